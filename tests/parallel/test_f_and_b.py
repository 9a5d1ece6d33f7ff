"""The F&B step's interleave (parallel/f_and_b.py) on plain parts, in one process: the turn passes at each
hand-over and nowhere else, a part's autograd modes come back with its turn, and an error is raised.

    pytest tests/parallel/test_f_and_b.py

Its use in DualPipeV with MoE and ep 2 (the timing record, exact to one process) is in
tests/parallel/test_pipeline_schedules.py.
"""

import numpy as np
import pytest

from minipar.core import autograd, recompute
from minipar.core.autograd import Tensor
from minipar.parallel.f_and_b import Interleave
from minipar.parallel.pipeline import computed_between


def test_the_parts_take_turns_at_each_hand_over_and_the_last_runs_on_alone():
    interleave, log = Interleave(), []

    def part(label, stretches):
        def run():
            for k in range(stretches):
                log.append(f"{label}{k}")
                if k + 1 < stretches:
                    interleave.hand_over(label)
        return run

    interleave.run([("F", part("F", 2)), ("B", part("B", 4))])
    # F0, hand over, B0, hand over, F1, F ends, and B runs on: its hand-overs find F finished
    assert log == ["F0", "B0", "F1", "B1", "B2", "B3"]
    assert [label for label, *_ in interleave.away] == ["F", "B"]


def test_switched_off_the_parts_run_one_after_the_other():
    interleave, log = Interleave(enabled=False), []
    interleave.run([("F", lambda: log.append("F")), ("B", lambda: log.append("B"))])
    assert log == ["F", "B"] and interleave.away == []


def test_a_part_keeps_its_own_autograd_modes_across_a_hand_over():
    """A forward handing over inside no_grad (a recomputed block's first pass) must not leave the
    backward without a graph, nor get the backward's rerun depth."""
    interleave, seen = Interleave(), {}

    def forward():
        with autograd.no_grad():
            interleave.hand_over("F")
            seen["F"] = Tensor(np.ones(1), requires_grad=True) * 2, recompute.recomputing()

    def backward():
        with recompute.rerunning():
            seen["B"] = Tensor(np.ones(1), requires_grad=True) * 2, recompute.recomputing()
            interleave.hand_over("B")

    interleave.run([("F", forward), ("B", backward)])
    assert seen["B"][0].requires_grad and seen["B"][1]  # the backward ran with a graph, rerunning
    assert not seen["F"][0].requires_grad and not seen["F"][1]  # the forward back in no_grad, not rerun
    assert autograd.recording_modes()[0] and recompute.rerun_depth() == 0


def test_an_error_in_the_second_part_is_raised_by_run():
    interleave = Interleave()

    def backward():
        raise ValueError("in the backward")

    with pytest.raises(ValueError, match="in the backward"):
        interleave.run([("F", lambda: interleave.hand_over("F")), ("B", backward)])


def test_an_error_in_the_first_part_is_raised_and_stops_the_second_at_its_next_hand_over():
    interleave, log = Interleave(), []

    def forward():
        interleave.hand_over("F")
        raise ValueError("in the forward")

    def backward():
        log.append("B0")
        interleave.hand_over("B")
        log.append("B1")  # must not run: the forward failed while B waited for the turn

    with pytest.raises(ValueError, match="in the forward"):
        interleave.run([("F", forward), ("B", backward)])
    assert log == ["B0"]


def test_a_part_computes_outside_the_stretches_it_handed_away():
    assert computed_between(0.0, 10.0, [(6.0, 8.0), (2.0, 3.0)]) == [(0.0, 2.0), (3.0, 6.0), (8.0, 10.0)]
    assert computed_between(0.0, 10.0, []) == [(0.0, 10.0)]
    assert computed_between(5.0, 10.0, [(1.0, 2.0)]) == [(5.0, 10.0)]  # another action's hand-over
