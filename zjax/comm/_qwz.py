"""qwZ's gathers of a weight laid out by GSPMD (outside a region manual over the data axes): each rank quantizes its
shard in a ``shard_map`` and all-gathers the integer blocks; inside a pipeline stage (``Pipeline(zero3_gather=
"layer")``), whose per-stage ``vmap`` a ``shard_map`` cannot run in, the weight is quantized as it lies and its
blocks' layouts are pinned on both sides of the gather. The gradients go back unquantized."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..sharding._axes import REPLICA
from ._quantize import Wire, all_gather, dequantize, quantize


def across_replica(x: jax.Array, spec: P, node: P, wire: Wire) -> jax.Array:
    """hpZ with qwZ: ``x`` (split over ``replica x dp`` by ``spec``, ``replica`` innermost) gathered over ``replica``
    to its node's shard (``node``, the spec without ``replica``) as ``wire``'s blocks with fp32 scales, dequantized on
    arrival; its gradient reduce-scatters back over ``replica`` unquantized. A leaf not split over ``replica`` is
    constrained to ``node``."""
    dims = [d for d, entry in enumerate(spec) if entry is not None and REPLICA in _names(entry)]
    if not dims or not jnp.issubdtype(x.dtype, jnp.floating):
        return jax.lax.with_sharding_constraint(x, node)
    return quantized_gather(x, spec, node, dims[0], (REPLICA,), wire)


def quantized_gather(x: jax.Array, split: P, whole: P, dim: int, zero: tuple[str, ...], wire: Wire | None) -> jax.Array:
    """``x`` gathered over ``zero`` along ``dim``: as ``wire``'s integer blocks, or as it is (``None``)."""
    names = set(jax.sharding.get_abstract_mesh().axis_names)

    def forward(local: jax.Array) -> jax.Array:
        return all_gather(local, zero, dim, wire)

    @jax.custom_vjp
    def run(x: jax.Array) -> jax.Array:
        return jax.shard_map(forward, in_specs=split, out_specs=whole, axis_names=names, check_vma=False)(x)

    def fwd(x: jax.Array) -> tuple[jax.Array, None]:
        return run(x), None

    def bwd(_: None, g: jax.Array) -> tuple[jax.Array]:
        # g is each rank's partial sum (the weight-gradient dot over its rows): constrained to the split
        # layout, GSPMD reduce-scatters it, as it does the unquantized gather's gradient
        return (jax.lax.with_sharding_constraint(g, split),)

    run.defvjp(fwd, bwd)
    return run(x)


def pinned_gather(x: jax.Array, entries: list[Any], dim: int, zero: tuple[str, ...], wire: Wire) -> jax.Array:
    """``x``, laid out as ``entries`` (its ZeRO spec, one entry per dim; ``zero`` split ``dim`` as the minor part
    of its entry), whole over ``zero`` in ``x``'s dtype, having crossed them as ``wire``'s blocks with fp32 scales.

    The blocks run along the last dim on each rank's own tile: a last dim split over the mesh is viewed as
    ``[tiles, n / tiles]`` first, so a block never spans two ranks (the same blocks as a ``shard_map`` over the
    tiles). Both layouts of the integers and scales are pinned with sharding constraints, so the partitioner's
    one move between them is their all-gather. The gradient goes back unquantized, constrained to the split
    layout (a reduce-scatter in its dtype, as GSPMD's own gather's gradient)."""
    mesh = jax.sharding.get_abstract_mesh()
    local = set(mesh.manual_axes)  # a region's manual axes are already this rank's: not in a constraint
    entries = [_without(e, local) for e in entries]
    tiles = math.prod(dict(mesh.shape)[a] for a in _names(entries[-1]))
    shape = x.shape
    if tiles > 1:  # [..., n] -> [..., tiles, n / tiles]: the last dim's split on its own dim
        x = x.reshape(*shape[:-1], tiles, shape[-1] // tiles)
        entries = [*entries[:-1], entries[-1], None]
    kept = tuple(a for a in _names(entries[dim]) if a not in zero)
    whole = list(entries)
    whole[dim] = (kept if len(kept) > 1 else kept[0]) if kept else None
    split_spec, whole_spec = P(*entries), P(*whole)

    @jax.custom_vjp
    def run(x: jax.Array) -> jax.Array:
        q, scale = quantize(x, wire.block, wire.bits, kernel=False)  # a Pallas call would be replicated
        q, scale = (jax.lax.with_sharding_constraint(a, split_spec) for a in (q, scale))
        q, scale = (jax.lax.with_sharding_constraint(a, whole_spec) for a in (q, scale))
        return dequantize(q, scale, x.dtype)

    def fwd(x: jax.Array) -> tuple[jax.Array, None]:
        return run(x), None

    def bwd(_: None, g: jax.Array) -> tuple[jax.Array]:
        return (jax.lax.with_sharding_constraint(g, split_spec),)

    run.defvjp(fwd, bwd)
    return run(x).reshape(shape)


def _names(entry: Any) -> tuple[str, ...]:
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def _without(entry: Any, axes: set[str]) -> Any:
    kept = tuple(a for a in _names(entry) if a not in axes)
    return None if not kept else kept[0] if len(kept) == 1 else kept
