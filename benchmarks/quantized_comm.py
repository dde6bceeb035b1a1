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

from _convergence import compare

VARIANTS = ["none", "weights", "grads", "weights+grads", "weights+grads:int4", "weights:int4+grads:int4"]
LABELS = {
    "none": "bf16",
    "weights": "int8 weights (qwZ)",
    "grads": "int8 gradients (qgZ)",
    "weights+grads": "int8 weights + gradients",
    "weights+grads:int4": "int8 weights + int4 gradients",
    "weights:int4+grads:int4": "int4 weights + gradients",
}


def main(argv: list[str] | None = None) -> dict:
    return compare(
        argv, description=__doc__.split("\n")[0], flag="quantize-comm", choices="variants", variants=VARIANTS,
        base="none", example=["--stage", "3", "--mesh", "dp=8", "--preset", "small"], labels=LABELS, vs="bf16",
        width=14,
    )  # fmt: skip


if __name__ == "__main__":
    main()
