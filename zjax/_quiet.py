"""JAX imported without the CUDA plugin's start-up lines on a machine without a GPU.

With ``jax-cuda12-plugin`` installed (the ``test`` and ``plan-gpu`` extras), ``import jax`` loads the plugin's
libraries, and on a machine without an NVIDIA driver XLA's C++ logging writes "Could not find cuda drivers on your
machine" from ``cudart_stub.cc`` three times, each after absl's "All log messages before absl::InitializeLog()"
notice, to file descriptor 2 (no environment variable stops it). When zjax is what imports JAX, the import runs
with descriptor 2 sent to a temporary file, and what it wrote there is passed on to ``sys.stderr`` without those
lines; the trainer (:func:`zjax.train.runtime`) starts JAX's backend the same way, where the plugin probes once
more. Nothing else is filtered; a process that imported JAX itself first sees JAX as it is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator

NOISE = ("cudart_stub.cc", "All log messages before absl::InitializeLog() is called")
"""Substrings of the lines left out: the CUDA plugin's driver probe on a machine without a GPU, and absl's notice
that precedes each of them."""

GPU_TARGET_NOISE = (
    *NOISE,
    # XLA:GPU's check of a program's argument bytes against a default budget it cannot know for a GPU that is not
    # there (a deviceless compile for a target); the planner reports the real figures itself
    "The byte size of input/output arguments",
)
"""Lines a deviceless compile for a GPU target prints that say nothing about the program (the planner's)."""


def import_jax() -> None:
    """``import jax`` with the lines of :data:`NOISE` left out of standard error (a no-op if JAX is imported)."""
    if "jax" in sys.modules:
        return
    with filtered_stderr():
        import jax  # noqa: F401


@contextlib.contextmanager
def filtered_stderr(noise: tuple[str, ...] = NOISE) -> Iterator[None]:
    """Descriptor 2 into a temporary file while the block runs; then what was written there, less the lines holding
    one of ``noise``'s substrings (default :data:`NOISE`), to ``sys.stderr``."""
    try:
        saved = os.dup(2)
    except OSError:  # no descriptor 2 (an embedded interpreter): nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as caught:
        sys.stderr.flush()
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            text = caught.read().decode("utf-8", "replace")
            kept = [line for line in text.splitlines(keepends=True) if not any(n in line for n in noise)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


class _Skip(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


@contextlib.contextmanager
def quiet_autotuning() -> Iterator[None]:
    """tokamax's "Autotuning cache miss" warnings left out of the ``absl`` log while the block runs: lowering for a GPU
    target that is not there autotunes nothing (each grouped matmul takes the default configuration, which is what
    the plan compiles), and each warning is several lines per shape (a DeepSeek-V3 plan printed hundreds)."""
    log, skip = logging.getLogger("absl"), _Skip("Autotuning cache miss")
    log.addFilter(skip)
    try:
        yield
    finally:
        log.removeFilter(skip)
