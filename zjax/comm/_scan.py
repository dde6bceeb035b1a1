"""A scan over a model's stacked layers whose quantized gradient reductions (qgZ) overlap the next layer's backward.

At stage 3 each layer's gradient is reduced in that layer's backward iteration. For bf16 (or fp32) reduce-scatters
XLA's collective pipeliner moves the reduction into the next iteration, where it runs under that layer's compute.
XLA does not pipeline all-to-alls, so qgZ's exchanges (:func:`zjax.comm.reduce`) would wait at the end of each
iteration, after every weight-gradient dot. :func:`layer_scan` pipelines them itself: its backward pass carries a
layer's partial gradient into the next iteration and reduces it there, beside the next layer's recomputation and
backward, which do not depend on it; the first layer's gradient is reduced after the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ._gather import _ACTIVE, Route, _path, gathered_tree, manual_route, passthrough, reduce_routes


def quantized_reductions() -> bool:
    """Whether the step being traced reduces its gradients itself as integer blocks (``Plan(quantized_comm=
    "grads")`` or ``"weights+grads"`` at stage 3): a model's layer scan should then be :func:`layer_scan`."""
    active = _ACTIVE.get()
    return active is not None and active.manual is not None and active.manual.reduction.wire is not None


def layer_scan(layer: Callable[..., Any], params: Any, x: Any, path: Sequence[str], *, numbered: bool = False) -> Any:
    """``layer(layer_params, h) -> h`` applied over ``params``, parameters stacked on a leading layers axis at
    ``path`` in the params tree (a decoder's ``("layers",)``), rematerialized per layer (only each layer's input
    is saved). ``layer`` receives its parameters gathered whole, in the compute dtype: it must not gather them
    again (:func:`zjax.comm.gathered` returns them as they are while it runs). With ``numbered`` it is called
    ``layer(layer_params, h, i)``, ``i`` the layer's index in the stack (an int32 scalar; e.g. what its dropout
    masks are drawn from).

    When the step reduces gradients as integer blocks (:func:`quantized_reductions`), each layer's reduction runs
    during the next layer's backward (module docstring); otherwise this is a rematerialized scan that reads each
    layer through :func:`zjax.comm.gathered_tree`.

    Example:
      >>> x = zjax.comm.layer_scan(lambda w, h: block.apply({"params": w}, h), params["layers"], x, ("layers",))
    """
    prefix = tuple(path)

    def apply(whole: Any, h: Any, i: jax.Array) -> Any:
        with passthrough():
            return layer(whole, h, i) if numbered else layer(whole, h)

    active = _ACTIVE.get()
    if active is None or not quantized_reductions():
        count = jnp.arange(jax.tree.leaves(params)[0].shape[0], dtype=jnp.int32)
        body = jax.checkpoint(lambda h, wi: (apply(gathered_tree(wi[0], prefix), h, wi[1]), None), prevent_cse=False)
        return jax.lax.scan(body, x, (params, count))[0]
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = [v for _, v in flat]
    routes = [manual_route(v.ndim - 1, active, (*prefix, *_path(kp))) for kp, v in flat]
    return _overlapped(apply, treedef, routes, leaves, x)


def _overlapped(apply: Callable, treedef: Any, routes: list[Route], leaves: list, x: Any) -> Any:
    n = leaves[0].shape[0]

    def whole(ws: list) -> list:
        return [r.gather(w) for r, w in zip(routes, ws, strict=True)]

    def forward(ws: list, h: Any, i: jax.Array) -> Any:
        return apply(jax.tree_util.tree_unflatten(treedef, whole(ws)), h, i)

    def backward(ws: list, h: Any, dh: Any, i: jax.Array) -> tuple[list, Any]:
        """Layer ``i`` recomputed from its input ``h`` and differentiated: the partial gradients of its gathered
        weights (this rank's, not yet reduced) and the cotangent of ``h``."""
        _, pull = jax.vjp(lambda wl, hh: apply(jax.tree_util.tree_unflatten(treedef, wl), hh, i), whole(ws), h)
        return pull(dh)

    def reduced(partial: list, ws: list) -> list:
        """A layer's partial gradients reduced into its shards (the quantized ones in one exchange), in their dtype."""
        shards = reduce_routes(routes, partial)
        return [g.astype(w.dtype) for g, w in zip(shards, ws, strict=True)]

    count = jnp.arange(n, dtype=jnp.int32)

    @jax.custom_vjp
    def run(leaves: list, x: Any) -> Any:
        return jax.lax.scan(lambda h, wi: (forward(wi[0], h, wi[1]), None), x, (leaves, count))[0]

    def fwd(leaves: list, x: Any) -> tuple[Any, tuple[list, Any]]:
        y, inputs = jax.lax.scan(lambda h, wi: (forward(wi[0], h, wi[1]), h), x, (leaves, count))
        return y, (leaves, inputs)

    def bwd(res: tuple[list, Any], dy: Any) -> tuple[list, Any]:
        leaves, inputs = res
        at = lambda tree, i: jax.tree.map(lambda a: a[i], tree)  # noqa: E731
        index = lambda tree, i: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, False), tree)  # noqa: E731
        # the last layer outside the loop, so that every iteration has a gradient to reduce (no empty exchange)
        pending, dh = backward(at(leaves, n - 1), at(inputs, n - 1), dy, jnp.int32(n - 1))

        def body(carry: tuple[Any, list], i: jax.Array) -> tuple[tuple[Any, list], list]:
            dh, pending = carry
            ws, h = index(leaves, i), index(inputs, i)
            done = reduced(pending, ws)  # layer i + 1's, beside layer i's backward: nothing there needs it
            partial, dh = backward(ws, h, dh, i)
            return (dh, partial), done

        # the layers indexed where they lie (xs slices [: n - 1] of the saved inputs would be copied first)
        (dh, pending), done = jax.lax.scan(body, (dh, pending), jnp.arange(n - 1), reverse=True)
        first = reduced(pending, at(leaves, 0))
        grads = [jnp.concatenate([f[None], d]) for f, d in zip(first, done, strict=True)]
        return grads, dh

    run.defvjp(fwd, bwd)
    return run(leaves, x)
