"""The user's loss function as the steps call it: its optional arguments, its result, its microbatches, and how it
reads the parameters while it is traced."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from .. import comm
from ..pipeline._context import quantizing

if TYPE_CHECKING:
    from ._config import PlanConfig
    from ._layout import StateLayout

LossFn = Callable[[Any, Any], Any]


def takes(fn: Callable, name: str) -> bool:
    """Whether ``fn`` accepts a ``name`` keyword (``rng``: a fresh key; ``model_state``: the model's state)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params


@dataclasses.dataclass(frozen=True)
class Loss:
    """The loss a train step differentiates: the user's function, the arguments it takes, its microbatches."""

    fn: LossFn
    accum_steps: int = 1
    takes_rng: bool = False
    takes_model_state: bool = False

    @classmethod
    def of(cls, fn: LossFn, accum_steps: int = 1) -> Loss:
        """``fn`` checked, with the optional arguments its signature names (``rng``, ``model_state``)."""
        if not callable(fn):
            raise TypeError(f"train_step: loss_fn must be callable, got {type(fn).__name__}.")
        if not isinstance(accum_steps, int) or isinstance(accum_steps, bool) or accum_steps < 1:
            raise ValueError(f"train_step: accum_steps={accum_steps!r} must be an int >= 1.")
        return cls(fn, accum_steps, takes(fn, "rng"), takes(fn, "model_state"))


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


def placing(plan: PlanConfig, layout: StateLayout) -> contextlib.ExitStack:
    """Stage 3's placements while the loss is traced (:mod:`zjax.comm`: qwZ, the lookup, the head read once) and
    the wire of a pipeline's chunk gathers."""
    stack = contextlib.ExitStack()
    if plan.stage.shard_parameters:
        stack.enter_context(quantizing(plan.weights_wire))
        stack.enter_context(comm.use(layout.params.placements, plan.read_wire))
    return stack
