"""`python -m minipar train | plan | schedule | simulate | bench | course | plot` (or the script `minipar`).

The command line's front door, above every layer (bench included): it only dispatches. Bad input ends
every rank with one line naming the problem and exit code 2, before any collective: every rank parses
and validates the same arguments on its own, so no rank waits for another. Every command first keeps
freed memory in the process (core/allocator.py: no page faults for each step's fresh activations) and
takes the BLAS that MINIPAR_BLAS names (core/blas.py: NumPy's by default, or Intel's MKL).
Lesson: lessons/00_overview.md.
"""

from __future__ import annotations

import sys

from minipar.bench import registry
from minipar.core import blas
from minipar.core.allocator import keep_freed_memory
from minipar.course import command as course
from minipar.dist.watchdog import timeout_from_env
from minipar.plot import registry as plot_registry
from minipar.trainer import commands
from minipar.trainer.arguments import fail

COMMANDS = {
    "train": commands.train_main,
    "plan": commands.plan_main,
    "schedule": commands.schedule_main,
    "simulate": commands.simulate_main,
    "bench": registry.main,
    "course": course.main,
    "plot": plot_registry.main,
}

STARTS_RANKS = ("train", "bench", "course")  # the commands whose collectives the watchdog times


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        if argv and argv[0] in ("-h", "--help"):
            print(f"usage: minipar {{{','.join(COMMANDS)}}} [options]   (minipar COMMAND --help for details)")
            return 0
        return fail("minipar", f"choose a command: {', '.join(COMMANDS)}")
    keep_freed_memory()
    try:
        blas.use_from_env()
    except ValueError as why:  # every rank reads the same variable: all of them stop here, at once
        return fail("minipar", str(why))
    if argv[0] in STARTS_RANKS:
        try:
            timeout_from_env()  # every rank reads the same variable: a typo stops all of them, at once
        except ValueError as why:
            return fail(f"minipar {argv[0]}", str(why))
    return COMMANDS[argv[0]](argv[1:])
