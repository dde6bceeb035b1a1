"""Train a byte-level decoder LM with a ZeRO stage of your choice.

    python examples/train_lm.py --stage 3 --mesh dp=8 --steps 50
    python examples/train_lm.py --config examples/configs/small.toml --steps 20   # a run file; flags win
    python examples/train_lm.py --stage 2 --mesh dp=4,tp=2 --precision fp16 --accum 4
    python examples/train_lm.py --stage 3 --mesh replica=2,dp=4 --processes 2   # HSDP, 2 processes x 4 devices
    python examples/train_lm.py --stage 1 --mesh dp=2,pp=4 --microbatches 8 --repeats 2   # circular pipeline
    python examples/train_lm.py --hf ckpt_dir --stage 3 --save-hf out_dir   # continue a Hugging Face checkpoint

The model, data and plan are built here; the loop (accumulation, evaluation and checkpoint cadences,
preemption, metrics, progress, joining a cluster or launching --processes) is zjax.train's. With no
accelerator it runs on 8 simulated CPU devices. The text is the source of a few modules of Python's own
standard library, read from this interpreter's installation (no downloads).
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import zjax
import zjax.train

TEXT_FILES = ("argparse.py", "dataclasses.py", "functools.py", "textwrap.py", "typing.py", "inspect.py",
              "json/decoder.py", "collections/__init__.py")  # fmt: skip
MESH_AXES = ("replica", "dp", "ep", "cp", "tp", "pp")


def load_texts() -> list[str]:
    """The default training documents: a fixed list of standard-library source files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / name).read_text(encoding="utf-8") for name in TEXT_FILES]


def build_data(args, cfg, tok, pipelined: bool, log):
    """Training rows and the held-out split (``None`` without ``--eval-every``), packed on grain."""
    import numpy as np

    if args.data is None:
        eos = [tok.eos_id] if tok.eos_id is not None else []
        stream = np.concatenate([np.concatenate([tok.encode(d), eos]) for d in load_texts()]).astype(np.int32)
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
        if not eq or name not in MESH_AXES:
            raise argparse.ArgumentTypeError(f"--mesh: expected entries like dp=4,tp=2 or replica=2,dp=4, got {part!r}")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--mesh: {name}={value!r} is not an int") from None
    return sizes


def build_parser() -> argparse.ArgumentParser:
    p = zjax.train.add_arguments(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    add = p.add_argument
    add("--stage", type=int, choices=(0, 1, 2, 3), default=3)
    add("--mesh", type=parse_mesh, default={"dp": -1}, help="e.g. dp=8, dp=4,tp=2, dp=2,cp=4, dp=2,ep=4 (experts; "
        "--preset moe-small), replica=2,dp=4 (HSDP); default dp=all")  # fmt: skip
    add("--preset", default="small", help="model size: tiny, small, medium, moe-small (8 experts, top-2)")
    add("--hf", type=Path, default=None, help="continue this Hugging Face checkpoint (token ids: bytes mod vocab)")
    add("--save-hf", type=Path, default=None, help="write the trained weights as a Hugging Face checkpoint")
    add("--data", type=Path, default=None, help="local text/.jsonl/.parquet/.npy files or a directory")
    add("--tokenizer", type=Path, default=None, help="tokenizer.json or a directory holding one (default: bytes)")
    add("--eval-fraction", type=float, default=0.05, help="share of the token stream held out for evaluation")
    add("--batch-size", type=int, default=32, help="global batch (sequences per step)")
    add("--seq-len", type=int, default=128)
    add("--precision", choices=("fp32", "bf16", "fp16"), default="bf16")
    add("--remat", default="full", help="activation checkpointing policy (zjax.remat.POLICIES)")
    add("--accum", type=int, default=1, help="gradient-accumulation microbatches per step")
    add("--offload", choices=("none", "optimizer", "optimizer+params"), default="none", help="ZeRO-Offload")
    add("--quantize-comm", default="none", help="ZeRO++: none, weights, grads, weights+grads (':int4', '@B' on a part)")
    add("--reduce-dtype", default=None, help="reduce gradients over dp in this dtype (e.g. float32)")
    add("--compute-copy", choices=("keep", "drop"), default="keep", help="stage 3: drop = fp32 weights only")
    add("--hpz", action="store_true", help="stage 3 with replica: ZeRO++'s hierarchical partitioning")
    add("--microbatches", type=int, default=None, help="pipeline microbatches per step (default 2 x pp)")
    add("--repeats", type=int, default=1, help="pipeline repeats: chunks of layers per stage")
    add("--schedule", choices=("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"), default="gpipe")
    add("--zero3-gather", choices=("step", "layer", "chunk"), default=None, help="pipeline weight gathering")
    add("--lr", type=float, default=3e-3)
    add("--optimizer", choices=("adamw", "fused_adamw"), default="adamw", help="fused_adamw: zjax.pallas")
    add("--clip-norm", type=float, default=1.0)
    add("--seed", type=int, default=0)
    add("--metrics-json", type=Path, default=None, help="write losses and memory figures here")
    return p


def build_model(args, tok):
    """The model's config (a preset sized to the tokenizer and --seq-len, or a Hugging Face checkpoint's)."""
    from zjax.models import PRESETS, from_hf_config
    from zjax.remat import POLICIES

    if args.remat not in POLICIES:
        raise SystemExit(f"--remat {args.remat!r}: choose one of {sorted(POLICIES)}")
    if args.hf is not None:
        return from_hf_config(args.hf, remat=args.remat).cfg
    if args.preset not in PRESETS:
        raise SystemExit(f"--preset {args.preset!r}: choose one of {sorted(PRESETS)}")
    vocab = -(-tok.vocab_size // 128) * 128  # padded to a multiple of 128 (it splits over tp)
    preset = PRESETS[args.preset]
    return type(preset)(**{**preset.__dict__, "max_len": args.seq_len, "remat": args.remat, "vocab": vocab})


def main(argv: list[str] | None = None) -> dict:
    args, loop = zjax.train.parse_args(build_parser(), argv)
    out = args.save_hf
    if out is not None and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SystemExit(f"--save-hf {out}: exists and is not an empty directory; pick a new or empty one")
    with zjax.train.runtime(loop, argv):  # joins a cluster, launches --processes or simulates CPU devices
        import jax
        import jax.numpy as jnp
        import optax

        from zjax.models import Decoder, lm_loss

        tok = zjax.data.load_tokenizer(args.tokenizer)
        cfg = build_model(args, tok)
        sizes = dict(args.mesh)
        if "replica" in sizes:
            sizes["dp"] = (sizes.pop("replica"), sizes.get("dp", -1))
        mesh = zjax.make_mesh(**sizes)
        stages, pipeline = int(mesh.shape["pp"]), None
        if stages > 1 or args.microbatches is not None:
            pipeline = zjax.Pipeline(args.microbatches or 2 * stages, repeats=args.repeats,
                                     zero3_gather=args.zero3_gather, schedule=args.schedule)  # fmt: skip
            if cfg.layers % (stages * args.repeats) and args.hf is not None:
                raise SystemExit(f"--hf: {cfg.layers} layers do not split into pp={stages} x --repeats {args.repeats}")
            chunks = stages * args.repeats  # deepen a preset so that every stage gets whole layers
            cfg = type(cfg)(**{**cfg.__dict__, "layers": chunks * -(-cfg.layers // chunks)})
        model = Decoder(cfg)
        plan = zjax.Plan(
            mesh, stage=args.stage, precision=args.precision, clip_norm=args.clip_norm, pipeline=pipeline,
            offload=args.offload, quantized_comm=None if args.quantize_comm == "none" else args.quantize_comm,
            reduce_dtype=args.reduce_dtype, compute_copy=args.compute_copy == "keep", hpz=args.hpz,
        )  # fmt: skip
        pipeline = plan.pipeline  # with its gathering mode settled for the stage
        schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(1, loop.steps // 10), max(2, loop.steps))
        adamw = zjax.pallas.fused_adamw if args.optimizer == "fused_adamw" else optax.adamw
        tx = adamw(schedule, b2=0.95, weight_decay=0.1)
        init_fn = lambda r: model.init(r, jnp.zeros((1, args.seq_len), jnp.int32))["params"]  # noqa: E731
        rng = jax.random.key(args.seed)
        hf = None if args.hf is None else (lambda: zjax.hf.load(args.hf, plan, model, tx, rng))
        state, start = zjax.train.init_or_restore(plan, init_fn, tx, rng, loop, fresh=hf)
        step = plan.train_step(lambda params, batch: lm_loss(model, params, batch), accum_steps=args.accum)
        log = print if jax.process_index() == 0 else (lambda *a, **k: None)
        data, held_out = build_data(args, cfg, tok, pipeline is not None, log)
        log(f"zjax example: remat policy {args.remat!r}, {cfg.num_params:,} params, {data.num_rows:,} rows of "
            f"{args.seq_len + 1} tokens, devices: {jax.devices()[0].platform} x {jax.device_count()} in "
            f"{jax.process_count()} process(es), mesh {dict(mesh.shape)}")  # fmt: skip
        if pipeline is not None:
            log(f"pipeline: {pipeline.schedule}, {stages} stages x {cfg.layers // stages} layers, "
                f"{pipeline.microbatches} microbatches, {pipeline.repeats} repeat(s): {pipeline.table(stages).ticks} "
                f"ticks, bubble {pipeline.bubble(stages):.1%}")  # fmt: skip
        first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731 (an MoE: (loss, router metrics))
        # the held-out tokens' mean loss: the eval returns its LossSum (an MoE's with its routers' terms, as trained)
        evaluate = None if held_out is None else plan.eval_step(lambda p, b: first(lm_loss(model, p, b)))
        kind, devices = jax.devices()[0].device_kind, jax.device_count()
        result = zjax.train.fit(
            plan, step, state, data, loop, start=start, schedule=schedule,
            eval_step=evaluate, eval_data=held_out,
            tokens_per_step=args.batch_size * args.seq_len,
            mfu=lambda rate: zjax.metrics.mfu(rate, cfg, args.seq_len, kind, devices),
            aux_metrics=None if cfg.moe is None else router_metrics,
            run_config={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        )  # fmt: skip
        if args.save_hf is not None:  # every process takes part; process 0 writes
            zjax.hf.save(args.save_hf, model, result.state)
            log(f"Hugging Face checkpoint written to {args.save_hf}")
        summary = report(args, cfg, plan, result)
        if args.metrics_json is not None and jax.process_index() == 0:
            zjax.write_json_atomic(args.metrics_json, summary)
            log(f"metrics written to {args.metrics_json}")
    return summary


def router_metrics(aux) -> dict:
    """A mixture of experts' routers: auxiliary losses, dropped rows, tokens per expert (all layers)."""
    import numpy as np

    return {k: float(aux[k]) for k in ("ce", "load_balance", "z_loss", "dropped")} | {
        "expert_tokens": np.asarray(aux["expert_tokens"]).sum(axis=0)
    }


def report(args, cfg, plan, result) -> dict:
    """The run's figures as --metrics-json writes them."""
    import jax

    sizes, pipe, pp = {k: int(v) for k, v in plan.mesh.shape.items()}, plan.pipeline, int(plan.mesh.shape["pp"])
    memory = result.memory
    return {
        "stage": args.stage, "mesh": {name: sizes[name] for name in MESH_AXES}, "processes": jax.process_count(),
        "pipeline": None if pipe is None else {
            "schedule": pipe.schedule, "microbatches": pipe.microbatches, "repeats": pipe.repeats,
            "zero3_gather": pipe.zero3_gather, "ticks": pipe.table(pp).ticks, "bubble": pipe.bubble(pp),
        },
        **{k: getattr(args, k) for k in ("precision", "quantize_comm", "reduce_dtype", "compute_copy", "hpz",
                                         "offload", "accum", "remat", "optimizer")},
        "preset": None if args.hf is not None else args.preset, "hf": None if args.hf is None else str(args.hf),
        "num_params": cfg.num_params, "active_params": cfg.num_active_params, "losses": result.losses,
        "state_bytes_per_device": {"theory": memory.state_theory, "compiled": memory.state_compiled},
        "temp_bytes_per_device": memory.temp_bytes, "memory": memory.to_dict(),
        "tokens_per_second": result.tokens_per_second, "resumed_from": result.start if args.resume else None,
        "final_step": int(result.state.step), "skipped_steps": result.skipped_steps, "eval_loss": result.eval_loss,
        "mfu": result.mfu, "final_loss_scale": float(result.state.loss_scale.scale),
    }  # fmt: skip


if __name__ == "__main__":
    main()
