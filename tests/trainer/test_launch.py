"""Launching a job of several ranks from Python (trainer/launch.py): the mpiexec beside this Python, a
real two-rank run's log read back, and a failing run's error raised with its command."""

import sys
from pathlib import Path

import pytest

from minipar.trainer import launch


def test_mpiexec_is_the_one_next_to_this_python():
    assert Path(launch.mpiexec()) == Path(sys.executable).parent / "mpiexec"


def test_run_train_returns_rank_0s_records_of_a_real_two_rank_run(tmp_path):
    small = ["--n-layer", "1", "--d-model", "16", "--n-head", "2", "--seq-len", "8", "--batch-size", "4"]
    records = launch.run_train(2, [*small, "--dp", "2", "--steps", "3"], tmp_path / "log.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["comm"]["sent_bytes"] > 0 and r["time_s"] > 0 for r in records)  # dp = 2 sent gradients


def test_a_log_is_read_one_record_a_line_and_a_missing_one_is_named(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 0, "loss": 2.5}\n\n{"step": 1, "loss": null}\n')
    assert launch.read_log(log) == [{"step": 0, "loss": 2.5}, {"step": 1, "loss": None}]
    with pytest.raises(FileNotFoundError, match="no log file .*missing.jsonl"):
        launch.read_log(tmp_path / "missing.jsonl")


def test_a_failing_run_raises_with_its_command_and_error():
    with pytest.raises(RuntimeError, match="--batch-size 7 is not divisible by dp=2"):
        launch.run_mpi(2, ["-m", "minipar", "train", "--batch-size", "7"])
