"""``zjax plan``'s command line: its arguments and their parsers (each error one line)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .fp8 import MATMULS
from .pipeline._config import GATHER_MODES, RECOMPUTE


def parse_bytes(text: str) -> float:
    """``"80GB"`` (1e9), ``"80GiB"`` (2**30) or a plain number of bytes."""
    from .planner._gpu import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--budget: {e}") from None


def parse_budget(text: str) -> str:
    """``80%`` (of a GPU target's memory) or a size; resolved once the target is known."""
    if not text.strip().endswith("%"):
        parse_bytes(text)
    return text.strip()


def parse_mesh(text: str) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for part in filter(None, text.replace(" ", "").split(",")):
        name, eq, value = part.partition("=")
        if not eq or name not in ("replica", "dp", "ep", "cp", "tp", "pp") or not value.isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(
                f"--mesh: expected entries like dp=64,tp=2 or replica=8,dp=8 (HSDP), got {part!r}"
            )
        sizes[name] = int(value)
    if not sizes:
        raise argparse.ArgumentTypeError("--mesh: give at least one axis, e.g. dp=64")
    return sizes


def parse_ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of ints, got {text!r}") from None


def parses_quantized(quantized: str) -> bool:
    from .comm._quantize import parse

    try:
        parse(quantized)
    except ValueError:
        return False
    return True


def plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="per-device memory and communication for each ZeRO stage, compiled ahead of time")
    p.add_argument(
        "--model",
        required=True,
        help="a preset (llama3-8b, llama3-70b, qwen2-7b, mistral-7b, llama2-7b, tiny, ...) or a Hugging Face "
        "config.json or checkpoint directory",
    )
    p.add_argument(
        "--mesh", type=parse_mesh, default={"dp": 8}, help="dp=64, dp=32,tp=2, replica=8,dp=8 (HSDP), dp=8,ep=8 (MoE)"
    )
    p.add_argument("--stages", type=parse_ints, default=[0, 1, 2, 3])
    p.add_argument("--remat", default="full", help="remat policy (zjax.remat.POLICIES); comma list with --budget")
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--matmul", default=None, help="the projections' products (zjax.fp8.MATMULS)", choices=MATMULS)
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="global batch (default: one sequence per dp rank in each microbatch, for every --accum value)",
    )
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--accum", type=parse_ints, default=[1], help="microbatches; comma list with --budget")
    p.add_argument(
        "--budget",
        type=parse_budget,
        default=None,
        help="per-device memory to fit: 80%% (of the --target's memory, as the allocator's fraction) or 70GB; a "
        "GPU target keeps a reserve for what the compiler does not count; picks the cheapest fit",
    )
    p.add_argument(
        "--target",
        default=None,
        help="compile with XLA:GPU for this GPU (h100, h200, b200, a100, or a GpuTargetConfigProto .txtpb file), "
        'no GPU needed (pip install "zjax[plan-gpu]"); default: XLA:CPU on simulated devices',
    )
    p.add_argument(
        "--offload",
        default="none",
        help="ZeRO-Offload: none, optimizer (master + optimizer state in host memory) or optimizer+params "
        "(stage 3); with --budget a comma list of those allowed (default: all, tried after every on-device plan)",
    )
    p.add_argument(
        "--quantize-comm",
        default="none",
        help="stage 3 rows: what crosses dp as int8 blocks (ZeRO++; zjax.comm): none, weights (qwZ), grads (qgZ) "
        "or weights+grads, a part as int4 with ':int4' (weights+grads:int4: ZeRO++'s int4 gradients) and in "
        "blocks of B values per scale with '@B' (weights:int4@64; default 256); a comma "
        "list plans each, side by side (e.g. none,weights,weights+grads); with "
        "--budget, stage 3 takes the listed value that exposes the fewest bytes (at a tie, the first listed)",
    )
    p.add_argument(
        "--compute-copy",
        default="keep",
        help="stage 3 rows: keep the parameters' compute-dtype copy beside the fp32 master (keep), or keep only the "
        "fp32 weights and cast each shard before its gather (drop: Plan(compute_copy=False), 12 bytes per "
        "parameter of state with Adam); keep,drop plans both",
    )
    p.add_argument(
        "--hpz",
        default="no",
        help="stage 3 rows on a mesh with replica > 1: ZeRO++'s hierarchical partitioning (yes: state split over "
        "replica x dp, each step gathers the parameters across nodes once and every layer inside the node; "
        "Plan(hpz=True)); no,yes plans both",
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="GPU targets: print each row's roofline walk over the compiled schedule: compute ms per step (peak "
        "FLOP/s, HBM bandwidth) and the ms it waits for collectives (NVLink inside a host of 8, the network "
        "across hosts); exposed counts any overlap, this weighs it",
    )
    p.add_argument(
        "--reduce-dtype",
        default=None,
        help="the dtype gradients are reduced in over the data axes (Plan(reduce_dtype=...), e.g. float32); "
        "default: the compute dtype",
    )
    p.add_argument(
        "--ep",
        type=parse_ints,
        default=None,
        help="with --budget, a mixture of experts: the ep sizes the search may take out of dp x ep (e.g. 1,2,4,8)",
    )
    p.add_argument(
        "--capacity-factor",
        type=float,
        default=None,
        help="a mixture of experts: each expert takes at most factor x its balanced share of each device's "
        "tokens, the rest dropped (MoE(capacity_factor=...)); each rank's receive buffers then hold that, not "
        "the worst case of every token routed to it (default: the model's, dropless)",
    )
    p.add_argument(
        "--dispatch-chunks",
        type=int,
        default=None,
        help="a mixture of experts: route each device's tokens in this many chunks, one after another "
        "(MoE(dispatch_chunks=...)): receive buffers that much smaller, one more exchange in the backward",
    )
    p.add_argument(
        "--cp",
        type=parse_ints,
        default=None,
        help="with --budget, the cp sizes the search may take out of dp x cp, smallest first (e.g. 1,2,4,8)",
    )
    p.add_argument("--microbatches", type=int, default=None, help="pipeline microbatches when pp > 1 (default 2 x pp)")
    p.add_argument("--repeats", type=int, default=1, help="pipeline repeats: chunks of layers per stage")
    p.add_argument(
        "--schedule",
        default="gpipe",
        help="pipeline schedule: gpipe, 1f1b, interleaved-1f1b (repeats > 1) or zero-bubble; with --budget a comma "
        "list to choose from (smallest bubble first)",
    )
    p.add_argument(
        "--zero3-gather",
        choices=GATHER_MODES,
        default=None,
        help="pipeline at stages 2-3: weights gathered once per step or per use (default: layer at 2-3, step below)",
    )
    p.add_argument(
        "--recompute",
        choices=RECOMPUTE,
        default="once",
        help="table schedules under full/nested remat: B recomputes the stage once for B and W (GPipe's FLOPs), or "
        "B and W each recompute it (per-action: the least memory)",
    )
    p.add_argument(
        "--optimizer",
        default="adamw",
        help="the optimizer whose state the plan holds: adamw, fused_adamw, lion, adafactor, muon (zjax train's "
        "optim.name, with its defaults)",
    )
    p.add_argument(
        "--pipeline-table",
        type=Path,
        default=None,
        help="a schedule of one's own: a file of actions per stage (zjax.pipeline.parse_table's format), run in "
        "place of --schedule; its microbatches and chunks are the plan's",
    )
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None, help="PNG bar chart of memory by category")
