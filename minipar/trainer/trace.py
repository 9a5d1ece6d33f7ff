"""A timeline of the run for a trace viewer: every rank's compute, communication and memory (--trace DIR).

The idea: minipar already records what happens (the pipeline's actions for its Gantt chart, every
collective on the traffic ledger, memory by category, offload moves); a trace puts them on one clock in
the Chrome trace event format, the JSON that PyTorch's profiler, DeepSpeed and JAX export and that
Perfetto (ui.perfetto.dev) and chrome://tracing open: one process per rank (pid = rank), one track per
stream (tid), times in microseconds. Nothing is patched: the recorder listens through hooks with
removable handles (the ledger's `subscribe`, the memory ledger's, the engine's phase hook, the
runner's action hook, the offload move meter) and the trainer marks its steps and checkpoint saves.

    tid 0  compute        step N > forward_backward > pipeline schedule > F/B/W actions;
                          optimizer_step; checkpoint saves
    tid 1  communication  every watched wait ("X"), a blocking call's bytes, dimension, intra/inter split
    tid 2  non-blocking   DDP's and ZeRO-3's collectives in flight: async "b"/"e" pairs (they overlap)
    tid 3  offload        block moves between tiers, by direction
    counters               "memory: <category>" bytes held (activations, params, ...), per rank

Every rank records on its own monotonic clock (perf_counter); ranks on rank 0's host share it, a rank
on another host is shifted by an offset measured against rank 0 at start (Cristian's ping-pong: the
round trip bounds the error; both are in the trace's metadata). At the end every rank hands its events
to rank 0 (uncharged control messages), which writes DIR/trace.json; `minipar trace summary FILE`
reads the figures back (trainer/trace_summary.py).

What it saves: nothing; it shows where a step's time goes. What it costs: a list append per event
while on (every saved activation moves the memory counter); when off, nothing is subscribed and each
charge or memory change tests an empty list. Lesson: lessons/07_3d.md.
"""

from __future__ import annotations

import json
import math
import os
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

from minipar.core.options import option
from minipar.distributed.watchdog import WATCHDOG, watching
from minipar.memory.offload import move_meter
from minipar.parallel.pipeline import SCHEDULE

TRACE_FILE = "trace.json"
MARKER = ".minipar-trace"  # in DIR: minipar wrote this folder's trace.json (never the user's own)
MARKER_TEXT = "minipar train --trace writes trace.json here (minipar/trainer/trace.py)\n"
FORMAT = "minipar-trace/1"
COMPUTE, COMM, ASYNC, OFFLOAD = 0, 1, 2, 3
THREADS = {COMPUTE: "compute", COMM: "communication (waits)", ASYNC: "communication (non-blocking)",
           OFFLOAD: "offload"}
SYNC_ROUNDS = 8  # ping-pongs per remote rank: the shortest round trip gives the tightest bound


@dataclass
class TraceOptions:
    """A timeline for a trace viewer (trainer/trace.py)."""
    trace: str | None = option(None, "write DIR/trace.json: every rank's compute, communication and memory "
                               "on one timeline (Chrome trace event format; open it in ui.perfetto.dev)",
                               single_process=None)


def config_errors(options: TraceOptions) -> list[str]:
    """--trace DIR: a folder (made if missing) that can be written, whose trace.json, if any, is minipar's."""
    if options.trace is None:
        return []
    folder = Path(options.trace)
    if options.trace == "":
        return ["--trace needs a path, got an empty string"]
    if folder.exists() and not folder.is_dir():
        return [f"--trace {options.trace} is a file, not a directory"]
    existing = next(p for p in [folder, *folder.absolute().parents] if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        return [f"--trace {options.trace}: the folder {existing} is not writable"]
    target = folder / TRACE_FILE
    if (target.exists() or target.is_symlink()) and not (folder / MARKER).is_file():
        return [f"--trace {options.trace} holds a {TRACE_FILE} that minipar did not write (no {MARKER} "
                "there): choose another folder, or move that file"]
    if target.exists() and not target.is_file():
        return [f"--trace {options.trace}: {target} is not a regular file"]
    return []


class Recorder:
    """This rank's events on its own clock (perf_counter seconds), until they are merged.

    A listener of the traffic ledger: a blocking call's charge arrives inside its wait (between `began`
    and `waited`) and becomes the wait's arguments; a non-blocking call's charge names it (`pending`)
    and opens an async span that its wait closes; any other charge (an isend) is an instant."""

    def __init__(self):
        self.events: list[dict] = []
        self.open_waits: list[dict] = []  # watched waits begun and not yet ended (innermost last)
        self.memory: dict[str, int] = {}  # the last value of each counter: only changes are recorded
        self.actions_this_step: set[str] = set()  # labels begun in this step's schedule (F&B stretches)
        # Each counter change: nine events in ten are these, one per saved activation, so they go into
        # flat arrays (seconds, category's index, bytes), which allocate no object the garbage collector
        # must visit (a dict or a tuple each would, and make it run about once a step), and become events
        # only when the trace is written.
        self.count_times, self.count_categories, self.count_bytes = array("d"), array("B"), array("q")
        self.category_index: dict[str, int] = {}  # each category's number in count_categories

    def counts(self) -> int:
        """Memory counter changes recorded so far."""
        return len(self.count_times)

    def all_events(self) -> list[dict]:
        """The events so far, the memory counters' among them."""
        names = [f"memory: {category}" for category in self.category_index]
        return self.events + [{"ph": "C", "name": names[index], "tid": COMPUTE, "t": seconds,
                               "args": {"bytes": nbytes}} for seconds, index, nbytes
                              in zip(self.count_times, self.count_categories, self.count_bytes)]

    def span(self, tid: int, name: str, started: float, stopped: float, cat: str, args=None) -> dict:
        event = {"ph": "X", "name": name, "cat": cat, "tid": tid, "t": started, "end": stopped,
                 "args": dict(args or {})}
        self.events.append(event)
        return event

    def instant(self, tid: int, name: str, cat: str, args=None, at: float | None = None) -> None:
        self.events.append({"ph": "i", "s": "t", "name": name, "cat": cat, "tid": tid,
                            "t": time.perf_counter() if at is None else at, "args": dict(args or {})})

    # ---- the traffic ledger's listener (distributed/ledger.py) ----
    def began(self, dim: str, op: str, started: float) -> None:
        self.open_waits.append({"dim": dim})

    def charged(self, dim: str, op: str, nbytes: int, link: str, pending: int | None) -> None:
        bytes_args = {"op": op, "dim": dim, "bytes": nbytes, "intra_bytes": 0, "inter_bytes": 0}
        bytes_args[f"{link}_bytes"] = nbytes
        if pending is not None:  # a non-blocking collective starts: it overlaps what follows
            self.events.append({"ph": "b", "name": op, "cat": "comm", "id": str(pending), "tid": ASYNC,
                                "t": time.perf_counter(), "args": bytes_args})
        elif self.open_waits:  # a blocking call: its bytes go on its wait
            args = self.open_waits[-1]
            for key in ("bytes", "intra_bytes", "inter_bytes"):
                args[key] = args.get(key, 0) + bytes_args[key]
            args["op"] = op
        else:  # a send that nobody waits for here (a pipeline's isend)
            self.instant(ASYNC, op, "comm", bytes_args)

    def waited(self, dim: str, op: str, started: float, ended: float, pending: int | None) -> None:
        args = self.open_waits.pop() if self.open_waits else {"dim": dim}
        self.span(COMM, op, started, ended, "comm", args)
        if pending is not None:
            self.events.append({"ph": "e", "name": op, "cat": "comm", "id": str(pending), "tid": ASYNC,
                                "t": ended, "args": {}})

    # ---- the other hooks ----
    def action(self, label: str, started: float, stopped: float) -> None:
        if label == SCHEDULE:  # the stage's whole schedule, after its actions: what the bubble is over
            self.span(COMPUTE, "pipeline schedule", started, stopped, "schedule")
            self.actions_this_step.clear()
        elif label in self.actions_this_step:  # a later stretch of an action an F&B step interleaved
            self.span(COMPUTE, label, started, stopped, "action", {"op": label[0], "continues": True})
        else:
            self.actions_this_step.add(label)
            self.span(COMPUTE, label, started, stopped, "action", {"op": label[0]})

    def phase(self, name: str, started: float, stopped: float) -> None:
        self.span(COMPUTE, name, started, stopped, "phase")

    def memory_changed(self, category: str, nbytes: int) -> None:
        if self.memory.get(category) != nbytes:
            self.memory[category] = nbytes
            self.count_times.append(time.perf_counter())
            self.count_categories.append(self.category_index.setdefault(category, len(self.category_index)))
            self.count_bytes.append(nbytes)

    def moved(self, category: str, source: str, target: str, nbytes: int, started: float, stopped: float):
        self.span(OFFLOAD, f"{source}->{target}", started, stopped, "offload",
                  {"category": category, "bytes": nbytes})


def in_microseconds(events: list[dict], rank: int, shift_s: float) -> list[dict]:
    """The events in the trace's form: integer microseconds on rank 0's clock (`shift_s`: this rank's
    offset minus rank 0's start), pid = rank. Rounding down keeps the order of every edge, so spans
    that nest in seconds nest in microseconds; a span lasts its rounded end minus its rounded start."""
    out = []
    for event in events:
        event = dict(event)
        ts = math.floor((event.pop("t") + shift_s) * 1e6)
        if "end" in event:
            event["dur"] = math.floor((event.pop("end") + shift_s) * 1e6) - ts
        out.append({**event, "ts": ts, "pid": rank})
    return out


def clock_offset(world, nodes: list[str], rounds: int = SYNC_ROUNDS) -> tuple[float, float]:
    """(offset, error bound) in seconds of this rank's perf_counter against rank 0's: rank 0's clock
    reads about (this rank's + offset). On rank 0's host they share one clock: (0, 0). Elsewhere, ping-
    pong with rank 0, which reads its clock at the middle of each round trip: the error is at most half
    the trip, and the shortest trip of `rounds` wins. Collective over `world` (an mpi4py communicator)."""
    rank = world.Get_rank()
    remote = [r for r in range(world.Get_size()) if nodes[r] != nodes[0]]
    if rank == 0:
        for peer in remote:  # one at a time: each peer's round trips are not slowed by the others'
            for _ in range(rounds):
                world.recv(source=peer, tag=7)
                world.send(time.perf_counter(), dest=peer, tag=7)
        return 0.0, 0.0
    if rank not in remote:
        return 0.0, 0.0
    best = (0.0, math.inf)
    for _ in range(rounds):
        sent = time.perf_counter()
        world.send(None, dest=0, tag=7)
        theirs = world.recv(source=0, tag=7)
        back = time.perf_counter()
        if (back - sent) / 2 < best[1]:
            best = (theirs - (sent + back) / 2, (back - sent) / 2)
    return best


class Trace:
    """--trace DIR on one rank: the recorder's subscriptions, the clock, and the merge into one file."""

    def __init__(self, directory: str, world, grid, memory, engine):
        self.directory, self.world, self.grid = Path(directory), world, grid
        self.recorder = Recorder()
        mpi = world.mpi
        with watching("measuring the clock against rank 0 (--trace)", world.name, world.world_ranks,
                      world.world_ranks[world.rank]):
            self.origin = mpi.bcast(time.perf_counter() if world.rank == 0 else None, root=0)
            self.offset, self.error_bound = clock_offset(mpi, grid.nodes)
        self.memory, self.engine = memory, engine
        self.handles: list = []
        self.listen()

    def listen(self) -> None:
        """Subscribe the recorder to every hook; `stop` removes them. A trace may stop and listen again:
        `bench trace` does, on every other step, to measure the trace's cost in one job."""
        recorder = self.recorder
        self.handles = [self.world.ledger.subscribe(recorder), self.memory.subscribe(recorder.memory_changed),
                        self.engine.register_phase_hook(recorder.phase),
                        self.engine.runner.register_action_hook(recorder.action),
                        move_meter.subscribe(recorder.moved), WATCHDOG.add_reporter(self.stalled)]

    def shift(self) -> float:
        return self.offset - self.origin

    def span(self, name: str, started: float, stopped: float, args=None) -> None:
        """A span of the trainer's own (a step, a checkpoint save) on the compute track, while listening."""
        if self.handles:
            self.recorder.span(COMPUTE, name, started, stopped, "trainer", args)

    def stop(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def stalled(self, line: str) -> None:
        """The watchdog is ending this rank (a collective stalled): no merge will happen, so the rank
        writes its own events so far, the stall last, to DIR/trace-rank-R.json (a trace on its own)."""
        so_far = self.recorder.all_events()  # the memory counters' last: the stall goes after them
        self.recorder.instant(COMM, "watchdog: " + line.strip(), "watchdog")
        rank = self.world.rank  # pid = rank, as in the merged trace
        events = in_microseconds(so_far + self.recorder.events[-1:], rank, self.shift())
        tids = {COMPUTE} | {e["tid"] for e in events}
        named = metadata_events(rank, self.grid.coords_of(self.world.rank), tids)
        try:
            write_atomically(self.directory / f"trace-rank-{rank}.json", {"traceEvents": named + events})
        except OSError:
            pass  # the process is ending with the watchdog's line: that line is what matters

    def finish(self, records: list[dict]) -> None:
        """Every rank's events to rank 0, which writes DIR/trace.json. Collective over the world."""
        self.stop()
        mine = in_microseconds(self.recorder.all_events(), self.world.rank, self.shift())
        clock = (self.offset, self.error_bound)
        gathered = self.world.gather_obj((mine, clock, self.grid.coords_of(self.world.rank)), root=0)
        if self.world.rank == 0:
            write_trace(self.directory, gathered, self.grid, [r["step"] for r in records])


def metadata_events(rank: int, coords, tids) -> list[dict]:
    """Names for the viewer: each rank a process named by its place in the grid, each stream a thread."""
    dp, pp, tp, cp = coords
    events = [{"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "ts": 0,
               "args": {"name": f"rank {rank} (dp {dp}, pp {pp}, tp {tp}, cp {cp})"}},
              {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "ts": 0,
               "args": {"sort_index": rank}}]
    return events + [{"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "ts": 0,
                      "args": {"name": THREADS[tid]}} for tid in sorted(tids)]


def write_trace(directory: Path, gathered: list, grid, steps: list[int]) -> None:
    events: list[dict] = []
    for rank, (mine, _, coords) in enumerate(gathered):
        events += metadata_events(rank, coords, {COMPUTE} | {e["tid"] for e in mine})
        events += mine
    trace = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {
        "producer": "minipar train", "format": FORMAT, "world_size": len(gathered),
        "layout": {"dp": grid.dp.size, "pp": grid.pp.size, "tp": grid.tp.size, "cp": grid.cp.size},
        "nodes": list(grid.nodes), "steps": steps, "coords": [list(coords) for _, _, coords in gathered],
        "clock": "per host the monotonic clock (perf_counter); ranks on another host than rank 0 shifted "
                 "by an offset measured against rank 0 at start, within the error bound",
        "clock_offset_us": [round(offset * 1e6, 3) for _, (offset, _), _ in gathered],
        "clock_error_bound_us": [round(bound * 1e6, 3) for _, (_, bound), _ in gathered]}}
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / MARKER).is_file():  # before the first trace.json: from now on it is minipar's
        (directory / MARKER).write_text(MARKER_TEXT)
    write_atomically(directory / TRACE_FILE, trace)


def write_atomically(path: Path, trace: dict) -> None:
    """A reader sees the old file or the whole new one, never half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w") as out:
        json.dump(trace, out, separators=(",", ":"))
    os.replace(partial, path)
