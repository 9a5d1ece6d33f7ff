"""The pipeline bubble against the number of micro-batches M: measured, simulated and (K-1)/(M+K-1).

Measured: the median `bubble_measured` of short `minipar train --pp K --schedule S` runs at each M (the
steps after the first), or the rows of `python -m minipar bench pp --json` saved to a file (--bench-json).
Simulated: the idle share of parallel/schedules.py's timeline (F = 1, B = 2), which for GPipe and 1F1B
is the formula exactly.

    python -m minipar plot bubble [--stages 2] [--schedule 1f1b] [--microbatches 1 2 4 8]
                                  [--bench-json FILE] [--out DIR]
Lesson: lessons/06b_pipeline_schedules.md.
"""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import numpy as np

from minipar.parallel.pipeline import bubble_formula
from minipar.parallel.schedules import bubble_fraction, build_schedule, simulate
from minipar_lab.bench import canvas
from minipar_lab.plot.gantt import pipeline_records

FILE = "06_bubble.png"


def add_arguments(p) -> None:
    p.add_argument("--stages", type=int, default=2, help="pipeline stages K (= ranks)")
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"))
    p.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--bench-json", type=Path, default=None, help="the output of `bench pp --json`")


def simulated(schedule: str, stages: int, microbatches: list[int]) -> list[Fraction]:
    """The simulator's bubble fraction at each M (F = 1, B = 2)."""
    return [bubble_fraction(simulate(build_schedule(schedule, stages, m), forward_cost=1, backward_cost=2))
            for m in microbatches]


def measured(schedule: str, stages: int, microbatches: list[int]) -> list[float]:
    """The median measured bubble of the steps after the first, one short run per M."""
    return [float(np.median([r["pipeline"]["bubble_measured"]
                             for r in pipeline_records(stages, schedule, m, steps=4)[1:]]))
            for m in microbatches]


def from_bench(path: Path, schedule: str) -> tuple[int, list[int], list[float]]:
    """(K, M values, measured bubbles) of one schedule's rows in `bench pp --json` output."""
    if not path.is_file():
        raise FileNotFoundError(f"no bench pp JSON file {path}")
    figures = json.loads(path.read_text())
    rows = [r for r in figures["rows"] if r["schedule"] == schedule]
    return figures["stages"], [r["microbatches"] for r in rows], [r["bubble_measured"] for r in rows]


def draw(args, path: Path) -> None:
    if args.bench_json:
        stages, ms, bubbles = from_bench(args.bench_json, args.schedule)
    else:
        stages, ms = args.stages, args.microbatches
        bubbles = measured(args.schedule, stages, ms)
    plt = canvas.pyplot()
    figure, ax = plt.subplots(figsize=(6, 4))
    dense = np.arange(1, max(ms) + 1)
    ax.plot(dense, [float(bubble_formula(stages, m)) for m in dense], "-", color="grey",
            label="(K-1)/(M+K-1)")
    ax.plot(ms, [float(b) for b in simulated(args.schedule, stages, ms)], "s", fillstyle="none",
            markersize=9, label="simulated")
    ax.plot(ms, bubbles, "o-", label="measured (median of steps)")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="micro-batches M", ylabel="bubble fraction", ylim=(0, 1),
           title=f"{args.schedule}, K = {stages} stages")
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.minorticks_off()
    ax.grid(alpha=0.3)
    ax.legend()
    canvas.save(figure, path)
