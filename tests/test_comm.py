"""Quantized weight gathers (qwZ): int8 blocks on the wire, straight-through gradients, the step's bytes."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zjax
from zjax import comm
from zjax.comm import _gather as comm_gather
from zjax.comm import _reduce as comm_reduce
from zjax.models import Decoder, DecoderConfig, lm_loss
from zjax.planner._compile import partitioned_hlo
from zjax.planner._hlo import collectives
from zjax.sharding._annotations import Leaf
from zjax.sharding._rules import spec_axes
from zjax.stages._layout import Placement


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [4, 64, 256])
def test_a_block_round_trips_within_half_a_step(block, bits):
    rs = np.random.RandomState(block)
    x = jnp.asarray(rs.randn(6, 512) * rs.lognormal(size=(6, 1)), jnp.float32)
    q, scale = comm.quantize(x, block, bits)
    # int8 values, or two int4 values per byte
    assert (q.dtype, q.shape) == ((jnp.int8, (6, 512)) if bits == 8 else (jnp.uint8, (6, 256)))
    assert scale.shape == (6, 512 // block)
    back = comm.dequantize(q, scale, jnp.float32)
    top = 2 ** (bits - 1) - 1  # 127 or 7 steps each side of zero
    amax = np.abs(np.asarray(x).reshape(6, -1, block)).max(-1)
    err = np.abs(np.asarray(back - x)).reshape(6, -1, block).max(-1)
    assert np.all(err <= amax / (2 * top) * (1 + 1e-6))  # half of one step, amax / top
    assert np.all(err.max(-1) > amax.max(-1) / (2 * top) / 4)  # and not finer: it did quantize at that width
    on_grid = comm.dequantize(q, scale, jnp.float32)  # values on the grid come back (up to the scale's rounding)
    again = comm.dequantize(*comm.quantize(on_grid, block, bits), jnp.float32)
    np.testing.assert_allclose(again, on_grid, rtol=1e-6)
    # a block that does not divide the dim takes the whole dim; zeros stay zeros
    q, scale = comm.quantize(jnp.zeros((3, 10)), 4, bits)
    assert scale.shape == (3, 1) and not np.any(np.asarray(q))
    # an odd block cannot pack pairs: it stays int8
    q, scale = comm.quantize(x[:, :7], block, bits)
    assert q.dtype == jnp.int8 and scale.shape == (6, 1)


def test_int4_values_pack_two_to_a_byte_half_a_block_apart():
    x = jnp.asarray([[7.0, -7.0, 3.0, -1.0, 0.0, 7.0, -4.0, 2.0] * 2]) * jnp.asarray([1.0] * 8 + [2.0] * 8)
    q, scale = comm.quantize(x, 8, 4)
    assert np.asarray(scale).tolist() == [[1.0, 2.0]]
    # two's complement nibbles, value j low and value j + 4 high: (7, 0) -> 0x07, (-7, 7) -> 0x79,
    # (3, -4) -> 0xC3, (-1, 2) -> 0x2F; the second block the same at twice the scale
    assert np.asarray(q).tolist() == [[0x07, 0x79, 0xC3, 0x2F] * 2]
    np.testing.assert_array_equal(comm.dequantize(q, scale, jnp.float32), x)


@pytest.mark.parametrize(("where", "block"), [("shard_map", 4), ("pipeline_stage", 4), ("pipeline_stage", 16)])
def test_gathered_is_int8_per_shard_and_its_gradient_goes_straight_through(where, block):
    """On dp=8, a weight split over dp on dim 1: the gathered value is each shard quantized on its own and put
    together, and the gradient of sum(gathered * c) is c, reduce-scattered once (not 8c). Inside a pipeline stage
    (zero3_gather="layer": sharding constraints instead of a shard_map) the blocks are the same, also where one is
    wider than a rank's 8 columns (then each rank's tile is one block, none spanning two ranks)."""
    mesh = zjax.make_mesh(dp=8)
    rs = np.random.RandomState(0)
    w = rs.randn(16, 64).astype(np.float32)
    c = rs.randn(16, 64).astype(np.float32)
    placement = Placement(Leaf("w", (16, 64), jnp.float32, None), P(), P(None, "dp"), None)

    def f(w, c):
        with comm.use([placement], comm.Wire(block=block)):
            if where == "shard_map":
                return jnp.sum(comm.gathered(w, ("w",)) * c)
            with comm_gather.stage_reads():
                return jnp.sum(comm.gathered(w, ("w",)) * c)

    shards = [comm.dequantize(*comm.quantize(jnp.asarray(s), block), jnp.float32) for s in np.split(w, 8, axis=1)]
    expected = float(np.sum(np.concatenate([np.asarray(s) for s in shards], axis=1) * c))
    with jax.set_mesh(mesh):
        ws = jax.device_put(w, NamedSharding(mesh, P(None, "dp")))
        value, grad = jax.jit(jax.value_and_grad(f))(ws, c)
        lowered = jax.jit(jax.value_and_grad(f)).lower(ws, c)
    np.testing.assert_allclose(float(value), expected, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), c, rtol=1e-6)
    _, hlo = partitioned_hlo(lowered)
    gathers = [c for c in collectives(hlo) if c.kind == "all-gather"]
    # the int8 values (a byte each) and their scales (fp32 per block of a rank's columns), nothing else
    assert sorted((c.dtype, c.volume) for c in gathers) == [("f32", 16 * 64 // min(block, 8) * 4), ("s8", 16 * 64)]


CFG = DecoderConfig(vocab=256, embed=128, layers=2, heads=4, head_dim=32, mlp=512, max_len=32)


def test_quantized_comm_needs_stage_3_and_refuses_what_it_cannot_quantize():
    with pytest.raises(ValueError, match=r"quantized_comm='weights' quantizes ZeRO-3's weight gathers.*stage 1"):
        zjax.Plan(zjax.make_mesh(dp=8), stage=1, quantized_comm="weights")
    for bad in ("int8", "weights:int2", "grads+grads", "weights+"):
        with pytest.raises(ValueError, match=rf"quantized_comm={re.escape(repr(bad))}: .* 'weights\+grads:int4'"):
            zjax.Plan(zjax.make_mesh(dp=8), stage=3, quantized_comm=bad)
    with pytest.raises(ValueError, match=r"'weights\+grads' under pipeline schedule='gpipe', .* reduce in the compute"):
        zjax.Plan(zjax.make_mesh(dp=2, pp=4), stage=3, quantized_comm="weights+grads", pipeline=zjax.Pipeline(4))
    with pytest.raises(ValueError, match=r"quantized_comm='grads' at stage 3 .* offload='optimizer' keeps them"):
        zjax.Plan(zjax.make_mesh(dp=8), stage=3, quantized_comm="grads", offload="optimizer")
    with pytest.raises(ValueError, match=r"reduce_dtype='float32' at stage 3 is not supported with cp=2 yet"):
        zjax.Plan(zjax.make_mesh(dp=4, cp=2), stage=3, reduce_dtype="float32")
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=3, quantized_comm="weights")
    assert plan.quantizes_weights and not plan.quantizes_grads and not plan.reduces_gradients
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=3, quantized_comm="weights+grads")
    assert plan.quantizes_weights and plan.quantizes_grads and plan.reduces_gradients
    assert (plan.weights_wire, plan.grads_wire) == (comm.Wire(8), comm.Wire(8))
    # ZeRO++'s pair: int8 weights, int4 gradients; a part's width applies to that part alone
    assert comm.parse("weights+grads:int4") == (comm.Wire(8), comm.Wire(4))
    assert comm.parse("grads:int4+weights:int4") == (comm.Wire(4), comm.Wire(4))
    assert comm.parse("weights:int8") == (comm.Wire(8), None) and comm.parse(None) == (None, None)
    # a part's block: one scale per B values ("@B"), the width's default otherwise
    assert comm.parse("weights:int4@64+grads") == (comm.Wire(4, 64), comm.Wire(8, comm.DEFAULT_BLOCK))
    assert comm.parse("grads@32") == (None, comm.Wire(8, 32)) and comm.Wire(4, 64).name == "int4@64"
    for bad, why in (("weights@", "at least 2"), ("weights@1", "at least 2"), ("grads:int4@31+weights", "even")):
        with pytest.raises(ValueError, match=rf"quantized_comm={re.escape(repr(bad))}: the block of .* {why}"):
            comm.parse(bad)


# -- gradients reduced by zjax: in fp32, or as int8 through all-to-alls (qgZ) -----------------------------------------


def _reduce_on(mesh, parts, split, dim, whole, how, hlo=None):
    """``comm.reduce`` of per-rank parts ``[ranks, ...]`` (rank order: the mesh's data axes); its collectives
    appended to ``hlo`` when given."""
    axes = (*whole, *split) if whole else split  # replica outermost
    manual = set(split) | set(whole)

    def local(x):
        return comm.reduce(x[0], split, dim, whole, how)[None]

    with jax.set_mesh(mesh):  # out: each rank's shard, stacked in rank order
        fn = jax.shard_map(local, mesh=mesh, in_specs=P(axes), out_specs=P(axes), axis_names=manual, check_vma=False)
        fn = jax.jit(fn)
        if hlo is not None:
            hlo.extend(collectives(partitioned_hlo(fn.lower(jnp.asarray(parts)))[1]))
        return np.asarray(fn(jnp.asarray(parts)))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("hsdp", [False, True])
def test_a_quantized_reduction_is_within_each_ranks_half_step(hsdp, bits):
    """Every rank quantizes its own chunks once (error <= its block's amax / 254 as int8, / 14 as int4), the sums
    are fp32: the reduced shard is within the sum of the ranks' half steps of the exact sum; over replica (HSDP)
    the shards' sums are quantized twice more (the inter-node all-to-all and the gather back), each within its
    half step."""
    mesh = zjax.make_mesh(dp=(2, 4)) if hsdp else zjax.make_mesh(dp=8)
    split, whole = ("dp",), (("replica",) if hsdp else ())
    rs = np.random.RandomState(1)
    block = 16
    parts = (rs.randn(8, 32, 64) * rs.lognormal(size=(8, 1, 64))).astype(np.float32)  # [rank, rows, cols]
    hlo: list = []
    out = _reduce_on(mesh, parts, split, 0, whole, comm.Reduction(wire=comm.Wire(bits, block)), hlo)
    # on the wire: one byte per value (int8) or per two (int4), and an fp32 scale per block; an all-to-all carries
    # both in one byte buffer, a gather of the sums (HSDP) the integers (int4 in uint8) beside their scales
    exchanged = [c for c in hlo if c.kind == "all-to-all"]
    assert {c.dtype for c in exchanged} == {"s8"}, [(c.kind, c.dtype) for c in hlo]
    assert exchanged[0].bytes == 32 * 64 * bits // 8 + 32 * 64 // block * 4  # each rank's [32, 64] part, once
    gathered = {c.dtype for c in hlo if c.kind == "all-gather" and c.dtype != "f32"}
    assert gathered == ({"s8" if bits == 8 else "u8"} if hsdp else set()), gathered
    step = 2 * (2 ** (bits - 1) - 1)  # a half step is amax / 254 (int8) or amax / 14 (int4)
    exact = parts.sum(0)
    n_dp = 4 if hsdp else 8
    # the reduced array, reassembled: rank (r, j) holds rows j of replica group r; all replicas agree
    got = out.reshape(2, n_dp, 32 // n_dp, 64)[0].reshape(32, 64) if hsdp else out.reshape(32, 64)
    # each rank's chunk j is the [32/n_dp, 64] rows of dp rank j, quantized flat in blocks of 16
    chunks = parts.reshape(8, n_dp, -1, block)  # [rank, dest, blocks, block]
    half = np.abs(chunks).max(-1) / step  # [rank, dest, blocks]
    bound = half.sum(0).reshape(n_dp, 32 // n_dp, 64 // block, 1)
    bound = np.broadcast_to(bound, (n_dp, 32 // n_dp, 64 // block, block)).reshape(32, 64)
    if hsdp:  # the dp sums' own quantization, twice, each within its half step (bounded by the sums' amax)
        dp_sums = parts.reshape(2, 4, 32, 64).sum(1)
        bound = bound + 2 * np.abs(dp_sums).max() / step * 2 + np.abs(exact).max() / step
    err = np.abs(got - exact)
    assert np.all(err <= bound * (1 + 1e-5) + 1e-6), float((err / bound).max())
    assert err.max() > 0  # it did quantize
    # unquantized in fp32: the plain sum (up to fp32 rounding)
    plain = _reduce_on(mesh, parts.astype(jnp.bfloat16), split, 0, whole, comm.Reduction(dtype=jnp.float32))
    assert plain.dtype == np.float32
    want = parts.astype(jnp.bfloat16).astype(np.float32).sum(0)
    plain = plain.reshape(2, n_dp, 32 // n_dp, 64)[0].reshape(32, 64) if hsdp else plain.reshape(32, 64)
    np.testing.assert_allclose(plain, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_reduction_sums_the_dequantized_chunks_in_fp32(bits):
    """The receiving rank's sum of the dequantized chunks is exact to fp32 (about 1e-7 of the summands' size), not
    a 16-bit sum (about 4e-3), which the half-step bound above cannot tell apart."""
    mesh = zjax.make_mesh(dp=8)
    rs = np.random.RandomState(2)
    block = 16
    parts = (rs.randn(8, 32, 64) * rs.lognormal(size=(8, 1, 64))).astype(np.float32)
    got = _reduce_on(mesh, parts, ("dp",), 0, (), comm.Reduction(wire=comm.Wire(bits, block))).reshape(32, 64)
    # every rank's chunk j (rows 4j..4j+3, flat) quantized in blocks of 16 and dequantized, as it crossed
    wire = comm.Wire(bits, block)
    blocks = [comm_reduce.quantize(jnp.asarray(p.reshape(8, -1)), wire.block, wire.bits) for p in parts]
    sent = np.stack([np.asarray(comm_reduce.dequantize(q, scale, jnp.float32)) for q, scale in blocks])
    want = sent.astype(np.float64).sum(0).reshape(32, 64)
    size = np.abs(sent.astype(np.float64)).sum(0).reshape(32, 64)
    assert np.all(np.abs(got - want) <= 1e-6 * size + 1e-30), float((np.abs(got - want) / size).max())


def test_a_quantized_reduction_keeps_a_non_finite_gradient_non_finite():
    """Loss scaling skips a step on a non-finite gradient: the int8 blocks must not turn inf or nan finite."""
    mesh = zjax.make_mesh(dp=8)
    parts = np.ones((8, 16, 32), np.float32)
    for bad in (np.inf, np.nan):
        p = parts.copy()
        p[3, 5, 7] = bad
        out = _reduce_on(mesh, p, ("dp",), 0, (), comm.Reduction(wire=comm.Wire(block=8)))
        assert not np.all(np.isfinite(out))


# the fast suite's one-objective matrix runs the Decoder through layer_scan under qgZ (tests/test_objective.py,
# bf16-qgz) against one device's gradient: a layer reduced into the wrong place fails it (relative error ~1)
@pytest.mark.slow
def test_layer_scan_reduces_each_layer_during_the_next_ones_backward_with_the_same_result(monkeypatch):
    """Under quantized gradients the Decoder's layers run in zjax.comm.layer_scan (full remat): each layer's gradient
    is carried into the next backward iteration and exchanged there, the layer's weights in one all-to-all. Against
    nn.scan's per-layer reductions (remat="none" keeps the Decoder on nn.scan), one SGD step (lr 1: the update is
    the reduced gradient) moves every layer's weights the same, up to a few bf16 roundings of the compute (2^-8
    each; the two programs fuse differently): a gradient reduced into the wrong layer is off by its whole size."""
    import zjax.comm._scan as scan

    calls = []
    overlapped = scan._overlapped
    monkeypatch.setattr(scan, "_overlapped", lambda *a: calls.append(1) or overlapped(*a))
    tokens = np.random.RandomState(0).randint(0, CFG.vocab, (8, 33)).astype(np.int32)
    runs = {}
    for remat in ("full", "none"):
        model = Decoder(dataclasses.replace(CFG, layers=4, remat=remat))
        plan = zjax.Plan(zjax.make_mesh(dp=8), stage=3, precision="bf16", quantized_comm="grads")
        init = lambda r, m=model: m.init(r, jnp.zeros((1, 32), jnp.int32))["params"]  # noqa: E731
        state = plan.init(init, optax.sgd(1.0), jax.random.key(0))
        before = jax.device_get(state.opt_state.master)
        state, metrics = plan.train_step(lambda p, b, m=model: lm_loss(m, p, b))(state, plan.shard_batch(tokens))
        moved = jax.tree.map(lambda a, b: np.asarray(b) - np.asarray(a), before, jax.device_get(state.opt_state.master))
        runs[remat] = float(metrics["loss"]), moved
    assert len(calls) == 1  # the full-remat step traced its layers through layer_scan, once
    assert runs["full"][0] == pytest.approx(runs["none"][0], rel=1e-6)
    layers = jax.tree_util.tree_leaves_with_path(runs["full"][1]["layers"])
    for (path, a), b in zip(layers, jax.tree.leaves(runs["none"][1]["layers"]), strict=True):
        for i in range(4):
            off = np.abs(a[i] - b[i]).max() / np.abs(b[i]).max()
            assert off < 4 * 2.0**-8, (jax.tree_util.keystr(path), i, off)


def _run(mesh_axes, stage, steps=3, cfg=CFG, accum=2, **plan_kw):
    model = Decoder(cfg)
    plan = zjax.Plan(zjax.make_mesh(**mesh_axes), stage=stage, precision="bf16", **plan_kw)
    state = plan.init(
        lambda r: model.init(r, jnp.zeros((1, 32), jnp.int32))["params"], optax.adamw(1e-3), jax.random.key(0)
    )
    step = plan.train_step(lambda p, b: lm_loss(model, p, b), accum_steps=accum)
    batch = plan.shard_batch(np.random.RandomState(0).randint(0, cfg.vocab, (16, 33)).astype(np.int32))
    compiled, hlo = partitioned_hlo(step.lower(state, batch))  # the program the steps below run, compiled once
    sizes = dict(plan.mesh.shape)
    # parameters per tp rank: what each data-parallel group reduces
    placements = state.layout.params.placements
    local = sum(np.prod(p.leaf.shape) / np.prod([sizes[a] for a in spec_axes(p.compute)]) for p in placements)
    losses = []
    for _ in range(steps):
        state, metrics = compiled(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(state.opt_state.master), hlo, local


def _reduced(hlo: str, ranks: int = 8) -> dict[tuple[str, str], int]:
    """Bytes per (dtype, kind) of the collectives over groups of ``ranks`` devices (the data axes; with tp the
    activations' collectives run over tp groups)."""
    out: dict[tuple[str, str], int] = {}
    for c in collectives(hlo):
        if max((len(g) for g in c.groups), default=1) == ranks:
            out[(c.dtype, c.kind)] = out.get((c.dtype, c.kind), 0) + c.volume * c.trips
    return out


# the fast suite checks the same equality on a plain flax model and the f32 HLO on the GPU target; a tied table
# is reduced once at stage 3 in test_tied_embedding.py
@pytest.mark.slow
@pytest.mark.parametrize("mesh_axes,tied", [({"dp": 4, "tp": 2}, False)])
def test_stage_3_reduces_in_fp32_as_stage_2_does(mesh_axes, tied):
    """reduce_dtype=float32 at stage 3: the per-layer reduce-scatters run in fp32 and train as stage 2's fp32
    reduction does (the same sums); with tp the gradients are not gathered over tp first, and a tied
    embedding's two uses reduce once."""
    cfg = dataclasses.replace(CFG, tie_embeddings=tied)
    s2 = _run(mesh_axes, 2, cfg=cfg, reduce_dtype="float32")
    s3 = _run(mesh_axes, 3, cfg=cfg, reduce_dtype="float32")
    plain = _run(mesh_axes, 3, cfg=cfg, steps=0)
    np.testing.assert_allclose(s3[0], s2[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(s3[1]), jax.tree.leaves(s2[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    ranks = mesh_axes["dp"]
    wide, narrow = _reduced(s3[2], ranks), _reduced(plain[2], ranks)
    assert ("bf16", "reduce-scatter") not in wide and ("f32", "reduce-scatter") in wide
    # every parameter's gradient reduced once per microbatch in fp32 (a tied embedding's two uses once): ZeRO's
    # psi, 4 bytes each
    assert wide[("f32", "reduce-scatter")] == 4 * s3[3] * 2
    assert narrow[("bf16", "reduce-scatter")] <= 2 * s3[3] * 2
    # no weight gradient all-gathered over tp in fp32 before its reduction (XLA does so for a collective over
    # the data axes on a tp-split operand unless the collective is manual over tp too)
    tp_f32 = _reduced(s3[2], mesh_axes.get("tp", 0)).get(("f32", "all-gather"), 0)
    assert tp_f32 <= _reduced(plain[2], mesh_axes.get("tp", 0)).get(("f32", "all-gather"), 0)


@pytest.mark.slow  # three compiled Decoder steps; the fast suite keeps the block bounds and the GPU HLO
def test_quantized_weights_and_gradients_cross_dp_as_int8_and_train_like_bf16():
    plain = _run({"dp": 8}, 3)
    weights = _run({"dp": 8}, 3, quantized_comm="weights")
    both = _run({"dp": 8}, 3, quantized_comm="weights+grads")
    # qwZ: every weight gather int8 with an fp32 scale per 256 values (about half of bf16's bytes), the gradients
    # reduced as before, in bf16; the weights within amax/254 per block move the loss far less than training does
    narrow, w = _reduced(plain[2]), _reduced(weights[2])
    assert ("s8", "all-gather") in w and ("bf16", "all-gather") not in w and ("s8", "all-gather") not in narrow
    gathered = w[("s8", "all-gather")] + w.get(("f32", "all-gather"), 0)
    assert gathered <= 0.55 * narrow[("bf16", "all-gather")]
    assert w[("bf16", "reduce-scatter")] == narrow[("bf16", "reduce-scatter")]
    np.testing.assert_allclose(weights[0], plain[0], rtol=2e-3)
    assert weights[0][-1] < weights[0][0]
    # qgZ
    q = _reduced(both[2])
    assert ("s8", "all-to-all") in q and ("bf16", "reduce-scatter") not in q
    # every parameter's gradient once per microbatch (2) as int8, with an fp32 scale per 256 values: against
    # bf16's 2 bytes (GSPMD's bf16 reduction no longer carries the embedding, looked up on its shard)
    moved = q[("s8", "all-to-all")] + q.get(("f32", "all-to-all"), 0)  # int8 values and their fp32 scales
    assert moved <= plain[3] * 2 * (1 + 4 / 256) * 1.01, (moved, plain[3])
    assert narrow[("bf16", "reduce-scatter")] <= plain[3] * 2 * 2
    assert ("s8", "all-gather") in q and ("bf16", "all-gather") not in q
    # each rank's part is within amax/254 per block: the step moves as bf16's does, within that noise
    np.testing.assert_allclose(both[0], plain[0], rtol=2e-3)
    assert both[0][-1] < both[0][0]
    # the fp32 master moved as bf16's did, up to the quantization noise (Adam's first steps move each weight
    # by about lr = 1e-3; noise flips the sign of only the smallest gradients)
    for a, b in zip(jax.tree.leaves(both[1]), jax.tree.leaves(plain[1]), strict=True):
        assert np.abs(a - b).max() <= 3 * 2e-3 + 1e-6


def test_a_model_that_does_not_read_through_gathered_is_gathered_before_its_loss():
    """A plain flax model under stage 3 with fp32 reduction: its parameters are gathered whole before the loss
    (found by tracing it once), and it trains as stage 2 with the same reduction does."""
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(nn.relu(nn.Dense(64)(x)))

    model = MLP()
    rs = np.random.RandomState(0)
    x, y = rs.randn(16, 32).astype(np.float32), rs.randn(16, 4).astype(np.float32)

    def loss_fn(p, b):
        return jnp.mean((model.apply({"params": p}, b[0]).astype(jnp.float32) - b[1]) ** 2)

    runs = []
    for stage in (2, 3):
        plan = zjax.Plan(zjax.make_mesh(dp=8), stage=stage, precision="bf16", reduce_dtype="float32")
        state = plan.init(lambda r: model.init(r, x[:1])["params"], optax.adamw(1e-2), jax.random.key(0))
        step = plan.train_step(loss_fn)
        batch = plan.shard_batch((x, y))
        losses = []
        for _ in range(3):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        runs.append(losses)
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-5)


def test_an_fp8_products_weight_crosses_a_gather_as_e4m3_under_the_tensors_one_scale():
    """zjax.comm.FLOAT8: each shard cast to e4m3 with the whole tensor's power-of-two scale (the shards' amaxes
    max-reduced), so what arrives is the tensor zjax.fp8.quantize casts whole, exactly, in half of bf16's bytes;
    the fp8 product's own cast of it then changes nothing."""
    mesh = zjax.make_mesh(dp=8)
    x = jax.random.normal(jax.random.key(0), (64, 48), jnp.bfloat16) * jnp.linspace(0.1, 30.0, 64)[:, None]
    gather = jax.jit(
        jax.shard_map(
            lambda s: comm._quantize.all_gather(s, "dp", 0, comm.FLOAT8),
            mesh=mesh, in_specs=P("dp"), out_specs=P(), check_vma=False,
        )
    )  # fmt: skip
    q, scale = zjax.fp8.quantize(x, jnp.float8_e4m3fn)
    whole = (q.astype(jnp.float32) * scale).astype(jnp.bfloat16)
    np.testing.assert_array_equal(gather(x), whole)
    assert re.search(r"f8e4m3fn\[64,48\]\S* all-gather\(", gather.lower(x).as_text("hlo"))
    again, rescale = zjax.fp8.quantize(whole, jnp.float8_e4m3fn)  # the product's cast of what arrived
    np.testing.assert_array_equal(again.astype(jnp.float32) * rescale, q.astype(jnp.float32) * scale)
