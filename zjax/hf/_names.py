"""Where each of the decoder's parameters lives in a Hugging Face checkpoint: names and layouts, as data.

A zjax parameter of per-layer shape ``Z`` is stored in a Hugging Face file as a tensor whose dimension
``k`` is zjax's dimensions ``hf_dims[k]`` flattened together (in that order). ``wq [embed, heads,
head_dim]`` is ``q_proj.weight [heads * head_dim, embed]``: ``hf_dims = ((1, 2), (0,))``. Scanned models
stack layer ``i``'s tensors (``model.layers.{i}...``) on a leading ``layers`` axis, in natural order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

from ..models import DecoderConfig

# zjax parameter (within a layer) -> (Hugging Face name within the layer, hf_dims)
_LAYER: tuple[tuple[tuple[str, ...], str, tuple[tuple[int, ...], ...]], ...] = (
    (("attn_norm", "scale"), "input_layernorm.weight", ((0,),)),
    (("wq",), "self_attn.q_proj.weight", ((1, 2), (0,))),
    (("wk",), "self_attn.k_proj.weight", ((1, 2), (0,))),
    (("wv",), "self_attn.v_proj.weight", ((1, 2), (0,))),
    (("wo",), "self_attn.o_proj.weight", ((2,), (0, 1))),
    (("mlp_norm", "scale"), "post_attention_layernorm.weight", ((0,),)),
    (("w_gate",), "mlp.gate_proj.weight", ((1,), (0,))),
    (("w_up",), "mlp.up_proj.weight", ((1,), (0,))),
    (("w_down",), "mlp.down_proj.weight", ((1,), (0,))),
)
_BIASES = (
    (("bq",), "self_attn.q_proj.bias", ((0, 1),)),
    (("bk",), "self_attn.k_proj.bias", ((0, 1),)),
    (("bv",), "self_attn.v_proj.bias", ((0, 1),)),
)

IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
"""Buffers some checkpoints carry that are not parameters (recomputed from the config)."""


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One parameter: its path in the params tree, its Hugging Face name(s) and how its dims map.

    ``stacked``: the leaf has a leading ``layers`` axis and ``name`` holds ``{i}`` for the layer index.
    ``shape``: the zjax shape of one stored tensor (per layer when stacked).
    """

    path: tuple[str, ...]
    name: str
    hf_dims: tuple[tuple[int, ...], ...]
    shape: tuple[int, ...]
    stacked: bool = False

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(self.shape[d] for d in group) for group in self.hf_dims)

    def names(self, layers: int) -> list[str]:
        return [self.name.format(i=i) for i in range(layers)] if self.stacked else [self.name]


def _layer_shapes(cfg: DecoderConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    e, h, kv, d, m = cfg.embed, cfg.heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp
    return {
        ("attn_norm", "scale"): (e,),
        ("mlp_norm", "scale"): (e,),
        ("wq",): (e, h, d),
        ("wk",): (e, kv, d),
        ("wv",): (e, kv, d),
        ("wo",): (h, d, e),
        ("w_gate",): (e, m),
        ("w_up",): (e, m),
        ("w_down",): (m, e),
        ("bq",): (h, d),
        ("bk",): (kv, d),
        ("bv",): (kv, d),
    }


def tensors(cfg: DecoderConfig) -> Iterator[Tensor]:
    """Every parameter of a :class:`~zjax.models.Decoder` of ``cfg``, in Hugging Face's file order."""
    yield Tensor(("embedding",), "model.embed_tokens.weight", ((0,), (1,)), (cfg.vocab, cfg.embed))
    shapes = _layer_shapes(cfg)
    per_layer = _LAYER + (_BIASES if cfg.qkv_bias else ())
    if cfg.scan:
        for sub, name, dims in per_layer:
            yield Tensor(("layers", *sub), "model.layers.{i}." + name, dims, shapes[sub], stacked=True)
    else:
        for i in range(cfg.layers):
            for sub, name, dims in per_layer:
                yield Tensor((f"layer_{i}", *sub), f"model.layers.{i}.{name}", dims, shapes[sub])
    yield Tensor(("final_norm", "scale"), "model.norm.weight", ((0,),), (cfg.embed,))
    if not cfg.tie_embeddings:
        yield Tensor(("head",), "lm_head.weight", ((1,), (0,)), (cfg.embed, cfg.vocab))
