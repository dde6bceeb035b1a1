"""A small HTML table renderer for Jupyter (``_repr_html_``), and the byte and mesh texts the tables share.

It knows nothing of zjax's objects: each of them (a state's layout, a memory report, a planner estimate) builds
its own rows and hands them here.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

_STYLE = (
    "<style>.zjax-t{border-collapse:collapse;font:12px monospace}.zjax-t td,.zjax-t th{padding:2px 8px;"
    "border-bottom:1px solid #ddd;text-align:left}.zjax-t td.n,.zjax-t th.n{text-align:right}"
    ".zjax-t caption{text-align:left;font-weight:bold;padding:4px 0}.zjax-t tr.sum td{font-weight:bold}</style>"
)


def fmt_bytes(n: float | None) -> str:
    """``n`` bytes in GiB, MiB, KiB or B; ``"-"`` for ``None``."""
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def mesh_text(shape: dict[str, int]) -> str:
    """The mesh axes that split anything, ``"dp=4 x tp=2"`` (``"1 device"`` when none does)."""
    return " x ".join(f"{k}={v}" for k, v in shape.items() if v > 1) or "1 device"


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[Any]],
    caption: str = "",
    numeric: Sequence[int] = (),
    bold_last: bool = False,
) -> str:
    """A small HTML table; columns in ``numeric`` are right-aligned. Cells are escaped."""

    def cell(tag: str, j: int, value: Any) -> str:
        cls = ' class="n"' if j in numeric else ""
        return f"<{tag}{cls}>{html.escape(str(value))}</{tag}>"

    head = "".join(cell("th", j, h) for j, h in enumerate(headers))
    body = []
    for r, row in enumerate(rows):
        cls = ' class="sum"' if bold_last and r == len(rows) - 1 else ""
        body.append(f"<tr{cls}>" + "".join(cell("td", j, v) for j, v in enumerate(row)) + "</tr>")
    cap = f"<caption>{html.escape(caption)}</caption>" if caption else ""
    return f'{_STYLE}<table class="zjax-t">{cap}<tr>{head}</tr>{"".join(body)}</table>'
