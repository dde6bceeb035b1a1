"""``zjax train``: a run file and ``section.key=value`` overrides in, a trained model out; errors in one line.

    zjax train                                   # the default run: the small preset on 8 simulated CPU devices
    zjax train --print-config > run.toml         # the resolved settings, as a file the next command reads
    zjax train run.toml plan.stage=3 optim.name=muon optim.lr=0.02
    zjax train run.toml --pipeline-schedule 1f1b plan.mesh=dp=2,pp=4

A mistake in the input (a key, a value, a file, a batch that does not split, an optional package that is missing)
prints one line naming it and exits with status 2, before anything compiles; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .._argparse import ArgumentParser
from .._extras import MissingExtra

USER_ERRORS = (ValueError, TypeError, FileNotFoundError, MissingExtra)
"""What zjax's own checks raise for input a person can fix."""


def parser(prog: str = "zjax train") -> argparse.ArgumentParser:
    """``zjax train``'s arguments (also the ``train`` subcommand of ``zjax``)."""
    from ._run import SECTIONS

    keys = "; ".join(f"[{name}] " + ", ".join(f.name for f in _fields(cls)) for name, cls in SECTIONS.items())
    p = ArgumentParser(
        prog=prog,
        description="Train a decoder language model: a TOML run file (optional) and section.key=value overrides.",
        epilog=f"Keys by section: {keys}. Defaults: zjax train --print-config.",
    )
    add_train_arguments(p)
    return p


def add_train_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``zjax train``'s arguments to ``p``."""
    p.add_argument("items", nargs="*", metavar="RUN.toml | section.key=value",
                   help="a run file (first, optional) and overrides, e.g. plan.stage=3 optim.lr=3e-4")  # fmt: skip
    p.add_argument("--print-config", action="store_true", help="print the resolved settings as TOML and exit")
    p.add_argument("--pipeline-schedule", "--schedule", dest="pipeline_schedule", default=None,
                   help="pipeline.schedule (--schedule: the same; the learning rate's is optim.schedule)")  # fmt: skip
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return p


def _fields(cls: type) -> list:
    import dataclasses

    return list(dataclasses.fields(cls))


def resolve(items: Sequence[str], pipeline_schedule: str | None = None) -> Any:
    """The :class:`RunConfig` of a command line's run file (optional, first) and overrides."""
    from ._run import RunConfig

    items = list(items)
    cfg = RunConfig()
    if items and "=" not in items[0]:
        cfg = RunConfig.load(Path(items.pop(0)))
    extra = [f"pipeline.schedule={pipeline_schedule}"] if pipeline_schedule is not None else []
    loose = [i for i in items if "=" not in i]
    if loose:
        raise ValueError(f"{loose[0]!r}: only the first argument may be a run file; the rest are section.key=value.")
    return cfg.override([*items, *extra])


@contextmanager
def one_line_errors(prog: str, debug: bool = False) -> Iterator[None]:
    """Turn :data:`USER_ERRORS` (and ``SystemExit`` with a message) into one line on stderr and exit status 2."""
    try:
        yield
    except USER_ERRORS as e:
        if debug:
            raise
        text = " ".join(str(e).split()) or type(e).__name__
        print(f"{prog}: error: {text}", file=sys.stderr)
        raise SystemExit(2) from None


def run_command(args: argparse.Namespace, prog: str = "zjax train", run: Callable[..., Any] | None = None) -> int:
    """``zjax train`` for parsed arguments (``run``: the trainer, :func:`zjax.train.run_lm` by default)."""
    with one_line_errors(prog, args.debug):
        cfg = resolve(args.items, args.pipeline_schedule)
        if args.print_config:
            sys.stdout.write(cfg.to_toml())
            return 0
        if run is None:
            from ._lm import run_lm

            run = run_lm
        run(cfg)
    return 0
