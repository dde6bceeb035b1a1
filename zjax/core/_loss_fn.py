"""The user's loss function as the steps call it: its optional arguments and how it reads the parameters while it
is traced (what it returns and how that is normalised: :mod:`._objective`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
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
    """Whether ``fn`` accepts a ``name`` keyword (``rng``: a fresh key; ``model_state``: the model's state;
    ``rows``: the global indices of the rows it is called on)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params


@dataclasses.dataclass(frozen=True)
class Loss:
    """The loss a train step differentiates: the user's function, the arguments it takes, its microbatches, and
    the ``finish_step(model_state) -> model_state`` it may carry (applied once per step, after the last
    microbatch: state moved by what the whole step counted, as the routers' selection biases are)."""

    fn: LossFn
    accum_steps: int = 1
    takes_rng: bool = False
    takes_model_state: bool = False
    finish_step: Callable[[Any], Any] | None = None
    takes_rows: bool = False

    @classmethod
    def of(cls, fn: LossFn, accum_steps: int = 1) -> Loss:
        """``fn`` checked, with the optional arguments its signature names (``rng``, ``model_state``)."""
        if not callable(fn):
            raise TypeError(f"train_step: loss_fn must be callable, got {type(fn).__name__}.")
        if not isinstance(accum_steps, int) or isinstance(accum_steps, bool) or accum_steps < 1:
            raise ValueError(f"train_step: accum_steps={accum_steps!r} must be an int >= 1.")
        finish = getattr(fn, "finish_step", None)
        if finish is not None and not callable(finish):
            raise TypeError(f"train_step: loss_fn.finish_step must be callable, got {type(finish).__name__}.")
        return cls(fn, accum_steps, takes(fn, "rng"), takes(fn, "model_state"), finish, takes(fn, "rows"))

    def with_rows(self, batch: Any) -> Any:
        """The batch a step's paths split: ``(batch, rows)`` with each row's index in the global batch beside it
        when the loss takes ``rows`` (then every split, microbatches and ranks alike, carries them along)."""
        if not self.takes_rows:
            return batch
        return batch, jnp.arange(jax.tree.leaves(batch)[0].shape[0], dtype=jnp.int32)

    def arguments(self, batch: Any, key: jax.Array, *folds: Any) -> tuple[Any, dict[str, Any]]:
        """The rows one call reads (of :meth:`with_rows`'s batch) and its keywords: with ``rows``, the step's
        ``key`` as it is (the loss draws each row's randomness from the row's global index, so every split of
        the batch draws what one device draws); without, ``key`` folded with ``folds`` (the microbatch, the
        rank), a fresh key per call."""
        kwargs: dict[str, Any] = {}
        if self.takes_rows:
            batch, kwargs["rows"] = batch
        if self.takes_rng:
            kwargs["rng"] = self.key(key, *folds)
        return batch, kwargs

    def key(self, key: jax.Array, *folds: Any) -> jax.Array:
        """The key for one part of the step: ``key`` folded with ``folds`` (a microbatch, a rank), or the step's
        ``key`` as it is for a loss that takes ``rows`` (it draws per global row)."""
        return key if self.takes_rows else functools.reduce(jax.random.fold_in, folds, key)


def placing(plan: PlanConfig, layout: StateLayout) -> contextlib.ExitStack:
    """Stage 3's placements while the loss is traced (:mod:`zjax.comm`: qwZ, the lookup, the head read once) and
    the wire of a pipeline's chunk gathers."""
    stack = contextlib.ExitStack()
    if plan.stage.shard_parameters:
        # hpZ: qwZ crosses nodes once per step (compute_params); a pipeline's gathers inside a node stay unquantized
        stack.enter_context(quantizing(None if plan.hpz else plan.weights_wire, plan.grads_wire))
        stack.enter_context(comm.use(layout.params.placements, plan.read_wire))
    return stack
