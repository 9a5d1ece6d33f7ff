"""Pipeline schedules as data: which micro-batch each stage works on, in what order, and how long it idles.

The idea: pipeline parallelism cuts the model's layers into K stages, one per rank. A *schedule* is, for
each stage, the ordered list of actions that rank executes: `F(i)`, the forward of micro-batch i, and
`B(i)`, its backward. That list is all a rank needs; its sends and receives follow from the data:
F(i) on stage s consumes the output of F(i) on stage s-1, and B(i) on stage s consumes the gradient from
B(i) on stage s+1 (on the last stage, B(i) starts from its own F(i) and the loss).

What it saves: cutting the batch into M micro-batches lets stages work at the same time, so the idle
"bubble" shrinks from (K-1)/K with no micro-batching to (K-1)/(M+K-1). 1F1B (PipeDream-Flush) has the
same bubble as GPipe but starts each backward as early as it can, so a stage holds the activations of at
most K micro-batches instead of M. What it costs: one point-to-point send per stage boundary and
micro-batch in each direction, and the bubble itself.

`simulate` places the per-stage action lists on unit-time slots, each action starting as soon as its
rank is free and its inputs exist; the bubble fraction and in-flight counts are read off the result,
never typed in. Lesson 06 (pipeline parallelism) explains it; `python -m minipar schedule` draws it
(minipar/trainer/commands.py: the command; this file: the schedules and the simulator).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class Action:
    """One step of a pipeline rank: op "F" (forward) or "B" (backward) of micro-batch `microbatch`."""

    op: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.op}{self.microbatch}"


# schedule[stage] is that stage's actions in the order its rank executes them.
Schedule = list[list[Action]]


def naive(stages: int, microbatches: int) -> Schedule:
    """No micro-batching: the whole batch is one micro-batch, so `microbatches` is ignored.

    Every stage waits for the one before it to finish the whole batch: the bubble is (K-1)/K.
    """
    return gpipe(stages, 1)


def gpipe(stages: int, microbatches: int) -> Schedule:
    """GPipe: every stage runs all M forwards, then all M backwards (last micro-batch first).

    Stage 0 holds the activations of all M micro-batches at the turn: memory grows with M.
    """
    forwards = [Action("F", i) for i in range(microbatches)]
    backwards = [Action("B", i) for i in reversed(range(microbatches))]
    return [forwards + backwards for _ in range(stages)]


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush): a few warm-up forwards, then alternate one forward and one backward.

    Stage s runs K-s-1 warm-up forwards (just enough to fill the pipe below it), so it never holds more
    than K-s micro-batches' activations; the remaining backwards drain the pipe at the end.
    """
    schedule = []
    for stage in range(stages):
        warmup = min(stages - stage - 1, microbatches)
        actions = [Action("F", i) for i in range(warmup)]
        for i in range(microbatches - warmup):
            actions += [Action("F", warmup + i), Action("B", i)]
        actions += [Action("B", i) for i in range(microbatches - warmup, microbatches)]
        schedule.append(actions)
    return schedule


SCHEDULES = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b}


def build_schedule(name: str, stages: int, microbatches: int) -> Schedule:
    """The per-stage action lists of schedule `name` ("naive", "gpipe" or "1f1b")."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose from {', '.join(SCHEDULES)}")
    if stages < 1 or microbatches < 1:
        raise ValueError(f"need at least 1 stage and 1 micro-batch, got {stages} and {microbatches}")
    return SCHEDULES[name](stages, microbatches)


def dependencies(stage: int, action: Action, stages: int) -> list[tuple[int, Action]]:
    """The (stage, action) pairs that must finish before `action` can start on `stage`.

    A pair on another stage is a message the executor receives: activations from stage-1 for a forward,
    the gradient from stage+1 for a backward. A backward also needs its own stage's forward (the saved
    activations), which is what starts the backward on the last stage.
    """
    if action.op == "F":
        return [(stage - 1, action)] if stage > 0 else []
    own_forward = (stage, Action("F", action.microbatch))
    if stage == stages - 1:
        return [own_forward]
    return [own_forward, (stage + 1, action)]


def check_schedule(schedule: Schedule) -> int:
    """Check every stage runs F(i) and B(i) exactly once for the same micro-batches; return their count."""
    if not schedule:
        raise ValueError("a schedule needs at least one stage")
    microbatches = len(schedule[0]) // 2
    expected = sorted((op, i) for op in "BF" for i in range(microbatches))
    for stage, actions in enumerate(schedule):
        if sorted((a.op, a.microbatch) for a in actions) != expected:
            raise ValueError(f"stage {stage} must run F and B of micro-batches 0..{microbatches - 1} once")
    return microbatches


@dataclass(frozen=True)
class Timeline:
    """A schedule placed on time slots: grid[stage][slot] is the action busy there, or None when idle."""

    grid: list[list[Action | None]]
    start: dict[tuple[int, Action], int]

    @property
    def makespan(self) -> int:
        return len(self.grid[0])


def simulate(schedule: Schedule, forward_cost: int = 1, backward_cost: int = 1) -> Timeline:
    """Run each stage's actions in order, each as early as its rank is free and its inputs are ready.

    This is what ranks executing the lists with blocking receives do, if compute takes `forward_cost`
    and `backward_cost` time units and messages take no time. A schedule whose ranks would wait on each
    other forever raises ValueError.
    """
    if forward_cost < 1 or backward_cost < 1:
        raise ValueError("forward and backward costs must be at least 1 time unit")
    check_schedule(schedule)
    cost = {"F": forward_cost, "B": backward_cost}
    stages = len(schedule)
    start: dict[tuple[int, Action], int] = {}
    finish: dict[tuple[int, Action], int] = {}
    position = [0] * stages
    rank_free_at = [0] * stages
    while any(position[s] < len(schedule[s]) for s in range(stages)):
        progressed = False
        for stage, actions in enumerate(schedule):
            while position[stage] < len(actions):
                action = actions[position[stage]]
                inputs = dependencies(stage, action, stages)
                if any(key not in finish for key in inputs):
                    break  # this rank blocks on a receive until another stage gets further
                begin = max([rank_free_at[stage]] + [finish[key] for key in inputs])
                start[(stage, action)] = begin
                finish[(stage, action)] = rank_free_at[stage] = begin + cost[action.op]
                position[stage] += 1
                progressed = True
        if not progressed:
            waiting = "; ".join(
                f"stage {s} waits at {schedule[s][position[s]]}"
                for s in range(stages)
                if position[s] < len(schedule[s])
            )
            raise ValueError(f"schedule deadlocks: {waiting}")
    grid: list[list[Action | None]] = [[None] * max(rank_free_at) for _ in range(stages)]
    for (stage, action), begin in start.items():
        for slot in range(begin, begin + cost[action.op]):
            grid[stage][slot] = action
    return Timeline(grid=grid, start=start)


def bubble_fraction(timeline: Timeline) -> Fraction:
    """Idle slots over all slots (stages x makespan): the share of the machine the pipeline wastes."""
    idle = sum(cell is None for row in timeline.grid for cell in row)
    return Fraction(idle, len(timeline.grid) * timeline.makespan)


def peak_inflight(schedule: Schedule) -> list[int]:
    """Per stage, the most micro-batches whose forward has run and backward has not: activations held."""
    peaks = []
    for actions in schedule:
        inflight = peak = 0
        for action in actions:
            inflight += 1 if action.op == "F" else -1
            peak = max(peak, inflight)
        peaks.append(peak)
    return peaks


def render(timeline: Timeline) -> str:
    """An ASCII timeline like the GPipe paper's figure: last stage on top, one column per time unit.

    A backward that takes 2 time units fills two columns with its label; '.' marks an idle slot.
    """
    width = max(len(str(cell)) for row in timeline.grid for cell in row if cell is not None)
    label_width = len(str(len(timeline.grid) - 1))
    lines = []
    for stage in reversed(range(len(timeline.grid))):
        cells = [(str(cell) if cell is not None else ".").rjust(width) for cell in timeline.grid[stage]]
        lines.append(f"stage {stage:>{label_width}} | " + " ".join(cells))
    return "\n".join(lines)
