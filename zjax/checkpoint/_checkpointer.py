"""Checkpoints of the whole ``TrainState`` that restore into any plan (stage, mesh, process count).

One logical checkpoint per step, written by orbax's ``CheckpointManager``: the state as global arrays
(unpadded logical shapes) plus a JSON item with the plan, the zjax version and the caller's metadata
(e.g. the data position). Restoring builds its target from the *new* plan's :meth:`zjax.Plan.abstract_state`,
so orbax reads each device's slice straight into the new layout: no offline conversion between ZeRO stages
or meshes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec

from .._version import __version__
from ..core import Plan, TrainState
from ..sharding._annotations import path_str
from ._recovery import (
    META,
    STATE,
    CallerError,
    Damaged,
    Failed,
    GuardedHandler,
    GuardedRestore,
    GuardedSave,
    ReadFailure,
    agree,
    agreed_steps,
    damage,
    incomplete,
)

log = logging.getLogger("zjax.checkpoint")


def plan_metadata(plan: Plan) -> dict[str, Any]:
    """What a checkpoint records about the plan that wrote it."""
    return {
        "stage": plan.stage.level,
        "precision": plan.precision.name,
        "compute_copy": plan.compute_copy,
        "offload": plan.offload.name,
        "mesh": {k: int(v) for k, v in plan.mesh.shape.items()},
        "processes": jax.process_count(),
        "rules": repr(plan.rules),
        "zjax_version": __version__,
    }


class _Mismatch(Exception):
    """The checkpoint holds different arrays than the plan's state: never pad or truncate silently."""


def _keeps_master(plan: Plan, meta: dict[str, Any]) -> bool:
    """Whether a checkpoint (of ``plan``'s precision) holds a compute copy beside fp32 master weights."""
    return plan.precision.master_weights and bool(meta.get("compute_copy", True))


def _other_form(plan: Plan) -> Plan:
    """``plan`` with the other form of state: without a compute copy (its fp32 weights as ``state.params``, laid
    out as an fp32 plan's) if it keeps one, else with one."""
    if plan.keeps_master:
        return dataclasses.replace(plan, precision="fp32", reduce_dtype=None)
    return dataclasses.replace(plan, compute_copy=True)


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _keys_to_data(tree: Any) -> Any:
    """Typed PRNG keys (arrays or ``ShapeDtypeStruct``) as their ``uint32`` key data, other leaves as they are."""

    def convert(x: Any) -> Any:
        if not _is_key(x):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            data = jax.eval_shape(jax.random.key_data, x)
            return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=x.sharding)
        return jax.random.key_data(x)

    return jax.tree.map(convert, tree)


def _data_to_keys(restored: Any, typed: Any, impl: Any) -> Any:
    """Undo :func:`_keys_to_data` where the target had typed keys."""
    return jax.tree.map(lambda r, t: jax.random.wrap_key_data(r, impl=impl) if _is_key(t) else r, restored, typed)


def _check_shapes(step: int, saved: list[tuple[str, tuple[int, ...], str, str]], target: Any) -> None:
    def key(path: str) -> str:  # nnx variables are saved as dicts with a 'value' entry
        return path.removesuffix("/value")

    want = {key(path_str(p)): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(target)[0]}
    have = {key(path): shape for path, shape, _, _ in saved}
    problems = [
        f"{p}: saved {have.get(p)}, model {want.get(p)}"
        for p in sorted(set(want) | set(have), key=lambda p: (not p.startswith("params"), p))  # parameters first
        if have.get(p) != want.get(p)
    ]
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise _Mismatch(
            f"checkpoint step {step} does not match this model's state ({shown}). Restore with the model and "
            "optimizer that wrote it; zjax never pads or truncates arrays on restore."
        )


class Checkpointer:
    """Save a run every ``save_every`` steps (asynchronously) and restore it into any plan.

    Use it as a context manager (or call :meth:`close`): the last write is always waited for, so a run
    never ends with only a temporary directory.

    Args:
      directory: where steps go (made absolute: orbax's background writer needs that).
      save_every: :meth:`maybe_save` saves when ``step % save_every == 0``.
      max_to_keep: keep this many newest steps.

    Example:
      >>> with zjax.Checkpointer("runs/ckpt", save_every=100) as ckpt:
      ...     state, meta = ckpt.restore_or_init(plan, init_fn, tx, rng)
      ...     for ...: state, m = step(state, batch); ckpt.maybe_save(state, {"data_position": i})
    """

    def __init__(self, directory: str | os.PathLike, *, save_every: int = 1000, max_to_keep: int = 3):
        if save_every < 1:
            raise ValueError(f"Checkpointer: save_every={save_every} must be >= 1.")
        self.directory = os.path.abspath(os.fspath(directory))
        self.save_every = save_every
        self.preempted = False
        self._manager = ocp.CheckpointManager(
            self.directory,
            item_handlers={STATE: GuardedHandler(), META: ocp.JsonCheckpointHandler()},
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        )

    # -- context ------------------------------------------------------------------------------

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for the last write and release the manager."""
        self._manager.wait_until_finished()
        self._manager.close()

    def saving(self) -> bool:
        """Whether an asynchronous save is still being written."""
        return bool(self._manager.is_saving_in_progress())

    def wait(self) -> None:
        """Block until the pending asynchronous save is on disk (and raise if it failed)."""
        self._manager.wait_until_finished()

    # -- save ---------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(
        self, state: TrainState, plan: Plan, metadata: dict[str, Any] | None = None, *, force: bool = True
    ) -> bool:
        """Start writing ``state`` at step ``state.step``; returns before the write ends."""
        step = int(jax.device_get(state.step))
        meta = plan_metadata(plan) | {"step": step, "user": metadata or {}}
        return bool(
            self._manager.save(
                step,
                args=ocp.args.Composite(**{STATE: GuardedSave(_keys_to_data(state)), META: ocp.args.JsonSave(meta)}),
                force=force,
            )
        )

    def maybe_save(self, state: TrainState, plan: Plan, metadata: dict[str, Any] | None = None) -> bool:
        """Save when the state's step is a multiple of ``save_every``, or at a preemption.

        With ``jax.distributed`` initialized, a SIGTERM makes every process agree on a step (JAX's
        preemption sync point); at that step this saves on all of them and sets :attr:`preempted`: the
        training loop should then stop and :meth:`close`.
        """
        step = int(jax.device_get(state.step))
        if jax.distributed.is_initialized() and multihost_utils.reached_preemption_sync_point(step):
            self.preempted = True
            log.warning("zjax: preemption: saving step %d in %s", step, self.directory)
            return self.save(state, plan, metadata)
        if step % self.save_every:
            return False
        return self.save(state, plan, metadata)

    # -- restore ------------------------------------------------------------------------------

    def array_metadata(self, step: int) -> list[tuple[str, tuple[int, ...], str, str]]:
        """``(path, shape, dtype, sharding)`` of every saved array at ``step``, read from disk metadata."""
        tree = self._manager.item_metadata(step)[STATE]
        rows = []
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            sharding = getattr(leaf, "sharding", None)
            spec = getattr(sharding, "partition_spec", None)
            if spec is None:
                spec = getattr(sharding, "spec", sharding)
            text = str(PartitionSpec(*spec)) if isinstance(spec, (tuple, list)) else str(spec)
            rows.append((path_str(path), tuple(leaf.shape), str(leaf.dtype), text))
        return rows

    def metadata(self, step: int) -> dict[str, Any]:
        """The JSON item saved with ``step``."""
        restored = self._manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))
        return dict(restored[META])

    def restore(
        self,
        plan: Plan,
        init_fn: Callable[[jax.Array], Any],
        tx: Any,
        rng: jax.Array,
        step: int | None = None,
    ) -> tuple[TrainState, dict[str, Any]]:
        """Restore into ``plan``'s layout: ``(state, metadata)``.

        Without ``step``, the newest step that restores. A step is skipped (with a warning naming it) only
        when it is provably incomplete or corrupt: a missing or unparsable commit or metadata file, or an
        array file that is truncated, corrupt or missing. Anything else (an I/O error, out of memory, a
        bug) is raised at once, naming the step: it says nothing about the checkpoint, so zjax does not
        fall back past a good step. With several processes all of them try the same steps (process 0's
        list) and agree after each: they restore the same step or fail together.

        Raises:
          FileNotFoundError: if there is no step, or every step is damaged.
          RestoreError: reading a step failed for another reason (``__cause__`` holds the original error).
          ValueError: if the checkpoint's precision or array shapes differ from the plan's state.
        """
        typed = plan.abstract_state(init_fn, tx, rng)
        forms = {plan.keeps_master: typed}

        def form(keeps_master: bool) -> Any:
            """The abstract state of a checkpoint that holds a compute copy beside its master or not."""
            if keeps_master not in forms:
                other = _other_form(plan)
                forms[keeps_master] = other.abstract_state(init_fn, tx, rng)
            return forms[keeps_master]

        candidates = agreed_steps([step] if step is not None else self.steps()[::-1])
        if not candidates:
            raise FileNotFoundError(f"No checkpoint steps in {self.directory}.")
        damaged: list[tuple[int, str]] = []
        for candidate in candidates:
            outcome = agree(self._try_restore(candidate, plan, form), candidate, self.directory)
            if isinstance(outcome, Damaged):
                damaged.append((candidate, outcome.reason))
                continue
            restored, meta = outcome
            for bad, why in damaged:
                warnings.warn(f"zjax: skipped damaged checkpoint step {bad} in {self.directory}: {why}", stacklevel=2)
            moved = ("stage", "mesh", "compute_copy")
            changed = {
                k: (meta.get(k, True if k == "compute_copy" else None), v)
                for k, v in plan_metadata(plan).items()
                if k in moved
            }
            changed = {k: v for k, v in changed.items() if v[0] != v[1]}
            if changed:
                log.warning(
                    "zjax: restored step %d with a different plan: %s",
                    candidate,
                    ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()),
                )
            saved = form(_keeps_master(plan, meta))
            state = _data_to_keys(restored[STATE], saved, jax.random.key_impl(rng)).replace(layout=saved.layout)
            if saved is not typed:  # saved with(out) a compute copy: moved into this plan's form
                state = plan.reshard(state)
            return state.replace(layout=typed.layout), meta
        detail = "; ".join(f"step {s}: {why}" for s, why in damaged)
        raise FileNotFoundError(
            f"No restorable checkpoint step in {self.directory}: every step is damaged ({detail}). Nothing was "
            "deleted; move the directory aside to start fresh."
        )

    def _try_restore(self, step: int, plan: Plan, form: Callable[[bool], Any]) -> Any:
        """``(restored, meta)``, a :class:`Damaged` verdict, or a :class:`Failed` (error kept to re-raise)."""
        where = os.path.join(self.directory, str(step))
        try:
            reason = incomplete(where)
            if reason is not None:
                return Damaged(reason)
            meta = self.metadata(step)
            if meta.get("precision") != plan.precision.name:
                return Failed(
                    CallerError(
                        f"checkpoint step {step} was saved with precision {meta.get('precision')!r}; this plan "
                        f"uses {plan.precision.name!r}. Restore with a plan of the same precision."
                    )
                )
            target = _keys_to_data(form(_keeps_master(plan, meta)))  # typed PRNG keys are saved as key data
            # A different model is the caller's error (never padded or truncated): checked before reading arrays.
            _check_shapes(step, self.array_metadata(step), target)
            restored = self._manager.restore(step, args=ocp.args.Composite(**{STATE: GuardedRestore(target)}))
            if isinstance(restored[STATE], ReadFailure):
                raise restored[STATE].error
        except _Mismatch as mismatch:
            return Failed(CallerError(str(mismatch)))
        except Exception as e:  # noqa: BLE001 - classified: damage falls back, everything else is raised
            reason = damage(e, where)
            return Damaged(reason) if reason is not None else Failed(e)
        return restored, meta

    def restore_or_init(
        self, plan: Plan, init_fn: Callable[[jax.Array], Any], tx: Any, rng: jax.Array
    ) -> tuple[TrainState, dict[str, Any] | None]:
        """The newest restorable step, or a fresh ``plan.init`` **only** when the directory has no steps.

        If steps exist and none restores, or reading one fails for a reason other than damage, this
        raises (see :meth:`restore`) and deletes nothing: a run never silently starts over.
        """
        if not agreed_steps(self.steps()):
            return plan.init(init_fn, tx, rng), None
        return self.restore(plan, init_fn, tx, rng)
