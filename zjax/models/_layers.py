"""The decoder's small pieces that its attention variants share: RMSNorm, RoPE, the heads' layout."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ._params import param


class RMSNorm(nn.Module):
    dim: int
    eps: float = 1e-6

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = param(self, "scale", (self.dim,), ("norm",), nn.initializers.ones)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * scale.astype(jnp.float32)).astype(x.dtype)


def heads_constraint(x: jax.Array, heads: str) -> jax.Array:
    return nn.with_logical_constraint(x, ("batch", "seq", heads, "head_dim"))


def rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, factor: float = 1.0) -> jax.Array:
    """Rotary position embedding of ``x [batch, seq, heads, head_dim]`` at ``positions [batch|1, seq]``
    (the halves convention of Hugging Face's Llama checkpoints), in fp32; cos and sin times ``factor`` (YaRN's
    attention factor)."""
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    sin, cos = jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]
    if factor != 1.0:
        sin, cos = sin * factor, cos * factor
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
