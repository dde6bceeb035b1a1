"""Where each of the decoder's parameters lives in a Hugging Face checkpoint: names and layouts, as data.

A zjax parameter of per-layer shape ``Z`` is stored in a Hugging Face file as a tensor whose dimension
``k`` is zjax's dimensions ``hf_dims[k]`` flattened together (in that order). ``wq [embed, heads,
head_dim]`` is ``q_proj.weight [heads * head_dim, embed]``: ``hf_dims = ((1, 2), (0,))``. Scanned models
stack layer ``i``'s tensors (``model.layers.{i}...``) on a leading ``layers`` axis, in natural order.

A mixture of experts stores one tensor per layer and expert (``...experts.{j}.w1.weight``); zjax stacks the
experts on an ``experts`` axis (after ``layers``), so one leaf ``[layers, experts, *Z]`` is ``layers x
experts`` Hugging Face tensors of shape ``Z`` laid out by ``hf_dims``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator

from ..models import DecoderConfig
from ..models._hf_config import model_type_of

Layout = tuple[tuple[int, ...], ...]
_LINEAR: Layout = ((1,), (0,))  # a zjax [in, out] matrix is a PyTorch Linear's [out, in] weight

# zjax parameter (within a layer) -> (Hugging Face name within the layer, hf_dims)
_ATTENTION: tuple[tuple[tuple[str, ...], str, Layout], ...] = (
    (("attn_norm", "scale"), "input_layernorm.weight", ((0,),)),
    (("wq",), "self_attn.q_proj.weight", ((1, 2), (0,))),
    (("wk",), "self_attn.k_proj.weight", ((1, 2), (0,))),
    (("wv",), "self_attn.v_proj.weight", ((1, 2), (0,))),
    (("wo",), "self_attn.o_proj.weight", ((2,), (0, 1))),
    (("mlp_norm", "scale"), "post_attention_layernorm.weight", ((0,),)),
)
_DENSE_MLP = (
    (("w_gate",), "mlp.gate_proj.weight", _LINEAR),
    (("w_up",), "mlp.up_proj.weight", _LINEAR),
    (("w_down",), "mlp.down_proj.weight", _LINEAR),
)
_BIASES = (
    (("bq",), "self_attn.q_proj.bias", ((0, 1),)),
    (("bk",), "self_attn.k_proj.bias", ((0, 1),)),
    (("bv",), "self_attn.v_proj.bias", ((0, 1),)),
)
_QK_NORMS = (
    (("q_norm", "scale"), "self_attn.q_norm.weight", ((0,),)),
    (("k_norm", "scale"), "self_attn.k_norm.weight", ((0,),)),
)
# mixture of experts: (router name, expert names (gate, up, down) with {j}); Mixtral's block_sparse_moe, Qwen's mlp
_MIXTRAL = ("block_sparse_moe.gate.weight", ("block_sparse_moe.experts.{j}.w1.weight",
            "block_sparse_moe.experts.{j}.w3.weight", "block_sparse_moe.experts.{j}.w2.weight"))  # fmt: skip
_QWEN_MOE = ("mlp.gate.weight", ("mlp.experts.{j}.gate_proj.weight", "mlp.experts.{j}.up_proj.weight",
             "mlp.experts.{j}.down_proj.weight"))  # fmt: skip
_SHARED = (
    (("moe", "shared_gate"), "mlp.shared_expert.gate_proj.weight", _LINEAR),
    (("moe", "shared_up"), "mlp.shared_expert.up_proj.weight", _LINEAR),
    (("moe", "shared_down"), "mlp.shared_expert.down_proj.weight", _LINEAR),
    (("moe", "shared_router"), "mlp.shared_expert_gate.weight", _LINEAR),
)

IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
"""Buffers some checkpoints carry that are not parameters (recomputed from the config)."""


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One parameter: its path in the params tree, its Hugging Face name(s) and how its dims map.

    ``stacked``: the leaf has a leading ``layers`` axis and ``name`` holds ``{i}`` for the layer index.
    ``experts > 0``: the leaf has an ``experts`` axis of that size (after ``layers`` when stacked) and
    ``name`` holds ``{j}`` for the expert index: one Hugging Face tensor per expert.
    ``shape``: the zjax shape of one stored tensor (per layer and per expert).
    """

    path: tuple[str, ...]
    name: str
    hf_dims: Layout
    shape: tuple[int, ...]
    stacked: bool = False
    experts: int = 0

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(self.shape[d] for d in group) for group in self.hf_dims)

    def leading(self, layers: int) -> tuple[int, ...]:
        """The sizes of the leaf's axes that index stored tensors: ``layers`` when stacked, ``experts``."""
        return ((layers,) if self.stacked else ()) + ((self.experts,) if self.experts else ())

    def name_at(self, index: tuple[int, ...]) -> str:
        """The Hugging Face name of the tensor at ``index`` over the :meth:`leading` axes."""
        if not index:
            return self.name
        i = index[0] if self.stacked else None
        j = index[-1] if self.experts else None
        return self.name.format(i=i, j=j)

    def indices(self, layers: int) -> list[tuple[int, ...]]:
        """Every index over the :meth:`leading` axes, in file order (layer-major)."""
        return list(itertools.product(*(range(n) for n in self.leading(layers))))

    def names(self, layers: int) -> list[str]:
        return [self.name_at(index) for index in self.indices(layers)]


def _layer_shapes(cfg: DecoderConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    e, h, kv, d, m = cfg.embed, cfg.heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp
    f = cfg.moe.expert_mlp(m) if cfg.moe is not None else m
    s = cfg.moe.shared_mlp if cfg.moe is not None else 0
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
        ("q_norm", "scale"): (d,),
        ("k_norm", "scale"): (d,),
        ("moe", "router"): (e, cfg.moe.experts if cfg.moe is not None else 0),
        ("moe", "w_gate"): (e, f),
        ("moe", "w_up"): (e, f),
        ("moe", "w_down"): (f, e),
        ("moe", "shared_gate"): (e, s),
        ("moe", "shared_up"): (e, s),
        ("moe", "shared_down"): (s, e),
        ("moe", "shared_router"): (e, 1),
    }


def _per_layer(cfg: DecoderConfig) -> Iterator[tuple[tuple[str, ...], str, Layout, int]]:
    """``(path within the layer, Hugging Face name within the layer, hf_dims, experts)`` of each parameter."""
    for sub, name, dims in _ATTENTION + (_BIASES if cfg.qkv_bias else ()) + (_QK_NORMS if cfg.qk_norm else ()):
        yield sub, name, dims, 0
    if cfg.moe is None:
        for sub, name, dims in _DENSE_MLP:
            yield sub, name, dims, 0
        return
    router, experts = _MIXTRAL if model_type_of(cfg) == "mixtral" else _QWEN_MOE
    yield ("moe", "router"), router, _LINEAR, 0
    for leaf, name in zip(("w_gate", "w_up", "w_down"), experts, strict=True):
        yield ("moe", leaf), name, _LINEAR, cfg.moe.experts
    if cfg.moe.shared_mlp:
        for sub, name, dims in _SHARED:
            yield sub, name, dims, 0


def tensors(cfg: DecoderConfig) -> Iterator[Tensor]:
    """Every parameter of a :class:`~zjax.models.Decoder` of ``cfg``, in Hugging Face's file order."""
    yield Tensor(("embedding",), "model.embed_tokens.weight", ((0,), (1,)), (cfg.vocab, cfg.embed))
    shapes = _layer_shapes(cfg)
    per_layer = list(_per_layer(cfg))
    if cfg.scan:
        for sub, name, dims, experts in per_layer:
            yield Tensor(("layers", *sub), "model.layers.{i}." + name, dims, shapes[sub], True, experts)
    else:
        for i in range(cfg.layers):
            for sub, name, dims, experts in per_layer:
                # the layer index is fixed; an expert's {j} stays for name_at
                yield Tensor((f"layer_{i}", *sub), f"model.layers.{i}." + name, dims, shapes[sub], False, experts)
    yield Tensor(("final_norm", "scale"), "model.norm.weight", ((0,),), (cfg.embed,))
    if not cfg.tie_embeddings:
        yield Tensor(("head",), "lm_head.weight", ((1,), (0,)), (cfg.embed, cfg.vocab))
