"""Pipeline parallelism: cut the model's units into K stages, one per rank, and stream micro-batches.

The idea: stage s holds a contiguous run of the model's units (embedding, blocks, head) and nothing
else. A forward receives the activation from stage s-1, runs the stage and sends its output to s+1;
a backward receives the output's gradient from s+1, back-propagates through the stage and sends the
input's gradient to s-1. The last stage owns the loss. Which micro-batch each rank works on, and in
what order, is the schedule (naive, GPipe or 1F1B): data from `schedules.py`, run here by one executor.

What it saves: each rank holds only its stage's parameters, gradients and optimizer state (about 1/K).
What it costs: one point-to-point message of a (micro-batch, T, d_model) activation per stage boundary
and micro-batch in each direction, and the bubble: with M micro-batches a stage idles for a fraction
(K-1)/(M+K-1) of the step, which `PipelineRunner` measures in wall time during real training.
Lesson: lessons/06_pipeline.md.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from fractions import Fraction
from typing import TYPE_CHECKING

import numpy as np

from minipar.core import backend
from minipar.core.autograd import Tensor
from minipar.core.nn import Module
from minipar.parallel.api import Runner
from minipar.parallel.schedules import build_schedule, check_schedule

if TYPE_CHECKING:  # only for annotations: the pipeline talks to MPI through Comm
    from mpi4py import MPI


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


class PipelineStage(Module):
    """A contiguous run of a model's units, registered under their global names ("blocks.3")."""

    def __init__(self, model, units: range, is_last: bool):
        super().__init__()
        for name, unit in model.units()[units.start:units.stop]:
            self.add_module(name, unit)
        self.config = model.config
        self.loss = without_units(model).loss  # applied on the last stage only
        self.is_last = is_last

    def units(self):
        return list(self._children.items())

    def forward(self, x):
        for _, unit in self.units():
            x = unit(x)
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


def build_stage(model, stages: int, stage: int) -> PipelineStage:
    """Keep this stage's units of `model` (the others are dropped with it); parameters keep their names."""
    bounds = partition([unit_cost(unit) for _, unit in model.units()], stages)
    return PipelineStage(model, bounds[stage], is_last=stage == stages - 1)


def bubble_formula(stages: int, microbatches: int) -> Fraction:
    """The idle share of a pipeline of equal stages: (K-1)/(M+K-1)."""
    return Fraction(stages - 1, microbatches + stages - 1)


class PipelineRunner(Runner):
    """Runs this stage's actions of a schedule over the micro-batches of one batch.

    Activations and gradients cross stage boundaries with non-blocking sends and blocking receives:
    a rank never waits on its own sends, so any schedule the simulator can run cannot deadlock here
    (a blocking send of a large message would: in 1F1B two neighbours may both be sending).
    `timing()` is the measured busy and idle time of the last step, gathered over stages.
    """

    def __init__(self, stage: PipelineStage, comm, schedule: str, microbatches: int, width: int, dtype):
        self.stage, self.comm = stage, comm
        self.stages, self.rank = comm.size, comm.rank
        schedule_table = build_schedule(schedule, self.stages, microbatches)
        self.microbatches = check_schedule(schedule_table)  # naive runs one, whatever was asked
        self.actions = schedule_table[self.rank]
        self.width, self.dtype = width, dtype
        self.in_flight: dict[int, tuple] = {}  # micro-batch -> (stage input, output), until its backward
        self.pending_sends: list[MPI.Request] = []  # this step's sends not yet known to be complete
        self.loss_sum = 0.0
        self.compute_s = {"F": 0.0, "B": 0.0}
        self.last_timing: dict = {}

    def timing(self) -> dict | None:
        """The last step's busy and idle time of every stage and the bubble (None before a step)."""
        return self.last_timing or None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.stages - 1

    def forward_backward(self, inputs, targets, normaliser: int) -> float:
        """The summed loss of this batch on the last stage (0.0 on the others); grads accumulate."""
        xs = np.array_split(inputs, self.microbatches)
        ys = np.array_split(targets, self.microbatches)
        self.in_flight, self.pending_sends, self.loss_sum = {}, [], 0.0
        self.compute_s = {"F": 0.0, "B": 0.0}
        self.comm.barrier()  # every stage's clock starts together, so the makespan is common
        started = time.perf_counter()
        for action in self.actions:
            if action.op == "F":
                self.forward(action.microbatch, xs[action.microbatch], ys[action.microbatch], normaliser)
            else:
                self.backward(action.microbatch)
        for request in self.pending_sends:
            self.comm.wait(request, "send")
        self.record_timing(time.perf_counter() - started)
        return self.loss_sum

    def forward(self, i: int, x, y, normaliser: int):
        be = backend.current()
        if self.is_first:
            stage_input = be.from_host(x)
        else:
            received = self.comm.recv(self.activation_shape(x), self.dtype, self.rank - 1, tag=2 * i)
            stage_input = Tensor(received, requires_grad=True)
        with self.computing("F"):
            output = self.stage(stage_input)
            if self.is_last:
                output = self.stage.loss(output, be.from_host(y), normaliser)
                self.loss_sum += output.item()
        if not self.is_last:
            self.send(output.data, self.rank + 1, tag=2 * i)  # tags: 2i forward, 2i+1 backward
        self.in_flight[i] = (stage_input, output)

    def backward(self, i: int):
        stage_input, output = self.in_flight.pop(i)
        grad = None
        if not self.is_last:
            grad = self.comm.recv(output.shape, self.dtype, self.rank + 1, tag=2 * i + 1)
        with self.computing("B"):
            output.backward(grad)
        if not self.is_first:
            self.send(stage_input.grad, self.rank - 1, tag=2 * i + 1)

    def activation_shape(self, x) -> tuple:
        """(*batch axes, width): token ids (B, T) become (B, T, d); features (B, d_in) become (B, d)."""
        batch_axes = x.shape if np.issubdtype(x.dtype, np.integer) else x.shape[:-1]
        return (*batch_axes, self.width)

    def send(self, array, dest: int, tag: int):
        self.pending_sends.append(self.comm.isend(array, dest, tag=tag))
        self.pending_sends = [r for r in self.pending_sends if not r.Test()]  # also drives MPI progress

    @contextlib.contextmanager
    def computing(self, op: str):
        """Add the wall time of a block of computation (device work included) to op's busy time."""
        started = time.perf_counter()
        yield
        backend.current().sync()
        self.compute_s[op] += time.perf_counter() - started

    def record_timing(self, wall_s: float):
        """Gather every stage's compute time; bubble = idle share of stages x makespan (uncharged control)."""
        mine = (self.compute_s["F"], self.compute_s["B"], wall_s)
        forward, backward, walls = zip(*self.comm.allgather_obj(mine))
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
            "bubble_measured": 1.0 - sum(busy) / (self.stages * makespan),
            "bubble_formula": float(bubble_formula(self.stages, self.microbatches)),
        }
