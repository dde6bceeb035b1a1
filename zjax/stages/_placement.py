"""Put one more mesh axis (ZeRO's ``dp``, or ``dp x cp``) on top of a leaf's spec."""

from __future__ import annotations

import math

from jax.sharding import PartitionSpec

from ..remat import LAYERS, STACKED


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
    bias). Failing that too, several axes (``("dp", "ep")``) are split over two free dimensions, the outer
    axes on one and the inner on the other (DeepSeek-V3's ``wq_b`` ``[1536, 128, 192]`` on ``dp=32 x ep=32``:
    no dimension divides by 1,024, ``dp`` takes the 1,536 and ``ep`` the 192). A leaf that can take none of
    these stays as it is.

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
        split = _split(entries, shape, names, sizes, dim_names) if not stacked else None
        if not stacked and split is None:
            return spec, f"no dimension of shape {shape} is divisible by {'x'.join(names)}={size}"
        if split is not None:
            for dim, part in split:
                entries[dim] = part[0] if len(part) == 1 else part
        else:
            dim = max(stacked, key=lambda d: (shape[d], -d))
            entries[dim] = (*_axes(entries[dim]), *names)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries), None


def _split(
    entries: list,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    sizes: dict[str, int],
    dim_names: tuple[str | None, ...] | None,
) -> list[tuple[int, tuple[str, ...]]] | None:
    """Two free dimensions that take ``names[:i]`` and ``names[i:]`` (the largest pair that divides), or ``None``.
    Never a stack's layers dimension: a layer scan would gather the whole stack to slice one layer."""
    free = [d for d, e in enumerate(entries) if e is None and not (dim_names and dim_names[d] in (LAYERS, STACKED))]
    best = None
    for i in range(1, len(names)):
        outer, inner = names[:i], names[i:]
        a, b = math.prod(sizes[n] for n in outer), math.prod(sizes[n] for n in inner)
        for d1 in free:
            for d2 in free:
                if d1 != d2 and shape[d1] % a == 0 and shape[d2] % b == 0:
                    key = (shape[d1] + shape[d2], -d1, -d2)
                    if best is None or key > best[0]:
                        best = (key, [(d1, outer), (d2, inner)])
    return None if best is None else best[1]


def shard_count(spec: PartitionSpec, sizes: dict[str, int]) -> int:
    """Into how many pieces ``spec`` cuts a leaf."""
    return math.prod(sizes[a] for entry in spec for a in _axes(entry))
