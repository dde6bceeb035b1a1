"""A plan's settings: the mesh, stage, precision, rules and the options of the step, checked once.

:class:`zjax.Plan` is these settings with the methods that build a state and its steps; the steps read the
settings alone (this class), so they depend on it and not on the plan that makes them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import jax.numpy as jnp
from jax.sharding import Mesh

from ..comm import Wire, parse
from ..offload._config import Offload
from ..pipeline import Pipeline
from ..sharding._axes import CP, DP, EP, MESH_AXES, PP, REPLICA
from ..sharding._mesh import axis_size
from ..sharding._rules import Rules
from ..stages._stage import Stage
from ._loss_scale import DynamicLossScale
from ._precision import Precision


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """The settings of a :class:`zjax.Plan`, normalized and checked (see it for each field)."""

    mesh: Mesh
    stage: Any = 0
    precision: Any = "bf16"
    rules: Rules | None = None
    clip_norm: float | None = None
    loss_scale: DynamicLossScale = DynamicLossScale()
    pipeline: Pipeline | None = None
    reduce_dtype: Any = None
    offload: Any = None
    gpu_overlap: bool = True
    quantized_comm: str | None = None
    compute_copy: bool = True
    hpz: bool = False
    skip_nonfinite: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mesh):
            raise TypeError(f"Plan: mesh must be a jax.sharding.Mesh (zjax.make_mesh), got {type(self.mesh).__name__}.")
        missing = [a for a in (DP,) if a not in self.mesh.shape]
        if missing:
            raise ValueError(
                f"Plan: the mesh {dict(self.mesh.shape)} has no {missing[0]!r} axis; build it with "
                f"zjax.make_mesh (axes {MESH_AXES})."
            )
        if self.pipeline is not None and not isinstance(self.pipeline, Pipeline):
            raise TypeError(
                f"Plan: pipeline must be a zjax.Pipeline(microbatches=...), got {type(self.pipeline).__name__}."
            )
        stages = axis_size(self.mesh, PP)
        if stages > 1 and self.pipeline is None:
            raise ValueError(
                f"Plan: the mesh has {PP}={stages} but no pipeline schedule; pass "
                f"pipeline=zjax.Pipeline(microbatches=M) with M a multiple of {stages} (e.g. {2 * stages}), "
                f"or fold those devices into dp or tp."
            )
        if self.pipeline is not None:
            self.pipeline.check(stages)
        object.__setattr__(self, "stage", Stage.from_value(self.stage))
        object.__setattr__(self, "precision", Precision.from_value(self.precision))
        object.__setattr__(self, "rules", Rules() if self.rules is None else self.rules)
        if not isinstance(self.rules, Rules):
            raise TypeError(f"Plan: rules must be a zjax.Rules, got {type(self.rules).__name__}.")
        if self.reduce_dtype is not None:
            try:
                dtype = jnp.dtype(self.reduce_dtype)
            except TypeError:
                dtype = None
            if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
                raise ValueError(
                    f"Plan: reduce_dtype={self.reduce_dtype!r} must be a float dtype such as 'float32', or None."
                )
            same = dtype == jnp.dtype(self.precision.compute_dtype)
            object.__setattr__(self, "reduce_dtype", None if same else dtype)
        if self.pipeline is not None:  # each rank's whole gradients, reduced once, when reduce_dtype asks
            whole = None if self.reduce_dtype is None else f"reduce_dtype={self.reduce_dtype.name!r}"
            object.__setattr__(self, "pipeline", self.pipeline.for_stage(self.stage, whole_gradients=whole))
        object.__setattr__(self, "offload", Offload.from_value(self.offload))
        cast(Offload, self.offload).check(self.stage)
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"Plan: clip_norm={self.clip_norm} must be > 0 or None.")
        if self.skip_nonfinite is False and self.precision.loss_scaling:
            raise ValueError(
                f"Plan: skip_nonfinite=False with precision={self.precision.name!r}: dynamic loss scaling finds its "
                "scale by skipping the steps whose gradients overflow. Use skip_nonfinite=None (or True)."
            )
        if self.quantized_comm is not None:
            try:
                parse(self.quantized_comm)
            except ValueError as error:
                raise ValueError(f"Plan: {error} Or None: no quantization.") from None
            if not self.stage.shard_parameters:
                raise ValueError(
                    f"Plan: quantized_comm={self.quantized_comm!r} quantizes ZeRO-3's weight gathers and gradient "
                    f"reductions: it needs stage 3 (got stage {self.stage.level}). Use stage=3, or quantized_comm=None."
                )
            per_action = self.pipeline is not None and self.pipeline.tabled and self.pipeline.zero3_gather == "layer"
            if self.pipeline is not None and self.grads_wire is not None and not per_action:
                raise ValueError(
                    f"Plan: quantized_comm={self.quantized_comm!r} under pipeline schedule="
                    f"{self.pipeline.name!r}, zero3_gather={self.pipeline.zero3_gather!r}: its gradients reduce in "
                    "the compute dtype; they reduce quantized in the table schedules' per-layer mode (1f1b, "
                    "interleaved-1f1b or zero-bubble with zero3_gather='layer', their default at stage 3). Use one of "
                    "those, or quantized_comm='weights' (or 'weights:int4'), or None."
                )
        if not isinstance(self.compute_copy, bool):
            raise TypeError(f"Plan: compute_copy must be True or False, got {self.compute_copy!r}.")
        if not self.compute_copy:
            self._check_without_compute_copy()
        if not isinstance(self.hpz, bool):
            raise TypeError(f"Plan: hpz must be True or False, got {self.hpz!r}.")
        if self.hpz:
            self._check_hpz()
        if self.reduces_gradients:
            what = "reduce_dtype" if self.reduce_dtype is not None else "quantized_comm"
            value = self.reduce_dtype.name if self.reduce_dtype is not None else self.quantized_comm
            if cast(Offload, self.offload).enabled:
                raise ValueError(
                    f"Plan: {what}={value!r} at stage 3 differentiates the fp32 master's shards on the device; "
                    f"offload={cast(Offload, self.offload).name!r} keeps them in host memory. Use offload='none', "
                    f"or {what}=None."
                )
            if axis_size(self.mesh, CP) > 1:
                raise ValueError(
                    f"Plan: {what}={value!r} at stage 3 is not supported with {CP}={axis_size(self.mesh, CP)} yet "
                    f"(its weights are split over {CP} too, outside the data axes zjax reduces over); use "
                    f"{what}=None, or fold {CP} into {DP}."
                )

    def _check_without_compute_copy(self) -> None:
        """``compute_copy=False`` casts stage 3's shards before each gather: it needs stage 3 on the device (with or
        without a pipeline: its stages read the cast shards as they would the copy)."""
        problem = (
            f"stage {self.stage.level} (its parameters are not split: the cast would be gathered whole every step)"
            if not self.stage.shard_parameters
            else f"offload={cast(Offload, self.offload).name!r} (the fp32 weights live in host memory)"
            if cast(Offload, self.offload).enabled
            else None
        )
        if problem is not None:
            raise ValueError(
                f"Plan: compute_copy=False keeps only the fp32 weights and casts each shard to "
                f"{jnp.dtype(self.precision.compute_dtype).name} before it is gathered; it is supported at stage 3 "
                f"without offload, not with {problem}. Use stage=3, or compute_copy=True."
            )

    def _check_hpz(self) -> None:
        """hpZ splits stage 3's state over ``replica x dp`` and gathers weights through their node's shard."""
        offload = cast(Offload, self.offload)
        problem = (
            f"stage {self.stage.level} (only stage 3 gathers weights)"
            if not self.stage.shard_parameters
            else f"{REPLICA}={axis_size(self.mesh, REPLICA)} (hpZ keeps a shard per node: the mesh needs replica > 1)"
            if axis_size(self.mesh, REPLICA) < 2
            else f"offload={offload.name!r}"
            if offload.enabled
            else f"{CP}={axis_size(self.mesh, CP)}"
            if axis_size(self.mesh, CP) > 1
            else f"{EP}={axis_size(self.mesh, EP)}"
            if axis_size(self.mesh, EP) > 1
            else None
        )
        if problem is not None:
            raise ValueError(
                f"Plan: hpz=True (ZeRO++'s hierarchical partitioning: stage 3's state split over {REPLICA} x {DP}, "
                f"the per-layer weight gathers inside a node) is supported at stage 3 on a mesh with "
                f"{REPLICA} > 1, without offload, {CP} or {EP}; not with {problem}. "
                f"Use hpz=False (HSDP: state split over {DP} alone)."
            )

    @property
    def keeps_master(self) -> bool:
        """Whether the state holds fp32 master weights beside compute parameters (mixed precision with a
        compute copy); without one (``compute_copy=False``, or fp32) ``state.params`` are the fp32 weights."""
        return self.precision.master_weights and self.compute_copy

    @property
    def casts_params(self) -> bool:
        """Whether the step casts ``state.params`` (the fp32 weights, ``compute_copy=False``) to the compute
        dtype on their shards before the model reads them."""
        return self.precision.master_weights and not self.compute_copy

    @property
    def weights_wire(self) -> Wire | None:
        """How ZeRO-3's weight gathers cross the ZeRO axes quantized (``quantized_comm`` with weights), or ``None``."""
        return parse(self.quantized_comm)[0]

    @property
    def grads_wire(self) -> Wire | None:
        """How gradients cross the data axes quantized (``quantized_comm`` with grads), or ``None``."""
        return parse(self.quantized_comm)[1]

    @property
    def read_wire(self) -> Wire | None:
        """How the weights the model reads through :func:`zjax.comm.gathered` cross the ZeRO axes: ``weights_wire``,
        except with hpZ (its node gathers quantize instead)."""
        return None if self.hpz else self.weights_wire

    @property
    def quantizes_weights(self) -> bool:
        """Whether ZeRO-3's weight gathers cross the ZeRO axes quantized."""
        return self.weights_wire is not None

    @property
    def quantizes_grads(self) -> bool:
        """Whether gradients cross the data axes quantized."""
        return self.grads_wire is not None

    @property
    def reduces_gradients(self) -> bool:
        """Whether the step reduces stage 3's gradients per layer itself (:func:`zjax.core._per_rank.zero3_grads`):
        in ``reduce_dtype``, or quantized. (Under a pipeline ``reduce_dtype`` reduces each rank's whole gradients
        once per step, as at stages 0-2: :func:`zjax.core._per_rank.grads_per_rank`.)"""
        return (
            self.stage.shard_parameters
            and self.pipeline is None
            and (self.reduce_dtype is not None or self.quantizes_grads)
        )
