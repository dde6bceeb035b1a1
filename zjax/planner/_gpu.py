"""Deviceless XLA:GPU compiles: devices of a GPU target that is not there, and what the compile tells.

The CUDA compiler plugin (``pip install "zjax[plan-gpu]"``) compiles for a :class:`GpuTarget` on a machine
without a GPU. The process must run JAX on the CPU platform (set before its backend starts), or the
plugin looks for a GPU and fails.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import re
from collections.abc import Iterator
from typing import Any

import jax

from .._quiet import GPU_TARGET_NOISE, filtered_stderr
from ._targets import GpuTarget, get_target, topology_string

PLUGIN_HINT = 'pip install "zjax[plan-gpu]"  (the CUDA compiler plugin, jax-cuda12-plugin; no GPU needed)'


def use_cpu_platform() -> None:
    """Run this process's JAX on the CPU platform, as deviceless GPU compiles need (before backend start)."""
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")


def gpu_devices(target: str | GpuTarget, count: int) -> list[Any]:
    """``count`` devices of ``target`` (a topology of hosts with 8 GPUs) to build a mesh and compile for.

    Raises:
      ImportError: the CUDA compiler plugin is not installed (the message says what to install).
      ValueError: an unknown target (lists the known ones) or a count that does not fill hosts of 8.
    """
    spec = get_target(target)
    if importlib.util.find_spec("jax_cuda12_plugin") is None:
        raise ImportError(f"compiling for GPU target {spec.name!r} needs the CUDA compiler plugin: {PLUGIN_HINT}")
    use_cpu_platform()
    from jax.experimental import topologies

    try:
        with filtered_stderr(GPU_TARGET_NOISE):  # the plugin probes for a driver (on a machine without a GPU)
            topo = topologies.get_topology_desc(
                platform="cuda", target_config=spec.text, topology=topology_string(count)
            )
    except RuntimeError as e:
        raise RuntimeError(
            f"deviceless compile for {count} x {spec.device_kind} failed to start: {e}. Run JAX on the CPU "
            "platform in this process (JAX_PLATFORMS=cpu, before jax starts) and check the plugin's version "
            "matches jaxlib's."
        ) from e
    return list(topo.devices)


@contextlib.contextmanager
def cudnn_for_target(target: str | GpuTarget) -> Iterator[None]:
    """Answer JAX's cuDNN attention checks, and tokamax's hardware check, for ``target`` while a step is traced
    for it.

    ``jax.nn.dot_product_attention(implementation="cudnn")`` asks the *local* backend for the compute
    capability (a CPU here: every Hopper/Blackwell-only shape, e.g. head_dim 256, is rejected) and loads
    cuDNN to read its version (absent: a RuntimeError). tokamax's kernels (an MoE's grouped matmul) ask the
    machine whether it has a GPU (here: NotImplementedError). For a deviceless compile the answers come from
    the target instead. This is the one place that touches those (private) checks.
    """
    from jax._src.cudnn import fused_attention_stablehlo as fa

    spec = get_target(target)
    have = spec.compute_capability

    def at_least(capability: str) -> bool:
        return have >= tuple(int(x) for x in capability.split("."))

    def equal(capability: str) -> bool:
        return have == tuple(int(x) for x in capability.split("."))

    saved = (fa.check_cudnn_version, fa.check_compute_capability, fa.is_cuda_compute_capability_equal)
    fa.check_cudnn_version = lambda: spec.cudnn_version  # type: ignore[assignment]
    fa.check_compute_capability = at_least  # type: ignore[assignment]
    fa.is_cuda_compute_capability_equal = equal  # type: ignore[assignment]
    try:
        with _tokamax_cross_compiled():
            yield
    finally:
        fa.check_cudnn_version, fa.check_compute_capability, fa.is_cuda_compute_capability_equal = saved


@contextlib.contextmanager
def _tokamax_cross_compiled() -> Iterator[None]:
    """tokamax's kernels check that the machine has a GPU unless told they are cross-compiled (its public
    ``cross_compile`` option, for kernels compiled where they do not run: a deviceless compile)."""
    try:
        import tokamax
    except ImportError:  # not installed: an MoE then uses jax.lax.ragged_dot
        yield
        return
    from ..experts._dispatch import absl_flags_parsed

    absl_flags_parsed()
    with tokamax.config.cross_compile(True):
        yield


def cost_analysis(compiled: Any) -> dict[str, float] | None:
    """FLOPs and bytes accessed of a compiled program, also for a deviceless GPU compile.

    ``compiled.cost_analysis()`` needs a client, which a deviceless compile does not have; then XLA's
    HLO cost analysis runs on the GPU-optimized module through the CPU backend (a private JAX API, kept
    here only). Returns ``None`` if neither works.
    """
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - UNIMPLEMENTED without a client
        cost = None
    if isinstance(cost, list):
        cost = cost[0] if cost else None
    if not cost:
        try:
            from jax._src import xla_bridge
            from jax._src.lib import _jax

            module = compiled._executable.xla_extension_executable().hlo_modules()[0]
            cost = _jax.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), module)
        except Exception:  # noqa: BLE001 - private API: absent or changed
            return None
    keys = ("flops", "bytes accessed")
    return {k: float(cost[k]) for k in keys if k in cost} or None


# What memory_analysis() never counts on a GPU: NCCL's communicator buffers, cuBLAS/cuDNN workspaces (a
# deviceless compile shows cuDNN's as u8[0]), the CUDA context and the allocator's fragmentation. Stated,
# not measured here; override with ZJAX_GPU_RESERVE_BYTES.
DEFAULT_RESERVE = 4 * 2**30
DEFAULT_FRACTION = 0.75  # JAX preallocates this share of device memory (XLA_PYTHON_CLIENT_MEM_FRACTION)


@dataclasses.dataclass(frozen=True)
class Budget:
    """Per-device bytes a plan may use on a GPU target: ``memory x fraction - reserve`` (or a given size)."""

    usable: float
    device_memory: int | None
    fraction: float | None
    reserve: float

    def describe(self) -> str:
        if self.fraction is not None and self.device_memory is not None:
            return (
                f"{self.usable / 1e9:.2f} GB usable = {self.device_memory / 1e9:.2f} GB x {self.fraction:.0%} "
                f"(the allocator's share) - {self.reserve / 1e9:.2f} GB reserved for NCCL, cuBLAS/cuDNN workspaces "
                "and fragmentation (not in memory_analysis)"
            )
        return f"{self.usable / 1e9:.2f} GB usable = the given size - {self.reserve / 1e9:.2f} GB reserved"


def budget(text_or_bytes: str | float, target: str | GpuTarget | None = None, reserve: float | None = None) -> Budget:
    """``"80%"`` (of the target's memory: the allocator fraction), ``"70GB"`` or bytes, less the reserve.

    Without a target (the CPU path) a percentage is refused and nothing is reserved.
    """
    if reserve is None:
        env = os.environ.get("ZJAX_GPU_RESERVE_BYTES", "").strip()
        reserve = float(env) if env else (DEFAULT_RESERVE if target is not None else 0.0)
    text = str(text_or_bytes).strip()
    if text.endswith("%"):
        if target is None:
            raise ValueError(f"budget {text!r}: a percentage needs a GPU target (--target) to take it of.")
        fraction = float(text[:-1]) / 100
        if not 0 < fraction <= 1:
            raise ValueError(f"budget {text!r}: the percentage must be in (0, 100].")
        memory = get_target(target).memory_bytes
        return Budget(memory * fraction - reserve, memory, fraction, reserve)
    size = float(text_or_bytes) if not isinstance(text_or_bytes, str) else parse_size(text)
    return Budget(size - reserve, None, None, reserve)


_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str) -> float:
    """``"80GB"`` (1e9), ``"80GiB"`` (2**30) or a plain number of bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"expected a size like 80GB, 75GiB, 1e9 or (with a GPU target) 80%, got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]
