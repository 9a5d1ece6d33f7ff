"""`python -m minipar train | plan | schedule | simulate | trace | launch | bench | course | plot`.

The command line's front door, above every layer: it only dispatches. `bench`, `plot` and `course` are
the lab's (minipar_lab, a sibling package: the reference never imports it): they are found through the
entry points of the group `minipar.commands`, and without the lab each says so in one line, exit 2.
Bad input ends every rank with one line naming the problem and exit code 2, before any collective:
every rank parses and validates the same arguments on its own, so no rank waits for another. Every
command first installs the speed layer's forms of the hot kernels (minipar/speed/install.py: the
in-place, tiled GELU and AdamW rules, which give the plain forms' bits, and freed memory kept in the
process; MINIPAR_KERNELS=plain runs core's plain forms) and the BLAS that MINIPAR_BLAS names (NumPy's
by default, or Intel's MKL).
Lesson: lessons/00_overview.md.
"""

from __future__ import annotations

import sys
from importlib.metadata import entry_points

from minipar.distributed.watchdog import timeout_from_env

REFERENCE_COMMANDS = ("train", "plan", "schedule", "simulate", "trace")  # trainer/'s
LAB_COMMANDS = ("bench", "course", "plot")  # minipar_lab's, through its entry points
LAB_GROUP = "minipar.commands"
COMMANDS = (*REFERENCE_COMMANDS, "launch", *LAB_COMMANDS)
STARTS_RANKS = ("train", "launch", "bench", "course")  # the commands whose collectives the watchdog times


def without_mpi() -> None:
    """`minipar launch` is the restart supervisor (trainer/elastic.py), a process outside the MPI job:
    importing mpi4py's MPI (the checkpoint's checks reach it) must not start MPI in it."""
    import mpi4py

    mpi4py.rc.initialize = mpi4py.rc.finalize = False


def lab_command(name: str):
    """The lab's `main` for the command `name`, or None when no installed package provides it."""
    found = [point for point in entry_points(group=LAB_GROUP) if point.name == name]
    return found[0].load() if found else None


def reference_command(name: str):
    from minipar.trainer import commands, trace_summary

    return {"train": commands.train_main, "plan": commands.plan_main, "schedule": commands.schedule_main,
            "simulate": commands.simulate_main, "trace": trace_summary.trace_main}[name]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "launch":  # before anything imports mpi4py's MPI (trainer/ does)
        without_mpi()
    from minipar.speed.install import install_from_env
    from minipar.trainer.arguments import fail  # imports mpi4py's MPI, which starts MPI (train's ranks)

    if not argv or argv[0] not in COMMANDS:
        if argv and argv[0] in ("-h", "--help"):
            print(f"usage: minipar {{{','.join(COMMANDS)}}} [options]   (minipar COMMAND --help for details)")
            return 0
        return fail("minipar", f"choose a command: {', '.join(COMMANDS)}")
    try:
        install_from_env()
    except ValueError as why:  # every rank reads the same variable: all of them stop here, at once
        return fail("minipar", str(why))
    if argv[0] in STARTS_RANKS:
        try:
            timeout_from_env()  # every rank reads the same variable: a typo stops all of them, at once
        except ValueError as why:
            return fail(f"minipar {argv[0]}", str(why))
    if argv[0] == "launch":
        from minipar.trainer.elastic import launch_main

        return launch_main(argv[1:])
    if argv[0] in REFERENCE_COMMANDS:
        return reference_command(argv[0])(argv[1:])
    command = lab_command(argv[0])
    if command is None:
        return fail("minipar", f"`{argv[0]}` is a command of the lab (minipar_lab), which is not installed: "
                               "run `pip install -e .` in the repository (make setup)")
    return command(argv[1:])
