"""Quantized weight gathers (ZeRO++'s qwZ): a ZeRO-3 weight crosses the ZeRO axes as int8 blocks.

A model reads each parameter through :func:`gathered` (``zjax.models.Decoder`` does). While a train or eval
step traces the loss under :func:`use` (the plan sets it from ``Plan(quantized_comm="weights")``), a weight
split over the ZeRO axes (``dp``, and ``cp``) is quantized on its own shard, all-gathered as int8 with its
fp32 scales and dequantized to the compute dtype on arrival, in a ``shard_map`` manual over the whole mesh
(GSPMD would choose where to gather, and might gather the bf16 weight before quantizing it). Its gradient
goes back unquantized: a reduce-scatter in the gradient's dtype (the straight-through estimator; the fp32
master weights and the optimizer never see quantization). Inside a layer scan the gather runs per layer, in
the forward pass and again in the rematerialized one, so both of ZeRO-3's weight gathers are int8.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..sharding._rules import spec_axes
from ._quantize import DEFAULT_BLOCK, dequantize, quantize

QUANTIZED_COMM = ("weights",)
"""What ``Plan(quantized_comm=...)`` can quantize."""


@dataclasses.dataclass(frozen=True)
class _Active:
    specs: dict[tuple[str, ...], tuple[Any, ...]]  # parameter path -> its ZeRO-3 spec, one entry per dim
    zero: dict[tuple[str, ...], frozenset[str]]  # parameter path -> the axes the stage added (not the compute spec's)
    block: int


_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar("zjax_quantized_comm", default=None)


@contextlib.contextmanager
def use(placements: Sequence[Any], block: int = DEFAULT_BLOCK) -> Iterator[None]:
    """Quantize the ZeRO weight gathers of the parameters placed as ``placements`` (a parameter layout's
    :class:`zjax.stages.Placement` s) while a loss is traced."""
    specs, zero = {}, {}
    for p in placements:
        path, spec = tuple(p.leaf.path.split("/")), p.sharded
        specs[path] = tuple(spec) + (None,) * (len(p.leaf.shape) - len(spec))
        zero[path] = frozenset(spec_axes(spec)) - frozenset(spec_axes(p.compute))  # an expert's ep stays split
    token = _ACTIVE.set(_Active(specs, zero, block))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def gathered(value: Any, path: Sequence[str]) -> Any:
    """The parameter at ``path`` (its keys in the params tree, e.g. ``("layers", "wq")``), whole over the ZeRO
    axes: gathered as int8 under :func:`use`, else ``value`` as it is (GSPMD gathers it in its dtype).

    Inside a layer scan ``value`` is one layer's slice of a stacked parameter: its spec is the stacked one
    without the leading layers entry.
    """
    active = _ACTIVE.get()
    if active is None or not jnp.issubdtype(value.dtype, jnp.floating):
        return value
    spec = active.specs.get(tuple(path))
    if spec is None or len(spec) not in (value.ndim, value.ndim + 1):
        return value
    entries = list(spec[len(spec) - value.ndim :])  # one layer of a stacked parameter: without the layers entry
    added = active.zero[tuple(path)]
    split = [(d, e) for d, e in enumerate(entries) if e is not None and set(_axes(e)) & added]
    if not split:
        return value
    dim, entry = split[0]
    zero = tuple(a for a in _axes(entry) if a in added)
    kept = tuple(a for a in _axes(entry) if a not in added)
    if kept and _axes(entry)[: len(kept)] != kept:  # ZeRO's axes must be the minor part of the dim's split
        return value
    whole = list(entries)
    whole[dim] = (kept if len(kept) > 1 else kept[0]) if kept else None
    return _quantized_gather(value, P(*entries), P(*whole), dim, zero, active.block)


def _axes(entry: Any) -> tuple[str, ...]:
    return entry if isinstance(entry, tuple) else (entry,)


def _quantized_gather(x: jax.Array, split: P, whole: P, dim: int, zero: tuple[str, ...], block: int) -> jax.Array:
    names = set(jax.sharding.get_abstract_mesh().axis_names)

    def forward(local: jax.Array) -> jax.Array:
        q, scale = quantize(local, block)
        q = jax.lax.all_gather(q, zero, axis=dim, tiled=True)
        scale = jax.lax.all_gather(scale, zero, axis=dim, tiled=True)
        return dequantize(q, scale, local.dtype)

    @jax.custom_vjp
    def run(x: jax.Array) -> jax.Array:
        return jax.shard_map(forward, in_specs=split, out_specs=whole, axis_names=names, check_vma=False)(x)

    def fwd(x: jax.Array) -> tuple[jax.Array, None]:
        return run(x), None

    def bwd(_: None, g: jax.Array) -> tuple[jax.Array]:
        # g is each rank's partial sum (the weight-gradient dot over its rows): constrained to the split
        # layout, GSPMD reduce-scatters it, as it does the unquantized gather's gradient
        return (jax.lax.with_sharding_constraint(g, split),)

    run.defvjp(fwd, bwd)
    return run(x)
