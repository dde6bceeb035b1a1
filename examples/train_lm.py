"""Train a byte-level decoder LM with a ZeRO stage of your choice.

    python examples/train_lm.py --stage 3 --mesh dp=8 --steps 50
    python examples/train_lm.py --stage 2 --mesh dp=4,tp=2 --precision fp16 --accum 4
    python examples/train_lm.py --stage 3 --mesh replica=2,dp=4 --processes 2   # HSDP, 2 processes x 4 devices
    python examples/train_lm.py --stage 1 --mesh dp=2,pp=4 --microbatches 8 --repeats 2   # circular pipeline
    python examples/train_lm.py --hf ckpt_dir --stage 3 --save-hf out_dir   # continue a Hugging Face checkpoint

Started by a cluster (srun, mpirun, a Kubernetes Indexed Job, ZJAX_* variables) it joins that job; with
--processes N and no cluster it launches N local processes itself. With no accelerator the example runs
on 8 simulated CPU devices. The text is the source of a few
modules of Python's own standard library, read from this interpreter's installation (no downloads).
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
import time
from pathlib import Path

TEXT_FILES = (
    "argparse.py",
    "dataclasses.py",
    "functools.py",
    "textwrap.py",
    "typing.py",
    "inspect.py",
    "json/decoder.py",
    "collections/__init__.py",
)


def load_texts() -> list[str]:
    """The default training documents: a fixed list of standard-library source files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / name).read_text(encoding="utf-8") for name in TEXT_FILES]


def build_data(args, cfg, tok, pipelined: bool, log):
    """Training rows and the held-out split (``None`` without ``--eval-every``), packed on grain."""
    import numpy as np

    import zjax

    if args.data is None:
        parts = [np.concatenate([tok.encode(d), [tok.eos_id] if tok.eos_id is not None else []]) for d in load_texts()]
        stream = np.concatenate(parts).astype(np.int32)
    else:
        stream = zjax.data.tokenize(args.data, tok)
    eos = tok.eos_id
    if int(stream.max()) >= cfg.vocab:
        if args.tokenizer is not None:
            raise SystemExit(
                f"--tokenizer: its ids reach {int(stream.max())}, beyond the model's vocabulary {cfg.vocab}"
            )
        stream, eos = stream % cfg.vocab, None
        log(f"training on byte ids modulo {cfg.vocab} (not the checkpoint's tokenizer); documents not separated")
    if pipelined and eos is not None:
        eos = None  # the pipeline takes unpacked rows (segment ids need pp=1)
        log("pipeline: packed documents are not separated (segment ids are supported with pp=1)")
    # held out by --eval-fraction alone: a run with and without --eval-every trains on the same rows
    train, held = zjax.data.train_eval_split(stream, args.eval_fraction)
    data = zjax.data.LMData(train, args.seq_len, args.batch_size, eos_id=eos, seed=args.seed)
    if not args.eval_every:
        return data, None
    return data, zjax.data.LMData(held, args.seq_len, args.batch_size, eos_id=eos, shuffle=False)


def parse_mesh(text: str) -> dict[str, int]:
    sizes = {}
    for part in filter(None, text.replace(" ", "").split(",")):
        name, eq, value = part.partition("=")
        if not eq or name not in ("replica", "dp", "ep", "cp", "tp", "pp"):
            raise argparse.ArgumentTypeError(f"--mesh: expected entries like dp=4,tp=2 or replica=2,dp=4, got {part!r}")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--mesh: {name}={value!r} is not an int") from None
    return sizes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=3)
    p.add_argument(
        "--mesh",
        type=parse_mesh,
        default={"dp": -1},
        help="e.g. dp=8, dp=4,tp=2, dp=2,cp=4 (each sequence split over 4 devices), dp=2,ep=4 (experts split "
        "over 4 devices; --preset moe-small), or replica=2,dp=4 for HSDP (shard over dp, replicate over replica); "
        "default dp=all",
    )
    p.add_argument("--preset", default="small", help="model size: tiny, small, medium, moe-small (8 experts, top-2)")
    p.add_argument(
        "--hf",
        type=Path,
        default=None,
        help="continue training this Hugging Face checkpoint (Llama/Mistral/Qwen2 config.json + safetensors) "
        "instead of --preset; its token ids are the text's bytes modulo the vocabulary (not its tokenizer)",
    )
    p.add_argument("--save-hf", type=Path, default=None, help="write the trained weights as a Hugging Face checkpoint")
    p.add_argument(
        "--data",
        type=Path,
        default=None,
        help="train on these local files (text, .jsonl, .parquet, a directory, or pre-tokenized .npy); default: "
        "the source of a few standard-library modules",
    )
    p.add_argument(
        "--tokenizer", type=Path, default=None, help="tokenizer.json or a directory holding one (default: bytes)"
    )
    p.add_argument(
        "--eval-every", type=int, default=0, help="evaluate on the held-out split every N steps and at the end"
    )
    p.add_argument(
        "--eval-fraction", type=float, default=0.05, help="share of the token stream held out for evaluation"
    )
    p.add_argument("--eval-batches", type=int, default=4, help="batches per evaluation (at most the held-out split)")
    p.add_argument("--log-dir", type=Path, default=None, help="write metrics.jsonl here (and TensorBoard, profiles)")
    p.add_argument("--log-every", type=int, default=10, help="steps between logged records (one host sync each)")
    p.add_argument("--tensorboard", action="store_true", help="also write TensorBoard event files (tensorboardX)")
    p.add_argument("--wandb", default=None, help="also log to this Weights & Biases project")
    p.add_argument("--profile-steps", default=None, help="A:B: write a jax.profiler trace of steps A..B-1 to --log-dir")
    p.add_argument("--compilation-cache", type=Path, default=None, help="persistent XLA compilation cache directory")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32, help="global batch (sequences per step)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="bf16")
    p.add_argument("--remat", default="full", help="activation checkpointing policy (zjax.remat.POLICIES)")
    p.add_argument("--accum", type=int, default=1, help="gradient-accumulation microbatches per step")
    p.add_argument(
        "--offload",
        choices=("none", "optimizer", "optimizer+params"),  # zjax.Offload.NAMES
        default="none",
        help="ZeRO-Offload: optimizer state (and at stage 3 the parameters) in pinned host memory",
    )
    p.add_argument(
        "--quantize-comm",
        choices=("none", "weights", "grads", "weights+grads"),  # zjax.comm.QUANTIZED_COMM
        default="none",
        help="stage 3: gather weights (qwZ) and/or reduce gradients (qgZ) over dp as int8 blocks (ZeRO++)",
    )
    p.add_argument("--reduce-dtype", default=None, help="reduce gradients over dp in this dtype (e.g. float32)")
    p.add_argument(
        "--microbatches", type=int, default=None, help="pipeline microbatches per step (pp > 1; default 2 x pp)"
    )
    p.add_argument("--repeats", type=int, default=1, help="pipeline repeats: chunks of layers per stage")
    p.add_argument(
        "--schedule",
        choices=("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"),  # zjax.pipeline.SCHEDULES
        default="gpipe",
        help="pipeline schedule (repeats > 1: gpipe is circular; interleaved-1f1b needs repeats > 1)",
    )
    p.add_argument(
        "--zero3-gather",
        choices=("step", "layer", "chunk"),  # zjax.pipeline.GATHER_MODES (parsed before jax starts)
        default=None,
        help="pipeline at stages 2-3: weights and gradients whole once per step, or split over dp through the loop "
        "(per use, lean; the default at stages 2-3), or gathered per repeat's chunk (stage 3: ZeRO-3's 3 psi)",
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--optimizer",
        choices=("adamw", "fused_adamw"),
        default="adamw",
        help="optax.adamw, or zjax.pallas.fused_adamw (one-pass update; Pallas kernel on GPU)",
    )
    p.add_argument("--clip-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-devices", type=int, default=8, help="simulated CPU devices in all (split among --processes)")
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        help="run as this many processes on this machine (one multi-process job on 127.0.0.1)",
    )
    p.add_argument("--metrics-json", type=Path, default=None, help="write losses and memory figures here")
    p.add_argument("--checkpoint-dir", type=Path, default=None, help="save the run here (orbax, async)")
    p.add_argument("--save-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    p.add_argument(
        "--preemptible",
        action="store_true",
        help="start jax.distributed (one local process) so that SIGTERM saves a checkpoint and exits cleanly",
    )
    p.add_argument("--stop-at", type=int, default=None, help="stop after this step (as if preempted)")
    p.add_argument("--no-progress", action="store_true", help="print a line per 10 steps instead of a bar")
    return p


def _quiet(*args, **kwargs) -> None:
    pass


def _relaunch(argv: list[str], processes: int, cpu_devices: int) -> int:
    """Run this script as ``processes`` processes (zjax.distributed.launch) and return their status."""
    import os

    from zjax.distributed import launch

    if cpu_devices % processes:
        raise SystemExit(f"--cpu-devices {cpu_devices} must divide among --processes {processes}")
    os.environ["ZJAX_EXAMPLE_CHILD"] = "1"
    return launch([sys.executable, __file__, *argv], processes, cpu_devices=cpu_devices // processes)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    import os

    import jax

    import zjax

    # A job started by a cluster (srun, mpirun, a Kubernetes Indexed Job, ZJAX_* variables) is joined as it
    # is; --processes N relaunches this script locally only when no cluster is detected.
    cluster = zjax.distributed.detect(os.environ)
    if args.processes > 1 and cluster.num_processes == 1 and not os.environ.get("ZJAX_EXAMPLE_CHILD"):
        raise SystemExit(_relaunch(argv, args.processes, args.cpu_devices))
    if cluster.num_processes > 1:  # join the job first, before anything starts a backend
        if args.cpu_devices % cluster.num_processes:
            raise SystemExit(f"--cpu-devices {args.cpu_devices} must divide among {cluster.num_processes} processes")
        # simulated CPU devices per process (a GPU job drives its GPUs; this only sizes the CPU backend)
        per_process = None if os.environ.get("ZJAX_CPU_DEVICES") else args.cpu_devices // cluster.num_processes
        joined = zjax.distributed.initialize(cpu_devices=per_process)
        print(
            f"joined a {joined.num_processes}-process job ({joined.source}) as process {joined.process_id}",
            flush=True,
        )
    else:
        zjax.simulate_cpu_devices(args.cpu_devices)  # before the backend starts; threads for its collectives
    if args.compilation_cache is not None:  # a resumed job reuses its compiled steps
        jax.config.update("jax_compilation_cache_dir", str(args.compilation_cache))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # every step, however fast it compiled
    if args.preemptible and cluster.num_processes == 1:
        if args.checkpoint_dir is None:
            raise SystemExit("--preemptible needs --checkpoint-dir")
        port = zjax.distributed.free_port()  # the coordinator of a one-process job
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=1, process_id=0)

    import jax.numpy as jnp
    import numpy as np
    import optax
    from tqdm import tqdm

    from zjax.models import PRESETS, Decoder, from_hf_config, lm_loss
    from zjax.remat import POLICIES

    if args.remat not in POLICIES:
        raise SystemExit(f"--remat {args.remat!r}: choose one of {sorted(POLICIES)}")
    if (
        args.save_hf is not None
        and args.save_hf.exists()
        and not (args.save_hf.is_dir() and not any(args.save_hf.iterdir()))
    ):
        raise SystemExit(f"--save-hf {args.save_hf}: exists and is not an empty directory; pick a new or empty one")
    tok = zjax.data.load_tokenizer(args.tokenizer)
    if args.hf is not None:
        cfg = from_hf_config(args.hf, remat=args.remat).cfg
    elif args.preset not in PRESETS:
        raise SystemExit(f"--preset {args.preset!r}: choose one of {sorted(PRESETS)}")
    else:
        # the preset takes the tokenizer's vocabulary, padded to a multiple of 128 (it splits over tp)
        vocab = -(-tok.vocab_size // 128) * 128
        cfg = type(PRESETS[args.preset])(
            **{**PRESETS[args.preset].__dict__, "max_len": args.seq_len, "remat": args.remat, "vocab": vocab}
        )
    model = Decoder(cfg)

    sizes = dict(args.mesh)
    if "replica" in sizes:
        sizes["dp"] = (sizes.pop("replica"), sizes.get("dp", -1))
    mesh = zjax.make_mesh(**sizes)
    main_process = jax.process_index() == 0
    if args.preemptible and jax.process_count() > 1 and args.checkpoint_dir is None:
        raise SystemExit("--preemptible needs --checkpoint-dir")
    stages = int(mesh.shape["pp"])
    pipeline = None
    if stages > 1 or args.microbatches is not None:
        pipeline = zjax.Pipeline(
            args.microbatches or 2 * stages,
            repeats=args.repeats,
            zero3_gather=args.zero3_gather,
            schedule=args.schedule,
        )
        if cfg.layers % (stages * args.repeats) and args.hf is not None:
            raise SystemExit(f"--hf: {cfg.layers} layers do not split into pp={stages} x --repeats {args.repeats}")
        if cfg.layers % (stages * args.repeats):  # deepen the preset so that every stage gets whole layers
            cfg = type(cfg)(
                **{**cfg.__dict__, "layers": stages * args.repeats * -(-cfg.layers // (stages * args.repeats))}
            )
            model = Decoder(cfg)
    plan = zjax.Plan(
        mesh, stage=args.stage, precision=args.precision, clip_norm=args.clip_norm, pipeline=pipeline,
        offload=args.offload, quantized_comm=None if args.quantize_comm == "none" else args.quantize_comm,
        reduce_dtype=args.reduce_dtype,
    )  # fmt: skip
    pipeline = plan.pipeline  # with its gathering mode settled for the stage
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(1, args.steps // 10), max(2, args.steps))
    if args.optimizer == "fused_adamw":
        tx = zjax.pallas.fused_adamw(schedule, b2=0.95, weight_decay=0.1)
    else:
        tx = optax.adamw(schedule, b2=0.95, weight_decay=0.1)
    dummy = jnp.zeros((1, args.seq_len), jnp.int32)
    if args.resume and args.checkpoint_dir is None:
        raise SystemExit("--resume needs --checkpoint-dir")
    init_fn = lambda r: model.init(r, dummy)["params"]  # noqa: E731
    ckpt = zjax.Checkpointer(args.checkpoint_dir, save_every=args.save_every) if args.checkpoint_dir else None
    start = 0
    if ckpt is not None and args.resume and (args.hf is None or ckpt.steps()):
        state, meta = ckpt.restore_or_init(plan, init_fn, tx, jax.random.key(args.seed))
        start = int(meta["user"]["data_position"]) if meta else 0
        if meta:
            print(f"resumed from step {meta['step']} (saved at stage {meta['stage']}, mesh {meta['mesh']})")
    elif args.hf is not None:  # the fp32 master weights are the checkpoint's; each process reads its slices
        state = zjax.hf.load(args.hf, plan, model, tx, jax.random.key(args.seed))
    else:
        state = plan.init(init_fn, tx, jax.random.key(args.seed))
    step = plan.train_step(lambda params, batch: lm_loss(model, params, batch), accum_steps=args.accum)

    data, held_out = build_data(args, cfg, tok, pipeline is not None, log=print if jax.process_index() == 0 else _quiet)
    batch = plan.shard_batch(data.batch(start, mesh))  # each process reads only its own rows
    report = step.memory_report(state, batch)
    sizes = {k: int(v) for k, v in mesh.shape.items()}
    log = print if main_process else (lambda *a, **k: None)
    log(
        f"zjax example: remat policy {args.remat!r}, {cfg.num_params:,} params, {data.num_rows:,} rows of "
        f"{args.seq_len + 1} tokens, "
        f"devices: {jax.devices()[0].platform} x {jax.device_count()} in {jax.process_count()} process(es), "
        f"mesh {sizes}"
    )
    log(report)
    if pipeline is not None:
        log(
            f"pipeline: {pipeline.schedule}, {stages} stages x {cfg.layers // stages} layers, "
            f"{pipeline.microbatches} microbatches, {pipeline.repeats} repeat(s): {pipeline.table(stages).ticks} "
            f"ticks, bubble {pipeline.bubble(stages):.1%}"
        )

    losses: list = []  # device scalars, fetched at logged steps: one host sync per --log-every steps
    skipped_flags: list = []
    tokens_per_step = args.batch_size * args.seq_len
    end = args.steps if args.stop_at is None else min(args.steps, args.stop_at)
    quiet = args.no_progress or not main_process
    bar = tqdm(range(start, end), desc=f"zero{args.stage}", disable=quiet, file=sys.stdout)

    def eval_loss(params, b):
        out = lm_loss(model, params, b)
        return out[0] if isinstance(out, tuple) else out  # a mixture of experts: (loss, router metrics)

    evaluate = plan.eval_step(eval_loss) if held_out is not None else None
    writer = None
    if args.log_dir is not None:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}  # JSON-able run config
        wandb = {"project": args.wandb, "config": config} if args.wandb else None
        writer = zjax.metrics.MetricsWriter(args.log_dir, tensorboard=args.tensorboard, wandb=wandb)
    profile = None
    if args.profile_steps:
        a, b = (int(x) for x in args.profile_steps.split(":"))
        profile = (a, b)
    device_kind, eval_loss, mfu = jax.devices()[0].device_kind, None, None

    def run_eval() -> float:
        batches = [b for b, _ in zip(held_out.epoch_batches(mesh), range(args.eval_batches), strict=False)]
        if not batches:
            raise SystemExit(f"--eval-every: the held-out split has fewer than {args.batch_size} rows")
        return float(np.mean([float(evaluate(state, plan.shard_batch(b))) for b in batches]))  # type: ignore[misc]

    t0 = time.perf_counter()
    t_last, i_last = t0, start
    for i in bar:
        if profile is not None and i == profile[0]:
            jax.profiler.start_trace(str((args.log_dir or Path("runs")) / "profile"))
        state, metrics = step(state, batch)
        if i + 1 < end:
            batch = plan.shard_batch(data.batch(i + 1, mesh))  # overlaps with the step running asynchronously
        losses.append(metrics["loss"])
        skipped_flags.append(metrics["skipped"])
        if profile is not None and i + 1 == min(profile[1], end):
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
        if ckpt is not None:
            ckpt.maybe_save(state, plan, {"data_position": i + 1})
            if ckpt.preempted:
                print(f"preempted: saved step {i + 1}, exiting", flush=True)  # on every process
                end = i + 1
                break
        due_eval = evaluate is not None and ((i + 1) % args.eval_every == 0 or i == end - 1)
        if (i + 1 - start) % args.log_every and i != end - 1 and not due_eval:
            continue
        loss = float(metrics["loss"])  # the host sync of this interval
        now = time.perf_counter()
        rate = tokens_per_step * (i + 1 - i_last) / (now - t_last)
        mfu = zjax.metrics.mfu(rate, cfg, args.seq_len, device_kind, jax.device_count())
        record = {
            "loss": loss,
            "grad_norm": float(metrics["grad_norm"]),
            "learning_rate": float(schedule(i)),
            "loss_scale": float(metrics["loss_scale"]),
            "skipped": int(sum(int(x) for x in jax.device_get(skipped_flags))),
            "step_time": (now - t_last) / (i + 1 - i_last),
            "tokens_per_second": rate,
            "mfu": mfu,
        }
        if cfg.moe is not None:  # the routers: auxiliary losses, dropped rows, tokens per expert (all layers)
            aux = metrics["aux"]
            record |= {k: float(aux[k]) for k in ("ce", "load_balance", "z_loss", "dropped")}
            record["expert_tokens"] = np.asarray(aux["expert_tokens"]).sum(axis=0)
        stats = jax.local_devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats:  # GPUs: the allocator's peak beside the plan's
            record |= {"device_peak_bytes": stats["peak_bytes_in_use"], "planned_peak_bytes": report.peak_bytes}
        if due_eval:
            eval_loss = record["eval_loss"] = run_eval()
        if writer is not None:
            writer.write(i + 1, record)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{rate:,.0f}", scale=record["loss_scale"])
        if args.no_progress:
            log(
                f"step {i:5d}  loss {loss:.4f}  tokens/s {rate:,.0f}"
                + ("" if eval_loss is None else f"  eval {eval_loss:.4f}")
            )
        t_last, i_last = time.perf_counter(), i + 1
    if writer is not None:
        writer.close()
    losses = [float(x) for x in jax.device_get(losses)]
    skipped = int(sum(int(x) for x in jax.device_get(skipped_flags)))
    elapsed = time.perf_counter() - t0
    if ckpt is not None:
        if end > start and end % args.save_every and not ckpt.preempted:
            ckpt.save(state, plan, {"data_position": end})  # the last step, always
        ckpt.close()  # waits for the last write

    if args.save_hf is not None:  # every process takes part; process 0 writes
        zjax.hf.save(args.save_hf, model, state)
        log(f"Hugging Face checkpoint written to {args.save_hf}")

    result = {
        "stage": args.stage,
        "mesh": {name: sizes[name] for name in ("replica", "dp", "ep", "cp", "tp", "pp")},
        "processes": jax.process_count(),
        "pipeline": None
        if pipeline is None
        else {
            "schedule": pipeline.schedule,
            "microbatches": pipeline.microbatches,
            "repeats": pipeline.repeats,
            "zero3_gather": pipeline.zero3_gather,
            "ticks": pipeline.table(stages).ticks,
            "bubble": pipeline.bubble(stages),
        },
        "precision": args.precision,
        "quantize_comm": args.quantize_comm,
        "reduce_dtype": args.reduce_dtype,
        "offload": args.offload,
        "accum": args.accum,
        "remat": args.remat,
        "optimizer": args.optimizer,
        "preset": None if args.hf is not None else args.preset,
        "hf": None if args.hf is None else str(args.hf),
        "num_params": cfg.num_params,
        "active_params": cfg.num_active_params,
        "losses": losses,
        "state_bytes_per_device": {"theory": report.state_theory, "compiled": report.state_compiled},
        "temp_bytes_per_device": report.temp_bytes,
        "memory": report.to_dict(),
        "tokens_per_second": tokens_per_step * (end - start) / elapsed if elapsed > 0 else None,
        "resumed_from": start if args.resume else None,
        "final_step": int(state.step),
        "skipped_steps": skipped,
        "eval_loss": eval_loss,
        "mfu": mfu,
        "final_loss_scale": float(state.loss_scale.scale),
    }
    if args.metrics_json is not None and main_process:
        zjax.write_json_atomic(args.metrics_json, result)
        log(f"metrics written to {args.metrics_json}")
    if args.preemptible or jax.process_count() > 1:
        jax.distributed.shutdown()
    return result


if __name__ == "__main__":
    main()
