"""`python -m minipar bench zero3`: ZeRO-3 against DDP on the same model and batch, and what the host
allocator has to do with it.

Runs `minipar train` at --dp 2 (default GPT, batch 32) four ways: DDP and ZeRO-3, each with overlap
(bucket all-reduces from the backward hooks; prefetched gathers) and with --no-overlap, taking turns
in every round (timing.py: alternating rounds, medians after the warm-up steps). Each way runs twice
per round: as `minipar train` runs (freed host memory kept by malloc for reuse, speed/allocator.py) and
under MINIPAR_SYSTEM_MALLOC=1 (glibc's defaults: a free top of the heap goes back to the system, and
its pages are faulted in again at their next use). A row shows rank 0's median tokens/s and
comm_wait_s, its speed against DDP's (the median over rounds of that round's ratio) and the minor
page faults per step and rank: what the ranks of a run fault (getrusage of the finished children)
less what a run of only the warm-up steps faults, over the steps between and the ranks.
Lesson: lessons/04c_zero_appendix.md (the measured table, and the allocator behind it).

    python -m minipar bench zero3 [--dp 2] [--batch-size 32] [--steps 20] [--warmup 3] [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
from pathlib import Path

import numpy as np

from minipar.trainer.launch import run_train
from minipar_lab.bench.table import right_aligned
from minipar_lab.bench.timing import Progress, median, minor_page_faults

WAYS = {"ddp": [], "ddp --no-overlap": ["--no-overlap"], "zero3": ["--zero", "3"],
        "zero3 --no-overlap": ["--zero", "3", "--no-overlap"]}
ALLOCATORS = {"kept": {}, "malloc": {"MINIPAR_SYSTEM_MALLOC": "1"}}  # freed memory kept, or malloc's defaults


def faulting_run(dp: int, train_args: list[str], log: Path, env: dict) -> tuple[list[dict], int]:
    """run_train's records, and the page faults of all the run's processes together."""
    before = minor_page_faults(resource.RUSAGE_CHILDREN)  # mpiexec's ranks, once it returned
    records = run_train(dp, train_args, log, env)
    return records, minor_page_faults(resource.RUSAGE_CHILDREN) - before


def zero3_figures(dp: int, batch_size: int, steps: int, warmup: int, rounds: int) -> dict:
    """{allocator: {way: {tokens_per_s, comm_wait_ms, vs_ddp, faults_per_step}}} from `rounds`
    alternating rounds."""
    train = ["--dp", str(dp), "--batch-size", str(batch_size)]
    progress = Progress("zero3", (rounds + 1) * len(WAYS) * len(ALLOCATORS))
    kept = {(allocator, way): [] for allocator in ALLOCATORS for way in WAYS}  # every round's records
    faults = {key: [] for key in kept}  # every round's faults per step and rank
    start_up = {}  # the faults of a run of the warm-up steps alone: start-up, imports, first steps
    with tempfile.TemporaryDirectory() as folder:  # the runs' log, removed with it
        log = Path(folder) / "zero3.jsonl"
        for allocator, env in ALLOCATORS.items():
            for way, extra in WAYS.items():
                progress(f"warm-up steps alone {way} ({allocator})")
                warm_up = [*train, "--steps", str(warmup), *extra]
                _, start_up[allocator, way] = faulting_run(dp, warm_up, log, env)
        for round_ in range(rounds):
            for way, extra in WAYS.items():
                for allocator, env in ALLOCATORS.items():
                    progress(f"round {round_ + 1} {way} ({allocator})")
                    records, faulted = faulting_run(dp, [*train, "--steps", str(steps), *extra], log, env)
                    kept[allocator, way].append(records[warmup:])
                    # a difference of two runs' counts: where a step faults about never, their noise
                    # can make it a little negative, and no step faults fewer than zero times
                    steps_and_ranks = (steps - warmup) * dp
                    per_step_and_rank = max(0.0, (faulted - start_up[allocator, way]) / steps_and_ranks)
                    faults[allocator, way].append(per_step_and_rank)
    figures: dict = {}
    for (allocator, way), per_round in kept.items():
        speeds = [median(records, lambda r: r["tokens_per_s"]) for records in per_round]
        ddp = [median(records, lambda r: r["tokens_per_s"]) for records in kept[allocator, "ddp"]]
        records = [record for records in per_round for record in records]
        figures.setdefault(allocator, {})[way] = {
            "tokens_per_s": median(records, lambda r: r["tokens_per_s"]),
            "comm_wait_ms": 1e3 * median(records, lambda r: r["comm_wait_s"]),
            "vs_ddp": float(np.median(np.array(speeds) / np.array(ddp))),
            "faults_per_step": float(np.median(faults[allocator, way]))}
    return figures


def table(figures: dict) -> list[str]:
    rows = [{"way": way, **{f"{allocator} {key}": value for allocator, ways in figures.items()
                            for key, value in ways[way].items()}} for way in WAYS]
    columns = [("way", lambda row: row["way"])]
    for allocator in ALLOCATORS:
        columns += [(f"tokens/s ({allocator})", lambda row, a=allocator: f"{row[f'{a} tokens_per_s']:.0f}"),
                    ("wait ms", lambda row, a=allocator: f"{row[f'{a} comm_wait_ms']:.2f}"),
                    ("vs ddp", lambda row, a=allocator: f"{row[f'{a} vs_ddp']:.2f}x"),
                    ("faults/step", lambda row, a=allocator: f"{row[f'{a} faults_per_step']:.0f}")]
    return right_aligned(rows, columns)


def main(argv) -> int:
    parser = argparse.ArgumentParser(prog="minipar bench zero3", description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20, help="steps of each run")
    parser.add_argument("--warmup", type=int, default=3, help="first steps of each run left out")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        parser.error("--warmup must leave at least one of the --steps")
    figures = zero3_figures(args.dp, args.batch_size, args.steps, args.warmup, args.rounds)
    if args.json:
        print(json.dumps(figures))
        return 0
    print(f"minipar train --dp {args.dp} --batch-size {args.batch_size} --steps {args.steps}; medians of "
          f"rank 0's steps after {args.warmup}, {args.rounds} alternating rounds")
    print("kept: freed host memory reused (the default); malloc: MINIPAR_SYSTEM_MALLOC=1, glibc's defaults")
    print("\n".join(table(figures)))
    return 0
