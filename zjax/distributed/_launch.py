"""Run N copies of a command on this machine as one multi-process job, and end them all when one fails."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from ._cluster import COORDINATOR, CPU_DEVICES, NUM_PROCESSES, PROCESS_ID

PEER_FAILED = "peer failed"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


# Gloo prints one line per communicator and peer group from its own threads (unsynchronized, so two may share
# a line: "... ranks is : [Gloo] Rank 2 is connected to 3 ... is : 3" and a lone "3" after it)
_GLOO = re.compile(
    r"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. Expected number of connected peer ranks is : ?(\d+)?"
)


# what is left of those lines when two threads wrote them into each other word by word ("[Gloo] Rank [Gloo] Rank 56
# is connected to  is connected to 77 peer ranks. ...", and the rest on a line of its own): their words and counts
_GLOO_WORDS = re.compile(
    r"(?:\s|\d|\[Gloo\] Rank|is connected to|peer ranks\.|Expected number of connected peer ranks is :?)+"
)


class GlooFilter:
    """Drops Gloo's "Rank r is connected to n peer ranks" lines from a process's output, also when two of
    them were written into one line (whole, or word by word); keeps any whole one that reports fewer peers than
    expected."""

    def __init__(self) -> None:
        self._owed = 0  # messages cut before their expected count, which then arrives on a line of its own

    def __call__(self, line: str) -> str | None:
        """The line to print, or ``None`` to drop it."""
        if self._owed and line.strip().isdigit():
            self._owed -= 1
            return None
        kept: list[str] = []

        def strip(m: re.Match) -> str:
            if m.group(2) is None:
                self._owed += 1
            elif m.group(1) != m.group(2):
                kept.append(m.group(0))  # a peer is missing: worth seeing
            return ""

        rest = _GLOO.sub(strip, line)
        if ("[Gloo]" in rest or "peer ranks" in rest) and _GLOO_WORDS.fullmatch(rest.strip()):
            rest = ""  # pieces of messages written into each other
        if rest == line:
            return line
        text = " ".join([*kept, rest.strip()]).strip()
        return f"{text}\n" if text else None


def _pump(stream, rank: int, out) -> None:
    keep = GlooFilter()
    for raw in iter(stream.readline, ""):
        line = keep(raw)
        if line is None:
            continue
        out.write(f"[{rank}] {line}")
        out.flush()
    stream.close()


def launch(
    command: Sequence[str],
    processes: int,
    *,
    cpu_devices: int | None = None,
    grace_s: float = 70.0,
    env: Mapping[str, str] | None = None,
    out=None,
) -> int:
    """Run ``command`` as ``processes`` processes on 127.0.0.1 (one job) and wait for them.

    Each copy finds its place through ``ZJAX_COORDINATOR_ADDRESS``, ``ZJAX_NUM_PROCESSES`` and
    ``ZJAX_PROCESS_ID`` (read by :func:`zjax.distributed.initialize`); its output is prefixed with
    ``[rank]``. When one copy fails, the others are given ``grace_s`` seconds to end (JAX's runtime
    aborts them after its heartbeat timeout) and are then killed, and the launcher says which
    process failed and that the job should resume from its last checkpoint. SIGTERM/SIGINT to the
    launcher is passed on to every copy (preemption: they save and exit).

    Returns:
      0 when every copy succeeded, else the first failure's exit status (128 + signal if killed).
    """
    if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
        raise ValueError(f"launch: processes={processes!r} must be a positive int.")
    if not command:
        raise ValueError("launch: command is empty; give the program and its arguments.")
    out = sys.stderr if out is None else out
    base = dict(os.environ if env is None else env)
    base[COORDINATOR] = f"127.0.0.1:{free_port()}"
    base[NUM_PROCESSES] = str(processes)
    base["PYTHONUNBUFFERED"] = "1"
    if cpu_devices is not None:
        base[CPU_DEVICES] = str(cpu_devices)
    procs: list[subprocess.Popen] = []
    pumps = []
    for rank in range(processes):
        p = subprocess.Popen(
            list(command),
            env={**base, PROCESS_ID: str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # a signal to the launcher's terminal is forwarded, not duplicated
        )
        procs.append(p)
        t = threading.Thread(target=_pump, args=(p.stdout, rank, out), daemon=True)
        t.start()
        pumps.append(t)

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    first: tuple[int, int] | None = None
    deadline = None
    try:
        while [p.poll() for p in procs].count(None):  # poll every process (any() would stop early)
            for rank, p in enumerate(procs):
                if first is None and p.returncode not in (None, 0):
                    first = (rank, p.returncode)
                    deadline = time.monotonic() + grace_s
            if deadline is not None and time.monotonic() > deadline:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.05)
        for rank, p in enumerate(procs):
            if first is None and p.returncode != 0:
                first = (rank, p.returncode)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for t in pumps:
            t.join(timeout=5)
    if first is None:
        return 0
    rank, rc = first
    others = ", ".join(f"{r}: {_describe(p.returncode)}" for r, p in enumerate(procs) if r != rank)
    out.write(
        f"zjax launch: process {rank} of {processes} failed ({_describe(rc)}); {PEER_FAILED}, the others "
        f"ended ({others}). Resume from the last checkpoint (e.g. the same command with --resume).\n"
    )
    out.flush()
    return 128 - rc if rc < 0 else rc
