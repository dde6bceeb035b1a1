"""Run every code block of the README and the docs, as a reader would (conventions: ``docs/_pages.py``).

    python docs/snippets.py                  # every page
    python docs/snippets.py docs/concepts/stages.md --list
    python docs/snippets.py --jobs 1         # one block at a time (default: two)
    python docs/snippets.py --here           # in this environment, not the pages' own installs

A python block runs in a fresh interpreter with the blocks that continue it; a bash block's commands run
from the repository root. Each runs with the install its page has told the reader to do by then
(``docs/_installs.py``: ``pip install -e .`` and the extras the page names), in a virtual environment of
those packages alone. Units run two at a time (a compile is single-threaded); each writes only its own
paths (a temporary directory, or a ``runs/`` folder no other block names).

Figures (a command and its printed output) are left to ``docs/figures.py``, which runs them and compares.
Exit status 1 when a block fails, with the page, line and traceback.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _installs import Environments, extras_by_line, install_of  # noqa: E402
from _pages import ROOT, Block, blocks, figures, pages  # noqa: E402

TIMEOUT_S = 600
# run inside the fresh interpreter: exec each block of a chain in one namespace, reporting its page and line
_DRIVER = """
import json, sys, traceback
chain = json.load(sys.stdin)
namespace = {"__name__": "__main__"}
for where, source in chain:
    try:
        exec(compile(source, where, "exec"), namespace)
    except BaseException:
        print(f"FAILED: a block of {where}", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
"""


def chains(page: Path) -> tuple[list[list[Block]], list[Block], list[Block]]:
    """A page's python chains (a whole block and the blocks continuing it), bash blocks to run, blocks not run."""
    figure_commands = {f.command.line for f in figures(page)}
    runs: list[list[Block]] = []
    commands: list[Block] = []
    skipped: list[Block] = []
    for b in blocks(page):
        if b.lang == "python":
            if b.needs:
                compile(b.text, b.where, "exec")  # a block CI cannot run still parses
                skipped.append(b)
            elif b.continues:
                if not runs:
                    raise SystemExit(f"{b.where}: '# continues the block above' with no python block above it")
                runs[-1].append(b)
            else:
                runs.append([b])
        elif b.lang == "bash":
            if b.needs or b.line in figure_commands or install_of(b) is not None:
                skipped.append(b)
            else:
                commands.append(b)
    return runs, commands, skipped


def run_chain(chain: list[Block], envs: Environments, extras: frozenset[str]) -> tuple[bool, str]:
    payload = json.dumps([(b.page, "\n" * b.line + b.text) for b in chain])  # tracebacks give page lines
    proc = subprocess.run(
        [envs.python(extras), "-c", _DRIVER],
        input=payload,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=envs.env(extras),
        timeout=TIMEOUT_S,
    )
    return proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]


def run_commands(block: Block, envs: Environments, extras: frozenset[str]) -> tuple[bool, str]:
    for command in block.commands():
        proc = subprocess.run(
            command, shell=True, capture_output=True, text=True, cwd=ROOT, env=envs.env(extras), timeout=TIMEOUT_S
        )
        if proc.returncode != 0:
            return False, f"$ {command}\n(exit {proc.returncode})\n{proc.stdout[-2000:]}{proc.stderr[-6000:]}"
    return True, ""


def _run(unit: list[Block] | Block, envs: Environments, extras: frozenset[str]) -> tuple[bool, str, float]:
    t0 = time.perf_counter()
    ok, log = run_chain(unit, envs, extras) if isinstance(unit, list) else run_commands(unit, envs, extras)
    return ok, log, time.perf_counter() - t0


def _why(block: Block) -> str:
    if block.needs:
        return block.needs
    return "the page's install (its environment)" if install_of(block) is not None else "figure (docs/figures.py)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("pages", nargs="*", type=Path, help="pages to run (default: the README and docs/)")
    parser.add_argument("--list", action="store_true", help="list the blocks and what runs them, run nothing")
    parser.add_argument("--jobs", type=int, default=2, help="units run at once (compiles are single-threaded)")
    parser.add_argument("--here", action="store_true", help="run in this environment, not the pages' installs")
    args = parser.parse_args(argv)
    units: list[tuple[str, str, list[Block] | Block, frozenset[str]]] = []
    for page in [p.resolve() for p in args.pages] or pages():
        runs, commands, skipped = chains(page)
        extras = extras_by_line(page)
        found = [(c[0].where, f"python x{len(c)}", c, extras[c[0].line]) for c in runs]
        found += [(b.where, "bash", b, extras[b.line]) for b in commands]
        found.sort(key=lambda u: u[2][0].line if isinstance(u[2], list) else u[2].line)
        if args.list:
            print("\n".join(f"run   {where}  {kind}  [{','.join(sorted(x))}]" for where, kind, _, x in found))
            print("\n".join(f"skip  {b.where}  {b.lang}: {_why(b)}" for b in skipped))
        units += found
    if args.list:
        return 0
    envs = Environments(here=args.here)
    envs.prepare(u[3] for u in units)
    failed: list[str] = []
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = pool.map(lambda u: _run(u[2], envs, u[3]), units)  # printed in page order as each finishes
        for (where, kind, _, _), (ok, log, seconds) in zip(units, results, strict=True):
            print(f"{'ok  ' if ok else 'FAIL'} {where}  {kind}  {seconds:.1f}s", flush=True)
            if not ok:
                failed.append(where)
                print(log, flush=True)
    print(f"{len(units)} blocks run in {time.perf_counter() - start:.0f}s; {len(failed)} failed {failed or ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
