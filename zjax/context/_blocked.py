"""Blocked attention: an online softmax over key blocks, query blocks at a time, never an ``[S, S]`` matrix.

The two primitives every attention path of :mod:`zjax.context` is built from:

* :func:`block_forward` -- the attention of local queries over one chunk of keys and values, returned
  normalized with its log-sum-exp, so that partial results over several chunks merge exactly
  (:func:`merge`);
* :func:`block_backward` -- the gradients of that chunk given the *global* output's log-sum-exp and
  ``delta = sum(d_out * out)`` (the flash-attention backward: probabilities are recomputed block by block).

Masks come from each slot's **original token index** (its place in the unpermuted row: ``qi``, ``ki``) and
segment ids: a query sees keys of its segment at an index not after its own and, with a window ``w``,
not more than ``w`` before it. Shapes: ``q [B, Sq, K, G, D]`` (``K`` key/value heads, ``G`` queries per
key/value head), ``k, v [B, Sk, K, D]``; logits, softmax and accumulation in fp32. A (query block, key block)
pair that the mask hides entirely is skipped (``lax.cond`` on static-per-rank indices), which is what makes a
load-balanced causal layout cost each rank the same.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Query and key block sizes (upper bounds: each is cut down to a divisor of its sequence length)."""

    q: int = 512
    k: int = 512


def block_size(length: int, target: int) -> int:
    """The largest divisor of ``length`` that is at most ``target``."""
    return next(b for b in range(min(target, length), 0, -1) if length % b == 0)


class Chunk(NamedTuple):
    """Keys and values of one chunk with their original indices ``[Sk]`` and segment ids ``[B, Sk]`` (or None)."""

    k: jax.Array
    v: jax.Array
    order: jax.Array
    segments: jax.Array | None


def _mask(qi, ki, qs, ks, window: int | None) -> jax.Array:
    """``[B|1, 1, 1, bq, bk]``: which keys each query sees."""
    m = qi[:, None] >= ki[None, :]
    if window is not None:
        m = m & (qi[:, None] - ki[None, :] <= window)
    m = m[None]
    if qs is not None:
        m = m & (qs[:, :, None] == ks[:, None, :])
    return m[:, None, None]


def _visible(qi, ki, window: int | None) -> jax.Array:
    """Whether some key of the block may be visible to some query of the block (segments not counted)."""
    ok = jnp.min(ki) <= jnp.max(qi)
    if window is not None:
        ok = ok & (jnp.max(ki) >= jnp.min(qi) - window)
    return ok


def _scores(qb, kb, scale: float) -> jax.Array:
    return jnp.einsum("bqkgd,bskd->bkgqs", qb, kb, preferred_element_type=F32) * scale


def _loop(n: int, body, init):
    """``body(i, carry)`` for ``i`` in ``0 .. n-1`` as a ``while_loop``. Not ``scan``: these loops are never
    differentiated (their custom VJPs are), and a scan inside a layer scan makes JAX's partial evaluation keep
    per-block residuals of the forward pass (measured: a stacked ``[nq, nk, B, K, G, bq, bk]`` score array)."""

    def step(state):
        i, carry = state
        return i + 1, body(i, carry)

    return jax.lax.while_loop(lambda state: state[0] < n, step, (jnp.int32(0), init))[1]


def _take(x: jax.Array | None, axis: int, i, size: int) -> jax.Array | None:
    return None if x is None else jax.lax.dynamic_slice_in_dim(x, i * size, size, axis=axis)


def _put(x: jax.Array, block: jax.Array, axis: int, i, size: int) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(x, block, i * size, axis=axis)


def _key_block(chunk: Chunk, j, bk: int):
    return (
        _take(chunk.k, 1, j, bk),
        _take(chunk.v, 1, j, bk),
        _take(chunk.order, 0, j, bk),
        _take(chunk.segments, 1, j, bk),
    )


def block_forward(
    q: jax.Array, qi: jax.Array, qs: jax.Array | None, chunk: Chunk, *, window: int | None, scale: float, blocks: Blocks
) -> tuple[jax.Array, jax.Array]:
    """``(out [B, Sq, K, G, D] fp32, lse [B, K, G, Sq] fp32)`` of ``q`` over ``chunk`` (``lse = -inf`` and
    ``out = 0`` for a query that sees no key of the chunk)."""
    b, sq, kh, g, d = q.shape
    sk = chunk.k.shape[1]
    bq, bk = block_size(sq, blocks.q), block_size(sk, blocks.k)

    def one_q(i, outs):
        out_all, lse_all = outs
        qb, qib, qsb = _take(q, 1, i, bq), _take(qi, 0, i, bq), _take(qs, 1, i, bq)

        def step(j, carry):
            kb, vb, kib, ksb = _key_block(chunk, j, bk)

            def visit(c):
                m, total, acc = c
                s = jnp.where(_mask(qib, kib, qsb, ksb, window), _scores(qb, kb, scale), -jnp.inf)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.exp(s - safe[..., None])
                corr = jnp.exp(m - safe)
                total = total * corr + jnp.sum(p, axis=-1)
                pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(vb.dtype), vb, preferred_element_type=F32)
                return m_new, total, acc * corr[..., None] + pv

            return jax.lax.cond(_visible(qib, kib, window), visit, lambda c: c, carry)

        init = (
            jnp.full((b, kh, g, bq), -jnp.inf, F32),
            jnp.zeros((b, kh, g, bq), F32),
            jnp.zeros((b, kh, g, bq, d), F32),
        )
        m, total, acc = _loop(sk // bk, step, init)
        seen = total > 0
        safe_total = jnp.where(seen, total, 1.0)
        out = jnp.where(seen[..., None], acc / safe_total[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(safe_total), -jnp.inf)
        return _put(out_all, jnp.einsum("bkgqd->bqkgd", out), 1, i, bq), _put(lse_all, lse, 3, i, bq)

    init = (jnp.zeros((b, sq, kh, g, d), F32), jnp.full((b, kh, g, sq), -jnp.inf, F32))
    return _loop(sq // bq, one_q, init)


def block_backward(
    q: jax.Array,
    qi: jax.Array,
    qs: jax.Array | None,
    chunk: Chunk,
    d_out: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    *,
    window: int | None,
    scale: float,
    blocks: Blocks,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dq fp32, dk fp32, dv fp32)`` of ``chunk``'s share of the attention, given the global output's
    ``lse`` and ``delta = sum(d_out * out, -1)`` (both ``[B, K, G, Sq]``) and ``d_out [B, Sq, K, G, D]``."""
    sq, sk = q.shape[1], chunk.k.shape[1]
    bq, bk = block_size(sq, blocks.q), block_size(sk, blocks.k)
    lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)

    def one_q(i, grads):
        dq_all, dk_all, dv_all = grads
        qb, qib, qsb = _take(q, 1, i, bq), _take(qi, 0, i, bq), _take(qs, 1, i, bq)
        dob, lseb, deltab = _take(d_out, 1, i, bq), _take(lse_safe, 3, i, bq), _take(delta, 3, i, bq)

        def step(j, carry):
            kb, vb, kib, ksb = _key_block(chunk, j, bk)

            def visit(c):
                dq, dk_all, dv_all = c
                mask = _mask(qib, kib, qsb, ksb, window)
                p = jnp.where(mask, jnp.exp(_scores(qb, kb, scale) - lseb[..., None]), 0.0)
                dv = jnp.einsum("bkgqs,bqkgd->bskd", p.astype(dob.dtype), dob, preferred_element_type=F32)
                dp = jnp.einsum("bqkgd,bskd->bkgqs", dob, vb, preferred_element_type=F32)
                ds = (p * (dp - deltab[..., None]) * scale).astype(qb.dtype)
                dq = dq + jnp.einsum("bkgqs,bskd->bqkgd", ds, kb, preferred_element_type=F32)
                dk = jnp.einsum("bkgqs,bqkgd->bskd", ds, qb, preferred_element_type=F32)
                dk_all = _put(dk_all, _take(dk_all, 1, j, bk) + dk, 1, j, bk)
                dv_all = _put(dv_all, _take(dv_all, 1, j, bk) + dv, 1, j, bk)
                return dq, dk_all, dv_all

            return jax.lax.cond(_visible(qib, kib, window), visit, lambda c: c, carry)

        dq, dk_all, dv_all = _loop(sk // bk, step, (jnp.zeros(qb.shape, F32), dk_all, dv_all))
        return _put(dq_all, dq, 1, i, bq), dk_all, dv_all

    zeros = jnp.zeros(chunk.k.shape, F32)
    return _loop(sq // bq, one_q, (jnp.zeros(q.shape, F32), zeros, zeros))


def merge(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Combine two normalized partial attentions over disjoint key sets by their log-sum-exps."""
    lse = jnp.logaddexp(lse_a, lse_b)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    wa = jnp.moveaxis(jnp.exp(lse_a - safe), 3, 1)[..., None]  # [B, Sq, K, G, 1]
    wb = jnp.moveaxis(jnp.exp(lse_b - safe), 3, 1)[..., None]
    return out_a * wa + out_b * wb, lse
