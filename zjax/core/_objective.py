"""The objective a train step minimises: one place owns how a loss is normalised, whatever path reduces it.

A loss function returns a sum and the count it sums over (:class:`LossSum`), or a plain scalar, which is a mean
over the rows it was called on (a :class:`LossSum` of that mean and a count of 1). Every path calls the loss on
some part of the global batch (the whole batch under GSPMD; a microbatch; one data-parallel rank's rows) and
the step's objective is the sum of all the parts' sums over the sum of all their counts, so that a token loss
is the mean over the whole step's tokens, the one-device objective, however the rows are split::

    loss = sum_parts sum_p / sum_parts count_p

The gradients follow without knowing the total count in advance. Part ``i`` (one microbatch on every rank at
once) is differentiated as ``sum_i * scale / C_i``, with ``C_i`` its count summed over the data-parallel ranks
(known after its forward pass, and the same on every rank, so that each rank's gradient can be reduced with
the others' as it is made, per layer at stage 3). Its reduced gradient is then weighted by ``C_i`` into an
fp32 accumulator, and the sum divided by ``C = sum_i C_i`` once, after the last part:
``sum_i (C_i / C) grad(sum_i / C_i) = grad(sum_i sum_i) / C``. Each part's gradient has a mean's magnitude (what
fp16's loss scale expects), and without accumulation nothing is multiplied twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LossSum:
    """A loss as a sum and the count it is a sum over: every path of a train step divides by the global count.

    Return it from a loss function (alone, or as ``(LossSum(...), aux)``) to make the step minimise the sum over
    the whole global batch divided by the count over the whole global batch, whatever splits the batch
    (accumulation, per-rank reductions, pipeline microbatches). :func:`zjax.models.lm_loss` returns the sum of
    weighted token losses and the sum of the weights. Not a tuple, since a tuple means ``(loss, aux)``.

    Example::

        def loss_fn(params, batch):
            nll = per_token_nll(params, batch)  # [B, S]
            w = batch["loss_mask"]
            return zjax.LossSum(jnp.sum(nll * w), jnp.sum(w))

    Attributes:
      sum: the summed loss (a scalar).
      count: what it sums over: tokens, or the sum of their weights (a scalar that does not depend on the
        parameters).
    """

    sum: Any
    count: Any

    @property
    def mean(self) -> jax.Array:
        """``sum / count`` (0 where nothing was counted)."""
        return jnp.asarray(self.sum, jnp.float32) / _nonzero(self.count)

    def __add__(self, other: LossSum) -> LossSum:
        if not isinstance(other, LossSum):
            return NotImplemented
        return LossSum(self.sum + other.sum, self.count + other.count)


def _nonzero(count: Any) -> jax.Array:
    count = jnp.asarray(count, jnp.float32)
    return jnp.where(count > 0, count, 1.0)


def split_output(out: Any) -> tuple[LossSum, Any]:
    """A loss function's result (``loss``, ``(loss, aux)``, ``LossSum`` or ``(LossSum, aux)``) as
    ``(LossSum of fp32 scalars, aux or None)``; a plain scalar loss is a mean: ``LossSum(loss, 1)``."""
    loss, aux = out if isinstance(out, tuple) else (out, None)
    if isinstance(loss, tuple):
        raise TypeError(
            "loss_fn returned a tuple whose first element is a tuple; return loss, (loss, aux), zjax.LossSum(sum, "
            "count) or (zjax.LossSum(sum, count), aux)."
        )
    if isinstance(loss, LossSum):
        total, count = loss.sum, loss.count
        for name, value in (("sum", total), ("count", count)):
            if jnp.ndim(value) != 0:
                raise ValueError(f"loss_fn returned a zjax.LossSum whose {name} has shape {jnp.shape(value)}; both "
                                 "sum and count must be scalars (sum over the rows before returning).")  # fmt: skip
        count = jax.lax.stop_gradient(jnp.asarray(count, jnp.float32))
        return LossSum(jnp.asarray(total, jnp.float32), count), aux
    if jnp.ndim(loss) != 0:
        raise ValueError(f"loss_fn must return a scalar loss or a zjax.LossSum, got shape {jnp.shape(loss)}.")
    return LossSum(jnp.asarray(loss).astype(jnp.float32), jnp.float32(1.0)), aux


def seeded(part: LossSum, scale: jax.Array, axes: tuple[str, ...] = ()) -> tuple[jax.Array, LossSum]:
    """What a path differentiates for one part of the batch, and the part summed over the ranks.

    ``part`` is what the loss returned on this rank's rows; ``axes`` are the data axes manual in the region the
    loss runs in (``()`` under GSPMD, where one call sees every rank's rows). Returns ``part.sum * scale / C``
    with ``C`` the part's count summed over ``axes``, and ``LossSum(sum, C)`` summed over ``axes`` (the same on
    every rank).
    """
    total = part if not axes else LossSum(jax.lax.psum(part.sum, axes), jax.lax.psum(part.count, axes))
    count = jax.lax.stop_gradient(total.count)
    return part.sum * (scale / _nonzero(count)), jax.tree.map(jax.lax.stop_gradient, total)


def accumulate(
    grad_fn: Callable[[Any, Any, Any, jax.Array], tuple[Any, tuple[LossSum, Any, Any]]],
    params: Any,
    batch: Any,
    k: int,
    carry: Any = None,
    constrain: Callable[[Any], Any] = lambda g: g,
) -> tuple[Any, LossSum, Any, Any]:
    """The step's gradients over ``k`` microbatches of ``batch``, normalised by the whole step's count.

    ``grad_fn(params, carry, microbatch, i) -> (grads, (part, aux, carry))`` differentiates :func:`seeded`'s
    value for microbatch ``i`` (``part`` its :class:`LossSum` over the ranks; ``carry`` threads a model state
    through the microbatches in order). With ``k == 1`` the batch is the one part and its gradients are
    returned as they are. Otherwise each microbatch's gradients are weighted by its count into an fp32
    accumulator (``constrain`` lays it out, e.g. stage 2's shards) and divided by the total count after the
    loop. Returns ``(grads, LossSum over the step, aux averaged over the microbatches, carry)``.
    """
    if k == 1:
        grads, (part, aux, carry) = grad_fn(params, carry, batch, jnp.int32(0))
        return grads, part, aux, carry

    def body(state, xs):
        acc, total, carry = state
        i, microbatch = xs
        grads, (part, aux, carry) = grad_fn(params, carry, microbatch, i)
        weight = _nonzero(part.count)
        acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32) * weight, acc, constrain(grads))
        return (constrain(acc), total + part, carry), aux

    zeros = constrain(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
    nothing = LossSum(jnp.float32(0.0), jnp.float32(0.0))
    (acc, total, carry), auxes = jax.lax.scan(
        body, (zeros, nothing, carry), (jnp.arange(k), split_microbatches(batch, k))
    )
    inv = 1.0 / _nonzero(total.count)  # a part that counted nothing weighed 1 and had no gradient
    grads = jax.tree.map(lambda a: a * inv, acc)
    return grads, total, jax.tree.map(lambda a: jnp.mean(a, axis=0), auxes), carry


def split_microbatches(batch: Any, k: int) -> Any:
    """``[B, ...] -> [k, B/k, ...]`` where microbatch ``i`` is rows ``i, i+k, ...``.

    Reshaping to ``(B/k, k)`` keeps each dp shard's rows on that shard (the dp split stays on the
    first dimension), so no data moves; ``(k, B/k)`` directly would put dp on the microbatch index.
    """
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), batch)
