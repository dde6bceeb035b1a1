"""The SPMD pipeline: one ``lax.scan`` in which every stage computes at once and outputs shift over ``pp``.

Design (measured on CPU, see the README's pipeline section):

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

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from ..remat import RematPolicy
from ..sharding._axes import DATA_AXES, DP, PP
from ._config import Pipeline

ITERATION_INPUT = "iteration_input"
"""``checkpoint_name`` of each iteration's stage inputs: the only value the backward pass keeps."""

_CURRENT: contextvars.ContextVar[Pipeline | None] = contextvars.ContextVar("zjax_pipeline", default=None)


@contextlib.contextmanager
def use(pipeline: Pipeline | None) -> Iterator[None]:
    """Make ``pipeline`` the schedule :func:`apply` uses while a model is traced (the train step does this)."""
    token = _CURRENT.set(pipeline)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> Pipeline | None:
    """The schedule set by :func:`use` (the plan's, while its step traces the loss), or ``None``."""
    return _CURRENT.get()


def _mesh_sizes() -> dict[str, int]:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        raise ValueError(
            "zjax.pipeline.apply needs a mesh in context: call it inside plan.train_step's loss, or under "
            "jax.set_mesh(mesh)."
        )
    return dict(mesh.shape)


def _permute(x: jax.Array, pairs: list[tuple[int, int]]) -> jax.Array:
    """Move ``x[s]`` (dim 0 sharded over ``pp``) along ``pairs``; stages that receive nothing get zeros."""
    return jax.shard_map(
        lambda a: jax.lax.ppermute(a, PP, pairs),
        in_specs=P(PP),
        out_specs=P(PP),
        axis_names={PP},
        check_vma=False,
    )(x)


def _pick(w: jax.Array, index: jax.Array) -> jax.Array:
    """``w[index[s], s]`` for every stage ``s`` (dim 1 of ``w`` split over ``pp``): one dynamic slice per stage,
    in a region manual over ``pp``. (A ``vmap`` of ``dynamic_index_in_dim`` over the stages is a gather
    whose transpose, a scatter, XLA:GPU rejects once the weights are also split over ``dp``: "Repeated
    dimensions not allowed in scatter_dims_to_operand_dims", jax 0.10.2.)"""

    def local(w: jax.Array, index: jax.Array) -> jax.Array:
        return jax.lax.dynamic_index_in_dim(w, index[0], 0, keepdims=False)

    return jax.shard_map(local, in_specs=(P(None, PP), P(PP)), out_specs=P(PP), axis_names={PP}, check_vma=False)(
        w, index
    )


def _where_stage(mask: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.where(mask.reshape(mask.shape + (1,) * (a.ndim - 1)), a, b)


def _pipeline(
    stage_fn: Callable, stacked: Any, state_io: jax.Array, cfg: Pipeline, stages: int, fill: float, rows: Any
) -> jax.Array:
    """The pipeline on microbatches ``state_io[S, K, mb, ...]`` (S over ``pp``, mb over ``rows``)."""
    s_, m_, r_ = stages, cfg.microbatches, cfg.repeats
    k_ = m_ // s_
    mb, rest = state_io.shape[2], state_io.shape[3:]
    wsc = jax.lax.with_sharding_constraint
    state_io = wsc(state_io, P(PP, None, rows))
    shift = wsc(jnp.full((s_, mb, *rest), fill, state_io.dtype), P(PP, rows))
    circ = wsc(jnp.full((s_, m_, mb, *rest), fill, state_io.dtype), P(PP, None, rows)) if r_ > 1 else None
    stage = jnp.arange(s_)
    ring = [(i, (i + 1) % s_) for i in range(s_)] if r_ > 1 else [(i, i + 1) for i in range(s_ - 1)]
    left = [(i, i - 1) for i in range(1, s_)]

    def weights(t: jax.Array) -> Any:
        if r_ == 1:
            return jax.tree.map(lambda w: w[0], stacked)
        repeat = jnp.clip((t - stage) // m_, 0, r_ - 1)
        return jax.tree.map(lambda w: _pick(w, repeat), stacked)

    def iteration(carry, t):
        shift, state_io, circ = carry
        column = t % k_
        fresh = jax.lax.dynamic_index_in_dim(state_io, column, 1, keepdims=False)
        first = fresh
        if circ is not None:
            # the ring brought the last stage's output of microbatch (t - S) % M to stage 0: keep it
            # until stage 0 takes that microbatch again, M - S iterations later
            circ = jax.lax.dynamic_update_index_in_dim(circ, shift, (t - s_) % m_, 1)
            first = jnp.where(t < m_, fresh, jax.lax.dynamic_index_in_dim(circ, t % m_, 1, keepdims=False))
        inputs = _where_stage(stage == 0, first, shift)
        work = t - stage  # the (repeat, microbatch) item each stage works on, if any
        inputs = _where_stage((work >= 0) & (work < m_ * r_), inputs, jnp.zeros_like(inputs))
        inputs = checkpoint_name(inputs, ITERATION_INPUT)
        with nn.logical_axis_rules(()):  # the model's activation constraints do not apply per stage
            out = jax.vmap(stage_fn, spmd_axis_name=PP)(weights(t), inputs)
        new_shift = _permute(out, ring)
        column_next = _where_stage(stage == s_ - 1, out, _permute(fresh, left))
        state_io = jax.lax.dynamic_update_index_in_dim(state_io, column_next, column, 1)
        return (new_shift, state_io, circ), None

    if cfg.remat:
        policy = jax.checkpoint_policies.save_only_these_names(ITERATION_INPUT)
        iteration = jax.checkpoint(iteration, policy=policy, prevent_cse=False)
    steps = jnp.arange(cfg.iterations(s_))
    (_, state_io, _), _ = jax.lax.scan(iteration, (shift, state_io, circ), steps, unroll=cfg.unroll)
    return jnp.roll(state_io, -(((r_ - 1) * m_ + s_ - 1) % k_), axis=1)


def scan_layers(
    layer_fn: Callable[[Any, jax.Array], jax.Array], remat: str | RematPolicy = "none"
) -> Callable[[Any, jax.Array], jax.Array]:
    """A ``stage_fn`` for :func:`apply` that runs a stage's layers as one ``lax.scan`` of ``layer_fn``.

    ``layer_fn(layer, h) -> h`` applies one layer (leaves without the leading layers dim); each layer is
    rematerialized by ``remat`` (a :class:`zjax.remat.RematPolicy` or its name), as the model's scanned
    layers are without a pipeline. The program does not grow with the layers per stage, and with
    ``zero3_gather="layer"`` only the layer being applied is gathered over ``dp``.
    """
    policy = RematPolicy.from_str(remat)

    def body(h: jax.Array, layer: Any) -> tuple[jax.Array, None]:
        return layer_fn(layer, h), None

    if policy.remat:
        body = jax.checkpoint(body, policy=policy.jax_policy(), prevent_cse=False)

    def stage_fn(stage_layers: Any, h: jax.Array) -> jax.Array:
        h, _ = jax.lax.scan(body, h, stage_layers)
        return h

    return stage_fn


def apply(
    stage_fn: Callable[[Any, jax.Array], jax.Array],
    layers: Any,
    x: jax.Array,
    pipeline: Pipeline | None = None,
    *,
    _bubble_fill: float = 0.0,
) -> jax.Array:
    """Run ``x`` through stacked layers as a pipeline over the mesh axis ``pp``.

    Args:
      stage_fn: ``stage_fn(stage_layers, h) -> h`` applies one stage's layers (leaves ``[Lps, ...]``)
        to a microbatch ``h[mb, ...]``; output shape and dtype equal the input's (a residual stream).
      layers: a pytree of layer weights stacked ``[L, ...]``, dim 0 sharded over ``pp`` (the logical
        name ``layers``), applied in their natural order ``0 .. L-1`` whatever the schedule.
      x: the global batch of activations ``[B, ...]``, split over the data axes.
      pipeline: the schedule; by default the plan's (:func:`current`).

    Returns:
      ``y[B, ...]``, split over the data axes and ``pp`` (embeddings, head and loss then run data
      parallel over both).
    """
    cfg = current() if pipeline is None else pipeline
    if cfg is None:
        raise ValueError(
            "zjax.pipeline.apply: no pipeline schedule; pass pipeline=zjax.Pipeline(...) or build the plan "
            "with zjax.Plan(..., pipeline=zjax.Pipeline(microbatches=...))."
        )
    sizes = _mesh_sizes()
    stages = sizes.get(PP, 1)
    leaves = jax.tree.leaves(layers)
    if not leaves:
        raise ValueError("zjax.pipeline.apply: layers has no arrays.")
    count = leaves[0].shape[0]
    for path, leaf in jax.tree_util.tree_flatten_with_path(layers)[0]:
        if leaf.shape[:1] != (count,):
            raise ValueError(
                f"zjax.pipeline.apply: layer weight {jax.tree_util.keystr(path)} has shape {leaf.shape}; every "
                f"leaf must be stacked on a leading layers dim of size {count}."
            )
    data = tuple(a for a in DATA_AXES if sizes.get(a, 1) > 1)
    ranks = math.prod(sizes[a] for a in data)
    cfg.check(stages, count, x.shape[0] // ranks if x.shape[0] % ranks == 0 else None)
    if x.shape[0] % (ranks * cfg.microbatches):
        raise ValueError(
            f"zjax.pipeline.apply: batch of {x.shape[0]} rows does not split over data parallelism ({ranks}) x "
            f"microbatches ({cfg.microbatches}); use a multiple of {ranks * cfg.microbatches}."
        )
    lps = count // (stages * cfg.repeats)

    def by_visit(w: jax.Array) -> jax.Array:
        # natural order [L, ...] -> [R, S, Lps, ...]: layer (r*S + s)*Lps + j is stage s's j-th on visit r
        w = w.reshape(cfg.repeats, stages, lps, *w.shape[1:])
        if cfg.repeats == 1:
            return w  # each stage's contiguous block: S stays over pp, nothing moves
        return jax.lax.with_sharding_constraint(w, P(None, PP, *([P.UNCONSTRAINED] * (w.ndim - 2))))

    stacked = jax.tree.map(by_visit, layers)
    x = jax.lax.with_sharding_constraint(x, P((*data, PP)))
    s_, k_, rest = stages, cfg.microbatches // stages, x.shape[1:]
    # The data axes over which the weights are whole on every rank get the manual region below; with
    # zero3_gather="layer" the ZeRO-3 weights stay split over dp, which GSPMD then runs inside the loop.
    region = tuple(a for a in data if cfg.zero3_gather != "layer" or a != DP)
    inner = tuple(a for a in data if a not in region)
    n = math.prod(sizes[a] for a in inner)

    def run(w: Any, h: jax.Array) -> jax.Array:
        # microbatches ``[S, K, n x mb, ...]``: the rows of the ``inner`` ranks side by side, split
        # over them (h is already split over (inner, pp), so no data moves)
        io = h.reshape(n, s_, k_, -1, *rest).swapaxes(0, 1).swapaxes(1, 2).reshape(s_, k_, -1, *rest)
        io = _pipeline(stage_fn, w, io, cfg, stages, _bubble_fill, inner or None)
        return io.reshape(s_, k_, n, -1, *rest).swapaxes(1, 2).swapaxes(0, 1).reshape(h.shape)

    if not region:
        return run(stacked, x)
    # Every rank of the region gets its own copy of the weights on a leading dim (a broadcast: no data
    # moves, except ZeRO-3's all-gather in "step" mode); their gradient is summed over that dim outside
    # the region, so it is reduced over those axes once per step, not per layer per iteration inside
    # the loop. (Entering as P() and letting shard_map psum the cotangent does the same, but that
    # psum's reducer carries a sharding constraint on which XLA:CPU's bf16 all-reduce promotion aborts.)
    free = P.UNCONSTRAINED
    copies = math.prod(sizes[a] for a in region)

    def per_rank(w: jax.Array) -> jax.Array:
        w = jnp.broadcast_to(w[None], (copies, *w.shape))
        return jax.lax.with_sharding_constraint(w, P(region, *([free] * (w.ndim - 1))))

    return jax.shard_map(
        lambda w, h: run(jax.tree.map(lambda a: a[0], w), h),
        in_specs=(P(region), P(region)),
        out_specs=P(region),
        axis_names=set(region),
        check_vma=False,
    )(jax.tree.map(per_rank, stacked), x)
