"""Non-trainable model state (linen batch_stats, nnx BatchNorm statistics and RNG state) in TrainState."""

import jax
import numpy as np
import optax
import pytest

import zjax

from ._models import cnn_task, image_batch, nnx_norm_drop_task, regression_batch

STEPS = 3


def run(task, batch_fn, stage, steps=STEPS):
    init_fn, loss_fn = task
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=stage, precision="fp32")
    state = plan.init(init_fn, optax.adam(1e-2), jax.random.key(0))
    first = jax.device_get(state.model_state)
    step = plan.train_step(loss_fn)
    losses = []
    for i in range(steps):
        state, metrics = step(state, plan.shard_batch(batch_fn(seed=i)))
        losses.append(float(metrics["loss"]))
    return losses, first, state, plan


class _Runs(dict):
    """Each stage's run, trained the first time a test asks for it (a slow-only stage costs the fast
    suite nothing)."""

    def __missing__(self, stage):
        self[stage] = run(cnn_task(), image_batch, stage)
        return self[stage]


@pytest.fixture(scope="module")
def cnn_runs():
    return _Runs()


@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), 3])  # 2 = 1 + split gradients
def test_linen_batchnorm_and_dropout_train_alike_under_every_stage(cnn_runs, stage):
    want, _, want_state, _ = cnn_runs[0]
    got, first, state, _ = cnn_runs[stage]
    np.testing.assert_allclose(got, want, atol=1e-5)
    stats = jax.device_get(state.model_state["batch_stats"])
    for new, old, ref in zip(
        jax.tree.leaves(stats),
        jax.tree.leaves(first),
        jax.tree.leaves(jax.device_get(want_state.model_state)),
        strict=True,
    ):
        assert not np.allclose(new, old)  # the step returned updated statistics
        np.testing.assert_allclose(new, ref, atol=1e-5)


def test_model_state_is_checkpointed_and_restored_into_another_stage(cnn_runs, tmp_path):
    _, _, state, plan = cnn_runs[3]
    init_fn, loss_fn = cnn_task()
    with zjax.Checkpointer(tmp_path) as ckpt:
        ckpt.save(state, plan)
    other = zjax.Plan(zjax.make_mesh(dp=4, tp=2), stage=1, precision="fp32")
    with zjax.Checkpointer(tmp_path) as ckpt:
        restored, _ = ckpt.restore(other, init_fn, optax.adam(1e-2), jax.random.key(0))
    for a, b in zip(jax.tree.leaves(restored.model_state), jax.tree.leaves(state.model_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _, metrics = other.train_step(loss_fn)(restored, other.shard_batch(image_batch(seed=9)))
    assert np.isfinite(float(metrics["loss"]))


def test_nnx_batchnorm_and_dropout_train_through_the_readme_recipe():
    want, first, state0, _ = run(nnx_norm_drop_task(), regression_batch, 0)
    got, _, state3, _ = run(nnx_norm_drop_task(), regression_batch, 3)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert want[-1] < want[0]
    new = jax.device_get(state3.model_state)
    assert not np.allclose(new["norm"]["mean"].get_value(), first["norm"]["mean"].get_value())
    counts = [x for p, x in jax.tree_util.tree_flatten_with_path(new)[0] if "count" in jax.tree_util.keystr(p)]
    assert counts and int(counts[0]) > int(
        [x for p, x in jax.tree_util.tree_flatten_with_path(first)[0] if "count" in jax.tree_util.keystr(p)][0]
    )  # the dropout stream advanced: new masks every step


def test_a_loss_without_model_state_is_refused_for_a_stateful_model():
    init_fn, _ = cnn_task()
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=0, precision="fp32")
    state = plan.init(init_fn, optax.adam(1e-2), jax.random.key(0))
    step = plan.train_step(lambda params, batch: 0.0 * jax.tree.leaves(params)[0].sum())
    with pytest.raises(ValueError, match=r"holds model state \(batch_stats/BatchNorm_0/mean.*no model_state parameter"):
        step(state, plan.shard_batch(image_batch()))


def test_variables_linen_rejects_what_is_not_a_variables_dict():
    with pytest.raises(TypeError, match="Variables.linen: expected the dict"):
        zjax.Variables.linen([1, 2])
