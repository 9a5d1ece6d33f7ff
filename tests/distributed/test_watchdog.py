"""The watchdog (distributed/watchdog.py) on its own, in a child process (it ends the process it runs in):
a wait past the timeout ends it within a tick or so with the one line, measured on the wait's own clock;
waits each shorter than the timeout, however many, and time outside any wait never fire it. The
end-to-end runs (a stalled rank under mpiexec) are in tests/trainer/test_hostile_user.py; a multi-rank
test that deadlocks (deadlock_example.py) names itself and the collective on the terminal."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pace
import pytest

from minipar.distributed import watchdog

ROOT = Path(__file__).resolve().parents[2]
PREAMBLE = """
import time
from minipar.distributed import watchdog
watchdog.set_collective_timeout({timeout})
"""


def run_child(body: str, timeout: float, limit_s: float) -> tuple[subprocess.CompletedProcess, float]:
    script = PREAMBLE.format(timeout=timeout) + textwrap.dedent(body)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=limit_s)
    return result, time.monotonic() - started


def test_a_wait_past_the_timeout_ends_the_process_with_one_line_naming_it():
    """Timeout 1 s, a wait of 20: the process ends with the stall's own code (75, which `minipar launch`
    restarts on, unlike 1: a run that stopped by itself) after at least 1 s (and well before 20),
    saying it waited 1 s (not 0: a clock read the wrong way round fires at the first tick)."""
    body = """
        with watchdog.watching("all_reduce", "dp", [0, 1], 0):
            time.sleep(20)
        print("the wait returned")
    """
    result, seconds = run_child(body, timeout=1, limit_s=60)
    assert result.returncode == watchdog.STALL_EXIT == 75, (result.stdout, result.stderr)
    assert result.stdout == ""
    assert result.stderr == ("minipar: error: rank 0 waited 1 s in all_reduce on communicator 'dp' "
                             "(world ranks [0, 1]), past --collective-timeout 1: a rank of it stalled "
                             "or died\n")
    assert 1 <= seconds < 1 + pace.allowance(), seconds  # the lower bound is exact; the upper: a few
    # start-ups at this machine's pace (tests/pace.py), far below the 20 s a watchdog that never fires takes


def test_ctrl_c_dropped_by_a_finalizer_still_ends_the_rank_with_the_one_line():
    """Python runs the SIGINT handler between any two bytecodes, a finalizer's too; a KeyboardInterrupt
    raised inside __del__ (a graph's Context) is printed as "Exception ignored ... Traceback" and
    dropped, and the rank computed on. The unraisable hook ends it in one line, exit 130, no traceback."""
    body = """
        import os, signal
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's; a background job ignores it
        watchdog.WATCHDOG.start(rank=3)
        watchdog.WATCHDOG.catch_interrupts()

        class Graph:
            def __del__(self):
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C arrives while the finalizer runs
                for _ in range(100):  # 1 s inside it: Python runs the handler here, whatever the load
                    time.sleep(0.01)

        Graph()
        time.sleep(20)  # computing on: the interrupt is gone from the main thread
        print("never interrupted")
    """
    result, seconds = run_child(body, timeout=600, limit_s=60)
    assert result.returncode == 130, (result.stdout, result.stderr)
    assert result.stderr == "minipar train: interrupted (rank 3)\n" and result.stdout == ""
    assert seconds < 20


@pytest.mark.parametrize("said_first", [False, True])
def test_a_finalizer_failing_after_ctrl_c_ends_the_rank_with_the_one_line(said_first):
    """A Ctrl-C can stop the activation meter between two of its dictionaries; as the rank unwinds, a
    graph's finalizer then fails (a KeyError, once under load in the elastic Ctrl-C test), and Python
    printed "Exception ignored ... Traceback" above the rank's line. After a Ctrl-C the unraisable hook
    ends the rank with the one line, exit 130, whatever the finalizer raised; and once only, when the
    rank's own handler (commands.interrupted) wrote it before the finalizer ran."""
    said = "watchdog.WATCHDOG.say_interrupted(3)" if said_first else "pass"
    body = f"""
        import os, signal
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's; a background job ignores it
        watchdog.WATCHDOG.start(rank=3)
        watchdog.WATCHDOG.catch_interrupts()

        class HalfUpdated:
            def __del__(self):
                raise KeyError(140628383185296)  # the meter's entry that the interrupt left unmade

        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(20)
        except KeyboardInterrupt:
            {said}
            HalfUpdated()  # unwinding drops a graph: its finalizer fails
            print("the rank's own handler ran on")
    """
    result, seconds = run_child(body, timeout=600, limit_s=60)
    assert result.returncode == 130, (result.stdout, result.stderr)
    assert result.stderr == "minipar train: interrupted (rank 3)\n" and result.stdout == ""
    assert seconds < 20


def test_short_waits_and_time_between_waits_never_fire_it():
    """Timeout 2 s: six waits of 0.5 s (3 s in all, each under the timeout) and then 2.5 s outside any
    wait. The clock starts again at each wait and stops when it ends: a watchdog that measured from its
    first wait, or kept the last wait as current, would end the process."""
    body = """
        for _ in range(6):
            with watchdog.watching("all_gather", "tp", [0, 1], 0):
                time.sleep(0.5)
            assert watchdog.WATCHDOG.current is None
        time.sleep(2.5)
        print("done")
    """
    result, _ = run_child(body, timeout=2, limit_s=60)
    assert result.returncode == 0 and result.stdout == "done\n" and result.stderr == "", result.stderr


def run_example_under_pytest(variant: str, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    """deadlock_example.py under `mpiexec -n 2 python -m pytest -m mpi`, as make test runs the suite."""
    command = [str(Path(sys.executable).parent / "mpiexec"), "-n", "2", sys.executable, "-m", "pytest", "-q",
               "-m", "mpi", "tests/distributed/deadlock_example.py"]
    environment = {**os.environ, "MINIPAR_DEADLOCK_EXAMPLE": variant, "MINIPAR_TEST_DEADLOCK_S": "60",
                   "MINIPAR_COLLECTIVE_TIMEOUT": f"{timeout:g}", "MPIEXEC_TIMEOUT": "200",
                   "OPENBLAS_NUM_THREADS": "1"}
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=ROOT, env=environment)
    return result, time.monotonic() - started


def test_a_deadlocked_multi_rank_test_names_itself_and_the_collective_on_the_terminal():
    """Rank 0 waits in an all-reduce rank 1 never joins. The watchdog fires at the collective timeout
    (3 s), but under pytest its line went to the captured stderr and os._exit dropped it: the job
    ended with exit 1 and no output (the harness's own watchdog, which names the test, comes at 60 s).
    Now the terminal shows the test's node id and the line, within the timeout plus 10 s of the same
    run without the deadlock (the machine's pace: start-up, collection and teardown)."""
    passing, pace = run_example_under_pytest("none", timeout=3)
    assert passing.returncode == 0, passing.stdout + passing.stderr
    result, seconds = run_example_under_pytest("deadlock", timeout=3)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and seconds < pace + 3 + 10, (seconds, pace, output)
    node = "tests/distributed/deadlock_example.py::" \
        "test_rank_0_waits_in_an_all_reduce_that_rank_1_never_joins"
    line = ("minipar: error: rank 0 waited 3 s in all_reduce on communicator 'world' (world ranks [0, 1]), "
            "past --collective-timeout 3: a rank of it stalled or died")
    assert f"[rank 0] {node}: {line}" in output, output


ENDING_SCRIPT = """
import os, signal, subprocess, time
from mpi4py import MPI
from minipar.distributed import watchdog
if MPI.COMM_WORLD.rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)  # stopped, as a hung rank is: only SIGKILL ends it
time.sleep(0.3)
# a child holding this rank's PMI socket open past its exit: Hydra's proxy reaps the rank's exit status
# before it sees that socket close, the order a loaded machine gave at random
subprocess.Popen(["sleep", "60"], pass_fds=[int(os.environ["PMI_FD"])], stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL)
watchdog.end_job("the one line\\n", 75)
"""


def test_a_stall_ends_every_rank_of_the_job_even_when_mpiexec_reaps_the_ending_rank_first():
    """end_job (a stall's end) takes the stopped rank 1 down with rank 0, and mpiexec exits with 75 and
    the one line. Ending rank 0 alone (os._exit, as the watchdog did) relied on Hydra noticing its
    PMI socket close before reaping it: CI once waited here until MPIEXEC_TIMEOUT (90 s), and with the
    socket held open this job did every time."""
    command = [str(Path(sys.executable).parent / "mpiexec"), "-n", "2", sys.executable, "-c", ENDING_SCRIPT]
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env={**os.environ, "MPIEXEC_TIMEOUT": "60"})
    seconds = time.monotonic() - started
    assert result.returncode == 75 and seconds < pace.allowance(), (result.returncode, seconds, result.stderr)
    assert result.stderr.splitlines() == ["the one line"], result.stderr
