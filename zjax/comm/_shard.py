"""A rank's shard gathered whole inside a region manual over the axes it is split on, its gradient reduced back."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..sharding import REPLICA
from ..sharding._mesh import mesh_platform
from ._quantize import Wire, all_gather
from ._reduce import Reduction, reduce


def shard_gather(x: jax.Array, axis: str, dim: int, wire: Wire | None, reduction: Reduction | None = None) -> jax.Array:
    """This rank's shard ``x`` all-gathered over ``axis`` along ``dim`` (as ``wire``'s integer blocks when given);
    its gradient reduce-scattered back into the shard in the gradient's dtype (the straight-through estimator
    when quantized), or as ``reduction`` says when it quantizes (:func:`zjax.comm.reduce`)."""

    @jax.custom_vjp
    def run(v: jax.Array) -> jax.Array:
        return all_gather(v, axis, dim, wire)

    def fwd(v: jax.Array) -> tuple[jax.Array, jax.Array]:
        return run(v), jnp.zeros((0,), v.dtype)

    def bwd(like: jax.Array, g: jax.Array) -> tuple[jax.Array]:
        if reduction is not None and reduction.wire is not None:
            return (reduce(g, (axis,), dim, (), reduction).astype(like.dtype),)
        # XLA:CPU aborts on 16-bit reductions in a region manual over some axes (jax 0.10.2) and widens them anyway
        wide = mesh_platform() == "cpu" and jnp.finfo(g.dtype).bits < 32
        out = jax.lax.psum_scatter(g.astype(jnp.float32) if wide else g, axis, scatter_dimension=dim, tiled=True)
        return (out.astype(like.dtype),)

    run.defvjp(fwd, bwd)
    return run(x)


def to_node(x: jax.Array, spec: P, dtype: Any, reduction: Reduction, weights: Wire | None):
    """hpZ inside a region manual over the data axes: this rank's shard ``x`` (``spec``: its manual spec,
    ``replica`` innermost in its dim) cast to ``dtype`` and gathered over ``replica`` into its node's shard (as
    ``weights``' integer blocks when given), once per microbatch; the node shard's gradient (summed over ``dp`` per
    layer by :func:`gathered`) is reduced over ``replica`` into ``x``'s shard as ``reduction`` says (int8
    all-to-alls when quantized). With ``reduction.dtype`` (``Plan(reduce_dtype=...)``) the node shard is held in
    that dtype once gathered, so that its gradient stays in it from the sums over ``dp`` to the one over
    ``replica``: the wire still carries ``dtype``, the temporaries hold the wider node shard."""
    dims = [d for d, e in enumerate(spec) if e is not None and REPLICA in (e if isinstance(e, tuple) else (e,))]
    dim = dims[0] if dims else None
    hold = reduction.dtype if reduction.dtype is not None and reduction.wire is None else dtype

    def gather(v: jax.Array) -> jax.Array:
        if dim is None:
            return v.astype(hold)
        return all_gather(v.astype(dtype), REPLICA, dim, weights).astype(hold)

    @jax.custom_vjp
    def run(v: jax.Array) -> jax.Array:
        return gather(v)

    def fwd(v: jax.Array) -> tuple[jax.Array, jax.Array]:
        return gather(v), jnp.zeros((0,), v.dtype)

    def bwd(like: jax.Array, g: jax.Array) -> tuple[jax.Array]:
        split, whole = ((REPLICA,), ()) if dim is not None else ((), (REPLICA,))
        return (reduce(g, split, dim, whole, reduction).astype(like.dtype),)

    run.defvjp(fwd, bwd)
    return run(x) if jnp.issubdtype(x.dtype, jnp.floating) else x
