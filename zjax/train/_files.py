"""Runs described by a TOML file, with command-line flags that win over it."""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ._config import LoopConfig


def load_config(path: str | os.PathLike, keys: Iterable[str]) -> dict[str, Any]:
    """Read a TOML run file: flat ``key = value`` lines, optionally grouped under ``[tables]``.

    Keys are the flags' names with ``_`` or ``-`` (``eval_every`` or ``eval-every``); a table only groups
    lines for the reader (``[loop]``, ``[model]``), so a key may appear once in the whole file.

    Args:
      path: the ``.toml`` file.
      keys: the valid keys (the parser's destinations).

    Returns:
      ``{key: value}`` with keys as given in ``keys``.

    Raises:
      ValueError: an unknown or repeated key (naming it, the file and the valid keys), or a file that is not TOML.

    Example:
      >>> load_config("examples/configs/small.toml", ["steps", "stage", "mesh"])
      {'steps': 100, 'stage': 3, 'mesh': 'dp=8'}
    """
    valid = set(keys)
    try:
        with open(path, "rb") as f:
            tree = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {os.fspath(path)}: not valid TOML ({e}).") from None
    values: dict[str, Any] = {}
    where: dict[str, str] = {}

    def take(table: dict[str, Any], prefix: str) -> None:
        for raw, value in table.items():
            if isinstance(value, dict) and not prefix:
                take(value, f"[{raw}] ")
                continue
            key = raw.replace("-", "_")
            if key not in valid:
                raise ValueError(
                    f"config file {os.fspath(path)}: unknown key {prefix}{raw!r}; valid keys: "
                    f"{', '.join(sorted(valid))}."
                )
            if key in values:
                raise ValueError(
                    f"config file {os.fspath(path)}: key {key!r} appears twice ({where[key]}and {prefix or 'top '}"
                    "level); keep one."
                )
            values[key], where[key] = value, prefix or "top level "

    take(tree, "")
    return values


def _file_defaults(parser: argparse.ArgumentParser, path: Path) -> dict[str, Any]:
    """The file's values as parser defaults: strings go through each flag's ``type``, choices are checked."""
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config", argparse.SUPPRESS)}
    values = load_config(path, actions)
    for key, value in values.items():
        action = actions[key]
        if action.choices is not None and value not in action.choices:
            raise ValueError(f"config file {path}: {key} = {value!r} is not one of {sorted(map(str, action.choices))}.")
        if isinstance(action, argparse._StoreConstAction) and not isinstance(value, bool):  # store_true / false
            raise ValueError(f"config file {path}: {key} = {value!r} must be true or false.")
        if action.type is float and isinstance(value, int) and not isinstance(value, bool):
            values[key] = float(value)  # lr = 1 in TOML is an int
    return values


def parse_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None
) -> tuple[argparse.Namespace, LoopConfig]:
    """Parse ``argv`` over the values of ``--config FILE`` (flags given explicitly win) into a :class:`LoopConfig`.

    Args:
      parser: a parser with :func:`add_arguments`'s flags and the script's own.
      argv: the arguments (default ``sys.argv[1:]``).

    Returns:
      ``(args, config)``: every value (the script's flags too) and the loop's settings.

    Raises:
      SystemExit: through ``parser.error`` (status 2) for a bad file, key or value, naming it.

    Example:
      >>> parser = zjax.train.add_arguments(argparse.ArgumentParser())
      >>> parser.add_argument("--lr", type=float, default=3e-3)
      >>> args, config = zjax.train.parse_args(parser, ["--config", "run.toml", "--steps", "10"])
    """
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path, default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config is not None:
        try:
            parser.set_defaults(**_file_defaults(parser, known.config))
        except (OSError, ValueError) as e:
            parser.error(str(e))
    args = parser.parse_args(argv)  # a string default goes through its flag's type, as if typed
    try:
        return args, LoopConfig.from_args(args)
    except ValueError as e:
        parser.error(str(e))
