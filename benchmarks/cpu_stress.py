"""Run the example commands of the docs' getting started many times on simulated CPU devices and count how many finish.

    python benchmarks/cpu_stress.py [--runs 20] [--variant-runs 5] [--json runs/cpu_stress.json]

The main command (``python examples/train_lm.py``, 8 simulated devices) runs ``--runs`` times; each other
variant getting started shows runs ``--variant-runs`` times. A run that does not exit 0 is a failure; one whose
output shows XLA:CPU's rendezvous termination is counted as a deadlock. Prints a table and the machine
(CPU model, cores, vector extensions), and writes JSON.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_lm.py"

MAIN = ""  # the README's main command: no flags
VARIANTS = {  # the other example commands the docs show, and a --data run
    "stage 3, dp=8, 100 steps": "--stage 3 --mesh dp=8 --steps 100",
    "stage 2, dp=4 x tp=2, fp16, accum 4": "--stage 2 --mesh dp=4,tp=2 --precision fp16 --accum 4",
    "stage 3, HSDP replica=2 x dp=4, 2 processes": "--stage 3 --mesh replica=2,dp=4 --processes 2",
    "stage 1, dp=2 x pp=4, circular": "--stage 1 --mesh dp=2,pp=4 --microbatches 8 --repeats 2",
    "stage 3, fp32, --data text file": "--stage 3 --precision fp32 --data {text}",
}


def machine() -> dict:
    """The CPU this ran on: model, cores, the vector extensions that decide fp32 reduction order."""
    model, flags = platform.processor() or platform.machine(), set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.machine(), platform.processor()):
                model = value.strip()
            if key.strip() in ("flags", "Features"):
                flags = set(value.split())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    vector = [f for f in ("avx512f", "avx2", "asimd", "sve") if f in flags]
    return {"cpu": model, "arch": platform.machine(), "cores": cores, "vector_extensions": vector}


def run_once(flags: tuple[str, ...], timeout: float) -> dict:
    cmd = [sys.executable, str(EXAMPLE), *flags, "--no-progress"]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        code, out = None, f"timed out after {timeout} s: {e}"
    seconds = time.perf_counter() - start
    return {
        "returncode": code,
        "seconds": round(seconds, 1),
        "finished": code == 0,
        "deadlock": "rendezvous" in out and "Termination timeout" in out,
        "tail": "" if code == 0 else out[-1500:],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="runs of the main command")
    parser.add_argument("--variant-runs", type=int, default=5, help="runs of each other variant")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "corpus.txt"  # a plain text file for --data: a few standard-library modules
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        text.write_text(
            "\n".join((stdlib / n).read_text(encoding="utf-8") for n in ("abc.py", "bisect.py", "heapq.py"))
        )
        jobs = [("main command", tuple(MAIN.split()), args.runs)]
        jobs += [(name, tuple(line.format(text=text).split()), args.variant_runs) for name, line in VARIANTS.items()]
        results = []
        for name, flags, runs in jobs:
            runs_out = []
            for i in range(runs):
                r = run_once(flags, args.timeout)
                runs_out.append(r)
                status = "ok" if r["finished"] else ("DEADLOCK" if r["deadlock"] else f"exit {r['returncode']}")
                print(f"{name} [{i + 1}/{runs}]: {status} in {r['seconds']:.0f} s", flush=True)
            results.append({"name": name, "flags": list(flags), "runs": runs_out})

    info = machine()
    print(f"\n{info['cpu']} ({info['arch']}, {info['cores']} cores, {', '.join(info['vector_extensions']) or '-'})")
    print(f"{'command':<46}{'finished':>10}{'deadlocks':>11}{'median s':>10}")
    for r in results:
        done = f"{sum(x['finished'] for x in r['runs'])}/{len(r['runs'])}"
        times = sorted(x["seconds"] for x in r["runs"] if x["finished"]) or [float("nan")]
        deadlocks = sum(x["deadlock"] for x in r["runs"])
        print(f"{r['name']:<46}{done:>10}{deadlocks:>11}{times[len(times) // 2]:>10.0f}")
    out = {"machine": info, "date": time.strftime("%Y-%m-%d"), "results": results}
    if args.json is not None:
        from zjax import write_json_atomic

        write_json_atomic(args.json, out)
        print(f"written to {args.json}")
    return out


if __name__ == "__main__":
    main()
