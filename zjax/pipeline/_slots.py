"""Where the table engine keeps what each microbatch's actions hand each other, per tick and stage.

Three buffers per stage, each a few slots that microbatches take turns in (an interval colouring of their
lifetimes): ``x``, a stage input from its arrival to the action that last reads it; ``g``, an output gradient
from its arrival to the W; ``r``, the residuals of the stage's backward pass (what ``jax.vjp`` keeps) from the
action that makes them to the W. Which action makes them is the engine's ``keep``: ``"F"`` (the forward keeps
what the remat policy saves; B and W pull back from it) or ``"B"`` (the forward keeps only the input; B recomputes
the stage once, keeping what W pulls back from).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import numpy as np

from ._schedule import B, F, Table, W, _after, _before, _is_last, _key

Keep = Literal["F", "B"]

UP, DOWN, SELF = 0, 1, 2
"""The channels a stage's output takes to the stage that reads it on the next tick: to the next stage (``pp``
rank ``s + 1``, the ring's wrap included), the previous one, or itself (a V's turn)."""


@dataclasses.dataclass(frozen=True, eq=False)
class Slots:
    """The slot plan of a table, per tick and stage: ``recv_*`` (``[T, S, 3]``: the slot the message arriving on
    each channel goes to), ``send`` (the channel the action's output leaves on, -1: none), ``read_*`` (the slot the
    action reads), ``store_*`` (the slot an action's own result goes to: a first stage's input, a last stage's loss
    gradient, the residuals). Slot ``n_x`` / ``n_g`` is scratch (writes there are dropped); ``store_r`` is -1
    where nothing is kept. ``first``/``last`` flag the actions that start from the inputs or end in the loss."""

    n_x: int
    n_g: int
    n_r: int
    recv_x: np.ndarray
    recv_g: np.ndarray
    read_x: np.ndarray
    read_g: np.ndarray
    read_r: np.ndarray
    store_x: np.ndarray
    store_g: np.ndarray
    store_r: np.ndarray
    first: np.ndarray
    last: np.ndarray
    send: np.ndarray


def _colour(intervals: list[tuple[int, int, object]]) -> tuple[dict[object, int], int]:
    """Interval-graph colouring: a slot per key, reused once its interval (inclusive ticks) is over."""
    free: list[int] = []
    busy: list[tuple[int, int]] = []  # (end, slot)
    slot_of: dict[object, int] = {}
    count = 0
    for start, end, key in sorted(intervals, key=lambda x: (x[0], x[1])):
        for item in sorted(busy):
            if item[0] < start:
                busy.remove(item)
                free.append(item[1])
        if free:
            slot = min(free)
            free.remove(slot)
        else:
            slot, count = count, count + 1
        busy.append((end, slot))
        slot_of[key] = slot
    return slot_of, count


@functools.lru_cache(maxsize=64)
def slots(tab: Table, keep: Keep = "B") -> Slots:
    """The buffers' slot plan for ``tab`` when ``keep`` makes the residuals (static: the engine indexes it per
    tick)."""
    s_, v, shape, where = tab.stages, tab.chunks, tab.kind.shape, tab.placement
    at: dict[tuple[int, int, int, int], int] = {}
    for t in range(tab.ticks):
        for s in range(s_):
            if tab.kind[t, s]:
                at[(int(tab.kind[t, s]), s, int(tab.micro[t, s]), int(tab.chunk[t, s]))] = t
    is_first = lambda s, c: s == 0 and c == 0  # noqa: E731
    is_last = lambda s, c: _is_last(s, c, s_, v, where)  # noqa: E731
    lives: list[tuple[list, list, list]] = [([], [], []) for _ in range(s_)]  # x, g, r intervals per stage
    for (kind, s, m, c), t_f in at.items():
        if kind != F:
            continue
        # an input from its arrival (a first stage's from its own forward) until the action that last reads it
        x_start = t_f if is_first(s, c) else at[_key(F, _before(s, c, s_, where), m)] + 1
        if (W, s, m, c) not in at:  # a table of forwards alone (Table.forwards): no gradient, no residuals
            lives[s][0].append((x_start, t_f, (m, c)))
            continue
        t_b, t_w = at[(B, s, m, c)], at[(W, s, m, c)]
        g_start = t_f if is_last(s, c) else at[_key(B, _after(s, c, s_, where), m)] + 1
        lives[s][0].append((x_start, t_f if keep == "F" else t_b, (m, c)))
        lives[s][1].append((g_start, t_w, (m, c)))
        lives[s][2].append((t_f if keep == "F" else t_b, t_w, (m, c)))
    colours = [tuple(_colour(iv) for iv in stage) for stage in lives]
    n_x, n_g = (max([1] + [stage[i][1] for stage in colours]) for i in (0, 1))
    n_r = max([0] + [stage[2][1] for stage in colours])
    read_x, store_x, recv_x = np.full(shape, n_x, np.int32), np.full(shape, n_x, np.int32), np.full((*shape, 3), n_x)
    read_g, store_g, recv_g = np.full(shape, n_g, np.int32), np.full(shape, n_g, np.int32), np.full((*shape, 3), n_g)
    read_r, store_r = np.zeros(shape, np.int32), np.full(shape, -1, np.int32)
    first, last, send = np.zeros(shape, bool), np.zeros(shape, bool), np.full(shape, -1, np.int32)

    def channel(s: int, to: int, kind: int) -> int:
        if where == "loop":  # forwards go round to the next stage, backwards back
            return UP if kind == F else DOWN
        return SELF if to == s else UP if to == s + 1 else DOWN

    for (kind, s, m, c), t in at.items():
        (x_of, _), (g_of, _), (r_of, _) = colours[s]
        first[t, s], last[t, s] = is_first(s, c), is_last(s, c)
        backward = (m, c) in g_of  # not in a table of forwards alone
        read_x[t, s], read_r[t, s] = x_of[(m, c)], r_of.get((m, c), 0)
        if kind != F:
            read_g[t, s] = g_of[(m, c)]
        if kind == (F if keep == "F" else B) and backward:
            store_r[t, s] = r_of[(m, c)]
        if kind == F:
            if is_first(s, c):
                store_x[t, s] = x_of[(m, c)]
            if is_last(s, c):
                store_g[t, s] = g_of[(m, c)] if backward else n_g
            else:
                nxt, nc = _after(s, c, s_, where)  # the stage (and chunk) that reads it receives it at t + 1
                send[t, s] = channel(s, nxt, F)
                recv_x[t + 1, nxt, send[t, s]] = colours[nxt][0][0][(m, nc)]
        if kind == B and not is_first(s, c):
            prv, pc = _before(s, c, s_, where)
            send[t, s] = channel(s, prv, B)
            recv_g[t + 1, prv, send[t, s]] = colours[prv][1][0][(m, pc)]
    recv_x, recv_g = recv_x.astype(np.int32), recv_g.astype(np.int32)
    return Slots(n_x, n_g, n_r, recv_x, recv_g, read_x, read_g, read_r, store_x, store_g, store_r, first, last, send)
