"""The pipeline schedule as data: microbatches, repeats (GPipe or circular), and its checks."""

from __future__ import annotations

import dataclasses
from typing import Any

GATHER_MODES = ("step", "layer", "chunk")
"""How dp-split weights meet the pipeline: once per step, per use inside the loop, or per repeat's chunk
(see ``Pipeline``)."""


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """An SPMD pipeline over the mesh axis ``pp`` (S = its size).

    Layer weights stacked ``[L, ...]`` are cut into S stages along ``pp``; every stage applies its
    ``L / (S x repeats)`` layers per visit. One ``lax.scan`` runs ``microbatches x repeats + S - 1``
    iterations in which every stage works on a different microbatch and hands its output to the
    next stage (one collective-permute per direction).

    Args:
      microbatches: M, microbatches per step and data-parallel rank; a multiple of S.
      repeats: R. 1 is GPipe; R > 1 is the circular (interleaved) schedule: each stage holds R
        chunks of layers and every microbatch loops R times around the stages, which divides the
        bubble by R.
      zero3_gather: how weights and gradients split over ``dp`` (stages 2 and 3) meet the stages.
        ``"step"``: every stage's weights are gathered once per step, before the loop, and stay whole,
        with whole gradients, until the backward pass is done; the gradients are reduced over ``dp``
        once, at the loop's boundary (least communication; the memory of stage 1). ``"layer"``: they
        stay split over ``dp`` through the loop. The stage's layer scan gathers each layer just
        before applying it, the backward pass gathers it again, and its gradient is reduce-scattered
        into a ``dp``-split accumulator, per iteration (stage 2's weights are whole: only the gradient
        reduction moves into the loop). Whole weights then live for one layer, and the memory
        promise of stages 2 and 3 holds under a pipeline, at ``dp`` traffic that grows with the
        iterations (``benchmarks/pipeline.py``). ``"chunk"`` (stage 3): split over ``dp`` through the
        loop, which runs in R phases of M iterations; each repeat's chunk is gathered once forward and
        once backward (two chunks whole at a time) and its gradient reduce-scattered once, when both
        phases that use it are done: ZeRO-3's 3 psi, with the memory of about ten whole chunks, so it
        pays with many repeats (a chunk of one or two layers). ``None`` (the default): the plan picks
        ``"layer"`` at stages 2 and 3, ``"step"`` below; ``"layer"`` is refused at stages 0 and 1,
        ``"chunk"`` below stage 3.
      remat: rematerialize each iteration in the backward pass, saving only its input.
      unroll: unroll the loop (for FLOP accounting: compiled cost analysis counts a loop body once;
        unrolled programs grow with M, so never for training).
    """

    microbatches: int
    repeats: int = 1
    zero3_gather: str | None = None
    remat: bool = True
    unroll: bool = False

    def __post_init__(self) -> None:
        for name in ("microbatches", "repeats"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Pipeline: {name}={value!r} must be a positive int.")
        if self.zero3_gather is not None and self.zero3_gather not in GATHER_MODES:
            raise ValueError(
                f"Pipeline: zero3_gather={self.zero3_gather!r} is not a gathering mode; use one of {GATHER_MODES}."
            )

    def for_stage(self, stage: Any) -> Pipeline:
        """This schedule with its gathering mode settled for ZeRO ``stage`` (a :class:`zjax.Stage`).

        The default (``zero3_gather=None``) is ``"layer"`` at stages 2 and 3, the mode whose weights and
        gradients stay split over ``dp`` through the loop, and ``"step"`` below (stages 0 and 1 keep
        whole weights and gradients on every rank anyway).

        Raises:
          ValueError: ``"layer"`` at stage 0 or 1; ``"chunk"`` below stage 3.
        """
        if self.zero3_gather is None:
            return dataclasses.replace(self, zero3_gather="layer" if stage.shard_gradients else "step")
        reason = self.refusal(stage)
        if reason is not None:
            raise ValueError(reason)
        return self

    def refusal(self, stage: Any) -> str | None:
        """Why this gathering mode cannot run at ZeRO ``stage`` (``None``: it can; the planner then falls
        back to ``"step"``)."""
        if self.zero3_gather == "layer" and not stage.shard_gradients:
            return (
                f"Pipeline: zero3_gather='layer' keeps weights and gradients split over dp through the loop, "
                f"but stage={stage.level} keeps whole gradients on every dp rank: their reduction over dp would "
                f"only move inside the loop, once per iteration, and save no memory. Use stage 2 or 3, or "
                f"zero3_gather='step'."
            )
        if self.zero3_gather == "chunk" and not stage.shard_parameters:
            return (
                f"Pipeline: zero3_gather='chunk' gathers weights split over dp chunk by chunk, but stage={stage.level} "
                f"keeps whole weights on every dp rank. Use stage 3, or zero3_gather='layer' (stage 2) or 'step'."
            )
        return None

    def iterations(self, stages: int) -> int:
        """Scan iterations per step: ``M x R + S - 1``."""
        return self.microbatches * self.repeats + stages - 1

    def bubble(self, stages: int) -> float:
        """The idle fraction of every stage: ``(S - 1) / (M x R + S - 1)``."""
        return (stages - 1) / self.iterations(stages)

    def check(self, stages: int, layers: int | None = None, rows: int | None = None) -> None:
        """Raise ``ValueError`` unless this schedule fits ``stages`` (S), ``layers`` (L) and ``rows`` (per dp rank)."""
        m, r = self.microbatches, self.repeats
        if m < stages:
            raise ValueError(
                f"Pipeline: microbatches={m} < pp={stages} stages: the pipeline never fills. Use at least "
                f"{stages} microbatches (more shrink the bubble {self.bubble(stages):.0%})."
            )
        if m % stages:
            raise ValueError(
                f"Pipeline: microbatches={m} is not a multiple of pp={stages}; each stage streams "
                f"microbatches/pp of them. Use {m + stages - m % stages} or {m - m % stages}."
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
