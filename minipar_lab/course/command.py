"""`python -m minipar course list | new | check`: hand out, take and grade the exercises.

    course list [--json] [--lesson LL]
    course new DIR [--lesson LL | --exercise ID ...]     a workspace with those regions stubbed
    course check ID [--dir DIR] | --all [--json]          grade a workspace (default DIR: .)
    course check --submission DIR --exercise ID           grade loose submitted files (or a workspace)
        [--format text|json|gradescope] [--out PATH]      gradescope: results.json for Gradescope, to PATH

Grading runs in a temporary copy of the reference (this project) with only the exercise regions taken from
the student's files (grading.py, splice.py): run it from the reference's checkout, never a workspace's.
Bad input (an unknown id or lesson, a DIR that is missing or no workspace, a manifest that does not read,
a DIR for `new` that is not empty, a region that is refused) is one line and exit code 2, before any test
runs. `check` exits 0 iff every check passed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from minipar.trainer.arguments import OneLineParser, fail
from minipar_lab.course import grading, splice, workspace
from minipar_lab.course.exercises import BY_ID, EXERCISES, Exercise

PROG = "minipar course"


def parser() -> OneLineParser:
    p = OneLineParser(prog=PROG, description="Coursework: exercises cut from the reference code.")
    commands = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    listing = commands.add_parser("list", help="every exercise: id, title, section, files, checks")
    listing.add_argument("--json", action="store_true")
    listing.add_argument("--lesson", help="only this lesson's exercises (LL)")
    new = commands.add_parser("new", help="a student workspace with the chosen exercises stubbed")
    new.add_argument("dir", type=Path)
    chosen = new.add_mutually_exclusive_group(required=True)
    chosen.add_argument("--lesson", help="every exercise of lesson LL")
    chosen.add_argument("--exercise", action="append", help="an exercise id LL.N (repeatable)")
    check = commands.add_parser("check", help="grade a workspace with the reference's tests")
    check.add_argument("id", nargs="?")
    check.add_argument("--all", action="store_true", help="every exercise the workspace was made for")
    check.add_argument("--dir", type=Path, default=Path("."))
    check.add_argument("--json", action="store_true", help="the same as --format json")
    check.add_argument("--submission", type=Path, help="loose submitted files (or a workspace) to grade "
                       "for --exercise, without a manifest")
    check.add_argument("--exercise", action="append", help="with --submission: an exercise id (repeatable)")
    check.add_argument("--format", choices=("text", "json", "gradescope"), default=None)
    check.add_argument("--out", type=Path, help="write the json or gradescope report here (default: stdout)")
    return p


def _of_lesson(lesson: str) -> list[Exercise]:
    return [exercise for exercise in EXERCISES if exercise.lesson == lesson.zfill(2)]


def _as_json(exercise: Exercise) -> dict:
    return {"id": exercise.id, "title": exercise.title, "lesson": exercise.lesson,
            "section": exercise.section, "difficulty": exercise.difficulty,
            "files": workspace.files_of(exercise.id),
            "checks": [{"node": c.node, "ranks": list(c.ranks) or [1], "hint": c.hint}
                       for c in exercise.checks]}


def rank_counts(ranks: tuple[int, ...]) -> str:
    return " and ".join(map(str, ranks)) + " ranks" if ranks else "1 process"


def describe(exercise: Exercise) -> str:
    """What to read, where to write, what grades it and how to check: the lessons print this."""
    graded = [f"{check.node} ({rank_counts(check.ranks)})" for check in exercise.checks]
    return "\n".join([
        f"{exercise.id} {'*' * exercise.difficulty}  {exercise.title}",
        f"    read:   lesson {exercise.lesson}, section '{exercise.section}'",
        f"    write:  {', '.join(workspace.files_of(exercise.id))}, between '# exercise {exercise.id}' "
        "and '# end exercise'",
        "    graded: " + "\n            ".join(graded),
        f"    check:  python -m minipar course check {exercise.id}"])


def list_main(args) -> int:
    chosen = _of_lesson(args.lesson) if args.lesson else list(EXERCISES)
    if args.lesson and not chosen:
        return fail(PROG, f"lesson {args.lesson} has no exercises")
    if args.json:
        lessons = sorted({exercise.lesson for exercise in chosen})
        print(json.dumps({"exercises": [_as_json(e) for e in chosen], "count": len(chosen),
                          "lessons": lessons}, indent=1))
        return 0
    for exercise in chosen:
        print(describe(exercise))
    return 0


def new_main(args) -> int:
    if args.lesson:
        chosen = _of_lesson(args.lesson)
        if not chosen:
            return fail(PROG, f"lesson {args.lesson} has no exercises")
    else:
        unknown = [i for i in args.exercise if i not in BY_ID]
        if unknown:
            return fail(PROG, f"no exercise {unknown[0]} (python -m minipar course list shows them)")
        chosen = [BY_ID[i] for i in dict.fromkeys(args.exercise)]
    if args.dir.exists() and (not args.dir.is_dir() or any(args.dir.iterdir())):
        return fail(PROG, f"{args.dir} exists and is not an empty folder")
    try:
        stubbed = workspace.create(args.dir, chosen)
    except OSError as error:
        return fail(PROG, f"cannot write the workspace {args.dir}: {error.strerror or error}")
    ids = ", ".join(exercise.id for exercise in chosen)
    print(f"workspace {args.dir}: exercises {ids} stubbed in {', '.join(stubbed)}")
    return 0


def _chosen(args) -> list[str] | str:
    """The exercise ids to grade, or the one-line reason there are none."""
    if args.submission is not None:
        if args.id is not None or args.all:
            return "--submission takes --exercise ID, not an id or --all"
        if not args.exercise:
            return "--submission needs --exercise ID"
        if not args.submission.is_dir():
            return f"no folder {args.submission}"
        return list(dict.fromkeys(args.exercise))
    if args.exercise:
        return "--exercise goes with --submission (a workspace: check ID --dir DIR)"
    if args.all == (args.id is not None):
        return "check takes one exercise id or --all"
    if args.id is not None and args.id not in BY_ID:
        return f"no exercise {args.id} (python -m minipar course list shows them)"
    if not args.dir.is_dir():
        return f"no folder {args.dir}"
    if not workspace.is_workspace(args.dir):
        return (f"{args.dir} is not a course workspace (no {workspace.MANIFEST}: "
                "make one with python -m minipar course new DIR)")
    if not args.all:
        return [args.id]
    try:
        ids = workspace.handed_out(args.dir)
    except workspace.BadManifest as error:
        return str(error)
    return ids


def gradescope(results: dict[str, list[grading.Outcome]], seconds: float, refused: str = "") -> dict:
    """Gradescope's results.json: one test per check and rank count, one point each."""
    tests = []
    for exercise_id, outcomes in results.items():
        for outcome in outcomes:
            output = ("" if outcome.passed else
                      f"{outcome.detail}\nhint: {outcome.check.hint}\n"
                      f"rerun in your workspace: {outcome.rerun}")
            tests.append({"name": f"{exercise_id} {outcome.check.node} ({grading.where(outcome.ranks)})",
                          "number": f"{exercise_id}.{len(tests) + 1}", "score": float(outcome.passed),
                          "max_score": 1.0, "status": "passed" if outcome.passed else "failed",
                          "output": output, "visibility": "visible"})
    summary = refused or f"{sum(t['status'] == 'passed' for t in tests)} of {len(tests)} checks passed"
    report = {"tests": tests, "execution_time": round(seconds, 1), "output": summary}
    if refused:
        report["score"] = 0.0
    return report


def _write(text: str, out: Path | None) -> None:
    if out is None:
        print(text)
    else:
        out.write_text(text + "\n")


def check_main(args) -> int:
    ids = _chosen(args)
    if isinstance(ids, str):
        return fail(PROG, ids)
    unknown = [i for i in ids if i not in BY_ID]
    if unknown:
        where = "--exercise" if args.submission is not None else f"{args.dir} was made for exercise"
        return fail(PROG, f"{where} {unknown[0]}, which this minipar does not have")
    form = args.format or ("json" if args.json else "text")
    submission = (args.submission if args.submission is not None else args.dir).resolve()
    try:
        grading.refuse_if_a_workspace()
    except grading.GraderIsAWorkspace as error:
        return fail(PROG, str(error))
    report = (lambda outcome: print(grading.describe(outcome), flush=True)) if form == "text" else None
    started = time.monotonic()
    results: dict[str, list[grading.Outcome]] = {}
    try:
        for exercise_id in ids:
            if form == "text":
                print(f"exercise {exercise_id}: {BY_ID[exercise_id].title}", flush=True)
            results[exercise_id] = grading.run_exercise(BY_ID[exercise_id], submission, report=report)
    except splice.Refused as error:
        if form == "gradescope":
            refused = gradescope({}, time.monotonic() - started, f"refused: {error}")
            _write(json.dumps(refused, indent=1), args.out)
        return fail(PROG, f"refused, no test run: {error}")
    passed = all(outcome.passed for outcomes in results.values() for outcome in outcomes)
    if form == "json":
        _write(json.dumps({"workspace": str(submission), "passed": passed,
                           "exercises": [{"id": i, "passed": all(o.passed for o in outcomes),
                                          "checks": [o.as_json() for o in outcomes]}
                                         for i, outcomes in results.items()]}, indent=1), args.out)
    elif form == "gradescope":
        _write(json.dumps(gradescope(results, time.monotonic() - started), indent=1), args.out)
    else:
        total = sum(len(outcomes) for outcomes in results.values())
        good = sum(o.passed for outcomes in results.values() for o in outcomes)
        print(f"{good} of {total} checks passed")
    return 0 if passed else 1


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    return {"list": list_main, "new": new_main, "check": check_main}[args.command](args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
