"""Hugging Face ``config.json`` <-> :class:`DecoderConfig`, for the model types the decoder covers."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from ._config import DecoderConfig, RopeScaling, YarnScaling
from ._decoder import Decoder
from ._hf_moe import MOE_MODEL_TYPES, moe_from_hf, moe_to_hf
from ._hf_moe import unsupported as _unsupported
from ._mla import MLA

_DENSE = ("llama", "mistral", "qwen2")
SUPPORTED_MODEL_TYPES = (*_DENSE, "qwen3", *MOE_MODEL_TYPES)


@dataclasses.dataclass(frozen=True)
class _Family:
    """What a ``model_type`` has: q/k/v biases, q/k norms, experts, and how it names a sliding window
    (``"mistral"``: ``sliding_window`` for every layer; ``"qwen"``: ``use_sliding_window``, refused)."""

    architecture: str
    qkv_bias: bool = False
    qk_norm: bool = False
    moe: bool = False
    window: str | None = None
    mla: bool = False


_FAMILIES = {
    "llama": _Family("LlamaForCausalLM"),
    "mistral": _Family("MistralForCausalLM", window="mistral"),
    "qwen2": _Family("Qwen2ForCausalLM", qkv_bias=True, window="qwen"),
    "qwen3": _Family("Qwen3ForCausalLM", qk_norm=True, window="qwen"),
    "mixtral": _Family("MixtralForCausalLM", moe=True, window="mistral"),
    "qwen2_moe": _Family("Qwen2MoeForCausalLM", qkv_bias=True, moe=True, window="qwen"),
    "qwen3_moe": _Family("Qwen3MoeForCausalLM", qk_norm=True, moe=True, window="qwen"),
    "deepseek_v2": _Family("DeepseekV2ForCausalLM", moe=True, mla=True),
    "deepseek_v3": _Family("DeepseekV3ForCausalLM", moe=True, mla=True),
}
_DEFAULTS = {"mixtral": {"rope_theta": 1e6, "rms_norm_eps": 1e-5}}  # where transformers' defaults differ


def config_path(path: str | os.PathLike) -> str:
    """``path`` itself if it is a file, else ``path/config.json``."""
    path = os.fspath(path)
    return path if os.path.isfile(path) else os.path.join(path, "config.json")


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    file = config_path(path)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"zjax.models: no Hugging Face config at {file!r} (a checkpoint directory holds one).")
    with open(file) as f:
        try:
            hf = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"zjax.models: {file!r} is not valid JSON ({e}).") from None
    if not isinstance(hf, dict):
        raise ValueError(f"zjax.models: {file!r} holds a {type(hf).__name__}, not a config object.")
    return hf


def config_from_hf(hf: dict[str, Any], source: str = "config.json", **overrides: Any) -> DecoderConfig:
    """The :class:`DecoderConfig` of a Hugging Face config dict; ``overrides`` set zjax-only fields
    (``remat``, ``scan``) or replace any field (``moe=``: a whole :class:`~zjax.models.MoE`, e.g. with a
    capacity factor).

    Raises:
      ValueError: an unsupported ``model_type`` or setting (named with its value), or a missing field.
    """
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"zjax.models: {source} has model_type {model_type!r}; supported model types are {list(_DENSE)} "
            f"(Llama-2/3/3.1, Mistral, Qwen2), ['qwen3'] (Qwen3) and the mixtures of experts "
            f"{list(MOE_MODEL_TYPES)} (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2, DeepSeek-V3)."
        )
    family = _FAMILIES[model_type]
    hf = {**_DEFAULTS.get(model_type, {}), **hf}
    if hf.get("hidden_act", "silu") != "silu":
        raise _unsupported(source, f"hidden_act={hf['hidden_act']!r} (the decoder's MLP is SwiGLU with silu)")
    if hf.get("mlp_bias"):
        raise _unsupported(source, "mlp_bias=true")
    if not family.qkv_bias and hf.get("attention_bias"):
        raise _unsupported(source, "attention_bias=true (biases on q, k, v and o)")
    if family.window == "qwen" and hf.get("use_sliding_window"):
        raise _unsupported(source, "use_sliding_window=true (Qwen's per-layer windows)")
    scaling = hf.get("rope_scaling")
    rope_scaling: RopeScaling | YarnScaling | None = None
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "default":
            rope_scaling = None
        elif kind == "llama3":
            rope_scaling = RopeScaling(
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_len=int(scaling["original_max_position_embeddings"]),
            )
        elif kind == "yarn":
            optional = {
                "mscale": "mscale",
                "mscale_all_dim": "mscale_all_dim",
                "attention_factor": "given_attention_factor",
            }
            rope_scaling = YarnScaling(
                factor=float(scaling["factor"]),
                original_max_len=int(scaling.get("original_max_position_embeddings") or hf["max_position_embeddings"]),
                beta_fast=float(scaling.get("beta_fast") or 32.0),
                beta_slow=float(scaling.get("beta_slow") or 1.0),
                truncate=bool(scaling.get("truncate", True)),
                **{
                    ours: float(scaling[theirs]) for theirs, ours in optional.items() if scaling.get(theirs) is not None
                },
            )
        else:
            raise _unsupported(source, f"rope_scaling of type {kind!r} (supported: 'llama3', 'yarn')")
    heads = int(hf["num_attention_heads"])
    try:
        fields: dict[str, Any] = dict(
            vocab=int(hf["vocab_size"]),
            embed=int(hf["hidden_size"]),
            layers=int(hf["num_hidden_layers"]),
            heads=heads,
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            mlp=int(hf["intermediate_size"]),
            max_len=int(hf.get("max_position_embeddings", 2048)),
            kv_heads=None if int(hf.get("num_key_value_heads") or heads) == heads else int(hf["num_key_value_heads"]),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            rope_scaling=rope_scaling,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=family.qkv_bias,
            sliding_window=(
                int(hf["sliding_window"]) if family.window == "mistral" and hf.get("sliding_window") else None
            ),
            qk_norm=family.qk_norm,
        )
        if family.moe:
            fields["moe"] = moe_from_hf(hf, model_type, source, fields["mlp"])
        if family.mla:
            fields.update(_mla_from_hf(hf, source))
    except KeyError as e:
        raise ValueError(f"zjax.models: {source} has no {e.args[0]!r}, which a {model_type} config needs.") from None
    return dataclasses.replace(DecoderConfig(**fields), **overrides)


def _mla_from_hf(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The fields of a DeepSeek config's multi-head latent attention and first dense layers."""
    if int(hf.get("num_key_value_heads") or hf["num_attention_heads"]) != int(hf["num_attention_heads"]):
        raise _unsupported(source, f"num_key_value_heads={hf['num_key_value_heads']} (MLA has one key per head)")
    try:
        mla = MLA(
            kv_lora_rank=int(hf["kv_lora_rank"]),
            q_lora_rank=int(hf["q_lora_rank"]) if hf.get("q_lora_rank") else None,
            qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
            qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
            v_head_dim=int(hf["v_head_dim"]),
            rope_interleave=bool(hf.get("rope_interleave", True)),
        )
    except ValueError as e:
        raise ValueError(f"zjax.models: {source}: {e}") from None
    dense = int(hf.get("first_k_dense_replace") or 0)
    return {"mla": mla, "head_dim": mla.qk_head_dim, "kv_heads": None, "dense_layers": dense}


def _mla_to_hf(cfg: DecoderConfig, m: MLA) -> dict[str, Any]:
    return {
        "kv_lora_rank": m.kv_lora_rank,
        "q_lora_rank": m.q_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim,
        "head_dim": m.qk_rope_head_dim,  # transformers' DeepseekV3Config: the rotary part's width
        "rope_interleave": m.rope_interleave,
        "first_k_dense_replace": cfg.dense_layers,
        "num_nextn_predict_layers": cfg.mtp_layers,  # what the files hold (zjax.hf.save writes no MTP modules yet)
        "attention_bias": False,
    }


def model_type_of(cfg: DecoderConfig) -> str:
    """The Hugging Face ``model_type`` a config exports as: q/k norms make a Qwen3, q/k biases (or a shared
    expert) a Qwen2, experts otherwise a Mixtral, a sliding window otherwise a Mistral."""
    if cfg.mla is not None:  # DeepSeek-V2 scores by softmax (a dense MLA model exports as V3, which has no experts)
        return "deepseek_v2" if cfg.moe is not None and cfg.moe.scoring == "softmax" else "deepseek_v3"
    if cfg.moe is not None:
        if cfg.qk_norm:
            return "qwen3_moe"
        return "qwen2_moe" if cfg.qkv_bias or cfg.moe.shared_mlp else "mixtral"
    if cfg.qk_norm:
        return "qwen3"
    if cfg.qkv_bias:
        return "qwen2"
    return "mistral" if cfg.sliding_window is not None else "llama"


def _check_family(cfg: DecoderConfig, model_type: str) -> _Family:
    family = _FAMILIES[model_type]
    for name, has, wants in (
        ("qkv_bias", cfg.qkv_bias, family.qkv_bias),
        ("qk_norm", cfg.qk_norm, family.qk_norm),
        ("moe", cfg.moe is not None, family.moe),
        ("mla", cfg.mla is not None, family.mla),
    ):
        if has != wants:
            value = getattr(cfg, name)
            raise ValueError(
                f"zjax.models: {name}={value} cannot be written as model_type {model_type!r} (which has "
                f"{'' if wants else 'no '}{name}); leave model_type out to pick it from the config."
            )
    if cfg.sliding_window is not None and family.window != "mistral":
        raise ValueError(
            f"zjax.models: sliding_window={cfg.sliding_window} cannot be written as model_type {model_type!r}, "
            "which has no window on every layer (mistral and mixtral have)."
        )
    return family


def config_to_hf(cfg: DecoderConfig, dtype: str = "bfloat16", model_type: str | None = None) -> dict[str, Any]:
    """The Hugging Face config dict of ``cfg`` (the inverse of :func:`config_from_hf`).

    ``model_type`` defaults to :func:`model_type_of`. A Mixtral's ``intermediate_size`` is its experts' size;
    MoE settings Hugging Face has no field for (``capacity_factor``, ``z_loss_weight``, ``exchange``) are not
    written.

    Raises:
      ValueError: an unknown ``model_type``, or one that cannot express ``cfg`` (biases, q/k norms, experts,
        a shared expert, a sliding window, the top-k renormalization it lacks or always has).
    """
    model_type = model_type or model_type_of(cfg)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"zjax.models: model_type {model_type!r}; supported: {list(SUPPORTED_MODEL_TYPES)}.")
    family = _check_family(cfg, model_type)
    s = cfg.rope_scaling
    hf: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": model_type,
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.embed,
        "intermediate_size": cfg.mlp,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": _rope_scaling_to_hf(s),
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": dtype,
    }
    if model_type == "llama":
        hf.update(attention_bias=False, mlp_bias=False)
    if family.qk_norm:  # Qwen3 (MoE): biases on q, k, v and o when attention_bias
        hf["attention_bias"] = False
    if family.window == "mistral":
        hf["sliding_window"] = cfg.sliding_window
    if family.window == "qwen":
        hf.update(use_sliding_window=False, sliding_window=None)
    if cfg.moe is not None:
        hf.update(moe_to_hf(cfg.moe, model_type, cfg.mlp))
    if cfg.mla is not None:
        hf.update(_mla_to_hf(cfg, cfg.mla))
    elif cfg.dense_layers:
        raise ValueError(
            f"zjax.models: dense_layers={cfg.dense_layers} cannot be written as model_type {model_type!r} (its "
            "layers are all mixtures of experts); DeepSeek-V3's first_k_dense_replace has them."
        )
    return hf


def from_hf_config(path: str | os.PathLike, **overrides: Any) -> Decoder:
    """A :class:`Decoder` for the Hugging Face checkpoint at ``path`` (its directory or its ``config.json``).

    ``overrides`` set zjax's own fields, e.g. ``from_hf_config(dir, remat="dots")``.
    """
    return Decoder(config_from_hf(read_hf_config(path), config_path(path), **overrides))


def _rope_scaling_to_hf(s: RopeScaling | YarnScaling | None) -> dict[str, Any] | None:
    """A Hugging Face config's ``rope_scaling`` entry of ``s``."""
    if s is None:
        return None
    if isinstance(s, YarnScaling):
        out: dict[str, Any] = {
            "rope_type": "yarn",
            "factor": s.factor,
            "original_max_position_embeddings": s.original_max_len,
            "beta_fast": s.beta_fast,
            "beta_slow": s.beta_slow,
            "truncate": s.truncate,
        }
        given = {"mscale": s.mscale, "mscale_all_dim": s.mscale_all_dim, "attention_factor": s.given_attention_factor}
        return {**out, **{k: v for k, v in given.items() if v is not None}}
    return {
        "rope_type": "llama3",
        "factor": s.factor,
        "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor,
        "original_max_position_embeddings": s.original_max_len,
    }
