"""The coursework tool (minipar_lab/course/): its registry agrees with the code's regions, stubs cut exactly
the chosen regions, bad input is one line and exit 2, and a fixed few exercises go the whole way round:
a fresh workspace fails its checks on the stub and passes them once the reference's files are back
(`make course-selftest` does this for every exercise)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from minipar_lab.course import grading, selftest, workspace
from minipar_lab.course.bank import BANK
from minipar_lab.course.exercises import BY_ID, EXERCISES, Check
from minipar_lab.course.regions import RegionError, regions_in, regions_under, stub_text

ROOT = Path(__file__).resolve().parents[2]
LESSONS = {path.name[:2]: path for path in (ROOT / "lessons").glob("[0-9][0-9]_*.md")}


def course(*argv, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "minipar", "course", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_the_issue_asks_for_at_least_18_exercises_over_at_least_10_lessons():
    assert len(EXERCISES) >= 18 and len({e.lesson for e in EXERCISES}) >= 10


def test_every_exercise_has_regions_and_every_region_an_exercise_of_the_same_title():
    regions = regions_under(ROOT)
    assert {r.exercise for r in regions} == set(BY_ID)
    for region in regions:
        assert region.title == BY_ID[region.exercise].title, region


def test_every_check_names_a_test_that_exists_and_every_section_is_a_heading_of_its_lesson():
    for exercise in EXERCISES:
        headings = {line.lstrip("#").strip() for line in LESSONS[exercise.lesson].read_text().splitlines()
                    if line.startswith("#")}
        assert exercise.section in headings, (exercise.id, exercise.section)
        for check in exercise.checks:
            path, _, name = check.node.partition("::")
            tree = ast.parse((ROOT / path).read_text())
            assert name.split("[")[0] in {f.name for f in tree.body if isinstance(f, ast.FunctionDef)}, check
            assert all(k >= 2 for k in check.ranks) and check.hint


def end_to_end_table() -> dict[str, tuple[set[str], list[str]]]:
    """lessons/course.md's table of end-to-end checks: per exercise id, the tests its third column names
    and the wrong solutions its fourth column names (';' between two)."""
    text = (ROOT / "lessons" / "course.md").read_text()
    section = text.split("### Each exercise's end-to-end check", 1)[1].split("\n#", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0][:2].isdigit():
            tests = set(re.findall(r"`(test_\w+(?:\[[^\]`]*\])?)`", cells[2]))
            rows[cells[0].split()[0]] = (tests, [w.strip() for w in cells[3].split(";") if w.strip()])
    return rows


def test_the_lessons_table_of_end_to_end_checks_is_the_registry_and_the_bank():
    """Each exercise has its row; every test the row names is one of the exercise's checks (so dropping an
    end-to-end check from the registry, or naming one it lacks, fails here), and every wrong solution it
    names is in the exercise's bank, graded at one of those tests."""
    rows = end_to_end_table()
    assert set(rows) == set(BY_ID)
    for exercise_id, (tests, wrongs) in rows.items():
        checks = {check.node.split("::")[1] for check in BY_ID[exercise_id].checks}
        assert tests <= checks, (exercise_id, tests - checks)
        assert bool(wrongs) == bool(tests), exercise_id
        for wrong in wrongs:
            assert any(w.exercise == exercise_id and wrong in w.name and w.check in tests for w in BANK), \
                (exercise_id, wrong)
    # every exercise whose region sits in a training path (minipar/parallel/) is graded by a real run
    in_a_training_path = {r.exercise for r in regions_under(ROOT) if r.path.startswith("minipar/parallel/")}
    assert {e for e in in_a_training_path if not rows[e][0]} == {"06.3"}


SOURCE = """def f(x):
    y = 1
    # exercise 01.9: the first
    y += x
    # end exercise
    if x:
        # exercise 01.8: the second
        return y
        # end exercise
    return -y
"""


def test_a_stub_replaces_only_the_chosen_region_at_its_indentation_and_keeps_the_markers():
    stubbed = stub_text(SOURCE, "f.py", {"01.8": "exercise 01.8: the second"})
    assert stubbed == SOURCE.replace("        return y\n",
                                     "        raise NotImplementedError('exercise 01.8: the second')\n")
    namespace: dict = {}
    exec(stub_text(SOURCE, "f.py", {"01.9": "nine"}), namespace)  # the rest still runs, up to the stub
    with pytest.raises(NotImplementedError, match="nine"):
        namespace["f"](1)


@pytest.mark.parametrize("broken", ["    # exercise 01.1: a\n", "    # end exercise\n",
                                    "    # exercise 01.1: a\n    # exercise 01.2: b\n    # end exercise\n"])
def test_markers_that_do_not_pair_up_are_refused(broken):
    with pytest.raises(RegionError):
        regions_in("def f():\n" + broken, "f.py")


def test_list_json_has_every_exercise_with_its_files_and_checks():
    done = course("list", "--json")
    listing = json.loads(done.stdout)
    assert done.returncode == 0 and listing["count"] == len(EXERCISES) >= 18 and len(listing["lessons"]) >= 10
    first = listing["exercises"][0]
    assert set(first) == {"id", "title", "lesson", "section", "difficulty", "files", "checks"}
    assert all((ROOT / path).is_file() for e in listing["exercises"] for path in e["files"])


@pytest.mark.parametrize("argv, message", [
    (["check", "99.9", "--dir", "."], "no exercise 99.9"),
    (["check", "09.1", "--dir", "no/such/folder"], "no folder no/such/folder"),
    (["check", "09.1", "--dir", "lessons"], "lessons is not a course workspace"),
    (["check", "--dir", "."], "check takes one exercise id or --all"),
    (["new", "x", "--exercise", "99.9"], "no exercise 99.9"),
    (["new", "lessons", "--exercise", "09.1"], "lessons exists and is not an empty folder"),
    (["new", "x", "--lesson", "99"], "lesson 99 has no exercises"),
    (["list", "--lesson", "99"], "lesson 99 has no exercises"),
    (["new", "/proc/minipar-ws", "--exercise", "09.1"], "cannot write the workspace /proc/minipar-ws"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message):
    done = course(*argv)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith("minipar course: error: ") and message in done.stderr
    assert done.stderr.count("\n") == 1


def test_a_workspace_made_for_an_exercise_this_minipar_lacks_is_one_line_and_exit_2(tmp_path):
    workspace.create(tmp_path / "ws", [BY_ID["09.1"]])
    (tmp_path / "ws" / workspace.MANIFEST).write_text(json.dumps({"exercises": ["99.9"]}))
    done = course("check", "--all", "--dir", str(tmp_path / "ws"))
    assert done.returncode == 2 and "made for exercise 99.9, which this minipar does not have" in done.stderr


def test_the_checks_run_the_workspace_code_and_the_guard_refuses_another(tmp_path):
    workspace.create(tmp_path / "ws", [BY_ID["09.1"]])
    stub = (tmp_path / "ws/minipar/precision/formats.py").read_text()
    assert ("raise NotImplementedError(\"exercise 09.1 (lesson 09, section 'Emulating bf16 in four lines'): "
            "bf16 rounding to nearest, ties to even\")") in stub
    assert json.loads((tmp_path / "ws" / workspace.MANIFEST).read_text())["exercises"] == ["09.1"]
    assert not (tmp_path / "ws/.git").exists() and (tmp_path / "ws/tests/conftest.py").is_file()
    check = BY_ID["09.1"].checks[0]
    tree = grading.prepare([BY_ID["09.1"]], tmp_path / "ws", tmp_path / "grader")
    outcome = grading.run_check(check, 1, tree)
    assert not outcome.passed and "NotImplementedError: exercise 09.1" in outcome.detail
    (tmp_path / "other").mkdir()  # a tree with no minipar: the import finds the reference, refused
    refused = grading.run_check(check, 1, tmp_path / "other")
    assert not refused.passed and "not the graded tree" in refused.detail


def test_a_lesson_excerpt_that_shows_a_stubbed_region_loses_its_body_and_no_other(tmp_path):
    workspace.create(tmp_path / "ws", [BY_ID["02.1"]])
    lesson = (tmp_path / "ws/lessons/02_collectives.md").read_text()
    assert "```python excerpt minipar/distributed/collectives.py\n...\n```" in lesson
    assert "partial = flat[start:stop] + wire.decode(received)" not in lesson
    workspace.create(tmp_path / "other", [BY_ID["02.2"]])  # the all-gather: the excerpt shows none of it
    unchanged = (ROOT / "lessons/02_collectives.md").read_text()
    assert (tmp_path / "other/lessons/02_collectives.md").read_text() == unchanged


def test_an_exercise_fails_on_its_stub_and_passes_on_the_solution():
    # 09.2, two checks; 01.1 goes the whole way round through the command line (the test below)
    assert selftest.selftest(BY_ID["09.2"]) == []


def test_selftest_reports_a_check_that_passes_on_the_stub():
    """A check that never reaches its region grades nothing, and selftest must say so: 01.1's region
    (softmax's backward) graded by the log_softmax case of its test, which has a backward of its own."""
    wrong = Check(BY_ID["01.1"].checks[0].node.replace("[softmax]", "[log_softmax]"), "a hint")
    assert selftest.selftest(replace(BY_ID["01.1"], checks=(wrong,))) == [
        "passes on the stub: tests/core/test_functional.py::test_softmax_and_log_softmax[log_softmax] "
        "(1 process)"]


def test_check_exits_1_on_a_stub_and_0_once_solved_and_grades_a_workspace_in_json(tmp_path):
    assert course("new", str(tmp_path / "ws"), "--exercise", "01.1", "--exercise", "09.1").returncode == 0
    failing = course("check", "01.1", "--dir", str(tmp_path / "ws"))
    assert failing.returncode == 1 and "FAIL  tests/core/test_functional.py::" in failing.stdout
    assert "NotImplementedError: exercise 01.1 (lesson 01, section 'Checking a gradient')" in failing.stdout
    assert "hint: " in failing.stdout and failing.stdout.endswith("0 of 1 checks passed\n")
    workspace.restore(tmp_path / "ws", workspace.files_of("01.1"))
    graded = course("check", "--all", "--json", "--dir", str(tmp_path / "ws"))
    report = json.loads(graded.stdout)
    assert [e["id"] for e in report["exercises"]] == ["01.1", "09.1"]  # what the workspace was given
    assert graded.returncode == 1 and not report["passed"]
    assert [e["passed"] for e in report["exercises"]] == [True, False]
    assert report["exercises"][1]["checks"][0]["hint"].startswith("bf16 is the top 16 bits")
