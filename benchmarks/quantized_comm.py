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
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("none", "weights", "grads", "weights+grads", "weights+grads:int4", "weights:int4+grads:int4")


def run(variant: str, steps: int, extra: list[str]) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "metrics.json"
        cmd = [
            sys.executable, str(ROOT / "examples" / "train_lm.py"), "--stage", "3", "--mesh", "dp=8",
            "--preset", "small", "--steps", str(steps), "--quantize-comm", variant, "--log-every", str(steps),
            "--metrics-json", str(out), "--no-progress", *extra,
        ]  # fmt: skip
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())["losses"]


def summarize(curves: dict[str, list[float]], tail: int = 20) -> dict[str, dict[str, float]]:
    final = {v: sum(c[-tail:]) / len(c[-tail:]) for v, c in curves.items()}
    base = final["none"]
    return {v: {"final_loss": f, "vs_bf16": f / base - 1.0} for v, f in final.items()}


def plot(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = {
        "none": "bf16",
        "weights": "int8 weights (qwZ)",
        "grads": "int8 gradients (qgZ)",
        "weights+grads": "int8 weights + gradients",
        "weights+grads:int4": "int8 weights + int4 gradients",
        "weights:int4+grads:int4": "int4 weights + gradients",
    }
    for variant, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=labels.get(variant, variant), lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.set_title("examples/train_lm.py --stage 3 --mesh dp=8 --preset small")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


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
    curves = {v: run(v, args.steps, extra) for v in variants}
    summary = summarize(curves)
    for v, s in summary.items():
        print(f"{v:>14}: final loss {s['final_loss']:.4f} ({s['vs_bf16']:+.2%} vs bf16)")
    result = {"steps": args.steps, "extra_args": extra, "summary": summary, "curves": curves}
    if args.json is not None:
        from zjax import write_json_atomic

        write_json_atomic(args.json, result)
    if args.plot is not None:
        plot(curves, args.plot)
    return result


if __name__ == "__main__":
    main()
