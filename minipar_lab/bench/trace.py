"""`python -m minipar bench trace`: what `--trace DIR` costs a training step.

A `minipar train --trace` job in which the trace listens on every other step only (trainer/trace.py:
`Trace.stop` removes its hooks, `Trace.listen` puts them back), so that every two neighbouring steps are a
plain and a traced step of one job: the same processes, the same memory, the machine's load of that
moment. The cost is the median, over all such pairs after the warm-up steps, of the traced step's time
over its plain neighbour's, minus 1: a ratio measured in one run, alternating. Two separate jobs, one
plain and one traced, differ on a shared 2-core machine by more than the trace costs. Half the jobs
start with a traced step, half with a plain one, so neither way always comes first in its pair. The
table: each way's median step. What the trace does while listening: every phase, pipeline action,
collective, memory change and offload move recorded on every rank; the merge into one file happens
once, after the last step, and is not a step's cost.

    python -m minipar bench trace [--ranks 2] [--repeats 4] [--steps 24] [--warmup 2] [--json]
        [-- TRAIN OPTIONS...]        default: --pp 2 --microbatches 4 (the pipeline's actions traced)
Lesson: lessons/07_3d.md (a run's timeline).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from minipar.trainer.arguments import fail, parse_train_args
from minipar.trainer.launch import run_mpi
from minipar.trainer.validate import validate
from minipar_lab.bench.table import right_aligned
from minipar_lab.bench.timing import SPREAD, plus_minus, spread

DEFAULT_LAYOUT = ["--pp", "2", "--microbatches", "4"]


def alternating_job(traced_first: bool, train_args: list[str]) -> None:
    """Under mpiexec: train with the trace listening on every other step; rank 0 prints, per step,
    whether the trace listened, the step's seconds, its loss and the events recorded during it."""
    from mpi4py import MPI

    from minipar.trainer.loop import Trainer

    world = MPI.COMM_WORLD
    trainer = Trainer(parse_train_args(train_args).resolved(world.Get_size()), world)
    trace, steps = trainer.trace, []
    for step in range(trainer.cfg.steps):
        listening = (step % 2 == 0) == traced_first
        if not listening:
            trace.stop()
        recorded = len(trace.recorder.events) + trace.recorder.counts()
        record = trainer.step(step)
        recorded = len(trace.recorder.events) + trace.recorder.counts() - recorded
        if not listening:
            trace.listen()
        steps.append({"traced": listening, "time_s": record["time_s"], "loss": record["loss"],
                      "events": recorded})
    trace.stop()
    if world.Get_rank() == 0:
        print(json.dumps(steps))


def pair_ratios(steps: list[dict], warmup: int) -> list[float]:
    """Each pair of neighbouring steps after `warmup` (one traced, one plain): traced time / plain time."""
    kept = steps[warmup:]
    pairs = zip(kept[0::2], kept[1::2])
    return [(a if a["traced"] else b)["time_s"] / (b if a["traced"] else a)["time_s"] for a, b in pairs]


def trace_figures(ranks: int, train_args: list[str], repeats: int, steps: int, warmup: int,
                  folder: Path) -> dict:
    """`repeats` alternating jobs: each way's median step, the pairs' ratios and their median."""
    jobs = []
    for job in range(repeats):
        args = [*train_args, "--steps", str(steps), "--quiet", "--trace", str(folder / f"trace-{job}")]
        traced_first = job % 2 == 0
        output = run_mpi(ranks, ["-m", "minipar_lab.bench.trace", "--job",
                                 "traced-first" if traced_first else "plain-first", "--", *args])
        jobs.append(json.loads(output.strip().splitlines()[-1]))
    ratios = [ratio for job in jobs for ratio in pair_ratios(job, warmup)]
    rows = []
    for way, traced in (("plain", False), ("traced", True)):
        seconds = np.array([s["time_s"] for job in jobs for s in job[warmup:] if s["traced"] == traced])
        middle, half_range = spread(seconds)
        rows.append({"way": way, "step_ms": 1e3 * middle, "step_ms_spread": 1e3 * half_range})
    return {"config": {"ranks": ranks, "train_args": train_args, "repeats": repeats, "steps": steps,
                       "warmup": warmup},
            "ways": rows, "cost": float(np.median(ratios) - 1), "pairs": len(ratios),
            "cost_quartiles": [float(q - 1) for q in np.percentile(ratios, [25, 75])], "jobs": jobs}


def input_errors(args, train_args: list[str]) -> list[str]:
    """What is wrong with the bench's own numbers and the training options, before any job starts."""
    errors = [f"--{name} must be at least {least}, got {getattr(args, name)}"
              for name, least in (("ranks", 1), ("repeats", 1), ("warmup", 0)) if getattr(args, name) < least]
    if args.steps < args.warmup + 2:
        errors.append(f"--steps must leave a pair of steps after --warmup {args.warmup}, got {args.steps}")
    if "--trace" in train_args or "--steps" in train_args:
        errors.append("give --steps to the bench, and no --trace: the bench traces into its own folder")
    if not errors:  # an option minipar train does not know: its parser's one line, exit 2
        errors = validate(parse_train_args([*train_args, "--steps", str(args.steps)]), args.ranks)
    return errors


def main(argv) -> int:
    parser = argparse.ArgumentParser(prog="minipar bench trace")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=4, help="jobs (half start with a traced step)")
    parser.add_argument("--steps", type=int, default=24, help="steps of each job, warm-up included")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("train_args", nargs="*", help="minipar train's options (after --)")
    args = parser.parse_args(argv)
    train_args = args.train_args or DEFAULT_LAYOUT
    errors = input_errors(args, train_args)
    if errors:
        return fail("minipar bench trace", "; ".join(errors))
    with tempfile.TemporaryDirectory() as folder:
        figures = trace_figures(args.ranks, train_args, args.repeats, args.steps, args.warmup, Path(folder))
    if args.json:
        json.dump(figures, sys.stdout)
        print()
        return 0
    low, high = figures["cost_quartiles"]
    print(f"{args.ranks} ranks, minipar train {' '.join(train_args)} --steps {args.steps}, {args.repeats} "
          f"jobs, the trace listening on every other step; steps after {args.warmup} warm-up ({SPREAD})")
    columns = [("way", lambda r: "--trace DIR" if r["way"] == "traced" else "no trace"),
               ("step", lambda r: f"{plus_minus(r['step_ms'], r['step_ms_spread'])} ms")]
    print("\n".join(right_aligned(figures["ways"], columns)))
    print(f"the trace's cost: {100 * figures['cost']:+.1f}% a step (median of {figures['pairs']} pairs of "
          f"neighbouring steps; quartiles {100 * low:+.1f}% and {100 * high:+.1f}%)")
    return 0


if __name__ == "__main__":  # one alternating job, launched by trace_figures under mpiexec
    job = argparse.ArgumentParser(prog="minipar_lab.bench.trace")
    job.add_argument("--job", choices=["traced-first", "plain-first"], required=True)
    job.add_argument("train_args", nargs="*")
    parsed = job.parse_args()
    alternating_job(parsed.job == "traced-first", parsed.train_args)
