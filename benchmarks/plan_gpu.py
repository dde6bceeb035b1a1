"""The planner on the GPU compiler (deviceless XLA:GPU) beside the CPU path, and at scale.

    python benchmarks/plan_gpu.py [--json runs/plan_gpu.json] [--skip-cpu] [--skip-1t]

1. LLaMA2-7B shape, bf16 + AdamW, global batch 64 x 2048, full remat, stages 0-3 on 64 devices: compiled
   by XLA:CPU on 64 simulated devices and by XLA:GPU for 64 x H100. State, temporaries, collective bytes by
   kind and dtype, overlapped vs exposed (GPU), wall time of the whole table.
2. A 1T-class decoder (1.1T params) at stage 3 for 4,096 x H100 (dp=512 x tp=8): wall time and peak RSS.

Needs the CUDA compiler plugin (pip install "zjax[plan-gpu]"); no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import resource
import time
from collections import Counter
from pathlib import Path

import jax

jax.config.update("jax_platforms", "cpu")
import zjax  # noqa: E402

zjax.simulate_cpu_devices(64)
from zjax.models import DecoderConfig  # noqa: E402

LLAMA_1T = DecoderConfig(vocab=32000, embed=16384, layers=256, heads=128, head_dim=128, mlp=65536, max_len=2048)


def rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: KiB


def table(target: str | None) -> dict:
    start = time.perf_counter()
    est = zjax.planner.estimate("llama2-7b", mesh={"dp": 64}, batch_size=64, seq_len=2048, remat="full", target=target)
    wall = time.perf_counter() - start
    print(est)
    print(f"  whole table: {wall:.1f} s, peak RSS so far {rss_gb():.2f} GB\n")
    return est.to_dict() | {"wall_seconds": round(wall, 2), "peak_rss_gb": round(rss_gb(), 3)}


def dtypes_by_kind(target: str | None) -> dict[str, dict[str, int]]:
    """Collective counts by kind and dtype at stage 3 (the dtype XLA really moves)."""
    from zjax.planner._compile import partitioned_hlo

    devices = zjax.planner._gpu.gpu_devices(target, 64) if target else jax.devices()[:64]
    mesh = zjax.make_mesh(dp=64, devices=devices)
    import jax.numpy as jnp
    import optax

    from zjax.models import PRESETS, Decoder, lm_loss

    cfg = PRESETS["llama2-7b"]
    model = Decoder(cfg)
    plan = zjax.Plan(mesh, stage=3)
    state = plan.abstract_state(
        lambda r: model.init(r, jnp.zeros((1, cfg.max_len), jnp.int32))["params"], optax.adamw(1e-4), jax.random.key(0)
    )
    step = plan.train_step(lambda p, b: lm_loss(model, p, b))
    batch = jax.ShapeDtypeStruct((64, 2049), jnp.int32)
    # cuDNN attention is checked against the target, not this CPU (as the planner does)
    with zjax.planner._gpu.cudnn_for_target(target) if target else contextlib.nullcontext():
        lowered = step.lower(state, batch)
    text = lowered.compile().as_text() if target else partitioned_hlo(lowered)[1]
    pattern = r"= \(*(\w+)\[[^\n]*? (all-gather|reduce-scatter|all-reduce)(?:-start)?\("
    counts = Counter(f"{kind}:{dtype}" for dtype, kind in re.findall(pattern, text))
    return dict(sorted(counts.items()))


def one_trillion() -> dict:
    start = time.perf_counter()
    est = zjax.planner.estimate(
        LLAMA_1T, mesh={"dp": 512, "tp": 8}, stages=(3,), batch_size=512, seq_len=2048, target="h100"
    )
    wall = time.perf_counter() - start
    print(est)
    print(f"  1T-class on 4,096 x H100: {wall:.1f} s, peak RSS {rss_gb():.2f} GB\n")
    return est.to_dict() | {"wall_seconds": round(wall, 2), "peak_rss_gb": round(rss_gb(), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--skip-cpu", action="store_true")
    parser.add_argument("--skip-1t", action="store_true")
    args = parser.parse_args()
    out: dict = {"gpu": table("h100"), "gpu_stage3_collectives": dtypes_by_kind("h100")}
    print("stage 3 collectives by kind:dtype, GPU:", out["gpu_stage3_collectives"])
    if not args.skip_cpu:
        out["cpu"] = table(None)
        out["cpu_stage3_collectives"] = dtypes_by_kind(None)
        print("stage 3 collectives by kind:dtype, CPU:", out["cpu_stage3_collectives"])
    if not args.skip_1t:
        out["one_trillion"] = one_trillion()
    if args.json is not None:
        zjax.write_json_atomic(args.json, out)
        print(f"written to {args.json}")


if __name__ == "__main__":
    main()
