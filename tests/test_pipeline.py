"""Pipeline parallelism over pp: numerics against the sequential model, HLO structure, memory, bubble, errors."""

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
from zjax.models import Decoder, DecoderConfig, lm_loss
from zjax.pipeline import Pipeline, apply
from zjax.pipeline._context import accumulating
from zjax.planner._compile import partitioned_hlo
from zjax.planner._hlo import collectives, spanned_axes

D, L, B = 32, 8, 32
STAGES_ONLY = P("pp")  # weights split into stages, whole over dp
MESHES = {"dp2_pp4": {"dp": 2, "pp": 4}, "dp2_tp2_pp2": {"dp": 2, "tp": 2, "pp": 2}}


def schedules(stages: int) -> dict[str, Pipeline]:
    return {
        "gpipe": Pipeline(stages),
        "circular_m_eq_s": Pipeline(stages, repeats=2),
        "circular_m_2s": Pipeline(2 * stages, repeats=2),
    }


def layer(w, h):
    return h + jnp.tanh(h @ w["a"]) @ w["b"]


def stage_fn(ws, h):
    for j in range(ws["a"].shape[0]):
        h = layer(jax.tree.map(lambda x: x[j], ws), h)  # noqa: B023
    return h


def weights_and_input(dim: int = D, layers: int = L, rows: int = B):
    rs = np.random.RandomState(0)
    w = {
        "a": jnp.asarray(rs.randn(layers, dim, dim) / np.sqrt(dim), jnp.float32),
        # each layer adds O(1/sqrt(layers)) to the residual stream, which stays O(1) (max |h| 4.6 at 8 layers, not
        # 7.9): the pipelined and sequential programs sum in different orders, and fp32 then differs ~1e-6 at most
        "b": jnp.asarray(rs.randn(layers, dim, dim) / np.sqrt(dim * layers), jnp.float32),
    }
    return w, jnp.asarray(rs.randn(rows, dim), jnp.float32)


def sequential(w, x):
    h = x
    for i in range(jax.tree.leaves(w)[0].shape[0]):
        h = layer(jax.tree.map(lambda a: a[i], w), h)  # noqa: B023
    return jnp.mean(h**2), h


def pipelined(cfg: Pipeline, fill: float = 0.0):
    def f(w, x):
        h = apply(stage_fn, w, x, cfg, _bubble_fill=fill)
        return jnp.mean(h**2), h

    return f


def run_pipelined(mesh, cfg, w, x, fill=0.0, spec=STAGES_ONLY):
    with jax.set_mesh(mesh):
        w = jax.device_put(w, NamedSharding(mesh, spec))
        x = jax.device_put(x, NamedSharding(mesh, P("dp")))
        return jax.jit(jax.value_and_grad(pipelined(cfg, fill), has_aux=True))(w, x)


def check_engine(mesh_name, cfg, spec=STAGES_ONLY):
    mesh = zjax.make_mesh(**MESHES[mesh_name])
    w, x = weights_and_input()
    (want, want_h), want_g = jax.value_and_grad(sequential, has_aux=True)(w, x)
    (got, got_h), got_g = run_pipelined(mesh, cfg, w, x, spec=spec)
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(got_h, want_h, atol=1e-5)
    for g, r in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
        np.testing.assert_allclose(g, r, atol=1e-5)


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("schedule", ["gpipe", "circular_m_eq_s", "circular_m_2s"])
def test_loss_output_and_gradients_match_the_sequential_model(mesh_name, schedule):
    check_engine(mesh_name, schedules(MESHES[mesh_name]["pp"])[schedule])


@pytest.mark.parametrize(
    ("mesh_name", "schedule"),
    [("dp2_pp4", "circular_m_2s"), ("dp2_tp2_pp2", "gpipe"),
     *[pytest.param(m, s, marks=pytest.mark.slow)
       for m, s in [("dp2_pp4", "gpipe"), ("dp2_pp4", "circular_m_eq_s"), ("dp2_tp2_pp2", "circular_m_eq_s"),
                    ("dp2_tp2_pp2", "circular_m_2s")]]],
)  # fmt: skip
def test_per_use_gathering_matches_the_sequential_model(mesh_name, schedule):
    """zero3_gather="layer" with the weights split over dp (ZeRO-3): the same loss, output and gradients."""
    cfg = dataclasses.replace(schedules(MESHES[mesh_name]["pp"])[schedule], zero3_gather="layer")
    check_engine(mesh_name, cfg, spec=P("pp", "dp"))


def test_step_gathering_moves_each_weight_once_and_layer_gathering_per_iteration():
    """zero3_gather="step" gathers every weight over dp once and reduce-scatters its gradient once, outside the
    pipeline's loop; "layer" gathers inside the loop, per iteration."""
    mesh = zjax.make_mesh(**MESHES["dp2_pp4"])
    w, x = weights_and_input()
    stage_bytes = sum(a.nbytes for a in jax.tree.leaves(w)) // 4  # one stage's weights, whole (fp32)
    moved = {}
    for mode in ("step", "layer"):
        with jax.set_mesh(mesh):
            ws = jax.device_put(w, NamedSharding(mesh, P("pp", "dp")))
            xs = jax.device_put(x, NamedSharding(mesh, P("dp")))
            grad_fn = jax.value_and_grad(pipelined(Pipeline(8, repeats=2, zero3_gather=mode)), has_aux=True)
            lowered = jax.jit(grad_fn, out_shardings=(None, NamedSharding(mesh, P("pp", "dp")))).lower(ws, xs)
        _, hlo = partitioned_hlo(lowered)
        shape = dict(mesh.shape)
        moved[mode] = {}
        for c in collectives(hlo):
            if "dp" in spanned_axes(c.groups, shape) and c.kind != "all-reduce":  # (the loss's scalar mean)
                key = (c.kind, c.in_loop)
                moved[mode][key] = moved[mode].get(key, 0) + c.volume * c.trips
    assert moved["step"] == {("all-gather", False): stage_bytes, ("reduce-scatter", False): stage_bytes}
    assert moved["layer"].get(("all-gather", True), 0) > 8 * stage_bytes


def _bf16_and_int8_runs(cfg: Pipeline, steps: int) -> tuple[tuple[dict, list[float]], tuple[dict, list[float]]]:
    """The WIDE decoder at stage 3 on dp=2 x pp=4 under ``cfg``, without and with ``quantized_comm="weights"``: each
    run's bytes over dp by (kind, dtype) (all-reduces left out: the loss's scalars) and its losses over ``steps``."""
    runs = []
    for q in (None, "weights"):
        plan = zjax.Plan(zjax.make_mesh(**MESHES["dp2_pp4"]), stage=3, quantized_comm=q, pipeline=cfg)
        init_fn, loss_fn = decoder_task(WIDE)
        state = plan.init(init_fn, optax.adamw(1e-3), jax.random.key(0))
        compiled, hlo = partitioned_hlo(plan.train_step(loss_fn).lower(state, plan.shard_batch(tokens(0))))
        moved: dict = {}
        for c in collectives(hlo):
            if c.kind != "all-reduce" and spanned_axes(c.groups, dict(plan.mesh.shape)) == ("dp",):
                moved[c.kind, c.dtype] = moved.get((c.kind, c.dtype), 0) + c.volume * c.trips
        losses = []
        for i in range(steps):
            state, metrics = compiled(state, plan.shard_batch(tokens(i)))
            losses.append(float(metrics["loss"]))
        runs.append((moved, losses))
    return runs[0], runs[1]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_weights_gathered_once_per_step_are_read_as_int8_blocks(schedule):
    """The traced step (no compile) of qwZ with zero3_gather="step": one int8 all-gather over dp per parameter
    split over dp (the stages' weights read through zjax.comm before the loop, the edges as the model reads them)
    and one for its scales; none without quantization (GSPMD then gathers in bf16)."""
    counts = {}
    for q in (None, "weights"):
        cfg = Pipeline(8, schedule=schedule, zero3_gather="step")
        plan = zjax.Plan(zjax.make_mesh(**MESHES["dp2_pp4"]), stage=3, quantized_comm=q, pipeline=cfg)
        init_fn, loss_fn = decoder_task()
        state = plan.abstract_state(init_fn, optax.adamw(1e-3), jax.random.key(0))
        text = plan.train_step(loss_fn).lower(state, plan.shard_batch(tokens(0))).as_text()
        counts[q] = {t: len(re.findall(rf"all_gather.*-> tensor<[0-9x]+x{t}>", text)) for t in ("i8", "f32")}
    split = [p for p in state.layout.params.placements if "dp" in str(p.sharded)]
    assert counts[None] == {"i8": 0, "f32": 0}
    assert counts["weights"] == {"i8": len(split), "f32": len(split)}


@pytest.mark.slow  # two Decoder compiles and runs; the test above checks the traced gathers under GPipe too
def test_weights_gathered_once_per_step_cross_dp_as_int8_under_1f1b():
    """qwZ under 1F1B (every table schedule gathers the stages' weights once per step, zero3_gather="step"): the
    model reads them through zjax.comm before the loop, so every weight gather over dp is int8 with an fp32 scale
    per block (the embedding and head included); the reductions stay bf16; two steps follow bf16's losses within
    the blocks' rounding."""
    (plain, plain_losses), (quantized, losses) = _bf16_and_int8_runs(
        Pipeline(8, schedule="1f1b", zero3_gather="step"), 2
    )
    assert ("all-gather", "bf16") not in quantized and plain[("all-gather", "bf16")] > 0
    assert quantized[("all-gather", "s8")] == pytest.approx(plain[("all-gather", "bf16")] / 2, rel=1e-3)
    # an fp32 scale per block: 256 values, or a smaller last dim whole (head_dim, 32)
    s8 = quantized[("all-gather", "s8")]
    assert s8 * 4 / 256 <= quantized[("all-gather", "f32")] <= s8 * 4 / WIDE.head_dim
    reductions = {k: v for k, v in plain.items() if k[0] != "all-gather"}
    assert reductions and {k: v for k, v in quantized.items() if k[0] != "all-gather"} == reductions
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-3)
    assert losses != plain_losses


@pytest.mark.slow  # the GPU target's pipeline test checks every in-loop dp gather is int8 in the fast suite
def test_per_layer_gathers_cross_dp_as_int8_blocks_inside_the_loop():
    """qwZ under zero3_gather="layer" (the default at stage 3), on dp=2 x tp=2 x pp=2: every all-gather over dp
    inside the pipeline's loop is int8 or fp32 (a scale per block), none in bf16; each layer weight split over dp
    crosses as int8 whole (its tp tile), equally often (forward and rematerialized), with dp splitting the last dim
    of some (wo, w_down: their blocks within each rank's tile)."""
    cfg = Pipeline(8, zero3_gather="layer")
    plan = zjax.Plan(zjax.make_mesh(**MESHES["dp2_tp2_pp2"]), stage=3, quantized_comm="weights", pipeline=cfg)
    init_fn, loss_fn = decoder_task(WIDE)
    state = plan.abstract_state(init_fn, optax.adamw(1e-3), jax.random.key(0))
    _, hlo = partitioned_hlo(plan.train_step(loss_fn).lower(state, plan.shard_batch(tokens(0))))
    over_dp = [c for c in collectives(hlo) if "dp" in spanned_axes(c.groups, dict(plan.mesh.shape))]
    inside = [c for c in over_dp if c.in_loop and c.kind == "all-gather"]
    assert {c.dtype for c in inside} == {"s8", "f32"}
    # each layer weight split over dp: one layer, whole over dp, its tp tile (a byte per value)
    layers = [p for p in state.layout.params.placements if p.leaf.path.startswith("layers/") and "dp" in str(p.sharded)]
    assert any(p.sharded[-1] == "dp" for p in layers)  # blocks cut within each rank's tile of the last dim
    tiles = sorted(int(np.prod(p.leaf.shape[1:])) // (2 if "tp" in str(p.sharded) else 1) for p in layers)
    s8 = sorted(c.volume for c in inside if c.dtype == "s8")
    passes = len(s8) // len(tiles)
    assert passes >= 2 and s8 == sorted(tiles * passes)
    scales = sum(c.volume for c in inside if c.dtype == "f32")
    assert sum(s8) * 4 / 256 <= scales <= sum(s8) * 4 / WIDE.head_dim  # fp32 per block: 256 values, or a head


@pytest.mark.slow  # two Decoder compiles and runs; the fast test above checks the gathers
def test_a_decoder_with_quantized_per_layer_gathers_trains_like_bf16():
    """Stage 3 under GPipe on dp=2 x pp=4 with zero3_gather="layer": two steps with quantized_comm="weights" follow
    bf16's losses within the blocks' rounding, the weight gathers over dp int8 and the reductions in bf16."""
    (plain, plain_losses), (quantized, losses) = _bf16_and_int8_runs(Pipeline(8, zero3_gather="layer"), 2)
    assert quantized[("all-gather", "s8")] > 0 and ("all-gather", "s8") not in plain
    assert {k for k in quantized if k[0] == "reduce-scatter"} == {k for k in plain if k[0] == "reduce-scatter"}
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-3)
    assert losses != plain_losses


@pytest.mark.slow  # two compiles and steps of the WIDE decoder; the fast suite checks the e4m3 gather alone
def test_a_table_schedule_gathers_the_fp8_products_weights_in_e4m3_with_the_same_step(monkeypatch):
    """fp8 current scaling at stage 3 under 1F1B on dp=2 x pp=4, each layer gathered over dp inside the tick loop:
    every projection's weight crosses as e4m3 (half its bf16 bytes; the norms stay bf16), and the step is bit for
    bit the one whose gathers move bf16 (the product's cast of an e4m3-gathered weight is exact)."""
    import zjax.models._stages as stages

    model = dataclasses.replace(WIDE, matmul="fp8-current")
    plan = zjax.Plan(zjax.make_mesh(**MESHES["dp2_pp4"]), stage=3, pipeline=Pipeline(8, schedule="1f1b"))
    init_fn, loss_fn = decoder_task(model)
    runs = []
    for reads in (stages.FP8_PROJECTIONS, ()):
        monkeypatch.setattr(stages, "FP8_PROJECTIONS", reads)  # () : gathered in bf16, cast after
        state = plan.init(init_fn, optax.sgd(0.1), jax.random.key(0))
        compiled, hlo = partitioned_hlo(plan.train_step(loss_fn).lower(state, plan.shard_batch(tokens(0))))
        gathers: dict = {}  # each all-gather of the partitioned program once: its result's bytes by dtype
        for dtype, dims in re.findall(r"= (\w+)\[([\d,]*)\]\{?[\d,]*\}? all-gather\(", hlo):
            size = int(np.prod([int(d) for d in dims.split(",") if d])) * (1 if dtype == "f8e4m3fn" else 2)
            gathers[dtype] = gathers.get(dtype, 0) + size
        state, metrics = compiled(state, plan.shard_batch(tokens(0)))
        runs.append((gathers, float(metrics["loss"]), jax.device_get(state.params)))
    (e4m3, loss, params), (bf16, plain_loss, plain_params) = runs
    assert "f8e4m3fn" not in bf16 and e4m3["f8e4m3fn"] > 0, (e4m3, bf16)
    assert e4m3["f8e4m3fn"] == (bf16["bf16"] - e4m3["bf16"]) // 2, (e4m3, bf16)  # the projections', halved
    assert e4m3["bf16"] < bf16["bf16"] / 8  # the norms' scales and the edges (the embedding, gathered once)
    assert loss == plain_loss
    jax.tree.map(np.testing.assert_array_equal, params, plain_params)


def test_per_layer_quantized_gathers_need_the_stage_to_read_its_layers_through_zjax_comm():
    """A stage_fn of one's own under qwZ and zero3_gather="layer" that does not read its layers through
    zjax.comm.gathered_tree is refused (its gathers would cross dp in bf16); reading them so, it traces."""
    plan = zjax.Plan(zjax.make_mesh(**MESHES["dp2_pp4"]), stage=3, quantized_comm="weights", pipeline=Pipeline(8))
    params = {"layers": {"w": jnp.zeros((L, D, D))}}
    state = plan.abstract_state(lambda r: params, optax.sgd(0.1), jax.random.key(0))
    batch = jax.ShapeDtypeStruct((B, D), jnp.float32)

    def loss(read):
        def fn(p, x):
            stage = zjax.pipeline.scan_layers(lambda w, h: jnp.tanh(h @ read(w)["w"]))
            return jnp.mean(apply(stage, p["layers"], x) ** 2)

        return fn

    with pytest.raises(ValueError, match=r"zero3_gather='layer' .* read none, .* Pipeline\(zero3_gather='step'\)"):
        plan.train_step(loss(lambda w: w)).lower(state, batch)
    text = plan.train_step(loss(lambda w: zjax.comm.gathered_tree(w, ("layers",)))).lower(state, batch).as_text()
    assert "xi8>" in text


def test_under_a_pipeline_the_loss_reads_a_tied_table_once_before_its_vocabulary_loop():
    """Stage 3 under GPipe, the loss over two vocabulary chunks: the traced step (no compile) gathers the tied table
    over dp once, through zjax.comm, for the lookup and the head alike, before the loss's loop (left to GSPMD, the
    head was gathered inside the loop, forward and backward, on the GPU compiler: docs/concepts/precision.md)."""
    cfg = dataclasses.replace(CFG, tie_embeddings=True, vocab=96)  # a table no other weight's shape
    model = Decoder(cfg)
    plan = zjax.Plan(zjax.make_mesh(**MESHES["dp2_pp4"]), stage=3, pipeline=Pipeline(8, zero3_gather="step"))
    state = plan.abstract_state(
        lambda r: model.init(r, jnp.zeros((1, 16), jnp.int32))["params"], optax.adamw(1e-3), jax.random.key(0)
    )
    step = plan.train_step(lambda p, b: lm_loss(model, p, b, vocab_chunk=cfg.vocab // 2))
    text = step.lower(state, plan.shard_batch(tokens(0))).as_text()
    assert len(re.findall(rf"all_gather.*-> tensor<{cfg.vocab}x{cfg.embed}xbf16>", text)) == 1


@pytest.mark.parametrize("schedule", ["gpipe", "circular_m_2s"])
def test_nan_in_bubble_slots_changes_nothing(schedule):
    """Every carry slot that is not real work starts as NaN: loss, output and gradients are unchanged."""
    mesh = zjax.make_mesh(dp=2, pp=4)
    cfg = schedules(4)[schedule]
    w, x = weights_and_input()
    (clean, h), g = run_pipelined(mesh, cfg, w, x)
    (dirty, h2), g2 = run_pipelined(mesh, cfg, w, x, fill=float("nan"))
    assert np.isfinite(float(dirty))
    np.testing.assert_array_equal(dirty, clean)
    np.testing.assert_array_equal(h2, h)
    for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # the schedules' bubbles are tested fast on their tables (test_pipeline_schedules)
def test_bubble_flops_match_the_schedule():
    """Per-device FLOPs of the (unrolled) forward over the ideal share of the sequential FLOPs equal
    (M*R + S - 1) / (M*R): every device computes one stage on one microbatch per iteration."""
    mesh = zjax.make_mesh(dp=2, pp=4)
    w, x = weights_and_input(dim=256, rows=64)  # matmuls dominate: the selects of the schedule stay < 1%
    seq = jax.jit(lambda w, x: sequential(w, x)[1]).lower(w, x).compile()
    ideal = seq.cost_analysis()["flops"] / 8
    for cfg in (Pipeline(4), Pipeline(8), Pipeline(4, repeats=2), Pipeline(8, repeats=2)):
        unrolled = Pipeline(cfg.microbatches, cfg.repeats, unroll=True)
        with jax.set_mesh(mesh):
            wd = jax.device_put(w, NamedSharding(mesh, P("pp")))
            xd = jax.device_put(x, NamedSharding(mesh, P("dp")))
            compiled = jax.jit(lambda w, x: apply(stage_fn, w, x, unrolled)).lower(wd, xd).compile()  # noqa: B023
        ratio = compiled.cost_analysis()["flops"] / ideal
        m_r = cfg.microbatches * cfg.repeats
        assert ratio == pytest.approx((m_r + 3) / m_r, rel=0.01), (cfg, ratio)
        assert cfg.bubble(4) == pytest.approx(3 / (m_r + 3))


# -- the plan: a decoder trained through the pipeline --------------------------------------------------

CFG = DecoderConfig(vocab=64, embed=32, layers=8, heads=2, head_dim=16, mlp=64, max_len=16)


def decoder_task(cfg: DecoderConfig = CFG):
    model = Decoder(cfg)
    return (lambda r: model.init(r, jnp.zeros((1, 16), jnp.int32))["params"]), (lambda p, b: lm_loss(model, p, b))


def tokens(seed: int, rows: int = 32) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, CFG.vocab, (rows, 17)).astype(np.int32)


def train(plan: zjax.Plan, steps: int = 3):
    """Same seed, natural layer order: every plan must compute the same function."""
    init_fn, loss_fn = decoder_task()
    state = plan.init(init_fn, optax.sgd(0.1, momentum=0.9), jax.random.key(0))
    step = plan.train_step(loss_fn)
    losses = []
    for i in range(steps):
        state, metrics = step(state, plan.shard_batch(tokens(i)))
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(state.params)


@pytest.fixture(scope="module")
def reference():
    return train(zjax.Plan(zjax.make_mesh(dp=8), stage=0, precision="fp32"))


def check_against_reference(reference, mesh_kw, stage, schedule, gather="step"):
    stages = mesh_kw["pp"]
    cfg = dataclasses.replace(schedules(stages)[schedule], zero3_gather=gather)
    plan = zjax.Plan(zjax.make_mesh(**mesh_kw), stage=stage, precision="fp32", pipeline=cfg)
    losses, params = train(plan)
    np.testing.assert_allclose(losses, reference[0], atol=1e-5)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(reference[1]), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_decoder_trains_through_the_pipeline(reference):
    """ZeRO-3 + circular schedule on dp=2 x pp=4: losses and parameters after 3 SGD+momentum steps equal
    the non-pipelined model's on dp=8."""
    check_against_reference(reference, MESHES["dp2_pp4"], 3, "circular_m_2s")


@pytest.mark.parametrize(
    ("mesh_kw", "schedule"),
    [
        pytest.param({"dp": 2, "pp": 4}, "gpipe", marks=pytest.mark.slow),
        ({"dp": 2, "tp": 2, "pp": 2}, "circular_m_eq_s"),
    ],
)
def test_the_same_seed_gives_the_same_model_under_every_schedule(reference, mesh_kw, schedule):
    """No pipeline (dp=8), GPipe (dp=2 x pp=4) and circular R=2 (dp=2 x tp=2 x pp=2), fp32 stage 0: the
    layers are stored in their natural order, so the same seed trains the same function."""
    check_against_reference(reference, mesh_kw, 0, schedule)


@pytest.mark.slow
def test_a_circular_checkpoint_restores_into_any_plan_and_computes_the_same_function(reference, tmp_path):
    """Saved under circular R=2 after one step; restored into dp=8 without a pipeline and into GPipe (R=1):
    the next losses equal the straight run's."""
    init_fn, loss_fn = decoder_task()
    tx = optax.sgd(0.1, momentum=0.9)
    circular = zjax.Plan(zjax.make_mesh(dp=2, tp=2, pp=2), stage=3, precision="fp32", pipeline=Pipeline(4, repeats=2))
    state = circular.init(init_fn, tx, jax.random.key(0))
    state, _ = circular.train_step(loss_fn)(state, circular.shard_batch(tokens(0)))
    with zjax.Checkpointer(tmp_path) as ckpt:
        ckpt.save(state, circular)
    targets = [
        zjax.Plan(zjax.make_mesh(dp=8), stage=0, precision="fp32"),
        zjax.Plan(zjax.make_mesh(dp=4, pp=2), stage=1, precision="fp32", pipeline=Pipeline(2)),
    ]
    for plan in targets:
        with zjax.Checkpointer(tmp_path) as ckpt:
            restored, _ = ckpt.restore(plan, init_fn, tx, jax.random.key(0))
        step = plan.train_step(loss_fn)
        losses = []
        for i in (1, 2):
            restored, metrics = step(restored, plan.shard_batch(tokens(i)))
            losses.append(float(metrics["loss"]))
        np.testing.assert_allclose(losses, reference[0][1:3], atol=1e-5)


@pytest.mark.slow  # the other gathering modes compute the one-device objective in test_pipeline_objective.py
@pytest.mark.parametrize("gather", ["layer"])
def test_decoder_hsdp_pipeline(reference, gather):
    """HSDP (replica=2 x dp=2) x pp=2, ZeRO-3, per-layer gathers: the same losses and parameters."""
    check_against_reference(reference, {"dp": (2, 2), "pp": 2}, 3, "circular_m_2s", gather)


def compiled_step(mesh_kw, stage, cfg, rows=32, precision="bf16", model=CFG):
    init_fn, loss_fn = decoder_task(model)
    plan = zjax.Plan(zjax.make_mesh(**mesh_kw), stage=stage, precision=precision, pipeline=cfg)
    state = plan.abstract_state(init_fn, optax.adamw(1e-3), jax.random.key(0))
    batch = jax.ShapeDtypeStruct((rows, 17), jnp.int32)
    step = plan.train_step(loss_fn)
    compiled, hlo = partitioned_hlo(step.lower(state, batch))
    return plan, state, batch, step, compiled, hlo


@pytest.mark.parametrize(
    ("stage", "schedule"),
    [(3, "circular_m_2s"), pytest.param(1, "gpipe", marks=pytest.mark.slow),
     pytest.param(3, "gpipe", marks=pytest.mark.slow), pytest.param(1, "circular_m_2s", marks=pytest.mark.slow)],
)  # fmt: skip
def test_hlo_structure(stage, schedule):
    """Gathering once per step (``zero3_gather="step"``): no dp collective inside the loop."""
    cfg = dataclasses.replace(schedules(4)[schedule], zero3_gather="step")
    plan, state, _, _, _, hlo = compiled_step(MESHES["dp2_pp4"], stage, cfg)
    shape = dict(plan.mesh.shape)
    ops = [(c, spanned_axes(c.groups, shape)) for c in collectives(hlo)]
    permutes = [(c, axes) for c, axes in ops if c.kind == "collective-permute"]
    in_loop = [c for c, axes in permutes if c.in_loop]
    # the stage shift and the stream-io shift, forward and backward: 2 per iteration per direction
    assert 0 < len(in_loop) <= 4
    assert all(axes == ("pp",) for _, axes in permutes)
    sizes = list(shape.values())
    for c in in_loop:  # every pair moves one stage along pp (the ring's wrap-around included)
        stage_of = [int(np.unravel_index(p, sizes)[0]) for pair in c.groups for p in pair]
        assert all((b - a) % 4 in (1, 3) for a, b in zip(stage_of[::2], stage_of[1::2], strict=True))
        assert len(c.groups) <= 8  # at most S pairs per pipeline (one per dp rank here)
    # data-parallel gradient reductions once per step, outside every loop
    reductions = [(c, axes) for c, axes in ops if c.kind in ("all-reduce", "reduce-scatter") and "dp" in axes]
    assert reductions and not [c for c, _ in reductions if c.in_loop]
    # stage weights are never gathered over pp (stream io: no collective at the pipeline's boundary)
    assert not [c for c, axes in ops if c.kind == "all-gather" and "pp" in axes]
    # weights are gathered over dp outside the loop: ZeRO-3 once per step before it, ZeRO-1 after the update
    gathers = [c for c, axes in ops if c.kind == "all-gather"]
    assert gathers and not [c for c in gathers if c.in_loop]


# a decoder whose layer weights outweigh its activations (what per-use gathering is for)
WIDE = DecoderConfig(vocab=64, embed=128, layers=8, heads=4, head_dim=32, mlp=512, max_len=16)


@pytest.fixture(scope="module")
def gather_modes():
    """ZeRO-3, circular R=2 with M=8 on dp=2 x pp=4, compiled in both gathering modes."""
    return {
        g: compiled_step(MESHES["dp2_pp4"], 3, Pipeline(8, repeats=2, zero3_gather=g), model=WIDE)
        for g in ("step", "layer")
    }


@pytest.mark.slow  # two circular-schedule compiles (the fixture, read by this test alone): the slow step
def test_per_use_gathering_cuts_temp_memory_and_moves_the_gathers_into_the_loop(gather_modes):
    """Gathering per use inside the loop: temp < 0.6 x gathering once per step, the same state. Gathering once per
    step puts no gather and no dp reduction in the loop; gathering per use puts both there, over dp only. Both keep
    the loop's permutes over pp and never gather over pp."""
    step, layer = (gather_modes[g][4].memory_analysis() for g in ("step", "layer"))
    print(f"temp: step {step.temp_size_in_bytes / 2**20:.2f} MiB, layer {layer.temp_size_in_bytes / 2**20:.2f} MiB")
    assert layer.temp_size_in_bytes < 0.6 * step.temp_size_in_bytes
    assert layer.argument_size_in_bytes == step.argument_size_in_bytes
    for gather, (plan, *_, hlo) in gather_modes.items():
        ops = loop_collectives(plan, hlo)
        gathers = [axes for c, axes in ops if c.kind == "all-gather"]
        dp_reductions = [axes for c, axes in ops if c.kind in ("all-reduce", "reduce-scatter") and "dp" in axes]
        permutes = [axes for c, axes in ops if c.kind == "collective-permute"]
        assert 0 < len(permutes) <= 4 and set(permutes) == {("pp",)}
        if gather == "step":
            assert not gathers and not dp_reductions
        else:
            assert gathers and set(gathers) == {("dp",)}
            assert dp_reductions and set(dp_reductions) == {("dp",)}
        assert not [
            c
            for c in collectives(hlo)
            if c.kind == "all-gather" and "pp" in spanned_axes(c.groups, dict(plan.mesh.shape))
        ]


def peak(mesh_kw, stage, cfg, model=WIDE):
    _, state, batch, step, compiled, _ = compiled_step(mesh_kw, stage, cfg, model=model)
    return step.memory_report(state, batch, compiled=compiled).peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["circular_m_2s"])  # the circular schedule, which holds more in flight
def test_default_mode_stage_3_and_2_peak_below_stage_1(schedule):
    """With a pipeline, the default mode at stages 2 and 3 keeps weights and gradients split over dp
    through the loop: on a weight-heavy decoder stage 3 peaks well below stage 1 (and with GPipe stage 2 below
    stage 1; with the circular schedule stage 2 saves about nothing: see docs/concepts/pipelines.md)."""
    cfg = schedules(4)[schedule]
    peaks = {stage: peak(MESHES["dp2_pp4"], stage, cfg) for stage in ((1, 2, 3) if cfg.repeats == 1 else (1, 3))}
    print({k: f"{v / 2**20:.2f} MiB" for k, v in peaks.items()})
    assert peaks[3] < 0.85 * peaks[1]
    if cfg.repeats == 1:
        assert peaks[2] < peaks[1] and peaks[3] < 0.85 * peaks[2]


@pytest.mark.slow
def test_remat_policy_changes_pipeline_temps_and_the_program_is_flat_in_layers_per_stage():
    """The stage's layers run as a scan rematerialized by the model's policy: saving everything ("none") costs more
    temp than saving layer inputs only ("full"), as without a pipeline (the remat page's figure). And 4x the layers
    per stage: the same HLO size (one scan per stage), so compile time does not grow with it."""
    temps, lines = {}, []
    for remat in ("none", "full"):
        compiled, hlo = compiled_step(MESHES["dp2_pp4"], 3, Pipeline(4), model=dataclasses.replace(WIDE, remat=remat))[
            4:
        ]
        temps[remat] = compiled.memory_analysis().temp_size_in_bytes
        if remat == "full":  # WIDE's own remat: its 8 layers, 2 per stage
            lines.append(len(hlo.splitlines()))
    print({k: f"{v / 2**20:.2f} MiB" for k, v in temps.items()})
    assert temps["none"] > 1.2 * temps["full"]
    hlo = compiled_step(MESHES["dp2_pp4"], 3, Pipeline(4), model=dataclasses.replace(WIDE, layers=32))[5]
    lines.append(len(hlo.splitlines()))
    assert lines[1] <= 1.02 * lines[0], lines


def test_partitioned_remat_is_refused_under_a_pipeline():
    model = dataclasses.replace(CFG, remat="full+partitioned")
    with pytest.raises(ValueError, match=r"remat='full\+partitioned' under pipeline parallelism.*Use remat='full'"):
        compiled_step(MESHES["dp2_tp2_pp2"], 3, Pipeline(2), model=model)


def loop_collectives(plan, hlo):
    shape = dict(plan.mesh.shape)
    return [(c, spanned_axes(c.groups, shape)) for c in collectives(hlo) if c.in_loop]


@pytest.mark.slow
def test_hsdp_per_use_gathering_reduces_over_replica_outside_the_loop():
    """With replica x dp, per-use gathering keeps the weights whole over replica: the loop gathers and
    reduces over dp only, and the reduction over replica happens once, outside it."""
    plan, *_, hlo = compiled_step({"dp": (2, 2), "pp": 2}, 3, Pipeline(4, repeats=2, zero3_gather="layer"))
    ops = loop_collectives(plan, hlo)
    assert [c for c, axes in ops if c.kind == "all-gather"]
    assert not [c for c, axes in ops if "replica" in axes]
    shape = dict(plan.mesh.shape)
    assert [c for c in collectives(hlo) if not c.in_loop and spanned_axes(c.groups, shape) == ("replica",)]


@pytest.mark.parametrize(
    ("stage", "mesh_name"),
    [
        pytest.param(1, "dp2_pp4", marks=pytest.mark.slow),
        (3, "dp2_pp4"),
        pytest.param(3, "dp2_tp2_pp2", marks=pytest.mark.slow),
    ],
)
def test_state_bytes_follow_pp_tp_and_dp(stage, mesh_name):
    """Per device: parameters / (pp x tp) (x 1/dp at stage 3) plus optimizer state / dp, within 5%."""
    mesh_kw = MESHES[mesh_name]
    plan, state, batch, step, compiled, _ = compiled_step(mesh_kw, stage, Pipeline(mesh_kw["pp"]))
    report = step.memory_report(state, batch, compiled=compiled)
    assert report.state_compiled == pytest.approx(report.state_theory, rel=0.05)
    layer_params = sum(x.size for x in jax.tree.leaves(state.params["layers"]))
    model_parallel = mesh_kw["pp"] * mesh_kw.get("tp", 1)
    on_device = sum(
        x.sharding.shard_shape(x.shape)[0] * np.prod(x.sharding.shard_shape(x.shape)[1:])
        for x in jax.tree.leaves(state.params["layers"])
    )
    expected = layer_params / model_parallel / (2 if stage == 3 else 1)
    assert on_device == pytest.approx(expected, rel=0.05)


@pytest.mark.slow
def test_temp_memory_and_program_size_flat_in_microbatches():
    """At a fixed batch, M=32 microbatches cost at most 1.1x the temp memory of M=8 and the same HLO size."""
    small = compiled_step(MESHES["dp2_pp4"], 1, Pipeline(8), rows=64)
    large = compiled_step(MESHES["dp2_pp4"], 1, Pipeline(32), rows=64)
    temp = [c.memory_analysis().temp_size_in_bytes for c in (small[4], large[4])]
    assert temp[1] <= 1.1 * temp[0], temp
    lines = [len(h.splitlines()) for h in (small[5], large[5])]
    assert lines[1] <= 1.02 * lines[0], lines


@pytest.mark.slow
def test_one_compiled_step_for_the_run(caplog):
    init_fn, loss_fn = decoder_task()
    plan = zjax.Plan(zjax.make_mesh(dp=2, pp=4), stage=3, precision="bf16", pipeline=Pipeline(4, repeats=2))
    state = plan.init(init_fn, optax.adamw(1e-3), jax.random.key(0))
    step = plan.train_step(loss_fn)
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        for i in range(3):
            state, metrics = step(state, plan.shard_batch(tokens(i)))
    assert np.isfinite(float(metrics["loss"]))
    assert len([r for r in caplog.records if r.getMessage().startswith("Compiling jit(<lambda>)")]) == 1


# -- errors ------------------------------------------------------------------------------------------


def test_config_errors():
    mesh = zjax.make_mesh(dp=2, pp=4)
    with pytest.raises(ValueError, match=r"the mesh has pp=4 but no pipeline schedule.*Pipeline\(microbatches=M\)"):
        zjax.Plan(mesh, stage=1)
    with pytest.raises(ValueError, match=r"microbatches=2 < pp=4 stages: .*or schedule='1f1b' or 'zero-bubble'"):
        zjax.Plan(mesh, stage=1, pipeline=Pipeline(2))
    with pytest.raises(ValueError, match=r"microbatches=6 is not a multiple of pp=4.*Use 8 or 4, or schedule='1f1b'"):
        zjax.Plan(mesh, stage=1, pipeline=Pipeline(6))
    with pytest.raises(ValueError, match="repeats=0 must be a positive int"):
        Pipeline(4, repeats=0)
    with pytest.raises(ValueError, match=r"zero3_gather='all' is not a gathering mode; use one of \('step', 'layer'"):
        Pipeline(4, zero3_gather="all")
    for stage in (0, 1):
        with pytest.raises(ValueError, match=rf"zero3_gather='layer' .* stage={stage} keeps whole gradients"):
            zjax.Plan(mesh, stage=stage, pipeline=Pipeline(4, zero3_gather="layer"))
    with pytest.raises(ValueError, match=r"zero3_gather='chunk' was removed: 'step' .* 'layer' .* memory does"):
        Pipeline(4, zero3_gather="chunk")
    # the default gathering mode is settled by the plan: per use where gradients are split over dp
    modes = {stage: zjax.Plan(mesh, stage=stage, pipeline=Pipeline(4)).pipeline.zero3_gather for stage in range(4)}
    assert modes == {0: "step", 1: "step", 2: "layer", 3: "layer"}
    # reduce_dtype reduces each rank's whole gradients once per step: "step" by default, per use refused
    wide = {s: zjax.Plan(mesh, stage=s, reduce_dtype="float32", pipeline=Pipeline(4)).pipeline for s in range(4)}
    assert {s: p.zero3_gather for s, p in wide.items()} == dict.fromkeys(range(4), "step")
    with pytest.raises(ValueError, match=r"zero3_gather='layer' with Plan\(reduce_dtype='float32'\).*'step'"):
        zjax.Plan(mesh, stage=3, reduce_dtype="float32", pipeline=Pipeline(4, zero3_gather="layer"))
    # qwZ under a pipeline, in every gathering mode (the default "layer" included), weights only
    for gather in ("step", "layer", None):
        quantized = zjax.Plan(mesh, stage=3, quantized_comm="weights", pipeline=Pipeline(4, zero3_gather=gather))
        assert quantized.quantizes_weights and not quantized.reduces_gradients
        assert quantized.read_wire is not None  # the model's reads (and "step"'s one gather) quantize
    for q, gather in (("weights+grads", "layer"), ("grads", "step")):
        with pytest.raises(ValueError, match=rf"'{re.escape(q)}' under pipeline schedule='gpipe', zero3_gather"):
            zjax.Plan(mesh, stage=3, quantized_comm=q, pipeline=Pipeline(4, zero3_gather=gather))
    # the table schedules reduce quantized per layer (zero3_gather="layer", their default at stage 3)
    assert zjax.Plan(mesh, stage=3, quantized_comm="grads", pipeline=Pipeline(4, schedule="1f1b")).quantizes_grads
    with pytest.raises(ValueError, match=r"'grads' under pipeline schedule='1f1b', zero3_gather='step'"):
        zjax.Plan(mesh, stage=3, quantized_comm="grads", pipeline=Pipeline(4, schedule="1f1b", zero3_gather="step"))
    with pytest.raises(TypeError, match="pipeline must be a zjax.Pipeline"):
        zjax.Plan(mesh, stage=1, pipeline=4)


@pytest.mark.parametrize(
    ("cfg", "layers", "rows", "match"),
    [
        (Pipeline(4, repeats=3), 8, 32, r"8 layers do not split into pp=4 stages x repeats=3 equal chunks"),
        (Pipeline(8), 8, 24, r"12 batch rows per data-parallel rank do not split into microbatches=8"),
    ],
)
def test_apply_errors(cfg, layers, rows, match):
    mesh = zjax.make_mesh(dp=2, pp=4)
    w, x = weights_and_input(layers=layers, rows=rows)
    with pytest.raises(ValueError, match=match):
        run_pipelined(mesh, cfg, w, x)


def test_apply_needs_a_schedule_and_a_mesh():
    w, x = weights_and_input()
    with pytest.raises(ValueError, match="needs a mesh in context"):
        apply(stage_fn, w, x, Pipeline(4))
    with jax.set_mesh(zjax.make_mesh(dp=2, pp=4)), pytest.raises(ValueError, match="pp=4 but no pipeline schedule is"):
        apply(stage_fn, w, x)
    # without pp and without a schedule the stages run in turn: the same function
    np.testing.assert_allclose(apply(stage_fn, w, x), sequential(w, x)[1], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(("mesh", "gather"), [("dp=2,tp=2,pp=2", "layer")])  # docs/getting_started.md runs dp=2,pp=4
def test_example_trains_with_a_pipeline(tmp_path, mesh, gather):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "m.json"
    run = subprocess.run(
        [sys.executable, "examples/train_lm.py", "--preset", "tiny", "--steps", "8", "--batch-size", "16",
         "--seq-len", "32", "--stage", "3", "--mesh", mesh, "--microbatches", "4", "--repeats", "2",
         "--zero3-gather", gather, "--no-progress", "--metrics-json", str(out)],
        cwd=root, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    stages = result["mesh"]["pp"]
    assert result["pipeline"]["bubble"] == pytest.approx((stages - 1) / (4 * 2 + stages - 1))
    assert result["pipeline"]["zero3_gather"] == gather
    assert result["losses"][-1] < result["losses"][0]


@pytest.mark.slow
def test_planner_takes_per_use_gathering_for_stages_2_and_3_only():
    """The planner compiles every stage with one schedule: per-use gathering applies at stages 2 and 3
    (more dp traffic than gathering once), the lower stages gather once."""
    schedule = Pipeline(8, repeats=2, zero3_gather="layer")
    kw = {"mesh": {"dp": 2, "pp": 4}, "batch_size": 32, "seq_len": 16}
    lean = zjax.planner.estimate(WIDE, stages=(1, 3), pipeline=schedule, **kw)
    once = zjax.planner.estimate(WIDE, stages=(3,), pipeline=dataclasses.replace(schedule, zero3_gather="step"), **kw)
    stage1, stage3 = lean.rows
    assert (stage1.stage, stage3.stage) == (1, 3)
    assert stage3.comm.total_volume > 2 * once.rows[0].comm.total_volume
    assert stage3.compiled["temp"] < once.rows[0].compiled["temp"]


@pytest.mark.parametrize("wide", [True, False])
def test_a_ranks_microbatch_gradients_sum_in_the_accumulation_dtype(wide):
    """Inside a region manual over dp (each rank's gradients, as Plan(reduce_dtype=...) makes them), GPipe sums
    a bf16 weight's gradient over 16 microbatches in fp32 under ``accumulating("float32")``: 16 x (1 + 3 x 2**-7)
    = 16.375 exactly (a bf16 number), where a bf16 running sum rounds on the way to 16.25."""
    mesh = zjax.make_mesh(dp=4, pp=2)
    m, c = 16, 1 + 3 * 2**-7

    def rank_grad(w, x):
        def loss(w):
            y = apply(lambda ws, h: h + jnp.sum(ws, axis=0), w, x, Pipeline(m))
            return jnp.sum(y.astype(jnp.float32)) * c

        with accumulating(jnp.float32 if wide else None):
            return jax.grad(loss)(w)[None]

    w = jnp.zeros((4, 8), jnp.bfloat16)
    x = jnp.zeros((4 * m, 8), jnp.bfloat16)
    with jax.set_mesh(mesh):
        fn = jax.shard_map(rank_grad, in_specs=(P(), P("dp")), out_specs=P("dp"), axis_names={"dp"}, check_vma=False)
        grads = np.asarray(jax.jit(fn)(w, x).astype(jnp.float32))
    exact = np.all(grads == m * c)
    assert exact if wide else not exact, np.unique(grads)
