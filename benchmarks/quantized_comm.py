"""Convergence with quantized collectives (ZeRO++): the example's loss curve at stage 3 with bf16, int8 weight
gathers (qwZ), int8 gradient reductions (qgZ), both, int8 weights with int4 gradients (ZeRO++'s pair) and int4 both
ways, on 8 simulated CPU devices.

    python benchmarks/quantized_comm.py [--steps 300] [--json runs/quantized_comm.json] [--plot docs/quantized_comm.png]

Each variant runs ``examples/train_lm.py --stage 3 --mesh dp=8 --preset small`` in its own process (same data,
same seed) and records every step's loss; the summary compares the final losses (mean of the last 20 steps,
which smooths the per-batch noise) with bf16's. The bytes per step each variant moves come from the planner
(``zjax plan --quantize-comm none,weights,grads,weights+grads``), not from this run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _convergence import plot, run, summarize, write

VARIANTS = ("none", "weights", "grads", "weights+grads", "weights+grads:int4", "weights:int4+grads:int4")
LABELS = {
    "none": "bf16",
    "weights": "int8 weights (qwZ)",
    "grads": "int8 gradients (qgZ)",
    "weights+grads": "int8 weights + gradients",
    "weights+grads:int4": "int8 weights + int4 gradients",
    "weights:int4+grads:int4": "int4 weights + gradients",
}
EXAMPLE = ["--stage", "3", "--mesh", "dp=8", "--preset", "small"]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    args, extra = p.parse_known_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if "none" not in variants:
        variants.insert(0, "none")
    curves = {v: run([*EXAMPLE, "--quantize-comm", v, *extra], args.steps) for v in variants}
    summary = summarize(curves, "none")
    for v, s in summary.items():
        print(f"{v:>14}: final loss {s['final_loss']:.4f} ({s['vs_base']:+.2%} vs bf16)")
    result = {"steps": args.steps, "extra_args": extra, "summary": summary, "curves": curves}
    write(result, args.json)
    if args.plot is not None:
        plot(curves, LABELS, "examples/train_lm.py --stage 3 --mesh dp=8 --preset small", args.plot)
    return result


if __name__ == "__main__":
    main()
