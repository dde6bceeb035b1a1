"""The schedule a model's pipeline uses while it is traced, and whether its parameters are being made."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from ..comm._gather import passthrough, stage_reads
from ..sharding._axes import DATA_AXES
from ._config import Pipeline

if TYPE_CHECKING:
    from ..comm._quantize import Wire

_CURRENT: contextvars.ContextVar[Pipeline | None] = contextvars.ContextVar("zjax_pipeline", default=None)


@contextlib.contextmanager
def use(pipeline: Pipeline | None) -> Iterator[None]:
    """Make ``pipeline`` the schedule :func:`apply` uses while a model is traced (the train step does this)."""
    token = _CURRENT.set(pipeline)
    try:
        yield
    finally:
        _CURRENT.reset(token)


_INITIALIZING: contextvars.ContextVar[bool] = contextvars.ContextVar("zjax_pipeline_init", default=False)


@contextlib.contextmanager
def initializing() -> Iterator[None]:
    """While a model's parameters are made (``plan.init``): :func:`apply` runs its stages one after the
    other, whatever the mesh (only shapes matter, and the layers may not be sharded yet)."""
    token = _INITIALIZING.set(True)
    try:
        yield
    finally:
        _INITIALIZING.reset(token)


def current() -> Pipeline | None:
    """The schedule set by :func:`use` (the plan's, while its step traces the loss), or ``None``."""
    return _CURRENT.get()


_ACCUMULATE: contextvars.ContextVar[Any] = contextvars.ContextVar("zjax_pipeline_accumulate", default=None)


@contextlib.contextmanager
def accumulating(dtype: Any) -> Iterator[None]:
    """While a train step traces its loss: sum the layer weights' gradients over the microbatches in ``dtype``
    (``Plan(reduce_dtype=...)``; ``None``: in the weights' own dtype, as the transpose of the loop does)."""
    token = _ACCUMULATE.set(None if dtype is None else jnp.dtype(dtype))
    try:
        yield
    finally:
        _ACCUMULATE.reset(token)


_QUANTIZE: contextvars.ContextVar[tuple[Wire | None, Wire | None]] = contextvars.ContextVar(
    "zjax_pipeline_quantize", default=(None, None)
)


@contextlib.contextmanager
def quantizing(wire: Wire | None, grads: Wire | None = None) -> Iterator[None]:
    """While a step traces its loss: the table schedules' per-layer gathers move each layer over ``dp`` as ``wire``'s
    integer blocks with fp32 scales (``Plan(quantized_comm="weights")``; ``None``: in the compute dtype) and
    reduce-scatter each gradient as ``grads``' blocks (``"grads"``; ``None``: not)."""
    token = _QUANTIZE.set((wire, grads))
    try:
        yield
    finally:
        _QUANTIZE.reset(token)


def quantize_wire() -> Wire | None:
    """The weights' wire set by :func:`quantizing` (``None``: the gathers are not quantized)."""
    return _QUANTIZE.get()[0]


def reduce_wire() -> Wire | None:
    """The gradients' wire set by :func:`quantizing` (``None``: the reductions are not quantized)."""
    return _QUANTIZE.get()[1]


def accumulate_dtype() -> Any:
    """The dtype set by :func:`accumulating` (``None``: the weights' own)."""
    return _ACCUMULATE.get()


def summed_wide(stage_fn: Callable[[Any, jax.Array], Any], call: Callable[..., Any], layers: Any, x: Any) -> Any:
    """``call(stage_fn, layers, x)`` (the pipeline's loop) with the layer weights' gradients summed over its
    iterations in :func:`accumulating`'s dtype, then cast to the weights' dtype once.

    A loop's transpose sums a loop-invariant's gradient in that invariant's dtype; entering the weights in fp32
    would cost an fp32 copy of them for the step. Instead every stage reads its weights through :func:`_tie`
    to an fp32 zero of the same shape, whose gradient (the fp32 sum) becomes the weights' gradient.
    """
    wide = _ACCUMULATE.get()
    if wide is None:
        return call(stage_fn, layers, x)

    def tied(wz: Any, h: jax.Array, *side: Any) -> Any:
        w, z = wz
        return stage_fn(jax.tree.map(lambda a, b: _tie(a, b, wide), w, z), h, *side)

    @jax.custom_vjp
    def run(w: Any, x: Any) -> Any:
        return call(stage_fn, w, x)

    def fwd(w: Any, x: Any) -> tuple[Any, Any]:
        z = jax.tree.map(lambda a: jnp.zeros(a.shape, wide), w)
        return jax.vjp(lambda w, z, x: call(tied, (w, z), x), w, z, x)

    def bwd(pull: Any, ct: Any) -> tuple[Any, Any]:
        _, dz, dx = pull(ct)
        return jax.tree.map(lambda d, a: d.astype(a.dtype), dz, dtypes), dx

    dtypes = jax.tree.map(lambda a: jax.ShapeDtypeStruct((), a.dtype), layers)
    run.defvjp(fwd, bwd)
    return run(layers, x)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _tie(w: jax.Array, z: jax.Array, dtype: Any) -> jax.Array:
    """``w``, whose gradient goes to ``z`` in ``dtype`` (a loop's transpose then sums it in that dtype)."""
    return w


def _tie_fwd(w: jax.Array, z: jax.Array, dtype: Any) -> tuple[jax.Array, None]:
    return w, None


def _tie_bwd(dtype: Any, _: None, ct: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jnp.zeros_like(ct), ct.astype(dtype)


_tie.defvjp(_tie_fwd, _tie_bwd)


def own_reads(
    stage_fn: Callable[[Any, jax.Array], Any], per_layer: bool = False, reads: list | None = None
) -> Callable[[Any, jax.Array], Any]:
    """``stage_fn`` traced with :func:`zjax.comm.gathered` passing values through: the stage's weights arrive as
    the pipeline gathered them ("step") or as GSPMD gathers them per use ("layer"). ``per_layer``
    ("layer"): under qwZ, a layer read with its model path crosses the ZeRO axes as integer blocks
    (:func:`zjax.comm._gather.stage_reads`); each trace appends its reads to ``reads`` (``None``: nothing
    quantizes)."""

    def fn(stage_layers: Any, h: jax.Array, *side: Any) -> Any:
        if not per_layer:
            with passthrough():
                return stage_fn(stage_layers, h, *side)
        with stage_reads() as made:
            out = stage_fn(stage_layers, h, *side)
        if reads is not None:
            reads.append(made)
        return out

    return fn


def call_stage(stage_fn: Callable[..., Any], stage_layers: Any, h: Any, side: Any) -> Any:
    """``stage_fn(stage_layers, h)``, or ``stage_fn(stage_layers, h, side)`` when the pipeline carries side inputs
    (a microbatch's positions, segment ids and the like: its rows' per-token arrays, the same at every stage)."""
    return stage_fn(stage_layers, h) if side is None else stage_fn(stage_layers, h, side)


def data_axes_here(sizes: dict[str, int]) -> tuple[str, ...]:
    """The data axes (size > 1) the pipeline splits rows over itself: those not already manual (a train step
    that makes each rank's gradients in a ``shard_map`` over the data axes runs the pipeline inside it)."""
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    return tuple(a for a in DATA_AXES if sizes.get(a, 1) > 1 and a not in manual)


def mesh_sizes() -> dict[str, int]:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        raise ValueError(
            "zjax.pipeline.apply needs a mesh in context: call it inside plan.train_step's loss, or under "
            "jax.set_mesh(mesh)."
        )
    return dict(mesh.shape)
