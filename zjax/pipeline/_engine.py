"""The SPMD pipeline: one ``lax.scan`` in which every stage computes at once and outputs shift over ``pp``.

Design (measured on CPU, see docs/concepts/pipelines.md):

- Layer weights ``[L, ...]`` are stored in their natural order (what the model, checkpoints and
  Hugging Face files see) and sharded over ``pp`` on their leading dim. They are read as
  ``[R, S, Lps, ...]``: on its ``r``-th visit stage ``s`` applies layers ``(r*S + s)*Lps ...``, so every
  schedule computes the same function as the unpipelined model. With GPipe (R = 1) that view is each
  stage's own contiguous block (no data moves); with the circular schedule (R > 1) a stage's chunks
  are strided in storage, so XLA exchanges ``(S-1)/S`` of the layer weights over ``pp`` once per step
  (an all-to-all, and its transpose for the gradients): the price of a layout that does not depend on
  the schedule.
- The pipeline runs inside a ``shard_map`` that is manual over the data axes only, with one copy of
  the weights per data-parallel rank: their gradient is reduced over data parallelism once, at the
  region's boundary, instead of once per layer per iteration inside the loop (XLA cannot hoist
  collectives out of a loop). ZeRO-3 weights are all-gathered at that boundary, once per step;
  with ``zero3_gather="layer"`` (the plan's default at stages 2 and 3) weights and gradients stay
  split over ``dp`` (the region then covers the other data axes only): a stage that scans its layers
  (:func:`scan_layers`) gathers one layer at a time inside the loop and reduce-scatters its gradient.
- Stream io: the local batch ``[B, ...]`` is split over ``pp`` and read as ``[S, K, mb, ...]``
  (K = M / S); stage 0 takes microbatch ``t`` from column ``t % K``, which is shifted one stage
  left each visit while the last stage writes its outputs there. No collective at the boundary.
- The stage-to-stage shift is one ``ppermute`` over ``pp`` (a ring for the circular schedule, whose
  outputs wait in a per-microbatch buffer until stage 0 needs them again).
- Bubble iterations compute on zeros (never on stale or uninitialized values, so NaNs cannot leak
  into gradients through ``0 * nan``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..comm import GATHERED
from ..remat import RematPolicy, nested_scan
from ..sharding._axes import DP, PP
from ..stages._placement import add_axis
from ._config import Pipeline
from ._context import _INITIALIZING, call_stage, current, data_axes_here, mesh_sizes, own_reads, summed_wide
from ._scan import _pipeline


def scan_layers(
    layer_fn: Callable[..., Any], remat: str | RematPolicy = "none", *, outputs: bool = False
) -> Callable[..., Any]:
    """A ``stage_fn`` for :func:`apply` that runs a stage's layers as one ``lax.scan`` of ``layer_fn``.

    ``layer_fn(layer, h) -> h`` applies one layer (leaves without the leading layers dim); each layer is
    rematerialized by ``remat`` (a :class:`zjax.remat.RematPolicy` or its name), as the model's scanned
    layers are without a pipeline. The program does not grow with the layers per stage, and with
    ``zero3_gather="layer"`` only the layer being applied is gathered over ``dp``. With ``outputs``,
    ``layer_fn`` returns ``(h, sums)`` and the stage ``(h, sums stacked per layer)`` (:func:`apply`'s
    ``outputs``). A pipeline with side inputs (:func:`apply`'s ``side``) calls the stage, and so
    ``layer_fn``, with the microbatch's side inputs last: ``layer_fn(layer, h, side)``.

    The table schedules read from the stage what their B and W pull back from (``Pipeline(recompute=...)``):
    under ``full`` and ``nested`` the stage that keeps each layer's matrix products, which B recomputes once;
    under ``none`` the stage that keeps everything but the weights gathered per layer.
    """
    policy = RematPolicy.from_str(remat)

    def scanned(keeps: Any) -> Callable[..., Any]:
        """The stage as one scan of its layers, each checkpointed with ``keeps`` (``None``: not checkpointed)."""

        def stage(stage_layers: Any, h: jax.Array, *side: Any) -> Any:
            def body(h: jax.Array, layer: Any) -> tuple[jax.Array, Any]:
                out = layer_fn(layer, h, *side)
                return out if outputs else (out, None)

            if keeps is not None:
                body = jax.checkpoint(body, policy=keeps, prevent_cse=False)
            h, sums = jax.lax.scan(body, h, stage_layers)
            return (h, sums) if outputs else h

        return stage

    def stage_fn(stage_layers: Any, h: jax.Array, *side: Any) -> Any:
        if policy.kind == "nested":  # groups of the stage's layers (zjax.remat.nested_scan)
            return nested_scan(lambda w, x: layer_fn(w, x, *side), stage_layers, h, policy, outputs=outputs)
        return scanned(policy.jax_policy() if policy.remat else None)(stage_layers, h, *side)

    # the table engine's residuals (zjax.pipeline.Pipeline.recompute): layers recomputed whole are recomputed
    # once, by B, which keeps their matmul outputs for W; any other policy's forward keeps what it saves
    cp = jax.checkpoint_policies
    if policy.kind in ("full", "nested"):
        once = ("B", scanned(cp.dots_saveable))
        stage_fn.zjax_keep = {"once": once, "per-action": ("F", stage_fn)}  # type: ignore[attr-defined]
    elif not policy.remat:
        stage_fn.zjax_keep = ("F", scanned(cp.save_anything_except_these_names(GATHERED)))  # type: ignore[attr-defined]
    return stage_fn


def apply(
    stage_fn: Callable[[Any, jax.Array], jax.Array],
    layers: Any,
    x: jax.Array,
    pipeline: Pipeline | None = None,
    *,
    outputs: bool = False,
    split_over: Any = None,
    side: Any = None,
    _bubble_fill: float = 0.0,
) -> Any:
    """Run ``x`` through stacked layers as a pipeline over the mesh axis ``pp``.

    Args:
      stage_fn: ``stage_fn(stage_layers, h) -> h`` applies one stage's layers (leaves ``[Lps, ...]``)
        to a microbatch ``h[mb, ...]``; output shape and dtype equal the input's (a residual stream).
      layers: a pytree of layer weights stacked ``[L, ...]``, dim 0 sharded over ``pp`` (the logical
        name ``layers``), applied in their natural order ``0 .. L-1`` whatever the schedule.
      x: the global batch of activations ``[B, ...]``, split over the data axes.
      pipeline: the schedule; by default the plan's (:func:`current`). Without one (a model's
        ``init``, or a mesh without ``pp``) the stages run one after the other on the whole batch: the
        same function, so ``plan.init`` and a model's own ``init`` need nothing special.
      side: a pytree of per-row arrays ``[B, ...]`` (or ``None``) that every stage reads as it is: a packed
        row's positions and segment ids. Each microbatch's rows travel with it; ``stage_fn`` is then called
        ``stage_fn(stage_layers, h, side_mb)``. Not differentiated.
      outputs: ``stage_fn`` returns ``(h, sums)``, ``sums`` a pytree of per-layer arrays ``[Lps, ...]`` that
        add up over tokens (a mixture of experts' router statistics); they come back summed over every
        microbatch and data-parallel rank, ``[L, ...]`` in the layers' order.
      split_over: a pytree like ``layers`` of ``{dim: mesh axis}`` (or ``None``) for leaves that a data axis
        splits (an expert weight's experts over ``ep``): they enter each rank as their own shard, not as a
        copy of the whole, and ``stage_fn`` runs with that axis manual (its collectives are the stage's);
        ``{}`` for a leaf that ZeRO-3 never splits over ``dp`` in the stage (per-layer state read as it is).

    Returns:
      ``y[B, ...]``, split over the data axes and ``pp`` (embeddings, head and loss then run data
      parallel over both); with ``outputs``, ``(y, sums)``.

    Raises:
      ValueError: ``pp > 1`` in the mesh and no schedule; a table schedule (``"1f1b"`` and the like),
        which needs the loss inside the pipeline (:func:`zjax.pipeline.loss`).
    """
    cfg = current() if pipeline is None else pipeline
    reads: list = []  # per trace of the stage, its quantized layer reads (None: nothing quantizes)
    stage_fn = own_reads(stage_fn, cfg is not None and cfg.zero3_gather == "layer", reads)
    mesh = jax.sharding.get_abstract_mesh()
    stages = 1 if mesh.empty else dict(mesh.shape).get(PP, 1)
    count = _layer_count(layers)
    if side is not None:
        side = jax.tree.map(jax.lax.stop_gradient, side)
        for leaf in jax.tree.leaves(side):
            if leaf.shape[:1] != x.shape[:1]:
                raise ValueError(
                    f"zjax.pipeline.apply: a side input has shape {leaf.shape}; side inputs are per row, with the "
                    f"batch's {x.shape[0]} rows first (x has shape {x.shape})."
                )
    if _INITIALIZING.get():
        return sequential(stage_fn, layers, x, 1, 1, outputs, side)
    if cfg is None:
        if stages > 1:
            raise ValueError(
                f"zjax.pipeline.apply: the mesh has pp={stages} but no pipeline schedule is active: build the "
                "plan with zjax.Plan(..., pipeline=zjax.Pipeline(microbatches=...)) and call the model inside "
                "plan.train_step / plan.eval_step (or pass pipeline=... here)."
            )
        return sequential(stage_fn, layers, x, 1, 1, outputs, side)
    if cfg.tabled:
        raise ValueError(
            f"zjax.pipeline.apply: schedule={cfg.name!r} interleaves each microbatch's forward and backward "
            "passes, so the pipeline must compute the loss: call zjax.pipeline.loss(stage_fn, layers, inputs, "
            "first=..., last=...) instead (zjax.models.lm_loss does), or use schedule='gpipe'."
        )
    sizes = mesh_sizes()
    data = data_axes_here(sizes)
    ranks = math.prod(sizes[a] for a in data)
    cfg.check(stages, count, x.shape[0] // ranks if x.shape[0] % ranks == 0 else None)
    if x.shape[0] % (ranks * cfg.microbatches):
        raise ValueError(
            f"zjax.pipeline.apply: batch of {x.shape[0]} rows does not split over data parallelism ({ranks}) x "
            f"microbatches ({cfg.microbatches}); use a multiple of {ranks * cfg.microbatches}."
        )
    stacked = by_visit(layers, cfg.repeats, stages)
    x = jax.lax.with_sharding_constraint(x, P((*data, PP)))
    side = jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, P((*data, PP))), side)
    s_, k_, rest = stages, cfg.microbatches // stages, x.shape[1:]
    # The data axes over which the weights are whole on every rank get the manual region below; with
    # zero3_gather="layer" the ZeRO-3 weights stay split over dp, which GSPMD then runs inside the loop.
    region = tuple(a for a in data if cfg.zero3_gather != "layer" or a != DP)
    inner = tuple(a for a in data if a not in region)
    n = math.prod(sizes[a] for a in inner)

    def microbatched(a: jax.Array) -> jax.Array:
        # ``[S, K, n x mb, ...]``: the rows of the ``inner`` ranks side by side, split over them (the rows
        # are already split over (inner, pp), so no data moves)
        more = a.shape[1:]
        return a.reshape(n, s_, k_, -1, *more).swapaxes(0, 1).swapaxes(1, 2).reshape(s_, k_, -1, *more)

    def every_stage(a: jax.Array) -> jax.Array:
        # side inputs ``[M, n x mb, ...]`` in the microbatches' order, on every stage (gathered over pp)
        a = microbatched(a)
        a = a.reshape(s_ * k_, *a.shape[2:])
        return jax.lax.with_sharding_constraint(a, P(None, inner or None))

    def run(w: Any, hs: tuple, fn: Callable = stage_fn) -> Any:  # w: [R, S, Lps, ...]
        h, sd = hs
        sd = jax.tree.map(every_stage, sd)
        io, sums = _pipeline(fn, w, microbatched(h), cfg, stages, _bubble_fill, inner or None, outputs, sd)
        y = io.reshape(s_, k_, n, -1, *rest).swapaxes(1, 2).swapaxes(0, 1).reshape(h.shape)
        return (y, sums) if outputs else y

    if not region:  # the data axes are manual already (each rank's gradients, Plan(reduce_dtype=...))
        loop = lambda fn, w, hs: run(by_visit(w, cfg.repeats, stages), hs, fn)  # noqa: E731
        return _read_per_layer(summed_wide(stage_fn, loop, layers, (x, side)), reads)
    leaves, treedef = jax.tree.flatten(stacked)
    # a leaf that a region axis already splits (split_over, in the natural [L, ...] dims) enters split over it
    views = [{d + 2: a for d, a in sp.items()} if sp else None for sp in split_leaves(split_over, len(leaves))]
    specs, entered = zip(*[_enter(w, region, sizes, v) for w, v in zip(leaves, views, strict=True)], strict=True)

    def body(w: Any, hs: tuple) -> Any:
        out = run(jax.tree.map(lambda a: a[0], w), hs)
        if not outputs:
            return out
        return out[0], jax.lax.psum(out[1], region)  # each rank summed its own rows

    out = jax.shard_map(
        body,
        in_specs=(jax.tree.unflatten(treedef, specs), (P(region), jax.tree.map(lambda _: P(region), side))),
        out_specs=(P(region), P()) if outputs else P(region),
        axis_names=set(region),
        check_vma=False,
    )(jax.tree.unflatten(treedef, entered), (x, side))
    return _read_per_layer(out, reads)


def _read_per_layer(out: Any, reads: list) -> Any:
    """``out``, once every trace of the stage that quantizes its per-layer gathers read a layer (``reads``)."""
    if any(made is not None and not made for made in reads):
        raise ValueError(
            "zjax.pipeline.apply: Plan(quantized_comm='weights') with zero3_gather='layer' gathers each layer "
            "over dp as integer blocks where the stage reads it through zjax.comm.gathered_tree(layer, "
            "('layers',)) (the model's path of the stacked layers); this stage_fn read none, so its gathers "
            "would cross dp in the compute dtype. Read each layer so in layer_fn (zjax.models.Decoder does), "
            "or use Pipeline(zero3_gather='step')."
        )
    return out


def _layer_count(layers: Any) -> int:
    """L, the leading dim every leaf of ``layers`` shares."""
    leaves = jax.tree.leaves(layers)
    if not leaves:
        raise ValueError("zjax.pipeline: layers has no arrays.")
    count = leaves[0].shape[0]
    for path, leaf in jax.tree_util.tree_flatten_with_path(layers)[0]:
        if leaf.shape[:1] != (count,):
            raise ValueError(
                f"zjax.pipeline: layer weight {jax.tree_util.keystr(path)} has shape {leaf.shape}; every "
                f"leaf must be stacked on a leading layers dim of size {count}."
            )
    return count


def by_visit(layers: Any, repeats: int, stages: int, placement: str = "loop") -> Any:
    """Natural order ``[L, ...]`` -> ``[R, S, Lps, ...]``: layer ``(r*S + s)*Lps + j`` is stage ``s``'s
    ``j``-th on visit ``r``; in a V (``placement="v"``, :data:`zjax.pipeline.PLACEMENTS`) odd visits run back
    down: their stage ``s`` holds block ``r*S + S - 1 - s``."""

    def one(w: jax.Array) -> jax.Array:
        w = w.reshape(repeats, stages, w.shape[0] // (repeats * stages), *w.shape[1:])
        if placement == "v":
            w = _turned(w)
        if repeats == 1 or stages == 1:
            return w  # each stage's contiguous block: S stays over pp, nothing moves
        return jax.lax.with_sharding_constraint(w, P(None, PP, *([P.UNCONSTRAINED] * (w.ndim - 2))))

    return jax.tree.map(one, layers)


def _turned(w: jax.Array) -> jax.Array:
    """``w [R, S, ...]`` with the stages of its odd visits in reverse (its own inverse)."""
    return jnp.stack([w[r, ::-1] if r % 2 else w[r] for r in range(w.shape[0])])


def natural(stacked: Any, placement: str = "loop") -> Any:
    """:func:`by_visit`'s inverse: ``[R, S, Lps, ...]`` -> ``[L, ...]``."""

    def one(w: jax.Array) -> jax.Array:
        w = _turned(w) if placement == "v" else w
        return w.reshape(-1, *w.shape[3:])

    return jax.tree.map(one, stacked)


def sequential(
    stage_fn: Callable, layers: Any, x: jax.Array, repeats: int, stages: int, outputs: bool = False, side: Any = None
) -> Any:
    """The pipeline's function without a pipeline: every (visit, stage) chunk of layers in turn, one scan
    (with ``outputs``, also the chunks' per-layer sums, ``[L, ...]``)."""
    chunks = jax.tree.map(lambda w: w.reshape(repeats * stages, *w.shape[2:]), by_visit(layers, repeats, stages))
    if outputs:
        h, sums = jax.lax.scan(lambda h, w: call_stage(stage_fn, w, h, side), x, chunks)
        return h, jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), sums)
    h, _ = jax.lax.scan(lambda h, w: (call_stage(stage_fn, w, h, side), None), x, chunks)
    return h


def split_leaves(split_over: Any, count: int) -> list[dict[int, str] | None]:
    """``split_over`` (a pytree like the layers of ``{dim: mesh axis}`` or ``None``) per leaf of the layers (``count``
    of them), in ``jax.tree.leaves`` order."""
    if split_over is None:
        return [None] * count
    is_split = lambda x: x is None or (isinstance(x, dict) and all(isinstance(k, int) for k in x))  # noqa: E731
    return jax.tree.leaves(split_over, is_leaf=is_split)


def _enter(
    w: jax.Array, region: tuple[str, ...], sizes: dict[str, int], split: dict[int, str] | None = None
) -> tuple[P, jax.Array]:
    """A layer weight entering the region manual over ``region``: its ``shard_map`` spec and the array.

    Every rank of the region gets its own copy on a new leading dim (a broadcast: no data moves, except
    ZeRO-3's all-gather in "step" mode); the gradient is summed over that dim outside the region, so it is
    reduced over those axes once per step, not per layer per iteration inside the loop. (Entering as P()
    and letting shard_map psum the cotangent does the same, but that psum's reducer carries a sharding
    constraint on which XLA:CPU's bf16 all-reduce promotion aborts.) ``split`` (``{dim: axis}``, e.g. an
    expert weight's experts over ``ep``) keeps a region axis split on that dim, the copies over the others.
    """
    kept = {d: a for d, a in (split or {}).items() if a in region}
    lead = tuple(a for a in region if a not in kept.values())
    entries: list[Any] = [lead or None] + [None] * w.ndim
    for dim, axis in kept.items():
        entries[dim + 1] = axis
    w = jnp.broadcast_to(w[None], (math.prod(sizes[a] for a in lead), *w.shape))
    return P(*entries), jax.lax.with_sharding_constraint(w, P(*[P.UNCONSTRAINED if e is None else e for e in entries]))


def _dp_dims(layers: Any, split_over: Any, sizes: dict[str, int]) -> list[int | None]:
    """Per leaf of ``layers``, :func:`_dp_dim`; ``None`` for a leaf ``split_over`` keeps whole (``{}``)."""
    leaves = jax.tree.leaves(layers)
    splits = split_leaves(split_over, len(leaves))
    return [None if sp == {} else _dp_dim(w.shape, sizes) for w, sp in zip(leaves, splits, strict=True)]


def _dp_dim(shape: tuple[int, ...], sizes: dict[str, int]) -> int | None:
    """The dim of a layer weight ``[L, ...]`` that ZeRO-3 splits over ``dp`` (the rule of
    :func:`zjax.stages.add_axis` on the stage layout ``P("pp")``), or ``None`` if it stays whole there."""
    spec, reason = add_axis(P(PP), shape, DP, sizes)
    if reason is not None:
        return None
    dims = [d for d, e in enumerate(spec) if e == DP]
    return dims[0] if dims and dims[0] > 0 else None
