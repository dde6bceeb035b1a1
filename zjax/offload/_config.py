"""``Offload``: which pieces of a training state live in host memory between steps (data, not code)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..stages._stage import Stage

HOST = "pinned_host"  # page-locked host memory: DMA-able, what XLA's host offloading moves to and from
_DEFAULT_CHUNK = 256 * 2**20


@dataclasses.dataclass(frozen=True)
class Offload:
    """Host placement of a training state (ZeRO-Offload).

    Attributes:
      optimizer: the fp32 master weights and every optimizer-state leaf live in ``pinned_host`` memory;
        the step streams them through the device in chunks for the update (stages 1-3).
      params: the compute parameters live in ``pinned_host`` memory too (stage 3, where each device
        holds only its shard); the step brings them to the device for the forward and backward passes.
      chunk_bytes: the most fp32 master bytes per device that one chunk of the update brings to the
        device (a parameter's leading dimension is cut into chunks under this bound, e.g. one layer of
        a stacked decoder; a smaller parameter is one chunk). With Adam the working set of a chunk is
        about 4x this (master, two moments and the gradient), plus the next chunk being fetched.
    """

    optimizer: bool = False
    params: bool = False
    chunk_bytes: int = _DEFAULT_CHUNK

    NAMES = ("none", "optimizer", "optimizer+params")

    @classmethod
    def from_value(cls, value: Any) -> Offload:
        if value is None:
            return cls()
        if isinstance(value, Offload):
            return value
        if isinstance(value, str) and value in cls.NAMES:
            return cls(optimizer=value != "none", params=value == "optimizer+params")
        raise ValueError(
            f"Plan: unknown offload {value!r}; valid names are {list(cls.NAMES)} (or a zjax.Offload(...))."
        )

    def __post_init__(self) -> None:
        if self.params and not self.optimizer:
            raise ValueError("Offload(params=True) needs optimizer=True: the parameters are updated from host state.")
        if not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 1:
            raise ValueError(f"Offload: chunk_bytes={self.chunk_bytes!r} must be a positive int.")

    @property
    def enabled(self) -> bool:
        return self.optimizer

    @property
    def name(self) -> str:
        return "optimizer+params" if self.params else "optimizer" if self.optimizer else "none"

    def check(self, stage: Stage) -> None:
        """Raise ``ValueError`` for a combination that would not save memory or cannot run."""
        if self.optimizer and stage.level == 0:
            raise ValueError(
                "Plan: offload needs stage >= 1: at stage 0 every dp rank keeps the whole optimizer state, so "
                "offloading it puts one full copy per GPU in host memory. Use stage=1 (or higher) with offload."
            )
        if self.params and not stage.shard_parameters:
            raise ValueError(
                f"Plan: offload='optimizer+params' keeps each device's shard of the compute parameters in host "
                f"memory, which exists at stage 3 only (stage={stage.level} keeps them whole on every device). "
                f"Use stage=3, or offload='optimizer'."
            )
