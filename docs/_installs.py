"""The install each block of a page runs with: what the page has told its reader to install by then.

A reader installs zjax once (``pip install -e .``, the README's first command and the getting-started page's) and
adds an extra where a page shows one: a ``bash`` block made only of ``pip install -e ".[extra,...]"`` commands (a
page's install block, not run as a command). The blocks after it on that page run with those extras too; no block
runs with an extra its page has not named by then (CI's own ``[test]`` and ``[docs]`` extras are not the pages').

Each distinct set of extras gets one virtual environment under ``.docs_envs/``, built once and reused by the
snippet and figure runners (``docs/snippets.py``, ``docs/figures.py``; ``--here`` runs in the current environment
instead): ``base`` by ``pip install -e .``, and each extra on top of it (a ``.pth`` file puts base's packages on
its path, so only the extra's own requirements install there); a set of extras layers their environments.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterable
from pathlib import Path

from _pages import PIP_INSTALL, ROOT, Block, blocks

ENVS = ROOT / ".docs_envs"
INSTALL = re.compile(rf"^{PIP_INSTALL}$")
# a reader's one-time setup line (docs/_pages.py's SETUP) names the extras it installs too
_SETUP_EXTRAS = re.compile(rf"{PIP_INSTALL} &&")


def _names(group: str | None) -> frozenset[str]:
    return frozenset(x for x in (group or "").split(",") if x)


def install_of(block: Block) -> frozenset[str] | None:
    """The extras an install block names (``frozenset()`` for ``pip install -e .``); ``None`` for any other block."""
    if block.lang != "bash" or block.needs:
        return None
    matches = [INSTALL.match(c) for c in block.commands()]
    if not matches or not all(matches):
        return None
    return frozenset().union(*(_names(m.group(1)) for m in matches if m))


def extras_by_line(page: Path) -> dict[int, frozenset[str]]:
    """Each block's extras (by its opening line): those the page's install blocks and setup lines above it, and
    its own setup line, name (blocks CI does not run, ``# needs`` or ``# run by``, count for nothing)."""
    seen: frozenset[str] = frozenset()
    out: dict[int, frozenset[str]] = {}
    for block in blocks(page):
        if block.lang == "bash" and not block.needs:  # a block CI does not run installs nothing for the page
            named = [_names(m.group(1)) for m in _SETUP_EXTRAS.finditer(block.text)]
            seen = seen.union(*named, install_of(block) or frozenset())
        out[block.line] = seen
    return out


def _requirements(extras: Iterable[str]) -> list[str]:
    """The requirement strings of ``extras`` (``pyproject.toml``'s optional dependencies)."""
    table = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    unknown = sorted(set(extras) - set(table))
    if unknown:
        raise SystemExit(f"a page installs unknown extras {unknown}; pyproject.toml has {sorted(table)}")
    return sorted({r for x in extras for r in table[x]})


class Environments:
    """The virtual environments of the pages' installs (``here``: the current interpreter for every install)."""

    def __init__(self, here: bool = False) -> None:
        self.here = here

    def _dir(self, extras: frozenset[str]) -> Path:
        return ENVS / ("-".join(sorted(extras)) or "base")

    def prepare(self, needed: Iterable[frozenset[str]]) -> None:
        """Build the environments of ``needed`` that are missing or older than ``pyproject.toml``: base by ``pip
        install -e .``; one per extra, base's packages on its path and the extra's own requirements installed; a
        set of several extras, the paths of base and of each of its extras' environments."""
        if self.here:
            return
        needed = set(needed)
        _requirements(set().union(*needed))  # an unknown extra stops the run before anything is built
        stamp = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
        singles = {frozenset({x}) for extras in needed for x in extras}
        for extras in sorted(needed | singles | {frozenset()}, key=lambda e: (len(e), sorted(e))):
            where = self._dir(extras)
            if (where / "zjax-docs-stamp").is_file() and (where / "zjax-docs-stamp").read_text() == stamp:
                continue
            t0 = time.perf_counter()
            # one pip, base's, installs into every environment (``--python``): the layers are made without their own
            venv = [sys.executable, "-m", "venv", "--clear", *(["--without-pip"] if extras else []), str(where)]
            subprocess.run(venv, check=True)
            base_python, own_python = self._dir(frozenset()) / "bin" / "python", where / "bin" / "python"
            pip = [str(base_python), "-m", "pip", "--python", str(own_python)]
            pip += ["install", "-q", "--disable-pip-version-check"]
            if extras:
                below = [frozenset(), *([frozenset({x}) for x in sorted(extras)] if len(extras) > 1 else [])]
                paths = "".join(f"import site; site.addsitedir({_purelib(self._dir(b))!r})\n" for b in below)
                Path(_purelib(where), "_zjax_docs_below.pth").write_text(paths)
                if len(extras) == 1:
                    _quiet([*pip, *_requirements(extras)])
                _scripts(self._dir(frozenset()), where)
            else:
                _quiet([*pip, "-e", str(ROOT)])
            (where / "zjax-docs-stamp").write_text(stamp)
            print(f"env  {where.name}  {time.perf_counter() - t0:.1f}s", flush=True)

    def env(self, extras: frozenset[str]) -> dict[str, str]:
        """The environment variables of a block run with ``extras``."""
        env = dict(os.environ)
        env.setdefault("JAX_PLATFORMS", "cpu")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
        if not self.here:
            bin_dir = self._dir(extras) / "bin"
            env["VIRTUAL_ENV"] = str(bin_dir.parent)
            env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
            env.pop("PYTHONHOME", None)
        return env

    def python(self, extras: frozenset[str]) -> str:
        return sys.executable if self.here else str(self._dir(extras) / "bin" / "python")


def _scripts(base: Path, env: Path) -> None:
    """zjax's console scripts (``zjax``) in ``env``, as base's run by ``env``'s interpreter."""
    table = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    for name in table:
        _, body = (base / "bin" / name).read_text().split("\n", 1)
        script = env / "bin" / name
        script.write_text(f"#!{env / 'bin' / 'python'}\n{body}")
        script.chmod(0o755)


def _purelib(env: Path) -> str:
    """The site-packages directory of the virtual environment ``env``."""
    code = "import sysconfig; print(sysconfig.get_path('purelib'))"
    return subprocess.run(
        [str(env / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


def _quiet(command: list[str]) -> None:
    """Run a pip command; on failure show its output and stop."""
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"$ {' '.join(command)}\n(exit {proc.returncode})\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
