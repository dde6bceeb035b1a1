"""Reading a checkpoint step safely: a damaged step is told from a failed read, and every process agrees.

A step whose files are provably incomplete or corrupt (:func:`incomplete`, :func:`damage`) is skipped for an
older one; any other failure (I/O, memory, a bug, a plan that does not fit) is raised as it is, never taken for
damage. Orbax's handler returns a failed read instead of raising it (:class:`GuardedHandler`), so that every
process passes orbax's barrier and they then decide together (:func:`agree`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

STATE, META = "state", "meta"
"""The two items of a step: the state's arrays and the JSON metadata."""


class CallerError(ValueError):
    """The checkpoint is fine but does not fit the caller's plan or model (raised, never skipped)."""


class RestoreError(RuntimeError):
    """Reading a checkpoint step failed for a reason that is not damage to the step (I/O, memory, a bug).

    Attributes:
      step: the step that was being read.
      path: its directory.
    """

    def __init__(self, message: str, step: int, path: str):
        super().__init__(message)
        self.step = step
        self.path = path


@dataclasses.dataclass(frozen=True)
class ReadFailure:
    error: BaseException


class GuardedHandler(ocp.StandardCheckpointHandler):
    """Orbax's handler, except that a failed read is returned, not raised.

    orbax ends every restore with a barrier across processes; a process whose read raised would skip it and
    leave the others waiting. Returning the failure lets every process pass the barrier, after which they
    agree on what to do with the step (:func:`agree`).
    """

    def restore(self, directory: Any, args: Any = None) -> Any:
        try:
            return super().restore(directory, args=args)
        except Exception as e:  # noqa: BLE001 - re-raised by Checkpointer._try_restore, after the barrier
            return ReadFailure(e)


@ocp.args.register_with_handler(GuardedHandler, for_save=True)
@dataclasses.dataclass
class GuardedSave(ocp.args.StandardSave):
    """``StandardSave`` for :class:`GuardedHandler` (the same files on disk)."""


@ocp.args.register_with_handler(GuardedHandler, for_restore=True)
@dataclasses.dataclass
class GuardedRestore(ocp.args.StandardRestore):
    """``StandardRestore`` for :class:`GuardedHandler`."""


@dataclasses.dataclass(frozen=True)
class Damaged:
    reason: str


@dataclasses.dataclass(frozen=True)
class Failed:
    error: BaseException


# tensorstore reports a short or garbled file with these absl status codes (a transient error is UNAVAILABLE,
# UNKNOWN, RESOURCE_EXHAUSTED, ... and is never taken for damage)
_DAMAGE_CODES = ("DATA_LOSS", "OUT_OF_RANGE", "NOT_FOUND")
_REQUIRED = (
    ("_CHECKPOINT_METADATA",),  # written when the step is committed
    (STATE, "_METADATA"),
    (META, "metadata"),
)


def incomplete(step_dir: str) -> str | None:
    """Why ``step_dir`` is provably incomplete (a missing or unparsable commit/metadata file), or ``None``.

    Other ``OSError`` s (permissions, I/O) propagate: they say nothing about the step.
    """
    for parts in _REQUIRED:
        path = os.path.join(step_dir, *parts)
        try:
            with open(path, "rb") as f:
                json.loads(f.read())
        except FileNotFoundError:
            return f"{os.path.join(*parts)} is missing (the write never finished)"
        except (ValueError, UnicodeDecodeError):
            return f"{os.path.join(*parts)} is not valid JSON (a write cut short)"
    return None


def damage(error: BaseException, step_dir: str) -> str | None:
    """Why ``error`` proves the step's files damaged (a truncated, corrupt or missing array file), or ``None``."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e)
        if step_dir in text and any(text.lstrip().startswith(code) or f"{code}:" in text for code in _DAMAGE_CODES):
            return text.split("[tensorstore_spec", 1)[0].strip()[:400]
        e = e.__cause__ or e.__context__
    return None


def agreed_steps(steps: list[int]) -> list[int]:
    """Process 0's list of steps, on every process (each could list a directory at a different moment)."""
    if jax.process_count() == 1:
        return list(steps)
    n = int(multihost_utils.broadcast_one_to_all(np.int64(len(steps))))
    if n == 0:
        return []
    mine = np.zeros((n,), np.int64)
    mine[: min(n, len(steps))] = steps[:n]
    return [int(s) for s in multihost_utils.broadcast_one_to_all(mine)]


def agree(outcome: Any, step: int, directory: str) -> Any:
    """Make every process act alike on ``step``: all use it, all skip it as damaged, or all raise."""
    verdict = 2 if isinstance(outcome, Failed) else 1 if isinstance(outcome, Damaged) else 0
    if jax.process_count() > 1:
        verdicts = np.asarray(multihost_utils.process_allgather(np.int32(verdict)))
        worst = int(verdicts.max())
        if worst == 1 and verdict == 0:
            culprits = [int(i) for i in np.flatnonzero(verdicts == 1)]
            outcome = Damaged(f"damaged as read by process(es) {culprits}")
        elif worst == 2 and verdict != 2:
            culprits = [int(i) for i in np.flatnonzero(verdicts == 2)]
            raise RestoreError(
                f"checkpoint step {step} in {directory}: process(es) {culprits} failed to read it (see their "
                "logs); every process stops rather than restore different steps.",
                step,
                os.path.join(directory, str(step)),
            )
    if isinstance(outcome, Failed):
        error = outcome.error
        if isinstance(error, CallerError):
            raise error
        raise RestoreError(
            f"reading checkpoint step {step} in {os.path.join(directory, str(step))} failed with "
            f"{type(error).__name__}: {_clip(error)}. This is not damage to the step, so nothing was skipped or "
            "deleted; fix the cause and restore again.",
            step,
            os.path.join(directory, str(step)),
        ) from error
    return outcome


def _clip(error: BaseException, limit: int = 600) -> str:
    text = str(error).split("[tensorstore_spec", 1)[0].strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."
