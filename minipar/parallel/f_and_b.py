"""The overlap inside DualPipeV's F&B step: one micro-batch's all-to-all in flight while the other computes.

The idea (DeepSeek-V3, section 3.2.1, figure 4): an F&B step runs the forward of one micro-batch through
one chunk and the whole backward of another micro-batch through the other chunk. The two share no data,
so while one part waits for its expert all-to-all (dispatch or combine, forward or backward), the other
part can compute. A GPU runs them on two streams; here each part runs on a thread of its own and a turn
passes between them, so that exactly one part runs at any moment. With one MoE layer in each chunk:

    turn 1  forward:   attention and router; post the dispatch all-to-all
    turn 2  backward:  receive the gradient, back to the MoE layer; post its combine's all-to-all
    turn 3  forward:   wait for the dispatch; the experts; post the combine
    turn 4  backward:  wait; the experts' backward; post the dispatch's all-to-all
    turn 5  forward:   wait for the combine; the rest of the chunk, done
    then    backward:  wait; the rest of the chunk (the forward has finished: no turn to hand over)

A part hands the turn to the other right after it has *posted* an all-to-all (`exchange`), and waits for
it only when the turn comes back. So every computation runs exactly as it would one part after the other
(each sum in the same order, the losses and weights bit for bit), only the waits move. The parts take
turns in an order fixed by the code, never by timing, so the ranks of an ep group post their all-to-alls
in the same order, as MPI's non-blocking collectives require.

What it saves: the all-to-all's time, hidden behind the other part's compute, where the network moves the
data while the processor computes (MPICH moves it inside any MPI call, or all the time with its progress
thread, MPIR_CVAR_ASYNC_PROGRESS=1). What it costs: nothing more sent; a thread per F&B step and two
hand-overs per all-to-all. A part keeps its own autograd modes (no_grad, a rerun's) across a hand-over.
MPI is called from two threads, never at once: MPI_THREAD_SERIALIZED is enough (mpi4py asks for
MPI_THREAD_MULTIPLE). A part that fails stops the other at its next wait for the turn.
`Interleave(enabled=False)` (--no-overlap) runs the parts one after the other on this thread, as the
baseline, with the same record.

The record: each all-to-all as [part, posted, waited] (seconds on perf_counter: `waited` is when the
part, its turn back, began to wait), and each part's time away from the processor as [part, handed over,
resumed]; the pipeline turns the latter into the compute segments of its timing (pipeline.py).
Lesson: lessons/06b_pipeline_schedules.md (the F&B step), lessons/15_experts.md (the all-to-all).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from minipar.core import autograd, recompute
from minipar.distributed import collectives

_here = threading.local()  # .part: (the Interleave, this thread's part's label) while a part runs


class OtherPartFailed(RuntimeError):
    """Raised in a part waiting for the turn when the other part has failed: it must not run on."""


class Interleave:
    """Run the parts of one F&B step, handing the turn from one to the other at each all-to-all."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.turn = threading.Condition()
        self.labels: list[str] = []  # the two parts' labels, first part first
        self.modes: tuple = ()  # the modes the step began with (modes_now)
        self.running = ""  # the label of the part that holds the turn
        self.finished: set[str] = set()
        self.broken = False  # a part failed: the other stops at its next wait for the turn
        self.exchanges: list[list] = []  # [part, posted, waited]: each all-to-all of the step
        self.away: list[list] = []  # [part, handed over, resumed]: each stretch a part gave the turn away

    def run(self, parts: list[tuple[str, Callable[[], None]]]) -> None:
        """Run the two (label, part) pairs, the first on this thread, holding the turn first; the
        second on a thread of its own, from the first hand-over. Returns when both are done; a part's
        error is raised here."""
        self.labels = [label for label, _ in parts]
        self.modes = modes_now()  # each part starts with the step's modes
        if not self.enabled:
            for label, part in parts:
                self.as_part(label, part)
            return
        (first, run_first), (second, run_second) = parts
        failed: list[BaseException] = []
        self.running = first
        helper = threading.Thread(target=self.as_part, args=(second, run_second, failed),
                                  name=f"minipar-{second}", daemon=True)  # daemon: a failed job exits
        helper.start()
        try:
            self.as_part(first, run_first)
        except OtherPartFailed:
            pass  # the second part failed: its error is raised below
        finally:
            helper.join()  # it holds no turn now: it runs to its end, or stops at its next wait
        if failed:
            raise failed[0]

    def as_part(self, label: str, part: Callable[[], None], failed: list | None = None) -> None:
        """Run `part` as the part `label`: wait for its turn, run, and at its end give the turn away."""
        _here.part = (self, label)
        try:
            self.wait_for_turn(label)
            restore_modes(self.modes)
            part()
        except OtherPartFailed:
            if failed is None:
                raise
        except BaseException as error:  # on the helper thread: handed to run(), which raises it
            with self.turn:
                self.broken = True
            if failed is None:
                raise
            failed.append(error)
        finally:
            _here.part = None
            with self.turn:
                self.finished.add(label)
                self.running = self.other(label)
                self.turn.notify_all()

    def wait_for_turn(self, label: str) -> None:
        """Wait (holding self.turn's lock, or taking it) until the part `label` has the turn."""
        with self.turn:
            self.turn.wait_for(lambda: self.running == label or self.broken or not self.enabled)
            if self.broken:
                raise OtherPartFailed(f"the other part of this F&B step failed; {label} stops")

    def other(self, label: str) -> str:
        """The other part's label."""
        return next(name for name in self.labels if name != label)

    def hand_over(self, label: str) -> None:
        """Give the turn to the other part (unless it has finished) and wait until it comes back."""
        with self.turn:
            if self.other(label) in self.finished:
                return
            modes = modes_now()  # this part's, kept across
            handed = time.perf_counter()
            self.running = self.other(label)
            self.turn.notify_all()
            self.wait_for_turn(label)
            self.away.append([label, handed, time.perf_counter()])
            restore_modes(modes)


def modes_now() -> tuple:
    """The global modes a part runs under: autograd's (no_grad, a mixed precision cast) and a rerun's."""
    return autograd.recording_modes(), recompute.rerun_depth()


def restore_modes(modes: tuple) -> None:
    autograd.restore_recording_modes(modes[0])
    recompute.restore_rerun_depth(modes[1])


def exchange(comm, blocks):
    """collectives.all_to_all(comm, blocks), as a part of an overlapped step does it: posted, the turn
    handed to the other part, then waited for. Outside an F&B step, the plain blocking one."""
    part = getattr(_here, "part", None)
    if part is None:
        return collectives.all_to_all(comm, blocks)
    interleave, label = part
    if not interleave.enabled:  # the baseline: waited for at once
        now = time.perf_counter()
        interleave.exchanges.append([label, now, now])
        return collectives.all_to_all(comm, blocks)
    pending = comm.iall_to_all(blocks)
    posted = time.perf_counter()
    interleave.hand_over(label)
    interleave.exchanges.append([label, posted, time.perf_counter()])
    return pending.wait()
