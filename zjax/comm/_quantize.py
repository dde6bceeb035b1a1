"""Blockwise int8 quantization for what crosses the wire: one scale per block of the last dim."""

from __future__ import annotations

import jax
import jax.numpy as jnp

DEFAULT_BLOCK = 256
"""Elements per scale: ZeRO++ quantizes weights in blocks of a few hundred to a few thousand elements; 256
keeps the scales at 1.6% of the int8 bytes (fp32 scales) and the error per block local."""


def block_size(n: int, block: int) -> int:
    """The block along a last dim of ``n`` elements: ``block`` if it divides ``n``, else the whole dim."""
    return block if n % block == 0 else n


def quantize(x: jax.Array, block: int = DEFAULT_BLOCK) -> tuple[jax.Array, jax.Array]:
    """``(q int8 [..., n], scales fp32 [..., n / b])`` with ``x ~= q * scale`` per block of ``b`` elements of
    the last dim (symmetric, round to nearest: ``|x - dequantize(q, s)| <= s / 2 = amax / 254`` per block)."""
    n = x.shape[-1]
    b = block_size(n, block)
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], n // b, b)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    scale = jnp.where(amax == 0, 1.0, amax / 127.0)  # a non-finite block keeps a non-finite scale: it stays so
    q = jnp.clip(jnp.round(blocks / scale[..., None]), -127, 127).astype(jnp.int8)
    return q.reshape(x.shape), scale


def dequantize(q: jax.Array, scale: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The values ``q * scale`` (per block of the last dim) in ``dtype``."""
    n, nb = q.shape[-1], scale.shape[-1]
    blocks = q.astype(jnp.float32).reshape(*q.shape[:-1], nb, n // nb) * scale[..., None]
    return blocks.reshape(q.shape).astype(dtype)


def all_gather(x: jax.Array, axes: str | tuple[str, ...], dim: int, block: int | None) -> jax.Array:
    """``x`` all-gathered over ``axes`` along ``dim`` (tiled, inside a manual region): as it is (``block`` ``None``)
    or as int8 blocks of ``block`` values with their fp32 scales, dequantized to ``x``'s dtype on arrival."""
    if block is None:
        return jax.lax.all_gather(x, axes, axis=dim, tiled=True)
    q, scale = quantize(x, block)
    q = jax.lax.all_gather(q, axes, axis=dim, tiled=True)
    scale = jax.lax.all_gather(scale, axes, axis=dim, tiled=True)
    return dequantize(q, scale, x.dtype)
