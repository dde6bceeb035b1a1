"""GPipe and the circular schedule as one ``lax.scan``: every stage computes at once, outputs shift over ``pp``.

See :mod:`._engine` for the design; :func:`_chunked` (``zero3_gather="chunk"``) runs the same loop in phases.
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


class _Loop:
    """One schedule's loop pieces: the initial carry, the iteration, and the final column order.

    The carry is ``(shift, state_io, circ)``; ``weights(t)`` gives every stage's weights for iteration
    ``t`` (leaves ``[S, Lps, ...]``). :func:`_pipeline` runs all iterations with weights picked from the
    stacked chunks; :func:`_chunked` runs them in phases of ``M`` with each phase's chunks gathered.
    """

    def __init__(
        self, stage_fn: Callable, cfg: Pipeline, stages: int, fill: float, rows: Any, outputs: bool = False
    ) -> None:
        self.stage_fn, self.cfg, self.s, self.fill, self.rows = stage_fn, cfg, stages, fill, rows
        self.m, self.r = cfg.microbatches, cfg.repeats
        self.k = self.m // stages
        self.outputs = outputs  # stage_fn returns (h, per-layer sums [Lps, ...]), summed over the work items

    @property
    def stage(self) -> jax.Array:
        return jnp.arange(self.s)  # made where it is used (a custom_vjp's rules must not close over tracers)

    def init(self, state_io: jax.Array) -> tuple:
        s_, m_, rows = self.s, self.m, self.rows
        mb, rest = state_io.shape[2], state_io.shape[3:]
        wsc = jax.lax.with_sharding_constraint
        state_io = wsc(state_io, P(PP, None, rows))
        shift = wsc(jnp.full((s_, mb, *rest), self.fill, state_io.dtype), P(PP, rows))
        circ = wsc(jnp.full((s_, m_, mb, *rest), self.fill, state_io.dtype), P(PP, None, rows)) if self.r > 1 else None
        return shift, state_io, circ

    def repeat(self, t: jax.Array) -> jax.Array:
        """The repeat (chunk) each stage applies at iteration ``t``."""
        return jnp.clip((t - self.stage) // self.m, 0, self.r - 1)

    def sums(self, weights: Callable[[jax.Array], Any], shift: jax.Array, side: Any = None) -> Any:
        """Zeros ``[S, R, Lps, ...]`` for each per-layer sum the stages return (``outputs``): one slot per
        stage and repeat, so that every layer's sums land in their own place."""
        with nn.logical_axis_rules(()):  # as the iterations run the stages
            extra = () if side is None else (_per_stage(side, jnp.zeros(self.s, jnp.int32)),)
            shapes = jax.eval_shape(
                lambda w, x, *e: jax.vmap(self.stage_fn, spmd_axis_name=PP)(w, x, *e)[1],
                weights(jnp.zeros((), jnp.int32)),
                shift,
                *extra,
            )
        return jax.tree.map(
            lambda a: jax.lax.with_sharding_constraint(
                jnp.zeros((self.s, self.r, *a.shape[1:]), a.dtype), P(PP, *([None] * a.ndim))
            ),
            shapes,
        )

    def layer_order(self, sums: Any) -> Any:
        """``[S, R, Lps, ...]`` sums in the layers' natural order ``[L, ...]`` (layer ``(r*S + s)*Lps + j``)."""
        return jax.tree.map(lambda a: a.swapaxes(0, 1).reshape(-1, *a.shape[3:]), sums)

    def run(self, weights: Callable[[jax.Array], Any], carry: tuple, steps: jax.Array, side: Any = None) -> tuple:
        """The iterations ``steps``; ``side`` (or ``None``): the side inputs ``[M, mb, ...]`` of every microbatch,
        each stage reading those of the microbatch it works on."""
        s_, m_, r_, k_ = self.s, self.m, self.r, self.k
        stage = self.stage
        ring = [(i, (i + 1) % s_) for i in range(s_)] if r_ > 1 else [(i, i + 1) for i in range(s_ - 1)]
        left = [(i, i - 1) for i in range(1, s_)]

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
            extra = () if side is None else (_per_stage(side, work % m_),)
            with nn.logical_axis_rules(()):  # the model's activation constraints do not apply per stage
                out = jax.vmap(self.stage_fn, spmd_axis_name=PP)(weights(t), inputs, *extra)
            if self.outputs:
                out, layer_sums = out
                # each stage adds its layers' sums into its repeat's slot, bubbles (zero inputs) add nothing
                hot = (jnp.arange(r_)[None, :] == self.repeat(t)[:, None]) & ((work >= 0) & (work < m_ * r_))[:, None]
                sums = [
                    jax.tree.map(
                        lambda a, x: a + jnp.where(hot.reshape(*hot.shape, *(1,) * (x.ndim - 1)), x[:, None], 0),
                        sums[0],
                        layer_sums,
                    )
                ]
            new_shift = _permute(out, ring)
            column_next = _where_stage(stage == s_ - 1, out, _permute(fresh, left))
            state_io = jax.lax.dynamic_update_index_in_dim(state_io, column_next, column, 1)
            return (new_shift, state_io, circ, *sums), None

        if self.cfg.remat:
            policy = jax.checkpoint_policies.save_only_these_names(ITERATION_INPUT)
            iteration = jax.checkpoint(iteration, policy=policy, prevent_cse=False)
        carry, _ = jax.lax.scan(iteration, carry, steps, unroll=self.cfg.unroll)
        return carry

    def finish(self, state_io: jax.Array) -> jax.Array:
        return jnp.roll(state_io, -(((self.r - 1) * self.m + self.s - 1) % self.k), axis=1)


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
    """The pipeline on microbatches ``state_io[S, K, mb, ...]`` (S over ``pp``, mb over ``rows``); with
    ``outputs``, also the stages' per-layer sums over every microbatch, ``[L, ...]``; ``side``: every
    microbatch's side inputs ``[M, mb, ...]`` (:meth:`_Loop.run`)."""
    loop = _Loop(stage_fn, cfg, stages, fill, rows, outputs)

    def weights(t: jax.Array) -> Any:
        if loop.r == 1:
            return jax.tree.map(lambda w: w[0], stacked)
        return jax.tree.map(lambda w: _pick(w, loop.repeat(t)), stacked)

    carry = loop.init(state_io)
    if outputs:
        carry = (*carry, loop.sums(weights, carry[0], side))
    _, state_io, _, *sums = loop.run(weights, carry, jnp.arange(cfg.iterations(stages)), side)
    if not outputs:
        return loop.finish(state_io)
    return loop.finish(state_io), loop.layer_order(sums[0])
