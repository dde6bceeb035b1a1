"""``StateLayout``: the specs of every piece of a training state, built once and carried by the state.

``plan.init``, ``plan.abstract_state`` and a checkpoint restore build it; the state carries it as a static
field (``state.layout``); the step, the eval step, the memory report, checkpoints and the planner read it.
Nothing re-derives it from the shardings of live arrays: a state whose arrays disagree with its layout is
an error that names the leaf (:meth:`StateLayout.check`), and :meth:`zjax.Plan.reshard` places any
same-shaped state into a plan's layout.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..offload._config import HOST, Offload
from ..sharding._annotations import Leaf, path_str
from ..sharding._batch import batch_shardings
from ..stages._layout import Layout, Unsharded
from ..stages._stage import Stage
from ._loss_scale import LossScaleState
from ._rows import layout_html
from ._state import MixedPrecisionState, TrainState


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """Where every leaf of a :class:`zjax.TrainState` lives on the mesh.

    Attributes:
      params: the parameters' :class:`zjax.stages.Layout` (compute, param, grad and master specs).
      master: whether the optimizer keeps fp32 master weights (mixed precision).
      opt_treedef / opt_specs: the optax state's structure and the spec of each of its leaves.
      model_leaves / model_treedef / model_specs: the non-trainable model state (batch statistics,
        nnx RNG state), its structure and the spec of each leaf (replicated unless a rule says otherwise).
      offload: which pieces live in host memory (:class:`zjax.Offload`); their shardings carry
        ``memory_kind="pinned_host"``.
      opt_owners: for each optimizer-state leaf, the index of the parameter it mirrors, or ``None``.

    It is hashable and compared by value, so two states laid out alike share one compiled step.
    """

    params: Layout
    master: bool
    opt_treedef: Any
    opt_specs: tuple[Any, ...]
    model_treedef: Any
    model_leaves: tuple[Leaf, ...]
    model_specs: tuple[PartitionSpec, ...]
    offload: Offload = Offload()
    opt_owners: tuple[int | None, ...] = ()

    def __hash__(self) -> int:
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        return hash(
            (self.params, self.master, self.opt_treedef, self.opt_specs, self.model_treedef, self.model_specs,
             self.offload, self.opt_owners)
        )  # fmt: skip

    # -- what the plan recorded -----------------------------------------------------------------

    @property
    def mesh(self) -> Mesh:
        return self.params.mesh

    @property
    def stage(self) -> Stage:
        return self.params.stage

    @property
    def param_specs(self) -> Any:
        return self.params.param_specs

    @property
    def grad_specs(self) -> Any:
        return self.params.grad_specs

    @property
    def master_specs(self) -> Any:
        return self.params.master_specs

    @property
    def opt_state_specs(self) -> Any:
        return jax.tree_util.tree_unflatten(self.opt_treedef, self.opt_specs)

    @property
    def model_state_specs(self) -> Any:
        return jax.tree_util.tree_unflatten(self.model_treedef, self.model_specs)

    @property
    def unsharded(self) -> list[Unsharded]:
        return self.params.unsharded

    def _repr_html_(self) -> str:
        return layout_html(self)

    # -- spec trees -------------------------------------------------------------------------------

    def state_specs(self, tx: Any) -> TrainState:
        """A ``TrainState``-shaped tree of ``PartitionSpec`` (with ``tx`` and this layout as static fields)."""
        scalar: Any = PartitionSpec()
        return TrainState(
            step=scalar,
            params=self.param_specs,
            opt_state=MixedPrecisionState(self.master_specs if self.master else None, self.opt_state_specs),
            loss_scale=LossScaleState(scalar, scalar),
            rng=scalar,
            tx=tx,
            model_state=self.model_state_specs,
            layout=self,
        )

    def state_shardings(self, tx: Any) -> TrainState:
        """Like :meth:`state_specs`, with ``NamedSharding`` leaves on the layout's mesh (``pinned_host``
        memory for the pieces the layout offloads)."""
        specs = self.state_specs(tx)

        def place(tree: Any, memory_kind: str | None = None) -> Any:
            return jax.tree.map(lambda s: NamedSharding(self.mesh, s, memory_kind=memory_kind), tree, is_leaf=_is_spec)

        out = place(specs)
        host = HOST if self.offload.optimizer else None
        return out.replace(
            params=place(specs.params, HOST if self.offload.params else None),
            opt_state=MixedPrecisionState(
                None if specs.opt_state.master is None else place(specs.opt_state.master, host),
                place(specs.opt_state.inner, host),
            ),
        )

    def batch_shardings(self, batch: Any) -> Any:
        """The batch's shardings: its leading (example) dimension over the data axes."""
        return batch_shardings(batch, self.mesh)

    # -- checks -----------------------------------------------------------------------------------

    def check_structure(self, state: TrainState) -> None:
        """Raise ``ValueError`` if ``state``'s trees are not the ones this layout was built for."""
        parts = (
            ("params", state.params, self.params.treedef),
            ("opt_state.inner", state.opt_state.inner, self.opt_treedef),
            ("model_state", state.model_state, self.model_treedef),
        )
        for name, tree, want in parts:
            have = jax.tree.structure(tree)
            if have != want:
                raise ValueError(
                    f"state.{name} has structure {_short(have)}, but its layout was built for {_short(want)}. "
                    f"A state changed after plan.init (another model or optimizer) needs a new layout: "
                    f"call plan.reshard(state) for the same model, or plan.init / a restore for another one."
                )
        if (state.opt_state.master is None) == self.master:
            raise ValueError(
                f"state.opt_state.master is {'missing' if self.master else 'present'}, but the layout says "
                f"master weights are {'kept' if self.master else 'not kept'}: build the state with the plan "
                f"whose precision you train with (plan.init or plan.reshard)."
            )

    def check(self, state: TrainState) -> None:
        """Raise ``ValueError`` naming the first leaf whose array is not placed as this layout says.

        Called when jit rejects a state's shardings: the message names the leaf path, the expected and
        actual spec and the fix (:meth:`zjax.Plan.reshard`).
        """
        self.check_structure(state)
        specs = self.state_specs(state.tx)
        flat = jax.tree_util.tree_flatten_with_path(state)[0]
        for (path, x), spec in zip(flat, jax.tree.leaves(specs, is_leaf=_is_spec), strict=True):
            sharding = getattr(x, "sharding", None)
            if sharding is None or not getattr(x, "committed", True):
                continue  # host values and uncommitted arrays are placed by jit
            want = NamedSharding(self.mesh, spec)
            if not sharding.is_equivalent_to(want, x.ndim):
                have = sharding.spec if isinstance(sharding, NamedSharding) else sharding
                where = "" if sharding.device_set == want.device_set else " on other devices"
                raise ValueError(
                    f"state leaf {path_str(path)!r} (shape {tuple(x.shape)}) is placed as {have}{where}, but the "
                    f"state's layout (ZeRO stage {self.stage.level}, mesh {dict(self.mesh.shape)}) puts it at "
                    f"{spec}. Arrays placed by hand (jax.device_put, loaded weights, state.replace) must follow "
                    f"the layout: call state = plan.reshard(state)."
                )


def _short(treedef: Any) -> str:
    text = str(treedef)
    return text if len(text) <= 160 else text[:157] + "..."
