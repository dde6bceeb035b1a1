"""Every pipeline schedule computes the one-device objective on packed rows with uneven masks.

Each microbatch's per-token arrays (positions, segment ids, the routers' mask) travel with it through the stages
(``zjax.pipeline.apply(..., side=...)``), so packed documents stay apart under every schedule, every ZeRO stage
and gathering mode, with cp and with experts. One SGD step of a four-layer tiny decoder against ``jax.grad`` of
the whole batch's mean loss on one device (tests/_objective.py), fp32 within 3e-5.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import zjax
from zjax.models import Decoder, lm_loss
from zjax.pipeline import ACTION_SCOPE
from zjax.planner._compile import partitioned_hlo
from zjax.planner._hlo import _parse, _trip_count, collectives, spanned_axes

from ._models import TINY
from ._objective import SGD, applied, init_fn, initial, reference, relative, uneven_batch
from .test_experts import TINY as TINY_MOE

ROWS, FP32 = 32, 3e-5
FOUR = dataclasses.replace(TINY, layers=4)  # pp=4, or pp=2 with two chunks per stage
SCHEDULES = {  # name: (schedule, repeats)
    "gpipe": ("gpipe", 1),
    "circular": ("gpipe", 2),
    "1f1b": ("1f1b", 1),
    "interleaved": ("interleaved-1f1b", 2),
    "zero-bubble": ("zero-bubble", 1),
    "zb-v": ("zb-v", 2),
}
FAST = {("zb-v", 2, 3)}  # tests/test_objective.py runs GPipe and 1F1B fast on packed rows too
ELSEWHERE = {("1f1b", 2, 1)}  # tests/test_objective.py's fast dp4-pp2-1f1b case: 1F1B at stage 1 on dp=4 x pp=2


def _grid():
    """Every schedule at every stage, pp alternating so that each schedule and each stage meets both pp (pairwise,
    not the full product: the slow step's budget)."""
    for name in SCHEDULES:
        for stage in range(4):
            # 4 layers make one per chunk at pp=2 already: the chunked schedules run there only; 1F1B takes pp=4
            # at the stages where GPipe and zero-bubble take pp=2
            pp = 2 if name in ("circular", "interleaved", "zb-v") else (2, 4)[(stage + (name == "1f1b")) % 2]
            if (name, pp, stage) in ELSEWHERE:
                continue
            marks = [] if (name, pp, stage) in FAST else [pytest.mark.slow]
            yield pytest.param(name, pp, stage, marks=marks, id=f"{name}-pp{pp}-stage{stage}")


@pytest.fixture(scope="module")
def want():
    batch = uneven_batch(ROWS, FOUR)
    return (batch, *reference(FOUR, batch))


def _check(plan, cfg, want, accum=1):
    batch, loss, grads = want
    got, metrics = applied(plan, cfg, batch, accum)
    assert relative(got, grads) <= FP32, relative(got, grads)
    assert abs(float(metrics["loss"]) - loss) <= FP32 * loss, (float(metrics["loss"]), loss)


@pytest.mark.parametrize(("name", "pp", "stage"), list(_grid()))
def test_every_schedule_and_stage_computes_the_one_device_objective_on_packed_rows(want, name, pp, stage):
    schedule, repeats = SCHEDULES[name]
    pipe = zjax.Pipeline(4 if schedule in ("gpipe", "interleaved-1f1b") else 8, repeats=repeats, schedule=schedule)
    plan = zjax.Plan(zjax.make_mesh(dp=8 // pp, pp=pp), stage=stage, precision="fp32", pipeline=pipe)
    _check(plan, FOUR, want)


@pytest.mark.slow  # the grid runs ZB-V at pp=2 (four layers make two chunks of one layer per stage there)
def test_zb_v_at_pp4_with_fewer_microbatches_than_stages():
    """ZB-V on dp=2 x pp=4 at stage 3 with eight layers and 2 microbatches (fewer than the stages: the V's turn and
    the loss on stage 0 with most ticks idle) equals the one-device objective."""
    eight = dataclasses.replace(TINY, layers=8)
    batch = uneven_batch(ROWS, eight)
    pipe = zjax.Pipeline(2, repeats=2, schedule="zb-v")
    _check(zjax.Plan(zjax.make_mesh(dp=2, pp=4), stage=3, precision="fp32", pipeline=pipe), eight,
           (batch, *reference(eight, batch)))  # fmt: skip


OTHERS = {
    # the gathering modes of stage 3, the whole-gradient region (reduce_dtype), tp, HSDP, offload, cp in both modes
    "reduce-fp32": ({"dp": 4, "pp": 2}, {"stage": 3, "reduce_dtype": "float32", "pipeline": zjax.Pipeline(4)}, None),
    "layer-tp": ({"dp": 2, "pp": 2, "tp": 2}, {"stage": 3, "pipeline": zjax.Pipeline(4, zero3_gather="layer")}, None),
    "reduce-fp32-1f1b": (
        {"dp": 4, "pp": 2}, {"stage": 1, "reduce_dtype": "float32", "pipeline": zjax.Pipeline(4, schedule="1f1b")}, None
    ),
    "tp-1f1b": ({"dp": 2, "pp": 2, "tp": 2}, {"stage": 3, "pipeline": zjax.Pipeline(4, schedule="1f1b")}, None),
    "hsdp-1f1b": ({"dp": (2, 1), "pp": 4}, {"stage": 2, "pipeline": zjax.Pipeline(8, schedule="1f1b")}, None),
    # hpZ: the node's shards gathered across replica once per step, each layer inside the tick loop over dp
    "hpz-1f1b": (
        {"dp": (2, 2), "pp": 2}, {"stage": 3, "hpz": True, "pipeline": zjax.Pipeline(4, schedule="1f1b")}, None
    ),
    "offload-zb-v": (
        {"dp": 4, "pp": 2},
        {"stage": 3, "offload": "optimizer+params", "pipeline": zjax.Pipeline(4, 2, schedule="zb-v")},
        None,
    ),
    "cp-ring": ({"dp": 2, "pp": 2, "cp": 2}, {"stage": 2, "pipeline": zjax.Pipeline(4, repeats=2)}, "ring"),
    # the ring inside a table schedule's branches (on XLA:CPU its steps move K/V by all-gathers there)
    "cp-ring-zero-bubble": (
        {"dp": 2, "pp": 2, "cp": 2}, {"stage": 3, "pipeline": zjax.Pipeline(4, schedule="zero-bubble")}, "ring"
    ),
    "cp-all-gather-1f1b": (
        {"dp": 2, "pp": 2, "cp": 2}, {"stage": 1, "pipeline": zjax.Pipeline(4, schedule="1f1b")}, "all-gather"
    ),
}  # fmt: skip


@pytest.mark.slow  # fast budget: the grid's zb-v case runs every engine piece but these options
@pytest.mark.parametrize("name", list(OTHERS))
def test_gathering_modes_reductions_and_context_parallelism_in_a_pipeline(want, name):
    """The grid's other options: stage 3's layer gathers, reduce_dtype, tp, HSDP (replica=2 x pp=4), hpZ,
    ZeRO-Offload (optimizer and parameters in host memory) and cp (the ring inside a table schedule runs its steps
    as all-gathers on XLA:CPU)."""
    mesh, kw, mode = OTHERS[name]
    cfg = FOUR if mode is None else dataclasses.replace(FOUR, context_mode=mode)
    _check(zjax.Plan(zjax.make_mesh(**mesh), precision="fp32", **kw), cfg, want)


@pytest.mark.slow  # fast budget (the suite's 10 minutes)
@pytest.mark.parametrize(("schedule", "repeats", "stage"), [("gpipe", 1, 3), ("zb-v", 2, 3)])
def test_multi_token_prediction_in_a_pipeline_computes_the_one_device_objective(schedule, repeats, stage):
    """DeepSeek-V3's MTP modules under GPipe (after the last stage, on the pipeline's output) and under a table
    schedule (in the loss's stage, stage 0 in ZB-V's V, beside the head): the one-device objective, next-token
    loss and the modules' together."""
    cfg = dataclasses.replace(FOUR, mtp_layers=1)
    batch = uneven_batch(ROWS, cfg)
    pipe = zjax.Pipeline(4, repeats=repeats, schedule=schedule)
    _check(zjax.Plan(zjax.make_mesh(dp=4, pp=2), stage=stage, precision="fp32", pipeline=pipe), cfg,
           (batch, *reference(cfg, batch)))  # fmt: skip


@pytest.mark.slow  # fast budget (the suite's 10 minutes)
@pytest.mark.parametrize(("mesh", "dense"), [({"dp": 2, "ep": 2, "pp": 2}, 0), ({"dp": 4, "pp": 2}, 1)])
def test_experts_in_a_pipeline_count_only_the_masked_tokens_of_each_microbatch(mesh, dense):
    """The routers' mask (the loss mask) and the packed rows travel with each microbatch: the load-balancing
    statistics, the gradients and the loss are the one-device model's; with DeepSeek's first dense layers too
    (whole before the first stage)."""
    cfg = dataclasses.replace(TINY_MOE, layers=TINY_MOE.layers + dense, dense_layers=dense)
    batch = uneven_batch(ROWS, cfg)
    model = Decoder(cfg)

    def mean(p, b):
        out, aux = lm_loss(model, p, b)
        return out.mean, aux

    (loss, aux), grads = jax.jit(jax.value_and_grad(mean, has_aux=True))(initial(cfg), batch)
    pipe = zjax.Pipeline(4, zero3_gather="step")
    plan = zjax.Plan(zjax.make_mesh(**mesh), stage=3, precision="fp32", pipeline=pipe)
    got, metrics = applied(plan, cfg, batch)
    assert relative(got, jax.tree.map(np.asarray, grads)) <= FP32
    assert abs(float(metrics["loss"]) - float(loss)) <= FP32 * float(loss)
    np.testing.assert_array_equal(metrics["aux"]["expert_tokens"], aux["expert_tokens"])
    for key in ("load_balance", "z_loss", "ce", "dropped"):
        np.testing.assert_allclose(metrics["aux"][key], aux[key], rtol=1e-5, atol=1e-6, err_msg=key)


def _per_microbatch(cfg, batch, groups):
    """The one-device objective of a mixture of experts under a table schedule: ``jax.grad`` (one ``jit``, one device)
    of the token loss over the whole batch plus the routers' losses of each of ``groups`` blocks of rows (the
    schedule's microbatches, each data rank's), each weighted by its share of the scored tokens."""
    model, device = Decoder(cfg), jax.devices()[0]
    rows = len(batch["tokens"]) // groups

    def mean(p, b):
        blocks = jax.tree.map(lambda a: a.reshape(groups, rows, *a.shape[1:]), b)
        sums, counts = jax.lax.map(lambda block: (lambda x: (x.sum, x.count))(lm_loss(model, p, block)[0]), blocks)
        return sums.sum() / counts.sum()

    params, batch = jax.device_put((initial(cfg), batch), device)
    loss, grads = jax.jit(jax.value_and_grad(mean))(params, batch)
    return float(loss), jax.tree.map(np.asarray, grads)


# (schedule, repeats, mesh, stage, balance_loss, dense layers); each with 4 microbatches per data rank
TABLED_MOE = {
    "1f1b-dp4-stage1": ("1f1b", 1, {"dp": 4, "pp": 2}, 1, "per-layer", 0),
    # DeepSeek's first dense layers: on stage 0 after the embedding, in each microbatch's first action
    "zb-v-ep2-stage3-dense": ("zb-v", 2, {"dp": 2, "ep": 2, "pp": 2}, 3, "per-layer", 1),
    "interleaved-ep4-per-sequence": ("interleaved-1f1b", 2, {"ep": 4, "pp": 2}, 2, "per-sequence", 0),
}


@pytest.mark.slow  # fast budget (the suite's 10 minutes); the fast suite traces the pooled loss's refusal
@pytest.mark.parametrize("name", list(TABLED_MOE))
def test_experts_under_a_table_schedule_weigh_each_microbatchs_routers_losses(name):
    """Under 1F1B, interleaved 1F1B and ZB-V each microbatch's routers' losses are its own (a data rank's
    microbatch, Megatron-LM's), weighted by its scored tokens as gradient accumulation weighs them: loss and
    gradients equal the one-device objective of the same blocks of rows (the whole batch's routers' losses differ:
    0.2 relative in the gradients), with the experts over ep too; the metrics are the whole batch's sums."""
    schedule, repeats, mesh, stage, balance, dense = TABLED_MOE[name]
    moe = dataclasses.replace(TINY_MOE.moe, balance_loss=balance)
    cfg = dataclasses.replace(TINY_MOE, layers=2 * repeats + dense, dense_layers=dense, moe=moe)
    batch = uneven_batch(ROWS, cfg)
    ranks = mesh.get("dp", 1) * mesh.get("ep", 1)
    loss, grads = _per_microbatch(cfg, batch, ranks * 4)
    pipe = zjax.Pipeline(4, repeats=repeats, schedule=schedule, zero3_gather="step" if "ep" in mesh else None)
    plan = zjax.Plan(zjax.make_mesh(**mesh), stage=stage, precision="fp32", pipeline=pipe)
    got, metrics = applied(plan, cfg, batch)
    assert relative(got, grads) <= FP32, relative(got, grads)
    assert abs(float(metrics["loss"]) - loss) <= FP32 * loss, (float(metrics["loss"]), loss)
    model = Decoder(cfg)
    _, whole = jax.jit(lambda p, b: lm_loss(model, p, b))(initial(cfg), batch)
    np.testing.assert_array_equal(metrics["aux"]["expert_tokens"], whole["expert_tokens"])
    for key in ("load_balance", "z_loss", "ce", "dropped"):
        np.testing.assert_allclose(metrics["aux"][key], whole[key], rtol=1e-5, atol=1e-6, err_msg=key)
    if schedule == "1f1b":  # evaluation computes the same objective by the table's forwards alone
        state = plan.init(init_fn(cfg), SGD, jax.random.key(0), params=initial(cfg))
        evaluate, placed = plan.eval_step(lambda p, b: lm_loss(model, p, b)), plan.shard_batch(batch)
        out, _ = evaluate(state, placed)
        assert abs(float(out.mean) - loss) <= FP32 * loss, (float(out.mean), loss)
        _, hlo = partitioned_hlo(evaluate.lower(state, placed))
        assert f"{ACTION_SCOPE}F" in hlo and f"{ACTION_SCOPE}B" not in hlo and f"{ACTION_SCOPE}W" not in hlo
        comps, _ = _parse(hlo)  # the tick loop runs the forwards' ticks (5 of the table's 15 at pp=2, M=4)
        trips = max(_trip_count(i, comps) for c in comps.values() for i in c if i.opcode == "while")
        assert trips == pipe.table(2).forwards().ticks < pipe.table(2).ticks, trips


QGZ_1F1B = {
    "stage": 3, "precision": "bf16", "quantized_comm": "weights+grads", "pipeline": zjax.Pipeline(4, schedule="1f1b")
}  # fmt: skip


@pytest.mark.slow  # fast budget: a bf16 step under 1F1B with int8 both ways, compiled once for its HLO and its step
def test_quantized_collectives_in_a_table_schedule_run_per_layer_and_compute_the_one_device_objective(want):
    """qwZ and qgZ under 1F1B at stage 3 (``zero3_gather="layer"``): inside the tick loop each layer crosses dp as
    int8 blocks both ways (its gather, and its gradient's reduce-scatter after each W), and the step's loss and
    gradient are the one-device objective's to bf16's and int8's rounding."""
    batch, loss, grads = want
    plan = zjax.Plan(zjax.make_mesh(dp=4, pp=2), **QGZ_1F1B)
    model = Decoder(FOUR)
    state = plan.init(init_fn(FOUR), SGD, jax.random.key(0), params=initial(FOUR))
    compiled, hlo = partitioned_hlo(
        plan.train_step(lambda p, b: lm_loss(model, p, b)).lower(state, plan.shard_batch(batch))
    )
    shape, pipe = dict(plan.mesh.shape), plan.pipeline
    share = pipe.microbatches / pipe.table(2).ticks  # every action's collectives, on its share of the ticks
    ops = collectives(hlo, share)
    looped = {(c.kind, c.dtype) for c in ops if c.in_loop and "dp" in spanned_axes(c.groups, shape)}
    assert ("all-gather", "s8") in looped and ("all-to-all", "s8") in looped, looped
    # the step that program runs: SGD at learning rate 1 keeps the gradient it applied (tests/_objective.py's
    # ``applied``, here on the program compiled above)
    host = lambda tree: jax.tree.map(lambda x: np.asarray(jax.device_get(x), np.float64), tree)  # noqa: E731
    weights = lambda s: s.master_params if plan.keeps_master else s.params  # noqa: E731 - the fp32 weights
    before = host(weights(state))
    state, metrics = compiled(state, plan.shard_batch(batch))
    got, after = host(state.opt_state.inner[0].trace), host(weights(state))
    for b, a, g in zip(jax.tree.leaves(before), jax.tree.leaves(after), jax.tree.leaves(got), strict=True):
        assert np.all(np.abs((b - a) - g) <= 2.0**-23 * (np.abs(b) + np.abs(a)) + 1e-30)
    assert relative(got, grads) <= 6e-2, relative(got, grads)  # bf16 and int8 both ways (bf16 alone: 1.5e-2)
    assert abs(float(metrics["loss"]) - loss) <= 3e-2 * loss
