"""Simulated CPU devices never deadlock: XLA:CPU gets threads for every device's collectives in flight."""

import os
import sys
import warnings

import jax
import pytest

import zjax
from zjax.sharding import _simulate

from ._procs import run_workers


def test_simulate_refuses_a_started_backend_and_bad_counts():
    env: dict[str, str] = {}
    with pytest.raises(RuntimeError, match=r"already started.*Call it at the top of the script"):
        zjax.simulate_cpu_devices(8, env=env)  # the suite's backend is running
    assert env == {}
    with pytest.raises(ValueError, match="devices=0 must be a positive int"):
        zjax.simulate_cpu_devices(0)
    assert _simulate.threads_needed(8) == 32 and _simulate.threads_needed(1000) == _simulate.MAX_THREADS
    assert _simulate.pool_threads() >= 32  # conftest's simulate_cpu_devices(8) sized the pool this suite runs on


def test_too_few_threads_warn_once_and_name_the_fix():
    devices = jax.devices()
    _simulate._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not _simulate.check_cpu_threads(devices, env={"PJRT_NPROC": "2"})
        assert not _simulate.check_cpu_threads(devices, env={"PJRT_NPROC": "2"})  # once per configuration
        assert _simulate.check_cpu_threads(devices, env={"PJRT_NPROC": "32"})
        assert _simulate.check_cpu_threads(devices[:1], env={"PJRT_NPROC": "2"})  # one device: no collectives
    assert len(caught) == 1 and caught[0].category is RuntimeWarning
    text = str(caught[0].message)
    assert "8 simulated CPU devices share 8 XLA:CPU threads" in text
    assert "zjax.simulate_cpu_devices(8)" in text and "PJRT_NPROC=32" in text


@pytest.mark.slow  # two processes, each compiling a step for XLA:CPU and for 8 H100s
def test_the_thread_pool_changes_no_compiled_program():
    """simulate_cpu_devices sets a runtime thread count: the deviceless GPU compile of a step is the same program
    as with jax_num_cpu_devices alone, and the CPU compile the same instructions and memory (only the number of
    tasks XLA:CPU splits each elementwise loop into follows the threads)."""
    env = {k: v for k, v in os.environ.items() if k != _simulate.THREADS_VARIABLE}
    cmds = [[sys.executable, "-m", "tests._compile_fingerprint_worker", mode] for mode in ("simulate", "plain")]
    (c1, simulated), (c2, plain) = run_workers(cmds, timeout=600, envs=[env, env])
    assert c1 == 0 and c2 == 0, simulated[-2000:] + plain[-2000:]
    lines = [[line for line in out.splitlines() if line.startswith(("cpu ", "gpu "))] for out in (simulated, plain)]
    assert len(lines[0]) == 2 and lines[0] == lines[1], lines


@pytest.mark.skipif(_simulate.nvidia_gpu_visible(), reason="an NVIDIA GPU is visible: the CUDA plugin may start")
def test_a_simulating_process_sizes_its_pool_and_prints_no_cuda_traceback():
    """With the CUDA plugin installed (the test extra) and no GPU, JAX would log the plugin's failed library check
    as a traceback before falling back to the CPU; a process that simulates its devices prints none. Its pool is
    sized unless the user set PJRT_NPROC."""
    pytest.importorskip("jax_plugins.xla_cuda12")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK")}
    env.pop(_simulate.THREADS_VARIABLE, None)
    code = "import os, zjax\nzjax.simulate_cpu_devices(2)\nimport jax\nprint(jax.devices(), os.environ['PJRT_NPROC'])\n"
    cmd = [sys.executable, "-c", code]
    (rc, out), (rc_own, own) = run_workers([cmd, cmd], timeout=120, envs=[env, {**env, "PJRT_NPROC": "3"}])
    assert rc == 0 and "CpuDevice(id=1)" in out, out
    assert "Traceback" not in out and "Unable to load CUDA" not in out, out
    assert f"] {max(os.cpu_count() or 1, 8)}" in out  # 4 threads per device, never fewer than the cores
    assert rc_own == 0 and "] 3" in own, own  # a value the user set is kept (a step then warns: below)
