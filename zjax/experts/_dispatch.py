"""Tokens to their experts and back: sort by expert, grouped matmuls, an all-to-all over ``ep``.

:func:`expert_mlp` is what a mixture-of-experts layer calls with its router's choices. Inside a ``shard_map``
manual over the whole mesh, each device

1. repeats each of its tokens once per chosen expert and (with a capacity factor) drops the rows beyond an
   expert's capacity;
2. with ``ep > 1``, sends each row to the ``ep`` rank that holds its expert: an all-to-all of padded per-rank
   buffers (``"padded"``: every rank sends ``ep`` buffers of its worst case; the dense collective XLA:CPU
   implements) or of exactly the rows (``"ragged"``: ``jax.lax.ragged_all_to_all``, on GPUs). Each rank's
   slice of a buffer holds :func:`rows_per_rank`: a token reaches one rank at most ``min(top_k, experts /
   ep)`` times, and with a capacity factor each expert takes at most its capacity from each device, so the
   receive buffers are ``ep x`` that bound rather than ``ep x`` all of a device's rows;
3. sorts the rows by expert and runs the SwiGLU experts as three grouped matmuls (dropless: no capacity unless
   asked), with the experts' hidden dimension split over ``tp``: tokamax's Triton kernel on GPUs
   (``pip install "zjax[moe-gpu]"``; measured: XLA:GPU in jax 0.10.2 turns ``jax.lax.ragged_dot`` into one dense
   matmul over every expert, 47 GB of temporaries for 32,768 rows into 128 experts of 4,096 x 1,536, against
   0.1 GB for tokamax's), ``jax.lax.ragged_dot`` elsewhere;
4. sends the results back the same way, weights them by the router's gates and sums each token's rows.

The expert weights enter as one copy per rank of the axes that split the tokens but not the experts
(``dp``, ``replica``, ``cp``): their gradient leaves the ``shard_map`` unreduced, and GSPMD reduces it into
the layout the ZeRO stage asks for (a reduce-scatter at stages 2-3) instead of an all-reduce inside.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import math
import warnings
from collections.abc import Iterator
from typing import Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..sharding._axes import EP, TP
from ..sharding._mesh import mesh_platform

_LOCAL_EXPERTS: contextvars.ContextVar[int] = contextvars.ContextVar("zjax_local_experts", default=1)


@contextlib.contextmanager
def local_experts(ep: int) -> Iterator[None]:
    """Code traced inside holds only its ``ep`` rank's experts, in a region already manual over ``ep`` (a
    pipeline's stages): a layer declares ``experts / ep`` of them and :func:`expert_mlp` exchanges rows over
    ``ep`` itself."""
    token = _LOCAL_EXPERTS.set(ep)
    try:
        yield
    finally:
        _LOCAL_EXPERTS.reset(token)


def experts_held(experts: int) -> int:
    """How many of a layer's ``experts`` this rank holds where it is traced (:func:`local_experts`)."""
    return experts // _LOCAL_EXPERTS.get()


Exchange = Literal["padded", "ragged"]
EXCHANGES: tuple[str, ...] = ("padded", "ragged")
Grouped = Literal["xla", "tokamax"]
GROUPED: tuple[str, ...] = ("xla", "tokamax")
F32 = jnp.float32


def capacity(tokens: int, top_k: int, experts: int, factor: float) -> int:
    """Rows one expert takes from one device's ``tokens`` (GShard's per-group capacity):
    ``ceil(factor x tokens x top_k / experts)``."""
    return max(1, math.ceil(factor * tokens * top_k / experts))


def rows_per_rank(tokens: int, top_k: int, experts: int, ep: int, capacity_factor: float | None) -> int:
    """The most rows one device's ``tokens`` can send to one ``ep`` rank, the size of each rank's slice of a
    receive buffer: a token sends at most ``min(top_k, experts / ep)`` rows to one rank (its experts are
    distinct), and with a capacity factor each of the rank's experts takes at most :func:`capacity` rows."""
    local = experts // ep
    bound = tokens * min(top_k, local)
    if capacity_factor is not None:
        bound = min(bound, local * capacity(tokens, top_k, experts, capacity_factor))
    return bound


def rank_in_group(ids: jax.Array, groups: int) -> jax.Array:
    """For each entry of ``ids`` (ints in ``[0, groups]``), how many earlier entries have the same id."""
    order = jnp.argsort(ids, stable=True)
    counts = jnp.bincount(ids, length=groups + 1)
    starts = jnp.cumsum(counts) - counts
    ranked = jnp.arange(ids.shape[0], dtype=jnp.int32) - starts[ids[order]]
    return jnp.zeros_like(ranked).at[order].set(ranked)


def default_grouped() -> Grouped:
    """``"tokamax"`` on GPUs when it is installed, else ``"xla"`` (a warning on GPUs: XLA's is dense there)."""
    if mesh_platform() != "gpu":
        return "xla"
    try:
        import tokamax  # noqa: F401 - optional: pip install "zjax[moe-gpu]"
    except ImportError:
        warnings.warn(
            'zjax.experts: tokamax is not installed (pip install "zjax[moe-gpu]"); on GPUs jax.lax.ragged_dot '
            "computes every row against every expert (experts x the FLOPs and memory of a grouped matmul).",
            RuntimeWarning,
            stacklevel=3,
        )
        return "xla"
    return "tokamax"


def absl_flags_parsed() -> None:
    """tokamax reads its options from absl flags and, unless they were parsed, parses ``sys.argv`` (a script's
    own ``--preset ...`` then fails as an unknown absl flag): mark them parsed, at their defaults."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def _grouped_dot(x: jax.Array, w: jax.Array, sizes: jax.Array, grouped: Grouped) -> jax.Array:
    if grouped == "tokamax":
        import tokamax  # optional: pip install "zjax[moe-gpu]"

        absl_flags_parsed()
        quiet = logging.getLogger("absl")  # tokamax logs each shape's autotuning-cache miss (then uses heuristics)
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            return tokamax.ragged_dot(x, w, sizes, implementation="triton")
        finally:
            quiet.setLevel(level)
    return jax.lax.ragged_dot(x, w, sizes)


def grouped_swiglu(
    rows: jax.Array, ids: jax.Array, groups: int, w_gate, w_up, w_down, grouped: Grouped = "xla"
) -> jax.Array:
    """``down(silu(rows @ gate[e]) * (rows @ up[e]))`` for each row's expert ``e = ids[row]``; rows whose id is
    ``groups`` (dropped, padding) come out zero, their gradient too. Three grouped matmuls over the rows sorted
    by expert; the rows past the last group are masked on the way in and out (a grouped-matmul kernel need not
    write them)."""
    order = jnp.argsort(ids, stable=True)
    sizes = jnp.bincount(ids, length=groups).astype(jnp.int32)  # the id ``groups`` is not counted: rows at the end
    valid = (ids[order] < groups)[:, None]
    x = jnp.where(valid, rows[order], 0)
    h = jax.nn.silu(_grouped_dot(x, w_gate, sizes, grouped)) * _grouped_dot(x, w_up, sizes, grouped)
    y = jnp.where(valid, _grouped_dot(h.astype(rows.dtype), w_down, sizes, grouped), 0)
    return jnp.zeros_like(y).at[order].set(y)


def _padded(rows, ids, experts: int, ep: int, per_rank: int, weights, grouped: Grouped) -> jax.Array:
    """Rows to the ``ep`` rank of their expert and back by dense all-to-alls of ``[ep, per_rank]`` buffers."""
    d = rows.shape[1]
    local = experts // ep
    dest = jnp.minimum(ids // local, ep)  # a dropped row (id == experts) goes nowhere
    slot = rank_in_group(dest, ep)  # < per_rank for every row sent (rows_per_rank's bound)
    send = jnp.zeros((ep, per_rank, d), rows.dtype).at[dest, slot].set(rows, mode="drop")
    send_ids = jnp.full((ep, per_rank), local, jnp.int32).at[dest, slot].set(ids % local, mode="drop")
    swap = lambda x: jax.lax.all_to_all(x, EP, 0, 0, tiled=True)  # noqa: E731 - block r to/from rank r
    got = swap(send.reshape(ep * per_rank, d))
    got_ids = swap(send_ids.reshape(ep * per_rank))
    done = grouped_swiglu(got, got_ids, local, weights[0], weights[1], weights[2], grouped)
    back = swap(done).reshape(ep, per_rank, d)
    return back.at[dest, slot].get(mode="fill", fill_value=0)


def _ragged(rows, ids, experts: int, ep: int, per_rank: int, weights, grouped: Grouped) -> jax.Array:
    """Rows to the ``ep`` rank of their expert and back by ``ragged_all_to_all``: only the rows cross."""
    n, d = rows.shape
    local = experts // ep
    order = jnp.argsort(ids, stable=True)  # by expert, hence by destination; dropped rows last
    sent, sent_ids = rows[order], ids[order]
    sizes = jnp.bincount(sent_ids // local, length=ep).astype(jnp.int32)  # rows for each rank
    starts = jnp.cumsum(sizes) - sizes
    table = jax.lax.all_gather(sizes, EP)  # [source, destination]
    me = jax.lax.axis_index(EP)
    recv = table[:, me]  # rows from each source
    into = (jnp.cumsum(table, axis=0) - table)[me]  # where my rows start in each destination's buffer
    mine = jnp.cumsum(recv) - recv  # where each source's rows start in my buffer
    home = (jnp.cumsum(table, axis=1) - table)[:, me]  # where each source sent its rows for me from
    buffer = ep * per_rank  # every rank could send this many rows here
    got = jax.lax.ragged_all_to_all(sent, jnp.zeros((buffer, d), rows.dtype), starts, sizes, into, recv, axis_name=EP)
    local_ids = jnp.where(sent_ids < experts, sent_ids % local, local).astype(jnp.int32)
    empty = jnp.full((buffer,), local, jnp.int32)
    got_ids = jax.lax.ragged_all_to_all(local_ids, empty, starts, sizes, into, recv, axis_name=EP)
    done = grouped_swiglu(got, got_ids, local, weights[0], weights[1], weights[2], grouped)
    back = jax.lax.ragged_all_to_all(done, jnp.zeros((n, d), rows.dtype), mine, recv, home, sizes, axis_name=EP)
    return jnp.zeros_like(back).at[order].set(back)


def _routed(x, ids, gates, weights, *, experts, ep, capacity_factor, exchange, grouped):
    """Tokens ``x [t, d]`` through their ``top_k`` experts (``ids``, ``gates`` ``[t, k]``); returns their gated
    sums (fp32) and the dropped row count."""
    t, d = x.shape
    k = ids.shape[-1]
    flat_ids = ids.reshape(-1).astype(jnp.int32)
    rows = jnp.repeat(x, k, axis=0)  # row i: token i // k, its (i % k)-th expert
    dropped = jnp.zeros((), F32)
    if capacity_factor is not None:
        keep = rank_in_group(flat_ids, experts) < capacity(t, k, experts, capacity_factor)
        flat_ids = jnp.where(keep, flat_ids, experts)
        dropped = jnp.sum(~keep).astype(F32)
    per_rank = rows_per_rank(t, k, experts, ep, capacity_factor)
    if ep == 1:
        y = grouped_swiglu(rows, flat_ids, experts, *weights, grouped)
    elif exchange == "ragged":
        y = _ragged(rows, flat_ids, experts, ep, per_rank, weights, grouped)
    else:
        y = _padded(rows, flat_ids, experts, ep, per_rank, weights, grouped)
    return jnp.sum(y.astype(F32).reshape(t, k, d) * gates.reshape(t, k, 1).astype(F32), axis=1), dropped


def _local(x, ids, gates, w_gate, w_up, w_down, *, experts, ep, tp, chunks, **options):
    """One device's tokens ``x [b, s, d]`` through their ``top_k`` experts, in ``chunks`` dispatched one after
    another (each rematerialized in the backward pass, so that one chunk's buffers are live at a time); returns
    the output and the dropped row count."""
    b, s, d = x.shape
    t = b * s
    if t % chunks:
        raise ValueError(
            f"expert_mlp: chunks={chunks} does not divide the {t} tokens each device routes ({b} rows of {s}); "
            f"use a divisor of {t}."
        )
    weights = tuple(w.reshape(w.shape[-3:]) for w in (w_gate, w_up, w_down))  # one copy of this rank
    flat = (x.reshape(t, d), ids.reshape(t, -1), gates.reshape(t, -1))
    route = functools.partial(_routed, experts=experts, ep=ep, **options)
    if chunks == 1:
        out, dropped = route(*flat, weights)
    else:
        step = jax.checkpoint(lambda piece: route(*piece, weights))
        outs, drops = jax.lax.map(step, tuple(a.reshape(chunks, t // chunks, *a.shape[1:]) for a in flat))
        out, dropped = outs.reshape(t, d), jnp.sum(drops)
    if tp > 1:
        out = jax.lax.psum(out, TP)  # each tp rank summed over its part of the experts' hidden dimension
    return out.reshape(b, s, d).astype(x.dtype), dropped


def _entry(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _spec_axes(names: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The mesh axes the activation rules in context give each of the logical ``names``."""
    spec = nn.logical_to_mesh_axes(names) or P(*([None] * len(names)))
    out = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]
    return out + [()] * (len(names) - len(out))


def expert_mlp(
    x: jax.Array,
    expert_ids: jax.Array,
    gates: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    capacity_factor: float | None = None,
    exchange: Exchange | None = None,
    grouped: Grouped | None = None,
    chunks: int = 1,
) -> tuple[jax.Array, jax.Array]:
    """The SwiGLU experts of a mixture-of-experts layer applied to the experts each token chose.

    Call it from a model traced by a zjax step (the zjax decoder does): the tokens are split over the data axes
    (and the sequence over ``cp``), the experts over ``ep`` and their hidden dimension over ``tp`` by the
    activation rules (logical ``batch``, ``seq``, ``expert``, ``mlp``); outside a mesh everything is local.

    Args:
      x: ``[batch, seq, embed]`` tokens in the compute dtype.
      expert_ids: ``[batch, seq, top_k]`` int, each token's experts, distinct (as a top-k gives them: the
        exchange's buffers are sized for it, :func:`rows_per_rank`).
      gates: ``[batch, seq, top_k]`` the weights of those experts' outputs (fp32).
      w_gate, w_up: ``[experts, embed, hidden]``; w_down: ``[experts, hidden, embed]``.
      capacity_factor: ``None`` (dropless) or the factor of :func:`capacity`: an expert takes at most that
        many rows of each device's tokens, the first ones in token order; the rest are dropped (their
        output zero, the token keeps its residual) and counted.
      exchange: how rows cross ``ep``: ``"ragged"`` (only the rows; the default on GPUs) or ``"padded"``
        (dense buffers of each rank's bound; the default elsewhere: XLA:CPU has no ragged all-to-all).
      grouped: the grouped matmul: ``"tokamax"`` (its Triton kernel; the default on GPUs when installed) or
        ``"xla"`` (``jax.lax.ragged_dot``; the default elsewhere).
      chunks: each device's tokens are routed in this many equal chunks, one after another, each recomputed in
        the backward pass: the exchange's buffers are ``1/chunks`` the size (dropless stays dropless) for one
        more pass of the exchange in the backward (none when the layer is rematerialized: XLA then drops the
        layer's own recompute of it). With a capacity factor, capacity is per chunk.

    Returns:
      ``(out [batch, seq, embed], dropped)``: the gated sum of each token's experts and the number of
      dropped rows over the whole batch (fp32; 0 when dropless).

    Raises:
      ValueError: experts that ``ep`` does not divide, an unknown ``exchange`` or ``grouped``, or ``chunks`` that
        do not divide a device's tokens.

    Example:
      >>> out, dropped = zjax.experts.expert_mlp(h, ids, gates, wg, wu, wd)   # inside a flax module
    """
    experts = w_gate.shape[0]
    if exchange is None:
        exchange = "ragged" if mesh_platform() == "gpu" else "padded"
    if exchange not in EXCHANGES:
        raise ValueError(f"expert_mlp: exchange={exchange!r}; use one of {list(EXCHANGES)}.")
    grouped = default_grouped() if grouped is None else grouped
    if grouped not in GROUPED:
        raise ValueError(f"expert_mlp: grouped={grouped!r}; use one of {list(GROUPED)}.")
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"expert_mlp: chunks={chunks!r} must be a positive int (1: every token at once).")
    options = {"capacity_factor": capacity_factor, "exchange": exchange, "grouped": grouped, "chunks": chunks}
    mesh = jax.sharding.get_abstract_mesh()
    free = () if mesh.empty else tuple(a for a in mesh.axis_names if a not in mesh.manual_axes)
    if _LOCAL_EXPERTS.get() > 1:  # a region already manual over ep (a pipeline's stage): this rank's experts
        ep = _LOCAL_EXPERTS.get()
        experts = w_gate.shape[0] * ep
        return _local(x, expert_ids, gates, w_gate, w_up, w_down, experts=experts, ep=ep, tp=1, **options)
    rules = bool(nn.get_logical_axis_rules()) and bool(free)
    if not rules:
        return _local(x, expert_ids, gates, w_gate, w_up, w_down, experts=experts, ep=1, tp=1, **options)
    sizes = dict(mesh.shape)
    keep = lambda axes: tuple(a for a in axes if a in free and sizes[a] > 1)  # noqa: E731
    tokens = [keep(a) for a in _spec_axes(("batch", "seq", "embed"))]
    expert_axes, _, hidden_axes = (keep(a) for a in _spec_axes(("expert", "embed", "mlp")))
    if expert_axes not in ((), (EP,)) or hidden_axes not in ((), (TP,)):
        raise ValueError(
            f"expert_mlp: the activation rules put the experts on {expert_axes} and their hidden dimension on "
            f"{hidden_axes}; map 'expert' to {EP!r} (or None) and 'mlp' to {TP!r} (or None)."
        )
    ep = sizes[EP] if expert_axes else 1
    tp = sizes[TP] if hidden_axes else 1
    if experts % ep:
        raise ValueError(
            f"expert_mlp: {experts} experts cannot be split over {EP}={ep}; use an {EP} that divides {experts}."
        )
    # one copy of the experts per rank of the axes that split tokens but not experts: their gradients leave
    # the shard_map unreduced, for GSPMD to reduce into the ZeRO layout
    copies = tuple(a for a in free if sizes[a] > 1 and any(a in t for t in tokens) and a not in (EP, TP))
    n = math.prod(sizes[a] for a in copies)
    token_spec = P(*(_entry(t) for t in tokens))
    route_spec = P(*(_entry(t) for t in tokens[:2]), None)
    ws = P(_entry(copies), _entry(expert_axes), None, _entry(hidden_axes))
    wd = P(_entry(copies), _entry(expert_axes), _entry(hidden_axes), None)

    def replicate(w: jax.Array, spec: P) -> jax.Array:
        return jax.lax.with_sharding_constraint(jnp.broadcast_to(w[None], (n, *w.shape)), spec)

    def body(*args):
        out, dropped = _local(*args, experts=experts, ep=ep, tp=tp, **options)
        token_axes = tuple(a for t in tokens[:2] for a in t)
        return out, (jax.lax.psum(dropped, token_axes) if token_axes else dropped)

    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(token_spec, route_spec, route_spec, ws, ws, wd),
        out_specs=(token_spec, P()),
        axis_names=set(free),
        check_vma=False,
    )(x, expert_ids, gates, replicate(w_gate, ws), replicate(w_up, ws), replicate(w_down, wd))
