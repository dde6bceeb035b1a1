import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import zjax
from zjax.stages import STAGES, Stage, add_axis

from ._models import linen_mlp_task


@pytest.mark.parametrize("level", sorted(STAGES))
def test_registry_round_trip(level):
    stage = STAGES[level]
    assert Stage.from_value(level) is stage
    assert Stage.from_value(stage.name) is stage
    assert Stage.from_value(str(level)) is stage
    assert Stage.from_value(stage) is stage


def test_stage_flags_are_cumulative():
    flags = [(s.shard_optimizer, s.shard_gradients, s.shard_parameters) for s in STAGES.values()]
    assert flags == [(False, False, False), (True, False, False), (True, True, False), (True, True, True)]


def test_unknown_stage():
    with pytest.raises(ValueError, match=r"Unknown ZeRO stage 4; valid stages are \[0, 1, 2, 3\]"):
        Stage.from_value(4)
    with pytest.raises(ValueError, match="Unknown ZeRO stage 'zero9'"):
        Stage.from_value("zero9")


SIZES = {"pp": 1, "dp": 4, "tp": 2}


@pytest.mark.parametrize(
    ("spec", "shape", "want"),
    [
        (P(), (64, 256), P(None, "dp")),  # largest divisible dim
        (P(), (256, 64), P("dp")),
        (P(), (6, 8), P(None, "dp")),  # 6 is not divisible by 4
        (P(None, "tp"), (64, 256), P("dp", "tp")),  # never on the tp-sharded dim if a free one fits
        (P("tp"), (256,), P(("tp", "dp"))),  # stacked on the tp dim: 256 % (2*4) == 0
    ],
)
def test_dp_placement(spec, shape, want):
    assert add_axis(spec, shape, "dp", SIZES) == (want, None)


@pytest.mark.parametrize(
    ("spec", "shape", "want"),
    [
        (P(), (6, 4, 12), P("dp", None, "ep")),  # no dim divides by 8: dp on one, ep on another (largest pair)
        (P(None, "tp"), (6, 4, 12), P("dp", "tp", "ep")),
        (P(), (2, 3, 4), P("dp", None, "ep")),
    ],
)
def test_zero_axes_split_over_two_dims_when_no_one_dim_divides(spec, shape, want):
    """DeepSeek-V3's wq_b [1536, 128, 192] on dp=32 x ep=32 is such a leaf: replicated, 35 GB per device of it
    and its optimizer state at stage 3."""
    sizes = {"dp": 2, "ep": 4, "tp": 2}
    assert add_axis(spec, shape, ("dp", "ep"), sizes) == (want, None)
    assert add_axis(P(), (1536, 128, 192), ("dp", "ep"), {"dp": 32, "ep": 32}) == (P("dp", None, "ep"), None)
    assert add_axis(P(), (3, 5), ("dp", "ep"), sizes)[1]  # neither part divides


@pytest.mark.parametrize(("spec", "shape"), [(P(), ()), (P(), (3, 5)), (P("tp"), (6,))])
def test_dp_placement_impossible(spec, shape):
    got, reason = add_axis(spec, shape, "dp", SIZES)
    assert got == spec and reason


def test_unshardable_leaf_is_reported():
    mesh = zjax.make_mesh(dp=8)
    plan = zjax.Plan(mesh, stage=3)

    def init_fn(rng):
        return {"w": jax.random.normal(rng, (64, 64)), "odd": jnp.ones((3, 5))}

    state = plan.init(init_fn, optax.sgd(0.1), jax.random.key(0))
    assert [(u.path, u.shape) for u in plan.unsharded(state)] == [("odd", (3, 5))]
    assert state.params["odd"].sharding.spec == P()
    assert state.params["w"].sharding.spec == P("dp")


OPTIMIZERS = {
    "adamw": optax.adamw(1e-3),
    "adamw_masked": optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
    "sgd_momentum": optax.sgd(1e-2, momentum=0.9),
    "sgd": optax.sgd(1e-2),
    "chain_clip_lion": optax.chain(optax.clip_by_global_norm(1.0), optax.lion(1e-4)),
    "adafactor": optax.adafactor(1e-3),
    "schedule_free": optax.contrib.schedule_free_adamw(1e-3),
    "inject": optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
    "accumulate": optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_state_follows_params(name):
    """Every parameter-shaped optimizer leaf is sharded like the master weights, for any optax transform."""
    mesh = zjax.make_mesh(dp=4, tp=2)
    plan = zjax.Plan(mesh, stage=1, precision="bf16")
    init_fn, _ = linen_mlp_task()
    state = plan.init(init_fn, OPTIMIZERS[name], jax.random.key(0))
    masters = {(tuple(x.shape), str(x.sharding.spec)) for x in jax.tree.leaves(state.opt_state.master) if x.ndim}
    sharded = 0
    for leaf in jax.tree.leaves(state.opt_state.inner):
        spec = leaf.sharding.spec
        if leaf.size >= 64 and leaf.ndim:
            # big leaves are dp-sharded; those shaped like a parameter carry exactly its master's spec
            assert "dp" in str(spec), (name, leaf.shape, spec)
            shapes = {s for s, _ in masters}
            if tuple(leaf.shape) in shapes:
                assert (tuple(leaf.shape), str(spec)) in masters
            sharded += 1
    if name != "sgd":
        assert sharded > 0


def test_a_leaf_split_over_two_dims_computes_the_one_device_objective():
    """Stage 3 on dp=4 x cp=2 with widths 36, 60 and 12 (none divides by 8): the projections are split dp on one
    dim and cp on another, and the step's gradient is one device's (packed rows, uneven masks)."""
    from zjax.models import DecoderConfig

    from ._objective import applied, initial, reference, relative, uneven_batch

    cfg = DecoderConfig(vocab=64, embed=36, layers=2, heads=3, head_dim=12, mlp=60, max_len=16)
    plan = zjax.Plan(zjax.make_mesh(dp=4, cp=2), stage=3, precision="fp32")
    batch = uneven_batch(16, cfg)
    loss, grads = reference(cfg, batch)
    specs = plan.layout(initial(cfg)).param_specs
    assert specs["layers"]["wq"] == P(None, "dp", None, "cp") and specs["layers"]["w_up"] == P(None, "dp", "cp")
    got, metrics = applied(plan, cfg, batch)
    assert relative(got, grads) <= 3e-5, relative(got, grads)
    assert abs(float(metrics["loss"]) - loss) <= 3e-5 * loss
