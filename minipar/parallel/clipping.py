"""Global-norm gradient clipping (`--clip-grad-norm MAX`): one norm over the whole model, capped at MAX.

The idea (Pascanu et al., "On the difficulty of training recurrent neural networks", 2013; PyTorch's
`torch.nn.utils.clip_grad_norm_`): take the L2 norm of all the gradients together, as if they were
one vector, and multiply every gradient by the same coefficient min(1, MAX / (norm + 1e-6)). A rare
huge gradient then moves the weights at most MAX far, in the direction it points. The norm before
clipping is logged as `grad_norm` every step.

Where: a transform at the updater's gradients-ready point (parallel/api.py), after DDP's all-reduce or
ZeRO's reduce-scatter (a rank that clipped its own part before the sum would scale by a norm that is
not the model's) and after fp16's unscale and overflow verdict (the norm of the true gradients; a
skipped step clips nothing and logs no `grad_norm`). Each rank sums the squares of the gradients it
steps with, each value counted once over the whole grid: a data-parallel replica's copy not at all
(`GradientPiece.counted`), a parameter replicated over tp (LayerNorm's weights, the MoE layers:
`param.shard` is None) on tp rank 0 only. The sums are added over dp (dp x cp), then tp, then pp, so
every rank holds the same norm and scales by the same coefficient: the replicas stay identical.

What it saves: nothing; it keeps a step from being ruined by one outsized gradient. What it costs: a
pass over the gradients, and one all-reduce of a single fp64 value over each of dp·cp, tp and pp of
more than one rank, charged to that dimension on the traffic ledger (sent only with the option).
Lesson: lessons/03_data_parallel.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from minipar.core.options import option
from minipar.parallel.api import GradientTransform

EPS = 1e-6  # clip_grad_norm_'s: the coefficient stays finite for a zero gradient


@dataclass
class ClippingOptions:
    """Gradient clipping (parallel/clipping.py)."""
    clip_grad_norm: float | None = option(None, "clip the gradients' global L2 norm to MAX before the step "
                                          "(clip_grad_norm_; logs grad_norm)", gradient_transform=__name__)


def sum_of_squares(pieces, tp_rank: int) -> float:
    """This rank's share of the squared global norm: the pieces it counts (in fp64)."""
    total = 0.0
    for piece in pieces:
        if piece.counted and (piece.param.shard is not None or tp_rank == 0):
            flat = piece.grad.reshape(-1).astype(np.float64)
            total += float(flat @ flat)
    return total


def global_norm(pieces, grid) -> float:
    """The L2 norm of every gradient of the model, each value counted once; the same on every rank.
    Collective over dp·cp, tp and pp (those of more than one rank)."""
    squares = np.array([sum_of_squares(pieces, grid.tp_rank)])
    for comm in (grid.dp_cp, grid.tp, grid.pp):
        if comm.size > 1:
            squares = comm.all_reduce(squares)
    return math.sqrt(float(squares[0]))


class GradientClipping(GradientTransform):
    """`clip_grad_norm_(parameters, max_norm)` over every rank's gradients, at the gradients-ready point."""

    def __init__(self, max_norm: float, grid):
        self.max_norm, self.grid = float(max_norm), grid
        self.grad_norm = 0.0  # the last step's norm, before clipping

    def __call__(self, pieces) -> None:
        self.grad_norm = global_norm(pieces(), self.grid)
        coefficient = self.max_norm / (self.grad_norm + EPS)
        if coefficient < 1.0:  # clip_grad_norm_ multiplies by min(1, coefficient): by 1 changes nothing
            for piece in pieces():
                piece.grad *= coefficient

    def log_record(self) -> dict:
        return {"grad_norm": self.grad_norm}


def attach(options: ClippingOptions, grid, updater):
    """trainer/build.py's call for the option: register the clipping (None without --clip-grad-norm)."""
    if options.clip_grad_norm is None:
        return None
    return updater.register_gradients_ready_hook(GradientClipping(options.clip_grad_norm, grid))


def config_errors(options: ClippingOptions) -> list[str]:
    """--clip-grad-norm's check, one line (its finiteness is checked with every float option's)."""
    if options.clip_grad_norm is not None and not options.clip_grad_norm > 0:
        return [f"--clip-grad-norm must be positive, got {options.clip_grad_norm}"]
    return []
