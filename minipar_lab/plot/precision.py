"""bf16, fp16 and fp32 training curves (small gradients, large values), drawn by bench precision's own
plot: `minipar_lab.bench.precision` run with its defaults, its tables left out.

    python -m minipar plot precision [--out DIR]    (the same figure: bench precision --plot FILE)
Lesson: lessons/09_precision.md.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from minipar_lab.bench import precision

FILE = "09_precision_bench.png"


def add_arguments(p) -> None:
    """No options: bench precision's defaults."""


def draw(args, path: Path) -> None:
    with contextlib.redirect_stdout(io.StringIO()):  # the bench's tables: the lesson shows them
        code = precision.main(["--plot", str(path)])
    if code:
        raise ValueError(f"bench precision failed with exit code {code}")
