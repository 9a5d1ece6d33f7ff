"""`python -m minipar course list | new | check`: hand out, take and grade the exercises.

    course list [--json] [--lesson LL]
    course new DIR [--lesson LL | --exercise ID ...]     a workspace with those regions stubbed
    course check ID [--dir DIR] | --all [--json]          grade a workspace (default DIR: .)

Bad input (an unknown id or lesson, a DIR that is missing or no workspace, a DIR for `new` that is not
empty) is one line and exit code 2, before anything runs. `check` exits 0 iff every check passed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from minipar.trainer.arguments import OneLineParser, fail
from minipar_lab.course import grading, workspace
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
    check.add_argument("--json", action="store_true")
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


def check_main(args) -> int:
    if args.all == (args.id is not None):
        return fail(PROG, "check takes one exercise id or --all")
    if args.id is not None and args.id not in BY_ID:
        return fail(PROG, f"no exercise {args.id} (python -m minipar course list shows them)")
    if not args.dir.is_dir():
        return fail(PROG, f"no folder {args.dir}")
    if not workspace.is_workspace(args.dir):
        return fail(PROG, f"{args.dir} is not a course workspace (no {workspace.MANIFEST}: "
                          "make one with python -m minipar course new DIR)")
    folder = args.dir.resolve()
    ids = workspace.handed_out(folder) if args.all else [args.id]
    unknown = [i for i in ids if i not in BY_ID]
    if unknown:
        return fail(PROG, f"{args.dir} was made for exercise {unknown[0]}, which this minipar does not have")
    report = None if args.json else (lambda outcome: print(grading.describe(outcome), flush=True))
    results = {}
    for exercise_id in ids:
        if not args.json:
            print(f"exercise {exercise_id}: {BY_ID[exercise_id].title}")
        results[exercise_id] = grading.run_exercise(BY_ID[exercise_id], folder, report=report)
    passed = all(outcome.passed for outcomes in results.values() for outcome in outcomes)
    if args.json:
        print(json.dumps({"workspace": str(folder), "passed": passed,
                          "exercises": [{"id": i, "passed": all(o.passed for o in outcomes),
                                         "checks": [o.as_json() for o in outcomes]}
                                        for i, outcomes in results.items()]}, indent=1))
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
