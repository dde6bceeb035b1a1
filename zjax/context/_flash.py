"""Packed rows on GPUs: JAX's Pallas (Triton) flash attention, which takes segment ids.

cuDNN's kernel behind ``jax.nn.dot_product_attention`` takes lengths, not segment ids, so a packed row
(several documents in one sequence) would fall to XLA's path with a ``[batch, 1, seq, seq]`` mask. JAX ships a
flash attention for GPUs in Pallas (``jax.experimental.pallas.ops.gpu.attention.mha``: forward and
backward kernels, online softmax over key blocks, a segment mask per block) that never holds ``[S, S]``.
It wants as many key/value heads as query heads, so grouped-query K/V are repeated per shard (linear in
the sequence). Off a GPU the same kernels run in Pallas's interpreter (tests).

Block sizes, measured on one H200 (jax 0.11.2, forward + backward, bf16, Llama-3-8B's 32/8 heads of 128, one
row packed with 4 documents): the kernel's default backward blocks of 32 ran 14.2 ms at 8K tokens and 208 ms
at 32K; backward blocks of 64 run 8.1 and 106 ms (240 and 290 TFLOP/s of causal attention), 3.1x and 6.2x
faster than the blocked attention, within 1.9x of cuDNN on the same rows unpacked; 128-row dK/dV blocks
were 2x slower again (``benchmarks/gpu_kernels.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 128  # the forward's query and key block
BACKWARD_BLOCK = 64  # the backward kernels' query and key/value blocks


def flash_fits(length: int, head_dim: int, window: int | None) -> bool:
    """Whether the kernel takes this row: no sliding window, the length a multiple of its block, and a
    head_dim of at most 128 (the blocks above were measured there; larger heads would need smaller blocks
    to fit Triton's shared memory)."""
    return window is None and length % BLOCK == 0 and head_dim <= 128


def flash(q, k, v, segment_ids, *, scale: float, interpret: bool, blocks=None) -> jax.Array:
    """Causal attention of ``q [B, S, H, D]`` over ``k, v [B, S, K, D]`` within segments, on one shard;
    ``blocks``: the kernel's ``BlockSizes`` (default: ``BLOCK`` forward, ``BACKWARD_BLOCK`` backward)."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    group = q.shape[2] // k.shape[2]
    if group > 1:
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    if blocks is None:
        b = BACKWARD_BLOCK
        blocks = pallas_attention.BlockSizes(BLOCK, BLOCK, b, b, b, b)
    return pallas_attention.mha(
        q,
        k,
        v,
        segment_ids,
        sm_scale=scale,
        causal=True,
        block_sizes=blocks,
        interpret=interpret,
    )
