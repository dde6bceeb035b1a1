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

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from .. import comm, pipeline
from ..context import check_sequence, context_size
from ..experts import local_experts
from ..remat import STACKED, RematPolicy, linen_scan, nested_scan
from ..sharding import EP
from ._block import Block, _constrain, _region
from ._config import DecoderConfig
from ._layers import RMSNorm
from ._mtp import MTP
from ._params import param
from ._stages import (
    EACH_LAYER,
    apply_numbered,
    check_unsupported,
    dense_config,
    layer_state,
    numbered,
    overlaps_reductions,
    pipeline_stage_fn,
    pipelined_layers,
)

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
    ``dropout_keys`` (each token's key, :func:`zjax.models.dropout_keys` of the step's key and the token's index in
    the global batch) turns on ``DecoderConfig.dropout`` (:func:`lm_loss` passes them when given a key).
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
        dropout_keys: jax.Array | None = None,
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
        if self.is_initializing() or not c.dropout:
            dropout_keys = None
        keys = dropout_keys
        if c.dense_layers:  # DeepSeek's first dense layers, one scan of their own before the experts' layers
            x = self._dense_layers(x, positions, segment_ids, load_balanced, policy, keys)
        if schedule is not None and not self.is_initializing():
            # each microbatch's per-token arrays travel with it through the stages
            side = {"positions": positions, "segment_ids": segment_ids, "router_mask": router_mask}
            side = {k: v for k, v in side.items() if v is not None and (k != "router_mask" or c.moe is not None)}
            side |= {} if keys is None else {"dropout_keys": keys}
            layers = self.variables["params"]["layers"]
            if schedule.zero3_gather in (None, "step"):  # gathered once, before the loop: read as the rest (qwZ)
                layers = comm.gathered_tree(layers, (*self.path, "layers"))
            # each layer's index and state travel with it to its stage (its masks, its biases)
            layers, split_over, carried = pipelined_layers(c, layers, layer_state(self.variables), keys is not None)
            at = (*self.path, "layers")
            stage_fn = pipeline_stage_fn(c, load_balanced=load_balanced, at=at, numbered=carried)
            if c.moe is None:
                x = pipeline.apply(stage_fn, layers, x, schedule, side=side or None)
            else:  # the routers' sums over every microbatch and rank, per layer; experts enter split over ep
                with local_experts(int(jax.sharding.get_abstract_mesh().shape.get(EP, 1))):
                    x, stats = pipeline.apply(
                        stage_fn, layers, x, schedule, outputs=True, split_over=split_over, side=side or None
                    )
        elif c.scan and c.bf16_edge_layers and not self.is_initializing():
            x, stats = self._with_bf16_edges(x, positions, segment_ids, router_mask, load_balanced, policy, keys)
        elif c.scan and overlaps_reductions(c, policy) and not self.is_initializing():
            # qgZ: each layer's quantized reduction runs under the next layer's backward (XLA pipelines no all-to-all)
            one = Block(c, load_balanced)

            def indexed(w: Any, h: jax.Array, i: jax.Array) -> jax.Array:
                return one.apply({"params": w}, h, positions, segment_ids, None, keys, c.dense_layers + i)[0]

            layers = nn.unbox(self.variables["params"]["layers"])
            x = comm.layer_scan(indexed, layers, x, (*self.path, "layers"), numbered=True)
        elif c.scan and policy.kind == "nested" and not self.is_initializing():
            one = Block(c, load_balanced)
            layers = numbered(self.variables["params"]["layers"], c.dense_layers, layer_state(self.variables))
            run = lambda w, h: apply_numbered(one, w, h, positions, segment_ids, router_mask, keys)  # noqa: E731
            x, stats = nested_scan(run, layers, x, policy, outputs=True)
        elif c.scan:
            made = "full" if policy.kind == "nested" else policy  # init: the same stacked parameters
            count = c.layers - c.dense_layers
            stack = linen_scan(Block, count, made, in_axes=EACH_LAYER)(c, load_balanced, name="layers")
            x, stats = stack(x, positions, segment_ids, router_mask, keys, jnp.arange(c.dense_layers, c.layers))
        else:
            block = nn.remat(Block, policy=policy.jax_policy()) if policy.remat else Block
            per_layer = []
            for i in range(c.dense_layers, c.layers):
                edge = min(i - c.dense_layers, c.layers - 1 - i) < c.bf16_edge_layers
                layer_cfg = c.in_compute_dtype if edge else c
                x, layer_stats = block(layer_cfg, load_balanced, name=f"layer_{i}")(
                    x, positions, segment_ids, router_mask, keys, i
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
            predicted = self._predict_ahead(last, ahead, positions, segment_ids, load_balanced, table, at, keys)
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
        keys: jax.Array | None,
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
                hidden, _constrain(embedded), positions, segment_ids, keys, c.layers + k
            )
            outs.append(normed)
        return jnp.stack(outs)

    def _with_bf16_edges(
        self, x: jax.Array, positions: Any, segment_ids: Any, router_mask: Any, load_balanced: bool, policy: Any,
        keys: jax.Array | None,
    ) -> tuple[jax.Array, Any]:  # fmt: skip
        """The stacked layers with the first and last ``bf16_edge_layers`` multiplying in the compute dtype: three
        scans over slices of the one stack (its parameters, and so checkpoints, as without the option)."""
        c, n = self.cfg, self.cfg.bf16_edge_layers
        layers = numbered(nn.unbox(self.variables["params"]["layers"]), c.dense_layers, layer_state(self.variables))
        count = c.layers - c.dense_layers
        stats = []
        plain = c.in_compute_dtype
        for lo, hi, layer_cfg in ((0, n, plain), (n, count - n, c), (count - n, count, plain)):
            one = Block(layer_cfg, load_balanced)
            layer = lambda w, h, one=one: apply_numbered(one, w, h, positions, segment_ids, router_mask, keys)  # noqa: E731
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
        keys: jax.Array | None,
    ) -> jax.Array:
        """The first ``dense_layers`` layers (dense MLPs): ``dense_layers`` stacked (``scan``) or ``layer_{i}``."""
        c = self.cfg
        dense = dense_config(c)
        if c.scan:  # a nested policy's groups are the experts' layers'; these run whole-layer remat
            made = "full" if policy.kind == "nested" else policy
            # a stack a pipeline does not split: it runs whole before the first stage
            stack = linen_scan(Block, c.dense_layers, made, axis=STACKED, in_axes=EACH_LAYER)
            ids = jnp.arange(c.dense_layers)
            return stack(dense, load_balanced, name="dense_layers")(x, positions, segment_ids, None, keys, ids)[0]
        block = nn.remat(Block, policy=policy.jax_policy()) if policy.remat else Block
        for i in range(c.dense_layers):
            x = block(dense, load_balanced, name=f"layer_{i}")(x, positions, segment_ids, None, keys, i)[0]
        return x


def output_head(cfg: DecoderConfig, params) -> jax.Array:
    """The ``[embed, vocab]`` output projection of ``params`` (the embedding table's transpose when tied)."""
    return params["embedding"].T if cfg.tie_embeddings else params["head"]
