"""``DecoderConfig.dropout``: every way a train step splits the batch draws the masks one device draws.

A token's masks come from the step's key, the layer and the token's index in the global batch alone, so a step
that splits the rows (accumulation, per-rank reductions, ZeRO-3's per-layer reductions) or the sequence (cp)
computes ``jax.grad`` of the one-device model with the same masks, on data with uneven masks and packed rows."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

import zjax
from zjax.models import Decoder, MoE, lm_loss

from ._models import TINY
from ._objective import initial, relative, uneven_batch

DROPPING = dataclasses.replace(TINY, dropout=0.25)
EXPERTS = dataclasses.replace(
    DROPPING, layers=3, moe=MoE(experts=4, top_k=2, load_balance_weight=0.0), dense_layers=1, mtp_layers=1
)  # no balance loss: a microbatch's differs from the whole batch's (docs/concepts/objective.md)


def _one_device(cfg, batch, key, params=None):
    """The whole batch's mean token loss and its gradients on one device, the masks drawn from ``key``."""
    model = Decoder(cfg)
    put = jax.device_put((initial(cfg) if params is None else params, batch, key), jax.devices()[0])

    def mean(p, b, k):
        out = lm_loss(model, p, b, rng=k)
        return (out[0] if isinstance(out, tuple) else out).mean  # a mixture of experts': (loss, metrics)

    loss, grads = jax.jit(jax.value_and_grad(mean))(*put)
    return float(loss), jax.tree.map(np.asarray, jax.device_get(grads))


def _step_grads(plan, cfg, batch, accum=1):
    """What one step of ``plan`` would apply (:meth:`TrainStep.grads`) and the key its loss was given."""
    init_fn, loss_fn = zjax.models.train_functions(Decoder(cfg), cfg.max_len)
    state = plan.init(init_fn, optax.sgd(0.1), jax.random.key(3), params=initial(cfg))
    key = jax.random.split(state.rng)[1]  # the step's key: the state's, split once
    grads, metrics = plan.train_step(loss_fn, accum_steps=accum).grads(state, plan.shard_batch(batch))
    return float(metrics["loss"]), jax.tree.map(np.asarray, jax.device_get(grads)), key


DEEP = dataclasses.replace(DROPPING, layers=4)  # two chunks per stage at pp=2 (zb-v)
PIPE = {
    "1f1b": zjax.Pipeline(4, schedule="1f1b"),
    "gpipe": zjax.Pipeline(2),
    "zb-v": zjax.Pipeline(4, 2, schedule="zb-v"),
}
QGZ = 6e-2  # int8 gradient reductions (tests/test_objective.py)

CASES = {  # mesh, plan, microbatches accumulated, model, gradients' tolerance
    "dp4-tp2-stage2-accum4": (dict(dp=4, tp=2), dict(stage=2), 4, DROPPING, 3e-5),
    "dp8-stage3-fp32-reductions": (dict(dp=8), dict(stage=3, reduce_dtype="float32"), 2, DROPPING, 3e-5),
    "dp4-cp2-ring": (dict(dp=4, cp=2), dict(stage=1), 1, DROPPING, 3e-5),
    # the pipelines: each layer's index and each token's key travel to the stage that runs them
    "dp4-pp2-1f1b-stage3": (dict(dp=4, pp=2), dict(stage=3, pipeline=PIPE["1f1b"]), 1, DROPPING, 3e-5),
    "dp4-pp2-gpipe-stage1-accum2": (dict(dp=4, pp=2), dict(stage=1, pipeline=PIPE["gpipe"]), 2, DROPPING, 3e-5),
    "dp8-stage0-accum2-per-rank": (dict(dp=8), dict(stage=0), 2, DROPPING, 3e-5),  # the ranks' rows, reduced once
    # experts' outputs, DeepSeek's dense first layer and a multi-token prediction module drop too
    "dp2-ep4-experts-accum2": (dict(dp=2, ep=4), dict(stage=2), 2, EXPERTS, 3e-5),
    "dp2-pp2-cp2-ring-zb-v": (dict(dp=2, pp=2, cp=2), dict(stage=2, pipeline=PIPE["zb-v"]), 1, DEEP, 3e-5),
    "qgz": (dict(dp=8), dict(stage=3, precision="bf16", quantized_comm="grads"), 1, DROPPING, QGZ),
}
SLOW = {  # paths the fast cases share: the per-rank region's, the experts', the scan engine's, a zb-v table's
    "dp8-stage0-accum2-per-rank",
    "dp2-ep4-experts-accum2",
    "dp2-pp2-cp2-ring-zb-v",
    "qgz",
    "dp4-pp2-gpipe-stage1-accum2",
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES])
def test_a_split_step_draws_the_one_device_masks(case):
    mesh, plan_kw, accum, cfg, tolerance = CASES[case]
    cfg = dataclasses.replace(cfg, context_mode="ring") if "cp" in mesh else cfg
    plan = zjax.Plan(zjax.make_mesh(**mesh), **{"precision": "fp32", **plan_kw})
    batch = uneven_batch(16, cfg)
    loss, grads, key = _step_grads(plan, cfg, batch, accum)
    want_loss, want = _one_device(cfg, batch, key)
    assert loss == pytest.approx(want_loss, rel=3e-6 if tolerance < QGZ else 3e-2)
    assert relative(grads, want) < tolerance


EDGES = dict(matmul="fp8-current", bf16_edge_layers=1)  # the first and last layers' products in the compute dtype


@pytest.mark.parametrize(
    "how, base",
    [
        (dict(remat="nested"), {}),
        pytest.param(dict(scan=False), {}, marks=pytest.mark.slow),  # per-layer blocks: the index given, as scanned
        pytest.param(EDGES, dict(EDGES, scan=False), marks=pytest.mark.slow),  # three scans of the nested path's kind
    ],
    ids=["nested-remat", "layer-by-layer", "bf16-edges"],
)
def test_every_way_a_model_runs_its_layers_draws_the_same_masks(how, base):
    """Scanned, layer by layer, in nested remat's groups, in three parts (bf16 edges, against the same model layer
    by layer): each layer draws its masks by its index in the model."""
    batch, key = uneven_batch(8, DEEP), jax.random.key(5)

    def run(cfg):
        params = dict(initial(DEEP))
        if not cfg.scan:  # per-layer names: the stacked parameters unstacked
            stacked = params.pop("layers")
            params |= {f"layer_{i}": jax.tree.map(lambda w, i=i: w[i], stacked) for i in range(cfg.layers)}
        loss, grads = _one_device(cfg, batch, key, params)
        if not cfg.scan:
            per_layer = [grads.pop(f"layer_{i}") for i in range(cfg.layers)]
            grads["layers"] = jax.tree.map(lambda *w: np.stack(w), *per_layer)
        return loss, grads

    want_loss, want = run(dataclasses.replace(DEEP, **base))
    loss, grads = run(dataclasses.replace(DEEP, **how))
    assert loss == pytest.approx(want_loss, rel=3e-6)
    assert relative(grads, want) < 3e-5


def test_dropout_draws_masks_per_key_and_none_without_one():
    """The masks change with the key; without a key (evaluation) the model is the one without dropout."""
    with pytest.raises(ValueError, match=r"dropout=1.0 must be a float in \[0, 1\)"):
        dataclasses.replace(TINY, dropout=1.0)
    batch = uneven_batch(8, DROPPING)
    params = initial(TINY)
    mean = jax.jit(lambda p, b, k: lm_loss(Decoder(DROPPING), p, b, rng=k).mean)
    evaluated = jax.jit(lambda p, b: (lm_loss(Decoder(DROPPING), p, b).mean, lm_loss(Decoder(TINY), p, b).mean))
    dropping, plain = evaluated(params, batch)
    assert float(dropping) == float(plain)
    a, b = (float(mean(params, batch, jax.random.key(i))) for i in (0, 1))
    assert len({a, b, float(plain)}) == 3
