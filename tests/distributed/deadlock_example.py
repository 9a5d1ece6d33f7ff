"""A multi-rank test that deadlocks on purpose: test_watchdog.py runs it under mpiexec and pytest, and
checks that the collective watchdog's line reaches the terminal with the test's node id. Not collected
with the suite (its name is not test_*.py); given by name, pytest runs it. MINIPAR_DEADLOCK_EXAMPLE=
deadlock: rank 0 alone enters an all-reduce; anything else: both ranks do (the same run's pace)."""

from __future__ import annotations

import os

import numpy as np
from mpi_harness import mpi_test


@mpi_test
def test_rank_0_waits_in_an_all_reduce_that_rank_1_never_joins(comm):
    if comm.rank == 0 or os.environ.get("MINIPAR_DEADLOCK_EXAMPLE") != "deadlock":
        comm.all_reduce(np.ones(1))
