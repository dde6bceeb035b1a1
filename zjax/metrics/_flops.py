"""Model FLOPs per token and MFU: the analytic count (PaLM's convention) against the device's peak."""

from __future__ import annotations

from ..models import DecoderConfig
from ..planner._targets import peak_flops


def matmul_params(cfg: DecoderConfig, fp8_only: bool = False) -> int:
    """Parameters that take part in a matmul per token: every layer's projections and the output head
    (the embedding lookup is a gather; norms and biases are negligible and left out). A mixture of experts counts
    the experts a token passes through (``top_k``), the router and shared experts: its active parameters.
    ``fp8_only``: those whose products run in fp8 (``DecoderConfig.matmul``: the attention and dense MLP
    projections; none under ``"default"``)."""
    kv = cfg.num_kv_heads * cfg.head_dim
    if cfg.mla is None:
        attn = 2 * cfg.embed * cfg.heads * cfg.head_dim + 2 * cfg.embed * kv
    else:  # the latents' norms are in the count (negligible)
        attn = cfg.mla.params_per_layer(cfg.embed, cfg.heads)
    dense = 3 * cfg.embed * cfg.mlp
    ff = dense if cfg.moe is None else cfg.moe.active_per_layer(cfg.embed, cfg.mlp)
    moe_layers = cfg.layers - cfg.dense_layers if cfg.moe is not None else 0
    if fp8_only:
        return 0 if cfg.matmul == "default" else cfg.layers * attn + (cfg.layers - moe_layers) * dense
    return cfg.layers * attn + (cfg.layers - moe_layers) * dense + moe_layers * ff + cfg.embed * cfg.vocab


def flops_per_token(cfg: DecoderConfig, seq_len: int) -> float:
    """Training FLOPs per token: ``6 * matmul_params + 6 * layers * heads * (head_dim + v_dim) * seq_len``.

    Forward 2 FLOPs per matmul parameter, backward twice that; attention's two ``[S, S]`` products count
    ``2 * heads * (head_dim + v_dim) * S`` per token forward (``v_dim``: ``head_dim``, or MLA's ``v_head_dim``;
    the full square, as PaLM's MFU does, not the causal half). Rematerialization is not counted: MFU measures
    the model's work, not the recomputation.
    """
    v_dim = cfg.head_dim if cfg.mla is None else cfg.mla.v_head_dim
    return 6.0 * matmul_params(cfg) + 6.0 * cfg.layers * cfg.heads * (cfg.head_dim + v_dim) * seq_len


def mfu(
    tokens_per_second: float,
    cfg: DecoderConfig,
    seq_len: int,
    device_kind: str,
    devices: int,
    bf16_peak: bool = False,
) -> float | None:
    """Model FLOPs utilization, or ``None`` when the device's peak is unknown (a CPU): never a made-up number.

    The model's FLOPs per token at peak take ``flops / peak`` seconds; the fp8 products' share (``matmul`` other
    than ``"default"``, :func:`matmul_params`) runs at the device's fp8 peak, so MFU is the share of the devices'
    time those seconds fill. ``bf16_peak``: every product counted at the bf16 peak, as published fp8 training
    figures usually are (higher than the former; ``None`` on a device without fp8 tensor cores for an fp8 model
    unless ``bf16_peak``).
    """
    peak = peak_flops(device_kind)
    if peak is None or devices < 1:
        return None
    total = flops_per_token(cfg, seq_len)
    fp8 = 0.0 if bf16_peak else 6.0 * matmul_params(cfg, fp8_only=True)
    fp8_peak = peak_flops(device_kind, fp8=True) if fp8 else peak
    if fp8_peak is None:
        return None
    return tokens_per_second * ((total - fp8) / peak + fp8 / fp8_peak) / devices
