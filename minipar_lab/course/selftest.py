"""`make course-selftest`: every exercise's checks can fail, and pass on the solution.

For each exercise, in a fresh workspace (a temporary folder): with its regions stubbed every one of its
checks must FAIL; with the reference's files copied back every one must PASS. A check that passes on
the stub grades nothing (it does not reach the region, or the test reads the reference's code); one that
fails on the solution is broken. `python -m minipar_lab.course.selftest [ID ...]` (default: all).

`--within-lessons` reports instead which checks of a lesson's other exercises a stub breaks: the
exercises a student given the whole lesson must take in order (information, not a failure).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from minipar.trainer.arguments import fail
from minipar_lab.course import grading, workspace
from minipar_lab.course.exercises import BY_ID, EXERCISES, Exercise


def selftest(exercise: Exercise) -> list[str]:
    """The problems found (empty: the exercise's checks fail on the stub and pass on the solution)."""
    problems = []
    with tempfile.TemporaryDirectory(prefix=f"course-{exercise.id}-") as folder:
        root = Path(folder) / "workspace"
        workspace.create(root, [exercise])
        for outcome in grading.run_exercise(exercise, root):
            if outcome.passed:
                problems.append(f"passes on the stub: {outcome.check.node} ({grading.where(outcome.ranks)})")
        workspace.restore(root, workspace.files_of(exercise.id))
        for outcome in grading.run_exercise(exercise, root):
            if not outcome.passed:
                where = grading.where(outcome.ranks)
                problems.append(f"fails on the solution: {outcome.check.node} ({where}): {outcome.detail}")
    return problems


def broken_by(exercise: Exercise) -> list[str]:
    """The checks of the other exercises of its lesson that fail with only this exercise stubbed."""
    others = [e for e in EXERCISES if e.lesson == exercise.lesson and e.id != exercise.id]
    broken = []
    with tempfile.TemporaryDirectory(prefix=f"course-{exercise.id}-") as folder:
        root = Path(folder) / "workspace"
        workspace.create(root, [exercise])
        for other in others:
            broken += [f"{other.id}: {o.check.node} ({grading.where(o.ranks)})"
                       for o in grading.run_exercise(other, root) if not o.passed]
    return broken


def within_lessons() -> int:
    for exercise in EXERCISES:
        broken = broken_by(exercise)
        print(f"{exercise.id} stubbed breaks {len(broken)} check(s) of its lesson's others", flush=True)
        for line in broken:
            print(f"       {line}", flush=True)
    return 0


def main(argv: list[str]) -> int:
    if argv == ["--within-lessons"]:
        return within_lessons()
    unknown = [i for i in argv if i not in BY_ID]
    if unknown:
        return fail("minipar course selftest", f"no exercise {unknown[0]}")
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
