"""Remat policies on the example LM: compiled temp bytes per device and FLOPs relative to ``none``.

    python benchmarks/remat.py --preset small --stage 3 --mesh dp=8 --json runs/remat.json

FLOPs come from ``compiled.cost_analysis()``, which counts a scanned layer's body once: the ratios
compare policies fairly, the absolute numbers are per layer plus the unscanned parts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from train_lm import parse_mesh  # noqa: E402

from zjax import write_json_atomic  # noqa: E402


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--mesh", type=parse_mesh, default={"dp": 8})
    p.add_argument("--precision", default="fp32", help="fp32 by default: CPU upcasts bf16 temporaries")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    import jax

    import zjax

    zjax.simulate_cpu_devices(args.devices)
    import jax.numpy as jnp
    import optax

    from zjax.models import PRESETS, Decoder, lm_loss
    from zjax.remat import POLICIES

    mesh = zjax.make_mesh(**args.mesh)
    batch = jax.ShapeDtypeStruct((args.batch_size, args.seq_len + 1), jnp.int32)
    rows = []
    for name in POLICIES:
        cfg = PRESETS[args.preset]
        cfg = type(cfg)(**{**cfg.__dict__, "max_len": args.seq_len, "remat": name})
        model = Decoder(cfg)
        plan = zjax.Plan(mesh, stage=args.stage, precision=args.precision)
        dummy = jnp.zeros((1, args.seq_len), jnp.int32)
        state = plan.abstract_state(
            lambda r, m=model, d=dummy: m.init(r, d)["params"], optax.adamw(1e-3), jax.random.key(0)
        )
        step = plan.train_step(lambda prm, b, m=model: lm_loss(m, prm, b))
        compiled = step.lower(state, batch).compile()
        rows.append(
            {
                "policy": name,
                "temp_bytes_per_device": int(compiled.memory_analysis().temp_size_in_bytes),
                "flops": float(compiled.cost_analysis()["flops"]),
            }
        )
    base = next(r for r in rows if r["policy"] == "none")
    print(
        f"{args.preset} LM, stage {args.stage}, {args.precision}, mesh {args.mesh}, "
        f"batch {args.batch_size}x{args.seq_len}"
    )
    print(f"{'policy':<18}{'temp / device':>16}{'temp vs none':>14}{'FLOPs vs none':>15}")
    for r in rows:
        r["temp_vs_none"] = r["temp_bytes_per_device"] / base["temp_bytes_per_device"]
        r["flops_vs_none"] = r["flops"] / base["flops"]
        print(
            f"{r['policy']:<18}{r['temp_bytes_per_device'] / 2**20:>12.2f} MiB"
            f"{r['temp_vs_none']:>14.3f}{r['flops_vs_none']:>15.3f}"
        )
    if args.json:
        write_json_atomic(args.json, {"rows": rows, "args": {k: str(v) for k, v in vars(args).items()}})
    return rows


if __name__ == "__main__":
    main()
