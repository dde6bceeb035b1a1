"""One layout per state: built once, carried by the state, read by the step; errors name the leaf."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zjax

from ._models import linen_mlp_task, regression_batch


@pytest.fixture
def setup():
    init_fn, loss_fn = linen_mlp_task()
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=3, precision="bf16")
    state = plan.init(init_fn, optax.adamw(1e-3), jax.random.key(0))
    return plan, state, init_fn, loss_fn


def test_the_layout_is_the_one_init_built_and_abstract_state_agrees(setup):
    plan, state, init_fn, _ = setup
    assert isinstance(state.layout, zjax.StateLayout)
    abstract = plan.abstract_state(init_fn, state.tx, jax.random.key(0))
    assert abstract.layout == state.layout and hash(abstract.layout) == hash(state.layout)
    assert jax.tree.structure(abstract) == jax.tree.structure(state)  # one compiled step serves both
    specs = jax.tree.leaves(state.layout.state_specs(state.tx), is_leaf=lambda x: isinstance(x, P))
    for x, spec in zip(jax.tree.leaves(state), specs, strict=True):
        assert x.sharding.is_equivalent_to(NamedSharding(plan.mesh, spec), x.ndim)


def test_params_placed_elsewhere_get_an_error_naming_the_leaf_and_reshard_fixes_them(setup):
    plan, state, _, loss_fn = setup
    step = plan.train_step(loss_fn)
    moved = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(plan.mesh, P())), state.params)
    bad = state.replace(params=moved)
    with pytest.raises(
        ValueError, match=r"state leaf 'params/Dense_0/bias' .* placed as P\(\).* puts it at P\('dp',\)"
    ):
        step(bad, plan.shard_batch(regression_batch()))
    fixed = plan.reshard(bad)
    assert fixed.layout == state.layout
    _, metrics = step(fixed, plan.shard_batch(regression_batch()))
    assert np.isfinite(float(metrics["loss"]))


def test_reshard_moves_a_state_into_another_plan_and_keeps_the_logical_names(setup):
    plan, state, _, loss_fn = setup
    want = jax.device_get(state)
    other = zjax.Plan(zjax.make_mesh(dp=4, tp=2), stage=1, precision="bf16")
    with pytest.raises(ValueError, match=r"laid out for ZeRO stage 3 .* call state = plan.reshard\(state\)"):
        other.train_step(loss_fn)(state, other.shard_batch(regression_batch()))
    moved = other.reshard(state)
    assert moved.layout.stage.level == 1
    assert moved.params["Dense_0"]["kernel"].sharding.spec == P(None, "tp")  # ("embed", "mlp") -> tp
    for a, b in zip(jax.tree.leaves(moved.replace(rng=None)), jax.tree.leaves(want.replace(rng=None)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="precision 'fp32' does not keep them"):
        zjax.Plan(zjax.make_mesh(dp=8), stage=0, precision="fp32").reshard(state)


def test_a_state_without_a_layout_is_refused_with_the_fix(setup):
    plan, state, _, loss_fn = setup
    with pytest.raises(ValueError, match=r"no layout.*plan.reshard\(state\)"):
        plan.train_step(loss_fn)(state.replace(layout=None), plan.shard_batch(regression_batch()))


def test_eval_step_runs_on_the_layout_without_donation_or_recompiling(setup):
    plan, state, _, loss_fn = setup
    traces = []

    def evaluate(params, batch):
        traces.append(1)
        return {"loss": loss_fn(params, batch)}

    ev = plan.eval_step(evaluate)
    a = ev(state, plan.shard_batch(regression_batch(seed=1)))
    b = ev(state, plan.shard_batch(regression_batch(seed=2)))
    assert len(traces) == 1  # traced (and compiled) once
    assert float(a["loss"]) != float(b["loss"])
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))  # nothing donated
    # eval agrees with the train step's loss on the same batch
    _, metrics = plan.train_step(loss_fn)(state, plan.shard_batch(regression_batch(seed=1)))
    np.testing.assert_allclose(float(a["loss"]), float(metrics["loss"]), rtol=1e-6)


def test_memory_report_belongs_to_the_step_it_compiles(setup):
    plan, state, _, loss_fn = setup
    batch = jax.ShapeDtypeStruct((64, 32), np.float32)
    batch = {"x": batch, "y": batch}
    one = plan.train_step(loss_fn, accum_steps=1).memory_report(state, batch)
    plan.eval_step(lambda p, b: loss_fn(p, b))  # building other steps changes nothing
    four = plan.train_step(loss_fn, accum_steps=4)
    assert four.memory_report(state, batch).accum_steps == 4 and one.accum_steps == 1
    assert not hasattr(plan, "memory_report")
