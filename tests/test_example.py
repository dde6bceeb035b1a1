"""The example trains end to end and writes its metrics; same seed and flags give the same losses."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from .test_train_example import recorded

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--preset", "tiny", "--steps", "4", "--seq-len", "32", "--batch-size", "16", "--no-progress"]


def run_example(tmp_path: Path, name: str, *flags: str) -> dict:
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, str(ROOT / "examples" / "train_lm.py"), *SMALL, *flags, "--metrics-json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "memory per device: ZeRO stage" in proc.stdout
    return json.loads(out.read_text())


@pytest.mark.slow  # three runs of the script (its determinism: the recorded losses of test_train_example.py)
def test_metrics_schema_offload_and_a_compilation_cache_that_serves_a_restarted_run(tmp_path):
    """The metrics file's schema; ``--compilation-cache DIR``: the first run writes its compiled programs there, a
    second run of the same job finds every one of them (it adds no entry) and trains to the same losses; with the
    optimizer and the parameters offloaded the run trains to the same bits."""
    cache = tmp_path / "xla_cache"
    flags = ("--stage", "3", "--mesh", "dp=8", "--seed", "1")
    a = run_example(tmp_path, "a", *flags, "--compilation-cache", str(cache))
    assert a["stage"] == 3 and a["mesh"] == {"replica": 1, "dp": 8, "ep": 1, "cp": 1, "tp": 1, "pp": 1}
    assert len(a["losses"]) == 4 and all(isinstance(x, float) for x in a["losses"])
    assert set(a["state_bytes_per_device"]) == {"theory", "compiled"}
    assert a["state_bytes_per_device"]["compiled"] == pytest.approx(a["state_bytes_per_device"]["theory"], rel=0.01)
    assert isinstance(a["temp_bytes_per_device"], int) and a["temp_bytes_per_device"] > 0
    entries = sorted(p.name for p in cache.iterdir())
    assert entries
    second = run_example(tmp_path, "second", *flags, "--compilation-cache", str(cache))
    assert sorted(p.name for p in cache.iterdir()) == entries
    assert second["losses"] == a["losses"]
    c = run_example(tmp_path, "c", *flags, "--offload", "optimizer+params")
    assert c["offload"] == "optimizer+params" and a["offload"] == "none"
    assert c["losses"] == a["losses"]  # every parameter of the small preset fits in one chunk: the same bits


@pytest.mark.slow
def test_joins_a_slurm_job_it_did_not_launch(tmp_path):
    """Two processes started as srun would start them (SLURM_* variables, no --processes): the example
    detects the job, joins it, and trains on a dp=8 mesh over both processes."""
    import os

    from zjax.distributed import free_port

    from ._procs import run_workers

    port = str(free_port())
    out = tmp_path / "slurm.json"
    cmd = [sys.executable, str(ROOT / "examples" / "train_lm.py"), *SMALL, "--stage", "3", "--mesh", "dp=8"]
    envs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "ZJAX_", "OMPI_"))}
        env |= {
            "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "localhost", "SLURM_NODEID": "0", "SLURM_NTASKS": "2",
            "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_STEP_TASKS_PER_NODE": "2",
            "ZJAX_COORDINATOR_PORT": port,
        }  # fmt: skip
        envs.append(env)
    runs = run_workers([[*cmd, "--metrics-json", str(out)]] * 2, timeout=300, envs=envs)
    for rank, (rc, text) in enumerate(runs):
        assert rc == 0, text[-3000:]
        assert f"joined a 2-process job (slurm) as process {rank}" in text, text[-3000:]
    m = json.loads(out.read_text())
    assert m["processes"] == 2 and m["mesh"]["dp"] == 8 and len(m["losses"]) == 4


def test_bad_mesh_flag(tmp_path):
    cmd = [sys.executable, str(ROOT / "examples" / "train_lm.py"), "--mesh", "dp=4,xp=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "expected entries like dp=4,tp=2" in proc.stderr


@pytest.mark.slow  # two runs of the script end to end
def test_continues_a_hugging_face_checkpoint(tmp_path):
    from ._hf_models import flax_model, read_checkpoint, torch_layout, write_checkpoint

    _, cfg, params = flax_model("llama", num_hidden_layers=2)
    tensors = torch_layout(params)
    tensors["lm_head.weight"][:] = 0  # zero logits: the first loss is log(vocab) exactly, unlike a fresh init's
    ckpt = write_checkpoint(str(tmp_path / "ckpt"), {**cfg.to_dict(), "model_type": "llama"}, tensors)
    a = run_example(
        tmp_path, "a", "--hf", ckpt, "--stage", "3", "--mesh", "dp=4,tp=2", "--save-hf", str(tmp_path / "a")
    )
    b = run_example(tmp_path, "b", "--hf", ckpt, "--stage", "1", "--mesh", "dp=4,pp=2", "--precision", "fp32")
    assert a["hf"] == ckpt and a["num_params"] == sum(x.size for x in read_checkpoint(ckpt).values())
    # both start from the checkpoint's weights
    assert a["losses"][0] == pytest.approx(math.log(96), rel=1e-6)
    assert b["losses"][0] == pytest.approx(math.log(96), rel=1e-6)
    trained, start = read_checkpoint(str(tmp_path / "a")), read_checkpoint(ckpt)
    assert sorted(trained) == sorted(start)
    assert any(not np.allclose(trained[k].astype(np.float32), start[k], atol=1e-6) for k in start)


@pytest.mark.slow  # 2 processes x 4 devices and 1 x 8, end to end
def test_hugging_face_checkpoint_in_two_processes(tmp_path):
    from ._hf_models import flax_model, read_checkpoint, torch_layout, write_checkpoint

    _, cfg, params = flax_model("llama", num_hidden_layers=2)
    ckpt = write_checkpoint(str(tmp_path / "ckpt"), {**cfg.to_dict(), "model_type": "llama"}, torch_layout(params))
    flags = ["--hf", ckpt, "--stage", "3", "--mesh", "dp=8", "--precision", "fp32"]
    out = tmp_path / "two.json"
    cmd = [sys.executable, str(ROOT / "examples" / "train_lm.py"), *SMALL, *flags, "--processes", "2"]
    cmd += ["--save-hf", str(tmp_path / "two"), "--metrics-json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    two = json.loads(out.read_text())
    one = run_example(tmp_path, "one", *flags, "--save-hf", str(tmp_path / "one"))
    assert two["processes"] == 2
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)
    a, b = read_checkpoint(str(tmp_path / "two")), read_checkpoint(str(tmp_path / "one"))
    assert sorted(a) == sorted(b) == sorted(read_checkpoint(ckpt))
    for name in a:  # each process loaded its own slices; process 0 wrote tensors gathered from both
        np.testing.assert_allclose(a[name].astype(np.float32), b[name].astype(np.float32), atol=1e-2, err_msg=name)


@pytest.mark.slow  # the script end to end; zjax.data and zjax.metrics are tested in-process in test_data.py
def test_logs_evaluates_and_profiles(tmp_path):
    logs = tmp_path / "logs"
    flags = ["--eval-every", "2", "--log-every", "2", "--log-dir", str(logs), "--tensorboard", "--profile-steps", "1:3"]
    m = run_example(tmp_path, "m", "--stage", "2", *flags)
    records = [json.loads(x) for x in (logs / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]  # every --log-every steps: one host sync each
    keys = {"loss", "eval_loss", "grad_norm", "learning_rate", "loss_scale", "skipped", "step_time"}
    assert all(keys | {"tokens_per_second", "mfu"} <= set(r) for r in records)
    assert all(r["mfu"] is None for r in records)  # a CPU has no peak FLOPs: never a made-up number
    assert records[-1]["loss"] == pytest.approx(m["losses"][-1]) and m["eval_loss"] == records[-1]["eval_loss"]
    assert list((logs / "tensorboard").glob("events.out.tfevents.*"))
    assert list((logs / "profile").rglob("*.xplane.pb"))


@pytest.mark.slow  # five runs of the script end to end
def test_resume_on_another_mesh_and_process_count_sees_the_same_batches(tmp_path):
    """Stopped at step 3 and resumed on dp=4 x tp=2, and stopped in 2 processes and resumed in 1: the
    same batches and losses as the straight run (fp32). The stopped run and the resumed one in 1 process are
    tests/train_loop_baseline.json's recorded commands (stage3_fp32_stop_at_3, stage3_fp32_resumed): their losses
    are the recorded ones (within 1%, test_train_example.py's tolerance across CPUs)."""
    flags = ["--precision", "fp32", "--stage", "3", "--steps", "6", "--save-every", "3"]
    straight = run_example(tmp_path, "straight", *flags)
    ckpt = str(tmp_path / "ckpt")
    first = run_example(tmp_path, "first", *flags, "--stop-at", "3", "--checkpoint-dir", ckpt)
    recorded(first["losses"], "stage3_fp32_stop_at_3")
    resumed = run_example(tmp_path, "resumed", *flags, "--mesh", "dp=4,tp=2", "--checkpoint-dir", ckpt, "--resume")
    np.testing.assert_allclose(resumed["losses"], straight["losses"][3:], rtol=1e-5)
    # 2 processes x 4 devices read disjoint rows of the same global batches: the same losses as 1 x 8; their
    # checkpoint (with each process's data position) resumes in 1 process on the batches the straight run saw
    out, ckpt2 = tmp_path / "two.json", str(tmp_path / "ckpt2")
    cmd = [sys.executable, str(ROOT / "examples" / "train_lm.py"), *SMALL, *flags, "--processes", "2"]
    cmd += ["--stop-at", "3", "--checkpoint-dir", ckpt2, "--metrics-json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    np.testing.assert_allclose(json.loads(out.read_text())["losses"], straight["losses"][:3], rtol=1e-5)
    alone = run_example(tmp_path, "alone", *flags, "--checkpoint-dir", ckpt2, "--resume")
    np.testing.assert_allclose(alone["losses"], straight["losses"][3:], rtol=1e-5)
    assert alone["resumed_from"] == 3
    recorded(alone["losses"], "stage3_fp32_resumed")


def test_evaluation_does_not_change_the_training_rows():
    """The held-out split is set by data.eval_fraction alone: turning loop.eval_every on trains on the same rows."""
    import zjax
    from zjax.models import PRESETS
    from zjax.train._lm import build_data

    tok = zjax.data.load_tokenizer(None)
    runs = {}
    base = zjax.train.RunConfig().override(["model.seq_len=32", "data.batch_size=16"])
    for flags in ([], ["loop.eval_every=5"]):
        runs[bool(flags)] = build_data(base.override(flags), PRESETS["tiny"], tok, log=lambda *a: None)
    (plain, none), (evaluated, held) = runs[False], runs[True]
    assert none is None and held is not None and held.num_rows > 0
    assert plain.num_rows == evaluated.num_rows
    for step in (0, 7):
        for key, value in plain.batch(step).items():
            np.testing.assert_array_equal(value, evaluated.batch(step)[key], err_msg=key)


@pytest.mark.slow  # two runs of the script; the numerics of every cp layout are tested in-process (test_context)
def test_context_parallel_runs_print_the_dp_runs_losses(tmp_path):
    """fp32, packed rows: --mesh dp=2,tp=2,cp=2 (sequence parallel) trains to dp=8's losses."""
    flags = ("--precision", "fp32", "--seed", "1")
    want = run_example(tmp_path, "dp", "--mesh", "dp=8", *flags)["losses"]
    for name, mesh in (("tpcp", "dp=2,tp=2,cp=2"),):
        got = run_example(tmp_path, name, "--mesh", mesh, *flags)
        assert got["mesh"]["cp"] == int(mesh[-1])
        np.testing.assert_allclose(got["losses"], want, atol=1e-5)
