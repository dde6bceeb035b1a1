"""Gradient reductions inside a ``shard_map`` manual over the data axes: in a chosen dtype, or as int8 (or int4)
blocks through all-to-alls (ZeRO++'s qgZ).

Each data-parallel rank holds its own partial gradient of a whole parameter; :func:`reduce` sums the ranks' parts
into the shard a rank keeps (split over the ZeRO axes along one dim; summed whole over the axes it is replicated on,
``replica`` for HSDP). Unquantized, that is one ``psum_scatter`` (and a ``psum`` over ``replica``) in the reduction
dtype. Quantized, each rank cuts its gradient into one chunk per rank, quantizes each chunk in blocks, and sends
chunk ``j`` to rank ``j`` (an all-to-all of int8, or int4 packed two to a byte, and fp32 scales); rank ``j``
dequantizes what it received and sums it in fp32: every value is quantized once, on the rank that computed it, and
the sum itself is exact in fp32 (a ring reduce-scatter of int8 would requantize at every hop). Over ``replica``
(between nodes) the shard is then reduced the same way and gathered back quantized: ZeRO++'s hierarchical scheme,
where the intra-node all-to-all leaves 1/dp of the bytes to cross nodes.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from ._quantize import Wire, dequantize, quantize


@dataclasses.dataclass(frozen=True)
class Reduction:
    """How gradients cross the data axes: summed in ``dtype`` (``None``: the gradient's own), or as ``wire``'s
    integer blocks (:class:`zjax.comm.Wire`) summed in fp32."""

    dtype: jnp.dtype | None = None
    wire: Wire | None = None


def reduce(g: jax.Array, split: tuple[str, ...], dim: int | None, whole: tuple[str, ...], how: Reduction) -> jax.Array:
    """The sum over the ranks of ``g`` (each rank's partial gradient of a whole parameter), as the shard this rank
    keeps: ``g`` split along ``dim`` over the axes ``split`` (tiled, in their order) and summed over the axes
    ``whole`` too. Called inside a ``shard_map`` manual over all of them. fp32 when quantized, else in
    ``how.dtype`` (or ``g``'s)."""
    if how.wire is not None and math.prod(jax.lax.axis_size(a) for a in (*split, *whole)) > 1:
        shard = _quantized_scatter(g, split, dim, how.wire) if split else g.astype(jnp.float32)
        if whole:
            shard = _quantized_all_reduce(shard, whole, how.wire)
        return shard
    x = g.astype(how.dtype or g.dtype)
    if split:
        x = jax.lax.psum_scatter(x, split, scatter_dimension=dim, tiled=True)
    return jax.lax.psum(x, whole) if whole else x


def _chunks(x: jax.Array, dim: int, n: int) -> jax.Array:
    """``x`` as ``[n, chunk]``: row ``j`` the ``j``-th of ``n`` equal parts along ``dim``, flattened."""
    moved = jnp.moveaxis(x, dim, 0)
    return moved.reshape(n, -1)


def _unchunk(rows: jax.Array, shape: tuple[int, ...], dim: int) -> jax.Array:
    """One row of :func:`_chunks` back as the part of ``shape`` along ``dim`` it was cut from."""
    moved = (shape[dim], *shape[:dim], *shape[dim + 1 :])
    return jnp.moveaxis(rows.reshape(moved), 0, dim)


def _quantized_scatter(g: jax.Array, axes: tuple[str, ...], dim: int | None, wire: Wire) -> jax.Array:
    """Rank ``j`` gets the fp32 sum of every rank's ``j``-th chunk along ``dim``, each sent as ``wire``'s blocks."""
    n = math.prod(jax.lax.axis_size(a) for a in axes)
    if dim is None:
        raise ValueError("comm.reduce: a split over the ZeRO axes needs the dim it splits.")
    rows = _chunks(g, dim, n)
    total = _sum_exchanged(rows, axes, wire)
    shape = list(g.shape)
    shape[dim] //= n
    return _unchunk(total, tuple(shape), dim)


def _quantized_all_reduce(x: jax.Array, axes: tuple[str, ...], wire: Wire) -> jax.Array:
    """The fp32 sum of ``x`` over ``axes``: a quantized all-to-all reduce, then a quantized all-gather of the sums."""
    n = math.prod(jax.lax.axis_size(a) for a in axes)
    flat = x.reshape(-1)
    pad = -flat.size % n
    rows = jnp.pad(flat, (0, pad)).reshape(n, -1)
    mine = _sum_exchanged(rows, axes, wire)
    width = mine.size
    block = min(wire.block, width)
    q, scale = quantize(_padded(mine, block)[None], block, wire.bits)
    q = jax.lax.all_gather(q, axes, axis=0, tiled=True)
    scale = jax.lax.all_gather(scale, axes, axis=0, tiled=True)
    total = dequantize(q, scale, jnp.float32)[:, :width].reshape(-1)
    return total[: flat.size].reshape(x.shape)


def _padded(x: jax.Array, block: int) -> jax.Array:
    """``x`` with zeros after its last dim up to a multiple of ``block`` (one scale per block, none spanning two
    ranks' parts)."""
    pad = -x.shape[-1] % block
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else x


def _sum_exchanged(rows: jax.Array, axes: tuple[str, ...], wire: Wire) -> jax.Array:
    """Row ``j`` of every rank's ``rows`` (``[n, width]``) to rank ``j`` as ``wire``'s blocks; their fp32 sum."""
    width = rows.shape[1]
    block = min(wire.block, width)  # a small parameter's chunk is one block
    q, scale = quantize(_padded(rows, block), block, wire.bits)
    q = jax.lax.all_to_all(q, axes, 0, 0, tiled=True)
    scale = jax.lax.all_to_all(scale, axes, 0, 0, tiled=True)
    return jnp.sum(dequantize(q, scale, jnp.float32), axis=0)[:width]
