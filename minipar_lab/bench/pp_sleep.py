"""Pipelines of known costs: every unit sleeps, so a stage's F, B and W take exactly what we say.

With more stages than cores a real model's stages fight over the cores and the measured bubble says
more about the machine than about the schedule. A unit that sleeps leaves the core to the others, so
the bubble measured by `PipelineRunner` (the same timing as in training) can be set beside the formula
and the simulator's. Run (lesson 06b):

    mpiexec -n 4 python -m minipar_lab.bench.pp_sleep --microbatches 8 --unit-ms 20

F = B = W = 1 unit; 1F1B and interleaved run B and W together (a backward of 2 units); with V chunks
a rank holds V units of 1/V each, so a stage costs the same whatever V.
"""
import argparse
import time
from fractions import Fraction

import numpy as np
from mpi4py import MPI

from minipar.core.autograd import Function, Tensor
from minipar.core.module import Module, Parameter
from minipar.distributed.communicator import Comm
from minipar.parallel.pipeline import PipelineRunner, PipelineStage, bubble_formula
from minipar.parallel.schedules import bubble_fraction, build_schedule, simulate

SCHEDULES = [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]


class Sleep(Function):
    """Identity that sleeps `cost` units forward, `cost` for the input's gradient and `cost` for the
    weight's (each only when asked: a split backward asks for them in B and W)."""

    reads_in_backward = (1,)  # the weight, for its gradient's shape

    @staticmethod
    def forward(ctx, x, weight, cost, unit_s):
        ctx.cost, ctx.unit_s = cost, unit_s
        time.sleep(cost * unit_s)
        return x.copy()

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.cost * ctx.unit_s * (ctx.needs_input_grad[0] + ctx.needs_input_grad[1]))
        weight_grad = np.zeros_like(ctx.inputs[1].data) if ctx.needs_input_grad[1] else None
        return g, weight_grad, None, None


class SleepUnit(Module):
    def __init__(self, cost, unit_s):
        super().__init__()
        self.weight, self.cost, self.unit_s = Parameter((1,)), cost, unit_s

    def forward(self, x):
        if not isinstance(x, Tensor):  # the first stage's input: its B costs as much as the others'
            x = Tensor(x, requires_grad=True)
        return Sleep.apply(x, self.weight, self.cost, self.unit_s)


class SleepNet(Module):
    """`n_units` sleeping units and a free loss (no prediction scored right): all a PipelineStage
    needs of a model."""

    config = None

    def __init__(self, n_units, cost, unit_s):
        super().__init__()
        self.names = [f"unit{i}" for i in range(n_units)]
        for name in self.names:
            self.add_module(name, SleepUnit(cost, unit_s))

    def units(self):
        return [(name, self._children[name]) for name in self.names]

    def loss(self, output, targets, normaliser):
        return self.loss_and_correct(output, targets, normaliser)[0]

    def loss_and_correct(self, output, targets, normaliser):
        return (output * output).sum(), np.zeros(targets.shape, dtype=bool)


def measure(world, microbatches: int, unit_s: float, steps: int = 3) -> list[tuple]:
    """(schedule, V, formula, simulated, measured median) per schedule, on the ranks of `world`."""
    k, rows = world.size, []
    for schedule, v in SCHEDULES:
        model = SleepNet(k * v, Fraction(1, v), unit_s)  # unit c·K + s is rank s's chunk c
        chunks = [range(c * k + world.rank, c * k + world.rank + 1) for c in range(v)]
        runner = PipelineRunner(PipelineStage(model, chunks, world.rank == k - 1), Comm(world, "pp"),
                                schedule, microbatches, 4, "float64", v)
        measured = []
        for _ in range(steps):
            runner.forward_backward(np.ones((microbatches, 4)), np.ones((microbatches, 4)), microbatches)
            measured.append(runner.timing()["bubble_measured"])
        split = schedule == "zb-h1"
        timeline = simulate(build_schedule(schedule, k, microbatches, v), 1, 1 if split else 2)
        rows.append((schedule, v, bubble_formula(k, microbatches, v, split), bubble_fraction(timeline),
                     sorted(measured)[steps // 2]))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--unit-ms", type=float, default=20.0)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    rows = measure(world, args.microbatches, args.unit_ms / 1000)
    if world.rank == 0:
        print(f"K={world.size} stages, M={args.microbatches} micro-batches, F = B = W = {args.unit_ms:g} ms")
        print("schedule     V  formula  simulated  measured")
        for schedule, v, formula, simulated, measured in rows:
            print(f"{schedule:<11} {v}  {float(formula):7.3f}  {float(simulated):9.3f}  {measured:8.3f}")


if __name__ == "__main__":
    main()
