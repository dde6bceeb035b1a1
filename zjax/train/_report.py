"""What a logged step reports: one host-synced record to the metric writers, the progress bar or a line."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import jax

from ..metrics import MetricsWriter
from ._config import LoopConfig

if TYPE_CHECKING:
    from ..core import MemoryReport, Plan


class Reporter:
    """Records of logged steps for :func:`zjax.train.fit`: writers and progress on process 0 only."""

    def __init__(
        self,
        config: LoopConfig,
        plan: Plan,
        start: int,
        end: int,
        memory: MemoryReport | None,
        tokens_per_step: int | None,
        schedule: Callable[[int], Any] | None,
        mfu: Callable[[float], float | None] | None,
        aux_metrics: Callable[[Any], dict[str, Any]] | None,
        run_config: dict[str, Any] | None,
    ):
        from tqdm import tqdm

        self.config, self.start, self.end, self.memory = config, start, end, memory
        self.tokens_per_step, self.schedule, self._mfu, self.aux_metrics = tokens_per_step, schedule, mfu, aux_metrics
        self.main = jax.process_index() == 0
        self.eval_loss: float | None = None
        self.mfu: float | None = None
        quiet = not config.progress or not self.main
        desc = f"zero{plan.stage.level}"
        # on stderr (tqdm's own default): a redirected log keeps the step lines, not the bar's carriage returns
        self.bar = tqdm(range(start, end), desc=desc, disable=quiet, file=sys.stderr)
        self.writer = None
        if config.log_dir is not None:
            wandb = {"project": config.wandb, "config": run_config or {}} if config.wandb else None
            self.writer = MetricsWriter(config.log_dir, tensorboard=config.tensorboard, wandb=wandb)
        self.t_last, self.i_last = time.perf_counter(), start

    def steps(self) -> Iterable[int]:
        """The steps to run, through the progress bar."""
        return self.bar

    def log(self, i: int, metrics: dict[str, Any], skipped: list[Any], evaluate: Callable[[], float] | None) -> None:
        """Fetch step ``i``'s metrics (the interval's one host sync), evaluate if due, write and show them."""
        loss = float(metrics["loss"])
        now = time.perf_counter()
        steps = i + 1 - self.i_last
        record: dict[str, Any] = {"loss": loss, "grad_norm": float(metrics["grad_norm"])}
        if self.schedule is not None:
            record["learning_rate"] = float(self.schedule(i))
        record["loss_scale"] = float(metrics["loss_scale"])
        record["skipped"] = int(sum(int(x) for x in jax.device_get(skipped)))
        record["step_time"] = (now - self.t_last) / steps
        if "fp8_saturated" in metrics:  # fp8 delayed scaling: the tensors this step saturated
            record["fp8_saturated"] = int(metrics["fp8_saturated"])
        rate = None
        if self.tokens_per_step is not None:
            rate = record["tokens_per_second"] = self.tokens_per_step * steps / (now - self.t_last)
        if self._mfu is not None and rate is not None:
            self.mfu = record["mfu"] = self._mfu(rate)
        if self.aux_metrics is not None and "aux" in metrics:
            record |= self.aux_metrics(metrics["aux"])
        stats = jax.local_devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats and self.memory is not None:  # GPUs: the allocator's peak beside the plan's
            record |= {"device_peak_bytes": stats["peak_bytes_in_use"], "planned_peak_bytes": self.memory.peak_bytes}
        evaluated = evaluate is not None
        if evaluate is not None:
            self.eval_loss = record["eval_loss"] = evaluate()
        if self.writer is not None:
            self.writer.write(i + 1, record)
        shown = {"loss": f"{loss:.4f}"} | ({} if rate is None else {"tok_s": f"{rate:,.0f}"})
        self.bar.set_postfix(**shown, scale=record["loss_scale"])
        if not self.config.progress and self.main:
            line = f"step {i:5d}  loss {loss:.4f}" + ("" if rate is None else f"  tokens/s {rate:,.0f}")
            print(line + (f"  eval {self.eval_loss:.4f}" if evaluated else ""), flush=True)  # this step's eval only
        self.t_last, self.i_last = time.perf_counter(), i + 1

    def close(self) -> None:
        self.bar.close()
        if self.writer is not None:
            self.writer.close()
