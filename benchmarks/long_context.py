"""Long context on the GPU compiler (deviceless XLA:GPU, H100): temporaries per device by sequence length and cp.

    python benchmarks/long_context.py [--json runs/long_context.json] [--seqs 8192,32768,131072] [--cps 1,2,4,8]
                                      [--skip-1t] [--stretch]

1. Llama-3-8B, ZeRO-3, bf16 + AdamW, full remat, 8 x H100: one sequence per data-parallel group
   (``dp = 8 / cp`` sequences per step), for each sequence length and ``cp``: state, temporaries and peak
   per device, and the bytes attention moves over cp per step (K/V all-gathers and their dK/dV
   reduce-scatters, :func:`attention_bytes`) against the formula
   ``layers x (fwd + recompute + bwd) x 2 x seq x kv_heads x head_dim x 2 bytes``.
2. The 1T-class plan (1.1T parameters, dp=512 x tp=8 on 4,096 H100s, 2,048-token rows) at stage 3 with
   sequence parallelism (the default) and without.
3. ``--stretch``: a 1,048,576-token Llama-3-8B sequence on 64 H100s (cp=64) with the nested remat policy.

Needs the CUDA compiler plugin (pip install -e ".[plan-gpu]"); no GPU. Compiles are minutes each.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import jax

jax.config.update("jax_platforms", "cpu")
import zjax  # noqa: E402

zjax.simulate_cpu_devices(8)
from zjax.models import PRESETS, DecoderConfig  # noqa: E402

LLAMA_1T = DecoderConfig(vocab=32000, embed=16384, layers=256, heads=128, head_dim=128, mlp=65536, max_len=2048)
GB = 1e9


def cp_formula(cfg: DecoderConfig, seq: int, cp: int) -> float:
    """Bytes attention moves over cp per step per device in the all-gather mode (the planner's volume: an
    all-gather counts its result, a reduce-scatter its operand): per layer, one sequence's K and V gathered
    whole in the forward and again in the recompute, dK and dV reduce-scattered in the backward (bf16)."""
    kv = 2 * seq * cfg.num_kv_heads * cfg.head_dim * 2  # K and V of one sequence, bf16
    return 0.0 if cp == 1 else cfg.layers * 3 * kv


def attention_bytes(rows: list[dict]) -> None:
    """Each row's cp attention traffic: its collectives over cp alone, less, when dp is 1 (ZeRO's shards then
    span cp alone), the ZeRO traffic that a dp x cp = 8 row of the same table moves over dp x cp."""
    zero = next((r["comm_by_axes_gb"].get("dpxcp") for r in rows if "dpxcp" in r["comm_by_axes_gb"]), None)
    for r in rows:
        cp_only = r["comm_by_axes_gb"].get("cp", 0.0)
        if r["mesh"].get("dp", 1) == 1 and r["mesh"].get("cp", 1) > 1:
            r["cp_attention_gb"] = None if zero is None else round(cp_only - zero, 4)
        else:
            r["cp_attention_gb"] = round(cp_only, 4)


def one(model: DecoderConfig, mesh: dict[str, int], rows: int, seq: int, remat: str = "full", rules=None) -> dict:
    start = time.perf_counter()
    est = zjax.planner.estimate(
        dataclasses.replace(model, max_len=seq),
        mesh=mesh,
        stages=(3,),
        remat=remat,
        batch_size=rows,
        seq_len=seq,
        target="h100",
        rules=rules,
    )
    row = est.rows[0]
    by_axes = {"x".join(k) or "-": v for k, v in row.comm.by_axes.items()}
    return {
        "mesh": mesh,
        "seq": seq,
        "rows": rows,
        "remat": remat,
        "state_gb": round(row.compiled["state"] / GB, 3),
        "temp_gb": round(row.compiled["temp"] / GB, 3),
        "peak_gb": round(row.compiled["total"] / GB, 3),
        "comm_by_axes_gb": {k: round(v / GB, 4) for k, v in by_axes.items()},
        "comm_total_gb": round(row.comm.total_volume / GB, 4),
        "seconds": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--seqs", default="8192,32768,131072")
    ap.add_argument("--cps", default="1,2,4,8")
    ap.add_argument("--skip-1t", action="store_true")
    ap.add_argument("--stretch", action="store_true")
    args = ap.parse_args()
    cfg = PRESETS["llama3-8b"]
    out: dict = {"device": "H100 (deviceless XLA:GPU)", "jax": jax.__version__, "llama3_8b": []}
    print("Llama-3-8B, stage 3, bf16, full remat, 8 x H100: per device")
    head = f"{'seq':>8} {'cp':>3} {'state GB':>9} {'temp GB':>8} {'peak GB':>8} {'cp GB/step':>10} {'formula':>8}"
    print(head + " compile")
    for seq in [int(s) for s in args.seqs.split(",")]:
        rows = []
        for cp in [int(c) for c in args.cps.split(",")]:
            r = one(cfg, {"dp": 8 // cp, "cp": cp}, 8 // cp, seq)
            r["cp_formula_gb"] = round(cp_formula(cfg, seq, cp) / GB, 4)
            rows.append(r)
        attention_bytes(rows)
        for r in rows:
            got = float("nan") if r["cp_attention_gb"] is None else r["cp_attention_gb"]
            cp = r["mesh"]["cp"]
            print(
                f"{seq:>8} {cp:>3} {r['state_gb']:>9.3f} {r['temp_gb']:>8.3f} {r['peak_gb']:>8.3f} {got:>10.3f} "
                f"{r['cp_formula_gb']:>8.3f} {r['seconds']:>6.1f}s",
                flush=True,
            )
        out["llama3_8b"] += rows
    if not args.skip_1t:
        out["1t"] = []
        for sp in (True, False):
            r = one(LLAMA_1T, {"dp": 512, "tp": 8}, 512, 2048, rules=zjax.Rules(sequence_parallel=sp))
            r["sequence_parallel"] = sp
            out["1t"].append(r)
            print(
                f"1T-class dp=512 x tp=8, sequence parallelism {'on' if sp else 'off'}: temp {r['temp_gb']} GB, "
                f"peak {r['peak_gb']} GB ({r['seconds']} s)"
            )
    if args.stretch:
        r = one(cfg, {"dp": 1, "cp": 64}, 1, 1 << 20, remat="nested")
        out["stretch_1m"] = r
        print(
            f"1,048,576 tokens, cp=64, nested remat: temp {r['temp_gb']} GB, peak {r['peak_gb']} GB ({r['seconds']} s)"
        )
    if args.json:
        zjax.write_json_atomic(args.json, out)


if __name__ == "__main__":
    main()
