"""Compiles whose products the planner reads: the module right after SPMD partitioning, and a compile that
bypasses JAX's persistent compilation cache (which would serve a program without compiling it)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import jax


def partitioned_hlo(lowered: Any) -> tuple[Any, str]:
    """Compile ``lowered`` and return ``(compiled, HLO text right after SPMD partitioning)``."""
    with tempfile.TemporaryDirectory() as tmp, compiled_here():
        compiled = lowered.compile(compiler_options={"xla_dump_to": tmp, "xla_dump_hlo_pass_re": "spmd-partitioning"})
        names = sorted(f for f in os.listdir(tmp) if "after_spmd-partitioning" in f)
        if not names:
            raise RuntimeError("partitioned_hlo: XLA wrote no module after SPMD partitioning.")
        with open(os.path.join(tmp, names[-1])) as f:
            return compiled, f.read()


@contextlib.contextmanager
def compiled_here() -> Iterator[None]:
    """Compile without JAX's persistent compilation cache (``jax_compilation_cache_dir``), if one is set: a
    program read from it is not compiled, so XLA dumps no module, and a deviceless GPU program written to it
    cannot be read back without a GPU (jax 0.10: a warning, then a compile). Not for concurrent compiles."""
    from jax.experimental.compilation_cache import compilation_cache

    settings = jax.config.values
    if settings["jax_compilation_cache_dir"] is None or not settings["jax_enable_compilation_cache"]:
        yield
        return
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # the cache's use is decided once; decide again
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()
