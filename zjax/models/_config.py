"""The decoder's configuration: sizes, the Llama-family variant (attention, RoPE, norms, biases), experts.

One :class:`DecoderConfig` describes Llama-2/3/3.1, Mistral, Qwen2/3 and their mixtures of experts; it also counts
the parameters (total, experts, active per token) without building the model.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..context import CONTEXT_MODES
from ..fp8 import MATMULS
from ._mla import MLA
from ._moe import MoE


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1's RoPE frequency scaling (``rope_scaling`` with ``rope_type: llama3`` in a HF config):
    wavelengths longer than ``original_max_len / low_freq_factor`` are divided by ``factor``, those shorter
    than ``original_max_len / high_freq_factor`` kept, the band between interpolated smoothly."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192

    attention_factor = 1.0  # cos and sin as they are

    def frequencies(self, inv: np.ndarray, theta: float) -> np.ndarray:
        """The scaled inverse frequencies of the unscaled ``inv`` (float64)."""
        wavelen = 2 * math.pi / inv
        low, high = self.original_max_len / self.low_freq_factor, self.original_max_len / self.high_freq_factor
        smooth = (self.original_max_len / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        mid = (1 - smooth) * inv / self.factor + smooth * inv
        return np.where(wavelen > low, inv / self.factor, np.where(wavelen < high, inv, mid))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN's RoPE scaling (Peng et al. 2023; ``rope_scaling`` with ``rope_type: yarn``: DeepSeek-V3, Qwen3's long
    context): the frequencies whose wavelengths fit ``original_max_len`` more than ``beta_fast`` times are kept,
    those fitting fewer than ``beta_slow`` times divided by ``factor``, a linear ramp between (over the dimension
    indices, rounded out when ``truncate``); cos and sin are multiplied by :attr:`attention_factor` (given, or
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are set, else ``0.1 ln(factor) + 1``),
    as Hugging Face's ``_compute_yarn_parameters`` computes them."""

    factor: float = 4.0
    original_max_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    given_attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if not self.factor > 0 or self.original_max_len < 1 or not self.beta_fast > self.beta_slow > 0:
            raise ValueError(
                f"YarnScaling: factor={self.factor}, original_max_len={self.original_max_len}, beta_fast="
                f"{self.beta_fast}, beta_slow={self.beta_slow}: need factor > 0, original_max_len >= 1 and "
                "beta_fast > beta_slow > 0."
            )

    @property
    def attention_factor(self) -> float:
        if self.given_attention_factor is not None:
            return self.given_attention_factor
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
        return _yarn_mscale(self.factor)

    def frequencies(self, inv: np.ndarray, theta: float) -> np.ndarray:
        """The scaled inverse frequencies of the unscaled ``inv`` ``[dim / 2]`` (float64)."""
        dim = 2 * inv.shape[0]

        def at(rotations: float) -> float:  # the dimension index whose wavelength fits that many rotations
            return dim * math.log(self.original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = at(self.beta_fast), at(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = np.clip((np.arange(dim // 2) - low) / ((high - low) or 0.001), 0, 1)
        return inv / self.factor * ramp + inv * (1 - ramp)


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Sizes and variant of the decoder.

    ``kv_heads`` (default: ``heads``) < ``heads`` is grouped-query attention; ``rope_theta`` and
    ``rope_scaling`` set the rotary frequencies; ``tie_embeddings`` reads the output head from the
    embedding table; ``qkv_bias`` adds Qwen2's q/k/v biases; ``sliding_window`` limits each token to itself and
    the ``sliding_window`` positions before it (Mistral). ``context_mode`` says how attention reaches the keys
    of other ``cp`` ranks (``"all-gather"`` or ``"ring"``, :func:`zjax.context.attention`). ``scan`` stacks
    layers with ``nn.scan``; ``remat`` names the checkpointing policy of each layer (:data:`zjax.remat.POLICIES`).
    ``qk_norm`` RMS-normalizes each query and key head before RoPE (Qwen3). ``moe`` (:class:`MoE`) makes every
    layer's feed-forward block a mixture of experts, but for the first ``dense_layers`` layers (dense SwiGLU MLPs of
    size ``mlp``: DeepSeek's ``first_k_dense_replace``). ``mla`` (:class:`MLA`) makes the attention multi-head
    latent attention (DeepSeek-V2/V3; ``head_dim`` is then its query/key head width, ``qk_nope_head_dim +
    qk_rope_head_dim``, and RoPE rotates ``qk_rope_head_dim`` values). ``mtp_layers`` adds DeepSeek-V3's
    multi-token prediction modules (:mod:`zjax.models._mtp`), their loss weighted by ``mtp_weight``.
    ``matmul="fp8-current"`` runs the attention and dense MLP projections as fp8 products with current scaling
    (:func:`zjax.fp8.matmul`; the embedding, the head, the router and the experts stay in the compute dtype);
    ``"fp8-delayed"`` scales them from amax histories (:func:`zjax.fp8.matmul_delayed`) kept in the model state
    (``zjax.Variables.linen(model.init(...))``; not yet under pipelines or qgZ); ``"mxfp8"`` in
    blocks of 32 (:func:`zjax.fp8.matmul_mx`). ``bf16_edge_layers=n`` keeps the first and the last ``n`` layers'
    products in the compute dtype (Megatron-Core's ``--first-last-layers-bf16``; the parameters' tree is the
    same; not under pipelines or qgZ). ``dropout`` zeroes each value of every attention and MLP (or experts')
    output before its residual add with that probability (Megatron-Core's ``hidden_dropout``) when the loss is
    given a key (:func:`lm_loss`'s ``rng``; evaluation passes none): a token's masks depend on the key, the layer
    and the token's place in the global batch alone, so every way a step splits the batch draws the masks one
    device draws, pipelines' stages and microbatches included.
    """

    vocab: int = 256
    embed: int = 128
    layers: int = 4
    heads: int = 4
    head_dim: int = 32
    mlp: int = 512
    max_len: int = 128
    scan: bool = True
    remat: str = "full"
    kv_heads: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | YarnScaling | None = None
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    qkv_bias: bool = False
    sliding_window: int | None = None
    context_mode: str = "all-gather"
    qk_norm: bool = False
    moe: MoE | None = None
    matmul: str = "default"
    mla: MLA | None = None
    dense_layers: int = 0
    bf16_edge_layers: int = 0
    mtp_layers: int = 0
    mtp_weight: float = 0.3
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab", "embed", "layers", "heads", "head_dim", "mlp", "max_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DecoderConfig: {name}={value!r} must be a positive int.")
        if self.head_dim % 2:
            raise ValueError(f"DecoderConfig: head_dim={self.head_dim} must be even (RoPE rotates pairs).")
        if self.heads % self.num_kv_heads:
            raise ValueError(
                f"DecoderConfig: heads={self.heads} is not a multiple of kv_heads={self.num_kv_heads}; grouped-query "
                f"attention shares each key/value head among heads/kv_heads query heads."
            )
        if self.context_mode not in CONTEXT_MODES:
            raise ValueError(
                f"DecoderConfig: context_mode={self.context_mode!r}; valid modes are {list(CONTEXT_MODES)} (how "
                "attention gets keys and values from the other cp ranks)."
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"DecoderConfig: sliding_window={self.sliding_window} must be >= 1 or None.")
        if self.matmul not in MATMULS:
            raise ValueError(
                f"DecoderConfig: matmul={self.matmul!r}; use one of {list(MATMULS)} (the projections' matrix products)."
            )
        edges = self.bf16_edge_layers
        if edges and (self.matmul not in ("fp8-current", "mxfp8") or self.dense_layers or 2 * edges >= self.layers):
            raise ValueError(
                f"DecoderConfig: bf16_edge_layers={edges!r} with matmul={self.matmul!r}, layers={self.layers}, "
                f"dense_layers={self.dense_layers}: it keeps the first and the last {edges} layers' products in the "
                "compute dtype around fp8 ones, so it needs matmul='fp8-current' or 'mxfp8', fewer than half the "
                "layers, and no dense_layers."
            )
        if self.moe is not None and not isinstance(self.moe, MoE):
            raise TypeError(f"DecoderConfig: moe={self.moe!r} must be a zjax.models.MoE or None (a dense decoder).")
        if not isinstance(self.dense_layers, int) or not 0 <= self.dense_layers < self.layers:
            raise ValueError(
                f"DecoderConfig: dense_layers={self.dense_layers!r} must be an int in 0..layers-1={self.layers - 1} "
                "(the first layers with a dense MLP; at least one mixture-of-experts layer follows)."
            )
        if self.dense_layers and self.moe is None:
            raise ValueError(
                f"DecoderConfig: dense_layers={self.dense_layers} with moe=None: every layer of a dense decoder is "
                "dense already; set moe=zjax.models.MoE(...) or dense_layers=0."
            )
        if self.mla is not None:
            self._check_mla()
        if not isinstance(self.dropout, int | float) or not 0 <= self.dropout < 1:
            raise ValueError(
                f"DecoderConfig: dropout={self.dropout!r} must be a float in [0, 1) (the probability of zeroing each "
                "value of an attention or MLP output; 0: none)."
            )
        if not isinstance(self.mtp_layers, int) or self.mtp_layers < 0 or not self.mtp_weight >= 0:
            raise ValueError(
                f"DecoderConfig: mtp_layers={self.mtp_layers!r}, mtp_weight={self.mtp_weight!r}: mtp_layers is an int "
                ">= 0 (multi-token prediction modules; 0: none) and mtp_weight >= 0 (their loss's weight)."
            )

    def _check_mla(self) -> None:
        m = self.mla
        if not isinstance(m, MLA):
            raise TypeError(f"DecoderConfig: mla={m!r} must be a zjax.models.MLA or None (grouped-query attention).")
        clashes = {
            "kv_heads": self.kv_heads not in (None, self.heads),
            "qkv_bias": self.qkv_bias,
            "qk_norm": self.qk_norm,
        }
        for name, clash in clashes.items():
            if clash:
                raise ValueError(
                    f"DecoderConfig: {name}={getattr(self, name)!r} with mla=MLA(...): multi-head latent attention "
                    f"has per-head keys and values from its latent, no q/k/v biases and no q/k norms; leave {name} "
                    "at its default."
                )
        if self.head_dim != m.qk_head_dim:
            raise ValueError(
                f"DecoderConfig: head_dim={self.head_dim} with mla=MLA(qk_nope_head_dim={m.qk_nope_head_dim}, "
                f"qk_rope_head_dim={m.qk_rope_head_dim}): head_dim is the query/key head width, set "
                f"head_dim={m.qk_head_dim}."
            )

    @property
    def num_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def num_params(self) -> int:
        dense = self.dense_layers * (3 * self.embed * self.mlp - self._feed_forward())
        layer = self._attention() + self._feed_forward() + 2 * self.embed
        mtp = self.mtp_layers * (layer + 2 * self.embed * self.embed + 3 * self.embed)  # + norms and projection
        return self._tables() + self.layers * layer + dense + mtp + self.embed

    @property
    def moe_layers(self) -> int:
        """The layers whose feed-forward block is a mixture of experts (0 for a dense decoder)."""
        return 0 if self.moe is None else self.layers - self.dense_layers

    @property
    def num_expert_params(self) -> int:
        """The experts' parameters (split over ``ep``); 0 for a dense decoder."""
        return 0 if self.moe is None else self.moe_layers * self.moe.params_per_layer(self.embed, self.mlp)[0]

    @property
    def num_active_params(self) -> int:
        """Parameters one token passes through: :attr:`num_params` with ``top_k`` experts of each layer."""
        if self.moe is None:
            return self.num_params
        inactive = self._feed_forward() - self.moe.active_per_layer(self.embed, self.mlp)
        return self.num_params - self.moe_layers * inactive

    def _tables(self) -> int:
        return (1 if self.tie_embeddings else 2) * self.vocab * self.embed

    def _attention(self) -> int:
        if self.mla is not None:
            return self.mla.params_per_layer(self.embed, self.heads)
        kv = self.num_kv_heads * self.head_dim
        bias = (self.heads * self.head_dim + 2 * kv) if self.qkv_bias else 0
        norms = 2 * self.head_dim if self.qk_norm else 0
        return 2 * self.embed * self.heads * self.head_dim + 2 * self.embed * kv + bias + norms

    def _feed_forward(self) -> int:
        if self.moe is None:
            return 3 * self.embed * self.mlp
        return sum(self.moe.params_per_layer(self.embed, self.mlp))

    @property
    def mtp_layer(self) -> DecoderConfig:
        """The configuration of a multi-token prediction module's decoder layer: this one, its experts' selection
        biases off (:mod:`zjax.models._mtp`)."""
        if self.moe is None or self.moe.bias_update_rate is None:
            return self
        return dataclasses.replace(self, moe=dataclasses.replace(self.moe, bias_update_rate=None))

    @property
    def rope_dim(self) -> int:
        """How many values of a query or key head RoPE rotates: ``head_dim``, or MLA's ``qk_rope_head_dim``."""
        return self.head_dim if self.mla is None else self.mla.qk_rope_head_dim

    @property
    def in_compute_dtype(self) -> DecoderConfig:
        """This config with its projections' products in the compute dtype (a ``bf16_edge_layers`` layer's)."""
        return dataclasses.replace(self, matmul="default", bf16_edge_layers=0)

    @property
    def keeps_state(self) -> bool:
        """Whether the model keeps model state: routers' selection biases or fp8 amax histories."""
        return (self.moe is not None and self.moe.bias_update_rate is not None) or self.matmul == "fp8-delayed"

    def rope_frequencies(self) -> np.ndarray:
        """The rotary inverse frequencies ``[rope_dim / 2]`` (fp32), Llama-3.1's or YaRN's scaling applied."""
        d = self.rope_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        if self.rope_scaling is not None:
            inv = self.rope_scaling.frequencies(inv, self.rope_theta)
        return inv.astype(np.float32)

    @property
    def rope_attention_factor(self) -> float:
        """What the rotated queries and keys are multiplied by (YaRN's attention factor; 1 otherwise)."""
        return 1.0 if self.rope_scaling is None else float(self.rope_scaling.attention_factor)

    @property
    def softmax_scale(self) -> float:
        """What the attention logits are multiplied by: ``1 / sqrt(head_dim)``; with MLA and YaRN scaling that
        has an ``mscale_all_dim``, times ``mscale(factor, mscale_all_dim)`` squared (DeepSeek's attention)."""
        scale = 1.0 / math.sqrt(self.head_dim)
        s = self.rope_scaling
        if self.mla is not None and isinstance(s, YarnScaling) and s.mscale_all_dim:
            scale *= _yarn_mscale(s.factor, s.mscale_all_dim) ** 2
        return scale
