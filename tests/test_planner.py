"""The planner: the ZeRO paper's numbers, communication counted from the partitioned HLO, the CLI."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import zjax
from zjax import planner
from zjax.planner import count_collectives, zero_bytes
from zjax.planner._fit import weigh
from zjax.planner._table import text_table

ROOT = Path(__file__).resolve().parents[1]


def test_analytic_reproduces_the_zero_paper():
    """Figure 1 of the ZeRO paper: 7.5B params, N=64, K=12: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB."""
    got = [zero_bytes(7.5e9, 64, s)["total"] / 1e9 for s in range(4)]
    assert got == pytest.approx([120.0, 31.40625, 16.640625, 1.875])
    assert [round(x, 1) for x in got] == [120.0, 31.4, 16.6, 1.9]  # as printed in the paper


HLO = """
HloModule test

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%cond (p: (s32[], f32[64])) -> pred[] {
  %p = (s32[], f32[64]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[64])) -> (s32[], f32[64]) {
  %p = (s32[], f32[64]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[64] get-tuple-element(%p), index=1
  %g = f32[64] all-gather(%x), channel_id=1, replica_groups=mesh['axis_0'=8,'axis_1'=2] {'axis_0'}, dimensions={0}
  ROOT %t = (s32[], f32[64]) tuple(%i, %g)
}

ENTRY %main (x: bf16[1024], y: f32[64]) -> f32[64] {
  %x = bf16[1024] parameter(0)
  %y = f32[64] parameter(1)
  %ar = bf16[1024] all-reduce(%x), channel_id=2, replica_groups=[1,8]<=[8], to_apply=%add
  %ds = bf16[128] dynamic-slice(%ar, %y), dynamic_slice_sizes={128}
  %ar2 = f32[64] all-reduce(%y), channel_id=3, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %w = (s32[], f32[64]) while(%ar2), condition=%cond, body=%body
  ROOT %r = f32[64] get-tuple-element(%w), index=1
}
"""


def test_count_collectives_on_handwritten_hlo():
    comm = count_collectives(HLO)
    # all-reduce feeding only a dynamic-slice = reduce-scatter: 1x its 2 KiB operand, ring 7/8
    assert comm.volume["reduce-scatter"] == 2048 and comm.wire["reduce-scatter"] == 2048 * 7 // 8
    # a plain all-reduce of 256 B over groups of 4 moves 2x, ring 3/4
    assert comm.volume["all-reduce"] == 512 and comm.wire["all-reduce"] == 384
    # an all-gather in a while loop of 5 trips, group of 8 along axis_0
    assert comm.count["all-gather"] == 5 and comm.volume["all-gather"] == 5 * 256
    assert comm.wire["all-gather"] == 5 * 224


@pytest.fixture(scope="module")
def small_estimate():
    return planner.estimate("small", mesh={"dp": 8}, batch_size=16, seq_len=32)


def test_communication_matches_zero(small_estimate):
    """Stages 0-2 move 2 psi per step, stage 3 3 psi (ZeRO counting, compute-dtype bytes)."""
    got = {row.stage: row.comm_psi for row in small_estimate.rows}
    for stage in (0, 1, 2):
        assert got[stage] == pytest.approx(2.0, rel=0.05)
    assert got[3] == pytest.approx(3.0, rel=0.05)
    kinds = {row.stage: row.comm for row in small_estimate.rows}
    assert kinds[0].volume["all-reduce"] > 0 and kinds[0].volume["all-gather"] == 0
    assert kinds[1].volume["reduce-scatter"] > 0  # stage 1 reduce-scatters too (ZeRO's 2 psi)
    for row in small_estimate.rows:
        assert row.comm.total_wire == pytest.approx(row.comm.total_volume * 7 / 8, rel=0.01)


def test_compiled_state_matches_theory(small_estimate):
    for row in small_estimate.rows:
        theory_state = row.theory["params"] + row.theory["optimizer"]
        assert row.compiled["state"] == pytest.approx(theory_state, rel=0.01)
    d = small_estimate.to_dict()
    assert set(d) >= {"model", "params", "mesh", "rows"}
    assert set(d["rows"][0]) >= {"stage", "remat", "theory", "compiled", "comm_bytes", "compile_seconds"}
    assert set(d["rows"][0]["theory"]) >= {"params", "optimizer", "grads", "total"}
    assert set(d["rows"][0]["compiled"]) == {"state", "temp", "total", "host"}
    assert d["backend"] == "cpu" and all(r["backend"] == "cpu" and r["compiled"]["host"] == 0 for r in d["rows"])


def test_mesh_larger_than_devices_is_a_clear_error():
    with pytest.raises(ValueError, match=r"needs 64 devices but this process has 8.*simulate_cpu_devices\(64\)"):
        planner.estimate("tiny", mesh={"dp": 64})
    with pytest.raises(ValueError, match="unknown model 'gpt5': not a preset"):
        planner.estimate("gpt5", mesh={"dp": 8})


def test_the_budget_weighs_what_stage_3_exposes_on_the_wire():
    """Quantizations allowed at stage 3: the search compiles each and takes the one exposing the fewest bytes
    (XLA:CPU's collectives are synchronous, so every byte is exposed and int8 weights beat bf16); at a tie, the
    first listed; a quantization the plan refuses is listed with its reason, never dropped."""
    import dataclasses

    common = dict(mesh={"dp": 8}, stages=(3,), remats=("full",), accums=(1,), batch_size=16, offloads=("none",))
    fit = planner.fit(1e12, "tiny", quantized=(None, "weights"), **common)
    assert [e.rows[0].wire for e in fit.tried] == ["bf16/bf16", "int8/bf16"]
    exact, int8 = (e.rows[0] for e in fit.tried)
    assert int8.comm.exposed_volume < exact.comm.exposed_volume and fit.row is int8
    same = dataclasses.replace(int8, comm=exact.comm)  # equal exposure: the order given decides
    assert weigh([exact, same]) is exact and weigh([same, exact]) is same
    with pytest.raises(ValueError, match="no candidate can run: .*quantized_comm='grads' at stage 3 .*offload"):
        planner.fit(1e12, "tiny", **{**common, "offloads": ("optimizer",)}, quantized=("grads",))


def zjax_plan(*flags: str, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "zjax.cli", "plan", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.slow  # two compiles; the planner's rows without the copy are read from a docs figure in the fast suite
def test_the_budget_search_plans_stage_3_without_the_compute_copy():
    """``fit(..., compute_copy=False)``: the fp32 weights alone, 2 bytes per parameter per rank less state."""
    common = dict(mesh={"dp": 8}, stages=(3,), remats=("full",), accums=(1,), batch_size=16, offloads=("none",))
    exact, lean = (planner.fit(1e12, "tiny", compute_copy=c, **common) for c in (True, False))
    assert exact.row.compute_copy and not lean.row.compute_copy
    assert exact.row.compiled["state"] - lean.row.compiled["state"] == 2 * exact.tried[0].params // 8


@pytest.mark.slow  # a CLI run with four compiles; the CLI's argument errors run in the fast suite
def test_cli_budget_picks_a_config_that_fits(tmp_path):
    out = tmp_path / "fit.json"
    # stage 0 without remat needs ~6.8 MB here; the search moves on to the next-cheapest, stage 0 + full remat
    args = ["--model", "tiny", "--mesh", "dp=8", "--stages", "0,3", "--remat", "none,full", "--batch-size", "16"]
    proc = zjax_plan(*args, "--budget", "5MB", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["fits"]["compiled"]["total"] <= 5e6
    assert (data["fits"]["stage"], data["fits"]["remat"]) == (0, "full")
    assert data["rows"][0]["compiled"]["total"] > 5e6  # the cheaper candidate tried first did not fit
    assert "budget: 0.01 GB usable = the given size - 0.00 GB reserved" in proc.stdout
    assert "fits: stage 0, remat full" in proc.stdout


@pytest.mark.slow  # three compiles; the GPU target's offload test runs in the fast suite
def test_cli_budget_offloads_only_when_nothing_else_fits(tmp_path):
    out = tmp_path / "offload.json"
    args = ["--model", "tiny", "--mesh", "dp=8", "--stages", "3", "--remat", "full", "--batch-size", "16"]
    proc = zjax_plan(*args, "--budget", "1.9MB", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    first, fit = data["rows"][0], data["fits"]
    assert first["offload"]["name"] == "none" and first["compiled"]["total"] > 1.9e6  # tried first, too big
    assert fit["offload"]["name"] == "optimizer" and fit["compiled"]["total"] <= 1.9e6
    # the master weights and Adam moments per device (12 bytes per parameter / dp) leave the device
    off = fit["offload"]["host_bytes_per_device"]
    assert off == pytest.approx(fit["theory"]["optimizer"], rel=0.01)
    assert fit["offload"]["pcie_to_device_bytes_per_step"] == off
    assert fit["compiled"]["total"] == pytest.approx(first["compiled"]["total"] - off, rel=0.01)
    assert "offload optimizer" in proc.stdout


@pytest.mark.slow
def test_cli_impossible_budget_shows_closest(tmp_path):
    out = tmp_path / "none.json"
    args = ["--model", "tiny", "--mesh", "dp=8", "--stages", "3", "--remat", "full", "--batch-size", "16"]
    # --budget with --offload none tries every offload; each candidate at stage 3 once per --quantize-comm value
    flags = ["--accum", "1", "--offload", "none", "--quantize-comm", "none,weights"]
    proc = zjax_plan(*args, *flags, "--budget", "1KB", "--json", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "nothing fits in 0.000 GB per device; closest: stage 3" in proc.stdout
    data = json.loads(out.read_text())
    assert data["fits"] is None and data["closest"]["stage"] == 3
    assert [(r["offload"]["name"], r["wire_dtypes"]) for r in data["rows"]] == [
        (offload, wire) for offload in ("none", "optimizer", "optimizer+params") for wire in ("bf16/bf16", "int8/bf16")
    ]


def test_cli_errors():
    proc = zjax_plan("--model", "gpt5")
    assert proc.returncode == 2 and "unknown model 'gpt5'" in proc.stderr
    proc = zjax_plan("--mesh", "dp=8", "--model", "tiny", "--batch-size", "12")
    assert proc.returncode == 2 and "not divisible by mesh axis 'dp' of size 8" in proc.stderr
    proc = zjax_plan("--model", "tiny", "--mesh", "dp=8,zp=2")
    assert proc.returncode == 2 and "expected entries like dp=64,tp=2" in proc.stderr
    proc = zjax_plan("--mesh", "dp=8")  # no silent default model: a plan names what it plans
    assert proc.returncode == 2 and "the following arguments are required: --model" in proc.stderr
    proc = zjax_plan("--model", "tiny", "--mesh", "dp=8", "--timeline")  # a roofline walk needs a GPU's schedule
    assert proc.returncode == 2 and "--timeline walks a GPU's schedule: give --target" in proc.stderr
    proc = zjax_plan("--model", "tiny", "--mesh", "dp=8", "--matmul", "fp4")
    assert proc.returncode == 2 and "--matmul: invalid choice: 'fp4' (choose from 'default'" in proc.stderr
    proc = zjax_plan("--model", "tiny", "--mesh", "dp=8", "--optimizer", "nadam")
    assert proc.returncode == 2 and "--optimizer nadam: one of adamw, fused_adamw, lion, adafactor, muon" in proc.stderr


@pytest.mark.slow  # two compiles; the fast suite checks --optimizer's argument (test_cli_errors)
def test_the_plan_holds_the_named_optimizers_state():
    """``zjax plan --optimizer``: the plan's state is the named optimizer's, made from the parameters' shapes.
    AdamW keeps two fp32 moments beside the fp32 master (12 bytes a parameter); Muon one for each matrix it
    orthogonalises (8) and AdamW's two for the embedding, the head and the norms (its parameter rule needs their
    names), in the theory and in the compiled state alike."""
    import math

    import flax.linen as nn
    import jax
    from optax.contrib import MuonDimensionNumbers

    from zjax.models import PRESETS, Decoder, train_functions
    from zjax.train import Optim

    theory, compiled = {}, {}
    for name in ("adamw", "muon"):
        tx = lambda params, name=name: Optim(name=name).transformation(1000, params)  # noqa: E731
        row = zjax.planner.estimate("tiny", mesh={"dp": 8}, stages=(1,), tx=tx).rows[0]
        theory[name], compiled[name] = row.theory["optimizer"], row.compiled["state"]  # master and moments
    init_fn, _ = train_functions(Decoder(PRESETS["tiny"]), PRESETS["tiny"].max_len)
    shapes = jax.eval_shape(init_fn, jax.random.key(0))
    matrix = lambda x: x is None or isinstance(x, MuonDimensionNumbers)  # noqa: E731
    dims = jax.tree.leaves(Optim(name="muon").muon_matrices(shapes), is_leaf=matrix)
    sizes = [math.prod(leaf.shape) for leaf in jax.tree.leaves(nn.unbox(shapes))]
    assert len(dims) == len(sizes) and any(d is None for d in dims) and any(d is not None for d in dims)
    want = sum(n * (12 if d is None else 8) for n, d in zip(sizes, dims, strict=True)) / 8
    assert theory["muon"] == pytest.approx(want, abs=8), (theory, want)
    assert theory["adamw"] == pytest.approx(12 * sum(sizes) / 8, abs=8) and compiled["muon"] < compiled["adamw"]


@pytest.mark.slow  # three compiles in a subprocess; the argument error below runs in the fast suite
def test_cli_plans_quantized_comm_side_by_side(tmp_path):
    """``--quantize-comm none,weights+grads``: the first value plans every stage, the next ones stage 3 only
    (the only rows they change), each row naming what crossed dp and its bytes."""
    out = tmp_path / "q.json"
    proc = zjax_plan(
        "--model", "tiny", "--mesh", "dp=8", "--stages", "2,3", "--quantize-comm", "none,weights+grads",
        "--json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["stage"], r["wire_dtypes"]) for r in rows] == [(2, "bf16"), (3, "bf16/bf16"), (3, "int8/int8")]
    assert "wire dtype" in proc.stdout and "int8/int8" in proc.stdout
    plain, quantized = (sum(r["comm_bytes"].values()) for r in rows[1:])
    assert quantized <= 0.56 * plain, (quantized, plain)


def test_cli_refuses_an_unknown_quantization():
    proc = zjax_plan("--model", "tiny", "--mesh", "dp=8", "--quantize-comm", "none,int4")
    assert proc.returncode == 2
    assert "--quantize-comm none,int4: give none, weights, grads or weights+grads" in proc.stderr
    proc = zjax_plan("--model", "tiny", "--mesh", "dp=8", "--compute-copy", "keep,drop", "--budget", "1GB")
    assert proc.returncode == 2 and "--compute-copy keep,drop: keep or drop" in proc.stderr


COND_HLO = """
HloModule c

%small (p: f32[16]) -> f32[16] {
  %p = f32[16] parameter(0)
  ROOT %g = f32[16] all-reduce(%p), channel_id=1, replica_groups=[1,8]<=[8], to_apply=%add
}

%big (p: f32[16]) -> f32[16] {
  %p = f32[16] parameter(0)
  %q = f8e4m3fn[1024] all-gather(%p), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}
  %r = s4[1024] all-gather(%p), channel_id=3, replica_groups=[1,8]<=[8], dimensions={0}
  ROOT %o = f32[16] bitcast(%q)
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (i: s32[], x: f32[16]) -> f32[16] {
  %i = s32[] parameter(0)
  %x = f32[16] parameter(1)
  ROOT %c = f32[16] conditional(%i, %x, %x), branch_computations={%small, %big}
}
"""


def test_a_conditional_counts_its_larger_branch_and_narrow_dtypes_have_bytes():
    comm = count_collectives(COND_HLO)
    assert comm.volume["all-reduce"] == 0  # the smaller branch is not counted on top
    assert comm.volume["all-gather"] == 1024 + 512  # fp8: 1 byte, int4: half a byte per element


@pytest.mark.slow  # a decoder compile; tests/test_hf.py reads Hugging Face configs in the fast suite
def test_plans_a_hugging_face_config(tmp_path):
    cfg = zjax.models.DecoderConfig(vocab=96, embed=64, layers=2, heads=4, head_dim=16, mlp=128, max_len=32, kv_heads=1)
    (tmp_path / "config.json").write_text(json.dumps(zjax.models.config_to_hf(cfg)))
    est = zjax.planner.estimate(tmp_path, mesh={"dp": 8}, stages=(3,), batch_size=8, seq_len=16)
    # grouped-query attention: k and v are embed x 1 x 16 per layer, not embed x 4 x 16
    assert est.params == cfg.num_params == 2 * 96 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 16 + 3 * 64 * 128 + 2 * 64) + 64
    (row,) = est.rows
    # the compiled state (params + optimizer) is the formula's for this parameter count
    want = row.theory["params"] + row.theory["optimizer"]
    assert row.compiled["state"] == pytest.approx(want, rel=0.01)
    with pytest.raises(ValueError, match="not a preset"):
        zjax.planner.estimate(tmp_path / "nothing", mesh={"dp": 8})


def _row(scale: float, **kw) -> planner.Row:
    comm = planner.Communication(
        volume={"all-gather": int(1.9e12 * scale)}, wire={"all-gather": int(1.8e12 * scale)}, count={"all-gather": 1}
    )
    theory = {"params": int(3.0e12 * scale), "optimizer": int(1.84e12 * scale), "grads": int(1.96e12 * scale)}
    theory["total"] = sum(theory.values())
    compiled = {"state": int(4.8e12 * scale), "temp": int(1.16e11 * scale), "total": int(4.9e12 * scale), "host": 0}
    return planner.Row(3, "full", 1, theory, compiled, comm, 2.98, 1234.5, **kw)


@pytest.mark.parametrize("gpu", [False, True])
def test_plan_table_columns_never_run_together(gpu):
    """A 1T-class plan printed ``3.001,840.0241,967.346*``: every cell is now its own whitespace-separated field."""
    kw = {"backend": "gpu", "device_kind": "H100"} if gpu else {}
    rows = tuple(_row(s, device_memory=int(8e10) if gpu else None, **kw) for s in (1.0, 1e-6))  # TB beside KB
    est = planner.Estimate("huge", 10**12, {"replica": 4, "dp": 512, "tp": 8}, "bf16", 2048, rows, **kw)
    lines = str(est).splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("stage"))
    table = lines[header:]
    fields = [line.replace("x psi", "x-psi").split() for line in table]
    assert len({len(f) for f in fields}) == 1, table  # header and both rows: the same number of fields
    big = dict(zip(fields[0], fields[1], strict=True))
    assert big["total"] == f"{4.9e12 / 1e9:,.3f}" and big["comm"] == f"{1.9e12 / 1e9:,.3f}"
    if gpu:
        assert big["exposed"] == f"{1.9e12 / 1e9:,.3f}*"  # over the scheduler's memory: marked, apart
    with pytest.raises(ValueError, match="row 0 has 1 cells for 2 columns"):
        text_table([("a", "<"), ("b", ">")], [["x"]])


def test_budget_search_lists_candidates_that_cannot_run():
    """An accumulation that does not divide the global batch is listed with the reason, never dropped silently."""
    row, closest, tried, skipped = planner.fit(
        1.0, "tiny", mesh={"dp": 8}, stages=(3,), remats=("full",), accums=(1, 2), batch_size=8, offloads=("none",)
    )
    assert row is None and [e.rows[0].accum for e in tried] == [1] and closest.accum == 1
    [(candidate, reason)] = skipped
    assert (candidate.stage, candidate.accum, candidate.offload) == (3, 2, "none")
    assert "global batch 8 does not split into 2 microbatch(es)" in reason and "--batch-size 16" in reason
    [line] = planner.describe_skipped(skipped)
    assert line.startswith("stage 3 x remat full x 2 microbatch(es) x offload none (1): global batch 8")
    with pytest.raises(ValueError, match=r"no candidate can run: global batch 8 does not split into 4"):
        planner.fit(1.0, "tiny", mesh={"dp": 8}, stages=(3,), remats=("full",), accums=(4,), batch_size=8)


# the async forms as XLA:GPU (jaxlib 0.10.2) schedules them for 8 H100s (the types as a deviceless compile of an
# all_to_all and a ppermute in shard_map printed them; names and attributes shortened): each start's type holds
# the operand beside the result
GPU_ASYNC_HLO = """
HloModule gpu_async, num_partitions=8

ENTRY %main (x: bf16[64,256], y: f32[32,128]) -> (bf16[64,256], f32[32,128]) {
  %x = bf16[64,256]{1,0} parameter(0)
  %y = f32[32,128]{1,0} parameter(1)
  %a2a = ((bf16[64,256]{1,0}), bf16[64,256]{1,0}) all-to-all-start(%x), replica_groups=[1,8]<=[8], dimensions={0}
  %a2a-done = bf16[64,256]{1,0} all-to-all-done(%a2a)
  %cp = (f32[32,128]{1,0}, f32[32,128]{1,0}) collective-permute-start(%y), source_target_pairs={{0,1},{1,0}}
  %cp-done = f32[32,128]{1,0} collective-permute-done(%cp)
  %ag = ((bf16[8,256]{1,0}), bf16[64,256]{1,0}) all-gather-start(%x), replica_groups=[1,8]<=[8], dimensions={0}
  %ag-done = bf16[64,256]{1,0} all-gather-done(%ag)
  %ar = (f32[32,128]{1,0}, bf16[64,256]{1,0}) all-reduce-start(%y, %x), replica_groups=[1,8]<=[8], to_apply=%add
  %ar-done = (f32[32,128]{1,0}, bf16[64,256]{1,0}) all-reduce-done(%ar)
  ROOT %t = (bf16[64,256]{1,0}, f32[32,128]{1,0}) tuple(%a2a-done, %cp-done)
}
"""


def test_async_starts_count_their_payload_once():
    """An async all-to-all or collective-permute start carries its operand beside its result in its type: the
    payload is the result (32 KiB and 16 KiB here), not their sum; an all-reduce start's tuple is all results."""
    comm = count_collectives(GPU_ASYNC_HLO)
    assert comm.volume["all-to-all"] == 64 * 256 * 2 and comm.wire["all-to-all"] == 64 * 256 * 2 * 7 // 8
    assert comm.volume["collective-permute"] == 32 * 128 * 4 and comm.wire["collective-permute"] == 32 * 128 * 4
    assert comm.volume["all-gather"] == 64 * 256 * 2  # the gathered result
    assert comm.volume["all-reduce"] == 2 * (32 * 128 * 4 + 64 * 256 * 2)  # a combined all-reduce: both results


# a ragged all-to-all as XLA:GPU (jaxlib 0.10.2) schedules zjax's expert dispatch over ep=4 (a deviceless H100
# compile; names shortened): 512 rows sent into a 2,048-row buffer, then the buffer's rows sent back into 512
_OFFSETS = "s64[4]{0}, s64[4]{0}, s64[4]{0}, /*index=5*/s64[4]{0}"
_GROUPS = "replica_groups={{0,1,2,3},{4,5,6,7}}"
GPU_RAGGED_HLO = f"""
HloModule gpu_ragged, num_partitions=8

ENTRY %main (x: bf16[512,128], y: bf16[2048,128], o: s64[4]) -> (bf16[2048,128], bf16[512,128]) {{
  %x = bf16[512,128]{{1,0}} parameter(0)
  %y = bf16[2048,128]{{1,0}} parameter(1)
  %o = s64[4]{{0}} parameter(2)
  %go = ((bf16[512,128]{{1,0}}, bf16[2048,128]{{1,0}}, {_OFFSETS}), bf16[2048,128]{{1,0}}) \
ragged-all-to-all-start(%x, %y, %o, %o, %o, /*index=5*/%o), {_GROUPS}
  %go-done = bf16[2048,128]{{1,0}} ragged-all-to-all-done(%go)
  %back = ((bf16[2048,128]{{1,0}}, bf16[512,128]{{1,0}}, {_OFFSETS}), bf16[512,128]{{1,0}}) \
ragged-all-to-all-start(%go-done, %x, %o, %o, %o, /*index=5*/%o), {_GROUPS}
  %back-done = bf16[512,128]{{1,0}} ragged-all-to-all-done(%back)
  ROOT %t = (bf16[2048,128]{{1,0}}, bf16[512,128]{{1,0}}) tuple(%go-done, %back-done)
}}
"""


def test_a_ragged_all_to_all_counts_the_rows_it_can_send_once():
    """Each way at most a rank's 512 rows cross (the receiving buffer holds ep x 512 for the worst case): counted
    neither as the buffer nor as operand + buffer; with balanced routing 3/4 of them leave the device."""
    comm = count_collectives(GPU_RAGGED_HLO)
    rows = 512 * 128 * 2
    assert comm.count["ragged-all-to-all"] == 2
    assert comm.volume["ragged-all-to-all"] == 2 * rows and comm.wire["ragged-all-to-all"] == 2 * rows * 3 // 4


_CACHED_TWICE = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import zjax
from zjax.planner import partitioned_hlo
zjax.simulate_cpu_devices(8)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
x = jax.device_put(jnp.ones((64, 256)), NamedSharding(Mesh(np.array(jax.devices()), ("dp",)), P("dp")))
compiled, text = partitioned_hlo(jax.jit(lambda v: (v * 2).sum()).lower(x))
assert "all-reduce" in text and float(compiled(x)) == 32768.0
"""


def test_the_partitioned_module_is_read_with_a_persistent_compilation_cache(tmp_path):
    """With ``jax_compilation_cache_dir`` set, a second process would be served the program from the cache, not
    compile it, and XLA would dump no partitioned module: the planner's compiles bypass the cache."""
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache")}
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", _CACHED_TWICE], env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
