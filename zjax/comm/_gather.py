"""Where a model reads its parameters: quantized weight gathers (ZeRO++'s qwZ) and, inside a step manual over the data
axes, explicit ZeRO-3 gathers whose gradients reduce in fp32 or as int8 (qgZ).

A model reads each parameter through :func:`gathered` (``zjax.models.Decoder`` does). While a train or eval
step traces the loss under :func:`use` (the plan sets it from ``Plan(quantized_comm="weights")``), a weight
split over the ZeRO axes (``dp``, and ``cp``) is quantized on its own shard, all-gathered as int8 with its
fp32 scales and dequantized to the compute dtype on arrival, in a ``shard_map`` manual over the whole mesh
(GSPMD would choose where to gather, and might gather the bf16 weight before quantizing it). Its gradient
goes back unquantized: a reduce-scatter in the gradient's dtype (the straight-through estimator; the fp32
master weights and the optimizer never see quantization). Inside a layer scan the gather runs per layer, in
the forward pass and again in the rematerialized one, so both of ZeRO-3's weight gathers are int8.

Under :func:`manual` (a train step traced in a ``shard_map`` manual over the data axes, which ZeRO-3 takes when its
gradients must reduce in another dtype or quantized) every parameter arrives as this rank's shard of the fp32
master (or of the compute parameters without master weights): :func:`gathered` casts it to the compute dtype,
all-gathers it (int8 with qwZ) and, in the backward pass, reduces this rank's partial gradient straight into the
shard with :func:`zjax.comm.reduce`: a reduce-scatter in fp32, or int8 through all-to-alls, per layer as GSPMD's
would be. A parameter the model does not read through :func:`gathered` is gathered the same way before the loss.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Collection, Iterator, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from ..sharding._axes import REPLICA
from ..sharding._rules import spec_axes
from ._quantize import FLOAT8, PARTS, Wire, all_gather
from ._qwz import pinned_gather, quantized_gather
from ._reduce import Reduction, reduce_all
from ._shard import shard_gather

GATHERED = "zjax_gathered"
"""The :func:`jax.ad_checkpoint.checkpoint_name` of a layer weight gathered by :func:`shard_reads` (a remat policy
saving every activation but these re-gathers the weights in the backward pass rather than keeping them)."""

QUANTIZED_COMM = (*PARTS, "+".join(PARTS))
"""What ``Plan(quantized_comm=...)`` can quantize: ZeRO-3's weight gathers, its gradient reductions, or both (each
part int8, or int4 with ``":int4"``: :func:`zjax.comm.parse`)."""


@dataclasses.dataclass(frozen=True)
class _Manual:
    axes: tuple[str, ...]  # the data axes the region is manual over
    dtype: Any  # the compute dtype the model reads parameters in
    reduction: Reduction
    weights: Wire | None  # how the gathers quantize (None: in the compute dtype)
    hierarchical: bool = False  # hpZ: parameters arrive as their node's shards (split over dp, not replica)


@dataclasses.dataclass(frozen=True)
class _Active:
    specs: dict[tuple[str, ...], tuple[Any, ...]]  # parameter path -> its ZeRO-3 spec, one entry per dim
    zero: dict[tuple[str, ...], frozenset[str]]  # parameter path -> the axes the stage added (not the compute spec's)
    wire: Wire | None  # how the weight gathers quantize (outside manual); None: only the placements are known
    manual: _Manual | None = None
    read: set[tuple[str, ...]] | None = None  # records the paths read (see :func:`reads`)
    memo: dict[Any, Any] = dataclasses.field(default_factory=dict)  # (path, id) -> (value, gathered)
    stage: bool = False  # inside a pipeline stage (zero3_gather="layer"): GSPMD partitions, pinned_gather
    shards: _Shards | None = None  # inside a table schedule's stage whose layers enter as their shards


@dataclasses.dataclass(frozen=True)
class _Shards:
    axis: str  # the manual axis the layers are split over (dp)
    dims: dict[tuple[str, ...], int]  # a layer leaf's keys in the stacked layers -> its split dim in one layer
    wire: Wire | None  # how the gathers quantize
    reduction: Reduction | None  # how the gradients reduce (None: reduce-scattered in their dtype)
    read: set[tuple[str, ...]]  # the keys read so far
    gather: bool = True  # False: only record the reads (an abstract probe of the stage)


_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar("zjax_comm", default=None)


def manual_placement(path: Sequence[str]) -> tuple[tuple[Any, ...], _Manual] | None:
    """Under :func:`manual`: the ZeRO spec of the parameter at ``path`` and the region's settings; else ``None``."""
    active = _ACTIVE.get()
    if active is None or active.manual is None or tuple(path) not in active.specs:
        return None
    return active.specs[tuple(path)], active.manual


def placement(path: Sequence[str]) -> tuple[tuple[Any, ...], frozenset[str]] | None:
    """The ZeRO spec (one entry per dim) of the parameter at ``path`` and the axes the stage added, while a step
    traces its loss outside a region manual over the data axes; else ``None``."""
    active = _ACTIVE.get()
    if active is None or active.manual is not None or active.read is not None:
        return None
    spec = active.specs.get(tuple(path))
    return None if spec is None else (spec, active.zero[tuple(path)])


@contextlib.contextmanager
def use(placements: Sequence[Any], wire: Wire | None = None) -> Iterator[None]:
    """While a loss is traced, the parameters are placed as ``placements`` (a parameter layout's
    :class:`zjax.stages.Placement` s): their ZeRO weight gathers are quantized as ``wire`` says (``None``: not),
    and :func:`zjax.comm.lookup` can read an embedding table where it lies."""
    with _activate(_active(placements, wire)):
        yield


def _active(placements: Sequence[Any], wire: Wire | None, manual: _Manual | None = None) -> _Active:
    specs, zero = {}, {}
    for p in placements:
        path, spec = tuple(p.leaf.path.split("/")), p.sharded
        specs[path] = tuple(spec) + (None,) * (len(p.leaf.shape) - len(spec))
        zero[path] = frozenset(spec_axes(spec)) - frozenset(spec_axes(p.compute))  # an expert's ep stays split
    return _Active(specs, zero, wire, manual)


@contextlib.contextmanager
def _activate(active: _Active | None) -> Iterator[None]:
    token = _ACTIVE.set(active)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def manual(
    placements: Sequence[Any],
    axes: Sequence[str],
    dtype: Any,
    reduction: Reduction,
    weights: Wire | None = None,
    hierarchical: bool = False,
) -> Iterator[None]:
    """Trace a loss inside a ``shard_map`` manual over the data ``axes`` whose parameters enter as this rank's
    ZeRO-3 shards (:func:`manual_spec`): :func:`gathered` gathers each one over the ZeRO axes in ``dtype`` (as
    ``weights``' integer blocks when given) and reduces its gradient as ``reduction`` says. ``hierarchical`` (hpZ):
    they enter as their node's shards (:func:`to_node`), gathered and reduced over the axes other than
    ``replica``."""
    settings = _Manual(tuple(axes), jnp.dtype(dtype), reduction, weights, hierarchical)
    with _activate(_active(placements, weights, settings)):
        yield


def manual_spec(spec: P, axes: Sequence[str]) -> P:
    """``spec`` with only the manual ``axes`` kept: a parameter's ``in_specs`` entry for the manual region."""
    kept = []
    for entry in spec:
        names = tuple(a for a in _axes(entry) if a in axes) if entry is not None else ()
        kept.append(None if not names else names[0] if len(names) == 1 else names)
    return P(*kept)


def reads_shards() -> bool:
    """Whether parameters are passed as this rank's shards (under :func:`manual`): a model that checks their
    shapes before reading them through :func:`gathered` must not."""
    active = _ACTIVE.get()
    return active is not None and active.manual is not None


def reads(fn: Any, *args: Any) -> set[tuple[str, ...]]:
    """The parameter paths ``fn(*args)`` reads through :func:`gathered` (traced abstractly, nothing runs)."""
    record: set[tuple[str, ...]] = set()
    with _activate(_Active({}, {}, None, read=record)):
        jax.eval_shape(fn, *args)
    return record


def gather_unread(params: Any, read: set[tuple[str, ...]]) -> Any:
    """Under :func:`manual`: ``params`` (this rank's shards) with every parameter the model does not read through
    :func:`gathered` gathered whole now, the ones it does left for it to gather as it reads them."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    out = [value if _path(keypath) in read else gathered(value, _path(keypath)) for keypath, value in flat]
    return jax.tree_util.tree_unflatten(treedef, out)


def gathered_tree(tree: Any, prefix: Sequence[str], float8: Collection[str] = ()) -> Any:
    """Every parameter of ``tree``, the subtree of the params at ``prefix`` (a decoder's stacked layers at
    ``("layers",)``), read through :func:`gathered`: a pipeline gathering its stages' weights once per step reads
    them so (quantized with ``Plan(quantized_comm="weights")``), and with ``zero3_gather="layer"`` a stage reads
    each layer so, one layer's slice at the stacked layers' prefix (quantized per layer inside the loop).
    ``float8``: names of ``tree``'s own leaves read by fp8 products (:func:`gathered`'s ``float8``)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    names = {(n,) for n in float8}  # the tree's own leaves, not a nested module's of the same name
    out = [gathered(v, (*prefix, *_path(kp)), float8=_path(kp) in names) for kp, v in flat]
    return jax.tree_util.tree_unflatten(treedef, out)


def _path(keypath: Any) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in keypath)


@contextlib.contextmanager
def passthrough() -> Iterator[None]:
    """While a pipeline's stage is traced: :func:`gathered` returns each value as it is (the stage's weights
    arrive as the pipeline gathered them, and its parameter paths are the stage's own, not the model's)."""
    with _activate(None):
        yield


@contextlib.contextmanager
def stage_reads() -> Iterator[dict[Any, Any] | None]:
    """While a pipeline's stage is traced with its weights split over the ZeRO axes (``zero3_gather="layer"``):
    under :func:`use` with a wire, a layer read through :func:`gathered` with its model path (``gathered_tree``
    of one layer's slice, at ``("layers",)``) crosses them as integer blocks (:func:`pinned_gather`), and any
    other read passes through (the stage's own module paths). Yields the reads made (path, id -> value), or
    ``None`` where nothing quantizes (:func:`passthrough`)."""
    active = _ACTIVE.get()
    if active is None or active.wire is None or active.manual is not None or active.read is not None:
        with passthrough():
            yield None
        return
    stage = _Active(active.specs, active.zero, active.wire, stage=True)
    with _activate(stage):
        yield stage.memo


@contextlib.contextmanager
def shard_reads(
    axis: str, layers: Any, dims: Sequence[int | None], wire: Wire | None, gather: bool = True,
    reduction: Reduction | None = None,
) -> Iterator[set[tuple[str, ...]]]:  # fmt: skip
    """While a pipeline's stage is traced in a region manual over ``axis`` with its stacked ``layers`` entering as
    their shards (a table schedule at ZeRO-3, ``zero3_gather="layer"``): a layer read through :func:`gathered`
    with its model path (``gathered_tree`` of one layer's slice) is all-gathered over ``axis`` on its split dim
    (``dims``: per leaf of ``layers`` in ``jax.tree.leaves`` order, that dim in one layer's slice, ``None`` for a
    leaf kept whole; as ``wire``'s integer blocks when given), and its gradient reduce-scattered back into the
    shard (as ``reduction`` says: int8 blocks with qgZ). Any other read passes through. Yields the keys (a split
    leaf's path in ``layers``) read: a stage that reads none of them would compute on shards. ``gather=False``:
    the reads are only recorded (a probe of the stage on whole layers, traced abstractly)."""
    read: set[tuple[str, ...]] = set()
    flat = jax.tree_util.tree_flatten_with_path(layers)[0]
    split = {_path(kp): d for (kp, _), d in zip(flat, dims, strict=True) if d is not None}
    with _activate(_Active({}, {}, wire, shards=_Shards(axis, split, wire, reduction, read, gather))):
        yield read


def _shard_gather(x: jax.Array, shards: _Shards, path: tuple[str, ...], float8: bool = False) -> jax.Array:
    """:func:`shard_reads`'s gather of the layer leaf at ``path`` (``x`` as it is unless ``path`` is a prefix and a
    split leaf's keys); as e4m3 for an fp8 product's weight (``float8``)."""
    # the layer read at its model path (a prefix, then the leaf's keys); the stage's own module paths (the keys
    # alone, a Block reading its parameters) pass through
    keys = [k for k in shards.dims if len(path) > len(k) and path[len(path) - len(k) :] == k]
    if not keys:
        return x
    key = max(keys, key=len)
    shards.read.add(key)
    if not shards.gather:
        return x
    # named, so that a stage that keeps its activations for the backward pass re-gathers this instead of keeping it
    gather = shard_gather(x, shards.axis, shards.dims[key], FLOAT8 if float8 else shards.wire, shards.reduction)
    return checkpoint_name(gather, GATHERED)


def gathered(value: Any, path: Sequence[str], now: bool = False, float8: bool = False) -> Any:
    """The parameter at ``path`` (its keys in the params tree, e.g. ``("layers", "wq")``), whole over the ZeRO
    axes: gathered as integer blocks under :func:`use` with a wire, else ``value`` as it is (GSPMD gathers it in its
    dtype where it is used). ``now``: gathered here in any case, for a reader that loops over it (GSPMD would
    gather it inside the loop, once per iteration forward and again backward, exposed: the LM head's chunks).
    ``float8``: an fp8 product reads it, so a table schedule's stage gathers it as e4m3 (:data:`zjax.comm.FLOAT8`).
    Inside a layer scan ``value`` is one layer's slice of a stacked parameter (its spec the stacked one but the
    leading layers entry)."""
    active = _ACTIVE.get()
    if active is None or not jnp.issubdtype(value.dtype, jnp.floating):
        return value
    if active.read is not None:
        active.read.add(tuple(path))
        return value
    # read twice (a tied embedding), gathered once: its two uses' gradients add up before the one reduction
    key = (tuple(path), id(value))
    if key in active.memo:
        return active.memo[key][1]
    if active.shards is not None:
        active.memo[key] = (value, _shard_gather(value, active.shards, tuple(path), float8))
        return active.memo[key][1]
    if active.manual is not None:
        active.memo[key] = (value, _manual_gather(value, active, tuple(path)))
        return active.memo[key][1]
    if active.wire is None and not now:
        return value
    spec = active.specs.get(tuple(path))
    if spec is None or len(spec) not in (value.ndim, value.ndim + 1):
        return value
    entries = list(spec[len(spec) - value.ndim :])  # one layer of a stacked parameter: without the layers entry
    added = active.zero[tuple(path)]
    split = [(d, e) for d, e in enumerate(entries) if e is not None and set(_axes(e)) & added]
    if len(split) != 1:  # none, or ZeRO's axes over two dims (add_axis's last resort): GSPMD gathers it as it is
        return value
    dim, entry = split[0]
    zero = tuple(a for a in _axes(entry) if a in added)
    kept = tuple(a for a in _axes(entry) if a not in added)
    if kept and _axes(entry)[: len(kept)] != kept:  # ZeRO's axes must be the minor part of the dim's split
        return value
    if active.stage:
        active.memo[key] = (value, pinned_gather(value, entries, dim, zero, cast(Wire, active.wire)))
        return active.memo[key][1]
    whole = list(entries)
    whole[dim] = (kept if len(kept) > 1 else kept[0]) if kept else None
    active.memo[key] = (value, quantized_gather(value, P(*entries), P(*whole), dim, zero, active.wire))
    return active.memo[key][1]


def _axes(entry: Any) -> tuple[str, ...]:
    return entry if isinstance(entry, tuple) else (entry,)


def _manual_gather(x: jax.Array, active: _Active, path: tuple[str, ...]) -> jax.Array:
    """This rank's shard of the parameter at ``path``, whole in the compute dtype; its gradient reduced into the
    shard (:func:`zjax.comm.reduce`) in the primal's dtype."""
    route = manual_route(x.ndim, active, path)

    @jax.custom_vjp
    def run(v: jax.Array) -> jax.Array:
        return route.gather(v)

    def fwd(v: jax.Array) -> tuple[jax.Array, jax.Array]:
        return run(v), jnp.zeros((0,), v.dtype)  # the primal's dtype, for the cotangent

    def bwd(like: jax.Array, g: jax.Array) -> tuple[jax.Array]:
        return (reduce_routes([route], [g])[0].astype(like.dtype),)

    run.defvjp(fwd, bwd)
    return run(x)


@dataclasses.dataclass(frozen=True)
class Route:
    """How one parameter crosses the data axes inside :func:`manual`: its shard is gathered along ``dim`` over
    ``split`` in ``dtype`` (as ``weights``' blocks when given); a rank's partial gradient of the whole parameter is
    reduced over ``split`` into the shard and summed over ``whole``. Each collective runs in a ``shard_map``
    manual over the mesh's ``others`` axes (tp, ...) on the local tiles (``local``: the spec over those): XLA's
    partitioner would otherwise replicate a tp-split operand over tp before a collective over the data axes
    (measured: every weight gradient all-gathered over tp in fp32 before its reduce-scatter)."""

    split: tuple[str, ...]
    dim: int | None
    whole: tuple[str, ...]
    local: P
    others: frozenset[str]
    dtype: Any
    weights: Wire | None
    reduction: Reduction

    def gather(self, v: jax.Array) -> jax.Array:
        """This rank's shard, whole in the compute dtype."""

        def run(v: jax.Array) -> jax.Array:
            v = v.astype(self.dtype)
            return v if self.dim is None else all_gather(v, self.split, self.dim, self.weights)

        return self._tiles(run, self.local, self.local)(v)

    def _tiles(self, fn: Any, in_specs: Any, out_specs: Any) -> Any:
        names = set(self.others)
        return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names=names, check_vma=False)


def reduce_routes(routes: Sequence[Route], grads: Sequence[jax.Array]) -> list:
    """The partial gradients ``grads`` of ``routes``' parameters (one layer's, or one parameter's) reduced into their
    shards (fp32 when quantized, else the reduction's dtype), in one ``shard_map``: quantized, those split over the
    same axes cross in one all-to-all."""
    specs = tuple(r.local for r in routes)

    def run(*gs: jax.Array) -> tuple:
        parts = [(g, r.split, r.dim, r.whole) for r, g in zip(routes, gs, strict=True)]
        return tuple(reduce_all(parts, routes[0].reduction))

    return list(routes[0]._tiles(run, specs, specs)(*grads))


def manual_route(ndim: int, active: _Active, path: tuple[str, ...]) -> Route:
    """Under :func:`manual`: how the parameter at ``path``, read as an ``ndim``-dim shard (one layer's, inside a
    layer scan), crosses the data axes."""
    manual = cast(_Manual, active.manual)
    spec = active.specs.get(path)
    if spec is None:
        raise ValueError(
            f"zjax.comm.gathered: no parameter at path {'/'.join(path)!r} in this step's layout; read parameters "
            "with their path in the params tree (e.g. ('layers', 'wq'))."
        )
    entries = spec[len(spec) - ndim :]  # one layer of a stacked parameter: without the layers entry
    axes_here = tuple(a for a in manual.axes if not (manual.hierarchical and a == REPLICA))  # hpZ: within the node
    dims = [(d, tuple(a for a in _axes(e) if a in axes_here)) for d, e in enumerate(entries) if e is not None]
    dims = [(d, axes) for d, axes in dims if axes]
    if len(dims) > 1:
        raise ValueError(
            f"zjax.comm.gathered: {'/'.join(path)!r} (spec {P(*entries)}) is split over the data axes on two dims "
            "(no one dim divides by their size); the manual ZeRO-3 path (reduce_dtype, quantized gradients) gathers "
            "one dim. Use the default path, or a mesh whose ZeRO axes' size divides one of its dims."
        )
    dim, split = dims[0] if dims else (None, ())
    whole = tuple(a for a in axes_here if a not in split)
    others = frozenset(a for a in jax.sharding.get_abstract_mesh().axis_names if a not in manual.axes)
    local = manual_spec(P(*entries), tuple(others))
    return Route(split, dim, whole, local, others, manual.dtype, manual.weights, manual.reduction)
