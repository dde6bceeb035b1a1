"""An embedding lookup where the table lies: ZeRO-3 splits the table along its hidden dim over ``dp`` (and ``cp``),
so each rank looks up every token's slice of its hidden columns and an all-to-all hands each rank its own rows
whole (its batch rows over ``dp``, its sequence chunk over ``cp``).

The table is never gathered (GSPMD would gather it whole, forward and in the recomputed forward, and
reduce-scatter its gradient: three table-sized collectives per step); the token ids cross ``dp`` once
(int32, ``B x S`` each) and the activations twice (forward, and the gradient back): for Llama-2-7B on 8 GPUs with
4,096 tokens each, 0.07 GB per step in place of the table's 0.79 GB. The table's gradient is made on its own
shard (a scatter-add of every token's gradient slice) and needs no reduction over ``dp``. (With ``cp`` GSPMD's own
lookup left the table split over ``dp x cp``, looked up every token's columns and then had no way from that
layout to the activations' ``[dp, cp]`` one but to replicate the whole ``[B, S, E]`` activation and slice it,
forward and backward: XLA's "involuntary full rematerialization".)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..sharding._axes import CP, DATA_AXES, DP
from ._gather import _axes, gathered, manual_placement, placement
from ._reduce import reduce


def lookup(table: jax.Array, ids: jax.Array, path: Sequence[str]) -> jax.Array:
    """``table[ids]`` (``[V, E]`` and ``[B, S]`` -> ``[B, S, E]``) for the parameter at ``path``: local to each
    rank's hidden columns when ZeRO-3 split them over ``dp`` or ``dp x cp`` (the vocabulary unsplit, no
    ``replica``/``ep``/``pp``), else the table as :func:`gathered` reads it."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(mesh.shape) if not mesh.empty else {}
    inside = manual_placement(path)
    if inside is not None:
        return _manual_lookup(table, ids, path, sizes, *inside)
    found = placement(path)
    local = (
        found is not None
        and table.ndim == 2
        and ids.ndim == 2
        and found[0][0] is None  # the vocabulary is not split (tp splits it: GSPMD's vocab-parallel lookup)
        and found[0][1] is not None
        and set(_axes(found[0][1])) == {DP, CP} & {a for a in sizes if sizes[a] > 1 or a == DP}
        and set(_axes(found[0][1])) <= set(found[1])
        # with replica (HSDP) XLA:CPU aborts compiling the lookup's transpose ("Invalid binary instruction opcode
        # copy", jaxlib 0.10.2): GSPMD gathers the table there; the manual path above handles replica
        and all(sizes.get(a, 1) == 1 for a in ("replica", "ep", "pp"))
    )
    if not local or found is None:
        return _take(table, ids, path, sizes)
    axes = _axes(found[0][1])  # the hidden columns' split, in its order
    n, dp, cp = math.prod(sizes[a] for a in axes), sizes[DP], sizes.get(CP, 1)
    if ids.shape[0] % dp or ids.shape[1] % cp or table.shape[1] % n:
        return _take(table, ids, path, sizes)
    rows = P(DP, CP) if cp > 1 else P(DP)

    def rank(t: jax.Array, i: jax.Array) -> jax.Array:
        every = jax.lax.all_gather(i, DP, axis=0, tiled=True)  # every token id
        if cp > 1:
            every = jax.lax.all_gather(every, CP, axis=1, tiled=True)
        cols = jnp.take(t, every, axis=0)  # [B, S, E / n]: every token, this rank's hidden columns
        b, s, e = cols.shape
        # one block of rows per rank, in the order the columns are split: [n, B / dp, S / cp, E / n]
        blocks = cols.reshape(dp, b // dp, cp, s // cp, e).transpose(0, 2, 1, 3, 4)
        if axes == (CP, DP):
            blocks = blocks.transpose(1, 0, 2, 3, 4)
        blocks = blocks.reshape(n, b // dp, s // cp, e)
        return jax.lax.all_to_all(blocks, axes, 0, 3, tiled=True)[0]  # [B / dp, S / cp, E]

    return jax.shard_map(rank, in_specs=(P(None, axes), rows), out_specs=rows, axis_names=set(axes), check_vma=True)(
        table, ids
    )


def _take(table: jax.Array, ids: jax.Array, path: Sequence[str], sizes: dict) -> jax.Array:
    """``table[ids]`` by GSPMD, the table as :func:`gathered` reads it.

    With ``cp`` (the rows' batch and sequence dims both split), or with more than one data axis (HSDP's ``replica`` x
    ``dp``), the table is whole over the ZeRO axes before the lookup (stage 3), and the ids go in as one flat dim
    split over the data axes and ``cp`` and nothing else (each rank's block of rows and sequence chunk side by side:
    no data moves), so that the table's gradient is a scatter-add of updates split along one dim, summed and then
    split as the stage keeps it. Left to GSPMD, the gradient's split of the hidden dim over ``dp`` (``x cp``) reached
    back into the updates, split over those axes along other dims, and it replicated the whole activation gradient to
    meet it (XLA's "involuntary full rematerialization")."""
    data = tuple(a for a in DATA_AXES if sizes.get(a, 1) > 1)
    if (sizes.get(CP, 1) == 1 and len(data) < 2) or ids.ndim != 2:
        return jnp.take(gathered(table, path), ids, axis=0)
    n, cp = math.prod(sizes[a] for a in data), sizes[CP]
    (b, s), e = ids.shape, table.shape[-1]
    if b % n:
        return jnp.take(gathered(table, path), ids, axis=0)
    # [B, S] -> [n, cp, B/n, S/cp] (rank-major, its rows and chunk inside) -> flat, split over (data..., cp)
    rows = (*data, CP) if cp > 1 else data
    blocks = ids.reshape(n, b // n, cp, s // cp).transpose(0, 2, 1, 3)
    flat = jax.lax.with_sharding_constraint(blocks.reshape(-1), P(rows))
    whole = gathered(table, path, now=True)
    if e % (n * cp) == 0:  # its gradient first summed into a split over the rows' axes, then laid out as kept
        whole = _gradient_split(whole, P(None, rows))
    out = jax.lax.with_sharding_constraint(jnp.take(whole, flat, axis=0), P(rows, None))
    return out.reshape(n, cp, b // n, s // cp, e).transpose(0, 2, 1, 3, 4).reshape(b, s, e)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gradient_split(table: jax.Array, spec: P) -> jax.Array:
    """``table``, whose gradient is laid out as ``spec`` where it is made: the scatter-add of updates split over the
    same axes along their rows, reduce-scattered onto the hidden dim (with HSDP's ``replica`` among them, GSPMD went
    straight for the stage's split over ``dp`` alone, which it cannot reach from updates split over ``replica x
    dp``, and replicated the activation gradient to get there)."""
    return table


def _gradient_split_fwd(table: jax.Array, spec: P) -> tuple[jax.Array, None]:
    return table, None


def _gradient_split_bwd(spec: P, _: None, g: jax.Array) -> tuple[jax.Array]:
    return (jax.lax.with_sharding_constraint(g, spec),)


_gradient_split.defvjp(_gradient_split_fwd, _gradient_split_bwd)


def _manual_lookup(
    table: jax.Array, ids: jax.Array, path: Sequence[str], sizes: dict, spec: tuple, manual: Any
) -> jax.Array:
    """:func:`lookup` inside a step manual over the data axes (``zjax.comm.manual``): ``table`` is this rank's
    shard of the fp32 master, ``ids`` this rank's rows. Its gradient is made on the shard; summed over the data
    axes the table is not split on (``replica``) as the region's reduction says."""
    split = tuple(a for a in _axes(spec[1]) if a in manual.axes) if spec[1] is not None else ()
    others = [a for a in sizes if a not in manual.axes and sizes[a] > 1]
    if table.ndim != 2 or ids.ndim != 2 or spec[0] is not None or split != (DP,) or others:
        return jnp.take(gathered(table, path), ids, axis=0)
    whole = tuple(a for a in manual.axes if a != DP)

    @jax.custom_vjp
    def read(t: jax.Array) -> jax.Array:
        return t.astype(manual.dtype)

    def fwd(t: jax.Array) -> tuple[jax.Array, jax.Array]:
        return read(t), jnp.zeros((0,), t.dtype)

    def bwd(like: jax.Array, g: jax.Array) -> tuple[jax.Array]:
        return (reduce(g, (), None, whole, manual.reduction).astype(like.dtype),)

    read.defvjp(fwd, bwd)
    every = jax.lax.all_gather(ids, DP, axis=0, tiled=True)
    cols = jnp.take(read(table), every, axis=0)
    return jax.lax.all_to_all(cols, DP, 0, 2, tiled=True)
