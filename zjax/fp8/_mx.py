"""MXFP8 matrix products: e4m3 values in blocks of 32 along the contracting dim, each block with its own power-of-two
scale in ``float8_e8m0fnu`` (the OCP Microscaling format; Blackwell's tensor cores multiply it natively).

``matmul_mx(x, w)`` quantizes ``x`` in blocks along its last contracting dim and ``w`` along its own, and forms the
product with ``jax.lax.scaled_dot``, which XLA:GPU lowers to a Triton block-scaled GEMM (a ``scaled-dot`` fusion)
and XLA:CPU computes exactly in fp32. A block's scale is the smallest power of two at least its amax over the
format's largest value, so nothing saturates. The backward pass quantizes the incoming gradient to e5m2 and
re-blocks each operand along the dims its product contracts (``dx = g w^T`` along the output dim, ``dw = x^T g``
along the sequence), as MXFP8 recipes do: the forward's blocks run along the other dim. It keeps ``x`` and ``w``
(bf16) for that, the bytes of two fp8 copies.

Every blocked dim is a multiple of :data:`BLOCK`: the projections' inputs and outputs (embed, heads x head_dim,
mlp) and the rows' sequence length.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.shard_alike import shard_alike

from ._matmul import E4M3, E5M2, F32, check_operands, pow2_scale

BLOCK = 32
"""Values per MXFP8 scale (the OCP MX block)."""

E8M0 = jnp.float8_e8m0fnu


def quantize_blocks(x: jax.Array, axis: int, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """``(x / scales in dtype, scales in e8m0)``, one scale per :data:`BLOCK` values along ``axis`` (the scales'
    shape is ``x``'s with that dim divided by the block)."""
    axis %= x.ndim
    shape = x.shape
    blocks = x.astype(F32).reshape(*shape[:axis], shape[axis] // BLOCK, BLOCK, *shape[axis + 1 :])
    # e8m0 holds 2^-127 .. 2^127: a block that small is zeros to e4m3 anyway
    scale = jnp.maximum(pow2_scale(jnp.max(jnp.abs(blocks), axis=axis + 1), dtype), 2.0**-127)
    q = (blocks / jnp.expand_dims(scale, axis + 1)).astype(dtype).reshape(shape)
    return q, scale.astype(E8M0)


def _matrix(quantized: tuple[jax.Array, jax.Array], split: int) -> tuple[jax.Array, jax.Array]:
    """Values and scales as matrices, the dims before ``split`` as rows (``jax.lax.scaled_dot`` takes operands of
    one rank): reshaped after quantizing, so a weight's quantization runs where its shards lie."""
    return tuple(a.reshape(math.prod(a.shape[:split]), math.prod(a.shape[split:])) for a in quantized)  # type: ignore[return-value]


def _scaled(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array], contracting: tuple[int, int], out: Any):
    numbers = (((contracting[0],), (contracting[1],)), ((), ()))
    return jax.lax.scaled_dot(
        a[0], b[0], lhs_scale=a[1], rhs_scale=b[1], dimension_numbers=numbers, preferred_element_type=out
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x: jax.Array, w: jax.Array, contract: int) -> jax.Array:
    return _forward(x, w, contract)[0]


def _forward(x: jax.Array, w: jax.Array, contract: int):
    lead = x.ndim - contract
    wq, ws = quantize_blocks(w, contract - 1, E4M3)  # along its last contracting dim, in its own shape
    wq = shard_alike(wq, w)[0]  # quantized where the weight lies: ZeRO-3's gathers move fp8
    xm, wm = _matrix(quantize_blocks(x, -1, E4M3), lead), _matrix((wq, ws), contract)
    y = _scaled(xm, wm, (1, 0), F32)  # [M, K] . [K, N]
    return y.reshape(*x.shape[:lead], *w.shape[contract:]).astype(x.dtype), (x, w)


def _backward(contract: int, res, g: jax.Array):
    x, w = res
    lead = x.ndim - contract
    # dx [M, K] = g [M, N] . w [K, N]^T, blocks along the output dim (the last of g and of w)
    gm, wm = _matrix(quantize_blocks(g, -1, E5M2), lead), _matrix(quantize_blocks(w, -1, E4M3), contract)
    dx = _scaled(gm, wm, (1, 1), F32).reshape(x.shape).astype(x.dtype)
    # dw [K, N] = x [M, K]^T . g [M, N], blocks along the rows (the sequence: its last lead dim)
    xr, gr = _matrix(quantize_blocks(x, lead - 1, E4M3), lead), _matrix(quantize_blocks(g, lead - 1, E5M2), lead)
    dw = _scaled(xr, gr, (0, 0), w.dtype).reshape(w.shape)
    return dx, dw


_matmul.defvjp(_forward, _backward)


def check_blocks(what: str, x: Any, w: Any, contract: int) -> None:
    """Every dim an MXFP8 product blocks is a multiple of :data:`BLOCK` (a ``ValueError`` naming it otherwise)."""
    lead = len(x.shape) - contract
    blocked = {
        f"x {tuple(x.shape)}'s last dim (the forward's contraction)": x.shape[-1],
        f"w {tuple(w.shape)}'s last dim (the input gradient's contraction)": w.shape[-1],
        f"x {tuple(x.shape)}'s dim {lead - 1} (the rows' sequence: the weight gradient's contraction)": (
            x.shape[lead - 1] if lead >= 1 else BLOCK
        ),
    }
    for name, size in blocked.items():
        if size % BLOCK:
            raise ValueError(
                f"{what}: mxfp8 scales blocks of {BLOCK} values, and {name} has {size}, not a multiple of "
                f"{BLOCK}. Pad that dim to a multiple of {BLOCK} (the sequence: --seq-len), or use "
                "matmul='fp8-current' (one scale per tensor)."
            )


def check_device(recipe: str, device: str, capability: tuple[int, int] | None, devices: int = 1) -> None:
    """Whether a recipe runs on ``devices`` GPUs of a kind (``capability`` ``None``: not a GPU, e.g. the CPU
    computing the numerics: anything goes). MXFP8 needs Blackwell's block-scaled tensor cores (compute capability
    10.0 or later), and one GPU: jax 0.10's partitioners cannot split XLA's ``scaled-dot`` yet (a sharded program
    fails to compile under Shardy, "Unable to convert MHLO to StableHLO"; GSPMD replicates its operands, measured:
    13x bf16's all-gather bytes on the tiny preset at stage 3 over dp=8).

    Raises:
      ValueError: MXFP8 on a GPU before Blackwell, or across GPUs.
    """
    if recipe != "mxfp8" or capability is None:
        return
    if tuple(capability) < (10, 0):
        raise ValueError(
            f"matmul='mxfp8' on {device} (compute capability {capability[0]}.{capability[1]}): MXFP8's block-scaled "
            "products run on Blackwell's tensor cores (10.0 or later: B200, GB200); earlier GPUs would emulate "
            "them. Use matmul='fp8-current' or 'fp8-delayed' there, or plan for a Blackwell target (--target b200)."
        )
    if devices > 1:
        raise ValueError(
            f"matmul='mxfp8' on {devices} x {device}: jax 0.10's partitioners cannot split XLA's block-scaled "
            "product (scaled-dot) yet: a sharded program fails to compile under Shardy and GSPMD replicates its "
            "operands. MXFP8 runs on one GPU (and on CPU, for its numerics); across GPUs use matmul='fp8-current'."
        )


@functools.partial(jax.named_call, name="mxfp8_matmul")
def matmul_mx(x: jax.Array, w: jax.Array, contract: int = 1) -> jax.Array:
    """``x @ w`` as :func:`zjax.fp8.matmul` (the last ``contract`` dims of ``x`` with the first of ``w``; the result
    in ``x``'s dtype), in MXFP8 (the module's docstring): one e8m0 scale per 32 values.

    Example:
      >>> y = zjax.fp8.matmul_mx(h, w_up)  # h [b, s, embed], w_up [embed, mlp]: embed, mlp and s multiples of 32
    """
    check_operands("zjax.fp8.matmul_mx", x, w, contract)
    check_blocks("zjax.fp8.matmul_mx", x, w, contract)
    return _matmul(x, w, contract)
