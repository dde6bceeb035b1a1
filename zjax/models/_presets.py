"""The decoder's presets: configurations as data, with the published parameter counts the tests check."""

from __future__ import annotations

import dataclasses

from ._config import DecoderConfig, RopeScaling
from ._mla import MLA
from ._moe import MoE

_LLAMA2_7B = DecoderConfig(vocab=32000, embed=4096, layers=32, heads=32, head_dim=128, mlp=11008, max_len=4096)
_LLAMA3_8B = DecoderConfig(
    vocab=128256, embed=4096, layers=32, heads=32, head_dim=128, kv_heads=8, mlp=14336, max_len=8192,
    rope_theta=500000.0, norm_eps=1e-5,
)  # fmt: skip

_MISTRAL_7B = DecoderConfig(
    vocab=32000, embed=4096, layers=32, heads=32, head_dim=128, kv_heads=8, mlp=14336, max_len=32768, norm_eps=1e-5,
    sliding_window=4096,
)  # fmt: skip
_QWEN3_30B = DecoderConfig(
    vocab=151936, embed=2048, layers=48, heads=32, head_dim=128, kv_heads=4, mlp=6144, max_len=40960,
    rope_theta=1e6, qk_norm=True,
    moe=MoE(experts=128, top_k=8, mlp=768, load_balance_weight=0.001, balance_loss="pooled"),
)  # fmt: skip

PRESETS: dict[str, DecoderConfig] = {
    "tiny": DecoderConfig(embed=64, layers=2, heads=2, head_dim=32, mlp=256, max_len=64),
    "small": DecoderConfig(),
    "medium": DecoderConfig(embed=512, layers=8, heads=8, head_dim=64, mlp=2048, max_len=256),
    # mixtures of experts: Mixtral-8x7B (46.7e9 parameters, 12.9e9 active), Qwen3-30B-A3B and Qwen3-235B-A22B
    # Mistral-7B's attention with 8 of its MLPs as experts, 2 per token, and no sliding window
    "mixtral-8x7b": dataclasses.replace(
        _MISTRAL_7B,
        sliding_window=None,
        rope_theta=1e6,
        moe=MoE(experts=8, top_k=2, load_balance_weight=0.02, balance_loss="pooled"),
    ),
    "qwen3-30b-a3b": _QWEN3_30B,
    "qwen3-235b-a22b": dataclasses.replace(
        _QWEN3_30B,
        embed=4096,
        layers=94,
        heads=64,
        mlp=12288,
        moe=MoE(experts=128, top_k=8, mlp=1536, load_balance_weight=0.001, balance_loss="pooled"),
    ),  # fmt: skip
    # "small" with 8 experts of half its MLP, 2 per token: the same matmul work per token, 4x the MLP parameters
    "moe-small": DecoderConfig(moe=MoE(experts=8, top_k=2, mlp=256, z_loss_weight=1e-3)),
    # "small" shaped as DeepSeek-V3: latent attention, a dense first layer, 8 experts in 4 groups (2 groups and 2
    # experts per token, sigmoid scores, selection biases, a shared expert) and one multi-token prediction module
    "deepseek-small": DecoderConfig(
        head_dim=48,
        dense_layers=1,
        mla=MLA(kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32),
        moe=MoE(
            experts=8,
            top_k=2,
            mlp=128,
            shared_mlp=128,
            shared_gate=False,
            scoring="sigmoid",
            groups=4,
            top_groups=2,
            routed_scale=2.5,
            bias_update_rate=1e-3,
            balance_loss="per-sequence",
            load_balance_weight=1e-4 / 2,
        ),  # fmt: skip
        mtp_layers=1,
    ),
    # the seeds' table: Llama-2-7B's sizes (6.74e9 parameters)
    "llama2-7b": dataclasses.replace(_LLAMA2_7B, norm_eps=1e-5),
    "llama3-8b": _LLAMA3_8B,
    "llama3-70b": dataclasses.replace(_LLAMA3_8B, embed=8192, layers=80, heads=64, mlp=28672),
    "llama3.1-8b": dataclasses.replace(_LLAMA3_8B, max_len=131072, rope_scaling=RopeScaling()),
    # Llama-3.2-1B's sizes: the tied-embedding preset (its 128,256 x 2,048 table is 21% of 1.24e9 parameters)
    "llama3.2-1b": dataclasses.replace(
        _LLAMA3_8B,
        embed=2048,
        layers=16,
        heads=32,
        head_dim=64,
        mlp=8192,
        max_len=131072,
        rope_scaling=RopeScaling(factor=32.0),
        tie_embeddings=True,
    ),  # fmt: skip
    "mistral-7b": _MISTRAL_7B,
    "qwen2-7b": DecoderConfig(
        vocab=152064,
        embed=3584,
        layers=28,
        heads=28,
        head_dim=128,
        kv_heads=4,
        mlp=18944,
        max_len=32768,
        rope_theta=1000000.0,
        qkv_bias=True,
    ),  # fmt: skip
}
