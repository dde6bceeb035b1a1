"""What :meth:`zjax.Plan.init` and :meth:`zjax.Plan.train_step` take for a :class:`~zjax.models.Decoder`: its
``init_fn`` and a ``loss_fn`` with the arguments and the once-per-step state update its options need."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..core import Variables
from ._biases import with_moved_biases
from ._loss import lm_loss


def train_functions(model: Any, length: int) -> tuple[Callable[[jax.Array], Any], Callable[..., Any]]:
    """``(init_fn, loss_fn)`` of a :class:`~zjax.models.Decoder` for :meth:`zjax.Plan.init` and
    :meth:`zjax.Plan.train_step`, initialised on rows of ``length`` tokens: ``init_fn`` returns the parameters, or a
    :class:`zjax.Variables` with the model state when the model keeps some (the routers' selection biases,
    ``MoE(bias_update_rate=...)``; fp8 amax histories, ``matmul="fp8-delayed"``), and ``loss_fn`` is
    :func:`lm_loss`, passing that state through, with the ``finish_step`` a train step applies to the state once,
    after its last microbatch (:func:`with_moved_biases`: the routers' biases moved by the step's loads), and for a
    model with ``dropout`` taking the step's key and the rows' global indices (``rng``, ``rows``)."""
    dummy = jnp.zeros((1, length), jnp.int32)
    drops = getattr(model.cfg, "dropout", 0.0) > 0
    if not getattr(model.cfg, "keeps_state", False):
        if drops:  # the step's key and each call's global rows: lm_loss draws the one-device masks
            return (lambda r: model.init(r, dummy)["params"]), (
                lambda p, b, rng, rows: lm_loss(model, p, b, rng=rng, rows=rows)
            )
        return (lambda r: model.init(r, dummy)["params"]), (lambda p, b: lm_loss(model, p, b))
    init_fn = lambda r: Variables.linen(model.init(r, dummy))  # noqa: E731
    if drops:

        def loss_fn(params: Any, batch: Any, model_state: Any, rng: Any, rows: Any) -> Any:
            return lm_loss(model, params, batch, model_state, rng=rng, rows=rows)

    else:

        def loss_fn(params: Any, batch: Any, model_state: Any) -> Any:  # type: ignore[misc]
            return lm_loss(model, params, batch, model_state)

    loss_fn.finish_step = lambda model_state: with_moved_biases(model.cfg, model_state)  # type: ignore[attr-defined]
    return init_fn, loss_fn
