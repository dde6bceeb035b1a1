"""Blockwise integer quantization for what crosses the wire: one fp32 scale per block of the last dim, int8 values
or int4 values packed two to a byte, and the ``Plan(quantized_comm=...)`` grammar that picks them."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from .. import fp8
from ..pallas import quantize as one_pass

DEFAULT_BLOCK = 256
"""Elements per scale: ZeRO++ quantizes weights in blocks of a few hundred to a few thousand elements; 256
keeps the scales at 1.6% of the int8 bytes (3.1% of int4's) and the error per block local."""

BITS = (8, 4)
"""The widths a value can cross the wire in: int8, or int4 (ZeRO++'s qgZ sends gradients as int4)."""

PARTS = ("weights", "grads")
"""What ``Plan(quantized_comm=...)`` can quantize: ZeRO-3's weight gathers and its gradient reductions."""


@dataclasses.dataclass(frozen=True)
class Wire:
    """How a collective's values cross the wire: ``bits`` per value (8, or 4 packed two to a byte) and one fp32
    scale per ``block`` values of the last dim; with ``float8``, e4m3 values under one power-of-two scale for the
    whole gathered tensor (:data:`FLOAT8`)."""

    bits: int = 8
    block: int = DEFAULT_BLOCK
    float8: bool = False

    @property
    def name(self) -> str:
        """``int8``, ``int4``; ``int4@64`` where the block is not :data:`DEFAULT_BLOCK` (the grammar's spelling);
        ``e4m3``."""
        if self.float8:
            return "e4m3"
        return f"int{self.bits}" + (f"@{self.block}" if self.block != DEFAULT_BLOCK else "")


FLOAT8 = Wire(bits=8, block=0, float8=True)
"""How a weight that an fp8 product reads (``matmul="fp8-current"``) crosses a gather: each shard cast to e4m3 with
the tensor's one power-of-two scale (the shards' amaxes max-reduced over the gather's axes), half of bf16's bytes.
The product's own cast of what arrives is then exact (:func:`zjax.fp8.quantize`'s scale is a power of two and no
entry saturates), so its result is the same as from a weight gathered in the compute dtype."""


def parse(value: str | None) -> tuple[Wire | None, Wire | None]:
    """``Plan(quantized_comm=...)`` as ``(weights, grads)`` wires (``None``: that part crosses unquantized).

    ``value`` is ``"+"``-joined parts, each ``"weights"`` or ``"grads"`` with an optional ``":int8"`` (the
    default) or ``":int4"`` and an optional ``"@B"``, the block (values per fp32 scale, default
    :data:`DEFAULT_BLOCK`): ``"weights"``, ``"grads:int4"``, ``"weights+grads:int4"`` (ZeRO++'s pair: int8
    weights, int4 gradients), ``"weights:int4@64+grads"`` (int4 weights in blocks of 64, int8 gradients)."""
    if value is None:
        return None, None
    wires: dict[str, Wire] = {}
    for part in str(value).split("+"):
        spec, _, block = part.partition("@")
        what, _, width = spec.partition(":")
        bits = {"": 8, "int8": 8, "int4": 4}.get(width)
        if what not in PARTS or bits is None or what in wires:
            raise ValueError(
                f"quantized_comm={value!r}: {part!r} is not a part; join 'weights' and/or 'grads' with '+', each "
                "optionally ':int8' (the default) or ':int4' and '@B' for B values per scale, e.g. 'weights', "
                "'weights+grads', 'weights+grads:int4', 'weights:int4@64+grads'."
            )
        size = int(block) if block.isdigit() else 0 if "@" in part else DEFAULT_BLOCK
        if size < 2 or size % 2 and bits == 4:
            raise ValueError(
                f"quantized_comm={value!r}: the block of {part!r} must be a whole number of values per scale, at "
                f"least 2{' and even (int4 packs two values per byte)' if bits == 4 else ''}, e.g. "
                f"'{spec}@64' (default {DEFAULT_BLOCK}; a last dim the block does not divide is one block)."
            )
        wires[what] = Wire(bits, size)
    return wires.get("weights"), wires.get("grads")


def block_size(n: int, block: int) -> int:
    """The block along a last dim of ``n`` elements: ``block`` if it divides ``n``, else the whole dim."""
    return block if n % block == 0 else n


def quantize(
    x: jax.Array, block: int = DEFAULT_BLOCK, bits: int = 8, kernel: bool = True
) -> tuple[jax.Array, jax.Array]:
    """``(q, scales fp32 [..., n / b])`` with ``x ~= q * scale`` per block of ``b`` elements of the last dim
    (symmetric, round to nearest: ``|x - dequantize(q, s)| <= s / 2 = amax / (2 (2^(bits-1) - 1))`` per block,
    ``amax / 254`` for int8, ``amax / 14`` for int4). ``q`` is int8 ``[..., n]``, or for 4 bits uint8
    ``[..., n / 2]`` holding two values per byte (a block's first half in the low nibbles, its second half in
    the high ones); a block of odd length stays int8. Compiled for a GPU, blocks the one-pass Pallas kernel
    takes (:func:`zjax.pallas.quantize_blocks`) go through it, with the same values (``kernel=False``: XLA's
    fusions everywhere, which read ``x`` twice)."""
    if bits not in BITS:
        raise ValueError(f"quantize: bits={bits}; use one of {BITS}.")
    n = x.shape[-1]
    b = block_size(n, block)
    bits = 8 if b % 2 else bits  # an odd block cannot pack pairs: int8 (only a small leaf's whole dim is odd)
    xla = functools.partial(_quantize_xla, block=b, bits=bits)
    if kernel and one_pass.fits(n, b) and 0 < x.size < 2**31:  # the kernel's offsets are int32
        return jax.lax.platform_dependent(
            x, cuda=functools.partial(one_pass.quantize_blocks, block=b, bits=bits), default=xla
        )
    return xla(x)


def _quantize_xla(x: jax.Array, block: int, bits: int) -> tuple[jax.Array, jax.Array]:
    n, b = x.shape[-1], block
    top = 2 ** (bits - 1) - 1
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], n // b, b)
    # a non-finite block keeps a non-finite scale, so it stays non-finite (loss scaling skips such a step): x * 0
    # is NaN for inf and NaN, and XLA:CPU's vectorized maximum can drop a NaN
    amax = jnp.max(jnp.abs(blocks), axis=-1) + jnp.sum(blocks * 0.0, axis=-1)
    scale = jnp.where(amax == 0, 1.0, amax / top)
    q = jnp.clip(jnp.round(blocks / scale[..., None]), -top, top).astype(jnp.int8)
    if bits == 4:
        return _pack(q).reshape(*x.shape[:-1], n // 2), scale
    return q.reshape(x.shape), scale


def dequantize(q: jax.Array, scale: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The values ``q * scale`` (per block of the last dim) in ``dtype``; ``q`` as :func:`quantize` made it (int8,
    or uint8 with two int4 values per byte)."""
    nb = scale.shape[-1]
    blocks = q.reshape(*q.shape[:-1], nb, q.shape[-1] // nb)
    if q.dtype == jnp.uint8:
        blocks = _unpack(blocks)
    values = blocks.astype(jnp.float32) * scale[..., None]
    return values.reshape(*q.shape[:-1], -1).astype(dtype)


def _pack(blocks: jax.Array) -> jax.Array:
    """int8 values in [-7, 7], ``[..., blocks, b]`` (b even), as uint8 ``[..., blocks, b / 2]``: two's-complement
    nibbles, a block's first half low and its second half high (unpacking is then a concatenation, which fuses
    into the dequantization; interleaved pairs measured slower on an H100)."""
    nibbles = blocks.astype(jnp.uint8) & 0xF
    half = blocks.shape[-1] // 2
    return nibbles[..., :half] | (nibbles[..., half:] << 4)


def _unpack(packed: jax.Array) -> jax.Array:
    """:func:`_pack`'s bytes ``[..., blocks, b / 2]`` back as int8 values ``[..., blocks, b]``."""
    byte = jax.lax.bitcast_convert_type(packed, jnp.int8)
    return jnp.concatenate([jnp.left_shift(byte, 4) >> 4, byte >> 4], axis=-1)  # arithmetic shifts sign-extend


def all_gather(x: jax.Array, axes: str | tuple[str, ...], dim: int, wire: Wire | None) -> jax.Array:
    """``x`` all-gathered over ``axes`` along ``dim`` (tiled, inside a manual region): as it is (``wire`` ``None``)
    or as ``wire``'s integer blocks with their fp32 scales (or e4m3 values under one scale, :data:`FLOAT8`),
    dequantized to ``x``'s dtype on arrival."""
    if wire is None:
        return jax.lax.all_gather(x, axes, axis=dim, tiled=True)
    if wire.float8:
        amax = jax.lax.pmax(jnp.max(jnp.abs(x)).astype(jnp.float32), axes)
        q8, scale = fp8.quantize(x, jnp.float8_e4m3fn, amax)
        return (jax.lax.all_gather(q8, axes, axis=dim, tiled=True).astype(jnp.float32) * scale).astype(x.dtype)
    q, scale = quantize(x, wire.block, wire.bits)
    q = jax.lax.all_gather(q, axes, axis=dim, tiled=True)
    scale = jax.lax.all_gather(scale, axes, axis=dim, tiled=True)
    return dequantize(q, scale, x.dtype)
