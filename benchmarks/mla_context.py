"""Multi-head latent attention under context parallelism: what attention's collectives move over ``cp``.

    python benchmarks/mla_context.py [--json runs/mla_context.json] [--cp 8] [--seq 4096]

A DeepSeek-V3-shaped layer (128 heads, 512 + 64 latent values per token, query/key heads of 192, value heads of
128) and a grouped-query layer whose keys and values are as wide as MLA's up-projected ones (128 heads of 192,
the values padded to the keys' width as zjax's MLA pads them), one sequence split over ``cp`` ranks, bf16, full
remat, stage 0, compiled on XLA:CPU (the partitioned program's collectives: the same on any backend). Attention's
bytes are the all-gather mode's collective volume less the ring mode's (in the ring, keys and values travel by
permutes; the two programs' other collectives, the weight gradients' sums, are the same): in the all-gather mode
MLA's ranks gather the latent and up-project their own keys and values; gathering the keys and values moves them.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax

jax.config.update("jax_platforms", "cpu")
import zjax  # noqa: E402

zjax.simulate_cpu_devices(8)
from zjax.models import MLA, DecoderConfig  # noqa: E402

MB = 1e6
KINDS = ("all-gather", "reduce-scatter", "all-reduce")


def attention_bytes(cfg: DecoderConfig, cp: int, seq: int) -> dict[str, float]:
    """Attention's collective volume per kind over ``cp`` per device per step (bytes)."""
    volume = {}
    for mode in ("all-gather", "ring"):
        est = zjax.planner.estimate(
            dataclasses.replace(cfg, context_mode=mode), mesh={"cp": cp}, stages=(0,), batch_size=1, seq_len=seq
        )
        volume[mode] = est.rows[0].comm.volume
    return {k: float(volume["all-gather"][k] - volume["ring"][k]) for k in KINDS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    layer = DecoderConfig(vocab=1024, embed=7168, layers=1, heads=128, head_dim=192, mlp=2048, max_len=args.seq)
    models = {"mla (deepseek-v3)": dataclasses.replace(layer, mla=MLA()), "gqa, K/V as wide": layer}
    rows = []
    print(f"{'layer':<20} {'cp':>3} {'seq':>6} | {'gather':>8} {'scatter':>8} {'all-red':>8} {'total':>8} | compile")
    print("-" * 76)
    for name, cfg in models.items():
        t0 = time.perf_counter()
        got = attention_bytes(cfg, args.cp, args.seq)
        seconds = time.perf_counter() - t0
        total = sum(got.values())
        rows.append({"layer": name, "cp": args.cp, "seq": args.seq, **got, "total": total})
        gathered, scattered, reduced = (got[k] / MB for k in KINDS)
        print(
            f"{name:<20} {args.cp:>3} {args.seq:>6} | {gathered:>8.2f} {scattered:>8.2f} {reduced:>8.2f} "
            f"{total / MB:>8.2f} | {seconds:.1f}s"
        )
    ratio = rows[0]["total"] / rows[1]["total"]
    print(f"MB per device per step of one layer's attention over cp; MLA moves {ratio:.4f}x (1/{1 / ratio:.0f})")
    if args.json:
        zjax.write_json_atomic(Path(args.json), {"rows": rows, "ratio": ratio})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
