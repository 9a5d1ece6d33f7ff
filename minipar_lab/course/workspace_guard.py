"""A pytest plugin for `course check`: stop at once unless `import minipar` is the workspace's code.

The checks are the reference's tests run against a workspace (PYTHONPATH=workspace, ahead of the
editable install of the reference). Should the path ever resolve to another copy, every check would
grade the reference instead of the student, and pass; this plugin makes that a loud error instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def pytest_configure(config):
    import minipar

    workspace = Path(os.environ["MINIPAR_COURSE_WORKSPACE"]).resolve()
    imported = Path(minipar.__file__).resolve()
    if workspace not in imported.parents:
        pytest.exit(f"course check: import minipar found {imported}, not the workspace {workspace}",
                    returncode=3)
