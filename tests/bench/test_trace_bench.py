"""`bench trace` (minipar_lab/bench/trace.py): in each job the trace listens on every other step, so a
traced step records events and its plain neighbour none; the trace changes no number of the training;
the cost is the median over the pairs of neighbouring steps of traced time / plain time, minus 1; bad
input is one line, exit 2, before any job. Times are not asserted: the figure comes from running it."""

import subprocess
import sys

import numpy as np
import pytest

from minipar.trainer.launch import run_train
from minipar_lab.bench import trace

TINY = ["--n-layer", "2", "--d-model", "16", "--n-head", "2", "--seq-len", "8", "--batch-size", "4",
        "--pp", "2", "--microbatches", "2"]


def step(traced: bool, seconds: float) -> dict:
    return {"traced": traced, "time_s": seconds}


def test_pairs_are_neighbouring_steps_after_the_warm_up_and_the_ratio_is_traced_over_plain():
    steps = [step(True, 9.0), step(False, 9.0),  # the warm-up: left out
             step(True, 3.0), step(False, 2.0), step(False, 4.0), step(True, 5.0), step(True, 1.0)]
    assert trace.pair_ratios(steps, warmup=2) == [1.5, 1.25]  # the odd step out has no neighbour


def test_a_job_traces_every_other_step_trains_as_without_a_trace_and_the_cost_is_the_median(tmp_path):
    figures = trace.trace_figures(2, TINY, repeats=2, steps=6, warmup=2, folder=tmp_path)
    first, second = figures["jobs"]
    assert [s["traced"] for s in first] == [True, False] * 3  # job 0 starts traced, job 1 plain
    assert [s["traced"] for s in second] == [False, True] * 3
    for job in (first, second):
        assert all((s["events"] > 0) == s["traced"] for s in job)  # a plain step records nothing
    plain = run_train(2, [*TINY, "--steps", "6"], tmp_path / "plain.jsonl")
    assert [s["loss"] for s in first] == [s["loss"] for s in second] == [r["loss"] for r in plain]
    ratios = trace.pair_ratios(first, 2) + trace.pair_ratios(second, 2)
    assert figures["pairs"] == 4 and figures["cost"] == float(np.median(ratios) - 1)
    for row, traced in zip(figures["ways"], (False, True)):  # each way's median, from its own steps
        seconds = [s["time_s"] for job in (first, second) for s in job[2:] if s["traced"] == traced]
        assert row["way"] == ("traced" if traced else "plain")
        assert row["step_ms"] == pytest.approx(1e3 * float(np.median(seconds)), rel=1e-12)


def test_bad_input_is_one_line_and_exit_2_before_any_job():
    for args in (["--steps", "3"], ["--repeats", "0"], ["--", "--pp", "2", "--trace", "x"],
                 ["--", "--pp", "3"]):
        done = subprocess.run([sys.executable, "-m", "minipar", "bench", "trace", *args],
                              capture_output=True, text=True, timeout=60)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and "error" in lines[0], (args, done.stderr)
