"""Training lowers the loss; the train log's schema; the CLI's errors; a failing rank aborts the job.

The CLI tests run `python -m minipar ...` (and, for the two marked "spawns mpiexec", a 2-rank
`mpiexec` job) as subprocesses, since exit codes and stderr are what they are about.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pace
import pytest
from mpi4py import MPI

from minipar.trainer import loop as train
from minipar.trainer.config import TrainConfig

PYTHON = sys.executable
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--n-layer", "1", "--d-model", "16", "--n-head", "2", "--seq-len", "8", "--batch-size", "4"]


def minipar(*args, ranks=None, env=None, timeout=60):
    command = [PYTHON, "-m", "minipar", *args]
    if ranks:
        command = [MPIEXEC, "-n", str(ranks), *command]
    environment = {**os.environ, "MPIEXEC_TIMEOUT": str(timeout), **(env or {})}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout + 30, cwd=ROOT,
                          env=environment)


# ---- training lowers the loss ---------------------------------------------------------------------


@pytest.mark.parametrize("model, options, target_ratio", [
    ("gpt", dict(n_layer=2, d_model=16, n_head=2, seq_len=16, batch_size=16), 0.93),
    ("mlp", dict(n_layer=3, d_model=32, batch_size=32), 0.5),
])
def test_training_lowers_the_loss(model, options, target_ratio):
    cfg = TrainConfig(model=model, steps=30, lr=1e-2, precision="fp64", quiet=True, **options)
    losses = [r["loss"] for r in train.train(cfg, MPI.COMM_SELF)]
    assert len(losses) == 30 and all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < target_ratio * losses[0], losses


# ---- the CLI ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, names", [
    (["--steps", "-1"], "--steps"),
    (["--bogus"], "--bogus"),
    (["--model", "nope"], "nope"),
    (["--dp", "2"], "world size"),  # dp*tp*pp must match the one process we run on
    (["--d-model", "30", "--n-head", "4"], "--d-model"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, names):
    result = minipar("train", *SMALL, *args)  # later options win, so the bad one comes last
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("minipar train: error:") and names in lines[0], lines


def test_unknown_command_is_one_line_and_exit_code_2():
    result = minipar("nope")
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1


def test_the_log_follows_the_documented_schema(tmp_path):
    log = tmp_path / "f.jsonl"
    result = minipar("train", "--steps", "2", "--log", str(log), "--quiet", *SMALL)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert isinstance(r["loss"], float) and np.isfinite(r["loss"])
        assert isinstance(r["tokens_per_s"], float) and r["tokens_per_s"] > 0
        for key in ("params", "grads", "optimizer", "activations_peak", "device_peak"):
            assert isinstance(r["mem"][key], int) and r["mem"][key] >= 0, key
        assert r["mem"]["params"] > 0 and r["mem"]["activations_peak"] > 0
        assert r["mem"]["optimizer"] == 2 * r["mem"]["params"]  # AdamW: two moments per parameter
        assert r["comm"]["sent_bytes"] == 0 and r["comm"]["by_op"] == {}  # one process sends nothing


# ---- multi-rank jobs (each spawns mpiexec -n 2) ------------------------------------------------------


def test_spawns_mpiexec_bad_input_ends_every_rank_with_exit_code_2():
    result = minipar("train", "--tp", "3", *SMALL, ranks=2)
    assert result.returncode == 2, result.stderr
    # one line per rank; mpiexec may interleave the two ranks' bytes, so count the messages instead
    assert result.stderr.count("minipar train: error:") == 2, result.stderr
    assert result.stderr.count("does not match the world size 2") == 2 and "Traceback" not in result.stderr


def test_spawns_mpiexec_a_rank_that_raises_ends_the_whole_job():
    started = time.monotonic()
    fault = {"MINIPAR_FAULT": "rank:1,step:1"}
    result = minipar("train", "--steps", "5", "--quiet", *SMALL, ranks=2, env=fault, timeout=60)
    seconds = time.monotonic() - started  # within a few start-ups at this machine's pace (tests/pace.py)
    assert seconds < pace.allowance(), "the job should abort within seconds, not wait in a collective"
    assert result.returncode != 0
    assert result.stderr.count("Traceback") == 1, result.stderr
    assert "RuntimeError: injected fault on rank 1 at step 1" in result.stderr
