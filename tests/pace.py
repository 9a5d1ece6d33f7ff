"""The machine's own pace, for the tests that bound how long a job takes.

A test that says "the job ends within the timeout" must not fail because the machine is slow or shared
(two cores and five test runs): how long a job takes to start and stop is measured here, once per test
process, on the smallest job (`mpiexec -n 2 python -m minipar train`, one step of a tiny GPT), and the
bounds are the time the test is about plus an allowance of a few such jobs. What a bound still catches
is what it is for: a job that waits in a collective until MPIEXEC_TIMEOUT, or a watchdog that never
fires, takes minutes, not a few start-ups.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from pathlib import Path

MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
ROOT = Path(__file__).resolve().parents[1]
SMALLEST = ["--n-layer", "1", "--d-model", "16", "--n-head", "2", "--seq-len", "8", "--batch-size", "4",
            "--steps", "1", "--quiet"]


@functools.cache
def job_seconds() -> float:
    """Wall seconds of the smallest 2-rank training job, start to end, on this machine now."""
    command = [MPIEXEC, "-n", "2", sys.executable, "-m", "minipar", "train", *SMALLEST]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "MPIEXEC_TIMEOUT": "280"})
    seconds = time.monotonic() - started
    assert done.returncode == 0, f"the calibration job failed: {done.stderr}"
    return seconds


def allowance(jobs: float = 3.0) -> float:
    """Seconds for `jobs` start-ups at this machine's pace (a loaded machine's pace moves between the
    calibration and the test, hence more than one), times the pytest-xdist workers that share the
    machine (make test runs the serial tests in two: the other may start an 8-rank job at any moment),
    and a few seconds more."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return jobs * workers * job_seconds() + 5.0
