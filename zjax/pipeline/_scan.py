"""GPipe and the circular schedule as one ``lax.scan``: every stage computes at once, outputs shift over ``pp``.

See :mod:`._engine` for the design.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from ..sharding._axes import PP
from ._config import Pipeline

ITERATION_INPUT = "iteration_input"
"""``checkpoint_name`` of each iteration's stage inputs: the only value the backward pass keeps."""


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


def _per_stage(side: Any, index: jax.Array) -> Any:
    """``side[index[s]]`` on every stage ``s`` (leaves ``[M, ...]`` whole on every stage): ``[S, ...]`` over ``pp``."""

    def local(side: Any, index: jax.Array) -> Any:
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index[0], 0), side)

    specs = jax.tree.map(lambda _: P(), side)
    out = jax.tree.map(lambda _: P(PP), side)
    return jax.shard_map(local, in_specs=(specs, P(PP)), out_specs=out, axis_names={PP}, check_vma=False)(side, index)


def _where_stage(mask: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.where(mask.reshape(mask.shape + (1,) * (a.ndim - 1)), a, b)


def _pipeline(
    stage_fn: Callable,
    stacked: Any,
    state_io: jax.Array,
    cfg: Pipeline,
    stages: int,
    fill: float,
    rows: Any,
    outputs: bool = False,
    side: Any = None,
) -> Any:
    """The pipeline on microbatches ``state_io[S, K, mb, ...]`` (S over ``pp``, mb over ``rows``), weights
    ``stacked`` ``[R, S, Lps, ...]``; ``side`` (or ``None``): the side inputs ``[M, mb, ...]`` of every
    microbatch, each stage reading those of the microbatch it works on. Returns ``(y, sums)``: with ``outputs``
    (``stage_fn`` returns ``(h, per-layer sums [Lps, ...])``) the stages' per-layer sums over every microbatch,
    ``[L, ...]`` in the layers' order, else ``None``."""
    s_, m_, r_ = stages, cfg.microbatches, cfg.repeats
    k_ = m_ // s_
    wsc = jax.lax.with_sharding_constraint
    mb, rest = state_io.shape[2], state_io.shape[3:]
    state_io = wsc(state_io, P(PP, None, rows))
    shift = wsc(jnp.full((s_, mb, *rest), fill, state_io.dtype), P(PP, rows))
    # the circular schedule's ring brings the last stage's outputs back to stage 0, which waits for them
    circ = wsc(jnp.full((s_, m_, mb, *rest), fill, state_io.dtype), P(PP, None, rows)) if r_ > 1 else None
    ring = [(i, (i + 1) % s_) for i in range(s_)] if r_ > 1 else [(i, i + 1) for i in range(s_ - 1)]
    left = [(i, i - 1) for i in range(1, s_)]
    stage = jnp.arange(s_)  # a constant of the loop; repeat() makes its own in the body (XLA:GPU schedules the
    # circular schedule's collectives differently, 3% more exposed bytes on Llama-2-7B, when both share one)

    def repeat(t: jax.Array) -> jax.Array:  # the repeat (chunk) each stage applies at iteration t
        return jnp.clip((t - jnp.arange(s_)) // m_, 0, r_ - 1)

    def weights(t: jax.Array) -> Any:
        if r_ == 1:
            return jax.tree.map(lambda w: w[0], stacked)
        return jax.tree.map(lambda w: _pick(w, repeat(t)), stacked)

    def stages_on(w: Any, inputs: jax.Array, work: jax.Array) -> Any:
        extra = () if side is None else (_per_stage(side, work % m_),)
        with nn.logical_axis_rules(()):  # the model's activation constraints do not apply per stage
            return jax.vmap(stage_fn, spmd_axis_name=PP)(w, inputs, *extra)

    sums = []
    if outputs:  # one slot per stage and repeat [S, R, Lps, ...], so that every layer's sums land in their own place
        w0 = weights(jnp.zeros((), jnp.int32))
        shapes = jax.eval_shape(lambda w, x, work: stages_on(w, x, work)[1], w0, shift, jnp.zeros(s_, jnp.int32))
        sums = [jax.tree.map(lambda a: wsc(jnp.zeros((s_, r_, *a.shape[1:]), a.dtype), P(PP)), shapes)]

    def iteration(carry, t):
        shift, state_io, circ, *sums = carry
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
        out = stages_on(weights(t), inputs, work)
        if outputs:
            out, layer_sums = out
            # each stage adds its layers' sums into its repeat's slot, bubbles (zero inputs) add nothing
            hot = (jnp.arange(r_)[None, :] == repeat(t)[:, None]) & ((work >= 0) & (work < m_ * r_))[:, None]
            add = lambda a, x: a + jnp.where(hot.reshape(*hot.shape, *(1,) * (x.ndim - 1)), x[:, None], 0)  # noqa: E731
            sums = [jax.tree.map(add, sums[0], layer_sums)]
        new_shift = _permute(out, ring)
        column_next = _where_stage(stage == s_ - 1, out, _permute(fresh, left))
        state_io = jax.lax.dynamic_update_index_in_dim(state_io, column_next, column, 1)
        return (new_shift, state_io, circ, *sums), None

    if cfg.remat:
        policy = jax.checkpoint_policies.save_only_these_names(ITERATION_INPUT)
        iteration = jax.checkpoint(iteration, policy=policy, prevent_cse=False)
    steps = jnp.arange(cfg.iterations(stages))
    (_, state_io, _, *sums), _ = jax.lax.scan(iteration, (shift, state_io, circ, *sums), steps, unroll=cfg.unroll)
    y = jnp.roll(state_io, -(((r_ - 1) * m_ + s_ - 1) % k_), axis=1)
    # the sums in the layers' order [L, ...]: layer (r*S + s)*Lps + j
    return y, jax.tree.map(lambda a: a.swapaxes(0, 1).reshape(-1, *a.shape[3:]), sums[0]) if outputs else None
