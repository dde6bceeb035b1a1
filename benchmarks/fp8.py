"""Convergence with fp8 projections: the example's loss curve at stage 3 with bf16 products and with fp8 products
(``--matmul``), on 8 simulated CPU devices.

    python benchmarks/fp8.py [--steps 300] [--json runs/fp8.json] [--plot docs/fp8.png]

Each recipe runs ``examples/train_lm.py --stage 3 --mesh dp=8 --preset small --precision bf16`` in its own process
(same data, same seed) and records every step's loss; the summary compares the final losses (mean of the last 20
steps) with the bf16 products'. XLA:CPU converts to and from the fp8 formats exactly, so the curves are fp8's
numerics; the speed of fp8 products is a GPU's (``zjax plan --matmul fp8-current --timeline``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _convergence import plot, run, summarize, write

from zjax.fp8 import MATMULS

LABELS = {"default": "bf16 products", "fp8-current": "fp8 products, current scaling"}
EXAMPLE = ["--stage", "3", "--mesh", "dp=8", "--preset", "small", "--precision", "bf16"]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--recipes", default=",".join(MATMULS), help=f"comma list of {list(MATMULS)}")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    args, extra = p.parse_known_args(argv)
    recipes = ["default", *[r for r in args.recipes.split(",") if r and r != "default"]]
    curves = {r: run([*EXAMPLE, "--matmul", r, *extra], args.steps) for r in recipes}
    summary = summarize(curves, "default")
    for r, s in summary.items():
        print(f"{r:>12}: final loss {s['final_loss']:.4f} ({s['vs_base']:+.2%} vs bf16 products)")
    result = {"steps": args.steps, "extra_args": extra, "summary": summary, "curves": curves}
    write(result, args.json)
    if args.plot is not None:
        plot(curves, LABELS, "examples/train_lm.py --stage 3 --mesh dp=8 --preset small --precision bf16", args.plot)
    return result


if __name__ == "__main__":
    main()
