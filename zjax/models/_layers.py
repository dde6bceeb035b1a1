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


def dropout(module: nn.Module, y: jax.Array, token_ids: jax.Array, rate: float) -> jax.Array:
    """``y [batch, seq, embed]`` with each value zeroed with probability ``rate`` (the rest scaled by ``1 / (1 -
    rate)``): a token's mask drawn from the module's ``dropout`` key (one per layer and call site) folded with its
    ``token_ids [batch, seq]`` (its index in the global batch, row x length + column), so that it is the same
    whichever microbatch, rank or sequence shard the token is computed on."""
    key = module.make_rng("dropout")
    width = y.shape[-1]
    keep = jax.vmap(jax.vmap(lambda i: jax.random.bernoulli(jax.random.fold_in(key, i), 1.0 - rate, (width,))))(
        token_ids
    )
    return jnp.where(keep, y / (1.0 - rate), 0).astype(y.dtype)
