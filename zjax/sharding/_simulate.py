"""Simulated CPU devices whose collectives cannot starve: JAX's CPU backend with enough threads.

XLA:CPU runs a program's thunks on one pool of threads shared by all devices of the process, sized
``max(cores, devices)`` (``xla/pjrt/cpu/cpu_client.cc``: "at least CpuDeviceCount threads to launch one
collective"), and a collective blocks its thread until every device has joined it. The thunk executor
orders collectives only by when they *start* (a scheduling edge), not by when they finish, so one device
can hold two blocking collectives at once: an all-gather inside a layer scan's while loop and a gradient
all-reduce beside the loop. With 8 devices on a 2-core machine that is 8 threads: device 0 holds two,
devices 1-6 one each, and device 7 gets none, so the collective it must join never completes (the
README's main command aborted in 11 of 11 runs with ``rendezvous.cc ... Termination timeout``). A longer
collective timeout cannot help: nothing frees a thread.

The pool's size comes from the ``PJRT_NPROC`` variable (read once, when the backend starts), so the fix
is a pool with room for several collectives in flight per device: :data:`COLLECTIVES_IN_FLIGHT` per
device. Compiled programs are unchanged (this is a runtime thread count), on CPU and GPU alike.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, MutableMapping

import jax
from jax._src import xla_bridge  # backends_are_initialized: no public equivalent in jax 0.10.2

COLLECTIVES_IN_FLIGHT = 4
"""Blocking collectives one device may have started and not finished at once (2 seen in a layer scan beside
a gradient all-reduce; room for nested loops). A pool of ``COLLECTIVES_IN_FLIGHT x devices`` threads can
always give the device that lags a thread: the others hold at most ``COLLECTIVES_IN_FLIGHT`` each."""

MAX_THREADS = 256
"""XLA:CPU caps its pool here (``kMaxIntraOpThreads``): beyond 64 devices fewer than four collectives each."""

THREADS_VARIABLE = "PJRT_NPROC"
"""The environment variable XLA's CPU client reads for its thread pool size (``DefaultThreadPoolSize``)."""

_NVIDIA_DEVICE_NODES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")  # what JAX checks before starting CUDA
_WARNED: set[str] = set()


def backend_started() -> bool:
    """Whether JAX has started its backends in this process (device counts and threads are then fixed)."""
    return xla_bridge.backends_are_initialized()


def threads_needed(devices: int) -> int:
    """Threads XLA:CPU needs so that ``devices`` simulated devices never starve a collective."""
    return min(COLLECTIVES_IN_FLIGHT * devices, MAX_THREADS)


def _platforms() -> str:
    return str(getattr(jax.config, "jax_platforms", None) or os.environ.get("JAX_PLATFORMS", "")).strip()


def nvidia_gpu_visible() -> bool:
    """An NVIDIA GPU device node exists (the check JAX makes before it starts its CUDA backend)."""
    return any(os.path.exists(p) for p in _NVIDIA_DEVICE_NODES)


def simulate_cpu_devices(devices: int, *, env: MutableMapping[str, str] | None = None) -> None:
    """Give JAX's CPU backend ``devices`` simulated devices that run collectives without deadlock.

    Call it before anything starts JAX's backend (``jax.devices()``, an array, ``zjax.make_mesh``). It sets
    ``jax_num_cpu_devices`` and sizes XLA:CPU's thread pool to at least :func:`threads_needed` (never below
    the cores), which 8 devices on a 2-core machine need (see the module docstring); a ``PJRT_NPROC`` already
    set is left as it is (a step then warns once if it is too small). Without an NVIDIA GPU it also
    tells the CUDA plugin, when installed, to skip its library check (it would print a traceback, then JAX
    skips CUDA anyway). Programs compiled for GPUs are unaffected: the CPU backend's threads are not theirs.

    Args:
      devices: simulated CPU devices in this process.
      env: the environment to set (default ``os.environ``, which the backend reads when it starts).

    Raises:
      ValueError: ``devices`` is not a positive int.
      RuntimeError: JAX's backend has already started (the device count and threads are then fixed).

    Example::

        import zjax
        zjax.simulate_cpu_devices(8)  # first thing in the script
        mesh = zjax.make_mesh(dp=8)
    """
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"simulate_cpu_devices: devices={devices!r} must be a positive int.")
    target: MutableMapping[str, str] = os.environ if env is None else env
    if backend_started():
        raise RuntimeError(
            f"simulate_cpu_devices({devices}): JAX's backend has already started, with "
            f"{jax.local_device_count()} local device(s). Call it at the top of the script, before jax.devices(), "
            "any JAX array or zjax.make_mesh."
        )
    jax.config.update("jax_num_cpu_devices", devices)
    gpu = nvidia_gpu_visible() and _platforms().split(",")[0].strip() != "cpu"
    if not gpu and not target.get(THREADS_VARIABLE, "").strip():  # a value the user set is theirs (warned if low)
        target[THREADS_VARIABLE] = str(max(os.cpu_count() or 1, threads_needed(devices)))
    if not nvidia_gpu_visible():
        target.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def pool_threads(env: Mapping[str, str] | None = None) -> int:
    """The thread pool XLA:CPU started with, as the environment says now (``PJRT_NPROC``, ``NPROC``, cores)."""
    source: Mapping[str, str] = os.environ if env is None else env
    for name in (THREADS_VARIABLE, "NPROC"):
        text = source.get(name, "").strip()
        if text.isdigit() and int(text) > 0:
            return max(int(text), jax.local_device_count("cpu"))
    return max(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
               jax.local_device_count("cpu"))  # fmt: skip


def check_cpu_threads(devices: list, env: Mapping[str, str] | None = None) -> bool:
    """Warn once when ``devices`` are simulated CPU devices whose collectives can deadlock.

    Returns ``True`` when the pool is large enough (or the devices are not CPUs)."""
    local = [d for d in devices if d.process_index == jax.process_index()]
    if not local or local[0].platform != "cpu" or len(local) < 2:
        return True
    have, need = pool_threads(env), threads_needed(len(local))
    if have >= need:
        return True
    key = f"{len(local)}:{have}"
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(
            f"zjax: {len(local)} simulated CPU devices share {have} XLA:CPU threads; a step whose collectives "
            f"overlap (a layer scan beside a gradient all-reduce) can deadlock in rendezvous. Start the backend "
            f"with zjax.simulate_cpu_devices({len(local)}) instead of jax_num_cpu_devices, or set "
            f"{THREADS_VARIABLE}={need} before JAX starts.",
            RuntimeWarning,
            stacklevel=3,
        )
    return False
