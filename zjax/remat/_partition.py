"""ZeRO-R partitioned activation checkpoints (Rajbhandari et al., SC'20, §6.1 "P_a").

With tensor parallelism every tp rank holds the same copy of a layer's input, and remat saves that
input for the backward pass on every rank. Partitioning stores each rank's slice of it (split along
the sequence) and all-gathers it when the layer is recomputed: saved-checkpoint bytes drop by the tp size.

The gather is a ``shard_map`` over ``tp`` on purpose: with a plain sharding constraint XLA moves the
all-gather in front of the scan's residual store and keeps the replicated copy (measured: the stacked
residual stayed ``[layers, batch, seq, embed]``); behind the ``shard_map`` boundary the stack is stored
split (``[layers, batch, seq / tp, embed]``).
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec

from ..sharding._axes import TP


def _tp_size() -> int:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or TP not in mesh.axis_names:
        return 1
    return int(mesh.shape[TP])


def _spec(ndim: int, axis: int) -> PartitionSpec:
    return PartitionSpec(*[TP if d == axis else None for d in range(ndim)])


def partition_checkpoint(x: jax.Array, axis: int = 1) -> jax.Array:
    """Split ``x`` over ``tp`` along ``axis`` (a layer's output, i.e. the next layer's saved input).

    A no-op without a mesh context, with tp = 1, or when ``axis`` does not divide by the tp size.
    """
    tp = _tp_size()
    if tp == 1 or x.shape[axis] % tp:
        return x
    unconstrained = PartitionSpec.UNCONSTRAINED
    spec = PartitionSpec(*[TP if d == axis else unconstrained for d in range(x.ndim)])
    return jax.lax.with_sharding_constraint(x, spec)


def gather_checkpoint(x: jax.Array, axis: int = 1) -> jax.Array:
    """All-gather a :func:`partition_checkpoint`-ed tensor over ``tp`` for computing with it."""
    tp = _tp_size()
    if tp == 1 or x.shape[axis] % tp:
        return x
    return jax.shard_map(
        lambda a: jax.lax.all_gather(a, TP, axis=axis, tiled=True),
        in_specs=_spec(x.ndim, axis),
        out_specs=PartitionSpec(),
        axis_names={TP},
        check_vma=False,
    )(x)
