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


def dropout_keys(rng: jax.Array, token_ids: jax.Array) -> jax.Array:
    """Each token's dropout key, ``[batch, seq, ...]`` key data: ``rng`` (the step's key) folded with the token's
    ``token_ids [batch, seq]`` (its index in the global batch, row x length + column). A per-token array that
    travels with its rows through every split (microbatches, ranks, cp's shards, pipeline stages), so a token
    draws the same masks wherever it is computed; :func:`dropout` folds in the layer and the call site."""
    rng = jax.random.wrap_key_data(rng) if not jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key) else rng
    return jax.random.key_data(jax.vmap(jax.vmap(lambda i: jax.random.fold_in(rng, i)))(token_ids))


def dropout(y: jax.Array, keys: jax.Array, layer: jax.Array | int, site: int, rate: float) -> jax.Array:
    """``y [batch, seq, embed]`` with each value zeroed with probability ``rate`` (the rest scaled by ``1 / (1 -
    rate)``): a token's mask drawn from its key (``keys``, :func:`dropout_keys`) folded with the model's index of
    the ``layer`` (the decoder's first layer 0, its multi-token prediction modules' after the last) and the
    ``site`` within it (0 the attention's output, 1 the MLP's)."""
    width = y.shape[-1]
    layer = jnp.asarray(layer).astype(jnp.int32)

    def one(data: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(data), layer), site)
        return jax.random.bernoulli(key, 1.0 - rate, (width,))

    keep = jax.vmap(jax.vmap(one))(keys)
    return jnp.where(keep, y / (1.0 - rate), 0).astype(y.dtype)
