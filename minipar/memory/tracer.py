"""Gemini's memory stats collector: the device memory that is not model states, moment by moment.

The idea (Colossal-AI's Gemini; Fang et al., "Parallel Training of Pre-Trained Models via Chunk-Based
Dynamic Memory Management", 2022): the device holds the model states a rank keeps (its blocks) and the
*non-model* memory of the step, activations saved for backward and temporary buffers (gathered
chunks, gradients being handed over). A static budget does not know the second part, so a budget too
small for the activations fails in the middle of a step. A training step repeats itself, so one
warm-up step can measure it. The offloading store (memory/offload.py) marks a *moment* at every use of
a block and at the end of every use; the tracer records, for each moment of the warm-up, the peak of
the non-model memory until the next moment, and the least device budget the step needed: at every
change, the blocks that could not move (in use) plus the non-model bytes. From then on the store knows
what is coming: it evicts ahead of need for the non-model memory about to grow, and prefetches only
what will not have to leave again before it is used. A budget below the warm-up's least is refused
(parallel/zero_chunked.py); at or above it, the step cannot run out.

What it saves: a failed run (the budget is checked against the measured step, not an estimate), and
the bytes of blocks that a blind prefetch brings in only to evict them again. What it costs: a list of
integers per moment, and one warm-up step placed without the trace. Lesson: lessons/08_memory.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from minipar.core import autograd
from minipar.memory.ledger import buffer_meter

MiB = 2**20
AUTO = "auto"  # `--device-mem-mb auto`: the least budget the warm-up step needs


def budget_mb(text: str) -> float | str:
    """`--device-mem-mb`'s value: MiB, or `auto` (argparse names this function in its message)."""
    return AUTO if text.strip().lower() == AUTO else float(text)


def round_up_mb(nbytes: int, places: int = 4) -> float:
    """nbytes in MiB rounded up to `places` decimals: a figure to print that, typed back, still fits."""
    scale = 10**places
    mb = math.ceil(nbytes * scale / MiB) / scale
    while mb * MiB < nbytes:  # the decimal's float may sit a hair below: one more step up
        mb += 1 / scale
    return mb


class BudgetTooSmall(ValueError):
    """The warm-up step needed more device memory than the budget: a user's mistake (exit code 2)."""


def settled_budget(least: int, budget: float, auto: bool) -> float:
    """The budget in bytes after the warm-up, given the `least` it needed on any rank: auto's (the least,
    rounded up to a figure one can type), or `budget` if it is enough; else BudgetTooSmall."""
    least_mb = round_up_mb(least)
    if auto:
        return least_mb * MiB
    if budget < least:
        raise BudgetTooSmall(
            f"--device-mem-mb {budget / MiB:g} is too small: the warm-up step needed {least_mb:.4f} MiB on "
            f"the device (blocks in use, gathered chunks and activations at their peak); give at least "
            f"--device-mem-mb {least_mb:.4f}, or --device-mem-mb auto")
    return budget


def non_model_sources() -> dict[str, Callable[[], int]]:
    """The live non-model bytes of this process: autograd's activation meter and the buffer meter."""
    return {"activations": lambda: autograd.activation_meter.current, "buffers": lambda: buffer_meter.current}


class MemoryTracer:
    """The warm-up's trace of non-model memory (per moment) and the least budget it needed; afterwards,
    how much the non-model memory will still grow before the next moment, while the step keeps to it.

    The store calls `moment(label)` when a block is used (and when the use ends), `observe(immovable,
    model, extra)` at every change of the meters and before it makes room, and `end_step()`."""

    def __init__(self, sources: dict[str, Callable[[], int]] | None = None):
        self.sources = sources or non_model_sources()
        self.recording = True  # the warm-up step: measure, and let the budget be overdrawn
        self.labels: list = []  # each moment of the warm-up: ("use", key) or ("done", keys)
        self.peaks: list[int] = []  # peak non-model bytes from each moment to the next
        self.samples: list[dict] = []  # every observation of the warm-up (the lesson's plot)
        self.minimum = 0  # the least device budget the warm-up needed
        self.moment_index = -1  # the current moment of this step
        self.on_trace = True  # this step has met the warm-up's moments so far

    def others(self) -> int:
        return sum(read() for read in self.sources.values())

    def moment(self, label):
        self.moment_index += 1
        if self.recording:
            self.labels.append(label)
            self.peaks.append(self.others())
        elif self.moment_index >= len(self.labels) or self.labels[self.moment_index] != label:
            self.on_trace = False  # another step than the warm-up's (an evaluation, say): no forecasts

    def observe(self, immovable: int, model: int, extra: int = 0):
        """Now `immovable` bytes of blocks cannot leave the device (in use), `model` bytes of blocks are
        on it, and `extra` bytes are about to be allocated beside the non-model memory."""
        if not self.recording:
            return
        others = self.others()
        need = immovable + others + extra
        self.minimum = max(self.minimum, need)
        if self.peaks:
            self.peaks[-1] = max(self.peaks[-1], others)
        self.samples.append({"moment": max(self.moment_index, 0), "model": model, "need": need,
                             **{name: read() for name, read in self.sources.items()}})

    def growth_ahead(self) -> int:
        """Bytes the non-model memory will still grow before the next moment, by the warm-up's trace
        (0 while recording or off the trace: then nothing is forecast)."""
        if self.recording or not self.on_trace:
            return 0
        return max(0, self.peaks[self.moment_index] - self.others())

    def end_step(self):
        self.recording, self.moment_index, self.on_trace = False, -1, True

    def summary(self) -> dict:
        """The warm-up in figures: moments, the least budget, the peaks of each source and of both."""
        peaks = {name: max((s[name] for s in self.samples), default=0) for name in self.sources}
        return {"moments": len(self.labels), "minimum_bytes": self.minimum, "non_model_peak":
                max(self.peaks, default=0), **{f"{name}_peak": value for name, value in peaks.items()}}
