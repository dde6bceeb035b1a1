"""Regenerate or check every figure of the README and the docs: a command block and the output printed below it.

    python docs/figures.py --check           # recompute each figure; fail on any that changed (CI)
    python docs/figures.py --write           # recompute and rewrite the pages (and the plots the commands write)
    python docs/figures.py --check docs/concepts/stages.md

A figure is a ``bash`` block followed by a ``text`` block (``docs/_pages.py``). Its commands run from the
repository root; their standard output is the figure. Durations (``3.6s``) are wall-clock and not compared;
every other number is, exactly, unless the command block's first line states a tolerance (``# figures within
0.5% across CPUs (fp32 sums)``). A figure whose first line is ``# measured on <date>, <device>, commit <sha>``
holds what CI cannot recompute (a GPU's numbers, wall-clock times, a run longer than CI's budget): it is not
recomputed, and the line must be there. Figures with the same commands (a headline figure repeated on its
concept page) are computed once. A figure's commands run with the install its page has told the reader to do by
then (``docs/_installs.py``; ``--here``: in this environment).
"""

from __future__ import annotations

import argparse
import difflib
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _installs import Environments, extras_by_line  # noqa: E402
from _pages import ROOT, Figure, figures, pages  # noqa: E402

TIMEOUT_S = 900
_DURATION = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?(?:ms|s)\b")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?")


def output_of(figure: Figure, env: dict[str, str]) -> str:
    """What the figure's commands print to standard output now (run with the environment variables ``env``)."""
    parts = []
    for command in figure.command.commands():
        proc = subprocess.run(command, shell=True, capture_output=True, text=True, cwd=ROOT, env=env, timeout=TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"{figure.command.where}: $ {command}\n(exit {proc.returncode})\n{proc.stderr[-4000:]}")
        parts.append(proc.stdout)
    return "\n".join(line.rstrip() for line in "".join(parts).strip("\n").split("\n"))


def _numbers(text: str) -> list[float]:
    return [float(n.replace(",", "")) for n in _NUMBER.findall(text)]


def same(shown: str, now: str, tolerance: float) -> bool:
    """Whether a page's figure still holds: equal text with durations masked and runs of spaces as one, numbers
    within the tolerance."""
    a, b = (re.sub(r"[ \t]+", " ", _DURATION.sub("<t>", text.strip())) for text in (shown, now))  # columns shift
    if _NUMBER.sub("<n>", a) != _NUMBER.sub("<n>", b):
        return False
    pairs = zip(_numbers(a), _numbers(b), strict=True)
    return all(x == y or abs(x - y) <= tolerance * max(abs(x), abs(y)) for x, y in pairs)


def _rewrite(path: Path, read: str, updates: list[tuple[Figure, str]]) -> None:
    if path.read_text(encoding="utf-8") != read:
        raise SystemExit(f"{path}: the page changed while its figures ran; run again")
    lines = read.split("\n")
    for figure, text in sorted(updates, key=lambda u: -u[0].output.line):
        lines[figure.output.line : figure.output.end - 1] = text.split("\n")
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines), encoding="utf-8")
    tmp.replace(path)  # never a half-written page


def _timed(figure: Figure, env: dict[str, str]) -> tuple[str | None, float]:
    """The figure's output now (``None`` when its command failed, with the error printed) and the seconds."""
    t0 = time.perf_counter()
    try:
        return output_of(figure, env), time.perf_counter() - t0
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"FAIL {e}", flush=True)
        return None, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="fail on a figure that changed")
    mode.add_argument("--write", action="store_true", help="rewrite the pages' figures")
    parser.add_argument("--jobs", type=int, default=2, help="figures computed at once (compiles are single-threaded)")
    parser.add_argument("--here", action="store_true", help="run in this environment, not the pages' installs")
    parser.add_argument("pages", nargs="*", type=Path, help="pages (default: the README and docs/)")
    args = parser.parse_args(argv)
    stale: list[str] = []
    start = time.perf_counter()
    todo: dict[Path, tuple[str, list[Figure]]] = {}
    extras: dict[str, frozenset[str]] = {}  # by the figure's commands: a figure on two pages needs one install
    for page in [p.resolve() for p in args.pages] or pages():
        recompute = []
        installs = extras_by_line(page)
        for figure in figures(page):
            if not figure.command.first.startswith("# measured"):
                recompute.append(figure)
                extras[figure.command.text] = (
                    extras.get(figure.command.text, frozenset()) | installs[figure.command.line]
                )
            elif not figure.measured:
                stale.append(figure.command.where)
                print(f"FAIL {figure.command.where}: '# measured on <YYYY-MM-DD>, <device>, commit <sha>' expected")
        todo[page] = (page.read_text(encoding="utf-8"), recompute)
    distinct = {f.command.text: f for _, recompute in todo.values() for f in recompute}  # the same commands once
    envs = Environments(here=args.here)
    envs.prepare(extras.values())
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        runs = pool.map(lambda f: _timed(f, envs.env(extras[f.command.text])), distinct.values())
        results = dict(zip(distinct, runs, strict=True))
    for page, (read, recompute) in todo.items():
        updates = []
        for figure in recompute:
            now, seconds = results[figure.command.text]
            if now is None:
                stale.append(figure.command.where)
                continue
            ok = same(figure.output.text, now, figure.tolerance)
            print(f"{'ok   ' if ok else 'STALE'} {figure.command.where}  {seconds:.1f}s", flush=True)
            if not ok:
                updates.append((figure, now))
                diff = difflib.unified_diff(
                    figure.output.text.split("\n"), now.split("\n"), "page", "now", lineterm="", n=1
                )
                print("\n".join(diff), flush=True)
        if args.write and updates:
            _rewrite(page, read, updates)
        elif updates:
            stale += [f.command.where for f, _ in updates]
    print(f"figures {'checked' if args.check else 'written'} in {time.perf_counter() - start:.0f}s", end="")
    if stale:
        print(f"; {len(stale)} failed or stale: {stale}\nRegenerate with: python docs/figures.py --write")
        return 1
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
