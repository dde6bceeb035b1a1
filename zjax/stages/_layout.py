"""Turn compute specs + a stage into the spec trees of parameters, gradients and optimizer state."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import jax
import optax
from jax.sharding import Mesh, PartitionSpec

from ..sharding._annotations import Leaf
from ..sharding._axes import REPLICA
from ..sharding._mesh import zero_target
from ..sharding._rules import spec_axes
from ._placement import add_axis
from ._stage import Stage


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one parameter lives: its compute (model-parallel) spec and its spec with ZeRO's axes (``dp``, and
    ``cp`` when the mesh has one) added."""

    leaf: Leaf
    compute: PartitionSpec
    sharded: PartitionSpec  # compute + dp; equals compute when the leaf cannot take dp
    reason: str | None  # why dp could not be added, or None


@dataclasses.dataclass(frozen=True)
class Unsharded:
    """A leaf that a stage wanted to shard over dp but could not; it stays replicated over dp."""

    path: str
    shape: tuple[int, ...]
    reason: str


@dataclasses.dataclass(frozen=True)
class Layout:
    """The specs of every piece of training state for one (stage, mesh, parameter tree)."""

    stage: Stage
    mesh: Mesh
    treedef: Any  # of the (unboxed) parameter tree
    placements: tuple[Placement, ...]
    hierarchical: bool = False  # ZeRO++'s hpZ: ZeRO's axes include replica (innermost)

    @classmethod
    def build(
        cls,
        stage: Stage,
        mesh: Mesh,
        treedef: Any,
        leaves: list[Leaf],
        compute: list[PartitionSpec],
        hierarchical: bool = False,
    ):
        sizes = dict(mesh.shape)
        placements = []
        for leaf, spec in zip(leaves, compute, strict=True):
            # ZeRO's axes less those the compute spec already uses (an expert's weights are split over ep)
            zero = zero_target(mesh, taken=spec_axes(spec), hierarchical=hierarchical)
            # a table split along its hidden dim is looked up where it lies (zjax.comm.lookup), without a pipeline
            names = leaf.names if sizes.get("pp", 1) == 1 else None
            sharded, reason = add_axis(spec, leaf.shape, zero, sizes, names)
            placements.append(Placement(leaf, spec, sharded, reason))
        return cls(stage, mesh, treedef, tuple(placements), hierarchical)

    def _tree(self, pick) -> Any:
        return jax.tree_util.tree_unflatten(self.treedef, [pick(p) for p in self.placements])

    @property
    def compute_specs(self) -> Any:
        return self._tree(lambda p: p.compute)

    @property
    def param_specs(self) -> Any:
        """Compute parameters: dp-sharded only at stage 3."""
        return self._tree(lambda p: p.sharded if self.stage.shard_parameters else p.compute)

    @property
    def node_specs(self) -> Any:
        """ZeRO++'s hpZ (``hierarchical``): the parameter specs without ``replica``, each node's shard of a
        parameter split over ``replica x dp`` (the parameter specs themselves otherwise)."""
        return self._tree(lambda p: _without(p.sharded if self.stage.shard_parameters else p.compute, REPLICA))

    @property
    def grad_specs(self) -> Any:
        """Gradients (and their accumulation buffer): dp-sharded from stage 2."""
        return self._tree(lambda p: p.sharded if self.stage.shard_gradients else p.compute)

    @property
    def master_specs(self) -> Any:
        """fp32 master weights and per-parameter optimizer state: dp-sharded from stage 1."""
        return self._tree(lambda p: p.sharded if self.stage.shard_optimizer else p.compute)

    @property
    def unsharded(self) -> list[Unsharded]:
        """Leaves this stage leaves replicated over dp although it shards some state (empty at stage 0)."""
        if not self.stage.shard_optimizer:
            return []
        return [Unsharded(p.leaf.path, p.leaf.shape, p.reason) for p in self.placements if p.reason]

    def optimizer_specs(self, tx: optax.GradientTransformation, state: Any) -> Any:
        """Specs for an optax state (abstract or concrete) of ``tx`` over parameters of this layout.

        Each parameter-shaped subtree of the state (found with ``optax.tree_map_params``, so any optax
        transformation works) inherits the master specs leaf by leaf. A state leaf whose shape differs
        from its parameter's (e.g. Adafactor's factored rows) and every other state leaf get their own
        placement: dp on their largest divisible dimension when the stage shards the optimizer.
        """
        sizes, zero = dict(self.mesh.shape), zero_target(self.mesh, hierarchical=self.hierarchical)
        shard = self.stage.shard_optimizer

        def own(x: Any) -> PartitionSpec:
            shape = tuple(getattr(x, "shape", ()))
            return add_axis(PartitionSpec(), shape, zero, sizes)[0] if shard else PartitionSpec()

        return self._map_optimizer_state(tx, state, lambda x, master: master.spec, own)

    def optimizer_owners(self, tx: optax.GradientTransformation, state: Any) -> tuple[int | None, ...]:
        """For each leaf of the optax state (flattened), the index of the parameter it mirrors element for
        element (Adam's moments), or ``None`` (step counts, factored statistics)."""
        owners = self._map_optimizer_state(tx, state, lambda x, master: _Owner(master.index), lambda x: _Owner(None))
        return tuple(o.index for o in jax.tree.leaves(owners, is_leaf=lambda x: isinstance(x, _Owner)))

    def _map_optimizer_state(self, tx: Any, state: Any, inherit_fn, own) -> Any:
        """``inherit_fn(leaf, master)`` on the state leaves that are shaped like their parameter (``master``
        a :class:`_SpecLeaf`), ``own(leaf)`` on every other leaf."""
        shard = self.stage.shard_optimizer

        def inherit(x: Any, master: Any) -> Any:
            if isinstance(x, optax.MaskedNode) or x is None:
                return x
            if tuple(getattr(x, "shape", ())) == tuple(master.shape):
                return inherit_fn(x, master)
            return own(x)

        masters = self._tree_indexed(lambda p: p.sharded if shard else p.compute)
        is_leaf = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
        try:
            return optax.tree_map_params(
                tx,
                inherit,
                state,
                masters,
                transform_non_params=lambda v: jax.tree.map(own, v),
                is_leaf=is_leaf,
            )
        except Exception:  # noqa: BLE001 - transforms whose init rejects optax's placeholder
            return _map_by_structure(state, masters, inherit, own)

    def _tree_indexed(self, pick) -> Any:
        leaves = [_SpecLeaf(p.leaf.shape, pick(p), i) for i, p in enumerate(self.placements)]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def _without(spec: PartitionSpec, axis: str) -> PartitionSpec:
    entries = []
    for entry in spec:
        kept = tuple(a for a in spec_axes(PartitionSpec(entry)) if a != axis)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*entries)


@dataclasses.dataclass(frozen=True)
class _Owner:
    """A pytree leaf naming the parameter an optimizer-state leaf mirrors (``None``: none)."""

    index: int | None


@dataclasses.dataclass(frozen=True)
class _SpecLeaf:
    """A spec with the shape it was made for; a pytree leaf (not a node)."""

    shape: tuple[int, ...]
    spec: PartitionSpec
    index: int = -1  # the parameter's position in the flattened tree


def _map_by_structure(state: Any, masters: Any, inherit, own) -> Any:
    """Fallback: any subtree whose structure equals the parameter tree's is parameter-shaped."""
    params_def: Any = jax.tree.structure(masters)

    def visit(node: Any) -> Any:
        if jax.tree.structure(node) == params_def:
            return jax.tree.map(inherit, node, masters)
        children, rebuild = _children(node)
        if children is None:
            return own(node)
        return rebuild([visit(c) for c in children])

    return visit(state)


def _children(node: Any):
    leaves, treedef = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)
    treedef = cast(Any, treedef)
    if treedef.num_nodes == 1 and treedef.num_leaves == 1 and leaves and leaves[0] is node:
        return None, None
    return leaves, lambda new: jax.tree_util.tree_unflatten(treedef, new)
