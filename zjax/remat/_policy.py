"""Activation-checkpointing (remat) policies as data.

A policy says, for the tensors a layer produces in its forward pass, which are **saved** for the
backward pass, which are **offloaded** to host memory (``pinned_host``) and brought back, and which
are **recomputed**. Models tag tensors with :func:`jax.ad_checkpoint.checkpoint_name`; the zjax
decoder tags ``qkv_proj``, ``out_proj``, ``mlp_in`` and ``mlp_out``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax

PARTITIONED = "+partitioned"
Kind = Literal["none", "full", "dots", "dots_no_batch", "names", "nested"]
OffloadDst = Literal["pinned_host"]

DECODER_NAMES = ("qkv_proj", "out_proj", "mlp_in", "mlp_out")


@dataclasses.dataclass(frozen=True)
class RematPolicy:
    """One checkpointing policy.

    Attributes:
      name: registry name.
      kind: ``none`` saves everything (no remat); ``full`` saves only the layer input; ``dots`` saves
        every matmul output; ``dots_no_batch`` saves matmuls without batch dimensions (weight-stationary
        projections, not attention scores); ``names`` saves / offloads exactly the named tensors.
      save: names kept on device (``kind="names"``).
      offload: names moved to host memory after the forward pass (``kind="names"``).
      offload_dst: the memory kind offloaded tensors go to. Only ``pinned_host``: in jax 0.10
        ``unpinned_host`` compiles but silently offloads nothing.
      partition: ZeRO-R partitioned activation checkpoints: layer inputs saved for the backward pass
        are stored split over ``tp`` (see :func:`zjax.remat.partition_checkpoint`). Registered as
        ``NAME+partitioned``.
      group: ``kind="nested"`` only: layers per checkpointed group (``None``: the divisor of the layer count
        closest to its square root). Nested checkpointing (Chen et al. 2016, "sqrt(N) memory") saves the
        input of every group only; a group's backward recomputes its layers' inputs, and each layer
        recomputes itself (``full`` within the group): ``L / k + k`` saved layer inputs instead of ``L``, for
        one more forward pass than ``full``. See :func:`zjax.remat.nested_scan`.
    """

    name: str
    kind: Kind
    save: tuple[str, ...] = ()
    offload: tuple[str, ...] = ()
    offload_dst: str = "pinned_host"
    partition: bool = False
    group: int | None = None

    def __post_init__(self) -> None:
        if self.group is not None and (self.kind != "nested" or not isinstance(self.group, int) or self.group < 1):
            raise ValueError(
                f"RematPolicy {self.name!r}: group={self.group!r} needs kind='nested' and a positive int "
                "(layers per checkpointed group)."
            )
        if self.kind not in ("none", "full", "dots", "dots_no_batch", "names", "nested"):
            raise ValueError(f"RematPolicy {self.name!r}: unknown kind {self.kind!r}.")
        if self.offload_dst != "pinned_host":
            raise ValueError(
                f"RematPolicy {self.name!r}: offload_dst={self.offload_dst!r} is not supported: jax 0.10 "
                "silently offloads nothing to 'unpinned_host'. Use 'pinned_host'."
            )
        if (self.save or self.offload) and self.kind != "names":
            raise ValueError(f"RematPolicy {self.name!r}: save/offload names need kind='names', got {self.kind!r}.")
        both = set(self.save) & set(self.offload)
        if both:
            raise ValueError(f"RematPolicy {self.name!r}: {sorted(both)} cannot be both saved and offloaded.")

    @property
    def remat(self) -> bool:
        """Whether the layer is wrapped in ``jax.checkpoint`` at all."""
        return self.kind != "none"

    def jax_policy(self) -> Callable[..., Any] | None:
        """The ``jax.checkpoint`` policy (``None`` for ``kind="none"``: no checkpointing)."""
        cp = jax.checkpoint_policies
        if self.kind == "none":
            return None
        if self.kind in ("full", "nested"):  # nested: each layer within its group is fully recomputed
            return cp.nothing_saveable
        if self.kind == "dots":
            return cp.dots_saveable
        if self.kind == "dots_no_batch":
            return cp.dots_with_no_batch_dims_saveable
        if self.offload:
            return cp.save_and_offload_only_these_names(
                names_which_can_be_saved=list(self.save),
                names_which_can_be_offloaded=list(self.offload),
                offload_src="device",
                offload_dst=self.offload_dst,
            )
        return cp.save_only_these_names(*self.save)

    def group_size(self, layers: int) -> int:
        """Layers per group of a nested policy for a stack of ``layers`` (1 for any other kind).

        Raises:
          ValueError: if an explicit ``group`` does not divide ``layers``.
        """
        if self.kind != "nested":
            return 1
        if self.group is not None:
            if layers % self.group:
                divisors = [d for d in range(1, layers + 1) if layers % d == 0]
                raise ValueError(
                    f"RematPolicy {self.name!r}: group={self.group} does not divide the {layers} layers; use one of "
                    f"{divisors}."
                )
            return self.group
        return min((d for d in range(1, layers + 1) if layers % d == 0), key=lambda d: (abs(d - layers**0.5), d))

    def partitioned(self) -> RematPolicy:
        """This policy with ZeRO-R partitioned checkpoints, named ``NAME+partitioned``."""
        return dataclasses.replace(self, name=f"{self.name}{PARTITIONED}", partition=True)

    @classmethod
    def custom(cls, save: Sequence[str] = (), offload: Sequence[str] = (), *, name: str = "custom") -> RematPolicy:
        """Save the ``save`` names, offload the ``offload`` names, recompute everything else."""
        return cls(name, "names", tuple(save), tuple(offload))

    @classmethod
    def from_str(cls, value: str | RematPolicy) -> RematPolicy:
        """A registered policy by name (or the policy itself).

        Raises:
          ValueError: for an unknown name, listing the registered ones.
        """
        if isinstance(value, RematPolicy):
            return value
        if value not in POLICIES:
            raise ValueError(f"Unknown remat policy {value!r}; valid names are {sorted(POLICIES)}.")
        return POLICIES[value]


_BASE = (
    RematPolicy("none", "none"),
    RematPolicy("full", "full"),
    RematPolicy("dots", "dots"),
    RematPolicy("dots_no_batch", "dots_no_batch"),
    RematPolicy("minimal", "names", save=DECODER_NAMES),
    RematPolicy("save_qkv_proj", "names", save=("qkv_proj",)),
    RematPolicy("save_out_proj", "names", save=("out_proj",)),
    RematPolicy("offload_minimal", "names", offload=DECODER_NAMES),
    RematPolicy("offload_qkv_proj", "names", offload=("qkv_proj",)),
    RematPolicy("nested", "nested"),
)
POLICIES: dict[str, RematPolicy] = {
    p.name: p for p in (*_BASE, *(b.partitioned() for b in _BASE if b.name in ("full", "dots", "minimal")))
}
