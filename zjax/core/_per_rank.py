"""Gradients made per data-parallel rank in a ``shard_map`` manual over the data axes, reduced by zjax.

GSPMD reduces a gradient where its dot makes it, in the dot's dtype. Three things need the reduction in zjax's
hands instead: accumulation at stages 0-1 (one reduction per step, not one per microbatch: DDP's ``no_sync``),
``Plan(reduce_dtype=...)`` (the sum in fp32), and ZeRO++'s quantized gradients (int8 through all-to-alls). Stages
0-2 hold each rank's whole gradient sum until the one reduction after the loop (:func:`grads_per_rank`). Stage 3
gathers and reduces per layer (:func:`zero3_grads`): the parameters enter as shards and the model's reads
(:func:`zjax.comm.gathered`) gather them and reduce their gradients.
"""

from __future__ import annotations

from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from .. import comm
from ..comm._shard import to_node
from ..pipeline._context import accumulating
from ..sharding._axes import DATA_AXES
from ..sharding._mesh import data_axes, data_size, manual_data_axes
from ..sharding._rules import Rules, spec_axes
from ._config import PlanConfig
from ._layout import StateLayout
from ._loss_fn import Loss
from ._objective import accumulate, seeded, split_output


def without_axes(rules: Any, drop: set[str]) -> tuple[tuple[str, Any], ...]:
    """Logical axis rules with the mesh axes in ``drop`` taken out of every target."""
    out = []
    for name, target in rules:
        axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
        kept = tuple(a for a in axes if a not in drop)
        out.append((name, None if not kept else kept[0] if len(kept) == 1 else kept))
    return tuple(out)


def _sum_leading(x: jax.Array) -> jax.Array:
    """Sum over the leading axis in ``x``'s own dtype (``jnp.sum`` would reduce bf16 in f32)."""
    return jax.lax.reduce(x, jnp.zeros((), x.dtype), jax.lax.add, (0,))


def split_over_data_axes(layout: StateLayout) -> list[str]:
    """The parameters whose compute spec splits them over a data axis (an expert over ``ep``): they cannot enter a
    region manual over the data axes whole."""
    return [p.leaf.path for p in layout.params.placements if set(spec_axes(p.compute)) & set(DATA_AXES)]


def defers_reduction(plan: PlanConfig, loss: Loss, layout: StateLayout, model_state: Any) -> bool:
    """Stages 0 and 1 with accumulation: reduce the gradients once per step, not once per microbatch."""
    return (
        loss.accum_steps > 1
        and not layout.stage.shard_gradients
        and plan.pipeline is None  # the pipeline reduces once per step at its own boundary
        and not jax.tree.leaves(model_state)  # batch statistics stay global-batch statistics
        and data_size(plan.mesh) > 1
        and not split_over_data_axes(layout)
    )


def _grad_fn(loss: Loss, scale: jax.Array, axes: tuple[str, ...], key: jax.Array, prepare=lambda p: p):
    """One rank's ``(params, carry, microbatch, i) -> (grads, (part, aux, carry))`` for :func:`accumulate`: the
    gradient of its share of the microbatch's objective (:func:`seeded` over the manual ``axes``)."""

    def scaled(p, b, i):
        p = prepare(p)
        b, kwargs = loss.arguments(b, key, i)
        out = loss.fn(p, b, **kwargs)
        part, aux = split_output(out)
        value, part = seeded(part, scale, axes)
        return value, (part, aux)

    def grad_fn(p, carry, b, i):
        grads, (part, aux) = jax.grad(scaled, has_aux=True)(p, b, i)
        return grads, (part, aux, carry)

    return grad_fn


def _per_rank(x: Any) -> Any:
    return jnp.asarray(x)[None]  # one entry per rank, split over the data axes


def grads_per_rank(
    plan: PlanConfig, loss: Loss, layout: StateLayout, params: Any, batch: Any, scale: jax.Array, rng: jax.Array
):
    """Accumulation without a reduction per microbatch (stages 0 and 1, like DDP's ``no_sync``); also the
    path of ``Plan(reduce_dtype=...)`` at stages 0-2, whose one reduction runs in that dtype.

    A ``shard_map`` manual over the data axes (tp stays with GSPMD) gives every data-parallel rank its
    own rows; it sums its microbatch gradients, unreduced, into its fp32 accumulator (each microbatch's
    share of the step's objective, :mod:`._objective`); after the loop the ranks' accumulators are summed
    once, straight into the optimizer's layout (a reduce-scatter at stage 1, an all-reduce at stage 0):
    ZeRO's 2 psi per step for every ``accum_steps``. Microbatch ``i`` holds the same rows as without it; each
    rank's dropout key is folded with its index (unless the loss takes ``rows``: :meth:`Loss.arguments`).
    """
    mesh = plan.mesh
    axes = data_axes(mesh)
    rules = without_axes(cast(Rules, plan.rules).activations_for(mesh), set(axes))

    def local(p, rows, key):
        key = loss.key(key, jax.lax.axis_index(axes))
        # each rank sees only its own rows: activation rules must not split them over the data axes again
        # under a pipeline its loop sums the microbatches' gradients in reduce_dtype too
        with nn.logical_axis_rules(rules), manual_data_axes(), accumulating(plan.reduce_dtype):
            grads, total, aux = _in_region(loss, scale, axes, key, p, rows)
        return jax.tree.map(_per_rank, grads), total, jax.tree.map(_per_rank, aux)

    data = PartitionSpec(axes)
    acc, total, auxes = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(PartitionSpec(), data, PartitionSpec()),
        out_specs=(data, PartitionSpec(), data),
        axis_names=set(axes),
        check_vma=False,
    )(params, batch, rng)
    # the one reduction of the step, in the gradients' own dtype as without accumulation (bf16 moves half
    # the bytes of the fp32 partial sums)
    reduce_in = plan.reduce_dtype  # Plan(reduce_dtype=...): the ranks' sums widened before the reduction
    grads = jax.tree.map(lambda a, p: _sum_leading(a.astype(reduce_in or p.dtype)), acc, params)
    aux = jax.tree.map(lambda a: jnp.mean(a, axis=0), auxes)
    return total, aux, grads


def _in_region(loss: Loss, scale: jax.Array, axes: tuple[str, ...], key: jax.Array, p: Any, rows: Any, prepare=None):
    """One rank's gradients (its share of the step's objective, over its microbatches), the step's
    :class:`LossSum` and the rank's aux."""
    grad_fn = _grad_fn(loss, scale, axes, key, *(() if prepare is None else (prepare,)))
    grads, total, aux, _ = accumulate(grad_fn, p, rows, loss.accum_steps)
    return grads, total, aux


def zero3_grads(
    plan: PlanConfig, loss: Loss, layout: StateLayout, primal: Any, batch: Any, scale: jax.Array, rng: jax.Array
):
    """Stage 3 with its gradients reduced by zjax (``Plan(reduce_dtype=...)``, ``quantized_comm`` with grads).

    ``primal`` is the fp32 master (or the compute parameters without master weights), split over the ZeRO axes;
    each rank's shard enters the region, the model's reads gather it in the compute dtype per layer and reduce its
    gradient back into the shard per layer (:func:`zjax.comm.manual`), as GSPMD's ZeRO-3 does, and the gradient
    comes out in the master's layout, summed over the microbatches in fp32. A parameter the model does not read
    through :func:`zjax.comm.gathered` is gathered before the loss (found by tracing the loss once abstractly).
    """
    mesh, k = plan.mesh, loss.accum_steps
    axes = data_axes(mesh)
    rules = without_axes(cast(Rules, plan.rules).activations_for(mesh), set(axes))
    compute = plan.precision.compute_dtype
    placements = layout.params.placements
    reduction = comm.Reduction(dtype=plan.reduce_dtype, wire=plan.grads_wire)

    # which parameters the loss reads through comm.gathered (the rest are gathered before it)
    whole = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, compute), primal)
    rows = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] // k, *x.shape[1:]), x.dtype), batch)

    def traced(p: Any, b: Any) -> Any:
        b, kwargs = loss.arguments(b, jax.random.key(0), 0)
        return loss.fn(p, b, **kwargs)

    read = comm.reads(traced, whole, rows)

    specs = jax.tree.map(lambda s: comm.manual_spec(s, axes), layout.master_specs, is_leaf=_is_spec)
    hpz, wire = plan.hpz, plan.weights_wire  # hpZ: qwZ on the gather across nodes only

    def local(p, rows, key):
        key = loss.key(key, jax.lax.axis_index(axes))

        def gather(shards: Any) -> Any:
            if hpz:  # every parameter to its node's shard, once per microbatch; its gradient back over replica
                node = lambda x, s: to_node(x, s, compute, reduction, wire)  # noqa: E731
                shards = jax.tree.map(node, shards, specs, is_leaf=_is_spec)
            return comm.gather_unread(shards, read)

        with (
            nn.logical_axis_rules(rules),
            manual_data_axes(),
            comm.manual(placements, axes, compute, reduction, weights=None if hpz else wire, hierarchical=hpz),
        ):
            grads, total, aux = _in_region(loss, scale, axes, key, p, rows, gather)
        return grads, total, jax.tree.map(_per_rank, aux)

    data = PartitionSpec(axes)
    grads, total, auxes = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(specs, data, PartitionSpec()),
        out_specs=(specs, PartitionSpec(), data),
        axis_names=set(axes),
        check_vma=False,
    )(primal, batch, rng)
    aux = jax.tree.map(lambda a: jnp.mean(a, axis=0), auxes)
    return total, aux, grads


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)
