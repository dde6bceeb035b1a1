"""Per-device memory from the compiled step equals the ZeRO formulas."""

import dataclasses

import jax
import numpy as np
import optax
import pytest

import zjax
from zjax.models import PRESETS
from zjax.planner._compile import partitioned_hlo
from zjax.planner._hlo import collectives, spanned_axes

from ._models import TINY, decoder_task, linen_mlp_task, regression_batch, token_batch
from .test_gpu_plan import _figure

MESHES = {"dp8": {"dp": 8}, "dp4_tp2": {"dp": 4, "tp": 2}}


def compiled_report(task, batch, *, stage, mesh, precision="bf16", tx=None, accum=1):
    init_fn, loss_fn = task
    plan = zjax.Plan(mesh, stage=stage, precision=precision)
    state = plan.abstract_state(init_fn, optax.adam(1e-3) if tx is None else tx, jax.random.key(0))
    step = plan.train_step(loss_fn, accum_steps=accum)
    abstract_batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    return step.memory_report(state, abstract_batch), plan


def formula(stage: int, psi: float, n: int) -> float:
    """ZeRO paper, bf16 compute + fp32 Adam (K = 12), persistent state without gradients."""
    return {0: 2 * psi + 12 * psi, 1: 2 * psi + 12 * psi / n, 2: 2 * psi + 12 * psi / n, 3: 14 * psi / n}[stage]


# psi per device after tp: the MLP's (32,128) kernel, (128,) bias and (128,32) kernel split over tp;
# the (32,) output bias stays whole.
MLP_PSI_TP = {"dp8": 32 * 128 + 128 + 128 * 32 + 32, "dp4_tp2": (32 * 128 + 128 + 128 * 32) / 2 + 32}


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_state_bytes_match_formula(stage, mesh_name):
    mesh = zjax.make_mesh(**MESHES[mesh_name])
    report, _ = compiled_report(linen_mlp_task(), regression_batch(), stage=stage, mesh=mesh)
    want = formula(stage, MLP_PSI_TP[mesh_name], mesh.shape["dp"])
    assert report.state_compiled == pytest.approx(want, rel=0.01)
    assert report.state_theory == pytest.approx(want, rel=0.01)
    # the per-category split read from the compiler's argument shardings adds up to the same total
    assert sum(report.compiled.values()) == pytest.approx(report.state_compiled, rel=0.001)


def test_decoder_state_bytes_stage3_with_tp():
    """3-D attention weights stacked over scanned layers: stage 3 holds 14 psi / (tp * dp) per device. Read from the
    figure on docs/concepts/stages.md (``zjax plan --model small --mesh dp=4,tp=2``: the compiled step's state per
    device, its parameters and optimizer state; recomputed by CI's docs/figures.py --check)."""
    text = _figure("docs/concepts/stages.md", "zjax plan --model small --mesh dp=4,tp=2 --batch-size 32 --seq-len 256")
    table = text[text.index("mesh pp=1 replica=1 dp=4 ep=1 cp=1 tp=2") :]
    [row] = [line for line in table.splitlines() if line.split("|")[0].split()[:3] == ["3", "full", "1"]]
    state = float(row.split("|")[2].split()[0]) * 1e6  # MB per device
    c = PRESETS["small"]
    assert f"small: {c.num_params:,} params" in text
    tp_split = 2 * c.vocab * c.embed + c.layers * (4 * c.embed * c.heads * c.head_dim + 3 * c.embed * c.mlp)
    whole = c.layers * 2 * c.embed + c.embed  # norm scales
    psi_tp = tp_split / 2 + whole
    assert tp_split + whole == c.num_params
    assert state == pytest.approx(14 * psi_tp / 4, rel=0.01)


def test_report_text_names_categories():
    mesh = zjax.make_mesh(dp=8)
    report, _ = compiled_report(linen_mlp_task(), regression_batch(), stage=2, mesh=mesh)
    text = str(report)
    for label in ("compute params", "fp32 master weights", "optimizer state", "gradients", "temporaries"):
        assert label in text
    d = report.to_dict()
    assert d["state_bytes_per_device"]["compiled"] == report.state_compiled
    assert d["peak_bytes"] == report.argument_bytes + report.output_bytes - report.alias_bytes + report.temp_bytes


def test_stage2_shards_the_accumulation_buffer():
    """With 4 microbatches, stage 2 accumulates into a dp-sharded fp32 buffer and reduce-scatters each layer's
    gradients inside the backward scan; stage 1 keeps a whole fp32 accumulator per rank (and reduces it once,
    after the loop). On a scanned decoder stage 2's temporaries are at least (1 - 1/N) x grads smaller."""
    cfg = dataclasses.replace(TINY, embed=128, layers=8, mlp=512, max_len=32, remat="full")
    mesh = zjax.make_mesh(dp=8)
    batch = token_batch(64, cfg)
    temps = {}
    for stage in (1, 2):
        report, _ = compiled_report(
            decoder_task(cfg), batch, stage=stage, mesh=mesh, precision="fp32", tx=optax.sgd(0.1), accum=4
        )
        temps[stage] = report.temp_bytes
        grad_bytes = report.num_params * 4
    assert temps[1] - temps[2] >= (1 - 1 / 8) * grad_bytes, temps


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1])
def test_accumulation_reduces_once_per_step_at_stages_0_and_1(stage, precision):
    """Stage 0/1 with 8 microbatches: no gradient reduction over dp inside the accumulation loop, and the
    per-step dp bytes equal those of one microbatch (ZeRO's 2 psi, not 2 psi per microbatch; in bf16 the
    fp32 accumulator is reduced in bf16, as the gradients are without accumulation)."""
    mesh = zjax.make_mesh(dp=4, tp=2)
    init_fn, loss_fn = linen_mlp_task()
    plan = zjax.Plan(mesh, stage=stage, precision=precision)
    state = plan.abstract_state(init_fn, optax.sgd(0.1), jax.random.key(0))
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), regression_batch(64))
    shape = dict(mesh.shape)
    dp_bytes, in_loop = {}, {}
    for k in (1, 8):
        _, hlo = partitioned_hlo(plan.train_step(loss_fn, accum_steps=k).lower(state, batch))
        ops = [c for c in collectives(hlo) if "dp" in spanned_axes(c.groups, shape) and c.bytes > 4]
        dp_bytes[k] = sum(c.volume * c.trips for c in ops)
        in_loop[k] = [c for c in ops if c.in_loop and c.kind in ("all-reduce", "reduce-scatter")]
    assert not in_loop[8]
    assert dp_bytes[8] == dp_bytes[1] > 0


def _collectives(stage: int, evaluate: bool = False) -> list:
    """The collectives of the train (or eval) step's HLO right after SPMD partitioning (what XLA:GPU also
    starts from)."""
    mesh = zjax.make_mesh(dp=8)
    init_fn, loss_fn = linen_mlp_task()
    plan = zjax.Plan(mesh, stage=stage, precision="fp32")
    state = plan.abstract_state(init_fn, optax.adam(1e-3), jax.random.key(0))
    # a batch that outweighs the weights: GSPMD then gathers weights, not activations (on a tiny batch
    # it rightly gathers the 4 KiB of activations instead)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), regression_batch(512))
    step = plan.eval_step(loss_fn) if evaluate else plan.train_step(loss_fn)
    _, hlo = partitioned_hlo(step.lower(state, batch))
    return collectives(hlo)


def test_stage3_all_gathers_parameters_stage0_does_not():
    """Stage 0 all-reduces the gradients (2 psi); stage 3 gathers every parameter for use and
    reduce-scatters every gradient. Bytes are counted per op, not by matching text."""
    from ._models import LinenMLP

    params = jax.eval_shape(lambda: LinenMLP().init(jax.random.key(0), np.zeros((1, 32), np.float32))["params"])
    psi_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
    ops0, ops3 = _collectives(0), _collectives(3)
    assert not [c for c in ops0 if c.kind == "all-gather"]
    assert sum(c.volume * c.trips for c in ops0 if c.kind == "all-reduce" and c.bytes > 4) == 2 * psi_bytes
    assert sum(c.volume * c.trips for c in ops3 if c.kind == "reduce-scatter") == psi_bytes  # every gradient once
    # the forward pass alone (an eval step) gathers every parameter at stage 3, none at stage 2
    eval2, eval3 = _collectives(2, evaluate=True), _collectives(3, evaluate=True)
    assert not [c for c in eval2 if c.kind == "all-gather"]
    assert sum(c.volume * c.trips for c in eval3 if c.kind == "all-gather") == psi_bytes
    assert not [c for c in ops3 if c.kind == "all-reduce" and c.bytes > 64]  # only scalars (loss, norm)


def test_no_recompilation_on_second_step(caplog):
    mesh = zjax.make_mesh(dp=4, tp=2)
    init_fn, loss_fn = linen_mlp_task()
    plan = zjax.Plan(mesh, stage=3, precision="bf16")
    state = plan.init(init_fn, optax.adamw(1e-3), jax.random.key(0))
    step = plan.train_step(loss_fn)
    batch = plan.shard_batch(regression_batch())
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        sizes = []
        for _ in range(6):
            state, metrics = step(state, batch)
            (jitted,) = step._jitted.values()
            sizes.append(jitted._cache_size())
    compiles = [r for r in caplog.records if r.getMessage().startswith("Compiling jit(<lambda>)")]
    assert len(compiles) == 1  # one trace and one executable for the whole run
    # the dispatch cache settles (jit may add one entry for the step's own outputs, which differ in
    # provenance from plan.init's, pointing at the same executable); it never grows per step
    assert sizes[2:] == [sizes[2]] * 4 and sizes[-1] <= 2
    assert np.isfinite(float(metrics["loss"]))
