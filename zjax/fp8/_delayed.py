"""FP8 matrix products with delayed scaling: each tensor's scale from the amaxes of the steps before this one.

The scale of each operand (the input and the weight forward, the gradient backward) comes from an **amax
history** kept in the training state: the largest absolute values of that tensor in the last ``H`` steps
(Transformer Engine's delayed-scaling recipe, ``amax_compute_algo="max"``), so the cast needs no reduction over
this step's tensor first. Values beyond the scaled range saturate at the format's largest value (the step counts
them: ``fp8_saturated`` in its metrics). A history with nothing in it yet (the first step) scales from the
tensor's own amax, as current scaling does.

One history per projection, ``[3, H]`` fp32 (rows: input, weight, gradient; column 0 the newest step), lives in
the model's :data:`COLLECTION` variables (:class:`zjax.TrainState`'s ``model_state``: sharded, checkpointed and
resharded on restore like any state). The product reads it and reports this call's three amaxes as the
history's cotangent; the train step differentiates the histories with the parameters, takes the amaxes' maximum
over its microbatches (:func:`amax_seen`) and shifts them in (:func:`advance`) once per step. A history is read
by one product per forward pass (a second use would add its amaxes to the first's).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.shard_alike import shard_alike

from ._matmul import E4M3, E5M2, F32, check_operands, contract_dims, pow2_scale, product

COLLECTION = "fp8_meta"
"""The linen variable collection of the amax histories (a model's ``model_state[COLLECTION]``)."""

HISTORY = 1024
"""Steps of amax history per tensor (Transformer Engine's and flax's default)."""


def _amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x)).astype(F32)


def _scale(history: jax.Array, amax: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The power-of-two scale from a tensor's history (its own amax while the history is empty)."""
    past = jnp.max(history)
    return pow2_scale(jnp.where(past > 0, past, amax), dtype)


def _cast(x: jax.Array, scale: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``x / scale`` in ``dtype``, saturating (``float8_e4m3fn`` has no infinity: an overflow would be NaN)."""
    top = jnp.asarray(jnp.finfo(dtype).max, F32)
    return jnp.clip(x.astype(F32) / scale, -top, top).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _matmul(x: jax.Array, w: jax.Array, history: jax.Array, contract: int) -> jax.Array:
    return _forward(x, w, history, contract)[0]


def _forward(x: jax.Array, w: jax.Array, history: jax.Array, contract: int):
    ax, aw = _amax(x), _amax(w)
    sx, sw = _scale(history[0], ax, E4M3), _scale(history[1], aw, E4M3)
    xq = _cast(x, sx, E4M3)
    wq = shard_alike(_cast(w, sw, E4M3), w)[0]  # cast where the weight lies: ZeRO-3's gathers move fp8
    y = product(xq, wq, sx * sw, contract_dims(x.ndim, contract), x.dtype)
    like = (jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))
    return y, (xq, sx, wq, sw, jnp.stack([ax, aw]), history, *like)


def _backward(contract: int, res, g: jax.Array):
    xq, sx, wq, sw, seen, history, x_like, w_like = res
    ag = _amax(g)
    sg = _scale(history[2], ag, E5M2)
    gq = _cast(g, sg, E5M2)
    lead = xq.ndim - contract
    dx = product(gq, wq, sg * sw, (range(lead, g.ndim), range(contract, wq.ndim)), x_like.dtype)
    dw = product(xq, gq, sx * sg, (range(lead), range(lead)), w_like.dtype, w_like.dtype)
    # the history's cotangent: this call's amaxes in column 0 (the train step keeps their maximum over its
    # microbatches and shifts them in)
    amaxes = jnp.concatenate([seen, ag[None]])
    return dx, dw, jnp.zeros_like(history).at[:, 0].set(amaxes)


_matmul.defvjp(_forward, _backward)


@functools.partial(jax.named_call, name="fp8_matmul_delayed")
def matmul_delayed(x: jax.Array, w: jax.Array, history: jax.Array, contract: int = 1) -> jax.Array:
    """``x @ w`` as :func:`zjax.fp8.matmul`, with each operand's scale from ``history`` ``[3, H]`` (the
    module's docstring) instead of this call's amax. Differentiate it with respect to ``history`` to read the
    amaxes this call saw (the train step does, for the histories in a model's :data:`COLLECTION`)."""
    check_operands("zjax.fp8.matmul_delayed", x, w, contract)
    if history.ndim != 2 or history.shape[0] != 3 or history.dtype != F32:
        raise ValueError(
            f"zjax.fp8.matmul_delayed: history {tuple(history.shape)} {history.dtype}; it must be [3, H] float32 "
            "(the input's, the weight's and the gradient's amaxes of the last H steps), e.g. "
            "zjax.fp8.linen_matmul's variable."
        )
    return _matmul(x, w, history, contract)


# -- the train step's side --------------------------------------------------------------------------------------


def histories(model_state: Any) -> Any:
    """The amax histories in a model state (its :data:`COLLECTION`), or ``None`` when it keeps none."""
    if isinstance(model_state, Mapping) and COLLECTION in model_state and jax.tree.leaves(model_state[COLLECTION]):
        return model_state[COLLECTION]
    return None


def with_histories(model_state: Mapping, hist: Any) -> dict:
    """``model_state`` with its histories replaced by ``hist``."""
    return {**model_state, COLLECTION: hist}


def amax_seen(seen: Any, cotangents: Any) -> Any:
    """The running maximum of the amaxes the histories' cotangents report (one microbatch's after another)."""
    return jax.tree.map(jnp.maximum, seen, cotangents)


def advance(model_state: Mapping, seen: Any) -> dict:
    """``model_state`` with every history shifted by one step, this step's amaxes (``seen``) in column 0."""
    new = jax.tree.map(lambda h, s: jnp.roll(h, 1, axis=-1).at[..., 0].set(s[..., 0]), model_state[COLLECTION], seen)
    return with_histories(model_state, new)


def finite(seen: Any) -> jax.Array:
    """Whether every amax this step saw is finite (a NaN or inf skips the step, as fp16's loss scaling does)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(s[..., 0])) for s in jax.tree.leaves(seen)]))


def saturated(model_state: Mapping, seen: Any) -> jax.Array:
    """How many tensors (per layer and projection: input, weight, gradient) this step saturated: their amax beyond
    the range their delayed scale covers (a history's first step, scaled from its own amax, saturates nothing)."""
    count = jnp.int32(0)
    for h, s in zip(jax.tree.leaves(model_state[COLLECTION]), jax.tree.leaves(seen), strict=True):
        for row, dtype in enumerate((E4M3, E4M3, E5M2)):
            past = jnp.max(h[..., row, :], axis=-1)
            covered = pow2_scale(past, dtype) * jnp.asarray(jnp.finfo(dtype).max, F32)
            count += jnp.sum((past > 0) & (s[..., row, 0] > covered), dtype=jnp.int32)
    return count
