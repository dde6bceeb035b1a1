"""Convergence with fp8 projections: the example's loss curve at stage 3 with bf16 products and with fp8 products
(``--matmul``), on 8 simulated CPU devices.

    python benchmarks/fp8.py [--steps 300] [--json runs/fp8.json] [--plot docs/fp8.png]

Each recipe runs ``examples/train_lm.py --stage 3 --mesh dp=8 --preset small --precision bf16`` in its own process
(same data, same seed) and records every step's loss; the summary compares the final losses (mean of the last 20
steps) with the bf16 products'. XLA:CPU converts to and from the fp8 formats exactly, so the curves are fp8's
numerics; the speed of fp8 products is a GPU's (``zjax plan --matmul fp8-current --timeline``).
"""

from __future__ import annotations

from _convergence import compare

from zjax.fp8 import MATMULS

LABELS = {
    "default": "bf16 products",
    "fp8-current": "fp8 products, current scaling",
    "fp8-delayed": "fp8 products, delayed scaling",
    "mxfp8": "MXFP8 products (blocks of 32)",
}


def main(argv: list[str] | None = None) -> dict:
    return compare(
        argv, description=__doc__.split("\n")[0], flag="matmul", choices="recipes", variants=list(MATMULS),
        base="default", example=["--stage", "3", "--mesh", "dp=8", "--preset", "small", "--precision", "bf16"],
        labels=LABELS, vs="bf16 products", width=12,
    )  # fmt: skip


if __name__ == "__main__":
    main()
