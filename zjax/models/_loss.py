"""The language-model loss (:func:`lm_loss`) on every path: GSPMD, a tied table per data rank, the pipeline
schedules; the routers' losses and statistics of a mixture of experts, multi-token prediction. Its cross-entropy runs
over vocabulary chunks (:mod:`._xent`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .. import comm, pipeline
from ..context import context_size, load_balance
from ..core import LossSum
from ..experts import local_experts
from ..sharding import DATA_AXES, EP, PP
from ..sharding._mesh import in_manual_data_axes
from ._biases import with_counted_loads
from ._config import DecoderConfig
from ._decoder import MOE_STATS
from ._layers import RMSNorm, dropout_keys
from ._mtp import mtp_rows
from ._stages import (
    dense_stage_fn,
    layer_state,
    maxed_leaves,
    pipeline_stage_fn,
    pipelined_layers,
    predict_ahead_fn,
)
from ._xent import cross_entropy_sum, vocab_chunks

BATCH_KEYS = ("tokens", "positions", "segment_ids", "loss_mask")


def read_batch(batch: Any) -> tuple[jax.Array, jax.Array | None, jax.Array | None, jax.Array | None]:
    """``(tokens, positions, segment_ids, loss_mask)`` of a batch: int tokens ``[B, S+1]`` or a mapping with
    ``tokens [B, S+1]`` and optional ``positions``, ``segment_ids`` and ``loss_mask`` of the same shape."""
    if isinstance(batch, Mapping):
        unknown = sorted(set(batch) - set(BATCH_KEYS))
        if "tokens" not in batch or unknown:
            raise ValueError(
                f"lm_loss: a dict batch has keys {list(BATCH_KEYS)} ('tokens' required); got {sorted(batch)}"
                + (f", unknown {unknown}" if unknown else "")
                + "."
            )
        tokens = batch["tokens"]
        extra = [batch.get(k) for k in BATCH_KEYS[1:]]
    else:
        tokens, extra = batch, [None, None, None]
    if getattr(tokens, "ndim", None) != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(
            f"lm_loss: tokens must be int [batch, seq + 1] (inputs and next-token targets); got "
            f"{getattr(tokens, 'dtype', type(tokens).__name__)} {getattr(tokens, 'shape', '')}."
        )
    for key, value in zip(BATCH_KEYS[1:], extra, strict=True):
        if value is not None and tuple(value.shape) != tuple(tokens.shape):
            raise ValueError(
                f"lm_loss: batch[{key!r}] has shape {tuple(value.shape)}; it must match tokens {tuple(tokens.shape)} "
                f"(one entry per token, inputs and targets shifted from the same row)."
            )
    return tokens, *extra  # type: ignore[return-value]


def lm_loss(
    model: Any,
    params: Any,
    batch: Any,
    model_state: Any = None,
    *,
    rng: jax.Array | None = None,
    rows: jax.Array | None = None,
    vocab_chunk: int | None = 16384,
) -> Any:
    """Next-token cross-entropy (fp32) of a :class:`~zjax.models.Decoder` on ``batch``, as a
    :class:`zjax.LossSum`: the weighted token losses' sum and the weights' sum (``.mean`` is the mean).

    A train step divides the sums of every microbatch and data-parallel rank by the counts of all of them, so
    that every path minimises the mean over the whole global batch's scored tokens, as one device would.

    ``batch`` is int tokens ``[B, S+1]`` (inputs ``[:, :-1]``, targets ``[:, 1:]``) or a dict with ``tokens``
    and optional ``positions``, ``segment_ids`` (packed sequences: attention stays within a segment, and
    a target from another segment than its input is not scored) and ``loss_mask`` (weights of the targets),
    each ``[B, S+1]`` aligned with ``tokens``. Logits are built about ``vocab_chunk`` vocabulary entries at a
    time (:func:`chunked_cross_entropy`; ``None``: whole). On a mesh with ``cp > 1`` the rows are put in the
    load-balanced causal layout (:func:`zjax.context.load_balance`) before the model splits them over ``cp``.

    For a mixture-of-experts decoder (``DecoderConfig(moe=...)``) it returns ``(loss, metrics)``: the
    cross-entropy plus the routers' weighted auxiliary losses (counted once per scored token, so that a step
    that splits the batch weighs each part's auxiliary loss by its tokens), and ``ce`` (the part's mean),
    ``load_balance`` and ``z_loss`` (:meth:`~zjax.models.MoE.aux_losses`), ``dropped`` rows and ``expert_tokens
    [layers, experts]`` (a train step puts them in its metrics' ``aux``). The routers' statistics count the input
    tokens whose ``loss_mask`` is nonzero (``loss_mask[:, :-1]``: padding is left out, as Hugging Face's
    attention mask leaves it out of Mixtral's load-balancing loss).

    ``model_state`` (the model's other collections, :class:`zjax.TrainState`'s ``model_state``) makes it return
    ``(that result, new model state)``, as a train step's ``loss_fn(params, batch, model_state)`` does; a
    mixture of experts with selection biases (``MoE(bias_update_rate=...)``) needs it: its new state adds this
    call's expert loads to the routers' ``load``, and the biases move once per train step, after the last
    microbatch, by the whole step's loads (:func:`with_moved_biases`, the ``finish_step`` of
    :func:`train_functions`' ``loss_fn``), so that every microbatch of a step routes with the same biases, as the
    whole batch on one device would.

    ``rng`` turns on the model's dropout (``DecoderConfig.dropout``; without a key, as in evaluation, none): each
    token's masks come from ``rng``, the layer and the token's index in the global batch, ``rows[b] x S + s``
    with ``rows [B]`` the global indices of the batch's rows (default ``0 .. B-1``: the whole batch). A train step
    passes both to a loss function that takes ``rng`` and ``rows`` (the step's one key, and each microbatch's or
    rank's rows), so that every path draws the masks of one device running the whole batch.

    Example:
      >>> init_fn, loss_fn = zjax.models.train_functions(model, seq_len)   # the step moves the biases
      >>> step = plan.train_step(loss_fn, accum_steps=4)
    """
    biased = getattr(model.cfg, "moe", None) is not None and model.cfg.moe.bias_update_rate is not None
    if model_state is None and getattr(model.cfg, "keeps_state", False):
        what = (
            "routers keep selection biases (MoE(bias_update_rate=...))"
            if biased
            else "fp8 projections keep amax histories (matmul=fp8-delayed)"
        )
        raise ValueError(
            f"lm_loss: the model's {what}, which are model state: initialize with "
            "zjax.Variables.linen(model.init(...)) and pass the state through: init_fn, loss_fn = "
            "zjax.models.train_functions(model, seq_len) makes both (its loss_fn's finish_step moves the biases "
            "once per step)."
        )
    out, stats = _loss_and_stats(model, params, batch, model_state, vocab_chunk, rng, rows)
    if model_state is None:
        return out
    if biased:
        model_state = with_counted_loads(model.cfg, model_state, stats["tokens"])
    return out, model_state


def _loss_and_stats(
    model: Any, params: Any, batch: Any, model_state: Any, vocab_chunk: int | None, rng: Any, rows: Any
) -> Any:
    """:func:`lm_loss`'s result and the routers' statistics (``None`` for a dense decoder)."""
    tokens, positions, segment_ids, loss_mask = read_batch(batch)
    depth = getattr(model.cfg, "mtp_layers", 0)
    # multi-token prediction: module k's inputs (the tokens k places after each input), targets and weights
    ahead = mtp_rows(tokens, segment_ids, loss_mask, depth) if depth else None
    weights = None if loss_mask is None else loss_mask[:, 1:].astype(jnp.float32)
    if segment_ids is not None:
        same = (segment_ids[:, 1:] == segment_ids[:, :-1]).astype(jnp.float32)
        weights = same if weights is None else weights * same
    cut = lambda x: None if x is None else x[:, :-1]  # noqa: E731
    inputs, positions, segment_ids, targets = tokens[:, :-1], cut(positions), cut(segment_ids), tokens[:, 1:]
    # the input tokens the routers count: those the loss mask keeps (padding is no routed traffic)
    routed = None if loss_mask is None or getattr(model.cfg, "moe", None) is None else cut(loss_mask)
    ids = None  # each input token's index in the global batch: what its dropout masks are drawn from
    if rng is not None and getattr(model.cfg, "dropout", 0.0) > 0:
        length = inputs.shape[1]
        rows = jnp.arange(inputs.shape[0], dtype=jnp.int32) if rows is None else jnp.asarray(rows, jnp.int32)
        ids = rows[:, None] * length + jnp.arange(length, dtype=jnp.int32)
    schedule = pipeline.current()
    # the table engine runs the whole model per microbatch; GPipe's schedule too where the amax histories' cotangents
    # must be maximised over the microbatches (the scan would sum them)
    tabled = schedule is not None and (schedule.tabled or getattr(model.cfg, "matmul", None) == "fp8-delayed")
    if depth and tabled and schedule is not None and model.cfg.moe is not None:
        where, fix = (
            (f"the table schedule {schedule.name!r}", "schedule='gpipe' (the modules after the last stage)")
            if schedule.tabled
            else ("GPipe with matmul='fp8-delayed' (run on the table engine)", "matmul='fp8-current'")
        )
        raise ValueError(
            f"lm_loss: mtp_layers={depth} of a mixture of experts under {where} is not supported yet: the modules "
            "run in the loss's stage with the parameters outside the layers, whole on every rank, and their experts "
            f"would be too. Use {fix}."
        )
    balanced = context_size() > 1
    if balanced:
        # every per-token array in the load-balanced layout before the model splits the rows over cp: each
        # cp rank then holds a chunk from the front and its mirror from the back (the loss is a mean, so the
        # order of its terms does not matter)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
        inputs, positions, targets = (load_balance(x) for x in (inputs, positions, targets))
        segment_ids, weights, routed, ids = (
            None if x is None else load_balance(x) for x in (segment_ids, weights, routed, ids)
        )
        if ahead is not None:
            ahead = (
                jax.vmap(load_balance)(ahead[0]),
                jax.vmap(load_balance)(ahead[1]),
                jax.vmap(load_balance)(ahead[2]),
            )
    w = jnp.ones(targets.shape, jnp.float32) if weights is None else weights
    count = jnp.sum(w)
    keys = None if ids is None else dropout_keys(rng, ids)  # per token: they travel with the rows everywhere
    if tabled:
        # each target weighted by its share of the mean: the microbatches' sums add up to the mean, whose
        # cotangent (the loss scale) then seeds the pipeline's backward passes at the magnitude GPipe's get
        share = w / count_or_1(count)
        named = (
            ("positions", positions),
            ("segment_ids", segment_ids),
            ("router_mask", routed),
            ("dropout_keys", keys),
        )
        side = {k: v for k, v in named if v is not None} or None
        per_row = None  # the MTP modules' rows [B, depth, S] (cut into microbatches with them), weighted as the targets
        if ahead is not None:
            per_row = (*(jnp.moveaxis(a, 0, 1) for a in ahead[:2]), jnp.moveaxis(ahead[2], 0, 1) / count_or_1(count))
        mean, stats = _pipelined_sum(
            model.cfg, nn.unbox(params), inputs, targets, share, vocab_chunk, balanced, side, per_row,
            layer_state(model_state or {}),
        )  # fmt: skip
        if stats is None:
            return LossSum(mean * count, count), None
        aux, stats = stats  # the routers' losses, each microbatch's own, weighted by its share of the count
        return _with_experts(model.cfg, LossSum((mean - aux) * count, count), stats, aux), stats
    variables = {**(model_state or {}), "params": params}
    dropping = {} if keys is None else {"dropout_keys": keys}
    ranks = _data_ranks()
    if model.cfg.tie_embeddings and ranks:
        if depth:
            raise ValueError(
                f"lm_loss: mtp_layers={depth} with tie_embeddings=True on a data-parallel mesh is not supported yet; "
                "untie the embeddings (DeepSeek-V3's are untied) or train on one device."
            )
        per_token = (inputs, positions, segment_ids, targets, w, routed)
        return _tied_per_rank(model, variables, per_token, ranks, balanced, vocab_chunk, dropping)
    extra = dropping if ahead is None else {"mtp_tokens": ahead[0], **dropping}
    hidden, stats = _hidden(
        model, variables, inputs, positions, segment_ids, load_balanced=balanced, router_mask=routed, **extra
    )
    head = _read_head(model.cfg, nn.unbox(params), vocab_chunks(model.cfg.vocab, vocab_chunk) > 1)
    if ahead is None:
        total = cross_entropy_sum(hidden, head, targets, w, vocab_chunk)
    else:  # each module's sum weighted by mtp_weight / mtp_layers beside the next-token sum, over its count
        hidden, predicted = hidden
        total = cross_entropy_sum(hidden, head, targets, w, vocab_chunk)
        for k in range(depth):
            mtp = cross_entropy_sum(predicted[k], head, ahead[1][k], ahead[2][k], vocab_chunk)
            total = total + model.cfg.mtp_weight / depth * mtp
    return _with_experts(model.cfg, LossSum(total, count), stats), stats


def _hidden(model: Any, variables: Any, *args: Any, **kwargs: Any) -> tuple[jax.Array, Any]:
    """The decoder's final hidden states and, for a mixture of experts, its router statistics (per layer)."""
    if getattr(model.cfg, "moe", None) is None:
        return model.apply(variables, *args, return_hidden=True, **kwargs), None
    hidden, sown = model.apply(variables, *args, return_hidden=True, mutable=["intermediates"], **kwargs)
    return hidden, sown["intermediates"][MOE_STATS][0]


def _with_experts(cfg: DecoderConfig, ce: LossSum, stats: Any, aux: jax.Array | None = None) -> Any:
    """``ce`` for a dense decoder; ``(ce + the routers' auxiliary losses per counted token, metrics)`` for a
    mixture of experts: ``ce`` (mean), ``load_balance`` and ``z_loss`` (:meth:`MoE.aux_losses`, of the whole
    part's sums), ``dropped`` rows (all layers) and ``expert_tokens`` ``[layers, experts]`` (rows each expert was
    chosen for). ``aux``: the weighted auxiliary losses as the part computed them (a table schedule's, per
    microbatch), else :meth:`MoE.loss` of ``stats``."""
    if stats is None or cfg.moe is None:
        return ce
    aux = cfg.moe.loss(stats) if aux is None else aux
    balance, z = cfg.moe.aux_losses(stats)
    metrics = {
        "ce": ce.mean,
        "load_balance": balance,
        "z_loss": z,
        "dropped": jnp.sum(stats["dropped"]),
        "expert_tokens": stats["tokens"],
    }
    return LossSum(ce.sum + ce.count * aux, ce.count), metrics


def _read_head(cfg: DecoderConfig, params: Any, looped: bool = False) -> jax.Array:
    """The output projection, read as the model reads its parameters (:func:`zjax.comm.gathered`); whole before
    the loss loops over its vocabulary chunks (``looped``: gathered once, not per chunk)."""
    if cfg.tie_embeddings:
        return comm.gathered(params["embedding"], ("embedding",), now=looped).T
    return comm.gathered(params["head"], ("head",), now=looped)


def _data_ranks() -> tuple[str, ...]:
    """The data-parallel axes (> 1) of the mesh in context, without a pipeline or a region manual over them
    (each rank's loss there is its own); ``()`` otherwise."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or dict(mesh.shape).get(PP, 1) > 1 or in_manual_data_axes():
        return ()
    return tuple(a for a in DATA_AXES if dict(mesh.shape).get(a, 1) > 1)


def _tied_per_rank(
    model: Any,
    variables: Any,
    rows: tuple,
    axes: tuple[str, ...],
    balanced: bool,
    vocab_chunk: int | None,
    dropping: dict[str, Any],
) -> tuple[Any, Any]:
    """:func:`lm_loss` for a tied embedding on a data-parallel mesh: the lookup and the head use one copy of the
    table per data-parallel rank (a broadcast on a new leading dim split over the data axes), so that the two
    gradients meet on each rank and the table's gradient crosses the data axes once. Used twice by the
    model, GSPMD reduces each use's gradient on its own (measured: two all-reduces of the table at stage 0,
    ZeRO's 2 psi becoming 2.43 for a Llama-3.2-1B shape)."""
    inputs, positions, segment_ids, targets, w, routed = rows
    mesh = dict(jax.sharding.get_abstract_mesh().shape)
    n = math.prod(mesh[a] for a in axes)
    table = comm.gathered(nn.unbox(variables["params"])["embedding"], ("embedding",))
    copies = jnp.broadcast_to(table[None], (n, *table.shape))
    copies = jax.lax.with_sharding_constraint(copies, P(axes, P.UNCONSTRAINED, P.UNCONSTRAINED))
    by_rank = lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:])  # noqa: E731 - rows split over the axes
    embeds = jax.vmap(lambda e, t: jnp.take(e, t, axis=0), spmd_axis_name=axes)(copies, by_rank(inputs))
    hidden, stats = _hidden(
        model, variables, inputs, positions, segment_ids, load_balanced=balanced, router_mask=routed,
        inputs_embeds=embeds.reshape(*inputs.shape, -1), **dropping,
    )  # fmt: skip

    # inside the vmap over ranks the batch is each rank's own: its rows are not split again
    rules = [(name, None if name == "batch" else axis) for name, axis in nn.get_logical_axis_rules()]

    def one(e: jax.Array, h: jax.Array, t: jax.Array, wt: jax.Array) -> jax.Array:
        with nn.logical_axis_rules(rules):
            return cross_entropy_sum(h, e.T, t, wt, vocab_chunk)

    total = jax.vmap(one, spmd_axis_name=axes)(copies, by_rank(hidden), by_rank(targets), by_rank(w))
    return _with_experts(model.cfg, LossSum(jnp.sum(total), jnp.sum(w)), stats), stats


def count_or_1(count: jax.Array) -> jax.Array:
    return jnp.where(count > 0, count, 1.0)


def _pipelined_sum(
    cfg: DecoderConfig, params: Any, inputs: jax.Array, targets: jax.Array, weights: jax.Array,
    vocab_chunk: int | None, balanced: bool, side: dict | None, ahead: tuple | None = None, state: Any = None,
) -> tuple[jax.Array, Any]:  # fmt: skip
    """The weighted loss sum of a decoder run whole through :func:`zjax.pipeline.loss` (the table
    schedules): the embedding (and the dense layers, :func:`dense_stage_fn`) on stage 0, the final norm, head
    and cross-entropy on the last stage; ``side`` the per-token arrays every stage reads (positions, segment
    ids); ``ahead``: the multi-token prediction modules' ``(inputs, targets, weights)`` per row ``[B, depth, S]``,
    run in the loss's stage after the final norm; ``state``: the stacked layers' model state (the routers'
    selection biases, :func:`layer_state`), read by each layer where it runs. Returns ``(sum, None)``; for a mixture of
    experts ``(sum, (its routers' weighted losses, their sums per layer))``: each microbatch's losses (each
    stage's layers' part, :meth:`MoE.layers_loss`) weighted by its share of the count, in ``sum`` too."""
    norm = RMSNorm(cfg.embed, cfg.norm_eps)
    rows: dict[str, Any] = {"tokens": inputs, "targets": targets, "weights": weights}
    if cfg.dense_layers or ahead is not None:  # the stages' per-token arrays, read by the ends too
        rows |= {"side": side, **({} if ahead is None else {"ahead": ahead})}
    dense = dense_stage_fn(cfg, balanced)
    predict = predict_ahead_fn(cfg, balanced)

    def first(edge: dict, mb: dict) -> jax.Array:
        h = jnp.take(edge["embedding"], mb["tokens"], axis=0)
        return h if dense is None else dense(edge["dense_layers"], h, mb["side"] or {})

    def last(edge: dict, h: jax.Array, mb: dict) -> jax.Array:
        normed = jnp.asarray(norm.apply({"params": edge["final_norm"]}, h))
        head = edge["embedding"].T if cfg.tie_embeddings else edge["head"]
        total = cross_entropy_sum(normed, head, mb["targets"], mb["weights"], vocab_chunk)
        if predict is None:
            return total
        predicted = predict(edge, h, mb["ahead"][0], mb["side"] or {})
        for k, normed_k in enumerate(predicted):  # each module's sum weighted by mtp_weight / mtp_layers
            ce = cross_entropy_sum(normed_k, head, mb["ahead"][1][:, k], mb["ahead"][2][:, k], vocab_chunk)
            total = total + cfg.mtp_weight / cfg.mtp_layers * ce
        return total

    # the parameters outside the layers, one tree: a tied table's two gradients meet before the reduction; each
    # read as the model reads it (gathered once per step, before the schedule: quantized with qwZ)
    edge = {
        k: comm.gathered_tree(params[k], (k,))
        for k in ("embedding", "dense_layers", "final_norm", "head", *(f"mtp_{i}" for i in range(cfg.mtp_layers)))
        if k in params
    }
    layers = params["layers"]
    schedule = pipeline.current()
    if schedule is None or schedule.zero3_gather != "layer":  # "layer": each stage gathers each layer it applies
        layers = comm.gathered_tree(layers, ("layers",))
    # each layer's index and state travel with it (its dropout masks, its routers' biases)
    layers, split_over, indexed = pipelined_layers(cfg, layers, state, side is not None and "dropout_keys" in side)
    stage_fn = pipeline_stage_fn(cfg, load_balanced=balanced, numbered=indexed)
    maxed = maxed_leaves(layers)  # the fp8 amax histories: the largest amax each product saw
    if cfg.moe is None:
        return pipeline.loss(
            stage_fn, layers, rows, first=first, last=last, params=edge, side=side, split_over=split_over, maxed=maxed
        ), None
    moe, count = cfg.moe, cfg.layers - cfg.dense_layers

    def tally(stats: dict, mb: dict) -> jax.Array:  # the microbatch's routers' losses, its share of the mean
        return jnp.sum(mb["weights"]) * moe.layers_loss(stats, count)

    # the experts enter each stage split over ep, and rows cross ep inside it
    with local_experts(int(jax.sharding.get_abstract_mesh().shape.get(EP, 1))):
        return pipeline.loss(
            stage_fn, layers, rows, first=first, last=last, params=edge, side=side, tally=tally,
            split_over=split_over, maxed=maxed,
        )  # fmt: skip
