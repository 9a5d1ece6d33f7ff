"""Pipeline schedules: the simulated bubble matches (K-1)/(M+K-1), in-flight counts, chart and CLI."""

import json
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipar.parallel.schedules import (
    Action,
    bubble_fraction,
    build_schedule,
    check_schedule,
    dependencies,
    gpipe,
    naive,
    one_f_one_b,
    peak_inflight,
    render,
    simulate,
)
from minipar.trainer.commands import schedule_main

stages = st.integers(1, 12)
microbatches = st.integers(1, 40)
costs = st.integers(1, 3)


@settings(max_examples=200, deadline=None)
@given(stages, microbatches, st.sampled_from(["gpipe", "1f1b"]), costs, costs)
def test_simulated_bubble_is_the_formula(k, m, name, forward_cost, backward_cost):
    timeline = simulate(build_schedule(name, k, m), forward_cost, backward_cost)
    assert bubble_fraction(timeline) == Fraction(k - 1, m + k - 1)
    assert timeline.makespan == (m + k - 1) * (forward_cost + backward_cost)


def test_a_stage_missing_an_action_is_told_every_micro_batch_it_must_run():
    """The count of micro-batches comes from the stage that lists the most actions: a first stage that
    forgot its last backward must hear 'micro-batches 0..2', not '0..1' (or '0..-1' with one)."""
    table = build_schedule("gpipe", 2, 3)
    assert check_schedule(table) == 3
    with pytest.raises(ValueError, match=r"^stage 0 must run F, B of micro-batches 0\.\.2 once$"):
        check_schedule([table[0][:-1], table[1]])
    with pytest.raises(ValueError, match=r"^stage 0 must run F, B of micro-batches 0\.\.0 once$"):
        check_schedule([build_schedule("gpipe", 2, 1)[0][:-1], build_schedule("gpipe", 2, 1)[1]])


def test_gpipe_paper_setting_k4_m16():
    for name in ("gpipe", "1f1b"):
        assert bubble_fraction(simulate(build_schedule(name, 4, 16))) == Fraction(3, 19)


@given(stages, microbatches)
def test_naive_is_one_microbatch_whatever_m(k, m):
    assert naive(k, m) == gpipe(k, 1)
    assert bubble_fraction(simulate(naive(k, m))) == Fraction(k - 1, k)
    assert peak_inflight(naive(k, m)) == [1] * k


@given(stages, microbatches)
def test_gpipe_holds_m_microbatches_1f1b_at_most_k(k, m):
    assert peak_inflight(gpipe(k, m)) == [m] * k
    peaks = peak_inflight(one_f_one_b(k, m))
    assert peaks == [min(k - stage, m) for stage in range(k)]
    assert max(peaks) <= k


def _actions_in_order(row):
    """The actions a stage's row of the grid runs, left to right, each run of equal cells once."""
    previous = [None] + row[:-1]
    return [cell for cell, before in zip(row, previous) if cell is not None and cell != before]


@settings(max_examples=100, deadline=None)
@given(stages, st.integers(1, 12), st.sampled_from(["naive", "gpipe", "1f1b"]), costs)
def test_timeline_runs_each_list_in_order_after_its_inputs(k, m, name, backward_cost):
    schedule = build_schedule(name, k, m)
    timeline = simulate(schedule, backward_cost=backward_cost)
    cost = {"F": 1, "B": backward_cost}
    for stage, row in enumerate(timeline.grid):
        assert _actions_in_order(row) == schedule[stage]
        for action in schedule[stage]:
            begin = timeline.start[(stage, action)]
            assert row[begin:begin + cost[action.op]] == [action] * cost[action.op]
            for other_stage, needed in dependencies(stage, action, k):
                assert timeline.start[(other_stage, needed)] + cost[needed.op] <= begin


def test_dependencies_follow_the_data():
    assert dependencies(0, Action("F", 3), 4) == []
    assert dependencies(2, Action("F", 3), 4) == [(1, Action("F", 3))]
    assert dependencies(3, Action("B", 3), 4) == [(3, Action("F", 3))]
    assert dependencies(1, Action("B", 3), 4) == [(1, Action("F", 3)), (2, Action("B", 3))]


def test_a_schedule_that_waits_on_itself_is_reported_not_hung():
    # Stage 0 wants B0 before sending F1; the last stage wants F1 before it runs B0.
    schedule = [
        [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
        [Action("F", 0), Action("F", 1), Action("B", 1), Action("B", 0)],
    ]
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(schedule)


def test_a_schedule_missing_an_action_is_rejected():
    with pytest.raises(ValueError, match="stage 1"):
        simulate([[Action("F", 0), Action("B", 0)], [Action("F", 0), Action("F", 0)]])
    with pytest.raises(ValueError, match="unknown schedule"):
        build_schedule("zigzag", 2, 2)
    with pytest.raises(ValueError, match="at least 1"):
        build_schedule("gpipe", 0, 2)


def test_render_draws_the_gpipe_figure():
    chart = render(simulate(gpipe(2, 2)))
    assert chart == (
        "stage 1 |  . F0 F1 B1 B0  .\n"
        "stage 0 | F0 F1  .  . B1 B0"
    )


@settings(max_examples=30, deadline=None)
@given(stages, microbatches, st.sampled_from(["naive", "gpipe", "1f1b"]), costs)
def test_render_shows_every_slot_of_the_grid(k, m, name, backward_cost):
    timeline = simulate(build_schedule(name, k, m), backward_cost=backward_cost)
    lines = render(timeline).splitlines()
    labels = [f"stage {stage:>{len(str(k - 1))}}" for stage in reversed(range(k))]
    assert [line.split(" | ")[0] for line in lines] == labels
    cells = [line.split(" | ")[1].split() for line in reversed(lines)]
    assert cells == [[str(cell) if cell else "." for cell in row] for row in timeline.grid]
    assert len({len(line) for line in lines}) == 1  # fixed cell width: columns line up


def test_cli_chart(capsys):
    assert schedule_main(["--stages", "4", "--microbatches", "16", "--schedule", "gpipe"]) == 0
    out = capsys.readouterr().out
    assert "bubble fraction: 3/19 = 0.158" in out
    assert "stage 0: 16, stage 1: 16, stage 2: 16, stage 3: 16" in out
    assert out.count("stage 3 |") == 1


def test_cli_json_shape(capsys):
    argv = ["--stages", "4", "--microbatches", "8", "--schedule", "1f1b", "--json", "--backward-cost", "2"]
    assert schedule_main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bubble_fraction"] == pytest.approx(3 / 11)
    assert report["bubble_fraction_exact"] == "3/11"
    assert report["peak_inflight"] == [4, 3, 2, 1]
    assert len(report["timeline"]) == 4
    assert all(len(row) == report["makespan"] == 33 for row in report["timeline"])
    assert report["timeline"][3][3:6] == ["F0", "B0", "B0"]
    assert report["timeline"][0][0] == "F0" and report["timeline"][3][0] is None


def test_cli_naive_ignores_microbatches(capsys):
    assert schedule_main(["--stages", "3", "--microbatches", "8", "--schedule", "naive", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["microbatches"] == 1 and report["bubble_fraction_exact"] == "2/3"


@pytest.mark.parametrize("argv", [
    ["--stages", "0", "--microbatches", "4", "--schedule", "gpipe"],
    ["--stages", "4", "--microbatches", "0", "--schedule", "gpipe"],
    ["--stages", "4", "--microbatches", "-3", "--schedule", "1f1b"],
    ["--stages", "4", "--microbatches", "4", "--schedule", "zigzag"],
    ["--stages", "4", "--microbatches", "4", "--schedule", "1f1b", "--backward-cost", "0"],
    ["--stages", "four", "--microbatches", "4", "--schedule", "1f1b"],
    ["--stages", "4", "--schedule", "1f1b"],
    # sizes bounded before anything is allocated or simulated (issue 40)
    ["--stages", "4", "--microbatches", "100000000", "--schedule", "1f1b"],
    ["--stages", "400", "--microbatches", "4", "--schedule", "gpipe"],
    ["--stages", "4", "--microbatches", "4", "--schedule", "1f1b", "--backward-cost", "1e8"],
    ["--stages", "4", "--microbatches", "4", "--schedule", "zb-h1", "--weight-cost", "1e400"],
    ["--stages", "4", "--microbatches", "800", "--schedule", "zb-h1", "--weight-cost", "999.99"],
])
def test_cli_bad_input_is_one_line_and_exit_2(argv, capsys):
    assert schedule_main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("minipar schedule: error: ")
    assert captured.err.count("\n") == 1
