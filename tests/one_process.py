"""The exactness contract of DESIGN.md, for tests: a layout trains to one process's losses and weights
(fp64, relative 1e-9), checked against `compare_with_reference`'s single-process rerun."""

from __future__ import annotations

from mpi4py import MPI

from minipar.trainer.loop import Trainer, compare_with_reference


def train(cfg, world=MPI.COMM_WORLD):
    """Train `cfg` on `world`; rank 0's log records and the whole model state (every rank)."""
    trainer = Trainer(cfg, world)
    records = trainer.run()
    return records, trainer.full_state()


def assert_trains_like_one_process(cfg, records, full, tolerance: float = 1e-9) -> dict:
    """The run's losses and final weights within `tolerance` (relative) of one process's."""
    check = compare_with_reference(cfg, records, full)
    assert check["max_rel_loss_deviation"] <= tolerance, check
    assert check["max_rel_weight_deviation"] <= tolerance, check
    return check
