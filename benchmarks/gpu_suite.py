"""What only a GPU can measure, in one script (under 10 minutes on one H100); tiny sizes elsewhere.

    python benchmarks/gpu_suite.py [--json runs/gpu_suite.json] [--tiny]

1. Fused AdamW: GB/s of the Pallas kernel beside a device copy of the same bytes and optax.adamw
   (benchmarks/optimizer_update.py; goal: the kernel >= 90% of the copy).
2. Planned vs measured peak memory of a train step: the compiled program's ``argument + output - alias +
   temp`` beside ``device.memory_stats()["peak_bytes_in_use"]`` after the steps (goal: within 10%).
3. Step time and MFU of a LLaMA-shaped decoder at each ZeRO stage (the model's FLOPs per token from
   ``zjax.metrics.flops_per_token`` times tokens per second over the devices' dense bf16 peak; the
   compiler's count is not the numerator: it counts a scanned layer body once; "unknown device" where there
   is no peak to compare with, e.g. a CPU), with and without the persistent compute copy
   (``--compute-copy keep,drop``: ``Plan(compute_copy=False)`` casts the fp32 master every step).
4. What the quantized collectives (``quantized_comm``) and the dropped compute copy add on each device
   (``--codec``): GB/s of int8 block quantization, dequantization and the fp32 -> bf16 cast beside a device
   copy, and milliseconds per billion parameters; the one-pass quantization kernel at each ``--quantize-sweep``
   size, its values against XLA's, and whether ``zjax.comm.quantize`` runs it on this device.

On a CPU it runs everything at tiny sizes so that it stays alive in CI; its figures then mean nothing.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def step_figures(stage: int, tiny: bool, compute_copy: bool = True) -> dict:
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
    plan = zjax.Plan(zjax.make_mesh(dp=n), stage=stage, precision="bf16", gpu_overlap=n > 1, compute_copy=compute_copy)
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
        "compute_copy": compute_copy,
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


def codec_figures(tiny: bool, repeats: int = 10, sweep: str = "16/4") -> dict:
    """GB/s (bytes read + written) of what qwZ/qgZ and ``compute_copy=False`` run per gather, beside a copy; the
    one-pass quantization kernel (``zjax.pallas.quantize``) at each ``blocks/num_warps`` of ``sweep``."""
    import jax
    import jax.numpy as jnp
    import optimizer_update

    from zjax.comm import _quantize
    from zjax.pallas import quantize as kernel

    n = 1 << (16 if tiny else 28)
    x = jax.random.normal(jax.random.key(0), (n // 4096, 4096), jnp.float32)
    xb = x.astype(jnp.bfloat16)
    xla = functools.partial(_quantize.quantize, kernel=False)  # XLA's fusions, on any device
    q, s = jax.jit(xla)(xb)
    q4, _ = jax.jit(lambda a: xla(a, bits=4))(xb)
    scale_bytes = s.size * 4

    cases = {  # name: (fn, args, bytes read + written)
        "copy bf16": (lambda a: a + jnp.bfloat16(1), (xb,), 4 * n),
        "quantize bf16 -> int8 + scales": (xla, (xb,), 3 * n + scale_bytes),
        "dequantize int8 + scales -> bf16": (
            lambda a, b: _quantize.dequantize(a, b, jnp.bfloat16),
            (q, s),
            3 * n + scale_bytes,
        ),
        "quantize bf16 -> int4 + scales": (
            lambda a: xla(a, bits=4),
            (xb,),
            2 * n + n // 2 + scale_bytes,
        ),
        "dequantize int4 + scales -> bf16": (
            lambda a, b: _quantize.dequantize(a, b, jnp.bfloat16),
            (q4, s),
            n // 2 + 2 * n + scale_bytes,
        ),
        "cast fp32 -> bf16": (lambda a: a.astype(jnp.bfloat16), (x,), 6 * n),
        "cast fp32 -> int8 + scales": (xla, (x,), 5 * n + scale_bytes),
    }
    interpret = jax.default_backend() != "gpu"
    checks = {}
    for setting in filter(None, sweep.split(",")):
        blocks, warps = (int(v) for v in setting.split("/"))
        config = kernel.QuantizeConfig(blocks, warps)
        for name, a, bits, nbytes in (
            ("bf16 -> int8", xb, 8, 3 * n + scale_bytes),
            ("bf16 -> int4", xb, 4, 2 * n + n // 2 + scale_bytes),
            ("fp32 -> int8", x, 8, 5 * n + scale_bytes),
        ):
            fn = functools.partial(kernel.quantize_blocks, block=256, bits=bits, config=config, interpret=interpret)
            cases[f"kernel {setting} {name}"] = (fn, (a,), nbytes)
            if setting == sweep.split(",")[0]:
                checks[name] = _kernel_agrees(jax.jit(fn), jax.jit(lambda v, b=bits: xla(v, bits=b)), a)
    rows = {}
    for name, (fn, args, nbytes) in cases.items():
        seconds = optimizer_update._time(jax.jit(fn), args, repeats)  # the median of the repeats
        rows[name] = {"seconds": seconds, "gb_per_s": nbytes / seconds / 1e9, "ms_per_billion": seconds / n * 1e12}
    copy = rows["copy bf16"]["gb_per_s"]
    for r in rows.values():
        r["vs_copy"] = r["gb_per_s"] / copy
    print(f"{'per element of ' + format(n, ','):<36}{'GB/s':>9}{'vs copy':>9}{'ms per 1e9':>12}")
    for name, r in rows.items():
        print(f"{name:<36}{r['gb_per_s']:>9,.0f}{r['vs_copy']:>9.0%}{r['ms_per_billion']:>12.2f}")
    for name, c in checks.items():
        print(f"kernel {name} against the XLA path: {c}")
    # what zjax.comm.quantize itself compiles to on this device, and that it gives the XLA path's values
    default = jax.jit(_quantize.quantize)
    via_kernel = kernel.TRITON_NAME in default.lower(xb).compile().as_text()
    same = all(bool((a == b).all()) for a, b in zip(default(xb), jax.jit(xla)(xb), strict=True))
    print(f"zjax.comm.quantize on {jax.devices()[0].platform}: through the kernel {via_kernel}, the same values {same}")
    return {"elements": n, "rows": rows, "kernel_checks": checks, "default": {"kernel": via_kernel, "same": same}}


def _kernel_agrees(kernel_fn, xla_fn, x) -> dict:
    """How far the kernel's integers and scales are from the XLA path's, and whether a NaN survives both."""
    import jax.numpy as jnp
    import numpy as np

    (q, s), (qr, sr) = kernel_fn(x), xla_fn(x)
    if q.dtype == jnp.uint8:  # compare nibble by nibble, not the packed bytes
        q, qr = (np.concatenate([(v & 0xF).astype(np.int8), (v >> 4).astype(np.int8)], -1) for v in (q, qr))
    q, qr = np.asarray(q, np.int32), np.asarray(qr, np.int32)
    bad = x.at[3, 5].set(jnp.nan)
    nan_kernel, nan_xla = (bool(np.isnan(np.asarray(f(bad)[1])[3, 0])) for f in (kernel_fn, xla_fn))
    return {
        "values_differing": int((q != qr).sum()),
        "max_value_difference": int(np.abs(q - qr).max()),
        "max_scale_relative_difference": float(np.max(np.abs(np.asarray(s) / np.asarray(sr) - 1))),
        "nan_block_scale_is_nan": {"kernel": nan_kernel, "xla": nan_xla},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (the default without a GPU)")
    parser.add_argument("--stages", default="0,1,2,3", help="ZeRO stages to time, e.g. 0,3 ('' for none)")
    parser.add_argument("--no-adamw", action="store_true", help="skip the fused AdamW figures")
    parser.add_argument("--compute-copy", default="keep", help="keep, drop or keep,drop (Plan(compute_copy=...))")
    parser.add_argument("--codec", action="store_true", help="time int8 block (de)quantization and the cast")
    parser.add_argument(
        "--quantize-sweep", default="16/4", help="quantization kernel blocks/num_warps to time, e.g. 4/4,16/4,64/8"
    )
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
    if args.codec:
        out["codec"] = codec_figures(tiny, 10 if tiny else 50, args.quantize_sweep)
    copies = {"keep": True, "drop": False}
    out["steps"] = [
        step_figures(int(stage), tiny, copies[copy])
        for stage in args.stages.split(",")
        if stage
        for copy in args.compute_copy.split(",")
        if copy == "keep" or int(stage) == 3  # only stage 3 can drop the copy (its shards are cast, then gathered)
    ]
    print(f"{'stage':>5}{'copy':>6}{'step s':>10}{'tok/s':>12}{'planned GB':>12}{'measured GB':>13}{'MFU':>8}")
    for r in out["steps"]:
        measured = "-" if r["measured_peak_bytes"] is None else f"{r['measured_peak_bytes'] / 1e9:.3f}"
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        print(
            f"{r['stage']:>5}{'keep' if r['compute_copy'] else 'drop':>6}"
            f"{r['step_seconds']:>10.4f}{r['tokens_per_second']:>12,.0f}"
            f"{r['planned_peak_bytes'] / 1e9:>12.3f}{measured:>13}{mfu:>8}"
        )
    if args.json is not None:
        from zjax import write_json_atomic

        write_json_atomic(args.json, out)
        print(f"written to {args.json}")


if __name__ == "__main__":
    main()
