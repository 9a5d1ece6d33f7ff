"""Engine: one rank's share of a training step, as three replaceable parts.

    model    the parameters this rank holds (all of them, a tensor shard, a pipeline stage, ...)
    runner   forward and backward over the micro-batches of this rank's slice of the global batch
    updater  turns this rank's gradients into the next parameters (optimizer; DDP or ZeRO syncs first)

Every layout is a choice of these three (trainer/build.py makes it); the runner and the updater are
written down as interfaces in parallel/api.py, with the single-process parts beside them. Gradients
are *sums* over this rank's samples of a loss already divided by the global count, so summing them
over data-parallel ranks gives exactly the single-process gradient.
Lesson: lessons/03_data_parallel.md and lessons/07_3d.md.
"""

from __future__ import annotations

import time

import numpy as np

from minipar.core.hooks import HookList, RemovableHandle
from minipar.core.moe import RoutingStats
from minipar.parallel import pipeline
from minipar.parallel.api import Runner, Updater
from minipar.precision.formats import DynamicLossScaler
from minipar.trainer.tasks import local_slice


class Engine:
    """Runs one global step on this rank and returns the global mean loss (on every rank).

    `loss_scaler` is fp16's dynamic loss scaler (None without one): the checkpoint saves its state.
    `routing` (--model moe) is what this rank's MoE layers routed (core/moe.py's RoutingStats; None
    on a pipeline stage without MoE layers)."""

    def __init__(self, cfg, grid, model, runner: Runner, updater: Updater,
                 loss_scaler: DynamicLossScaler | None = None, routing: RoutingStats | None = None):
        self.cfg, self.grid, self.model, self.runner, self.updater = cfg, grid, model, runner, updater
        self.loss_scaler, self.routing_stats = loss_scaler, routing
        self.routing: dict | None = None  # --model moe: the last step's aux loss, tokens per expert
        self.accuracy: float | None = None  # the last step's share of scored predictions that were right
        self.phase_hooks = HookList()

    def register_phase_hook(self, hook) -> RemovableHandle:
        """Call `hook(name, started, stopped)` (perf_counter seconds) after each part of a step:
        "forward_backward" (the runner) and "optimizer_step" (the updater: gradient synchronisation,
        the gradients-ready point, the optimizer). A trace draws them (trainer/trace.py)."""
        return self.phase_hooks.add(hook)

    def normaliser(self, targets) -> int:
        """The global count the summed loss is divided by: tokens for the GPT, samples for the MLP."""
        return targets.size if self.cfg.is_gpt else len(targets)

    def train_step(self, inputs, targets, scored=None) -> float:
        """`scored` (bool, targets' shape; None: every prediction): what `accuracy` counts (tasks.py)."""
        grid = self.grid
        mine = local_slice(len(inputs), grid.dp.size, grid.dp_rank)
        self.model.zero_grad()
        started = time.perf_counter()
        loss = self.runner.forward_backward(inputs[mine], targets[mine], self.normaliser(targets),
                                            None if scored is None else scored[mine])
        computed = time.perf_counter()
        self.phase_hooks.call_all("forward_backward", started, computed)
        self.updater.step()
        self.phase_hooks.call_all("optimizer_step", computed, time.perf_counter())
        self.routing = self.global_routing_stats(len(targets))
        self.accuracy = self.global_accuracy(targets.size if scored is None else int(scored.sum()))
        return self.global_loss(loss)

    def global_accuracy(self, scored: int) -> float | None:
        """The share of the global batch's scored predictions that are right: each rank's count of
        them reduced the way the loss is (summed over the replicas on the last stage, then handed to
        every stage; stages without the loss count 0). None where the runner does not count, or
        nothing was scored."""
        correct = self.runner.correct_count()
        if correct is None:
            return None
        correct = self.global_loss(correct)
        return correct / scored if scored else None

    def global_routing_stats(self, sequences: int) -> dict | None:
        """--model moe: the load-balancing part of the step's loss and the tokens each block's
        experts kept, summed over the replicas and the pipeline stages (each block is on one stage;
        tp ranks route alike, so each counts once) (None for other models). Uncharged control bytes."""
        if self.cfg.model != "moe":
            return None
        if self.routing_stats is None:  # a stage without MoE layers: nothing routed
            aux, kept = 0.0, np.zeros((self.cfg.n_layer, self.cfg.n_experts), dtype=np.int64).tolist()
        else:
            aux, kept = self.routing_stats.take(self.cfg.aux_loss_coef, sequences)
        for comm in (self.grid.dp_cp, self.grid.pp):
            every = comm.allgather_obj((aux, kept))
            aux, kept = sum(a for a, _ in every), np.sum([k for _, k in every], axis=0).tolist()
        return {"aux_loss": aux, "tokens_per_expert": kept}

    def global_loss(self, local_loss) -> float:
        """Sum the replicas' losses (or counts of right predictions) and hand the last stage's value
        to every rank; with MoE, the stages' values summed (each stage's loss holds the aux part of its
        layers; a count is 0 on every stage but the last).

        These few bytes travel as uncharged control messages, so the traffic ledger shows only the
        technique's own communication."""
        grid = self.grid
        if self.cfg.model == "moe":
            return grid.pp.allreduce_obj(grid.dp_cp.allreduce_obj(local_loss))
        loss_rank = pipeline.loss_rank(self.cfg.schedule, grid.pp.size)  # the last stage; rank 0 in a V
        if grid.pp_rank == loss_rank:
            local_loss = grid.dp_cp.allreduce_obj(local_loss)  # with --cp each rank has its tokens' share
        return grid.pp.bcast_obj(local_loss, root=loss_rank)


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
