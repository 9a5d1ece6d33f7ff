"""`python -m minipar bench trace`: what `--trace DIR` costs a training step.

The same `minipar train` job twice per round, once plain and once with `--trace` (minipar/trainer/
trace.py: every phase, pipeline action, collective, memory change and offload move recorded on every
rank; rank 0 merges the ranks' files once, after the last step), in a shuffled order each round (seeded,
as timing.py's rounds). Each job's step time is the median of its log's `time_s` after the warm-up
steps, so neither the start-up nor the merge at the end is counted: the cost asked of a trace is the one
it adds to every step. The table: each way's median step, and the trace's cost as the median of the
per-round ratios (timing.py: far steadier on a shared machine than the quotient of two medians).

    python -m minipar bench trace [--ranks 2] [--repeats 5] [--steps 8] [--warmup 2] [--json]
        [-- TRAIN OPTIONS...]        default: --pp 2 --microbatches 4 (the pipeline's actions traced)
Lesson: lessons/07_3d.md (a run's timeline).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import numpy as np

from minipar.trainer.launch import run_train
from minipar_lab.bench.table import right_aligned
from minipar_lab.bench.timing import SPREAD, plus_minus, spread

DEFAULT_LAYOUT = ["--pp", "2", "--microbatches", "4"]


def step_seconds(ranks: int, train_args: list[str], log: Path, trace: Path | None, warmup: int) -> float:
    """Median seconds of the steps after `warmup` of one job, plain or with `--trace trace`."""
    records = run_train(ranks, [*train_args, *(["--trace", str(trace)] if trace else [])], log)
    return float(np.median([record["time_s"] for record in records[warmup:]]))


def trace_figures(ranks: int, train_args: list[str], repeats: int, steps: int, warmup: int,
                  folder: Path) -> dict:
    """Per round, one plain and one traced job in a shuffled order: their median steps and ratios."""
    args = [*train_args, "--steps", str(steps)]
    order = random.Random(0)
    times: dict[str, list[float]] = {"plain": [], "traced": []}
    for round_ in range(repeats):
        ways = ["plain", "traced"]
        order.shuffle(ways)
        for way in ways:  # each traced job its own folder: a trace never writes over a file it did not make
            trace = folder / f"trace-{round_}" if way == "traced" else None
            times[way].append(step_seconds(ranks, args, folder / f"{way}.jsonl", trace, warmup))
    plain, traced = np.array(times["plain"]), np.array(times["traced"])
    rows = []
    for way, seconds in (("plain", plain), ("traced", traced)):
        middle, half_range = spread(seconds)
        rows.append({"way": way, "step_ms": 1e3 * middle, "step_ms_spread": 1e3 * half_range})
    return {"config": {"ranks": ranks, "train_args": args, "repeats": repeats, "warmup": warmup},
            "ways": rows, "cost": float(np.median(traced / plain - 1)), "per_round": list(traced / plain - 1)}


def main(argv) -> int:
    parser = argparse.ArgumentParser(prog="minipar bench trace")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("train_args", nargs="*", help="minipar train's options (after --)")
    args = parser.parse_args(argv)
    train_args = args.train_args or DEFAULT_LAYOUT
    with tempfile.TemporaryDirectory() as folder:
        figures = trace_figures(args.ranks, train_args, args.repeats, args.steps, args.warmup, Path(folder))
    if args.json:
        json.dump(figures, sys.stdout)
        print()
        return 0
    print(f"{args.ranks} ranks, minipar train {' '.join(train_args)} --steps {args.steps}: median step after "
          f"{args.warmup} warm-up, {args.repeats} rounds, each a plain and a traced job in a shuffled order "
          f"({SPREAD})")
    columns = [("way", lambda r: "--trace DIR" if r["way"] == "traced" else "no trace"),
               ("step", lambda r: f"{plus_minus(r['step_ms'], r['step_ms_spread'])} ms")]
    print("\n".join(right_aligned(figures["ways"], columns)))
    print(f"the trace's cost: {100 * figures['cost']:+.1f}% a step (median of the rounds' ratios: "
          + ", ".join(f"{100 * r:+.1f}%" for r in figures["per_round"]) + ")")
    return 0
