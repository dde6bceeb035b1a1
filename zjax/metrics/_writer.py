"""Metrics writers: JSON lines built in, TensorBoard (tensorboardX) and Weights & Biases as extras.

Only process 0 writes. ``write(step, metrics)`` takes host numbers (the caller decides when to fetch
device values, so logging every N steps costs one host sync per N steps).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import jax


class MetricsWriter:
    """``MetricsWriter(log_dir, tensorboard=False, wandb=None)``: ``metrics.jsonl`` in ``log_dir`` (one record
    per call, appended and flushed, readable while training), TensorBoard event files with
    ``tensorboard=True`` (``pip install tensorboardX``), a Weights & Biases run with ``wandb={"project": ...}``."""

    def __init__(self, log_dir: str | os.PathLike, *, tensorboard: bool = False, wandb: dict[str, Any] | None = None):
        self.log_dir = os.fspath(log_dir)
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if jax.process_index() != 0:
            return
        # the optional writers first: one that cannot start leaves nothing open and no file behind
        try:
            if tensorboard:
                try:
                    from tensorboardX import SummaryWriter
                except ImportError as e:
                    raise ImportError('MetricsWriter(tensorboard=True) needs: pip install "zjax[tensorboard]".') from e
                self._tb = SummaryWriter(os.path.join(self.log_dir, "tensorboard"))
            if wandb is not None:
                try:
                    import wandb as _wandb
                except ImportError as e:
                    raise ImportError('MetricsWriter(wandb=...) needs: pip install "zjax[wandb]".') from e
                self._wandb = _wandb.init(dir=self.log_dir, **wandb)
            os.makedirs(self.log_dir, exist_ok=True)
            self._jsonl = open(os.path.join(self.log_dir, "metrics.jsonl"), "a")  # noqa: SIM115 (closed in close())
        except BaseException:
            self.close()
            raise

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if self._jsonl is None:
            return
        record = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        numbers = {k: v for k, v in record.items() if isinstance(v, int | float) and k != "step"}
        for key, value in record.items():  # a vector (an MoE's tokens per expert): one scalar per entry
            if isinstance(value, list) and all(isinstance(x, int | float) for x in value):
                numbers |= {f"{key}/{i}": x for i, x in enumerate(value)}
        if self._tb is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _plain(value: Any) -> Any:
    """A JSON value: numbers as Python floats/ints (NaN and infinities as None), arrays as nested lists of them,
    everything else as is."""
    if getattr(value, "ndim", 0) > 0 and hasattr(value, "tolist"):
        value = value.tolist()
    elif hasattr(value, "item"):
        value = value.item()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
