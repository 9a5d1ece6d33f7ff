"""pytest setup for minipar: serial tests under plain pytest, multi-rank tests under mpiexec.

    pytest -m "not mpi" tests/                                   # serial tests, one process
    mpiexec -n K python -m pytest -m mpi tests/                   # multi-rank tests, K in 2, 4, 8

To write a multi-rank test, read tests/mpi_harness.py (decorators mpi_test and mpi_given, the mark
needs_world_size). This file skips mpi tests in a single process and serial tests under mpiexec,
silences the reports of ranks > 0 (the harness brings their failures to rank 0), provides the
fixture `comm`, makes serial hypothesis draws reproducible, sets MINIPAR_COLLECTIVE_TIMEOUT, and sends
the collective watchdog's line to the terminal with the test's node id (pytest captures stderr).
"""

from __future__ import annotations

import os
import sys

# A collective that waits longer than this fails (the reliability layer's limit,
# minipar/distributed/watchdog.py), so a deadlocked test ends in seconds; set before minipar is imported,
# unless the caller chose one.
os.environ.setdefault("MINIPAR_COLLECTIVE_TIMEOUT", "30")

import mpi_harness  # noqa: E402
import pytest  # noqa: E402
from hypothesis import Phase, settings  # noqa: E402
from mpi4py import MPI  # noqa: E402

from minipar.distributed import watchdog  # noqa: E402
from minipar.distributed.communicator import Comm  # noqa: E402
from minipar.distributed.ledger import TrafficLedger

WORLD = MPI.COMM_WORLD

# Serial property tests draw the same examples in every run, as the multi-rank harness does (the
# examples are a function of each test's name); MINIPAR_HYPOTHESIS_SEED picks another fixed set.
# No explain phase: after a failure it reruns the failing example some 250 times to mark which
# arguments did not matter ("# or any other generated value"), 17 s for one failing softmax check of
# the course on a loaded machine; the failing example itself is reported as before.
# No deadline: Hypothesis's 200 ms per example is a timing bound, and on two busy cores (the serial
# tests run in two workers beside mpiexec jobs) a pause of the scheduler fails it; pytest-timeout
# bounds a test that hangs.
settings.register_profile("minipar", derandomize=mpi_harness.HYPOTHESIS_SEED is None, database=None,
                          print_blob=False, deadline=None,
                          phases=[phase for phase in Phase if phase is not Phase.explain])
settings.load_profile("minipar")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    mpi_harness.keep_terminal_stderr()
    watchdog.WATCHDOG.add_reporter(mpi_harness.report_collective_stall)  # the test, on the terminal
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
def no_matplotlib(monkeypatch):
    """`import matplotlib` raises ImportError from now on, as where it is not installed."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)


@pytest.fixture
def comm():
    """A Comm named "world" over a private duplicate of COMM_WORLD, with a fresh ledger."""
    duplicate = WORLD.Dup()
    yield Comm(duplicate, name="world", ledger=TrafficLedger())
    duplicate.Free()
