"""The lessons' pictures are the ones `make figures` draws: every image a lesson embeds exists, lies in
lessons/figures and is the PNG of a figure of `python -m minipar plot` (so `plot all` redraws it), and
every such figure is embedded by some lesson. (That the command runs is tests/plot/test_figures.py.)
The one exception is a screenshot of a real viewer, which `make trace-viewer` takes (SCREENSHOTS)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from minipar_lab.plot import registry

LESSONS = Path(__file__).parent
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")  # alt text may span lines
# {screenshot: the script that takes it}: a browser's picture, not a plot (needs Chromium: not make figures)
SCREENSHOTS = {"07_trace_speedscope.png": "tests/trace_viewer.py"}


def embedded() -> dict[str, list[str]]:
    """{image path as written: [lessons embedding it]}."""
    images: dict[str, list[str]] = {}
    for lesson in sorted(LESSONS.glob("*.md")):
        for path in IMAGE.findall(lesson.read_text()):
            images.setdefault(path, []).append(lesson.name)
    return images


def test_every_embedded_picture_exists_and_plot_all_draws_it():
    drawn = {importlib.import_module(f"minipar_lab.plot.{name}").FILE for name in registry.FIGURES}
    drawn |= set(SCREENSHOTS)
    images = embedded()
    assert images, "no lesson embeds a picture"
    for path, lessons in images.items():
        assert (LESSONS / path).is_file(), f"{lessons}: {path} does not exist"
        assert Path(path).parent == Path("figures") and Path(path).name in drawn, \
            f"{lessons}: {path} is not one of the figures `make figures` draws"
    assert drawn == {Path(path).name for path in images}, "a figure that no lesson embeds"


def test_no_png_lies_outside_lessons_figures():
    assert not list(LESSONS.glob("*.png")), "pictures live in lessons/figures, drawn by make figures"
    assert {p.name for p in (LESSONS / "figures").glob("*.png")} == {Path(p).name for p in embedded()}


def test_each_screenshot_is_written_by_its_script_which_a_make_target_runs():
    makefile = (LESSONS.parent / "Makefile").read_text()
    for name, script in SCREENSHOTS.items():
        assert f'"{name}"' in (LESSONS.parent / script).read_text(), f"{script} does not write {name}"
        assert f"$(PYTHON) {script}" in makefile, f"no make target runs {script}"
