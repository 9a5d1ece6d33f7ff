"""The benchmarks' tables: a header line and one line per row, every column right-aligned to its
widest cell, two spaces apart, so that figures of one kind line up digit under digit.
Used by the benches that print tables (dp, tp, pp, layouts, memory, context, tracer, recompute, zero3);
the lessons quote their output."""

from __future__ import annotations

from typing import Callable


def right_aligned(rows: list[dict], columns: list[tuple[str, Callable]]) -> list[str]:
    """The table's lines. columns: (header, how to show a row's figure), in order."""
    cells = [[header for header, _ in columns]] + [[str(show(row)) for _, show in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return ["  ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in cells]
