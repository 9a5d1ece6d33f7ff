"""Engine: one rank's share of a training step, as three replaceable parts.

    model    the parameters this rank holds (all of them, a tensor shard, a pipeline stage, ...)
    runner   forward and backward over the micro-batches of this rank's slice of the global batch
    updater  turns this rank's gradients into the next parameters (optimizer; DDP or ZeRO syncs first)

Every layout is a choice of these three (parallel/hybrid.py makes it); the single-process pieces are
here. Gradients are *sums* over this rank's samples of a loss already divided by the global count, so
summing them over data-parallel ranks gives exactly the single-process gradient.
Lesson: lessons/03_data_parallel.md and lessons/07_3d.md.
"""

from __future__ import annotations

import numpy as np

from minipar.core import autograd, backend
from minipar.parallel.logical_state import load_whole, whole_pieces
from minipar.trainer.tasks import local_slice


class MicrobatchRunner:
    """Forward and backward micro-batch after micro-batch; gradients accumulate in `.grad`."""

    def __init__(self, model, microbatches: int):
        self.model, self.microbatches = model, microbatches

    def forward_backward(self, inputs, targets, normaliser: int) -> float:
        total, to_device = 0.0, backend.current().from_host  # the batch is made on the host
        pieces = zip(np.array_split(inputs, self.microbatches), np.array_split(targets, self.microbatches))
        for x, y in pieces:
            loss = self.model.loss(self.model(to_device(x)), to_device(y), normaliser)
            loss.backward()
            total += loss.item()
        return total


class LocalUpdater:
    """A plain optimizer step: nothing to synchronise."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def step(self):
        with autograd.no_grad():
            self.optimizer.step()

    def memory(self) -> dict:
        params = self.model.parameters()
        return {
            "params": sum(p.data.nbytes for p in params),
            "grads": sum(p.grad.nbytes for p in params if p.grad is not None),
            "optimizer": self.optimizer.state_bytes(),
        }

    def checkpoint_pieces(self) -> dict:
        """{name: {kind: (Piece, array)}}: the parameters this rank holds and their optimizer state."""
        return whole_pieces(self.model.named_parameters(), self.optimizer)

    def load_logical(self, state) -> None:
        """Take the parameters and optimizer state from a checkpoint's logical tensors (checkpoint.py)."""
        load_whole(self.model.named_parameters(), self.optimizer, state)


class Engine:
    """Runs one global step on this rank and returns the global mean loss (on every rank)."""

    def __init__(self, cfg, grid, model, runner, updater):
        self.cfg, self.grid, self.model, self.runner, self.updater = cfg, grid, model, runner, updater

    def normaliser(self, targets) -> int:
        """The global count the summed loss is divided by: tokens for the GPT, samples for the MLP."""
        return targets.size if self.cfg.model == "gpt" else len(targets)

    def train_step(self, inputs, targets) -> float:
        grid = self.grid
        mine = local_slice(len(inputs), grid.dp.size, grid.dp_rank)
        self.model.zero_grad()
        loss = self.runner.forward_backward(inputs[mine], targets[mine], self.normaliser(targets))
        self.updater.step()
        return self.global_loss(loss)

    def global_loss(self, local_loss) -> float:
        """Sum the replicas' losses and hand the last stage's value to every rank.

        These few bytes travel as uncharged control messages, so the traffic ledger shows only the
        technique's own communication."""
        grid = self.grid
        if grid.pp_rank == grid.pp.size - 1:
            local_loss = grid.dp.allreduce_obj(local_loss)
        return grid.pp.bcast_obj(local_loss, root=grid.pp.size - 1)


def local_state(model) -> dict:
    """{name: (shard, array)} for every parameter this rank holds, shards described by `Parameter.shard`."""
    to_host = backend.current().to_host
    return {name: (p.shard, np.array(to_host(p.data))) for name, p in model.named_parameters()}


def assemble_full_state(pieces: list[dict]) -> dict:
    """Put the shards that ranks hold back together into full tensors (replicas are simply skipped)."""
    full = {}
    for piece in pieces:
        for name, (shard, array) in piece.items():
            if shard is None:
                full.setdefault(name, array)
                continue
            if name not in full:
                padded = list(shard.full_shape)
                padded[shard.axis] = max([padded[shard.axis]] + _stops(pieces, name))
                full[name] = np.zeros(padded, dtype=array.dtype)
            index = [slice(None)] * array.ndim
            index[shard.axis] = slice(shard.start, shard.stop)
            full[name][tuple(index)] = array
    for name, piece_shape in _full_shapes(pieces).items():
        full[name] = full[name][tuple(slice(0, n) for n in piece_shape)]
    return full


def _stops(pieces, name) -> list[int]:
    """Where each rank's shard of `name` ends: past the full shape when the split is padded."""
    return [piece[name][0].stop for piece in pieces if name in piece]


def _full_shapes(pieces):
    return {name: shard.full_shape for piece in pieces for name, (shard, _) in piece.items() if shard}
