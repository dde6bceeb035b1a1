"""What the train and eval steps share: the parameters a model computes with, the state's layout checked against
the plan, one jit per layout; and the eval step."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from .. import pipeline
from ..comm._qwz import across_replica
from ..sharding._batch import check_batch
from ..sharding._mesh import use_mesh_platform
from ..sharding._simulate import check_cpu_threads
from ._config import PlanConfig
from ._layout import StateLayout
from ._loss_fn import placing, takes
from ._overlap import compiler_options
from ._state import TrainState

__all__ = ["EvalStep"]


def constrain(tree: Any, specs: Any, mesh) -> Any:
    return jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s)), tree, specs)


def compute_params(plan: PlanConfig, layout: StateLayout, params: Any) -> Any:
    """The parameters the model computes with: ``state.params`` in device memory (a copy in when the layout
    offloads them), or, without a compute copy (``compute_copy=False``), the fp32 weights cast on their shards
    (then gathered as the model reads them, like the copy would be). With hpZ (``Plan(hpz=True)``) they are
    first gathered over ``replica`` to their node's shards once per step (as int8 with qwZ), which the forward
    and rematerialized passes gather over ``dp`` inside the node (gradients reduce-scatter back per layer)."""
    if layout.offload.params:
        return jax.device_put(params, jax.memory.Space.Device)
    if plan.casts_params:
        dtype = plan.precision.compute_dtype
        cast = jax.tree.map(lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)
        params = constrain(cast, layout.param_specs, plan.mesh)
    if plan.hpz and plan.weights_wire is not None:
        gather = lambda x, spec, node: across_replica(x, spec, node, plan.weights_wire)  # noqa: E731
        return jax.tree.map(gather, params, layout.param_specs, layout.params.node_specs)
    return constrain(params, layout.params.node_specs, plan.mesh) if plan.hpz else params


def layout_of(plan: PlanConfig, state: TrainState, what: str) -> StateLayout:
    """The state's layout, checked against the plan the step belongs to (it is never rebuilt here)."""
    layout = getattr(state, "layout", None)
    if not isinstance(state, TrainState):
        raise TypeError(f"{what}: expected a zjax.TrainState (from plan.init), got {type(state).__name__}.")
    if layout is None:
        raise ValueError(
            f"{what}: this TrainState has no layout; build it with plan.init, plan.abstract_state or a checkpoint "
            "restore, or place it with state = plan.reshard(state)."
        )
    if layout.master != plan.keeps_master:
        raise ValueError(
            f"{what}: the state {'keeps' if layout.master else 'has no'} compute copy beside its fp32 master but "
            f"this step's plan {'keeps' if plan.keeps_master else 'does not keep'} one (compute_copy="
            f"{plan.compute_copy}); call state = plan.reshard(state) to move it into this plan's form."
        )
    hpz = layout.params.hierarchical
    if layout.mesh != plan.mesh or layout.stage != plan.stage or layout.offload != plan.offload or hpz != plan.hpz:
        raise ValueError(
            f"{what}: the state is laid out for ZeRO stage {layout.stage.level} on mesh {dict(layout.mesh.shape)} "
            f"with offload {layout.offload.name!r} and hpz={hpz}, but this step's plan is stage {plan.stage.level} "
            f"on mesh {dict(plan.mesh.shape)} with offload {plan.offload.name!r} and hpz={plan.hpz}; call "
            "state = plan.reshard(state) to move it into this plan's layout."
        )
    layout.check_structure(state)
    return layout


def _mismatch(error: ValueError) -> bool:
    """Whether jit rejected an argument's sharding (then the layout names the leaf)."""
    text = str(error)
    return "harding" in text and ("does not match" in text or "incompatible" in text or "devices" in text)


class CompiledFn:
    """What the train and eval steps share: the plan's tracing context, one jit per layout, clear errors."""

    what = "step"

    def __init__(self, plan: PlanConfig):
        self.plan = plan
        self._jitted: dict[Any, Any] = {}
        self._threads_checked = False

    def _context(self):
        """The mesh and activation rules the loss is traced under (the model's constraints use this plan's axes)."""
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.plan.mesh))
        stack.enter_context(nn.logical_axis_rules(self.plan.rules.activations_for(self.plan.mesh)))
        stack.enter_context(pipeline.use(self.plan.pipeline))
        stack.enter_context(use_mesh_platform(self.plan.mesh))  # cuDNN attention for GPU meshes
        return stack

    def _build(self, layout: StateLayout, state: TrainState, batch: Any) -> Any:
        raise NotImplementedError

    def _compiler_options(self) -> dict[str, Any] | None:
        plan = self.plan
        platform = str(plan.mesh.devices.flat[0].platform)
        deviceless = platform != jax.default_backend()  # a target the planner compiles for without its devices
        return compiler_options(plan.stage.level, platform, plan.gpu_overlap, deviceless, plan.quantizes_grads)

    def _jit(self, state: TrainState, batch: Any):
        key = (jax.tree.structure(state), jax.tree.structure(batch))
        fn = self._jitted.get(key)
        if fn is None:
            fn = self._jitted[key] = self._build(layout_of(self.plan, state, self.what), state, batch)
        return fn

    def _check(self, state: TrainState, batch: Any) -> None:
        pass

    def __call__(self, state: TrainState, batch: Any):
        if not self._threads_checked:  # simulated CPU devices: enough threads for their collectives?
            self._threads_checked = True
            check_cpu_threads(list(self.plan.mesh.devices.flat))
        self._check(state, batch)
        with self._context():
            fn = self._jit(state, batch)
            try:
                return fn(state, batch)
            except ValueError as e:
                if _mismatch(e):
                    state.layout.check(state)  # names the leaf and the fix
                raise

    def lower(self, state: TrainState, batch: Any):
        """``jax.jit(...).lower`` for concrete or abstract (``ShapeDtypeStruct``) state and batch."""
        self._check(state, batch)
        with self._context():
            return self._jit(state, batch).lower(state, batch)


class EvalStep(CompiledFn):
    """``eval(state, batch) -> fn(state.params, batch)`` jitted on the state's layout (no donation).

    ``fn(params, batch)`` returns any pytree of metrics; a ``fn`` with a ``model_state`` parameter
    also gets ``state.model_state``.
    """

    what = "eval_step"

    def __init__(self, plan: PlanConfig, fn: Callable[..., Any]):
        if not callable(fn):
            raise TypeError(f"eval_step: fn must be callable, got {type(fn).__name__}.")
        super().__init__(plan)
        self.fn = fn
        self._takes_model_state = takes(fn, "model_state")

    def _build(self, layout: StateLayout, state: TrainState, batch: Any) -> Any:
        def evaluate(s: TrainState, b: Any) -> Any:
            params = compute_params(self.plan, layout, s.params)
            with placing(self.plan, layout):
                if self._takes_model_state:
                    return self.fn(params, b, model_state=s.model_state)
                return self.fn(params, b)

        # the whole state goes in (jit drops the arguments it does not use); nothing is donated
        return jax.jit(
            evaluate,
            in_shardings=(layout.state_shardings(state.tx), layout.batch_shardings(batch)),
            compiler_options=self._compiler_options(),
        )

    def _check(self, state: TrainState, batch: Any) -> None:
        check_batch(batch, self.plan.mesh)
