"""The language-model loss: next-token cross-entropy over vocabulary chunks, never whole fp32 logits.

Full logits ``[B, S, V]`` in fp32 are the largest activation of a large-vocabulary model (Llama-3's
128,256 entries: 0.5 MB per token). The loss computes them a vocabulary chunk at a time inside a
rematerialized scan (an online log-sum-exp), so one chunk's logits are alive in the forward and backward
passes. Chunking the vocabulary rather than the sequence keeps ZeRO's traffic: a sequence chunk's head
gradient would be accumulated across loop iterations, and XLA reduces such a gradient over ``dp`` in
every iteration (measured: one head reduce-scatter per chunk inside the loop).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from ..core import LossSum


def vocab_chunks(vocab: int, chunk: int | None) -> int:
    """How many interleaved vocabulary chunks of about ``chunk`` entries: a divisor of ``vocab`` (so a
    vocabulary split over ``tp`` stays split), 1 when ``chunk`` is None or covers the vocabulary, or when
    ``vocab`` has no divisor within 4x of the wanted count (then the logits are built whole)."""
    if chunk is None or chunk >= vocab:
        return 1
    if chunk < 1:
        raise ValueError(f"lm_loss: vocab_chunk={chunk} must be >= 1 or None (vocabulary entries per logits chunk).")
    want = -(-vocab // chunk)
    return next((n for n in range(want, 4 * want + 1) if vocab % n == 0), 1)


def chunked_cross_entropy(
    hidden: jax.Array, head: jax.Array, targets: jax.Array, weights: jax.Array | None, vocab_chunk: int | None
) -> jax.Array:
    """Weighted mean of ``-log softmax(hidden @ head)[targets]`` (fp32), the vocabulary in chunks
    (:func:`cross_entropy_sum` over the weights' sum)."""
    b, s, _ = hidden.shape
    w = jnp.ones((b, s), jnp.float32) if weights is None else weights.astype(jnp.float32)
    return LossSum(cross_entropy_sum(hidden, head, targets, w, vocab_chunk), jnp.sum(w)).mean


def cross_entropy_sum(
    hidden: jax.Array, head: jax.Array, targets: jax.Array, weights: jax.Array | None, vocab_chunk: int | None
) -> jax.Array:
    """Weighted sum of ``-log softmax(hidden @ head)[targets]`` (fp32), the vocabulary in chunks.

    ``hidden [B, S, E]`` and ``head [E, V]`` in the compute dtype. With ``n`` chunks, chunk ``j`` holds the
    vocabulary entries ``c * n + j`` (interleaved, so that a ``tp``-split vocabulary stays split); a
    rematerialized scan keeps a running max, sum of exponentials and target logit per token, so one
    chunk's fp32 logits ``[B, S, V / n]`` are alive at a time. Each chunk's head gradient is its own slice
    (nothing accumulates across iterations), so ZeRO reduces the head's gradient once per step.
    """
    b, s, e = hidden.shape
    vocab = head.shape[1]
    w = jnp.ones((b, s), jnp.float32) if weights is None else weights.astype(jnp.float32)
    head = head.astype(hidden.dtype)
    n = vocab_chunks(vocab, vocab_chunk)

    def logits_of(h_: jax.Array) -> jax.Array:
        return nn.with_logical_constraint((hidden @ h_).astype(jnp.float32), ("batch", "seq", "vocab"))

    if n == 1:
        nll = optax.softmax_cross_entropy_with_integer_labels(logits_of(head), targets)
    else:
        size = vocab // n
        heads = jnp.moveaxis(head.reshape(e, size, n), 2, 0)  # [n, E, V/n]: chunk j = columns c*n + j
        which, column = targets % n, targets // n

        @jax.checkpoint
        def one(carry, xs):
            top, total, target = carry
            j, h_ = xs
            logits = logits_of(h_)
            new_top = jnp.maximum(top, jnp.max(logits, axis=-1))
            total = total * jnp.exp(top - new_top) + jnp.sum(jnp.exp(logits - new_top[..., None]), axis=-1)
            hit = (jnp.arange(size) == column[..., None]) & (which == j)[..., None]
            return (new_top, total, target + jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)), None

        zeros = jnp.zeros((b, s), jnp.float32)
        init = (jnp.full((b, s), -jnp.inf, jnp.float32), zeros, zeros)
        (top, total, target), _ = jax.lax.scan(one, init, (jnp.arange(n), heads))
        nll = top + jnp.log(total) - target
    return jnp.sum(nll * w)
