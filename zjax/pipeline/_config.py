"""The pipeline's configuration: schedule, microbatches, repeats, gathering mode, and its checks."""

from __future__ import annotations

import dataclasses
from typing import Any

from ._schedule import SCHEDULES, Table, schedule_table

TABLE_SCHEDULES = SCHEDULES[1:]
"""The schedules run by the table engine (:func:`zjax.pipeline.loss`); ``gpipe`` runs as one ``lax.scan``."""

RECOMPUTE = ("once", "per-action")
"""How the table schedules' B and W recompute layers that the remat policy recomputes whole (see ``Pipeline``)."""

GATHER_MODES = ("step", "layer")
"""How dp-split weights meet the pipeline: once per step, or per use inside the loop (see ``Pipeline``)."""


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """An SPMD pipeline over the mesh axis ``pp`` (S = its size).

    Layer weights stacked ``[L, ...]`` are cut into S stages along ``pp``; every stage applies its
    ``L / (S x repeats)`` layers per visit. Every stage works on a different microbatch at a time and
    hands its output to the next stage (one collective-permute per direction).

    Args:
      microbatches: M, microbatches per step and data-parallel rank.
      repeats: R, chunks of layers per stage: every microbatch loops R times around the stages, which
        divides the bubble by R (``gpipe`` with R > 1 is the circular schedule).
      schedule: ``"gpipe"`` (the default): all forwards, then the backward pass as the transpose of one
        ``lax.scan``; inputs of all ``M x R + S - 1`` iterations are kept, M a multiple of S.
        ``"1f1b"``: one forward, one backward at a time after ``S - s - 1`` warm-up forwards; at most S
        microbatches in flight whatever M, the bubble of GPipe. ``"interleaved-1f1b"`` (R > 1, M a
        multiple of S): 1F1B over R chunks per stage, the bubble divided by R. ``"zero-bubble"`` (ZB-H1):
        1F1B with each backward split into its input part (B) and weight part (W), the W deferred into
        the ticks where the stage would wait; the bubble a third of 1F1B's at the memory of 1F1B's first
        stage. ``"zb-v"`` (ZB-V, R = 2, any M): two chunks per stage in a V (chunk 1 of stage s holds block
        2S - 1 - s, so stage 0 holds the first and the last), F, B and W apart and placed greedily; 1F1B's peak
        memory and about half zero-bubble's bubble. The last four run the whole model per microbatch
        (:func:`zjax.pipeline.loss`: the loss is computed by the stage with the last layers as each microbatch
        arrives) from a table of ticks (:func:`zjax.pipeline.schedule_table`).
      zero3_gather: how weights and gradients split over ``dp`` (stages 2 and 3) meet the stages.
        ``"step"``: every stage's weights are gathered once per step, before the loop, and stay whole,
        with whole gradients, until the backward pass is done; the gradients are reduced over ``dp``
        once, at the loop's boundary (least communication; the memory of stage 1). ``"layer"``: they
        stay split over ``dp`` through the loop. The stage's layer scan gathers each layer just
        before applying it, the backward pass gathers it again, and its gradient is reduce-scattered
        into a ``dp``-split accumulator, per iteration (stage 2's weights are whole: only the gradient
        reduction moves into the loop). Whole weights then live for one layer, and the memory
        promise of stages 2 and 3 holds under a pipeline, at ``dp`` traffic that grows with the
        iterations (``benchmarks/pipeline.py``). ``None`` (the default): the plan picks ``"layer"`` at
        stages 2 and 3, ``"step"`` below; ``"layer"`` is refused at stages 0 and 1. The table schedules
        run ``"step"`` and, at stage 3, ``"layer"`` (their default there): every F, B and W action gathers
        each layer of its chunk over ``dp`` as it applies it (int8 with qwZ) and reduce-scatters the layer's
        gradient into a ``dp``-split fp32 accumulator after each W, so a stage never holds more than one
        whole layer and its gradient at a time.
      remat: rematerialize each iteration of GPipe's scan in the backward pass, saving only its input (the
        table schedules keep what the model's remat policy saves).
      recompute: the table schedules' backward passes under a remat policy that recomputes whole layers
        (``full``, ``nested``; :func:`zjax.pipeline.scan_layers`). ``"once"`` (the default): each forward
        keeps the stage's input, B recomputes the stage keeping its matmul outputs and W pulls back from them,
        so a step computes GPipe's FLOPs; a stage holds its layers' matmul outputs for each microbatch from
        its B to its W (one tick under 1F1B, a few under zero-bubble). ``"per-action"``: B and W each
        recompute the stage from its kept layer inputs: one forward pass more per microbatch, the least
        memory. Any other policy's forward keeps what the policy saves, and B and W pull back from it.
      unroll: unroll the loop (for FLOP accounting: compiled cost analysis counts a loop body once;
        unrolled programs grow with M, so never for training).
    """

    microbatches: int
    repeats: int = 1
    zero3_gather: str | None = None
    schedule: str | Table = "gpipe"
    remat: bool = True
    unroll: bool = False
    recompute: str = "once"

    def __post_init__(self) -> None:
        for name in ("microbatches", "repeats"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Pipeline: {name}={value!r} must be a positive int.")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"Pipeline: recompute={self.recompute!r} is not one of {RECOMPUTE}.")
        if self.zero3_gather == "chunk":
            raise ValueError(
                "Pipeline: zero3_gather='chunk' was removed: 'step' moves two thirds of its dp bytes at 0.88-1.05x its "
                "peak, 'layer' overlaps its gathers with compute at 0.69-0.81x its peak (docs/concepts/pipelines.md). "
                "Use zero3_gather='step' where dp bandwidth binds, 'layer' where memory does."
            )
        if self.zero3_gather is not None and self.zero3_gather not in GATHER_MODES:
            raise ValueError(
                f"Pipeline: zero3_gather={self.zero3_gather!r} is not a gathering mode; use one of {GATHER_MODES}."
            )
        if isinstance(self.schedule, Table):  # a table of one's own (zjax.pipeline.parse_table)
            t = self.schedule
            if (t.microbatches, t.chunks) != (self.microbatches, self.repeats):
                raise ValueError(
                    f"Pipeline: the table {t.schedule!r} runs {t.microbatches} microbatches and {t.chunks} chunks per "
                    f"stage; pass microbatches={t.microbatches}, repeats={t.chunks} (got {self.microbatches}, "
                    f"{self.repeats})."
                )
        elif self.schedule not in SCHEDULES:
            raise ValueError(
                f"Pipeline: schedule={self.schedule!r} is not a schedule; use one of {SCHEDULES}, or a table "
                "(zjax.pipeline.parse_table)."
            )
        if self.schedule == "interleaved-1f1b" and self.repeats == 1:
            raise ValueError(
                "Pipeline: schedule='interleaved-1f1b' interleaves chunks of layers: it needs repeats > 1 (chunks "
                "per stage). Use repeats=2 or more, or schedule='1f1b'."
            )
        if self.schedule == "zb-v" and self.repeats != 2:
            raise ValueError(
                f"Pipeline: schedule='zb-v' runs two chunks of layers per stage in a V (the first and the last on "
                f"stage 0); use repeats=2 (got {self.repeats})."
            )
        if self.schedule == "1f1b" and self.repeats > 1:
            raise ValueError(
                f"Pipeline: schedule='1f1b' with repeats={self.repeats}: chunks per stage are the interleaved "
                "schedule; use schedule='interleaved-1f1b' (or 'zero-bubble', which takes repeats too)."
            )

    @property
    def tabled(self) -> bool:
        """Whether the table engine runs this schedule (every schedule but ``gpipe``)."""
        return isinstance(self.schedule, Table) or self.schedule in TABLE_SCHEDULES

    @property
    def name(self) -> str:
        """The schedule's name (a table's own, ``"custom"`` unless :func:`zjax.pipeline.parse_table` was told)."""
        return self.schedule.schedule if isinstance(self.schedule, Table) else self.schedule

    def for_stage(self, stage: Any, whole_gradients: str | None = None) -> Pipeline:
        """This schedule with its gathering mode settled for ZeRO ``stage`` (a :class:`zjax.Stage`).

        The default (``zero3_gather=None``) is ``"layer"`` at stages 2 and 3 (the table schedules: at stage
        3), the mode whose weights and gradients stay split over ``dp`` through the loop, and ``"step"``
        below (stages 0 and 1 keep whole weights and gradients on every rank anyway). ``whole_gradients``
        names the plan setting that keeps every rank's whole gradients for the step and reduces them once
        (``reduce_dtype=...``): the mode is then ``"step"``.

        Raises:
          ValueError: ``"layer"`` at stage 0 or 1, or with ``whole_gradients``.
        """
        if whole_gradients is not None and self.zero3_gather not in (None, "step"):
            raise ValueError(
                f"Pipeline: zero3_gather={self.zero3_gather!r} with Plan({whole_gradients}): the plan reduces each "
                f"data-parallel rank's whole gradients once per step in that dtype (the weights gathered over dp "
                f"once, before the loop), which is zero3_gather='step'. Use zero3_gather='step' (or None), or "
                f"reduce_dtype=None to reduce inside the loop in the compute dtype."
            )
        if self.zero3_gather is None:
            split = (stage.shard_parameters if self.tabled else stage.shard_gradients) and whole_gradients is None
            return dataclasses.replace(self, zero3_gather="layer" if split else "step")
        reason = self.refusal(stage)
        if reason is not None:
            raise ValueError(reason)
        return self

    def refusal(self, stage: Any) -> str | None:
        """Why this gathering mode cannot run at ZeRO ``stage`` (``None``: it can; the planner then falls
        back to ``"step"``)."""
        if self.zero3_gather == "layer" and self.tabled and not stage.shard_parameters:
            return (
                f"Pipeline: zero3_gather='layer' with schedule={self.name!r} gathers each layer's weights split "
                f"over dp as its actions run, but stage={stage.level} keeps whole weights on every dp rank. Use "
                f"stage 3, or zero3_gather='step'."
            )
        if self.zero3_gather == "layer" and not stage.shard_gradients:
            return (
                f"Pipeline: zero3_gather='layer' keeps weights and gradients split over dp through the loop, "
                f"but stage={stage.level} keeps whole gradients on every dp rank: their reduction over dp would "
                f"only move inside the loop, once per iteration, and save no memory. Use stage 2 or 3, or "
                f"zero3_gather='step'."
            )
        return None

    def iterations(self, stages: int) -> int:
        """GPipe's scan iterations per step: ``M x R + S - 1``."""
        return self.microbatches * self.repeats + stages - 1

    def table(self, stages: int) -> Any:
        """The schedule on ticks for ``stages`` (:func:`zjax.pipeline.schedule_table`, or the table passed)."""
        if not isinstance(self.schedule, Table):
            return schedule_table(self.schedule, stages, self.microbatches, self.repeats)
        if self.schedule.stages != stages:
            raise ValueError(
                f"Pipeline: the table {self.schedule.schedule!r} has {self.schedule.stages} stages but the mesh has "
                f"pp={stages}; write one line per stage, or use a mesh with pp={self.schedule.stages}."
            )
        return self.schedule

    def bubble(self, stages: int) -> float:
        """The largest idle fraction of a stage, counted on the schedule's table (F, B and W one tick each;
        GPipe and 1F1B: ``(S - 1) / (M x R + S - 1)``)."""
        return self.table(stages).bubble()

    def check(self, stages: int, layers: int | None = None, rows: int | None = None) -> None:
        """Raise ``ValueError`` unless this schedule fits ``stages`` (S), ``layers`` (L) and ``rows`` (per dp rank)."""
        m, r = self.microbatches, self.repeats
        if isinstance(self.schedule, Table):  # its own order: any M
            self.table(stages)
        # the scan's stream and Megatron's interleaving take microbatches in groups of S
        grouped = self.schedule == "gpipe" or (r > 1 and self.schedule in ("interleaved-1f1b", "zero-bubble"))
        if grouped and m < stages:
            raise ValueError(
                f"Pipeline: microbatches={m} < pp={stages} stages: schedule={self.name!r} with repeats={r} "
                f"takes microbatches in groups of pp. Use at least {stages} microbatches, or schedule='1f1b' "
                f"or 'zero-bubble' with repeats=1, which run any number (at a bubble of "
                f"{schedule_table('1f1b', stages, m).bubble():.0%} here)."
            )
        if grouped and m % stages:
            raise ValueError(
                f"Pipeline: microbatches={m} is not a multiple of pp={stages}; schedule={self.name!r} with "
                f"repeats={r} takes microbatches in groups of pp. Use {m + stages - m % stages} or "
                f"{m - m % stages}, or schedule='1f1b' or 'zero-bubble' with repeats=1."
            )
        if layers is not None and layers % (stages * r):
            raise ValueError(
                f"Pipeline: {layers} layers do not split into pp={stages} stages x repeats={r} equal chunks "
                f"(layers must be a multiple of {stages * r})."
            )
        if rows is not None and rows % m:
            raise ValueError(
                f"Pipeline: {rows} batch rows per data-parallel rank do not split into microbatches={m}; use "
                f"a global batch that is a multiple of microbatches x dp."
            )
