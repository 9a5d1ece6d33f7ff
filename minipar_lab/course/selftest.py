"""`make course-selftest`: every exercise's checks can fail, pass on the solution, and fail every wrong one.

For each exercise, in a fresh workspace (a temporary folder): with its regions stubbed every one of its
checks must FAIL; with the reference's files copied back every one must PASS. A check that passes on
the stub grades nothing (it does not reach the region, or the test reads the reference's code); one that
fails on the solution is broken. Then the bank (bank.py): each known-wrong solution, spliced into the
workspace, must be graded FAIL at its named check (at the first of its rank counts that fails), with its
keyword in the failure's detail or hint.

    python -m minipar_lab.course.selftest [ID ...]          stub, solution and bank (default: all)
    python -m minipar_lab.course.selftest --bank [ID ...]   the bank only (ID/TEXT: the entries whose
                                                            name contains TEXT)

`--within-lessons` reports instead which checks of a lesson's other exercises a stub breaks: the
exercises a student given the whole lesson must take in order (information, not a failure).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

from minipar.trainer.arguments import fail
from minipar_lab.course import grading, splice, workspace
from minipar_lab.course.bank import BANK, Wrong
from minipar_lab.course.exercises import BY_ID, EXERCISES, Exercise
from minipar_lab.course.regions import regions_in


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


def _indented(body: str, indent: str) -> str:
    return "".join(indent + line if line.strip() else line for line in body.splitlines(keepends=True))


def write_wrong(folder: Path, wrong: Wrong, reference: Path = workspace.ROOT) -> None:
    """Put the wrong solution's bodies into the workspace's regions (None: the reference's body)."""
    for path in workspace.files_of(wrong.exercise, reference):
        text = (reference / path).read_text()
        lines = text.splitlines(keepends=True)
        regions = [r for r in regions_in(text, path) if r.exercise == wrong.exercise]
        if len(regions) != len(wrong.bodies):
            raise ValueError(f"{wrong.exercise} {wrong.name!r}: {len(wrong.bodies)} bodies for "
                             f"{len(regions)} regions")
        bodies = ["".join(lines[r.start + 1:r.end]) if body is None else _indented(body, r.indent)
                  for r, body in zip(regions, wrong.bodies)]
        (folder / path).write_text(splice._splice_file(text, path, {wrong.exercise: bodies}))


def bank_problem(wrong: Wrong, tree_folder: Path, submission: Path) -> tuple[str, str]:
    """('', the failure) when the wrong solution is graded FAIL at its check with its keyword; else
    (the problem, '')."""
    exercise = BY_ID[wrong.exercise]
    check = next(c for c in exercise.checks if c.node == wrong.node())
    write_wrong(submission, wrong)
    try:
        try:
            tree = grading.prepare([exercise], submission, tree_folder)
        except splice.Refused as refused:
            return f"refused by the screen, not graded: {refused}", ""
        for ranks in check.ranks or (1,):
            outcome = grading.run_check(check, ranks, tree)
            if not outcome.passed:
                if wrong.keyword not in outcome.detail + " " + check.hint:
                    return (f"fails at {grading.where(ranks)}, but neither detail nor hint says "
                            f"{wrong.keyword!r}: {outcome.detail}"), ""
                return "", f"{grading.where(ranks)}: {outcome.detail[:160]}"
        return f"graded PASS at {check.node}", ""
    finally:
        shutil.rmtree(tree_folder, ignore_errors=True)


def bank(chosen: list[Exercise], names: dict[str, str] | None = None) -> int:
    """Grade every wrong solution of the chosen exercises (names[id]: only those whose name contains it)."""
    bad = total = 0
    for exercise in chosen:
        entries = [wrong for wrong in BANK if wrong.exercise == exercise.id
                   and (names or {}).get(exercise.id, "") in wrong.name]
        with tempfile.TemporaryDirectory(prefix=f"course-bank-{exercise.id}-") as folder:
            submission = Path(folder) / "workspace"
            workspace.create(submission, [exercise])
            for wrong in entries:
                started = time.monotonic()
                problem, failure = bank_problem(wrong, Path(folder) / "grader", submission)
                bad, total = bad + bool(problem), total + 1
                seconds = time.monotonic() - started
                print(f"{'BAD ' if problem else 'ok  '} {wrong.exercise}  {wrong.name}  ({seconds:.1f} s)\n"
                      f"       {problem or 'FAIL ' + failure}", flush=True)
    print(f"{total - bad} of {total} wrong solutions graded FAIL at their check")
    return bad


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
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv == ["--within-lessons"]:
        return within_lessons()
    only_bank = argv[:1] == ["--bank"]
    argv = argv[1:] if only_bank else argv
    names = dict(arg.split("/", 1) for arg in argv if "/" in arg)  # --bank 04.3/leak: those entries only
    argv = list(dict.fromkeys(arg.split("/", 1)[0] for arg in argv))
    unknown = [i for i in argv if i not in BY_ID]
    if unknown:
        return fail("minipar course selftest", f"no exercise {unknown[0]}")
    chosen = [BY_ID[i] for i in argv] if argv else list(EXERCISES)
    if only_bank:
        return 1 if bank(chosen, names) else 0
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
    wrong = bank(chosen)
    return 1 if failures or wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
