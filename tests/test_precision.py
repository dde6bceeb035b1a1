"""Mixed precision: compute dtypes, fp32 master weights, dynamic loss scaling."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zjax
from zjax import DynamicLossScale, Precision

from ._models import host, linen_mlp_task, regression_batch, train


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16"])
def test_registry_round_trip(name):
    assert Precision.from_value(name).name == name


def test_unknown_precision():
    with pytest.raises(ValueError, match=r"Unknown precision 'fp8'; valid names are \['bf16', 'fp16', 'fp32'\]"):
        zjax.Plan(zjax.make_mesh(dp=8), precision="fp8")


# codegen: the master and its cast come out of two fusions of the initializer's arithmetic, equal to the last bit
# with XLA:CPU's default code generation (with LLVM's optimizations off one fp16 weight in 4,096 rounds the other way)
@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("bf16", jnp.bfloat16), pytest.param("fp16", jnp.float16, marks=pytest.mark.codegen), ("fp32", jnp.float32)],
)
def test_state_dtypes(precision, dtype):
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=1, precision=precision)
    init_fn, _ = linen_mlp_task()
    state = plan.init(init_fn, optax.adam(1e-3), jax.random.key(0))
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(dtype)}
    if precision == "fp32":
        assert state.opt_state.master is None  # the params are the master
    else:
        assert {x.dtype for x in jax.tree.leaves(state.opt_state.master)} == {jnp.dtype(jnp.float32)}
        # compute params are the rounded master weights
        for p, m in zip(jax.tree.leaves(state.params), jax.tree.leaves(state.opt_state.master), strict=True):
            np.testing.assert_array_equal(np.asarray(p), np.asarray(m.astype(dtype)))


def test_bf16_trains_close_to_fp32():
    data = [regression_batch(seed=i) for i in range(8)]
    l32, _, _ = train(linen_mlp_task(), data, stage=3, precision="fp32")
    l16, _, _ = train(linen_mlp_task(), data, stage=3, precision="bf16")
    assert l16[-1] < l16[0] * 0.8
    np.testing.assert_allclose(l16, l32, rtol=0.05)


def _poisoned_task():
    """An MLP task whose loss is multiplied by batch['poison'] (inf makes every gradient non-finite)."""
    init_fn, loss_fn = linen_mlp_task()
    return init_fn, lambda p, b: loss_fn(p, b) * b["poison"][0]


def test_fp16_skips_non_finite_step_and_halves_scale():
    plan = zjax.Plan(zjax.make_mesh(dp=4, tp=2), stage=2, precision="fp16", loss_scale=DynamicLossScale(initial=1024.0))
    init_fn, loss_fn = _poisoned_task()
    state = plan.init(init_fn, optax.adam(1e-2), jax.random.key(0))
    step = plan.train_step(loss_fn)
    good = {**regression_batch(), "poison": np.ones((32,), np.float32)}
    bad = {**good, "poison": np.full((32,), np.inf, np.float32)}

    state, m = step(state, plan.shard_batch(good))
    assert not bool(m["skipped"]) and float(state.loss_scale.scale) == 1024.0
    before = host((state.params, state.opt_state))
    state, m = step(state, plan.shard_batch(bad))
    assert bool(m["skipped"])
    assert float(state.loss_scale.scale) == 512.0
    assert int(state.step) == 2
    after = host((state.params, state.opt_state))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)  # params, master and moments untouched
    state, m = step(state, plan.shard_batch(good))
    assert not bool(m["skipped"]) and float(m["loss_scale"]) == 512.0


@pytest.mark.parametrize("skip", [None, True])
def test_bf16_leaves_a_non_finite_step_out_when_asked(skip):
    """``Plan(skip_nonfinite=True)``: in bf16 (no loss scaling) a step with an inf gradient leaves the state as it
    was and says so; by default it goes through (the weights turn NaN). ``False`` under fp16 is refused."""
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=3, precision="bf16", skip_nonfinite=skip)
    init_fn, loss_fn = _poisoned_task()
    state = plan.init(init_fn, optax.adam(1e-2), jax.random.key(0))
    bad = {**regression_batch(), "poison": np.full((32,), np.inf, np.float32)}
    before = host((state.params, state.opt_state))
    state, m = plan.train_step(loss_fn)(state, plan.shard_batch(bad))
    after = host((state.params, state.opt_state))
    assert bool(m["skipped"]) == bool(skip) and int(state.step) == 1
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True))
    assert same == bool(skip)
    with pytest.raises(ValueError, match=r"skip_nonfinite=False with precision='fp16': dynamic loss scaling"):
        zjax.Plan(zjax.make_mesh(dp=8), precision="fp16", skip_nonfinite=False)


def test_fp16_scale_grows_after_interval():
    cfg = DynamicLossScale(initial=8.0, growth_interval=3)
    data = [regression_batch(seed=i) for i in range(7)]
    plan_kw = {"loss_scale": cfg}
    _, state, _ = train(linen_mlp_task(), data, stage=1, precision="fp16", **plan_kw)
    assert float(state.loss_scale.scale) == 8.0 * 2 * 2  # grew after steps 3 and 6
    assert int(state.loss_scale.good_steps) == 1


def test_fp16_gradients_are_unscaled():
    """The same fp16 run with two different loss scales takes (nearly) the same steps."""
    data = [regression_batch(seed=i) for i in range(3)]
    a, sa, _ = train(
        linen_mlp_task(),
        data,
        stage=0,
        precision="fp16",
        tx=optax.sgd(0.1),
        loss_scale=DynamicLossScale(initial=2.0**4),
    )
    b, sb, _ = train(
        linen_mlp_task(),
        data,
        stage=0,
        precision="fp16",
        tx=optax.sgd(0.1),
        loss_scale=DynamicLossScale(initial=2.0**12),
    )
    np.testing.assert_allclose(a, b, rtol=2e-3)


def test_loss_scale_validation():
    with pytest.raises(ValueError, match="factor=1.0 must be > 1"):
        DynamicLossScale(factor=1.0)
    with pytest.raises(ValueError, match="growth_interval=0"):
        DynamicLossScale(growth_interval=0)
