"""The jitted training step: mixed precision, loss scaling, gradient accumulation, clipping, the update."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from . import pipeline
from ._state import MixedPrecisionState, TrainState
from .sharding._batch import batch_shardings, check_batch
from .stages._layout import Layout

if TYPE_CHECKING:
    from ._plan import Plan

LossFn = Callable[[Any, Any], Any]


def _constrain(tree: Any, specs: Any, mesh) -> Any:
    return jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s)), tree, specs)


def _split_microbatches(batch: Any, k: int) -> Any:
    """``[B, ...] -> [k, B/k, ...]`` where microbatch ``i`` is rows ``i, i+k, ...``.

    Reshaping to ``(B/k, k)`` keeps each dp shard's rows on that shard (the dp split stays on the
    first dimension), so no data moves; ``(k, B/k)`` directly would put dp on the microbatch index.
    """
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), batch)


def _takes_rng(fn: Callable) -> bool:
    """Whether ``fn`` accepts an ``rng`` keyword (then the step passes it a fresh key)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "rng" in params


def _tree_where(pred: jax.Array, new: Any, old: Any) -> Any:
    return jax.tree.map(lambda n, o: jnp.where(pred, n, o), new, old)


class TrainStep:
    """A compiled training step for one plan and loss function; call it as ``step(state, batch)``.

    ``loss_fn(params, batch)`` returns a scalar loss (a mean over the batch) or ``(loss, aux)``. A
    ``loss_fn(params, batch, rng)`` also gets a fresh PRNG key per step and microbatch, split from
    ``state.rng`` (dropout that resumes reproducibly from a checkpoint).
    Returns the new state and metrics: ``loss``, ``grad_norm`` (unscaled, before clipping),
    ``loss_scale``, ``skipped`` (non-finite gradients under loss scaling) and ``aux`` if given.
    The input state is donated: do not use it after the call.
    """

    def __init__(self, plan: Plan, loss_fn: LossFn, accum_steps: int = 1):
        if not callable(loss_fn):
            raise TypeError(f"train_step: loss_fn must be callable, got {type(loss_fn).__name__}.")
        if not isinstance(accum_steps, int) or isinstance(accum_steps, bool) or accum_steps < 1:
            raise ValueError(f"train_step: accum_steps={accum_steps!r} must be an int >= 1.")
        self.plan = plan
        self.loss_fn = loss_fn
        self._takes_rng = _takes_rng(loss_fn)
        self.accum_steps = accum_steps
        self._jitted: dict[Any, Any] = {}

    def _jit(self, state: TrainState, batch: Any):
        key = (jax.tree.structure(state), jax.tree.structure(batch))
        if key not in self._jitted:
            layout = self.plan.layout_of(state.params)
            state_shardings = self.plan.state_shardings(state)
            fn = jax.jit(
                lambda s, b: self._step(layout, s, b),
                in_shardings=(state_shardings, batch_shardings(batch, self.plan.mesh)),
                out_shardings=(state_shardings, None),
                donate_argnums=0,
            )
            self._jitted[key] = fn
        return self._jitted[key]

    def _context(self):
        """The mesh and activation rules under which the loss is traced, so that
        ``nn.with_logical_constraint`` inside the model resolves to this plan's mesh axes."""
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.plan.mesh))
        stack.enter_context(nn.logical_axis_rules(self.plan.rules.activations_for(self.plan.mesh)))
        stack.enter_context(pipeline.use(self.plan.pipeline))
        return stack

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        check_batch(batch, self.plan.mesh, self.accum_steps)
        with self._context():
            return self._jit(state, batch)(state, batch)

    def lower(self, state: TrainState, batch: Any):
        """``jax.jit(...).lower`` for concrete or abstract (``ShapeDtypeStruct``) state and batch."""
        check_batch(batch, self.plan.mesh, self.accum_steps)
        with self._context():
            return self._jit(state, batch).lower(state, batch)

    # -- the traced step ------------------------------------------------------------------------

    def _grads(self, layout: Layout, params: Any, batch: Any, scale: jax.Array, rng: jax.Array):
        """Mean loss, aux and gradients of ``loss * scale`` (summed over microbatches, fp32 if k > 1)."""
        mesh = self.plan.mesh

        def scaled(p, b, i):
            out = self.loss_fn(p, b, rng=jax.random.fold_in(rng, i)) if self._takes_rng else self.loss_fn(p, b)
            loss, aux = out if isinstance(out, tuple) else (out, None)
            if jnp.ndim(loss) != 0:
                raise ValueError(f"loss_fn must return a scalar loss, got shape {jnp.shape(loss)}.")
            return loss.astype(jnp.float32) * scale, (loss.astype(jnp.float32), aux)

        grad_fn = jax.grad(scaled, has_aux=True)
        k = self.accum_steps
        if k == 1:
            # Straight to the optimizer's layout: at stage 1 too the reduction is a reduce-scatter
            # (ZeRO's 2 psi per step); an all-reduce to full gradients would cost 3 psi with the gather.
            grads, (loss, aux) = grad_fn(params, batch, 0)
            return loss, aux, _constrain(grads, layout.master_specs, mesh)

        def body(acc, xs):
            i, microbatch = xs
            grads, (loss, aux) = grad_fn(params, microbatch, i)
            grads = _constrain(grads, layout.grad_specs, mesh)
            acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
            return _constrain(acc, layout.grad_specs, mesh), (loss, aux)

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        acc, (losses, auxes) = jax.lax.scan(
            body, _constrain(zeros, layout.grad_specs, mesh), (jnp.arange(k), _split_microbatches(batch, k))
        )
        aux = jax.tree.map(lambda a: jnp.mean(a, axis=0), auxes)
        return jnp.mean(losses), aux, acc

    def _step(self, layout: Layout, state: TrainState, batch: Any):
        plan, mesh = self.plan, self.plan.mesh
        precision = plan.precision
        scale = state.loss_scale.scale
        next_rng, step_rng = jax.random.split(state.rng)
        loss, aux, grads = self._grads(layout, state.params, batch, scale, step_rng)

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
        if precision.master_weights:
            # Cast on the shard, then gather: XLA would otherwise all-gather the fp32 master (2x bytes).
            params = _constrain(_constrain(cast, layout.master_specs, mesh), layout.param_specs, mesh)
            opt_state = MixedPrecisionState(new_master, inner)
        else:
            params = _constrain(new_master, layout.param_specs, mesh)
            opt_state = MixedPrecisionState(None, inner)

        loss_scale = state.loss_scale
        if skip_nonfinite:
            params = _tree_where(finite, params, state.params)
            opt_state = _tree_where(finite, opt_state, state.opt_state)
        if precision.loss_scaling:
            loss_scale = plan.loss_scale.update(loss_scale, finite)
            skipped = ~finite
        else:
            skipped = jnp.zeros((), bool)

        new_state = state.replace(
            step=state.step + 1, params=params, opt_state=opt_state, loss_scale=loss_scale, rng=next_rng
        )
        metrics = {"loss": loss, "grad_norm": grad_norm, "loss_scale": scale, "skipped": skipped}
        if aux is not None:
            metrics["aux"] = aux
        return new_state, metrics
