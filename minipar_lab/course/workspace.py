"""A student workspace: the project copied with the chosen exercises' regions cut out.

What is copied is what a student needs to build, run and read (minipar/, minipar_lab/, tests/, lessons/,
pyproject.toml, Makefile, README.md) and nothing else: no .git (its history holds the solutions), no
.venv. A manifest, `.minipar-course.json`, names the exercises handed out; it is what makes a folder a
workspace.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from minipar_lab.course.exercises import Exercise, stub_message
from minipar_lab.course.regions import Region, regions_under, stub_text
from minipar_lab.course.splice import copy_tree

ROOT = Path(__file__).resolve().parents[2]  # the project this code belongs to: the reference
COPIED = ("minipar", "minipar_lab", "tests", "lessons", "pyproject.toml", "Makefile", "README.md")
MANIFEST = ".minipar-course.json"
EXCERPT = re.compile(r"^```python excerpt (?P<path>\S+)\n(?P<body>.*?)^```$", re.MULTILINE | re.DOTALL)
HIDDEN = "...\n"  # an excerpt of nothing: lessons/conftest.py still finds it in the file


def is_workspace(folder: Path) -> bool:
    return (folder / MANIFEST).is_file()


class BadManifest(ValueError):
    """A manifest that does not read as a list of exercise ids (truncated, emptied, edited)."""


def handed_out(folder: Path) -> list[str]:
    """The exercise ids a workspace was made for (at least one); BadManifest, with a one-line reason,
    if the manifest is not what `course new` wrote."""
    path = folder / MANIFEST
    try:
        ids = json.loads(path.read_text())["exercises"]
    except (OSError, UnicodeDecodeError) as error:
        raise BadManifest(f"cannot read {path}: {error}") from None
    except (ValueError, TypeError, KeyError):
        raise BadManifest(f"{path} is not a course manifest (truncated or edited?): "
                          "make a new workspace with python -m minipar course new DIR") from None
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise BadManifest(f"{path}: 'exercises' is not a list of exercise ids")
    if not ids:
        raise BadManifest(f"{path} names no exercises: nothing to grade")
    return ids


def files_of(exercise_id: str, root: Path = ROOT) -> list[str]:
    """The files an exercise stubs, relative to the project root (copying them back solves it)."""
    return sorted({region.path for region in regions_under(root) if region.exercise == exercise_id})


def create(folder: Path, exercises: list[Exercise], root: Path = ROOT) -> list[str]:
    """Copy the project from root into folder and stub the exercises' regions; return the stubbed
    files, relative to the project root. Files already in folder are overwritten: `course new` refuses
    a folder that exists and is not empty before calling this."""
    copy_tree(root, folder, COPIED)
    messages = {exercise.id: stub_message(exercise) for exercise in exercises}
    regions = [region for region in regions_under(root) if region.exercise in messages]
    stubbed = sorted({region.path for region in regions})
    for path in stubbed:
        target = folder / path
        target.write_text(stub_text(target.read_text(), path, messages))
    hide_solutions_in_lessons(folder, regions, root)
    manifest = {"exercises": [exercise.id for exercise in exercises], "stubbed_files": stubbed}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return stubbed


def hide_solutions_in_lessons(folder: Path, stubbed: list[Region], root: Path) -> None:
    """A lesson's code excerpt that shows half of a stubbed region or more would hand the solution out
    with the exercise: such an excerpt keeps its fence and loses its body. (Lessons that explain a solution
    in prose or run their own version of it are for the instructor to read before handing out.)"""
    solutions: list[tuple[str, set[str]]] = []
    for region in stubbed:
        lines = (root / region.path).read_text().splitlines()[region.start + 1:region.end]
        solutions.append((region.path, {line.strip() for line in lines if line.strip()}))

    def shows_half_of_a_region(path: str, body: str) -> bool:  # a line like `return x` alone is no giveaway
        shown = {line.strip() for line in body.splitlines()}
        return any(where == path and 2 * len(shown & lines) >= len(lines) for where, lines in solutions)

    def hide(match: re.Match) -> str:
        if not shows_half_of_a_region(match["path"], match["body"]):
            return match[0]
        return match[0].replace(match["body"], HIDDEN, 1)

    for lesson in sorted((folder / "lessons").glob("*.md")):
        text = lesson.read_text()
        hidden = EXCERPT.sub(hide, text)
        if hidden != text:
            lesson.write_text(hidden)


def restore(folder: Path, paths: list[str], root: Path = ROOT) -> None:
    """Copy the reference's versions of paths back into the workspace: the exercise solved."""
    for path in paths:
        shutil.copy2(root / path, folder / path)
