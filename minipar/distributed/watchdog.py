"""The watchdog: no rank waits forever in a collective, and Ctrl-C reaches a rank blocked in MPI.

The idea: a rank that stops without dying (a hung driver, a node swapping, a deadlock) leaves the
others waiting in a collective for ever, and nothing notices; NCCL's answer is a watchdog thread that
aborts a collective running past a timeout, and this is the same. Every collective and pipeline wait
of `Comm` (comm.py) runs inside `watching(comm, op)`, which writes down the operation, its
communicator and the time it began; a daemon thread wakes a few times a second and, if the current
wait began more than the timeout ago, writes one line naming the operation, the communicator and its
world ranks, and ends the whole job with MPI_Abort (`end_job`). mpi4py releases the GIL inside
blocking MPI calls, so the thread runs while the main thread waits.

Ctrl-C: Python runs a signal handler (KeyboardInterrupt) only in the main thread between bytecodes,
so a rank blocked inside a C-level MPI call would see it only once the call returned, which for a
stalled peer is never. `signal.set_wakeup_fd` makes the C-level handler write the signal's number to a
pipe at once; the thread reads it, and if the main thread is still inside a watched wait a moment
later, it writes the one line (`minipar train: interrupted (rank R)`) and ends the process with 130.
A rank that is computing gets KeyboardInterrupt as usual and prints the same line itself; one whose
KeyboardInterrupt goes off inside a finalizer (where Python drops it) is ended by `unraisable`.

What it costs: two clock reads and a few assignments per collective (blocking MPI calls are kept:
MPICH's non-blocking all-reduce ran 2-16x slower than its blocking one here, a polled wait was no
option), and one thread that wakes every 0.1 s. The non-blocking calls that overlap computation
(DDP's bucket all-reduces, ZeRO-3's prefetch, pipeline receives posted early: comm.py's
PendingCollective) are watched at their wait, named as their blocking call. Lesson:
lessons/12_reliability.md.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import signal
import sys
import threading
import time

from minipar.core.hooks import HookList, RemovableHandle

TIMEOUT_ENV = "MINIPAR_COLLECTIVE_TIMEOUT"  # the default of --collective-timeout (tests set ~30 s)
DEFAULT_TIMEOUT_S = 600.0
TICK_S = 0.1  # how often the thread looks: a stall is noticed within a tick of the timeout
STALL_EXIT = 75  # the process's code when a wait ran past the timeout: `minipar launch` restarts on it
INTERRUPT_GRACE_S = 0.5  # Ctrl-C: how long the main thread has to raise KeyboardInterrupt itself
ABORT_PAUSE_S = 0.3  # end_job: how long mpiexec has to forward the last line before the abort


def timeout_from_env() -> float:
    """$MINIPAR_COLLECTIVE_TIMEOUT in seconds, a positive finite number; 600 when unset or empty.
    Anything else is a ValueError with the one line to print: a typo ("5s") must not mean 600 s.
    cli.py refuses it before a command that starts ranks runs."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise ValueError(f"{TIMEOUT_ENV}={text!r} is not a number of seconds: give a positive number "
                         f"(e.g. 600), or leave it empty for {DEFAULT_TIMEOUT_S:g}")
    return seconds


class Watchdog:
    """The one wait in progress on this process's main thread, and the thread that watches it.
    `add_reporter(report)`: `report(line)` is called with the stall's line before the job ends (the test
    harness's terminal, --trace's file); it returns the handle that takes it out again."""

    def __init__(self):
        try:
            self.timeout_s = timeout_from_env()
        except ValueError:  # refused by the command line before any rank waits (cli.py)
            self.timeout_s = DEFAULT_TIMEOUT_S
        self.current: tuple | None = None  # (operation, communicator name, its world ranks, start)
        self.rank = 0
        self.thread: threading.Thread | None = None
        self.interrupts: int | None = None  # the pipe the C-level signal handler writes to
        self.interrupted_already = False  # a Ctrl-C reached Python's handler in this process
        self.interrupt_said = threading.Lock()  # taken by whoever writes the Ctrl-C line: it is written once
        # where the line goes too, before the process ends: a test harness whose pytest captures
        # stderr (into a file os._exit never shows) gives the terminal, and says which test it was
        self.reporters = HookList()

    def add_reporter(self, report) -> RemovableHandle:
        return self.reporters.add(report)

    def start(self, rank: int) -> None:
        if self.thread is None:
            self.rank = rank
            self.thread = threading.Thread(target=self.watch, name="minipar-watchdog", daemon=True)
            self.thread.start()

    def watch(self) -> None:
        while True:
            if self.interrupts is not None:
                readable, _, _ = select.select([self.interrupts], [], [], TICK_S)
                if readable and signal.SIGINT in os.read(self.interrupts, 64):
                    self.interrupted()
            else:
                time.sleep(TICK_S)
            current = self.current
            if current is not None and time.monotonic() - current[3] > self.timeout_s:
                self.stalled(*current)

    def stalled(self, op: str, name: str, ranks: list[int], started: float) -> None:
        waited = time.monotonic() - started
        line = (f"minipar: error: rank {self.rank} waited {waited:.0f} s in {op} on communicator {name!r} "
                f"(world ranks {ranks}), past --collective-timeout {self.timeout_s:g}: a rank of it "
                "stalled or died\n")
        self.reporters.call_all(line)
        end_job(line, STALL_EXIT)  # its own code (EX_TEMPFAIL): a restart may cure it, unlike 1 or 2

    def interrupted(self) -> None:
        time.sleep(INTERRUPT_GRACE_S)
        if self.current is not None:  # still blocked in MPI: KeyboardInterrupt cannot reach it
            self.end_interrupted()

    def unraisable(self, unraisable) -> None:
        """sys.unraisablehook while interrupts are caught. A Ctrl-C whose KeyboardInterrupt goes off in a
        finalizer (a graph's Context.__del__) is dropped there by Python, which prints "Exception
        ignored ... Traceback" and computes on: the rank ends here instead, in the main thread, with the
        one line. So does any exception from a finalizer once a Ctrl-C has arrived: the interrupt may
        have stopped some bookkeeping half done (the activation meter's, between two dictionaries), whose
        finalizer then fails as the rank unwinds, and the rank is ending anyway. Any other unraisable
        exception goes to Python's own hook."""
        interrupt = unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt)
        if interrupt or self.interrupted_already:
            self.end_interrupted()
        sys.__unraisablehook__(unraisable)

    def say_interrupted(self, rank: int) -> None:
        """Write the one line of a Ctrl-C (`minipar train: interrupted (rank R)`), once per process: the
        rank's own handler and a finalizer failing as it unwinds may both come to it."""
        if self.interrupt_said.acquire(blocking=False):
            sys.stderr.write(f"minipar train: interrupted (rank {rank})\n")
            sys.stderr.flush()

    def end_interrupted(self) -> None:
        """End this process alone on a Ctrl-C (mpiexec passed it to every rank), with the one line."""
        self.say_interrupted(self.rank)
        os._exit(130)

    def note_interrupt(self, signum, frame) -> None:
        """Python's SIGINT handler (KeyboardInterrupt), noting that the interrupt came."""
        self.interrupted_already = True
        raise KeyboardInterrupt

    def catch_interrupts(self) -> None:
        """From the main thread: let the thread see Ctrl-C while the main thread is blocked in MPI."""
        if self.interrupts is None:
            read, write = os.pipe()
            os.set_blocking(write, False)
            signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            self.interrupts = read
            sys.unraisablehook = self.unraisable  # Python's documented hook for exceptions it cannot raise
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where Ctrl-C is ignored
                signal.signal(signal.SIGINT, self.note_interrupt)


def end_job(text: str, code: int) -> None:
    """Write `text` and end every rank of the job, mpiexec exiting with `code`.

    MPI_Abort, not this process's exit alone: Hydra's proxy ends the other ranks when a rank's PMI
    socket closes unless it has already reaped that rank's exit status, and on a loaded machine it
    sometimes has (a stopped rank then kept the job alive until MPIEXEC_TIMEOUT). The pause lets
    mpiexec forward our stderr before the abort tears the job down (without it about 1 line in 30 was
    lost); MPICH's own "Abort(75) on node 0 ..." line goes to /dev/null, so ours is the only one."""
    sys.stderr.write(text)
    sys.stderr.flush()
    MPI = sys.modules.get("mpi4py.MPI")  # never imported here: importing it starts MPI
    if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        time.sleep(ABORT_PAUSE_S)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
        MPI.COMM_WORLD.Abort(code)
    os._exit(code)


WATCHDOG = Watchdog()


def set_collective_timeout(seconds: float) -> None:
    """How long any rank may wait in one collective or receive before the watchdog ends the job."""
    WATCHDOG.timeout_s = float(seconds)


def collective_timeout() -> float:
    return WATCHDOG.timeout_s


@contextlib.contextmanager
def watching(op: str, name: str, ranks: list[int], rank: int):
    """Run the body (one blocking MPI call, or a stretch of start-up that ends in one) as the wait the
    watchdog watches; inside another, the outer one is watched again (from its own start) afterwards."""
    WATCHDOG.start(rank)
    outer = WATCHDOG.current  # a wait inside a watched stretch (the start-up's, the load's) gives it back
    WATCHDOG.current = (op, name, ranks, time.monotonic())
    try:
        yield
    finally:
        WATCHDOG.current = outer
