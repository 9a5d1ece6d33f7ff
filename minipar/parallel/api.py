"""The two replaceable parts of an engine, written down: what a Runner and an Updater must do.

An engine (trainer/engine.py) is one rank's model plus two parts that every technique replaces:

    Runner   forward and backward over this rank's micro-batches; gradients accumulate in `.grad`
             (MicrobatchRunner here, pipeline.PipelineRunner, precision.mixed.MixedPrecisionRunner)
    Updater  turns this rank's gradients into the next parameters, syncing them first where the
             technique needs to (LocalUpdater here, ddp, zero, zero3, zero_chunked)

An Updater's step has two halves and one point between them, the *gradients-ready point*:

    synchronize_gradients()   DDP's all-reduce, ZeRO's reduce-scatter, the experts' sums: after it
                              every gradient this rank steps with is final, and nothing is updated yet
    -- gradients ready --     the registered GradientTransforms run, in order, on ready_gradients():
                              fp16's unscale and overflow verdict (precision/mixed.py), then clipping
                              (clipping.py), as PyTorch's AMP recipe orders them; one may skip the step
    apply_optimizer()         the optimizer on what this rank owns (ZeRO then all-gathers), unless skipped
    release_gradients()       drop what the step kept (ZeRO's gradient shards), skipped or not

A transform attaches with `updater.register_gradients_ready_hook(transform)` and gets a
`RemovableHandle` back, like a module hook (core/hooks.py).

Each interface is a `typing.Protocol` that also carries defaults: any object with these methods (and,
for an Updater, its `model` and `optimizer`) satisfies it (`isinstance` checks at run time), and a class
that derives from it explicitly inherits the defaults and must define what is abstract. The trainer
and the checkpoint call these methods and nothing else, so a new technique plugs in by implementing
them, without the trainer probing for optional attributes. Methods marked *collective* must be called
on every rank of their communicator.

This file also holds the single-process parts, the plainest implementation of each interface.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from minipar.core import autograd, backend
from minipar.core.backend import Array
from minipar.core.hooks import HookList, RemovableHandle
from minipar.core.module import Module, Parameter
from minipar.core.optim import Optimizer
from minipar.parallel.logical_state import load_whole, whole_pieces


@runtime_checkable
class Runner(Protocol):
    """Forward and backward over this rank's share of a batch."""

    @abstractmethod
    def forward_backward(self, inputs, targets, normaliser: int, scored=None) -> float:
        """Accumulate the gradients of this slice's loss (divided by the global `normaliser`); return the
        summed loss (0.0 on pipeline stages that have none; with MoE, a stage adds its layers' aux part).
        Collective in pipeline parallelism. `scored` (bool, targets' shape; None: all of them) marks the
        predictions the accuracy counts."""

    def correct_count(self) -> int | None:
        """How many of the last step's scored predictions this rank's loss found right (0 on pipeline
        stages without the loss), or None for a runner that does not count them (no accuracy logged)."""
        return None

    def timing(self) -> dict | None:
        """The last step's measured pipeline timing (busy, idle, bubble) for the train log, or None."""
        return None

    def log_record(self) -> dict | None:
        """The last step's loss scaling (scale, skipped) for the train log, or None without fp16 scaling."""
        return None

    def register_action_hook(self, hook) -> RemovableHandle:
        """Call `hook(label, started, stopped)` after each of a step's scheduled actions (a pipeline's F,
        B and W, and its whole schedule as "schedule"); a runner without a schedule never calls it."""
        return HookList().add(hook)


class RunnerWrapper(Runner):
    """A runner that changes a step around an inner runner (context parallelism's columns, MoE's aux
    loss, mixed precision's 16-bit weights) and reports what the inner one counted and measured."""

    runner: Runner

    def correct_count(self) -> int | None:
        return self.runner.correct_count()

    def timing(self) -> dict | None:
        return self.runner.timing()

    def log_record(self) -> dict | None:
        return self.runner.log_record()

    def register_action_hook(self, hook) -> RemovableHandle:
        return self.runner.register_action_hook(hook)


@dataclass
class GradientPiece:
    """A part of one parameter's final gradient that this rank steps with, at the gradients-ready point.

    `grad` holds the elements of the parameter's (tensor-parallel local) gradient, flattened, from
    `offset` on: the whole gradient where the rank holds it whole, a slice of it where ZeRO shards it.
    A transform may change `grad` in place; the optimizer then steps with what it holds. `counted` is
    False on a data-parallel replica whose values another rank also holds (DDP's ranks but dp rank 0),
    so that a sum over every rank counts each value once; a tensor-parallel replica is told by
    `param.shard` (None: the same values on every tp rank)."""

    name: str
    param: Parameter
    grad: Array
    offset: int = 0
    counted: bool = True


class GradientTransform:
    """What runs at the gradients-ready point: `__call__(pieces)` sees this rank's final gradients and
    returns False to skip the step (every rank must return the same verdict), True or None to go on.
    `pieces()` gives a fresh pass over them (chunked ZeRO-3 fetches each block for the pass)."""

    @abstractmethod
    def __call__(self, pieces) -> bool | None:
        """Transform the gradients in place (or just look); False skips the step on this rank."""

    def log_record(self) -> dict | None:
        """Fields for the train log's record of the last step (e.g. `grad_norm`), or None."""
        return None


@runtime_checkable
class Updater(Protocol):
    """The optimizer step of this rank, and the model states it holds.

    The defaults are those of a rank that holds its parameters (`self.model`) whole or as a
    tensor-parallel shard, with the optimizer's state for them (`self.optimizer`). An updater that
    partitions them (ZeRO) overrides every method but `tier_traffic` and the gradients-ready point's."""

    model: Module  # this rank's model: whole, a tensor-parallel shard or a pipeline stage
    optimizer: Optimizer  # for the parameters this rank updates
    gradient_transforms: HookList  # what runs at the gradients-ready point, in order
    transforms_run: list  # those that ran in the last step (up to one that skipped it)
    # ZeRO-3 and chunked ZeRO-3: a unit's parameters are whole only while it runs, gathered by the
    # updater's hooks (in bf16 and fp16 the gathered units are the 16-bit working copy: zero3.py)
    gathers_parameters: bool = False

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.gradient_transforms, self.transforms_run = HookList(), []

    def step(self) -> None:
        """Turn the accumulated gradients into the next parameters: synchronise them, run the
        gradients-ready point's transforms, apply the optimizer unless one skipped the step, release
        the gradients. Collective where gradients are synced (and where a transform reduces)."""
        self.synchronize_gradients()
        if self.gradients_ready():
            self.apply_optimizer()
        self.release_gradients()

    def synchronize_gradients(self) -> None:
        """Make every gradient this rank steps with final (a collective where they are summed)."""

    def ready_gradients(self) -> Iterable[GradientPiece]:
        """This rank's final gradients, after `synchronize_gradients`, as pieces (a fresh pass per call)."""
        return [GradientPiece(name, p, p.grad) for name, p in self.model.named_parameters()
                if p.grad is not None]

    @abstractmethod
    def apply_optimizer(self) -> None:
        """The optimizer step on the parameters this rank owns, from the final gradients."""

    def release_gradients(self) -> None:
        """Drop what the step kept of the gradients (ZeRO's shards), whether or not it was skipped."""

    def register_gradients_ready_hook(self, transform: GradientTransform,
                                      first: bool = False) -> RemovableHandle:
        """Run `transform` at the gradients-ready point, after those registered before (`first`: before
        them all). Its handle's `remove()` takes it out."""
        return self.gradient_transforms.add(transform, first=first)

    def gradients_ready(self) -> bool:
        """Run the transforms in order; False (skip the step) as soon as one says so: the later ones do
        not run, and log nothing for the step (fp16's overflow: no `grad_norm` in that record)."""
        self.transforms_run = []
        for transform in self.gradient_transforms:
            self.transforms_run.append(transform)
            if transform(self.ready_gradients) is False:
                return False
        return True

    def log_record(self) -> dict:
        """The fields for the train log that the last step's transforms report (e.g. `grad_norm`)."""
        record: dict = {}
        for transform in self.transforms_run:
            record.update(transform.log_record() or {})
        return record

    def memory(self) -> dict:
        """Model-state bytes held after the step: {category: bytes}, or {category: {tier: bytes}}."""
        params = self.model.parameters()
        return {
            "params": sum(p.data.nbytes for p in params),
            "grads": sum(p.grad.nbytes for p in params if p.grad is not None),
            "optimizer": self.optimizer.state_bytes(),
        }

    def checkpoint_pieces(self) -> dict:
        """{name: {kind: (Piece, array)}}: the parameters this rank holds and their optimizer state, as
        host copies the caller owns (logical_state.to_host): --save-async writes them while the next
        steps change the originals. Every updater's pieces are made by to_host."""
        return whole_pieces(self.model.named_parameters(), self.optimizer)

    def load_logical(self, state) -> None:
        """Take this rank's parameters and optimizer state from a checkpoint's logical tensors."""
        load_whole(self.model.named_parameters(), self.optimizer, state)

    def local_state(self) -> dict:
        """{name: (tensor-parallel shard or None, host array)}: every parameter this rank's model has, whole
        across data-parallel ranks. Collective over them where the parameters are partitioned (ZeRO-3)."""
        to_host = backend.current().to_host
        return {name: (p.shard, np.array(to_host(p.data))) for name, p in self.model.named_parameters()}

    def tier_traffic(self) -> dict | None:
        """The last step's bytes moved between device, CPU and disk (offload), or None without tiers."""
        return None


def split_scored(scored, microbatches: int) -> list:
    """The accuracy's mask cut into micro-batches like the targets (None for each: all scored)."""
    return [None] * microbatches if scored is None else np.array_split(scored, microbatches)


def count_correct(correct, scored) -> int:
    """How many of the scored predictions are right (`correct`: the loss's verdicts, on the device)."""
    if scored is not None:
        correct = correct & backend.current().from_host(scored)
    return int(correct.sum())


def own_pieces(inputs, microbatches: int) -> list:
    """The micro-batches of `inputs`, each an array of its own: a piece the first layer saves for
    backward (an MLP's Linear saves its input) must not keep the whole batch alive (and counted)
    until its backward, as a view of it would; on a device the copy to it makes one anyway."""
    return [piece.copy() for piece in np.array_split(inputs, microbatches)]


class MicrobatchRunner(Runner):
    """Forward and backward micro-batch after micro-batch, on this rank's whole model."""

    def __init__(self, model, microbatches: int):
        self.model, self.microbatches = model, microbatches
        self.correct = 0

    def forward_backward(self, inputs, targets, normaliser: int, scored=None) -> float:
        total, to_device = 0.0, backend.current().from_host  # the batch is made on the host
        self.correct = 0
        pieces = zip(own_pieces(inputs, self.microbatches), np.array_split(targets, self.microbatches),
                     split_scored(scored, self.microbatches))
        for x, y, s in pieces:
            loss, correct = self.model.loss_and_correct(self.model(to_device(x)), to_device(y), normaliser)
            loss.backward()
            total += loss.item()
            self.correct += count_correct(correct, s)
        return total

    def correct_count(self) -> int | None:
        return self.correct


class LocalUpdater(Updater):
    """A plain optimizer step: nothing to synchronise."""

    def apply_optimizer(self) -> None:
        with autograd.no_grad():
            self.optimizer.step()
