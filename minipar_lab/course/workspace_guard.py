"""The grader's pytest plugin: `import minipar` must be the graded tree's, and each rank writes a report.

`course check` runs the reference's tests in a temporary copy of the reference it owns, with only the
exercise regions taken from the student (splice.py). This file is loaded by its path, from the
reference, by run_check.py (never through the import path the tests see), and does two things:

- stops at once (exit 3) unless `import minipar` resolves inside the graded tree: should the path ever
  find another copy, every check would grade that copy instead of the student's regions;
- at the end of the session writes `rank-R.json` into the grader's report folder (MINIPAR_COURSE_REPORT):
  every test it ran, with its outcome (passed, failed, skipped, error) and, for a failure, the assertion.

The verdict (grading.verdict) is taken from these files and the exit code, never from printed output,
which the code under test can write to.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

_results: dict[str, dict] = {}
_collect_errors: list[str] = []


def pytest_configure(config):
    import minipar

    tree = Path(os.environ["MINIPAR_COURSE_TREE"]).resolve()
    imported = Path(minipar.__file__).resolve()
    if tree not in imported.parents:
        pytest.exit(f"course check: import minipar found {imported}, not the graded tree {tree}",
                    returncode=3)


def _message(report) -> str:
    text = getattr(report, "longreprtext", "") or str(report.longrepr or "")
    return text[-6000:]


def pytest_runtest_logreport(report):
    entry = _results.setdefault(report.nodeid, {"outcome": "passed", "message": "", "phases": []})
    entry["phases"].append(report.when)
    if report.failed:
        entry["outcome"] = "error" if report.when != "call" else "failed"
        entry["message"] = _message(report)
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
        longrepr = report.longrepr
        entry["message"] = str(longrepr[2]) if isinstance(longrepr, tuple) else _message(report)


def pytest_collectreport(report):
    if report.failed:
        _collect_errors.append(f"{report.nodeid}: {_message(report)}")


def _rank() -> tuple[int, int]:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        return mpi.COMM_WORLD.Get_rank(), mpi.COMM_WORLD.Get_size()
    return 0, 1


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    folder = os.environ.get("MINIPAR_COURSE_REPORT")
    if not folder:
        return
    rank, size = _rank()
    tests = {node: {"outcome": e["outcome"] if "call" in e["phases"] or e["outcome"] != "passed"
                    else "error", "message": e["message"]} for node, e in _results.items()}
    report = {"rank": rank, "size": size, "exitstatus": int(exitstatus), "tests": tests,
              "collect_errors": _collect_errors}
    path = Path(folder) / f"rank-{rank}.json"
    path.write_text(json.dumps(report))
