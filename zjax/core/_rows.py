"""Per-leaf rows of a training state's layout (specs, bytes per device, replication) and their HTML table."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ..sharding._axes import DATA_AXES
from ._html import fmt_bytes, mesh_text, table


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def spec_text(spec: PartitionSpec) -> str:
    """A spec as text, ``[dp, -]``; ``replicated`` for an empty one."""
    parts = []
    for entry in spec:
        if entry is None:
            parts.append("-")
        elif isinstance(entry, str):
            parts.append(entry)
        else:
            parts.append("(" + ",".join(entry) + ")")
    return "[" + ", ".join(parts) + "]" if parts else "replicated"


def _axes(spec: PartitionSpec) -> set[str]:
    out: set[str] = set()
    for entry in spec:
        if entry is not None:
            out.update((entry,) if isinstance(entry, str) else entry)
    return out


def _per_device(mesh: Any, spec: PartitionSpec, shape: tuple[int, ...], itemsize: int) -> int:
    return math.prod(NamedSharding(mesh, spec).shard_shape(shape)) * itemsize


@dataclasses.dataclass(frozen=True)
class LeafRow:
    """One parameter: where its compute copy, master, optimizer moments and gradient live.

    ``bytes`` are per device by category (``None`` when the state's dtypes are unknown, e.g. a bare
    layout); ``replication`` is how many devices hold each byte of the master weights; ``unsharded``
    the bytes per device that stay replicated over the data axes although the stage shards them.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    params: str
    master: str
    moments: str
    grads: str
    replication: int
    bytes: dict[str, int] | None
    unsharded: int
    reason: str | None

    @property
    def total(self) -> int:
        return sum((self.bytes or {}).values())


def layout_rows(layout: Any, state: Any = None) -> list[LeafRow]:
    """Rows for every parameter of ``layout`` (a :class:`zjax.StateLayout`); with ``state`` (concrete or
    abstract), bytes per device from its dtypes."""
    mesh = layout.mesh
    sizes = dict(mesh.shape)
    spec = lambda tree: jax.tree.leaves(tree, is_leaf=_is_spec)  # noqa: E731
    param_specs, master_specs, grad_specs = spec(layout.param_specs), spec(layout.master_specs), spec(layout.grad_specs)
    owned: dict[int, list[int]] = {}
    for k, owner in enumerate(layout.opt_owners):
        if owner is not None:
            owned.setdefault(owner, []).append(k)
    params = jax.tree.leaves(state.params) if state is not None else None
    opt = jax.tree.leaves(state.opt_state.inner) if state is not None else None
    data = [a for a in DATA_AXES if sizes.get(a, 1) > 1]
    rows = []
    for i, placement in enumerate(layout.params.placements):
        leaf = placement.leaf
        moments = [layout.opt_specs[k] for k in owned.get(i, [])]
        replication = mesh.size // math.prod(sizes[a] for a in _axes(master_specs[i]))
        dtype = str(np.dtype(params[i].dtype)) if params is not None else str(np.dtype(leaf.dtype))
        sizes_by_cat = None
        if params is not None and opt is not None:
            item = np.dtype(params[i].dtype).itemsize
            sizes_by_cat = {
                "params": _per_device(mesh, param_specs[i], leaf.shape, item),
                "master": _per_device(mesh, master_specs[i], leaf.shape, 4) if layout.master else 0,
                "moments": sum(
                    _per_device(mesh, layout.opt_specs[k], leaf.shape, np.dtype(opt[k].dtype).itemsize)
                    for k in owned.get(i, [])
                ),
                "grads": _per_device(mesh, grad_specs[i], leaf.shape, item),
            }
        unsharded = 0
        if placement.reason and layout.stage.shard_optimizer and not set(data) & _axes(master_specs[i]):
            unsharded = sum(v for k, v in (sizes_by_cat or {}).items() if k != "params")
        rows.append(
            LeafRow(
                path=leaf.path,
                shape=tuple(leaf.shape),
                dtype=dtype,
                params=spec_text(param_specs[i]),
                master=spec_text(master_specs[i]) if layout.master else "(params)",
                moments=", ".join(sorted({spec_text(s) for s in moments})) or "-",
                grads=spec_text(grad_specs[i]),
                replication=replication,
                bytes=sizes_by_cat,
                unsharded=unsharded,
                reason=placement.reason,
            )
        )
    return rows


def layout_html(layout: Any, state: Any = None) -> str:
    """Every parameter: shape, dtype, the spec of its params / master / moments / grads, bytes per device."""
    rows = layout_rows(layout, state)
    sized = state is not None
    headers = ["path", "shape", "dtype", "params", "master", "moments", "grads", "replicas"]
    if sized:
        headers += ["bytes/device", "unsharded"]
    body = []
    for r in rows:
        line = [r.path, "x".join(map(str, r.shape)) or "()", r.dtype, r.params, r.master, r.moments, r.grads,
                r.replication]  # fmt: skip
        if sized:
            line += [fmt_bytes(r.total), fmt_bytes(r.unsharded) if r.unsharded else ""]
        body.append(line)
    if sized:
        body.append(["total", "", "", "", "", "", "", "", fmt_bytes(sum(r.total for r in rows)),
                     fmt_bytes(sum(r.unsharded for r in rows))])  # fmt: skip
    caption = (
        f"ZeRO stage {layout.stage.level} on {mesh_text(dict(layout.mesh.shape))}, {len(rows)} parameters"
        + (f", offload {layout.offload.name}" if layout.offload.enabled else "")
        + ("; bytes per device: params + master + moments + grads" if sized else "")
        + "; replicas = devices holding each byte of the master weights"
    )
    return table(headers, body, caption, numeric=(7, 8, 9), bold_last=sized)
