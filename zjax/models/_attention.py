"""Causal attention through ``jax.nn.dot_product_attention``, with the implementation chosen for the devices.

cuDNN's fused (flash) attention on GPUs (bf16/fp16), XLA's elsewhere: the choice follows the devices of the
mesh the step is traced under, so a deviceless compile for a GPU target (``zjax plan --target``) plans the
cuDNN kernels a GPU run will use.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from .. import pipeline
from ..sharding._mesh import in_manual_data_axes, mesh_platform


def attention_implementation(dtype) -> Literal["cudnn", "xla"]:
    """``"cudnn"`` for bf16/fp16 attention on a mesh of GPUs, ``"xla"`` otherwise (cuDNN has no fp32 kernel)."""
    if pipeline.current() is not None or in_manual_data_axes():
        # inside the pipeline's vmap over pp, or a shard_map manual over the data axes (per-rank gradients),
        # cuDNN attention's custom partitioner fails to partition (measured: an INTERNAL custom_partitioner
        # error compiling for H100): XLA's attention there
        return "xla"
    platform = mesh_platform()
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if platform == "gpu" and half else "xla"


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    window: int | None = None,
) -> jax.Array:
    """Causal attention of ``q [batch, seq, heads, head_dim]`` over ``k, v [batch, seq, kv_heads, head_dim]``
    (grouped-query when ``kv_heads < heads``): logits and softmax in fp32.

    ``segment_ids [batch, seq]`` keeps each token within its own packed sequence; ``window`` lets a token see
    itself and the ``window`` tokens before it (Mistral's sliding window, as its reference implementation and
    flash-attention's ``window_size`` count it).
    """
    implementation = attention_implementation(q.dtype)
    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
        implementation = "xla"  # an arbitrary [b, 1, s, s] mask: XLA's path (cuDNN's takes lengths, not masks)
    local = None if window is None else (window, 0)
    if implementation == "xla" and q.dtype == jnp.float16 and mesh_platform() == "cpu":
        # XLA's attention asks for fp16 x fp16 -> fp32 products, which XLA:CPU's dot does not implement
        q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
        out = jax.nn.dot_product_attention(q32, k32, v32, mask=mask, is_causal=True, local_window_size=local)
        return out.astype(q.dtype)
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=True, local_window_size=local, implementation=implementation
    )
