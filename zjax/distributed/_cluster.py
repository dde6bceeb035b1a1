"""Read who this process is from its environment: explicit variables, Open MPI, SLURM, Kubernetes, torchrun.

Pure functions of an environment mapping, so every cluster can be tested without one. JAX has its
own detection; zjax reads the environment itself because JAX's forces one GPU per process under
SLURM and Open MPI (it passes ``local_device_ids=[local rank]`` even to a single process per node
with 8 GPUs), does not read Open MPI 5 or Kubernetes without extra packages, and fails with a
``KeyError`` or a missing-coordinator error where zjax can name the variable to set.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

COORDINATOR = "ZJAX_COORDINATOR_ADDRESS"
NUM_PROCESSES = "ZJAX_NUM_PROCESSES"
PROCESS_ID = "ZJAX_PROCESS_ID"
LOCAL_DEVICE_IDS = "ZJAX_LOCAL_DEVICE_IDS"
COORDINATOR_PORT = "ZJAX_COORDINATOR_PORT"
CPU_DEVICES = "ZJAX_CPU_DEVICES"

_SLURM_STEP = ("SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


class ClusterError(ValueError):
    """The environment says this is a multi-process job but does not say enough to start it."""


@dataclasses.dataclass(frozen=True)
class ClusterEnv:
    """Who this process is in a multi-process job.

    Attributes:
      source: where it was read: ``"explicit"`` (arguments or ``ZJAX_*``/``JAX_*`` variables),
        ``"ompi"``, ``"slurm"``, ``"kubernetes"``, ``"torchrun"`` or ``"single"`` (one process).
      coordinator_address: ``host:port`` of process 0's coordination service.
      num_processes: processes in the job.
      process_id: this process's index, ``0 <= process_id < num_processes``.
      local_device_ids: the local accelerators this process drives; ``None`` means all it sees.
    """

    source: str
    coordinator_address: str | None
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None = None


def _int(env: Mapping[str, str], name: str) -> int:
    text = env[name].strip()
    if not re.fullmatch(r"\d+", text):
        raise ClusterError(f"environment variable {name}={env[name]!r} must be a non-negative integer.")
    return int(text)


def _ids(text: str, name: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise ClusterError(f"{name}={text!r} must be a comma-separated list of device indices, e.g. 0,1,2,3.")
    return tuple(int(p) for p in parts)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"gpu[003-004,010],cpu1"`` -> ``"gpu003"``."""
    m = re.match(r"\s*([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not m or not m.group(1):
        raise ClusterError(f"SLURM_STEP_NODELIST={nodelist!r} is not a node list.")
    prefix, ranges = m.group(1), m.group(2)
    return prefix if ranges is None else prefix + ranges.split(",")[0].split("-")[0]


def _tasks_on_node(text: str, node: int) -> int:
    """Tasks on node ``node`` from ``SLURM_STEP_TASKS_PER_NODE`` (``"8(x2),4"``)."""
    counts: list[int] = []
    for part in filter(None, text.split(",")):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ClusterError(f"SLURM_STEP_TASKS_PER_NODE={text!r} is not a task count list like 8(x2),4.")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if node >= len(counts):
        raise ClusterError(f"SLURM_NODEID={node} but SLURM_STEP_TASKS_PER_NODE={text!r} lists {len(counts)} nodes.")
    return counts[node]


def local_devices(
    env: Mapping[str, str], local_rank: int, local_size: int, gpus_var: str | None
) -> tuple[int, ...] | None:
    """Which local GPUs a process drives when ``local_size`` processes share a node.

    One process per node drives every GPU (``None``). A process that sees a single GPU (the launcher
    bound it, e.g. ``srun --gpus-per-task=1``) drives that one. Otherwise the visible GPUs are split
    evenly by local rank.
    """
    if local_size <= 1:
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    count = len([v for v in visible.split(",") if v.strip()]) if visible else None
    if count is None and gpus_var and env.get(gpus_var, "").strip().isdigit():
        count = int(env[gpus_var])
    if count is None:
        return (local_rank,)  # one GPU each, as JAX assumes
    if count == 1:
        return None
    if count % local_size:
        raise ClusterError(
            f"{local_size} processes share this node but it has {count} visible GPUs "
            f"(CUDA_VISIBLE_DEVICES={visible or '<unset>'}), which do not divide evenly. Start one process "
            f"per node or one per GPU, or set {LOCAL_DEVICE_IDS} for each process."
        )
    per = count // local_size
    return tuple(range(local_rank * per, (local_rank + 1) * per))


def _port(env: Mapping[str, str], default: int) -> int:
    for name in (COORDINATOR_PORT, "JAX_COORDINATOR_PORT"):
        if env.get(name, "").strip():
            return _int(env, name)
    return default


def _ompi(env: Mapping[str, str]) -> ClusterEnv | None:
    if "OMPI_COMM_WORLD_SIZE" not in env:
        return None
    rank, size = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
    local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK") if "OMPI_COMM_WORLD_LOCAL_RANK" in env else 0
    local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") if "OMPI_COMM_WORLD_LOCAL_SIZE" in env else 1
    coordinator = None
    uri = env.get("OMPI_MCA_orte_hnp_uri", "")
    if uri:  # Open MPI 4 (ORTE): "<jobid>.<vpid>;tcp://10.0.0.1,192.168.0.1:41234"
        job = re.match(r"(\d+)", uri)
        host = re.search(r"tcp6?://\[?([^,:\]\s;]+)", uri)
        if not job or not host:
            raise ClusterError(f"OMPI_MCA_orte_hnp_uri={uri!r} is not an Open MPI 4 URI; set {COORDINATOR}.")
        coordinator = f"{host.group(1)}:{_port(env, (int(job.group(1)) // 4096) % 4096 + 61440)}"
    ids = local_devices(env, local_rank, local_size, None)
    return ClusterEnv("ompi", coordinator, size, rank, ids)


def _slurm(env: Mapping[str, str]) -> ClusterEnv | None:
    if "SLURM_JOB_ID" not in env:
        return None
    missing = [v for v in _SLURM_STEP if v not in env]
    if missing:
        nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1"
        if nodes.strip().isdigit() and int(nodes) > 1:
            raise ClusterError(
                f"SLURM job {env['SLURM_JOB_ID']} spans {nodes} nodes, but this process is not an srun task "
                f"(missing {', '.join(missing)}): the batch script runs once, on the first node. Start the "
                "training with `srun python train.py ...` inside the batch script."
            )
        return None  # a one-node allocation running one process
    node = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
    if "SLURM_STEP_TASKS_PER_NODE" in env:
        local_size = _tasks_on_node(env["SLURM_STEP_TASKS_PER_NODE"], node)
    elif "SLURM_NTASKS_PER_NODE" in env:
        local_size = _int(env, "SLURM_NTASKS_PER_NODE")
    else:
        local_size = 1
    host = first_host(env["SLURM_STEP_NODELIST"])
    coordinator = f"{host}:{_port(env, _int(env, 'SLURM_JOB_ID') % 4096 + 61440)}"
    ids = local_devices(env, _int(env, "SLURM_LOCALID"), local_size, "SLURM_GPUS_ON_NODE")
    return ClusterEnv("slurm", coordinator, _int(env, "SLURM_NTASKS"), _int(env, "SLURM_PROCID"), ids)


def _kubernetes(env: Mapping[str, str]) -> ClusterEnv | None:
    if "KUBERNETES_SERVICE_HOST" not in env or "JOB_COMPLETION_INDEX" not in env:
        return None
    # An Indexed Job (or JobSet) gives each pod its index; the job's size and the address of pod 0
    # (through a headless Service) come from the manifest.
    size = _int(env, NUM_PROCESSES) if NUM_PROCESSES in env else None
    if size is None:
        raise ClusterError(
            f"Kubernetes Indexed Job (JOB_COMPLETION_INDEX={env['JOB_COMPLETION_INDEX']}) without {NUM_PROCESSES}: "
            f"set {NUM_PROCESSES} to the Job's parallelism and {COORDINATOR} to pod 0's address "
            "(e.g. <job>-0.<headless-service>:1234) in the pod template."
        )
    return ClusterEnv("kubernetes", None, size, _int(env, "JOB_COMPLETION_INDEX"), None)


def _torchrun(env: Mapping[str, str]) -> ClusterEnv | None:
    if not all(v in env for v in ("WORLD_SIZE", "RANK", "MASTER_ADDR")):
        return None
    coordinator = f"{env['MASTER_ADDR']}:{_port(env, _int(env, 'MASTER_PORT') + 1 if 'MASTER_PORT' in env else 29501)}"
    local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
    local_size = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else 1
    ids = local_devices(env, local_rank, local_size, None)
    return ClusterEnv("torchrun", coordinator, _int(env, "WORLD_SIZE"), _int(env, "RANK"), ids)


DETECTORS = (("ompi", _ompi), ("slurm", _slurm), ("kubernetes", _kubernetes), ("torchrun", _torchrun))
"""Tried in this order; the first that recognizes the environment wins (JAX's order for the first two)."""


def detect(
    env: Mapping[str, str],
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: tuple[int, ...] | None = None,
) -> ClusterEnv:
    """Who this process is: explicit arguments, then ``ZJAX_*`` (and JAX's own) variables, then the cluster.

    Explicit values win field by field over what a cluster says, so a coordinator address can be
    supplied to an Open MPI 5 job, or local devices overridden under SLURM.

    Raises:
      ClusterError: the environment says several processes but not enough to start them; the
        message names the variables to set.
    """
    cluster = None
    for _, read in DETECTORS:
        cluster = read(env)
        if cluster is not None:
            break
    if coordinator_address is None:
        coordinator_address = env.get(COORDINATOR) or env.get("JAX_COORDINATOR_ADDRESS") or None
    if num_processes is None and env.get(NUM_PROCESSES, "").strip():
        num_processes = _int(env, NUM_PROCESSES)
    if process_id is None and env.get(PROCESS_ID, "").strip():
        process_id = _int(env, PROCESS_ID)
    if local_device_ids is None:
        for name in (LOCAL_DEVICE_IDS, "JAX_LOCAL_DEVICE_IDS"):
            if env.get(name, "").strip():
                local_device_ids = _ids(env[name], name)
                break
    explicit = any(v is not None for v in (coordinator_address, num_processes, process_id))
    if cluster is None and not explicit:
        return ClusterEnv("single", None, 1, 0, local_device_ids)
    source = cluster.source if cluster is not None else "explicit"
    base = cluster or ClusterEnv(source, None, 1, 0)
    out = ClusterEnv(
        source,
        coordinator_address or base.coordinator_address,
        base.num_processes if num_processes is None else num_processes,
        base.process_id if process_id is None else process_id,
        local_device_ids if local_device_ids is not None else base.local_device_ids,
    )
    return _validated(out, explicit_count=num_processes is not None, explicit_id=process_id is not None)


def _validated(c: ClusterEnv, *, explicit_count: bool, explicit_id: bool) -> ClusterEnv:
    where = {"explicit": "the arguments / ZJAX_* variables"}.get(c.source, f"the {c.source} environment")
    if c.source == "explicit" and c.num_processes > 1 and not explicit_id:
        raise ClusterError(f"{NUM_PROCESSES}={c.num_processes} is set but not {PROCESS_ID}: set it on every process.")
    if c.source == "explicit" and not explicit_count and c.coordinator_address:
        raise ClusterError(
            f"{COORDINATOR}={c.coordinator_address} is set but not {NUM_PROCESSES}: set both, and "
            f"{PROCESS_ID} on every process."
        )
    if c.num_processes < 1 or not 0 <= c.process_id < c.num_processes:
        raise ClusterError(
            f"process id {c.process_id} is not in [0, {c.num_processes}) ({where}); check {PROCESS_ID} / "
            f"{NUM_PROCESSES} or the launcher's task count."
        )
    if c.num_processes > 1 and not c.coordinator_address:
        hint = {
            "ompi": " Open MPI 5 (PRRTE) does not publish the launcher's address the way Open MPI 4 did.",
            "kubernetes": " Point it at pod 0 through the Job's headless Service.",
        }.get(c.source, "")
        raise ClusterError(
            f"{c.num_processes} processes ({where}) but no coordinator address.{hint} Set {COORDINATOR}=host:port "
            "to an address of process 0's host that every process can reach (any free port)."
        )
    if c.coordinator_address and not re.fullmatch(r"\[?[\w.\-:]+\]?:\d+", c.coordinator_address):
        raise ClusterError(f"coordinator address {c.coordinator_address!r} must be host:port, e.g. 10.0.0.1:1234.")
    return c
