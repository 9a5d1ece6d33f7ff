"""`python -m minipar bench NAME [options]`: every benchmark by name, and `bench all` for the quick ones.

Each benchmark is a file of this package with a `main(argv) -> int`; its docstring says what it
measures, which lesson quotes it and its options. Times are taken as minipar_lab/bench/timing.py says.
A bench's `--plot FILE` without matplotlib (canvas.NoMatplotlib) is a one-line error, exit code 2.

    python -m minipar bench NAME [options]     NAME: one of BENCHES below, or all (QUICK)
"""

from __future__ import annotations

import importlib

from minipar.trainer.arguments import fail
from minipar_lab.bench.canvas import NoMatplotlib

BENCHES = ("autograd", "dp", "pp", "tp", "fusion", "precision", "layouts", "memory", "tracer", "gpu",
           "recompute", "context", "simulate", "profile", "zero3", "checkpoint", "trace", "saved", "fp8")
QUICK = ("autograd", "dp", "pp", "tp", "fusion", "precision")  # what `bench all` runs (gpu needs a GPU)


def main(argv) -> int:
    """Run the benchmark argv[0] (or each of QUICK for "all") with the options argv[1:]."""
    if not argv or argv[0] not in (*BENCHES, "all"):
        return fail("minipar bench", f"choose one of {', '.join(BENCHES)}, all")
    names = QUICK if argv[0] == "all" else (argv[0],)
    for name in names:
        print(f"== bench {name}", flush=True)
        try:
            code = importlib.import_module(f"minipar_lab.bench.{name}").main(argv[1:])
        except NoMatplotlib as missing:  # a bench's --plot FILE
            return fail(f"minipar bench {name}", str(missing))
        if code:
            return code
    return 0
