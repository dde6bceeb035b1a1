"""XLA:GPU compiler options that let a stage's collectives overlap compute, chosen per ZeRO stage (data).

Measured on the deviceless XLA:GPU compile for 8 x H100 (jaxlib 0.10.2; an 8-layer scanned decoder,
bf16 + AdamW, dp=8, 16 x 256 tokens), with the planner's overlap reading of the scheduled HLO:

- Stage 3 by default leaves 54.5 MB of its 167.9 MB of collectives per step exposed: the scheduler
  cannot start a layer's weight all-gather (forward) or its gradient reduce-scatter (backward) in the
  previous loop iteration. Pipelining both across the layer loop's iterations (the next layer's gather
  runs under this layer's matmuls; ZeRO-3's prefetch) exposes 0 bytes, for 0.6 MB more temporaries
  (one layer's gathered weights in flight: ZeRO-R's constant-size buffer).
- Stages 0-2 are already fully overlapped by XLA's default latency-hiding scheduler; pipelining there
  only added 3.4-8 MB of temporaries, so they get no options. Pipelined all-reduce and while-loop double
  buffering changed nothing hidden at any stage and cost temporaries.
- The scheduler schedules against the device's memory: a step that does not fit gets no overlap at all
  (Llama-2-7B at stage 0 on 64 x H100, 108.6 GB: all 26.95 GB of its per-layer gradient all-reduces
  exposed; the same step for 64 x H200: none). No option here changes that; the planner marks such rows.
"""

from __future__ import annotations

from typing import Any

GPU_OVERLAP: dict[int, dict[str, Any]] = {
    3: {"xla_gpu_enable_pipelined_all_gather": True, "xla_gpu_enable_pipelined_reduce_scatter": True},
}


QUANTIZED_GRADS: dict[str, Any] = {"xla_gpu_experimental_parallel_collective_overlap_limit": 2}
"""For a stage-3 step that reduces its gradients as int8 blocks (qgZ), on top of stage 3's: two collectives in flight
at once. Each layer's exchange runs during the next layer's backward (:func:`zjax.comm.layer_scan`), where XLA's
pipeliner also runs the next layer's weight gathers; with one collective in flight (XLA's default) the scheduler
gives the whole iteration to the exchange and leaves the gathers bare (measured, Llama-2-7B on 64 x H100, int8
gradients: 6.29 GB of 32.9 exposed, all weight gathers; with two, 2.17 GB, and 0.06 with int8 weights too)."""

DEVICELESS: dict[str, Any] = {"xla_gpu_enable_cub_radix_sort": False}
"""For a GPU compile without a GPU (the planner's): XLA:GPU rewrites a large sort (an MoE's tokens sorted by
expert, 8,192 rows and up) into CUB's radix sort, whose scratch size it asks the CUDA runtime for at compile time
(measured: ``INTERNAL: CUDA Runtime error: Error loading CUDA libraries`` for Mixtral-8x7B at 4,096 tokens per
device); XLA's own sort compiles without one. A real GPU keeps CUB."""


def compiler_options(
    stage_level: int, platform: str, enabled: bool, deviceless: bool = False, quantized_grads: bool = False
) -> dict[str, Any] | None:
    """The options for a step on ``platform`` at ``stage_level`` (None: XLA's defaults); ``deviceless``: the
    platform's devices are not this process's (:data:`DEVICELESS`); ``quantized_grads``: the step reduces its
    gradients as integer blocks (:data:`QUANTIZED_GRADS`).

    Only GPU compiles get them (real or deviceless). Pipelined plans get them too: with
    ``zero3_gather="layer"`` each stage's layer scan gathers and reduce-scatters per layer like the model's
    own scan (measured, 16-layer decoder on dp=2 x pp=4: GPipe M=4 exposes 0.6 MiB instead of 114.4 MiB of
    dp collectives for 2.2 MiB more temporaries; circular R=4, M=8, 0.2 instead of 2.6 MiB for 2.5 MiB), and
    ``"step"`` compiles to the same program with or without them.
    """
    if platform != "gpu":
        return None
    options = dict(GPU_OVERLAP.get(stage_level, {})) if enabled else {}
    if enabled and quantized_grads:
        options |= QUANTIZED_GRADS
    if deviceless:
        options |= DEVICELESS
    return options or None
