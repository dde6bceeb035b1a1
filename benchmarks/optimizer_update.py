"""The mixed-precision AdamW update: optax.adamw + cast vs zjax's fused update (reference and Pallas).

    python benchmarks/optimizer_update.py --params 16777216 --json runs/optimizer.json

Bytes per parameter: XLA's cost analysis for the XLA paths; the kernel's own loads and stores for the
Pallas path (the one-pass floor: bf16 grad 2 + fp32 master, m, v 12 in; 12 + bf16 copy 2 out = 28).
GB/s is measured on a GPU only, beside a plain device copy of the same bytes. On CPU the Pallas path runs
in interpret mode (a correctness tool, not a speed figure) and is left out unless --interpret.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from zjax import write_json_atomic  # noqa: E402

KERNEL_BYTES_PER_PARAM = 2 + 3 * 4 + 3 * 4 + 2


def _time(fn, args, repeats: int) -> float:
    import jax

    out = fn(*args)
    jax.block_until_ready(out)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def _time_threaded(fn, grad, master, state, repeats: int) -> float:
    """Median seconds of ``fn(grad, master, state) -> (master, state, ...)`` with its outputs fed back in."""
    import jax

    master, state = fn(grad, master, state)[:2]
    jax.block_until_ready(master)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        master, state = fn(grad, master, state)[:2]
        jax.block_until_ready((master, state))
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", type=int, default=1 << 22)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--interpret", action="store_true", help="also time the Pallas kernel in interpret mode on CPU")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument(
        "--sweep", default="", help="GPU: also time the kernel at these block_size/num_warps, e.g. 4096/8,8192/8"
    )
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import optax

    from zjax.pallas import FusedAdamWConfig, fused_adamw

    n = args.params
    gpu = jax.default_backend() == "gpu"
    key = jax.random.key(0)
    grad = jax.random.normal(key, (n,), jnp.bfloat16)
    master = jax.random.normal(key, (n,), jnp.float32)
    one = jnp.float32(1.0)

    tx = optax.adamw(1e-3, weight_decay=0.1)

    def optax_step(g, p, state):
        updates, state = tx.update(g.astype(jnp.float32), state, p)
        p = optax.apply_updates(p, updates)
        return p, state, p.astype(jnp.bfloat16)

    def fused_step(impl, interpret=None, config=None):
        f = fused_adamw(1e-3, weight_decay=0.1, implementation=impl, interpret=interpret, config=config)

        def step(g, p, state):
            return f.fused_apply(
                g, state, p, compute_dtype=jnp.bfloat16, inv_scale=one, apply=one, mesh=None, specs=None
            )

        return f, step

    rows = []

    def measure(name, fn, state, bytes_per_param=None):
        # master and state are donated, as in a train step: an update in place needs no copy of them
        # (without donation, the kernel's in-place outputs cost XLA a copy of master, m and v first)
        jitted = jax.jit(fn, donate_argnums=(1, 2))
        cost = jitted.lower(grad, master, state).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        xla_bytes = float(cost.get("bytes accessed", 0.0)) / n if cost else None
        bpp = bytes_per_param if bytes_per_param is not None else xla_bytes
        seconds = _time_threaded(jitted, grad, jnp.copy(master), state, args.repeats)
        rows.append(
            {
                "impl": name,
                "seconds": seconds,
                "bytes_per_param": bpp,
                "xla_cost_bytes_per_param": xla_bytes,
                "gbps": bpp * n / seconds / 1e9 if gpu and bpp else None,
            }
        )

    measure("optax.adamw+cast", optax_step, tx.init(master))
    f_xla, step_xla = fused_step("xla")
    measure("fused-xla (reference)", step_xla, f_xla.init(master))
    if gpu or args.interpret:
        f_pl, step_pl = fused_step("pallas", interpret=None)
        measure("fused-pallas" + ("" if gpu else " (interpret)"), step_pl, f_pl.init(master), KERNEL_BYTES_PER_PARAM)
    for item in filter(None, args.sweep.split(",")) if gpu else ():
        block, warps = (int(x) for x in item.split("/"))
        f_sw, step_sw = fused_step("pallas", config=FusedAdamWConfig(block_size=block, num_warps=warps))
        measure(f"fused-pallas b={block} w={warps}", step_sw, f_sw.init(master), KERNEL_BYTES_PER_PARAM)
    copy = jax.jit(lambda x: x * 1.0)
    blob = jnp.zeros((KERNEL_BYTES_PER_PARAM * n // 8,), jnp.float32)  # reads + writes 28 bytes per param
    copy_seconds = _time(copy, (blob,), args.repeats)
    copy_gbps = KERNEL_BYTES_PER_PARAM * n / copy_seconds / 1e9

    print(f"AdamW update of {n:,} params on {jax.devices()[0].device_kind} ({jax.default_backend()})")
    print(f"{'impl':<26}{'ms':>10}{'B/param':>10}{'XLA cost B/param':>18}{'GB/s':>9}{'% of copy':>11}")
    for r in rows:
        gbps = r["gbps"]
        pct = f"{100 * gbps / copy_gbps:.0f}%" if gbps else "-"
        xla = f"{r['xla_cost_bytes_per_param']:.1f}" if r["xla_cost_bytes_per_param"] else "-"
        print(
            f"{r['impl']:<26}{r['seconds'] * 1e3:>10.2f}{r['bytes_per_param']:>10.1f}{xla:>18}"
            f"{(f'{gbps:.0f}' if gbps else '-'):>9}{pct:>11}"
        )
    print(f"{'device copy (28 B/param)':<26}{copy_seconds * 1e3:>10.2f}{'':>10}{'':>18}{copy_gbps:>9.0f}")
    result = {"params": n, "rows": rows, "copy_gbps": copy_gbps, "backend": jax.default_backend()}
    if args.json:
        write_json_atomic(args.json, result)
    return result


if __name__ == "__main__":
    main()
