"""Two processes x 4 CPU devices on 127.0.0.1 (gloo): the same numbers as one process x 8, and failures that end.

All slow: each job starts two Python processes that initialize JAX and compile.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import zjax
from zjax.distributed import free_port

from ._models import MP_CONFIGS as CONFIGS
from ._models import MP_ROWS as ROWS
from ._models import MP_STEPS as STEPS
from ._models import MP_TX as TX
from ._models import linen_mlp_task, regression_batch
from ._procs import run_workers

ROOT = Path(__file__).resolve().parents[1]
HEARTBEAT, SHUTDOWN = 5, 5

pytestmark = pytest.mark.slow


def _envs() -> list[dict[str, str]]:
    env = {
        **os.environ,
        "ZJAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}",
        "ZJAX_NUM_PROCESSES": "2",
        "ZJAX_CPU_DEVICES": "4",
        "ZJAX_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT),
        "ZJAX_SHUTDOWN_TIMEOUT_S": str(SHUTDOWN),
        "ZJAX_INIT_TIMEOUT_S": "60",
        "PYTHONUNBUFFERED": "1",
    }
    return [{**env, "ZJAX_PROCESS_ID": str(rank)} for rank in (0, 1)]


def _start(mode: str, *args: str) -> list[subprocess.Popen]:
    return [
        subprocess.Popen(
            [sys.executable, "-m", "tests._mp_worker", mode, *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )
        for env in _envs()
    ]


def _train_job(out: Path) -> list[dict[str, np.ndarray]]:
    runs = run_workers([[sys.executable, "-m", "tests._mp_worker", "train", str(out)]] * 2, timeout=300, envs=_envs())
    for rank, (rc, text) in enumerate(runs):
        assert rc == 0 and f"OK {rank} 2 8" in text, text[-3000:]
        assert "BAD ROWS: shard_batch on process" in text and "holds 4 of the 8 data-parallel parts" in text
        assert "SPANS (2, 4) 1 ['replica']" in text and "SPANS 4 2 ['dp']" in text
    return [dict(np.load(f"{out}.{rank}.npz")) for rank in (0, 1)]


def _one_process_runs() -> dict[str, tuple[list[float], list[np.ndarray]]]:
    init_fn, loss_fn = linen_mlp_task()
    runs = {}
    for name, (dp, stage) in CONFIGS.items():
        plan = zjax.Plan(zjax.make_mesh(dp=dp), stage=stage, precision="fp32")
        state = plan.init(init_fn, TX, jax.random.key(0))
        step = plan.train_step(loss_fn)
        losses = []
        for i in range(STEPS):
            state, m = step(state, plan.shard_batch(regression_batch(ROWS, seed=i)))
            losses.append(float(m["loss"]))
        runs[name] = (losses, [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state.params))])
    return runs


def test_two_by_four_matches_one_by_eight(tmp_path):
    """Stages 0-3 and HSDP: identical losses on both ranks, params within rtol 1e-5 / atol 1e-6 of one
    process x 8 devices (gloo sums in another order), and two 2-process runs bitwise equal."""
    first = _train_job(tmp_path / "a")
    second = _train_job(tmp_path / "b")
    single = _one_process_runs()
    table = {}
    for name in CONFIGS:
        r0, r1 = first[0], first[1]
        assert np.array_equal(r0[f"{name}/losses"], r1[f"{name}/losses"]), name
        losses, params = single[name]
        np.testing.assert_allclose(r0[f"{name}/losses"], losses, rtol=1e-6)
        diff = 0.0
        for i, p in enumerate(params):
            np.testing.assert_allclose(r0[f"{name}/param{i}"], p, rtol=1e-5, atol=1e-6, err_msg=name)
            diff = max(diff, float(np.max(np.abs(r0[f"{name}/param{i}"] - p))))
            assert np.array_equal(r0[f"{name}/param{i}"], second[0][f"{name}/param{i}"]), name
        table[name] = {
            "losses": [round(float(x), 6) for x in r0[f"{name}/losses"]],
            "max_param_diff_vs_1x8": diff,
            "argument_bytes_per_device": int(r0[f"{name}/argument_bytes"]),
            "cross_process_bytes_per_device": int(r0[f"{name}/cross_process_bytes"]),
        }
    print(json.dumps(table, indent=1))
    cross = {n: row["cross_process_bytes_per_device"] for n, row in table.items()}
    # HSDP sends only the gradient shards across processes: less than ZeRO-3 or plain DP over all devices
    assert 0 < cross["hsdp3"] < cross["stage3"] and cross["hsdp3"] < cross["stage0"]


def _wait_for(procs: list[subprocess.Popen], text: str, timeout: float = 120) -> list[str]:
    """Read each process's output until it prints ``text``."""
    seen = ["", ""]
    deadline = time.monotonic() + timeout
    for rank, p in enumerate(procs):
        assert p.stdout is not None
        while text not in seen[rank]:
            line = p.stdout.readline()
            if not line or time.monotonic() > deadline:
                raise AssertionError(f"process {rank} did not print {text!r}:\n{seen[rank][-3000:]}")
            seen[rank] += line
    return seen


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()
        if p.stdout is not None:
            p.stdout.close()


def _exit_within(p: subprocess.Popen, seconds: float) -> tuple[int, float]:
    start = time.monotonic()
    try:
        rc = p.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError(f"a survivor still ran {seconds:.0f} s after its peer failed") from None
    return rc, time.monotonic() - start


@pytest.mark.parametrize(
    ("victim", "how", "within"),
    [(1, "SIGKILL", HEARTBEAT + 3), (1, "SIGSTOP", HEARTBEAT + 3), (0, "SIGKILL", 3)],
    ids=["process-1-killed", "process-1-frozen", "coordinator-killed"],
)
def test_survivor_ends_when_a_peer_dies_or_freezes(victim, how, within):
    """A dead or frozen process 1 ends process 0 after the heartbeat timeout; a dead process 0 ends 1 at once."""
    procs = _start("loop")
    survivor = 1 - victim
    try:
        _wait_for(procs, "STEP 2")
        os.kill(procs[victim].pid, getattr(signal, how))
        rc, took = _exit_within(procs[survivor], within)
        print(f"process {survivor} ended {took:.1f} s after process {victim} got {how} (rc {rc})")
        assert rc != 0, took
    finally:
        _stop(procs)


def test_an_exception_in_one_process_ends_both():
    procs = _start("raise")
    try:
        _wait_for(procs, "STEP 1")
        results = [_exit_within(p, SHUTDOWN + 3 + 10) for p in procs]  # 10 s: rank 1 may still be in step 2
        print(f"after process 1 raised: (rc, seconds) = {results}")
        assert all(rc != 0 for rc, _ in results), results
    finally:
        _stop(procs)


def test_launcher_ends_the_job_and_says_resume(tmp_path):
    """A process of the example killed mid-run: the launcher stops the other and reports it."""
    script = tmp_path / "die.py"
    script.write_text(
        "import os, signal, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "import zjax\n"
        "zjax.distributed.initialize()\n"
        "import jax, jax.numpy as jnp\n"
        "x = jax.jit(lambda a: a.sum())(jnp.ones(4))\n"
        "print('started', jax.process_index(), jax.process_count(), flush=True)\n"
        "if jax.process_index() == 1: os.kill(os.getpid(), signal.SIGKILL)\n"
        "import time; time.sleep(120)\n"
        "print('slept', flush=True)\n"
    )
    env = {**os.environ, "ZJAX_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT)}
    run = subprocess.run(
        [sys.executable, "-m", "zjax.cli", "launch", "-n", "2", "--cpu-devices", "2", "--grace", "30", "--",
         sys.executable, str(script)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert run.returncode == 128 + signal.SIGKILL, run.stderr[-3000:]
    assert "[1] started 1 2" in run.stderr
    assert "process 1 of 2 failed (killed by SIGKILL); peer failed" in run.stderr
    assert "Resume from the last checkpoint" in run.stderr
    assert "slept" not in run.stderr + run.stdout  # process 0 was ended (the heartbeat), not left to finish its sleep
