"""Multi-head latent attention (DeepSeek-V2/V3) and multi-token prediction (DeepSeek-V3's MTP).

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
from zjax.models import MLA, Decoder, DecoderConfig, YarnScaling, lm_loss

from ._objective import applied, initial, reference, relative, uneven_batch
from .test_gpu_plan import _figure

LATENT = MLA(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
TINY_MLA = DecoderConfig(vocab=64, embed=64, layers=2, heads=4, head_dim=16, mlp=128, max_len=16, mla=LATENT)


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rotate(x, positions, inv_freq, factor):
    """DeepSeek's rotary embedding: adjacent pairs ``(x[2i], x[2i+1])`` as complex numbers times ``e^{i p f_i}``."""
    pairs = x[..., 0::2] + 1j * x[..., 1::2]  # [batch, seq, heads, d / 2]
    angle = positions[..., None, None] * inv_freq  # positions [seq] or [batch, seq]
    turned = pairs * factor * np.exp(1j * (angle if angle.ndim == 4 else angle[None]))
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = turned.real, turned.imag
    return out


def _numpy_layer(cfg: DecoderConfig, w, x: np.ndarray, positions=None, segments=None) -> np.ndarray:
    """One decoder layer with multi-head latent attention, written from DeepSeek's definition (float64); packed rows
    attend within their ``segments [batch, seq]`` at their ``positions [seq]`` (default ``0..seq-1``)."""
    m, eps = cfg.mla, cfg.norm_eps
    s = x.shape[1]
    positions = np.arange(s, dtype=np.float64) if positions is None else positions
    inv_freq = cfg.rope_frequencies().astype(np.float64)
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
    allowed = np.tril(np.ones((s, s), bool))[None, None]
    if segments is not None:
        allowed = allowed & (segments[:, None, :, None] == segments[:, None, None, :])
    scores = np.where(allowed, scores * cfg.softmax_scale, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    x = x + np.einsum("bhqk,bkhd,hde->bqe", probs, v, w["wo"])
    h = _rms(x, w["mlp_norm"]["scale"], eps)
    gate = h @ w["w_gate"]
    return x + (gate / (1 + np.exp(-gate)) * (h @ w["w_up"])) @ w["w_down"]


def _numpy_last(cfg: DecoderConfig, p, tokens: np.ndarray, positions=None, segments=None) -> np.ndarray:
    """The last layer's output (before the final norm)."""
    x = p["embedding"][tokens]
    for i in range(cfg.layers):
        x = _numpy_layer(cfg, jax.tree.map(lambda a, i=i: a[i], p["layers"]), x, positions, segments)
    return x


def _numpy_logits(cfg: DecoderConfig, params, tokens: np.ndarray) -> np.ndarray:
    """The decoder's logits, written from DeepSeek's definition of MLA (float64)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    return _rms(_numpy_last(cfg, p, tokens), p["final_norm"]["scale"], cfg.norm_eps) @ p["head"]


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
FAST = ("stage3-cp4-tp2-latent",)  # the latent's gather with heads over tp; the others in the slow step


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in FAST else [pytest.mark.slow]) for n in CASES])
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


def test_under_cp_the_ranks_gather_the_latent_not_the_keys_and_values():
    """cp=8, all-gather mode, one DeepSeek-V3-shaped layer over a 4,096-token sequence, read from the figure on
    docs/concepts/experts.md (benchmarks/mla_context.py: the planner's collective volume over cp per kind, the
    all-gather mode's less the ring's; recomputed by CI's docs/figures.py --check): MLA's collectives over cp move
    the latent and the rotated key part (512 + 64 values per token, bf16), gathered forward and in the recompute,
    its cotangent summed once. A grouped-query layer whose keys and values are as wide (128 heads of 192 + 192)
    moves them instead: more than 20x the bytes."""
    text = _figure("docs/concepts/experts.md", "benchmarks/mla_context.py --cp 8 --seq 4096")
    rows = {}  # mla / gqa -> (gather, scatter, all-reduce, total), MB per device per step
    for line in text.splitlines():
        cells = line.split("|")
        if len(cells) == 3 and cells[0].startswith(("mla", "gqa")):
            rows[cells[0][:3]] = tuple(float(x) for x in cells[1].split())
    assert set(rows) == {"mla", "gqa"}, text
    seq, mb, printed = 4096, 1e6, 0.005  # the figure's MB, to two decimals
    whole = seq * (512 + 64) * 2 / mb  # the whole sequence's latent and rotated key part
    assert rows["mla"][:3] == pytest.approx((2 * whole, 0.0, 2 * whole), abs=printed), rows
    assert rows["gqa"][0] == pytest.approx(2 * seq * 128 * (192 + 192) * 2 / mb, abs=printed), rows
    assert rows["mla"][3] * 20 <= rows["gqa"][3], rows


def _nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    logits = logits - logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, targets[..., None], -1)[..., 0]


def _numpy_mtp_loss(cfg: DecoderConfig, params, batch) -> float:
    """The next-token loss plus ``mtp_weight / mtp_layers`` times each module's, over the next-token count, written
    from DeepSeek-V3's MTP (module k: ``[norm(emb(t_{i+k})); norm(h_i)] @ proj``, one layer, the shared head
    predicting ``t_{i+k+1}``), float64."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    tokens, mask, seg = batch["tokens"], batch["loss_mask"], batch["segment_ids"]
    eps, s = cfg.norm_eps, tokens.shape[1] - 1

    def weights(k: int) -> np.ndarray:  # targets k + 1 ahead of the inputs: in the row, the document, the mask
        w = np.zeros((len(tokens), s))
        for i in range(s - k):
            w[:, i] = mask[:, i + k + 1] * (seg[:, i + k + 1] == seg[:, i])
        return w

    rows = (batch["positions"][:, :-1].astype(np.float64), seg[:, :-1])
    prev = _numpy_last(cfg, p, tokens[:, :-1], *rows)
    main = _nll(_rms(prev, p["final_norm"]["scale"], eps) @ p["head"], tokens[:, 1:])
    total, count = np.sum(main * weights(0)), np.sum(weights(0))
    for k in range(1, cfg.mtp_layers + 1):
        m = p[f"mtp_{k - 1}"]
        ahead = np.concatenate([tokens[:, k:], np.zeros((len(tokens), k - 1), np.int64)], 1)[:, :s]
        emb = _rms(p["embedding"][ahead], m["embed_norm"]["scale"], eps)
        joined = np.concatenate([emb, _rms(prev, m["hidden_norm"]["scale"], eps)], -1) @ m["w_proj"]
        prev = _numpy_layer(cfg, m["layer"], joined, *rows)
        target = np.concatenate([tokens[:, k + 1 :], np.zeros((len(tokens), k), np.int64)], 1)[:, :s]
        nll = _nll(_rms(prev, m["norm"]["scale"], eps) @ p["head"], target)
        total += cfg.mtp_weight / cfg.mtp_layers * np.sum(nll * weights(k))
    return float(total / count)


TINY_MTP = dataclasses.replace(TINY_MLA, mtp_layers=2, mtp_weight=0.5)


def test_multi_token_prediction_equals_deepseeks_definition():
    """Two modules on packed rows with uneven masks: the loss (and, by it, what the modules learn from) is the NumPy
    transcription's; the parameter count is the model's."""
    batch = uneven_batch(4, TINY_MTP)
    params = initial(TINY_MTP)
    assert sum(x.size for x in jax.tree.leaves(params)) == TINY_MTP.num_params
    got = jax.jit(lambda p, b: lm_loss(Decoder(TINY_MTP), p, b).mean)(params, batch)
    want = _numpy_mtp_loss(TINY_MTP, params, batch)
    assert abs(float(got) - want) <= 1e-5 * want, (float(got), want)
    plain = jax.jit(lambda p, b: lm_loss(Decoder(TINY_MLA), p, b).mean)(
        {k: v for k, v in params.items() if not k.startswith("mtp_")}, batch
    )
    assert float(got) > float(plain) * 1.2  # the modules' terms are there


@pytest.mark.slow  # the definition's test above is fast; tp splits the modules as it does the layers
@pytest.mark.parametrize("mesh", [{"dp": 2, "cp": 4}])
def test_multi_token_prediction_computes_the_one_device_objective(mesh):
    """Under cp (the shifted tokens, targets and weights in the load-balanced layout with the rest) and tp, stage
    3, packed rows and uneven masks: the one-device gradient."""
    batch = uneven_batch(16, TINY_MTP)
    loss, grads = reference(TINY_MTP, batch)
    got, metrics = applied(zjax.Plan(zjax.make_mesh(**mesh), precision="fp32", stage=3), TINY_MTP, batch)
    assert relative(got, grads) <= 3e-5, relative(got, grads)
    assert abs(float(metrics["loss"]) - loss) <= 3e-5 * loss
