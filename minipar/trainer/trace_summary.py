"""`minipar trace summary FILE`: a trace's figures read back, so a run can be checked without a browser.

`--trace DIR` (trace.py) writes DIR/trace.json in the Chrome trace event format. This module reads one
as any viewer would, from the format alone, and knows nothing of how it was recorded: `format_problems`
checks the format's rules (every event has ph, ts, pid, tid; integer pid and tid; "X" spans last
dur >= 0 and nest on their track, never overlapping in part; counters are "C" events with numbers;
async "b"/"e" pairs close; every process and track is named by an "M" event), and `summary` adds up
per rank the time of each phase, the bytes sent by communicator dimension (and intra/inter-node), the
pipeline's actions and its measured bubble, the peak of each memory counter and the offload bytes by
direction: the figures the run's own log reports (tests/trainer/test_trace.py checks that they agree).
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from collections import Counter, defaultdict

from minipar.trainer.arguments import OneLineParser, fail

PHASES = ("X", "i", "C", "b", "e", "M")
MAX_TRACE_BYTES = 2**30


def format_problems(trace) -> list[str]:
    """Each broken rule of the trace event format, one line each (empty: a valid trace)."""
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ['not a trace: expected a JSON object with a "traceEvents" list']
    problems: list[str] = []
    events = trace["traceEvents"]
    for index, event in enumerate(events):
        problems += [f"event {index}: {p}" for p in _event_problems(event)]
    if problems:
        return problems
    return _nesting_problems(events) + _async_problems(events) + _naming_problems(events)


def _event_problems(event) -> list[str]:
    if not isinstance(event, dict):
        return ["not an object"]
    missing = [key for key in ("ph", "ts", "pid", "tid") if key not in event]
    if missing:
        return [f"has no {', '.join(missing)}"]
    problems = []
    if event["ph"] not in PHASES:
        problems.append(f"unknown phase {event['ph']!r}")
    if not all(isinstance(event[key], int) and not isinstance(event[key], bool) for key in ("pid", "tid")):
        problems.append("pid and tid must be integers")
    if not _number(event["ts"]):
        problems.append("ts must be a number")
    if event["ph"] == "X" and not (_number(event.get("dur")) and event["dur"] >= 0):
        problems.append("an X event needs dur >= 0")
    if event["ph"] == "C" and not (isinstance(event.get("args"), dict) and event["args"]
                                   and all(_number(v) for v in event["args"].values())):
        problems.append("a counter (C) needs numeric args")
    return problems


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _nesting_problems(events) -> list[str]:
    """On each (pid, tid), complete spans are a forest: a span starting inside another ends inside it."""
    tracks = defaultdict(list)
    for event in events:
        if event["ph"] == "X":
            start = event["ts"]
            tracks[event["pid"], event["tid"]].append((start, start + event["dur"], event["name"]))
    problems = []
    for (pid, tid), spans in sorted(tracks.items()):
        open_spans: list[tuple] = []
        for start, end, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_spans and open_spans[-1][1] <= start:
                open_spans.pop()
            if open_spans and end > open_spans[-1][1]:
                problems.append(f"pid {pid} tid {tid}: {name!r} [{start}, {end}] overlaps "
                                f"{open_spans[-1][2]!r} [{open_spans[-1][0]}, {open_spans[-1][1]}] in part")
            open_spans.append((start, end, name))
    return problems


def _async_problems(events) -> list[str]:
    """Every async begin ("b") is ended ("e") once, later, under the same pid, cat and id."""
    opened: dict[tuple, float] = {}
    problems = []
    for event in sorted((e for e in events if e["ph"] in "be"), key=lambda e: (e["ts"], e["ph"] == "e")):
        key = (event["pid"], event.get("cat"), event.get("id"))
        if event["ph"] == "b":
            opened[key] = event["ts"]
        elif opened.pop(key, None) is None:
            problems.append(f"pid {key[0]}: async end {event.get('name')!r} id {key[2]} without its begin")
    return problems + [f"pid {key[0]}: async {key[2]} never ends" for key in opened]


def _naming_problems(events) -> list[str]:
    named_processes = {e["pid"] for e in events if e["ph"] == "M" and e.get("name") == "process_name"}
    named_threads = {(e["pid"], e["tid"]) for e in events
                     if e["ph"] == "M" and e.get("name") == "thread_name"}
    used = {(e["pid"], e["tid"]) for e in events if e["ph"] != "M"}
    return ([f"pid {pid} has no process_name" for pid in sorted({p for p, _ in used} - named_processes)]
            + [f"pid {pid} tid {tid} has no thread_name" for pid, tid in sorted(used - named_threads)])


def summary(trace: dict) -> dict:
    """Per rank (pid): the seconds of each span name's kind (a step, a phase, an action's op, the
    communication waits), bytes by dimension and link, actions, memory peaks, offload bytes."""
    ranks: dict[int, dict] = defaultdict(lambda: {
        "seconds": Counter(), "actions": Counter(), "steps": 0, "bytes_by_dim": Counter(),
        "bytes_by_dim_link": defaultdict(Counter), "memory_peak": {}, "offload_bytes": Counter()})
    for event in trace["traceEvents"]:
        if event["ph"] != "M":
            _add(ranks[event["pid"]], event)
    figures = {pid: _plain(ranks[pid]) for pid in sorted(ranks)}
    for pid, bubbles in measured_bubbles(trace).items():
        figures[pid]["bubble"] = bubbles
    return {"world_size": len(ranks), "otherData": trace.get("otherData", {}), "ranks": figures}


def measured_bubbles(trace: dict) -> dict[int, list[float]]:
    """Each rank's pipeline bubble per step, from its pipeline's "pipeline schedule" spans and actions:
    1 - (the stages' busy time) / (stages x makespan), the makespan from the first stage's start to the
    last one's end (the ranks of one pipeline share (dp, tp, cp) in otherData's coords)."""
    coords = trace.get("otherData", {}).get("coords")
    if not coords:
        return {}
    schedules, actions = defaultdict(list), defaultdict(list)
    for event in trace["traceEvents"]:
        if event["ph"] == "X" and event.get("cat") in ("schedule", "action"):
            (schedules if event["cat"] == "schedule" else actions)[event["pid"]].append(event)
    pipelines = defaultdict(list)
    for pid in sorted(schedules):
        dp, _, tp, cp = coords[pid]
        pipelines[dp, tp, cp].append(pid)
    bubbles = {}
    for stages in pipelines.values():
        steps = zip(*(sorted(schedules[pid], key=lambda e: e["ts"]) for pid in stages))
        per_step = [_bubble(spans, [actions[pid] for pid in stages]) for spans in steps]
        bubbles.update({pid: per_step for pid in stages})
    return bubbles


def _bubble(spans: tuple, actions: list[list[dict]]) -> float:
    """One step's bubble: `spans` each stage's schedule span, `actions` each stage's action spans."""
    busy = sum(a["dur"] for span, mine in zip(spans, actions) for a in mine
               if span["ts"] <= a["ts"] <= span["ts"] + span["dur"])
    makespan = max(s["ts"] + s["dur"] for s in spans) - min(s["ts"] for s in spans)
    return 1.0 - busy / (len(spans) * makespan) if makespan else 0.0


def _add(rank: dict, event: dict) -> None:
    args, cat = event.get("args", {}), event.get("cat")
    if event["ph"] == "X":
        seconds = event["dur"] / 1e6
        if cat == "trainer" and event["name"].startswith("step "):
            rank["steps"] += 1
            rank["seconds"]["step"] += seconds
        elif cat == "phase":
            rank["seconds"][event["name"]] += seconds
        elif cat == "action":  # an action an F&B step interleaved is several spans, counted once
            rank["actions"][args["op"]] += 0 if args.get("continues") else 1
            rank["seconds"][args["op"]] += seconds
        elif cat == "comm":
            rank["seconds"]["comm_wait"] += seconds
        elif cat == "offload":
            rank["offload_bytes"][event["name"]] += args["bytes"]
    if cat == "comm" and "bytes" in args:
        rank["bytes_by_dim"][args["dim"]] += args["bytes"]
        for link in ("intra", "inter"):
            rank["bytes_by_dim_link"][args["dim"]][link] += args[f"{link}_bytes"]
    if event["ph"] == "C":
        name = event["name"].removeprefix("memory: ")
        rank["memory_peak"][name] = max(rank["memory_peak"].get(name, 0), args["bytes"])


def _plain(rank: dict) -> dict:
    return {"steps": rank["steps"], "seconds": dict(rank["seconds"]), "actions": dict(rank["actions"]),
            "bytes_by_dim": dict(rank["bytes_by_dim"]),
            "bytes_by_dim_link": {dim: dict(links) for dim, links in rank["bytes_by_dim_link"].items()},
            "memory_peak": rank["memory_peak"], "offload_bytes": dict(rank["offload_bytes"])}


def summary_text(name: str, figures: dict) -> str:
    """The summary as lines: counts and bytes first (the same on any machine), the seconds last."""
    layout = figures["otherData"].get("layout", {})
    lines = [f"{name}: {figures['world_size']} ranks ("
             + ", ".join(f"{dim} {size}" for dim, size in layout.items()) + "), the format's rules kept"]
    for pid, rank in figures["ranks"].items():
        actions = " ".join(f"{op} {n}" for op, n in sorted(rank["actions"].items())) or "none"
        sent = ", ".join(f"{dim} {n:,} B (intra {rank['bytes_by_dim_link'][dim]['intra']:,}, inter "
                         f"{rank['bytes_by_dim_link'][dim]['inter']:,})"
                         for dim, n in sorted(rank["bytes_by_dim"].items())) or "nothing"
        peaks = ", ".join(f"{category} {n:,} B" for category, n in sorted(rank["memory_peak"].items()))
        lines += [f"rank {pid}: {rank['steps']} steps, actions {actions}",
                  f"  sent: {sent}", f"  memory peak: {peaks}"]
        if rank["offload_bytes"]:
            moved = sorted(rank["offload_bytes"].items())
            lines.append("  offload: " + ", ".join(f"{direction} {n:,} B" for direction, n in moved))
    lines.append("seconds per rank (step, forward_backward, optimizer_step, F, B, W, comm_wait), "
                 "bubble per step:")
    for pid, rank in figures["ranks"].items():
        seconds = rank["seconds"]
        lines.append(f"rank {pid}: " + " ".join(
            f"{seconds.get(key, 0.0):.4f}" for key in ("step", "forward_backward", "optimizer_step",
                                                       "F", "B", "W", "comm_wait"))
            + "".join(f"  {bubble:.3f}" for bubble in rank.get("bubble", [])))
    return "\n".join(lines)


def read_trace(path: str):
    """The trace's JSON, or a ValueError with the one line to print (not a regular file, too large,
    not JSON)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as error:
        raise ValueError(f"{path}: cannot open it ({error.strerror})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_TRACE_BYTES:
        os.close(fd)
        raise ValueError(f"{path} is not a regular file" if not stat.S_ISREG(info.st_mode) else
                         f"{path} is {info.st_size:,} bytes, more than a trace of minipar's (1 GiB)")
    with os.fdopen(fd, "rb") as file:
        try:
            return json.loads(file.read())
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path} is not JSON ({error})") from None


def trace_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="minipar trace", description="Read a trace written by minipar train --trace DIR.")
    commands = p.add_subparsers(dest="command", required=True)
    summary_command = commands.add_parser("summary", help="check the format; figures per rank")
    summary_command.add_argument("file", help="the trace (DIR/trace.json)")
    summary_command.add_argument("--json", action="store_true", help="the figures as JSON")
    return p


def trace_main(argv: list[str]) -> int:
    """`minipar trace summary FILE [--json]`: exit 2 on a file that is no trace, 1 on a broken one."""
    args = trace_parser().parse_args(argv)
    try:
        trace = read_trace(args.file)
    except ValueError as why:
        return fail("minipar trace", str(why))
    problems = format_problems(trace)
    if problems:
        sys.stderr.write("".join(f"minipar trace: {args.file}: {problem}\n" for problem in problems[:20]))
        return 1
    figures = summary(trace)
    if args.json:
        print(json.dumps(figures, indent=1, sort_keys=True))
    else:
        print(summary_text(args.file, figures))
    return 0
