"""Per-device memory of the example LM for ZeRO stages 0-3: the formula beside the compiled step.

    python benchmarks/memory_per_stage.py --preset medium --mesh dp=8 --json runs/memory.json

Nothing is allocated: the state is abstract and the step is compiled ahead of time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from train_lm import parse_mesh  # noqa: E402

from zjax import write_json_atomic  # noqa: E402


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="medium")
    p.add_argument("--mesh", type=parse_mesh, default={"dp": 8})
    p.add_argument("--precision", default="bf16")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    import jax

    import zjax

    zjax.simulate_cpu_devices(args.devices)
    import jax.numpy as jnp
    import optax

    from zjax.models import PRESETS, Decoder, lm_loss

    cfg = PRESETS[args.preset]
    cfg = type(cfg)(**{**cfg.__dict__, "max_len": args.seq_len})
    model = Decoder(cfg)
    mesh = zjax.make_mesh(**args.mesh)
    batch = jax.ShapeDtypeStruct((args.batch_size, args.seq_len + 1), jnp.int32)
    rows = []
    for stage in range(4):
        start = time.perf_counter()
        plan = zjax.Plan(mesh, stage=stage, precision=args.precision)
        state = plan.abstract_state(
            lambda r: model.init(r, jnp.zeros((1, args.seq_len), jnp.int32))["params"],
            optax.adamw(1e-3),
            jax.random.key(0),
        )
        step = plan.train_step(lambda prm, b: lm_loss(model, prm, b), accum_steps=args.accum)
        report = step.memory_report(state, batch)
        row = report.to_dict() | {"compile_seconds": round(time.perf_counter() - start, 2), "preset": args.preset}
        rows.append(row)
        print(report, f"\n  (compiled in {row['compile_seconds']} s)\n")

    psi = rows[0]["num_params"]
    print(f"{'stage':>5} {'theory B/param':>15} {'compiled B/param':>17} {'compiled state':>15} {'temp':>12}")
    for r in rows:
        s = r["state_bytes_per_device"]
        print(
            f"{r['stage']:>5} {s['theory'] / psi:>15.3f} {s['compiled'] / psi:>17.3f} "
            f"{s['compiled'] / 2**20:>12.2f} MiB {r['temp_bytes_per_device'] / 2**20:>8.2f} MiB"
        )
    if args.json:
        write_json_atomic(args.json, {"rows": rows})
    return rows


if __name__ == "__main__":
    main()
