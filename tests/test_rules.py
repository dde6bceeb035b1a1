import jax
import pytest
from jax.sharding import PartitionSpec as P

import zjax
from zjax.sharding import Leaf, read_leaves

from ._models import LinenMLP, linen_mlp_task, nnx_mlp_task


@pytest.fixture(scope="module")
def mesh():
    return zjax.make_mesh(dp=4, tp=2)


def specs(rules, leaves, mesh):
    return {leaf.path: spec for leaf, spec in zip(leaves, rules.compute_specs(leaves, mesh), strict=True)}


def test_linen_logical_names(mesh):
    init_fn, _ = linen_mlp_task()
    leaves = read_leaves(jax.eval_shape(init_fn, jax.random.key(0)))
    got = specs(zjax.Rules(), leaves, mesh)
    assert got == {
        "Dense_0/bias": P("tp"),
        "Dense_0/kernel": P(None, "tp"),
        "Dense_1/bias": P(),
        "Dense_1/kernel": P("tp"),
    }


def test_nnx_logical_names(mesh):
    from flax import nnx

    init_fn, _ = nnx_mlp_task()
    with nnx.use_eager_sharding(False):
        leaves = read_leaves(jax.eval_shape(init_fn, jax.random.key(0)))
    got = specs(zjax.Rules(), leaves, mesh)
    assert got["up/kernel"] == P(None, "tp")
    assert got["down/kernel"] == P("tp")
    assert got["up/bias"] == P()  # nnx.Linear's bias carries no annotation


def test_axis_of_size_one_is_dropped():
    leaves = [Leaf("w", (64, 256), None, ("embed", "mlp"))]
    assert zjax.Rules().compute_specs(leaves, zjax.make_mesh(dp=8)) == [P()]


def test_regex_rules_for_unannotated(mesh):
    plain = jax.eval_shape(lambda r: LinenMLP().init(r, jax.numpy.zeros((1, 32)))["params"], jax.random.key(0))
    plain = zjax.sharding.unbox(plain)
    rules = zjax.Rules(regex=[(r"Dense_0/kernel$", P(None, "tp")), (r"Dense_1/kernel$", ("tp",))])
    got = specs(rules, read_leaves(plain), mesh)
    assert got["Dense_0/kernel"] == P(None, "tp")
    assert got["Dense_1/kernel"] == P("tp")


def test_unknown_mesh_axis(mesh):
    leaves = [Leaf("layer/w", (64, 128), None, ("embed", "mlp"))]
    with pytest.raises(ValueError, match=r"'layer/w' \(shape \(64, 128\)\).*mesh axis 'model'.*not in the mesh"):
        zjax.Rules(logical={"embed": None, "mlp": "model"}).compute_specs(leaves, mesh)


def test_duplicate_logical_name():
    with pytest.raises(ValueError, match="duplicate logical name 'mlp'"):
        zjax.Rules(logical=[("mlp", "tp"), ("embed", None), ("mlp", None)])


def test_not_divisible(mesh):
    leaves = [Leaf("ffn/kernel", (64, 129), None, ("embed", "mlp"))]
    with pytest.raises(
        ValueError, match=r"'ffn/kernel' \(shape \(64, 129\)\): dimension 1 of size 129.*'tp' of size 2"
    ):
        zjax.Rules().compute_specs(leaves, mesh)


def test_unknown_logical_name(mesh):
    leaves = [Leaf("lora/w", (8, 64), None, ("rank", "embed"))]
    with pytest.raises(ValueError, match=r"logical axis name 'rank'.*Add \('rank', None\) to Rules.logical"):
        zjax.Rules().compute_specs(leaves, mesh)


def test_axis_used_twice(mesh):
    leaves = [Leaf("w", (64, 64), None, ("mlp", "heads"))]
    with pytest.raises(ValueError, match="uses mesh axis 'tp' for dimensions 0 and 1"):
        zjax.Rules().compute_specs(leaves, mesh)


def test_dp_is_not_a_parameter_target(mesh):
    leaves = [Leaf("w", (64, 64), None, ("embed", "mlp"))]
    with pytest.raises(ValueError, match="comes from the ZeRO stage"):
        zjax.Rules(logical={"embed": "dp", "mlp": None}).compute_specs(leaves, mesh)


def test_names_rank_mismatch():
    import flax.linen as nn

    class Bad(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, kernel_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)))(x)

    with pytest.raises(ValueError, match=r"'params/Dense_0/kernel' with shape \(3, 4\) has 1 logical axis names"):
        read_leaves(jax.eval_shape(Bad().init, jax.random.key(0), jax.numpy.zeros((1, 3))))


def test_bad_rule_types():
    with pytest.raises(TypeError, match="maps to 3"):
        zjax.Rules(logical={"mlp": 3})
    with pytest.raises(ValueError, match="not a valid regular expression"):
        zjax.Rules(regex=[("(", P())])
