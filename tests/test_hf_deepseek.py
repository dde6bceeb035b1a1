"""DeepSeek-V3 and V2 checkpoints: the configs (671.0B parameters from DeepSeek-V3's published ``config.json``,
15.7B from V2-Lite's, 235.7B from V2's), the names and layouts of multi-head latent attention, the first dense
layers, routing (V3: sigmoid, group-limited by each group's two best, with its selection bias; V2: softmax, greedy
or group-limited by each group's best) and the shared experts, in and out, against a NumPy transcription of
DeepSeek's modeling code (V3 as Hugging Face's ``modeling_deepseek_v3``; transformers' DeepSeek models are
PyTorch-only) run on the tensors of the file itself."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import ml_dtypes
import numpy as np
import optax
import pytest

import zjax
from zjax.models import config_from_hf, config_to_hf, from_hf_config, lm_loss

from ._hf_models import read_checkpoint, write_checkpoint

# DeepSeek-V3's published config.json (the fields that shape the model)
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "aux_loss_alpha": 0.001, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip
QWEN3_235B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096,
    "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94, "num_attention_heads": 64,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "hidden_act": "silu",
    "router_aux_loss_coef": 0.001,
}  # fmt: skip

# DeepSeek-V2-Lite's and DeepSeek-V2's published config.json (the fields that shape the model)
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "attention_bias": False,
    "aux_loss_alpha": 0.001, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 1408,
    "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False,
    "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "v_head_dim": 128, "vocab_size": 102400,
}  # fmt: skip
DEEPSEEK_V2 = {
    **DEEPSEEK_V2_LITE, "aux_loss_alpha": 0.003, "hidden_size": 5120, "intermediate_size": 12288,
    "moe_intermediate_size": 1536, "n_group": 8, "n_routed_experts": 160, "num_attention_heads": 128,
    "num_key_value_heads": 128, "num_hidden_layers": 60, "q_lora_rank": 1536, "routed_scaling_factor": 16.0,
    "topk_group": 3, "topk_method": "group_limited_greedy",
}  # fmt: skip

TINY = {
    **{k: v for k, v in DEEPSEEK_V3.items() if k not in ("quantization_config",)},
    "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 3,
    "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 24,
    "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 8,
    "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2, "vocab_size": 96, "max_position_embeddings": 64,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}  # fmt: skip
TINY_V2 = {  # V2's group-limited greedy routing (groups by their best), unnormalised gates scaled, queries direct
    **TINY, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "scoring_func": "softmax",
    "topk_method": "group_limited_greedy", "norm_topk_prob": False, "routed_scaling_factor": 1.5, "q_lora_rank": None,
    "rope_scaling": {**TINY["rope_scaling"], "mscale": 0.707, "mscale_all_dim": 0.707},
}  # fmt: skip
TINY_V2_LITE = {**TINY_V2, "topk_method": "greedy", "n_group": 1, "topk_group": 1}


def test_published_configs_build_the_published_parameter_counts():
    """DeepSeek-V3: 671.0B (MTP aside, as DeepSeek counts it), 37.6B active; Qwen3-235B-A22B: 235.1B, 22.2B
    active; DeepSeek-V2-Lite 15.7B and V2 235.7B (DeepSeek's 16B and 236B). Each round-trips through config_to_hf."""
    v3, qwen = config_from_hf(DEEPSEEK_V3), config_from_hf(QWEN3_235B)
    lite, v2 = config_from_hf(DEEPSEEK_V2_LITE), config_from_hf(DEEPSEEK_V2)
    assert round(lite.num_params / 1e9, 1) == 15.7 and round(v2.num_params / 1e9, 1) == 235.7
    assert (lite.moe.scoring, lite.moe.groups, lite.mla.q_lora_rank, lite.moe.routed_scale) == ("softmax", 1, None, 1)
    assert (v2.moe.groups, v2.moe.routed_groups, v2.moe.group_score, v2.moe.routed_scale) == (8, 3, "max", 16.0)
    assert lite.moe.bias_update_rate is None and not lite.moe.normalize_top_k and v2.dense_layers == 1
    for cfg in (lite, v2):
        assert config_from_hf(config_to_hf(cfg)) == cfg and config_to_hf(cfg)["model_type"] == "deepseek_v2"
    assert round(v3.num_params / 1e9, 1) == 671.0 and round(v3.num_active_params / 1e9, 1) == 37.6
    assert round(qwen.num_params / 1e9, 1) == 235.1 and round(qwen.num_active_params / 1e9, 1) == 22.2
    assert v3.dense_layers == 3 and v3.mla.q_lora_rank == 1536 and v3.head_dim == 192
    assert v3.softmax_scale == pytest.approx((0.1 * math.log(40) + 1) ** 2 / math.sqrt(192))
    moe = v3.moe
    assert (moe.experts, moe.top_k, moe.groups, moe.routed_groups, moe.shared_mlp) == (256, 8, 8, 4, 2048)
    assert moe.scoring == "sigmoid" and not moe.shared_gate and moe.routed_scale == 2.5
    assert moe.load_balance_weight == pytest.approx(0.001 / 8)  # zjax's per-sequence loss is DeepSeek's x top_k
    for cfg in (v3, qwen):
        assert config_from_hf(config_to_hf(cfg)) == cfg


def hf_tensors(hf: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under DeepSeek's names and ``[out, in]`` layouts (bf16; V3's selection biases fp32)."""
    rng = np.random.default_rng(seed)
    e, v, h = hf["hidden_size"], hf["vocab_size"], hf["num_attention_heads"]
    qk, nope_v = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"], hf["qk_nope_head_dim"] + hf["v_head_dim"]
    f, experts = hf["moe_intermediate_size"], hf["n_routed_experts"]

    def w(*shape, scale=0.2):
        return (rng.normal(size=shape) * scale).astype(ml_dtypes.bfloat16)

    def norm(n):
        return (1.0 + rng.normal(size=n) * 0.1).astype(ml_dtypes.bfloat16)

    out = {"model.embed_tokens.weight": w(v, e, scale=1.0), "model.norm.weight": norm(e), "lm_head.weight": w(v, e)}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": norm(e),
            p + "post_attention_layernorm.weight": norm(e),
            p + "self_attn.kv_a_proj_with_mqa.weight": w(hf["kv_lora_rank"] + hf["qk_rope_head_dim"], e),
            p + "self_attn.kv_a_layernorm.weight": norm(hf["kv_lora_rank"]),
            p + "self_attn.kv_b_proj.weight": w(h * nope_v, hf["kv_lora_rank"]),
            p + "self_attn.o_proj.weight": w(e, h * hf["v_head_dim"]),
        }
        if hf["q_lora_rank"]:
            out[p + "self_attn.q_a_proj.weight"] = w(hf["q_lora_rank"], e)
            out[p + "self_attn.q_a_layernorm.weight"] = norm(hf["q_lora_rank"])
            out[p + "self_attn.q_b_proj.weight"] = w(h * qk, hf["q_lora_rank"])
        else:  # DeepSeek-V2-Lite: the queries directly
            out[p + "self_attn.q_proj.weight"] = w(h * qk, e)
        if i < hf["first_k_dense_replace"]:
            m = hf["intermediate_size"]
            out |= {p + "mlp.gate_proj.weight": w(m, e), p + "mlp.up_proj.weight": w(m, e)}
            out[p + "mlp.down_proj.weight"] = w(e, m)
            continue
        out[p + "mlp.gate.weight"] = w(experts, e, scale=1.0)
        if hf["model_type"] == "deepseek_v3":
            out[p + "mlp.gate.e_score_correction_bias"] = (rng.normal(size=experts) * 0.3).astype(np.float32)
        shared = hf["n_shared_experts"] * f
        for name, size in [(f"mlp.experts.{j}.", f) for j in range(experts)] + [("mlp.shared_experts.", shared)]:
            out |= {p + name + "gate_proj.weight": w(size, e), p + name + "up_proj.weight": w(size, e)}
            out[p + name + "down_proj.weight"] = w(e, size)
    return out


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _silu(x):
    return x / (1 + np.exp(-x))


def _rotate_interleaved(x, positions, inv_freq, factor):
    """``apply_rotary_pos_emb_interleave``: the pairs ``(x[2i], x[2i+1])`` rotated by ``positions x inv_freq``."""
    angle = positions[:, None] * inv_freq[None]  # [s, d/2]
    cos, sin = np.cos(angle)[None, :, None] * factor, np.sin(angle)[None, :, None] * factor
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    return out


def numpy_loss(hf: dict, t: dict[str, np.ndarray], tokens: np.ndarray, inv_freq, factor: float) -> float:
    """DeepSeek's forward (Hugging Face's DeepseekV3ForCausalLM; for a V2 config, DeepSeek-V2's ``MoEGate``) and
    mean next-token loss, in float64 (RoPE's inverse frequencies and YaRN's attention factor given: YaRN's own
    test is in tests/test_hf.py)."""
    t = {k: np.asarray(v, np.float64) for k, v in t.items()}
    eps, h = hf["rms_norm_eps"], hf["num_attention_heads"]
    nope, rope, vd = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
    s = tokens.shape[1] - 1
    x = t["model.embed_tokens.weight"][tokens[:, :-1]]
    positions = np.arange(s, dtype=np.float64)
    scale = (nope + rope) ** -0.5 * (0.1 * hf["rope_scaling"]["mscale_all_dim"] * math.log(4.0) + 1) ** 2
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        y = _rms(x, t[p + "input_layernorm.weight"], eps)
        if hf["q_lora_rank"]:
            q_latent = _rms(y @ t[p + "self_attn.q_a_proj.weight"].T, t[p + "self_attn.q_a_layernorm.weight"], eps)
            q = (q_latent @ t[p + "self_attn.q_b_proj.weight"].T).reshape(*y.shape[:2], h, nope + rope)
        else:
            q = (y @ t[p + "self_attn.q_proj.weight"].T).reshape(*y.shape[:2], h, nope + rope)
        kv_a = y @ t[p + "self_attn.kv_a_proj_with_mqa.weight"].T
        latent = _rms(kv_a[..., : hf["kv_lora_rank"]], t[p + "self_attn.kv_a_layernorm.weight"], eps)
        kv = (latent @ t[p + "self_attn.kv_b_proj.weight"].T).reshape(*y.shape[:2], h, nope + vd)
        q_rot = _rotate_interleaved(q[..., nope:], positions, inv_freq, factor)
        k_rot = _rotate_interleaved(kv_a[..., None, hf["kv_lora_rank"] :], positions, inv_freq, factor)
        query = np.concatenate([q[..., :nope], q_rot], -1)
        key = np.concatenate([kv[..., :nope], np.broadcast_to(k_rot, (*kv.shape[:3], rope))], -1)
        logits = np.einsum("bqhd,bkhd->bhqk", query, key) * scale
        logits = np.where(np.tril(np.ones((s, s), bool)), logits, -np.inf)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("bhqk,bkhd->bqhd", probs, kv[..., nope:]).reshape(*y.shape[:2], h * vd)
        x = x + attn @ t[p + "self_attn.o_proj.weight"].T
        y = _rms(x, t[p + "post_attention_layernorm.weight"], eps)

        def mlp(z, prefix):
            return (_silu(z @ t[prefix + "gate_proj.weight"].T) * (z @ t[prefix + "up_proj.weight"].T)) @ t[
                prefix + "down_proj.weight"
            ].T

        if i < hf["first_k_dense_replace"]:
            x = x + mlp(y, p + "mlp.")
            continue
        flat = y.reshape(-1, y.shape[-1])
        logits = flat @ t[p + "mlp.gate.weight"].T
        method = hf["topk_method"]
        if method == "noaux_tc":  # V3: sigmoid, biased choice, groups by the sum of their two best, -inf outside
            scores = 1 / (1 + np.exp(-logits))
            choice = scores + t[p + "mlp.gate.e_score_correction_bias"]
        else:  # V2: softmax, groups by their best, 0.0 outside
            scores = np.exp(logits - logits.max(-1, keepdims=True))
            choice = scores = scores / scores.sum(-1, keepdims=True)
        if method != "greedy":
            groups = choice.reshape(len(flat), hf["n_group"], -1)
            group_score = np.sort(groups, -1)[..., -2:].sum(-1) if method == "noaux_tc" else groups.max(-1)
            kept = np.argsort(-group_score, -1)[:, : hf["topk_group"]]
            allowed = np.zeros_like(group_score, bool)
            np.put_along_axis(allowed, kept, True, -1)
            outside = -np.inf if method == "noaux_tc" else 0.0
            choice = np.where(np.repeat(allowed, groups.shape[-1], -1), choice, outside)
        top = np.argsort(-choice, -1)[:, : hf["num_experts_per_tok"]]
        weights = np.take_along_axis(scores, top, -1)
        if method == "noaux_tc":
            weights = weights / weights.sum(-1, keepdims=True) * hf["routed_scaling_factor"]
        elif hf["norm_topk_prob"]:  # V2: normalised, or scaled
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        else:
            weights = weights * hf["routed_scaling_factor"]
        routed = np.zeros_like(flat)
        for r in range(len(flat)):
            for k, j in enumerate(top[r]):
                routed[r] += weights[r, k] * mlp(flat[r], p + f"mlp.experts.{j}.")
        x = x + routed.reshape(y.shape) + mlp(y, p + "mlp.shared_experts.")
    logits = _rms(x, t["model.norm.weight"], eps) @ t["lm_head.weight"].T
    logits = logits - logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return float(-np.mean(np.take_along_axis(logp, tokens[:, 1:, None], -1)))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("deepseek")
    return write_checkpoint(str(directory / "v3"), TINY, hf_tensors(TINY), files=3)


@pytest.mark.slow  # two compiles each; the fast suite checks the configs and V3's checkpoint path
@pytest.mark.parametrize("hf", [TINY_V2, TINY_V2_LITE], ids=["v2", "v2-lite"])
def test_deepseek_v2_loads_computes_its_loss_and_saves_back_bitwise(hf, tmp_path):
    """DeepSeek-V2 (group-limited greedy: groups ranked by their best score; unnormalised gates times the routed
    scale; queries without a latent) and V2-Lite (greedy over all experts) at dp=2 x ep=4, stage 3, fp32: the
    loss is the NumPy transcription's on the file's tensors; a bf16 save is the import bit for bit."""
    directory = write_checkpoint(str(tmp_path / "v2"), hf, hf_tensors(hf, seed=2), files=2)
    model = from_hf_config(directory)
    plan = zjax.Plan(zjax.make_mesh(dp=2, ep=4), stage=3, precision="fp32")
    state = zjax.hf.load(directory, plan, model, optax.sgd(0.0))
    tokens = np.random.default_rng(3).integers(0, hf["vocab_size"], (8, 17)).astype(np.int32)
    _, metrics = plan.train_step(lambda p, b: lm_loss(model, p, b))(state, plan.shard_batch(tokens))
    cfg = model.cfg
    want = numpy_loss(hf, read_checkpoint(directory), tokens, cfg.rope_frequencies(), cfg.rope_attention_factor)
    assert abs(float(metrics["aux"]["ce"]) - want) <= 1e-4 * want, (float(metrics["aux"]["ce"]), want)
    bf16 = zjax.Plan(zjax.make_mesh(dp=2, ep=4), stage=3, precision="bf16")
    out = zjax.hf.save(tmp_path / "out", model, zjax.hf.load(directory, bf16, model, optax.sgd(0.0)))
    want_t, got_t = read_checkpoint(directory), read_checkpoint(out)
    assert sorted(got_t) == sorted(want_t)
    assert all(np.array_equal(got_t[n], x) and got_t[n].dtype == x.dtype for n, x in want_t.items())
    assert config_from_hf(json.loads((tmp_path / "out" / "config.json").read_text())) == cfg


def test_loss_equals_hugging_faces_deepseek_v3_on_the_files_tensors(checkpoint):
    """Stage 3, fp32, experts split over ep: the loaded model's cross-entropy is the NumPy transcription's on the
    same tensors (the selection bias moves which experts a token reaches). With heads over tp too, against
    transformers' PyTorch model: tests/test_hf_reference.py."""
    model = from_hf_config(checkpoint)
    plan = zjax.Plan(zjax.make_mesh(dp=2, ep=4), stage=3, precision="fp32")
    state = zjax.hf.load(checkpoint, plan, model, optax.sgd(0.0))
    tokens = np.random.default_rng(1).integers(0, TINY["vocab_size"], (8, 17)).astype(np.int32)
    step = plan.train_step(lambda p, b, model_state: lm_loss(model, p, b, model_state))
    _, metrics = step(state, plan.shard_batch(tokens))
    cfg = model.cfg
    want = numpy_loss(TINY, read_checkpoint(checkpoint), tokens, cfg.rope_frequencies(), cfg.rope_attention_factor)
    assert abs(float(metrics["aux"]["ce"]) - want) <= 1e-4 * want, (float(metrics["aux"]["ce"]), want)


def test_export_is_bitwise_the_import(checkpoint, tmp_path):
    """bf16 weights and the fp32 selection biases written back bit for bit, the config round-tripped."""
    model = from_hf_config(checkpoint)
    plan = zjax.Plan(zjax.make_mesh(dp=2, ep=4), stage=3, precision="bf16")
    state = zjax.hf.load(checkpoint, plan, model, optax.sgd(0.0))
    bias = state.model_state["router"]["layers"]["moe"]["bias"]
    assert bias.shape == (2, 8)
    out = zjax.hf.save(tmp_path / "out", model, state, max_shard_size=20_000)
    want, got = read_checkpoint(checkpoint), read_checkpoint(out)
    assert sorted(got) == sorted(want)
    for name, x in want.items():
        assert got[name].dtype == x.dtype and np.array_equal(got[name], x), name
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config_from_hf(saved) == model.cfg


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("topk_method", "greedy", "topk_method='greedy'"),
        ("scoring_func", "softmax", "scoring_func='softmax'"),
        ("moe_layer_freq", 2, "moe_layer_freq=2"),
        ("num_key_value_heads", 2, "num_key_value_heads=2"),
        ("topk_group", 5, "top_groups=5"),
    ],
)
def test_unsupported_deepseek_settings_are_named(field, value, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf({**TINY, field: value})


def mtp_tensors(hf: dict, tensors: dict[str, np.ndarray], seed: int = 1) -> dict[str, np.ndarray]:
    """DeepSeek-V3's MTP module as the files hold it: layer ``num_hidden_layers`` (an expert layer whose router has
    no selection bias in zjax), its norms and projection, and copies of the embedding table and the head."""
    i, e = hf["num_hidden_layers"], hf["hidden_size"]
    deeper = hf_tensors({**hf, "num_hidden_layers": i + 1}, seed)
    out = {k: v for k, v in deeper.items() if k.startswith(f"model.layers.{i}.") and "e_score_correction" not in k}
    rng = np.random.default_rng(seed)
    out |= {
        f"model.layers.{i}.enorm.weight": (1 + rng.normal(size=e) * 0.1).astype(ml_dtypes.bfloat16),
        f"model.layers.{i}.hnorm.weight": (1 + rng.normal(size=e) * 0.1).astype(ml_dtypes.bfloat16),
        f"model.layers.{i}.eh_proj.weight": (rng.normal(size=(e, 2 * e)) * 0.2).astype(ml_dtypes.bfloat16),
        f"model.layers.{i}.shared_head.norm.weight": (1 + rng.normal(size=e) * 0.1).astype(ml_dtypes.bfloat16),
        f"model.layers.{i}.embed_tokens.weight": tensors["model.embed_tokens.weight"],
        f"model.layers.{i}.shared_head.head.weight": tensors["lm_head.weight"],
    }
    return out


def test_the_multi_token_prediction_layer_reads_and_writes_or_is_skipped(checkpoint, tmp_path):
    """DeepSeek-V3's files hold its MTP module as layer num_hidden_layers (here 3): a model with mtp_layers=1 reads
    it (its projection is eh_proj's transpose) and writes it back bit for bit with the embedding and head copies; a
    model without MTP skips it, as Hugging Face's does; a layer past the MTP ones is an unexpected tensor."""
    tensors = read_checkpoint(checkpoint)
    src = write_checkpoint(str(tmp_path / "mtp"), TINY, {**tensors, **mtp_tensors(TINY, tensors)})
    plan = zjax.Plan(zjax.make_mesh(dp=2, ep=4), stage=3, precision="bf16")
    model = from_hf_config(src, mtp_layers=1)
    state = zjax.hf.load(src, plan, model, optax.sgd(0.0))
    proj = np.asarray(state.opt_state.master["mtp_0"]["w_proj"])
    assert np.array_equal(proj, read_checkpoint(src)["model.layers.3.eh_proj.weight"].astype(np.float32).T)
    out = zjax.hf.save(tmp_path / "out", model, state)
    want, got = read_checkpoint(src), read_checkpoint(out)
    assert sorted(got) == sorted(want)
    for name, x in want.items():
        assert got[name].dtype == x.dtype and np.array_equal(got[name], x), name
    plain = zjax.hf.load(src, plan, from_hf_config(src), optax.sgd(0.0))
    assert "mtp_0" not in plain.params
    with pytest.raises(ValueError, match="mtp_layers=2 but .*num_nextn_predict_layers=1"):
        zjax.hf.load(src, plan, from_hf_config(src, mtp_layers=2), optax.sgd(0.0))
    beyond = write_checkpoint(str(tmp_path / "beyond"), TINY, {**tensors, "model.layers.4.enorm.weight": np.ones(32)})
    with pytest.raises(ValueError, match=r"1 unexpected \['model.layers.4.enorm.weight'\]"):
        zjax.hf.load(beyond, plan, from_hf_config(beyond), optax.sgd(0.0))


def _block_quantized(x: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V3's fp8 layout: e4m3 values and one fp32 factor per ``block`` (its amax over 448; partial blocks
    at the edges), ``values x factor`` the weight."""
    x = np.asarray(x, np.float32)
    rows, cols = -(-x.shape[0] // block[0]), -(-x.shape[1] // block[1])
    factors = np.ones((rows, cols), np.float32)
    for i in range(rows):
        for j in range(cols):
            tile = x[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            factors[i, j] = max(np.abs(tile).max(), 1e-12) / 448.0
    expanded = np.repeat(np.repeat(factors, block[0], 0), block[1], 1)[: x.shape[0], : x.shape[1]]
    return (x / expanded).astype(ml_dtypes.float8_e4m3fn), factors


def test_an_fp8_checkpoint_is_dequantised_by_its_block_scales(tmp_path):
    """The published checkpoint's layout (fp8 projections, ``_scale_inv`` per block; blocks of 16 here, partial at
    the edges): the loaded weights are exactly each value times its block's factor, as a bf16 conversion of the
    same files would hold them; a weight without its scales is named."""
    block = (16, 16)
    tensors = hf_tensors(TINY)
    quantized, dequantized = {}, {}
    for name, x in tensors.items():
        if name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight"):
            q, factors = _block_quantized(x, block)
            quantized |= {name: q, name + "_scale_inv": factors}
            expanded = np.repeat(np.repeat(factors, block[0], 0), block[1], 1)[: x.shape[0], : x.shape[1]]
            dequantized[name] = q.astype(np.float32) * expanded
        else:
            quantized[name] = dequantized[name] = np.asarray(x, np.float32)
    fp8_config = {**TINY, "quantization_config": {**DEEPSEEK_V3["quantization_config"], "weight_block_size": block}}
    fp8_dir = write_checkpoint(str(tmp_path / "fp8"), fp8_config, quantized, files=2)
    plain_dir = write_checkpoint(str(tmp_path / "fp32"), TINY, dequantized)
    model = from_hf_config(plain_dir)
    plan = zjax.Plan(zjax.make_mesh(dp=2, ep=4), stage=3, precision="fp32")
    got = jax.device_get(zjax.hf.load(fp8_dir, plan, model, optax.sgd(0.0)).params)
    want = jax.device_get(zjax.hf.load(plain_dir, plan, model, optax.sgd(0.0)).params)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    assert not hasattr(np, "float8_e4m3fn") or np.float8_e4m3fn is ml_dtypes.float8_e4m3fn  # NumPy left as it was
    del quantized["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    broken = write_checkpoint(str(tmp_path / "broken"), fp8_config, quantized)
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.o_proj.weight' in .* is fp8 without its block "
                                         r"scales 'model.layers.0.self_attn.o_proj.weight_scale_inv'"):  # fmt: skip
        zjax.hf.load(broken, plan, model, optax.sgd(0.0))


def test_a_checkpoint_loads_into_a_model_with_fp8_delayed_scaling(checkpoint):
    """The histories no file holds start empty beside the routers' biases the files hold."""
    model = from_hf_config(checkpoint)
    model = type(model)(dataclasses.replace(model.cfg, matmul="fp8-delayed"))
    plan = zjax.Plan(zjax.make_mesh(dp=2, ep=4), stage=1, precision="bf16")
    state = zjax.hf.load(checkpoint, plan, model, optax.sgd(0.0))
    histories = jax.device_get(state.model_state[zjax.fp8.COLLECTION])
    assert histories["layers"]["wo"].shape == (2, 3, zjax.fp8.HISTORY) and not any(
        np.any(h) for h in jax.tree.leaves(histories)
    )
    bias = jax.device_get(state.model_state["router"]["layers"]["moe"]["bias"])
    files = read_checkpoint(checkpoint)
    np.testing.assert_array_equal(bias[0], files["model.layers.1.mlp.gate.e_score_correction_bias"])
