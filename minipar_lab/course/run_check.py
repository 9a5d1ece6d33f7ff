"""Run one check's pytest with the grader's plugin, loaded by file path: `python run_check.py PYTEST-ARGS`.

grading.run_check starts this file by its path in the reference (under mpiexec for a multi-rank check),
with PYTHONPATH the graded tree; the plugin (workspace_guard.py, beside this file) is loaded from its
file, so no copy of it on the import path can stand in for it.
"""

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str]) -> int:
    del sys.path[0]  # this folder: the tests import from the graded tree only
    import pytest

    spec = importlib.util.spec_from_file_location("minipar_course_grader_plugin", HERE / "workspace_guard.py")
    plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plugin)
    return int(pytest.main(argv, plugins=[plugin]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
