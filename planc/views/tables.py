"""Plain-text tables for the terminal: aligned columns, numbers right-aligned."""

from __future__ import annotations

from typing import Sequence


def table(header: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "") -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    numeric = [all(_is_number(row[i]) for row in cells[1:] if row[i] not in ("", "..."))
               and len(cells) > 1 for i in range(len(header))]

    def line(row: list[str]) -> str:
        parts = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)]
        return (indent + "  ".join(parts)).rstrip()

    rule = indent + "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(row) for row in cells[1:]])


def _is_number(text: str) -> bool:
    head = text.split(" ")[0].replace(",", "").replace("%", "")
    try:
        float(head)
    except ValueError:
        return False
    return True
