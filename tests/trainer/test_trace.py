"""--trace DIR and `minipar trace summary`: the trace is valid trace-event JSON, and the figures read
back from it are the run's own (its log's pipeline timing and bubble, traffic ledger, memory ledger).

The format checker is tested on traces written by hand (each rule broken once); the multi-rank tests
(2 ranks) train in-process, read the trace as a viewer would (trace_summary.py knows nothing of how it
was recorded) and compare with the log records every rank returns. Times: the trace rounds each edge
down to a microsecond, so a sum of n spans may differ from the log's seconds by n microseconds.
"""

from __future__ import annotations

import json
import math
import os
import time

import pytest
from mpi4py import MPI
from mpi_harness import mpi_test, needs_world_size

from minipar.distributed import watchdog
from minipar.memory.offload import move_meter
from minipar.parallel.pipeline import SCHEDULE
from minipar.parallel.schedules import build_schedule
from minipar.trainer import loop as train
from minipar.trainer import trace_summary
from minipar.trainer.config import TrainConfig
from minipar.trainer.trace import MARKER, TRACE_FILE, Recorder, clock_offset, in_microseconds
from minipar.trainer.trace_summary import format_problems, summary
from minipar.trainer.validate import validate

US = 1e-6


def named(*pids_tids) -> list[dict]:
    """The metadata events that name each process and track."""
    events = []
    for pid, tid in pids_tids:
        events += [{"ph": "M", "name": name, "pid": pid, "tid": tid, "ts": 0, "args": {"name": "x"}}
                   for name in ("process_name", "thread_name")]
    return events


def span(name, ts, dur, pid=0, tid=0, **extra) -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid, **extra}


# ---- the format's rules, on traces written by hand --------------------------------------------------


def test_a_trace_written_by_hand_to_the_rules_is_valid():
    """A parent and its first child start at the same microsecond, a span starts where another ends,
    an async pair and a counter: every rule kept."""
    events = named((0, 0), (0, 2)) + [
        span("step 0", 10, 100), span("F0", 10, 30), span("B0", 40, 70), span("next", 110, 5),
        {"ph": "b", "name": "all_reduce", "cat": "comm", "id": "1", "ts": 12, "pid": 0, "tid": 2},
        {"ph": "e", "name": "all_reduce", "cat": "comm", "id": "1", "ts": 50, "pid": 0, "tid": 2},
        {"ph": "C", "name": "memory: activations", "ts": 20, "pid": 0, "tid": 0, "args": {"bytes": 64}}]
    assert format_problems({"traceEvents": events}) == []


@pytest.mark.parametrize("broken, problem", [
    (span("late", 50, 100), "overlaps"),  # starts inside step 0 and ends after it
    (span("backwards", 20, -1), "dur >= 0"),
    ({"ph": "X", "name": "no pid", "ts": 1, "dur": 1, "tid": 0}, "has no pid"),
    (span("text pid", 1, 1, pid="0"), "integers"),
    ({"ph": "C", "name": "memory", "ts": 1, "pid": 0, "tid": 0, "args": {"bytes": "64"}}, "numeric args"),
    ({"ph": "b", "name": "open", "cat": "comm", "id": "9", "ts": 1, "pid": 0, "tid": 0}, "never ends"),
    ({"ph": "e", "name": "closed", "cat": "comm", "id": "8", "ts": 1, "pid": 0, "tid": 0},
     "without its begin"),
    (span("unnamed track", 200, 1, tid=5), "has no thread_name"),
    (span("unnamed process", 200, 1, pid=3), "has no process_name"),
])
def test_each_broken_rule_is_named(broken, problem):
    events = named((0, 0)) + [span("step 0", 10, 100), span("F0", 10, 30), broken]
    problems = format_problems({"traceEvents": events})
    assert len(problems) >= 1 and any(problem in line for line in problems), problems


def test_summary_command_reads_a_trace_and_refuses_what_is_none(tmp_path, capsys):
    events = named((0, 0), (0, 1), (0, 2)) + [
        span("step 0", 0, 1000, cat="trainer"), span("F0", 0, 250, cat="action", args={"op": "F"}),
        span("send to rank 1", 300, 10, tid=1, cat="comm", args={
            "dim": "pp", "op": "send", "bytes": 96, "intra_bytes": 64, "inter_bytes": 32}),
        {"ph": "i", "s": "t", "name": "send", "cat": "comm", "ts": 400, "pid": 0, "tid": 2, "args": {
            "dim": "pp", "op": "send", "bytes": 4, "intra_bytes": 4, "inter_bytes": 0}},
        {"ph": "C", "name": "memory: activations", "ts": 5, "pid": 0, "tid": 0, "args": {"bytes": 700}},
        {"ph": "C", "name": "memory: activations", "ts": 6, "pid": 0, "tid": 0, "args": {"bytes": 70}}]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert trace_summary.trace_main(["summary", str(path), "--json"]) == 0
    rank = json.loads(capsys.readouterr().out)["ranks"]["0"]
    assert rank["bytes_by_dim"] == {"pp": 100}
    assert rank["bytes_by_dim_link"] == {"pp": {"intra": 68, "inter": 32}}
    assert rank["actions"] == {"F": 1} and rank["steps"] == 1 and rank["memory_peak"] == {"activations": 700}
    assert rank["seconds"] == {"step": 1000 / 1e6, "F": 250 / 1e6, "comm_wait": 10 / 1e6}
    path.write_text(json.dumps({"traceEvents": events + [span("late", 900, 200, cat="action")]}))
    assert trace_summary.trace_main(["summary", str(path)]) == 1
    assert "overlaps" in capsys.readouterr().err
    for not_a_trace in (tmp_path, tmp_path / "missing.json"):
        assert trace_summary.trace_main(["summary", str(not_a_trace)]) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


# ---- --trace DIR: validated before any collective -------------------------------------------------


def test_trace_folder_is_a_folder_and_never_a_users_trace_json(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("mine")
    assert validate(TrainConfig(trace=str(a_file)), 1) == [f"--trace {a_file} is a file, not a directory"]
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / TRACE_FILE).write_text("{}")  # the user's own: never overwritten
    cfg = TrainConfig(steps=1, trace=str(theirs))
    assert [e for e in validate(cfg, 1) if "did not write" in e] == [
        f"--trace {theirs} holds a {TRACE_FILE} that minipar did not write (no {MARKER} there): "
        "choose another folder, or move that file"]
    (theirs / MARKER).write_text("minipar's\n")  # a folder minipar wrote to before: overwritten
    assert validate(cfg, 1) == [] and validate(cfg.replace(trace=str(tmp_path / "new" / "dir")), 1) == []
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert validate(cfg.replace(trace=str(locked)), 1) == [f"--trace {locked}: the folder {locked} "
                                                               "is not writable"]
    assert cfg.single_process().trace is None  # --check-reference's run writes no trace


# ---- a traced run: the trace's figures are the run's own (2 ranks) ----------------------------------


def traced_run(tmp_path, **layout) -> tuple[dict, list[list[dict]], float]:
    """Train 2 steps with --trace on every rank; rank 0 returns the trace, every rank's records, and
    the seconds the run took (elsewhere: None)."""
    world = MPI.COMM_WORLD
    folder = world.bcast(str(tmp_path / "trace") if world.Get_rank() == 0 else None, root=0)
    cfg = TrainConfig(**{"steps": 2, "batch_size": 4, "seq_len": 16, "precision": "fp64", "trace": folder,
                         "quiet": True, **layout})
    started = time.perf_counter()
    records = train.train(cfg)
    wall = time.perf_counter() - started
    every = world.gather(records, root=0)
    if world.Get_rank():
        return {}, [], 0.0
    with open(os.path.join(folder, TRACE_FILE)) as file:
        return json.load(file), every, wall


@needs_world_size(2)
@mpi_test
def test_pipeline_trace_is_valid_and_its_figures_are_the_logs(tmp_path):
    trace, every, wall = traced_run(tmp_path, pp=2, microbatches=2, schedule="1f1b")
    if not trace:
        return
    assert format_problems(trace) == []
    events = [e for e in trace["traceEvents"] if e["ph"] != "M"]
    assert {e["pid"] for e in events} == {0, 1}
    assert all(0 <= e["ts"] and e["ts"] + e.get("dur", 0) <= wall / US for e in events)  # rank 0's start
    assert trace["otherData"]["clock_offset_us"] == [0, 0] == trace["otherData"]["clock_error_bound_us"]
    figures = summary(trace)["ranks"]
    schedule = build_schedule("1f1b", 2, 2)
    for rank, records in enumerate(every):
        mine = figures[rank]
        # the pipeline's actions: the schedule's, in its order, each lasting what the Gantt record says
        actions = sorted((e for e in events if e["pid"] == rank and e.get("cat") == "action"),
                         key=lambda e: e["ts"])
        assert [e["name"] for e in actions] == [str(a) for a in schedule[rank]] * 2
        gantt = [stop - start for r in records
                 for _, start, stop in r["pipeline"]["stage_action_times_s"][rank]]
        assert all(abs(e["dur"] * US - seconds) <= US for e, seconds in zip(actions, gantt))
        # time per phase: the log's step time and each stage's forward and backward time
        assert mine["steps"] == 2
        assert abs(mine["seconds"]["step"] - sum(r["time_s"] for r in records)) <= 2 * US
        forward = sum(r["pipeline"]["stage_forward_s"][rank] for r in records)
        backward = sum(r["pipeline"]["stage_backward_s"][rank] for r in records)
        assert abs(mine["seconds"]["F"] - forward) <= 4 * US
        assert abs(mine["seconds"]["B"] - backward) <= 4 * US
        # bytes per dimension and link: the traffic ledger's, step by step summed
        assert mine["bytes_by_dim"] == sum_of(records, "by_dim") and mine["bytes_by_dim"]["pp"] > 0
        links = {dim: sum_of([{"comm": {"x": r["comm"]["by_dim_link"][dim]}} for r in records], "x")
                 for dim in mine["bytes_by_dim"]}
        assert mine["bytes_by_dim_link"] == links
        # the measured bubble, step by step: 1 - busy / (K x makespan), with busy off by at most a
        # microsecond per action (n of them) and the makespan by two, so by (n + 2K) us / (K x makespan)
        n = sum(len(stage) for stage in schedule)
        for bubble, record in zip(mine["bubble"], records, strict=True):
            timing = record["pipeline"]
            allowed = (n + 2 * 2) * US / (2 * timing["makespan_s"])
            assert abs(bubble - timing["bubble_measured"]) <= allowed, (bubble, timing["bubble_measured"])
        # memory: the counters' peaks are the memory ledger's
        assert mine["memory_peak"]["activations"] == max(r["mem"]["activations_peak"] for r in records)
        assert mine["memory_peak"]["params"] == max(r["mem"]["params"] for r in records) > 0


@needs_world_size(8)
@mpi_test
def test_make_demos_3d_layout_traces_every_rank_and_its_bytes_and_bubble_are_the_logs(tmp_path):
    """`make demo`'s layout (dp 2 x pp 2 x tp 2, ZeRO-1, 4 micro-batches) on a tiny GPT: the merged
    trace keeps the format's rules, names all 8 ranks, and from it alone each rank's bytes per dimension
    are its traffic ledger's, its pipeline actions are its stage's Gantt record (labels, order and
    durations) and each step's bubble is its pipeline's `bubble_measured`."""
    trace, every, _ = traced_run(tmp_path, dp=2, pp=2, tp=2, zero=1, microbatches=4, batch_size=8,
                                 seq_len=8, d_model=16, n_layer=2, n_head=2)
    if not trace:
        return
    assert format_problems(trace) == []
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] != "M"} == set(range(8)) == set(names)
    # the grid numbers tp fastest, then pp, then dp (lesson 07): rank 5 is dp 1, pp 0, tp 1
    assert names[5] == "rank 5 (dp 1, pp 0, tp 1, cp 0)"
    figures = summary(trace)["ranks"]
    for rank, records in enumerate(every):
        sent = sum_of(records, "by_dim")
        assert figures[rank]["bytes_by_dim"] == sent and all(sent[dim] > 0 for dim in ("dp", "tp", "pp"))
        stage = trace["otherData"]["coords"][rank][1]  # (dp, pp, tp, cp): this rank's pipeline stage
        actions = sorted((e for e in trace["traceEvents"] if e["pid"] == rank and e.get("cat") == "action"),
                         key=lambda e: e["ts"])
        gantt = [(label, stop - start) for r in records
                 for label, start, stop in r["pipeline"]["stage_action_times_s"][stage]]
        assert [e["name"] for e in actions] == [label for label, _ in gantt] and len(gantt) == 2 * 8
        assert all(abs(e["dur"] * US - seconds) <= US for e, (_, seconds) in zip(actions, gantt))
        # each action's edges and the makespan's two are rounded down to a microsecond (see above)
        for bubble, record in zip(figures[rank]["bubble"], records, strict=True):
            timing = record["pipeline"]
            n = sum(len(stage) for stage in timing["stage_action_times_s"])
            allowed = (n + 2 * 2) * US / (2 * timing["makespan_s"])
            assert abs(bubble - timing["bubble_measured"]) <= allowed, (bubble, timing["bubble_measured"])


def sum_of(records: list[dict], key: str) -> dict:
    total: dict = {}
    for record in records:
        for name, value in record["comm"][key].items():
            total[name] = total.get(name, 0) + value
    return total


@needs_world_size(2)
@mpi_test
def test_overlapping_all_reduces_are_async_pairs_and_their_bytes_the_logs(tmp_path):
    """DDP starts each bucket's all-reduce from backward hooks and waits at the step: those collectives
    overlap the computation, so each is an async begin/end pair with its bytes on the begin."""
    trace, every, _ = traced_run(tmp_path, dp=2, bucket_mb=0.01)
    if not trace:
        return
    assert format_problems(trace) == []
    begins = [e for e in trace["traceEvents"] if e["ph"] == "b"]
    assert len(begins) >= 4 and {e["pid"] for e in begins} == {0, 1}  # two buckets or more, per step
    for rank, records in enumerate(every):
        assert summary(trace)["ranks"][rank]["bytes_by_dim"] == sum_of(records, "by_dim")
        # the buckets the hooks started are async; the one no hook starts (the embedding's) blocks
        started = sum(e["args"]["bytes"] for e in begins if e["pid"] == rank)
        blocking = sum(e["args"].get("bytes", 0) for e in trace["traceEvents"]
                       if e["ph"] == "X" and e["pid"] == rank and e["args"].get("op") == "all_reduce")
        assert started > 0 and started + blocking == sum_of(records, "by_op")["all_reduce"]


@needs_world_size(2)
@mpi_test
def test_measured_clock_offset_between_two_hosts_is_within_its_bound():
    """Two ranks told they are on two hosts measure each other's clock; they share one, so the true
    offset is 0 and must lie within the bound the measurement gives."""
    offset, bound = clock_offset(MPI.COMM_WORLD, ["host-a", "host-b"])
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert (offset, bound) == (0.0, 0.0)
    else:
        assert 0 < bound < 1 and abs(offset) <= bound and math.isfinite(offset)


def test_without_trace_nothing_listens_and_a_trace_leaves_no_listener_behind(tmp_path):
    """Off, no per-event work: no listener on the traffic ledger, the memory ledger or the offload
    moves, so a charge or a saved activation tests an empty list. On, every hook goes with the run,
    the offload moves in the trace are the log's, and a stalled rank writes its own trace."""
    cfg = TrainConfig(steps=1, batch_size=2, seq_len=8, quiet=True).resolved(1)
    off = train.Trainer(cfg, MPI.COMM_SELF)
    assert off.trace is None
    assert not off.world.ledger.listeners and not off.memory.listeners and not move_meter.listeners
    off.memory.close()
    # on: chunked ZeRO-3 offloaded to the CPU under a 1 MiB budget, so that blocks move every step
    on = train.Trainer(cfg.replace(trace=str(tmp_path / "t"), steps=2, zero=3, offload="cpu",
                                   device_mem_mb=1.0), MPI.COMM_SELF)
    assert len(on.world.ledger.listeners) == len(on.memory.listeners) == len(move_meter.listeners) == 1
    assert on.trace.stalled in watchdog.WATCHDOG.reporters
    on.trace.recorder.memory_changed("activations", 64)  # a counter before the stall
    on.trace.stalled("minipar: error: rank 0 waited 31 s in all_reduce ...\n")  # what the watchdog calls
    alone = json.loads((tmp_path / "t" / "trace-rank-0.json").read_text())  # the rank's own, as it ends
    assert format_problems(alone) == [] and alone["traceEvents"][-1]["name"].startswith("watchdog: ")
    records = on.run()
    on.memory.close()
    assert not on.world.ledger.listeners and not on.memory.listeners and not move_meter.listeners
    assert on.trace.stalled not in watchdog.WATCHDOG.reporters
    trace = json.loads((tmp_path / "t" / TRACE_FILE).read_text())
    assert format_problems(trace) == []
    mine = summary(trace)["ranks"][0]
    moved: dict = {}  # the log's bytes between tiers, by direction, summed over the steps
    for record in records:
        for direction, nbytes in record["offload"]["by_direction"].items():
            moved[direction] = moved.get(direction, 0) + nbytes
    assert mine["steps"] == 2 and mine["offload_bytes"] == moved and moved["cpu->device"] > 0
    assert mine["memory_peak"]["buffers"] == max(r["mem"]["buffers_peak"] for r in records)


def test_a_stopped_trace_records_nothing_until_it_listens_again(tmp_path):
    """`bench trace` measures the cost by stopping the trace on every other step: stopped, no hook is
    left (no per-event work) and no event is recorded, the trainer's own step span included; listening
    again, every hook is back and events are recorded, memory counters among them."""
    cfg = TrainConfig(steps=3, batch_size=2, seq_len=8, quiet=True, trace=str(tmp_path / "t")).resolved(1)
    trainer = train.Trainer(cfg, MPI.COMM_SELF)
    recorder = trainer.trace.recorder

    def recorded() -> int:
        return len(recorder.events) + recorder.counts()

    try:
        trainer.step(0)
        first, counters = recorded(), recorder.counts()
        assert first > 0 and counters > 0
        trainer.trace.stop()
        assert not trainer.world.ledger.listeners and not trainer.memory.listeners
        assert not move_meter.listeners and trainer.trace.stalled not in watchdog.WATCHDOG.reporters
        trainer.step(1)
        assert recorded() == first
        trainer.trace.listen()
        listeners = (trainer.world.ledger.listeners, trainer.memory.listeners, move_meter.listeners)
        assert [len(hooks) for hooks in listeners] == [1, 1, 1]
        assert list(watchdog.WATCHDOG.reporters).count(trainer.trace.stalled) == 1
        trainer.step(2)
        assert recorded() > first and recorder.counts() > counters
        steps = [e["name"] for e in recorder.all_events() if e.get("cat") == "trainer"]
        assert steps == ["step 0", "step 2"]
    finally:  # no listener left on the global meters for the tests after this one
        trainer.trace.stop()
        trainer.memory.close()


def test_an_action_in_stretches_is_one_action_and_all_its_time():
    """Inside a DualPipeV F&B step a part hands the turn to the other while its all-to-all is in flight,
    so the runner reports one action as several stretches (pipeline.py's computing): the trace keeps
    each stretch as a span, marks the later ones as continuing, and the summary counts the action once
    and every stretch's time; a new step's schedule starts the count again."""
    recorder = Recorder()
    for label, started, stopped in [("F1", 0.0, 0.001), ("B0", 0.001, 0.003), ("F1", 0.003, 0.004),
                                    (SCHEDULE, 0.0, 0.005), ("F1", 0.006, 0.007), (SCHEDULE, 0.006, 0.008)]:
        recorder.action(label, started, stopped)
    spans = [e for e in recorder.events if e["cat"] == "action"]
    assert [e["args"].get("continues", False) for e in spans] == [False, False, True, False]
    events = in_microseconds(recorder.all_events(), 0, 0.0)  # as the trace file holds them
    mine = summary({"traceEvents": named((0, 0)) + events})["ranks"][0]
    assert mine["actions"] == {"F": 2, "B": 1}
    assert mine["seconds"]["F"] == pytest.approx(0.003) and mine["seconds"]["B"] == pytest.approx(0.002)
