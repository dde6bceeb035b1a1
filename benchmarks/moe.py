"""Mixtures of experts on the GPU compiler (deviceless XLA:GPU, H100): memory per stage with and without ep, the
token dispatch's bytes against the formula, compile time.

    python benchmarks/moe.py [--json runs/moe.json] [--gpus 8,64] [--stages 1,2,3] [--seq 4096] [--stretch]

1. Mixtral-8x7B (46.7e9 parameters, 45.1e9 of them in experts), bf16 + AdamW, full remat, one 4,096-token sequence
   per data-parallel rank, on 8 and on 64 H100s, with the experts replicated (``dp=N``) and split over ``ep=8``
   (``dp=N/8, ep=8``): state per device compiled against the ZeRO formula per parameter group (dense state over
   ``dp x ep``, expert state over ``dp``), temporaries, peak, ZeRO's traffic in psi, and the bytes the ragged
   all-to-alls move over ep against :func:`dispatch_formula`.
2. ``--stretch``: Qwen3-235B-A22B (128 experts, top-8, q/k norms) on 256 H100s (dp=32, ep=8, stage 3): does it
   fit 80 GB, and how long does the plan take.

Needs the CUDA compiler plugin (pip install -e ".[plan-gpu]"); no GPU. Compiles are a minute or more each.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax

jax.config.update("jax_platforms", "cpu")
import zjax  # noqa: E402

zjax.simulate_cpu_devices(8)
from zjax.models import PRESETS, DecoderConfig  # noqa: E402

GB = 1e9


def dispatch_formula(cfg: DecoderConfig, tokens_per_device: int, ep: int) -> float:
    """Bytes per device per step of the ragged all-to-alls over ep (the planner's count: each way, the rows a
    rank can send): per layer, every token's ``top_k`` rows (bf16) out to the experts and back, in the forward,
    the recompute and the backward (the cotangents), plus their int32 expert ids in the forward and recompute."""
    if ep == 1 or cfg.moe is None:
        return 0.0
    rows = tokens_per_device * cfg.moe.top_k
    return cfg.layers * (6 * rows * cfg.embed * 2 + 2 * rows * 4)


def plan_row(name: str, cfg: DecoderConfig, gpus: int, ep: int, stage: int, seq: int) -> dict:
    mesh = {"dp": gpus // ep, "ep": ep}
    t0 = time.perf_counter()
    est = zjax.planner.estimate(cfg, mesh=mesh, stages=(stage,), batch_size=gpus, seq_len=seq, target="h100")
    seconds = time.perf_counter() - t0
    row = est.rows[0]
    ragged = row.comm.volume.get("ragged-all-to-all", 0)
    state_theory = row.theory["params"] + row.theory["optimizer"]  # the gradients live in the temporaries
    return {
        "model": name,
        "gpus": gpus,
        "mesh": mesh,
        "stage": stage,
        "seq": seq,
        "state_theory_gb": state_theory / GB,
        "state_compiled_gb": row.compiled["state"] / GB,
        "state_error": row.compiled["state"] / state_theory - 1,
        "temp_gb": row.compiled["temp"] / GB,
        "peak_gb": row.compiled["total"] / GB,
        "fits_80gb_device": not row.over_memory and row.compiled["total"] <= (row.device_memory or 0),
        "comm_gb": row.comm.total_volume / GB,
        "comm_psi": row.comm_psi,
        "exposed_gb": row.comm.exposed_volume / GB,
        "dispatch_gb": ragged / GB,
        "dispatch_formula_gb": dispatch_formula(cfg, seq, ep) / GB,
        "compile_seconds": seconds,
    }


def show(rows: list[dict]) -> None:
    head = (
        f"{'model':<16}{'gpus':>5} {'mesh':<12}{'stage':>5} | {'state':>7} {'theory':>7} {'temp':>7} {'peak':>7} | "
        f"{'comm':>7} {'x psi':>5} {'expo':>6} | {'a2a':>6} {'formula':>7} | {'compile':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items())
        print(
            f"{r['model']:<16}{r['gpus']:>5} {mesh:<12}{r['stage']:>5} | {r['state_compiled_gb']:7.2f} "
            f"{r['state_theory_gb']:7.2f} {r['temp_gb']:7.2f} {r['peak_gb']:7.2f} | {r['comm_gb']:7.2f} "
            f"{r['comm_psi']:5.2f} {r['exposed_gb']:6.2f} | {r['dispatch_gb']:6.2f} {r['dispatch_formula_gb']:7.2f} | "
            f"{r['compile_seconds']:6.1f}s"
        )
    print("GB per device; a2a = ragged all-to-all bytes over ep per step (the planner's count), formula = "
          "dispatch_formula(); x psi = ZeRO's traffic / (params per model-parallel group x 2 bytes)")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, default=Path("runs/moe.json"))
    p.add_argument("--gpus", default="8,64")
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--stretch", action="store_true")
    args = p.parse_args()
    rows = []
    for gpus in (int(g) for g in args.gpus.split(",")):
        for ep in (1, 8):
            for stage in (int(s) for s in args.stages.split(",")):
                rows.append(plan_row("mixtral-8x7b", PRESETS["mixtral-8x7b"], gpus, ep, stage, args.seq))
                print(rows[-1], file=sys.stderr, flush=True)  # progress; the table goes to stdout
    if args.stretch:
        rows.append(plan_row("qwen3-235b-a22b", PRESETS["qwen3-235b-a22b"], 256, 8, 3, args.seq))
    show(rows)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    zjax.write_json_atomic(args.json, {"device": "H100 (deviceless XLA:GPU)", "jax": jax.__version__, "rows": rows})
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
