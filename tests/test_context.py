"""Long context: the blocked attention equals XLA's, and a sequence split over cp trains the same model."""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zjax
from zjax.context import Blocks, attention, balanced_order, load_balance
from zjax.context._attention import _dense
from zjax.models import Decoder, DecoderConfig, lm_loss
from zjax.planner._compile import partitioned_hlo
from zjax.planner._hlo import collectives, count_collectives, spanned_axes

nn_rules = nn.logical_axis_rules

# -- the blocked attention against XLA's dense attention -------------------------------------------------


def qkv(seed=0, b=2, s=64, heads=4, kv_heads=2, d=16):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.normal(size=(b, s, heads, d)), jnp.float32)
    k = jnp.asarray(r.normal(size=(b, s, kv_heads, d)), jnp.float32)
    v = jnp.asarray(r.normal(size=(b, s, kv_heads, d)), jnp.float32)
    return q, k, v


def packed_segments(b: int, s: int, seed: int = 0) -> np.ndarray:
    """Rows of consecutive segments of random lengths (a packer's output)."""
    r = np.random.default_rng(seed)
    rows = []
    for _ in range(b):
        cuts = np.sort(r.choice(np.arange(1, s), size=3, replace=False))
        rows.append(np.searchsorted(cuts, np.arange(s), side="right"))
    return np.stack(rows).astype(np.int32)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("packed", [False, True])
def test_blocked_attention_equals_xla_attention(packed, window):
    """Several query and key blocks (16 x 8 of 64), GQA, packed rows, a window: outputs and gradients of
    q, k and v equal XLA's dense attention (fp32)."""
    q, k, v = qkv()
    seg = jnp.asarray(packed_segments(2, 64)) if packed else None
    w = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * w)

    dense = loss(lambda q, k, v: _dense(q, k, v, seg, window, "xla"))
    blocked = loss(
        lambda q, k, v: attention(
            q, k, v, segment_ids=seg, window=window, implementation="blocked", blocks=Blocks(16, 8)
        )
    )
    want, want_grads = jax.value_and_grad(dense, argnums=(0, 1, 2))(q, k, v)
    got, got_grads = jax.value_and_grad(blocked, argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, h in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, h, atol=2e-5)


@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("mode", ["ring", "all-gather"])
def test_attention_over_cp4_equals_dense_attention(mode, balanced):
    """At cp=4 (where a ring that visits its chunks the wrong way round is no longer its own mirror, as at cp=2)
    the sequence split over cp gives dense attention's outputs and dq, dk, dv: packed rows, GQA, fp32, in the
    contiguous and the load-balanced layouts."""
    q, k, v = qkv(seed=3)
    seg = jnp.asarray(packed_segments(2, 64, seed=3))
    w = jnp.asarray(np.random.default_rng(4).normal(size=q.shape), jnp.float32)
    order = balanced_order(64, 4) if balanced else np.arange(64)

    def dense(q, k, v):
        out = _dense(q, k, v, seg, None, "xla")
        return jnp.sum(out * w), out

    def split(q, k, v):
        q, k, v, s, wt = (x[:, order] for x in (q, k, v, seg, w))
        out = attention(q, k, v, segment_ids=s, load_balanced=balanced, context_mode=mode)
        return jnp.sum(out * wt), out[:, np.argsort(order)]

    (_, want), want_grads = jax.jit(jax.value_and_grad(dense, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    with jax.set_mesh(zjax.make_mesh(dp=2, cp=4)):
        (_, got), got_grads = jax.jit(jax.value_and_grad(split, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    np.testing.assert_allclose(got, want, atol=1e-5)
    for name, g, h in zip("qkv", got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, h, atol=2e-5, err_msg=f"d{name}")


def test_the_pallas_flash_kernel_takes_packed_rows_and_equals_xla_attention():
    """JAX's Pallas flash attention (GPU packed rows), run in its interpreter: with GQA and packed segments its
    outputs and gradients equal XLA's dense attention, on one device and in its shard_map over a dp x tp mesh
    (batch over dp, heads over tp); lengths and windows it does not take are refused by name."""
    q, k, v = qkv(s=128)
    seg = jnp.asarray(packed_segments(2, 128))
    w = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * w)

    want, want_grads = jax.value_and_grad(loss(lambda q, k, v: _dense(q, k, v, seg, None, "xla")), (0, 1, 2))(q, k, v)
    flash = loss(lambda q, k, v: attention(q, k, v, segment_ids=seg, implementation="pallas"))
    mesh = zjax.make_mesh(dp=2, tp=2, devices=jax.devices()[:4])
    rules = (("batch", "dp"), ("heads", "tp"), ("kv_heads", "tp"))
    for where in ("one device", "dp x tp"):
        if where == "one device":
            got, got_grads = jax.value_and_grad(flash, (0, 1, 2))(q, k, v)
        else:
            with jax.set_mesh(mesh), nn_rules(rules):
                got, got_grads = jax.jit(jax.value_and_grad(flash, (0, 1, 2)))(q, k, v)
        np.testing.assert_allclose(got, want, rtol=1e-5)
        for g, h in zip(got_grads, want_grads, strict=True):
            np.testing.assert_allclose(g, h, atol=2e-5)
    with pytest.raises(ValueError, match=r"multiple of 128.*length=64.*window=None"):
        attention(*qkv(s=64), segment_ids=seg[:, :64], implementation="pallas")
    with pytest.raises(ValueError, match=r"window=7"):
        attention(q, k, v, segment_ids=seg, window=7, implementation="pallas")


def test_gpus_take_the_flash_kernel_for_packed_rows_that_fit_it():
    from zjax.context import attention_implementation
    from zjax.sharding._mesh import _PLATFORM

    token = _PLATFORM.set("gpu")
    try:
        pick = lambda **kw: attention_implementation(jnp.bfloat16, length=4096, **kw)  # noqa: E731
        assert pick() == "cudnn" and pick(packed=True) == "pallas"
        assert pick(packed=True, window=4096) == "blocked" and pick(packed=True, head_dim=256) == "blocked"
        assert attention_implementation(jnp.float32, packed=True, length=4096) == "blocked"
    finally:
        _PLATFORM.reset(token)


def test_blocked_attention_never_builds_the_score_matrix():
    """Under a scan over two layers (where JAX's partial evaluation of a scanned forward would keep per-block
    residuals) the gradient's jaxpr holds no array of S x S elements or more; XLA's dense attention does."""
    s = 256
    q, k, v = qkv(b=1, s=s)

    def grad_jaxpr(attend):
        def loss(w, q):
            layer = lambda h, w_: (attend(h * w_, k * w_, v * w_), None)  # noqa: E731
            return jnp.sum(jax.lax.scan(layer, q, w)[0])

        return jax.make_jaxpr(jax.grad(loss))(jnp.ones(2), q).jaxpr

    def largest(jaxpr):
        return max(math.prod(v.aval.shape) for eqn in _eqns(jaxpr) for v in eqn.outvars if hasattr(v.aval, "shape"))

    blocked = lambda q, k, v: attention(q, k, v, implementation="blocked", blocks=Blocks(32, 32))  # noqa: E731
    assert largest(grad_jaxpr(blocked)) < s * s
    assert largest(grad_jaxpr(lambda q, k, v: _dense(q, k, v, None, None, "xla"))) >= s * s


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


def test_the_balanced_layout_gives_each_rank_a_chunk_and_its_mirror():
    order = balanced_order(16, 4)  # 8 chunks of 2
    assert order.tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    x = jnp.arange(16)[None]
    np.testing.assert_array_equal(load_balance(x, cp=4), order[None])
    # causal work per rank: the number of (query, key) pairs it scores is the same for every rank
    work = [int(np.sum(order.reshape(4, 4)[r][:, None] + 1)) for r in range(4)]
    assert len(set(work)) == 1, work


def test_a_length_that_cp_cannot_split_names_the_lengths_that_work():
    with pytest.raises(ValueError, match=r"sequence length 30 cannot be split over cp=4 .*multiple of 8. Use 24 or 32"):
        balanced_order(30, 4)


# -- the decoder with its sequence split over cp ----------------------------------------------------------

CFG = DecoderConfig(vocab=64, embed=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=64, max_len=32)
SEQ, ROWS = 32, 8


def batches(packed: bool, steps: int = 2):
    r = np.random.default_rng(7)
    out = []
    for i in range(steps):
        tokens = r.integers(0, CFG.vocab, (ROWS, SEQ + 1)).astype(np.int32)
        if not packed:
            out.append(tokens)
            continue
        seg = packed_segments(ROWS, SEQ + 1, seed=i)
        starts = np.concatenate([np.ones((ROWS, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
        idx = np.arange(SEQ + 1)[None].repeat(ROWS, 0)
        first = np.maximum.accumulate(np.where(starts, idx, 0), axis=1)
        out.append({"tokens": tokens, "segment_ids": seg, "positions": (idx - first).astype(np.int32)})
    return out


def train(mesh_kw, *, stage=0, cfg=CFG, packed=False, steps=2, rules=None, accum=1, **plan_kw):
    model = Decoder(cfg)
    plan = zjax.Plan(zjax.make_mesh(**mesh_kw), stage=stage, precision="fp32", rules=rules, **plan_kw)
    state = plan.init(
        lambda r: model.init(r, jnp.zeros((1, SEQ), jnp.int32))["params"],
        optax.sgd(0.1, momentum=0.9),
        jax.random.key(0),
    )
    step = plan.train_step(lambda p, b: lm_loss(model, p, b), accum_steps=accum)
    losses = []
    for batch in batches(packed, steps):
        state, metrics = step(state, plan.shard_batch(batch))
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(state.params)


def check_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5)


REFERENCE: dict = {}


def reference(cfg=CFG, packed=False):
    key = (cfg, packed)
    if key not in REFERENCE:
        REFERENCE[key] = train({"dp": 8}, cfg=cfg, packed=packed)
    return REFERENCE[key]


@pytest.mark.parametrize(
    ("mesh_kw", "stage", "mode", "packed", "window"),
    [
        # the one-objective matrix (tests/test_objective.py) holds dp=2 x cp=4 at stage 3 in both modes with packed
        # rows against one device; these add two steps, a window and tp in the slow step
        pytest.param({"dp": 4, "cp": 2}, 3, "ring", False, 5, marks=pytest.mark.slow),
        pytest.param({"dp": 2, "cp": 2, "tp": 2}, 3, "all-gather", True, 5, marks=pytest.mark.slow),
    ],
)
def test_context_parallel_trains_the_same_model(mesh_kw, stage, mode, packed, window):
    """fp32, two SGD+momentum steps, GQA: losses and parameters with the sequence split over cp (load-balanced
    causal layout, all-gather or ring attention, packed rows, a sliding window, tp, ZeRO-3 over dp x cp)
    equal the dp=8 run's."""
    cfg = dataclasses.replace(CFG, context_mode=mode, sliding_window=window)
    check_same(
        train(mesh_kw, stage=stage, cfg=cfg, packed=packed),
        reference(dataclasses.replace(CFG, sliding_window=window), packed),
    )


@pytest.mark.slow
def test_context_parallel_composes_with_deferred_reduction_and_offload():
    """Stage 1 with 2 microbatches (each data rank accumulates unreduced, in a shard_map over the data axes
    with cp's attention nested inside) trains dp=4 x tp=2's model; stage 3 with the optimizer offloaded
    trains dp=8's."""
    want = train({"dp": 4, "tp": 2}, accum=2)  # rows: 8 = dp x accum
    check_same(train({"dp": 4, "cp": 2}, stage=1, accum=2), want)
    check_same(train({"dp": 2, "cp": 4}, stage=3, offload="optimizer"), reference())


CFG4 = dataclasses.replace(CFG, layers=4)


@pytest.mark.parametrize(
    ("schedule", "mode", "stage", "repeats"),
    [
        # fast: cp in GPipe, 1F1B without cp; the circular schedule with the ring, zero-bubble with the ring and
        # 1F1B with the all-gather compute the one-device objective in tests/test_pipeline_objective.py
        pytest.param("interleaved-1f1b", "all-gather", 3, 2, marks=pytest.mark.slow),
    ],
)
def test_context_parallel_runs_inside_a_pipeline(schedule, mode, stage, repeats):
    """dp=2 x pp=2 x cp=2: each stage's layers see their sequence split over cp (load-balanced positions made
    inside the stage), every schedule; losses and parameters equal the dp=8 run's."""
    cfg = dataclasses.replace(CFG4, context_mode=mode)
    pipe = zjax.Pipeline(microbatches=4, schedule=schedule, repeats=repeats)
    check_same(train({"dp": 2, "pp": 2, "cp": 2}, stage=stage, cfg=cfg, pipeline=pipe), reference(CFG4))


def test_a_pipeline_splits_its_sequences_over_cp():
    """pp=2 x cp=4 against pp=2 x dp=4 with the same rows per microbatch per device: the stages' activations
    are a quarter as long (temporaries at most half), and K/V cross cp inside the pipeline."""
    seq = 256
    cfg = dataclasses.replace(CFG4, max_len=seq)

    def compiled(mesh_kw, rows):
        model = Decoder(cfg)
        plan = zjax.Plan(zjax.make_mesh(**mesh_kw), stage=0, precision="fp32", pipeline=zjax.Pipeline(microbatches=2))
        init = lambda r: model.init(r, jnp.zeros((1, seq), jnp.int32))["params"]  # noqa: E731
        state = plan.abstract_state(init, optax.sgd(0.1), jax.random.key(0))
        batch = jax.ShapeDtypeStruct((rows, seq + 1), jnp.int32)
        step = plan.train_step(lambda p, b: lm_loss(model, p, b))
        return step.lower(state, batch).compile(), dict(state.layout.mesh.shape)

    split, mesh = compiled({"pp": 2, "cp": 4}, 4)
    whole, _ = compiled({"pp": 2, "dp": 4}, 16)
    assert split.memory_analysis().temp_size_in_bytes < whole.memory_analysis().temp_size_in_bytes / 2
    assert count_collectives(split.as_text(), mesh).by_axes.get(("cp",), 0) > 0


@pytest.mark.slow  # planner compiles; the fast planner tests cover the budget search
def test_the_budget_search_takes_cp_out_of_dp_when_the_sequences_are_fewer_than_the_devices():
    """Two 1,024-token rows on 8 devices: at fixed global batch cp does not cut the tokens per device, it lets
    fewer rows than devices run. The search skips cp=1 and 2 (2 rows do not split over 8 or 4 data ranks) and
    cp=3 (does not divide dp x cp), each with its reason, and plans cp=4 (dp=2) at stage 0."""
    from zjax.planner._fit import _cp_reason, with_cp

    assert with_cp({"dp": 8}, 4) == {"dp": 2, "cp": 4} and with_cp({"dp": 2, "cp": 4}, 0) == {"dp": 2, "cp": 4}
    assert _cp_reason(4, {"dp": 8}, 1004) == (
        "cp=4 does not split the 1004-token sequence into 2 x cp = 8 load-balanced chunks"
    )
    cfg = dataclasses.replace(CFG, max_len=1024)
    found = zjax.planner.fit(
        float("inf"), cfg, mesh={"dp": 8}, stages=(0,), remats=("full",), accums=(1,), batch_size=2,
        seq_len=1024, offloads=("none",), cps=(1, 2, 3, 4, 8),
    )  # fmt: skip
    assert found.row is not None and found.row.mesh == {**found.row.mesh, "dp": 2, "cp": 4}
    assert [e.rows[0].mesh["cp"] for e in found.tried] == [4]
    why = {c.cp: reason for c, reason in found.skipped}
    assert "global batch 2 does not split" in why[1] and "global batch 2 does not split" in why[2]
    assert why[3] == "cp=3 does not divide the 8 ranks of dp x cp"


def compiled_text(mesh_kw, mode="all-gather", stage=3, rules=None, partitioned=False):
    cfg = dataclasses.replace(CFG, context_mode=mode)
    model = Decoder(cfg)
    plan = zjax.Plan(zjax.make_mesh(**mesh_kw), stage=stage, precision="fp32", rules=rules)
    init = lambda r: model.init(r, jnp.zeros((1, SEQ), jnp.int32))["params"]  # noqa: E731
    state = plan.abstract_state(init, optax.adam(1e-3), jax.random.key(0))
    batch = jax.ShapeDtypeStruct((ROWS, SEQ + 1), jnp.int32)
    lowered = plan.train_step(lambda p, b: lm_loss(model, p, b)).lower(state, batch)
    return state, (lowered.compile() if not partitioned else partitioned_hlo(lowered)[1])


def test_zero_shards_state_over_dp_and_cp_and_cp_moves_keys_and_values():
    """At stage 3 on dp=2 x cp=4 every weight is cut into 8 shards (ZeRO's N = dp x cp); the ring moves
    K/V by collective-permutes, the all-gather mode by all-gathers over cp."""
    state, compiled = compiled_text({"dp": 2, "cp": 4})
    specs = jax.tree.leaves(state.layout.param_specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    assert specs and all(("dp", "cp") in tuple(s) for s in specs), specs
    ring = collectives(compiled_text({"dp": 2, "cp": 4}, "ring")[1].as_text())
    gathered = collectives(compiled.as_text())
    assert any(c.kind == "collective-permute" for c in ring)
    assert not any(c.kind == "collective-permute" for c in gathered)
    by_axes = count_collectives(compiled.as_text(), dict(state.layout.mesh.shape)).by_axes
    assert by_axes.get(("cp",), 0) > 0, by_axes  # K/V gathers, dK/dV reduce-scatters


def tp_collectives(rules):
    state, text = compiled_text({"dp": 4, "tp": 2}, stage=0, rules=rules, partitioned=True)
    found = collectives(text)  # as GSPMD partitioned the step (XLA:CPU later lowers a reduce-scatter to an all-reduce)
    mesh = dict(state.layout.mesh.shape)
    return [c for c in found if spanned_axes(c.groups, mesh) == ("tp",)]


@pytest.mark.slow  # sequence parallelism is the default: the fast dp x tp tests train with it
def test_sequence_parallelism_changes_no_number():
    """tp=2: the model trains the same (fp32, 1e-5) with sequence parallelism and without."""
    off = zjax.Rules(sequence_parallel=False)
    check_same(train({"dp": 4, "tp": 2}), train({"dp": 4, "tp": 2}, rules=off))


def test_sequence_parallelism_turns_tp_all_reduces_into_reduce_scatters():
    """tp=2: with sequence parallelism (the default) the residual stream is split over tp, so each
    tensor-parallel region ends in a reduce-scatter over tp, not an all-reduce."""
    off = zjax.Rules(sequence_parallel=False)
    with_sp, without = tp_collectives(None), tp_collectives(off)
    act = ROWS // 4 * SEQ * CFG.embed * 4  # one data shard's residual stream in fp32
    layer = lambda cs, kind: [c for c in cs if c.in_loop and c.kind == kind and c.bytes >= act // 2]  # noqa: E731
    assert layer(without, "all-reduce") and not layer(without, "reduce-scatter")
    # regions start with all-gathers and end with reduce-scatters (forward and backward): no all-reduce in the layers
    assert layer(with_sp, "reduce-scatter") and not layer(with_sp, "all-reduce")
    assert layer(with_sp, "all-gather")
    volume = lambda cs: sum(c.volume * c.trips for c in cs)  # noqa: E731
    assert volume(with_sp) <= volume(without)


# -- nested checkpointing ------------------------------------------------------------------------------------


def nested_step(remat: str, layers: int = 16, rows: int = 64, seq: int = 128):
    cfg = dataclasses.replace(CFG, layers=layers, remat=remat, embed=64, mlp=64, max_len=seq)
    model = Decoder(cfg)
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=0, precision="fp32")
    init = lambda r: model.init(r, jnp.zeros((1, seq), jnp.int32))["params"]  # noqa: E731
    state = plan.init(init, optax.sgd(0.1), jax.random.key(0))
    step = plan.train_step(lambda p, b: lm_loss(model, p, b))
    tokens = np.random.default_rng(3).integers(0, CFG.vocab, (rows, seq + 1)).astype(np.int32)
    batch = plan.shard_batch(tokens)
    compiled = step.lower(state, batch).compile()
    new, metrics = step(state, batch)
    return float(metrics["loss"]), jax.device_get(new.params), compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow  # two 16-layer compiles; test_remat trains the Decoder with nested remat at stage 3
def test_nested_checkpointing_trains_the_same_model_and_keeps_fewer_layer_inputs():
    """16 layers in groups of 4: the same loss and update as per-layer full remat (fp32), and compiled
    temporaries smaller by at least half of the 8 layer inputs it does not keep (4 + 4 saved instead of 16)."""
    full, nested = nested_step("full"), nested_step("nested")
    check_same(([nested[0]], nested[1]), ([full[0]], full[1]))
    layer_input = 64 // 8 * 128 * 64 * 4  # rows per device x seq x embed, fp32
    assert full[2] - nested[2] >= 8 * layer_input // 2, (nested[2], full[2])


def test_a_nested_group_that_does_not_divide_the_layers_names_the_divisors():
    policy = zjax.remat.RematPolicy("nested3", "nested", group=3)
    with pytest.raises(ValueError, match=r"group=3 does not divide the 16 layers; use one of \[1, 2, 4, 8, 16\]"):
        policy.group_size(16)
    assert zjax.remat.POLICIES["nested"].group_size(16) == 4 and zjax.remat.POLICIES["nested"].group_size(12) == 3
