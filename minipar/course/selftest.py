"""`make course-selftest`: every exercise's checks can fail, and pass on the solution.

For each exercise, in a fresh workspace (a temporary folder): with its regions stubbed every one of its
checks must FAIL; with the reference's files copied back every one must PASS. A check that passes on
the stub grades nothing (it does not reach the region, or the test reads the reference's code); one that
fails on the solution is broken. `python -m minipar.course.selftest [ID ...]` (default: all).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from minipar.course import grading, workspace
from minipar.course.exercises import BY_ID, EXERCISES, Exercise


def selftest(exercise: Exercise) -> list[str]:
    """The problems found (empty: the exercise's checks fail on the stub and pass on the solution)."""
    problems = []
    with tempfile.TemporaryDirectory(prefix=f"course-{exercise.id}-") as folder:
        root = Path(folder) / "workspace"
        workspace.create(root, [exercise])
        for outcome in grading.run_exercise(exercise, root):
            if outcome.passed:
                problems.append(f"passes on the stub: {outcome.check.node} ({outcome.ranks} ranks)")
        workspace.restore(root, workspace.files_of(exercise.id))
        for outcome in grading.run_exercise(exercise, root):
            if not outcome.passed:
                problems.append(f"fails on the solution: {outcome.check.node} ({outcome.ranks} ranks): "
                                f"{outcome.detail}")
    return problems


def main(argv: list[str]) -> int:
    unknown = [i for i in argv if i not in BY_ID]
    if unknown:
        sys.stderr.write(f"minipar course selftest: error: no exercise {unknown[0]}\n")
        return 2
    chosen = [BY_ID[i] for i in argv] if argv else list(EXERCISES)
    failures = 0
    for exercise in chosen:
        started = time.monotonic()
        problems = selftest(exercise)
        failures += bool(problems)
        seconds = time.monotonic() - started
        verdict = "BAD " if problems else "ok  "
        print(f"{verdict} {exercise.id}  {exercise.title}  ({seconds:.1f} s)", flush=True)
        for problem in problems:
            print(f"       {problem}", flush=True)
    print(f"{len(chosen) - failures} of {len(chosen)} exercises fail on their stub and pass on the solution")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
