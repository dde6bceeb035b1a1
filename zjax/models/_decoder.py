"""The Llama-family decoder in flax linen: logical axis names, scanned layers, one configuration per model.

One module covers Llama-2/3/3.1, Mistral and Qwen2 by configuration (:class:`DecoderConfig`): grouped-query
attention (``kv_heads``), the RoPE base and Llama-3.1's frequency scaling, the RMSNorm epsilon, tied or
untied embeddings, Qwen2's q/k/v biases, Mistral's sliding window, SwiGLU. Computation follows the dtype of
the parameters it is given (bf16 params -> bf16 matmuls); norms, RoPE, softmax and the loss run in fp32.
``moe=MoE(...)`` replaces every layer's feed-forward block by a mixture of experts (Mixtral, Qwen2-MoE,
Qwen3-MoE; :mod:`zjax.models._moe`).
Layers are stacked by ``nn.scan`` (one compiled layer, parameters with a leading ``layers`` axis) so that
ZeRO-3 gathers one layer at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from .. import comm, pipeline
from ..context import check_sequence, context_size, load_balance
from ..experts import local_experts
from ..remat import STACKED, RematPolicy, linen_scan, nested_scan
from ..sharding import EP
from ._block import Block, _constrain, _region
from ._config import DecoderConfig
from ._layers import RMSNorm
from ._moe import check_experts_in_pipeline, expert_splits
from ._mtp import MTP
from ._params import param

"""The expert weights of a layer (``[experts, ...]``; stacked ``[layers, experts, ...]``), as ``keystr`` names."""

MOE_STATS = "moe"
"""The ``intermediates`` entry where a mixture-of-experts decoder sows its router statistics (per layer)."""


class Decoder(nn.Module):
    """``Decoder(cfg)(tokens[batch, seq]) -> logits[batch, seq, vocab]`` (in the parameters' dtype).

    ``positions [batch, seq]`` (default ``0 .. seq-1``) and ``segment_ids [batch, seq]`` (tokens attend
    only within their segment) serve packed sequences; ``return_hidden=True`` returns the final normed
    hidden states ``[batch, seq, embed]`` instead of logits (:func:`lm_loss` computes the logits in chunks).
    ``load_balanced=True`` says the rows are in :func:`zjax.context.load_balance`'s layout (then pass the
    tokens' ``positions``): :func:`lm_loss` does this on a mesh with ``cp > 1``. ``inputs_embeds``
    ``[batch, seq, embed]`` replaces the embedding lookup (the tokens then give only the shapes).
    ``router_mask [batch, seq]`` weighs the tokens in a mixture of experts' router statistics (the load-balancing
    and z-losses; default: every token counts). ``mtp_tokens [mtp_layers, batch, seq]`` (with ``return_hidden``):
    the tokens ``k`` places after each input, for the multi-token prediction modules (``DecoderConfig.mtp_layers``),
    whose normed outputs ``[mtp_layers, batch, seq, embed]`` are then returned beside the hidden states.
    ``token_ids [batch, seq]`` (each token's index in the global batch) with a ``dropout`` key in ``rngs`` turns on
    ``DecoderConfig.dropout`` (:func:`lm_loss` passes both when given a key).
    """

    cfg: DecoderConfig

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        *,
        return_hidden: bool = False,
        load_balanced: bool = False,
        inputs_embeds: jax.Array | None = None,
        router_mask: jax.Array | None = None,
        mtp_tokens: jax.Array | None = None,
        token_ids: jax.Array | None = None,
    ) -> Any:
        c = self.cfg
        if not self.is_initializing():
            check_sequence(tokens.shape[1], balanced=load_balanced)
        ep = int(jax.sharding.get_abstract_mesh().shape.get(EP, 1))
        if ep > 1 and c.moe is None:
            raise ValueError(
                f"Decoder: the mesh has {EP}={ep} but the model has no experts (DecoderConfig.moe is None); "
                f"{EP} splits a mixture-of-experts layer's experts. Fold it into dp (dp x {ep}), or configure "
                "moe=zjax.models.MoE(...)."
            )
        table = param(
            self, "embedding", (c.vocab, c.embed), ("vocab", "embed"), nn.initializers.normal(1.0), gather=False
        )
        at = (*self.path, "embedding")
        if inputs_embeds is not None and inputs_embeds.shape != (*tokens.shape, c.embed):
            raise ValueError(
                f"Decoder: inputs_embeds has shape {inputs_embeds.shape}; it must be tokens' {tuple(tokens.shape)} "
                f"plus the embedding width {c.embed}."
            )
        if inputs_embeds is not None:
            x = _constrain(inputs_embeds)
        elif c.tie_embeddings:  # the head reads the whole table anyway: gathered once, here, for both
            x = _constrain(jnp.take(comm.gathered(table, at, now=True), tokens, axis=0))
        else:  # on each rank's hidden columns when ZeRO-3 split them (no table gather)
            x = _constrain(comm.lookup(table, tokens, at))
        policy = RematPolicy.from_str(c.remat)
        schedule = pipeline.current()
        stats = None
        if not self.is_initializing():
            check_unsupported(c, schedule)
            if c.dropout and token_ids is not None:
                _check_dropout(c, schedule, policy)
        else:
            token_ids = None
        if c.dense_layers:  # DeepSeek's first dense layers, one scan of their own before the experts' layers
            x = self._dense_layers(x, positions, segment_ids, load_balanced, policy, token_ids)
        if schedule is not None and not self.is_initializing():
            stage_fn = pipeline_stage_fn(c, load_balanced=load_balanced, at=(*self.path, "layers"))
            # each microbatch's per-token arrays travel with it through the stages
            side = {"positions": positions, "segment_ids": segment_ids, "router_mask": router_mask}
            side = {k: v for k, v in side.items() if v is not None and (k != "router_mask" or c.moe is not None)}
            layers = self.variables["params"]["layers"]
            if schedule.zero3_gather in (None, "step"):  # gathered once, before the loop: read as the rest (qwZ)
                layers = comm.gathered_tree(layers, (*self.path, "layers"))
            if c.moe is None:
                x = pipeline.apply(stage_fn, layers, x, schedule, side=side or None)
            else:  # the routers' sums over every microbatch and rank, per layer; experts enter split over ep
                split_over = expert_splits(layers)
                with local_experts(int(jax.sharding.get_abstract_mesh().shape.get(EP, 1))):
                    x, stats = pipeline.apply(
                        stage_fn, layers, x, schedule, outputs=True, split_over=split_over, side=side or None
                    )
        elif c.scan and c.bf16_edge_layers and not self.is_initializing():
            x, stats = self._with_bf16_edges(x, positions, segment_ids, router_mask, load_balanced, policy)
        elif c.scan and _overlaps_reductions(c, policy) and not self.is_initializing():
            # qgZ: each layer's quantized reduction runs under the next layer's backward (XLA pipelines no all-to-all)
            one = Block(c, load_balanced)
            layer = lambda w, h: one.apply({"params": w}, h, positions, segment_ids)[0]  # noqa: E731
            x = comm.layer_scan(layer, nn.unbox(self.variables["params"]["layers"]), x, (*self.path, "layers"))
        elif c.scan and policy.kind == "nested" and not self.is_initializing():
            one = Block(c, load_balanced)
            layer = lambda w, h: one.apply({"params": w}, h, positions, segment_ids, router_mask)  # noqa: E731
            x, stats = nested_scan(layer, self.variables["params"]["layers"], x, policy, outputs=True)
        elif c.scan:
            made = "full" if policy.kind == "nested" else policy  # init: the same stacked parameters
            stack = linen_scan(Block, c.layers - c.dense_layers, made, broadcast=True)(c, load_balanced, name="layers")
            x, stats = stack(x, positions, segment_ids, router_mask, token_ids)
        else:
            block = nn.remat(Block, policy=policy.jax_policy()) if policy.remat else Block
            per_layer = []
            for i in range(c.dense_layers, c.layers):
                edge = min(i - c.dense_layers, c.layers - 1 - i) < c.bf16_edge_layers
                layer_cfg = c.in_compute_dtype if edge else c
                x, layer_stats = block(layer_cfg, load_balanced, name=f"layer_{i}")(
                    x, positions, segment_ids, router_mask, token_ids
                )
                per_layer.append(layer_stats)
            stats = None if c.moe is None else jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
        if stats is not None and not self.is_initializing():
            self.sow("intermediates", MOE_STATS, stats)  # per layer, stacked: read by lm_loss
        last = x  # the last layer's output: multi-token prediction's first input
        x = RMSNorm(c.embed, c.norm_eps, name="final_norm")(x)
        if context_size() > 1:
            # with cp, the head's input as a tensor-parallel region's (vocabulary over tp): left free, the head's
            # gradient took its ZeRO split from its weight and replicated the activation to get there (cp=4 x
            # tp=2 at stage 3). Without cp GSPMD's own choice is cheaper (dp=4 x tp=2, the small preset: it
            # gathers the small head rather than the hidden states, 0.5 MB less per step)
            x = _region(x)
        predicted = None
        if c.mtp_layers and (mtp_tokens is not None or self.is_initializing()):
            ahead = jnp.stack([tokens] * c.mtp_layers) if mtp_tokens is None else mtp_tokens
            predicted = self._predict_ahead(last, ahead, positions, segment_ids, load_balanced, table, at, token_ids)
        if return_hidden:  # the loss reads the head itself (zjax.models.lm_loss)
            return x if mtp_tokens is None else (x, predicted)
        if c.tie_embeddings:
            head = comm.gathered(table, at).T
        else:
            head = param(self, "head", (c.embed, c.vocab), ("embed", "vocab"))
        return nn.with_logical_constraint(x @ head.astype(x.dtype), ("batch", "seq", "vocab"))

    def _predict_ahead(
        self,
        hidden: jax.Array,
        ahead: jax.Array,
        positions: jax.Array | None,
        segment_ids: jax.Array | None,
        load_balanced: bool,
        table: jax.Array,
        at: tuple[str, ...],
        token_ids: jax.Array | None,
    ) -> jax.Array:
        """The MTP modules' normed outputs ``[mtp_layers, batch, seq, embed]`` (:mod:`zjax.models._mtp`); ``ahead
        [mtp_layers, batch, seq]``: the tokens ``k`` places after each input, for module ``k``."""
        c = self.cfg
        policy = RematPolicy.from_str(c.remat)
        module = nn.remat(MTP, policy=policy.jax_policy()) if policy.remat and policy.kind != "nested" else MTP
        outs = []
        for k in range(c.mtp_layers):
            if c.tie_embeddings:
                embedded = jnp.take(comm.gathered(table, at, now=True), ahead[k], axis=0)
            else:
                embedded = comm.lookup(table, ahead[k], at)
            hidden, normed = module(c, load_balanced, name=f"mtp_{k}")(
                hidden, _constrain(embedded), positions, segment_ids, token_ids
            )
            outs.append(normed)
        return jnp.stack(outs)

    def _with_bf16_edges(
        self, x: jax.Array, positions: Any, segment_ids: Any, router_mask: Any, load_balanced: bool, policy: Any
    ) -> tuple[jax.Array, Any]:
        """The stacked layers with the first and last ``bf16_edge_layers`` multiplying in the compute dtype: three
        scans over slices of the one stack (its parameters, and so checkpoints, as without the option)."""
        c, n = self.cfg, self.cfg.bf16_edge_layers
        layers = nn.unbox(self.variables["params"]["layers"])
        count = c.layers - c.dense_layers
        stats = []
        plain = c.in_compute_dtype
        for lo, hi, layer_cfg in ((0, n, plain), (n, count - n, c), (count - n, count, plain)):
            one = Block(layer_cfg, load_balanced)
            layer = lambda w, h, one=one: one.apply({"params": w}, h, positions, segment_ids, router_mask)  # noqa: E731
            part = jax.tree.map(lambda w, lo=lo, hi=hi: w[lo:hi], layers)
            x, part_stats = pipeline.scan_layers(layer, policy, outputs=True)(part, x)
            stats.append(part_stats)
        if c.moe is None:
            return x, None
        return x, jax.tree.map(lambda *s: jnp.concatenate(s), *stats)

    def _dense_layers(
        self,
        x: jax.Array,
        positions: jax.Array | None,
        segment_ids: jax.Array | None,
        load_balanced: bool,
        policy: RematPolicy,
        token_ids: jax.Array | None,
    ) -> jax.Array:
        """The first ``dense_layers`` layers (dense MLPs): ``dense_layers`` stacked (``scan``) or ``layer_{i}``."""
        c = self.cfg
        dense = _dense_config(c)
        if c.scan:  # a nested policy's groups are the experts' layers'; these run whole-layer remat
            made = "full" if policy.kind == "nested" else policy
            # a stack a pipeline does not split: it runs whole before the first stage
            stack = linen_scan(Block, c.dense_layers, made, broadcast=True, axis=STACKED)
            return stack(dense, load_balanced, name="dense_layers")(x, positions, segment_ids, None, token_ids)[0]
        block = nn.remat(Block, policy=policy.jax_policy()) if policy.remat else Block
        for i in range(c.dense_layers):
            x = block(dense, load_balanced, name=f"layer_{i}")(x, positions, segment_ids, None, token_ids)[0]
        return x


def _check_dropout(c: DecoderConfig, schedule: Any, policy: RematPolicy) -> None:
    """Raise where dropout cannot draw its masks yet: the paths that apply the layers' parameters themselves
    (pipeline stages, nested remat, bf16 edges, qgZ's layer scan) hand the layers no per-layer keys."""
    where = None
    if schedule is not None:
        where = f"pipeline schedule {schedule.name!r}"
    elif policy.kind == "nested":
        where = f"remat={c.remat!r}"
    elif c.scan and c.bf16_edge_layers:
        where = f"bf16_edge_layers={c.bf16_edge_layers}"
    elif c.scan and _overlaps_reductions(c, policy):
        where = "qgZ's overlapped reductions (Plan(quantized_comm=...) with gradients, scanned layers)"
    if where is not None:
        raise ValueError(
            f"Decoder: dropout={c.dropout} under {where} is not supported yet: that path applies each layer's "
            "parameters itself and gives the layers no per-layer dropout keys. Use dropout=0.0 there, or a plan "
            "without it (pp=1, a non-nested remat policy, no bf16_edge_layers, quantized_comm=None or 'weights')."
        )


def check_unsupported(c: DecoderConfig, schedule: Any) -> None:
    """Raise for what the decoder cannot run yet where it is traced: under pipeline parallelism (``schedule``; both
    engines' stages, :func:`pipeline_stage_fn`, check), nested remat or quantized gradient reductions."""
    policy = RematPolicy.from_str(c.remat)
    biased = c.moe is not None and c.moe.bias_update_rate is not None
    if biased and (schedule is not None or policy.kind == "nested"):
        raise ValueError(
            "Decoder: MoE(bias_update_rate=...) (the routers' selection biases, model state) is not supported "
            f"under {'pipeline parallelism' if schedule is not None else f'remat={c.remat!r}'} yet: the "
            "biases would have to travel with each stage's or group's parameters. Use bias_update_rate=None "
            "(an auxiliary load-balancing loss), or pp=1 and a non-nested remat policy."
        )
    qgz = c.scan and _overlaps_reductions(c, policy)
    if c.bf16_edge_layers and (schedule is not None or qgz):
        raise ValueError(
            f"Decoder: bf16_edge_layers={c.bf16_edge_layers} under "
            f"{'pipeline parallelism' if schedule is not None else 'quantized gradient reductions (qgZ)'} is not "
            "supported yet (their layers run one stack alike). Use bf16_edge_layers=0 there."
        )
    functional = schedule is not None or policy.kind == "nested" or qgz
    if c.matmul == "fp8-delayed" and functional:
        where = (
            "pipeline parallelism"
            if schedule is not None
            else (f"remat={c.remat!r}" if policy.kind == "nested" else "quantized gradient reductions (qgZ)")
        )
        raise ValueError(
            f"Decoder: matmul='fp8-delayed' under {where} is not supported yet: the layers run from their "
            "parameters alone there, and the amax histories (model state) would have to travel with them. "
            "Use matmul='fp8-current' (no state), or pp=1, a non-nested remat policy and no qgZ."
        )  # fmt: skip


def _overlaps_reductions(c: DecoderConfig, policy: RematPolicy) -> bool:
    """Whether the layers run in :func:`zjax.comm.layer_scan`: quantized gradient reductions, whole-layer remat (the
    scan saves each layer's input, nothing else) and no experts (their router statistics are scan outputs)."""
    return comm.quantized_reductions() and policy.kind == "full" and not policy.partition and c.moe is None


def pipeline_stage_fn(
    c: DecoderConfig, *, load_balanced: bool = False, at: tuple[str, ...] = ("layers",)
) -> Callable[..., Any]:
    """The ``stage_fn`` of :func:`zjax.pipeline.apply` / :func:`zjax.pipeline.loss` for a decoder: each stage
    scans its layers, rematerialized per layer by the model's policy, each layer read through
    :func:`zjax.comm.gathered_tree` at ``at`` (the stacked layers' path: qwZ's per-layer gathers under
    ``zero3_gather="layer"``). A mixture of experts' stage returns ``(h, router sums per layer)``
    (``apply(..., outputs=True)``). The pipeline's side inputs (a dict of ``positions``, ``segment_ids`` and
    ``router_mask``, each optional) reach every layer with its microbatch: packed rows keep their documents.

    Raises:
      ValueError: ``scan=False``, a partitioned remat policy (none run in a pipeline); a mixture of experts
        that a schedule cannot run (:func:`zjax.models._moe.check_experts_in_pipeline`).
    """
    policy = RematPolicy.from_str(c.remat)
    schedule = pipeline.current()
    if not c.scan:
        raise ValueError("Decoder: pipeline parallelism needs scan=True (layers stacked on one axis).")
    check_unsupported(c, schedule)
    if c.moe is not None:
        check_experts_in_pipeline(c.moe, schedule)
    if policy.partition:
        raise ValueError(
            f"Decoder: remat={c.remat!r} under pipeline parallelism: ZeRO-R partitioned checkpoints "
            "split over tp with a shard_map, which cannot run inside the pipeline's per-stage vmap. Use "
            f"remat={policy.name.removesuffix('+partitioned')!r} with a pipeline."
        )
    one = Block(c, load_balanced)

    def layer(w: Any, h: jax.Array, side: dict | None = None) -> Any:
        side = side or {}
        positions = _stage_positions(side, h.shape[1], load_balanced)
        h, stats = one.apply(
            {"params": comm.gathered_tree(w, at)}, h, positions, side.get("segment_ids"), side.get("router_mask")
        )
        return h if c.moe is None else (h, stats)

    return pipeline.scan_layers(layer, policy, outputs=c.moe is not None)


def _dense_config(c: DecoderConfig) -> DecoderConfig:
    """The configuration of the first ``dense_layers`` layers: dense MLPs, a stack of their own."""
    return dataclasses.replace(c, moe=None, layers=c.dense_layers, dense_layers=0)


def _stage_positions(side: dict, length: int, load_balanced: bool) -> jax.Array | None:
    """A pipeline stage's token positions: the microbatch's own (packed rows), or under the load-balanced layout
    (cp) each token's index before the permutation; ``None`` for the plain order."""
    positions = side.get("positions")
    if positions is None and load_balanced:
        positions = load_balance(jnp.arange(length, dtype=jnp.int32)[None])
    return positions


def dense_stage_fn(c: DecoderConfig, load_balanced: bool = False) -> Callable[..., jax.Array] | None:
    """A table schedule's dense layers (``dense_layers``, DeepSeek's first layers; ``None`` without them):
    ``fn(stacked, h, side)`` runs them on stage 0 after the embedding, on each microbatch as its first action
    runs (their parameters travel with the embedding's, whole on every rank for the step)."""
    if not c.dense_layers:
        return None
    one = Block(_dense_config(c), load_balanced)

    def layer(w: Any, h: jax.Array, side: dict) -> jax.Array:
        return one.apply({"params": w}, h, _stage_positions(side, h.shape[1], load_balanced), side.get("segment_ids"))[
            0
        ]

    return pipeline.scan_layers(layer, "full" if RematPolicy.from_str(c.remat).remat else "none")


def predict_ahead_fn(c: DecoderConfig, load_balanced: bool = False) -> Callable[..., list[Any]] | None:
    """A table schedule's multi-token prediction modules (``mtp_layers``; ``None`` without them), run in the loss's
    stage: ``fn(edge, hidden, tokens [mb, depth, S], side)`` -> each module's normed output (:mod:`._mtp`), from
    the last layer's output and the embedding table, the modules' parameters ``edge["mtp_k"]``."""
    if not c.mtp_layers:
        return None
    module = MTP(c, load_balanced)

    def fn(edge: dict, hidden: jax.Array, tokens: jax.Array, side: dict) -> list[Any]:
        positions = _stage_positions(side, hidden.shape[1], load_balanced)
        outs = []
        for k in range(c.mtp_layers):
            embedded = jnp.take(edge["embedding"], tokens[:, k], axis=0)
            variables = {"params": edge[f"mtp_{k}"]}
            hidden, normed = module.apply(variables, hidden, embedded, positions, side.get("segment_ids"))
            outs.append(normed)
        return outs

    return fn


def output_head(cfg: DecoderConfig, params) -> jax.Array:
    """The ``[embed, vocab]`` output projection of ``params`` (the embedding table's transpose when tied)."""
    return params["embedding"].T if cfg.tie_embeddings else params["head"]
