"""The grader's verdict, screen and splice, on fake reports and small files (fast: no grading run but one).

The verdict (grading.verdict) is judged here on reports as the grader's plugin writes them, one per rank:
each test below is the bug it catches, named. Grading runs of whole exercises and of the bank of wrong
solutions are `make course-selftest`'s.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from minipar_lab.course import grading, splice, workspace
from minipar_lab.course.exercises import BY_ID, EXERCISES
from minipar_lab.course.regions import regions_under

ROOT = Path(__file__).resolve().parents[2]
NODE = "tests/distributed/test_collectives.py::test_ring_reduce_scatter"


def rank_report(rank: int, outcome: str = "passed", node: str = NODE, message: str = "", **extra) -> dict:
    tests = {node: {"outcome": outcome, "message": message}} if outcome else {}
    return {"rank": rank, "size": 2, "exitstatus": 0, "tests": tests, "collect_errors": [], **extra}


def every_rank(ranks: int, **kwargs) -> dict:
    return {rank: rank_report(rank, **kwargs) for rank in range(ranks)}


def test_every_rank_passing_with_exit_code_0_is_a_pass():
    assert grading.verdict(NODE, 2, 0, every_rank(2)) == (True, "")
    assert grading.verdict(NODE, 1, 0, every_rank(1)) == (True, "")


def test_a_nonzero_exit_code_fails_even_if_every_report_says_passed():
    """Catches a verdict that drops `returncode == 0` (the code under test exiting 1 after its tests)."""
    passed, detail = grading.verdict(NODE, 2, 1, every_rank(2))
    assert not passed and "exit code is 1" in detail


def test_a_partial_pass_fails_and_shows_the_failing_rank_assertion():
    """One parametrized case of three failed: '1 failed, 2 passed' is no pass."""
    message = ("E   mpi_harness.MultiRankFailure: failed on rank(s) [1] of 2:\n"
               "E   ----- rank 1 -----\nE   Traceback (most recent call last):\n"
               "E     File \"t.py\", line 3, in body\nE       assert traffic == expected\n"
               "E   AssertionError: bytes sent 96 != 64\n")
    reports = {rank: {**rank_report(rank), "tests": {
        NODE + "[a]": {"outcome": "passed", "message": ""},
        NODE + "[b]": {"outcome": "failed", "message": message},
        NODE + "[c]": {"outcome": "passed", "message": ""}}} for rank in range(2)}
    passed, detail = grading.verdict(NODE, 2, 1, reports)
    assert not passed and "rank 1: AssertionError: bytes sent 96 != 64" in detail
    # and with the exit code a cheat forced to 0, the reports still fail it
    assert not grading.verdict(NODE, 2, 0, reports)[0]


def test_a_failed_comparison_of_a_run_says_what_it_compared_and_where():
    """numpy's assert_allclose raises 'AssertionError:' with an empty first line: the detail runs it on
    into the next line (not 'AssertionError: | Not equal'), and names the test's line that compared,
    here the losses, not the harness's frames around it."""
    message = ("E   mpi_harness.MultiRankFailure: failed on rank(s) [0] of 2:\nE   ----- rank 0 -----\n"
               "E   Traceback (most recent call last):\n"
               "E     File \"/tmp/g/graded/tests/mpi_harness.py\", line 158, in _outcome_of\nE       body()\n"
               "E     File \"/tmp/g/graded/tests/parallel/test_zero.py\", line 46, in assert_matches\n"
               "E       np.testing.assert_allclose(losses, reference, rtol=1e-9, atol=0)\n"
               "E     File \"/venv/numpy/testing/_private/utils.py\", line 983, in assert_array_compare\n"
               "E       raise AssertionError(msg)\nE   AssertionError: \n"
               "E   Not equal to tolerance rtol=1e-09, atol=0\nE   \nE   Mismatched elements: 1 / 3 (33.3%)\n"
               "E   Mismatch at index:\nE    [2]: 2.5625552414 (ACTUAL), 2.5625552234 (DESIRED)\n")
    assert grading.assertion_of(message) == (
        "rank 0: AssertionError: Not equal to tolerance rtol=1e-09, atol=0 | Mismatched elements: 1 / 3 "
        "(33.3%) | Mismatch at index: [2]: 2.5625552414 (ACTUAL), 2.5625552234 (DESIRED) (at "
        "tests/parallel/test_zero.py:46: np.testing.assert_allclose(losses, reference, rtol=1e-9, atol=0))")


def test_a_skipped_check_is_no_pass():
    """Catches a verdict that drops the skip rule: a check that did not run graded PASS."""
    passed, detail = grading.verdict(NODE, 2, 0, every_rank(2, outcome="skipped", message="needs 4 ranks"))
    assert not passed and "did not run" in detail and "needs 4 ranks" in detail


def test_an_error_in_setup_or_teardown_is_no_pass():
    passed, detail = grading.verdict(NODE, 1, 1, every_rank(1, outcome="error", message="E   OSError: x\n"))
    assert not passed and "error" in detail and "OSError: x" in detail


def test_a_check_whose_test_was_not_collected_is_no_pass():
    passed, detail = grading.verdict(NODE, 1, 0, {0: rank_report(0, node="tests/other.py::test_x")})
    assert not passed and "did not run" in detail


def test_a_test_file_that_does_not_load_is_no_pass():
    passed, detail = grading.verdict(NODE, 1, 2, {0: rank_report(0, outcome="", collect_errors=[
        "tests/x.py: E   ImportError: cannot import name 'ring'\n"])})
    assert not passed and "did not load" in detail and "ImportError" in detail


@pytest.mark.parametrize("missing", [0, 1, 2])
def test_every_rank_must_report(missing):
    """Catches a verdict that reads rank 0 only, or that runs a check at fewer ranks than asked: a rank
    that crashed (killed, aborted) wrote no report."""
    reports = every_rank(3)
    reports[missing] = None
    passed, detail = grading.verdict(NODE, 3, 0, reports)
    assert not passed and f"on 3 ranks, rank(s) [{missing}] wrote no report" in detail


def test_a_crash_before_any_report_is_no_pass():
    passed, detail = grading.verdict(NODE, 2, 134, {0: None, 1: None}, "lots\nSegmentation fault\n")
    assert not passed and "exit code 134" in detail and "Segmentation fault" in detail


def test_a_rank_that_aborted_the_job_shows_its_own_assertion():
    """The harness aborts the job when one rank failed and the others wait in a collective it skipped;
    its traceback (MINIPAR_TEST_REPORT_DIR/rank-R.txt) is the failure shown, not mpiexec's last words."""
    aborted = ("[rank 1] failed, and 10 s later the other ranks are still in the test body, probably "
               "waiting in a collective this rank never reached; aborting the job.\n[rank 1] Traceback "
               "(most recent call last):\n  File \"x.py\", line 1, in f\nAssertionError: wrong chunk\n")
    passed, detail = grading.verdict(NODE, 2, 1, {0: None, 1: None}, "MPI_ABORT was invoked\n",
                                     {1: aborted})
    assert not passed and detail.startswith("on 2 ranks, rank 1 aborted the job")
    assert "AssertionError: wrong chunk" in detail
    hung = "[rank 0] t still running after 60 s (MINIPAR_TEST_DEADLOCK_S): a deadlock?\n  File x\n"
    passed, detail = grading.verdict(NODE, 2, 1, {0: None, 1: None}, "", {0: hung})
    assert not passed and "still running after 60 s" in detail


def test_a_hang_is_no_pass():
    passed, detail = grading.verdict(NODE, 2, None, every_rank(2))
    assert not passed and "a hang" in detail


def test_printed_output_does_not_change_the_verdict():
    """A summary printed by the code under test ('1 passed') is display only."""
    assert not grading.verdict(NODE, 1, 0, {0: None}, "===== 1 passed in 0.1s =====\n")[0]
    failing = every_rank(1, outcome="failed", message="E   AssertionError: no\n")
    assert not grading.verdict(NODE, 1, 0, failing, "===== 1 passed in 0.1s =====\n")[0]


def test_every_rank_count_of_every_check_is_run_and_reported(monkeypatch, tmp_path):
    """Catches a grader that runs each check at its first rank count only (ring bugs are invisible at 2)."""
    ran = []

    def fake_run(check, ranks, tree):
        ran.append((check.node, ranks))
        return grading.Outcome(check, ranks, ranks != 3, 0.0, "" if ranks != 3 else "failed at 3")

    monkeypatch.setattr(grading, "run_check", fake_run)
    monkeypatch.setattr(grading, "prepare", lambda exercises, submission, into, reference=ROOT: into)
    exercise = BY_ID["02.1"]
    outcomes = grading.run_exercise(exercise, tmp_path)
    assert ran == [(check.node, ranks) for check in exercise.checks for ranks in check.ranks or (1,)]
    assert [(o.ranks, o.passed) for o in outcomes if o.check is exercise.checks[0]] == [
        (ranks, ranks != 3) for ranks in exercise.checks[0].ranks]
    assert 3 in exercise.checks[0].ranks and 4 in exercise.checks[0].ranks


def test_a_failing_check_names_the_command_that_reruns_it_under_mpiexec():
    outcome = grading.Outcome(BY_ID["02.1"].checks[0], 3, False, 1.0, "rank 2: AssertionError")
    assert outcome.rerun == f"mpiexec -n 3 python -m pytest -x -q {NODE}"
    rerun = f"rerun (in the workspace): mpiexec -n 3 python -m pytest -x -q {NODE}"
    assert rerun in grading.describe(outcome)


# ---- the screen: what a region may not name ----------------------------------------------------------

@pytest.mark.parametrize("body, word", [
    ("    import os\n", "import"),
    ("    from sys import exit\n", "import"),
    ("    gc.collect()\n", "'gc'"),
    ("    sys.stdout.write('1 passed')\n", "'sys'"),
    ("    open('/tmp/x', 'w').write('1 passed')\n", "'open'"),
    ("    exec('x = 1')\n", "'exec'"),
    ("    eval('1')\n", "'eval'"),
    ("    __import__('os').exit(0)\n", "'__import__'"),
    ("    builtins.print(1)\n", "'builtins'"),
    ("    _pytest.capture\n", "'_pytest'"),
    ("    mpi4py.MPI\n", "'mpi4py'"),
    ("    raise SystemExit(0)\n", "'SystemExit'"),
    ("    exit(0)\n", "'exit'"),
    ("    getattr(ring, '_secret')\n", "'getattr'"),
    ("    ring.comm._ledger = None\n", "'_ledger'"),
    ("    x = ring.__class__\n", "'__class__'"),
    ("    self.__dict__['x'] = 1\n", "'__dict__'"),
    ("    y = (\n", "does not parse"),
])
def test_the_screen_refuses_in_one_line(body, word):
    with pytest.raises(splice.Refused) as refused:
        splice.screen(body, "f.py (exercise 02.1)")
    assert word in str(refused.value) and "\n" not in str(refused.value)


def test_the_screen_lets_every_reference_region_through():
    for region in regions_under(ROOT):
        lines = (ROOT / region.path).read_text().splitlines(keepends=True)[region.start + 1:region.end]
        splice.screen("".join(lines), region.path)  # raises on a reference region: the rule is too strict


def test_the_splice_takes_only_the_regions_text_and_refuses_a_line_that_leaves_the_function(tmp_path):
    submission = tmp_path / "sub"
    workspace.create(submission, [BY_ID["09.1"]])
    stubbed = (submission / "minipar/precision/formats.py").read_text()
    (submission / "minipar/precision/formats.py").write_text("# the student's own top\n" + stubbed)
    (submission / "tests/precision/test_precision.py").write_text("def test_nothing(): pass\n")
    tree = tmp_path / "tree"
    splice.copy_tree(ROOT, tree)
    assert splice.splice(["09.1"], submission, tree, ROOT) == ["minipar/precision/formats.py"]
    graded = (tree / "minipar/precision/formats.py").read_text()
    assert graded == stubbed  # the reference's file, its region the student's (here the stub)
    assert (tree / "tests/precision/test_precision.py").read_text() == (
        ROOT / "tests/precision/test_precision.py").read_text()
    stub_line = "    raise NotImplementedError("
    escaping = stubbed.replace(stub_line, "def cheat():\n" + stub_line, 1)
    (submission / "minipar/precision/formats.py").write_text(escaping)
    with pytest.raises(splice.Refused, match="indented less than its marker"):
        splice.splice(["09.1"], submission, tree, ROOT)
    (submission / "minipar/precision/formats.py").write_text(stubbed.replace("# end exercise", "# the end"))
    with pytest.raises(splice.Refused, match="starts inside exercise 09.1"):
        splice.splice(["09.1"], submission, tree, ROOT)


def test_loose_files_are_found_by_name(tmp_path):
    (tmp_path / "formats.py").write_text("x")
    assert splice.find_submitted(tmp_path, "minipar/precision/formats.py") == tmp_path / "formats.py"
    with pytest.raises(splice.Refused, match="has no minipar/simulate/model.py"):
        splice.find_submitted(tmp_path, "minipar/simulate/model.py")


# ---- the command line --------------------------------------------------------------------------------

def course(*argv, cwd=ROOT, env=None):
    return subprocess.run([sys.executable, "-m", "minipar", "course", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.mark.parametrize("manifest", ["", "{\"exercises\": [\"09", "{\"exercises\": []}", "[]", "{}",
                                      "{\"exercises\": \"09.1\"}"])
def test_check_all_on_a_broken_manifest_is_one_line_and_exit_2(tmp_path, manifest):
    (tmp_path / workspace.MANIFEST).write_text(manifest)
    done = course("check", "--all", "--dir", str(tmp_path))
    assert (done.returncode, done.stdout) == (2, "") and done.stderr.count("\n") == 1, done.stderr
    assert workspace.MANIFEST in done.stderr


def test_a_refused_region_is_one_line_and_exit_2_before_any_test(tmp_path):
    workspace.create(tmp_path / "ws", [BY_ID["09.1"]])
    path = tmp_path / "ws/minipar/precision/formats.py"
    path.write_text(path.read_text().replace(
        "    raise NotImplementedError(",
        "    print('1 passed')\n    sys.exit(0)\n    raise NotImplementedError(", 1))
    done = course("check", "09.1", "--dir", str(tmp_path / "ws"))
    assert (done.returncode, done.stdout) == (2, "exercise 09.1: bf16 rounding to nearest, ties to even\n")
    assert done.stderr.count("\n") == 1 and "refused, no test run" in done.stderr and "'sys'" in done.stderr
    out = tmp_path / "results.json"
    done = course("check", "--submission", str(tmp_path / "ws"), "--exercise", "09.1",
                  "--format", "gradescope", "--out", str(out))
    results = json.loads(out.read_text())
    assert done.returncode == 2 and results["score"] == 0 and "'sys'" in results["output"]


def test_the_grader_of_a_workspace_refuses_to_grade(tmp_path):
    """Run inside a workspace (its package first on the path), the grader is the student's copy: it
    refuses."""
    workspace.create(tmp_path / "ws", [BY_ID["09.1"]])
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path / "ws")}
    done = course("check", "09.1", cwd=tmp_path / "ws", env=env)
    assert done.returncode == 2 and "this grader is a workspace's copy" in done.stderr


def test_submission_and_exercise_bad_input_is_one_line_and_exit_2(tmp_path):
    for argv, message in [(["--submission", str(tmp_path)], "--submission needs --exercise ID"),
                          (["--submission", str(tmp_path / "no"), "--exercise", "09.1"], "no folder"),
                          (["--submission", str(tmp_path), "--exercise", "99.9"], "99.9"),
                          (["09.1", "--exercise", "09.1"], "--exercise goes with --submission")]:
        done = course("check", *argv)
        assert done.returncode == 2 and message in done.stderr and done.stderr.count("\n") == 1, argv


def test_gradescope_results_have_the_fields_gradescope_reads():
    check = BY_ID["02.1"].checks[0]
    results = {"02.1": [grading.Outcome(check, 2, True, 1.0, ""),
                        grading.Outcome(check, 3, False, 1.0, "rank 2: AssertionError: x")]}
    from minipar_lab.course.command import gradescope
    report = gradescope(results, 12.3)
    assert set(report) == {"tests", "execution_time", "output"} and report["output"] == "1 of 2 checks passed"
    first, second = report["tests"]
    assert set(first) == {"name", "number", "score", "max_score", "status", "output", "visibility"}
    assert (first["score"], second["score"], second["status"]) == (1.0, 0.0, "failed")
    assert "rank 2: AssertionError: x" in second["output"]
    assert "mpiexec -n 3 python -m pytest" in second["output"]
    assert check.hint in second["output"]


def test_the_edited_guard_tests_and_conftest_of_a_workspace_are_not_what_grades(tmp_path):
    """The cheats reproduced in issue 42, all at once on an unsolved stub: a guard plugin that turns failed
    into passed, a test that asserts nothing, a conftest that skips everything. Graded FAIL."""
    ws = tmp_path / "ws"
    workspace.create(ws, [BY_ID["09.1"]])
    guard = ws / "minipar_lab/course/workspace_guard.py"
    guard.write_text(guard.read_text() + "\n\ndef pytest_runtest_logreport(report):\n"
                     "    report.outcome = 'passed'\n")
    (ws / "tests/precision/test_precision.py").write_text("def test_bf16_named_cases():\n    pass\n")
    (ws / "tests/conftest.py").write_text("import pytest\n\n@pytest.fixture(autouse=True)\ndef s():\n"
                                          "    pytest.skip('x')\n")
    done = course("check", "--submission", str(ws), "--exercise", "09.1", "--format", "json")
    report = json.loads(done.stdout)
    assert done.returncode == 1 and not report["passed"]
    assert all("NotImplementedError: exercise 09.1" in c["detail"] for c in report["exercises"][0]["checks"])


def test_the_registry_has_more_than_one_rank_count_for_every_ring():
    rings = [c for e in EXERCISES if e.id in ("02.1", "02.2") for c in e.checks if "test_ring" in c.node]
    assert rings and all({3, 4} <= set(c.ranks) for c in rings if "all_reduce" not in c.node)
