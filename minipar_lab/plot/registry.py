"""`python -m minipar plot WHAT [--out DIR] [options]`: every figure by name, and `plot all` for the set
the lessons embed (`make figures`: `plot all --out lessons/figures`).

Each figure is a file of this package with `FILE` (the PNG's name), `add_arguments(parser)` and
`draw(args, path)`; its docstring says what it draws, from which command's data, and for which lesson.
Defaults are small, so that `plot all` regenerates every picture in well under a minute on 2 cores.
"""

from __future__ import annotations

import importlib
import os
import time
from pathlib import Path

from minipar.trainer.arguments import OneLineParser, fail
from minipar_lab.bench import canvas

FIGURES = ("loss", "gantt", "gantt_v", "bubble", "zero", "allreduce", "offload", "roofline",  # drawn here
           "trace", "precision", "context", "simulate", "fp8")  # drawn by a benchmark's own --plot


def parser_of(name: str, module) -> OneLineParser:
    p = OneLineParser(prog=f"minipar plot {name}", description=(module.__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("."), help="folder for the PNG (made if missing)")
    module.add_arguments(p)
    return p


def draw(name: str, argv: list[str]) -> Path:
    module = importlib.import_module(f"minipar_lab.plot.{name}")
    args = parser_of(name, module).parse_args(argv)
    try:  # before any figure is computed: a run or a benchmark must not be wasted on a bad --out
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"--out {args.out}: cannot make the folder ({error.strerror})") from None
    if not os.access(args.out, os.W_OK | os.X_OK):
        raise ValueError(f"--out {args.out}: the folder is not writable")
    path = args.out / module.FILE
    canvas.pyplot()  # no matplotlib: say so now, not after a figure's training runs or measurements
    module.draw(args, path)
    if not path.is_file():  # a figure that returned without drawing must not be printed as drawn
        raise canvas.NoMatplotlib(f"no {path} was written (is matplotlib installed? pip install -e '.[viz]')")
    return path


def main(argv) -> int:
    """Draw the figure argv[0] (or every one of FIGURES for "all", each with its defaults)."""
    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: minipar plot {{{','.join(FIGURES)},all}} [--out DIR] [options]   "
              "(minipar plot WHAT --help for details)")
        return 0
    if not argv or argv[0] not in (*FIGURES, "all"):
        return fail("minipar plot", f"choose one of {', '.join(FIGURES)}, all")
    if argv[0] == "all":
        out = OneLineParser(prog="minipar plot all")
        out.add_argument("--out", default=".", help="folder for the PNGs (made if missing)")
        runs = [(name, ["--out", out.parse_args(argv[1:]).out]) for name in FIGURES]
    else:
        runs = [(argv[0], argv[1:])]
    for name, figure_argv in runs:
        started = time.perf_counter()
        try:
            path = draw(name, figure_argv)
        except (canvas.NoMatplotlib, FileNotFoundError, ValueError) as problem:
            return fail(f"minipar plot {name}", str(problem))
        print(f"plot {name}: {path} ({time.perf_counter() - started:.1f} s)", flush=True)
    return 0
