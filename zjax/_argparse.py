"""Command lines whose mistakes are one line: an argument parser that names the error and where help is."""

from __future__ import annotations

import argparse
import sys
from typing import Any


class ArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors print one line (the error, then ``see PROG --help``) and exit with status 2,
    instead of the usage block first (its subcommands' parsers are of this class too)."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)
