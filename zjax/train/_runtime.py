"""Start a script's runtime: join its cluster, or launch local processes, or simulate CPU devices."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import jax

from .. import distributed
from .._quiet import filtered_stderr
from ..sharding import simulate_cpu_devices
from ._config import LoopConfig

_CHILD = "ZJAX_TRAIN_CHILD"  # set in the processes that runtime() launched: they never launch again


@contextmanager
def runtime(config: LoopConfig, argv: Sequence[str] | None = None) -> Iterator[distributed.ClusterEnv]:
    """Set up JAX for ``config`` before anything starts a backend; shut the job down when the block ends.

    A job started by a cluster (srun, mpirun, a Kubernetes Indexed Job, ``ZJAX_*`` variables) is joined as it
    is. Otherwise ``config.processes > 1`` runs this script again as that many local processes
    (:func:`zjax.distributed.launch`) and exits with their status; one process gets ``config.cpu_devices``
    simulated CPU devices (used only without an accelerator). Then the compilation cache is enabled
    (``config.compilation_cache``) and a ``preemptible`` one-process run starts ``jax.distributed`` so that a
    SIGTERM reaches :meth:`zjax.Checkpointer.maybe_save`. ``jax.distributed`` is shut down when the block
    exits normally (after an exception the process leaves the job at exit).

    Args:
      config: the loop's settings.
      argv: this script's arguments, for the relaunch (default ``sys.argv[1:]``).

    Yields:
      The cluster this process belongs to (``num_processes == 1`` when alone).

    Raises:
      SystemExit: after a local launch (the processes' status), or when the devices do not divide among
        the cluster's processes.

    Example:
      >>> with zjax.train.runtime(config):
      ...     mesh = zjax.make_mesh(dp=-1)
      ...     ...
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    cluster = distributed.detect(os.environ)
    if config.processes > 1 and cluster.num_processes == 1 and not os.environ.get(_CHILD):
        command = [sys.executable, sys.argv[0], *argv]
        raise SystemExit(
            distributed.launch(
                command,
                config.processes,
                cpu_devices=config.cpu_devices // config.processes,
                env={**os.environ, _CHILD: "1"},
            )
        )
    if cluster.num_processes > 1:  # join the job first, before anything starts a backend
        if config.cpu_devices % cluster.num_processes:
            raise SystemExit(f"--cpu-devices {config.cpu_devices} must divide among {cluster.num_processes} processes")
        # simulated CPU devices per process (a GPU job drives its GPUs; this only sizes the CPU backend)
        per_process = None if os.environ.get("ZJAX_CPU_DEVICES") else config.cpu_devices // cluster.num_processes
        cluster = distributed.initialize(cpu_devices=per_process)
        print(
            f"joined a {cluster.num_processes}-process job ({cluster.source}) as process {cluster.process_id}",
            flush=True,
        )
    else:
        simulate_cpu_devices(config.cpu_devices)  # before the backend starts; threads for its collectives
    if config.compilation_cache is not None:  # a resumed job reuses its compiled steps
        jax.config.update("jax_compilation_cache_dir", str(config.compilation_cache))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # every step, however fast it compiled
    if config.preemptible and cluster.num_processes == 1:
        port = distributed.free_port()  # the coordinator of a one-process job
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=1, process_id=0)
    with filtered_stderr():  # the backend starts here (after any initialize), without the CUDA plugin's driver probe
        jax.devices()
    yield cluster
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()
