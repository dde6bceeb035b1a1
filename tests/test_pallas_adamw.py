"""Fused AdamW: reference == optax, kernel (interpret mode, on CPU) == reference, CUDA lowering, one pass."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.export import DisabledSafetyCheck
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zjax
from zjax.pallas import FusedAdamWConfig, fused_adamw
from zjax.pallas._backend import TRITON_CUSTOM_CALL
from zjax.pallas.adamw import FusedAdamWState, Scalars, adamw_kernel, adamw_reference
from zjax.planner._compile import partitioned_hlo
from zjax.planner._hlo import collectives

from ._models import decoder_task, linen_mlp_task, regression_batch, rel_norm_diff, token_batch, train


def test_reference_matches_optax_adamw_over_100_steps():
    rs = np.random.RandomState(0)
    params = {"w": jnp.asarray(rs.randn(16, 8), jnp.float32), "b": jnp.asarray(rs.randn(8), jnp.float32)}
    mask = {"w": True, "b": False}  # no decay on the bias
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 10, 100)
    ours = fused_adamw(schedule, weight_decay=0.1, mask=mask, implementation="xla")
    theirs = optax.adamw(schedule, weight_decay=0.1, mask=mask)
    p1, p2 = params, params
    s1, s2 = ours.init(p1), theirs.init(p2)

    @jax.jit
    def step1(g, s, p):  # the fused path: the master is updated directly, no update tree
        one = jnp.float32(1.0)
        new, s, _ = ours.fused_apply(
            g, s, p, compute_dtype=jnp.float32, inv_scale=one, apply=one, mesh=None, specs=None
        )
        return new, s

    step2 = jax.jit(theirs.update)
    for i in range(100):
        g = jax.tree.map(lambda x, i=i: jnp.asarray(np.random.RandomState(i).randn(*x.shape), jnp.float32), params)
        p1, s1 = step1(g, s1, p1)
        u2, s2 = step2(g, s2, p2)
        p2 = optax.apply_updates(p2, u2)
    # relative in norm: elementwise, Adam's m / sqrt(v) turns ulp-level reassociation differences on
    # near-zero gradients into a few 1e-6 on single elements after 100 steps
    assert rel_norm_diff(p1, p2) <= 1e-6


def _inputs(n, compute_dtype, seed=0, apply=1.0):
    rs = np.random.RandomState(seed)
    grad = jnp.asarray(rs.randn(n) * 100, compute_dtype)
    master = jnp.asarray(rs.randn(n), jnp.float32)
    m = jnp.asarray(rs.randn(n) * 0.1, jnp.float32)
    v = jnp.asarray(rs.rand(n) * 0.1, jnp.float32)
    s = Scalars(*(jnp.float32(x) for x in (1e-3, 0.9, 0.999, 1e-8, 0.1, 1 - 0.9**3, 1 - 0.999**3, 1 / 128, apply)))
    return s, grad, master, m, v


def assert_within_ulp(got, want, *scales):
    """|got - want| <= 1 ulp (fp32) of the largest magnitude among the result and the terms that formed it:
    where terms cancel (m' = b1 m + (1 - b1) g near 0) one rounding of a term is more than 1 ulp of the sum."""
    scale = np.max([np.abs(np.asarray(x, np.float32)) for x in (want, *scales)], axis=0)
    err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    assert np.all(err <= np.spacing(scale.astype(np.float32))), float(np.max(err / np.spacing(scale)))


@pytest.mark.parametrize("compute_dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("n", [1, 1000, 4097])
def test_interpret_kernel_matches_reference(compute_dtype, n):
    s, grad, master, m, v = _inputs(n, compute_dtype)
    want = jax.jit(adamw_reference, static_argnums=5)(s, grad, master, m, v, compute_dtype)
    kernel = jax.jit(lambda *a: adamw_kernel(*a, compute_dtype, FusedAdamWConfig(block_size=256), interpret=True))
    got = kernel(s.as_array(), grad, master, m, v)
    assert jax.default_backend() == "cpu"  # the Pallas kernel itself ran, in interpret mode, here on CPU
    g32 = np.asarray(grad, np.float32) * float(s.inv_scale)
    assert_within_ulp(got[0], want[0], master)  # fp32 master: within 1 ulp
    assert_within_ulp(got[1], want[1], m, g32)  # first moment
    assert_within_ulp(got[2], want[2], v, g32 * g32)  # second moment
    # the compute copy is the kernel's own master cast (a master 1 ulp apart may round to another bf16/fp16), and
    # equals the reference's wherever the masters agree
    copy = np.asarray(got[3], np.float32)
    np.testing.assert_array_equal(copy, np.asarray(jnp.asarray(got[0]).astype(compute_dtype), np.float32))
    same = np.asarray(got[0]) == np.asarray(want[0])
    np.testing.assert_array_equal(copy[same], np.asarray(want[3], np.float32)[same])
    assert not np.array_equal(np.asarray(got[0]), np.asarray(master))  # it really updated


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_non_finite_step_changes_nothing(impl):
    s, grad, master, m, v = _inputs(300, jnp.bfloat16, apply=0.0)
    if impl == "xla":
        out = adamw_reference(s, grad, master, m, v, jnp.bfloat16)
    else:
        out = adamw_kernel(s.as_array(), grad, master, m, v, jnp.bfloat16, FusedAdamWConfig(), interpret=True)
    for got, want in zip(out[:3], (master, m, v), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_kernel_reads_and_writes_each_byte_once():
    """In the kernel body each input ref is loaded once and each output stored once: 28 bytes/param (bf16)."""
    args = (jnp.zeros(16), jnp.zeros(100, jnp.bfloat16), jnp.zeros(100), jnp.zeros(100), jnp.zeros(100))
    jaxpr = jax.make_jaxpr(lambda *a: adamw_kernel(*a, jnp.bfloat16, FusedAdamWConfig()))(*args)
    (call,) = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    body = call.params["jaxpr"]
    scalars, *arrays = body.invars
    inputs, outputs = arrays[:4], arrays[4:]
    loads = [e.invars[0] for e in body.eqns if e.primitive.name == "masked_load"]
    stores = [e.invars[0] for e in body.eqns if e.primitive.name == "masked_swap"]
    assert sorted(map(id, loads)) == sorted(map(id, inputs))
    assert sorted(map(id, stores)) == sorted(map(id, outputs))
    per_param = sum(np.dtype(r.aval.dtype).itemsize for r in inputs + outputs)
    assert per_param == 28


def sharded_update(tx, specs):
    """``(update, args)``: the fused update of a dp x tp sharded state (``w`` (64, 32), ``b`` (40,)), told ``specs``."""
    mesh = zjax.make_mesh(dp=4, tp=2)
    placed = {"w": P("dp", "tp"), "b": P("dp")}
    shapes = {"w": (64, 32), "b": (40,)}

    def sds(dtype):
        return {k: jax.ShapeDtypeStruct(v, dtype, sharding=NamedSharding(mesh, placed[k])) for k, v in shapes.items()}

    def update(g, state, master):
        return tx.fused_apply(
            g, state, master, compute_dtype=jnp.bfloat16, inv_scale=jnp.float32(1.0), apply=jnp.float32(1.0),
            mesh=mesh, specs=specs,
        )  # fmt: skip

    count = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
    return update, (sds(jnp.bfloat16), FusedAdamWState(count, sds(jnp.float32), sds(jnp.float32)), sds(jnp.float32))


SPECS = {"w": P("dp", "tp"), "b": P("dp")}


@pytest.mark.parametrize(("group_bytes", "launches"), [(4 << 20, 1), (0, 2)])
def test_lowers_for_cuda_under_shard_map_without_gathering(group_bytes, launches):
    """Small leaves share one launch (a constant-size buffer); with grouping off each leaf gets its own."""
    config = FusedAdamWConfig(group_bytes=group_bytes)
    tx = fused_adamw(1e-3, implementation="pallas", interpret=False, config=config)
    update, args = sharded_update(tx, SPECS)
    exported = jax.export.export(
        jax.jit(update), platforms=["cuda"], disabled_checks=[DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)]
    )(*args)
    assert exported.mlir_module().count(TRITON_CUSTOM_CALL) == launches  # on the local shards


@pytest.mark.parametrize(("specs", "gathers"), [(SPECS, False), ({"w": P(), "b": P()}, True)])
def test_the_partitioned_update_gathers_nothing(specs, gathers):
    """The kernel runs inside shard_map on each device's shard: the program after SPMD partitioning has no
    all-gather (collectives only exist there, not in exported StableHLO). Told the wrong specs (whole
    leaves), the same update must gather the sharded inputs: the check can fail."""
    update, args = sharded_update(fused_adamw(1e-3, implementation="pallas", interpret=True), specs)
    _, hlo = partitioned_hlo(jax.jit(update).lower(*args))
    kinds = [c.kind for c in collectives(hlo)]
    assert ("all-gather" in kinds) == gathers, kinds


def test_bad_implementation_name():
    with pytest.raises(ValueError, match=r"unknown implementation 'cuda'; valid names are \['auto', 'pallas', 'xla'\]"):
        fused_adamw(1e-3, implementation="cuda")


@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.slow), 3])
def test_plan_trains_with_fused_adamw_like_optax(stage):
    data = [regression_batch(seed=i) for i in range(5)]
    mesh = zjax.make_mesh(dp=4, tp=2)
    ref, _, _ = train(linen_mlp_task(), data, stage=stage, mesh=mesh, precision="bf16",
                      tx=optax.adamw(1e-2, weight_decay=0.1))  # fmt: skip
    for impl in ("xla", "pallas"):
        tx = fused_adamw(1e-2, weight_decay=0.1, implementation=impl)
        got, state, _ = train(linen_mlp_task(), data, stage=stage, mesh=mesh, precision="bf16", tx=tx)
        np.testing.assert_allclose(got, ref, rtol=1e-3)  # bf16 compute copies
        assert int(state.opt_state.inner.count) == 5


def test_fused_fp16_skips_non_finite_steps():
    init_fn, loss_fn = linen_mlp_task()
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=2, precision="fp16")
    state = plan.init(init_fn, fused_adamw(1e-2, implementation="pallas"), jax.random.key(0))
    step = plan.train_step(lambda p, b: loss_fn(p, b) * b["poison"][0])
    good = {**regression_batch(), "poison": np.ones((32,), np.float32)}
    state, _ = step(state, plan.shard_batch(good))
    before = jax.device_get((state.params, state.opt_state))
    state, metrics = step(state, plan.shard_batch({**good, "poison": np.full((32,), np.inf, np.float32)}))
    assert bool(metrics["skipped"])
    for a, b in zip(
        jax.tree.leaves(before), jax.tree.leaves(jax.device_get((state.params, state.opt_state))), strict=True
    ):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_example_lm_20_steps_fused_vs_optax():
    """The example's decoder for 20 steps: the fused update follows optax.adamw within bf16 tolerance."""
    import optax as ox

    data = [token_batch(16, seed=i) for i in range(20)]
    ref, _, _ = train(decoder_task(), data, stage=3, precision="bf16", tx=ox.adamw(3e-3, weight_decay=0.1))
    got, _, _ = train(decoder_task(), data, stage=3, precision="bf16", tx=fused_adamw(3e-3, weight_decay=0.1))
    np.testing.assert_allclose(got, ref, rtol=1e-3)  # measured 1.8e-4; bf16 eps is 7.8e-3
    assert got[-1] < got[0]


def test_a_shard_too_long_for_int32_offsets_runs_in_pieces(monkeypatch):
    """Offsets are int32 inside one launch: a longer shard runs as consecutive launches with the same bits.
    Shown at a lowered limit in interpret mode, and abstractly at a real 2**31 + 5 elements."""
    from zjax.pallas.adamw import _kernel

    s, grad, master, m, v = _inputs(10_000, jnp.bfloat16)
    cfg = FusedAdamWConfig(block_size=1024)
    run = lambda: jax.jit(lambda *a: adamw_kernel(*a, jnp.bfloat16, cfg, interpret=True))(  # noqa: E731
        s.as_array(), grad, master, m, v
    )
    whole = run()
    monkeypatch.setattr(_kernel, "_MAX_OFFSET", 5000)  # pieces of 3,072 elements: 4 launches
    jaxpr = jax.make_jaxpr(lambda *a: adamw_kernel(*a, jnp.bfloat16, cfg))(s.as_array(), grad, master, m, v)
    assert [e.primitive.name for e in jaxpr.eqns].count("pallas_call") == 4
    for got, want in zip(run(), whole, strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    monkeypatch.undo()
    n = 2**31 + 5
    big = [jax.ShapeDtypeStruct((n,), d) for d in (jnp.bfloat16, jnp.float32, jnp.float32, jnp.float32)]
    out = jax.eval_shape(lambda *a: adamw_kernel(*a, jnp.bfloat16, cfg), jax.ShapeDtypeStruct((16,), jnp.float32), *big)
    assert [o.shape for o in out] == [(n,)] * 4 and out[3].dtype == jnp.bfloat16
