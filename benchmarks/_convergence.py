"""Loss curves of the example under variants of one flag: each run in its own process, the same data and seed.

Shared by the convergence benchmarks (``quantized_comm.py``, ``fp8.py``): :func:`compare` is their command line;
:func:`run` trains ``examples/train_lm.py`` once and returns every step's loss, :func:`summarize` compares final
losses (the mean of the last 20 steps, which smooths the per-batch noise) with a baseline's, :func:`plot` draws the
curves.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(args: list[str], steps: int) -> list[float]:
    """Every step's loss of ``examples/train_lm.py --steps steps *args``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "metrics.json"
        cmd = [
            sys.executable, str(ROOT / "examples" / "train_lm.py"), "--steps", str(steps), "--log-every", str(steps),
            "--metrics-json", str(out), "--no-progress", *args,
        ]  # fmt: skip
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())["losses"]


def summarize(curves: dict[str, list[float]], base: str, tail: int = 20) -> dict[str, dict[str, float]]:
    """Per variant, its final loss (mean of the last ``tail`` steps) and how far it ends from ``base``'s."""
    final = {v: sum(c[-tail:]) / len(c[-tail:]) for v, c in curves.items()}
    return {v: {"final_loss": f, "vs_base": f / final[base] - 1.0} for v, f in final.items()}


def plot(curves: dict[str, list[float]], labels: dict[str, str], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for variant, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=labels.get(variant, variant), lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def write(result: dict, path: Path | None) -> None:
    if path is not None:
        from zjax import write_json_atomic

        write_json_atomic(path, result)


def compare(
    argv: list[str] | None, *, description: str, flag: str, choices: str, variants: list[str], base: str,
    example: list[str], labels: dict[str, str], vs: str, width: int,
) -> dict:  # fmt: skip
    """Run the example once per value of ``flag`` (``base`` first, always), print each final loss against
    ``base``'s (``vs`` names it, values right-aligned to ``width``), and write ``--json`` and ``--plot``. The
    values come from ``--<choices>`` (default: ``variants``); unknown arguments go to the example."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument(f"--{choices}", default=",".join(variants), help=f"comma list of {variants}")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    args, extra = p.parse_known_args(argv)
    chosen = [base, *[v for v in getattr(args, choices).split(",") if v and v != base]]
    curves = {v: run([*example, f"--{flag}", v, *extra], args.steps) for v in chosen}
    summary = summarize(curves, base)
    for v, s in summary.items():
        print(f"{v:>{width}}: final loss {s['final_loss']:.4f} ({s['vs_base']:+.2%} vs {vs})")
    result = {"steps": args.steps, "extra_args": extra, "summary": summary, "curves": curves}
    write(result, args.json)
    if args.plot is not None:
        plot(curves, labels, "examples/train_lm.py " + " ".join(example), args.plot)
    return result
