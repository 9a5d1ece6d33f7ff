"""Gemini's memory trace of a chunked ZeRO-3 warm-up step, drawn by bench tracer's own plot
(`minipar_lab.bench.tracer`: its `trace` measurement, without the tables).

    python -m minipar plot trace [--out DIR]       (the same figure: bench tracer --plot FILE)
Lesson: lessons/08_memory.md.
"""

from __future__ import annotations

from pathlib import Path

from minipar_lab.bench import tracer

FILE = "08_memory_trace.png"


def add_arguments(p) -> None:
    """No options: the trace of bench tracer's default run."""


def draw(args, path: Path) -> None:
    tracer.save_plot(str(path), tracer.measure_trace())
