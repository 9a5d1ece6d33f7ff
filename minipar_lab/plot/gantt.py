"""A pipeline's step as a Gantt chart: each stage's actions, measured in a real run beside the schedule
simulator's placement of the same actions.

Measured: `minipar train --pp K --schedule S --microbatches M` under mpiexec (or a log of one: --log);
the pipeline runner notes every action's start and stop (the `stage_action_times_s` of the log's `pipeline`
record, parallel/pipeline.py), so the chart is the last step's real timeline, waits included.
Simulated: parallel/schedules.py's `simulate` of the schedule the step ran (read off its actions'
labels), a backward twice a forward (F = 1, B = 2; F = B = W = 1 where the backward is split). The V
schedules (zb-v, dualpipev) run a GPT of 2K-2 blocks, so that each of the 2K chunks has a unit.

    python -m minipar plot gantt [--stages 2] [--schedule 1f1b] [--microbatches 4] [--log FILE] [--out DIR]
Lesson: lessons/06_pipeline.md.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from minipar.parallel.schedules import (
    SCHEDULES,
    V_SHAPED,
    Action,
    Timeline,
    bubble_fraction,
    build_schedule,
    placement_of,
    simulate,
    splits_backward,
)
from minipar.trainer.arguments import parse_train_args
from minipar.trainer.launch import read_log, run_train
from minipar.trainer.validate import validate
from minipar_lab.bench import canvas

FILE = "06_gantt.png"
PIPELINE_ARGS = ["--batch-size", "32", "--d-model", "128", "--n-layer", "2"]  # bench pp's model
COLOURS = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}


def add_arguments(p) -> None:
    p.add_argument("--stages", type=int, default=2, help="pipeline stages K (= ranks)")
    p.add_argument("--schedule", default="1f1b",
                   choices=("naive", "gpipe", "1f1b", "zb-h1", "zb-v", "dualpipev"))
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--log", type=Path, default=None, help="a `train --pp K --log` file instead of a run")


def pipeline_args(stages: int, schedule: str, microbatches: int) -> list[str]:
    """bench pp's model as a pipeline; ValueError (one line) where validation refuses it."""
    args = [*PIPELINE_ARGS, "--pp", str(stages), "--schedule", schedule, "--microbatches", str(microbatches)]
    if schedule in V_SHAPED:  # 2K chunks of a GPT of n_layer + 2 units
        args[args.index("--n-layer") + 1] = str(max(2, 2 * stages - 2))
    problems = validate(parse_train_args(args), stages) if stages >= 2 else ["--stages must be at least 2"]
    if problems:
        raise ValueError("; ".join(problems))
    return args


def pipeline_records(stages: int, schedule: str, microbatches: int, steps: int) -> list[dict]:
    """Rank 0's log records of a short pipeline run of bench pp's model."""
    args = pipeline_args(stages, schedule, microbatches)
    with tempfile.TemporaryDirectory() as folder:
        return run_train(stages, [*args, "--steps", str(steps)], Path(folder) / "pp.jsonl")


def schedule_of(timing: dict) -> tuple[str, int]:
    """(schedule, V) whose per-stage action lists the measured step ran, read off the labels: the
    first of SCHEDULES that gives the same lists (at M = 1 GPipe and 1F1B are naive's)."""
    # an F&B's parts handing each other the turn (MoE with ep) are timed in stretches: each label once
    labels = [list(dict.fromkeys(label for label, _, _ in actions)) for actions in timing["stage_action_times_s"]]
    chunks = {label.split(".")[1] for row in labels for label in row if "." in label}
    virtual = max(1, len(chunks))
    for name in SCHEDULES:
        try:
            table = build_schedule(name, timing["stages"], timing["microbatches"],
                                   virtual if name == "interleaved" else 1)
        except ValueError:  # sizes this schedule does not take (interleaved with V = 1, dualpipev M < 2K)
            continue
        if [[label for action in actions for label in timed_labels(action)] for actions in table] == labels:
            return name, virtual
    raise ValueError("the log's pipeline actions are those of no schedule")


def timed_labels(action: Action) -> list[str]:
    """The labels the runner times `action` under: an F&B's forward and backward one after the other."""
    if action.backward is not None:
        return [str(Action("F", action.microbatch, action.chunk)), str(action.backward)]
    return [str(action)]


def measured_bars(timing: dict) -> list[tuple[int, str, float, float]]:
    """(stage, action, start, stop) in seconds from the step's common start, from a `pipeline` record."""
    return [(stage, label, start, stop) for stage, actions in enumerate(timing["stage_action_times_s"])
            for label, start, stop in actions]


def simulated_bars(timeline: Timeline) -> list[tuple[int, str, float, float]]:
    """(stage, action, start, stop) in time units: each action from its first slot for as many slots as
    the grid gives it."""
    bars = []
    for (stage, action), slot in sorted(timeline.start.items(), key=lambda item: (item[0][0], item[1])):
        slots = sum(cell == action for cell in timeline.grid[stage])
        bars.append((stage, str(action), float(slot * timeline.slot), float((slot + slots) * timeline.slot)))
    return bars


def draw_bars(ax, bars, stages: int, scale: float = 1.0) -> None:
    for stage, label, start, stop in bars:
        ax.broken_barh([(start * scale, (stop - start) * scale)], (stage - 0.4, 0.8),
                       facecolors=COLOURS[label[0]], edgecolor="black", linewidth=0.5)
        ax.text((start + stop) / 2 * scale, stage, label, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
    ax.invert_yaxis()


def draw(args, path: Path) -> None:
    if args.log:
        timings = [r["pipeline"] for r in read_log(args.log) if r.get("pipeline")]
        if not timings or "stage_action_times_s" not in timings[-1]:
            raise ValueError(f"{args.log} has no pipeline actions (a log of `minipar train --pp K --log`)")
        timing = timings[-1]
    else:
        timing = pipeline_records(args.stages, args.schedule, args.microbatches, steps=3)[-1]["pipeline"]
    stages, microbatches = timing["stages"], timing["microbatches"]
    schedule, virtual = schedule_of(timing)
    table = build_schedule(schedule, stages, microbatches, virtual if schedule == "interleaved" else 1)
    backward = 1 if splits_backward(table) else 2
    measured = measured_bars(timing)
    timeline = simulate(table, forward_cost=1, backward_cost=backward, placement=placement_of(schedule))
    simulated = simulated_bars(timeline)
    plt = canvas.pyplot()
    widest = max(len(actions) for actions in table)  # room for each label: 48 actions a rank in zb-v, K=4, M=8
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(max(10, widest / 3), 1.2 + 1.1 * stages))
    draw_bars(top, measured, stages, scale=1e3)
    clock = "one clock" if timing.get("time_base") == "shared" else "each rank's clock"  # older logs: own
    top.set(xlabel="ms from the step's start", title=f"measured: {schedule}, K={stages}, M={microbatches}, "
            f"bubble {timing['bubble_measured']:.3f} (the last step; {clock})")
    draw_bars(bottom, simulated, stages)
    costs = "F = B = W = 1" if backward == 1 else "F = 1, B = 2"
    bottom.set(xlabel=f"time units ({costs})", title=f"simulated {schedule}: bubble "
               f"{float(bubble_fraction(timeline)):.3f}")
    canvas.save(figure, path)
