"""``zjax train``: settings from a file and overrides, mistakes in one line before any compile, the optimizers."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zjax
import zjax.cli
import zjax.train
from zjax.models import Decoder

from ._models import TINY

ROOT = Path(__file__).resolve().parents[1]


def run(argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """``zjax train argv`` in this process, its runtime refused (nothing may start or compile): (status, output)."""

    def no_runtime(*args, **kwargs):
        raise AssertionError("the run started its runtime: the input should have been refused before")

    monkeypatch.setattr(zjax.train._lm, "runtime", no_runtime)
    with pytest.raises(SystemExit) as stop:
        zjax.cli.main(["train", *argv])
    out = capsys.readouterr()
    return int(stop.value.code), (out.out + out.err).strip()


def test_print_config_writes_the_settings_a_run_file_reads_back_from_any_directory(tmp_path, capsys):
    assert zjax.cli.main(["train", "--print-config"]) == 0
    text = capsys.readouterr().out
    assert "\nsteps = 100\n" in text and "[optim]" in text
    path = tmp_path / "run.toml"
    path.write_text(text)
    assert zjax.train.RunConfig.load(path).to_toml() == text
    path.write_text(text.replace("# path =", 'path = "corpus.txt"'))
    cfg = zjax.train.RunConfig.load(path)
    assert cfg.data.path == tmp_path / "corpus.txt"  # relative to the file, not the working directory
    assert dataclasses.replace(cfg, data=zjax.train.RunConfig().data) == zjax.train.RunConfig()
    moved = cfg.override(
        ["plan.stage=2", "optim.name=muon", "optim.lr=0.02", "plan.mesh=dp=4,tp=2", "optim.clip_norm="]
    )
    assert (moved.plan.stage, moved.optim.name, moved.optim.lr, moved.plan.mesh) == (2, "muon", 0.02, "dp=4,tp=2")
    assert moved.optim.clip_norm is None and moved.loop.steps == 100


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan.stgae=3"], "unknown key 'plan.stgae'; did you mean 'plan.stage'?"),
        (["plan.stage=4"], "plan.stage = 4: use one of 0, 1, 2, 3"),
        (["plan.mesh=dp=3"], "plan.mesh = 'dp=3' needs 3 devices, not the 8"),
        (["data.batch_size=30"], "data.batch_size = 30 does not split over"),
        (["data.path=missing.txt"], "missing.txt'?: no such file"),
        (["plan.mesh=dp=2,pp=4", "pipeline.microbatches=2"], "Use at least 4 microbatches"),
        (["loop.steps=many"], "loop.steps = 'many': expected int"),
        (["model.matmul=fp4"], "model.matmul = 'fp4': use one of default, fp8-current"),
        (["model.matmul=fp8-current", "plan.precision=fp16"], "with plan.precision = 'fp16': fp8 products take"),
        (["plan.mesh=dp=2,pp=4", "pipeline.table=/nowhere/t.txt"], "pipeline.table = '/nowhere/t.txt': no such file"),
        (["missing.toml"], "config file missing.toml: no such file"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_a_mistake_is_one_line_and_status_2_before_anything_starts(argv, message, monkeypatch, capsys):
    code, out = run(argv, monkeypatch, capsys)
    assert code == 2
    assert len(out.splitlines()) <= 2, out
    assert any(m in out for m in (message, message.replace("'?", "'"))), out


def test_a_pipeline_table_file_is_the_runs_schedule(tmp_path, monkeypatch, capsys):
    """``pipeline.table``: the file's schedule, named by the file, its microbatches the run's; a table that breaks
    a dependency or fits another pp is refused in one line before anything starts."""
    (tmp_path / "mine.txt").write_text("stage 0: F0 F1 B0 W0 B1 W1\nstage 1: F0 B0 F1 W0 B1 W1\n")
    cfg = zjax.train.RunConfig().override([f"pipeline.table={tmp_path / 'mine.txt'}"])
    pipe = cfg.pipeline.build(2)
    assert (pipe.name, pipe.microbatches, pipe.repeats, pipe.tabled) == ("mine", 2, 1, True)
    assert str(pipe.table(2)) == str(zjax.pipeline.read_table(tmp_path / "mine.txt"))
    code, out = run(["plan.mesh=dp=4,pp=2", f"pipeline.table={tmp_path / 'mine.txt'}", "data.batch_size=12"],
                    monkeypatch, capsys)  # fmt: skip
    assert code == 2 and "does not split over replica x dp x ep = 4 data-parallel ranks" in out, out
    assert "x 2 pipeline microbatches" in out, out
    code, out = run(["plan.mesh=dp=2,pp=4", f"pipeline.table={tmp_path / 'mine.txt'}"], monkeypatch, capsys)
    assert code == 2 and "the table 'mine' has 2 stages but the mesh has pp=4" in out, out
    (tmp_path / "bad.txt").write_text("F0 B0 W0\nF0 W0 B0\n")
    code, out = run(["plan.mesh=dp=4,pp=2", f"pipeline.table={tmp_path / 'bad.txt'}"], monkeypatch, capsys)
    assert code == 2 and "pipeline.table: " in out and "bad.txt: pipeline table, stage 1: W0 comes before B0" in out


def test_the_model_sections_matmul_reaches_the_decoder():
    from zjax.train._lm import build_model

    cfg = zjax.train.RunConfig().override(["model.matmul=fp8-current", "model.preset=tiny"])
    assert build_model(cfg, zjax.data.load_tokenizer(None)).matmul == "fp8-current"


def test_a_missing_extra_names_its_pip_command_before_anything_starts(monkeypatch, capsys, tmp_path):
    from zjax import _extras

    monkeypatch.setattr(_extras, "_found", lambda module: module != "tensorboardX")
    code, out = run(["loop.tensorboard=true"], monkeypatch, capsys)
    assert (
        code == 2 and out == 'zjax train: error: loop.tensorboard needs tensorboardX: pip install "zjax[tensorboard]"'
    )


def test_the_console_script_is_quiet_and_says_its_version():
    """No CUDA-driver probe lines from ``import zjax`` (the CUDA plugin is installed here and finds no GPU), a version,
    and a typo answered in one line."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS",)}
    imported = subprocess.run([sys.executable, "-c", "import zjax"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert imported.returncode == 0 and "cudart_stub" not in imported.stderr, imported.stderr
    bin_dir = Path(sys.executable).parent
    version = subprocess.run([bin_dir / "zjax", "--version"], capture_output=True, text=True, env=env)
    assert version.stdout.strip() == f"zjax {zjax.__version__}"
    typo = subprocess.run([bin_dir / "zjax", "train", "plan.stgae=3"], capture_output=True, text=True, env=env)
    assert typo.returncode == 2 and typo.stdout == ""
    assert typo.stderr.splitlines() == ["zjax train: error: unknown key 'plan.stgae'; did you mean 'plan.stage'?"]


def test_the_schedules_warm_up_then_decay_as_named():
    at = lambda name, **kw: [  # noqa: E731
        round(float(zjax.train.Optim(schedule=name, lr=1.0, min_lr_ratio=0.1, **kw).learning_rate(100)(i)), 4)
        for i in (0, 5, 10, 50, 80, 90, 100)
    ]
    assert at("constant") == [0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert at("linear") == [0.0, 0.5, 1.0, 0.6, 0.3, 0.2, 0.1]
    assert at("wsd", decay_fraction=0.2) == [0.0, 0.5, 1.0, 1.0, 1.0, 0.55, 0.1]
    cosine = at("cosine")
    assert (
        cosine[:3] == [0.0, 0.5, 1.0]
        and cosine[-1] == 0.1
        and cosine[3] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 40 / 90)), abs=1e-4)
    )


def test_weight_decay_spares_norms_biases_embeddings_and_the_head():
    boxed = jax.eval_shape(_init, jax.random.key(0))
    decays = zjax.train.Optim().decays(nn.unbox(boxed))
    flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(decays)[0]}
    assert not flat["['embedding']"] and not flat["['head']"] and not flat["['final_norm']['scale']"]
    assert not flat["['layers']['attn_norm']['scale']"]
    assert flat["['layers']['wq']"] and flat["['layers']['w_down']"]
    dims = zjax.train.Optim(name="muon").muon_matrices(boxed)
    assert dims["layers"]["wq"].reduction_axis == (1,) and dims["layers"]["wq"].output_axis == (2, 3)
    assert dims["layers"]["wo"].reduction_axis == (1, 2) and dims["layers"]["wo"].output_axis == (3,)
    assert dims["layers"]["w_down"].reduction_axis == (1,) and dims["embedding"] is None


def _init(rng):
    return Decoder(TINY).init(rng, jnp.zeros((1, TINY.max_len), jnp.int32))["params"]


MUON = zjax.train.Optim(name="muon", lr=0.02, schedule="constant", warmup_steps=0, weight_decay=0.0, clip_norm=None)


@pytest.mark.parametrize(
    ("stage", "mesh"),
    [
        (3, {"dp": 4, "tp": 2}),
        (1, {"dp": 8}),
        pytest.param(2, {"dp": 8}, marks=pytest.mark.slow),  # every stage once, each mesh at two
        pytest.param(0, {"dp": 4, "tp": 2}, marks=pytest.mark.slow),
    ],
)
def test_muon_on_sharded_state_updates_as_optax_muon_on_one_device(stage, mesh):
    """Given the same gradients (a loss linear in the parameters: its gradient is a fixed tree G), one step of Muon
    under a ZeRO stage moves the parameters as optax's Muon does on one device, within 1e-5: its Newton-Schulz
    iterations see whole matrices, one per layer of a stacked weight, whatever splits them."""
    boxed = jax.eval_shape(_init, jax.random.key(0))
    rs = np.random.RandomState(0)
    grads = jax.tree.map(lambda x: rs.randn(*x.shape).astype(np.float32), nn.unbox(boxed))
    tx = MUON.transformation(10, boxed)
    plain = nn.unbox(jax.tree.map(lambda x: np.zeros(x.shape, np.float32), boxed))
    want, _ = jax.jit(tx.update)(grads, tx.init(plain), plain)
    plan = zjax.Plan(zjax.make_mesh(**mesh), stage=stage, precision="fp32")
    state = plan.init(_init, tx, jax.random.key(0), params=plain)  # zeros: no weight term in the update
    step = plan.train_step(
        lambda p, b: (
            sum(jnp.sum(x * g) for x, g in zip(jax.tree.leaves(p), jax.tree.leaves(grads), strict=True)) * jnp.mean(b)
        )
    )
    state, _ = step(state, plan.shard_batch(np.ones((8, 1), np.float32)))
    for (path, got), w in zip(jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0],
                              jax.tree.leaves(want), strict=True):  # fmt: skip
        err = np.linalg.norm(np.asarray(got) - np.asarray(w)) / np.linalg.norm(w)
        assert err <= 1e-5, (jax.tree_util.keystr(path), err)


@pytest.mark.slow  # a whole training run in a subprocess (the README's main command runs in CI's docs step)
def test_zjax_train_trains_and_its_last_line_is_a_summary(tmp_path):
    cmd = [Path(sys.executable).parent / "zjax", "train", "model.preset=tiny", "model.seq_len=32", "loop.steps=6",
           "loop.log_every=3", "loop.eval_every=3", "data.batch_size=16",
           f"output.metrics_json={tmp_path / 'm.json'}"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("zjax train: step 6/6, loss ") and "eval loss" in last and "tokens/s" in last, last
    assert str(tmp_path / "m.json") in last and (tmp_path / "m.json").exists()
    assert "\r" not in proc.stdout and "cudart_stub" not in proc.stderr  # the bar is on stderr, the probe gone


@pytest.mark.slow  # a decoder step under ZeRO-3 beside the same step on one device
def test_a_whole_muon_step_at_stage_3_moves_the_weights_as_on_one_device():
    """lm_loss on uneven masks and packed rows, Muon at stage 3 over dp=8 against jax.grad and optax's Muon on one
    device: within 1e-3 (Newton-Schulz amplifies the reduction order's differences in the gradient)."""
    from zjax.models import lm_loss

    from ._objective import uneven_batch

    model, batch = Decoder(TINY), uneven_batch(32)
    boxed = jax.eval_shape(_init, jax.random.key(0))
    tx = MUON.transformation(10, boxed)
    device = jax.devices()[0]
    params = jax.device_put(nn.unbox(jax.jit(_init)(jax.random.key(0))), device)
    grads = jax.jit(jax.grad(lambda p, b: lm_loss(model, p, b).mean))(params, jax.device_put(batch, device))
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    want = optax.apply_updates(params, updates)
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=3, precision="fp32")
    state = plan.init(_init, tx, jax.random.key(0))
    state, _ = plan.train_step(lambda p, b: lm_loss(model, p, b))(state, plan.shard_batch(batch))
    moved = jax.tree.map(
        lambda a, b: np.asarray(a) - np.asarray(b), jax.device_get(state.params), jax.device_get(params)
    )
    expected = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), jax.device_get(want), jax.device_get(params))
    for got, w in zip(jax.tree.leaves(moved), jax.tree.leaves(expected), strict=True):
        assert np.linalg.norm(got - w) <= 1e-3 * np.linalg.norm(w)


@pytest.mark.slow  # a DeepSeek-shaped trainer run (the preset's pieces are tested fast in test_mla / test_routing)
def test_zjax_train_trains_the_deepseek_shaped_preset_with_its_router_biases(tmp_path):
    """MLA, a dense first layer, grouped sigmoid routing with selection biases (model state through the step, the
    eval and the checkpoints) and an MTP module, over dp=2 x ep=4 at stage 3: the loss falls."""
    cmd = [Path(sys.executable).parent / "zjax", "train", "model.preset=deepseek-small", "model.seq_len=32",
           "plan.mesh=dp=2,ep=4", "plan.stage=3", "loop.steps=8", "loop.log_every=4", "loop.eval_every=4",
           "data.batch_size=16", f"output.metrics_json={tmp_path / 'm.json'}"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = json.loads((tmp_path / "m.json").read_text())["losses"]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.3, losses


def test_muon_orthogonalises_whole_matrices_with_no_collective_inside_its_iterations():
    """Under ZeRO (stage 1, dp=8) Muon's update runs on whole matrices, each device's share of a stack's layers
    (:func:`zjax.train.whole_matrices`): the compiled step's all-gathers and all-reduces are AdamW's to the byte,
    and all Muon adds is the reshard into that layout and back: the gradients and momentum in, the momentum and
    update out, four all-to-alls of each device's eighth of the fp32 matrices.
    Left to GSPMD the Newton-Schulz products on ZeRO's shards gathered and reduced 3.8x AdamW's bytes."""
    from zjax.planner._hlo import count_collectives

    cfg = dataclasses.replace(TINY, layers=8)
    init = lambda r: Decoder(cfg).init(r, jnp.zeros((1, cfg.max_len), jnp.int32))["params"]  # noqa: E731
    boxed = jax.eval_shape(init, jax.random.key(0))
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=1, precision="fp32")
    volume = {}
    for name in ("adamw", "muon"):
        tx = dataclasses.replace(MUON, name=name).transformation(10, boxed)
        state = plan.abstract_state(init, tx, jax.random.key(0))
        step = plan.train_step(lambda p, b: zjax.models.lm_loss(Decoder(cfg), p, b))
        text = step.lower(state, jax.ShapeDtypeStruct((8, cfg.max_len + 1), jnp.int32)).compile().as_text()
        volume[name] = count_collectives(text, dict(plan.mesh.shape)).volume
    for kind in ("all-gather", "all-reduce", "reduce-scatter"):
        assert volume["muon"][kind] == volume["adamw"][kind], (kind, volume)
    weights = sum(x.size for x in jax.tree.leaves(nn.unbox(boxed))) * 4
    assert 0 < volume["muon"]["all-to-all"] - volume["adamw"]["all-to-all"] <= 4 * weights / 8, (volume, weights)
