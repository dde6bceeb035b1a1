"""What the planner says: a :class:`Row` per compiled configuration, an :class:`Estimate` of them, as text and HTML."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..core._html import fmt_bytes, mesh_text, table
from ._hlo import Communication
from ._table import SEP, text_table
from ._timeline import Timeline

SCHEDULER_MEMORY_SHARE = 0.8
"""The share of a GPU's memory XLA:GPU's scheduler plans a step against (jaxlib 0.10.2 logs it as the
"base limit": 67,954,383,257 bytes for the H100 target's 84,942,979,072)."""


@dataclasses.dataclass(frozen=True)
class Row:
    """One compiled configuration: bytes per device (theory and compiled) and communication per step."""

    stage: int
    remat: str
    accum: int
    theory: dict[str, int]
    compiled: dict[str, int]
    comm: Communication
    comm_psi: float  # data-parallel (dp, replica) volume / (psi per model-parallel group x compute bytes)
    compile_seconds: float
    backend: str = "cpu"  # the compiler that produced the numbers: "cpu" (simulated devices) or "gpu"
    device_kind: str = "cpu"
    flops: float | None = None  # per device per step, XLA's cost analysis of the compiled program
    bytes_accessed: float | None = None
    offload: str = "none"
    offloaded: int = 0  # state bytes per device in pinned host memory (computed from the plan's placements)
    device_memory: int | None = None  # the GPU target's memory per device (None: XLA:CPU)
    schedule: str | None = None  # the pipeline schedule (pp > 1)
    bubble: tuple[float, ...] = ()  # per pipeline stage: idle ticks / ticks of the schedule's table the step runs
    ticks: int = 0  # the table's ticks (the pipeline loop's trip count)
    in_flight: tuple[int, ...] = ()  # per pipeline stage: the most microbatch inputs it keeps (its activations)
    bubble_time: tuple[float, ...] = ()  # per pipeline stage: its idle share of the step's time (action_flops)
    action_flops: dict[str, float] = dataclasses.field(default_factory=dict)  # a table schedule's F, B, W each
    flops_per_step: float | None = None  # per device: every matrix product times its executions (loops' trips)
    mesh: dict[str, int] = dataclasses.field(default_factory=dict)  # the mesh it was compiled for
    # a mixture of experts: the formula's persistent state per device of its "experts" and "dense" parameters
    state_by_group: dict[str, int] = dataclasses.field(default_factory=dict)
    wire: str = ""  # what crosses the data axes (:func:`wire_dtypes`): the row's quantized_comm / reduce_dtype
    compute_copy: bool = True  # Plan(compute_copy=...): a compute-dtype copy of the parameters beside the fp32 master
    hpz: bool = False  # Plan(hpz=True): ZeRO++'s hierarchical partitioning (state over replica x dp)
    timeline: Timeline | None = None  # a GPU target's roofline walk over the schedule (zjax.planner._timeline)

    @property
    def over_memory(self) -> bool:
        """The step's device peak exceeds the memory XLA:GPU's latency-hiding scheduler plans against
        (:data:`SCHEDULER_MEMORY_SHARE` of the target's). The scheduler then trades overlap for memory (it
        serializes collectives), so ``exposed`` is not what a step that fits would show (measured:
        Llama-2-7B stage 0 on 64 x H100, peak 108.6 GB, exposes all 26.95 GB of its gradient all-reduces;
        the same step for 64 x H200 exposes none). An offloaded row counts its host state too: a deviceless
        compile drops memory kinds, so its scheduler planned with that state on the device."""
        if self.device_memory is None:
            return False
        return self.compiled["total"] + self.offloaded > SCHEDULER_MEMORY_SHARE * self.device_memory

    @property
    def pcie_bytes(self) -> int:
        """Host <-> device bytes per device per step, each direction: the offloaded state comes in for the
        update and goes back (computed; a deviceless compile drops memory kinds)."""
        return self.offloaded

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "mesh": dict(self.mesh),
            "state_by_group": dict(self.state_by_group),
            "comm_all_to_all_by_axes": {",".join(k) or "none": v for k, v in self.comm.all_to_all_by_axes.items()},
            "remat": self.remat,
            "accum": self.accum,
            "theory": dict(self.theory),
            "compiled": dict(self.compiled),
            "comm_bytes": dict(self.comm.volume),
            "comm_wire_bytes": dict(self.comm.wire),
            "comm_psi": round(self.comm_psi, 4),
            "wire_dtypes": self.wire,
            "compute_copy": self.compute_copy,
            "hpz": self.hpz,
            "comm_by_axes": {",".join(k) or "none": v for k, v in self.comm.by_axes.items()},
            "comm_overlapped_by_axes": {",".join(k) or "none": v for k, v in self.comm.overlapped_by_axes.items()},
            "comm_overlapped_bytes": self.comm.overlapped_volume,
            "comm_exposed_bytes": self.comm.exposed_volume,
            "over_device_memory": self.over_memory,
            "comm_cross_replica_bytes": self.comm.volume_across("replica"),
            "compile_seconds": round(self.compile_seconds, 2),
            "backend": self.backend,
            "device_kind": self.device_kind,
            "pipeline": None
            if self.schedule is None
            else {
                "schedule": self.schedule,
                "ticks": self.ticks,
                "bubble": max(self.bubble),
                "bubble_per_stage": [round(b, 4) for b in self.bubble],
                "inputs_kept_per_stage": list(self.in_flight),
                "bubble_time": max(self.bubble_time) if self.bubble_time else None,
                "bubble_time_per_stage": [round(b, 4) for b in self.bubble_time],
                "action_flops": dict(self.action_flops),
            },
            "flops": self.flops,
            "flops_per_step": self.flops_per_step,
            "bytes_accessed": self.bytes_accessed,
            "timeline": None if self.timeline is None else self.timeline.to_dict(),
            "offload": {
                "name": self.offload,
                "host_bytes_per_device": self.offloaded,
                "pcie_to_device_bytes_per_step": self.pcie_bytes,
                "pcie_to_host_bytes_per_step": self.pcie_bytes,
                "source": "computed from the plan's placements; compiled.total is device memory (on XLA:CPU, "
                "which counts host arguments as device ones, the compile's peak less these)",
            },
        }


def _unit(largest: float) -> tuple[str, float]:
    return ("GB", 1e9) if largest >= 1e9 else ("MB", 1e6) if largest >= 1e6 else ("KB", 1e3)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The planner's answer for one model, mesh and precision: one :class:`Row` per configuration."""

    model: str
    params: int
    mesh: dict[str, int]
    precision: str
    batch_size: int
    rows: tuple[Row, ...]
    backend: str = "cpu"
    device_kind: str = "cpu"
    show_timeline: bool = False  # print each row's roofline walk (compute and wait, ms: zjax.planner._timeline)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "params": self.params,
            "mesh": dict(self.mesh),
            "precision": self.precision,
            "batch_size": self.batch_size,
            "backend": self.backend,
            "device_kind": self.device_kind,
            "rows": [r.to_dict() for r in self.rows],
        }

    def _repr_html_(self) -> str:
        return estimate_html(self)

    def __str__(self) -> str:
        mesh = " ".join(f"{k}={v}" for k, v in self.mesh.items())
        largest = max([r.theory["total"] for r in self.rows] + [r.compiled["total"] for r in self.rows] + [1])
        unit, scale = _unit(largest)

        def f(n: float) -> str:
            return f"{n / scale:,.3f}"

        compiler = (
            f"compiled by XLA:GPU for {self.device_kind} (deviceless)"
            if self.backend == "gpu"
            else "compiled by XLA:CPU on simulated devices (temporaries are CPU figures: bf16 upcast to f32)"
        )
        head = (
            f"{self.model}: {self.params:,} params, mesh {mesh}, {self.precision}, global batch {self.batch_size}"
            f" -- {compiler}\n{unit} per device; comm = collective volume per step (ZeRO counting); x psi = "
            "data-parallel comm / (params per model-parallel group x compute bytes)"
        )
        if self.backend == "gpu":
            head += "; exposed = comm the scheduler did not overlap with compute"
            if any(r.over_memory for r in self.rows):
                head += (
                    f" (* the step exceeds the memory XLA's scheduler plans against, {SCHEDULER_MEMORY_SHARE:.0%} of "
                    "the GPU's: it then gives up overlap to save memory, so a step that fits exposes less)"
                )
        offloaded = any(r.offloaded for r in self.rows)
        if offloaded:
            head += (
                "; offload rows: total = device memory, host = state in pinned host memory and pcie = its "
                "bytes each way per step (both from the plan's placements)"
            )
        gpu = self.backend == "gpu"
        hsdp = self.mesh.get("replica", 1) > 1
        if hsdp:
            head += "; x-replica = the part of comm that crosses replica groups (nodes)"
        experts = any(r.state_by_group for r in self.rows)
        if experts:
            head += (
                "; experts / dense = the formula's state of the experts (ZeRO over dp x cp, split over ep) and of the "
                "rest (ZeRO over dp x ep x cp); a2a = all-to-all volume (the tokens' dispatch over ep)"
            )
        piped = any(r.schedule for r in self.rows)
        if piped:
            head += (
                "; bubble = the most idle ticks of a pipeline stage / ticks, on the schedule's table the step runs; "
                "pp = comm over pp (stage-to-stage messages); temp = the busiest stage's"
            )
        quant = len({r.wire for r in self.rows if r.stage == 3}) > 1 or any("int" in r.wire for r in self.rows)
        if quant:
            ints = "int8, int4" if any("int4" in r.wire for r in self.rows) else "int8"
            head += (
                f"; wire = what the data-parallel gradients and stage 3's weights cross in ({ints}: ZeRO++'s blocks, "
                "fp32 scales included in comm"
                + ("; @B: one scale per B values, else per 256" if any("@" in r.wire for r in self.rows) else "")
                + ")"
            )
        copies = any(not r.compute_copy for r in self.rows)
        if copies:
            head += (
                "; copy = whether the state keeps the parameters in the compute dtype beside the fp32 master (no: "
                "Plan(compute_copy=False), each shard cast before its gather; params = the fp32 weights)"
            )
        meshes = len({mesh_text(r.mesh) for r in self.rows if r.mesh}) > 1  # a search over ep or cp
        if meshes:
            head += "; mesh = the row's own (the search took ep or cp out of dp)"
        columns = [("stage", ">"), ("remat", "<"), ("acc", ">")] + ([("mesh", "<")] if meshes else [])
        columns += [("wire dtype", "<")] if quant else []
        columns += [("copy", "<")] if copies else []
        hpz = any(r.hpz for r in self.rows)
        if hpz:
            head += (
                "; hpz = ZeRO++'s hierarchical partitioning (Plan(hpz=True): state split over replica x dp, the "
                "per-layer weight gathers inside a node)"
            )
        columns += [("hpz", "<")] if hpz else []
        columns += [(SEP, "<")]
        columns += [(name, ">") for name in ("params", "optim", "grads", "theory")] + [(SEP, "<")]
        columns += [(name, ">") for name in ("state", "temp", "total")] + [(SEP, "<")]
        columns += [(name, ">") for name in ("comm", "x psi", "wire")]
        columns += ([("exposed", ">")] if gpu else []) + [("compile", ">")]
        columns += [("x-replica", ">")] if hsdp else []
        columns += [("schedule", "<"), ("bubble", ">"), ("pp", ">")] if piped else []
        columns += [("offload", "<"), ("host", ">"), ("pcie", ">")] if offloaded else []
        columns += [("experts", ">"), ("dense", ">"), ("a2a", ">")] if experts else []
        timed = self.show_timeline and all(r.timeline is not None for r in self.rows)
        links = self.rows[0].timeline.links if timed and self.rows[0].timeline is not None else None
        if timed and links is not None:
            head += (
                "; compute / wait = ms per step at the GPU's peak FLOP/s and HBM bandwidth, and ms it stands still "
                f"for collectives at {links.intra / 1e9:.0f} GB/s per GPU inside a host of 8 and "
                f"{links.inter / 1e9:.0f} GB/s across hosts (zjax.planner._timeline: a roofline walk over the "
                "schedule, no latency term)"
            )
            columns += [("compute", ">"), ("wait", ">")]
        cells = []
        for r in self.rows:
            t, c = r.theory, r.compiled
            row = [str(r.stage), r.remat, str(r.accum)] + ([mesh_text(r.mesh).replace(" x ", ",")] if meshes else [])
            row += [r.wire] if quant else []
            row += (["yes" if r.compute_copy else "no"] if copies else []) + (["yes" if r.hpz else "no"] if hpz else [])
            row += [SEP]
            row += [f(t["params"]), f(t["optimizer"]), f(t["grads"]), f(t["total"]), SEP]
            row += [f(c["state"]), f(c["temp"]), f(c["total"]), SEP]
            row += [f(r.comm.total_volume), f"{r.comm_psi:.2f}", f(r.comm.total_wire)]
            row += [f(r.comm.exposed_volume) + ("*" if r.over_memory else "")] if gpu else []
            row += [f"{r.compile_seconds:.1f}s"]
            row += [f(r.comm.volume_across("replica"))] if hsdp else []
            bubble = f"{max(r.bubble, default=0):.1%}"
            row += [r.schedule or "-", bubble, f(r.comm.volume_across("pp"))] if piped else []
            row += [r.offload, f(r.offloaded), f(r.pcie_bytes)] if offloaded else []
            groups = r.state_by_group
            a2a = sum(r.comm.all_to_all_by_axes.values())
            row += [f(groups.get("experts", 0)), f(groups.get("dense", 0)), f(a2a)] if experts else []
            tl = r.timeline
            row += [f"{tl.compute * 1e3:.1f}", f"{tl.wait * 1e3:.1f}"] if timed and tl is not None else []
            cells.append(row)
        lines = [head, *text_table(columns, cells)]
        return "\n".join(lines)


def estimate_html(est: Estimate) -> str:
    """One row per planned configuration: theory, compiled memory and communication per device (a Jupyter table)."""
    headers = ["stage", "remat", "accum", "offload", "theory", "state", "temp", "total", "comm", "x psi", "exposed"]
    rows = [
        [
            r.stage,
            r.remat,
            r.accum,
            r.offload,
            fmt_bytes(r.theory["total"]),
            fmt_bytes(r.compiled["state"]),
            fmt_bytes(r.compiled["temp"]),
            fmt_bytes(r.compiled["total"]),
            fmt_bytes(r.comm.total_volume),
            f"{r.comm_psi:.2f}",
            fmt_bytes(r.comm.exposed_volume) + (" *" if r.over_memory else ""),
        ]  # fmt: skip
        for r in est.rows
    ]
    compiler = f"XLA:GPU for {est.device_kind} (deviceless)" if est.backend == "gpu" else "XLA:CPU, simulated devices"
    caption = (
        f"{est.model}: {est.params:,} params on {mesh_text(est.mesh)}, {est.precision}, global batch "
        f"{est.batch_size}; compiled by {compiler}; per device"
    )
    if any(r.over_memory for r in est.rows):
        caption += (
            "; * over the memory the scheduler plans against: it gives up overlap there, so a step that fits "
            "exposes less"
        )
    return table(headers, rows, caption, numeric=tuple(range(4, 11)))
