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
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from .. import comm, pipeline
from ..context import attention, check_sequence, context_size, load_balance
from ..experts._dispatch import local_experts
from ..fp8 import matmul as fp8_matmul
from ..remat import RematPolicy, gather_checkpoint, linen_scan, nested_scan, partition_checkpoint
from ..sharding import EP
from ..sharding._rules import RESIDUAL_SEQ
from ._config import DecoderConfig
from ._layers import RMSNorm, heads_constraint, rope
from ._mla import mla_attention
from ._moe import ROUTER_MASK_UNDER_PIPELINE, MoELayer, check_experts_in_pipeline
from ._params import param


def _constrain(x: jax.Array) -> jax.Array:
    """Keep the residual stream split over the batch (without it, GSPMD may copy the parameters' ZeRO-3
    sharding onto activations and compute the whole batch on every device) and along the sequence over cp,
    and over tp too with sequence parallelism (``residual_seq``, :class:`zjax.Rules`)."""
    return nn.with_logical_constraint(x, ("batch", RESIDUAL_SEQ, "embed"))


def _region(x: jax.Array) -> jax.Array:
    """The input of a tensor-parallel region: the sequence whole on every tp rank (an all-gather over tp
    under sequence parallelism), still split over cp. Its cotangent, partial sums over tp, goes straight
    back to the residual stream's layout (a reduce-scatter, Megatron's backward of the all-gather): a plain
    constraint would make GSPMD all-reduce it to the region's layout first. Both layouts are resolved here,
    under the rules the forward pass sees (none inside a pipeline stage), never inside the custom VJP."""
    if pipeline.current() is not None or not nn.get_logical_axis_rules():
        return nn.with_logical_constraint(x, ("batch", "seq", "embed"))
    there = nn.logical_to_mesh_axes(("batch", "seq", "embed"))
    back = nn.logical_to_mesh_axes(("batch", RESIDUAL_SEQ, "embed"))
    return _region_vjp(x, there, back)


def _leave(y: jax.Array) -> jax.Array:
    """The output of a tensor-parallel region (partial sums over tp) into the residual stream's layout (a
    reduce-scatter under sequence parallelism), its cotangent back in the region's layout (an all-gather over tp,
    Megatron's backward of the reduce-scatter), where the weight gradient reads it. Left to GSPMD, at stage 3 with
    cp x tp the weight gradient's ZeRO split (its embed dim over cp) reached back into that cotangent, which was
    then replicated to meet it (XLA's "involuntary full rematerialization")."""
    if pipeline.current() is not None or not nn.get_logical_axis_rules():
        return y
    there = nn.logical_to_mesh_axes(("batch", "seq", "embed"))
    back = nn.logical_to_mesh_axes(("batch", RESIDUAL_SEQ, "embed"))
    return _region_vjp(y, back, there)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _region_vjp(x: jax.Array, there: PartitionSpec, back: PartitionSpec) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, there)


def _region_fwd(x: jax.Array, there: PartitionSpec, back: PartitionSpec) -> tuple[jax.Array, None]:
    return _region_vjp(x, there, back), None


def _region_bwd(there: PartitionSpec, back: PartitionSpec, _, g: jax.Array) -> tuple[jax.Array]:
    return (jax.lax.with_sharding_constraint(g, back),)


_region_vjp.defvjp(_region_fwd, _region_bwd)


class Block(nn.Module):
    cfg: DecoderConfig
    load_balanced: bool = False  # the sequence is in zjax.context.load_balance's layout

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        router_mask: jax.Array | None = None,
    ):
        c = self.cfg
        partitioned = RematPolicy.from_str(c.remat).partition
        if partitioned:
            x = gather_checkpoint(x, axis=1)  # the saved input arrives split over tp along seq
        if positions is None:
            positions = jnp.arange(x.shape[1])[None]
        if c.mla is None:
            out = self._grouped_query(x, positions, segment_ids)
        else:
            h = _region(RMSNorm(c.embed, c.norm_eps, name="attn_norm")(x))
            out = mla_attention(c, h, positions, segment_ids, self.load_balanced, self)
        x = _constrain(x + checkpoint_name(_leave(out), "out_proj"))

        h = _region(RMSNorm(c.embed, c.norm_eps, name="mlp_norm")(x))
        stats = None
        if c.moe is None:
            w_gate = param(self, "w_gate", (c.embed, c.mlp), ("embed", "mlp"))
            w_up = param(self, "w_up", (c.embed, c.mlp), ("embed", "mlp"))
            w_down = param(self, "w_down", (c.mlp, c.embed), ("mlp", "embed"))
            mlp = ("batch", "seq", "mlp")
            dot = fp8_matmul if c.matmul == "fp8-current" else jnp.matmul
            gate = nn.with_logical_constraint(checkpoint_name(dot(h, w_gate), "mlp_in"), mlp)
            up = nn.with_logical_constraint(checkpoint_name(dot(h, w_up), "mlp_in"), mlp)
            y = _leave(dot(jax.nn.silu(gate) * up, w_down))
        else:
            y, stats = MoELayer(c.moe, c.embed, c.mlp, name="moe")(h, router_mask)
        x = x + checkpoint_name(y, "mlp_out")
        if partitioned:
            return partition_checkpoint(_constrain(x), axis=1), stats
        return _constrain(x), stats

    def _grouped_query(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
        """Grouped-query attention's output projection (partial sums over tp) of the block's input ``x``."""
        c = self.cfg
        q_shape, kv_shape = (c.embed, c.heads, c.head_dim), (c.embed, c.num_kv_heads, c.head_dim)
        wq = param(self, "wq", q_shape, ("embed", "heads", "head_dim"))
        wk = param(self, "wk", kv_shape, ("embed", "kv_heads", "head_dim"))
        wv = param(self, "wv", kv_shape, ("embed", "kv_heads", "head_dim"))
        wo = param(self, "wo", (c.heads, c.head_dim, c.embed), ("heads", "head_dim", "embed"))
        h = _region(RMSNorm(c.embed, c.norm_eps, name="attn_norm")(x))
        fp8 = c.matmul == "fp8-current"  # the projections' products in fp8 (zjax.fp8.matmul)
        q = fp8_matmul(h, wq) if fp8 else jnp.einsum("bse,ehd->bshd", h, wq)
        k = fp8_matmul(h, wk) if fp8 else jnp.einsum("bse,ehd->bshd", h, wk)
        v = fp8_matmul(h, wv) if fp8 else jnp.einsum("bse,ehd->bshd", h, wv)
        if c.qkv_bias:
            zeros = nn.initializers.zeros
            q = q + param(self, "bq", q_shape[1:], ("heads", "head_dim"), zeros).astype(q.dtype)
            k = k + param(self, "bk", kv_shape[1:], ("kv_heads", "head_dim"), zeros).astype(k.dtype)
            v = v + param(self, "bv", kv_shape[1:], ("kv_heads", "head_dim"), zeros).astype(v.dtype)
        if c.qk_norm:  # Qwen3: each head normalized over head_dim
            q = RMSNorm(c.head_dim, c.norm_eps, name="q_norm")(q)
            k = RMSNorm(c.head_dim, c.norm_eps, name="k_norm")(k)
        inv_freq = c.rope_frequencies()
        # heads split over tp, the sequence over cp: pinned (cotangents too) so that GSPMD never reshards
        # between the sequence-split residual stream and the head-split attention by all-to-alls
        factor = c.rope_attention_factor
        q = heads_constraint(rope(checkpoint_name(q, "qkv_proj"), positions, inv_freq, factor), "heads")
        k = heads_constraint(rope(checkpoint_name(k, "qkv_proj"), positions, inv_freq, factor), "kv_heads")
        v = heads_constraint(checkpoint_name(v, "qkv_proj"), "kv_heads")
        attn = attention(
            q, k, v, segment_ids=segment_ids, window=c.sliding_window, load_balanced=self.load_balanced,
            context_mode=c.context_mode,  # type: ignore[arg-type]  # validated in DecoderConfig
        )  # fmt: skip
        attn = heads_constraint(attn, "heads")
        return fp8_matmul(attn, wo, contract=2) if fp8 else jnp.einsum("bshd,hde->bse", attn, wo)


EXPERT_KEYS = ("['w_gate']", "['w_up']", "['w_down']")
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
    and z-losses; default: every token counts).
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
    ) -> jax.Array:
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
        biased = c.moe is not None and c.moe.bias_update_rate is not None
        if biased and not self.is_initializing() and (schedule is not None or policy.kind == "nested"):
            raise ValueError(
                "Decoder: MoE(bias_update_rate=...) (the routers' selection biases, model state) is not supported "
                f"under {'pipeline parallelism' if schedule is not None else f'remat={c.remat!r}'} yet: the "
                "biases would have to travel with each stage's or group's parameters. Use bias_update_rate=None "
                "(an auxiliary load-balancing loss), or pp=1 and a non-nested remat policy."
            )
        if c.dense_layers:  # DeepSeek's first dense layers, one scan of their own before the experts' layers
            x = self._dense_layers(x, positions, segment_ids, load_balanced, policy)
        if schedule is not None and not self.is_initializing():
            if router_mask is not None and c.moe is not None:
                raise ValueError(ROUTER_MASK_UNDER_PIPELINE)
            packed = segment_ids is not None or (positions is not None and not load_balanced)
            stage_fn = pipeline_stage_fn(c, packed=packed, load_balanced=load_balanced, at=(*self.path, "layers"))
            layers = self.variables["params"]["layers"]
            if schedule.zero3_gather in (None, "step"):  # gathered once, before the loop: read as the rest (qwZ)
                layers = comm.gathered_tree(layers, (*self.path, "layers"))
            if c.moe is None:
                x = pipeline.apply(stage_fn, layers, x, schedule)
            else:  # the routers' sums over every microbatch and rank, per layer; experts enter split over ep
                split_over = jax.tree_util.tree_map_with_path(
                    lambda path, _: {1: EP} if jax.tree_util.keystr(path[-1:]) in EXPERT_KEYS else None, layers
                )
                with local_experts(int(jax.sharding.get_abstract_mesh().shape.get(EP, 1))):
                    x, stats = pipeline.apply(stage_fn, layers, x, schedule, outputs=True, split_over=split_over)
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
            x, stats = stack(x, positions, segment_ids, router_mask)
        else:
            block = nn.remat(Block, policy=policy.jax_policy()) if policy.remat else Block
            per_layer = []
            for i in range(c.dense_layers, c.layers):
                x, layer_stats = block(c, load_balanced, name=f"layer_{i}")(x, positions, segment_ids, router_mask)
                per_layer.append(layer_stats)
            stats = None if c.moe is None else jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
        if stats is not None and not self.is_initializing():
            self.sow("intermediates", MOE_STATS, stats)  # per layer, stacked: read by lm_loss
        x = RMSNorm(c.embed, c.norm_eps, name="final_norm")(x)
        if context_size() > 1:
            # with cp, the head's input as a tensor-parallel region's (vocabulary over tp): left free, the head's
            # gradient took its ZeRO split from its weight and replicated the activation to get there (cp=4 x
            # tp=2 at stage 3). Without cp GSPMD's own choice is cheaper (dp=4 x tp=2, the small preset: it
            # gathers the small head rather than the hidden states, 0.5 MB less per step)
            x = _region(x)
        if return_hidden:  # the loss reads the head itself (zjax.models.lm_loss)
            return x
        if c.tie_embeddings:
            head = comm.gathered(table, at).T
        else:
            head = param(self, "head", (c.embed, c.vocab), ("embed", "vocab"))
        return nn.with_logical_constraint(x @ head.astype(x.dtype), ("batch", "seq", "vocab"))

    def _dense_layers(
        self,
        x: jax.Array,
        positions: jax.Array | None,
        segment_ids: jax.Array | None,
        load_balanced: bool,
        policy: RematPolicy,
    ) -> jax.Array:
        """The first ``dense_layers`` layers (dense MLPs): ``dense_layers`` stacked (``scan``) or ``layer_{i}``."""
        c = self.cfg
        if pipeline.current() is not None and not self.is_initializing():
            raise ValueError(
                f"Decoder: dense_layers={c.dense_layers} under pipeline parallelism is not supported yet: a "
                "pipeline's stages split one stack of identical layers. Train with pp=1, or dense_layers=0."
            )
        dense = dataclasses.replace(c, moe=None, layers=c.dense_layers, dense_layers=0)
        if c.scan:  # a nested policy's groups are the experts' layers'; these run whole-layer remat
            made = "full" if policy.kind == "nested" else policy
            stack = linen_scan(Block, c.dense_layers, made, broadcast=True)(dense, load_balanced, name="dense_layers")
            return stack(x, positions, segment_ids, None)[0]
        block = nn.remat(Block, policy=policy.jax_policy()) if policy.remat else Block
        for i in range(c.dense_layers):
            x = block(dense, load_balanced, name=f"layer_{i}")(x, positions, segment_ids)[0]
        return x


def _overlaps_reductions(c: DecoderConfig, policy: RematPolicy) -> bool:
    """Whether the layers run in :func:`zjax.comm.layer_scan`: quantized gradient reductions, whole-layer remat (the
    scan saves each layer's input, nothing else) and no experts (their router statistics are scan outputs)."""
    return comm.quantized_reductions() and policy.kind == "full" and not policy.partition and c.moe is None


PACKED_UNDER_PIPELINE = (
    "Decoder: packed sequences (positions / segment_ids) are not supported under pipeline parallelism yet; "
    "train with pp=1, or pass unpacked sequences (tokens only)."
)


def pipeline_stage_fn(
    c: DecoderConfig, *, packed: bool = False, load_balanced: bool = False, at: tuple[str, ...] = ("layers",)
) -> Callable[[Any, jax.Array], Any]:
    """The ``stage_fn`` of :func:`zjax.pipeline.apply` / :func:`zjax.pipeline.loss` for a decoder: each stage
    scans its layers, rematerialized per layer by the model's policy, each layer read through
    :func:`zjax.comm.gathered_tree` at ``at`` (the stacked layers' path: qwZ's per-layer gathers under
    ``zero3_gather="layer"``). A mixture of experts' stage returns ``(h, router sums per layer)``
    (``apply(..., outputs=True)``).

    Raises:
      ValueError: ``scan=False``, packed sequences, a partitioned remat policy (none run in a pipeline); a
        mixture of experts under a table schedule.
    """
    policy = RematPolicy.from_str(c.remat)
    schedule = pipeline.current()
    if not c.scan:
        raise ValueError("Decoder: pipeline parallelism needs scan=True (layers stacked on one axis).")
    if c.moe is not None:
        check_experts_in_pipeline(schedule)
    if packed:
        raise ValueError(PACKED_UNDER_PIPELINE)
    if policy.partition:
        raise ValueError(
            f"Decoder: remat={c.remat!r} under pipeline parallelism: ZeRO-R partitioned checkpoints "
            "split over tp with a shard_map, which cannot run inside the pipeline's per-stage vmap. Use "
            f"remat={policy.name.removesuffix('+partitioned')!r} with a pipeline."
        )
    if load_balanced and c.context_mode == "ring" and schedule is not None and schedule.tabled:
        # measured on XLA:CPU: the ring's permutes inside the schedule's per-stage lax.switch give NaN losses
        raise ValueError(
            f"Decoder: context_mode='ring' inside the table schedule {schedule.schedule!r} is not supported: "
            "its K/V permutes would run inside the schedule's per-stage branches. Use context_mode='all-gather' "
            "(the same numbers) or schedule='gpipe' (ring works there)."
        )
    one = Block(c, load_balanced)

    def layer(w: Any, h: jax.Array) -> Any:
        # the balanced layout's positions are the same for every row: each token's index before the permutation
        positions = load_balance(jnp.arange(h.shape[1], dtype=jnp.int32)[None]) if load_balanced else None
        h, stats = one.apply({"params": comm.gathered_tree(w, at)}, h, positions)
        return h if c.moe is None else (h, stats)

    return pipeline.scan_layers(layer, policy, outputs=c.moe is not None)


def output_head(cfg: DecoderConfig, params) -> jax.Array:
    """The ``[embed, vocab]`` output projection of ``params`` (the embedding table's transpose when tied)."""
    return params["embedding"].T if cfg.tie_embeddings else params["head"]
