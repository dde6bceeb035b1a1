"""The optimizer update of an offloaded state, streamed through the device chunk by chunk.

The fp32 master weights and the optimizer state live in ``pinned_host`` memory. For each parameter the
update brings one chunk of its master weights and optimizer-state slices to the device (a slice of the
leading dimension, e.g. one layer of a stacked decoder, bounded by ``Offload.chunk_bytes``), runs the
optimizer on it, and sends the new values back, inside a ``lax.scan`` over the chunks: the device holds
one chunk's state at a time (XLA may prefetch the next), never the whole optimizer state. This is
ZeRO-R's constant-size buffer applied to ZeRO-Offload's update. The arithmetic is the on-device update's,
element for element: a parameter that is one chunk gets the same bits. Inside the chunk loop XLA may
rewrite a division by a scalar (Adam's bias correction) as a multiplication by its reciprocal, which
can move a result by an ulp; optimizers without such divisions (Lion, SGD) stay bitwise there too.

Any elementwise optax transformation streams (checked on its jaxpr: :mod:`._elementwise`); the chunk's
call sees the whole parameter tree, with the other parameters as empty slices, so masks and labels by
path or rank still apply.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec

from ._config import HOST, Offload
from ._elementwise import cross_element_op

_DEVICE = jax.memory.Space.Device
_HOST = jax.memory.Space.Host


class StreamedLayout(Protocol):
    """What the streamed update reads of a state's layout (:class:`zjax.StateLayout` has it all)."""

    @property
    def mesh(self) -> Mesh: ...

    @property
    def master(self) -> bool:
        """Whether the optimizer keeps fp32 master weights apart from the compute parameters."""
        ...

    @property
    def master_specs(self) -> Any:
        """The master weights' tree of ``PartitionSpec``."""
        ...

    @property
    def opt_owners(self) -> tuple[int | None, ...]:
        """For each optimizer-state leaf, the index of the parameter it mirrors, or ``None`` (a shared scalar)."""
        ...

    @property
    def offload(self) -> Offload: ...


def chunk_rows(shape: tuple[int, ...], spec: PartitionSpec, mesh_shape: dict[str, int], chunk_bytes: int) -> int:
    """Rows of the leading dimension per chunk (``shape[0]``: the leaf is one chunk).

    A leaf is cut only along a leading dimension that is not sharded (a slice is then local to every
    device) into the largest number of rows whose fp32 bytes per device fit ``chunk_bytes``.
    """
    if len(shape) < 2 or shape[0] <= 1 or (len(spec) and spec[0] is not None):
        return shape[0] if shape else 1
    split = 1
    for entry in tuple(spec)[1:]:
        for axis in (entry,) if isinstance(entry, str) else tuple(entry or ()):
            split *= mesh_shape[axis]
    row_bytes = 4 * math.prod(shape[1:]) // max(split, 1)
    most = max(1, chunk_bytes // max(row_bytes, 1))
    return max(d for d in range(1, shape[0] + 1) if shape[0] % d == 0 and d <= most)


def check_streamable(tx: Any, grads: Any, inner: Any, master: Any) -> None:
    """Raise ``ValueError`` if ``tx`` cannot update chunk by chunk (it mixes elements across a parameter)."""
    if callable(getattr(tx, "fused_apply", None)):
        return  # zjax.pallas.fused_adamw: elementwise by construction
    op = cross_element_op(lambda g, s, p: tx.update(g, s, p), grads, inner, master)
    if op is not None:
        raise ValueError(
            f"Plan(offload=...): the optimizer's update mixes elements of a parameter (its jaxpr has {op!r}, "
            f"e.g. a global-norm clip or a factored second moment), so it cannot stream through the device "
            f"chunk by chunk. Clip with Plan(clip_norm=...) instead of optax.clip_by_global_norm, use an "
            f"elementwise optimizer (adamw, lion, sgd, zjax.pallas.fused_adamw), or offload='none'."
        )


def _empty(x: Any) -> jax.Array:
    """A stand-in for a parameter that is not in this chunk: zero rows (a scalar for a scalar)."""
    return jnp.zeros((0, *x.shape[1:]) if x.ndim else (), x.dtype)


def streamed_update(
    layout: StreamedLayout,
    tx: Any,
    grads: Any,
    inner: Any,
    master: Any,
    *,
    inv_scale: jax.Array,
    finite: jax.Array | None,
    compute_dtype: Any,
) -> tuple[Any, Any, Any]:
    """``(new_master, new_inner, new_compute_params)`` with each piece placed where the layout keeps it.

    ``grads`` are on the device in the master layout, scaled by the loss scale (``inv_scale`` undoes it
    and may fold in a clipping factor); ``finite=False`` keeps everything unchanged (a skipped step).
    ``new_compute_params`` is ``None`` without master weights (the master *is* the parameters).
    """
    mesh = layout.mesh
    fused = getattr(tx, "fused_apply", None)
    g_leaves = jax.tree.leaves(grads)
    m_leaves, treedef = jax.tree.flatten(master)
    o_leaves = jax.tree.leaves(inner)
    owners = layout.opt_owners
    specs = jax.tree.leaves(layout.master_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    shared = [k for k, owner in enumerate(owners) if owner is None]  # step counts and other scalars
    master_home = _HOST if (layout.master or layout.offload.params) else _DEVICE
    param_home = _HOST if layout.offload.params else _DEVICE
    sizes = dict(mesh.shape)

    def run_chunk(i: int, g: jax.Array, m: jax.Array, own: list[jax.Array], shared_in: list[jax.Array]):
        """The optimizer on chunk ``(g, m, own)`` of parameter ``i``, the others as empty slices."""
        m = jax.device_put(m, _DEVICE)
        own = [jax.device_put(o, _DEVICE) for o in own]
        g_tree = [g if j == i else _empty(x) for j, x in enumerate(g_leaves)]
        m_tree = [m if j == i else _empty(x) for j, x in enumerate(m_leaves)]
        o_tree: list[Any] = []
        mine = iter(own)
        shared_it = iter(shared_in)
        for k, owner in enumerate(owners):
            if owner is None:
                o_tree.append(next(shared_it))
            elif owner == i:
                o_tree.append(next(mine))
            else:
                o_tree.append(_empty(o_leaves[k]))
        state = jax.tree.unflatten(jax.tree.structure(inner), o_tree)
        g_t, m_t = jax.tree.unflatten(treedef, g_tree), jax.tree.unflatten(treedef, m_tree)
        if fused is not None:
            new_m, new_state, cast = fused(
                g_t, state, m_t, compute_dtype=compute_dtype, inv_scale=inv_scale,
                apply=jnp.float32(1.0) if finite is None else finite, mesh=mesh, specs=layout.master_specs,
            )  # fmt: skip
        else:
            g_t = jax.tree.map(lambda x: x.astype(jnp.float32) * inv_scale, g_t)
            updates, new_state = tx.update(g_t, state, m_t)
            new_m = optax.apply_updates(m_t, updates)
            if finite is not None:  # a skipped step keeps the old values (cast below follows the master)
                new_m = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_m, m_t)
                new_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_state, state)
            cast = jax.tree.map(lambda x: x.astype(compute_dtype), new_m)
        new_o = jax.tree.leaves(new_state)
        out_m = jax.tree.leaves(new_m)[i]
        out_own = [new_o[k] for k, owner in enumerate(owners) if owner == i]
        out_shared = [new_o[k] for k in shared]
        return out_m, out_own, jax.tree.leaves(cast)[i], out_shared

    shared_dev = [jax.device_put(o_leaves[k], _DEVICE) for k in shared]
    new_m_leaves: list[Any] = []
    new_casts: list[Any] = []
    new_o_leaves: list[Any] = list(o_leaves)
    shared_out: list[Any] | None = None
    for i, (g, m) in enumerate(zip(g_leaves, m_leaves, strict=True)):
        own_idx = [k for k, owner in enumerate(owners) if owner == i]
        own = [o_leaves[k] for k in own_idx]
        rows = chunk_rows(tuple(m.shape), specs[i], sizes, layout.offload.chunk_bytes)
        if m.ndim and rows < m.shape[0]:
            n = m.shape[0] // rows

            def split(x, n=n, rows=rows):
                return x.reshape(n, rows, *x.shape[1:])

            def body(carry, xs, i=i):
                g_c, m_c, own_c = xs
                out_m, out_own, cast, out_shared = run_chunk(i, g_c, m_c, list(own_c), shared_dev)
                ys = (
                    jax.device_put(out_m, master_home),
                    [jax.device_put(o, _HOST) for o in out_own],
                    jax.device_put(cast, param_home),
                    out_shared,
                )
                return carry, ys

            xs = (split(g), split(m), [split(o) for o in own])
            _, (out_m, out_own, cast, out_shared) = jax.lax.scan(body, None, xs)
            out_m = out_m.reshape(m.shape)
            out_own = [o.reshape(x.shape) for o, x in zip(out_own, own, strict=True)]
            cast = cast.reshape(m.shape)
            out_shared = [s[-1] for s in out_shared]
        else:
            out_m, out_own, cast, out_shared = run_chunk(i, g, m, own, shared_dev)
            out_m = jax.device_put(out_m, master_home)
            out_own = [jax.device_put(o, _HOST) for o in out_own]
            cast = jax.device_put(cast, param_home)
        new_m_leaves.append(out_m)
        new_casts.append(cast)
        for k, o in zip(own_idx, out_own, strict=True):
            new_o_leaves[k] = o
        if shared_out is None:
            shared_out = out_shared
    for k, o in zip(shared, shared_out or [jax.device_put(o_leaves[k], _DEVICE) for k in shared], strict=True):
        new_o_leaves[k] = jax.device_put(o, _HOST)
    new_master = jax.tree.unflatten(treedef, new_m_leaves)
    new_inner = jax.tree.unflatten(jax.tree.structure(inner), new_o_leaves)
    return new_master, new_inner, (jax.tree.unflatten(treedef, new_casts) if layout.master else None)


__all__ = ["HOST", "chunk_rows", "check_streamable", "streamed_update"]
