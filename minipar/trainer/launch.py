"""Launching `minipar train` (or any python) under mpiexec from Python, and reading its log: how the
tests, the lessons' examples and the lab's benchmarks start a job of several ranks.

Each rank gets one BLAS thread (a rank stands for one device; ranks sharing cores with thread pools
of their own would measure oversubscription) and mpiexec's timeout, so a hung job ends.
Lesson: lessons/03_data_parallel.md (a job of several ranks, launched from a lesson).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path


def mpiexec() -> str:
    """The mpiexec next to this Python (the mpich wheel's), else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else (shutil.which("mpiexec") or "mpiexec")


def mpi_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a measured run: one BLAS thread per rank, mpiexec's timeout, and `extra`."""
    return {**os.environ, "MPIEXEC_TIMEOUT": os.environ.get("MPIEXEC_TIMEOUT", "600"),
            **{name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")},
            **(extra or {})}


def run_mpi(ranks: int, args: list[str], extra_env: dict[str, str] | None = None) -> str:
    """Run `python ARGS` on `ranks` processes, one BLAS thread each, and return their standard output."""
    command = [mpiexec(), "-n", str(ranks), sys.executable, *args]
    env = mpi_environment(extra_env)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def read_log(path: Path) -> list[dict]:
    """The records of a `minipar train --log` file, one JSON object a line (one per step)."""
    if not path.is_file():
        raise FileNotFoundError(f"no log file {path}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_train(ranks: int, train_args: list[str], log: Path,
              extra_env: dict[str, str] | None = None) -> list[dict]:
    """Run `minipar train` on `ranks` processes and return rank 0's log records, one per step."""
    run_mpi(ranks, ["-m", "minipar", "train", *train_args, "--quiet", "--log", str(log)], extra_env)
    return read_log(log)


def run_train_concurrently(copies: int, train_args: list[str], folder: Path) -> list[list[dict]]:
    """Start `copies` independent one-process `minipar train` runs at once and return each one's log
    records: what N ranks reach when they share the machine but never wait for each other."""
    logs = [folder / f"copy{i}.jsonl" for i in range(copies)]
    commands = [[mpiexec(), "-n", "1", sys.executable, "-m", "minipar", "train", *train_args, "--quiet",
                 "--log", str(log)] for log in logs]
    running = [subprocess.Popen(c, env=mpi_environment(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True) for c in commands]
    for command, process in zip(commands, running):
        _, errors = process.communicate(timeout=900)
        if process.returncode:
            raise RuntimeError(f"{' '.join(command)} failed ({process.returncode}): {errors.strip()}")
    return [read_log(log) for log in logs]
