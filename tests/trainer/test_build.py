"""trainer/build.py's synchronising_updater (lesson 07's excerpt): which updater a layout gets, and the
ranks it sums the gradients over: the replicas of the parameters, dp x cp with context parallelism.

    pytest -m "not mpi" tests/trainer/test_build.py
    mpiexec -n 2 python -m pytest -m mpi tests/trainer/test_build.py
"""

from __future__ import annotations

import pytest
from mpi4py import MPI
from mpi_harness import mpi_test, needs_world_size

from minipar.distributed.communicator import Comm
from minipar.distributed.grid import ProcessGrid
from minipar.parallel.api import LocalUpdater
from minipar.parallel.ddp import DistributedDataParallel
from minipar.parallel.zero import ZeroStage1, ZeroStage2
from minipar.parallel.zero3 import ZeroStage3
from minipar.trainer import build
from minipar.trainer.config import TrainConfig

TINY = TrainConfig(model="gpt", precision="fp64", n_layer=1, n_head=2, d_model=8, seq_len=8, batch_size=4,
                   quiet=True)


def updater_for(comm, **layout):
    cfg = TINY.replace(**layout)
    grid = ProcessGrid(comm, cfg.dp, cfg.pp, cfg.tp, cfg.cp)
    return build.synchronising_updater(cfg, grid, build.build_model(cfg, grid))


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_one_replica_steps_alone_or_with_zero_over_itself(zero):
    updater = updater_for(Comm(MPI.COMM_SELF), dp=1, zero=zero)
    if zero == 0:  # nothing to sum: the plain step
        assert type(updater) is LocalUpdater
    else:
        assert type(updater) is {1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}[zero] and updater.comm.size == 1


@needs_world_size(2)
@mpi_test
def test_two_replicas_sum_over_both_ranks_whether_data_or_context_parallel(comm):
    """dp 2, or dp 1 with cp 2 (each rank holds every parameter, and its positions' gradients): the
    updater sums over the two ranks either way; tp 2 holds different shards, so nothing is summed."""
    kinds = {0: DistributedDataParallel, 1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}
    for layout in ({"dp": 2}, {"dp": 1, "cp": 2}):
        for zero, kind in kinds.items():
            updater = updater_for(comm, zero=zero, **layout)
            assert type(updater) is kind and updater.comm.size == 2, (layout, zero, type(updater))
    assert type(updater_for(comm, dp=1, tp=2)) is LocalUpdater
