"""The Llama-family decoder against transformers' implementation, and Hugging Face checkpoints in and out."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import shutil

import flax.linen
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import zjax
from zjax.models import DecoderConfig, RopeScaling, YarnScaling, config_from_hf, from_hf_config, lm_loss

from ._hf_models import flax_model, read_checkpoint, torch_layout, write_checkpoint

TX = optax.adamw(1e-3)


def _hf_dict(cfg, model_type: str) -> dict:
    return {**cfg.to_dict(), "model_type": model_type}


def _tokens(rows=8, seq=17, vocab=96, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, size=(rows, seq)).astype(np.int32)


def _logits(directory, tokens, **plan_kw):
    model = from_hf_config(directory)
    plan = zjax.Plan(zjax.make_mesh(**plan_kw.pop("mesh", {"dp": 8})), precision="fp32", **plan_kw)
    state = zjax.hf.load(directory, plan, model, TX)
    return np.asarray(jax.jit(model.apply)({"params": state.params}, jnp.asarray(tokens)))


# -- the model against transformers' -----------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, extra",
    [
        ("llama", {}),  # grouped-query attention (4 heads, 2 kv heads), untied head
        pytest.param("llama", {"tie_word_embeddings": True, "num_key_value_heads": 1}, marks=pytest.mark.slow),
        pytest.param("mistral", {"sliding_window": 5}, marks=pytest.mark.slow),  # a window shorter than the sequence
    ],
)
def test_logits_match_transformers(tmp_path, kind, extra):
    hf_model, cfg, params = flax_model(kind, **extra)
    tied = bool(extra.get("tie_word_embeddings"))
    if tied:  # transformers' Flax Llama keeps its own head: make it the embedding's transpose
        params["lm_head"]["kernel"] = params["model"]["embed_tokens"]["embedding"].T.copy()
    ckpt = write_checkpoint(str(tmp_path / "ckpt"), _hf_dict(cfg, kind), torch_layout(params, tied))
    tokens = _tokens(seq=16)
    want = np.asarray(jax.jit(lambda p, t: hf_model(t, params=p).logits)(params, tokens))
    got = _logits(ckpt, tokens)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_qwen2_biases_match_transformers(tmp_path):
    # Qwen2 = Llama + q/k/v biases; transformers' Flax Llama with attention_bias has them too (and an o_proj
    # bias, zero here, which Qwen2 checkpoints do not have)
    hf_model, cfg, params = flax_model("llama", attention_bias=True, rope_theta=10000.0)
    for layer in params["model"]["layers"].values():
        layer["self_attn"]["o_proj"]["bias"][:] = 0
    tensors = {k: v for k, v in torch_layout(params).items() if not k.endswith("o_proj.bias")}
    hf = _hf_dict(cfg, "qwen2")
    hf.pop("attention_bias")
    ckpt = write_checkpoint(str(tmp_path / "ckpt"), hf, tensors)
    assert from_hf_config(ckpt).cfg.qkv_bias
    tokens = _tokens(seq=16)
    want = jax.jit(lambda p, t: hf_model(t, params=p).logits)(params, tokens)
    np.testing.assert_allclose(_logits(ckpt, tokens), np.asarray(want), atol=1e-4)


def test_rope_frequencies_worked_out_independently():
    # RoPE base 500000 and Llama-3.1 scaling (factor 8, low 1, high 4, original context 8192), head_dim 128:
    # inv_freq[i] = base^(-2i/128); wavelength 2*pi/inv_freq; > 8192 -> /8; < 2048 -> kept; between: a blend.
    cfg = DecoderConfig(head_dim=128, rope_theta=500000.0, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192))
    got = cfg.rope_frequencies()
    for i in (0, 20, 40, 45, 50, 63):
        f = 500000.0 ** (-(2 * i) / 128)
        wavelength = 2 * math.pi / f
        if wavelength < 2048:
            want = f
        elif wavelength > 8192:
            want = f / 8
        else:
            t = (8192 / wavelength - 1) / 3
            want = (1 - t) * f / 8 + t * f
        assert got[i] == pytest.approx(want, rel=1e-6), i
    # the three regimes all occur at these indices (the test would not see a wrong band otherwise)
    wl = 2 * math.pi * 500000.0 ** (np.arange(64) * 2 / 128)
    assert (wl < 2048).any() and (wl > 8192).any() and ((wl >= 2048) & (wl <= 8192)).any()
    plain = DecoderConfig(head_dim=8, rope_theta=10000.0).rope_frequencies()
    np.testing.assert_allclose(plain, [1.0, 0.1, 0.01, 0.001], rtol=1e-6)


def test_yarn_frequencies_and_attention_factor_worked_out_independently():
    # DeepSeek-V3's YaRN (rotary dim 64, base 10000, factor 40, original context 4096, beta 32 and 1): the
    # dimension index fitting r rotations in 4096 positions is 64 ln(4096 / (2 pi r)) / (2 ln 10000): 10.47 for
    # r = 32 (rounded down: 10), 22.51 for r = 1 (rounded up: 23). Below 10 kept, from 23 on divided by 40, a
    # linear ramp (i - 10) / 13 between. mscale = mscale_all_dim: cos and sin unscaled.
    yarn = YarnScaling(factor=40.0, original_max_len=4096, mscale=1.0, mscale_all_dim=1.0)
    got = DecoderConfig(head_dim=64, rope_theta=10000.0, rope_scaling=yarn).rope_frequencies()
    for i in (0, 9, 10, 16, 22, 23, 31):
        f = 10000.0 ** (-(2 * i) / 64)
        ramp = min(max((i - 10) / 13, 0.0), 1.0)
        assert got[i] == pytest.approx(f / 40 * ramp + f * (1 - ramp), rel=1e-6), i
    assert yarn.attention_factor == 1.0
    # Qwen3's long-context YaRN (factor 4, no mscale): 0.1 ln 4 + 1; DeepSeek-style with mscale_all_dim 0.5
    assert YarnScaling(factor=4.0).attention_factor == pytest.approx(1.1386294361, rel=1e-9)
    assert YarnScaling(factor=40.0, mscale=1.0, mscale_all_dim=0.5).attention_factor == pytest.approx(
        (0.1 * math.log(40) + 1) / (0.05 * math.log(40) + 1), rel=1e-9
    )


def test_yarns_attention_factor_scales_the_rotated_queries_and_keys():
    # factor 1 leaves the frequencies; an attention factor a on cos and sin is the same model as wq and wk times a
    plain = DecoderConfig(vocab=64, embed=32, layers=1, heads=2, head_dim=16, mlp=64, max_len=16)
    scaled = dataclasses.replace(plain, rope_scaling=YarnScaling(factor=1.0, given_attention_factor=1.7))
    np.testing.assert_array_equal(scaled.rope_frequencies(), plain.rope_frequencies())
    tokens = _tokens(seq=16, vocab=64)
    params = flax.linen.unbox(zjax.models.Decoder(plain).init(jax.random.key(0), tokens)["params"])
    layers = {**params["layers"], "wq": params["layers"]["wq"] * 1.7, "wk": params["layers"]["wk"] * 1.7}
    want = zjax.models.Decoder(plain).apply({"params": {**params, "layers": layers}}, tokens)
    got = zjax.models.Decoder(scaled).apply({"params": params}, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    hf = zjax.models.config_to_hf(scaled)
    assert hf["rope_scaling"]["rope_type"] == "yarn" and config_from_hf(hf) == scaled


def test_config_mapping_and_presets(tmp_path):
    hf = {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
    }
    cfg = config_from_hf(hf)
    assert cfg == zjax.models.PRESETS["llama3.1-8b"]
    assert cfg.num_params == 8_030_261_248  # Llama-3.1-8B's published count
    assert zjax.models.PRESETS["llama3-70b"].num_params == 70_553_706_496
    assert zjax.models.PRESETS["qwen2-7b"].num_params == 7_615_616_512
    assert zjax.models.PRESETS["mistral-7b"].num_params == 7_241_732_096
    assert config_from_hf(zjax.models.config_to_hf(cfg)) == cfg
    for name in ("qwen2-7b", "mistral-7b", "llama2-7b"):
        preset = zjax.models.PRESETS[name]
        assert config_from_hf(zjax.models.config_to_hf(preset)) == preset
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert from_hf_config(tmp_path, remat="dots").cfg.remat == "dots"
    assert from_hf_config(tmp_path / "config.json").cfg == cfg


# -- import and export --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    """A bf16 Llama checkpoint in 3 files with a safetensors index."""
    _, cfg, params = flax_model("llama")
    path = str(tmp_path_factory.mktemp("hf") / "bf16")
    return write_checkpoint(path, _hf_dict(cfg, "llama"), torch_layout(params), dtype=ml_dtypes.bfloat16, files=3)


def test_export_is_bitwise_the_import(bf16_ckpt, tmp_path):
    model = from_hf_config(bf16_ckpt)
    plan = zjax.Plan(zjax.make_mesh(dp=4, tp=2), stage=3, precision="bf16")
    state = zjax.hf.load(bf16_ckpt, plan, model, TX)
    out = zjax.hf.save(tmp_path / "out", model, state, max_shard_size=12_000)
    files = sorted(os.listdir(out))
    assert "model.safetensors.index.json" in files and "config.json" in files
    assert len([f for f in files if f.endswith(".safetensors")]) > 1
    want, got = read_checkpoint(bf16_ckpt), read_checkpoint(out)
    assert sorted(got) == sorted(want)
    for name, x in want.items():
        assert got[name].dtype == x.dtype and got[name].shape == x.shape, name
        assert np.array_equal(got[name].view(np.uint16), x.view(np.uint16)), name
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(want)
    assert index["metadata"]["total_size"] == sum(x.nbytes for x in want.values())
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config_from_hf(saved) == model.cfg and saved["torch_dtype"] == "bfloat16"
    # the compute copy is cast from the fp32 master, which holds the file's values exactly
    master = state.opt_state.master["layers"]["wq"]
    assert master.dtype == jnp.float32 and state.params["layers"]["wq"].dtype == jnp.bfloat16


def test_import_reads_only_each_devices_slices(bf16_ckpt, monkeypatch):
    from zjax.hf import _load

    blocks = []
    real = _load._Reader.read

    def read(self, t, name, index):
        out = real(self, t, name, index)
        blocks.append((t.path, out.shape))
        return out

    monkeypatch.setattr(_load._Reader, "read", read)
    model = from_hf_config(bf16_ckpt)
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=3, precision="bf16")
    state = zjax.hf.load(bf16_ckpt, plan, model, TX)
    sharded = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(state.opt_state.master)[0]:
        keys = tuple(str(k.key) for k in path)
        shard = leaf.addressable_shards[0].data.shape
        per_layer = shard[1:] if keys[0] == "layers" else shard
        reads = [s for p, s in blocks if p == keys]
        assert reads and all(s == per_layer for s in reads), (keys, reads[:2], shard)
        if shard != leaf.shape:
            sharded += 1
            assert all(math.prod(s) < math.prod(leaf.shape[1:] if keys[0] == "layers" else leaf.shape) for s in reads)
    assert sharded >= 8  # ZeRO-3 splits every large leaf over dp


@pytest.mark.slow  # three layouts compiled: the slow step
def test_same_loss_on_every_layout(bf16_ckpt):
    model = from_hf_config(bf16_ckpt)
    batch = _tokens(rows=16, seq=17)

    def loss(**kw):
        plan = zjax.Plan(zjax.make_mesh(**kw.pop("mesh")), precision="fp32", **kw)
        state = zjax.hf.load(bf16_ckpt, plan, model, TX)
        step = plan.train_step(lambda p, b: lm_loss(model, p, b))
        _, metrics = step(state, plan.shard_batch(jnp.asarray(batch)))
        return float(metrics["loss"])

    base = loss(mesh={"dp": 8}, stage=0)
    assert base == pytest.approx(loss(mesh={"dp": 4, "tp": 2}, stage=3), rel=1e-5)
    pipe = zjax.Pipeline(microbatches=4)
    assert base == pytest.approx(loss(mesh={"dp": 4, "pp": 2}, stage=1, pipeline=pipe), rel=1e-5)


@pytest.mark.slow  # packed rows' numerics are tested fast on the Decoder (test_context)
def test_packed_sequences_equal_separate_ones():
    cfg = DecoderConfig(vocab=64, embed=32, layers=2, heads=4, head_dim=8, mlp=64, max_len=32, kv_heads=2)
    model = zjax.models.Decoder(cfg)
    params = flax.linen.unbox(model.init(jax.random.key(1), jnp.zeros((1, 8), jnp.int32))["params"])
    a, b = _tokens(rows=2, seq=7, vocab=64, seed=1), _tokens(rows=2, seq=10, vocab=64, seed=2)
    packed = {
        "tokens": np.concatenate([a, b], axis=1),
        "positions": np.concatenate([np.arange(7), np.arange(10)])[None].repeat(2, 0),
        "segment_ids": np.concatenate([np.full(7, 1), np.full(10, 2)])[None].repeat(2, 0),
    }
    loss = jax.jit(lambda batch: lm_loss(model, params, batch).mean)
    got = loss(jax.tree.map(jnp.asarray, packed))
    # targets: 6 in the first sequence, 9 in the second, none across the boundary
    want = (6 * loss(jnp.asarray(a)) + 9 * loss(jnp.asarray(b))) / 15
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    masked = loss({"tokens": jnp.asarray(b), "loss_mask": jnp.asarray(np.arange(10) < 5)[None].repeat(2, 0)})
    assert float(masked) == pytest.approx(float(loss(jnp.asarray(b[:, :5]))), rel=1e-5)


def test_vocab_chunks_equal_whole_logits():
    from zjax.models._xent import chunked_cross_entropy, vocab_chunks

    assert vocab_chunks(128256, 16384) == 8 and vocab_chunks(96, None) == 1 and vocab_chunks(96, 500) == 1
    r = np.random.default_rng(0)
    # logits of unit variance (h scaled by 1/sqrt(8)): the chunked and whole log-sum-exps sum in different orders,
    # and O(1) logits keep their gradients' fp32 difference at 4.5e-8 on AVX-512, AVX2 and SSE (3.0e-7 unscaled)
    h = jnp.asarray(r.normal(size=(2, 5, 8)) / np.sqrt(8), jnp.float32)
    w = jnp.asarray(r.normal(size=(8, 96)), jnp.float32)
    t, wt = jnp.asarray(r.integers(0, 96, (2, 5))), jnp.asarray(r.random((2, 5)), jnp.float32)

    def whole(h, w):
        return chunked_cross_entropy(h, w, t, wt, None)

    def chunked(h, w):
        return chunked_cross_entropy(h, w, t, wt, 24)  # 4 chunks

    assert float(chunked(h, w)) == pytest.approx(float(whole(h, w)), rel=1e-6)
    for g, want in zip(jax.grad(chunked, (0, 1))(h, w), jax.grad(whole, (0, 1))(h, w), strict=True):
        np.testing.assert_allclose(g, want, atol=1e-6)


# -- bad input ------------------------------------------------------------------------------------------


def test_errors(bf16_ckpt, tmp_path):
    model = from_hf_config(bf16_ckpt)
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=1)
    hf = json.loads(pathlib.Path(bf16_ckpt, "config.json").read_text())
    tensors = read_checkpoint(bf16_ckpt)

    bad = write_checkpoint(str(tmp_path / "gpt2"), {**hf, "model_type": "gpt2"}, {"x": np.zeros(1, np.float32)})
    with pytest.raises(ValueError, match=r"model_type 'gpt2'.*\['llama', 'mistral', 'qwen2'\]"):
        from_hf_config(bad)

    missing = {k: v for k, v in tensors.items() if k != "model.layers.2.mlp.up_proj.weight"}
    missing["model.layers.9.extra.weight"] = np.zeros(2, np.float32)
    path = write_checkpoint(str(tmp_path / "missing"), hf, missing)
    with pytest.raises(ValueError, match=r"1 missing \['model.layers.2.mlp.up_proj.weight'\].*1 unexpected"):
        zjax.hf.load(path, plan, model, TX)

    wrong = {**tensors, "model.layers.1.self_attn.k_proj.weight": np.zeros((24, 32), np.float32)}
    path = write_checkpoint(str(tmp_path / "shape"), hf, wrong)
    with pytest.raises(ValueError, match=r"'model.layers.1.self_attn.k_proj.weight'.*\(24, 32\).*\(16, 32\)"):
        zjax.hf.load(path, plan, model, TX)

    other = zjax.models.Decoder(DecoderConfig(**{**model.cfg.__dict__, "kv_heads": 4}))
    with pytest.raises(ValueError, match=r"num_kv_heads: model 4, checkpoint 2"):
        zjax.hf.load(bf16_ckpt, plan, other, TX)

    with pytest.raises(ValueError, match=r"rope_scaling of type 'dynamic' \(supported: 'llama3', 'yarn'\)"):
        config_from_hf({**hf, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(hf))
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        zjax.hf.load(tmp_path / "empty", plan, model, TX)

    with pytest.raises(ValueError, match=r"'tokens'.*unknown \['labels'\]"):
        lm_loss(model, None, {"tokens": jnp.zeros((2, 5), jnp.int32), "labels": 0})


def test_save_never_leaves_a_half_written_checkpoint(bf16_ckpt, tmp_path, monkeypatch):
    from zjax.hf import _save

    model = from_hf_config(bf16_ckpt)
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=2)
    state = zjax.hf.load(bf16_ckpt, plan, model, TX)
    out = tmp_path / "out"
    out.mkdir()
    zjax.hf.save(out, model, state)  # an existing empty directory is filled, as a new one would be
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    with pytest.raises(FileExistsError, match="not empty; pass overwrite=True"):
        zjax.hf.save(out, model, state)
    shutil.rmtree(out)
    out.mkdir()
    (out / "keep.txt").write_text("the user's")
    with pytest.raises(FileExistsError, match="not empty; pass overwrite=True"):
        zjax.hf.save(out, model, state)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is a file"):
        zjax.hf.save(tmp_path / "file", model, state, overwrite=True)
    (tmp_path / "file").unlink()

    calls = []
    real = _save._to_hf

    def failing(*args):
        calls.append(1)
        if len(calls) == 5:
            raise OSError("disk full")
        return real(*args)

    monkeypatch.setattr(_save, "_to_hf", failing)
    with pytest.raises(OSError, match="disk full"):
        zjax.hf.save(out, model, state, overwrite=True, max_shard_size=12_000)
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary directory left behind
    assert sorted(os.listdir(out)) == ["keep.txt"]  # and the old directory untouched
    monkeypatch.setattr(_save, "_to_hf", real)
    zjax.hf.save(out, model, state, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]


@pytest.mark.slow  # writes and loads a 100M-parameter checkpoint
def test_import_host_memory_stays_near_one_leaf(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "io.json"
    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "hf_io.py"
    subprocess.run([sys.executable, str(script), "--layers", "12", "--json", str(out)], check=True, timeout=600)
    r = json.loads(out.read_text())
    assert r["params"] > 100e6
    # beyond the state itself, loading holds about one leaf's blocks (and safetensors' mapped pages)
    assert 0 < r["load_transient_bytes"] < 3 * r["largest_leaf_fp32_bytes"]
    # saving holds one output file (max_shard_size; here the whole bf16 model in one file) and one tensor
    assert r["save_transient_bytes"] < r["file_bytes"] + 2 * r["largest_leaf_fp32_bytes"]


@pytest.mark.slow  # zjax.hf.load covers Plan.init(params=) in the fast suite
def test_plan_init_from_given_params():
    cfg = DecoderConfig(vocab=64, embed=32, layers=2, heads=4, head_dim=8, mlp=64, max_len=16, kv_heads=2)
    model = zjax.models.Decoder(cfg)

    def init_fn(r):
        return model.init(r, jnp.zeros((1, 8), jnp.int32))["params"]

    given = jax.tree.map(lambda x: x + 1.0, flax.linen.unbox(init_fn(jax.random.key(5))))
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=3, precision="bf16")
    state = plan.init(init_fn, TX, jax.random.key(0), params=given)
    for a, b in zip(jax.tree.leaves(state.opt_state.master), jax.tree.leaves(given), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert not jax.tree.leaves(given)[0].is_deleted()  # the caller's arrays are not donated
    bad = {**given, "head": jnp.zeros((32, 65))}
    with pytest.raises(ValueError, match=r"params leaf 'head' has shape \(32, 65\); .* \(32, 64\)"):
        plan.init(init_fn, TX, jax.random.key(0), params=bad)
