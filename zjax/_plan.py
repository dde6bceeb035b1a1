"""``Plan``: one frozen object that says how a model trains on a mesh (stage, precision, rules)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._loss_scale import DynamicLossScale, LossScaleState
from ._memory import MemoryReport, memory_report
from ._precision import Precision
from ._state import MixedPrecisionState, TrainState
from ._step import LossFn, TrainStep
from .pipeline import Pipeline
from .sharding._annotations import read_leaves, unbox
from .sharding._axes import DP, MESH_AXES, PP
from .sharding._batch import shard_batch
from .sharding._mesh import axis_size
from .sharding._rules import Rules
from .stages._layout import Layout, Unsharded
from .stages._stage import Stage

_STATE_RNG = 0x7A6A  # folded into the init key for TrainState.rng


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def as_transformation(tx: Any) -> Any:
    """``tx`` as an ``optax.GradientTransformation`` (accepting ``optax.MultiSteps`` and duck types)."""
    if isinstance(tx, optax.GradientTransformation) or callable(getattr(tx, "fused_apply", None)):
        return tx  # optax transformations, and fused optimizers (zjax.pallas) that the step recognizes
    if callable(getattr(tx, "gradient_transformation", None)):
        return tx.gradient_transformation()
    if callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None)):
        return optax.GradientTransformation(tx.init, tx.update)
    raise TypeError(
        f"Plan.init: tx must be an optax.GradientTransformation (e.g. optax.adamw(3e-4)), got {type(tx).__name__}."
    )


@dataclasses.dataclass(frozen=True)
class Plan:
    """How to train on a mesh: the ZeRO stage, the precision and the parameter rules.

    Args:
      mesh: a mesh from :func:`zjax.make_mesh` (axes ``pp``, ``dp``, ``tp``).
      stage: ZeRO stage 0-3 (see :mod:`zjax.stages`).
      precision: ``"fp32"``, ``"bf16"`` (default) or ``"fp16"`` (with dynamic loss scaling).
      rules: :class:`zjax.Rules` for tensor parallelism; the defaults map common logical names.
      clip_norm: clip gradients to this global norm (computed correctly over sharded gradients).
      loss_scale: dynamic loss-scaling configuration, used when the precision scales the loss.
      pipeline: the schedule (:class:`zjax.Pipeline`) for a mesh with ``pp`` > 1; the model calls
        :func:`zjax.pipeline.apply` on its stacked layers (``zjax.models.Decoder`` does).

    Example:
      >>> plan = zjax.Plan(zjax.make_mesh(dp=-1, tp=2), stage=3, precision="bf16")
      >>> state = plan.init(lambda r: model.init(r, x)["params"], optax.adamw(3e-4), jax.random.key(0))
      >>> step = plan.train_step(loss_fn)
      >>> state, metrics = step(state, plan.shard_batch(batch))
    """

    mesh: Mesh
    stage: Any = 0
    precision: Any = "bf16"
    rules: Rules | None = None
    clip_norm: float | None = None
    loss_scale: DynamicLossScale = DynamicLossScale()
    pipeline: Pipeline | None = None
    _steps: list = dataclasses.field(default_factory=list, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mesh):
            raise TypeError(f"Plan: mesh must be a jax.sharding.Mesh (zjax.make_mesh), got {type(self.mesh).__name__}.")
        missing = [a for a in (DP,) if a not in self.mesh.shape]
        if missing:
            raise ValueError(
                f"Plan: the mesh {dict(self.mesh.shape)} has no {missing[0]!r} axis; build it with "
                f"zjax.make_mesh (axes {MESH_AXES})."
            )
        if self.pipeline is not None and not isinstance(self.pipeline, Pipeline):
            raise TypeError(
                f"Plan: pipeline must be a zjax.Pipeline(microbatches=...), got {type(self.pipeline).__name__}."
            )
        stages = axis_size(self.mesh, PP)
        if stages > 1 and self.pipeline is None:
            raise ValueError(
                f"Plan: the mesh has {PP}={stages} but no pipeline schedule; pass "
                f"pipeline=zjax.Pipeline(microbatches=M) with M a multiple of {stages} (e.g. {2 * stages}), "
                f"or fold those devices into dp or tp."
            )
        if self.pipeline is not None:
            self.pipeline.check(stages)
        object.__setattr__(self, "stage", Stage.from_value(self.stage))
        if self.pipeline is not None and self.pipeline.zero3_gather == "layer" and not self.stage.shard_parameters:
            raise ValueError(
                f"Plan: pipeline zero3_gather='layer' gathers ZeRO-3 weights per use, but stage={self.stage.level} "
                f"keeps the compute weights whole on every dp rank: their gradients would then be reduced over "
                f"{DP} inside the pipeline loop, once per iteration. Use stage=3, or zero3_gather='step'."
            )
        object.__setattr__(self, "precision", Precision.from_value(self.precision))
        object.__setattr__(self, "rules", Rules() if self.rules is None else self.rules)
        if not isinstance(self.rules, Rules):
            raise TypeError(f"Plan: rules must be a zjax.Rules, got {type(self.rules).__name__}.")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"Plan: clip_norm={self.clip_norm} must be > 0 or None.")

    # -- layouts and shardings ------------------------------------------------------------------

    def layout(self, abstract_params: Any) -> Layout:
        """The layout of a parameter tree (concrete or abstract, flax annotations allowed)."""
        leaves = read_leaves(abstract_params)
        compute = cast(Rules, self.rules).compute_specs(leaves, self.mesh)
        treedef = jax.tree.structure(unbox(abstract_params))
        return Layout.build(self.stage, self.mesh, treedef, leaves, compute)

    def layout_of(self, params: Any) -> Layout:
        """The layout of parameters that already carry their shardings (e.g. ``state.params``)."""
        return Layout.from_params(self.stage, self.mesh, params)

    def state_specs(self, state: TrainState, layout: Layout | None = None) -> TrainState:
        """A ``TrainState``-shaped tree of ``PartitionSpec`` for ``state`` (concrete or abstract)."""
        layout = self.layout_of(state.params) if layout is None else layout
        master = None if state.opt_state.master is None else layout.master_specs
        scalar: Any = PartitionSpec()  # a spec tree mirrors the state, leaf for leaf
        return TrainState(
            step=scalar,
            params=layout.param_specs,
            opt_state=MixedPrecisionState(master, layout.optimizer_specs(state.tx, state.opt_state.inner)),
            loss_scale=LossScaleState(scalar, scalar),
            rng=scalar,
            tx=state.tx,
        )

    def state_shardings(self, state: TrainState, layout: Layout | None = None) -> TrainState:
        """Like :meth:`state_specs`, with ``NamedSharding`` leaves on this plan's mesh."""
        specs = self.state_specs(state, layout)
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs, is_leaf=_is_spec)

    # -- state ----------------------------------------------------------------------------------

    def _make_state_fn(self, init_fn: Callable[[jax.Array], Any], tx: optax.GradientTransformation):
        precision = self.precision

        def make(rng: jax.Array) -> TrainState:
            with nnx.use_eager_sharding(False):  # zjax places parameters; nnx must not on its own
                params = unbox(init_fn(rng))

            def cast(dtype):
                return lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p

            master = jax.tree.map(cast(jnp.float32), params)
            compute = jax.tree.map(cast(precision.compute_dtype), params)
            return TrainState(
                step=jnp.zeros((), jnp.int32),
                params=compute,
                opt_state=MixedPrecisionState(master if precision.master_weights else None, tx.init(master)),
                loss_scale=self.loss_scale.init(precision.loss_scaling),
                rng=jax.random.fold_in(rng, _STATE_RNG),  # not the key init_fn used
                tx=tx,
            )

        return make

    def abstract_state(
        self, init_fn: Callable[[jax.Array], Any], tx: optax.GradientTransformation, rng: jax.Array
    ) -> TrainState:
        """The state :meth:`init` would make, as ``ShapeDtypeStruct`` leaves carrying their shardings.

        Nothing is allocated; use it to lower or compile a step ahead of time, or as a restore target.
        """
        state, shardings = self._abstract(init_fn, tx, rng)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)

    def _abstract(self, init_fn, tx, rng):
        tx = as_transformation(tx)
        with nnx.use_eager_sharding(False):
            annotated = jax.eval_shape(init_fn, rng)
        layout = self.layout(annotated)
        make = self._make_state_fn(init_fn, tx)
        state = jax.eval_shape(make, rng)
        return state, self.state_shardings(state, layout)

    def init(self, init_fn: Callable[[jax.Array], Any], tx: optax.GradientTransformation, rng: jax.Array) -> TrainState:
        """Create the training state directly in its sharded layout (never whole on one device).

        Args:
          init_fn: ``init_fn(rng) -> params``, e.g. ``lambda r: model.init(r, x)["params"]`` (linen) or
            ``lambda r: nnx.split(Model(rngs=nnx.Rngs(r)), nnx.Param)[1]`` (nnx).
          tx: any optax transformation; it updates the fp32 master weights.
          rng: a ``jax.random.key``.

        Returns:
          A :class:`TrainState` whose leaves are sharded as this plan's stage says.
        """
        state, shardings = self._abstract(init_fn, tx, rng)
        return jax.jit(self._make_state_fn(init_fn, state.tx), out_shardings=shardings)(rng)

    # -- training -------------------------------------------------------------------------------

    def train_step(self, loss_fn: LossFn, accum_steps: int = 1) -> TrainStep:
        """A jitted, state-donating step ``step(state, batch) -> (state, metrics)``.

        Args:
          loss_fn: ``loss_fn(params, batch) -> loss`` or ``(loss, aux)``; ``loss`` is a scalar mean. With
            an ``rng`` parameter, ``loss_fn(params, batch, rng)`` gets a fresh key each step (from ``state.rng``).
          accum_steps: split each batch into this many microbatches and accumulate their gradients
            (in fp32, laid out like the gradients: dp-sharded at stages 2 and 3).
        """
        step = TrainStep(self, loss_fn, accum_steps)
        self._steps[:] = [step]  # memory_report compiles the latest one
        return step

    def shard_batch(self, batch: Any) -> Any:
        """Place ``batch`` on the mesh with its leading dimension over ``dp``. See :func:`zjax.shard_batch`."""
        return shard_batch(batch, self.mesh)

    def unsharded(self, state: TrainState) -> list[Unsharded]:
        """Leaves that this stage keeps replicated over dp because no dimension divides by its size."""
        return self.layout_of(state.params).unsharded

    def memory_report(
        self, state: TrainState, batch: Any, step: TrainStep | None = None, compiled: Any = None
    ) -> MemoryReport:
        """Per-device memory by category: ZeRO theory beside the compiled program's numbers.

        Args:
          state: the training state (concrete or from :meth:`abstract_state`).
          batch: a batch (concrete or ``ShapeDtypeStruct``), global shape.
          step: the step to compile; the last one made by :meth:`train_step` by default.
          compiled: the step's compiled executable, if already at hand (skips compiling again).
        """
        if step is None:
            if not self._steps:
                raise ValueError("memory_report: build a step with plan.train_step(loss_fn) first, or pass step=.")
            step = self._steps[-1]
        return memory_report(self, state, batch, step, compiled)
