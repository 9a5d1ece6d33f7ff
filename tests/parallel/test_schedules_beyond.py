"""Interleaved 1F1B and ZB-H1 as data: bubble, makespan, memory and messages against hand-derived formulas.

Every expected value is written from the papers' arithmetic (Narayanan et al. 2021; Qi et al. 2023),
never read from the simulator: with unit costs each chunk of an interleaved rank costs 1/V, and
ZB-H1's last stage cannot start before K-1 and then has 3M units of work (the lower bound 3M + K - 1).
"""

import json
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipar.parallel.schedules import (
    Action,
    bubble_fraction,
    build_schedule,
    dependencies,
    interleaved,
    one_f_one_b,
    p2p_messages,
    peak_inflight,
    render,
    simulate,
    zb_h1,
)
from minipar.trainer.commands import schedule_main

stages = st.integers(2, 8)
chunks = st.integers(2, 4)
rounds = st.integers(1, 4)  # M = rounds * K: interleaving needs a multiple of K
costs = st.sampled_from([Fraction(1), Fraction(2), Fraction(1, 2), Fraction(3, 2)])


def F(i, c=None):
    return Action("F", i, c)


def B(i, c=None):
    return Action("B", i, c)


def W(i):
    return Action("W", i)


@settings(max_examples=40, deadline=None)
@given(stages, chunks, rounds, costs, costs)
def test_interleaved_bubble_shrinks_by_v(k, v, r, forward_cost, backward_cost):
    m = r * k
    timeline = simulate(interleaved(k, m, v), forward_cost, backward_cost)
    assert bubble_fraction(timeline) == Fraction(k - 1, v * m + k - 1)
    # M stages' worth of work, plus a fill and drain of K-1 chunks costing 1/V of a stage each
    assert timeline.makespan == (m + Fraction(k - 1, v)) * (forward_cost + backward_cost)


@settings(max_examples=30, deadline=None)
@given(stages, chunks, st.integers(2, 4))
def test_interleaved_first_rank_holds_k_plus_k_minus_1_over_v(k, v, r):
    peaks = peak_inflight(interleaved(k, r * k, v))  # (micro-batch, chunk) pairs, each 1/V of a stage's
    assert peaks[0] == v * k + k - 1
    assert Fraction(peaks[0], v) == k + Fraction(k - 1, v)
    assert peaks == [v * k + k - 1 - 2 * s for s in range(k)]  # 2 fewer warm-up chunks per rank down


@settings(max_examples=30, deadline=None)
@given(stages, chunks, rounds)
def test_interleaving_multiplies_messages_by_kv_minus_1_over_k_minus_1(k, v, r):
    m = r * k
    # one activation forward and one gradient back across each of the K-1 (or KV-1) boundaries
    assert p2p_messages(one_f_one_b(k, m)) == 2 * m * (k - 1)
    assert p2p_messages(interleaved(k, m, v)) == 2 * m * (k * v - 1)
    assert Fraction(p2p_messages(interleaved(k, m, v)), p2p_messages(one_f_one_b(k, m))) == \
        Fraction(k * v - 1, k - 1)


def test_interleaved_megatron_order_k2_m2_v2():
    assert interleaved(2, 2, 2) == [
        # rank 0: 2(K-1) + (V-1)K = 4 warm-up forwards = all of them
        [F(0, 0), F(1, 0), F(0, 1), F(1, 1), B(0, 1), B(1, 1), B(0, 0), B(1, 0)],
        # rank 1: 2 warm-up forwards, then one forward one backward, then the drain
        [F(0, 0), F(1, 0), F(0, 1), B(0, 1), F(1, 1), B(1, 1), B(0, 0), B(1, 0)],
    ]


def test_dependencies_cross_chunks_and_split_backward():
    # virtual stage c*K + s: chunk 1 on rank 0 follows chunk 0 on the last rank, and back
    assert dependencies(0, F(3, 1), 4, 2) == [(3, F(3, 0))]
    assert dependencies(0, F(3, 0), 4, 2) == []
    assert dependencies(3, B(3, 0), 4, 2) == [(3, F(3, 0)), (0, B(3, 1))]
    assert dependencies(3, B(3, 1), 4, 2) == [(3, F(3, 1))]  # the last virtual stage owns the loss
    assert dependencies(1, W(3), 4) == [(1, B(3))]  # W reads the output gradient B received


def test_zb_h1_lists_k2_m3():
    assert zb_h1(2, 3) == [
        [F(0), F(1), B(0), W(0), F(2), B(1), W(1), B(2), W(2)],  # stage 0: no W waits
        [F(0), B(0), F(1), B(1), W(0), F(2), B(2), W(1), W(2)],  # stage 1: one W waits for the drain
    ]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(1, 24))
def test_zb_h1_reaches_the_lower_bound(k, m):
    timeline = simulate(zb_h1(k, m))  # F = B = W = 1
    if m >= k:
        # the last stage receives its first input at K-1, then has 3M units of work: nothing is faster
        assert timeline.makespan == 3 * m + k - 1
        assert bubble_fraction(timeline) == Fraction(k - 1, 3 * m + k - 1)
    else:  # too few micro-batches to hide the drain behind W steps
        assert timeline.makespan == 2 * (m + k) - 1


@settings(max_examples=30, deadline=None)
@given(stages, st.integers(1, 24))
def test_zb_h1_has_a_third_of_1f1bs_bubble(k, m):
    m = max(m, k)
    zb = bubble_fraction(simulate(zb_h1(k, m)))
    one_f_one_b_bubble = bubble_fraction(simulate(one_f_one_b(k, m), backward_cost=2))  # B and W together
    assert one_f_one_b_bubble == Fraction(3 * (k - 1), 3 * m + 3 * (k - 1))
    assert zb == Fraction(k - 1, 3 * m + k - 1) < one_f_one_b_bubble


@settings(max_examples=30, deadline=None)
@given(stages, st.integers(1, 24))
def test_zb_h1_memory_is_1f1bs_peak(k, m):
    m = max(m, k)
    peaks = peak_inflight(zb_h1(k, m))  # from F to the end of W
    assert max(peaks) == max(peak_inflight(one_f_one_b(k, m))) == k
    assert peaks == [k] * k  # stage s holds K-s like 1F1B, plus the s weight gradients that wait


def _actions_in_order(row):
    previous = [None] + row[:-1]
    return [cell for cell, before in zip(row, previous) if cell is not None and cell != before]


@settings(max_examples=30, deadline=None)
@given(stages, st.integers(1, 3), st.sampled_from(["interleaved", "zb-h1"]), costs, costs)
def test_timeline_runs_each_list_in_order_after_its_inputs(k, r, name, backward_cost, weight_cost):
    v = 2 if name == "interleaved" else 1
    schedule = build_schedule(name, k, r * k, v)
    timeline = simulate(schedule, backward_cost=backward_cost, weight_cost=weight_cost)
    slots = {"F": Fraction(1, v) / timeline.slot, "B": backward_cost / v / timeline.slot,
             "W": weight_cost / timeline.slot}
    for stage, row in enumerate(timeline.grid):
        assert _actions_in_order(row) == schedule[stage]
        for action in schedule[stage]:
            begin = timeline.start[(stage, action)]
            assert row[begin:begin + int(slots[action.op])] == [action] * int(slots[action.op])
            for other_stage, needed in dependencies(stage, action, k, v):
                assert timeline.start[(other_stage, needed)] + slots[needed.op] <= begin


def test_render_draws_chunks_and_the_split():
    assert render(simulate(zb_h1(2, 2))) == (
        "stage 1 |  . F0 B0 F1 B1 W0 W1\n"
        "stage 0 | F0 F1  . B0 W0 B1 W1"
    )
    # columns of 1/2: rank 1 waits for F0.1 until rank 0 has run it, then never idles until B1.0,
    # which waits on rank 0's B1.1; the step is (M + (K-1)/V)(F+B) = 5 units = 10 columns
    assert render(simulate(interleaved(2, 2, 2))) == (
        "stage 1 |    . F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 B0.0 B1.0    .\n"
        "stage 0 | F0.0 F1.0 F0.1 F1.1    . B0.1    . B1.1 B0.0 B1.0")


def test_schedule_refuses_bad_combinations():
    with pytest.raises(ValueError, match="multiple of the stages"):
        build_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="at least 2 virtual stages"):
        build_schedule("interleaved", 4, 8, 1)
    with pytest.raises(ValueError, match="need the interleaved schedule"):
        build_schedule("1f1b", 4, 8, 2)


def test_cli_json_interleaved(capsys):
    argv = ["--stages", "4", "--microbatches", "8", "--schedule", "interleaved", "--virtual-stages", "2",
            "--json"]
    assert schedule_main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bubble_fraction_exact"] == "3/19"  # (K-1)/(VM+K-1)
    assert report["virtual_stages"] == 2 and report["slot"] == 0.5
    assert report["makespan"] == (8 + Fraction(3, 2)) * 2  # (M + (K-1)/V)(F+B)
    assert report["peak_inflight"][0] == 11  # VK + K - 1 pairs
    assert report["p2p_messages"] == 2 * 8 * 7
    assert all(len(row) == 38 for row in report["timeline"])  # makespan / slot columns
    assert report["timeline"][0][:2] == ["F0.0", "F1.0"]


def test_cli_json_zb_h1_fractional_costs(capsys):
    argv = ["--stages", "3", "--microbatches", "4", "--schedule", "zb-h1", "--json"]
    assert schedule_main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["weight_cost"] == 1 and report["makespan"] == 3 * 4 + 3 - 1
    assert report["bubble_fraction_exact"] == "1/7"  # (K-1)/(3M+K-1) = 2/14
    assert report["peak_inflight"] == [3, 3, 3]
    argv = ["--stages", "2", "--microbatches", "2", "--schedule", "zb-h1", "--backward-cost", "1.5",
            "--weight-cost", "1/2", "--json"]
    assert schedule_main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["slot"] == 0.5 and report["backward_cost"] == 1.5 and report["weight_cost"] == 0.5
    # stage 1 runs F0 B0 F1 B1 from 1 to 1 + 1 + 1.5 + 1 + 1.5 = 6; stage 0 then runs B1 and W1
    assert report["makespan"] == 6 + 1.5 + 0.5


@pytest.mark.parametrize("argv, message", [
    (["--schedule", "interleaved", "--virtual-stages", "1"], "needs --virtual-stages of at least 2"),
    (["--schedule", "interleaved"], "needs --virtual-stages of at least 2"),
    (["--schedule", "1f1b", "--virtual-stages", "2"], "--virtual-stages 2 needs --schedule interleaved"),
    (["--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "6"], "multiple of --stages 4"),
    (["--schedule", "1f1b", "--weight-cost", "1"], "--weight-cost needs --schedule zb-h1"),
    (["--schedule", "zb-h1", "--weight-cost", "0"], "must be positive"),
    (["--schedule", "zb-h1", "--weight-cost", "x"], "invalid number"),
    (["--schedule", "zb-h1", "--backward-cost", "1/0"], "invalid number"),
    (["--schedule", "zb-h1", "--backward-cost", "0.001"], "denominator"),
])
def test_cli_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    base = {"--stages": "4", "--microbatches": "8"}
    for flag, value in base.items():
        if flag not in argv:
            argv = [flag, value, *argv]
    assert schedule_main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("minipar schedule: error: ")
    assert captured.err.count("\n") == 1 and message in captured.err


def test_zb_h1_with_full_recomputation_is_refused_in_one_line():
    # Found when the branches met: a fully recomputed block is one operation in backward, so B would
    # compute its weight gradients too and W would add them again (weights off by a relative 7e-2).
    from minipar.trainer.config import TrainConfig
    from minipar.trainer.validate import validate

    cfg = TrainConfig(pp=2, microbatches=4, schedule="zb-h1", recompute="full")
    assert validate(cfg, world_size=2) == [
        "--schedule zb-h1 with --recompute full: a recomputed block's backward runs as one operation, so "
        "its weight gradients cannot wait for W; use --recompute selective or none"]
    assert validate(cfg.replace(recompute="selective"), world_size=2) == []
