"""Pipeline schedules as data: which stage runs which action of which microbatch at each tick.

A schedule is an order of actions per stage: ``F`` (forward), ``B`` (the backward pass to the stage's
input) and ``W`` (the backward pass to its weights), each on one microbatch ``m`` and one chunk ``c``
of the stage's layers (``c < v``, the interleaved schedules' repeats). :func:`table` places every
action on the earliest tick at which its inputs exist, in lockstep (a value sent at tick ``t`` arrives
at ``t + 1``; one action per stage per tick, each costing one tick: the split of the backward pass
into B and W keeps the three alike). GPipe and the 1F1B schedules take B and W as one backward pass (the
previous stage's B waits for the W), as their papers count them; only zero-bubble separates them. The
engine runs that table as it is, so the bubble counted here, idle ticks over all ticks, is the program's.

- ``gpipe``: all forwards, then all backwards (every microbatch's input kept until its W).
- ``1f1b`` (PipeDream-Flush): ``S - s - 1`` warm-up forwards on stage ``s``, then one forward, one
  backward (B then W) at a time; at most ``S - s`` microbatches in flight.
- ``interleaved-1f1b`` (Megatron-LM's): ``v`` chunks per stage, forwards in groups of ``S``
  microbatches per chunk; the bubble shrinks by ``v`` for ``v`` times the stage-to-stage messages.
- ``zero-bubble`` (ZB-H1, Qi et al. 2023): 1F1B's order of F and B, with each W deferred into ticks
  where the stage would otherwise wait, as long as the microbatches in flight stay within 1F1B's.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import re

import numpy as np

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zb-v")
"""The schedules :class:`zjax.Pipeline` runs (``gpipe`` with ``repeats > 1`` is the circular one)."""

PLACEMENTS = ("loop", "v")
"""Where a stage's chunks of layers lie in the model (:class:`Table`'s ``placement``): ``"loop"``, chunk ``c`` of
stage ``s`` holds block ``c*S + s`` (a microbatch loops through the stages once per chunk); ``"v"``, odd chunks run
back down, so chunk 1 of stage ``s`` holds block ``2S - 1 - s`` (ZB-V: the first and the last block on stage 0)."""

IDLE, F, B, W = 0, 1, 2, 3
ACTIONS = ".FBW"


@dataclasses.dataclass(frozen=True, eq=False)
class Table:
    """A schedule placed on ticks: ``kind[t, s]`` (IDLE, F, B or W), ``micro[t, s]`` and ``chunk[t, s]``."""

    schedule: str
    stages: int
    microbatches: int
    chunks: int
    kind: np.ndarray
    micro: np.ndarray
    chunk: np.ndarray
    placement: str = "loop"

    @property
    def ticks(self) -> int:
        return int(self.kind.shape[0])

    def idle(self) -> np.ndarray:
        """Idle ticks per stage."""
        return np.sum(self.kind == IDLE, axis=0)

    def bubble(self) -> float:
        """The largest idle fraction of any stage: idle ticks / ticks."""
        return float(np.max(self.idle()) / self.ticks)

    def bubble_time(self, costs: dict[str, float]) -> np.ndarray:
        """Per stage, its idle share of the step's time when an action of kind ``k`` takes ``costs[k]`` (``"F"``,
        ``"B"``, ``"W"``): the stages run in lockstep, so a tick lasts as long as its longest action, and a stage
        idles through the rest of every tick (its own idle ticks whole)."""
        cost = np.asarray([0.0] + [float(costs[a]) for a in ACTIONS[1:]])[self.kind]  # [T, S]
        time = float(np.sum(np.max(cost, axis=1)))
        return 1.0 - np.sum(cost, axis=0) / time if time > 0 else np.zeros(self.stages)

    def in_flight(self) -> np.ndarray:
        """Per stage, the most microbatch-chunks whose forward ran and whose W has not: the inputs it keeps."""
        live = np.cumsum(self.kind == F, axis=0) - np.cumsum(self.kind == W, axis=0)
        return np.max(live, axis=0)

    def forwards(self) -> Table:
        """The table's forwards alone, each stage's in its order, placed again on the first ticks their inputs exist
        (an evaluation's schedule: nothing is differentiated, so nothing waits for a backward pass)."""
        orders = [
            [(F, int(self.micro[t, s]), int(self.chunk[t, s])) for t in range(self.ticks) if self.kind[t, s] == F]
            for s in range(self.stages)
        ]
        return _place(self.schedule, self.stages, self.microbatches, self.chunks, orders, None, False, self.placement)

    def __str__(self) -> str:
        rows = [
            " ".join(
                f"{ACTIONS[k]}{m}" + (f".{c}" if self.chunks > 1 else "") if k else "." * (2 + 2 * (self.chunks > 1))
                for k, m, c in zip(self.kind[:, s], self.micro[:, s], self.chunk[:, s], strict=True)
            )
            for s in range(self.stages)
        ]
        head = [] if self.placement == "loop" else [f"placement: {self.placement}"]
        return "\n".join(head + [f"stage {s}: {row}" for s, row in enumerate(rows)])


def _forwards(m_: int, s_: int, v: int, schedule: str) -> list[tuple[int, int]]:
    """The (microbatch, chunk) order of the forwards (the backwards take it with chunks reversed)."""
    if schedule == "gpipe" or v == 1:  # chunk-major: every microbatch visits chunk c before any visits c + 1
        return [(m, c) for c in range(v) for m in range(m_)]
    # groups of S microbatches per chunk (Megatron-LM's interleaving; v = 1 is plain 1F1B)
    return [(g * s_ + i, c) for g in range(m_ // s_) for c in range(v) for i in range(s_)]


def _backwards(m_: int, s_: int, v: int, schedule: str) -> list[tuple[int, int]]:
    if schedule == "gpipe" or v == 1:
        return [(m, c) for c in reversed(range(v)) for m in range(m_)]
    return [(g * s_ + i, c) for g in range(m_ // s_) for c in reversed(range(v)) for i in range(s_)]


def _warmup(schedule: str, s_: int, stage: int, v: int, total: int) -> int:
    """Forwards stage ``stage`` runs before its first backward."""
    if schedule == "gpipe":
        return total
    if v == 1:
        return min(s_ - stage - 1, total)
    return min((s_ - stage - 1) * 2 + (v - 1) * s_, total)


def _before(s: int, c: int, s_: int, placement: str = "loop") -> tuple[int, int]:
    """The (stage, chunk) whose forward output the forward of (s, c) takes: the previous stage, or the last
    stage's previous chunk (the ring); in a V, an odd chunk's the next stage, or its own stage's previous chunk at
    the turn."""
    if placement == "v" and c % 2:
        return (s + 1, c) if s < s_ - 1 else (s, c - 1)
    if placement == "v" and s == 0:
        return (0, c - 1)
    return (s - 1, c) if s > 0 else (s_ - 1, c - 1)


def _after(s: int, c: int, s_: int, placement: str = "loop") -> tuple[int, int]:
    """The (stage, chunk) whose input gradient the backward of (s, c) takes (the forward of (s, c) feeds it)."""
    if placement == "v" and c % 2:
        return (s - 1, c) if s > 0 else (0, c + 1)
    if placement == "v":
        return (s + 1, c) if s < s_ - 1 else (s, c + 1)
    return (s + 1, c) if s < s_ - 1 else (0, c + 1)


def _is_last(s: int, c: int, s_: int, v: int, placement: str = "loop") -> bool:
    """Whether chunk ``c`` of stage ``s`` holds the model's last layers (its forward ends in the loss)."""
    return c == v - 1 and s == (0 if placement == "v" and v % 2 == 0 else s_ - 1)


def _action(kind: int, m: int, c: int, v: int) -> str:
    """An action as a table prints it: ``F3``, or ``F3.1`` (microbatch 3, chunk 1) with chunks."""
    return f"{ACTIONS[kind]}{m}" + (f".{c}" if v > 1 else "")


def _key(kind: int, where: tuple[int, int], m: int) -> tuple[int, int, int, int]:
    return (kind, where[0], m, where[1])


@functools.lru_cache(maxsize=64)
def schedule_table(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> Table:
    """Place ``schedule`` for ``stages`` (S), ``microbatches`` (M) and ``chunks`` (v) on ticks."""
    if schedule not in SCHEDULES:
        raise ValueError(f"Pipeline: schedule={schedule!r} is not one of {SCHEDULES}.")
    s_, m_, v = stages, microbatches, chunks
    if schedule == "zb-v":
        return _zb_v(s_, m_, v)
    defer = schedule == "zero-bubble"
    orders: list[list[tuple[int, int, int]]] = []
    fwd, bwd = _forwards(m_, s_, v, schedule), _backwards(m_, s_, v, schedule)
    for stage in range(s_):
        w = _warmup(schedule, s_, stage, v, len(fwd))
        order = [(F, *a) for a in fwd[:w]]
        for i in range(len(fwd) - w):
            order += [(F, *fwd[w + i]), (B, *bwd[i])] + ([] if defer else [(W, *bwd[i])])
        for i in range(len(fwd) - w, len(bwd)):
            order += [(B, *bwd[i])] + ([] if defer else [(W, *bwd[i])])
        orders.append(order)
    # ZB-H1: every stage may hold as many inputs as 1F1B's first stage (its peak), so the later stages defer
    # their W into the cool-down and the backward chain runs ahead at one tick per stage
    caps = [_warmup("1f1b", s_, 0, v, len(fwd)) + 1] * s_
    return _place(schedule, s_, m_, v, orders, caps if defer else None)


def _need(
    kind: int, s: int, m: int, c: int, s_: int, v: int, placement: str, after: int
) -> tuple[int, int, int, int] | None:
    """The action whose result the action ``kind`` of microbatch ``m`` on chunk ``c`` of stage ``s`` reads: a forward
    the previous chunk's forward, a B the backward of the chunk it feeds (``after``: B, or W where B and W are one
    backward pass, done after its W), the last layers' B their own forward, a W its B."""
    if kind == F:
        return None if (s, c) == (0, 0) else _key(F, _before(s, c, s_, placement), m)
    if kind == B:
        return (F, s, m, c) if _is_last(s, c, s_, v, placement) else _key(after, _after(s, c, s_, placement), m)
    return (B, s, m, c)


def _zb_v(s_: int, m_: int, v: int) -> Table:
    """ZB-V (Qi et al. 2024): two chunks per stage in a V (:data:`PLACEMENTS`), F, B and W apart, placed greedily
    tick by tick: each stage runs a ready B (the oldest microbatch), else a forward (the later chunk first) while
    it keeps fewer than 2S chunk inputs (1F1B's peak: S whole-stage inputs), else its oldest pending W, else idles."""
    if v != 2:
        raise ValueError(f"Pipeline: schedule='zb-v' runs two chunks per stage in a V; use repeats=2 (got {v}).")
    cap = 2 * s_
    done: dict[tuple[int, int, int, int], int] = {}
    nxt = {(k, s, c): 0 for k in (F, B) for s in range(s_) for c in range(v)}  # the next microbatch per queue
    pending: list[list[tuple[int, int]]] = [[] for _ in range(s_)]
    live = [0] * s_
    rows: list[list[tuple[int, int, int]]] = []

    def ready(kind: int, s: int, m: int, c: int, t: int) -> bool:
        if m >= m_ or (kind == B and done.get((F, s, m, c), t) >= t):
            return False
        needed = _need(kind, s, m, c, s_, v, "v", B)
        return needed is None or done.get(needed, t) < t

    while len(done) < 3 * s_ * m_ * v:
        t, row = len(rows), []
        for s in range(s_):
            backs = [(nxt[(B, s, c)], c) for c in range(v) if ready(B, s, nxt[(B, s, c)], c, t)]
            fores = [c for c in reversed(range(v)) if live[s] < cap and ready(F, s, nxt[(F, s, c)], c, t)]
            if backs:
                m, c = min(backs)
                run = (B, m, c)
                pending[s].append((m, c))
            elif fores:
                run = (F, nxt[(F, s, fores[0])], fores[0])
                live[s] += 1
            elif pending[s]:
                run = (W, *pending[s].pop(0))
                live[s] -= 1
            else:
                row.append((IDLE, 0, 0))
                continue
            if run[0] != W:
                nxt[(run[0], s, run[2])] += 1
            done[(run[0], s, run[1], run[2])] = t
            row.append(run)
        rows.append(row)
        if all(kind == IDLE for kind, _, _ in row):  # never seen: S = 2..8, M = 1..48
            raise RuntimeError(f"zb-v: no stage can run at tick {t} (pp={s_}, microbatches={m_}).")
    grid = np.asarray(rows, dtype=np.int32)
    return Table("zb-v", s_, m_, v, grid[..., 0], grid[..., 1], grid[..., 2], "v")


def _place(
    schedule: str,
    s_: int,
    m_: int,
    v: int,
    orders: list[list[tuple[int, int, int]]],
    caps: list[int] | None,
    split: bool = False,
    placement: str = "loop",
) -> Table:
    """Lockstep list scheduling: each stage runs its next action once what it needs was done on an earlier
    tick. With ``caps`` (zero-bubble), W actions are not in the orders: a stage runs its oldest pending W when
    its next action must wait, or when another forward would hold more than ``caps[s]`` inputs. ``split`` (a
    table of one's own): B waits for the next stage's B, not its W, whatever the order holds.

    Raises:
      ValueError: on a tick where no stage can run its next action (the orders wait on each other).
    """
    done: dict[tuple[int, int, int, int], int] = {}  # (kind, stage, m, c) -> tick
    after = B if caps is not None or split else W

    def need(kind: int, stage: int, m: int, c: int) -> tuple[int, int, int, int] | None:
        return _need(kind, stage, m, c, s_, v, placement, after)

    def ready(kind: int, stage: int, m: int, c: int, t: int) -> bool:
        needed = need(kind, stage, m, c)
        return needed is None or done.get(needed, t) < t

    cursor = [0] * s_
    pending: list[list[tuple[int, int]]] = [[] for _ in range(s_)]
    live = [0] * s_
    rows: list[list[tuple[int, int, int]]] = []
    while any(cursor[s] < len(orders[s]) or pending[s] for s in range(s_)):
        t = len(rows)
        row = []
        for s in range(s_):
            action = orders[s][cursor[s]] if cursor[s] < len(orders[s]) else None
            run = None
            if action is not None and ready(*action[:1], s, *action[1:], t):
                full = caps is not None and action[0] == F and live[s] >= caps[s]
                run = action if not full else None
            if run is None and pending[s] and (action is None or caps is not None):
                run = (W, *pending[s].pop(0))
            elif run is not None:
                cursor[s] += 1
            if run is None:
                row.append((IDLE, 0, 0))
                continue
            kind, m, c = run
            done[(kind, s, m, c)] = t
            live[s] += 1 if kind == F else -1 if kind == W else 0
            if kind == B and caps is not None:
                pending[s].append((m, c))
            row.append(run)
        rows.append(row)
        if all(kind == IDLE for kind, _, _ in row):  # nothing ran, so nothing will: the orders wait on each other
            waits = []
            for s in range(s_):
                if cursor[s] < len(orders[s]):
                    kind, m, c = orders[s][cursor[s]]
                    k2, s2, m2, c2 = need(kind, s, m, c) or (kind, s, m, c)
                    on = _action(k2, m2, c2, v)
                    waits.append(f"stage {s}'s {_action(kind, m, c, v)} waits for stage {s2}'s {on}")
            raise ValueError(
                f"pipeline schedule {schedule!r}: at tick {t} no stage can run its next action ({'; '.join(waits)}, "
                "which comes later in its stage's order): move the action waited for earlier in its stage's order, "
                "or the waiting one later."
            )
    grid = np.asarray(rows, dtype=np.int32)  # [T, S, 3]
    return Table(schedule, s_, m_, v, grid[..., 0], grid[..., 1], grid[..., 2], placement)


_TOKEN = re.compile(r"([FBW])(\d+)(?:\.(\d+))?")


def read_table(path: str | os.PathLike) -> Table:
    """:func:`parse_table` of a file's text, the table named by the file's name without its suffix.

    Raises:
      FileNotFoundError: no such file.
      ValueError: as :func:`parse_table`, the message starting with the file's path.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"pipeline table {str(path)!r}: no such file (one line of actions per stage).")
    try:
        return parse_table(path.read_text(encoding="utf-8"), name=path.stem)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def parse_table(text: str, name: str = "custom") -> Table:
    """A schedule of one's own: ``text`` holds one line per stage (``stage s:`` before it is optional), the
    stage's actions in the order it runs them: ``F3`` (the forward of microbatch 3), ``B3`` (its backward to the
    stage's input), ``W3`` (to the stage's weights), ``F3.1`` (chunk 1 of the stage's layers, with chunks: chunk
    ``c`` of stage ``s`` holds the layers ``(c*S + s)*Lps ...``, so a microbatch runs chunk c on stages 0 .. S-1,
    then chunk c + 1; after a line ``placement: v`` the odd chunks run back down, :data:`PLACEMENTS`, as ZB-V's).
    ``.`` (an idle tick of a printed :class:`Table`) and lines starting with ``#`` are skipped.
    Each action is placed on the first tick its inputs exist, in its stage's order (``str`` of the result prints
    the ticks; ``parse_table(str(table))`` gives ``table`` back). ``Pipeline(M, schedule=table)`` runs it.

    Raises:
      ValueError: a token that is no action; a stage that lacks an action or runs one twice, or runs B before its
        F or W before its B; orders that wait on each other (the tick, the stages and what each waits for).
    """
    orders: list[list[tuple[int, int, int]]] = []
    placement = "loop"
    for line in text.splitlines():
        if line.strip().startswith("placement:"):
            placement = line.split(":", 1)[1].strip()
            if placement not in PLACEMENTS:
                raise ValueError(f"pipeline table: placement {placement!r} is not one of {PLACEMENTS}.")
            continue
        line = line.split(":", 1)[1] if line.strip().startswith("stage") and ":" in line else line
        if not line.strip() or line.strip().startswith("#"):
            continue
        order = []
        for token in line.split():
            if set(token) == {"."}:
                continue
            match = _TOKEN.fullmatch(token)
            if match is None:
                raise ValueError(
                    f"pipeline table, stage {len(orders)}: {token!r} is not an action; write F, B or W, the "
                    "microbatch and, with chunks, '.' and the chunk (F3, W3.1), or '.' for an idle tick."
                )
            order.append((ACTIONS.index(match[1]), int(match[2]), int(match[3] or 0)))
        orders.append(order)
    if not orders or not any(orders):
        raise ValueError("pipeline table: no actions; write one line per stage, e.g. 'F0 F1 B0 W0 B1 W1'.")
    m_ = 1 + max(m for order in orders for _, m, _ in order)
    v = 1 + max(c for order in orders for _, _, c in order)
    for s, order in enumerate(orders):
        seen: dict[tuple[int, int, int], int] = {}
        for i, (kind, m, c) in enumerate(order):
            if (kind, m, c) in seen:
                raise ValueError(f"pipeline table, stage {s}: {_action(kind, m, c, v)} appears twice.")
            if kind != F and (kind - 1, m, c) not in seen:
                raise ValueError(
                    f"pipeline table, stage {s}: {_action(kind, m, c, v)} comes before {_action(kind - 1, m, c, v)}; "
                    "a microbatch's B follows its F on a stage, and its W its B."
                )
            seen[(kind, m, c)] = i
        missing = [(k, m, c) for m in range(m_) for c in range(v) for k in (F, B, W) if (k, m, c) not in seen]
        if missing:
            raise ValueError(
                f"pipeline table, stage {s}: lacks {', '.join(_action(*a, v) for a in missing[:6])}: every stage "
                f"runs F, B and W of each of the {m_} microbatches" + (f" and {v} chunks." if v > 1 else ".")
            )
    return _place(name, len(orders), m_, v, orders, None, split=True, placement=placement)
