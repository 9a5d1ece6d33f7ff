"""The loss scaler's overflow verdict is shared by all ranks through a real MPI all-reduce."""

import numpy as np
import pytest

from minipar.precision.formats import DynamicLossScaler

pytestmark = pytest.mark.mpi


def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD, MPI.MAX


@pytest.mark.parametrize("overflowing_rank", ["none", "last"])
def test_every_rank_skips_the_step_when_one_rank_overflows(overflowing_rank):
    comm, max_op = world()
    scaler = DynamicLossScaler(init_scale=1024.0, growth_interval=1,
                               all_reduce_max=lambda x: comm.allreduce(x, op=max_op))
    grads = [np.full(4, 2.0 * (comm.rank + 1))]
    if overflowing_rank == "last" and comm.rank == comm.size - 1:
        grads[0][1] = np.inf
    found_inf = scaler.unscale_(grads)
    scaler.update(found_inf)
    verdicts = comm.allgather((found_inf, scaler.get_scale()))
    expected = (True, 512.0) if overflowing_rank == "last" else (False, 2048.0)
    assert verdicts == [expected] * comm.size
