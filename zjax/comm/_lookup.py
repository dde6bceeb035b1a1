"""An embedding lookup where the table lies: ZeRO-3 splits the table along its hidden dim over ``dp``, so each rank
looks up every token's slice of its hidden columns and an all-to-all hands each rank its own rows whole.

The table is never gathered (GSPMD would gather it whole, forward and in the recomputed forward, and
reduce-scatter its gradient: three table-sized collectives per step); the token ids cross ``dp`` once
(int32, ``B x S`` each) and the activations twice (forward, and the gradient back): for Llama-2-7B on 8 GPUs with
4,096 tokens each, 0.07 GB per step in place of the table's 0.79 GB. The table's gradient is made on its own
shard (a scatter-add of every token's gradient slice) and needs no reduction over ``dp``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..sharding._axes import DATA_AXES, DP
from ._gather import _axes, gathered, placement


def lookup(table: jax.Array, ids: jax.Array, path: Sequence[str]) -> jax.Array:
    """``table[ids]`` (``[V, E]`` and ``[B, S]`` -> ``[B, S, E]``) for the parameter at ``path``: local to each
    rank's hidden columns when ZeRO-3 split them over ``dp`` (the vocabulary unsplit, no ``ep``/``cp``/``pp``),
    else the table as :func:`gathered` reads it."""
    found = placement(path)
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(mesh.shape) if not mesh.empty else {}
    local = (
        found is not None
        and table.ndim == 2
        and ids.ndim == 2
        and found[0][0] is None  # the vocabulary is not split (tp splits it: GSPMD's vocab-parallel lookup)
        and found[0][1] is not None
        and set(_axes(found[0][1])) == {DP}
        and DP in found[1]
        and all(sizes.get(a, 1) == 1 for a in ("ep", "cp", "pp"))
    )
    if not local:
        return jnp.take(gathered(table, path), ids, axis=0)
    data = tuple(a for a in DATA_AXES if sizes.get(a, 1) > 1 or a == DP)
    n = sizes[DP]
    if ids.shape[0] % (n * max(1, sizes.get("replica", 1))) or table.shape[1] % n:
        return jnp.take(gathered(table, path), ids, axis=0)

    def rank(t: jax.Array, i: jax.Array) -> jax.Array:
        every = jax.lax.all_gather(i, DP, axis=0, tiled=True)  # this replica's token ids, all of them
        cols = jnp.take(t, every, axis=0)  # [B / replica, S, E / dp]: every token, this rank's hidden columns
        return jax.lax.all_to_all(cols, DP, 0, 2, tiled=True)  # [B / (replica dp), S, E]

    return jax.shard_map(
        rank, in_specs=(P(None, DP), P(data)), out_specs=P(data), axis_names=set(data), check_vma=True
    )(table, ids)
