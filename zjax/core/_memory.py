"""Per-device memory: the ZeRO formula beside the numbers of the compiled step."""

from __future__ import annotations

import dataclasses
import html
import math
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from ..sharding._batch import batch_shardings
from ..sharding._mesh import zero_size
from ..sharding._rules import spec_axes
from ..stages._layout import Unsharded
from ..stages._placement import shard_count
from ._html import fmt_bytes, mesh_text, table

if TYPE_CHECKING:
    from ._precision import Precision
    from ._state import TrainState

CATEGORIES = ("params", "master", "optimizer", "gradients")
LABELS = {
    "params": "compute params",
    "master": "fp32 master weights",
    "optimizer": "optimizer state",
    "gradients": "gradients",
}


def _itemsize(x: Any) -> int:
    """Bytes per element as jax stores it (a float64 numpy batch becomes float32 without x64)."""
    dtype = getattr(x, "dtype", None)
    return np.dtype(jax.dtypes.canonicalize_dtype(np.result_type(x) if dtype is None else dtype)).itemsize


def _nbytes(x: Any) -> int:
    return int(math.prod(np.shape(x))) * _itemsize(x)


def _shard_bytes(x: Any, sharding: Any) -> int:
    shape = sharding.shard_shape(tuple(np.shape(x))) if sharding is not None else tuple(np.shape(x))
    return int(math.prod(shape)) * _itemsize(x)


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Per-device bytes by category. ``theory`` is the ZeRO formula; ``compiled`` the compiler's numbers.

    ``theory`` counts ``psi / tp`` model-parallel parameters per device (the tp-sharded leaves divided by
    their tp size) times the bytes per parameter of each category, divided by the dp size ``N`` where
    the stage shards that category. ``compiled`` reads the compiled step: state bytes per category from
    the shardings the compiler chose for its arguments, and the totals from ``memory_analysis()``.
    """

    stage: int
    precision: str
    mesh: dict[str, int]
    accum_steps: int
    num_params: int
    theory: dict[str, int]
    compiled: dict[str, int]
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    batch_bytes: int
    unsharded: tuple[Unsharded, ...]
    flops: float | None = None  # per device, from cost_analysis (a scanned layer's body counted once)
    params_per_group: float = 0.0  # parameters per model-parallel (tp x pp) group: psi / tp for tp-split leaves
    host_bytes: int = 0  # host memory the program uses per device (host_* of memory_analysis: offloaded buffers)
    offloaded_bytes: int = 0  # state the layout keeps in pinned host memory, per device (from its placements)
    # a mixture of experts: the formula's persistent state per device of its "experts" and its "dense" parameters
    state_by_group: dict[str, int] = dataclasses.field(default_factory=dict)
    model_state_bytes: int = 0  # the model's non-trainable state per device (router biases, fp8 amax histories)

    @property
    def state_theory(self) -> int:
        """Persistent state per device by the formula: params + master + optimizer (and model state)."""
        return sum(self.theory[k] for k in ("params", "master", "optimizer")) + self.model_state_bytes

    @property
    def state_compiled(self) -> int:
        """Persistent state per device in the compiled step: its argument bytes less the batch."""
        return self.argument_bytes - self.batch_bytes

    @property
    def peak_bytes(self) -> int:
        """``argument + output - alias + temp`` (``peak_memory_in_bytes`` ignores temps on CPU)."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def device_peak_bytes(self) -> int:
        """The peak in device memory. XLA:CPU drops memory kinds and counts host-placed state as device
        arguments (``host_*`` is then 0): those bytes, computed from the layout's placements, come off.
        XLA:GPU (deviceless too) honours them and already leaves them out (``host_*`` > 0)."""
        return self.peak_bytes - (self.offloaded_bytes if not self.host_bytes else 0)

    def _repr_html_(self) -> str:
        return memory_report_html(self)

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "precision": self.precision,
            "mesh": dict(self.mesh),
            "accum_steps": self.accum_steps,
            "num_params": self.num_params,
            "theory": dict(self.theory),
            "compiled": dict(self.compiled),
            "state_bytes_per_device": {"theory": self.state_theory, "compiled": self.state_compiled},
            "temp_bytes_per_device": self.temp_bytes,
            "argument_bytes": self.argument_bytes,
            "output_bytes": self.output_bytes,
            "alias_bytes": self.alias_bytes,
            "peak_bytes": self.peak_bytes,
            "flops": self.flops,
            "host_bytes": self.host_bytes,
            "offloaded_bytes": self.offloaded_bytes,
            "device_peak_bytes": self.device_peak_bytes,
            "dp_replicated": [dataclasses.asdict(u) for u in self.unsharded],
            "state_by_group": dict(self.state_by_group),
            "model_state_bytes": self.model_state_bytes,
        }

    def __str__(self) -> str:
        mesh = " ".join(f"{k}={v}" for k, v in self.mesh.items())
        lines = [
            f"memory per device: ZeRO stage {self.stage}, {self.precision}, mesh {mesh}, "
            f"{self.num_params:,} params" + (f", accum {self.accum_steps}" if self.accum_steps > 1 else ""),
            f"  {'category':<22}{'theory':>14}{'compiled':>14}",
        ]
        for key in CATEGORIES:
            compiled = self.compiled.get(key)
            note = "" if compiled is not None else "   (inside temporaries)"
            lines.append(f"  {LABELS[key]:<22}{fmt_bytes(self.theory[key]):>14}{fmt_bytes(compiled):>14}{note}")
        if self.model_state_bytes:
            shown = fmt_bytes(self.model_state_bytes)
            lines.append(f"  {'model state':<22}{shown:>14}{shown:>14}")
        lines += [
            f"  {'persistent state':<22}{fmt_bytes(self.state_theory):>14}{fmt_bytes(self.state_compiled):>14}",
            f"  {'temporaries':<22}{'':>14}{fmt_bytes(self.temp_bytes):>14}",
            f"  {'peak (arg+out-alias+temp)':<36}{fmt_bytes(self.peak_bytes):>14}",
        ]
        if self.offloaded_bytes:
            lines += [
                f"  {'in pinned host memory (computed)':<36}{fmt_bytes(self.offloaded_bytes):>14}",
                f"  {'device peak':<36}{fmt_bytes(self.device_peak_bytes):>14}",
            ]
        if self.flops is not None:
            lines.append(f"  {'step FLOPs (scan body once)':<36}{self.flops:>14.3e}")
        if self.unsharded:
            shown = ", ".join(f"{u.path} {u.shape}" for u in self.unsharded[:6])
            more = f" and {len(self.unsharded) - 6} more" if len(self.unsharded) > 6 else ""
            lines.append(f"  replicated over dp (no divisible dim): {shown}{more}")
        return "\n".join(lines)


def memory_report_html(report: MemoryReport) -> str:
    """ZeRO's formula beside the compiled program's numbers, per category and in total (a Jupyter table)."""
    rows = []
    for key in CATEGORIES:
        compiled = report.compiled.get(key)
        rows.append(
            [LABELS[key], fmt_bytes(report.theory[key]), fmt_bytes(compiled) if compiled is not None else "in temp"]
        )
    if report.model_state_bytes:
        rows.append(["model state", fmt_bytes(report.model_state_bytes), fmt_bytes(report.model_state_bytes)])
    rows += [
        ["persistent state", fmt_bytes(report.state_theory), fmt_bytes(report.state_compiled)],
        ["temporaries", "", fmt_bytes(report.temp_bytes)],
        ["peak (arg + out - alias + temp)", "", fmt_bytes(report.peak_bytes)],
    ]
    if report.offloaded_bytes:
        rows += [["in pinned host memory", "", fmt_bytes(report.offloaded_bytes)],
                 ["device peak", "", fmt_bytes(report.device_peak_bytes)]]  # fmt: skip
    caption = (
        f"memory per device: ZeRO stage {report.stage}, {report.precision}, {mesh_text(report.mesh)}, "
        f"{report.num_params:,} params"
    )
    out = table(["category", "theory", "compiled"], rows, caption, numeric=(1, 2))
    if report.unsharded:
        items = "".join(f"<li>{html.escape(u.path)} {u.shape}: {html.escape(u.reason)}</li>" for u in report.unsharded)
        out += f"<div style='font:12px monospace'>replicated over dp:<ul>{items}</ul></div>"
    return out


def theory_bytes(state: TrainState, precision: Precision, accum_steps: int = 1) -> tuple[int, dict[str, int]]:
    """The ZeRO formula per device for ``state`` (laid out: its layout gives the mesh and the stage) trained in
    ``precision``: (parameter count, bytes by category)."""
    psi, _, theory, _ = _theory(state, precision, accum_steps)
    return psi, theory


def _theory(
    state: TrainState, precision: Precision, accum_steps: int
) -> tuple[int, float, dict[str, int], dict[str, int]]:
    mesh, stage = state.layout.mesh, state.layout.stage
    sizes = dict(mesh.shape)
    layout = state.layout.params
    psi = sum(int(math.prod(p.leaf.shape)) for p in layout.placements)
    # per parameter: its elements per device after model parallelism (tp, an expert's ep), before ZeRO's split,
    # and ZeRO's N for it (dp x ep x cp; an expert, split over ep already: dp x cp; x replica with hpZ)
    groups = [
        (
            math.prod(p.leaf.shape) / shard_count(p.compute, sizes),
            zero_size(mesh, spec_axes(p.compute), layout.hierarchical),
        )
        for p in layout.placements
    ]
    psi_mp = sum(numel for numel, _ in groups)
    inner_bytes = sum(_nbytes(x) for x in jax.tree.leaves(state.opt_state.inner))
    opt_per_param = inner_bytes / psi if psi else 0.0
    grad_bytes = 4 if accum_steps > 1 else precision.compute_bytes  # accumulation runs in fp32
    master_bytes = 4 if state.layout.master else 0
    # without a compute copy (Plan(compute_copy=False)) the parameters are the fp32 weights themselves
    param_bytes = precision.compute_bytes if state.layout.master or not precision.master_weights else 4

    def per_device(bytes_per_param: float, sharded: bool, pick=lambda i: True) -> int:
        return round(
            sum(numel * bytes_per_param / (n if sharded else 1) for i, (numel, n) in enumerate(groups) if pick(i))
        )

    def state_of(pick) -> int:
        return (
            per_device(param_bytes, stage.shard_parameters, pick)
            + per_device(master_bytes, stage.shard_optimizer, pick)
            + per_device(opt_per_param, stage.shard_optimizer, pick)
        )

    theory = {
        "params": per_device(param_bytes, stage.shard_parameters),
        "master": per_device(master_bytes, stage.shard_optimizer),
        "optimizer": per_device(opt_per_param, stage.shard_optimizer),
        "gradients": per_device(grad_bytes, stage.shard_gradients),
    }
    # a mixture of experts' parameters carry the logical axis name "expert" (zjax.models.MoE)
    expert = [p.leaf.names is not None and "expert" in p.leaf.names for p in layout.placements]
    by_group = (
        {"experts": state_of(lambda i: expert[i]), "dense": state_of(lambda i: not expert[i])} if any(expert) else {}
    )
    return psi, psi_mp, theory, by_group


def memory_report(
    state: TrainState, batch: Any, compiled: Any, *, precision: Precision, accum_steps: int
) -> MemoryReport:
    """Per-device memory of ``compiled``, a train step compiled for ``(state, batch)`` with ``accum_steps``
    microbatches in ``precision``. The state's layout gives the mesh and the stage
    (:meth:`zjax.TrainStep.memory_report` compiles the step and calls this)."""
    if state.layout is None:
        raise ValueError("memory_report: the state has no layout; build it with plan.init or plan.abstract_state.")
    mesh = state.layout.mesh
    analysis = compiled.memory_analysis()
    state_shardings = compiled.input_shardings[0][0]

    def category(tree: Any, shardings: Any) -> int:
        return sum(_shard_bytes(x, s) for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True))

    opt = state.opt_state
    compiled_bytes = {
        "params": category(state.params, state_shardings.params),
        "master": 0 if opt.master is None else category(opt.master, state_shardings.opt_state.master),
        "optimizer": category(opt.inner, state_shardings.opt_state.inner)
        + category((state.step, state.loss_scale), (state_shardings.step, state_shardings.loss_scale)),
    }
    batch_bytes = sum(
        _shard_bytes(x, s)
        for x, s in zip(jax.tree.leaves(batch), jax.tree.leaves(batch_shardings(batch, mesh)), strict=True)
    )
    psi, psi_mp, theory, by_group = _theory(state, precision, accum_steps)
    # host-placed state per device, from the layout (a deviceless mesh reports no memory kinds)
    placed, offload = state.layout.state_shardings(state.tx), state.layout.offload
    host_parts = [(state.opt_state, placed.opt_state)] if offload.optimizer else []
    host_parts += [(state.params, placed.params)] if offload.params else []
    offloaded = sum(category(tree, shardings) for tree, shardings in host_parts)
    return MemoryReport(
        stage=state.layout.stage.level,
        precision=precision.name,
        mesh={k: int(v) for k, v in mesh.shape.items()},
        accum_steps=accum_steps,
        num_params=psi,
        theory=theory,
        compiled=compiled_bytes,
        argument_bytes=int(analysis.argument_size_in_bytes),
        output_bytes=int(analysis.output_size_in_bytes),
        alias_bytes=int(analysis.alias_size_in_bytes),
        temp_bytes=int(analysis.temp_size_in_bytes),
        batch_bytes=batch_bytes,
        unsharded=tuple(state.layout.unsharded),
        flops=_flops(compiled),
        params_per_group=psi_mp,
        host_bytes=int(
            getattr(analysis, "host_argument_size_in_bytes", 0)
            + getattr(analysis, "host_output_size_in_bytes", 0)
            - getattr(analysis, "host_alias_size_in_bytes", 0)
            + getattr(analysis, "host_temp_size_in_bytes", 0)
        ),
        offloaded_bytes=offloaded,
        state_by_group=by_group,
        model_state_bytes=category(state.model_state, state_shardings.model_state) if state.model_state else 0,
    )


def _flops(compiled: Any) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - a deviceless GPU compile has no client (zjax.planner reads it otherwise)
        return None
    if isinstance(cost, list):  # older jax returned one dict per program
        cost = cost[0] if cost else None
    return float(cost["flops"]) if cost and "flops" in cost else None
