"""What only a GPU can measure, in one script (under 10 minutes on one H100); tiny sizes elsewhere.

    python benchmarks/gpu_suite.py [--json runs/gpu_suite.json] [--tiny]

1. Fused AdamW: GB/s of the Pallas kernel beside a device copy of the same bytes and optax.adamw
   (benchmarks/optimizer_update.py; goal: the kernel >= 90% of the copy).
2. Planned vs measured peak memory of a train step: the compiled program's ``argument + output - alias +
   temp`` beside ``device.memory_stats()["peak_bytes_in_use"]`` after the steps (goal: within 10%).
3. Step time and MFU of a LLaMA-shaped decoder at each ZeRO stage (the model's FLOPs per token from
   ``zjax.metrics.flops_per_token`` times tokens per second over the devices' dense bf16 peak; the
   compiler's count is not the numerator: it counts a scanned layer body once; "unknown device" where there
   is no peak to compare with, e.g. a CPU).

On a CPU it runs everything at tiny sizes so that it stays alive in CI; its figures then mean nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def step_figures(stage: int, tiny: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import zjax
    from zjax.models import PRESETS, Decoder, DecoderConfig, lm_loss
    from zjax.planner._gpu import cost_analysis
    from zjax.planner._targets import peak_flops

    cfg = (
        PRESETS["tiny"]
        if tiny
        else DecoderConfig(
            vocab=32000, embed=2048, layers=16, heads=16, head_dim=128, mlp=5632, max_len=2048, remat="dots"
        )
    )
    n = jax.device_count()
    rows = max(n, 8 if tiny else 8 * n)
    model = Decoder(cfg)
    # one device has no collectives to overlap: no overlap options (their names change between XLA versions)
    plan = zjax.Plan(zjax.make_mesh(dp=n), stage=stage, precision="bf16", gpu_overlap=n > 1)
    init = lambda r: model.init(r, jnp.zeros((1, cfg.max_len), jnp.int32))["params"]  # noqa: E731
    state = plan.init(init, optax.adamw(1e-4), jax.random.key(0))
    step = plan.train_step(lambda p, b: lm_loss(model, p, b))
    tokens = np.random.RandomState(0).randint(0, cfg.vocab, (rows, cfg.max_len + 1)).astype(np.int32)
    batch = plan.shard_batch(tokens)
    compiled = step.lower(state, batch).compile()
    report = step.memory_report(state, batch, compiled=compiled)
    state, m = step(state, batch)
    jax.block_until_ready(m["loss"])
    times = []
    for _ in range(3 if tiny else 10):
        start = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - start)
    seconds = sorted(times)[len(times) // 2]
    stats = jax.devices()[0].memory_stats() or {}
    measured = stats.get("peak_bytes_in_use")
    flops = (cost_analysis(compiled) or {}).get("flops")  # XLA counts a scanned layer body once: not MFU's numerator
    tokens_per_second = rows * cfg.max_len / seconds
    device_kind = jax.devices()[0].device_kind
    return {
        "stage": stage,
        "params": cfg.num_params,
        "step_seconds": seconds,
        "tokens_per_second": tokens_per_second,
        "planned_peak_bytes": report.peak_bytes,
        "measured_peak_bytes": measured,
        "peak_ratio": None if measured is None else measured / report.peak_bytes,
        "compiled_flops_per_device": flops,
        "model_flops_per_token": zjax.metrics.flops_per_token(cfg, cfg.max_len),
        # the model's work (PaLM's convention: 6 x matmul params + attention per token), not the compiler's count
        "mfu": zjax.metrics.mfu(tokens_per_second, cfg, cfg.max_len, device_kind, jax.device_count()),
        "device": "unknown device" if peak_flops(device_kind) is None else device_kind,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (the default without a GPU)")
    parser.add_argument("--stages", default="0,1,2,3", help="ZeRO stages to time, e.g. 0,3")
    parser.add_argument("--no-adamw", action="store_true", help="skip the fused AdamW figures")
    parser.add_argument("--adamw-sweep", default="", help="kernel block_size/num_warps to try, e.g. 4096/8,8192/8")
    args = parser.parse_args()
    import jax

    import zjax

    zjax.simulate_cpu_devices(8)  # only the CPU backend uses them (set before it starts)
    tiny = args.tiny or jax.default_backend() != "gpu"
    import optimizer_update

    out: dict = {"device": str(jax.devices()[0].device_kind), "tiny": tiny}
    if not args.no_adamw:
        sizes = ["--params", str(1 << 16 if tiny else 1 << 28), "--repeats", "3", "--sweep", args.adamw_sweep]
        out["fused_adamw"] = optimizer_update.main(sizes)
    # the measured peak is the process's: the first stage's is its own, a later one's at least the earlier's
    out["steps"] = [step_figures(int(stage), tiny) for stage in args.stages.split(",")]
    print(f"{'stage':>5}{'step s':>10}{'tok/s':>12}{'planned GB':>12}{'measured GB':>13}{'MFU':>8}")
    for r in out["steps"]:
        measured = "-" if r["measured_peak_bytes"] is None else f"{r['measured_peak_bytes'] / 1e9:.3f}"
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        print(
            f"{r['stage']:>5}{r['step_seconds']:>10.4f}{r['tokens_per_second']:>12,.0f}"
            f"{r['planned_peak_bytes'] / 1e9:>12.3f}{measured:>13}{mfu:>8}"
        )
    if args.json is not None:
        from zjax import write_json_atomic

        write_json_atomic(args.json, out)
        print(f"written to {args.json}")


if __name__ == "__main__":
    main()
