"""The training state: two persistent pytrees (compute params, optimizer state) and a few scalars."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import optax
from flax import struct

from ._loss_scale import LossScaleState
from ._rows import layout_html


class MixedPrecisionState(NamedTuple):
    """What the optimizer owns: fp32 master weights (``None`` when compute is fp32) and the inner state."""

    master: Any
    inner: optax.OptState


class Variables(NamedTuple):
    """What an ``init_fn`` returns for a model with non-trainable state: ``Variables(params, model_state)``.

    Example:
      >>> init_fn = lambda r: zjax.Variables.linen(model.init(r, x))          # batch_stats etc.
      >>> init_fn = lambda r: zjax.Variables.nnx(Model(rngs=nnx.Rngs(r)))     # BatchNorm, Dropout
    """

    params: Any
    model_state: Any

    @classmethod
    def linen(cls, variables: Any) -> Variables:
        """Split a linen ``model.init(...)`` result: ``"params"`` are trained, every other collection is state."""
        if not isinstance(variables, Mapping) or "params" not in variables:
            raise TypeError(
                "Variables.linen: expected the dict that linen's model.init returns (with a 'params' "
                f"collection), got {type(variables).__name__}."
            )
        rest = {k: v for k, v in variables.items() if k != "params"}
        return cls(variables["params"], rest or None)

    @classmethod
    def nnx(cls, module: Any) -> Variables:
        """Split an nnx module: its ``nnx.Param`` variables are trained, all other state is model state."""
        from flax import nnx

        parts: Any = nnx.split(module, nnx.Param, ...)
        params, rest = parts[1], parts[2]
        return cls(params, rest if jax.tree.leaves(rest) else None)


class TrainState(struct.PyTreeNode):
    """A flax-style training state, a pytree that works with ``jax.tree`` tools and orbax.

    Attributes:
      step: int32 scalar, incremented by every step (skipped ones too).
      params: the compute parameters (bf16/fp16/fp32), in the layout the plan's stage gives them; with
        ``Plan(compute_copy=False)`` the fp32 weights themselves (each step casts them).
      opt_state: :class:`MixedPrecisionState` with the fp32 master weights (``None`` when ``params`` are
        the fp32 weights) and the optax state.
      loss_scale: dynamic loss scale (constant 1 unless the precision scales the loss).
      rng: a PRNG key (typed, e.g. from ``jax.random.key``) that each step splits: the step passes a fresh
        key to a ``loss_fn`` that takes ``rng`` (dropout), and a resumed run draws the same keys.
      tx: the inner optax transformation (static).
      model_state: non-trainable model state (linen collections such as ``batch_stats``; nnx variables
        that are not ``nnx.Param``, e.g. BatchNorm statistics and RNG state), never differentiated,
        passed to and returned from a loss that takes ``model_state`` (see :meth:`zjax.Plan.train_step`).
        ``None`` when the model has none.
      layout: the :class:`zjax.StateLayout` (static): where every leaf lives. Built once by
        ``plan.init`` / ``plan.abstract_state`` / a restore / ``plan.reshard``; the step reads it.
    """

    step: jax.Array
    params: Any
    opt_state: MixedPrecisionState
    loss_scale: LossScaleState
    rng: jax.Array
    tx: optax.GradientTransformation = struct.field(pytree_node=False)
    model_state: Any = None
    layout: Any = struct.field(pytree_node=False, default=None)

    def _repr_html_(self) -> str:
        """In Jupyter: every parameter's placement and bytes per device (its layout, with its dtypes)."""
        if self.layout is None:
            return f"<pre>TrainState without a layout (step {self.step})</pre>"
        return layout_html(self.layout, self)

    @property
    def master_params(self) -> Any:
        """The fp32 parameters the optimizer updates (the compute params themselves in fp32)."""
        master = self.opt_state.master
        return self.params if master is None else master
