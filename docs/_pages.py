"""The code blocks of zjax's Markdown pages (the README and ``docs/``), as data the snippet and figure runners read.

A page's fenced blocks follow four conventions, all visible to a reader:

- A ``python`` block is whole: it runs alone in a fresh interpreter. A block whose first line is
  ``# continues the block above`` runs after the page's previous python block, in the same interpreter and
  namespace.
- A ``bash`` block is a list of commands run from the repository root, one after the other; one made of ``pip
  install -e ".[extra]"`` lines is the page's install (``docs/_installs.py``): the blocks after it run with it.
- A block whose first line starts with ``# needs`` (``# needs a GPU``, ``# needs a cluster``) or ``# run by``
  (a command ``.ci/run`` runs itself) is not run; a python one is still compiled, so it cannot hold a syntax
  error.
- A ``bash`` block followed by a ``text`` block is a figure: the text is what the commands print.
  ``docs/figures.py`` recomputes it; a bash block whose first line is ``# measured on <date>, <device>, commit
  <sha>`` holds numbers CI cannot recompute (a GPU's, wall-clock times, runs longer than CI's budget) and is
  only checked for that line.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONTINUES = "# continues the block above"
NOT_RUN = ("# needs", "# run by")  # a GPU, a cluster; or a command CI runs elsewhere (.ci/run)
MEASURED = re.compile(r"^# measured on (\d{4}-\d{2}-\d{2}), (.+), commit ([0-9a-f]{7,40})\b")
TOLERANCE = re.compile(r"^# figures? within (\d+(?:\.\d+)?)% ")
_FENCE = re.compile(r"^(`{3,}|~{3,})(.*)$")
# zjax installed from this checkout, with the extras (group 1) a reader asks for
PIP_INSTALL = r'pip install (?:-q )?-e "?\.(?:\[([\w,+-]+)\])?"?'
# the setup a reader runs once on a fresh machine; CI has run it (.ci/run) before the pages' commands
SETUP = re.compile(rf"^python3 -m venv \S+ && \. \S+/bin/activate && {PIP_INSTALL} && ")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    path: Path
    line: int  # 1-based line of the opening fence
    end: int  # 1-based line of the closing fence
    lang: str
    text: str

    @property
    def first(self) -> str:
        return self.text.split("\n", 1)[0].strip()

    @property
    def page(self) -> str:
        """The page's path from the repository root (or as given, for a page elsewhere)."""
        return str(self.path.relative_to(ROOT)) if self.path.is_relative_to(ROOT) else str(self.path)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def needs(self) -> str | None:
        """Why the snippet runner leaves the block alone (``None``: it runs it)."""
        return self.first[2:] if self.first.startswith(NOT_RUN) else None

    @property
    def continues(self) -> bool:
        return self.first == CONTINUES

    def commands(self) -> list[str]:
        """A bash block's commands (continuation lines joined, comments and the one-time setup dropped)."""
        out: list[str] = []
        pending = ""
        for raw in self.text.split("\n"):
            line = raw.rstrip()
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            out.append(SETUP.sub("", pending + line).strip())
            pending = ""
        return [c for c in out if c]


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown page, in order (MyST directives such as ``{eval-rst}`` excluded)."""
    found: list[Block] = []
    lines = path.read_text(encoding="utf-8").split("\n")
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group(1), m.group(2).strip()
        j = i + 1
        while j < len(lines) and not lines[j].startswith(fence):
            j += 1
        lang = info.split()[0] if info else ""
        if not lang.startswith("{"):
            found.append(Block(path, i + 1, j + 1, lang, "\n".join(lines[i + 1 : j])))
        i = j + 1
    return found


def pages() -> list[Path]:
    """Every page whose blocks CI runs: the README and the documentation's Markdown pages."""
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)
    return [ROOT / "README.md", *docs]


@dataclasses.dataclass(frozen=True)
class Figure:
    """A command block and the output block right after it."""

    command: Block
    output: Block

    @property
    def measured(self) -> re.Match[str] | None:
        return MEASURED.match(self.command.first)

    @property
    def tolerance(self) -> float:
        """Relative tolerance for numbers that vary with the CPU (fp32 sums), stated in the block."""
        m = TOLERANCE.match(self.command.first)
        return float(m.group(1)) / 100 if m else 0.0


def figures(path: Path) -> Iterator[Figure]:
    """The figures of a page: each bash block immediately followed (blank lines only) by a text block."""
    found = blocks(path)
    lines = path.read_text(encoding="utf-8").split("\n")
    for a, b in zip(found, found[1:], strict=False):
        between = lines[a.end : b.line - 1]
        if a.lang == "bash" and b.lang == "text" and not any(s.strip() for s in between):
            yield Figure(a, b)
