"""The jitted training step: mixed precision, loss scaling, gradient accumulation, clipping, the update."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from .. import fp8, pipeline
from ..offload._update import streamed_update
from ..sharding._batch import check_batch
from ._compiled import CompiledFn, EvalStep, compute_params, constrain, layout_of
from ._config import PlanConfig
from ._layout import StateLayout
from ._loss_fn import Loss, LossFn, placing
from ._memory import MemoryReport, memory_report
from ._objective import accumulate, seeded, split_output
from ._per_rank import defers_reduction, grads_per_rank, zero3_grads
from ._state import MixedPrecisionState, TrainState

__all__ = ["EvalStep", "LossFn", "TrainStep"]


def _tree_where(pred: jax.Array, new: Any, old: Any) -> Any:
    return jax.tree.map(lambda n, o: jnp.where(pred, n, o), new, old)


class TrainStep(CompiledFn):
    """A compiled training step for one plan and loss function; call it as ``step(state, batch)``.

    ``loss_fn(params, batch)`` returns a :class:`zjax.LossSum` (a sum and its count: the step minimises the sum
    over the whole global batch divided by the count over it, on every path, as one device would) or a scalar (a
    mean over the rows it is called on: the whole batch without accumulation under GSPMD, each microbatch's or
    data-parallel rank's rows on the paths that split them), either alone or as ``(loss, aux)``. A
    ``loss_fn(params, batch, rng)`` also gets a fresh PRNG key per step and microbatch, split from
    ``state.rng`` (dropout that resumes reproducibly from a checkpoint); one that takes ``rows`` too,
    ``loss_fn(params, batch, rng, rows)``, gets the step's one key on every call and the global indices of the
    rows it is called on (``rows [b]``), from which to draw the one-device model's randomness per row. A
    ``loss_fn(params, batch, model_state)`` gets the model's non-trainable state and returns
    ``(loss, new_model_state)`` or ``((loss, aux), new_model_state)``; the state is threaded through the
    microbatches in order, and a ``loss_fn.finish_step(model_state) -> model_state`` attribute, if the function
    has one, is applied to it once, after the last (:func:`zjax.models.train_functions` moves the routers'
    selection biases there, by the whole step's loads).
    Returns the new state and metrics: ``loss`` (the objective's value), ``count`` (the count it divides by:
    tokens or their weights for a ``LossSum``, the calls' number for a scalar), ``grad_norm`` (before clipping),
    ``loss_scale``, ``skipped`` (non-finite gradients, left out: ``Plan(skip_nonfinite=...)``) and ``aux`` if
    given.
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
        """The step's :class:`LossSum`, aux, gradients of its objective times ``scale`` (over the microbatches in
        fp32 if k > 1), the model state after the last microbatch (threaded through them in order; never
        differentiated) and, for a model with fp8 amax histories (:func:`zjax.fp8.matmul_delayed`), the amaxes the
        step saw (the histories' cotangents, their maximum over the microbatches; else ``None``)."""
        mesh = self.plan.mesh
        histories = fp8.histories(model_state)

        def scaled(p, ms, b, i):
            b, kwargs = self.loss.arguments(b, rng, i)
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
                ms = constrain(ms, layout.model_state_specs, mesh)
            part, aux = split_output(out)
            value, part = seeded(part, scale)  # under GSPMD one call sees every rank's rows
            return value, (part, aux, ms)

        def grad_fn(p, carry, b, i):
            if histories is None:
                return jax.grad(scaled, has_aux=True)(p, carry, b, i)
            ms, seen = carry  # the histories are read, not changed, by every microbatch: the step shifts them
            with_h = lambda p_, h: scaled(p_, fp8.with_histories(ms, h), b, i)  # noqa: E731
            (g, amaxes), (part, aux, ms) = jax.grad(with_h, (0, 1), has_aux=True)(p, histories)
            return g, (part, aux, (ms, fp8.amax_seen(seen, amaxes)))

        carry = model_state if histories is None else (model_state, jax.tree.map(jnp.zeros_like, histories))
        # k == 1: straight to the optimizer's layout: at stage 1 too the reduction is a reduce-scatter (ZeRO's
        # 2 psi per step); an all-reduce to full gradients would cost 3 psi with the gather.
        grads, total, aux, carry = accumulate(
            grad_fn, params, batch, self.accum_steps, carry, lambda g: constrain(g, layout.grad_specs, mesh)
        )
        model_state, seen = (carry, None) if histories is None else carry
        return total, aux, constrain(grads, layout.master_specs, mesh), model_state, seen

    def _gradients(self, layout: StateLayout, state: TrainState, batch: Any, scale: jax.Array, rng: jax.Array):
        """The step's :class:`zjax.LossSum`, aux, gradients (the objective's, times ``scale``, in the master
        weights' layout), new model state and fp8 amaxes seen (:meth:`_grads`), by whichever path the plan
        reduces them."""
        plan = self.plan
        if (plan.reduce_dtype is not None or plan.reduces_gradients) and jax.tree.leaves(state.model_state):
            raise ValueError(
                "Plan(reduce_dtype=...) and quantized gradients do not support models with model state (batch "
                "statistics) yet; use reduce_dtype=None and quantized_comm=None or 'weights'."
            )
        computed = compute_params(plan, layout, state.params)
        batch = self.loss.with_rows(batch)  # every path splits the rows' global indices with them
        seen = None
        if plan.reduces_gradients:  # stage 3, reduced in fp32 or as int8: the fp32 master's shards differentiated
            primal = state.master_params if plan.precision.master_weights else computed  # cast per layer
            total, aux, grads = zero3_grads(plan, self.loss, layout, primal, batch, scale, rng)
            model_state = state.model_state
        elif defers_reduction(plan, self.loss, layout, state.model_state) or plan.reduce_dtype is not None:
            total, aux, grads = grads_per_rank(plan, self.loss, layout, computed, batch, scale, rng)
            model_state = state.model_state
        else:
            total, aux, grads, model_state, seen = self._grads(layout, computed, state.model_state, batch, scale, rng)
        return total, aux, constrain(grads, layout.master_specs, plan.mesh), model_state, seen

    def _scale_and_keys(self, state: TrainState) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The loss scale, the state's next key and this step's key."""
        # Without loss scaling the scale is the constant 1, not the state's scalar: XLA folds the multiplies
        # away (a runtime 1.0 costs one more operand in every gradient fusion).
        scale = state.loss_scale.scale if self.plan.precision.loss_scaling else jnp.float32(1.0)
        # a loss without an ``rng`` argument leaves the key as it is: no split (XLA:CPU runs threefry as a
        # loop, a measurable share of a small step)
        next_rng, step_rng = jax.random.split(state.rng) if self.takes_rng else (state.rng, state.rng)
        return scale, next_rng, step_rng

    def grads(self, state: TrainState, batch: Any) -> tuple[Any, dict[str, jax.Array]]:
        """The gradients this step would apply to ``state`` for ``batch``, before clipping and the optimizer.

        For checking a model port or a loss against a reference, and for debugging: the same program as the
        step's up to its update (the same path, reduction and normalisation, the same dropout keys), without
        changing or donating ``state``.

        Returns:
          ``(grads, metrics)``: ``grads`` in fp32, the tree of ``state.params``, laid out like the optimizer's
          master weights (split over the ZeRO axes from stage 1 on), unscaled; ``metrics`` holds ``loss``,
          ``count``, ``grad_norm`` and ``aux`` as the step reports them.
        """
        self._check(state, batch)
        with self._context():
            key = ("grads", jax.tree.structure(state), jax.tree.structure(batch))
            fn = self._jitted.get(key)
            if fn is None:
                layout = layout_of(self.plan, state, self.what)
                fn = self._jitted[key] = jax.jit(
                    lambda s, b: self._unscaled(layout, s, b),
                    in_shardings=(layout.state_shardings(state.tx), layout.batch_shardings(batch)),
                    compiler_options=self._compiler_options(),
                )
            return fn(state, batch)

    def _unscaled(self, layout: StateLayout, state: TrainState, batch: Any):
        scale, _, step_rng = self._scale_and_keys(state)
        total, aux, grads, _, _ = self._gradients(layout, state, batch, scale, step_rng)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32) / scale, grads)
        metrics = {"loss": total.mean, "count": total.count, "grad_norm": optax.tree.norm(grads)}
        if aux is not None:
            metrics["aux"] = aux
        return grads, metrics

    def _step(self, layout: StateLayout, state: TrainState, batch: Any):
        plan, mesh = self.plan, self.plan.mesh
        precision = plan.precision
        scale, next_rng, step_rng = self._scale_and_keys(state)
        total, aux, grads, model_state, seen = self._gradients(layout, state, batch, scale, step_rng)
        if self.loss.finish_step is not None:
            model_state = constrain(self.loss.finish_step(model_state), layout.model_state_specs, mesh)
        inv = 1.0 / scale  # the gradients are the objective's (zjax.core._objective), times the loss scale
        grad_norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32) * inv, grads))
        factor = jnp.float32(1.0)
        if plan.clip_norm is not None:
            factor = jnp.minimum(1.0, plan.clip_norm / (grad_norm + 1e-6))
        finite = jnp.isfinite(grad_norm)
        fp8_metrics = {}
        if seen is not None:  # fp8 delayed scaling: a non-finite amax skips the step; the histories shift
            finite = finite & fp8.finite(seen)
            fp8_metrics["fp8_saturated"] = fp8.saturated(state.model_state, seen)
            model_state = fp8.advance(model_state, seen)
        default_skip = precision.loss_scaling or seen is not None
        skips = default_skip if plan.skip_nonfinite is None else plan.skip_nonfinite
        skip_nonfinite = skips  # False below once the update itself skipped

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
            new_master = constrain(new_master, layout.master_specs, mesh)
            if layout.master:
                # Cast on the shard, then gather: XLA would otherwise all-gather the fp32 master (2x bytes).
                params = constrain(constrain(cast, layout.master_specs, mesh), layout.param_specs, mesh)
                opt_state = MixedPrecisionState(new_master, inner)
            else:
                params = constrain(new_master, layout.param_specs, mesh)
                opt_state = MixedPrecisionState(None, inner)

        loss_scale = state.loss_scale
        if skip_nonfinite:  # a skipped step changes nothing but the loss scale (and the step count)
            params = _tree_where(finite, params, state.params)
            opt_state = _tree_where(finite, opt_state, state.opt_state)
        if skips:
            model_state = _tree_where(finite, model_state, state.model_state)
            skipped = ~finite
        else:
            skipped = jnp.zeros((), bool)
        if precision.loss_scaling:
            loss_scale = plan.loss_scale.update(loss_scale, finite)

        new_state = state.replace(
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            loss_scale=loss_scale,
            rng=next_rng,
            model_state=model_state,
        )
        metrics = {
            "loss": total.mean,
            "count": total.count,
            "grad_norm": grad_norm,
            "loss_scale": scale,
            "skipped": skipped,
            **fp8_metrics,
        }
        if aux is not None:
            metrics["aux"] = aux
        return new_state, metrics
