"""Hugging Face ``config.json`` <-> :class:`DecoderConfig`, for the model types the decoder covers."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from ._decoder import Decoder, DecoderConfig, RopeScaling

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


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


def _unsupported(file: str, what: str) -> ValueError:
    return ValueError(f"zjax.models: {file}: {what} is not supported by zjax's decoder.")


def config_from_hf(hf: dict[str, Any], source: str = "config.json", **overrides: Any) -> DecoderConfig:
    """The :class:`DecoderConfig` of a Hugging Face config dict; ``overrides`` set zjax-only fields
    (``remat``, ``scan``) or replace any field."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"zjax.models: {source} has model_type {model_type!r}; supported model types are "
            f"{list(SUPPORTED_MODEL_TYPES)} (Llama-2/3/3.1, Mistral, Qwen2)."
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise _unsupported(source, f"hidden_act={hf['hidden_act']!r} (the decoder's MLP is SwiGLU with silu)")
    if hf.get("mlp_bias"):
        raise _unsupported(source, "mlp_bias=true")
    if model_type != "qwen2" and hf.get("attention_bias"):
        raise _unsupported(source, "attention_bias=true (biases on q, k, v and o)")
    if model_type == "qwen2" and hf.get("use_sliding_window"):
        raise _unsupported(source, "use_sliding_window=true (Qwen2's per-layer windows)")
    scaling = hf.get("rope_scaling")
    rope_scaling = None
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
        else:
            raise _unsupported(source, f"rope_scaling of type {kind!r} (supported: 'llama3')")
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
            qkv_bias=model_type == "qwen2",
            sliding_window=(
                int(hf["sliding_window"]) if model_type == "mistral" and hf.get("sliding_window") else None
            ),
        )
    except KeyError as e:
        raise ValueError(f"zjax.models: {source} has no {e.args[0]!r}, which a {model_type} config needs.") from None
    return dataclasses.replace(DecoderConfig(**fields), **overrides)


def model_type_of(cfg: DecoderConfig) -> str:
    """The Hugging Face ``model_type`` a config exports as."""
    if cfg.qkv_bias:
        return "qwen2"
    return "mistral" if cfg.sliding_window is not None else "llama"


def config_to_hf(cfg: DecoderConfig, dtype: str = "bfloat16", model_type: str | None = None) -> dict[str, Any]:
    """The Hugging Face config dict of ``cfg`` (the inverse of :func:`config_from_hf`)."""
    model_type = model_type or model_type_of(cfg)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"zjax.models: model_type {model_type!r}; supported: {list(SUPPORTED_MODEL_TYPES)}.")
    if cfg.qkv_bias != (model_type == "qwen2"):
        raise ValueError(f"zjax.models: qkv_bias={cfg.qkv_bias} cannot be written as model_type {model_type!r}.")
    s = cfg.rope_scaling
    hf: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[model_type]],
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
        "rope_scaling": None
        if s is None
        else {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_len,
        },
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": dtype,
    }
    if model_type == "llama":
        hf.update(attention_bias=False, mlp_bias=False)
    if model_type == "mistral":
        hf["sliding_window"] = cfg.sliding_window
    if model_type == "qwen2":
        hf.update(use_sliding_window=False, sliding_window=None)
    return hf


def from_hf_config(path: str | os.PathLike, **overrides: Any) -> Decoder:
    """A :class:`Decoder` for the Hugging Face checkpoint at ``path`` (its directory or its ``config.json``).

    ``overrides`` set zjax's own fields, e.g. ``from_hf_config(dir, remat="dots")``.
    """
    return Decoder(config_from_hf(read_hf_config(path), config_path(path), **overrides))
