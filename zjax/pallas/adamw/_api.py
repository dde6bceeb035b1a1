"""``fused_adamw``: mixed-precision AdamW that owns the fp32 master, m and v and updates them in one pass."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from ._config import FusedAdamWConfig
from ._kernel import NUM_SCALARS, adamw_kernel
from ._reference import Scalars, adamw_reference

Implementation = Literal["auto", "pallas", "xla"]
IMPLEMENTATIONS = ("auto", "pallas", "xla")


class FusedAdamWState(NamedTuple):
    """Step count and the fp32 first and second moments (shaped like the parameters)."""

    count: jax.Array  # type: ignore[assignment]  # optax names it count too
    mu: Any
    nu: Any


@dataclasses.dataclass(frozen=True)
class FusedAdamW:
    """A fused AdamW. Use it wherever zjax takes an optax transformation; it also speaks optax's
    ``init``/``update`` protocol (the reference math) for use outside a :class:`zjax.Plan`.

    Inside ``plan.train_step`` the fused path runs instead: per device, on its local shard (under
    ``shard_map``, so the optimizer state is never gathered), one kernel pass reads the compute-dtype
    gradient and the fp32 master, m, v once and writes master, m, v and the new compute copy once,
    unscaling by the loss scale, clipping and skipping non-finite steps on the way.
    """

    learning_rate: float | Callable[[jax.Array], jax.Array]
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 1e-4
    mask: Any = None
    implementation: Implementation = "auto"
    interpret: bool | None = None
    config: FusedAdamWConfig = FusedAdamWConfig()

    def __post_init__(self) -> None:
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"fused_adamw: unknown implementation {self.implementation!r}; valid names are {list(IMPLEMENTATIONS)}."
            )

    # -- optax protocol -------------------------------------------------------------------------

    def init(self, params: Any) -> FusedAdamWState:
        zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
        return FusedAdamWState(jnp.zeros((), jnp.int32), zeros, jax.tree.map(jnp.copy, zeros))

    def update(self, updates: Any, state: FusedAdamWState, params: Any = None):
        """optax protocol: returns ``(new_params - params, new_state)`` computed by the reference."""
        if params is None:
            raise ValueError("fused_adamw.update needs params (decoupled weight decay reads them).")
        master, state = self._reference_tree(updates, state, params, jnp.float32(1.0), jnp.float32(1.0))[:2]
        return jax.tree.map(lambda n, p: n - p, master, params), state

    # -- the fused path -------------------------------------------------------------------------

    def resolved_implementation(self) -> str:
        """``"auto"`` is the XLA path everywhere until a GPU measurement shows the kernel faster
        (``benchmarks/gpu_suite.py``); ``"pallas"`` asks for the kernel."""
        return "xla" if self.implementation == "auto" else self.implementation

    def _scalars(self, count: jax.Array, wd: float, inv_scale: jax.Array, apply: jax.Array) -> Scalars:
        t = (count + 1).astype(jnp.float32)
        lr = self.learning_rate(count) if callable(self.learning_rate) else self.learning_rate
        f = jnp.float32
        return Scalars(
            f(lr), f(self.b1), f(self.b2), f(self.eps), f(wd), 1 - f(self.b1) ** t, 1 - f(self.b2) ** t,
            f(inv_scale), f(apply),
        )  # fmt: skip

    def _decay(self, params: Any) -> list[float]:
        if self.mask is None:
            flags = [True] * len(jax.tree.leaves(params))
        else:
            mask = self.mask(params) if callable(self.mask) else self.mask
            flags = [bool(x) for x in jax.tree.leaves(mask)]
        return [self.weight_decay if f else 0.0 for f in flags]

    def _reference_tree(self, grads, state, master, inv_scale, apply, compute_dtype=jnp.float32):
        leaves, treedef = jax.tree.flatten(master)
        outs = [
            adamw_reference(self._scalars(state.count, wd, inv_scale, apply), g, p, m, v, compute_dtype)
            for g, p, m, v, wd in zip(
                jax.tree.leaves(grads), leaves, jax.tree.leaves(state.mu), jax.tree.leaves(state.nu),
                self._decay(master), strict=True,
            )
        ]  # fmt: skip
        unflat = [jax.tree.unflatten(treedef, [o[i] for o in outs]) for i in range(4)]
        count = state.count + jnp.asarray(apply, jnp.int32)
        return unflat[0], FusedAdamWState(count, unflat[1], unflat[2]), unflat[3]

    def fused_apply(
        self,
        grads: Any,
        state: FusedAdamWState,
        master: Any,
        *,
        compute_dtype: Any,
        inv_scale: jax.Array,
        apply: jax.Array,
        mesh: Any,
        specs: Any,
    ) -> tuple[Any, FusedAdamWState, Any]:
        """``(new_master, new_state, new_compute_params)``; all laid out by ``specs`` (the master specs).

        ``grads`` are in the compute dtype, scaled by the loss scale; ``inv_scale`` undoes that (and
        may fold in a clipping factor); ``apply=0`` keeps everything unchanged. ``mesh=None`` runs on
        whole leaves (a single device).
        """
        if self.resolved_implementation() == "xla":
            return self._reference_tree(grads, state, master, inv_scale, apply, compute_dtype)
        # interpret on CPU meshes; a mesh of GPU devices (real, or a deviceless compile's) gets the kernel
        platform = _platform(mesh)
        interpret = platform == "cpu" if self.interpret is None else self.interpret
        decay = self._decay(master)
        leaves, treedef = jax.tree.flatten(master)
        spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        scal = [self._scalars(state.count, wd, inv_scale, apply).as_array(NUM_SCALARS) for wd in decay]

        config = self.config

        def launch(s, g, p, m, v):
            return adamw_kernel(s, g, p, m, v, compute_dtype, config, interpret)

        def local(scal, g, p, m, v):
            outs: list[Any] = [None] * len(p)
            groups: dict[float, list[list[int]]] = {}
            for i, pi in enumerate(p):
                if pi.size == 0:  # a parameter left out of this call (a streamed update's other leaves)
                    outs[i] = (pi, m[i], v[i], pi.astype(compute_dtype))
                    continue
                if pi.size * 4 >= config.group_bytes:  # a big leaf: its own launch, no copy
                    o = launch(scal[i], g[i].reshape(-1), pi.reshape(-1), m[i].reshape(-1), v[i].reshape(-1))
                    outs[i] = tuple(x.reshape(pi.shape) for x in o)
                    continue
                chunks = groups.setdefault(decay[i], [[]])  # small leaves share buffers of <= group_bytes
                if sum(p[j].size for j in chunks[-1]) * 4 + pi.size * 4 > config.group_bytes:
                    chunks.append([])
                chunks[-1].append(i)
            for chunks in groups.values():
                for chunk in filter(None, chunks):

                    def cat(xs, chunk=chunk):
                        return jnp.concatenate([xs[j].reshape(-1) for j in chunk])

                    o = launch(scal[chunk[0]], cat(g), cat(p), cat(m), cat(v))
                    offset = 0
                    for j in chunk:
                        size = p[j].size
                        outs[j] = tuple(x[offset : offset + size].reshape(p[j].shape) for x in o)
                        offset += size
            return tuple(tuple(o[i] for o in outs) for i in range(4))

        if mesh is None:  # one device: the kernel on whole leaves
            update = local
        else:  # each device on its local shard: the optimizer state is never gathered
            tree_specs = tuple(spec_leaves)
            update = jax.shard_map(
                local,
                mesh=mesh,
                in_specs=((PartitionSpec(),) * len(scal), tree_specs, tree_specs, tree_specs, tree_specs),
                out_specs=(tree_specs,) * 4,
                check_vma=False,
            )
        new_p, new_m, new_v, new_c = update(
            tuple(scal), tuple(jax.tree.leaves(grads)), tuple(leaves), tuple(jax.tree.leaves(state.mu)),
            tuple(jax.tree.leaves(state.nu)),
        )  # fmt: skip
        count = state.count + jnp.asarray(apply, jnp.int32)
        return (
            jax.tree.unflatten(treedef, list(new_p)),
            FusedAdamWState(count, jax.tree.unflatten(treedef, list(new_m)), jax.tree.unflatten(treedef, list(new_v))),
            jax.tree.unflatten(treedef, list(new_c)),
        )


def fused_adamw(
    learning_rate: float | optax.Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    mask: Any = None,
    *,
    implementation: Implementation = "auto",
    interpret: bool | None = None,
    config: FusedAdamWConfig | None = None,
) -> FusedAdamW:
    """Mixed-precision AdamW in one memory pass (see :mod:`zjax.pallas.adamw`).

    Args:
      learning_rate: a float or an optax schedule of the step count.
      b1, b2, eps: Adam's constants (``eps`` outside the square root, as optax).
      weight_decay: decoupled weight decay.
      mask: a pytree of bools (or a function of the params returning one): decay only where True.
      implementation: ``"pallas"`` (the kernel), ``"xla"`` (the jnp reference) or ``"auto"`` (the XLA
        path until a GPU measurement shows the kernel faster).
      interpret: run the Pallas kernel in interpret mode (default: when the mesh's devices are CPUs).
      config: block size and launch parameters.

    Raises:
      ValueError: for an unknown implementation name, listing the valid ones.

    Example:
      >>> state = plan.init(init_fn, zjax.pallas.fused_adamw(3e-4, weight_decay=0.1), rng)
    """
    return FusedAdamW(
        learning_rate, b1, b2, eps, weight_decay, mask, implementation, interpret,
        FusedAdamWConfig() if config is None else config,
    )  # fmt: skip


def _platform(mesh: Any) -> str:
    """The platform of the devices the update runs on (a deviceless GPU compile's mesh says "gpu")."""
    if mesh is not None:
        return str(mesh.devices.flat[0].platform)
    return jax.default_backend()
