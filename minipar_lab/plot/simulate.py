"""Narayanan et al.'s Table 1 and their ZeRO-3 comparison, published against `minipar simulate`'s
prediction, drawn by bench simulate's own plot (`minipar_lab.bench.simulate.save_plot`).

    python -m minipar plot simulate [--out DIR]     (the same figure: bench simulate --plot FILE)
Lesson: lessons/14_simulate.md.
"""

from __future__ import annotations

from pathlib import Path

from minipar_lab.bench import simulate

FILE = "14_simulate.png"


def add_arguments(p) -> None:
    """No options: the published rows are fixed."""


def draw(args, path: Path) -> None:
    simulate.save_plot(str(path))
