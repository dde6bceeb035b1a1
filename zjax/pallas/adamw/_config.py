"""Block sizes and launch parameters of the fused AdamW kernel (data, not code)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class FusedAdamWConfig:
    """Launch configuration.

    Attributes:
      block_size: elements per program (a power of two). Each program reads grad, master, m, v and
        writes master, m, v and the compute copy of ``block_size`` elements once.
      num_warps: Triton warps per program.
      num_stages: Triton pipeline stages.
      group_bytes: leaves smaller than this (in fp32 master bytes) are concatenated into one buffer per
        launch (ZeRO-R's constant-size buffers): few launches for models with many small leaves.
    """

    block_size: int = 1024
    num_warps: int = 4
    num_stages: int = 1
    group_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"FusedAdamWConfig: block_size={self.block_size} must be a power of two >= 16.")
        if self.num_warps < 1 or self.num_stages < 1:
            raise ValueError("FusedAdamWConfig: num_warps and num_stages must be >= 1.")
