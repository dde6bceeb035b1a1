"""Put a batch on the mesh, split over the data-parallel axes (``replica`` x ``dp``)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._annotations import path_str
from ._mesh import data_axes, data_size, data_target


def batch_spec(ndim: int, mesh: Mesh) -> PartitionSpec:
    """The spec of a batch leaf on ``mesh``: the leading (example) dimension over the data axes."""
    return PartitionSpec(data_target(mesh), *([None] * (ndim - 1))) if ndim else PartitionSpec()


def batch_shardings(batch: Any, mesh: Mesh) -> Any:
    """A tree of ``NamedSharding`` matching ``batch`` (arrays or ``ShapeDtypeStruct``)."""
    return jax.tree.map(lambda x: NamedSharding(mesh, batch_spec(np.ndim(x), mesh)), batch)


def _axes_text(mesh: Mesh) -> str:
    axes = data_axes(mesh)
    return " x ".join(f"{a!r}" for a in axes) + f" of size {data_size(mesh)}"


def _leaves(batch: Any, what: str) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = tuple(np.shape(x))
        if not shape:
            raise ValueError(
                f"{what} leaf {path_str(path)!r} is a scalar; every batch leaf needs a leading example "
                "dimension to split over the data-parallel axes."
            )
        out.append((path_str(path), shape))
    return out


def check_batch(batch: Any, mesh: Mesh, multiple: int = 1, *, what: str = "batch") -> None:
    """Raise ``ValueError`` unless every leaf's leading dim splits into ``replica x dp x multiple`` equal parts."""
    n = data_size(mesh)
    for path, shape in _leaves(batch, what):
        if shape[0] % (n * multiple):
            extra = f" x accum_steps={multiple}" if multiple > 1 else ""
            raise ValueError(
                f"{what} leaf {path!r} has shape {shape}: its leading dimension {shape[0]} is not divisible "
                f"by mesh axis {_axes_text(mesh)}{extra} = {n * multiple}. Use a global batch size that "
                f"is a multiple of {n * multiple}."
            )


def local_batch_parts(mesh: Mesh) -> int:
    """How many of the batch's ``replica x dp`` parts this process's devices hold.

    Each process feeds exactly those rows to :func:`shard_batch`: ``global_batch * parts / (replica x dp)``
    (:func:`process_rows` cuts them from a global batch). When every device of this process sits in
    one data-parallel group (tp or pp spanning processes), that is one part shared with other
    processes, which must then feed the same rows.
    """
    return len(_local_parts(mesh))


def _local_parts(mesh: Mesh) -> list[int]:
    names = list(mesh.axis_names)
    index = [names.index(a) for a in data_axes(mesh)]
    sizes = [mesh.devices.shape[i] for i in index]
    me = jax.process_index()
    devices: Any = mesh.devices
    parts = {
        int(np.ravel_multi_index(tuple(pos[i] for i in index), sizes)) if index else 0
        for pos in np.ndindex(*devices.shape)
        if devices[pos].process_index == me
    }
    return sorted(parts)


def process_row_range(rows: int, mesh: Mesh) -> tuple[int, int]:
    """``(start, stop)``: the rows of a global batch of ``rows`` that this process feeds to :func:`shard_batch`
    (a data loader reads only these).

    Raises:
      ValueError: if ``rows`` does not split over the data axes, or this process's parts are not
        contiguous (a mesh not built by :func:`zjax.make_mesh`).
    """
    parts, n = _local_parts(mesh), data_size(mesh)
    if rows % n:
        raise ValueError(
            f"process_row_range: a global batch of {rows} rows does not split over the data axes "
            f"({_axes_text(mesh)}, {n} parts); use a multiple of {n}."
        )
    if parts != list(range(parts[0], parts[0] + len(parts))):
        raise ValueError(
            f"process_rows: process {jax.process_index()} holds data-parallel parts {parts} of {n}, which are not "
            "contiguous; build the mesh with zjax.make_mesh, which keeps each process's devices together."
        )
    return rows // n * parts[0], rows // n * (parts[-1] + 1)


def process_rows(batch: Any, mesh: Mesh) -> Any:
    """The rows of a global batch (the same on every process) that this process feeds to :func:`shard_batch`.

    Raises:
      ValueError: if the batch does not split over the data axes, or this process's parts are not
        contiguous (a mesh not built by :func:`zjax.make_mesh`).
    """
    check_batch(batch, mesh, what="process_rows: batch")
    start, stop = process_row_range(len(jax.tree.leaves(batch)[0]), mesh)
    return jax.tree.map(lambda x: x[start:stop], batch)


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """Place a batch on ``mesh`` with its leading dimension split over the data axes (``replica`` x ``dp``).

    In a single process ``batch`` is the global batch. With several processes each passes the rows
    its devices hold (:func:`local_batch_parts` parts; the global batch is their concatenation in
    process order) and gets the global array. Processes whose devices share data-parallel parts
    (tp spanning processes) pass the same rows.

    Raises:
      ValueError: if a leaf's leading dimension does not split into the parts this process holds
        (raised on that process, before any communication).
    """
    if jax.process_count() == 1:
        check_batch(batch, mesh)
        return jax.device_put(batch, batch_shardings(batch, mesh))
    parts, n = local_batch_parts(mesh), data_size(mesh)
    rows = None
    for path, shape in _leaves(batch, "shard_batch: local batch"):
        if shape[0] % parts or (rows is not None and shape[0] != rows):
            raise ValueError(
                f"shard_batch on process {jax.process_index()} of {jax.process_count()}: local batch leaf "
                f"{path!r} has shape {shape}, but this process holds {parts} of the {n} data-parallel parts "
                f"({_axes_text(mesh)}), so every leaf needs the same number of rows, a multiple of {parts} "
                f"(global batch = rows x {n // parts}). Pass this process's rows, not the global batch."
            )
        rows = shape[0]

    def make(x: Any, sharding: NamedSharding) -> jax.Array:
        local = np.asarray(x)
        global_shape = (local.shape[0] * n // parts, *local.shape[1:])
        return jax.make_array_from_process_local_data(sharding, local, global_shape)

    return jax.tree.map(make, batch, batch_shardings(batch, mesh))
