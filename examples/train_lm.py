"""Train a byte-level decoder LM with a ZeRO stage of your choice (the flags of ``zjax train``'s settings).

    python examples/train_lm.py --stage 3 --mesh dp=8 --steps 50
    python examples/train_lm.py --config examples/configs/small.toml --steps 20   # a run file; flags win
    python examples/train_lm.py --stage 2 --mesh dp=4,tp=2 --precision fp16 --accum 4
    python examples/train_lm.py --stage 3 --mesh replica=2,dp=4 --processes 2   # HSDP, 2 processes x 4 devices
    python examples/train_lm.py --stage 1 --mesh dp=2,pp=4 --microbatches 8 --repeats 2   # circular pipeline
    python examples/train_lm.py --hf ckpt_dir --stage 3 --save-hf out_dir   # continue a Hugging Face checkpoint

The run itself is ``zjax train``'s (:func:`zjax.train.run_lm`): these flags are its settings under other names
(``--stage`` is ``plan.stage``, ``--lr`` ``optim.lr``, ``--schedule`` ``pipeline.schedule``), and ``--config`` reads
a file of them (flat keys, tables only group them). With no accelerator it runs on 8 simulated CPU devices. The text
is the source of a few modules of Python's own standard library, read from this interpreter's installation.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import zjax
import zjax.train

MESH_AXES = ("replica", "dp", "ep", "cp", "tp", "pp")


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
    p = zjax.train.add_arguments(zjax.train.ArgumentParser(description=__doc__.split("\n")[0]))
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
    add("--matmul", default="default", choices=tuple(zjax.fp8.MATMULS), help="the projections' products")
    add("--bf16-edge-layers", type=int, default=0, help="first and last layers multiplying in bf16 around fp8 ones")
    add("--dropout", type=float, default=0.0, help="zero each attention and MLP output value with this probability")
    add("--accum", type=int, default=1, help="gradient-accumulation microbatches per step")
    add("--offload", choices=("none", "optimizer", "optimizer+params"), default="none", help="ZeRO-Offload")
    add("--quantize-comm", default="none", help="ZeRO++: none, weights, grads, weights+grads (':int4', '@B' on a part)")
    add("--reduce-dtype", default=None, help="reduce gradients over dp in this dtype (e.g. float32)")
    add("--compute-copy", choices=("keep", "drop"), default="keep", help="stage 3: drop = fp32 weights only")
    add("--hpz", action="store_true", help="stage 3 with replica: ZeRO++'s hierarchical partitioning")
    add("--microbatches", type=int, default=None, help="pipeline microbatches per step (default 2 x pp)")
    add("--repeats", type=int, default=1, help="pipeline repeats: chunks of layers per stage")
    add("--pipeline-schedule", "--schedule", dest="schedule", choices=zjax.pipeline.SCHEDULES, default="gpipe",
        help="the pipeline's schedule (--schedule: the same)")  # fmt: skip
    add("--pipeline-table", type=Path, default=None, help="a schedule of one's own: a file of actions per stage "
        "(zjax.pipeline.parse_table's format), run in place of --pipeline-schedule")  # fmt: skip
    add("--zero3-gather", choices=("step", "layer"), default=None, help="pipeline weight gathering")
    add("--recompute", choices=zjax.pipeline.RECOMPUTE, default="once",
        help="table schedules, full remat: B recomputes once for B and W, or per-action (least memory)")  # fmt: skip
    add("--lr", type=float, default=3e-3)
    add("--lr-schedule", choices=zjax.train.SCHEDULES, default="cosine", help="after a warm-up of a tenth of the steps")
    add("--optimizer", choices=zjax.train.OPTIMIZERS, default="adamw", help="fused_adamw: zjax.pallas's kernel")
    add("--weight-decay", type=float, default=0.1, help="not on norms, biases, embeddings and the head")
    add("--clip-norm", type=float, default=1.0)
    add("--seed", type=int, default=0)
    add("--metrics-json", type=Path, default=None, help="write losses and memory figures here")
    return p


SECTIONS = {  # the example's flags -> zjax train's settings
    "model": {"preset": "preset", "seq_len": "seq_len", "remat": "remat", "matmul": "matmul", "hf": "hf",
              "bf16_edge_layers": "bf16_edge_layers", "dropout": "dropout"},
    "data": {"data": "path", "tokenizer": "tokenizer", "batch_size": "batch_size", "eval_fraction": "eval_fraction",
             "seed": "seed"},
    "plan": {"stage": "stage", "precision": "precision", "accum": "accum", "offload": "offload",
             "quantize_comm": "quantize_comm", "reduce_dtype": "reduce_dtype", "hpz": "hpz"},
    "pipeline": {"schedule": "schedule", "microbatches": "microbatches", "repeats": "repeats",
                 "zero3_gather": "zero3_gather", "recompute": "recompute", "pipeline_table": "table"},
    "optim": {"optimizer": "name", "lr": "lr", "lr_schedule": "schedule", "weight_decay": "weight_decay",
              "clip_norm": "clip_norm"},
    "output": {"metrics_json": "metrics_json", "save_hf": "save_hf"},
}  # fmt: skip


def run_config(args: argparse.Namespace, loop: zjax.train.LoopConfig) -> zjax.train.RunConfig:
    """The flags as ``zjax train``'s settings."""
    values = {
        f"{section}.{key}": getattr(args, flag) for section, keys in SECTIONS.items() for flag, key in keys.items()
    }
    values["plan.mesh"] = ",".join(f"{axis}={size}" for axis, size in args.mesh.items())
    values["plan.compute_copy"] = args.compute_copy == "keep"
    values |= {f"loop.{k}": v for k, v in loop.__dict__.items()}
    return zjax.train.RunConfig().replaced(values, relative_to=Path.cwd(), where="")


def main(argv: list[str] | None = None) -> dict:
    args, loop = zjax.train.parse_args(build_parser(), argv)
    with zjax.train.one_line_errors("train_lm.py"):
        return zjax.train.run_lm(run_config(args, loop), argv)


if __name__ == "__main__":
    main()
