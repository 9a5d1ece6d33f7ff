"""`course check`: run an exercise's checks, from the reference's tests, against a workspace's code.

Each check is one pytest node id of the reference's tests/ and the rank counts it runs at (none: one
plain process; else `mpiexec -n K`, the venv's). The subprocess runs in the workspace with
PYTHONPATH=workspace, so `import minipar` is the student's code (the workspace_guard plugin proves it),
while the test files, their oracles and their conftest stay the reference's: a student cannot edit them.
A check passes when pytest ran it and it passed (a skip is no pass).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from minipar.trainer import launch
from minipar_lab.course.exercises import Check, Exercise
from minipar_lab.course.workspace import ROOT

TIMEOUT_S = 240
SUMMARY = re.compile(r"^=*\s*(?P<counts>(?:\d+ \w+(?:, )?)+)(?: in [\d.]+s)?\s*=*$", re.MULTILINE)
FAILED_LINE = re.compile(r"^(?:FAILED|ERROR) \S.*?(?: - (?P<why>.*))?$", re.MULTILINE)


@dataclass
class Outcome:
    check: Check
    ranks: int  # 1: one plain process
    passed: bool
    seconds: float
    detail: str  # on failure: pytest's one-line reason, or why nothing ran

    def as_json(self) -> dict:
        return {"node": self.check.node, "ranks": self.ranks, "passed": self.passed,
                "seconds": round(self.seconds, 2), "detail": self.detail,
                "hint": "" if self.passed else self.check.hint}


def _environment(workspace: Path) -> dict[str, str]:
    path = [str(workspace)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return launch.mpi_environment({
        "PYTHONPATH": os.pathsep.join(path), "MINIPAR_COURSE_WORKSPACE": str(workspace),
        "MPIEXEC_TIMEOUT": str(TIMEOUT_S), "MINIPAR_TEST_GRACE_S": "10",
        "COLUMNS": "400"})  # wide enough that pytest keeps the reason on its FAILED line


def _command(check: Check, ranks: int, reference: Path) -> list[str]:
    pytest = [sys.executable, "-m", "pytest", "-q", "-rfEs", "--no-header", "-p", "no:cacheprovider",
              "-p", "minipar_lab.course.workspace_guard", "--rootdir", str(reference),
              str(reference / check.node)]
    if ranks == 1:
        return pytest
    return [launch.mpiexec(), "-n", str(ranks), *pytest]


def _verdict(returncode: int, output: str) -> tuple[bool, str]:
    summaries = SUMMARY.findall(output)
    counts = summaries[-1] if summaries else ""
    if returncode == 0 and re.search(r"\b\d+ passed", counts) and "skipped" not in counts:
        return True, ""
    failed = FAILED_LINE.search(output)
    if failed and failed["why"]:
        return False, failed["why"].strip()[:300]
    if "skipped" in counts:
        return False, f"the check did not run ({counts})"
    if returncode == 3:
        return False, output.strip().splitlines()[-1]
    last = [line for line in output.strip().splitlines() if line.strip()]
    return False, (last[-1] if last else f"exit code {returncode}")[:300]


def run_check(check: Check, ranks: int, workspace: Path, reference: Path = ROOT) -> Outcome:
    started = time.monotonic()
    try:
        done = subprocess.run(_command(check, ranks, reference), cwd=workspace, env=_environment(workspace),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=TIMEOUT_S + 20)
        passed, detail = _verdict(done.returncode, done.stdout)
    except subprocess.TimeoutExpired:
        passed, detail = False, f"no verdict after {TIMEOUT_S + 20} s (a hang?)"
    return Outcome(check, ranks, passed, time.monotonic() - started, detail)


def run_exercise(exercise: Exercise, workspace: Path, reference: Path = ROOT, report=None) -> list[Outcome]:
    """Every check of the exercise at every rank count; report(outcome) is called as each one ends."""
    outcomes = []
    for check in exercise.checks:
        for ranks in check.ranks or (1,):
            outcome = run_check(check, ranks, workspace, reference)
            outcomes.append(outcome)
            if report is not None:
                report(outcome)
    return outcomes


def where(ranks: int) -> str:
    return "1 process" if ranks == 1 else f"{ranks} ranks"


def describe(outcome: Outcome) -> str:
    line = f"{'PASS' if outcome.passed else 'FAIL'}  {outcome.check.node}  ({where(outcome.ranks)})"
    if not outcome.passed:
        line += f"\n      {outcome.detail}\n      hint: {outcome.check.hint}"
    return line
