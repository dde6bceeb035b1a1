"""Scan over layers with a remat policy per layer, for flax linen and nnx.

A scanned stack compiles one layer and keeps its parameters stacked on a leading ``layers`` axis, so
that ZeRO-3 gathers one layer at a time and the backward pass keeps about two layers alive; unrolled
Python loops keep every gathered layer alive (the classic FSDP-in-XLA pitfall).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from ._policy import RematPolicy

LAYERS = "layers"
"""Logical name of the stacked-layer axis (split into pipeline stages by the default rules)."""

STACKED = "stacked"
"""Logical name of a stack of layers that a pipeline does not split (a decoder's dense layers before its mixture of
experts' stack, run whole before the first stage): replicated by the default rules."""


def linen_scan(
    block: type[nn.Module], length: int, policy: str | RematPolicy = "full", *, broadcast: bool = False,
    axis: str = LAYERS, in_axes: Any = None,
) -> Any:  # fmt: skip
    """A linen module class applying ``block`` ``length`` times with ``nn.scan``, remat'ed per layer.

    ``block`` is called as ``block(...)(carry, x) -> (carry, y)``; its parameters get a leading axis of
    size ``length`` named ``axis`` (:data:`LAYERS`, or :data:`STACKED`) in their logical partitioning metadata.
    With ``broadcast=True`` the arguments after the carry are the same for every layer (``block(...)(carry,
    *args)``, e.g. positions and segment ids) instead of scanned over. ``in_axes`` (flax's, one per argument after
    the carry: ``nn.broadcast`` or ``0``) overrides both, e.g. to scan each layer's index beside broadcast arguments.

    Example:
      >>> Stack = zjax.remat.linen_scan(Block, 16, "dots")
      >>> x, _ = Stack(cfg, name="layers")(x, None)
    """
    policy = RematPolicy.from_str(policy)
    if policy.kind == "nested":
        raise ValueError(
            f"linen_scan: remat policy {policy.name!r} groups layers into a scan of scans; apply the stacked "
            "parameters with zjax.remat.nested_scan(layer_fn, params, x, policy) (the zjax Decoder does)."
        )
    cls = nn.remat(block, policy=policy.jax_policy(), prevent_cse=False) if policy.remat else block
    return nn.scan(
        cls,
        variable_axes={True: 0},  # parameters and any state a layer keeps (a router's bias), one per layer
        split_rngs={"params": True, "dropout": True},
        in_axes=(nn.broadcast if broadcast else 0) if in_axes is None else in_axes,
        length=length,
        metadata_params={nn.PARTITION_NAME: axis},
    )


def nested_scan(
    layer_fn: Callable[[Any, Any], Any],
    params: Any,
    x: Any,
    policy: str | RematPolicy = "nested",
    *,
    outputs: bool = False,
) -> Any:
    """Apply ``layer_fn(layer_params, x) -> x`` over parameters stacked on a leading ``layers`` axis with
    nested checkpointing: a scan over groups of ``k`` layers, each group rematerialized as a whole (only its
    input is saved), each layer within it rematerialized too (a scan of scans; Chen et al. 2016).

    With ``L`` layers the forward saves ``L / k`` group inputs and a group's backward ``k`` layer inputs:
    ``k ~ sqrt(L)`` (the policy's default) minimizes the ``L / k + k`` saved layer inputs; the price is one
    more forward pass than ``full`` (a group is recomputed, then each of its layers again). The parameters
    keep their ``[L, ...]`` layout (checkpoints and ZeRO shards do not change).

    With ``outputs=True`` the layer returns ``(x, y)`` (e.g. a mixture of experts' router statistics) and the
    scan returns ``(x, ys)``, each ``y`` stacked on a leading ``[L]`` axis in layer order.

    Example:
      >>> x = zjax.remat.nested_scan(lambda w, h: block.apply({"params": w}, h), params["layers"], x)
    """
    policy = RematPolicy.from_str(policy)
    layers = jax.tree.leaves(params)[0].shape[0]
    k = policy.group_size(layers)
    step = layer_fn if outputs else (lambda w, h: (layer_fn(w, h), None))
    layer = jax.checkpoint(step, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)

    @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)
    def group(h: Any, ws: Any) -> Any:
        return jax.lax.scan(lambda h_, w: layer(w, h_), h, ws)

    groups = jax.tree.map(lambda w: w.reshape(layers // k, k, *w.shape[1:]), params)
    x, ys = jax.lax.scan(group, x, groups)
    if not outputs:
        return x
    return x, jax.tree.map(lambda y: y.reshape(layers, *y.shape[2:]), ys)


def nnx_stack(make_layer: Callable[[nnx.Rngs], nnx.Module], length: int, rngs: nnx.Rngs) -> nnx.Module:
    """Create ``length`` nnx layers stacked on a leading ``layers`` axis (one module, stacked variables).

    Example:
      >>> self.layers = zjax.remat.nnx_stack(lambda r: Block(cfg, rngs=r), cfg.layers, rngs)
    """

    @nnx.split_rngs(splits=length)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
    def create(r: nnx.Rngs) -> nnx.Module:
        return make_layer(r)

    return create(rngs)


def nnx_scan(layers: nnx.Module, x: Any, policy: str | RematPolicy = "full") -> Any:
    """Apply stacked nnx ``layers`` (from :func:`nnx_stack`) to ``x`` in a scan, remat'ed per layer.

    Each layer is called as ``layer(x) -> x``.
    """
    policy = RematPolicy.from_str(policy)

    def apply(layer: nnx.Module, h: Any) -> Any:
        return layer(h)

    body = nnx.remat(apply, policy=policy.jax_policy(), prevent_cse=False) if policy.remat else apply

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: LAYERS})
    def step(h: Any, layer: nnx.Module) -> Any:
        return body(layer, h)

    return step(x, layers)
