"""Tiny Hugging Face checkpoints made in the tests from transformers' own Flax models (a reference zjax did
not write): random weights, written in the PyTorch layout and names that Hugging Face checkpoints use."""

from __future__ import annotations

import json
import os

import numpy as np


def flax_model(kind: str, **config):
    """A transformers Flax causal LM (``"llama"`` or ``"mistral"``) with random normal weights and its config."""
    import transformers

    cls, cfg_cls = {
        "llama": (transformers.FlaxLlamaForCausalLM, transformers.LlamaConfig),
        "mistral": (transformers.FlaxMistralForCausalLM, transformers.MistralConfig),
    }[kind]
    base = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,  # transformers' Flax Llama needs >= 2 * head_dim
        rms_norm_eps=1e-5,
    )
    cfg = cfg_cls(**{**base, **config})
    model = cls(cfg, seed=0)
    rng = np.random.default_rng(0)
    params = _map(lambda x: (rng.normal(size=x.shape) * 0.2).astype(np.float32), model.params)
    return model, cfg, params


def _map(fn, tree):
    return {k: _map(fn, v) for k, v in tree.items()} if isinstance(tree, dict) else fn(np.asarray(tree))


def torch_layout(params: dict, tied: bool = False) -> dict[str, np.ndarray]:
    """Flax params of transformers' Llama/Mistral -> Hugging Face checkpoint tensors (``[out, in]`` weights)."""
    m = params["model"]
    out = {"model.embed_tokens.weight": m["embed_tokens"]["embedding"], "model.norm.weight": m["norm"]["weight"]}
    if not tied:
        out["lm_head.weight"] = params["lm_head"]["kernel"].T
    for i, layer in m["layers"].items():
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"model.layers.{i}.{norm}.weight"] = layer[norm]["weight"]
        for group in ("self_attn", "mlp"):
            for proj, p in layer[group].items():
                out[f"model.layers.{i}.{group}.{proj}.weight"] = p["kernel"].T
                if "bias" in p:
                    out[f"model.layers.{i}.{group}.{proj}.bias"] = p["bias"]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def write_checkpoint(
    directory: str, hf_config: dict, tensors: dict[str, np.ndarray], dtype=None, files: int = 1
) -> str:
    """A Hugging Face checkpoint directory: ``config.json`` and ``files`` safetensors files (an index if > 1)."""
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    tensors = {k: v.astype(dtype) if dtype is not None else v for k, v in tensors.items()}
    names = sorted(tensors)
    if files == 1:
        save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for k, chunk in enumerate(np.array_split(np.array(names), files)):
            file = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
            save_file({n: tensors[n] for n in chunk}, os.path.join(directory, file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(chunk.tolist(), file))
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config, f)
    return directory


def read_checkpoint(directory: str) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint directory, by name."""
    from safetensors.numpy import load_file

    out: dict[str, np.ndarray] = {}
    for file in sorted(os.listdir(directory)):
        if file.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, file)))
    return out
