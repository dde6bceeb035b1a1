"""The ZeRO paper's per-device model-state bytes (Rajbhandari et al., SC'20, §5, Figure 1)."""

from __future__ import annotations

from ..stages._stage import Stage


def zero_bytes(
    psi: float, n: int, stage: int | str | Stage, *, compute_bytes: int = 2, optimizer_bytes: float = 12
) -> dict[str, float]:
    """Per-device bytes of parameters, gradients and optimizer state for ``psi`` parameters over ``n`` ranks.

    ``optimizer_bytes`` is K in the paper: 12 for mixed-precision Adam (fp32 master, m and v).

    Example:
      >>> zero_bytes(7.5e9, 64, 3)["total"] / 1e9   # the paper's 7.5B model on 64 GPUs: 1.875 GB
    """
    s = Stage.from_value(stage)
    params = psi * compute_bytes / (n if s.shard_parameters else 1)
    grads = psi * compute_bytes / (n if s.shard_gradients else 1)
    optimizer = psi * optimizer_bytes / (n if s.shard_optimizer else 1)
    return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}
