"""The budget search: the cheapest configuration whose compiled per-device memory fits, and why others were not run."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

from ..models import DecoderConfig
from ..offload import Offload
from ..pipeline import Pipeline
from ..stages import Stage
from ._estimate import estimate
from ._models import resolve_model
from ._result import Estimate, Row

# cost order for the budget search: less communication first, then less recomputation, then fewer microbatches
REMAT_COST = ("none", "dots_no_batch", "minimal", "dots", "save_qkv_proj", "save_out_proj", "full", "nested")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration the search considers."""

    offload: str
    stage: int
    remat: str
    accum: int
    schedule: str = "-"  # the pipeline schedule (pp > 1), "-" without one
    ep: int = 0  # the ep taken out of the data-parallel ranks (a mixture of experts); 0: the mesh as given
    cp: int = 0  # the cp taken out of dp (sequences split over cp); 0: the mesh as given
    quantized: str = "none"  # Plan(quantized_comm=...) at stage 3 ("none": the compute dtype on the wire)

    def describe(self) -> str:
        text = f"stage {self.stage}, remat {self.remat}, {self.accum} microbatch(es)"
        text += f", schedule {self.schedule}" if self.schedule != "-" else ""
        text += f", ep {self.ep}" if self.ep else ""
        text += f", cp {self.cp}" if self.cp else ""
        text += f", quantized {self.quantized}" if self.quantized != "none" else ""
        return text + (f", offload {self.offload}" if self.offload != "none" else "")


class Fit(NamedTuple):
    """What :func:`fit` found: the fitting row (or ``None``), the smallest row compiled, every estimate compiled
    in order, and each candidate that could not run with the reason (never dropped silently)."""

    row: Row | None
    closest: Row
    tried: list[Estimate]
    skipped: list[tuple[Candidate, str]]


def describe_skipped(skipped: Sequence[tuple[Candidate, str]]) -> list[str]:
    """One line per reason: the candidates it rules out (stages, remat policies, microbatches, offloads), then
    the reason, e.g. ``stage 0 x remat none, full x 2, 4 microbatches x offload none: global batch 8 ...``."""
    by_reason: dict[str, list[Candidate]] = {}
    for c, reason in skipped:
        by_reason.setdefault(reason, []).append(c)
    lines = []
    for reason, cs in by_reason.items():

        def values(field: str, cs: list[Candidate] = cs) -> str:
            return ", ".join(str(v) for v in dict.fromkeys(getattr(c, field) for c in cs))

        what = f"stage {values('stage')} x remat {values('remat')} x {values('accum')} microbatch(es) x offload "
        what += values("offload") + (f" x schedule {values('schedule')}" if cs[0].schedule != "-" else "")
        what += f" x ep {values('ep')}" if cs[0].ep else ""
        what += f" x cp {values('cp')}" if cs[0].cp else ""
        what += f" x quantized {values('quantized')}" if cs[0].quantized != "none" else ""
        lines.append(f"{what} ({len(cs)}): {reason}")
    return lines


def _schedule(base: Pipeline | None, c: Candidate, mesh: dict[str, int]) -> Pipeline | None:
    """The candidate's pipeline: ``base`` (default 2 x pp microbatches) under ``c.schedule``."""
    if c.schedule == "-":
        return base
    base = Pipeline(2 * mesh.get("pp", 1)) if base is None else base
    return dataclasses.replace(base, schedule=c.schedule)


def with_ep(mesh: dict[str, int], ep: int) -> dict[str, int]:
    """``mesh`` with ``ep`` taken out of its data-parallel ranks (``dp x ep`` stays the same); ``ep=0``: as given."""
    if not ep:
        return mesh
    ranks = mesh.get("dp", 1) * mesh.get("ep", 1)
    return {**mesh, "dp": ranks // ep, "ep": ep}


def with_cp(mesh: dict[str, int], cp: int) -> dict[str, int]:
    """``mesh`` with ``cp`` taken out of ``dp x cp`` (their product stays the same); ``cp=0``: as given."""
    if not cp:
        return mesh
    ranks = mesh.get("dp", 1) * mesh.get("cp", 1)
    return {**mesh, "dp": ranks // cp, "cp": cp}


def _cp_reason(cp: int, mesh: dict[str, int], seq_len: int) -> str | None:
    """Why ``cp`` cannot split ``mesh``'s ``dp x cp`` ranks or the (load-balanced) sequence, or ``None``."""
    ranks = mesh.get("dp", 1) * mesh.get("cp", 1)
    if not cp:
        return None
    if ranks % cp:
        return f"cp={cp} does not divide the {ranks} ranks of dp x cp"
    if cp > 1 and seq_len % (2 * cp):
        return f"cp={cp} does not split the {seq_len}-token sequence into 2 x cp = {2 * cp} load-balanced chunks"
    return None


def _ep_reason(ep: int, mesh: dict[str, int], cfg: DecoderConfig | None) -> str | None:
    """Why ``ep`` cannot split ``mesh``'s data ranks or the model's experts, or ``None``."""
    ranks = mesh.get("dp", 1) * mesh.get("ep", 1)
    if not ep:
        return None
    if ranks % ep:
        return f"ep={ep} does not divide the {ranks} data-parallel ranks (dp x ep)"
    experts = cfg.moe.experts if cfg is not None and cfg.moe is not None else None
    if ep > 1 and experts is None:
        return f"ep={ep} needs a mixture-of-experts model"
    if experts is not None and experts % ep:
        return f"ep={ep} does not divide the model's {experts} experts"
    return None


def _reason(c: Candidate, batch_size: int, mesh: dict[str, int], base: Pipeline | None = None) -> str | None:
    """Why ``c`` cannot run at all (before compiling), or ``None``."""
    try:
        schedule = _schedule(base, c, mesh)
        if schedule is not None:
            schedule.check(mesh.get("pp", 1))
    except ValueError as e:  # e.g. interleaved-1f1b without repeats
        return str(e)
    data = mesh.get("dp", 1) * mesh.get("replica", 1) * mesh.get("ep", 1)
    if batch_size % (c.accum * data):
        need = c.accum * data
        return (
            f"global batch {batch_size} does not split into {c.accum} microbatch(es) of whole rows per data-parallel "
            f"rank (replica x dp x ep = {data}): the batch must be a multiple of {need}, e.g. --batch-size "
            f"{-(-batch_size // need) * need}"
            + (", or split each sequence over cp (--cp)" if batch_size < need else "")
        )
    try:
        Offload.from_value(c.offload).check(Stage.from_value(c.stage))
    except ValueError as e:  # e.g. offload at stage 0, parameters offloaded below stage 3
        return str(e)
    return None


def weigh(rows: Sequence[Row]) -> Row:
    """Of rows that differ only in what crosses the data axes (``quantized_comm``), the one whose step waits least
    on the wire: the fewest exposed bytes (what the scheduler did not hide under compute; on XLA:CPU, whose
    collectives are synchronous, every byte), and at a tie the earliest in the order given. So a quantization
    listed after ``None`` is taken only where it exposes fewer bytes than the exact step does."""
    if not rows:
        raise ValueError("weigh: no rows to choose from.")
    return min(enumerate(rows), key=lambda ir: (ir[1].comm.exposed_volume, ir[0]))[1]


def fit(
    budget: float,
    model: str | DecoderConfig = "small",
    *,
    mesh: dict[str, int],
    stages: Sequence[int] = (0, 1, 2, 3),
    remats: Sequence[str] = ("none", "dots", "full"),
    accums: Sequence[int] = (1, 2, 4, 8),
    precision: str = "bf16",
    batch_size: int = 8,
    seq_len: int | None = None,
    target: str | None = None,
    offloads: Sequence[str] = ("none", "optimizer", "optimizer+params"),
    pipeline: Pipeline | None = None,
    schedules: Sequence[str] = (),
    eps: Sequence[int] = (),
    cps: Sequence[int] = (),
    quantized: Sequence[str | None] = (None,),
    reduce_dtype: str | None = None,
    compute_copy: bool = True,
    hpz: bool = False,
    matmul: str | None = None,
    tx: Any = None,
    moe: dict[str, Any] | None = None,
) -> Fit:
    """The cheapest (stage, ep, cp, remat, schedule, microbatches, offload) whose compiled per-device total fits
    in ``budget``.

    Candidates are tried cheapest first: no offload before offload (PCIe traffic every step), then the smaller
    ``cp`` of ``cps`` (taken out of ``dp x cp``: sequences split over more devices hold fewer activations but
    move keys and values over cp in every layer, so cp comes in only when the whole sequence does not fit), then
    lower stage (less communication), then the larger ``ep`` of ``eps`` (a mixture of experts: its experts split over
    more devices hold less state and cross dp less; ``dp x ep`` stays the mesh's), then less recomputation, then
    the pipeline schedule with the smaller
    bubble (``schedules``, with ``pp`` > 1: ``pipeline``'s microbatches and repeats under each), then
    fewer microbatches. At stage 3, each value of ``quantized`` (``Plan(quantized_comm=...)``, ``None`` for
    none) is compiled and, of those that fit, :func:`weigh` takes the one that exposes the fewest bytes on the
    wire. ``compute_copy=False`` plans stage 3's on-device candidates without the compute copy
    (``Plan(compute_copy=False)``); offloaded ones keep it (their fp32 weights live in host memory); ``hpz``
    plans them with ZeRO++'s hierarchical partitioning (``Plan(hpz=True)``); ``tx`` is the optimizer
    (:func:`estimate_fn`'s), ``moe`` the experts' fields to replace (:func:`estimate`'s). A candidate
    that cannot
    run (microbatches that do not divide the global batch, an offload the stage does not support) is listed
    in :attr:`Fit.skipped` with the reason.

    Returns:
      A :class:`Fit`: ``(fitting row or None, closest row, every estimate compiled, skipped candidates)``.

    Raises:
      ValueError: no candidate can run at all (the message gives each reason).
    """
    order = sorted(remats, key=lambda r: REMAT_COST.index(r) if r in REMAT_COST else len(REMAT_COST))
    pp = mesh.get("pp", 1)
    base = pipeline if pipeline is not None or pp == 1 else Pipeline(2 * pp)

    def idle(name: str) -> float:  # schedules by bubble; one that cannot run goes last (and is skipped)
        try:
            return dataclasses.replace(base, schedule=name).bubble(pp) if base is not None else 0.0
        except ValueError:
            return 1.0

    tables = sorted(schedules, key=idle) if schedules and pp > 1 else ["-"]
    tried: list[Estimate] = []
    skipped: list[tuple[Candidate, str]] = []
    closest: Row | None = None
    cfg = resolve_model(model)[1] if eps or cps else None
    seq = seq_len or (cfg.max_len if cfg is not None else 0)
    candidates = [
        Candidate(off, stage, remat, accum, schedule, ep, cp)
        for off in [o for o in Offload.NAMES if o in offloads]
        for cp in sorted(cps or (0,))
        for stage in sorted(stages)
        for ep in sorted(eps or (0,), reverse=True)
        for remat in order
        for schedule in tables
        for accum in sorted(accums)
    ]
    for c in candidates:
        split = with_cp(with_ep(mesh, c.ep), c.cp)
        reason = _ep_reason(c.ep, mesh, cfg) or _cp_reason(c.cp, with_ep(mesh, c.ep), seq)
        reason = reason or _reason(c, batch_size, split, base)
        if reason is not None:
            skipped.append((c, reason))
            continue
        fitting = []
        for q in list(dict.fromkeys(quantized)) if c.stage == 3 else [None]:  # quantization is stage 3's
            try:
                est = estimate(
                    model, mesh=split, stages=(c.stage,), remat=c.remat, precision=precision,
                    batch_size=batch_size, seq_len=seq_len, accum=c.accum, target=target, offload=c.offload,
                    pipeline=_schedule(base, c, mesh), quantized_comm=q, reduce_dtype=reduce_dtype,
                    compute_copy=compute_copy or c.offload != "none", hpz=hpz and c.offload == "none",
                    matmul=matmul, tx=tx, moe=moe,
                )  # fmt: skip
            except ValueError as e:
                if q is None:
                    raise
                skipped.append((dataclasses.replace(c, quantized=q), str(e)))  # e.g. int8 grads with offload
                continue
            tried.append(est)
            row = est.rows[0]
            if closest is None or row.compiled["total"] < closest.compiled["total"]:
                closest = row
            if row.compiled["total"] <= budget:
                fitting.append(row)
        if fitting:
            best = weigh(fitting)
            return Fit(best, best, tried, skipped)
    if closest is None:
        reasons = sorted({r for _, r in skipped})
        raise ValueError("planner: no candidate can run: " + "; ".join(reasons) + ".")
    return Fit(None, closest, tried, skipped)
