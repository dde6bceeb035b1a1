"""matplotlib figures: memory per device by category, communication by kind and mesh axis, and which
devices hold which shard of a leaf. ``matplotlib`` is optional (``pip install "zjax[notebook]"``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ..core._rows import spec_text


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError('zjax.notebook plots need matplotlib: pip install "zjax[notebook]"') from e
    return plt


def _label(est: Any, row: Any, many: bool) -> str:
    text = f"stage {row.stage}" + (f"\n{row.remat}" if row.remat not in ("-", "full") else "")
    text += f"\nx{row.accum}" if row.accum > 1 else ""
    text += f"\n{row.offload}" if row.offload != "none" else ""
    return text + (f"\n{est.backend}" if many else "")


def plot_memory(estimates: Any, ax: Any = None) -> Any:
    """Per-device memory of every planned row: ZeRO theory (params, optimizer, grads) beside the compiled
    state and temporaries. ``estimates``: one :class:`zjax.planner.Estimate` or several (e.g. the CPU
    and a GPU target's) drawn side by side. Returns the figure."""
    ests = list(estimates) if isinstance(estimates, Sequence) else [estimates]
    plt = _pyplot()
    rows = [(e, r) for e in ests for r in e.rows]
    if ax is None:
        _, ax = plt.subplots(figsize=(1.3 * len(rows) + 2.5, 3.6))
    largest = max([r.theory["total"] for _, r in rows] + [r.compiled["total"] for _, r in rows] + [1])
    unit, scale = ("GB", 1e9) if largest >= 1e9 else ("MB", 1e6) if largest >= 1e6 else ("KB", 1e3)
    x = np.arange(len(rows))
    width = 0.38
    theory = {"params": "#4c72b0", "optimizer": "#55a868", "grads": "#c44e52"}
    bottom = np.zeros(len(rows))
    for key, color in theory.items():
        values = np.array([r.theory[key] for _, r in rows]) / scale
        ax.bar(x - width / 2, values, width, bottom=bottom, color=color, label=f"theory: {key}")
        bottom += values
    bottom = np.zeros(len(rows))
    for key, color in (("state", "#8172b2"), ("temp", "#ccb974")):
        values = np.array([r.compiled[key] for _, r in rows]) / scale
        ax.bar(x + width / 2, values, width, bottom=bottom, color=color, label=f"compiled: {key}", hatch="//")
        bottom += values
    ax.set_xticks(x, [_label(e, r, len(ests) > 1) for e, r in rows], fontsize=8)
    ax.set_ylabel(f"{unit} per device")
    mesh = " ".join(f"{k}={v}" for k, v in ests[0].mesh.items() if v > 1)
    ax.set_title(f"{ests[0].model}: memory per device ({mesh}, {ests[0].precision})", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    ax.figure.tight_layout()
    return ax.figure


def plot_comm(estimate: Any) -> Any:
    """Collective volume per device per step of every row, by kind (left) and by mesh axes (right)."""
    plt = _pyplot()
    rows = estimate.rows
    fig, (left, right) = plt.subplots(1, 2, figsize=(2.2 * len(rows) + 3, 3.4))
    largest = max([r.comm.total_volume for r in rows] + [1])
    unit, scale = ("GB", 1e9) if largest >= 1e9 else ("MB", 1e6) if largest >= 1e6 else ("KB", 1e3)
    labels = [_label(estimate, r, False) for r in rows]
    for ax, parts, title in (
        (left, [r.comm.volume for r in rows], "by kind"),
        (right, [{",".join(k) or "none": v for k, v in r.comm.by_axes.items()} for r in rows], "by mesh axes"),
    ):
        keys = sorted({k for p in parts for k, v in p.items() if v})
        bottom = np.zeros(len(rows))
        for key in keys:
            values = np.array([p.get(key, 0) for p in parts]) / scale
            ax.bar(labels, values, bottom=bottom, label=key)
            bottom += values
        ax.set_title(f"communication {title}", fontsize=10)
        ax.set_ylabel(f"{unit} per device per step")
        ax.tick_params(axis="x", labelsize=8)
        if keys:
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _leaf(state: Any, path: str | None, which: str) -> tuple[str, tuple[int, ...], PartitionSpec]:
    layout = state.layout
    trees = {"params": layout.param_specs, "master": layout.master_specs, "grads": layout.grad_specs}
    if which not in trees:
        raise ValueError(f"plot_mesh: which={which!r} must be one of {sorted(trees)}.")
    specs = jax.tree.leaves(trees[which], is_leaf=lambda x: isinstance(x, PartitionSpec))
    leaves = [p.leaf for p in layout.params.placements]
    if path is None:  # the largest parameter
        i = int(np.argmax([np.prod(leaf.shape) for leaf in leaves]))
    else:
        matches = [i for i, leaf in enumerate(leaves) if leaf.path == path]
        if not matches:
            raise ValueError(f"plot_mesh: no parameter {path!r}; paths are {[leaf.path for leaf in leaves][:8]}...")
        i = matches[0]
    return leaves[i].path, tuple(leaves[i].shape), specs[i]


def plot_mesh(state: Any, path: str | None = None, which: str = "master", ax: Any = None) -> Any:
    """The mesh as a grid of devices (rows: pp x replica x dp, columns: tp), each coloured and labelled by
    the shard of parameter ``path`` (default: the largest) it holds in ``which`` (``"params"``,
    ``"master"`` or ``"grads"``). Devices that share a colour hold the same bytes."""
    plt = _pyplot()
    name, shape, spec = _leaf(state, path, which)
    mesh = state.layout.mesh
    index_map = NamedSharding(mesh, spec).devices_indices_map(shape)
    shards: dict[Any, int] = {}
    ids: dict[int, int] = {}
    for device, index in index_map.items():
        key = tuple((s.start, s.stop) for s in index)
        ids[int(getattr(device, "id"))] = shards.setdefault(key, len(shards))  # noqa: B009 - typed as Device?
    sizes = dict(mesh.shape)
    cols = sizes.get("tp", 1)
    grid = mesh.devices.reshape(-1, cols)
    if ax is None:
        _, ax = plt.subplots(figsize=(1.2 * cols + 2.5, 0.45 * grid.shape[0] + 1.6))
    colors = np.array([[ids[d.id] for d in row] for row in grid])
    ax.imshow(colors, cmap="tab20", vmin=0, vmax=max(19, len(shards) - 1), aspect="auto")
    for r, row in enumerate(grid):
        for c, device in enumerate(row):
            ax.text(c, r, f"dev {device.id}\nshard {ids[device.id]}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(cols), [f"tp {c}" for c in range(cols)])
    ax.set_yticks(range(grid.shape[0]), [f"row {r}" for r in range(grid.shape[0])], fontsize=7)
    ax.set_title(
        f"{which} of {name} {shape}: {spec_text(spec)}, {len(shards)} distinct shard(s) on {mesh.size} devices",
        fontsize=9,
    )
    ax.figure.tight_layout()
    return ax.figure
