"""The import rule bites: `lint-imports` with the project's own contracts ([tool.importlinter] in
pyproject.toml), run on a copy of minipar and minipar_lab into which each kind of violation is planted;
and ruff's banned import, which keeps the lab out of every test but the lab's own.

`make lint` checks the real tree; this test checks the contracts themselves, so that a contract which
silently stopped checking (a layer order turned round, a cycle check too shallow, a forbidden list that
names a module that no longer exists) fails here. Each planted import sits inside a function where it
can, because the rule counts those too. Every message asserted below is first asserted absent from the
untouched copy, so no check passes because the tree already breaks it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"

def inside_a_function(statement: str) -> str:
    return f"def _planted_{statement.split()[-1].replace('.', '_')}():\n    {statement}  # noqa\n"


# (file to append to, code appended, what lint-imports must then report)
PLANTED = {
    "upward import": ("core/nn.py", inside_a_function("import minipar.trainer.loop"),
                      "minipar.core.nn -> minipar.trainer.loop"),
    "sibling import": ("memory/ledger.py", inside_a_function("import minipar.fusion.ir"),
                       "minipar.memory.ledger -> minipar.fusion.ir"),
    "cycle inside a package": ("distributed/communicator.py",
                               inside_a_function("import minipar.distributed.collectives"),
                               "No cycles are allowed in minipar.distributed."),
    "comm importing autograd": ("distributed/communicator.py",
                                inside_a_function("import minipar.core.autograd"),
                                "minipar.distributed is not allowed to import minipar.core.autograd"),
    "core importing mpi4py": ("core/backend.py", inside_a_function("import mpi4py"),
                              "minipar.core is not allowed to import mpi4py"),
    "core importing the speed layer": ("core/optim.py", inside_a_function("import minipar.speed.rules"),
                                       "minipar.core.optim -> minipar.speed.rules"),
    "the speed layer importing its sibling": ("speed/tiles.py",
                                              inside_a_function("import minipar.distributed.grid"),
                                              "minipar.speed.tiles -> minipar.distributed.grid"),
    "package outside the layers": ("extras/__init__.py", "", "- minipar.extras"),
    "the reference importing the lab": ("trainer/report.py",
                                        inside_a_function("import minipar_lab.bench.table"),
                                        "minipar.trainer.report -> minipar_lab.bench.table"),
    "bench importing plot, inside the lab": ("../minipar_lab/bench/table.py",
                                             inside_a_function("import minipar_lab.plot.loss"),
                                             "minipar_lab.bench.table -> minipar_lab.plot.loss"),
}


def copy_of_minipar(where: Path) -> Path:
    for package in ("minipar", "minipar_lab"):
        shutil.copytree(ROOT / package, where / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", where / "pyproject.toml")
    return where


def lint_imports(where: Path) -> str:
    """lint-imports' report on the copy at `where` (it puts its working directory first on sys.path)."""
    result = subprocess.run([str(LINT_IMPORTS), "--no-logo", "--no-cache"], cwd=where, capture_output=True,
                            text=True, timeout=120)
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def untouched_report(tmp_path_factory) -> str:
    return lint_imports(copy_of_minipar(tmp_path_factory.mktemp("untouched")))


@pytest.fixture(scope="module")
def planted_report(tmp_path_factory) -> str:
    where = copy_of_minipar(tmp_path_factory.mktemp("planted"))
    for relative, code, _ in PLANTED.values():
        path = where / "minipar" / relative
        path.parent.mkdir(exist_ok=True)
        with path.open("a") as file:
            file.write("\n\n" + code)
    return lint_imports(where)


def test_lint_imports_runs_with_the_project_contracts(untouched_report, planted_report):
    assert "Analyzed" in untouched_report, untouched_report
    assert "Analyzed" in planted_report, planted_report


@pytest.mark.parametrize("kind", list(PLANTED))
def test_each_planted_violation_is_reported(kind, untouched_report, planted_report):
    expected = PLANTED[kind][2]
    assert expected not in untouched_report, f"the untouched tree already reports {expected!r}"
    assert expected in planted_report, f"{kind}: lint-imports did not report {expected!r}:\n{planted_report}"


def test_the_root_package_modules_may_import_anything(untouched_report):
    # minipar/__init__.py imports core and __main__.py imports cli: neither is a layer.
    assert "minipar.__main__" not in untouched_report
    assert "minipar.__init__" not in untouched_report
    assert "not listed as layers" not in untouched_report


RUFF = Path(sys.executable).parent / "ruff"
LAB_IMPORT = "from minipar_lab.bench import table  # noqa: F401\n"


@pytest.mark.parametrize("where, banned", [("tests/parallel/test_planted.py", True),
                                           ("tests/test_planted.py", True),
                                           ("minipar/parallel/planted.py", True),
                                           ("tests/bench/test_planted.py", False),
                                           ("minipar_lab/plot/planted.py", False)])
def test_ruff_bans_the_lab_outside_the_lab_and_its_tests(tmp_path, where, banned):
    """A non-lab test (which lint-imports cannot see) or a minipar module importing the lab is reported;
    the lab and its own tests may import it."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    planted = tmp_path / where
    planted.parent.mkdir(parents=True)
    planted.write_text(LAB_IMPORT)
    done = subprocess.run([str(RUFF), "check", "--no-cache", "--select", "TID251", where], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert ("TID251" in done.stdout) == banned, done.stdout + done.stderr
    assert (done.returncode != 0) == banned
