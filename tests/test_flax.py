"""flax linen and nnx models train under every stage; batches and inputs are checked."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import zjax

from ._models import NnxMLP, linen_mlp_task, nnx_mlp_task, regression_batch, train

DATA = [regression_batch(seed=i) for i in range(4)]


# stages 1 and 2 keep stage 0's whole weights (every stage computes the one-device objective in test_objective.py)
@pytest.mark.parametrize("stage", [0, pytest.param(1, marks=pytest.mark.slow), 3])
@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_trains_under_each_stage(kind, stage):
    task = linen_mlp_task() if kind == "linen" else nnx_mlp_task()
    mesh = zjax.make_mesh(dp=4, tp=2)
    losses, state, _ = train(task, DATA * 2, stage=stage, mesh=mesh, precision="bf16")
    assert losses[-1] < 0.8 * losses[0]
    kernel = state.params["up"]["kernel"] if kind == "nnx" else state.params["Dense_0"]["kernel"]
    spec = kernel.sharding.spec
    assert "tp" in str(spec)  # the logical annotation reached the mesh
    assert ("dp" in str(spec)) == (stage == 3)


def test_nnx_state_merges_back_into_the_module():
    init_fn, _ = nnx_mlp_task()
    _, state, _ = train((init_fn, nnx_mlp_task()[1]), DATA, stage=3, precision="fp32")
    with nnx.use_eager_sharding(False):
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: NnxMLP(32, 128, 32, nnx.Rngs(0))))
    model = nnx.merge(graphdef, state.params)
    out = model(DATA[0]["x"])
    assert out.shape == (32, 32)
    assert isinstance(model.up.kernel, nnx.Param)


def test_batch_not_divisible():
    mesh = zjax.make_mesh(dp=8)
    plan = zjax.Plan(mesh, stage=1)
    with pytest.raises(ValueError, match=r"batch leaf 'x' has shape \(12, 32\).*mesh axis 'dp' of size 8"):
        plan.shard_batch({"x": np.zeros((12, 32), np.float32)})


def test_batch_not_divisible_by_accumulation():
    init_fn, loss_fn = linen_mlp_task()
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=2, precision="fp32")
    state = plan.init(init_fn, optax.sgd(0.1), jax.random.key(0))
    step = plan.train_step(loss_fn, accum_steps=3)
    with pytest.raises(ValueError, match=r"not divisible by mesh axis 'dp' of size 8 x accum_steps=3 = 24"):
        step(state, plan.shard_batch(regression_batch(32)))


def test_bad_arguments():
    plan = zjax.Plan(zjax.make_mesh(dp=8))
    init_fn, loss_fn = linen_mlp_task()
    with pytest.raises(TypeError, match="tx must be an optax.GradientTransformation"):
        plan.init(init_fn, "adam", jax.random.key(0))
    with pytest.raises(ValueError, match="accum_steps=0 must be an int >= 1"):
        plan.train_step(loss_fn, accum_steps=0)
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        zjax.Plan("dp=8")
    with pytest.raises(ValueError, match="clip_norm=-1"):
        zjax.Plan(zjax.make_mesh(dp=8), clip_norm=-1)


def test_aux_is_returned():
    init_fn, loss_fn = linen_mlp_task()

    def with_aux(params, batch):
        loss = loss_fn(params, batch)
        return loss, {"twice": 2 * loss}

    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=1, precision="fp32")
    state = plan.init(init_fn, optax.sgd(0.1), jax.random.key(0))
    _, metrics = plan.train_step(with_aux)(state, plan.shard_batch(DATA[0]))
    assert float(metrics["aux"]["twice"]) == pytest.approx(2 * float(metrics["loss"]))
    assert set(metrics) >= {"loss", "grad_norm", "loss_scale", "skipped", "aux"}
