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
from collections.abc import Sequence
from typing import Any, cast

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
    if how.wire is not None and _size((*split, *whole)) > 1:
        shard = _quantized_scatter([(g, split, dim, ())], split, how.wire)[0] if split else g.astype(jnp.float32)
        if whole:
            shard = _quantized_all_reduce(shard, whole, how.wire)
        return shard
    x = g.astype(how.dtype or g.dtype)
    if split:
        x = jax.lax.psum_scatter(x, split, scatter_dimension=dim, tiled=True)
    return jax.lax.psum(x, whole) if whole else x


Part = tuple[jax.Array, tuple[str, ...], int | None, tuple[str, ...]]
"""A rank's partial gradient of a whole parameter and how it reduces: ``(g, split, dim, whole)`` (:func:`reduce`)."""


def reduce_all(parts: Sequence[Part], how: Reduction) -> list:
    """:func:`reduce` of each ``(g, split, dim, whole)``. Quantized, the parts split over the same axes cross in one
    all-to-all (one int8 buffer holding every part's blocks and scales): a layer's gradients make one exchange
    instead of one per weight (XLA combines all-gathers and reduce-scatters, not all-to-alls)."""
    out: list = [None] * len(parts)
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, (g, split, dim, whole) in enumerate(parts):
        if how.wire is not None and split and _size(split) > 1:
            groups.setdefault(split, []).append(i)
        else:
            out[i] = reduce(g, split, dim, whole, how)
    wire = cast(Wire, how.wire)
    for split, members in groups.items():
        for i, shard in zip(members, _quantized_scatter([parts[i] for i in members], split, wire), strict=True):
            whole = parts[i][3]
            out[i] = _quantized_all_reduce(shard, whole, wire) if whole else shard
    return out


def _size(axes: tuple[str, ...]) -> int:
    return math.prod(jax.lax.axis_size(a) for a in axes)


def _chunks(x: jax.Array, dim: int, n: int) -> jax.Array:
    """``x`` as ``[n, chunk]``: row ``j`` the ``j``-th of ``n`` equal parts along ``dim``, flattened."""
    moved = jnp.moveaxis(x, dim, 0)
    return moved.reshape(n, -1)


def _unchunk(rows: jax.Array, shape: tuple[int, ...], dim: int) -> jax.Array:
    """One row of :func:`_chunks` back as the part of ``shape`` along ``dim`` it was cut from."""
    moved = (shape[dim], *shape[:dim], *shape[dim + 1 :])
    return jnp.moveaxis(rows.reshape(moved), 0, dim)


def _quantized_scatter(parts: Sequence[Part], axes: tuple[str, ...], wire: Wire) -> list:
    """For each part ``g`` split along its ``dim``: rank ``j`` gets the fp32 sum of every rank's ``j``-th chunk, the
    parts' blocks in one exchange."""
    n = _size(axes)
    if any(dim is None for _, _, dim, _ in parts):
        raise ValueError("comm.reduce: a split over the ZeRO axes needs the dim it splits.")
    rows = [_chunks(g, cast(int, dim), n) for g, _, dim, _ in parts]
    out = []
    for (g, _, dim, _), total in zip(parts, _exchange_sum(*_pack_rows(rows, wire), axes), strict=True):
        shape = list(g.shape)
        shape[cast(int, dim)] //= n
        out.append(_unchunk(total, tuple(shape), cast(int, dim)))
    return out


def _quantized_all_reduce(x: jax.Array, axes: tuple[str, ...], wire: Wire) -> jax.Array:
    """The fp32 sum of ``x`` over ``axes``: a quantized all-to-all reduce, then a quantized all-gather of the sums."""
    n = _size(axes)
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
    return _exchange_sum(*_pack_rows([rows], wire), axes)[0]


def _pack_rows(rows: Sequence[jax.Array], wire: Wire) -> tuple[jax.Array, tuple[tuple[Any, int, int, int], ...]]:
    """Each ``[n, width_k]`` of ``rows`` quantized as ``wire``'s blocks, all in one int8 buffer ``[n, bytes]``: a
    part's integers, then its fp32 scales bitcast to 4 bytes each; and each part's (integer dtype, integer bytes,
    scales, width)."""
    pieces, layout = [], []
    for r in rows:
        block = min(wire.block, r.shape[1])  # a small parameter's chunk is one block
        q, scale = quantize(_padded(r, block), block, wire.bits)
        pieces += [jax.lax.bitcast_convert_type(q, jnp.int8), jax.lax.bitcast_convert_type(scale, jnp.int8)]
        layout.append((q.dtype, q.shape[1], scale.shape[1], r.shape[1]))
    n = rows[0].shape[0]
    return jnp.concatenate([p.reshape(n, -1) for p in pieces], axis=1), tuple(layout)


def _exchange_sum(buffer: jax.Array, layout: Sequence[tuple[Any, int, int, int]], axes: tuple[str, ...]) -> list:
    """:func:`_pack_rows`' buffer through one all-to-all over ``axes`` (row ``j`` to rank ``j``); each part's fp32
    sum over the ranks."""
    n = buffer.shape[0]
    buffer = jax.lax.all_to_all(buffer, axes, 0, 0, tiled=True)
    sums, at = [], 0
    for dtype, width_q, width_s, width in layout:
        q = jax.lax.bitcast_convert_type(buffer[:, at : at + width_q], dtype)
        at += width_q
        scale = jax.lax.bitcast_convert_type(buffer[:, at : at + 4 * width_s].reshape(n, width_s, 4), jnp.float32)
        at += 4 * width_s
        sums.append(jnp.sum(dequantize(q, scale, jnp.float32), axis=0)[:width])
    return sums
