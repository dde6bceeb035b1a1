"""How a sequence is laid out over the ``cp`` axis: contiguous, or load-balanced for causal attention.

With ``cp`` ranks and causal attention, the rank holding the end of a sequence has the most keys to look
at. The **load-balanced** layout cuts the sequence into ``2 x cp`` chunks and gives rank ``r`` chunks ``r``
and ``2cp - 1 - r`` (one from the front, its mirror from the back), so every rank attends to the same
number of (query, key) pairs. The layout is a permutation of the sequence dimension, applied once to the
model's inputs and targets (:func:`load_balance`); attention masks use each slot's original index
(:func:`original_index`), RoPE the positions that travel with the tokens.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ..sharding._axes import CP, TP
from ..sharding._rules import RESIDUAL_SEQ, _as_axes


def context_size() -> int:
    """The ``cp`` size of the mesh the current computation is traced under (1 without one)."""
    return int(jax.sharding.get_abstract_mesh().shape.get(CP, 1))


def _nearest(length: int, multiple: int) -> str:
    low = length // multiple * multiple
    options = [n for n in (low, low + multiple) if n > 0]
    return " or ".join(str(n) for n in options)


def check_length(length: int, cp: int, *, balanced: bool, tp: int = 1, what: str = "sequence length") -> None:
    """Raise ``ValueError`` unless ``length`` splits over ``cp`` (into ``2 x cp`` chunks when ``balanced``)
    and, when ``tp > 1`` (sequence parallelism), over ``cp x tp``."""
    parts = math.lcm(2 * cp if balanced and cp > 1 else cp, cp * tp)
    if parts > 1 and (length % parts or length < parts):
        why = []
        if cp > 1:
            why.append(f"{CP}={cp}" + (" (2 x cp chunks for the load-balanced causal layout)" if balanced else ""))
        if tp > 1:
            why.append(f"{TP}={tp} (sequence parallelism)")
        raise ValueError(
            f"{what} {length} cannot be split over {' and '.join(why)}: it must be a multiple of {parts}. "
            f"Use {_nearest(length, parts)}, or a smaller {CP if cp > 1 else TP}."
        )


def check_sequence(length: int, *, balanced: bool) -> None:
    """:func:`check_length` for the mesh and activation rules the model is traced under: ``cp`` from the mesh,
    and the other axes the residual stream's sequence is split over (``tp`` with sequence parallelism)."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(mesh.shape)
    try:
        spec = nn.logical_to_mesh_axes((RESIDUAL_SEQ,))
    except ValueError:  # the user's activation rules do not name it: nothing more is split
        spec = None
    entry = spec[0] if spec is not None and len(spec) else None
    others = math.prod(sizes.get(a, 1) for a in _as_axes(entry) if a != CP)
    check_length(length, int(sizes.get(CP, 1)), balanced=balanced, tp=others)


def balanced_order(length: int, cp: int) -> np.ndarray:
    """``order[slot]`` = the original index of the token at ``slot`` in the load-balanced layout (rank ``r``
    holds slots ``r * length / cp`` onwards: chunks ``r`` and ``2cp - 1 - r`` of ``length / 2cp``)."""
    if cp == 1:
        return np.arange(length)
    check_length(length, cp, balanced=True)
    chunks = np.arange(length).reshape(2 * cp, length // (2 * cp))
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)])


def original_index(length: int, cp: int, balanced: bool) -> np.ndarray:
    """Each slot's original token index, ``[cp, length / cp]`` (row ``r``: the slots rank ``r`` holds)."""
    order = balanced_order(length, cp) if balanced else np.arange(length)
    return order.reshape(cp, length // cp).astype(np.int32)


def load_balance(x: jax.Array, *, axis: int = 1, cp: int | None = None) -> jax.Array:
    """``x`` with its sequence dimension ``axis`` permuted into the load-balanced layout of the traced mesh's
    ``cp`` (unchanged when ``cp`` is 1). Apply it to every per-token array of a step (tokens, positions,
    segment ids, targets, loss weights) *before* they are split over ``cp``, then call
    :func:`zjax.context.attention` with ``load_balanced=True``.

    Raises:
      ValueError: if the sequence length is not a multiple of ``2 x cp``.
    """
    cp = context_size() if cp is None else cp
    if cp == 1:
        return x
    return jnp.take(x, jnp.asarray(balanced_order(x.shape[axis], cp)), axis=axis)
