"""What a stage's backward pass keeps between the table engine's actions: the residuals of its ``jax.vjp``.

``jax.vjp`` returns its pullback as a pytree whose leaves are the residuals (the activations the remat policy
saves, the layer inputs it recomputes from) and whose structure holds the backward program. A :class:`Stash`
learns that structure once, abstractly, and then splits each pullback into the leaves the engine keeps in its
slot buffers and joins them back on a later tick. The stage's weights are not kept: a residual that is a weight
leaf itself is read from the weights again when the pullback is joined (only the activations take slots).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax._src.interpreters.partial_eval import dce_jaxpr  # no public jaxpr DCE in jax 0.10.2
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

from ._context import call_stage


def keep_of(stage_fn: Callable, recompute: str) -> tuple[str, Callable]:
    """Which action makes the table engine's residuals for ``stage_fn``, and the stage function whose pullback they
    are: as :func:`zjax.pipeline.scan_layers` set them by its remat policy and ``recompute``
    (:class:`zjax.Pipeline`'s), else the forward, of ``stage_fn`` itself."""
    keep = getattr(stage_fn, "zjax_keep", ("F", stage_fn))
    return keep[recompute] if isinstance(keep, dict) else keep


def pullback(stage_fn: Callable, w: Any, x: jax.Array, side: Any) -> tuple[jax.Array, Callable]:
    """``(stage_fn(w, x, side), its pullback to (w, x))``."""
    return jax.vjp(lambda w_, x_: call_stage(stage_fn, w_, x_, side), w, x)


def pulled(pull: Callable, dy: Any, part: int) -> Any:
    """``pull(dy)[part]`` (0: the weights' gradient, 1: the input's), with the other part's program cut from the
    backward pass before it is emitted: XLA keeps it once it is an output of a loop (the layer scan's transpose makes
    both in one loop), which would make B compute the weights' products too. ``dy``: the stage output's cotangent
    (a pytree where the stage returns more than ``h``)."""
    leaves, treedef = jax.tree.flatten(pull)
    closed, shapes = jax.make_jaxpr(lambda leaves, dy: jax.tree.unflatten(treedef, leaves)(dy), return_shape=True)(
        leaves, dy
    )
    used = [i == part for i, tree in enumerate(shapes) for _ in jax.tree.leaves(tree)]
    jaxpr, used_in = dce_jaxpr(closed.jaxpr, used)
    args = [a for a, u in zip([*leaves, *jax.tree.leaves(dy)], used_in, strict=True) if u]
    return jax.tree.unflatten(jax.tree.structure(shapes[part]), jaxpr_as_fun(ClosedJaxpr(jaxpr, closed.consts))(*args))


def _weight_at(leaves: list[Any], w: Any) -> list[int | None]:
    """Per residual leaf, the index of the weight leaf it is (``None``: an activation to keep)."""
    weights = jax.tree.leaves(w)
    return [next((i for i, a in enumerate(weights) if a is leaf), None) for leaf in leaves]


@dataclasses.dataclass(frozen=True)
class Stash:
    """The residuals of ``stage_fn``'s pullback on one microbatch: ``kept`` (their shapes and dtypes) go to the
    engine's buffers; the rest are weight leaves."""

    treedef: Any
    weight_at: tuple[int | None, ...]
    kept: tuple[jax.ShapeDtypeStruct, ...]

    @classmethod
    def of(cls, stage_fn: Callable, w: Any, x: Any, side: Any) -> Stash:
        """Traced abstractly on the shapes of one chunk's weights ``w``, one input ``x`` and its side inputs."""
        found: dict[str, Any] = {}

        def probe(w: Any, x: jax.Array, side: Any) -> list[jax.Array]:
            _, pull = pullback(stage_fn, w, x, side)
            leaves, found["treedef"] = jax.tree.flatten(pull)
            found["at"] = _weight_at(leaves, w)
            return [a for a, i in zip(leaves, found["at"], strict=True) if i is None]

        kept = jax.eval_shape(probe, w, x, side)
        return cls(found["treedef"], tuple(found["at"]), tuple(kept))

    def split(self, pull: Callable, w: Any) -> list[jax.Array]:
        """The leaves of ``pull`` to keep."""
        leaves = jax.tree.leaves(pull)
        if tuple(_weight_at(leaves, w)) != self.weight_at or len(leaves) != len(self.weight_at):
            raise RuntimeError(
                "zjax.pipeline: a stage's pullback kept other residuals than when it was first traced; the stage "
                "function must trace the same way on every call."
            )
        return [a for a, i in zip(leaves, self.weight_at, strict=True) if i is None]

    def join(self, kept: list[jax.Array], w: Any) -> Callable:
        """The pullback whose kept leaves are ``kept`` and whose weights are ``w``."""
        weights, it = jax.tree.leaves(w), iter(kept)
        return jax.tree.unflatten(self.treedef, [next(it) if i is None else weights[i] for i in self.weight_at])
