"""Which decoder a planner's model argument names: a preset, a Hugging Face config or checkpoint, a config."""

from __future__ import annotations

import os

from ..models import PRESETS, DecoderConfig, config_from_hf
from ..models._hf_config import config_path, read_hf_config


def resolve_model(model: str | os.PathLike | DecoderConfig) -> tuple[str, DecoderConfig]:
    """A preset name, a Hugging Face ``config.json`` (or its directory), or a :class:`DecoderConfig`."""
    if isinstance(model, DecoderConfig):
        return "custom", model
    if str(model) in PRESETS:
        return str(model), PRESETS[str(model)]
    if os.path.exists(model):
        hf = read_hf_config(model)
        return str(hf.get("_name_or_path") or model), config_from_hf(hf, config_path(model))
    raise ValueError(
        f"planner: unknown model {str(model)!r}: not a preset ({sorted(PRESETS)}) and not a Hugging Face "
        f"config.json or checkpoint directory."
    )
