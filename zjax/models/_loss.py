"""The language-model loss: next-token cross-entropy over sequence chunks, never whole fp32 logits.

Full logits ``[B, S, V]`` in fp32 are the largest activation of a large-vocabulary model (Llama-3's
128,256 entries: 0.5 MB per token). The loss computes them ``chunk`` positions at a time inside a
rematerialized scan, so one chunk's logits are alive in the forward and backward passes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

BATCH_KEYS = ("tokens", "positions", "segment_ids", "loss_mask")


def read_batch(batch: Any) -> tuple[jax.Array, jax.Array | None, jax.Array | None, jax.Array | None]:
    """``(tokens, positions, segment_ids, loss_mask)`` of a batch: int tokens ``[B, S+1]`` or a mapping with
    ``tokens [B, S+1]`` and optional ``positions``, ``segment_ids`` and ``loss_mask`` of the same shape."""
    if isinstance(batch, Mapping):
        unknown = sorted(set(batch) - set(BATCH_KEYS))
        if "tokens" not in batch or unknown:
            raise ValueError(
                f"lm_loss: a dict batch has keys {list(BATCH_KEYS)} ('tokens' required); got {sorted(batch)}"
                + (f", unknown {unknown}" if unknown else "")
                + "."
            )
        tokens = batch["tokens"]
        extra = [batch.get(k) for k in BATCH_KEYS[1:]]
    else:
        tokens, extra = batch, [None, None, None]
    if getattr(tokens, "ndim", None) != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(
            f"lm_loss: tokens must be int [batch, seq + 1] (inputs and next-token targets); got "
            f"{getattr(tokens, 'dtype', type(tokens).__name__)} {getattr(tokens, 'shape', '')}."
        )
    for key, value in zip(BATCH_KEYS[1:], extra, strict=True):
        if value is not None and tuple(value.shape) != tuple(tokens.shape):
            raise ValueError(
                f"lm_loss: batch[{key!r}] has shape {tuple(value.shape)}; it must match tokens {tuple(tokens.shape)} "
                f"(one entry per token, inputs and targets shifted from the same row)."
            )
    return tokens, *extra  # type: ignore[return-value]


def chunked_cross_entropy(
    hidden: jax.Array, head: jax.Array, targets: jax.Array, weights: jax.Array | None, chunk: int
) -> jax.Array:
    """Weighted mean of ``-log softmax(hidden @ head)[targets]``, ``chunk`` sequence positions at a time.

    ``hidden [B, S, E]`` and ``head [E, V]`` in the compute dtype; logits are cast to fp32 per chunk.
    """
    if chunk < 1:
        raise ValueError(f"lm_loss: chunk={chunk} must be >= 1 (sequence positions per logits chunk).")
    b, s, e = hidden.shape
    size = min(chunk, s)
    n = -(-s // size)
    w = jnp.ones((b, s), jnp.float32) if weights is None else weights.astype(jnp.float32)
    if n * size != s:  # pad to whole chunks; padded positions weigh nothing
        pad = n * size - s
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
        w = jnp.pad(w, ((0, 0), (0, pad)))

    def chunks(x: jax.Array) -> jax.Array:  # [B, n*size, ...] -> [n, B, size, ...]
        return x.reshape(b, n, size, *x.shape[2:]).swapaxes(0, 1)

    head = head.astype(hidden.dtype)

    @jax.checkpoint
    def one(total: jax.Array, xs: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, None]:
        h, t, wt = xs
        logits = nn.with_logical_constraint((h @ head).astype(jnp.float32), ("batch", "seq", "vocab"))
        return total + jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, t) * wt), None

    total, _ = jax.lax.scan(one, jnp.zeros((), jnp.float32), (chunks(hidden), chunks(targets), chunks(w)))
    return total / jnp.maximum(jnp.sum(w), 1.0)


def lm_loss(model: Any, params: Any, batch: Any, *, chunk: int = 1024) -> jax.Array:
    """Mean next-token cross-entropy (fp32) of a :class:`~zjax.models.Decoder` on ``batch``.

    ``batch`` is int tokens ``[B, S+1]`` (inputs ``[:, :-1]``, targets ``[:, 1:]``) or a dict with ``tokens``
    and optional ``positions``, ``segment_ids`` (packed sequences: attention stays within a segment, and
    a target from another segment than its input is not scored) and ``loss_mask`` (weights of the targets),
    each ``[B, S+1]`` aligned with ``tokens``. Logits are built ``chunk`` positions at a time.
    """
    from ._decoder import output_head

    tokens, positions, segment_ids, loss_mask = read_batch(batch)
    cut = (lambda x: None if x is None else x[:, :-1])
    hidden = model.apply({"params": params}, tokens[:, :-1], cut(positions), cut(segment_ids), return_hidden=True)
    weights = None if loss_mask is None else loss_mask[:, 1:].astype(jnp.float32)
    if segment_ids is not None:
        same = (segment_ids[:, 1:] == segment_ids[:, :-1]).astype(jnp.float32)
        weights = same if weights is None else weights * same
    return chunked_cross_entropy(hidden, output_head(model.cfg, params), tokens[:, 1:], weights, chunk)
