"""Build the (pp, replica, dp, ep, cp, tp) device mesh, on one process or many."""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Collection, Iterator, Sequence

import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from ._axes import CP, DATA_AXES, DP, EP, MESH_AXES, PP, REPLICA, TP, ZERO_AXES


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
            optional = (REPLICA, EP, CP)  # named only when used
            given = ", ".join(f"{n}={s}" for n, s in sizes.items() if s != -1 and not (n in optional and s == 1))
            raise ValueError(
                f"make_mesh: cannot infer {inferred[0]}: {num_devices} devices are not divisible by "
                f"{given} (product {fixed}). Choose sizes whose product divides {num_devices}."
            )
        sizes = {**sizes, inferred[0]: num_devices // fixed}
    elif fixed != num_devices:
        given = " x ".join(f"{n}={s}" for n, s in sizes.items() if not (n in (REPLICA, EP, CP) and s == 1))
        raise ValueError(
            f"make_mesh: {given} = {fixed} devices, but {num_devices} are available. "
            f"Make the product equal {num_devices}, or pass -1 for one axis to infer it."
        )
    return sizes


def _split_dp(dp: object) -> tuple[int, int]:
    """``dp`` as ``(replica, shard)``: an int is ``(1, dp)``; a pair asks for HSDP."""
    if isinstance(dp, tuple | list):
        if len(dp) != 2:
            raise ValueError(
                f"make_mesh: dp={tuple(dp)!r} must be an int or a (replica, shard) pair for hybrid sharding "
                "(HSDP), e.g. dp=(2, 4): shard model state over 4 devices, replicate it over 2 groups."
            )
        return dp[0], dp[1]  # type: ignore[return-value]
    return 1, dp  # type: ignore[return-value]


def dcn_split(sizes: dict[str, int], num_slices: int) -> dict[str, int]:
    """How many slices (nodes) each axis spans: the slow network goes to ``replica``, then ``pp``, then
    ``dp``; ``ep``, ``cp`` and ``tp`` never cross it.

    Raises:
      ValueError: when the slices cannot be divided among those axes.
    """
    left, dcn = num_slices, dict.fromkeys(sizes, 1)
    for name in (REPLICA, PP, DP):
        take = math.gcd(left, sizes.get(name, 1))
        dcn[name] = take
        left //= take
    if left != 1:
        raise ValueError(
            f"make_mesh: the devices span {num_slices} slices (nodes), which cannot be divided among "
            f"{REPLICA}={sizes.get(REPLICA, 1)}, {PP}={sizes.get(PP, 1)} and {DP}={sizes.get(DP, 1)} without "
            f"putting {EP}, {CP} or {TP} across the slow network. Make {REPLICA} x {PP} x {DP} a multiple of "
            f"{num_slices}, "
            f"e.g. dp=({num_slices}, -1)."
        )
    return dcn


def _slices(devices: Sequence[jax.Device]) -> int:
    return len({getattr(d, "slice_index", 0) for d in devices})


def make_mesh(
    dp: int | tuple[int, int] = -1,
    tp: int = 1,
    pp: int = 1,
    *,
    cp: int = 1,
    ep: int = 1,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """Make a mesh with the named axes ``pp``, ``replica``, ``dp``, ``ep``, ``cp`` and ``tp`` (outermost first).

    Device order comes from :func:`jax.make_mesh`, which knows the physical topology and keeps inner
    axes (``tp``, then ``cp``, ``ep`` and ``dp``) on the closest devices: with several processes the outer axes are the
    ones that cross processes. When the devices span several slices (nodes with their own fast
    interconnect) the mesh is built with :func:`jax.experimental.mesh_utils.create_hybrid_device_mesh`
    so that only ``replica``, ``pp`` and then ``dp`` cross the slow network (see :func:`dcn_split`).
    Axis types are ``Auto`` so that ``jit`` partitions from sharding annotations (GSPMD).

    Args:
      dp: data-parallel size; ZeRO stages shard model state over it. ``-1`` infers it. A pair
        ``(replica, shard)`` asks for hybrid sharding (HSDP): the batch is split over all
        ``replica x shard`` devices, model state is sharded over ``shard`` (mesh axis ``dp``) and
        replicated over ``replica`` (mesh axis ``replica``), so weight gathers stay inside a shard
        group and only the gradient shards are all-reduced across groups. Either may be ``-1``.
      tp: tensor-parallel size. ``-1`` infers it.
      pp: pipeline-parallel size. ``-1`` infers it.
      cp: context-parallel size: each sequence is split along its length over ``cp`` devices (attention
        gathers the keys and values it needs); ZeRO shards model state over ``dp x cp``. ``-1`` infers it.
      ep: expert-parallel size: a mixture-of-experts model's experts are split over ``ep`` devices and tokens
        reach them by an all-to-all; for everything else ``ep`` is one more data axis (the batch and ZeRO's
        shards are split over ``dp x ep``). ``-1`` infers it.
      devices: the devices to use; all of ``jax.devices()`` by default.

    Returns:
      A :class:`jax.sharding.Mesh` with axis names ``("pp", "replica", "dp", "ep", "cp", "tp")``.

    Raises:
      ValueError: if the sizes do not multiply to the number of devices, or more than one is -1.

    Example:
      >>> mesh = zjax.make_mesh(dp=-1, tp=2)      # 8 devices -> dp=4, tp=2
      >>> mesh = zjax.make_mesh(dp=(2, 4))        # HSDP: 2 replicas of a 4-way ZeRO group
      >>> mesh = zjax.make_mesh(dp=2, cp=4)       # each sequence split over 4 devices
      >>> mesh = zjax.make_mesh(dp=2, ep=4)       # experts split over 4 devices
    """
    devices = list(jax.devices() if devices is None else devices)
    replica, shard = _split_dp(dp)
    sizes = _resolve_sizes({REPLICA: replica, DP: shard, EP: ep, CP: cp, TP: tp, PP: pp}, len(devices))
    shape = tuple(sizes[name] for name in MESH_AXES)
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    slices = _slices(devices)
    if slices > 1:
        dcn = dcn_split(sizes, slices)
        ici = tuple(sizes[n] // dcn[n] for n in MESH_AXES)
        array = mesh_utils.create_hybrid_device_mesh(ici, tuple(dcn[n] for n in MESH_AXES), devices)
        return Mesh(array, MESH_AXES, axis_types=axis_types)
    return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)


def axis_size(mesh: Mesh, name: str) -> int:
    """The size of mesh axis ``name``, or 1 if the mesh has no such axis."""
    return int(mesh.shape.get(name, 1))


def data_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes the batch is split over (``replica``, ``dp`` and ``ep`` where larger than 1)."""
    axes = tuple(a for a in DATA_AXES if axis_size(mesh, a) > 1)
    return axes or tuple(a for a in (DP,) if a in mesh.shape)


def data_size(mesh: Mesh) -> int:
    """Into how many parts the batch is split: ``replica x dp x ep``."""
    return math.prod(axis_size(mesh, a) for a in DATA_AXES)


def zero_axes(mesh: Mesh, taken: Collection[str] = (), hierarchical: bool = False) -> tuple[str, ...]:
    """The axes ZeRO shards model state over on ``mesh``: ``dp``, and ``ep`` and ``cp`` when larger than 1, less
    the axes in ``taken`` (those a parameter's compute spec already splits it over: an expert's ``ep``).
    ``hierarchical`` (ZeRO++'s hpZ, ``Plan(hpz=True)``): ``replica`` too, innermost, so that gathering a shard
    over ``replica`` alone gives its node's ``dp`` shard."""
    axes = tuple(a for a in ZERO_AXES if (a == DP or axis_size(mesh, a) > 1) and a not in taken)
    return axes + ((REPLICA,) if hierarchical and axis_size(mesh, REPLICA) > 1 else ())


def zero_size(mesh: Mesh, taken: Collection[str] = (), hierarchical: bool = False) -> int:
    """ZeRO's ``N``: into how many shards a stage splits model state (``dp x ep x cp``; ``dp x cp`` for the
    experts, ``taken`` = ``("ep",)``; times ``replica`` when ``hierarchical``)."""
    return math.prod(axis_size(mesh, a) for a in ZERO_AXES if a not in taken) * (
        axis_size(mesh, REPLICA) if hierarchical else 1
    )


def zero_target(mesh: Mesh, taken: Collection[str] = (), hierarchical: bool = False) -> str | tuple[str, ...]:
    """:func:`zero_axes` as one ``PartitionSpec`` entry (``"dp"`` or ``("dp", "cp")``)."""
    axes = zero_axes(mesh, taken, hierarchical) or (DP,)
    return axes[0] if len(axes) == 1 else axes


def data_target(mesh: Mesh) -> str | tuple[str, ...] | None:
    """:func:`data_axes` as one ``PartitionSpec`` entry."""
    axes = data_axes(mesh)
    return None if not axes else axes[0] if len(axes) == 1 else axes


def process_spans(mesh: Mesh) -> dict[str, bool]:
    """For each mesh axis, whether some group along it spans more than one process."""
    out = {}
    for i, name in enumerate(mesh.axis_names):
        moved = mesh.devices.swapaxes(i, -1).reshape(-1, mesh.devices.shape[i])
        out[name] = any(len({d.process_index for d in group}) > 1 for group in moved)
    return out


_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("zjax_mesh_platform", default=None)


@contextlib.contextmanager
def use_mesh_platform(mesh: Mesh) -> Iterator[None]:
    """Record the platform of ``mesh``'s devices while a step is traced (``jax.sharding.get_mesh`` cannot be
    asked inside ``jit``): a deviceless GPU mesh says ``"gpu"`` although this process runs on a CPU."""
    token = _PLATFORM.set(str(mesh.devices.flat[0].platform))
    try:
        yield
    finally:
        _PLATFORM.reset(token)


def mesh_platform() -> str:
    """The platform of the devices the traced step runs on (:func:`use_mesh_platform`), else JAX's default."""
    return _PLATFORM.get() or jax.default_backend()


_MANUAL: contextvars.ContextVar[bool] = contextvars.ContextVar("zjax_manual_data_axes", default=False)


@contextlib.contextmanager
def manual_data_axes() -> Iterator[None]:
    """Mark code traced inside a ``shard_map`` that is manual over the data axes (the pipeline, per-rank
    gradients): custom partitioners such as cuDNN attention's cannot partition there."""
    token = _MANUAL.set(True)
    try:
        yield
    finally:
        _MANUAL.reset(token)


def in_manual_data_axes() -> bool:
    return _MANUAL.get()
