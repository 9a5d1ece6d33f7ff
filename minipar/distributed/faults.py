"""Failures on purpose and on accident: a fault injected where a test names it, and a job that ends
instead of hanging when one rank raises.

`MINIPAR_FAULT` places a fault (a raise, a SIGSTOP, or a nudge of the weights that `--check-reference`
must catch) on one rank at one step or one phase of a save; `install_excepthook` turns an uncaught
exception on any rank into an abort of the whole job, with that rank's traceback.
Lesson: lessons/12_reliability.md.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback

from minipar.distributed.watchdog import end_job


def install_excepthook() -> None:
    """Make an uncaught exception on any rank print its traceback (prefixed by the rank) and
    abort the whole job, instead of leaving the other ranks waiting forever in a collective.
    (mpi4py is imported here, not with the module: importing it starts MPI, and the checkpoint's
    checks, which use inject_fault, run in `minipar launch` too, a supervisor with no MPI of its own.)"""
    from mpi4py import MPI

    def abort_job(kind, value, tb):
        rank = MPI.COMM_WORLD.Get_rank()
        text = "".join(traceback.format_exception(kind, value, tb))
        end_job("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()), 1)

    sys.excepthook = abort_job


def inject_fault(rank: int, what: str, **where) -> None:
    """Raise on `rank` if MINIPAR_FAULT names this place: tests that a job losing a rank ends cleanly.

    MINIPAR_FAULT=rank:R,step:S raises on rank R at step S (trainer/loop.py: where = step=S);
    rank:R,step:S,stall:stop stops that rank there instead (SIGSTOP: the watchdog's test);
    rank:R,save:PHASE raises on rank R halfway through writing its checkpoint file (PHASE shard) or the
    manifest (PHASE manifest), or at the save's other points (snapshot, shard-fsynced, shards-written,
    manifest-fsynced, committed: checkpoint/sharded.py, where = save=PHASE);
    rank:R,step:S,signal:KILL kills rank R there with that signal (a node lost: `minipar launch`'s
    test), and once:PATH makes any of them fire only where PATH does not exist yet (it is created);
    rank:R,startup:validate (or load),stall:stop stops rank R while it validates its input
    (trainer/commands.py) or loads the checkpoint (trainer/loop.py): the watched start-up's test.
    `what` says where, in the error."""
    spec = os.environ.get("MINIPAR_FAULT", "")
    fault = dict(part.split(":", 1) for part in spec.split(",") if ":" in part)
    named = {"rank": rank, **where}
    if "nudge" in fault:  # not a failure: fault_nudge's deviation
        return
    if where and all(fault.get(key) == str(value) for key, value in named.items()):
        if "once" in fault and not first_time(fault["once"]):  # fired before, by an earlier launch
            return
        if "signal" in fault:  # rank:R,step:S,signal:KILL: killed from outside, as a lost node is
            os.kill(os.getpid(), getattr(signal, f"SIG{fault['signal']}"))
        if fault.get("stall") == "stop":  # rank:R,step:S,stall:stop: this rank stops, as if hung
            os.kill(os.getpid(), signal.SIGSTOP)
        raise RuntimeError(f"injected fault on rank {rank} {what} (MINIPAR_FAULT={spec})")


def first_time(path: str) -> bool:
    """True once: the first call creates `path` (atomically), every later one, in any process, finds it.
    A one-shot fault: the relaunched job (`minipar launch`) passes the same place unharmed."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def fault_nudge(rank: int, step: int) -> float | None:
    """MINIPAR_FAULT=rank:R,step:S,nudge:X: the relative amount by which rank R moves its first
    parameter before step S (trainer/loop.py), a deviation from one process that --check-reference
    must report as FAIL; None elsewhere."""
    fault = dict(part.split(":", 1) for part in os.environ.get("MINIPAR_FAULT", "").split(",") if ":" in part)
    if fault.get("rank") == str(rank) and fault.get("step") == str(step) and "nudge" in fault:
        return float(fault["nudge"])
    return None
