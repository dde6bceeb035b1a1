"""The training loop: steps, evaluation and checkpoint cadences, preemption, metrics and progress.

One function, :func:`fit`, rather than a trainer class: the model, loss, optimizer and data stay the
caller's (a ``Plan``, its ``train_step`` and a state, as in any zjax script), and the loop owns only what
every script repeated around them. Settings are one frozen :class:`LoopConfig`; what varies per model
(the learning-rate schedule, FLOPs for MFU, router metrics) comes in as plain functions. :func:`init_or_restore`
is the other half: a fresh state, or the newest checkpoint with the data position the loop saved in it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from ..checkpoint import Checkpointer
from ..core import LossSum
from ._config import LoopConfig
from ._data import Batches, eval_batches
from ._report import Reporter

if TYPE_CHECKING:
    from ..core import EvalStep, MemoryReport, Plan, TrainState, TrainStep


@dataclasses.dataclass(frozen=True)
class FitResult:
    """What :func:`fit` returns.

    Attributes:
      state: the state after the last step.
      losses: the loss of every step run, in order (fetched once, at the end).
      start: the step the run started from (its data position).
      end: the step it stopped after (``config.steps``, ``stop_at``, or the preemption's step).
      preempted: stopped by a preemption (SIGTERM); the checkpoint holds step ``end``.
      skipped_steps: steps skipped for non-finite gradients (fp16 loss scaling).
      eval_loss: the last evaluation's mean loss, or ``None``.
      mfu: the last logged model FLOPs utilization, or ``None``.
      tokens_per_second: over the whole run (``None`` without ``tokens_per_step``).
      memory: the step's per-device memory report (``None`` when a finished run's iterable had no batch left).
    """

    state: TrainState
    losses: list[float]
    start: int
    end: int
    preempted: bool
    skipped_steps: int
    eval_loss: float | None
    mfu: float | None
    tokens_per_second: float | None
    memory: MemoryReport | None


def init_or_restore(
    plan: Plan,
    init_fn: Callable[[jax.Array], Any],
    tx: Any,
    rng: jax.Array,
    config: LoopConfig,
    *,
    fresh: Callable[[], TrainState] | None = None,
) -> tuple[TrainState, int]:
    """The state to train from and its data position: the newest checkpoint with ``config.resume``, else new.

    Args:
      plan: the run's plan (a checkpoint restores into its layout, whatever stage or mesh wrote it).
      init_fn: ``init_fn(rng) -> params``.
      tx: the optax optimizer.
      rng: the initialization key.
      config: ``resume`` and ``checkpoint_dir`` are read.
      fresh: builds the state when nothing is restored (e.g. :func:`zjax.hf.load`); default ``plan.init``.

    Returns:
      ``(state, start)``: ``start`` is the data position saved by :func:`fit` (0 for a new run).

    Raises:
      FileNotFoundError, ValueError: see :meth:`zjax.Checkpointer.restore`; a run never silently starts over.

    Example:
      >>> state, start = zjax.train.init_or_restore(plan, init_fn, tx, jax.random.key(0), config)
    """
    if config.resume and config.checkpoint_dir is not None:
        with Checkpointer(config.checkpoint_dir, save_every=config.save_every) as ckpt:
            if fresh is None or ckpt.steps():
                state, meta = ckpt.restore_or_init(plan, init_fn, tx, rng)
                if meta is None:
                    return state, 0
                print(f"resumed from step {meta['step']} (saved at stage {meta['stage']}, mesh {meta['mesh']})")
                return state, int(meta["user"].get("data_position", meta["step"]))
    return (plan.init(init_fn, tx, rng) if fresh is None else fresh()), 0


def fit(
    plan: Plan,
    step: TrainStep,
    state: TrainState,
    data: Any,
    config: LoopConfig,
    *,
    start: int = 0,
    eval_step: EvalStep | None = None,
    eval_data: Any = None,
    schedule: Callable[[int], Any] | None = None,
    tokens_per_step: int | None = None,
    mfu: Callable[[float], float | None] | None = None,
    aux_metrics: Callable[[Any], dict[str, Any]] | None = None,
    run_config: dict[str, Any] | None = None,
) -> FitResult:
    """Train ``state`` with ``step`` from step ``start`` to ``config.steps``.

    Each step feeds ``plan.shard_batch`` of the step's batch (the next one is read while the step runs).
    Every ``log_every`` steps one host sync writes a record (``loss``, ``grad_norm``, ``loss_scale``,
    ``skipped``, ``step_time`` and what the optional arguments add) to ``config.log_dir``'s writers and the
    progress bar (process 0 only). Every ``eval_every`` steps and at the end, ``eval_step`` evaluates
    ``config.eval_batches`` held-out batches: a :class:`zjax.LossSum` as the sums over the counts of all of them
    (the held-out tokens' mean), a scalar as the mean over the batches. With ``checkpoint_dir`` the state is saved every
    ``save_every`` steps and after the last, with its data position; a SIGTERM (with ``jax.distributed`` up:
    :func:`runtime` with ``preemptible``, or any multi-process job) saves the agreed step on every process and
    returns with ``preempted``.

    Args:
      plan: the run's plan.
      step: ``plan.train_step(loss_fn, accum_steps=...)`` (accumulation happens inside it).
      state: from :func:`init_or_restore` or ``plan.init``.
      data: ``LMData``, a function ``step -> batch`` or an iterable of numpy batches (this process's rows).
      config: the loop's settings.
      start: the first step's data position (from :func:`init_or_restore`).
      eval_step: ``plan.eval_step(fn)`` with ``fn(params, batch) -> LossSum`` or a scalar loss; needs
        ``eval_data``.
      eval_data: ``LMData`` (its ``epoch_batches``), a list of batches, or a function returning an iterable.
      schedule: the learning-rate schedule, logged as ``learning_rate``.
      tokens_per_step: tokens in a global batch, for ``tokens_per_second``.
      mfu: ``tokens_per_second -> MFU`` (e.g. with :func:`zjax.metrics.mfu`), logged as ``mfu``.
      aux_metrics: host record entries from the step's ``metrics["aux"]`` (e.g. router statistics).
      run_config: the run's settings, sent to Weights & Biases with ``config.wandb``.

    Returns:
      A :class:`FitResult`.

    Raises:
      ValueError: ``config.eval_every`` without ``eval_step`` and ``eval_data``, or data that runs out.
      TypeError: ``data`` or ``eval_data`` gives no batches.

    Example:
      >>> step = plan.train_step(loss_fn, accum_steps=4)
      >>> result = zjax.train.fit(plan, step, state, batches, zjax.train.LoopConfig(steps=100))
      >>> result.losses[-1]
    """
    if config.eval_every and (eval_step is None or eval_data is None):
        raise ValueError(
            f"zjax.train.fit: eval_every={config.eval_every} needs eval_step and eval_data; pass both, or set "
            "eval_every=0."
        )
    mesh = plan.mesh
    end = config.steps if config.stop_at is None else min(config.steps, config.stop_at)
    fetch = Batches(data, mesh, start)
    memory = None
    if start < end or hasattr(data, "batch"):  # a finished run resumed may have no batch left in an iterable
        batch = plan.shard_batch(fetch(start))
        memory = step.memory_report(state, batch)
        if jax.process_index() == 0:
            print(memory, flush=True)
    ckpt = Checkpointer(config.checkpoint_dir, save_every=config.save_every) if config.checkpoint_dir else None
    report = Reporter(config, plan, start, end, memory, tokens_per_step, schedule, mfu, aux_metrics, run_config)
    held: list[Any] | None = None

    def evaluate() -> float:
        nonlocal held
        if eval_step is None:  # checked above; here for the type checker
            raise ValueError("zjax.train.fit: eval_every needs eval_step.")
        held = eval_batches(eval_data, mesh, config.eval_batches) if held is None else held
        outs = [eval_step(state, plan.shard_batch(b)) for b in held]
        if all(isinstance(out, LossSum) for out in outs):  # the held-out tokens' mean, as the step's loss is
            return float(sum(float(o.sum) for o in outs) / max(sum(float(o.count) for o in outs), 1e-30))
        return float(np.mean([float(out) for out in outs]))

    profile = config.profile_steps
    losses: list[Any] = []  # device scalars, fetched at logged steps: one host sync per log_every steps
    skipped: list[Any] = []
    preempted = False
    t0 = time.perf_counter()
    try:
        for i in report.steps():
            if profile is not None and i == profile[0]:
                jax.profiler.start_trace(str((config.log_dir or Path("runs")) / "profile"))
            state, metrics = step(state, batch)
            if i + 1 < end:
                batch = plan.shard_batch(fetch(i + 1))  # overlaps with the step running asynchronously
            losses.append(metrics["loss"])
            skipped.append(metrics["skipped"])
            if profile is not None and i + 1 == min(profile[1], end):
                jax.block_until_ready(state)
                jax.profiler.stop_trace()
            if ckpt is not None:
                ckpt.maybe_save(state, plan, {"data_position": i + 1})
                if ckpt.preempted:
                    print(f"preempted: saved step {i + 1}, exiting", flush=True)  # on every process
                    end, preempted = i + 1, True
                    break
            due_eval = bool(config.eval_every) and ((i + 1) % config.eval_every == 0 or i == end - 1)
            if (i + 1 - start) % config.log_every and i != end - 1 and not due_eval:
                continue
            report.log(i, metrics, skipped, evaluate if due_eval else None)
    finally:
        report.close()
    elapsed = time.perf_counter() - t0
    if ckpt is not None:
        if end > start and end % config.save_every and not preempted:
            ckpt.save(state, plan, {"data_position": end})  # the last step, always
        ckpt.close()  # waits for the last write
    rate = None if tokens_per_step is None or elapsed <= 0 else tokens_per_step * (end - start) / elapsed
    return FitResult(
        state=state,
        losses=[float(x) for x in jax.device_get(losses)],
        start=start,
        end=end,
        preempted=preempted,
        skipped_steps=int(sum(int(x) for x in jax.device_get(skipped))),
        eval_loss=report.eval_loss,
        mfu=report.mfu,
        tokens_per_second=rate,
        memory=memory,
    )
