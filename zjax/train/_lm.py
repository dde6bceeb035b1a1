"""The language-model run behind ``zjax train`` (and ``examples/train_lm.py``): a :class:`RunConfig` in, a trained
decoder and its figures out.

The run checks what it can before it starts JAX's backend or compiles (files, extras, the mesh against the devices,
the batch against the data-parallel ranks, accumulation and microbatches), then builds the tokenizer, the decoder,
the data on grain, the plan and the optimizer from the configuration and hands them to :func:`fit`. Without an
accelerator it runs on ``loop.cpu_devices`` simulated CPU devices. The default text is the source of a few modules
of Python's own standard library, read from this interpreter's installation (no downloads).
"""

from __future__ import annotations

import dataclasses
import math
import sysconfig
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .. import data as zdata
from .. import hf as zhf
from .. import metrics
from .._extras import require
from .._jsonfile import write_json_atomic
from ..core import Plan, Variables
from ..fp8 import check_device
from ..models import PRESETS, Decoder, from_hf_config, lm_loss, train_functions
from ..sharding import make_mesh, nvidia_gpu_visible
from ._loop import fit, init_or_restore
from ._run import MESH_AXES, RunConfig, mesh_sizes
from ._runtime import runtime

TEXT_FILES = ("argparse.py", "dataclasses.py", "functools.py", "textwrap.py", "typing.py", "inspect.py",
              "json/decoder.py", "collections/__init__.py")  # fmt: skip
"""The default training documents: standard-library modules of the running interpreter."""


def load_texts() -> list[str]:
    """The default training documents (:data:`TEXT_FILES`)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / name).read_text(encoding="utf-8") for name in TEXT_FILES]


def check(cfg: RunConfig) -> None:
    """What can be checked before JAX starts: files, extras, and the batch against the mesh's data-parallel ranks,
    accumulation and microbatches (the mesh's size against the devices is checked once they are known).

    Raises:
      FileNotFoundError: a data, tokenizer or checkpoint path that does not exist.
      ValueError: a batch that does not split, an output directory that is not empty, a pipeline setting.
      MissingExtra (an ImportError, zjax._extras): an optional package the settings need.
    """
    paths = (("data.path", cfg.data.path), ("data.tokenizer", cfg.data.tokenizer), ("model.hf", cfg.model.hf),
             ("pipeline.table", cfg.pipeline.table))  # fmt: skip
    for name, path in paths:
        if path is not None and not path.exists():
            raise FileNotFoundError(f"{name} = {str(path)!r}: no such file or directory.")
    if cfg.model.matmul != "default" and cfg.plan.precision == "fp16":
        raise ValueError(
            f"model.matmul = {cfg.model.matmul!r} with plan.precision = 'fp16': fp8 products take bf16 or fp32 "
            "operands; use plan.precision=bf16, or model.matmul=default."
        )
    out = cfg.output.save_hf
    if out is not None and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(
            f"output.save_hf = {str(out)!r}: exists and is not an empty directory; use a new or empty one."
        )
    if cfg.model.hf is not None or out is not None:
        require("safetensors", "model.hf and output.save_hf")
    if cfg.data.tokenizer is not None:
        require("tokenizers", "data.tokenizer")
    if cfg.data.path is not None and any(p.suffix == ".parquet" for p in _files(cfg.data.path)):
        require("pyarrow", "data.path's .parquet files")
    if cfg.loop.tensorboard:
        require("tensorboardX", "loop.tensorboard")
    if cfg.loop.wandb:
        require("wandb", "loop.wandb")
    sizes = mesh_sizes(cfg.plan.mesh)
    if not nvidia_gpu_visible():  # the run's devices: its simulated CPU devices, in all its processes
        sizes = check_devices(cfg, cfg.loop.cpu_devices)
    stages, fixed = sizes.get("pp", 1), all(v > 0 for v in sizes.values())
    data = math.prod(sizes.get(a, 1) for a in ("replica", "dp", "ep")) if fixed else None
    pipe = cfg.pipeline.build(stages) if stages > 1 else None
    micro = pipe.microbatches if pipe is not None else 1
    if data is not None:
        split = data * cfg.plan.accum * micro
        if cfg.data.batch_size % split:
            what = f"replica x dp x ep = {data} data-parallel ranks x plan.accum = {cfg.plan.accum}"
            what += f" x {micro} pipeline microbatches" if pipe is not None else ""
            raise ValueError(
                f"data.batch_size = {cfg.data.batch_size} does not split over {what} = {split}; use a multiple of "
                f"{split} (e.g. {split * max(1, round(cfg.data.batch_size / split))})."
            )
    if pipe is not None:
        pipe.check(stages)


def check_devices(cfg: RunConfig, devices: int) -> dict[str, int]:
    """The mesh's sizes with ``-1`` resolved against ``devices``; a mesh that does not fit them is refused."""
    sizes = mesh_sizes(cfg.plan.mesh)
    known = math.prod(v for v in sizes.values() if v > 0)
    free = [a for a, v in sizes.items() if v < 0]
    if free and devices % known == 0:
        sizes[free[0]] = devices // known
    if math.prod(sizes.values()) != devices:
        given = ",".join(f"{a}={v}" for a, v in mesh_sizes(cfg.plan.mesh).items())
        raise ValueError(
            f"plan.mesh = {given!r} needs {math.prod(v for v in sizes.values() if v > 0)} devices, not the "
            f"{devices} this run has; make the sizes multiply to {devices} (or size one axis -1: the rest)."
        )
    return sizes


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def build_data(cfg: RunConfig, model_cfg: Any, tok: Any, log: Callable[..., None]):
    """Training rows and the held-out split (``None`` without ``loop.eval_every``), packed on grain."""
    if cfg.data.path is None:
        end = [tok.eos_id] if tok.eos_id is not None else []
        stream = np.concatenate([np.concatenate([tok.encode(d), end]) for d in load_texts()]).astype(np.int32)
    else:
        stream = zdata.tokenize(cfg.data.path, tok)
    eos = tok.eos_id
    if int(stream.max()) >= model_cfg.vocab:
        if cfg.data.tokenizer is not None:
            raise ValueError(
                f"data.tokenizer: its ids reach {int(stream.max())}, beyond the model's vocabulary {model_cfg.vocab}."
            )
        stream, eos = stream % model_cfg.vocab, None
        log(f"training on byte ids modulo {model_cfg.vocab} (not the checkpoint's tokenizer); documents not separated")
    # held out by data.eval_fraction alone: a run with and without loop.eval_every trains on the same rows
    train, held = zdata.train_eval_split(stream, cfg.data.eval_fraction)
    seq, rows = cfg.model.seq_len, cfg.data.batch_size
    out = zdata.LMData(train, seq, rows, eos_id=eos, seed=cfg.data.seed)
    if not cfg.loop.eval_every:
        return out, None
    return out, zdata.LMData(held, seq, rows, eos_id=eos, shuffle=False)


def build_model(cfg: RunConfig, tok: Any) -> Any:
    """The model's config: a preset sized to the tokenizer and ``model.seq_len``, or a Hugging Face checkpoint's."""
    m = cfg.model
    if m.hf is not None:
        return dataclasses.replace(
            from_hf_config(m.hf, remat=m.remat).cfg,
            matmul=m.matmul,
            bf16_edge_layers=m.bf16_edge_layers,
            dropout=m.dropout,
        )
    vocab = -(-tok.vocab_size // 128) * 128  # padded to a multiple of 128 (it splits over tp)
    return dataclasses.replace(
        PRESETS[m.preset], max_len=m.seq_len, remat=m.remat, vocab=vocab, matmul=m.matmul,
        bf16_edge_layers=m.bf16_edge_layers, dropout=m.dropout,
    )  # fmt: skip


def run_lm(cfg: RunConfig, argv: Sequence[str] | None = None, log: Callable[..., None] | None = None) -> dict[str, Any]:
    """Train as ``cfg`` says; returns the run's figures (what ``output.metrics_json`` holds) and prints a summary.

    Args:
      cfg: the run's settings.
      argv: this command's arguments, for a relaunch as ``loop.processes`` local processes (default: sys.argv).
      log: where progress lines go on process 0 (default ``print``).
    """
    check(cfg)
    started = time.perf_counter()
    with runtime(cfg.loop, argv):  # joins a cluster, launches processes or simulates CPU devices
        sizes = check_devices(cfg, jax.device_count())
        device = jax.devices()[0]  # a GPU's compute capability ("9.0"): MXFP8 needs Blackwell's
        if getattr(device, "compute_capability", None):
            capability = tuple(int(v) for v in str(device.compute_capability).split(".")[:2])
            check_device(cfg.model.matmul, device.device_kind, capability, jax.device_count())  # type: ignore[arg-type]
        say = (log or print) if jax.process_index() == 0 else (lambda *a, **k: None)
        tok = zdata.load_tokenizer(cfg.data.tokenizer)
        model_cfg = build_model(cfg, tok)
        stages, pipeline, p = sizes.get("pp", 1), None, cfg.pipeline
        if stages > 1 or p.microbatches is not None:
            pipeline = p.build(stages)
            chunks = stages * pipeline.repeats
            dense = getattr(model_cfg, "dense_layers", 0)  # DeepSeek's first dense layers: before the first stage
            piped = model_cfg.layers - dense
            if piped % chunks and cfg.model.hf is not None:
                raise ValueError(
                    f"model.hf: {piped} layers{f' after {dense} dense ones' if dense else ''} do not split into "
                    f"pp={stages} x {pipeline.repeats} repeats."
                )
            model_cfg = type(model_cfg)(**{**model_cfg.__dict__, "layers": dense + chunks * -(-piped // chunks)})
        axes: dict[str, Any] = dict(sizes)
        if "replica" in axes:  # HSDP: dp=(replica, shard)
            axes["dp"] = (axes.pop("replica"), axes.get("dp", 1))
        model = Decoder(model_cfg)
        plan = Plan(
            make_mesh(**axes), stage=cfg.plan.stage, precision=cfg.plan.precision, clip_norm=cfg.optim.clip_norm,
            pipeline=pipeline, offload=cfg.plan.offload, reduce_dtype=cfg.plan.reduce_dtype, hpz=cfg.plan.hpz,
            quantized_comm=None if cfg.plan.quantize_comm == "none" else cfg.plan.quantize_comm,
            compute_copy=cfg.plan.compute_copy,
            skip_nonfinite=True if cfg.model.matmul != "default" else None,  # fp8: an inf amax skips the step
        )  # fmt: skip
        loop = cfg.loop
        # the parameters, and the model state the routers' selection biases are (DeepSeek-V3's) threaded through
        init_fn, loss_fn = train_functions(model, cfg.model.seq_len)
        rng = jax.random.key(cfg.data.seed)
        shapes = jax.eval_shape(init_fn, rng)
        tx = cfg.optim.transformation(loop.steps, shapes.params if isinstance(shapes, Variables) else shapes)
        hf_dir = cfg.model.hf
        hf = None if hf_dir is None else (lambda: zhf.load(hf_dir, plan, model, tx, rng))
        state, start = init_or_restore(plan, init_fn, tx, rng, loop, fresh=hf)
        step = plan.train_step(loss_fn, accum_steps=cfg.plan.accum)
        data, held_out = build_data(cfg, model_cfg, tok, say)
        say(f"zjax train: {model_cfg.num_params:,} params, remat {cfg.model.remat!r}, {data.num_rows:,} rows of "
            f"{cfg.model.seq_len + 1} tokens, devices: {jax.devices()[0].platform} x {jax.device_count()} in "
            f"{jax.process_count()} process(es), mesh {dict(plan.mesh.shape)}, "
            f"{cfg.optim.name} with a {cfg.optim.schedule} schedule")  # fmt: skip
        if plan.pipeline is not None:
            pipe = plan.pipeline
            say(f"pipeline: {pipe.name}, {stages} stages x {model_cfg.layers // stages} layers, "
                f"{pipe.microbatches} microbatches, {pipe.repeats} repeat(s): {pipe.table(stages).ticks} ticks, "
                f"bubble {pipe.bubble(stages):.1%}")  # fmt: skip
        first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731 (an MoE: (loss, router metrics))
        # the held-out tokens' mean loss: the eval returns its LossSum (an MoE's with its routers' terms, as trained)
        held_out_loss = (
            (lambda p_, b, model_state: first(lm_loss(model, p_, b, model_state)[0]))
            if isinstance(shapes, Variables)
            else (lambda p_, b: first(lm_loss(model, p_, b)))
        )
        evaluate = None if held_out is None else plan.eval_step(held_out_loss)
        kind, devices = jax.devices()[0].device_kind, jax.device_count()
        result = fit(
            plan, step, state, data, loop, start=start, schedule=cfg.optim.learning_rate(loop.steps),
            eval_step=evaluate, eval_data=held_out, tokens_per_step=cfg.data.batch_size * cfg.model.seq_len,
            mfu=lambda rate: metrics.mfu(rate, model_cfg, cfg.model.seq_len, kind, devices),
            aux_metrics=None if model_cfg.moe is None else router_metrics,
            run_config={"run": cfg.to_toml()},
        )  # fmt: skip
        if cfg.output.save_hf is not None:  # every process takes part; process 0 writes
            zhf.save(cfg.output.save_hf, model, result.state)
        summary = figures(cfg, model_cfg, plan, result)
        if cfg.output.metrics_json is not None and jax.process_index() == 0:
            write_json_atomic(cfg.output.metrics_json, summary)
        say(closing_line(cfg, result, time.perf_counter() - started))
    return summary


def router_metrics(aux: Any) -> dict[str, Any]:
    """A mixture of experts' routers: auxiliary losses, dropped rows, tokens per expert (all layers)."""
    return {k: float(aux[k]) for k in ("ce", "load_balance", "z_loss", "dropped")} | {
        "expert_tokens": np.asarray(aux["expert_tokens"]).sum(axis=0)
    }


def closing_line(cfg: RunConfig, result: Any, seconds: float) -> str:
    """The run's last line: where it ended, its losses, its speed, and what it wrote where."""
    parts = [f"step {result.end}/{cfg.loop.steps}" + (" (preempted)" if result.preempted else "")]
    if result.losses:
        parts.append(f"loss {result.losses[-1]:.4f}")
    if result.eval_loss is not None:
        parts.append(f"eval loss {result.eval_loss:.4f}")
    if result.tokens_per_second:
        parts.append(f"{result.tokens_per_second:,.0f} tokens/s")
    if result.mfu is not None:
        parts.append(f"MFU {result.mfu:.1%}")
    parts.append(f"{seconds:.0f} s")
    wrote = [f"{what} {path}" for what, path in (
        ("checkpoints", cfg.loop.checkpoint_dir), ("logs", cfg.loop.log_dir), ("metrics", cfg.output.metrics_json),
        ("weights", cfg.output.save_hf)) if path is not None]  # fmt: skip
    return "zjax train: " + ", ".join(parts) + ("; wrote " + ", ".join(wrote) if wrote else "")


def figures(cfg: RunConfig, model_cfg: Any, plan: Any, result: Any) -> dict[str, Any]:
    """The run's figures as ``output.metrics_json`` holds them."""
    sizes, pipe, pp = {k: int(v) for k, v in plan.mesh.shape.items()}, plan.pipeline, int(plan.mesh.shape["pp"])
    memory = result.memory
    rate, kind = result.tokens_per_second, jax.devices()[0].device_kind  # MFU as fp8 figures are published too
    mfu_bf16 = None if not rate else metrics.mfu(rate, model_cfg, cfg.model.seq_len, kind, jax.device_count(), True)
    return {
        "stage": cfg.plan.stage, "mesh": {name: sizes[name] for name in MESH_AXES}, "processes": jax.process_count(),
        "pipeline": None if pipe is None else {
            "schedule": pipe.name, "microbatches": pipe.microbatches, "repeats": pipe.repeats,
            "zero3_gather": pipe.zero3_gather, "ticks": pipe.table(pp).ticks, "bubble": pipe.bubble(pp),
        },
        "precision": cfg.plan.precision, "quantize_comm": cfg.plan.quantize_comm, "reduce_dtype": cfg.plan.reduce_dtype,
        "compute_copy": "keep" if cfg.plan.compute_copy else "drop", "hpz": cfg.plan.hpz, "offload": cfg.plan.offload,
        "accum": cfg.plan.accum, "remat": cfg.model.remat, "optimizer": cfg.optim.name,
        "lr_schedule": cfg.optim.schedule,
        "preset": None if cfg.model.hf is not None else cfg.model.preset,
        "hf": None if cfg.model.hf is None else str(cfg.model.hf),
        "num_params": model_cfg.num_params, "active_params": model_cfg.num_active_params, "losses": result.losses,
        "state_bytes_per_device": {"theory": memory.state_theory, "compiled": memory.state_compiled},
        "temp_bytes_per_device": memory.temp_bytes, "memory": memory.to_dict(),
        "tokens_per_second": result.tokens_per_second, "resumed_from": result.start if cfg.loop.resume else None,
        "final_step": int(result.state.step), "skipped_steps": result.skipped_steps, "eval_loss": result.eval_loss,
        "mfu": result.mfu, "mfu_bf16_peak": mfu_bf16, "final_loss_scale": float(result.state.loss_scale.scale),
    }  # fmt: skip
