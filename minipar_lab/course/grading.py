"""`course check`: run an exercise's checks, from the reference's tests, against a student's regions.

Where it runs: in a temporary folder the grader owns, a copy of the reference (this project) in which only
the text of the exercise regions is the student's (splice.py screens and splices it). The tests, their
conftests, the multi-rank harness, the ring's ledger, `buffer_meter` and this grader are the reference's
whatever the student's workspace holds; a grader whose own project is a workspace refuses to run.

Each check is one pytest node id of tests/ and the rank counts it runs at (none: one plain process; else
`mpiexec -n K`, the venv's), every count run and reported. The verdict (`verdict`) comes from the reports
the grader's plugin (workspace_guard.py, loaded by its path by run_check.py) writes, one per rank, into a
report folder of the grader's: a check passes when every rank wrote its report, every rank ran the
check's tests and each passed (a skip is no pass; a test not run is no pass), and the exit code is 0.
Printed output is shown, never read for the verdict. A failing check shows the failing rank's assertion
and the command that reruns it by hand in the workspace.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

from minipar.trainer import launch
from minipar_lab.course import splice
from minipar_lab.course.exercises import Check, Exercise
from minipar_lab.course.workspace import ROOT, is_workspace

TIMEOUT_S = 240
RUNNER = Path(__file__).resolve().parent / "run_check.py"
RANK_BLOCK = re.compile(r"^[ \t]*----- rank (?P<rank>\d+) -----[ \t]*$", re.MULTILINE)
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Failure|Exit|Interrupt)\b")
GROUP_BAR, GROUP_RULE = re.compile(r"^\s*\| "), re.compile(r"^\s*\+[-+]")  # an exception group's frame
TEST_FRAME = re.compile(r'^\s*File "[^"]*/tests/(?P<path>(?!mpi_harness)[^"]+\.py)", line (?P<line>\d+)')


@dataclass
class Outcome:
    check: Check
    ranks: int  # 1: one plain process
    passed: bool
    seconds: float
    detail: str  # on failure: the failing rank's assertion, or why nothing ran

    @property
    def rerun(self) -> str:
        return rerun_command(self.check, self.ranks)

    def as_json(self) -> dict:
        return {"node": self.check.node, "ranks": self.ranks, "passed": self.passed,
                "seconds": round(self.seconds, 2), "detail": self.detail,
                "hint": "" if self.passed else self.check.hint,
                "rerun": "" if self.passed else self.rerun}


class GraderIsAWorkspace(RuntimeError):
    pass


def refuse_if_a_workspace(reference: Path = ROOT) -> None:
    if is_workspace(reference):
        raise GraderIsAWorkspace(
            f"this grader is a workspace's copy ({reference}): its tests and grader are the student's to "
            "edit; grade with the reference's: python -m minipar course check ID --dir WORKSPACE, run from "
            "the reference's checkout")


def rerun_command(check: Check, ranks: int) -> str:
    """The command that reruns the check by hand, in the workspace (the workspace's copy of the test)."""
    pytest = f"python -m pytest -x -q {shlex.quote(check.node)}"
    return pytest if ranks == 1 else f"mpiexec -n {ranks} {pytest}"


def _environment(tree: Path, reports: Path) -> dict[str, str]:
    return launch.mpi_environment({
        "PYTHONPATH": str(tree), "MINIPAR_COURSE_TREE": str(tree), "MINIPAR_COURSE_REPORT": str(reports),
        "MINIPAR_TEST_REPORT_DIR": str(reports),  # where the harness writes a rank's abort: rank-R.txt
        "MPIEXEC_TIMEOUT": str(TIMEOUT_S), "MINIPAR_TEST_GRACE_S": "10", "COLUMNS": "200"})


def _command(check: Check, ranks: int, tree: Path, runner: Path = RUNNER) -> list[str]:
    pytest = [sys.executable, str(runner), "-q", "-rfEs", "--no-header", "-p", "no:cacheprovider",
              "--rootdir", str(tree), str(tree / check.node)]
    return pytest if ranks == 1 else [launch.mpiexec(), "-n", str(ranks), *pytest]


def _expected(tests: dict, node: str) -> dict:
    return {name: result for name, result in tests.items() if name == node or name.startswith(node + "[")}


def _joined(lines: list[str], most: int) -> str:
    """The first `most` lines of an exception in one line, ' | ' between them; a line that ends in ':'
    runs on into the next (numpy's 'AssertionError:' then 'Not equal to tolerance ...')."""
    merged: list[str] = []
    for line in (line.strip() for line in lines if line.strip()):
        if merged and merged[-1].endswith(":"):
            merged[-1] += " " + line
        else:
            merged.append(line)
    return " | ".join(merged[:most])


def _where_in_the_test(lines: list[str]) -> str:
    """' (at tests/x.py:N: the line)': the innermost frame of the test's own files (not the harness's)
    above the exception, so that a comparison says what it compared (the losses, a weight)."""
    for i in range(len(lines) - 2, -1, -1):
        frame = TEST_FRAME.match(lines[i])
        if frame:
            return f" (at tests/{frame['path']}:{frame['line']}: {lines[i + 1].strip()[:160]})"
    return ""


def assertion_of(message: str) -> str:
    """The failing rank's own assertion out of a test's failure text: with the harness's 'failed on
    rank(s) ...' the first failing rank's exception lines and the test's line that raised it, else
    pytest's `E` lines, else the last line."""
    explained = [GROUP_BAR.sub("", line[4:], count=1) for line in message.splitlines()
                 if line.startswith("E ") and not GROUP_RULE.match(line[4:])]  # "E   " + the line
    if explained:
        message = "\n".join(explained)
    blocks = RANK_BLOCK.split(message)
    if len(blocks) >= 3:  # [before, rank, text, rank, text, ...]
        rank, text = blocks[1], textwrap.dedent(blocks[2].strip("\n"))
        lines = [line for line in text.splitlines() if line.strip()]
        starts = [i for i, line in enumerate(lines) if EXCEPTION_LINE.match(line)]
        if not starts:
            return f"rank {rank}: " + _joined(lines[-1:], 1)
        return f"rank {rank}: " + _joined(lines[starts[-1]:], 3) + _where_in_the_test(lines[:starts[-1]])
    if explained:
        return _joined(explained, 2)
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no message"


def verdict(node: str, ranks: int, returncode: int | None, reports: dict[int, dict | None],
            output: str = "", aborts: dict[int, str] | None = None) -> tuple[bool, str]:
    """PASS iff the run ended (returncode not None), every rank 0..ranks-1 wrote a report, each report
    names the check's tests, each of them passed on every rank, and the exit code is 0. `aborts`: what
    the multi-rank harness wrote (MINIPAR_TEST_REPORT_DIR) for a rank that aborted the job."""
    where = "1 process" if ranks == 1 else f"{ranks} ranks"
    if returncode is None:
        return False, f"no verdict after {TIMEOUT_S + 20} s on {where} (a hang?)"
    lines = [line for line in output.strip().splitlines() if line.strip()]
    missing = [rank for rank in range(ranks) if reports.get(rank) is None]
    if missing:
        if returncode == 3 and lines:
            return False, lines[-1][:300]
        for rank, text in sorted((aborts or {}).items()):
            first = text.strip().splitlines()[0] if text.strip() else ""
            why = first if "still running after" in first else assertion_of(text)
            return False, f"on {where}, rank {rank} aborted the job (exit code {returncode}): {why}"[:600]
        return False, (f"on {where}, rank(s) {missing} wrote no report: the process crashed or was killed "
                       f"(exit code {returncode}); last output: {lines[-1][:200] if lines else 'none'}")
    for rank in range(ranks):
        report = reports[rank]
        if report.get("collect_errors"):
            why = assertion_of(report["collect_errors"][0])
            return False, f"rank {rank}: the test file did not load: {why}"
        expected = _expected(report.get("tests", {}), node)
        if not expected:
            return False, f"rank {rank}: {node} did not run (not collected)"
        for result in expected.values():
            if result["outcome"] in ("failed", "error"):
                kind = "an error outside the test" if result["outcome"] == "error" else "failed"
                return False, f"{kind} on {where}: {assertion_of(result['message'])}"[:600]
        skipped = [result for result in expected.values() if result["outcome"] != "passed"]
        if skipped:
            return False, f"the check did not run on rank {rank} (skipped: {skipped[0]['message'][:200]})"
    if returncode != 0:
        return False, f"every test passed, but the run's exit code is {returncode}"
    return True, ""


def _read_reports(folder: Path, ranks: int) -> tuple[dict[int, dict | None], dict[int, str]]:
    """The plugin's report of each rank (None: none written), and the harness's abort texts."""
    reports: dict[int, dict | None] = {}
    aborts: dict[int, str] = {}
    for rank in range(ranks):
        try:
            reports[rank] = json.loads((folder / f"rank-{rank}.json").read_text())
        except (OSError, ValueError):
            reports[rank] = None
        try:
            aborts[rank] = (folder / f"rank-{rank}.txt").read_text(errors="replace")
        except OSError:
            pass
    return reports, aborts


def run_check(check: Check, ranks: int, tree: Path) -> Outcome:
    """Run one check at one rank count in a graded tree (made by prepare) and judge it."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="minipar-reports-") as folder:
        process = subprocess.Popen(_command(check, ranks, tree), cwd=tree,
                                   env=_environment(tree, Path(folder)), stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, _ = process.communicate(timeout=TIMEOUT_S + 20)
            returncode: int | None = process.returncode
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            returncode = None
        reports, aborts = _read_reports(Path(folder), ranks)
        passed, detail = verdict(check.node, ranks, returncode, reports, output or "", aborts)
    return Outcome(check, ranks, passed, time.monotonic() - started, detail)


def prepare(exercises: list[Exercise], submission: Path, into: Path, reference: Path = ROOT) -> Path:
    """The graded tree: reference copied into `into`, the exercises' regions taken from submission.
    Raises splice.Refused (one line) before anything runs on a region that is missing or screened out."""
    refuse_if_a_workspace(reference)
    tree = into / "graded"
    splice.copy_tree(reference, tree)
    splice.splice([exercise.id for exercise in exercises], submission, tree, reference)
    return tree


def run_exercise(exercise: Exercise, submission: Path, reference: Path = ROOT, report=None) -> list[Outcome]:
    """Every check of the exercise at every rank count, in a graded tree of the grader's own; report(outcome)
    is called as each one ends. Raises splice.Refused before any test runs on a refused region."""
    with tempfile.TemporaryDirectory(prefix=f"minipar-grade-{exercise.id}-") as folder:
        tree = prepare([exercise], submission, Path(folder), reference)
        outcomes = []
        for check in exercise.checks:
            for ranks in check.ranks or (1,):
                outcome = run_check(check, ranks, tree)
                outcomes.append(outcome)
                if report is not None:
                    report(outcome)
    return outcomes


def where(ranks: int) -> str:
    return "1 process" if ranks == 1 else f"{ranks} ranks"


def describe(outcome: Outcome) -> str:
    line = f"{'PASS' if outcome.passed else 'FAIL'}  {outcome.check.node}  ({where(outcome.ranks)})"
    if not outcome.passed:
        line += (f"\n      {outcome.detail}\n      hint: {outcome.check.hint}"
                 f"\n      rerun (in the workspace): {outcome.rerun}")
    return line
