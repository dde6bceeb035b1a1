"""GPU targets as data: one ``GpuTargetConfigProto`` text file per GPU model, looked up by name.

A target lets XLA:GPU compile for GPUs that are not there (a "deviceless" compile): SPMD partitioning, GPU
fusion, the latency-hiding scheduler and Triton lowering all run, so the planner reads the GPU compiler's
own memory and collectives. The files (``targets/*.txtpb``) hold published device facts: SM count, clock,
memory size and bandwidth, caches, compute capability.
"""

from __future__ import annotations

import dataclasses
import os
import re
from importlib import resources

_DIR = "targets"
# name -> (file, aliases, dense bf16 and fp8 peak TFLOP/s from the vendor's data sheet, for MFU and the timeline;
# the sheets print twice these "with sparsity"; the A100 has no fp8 tensor cores); the file's device_memory_size is
# the memory the budget starts from
_REGISTRY: dict[str, tuple[str, tuple[str, ...], float, float | None]] = {
    "h100": ("h100_sxm.txtpb", ("h100-sxm", "h100-80gb"), 989.4, 1978.9),
    "h200": ("h200_sxm.txtpb", ("h200-sxm", "h200-141gb"), 989.4, 1978.9),
    "b200": ("b200.txtpb", (), 2250.0, 4500.0),
    "a100": ("a100_sxm_80gb.txtpb", ("a100-80gb", "a100-sxm"), 312.0, None),
}
GPUS_PER_HOST = 8


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """A GPU model to compile for: its name, the target proto text and the facts the planner uses."""

    name: str
    text: str
    source: str  # the registry name or the file path it came from
    peak_bf16_flops: float | None = None  # dense, per second; None for a user's file
    peak_fp8_flops: float | None = None  # dense, per second, e4m3/e5m2 operands; None without fp8 tensor cores

    @property
    def device_kind(self) -> str:
        m = re.search(r'^\s*name:\s*"([^"]+)"', self.text, re.M)
        return m.group(1) if m else self.name

    @property
    def memory_bytes(self) -> int:
        """Device memory (``device_memory_size``: what the driver reports as total)."""
        m = re.search(r"device_memory_size:\s*(\d+)", self.text)
        if not m:
            raise ValueError(f"GPU target {self.source!r} has no device_memory_size.")
        return int(m.group(1))

    @property
    def memory_bandwidth(self) -> float:
        """Device memory bandwidth, bytes per second (``memory_bandwidth``)."""
        m = re.search(r"memory_bandwidth:\s*(\d+)", self.text)
        if not m:
            raise ValueError(f"GPU target {self.source!r} has no memory_bandwidth.")
        return float(m.group(1))

    @property
    def cudnn_version(self) -> int:
        """cuDNN's version as JAX encodes it (9.10.0 -> 91000), from the target's ``dnn_version``."""
        m = re.search(r'dnn_version:\s*"(\d+)\.(\d+)\.(\d+)"', self.text)
        major, minor, patch = (int(x) for x in m.groups()) if m else (9, 0, 0)
        return major * 10000 + minor * 100 + patch

    @property
    def compute_capability(self) -> tuple[int, int]:
        block = re.search(r"cuda_compute_capability\s*\{([^}]*)\}", self.text)
        text = block.group(1) if block else ""
        major = re.search(r"major:\s*(\d+)", text)
        minor = re.search(r"minor:\s*(\d+)", text)
        return (int(major.group(1)) if major else 0, int(minor.group(1)) if minor else 0)


def target_names() -> list[str]:
    return sorted(_REGISTRY)


def get_target(name_or_path: str | GpuTarget) -> GpuTarget:
    """A registered target (``"h100"``, ``"h200"``, ``"b200"``, ``"a100"`` or an alias) or a ``.txtpb`` file.

    Raises:
      ValueError: the name is not registered and is not a file; the message lists the known names.
    """
    if isinstance(name_or_path, GpuTarget):
        return name_or_path
    key = str(name_or_path).strip().lower()
    for name, (file, aliases, tflops, fp8) in _REGISTRY.items():
        if key == name or key in aliases:
            text = resources.files(__package__).joinpath(_DIR, file).read_text()
            return GpuTarget(name, text, name, tflops * 1e12, None if fp8 is None else fp8 * 1e12)
    if os.path.isfile(name_or_path):
        with open(name_or_path) as f:
            text = f.read()
        if "gpu_device_info" not in text:
            raise ValueError(
                f"GPU target file {name_or_path!r} is not a GpuTargetConfigProto in text format (no gpu_device_info)."
            )
        return GpuTarget(os.path.splitext(os.path.basename(name_or_path))[0], text, os.fspath(name_or_path))
    raise ValueError(
        f"unknown GPU target {name_or_path!r}; known targets: {target_names()} (or the path of a "
        "GpuTargetConfigProto .txtpb file)."
    )


def topology_string(count: int, gpus_per_host: int = GPUS_PER_HOST) -> str:
    """``"1x{hosts}x{gpus per host}"`` for ``count`` GPUs (hosts of 8, or one host with fewer)."""
    if count < 1:
        raise ValueError(f"GPU count must be >= 1, got {count}.")
    per_host = min(count, gpus_per_host)
    if count % per_host:
        raise ValueError(f"{count} GPUs do not fill hosts of {per_host}; use a multiple of {per_host}.")
    return f"1x{count // per_host}x{per_host}"


def peak_flops(device_kind: str, fp8: bool = False) -> float | None:
    """Dense bf16 (or, with ``fp8``, fp8) peak FLOP/s of a device by its ``device_kind`` (``None`` for an unknown
    device, e.g. a CPU, or one without fp8 tensor cores: never a made-up number)."""
    for name in _REGISTRY:
        target = get_target(name)
        if target.device_kind == device_kind or device_kind.lower().startswith(target.device_kind.lower()):
            return target.peak_fp8_flops if fp8 else target.peak_bf16_flops
    return None
