"""The pipeline schedule as data: microbatches, repeats (GPipe or circular), and its checks."""

from __future__ import annotations

import dataclasses

GATHER_MODES = ("step", "layer")
"""ZeRO-3 weight gathering inside the pipeline: once per step, or per use inside the loop (see ``Pipeline``)."""


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
      zero3_gather: how ZeRO-3 weights (split over ``dp``) reach the stages. ``"step"``: every
        stage's weights are gathered once per step, before the loop, and stay whole until the
        backward pass is done (least communication). ``"layer"``: each iteration gathers only the
        layers it applies (the current repeat's chunk), the backward pass gathers them again, and
        their gradients are reduce-scattered per iteration; whole weights then live for one
        iteration only (least memory: about half the temp memory when weights dominate, at 5-22x
        the bytes gathered over dp in ``benchmarks/pipeline.py``). Only for ZeRO stage 3 (the plan
        refuses it otherwise).
      remat: rematerialize each iteration in the backward pass, saving only its input.
      unroll: unroll the loop (for FLOP accounting: compiled cost analysis counts a loop body once;
        unrolled programs grow with M, so never for training).
    """

    microbatches: int
    repeats: int = 1
    zero3_gather: str = "step"
    remat: bool = True
    unroll: bool = False

    def __post_init__(self) -> None:
        for name in ("microbatches", "repeats"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Pipeline: {name}={value!r} must be a positive int.")
        if self.zero3_gather not in GATHER_MODES:
            raise ValueError(
                f"Pipeline: zero3_gather={self.zero3_gather!r} is not a gathering mode; use one of {GATHER_MODES}."
            )

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
