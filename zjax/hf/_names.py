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

from ..models import ROUTER_STATE, DecoderConfig
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

# multi-head latent attention (DeepSeek): the query through its latent (or directly), the keys and values' latent
_NORMS = _ATTENTION[:1] + _ATTENTION[-1:]
_LATENT_Q = (
    (("wq_a",), "self_attn.q_a_proj.weight", _LINEAR),
    (("q_latent_norm", "scale"), "self_attn.q_a_layernorm.weight", ((0,),)),
    (("wq_b",), "self_attn.q_b_proj.weight", ((1, 2), (0,))),
)
_DIRECT_Q = ((("wq",), "self_attn.q_proj.weight", ((1, 2), (0,))),)
_LATENT_KV = (
    (("wkv_a",), "self_attn.kv_a_proj_with_mqa.weight", _LINEAR),
    (("kv_latent_norm", "scale"), "self_attn.kv_a_layernorm.weight", ((0,),)),
    (("wkv_b",), "self_attn.kv_b_proj.weight", ((1, 2), (0,))),
    (("wo",), "self_attn.o_proj.weight", ((2,), (0, 1))),
)
_DEEPSEEK_SHARED = (
    (("moe", "shared_gate"), "mlp.shared_experts.gate_proj.weight", _LINEAR),
    (("moe", "shared_up"), "mlp.shared_experts.up_proj.weight", _LINEAR),
    (("moe", "shared_down"), "mlp.shared_experts.down_proj.weight", _LINEAR),
)

IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
"""Buffers some checkpoints carry that are not parameters (recomputed from the config)."""


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One parameter (or model state): its path in the state's tree, its Hugging Face name(s) and how its dims map.

    ``layers > 0``: the leaf stacks that many layers on a leading axis, the first being Hugging Face's layer
    ``first_layer``, and ``name`` holds ``{i}`` for the layer index. ``experts > 0``: the leaf has an ``experts``
    axis of that size (after the layers' when stacked) and ``name`` holds ``{j}`` for the expert index: one Hugging
    Face tensor per expert. ``shape``: the zjax shape of one stored tensor (per layer and per expert).
    ``collection``: ``"params"``, or the model state's collection the leaf lives in (``path`` starts with it);
    model state is stored in fp32 whatever the weights' dtype.
    """

    path: tuple[str, ...]
    name: str
    hf_dims: Layout
    shape: tuple[int, ...]
    layers: int = 0
    experts: int = 0
    first_layer: int = 0
    collection: str = "params"

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(self.shape[d] for d in group) for group in self.hf_dims)

    @property
    def leading(self) -> tuple[int, ...]:
        """The sizes of the leaf's axes that index stored tensors: the stacked layers, the experts."""
        return ((self.layers,) if self.layers else ()) + ((self.experts,) if self.experts else ())

    def name_at(self, index: tuple[int, ...]) -> str:
        """The Hugging Face name of the tensor at ``index`` over the :attr:`leading` axes."""
        if not index:
            return self.name
        i = index[0] + self.first_layer if self.layers else None
        j = index[-1] if self.experts else None
        return self.name.format(i=i, j=j)

    def indices(self) -> list[tuple[int, ...]]:
        """Every index over the :attr:`leading` axes, in file order (layer-major)."""
        return list(itertools.product(*(range(n) for n in self.leading)))

    def names(self) -> list[str]:
        return [self.name_at(index) for index in self.indices()]


def _layer_shapes(cfg: DecoderConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    e, h, kv, d, m = cfg.embed, cfg.heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp
    f = cfg.moe.expert_mlp(m) if cfg.moe is not None else m
    s = cfg.moe.shared_mlp if cfg.moe is not None else 0
    a = cfg.mla
    latent = {}
    if a is not None:
        latent = {
            ("wq_a",): (e, a.q_lora_rank or 0),
            ("q_latent_norm", "scale"): (a.q_lora_rank or 0,),
            ("wq_b",): (a.q_lora_rank or 0, h, a.qk_head_dim),
            ("wkv_a",): (e, a.kv_lora_rank + a.qk_rope_head_dim),
            ("kv_latent_norm", "scale"): (a.kv_lora_rank,),
            ("wkv_b",): (a.kv_lora_rank, h, a.qk_nope_head_dim + a.v_head_dim),
            ("wo",): (h, a.v_head_dim, e),
        }
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
        (ROUTER_STATE, "moe", "bias"): (cfg.moe.experts if cfg.moe is not None else 0,),
        **latent,
    }


def _per_layer(cfg: DecoderConfig, dense: bool) -> Iterator[tuple[tuple[str, ...], str, Layout, int]]:
    """``(path within the layer, Hugging Face name within the layer, hf_dims, experts)`` of each parameter of a
    layer (``dense``: one of the first dense layers of a mixture of experts); a router's selection bias (model
    state) has a path that starts with its collection."""
    if cfg.mla is None:
        attention = _ATTENTION + (_BIASES if cfg.qkv_bias else ()) + (_QK_NORMS if cfg.qk_norm else ())
    else:
        attention = _NORMS[:1] + (_LATENT_Q if cfg.mla.q_lora_rank else _DIRECT_Q) + _LATENT_KV + _NORMS[1:]
    for sub, name, dims in attention:
        yield sub, name, dims, 0
    if cfg.moe is None or dense:
        for sub, name, dims in _DENSE_MLP:
            yield sub, name, dims, 0
        return
    kind = model_type_of(cfg)
    router, experts = _MIXTRAL if kind == "mixtral" else _QWEN_MOE
    yield ("moe", "router"), router, _LINEAR, 0
    if cfg.moe.bias_update_rate is not None and kind == "deepseek_v3":
        yield (ROUTER_STATE, "moe", "bias"), "mlp.gate.e_score_correction_bias", ((0,),), 0
    for leaf, name in zip(("w_gate", "w_up", "w_down"), experts, strict=True):
        yield ("moe", leaf), name, _LINEAR, cfg.moe.experts
    if cfg.moe.shared_mlp:
        for sub, name, dims in _DEEPSEEK_SHARED if cfg.mla is not None else _SHARED:  # DeepSeek-V2/V3 (MLA)
            yield sub, name, dims, 0


def _at(stack: str, sub: tuple[str, ...]) -> tuple[str, ...]:
    """The path of a layer's leaf ``sub`` in the stack (or layer) ``stack``: model state's under its collection."""
    return (sub[0], stack, *sub[1:]) if sub[0] == ROUTER_STATE else (stack, *sub)


def tensors(cfg: DecoderConfig) -> Iterator[Tensor]:
    """Every parameter (and stored model state) of a :class:`~zjax.models.Decoder` of ``cfg``, in Hugging Face's
    file order."""
    yield Tensor(("embedding",), "model.embed_tokens.weight", ((0,), (1,)), (cfg.vocab, cfg.embed))
    shapes = _layer_shapes(cfg)
    k = cfg.dense_layers
    stacks = (
        (("dense_layers", 0, k, True), ("layers", k, cfg.layers - k, False))
        if k
        else (("layers", 0, cfg.layers, False),)
    )
    for stack, first, count, dense in stacks:
        for sub, name, dims, experts in _per_layer(cfg, dense):
            where = sub[0] if sub[0] == ROUTER_STATE else "params"
            if cfg.scan:
                yield Tensor(
                    _at(stack, sub), "model.layers.{i}." + name, dims, shapes[sub], count, experts, first, where
                )
                continue
            for i in range(first, first + count):  # the layer index is fixed; an expert's {j} stays for name_at
                yield Tensor(
                    _at(f"layer_{i}", sub), f"model.layers.{i}." + name, dims, shapes[sub], 0, experts, 0, where
                )
    yield Tensor(("final_norm", "scale"), "model.norm.weight", ((0,),), (cfg.embed,))
    if not cfg.tie_embeddings:
        yield Tensor(("head",), "lm_head.weight", ((1,), (0,)), (cfg.embed, cfg.vocab))
    yield from _mtp_tensors(cfg, shapes)


def _mtp_tensors(cfg: DecoderConfig, shapes: dict[tuple[str, ...], tuple[int, ...]]) -> Iterator[Tensor]:
    """DeepSeek-V3's multi-token prediction modules: layer ``layers + k`` of the files, with copies of the
    embedding table and the head (written from the decoder's, read from the decoder's own names)."""
    e = cfg.embed
    for k in range(cfg.mtp_layers):
        at, i = f"mtp_{k}", cfg.layers + k
        yield Tensor(("embedding",), f"model.layers.{i}.embed_tokens.weight", ((0,), (1,)), (cfg.vocab, e))
        own: tuple[tuple[tuple[str, ...], str, Layout, tuple[int, ...]], ...] = (
            (("embed_norm", "scale"), "enorm.weight", ((0,),), (e,)),
            (("hidden_norm", "scale"), "hnorm.weight", ((0,),), (e,)),
            (("w_proj",), "eh_proj.weight", _LINEAR, (2 * e, e)),
        )
        for sub, name, dims, shape in own:
            yield Tensor((at, *sub), f"model.layers.{i}.{name}", dims, shape)
        for sub, name, dims, experts in _per_layer(cfg.mtp_layer, dense=False):
            yield Tensor((at, "layer", *sub), f"model.layers.{i}.{name}", dims, shapes[sub], 0, experts)
        yield Tensor((at, "norm", "scale"), f"model.layers.{i}.shared_head.norm.weight", ((0,),), (e,))
        head = ("embedding",) if cfg.tie_embeddings else ("head",)
        yield Tensor(head, f"model.layers.{i}.shared_head.head.weight", ((1,), (0,)), (e, cfg.vocab))
