"""A decoder-only transformer in flax linen with logical axis names and scanned layers.

Computation follows the dtype of the parameters it is given (bf16 params -> bf16 matmuls); norms,
softmax and the loss run in fp32. Layers are stacked by ``nn.scan`` (one compiled layer, parameters
with a leading ``layers`` axis) so that ZeRO-3 gathers one layer at a time.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name

from .. import pipeline
from ..remat import RematPolicy, gather_checkpoint, linen_scan, partition_checkpoint
from ._attention import causal_attention


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Sizes of the decoder. ``scan`` stacks layers with ``nn.scan``; ``remat`` names the checkpointing
    policy of each layer (:data:`zjax.remat.POLICIES`)."""

    vocab: int = 256
    embed: int = 128
    layers: int = 4
    heads: int = 4
    head_dim: int = 32
    mlp: int = 512
    max_len: int = 128
    scan: bool = True
    remat: str = "full"

    @property
    def num_params(self) -> int:
        per_layer = 4 * self.embed * self.heads * self.head_dim + 3 * self.embed * self.mlp + 2 * self.embed
        return 2 * self.vocab * self.embed + self.layers * per_layer + self.embed


PRESETS: dict[str, DecoderConfig] = {
    "tiny": DecoderConfig(embed=64, layers=2, heads=2, head_dim=32, mlp=256, max_len=64),
    "small": DecoderConfig(),
    "medium": DecoderConfig(embed=512, layers=8, heads=8, head_dim=64, mlp=2048, max_len=256),
    "llama2-7b": DecoderConfig(vocab=32000, embed=4096, layers=32, heads=32, head_dim=128, mlp=11008, max_len=4096),
}


def _param(module: nn.Module, name: str, shape: tuple[int, ...], names: tuple[str, ...], init=None):
    init = nn.initializers.lecun_normal() if init is None else init
    return module.param(name, nn.with_logical_partitioning(init, names), shape, jnp.float32)


class RMSNorm(nn.Module):
    dim: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = _param(self, "scale", (self.dim,), ("norm",), nn.initializers.ones)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
        return (y * scale.astype(jnp.float32)).astype(x.dtype)


def _constrain(x: jax.Array) -> jax.Array:
    """Keep the residual stream split over the batch: without it, GSPMD may copy the parameters'
    ZeRO-3 sharding onto activations and compute the whole batch on every device."""
    return nn.with_logical_constraint(x, ("batch", "seq", "embed"))


def _rope(x: jax.Array) -> jax.Array:
    """Rotary position embedding over the last dim of ``x`` [batch, seq, heads, head_dim]."""
    seq, dim = x.shape[1], x.shape[-1]
    freq = 1.0 / (10000.0 ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    angle = jnp.arange(seq, dtype=jnp.float32)[:, None] * freq[None, :]
    sin, cos = jnp.sin(angle)[None, :, None, :], jnp.cos(angle)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Block(nn.Module):
    cfg: DecoderConfig

    @nn.compact
    def __call__(self, x: jax.Array, _=None):
        c = self.cfg
        partitioned = RematPolicy.from_str(c.remat).partition
        if partitioned:
            x = gather_checkpoint(x, axis=1)  # the saved input arrives split over tp along seq
        qkv_shape, qkv_names = (c.embed, c.heads, c.head_dim), ("embed", "heads", "head_dim")
        wq = _param(self, "wq", qkv_shape, qkv_names)
        wk = _param(self, "wk", qkv_shape, qkv_names)
        wv = _param(self, "wv", qkv_shape, qkv_names)
        wo = _param(self, "wo", (c.heads, c.head_dim, c.embed), ("heads", "head_dim", "embed"))
        h = RMSNorm(c.embed, name="attn_norm")(x)
        q = _rope(checkpoint_name(jnp.einsum("bse,ehd->bshd", h, wq), "qkv_proj"))
        k = _rope(checkpoint_name(jnp.einsum("bse,ehd->bshd", h, wk), "qkv_proj"))
        v = checkpoint_name(jnp.einsum("bse,ehd->bshd", h, wv), "qkv_proj")
        attn = causal_attention(q, k, v)  # cuDNN flash attention on GPUs, XLA elsewhere
        x = x + checkpoint_name(jnp.einsum("bshd,hde->bse", attn, wo), "out_proj")

        w_gate = _param(self, "w_gate", (c.embed, c.mlp), ("embed", "mlp"))
        w_up = _param(self, "w_up", (c.embed, c.mlp), ("embed", "mlp"))
        w_down = _param(self, "w_down", (c.mlp, c.embed), ("mlp", "embed"))
        h = RMSNorm(c.embed, name="mlp_norm")(x)
        gate = checkpoint_name(h @ w_gate, "mlp_in")
        up = checkpoint_name(h @ w_up, "mlp_in")
        x = x + checkpoint_name((jax.nn.silu(gate) * up) @ w_down, "mlp_out")
        if partitioned:
            return partition_checkpoint(_constrain(x), axis=1), None
        return _constrain(x), None


class Decoder(nn.Module):
    """``Decoder(cfg)(tokens[batch, seq]) -> logits[batch, seq, vocab]`` (in the parameters' dtype)."""

    cfg: DecoderConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.cfg
        embedding = _param(self, "embedding", (c.vocab, c.embed), ("vocab", "embed"), nn.initializers.normal(1.0))
        x = _constrain(jnp.take(embedding, tokens, axis=0))
        policy = RematPolicy.from_str(c.remat)
        schedule = pipeline.current()
        if schedule is not None and not self.is_initializing():
            if not c.scan:
                raise ValueError("Decoder: pipeline parallelism needs scan=True (layers stacked on one axis).")
            # the pipeline rematerializes whole iterations: the layers inside run without their own remat
            one = Block(dataclasses.replace(c, remat="none"))

            def stage_fn(stage_layers, h):
                for j in range(jax.tree.leaves(stage_layers)[0].shape[0]):
                    h, _ = one.apply({"params": jax.tree.map(lambda w: w[j], stage_layers)}, h)  # noqa: B023
                return h

            x = pipeline.apply(stage_fn, self.variables["params"]["layers"], x, schedule)
        elif c.scan:
            x, _ = linen_scan(Block, c.layers, policy)(c, name="layers")(x, None)
        else:
            block = nn.remat(Block, policy=policy.jax_policy()) if policy.remat else Block
            for i in range(c.layers):
                x, _ = block(c, name=f"layer_{i}")(x, None)
        x = RMSNorm(c.embed, name="final_norm")(x)
        head = _param(self, "head", (c.embed, c.vocab), ("embed", "vocab"))
        return nn.with_logical_constraint(x @ head, ("batch", "seq", "vocab"))


def lm_loss(model: Decoder, params, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of ``tokens[batch, seq + 1]`` (fp32)."""
    logits: jax.Array = model.apply({"params": params}, tokens[:, :-1])  # type: ignore[assignment]
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:]).mean()
