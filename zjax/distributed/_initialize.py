"""Start JAX's multi-controller runtime with the cluster zjax read and timeouts that end a failed job."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping, Sequence

import jax

from ..sharding._simulate import simulate_cpu_devices
from ._cluster import CPU_DEVICES, ClusterEnv, ClusterError, detect

_TIMEOUT_VARS = ("ZJAX_INIT_TIMEOUT_S", "ZJAX_HEARTBEAT_TIMEOUT_S", "ZJAX_SHUTDOWN_TIMEOUT_S")


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Seconds after which the runtime gives up (JAX's defaults are 300 / 100 / 300).

    Attributes:
      initialization: how long process 0 waits for the others to join.
      heartbeat: a process that stops answering (killed, frozen, lost node) for this long ends the job:
        the survivors abort instead of hanging in a collective.
      shutdown: how long a finished process waits for the others at exit. A process that fails with
        an exception leaves the job; the others abort after this long.
    """

    initialization: int = 300
    heartbeat: int = 60
    shutdown: int = 120

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Timeouts:
        """The defaults, overridden by ``ZJAX_INIT_TIMEOUT_S``, ``ZJAX_HEARTBEAT_TIMEOUT_S`` and
        ``ZJAX_SHUTDOWN_TIMEOUT_S``."""
        values = {}
        for f, name in zip(dataclasses.fields(cls), _TIMEOUT_VARS, strict=True):
            text = env.get(name, "").strip()
            if text:
                if not text.isdigit() or int(text) < 1:
                    raise ClusterError(f"{name}={text!r} must be a positive integer (seconds).")
                values[f.name] = int(text)
        return cls(**values)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Timeouts: {f.name}={value!r} must be a positive int (seconds).")


_STATE: dict[str, ClusterEnv] = {}


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | None = None,
    *,
    timeouts: Timeouts | None = None,
    cpu_devices: int | None = None,
    env: Mapping[str, str] | None = None,
) -> ClusterEnv:
    """Join this process to its multi-process job; a single process is left as it is.

    Call it first, before anything that starts a JAX backend. Who this process is comes from the
    arguments, then the ``ZJAX_*`` variables (``ZJAX_COORDINATOR_ADDRESS``, ``ZJAX_NUM_PROCESSES``,
    ``ZJAX_PROCESS_ID``, ``ZJAX_LOCAL_DEVICE_IDS``, ``ZJAX_COORDINATOR_PORT``; JAX's
    ``JAX_COORDINATOR_ADDRESS`` and ``JAX_LOCAL_DEVICE_IDS`` too), then the cluster: Open MPI 4,
    SLURM (``srun``), a Kubernetes Indexed Job, or torchrun-style variables. A process that is
    alone on its node drives all of its GPUs (JAX's own detection would give it one).

    Args:
      coordinator_address: ``host:port`` of process 0.
      num_processes: processes in the job.
      process_id: this process's index.
      local_device_ids: local GPUs this process drives (default: from the cluster, see above).
      timeouts: when a failed or stuck job ends (see :class:`Timeouts`); default
        :meth:`Timeouts.from_env`.
      cpu_devices: CPU devices per process (simulated; for tests and laptops). The ``ZJAX_CPU_DEVICES``
        variable wins when set (``zjax launch --cpu-devices-per-process`` sets it; a different value here warns),
        else JAX's default.
      env: the environment to read (default ``os.environ``).

    Returns:
      The :class:`ClusterEnv` this process joined with (``source="single"`` when alone).

    Raises:
      ClusterError: (a ``ValueError``) the environment is incomplete; the message names what to set.
      RuntimeError: a JAX backend already started in this process.
    """
    env = os.environ if env is None else env
    if _STATE:
        return _STATE["cluster"]
    ids = None if local_device_ids is None else tuple(int(i) for i in local_device_ids)
    cluster = detect(
        env, coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id,
        local_device_ids=ids,
    )  # fmt: skip
    if env.get(CPU_DEVICES, "").strip():  # the launcher's (zjax launch --cpu-devices-per-process) wins
        text = env[CPU_DEVICES].strip()
        if not text.isdigit() or int(text) < 1:
            raise ClusterError(f"{CPU_DEVICES}={text!r} must be a positive integer.")
        if cpu_devices is not None and cpu_devices != int(text):
            warnings.warn(
                f"zjax.distributed.initialize(cpu_devices={cpu_devices}): the launcher set {CPU_DEVICES}={text} "
                f"(zjax launch --cpu-devices-per-process {text}); {text} simulated devices per process it is.",
                RuntimeWarning,
                stacklevel=2,
            )
        cpu_devices = int(text)
    if cpu_devices is not None:
        simulate_cpu_devices(cpu_devices)  # with XLA:CPU threads enough for their collectives
    if cluster.num_processes == 1:
        _STATE["cluster"] = cluster
        return cluster
    timeouts = Timeouts.from_env(env) if timeouts is None else timeouts
    if getattr(jax.config, "jax_enable_recoverability", False):
        raise ClusterError(
            "jax_enable_recoverability is on: with gloo (CPU) collectives a dead peer then hangs the "
            "survivors forever instead of ending the job. Turn it off to use zjax.distributed.initialize."
        )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            cluster.coordinator_address,
            cluster.num_processes,
            cluster.process_id,
            list(cluster.local_device_ids) if cluster.local_device_ids is not None else None,
            cluster_detection_method="deactivate",  # zjax has read the cluster; JAX would force one GPU
            initialization_timeout=timeouts.initialization,
            heartbeat_timeout_seconds=timeouts.heartbeat,
            shutdown_timeout_seconds=timeouts.shutdown,
        )
    except RuntimeError as e:
        raise RuntimeError(
            f"zjax.distributed.initialize: {e} Call it at the top of the script, before any JAX array, "
            "jax.devices() or zjax.make_mesh."
        ) from e
    _STATE["cluster"] = cluster
    return cluster


def cluster() -> ClusterEnv | None:
    """The :class:`ClusterEnv` this process joined with, or ``None`` before :func:`initialize`."""
    return _STATE.get("cluster")
