"""Ahead-of-time per-device memory and communication for any mesh, on simulated devices."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from .._quiet import GPU_TARGET_NOISE, filtered_stderr, quiet_autotuning
from ..core import Plan
from ..fp8 import check_device
from ..models import Decoder, DecoderConfig, train_functions
from ..offload import Offload
from ..pipeline import Pipeline
from ..sharding._mesh import make_mesh
from ..sharding._rules import Rules
from ..stages import Stage
from ._compile import compiled_here, partitioned_hlo
from ._flops import step_flops
from ._gpu import cost_analysis, cudnn_for_target, gpu_devices
from ._hlo import Communication, count_collectives
from ._models import resolve_model
from ._result import Estimate, Row
from ._targets import GPUS_PER_HOST, get_target
from ._timeline import LINKS, Timeline, timeline


def wire_dtypes(plan: Plan) -> str:
    """What crosses the data axes: ``weights/grads`` at stage 3 (``int8/bf16`` with qwZ, ``int8/int4`` with
    ``"weights+grads:int4"``, ``bf16/float32`` with ``reduce_dtype``), the gradients' dtype at stages 0-2."""
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    name = lambda dtype: short.get(jnp.dtype(dtype).name, jnp.dtype(dtype).name)  # noqa: E731
    compute = name(plan.precision.compute_dtype)
    weights = plan.weights_wire.name if plan.weights_wire is not None else compute
    grads = name(plan.reduce_dtype) if plan.reduce_dtype is not None else compute
    grads = plan.grads_wire.name if plan.grads_wire is not None else grads
    return f"{weights}/{grads}" if plan.stage.shard_parameters else grads


def _check_mesh(mesh: dict[str, int]) -> None:
    unknown = sorted(set(mesh) - {"replica", "dp", "ep", "cp", "tp", "pp"})
    if unknown:
        raise ValueError(f"planner: unknown mesh axes {unknown} in {mesh}; use replica (HSDP), dp, ep, cp, tp and pp.")
    if any(not isinstance(v, int) or v < 1 for v in mesh.values()):
        raise ValueError(f"planner: mesh sizes must be positive ints, got {mesh}.")


def _devices(mesh: dict[str, int], target: str | None) -> list[Any]:
    """The devices to compile for: a GPU target's (deviceless) or this process's simulated CPU devices."""
    _check_mesh(mesh)
    need = math.prod(mesh.values())
    if target is not None:
        return gpu_devices(target, need)
    have = jax.device_count()
    if need > have:
        raise ValueError(
            f"planner: mesh {mesh} needs {need} devices but this process has {have}. Simulate them with "
            f"zjax.simulate_cpu_devices({need}) before jax starts its backend (a fresh "
            "process), or use the `zjax plan` command, which does that for you."
        )
    return jax.devices()[:need]


def estimate_fn(
    init_fn: Callable[[jax.Array], Any],
    loss_fn: Callable[[Any, Any], Any],
    batch: Any,
    *,
    mesh: dict[str, int],
    stages: Sequence[int] = (0, 1, 2, 3),
    precision: str = "bf16",
    tx: optax.GradientTransformation | Callable[[Any], optax.GradientTransformation] | None = None,
    accum: int = 1,
    name: str = "custom",
    remat: str = "-",
    pipeline: Pipeline | None = None,
    target: str | None = None,
    offload: str | Offload = "none",
    rules: Rules | None = None,
    quantized_comm: str | None = None,
    reduce_dtype: str | None = None,
    compute_copy: bool = True,
    hpz: bool = False,
) -> Estimate:
    """Estimate a user's model: ``init_fn``/``loss_fn`` as for :meth:`zjax.Plan.init`, ``batch`` a tree of
    ``ShapeDtypeStruct`` (global shapes). Nothing is allocated; every stage is compiled ahead of time.
    With ``pp`` > 1 in ``mesh`` the model runs through ``pipeline`` (default: 2 x pp microbatches, GPipe).

    ``target`` (``"h100"``, ``"h200"``, ``"b200"``, ``"a100"`` or a ``.txtpb`` path) compiles with XLA:GPU
    for that many GPUs that are not there (``pip install "zjax[plan-gpu]"``); without it, XLA:CPU on
    simulated devices. Every row says which compiler produced it. ``offload`` (``"optimizer"``,
    ``"optimizer+params"``) estimates ZeRO-Offload plans: rows then show device memory, and the host
    bytes and PCIe traffic computed from the placements. ``rules`` (default ``zjax.Rules()``) places
    parameters and activations, e.g. ``Rules(sequence_parallel=False)``. ``quantized_comm``, ``compute_copy`` and
    ``hpz`` (stage 3 rows) and ``reduce_dtype`` are the :class:`zjax.Plan` options of those names. ``tx``: the
    optimizer (default AdamW), or a function of the parameters' shapes that makes it (weight decay's mask, Muon's
    matrices: :meth:`zjax.train.Optim.transformation`)."""
    offload = Offload.from_value(offload)
    devices = _devices(mesh, target)
    device_mesh = make_mesh(
        dp=(mesh.get("replica", 1), mesh.get("dp", 1)),
        tp=mesh.get("tp", 1),
        pp=mesh.get("pp", 1),
        cp=mesh.get("cp", 1),
        ep=mesh.get("ep", 1),
        devices=devices,
    )
    backend = "gpu" if target is not None else "cpu"
    device_kind = str(devices[0].device_kind)
    tx = optax.adamw(1e-4) if tx is None else tx
    if not isinstance(tx, optax.GradientTransformation):  # made from the parameters' shapes
        tx = tx(jax.eval_shape(init_fn, jax.random.key(0)))
    rows, psi = [], 0
    for stage in stages:
        start = time.perf_counter()
        stages_pp = mesh.get("pp", 1)
        schedule = pipeline if pipeline is not None or stages_pp == 1 else Pipeline(2 * stages_pp)
        if schedule is not None and schedule.refusal(Stage.from_value(stage)) is not None:
            schedule = dataclasses.replace(schedule, zero3_gather="step")  # the mode does not run at this stage
        zero3 = Stage.from_value(stage).shard_parameters
        quantize = quantized_comm if zero3 else None  # stage 3's gathers
        plan = Plan(
            device_mesh, stage=stage, precision=precision, pipeline=schedule, offload=offload, rules=rules,
            quantized_comm=quantize, reduce_dtype=reduce_dtype, compute_copy=compute_copy or not zero3,
            hpz=hpz and zero3,
        )  # fmt: skip
        state = plan.abstract_state(init_fn, tx, jax.random.key(0))
        step = plan.train_step(loss_fn, accum_steps=accum)
        if target is not None:  # the scheduled GPU program: async collectives, real reduce-scatters, bf16
            with cudnn_for_target(target), quiet_autotuning():  # cuDNN attention checked against the target
                lowered = step.lower(state, batch)
            with compiled_here(), filtered_stderr(GPU_TARGET_NOISE):  # XLA:GPU's budget check for an absent GPU
                compiled = lowered.compile()
            hlo = compiled.as_text()
        else:  # XLA:CPU: read right after SPMD partitioning (later CPU passes upcast and split collectives)
            compiled, hlo = partitioned_hlo(step.lower(state, batch))
        report = step.memory_report(state, batch, compiled=compiled)
        psi = report.num_params
        fields = _pipeline_fields(plan.pipeline, stages_pp)
        pipe = plan.pipeline
        tab = pipe.table(stages_pp) if pipe is not None and pipe.tabled and fields else None
        share, ends = 0.0, 0.0
        if pipe is not None and tab is not None:  # each action on its share of the ticks, the ends on theirs
            share, ends = pipe.microbatches * pipe.repeats / tab.ticks, 1 / (stages_pp * pipe.repeats)
        comm = count_collectives(hlo, dict(device_mesh.shape), share)  # a table's actions on their share of ticks
        steps = _timeline(hlo, target)
        per_step, per_action = step_flops(hlo, share, ends)
        if tab is not None and per_action:  # the table's ticks weighed by what each action computes
            fields["bubble_time"] = tuple(float(b) for b in tab.bubble_time(per_action))
        elif fields:  # GPipe's scan: every iteration computes alike (its bubbles on zeros), so time is iterations
            fields["bubble_time"] = fields["bubble"]
        cost = cost_analysis(compiled) or {}
        theory = {
            "params": report.theory["params"],
            "optimizer": report.theory["master"] + report.theory["optimizer"],
            "grads": report.theory["gradients"],
        }
        theory["total"] = sum(theory.values())
        compiled_bytes = {
            # device-resident state (XLA:CPU counts host-placed arguments as device ones)
            "state": report.state_compiled - (report.offloaded_bytes if not report.host_bytes else 0),
            "temp": report.temp_bytes,
            "total": report.device_peak_bytes,
            "host": report.host_bytes,  # host_* of memory_analysis (XLA:GPU: the offloaded state; XLA:CPU: 0)
        }
        rows.append(
            Row(
                stage=plan.stage.level,
                remat=remat,
                accum=accum,
                theory=theory,
                compiled=compiled_bytes,
                comm=comm,
                comm_psi=_data_volume(comm, plan.quantizes_grads)
                / (report.params_per_group * plan.precision.compute_bytes)
                if report.params_per_group
                else 0.0,
                compile_seconds=time.perf_counter() - start,
                backend=backend,
                device_kind=device_kind,
                flops=cost.get("flops"),
                bytes_accessed=cost.get("bytes accessed"),
                offload=offload.name,
                offloaded=report.offloaded_bytes,
                device_memory=get_target(target).memory_bytes if target is not None else None,
                mesh={k: int(v) for k, v in device_mesh.shape.items()},
                state_by_group=dict(report.state_by_group),
                wire=wire_dtypes(plan),
                compute_copy=plan.compute_copy,
                hpz=plan.hpz,
                timeline=steps,
                flops_per_step=per_step,
                action_flops=per_action,
                **fields,
            )
        )
    sizes = {k: int(v) for k, v in device_mesh.shape.items()}
    batch_size = int(jax.tree.leaves(batch)[0].shape[0])
    return Estimate(name, psi, sizes, precision, batch_size, tuple(rows), backend, device_kind)


def _timeline(hlo: str, target: Any) -> Timeline | None:
    """A GPU target's roofline walk over the scheduled program (:mod:`zjax.planner._timeline`); ``None`` on
    XLA:CPU or for a target without a peak or links on record."""
    if target is None:
        return None
    gpu = get_target(target)
    links = LINKS.get(gpu.name)
    if links is None or gpu.peak_bf16_flops is None or "memory_bandwidth" not in gpu.text:
        return None
    return timeline(hlo, gpu.peak_bf16_flops, gpu.memory_bandwidth, links, GPUS_PER_HOST, gpu.peak_fp8_flops)


def _pipeline_fields(schedule: Pipeline | None, stages: int) -> dict[str, Any]:
    """The schedule's name, its idle fraction per stage, its ticks and the microbatch inputs each stage keeps
    at most, counted on the table the step runs (the compiled temporaries are one SPMD program's, the busiest
    stage's; what each stage keeps is the schedule's)."""
    if schedule is None or stages == 1:
        return {}
    tab = schedule.table(stages)
    idle = tuple(float(i) / tab.ticks for i in tab.idle())
    kept = tuple(int(n) for n in tab.in_flight())
    return {"schedule": schedule.name, "bubble": idle, "ticks": tab.ticks, "in_flight": kept}


def _data_volume(comm: Communication, quantized_grads: bool = False) -> int:
    """The volume of ZeRO's traffic: collectives over the data-parallel axes (dp, replica and ep, with cp where
    ZeRO's shards span dp x cp); a collective over cp alone is attention's (keys and values), not ZeRO's, and an
    all-to-all is an MoE's token dispatch (over ep) or a reshard, not ZeRO's, except qgZ's (``quantized_grads``:
    the gradients' all-to-alls over dp and replica)."""
    data, zero = {"dp", "replica", "ep"}, {"dp", "replica", "ep", "cp"}
    return sum(
        v - (0 if quantized_grads and set(axes) <= {"dp", "replica"} else comm.all_to_all_by_axes.get(axes, 0))
        for axes, v in comm.by_axes.items()
        if set(axes) & data and set(axes) <= zero
    )


def estimate(
    model: str | DecoderConfig = "small",
    *,
    mesh: dict[str, int],
    stages: Sequence[int] = (0, 1, 2, 3),
    remat: str = "full",
    precision: str = "bf16",
    batch_size: int = 8,
    seq_len: int | None = None,
    accum: int = 1,
    pipeline: Pipeline | None = None,
    target: str | None = None,
    offload: str | Offload = "none",
    rules: Rules | None = None,
    quantized_comm: str | None = None,
    reduce_dtype: str | None = None,
    compute_copy: bool = True,
    hpz: bool = False,
    matmul: str | None = None,
    tx: optax.GradientTransformation | Callable[[Any], optax.GradientTransformation] | None = None,
    moe: dict[str, Any] | None = None,
) -> Estimate:
    """Estimate a decoder preset (``zjax.models.PRESETS``, e.g. ``"llama2-7b"``) or a ``DecoderConfig``
    (``matmul``: the projections' products, :data:`zjax.fp8.MATMULS`; default the model's; ``tx``: the optimizer,
    as for :func:`estimate_fn`; ``moe``: fields of the model's :class:`zjax.models.MoE` to replace, e.g.
    ``{"capacity_factor": 1.25}`` or ``{"dispatch_chunks": 4}``, which size the exchange's receive buffers).

    Example:
      >>> est = zjax.planner.estimate("llama2-7b", mesh={"dp": 64}, batch_size=64, seq_len=2048)
      >>> print(est)
    """
    name, cfg = resolve_model(model)
    cfg = dataclasses.replace(cfg, remat=remat, max_len=seq_len or cfg.max_len, matmul=matmul or cfg.matmul)
    if moe:
        if cfg.moe is None:
            raise ValueError(f"planner: moe={moe} but model {name!r} has no experts.")
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **moe))
    if target is not None:
        gpu = get_target(target)
        check_device(cfg.matmul, gpu.name, gpu.compute_capability, math.prod(mesh.values()))
    init_fn, loss_fn = train_functions(Decoder(cfg), cfg.max_len)
    batch = jax.ShapeDtypeStruct((batch_size, cfg.max_len + 1), jnp.int32)
    return estimate_fn(
        init_fn,
        loss_fn,
        batch,
        mesh=mesh,
        stages=stages,
        precision=precision,
        accum=accum,
        name=name,
        remat=remat,
        pipeline=pipeline,
        target=target,
        offload=offload,
        rules=rules,
        quantized_comm=quantized_comm,
        reduce_dtype=reduce_dtype,
        compute_copy=compute_copy,
        hpz=hpz,
        tx=tx,
    )
