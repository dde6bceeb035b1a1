"""Plain-text tables whose columns never run together: each column is as wide as its widest cell."""

from __future__ import annotations

from collections.abc import Sequence

SEP = "|"
"""A column whose header is this is drawn as a vertical rule between groups of columns."""


def text_table(columns: Sequence[tuple[str, str]], rows: Sequence[Sequence[str]]) -> list[str]:
    """Lines of a table: the header, then one line per row.

    Args:
      columns: ``(header, align)`` per column, ``align`` ``"<"`` (left) or ``">"`` (right); a header equal
        to :data:`SEP` makes a rule column (its cells are ignored).
      rows: one cell string per column.

    Every column is one space apart from the next and as wide as its header or widest cell, so figures of
    any size stay apart (``1,840.024`` and ``1,967.346*`` never print as ``1,840.0241,967.346*``).

    Raises:
      ValueError: a row whose length differs from the columns', or an align other than ``<``/``>``.
    """
    for header, align in columns:
        if align not in ("<", ">"):
            raise ValueError(f"text_table: column {header!r} has align {align!r}; use '<' or '>'.")
    for i, row in enumerate(rows):
        if len(row) != len(columns):
            raise ValueError(f"text_table: row {i} has {len(row)} cells for {len(columns)} columns.")
    widths = [
        1 if header == SEP else max([len(header), *(len(row[j]) for row in rows)])
        for j, (header, _) in enumerate(columns)
    ]

    def line(cells: Sequence[str]) -> str:
        parts = [
            SEP if header == SEP else f"{cell:{align}{width}}"
            for cell, (header, align), width in zip(cells, columns, widths, strict=True)
        ]
        return " ".join(parts).rstrip()

    return [line([h for h, _ in columns]), *(line(row) for row in rows)]
