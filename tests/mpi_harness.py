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

Reproducible draws: rank 0's hypothesis is derandomized (its examples are a function of the test's
name), so a run draws the same examples as the last one and a failure found once comes back. Set
MINIPAR_HYPOTHESIS_SEED=N to draw another fixed set (the seed is printed with each failure). Edge
cases random draws can miss are written out, each with the world sizes where it can run:
`mpi_given(..., examples=[at_world_size((4, 8), n=7)])`. Failing examples are not shrunk where
`shrink=False` (a body that trains for seconds would shrink for minutes), and hypothesis's explain
phase, which reruns the body many times more, is off.

Collective watchdog: a collective that waits past MINIPAR_COLLECTIVE_TIMEOUT (conftest.py: 30 s)
ends its rank with the watchdog's line (minipar/distributed/watchdog.py), which conftest.py sends to
the terminal too, after the test's node id (`report_collective_stall`): pytest's capture would
swallow it.

Deadlock watchdog: one example (or one mpi_test) that runs past DEADLOCK_S seconds (environment
variable MINIPAR_TEST_DEADLOCK_S, default 60) prints, on every rank, which test it is and every
thread's stack (faulthandler), then aborts the job: a hang fails in a minute, not at pytest's 300 s
timeout. conftest.py also sets MINIPAR_COLLECTIVE_TIMEOUT (the reliability layer's limit on one
collective, default 30 s here) unless the environment already sets it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import inspect
import os
import sys
import threading
import time
import traceback

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import seed as hypothesis_seed
from mpi4py import MPI

WORLD = MPI.COMM_WORLD
GRACE_S = float(os.environ.get("MINIPAR_TEST_GRACE_S", "30"))
DEADLOCK_S = float(os.environ.get("MINIPAR_TEST_DEADLOCK_S", "60"))
HYPOTHESIS_SEED = os.environ.get("MINIPAR_HYPOTHESIS_SEED")
REPORT_DIR = os.environ.get("MINIPAR_TEST_REPORT_DIR")  # abort reports also go to REPORT_DIR/rank-R.txt
_harness = WORLD.Dup()  # the harness's own messages never meet a test's
_abort_report = sys.stderr  # replaced by keep_terminal_stderr(), since pytest captures sys.stderr


def keep_terminal_stderr() -> None:
    """Keep a copy of the terminal's stderr for the abort report; conftest calls this from
    pytest_configure, while pytest's capture is suspended."""
    global _abort_report
    _abort_report = os.fdopen(os.dup(2), "w")


def report_collective_stall(line: str) -> None:
    """The collective watchdog's line (minipar/distributed/watchdog.py), on the terminal and in
    REPORT_DIR with the test it stopped: pytest captures stderr into a file, and the watchdog ends the
    process with os._exit, so its own copy is never shown. It fires at MINIPAR_COLLECTIVE_TIMEOUT (30 s
    here), before this harness's deadlock watchdog (60 s)."""
    report = f"[rank {WORLD.rank}] {_current_test()}: {line}"
    outputs = [_abort_report]
    if REPORT_DIR:
        outputs.append(open(os.path.join(REPORT_DIR, f"rank-{WORLD.rank}.txt"), "a"))
    for output in outputs:
        output.write(report)
        output.flush()


class MultiRankFailure(AssertionError):
    """The body failed on at least one rank; the message holds each failing rank's traceback."""


def needs_world_size(*sizes: int):
    """Mark: skip (identically on every rank) unless the world size is one of sizes."""
    return pytest.mark.skipif(WORLD.size not in sizes,
                              reason=f"needs a world size in {sizes}, this one is {WORLD.size}")


def _report_and_abort(report: str, stacks: bool = False) -> None:
    """Write report (and every thread's stack) to the terminal and to REPORT_DIR, then abort the job.

    A file is read back whole after the job, whatever the launcher does with the output of processes
    it kills; the pause gives the launcher time to forward the terminal copy (and lets other ranks
    whose watchdog fires at the same moment print theirs) before the abort."""
    outputs = [_abort_report]
    if REPORT_DIR:
        outputs.append(open(os.path.join(REPORT_DIR, f"rank-{WORLD.rank}.txt"), "a"))
    for output in outputs:
        output.write(report)
        output.flush()
        if stacks:
            faulthandler.dump_traceback(file=output, all_threads=True)
            output.flush()
    time.sleep(1.0)
    WORLD.Abort(1)


def _abort_on_deadlock(what: str) -> None:
    _report_and_abort(f"[rank {WORLD.rank}] {what} still running after {DEADLOCK_S:g} s "
                      "(MINIPAR_TEST_DEADLOCK_S): a deadlock? Every thread's stack on this rank:\n",
                      stacks=True)


@contextlib.contextmanager
def deadlock_watchdog():
    """Abort the job with every rank's stacks if the block runs past DEADLOCK_S seconds.

    A timer thread does it (a rank blocked in MPI releases the GIL, so it runs); should the GIL never
    come free, faulthandler's own C thread dumps the stacks 10 s later and ends the process."""
    timer = threading.Timer(DEADLOCK_S, _abort_on_deadlock, args=(_current_test(),))
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(DEADLOCK_S + 10, exit=True, file=_abort_report)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        timer.cancel()


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


def _current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "a test").rsplit(" ", 1)[0]


def at_world_size(sizes, **arguments) -> tuple:
    """An explicit example for mpi_given, run only where the world size is one of `sizes`."""
    return tuple(sizes), arguments


def _wait_for_every_rank(outcome: tuple[str, str]) -> None:
    # Poll with naps rather than MPI's busy wait: with more ranks than cores, a spinning rank would
    # take the processor from the ranks still working (rank 0 computing a reference, say).
    arrived = _harness.Ibarrier()
    deadline = time.monotonic() + GRACE_S
    while not arrived.Test():
        if outcome[0] == "failed" and time.monotonic() > deadline:
            _report_and_abort(
                f"[rank {WORLD.rank}] failed, and {GRACE_S:g} s later the other ranks are still in the "
                "test body, probably waiting in a collective this rank never reached; aborting the job.\n"
                f"[rank {WORLD.rank}] {outcome[1]}")
        time.sleep(0.001)


def run_and_share_verdict(body) -> None:
    """Run body() on every rank; if it failed on any rank, raise MultiRankFailure on every rank."""
    with deadlock_watchdog():  # the body and the wait for the others: a rank stuck in either is found
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


def mpi_given(max_examples: int = 10, examples=(), shrink: bool = True, **strategies):
    """Decorator: a multi-rank hypothesis test (marks it `mpi`); rank 0 draws, every rank runs.

    `examples`: `at_world_size(sizes, **arguments)` entries, run first where the world size fits.
    `shrink=False`: report the first failing example as drawn (for bodies that take seconds)."""
    chosen = [arguments for sizes, arguments in examples if WORLD.size in sizes]

    def decorate(test):
        signature = inspect.signature(test)
        fixture_parameters = [p for name, p in signature.parameters.items() if name not in strategies]

        @functools.wraps(test)
        def run_property(**fixtures):
            body = functools.partial(test, **fixtures)
            if WORLD.rank == 0:
                _draw_and_broadcast(body, test.__name__, strategies, max_examples, chosen, shrink)
            else:
                _follow_rank_0(body)

        run_property.__signature__ = signature.replace(parameters=fixture_parameters)
        return pytest.mark.mpi(run_property)

    return decorate


def _draw_and_broadcast(body, name: str, strategies: dict, max_examples: int, examples: list,
                        shrink: bool) -> None:
    def run_example(**drawn):
        _harness.bcast(("example", drawn), root=0)
        run_and_share_verdict(lambda: body(**drawn))

    run_example.__name__ = run_example.__qualname__ = name
    property_test = given(**strategies)(run_example)
    for arguments in reversed(examples):  # hypothesis runs explicit examples first, in this order
        property_test = example(**arguments)(property_test)
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])
    if HYPOTHESIS_SEED is not None:
        property_test = hypothesis_seed(int(HYPOTHESIS_SEED))(property_test)
    property_test = settings(max_examples=max_examples, deadline=None, database=None, phases=phases,
                             derandomize=HYPOTHESIS_SEED is None, print_blob=False,
                             suppress_health_check=[HealthCheck.too_slow])(property_test)
    verdict = ("failed", "")
    try:
        property_test()
        verdict = ("passed", "")
    except MultiRankFailure:
        draws = (f"MINIPAR_HYPOTHESIS_SEED={HYPOTHESIS_SEED}" if HYPOTHESIS_SEED is not None else
                 "derandomized (MINIPAR_HYPOTHESIS_SEED unset): a rerun draws the same examples")
        print(f"[mpi_given] {name} on {WORLD.size} ranks, draws {draws}")
        raise
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
