"""Context parallelism: which rank computes each block of causal attention (contiguous and zig-zag
splits) and the activation peak per rank at cp = 1, 2, 4, drawn by bench context's own plot. The peaks
are bytes, not times, so one short run of each cp gives the same picture as the bench's defaults.

    python -m minipar plot context [--out DIR]
        (the same figure: bench context --steps 3 --warmup 2 --repeats 1 --plot FILE)
Lesson: lessons/13_context_parallel.md.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from minipar_lab.bench import context

FILE = "13_context_parallel.png"
BENCH_ARGS = ["--steps", "3", "--warmup", "2", "--repeats", "1"]


def add_arguments(p) -> None:
    """No options: bench context's cp = 1, 2, 4 on the default GPT."""


def draw(args, path: Path) -> None:
    with contextlib.redirect_stdout(io.StringIO()):  # the bench's table: the lesson shows it
        code = context.main([*BENCH_ARGS, "--plot", str(path)])
    if code:
        raise ValueError(f"bench context failed with exit code {code}")
