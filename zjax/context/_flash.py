"""Packed rows on GPUs: JAX's Pallas (Triton) flash attention, which takes segment ids.

cuDNN's kernel behind ``jax.nn.dot_product_attention`` takes lengths, not segment ids, so a packed row
(several documents in one sequence) would fall to XLA's path with a ``[batch, 1, seq, seq]`` mask. JAX ships a
flash attention for GPUs in Pallas (``jax.experimental.pallas.ops.gpu.attention.mha``: forward and
backward kernels, online softmax over key blocks, a segment mask per block) that never holds ``[S, S]``.
It wants as many key/value heads as query heads, so grouped-query K/V are repeated per shard (linear in
the sequence). Off a GPU the same kernels run in Pallas's interpreter (tests).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

BLOCK = 128  # the forward's query and key block; the backward's blocks are the kernel's defaults


def flash_fits(length: int, head_dim: int, window: int | None) -> bool:
    """Whether the kernel takes this row: no sliding window, the length a multiple of its block, and a
    head_dim it supports (it pads to a power of two; Triton's shared memory holds up to 256)."""
    return window is None and length % BLOCK == 0 and head_dim <= 256


def flash(q, k, v, segment_ids, *, scale: float, interpret: bool) -> jax.Array:
    """Causal attention of ``q [B, S, H, D]`` over ``k, v [B, S, K, D]`` within segments, on one shard."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    group = q.shape[2] // k.shape[2]
    if group > 1:
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    blocks = dataclasses.replace(pallas_attention.BlockSizes.get_default(), block_q=BLOCK, block_k=BLOCK)
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
