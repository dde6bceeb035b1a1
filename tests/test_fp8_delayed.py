"""FP8 delayed scaling: the products' scales from amax histories, the train step keeping the histories (maximum
over microbatches, one shift per step, a non-finite amax skipping the step, saturations counted), a user's own
linen layer opting in, and the histories through a checkpoint onto another stage and mesh."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import zjax
from zjax.models import Decoder, lm_loss, train_functions

from ._models import TINY
from ._objective import relative, uneven_batch

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
DELAYED = dataclasses.replace(TINY, matmul="fp8-delayed")


def _qdq(x: np.ndarray, past: float, dtype) -> np.ndarray:
    """Delayed scaling in NumPy: divide by ``past / max(format)`` rounded up to a power of two, saturate at the
    format's largest value, round to the format, multiply back (float64)."""
    top = float(ml_dtypes.finfo(dtype).max)
    scale = 2.0 ** np.ceil(np.log2(past / top))
    return np.clip(x / scale, -top, top).astype(np.float32).astype(dtype).astype(np.float64) * scale


def test_the_products_scale_from_the_history_saturate_beyond_it_and_report_their_amaxes():
    rs = np.random.RandomState(0)
    x = rs.randn(3, 5, 32).astype(np.float32)
    w = (rs.randn(32, 16) * 0.1).astype(np.float32)
    g = rs.randn(3, 5, 16).astype(np.float32)
    # the input's history covers half its amax (its largest values saturate), the weight's and gradient's more
    past = np.array([np.abs(x).max() / 2, np.abs(w).max() * 3, np.abs(g).max() * 1.5], np.float32)
    history = np.zeros((3, 8), np.float32)
    history[:, 3] = past  # the maximum over the history is what counts, wherever it lies
    history[:, 5] = past / 4
    y, vjp = jax.vjp(zjax.fp8.matmul_delayed, jnp.asarray(x), jnp.asarray(w), jnp.asarray(history))
    dx, dw, dh = vjp(jnp.asarray(g))
    xq, wq, gq = _qdq(x.reshape(15, 32), past[0], E4M3), _qdq(w, past[1], E4M3), _qdq(g.reshape(15, 16), past[2], E5M2)
    assert np.abs(xq).max() < 0.8 * np.abs(x).max()  # saturated: the history's range is below this step's amax
    np.testing.assert_allclose(np.asarray(y).reshape(15, 16), xq @ wq, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dx).reshape(15, 32), gq @ wq.T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dw), xq.T @ gq, rtol=1e-5, atol=1e-6)
    # the history's cotangent: this call's three amaxes, newest column only
    want = np.zeros_like(history)
    want[:, 0] = [np.abs(x).max(), np.abs(w).max(), np.abs(g).max()]
    np.testing.assert_array_equal(np.asarray(dh), want)
    # an empty history (the first step) scales from the tensors' own amaxes: current scaling, bitwise
    empty = jnp.zeros((3, 8), jnp.float32)
    cur, cur_vjp = jax.vjp(zjax.fp8.matmul, jnp.asarray(x), jnp.asarray(w))
    got, got_vjp = jax.vjp(zjax.fp8.matmul_delayed, jnp.asarray(x), jnp.asarray(w), empty)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(cur))
    for a, b in zip(got_vjp(jnp.asarray(g))[:2], cur_vjp(jnp.asarray(g)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match=r"history \(8,\) float32; it must be \[3, H\] float32"):
        zjax.fp8.matmul_delayed(jnp.asarray(x), jnp.asarray(w), jnp.zeros((8,)))


@jax.jit
def _amaxes_of(params, histories, microbatch):
    """One device, no plan: a microbatch's objective (its loss sum over its count) differentiated with respect
    to the histories: the amaxes its products saw (column 0)."""

    def part(h):
        loss, _ = lm_loss(Decoder(DELAYED), params, microbatch, {zjax.fp8.COLLECTION: h})
        return loss.sum / loss.count

    return jax.grad(part)(histories)


def _reference_amaxes(params, histories, batch, k: int):
    """The amaxes maximised over the ``k`` microbatches (rows ``i, i+k, ...``, as the step splits them)."""
    rows = [{name: np.asarray(a)[i::k] for name, a in batch.items()} for i in range(k)]
    seen = [_amaxes_of(params, histories, microbatch) for microbatch in rows]
    return jax.tree.map(lambda *a: np.max(np.stack(a), axis=0), *seen)


@pytest.mark.slow  # stage 3 on dp x tp, twice; the fast test below checks the same on a user's layer
def test_the_step_keeps_one_history_per_projection_and_shifts_this_steps_amaxes_in():
    """dp=4 x tp=2 at stage 3, on uneven masks and packed rows: after each step every layer's and projection's
    history holds, in its newest column, the input's, weight's and gradient's amaxes of that step as one device
    computes them (the maximum over 2 microbatches, then over the whole batch), the older columns shifted by one;
    and with the histories filled, the step's gradient is one device's ``jax.grad`` of the same loss."""
    init_fn, loss_fn = train_functions(Decoder(DELAYED), DELAYED.max_len)
    plan = zjax.Plan(zjax.make_mesh(dp=4, tp=2), stage=3, precision="fp32")
    # SGD whose state is the gradient it applied (tests/_objective.py's, at a smaller rate: nothing saturates)
    state = plan.init(init_fn, optax.chain(optax.trace(decay=0.0), optax.scale(-0.05)), jax.random.key(0))
    batch = uneven_batch(8, DELAYED)
    before = jax.device_get(state.model_state[zjax.fp8.COLLECTION])
    assert set(before["layers"]) == {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}
    assert before["layers"]["wq"].shape == (DELAYED.layers, 3, zjax.fp8.HISTORY) and not np.any(before["layers"]["wq"])
    for k in (2, 1):
        params = nn.unbox(jax.device_get(state.params))
        state, metrics = plan.train_step(loss_fn, accum_steps=k)(state, plan.shard_batch(batch))
        after = jax.device_get(state.model_state[zjax.fp8.COLLECTION])
        want = _reference_amaxes(params, before, batch, k)
        for name, h in after["layers"].items():
            np.testing.assert_allclose(h[..., 0], want["layers"][name][..., 0], rtol=2e-6, err_msg=name)
            np.testing.assert_array_equal(h[..., 1:], before["layers"][name][..., :-1], err_msg=name)
            assert np.all(h[..., 0] > 0), name
        assert int(metrics["fp8_saturated"]) == 0 and not bool(metrics["skipped"])
        used, before = before, after
    # the last step's scales came from the first's amaxes (one microbatch: the fp8 roundings are one device's;
    # with several, each microbatch's own cotangent is rounded to e5m2, another draw of fp8's noise)
    model_state = {zjax.fp8.COLLECTION: used}
    one = jax.jit(jax.grad(lambda p, b: lm_loss(Decoder(DELAYED), p, b, model_state)[0].mean))(params, batch)
    applied = jax.tree.map(lambda x: np.asarray(x, np.float64), jax.device_get(state.opt_state.inner[0].trace))
    assert relative(applied, jax.tree.map(lambda x: np.asarray(x, np.float64), one)) < 3e-5


class Projection(nn.Module):
    """A user's own layer opted in: ``x @ kernel`` by a recipe of zjax.fp8.MATMULS."""

    recipe: str = "fp8-delayed"

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")),
                            (x.shape[-1], 64))  # fmt: skip
        return zjax.fp8.linen_matmul(self, "kernel", x, kernel, self.recipe)


def _projection_task():
    model = Projection()
    init_fn = lambda r: zjax.Variables.linen(model.init(r, jnp.zeros((1, 32))))  # noqa: E731

    def loss_fn(params, batch, model_state):
        y = model.apply({"params": params, **model_state}, batch["x"])
        return jnp.mean((y - batch["y"]) ** 2), model_state

    return init_fn, loss_fn


def test_a_users_layer_keeps_its_history_counts_saturations_and_skips_a_non_finite_amax():
    """A user's linen layer at stage 2 on dp=8 with 2 microbatches: the history's newest column holds the
    maximum of the amaxes one device sees on each microbatch (input, weight, gradient), the older ones shift;
    inputs beyond the history's range saturate (counted); an inf saturates too, so the loss stays finite, but its
    amax skips the step."""
    init_fn, loss_fn = _projection_task()
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=2, precision="fp32")
    state = plan.init(init_fn, optax.adamw(1e-3), jax.random.key(0))
    step = plan.train_step(loss_fn, accum_steps=2)
    rs = np.random.RandomState(0)
    x, y = rs.randn(16, 32).astype(np.float32), rs.randn(16, 64).astype(np.float32)
    x[1::2] *= 3  # the second microbatch (rows 1, 3, ...) has the larger inputs

    def amaxes(params, history, b):  # one device, one microbatch: the history's cotangent
        return jax.grad(lambda h: loss_fn(params, b, {zjax.fp8.COLLECTION: {"kernel": h}})[0])(history)[:, 0]

    before = np.asarray(jax.device_get(state.model_state[zjax.fp8.COLLECTION]["kernel"]))
    for _ in range(2):
        params = jax.device_get(state.params)
        state, m = step(state, plan.shard_batch({"x": x, "y": y}))
        after = np.asarray(jax.device_get(state.model_state[zjax.fp8.COLLECTION]["kernel"]))
        seen = [amaxes(params, before, {"x": x[i::2], "y": y[i::2]}) for i in range(2)]
        np.testing.assert_allclose(after[:, 0], np.maximum(*seen), rtol=1e-6)
        assert np.all(seen[1][:1] > seen[0][:1])  # the input's amax is the second microbatch's
        np.testing.assert_array_equal(after[:, 1:], before[:, :-1])
        assert int(m["fp8_saturated"]) == 0 and not bool(m["skipped"])
        before = after
    # inputs 100x larger than the history has seen: they saturate (the input's row; the gradient's grows too)
    state, m = step(state, plan.shard_batch({"x": 100 * x, "y": y}))
    assert int(m["fp8_saturated"]) >= 1 and not bool(m["skipped"])
    # an inf in the input saturates to the format's largest value, so the loss and the gradients stay finite,
    # but its amax is not: the step is skipped (fp32 scales no loss; the histories' presence makes it skip)
    kept = jax.device_get((state.params, state.model_state))
    bad = x.copy()
    bad[3, 7] = np.inf
    state, m = step(state, plan.shard_batch({"x": bad, "y": y}))
    assert np.isfinite(float(m["loss"])) and np.isfinite(float(m["grad_norm"]))
    assert bool(m["skipped"])
    now = jax.device_get((state.params, state.model_state))
    for a, b in zip(jax.tree.leaves(now), jax.tree.leaves(kept), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # three steps, a save and a restore; the fast suite checks the histories and model state restores
def test_the_histories_restore_bitwise_onto_another_stage_and_mesh(tmp_path):
    init_fn, loss_fn = train_functions(Decoder(DELAYED), DELAYED.max_len)
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=1, precision="bf16")
    state = plan.init(init_fn, optax.adamw(1e-3), jax.random.key(0))
    step = plan.train_step(loss_fn)
    for seed in range(3):
        state, _ = step(state, plan.shard_batch(uneven_batch(8, DELAYED, seed=seed)))
    want = jax.device_get(state.model_state)
    assert np.count_nonzero(want[zjax.fp8.COLLECTION]["layers"]["wq"][..., :3]) == DELAYED.layers * 3 * 3
    with zjax.Checkpointer(tmp_path) as ckpt:
        ckpt.save(state, plan)
    plan2 = zjax.Plan(zjax.make_mesh(dp=2, tp=4), stage=3, precision="bf16")
    with zjax.Checkpointer(tmp_path) as ckpt:
        restored, _ = ckpt.restore(plan2, init_fn, optax.adamw(1e-3), jax.random.key(0))
    assert restored.layout.stage.level == 3
    for a, b in zip(jax.tree.leaves(jax.device_get(restored.model_state)), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    restored, m = plan2.train_step(loss_fn)(restored, plan2.shard_batch(uneven_batch(8, DELAYED, seed=3)))
    assert not bool(m["skipped"])  # and it trains on from them


def test_where_the_histories_cannot_travel_it_says_so():
    model = Decoder(DELAYED)
    batch = {k: jnp.asarray(v) for k, v in uneven_batch(2, DELAYED).items()}
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, DELAYED.max_len), jnp.int32)))
    with pytest.raises(ValueError, match=r"amax histories \(matmul=fp8-delayed\), which are model state"):
        jax.eval_shape(lambda: lm_loss(model, variables["params"], batch))
    refused = r"matmul='fp8-delayed' under pipeline parallelism runs in zjax.models.lm_loss .* would sum them"
    with zjax.pipeline.use(zjax.Pipeline(2)), pytest.raises(ValueError, match=refused):  # the model's own call
        jax.eval_shape(lambda: model.apply(variables, jnp.asarray(batch["tokens"])))


@pytest.mark.slow  # two plans, two steps each; the fast suite checks the refusal of the model's own call
@pytest.mark.parametrize(("schedule", "stage"), [("gpipe", 3), ("1f1b", 1)])
def test_under_a_pipeline_the_histories_take_the_largest_amax_over_microbatches_and_ranks(schedule, stage):
    """dp=4 x pp=2, 4 microbatches per rank, on uneven masks and packed rows: the table engine (GPipe's order too)
    keeps each history's cotangent as the maximum over the microbatches and ranks where a pipeline would sum it, so
    after a step every newest column holds the amaxes one device sees on the whole batch, and with the histories
    filled the step's gradient is one device's ``jax.grad`` (at stage 3 each layer gathered per action)."""
    init_fn, loss_fn = train_functions(Decoder(DELAYED), DELAYED.max_len)
    pipe = zjax.Pipeline(4, schedule=schedule)
    plan = zjax.Plan(zjax.make_mesh(dp=4, pp=2), stage=stage, precision="fp32", pipeline=pipe)
    state = plan.init(init_fn, optax.chain(optax.trace(decay=0.0), optax.scale(-0.05)), jax.random.key(0))
    batch = uneven_batch(16, DELAYED)
    step = plan.train_step(loss_fn)
    state, _ = step(state, plan.shard_batch(batch))  # fills the histories (their first step scales per microbatch)
    params = nn.unbox(jax.device_get(state.params))
    before = jax.device_get(state.model_state[zjax.fp8.COLLECTION])
    state, metrics = step(state, plan.shard_batch(batch))
    after = jax.device_get(state.model_state[zjax.fp8.COLLECTION])
    want = _reference_amaxes(params, before, batch, 1)
    for name, h in after["layers"].items():
        np.testing.assert_allclose(h[..., 0], want["layers"][name][..., 0], rtol=2e-6, err_msg=name)
        np.testing.assert_array_equal(h[..., 1:], before["layers"][name][..., :-1], err_msg=name)
    assert int(metrics["fp8_saturated"]) == 0 and not bool(metrics["skipped"])
    model_state = {zjax.fp8.COLLECTION: before}
    one = jax.jit(jax.grad(lambda p, b: lm_loss(Decoder(DELAYED), p, b, model_state)[0].mean))(params, batch)
    applied = jax.tree.map(lambda x: np.asarray(x, np.float64), jax.device_get(state.opt_state.inner[0].trace))
    assert relative(applied, jax.tree.map(lambda x: np.asarray(x, np.float64), one)) < 3e-5


@pytest.mark.slow  # three compiles of the model; the fast suite checks the channel with dropout's nested case
def test_nested_remat_reads_the_histories_and_reports_the_amaxes_the_scan_reports():
    """Nested remat applies the stacked layers itself: each layer's history travels beside its weights (numbered
    layers), so its products scale from it and its cotangent is the amaxes they saw, as in flax's scan."""
    model = Decoder(DELAYED)
    variables = model.init(jax.random.key(0), jnp.zeros((1, DELAYED.max_len), jnp.int32))
    params, batch = nn.unbox(variables["params"]), uneven_batch(4, DELAYED)
    empty = variables[zjax.fp8.COLLECTION]
    filled = jax.tree.map(lambda h, a: h + a, empty, _amaxes_of(params, empty, batch))  # a step's amaxes shifted in

    def grads(cfg):
        mean = lambda p, h: lm_loss(Decoder(cfg), p, batch, {zjax.fp8.COLLECTION: h})[0].mean  # noqa: E731
        return jax.device_get(jax.jit(jax.grad(mean, (0, 1)))(params, filled))

    (want, want_amaxes), (got, amaxes) = grads(DELAYED), grads(dataclasses.replace(DELAYED, remat="nested"))
    assert relative(got, want) < 3e-5
    for a, b in zip(jax.tree.leaves(amaxes), jax.tree.leaves(want_amaxes), strict=True):
        assert np.all(a[..., 0] > 0)
        np.testing.assert_allclose(a, b, rtol=1e-6)
