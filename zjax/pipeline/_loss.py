"""``zjax.pipeline.loss``: a whole model through the pipeline, its loss computed by the last stage."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..sharding._axes import PP
from . import _ticks
from ._config import Pipeline
from ._context import current, data_axes_here, own_reads
from ._engine import _dp_dims, _layer_count, apply, by_visit, natural, split_leaves
from ._stash import keep_of


def loss(
    stage_fn: Callable[[Any, jax.Array], jax.Array],
    layers: Any,
    inputs: Any,
    *,
    first: Callable[[Any, Any], jax.Array],
    last: Callable[[Any, jax.Array, Any], jax.Array],
    params: Any,
    pipeline: Pipeline | None = None,
    side: Any = None,
    tally: Callable[[Any, Any], jax.Array] | None = None,
    split_over: Any = None,
    maxed: Any = None,
) -> Any:
    """``last(params, layers(first(params, inputs)), inputs)`` summed over microbatches.

    The whole model in the pipeline: stage 0 starts each microbatch with ``first`` (an embedding, say),
    the stacked ``layers`` run in stages as in :func:`apply`, and the last stage ends it with ``last``,
    which returns the microbatch's share of the loss: a sum over its rows, each weighted by its share of
    the whole batch's mean (so that the sums add up to the mean, and the loss scale that seeds the
    backward passes meets gradients of the size it meets without a pipeline). Every schedule
    runs through here; ``"1f1b"``, ``"interleaved-1f1b"`` and ``"zero-bubble"`` need it, since their
    backward passes start while other microbatches' forwards still run.

    Args:
      stage_fn: ``stage_fn(stage_layers, h) -> h`` as for :func:`apply`.
      layers: layer weights stacked ``[L, ...]`` (dim 0 over ``pp``).
      inputs: a pytree of arrays ``[B, ...]`` (tokens, targets, weights: every per-row input), split over
        the data axes; cut into microbatches along dim 0.
      first: ``first(params, inputs_mb) -> h[mb, ...]``.
      last: ``last(params, h, inputs_mb) -> scalar``, the microbatch's share of the loss.
      params: the parameters outside the layers (embedding, final norm, head); ``first`` and ``last`` each
        read what they need. One tree, so a table both use (a tied embedding) gets one gradient, reduced
        over the data axes once.
      pipeline: the schedule; by default the plan's (:func:`current`).
      side: per-row arrays ``[B, ...]`` every stage reads (a packed row's positions and segment ids), cut into
        microbatches as ``inputs`` are; ``stage_fn`` is then called ``stage_fn(stage_layers, h, side_mb)``.
      tally: ``tally(sums, inputs_mb) -> scalar``: ``stage_fn`` returns ``(h, sums)``, ``sums`` a pytree of
        per-layer arrays ``[Lps, ...]`` (a mixture of experts' router statistics), and each stage adds
        ``tally`` of its sums on each microbatch to the loss (a loss term per microbatch and layer, such as the
        routers' load-balancing loss, differentiated with it). Every schedule then runs on the table engine.
      split_over: as for :func:`apply`: leaves of ``layers`` that a data axis splits (the experts over ``ep``)
        enter each rank as its own shard, and ``stage_fn`` runs with that axis manual.
      maxed: a pytree like ``layers`` of bools (or ``None``): leaves whose gradient is the maximum of their
        cotangents over the microbatches and data-parallel ranks, not their sum, and not scaled by the loss's
        cotangent (fp8 amax histories: :func:`zjax.fp8.matmul_delayed` reports each call's amaxes as one).
        Every schedule then runs on the table engine (GPipe's scan would sum them).

    Returns:
      The fp32 sum of ``last`` (and ``tally``) over all microbatches. Its gradients are made during the
      schedule (seeded by the train step's loss scale) and returned when it is differentiated. With ``tally``:
      ``(that sum, (tally's part of it, sums))``, ``sums`` ``[L, ...]`` in the layers' order, summed over every
      microbatch and data-parallel rank (neither differentiated).
    """
    cfg = current() if pipeline is None else pipeline
    sizes = dict(jax.sharding.get_abstract_mesh().shape)
    stages = sizes.get(PP, 1)
    if cfg is None and tally is not None:  # the whole batch one microbatch
        y, sums = apply(stage_fn, layers, first(params, inputs), None, outputs=True, side=side, split_over=split_over)
        term = jnp.asarray(tally(sums, inputs), jnp.float32)
        value = jnp.asarray(last(params, y, inputs), jnp.float32) + term
        return value, jax.lax.stop_gradient((term, sums))
    if cfg is None or (not cfg.tabled and tally is None and not any(jax.tree.leaves(maxed))):
        h = first(params, inputs)
        y = apply(stage_fn, layers, h, cfg, side=side, split_over=split_over)
        return jnp.asarray(last(params, y, inputs), jnp.float32)
    if not cfg.tabled:  # a term per microbatch, or a maximum: GPipe's order on the table engine
        cfg = dataclasses.replace(cfg, schedule=cfg.table(stages))
    ranks = math.prod(sizes[a] for a in data_axes_here(sizes))
    rows = jax.tree.leaves(inputs)[0].shape[0]
    cfg.check(stages, _layer_count(layers), rows // ranks if rows % ranks == 0 else None)
    if rows % (ranks * cfg.microbatches):
        raise ValueError(
            f"zjax.pipeline.loss: batch of {rows} rows does not split over data parallelism ({ranks}) x "
            f"microbatches ({cfg.microbatches}); use a multiple of {ranks * cfg.microbatches}."
        )
    dtypes = jax.tree.map(lambda a: a.dtype, (layers, params))
    scale = _ticks._SEED.get()
    scale = jnp.float32(1.0) if scale is None else jnp.asarray(scale, jnp.float32)

    side = jax.tree.map(jax.lax.stop_gradient, side)

    dims = _dp_dims(layers, split_over, sizes) if cfg.zero3_gather == "layer" else None
    dims = dims if dims and any(d is not None for d in dims) else None  # nothing split over dp: as "step"
    staged = stage_fn if dims else own_reads(stage_fn)  # "layer": the table engine gathers each layer read
    mode, saving = keep_of(stage_fn, cfg.recompute)
    keep = (mode, saving if dims else own_reads(saving))

    placement = cfg.table(stages).placement

    def table_run(layers, ep, inputs, scale, side, forward_only=False):
        stacked = by_visit(layers, cfg.repeats, stages, placement)
        split = split_leaves(split_over, len(jax.tree.leaves(layers)))
        value, dw, dep, sums = _ticks.run(
            staged, first, last, cfg, stacked, ep, inputs, scale, side, dims, keep, tally, split, forward_only, maxed
        )
        dw = None if forward_only else natural(dw, placement)
        out = value if tally is None else (value, (sums[0], natural(sums[1], placement)))
        return out, (dw, dep)

    @jax.custom_vjp
    def run(layers, ep, inputs, scale, side):
        m_, s_ = cfg.microbatches, stages
        if m_ >= s_ and m_ % s_ == 0 and tally is None:  # forward only (eval): GPipe's scan keeps nothing
            scan = dataclasses.replace(cfg, schedule="gpipe", zero3_gather="step")
            h = apply(stage_fn, layers, first(ep, inputs), scan, side=side, split_over=split_over)
            return jnp.asarray(last(ep, h, inputs), jnp.float32)
        return table_run(layers, ep, inputs, scale, side, forward_only=True)[0]  # the table's forwards alone

    def fwd(layers, ep, inputs, scale, side):
        value, grads = table_run(layers, ep, inputs, scale, side)
        return value, (grads, scale)

    def bwd(res, g):
        grads, scale = res
        g = g if tally is None else g[0]  # the sums are not differentiated
        k = g / scale
        scaled = jax.tree.map(lambda a, dt: (a * k).astype(dt), grads, dtypes)
        if maxed is not None:  # the maxima as they are
            scaled = (jax.tree.map(lambda m, a, b: a if m else b, maxed, grads[0], scaled[0]), scaled[1])
        return (*scaled, None, None, None)

    run.defvjp(fwd, bwd)
    return run(layers, params, inputs, scale, side)
