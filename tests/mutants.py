"""make mutants: how many plausible bugs the tests catch, measured the way issues 17 and 41 measured it.

Each mutant of the catalogue (tests/mutant_catalogue.py) is a one-place change of behaviour: a text
`old` that occurs exactly once in a file of minipar/ or minipar_lab/, replaced by `new`. The runner
copies the repository (the files git tracks or would track; no .venv, no caches) into a scratch folder once,
and for each mutant writes the changed file there, runs the tests of the touched package (tests/<package>/,
or the mutant's own list) with a timeout, serially and then under mpiexec on the mutant's world
sizes, and writes the original back. The working tree is never written to, so neither a crash nor
Ctrl-C can leave it patched; the scratch folder is removed at the end, Ctrl-C included.

Verdicts: "assertion" (a test failed; the first failing tests are named), "timeout" (a test ran past
its limit: pytest-timeout's --timeout, the multi-rank harness's deadlock watchdog, or the runner's
--run-limit on the whole run; the test that was running is named), "survived" (every test passed: a
gap, unless the mutant is marked equivalent with the reason). Before the mutants, each distinct test
run is made once on the unchanged copy (the baseline): a run that fails there would make every verdict
on it meaningless.

    .venv/bin/python tests/mutants.py                     # all of them (make mutants)
    .venv/bin/python tests/mutants.py --only watchdog     # the mutants whose name contains "watchdog"
    .venv/bin/python tests/mutants.py --list              # the catalogue, without running anything
    .venv/bin/python tests/mutants.py --only softmax --tests tests/core/test_functional.py
    .venv/bin/python tests/mutants.py --no-baseline --timeout 60     # seconds per test

Exit status: 0 when every mutant is caught or marked equivalent, 1 otherwise, 2 on a bad catalogue
or a failing baseline.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutant_catalogue import MUTANTS, Mutant  # noqa: E402

VENV_BIN = Path(sys.executable).parent
NODE_ID = re.compile(r"^(tests/\S+::\S+)(.*)$")  # pytest -v: the test's id, then its outcome once it has one
OUTCOME = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
TIMEOUT_MARKS = ("+ Timeout +", "still running after")  # pytest-timeout; tests/mpi_harness.py's watchdog


@dataclass
class Verdict:
    kind: str  # "assertion", "timeout", "survived"
    detail: str
    seconds: float


def tests_of(mutant: Mutant) -> list[str]:
    """The mutant's own test list, or the tests of the package it touches: minipar/<package>/..."""
    if mutant.tests:
        return list(mutant.tests)
    package = Path(mutant.file).parts[1]
    return [f"tests/{package}"]


def runs_of(mutant: Mutant) -> list[tuple[int, tuple[str, ...]]]:
    """(world size, tests) of each run: serial (1) first, then every multi-rank size."""
    tests = tuple(tests_of(mutant))
    return [(1, tests)] + [(ranks, tests) for ranks in mutant.ranks]


def check_catalogue(mutants: list[Mutant]) -> list[str]:
    """Every mutant names a file of minipar/ or minipar_lab/ in which `old` occurs exactly once and
    differs from `new`."""
    errors, names = [], set()
    for m in mutants:
        if m.name in names:
            errors.append(f"{m.name}: the name is used twice")
        names.add(m.name)
        path = REPO / m.file
        if not (m.file.startswith(("minipar/", "minipar_lab/")) and path.is_file()):
            errors.append(f"{m.name}: {m.file} is not a file of minipar/ or minipar_lab/")
            continue
        count = path.read_text().count(m.old)
        if count != 1 or m.old == m.new:
            errors.append(f"{m.name}: its old text occurs {count} times in {m.file} (must be once)")
        for test in tests_of(m):
            if not (REPO / test.split("::")[0]).exists():
                errors.append(f"{m.name}: no {test}")
    return errors


def copy_repository(scratch: Path) -> None:
    """The files git tracks or would track (untracked but not ignored), as they are now."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (scratch / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, scratch / name)


def environment(scratch: Path) -> dict[str, str]:
    env = dict(os.environ)
    # the scratch copy's minipar before the editable install's; no .pyc, which a same-size edit made
    # within the second of the original could leave stale
    env["PYTHONPATH"] = os.pathsep.join([str(scratch), str(scratch / "tests")])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    for threads in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(threads, "1")
    return env


def check_imports_from(scratch: Path) -> None:
    probe = subprocess.run([sys.executable, "-c", "import minipar; print(minipar.__file__)"], cwd=scratch,
                           env=environment(scratch), capture_output=True, text=True, check=True)
    if not Path(probe.stdout.strip()).resolve().is_relative_to(scratch.resolve()):
        sys.exit(f"mutants: the scratch copy imports minipar from {probe.stdout.strip()}, not from itself")


def command(ranks: int, tests: tuple[str, ...], limit_s: float) -> list[str]:
    pytest = [sys.executable, "-m", "pytest", "-v", "-x", "-rfE", "--no-header",
              "-o", f"timeout={int(limit_s)}", *tests]
    if ranks == 1:
        return pytest + ["-m", "not mpi"]
    return [str(VENV_BIN / "mpiexec"), "-n", str(ranks)] + pytest + ["-m", "mpi"]


CHILD: subprocess.Popen | None = None  # the run in progress, ended on Ctrl-C


def run_tests(scratch: Path, ranks: int, tests: tuple[str, ...], limit_s: float,
              run_limit_s: float = 1800) -> Verdict:
    """One pytest run in the scratch copy (each test limited to limit_s, the run to run_limit_s): its
    verdict, the running test named on a timeout."""
    global CHILD
    started = time.monotonic()
    CHILD = subprocess.Popen(command(ranks, tests, limit_s), cwd=scratch, env=environment(scratch),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        output, _ = CHILD.communicate(timeout=max(run_limit_s, limit_s + 30))
        killed = False
    except subprocess.TimeoutExpired:
        os.killpg(CHILD.pid, signal.SIGKILL)
        output, _ = CHILD.communicate()
        killed = True
    code, CHILD = CHILD.returncode, None
    seconds = time.monotonic() - started
    where = f" ({ranks} ranks)" if ranks > 1 else ""
    if killed or any(mark in output for mark in TIMEOUT_MARKS):
        return Verdict("timeout", running_test(output) + where, seconds)
    if code == 0 or (code == 5 and "no tests ran" in output):  # 5: nothing selected (no mpi tests there)
        return Verdict("survived", "", seconds)
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", output, flags=re.M)
    if failed:
        return Verdict("assertion", ", ".join(failed[:3]) + where, seconds)
    # no summary: the job ended inside a test, e.g. the multi-rank harness aborting it after a rank
    # failed while the others waited in a collective it never reached (its report is in the output)
    aborted = " (a rank failed and the job was aborted)" if "failed, and" in output else ""
    return Verdict("assertion", f"{running_test(output)}{where}, exit {code}{aborted}", seconds)


def running_test(output: str) -> str:
    """The last test pytest -v started and gave no outcome for: the one that was running."""
    started = None
    for line in output.splitlines():
        match = NODE_ID.match(line)
        if match:  # a timeout's banner may follow the id on its line: only an outcome ends the test
            started = None if OUTCOME.search(match.group(2)) else match.group(1)
    deadlock = re.search(r"\] (\S+::\S+) still running after", output)
    return started or (deadlock.group(1) if deadlock else "no test named")


def run_mutant(scratch: Path, mutant: Mutant, limit_s: float, run_limit_s: float) -> Verdict:
    target = scratch / mutant.file
    original = target.read_text()
    target.write_text(original.replace(mutant.old, mutant.new, 1))
    try:
        total, verdict = 0.0, Verdict("survived", "", 0.0)
        for ranks, tests in runs_of(mutant):
            verdict = run_tests(scratch, ranks, tests, limit_s, run_limit_s)
            total += verdict.seconds
            if verdict.kind != "survived":
                break
        verdict.seconds = total
        return verdict
    finally:
        target.write_text(original)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="run only the mutants whose name contains this text")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per test (default 300)")
    parser.add_argument("--run-limit", type=float, default=1800,
                        help="seconds per pytest run, a last resort if a hang escapes the test's limit")
    parser.add_argument("--no-baseline", action="store_true", help="skip the runs on the unchanged copy")
    parser.add_argument("--list", action="store_true", help="print the catalogue and stop")
    parser.add_argument("--tests", nargs="+", default=None,
                        help="run these tests instead of each mutant's (does this new test catch them?)")
    args = parser.parse_args(argv)
    mutants = [m for m in MUTANTS if args.only in m.name]
    if args.tests:
        mutants = [replace(m, tests=tuple(args.tests)) for m in mutants]
    errors = check_catalogue(mutants)
    if errors:
        print("mutants: the catalogue is out of date:\n  " + "\n  ".join(errors), file=sys.stderr)
        return 2
    if args.list:
        for m in mutants:
            sizes = " ".join(map(str, (1,) + m.ranks))
            print(f"{m.name:40} {m.file}  tests {' '.join(tests_of(m))}  world sizes {sizes}")
        return 0
    scratch = Path(tempfile.mkdtemp(prefix="minipar-mutants-"))
    verdicts: dict[str, Verdict] = {}
    try:
        copy_repository(scratch)
        check_imports_from(scratch)
        if not args.no_baseline:
            for ranks, tests in dict.fromkeys(run for m in mutants for run in runs_of(m)):
                base = run_tests(scratch, ranks, tests, args.timeout, args.run_limit)
                outcome = "passes" if base.kind == "survived" else f"FAILS ({base.kind}: {base.detail})"
                print(f"baseline {' '.join(tests)} on {ranks}: {outcome} ({base.seconds:.0f} s)", flush=True)
                if base.kind != "survived":
                    print("mutants: the tests fail on the unchanged copy; fix that first", file=sys.stderr)
                    return 2
        for m in mutants:
            verdicts[m.name] = verdict = run_mutant(scratch, m, args.timeout, args.run_limit)
            note = f" (equivalent: {m.equivalent})" if verdict.kind == "survived" and m.equivalent else ""
            print(f"{m.name:40} {verdict.kind:9} {verdict.seconds:6.0f} s  {verdict.detail}{note}",
                  flush=True)
    except KeyboardInterrupt:
        if CHILD is not None:
            os.killpg(CHILD.pid, signal.SIGKILL)
        print("\nmutants: interrupted; the working tree was never changed", file=sys.stderr)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return summary(mutants, verdicts)


def summary(mutants: list[Mutant], verdicts: dict[str, Verdict]) -> int:
    ran = [m for m in mutants if m.name in verdicts]
    kinds = [verdicts[m.name].kind for m in ran]
    caught = kinds.count("assertion") + kinds.count("timeout")
    gaps = [m.name for m in ran if verdicts[m.name].kind == "survived" and not m.equivalent]
    share = f"{100 * caught / len(ran):.0f}%" if ran else "-"
    print(f"\n{caught} of {len(ran)} caught ({share}): {kinds.count('assertion')} by an assertion, "
          f"{kinds.count('timeout')} by a timeout; {len(ran) - caught} survived "
          f"({len(ran) - caught - len(gaps)} marked equivalent)")
    for name in gaps:
        print(f"  survived: {name}")
    return 1 if gaps or len(ran) < len(mutants) else 0


if __name__ == "__main__":
    sys.exit(main())
