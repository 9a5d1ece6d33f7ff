"""What of a student's files is graded: the exercise regions' text, screened, spliced into the reference.

The threat model (lessons/course.md, "What a grade means"): a student hands in a workspace, and may have
edited anything in it, the tests, the conftests, the harness, the grader, the guard plugin, the ring's
ledger or `buffer_meter`. None of that is read. The grader copies its own project (the reference) into a
temporary folder it owns and replaces, in that copy, only the lines between `# exercise ID` and
`# end exercise` by the student's. Everything else that runs is the reference's.

The region's own code still runs inside the test process, so it is screened first, as text, before any
test runs: a region that imports anything, names the interpreter's or the test runner's machinery (gc,
sys, os, builtins, _pytest, mpi4py, open, exec, eval, __import__, getattr, exit, ...) or reaches for a
`_`-prefixed attribute (but its own object's `self._x`) is refused in one line. That shuts the short ways
to a PASS without doing the work (rewrite pytest's report, print a summary and exit 0, write a byte
counter the test reads). It is no sandbox: what numpy itself can reach stays reachable; the grade is
there to tell a student whether the technique works, and an instructor reads what is handed in.
"""

from __future__ import annotations

import ast
import shutil
import textwrap
from pathlib import Path

from minipar_lab.course.regions import Region, RegionError, regions_in, regions_under

# copied into the grader's tree: what the checks import and run (lessons/ and the rest are not needed)
TREE = ("minipar", "minipar_lab", "tests", "pyproject.toml")
SKIPPED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", ".pytest_cache", ".hypothesis")

FORBIDDEN_NAMES = frozenset({
    "gc", "sys", "os", "builtins", "_pytest", "pytest", "mpi4py", "MPI", "open", "exec", "eval", "compile",
    "__import__", "importlib", "globals", "locals", "vars", "getattr", "setattr", "delattr", "exit", "quit",
    "breakpoint", "input", "SystemExit", "KeyboardInterrupt", "BaseException", "subprocess", "ctypes",
    "inspect", "signal", "threading", "atexit", "faulthandler", "traceback", "weakref", "tracemalloc"})


class Refused(ValueError):
    """A submission the grader will not run: the one-line reason is the message."""


def screen(body: str, where: str) -> None:
    """Raise Refused if the region's text (a function body's lines) imports or names what it must not."""
    try:
        tree = ast.parse("def _region():\n" + textwrap.indent(textwrap.dedent(body) or "pass\n", "    "))
    except SyntaxError as error:
        raise Refused(f"{where}: the region does not parse (line {max((error.lineno or 2) - 1, 1)}: "
                      f"{error.msg})") from None
    for node in ast.walk(tree):
        line = max(getattr(node, "lineno", 2) - 1, 1)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            raise Refused(f"{where}, line {line} of the region: an import (a region may use only what its "
                          "module already imports)")
        if isinstance(node, ast.Name) and (node.id in FORBIDDEN_NAMES or node.id.startswith("__")):
            raise Refused(f"{where}, line {line} of the region: the name {node.id!r} is not allowed in an "
                          "exercise")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            own = (isinstance(node.value, ast.Name) and node.value.id == "self"
                   and not node.attr.startswith("__"))
            if not own:
                raise Refused(f"{where}, line {line} of the region: the attribute {node.attr!r} is not "
                              "allowed in an exercise (only self's own _-prefixed state)")


def _regions_of(text: str, path: str, exercise_id: str) -> list[Region]:
    return [region for region in regions_in(text, path) if region.exercise == exercise_id]


def bodies(exercise_id: str, submitted: Path, path: str, count: int) -> list[str]:
    """The text between the markers of each of the exercise's `count` regions in a submitted file."""
    try:
        text = submitted.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise Refused(f"{path}: cannot read the submitted file ({error})") from None
    try:
        found = _regions_of(text, path, exercise_id)
    except RegionError as error:
        raise Refused(str(error)) from None
    if len(found) != count:
        raise Refused(f"{path}: {len(found)} region(s) '# exercise {exercise_id}' ... '# end exercise', "
                      f"the reference has {count}: keep the markers as they were handed out")
    lines = text.splitlines(keepends=True)
    out = []
    for region in found:
        body = "".join(lines[region.start + 1:region.end])
        outdented = [number for number, line in enumerate(body.splitlines(), region.start + 2)
                     if line.strip() and not line.startswith(region.indent)]
        if outdented or (region.indent == "" and body.strip()):
            raise Refused(f"{path}:{outdented[0] if outdented else region.start + 2}: a line of exercise "
                          f"{exercise_id} is indented less than its marker (it would leave the function)")
        out.append(body if body.endswith("\n") or not body else body + "\n")
    return out


def find_submitted(submission: Path, path: str) -> Path:
    """The submitted copy of the reference's file `path`: at the same path under submission (a
    workspace), else a file of the same name anywhere under it (loose files, as Gradescope keeps them)."""
    same = submission / path
    if same.is_file():
        return same
    loose = sorted(submission.rglob(Path(path).name))
    if len(loose) == 1:
        return loose[0]
    if not loose:
        raise Refused(f"the submission has no {path} (nor a file {Path(path).name})")
    raise Refused(f"the submission has {len(loose)} files named {Path(path).name}; keep one, or the "
                  f"workspace's layout ({path})")


def copy_tree(reference: Path, into: Path, names: tuple[str, ...] = TREE) -> None:
    """Copy the files and folders `names` of reference into `into`, without caches and build debris
    (the graded tree; a student's workspace, with its own list)."""
    into.mkdir(parents=True, exist_ok=True)
    for name in names:
        source = reference / name
        if source.is_dir():
            shutil.copytree(source, into / name, ignore=SKIPPED)
        elif source.is_file():
            shutil.copy2(source, into / name)


def splice(exercise_ids: list[str], submission: Path, tree: Path, reference: Path) -> list[str]:
    """Replace, in tree (a copy of reference), the regions of the exercises by the submission's; screen
    every region first. Return the files spliced. Raises Refused, before anything is written, on a region
    that is missing, outdented or screened out."""
    regions = [region for region in regions_under(reference) if region.exercise in exercise_ids]
    by_file: dict[str, list[Region]] = {}
    for region in regions:
        by_file.setdefault(region.path, []).append(region)
    replaced: dict[str, str] = {}
    for path, here in sorted(by_file.items()):
        submitted = find_submitted(submission, path)
        chosen = {}
        for exercise_id in dict.fromkeys(region.exercise for region in here):
            count = sum(region.exercise == exercise_id for region in here)
            chosen[exercise_id] = bodies(exercise_id, submitted, path, count)
            for number, body in enumerate(chosen[exercise_id], 1):
                screen(body, f"{path} (exercise {exercise_id}{f', region {number}' if count > 1 else ''})")
        replaced[path] = _splice_file((reference / path).read_text(), path, chosen)
    for path, text in replaced.items():
        (tree / path).write_text(text)
    return sorted(replaced)


def _splice_file(text: str, path: str, chosen: dict[str, list[str]]) -> str:
    """text with the bodies of the regions of the exercises in `chosen` replaced, in order."""
    lines = text.splitlines(keepends=True)
    found = regions_in(text, path)
    index = {exercise: len(bodies) for exercise, bodies in chosen.items()}
    for region in reversed(found):
        if region.exercise in chosen:
            index[region.exercise] -= 1
            lines[region.start + 1:region.end] = [chosen[region.exercise][index[region.exercise]]]
    return "".join(lines)

