"""Heterogeneous memory: a device with a byte budget, CPU memory and disk, and blocks that move
between them on demand (PatrickStar; ZeRO-Offload and ZeRO-Infinity).

The idea: what a rank keeps between uses (for chunked ZeRO-3: each chunk's shard of the parameters,
of the gradients, and of each optimizer state, one *block* each) need not stay on the device. A block
lives in exactly one tier. Using it brings it to the device; when the device budget is full, another
block is first evicted to the lower tier: CPU memory, or disk (`numpy.memmap` files). Which one goes?

    LRU  the least recently used one;
    OPT  Belady's choice: the one whose next use is furthest in the future. A training step repeats
         the same accesses, so the first step is recorded as a trace and the future is known exactly.

After each use, the next block of the trace is prefetched if it fits in the free room (a GPU would
copy it while computing). The budget covers everything on the device: the resident blocks plus the
`others()` bytes the caller reports (activations, gathered chunks, gradient buffers); `relieve()`
evicts blocks when those grow, and a budget that cannot be kept is a MemoryError, never exceeded.
With a `MemoryTracer` (memory/tracer.py, Gemini's placement) the first step measures instead: it marks
a moment at every use, records the non-model memory and the least budget the step needs, and may
overdraw (the caller refuses such a budget after it); later steps evict ahead of the non-model memory
the trace says is coming, and prefetch a block only if it fits beside it until its use.

What it saves: device memory; the model may be many times the budget. What it costs: traffic between
tiers (counted by direction, per step), in the time of PCIe or of a disk.
Lesson: lessons/08_memory.md.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import os
import shutil
import tempfile
import time
import weakref
from collections import Counter

import numpy as np

from minipar.core import backend
from minipar.core.hooks import HookList, RemovableHandle
from minipar.memory.ledger import TIERS  # device, cpu, disk: the ledger's tiers, fastest first
from minipar.memory.tracer import MemoryTracer

POLICIES = ("lru", "opt")  # `minipar train --eviction`
OFFLOADS = ("none", *TIERS[1:])  # `minipar train --offload`: keep every block on the device, or a lower tier
MiB = 2**20
# what traffic() counts besides bytes: wasted prefetches were evicted before their use (moved twice for
# nothing), late evictions made room in the middle of a computation (the others outgrew a forecast)
COUNTS = ("fetches", "prefetches", "wasted_prefetches", "evictions", "late_evictions", "off_trace")


class MoveMeter:
    """Every counted move of a block between tiers, as it happens, for whoever listens (a trace,
    trainer/trace.py): `listener(category, source, target, nbytes, started, stopped)`, perf_counter
    seconds. The same moves `traffic()` counts by direction."""

    def __init__(self):
        self.listeners = HookList()

    def subscribe(self, listener) -> RemovableHandle:
        return self.listeners.add(listener)

    def moved(self, category: str, source: str, target: str, nbytes: int, started: float, stopped: float):
        self.listeners.call_all(category, source, target, nbytes, started, stopped)


move_meter = MoveMeter()


class DiskTier:
    """One `numpy.memmap` file per block, made in a temporary folder that never outlives its creation.

    Each file is created already unlinked (`tempfile.TemporaryFile`) and the folder is removed as soon
    as the files exist, even if creating them fails: nothing is left on disk whatever happens to the
    process, since the system frees an unlinked file's space when its last handle closes.

    Each file's blocks are reserved on disk when made (posix_fallocate): a memmap over a sparse file
    on a full disk dies of SIGBUS at the first write it cannot store; a reservation fails at once,
    with ENOSPC, as an OSError naming the folder."""

    def __init__(self, shapes: dict, parent: str | None = None):
        self.folder = tempfile.mkdtemp(prefix="minipar-offload-", dir=parent)
        self.files, self.arrays = [], {}
        try:
            for key, (shape, dtype) in shapes.items():
                self.files.append(tempfile.TemporaryFile(dir=self.folder))
                reserve(self.files[-1], int(np.prod(shape)) * np.dtype(dtype).itemsize, parent)
                self.arrays[key] = np.memmap(self.files[-1], dtype=dtype, mode="w+", shape=shape)
        except BaseException:
            self.close()
            raise
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)
        self._closer = weakref.finalize(self, _close_files, self.files)

    def close(self):
        self.arrays = {}
        _close_files(self.files)


def reserve(file, nbytes: int, parent: str | None) -> None:
    """Allocate the file's blocks now, so that a full disk is an error here and not a bus error later."""
    if nbytes and hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(file.fileno(), 0, nbytes)
        except OSError as error:
            where = parent or tempfile.gettempdir()
            raise OSError(error.errno, f"--offload disk: cannot reserve {nbytes} bytes in {where} "
                          f"({error.strerror})") from None


def _close_files(files):
    for handle in files:
        handle.close()


class Block:
    """An array of one category ("params", "grads" or "optimizer") that lives in one tier."""

    def __init__(self, key, data, category: str, tier: str):
        self.key, self.data, self.category, self.tier = key, data, category, tier
        self.nbytes = data.nbytes
        self.prefetched = False  # brought in ahead of its use, and not used since


class TieredStore:
    """Blocks in device, cpu and disk tiers under a device byte budget, moved on use, with eviction."""

    def __init__(self, blocks: dict, budget_bytes: float | None, lower_tier: str | None, policy: str = "opt",
                 others=lambda: 0, report=None, prefetch: bool = True, tracer: MemoryTracer | None = None,
                 disk_folder: str | None = None):
        """blocks: {key: (array, category)}, all on the device to start with. `tracer`: place by the
        first step's memory trace (None: by the budget alone, the static placement); `disk_folder`:
        where --offload disk's files go (None: the system's temporary folder)."""
        if lower_tier not in (None, "cpu", "disk") or policy not in POLICIES:
            raise ValueError(f"lower tier {lower_tier!r}, policy {policy!r}: choose cpu or disk, lru or opt")
        self.backend = backend.current()
        self.budget = math.inf if budget_bytes is None else budget_bytes
        self.lower, self.policy, self.others, self.report = lower_tier, policy, others, report
        self.prefetching, self.tracer = prefetch, tracer
        shapes = {key: (array.shape, array.dtype) for key, (array, _) in blocks.items()}
        self.disk = DiskTier(shapes, disk_folder) if lower_tier == "disk" else None
        self.blocks = {key: Block(key, a, category, "device") for key, (a, category) in blocks.items()}
        self.pinned = Counter()
        self.trace, self.recording, self.positions = [], True, {}  # the accesses of the first step
        self.clock, self.now, self.tick, self.last_used = 0, -1, 0, {}
        self.in_step = False  # from the first use after a step's end to the end of the next step
        self.moved, self.counts = Counter(), Counter()
        self.last_step: dict | None = None
        for block in self.blocks.values():
            if self.lower:
                self._move(block, self.lower, count=False)
        self.make_room(0)  # with no lower tier every block stays on the device: it must fit
        self._report()

    # ---- where the bytes are ----
    def resident(self) -> int:
        return sum(b.nbytes for b in self.blocks.values() if b.tier == "device")

    def free(self) -> float:
        return self.budget - self.resident() - self.others()

    def immovable(self) -> int:
        """Bytes of blocks on the device that cannot leave it now: in use (all, without a lower tier)."""
        return sum(b.nbytes for b in self.blocks.values()
                   if b.tier == "device" and (self.lower is None or self.pinned[b.key]))

    def _observe(self, extra: int = 0):
        if self.tracer is not None:
            self.tracer.observe(self.immovable(), self.resident(), extra)

    def _moment(self, label):
        if self.tracer is not None:
            self.tracer.moment(label)
            self._observe()

    def warming_up(self) -> bool:
        """The tracer's first step: it measures what the step needs, and the budget may be overdrawn."""
        return self.tracer is not None and self.tracer.recording

    def placement(self) -> dict:
        """{category: {tier: bytes}} of every block."""
        held = {category: dict.fromkeys(TIERS, 0) for category in ("params", "grads", "optimizer")}
        for block in self.blocks.values():
            held[block.category][block.tier] += block.nbytes
        return held

    def _report(self):
        if self.report:
            for category, tiers in self.placement().items():
                for tier, nbytes in tiers.items():
                    self.report(category, nbytes, tier)

    # ---- use, eviction, prefetch ----
    @contextlib.contextmanager
    def use(self, *keys):
        """The blocks' arrays on the device, in the order of `keys`, pinned there until the `with` ends."""
        pinned = []
        try:
            for key in keys:
                block = self.blocks[key]
                self._record(key)
                self.pinned[key] += 1  # before making room: the block in use is never the victim
                block.prefetched = False
                pinned.append(key)
                self._moment(("use", key))
                fetch = 0 if block.tier == "device" else block.nbytes
                self.evict_ahead(fetch)
                if fetch:
                    self.make_room(block.nbytes)
                    self._move(block, "device")
                    self.counts["fetches"] += 1
            yield [self.blocks[key].data for key in keys]
        finally:
            for key in pinned:
                self.pinned[key] -= 1
        self._moment(("done", keys))
        self.evict_ahead(0)
        self.prefetch()

    def read(self, key) -> np.ndarray:
        """The block's values as a host array, wherever it lives (no move, not counted as traffic)."""
        return np.asarray(self.backend.to_host(self.blocks[key].data))

    def write(self, key, values: np.ndarray):
        """Set the block's values from a host array, wherever it lives (no move, not counted): a
        checkpoint's (checkpoint/sharded.py)."""
        block = self.blocks[key]
        block.data[...] = self.backend.from_host(values) if block.tier == "device" else values

    def make_room(self, nbytes: float):
        """Evict unpinned blocks until `nbytes` more fit in the budget, or raise MemoryError (in the
        tracer's warm-up: overdraw, the tracer has recorded the need)."""
        self._observe(int(nbytes))
        while self.free() < nbytes:
            candidates = self.evictable()
            if (not candidates or self.lower is None) and self.warming_up():
                return
            if not candidates or self.lower is None:
                needed = (nbytes - self.free()) / MiB
                raise MemoryError(f"the device budget of {self.budget / MiB:.3f} MiB is {needed:.3f} MiB "
                                  f"short: {self.resident() / MiB:.3f} MiB of blocks that cannot move (lower "
                                  f"tier: {self.lower}) and {self.others() / MiB:.3f} MiB of others")
            self._move(self.victim(candidates), self.lower)
            self.counts["evictions"] += 1

    def evictable(self) -> list[Block]:
        return [b for b in self.blocks.values() if b.tier == "device" and not self.pinned[b.key]]

    def relieve(self):
        """The others grew during a step: evict blocks until the device is back within its budget."""
        self._observe()
        if self.in_step and self.free() < 0:
            evictions = self.counts["evictions"]
            self.make_room(0)  # in the middle of a computation: unforeseen (no trace, or off it)
            self.counts["late_evictions"] += self.counts["evictions"] - evictions

    def evict_ahead(self, fetch: int):
        """Leave room for `fetch` bytes and for what the trace says the others will still grow before
        the next moment, evicting by the policy now rather than in the middle of the computation.
        Best effort: what cannot be evicted now is left to make_room and relieve."""
        if self.lower is None or self.tracer is None:
            return
        room = fetch + self.tracer.growth_ahead()
        while self.free() < room and (candidates := self.evictable()):
            self._move(self.victim(candidates), self.lower)
            self.counts["evictions"] += 1

    def victim(self, candidates: list[Block]) -> Block:
        # exercise 08.2: the eviction policy: Belady's OPT and LRU
        if self.policy == "opt" and self.positions:  # Belady: furthest next use; ties, least recent
            return max(candidates, key=lambda b: (self.next_use(b.key), -self.last_used.get(b.key, 0)))
        return min(candidates, key=lambda b: self.last_used.get(b.key, 0))
        # end exercise

    def next_use(self, key) -> float:
        """Accesses from now until `key` is used again, by the trace (the step repeats)."""
        positions = self.positions.get(key)
        if not positions:
            return math.inf
        now = self.now % len(self.trace)
        later = bisect.bisect_right(positions, now)
        return positions[later] - now if later < len(positions) else len(self.trace) - now + positions[0]

    def prefetch(self):
        """Bring the block the trace uses next to the device, if it fits in the free room."""
        if not (self.prefetching and self.positions):
            return
        block = self.blocks[self.trace[self.clock % len(self.trace)]]
        reserved = self.tracer.growth_ahead() if self.tracer is not None else 0  # the others' growth to come
        if block.tier != "device" and self.free() - reserved >= block.nbytes:
            self._move(block, "device")
            self.counts["prefetches"] += 1
            block.prefetched = True

    def _record(self, key):
        self.now, self.clock, self.tick, self.in_step = self.clock, self.clock + 1, self.tick + 1, True
        self.last_used[key] = self.tick
        if self.recording:
            self.trace.append(key)
        elif key != self.trace[self.now % len(self.trace)]:
            self.counts["off_trace"] += 1  # OPT's future was wrong here (a forward outside training, say)

    def _move(self, block: Block, tier: str, count: bool = True):
        started = time.perf_counter()
        if tier == "device":
            data = self.backend.xp.array(block.data)  # a copy: host -> device
        elif tier == "cpu":
            data = np.array(self.backend.to_host(block.data))
        else:
            data = self.disk.arrays[block.key]
            data[...] = self.backend.to_host(block.data)
        if block.prefetched and tier != "device":  # it moved twice for nothing
            self.counts["wasted_prefetches"] += 1
            block.prefetched = False
        if count:
            self.moved[f"{block.tier}->{tier}"] += block.nbytes
            move_meter.moved(block.category, block.tier, tier, block.nbytes, started, time.perf_counter())
        block.data, block.tier = data, tier
        self._report()

    # ---- steps ----
    def end_step(self):
        """A training step ended: the first one's accesses become the trace; its traffic is kept."""
        if self.recording:
            self.recording = False
            for position, key in enumerate(self.trace):
                self.positions.setdefault(key, []).append(position)
        self.clock, self.in_step = 0, False
        if self.tracer is not None:
            self.tracer.end_step()
        self.last_step = self.traffic()
        self.moved, self.counts = Counter(), Counter()

    def traffic(self) -> dict:
        """Bytes moved between tiers, by direction, and the fetches, prefetches and evictions."""
        return {"moved_bytes": sum(self.moved.values()), "by_direction": dict(self.moved),
                **{name: self.counts[name] for name in COUNTS}}

    def close(self):
        if self.disk:
            self.disk.close()
