"""The one place that knows which Pallas GPU backend zjax uses.

jax 0.10's ``pallas_call`` lowers to Triton when given Triton compiler params; without them the GPU
default is Mosaic GPU (sm90+), which rejects 1-D blocks over 256 elements. Newer jax deprecates the
Triton path in favour of Mosaic GPU: when that happens, only this file changes.
"""

from __future__ import annotations

from jax.experimental.pallas import triton as pl_triton

TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"


def compiler_params(num_warps: int, num_stages: int) -> pl_triton.CompilerParams:
    return pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def load(ref, mask, other=0.0):
    """Masked load of a ref view (``ref.at[pl.ds(...)]``)."""
    return pl_triton.load(ref, mask=mask, other=other)


def store(ref, value, mask) -> None:
    """Masked store into a ref view."""
    pl_triton.store(ref, value, mask=mask)
