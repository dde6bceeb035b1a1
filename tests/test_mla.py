"""Multi-head latent attention (DeepSeek-V2/V3) and the first dense layers of a mixture of experts.

The decoder's MLA is checked against a NumPy transcription of DeepSeek's formulation (the rotary parts as complex
pairs of adjacent values, keys and values up-projected per head from the normalised latent, the value heads
narrower than the query/key heads), and every distributed path against the one-device objective (packed rows,
uneven masks). Under context parallelism in the all-gather mode the ranks exchange the latent, not the keys and
values: the compiled step's cp traffic is counted.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import pytest

import zjax
from zjax.models import MLA, Decoder, DecoderConfig, YarnScaling

from ._objective import applied, initial, reference, relative, uneven_batch

LATENT = MLA(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
TINY_MLA = DecoderConfig(vocab=64, embed=64, layers=2, heads=4, head_dim=16, mlp=128, max_len=16, mla=LATENT)


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rotate(x, positions, inv_freq, factor):
    """DeepSeek's rotary embedding: adjacent pairs ``(x[2i], x[2i+1])`` as complex numbers times ``e^{i p f_i}``."""
    pairs = x[..., 0::2] + 1j * x[..., 1::2]  # [batch, seq, heads, d / 2]
    turned = pairs * (factor * np.exp(1j * positions[:, None, None] * inv_freq))[None]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = turned.real, turned.imag
    return out


def _numpy_logits(cfg: DecoderConfig, params, tokens: np.ndarray) -> np.ndarray:
    """The decoder's logits, written from DeepSeek's definition of MLA (float64)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    m, eps = cfg.mla, cfg.norm_eps
    b, s = tokens.shape
    x = p["embedding"][tokens]
    positions = np.arange(s, dtype=np.float64)
    inv_freq = cfg.rope_frequencies().astype(np.float64)
    causal = np.tril(np.ones((s, s), bool))
    for i in range(cfg.layers):
        w = jax.tree.map(lambda a, i=i: a[i], p["layers"])
        h = _rms(x, w["attn_norm"]["scale"], eps)
        q_latent = _rms(h @ w["wq_a"], w["q_latent_norm"]["scale"], eps)
        q = np.einsum("bsr,rhd->bshd", q_latent, w["wq_b"])
        q_nope, q_rope = q[..., : m.qk_nope_head_dim], q[..., m.qk_nope_head_dim :]
        kv_a = h @ w["wkv_a"]
        latent, k_rope = kv_a[..., : m.kv_lora_rank], kv_a[..., m.kv_lora_rank :]
        kv = np.einsum("bsr,rhd->bshd", _rms(latent, w["kv_latent_norm"]["scale"], eps), w["wkv_b"])
        k_nope, v = kv[..., : m.qk_nope_head_dim], kv[..., m.qk_nope_head_dim :]
        factor = cfg.rope_attention_factor
        q_rope = _rotate(q_rope, positions, inv_freq, factor)
        k_rope = _rotate(k_rope[:, :, None, :], positions, inv_freq, factor)
        scores = np.einsum("bqhd,bkhd->bhqk", q_nope, k_nope) + np.einsum("bqhd,bkxd->bhqk", q_rope, k_rope)
        scores = np.where(causal, scores * cfg.softmax_scale, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("bhqk,bkhd,hde->bqe", probs, v, w["wo"])
        h = _rms(x, w["mlp_norm"]["scale"], eps)
        gate = h @ w["w_gate"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w["w_up"])) @ w["w_down"]
    return _rms(x, p["final_norm"]["scale"], eps) @ p["head"]


@pytest.mark.parametrize("scaling", [None, YarnScaling(factor=4.0, original_max_len=4, mscale=1.0, mscale_all_dim=1.0)])
def test_latent_attention_equals_deepseeks_definition(scaling):
    """... with YaRN's mscale on the softmax scale (DeepSeek-V3's config), where a wrong scale moves the logits."""
    cfg = dataclasses.replace(TINY_MLA, rope_scaling=scaling)
    if scaling is not None:
        assert cfg.softmax_scale == pytest.approx((0.1 * math.log(4.0) + 1) ** 2 / 4.0)
    tokens = np.random.RandomState(0).randint(0, cfg.vocab, (2, cfg.max_len)).astype(np.int32)
    params = initial(cfg)
    got = jax.jit(lambda p, t: Decoder(cfg).apply({"params": p}, t))(params, tokens)
    want = _numpy_logits(cfg, params, tokens)
    assert np.max(np.abs(np.asarray(got, np.float64) - want)) <= 2e-5 * np.max(np.abs(want))


CASES = {
    "stage3-dp4-tp2": ({"dp": 4, "tp": 2}, {"stage": 3}, None),
    "stage3-cp4-tp2-latent": ({"cp": 4, "tp": 2}, {"stage": 3}, "all-gather"),
    "stage2-dp2-cp4-ring": ({"dp": 2, "cp": 4}, {"stage": 2}, "ring"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_latent_attention_computes_the_one_device_objective(name):
    """Under tp (heads split), cp in the all-gather mode (the latent gathered, one up-projection per rank) and
    the ring (keys and values passed on), packed rows and uneven masks: the one-device gradient."""
    mesh, plan, mode = CASES[name]
    cfg = TINY_MLA if mode is None else dataclasses.replace(TINY_MLA, context_mode=mode)
    batch = uneven_batch(16, TINY_MLA)
    loss, grads = reference(TINY_MLA, batch)
    got, metrics = applied(zjax.Plan(zjax.make_mesh(**mesh), precision="fp32", **plan), cfg, batch)
    assert relative(got, grads) <= 3e-5, relative(got, grads)
    assert abs(float(metrics["loss"]) - loss) <= 3e-5 * loss


def _attention_cp_volume(cfg: DecoderConfig) -> dict[str, int]:
    """Attention's collective volume per kind at cp=8 (stage 0): the all-gather mode's less the ring's (whose
    keys and values travel by permutes; every other collective of the two programs is the same)."""
    volume = {}
    for mode in ("all-gather", "ring"):
        est = zjax.planner.estimate(
            dataclasses.replace(cfg, context_mode=mode), mesh={"cp": 8}, stages=(0,), batch_size=1, precision="fp32"
        )
        volume[mode] = est.rows[0].comm.volume
    kinds = ("all-gather", "reduce-scatter", "all-reduce")
    return {k: volume["all-gather"][k] - volume["ring"][k] for k in kinds}


def test_under_cp_the_ranks_gather_the_latent_not_the_keys_and_values():
    """cp=8, all-gather mode: MLA's collectives over cp move the latent and the rotated key part (24 values per
    token here): gathered forward and in the recompute, its cotangent summed once. A grouped-query model whose
    keys and values are as wide (16 heads of 24 + 24) moves them instead: more than 20x the bytes."""
    wide = MLA(kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    cfg = DecoderConfig(vocab=64, embed=64, layers=1, heads=16, head_dim=24, mlp=64, max_len=16, mla=wide)
    latent = _attention_cp_volume(cfg)
    whole = 16 * (16 + 8) * 4  # bytes of the whole sequence's latent and rotated key part
    assert latent == {"all-gather": 2 * whole, "reduce-scatter": 0, "all-reduce": 2 * whole}, latent
    keys_values = _attention_cp_volume(dataclasses.replace(cfg, mla=None))
    assert keys_values["all-gather"] == 2 * 16 * 16 * (24 + 24) * 4, keys_values
    assert sum(latent.values()) * 20 <= sum(keys_values.values()), (latent, keys_values)
