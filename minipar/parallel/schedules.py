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

Two schedules go further. Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM) gives each rank V
*chunks* of the model (virtual stage c·K + s on rank s): each chunk's work is 1/V of a stage's, so the
fill and drain shrink by V and the bubble becomes (K-1)/(V·M + K-1), at the price of V times the
messages and K + (K-1)/V micro-batches' activations on the first rank. ZB-H1 (Qi et al. 2023, "Zero
Bubble Pipeline Parallelism") splits the backward into B, the input gradient the previous stage waits
for, and W, the weight gradient nobody waits for; W steps fill the drain, so with F = B = W = 1 the
makespan is the lower bound 3M + K - 1 and the bubble (K-1)/(3M + K-1), a third of 1F1B's, holding K
micro-batches at most, as 1F1B does.

ZB-V (Qi et al. 2024, the V-shaped zero-bubble schedule; torch's ScheduleZBVZeroBubble) gives each
rank two chunks placed as a V: rank s holds virtual stage s on the way down and 2K-1-s on the way
back, so the last chunk, and the loss, sit on rank 0, and every rank holds the same amount of
activations (2K chunk micro-batches, each half a stage: 1F1B's rank-0 level, K stages' worth). With
F = B = W per chunk its makespan is 6M + K - 1 chunk units: the bubble (K-1)/(6M+K-1), half of ZB-H1's.
DualPipeV (DeepSeek-V3's DualPipe cut in half; torch's ScheduleDualPipeV) keeps the V and makes each
steady step an F&B: one micro-batch's forward through one chunk with another's whole backward (BW)
through the other, so that one's communication hides behind the other's compute (M >= 2K; 2K + 1
pairs held a rank).

`simulate` places the per-stage action lists on time slots, each action starting as soon as its rank
is free and its inputs exist; the bubble fraction and in-flight counts are read off the result, never
typed in. Lesson 06 (pipeline parallelism) explains it; `python -m minipar schedule` draws it
(minipar/trainer/commands.py: the command; this file: the schedules and the simulator).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

OPS = ("F", "B", "W")  # forward, backward (with W: the input gradient only), weight gradient


@dataclass(frozen=True)
class Action:
    """One step of a pipeline rank: op "F" (forward), "B" (backward) or "W" (weight gradient) of a
    micro-batch, through one of the rank's chunks (`chunk`: None when a rank holds one stage).

    DualPipeV adds two: "BW", a whole backward (B and W as one step) in a schedule that otherwise splits
    them, and "F&B", the forward of (microbatch, chunk) and the whole backward `backward` of another
    micro-batch through the other chunk, run as one overlapped step."""

    op: str
    microbatch: int
    chunk: int | None = None
    backward: Action | None = None  # "F&B" only: the whole backward ("BW") run with this forward

    def __str__(self) -> str:
        if self.backward is not None:
            return f"F{self.microbatch}.{self.chunk}&{self.backward}"
        return f"{self.op}{self.microbatch}" + ("" if self.chunk is None else f".{self.chunk}")

    def parts(self) -> list[Action]:
        """The plain F, B and W this step stands for: F&B is its F, B and W; BW is its B and W."""
        if self.backward is not None:
            return [Action("F", self.microbatch, self.chunk), *self.backward.parts()]
        if self.op == "BW":
            return [Action("B", self.microbatch, self.chunk), Action("W", self.microbatch, self.chunk)]
        return [self]


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

    Stage s runs K-s-1 warm-up forwards, one for each of the stages s+1..K-1 after it (enough to keep
    them busy until the first backward comes back; Megatron-LM's `num_warmup_microbatches`), so it never
    holds more than K-s micro-batches' activations; the remaining backwards drain the pipe at the end.
    """
    # exercise 06.1: the 1F1B schedule builder
    schedule = []
    for stage in range(stages):
        warmup = min(stages - stage - 1, microbatches)
        actions = [Action("F", i) for i in range(warmup)]
        for i in range(microbatches - warmup):
            actions += [Action("F", warmup + i), Action("B", i)]
        actions += [Action("B", i) for i in range(microbatches - warmup, microbatches)]
        schedule.append(actions)
    return schedule
    # end exercise


def interleaved(stages: int, microbatches: int, virtual_stages: int) -> Schedule:
    """Megatron's interleaved 1F1B: rank s holds chunks c = 0..V-1, virtual stages c·K + s.

    Work goes in rounds of K micro-batches: forward step k of a rank is micro-batch (k // KV)·K + k % K
    through chunk (k // K) % V; backward step k the same micro-batch through chunk V-1 - (k // K) % V.
    Rank s runs 2(K-s-1) + (V-1)·K warm-up forwards (enough to keep every chunk after it busy), then
    one forward and one backward, then drains. M must be a multiple of K (Megatron's requirement).
    """
    if virtual_stages < 2:
        raise ValueError(f"interleaved needs at least 2 virtual stages per rank, got {virtual_stages}")
    if microbatches % stages:
        raise ValueError(f"interleaved needs micro-batches M={microbatches} to be a multiple of the "
                         f"stages K={stages}")
    # exercise 06.2: the interleaved 1F1B schedule builder
    total = microbatches * virtual_stages

    def step(k: int, op: str) -> Action:
        chunk = (k // stages) % virtual_stages
        microbatch = (k // (stages * virtual_stages)) * stages + k % stages
        return Action(op, microbatch, chunk if op == "F" else virtual_stages - 1 - chunk)

    schedule = []
    for stage in range(stages):
        warmup = min(2 * (stages - stage - 1) + (virtual_stages - 1) * stages, total)
        actions = [step(k, "F") for k in range(warmup)]
        for k in range(total - warmup):
            actions += [step(warmup + k, "F"), step(k, "B")]
        actions += [step(k, "B") for k in range(total - warmup, total)]
        schedule.append(actions)
    return schedule
    # end exercise


def zb_h1(stages: int, microbatches: int) -> Schedule:
    """ZB-H1: 1F1B's forwards and input-gradient backwards B, with the weight gradients W deferred.

    Stage s runs K-s forwards, then B, F pairs; it lets up to s weight gradients wait (runs W(j) only
    once s+1 are pending), and runs the waiting ones after its last B: they fill the drain, where
    1F1B idles. It holds at most K-s + s = K micro-batches from F to W: 1F1B's K on stage 0, more than
    1F1B's K-s on later stages. With F = B = W = 1 and M >= K the last stage starts at K-1 and never
    idles again, so the makespan is the lower bound 3M + K - 1 (for M < K: 2(M+K) - 1).
    """
    schedule = []
    for stage in range(stages):
        actions = [Action("F", i) for i in range(min(stages - stage, microbatches))]
        forwards, weights = len(actions), 0
        for backward in range(microbatches):
            actions.append(Action("B", backward))
            if backward + 1 - weights > stage:  # more than s weight gradients wait: run the oldest
                actions.append(Action("W", weights))
                weights += 1
            if forwards < microbatches:
                actions.append(Action("F", forwards))
                forwards += 1
        actions += [Action("W", i) for i in range(weights, microbatches)]
        schedule.append(actions)
    return schedule


def zb_v(stages: int, microbatches: int) -> Schedule:
    """ZB-V: two chunks a rank in the V placement (chunk 0 = virtual stage s, chunk 1 = 2K-1-s).

    Rank s fills with 2(K-s)-1 chunk-0 forwards, then s pairs (chunk-1 forward, chunk-0 forward), then
    K-s rounds of F, B, W through chunk 1; in the steady state each round is F, B, W through chunk 0
    and then through chunk 1; the drain runs s pairs of B (chunk 0, chunk 1) with their W left waiting,
    then K-s rounds of (B, the oldest W) through chunk 0, then the waiting W's, chunk 1's first. The
    order is written for at least 2K-1 micro-batches (enough to fill the V); with fewer, the actions
    of micro-batches that do not exist are dropped (torch's ScheduleZBVZeroBubble does the same).
    """
    padded = max(2 * stages - 1, microbatches)
    schedule = []
    for stage in range(stages):
        order = _VOrder()
        order.run([("F", 0)] * (2 * (stages - stage) - 1) + [("F", 1), ("F", 0)] * stage
                  + [("F", 1), ("B", 1), ("W", 1)] * (stages - stage))
        while order.count["F", 1] < order.count["F", 0] or order.count["F", 0] < padded:
            order.run(([("F", 0)] if order.count["F", 0] < padded else [])
                      + [("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1)])
        order.run([("B", 0), ("B", 1)] * stage + [("B", 0), ("W", 0)] * (stages - stage))
        order.run([("W", 1)] * (order.count["B", 1] - order.count["W", 1])
                  + [("W", 0)] * (order.count["B", 0] - order.count["W", 0]))
        schedule.append([action for action in order.actions if action.microbatch < microbatches])
    return schedule


def dualpipev(stages: int, microbatches: int) -> Schedule:
    """DualPipeV (DeepSeek-V3's DualPipe cut in half; torch's ScheduleDualPipeV): the V placement, and in
    the steady state every step is an F&B, one micro-batch's forward through one chunk overlapped
    with another's whole backward through the other chunk.

    Rank s fills with 2(K-s-1) chunk-0 forwards and s+1 pairs of forwards (chunk 0, chunk 1), then
    K-s-1 rounds of (B of chunk 1, the oldest waiting W, F of chunk 1); then M-2K+s+1 rounds of
    (F0&BW1, F1&BW0) (the very first F0&BW1 of rank K-1 runs as two plain steps); K-s-1 rounds of
    (BW1, F1&BW0); s+1 pairs of backwards (chunk 1, chunk 0), whole until the middle pair, then split
    with their W waiting; K-s-1 rounds of (the oldest W, B of chunk 0); and the last s+1 waiting W's.
    Needs M >= 2K micro-batches.
    """
    if microbatches < 2 * stages:
        raise ValueError(f"dualpipev needs at least 2K = {2 * stages} micro-batches, got {microbatches}")
    schedule = []
    for s in range(stages):
        order, rest = _VOrder(), stages - s - 1
        order.run([("F", 0)] * 2 * rest + [("F", 0), ("F", 1)] * (s + 1))
        for _ in range(rest):
            order.run([("B", 1)])
            order.oldest_weight()
            order.run([("F", 1)])
        for i in range(microbatches - 2 * stages + s + 1):
            if i == 0 and s == stages - 1:  # kept apart: the V's turn has nothing to overlap yet
                order.run([("F", 0), ("BW", 1)])
            else:
                order.overlap(0, 1)
            order.overlap(1, 0)
        for _ in range(rest):
            order.run([("BW", 1)])
            order.overlap(1, 0)
        pairs = s + 1  # from the middle pair on, B alone: its W fills the drain
        for i in range(pairs):
            order.run([("B" if i > pairs // 2 or (i == pairs // 2 and s % 2) else "BW", 1),
                       ("B" if i >= pairs // 2 else "BW", 0)])
        for _ in range(rest):
            order.oldest_weight()
            order.run([("B", 0)])
        for _ in range(pairs):
            order.oldest_weight()
        schedule.append(order.actions)
    return schedule


class _VOrder:
    """A rank's actions as they are appended: each (op, chunk) takes its next micro-batch in turn; a
    split B leaves its W waiting, oldest first; a BW is B and W at once."""

    def __init__(self):
        self.actions: list[Action] = []
        self.count = {(op, chunk): 0 for op in OPS for chunk in (0, 1)}
        self.waiting: list[Action] = []  # the W's of split B's not yet run, oldest first

    def next(self, op: str, chunk: int) -> Action:
        action = Action(op, self.count["B" if op == "BW" else op, chunk], chunk)
        for part in action.parts():
            self.count[part.op, chunk] += 1
        if op == "B":
            self.waiting.append(Action("W", action.microbatch, chunk))
        if op == "W":
            self.waiting.remove(action)
        return action

    def run(self, steps: list[tuple[str, int]]) -> None:
        self.actions += [self.next(op, chunk) for op, chunk in steps]

    def oldest_weight(self) -> None:
        if self.waiting:
            self.run([("W", self.waiting[0].chunk or 0)])

    def overlap(self, forward_chunk: int, backward_chunk: int) -> None:
        forward = self.next("F", forward_chunk)
        self.actions.append(Action("F&B", forward.microbatch, forward_chunk, self.next("BW", backward_chunk)))


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zb-h1": zb_h1,
    "zb-v": zb_v, "dualpipev": dualpipev}
V_SHAPED = ("zb-v", "dualpipev")  # two chunks a rank in the V placement; the loss on rank 0
SPLIT_BACKWARD = ("zb-h1", "zb-v", "dualpipev")  # B is the input gradient only, W the weight gradient


def placement_of(name: str) -> str:
    """How schedule `name` places virtual stages on ranks: "v" (rank s: s and 2K-1-s) or "loop"
    (Megatron's round robin: chunk c of rank s is c·K + s)."""
    return "v" if name in V_SHAPED else "loop"


def chunks_of(name: str, virtual_stages: int = 1) -> int:
    """Chunks per rank: 2 for a V-shaped schedule, else `virtual_stages`."""
    return 2 if name in V_SHAPED else virtual_stages


def virtual_stage(stage: int, chunk: int | None, stages: int, placement: str = "loop") -> int:
    """The virtual stage (its place in the model's order) of `chunk` on rank `stage`."""
    if placement == "v" and chunk == 1:
        return 2 * stages - 1 - stage
    return (chunk or 0) * stages + stage


def rank_and_chunk(virtual: int, stages: int, chunks: int, placement: str = "loop") -> tuple[int, int | None]:
    """The (rank, chunk) holding virtual stage `virtual`: the inverse of `virtual_stage`."""
    if chunks == 1:
        return virtual, None
    if placement == "v":
        return (virtual, 0) if virtual < stages else (2 * stages - 1 - virtual, 1)
    return virtual % stages, virtual // stages


# The simulator is plain Python (tens of microseconds an action, and a pass over the stages each time one
# waits): sizes are bounded before it runs, so that any input answers in seconds, not hours. The
# largest published run it models (Megatron's 1T: 64 stages, 512 micro-batches) fits.
MAX_ACTIONS = 2**15  # stages x micro-batches x chunks
MAX_VIRTUAL_STAGES = 256  # stages x chunks
MAX_CELLS = 4_000_000  # the timeline: stages x slots


def size_errors(stages: int, microbatches: int, virtual_stages: int = 1) -> list[str]:
    """Why the simulator refuses these sizes (one line each), empty when it takes them."""
    errors = []
    if stages * virtual_stages > MAX_VIRTUAL_STAGES:
        errors.append(f"stages x chunks = {stages * virtual_stages:,} is more than the {MAX_VIRTUAL_STAGES} "
                      "the schedule simulator takes")
    if stages * microbatches * virtual_stages > MAX_ACTIONS:
        errors.append(f"stages x micro-batches x chunks = {stages * microbatches * virtual_stages:,} is "
                      f"more than the {MAX_ACTIONS:,} the schedule simulator takes")
    return errors


class TimelineTooLarge(ValueError):
    """The timeline would have more than MAX_CELLS slots (costs with a large ratio or denominator)."""


def build_schedule(name: str, stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The per-stage action lists of schedule `name` (one of SCHEDULES; V > 1 only for interleaved)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose from {', '.join(SCHEDULES)}")
    if stages < 1 or microbatches < 1:
        raise ValueError(f"need at least 1 stage and 1 micro-batch, got {stages} and {microbatches}")
    if name == "interleaved":
        return interleaved(stages, microbatches, virtual_stages)
    if name in V_SHAPED and stages < 2:
        raise ValueError(f"{name} places two chunks on each of at least 2 ranks, got {stages}")
    if virtual_stages != 1:
        raise ValueError(f"{virtual_stages} virtual stages need the interleaved schedule, not {name}")
    return SCHEDULES[name](stages, microbatches)


def virtual_stages_of(schedule: Schedule) -> int:
    """V: how many chunks each rank holds (1 for a schedule without chunks)."""
    chunks = {action.chunk for actions in schedule for action in actions}
    return 1 if chunks == {None} else len(chunks)


def splits_backward(schedule: Schedule) -> bool:
    """Whether B is the input gradient only, with the weight gradient a separate W step (ZB-H1)."""
    return any(part.op == "W" for actions in schedule for action in actions for part in action.parts())


def _action_at(op: str, microbatch: int, virtual: int, stages: int, chunks: int,
               placement: str) -> tuple[int, Action]:
    """(rank, action) of virtual stage `virtual`."""
    rank, chunk = rank_and_chunk(virtual, stages, chunks, placement)
    return rank, Action(op, microbatch, chunk)


def dependencies(stage: int, action: Action, stages: int, virtual_stages: int = 1,
                 placement: str = "loop") -> list[tuple[int, Action]]:
    """The (stage, action) pairs that must finish before `action` can start on `stage`.

    A pair on another stage is a message the executor receives: activations from the virtual stage
    before for a forward, the gradient from the one after for a backward (with V chunks, virtual stage
    c·K + s follows c·K + s - 1, and chunk c+1 on rank 0 follows chunk c on rank K-1; in the V
    placement chunk 1 on rank K-1 follows chunk 0 there, and the loss is on rank 0). A backward also
    needs its own forward (the saved activations), which is what starts it on the last virtual stage;
    a weight gradient W needs its own B (the output's gradient, which B received). A BW needs what
    its B needs, and an F&B what its F and its BW need.
    """
    if action.op in ("F&B", "BW"):
        return [need for part in action.parts() if part.op != "W"
                for need in dependencies(stage, part, stages, virtual_stages, placement)]
    virtual = virtual_stage(stage, action.chunk, stages, placement)
    own_forward = (stage, Action("F", action.microbatch, action.chunk))
    if action.op == "W":
        return [(stage, Action("B", action.microbatch, action.chunk))]
    if action.op == "F":
        if virtual == 0:
            return []
        return [_action_at("F", action.microbatch, virtual - 1, stages, virtual_stages, placement)]
    if virtual == stages * virtual_stages - 1:
        return [own_forward]
    return [own_forward, _action_at("B", action.microbatch, virtual + 1, stages, virtual_stages, placement)]


def check_schedule(schedule: Schedule) -> int:
    """Check every stage runs each op (F, B, and W if any stage has one) once per micro-batch and
    chunk; return the number of micro-batches."""
    if not schedule:
        raise ValueError("a schedule needs at least one stage")
    chunks = sorted({action.chunk for actions in schedule for action in actions}, key=lambda c: c or 0)
    ops = "FBW" if splits_backward(schedule) else "FB"
    # counted on the stage that lists the most actions: a stage short of one is then told of every
    # micro-batch it must run, not of one fewer
    listed = max(sum(len(action.parts()) for action in actions) for actions in schedule)
    microbatches = listed // (len(ops) * len(chunks))
    expected = sorted((op, i, c or 0) for op in ops for i in range(microbatches) for c in chunks)
    for stage, actions in enumerate(schedule):
        if sorted((p.op, p.microbatch, p.chunk or 0) for a in actions for p in a.parts()) != expected:
            raise ValueError(f"stage {stage} must run {', '.join(ops)} of micro-batches "
                             f"0..{microbatches - 1} once" + (" per chunk" if len(chunks) > 1 else ""))
    return microbatches


@dataclass(frozen=True)
class Timeline:
    """A schedule placed on time slots: grid[stage][slot] is the action busy there, or None when idle.

    Every slot lasts `slot` time units (1 unless a cost is fractional or chunks split a stage's
    work); `start` gives the slot where each action begins."""

    grid: list[list[Action | None]]
    start: dict[tuple[int, Action], int]
    slot: Fraction = Fraction(1)

    @property
    def makespan(self) -> Fraction:
        """The step's duration in time units."""
        return len(self.grid[0]) * self.slot


def _slot_of(costs: list[Fraction]) -> Fraction:
    """The longest slot that divides every cost: the gcd of fractions over their common denominator."""
    denominator = math.lcm(*(c.denominator for c in costs))
    return Fraction(math.gcd(*(int(c * denominator) for c in costs)), denominator)


def action_costs(forward_cost=1, backward_cost=1, weight_cost=1, virtual_stages: int = 1,
                 overlap_cost=None) -> dict:
    """Time units of one action per op: a chunk's action costs a stage's divided by V. A BW costs B + W;
    an F&B `overlap_cost` (default F + B + W: no gain from the overlap)."""
    costs = {"F": Fraction(forward_cost), "B": Fraction(backward_cost), "W": Fraction(weight_cost)}
    costs["BW"] = costs["B"] + costs["W"]
    costs["F&B"] = costs["F"] + costs["BW"] if overlap_cost is None else Fraction(overlap_cost)
    if any(cost <= 0 for cost in costs.values()):
        raise ValueError("forward, backward, weight and overlap costs must be positive")
    return {op: cost / virtual_stages for op, cost in costs.items()}


def simulate(schedule: Schedule, forward_cost=1, backward_cost=1, weight_cost=1,
             placement: str = "loop", overlap_cost=None) -> Timeline:
    """Run each stage's actions in order, each as early as its rank is free and its inputs are ready.

    This is what ranks executing the lists with blocking receives do, if compute takes `forward_cost`,
    `backward_cost` and (for a split backward) `weight_cost` time units per stage (a chunk's share
    with V chunks), and messages take no time. Costs may be fractions. `placement` says where the
    chunks sit ("v" for a V-shaped schedule, `placement_of`). A schedule whose ranks would wait on
    each other forever raises ValueError.
    """
    check_schedule(schedule)
    chunks = virtual_stages_of(schedule)
    costs = action_costs(forward_cost, backward_cost, weight_cost, chunks, overlap_cost)
    slot = _slot_of(list(costs.values()))
    cost = {op: int(c / slot) for op, c in costs.items()}  # in slots: the simulation is integer
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
                inputs = dependencies(stage, action, stages, chunks, placement)
                if any(key not in finish for key in inputs):
                    break  # this rank blocks on a receive until another stage gets further
                begin = max([rank_free_at[stage]] + [finish[key] for key in inputs])
                start[(stage, action)] = begin
                rank_free_at[stage] = begin + cost[action.op]
                for part in action.parts():  # what F&B and BW stand for is done when they are
                    finish[(stage, part)] = rank_free_at[stage]
                position[stage] += 1
                progressed = True
        if not progressed:
            waiting = "; ".join(
                f"stage {s} waits at {schedule[s][position[s]]}"
                for s in range(stages)
                if position[s] < len(schedule[s])
            )
            raise ValueError(f"schedule deadlocks: {waiting}")
    if stages * max(rank_free_at) > MAX_CELLS:
        raise TimelineTooLarge(f"the timeline has {stages:,} stages x {max(rank_free_at):,} slots of "
                               f"{slot} time units, more than the {MAX_CELLS:,} cells it may hold")
    grid: list[list[Action | None]] = [[None] * max(rank_free_at) for _ in range(stages)]
    for (stage, action), begin in start.items():
        grid[stage][begin:begin + cost[action.op]] = [action] * cost[action.op]
    return Timeline(grid=grid, start=start, slot=slot)


def bubble_fraction(timeline: Timeline) -> Fraction:
    """Idle slots over all slots (stages x makespan): the share of the machine the pipeline wastes."""
    idle = sum(cell is None for row in timeline.grid for cell in row)
    return Fraction(idle, len(timeline.grid) * len(timeline.grid[0]))


def peak_inflight(schedule: Schedule) -> list[int]:
    """Per stage, the most (micro-batch, chunk) pairs whose activations are held: from F to the end of
    their backward (to W when the backward is split, since W still reads them)."""
    last = "W" if splits_backward(schedule) else "B"
    peaks = []
    for actions in schedule:
        inflight = peak = 0
        for action in actions:
            for part in action.parts():  # an F&B holds its forward's activations before its W frees
                inflight += 1 if part.op == "F" else -1 if part.op == last else 0
                peak = max(peak, inflight)
        peaks.append(peak)
    return peaks


def p2p_messages(schedule: Schedule, placement: str = "loop") -> int:
    """Point-to-point messages of one step: every input an action receives from another rank."""
    chunks = virtual_stages_of(schedule)
    return sum(other != stage for stage, actions in enumerate(schedule) for action in actions
               for other, _ in dependencies(stage, action, len(schedule), chunks, placement))


def render(timeline: Timeline) -> str:
    """An ASCII timeline like the GPipe paper's figure: last stage on top, one column per slot.

    A backward that takes 2 slots fills two columns with its label; '.' marks an idle slot; "F3.1"
    is micro-batch 3 through chunk 1, and W3 is micro-batch 3's weight gradient.
    """
    width = max(len(str(cell)) for row in timeline.grid for cell in row if cell is not None)
    label_width = len(str(len(timeline.grid) - 1))
    lines = []
    for stage in reversed(range(len(timeline.grid))):
        cells = [(str(cell) if cell is not None else ".").rjust(width) for cell in timeline.grid[stage]]
        lines.append(f"stage {stage:>{label_width}} | " + " ".join(cells))
    return "\n".join(lines)
