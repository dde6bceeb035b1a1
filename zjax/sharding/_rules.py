"""Rules that turn parameters into their tensor-parallel ("compute") ``PartitionSpec``.

A parameter's compute spec says how it is split over the model-parallel axes (``tp``, later ``pp``).
ZeRO's data-parallel sharding is added on top by the stage (:mod:`zjax.stages`), never here.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import Mesh, PartitionSpec

from ._annotations import Leaf
from ._axes import CP, DATA_AXES, DP, EP, PP, TP
from ._mesh import axis_size, data_axes

AxisTarget = str | tuple[str, ...] | None

DEFAULT_LOGICAL_RULES: tuple[tuple[str, AxisTarget], ...] = (
    # Megatron-style tensor parallelism: split the wide dims, keep the residual stream whole.
    ("vocab", TP),
    ("mlp", TP),
    ("heads", TP),
    ("kv_heads", TP),
    ("expert", EP),  # a mixture-of-experts layer's experts: split over ep (nothing when ep=1)
    ("embed", None),
    ("head_dim", None),
    ("norm", None),
    ("latent", None),  # multi-head latent attention's compressed width (zjax.models.MLA)
    ("layers", PP),  # stacked layers: split into pipeline stages (nothing when pp=1)
    ("stacked", None),  # a stack no pipeline splits (zjax.remat.STACKED: a decoder's dense layers)
)

RESIDUAL_SEQ = "residual_seq"
"""Logical name of the sequence dimension between tensor-parallel regions (the residual stream and norms)."""

DEFAULT_ACTIVATION_RULES: tuple[tuple[str, AxisTarget], ...] = (
    ("batch", DP),
    ("seq", CP),  # context parallelism: the sequence split over cp (nothing when cp=1)
    # between tensor-parallel regions (residual stream, norms): split over tp too (sequence parallelism)
    (RESIDUAL_SEQ, (CP, TP)),
    ("embed", None),
    ("head_dim", None),
    ("vocab", TP),
    ("mlp", TP),
    ("heads", TP),
    ("kv_heads", TP),
    ("expert", EP),
)


def _as_axes(target: AxisTarget) -> tuple[str, ...]:
    if target is None:
        return ()
    if isinstance(target, str):
        return (target,)
    return tuple(target)


def spec_axes(spec: PartitionSpec) -> tuple[str, ...]:
    """Every mesh axis a ``PartitionSpec`` names, in order."""
    return tuple(a for entry in spec for a in _as_axes(entry))


def _normalize_logical(rules: Any, field: str = "logical") -> tuple[tuple[str, AxisTarget], ...]:
    pairs = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
    seen: dict[str, AxisTarget] = {}
    for pair in pairs:
        if not (isinstance(pair, Sequence) and len(pair) == 2 and isinstance(pair[0], str)):
            raise TypeError(f"Rules.{field}: each rule is a (logical_name, mesh_axis) pair, got {pair!r}.")
        name, target = pair
        if target is not None and not isinstance(target, str):
            if not (isinstance(target, Sequence) and all(isinstance(a, str) for a in target)):
                raise TypeError(
                    f"Rules.{field}: logical name {name!r} maps to {target!r}; use a mesh axis name, "
                    "a tuple of them, or None (replicated)."
                )
            target = tuple(target)
        if name in seen:
            raise ValueError(
                f"Rules.{field}: duplicate logical name {name!r} (mapped to {seen[name]!r} and {target!r}); "
                "give each logical name exactly one rule."
            )
        seen[name] = target
    return tuple(seen.items())


def _normalize_regex(rules: Any) -> tuple[tuple[str, PartitionSpec], ...]:
    out = []
    pairs = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
    for pair in pairs:
        if not (isinstance(pair, Sequence) and len(pair) == 2 and isinstance(pair[0], str)):
            raise TypeError(f"Rules.regex: each rule is a (path_regex, PartitionSpec) pair, got {pair!r}.")
        pattern, spec = pair
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"Rules.regex: {pattern!r} is not a valid regular expression: {e}.") from None
        out.append((pattern, spec if isinstance(spec, PartitionSpec) else PartitionSpec(*spec)))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Rules:
    """How parameters are split over the model-parallel mesh axes.

    Two sources, in this order of precedence:

    1. **Logical names** attached by the model (flax linen ``nn.with_logical_partitioning``, nnx
       ``nnx.with_partitioning``), resolved through ``logical``: a map from logical name to a mesh
       axis, a tuple of mesh axes, or ``None`` (replicated). A logical name with no rule is an error.
    2. **Path regexes** for leaves without annotations: the first pattern that ``re.search``-es the
       '/'-joined parameter path (``params/layers/mlp/kernel``) gives the leaf's ``PartitionSpec``
       of mesh axes. Unmatched, unannotated leaves are replicated.

    Data parallelism (``dp``, ``replica``) is not a target for parameters: the ZeRO stage adds it. ``ep`` is
    (logical ``expert``): it splits a mixture-of-experts layer's experts.

    ``activations`` are the rules for ``nn.with_logical_constraint`` inside the model, active while
    zjax traces the loss (e.g. ``batch`` -> ``dp``); they keep activations split over the batch when
    ZeRO-3 shards the weights, and over the sequence on a mesh with ``cp``.

    ``sequence_parallel`` (default on; it matters when ``tp > 1``): Megatron-style sequence parallelism,
    the residual stream (logical ``residual_seq``) split along the sequence over ``tp`` between the
    tensor-parallel regions, so each region ends in a reduce-scatter instead of an all-reduce and starts
    with an all-gather: the same bytes, and the saved layer inputs and norms take ``1/tp`` of the memory.
    ``Rules(sequence_parallel=False)`` keeps the residual stream whole on every tp rank.

    Example:
      >>> rules = zjax.Rules(logical={"mlp": "tp", "embed": None},
      ...                    regex=[(r"dense_1/kernel$", P("tp", None))])
    """

    logical: Any = DEFAULT_LOGICAL_RULES
    regex: Any = ()
    activations: Any = DEFAULT_ACTIVATION_RULES
    sequence_parallel: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.sequence_parallel, bool):
            raise TypeError(f"Rules.sequence_parallel={self.sequence_parallel!r} must be a bool.")
        object.__setattr__(self, "logical", _normalize_logical(self.logical))
        object.__setattr__(self, "activations", _normalize_logical(self.activations, "activations"))
        object.__setattr__(self, "regex", _normalize_regex(self.regex))

    def compute_spec(self, leaf: Leaf, mesh: Mesh) -> PartitionSpec:
        """The compute (model-parallel) spec of one leaf, validated against ``mesh``."""
        if leaf.names is not None:
            table = dict(self.logical)
            dims: list[tuple[str, ...]] = []
            for dim, name in enumerate(leaf.names):
                if name is None:
                    dims.append(())
                    continue
                if name not in table:
                    raise ValueError(
                        f"Parameter {leaf.path!r} (shape {leaf.shape}) has logical axis name {name!r} at "
                        f"dimension {dim}, which has no rule. Known names: {sorted(table)}. Add "
                        f"({name!r}, None) to Rules.logical to replicate it, or map it to a mesh axis."
                    )
                dims.append(_as_axes(table[name]))
            source = f"logical names {leaf.names}"
        else:
            dims = [() for _ in leaf.shape]  # type: ignore[misc]  # declared above
            source = "no rule (replicated)"
            for pattern, spec in self.regex:
                if re.search(pattern, leaf.path):
                    if len(spec) > len(leaf.shape):
                        raise ValueError(
                            f"Parameter {leaf.path!r} has shape {leaf.shape} ({len(leaf.shape)} dims) but "
                            f"regex rule {pattern!r} gives {spec} ({len(spec)} entries)."
                        )
                    dims = [_as_axes(a) for a in spec] + [() for _ in leaf.shape[len(spec) :]]
                    source = f"regex rule {pattern!r}"
                    break
        return _validated(leaf, dims, mesh, source)

    def compute_specs(self, leaves: Sequence[Leaf], mesh: Mesh) -> list[PartitionSpec]:
        return [self.compute_spec(leaf, mesh) for leaf in leaves]

    def activations_for(self, mesh: Mesh) -> tuple[tuple[str, AxisTarget], ...]:
        """``activations`` for ``mesh``: a rule that targets ``dp`` splits over all data axes
        (``replica`` x ``dp`` under HSDP), the way the batch itself is split, and over ``pp`` too
        when there is a pipeline (outside it, embeddings, head and loss are data parallel over pp)."""
        axes = data_axes(mesh) + ((PP,) if axis_size(mesh, PP) > 1 else ())
        target: AxisTarget = None if not axes else axes[0] if len(axes) == 1 else axes
        out = []
        for name, t in self.activations:
            if _as_axes(t) == (DP,):
                t = target
            elif not self.sequence_parallel and TP in _as_axes(t) and name == RESIDUAL_SEQ:
                kept = tuple(a for a in _as_axes(t) if a != TP)
                t = None if not kept else kept[0] if len(kept) == 1 else kept
            out.append((name, t))
        return tuple(out)


def _validated(leaf: Leaf, dims: list[tuple[str, ...]], mesh: Mesh, source: str) -> PartitionSpec:
    used: dict[str, int] = {}
    for dim, axes in enumerate(dims):
        for axis in axes:
            if axis not in mesh.shape:
                raise ValueError(
                    f"Parameter {leaf.path!r} (shape {leaf.shape}): {source} puts dimension {dim} on mesh "
                    f"axis {axis!r}, which is not in the mesh {dict(mesh.shape)}. Use one of "
                    f"{list(mesh.axis_names)} or None."
                )
            if axis in DATA_AXES and axis != EP:  # ep splits experts; the stage adds the others
                raise ValueError(
                    f"Parameter {leaf.path!r} (shape {leaf.shape}): {source} puts dimension {dim} on "
                    f"{axis!r}. Data-parallel sharding of parameters comes from the ZeRO stage (stage=3); "
                    "map this logical name to a model-parallel axis or None."
                )
            if axis in used:
                raise ValueError(
                    f"Parameter {leaf.path!r} (shape {leaf.shape}): {source} uses mesh axis {axis!r} for "
                    f"dimensions {used[axis]} and {dim}; an axis can split only one dimension. Map one "
                    "of the two logical names to None."
                )
            used[axis] = dim
        size = math.prod(mesh.shape[a] for a in axes)
        if axes and leaf.shape[dim] % size:
            raise ValueError(
                f"Parameter {leaf.path!r} (shape {leaf.shape}): dimension {dim} of size {leaf.shape[dim]} "
                f"is not divisible by mesh axis {'x'.join(axes)!r} of size {size} ({source}). Pick sizes "
                f"that divide, or map this logical name to None."
            )
    # Axes of size 1 split nothing; dropping them keeps specs minimal and lets dp take the best dim.
    dims = [tuple(a for a in axes if mesh.shape[a] > 1) for axes in dims]
    entries = [None if not axes else axes[0] if len(axes) == 1 else axes for axes in dims]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)
