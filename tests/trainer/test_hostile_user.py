"""What a hostile user broke, each fixed: ranks that disagree, numbers out of range, sizes too large,
empty paths, mixed dtypes, a log that cannot be written, two jobs on one folder, a full offload disk,
Ctrl-C; and the watchdog, and a job killed between periodic checkpoints.

Serial checks call `validate` or a one-process Trainer; the rest spawn `mpiexec -n 2 python -m minipar
train` (test_reliability.py's helper), since exit codes, stderr and the time a job takes are the point.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pace
import pytest
from mpi4py import MPI
from test_reliability import MPIEXEC, ROOT, SMALL, SMALL_CFG, minipar_train

from minipar.core import functional as F
from minipar.core.autograd import Tensor
from minipar.distributed import watchdog
from minipar.memory import offload
from minipar.trainer import loop as train
from minipar.trainer import validate as validation
from minipar.trainer.config import TrainConfig
from minipar.trainer.validate import validate


def one_process(cfg: TrainConfig) -> train.Trainer:
    return train.Trainer(cfg.resolved(1), MPI.COMM_SELF)


# ---- 1. ranks that disagree about their input: every rank exits 2, none waits -------------------------


def test_spawns_mpiexec_ranks_that_disagree_about_their_input_all_exit_2():
    """Rank 1 alone is given a log in a missing folder (as a path on no shared file system would be):
    rank 0 used to train on and wait for rank 1 in its first collective until the launcher's timeout."""
    base = [sys.executable, "-m", "minipar", "train", *SMALL, "--steps", "2"]
    command = [MPIEXEC, "-n", "1", *base, ":", "-n", "1", *base, "--log", "/missing/folder/log.jsonl"]
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT,
                            env={**os.environ, "MPIEXEC_TIMEOUT": "20"})
    assert result.returncode == 2 and time.monotonic() - started < pace.allowance(), result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and all("the folder /missing/folder does not exist" in line for line in lines)
    assert sum("(on rank 1)" in line for line in lines) == 1 and result.stdout == ""


# ---- 4 and 6. numbers, sizes and paths: one line each -------------------------------------------------


BAD_VALUES = [
    (dict(lr=math.nan), "--lr must be a finite number, got nan"),
    (dict(lr=math.inf), "--lr must be a finite number, got inf"),
    (dict(weight_decay=-1.0), "--weight-decay must be at least 0, got -1.0"),
    (dict(weight_decay=math.nan), "--weight-decay must be a finite number"),
    (dict(offload="cpu", device_mem_mb=math.nan), "--device-mem-mb must be a finite number"),
    (dict(seed=-1), "--seed must be a non-negative integer, got -1"),
    (dict(bucket_mb=math.inf), "--bucket-mb must be a finite number, got inf"),
    (dict(chunk_mb=math.nan), "--chunk-mb must be a finite number, got nan"),
    (dict(chunk_mb=1e9), "--chunk-mb 1e+09 is more than this machine's memory"),
    (dict(seq_len=10**8), "the model and batch need at least"),
    (dict(n_layer=10**8), "the model and batch need at least"),
    (dict(momentum=math.nan), "--momentum must be a finite number"),
    (dict(collective_timeout=0.0), "--collective-timeout must be positive"),
    (dict(save=""), "--save needs a path, got an empty string"),
    (dict(resume=""), "--resume needs a path, got an empty string"),
    (dict(log=" "), "--log needs a path, got an empty string"),
    (dict(save_every=2), "--save-every and --keep-last need --save DIR"),
    (dict(save="x", keep_last=0), "--keep-last must be a positive integer, got 0"),
    (dict(offload_dir="/tmp"), "--offload-dir /tmp needs --offload disk"),
]


@pytest.mark.parametrize("change, message", BAD_VALUES, ids=[m for _, m in BAD_VALUES])
def test_every_bad_number_size_or_path_is_one_line(change, message):
    errors = validate(SMALL_CFG.replace(**change), 1)
    assert len(errors) == 1 and message in errors[0], errors


def test_the_memory_estimate_names_what_it_needs():
    """n_layer 1e8 blocks of 12 d^2 parameters with d = 16, four fp32 copies: at least 1.2e12 bytes."""
    cfg = SMALL_CFG.replace(n_layer=10**8).resolved(1)
    assert validation.estimated_bytes(cfg) >= 4 * 4 * 12 * 16 * 16 * 10**8
    [error] = validate(cfg, 1)
    assert "--n-layer 100000000" in error and "GiB per rank" in error
    assert validate(SMALL_CFG, 1) == []  # the small runs the tests use stay far below it


def test_the_memory_estimate_counts_the_experts():
    """--model moe --d-model 512 --n-experts 100000: 4 blocks of 100000 experts of 8 d^2 weights each,
    four fp32 copies: about 13 TB, where the dense model's estimate is 0.2 GB."""
    cfg = SMALL_CFG.replace(model="moe", n_layer=4, d_model=512, n_head=4, n_experts=100000).resolved(1)
    assert validation.estimated_bytes(cfg) >= 4 * 4 * 4 * 100000 * 8 * 512 * 512
    [error] = validate(cfg, 1)
    assert "--d-model 512 --n-experts 100000" in error and "GiB per rank" in error, error
    assert validate(SMALL_CFG.replace(model="moe"), 1) == []


def test_moe_options_typed_without_model_moe_are_one_line_and_exit_2():
    """They have defaults, so what was typed is what counts: --n-experts 4 (the default) too."""
    from minipar.trainer.commands import _own_verdict
    for typed in (["--n-experts", "4"], ["--top-k=2"], ["--capacity-factor", "2"], ["--aux-loss-coef", "0"]):
        _, error, code = _own_verdict(["--steps", "1", *typed], 1, 0)
        flag = typed[0].split("=")[0]
        assert code == 2 and error == f"{flag} needs --model moe (the gpt model has no experts)", error
        _, error, code = _own_verdict(["--steps", "1", "--model", "mlp", *typed], 1, 0)
        assert error == f"{flag} needs --model moe (the mlp model has no experts)", error
        assert _own_verdict(["--steps", "1", "--model", "moe", *typed], 1, 0)[1:] == ("", None)
    assert _own_verdict(["--steps", "1"], 1, 0)[1:] == ("", None)  # left out: the defaults are fine


def test_spawns_mpiexec_a_huge_size_is_refused_at_once_not_run_for_hours():
    result, seconds = minipar_train("--n-layer", "100000000")
    assert result.returncode == 2 and seconds < pace.allowance()
    assert result.stderr.count("the model and batch need at least") == 2 and "Traceback" not in result.stderr


# ---- 5. the MLP computes in its own dtype; matrix products refuse two dtypes --------------------------


def test_matmul_and_linear_refuse_two_dtypes_naming_both():
    a, b = Tensor(np.ones((2, 3), np.float32)), Tensor(np.ones((3, 2), np.float64))
    with pytest.raises(TypeError, match="matmul: .* float32 and float64"):
        F.matmul(a, b)
    with pytest.raises(TypeError, match="linear: .* float64 and float32"):
        F.linear(Tensor(np.ones((2, 2))), Tensor(np.ones((2, 2), np.float32)))
    assert (a * Tensor(np.ones((2, 3)))).dtype == np.float64  # elementwise ops still promote


def test_an_fp32_mlp_holds_4_byte_gradients():
    trainer = one_process(TrainConfig(model="mlp", steps=1, batch_size=8, quiet=True))
    [record] = trainer.run()
    n_params = sum(p.size for p in trainer.engine.model.parameters())
    assert record["mem"]["grads"] == 4 * n_params and record["mem"]["params"] == 4 * n_params


def test_spawns_mpiexec_an_fp32_mlp_sends_4_bytes_per_gradient_and_pipelines(tmp_path):
    log = tmp_path / "log.jsonl"
    result, _ = minipar_train("--model", "mlp", "--dp", "2", "--fused", "--steps", "1", "--quiet", "--log",
                              str(log))  # --fused: AdamW's fused kernels used to meet float64 gradients
    assert result.returncode == 0, result.stderr
    n_params = sum(p.size for p in train.build.build_model(SMALL_CFG.replace(model="mlp"), None).parameters())
    [record] = [json.loads(line) for line in log.read_text().splitlines()]
    assert record["comm"]["by_op"]["all_reduce"] == 2 * (2 - 1) * 4 * n_params // 2  # 2(N-1)/N * 4 bytes
    result, _ = minipar_train("--model", "mlp", "--pp", "2", "--n-layer", "2", "--steps", "2", "--quiet")
    assert result.returncode == 0, result.stderr  # it was "Message truncated": float64 into a float32 buffer


# ---- 7. the log is strict JSON; a loss that is not finite stops the run; a failed write is reported ------


def test_a_loss_that_is_not_finite_stops_the_run_and_the_log_stays_json(tmp_path):
    log = tmp_path / "log.jsonl"
    cfg = SMALL_CFG.replace(optimizer="sgd", lr=1e300, steps=5, log=str(log), save=str(tmp_path / "ck"))
    with pytest.raises(train.RunStopped, match=r"loss is not finite at step \d"):
        one_process(cfg).run()
    refuse = {"parse_constant": lambda name: pytest.fail(f"{name} in the log: not JSON")}
    records = [json.loads(line, **refuse) for line in log.read_text().splitlines()]
    assert records[-1]["loss"] is None and all(r["loss"] is not None for r in records[:-1])
    assert not (tmp_path / "ck" / "manifest.json").exists()  # no checkpoint of a diverged state


def test_spawns_mpiexec_a_failed_log_write_is_one_line_after_the_checkpoint(tmp_path):
    """/dev/full fails every write with ENOSPC, as a full disk does."""
    result, _ = minipar_train("--steps", "3", "--quiet", "--log", "/dev/full", "--save", str(tmp_path))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("minipar train: error: --log /dev/full: writing step 0 failed (No space left")
    assert json.loads((tmp_path / "manifest.json").read_text())["step"] == 3


# ---- 8. two jobs, one save folder ------------------------------------------------------------------------


def test_spawns_mpiexec_a_second_job_saving_to_a_held_folder_is_refused(tmp_path):
    hold = (f"import time; from minipar.checkpoint import sharded; assert sharded.lock_problems("
            f"{str(tmp_path)!r}) == []; print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        result, seconds = minipar_train("--steps", "1", "--save", str(tmp_path))
        assert result.returncode == 2 and seconds < pace.allowance(), result.stderr
        assert result.stderr.count(f"--save {tmp_path} is in use: another run is saving there") == 2
        assert result.stderr.count("(on rank 0)") == 1 and list(tmp_path.iterdir()) == []
    finally:
        holder.kill()
        holder.wait()
    assert sharded_lock_is_free(tmp_path)  # the system released it with the process


def sharded_lock_is_free(directory) -> bool:
    from minipar.checkpoint import sharded

    free = sharded.lock_problems(directory) == []
    os.close(sharded._LOCKS.pop())
    return free


# ---- 9. disk offload on a folder too small ---------------------------------------------------------------


CHUNKED_DISK = SMALL_CFG.replace(zero=3, offload="disk", device_mem_mb=1.0, precision="fp64")


def test_offload_to_a_folder_without_the_space_is_refused_up_front(monkeypatch, tmp_path):
    assert validate(CHUNKED_DISK.replace(offload_dir=str(tmp_path)), 1) == []
    real = shutil.disk_usage
    monkeypatch.setattr(validation.shutil, "disk_usage", lambda path: real(path)._replace(free=1024))
    [error] = validate(CHUNKED_DISK.replace(offload_dir=str(tmp_path)), 1)
    assert "--offload disk needs" in error and f"in {tmp_path}, which has 0.0 MiB free" in error
    assert "--offload-dir" in error


def test_a_disk_tier_reserves_its_space_so_a_full_disk_is_an_error_not_a_bus_error(monkeypatch, tmp_path):
    def full_disk(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(offload.os, "posix_fallocate", full_disk)
    with pytest.raises(OSError, match=f"cannot reserve 800 bytes in {tmp_path} .No space left on device"):
        offload.DiskTier({"a": ((100,), np.float64)}, str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_disk_files_go_to_the_offload_dir(tmp_path, monkeypatch):
    made = []
    real = offload.tempfile.mkdtemp
    monkeypatch.setattr(offload.tempfile, "mkdtemp", lambda **kw: made.append(kw["dir"]) or real(**kw))
    trainer = one_process(CHUNKED_DISK.replace(offload_dir=str(tmp_path), steps=1))
    trainer.run()
    trainer.memory.close()
    assert made == [str(tmp_path)]


# ---- 10. Ctrl-C ----------------------------------------------------------------------------------------


def interrupt_a_training_job(env=None) -> tuple[int, str]:
    command = [MPIEXEC, "-n", "2", sys.executable, "-m", "minipar", "train", *SMALL, "--steps", "100000"]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                           env={**os.environ, "MPIEXEC_TIMEOUT": "60", **(env or {})})
    while "step" not in job.stdout.readline():  # training has begun
        pass
    time.sleep(1.0)
    job.send_signal(signal.SIGINT)  # mpiexec passes it to every rank, as a terminal's Ctrl-C does
    _, stderr = job.communicate(timeout=30)
    return job.returncode, stderr


def test_spawns_mpiexec_ctrl_c_ends_every_rank_with_one_line_and_exit_130():
    code, stderr = interrupt_a_training_job()
    assert code == 130 and "Traceback" not in stderr, stderr
    assert sorted(stderr.strip().splitlines()) == [f"minipar train: interrupted (rank {r})" for r in (0, 1)]


def ranks_of(launcher: int) -> list[int]:
    """The process ids of the Python processes under mpiexec `launcher` (its proxy's children)."""
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError):
            continue
    below, found = {launcher}, True
    while found:
        found = {pid for pid, parent in parents.items() if parent in below} - below
        below |= found
    return [pid for pid in below - {launcher} if "python" in _read(f"/proc/{pid}/cmdline")]


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def test_spawns_mpiexec_ctrl_c_while_the_ranks_are_importing_ends_each_with_one_line_and_exit_130():
    """The signal goes out as soon as both ranks have NumPy's core mapped, i.e. while they import (NumPy,
    then mpi4py and MPI's start; on any machine's pace: the moment is observed, not guessed). Each rank
    used to die in a KeyboardInterrupt traceback (python -m minipar imported NumPy with the package,
    before any handler could run), and mpiexec exited 1 or 2."""
    command = [MPIEXEC, "-n", "2", sys.executable, "-m", "minipar", "train", *SMALL, "--steps", "100000"]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                           env={**os.environ, "MPIEXEC_TIMEOUT": "60"})
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and job.poll() is None:
            ranks = ranks_of(job.pid)
            if len(ranks) == 2 and all("_multiarray_umath" in _read(f"/proc/{pid}/maps") for pid in ranks):
                break
            time.sleep(0.005)
        job.send_signal(signal.SIGINT)  # mpiexec passes it to every rank, as a terminal's Ctrl-C does
        stdout, stderr = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == 130 and "Traceback" not in stderr, (job.returncode, stderr)
    assert sorted(stderr.strip().splitlines()) == [f"minipar train: interrupted (rank {r})" for r in (0, 1)]
    # it never trained: the grid's line is the first thing rank 0 prints (mpiexec says it passed Ctrl-C on)
    assert [line for line in stdout.splitlines() if not line.startswith("[mpiexec@")] == [], stdout


def test_spawns_mpiexec_ctrl_c_reaches_a_rank_blocked_inside_mpi():
    """Rank 1 stops at step 1, so rank 0 sits inside MPI_Allreduce, where KeyboardInterrupt cannot
    reach it: the watchdog thread, woken by the signal's byte on its pipe, ends it in one line."""
    code, stderr = interrupt_a_training_job({"MINIPAR_FAULT": "rank:1,step:1,stall:stop"})
    assert code == 130 and stderr.strip().splitlines() == ["minipar train: interrupted (rank 0)"], stderr


# ---- the watchdog -----------------------------------------------------------------------------------------


def test_spawns_mpiexec_a_stalled_rank_ends_the_job_within_the_timeout():
    """Rank 1 stops itself (SIGSTOP) at step 2: rank 0 waits in the dp all-reduce of its gradients.
    The job takes the timeout and a start-up at this machine's pace (tests/pace.py), not until
    mpiexec's own timeout (90 s)."""
    fault = {"MINIPAR_FAULT": "rank:1,step:2,stall:stop"}
    result, seconds = minipar_train("--steps", "5", "--quiet", "--collective-timeout", "2", env=fault)
    assert result.returncode != 0 and 2 <= seconds < 2 + pace.allowance(), (seconds, result.stderr)
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("minipar: error: rank 0 waited 2 s in all_reduce on communicator 'dp' "
                           "(world ranks [0, 1]), past --collective-timeout 2")


@pytest.mark.parametrize("where, waiting", [
    ("validate", "the start-up check (every rank validates its input, then allgather of the verdicts)"),
    ("load", "loading the checkpoint (every rank reads its pieces, then a barrier)")])
def test_spawns_mpiexec_a_rank_stuck_at_start_up_ends_the_job_within_the_timeout(tmp_path, where, waiting):
    """Ranks that see different inputs (rank 1 alone is told to resume, as a path on no shared file
    system would differ), and rank 1 stops (SIGSTOP) while it validates its input, or while it loads
    the checkpoint: rank 0 waits in the verdicts' allgather, or in the barrier after the load. Both
    used to run before the watchdog watched anything, so the job hung until mpiexec's timeout."""
    base = [sys.executable, "-m", "minipar", "train", *SMALL, "--steps", "4", "--quiet",
            "--collective-timeout", "2"]
    one_process(SMALL_CFG.replace(steps=2, save=str(tmp_path))).run()
    resume = ["--resume", str(tmp_path)]
    rank_0 = [*base, *(resume if where == "load" else [])]
    command = [MPIEXEC, "-n", "1", *rank_0, ":", "-n", "1", *base, *resume]
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env={**os.environ, "MPIEXEC_TIMEOUT": "90",
                                 "MINIPAR_FAULT": f"rank:1,startup:{where},stall:stop"})
    seconds = time.monotonic() - started
    assert result.returncode != 0 and 2 <= seconds < 2 + pace.allowance(), (seconds, result.stderr)
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"minipar: error: rank 0 waited 2 s in {waiting} on communicator 'world' "
                           "(world ranks [0, 1]), past --collective-timeout 2"), line


def test_spawns_mpiexec_the_watchdog_does_not_fire_while_rank_0_checks_the_reference():
    """The reference run takes rank 0 longer than the timeout, while rank 1 waits in a plain barrier."""
    result, _ = minipar_train("--steps", "12", "--check-reference", "--collective-timeout", "0.2")
    assert result.returncode == 0 and "check against one process" in result.stdout, result.stderr


def test_the_default_timeout_comes_from_the_environment(monkeypatch):
    for value, expected in [("30", 30.0), ("0.5", 0.5), ("", 600.0), ("  ", 600.0)]:
        monkeypatch.setenv(watchdog.TIMEOUT_ENV, value)
        assert watchdog.timeout_from_env() == expected
    monkeypatch.delenv(watchdog.TIMEOUT_ENV)
    assert watchdog.timeout_from_env() == 600.0


JUNK_TIMEOUTS = ["5s", "junk", "-3", "0", "never", "inf", "nan"]


@pytest.mark.parametrize("value", JUNK_TIMEOUTS)
def test_a_junk_timeout_in_the_environment_is_refused_in_one_line(monkeypatch, capsys, value):
    """It used to mean 600 s without a word, where the other MINIPAR_ variables refuse junk."""
    from minipar import cli
    monkeypatch.setenv(watchdog.TIMEOUT_ENV, value)
    with pytest.raises(ValueError):
        watchdog.timeout_from_env()
    for command in ("train", "bench"):
        assert cli.main([command, "--steps", "1"]) == 2
        assert capsys.readouterr().err == (
            f"minipar {command}: error: MINIPAR_COLLECTIVE_TIMEOUT={value!r} is not a number of seconds: "
            "give a positive number (e.g. 600), or leave it empty for 600\n")


def test_spawns_mpiexec_a_junk_timeout_ends_every_rank_with_one_line_and_exit_2():
    result, _ = minipar_train("--steps", "2", env={watchdog.TIMEOUT_ENV: "5s"})
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.count("minipar train: error: MINIPAR_COLLECTIVE_TIMEOUT='5s' is not a number") == 2


# ---- periodic checkpoints: a job killed at step 9 of 10 with --save-every 4 -----------------------------


def test_spawns_mpiexec_a_job_killed_at_step_9_resumes_from_step_8_like_an_uninterrupted_run(tmp_path):
    directory, log = tmp_path / "checkpoint", tmp_path / "log.jsonl"
    common = ["--steps", "10", "--precision", "fp64", "--zero", "2", "--quiet", "--save", str(directory)]
    result, _ = minipar_train(*common, "--save-every", "4", env={"MINIPAR_FAULT": "rank:1,step:9"})
    assert result.returncode != 0 and "injected fault on rank 1 at step 9" in result.stderr
    assert json.loads((directory / "manifest.json").read_text())["step"] == 8
    result, _ = minipar_train(*common, "--resume", str(directory), "--log", str(log))
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in log.read_text().splitlines()]
    losses, _ = train.reference_run(SMALL_CFG.replace(precision="fp64", steps=10))
    assert [r["step"] for r in records] == [8, 9]
    np.testing.assert_allclose([r["loss"] for r in records], losses[8:], rtol=1e-9)
