"""A pipeline's step as a Gantt chart: each stage's actions, measured in a real run beside the schedule
simulator's placement of the same actions.

Measured: `minipar train --pp K --schedule S --microbatches M` under mpiexec (or a log of one: --log);
the pipeline runner notes every action's start and stop (the `stage_actions` of the log's `pipeline`
record, parallel/pipeline.py), so the chart is the last step's real timeline, waits included.
Simulated: parallel/schedules.py's `simulate` with a backward twice a forward (F = 1, B = 2).

    python -m minipar plot gantt [--stages 2] [--schedule 1f1b] [--microbatches 4] [--log FILE] [--out DIR]
Lesson: lessons/06_pipeline.md.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from minipar.bench.timing import run_train
from minipar.parallel.schedules import Timeline, build_schedule, simulate
from minipar.plot import canvas
from minipar.plot.loss import read_log

FILE = "06_gantt.png"
PIPELINE_ARGS = ["--batch-size", "32", "--d-model", "128", "--n-layer", "2"]  # bench pp's model
COLOURS = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}


def add_arguments(p) -> None:
    p.add_argument("--stages", type=int, default=2, help="pipeline stages K (= ranks)")
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--log", type=Path, default=None, help="a `train --pp K --log` file instead of a run")


def pipeline_records(stages: int, schedule: str, microbatches: int, steps: int) -> list[dict]:
    """Rank 0's log records of a short pipeline run of bench pp's model."""
    with tempfile.TemporaryDirectory() as folder:
        args = [*PIPELINE_ARGS, "--pp", str(stages), "--schedule", schedule,
                "--microbatches", str(microbatches), "--steps", str(steps)]
        return run_train(stages, args, Path(folder) / "pp.jsonl")


def measured_bars(timing: dict) -> list[tuple[int, str, float, float]]:
    """(stage, action, start, stop) in seconds from the step's common start, from a `pipeline` record."""
    return [(stage, label, start, stop) for stage, actions in enumerate(timing["stage_actions"])
            for label, start, stop in actions]


def simulated_bars(timeline: Timeline) -> list[tuple[int, str, float, float]]:
    """(stage, action, start, stop) in time units: each action from its first slot for as many slots as
    the grid gives it."""
    bars = []
    for (stage, action), slot in sorted(timeline.start.items(), key=lambda item: (item[0][0], item[1])):
        slots = sum(cell == action for cell in timeline.grid[stage])
        bars.append((stage, str(action), float(slot * timeline.slot), float((slot + slots) * timeline.slot)))
    return bars


def busy_share(bars: list[tuple[int, str, float, float]], stages: int) -> float:
    """The stages' busy time over stages x makespan: 1 - the bubble fraction."""
    return sum(stop - start for _, _, start, stop in bars) / (stages * max(stop for *_, stop in bars))


def draw_bars(ax, bars, stages: int, scale: float = 1.0) -> None:
    for stage, label, start, stop in bars:
        ax.broken_barh([(start * scale, (stop - start) * scale)], (stage - 0.4, 0.8),
                       facecolors=COLOURS[label[0]], edgecolor="black", linewidth=0.5)
        ax.text((start + stop) / 2 * scale, stage, label, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
    ax.invert_yaxis()


def draw(args, path: Path) -> None:
    if args.log:
        timing = [r for r in read_log(args.log) if r.get("pipeline")][-1]["pipeline"]
        stages, microbatches = timing["stages"], timing["microbatches"]
    else:
        timing = pipeline_records(args.stages, args.schedule, args.microbatches, steps=3)[-1]["pipeline"]
        stages, microbatches = args.stages, args.microbatches
    measured = measured_bars(timing)
    timeline = simulate(build_schedule(args.schedule, stages, microbatches), forward_cost=1, backward_cost=2)
    simulated = simulated_bars(timeline)
    plt = canvas.pyplot()
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(10, 1.2 + 1.1 * stages))
    draw_bars(top, measured, stages, scale=1e3)
    top.set(xlabel="ms from the step's start", title=f"measured: {args.schedule if not args.log else 'log'}, "
            f"K={stages}, M={microbatches}, bubble {timing['bubble_measured']:.3f} (last step, rank clocks)")
    draw_bars(bottom, simulated, stages)
    bottom.set(xlabel="time units (F = 1, B = 2)", title=f"simulated {args.schedule}: bubble "
               f"{1 - busy_share(simulated, stages):.3f}")
    canvas.save(figure, path)
