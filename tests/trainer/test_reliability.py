"""Reliability, seen from outside: every bad input, a rank that dies, a save killed midway, determinism.

Each test spawns `mpiexec -n 2 python -m minipar train ...` as a subprocess: exit codes, stderr, the
time a job takes to end and the files it leaves are what these tests are about. "Within seconds" is a
few start-ups at the machine's own pace (tests/pace.py): a job that waits in a collective would run to
MPIEXEC_TIMEOUT instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pace
import pytest

from minipar.trainer import loop as train
from minipar.trainer.config import TrainConfig
from minipar.trainer.validate import validate

MARKER = ".minipar-checkpoints"  # checkpoint/sharded.py: this folder is minipar's

MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--n-layer", "1", "--d-model", "16", "--n-head", "2", "--seq-len", "8", "--batch-size", "4"]
SMALL_CFG = TrainConfig(n_layer=1, d_model=16, n_head=2, seq_len=8, batch_size=4, quiet=True)


def minipar_train(*args, env=None, ranks=2):
    """Run `minipar train SMALL args` on `ranks` ranks: (result, seconds it took)."""
    command = [MPIEXEC, "-n", str(ranks), sys.executable, "-m", "minipar", "train", *SMALL, *args]
    environment = {**os.environ, "MPIEXEC_TIMEOUT": "90", **(env or {})}
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT, env=environment)
    return result, time.monotonic() - started


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """Paths the bad inputs point at: a file, a folder, a checkpoint at step 2 and damaged copies."""
    root = tmp_path_factory.mktemp("places")
    (root / "file").write_text("not a folder")
    saved = root / "saved"
    train.Trainer(SMALL_CFG.replace(dp=1, steps=2, save=str(saved)), _self()).run()
    for damage in ("corrupt", "truncated"):
        copy = root / damage
        copy.mkdir()
        for path in saved.rglob("*"):
            target = copy / path.relative_to(saved)
            target.mkdir() if path.is_dir() else target.write_bytes(path.read_bytes())
    shard = sorted(root.glob("corrupt/step-*/rank*.npz"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    manifest = root / "truncated" / "manifest.json"
    manifest.write_text(manifest.read_text()[:100])
    return {"dir": root, "file": root / "file", "missing": root / "missing", "saved": saved,
            "corrupt": root / "corrupt", "truncated": root / "truncated"}


def _self():
    from mpi4py import MPI

    return MPI.COMM_SELF


# Every bad input tried, with a piece of the one line that must name it (world size 2; the options come
# after SMALL, and a later option wins).
BAD_INPUTS = [
    (["--dp", "3"], "does not match the world size 2"),
    (["--tp", "2", "--n-head", "3", "--d-model", "48"], "--tp 2 does not divide --n-head 3"),
    (["--tp", "2", "--model", "mlp"], "needs --model gpt"),
    (["--pp", "2", "--model", "mlp", "--n-layer", "1"], "more stages than the model's 1 blocks"),
    (["--batch-size", "3"], "--batch-size 3 is not divisible by dp=2"),
    (["--microbatches", "3"], "is not divisible by --microbatches 3"),
    (["--d-model", "30", "--n-head", "4"], "--d-model 30 is not divisible by --n-head 4"),
    (["--zero", "4"], "argument --zero: invalid choice"),
    (["--precision", "fp4"], "argument --precision: invalid choice"),
    (["--pp", "2", "--schedule", "zb-h1", "--zero", "3"], "--schedule zb-h1 runs with --zero 0, 1 or 2"),
    (["--backend", "tpu"], "argument --backend: invalid choice"),
    (["--model", "bert"], "argument --model: invalid choice"),
    (["--schedule", "zigzag"], "argument --schedule: invalid choice"),
    (["--steps", "0"], "--steps must be a positive integer"),
    (["--steps", "ten"], "argument --steps: invalid int value"),
    (["--n-layer", "0"], "--n-layer must be a positive integer"),
    (["--lr", "-1"], "--lr must be positive"),
    (["--bucket-mb", "0"], "--bucket-mb must be positive"),
    (["--offload", "cpu", "--device-mem-mb", "-1"], "--device-mem-mb must be positive"),
    (["--device-mem-mb", "0.0001"], "--device-mem-mb 0.0001 is too small"),
    (["--chunk-mb", "0"], "--chunk-mb must be positive"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--log", "{missing}/log.jsonl"], "does not exist"),
    (["--log", "{dir}"], "is a directory, not a file"),
    (["--save", "{file}"], "is a file, not a directory"),
    (["--resume", "{missing}"], "no such directory"),
    (["--resume", "{dir}"], "no manifest.json"),
    (["--resume", "{truncated}"], "manifest.json is unreadable or truncated"),
    (["--resume", "{corrupt}"], "is corrupt: its SHA-256 differs"),
    (["--resume", "{saved}", "--n-layer", "2"], "a checkpoint of another model (n_layer 1 there, 2 here)"),
    (["--resume", "{saved}", "--optimizer", "sgd"], "optimizer 'adamw' there, 'sgd' here"),
    (["--resume", "{saved}", "--seed", "1"], "saved with --seed 0"),
    (["--resume", "{saved}", "--steps", "1"], "the checkpoint is at step 2, past --steps 1"),
]


@pytest.mark.parametrize("args, message", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_spawns_mpiexec_every_bad_input_ends_every_rank_with_one_line_and_exit_2(places, args, message):
    result, seconds = minipar_train(*[a.format(**places) for a in args])
    assert result.returncode == 2, result.stderr
    assert seconds < pace.allowance() and result.stdout == ""
    # one line per rank; mpiexec may interleave the ranks' bytes, so count the messages
    assert result.stderr.count("minipar train: error:") == 2, result.stderr
    assert result.stderr.count(message) == 2 and "Traceback" not in result.stderr, result.stderr


def test_spawns_mpiexec_a_refused_checkpoint_overwrites_nothing(places, tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text("the previous run's log\n")
    before = {path: path.read_bytes() for path in places["corrupt"].rglob("*") if path.is_file()}
    result, _ = minipar_train("--resume", str(places["corrupt"]), "--save", str(places["corrupt"]),
                              "--log", str(log), "--steps", "4")
    assert result.returncode == 2 and "is corrupt" in result.stderr
    assert log.read_text() == "the previous run's log\n"
    assert {path: path.read_bytes() for path in places["corrupt"].rglob("*") if path.is_file()} == before


def test_spawns_mpiexec_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    """Kill a save halfway through a rank's shard file, then halfway through the manifest: the
    checkpoint of step 2 stays whole and loadable, and resuming from it trains like one process."""
    directory, log = tmp_path / "checkpoint", tmp_path / "log.jsonl"
    common = ["--precision", "fp64", "--zero", "2", "--quiet"]
    result, _ = minipar_train("--steps", "2", "--save", str(directory), *common)
    assert result.returncode == 0, result.stderr
    saved = {path: path.read_bytes() for path in directory.rglob("*") if path.is_file()}
    cfg = SMALL_CFG.replace(precision="fp64", steps=4, resume=str(directory))
    for fault, phase in [("rank:1,save:shard", "shard"), ("rank:0,save:manifest", "manifest")]:
        result, seconds = minipar_train("--steps", "4", "--resume", str(directory), "--save", str(directory),
                                        *common, env={"MINIPAR_FAULT": fault})
        assert result.returncode != 0 and seconds < pace.allowance()
        assert result.stderr.count("Traceback") == 1 and f"while saving its {phase}" in result.stderr
        assert all(path.read_bytes() == data for path, data in saved.items())  # the old checkpoint, untouched
        assert validate(cfg, 2) == []  # ... and still accepted
    result, _ = minipar_train("--steps", "4", "--resume", str(directory), "--save", str(directory),
                              "--log", str(log), *common)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 3]
    losses, _ = train.reference_run(cfg.replace(resume=None))
    np.testing.assert_allclose([r["loss"] for r in records], losses[2:], rtol=1e-9)
    # the debris is gone
    assert sorted(p.name for p in directory.iterdir()) == [MARKER, "manifest.json", "step-000004"]


@pytest.mark.parametrize("layout, rank", [(["--dp", "2"], 1), (["--pp", "2"], 0), (["--pp", "2"], 1),
                                          (["--tp", "2"], 1), (["--dp", "2", "--zero", "3"], 0)])
def test_spawns_mpiexec_an_injected_fault_ends_the_job_within_seconds(layout, rank):
    """A rank that raises takes the job down: its traceback once, a non-zero exit, no rank left
    waiting (a pipeline neighbour would otherwise wait forever in a receive)."""
    fault = {"MINIPAR_FAULT": f"rank:{rank},step:2"}
    result, seconds = minipar_train("--steps", "4", "--quiet", *layout, env=fault)
    assert result.returncode != 0 and seconds < pace.allowance(), result.stderr
    assert result.stderr.count("Traceback") == 1, result.stderr
    assert f"RuntimeError: injected fault on rank {rank} at step 2" in result.stderr


def is_timing(key: str) -> bool:
    """The log's measured times: seconds (`time_s`, the pipeline's `busy_s`...), rates (`tokens_per_s`)
    and what is computed from them (`bubble_measured`)."""
    return key.endswith("_s") or key.endswith("_measured")


def without_timings(record):
    if isinstance(record, dict):
        return {key: without_timings(value) for key, value in record.items() if not is_timing(key)}
    return record


@pytest.mark.parametrize("layout", [["--dp", "2", "--zero", "2"], ["--pp", "2", "--microbatches", "2"]])
def test_spawns_mpiexec_two_runs_of_one_command_log_the_same_bytes(tmp_path, layout):
    logs = []
    for run in range(2):
        log = tmp_path / f"run{run}.jsonl"
        result, _ = minipar_train("--steps", "3", "--quiet", "--log", str(log), *layout)
        assert result.returncode == 0, result.stderr
        logs.append([without_timings(json.loads(line)) for line in log.read_text().splitlines()])
    assert len(logs[0]) == 3 and json.dumps(logs[0]) == json.dumps(logs[1])
