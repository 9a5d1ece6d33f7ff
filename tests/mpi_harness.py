"""The multi-rank test harness: one pytest per rank, one shared verdict.

How to write a multi-rank test (read this first):

    import hypothesis.strategies as st
    from mpi_harness import mpi_given, mpi_test, needs_world_size

    @mpi_test                                # marks it `mpi`; runs on every rank; verdict shared
    def test_sum(comm):                      # fixture `comm`: a fresh Comm("world") on a Dup of COMM_WORLD
        total = comm.all_reduce(numpy.ones(3))
        assert (total == comm.size).all()

    @needs_world_size(2, 4)                  # skipped on every rank unless the world has 2 or 4 ranks
    @mpi_given(n=st.integers(0, 40), seed=st.integers(0, 2**32 - 1))
    def test_property(comm, n, seed):        # fixtures and drawn arguments mix freely
        mine = numpy.random.default_rng([seed, comm.rank]).standard_normal(n)
        ...

Run with `mpiexec -n K python -m pytest -m mpi tests/` for K in 2, 4, 8 (`make test` does). Under
plain pytest (one process) mpi tests are skipped; under mpiexec, serial tests are. Ranks > 0 print
nothing; a failure on any rank fails the test on every rank, and rank 0 shows each failing rank's
traceback (and, for mpi_given, hypothesis's falsifying example).

How it works: only rank 0 runs hypothesis. It broadcasts each example; every rank runs the body
with the same arguments (derive per-rank data from a seed and comm.rank inside the body); then the
ranks exchange their outcomes on a communicator of the harness's own, and all raise if any failed,
so hypothesis on rank 0 can shrink while the others follow, and no rank is left waiting.

Rules:
- Every rank must make the same collective calls, and fixture setup must be the same on every rank.
- Assert after the collectives. A rank whose body raised waits GRACE_S seconds (environment
  variable MINIPAR_TEST_GRACE_S, default 30) for the others to finish theirs; if they don't (they are
  stuck in a collective it skipped), it prints its traceback and aborts the whole job: a clear
  failure in seconds instead of a hang until the timeout.
- Filter inputs in the strategies, not with hypothesis.assume() in the body.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import time
import traceback

import pytest
from hypothesis import HealthCheck, given, settings
from mpi4py import MPI

WORLD = MPI.COMM_WORLD
GRACE_S = float(os.environ.get("MINIPAR_TEST_GRACE_S", "30"))
_harness = WORLD.Dup()  # the harness's own messages never meet a test's
_abort_report = sys.stderr  # replaced by keep_terminal_stderr(), since pytest captures sys.stderr


def keep_terminal_stderr() -> None:
    """Keep a copy of the terminal's stderr for the abort report; conftest calls this from
    pytest_configure, while pytest's capture is suspended."""
    global _abort_report
    _abort_report = os.fdopen(os.dup(2), "w")


class MultiRankFailure(AssertionError):
    """The body failed on at least one rank; the message holds each failing rank's traceback."""


def needs_world_size(*sizes: int):
    """Mark: skip (identically on every rank) unless the world size is one of sizes."""
    return pytest.mark.skipif(WORLD.size not in sizes,
                              reason=f"needs a world size in {sizes}, this one is {WORLD.size}")


def _outcome_of(body) -> tuple[str, str]:
    try:
        body()
    except (KeyboardInterrupt, SystemExit):
        raise
    except pytest.skip.Exception as skip:
        return "skipped", str(skip)
    except BaseException:
        return "failed", traceback.format_exc()
    return "passed", ""


def _wait_for_every_rank(outcome: tuple[str, str]) -> None:
    # Poll with naps rather than MPI's busy wait: with more ranks than cores, a spinning rank would
    # take the processor from the ranks still working (rank 0 computing a reference, say).
    arrived = _harness.Ibarrier()
    deadline = time.monotonic() + GRACE_S
    while not arrived.Test():
        if outcome[0] == "failed" and time.monotonic() > deadline:
            _abort_report.write(
                f"[rank {WORLD.rank}] failed, and {GRACE_S:g} s later the other ranks are still in the "
                "test body, probably waiting in a collective this rank never reached; aborting the job.\n"
                f"[rank {WORLD.rank}] {outcome[1]}")
            _abort_report.flush()
            WORLD.Abort(1)
        time.sleep(0.001)


def run_and_share_verdict(body) -> None:
    """Run body() on every rank; if it failed on any rank, raise MultiRankFailure on every rank."""
    outcome = _outcome_of(body)
    _wait_for_every_rank(outcome)
    outcomes = _harness.allgather(outcome)
    failed = [rank for rank, (kind, _) in enumerate(outcomes) if kind == "failed"]
    if failed:
        reports = "\n".join(f"----- rank {rank} -----\n{outcomes[rank][1]}" for rank in failed)
        raise MultiRankFailure(f"failed on rank(s) {failed} of {WORLD.size}:\n{reports}")
    skipped = [rank for rank, (kind, _) in enumerate(outcomes) if kind == "skipped"]
    if len(skipped) == WORLD.size:
        pytest.skip(outcomes[0][1])
    if skipped:
        raise MultiRankFailure(f"skipped on rank(s) {skipped} only; a skip must be the same on every rank")


def mpi_test(test):
    """Decorator: a multi-rank test run on every rank with a shared verdict (marks it `mpi`)."""

    @functools.wraps(test)
    def run_on_every_rank(*args, **kwargs):
        run_and_share_verdict(lambda: test(*args, **kwargs))

    return pytest.mark.mpi(run_on_every_rank)


def mpi_given(max_examples: int = 10, **strategies):
    """Decorator: a multi-rank hypothesis test (marks it `mpi`); rank 0 draws, every rank runs."""

    def decorate(test):
        signature = inspect.signature(test)
        fixture_parameters = [p for name, p in signature.parameters.items() if name not in strategies]

        @functools.wraps(test)
        def run_property(**fixtures):
            body = functools.partial(test, **fixtures)
            if WORLD.rank == 0:
                _draw_and_broadcast(body, test.__name__, strategies, max_examples)
            else:
                _follow_rank_0(body)

        run_property.__signature__ = signature.replace(parameters=fixture_parameters)
        return pytest.mark.mpi(run_property)

    return decorate


def _draw_and_broadcast(body, name: str, strategies: dict, max_examples: int) -> None:
    def run_example(**example):
        _harness.bcast(("example", example), root=0)
        run_and_share_verdict(lambda: body(**example))

    run_example.__name__ = run_example.__qualname__ = name
    property_test = settings(max_examples=max_examples, deadline=None, database=None,
                             suppress_health_check=[HealthCheck.too_slow])(given(**strategies)(run_example))
    verdict = ("failed", "")
    try:
        property_test()
        verdict = ("passed", "")
    except pytest.skip.Exception as skip:
        verdict = ("skipped", str(skip))
        raise
    finally:
        _harness.bcast(("done", verdict), root=0)


def _follow_rank_0(body) -> None:
    while True:
        kind, payload = _harness.bcast(None, root=0)
        if kind == "done":
            break
        try:
            run_and_share_verdict(functools.partial(body, **payload))
        except (MultiRankFailure, pytest.skip.Exception):
            pass  # rank 0's hypothesis decides what comes next: another example, or done
    verdict, reason = payload
    if verdict == "skipped":
        pytest.skip(reason)
    if verdict == "failed":
        raise MultiRankFailure("the property failed; rank 0 reports the falsifying example")
