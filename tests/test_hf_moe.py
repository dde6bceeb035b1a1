"""Mixtral, Qwen2-MoE and Qwen3-MoE checkpoints: configs, names and layouts in and out, against a NumPy reference
of Hugging Face's sparse MoE blocks (PyTorch-only in transformers) run on the tensors of the file itself."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import zjax
from zjax.models import DecoderConfig, MoE, MoELayer, config_from_hf, config_to_hf, from_hf_config, lm_loss

from ._hf_models import read_checkpoint, write_checkpoint

TX = optax.adamw(1e-3)
EXPERTS = 8
_BASE = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    hidden_act="silu",
    tie_word_embeddings=False,
    num_experts_per_tok=2,
    router_aux_loss_coef=0.02,
)
CONFIGS = {
    "mixtral": {**_BASE, "model_type": "mixtral", "intermediate_size": 24, "num_local_experts": EXPERTS,
                "sliding_window": None},
    "qwen2_moe": {**_BASE, "model_type": "qwen2_moe", "intermediate_size": 40, "moe_intermediate_size": 16,
                  "shared_expert_intermediate_size": 20, "num_experts": EXPERTS, "num_experts_per_tok": 3,
                  "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "qwen3_moe": {**_BASE, "model_type": "qwen3_moe", "intermediate_size": 40, "moe_intermediate_size": 16,
                  "num_experts": EXPERTS, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
}  # fmt: skip
# Hugging Face's names within a layer: router, and each expert's (gate, up, down)
MOE_NAMES = {
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{j}.w1.weight",
                "block_sparse_moe.experts.{j}.w3.weight", "block_sparse_moe.experts.{j}.w2.weight"),
    "qwen2_moe": ("mlp.gate.weight", "mlp.experts.{j}.gate_proj.weight", "mlp.experts.{j}.up_proj.weight",
                  "mlp.experts.{j}.down_proj.weight"),
}  # fmt: skip
MOE_NAMES["qwen3_moe"] = MOE_NAMES["qwen2_moe"]
SHARED = ("gate_proj", "up_proj", "down_proj")


def hf_tensors(hf: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under Hugging Face's names and ``[out, in]`` layouts, written from the modeling files."""
    rng = np.random.default_rng(seed)
    kind, e, v = hf["model_type"], hf["hidden_size"], hf["vocab_size"]
    h, kv, d = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    f = hf.get("moe_intermediate_size", hf["intermediate_size"])

    def w(*shape, scale=0.2):
        return (rng.normal(size=shape) * scale).astype(np.float32)

    def norm(n):
        return (1.0 + rng.normal(size=n) * 0.1).astype(np.float32)

    out = {"model.embed_tokens.weight": w(v, e, scale=1.0), "model.norm.weight": norm(e), "lm_head.weight": w(v, e)}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": norm(e), p + "post_attention_layernorm.weight": norm(e)}
        for proj, rows in (("q", h * d), ("k", kv * d), ("v", kv * d)):
            out[p + f"self_attn.{proj}_proj.weight"] = w(rows, e)
            if kind == "qwen2_moe":
                out[p + f"self_attn.{proj}_proj.bias"] = w(rows)
        out[p + "self_attn.o_proj.weight"] = w(e, h * d)
        if kind == "qwen3_moe":
            out |= {p + "self_attn.q_norm.weight": norm(d), p + "self_attn.k_norm.weight": norm(d)}
        router, gate, up, down = MOE_NAMES[kind]
        out[p + router] = w(EXPERTS, e, scale=1.0)  # spread-out router probabilities: no near-ties in top-k
        for j in range(EXPERTS):
            out |= {p + gate.format(j=j): w(f, e), p + up.format(j=j): w(f, e), p + down.format(j=j): w(e, f)}
        if kind == "qwen2_moe":
            s = hf["shared_expert_intermediate_size"]
            out |= {p + "mlp.shared_expert.gate_proj.weight": w(s, e), p + "mlp.shared_expert.up_proj.weight": w(s, e)}
            out |= {p + "mlp.shared_expert.down_proj.weight": w(e, s), p + "mlp.shared_expert_gate.weight": w(1, e)}
    return out


def _silu(x):
    return x / (1.0 + np.exp(-x))


def hf_sparse_moe(x: np.ndarray, t: dict[str, np.ndarray], hf: dict, layer: int) -> np.ndarray:
    """transformers' ``MixtralSparseMoeBlock`` / ``Qwen2MoeSparseMoeBlock`` forward (Qwen3-MoE's is Qwen2's without
    the shared expert) of ``x [tokens, hidden]``, in float64: route, top-k, renormalize or not, loop over experts,
    shared expert behind its sigmoid gate."""
    kind, k = hf["model_type"], hf["num_experts_per_tok"]
    p = f"model.layers.{layer}."
    router, gate, up, down = MOE_NAMES[kind]
    x = x.astype(np.float64)
    logits = x @ t[p + router].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1)[:, :k]
    weights = np.take_along_axis(probs, chosen, -1)
    if kind == "mixtral" or hf["norm_topk_prob"]:
        weights /= weights.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for j in range(EXPERTS):
        rows, slot = np.nonzero(chosen == j)
        h = x[rows]
        y = (_silu(h @ t[p + gate.format(j=j)].T) * (h @ t[p + up.format(j=j)].T)) @ t[p + down.format(j=j)].T
        np.add.at(out, rows, y * weights[rows, slot, None])
    if kind == "qwen2_moe":
        g, u, dn = (t[p + f"mlp.shared_expert.{n}.weight"] for n in SHARED)
        shared = (_silu(x @ g.T) * (x @ u.T)) @ dn.T
        out += 1.0 / (1.0 + np.exp(-(x @ t[p + "mlp.shared_expert_gate.weight"].T))) * shared
    return out


def by_hand(hf: dict, t: dict[str, np.ndarray]) -> dict:
    """The zjax params tree (scanned) of Hugging Face tensors ``t``, written out leaf by leaf."""
    kind, e = hf["model_type"], hf["hidden_size"]
    h, kv, d = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    router, gate, up, down = MOE_NAMES[kind]

    def layer(i):
        p = f"model.layers.{i}."
        out = {
            "attn_norm": {"scale": t[p + "input_layernorm.weight"]},
            "mlp_norm": {"scale": t[p + "post_attention_layernorm.weight"]},
            "wq": t[p + "self_attn.q_proj.weight"].T.reshape(e, h, d),
            "wk": t[p + "self_attn.k_proj.weight"].T.reshape(e, kv, d),
            "wv": t[p + "self_attn.v_proj.weight"].T.reshape(e, kv, d),
            "wo": t[p + "self_attn.o_proj.weight"].T.reshape(h, d, e),
            "moe": {
                "router": t[p + router].T,
                "w_gate": np.stack([t[p + gate.format(j=j)].T for j in range(EXPERTS)]),
                "w_up": np.stack([t[p + up.format(j=j)].T for j in range(EXPERTS)]),
                "w_down": np.stack([t[p + down.format(j=j)].T for j in range(EXPERTS)]),
            },
        }
        if kind == "qwen2_moe":
            out |= {f"b{n}": t[p + f"self_attn.{n}_proj.bias"].reshape(-1, d) for n in "qkv"}
            g, u, dn = (t[p + f"mlp.shared_expert.{n}.weight"].T for n in SHARED)
            out["moe"] |= {"shared_gate": g, "shared_up": u, "shared_down": dn}
            out["moe"]["shared_router"] = t[p + "mlp.shared_expert_gate.weight"].T
        if kind == "qwen3_moe":
            out |= {n: {"scale": t[p + f"self_attn.{n}.weight"]} for n in ("q_norm", "k_norm")}
        return out

    layers = [layer(i) for i in range(hf["num_hidden_layers"])]
    return {
        "embedding": t["model.embed_tokens.weight"],
        "layers": jax.tree.map(lambda *a: np.stack(a), *layers),
        "final_norm": {"scale": t["model.norm.weight"]},
        "head": t["lm_head.weight"].T,
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One fp32 checkpoint of each kind, written in Hugging Face's layout by the test."""
    root = tmp_path_factory.mktemp("moe")
    return {kind: write_checkpoint(str(root / kind), hf, hf_tensors(hf)) for kind, hf in CONFIGS.items()}


def _tokens(rows=8, seq=17, seed=0):
    return np.random.default_rng(seed).integers(0, 96, size=(rows, seq)).astype(np.int32)


def _moe_params(tree, layer: int) -> dict:
    return {k: np.asarray(v[layer]) for k, v in tree["layers"]["moe"].items()}


# -- the MoE layer against Hugging Face's forward -----------------------------------------------------------


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_moe_layer_matches_hugging_face(checkpoints, kind):
    # the loaded experts, router and shared expert through zjax's MoE layer equal Hugging Face's block run on
    # the file's own tensors (Mixtral: top-2 renormalized; Qwen2-MoE: top-3 raw plus a gated shared expert)
    hf, directory = CONFIGS[kind], checkpoints[kind]
    model = from_hf_config(directory)
    plan = zjax.Plan(zjax.make_mesh(dp=8), precision="fp32")
    state = zjax.hf.load(directory, plan, model, TX)
    tensors = read_checkpoint(directory)
    x = np.random.default_rng(1).normal(size=(2, 9, hf["hidden_size"])).astype(np.float32)
    layer = MoELayer(model.cfg.moe, model.cfg.embed, model.cfg.mlp)
    for i in range(hf["num_hidden_layers"]):
        got, stats = jax.jit(layer.apply)({"params": _moe_params(state.params, i)}, jnp.asarray(x))
        want = hf_sparse_moe(x.reshape(-1, x.shape[-1]), tensors, hf, i).reshape(x.shape)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)
        assert float(np.sum(stats["tokens"])) == x.shape[0] * x.shape[1] * hf["num_experts_per_tok"]


@pytest.mark.slow  # the expert mapping and the sharded load are tested fast (the layer vs HF, export = import)
def test_loaded_loss_equals_the_tree_made_by_hand(checkpoints):
    hf, directory = CONFIGS["mixtral"], checkpoints["mixtral"]
    model = from_hf_config(directory)
    assert model.cfg.moe == MoE(experts=EXPERTS, top_k=2, load_balance_weight=0.02, balance_loss="pooled")
    batch = jnp.asarray(_tokens())
    hand = jax.tree.map(jnp.asarray, by_hand(hf, read_checkpoint(directory)))
    want, metrics = jax.jit(lambda p, b: lm_loss(model, p, b))(hand, batch)
    want = want.mean
    assert float(metrics["load_balance"]) > 0  # the routers ran and their loss is in the total
    for mesh in ({"dp": 8}, {"dp": 2, "ep": 4}):
        plan = zjax.Plan(zjax.make_mesh(**mesh), stage=3, precision="fp32")
        state = zjax.hf.load(directory, plan, model, TX)
        # the experts' all-to-all over ep when the mesh has one: the plan's own evaluation
        got = plan.eval_step(lambda p, b: lm_loss(model, p, b)[0].mean)(state, plan.shard_batch(batch))
        assert float(got) == pytest.approx(float(want), rel=1e-5), mesh


@pytest.mark.slow  # the Mixtral test above runs the same load path in the fast suite
@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe"])
def test_qwen_moe_loss_equals_the_tree_made_by_hand(checkpoints, kind):
    # q/k/v biases and the shared expert (Qwen2-MoE), q/k norms (Qwen3-MoE) land where the decoder reads them
    hf, directory = CONFIGS[kind], checkpoints[kind]
    model = from_hf_config(directory)
    hand = jax.tree.map(jnp.asarray, by_hand(hf, read_checkpoint(directory)))
    plan = zjax.Plan(zjax.make_mesh(dp=8), precision="fp32")
    state = zjax.hf.load(directory, plan, model, TX)
    assert jax.tree.structure(state.params) == jax.tree.structure(hand)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(hand), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    batch = jnp.asarray(_tokens())
    want = jax.jit(lambda p, b: lm_loss(model, p, b)[0].mean)(hand, batch)
    got = jax.jit(lambda p, b: lm_loss(model, p, b)[0].mean)(state.params, batch)
    assert float(got) == pytest.approx(float(want), rel=1e-5)


# -- import and export, sharded over ep -------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, mesh, scan",
    [
        ("mixtral", {"dp": 2, "ep": 4}, True),
        pytest.param("qwen2_moe", {"dp": 2, "ep": 4}, True, marks=pytest.mark.slow),
        pytest.param(
            "qwen3_moe", {"dp": 4, "ep": 2}, False, marks=pytest.mark.slow
        ),  # layer_{i}/moe/..., experts leading
    ],
)
def test_export_is_bitwise_the_import(checkpoints, tmp_path, kind, mesh, scan):
    src = write_checkpoint(
        str(tmp_path / "bf16"), CONFIGS[kind], read_checkpoint(checkpoints[kind]), dtype=ml_dtypes.bfloat16, files=3
    )
    model = from_hf_config(src, scan=scan)
    plan = zjax.Plan(zjax.make_mesh(**mesh), stage=3, precision="bf16")
    state = zjax.hf.load(src, plan, model, TX)
    master = state.opt_state.master
    w_gate = master["layers"]["moe"]["w_gate"] if scan else master["layer_0"]["moe"]["w_gate"]
    axis = 1 if scan else 0
    assert {s.data.shape[axis] for s in w_gate.addressable_shards} == {EXPERTS // mesh["ep"]}  # split over ep
    out = zjax.hf.save(tmp_path / "out", model, state, max_shard_size=20_000)
    assert len([f for f in os.listdir(out) if f.endswith(".safetensors")]) > 1
    want, got = read_checkpoint(src), read_checkpoint(out)
    assert sorted(got) == sorted(want)
    for name, x in want.items():
        assert got[name].dtype == x.dtype and got[name].shape == x.shape, name
        assert np.array_equal(got[name].view(np.uint16), x.view(np.uint16)), name
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["model_type"] == kind and config_from_hf(saved, scan=scan) == model.cfg


def test_import_reads_only_the_experts_each_device_holds(checkpoints, monkeypatch):
    # dp=2 x ep=4: a device holds 2 of the 8 experts of every layer; the block its leaf is made of reads
    # exactly those experts' tensors (never all of a layer's), one Hugging Face tensor at a time
    from zjax.hf import _load

    reads: list[str] = []
    blocks: list[tuple[tuple[int, ...], tuple[int, ...], list[str]]] = []
    real_read, real_make = _load._Reader.read, jax.make_array_from_callback

    def read(self, t, name, index):
        reads.append(name)
        return real_read(self, t, name, index)

    def make(shape, sharding, callback):
        def spy(index):
            before = len(reads)
            out = callback(index)
            blocks.append((tuple(shape), out.shape, reads[before:]))
            return out

        return real_make(shape, sharding, spy)

    monkeypatch.setattr(_load._Reader, "read", read)
    monkeypatch.setattr(_load.jax, "make_array_from_callback", make)
    model = from_hf_config(checkpoints["mixtral"])
    plan = zjax.Plan(zjax.make_mesh(dp=2, ep=4), stage=3, precision="bf16")
    zjax.hf.load(checkpoints["mixtral"], plan, model, TX)
    hf = CONFIGS["mixtral"]
    layers, e, f = hf["num_hidden_layers"], hf["hidden_size"], hf["intermediate_size"]
    leaves = {(layers, EXPERTS, e, f), (layers, EXPERTS, f, e)}  # w_gate and w_up; w_down
    experts = [b for b in blocks if b[0] in leaves]
    assert len(experts) == 3 * 8  # every device's block of the three leaves
    assert sum(bool(names) for _, _, names in experts) >= 3 * 4  # at least one block read per ep rank
    for _, block, names in experts:
        assert block[1] == EXPERTS // 4, block
        if names:  # a replica's block comes from the host copy, reading nothing
            held = {n.split(".experts.")[1].split(".")[0] for n in names}
            assert len(held) == EXPERTS // 4 and len(names) == layers * EXPERTS // 4, names


# -- configs ------------------------------------------------------------------------------------------------

MIXTRAL_8X7B = {
    "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": None, "num_local_experts": 8,
    "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02, "router_jitter_noise": 0.0, "tie_word_embeddings": False,
}  # fmt: skip
QWEN15_MOE_A27B = {
    "model_type": "qwen2_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
    "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_hidden_layers": 24,
    "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
    "rope_theta": 1e6, "num_experts": 60, "num_experts_per_tok": 4, "norm_topk_prob": False,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False, "sliding_window": 32768,
    "router_aux_loss_coef": 0.001, "tie_word_embeddings": False,
}  # fmt: skip
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "use_sliding_window": False, "sliding_window": None, "attention_bias": False,
    "router_aux_loss_coef": 0.001, "tie_word_embeddings": False,
}  # fmt: skip


def test_configs_map_and_round_trip():
    mixtral = config_from_hf(MIXTRAL_8X7B)
    assert mixtral.moe == MoE(experts=8, top_k=2, normalize_top_k=True, load_balance_weight=0.02, balance_loss="pooled")
    assert not mixtral.qkv_bias and not mixtral.qk_norm and mixtral.sliding_window is None
    assert mixtral.num_params == 46_702_792_704  # Mixtral-8x7B's published count
    qwen2 = config_from_hf(QWEN15_MOE_A27B)
    assert qwen2.moe == MoE(experts=60, top_k=4, mlp=1408, normalize_top_k=False, shared_mlp=5632,
                            load_balance_weight=0.001, balance_loss="pooled")  # fmt: skip
    assert qwen2.qkv_bias and not qwen2.qk_norm and qwen2.sliding_window is None and qwen2.mlp == 5632
    assert qwen2.num_params == 14_315_784_192  # Qwen1.5-MoE-A2.7B's
    qwen3 = config_from_hf(QWEN3_30B_A3B)
    assert qwen3.moe == MoE(
        experts=128, top_k=8, mlp=768, normalize_top_k=True, load_balance_weight=0.001, balance_loss="pooled"
    )
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 128
    assert qwen3.num_params == 30_532_122_624  # Qwen3-30B-A3B's
    windowed = config_from_hf({**MIXTRAL_8X7B, "sliding_window": 4096})
    dense_qwen3 = config_from_hf({**QWEN3_30B_A3B, "model_type": "qwen3"})
    assert dense_qwen3.moe is None and dense_qwen3.qk_norm and dense_qwen3.mlp == 6144
    for cfg, kind in [(mixtral, "mixtral"), (qwen2, "qwen2_moe"), (qwen3, "qwen3_moe"), (windowed, "mixtral"),
                      (dense_qwen3, "qwen3")]:  # fmt: skip
        hf = config_to_hf(cfg)
        assert hf["model_type"] == kind
        assert config_from_hf(json.loads(json.dumps(hf))) == cfg, kind
    hf = config_to_hf(qwen2)  # the fields transformers' Qwen2MoeConfig reads
    assert (hf["moe_intermediate_size"], hf["shared_expert_intermediate_size"], hf["num_experts"]) == (1408, 5632, 60)
    assert hf["norm_topk_prob"] is False and hf["decoder_sparse_step"] == 1 and hf["mlp_only_layers"] == []
    assert config_to_hf(mixtral)["num_local_experts"] == 8 and config_to_hf(mixtral)["intermediate_size"] == 14336
    # a decoder whose experts are the size of its dense mlp: both sizes written, read back the same
    # (Hugging Face's configs have one load-balancing formula, the pooled one: an import reads it back as that)
    same = DecoderConfig(qk_norm=True, moe=MoE(experts=4, top_k=2, balance_loss="pooled"))
    assert config_from_hf(config_to_hf(same)) == same
    per_layer = dataclasses.replace(same, moe=dataclasses.replace(same.moe, balance_loss="per-layer"))
    assert config_from_hf(config_to_hf(per_layer)) == same
    # transformers' Mixtral defaults where the file leaves them out
    lean = {k: v for k, v in MIXTRAL_8X7B.items() if k not in ("rope_theta", "rms_norm_eps")}
    assert config_from_hf(lean).rope_theta == 1e6 and config_from_hf(lean).norm_eps == 1e-5


def test_bad_configs_name_the_field(checkpoints, tmp_path):
    with pytest.raises(ValueError, match=r"decoder_sparse_step=2 .*must be 1"):
        config_from_hf({**QWEN15_MOE_A27B, "decoder_sparse_step": 2})
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[0, 3\] .*must be empty"):
        config_from_hf({**QWEN3_30B_A3B, "mlp_only_layers": [0, 3]})
    with pytest.raises(ValueError, match=r"router_jitter_noise=0.01"):
        config_from_hf({**MIXTRAL_8X7B, "router_jitter_noise": 0.01})
    with pytest.raises(ValueError, match=r"has no 'num_experts'"):
        config_from_hf({k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"})
    with pytest.raises(ValueError, match=r"top_k=4 is larger than experts=2"):
        config_from_hf({**MIXTRAL_8X7B, "num_local_experts": 2, "num_experts_per_tok": 4})
    with pytest.raises(ValueError, match=r"attention_bias=true"):
        config_from_hf({**QWEN3_30B_A3B, "attention_bias": True})
    with pytest.raises(ValueError, match=r"normalize_top_k=False.*'mixtral'"):
        config_to_hf(DecoderConfig(moe=MoE(normalize_top_k=False)))
    with pytest.raises(ValueError, match=r"shared_mlp=16.*'qwen3_moe'"):
        config_to_hf(DecoderConfig(qk_norm=True, moe=MoE(shared_mlp=16)))
    with pytest.raises(ValueError, match=r"moe=None cannot be written as model_type 'mixtral'"):
        config_to_hf(DecoderConfig(), model_type="mixtral")
    with pytest.raises(ValueError, match=r"sliding_window=8 cannot be written as model_type 'qwen3_moe'"):
        config_to_hf(DecoderConfig(qk_norm=True, sliding_window=8, moe=MoE()))

    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=1)
    model = from_hf_config(checkpoints["mixtral"])
    fewer = zjax.models.Decoder(DecoderConfig(**{**model.cfg.__dict__, "moe": MoE(experts=4, top_k=2)}))
    with pytest.raises(ValueError, match=r"experts: model 4, checkpoint 8"):
        zjax.hf.load(checkpoints["mixtral"], plan, fewer, TX)
    tensors = read_checkpoint(checkpoints["mixtral"])
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    path = write_checkpoint(str(tmp_path / "missing"), CONFIGS["mixtral"], tensors)
    with pytest.raises(ValueError, match=r"1 missing \['model.layers.1.block_sparse_moe.experts.5.w3.weight'\]"):
        zjax.hf.load(path, plan, model, TX)
    tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"] = np.zeros((24, 31), np.float32)
    path = write_checkpoint(str(tmp_path / "shape"), CONFIGS["mixtral"], tensors)
    with pytest.raises(ValueError, match=r"experts.5.w3.weight'.*\(24, 31\).*\(24, 32\).*layers/moe/w_up"):
        zjax.hf.load(path, plan, model, TX)
