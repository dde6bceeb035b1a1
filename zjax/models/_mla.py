"""Multi-head latent attention (MLA, DeepSeek-V2/V3): keys and values up-projected from a small shared latent.

Each token's keys and values come from one compressed latent of ``kv_lora_rank`` values (RMS-normalised), up-projected
per head into a ``qk_nope_head_dim`` key part and a ``v_head_dim`` value; a ``qk_rope_head_dim`` key part carries
the rotary position and is shared by every head (projected straight from the hidden state). Queries are projected
the same way (through a ``q_lora_rank`` latent, or directly when it is ``None``: DeepSeek-V2-Lite) into a
``qk_nope_head_dim`` part and a rotated ``qk_rope_head_dim`` part. The softmax scale is ``1 / sqrt(qk_nope +
qk_rope)``, times YaRN's ``mscale(factor, mscale_all_dim)`` squared when the RoPE scaling is YaRN with an
``mscale_all_dim`` (as DeepSeek's attention computes it).

With ``cp > 1`` in the all-gather mode the ranks exchange the latent (``kv_lora_rank + qk_rope_head_dim`` values
per token, the rotary key part already rotated) and each up-projects the whole sequence's keys and values itself:
DeepSeek-V3's 576 values per token where gathering the keys and values moves ``heads x (qk_nope + qk_rope +
v_head_dim)`` (40,960).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from .. import pipeline
from ..context import attention, context_size
from ..fp8 import linen_matmul
from ..sharding import CP
from ._layers import RMSNorm, heads_constraint, rope
from ._params import param


@dataclasses.dataclass(frozen=True)
class MLA:
    """The sizes of multi-head latent attention (``DecoderConfig(mla=MLA(...))``; the module's docstring).

    ``q_lora_rank=None`` projects the queries directly (DeepSeek-V2-Lite); ``rope_interleave`` reads the rotary
    parts' pairs as adjacent values (DeepSeek's checkpoints) rather than Llama's halves.
    """

    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MLA: {name}={value!r} must be a positive int.")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 1):
            raise ValueError(f"MLA: q_lora_rank={self.q_lora_rank!r} must be a positive int or None (no query latent).")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLA: qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs).")

    @property
    def qk_head_dim(self) -> int:
        """The width of a query or key head: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def params_per_layer(self, embed: int, heads: int) -> int:
        """The attention's parameters in one layer (projections and the latents' norms)."""
        q = embed * heads * self.qk_head_dim
        if self.q_lora_rank is not None:
            q = embed * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * self.qk_head_dim
        kv = embed * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv += self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * embed


def _interleaved_to_halves(x: jax.Array) -> jax.Array:
    """The rotary pairs ``(0, 1), (2, 3), ...`` of the last dimension moved to ``(0, d/2), (1, d/2 + 1), ...``
    (the same permutation of queries and keys leaves their products unchanged)."""
    *lead, d = x.shape
    return x.reshape(*lead, d // 2, 2).swapaxes(-1, -2).reshape(*lead, d)


def mla_attention(
    c: Any,
    m: MLA,
    h: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array | None,
    load_balanced: bool,
    module: nn.Module,
) -> jax.Array:
    """The attention's output projection ``[batch, seq, embed]`` (partial sums over tp) of the normed input ``h``
    for the :class:`~zjax.models.DecoderConfig` ``c`` (which imports this module) whose ``mla`` is ``m``;
    its parameters are ``module``'s (the decoder's block): ``wq`` or ``wq_a``/``q_latent_norm``/``wq_b``, ``wkv_a``,
    ``kv_latent_norm``, ``wkv_b``, ``wo``."""
    fp8 = c.matmul != "default"  # the projections' products in fp8 (zjax.fp8)

    def dot(x: jax.Array, name: str, shape: tuple[int, ...], axes: tuple[str, ...]) -> jax.Array:
        w = param(module, name, shape, axes)
        return linen_matmul(module, name, x, w, c.matmul) if fp8 else jnp.tensordot(x, w, axes=1)

    if m.q_lora_rank is None:
        q = dot(h, "wq", (c.embed, c.heads, m.qk_head_dim), ("embed", "heads", "head_dim"))
    else:
        q_latent = dot(h, "wq_a", (c.embed, m.q_lora_rank), ("embed", "latent"))
        q_latent = RMSNorm(m.q_lora_rank, c.norm_eps, name="q_latent_norm", parent=module)(q_latent)
        q = dot(q_latent, "wq_b", (m.q_lora_rank, c.heads, m.qk_head_dim), ("latent", "heads", "head_dim"))
    kv_a = dot(h, "wkv_a", (c.embed, m.kv_lora_rank + m.qk_rope_head_dim), ("embed", "latent"))
    latent, k_rope = jnp.split(checkpoint_name(kv_a, "qkv_proj"), [m.kv_lora_rank], axis=-1)
    latent = RMSNorm(m.kv_lora_rank, c.norm_eps, name="kv_latent_norm", parent=module)(latent)
    kv_b_shape = (m.kv_lora_rank, c.heads, m.qk_nope_head_dim + m.v_head_dim)
    wo = param(module, "wo", (c.heads, m.v_head_dim, c.embed), ("heads", "head_dim", "embed"))

    inv_freq, factor = c.rope_frequencies(), c.rope_attention_factor
    q_nope, q_rope = jnp.split(checkpoint_name(q, "qkv_proj"), [m.qk_nope_head_dim], axis=-1)
    k_rope = k_rope[:, :, None, :]  # one rotary key head, shared by every query head
    if m.rope_interleave:
        q_rope, k_rope = _interleaved_to_halves(q_rope), _interleaved_to_halves(k_rope)
    q = heads_constraint(jnp.concatenate([q_nope, rope(q_rope, positions, inv_freq, factor)], axis=-1), "heads")
    k_rope = rope(k_rope, positions, inv_freq, factor)

    copies = context_size() > 1 and c.context_mode == "all-gather" and pipeline.current() is None
    if copies:  # the ranks exchange the latent and the rotated key part, not the up-projected keys and values
        gathered = nn.with_logical_constraint(
            jnp.concatenate([latent, k_rope[:, :, 0]], axis=-1), ("batch", None, None)
        )
        # one copy per cp rank, up-projected there: each rank's key/value cotangents stay its own and reach the
        # latent's (small) cotangent before anything is reduced over cp
        rules = nn.logical_to_mesh_axes(("batch",)) if nn.get_logical_axis_rules() else None
        batch = None if rules is None else rules[0]
        gathered = jax.lax.with_sharding_constraint(
            jnp.broadcast_to(gathered, (context_size(), *gathered.shape)), P(CP, batch, None, None)
        )
        latent, k_rope = jnp.split(gathered, [m.kv_lora_rank], axis=-1)
        k_rope = k_rope[..., None, :]
    kv = checkpoint_name(dot(latent, "wkv_b", kv_b_shape, ("latent", "heads", "head_dim")), "qkv_proj")
    k_nope, v = jnp.split(kv, [m.qk_nope_head_dim], axis=-1)
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (*k_nope.shape[:-1], m.qk_rope_head_dim))], axis=-1)
    # the value heads padded to the query/key width (every attention implementation takes one head width)
    v = jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, m.qk_head_dim - m.v_head_dim)])
    if not copies:
        k, v = heads_constraint(k, "heads"), heads_constraint(v, "heads")
    attn = attention(
        q,
        k,
        v,
        segment_ids=segment_ids,
        window=c.sliding_window,
        load_balanced=load_balanced,
        context_mode=c.context_mode,  # type: ignore[arg-type]  # validated in DecoderConfig
        scale=c.softmax_scale,
        kv_copies=copies,
    )
    attn = heads_constraint(attn[..., : m.v_head_dim], "heads")
    if fp8:
        return linen_matmul(module, "wo", attn, wo, c.matmul, contract=2)
    return jnp.einsum("bshd,hde->bse", attn, wo)
