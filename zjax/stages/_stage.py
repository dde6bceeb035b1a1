"""The ZeRO stages as data.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (SC'20), §5:
stage 1 (P_os) partitions the optimizer states over the N data-parallel ranks, stage 2 (P_os+g) the
gradients too, stage 3 (P_os+g+p) the parameters too. Per device, with psi parameters, bf16 compute
copies and fp32 Adam (master, m, v: K = 12 bytes/param):

    stage 0: 2psi + 2psi + 12psi        stage 2: 2psi + (2 + 12)psi / N
    stage 1: 2psi + 2psi + 12psi / N    stage 3: (2 + 2 + 12)psi / N

A stage is nothing more than which of the three state kinds carry the ``dp`` axis in their
``PartitionSpec``; XLA derives the collectives (all-reduce, reduce-scatter, all-gather) from that.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Stage:
    """One ZeRO stage: which persistent/transient state is sharded over the data-parallel axis."""

    level: int
    name: str
    shard_optimizer: bool  # fp32 master weights and optimizer moments
    shard_gradients: bool  # gradients (and their accumulation buffer)
    shard_parameters: bool  # compute (bf16/fp16/fp32) parameters, gathered per use
    description: str

    @classmethod
    def from_value(cls, value: Any) -> Stage:
        """A stage from its level (``0``-``3``), name (``"zero3"``, ``"3"``) or itself.

        Raises:
          ValueError: for an unknown stage, listing the valid ones.
        """
        if isinstance(value, Stage):
            return value
        key = value
        if isinstance(value, str):
            text = value.strip().lower()
            for prefix in ("zero-", "zero_", "zero", "stage"):
                text = text.removeprefix(prefix)
            key = int(text) if text.isdigit() else value
        if isinstance(key, bool) or key not in STAGES:
            raise ValueError(
                f"Unknown ZeRO stage {value!r}; valid stages are {sorted(STAGES)} "
                f"(names: {[s.name for s in STAGES.values()]})."
            )
        return STAGES[key]


STAGES: dict[int, Stage] = {
    s.level: s
    for s in (
        Stage(0, "zero0", False, False, False, "plain data parallel: everything replicated"),
        Stage(1, "zero1", True, False, False, "optimizer state (fp32 master + moments) sharded over dp"),
        Stage(2, "zero2", True, True, False, "optimizer state and gradients sharded over dp"),
        Stage(3, "zero3", True, True, True, "optimizer state, gradients and parameters sharded over dp"),
    )
}
