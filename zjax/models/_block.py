"""One decoder layer (:class:`Block`): attention (grouped-query, or multi-head latent) and a dense or expert MLP,
with the layouts its tensor-parallel regions take on the way in and out."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from .. import pipeline
from ..context import attention
from ..fp8 import linen_matmul
from ..remat import RematPolicy, gather_checkpoint, partition_checkpoint
from ..sharding import RESIDUAL_SEQ
from ._config import DecoderConfig
from ._layers import RMSNorm, dropout, heads_constraint, rope
from ._mla import mla_attention
from ._moe import MoELayer
from ._params import param

FP8_PROJECTIONS = ("wq", "wk", "wv", "wo", "wq_a", "wq_b", "wkv_a", "wkv_b", "w_gate", "w_up", "w_down")
"""The block's parameters its fp8 products read (``DecoderConfig.matmul``; the experts' and the norms' are not)."""


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
        dropout_keys: jax.Array | None = None,
        layer: jax.Array | int = 0,
    ):
        """``dropout_keys``: each token's key (:func:`zjax.models.dropout_keys`; training), ``layer`` this layer's
        index in the model (what its masks are drawn from besides the token's key)."""
        c = self.cfg

        def dropped(y: jax.Array, site: int) -> jax.Array:  # training: a sub-layer's output before the residual add
            return y if dropout_keys is None or not c.dropout else dropout(y, dropout_keys, layer, site, c.dropout)

        partitioned = RematPolicy.from_str(c.remat).partition
        if partitioned:
            x = gather_checkpoint(x, axis=1)  # the saved input arrives split over tp along seq
        if positions is None:
            positions = jnp.arange(x.shape[1])[None]
        if c.mla is None:
            out = self._grouped_query(x, positions, segment_ids)
        else:
            h = _region(RMSNorm(c.embed, c.norm_eps, name="attn_norm")(x))
            out = mla_attention(c, c.mla, h, positions, segment_ids, self.load_balanced, self)
        x = _constrain(x + dropped(checkpoint_name(_leave(out), "out_proj"), 0))

        h = _region(RMSNorm(c.embed, c.norm_eps, name="mlp_norm")(x))
        stats = None
        if c.moe is None:
            w_gate = param(self, "w_gate", (c.embed, c.mlp), ("embed", "mlp"))
            w_up = param(self, "w_up", (c.embed, c.mlp), ("embed", "mlp"))
            w_down = param(self, "w_down", (c.mlp, c.embed), ("mlp", "embed"))
            mlp = ("batch", "seq", "mlp")
            fp8 = c.matmul != "default"  # the projections' products in fp8 (zjax.fp8)
            dot = (lambda n, x, w: linen_matmul(self, n, x, w, c.matmul)) if fp8 else (lambda n, x, w: x @ w)
            gate = nn.with_logical_constraint(checkpoint_name(dot("w_gate", h, w_gate), "mlp_in"), mlp)
            up = nn.with_logical_constraint(checkpoint_name(dot("w_up", h, w_up), "mlp_in"), mlp)
            y = _leave(dot("w_down", jax.nn.silu(gate) * up, w_down))
        else:
            y, stats = MoELayer(c.moe, c.embed, c.mlp, name="moe")(h, router_mask)
        x = x + dropped(checkpoint_name(y, "mlp_out"), 1)
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
        fp8 = c.matmul != "default"  # the projections' products in fp8 (zjax.fp8)
        q = linen_matmul(self, "wq", h, wq, c.matmul) if fp8 else jnp.einsum("bse,ehd->bshd", h, wq)
        k = linen_matmul(self, "wk", h, wk, c.matmul) if fp8 else jnp.einsum("bse,ehd->bshd", h, wk)
        v = linen_matmul(self, "wv", h, wv, c.matmul) if fp8 else jnp.einsum("bse,ehd->bshd", h, wv)
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
        if fp8:
            return linen_matmul(self, "wo", attn, wo, c.matmul, contract=2)
        return jnp.einsum("bshd,hde->bse", attn, wo)
