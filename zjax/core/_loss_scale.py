"""Dynamic loss scaling for fp16 training (Micikevicius et al., "Mixed Precision Training", ICLR'18).

The loss is multiplied by ``scale`` before differentiation so that small gradients survive fp16's range;
gradients are divided by it in fp32. A step whose gradients hold an inf/NaN is skipped (parameters and
optimizer state unchanged) and the scale is divided by ``factor``; after ``growth_interval``
consecutive finite steps it is multiplied by ``factor``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp


class LossScaleState(NamedTuple):
    """The loss scale and the number of finite steps since it last changed."""

    scale: jax.Array  # float32 scalar
    good_steps: jax.Array  # int32 scalar


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """Configuration of dynamic loss scaling.

    Attributes:
      initial: starting scale.
      growth_interval: finite steps in a row before the scale grows.
      factor: growth and back-off factor.
      minimum: the scale never drops below this.
    """

    initial: float = 2.0**15
    growth_interval: int = 2000
    factor: float = 2.0
    minimum: float = 1.0

    def __post_init__(self) -> None:
        if not self.initial > 0 or not self.minimum > 0:
            raise ValueError(f"DynamicLossScale: initial={self.initial} and minimum={self.minimum} must be > 0.")
        if self.factor <= 1:
            raise ValueError(f"DynamicLossScale: factor={self.factor} must be > 1.")
        if self.growth_interval < 1:
            raise ValueError(f"DynamicLossScale: growth_interval={self.growth_interval} must be >= 1.")

    def init(self, enabled: bool) -> LossScaleState:
        scale = self.initial if enabled else 1.0
        return LossScaleState(jnp.asarray(scale, jnp.float32), jnp.asarray(0, jnp.int32))

    def update(self, state: LossScaleState, finite: jax.Array) -> LossScaleState:
        """The next state after a step whose gradients were ``finite`` (a bool scalar)."""
        grown = state.good_steps + 1 >= self.growth_interval
        scale = jnp.where(
            finite,
            jnp.where(grown, state.scale * self.factor, state.scale),
            jnp.maximum(state.scale / self.factor, self.minimum),
        ).astype(jnp.float32)
        good = jnp.where(finite & ~grown, state.good_steps + 1, 0).astype(jnp.int32)
        return LossScaleState(scale, good)
