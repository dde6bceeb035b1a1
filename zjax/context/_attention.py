"""Causal attention for any sequence layout: whole, blocked, or split over the ``cp`` mesh axis.

:func:`attention` is what a model calls (the zjax decoder does; a user's own flax model can too). Without
``cp`` it picks cuDNN's fused kernel on GPUs (bf16/fp16, unpacked rows), XLA's attention for short rows, and
the blocked attention (:mod:`zjax.context._blocked`: an online softmax, never ``[S, S]``) for long or packed
rows. With ``cp > 1`` the queries stay split over ``cp``; each rank gets the keys and values it needs by

* ``"all-gather"``: one all-gather of K/V over ``cp`` per layer (cheap with grouped-query attention: K/V
  are ``kv_heads / heads`` of the queries' size), its backward a reduce-scatter of dK/dV; or
* ``"ring"``: ``cp`` steps of ``ppermute`` of K/V chunks, each merged into the output by its log-sum-exp,
  with its own backward (dK/dV travel around the ring with their chunk) so that nothing is differentiated
  through the merge.

Either way the blocked attention runs on each rank, and with the load-balanced layout
(:func:`zjax.context.load_balance`) the causal work is the same on every rank.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .. import pipeline
from ..sharding._axes import CP
from ..sharding._mesh import in_manual_data_axes, mesh_platform
from ..sharding._rules import _as_axes
from ._blocked import Blocks, Chunk, block_backward, block_forward, merge
from ._flash import flash, flash_fits
from ._sequence import check_length, context_size, original_index

Implementation = Literal["cudnn", "pallas", "xla", "blocked"]
ContextMode = Literal["all-gather", "ring"]
CONTEXT_MODES: tuple[str, ...] = ("all-gather", "ring")
F32 = jnp.float32


DEFAULT_BLOCKS = Blocks()


def attention_implementation(
    dtype,
    *,
    packed: bool = False,
    length: int = 0,
    blocks: Blocks = DEFAULT_BLOCKS,
    head_dim: int = 128,
    window: int | None = None,
) -> Implementation:
    """The local attention for a row of ``length`` tokens. On a mesh of GPUs, for bf16/fp16: ``"cudnn"`` for
    unpacked rows, ``"pallas"`` (a flash kernel with segment ids, :mod:`zjax.context._flash`) for packed
    ones it takes. Else ``"blocked"`` for packed rows and rows longer than one key block, else ``"xla"``."""
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    gpu = mesh_platform() == "gpu" and half
    if gpu and packed and pipeline.current() is None and flash_fits(length, head_dim, window):
        return "pallas"
    # inside the pipeline's vmap over pp, or a shard_map manual over the data axes (per-rank gradients),
    # cuDNN attention's custom partitioner fails to partition (measured: an INTERNAL custom_partitioner
    # error compiling for H100); in the latter with every other axis one device, _dense runs it manual over them
    manual = pipeline.current() is not None or (in_manual_data_axes() and not _rest_is_one_device())
    if gpu and not packed and not manual:
        return "cudnn"
    return "blocked" if packed or length > blocks.k else "xla"


def _dense(
    q, k, v, segment_ids, window, implementation: Literal["cudnn", "xla"], scale: float | None = None
) -> jax.Array:
    mask = None if segment_ids is None else (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    local = None if window is None else (window, 0)
    if implementation == "xla" and q.dtype == jnp.float16 and mesh_platform() == "cpu":
        # XLA's attention asks for fp16 x fp16 -> fp32 products, which XLA:CPU's dot does not implement
        q32, k32, v32 = (x.astype(F32) for x in (q, k, v))
        out = jax.nn.dot_product_attention(
            q32, k32, v32, mask=mask, scale=scale, is_causal=True, local_window_size=local
        )
        return out.astype(q.dtype)
    attend = functools.partial(
        jax.nn.dot_product_attention,
        mask=mask,
        scale=scale,
        is_causal=True,
        local_window_size=local,
        implementation=implementation,
    )
    if implementation == "cudnn" and in_manual_data_axes() and _rest_is_one_device():
        # a region manual over the data axes whose other axes are one device each: cuDNN's custom partitioner
        # fails to partition there, and nothing is left to partition, so the call runs manual over every axis
        rest = set(jax.sharding.get_abstract_mesh().axis_names) - set(jax.sharding.get_abstract_mesh().manual_axes)
        return jax.shard_map(attend, in_specs=P(), out_specs=P(), axis_names=rest, check_vma=False)(q, k, v)
    return attend(q, k, v)


def _rest_is_one_device() -> bool:
    """Whether every mesh axis the current region is not manual over has one device."""
    mesh = jax.sharding.get_abstract_mesh()
    return all(size == 1 for name, size in mesh.shape.items() if name not in mesh.manual_axes)


# -- keys and values whole on the rank (no cp, or after the all-gather) ---------------------------------


def _delta(d_out: jax.Array, out: jax.Array) -> jax.Array:
    """``sum(d_out * out)`` over head_dim as ``[B, K, G, Sq]``."""
    return jnp.einsum("bqkgd,bqkgd->bkgq", d_out.astype(F32), out.astype(F32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _whole(q, qi, qs, chunk: Chunk, window, scale, blocks):
    return block_forward(q, qi, qs, chunk, window=window, scale=scale, blocks=blocks)[0].astype(q.dtype)


def _whole_fwd(q, qi, qs, chunk, window, scale, blocks):
    out, lse = block_forward(q, qi, qs, chunk, window=window, scale=scale, blocks=blocks)
    out = out.astype(q.dtype)
    return out, (q, qi, qs, chunk, out, lse)


def _whole_bwd(window, scale, blocks, res, d_out):
    q, qi, qs, chunk, out, lse = res
    dq, dk, dv = block_backward(
        q, qi, qs, chunk, d_out, lse, _delta(d_out, out), window=window, scale=scale, blocks=blocks
    )
    return dq.astype(q.dtype), None, None, Chunk(dk.astype(chunk.k.dtype), dv.astype(chunk.v.dtype), None, None)


_whole.defvjp(_whole_fwd, _whole_bwd)


# -- the ring: K/V chunks travel, partial outputs merge by log-sum-exp ---------------------------------


def _shift(x, cp: int, gathered: bool = False):
    """``x`` from rank ``i`` to rank ``i + 1`` of the ring. ``gathered``: by an all-gather over ``cp`` (``cp`` times
    the bytes) instead of a collective-permute, for XLA:CPU inside a table schedule's per-stage branches: its
    collective-permute waits for every device of the program, not only the pair's, and the other stages take
    other branches (jax 0.10.2: a stuck rendezvous, or one matched with another tick's permute and wrong values;
    docs/concepts/pipelines.md has the reproduction). GPUs permute between the pair only."""
    if gathered:
        return jax.lax.all_gather(x, CP)[(jax.lax.axis_index(CP) - 1) % cp]
    return jax.lax.ppermute(x, CP, [(i, (i + 1) % cp) for i in range(cp)])


def _pass_on(chunk: Chunk, cp: int, gathered: bool) -> Chunk:
    """The chunk after one ring step: K, V and segment ids from the previous rank."""
    segments = None if chunk.segments is None else _shift(chunk.segments, cp, gathered)
    return Chunk(_shift(chunk.k, cp, gathered), _shift(chunk.v, cp, gathered), chunk.order, segments)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _ring(q, qi, qs, chunk: Chunk, table, window, scale, blocks, cp, gathered):
    return _ring_fwd(q, qi, qs, chunk, table, window, scale, blocks, cp, gathered)[0]


def _ring_fwd(q, qi, qs, chunk, table, window, scale, blocks, cp, gathered):
    # a loop over the cp steps (the program does not grow with cp): step t attends to the chunk that started
    # t ranks back, then passes it on; the last step is peeled so that the chunk is passed cp - 1 times
    rank = jax.lax.axis_index(CP)
    b, sq, kh, g, d = q.shape

    def attend(t, out, lse, cur):
        visiting = cur._replace(order=table[(rank - t) % cp])
        o_t, lse_t = block_forward(q, qi, qs, visiting, window=window, scale=scale, blocks=blocks)
        return merge(out, lse, o_t, lse_t)

    def step(t, carry):
        out, lse, cur = carry
        out, lse = attend(t, out, lse, cur)
        return out, lse, _pass_on(cur, cp, gathered)

    init = (jnp.zeros((b, sq, kh, g, d), F32), jnp.full((b, kh, g, sq), -jnp.inf, F32), chunk)
    out, lse, cur = jax.lax.fori_loop(0, cp - 1, step, init)
    out, lse = attend(cp - 1, out, lse, cur)
    out = out.astype(q.dtype)
    return out, (q, qi, qs, chunk, table, out, lse)


def _ring_bwd(window, scale, blocks, cp, gathered, res, d_out):
    q, qi, qs, chunk, table, out, lse = res
    rank = jax.lax.axis_index(CP)
    delta = _delta(d_out, out)

    def grads(t, dq, dk, dv, cur):
        visiting = cur._replace(order=table[(rank - t) % cp])
        dq_t, dk_t, dv_t = block_backward(
            q, qi, qs, visiting, d_out, lse, delta, window=window, scale=scale, blocks=blocks
        )
        # the chunk's gradients travel with it; after cp shifts they are back on the chunk's own rank
        return dq + dq_t, _shift(dk + dk_t, cp, gathered), _shift(dv + dv_t, cp, gathered)

    def step(t, carry):
        dq, dk, dv, cur = carry
        dq, dk, dv = grads(t, dq, dk, dv, cur)
        return dq, dk, dv, _pass_on(cur, cp, gathered)

    zeros = lambda x: jnp.zeros(x.shape, F32)  # noqa: E731
    init = (zeros(q), zeros(chunk.k), zeros(chunk.v), chunk)
    dq, dk, dv, cur = jax.lax.fori_loop(0, cp - 1, step, init)
    dq, dk, dv = grads(cp - 1, dq, dk, dv, cur)
    grads_kv = Chunk(dk.astype(chunk.k.dtype), dv.astype(chunk.v.dtype), None, None)
    return dq.astype(q.dtype), None, None, grads_kv, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def _entry(spec: Any, dim: int) -> Any:
    return spec[dim] if spec is not None and dim < len(spec) else None


def _manual_specs(
    segments: bool, seq: tuple[str, ...] | None = (CP,), copies: bool = False
) -> tuple[tuple[P, ...], P, set[str]]:
    """The ``shard_map`` specs of ``(q5, k, v[, segment_ids])`` and of the output, over every mesh axis that
    is not manual already, read from the activation rules the model is traced under (batch over the data
    axes, the sequence over ``seq``, heads over tp): inside, every collective is one of ours. ``copies``: K/V
    are ``[cp, batch, seq, heads, head_dim]``, one whole-sequence copy per ``cp`` rank."""
    mesh = jax.sharding.get_abstract_mesh()
    free = {a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t != jax.sharding.AxisType.Manual}
    try:
        q = nn.logical_to_mesh_axes(("batch", "seq", "heads", "head_dim"))
        kv = nn.logical_to_mesh_axes(("batch", "seq", "kv_heads", "head_dim"))
    except ValueError:  # no activation rules (a bare jit under the mesh): only the sequence is split
        q = kv = P(None, seq)
    keep = lambda e: tuple(a for a in _as_axes(e) if a in free) or None  # noqa: E731
    batch, heads, kv_heads = keep(_entry(q, 0)), keep(_entry(q, 2)), keep(_entry(kv, 2))
    if heads != kv_heads:
        raise ValueError(
            f"attention with cp > 1: the query heads are split over {heads} but the key/value heads over "
            f"{kv_heads}; map the logical names 'heads' and 'kv_heads' to the same mesh axes in Rules.activations."
        )
    q5 = P(batch, seq, heads, None, None)
    kv_spec = P(seq, batch, None, heads, None) if copies else P(batch, seq, heads, None)
    specs = (q5, kv_spec, kv_spec) + ((P(batch, seq),) if segments else ())
    return specs, q5, free


def _context_parallel(
    q5, k, v, segment_ids, *, window, scale, blocks, balanced: bool, mode: ContextMode, copies: bool = False
):
    """The attention with the sequence split over ``cp``: a ``shard_map`` manual over every free mesh axis
    (the batch, sequence and heads splits read from the activation rules), so that the only collectives
    inside are the K/V gathers (or the ring's permutes) over ``cp`` and their transposes. (Manual over ``cp``
    alone, jax 0.10.2 lowers the reduce-scatter's reducer with a sharding constraint inside, which XLA:CPU's
    bf16 all-reduce promotion cannot clone: a crash.) With ``copies`` each rank reads its own copy of the whole
    K/V (:func:`attention`'s ``kv_copies``): nothing is gathered, and their cotangents stay on their ranks."""
    cp, length = context_size(), q5.shape[1]
    table = original_index(length, cp, balanced)  # [cp, length / cp]: each slot's original index
    schedule = pipeline.current()
    in_branches = mesh_platform() == "cpu" and schedule is not None and schedule.tabled  # see _shift

    def local(q5, k, v, *seg):
        qs = seg[0] if seg else None
        qi = jnp.asarray(table)[jax.lax.axis_index(CP)]
        if mode == "ring":
            chunk = Chunk(k, v, qi, qs)
            return _ring(q5, qi, qs, chunk, jnp.asarray(table), window, scale, blocks, cp, in_branches)
        gather = lambda x: jax.lax.all_gather(x, CP, axis=1, tiled=True)  # noqa: E731
        whole_k, whole_v = (k[0], v[0]) if copies else (gather(k), gather(v))
        chunk = Chunk(whole_k, whole_v, jnp.asarray(table.reshape(-1)), None if qs is None else gather(qs))
        return _whole(q5, qi, qs, chunk, window, scale, blocks)

    args = (q5, k, v) + (() if segment_ids is None else (segment_ids,))
    in_specs, out_spec, free = _manual_specs(segment_ids is not None, copies=copies)
    return jax.shard_map(
        local,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=in_specs,
        out_specs=out_spec,
        axis_names=free,
        check_vma=False,
    )(*args)


def _flash_sharded(q5, k, v, segment_ids, scale: float) -> jax.Array:
    """The Pallas flash kernel on each shard (batch over the data axes, heads over tp): a ``pallas_call``
    has no partitioning rule of its own, so under ``jit`` it runs in a ``shard_map``."""
    interpret = mesh_platform() != "gpu"

    def local(q5, k, v, seg):
        b, s, kh, g, d = q5.shape
        out = flash(q5.reshape(b, s, kh * g, d), k, v, seg, scale=scale, interpret=interpret)
        return out.reshape(q5.shape)

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:  # called outside a mesh: one device
        return local(q5, k, v, segment_ids)
    in_specs, out_spec, free = _manual_specs(True, seq=None)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_spec,
        axis_names=free,
        check_vma=False,
    )(q5, k, v, segment_ids)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    window: int | None = None,
    load_balanced: bool = False,
    context_mode: ContextMode = "all-gather",
    implementation: Implementation | None = None,
    blocks: Blocks = DEFAULT_BLOCKS,
    scale: float | None = None,
    kv_copies: bool = False,
) -> jax.Array:
    """Causal attention of ``q [batch, seq, heads, head_dim]`` over ``k, v [batch, seq, kv_heads, head_dim]``
    (grouped-query when ``kv_heads < heads``), logits and softmax in fp32, for any ``cp``.

    Call it from a model traced by a zjax step: on a mesh with ``cp > 1`` the sequence dimension is split
    over ``cp`` and this function brings each rank the keys and values it needs.

    Args:
      q, k, v: the projections in the compute dtype, the sequence in the layout the step uses.
      segment_ids: ``[batch, seq]`` ints; a token attends only within its segment (packed rows).
      window: a token sees itself and the ``window`` tokens before it (Mistral's sliding window).
      load_balanced: the sequence is in :func:`zjax.context.load_balance`'s layout (masks then use each
        slot's original index). Without it the layout is contiguous.
      context_mode: ``"all-gather"`` (K/V gathered over ``cp``) or ``"ring"`` (K/V passed around it).
      implementation: force ``"cudnn"``, ``"pallas"`` (packed rows only; interpreted off a GPU), ``"xla"``
        or ``"blocked"`` when ``cp`` is 1 (default: chosen for the devices, see
        :func:`attention_implementation`); with ``cp > 1`` the blocked attention runs.
      blocks: the blocked attention's query and key block sizes.
      scale: what the logits are multiplied by before the softmax (default ``1 / sqrt(head_dim)``).
      kv_copies: with ``cp > 1`` in the all-gather mode, ``k`` and ``v`` are ``[cp, batch, seq, kv_heads,
        head_dim]``: each ``cp`` rank's own copy of the whole sequence's keys and values (laid over ``cp`` on
        the first axis), which the caller computed from something smaller it gathered (multi-head latent
        attention's latent). Nothing is gathered here, and each rank's K/V cotangent stays its own (the
        caller's projections reduce theirs), where a replicated K/V would be all-reduced over ``cp``.

    Raises:
      ValueError: if the sequence does not split over ``cp`` (``2 x cp`` chunks when load balanced), or for
        an unknown ``context_mode``.

    Example:
      >>> out = zjax.context.attention(q, k, v, segment_ids=seg)   # inside a flax module's __call__
    """
    if context_mode not in CONTEXT_MODES:
        raise ValueError(f"attention: context_mode={context_mode!r}; valid modes are {list(CONTEXT_MODES)}.")
    b, length, heads, head_dim = q.shape
    if kv_copies and (context_size() == 1 or context_mode != "all-gather" or k.ndim != 5 or v.ndim != 5):
        raise ValueError(
            f"attention: kv_copies=True takes K/V of shape [cp, batch, seq, kv_heads, head_dim] (got {k.shape}) "
            f"with cp > 1 (cp={context_size()}) in the 'all-gather' mode (got {context_mode!r}); pass K/V as "
            "[batch, seq, kv_heads, head_dim] otherwise."
        )
    kv_heads = k.shape[-2]
    if heads % kv_heads:
        raise ValueError(f"attention: {heads} query heads are not a multiple of {kv_heads} key/value heads.")
    cp = context_size()
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    q5 = q.reshape(b, length, kv_heads, heads // kv_heads, head_dim)
    cpu_half = q.dtype == jnp.float16 and mesh_platform() == "cpu"  # XLA:CPU has no fp16 x fp16 -> fp32 dot
    if cp > 1:
        check_length(length, cp, balanced=load_balanced)
        if cpu_half:
            q5, k, v = (x.astype(F32) for x in (q5, k, v))
        out = _context_parallel(
            q5,
            k,
            v,
            segment_ids,
            window=window,
            scale=scale,
            blocks=blocks,
            balanced=load_balanced,
            mode=context_mode,
            copies=kv_copies,
        )
        return out.reshape(q.shape).astype(q.dtype)
    chosen = implementation or attention_implementation(
        q.dtype, packed=segment_ids is not None, length=length, blocks=blocks, head_dim=head_dim, window=window
    )
    if chosen == "pallas":
        if segment_ids is None or not flash_fits(length, head_dim, window):
            raise ValueError(
                f"attention: implementation='pallas' takes packed rows (segment_ids) of a length that is a "
                f"multiple of 128, head_dim <= 128 and no sliding window; got length={length}, "
                f"head_dim={head_dim}, window={window}, segment_ids={'given' if segment_ids is not None else None}. "
                f"Use 'blocked' for the others."
            )
        return _flash_sharded(q5, k, v, segment_ids, scale).reshape(q.shape)
    if chosen == "cudnn" or chosen == "xla":
        return _dense(q, k, v, segment_ids, window, chosen, scale)
    if cpu_half:
        q5, k, v = (x.astype(F32) for x in (q5, k, v))
    index = jnp.arange(length, dtype=jnp.int32)
    out = _whole(q5, index, segment_ids, Chunk(k, v, index, segment_ids), window, scale, blocks)
    return out.reshape(q.shape).astype(q.dtype)
