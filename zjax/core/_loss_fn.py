"""The user's loss function as the steps call it: its optional arguments, its result, its microbatches."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

LossFn = Callable[[Any, Any], Any]


def takes(fn: Callable, name: str) -> bool:
    """Whether ``fn`` accepts a ``name`` keyword (``rng``: a fresh key; ``model_state``: the model's state)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params


def loss_and_aux(out: Any) -> tuple[jax.Array, Any]:
    """``loss_fn``'s result (``loss`` or ``(loss, aux)``) as ``(fp32 scalar loss, aux or None)``."""
    loss, aux = out if isinstance(out, tuple) else (out, None)
    if jnp.ndim(loss) != 0:
        raise ValueError(f"loss_fn must return a scalar loss, got shape {jnp.shape(loss)}.")
    return loss.astype(jnp.float32), aux


def split_microbatches(batch: Any, k: int) -> Any:
    """``[B, ...] -> [k, B/k, ...]`` where microbatch ``i`` is rows ``i, i+k, ...``.

    Reshaping to ``(B/k, k)`` keeps each dp shard's rows on that shard (the dp split stays on the
    first dimension), so no data moves; ``(k, B/k)`` directly would put dp on the microbatch index.
    """
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), batch)
