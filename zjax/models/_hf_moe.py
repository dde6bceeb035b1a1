"""The mixture-of-experts fields of Hugging Face configs (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3) <-> :class:`MoE`.

Mixtral's experts have the size ``intermediate_size``; the Qwen MoEs' ``moe_intermediate_size`` (their
``intermediate_size`` is a dense MLP's, used by no layer here: :class:`~zjax.models.DecoderConfig`'s
``mlp``, with ``MoE.mlp`` set when the two differ). ``router_aux_loss_coef`` is the load-balancing loss
weight (``MoE.load_balance_weight``; Hugging Face adds that loss only with ``output_router_logits``).

DeepSeek-V3 (``deepseek_v3``): ``n_routed_experts`` experts of ``moe_intermediate_size`` with sigmoid scores,
group-limited (``n_group``, ``topk_group``), scaled by ``routed_scaling_factor``, ``n_shared_experts`` shared ones
added ungated (one shared SwiGLU of ``n_shared_experts x moe_intermediate_size``), the selection bias
(``e_score_correction_bias``) moved by :data:`DEEPSEEK_BIAS_RATE` per step; the sequence-wise loss of weight
``aux_loss_alpha`` (:data:`DEEPSEEK_AUX_ALPHA` when absent), divided by ``top_k`` because zjax's per-sequence loss is
DeepSeek's times ``top_k``. The first ``first_k_dense_replace`` layers are dense (``DecoderConfig.dense_layers``).

DeepSeek-V2 (``deepseek_v2``, V2 and V2-Lite) is laid out alike, with softmax scores, no selection bias, and
``topk_method`` ``greedy`` (the top-k of all experts: V2-Lite) or ``group_limited_greedy`` (groups ranked by their
best score: V2); its ``routed_scaling_factor`` scales the gates only when ``norm_topk_prob`` is false (DeepSeek's
code), so a normalising V2 imports with ``routed_scale=1``.
"""

from __future__ import annotations

from typing import Any

from ._moe import MoE

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")
DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
_AUX_DEFAULT = 0.001  # router_aux_loss_coef's default in transformers' three configs
DEEPSEEK_BIAS_RATE = 1e-3
"""The selection biases' update rate of an imported DeepSeek-V3 (the paper's gamma for most of pre-training)."""
DEEPSEEK_AUX_ALPHA = 1e-4
"""The sequence-wise balance loss's weight alpha of DeepSeek-V3's paper (its config may say ``aux_loss_alpha``)."""


def unsupported(file: str, what: str) -> ValueError:
    """The error for a Hugging Face config setting ``what`` (named with its value) that the decoder lacks."""
    return ValueError(f"zjax.models: {file}: {what} is not supported by zjax's decoder.")


def moe_from_hf(hf: dict[str, Any], model_type: str, source: str, mlp: int) -> MoE:
    """The :class:`MoE` of a Hugging Face config of ``model_type`` (one of :data:`MOE_MODEL_TYPES`) whose
    ``intermediate_size`` is ``mlp``.

    Raises:
      ValueError: settings the decoder does not have (dense layers among the sparse ones, router jitter),
        or a missing field (``KeyError`` is the caller's to report).
    """
    if model_type in DEEPSEEK_MODEL_TYPES:
        return _deepseek_from_hf(hf, model_type, source, mlp)
    aux = float(hf.get("router_aux_loss_coef", _AUX_DEFAULT))
    if model_type == "mixtral":
        jitter = hf.get("router_jitter_noise") or 0.0
        if jitter:
            raise unsupported(
                source,
                f"router_jitter_noise={jitter} (multiplicative noise on the router's input in training); set it "
                "to 0.0 to train without it",
            )
        fields: dict[str, Any] = dict(experts=int(hf["num_local_experts"]), normalize_top_k=True)
    else:
        step = hf.get("decoder_sparse_step", 1)
        if step != 1:
            raise unsupported(
                source,
                f"decoder_sparse_step={step} (a mixture of experts in every {step}th layer only, dense MLPs "
                "between); zjax's decoder has one in every layer: decoder_sparse_step must be 1",
            )
        dense = hf.get("mlp_only_layers") or []
        if dense:
            raise unsupported(
                source,
                f"mlp_only_layers={dense} (dense MLPs in those layers); every layer of zjax's decoder is a "
                "mixture of experts: mlp_only_layers must be empty",
            )
        size = int(hf["moe_intermediate_size"])
        shared = int(hf["shared_expert_intermediate_size"]) if model_type == "qwen2_moe" else 0
        if model_type == "qwen2_moe" and shared < 1:
            raise unsupported(source, f"shared_expert_intermediate_size={shared} (a Qwen2-MoE's shared expert)")
        fields = dict(
            experts=int(hf["num_experts"]),
            mlp=None if size == mlp else size,
            normalize_top_k=bool(hf.get("norm_topk_prob", False)),
            shared_mlp=shared,
        )
    try:
        # Hugging Face's load_balancing_loss_func pools every layer's routers before it multiplies f by P
        return MoE(top_k=int(hf["num_experts_per_tok"]), load_balance_weight=aux, balance_loss="pooled", **fields)
    except ValueError as e:
        raise ValueError(f"zjax.models: {source}: {e}") from None


# model_type: ({topk_method: MoE.group_score, None for no groups}, scoring_func)
_DEEPSEEK_ROUTING: dict[str, tuple[dict[str, str | None], str]] = {
    "deepseek_v3": ({"noaux_tc": "top2"}, "sigmoid"),
    "deepseek_v2": ({"greedy": None, "group_limited_greedy": "max"}, "softmax"),
}


def _deepseek_from_hf(hf: dict[str, Any], model_type: str, source: str, mlp: int) -> MoE:
    methods, scoring = _DEEPSEEK_ROUTING[model_type]
    default_method = next(iter(methods))
    method = hf.get("topk_method", default_method)
    for name, value, want in (
        ("moe_layer_freq", hf.get("moe_layer_freq", 1), (1,)),
        ("topk_method", method, tuple(methods)),
        ("scoring_func", hf.get("scoring_func", scoring), (scoring,)),
    ):
        if value not in want:
            raise unsupported(source, f"{name}={value!r} ({model_type}'s decoder has {name} in {list(want)})")
    size, top_k = int(hf["moe_intermediate_size"]), int(hf["num_experts_per_tok"])
    v3 = model_type == "deepseek_v3"
    normalize = bool(hf.get("norm_topk_prob", v3))
    scale = float(hf.get("routed_scaling_factor", 1.0))
    grouped = methods[method] is not None
    try:
        return MoE(
            experts=int(hf["n_routed_experts"]),
            top_k=top_k,
            mlp=None if size == mlp else size,
            normalize_top_k=normalize,
            shared_mlp=int(hf.get("n_shared_experts") or 0) * size,
            shared_gate=False,
            scoring=scoring,
            routed_scale=scale if v3 or not normalize else 1.0,  # V2 scales unnormalised gates only
            groups=int(hf.get("n_group") or 1) if grouped else 1,
            top_groups=int(hf["topk_group"]) if grouped and hf.get("topk_group") else None,
            group_score=methods[method] or "top2",
            bias_update_rate=DEEPSEEK_BIAS_RATE if v3 else None,
            balance_loss="per-sequence",
            load_balance_weight=float(hf.get("aux_loss_alpha", DEEPSEEK_AUX_ALPHA)) / top_k,
        )
    except ValueError as e:
        raise ValueError(f"zjax.models: {source}: {e}") from None


def _deepseek_to_hf(moe: MoE, model_type: str, mlp: int, refuse: Any) -> dict[str, Any]:
    size = moe.expert_mlp(mlp)
    methods, scoring = _DEEPSEEK_ROUTING[model_type]
    if moe.scoring != scoring or moe.shared_gate and moe.shared_mlp or moe.shared_mlp % size:
        raise refuse(
            f"scoring={moe.scoring!r}, shared_gate={moe.shared_gate}, shared_mlp={moe.shared_mlp}: {model_type} "
            f"scores by {scoring} and adds its shared experts ungated, each of the routed experts' size ({size})"
        )
    group_score = moe.group_score if moe.groups > 1 else None
    # one group is any method's top-k of all experts (V3's noaux_tc with n_group=1)
    method = [m for m, g in methods.items() if g == group_score or (group_score is None and g == "top2")]
    if not method:
        ranks = "their best score" if model_type == "deepseek_v2" else "the sum of their two best"
        raise refuse(f"groups={moe.groups}, group_score={moe.group_score!r}: {model_type} ranks groups by {ranks}")
    v3 = model_type == "deepseek_v3"
    if not v3 and (moe.normalize_top_k and moe.routed_scale != 1.0 or moe.bias_update_rate is not None):
        raise refuse(
            f"routed_scale={moe.routed_scale} with normalize_top_k, bias_update_rate={moe.bias_update_rate}: "
            "DeepSeek-V2 scales only unnormalised gates and has no selection bias"
        )
    return {
        "moe_intermediate_size": size,
        "n_routed_experts": moe.experts,
        "n_shared_experts": moe.shared_mlp // size,
        "num_experts_per_tok": moe.top_k,
        "norm_topk_prob": moe.normalize_top_k,
        "routed_scaling_factor": moe.routed_scale,
        "n_group": moe.groups,
        "topk_group": moe.routed_groups,
        "topk_method": method[0],
        "scoring_func": scoring,
        "moe_layer_freq": 1,
        "aux_loss_alpha": moe.load_balance_weight * moe.top_k,
        "seq_aux": moe.balance_loss == "per-sequence",
    }


def moe_to_hf(moe: MoE, model_type: str, mlp: int) -> dict[str, Any]:
    """The Hugging Face config fields of ``moe`` in a ``model_type`` config whose decoder's ``mlp`` is ``mlp``
    (the inverse of :func:`moe_from_hf`; Mixtral's ``intermediate_size`` is the experts' size).

    Raises:
      ValueError: ``moe`` has what ``model_type`` cannot express (named).
    """

    def refuse(what: str) -> ValueError:
        return ValueError(f"zjax.models: MoE({what}) cannot be written as model_type {model_type!r}.")

    if model_type in DEEPSEEK_MODEL_TYPES:
        return _deepseek_to_hf(moe, model_type, mlp, refuse)
    common = {
        "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.load_balance_weight,
        "output_router_logits": False,
    }
    if model_type == "mixtral":
        if not moe.normalize_top_k:
            raise refuse("normalize_top_k=False: Mixtral always renormalizes the top-k probabilities")
        if moe.shared_mlp:
            raise refuse(f"shared_mlp={moe.shared_mlp}: Mixtral has no shared expert (Qwen2-MoE has)")
        return {
            "intermediate_size": moe.expert_mlp(mlp),
            "num_local_experts": moe.experts,
            "router_jitter_noise": 0.0,
            **common,
        }
    if (model_type == "qwen2_moe") != bool(moe.shared_mlp):
        raise refuse(f"shared_mlp={moe.shared_mlp}: a Qwen2-MoE has a shared expert (shared_mlp > 0), a Qwen3-MoE none")
    out = {
        "intermediate_size": mlp,
        "moe_intermediate_size": moe.expert_mlp(mlp),
        "num_experts": moe.experts,
        "norm_topk_prob": moe.normalize_top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        **common,
    }
    if moe.shared_mlp:
        out["shared_expert_intermediate_size"] = moe.shared_mlp
    return out
