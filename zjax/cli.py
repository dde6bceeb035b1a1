"""The ``zjax`` command.

``zjax train [RUN.toml] [section.key=value ...]`` trains a decoder language model (:mod:`zjax.train`);
``zjax plan --model llama2-7b --mesh dp=64`` compiles every stage ahead of time on simulated CPU devices
(or, with ``--target h100``, with XLA:GPU for GPUs that are not there) and prints per-device memory and
communication; ``zjax ckpt info PATH`` describes a checkpoint; ``zjax launch`` runs a command as local processes.
Mistakes in the input are one line and exit status 2."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ._argparse import ArgumentParser
from ._plan_args import plan_parser
from ._plan_cli import run_plan
from ._version import __version__
from .train import add_train_arguments, run_command


def _ckpt_parser(sub) -> None:
    p = sub.add_parser("ckpt", help="inspect checkpoints")
    ckpt_sub = p.add_subparsers(dest="ckpt_command", required=True)
    info = ckpt_sub.add_parser("info", help="steps, the saved plan and every array's shape, dtype and spec")
    info.add_argument("path", type=Path)
    info.add_argument("--step", type=int, default=None, help="default: the newest step")


def _run_ckpt_info(args: argparse.Namespace) -> int:
    import jax

    jax.config.update("jax_platforms", "cpu")
    from .checkpoint import Checkpointer

    if not args.path.is_dir():
        print(f"zjax ckpt info: {args.path} is not a directory", file=sys.stderr)
        return 2
    with Checkpointer(args.path) as ckpt:
        steps = ckpt.steps()
        if not steps:
            print(f"zjax ckpt info: no checkpoint steps in {args.path}", file=sys.stderr)
            return 2
        step = steps[-1] if args.step is None else args.step
        if step not in steps:
            print(f"zjax ckpt info: step {step} not in {steps}", file=sys.stderr)
            return 2
        meta = ckpt.metadata(step)
        rows = ckpt.array_metadata(step)
    print(f"{args.path.resolve()}: steps {steps}")
    print(f"step {step}: " + ", ".join(f"{k}={v}" for k, v in meta.items() if k not in ("rules",)))
    width = max(len(r[0]) for r in rows)
    for path, shape, dtype, spec in rows:
        print(f"  {path:<{width}}  {dtype:<9} {str(shape):<22} {spec}")
    return 0


def _launch_parser(sub) -> None:
    p = sub.add_parser(
        "launch",
        help="run a command as N processes on this machine (one job on 127.0.0.1); end all when one fails",
    )
    p.add_argument("-n", "--processes", type=int, required=True)
    per_process = "simulated CPU devices per process (--cpu-devices: the older name)"
    p.add_argument("--cpu-devices-per-process", "--cpu-devices", dest="cpu_devices", type=int, help=per_process)
    p.add_argument("--grace", type=float, default=70.0, help="seconds the others get to end after one fails")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- python train.py ...")


def _run_launch(args: argparse.Namespace) -> int:
    from .distributed import launch

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        print("zjax launch: give a command, e.g. zjax launch -n 2 -- python train.py", file=sys.stderr)
        return 2
    return launch(cmd, args.processes, cpu_devices=args.cpu_devices, grace_s=args.grace)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="zjax", description="zjax command line")
    parser.add_argument("--version", action="version", version=f"zjax {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_arguments(sub.add_parser("train", help="train a decoder LM from a run file and key=value overrides"))
    plan_parser(sub)
    _ckpt_parser(sub)
    _launch_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "train":
        return run_command(args, prog="zjax train")
    if args.command == "plan":
        return run_plan(args)
    if args.command == "ckpt":
        return _run_ckpt_info(args)
    if args.command == "launch":
        return _run_launch(args)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
