"""Run a few worker processes to the end, or kill them all and say where each one was.

Each worker's output goes to a file, not a pipe: a worker that logs a lot never blocks on a full pipe while the
test waits on another one. On timeout every worker still running gets SIGABRT first (Python's faulthandler,
switched on for every worker, prints where each thread was), then is killed: none is left running into the next
test, and the failure shows the end of each worker's output.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_workers(
    cmds: Sequence[Sequence[str]], timeout: float, envs: Sequence[dict[str, str] | None] | None = None
) -> list[tuple[int, str]]:
    """Start ``cmds`` at once (cwd: the repository), wait for all of them: ``[(returncode, output), ...]``.

    ``envs``: one environment per command (``None``: this process's).
    """
    base = envs or [None] * len(cmds)
    envs = [{**(env if env is not None else os.environ), "PYTHONFAULTHANDLER": "1"} for env in base]
    with tempfile.TemporaryDirectory() as tmp:
        logs = [Path(tmp) / f"worker{i}.log" for i in range(len(cmds))]
        procs = []
        timed_out = False
        try:
            for cmd, env, log in zip(cmds, envs, logs, strict=True):
                with open(log, "w") as f:
                    procs.append(
                        subprocess.Popen(list(cmd), stdout=f, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
                    )
            deadline = time.monotonic() + timeout
            for p in procs:
                try:
                    p.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    timed_out = True
                    break
        finally:
            running = [p for p in procs if p.poll() is None]
            for p in running:
                p.send_signal(signal.SIGABRT)
            for p in running:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        outs = [log.read_text(errors="replace") for log in logs]
    if timed_out:
        tails = "\n".join(f"--- worker {i} (rc {procs[i].returncode}) ---\n{o[-3000:]}" for i, o in enumerate(outs))
        raise AssertionError(f"workers did not finish within {timeout:.0f} s (killed):\n{tails}")
    return [(p.returncode, o) for p, o in zip(procs, outs, strict=True)]
