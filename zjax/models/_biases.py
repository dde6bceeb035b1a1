"""The routers' selection biases (DeepSeek-V3's auxiliary-loss-free balancing, ``MoE(bias_update_rate=...)``):
model state that :func:`zjax.models.lm_loss` counts each router's loads into and a train step moves once, after
its last microbatch, by the whole step's loads."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

F32 = jnp.float32

ROUTER_STATE = "router"
"""The linen collection of the routers' selection biases (``MoE(bias_update_rate=...)``), each router's ``bias``
beside the ``load`` (rows each expert was chosen for) counted since the bias last moved: model state, not
parameters (:class:`zjax.TrainState`'s ``model_state``)."""


def moved_bias(moe: Any, bias: jax.Array, tokens: jax.Array) -> jax.Array:
    """DeepSeek-V3's auxiliary-loss-free update of the routers' selection ``bias [..., experts]`` from the rows
    each expert was chosen for (``tokens``, the same shape): ``bias + rate x sign(mean_e(tokens) - tokens)``,
    so an overloaded expert is chosen less next time and an idle one more."""
    rate = moe.bias_update_rate or 0.0
    load = tokens.astype(F32)
    return bias + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)


def with_counted_loads(cfg: Any, model_state: Any, tokens: jax.Array) -> Any:
    """``model_state`` with the rows each expert was chosen for (``tokens [layers, experts]``, the experts' layers)
    added to its router's ``load``: the loads a step counts over its microbatches before :func:`with_moved_biases`
    moves the biases once."""
    return _each_router(cfg, model_state, lambda r, t: {**r, "load": r["load"] + t.astype(F32)}, tokens)


def with_moved_biases(cfg: Any, model_state: Any) -> Any:
    """``model_state`` with each router's bias moved by the loads counted since it last moved
    (:func:`moved_bias`), and those loads set back to 0: what a train step does once, after its last microbatch
    (:func:`zjax.models.train_functions`' ``finish_step``)."""

    def moved(router: Any, _: Any) -> Any:
        return {"bias": moved_bias(cfg.moe, router["bias"], router["load"]), "load": jnp.zeros_like(router["load"])}

    return _each_router(cfg, model_state, moved)


def _each_router(cfg: Any, model_state: Any, fn: Any, tokens: jax.Array | None = None) -> Any:
    """``model_state`` with ``fn(router, its layers' tokens)`` in place of each router's ``{bias, load}``: stacked
    ``[layers, experts]`` under ``layers`` (``scan=True``) or one per ``layer_{i}``."""
    moe = cfg.moe
    if moe is None or moe.bias_update_rate is None:
        return model_state
    routers = dict(model_state[ROUTER_STATE])
    if "layers" in routers:
        routers["layers"] = {**routers["layers"], "moe": fn(routers["layers"]["moe"], tokens)}
    else:
        for i in range(cfg.dense_layers, cfg.layers):  # tokens: the experts' layers only
            at = f"layer_{i}"
            load = None if tokens is None else tokens[i - cfg.dense_layers]
            routers[at] = {**routers[at], "moe": fn(routers[at]["moe"], load)}
    return {**model_state, ROUTER_STATE: routers}
