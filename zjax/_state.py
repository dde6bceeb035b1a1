"""The training state: two persistent pytrees (compute params, optimizer state) and a few scalars."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax
from flax import struct

from ._loss_scale import LossScaleState


class MixedPrecisionState(NamedTuple):
    """What the optimizer owns: fp32 master weights (``None`` when compute is fp32) and the inner state."""

    master: Any
    inner: optax.OptState


class TrainState(struct.PyTreeNode):
    """A flax-style training state, a pytree that works with ``jax.tree`` tools and orbax.

    Attributes:
      step: int32 scalar, incremented by every step (skipped ones too).
      params: the compute parameters (bf16/fp16/fp32), in the layout the plan's stage gives them.
      opt_state: :class:`MixedPrecisionState` with the fp32 master weights and the optax state.
      loss_scale: dynamic loss scale (constant 1 unless the precision scales the loss).
      rng: a PRNG key (typed, e.g. from ``jax.random.key``) that each step splits: the step passes a fresh
        key to a ``loss_fn`` that takes ``rng`` (dropout), and a resumed run draws the same keys.
      tx: the inner optax transformation (static).
    """

    step: jax.Array
    params: Any
    opt_state: MixedPrecisionState
    loss_scale: LossScaleState
    rng: jax.Array
    tx: optax.GradientTransformation = struct.field(pytree_node=False)

    @property
    def master_params(self) -> Any:
        """The fp32 parameters the optimizer updates (the compute params themselves in fp32)."""
        master = self.opt_state.master
        return self.params if master is None else master
