"""Blockwise int8/int4 quantization in one pass: a Pallas kernel beside :func:`zjax.comm.quantize`'s XLA path.

XLA computes a block's absolute maximum in one fusion and the division in another, so it reads every value
twice (55-65% of a copy's bandwidth on an H100, ``docs/benchmarks.md``). Each program here loads ``blocks``
whole blocks once, reduces them in registers and writes the integers and their scales: one read, one write.
Its values are the XLA path's (the same division, round half to even), bit for bit: in interpret mode (tested)
and on an H100 over 268M values, int8 and int4, from bf16 and fp32 (``benchmarks/gpu_suite.py --codec``), where
it runs 1.3-1.6x faster. ``zjax.comm.quantize`` takes it wherever it is compiled for a GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._backend import compiler_params

TRITON_NAME = "zjax_quantize_int"
"""The start of the kernel's name in a compiled program (``zjax_quantize_int8``, ``zjax_quantize_int4``)."""


@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
    """Launch configuration: ``blocks`` quantization blocks per program (a power of two; fewer where the
    number of blocks is not a multiple) and Triton's ``num_warps``."""

    blocks: int = 16
    num_warps: int = 4

    def __post_init__(self) -> None:
        if self.blocks < 1 or self.blocks & (self.blocks - 1) or self.num_warps < 1:
            raise ValueError(
                f"QuantizeConfig: blocks={self.blocks} must be a power of two and num_warps={self.num_warps} >= 1."
            )


def fits(n: int, block: int) -> bool:
    """Whether the kernel takes a last dim of ``n`` in blocks of ``block``: a power-of-two block (Triton's
    tiles) of at least 16 elements that divides ``n``."""
    return block >= 16 and not block & (block - 1) and n % block == 0


def quantize_blocks(
    x: jax.Array, block: int, bits: int, config: QuantizeConfig = QuantizeConfig(), interpret: bool = False
) -> tuple[jax.Array, jax.Array]:
    """:func:`zjax.comm.quantize`'s ``(q, scales)`` for ``x`` (last dim a multiple of ``block``, see
    :func:`fits`): int8 ``[..., n]``, or for ``bits=4`` uint8 ``[..., n / 2]`` with a block's first half in the
    low nibbles and its second half in the high ones."""
    n = x.shape[-1]
    if not fits(n, block) or bits not in (8, 4):
        raise ValueError(
            f"quantize_blocks: a last dim of {n} in blocks of {block} at {bits} bits; the kernel takes a "
            "power-of-two block of at least 16 dividing the last dim, at 8 or 4 bits (zjax.comm.quantize takes any)."
        )
    rows = x.size // block
    group = min(config.blocks, rows & -rows)  # the largest power of two dividing the rows, at most config.blocks
    width = block if bits == 8 else block // 2
    call = pl.pallas_call(
        functools.partial(_kernel, top=2 ** (bits - 1) - 1, bits=bits),
        out_shape=(
            jax.ShapeDtypeStruct((rows, width), jnp.int8 if bits == 8 else jnp.uint8),
            jax.ShapeDtypeStruct((rows,), jnp.float32),
        ),
        grid=(rows // group,),
        in_specs=[pl.BlockSpec((group, block), lambda i: (i, 0))],
        out_specs=(pl.BlockSpec((group, width), lambda i: (i, 0)), pl.BlockSpec((group,), lambda i: (i,))),
        interpret=interpret,
        compiler_params=compiler_params(config.num_warps, 1),
        name=f"{TRITON_NAME}{bits}",
    )
    q, scale = call(x.reshape(rows, block))
    return q.reshape(*x.shape[:-1], n * width // block), scale.reshape(*x.shape[:-1], n // block)


def _kernel(x_ref, q_ref, s_ref, *, top: int, bits: int):
    if bits == 8:
        parts = [x_ref[...].astype(jnp.float32)]
    else:  # a block's halves, loaded apart: they become the low and the high nibbles
        half = x_ref.shape[1] // 2
        parts = [x_ref[:, pl.ds(i * half, half)].astype(jnp.float32) for i in range(2)]
    amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(p), axis=1) for p in parts])
    # as zjax.comm.quantize: a non-finite value makes its block's scale NaN (Triton's maximum drops NaNs)
    amax = amax + functools.reduce(jnp.add, [jnp.sum(p * 0.0, axis=1) for p in parts])
    scale = jnp.where(amax == 0, 1.0, amax / top)
    qs = [jnp.clip(_round(p / scale[:, None]), -top, top).astype(jnp.int8) for p in parts]
    if bits == 8:
        q_ref[...] = qs[0]
    else:
        low, high = (v.astype(jnp.uint8) & 0xF for v in qs)
        q_ref[...] = low | (high << 4)
    s_ref[...] = scale


def _round(v: jax.Array) -> jax.Array:
    """``jnp.round`` (half to even) from ``floor``, which Triton lowers (it has no rounding primitive):
    ``v - floor(v)`` is exact, so the comparisons with 0.5 are too."""
    down = jnp.floor(v)
    frac = v - down
    odd = down - 2.0 * jnp.floor(down * 0.5) != 0
    return down + ((frac > 0.5) | ((frac == 0.5) & odd)).astype(v.dtype)
