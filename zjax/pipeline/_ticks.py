"""The table engine: a pipeline whose forward and backward passes follow a schedule's table tick by tick.

:func:`loss` runs a whole model (``first`` on the inputs, the stacked layers in stages, ``last`` to a
scalar) as one ``lax.scan`` over the table's ticks, inside a ``shard_map`` manual over ``pp`` and the
data axes. On every tick each stage looks up its action (:mod:`._schedule`) and runs it in a
``lax.switch``: F applies the stage's chunk to a microbatch (stage 0 starts from ``first``, the last
stage ends in ``last`` and its gradient), B pulls the output gradient back to the stage's input, W to
its weights. B and W pull back through one ``jax.vjp`` per microbatch (:mod:`._stash`): the forward's
(it keeps what the remat policy saves), or, when the policy saves nothing but the layers' inputs, B's
(B recomputes the stage once, keeping its matrix products for its W), so no action runs a forward that
another kept, and each computes only its part of the backward pass. Then every stage sends its F
output forward and its B output backward (two ``ppermute``s over ``pp``). Inputs, gradients and
residuals wait in slot buffers sized by the table (:mod:`._slots`), so memory follows the schedule's
microbatches in flight, not the number of microbatches.

The gradients are made in the forward pass (the schedule interleaves F, B and W), so :func:`loss` is a
``custom_vjp`` whose backward pass only scales them by the loss's cotangent. They are seeded with
:func:`seed` (the train step's loss scale) so that fp16 loss scaling protects them as it protects the
GPipe engine's. Without differentiation (``eval_step``) the loss runs GPipe's scan, or the table's forwards alone.

The data axes are manual here. With ``zero3_gather="step"`` every data-parallel rank keeps whole weights
and whole gradients for the step (gathered over ``dp`` once at the start at stages 2 and 3, reduced once at
the end): ZeRO's traffic, with the memory of stage 1 for the layers during the step. With ``"layer"``
(stage 3) the layers stay ``dp`` shards: each action gathers each layer as the stage reads it and each W
reduce-scatters its gradient (:func:`zjax.comm.shard_reads`).
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
import numpy as np
from jax.sharding import PartitionSpec as P

from ..comm import Reduction, shard_reads
from ..sharding import DP, PP
from . import _schedule, _slots
from ._config import Pipeline
from ._context import accumulate_dtype, call_stage, data_axes_here, quantize_wire, reduce_wire
from ._slots import Keep
from ._stash import Stash, pullback, pulled

ACTION_SCOPE = "zjax_action_"
"""The name scope of a table schedule's actions (``zjax_action_F``, ``_B``, ``_W``) in the compiled program."""

ENDS_SCOPE = "zjax_ends"
"""The name scope, inside a table schedule's actions, of what only the first or the last stage runs (``first``,
``last`` and their gradients): the conditional branches that run on ``1 / (S x repeats)`` of the actions."""


def _ends(fn: Callable) -> Callable:
    def named(*args: Any) -> Any:
        with jax.named_scope(ENDS_SCOPE):
            return fn(*args)

    return named


_SEED: contextvars.ContextVar[Any] = contextvars.ContextVar("zjax_pipeline_seed", default=None)


@contextlib.contextmanager
def seed(scale: Any) -> Iterator[None]:
    """Seed the table engine's backward pass with ``scale`` (the loss scale) while a loss is traced."""
    token = _SEED.set(scale)
    try:
        yield
    finally:
        _SEED.reset(token)


def _named(fn: Callable, action: str) -> Callable:
    """``fn`` traced under the name scope ``zjax_action_<action>`` (its ops' ``op_name`` carries it)."""

    def named(*args: Any) -> Any:
        with jax.named_scope(f"{ACTION_SCOPE}{action}"):
            return fn(*args)

    return named


def _gathering(stage_fn: Callable, layers: Any, dims: list[int | None]) -> Callable:
    """``stage_fn`` traced under :func:`zjax.comm.shard_reads`: each layer it reads is gathered over ``dp`` (``dims``:
    per leaf of ``layers``, the split dim in one layer's slice)."""

    def fn(w: Any, h: jax.Array, *side: Any) -> Any:
        grads = reduce_wire()  # qgZ: each W's gradient reduce-scattered as integer blocks
        with shard_reads(DP, layers, dims, quantize_wire(), reduction=None if grads is None else Reduction(wire=grads)):
            return stage_fn(w, h, *side)

    return fn


def _check_reads(
    stage_fn: Callable, first: Callable, cfg: Pipeline, stacked: Any, dims: list[int | None], ep: Any, rows: Any,
    ranks: int,
) -> None:  # fmt: skip
    """Raise unless ``stage_fn`` reads every layer weight split over dp through :func:`zjax.comm.gathered_tree`
    (traced abstractly on one microbatch and one whole chunk): one it does not read would reach it as a shard."""
    per = ranks * cfg.microbatches
    mb = jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] // per, *a.shape[1:]), a.dtype), rows)
    chunk = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[2:], a.dtype), stacked)
    with nn.logical_axis_rules(()), shard_reads(DP, stacked, dims, None, gather=False) as read:
        h = jax.eval_shape(first, ep, mb[0])
        jax.eval_shape(lambda w, h, side: call_stage(stage_fn, w, h, side), chunk, h, mb[1])
    split = sum(d is not None for d in dims)
    if len(read) < split:
        raise ValueError(
            f"zjax.pipeline.loss: zero3_gather='layer' under schedule={cfg.name!r} gathers each layer's "
            "weights over dp where the stage reads them through zjax.comm.gathered_tree(layer, (..., 'layers')) "
            f"(the model's path of the stacked layers); this stage_fn read {len(read)} of the {split} split "
            "weights so, and would compute on dp shards. Read each layer so in layer_fn (zjax.models.Decoder "
            "does), or use Pipeline(zero3_gather='step')."
        )


def _tallied(stage_fn: Callable, tally: Callable) -> Callable:
    """``stage_fn`` (returning ``(h, sums)``) as the engine runs it with ``tally``: its side input ``(side,
    microbatch)``, its output ``(h, (tally(sums, microbatch), sums))``, the sums not differentiated."""

    def fn(w: Any, h: jax.Array, both: tuple) -> Any:
        side, mb = both
        h, sums = call_stage(stage_fn, w, h, side)
        return h, (jnp.asarray(tally(sums, mb), jnp.float32), jax.lax.stop_gradient(sums))

    return fn


def _zeros(tree: Any, dtype: Any = None) -> Any:
    return jax.tree.map(lambda a: jnp.zeros(a.shape, dtype or a.dtype), tree)


def _tick_loop(
    stage_fn: Callable, first: Callable, last: Callable, cfg: Pipeline, stages: int,
    w: Any, ep: Any, inputs: Any, scale: jax.Array, side: Any = None, keep: tuple[Keep, Callable] | None = None,
    tally: Callable | None = None, forward_only: bool = False, maxed: Any = None,
) -> tuple:  # fmt: skip
    """One device's part of the schedule (inside the manual region): ``w`` its chunks ``[v, Lps, ...]``, ``ep``
    (the parameters ``first`` and ``last`` read) whole, ``inputs`` its rows. Returns ``(loss, dw, dep, sums)``
    summed over its microbatches (one accumulator for ``first`` and ``last``: a tied table's two gradients meet
    there, before the one reduction over the ranks). ``keep``: which action makes the residuals B and W pull
    back from, and the stage function whose pullback they are (:func:`zjax.pipeline.scan_layers` says).
    ``tally``: the stage returns ``(h, sums)`` (per-layer sums ``[Lps, ...]``) and ``tally(sums, mb)`` is the
    microbatch's loss term of them, part of ``loss`` and differentiated with it; ``sums`` is then ``(the terms'
    sum, the sums per chunk [v, Lps, ...])`` over the microbatches (``None`` without ``tally``). ``forward_only``
    (an evaluation): the table's forwards alone (:meth:`Table.forwards`); ``dw`` and ``dep`` are then ``None``.
    ``maxed``: a pytree like ``w`` of bools: leaves whose cotangents combine by their maximum, not their sum."""
    mode, saving = keep or ("F", stage_fn)
    if tally is not None:  # the stage's sums: the loss term of the microbatch's own, and the sums themselves
        stage_fn, saving = _tallied(stage_fn, tally), _tallied(saving, tally)
    tab = cfg.table(stages).forwards() if forward_only else cfg.table(stages)
    plan = _slots.slots(tab, mode)
    m_ = cfg.microbatches
    mbs, sides = jax.tree.map(lambda a: a.reshape(m_, a.shape[0] // m_, *a.shape[1:]), (inputs, side))
    if tally is not None:
        sides = (sides, mbs)
    chunk = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), w)
    side0 = jax.tree.map(lambda a: a[0], sides)
    with nn.logical_axis_rules(()):  # as the actions run (the model's activation constraints do not apply)
        probe = jax.eval_shape(first, ep, jax.tree.map(lambda a: a[0], mbs))
        stash = Stash.of(saving, chunk, probe, side0)
        # the sums' shapes (a tallied stage's only: the stage is traced abstractly once more for them)
        out: Any = tally and jax.eval_shape(lambda w, x, sd: call_stage(stage_fn, w, x, sd), chunk, probe, side0)
    h_zero, sums_zero = jnp.zeros(probe.shape, probe.dtype), None if tally is None else _zeros(out[1][1])

    def output(y: Any) -> tuple[jax.Array, jax.Array, Any]:
        """The stage's output: ``(h, its loss term, its sums)``."""
        return (y, jnp.float32(0), None) if tally is None else (y[0], y[1][0], y[1][1])

    def cotangent(dy: jax.Array) -> Any:
        """The stage output's cotangent: ``dy`` for ``h``, the loss scale for the loss term."""
        return dy if tally is None else (dy, (scale, sums_zero))

    ring = cfg.repeats > 1 and tab.placement == "loop"
    pairs = {  # the channels' pp neighbours (_slots.UP, DOWN)
        _slots.UP: [(i, (i + 1) % stages) for i in range(stages if ring else stages - 1)],
        _slots.DOWN: [((i + 1) % stages, i) for i in range(stages if ring else stages - 1)],
    }
    # which channel brings inputs (x) and which output gradients (g): in a loop forwards go up and backwards down
    carries = {b: [ch for ch in range(3) if np.any(r[..., ch] != n)] for b, r, n in (("x", plan.recv_x, plan.n_x),
               ("g", plan.recv_g, plan.n_g))}  # fmt: skip
    stage = jax.lax.axis_index(PP)
    columns = {
        "kind": tab.kind, "micro": tab.micro, "chunk": tab.chunk, "recv_x": plan.recv_x, "recv_g": plan.recv_g,
        "read_x": plan.read_x, "read_g": plan.read_g, "read_r": plan.read_r, "store_x": plan.store_x,
        "store_g": plan.store_g, "store_r": plan.store_r, "first": plan.first, "last": plan.last, "send": plan.send,
    }  # fmt: skip
    xs = {k: jnp.asarray(v) for k, v in columns.items()}

    # the residuals stay in their buffers: read and written inside the action that uses them, by slot
    def keep_res(rbuf: list, row: Any, pull: Callable, wc: Any) -> list:
        return [b.at[row["store_r"]].set(a) for b, a in zip(rbuf, stash.split(pull, wc), strict=True)]

    def read_res(rbuf: list, row: Any, wc: Any) -> Callable:
        return stash.join([b[row["read_r"]] for b in rbuf], wc)

    def idle(row, mb, sd, wc, x, dy, rbuf, acc):
        return h_zero, h_zero, h_zero, h_zero, rbuf, acc

    def forward(row, mb, sd, wc, x, dy, rbuf, acc):
        x = jax.lax.cond(row["first"], _ends(lambda: first(ep, mb).astype(h_zero.dtype)), lambda: x)
        if mode == "F" and not forward_only:  # the forward keeps what the remat policy saves
            y, pull = pullback(saving, wc, x, sd)
            rbuf = keep_res(rbuf, row, pull, wc)
        else:
            y = call_stage(stage_fn, wc, x, sd)
        y, term, sums = output(y)

        def with_loss():
            value, pull = jax.vjp(lambda ep_, y_: last(ep_, y_, mb), ep, y)
            dep, dy = pull(scale.astype(value.dtype))
            return value.astype(jnp.float32), jax.tree.map(lambda a: a.astype(jnp.float32), dep), dy

        def with_loss_only():  # an evaluation's
            return jnp.asarray(last(ep, y, mb), jnp.float32), None, jnp.zeros_like(y)

        ends, none = (with_loss_only, None) if forward_only else (with_loss, _zeros(ep, jnp.float32))
        value, dep, dy = jax.lax.cond(row["last"], _ends(ends), lambda: (jnp.float32(0), none, jnp.zeros_like(y)))
        loss, dw, dep_acc, sums_acc = acc
        if sums is not None:  # (the loss terms, the sums per chunk)
            sums_acc = (sums_acc[0] + term, jax.tree.map(lambda a, s: a.at[row["chunk"]].add(s), sums_acc[1], sums))
        return y, h_zero, x, dy, rbuf, (loss + value + term, dw, jax.tree.map(jnp.add, dep_acc, dep), sums_acc)

    def backward(row, mb, sd, wc, x, dy, rbuf, acc):
        if mode == "F":
            pull = read_res(rbuf, row, wc)
        else:  # B recomputes the stage keeping what its W needs
            _, pull = pullback(saving, wc, x, sd)
            rbuf = keep_res(rbuf, row, pull, wc)
        dx = pulled(pull, cotangent(dy), 1)

        def into_first():
            _, pull_first = jax.vjp(lambda ep_: first(ep_, mb).astype(h_zero.dtype), ep)
            (dep,) = pull_first(dx)
            return jax.tree.map(lambda a: a.astype(jnp.float32), dep)

        dep = jax.lax.cond(row["first"], _ends(into_first), lambda: _zeros(ep, jnp.float32))
        loss, dw, dep_acc, sums_acc = acc
        return h_zero, dx, h_zero, h_zero, rbuf, (loss, dw, jax.tree.map(jnp.add, dep_acc, dep), sums_acc)

    most = jax.tree.map(lambda _: False, w) if maxed is None else maxed

    def weights(row, mb, sd, wc, x, dy, rbuf, acc):
        dwc = pulled(read_res(rbuf, row, wc), cotangent(dy), 0)
        loss, dw, dep, sums_acc = acc
        into = lambda m, a, g: getattr(a.at[row["chunk"]], "max" if m else "add")(g.astype(a.dtype))  # noqa: E731
        dw = jax.tree.map(into, most, dw, dwc)
        return h_zero, h_zero, h_zero, h_zero, rbuf, (loss, dw, dep, sums_acc)

    # indexed by _schedule.IDLE, F, B, W (a table of forwards alone runs no B or W); each action's ops named for the
    # planner's FLOPs per action
    actions = zip((forward, backward, weights)[: 1 if forward_only else 3], _schedule.ACTIONS[1:], strict=False)
    branches = [idle] + [_named(f, a) for f, a in actions]

    def send(row: Any, y: jax.Array, dx: jax.Array) -> list[jax.Array]:
        """The messages on the channels (up, down, self) that the stages read on the next tick."""
        if tab.placement == "loop":  # a forward's output goes up, a backward's down
            outs = [y, dx, None]
        else:  # in a V either goes either way (or stays, at the turn); an action makes one of them
            out = y + dx
            outs = [jnp.where(row["send"] == ch, out, jnp.zeros_like(out)) for ch in range(3)]
        msgs = [jax.lax.ppermute(o, PP, pairs[ch]) if pairs[ch] else h_zero for ch, o in enumerate(outs[:2])]
        return [*msgs, h_zero if outs[2] is None else outs[2]]

    def tick(carry, columns):
        xbuf, gbuf, rbuf, msgs, acc = carry
        row = jax.tree.map(lambda a: a[stage], columns)
        for ch in carries["x"]:
            xbuf = xbuf.at[row["recv_x"][ch]].set(msgs[ch])
        for ch in carries["g"]:
            gbuf = gbuf.at[row["recv_g"][ch]].set(msgs[ch])
        mb, sd = jax.tree.map(lambda a: a[row["micro"]], (mbs, sides))
        wc = jax.tree.map(lambda a: a[row["chunk"]], w)
        y, dx, x_new, dy_new, rbuf, acc = jax.lax.switch(
            row["kind"], branches, row, mb, sd, wc, xbuf[row["read_x"]], gbuf[row["read_g"]], rbuf, acc
        )
        xbuf = xbuf.at[row["store_x"]].set(x_new)
        gbuf = gbuf.at[row["store_g"]].set(dy_new)
        return (xbuf, gbuf, rbuf, send(row, y, dx), acc), None

    per_chunk = None
    if tally is not None:
        per_chunk = (jnp.float32(0), jax.tree.map(lambda a: jnp.zeros((cfg.repeats, *a.shape), a.dtype), sums_zero))
    grads = (None, None) if forward_only else (_zeros(w, jnp.float32), _zeros(ep, jnp.float32))
    acc = (jnp.float32(0), *grads, per_chunk)
    carry: tuple = (
        jnp.zeros((plan.n_x + 1, *probe.shape), probe.dtype),  # + 1: the scratch slot
        jnp.zeros((plan.n_g + 1, *probe.shape), probe.dtype),
        [jnp.zeros((plan.n_r, *a.shape), a.dtype) for a in stash.kept],
        [h_zero] * 3,
        acc,
    )
    with nn.logical_axis_rules(()):  # the model's activation constraints do not apply per stage
        (*_, acc), _ = jax.lax.scan(tick, carry, xs)
    return acc


def run(
    stage_fn: Callable, first: Callable, last: Callable, cfg: Pipeline, stacked: Any, ep: Any, inputs: Any,
    scale: jax.Array, side: Any = None, dims: list[int | None] | None = None, keep: tuple[Keep, Callable] | None = None,
    tally: Callable | None = None, split: list[dict[int, str] | None] | None = None, forward_only: bool = False,
    maxed: Any = None,
) -> tuple:  # fmt: skip
    """The schedule over the mesh: ``(loss, dw, dep, sums)`` with ``stacked`` leaves ``[R, S, Lps, ...]``;
    gradients seeded with ``scale``, accumulated in fp32 on each rank and summed over the ranks in the
    parameters' dtypes. ``side``: per-row side inputs every stage reads (``stage_fn(w, h, side_mb)``).

    ``dims`` (``zero3_gather="layer"``): per leaf of ``stacked`` (``jax.tree.leaves`` order), the dim of the
    natural ``[L, ...]`` layout split over ``dp`` (``None``: whole). Those leaves enter as their ``dp`` shards,
    the stage reads each layer through :func:`zjax.comm.gathered_tree` (gathered over ``dp`` per action,
    :func:`zjax.comm.shard_reads`) and their gradients accumulate as shards.

    ``keep``: ``("F", fn)`` (the default, with ``stage_fn``): each forward keeps the residuals of ``fn``'s pullback
    (what its remat policy saves) and B and W pull back from them; ``("B", fn)``: each forward keeps its input,
    and B recomputes the stage as ``fn`` (which saves what W needs), keeping the residuals for its W.

    ``split``: per leaf, ``{dim: data axis}`` (natural ``[L, ...]`` dims) that splits it on every rank (an expert
    weight's experts over ``ep``): it enters as that axis's shard and is copied over the other data axes only.

    ``tally`` (:func:`zjax.pipeline.loss`'s): ``sums`` is ``(the loss terms' sum, the per-layer sums [R, S, Lps,
    ...])`` over every microbatch and rank (``None`` without it). ``forward_only``, ``maxed``: :func:`_tick_loop`'s."""
    sizes = dict(jax.sharding.get_abstract_mesh().shape)
    stages = sizes.get(PP, 1)
    data = data_axes_here(sizes)
    n = math.prod(sizes[a] for a in data)
    lead = data or None
    every = (*data, PP)
    free = lambda nd: [P.UNCONSTRAINED] * nd  # noqa: E731 - tp and the like stay as they are

    def copies(tree: Any, count: int, spec: Callable[[jax.Array], P]) -> tuple[Any, Any]:
        """One copy per rank on a new leading dim (a broadcast; the gradient's sum over it is the reduction)."""
        out = jax.tree.map(lambda a: jnp.broadcast_to(a[None], (count, *a.shape)), tree)
        out = jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, spec(a)), out)
        return out, jax.tree.map(lambda a: P(*[None if e is P.UNCONSTRAINED else e for e in spec(a)]), out)

    leaves, treedef = jax.tree.flatten(stacked)
    dims = dims or [None] * len(leaves)

    def enter(a: jax.Array, d: int | None, sp: dict[int, str] | None) -> tuple[jax.Array, P]:
        kept = {**({} if d is None else {d: DP}), **{k: x for k, x in (sp or {}).items() if x in data}}
        if not kept:
            return copies(a, n, lambda a: P(lead, None, PP, *free(a.ndim - 3)))
        rest = tuple(x for x in data if x not in kept.values())  # the data axes it is copied over
        entries: list[Any] = [rest or None, None, PP, *free(a.ndim - 2)]
        for k, x in kept.items():  # natural dim k of [L, ...] is k + 2 of [R, S, Lps, ...], + 1 for the copies
            entries[k + 3] = x
        return copies(a, math.prod(sizes[x] for x in rest), lambda _: P(*entries))

    w_in, w_spec = (
        jax.tree.unflatten(treedef, t)
        for t in zip(*map(enter, leaves, dims, split or [None] * len(leaves)), strict=True)
    )
    if any(d is not None for d in dims):
        layer_dims = [None if d is None else d - 1 for d in dims]
        _check_reads(stage_fn, first, cfg, stacked, layer_dims, ep, (inputs, side), n)
        stage_fn = _gathering(stage_fn, stacked, layer_dims)
        keep = None if keep is None else (keep[0], _gathering(keep[1], stacked, layer_dims))
    ep_in, ep_spec = copies(ep, n * stages, lambda a: P(every, *free(a.ndim - 1)))
    in_rows = jax.tree.map(lambda a: P(lead), (inputs, side))

    def body(w, ep, rows, scale):
        w = jax.tree.map(lambda a: a[0, :, 0], w)  # [R, Lps, ...]: this stage's chunks
        ep = jax.tree.map(lambda a: a[0], ep)
        loss, dw, dep, sums = _tick_loop(
            stage_fn, first, last, cfg, stages, w, ep, rows[0], scale, rows[1], keep, tally, forward_only, maxed
        )
        if sums is not None:  # the terms per rank; the sums over the data ranks, [R, 1, Lps, ...] per stage
            per_layer = jax.tree.map(lambda a: (jax.lax.psum(a, data) if data else a)[:, None], sums[1])
            sums = (sums[0][None], per_layer)
        return loss[None], jax.tree.map(lambda a: a[None, :, None], dw), jax.tree.map(lambda a: a[None], dep), sums

    grad_specs = (None, None) if forward_only else (w_spec, ep_spec)
    loss, dw, dep, sums = jax.shard_map(
        body,
        in_specs=(w_spec, ep_spec, in_rows, P()),
        out_specs=(P(every), *grad_specs, None if tally is None else (P(every), P(None, PP))),
        axis_names={*data, PP},
        check_vma=False,
    )(w_in, ep_in, (inputs, side), scale)

    # the reduction over the ranks in the parameters' (compute) dtype, ZeRO's bytes (lax.reduce: jnp.sum would
    # accumulate a 16-bit sum in fp32, and the all-reduce with it); in Plan(reduce_dtype=...)'s if it asks
    wide = accumulate_dtype()

    def total(tree: Any, like: Any, maxed: Any = None) -> Any:
        def one(a: jax.Array, p: jax.Array, most: bool = False) -> jax.Array:
            dtype = p.dtype if wide is None or p.dtype.itemsize >= wide.itemsize else wide
            return jax.lax.reduce(a.astype(dtype), jnp.zeros((), dtype), jax.lax.max if most else jax.lax.add, (0,))

        return jax.tree.map(one, tree, like, *([] if maxed is None else [maxed]))

    sums = None if sums is None else (jnp.sum(sums[0]), sums[1])
    return jnp.sum(loss), *((None, None) if forward_only else (total(dw, stacked, maxed), total(dep, ep))), sums
