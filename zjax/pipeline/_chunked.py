"""``zero3_gather="chunk"``: the scan in phases, each repeat's chunk gathered over ``dp`` once per pass."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..comm._quantize import all_gather
from ..sharding._axes import DP, PP
from ..sharding._mesh import mesh_platform
from ._config import Pipeline
from ._context import quantize_wire
from ._scan import _Loop, _where_stage


def _per_stage(collective: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """Run a ``dp`` collective on a chunk ``[S, ...]`` stage by stage, in a region manual over ``pp`` too: in
    one manual over the data axes only, GSPMD first replicates the operand over ``pp`` (4x the bytes at
    pp=4)."""
    return jax.shard_map(collective, in_specs=P(PP), out_specs=P(PP), axis_names={PP}, check_vma=False)(x)


def _chunked(
    stage_fn: Callable, stacked: Any, state_io: jax.Array, cfg: Pipeline, stages: int, fill: float,
    dims: list[int | None], side: Any = None,
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
    wire = quantize_wire()  # Plan(quantized_comm="weights"): the chunks cross dp as integer blocks
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
            return _per_stage(lambda x: all_gather(x, DP, d - 1, wire), w)  # noqa: B023

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

    def phase(prev: Any, cur: Any, carry: tuple, p: Any, length: int, side: Any) -> tuple:
        """Iterations ``p*M .. p*M + length - 1``: stages past phase p's start apply ``cur``, others ``prev``."""

        def weights(t: jax.Array) -> Any:
            if prev is None:
                return cur
            newer = loop.repeat(t) == p
            return jax.tree.map(lambda a, b: _where_stage(newer, a, b), cur, prev)

        return loop.run(weights, carry, p * m_ + jnp.arange(length), side)

    last = m_ + stages - 1  # the last phase also drains the pipeline

    def vjp(prev: Any, cur: Any, start: tuple, p: Any, length: int, dcarry: tuple, side: Any) -> tuple:
        _, pull = jax.vjp(lambda a, b, c: phase(a, b, c, p, length, side), prev, cur, start)
        return pull(dcarry)

    def stack(*trees: Any) -> Any:  # per-chunk gradients (leading dim 1 or n) -> [R, ...]
        return jax.tree.map(lambda *xs: jnp.concatenate(xs), *trees)

    # Phases 1 .. R-2 run as one lax.scan (their work is alike): the program does not grow with R, and
    # each phase's gathered chunks and gradient accumulators are made inside the loop body, so only one
    # phase's are ever live (as separate phases XLA made every phase's zero accumulators at once).
    middle = lambda: jnp.arange(1, r_ - 1)  # noqa: E731 - made inside each rule (no closed-over tracers)

    @jax.custom_vjp
    def run(stacked: Any, io: jax.Array, side: Any) -> jax.Array:
        return fwd(stacked, io, side)[0]

    def fwd(stacked: Any, io: jax.Array, side: Any) -> tuple:
        first = loop.init(io)
        cur = gather(stacked, 0, first)
        if r_ == 1:
            return phase(None, cur, first, 0, last, side)[1], (stacked, first, None, None, side)

        def body(state: tuple, p: jax.Array) -> tuple:
            carry, cur = state
            prev, cur = cur, gather(stacked, p, carry)
            return (phase(prev, cur, carry, p, m_, side), cur), carry

        starts: Any
        (start, cur), starts = jax.lax.scan(body, (phase(None, cur, first, 0, m_, side), cur), middle())
        out = phase(cur, gather(stacked, r_ - 1, start), start, r_ - 1, last, side)
        return out[1], (stacked, first, starts, start, side)

    def bwd(res: tuple, g: jax.Array) -> tuple:
        stacked, first, starts, start, side = res
        zeros = jax.tree.map(jnp.zeros_like, first)
        dcarry = (zeros[0], g, zeros[2])
        cur = gather(stacked, r_ - 1, dcarry)
        if r_ == 1:
            _, dcur, dcarry = vjp(None, cur, first, 0, last, dcarry, side)
            return stack(jax.tree.map(lambda x: x[None], scatter(dcur))), dcarry[1], None
        prev = gather(stacked, r_ - 2, dcarry)
        dprev, dcur, dcarry = vjp(prev, cur, start, r_ - 1, last, dcarry, side)
        tail = scatter(dcur)  # chunk R-1 is complete: only the last phase used it

        def body(state: tuple, xs: tuple) -> tuple:
            cur, dcur, dcarry = state
            p, start = xs
            prev = gather(stacked, p - 1, dcarry)
            dprev, dc, dcarry = vjp(prev, cur, start, p, m_, dcarry, side)
            # chunk p is complete: phases p + 1 and p were its only users
            return (prev, dprev, dcarry), scatter(jax.tree.map(jnp.add, dcur, dc))

        mids: Any
        (cur, dcur, dcarry), mids = jax.lax.scan(body, (prev, dprev, dcarry), (middle(), starts), reverse=True)
        _, dc, dcarry = vjp(None, cur, first, 0, m_, dcarry, side)
        head = scatter(jax.tree.map(jnp.add, dcur, dc))
        lead = lambda tree: jax.tree.map(lambda x: x[None], tree)  # noqa: E731
        return stack(lead(head), mids, lead(tail)), dcarry[1], None

    run.defvjp(fwd, bwd)
    return loop.finish(run(stacked, state_io, side))
