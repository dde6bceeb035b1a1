"""Precision policies: the dtype of compute parameters and whether fp32 master weights exist."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Precision:
    """A mixed-precision policy.

    Attributes:
      name: registry name.
      compute_dtype: dtype of the parameters the model computes with, and of their gradients.
      master_weights: keep fp32 master weights in the optimizer state (and update those), casting the
        result to ``compute_dtype`` after each step. Off for fp32, where the parameters are the master.
      loss_scaling: use dynamic loss scaling (fp16: its 5-bit exponent underflows small gradients).
    """

    name: str
    compute_dtype: Any
    master_weights: bool
    loss_scaling: bool

    @property
    def compute_bytes(self) -> int:
        return jnp.dtype(self.compute_dtype).itemsize

    @classmethod
    def from_value(cls, value: Any) -> Precision:
        """A precision from its name (``"fp32"``, ``"bf16"``, ``"fp16"``) or itself.

        Raises:
          ValueError: for an unknown name, listing the valid ones.
        """
        if isinstance(value, Precision):
            return value
        if not isinstance(value, str) or value.lower() not in PRECISIONS:
            raise ValueError(f"Unknown precision {value!r}; valid names are {sorted(PRECISIONS)}.")
        return PRECISIONS[value.lower()]


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("fp32", jnp.float32, master_weights=False, loss_scaling=False),
        Precision("bf16", jnp.bfloat16, master_weights=True, loss_scaling=False),
        Precision("fp16", jnp.float16, master_weights=True, loss_scaling=True),
    )
}
