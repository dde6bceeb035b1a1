"""Put one more mesh axis (ZeRO's ``dp``, or ``dp x cp``) on top of a leaf's spec."""

from __future__ import annotations

import math

from jax.sharding import PartitionSpec


def _axes(entry: object) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)  # type: ignore[arg-type]


LOOKUP_TABLES = (("vocab", "embed"),)
"""Logical names of tables read by row (an embedding): ZeRO splits their other dim when it can, so that a lookup
runs on each rank's hidden columns with no gather (:func:`zjax.comm.lookup`); split along the rows, every rank
would need every token's row. (A head ``("embed", "vocab")`` is read whole by a matmul: it keeps the usual
choice, the largest dim.)"""


def add_axis(
    spec: PartitionSpec,
    shape: tuple[int, ...],
    axis: str | tuple[str, ...],
    sizes: dict[str, int],
    dim_names: tuple[str | None, ...] | None = None,
) -> tuple[PartitionSpec, str | None]:
    """Shard ``shape`` additionally over mesh ``axis`` (a name, or a tuple of names that split one dimension
    together, outermost first: ZeRO's ``("dp", "cp")``).

    The axis goes on the largest dimension that is not yet sharded and divides by the axis size
    (earliest such dimension on a tie); for a table read by row (``dim_names`` in :data:`LOOKUP_TABLES`) not its
    first (row) dim when another can take the axis. Failing that, it is stacked onto an already sharded dimension
    whose size divides by the product of its axes and ``axis`` (e.g. ``("tp", "dp")`` on a tp-sharded
    bias). A leaf that can take neither stays as it is.

    Returns:
      ``(new_spec, None)`` or ``(spec, reason)`` when the leaf cannot be sharded over ``axis``.
    """
    names = _axes(axis)
    size = math.prod(sizes[a] for a in names)
    if size == 1:
        return spec, None
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if not shape:
        return spec, "scalar"
    free = [d for d, e in enumerate(entries) if e is None and shape[d] % size == 0]
    if free:
        avoid = [0] if dim_names is not None and tuple(dim_names) in LOOKUP_TABLES else []
        dim = max([d for d in free if d not in avoid] or free, key=lambda d: (shape[d], -d))
        entries[dim] = axis
    else:
        stacked = [
            d
            for d, e in enumerate(entries)
            if e is not None and shape[d] % (math.prod(sizes[a] for a in _axes(e)) * size) == 0
        ]
        if not stacked:
            return spec, f"no dimension of shape {shape} is divisible by {'x'.join(names)}={size}"
        dim = max(stacked, key=lambda d: (shape[d], -d))
        entries[dim] = (*_axes(entries[dim]), *names)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries), None


def shard_count(spec: PartitionSpec, sizes: dict[str, int]) -> int:
    """Into how many pieces ``spec`` cuts a leaf."""
    return math.prod(sizes[a] for entry in spec for a in _axes(entry))
