"""The decoder's layers applied from their parameters alone: a pipeline's stages (and the dense layers and
multi-token prediction modules a table schedule runs at its ends), each layer's index and model state beside its
weights (:func:`numbered`: what its dropout masks are drawn from, its router's biases, its fp8 histories), and
what those paths cannot run yet."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from .. import comm, fp8, pipeline
from ..context import load_balance
from ..remat import RematPolicy
from ._biases import ROUTER_STATE
from ._block import FP8_PROJECTIONS, Block
from ._config import DecoderConfig
from ._moe import check_experts_in_pipeline, expert_splits
from ._mtp import MTP

EACH_LAYER = (nn.broadcast,) * 4 + (0,)
"""A stack's ``in_axes`` (:func:`zjax.remat.linen_scan`): positions, segment ids, router mask and dropout keys the
same for every layer, each layer's index its own."""


LAYER_INDEX = "zjax_layer_index"
"""The key under which :func:`numbered` layers carry their indices."""

LAYER_STATE = "zjax_layer_state"
"""The key under which :func:`numbered` layers carry their model state (the routers' selection biases, the fp8
projections' amax histories)."""


def numbered(layers: Any, start: int, state: Any = None) -> dict:
    """The stacked ``layers`` with each one's index in the model (``start``: the first's) beside its weights,
    under :data:`LAYER_INDEX`: ``[L]`` float32, and its model state (``state``: collections of ``[L, ...]``
    arrays, read only; ``None``: none) under :data:`LAYER_STATE`. Both travel with their layer through the
    functions that apply and split stacked layers themselves (pipeline stages, nested remat) while the weights
    keep their paths; floats, which such functions give a zero gradient like any weight (an integer's would be
    ``float0``). The amax histories' cotangents are the amaxes their products saw (:func:`zjax.fp8.matmul_delayed`),
    as where the layers run in flax's scan; the rest of the state is read outside the gradient."""
    count = jax.tree.leaves(layers)[0].shape[0]
    extra = {} if not state else {LAYER_STATE: state}
    return {**layers, LAYER_INDEX: jnp.arange(start, start + count, dtype=jnp.float32), **extra}


def unnumbered(layer: dict) -> tuple[dict, jax.Array]:
    """One :func:`numbered` layer's variables (``{"params": weights, **state}``) and index."""
    layer = dict(layer)
    index, state = layer.pop(LAYER_INDEX), dict(layer.pop(LAYER_STATE, {}))
    read = {k: v if k == fp8.COLLECTION else jax.tree.map(jax.lax.stop_gradient, v) for k, v in state.items()}
    return {"params": layer, **read}, index


def kept_whole(split_over: Any, layers: dict) -> Any:
    """A pipeline's ``split_over`` (:func:`zjax.pipeline.apply`) for :func:`numbered` ``layers`` from the weights'
    (``None``: none split): their state kept whole on every rank (``{}``), read as it is."""
    if LAYER_STATE not in layers:
        return split_over and {**split_over, LAYER_INDEX: None}
    weights = {k: v for k, v in layers.items() if k not in (LAYER_INDEX, LAYER_STATE)}
    split_over = split_over or jax.tree.map(lambda _: None, weights)
    return {**split_over, LAYER_INDEX: None, LAYER_STATE: jax.tree.map(lambda _: {}, layers[LAYER_STATE])}


def maxed_leaves(layers: Any) -> Any:
    """For :func:`numbered` ``layers``, the pytree of bools :func:`zjax.pipeline.loss` takes as ``maxed``: ``True`` at
    the fp8 amax histories, whose gradient is the largest amax any microbatch and rank saw; ``None`` without them."""
    histories = layers.get(LAYER_STATE, {}).get(fp8.COLLECTION) if isinstance(layers, dict) else None
    if histories is None:
        return None
    maxed = jax.tree.map(lambda _: False, layers)
    maxed[LAYER_STATE][fp8.COLLECTION] = jax.tree.map(lambda _: True, histories)
    return maxed


def pipelined_layers(c: DecoderConfig, layers: Any, state: Any, dropping: bool) -> tuple[Any, Any, bool]:
    """A decoder's stacked layers as a pipeline takes them: ``(layers, split_over, numbered)``: the experts split
    over ``ep``; :func:`numbered` (with their ``state``, kept whole) when the layers drop (``dropping``) or keep
    state, so that each stage's layers draw their masks and read their state."""
    split_over = None if c.moe is None else expert_splits(layers)
    carried = dropping or state is not None
    if carried:
        layers = numbered(layers, c.dense_layers, state)
        split_over = kept_whole(split_over, layers)
    return layers, split_over, carried


def layer_state(variables: Any, stack: str = "layers") -> Any:
    """The model state a stacked layer reads (each collection's ``stack`` entry; ``None``: none)."""
    state = {k: v[stack] for k, v in variables.items() if k in (ROUTER_STATE, fp8.COLLECTION) and stack in v}
    return state or None


def apply_numbered(
    block: Block, layer: dict, h: jax.Array, positions: Any, segment_ids: Any, router_mask: Any, keys: Any
) -> tuple[jax.Array, Any]:
    """One :func:`numbered` layer applied by ``block`` (its dropout masks drawn by its index): ``(h, stats)``."""
    variables, index = unnumbered(layer)
    return block.apply(variables, h, positions, segment_ids, router_mask, keys, index)


def check_unsupported(c: DecoderConfig, schedule: Any, maximised: bool = False) -> None:
    """Raise for what the decoder cannot run yet where it is traced: under pipeline parallelism (``schedule``; both
    engines' stages, :func:`pipeline_stage_fn`, check) or quantized gradient reductions. ``maximised``: the stages
    run where the amax histories' cotangents are maximised (:func:`zjax.models.lm_loss`'s table engine)."""
    policy = RematPolicy.from_str(c.remat)
    qgz = c.scan and overlaps_reductions(c, policy)
    if c.bf16_edge_layers and (schedule is not None or qgz):
        raise ValueError(
            f"Decoder: bf16_edge_layers={c.bf16_edge_layers} under "
            f"{'pipeline parallelism' if schedule is not None else 'quantized gradient reductions (qgZ)'} is not "
            "supported yet (their layers run one stack alike). Use bf16_edge_layers=0 there."
        )
    if c.matmul == "fp8-delayed" and schedule is not None and not maximised:
        raise ValueError(
            "Decoder: matmul='fp8-delayed' under pipeline parallelism runs in zjax.models.lm_loss (train_functions' "
            "loss), whose table engine keeps the largest amax each product saw over the microbatches and ranks: "
            "the model's own call under a pipeline would sum them. Compute the loss with lm_loss, or use "
            "matmul='fp8-current' (no state)."
        )
    if c.matmul == "fp8-delayed" and qgz:
        raise ValueError(
            "Decoder: matmul='fp8-delayed' under quantized gradient reductions (qgZ) is not supported yet: its layer "
            "scan applies the layers' weights alone. Use matmul='fp8-current' (no state), or no qgZ."
        )


def overlaps_reductions(c: DecoderConfig, policy: RematPolicy) -> bool:
    """Whether the layers run in :func:`zjax.comm.layer_scan`: quantized gradient reductions, whole-layer remat (the
    scan saves each layer's input, nothing else) and no experts (their router statistics are scan outputs)."""
    return comm.quantized_reductions() and policy.kind == "full" and not policy.partition and c.moe is None


def pipeline_stage_fn(
    c: DecoderConfig, *, load_balanced: bool = False, at: tuple[str, ...] = ("layers",), numbered: bool = False
) -> Callable[..., Any]:
    """The ``stage_fn`` of :func:`zjax.pipeline.apply` / :func:`zjax.pipeline.loss` for a decoder: each stage
    scans its layers, rematerialized per layer by the model's policy, each layer read through
    :func:`zjax.comm.gathered_tree` at ``at`` (the stacked layers' path: qwZ's per-layer gathers under
    ``zero3_gather="layer"``). A mixture of experts' stage returns ``(h, router sums per layer)``
    (``apply(..., outputs=True)``). The pipeline's side inputs (a dict of ``positions``, ``segment_ids`` and
    ``router_mask``, each optional) reach every layer with its microbatch: packed rows keep their documents;
    with ``dropout_keys`` among them the stage's layers are :func:`numbered` (their indices beside their weights),
    and each layer drops what the one-device model's drops.

    Raises:
      ValueError: ``scan=False``, a partitioned remat policy (none run in a pipeline); a mixture of experts
        that a schedule cannot run (:func:`zjax.models._moe.check_experts_in_pipeline`).
    """
    policy = RematPolicy.from_str(c.remat)
    schedule = pipeline.current()
    if not c.scan:
        raise ValueError("Decoder: pipeline parallelism needs scan=True (layers stacked on one axis).")
    check_unsupported(c, schedule, maximised=True)
    if c.moe is not None:
        check_experts_in_pipeline(c.moe, schedule)
    if policy.partition:
        raise ValueError(
            f"Decoder: remat={c.remat!r} under pipeline parallelism: ZeRO-R partitioned checkpoints "
            "split over tp with a shard_map, which cannot run inside the pipeline's per-stage vmap. Use "
            f"remat={policy.name.removesuffix('+partitioned')!r} with a pipeline."
        )
    one = Block(c, load_balanced)
    # a table schedule's per-layer gathers move the fp8 products' weights in e4m3 (current scaling: the product's
    # cast of them is then exact), as GSPMD's gathers do elsewhere
    fp8_reads = FP8_PROJECTIONS if c.matmul == "fp8-current" else ()

    def layer(w: Any, h: jax.Array, side: dict | None = None) -> Any:
        side = side or {}
        variables, index = unnumbered(w) if numbered else ({"params": w}, 0)
        variables = {**variables, "params": comm.gathered_tree(variables["params"], at, float8=fp8_reads)}
        positions = _stage_positions(side, h.shape[1], load_balanced)
        h, stats = one.apply(
            variables, h, positions, side.get("segment_ids"), side.get("router_mask"), side.get("dropout_keys"), index
        )
        return h if c.moe is None else (h, stats)

    return pipeline.scan_layers(layer, policy, outputs=c.moe is not None)


def dense_config(c: DecoderConfig) -> DecoderConfig:
    """The configuration of the first ``dense_layers`` layers: dense MLPs, a stack of their own."""
    return dataclasses.replace(c, moe=None, layers=c.dense_layers, dense_layers=0)


def _stage_positions(side: dict, length: int, load_balanced: bool) -> jax.Array | None:
    """A pipeline stage's token positions: the microbatch's own (packed rows), or under the load-balanced layout
    (cp) each token's index before the permutation; ``None`` for the plain order."""
    positions = side.get("positions")
    if positions is None and load_balanced:
        positions = load_balance(jnp.arange(length, dtype=jnp.int32)[None])
    return positions


def dense_stage_fn(c: DecoderConfig, load_balanced: bool = False) -> Callable[..., jax.Array] | None:
    """A table schedule's dense layers (``dense_layers``, DeepSeek's first layers; ``None`` without them):
    ``fn(stacked, h, side)`` runs them on stage 0 after the embedding, on each microbatch as its first action
    runs (their parameters travel with the embedding's, whole on every rank for the step)."""
    if not c.dense_layers:
        return None
    one = Block(dense_config(c), load_balanced)

    def layer(w: Any, h: jax.Array, side: dict) -> jax.Array:
        variables, index = unnumbered(w)
        positions = _stage_positions(side, h.shape[1], load_balanced)
        return one.apply(variables, h, positions, side.get("segment_ids"), None, side.get("dropout_keys"), index)[0]

    stage = pipeline.scan_layers(layer, "full" if RematPolicy.from_str(c.remat).remat else "none")
    return lambda stacked, h, side: stage(numbered(stacked, 0), h, side)


def predict_ahead_fn(c: DecoderConfig, load_balanced: bool = False) -> Callable[..., list[Any]] | None:
    """A table schedule's multi-token prediction modules (``mtp_layers``; ``None`` without them), run in the loss's
    stage: ``fn(edge, hidden, tokens [mb, depth, S], side)`` -> each module's normed output (:mod:`._mtp`), from
    the last layer's output and the embedding table, the modules' parameters ``edge["mtp_k"]``."""
    if not c.mtp_layers:
        return None
    module = MTP(c, load_balanced)

    def fn(edge: dict, hidden: jax.Array, tokens: jax.Array, side: dict) -> list[Any]:
        positions = _stage_positions(side, hidden.shape[1], load_balanced)
        outs = []
        for k in range(c.mtp_layers):
            embedded = jnp.take(edge["embedding"], tokens[:, k], axis=0)
            variables = {"params": edge[f"mtp_{k}"]}
            hidden, normed = module.apply(
                variables, hidden, embedded, positions, side.get("segment_ids"), side.get("dropout_keys"), c.layers + k
            )
            outs.append(normed)
        return outs

    return fn
