"""Pipeline parallelism: cut the model's units into K stages, one per rank, and stream micro-batches.

The idea: stage s holds a contiguous run of the model's units (embedding, blocks, head) and nothing
else. A forward receives the activation from stage s-1, runs the stage and sends its output to s+1;
a backward receives the output's gradient from s+1, back-propagates through the stage and sends the
input's gradient to s-1. The last stage owns the loss. Which micro-batch each rank works on, and in
what order, is the schedule (naive, GPipe, 1F1B, interleaved, ZB-H1, ZB-V): data from `schedules.py`,
run here by one executor.

What it saves: each rank holds only its stage's parameters, gradients and optimizer state (about 1/K).
What it costs: one point-to-point message of a (micro-batch, T, d_model) activation per stage boundary
and micro-batch in each direction, and the bubble: with M micro-batches a stage idles for a fraction
(K-1)/(M+K-1) of the step, which `PipelineRunner` measures in wall time during real training.
The interleaved schedule gives each rank V chunks (`build_stage(..., virtual_stages=V)`): the bubble
drops to (K-1)/(VM+K-1) for V times the messages; ZB-H1 splits each backward into B (sent on at once)
and W (the weight gradients, run later by the autograd engine's deferred calls) to fill the drain.
ZB-V gives each rank two chunks placed as a V (rank s: virtual stages s and 2K-1-s), so the loss is
computed on rank 0 and the forward turns back on rank K-1 without a message. DualPipeV's F&B steps run
a forward and a backward as two parts that take turns at each MoE all-to-all (f_and_b.py).
Lessons: lessons/06_pipeline.md, lessons/06b_pipeline_schedules.md.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

import numpy as np

from minipar.core import backend
from minipar.core.autograd import Tensor
from minipar.core.hooks import HookList, RemovableHandle
from minipar.core.nn import ModelOptions, Module
from minipar.core.options import option
from minipar.parallel.api import Runner, count_correct, own_pieces, split_scored
from minipar.parallel.f_and_b import Interleave
from minipar.parallel.schedules import (
    SCHEDULES,
    V_SHAPED,
    Action,
    build_schedule,
    check_schedule,
    chunks_of,
    placement_of,
    rank_and_chunk,
    splits_backward,
    virtual_stage,
)

if TYPE_CHECKING:  # only for annotations: the pipeline talks to MPI through Comm
    from mpi4py import MPI

    from minipar.distributed.communicator import PendingCollective


def unit_cost(unit: Module) -> int:
    """The balancing cost of a unit: its parameter count, on full (unsharded) shapes.

    Parameters are what a stage must hold, and a dense layer's FLOPs per token are twice its
    parameters. The embedding and the head count like any block: with a large vocabulary (BLOOM's
    250k tokens) they are the largest units of all, and a partition that ignored them would overload
    the first and last stage.
    """
    return sum(math.prod(p.full_shape) for p in unit.parameters())


def partition(costs: list[int], stages: int) -> list[range]:
    """Cut units into `stages` contiguous, non-empty ranges, as balanced as possible.

    Balanced means: the costliest stage is as cheap as possible (it sets the pace of the pipeline),
    then the second costliest, and so on. Dynamic programming over (stages used, units covered):
    best[k, j] is the stage costs, costliest first, of the best cut of the first j units into k stages;
    comparing these tuples lexicographically is exactly that order. Ties go to the earliest cut, so
    every rank computes the same partition.
    """
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} units into {stages} non-empty stages")
    # exercise 06.3: cutting the model into balanced stages
    prefix = np.concatenate([[0], np.cumsum(costs)])
    best: dict[tuple[int, int], tuple[int, ...]] = {(0, 0): ()}
    cut: dict[tuple[int, int], int] = {}  # (k, j) -> where the last stage of best[k, j] starts
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            best[k, j], cut[k, j] = min(
                (tuple(sorted(best[k - 1, i] + (int(prefix[j] - prefix[i]),), reverse=True)), i)
                for i in range(k - 1, j) if (k - 1, i) in best)
    bounds, stop = [], n
    for k in range(stages, 0, -1):
        bounds.append(range(cut[k, stop], stop))
        stop = cut[k, stop]
    return bounds[::-1]
    # end exercise


class PipelineStage(Module):
    """A rank's runs of a model's units, registered under their global names ("blocks.3").

    One run (`chunks`: one range of units) for a plain pipeline; V runs, chunk c being virtual stage
    c·K + s, for the interleaved schedule. `forward(x, chunk)` runs one chunk."""

    def __init__(self, model, chunks: list[range], is_last: bool):
        super().__init__()
        units = model.units()
        self.chunk_units = [[name for name, _ in units[run.start:run.stop]] for run in chunks]
        for run in chunks:
            for name, unit in units[run.start:run.stop]:
                self.add_module(name, unit)
        self.config = model.config
        shell = without_units(model)  # its loss is applied on the last stage only
        self.loss, self.loss_and_correct = shell.loss, shell.loss_and_correct
        self.is_last = is_last

    def units(self):
        return list(self._children.items())

    def forward(self, x, chunk: int = 0):
        for name in self.chunk_units[chunk]:
            x = self._children[name](x)
        return x


def without_units(model):
    """A shallow copy of `model` with its settings (config, communicator...) but no parameters.

    A model's `loss` may be a method that needs those settings (tensor parallelism's does); bound to
    this copy it does not keep the other stages' units, and their memory, alive."""
    shell = copy.copy(model)
    for name in [*model._children, *model._params]:
        shell.__dict__.pop(name, None)
    object.__setattr__(shell, "_children", {})
    object.__setattr__(shell, "_params", {})
    return shell


def build_stage(model, stages: int, stage: int, virtual_stages: int = 1, placement: str = "loop"
                ) -> PipelineStage:
    """Keep this stage's units of `model` (the others are dropped with it); parameters keep their names.

    With V virtual stages the units are cut into K·V balanced runs and rank s keeps runs s, K+s, ...
    (round-robin, Megatron's assignment), so the first and the last run sit on ranks 0 and K-1. In
    the V placement (`placement` "v", two chunks) rank s keeps runs s and 2K-1-s: the last is on rank 0."""
    bounds = partition([unit_cost(unit) for _, unit in model.units()], stages * virtual_stages)
    chunks = [bounds[virtual_stage(stage, chunk, stages, placement)] for chunk in range(virtual_stages)]
    last_rank = 0 if placement == "v" else stages - 1
    return PipelineStage(model, chunks, is_last=stage == last_rank)


def bubble_formula(stages: int, microbatches: int, virtual_stages: int = 1, split_backward: bool = False,
                   overlapped: bool = False) -> Fraction:
    """The idle share of a pipeline of equal stages: (K-1)/(M+K-1); with V chunks per rank
    (K-1)/(VM+K-1); with the backward split (ZB-H1, F = B = W, M >= K) (K-1)/(3M+K-1); with both
    (ZB-V: two chunks as a V, M >= 2K-1) (K-1)/(6M+K-1). DualPipeV (`overlapped`), F = B = W a chunk
    and an F&B costing F + B + W: the DualPipe README's (K-1)(F&B + B - 3W) = 2(K-1) chunk units over
    6M of work a rank, (K-1)/(3M+K-1)."""
    if overlapped:
        return Fraction(stages - 1, 3 * microbatches + stages - 1)
    if split_backward and virtual_stages == 2:
        return Fraction(stages - 1, 6 * microbatches + stages - 1)
    if split_backward:
        return Fraction(stages - 1, 3 * microbatches + stages - 1)
    return Fraction(stages - 1, virtual_stages * microbatches + stages - 1)


SCHEDULE = "schedule"  # the action hooks' label of a stage's whole schedule in one step


def loss_rank(schedule: str, stages: int) -> int:
    """The pipeline rank that holds the last virtual stage, and so the loss: 0 in a V, else K-1."""
    return 0 if placement_of(schedule) == "v" else stages - 1


class PipelineRunner(Runner):
    """Runs this stage's actions of a schedule over the micro-batches of one batch.

    Activations and gradients cross stage boundaries with non-blocking sends and blocking receives:
    a rank never waits on its own sends, so any schedule the simulator can run cannot deadlock here
    (a blocking send of a large message would: in 1F1B two neighbours may both be sending). With V
    chunks per rank (interleaved), action (i, c) on rank s is virtual stage v = c·K + s: it receives from
    rank (v-1) mod K and sends to (v+1) mod K, each message tagged by its micro-batch and boundary. With
    the backward split (ZB-H1), B sends the input gradient on and leaves the weight gradients, and the
    gradient hooks waiting for them, to W. `timing()` is the measured busy and idle time of the last
    step, gathered over stages, with each stage's actions as [label, start, stop] seconds from the
    step's common start (a measured Gantt chart: `python -m minipar plot gantt`). With
    `early_receives` (unless --no-overlap) the receive an action needs is posted (Irecv) as the action
    before it begins, so the message lands in its buffer while this stage computes, and the action only
    waits for what has not yet arrived.
    """

    def __init__(self, stage: PipelineStage, comm, schedule: str, microbatches: int, width: int, dtype,
                 virtual_stages: int = 1, sequence_pieces: int = 1, early_receives: bool = False):
        self.stage, self.comm = stage, comm
        self.early_receives = early_receives
        self.posted: dict[tuple, PendingCollective] = {}  # (source, tag) -> a receive posted early
        self.received_early = 0  # this step's messages that arrived into a receive posted early
        self.stages, self.rank = comm.size, comm.rank
        schedule_table = build_schedule(schedule, self.stages, microbatches, virtual_stages)
        self.microbatches = check_schedule(schedule_table)  # naive runs one, whatever was asked
        self.virtual_stages = chunks_of(schedule, virtual_stages)
        self.placement, self.schedule = placement_of(schedule), schedule
        self.split_backward = splits_backward(schedule_table)
        self.actions = schedule_table[self.rank]
        self.width, self.dtype = width, dtype
        self.sequence_pieces = sequence_pieces  # --sp: a stage boundary carries seq_len/tp positions
        self.in_flight: dict[tuple, tuple] = {}  # (micro-batch, chunk) -> (stage input, output), to B
        self.deferred: dict[tuple, list] = {}  # (micro-batch, chunk) -> weight-gradient work, B to W
        self.pending_sends: list[MPI.Request] = []  # this step's sends not yet known to be complete
        self.turn: dict[int, object] = {}  # tag -> array handed from chunk 0 to chunk 1 on this rank
        self.peak_held = 0  # this step's most (micro-batch, chunk) pairs held, from F to B (or to W)
        # F&B steps: [label, receives posted, backward's receive waited, whether it was posted (None: none)]
        self.overlaps: list[list] = []
        # each all-to-all inside an F&B: [F&B label, its part's label, posted, waited] (f_and_b.py)
        self.exchanges: list[list] = []
        self.interleave: Interleave | None = None  # the F&B step running now, if any
        self.loss_sum = 0.0
        self.correct = 0  # this step's right predictions among the scored ones (last stage)
        self.compute_s = {"F": 0.0, "B": 0.0, "W": 0.0, "BW": 0.0}
        self.action_times: list[list] = []  # this step's [label, start, stop], seconds from step_started
        self.step_started = 0.0
        self.last_timing: dict = {}
        self.action_hooks = HookList()

    def register_action_hook(self, hook) -> RemovableHandle:
        """Call `hook(label, started, stopped)` after each action's computation (perf_counter seconds):
        what `timing()`'s Gantt chart records, as it happens (a trace, trainer/trace.py); and once a
        step `hook(SCHEDULE, started, stopped)`: this stage's whole schedule, from the barrier's exit to
        its last send's completion, the span `timing()`'s makespan and bubble are measured over."""
        return self.action_hooks.add(hook)

    def timing(self) -> dict | None:
        """The last step's busy and idle time of every stage and the bubble (None before a step)."""
        return self.last_timing or None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.stages - 1

    def virtual(self, action: Action) -> int:
        """The virtual stage of `action` on this rank: chunk·K + rank (in the V: rank or 2K-1-rank)."""
        return virtual_stage(self.rank, action.chunk, self.stages, self.placement)

    def rank_of(self, virtual: int) -> int:
        """The pipeline rank that holds virtual stage `virtual`."""
        return rank_and_chunk(virtual, self.stages, self.virtual_stages, self.placement)[0]

    def tag(self, microbatch: int, boundary: int, backward: bool) -> int:
        """A message's tag: the boundary between virtual stages `boundary` and `boundary`+1, and the way."""
        return 2 * (microbatch * self.stages * self.virtual_stages + boundary) + int(backward)

    def forward_backward(self, inputs, targets, normaliser: int, scored=None) -> float:
        """The summed loss of this batch on the last stage (0.0 on the others); grads accumulate."""
        xs = own_pieces(inputs, self.microbatches)
        ys = np.array_split(targets, self.microbatches)
        scored_pieces = split_scored(scored, self.microbatches)
        self.in_flight, self.deferred, self.pending_sends, self.loss_sum = {}, {}, [], 0.0
        self.turn = {}
        self.peak_held = 0
        self.overlaps, self.exchanges = [], []
        self.correct = 0
        self.received_early = 0
        self.compute_s = {"F": 0.0, "B": 0.0, "W": 0.0, "BW": 0.0}
        self.action_times = []
        self.comm.barrier()  # the stages start together, to within the barrier's exit (record_timing)
        started = self.step_started = time.perf_counter()
        for k, action in enumerate(self.actions):
            if self.early_receives and k + 1 < len(self.actions):
                self.post_receive(self.actions[k + 1], xs)
            self.run_action(action, xs, ys, scored_pieces, normaliser)
        for request in self.pending_sends:
            self.comm.wait(request, "send")
        stopped = time.perf_counter()
        self.action_hooks.call_all(SCHEDULE, started, stopped)
        self.record_timing(stopped - started)
        return self.loss_sum

    def run_action(self, action: Action, xs, ys, scored_pieces, normaliser: int) -> None:
        """One step of the schedule: an F, a B or BW, a W, or DualPipeV's F&B (`overlapped_step`)."""
        if action.op == "F&B" and action.backward is not None:
            self.overlapped_step(action, xs, ys, scored_pieces, normaliser)
        elif action.op == "F":
            i = action.microbatch
            self.forward(action, xs[i], ys[i], scored_pieces[i], normaliser)
        elif action.op in ("B", "BW"):
            self.backward(action)
        else:
            self.weight_gradients(action)

    def overlapped_step(self, action: Action, xs, ys, scored_pieces, normaliser: int) -> None:
        """DualPipeV's F&B: the receives of both parts posted before either computes, so the forward's
        input and the backward's gradient travel together; then the two parts run as an Interleave
        (f_and_b.py): the forward first, each part handing the other the turn as soon as it has posted
        an all-to-all (MoE with --ep), so that one's all-to-all is in flight while the other computes.
        The forward's output is sent, not waited for, while the backward computes. --no-overlap: no
        early receive and the parts one after the other, the baseline."""
        forward, backward = Action("F", action.microbatch, action.chunk), action.backward
        assert backward is not None, "an F&B has its backward"
        if self.early_receives:
            self.post_receive(action, xs)
        posted = time.perf_counter() - self.step_started
        wanted = self.receive_of(backward.parts()[0], xs)  # None: the loss's chunk starts it
        in_flight = None if wanted is None or wanted[1] == self.rank else wanted[1:] in self.posted
        begun: list[float] = []  # when the backward part began, waiting first for its gradient

        def run_backward():
            begun.append(time.perf_counter() - self.step_started)
            self.run_action(backward, xs, ys, scored_pieces, normaliser)

        self.interleave = Interleave(enabled=self.early_receives)
        try:
            self.interleave.run([(str(forward), lambda: self.run_action(forward, xs, ys, scored_pieces,
                                                                        normaliser)),
                                 (str(backward), run_backward)])
        finally:
            exchanges, self.interleave = self.interleave.exchanges, None
        self.overlaps.append([str(action), posted, begun[0], in_flight])
        self.exchanges += [[str(action), part, sent - self.step_started, waited - self.step_started]
                           for part, sent, waited in exchanges]

    def correct_count(self) -> int | None:
        return self.correct  # 0 but on the last stage, like the loss

    def forward(self, action: Action, x, y, scored, normaliser: int):
        be, i, v = backend.current(), action.microbatch, self.virtual(action)
        last = v == self.stages * self.virtual_stages - 1
        if v == 0:
            stage_input = be.from_host(x)
        else:
            received = self.receive(self.activation_shape(x), self.rank_of(v - 1),
                                    self.tag(i, v - 1, backward=False))
            stage_input = Tensor(received, requires_grad=True)
        with self.computing(action):
            output = self.stage(stage_input, chunk=action.chunk or 0)
            if last:
                output, correct = self.stage.loss_and_correct(output, be.from_host(y), normaliser)
                self.loss_sum += output.item()
                self.correct += count_correct(correct, scored)
        if not last:
            self.send(output.data, self.rank_of(v + 1), tag=self.tag(i, v, backward=False))
        self.in_flight[i, action.chunk] = (stage_input, output)
        self.peak_held = max(self.peak_held, len(self.in_flight) + len(self.deferred))

    def backward(self, action: Action):
        i, v = action.microbatch, self.virtual(action)
        stage_input, output = self.in_flight.pop((i, action.chunk))
        grad = None
        if v != self.stages * self.virtual_stages - 1:
            grad = self.receive(output.shape, self.rank_of(v + 1), self.tag(i, v, backward=True))
        with self.computing(action):
            if action.op == "B" and self.split_backward:  # the input gradient now; W waits
                deferred: list = []
                self.deferred[i, action.chunk] = deferred
                output.backward(grad, defer_weight_grads=deferred)
            else:
                output.backward(grad)
        if v != 0:
            self.send(stage_input.grad, self.rank_of(v - 1), tag=self.tag(i, v - 1, backward=True))

    def receive_of(self, action: Action, xs) -> tuple | None:
        """(shape, source, tag) of the message `action` receives, or None: F receives the previous
        virtual stage's activations, B the next one's gradient of them (the same shape)."""
        i, v = action.microbatch, self.virtual(action)
        if action.op == "F" and v != 0:
            return self.activation_shape(xs[i]), self.rank_of(v - 1), self.tag(i, v - 1, backward=False)
        if action.op == "B" and v != self.stages * self.virtual_stages - 1:
            return self.activation_shape(xs[i]), self.rank_of(v + 1), self.tag(i, v, backward=True)
        return None

    def post_receive(self, action: Action, xs) -> None:
        """Post the receives `action` (each part of an F&B) will wait for, unless already posted."""
        for part in action.parts():
            wanted = self.receive_of(part, xs)
            if wanted is not None and wanted[1] != self.rank and wanted[1:] not in self.posted:
                shape, source, tag = wanted
                self.posted[source, tag] = self.comm.irecv(shape, self.dtype, source, tag=tag)

    def receive(self, shape, source: int, tag: int):
        """The message from `source` with `tag`: the receive posted early, waited for, or a plain one."""
        if source == self.rank:  # the turn of the V: the next chunk is on this rank, no message
            return self.turn.pop(tag)
        # exercise 06.4: the pipeline executor's point-to-point send and receive
        posted = self.posted.pop((source, tag), None)
        if posted is None:
            return self.comm.recv(shape, self.dtype, source, tag=tag)
        received = posted.wait()
        self.received_early += 1
        if received.shape != tuple(shape):
            raise RuntimeError(f"a receive posted early expected {received.shape}, the action {tuple(shape)}")
        return received
        # end exercise

    def weight_gradients(self, action: Action):
        """W: the weight gradients B left, in B's order, each module's backward hooks after its own."""
        with self.computing(action):
            for work in self.deferred.pop((action.microbatch, action.chunk)):
                work()

    def activation_shape(self, x) -> tuple:
        """(*batch axes, width): token ids (B, T) become (B, T, d), or (B, T/tp, d) with --sp;
        features (B, d_in) become (B, d)."""
        if np.issubdtype(x.dtype, np.integer):
            batch, positions = x.shape
            return (batch, positions // self.sequence_pieces, self.width)
        return (*x.shape[:-1], self.width)

    def send(self, array, dest: int, tag: int):
        if dest == self.rank:
            self.turn[tag] = array.copy()
            return
        # exercise 06.4: the pipeline executor's point-to-point send and receive
        self.pending_sends.append(self.comm.isend(array, dest, tag=tag))
        self.pending_sends = [r for r in self.pending_sends if not r.Test()]  # also drives MPI progress
        # end exercise

    @contextlib.contextmanager
    def computing(self, action: Action):
        """Add the wall time of a block of computation (device work included) to its op's busy time,
        and note when the action ran."""
        started = time.perf_counter()
        yield
        backend.current().sync()
        stopped = time.perf_counter()
        label = str(action)
        # inside an F&B step, the stretches this part handed to the other are not its compute
        away = [] if self.interleave is None else [
            (handed, resumed) for part, handed, resumed in self.interleave.away if part == label]
        for start, stop in computed_between(started, stopped, away):
            self.compute_s[action.op] += stop - start
            self.action_times.append([label, start - self.step_started, stop - self.step_started])
            self.action_hooks.call_all(label, start, stop)

    def record_timing(self, wall_s: float):
        """Gather every stage's compute time; bubble = idle share of stages x makespan (uncharged control).

        The stages leave the barrier before the step at slightly different times: microseconds, but
        milliseconds on a loaded machine, where a process waits for a core. On one host every process
        reads the same monotonic clock (perf_counter), so each stage's times are moved onto the first
        stage's start: the chart is then causal to the microsecond and the makespan runs from the first
        start to the last stop. Across hosts the clocks are not comparable, and each stage's times stay
        counted from its own start ("time_base" says which)."""
        backward_s = self.compute_s["B"] + self.compute_s["W"] + self.compute_s["BW"]
        mine = (self.compute_s["F"], backward_s, wall_s, self.action_times,
                self.step_started, self.peak_held, self.overlaps, self.exchanges)
        forward, backward, own_walls, own_actions, starts, held, own_overlaps, own_exchanges = zip(
            *self.comm.allgather_obj(mine))
        nodes = self.comm.nodes  # the grid's: each member's MPI processor name (None: one node)
        shared = nodes is None or len(set(nodes)) == 1
        walls, actions = (from_the_first_start(starts, own_walls, own_actions) if shared
                          else (list(own_walls), list(own_actions)))
        overlaps = from_the_first_start(starts, own_walls, own_overlaps)[1] if shared else list(own_overlaps)
        shifts = [start - min(starts) if shared else 0.0 for start in starts]
        exchanges = [[[step, part, posted + shift, waited + shift] for step, part, posted, waited in stage]
                     for stage, shift in zip(own_exchanges, shifts)]
        busy = [f + b for f, b in zip(forward, backward)]
        makespan = max(walls)
        self.last_timing = {
            "stages": self.stages,
            "microbatches": self.microbatches,
            "busy_s": busy[self.rank],
            "idle_s": makespan - busy[self.rank],
            "stage_forward_s": list(forward),
            "stage_backward_s": list(backward),
            "stage_busy_s": busy,
            "makespan_s": makespan,
            "stage_action_times_s": actions,  # per stage: [label, start, stop] in seconds
            "stage_peak_inflight": list(held),  # per stage: (micro-batch, chunk) pairs held at most
            "stage_overlaps_s": overlaps,  # per stage, each F&B: [label, posted, waited, receive posted]
            "stage_exchanges_s": exchanges,  # per stage, each F&B all-to-all: [F&B, part, posted, waited]
            "time_base": "shared" if shared else "per stage",
            "bubble_measured": 1.0 - sum(busy) / (self.stages * makespan),
            "bubble_formula": float(bubble_formula(self.stages, self.microbatches, self.virtual_stages,
                                                   self.split_backward, self.schedule == "dualpipev")),
            "formula": "(K-1)/(3M+K-1)" if self.schedule == "dualpipev" else
                       "(K-1)/(6M+K-1)" if self.placement == "v" else
                       "(K-1)/(3M+K-1)" if self.split_backward else
                       "(K-1)/(VM+K-1)" if self.virtual_stages > 1 else "(K-1)/(M+K-1)",
        }


def computed_between(started: float, stopped: float, away: list[tuple[float, float]]) -> list[tuple]:
    """The stretches of [started, stopped] outside the `away` ones (in order, each inside it)."""
    stretches, begin = [], started
    for handed, resumed in sorted(away):
        if started <= handed and resumed <= stopped:
            stretches.append((begin, handed))
            begin = resumed
    return [*stretches, (begin, stopped)]


def from_the_first_start(starts, walls, actions) -> tuple[list, list]:
    """Each stage's wall time and actions ([label, start, stop]), counted from its own start (`starts`,
    on one clock), counted instead from the first stage's."""
    shifts = [start - min(starts) for start in starts]
    return ([shift + wall for shift, wall in zip(shifts, walls)],
            [[[label, begin + shift, end + shift, *rest] for label, begin, end, *rest in stage]
             for stage, shift in zip(actions, shifts)])


@dataclass
class PipelineOptions:
    """Pipeline parallelism and micro-batches (parallel/pipeline.py, parallel/schedules.py)."""
    pp: int = option(1, "pipeline stages", single_process=1)
    microbatches: int = option(1, "micro-batches per replica's batch (gradients accumulate over them)",
                               single_process=1)
    schedule: str = option("1f1b", "pipeline schedule (with --pp > 1)", SCHEDULES)
    virtual_stages: int = option(1, "model chunks per pipeline rank (--schedule interleaved: at least 2)",
                                 single_process=1)


def config_errors(options: PipelineOptions, model: ModelOptions) -> list[str]:
    """The checks of --schedule and --virtual-stages, one line each (gathered by trainer/validate.py)."""
    v, k = options.virtual_stages, options.pp
    if v < 1:
        return [f"--virtual-stages must be a positive integer, got {v}"]
    errors = []
    if options.schedule == "interleaved" and k > 1:
        if v < 2:
            errors.append("--schedule interleaved needs --virtual-stages of at least 2")
        if options.microbatches % k:
            errors.append(f"--schedule interleaved needs --microbatches {options.microbatches} to be a "
                          f"multiple of --pp {k} (Megatron's order runs rounds of K micro-batches)")
        if k * v > model.n_units():
            errors.append(f"--pp {k} x --virtual-stages {v} = {k * v} chunks is more than the model's "
                          f"{model.n_units()} blocks; each chunk needs at least one")
    elif v != 1:
        errors.append(f"--virtual-stages {v} needs --schedule interleaved and --pp > 1")
    if options.schedule == "dualpipev" and k > 1 and options.microbatches < 2 * k:
        errors.append(f"--schedule dualpipev needs --microbatches >= 2 x --pp = {2 * k}, got "
                      f"{options.microbatches} (every rank's steady state overlaps two micro-batches)")
    if options.schedule in V_SHAPED and k > 1 and 2 * k > model.n_units():
        errors.append(f"--schedule {options.schedule} cuts the model into 2 x --pp {k} = {2 * k} chunks, "
                      f"more than its {model.n_units()} blocks; each chunk needs at least one")
    return errors
