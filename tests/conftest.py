"""pytest setup for minipar: serial tests under plain pytest, multi-rank tests under mpiexec.

    pytest -m "not mpi" tests/                                   # serial tests, one process
    mpiexec -n K python -m pytest -m mpi tests/                   # multi-rank tests, K in 2, 4, 8

To write a multi-rank test, read tests/mpi_harness.py (decorators mpi_test and mpi_given, the mark
needs_world_size). This file skips mpi tests in a single process and serial tests under mpiexec,
silences the reports of ranks > 0 (the harness brings their failures to rank 0), and provides the
fixture `comm`.
"""

from __future__ import annotations

import os
import sys

import mpi_harness
import pytest
from mpi4py import MPI

from minipar.dist.comm import Comm, TrafficLedger

WORLD = MPI.COMM_WORLD


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    mpi_harness.keep_terminal_stderr()
    if WORLD.rank > 0:
        # The terminal reporter takes sys.stdout when it is created, right after this hook.
        sys.stdout = open(os.devnull, "w")


def pytest_collection_modifyitems(config, items):
    for item in items:
        multi_rank = item.get_closest_marker("mpi") is not None
        if multi_rank and WORLD.size == 1:
            item.add_marker(pytest.mark.skip(reason="multi-rank test: mpiexec -n K python -m pytest -m mpi"))
        elif not multi_rank and WORLD.size > 1:
            item.add_marker(pytest.mark.skip(reason="serial test: run it under plain pytest"))


@pytest.fixture
def comm():
    """A Comm named "world" over a private duplicate of COMM_WORLD, with a fresh ledger."""
    duplicate = WORLD.Dup()
    yield Comm(duplicate, name="world", ledger=TrafficLedger())
    duplicate.Free()
