"""FP8 matrix products with per-tensor current scaling: e4m3 operands forward, e5m2 gradients backward.

``matmul(x, w)`` computes ``x @ w`` with both operands cast to ``float8_e4m3fn`` after dividing each by its scale
(its absolute maximum over the format's largest value, rounded up to a power of two, this call's own: *current*
scaling, Transformer Engine's default recipe), the product accumulated in fp32 and multiplied back by the two
scales. The backward pass casts the incoming gradient to ``float8_e5m2`` (wider range, for gradients) the same way
and forms both products from it and the forward's saved fp8 operands (half the bytes of bf16 residuals):
``dx = g @ w.T`` and ``dw = x.T @ g``.

The weight is cast where it lies, in its own shape, and the products contract its own dims: under ZeRO-3 its
shards are cast (with the tensor's one scale, their amaxes max-reduced) before XLA gathers them, so the gathers
move fp8; ``dw`` is made in the weight's dtype, so its reduce-scatter moves what it moves without fp8.

XLA:GPU lowers a dot whose operands are fp8 to an fp8 GEMM on Hopper and Blackwell tensor cores (a Triton GEMM
fusion or cuBLASLt's fp8 matmul); XLA:CPU computes the same products exactly in fp32, which is how the numerics
are tested without a GPU. The operands are quantized explicitly (not a quantize-dequantize pair for XLA to
pattern-match): XLA's excess-precision simplification removes such pairs before the GEMM rewrite sees them
(measured, jax 0.10.2: a deviceless H100 compile then multiplies in bf16).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.shard_alike import shard_alike

F32 = jnp.float32
E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2

MATMULS = {
    "default": "the compute dtype's matmul (bf16, fp16 or fp32)",
    "fp8-current": "e4m3 operands, e5m2 gradients, per-tensor scales from this step's amax",
    "fp8-delayed": "the same formats, each tensor's scale from its amax history (zjax.fp8.matmul_delayed)",
    "mxfp8": "e4m3 values, e5m2 gradients, one e8m0 scale per 32 values (zjax.fp8.matmul_mx; Blackwell)",
}
"""The matrix-product recipes of a model's projections (``DecoderConfig(matmul=...)``)."""


def pow2_scale(amax: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The smallest power of two at least ``amax / max(dtype)`` (fp32, elementwise; 1 where ``amax`` is 0)."""
    amax = jnp.asarray(amax, F32)
    mantissa, exponent = jnp.frexp(amax / jnp.asarray(jnp.finfo(dtype).max, F32))  # mantissa in [0.5, 1)
    return jnp.where(amax > 0, jnp.ldexp(jnp.float32(1.0), jnp.where(mantissa == 0.5, exponent - 1, exponent)), 1.0)


def quantize(x: jax.Array, dtype: jnp.dtype, amax: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """``(x / scale in dtype, scale)``: ``scale`` (fp32) the smallest power of two at least ``amax(|x|) / max(dtype)``
    (1 for an all-zero ``x``), so that no entry saturates and every rescale by it, in any float dtype, is exact
    (the largest entry lands in the format's top binade: a floating format's relative precision does not depend
    on where in its range a value lies, so rounding the scale up to a power of two loses none). ``amax``: the
    whole tensor's, when ``x`` is a shard of it (every shard then takes the one scale)."""
    scale = pow2_scale(jnp.max(jnp.abs(x)) if amax is None else amax, dtype)
    return (x.astype(F32) / scale).astype(dtype), scale


def _dot(a: jax.Array, b: jax.Array, dims: tuple[Sequence[int], Sequence[int]], out: Any = F32) -> jax.Array:
    contracting = (tuple(dims[0]), tuple(dims[1]))
    return jax.lax.dot_general(a, b, (contracting, ((), ())), preferred_element_type=out)


def contract_dims(ndim: int, contract: int) -> tuple[range, range]:
    """The forward product's contracting dims: ``x``'s last ``contract`` with ``w``'s first."""
    return range(ndim - contract, ndim), range(contract)


def product(a: jax.Array, b: jax.Array, scale: jax.Array, dims: tuple[Sequence[int], Sequence[int]], dtype: Any,
            accumulate: Any = F32) -> jax.Array:  # fmt: skip
    """``a . b`` over ``dims`` (accumulated in ``accumulate``) times ``scale``, in ``dtype``; in ``accumulate``'s
    dtype the rescale is exact (a power of two), so a weight gradient made in the weight's dtype reduces in it."""
    return (_dot(a, b, dims, accumulate) * scale.astype(accumulate)).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x: jax.Array, w: jax.Array, contract: int) -> jax.Array:
    return _forward(x, w, contract)[0]


def _forward(x: jax.Array, w: jax.Array, contract: int):
    xq, sx = quantize(x, E4M3)
    # cast where the weight lies, in its own shape: ZeRO-3's gathers (and any reshard) then move fp8, not bf16
    wq, sw = quantize(w, E4M3)
    wq = shard_alike(wq, w)[0]
    y = product(xq, wq, sx * sw, contract_dims(x.ndim, contract), x.dtype)
    # zero-size arrays carry the operands' dtypes for the gradients
    return y, (xq, sx, wq, sw, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _backward(contract: int, res, g: jax.Array):
    xq, sx, wq, sw, x_like, w_like = res
    lead = xq.ndim - contract
    gq, sg = quantize(g, E5M2)
    # [*lead, *out] x [*inner, *out] -> [*lead, *inner]
    dx = product(gq, wq, sg * sw, (range(lead, g.ndim), range(contract, wq.ndim)), x_like.dtype)
    # [*lead, *inner] x [*lead, *out] -> [*inner, *out], in w's dtype and rescaled there (exact: a power of two):
    # with the rows split over the data axes this product is a partial sum that XLA reduces (ZeRO's reduce-scatter)
    # in its dtype, and fp32 would double those bytes
    dw = product(xq, gq, sx * sg, (range(lead), range(lead)), w_like.dtype, w_like.dtype)
    return dx, dw


_matmul.defvjp(_forward, _backward)


def check_operands(what: str, x: jax.Array, w: jax.Array, contract: int) -> None:
    """The operands' shapes meet (``x``'s last ``contract`` dims are ``w``'s first) and neither is fp16."""
    inner = x.shape[x.ndim - contract :]
    if tuple(w.shape[:contract]) != tuple(inner):
        raise ValueError(
            f"{what}: x {tuple(x.shape)} contracts its last {contract} dims {tuple(inner)} with w "
            f"{tuple(w.shape)}'s first {contract}; they differ."
        )
    if jnp.float16 in (x.dtype, w.dtype):
        raise ValueError(
            f"{what}: x {tuple(x.shape)} {x.dtype} @ w {tuple(w.shape)} {w.dtype}: fp8 products take bf16 "
            "or fp32 operands, not fp16 (whose loss scaling fp8's own per-tensor scales would fight). Train in "
            "bf16 (Plan(precision='bf16'), --precision bf16), or keep fp16 with matmul='default'."
        )


@functools.partial(jax.named_call, name="fp8_matmul")
def matmul(x: jax.Array, w: jax.Array, contract: int = 1) -> jax.Array:
    """``x [..., K] @ w [K, ...]`` in fp8 with current scaling (the module's docstring), contracting the last
    ``contract`` dimensions of ``x`` with the first ``contract`` of ``w``; the result in ``x``'s dtype.

    Example:
      >>> q = zjax.fp8.matmul(h, wq)  # h [b, s, embed], wq [embed, heads, head_dim] -> [b, s, heads, head_dim]
      >>> y = zjax.fp8.matmul(attn, wo, contract=2)   # attn [b, s, heads, head_dim], wo [heads, head_dim, embed]
    """
    check_operands("zjax.fp8.matmul", x, w, contract)
    return _matmul(x, w, contract)
