"""The jitted training step: mixed precision, loss scaling, gradient accumulation, clipping, the update."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from .. import pipeline
from ..comm._qwz import across_replica
from ..offload._update import streamed_update
from ..sharding._batch import check_batch
from ..sharding._mesh import use_mesh_platform
from ..sharding._simulate import check_cpu_threads
from ._config import PlanConfig
from ._layout import StateLayout
from ._loss_fn import Loss, LossFn, loss_and_aux, placing, split_microbatches, takes
from ._memory import MemoryReport, memory_report
from ._overlap import compiler_options
from ._per_rank import defers_reduction, grads_per_rank, zero3_grads
from ._state import MixedPrecisionState, TrainState

__all__ = ["EvalStep", "LossFn", "TrainStep"]


def _constrain(tree: Any, specs: Any, mesh) -> Any:
    return jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s)), tree, specs)


def _compute_params(plan: PlanConfig, layout: StateLayout, params: Any) -> Any:
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
        params = _constrain(cast, layout.param_specs, plan.mesh)
    if plan.hpz and plan.weights_wire is not None:
        gather = lambda x, spec, node: across_replica(x, spec, node, plan.weights_wire)  # noqa: E731
        return jax.tree.map(gather, params, layout.param_specs, layout.params.node_specs)
    return _constrain(params, layout.params.node_specs, plan.mesh) if plan.hpz else params


def _tree_where(pred: jax.Array, new: Any, old: Any) -> Any:
    return jax.tree.map(lambda n, o: jnp.where(pred, n, o), new, old)


def _layout_of(plan: PlanConfig, state: TrainState, what: str) -> StateLayout:
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


class _CompiledFn:
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
            fn = self._jitted[key] = self._build(_layout_of(self.plan, state, self.what), state, batch)
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


class EvalStep(_CompiledFn):
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
            params = _compute_params(self.plan, layout, s.params)
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


class TrainStep(_CompiledFn):
    """A compiled training step for one plan and loss function; call it as ``step(state, batch)``.

    ``loss_fn(params, batch)`` returns a scalar loss (a mean over the batch) or ``(loss, aux)``. A
    ``loss_fn(params, batch, rng)`` also gets a fresh PRNG key per step and microbatch, split from
    ``state.rng`` (dropout that resumes reproducibly from a checkpoint). A
    ``loss_fn(params, batch, model_state)`` gets the model's non-trainable state and returns
    ``(loss, new_model_state)`` or ``((loss, aux), new_model_state)``.
    Returns the new state and metrics: ``loss``, ``grad_norm`` (unscaled, before clipping),
    ``loss_scale``, ``skipped`` (non-finite gradients under loss scaling) and ``aux`` if given.
    The input state is donated: do not use it after the call.
    """

    what = "train_step"

    def __init__(self, plan: PlanConfig, loss_fn: LossFn, accum_steps: int = 1):
        self.loss = Loss.of(loss_fn, accum_steps)
        super().__init__(plan)
        self.loss_fn = loss_fn
        self.takes_rng = self.loss.takes_rng
        self._takes_model_state = self.loss.takes_model_state
        self.accum_steps = accum_steps

    def _build(self, layout: StateLayout, state: TrainState, batch: Any) -> Any:
        if jax.tree.leaves(state.model_state) and not self._takes_model_state:
            paths = ", ".join(leaf.path for leaf in layout.model_leaves[:4])
            raise ValueError(
                f"train_step: the state holds model state ({paths}, ...) but loss_fn takes no model_state "
                "parameter; write loss_fn(params, batch, model_state) -> (loss, new_model_state)."
            )
        state_shardings = layout.state_shardings(state.tx)
        return jax.jit(
            lambda s, b: self._step(layout, s, b),
            in_shardings=(state_shardings, layout.batch_shardings(batch)),
            out_shardings=(state_shardings, None),
            donate_argnums=0,
            # every state leaf stays an argument, used or not (stage 3 reducing its own gradients reads the fp32
            # master, not the compute copy): its donated buffer is then the output's, and the memory report
            # finds every leaf's sharding
            keep_unused=True,
            compiler_options=self._compiler_options(),
        )

    def _check(self, state: TrainState, batch: Any) -> None:
        check_batch(batch, self.plan.mesh, self.accum_steps)

    def memory_report(self, state: TrainState, batch: Any, compiled: Any = None) -> MemoryReport:
        """Per-device memory of this step: ZeRO theory beside the compiled program's numbers.

        Args:
          state: the training state (concrete or from :meth:`zjax.Plan.abstract_state`).
          batch: a batch (concrete or ``ShapeDtypeStruct``), global shape.
          compiled: this step's compiled executable, if already at hand (skips compiling again).
        """
        if compiled is None:
            compiled = self.lower(state, batch).compile()
        return memory_report(state, batch, compiled, precision=self.plan.precision, accum_steps=self.accum_steps)

    # -- the traced step ------------------------------------------------------------------------

    def _grads(self, layout: StateLayout, params: Any, model_state: Any, batch: Any, scale: jax.Array, rng: jax.Array):
        """Mean loss, aux, gradients of ``loss * scale`` (summed over microbatches, fp32 if k > 1) and the
        model state after the last microbatch (threaded through them in order; never differentiated)."""
        mesh = self.plan.mesh

        def scaled(p, ms, b, i):
            kwargs: dict[str, Any] = {}
            if self.takes_rng:
                kwargs["rng"] = jax.random.fold_in(rng, i)
            if self._takes_model_state:
                # rebuilt inside the differentiated trace: nnx refuses to mutate variables made outside it
                kwargs["model_state"] = jax.tree.map(lambda x: x, ms)
            # the table schedules make their gradients in the forward pass, seeded with the loss scale
            with pipeline.seed(scale), placing(self.plan, layout):
                out = self.loss_fn(p, b, **kwargs)
            if self._takes_model_state:
                if not (isinstance(out, tuple) and len(out) == 2):
                    raise ValueError(
                        "loss_fn with a model_state parameter must return (loss, new_model_state) or "
                        f"((loss, aux), new_model_state), got {type(out).__name__}."
                    )
                out, ms = out
                ms = _constrain(ms, layout.model_state_specs, mesh)
            loss, aux = loss_and_aux(out)
            return loss * scale, (loss, aux, ms)

        grad_fn = jax.grad(scaled, has_aux=True)
        k = self.accum_steps
        if k == 1:
            # Straight to the optimizer's layout: at stage 1 too the reduction is a reduce-scatter
            # (ZeRO's 2 psi per step); an all-reduce to full gradients would cost 3 psi with the gather.
            grads, (loss, aux, model_state) = grad_fn(params, model_state, batch, 0)
            return loss, aux, _constrain(grads, layout.master_specs, mesh), model_state

        def body(carry, xs):
            acc, ms = carry
            i, microbatch = xs
            grads, (loss, aux, ms) = grad_fn(params, ms, microbatch, i)
            grads = _constrain(grads, layout.grad_specs, mesh)
            acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
            return (_constrain(acc, layout.grad_specs, mesh), ms), (loss, aux)

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        (acc, model_state), (losses, auxes) = jax.lax.scan(
            body,
            (_constrain(zeros, layout.grad_specs, mesh), model_state),
            (jnp.arange(k), split_microbatches(batch, k)),
        )
        aux = jax.tree.map(lambda a: jnp.mean(a, axis=0), auxes)
        return jnp.mean(losses), aux, acc, model_state

    def _step(self, layout: StateLayout, state: TrainState, batch: Any):
        plan, mesh = self.plan, self.plan.mesh
        precision = plan.precision
        # Without loss scaling the scale is the constant 1, not the state's scalar: XLA folds the multiplies
        # away (a runtime 1.0 costs one more operand in every gradient fusion).
        scale = state.loss_scale.scale if precision.loss_scaling else jnp.float32(1.0)
        # a loss without an ``rng`` argument leaves the key as it is: no split (XLA:CPU runs threefry as a
        # loop, a measurable share of a small step)
        next_rng, step_rng = jax.random.split(state.rng) if self.takes_rng else (state.rng, state.rng)
        if (plan.reduce_dtype is not None or plan.reduces_gradients) and jax.tree.leaves(state.model_state):
            raise ValueError(
                "Plan(reduce_dtype=...) and quantized gradients do not support models with model state (batch "
                "statistics) yet; use reduce_dtype=None and quantized_comm=None or 'weights'."
            )
        compute_params = _compute_params(plan, layout, state.params)
        if plan.reduces_gradients:  # stage 3, reduced in fp32 or as int8: the fp32 master's shards differentiated
            primal = state.master_params if precision.master_weights else compute_params  # cast per layer
            loss, aux, grads = zero3_grads(plan, self.loss, layout, primal, batch, scale, step_rng)
            model_state = state.model_state
        elif defers_reduction(plan, self.loss, layout, state.model_state) or plan.reduce_dtype is not None:
            loss, aux, grads = grads_per_rank(plan, self.loss, layout, compute_params, batch, scale, step_rng)
            model_state = state.model_state
        else:
            loss, aux, grads, model_state = self._grads(
                layout, compute_params, state.model_state, batch, scale, step_rng
            )

        grads = _constrain(grads, layout.master_specs, mesh)
        inv = 1.0 / (scale * self.accum_steps)
        grad_norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32) * inv, grads))
        factor = jnp.float32(1.0)
        if plan.clip_norm is not None:
            factor = jnp.minimum(1.0, plan.clip_norm / (grad_norm + 1e-6))
        finite = jnp.isfinite(grad_norm)
        skip_nonfinite = precision.loss_scaling

        master = state.master_params
        fused = getattr(state.tx, "fused_apply", None)
        if layout.offload.enabled:
            # Host-resident optimizer state streamed through the device in bounded chunks; skipping a
            # non-finite step happens chunk by chunk too.
            new_master, inner, cast = streamed_update(
                layout, state.tx, grads, state.opt_state.inner, master, inv_scale=inv * factor,
                finite=finite if skip_nonfinite else None, compute_dtype=precision.compute_dtype,
            )  # fmt: skip
            params = new_master if cast is None else cast
            opt_state = MixedPrecisionState(new_master if layout.master else None, inner)
            skip_nonfinite = False
        else:
            if fused is not None:
                # One pass per device over its shard: unscale, clip, skip, update, cast (zjax.pallas).
                new_master, inner, cast = fused(
                    grads, state.opt_state.inner, master, compute_dtype=precision.compute_dtype,
                    inv_scale=inv * factor, apply=finite if skip_nonfinite else jnp.float32(1.0),
                    mesh=mesh, specs=layout.master_specs,
                )  # fmt: skip
                skip_nonfinite = False  # done inside
            else:
                # fp32, unscaled, averaged over microbatches, in the master weights' layout: the optimizer
                # runs on each device's shard.
                grads = jax.tree.map(lambda g: g.astype(jnp.float32) * (inv * factor), grads)
                updates, inner = state.tx.update(grads, state.opt_state.inner, master)
                new_master = optax.apply_updates(master, updates)
                cast = jax.tree.map(lambda m: m.astype(precision.compute_dtype), new_master)
            new_master = _constrain(new_master, layout.master_specs, mesh)
            if layout.master:
                # Cast on the shard, then gather: XLA would otherwise all-gather the fp32 master (2x bytes).
                params = _constrain(_constrain(cast, layout.master_specs, mesh), layout.param_specs, mesh)
                opt_state = MixedPrecisionState(new_master, inner)
            else:
                params = _constrain(new_master, layout.param_specs, mesh)
                opt_state = MixedPrecisionState(None, inner)

        loss_scale = state.loss_scale
        if skip_nonfinite:  # a skipped step changes nothing but the loss scale (and the step count)
            params = _tree_where(finite, params, state.params)
            opt_state = _tree_where(finite, opt_state, state.opt_state)
        if precision.loss_scaling:
            model_state = _tree_where(finite, model_state, state.model_state)
            loss_scale = plan.loss_scale.update(loss_scale, finite)
            skipped = ~finite
        else:
            skipped = jnp.zeros((), bool)

        new_state = state.replace(
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            loss_scale=loss_scale,
            rng=next_rng,
            model_state=model_state,
        )
        metrics = {"loss": loss, "grad_norm": grad_norm, "loss_scale": scale, "skipped": skipped}
        if aux is not None:
            metrics["aux"] = aux
        return new_state, metrics
