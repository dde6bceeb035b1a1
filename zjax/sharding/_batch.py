"""Put a host batch on the mesh, split over the data-parallel axis."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._annotations import path_str
from ._axes import DP
from ._mesh import axis_size


def batch_spec(ndim: int) -> PartitionSpec:
    """The spec of a batch leaf: the leading (example) dimension over ``dp``."""
    return PartitionSpec(DP, *([None] * (ndim - 1))) if ndim else PartitionSpec()


def batch_shardings(batch: Any, mesh: Mesh) -> Any:
    """A tree of ``NamedSharding`` matching ``batch`` (arrays or ``ShapeDtypeStruct``)."""
    return jax.tree.map(lambda x: NamedSharding(mesh, batch_spec(np.ndim(x))), batch)


def check_batch(batch: Any, mesh: Mesh, multiple: int = 1, *, what: str = "batch") -> None:
    """Raise ``ValueError`` unless every leaf's leading dim splits into ``dp * multiple`` equal parts."""
    dp = axis_size(mesh, DP)
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = tuple(np.shape(x))
        if not shape:
            raise ValueError(
                f"{what} leaf {path_str(path)!r} is a scalar; every batch leaf needs a leading example "
                "dimension to split over the data-parallel axis."
            )
        if shape[0] % (dp * multiple):
            extra = f" x accum_steps={multiple}" if multiple > 1 else ""
            raise ValueError(
                f"{what} leaf {path_str(path)!r} has shape {shape}: its leading dimension {shape[0]} is not "
                f"divisible by mesh axis {DP!r} of size {dp}{extra} = {dp * multiple}. Use a global batch "
                f"size that is a multiple of {dp * multiple}."
            )


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """Place a batch on ``mesh`` with its leading dimension split over ``dp``.

    In a single process ``batch`` is the global batch. With several processes each passes its own
    rows (the global batch is their concatenation in process order) and gets the global array.

    Raises:
      ValueError: if a leaf's leading dimension does not divide by the dp size.
    """
    if jax.process_count() == 1:
        check_batch(batch, mesh)
        return jax.device_put(batch, batch_shardings(batch, mesh))
    return jax.tree.map(
        lambda x, s: jax.make_array_from_process_local_data(s, np.asarray(x)),
        batch,
        batch_shardings(batch, mesh),
    )
