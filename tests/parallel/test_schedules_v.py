"""The V-shaped schedules as data: ZB-V's and DualPipeV's orders against torch's, makespan, bubble, memory.

Rank s holds two chunks placed as a V: virtual stage s on the way down and 2K-1-s on the way back,
so the loss is on rank 0. The expected orders are torch.distributed.pipelining's, transcribed from
its generator; the makespan is the lower bound written out from the data flow (rank K-1 receives
its first input after the K-1 chunk forwards before it, then has 6M chunk actions of work), never
read from the simulator.
"""

import json
import re
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipar.parallel.schedules import (
    Action,
    bubble_fraction,
    build_schedule,
    dependencies,
    dualpipev,
    one_f_one_b,
    p2p_messages,
    peak_inflight,
    simulate,
    zb_v,
)
from minipar.trainer.commands import schedule_main

# torch.distributed.pipelining.schedules.ScheduleZBVZeroBubble._calculate_single_rank_operations
# (pytorch/pytorch, torch/distributed/pipelining/schedules.py at 00722e648b740f91d0e71494baa17891749fd291),
# run for (K, M) and written out in torch's notation: "<stage index><F|I|W><micro-batch>", I being the
# input gradient (minipar's B), the idle slots (None) left out. Rank s holds stages s and 2K-1-s.
TORCH_ZBV = {
    (2, 4): [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3",
    ],
    (4, 8): [
        "0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 7I3 7W3 0F7 0I0 0W0 7F4 7I4 "
        "7W4 0I1 0W1 7F5 7I5 7W5 0I2 0W2 7F6 7I6 7W6 0I3 0W3 7F7 7I7 7W7 0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7",
        "1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 6I0 6W0 6F2 6I1 6W1 6F3 6I2 6W2 1F6 1I0 1W0 6F4 6I3 6W3 1F7 1I1 "
        "1W1 6F5 6I4 6W4 1I2 1W2 6F6 6I5 6W5 1I3 1W3 6F7 6I6 6W6 1I4 6I7 1I5 1W4 1I6 1W5 1I7 1W6 6W7 1W7",
        "2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 5I0 5W0 5F3 5I1 5W1 2F5 2I0 2W0 5F4 5I2 5W2 2F6 2I1 2W1 5F5 5I3 "
        "5W3 2F7 2I2 2W2 5F6 5I4 5W4 2I3 2W3 5F7 5I5 5W5 2I4 5I6 2I5 5I7 2I6 2W4 2I7 2W5 5W6 5W7 2W6 2W7",
        "3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 4I0 4W0 3F4 3I0 3W0 4F4 4I1 4W1 3F5 3I1 3W1 4F5 4I2 4W2 3F6 3I2 "
        "3W2 4F6 4I3 4W3 3F7 3I3 3W3 4F7 4I4 4W4 3I4 4I5 3I5 4I6 3I6 4I7 3I7 3W4 4W5 4W6 4W7 3W5 3W6 3W7",
    ],
    (4, 12): [
        "0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 7I3 7W3 0F7 0I0 0W0 7F4 7I4 "
        "7W4 0F8 0I1 0W1 7F5 7I5 7W5 0F9 0I2 0W2 7F6 7I6 7W6 0F10 0I3 0W3 7F7 7I7 7W7 0F11 0I4 0W4 7F8 7I8 "
        "7W8 0I5 0W5 7F9 7I9 7W9 0I6 0W6 7F10 7I10 7W10 0I7 0W7 7F11 7I11 7W11 0I8 0W8 0I9 0W9 0I10 0W10 "
        "0I11 0W11",
        "1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 6I0 6W0 6F2 6I1 6W1 6F3 6I2 6W2 1F6 1I0 1W0 6F4 6I3 6W3 1F7 1I1 "
        "1W1 6F5 6I4 6W4 1F8 1I2 1W2 6F6 6I5 6W5 1F9 1I3 1W3 6F7 6I6 6W6 1F10 1I4 1W4 6F8 6I7 6W7 1F11 1I5 "
        "1W5 6F9 6I8 6W8 1I6 1W6 6F10 6I9 6W9 1I7 1W7 6F11 6I10 6W10 1I8 6I11 1I9 1W8 1I10 1W9 1I11 1W10 "
        "6W11 1W11",
        "2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 5I0 5W0 5F3 5I1 5W1 2F5 2I0 2W0 5F4 5I2 5W2 2F6 2I1 2W1 5F5 5I3 "
        "5W3 2F7 2I2 2W2 5F6 5I4 5W4 2F8 2I3 2W3 5F7 5I5 5W5 2F9 2I4 2W4 5F8 5I6 5W6 2F10 2I5 2W5 5F9 5I7 "
        "5W7 2F11 2I6 2W6 5F10 5I8 5W8 2I7 2W7 5F11 5I9 5W9 2I8 5I10 2I9 5I11 2I10 2W8 2I11 2W9 5W10 5W11 "
        "2W10 2W11",
        "3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 4I0 4W0 3F4 3I0 3W0 4F4 4I1 4W1 3F5 3I1 3W1 4F5 4I2 4W2 3F6 3I2 "
        "3W2 4F6 4I3 4W3 3F7 3I3 3W3 4F7 4I4 4W4 3F8 3I4 3W4 4F8 4I5 4W5 3F9 3I5 3W5 4F9 4I6 4W6 3F10 3I6 "
        "3W6 4F10 4I7 4W7 3F11 3I7 3W7 4F11 4I8 4W8 3I8 4I9 3I9 4I10 3I10 4I11 3I11 3W8 4W9 4W10 4W11 3W9 "
        "3W10 3W11",
    ],
    (2, 2): [  # M < 2K-1: torch writes the order for 2K-1 micro-batches and drops those that do not exist
        "0F0 0F1 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 0I1 0W1",
        "1F0 2F0 1F1 2F1 2I0 2W0 1I0 1W0 2I1 2W1 1I1 1W1",
    ],
}


def from_torch(rank: int, text: str) -> list[Action]:
    """A rank's actions in torch's notation as minipar's: stage s is chunk 0 on rank s, else chunk 1."""
    actions = []
    for word in text.split():
        stage, op, microbatch = re.fullmatch(r"(\d+)([FIBW])(\d+)", word).groups()
        actions.append(Action("B" if op == "I" else op, int(microbatch), 0 if int(stage) == rank else 1))
    return actions


@pytest.mark.parametrize("k, m", list(TORCH_ZBV))
def test_zb_v_is_torch_order_action_for_action(k, m):
    expected = [from_torch(rank, text) for rank, text in enumerate(TORCH_ZBV[k, m])]
    assert build_schedule("zb-v", k, m) == zb_v(k, m) == expected


def F(i, c):
    return Action("F", i, c)


def B(i, c):
    return Action("B", i, c)


def test_v_placement_dependencies_k2():
    # K = 2: virtual stages 0, 1, 2, 3 are (rank 0, chunk 0), (1, 0), (1, 1), (0, 1)
    assert dependencies(1, F(5, 0), 2, 2, "v") == [(0, F(5, 0))]
    assert dependencies(1, F(5, 1), 2, 2, "v") == [(1, F(5, 0))]  # the turn of the V stays on rank K-1
    assert dependencies(0, F(5, 1), 2, 2, "v") == [(1, F(5, 1))]
    assert dependencies(0, B(5, 1), 2, 2, "v") == [(0, F(5, 1))]  # the loss is on rank 0
    assert dependencies(1, B(5, 0), 2, 2, "v") == [(1, F(5, 0)), (1, B(5, 1))]
    assert dependencies(0, B(5, 0), 2, 2, "v") == [(0, F(5, 0)), (1, B(5, 0))]


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 6), st.integers(0, 8))
def test_zb_v_makespan_reaches_the_lower_bound(k, extra):
    m = 2 * k - 1 + extra  # enough micro-batches to fill the V
    timeline = simulate(zb_v(k, m), 2, 2, 2, placement="v")  # a chunk's F = B = W = 1 (a stage's: 2)
    # rank K-1 starts after K-1 chunk forwards and then has 6M chunk actions: nothing can be faster
    assert timeline.makespan == 6 * m + k - 1
    assert bubble_fraction(timeline) == Fraction(k - 1, 6 * m + k - 1)  # half of ZB-H1's (K-1)/(3M+K-1)


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 6), st.integers(1, 20))
def test_zb_v_runs_without_deadlock_and_holds_1f1b_rank_0_memory(k, m):
    simulate(zb_v(k, m), placement="v")  # every rank's inputs arrive: a deadlock raises
    if m >= 2 * k - 1:
        # every rank peaks at 2K chunk micro-batches, each half a stage: 1F1B's rank 0, K stages' worth
        assert peak_inflight(zb_v(k, m)) == [2 * peak_inflight(one_f_one_b(k, m))[0]] * k


def test_zb_v_messages():
    # each micro-batch crosses the 2K-2 boundaries between ranks twice (the turn at rank K-1 is local)
    assert p2p_messages(zb_v(4, 8), "v") == 8 * 2 * (2 * 4 - 2)


def test_cli_draws_zb_v(capsys):
    argv = ["--stages", "2", "--microbatches", "4", "--schedule", "zb-v", "--json"]
    assert schedule_main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["placement"] == "v" and report["virtual_stages"] == 2
    assert report["makespan"] == Fraction(6 * 4 + 2 - 1, 2)  # a stage's F = B = W = 1: a chunk's 1/2
    assert report["peak_inflight"] == [4, 4]
    assert report["timeline"][0][0] == "F0.0" and report["timeline"][1][0] is None


# torch.distributed.pipelining.schedules.ScheduleDualPipeV._calculate_single_rank_operations (same file
# and commit as above), in torch's notation: "B" there is a whole backward (minipar's BW), "I" the input
# gradient (minipar's B), and "(0F3;3B1)" its OVERLAP_F_B action with sub-actions 0F3 and 3B1 (an F&B).
TORCH_DUALPIPEV = {
    (2, 4): [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 (0F3;3B1) (3F2;0B0) 3B2 (3F3;0B1) 3B3 0I2 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 1F2 2B0 (2F2;1B0) (1F3;2B1) (2F3;1B1) 2B2 1B2 2I3 1I3 2W3 1W3",
    ],
    (4, 8): [
        "0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 (0F7;7B3) (7F4;0B0) 7B4 "
        "(7F5;0B1) 7B5 (7F6;0B2) 7B6 (7F7;0B3) 7B7 0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7",
        "1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 6I0 6W0 6F2 6I1 6W1 6F3 (1F6;6B2) (6F4;1B0) (1F7;6B3) (6F5;1B1) "
        "6B4 (6F6;1B2) 6B5 (6F7;1B3) 6B6 1B4 6I7 1I5 6W7 1I6 1W5 1I7 1W6 1W7",
        "2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 5I0 5W0 5F3 (2F5;5B1) (5F4;2B0) (2F6;5B2) (5F5;2B1) (2F7;5B3) "
        "(5F6;2B2) 5B4 (5F7;2B3) 5B5 2B4 5B6 2I5 5I7 2I6 2W5 2I7 5W7 2W6 2W7",
        "3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 3F4 4B0 (4F4;3B0) (3F5;4B1) (4F5;3B1) (3F6;4B2) (4F6;3B2) "
        "(3F7;4B3) (4F7;3B3) 4B4 3B4 4B5 3B5 4I6 3I6 4I7 3I7 4W6 3W6 4W7 3W7",
    ],
    (4, 12): [
        "0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 (0F7;7B3) (7F4;0B0) "
        "(0F8;7B4) (7F5;0B1) (0F9;7B5) (7F6;0B2) (0F10;7B6) (7F7;0B3) (0F11;7B7) (7F8;0B4) 7B8 (7F9;0B5) "
        "7B9 (7F10;0B6) 7B10 (7F11;0B7) 7B11 0I8 0W8 0I9 0W9 0I10 0W10 0I11 0W11",
        "1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 6I0 6W0 6F2 6I1 6W1 6F3 (1F6;6B2) (6F4;1B0) (1F7;6B3) (6F5;1B1) "
        "(1F8;6B4) (6F6;1B2) (1F9;6B5) (6F7;1B3) (1F10;6B6) (6F8;1B4) (1F11;6B7) (6F9;1B5) 6B8 (6F10;1B6) "
        "6B9 (6F11;1B7) 6B10 1B8 6I11 1I9 6W11 1I10 1W9 1I11 1W10 1W11",
        "2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 5I0 5W0 5F3 (2F5;5B1) (5F4;2B0) (2F6;5B2) (5F5;2B1) (2F7;5B3) "
        "(5F6;2B2) (2F8;5B4) (5F7;2B3) (2F9;5B5) (5F8;2B4) (2F10;5B6) (5F9;2B5) (2F11;5B7) (5F10;2B6) 5B8 "
        "(5F11;2B7) 5B9 2B8 5B10 2I9 5I11 2I10 2W9 2I11 5W11 2W10 2W11",
        "3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 3F4 4B0 (4F4;3B0) (3F5;4B1) (4F5;3B1) (3F6;4B2) (4F6;3B2) "
        "(3F7;4B3) (4F7;3B3) (3F8;4B4) (4F8;3B4) (3F9;4B5) (4F9;3B5) (3F10;4B6) (4F10;3B6) (3F11;4B7) "
        "(4F11;3B7) 4B8 3B8 4B9 3B9 4I10 3I10 4I11 3I11 4W10 3W10 4W11 3W11",
    ],
}


def from_torch_overlapped(rank: int, text: str) -> list[Action]:
    actions = []
    for word in text.split():
        pair = re.fullmatch(r"\((\S+);(\S+)\)", word)
        if pair:
            forward, backward = (one_from_torch(rank, part) for part in pair.groups())
            actions.append(Action("F&B", forward.microbatch, forward.chunk, backward))
        else:
            actions.append(one_from_torch(rank, word))
    return actions


def one_from_torch(rank: int, word: str) -> Action:
    stage, op, microbatch = re.fullmatch(r"(\d+)([FIBW])(\d+)", word).groups()
    return Action({"I": "B", "B": "BW"}.get(op, op), int(microbatch), 0 if int(stage) == rank else 1)


@pytest.mark.parametrize("k, m", list(TORCH_DUALPIPEV))
def test_dualpipev_is_torch_order_action_for_action(k, m):
    expected = [from_torch_overlapped(rank, text) for rank, text in enumerate(TORCH_DUALPIPEV[k, m])]
    assert build_schedule("dualpipev", k, m) == dualpipev(k, m) == expected


def test_dualpipev_needs_2k_microbatches():
    with pytest.raises(ValueError, match="at least 2K = 8 micro-batches"):
        dualpipev(4, 7)


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 6), st.integers(0, 6), st.integers(1, 3), st.integers(1, 3), st.integers(0, 2))
def test_dualpipev_makespan_is_the_dualpipe_readme_row(k, extra, forward, weight, overlap_extra):
    """DualPipe's README, DualPipeV row: the makespan exceeds the busiest rank's work by
    (PP/2 - 1)(F&B + B - 3W), PP = 2K chunks, B a whole backward. Written for F = the input gradient
    >= W and an F&B at least F + the whole backward (the simulator's messages take no time: a cheaper
    F&B would wait on its inputs, which the README's count leaves out)."""
    m, weight = 2 * k + extra, min(weight, forward)
    whole_backward = forward + weight  # input gradient B = F, then W
    overlap = forward + whole_backward + overlap_extra
    cost = {"F": forward, "B": forward, "W": weight, "BW": whole_backward, "F&B": overlap}
    schedule = dualpipev(k, m)
    # a chunk's costs; simulate takes a stage's, two chunks
    timeline = simulate(schedule, 2 * forward, 2 * forward, 2 * weight, placement="v",
                        overlap_cost=2 * overlap)
    busiest = max(sum(cost[action.op] for action in actions) for actions in schedule)
    assert timeline.makespan - busiest == (k - 1) * (overlap + whole_backward - 3 * weight)


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 6), st.integers(0, 8))
def test_dualpipev_holds_2k_plus_1_chunk_microbatches(k, extra):
    # the DualPipe README's PP + 1 with PP = 2K chunks: one more than ZB-V, the F&B's forward held
    # while its backward's micro-batch is still in flight
    assert peak_inflight(dualpipev(k, 2 * k + extra)) == [2 * k + 1] * k


def test_dualpipev_f_and_b_waits_for_both_inputs():
    step = Action("F&B", 3, 0, Action("BW", 1, 1))  # rank 1 of 2: F3 through virtual stage 1, BW1 of 2
    assert dependencies(1, step, 2, 2, "v") == [(0, F(3, 0)), (1, F(1, 1)), (0, B(1, 1))]


@pytest.mark.parametrize("extra, expected", [
    ([], 3), (["--backward-cost", "2", "--weight-cost", "1/2"], 7 / 2), (["--overlap-cost", "5/2"], 5 / 2)])
def test_cli_json_reports_the_f_and_b_cost_it_simulated(capsys, extra, expected):
    """overlap_cost: a stage's F&B, F + B + W unless --overlap-cost says otherwise. With it (K = 2,
    M = 4, F = B = W = 1 a stage), the makespan is the busiest rank's work, 6M stage units less what
    its 3 F&B steps gain, plus the DualPipe README's (K-1)(F&B + B - 3W), B the whole backward (2),
    both halved: a chunk is half a stage."""
    argv = ["--stages", "2", "--microbatches", "4", "--schedule", "dualpipev", "--json", *extra]
    assert schedule_main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["overlap_cost"] == expected
    if extra[:1] == ["--overlap-cost"]:  # 3 F&B steps on rank 0 (DualPipeV's order above), each 1/2 cheaper
        busiest = (6 * 4 - 3 * (3 - expected)) / 2
        assert report["makespan"] == busiest + (2 - 1) * (expected + 2 - 3 * 1) / 2


def test_cli_json_reports_no_overlap_cost_without_f_and_b_steps(capsys):
    assert schedule_main(["--stages", "2", "--microbatches", "4", "--schedule", "zb-v", "--json"]) == 0
    assert "overlap_cost" not in json.loads(capsys.readouterr().out)


def test_cli_refuses_dualpipev_with_few_microbatches(capsys):
    assert schedule_main(["--stages", "4", "--microbatches", "7", "--schedule", "dualpipev"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--schedule dualpipev needs --microbatches >= 2 x --stages = 8" in err[0]
