"""A student workspace: the project copied with the chosen exercises' regions cut out.

What is copied is what a student needs to build, run and read (minipar/, tests/, lessons/, pyproject.toml,
Makefile, README.md) and nothing else: no .git (its history holds the solutions), no .venv. A manifest,
`.minipar-course.json`, names the exercises handed out; it is what makes a folder a workspace.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from minipar.course.exercises import Exercise, stub_message
from minipar.course.regions import regions_under, stub_text

ROOT = Path(__file__).resolve().parents[2]  # the project this code belongs to: the reference
COPIED = ("minipar", "tests", "lessons", "pyproject.toml", "Makefile", "README.md")
MANIFEST = ".minipar-course.json"
SKIPPED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", ".pytest_cache", ".hypothesis")


def is_workspace(folder: Path) -> bool:
    return (folder / MANIFEST).is_file()


def handed_out(folder: Path) -> list[str]:
    """The exercise ids a workspace was made for."""
    return json.loads((folder / MANIFEST).read_text())["exercises"]


def files_of(exercise_id: str, root: Path = ROOT) -> list[str]:
    """The files an exercise stubs, relative to the project root (copying them back solves it)."""
    return sorted({region.path for region in regions_under(root) if region.exercise == exercise_id})


def create(folder: Path, exercises: list[Exercise], root: Path = ROOT) -> list[str]:
    """Copy the project from root into folder (which must not exist, or be empty) and stub the
    exercises' regions; return the stubbed files, relative to the project root."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        source = root / name
        if source.is_dir():
            shutil.copytree(source, folder / name, ignore=SKIPPED)
        elif source.is_file():
            shutil.copy2(source, folder / name)
    messages = {exercise.id: stub_message(exercise) for exercise in exercises}
    stubbed = sorted({region.path for region in regions_under(root) if region.exercise in messages})
    for path in stubbed:
        target = folder / path
        target.write_text(stub_text(target.read_text(), path, messages))
    manifest = {"exercises": [exercise.id for exercise in exercises], "stubbed_files": stubbed}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return stubbed


def restore(folder: Path, paths: list[str], root: Path = ROOT) -> None:
    """Copy the reference's versions of paths back into the workspace: the exercise solved."""
    for path in paths:
        shutil.copy2(root / path, folder / path)
