"""The kernels a GPU run picks, timed on one GPU: attention over packed rows, and MoE's grouped matmuls.

    python benchmarks/gpu_kernels.py [--json runs/gpu_kernels.json] [--tiny] [--seqs 8192,32768]

1. Attention, forward + backward, Llama-3-8B's heads (32 query, 8 key/value, head_dim 128), bf16, one row of
   S tokens packed with 4 documents: the Pallas flash kernel with segment ids (what zjax picks on GPUs for
   packed rows), zjax's blocked attention, XLA's dense attention with a ``[S, S]`` segment mask (only where it
   fits), and cuDNN on the same row unpacked (the speed a packed row could hope for). Per implementation:
   median seconds, the compiled temporaries, and the output's largest difference from the blocked attention.
2. MoE's three grouped matmuls (``zjax.experts.grouped_swiglu``), forward + backward, Mixtral's expert shapes
   (8 experts, 4,096 -> 14,336), top-2 rows of T tokens: tokamax's Triton ``ragged_dot`` against
   ``jax.lax.ragged_dot`` (which XLA:GPU computes densely in jax 0.10), with their temporaries.

Off a GPU it runs tiny sizes (the Pallas kernel in its interpreter) so that it stays alive; figures then mean
nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path


def _timed(fn, args, repeats: int) -> tuple[float, int | None]:
    import jax

    compiled = jax.jit(fn).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    memory = compiled.memory_analysis()
    return sorted(times)[len(times) // 2], None if memory is None else memory.temp_size_in_bytes


def attention_rows(
    seq: int, tiny: bool, repeats: int, sweep: list[tuple[int, ...]] = (), head_dim: int = 128
) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from zjax.context import attention

    heads, kv_heads, head_dim = (4, 2, 32) if tiny else (32, 8, head_dim)
    dtype = jnp.float32 if tiny else jnp.bfloat16
    r = np.random.default_rng(0)
    q = jnp.asarray(r.normal(size=(1, seq, heads, head_dim)), dtype)
    k = jnp.asarray(r.normal(size=(1, seq, kv_heads, head_dim)), dtype)
    v = jnp.asarray(r.normal(size=(1, seq, kv_heads, head_dim)), dtype)
    cuts = np.sort(r.choice(np.arange(1, seq), size=3, replace=False))
    seg = jnp.asarray(np.searchsorted(cuts, np.arange(seq), side="right")[None].astype(np.int32))
    w = jnp.asarray(r.normal(size=q.shape), dtype)

    def fwd_bwd(impl, packed):
        def loss(q, k, v):
            out = attention(q, k, v, segment_ids=seg if packed else None, implementation=impl)
            return jnp.sum(out.astype(jnp.float32) * w), out

        return lambda q, k, v: jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)

    gpu = jax.default_backend() == "gpu"
    cases = [("pallas", True), ("blocked", True)]
    if seq * seq * heads * 4 < 20e9:  # the dense path's fp32 scores must fit
        cases.append(("xla", True))
    if gpu:
        cases.append(("cudnn", False))

    def swept(sizes):  # the kernel alone (no mesh), at other block sizes
        from jax.experimental.pallas.ops.gpu.attention import BlockSizes

        from zjax.context._flash import flash

        blocks = BlockSizes(*sizes)

        def loss(q, k, v):
            out = flash(q, k, v, seg, scale=1 / math.sqrt(head_dim), interpret=False, blocks=blocks)
            return jnp.sum(out.astype(jnp.float32) * w), out

        return lambda q, k, v: jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)

    cases += [(f"pallas blocks={'/'.join(map(str, b))}", b) for b in sweep]
    reference = jax.jit(lambda q, k, v: attention(q, k, v, segment_ids=seg, implementation="blocked"))(q, k, v)
    rows = []
    for impl, packed in cases:
        row = {"seq": seq, "head_dim": head_dim, "implementation": impl, "packed": packed is not False}
        try:
            fn = swept(packed) if isinstance(packed, tuple) else fwd_bwd(impl, packed)
            seconds, temp = _timed(fn, (q, k, v), repeats)
            (_, out), _ = jax.jit(fn)(q, k, v)
            diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - reference.astype(jnp.float32)))) if packed else None
            # causal attention's matmul FLOPs, forward (2) + backward (5), halved by the causal mask
            flops = 7 * 2 * seq * seq * heads * head_dim / 2
            row.update(seconds=seconds, temp_bytes=temp, max_diff_vs_blocked=diff, tflops=flops / seconds / 1e12)
        except Exception as e:  # noqa: BLE001 - a benchmark reports what failed and goes on
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def grouped_rows(tokens: int, tiny: bool, repeats: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from zjax.experts._dispatch import grouped_swiglu

    experts, top_k, embed, mlp = (4, 2, 64, 128) if tiny else (8, 2, 4096, 14336)
    dtype = jnp.float32 if tiny else jnp.bfloat16
    r = np.random.default_rng(0)
    n = tokens * top_k
    rows = jnp.asarray(r.normal(size=(n, embed)), dtype)
    ids = jnp.asarray(r.integers(0, experts, n), jnp.int32)
    scale = 1 / math.sqrt(embed)
    ws = [jnp.asarray(r.normal(size=s) * scale, dtype) for s in ((experts, embed, mlp),) * 2 + ((experts, mlp, embed),)]
    out = []
    for grouped in ("tokamax", "xla"):
        row = {"tokens": tokens, "rows": n, "grouped": grouped}
        try:

            def loss(rows, a, b, c, grouped=grouped):
                return jnp.sum(grouped_swiglu(rows, ids, experts, a, b, c, grouped).astype(jnp.float32))

            fn = jax.value_and_grad(loss, (0, 1, 2, 3))
            seconds, temp = _timed(fn, (rows, *ws), repeats)
            flops = 3 * 3 * 2 * n * embed * mlp  # three matmuls, forward + 2 backward
            row.update(seconds=seconds, temp_bytes=temp, tflops=flops / seconds / 1e12)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (the default without a GPU)")
    parser.add_argument("--seqs", default="8192,32768")
    parser.add_argument("--tokens", default="8192")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--flash-sweep",
        default="",
        help="GPU: Pallas attention BlockSizes to try (fwd q/k, dkv q/kv, dq q/kv), e.g. 128/64/64/64/64/64",
    )
    parser.add_argument("--sections", default="attention,grouped")
    parser.add_argument("--head-dims", default="128", help="attention head_dim values, e.g. 64,96,128")
    args = parser.parse_args(argv)
    import jax

    tiny = args.tiny or jax.default_backend() != "gpu"
    seqs = [256] if tiny else [int(s) for s in args.seqs.split(",")]
    tokens = [64] if tiny else [int(t) for t in args.tokens.split(",")]
    result: dict = {
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "tiny": tiny,
    }
    sweep = [tuple(int(x) for x in b.split("/")) for b in args.flash_sweep.split(",") if b and not tiny]
    if "attention" in args.sections:
        dims = [32] if tiny else [int(d) for d in args.head_dims.split(",")]
        result["attention"] = [
            row for d in dims for s in seqs for row in attention_rows(s, tiny, args.repeats, sweep, d)
        ]
    if "grouped" in args.sections:
        result["grouped_matmul"] = [row for t in tokens for row in grouped_rows(t, tiny, args.repeats)]
    if args.json is not None:
        from zjax import write_json_atomic

        write_json_atomic(args.json, result)
        print(f"written to {args.json}")
    return result


if __name__ == "__main__":
    main()
