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
  With ``zero3_gather="chunk"`` the region covers every data axis and the weights enter split over
  ``dp``: :func:`_chunked` gathers each repeat's chunk once forward and once backward and
  reduce-scatters its gradient once (its own backward pass).
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

from ..remat import RematPolicy, nested_scan
from ..sharding._axes import DATA_AXES, DP, PP
from ..sharding._mesh import mesh_platform
from ..stages._placement import add_axis
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


_INITIALIZING: contextvars.ContextVar[bool] = contextvars.ContextVar("zjax_pipeline_init", default=False)


@contextlib.contextmanager
def initializing() -> Iterator[None]:
    """While a model's parameters are made (``plan.init``): :func:`apply` runs its stages one after the
    other, whatever the mesh (only shapes matter, and the layers may not be sharded yet)."""
    token = _INITIALIZING.set(True)
    try:
        yield
    finally:
        _INITIALIZING.reset(token)


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


class _Loop:
    """One schedule's loop pieces: the initial carry, the iteration, and the final column order.

    The carry is ``(shift, state_io, circ)``; ``weights(t)`` gives every stage's weights for iteration
    ``t`` (leaves ``[S, Lps, ...]``). :func:`_pipeline` runs all iterations with weights picked from the
    stacked chunks; :func:`_chunked` runs them in phases of ``M`` with each phase's chunks gathered.
    """

    def __init__(self, stage_fn: Callable, cfg: Pipeline, stages: int, fill: float, rows: Any) -> None:
        self.stage_fn, self.cfg, self.s, self.fill, self.rows = stage_fn, cfg, stages, fill, rows
        self.m, self.r = cfg.microbatches, cfg.repeats
        self.k = self.m // stages

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

    def run(self, weights: Callable[[jax.Array], Any], carry: tuple, steps: jax.Array) -> tuple:
        s_, m_, r_, k_ = self.s, self.m, self.r, self.k
        stage = self.stage
        ring = [(i, (i + 1) % s_) for i in range(s_)] if r_ > 1 else [(i, i + 1) for i in range(s_ - 1)]
        left = [(i, i - 1) for i in range(1, s_)]

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
                out = jax.vmap(self.stage_fn, spmd_axis_name=PP)(weights(t), inputs)
            new_shift = _permute(out, ring)
            column_next = _where_stage(stage == s_ - 1, out, _permute(fresh, left))
            state_io = jax.lax.dynamic_update_index_in_dim(state_io, column_next, column, 1)
            return (new_shift, state_io, circ), None

        if self.cfg.remat:
            policy = jax.checkpoint_policies.save_only_these_names(ITERATION_INPUT)
            iteration = jax.checkpoint(iteration, policy=policy, prevent_cse=False)
        carry, _ = jax.lax.scan(iteration, carry, steps, unroll=self.cfg.unroll)
        return carry

    def finish(self, state_io: jax.Array) -> jax.Array:
        return jnp.roll(state_io, -(((self.r - 1) * self.m + self.s - 1) % self.k), axis=1)


def _pipeline(
    stage_fn: Callable, stacked: Any, state_io: jax.Array, cfg: Pipeline, stages: int, fill: float, rows: Any
) -> jax.Array:
    """The pipeline on microbatches ``state_io[S, K, mb, ...]`` (S over ``pp``, mb over ``rows``)."""
    loop = _Loop(stage_fn, cfg, stages, fill, rows)

    def weights(t: jax.Array) -> Any:
        if loop.r == 1:
            return jax.tree.map(lambda w: w[0], stacked)
        return jax.tree.map(lambda w: _pick(w, loop.repeat(t)), stacked)

    _, state_io, _ = loop.run(weights, loop.init(state_io), jnp.arange(cfg.iterations(stages)))
    return loop.finish(state_io)


def _per_stage(collective: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """Run a ``dp`` collective on a chunk ``[S, ...]`` stage by stage, in a region manual over ``pp`` too: in
    one manual over the data axes only, GSPMD first replicates the operand over ``pp`` (4x the bytes at
    pp=4)."""
    return jax.shard_map(collective, in_specs=P(PP), out_specs=P(PP), axis_names={PP}, check_vma=False)(x)


def _chunked(
    stage_fn: Callable, stacked: Any, state_io: jax.Array, cfg: Pipeline, stages: int, fill: float,
    dims: list[int | None],
) -> jax.Array:  # fmt: skip
    """``zero3_gather="chunk"``: the pipeline with each repeat's chunk gathered over ``dp`` once forward and
    once backward, and its gradient reduce-scattered once (ZeRO-3's 3 psi), inside a region manual over the
    data axes.

    ``stacked`` holds this rank's ``dp`` shards ``[R, S, Lps, ...]`` (``dims``: the dim split over ``dp``
    per leaf in ``jax.tree.leaves`` order, ``None`` if whole). The loop runs in R phases of M iterations
    (the last takes the S - 1 draining ones too); in phase p every stage applies chunk p or, not yet
    there, chunk p - 1, so a phase needs two gathered chunks and hands the newer one on to the next
    phase. Forward saves the carry at each phase's start; backward walks the phases in reverse, gathers
    each chunk once more, recomputes the phase (its own iteration remat) under ``jax.vjp``, sums chunk p's
    gradient over the two phases that used it and reduce-scatters it once.
    """
    loop = _Loop(stage_fn, cfg, stages, fill, None)
    m_, r_ = loop.m, loop.r

    treedef = jax.tree.structure(stacked)

    def per_leaf(fn: Callable[[jax.Array, int | None], jax.Array], tree: Any) -> Any:  # fn(leaf, its dp dim)
        return jax.tree.unflatten(treedef, [fn(x, d) for x, d in zip(jax.tree.leaves(tree), dims, strict=True)])

    def gather(stacked: Any, p: Any, after: Any) -> Any:
        """Chunk p, whole (leaves ``[S, Lps, ...]``), gathered no earlier than ``after`` is computed: the
        scheduler may otherwise gather every chunk at the start (all of them live: "step" mode's memory)."""
        _, stacked = jax.lax.optimization_barrier((after, jax.tree.map(lambda w: w[p], stacked)))

        def one(w: jax.Array, d: int | None) -> jax.Array:
            if d is None:
                return w
            return _per_stage(lambda x: jax.lax.all_gather(x, DP, axis=d - 1, tiled=True), w)  # noqa: B023

        return per_leaf(one, stacked)

    # XLA:CPU aborts on 16-bit reductions in a region manual over some axes ("Invalid binary instruction
    # opcode copy", jax 0.10.2); it widens them to fp32 anyway. GPUs reduce in the gradients' dtype.
    widen = mesh_platform() == "cpu"

    def scatter(grads: Any) -> Any:  # a chunk's gradient, summed over dp into this rank's shard
        def one(g: jax.Array, d: int | None) -> jax.Array:
            if d is None:
                return g
            wide = widen and jnp.finfo(g.dtype).bits < 32
            out = _per_stage(
                lambda x: jax.lax.psum_scatter(x, DP, scatter_dimension=d - 1, tiled=True),  # noqa: B023
                g.astype(jnp.float32) if wide else g,
            )
            return out.astype(g.dtype)

        return per_leaf(one, grads)

    def phase(prev: Any, cur: Any, carry: tuple, p: Any, length: int) -> tuple:
        """Iterations ``p*M .. p*M + length - 1``: stages past phase p's start apply ``cur``, others ``prev``."""

        def weights(t: jax.Array) -> Any:
            if prev is None:
                return cur
            newer = loop.repeat(t) == p
            return jax.tree.map(lambda a, b: _where_stage(newer, a, b), cur, prev)

        return loop.run(weights, carry, p * m_ + jnp.arange(length))

    last = m_ + stages - 1  # the last phase also drains the pipeline

    def vjp(prev: Any, cur: Any, start: tuple, p: Any, length: int, dcarry: tuple) -> tuple:
        _, pull = jax.vjp(lambda a, b, c: phase(a, b, c, p, length), prev, cur, start)
        return pull(dcarry)

    def stack(*trees: Any) -> Any:  # per-chunk gradients (leading dim 1 or n) -> [R, ...]
        return jax.tree.map(lambda *xs: jnp.concatenate(xs), *trees)

    # Phases 1 .. R-2 run as one lax.scan (their work is alike): the program does not grow with R, and
    # each phase's gathered chunks and gradient accumulators are made inside the loop body, so only one
    # phase's are ever live (as separate phases XLA made every phase's zero accumulators at once).
    middle = lambda: jnp.arange(1, r_ - 1)  # noqa: E731 - made inside each rule (no closed-over tracers)

    @jax.custom_vjp
    def run(stacked: Any, io: jax.Array) -> jax.Array:
        return fwd(stacked, io)[0]

    def fwd(stacked: Any, io: jax.Array) -> tuple:
        first = loop.init(io)
        cur = gather(stacked, 0, first)
        if r_ == 1:
            return phase(None, cur, first, 0, last)[1], (stacked, first, None, None)

        def body(state: tuple, p: jax.Array) -> tuple:
            carry, cur = state
            prev, cur = cur, gather(stacked, p, carry)
            return (phase(prev, cur, carry, p, m_), cur), carry

        starts: Any
        (start, cur), starts = jax.lax.scan(body, (phase(None, cur, first, 0, m_), cur), middle())
        out = phase(cur, gather(stacked, r_ - 1, start), start, r_ - 1, last)
        return out[1], (stacked, first, starts, start)

    def bwd(res: tuple, g: jax.Array) -> tuple:
        stacked, first, starts, start = res
        zeros = jax.tree.map(jnp.zeros_like, first)
        dcarry = (zeros[0], g, zeros[2])
        cur = gather(stacked, r_ - 1, dcarry)
        if r_ == 1:
            _, dcur, dcarry = vjp(None, cur, first, 0, last, dcarry)
            return stack(jax.tree.map(lambda x: x[None], scatter(dcur))), dcarry[1]
        prev = gather(stacked, r_ - 2, dcarry)
        dprev, dcur, dcarry = vjp(prev, cur, start, r_ - 1, last, dcarry)
        tail = scatter(dcur)  # chunk R-1 is complete: only the last phase used it

        def body(state: tuple, xs: tuple) -> tuple:
            cur, dcur, dcarry = state
            p, start = xs
            prev = gather(stacked, p - 1, dcarry)
            dprev, dc, dcarry = vjp(prev, cur, start, p, m_, dcarry)
            # chunk p is complete: phases p + 1 and p were its only users
            return (prev, dprev, dcarry), scatter(jax.tree.map(jnp.add, dcur, dc))

        mids: Any
        (cur, dcur, dcarry), mids = jax.lax.scan(body, (prev, dprev, dcarry), (middle(), starts), reverse=True)
        _, dc, dcarry = vjp(None, cur, first, 0, m_, dcarry)
        head = scatter(jax.tree.map(jnp.add, dcur, dc))
        lead = lambda tree: jax.tree.map(lambda x: x[None], tree)  # noqa: E731
        return stack(lead(head), mids, lead(tail)), dcarry[1]

    run.defvjp(fwd, bwd)
    return loop.finish(run(stacked, state_io))


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
    if policy.kind == "nested":  # groups of the stage's layers (zjax.remat.nested_scan)
        return lambda stage_layers, h: nested_scan(layer_fn, stage_layers, h, policy)

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
      pipeline: the schedule; by default the plan's (:func:`current`). Without one (a model's
        ``init``, or a mesh without ``pp``) the stages run one after the other on the whole batch: the
        same function, so ``plan.init`` and a model's own ``init`` need nothing special.

    Returns:
      ``y[B, ...]``, split over the data axes and ``pp`` (embeddings, head and loss then run data
      parallel over both).

    Raises:
      ValueError: ``pp > 1`` in the mesh and no schedule; a table schedule (``"1f1b"`` and the like),
        which needs the loss inside the pipeline (:func:`zjax.pipeline.loss`).
    """
    cfg = current() if pipeline is None else pipeline
    mesh = jax.sharding.get_abstract_mesh()
    stages = 1 if mesh.empty else dict(mesh.shape).get(PP, 1)
    count = _layer_count(layers)
    if _INITIALIZING.get():
        return sequential(stage_fn, layers, x, 1, 1)
    if cfg is None:
        if stages > 1:
            raise ValueError(
                f"zjax.pipeline.apply: the mesh has pp={stages} but no pipeline schedule is active: build the "
                "plan with zjax.Plan(..., pipeline=zjax.Pipeline(microbatches=...)) and call the model inside "
                "plan.train_step / plan.eval_step (or pass pipeline=... here)."
            )
        return sequential(stage_fn, layers, x, 1, 1)
    if cfg.tabled:
        raise ValueError(
            f"zjax.pipeline.apply: schedule={cfg.schedule!r} interleaves each microbatch's forward and backward "
            "passes, so the pipeline must compute the loss: call zjax.pipeline.loss(stage_fn, layers, inputs, "
            "first=..., last=...) instead (zjax.models.lm_loss does), or use schedule='gpipe'."
        )
    sizes = _mesh_sizes()
    data = tuple(a for a in DATA_AXES if sizes.get(a, 1) > 1)
    ranks = math.prod(sizes[a] for a in data)
    cfg.check(stages, count, x.shape[0] // ranks if x.shape[0] % ranks == 0 else None)
    if x.shape[0] % (ranks * cfg.microbatches):
        raise ValueError(
            f"zjax.pipeline.apply: batch of {x.shape[0]} rows does not split over data parallelism ({ranks}) x "
            f"microbatches ({cfg.microbatches}); use a multiple of {ranks * cfg.microbatches}."
        )
    stacked = by_visit(layers, cfg.repeats, stages)
    x = jax.lax.with_sharding_constraint(x, P((*data, PP)))
    s_, k_, rest = stages, cfg.microbatches // stages, x.shape[1:]
    # The data axes over which the weights are whole on every rank get the manual region below; with
    # zero3_gather="layer" the ZeRO-3 weights stay split over dp, which GSPMD then runs inside the loop.
    region = tuple(a for a in data if cfg.zero3_gather != "layer" or a != DP)
    inner = tuple(a for a in data if a not in region)
    n = math.prod(sizes[a] for a in inner)

    def run(w: Any, h: jax.Array, engine: Callable[[Any, jax.Array], jax.Array]) -> jax.Array:
        # microbatches ``[S, K, n x mb, ...]``: the rows of the ``inner`` ranks side by side, split
        # over them (h is already split over (inner, pp), so no data moves)
        io = h.reshape(n, s_, k_, -1, *rest).swapaxes(0, 1).swapaxes(1, 2).reshape(s_, k_, -1, *rest)
        io = engine(w, io)
        return io.reshape(s_, k_, n, -1, *rest).swapaxes(1, 2).swapaxes(0, 1).reshape(h.shape)

    def engine(w: Any, io: jax.Array) -> jax.Array:
        return _pipeline(stage_fn, w, io, cfg, stages, _bubble_fill, inner or None)

    if not region:
        return run(stacked, x, engine)
    leaves, treedef = jax.tree.flatten(stacked)
    dims: list[int | None] = [None] * len(leaves)
    if cfg.zero3_gather == "chunk" and DP in region:
        # each leaf's dim split over dp, in the [R, S, Lps, ...] view (the natural [L, ...] dim d is d + 2)
        dims = [None if (d := _dp_dim(w.shape, sizes)) is None else d + 2 for w in jax.tree.leaves(layers)]

        def engine(w: Any, io: jax.Array) -> jax.Array:
            return _chunked(stage_fn, w, io, cfg, stages, _bubble_fill, dims)

    specs, entered = zip(*[_enter(w, d, region, sizes) for w, d in zip(leaves, dims, strict=True)], strict=True)
    return jax.shard_map(
        lambda w, h: run(jax.tree.map(lambda a: a[0], w), h, engine),
        in_specs=(jax.tree.unflatten(treedef, specs), P(region)),
        out_specs=P(region),
        axis_names=set(region),
        check_vma=False,
    )(jax.tree.unflatten(treedef, entered), x)


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


def by_visit(layers: Any, repeats: int, stages: int) -> Any:
    """Natural order ``[L, ...]`` -> ``[R, S, Lps, ...]``: layer ``(r*S + s)*Lps + j`` is stage ``s``'s
    ``j``-th on visit ``r``."""

    def one(w: jax.Array) -> jax.Array:
        w = w.reshape(repeats, stages, w.shape[0] // (repeats * stages), *w.shape[1:])
        if repeats == 1 or stages == 1:
            return w  # each stage's contiguous block: S stays over pp, nothing moves
        return jax.lax.with_sharding_constraint(w, P(None, PP, *([P.UNCONSTRAINED] * (w.ndim - 2))))

    return jax.tree.map(one, layers)


def sequential(stage_fn: Callable, layers: Any, x: jax.Array, repeats: int, stages: int) -> jax.Array:
    """The pipeline's function without a pipeline: every (visit, stage) chunk of layers in turn, one scan."""
    chunks = jax.tree.map(lambda w: w.reshape(repeats * stages, *w.shape[2:]), by_visit(layers, repeats, stages))
    h, _ = jax.lax.scan(lambda h, w: (stage_fn(w, h), None), x, chunks)
    return h


def _enter(w: jax.Array, dp_dim: int | None, region: tuple[str, ...], sizes: dict[str, int]) -> tuple[P, jax.Array]:
    """A layer weight entering the region manual over ``region``: its ``shard_map`` spec and the array.

    Every rank of the region gets its own copy on a new leading dim (a broadcast: no data moves, except
    ZeRO-3's all-gather in "step" mode); the gradient is summed over that dim outside the region, so it is
    reduced over those axes once per step, not per layer per iteration inside the loop. (Entering as P()
    and letting shard_map psum the cotangent does the same, but that psum's reducer carries a sharding
    constraint on which XLA:CPU's bf16 all-reduce promotion aborts.) With ``dp_dim`` (``"chunk"`` mode)
    the weight stays split over ``dp`` on that dim and the copies are over the other axes only.
    """
    lead = region if dp_dim is None else tuple(a for a in region if a != DP)
    entries: list[Any] = [lead or None] + [None] * w.ndim
    if dp_dim is not None:
        entries[dp_dim + 1] = DP
    w = jnp.broadcast_to(w[None], (math.prod(sizes[a] for a in lead), *w.shape))
    return P(*entries), jax.lax.with_sharding_constraint(w, P(*[P.UNCONSTRAINED if e is None else e for e in entries]))


def _dp_dim(shape: tuple[int, ...], sizes: dict[str, int]) -> int | None:
    """The dim of a layer weight ``[L, ...]`` that ZeRO-3 splits over ``dp`` (the rule of
    :func:`zjax.stages.add_axis` on the stage layout ``P("pp")``), or ``None`` if it stays whole there."""
    spec, reason = add_axis(P(PP), shape, DP, sizes)
    if reason is not None:
        return None
    dims = [d for d, e in enumerate(spec) if e == DP]
    return dims[0] if dims and dims[0] > 0 else None
