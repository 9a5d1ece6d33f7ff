"""How every benchmark takes its times: medians of repeated runs, ratios from alternating runs, and
training runs under mpiexec, whose JSON-lines logs hold the per-step times.

One way of timing for all of them, so that their figures can be set side by side:
  warm-up   one untimed run first: first-touch allocations, caches, connection set-up and kernel
            compilation are paid once, not counted in the figures.
  median    of repeated runs, not their mean: a shared machine's interruptions only ever add time,
            and the median ignores a few of them.
  rounds    two or more things compared are timed in alternation, one of each per round, so that all
            of them see the same load from moment to moment; a ratio is the median of the per-round
            ratios, far steadier on a busy machine than the quotient of two medians taken one after
            the other. Each round takes its works in a new order (shuffled, seeded): a work leaves
            its arrays in the cache and its freed blocks in malloc for the next one, and a work that
            always followed the same other one would carry that in its figures (`bench autograd`
            measured minipar's step of ShallowSpeed's MLP 1.3-1.5% slower right after the
            hand-written step than right after itself; appendix 01b).
  ranks     each process of an mpiexec run gets one BLAS thread: a rank stands for one device, and
            ranks sharing cores with their own thread pools would measure oversubscription.
  spread    a table shows a median with half the interquartile range of what it is the median of
            ("65.4 ± 3.1", `spread`, `plus_minus`), and a long benchmark says on stderr which of its
            configurations it is running (`Progress`).
  faults    a step's minor page faults (`minor_page_faults`) show what the allocator did beside the
            time: first touches of pages the kernel handed out.
Used by every file in minipar_lab/bench. Launching a job under mpiexec and reading its log is the
reference's own (minipar/trainer/launch.py): the tests and the lessons use it too.
"""

from __future__ import annotations

import resource
import sys
import time
from typing import Callable

import numpy as np

ROUND_ORDER_SEED = 0  # the shuffled orders of round_times' rounds


def nothing() -> None:
    """The default `before` and `sync`: a CPU's work is done when its function returns."""


def round_times(works: dict[str, Callable], repeats: int, sync: Callable = nothing,
                before: Callable = nothing) -> dict[str, np.ndarray]:
    """Seconds of each of `works` in each of `repeats` rounds, the works taking turns within a round
    in an order shuffled each round (the same orders on every rank and in every run: a seeded
    generator), after one untimed warm-up of each. `sync()` waits for work queued on a device (a GPU)
    and is timed with it; `before()` runs untimed before each run (a barrier, so that all ranks start
    together)."""
    for work in works.values():
        work()
        sync()
    times: dict[str, list[float]] = {name: [] for name in works}
    names, orders = list(works), np.random.default_rng(ROUND_ORDER_SEED)
    for _ in range(repeats):
        for i in orders.permutation(len(names)):
            name, work = names[i], works[names[i]]
            before()
            started = time.perf_counter()
            work()
            sync()
            times[name].append(time.perf_counter() - started)
    return {name: np.array(seconds) for name, seconds in times.items()}


def median_seconds(work: Callable, repeats: int, sync: Callable = nothing,
                   before: Callable = nothing) -> float:
    """Median seconds of work() over `repeats` runs, after one untimed warm-up."""
    return float(np.median(round_times({"work": work}, repeats, sync, before)["work"]))


def median(items, key: Callable = lambda item: item) -> float:
    """The median of key(item) over items: of one figure across the records of a training log."""
    return float(np.median([key(item) for item in items]))


SPREAD = "median ± half the interquartile range"  # what "a ± b" means in every timing table


def spread(items, key: Callable = lambda item: item) -> tuple[float, float]:
    """(median, half the interquartile range) of key(item) over items: where the middle of repeated
    measurements is, and how far their middle half strays from it. Both ignore the few runs a shared
    machine's interruptions slow down, as a mean and a standard deviation would not."""
    q1, middle, q3 = np.percentile([key(item) for item in items], [25, 50, 75])
    return float(middle), float((q3 - q1) / 2)


def plus_minus(middle: float, half_range: float, scale: float = 1.0, digits: int = 1) -> str:
    """A median and its spread as a table shows them: "65.4 ± 3.1" (times `scale`, `digits` decimals)."""
    return f"{middle * scale:.{digits}f} ± {half_range * scale:.{digits}f}"


def minor_page_faults(who: int) -> int:
    """Minor page faults so far (first touches of pages the kernel handed out) of this process
    (who=resource.RUSAGE_SELF) or of its children that finished (RUSAGE_CHILDREN: mpiexec's ranks,
    once it returned)."""
    return resource.getrusage(who).ru_minflt


class Progress:
    """One line to stderr per configuration of a long benchmark, "[bench dp] 3/8 dp=2 overlap", so
    that a run of minutes shows where it is; stdout keeps only the tables (the lessons quote them)."""

    def __init__(self, bench: str, total: int):
        self.bench, self.total, self.done = bench, total, 0

    def __call__(self, configuration: str) -> None:
        self.done += 1
        print(f"[bench {self.bench}] {self.done}/{self.total} {configuration}", file=sys.stderr, flush=True)
