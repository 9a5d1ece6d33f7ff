"""The default GPT's loss in fp32, bf16 and each FP8 recipe, the delayed recipe's amax per step, and
one outlier channel against one scale and against tiles: bench fp8's own plot, at 10 steps (a
third of the bench's 30, so that `plot all` stays short), its tables left out.

    python -m minipar plot fp8 [--out DIR] [--steps 10]   (the same figure: bench fp8 --plot FILE)
Lesson: lessons/09b_fp8.md.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from minipar_lab.bench import fp8

FILE = "09b_fp8_bench.png"


def add_arguments(p) -> None:
    p.add_argument("--steps", type=int, default=10, help="training steps per run")


def draw(args, path: Path) -> None:
    with contextlib.redirect_stdout(io.StringIO()):  # the bench's tables: the lesson shows the figure
        code = fp8.main(["--steps", str(args.steps), "--plot", str(path)])
    if code:
        raise ValueError(f"bench fp8 failed with exit code {code}")
