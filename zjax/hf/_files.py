"""Hugging Face checkpoint files: which safetensors file holds which tensor."""

from __future__ import annotations

import json
import os

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def checkpoint_dir(path: str | os.PathLike) -> str:
    """The checkpoint directory of ``path`` (the directory itself or its ``config.json``)."""
    path = os.fspath(path)
    return os.path.dirname(path) or "." if os.path.isfile(path) else path


def weight_map(directory: str) -> dict[str, str]:
    """Tensor name -> file path, from ``model.safetensors.index.json`` or a single ``model.safetensors``."""
    index = os.path.join(directory, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            try:
                names = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(
                    f"zjax.hf: {index!r} is not a safetensors index (no valid 'weight_map': {e})."
                ) from None
        return {name: os.path.join(directory, file) for name, file in names.items()}
    single = os.path.join(directory, SINGLE)
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, "numpy") as f:
            return dict.fromkeys(f.keys(), single)
    raise FileNotFoundError(
        f"zjax.hf: {directory!r} has neither {SINGLE} nor {INDEX}; a Hugging Face checkpoint saved with "
        f"safetensors has one of them (convert .bin checkpoints to safetensors first)."
    )
