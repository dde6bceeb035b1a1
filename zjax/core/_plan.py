"""``Plan``: one frozen object that says how a model trains on a mesh (stage, precision, rules)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec

from ..offload._config import Offload
from ..offload._update import check_streamable
from ..pipeline import initializing
from ..sharding._annotations import Leaf, path_str, read_leaves, unbox
from ..sharding._batch import shard_batch
from ..sharding._rules import Rules
from ..stages._layout import Layout, Unsharded
from ._config import PlanConfig
from ._layout import StateLayout
from ._state import MixedPrecisionState, TrainState, Variables
from ._step import EvalStep, LossFn, TrainStep

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


class Plan(PlanConfig):
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
      reduce_dtype: the dtype gradients are reduced in across data parallelism (``None``: the compute
        dtype, half the bytes; ``"float32"``: each rank's gradient is widened before the one reduce-scatter
        / all-reduce of the step, so a ring over many ranks does not round at every hop; 2x the gradient
        bytes on the wire). At stages 0-2, and under a pipeline at every stage (the microbatches summed in
        fp32 too; ``Pipeline(zero3_gather="step")``), each rank then holds its whole fp32 gradient sum until
        the reduction; at stage 3 without one, each layer's gradient reduce-scatters in fp32.
      gpu_overlap: apply zjax's XLA:GPU compiler options for the stage (:data:`zjax.core._overlap.GPU_OVERLAP`;
        at stage 3 pipelined all-gathers and reduce-scatters, so that each layer's weight gather and
        gradient reduction run under the neighbouring layer's compute); ``False`` keeps XLA's defaults.
        Only compiles for GPUs are affected.
      offload: ZeRO-Offload (:class:`zjax.Offload` or a name): ``"none"`` (default); ``"optimizer"``
        keeps the fp32 master weights and the optimizer state in pinned host memory (stages 1-3) and
        streams them through the device in bounded chunks for the update; ``"optimizer+params"`` also
        keeps each device's shard of the compute parameters there (stage 3). Needs an elementwise
        optimizer (adamw, lion, sgd, ``zjax.pallas.fused_adamw``; clip with ``clip_norm``).
      quantized_comm: ``"weights"`` (stage 3, ZeRO++'s qwZ): each weight split over ``dp`` crosses it as
        int8 blocks with fp32 scales (:mod:`zjax.comm`), forward and in the rematerialized forward, for
        about half of ZeRO-3's gather bytes; gradients still reduce in the compute dtype and the fp32
        master never sees quantization. The model must read its parameters through
        :func:`zjax.comm.gathered` (``zjax.models.Decoder`` does). ``"grads"`` / ``"weights+grads"`` (qgZ):
        gradients reduce as int8 blocks through all-to-alls, summed in fp32. A part names its width and block
        (``"weights:int4@64+grads"``: :func:`zjax.comm.parse`). Under a pipeline, ``"weights"`` in every
        ``Pipeline(zero3_gather=...)`` mode (with ``"layer"``, the stage reads each layer through
        :func:`zjax.comm.gathered_tree`, as the Decoder does); with ``hpz``, the int8 crossings are the node
        shards' gather and (qgZ) each layer's reduction inside the node, then across nodes. ``None``
        (default): no quantization.
      compute_copy: ``True`` (default) keeps the parameters in the compute dtype (``state.params``) beside the
        fp32 master in the optimizer state: 14 bytes per parameter with Adam at stage 3. ``False`` (stage 3,
        bf16/fp16, no offload; under a pipeline too) keeps only the fp32 weights, as ``state.params``, and each step
        casts every shard to the compute dtype before it is gathered (quantized from that cast with
        ``quantized_comm``): 12 bytes per parameter of state, as MaxText and FSDP2 keep, the same bytes on
        the wire and the cast's temporaries during the step. :meth:`reshard` moves a state between the two.
      hpz: ZeRO++'s hierarchical partitioning (stage 3, a mesh with ``replica`` > 1): the state is split over
        ``replica x dp`` (ZeRO-3's memory over every rank, not HSDP's over ``dp`` alone); each step gathers the
        parameters across nodes once, to their node's shards (ZeRO++'s secondary partition), and the forward
        and rematerialized passes gather each layer from those over ``dp``, inside the node; gradients
        reduce-scatter over ``dp`` per layer, then over ``replica``. Costs the node's shards (2 bytes per
        parameter / dp in bf16; in fp32 with ``reduce_dtype="float32"``, whose sums stay fp32 from ``dp`` to
        ``replica``) in temporaries during the step. Any model (no :mod:`zjax.comm` reads needed).
      skip_nonfinite: leave a step whose gradients are not all finite out (state as it was, ``skipped`` in the
        metrics). ``None`` (default): when the precision scales the loss (fp16), or the model keeps fp8 amax
        histories (a non-finite amax skips too); ``True`` in any precision (fp8 products, whose inf or NaN amax
        would otherwise reach the weights).

    Example:
      >>> plan = zjax.Plan(zjax.make_mesh(dp=-1, tp=2), stage=3, precision="bf16")
      >>> state = plan.init(lambda r: model.init(r, x)["params"], optax.adamw(3e-4), jax.random.key(0))
      >>> step = plan.train_step(loss_fn)
      >>> state, metrics = step(state, plan.shard_batch(batch))
    """

    # -- layouts --------------------------------------------------------------------------------

    def layout(self, abstract_params: Any) -> Layout:
        """The parameter layout of a parameter tree (concrete or abstract, flax annotations allowed)."""
        leaves = read_leaves(abstract_params)
        treedef = jax.tree.structure(unbox(abstract_params))
        return self._param_layout(leaves, treedef)

    def _param_layout(self, leaves: list[Leaf], treedef: Any) -> Layout:
        compute = cast(Rules, self.rules).compute_specs(leaves, self.mesh)
        return Layout.build(self.stage, self.mesh, treedef, leaves, compute, hierarchical=self.hpz)

    def _state_layout(
        self,
        param_leaves: list[Leaf],
        param_treedef: Any,
        model_leaves: list[Leaf],
        model_treedef: Any,
        tx: Any,
        opt_inner: Any,
    ) -> StateLayout:
        """The one place a state's layout is built (init, abstract state, restore and reshard use it)."""
        params = self._param_layout(param_leaves, param_treedef)
        opt_specs = params.optimizer_specs(tx, opt_inner)
        opt_flat, opt_treedef = jax.tree.flatten(opt_specs, is_leaf=_is_spec)
        if cast(Any, opt_treedef) != jax.tree.structure(opt_inner):
            raise ValueError(
                f"Plan: could not lay out the optimizer state of {type(tx).__name__}: its spec tree "
                f"{opt_treedef} does not mirror the state {jax.tree.structure(opt_inner)}."
            )
        model_specs = cast(Rules, self.rules).compute_specs(model_leaves, self.mesh)
        offload = cast(Offload, self.offload)
        if offload.enabled:
            master = [jax.ShapeDtypeStruct(leaf.shape, jnp.float32) for leaf in param_leaves]
            master_tree = jax.tree_util.tree_unflatten(param_treedef, master)
            check_streamable(tx, master_tree, opt_inner, master_tree)
        return StateLayout(
            params=params,
            master=self.keeps_master,
            opt_treedef=opt_treedef,
            opt_specs=tuple(opt_flat),
            model_treedef=model_treedef,
            model_leaves=tuple(model_leaves),
            model_specs=tuple(model_specs),
            offload=offload,
            opt_owners=params.optimizer_owners(tx, opt_inner),
        )

    # -- state ----------------------------------------------------------------------------------

    def _make_state_fn(self, init_fn: Callable[[jax.Array], Any], tx: Any, layout: StateLayout | None):
        precision, keeps_master = self.precision, self.keeps_master
        compute_dtype = precision.compute_dtype if keeps_master or not precision.master_weights else jnp.float32

        def make(rng: jax.Array, given: Any = None) -> TrainState:
            # zjax places parameters; nnx must not on its own. A model's pipeline runs its stages in turn.
            with nnx.use_eager_sharding(False), initializing():
                params, model_state = _split_init(init_fn(rng))
            if given is not None:  # the caller's values (XLA drops the unused initialisation)
                params = given

            def cast(dtype):
                return lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p

            master = jax.tree.map(cast(jnp.float32), params)
            compute = jax.tree.map(cast(compute_dtype), params)  # compute_copy=False: the fp32 weights
            return TrainState(
                step=jnp.zeros((), jnp.int32),
                params=compute,
                opt_state=MixedPrecisionState(master if keeps_master else None, tx.init(master)),
                loss_scale=self.loss_scale.init(precision.loss_scaling),
                rng=jax.random.fold_in(rng, _STATE_RNG),  # not the key init_fn used
                tx=tx,
                model_state=model_state,
                layout=layout,
            )

        return make

    def abstract_state(
        self, init_fn: Callable[[jax.Array], Any], tx: optax.GradientTransformation, rng: jax.Array
    ) -> TrainState:
        """The state :meth:`init` would make, as ``ShapeDtypeStruct`` leaves carrying their shardings.

        Nothing is allocated; use it to lower or compile a step ahead of time, or as a restore target.
        """
        state = self._abstract(init_fn, tx, rng)
        shardings = state.layout.state_shardings(state.tx)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)

    def _abstract(self, init_fn, tx, rng) -> TrainState:
        tx = as_transformation(tx)
        with nnx.use_eager_sharding(False), initializing():
            annotated = jax.eval_shape(init_fn, rng)
        params, model_state = annotated if isinstance(annotated, Variables) else (annotated, None)
        state = jax.eval_shape(self._make_state_fn(init_fn, tx, None), rng)
        layout = self._state_layout(
            read_leaves(params),
            jax.tree.structure(unbox(params)),
            read_leaves(model_state),
            jax.tree.structure(state.model_state),
            tx,
            state.opt_state.inner,
        )
        return state.replace(layout=layout)

    def init(
        self,
        init_fn: Callable[[jax.Array], Any],
        tx: optax.GradientTransformation,
        rng: jax.Array,
        *,
        params: Any = None,
    ) -> TrainState:
        """Create the training state directly in its sharded layout (never whole on one device).

        Args:
          init_fn: ``init_fn(rng) -> params``, e.g. ``lambda r: model.init(r, x)["params"]`` (linen) or
            ``lambda r: nnx.split(Model(rngs=nnx.Rngs(r)), nnx.Param)[1]`` (nnx); for a model with
            non-trainable state, a :class:`zjax.Variables` (``zjax.Variables.linen(model.init(r, x))``,
            ``zjax.Variables.nnx(Model(rngs=nnx.Rngs(r)))``).
          tx: any optax transformation; it updates the fp32 master weights.
          rng: a ``jax.random.key``.
          params: start from these parameter values instead of ``init_fn``'s (pretrained weights, e.g.
            from :func:`zjax.hf.load`); ``init_fn`` still gives the structure and logical axis names. Same
            tree and shapes as ``init_fn``'s parameters, any placement (they are not modified).

        Returns:
          A :class:`TrainState` whose leaves are sharded as this plan's stage says; ``state.layout``
          records where each leaf lives.
        """
        return self._init(init_fn, tx, rng, params, donate=False)

    def _init(self, init_fn, tx, rng, params: Any, donate: bool) -> TrainState:
        """:meth:`init`; ``donate`` lets fp32 ``params`` placed in the master layout become the master
        weights without a copy (for callers that made them, e.g. :func:`zjax.hf.load`)."""
        abstract = self._abstract(init_fn, tx, rng)
        layout = abstract.layout
        make = self._make_state_fn(init_fn, abstract.tx, layout)
        shardings = layout.state_shardings(abstract.tx)
        if params is None:
            return jax.jit(make, out_shardings=shardings)(rng)
        params = unbox(params)  # flax's boxed (logically partitioned) leaves, as model.init returns them, too
        _check_given(params, abstract.params)
        return jax.jit(make, out_shardings=shardings, donate_argnums=(1,) if donate else ())(rng, params)

    def reshard(self, state: TrainState) -> TrainState:
        """Place a same-shaped ``state`` into this plan's layout (another stage, mesh or rules; arrays
        put elsewhere by hand). Nothing is recomputed; arrays move with ``jax.device_put``.

        Between ``compute_copy=True`` and ``False`` of one precision the state changes form: the fp32 master
        becomes ``state.params`` (the compute copy is dropped), or ``state.params`` become the master and their
        cast the compute copy.

        Raises:
          ValueError: if the state's precision (master weights or not) differs from this plan's.
        """
        if not isinstance(state, TrainState):
            raise TypeError(f"Plan.reshard: expected a zjax.TrainState, got {type(state).__name__}.")
        state = self._with_compute_copy(state)
        if (state.opt_state.master is None) == self.keeps_master:
            raise ValueError(
                f"Plan.reshard: the state {'has no' if state.opt_state.master is None else 'has'} fp32 master "
                f"weights but this plan's precision {self.precision.name!r} "
                f"{'keeps' if self.keeps_master else 'does not keep'} them; reshard into a plan "
                f"of the state's precision."
            )
        old = state.layout
        if old is not None and old.params.treedef == jax.tree.structure(state.params):
            param_leaves = [p.leaf for p in old.params.placements]  # keeps the logical axis names
        else:
            param_leaves = _plain_leaves(state.params)
        if old is not None and old.model_treedef == jax.tree.structure(state.model_state):
            model_leaves = list(old.model_leaves)
        else:
            model_leaves = _plain_leaves(state.model_state)
        layout = self._state_layout(
            param_leaves,
            jax.tree.structure(state.params),
            model_leaves,
            jax.tree.structure(state.model_state),
            state.tx,
            state.opt_state.inner,
        )
        state = state.replace(layout=layout)
        return jax.device_put(state, layout.state_shardings(state.tx))

    def _with_compute_copy(self, state: TrainState) -> TrainState:
        """``state`` in this plan's form (compute copy and master, or the fp32 weights alone) when it holds the
        same precision's values in the other form; else as it is."""
        compute = jnp.dtype(self.precision.compute_dtype)
        leaves = [x for x in jax.tree.leaves(state.params) if jnp.issubdtype(x.dtype, jnp.floating)]
        if not self.precision.master_weights or not leaves:
            return state
        master = state.opt_state.master
        if master is not None and not self.keeps_master and all(x.dtype == compute for x in leaves):
            return state.replace(params=master, opt_state=MixedPrecisionState(None, state.opt_state.inner))
        if master is None and self.keeps_master and all(x.dtype == jnp.float32 for x in leaves):
            to_compute = lambda x: x.astype(compute) if jnp.issubdtype(x.dtype, jnp.floating) else x  # noqa: E731
            params = jax.tree.map(to_compute, state.params)
            return state.replace(params=params, opt_state=MixedPrecisionState(state.params, state.opt_state.inner))
        return state

    # -- steps ----------------------------------------------------------------------------------

    def train_step(self, loss_fn: LossFn, accum_steps: int = 1) -> TrainStep:
        """A jitted, state-donating step ``step(state, batch) -> (state, metrics)``.

        Args:
          loss_fn: ``loss_fn(params, batch) -> loss`` or ``(loss, aux)``; ``loss`` is a scalar mean. With
            an ``rng`` parameter, ``loss_fn(params, batch, rng)`` gets a fresh key each step (from ``state.rng``);
            with ``rng`` and ``rows``, the step's one key and the rows' global indices on every path
            (:class:`zjax.TrainStep`).
            With a ``model_state`` parameter (models with batch statistics or nnx RNG state),
            ``loss_fn(params, batch, model_state) -> (loss, new_model_state)`` or
            ``((loss, aux), new_model_state)``; the new model state is kept in ``state.model_state``, after
            ``loss_fn.finish_step(model_state)`` if the function has that attribute (applied once per step,
            after the last microbatch: :func:`zjax.models.train_functions`' moves the routers' biases).
          accum_steps: split each batch into this many microbatches and accumulate their gradients
            (in fp32, laid out like the gradients: dp-sharded at stages 2 and 3).
        """
        return TrainStep(self, loss_fn, accum_steps)

    def eval_step(self, fn: Callable[..., Any]) -> EvalStep:
        """A jitted evaluation ``eval(state, batch) -> fn(state.params, batch)`` on the state's layout.

        ``fn(params, batch) -> metrics`` (any pytree), or ``fn(params, batch, model_state)`` for models
        with model state. Traced under the plan's mesh, activation rules and pipeline; nothing is donated,
        and a second call with the same shapes does not compile again.
        """
        return EvalStep(self, fn)

    def shard_batch(self, batch: Any) -> Any:
        """Place ``batch`` on the mesh with its leading dimension over ``dp``. See :func:`zjax.shard_batch`."""
        return shard_batch(batch, self.mesh)

    def unsharded(self, state: TrainState) -> list[Unsharded]:
        """Leaves that this stage keeps replicated over dp because no dimension divides by its size."""
        return _layout_of(state).unsharded


def _split_init(out: Any) -> tuple[Any, Any]:
    """``init_fn``'s result as (unboxed params, model state)."""
    if isinstance(out, Variables):
        return unbox(out.params), unbox(out.model_state)
    return unbox(out), None


def _check_given(params: Any, expected: Any) -> None:
    """``params`` has the tree and shapes of the model's parameters ``expected``, or a ValueError names the leaf."""
    got, want = jax.tree.structure(params), jax.tree.structure(expected)
    if cast(Any, got) != want:
        have = {path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
        need = {path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(expected)[0]}
        raise ValueError(
            f"Plan.init: params do not match the model's parameter tree: missing {sorted(need - have)[:8]}, "
            f"unexpected {sorted(have - need)[:8]}. Pass a tree shaped like init_fn's parameters."
        )
    for (path, x), e in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(expected), strict=True):
        if tuple(jnp.shape(x)) != tuple(e.shape):
            raise ValueError(
                f"Plan.init: params leaf {path_str(path)!r} has shape {tuple(jnp.shape(x))}; the model's parameter "
                f"has shape {tuple(e.shape)}."
            )


def _plain_leaves(tree: Any) -> list[Leaf]:
    """Leaves without logical names (a tree built without flax annotations): regex rules apply."""
    return [Leaf(path_str(p), tuple(x.shape), x.dtype, None) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _layout_of(state: TrainState) -> StateLayout:
    if state.layout is None:
        raise ValueError(
            "this TrainState has no layout: build it with plan.init, plan.abstract_state or a checkpoint "
            "restore, or place it with state = plan.reshard(state)."
        )
    return cast(StateLayout, state.layout)
