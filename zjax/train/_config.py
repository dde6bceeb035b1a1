"""How a training run runs: step count, cadences, checkpoints, logging, processes (not what it trains)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path


def _profile_steps(text: str) -> tuple[int, int]:
    first, colon, last = text.partition(":")
    try:
        a, b = int(first), int(last)
    except ValueError:
        a = b = -1
    if not colon or not 0 <= a < b:
        raise argparse.ArgumentTypeError(f"--profile-steps: expected A:B with 0 <= A < B (e.g. 5:8), got {text!r}")
    return a, b


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """The training loop's settings; :func:`add_arguments` makes each field a command-line flag.

    Attributes:
      steps: train until this step (a resumed run continues to the same total).
      log_every: steps between logged records; each costs one host sync.
      eval_every: evaluate every N steps and at the end (0: never).
      eval_batches: batches per evaluation (at most what the held-out data holds).
      checkpoint_dir: save the run here (orbax, asynchronous); ``None``: no checkpoints.
      save_every: steps between checkpoints (the last step is always saved).
      resume: continue from the newest checkpoint in ``checkpoint_dir``.
      preemptible: start ``jax.distributed`` in a one-process run so that SIGTERM saves and exits cleanly.
      stop_at: stop after this step as if preempted (the checkpoint is the last step's).
      progress: a progress bar on process 0; ``False`` prints a line per logged step instead.
      log_dir: write ``metrics.jsonl`` here (and TensorBoard files, profiles).
      tensorboard: also write TensorBoard event files (``pip install "zjax[tensorboard]"``).
      wandb: also log to this Weights & Biases project.
      profile_steps: ``(a, b)``: a ``jax.profiler`` trace of steps ``a .. b-1`` in ``log_dir/profile``.
      compilation_cache: a persistent XLA compilation cache directory (a restarted job reuses its programs).
      cpu_devices: simulated CPU devices in all, when no accelerator is present (split among processes).
      processes: run as this many local processes (one job on 127.0.0.1) when no cluster started the script.

    Example:
      >>> config = zjax.train.LoopConfig(steps=200, eval_every=50, checkpoint_dir="runs/ckpt", resume=True)

    Raises:
      ValueError: a count out of range, or ``resume``/``preemptible`` without ``checkpoint_dir``.
    """

    steps: int = 100
    log_every: int = 10
    eval_every: int = 0
    eval_batches: int = 4
    checkpoint_dir: Path | None = None
    save_every: int = 50
    resume: bool = False
    preemptible: bool = False
    stop_at: int | None = None
    progress: bool = True
    log_dir: Path | None = None
    tensorboard: bool = False
    wandb: str | None = None
    profile_steps: tuple[int, int] | None = None
    compilation_cache: Path | None = None
    cpu_devices: int = 8
    processes: int = 1

    def __post_init__(self) -> None:
        for name, low in (("steps", 0), ("log_every", 1), ("eval_every", 0), ("eval_batches", 1), ("save_every", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"LoopConfig: {name}={value!r} must be an int >= {low}.")
        for name in ("cpu_devices", "processes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LoopConfig: {name}={value!r} must be a positive int.")
        if self.stop_at is not None and self.stop_at < 0:
            raise ValueError(f"LoopConfig: stop_at={self.stop_at} must be >= 0 (or None: run all steps).")
        if self.cpu_devices % self.processes:
            raise ValueError(
                f"LoopConfig: cpu_devices={self.cpu_devices} must divide among processes={self.processes}; "
                "pick a multiple."
            )
        for flag in ("resume", "preemptible"):
            if getattr(self, flag) and self.checkpoint_dir is None:
                raise ValueError(f"LoopConfig: {flag}=True needs checkpoint_dir (where to save and resume).")
        for name in ("checkpoint_dir", "log_dir", "compilation_cache"):  # str from a script or a config file
            value = getattr(self, name)
            if isinstance(value, str | os.PathLike) and not isinstance(value, Path):
                object.__setattr__(self, name, Path(value))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LoopConfig:
        """The fields found in ``args`` (parsed with :func:`add_arguments`'s flags); the others keep defaults."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add :class:`LoopConfig`'s flags (``--steps``, ``--eval-every``, ``--checkpoint-dir``, ...) and ``--config``.

    Args:
      parser: the script's parser, with its own model and data flags.

    Returns:
      ``parser``, for chaining.

    Example:
      >>> parser = zjax.train.add_arguments(argparse.ArgumentParser())
      >>> args, config = zjax.train.parse_args(parser, ["--steps", "20"])
    """
    d = LoopConfig()
    add = parser.add_argument
    add("--config", type=Path, default=None, help="a TOML file of flag values (keys as the flags' names); flags win")
    add("--steps", type=int, default=d.steps)
    add("--eval-every", type=int, default=d.eval_every, help="evaluate on held-out data every N steps and at the end")
    add("--eval-batches", type=int, default=d.eval_batches, help="batches per evaluation (at most the held-out data)")
    add("--log-dir", type=Path, default=None, help="write metrics.jsonl here (and TensorBoard, profiles)")
    add("--log-every", type=int, default=d.log_every, help="steps between logged records (one host sync each)")
    add("--tensorboard", action="store_true", help="also write TensorBoard event files (tensorboardX)")
    add("--wandb", default=None, help="also log to this Weights & Biases project")
    add("--profile-steps", type=_profile_steps, default=None, help="A:B: a jax.profiler trace of steps A..B-1")
    add("--compilation-cache", type=Path, default=None, help="persistent XLA compilation cache directory")
    add("--checkpoint-dir", type=Path, default=None, help="save the run here (orbax, async)")
    add("--save-every", type=int, default=d.save_every, help="steps between checkpoints")
    add("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    add(
        "--preemptible",
        action="store_true",
        help="start jax.distributed (one local process) so that SIGTERM saves a checkpoint and exits cleanly",
    )
    add("--stop-at", type=int, default=None, help="stop after this step (as if preempted)")
    add("--no-progress", dest="progress", action="store_false", help="print a line per logged step, not a bar")
    add("--cpu-devices", type=int, default=d.cpu_devices, help="simulated CPU devices in all (split among processes)")
    add("--processes", type=int, default=d.processes, help="run as N local processes (one job on 127.0.0.1)")
    return parser
