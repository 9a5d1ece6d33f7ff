"""`python -m minipar train | plan | schedule | bench` (also the console script `minipar`).

Bad input ends every rank with one line naming the problem and exit code 2, before any collective:
every rank parses and validates the same arguments on its own, so no rank waits for another.
Lesson: lessons/00_overview.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing

from minipar.trainer.arguments import OneLineParser
from minipar.trainer.config import TrainConfig
from minipar.trainer.validate import validate


def train_parser() -> argparse.ArgumentParser:
    """One flag per TrainConfig field, from its type, default and metadata (config.option)."""
    p = OneLineParser(prog="minipar train", description="Train a model under mpiexec in any layout.")
    types_of = typing.get_type_hints(TrainConfig)
    for field in dataclasses.fields(TrainConfig):
        if field.metadata.get("command_line", True):
            p.add_argument("--" + field.name.replace("_", "-"), **_argument(field, types_of[field.name]))
    return p


def _argument(field: dataclasses.Field, annotation) -> dict:
    """add_argument's keywords for one field: a bool is a switch, `X | None` takes an X."""
    help, choices, env = field.metadata["help"], field.metadata.get("choices"), field.metadata.get("env")
    if annotation is bool:
        if field.default is not False:
            raise TypeError(f"{field.name}: a command-line switch turns something on: default it to False")
        return {"action": "store_true", "help": help}
    if isinstance(annotation, types.UnionType):  # int | None: the option may be left out
        annotation = next(t for t in typing.get_args(annotation) if t is not type(None))
    keywords = {"type": annotation, "default": field.default, "help": help}
    if choices is not None:
        keywords["choices"] = choices
    if env is not None:  # None: not given, so parse_train_args reads the environment
        keywords["default"] = None
        keywords["help"] = f"{help} (default: ${env} if set, else {field.default})"
    return keywords


def parse_train_args(argv) -> TrainConfig:
    parser = train_parser()
    args = vars(parser.parse_args(argv))
    for field in dataclasses.fields(TrainConfig):
        env, choices = field.metadata.get("env"), field.metadata.get("choices")
        if env is None or args[field.name] is not None:  # the flag wins over the environment
            continue
        args[field.name] = os.environ.get(env, "").strip() or field.default
        if choices is not None and args[field.name] not in choices:
            parser.error(f"{env}={args[field.name]!r} is not one of {', '.join(choices)}")
    return TrainConfig(**{f.name: args[f.name] for f in dataclasses.fields(TrainConfig) if f.name in args})


def fail(prog: str, message: str) -> int:
    sys.stderr.write(f"{prog}: error: {message}\n")  # one write, so ranks' lines do not interleave
    sys.stderr.flush()
    return 2


def cmd_train(argv) -> int:
    cfg = parse_train_args(argv)
    from mpi4py import MPI

    world_size = MPI.COMM_WORLD.Get_size()
    errors = validate(cfg, world_size)
    if errors:
        return fail("minipar train", "; ".join(errors))
    from minipar.dist.comm import install_excepthook, wait_for_everyone
    from minipar.trainer import loop as train

    install_excepthook()
    train.train(cfg.resolved(world_size))
    wait_for_everyone(MPI.COMM_WORLD)  # e.g. while rank 0 alone runs --check-reference
    return 0


def cmd_plan(argv) -> int:
    from minipar.trainer import commands

    return commands.plan_main(argv)


def cmd_schedule(argv) -> int:
    from minipar.trainer import commands

    return commands.schedule_main(argv)


def cmd_bench(argv) -> int:
    from minipar.bench import registry as bench

    return bench.main(argv)


COMMANDS = {"train": cmd_train, "plan": cmd_plan, "schedule": cmd_schedule, "bench": cmd_bench}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        if argv and argv[0] in ("-h", "--help"):
            print(f"usage: minipar {{{','.join(COMMANDS)}}} [options]   (minipar COMMAND --help for details)")
            return 0
        return fail("minipar", f"choose a command: {', '.join(COMMANDS)}")
    return COMMANDS[argv[0]](argv[1:])
