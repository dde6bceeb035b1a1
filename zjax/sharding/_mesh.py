"""Build the (pp, dp, tp) device mesh."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

from ._axes import DP, MESH_AXES, PP, TP


def _resolve_sizes(sizes: dict[str, int], num_devices: int) -> dict[str, int]:
    for name, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool):
            raise TypeError(f"make_mesh: {name}={size!r} must be an int (use -1 to infer it).")
        if size == 0 or size < -1:
            raise ValueError(f"make_mesh: {name}={size} must be a positive int or -1 (infer).")
    inferred = [name for name, size in sizes.items() if size == -1]
    if len(inferred) > 1:
        raise ValueError(
            f"make_mesh: only one axis size may be -1, got {', '.join(f'{n}=-1' for n in inferred)}; "
            "give all but one axis an explicit size."
        )
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if inferred:
        if num_devices % fixed:
            given = ", ".join(f"{n}={s}" for n, s in sizes.items() if s != -1)
            raise ValueError(
                f"make_mesh: cannot infer {inferred[0]}: {num_devices} devices are not divisible by "
                f"{given} (product {fixed}). Choose sizes whose product divides {num_devices}."
            )
        sizes = {**sizes, inferred[0]: num_devices // fixed}
    elif fixed != num_devices:
        given = " x ".join(f"{n}={s}" for n, s in sizes.items())
        raise ValueError(
            f"make_mesh: {given} = {fixed} devices, but {num_devices} are available. "
            f"Make the product equal {num_devices}, or pass -1 for one axis to infer it."
        )
    return sizes


def make_mesh(
    dp: int = -1,
    tp: int = 1,
    pp: int = 1,
    *,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """Make a mesh with the named axes ``pp``, ``dp`` and ``tp`` (outermost first).

    Device order comes from :func:`jax.make_mesh`, which knows the physical topology and keeps the
    innermost axis (``tp``) on the closest devices, across processes too. Axis types are ``Auto`` so
    that ``jit`` partitions from sharding annotations (GSPMD).

    Args:
      dp: data-parallel size; ZeRO stages shard model state over it. ``-1`` infers it.
      tp: tensor-parallel size. ``-1`` infers it.
      pp: pipeline-parallel size. ``-1`` infers it.
      devices: the devices to use; all of ``jax.devices()`` by default.

    Returns:
      A :class:`jax.sharding.Mesh` with axis names ``("pp", "dp", "tp")``.

    Raises:
      ValueError: if the sizes do not multiply to the number of devices, or more than one is -1.

    Example:
      >>> mesh = zjax.make_mesh(dp=-1, tp=2)   # 8 devices -> dp=4, tp=2, pp=1
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = _resolve_sizes({DP: dp, TP: tp, PP: pp}, len(devices))
    shape = tuple(sizes[name] for name in MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def axis_size(mesh: Mesh, name: str) -> int:
    """The size of mesh axis ``name``, or 1 if the mesh has no such axis."""
    return int(mesh.shape.get(name, 1))
