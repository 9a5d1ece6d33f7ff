"""The command line's parsing: OneLineParser, and `minipar train`'s options generated from TrainConfig.

A mistake prints `minipar <command>: error: <what is wrong>` on stderr and exits with code 2, instead of
argparse's usage block: under mpiexec every rank prints it, and one line per rank stays readable.
`train_parser` makes one flag per TrainConfig field from its type, default and metadata
(core/options.py's `option`), so an option is declared once, in its technique's options object, with
its help and choices; `--help` lists them in one section per options object.
Lesson: lessons/00_overview.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing

from minipar.core.moe import MoEOptions
from minipar.core.options import title
from minipar.trainer.config import OPTION_GROUPS, TrainConfig


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def fail(prog: str, message: str) -> int:
    sys.stderr.write(f"{prog}: error: {message}\n")  # one write, so ranks' lines do not interleave
    sys.stderr.flush()
    return 2


def train_parser(defaults: bool = True) -> argparse.ArgumentParser:
    """One flag per TrainConfig field, from its type, default and metadata (core/options.py), in one
    section per options object (config.OPTION_GROUPS). `defaults=False`: a flag left out is absent from
    the result (what the user typed)."""
    p = OneLineParser(prog="minipar train", description="Train a model under mpiexec in any layout.")
    types_of = typing.get_type_hints(TrainConfig)
    for options in OPTION_GROUPS:
        section = p.add_argument_group(title(options))
        for field in dataclasses.fields(options):
            if field.metadata.get("command_line", True):
                keywords = _argument(field, types_of[field.name])
                section.add_argument("--" + field.name.replace("_", "-"),
                                     **keywords if defaults else {**keywords, "default": argparse.SUPPRESS})
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
    keywords = {"type": field.metadata.get("parse", annotation), "default": field.default, "help": help}
    if choices is not None:
        keywords["choices"] = choices
    if env is not None:  # None: not given, so parse_train_args reads the environment
        keywords["default"] = None
        keywords["help"] = f"{help} (default: ${env} if set, else {field.default})"
    return keywords


def parse_train_args(argv) -> TrainConfig:
    parser = train_parser()
    args = vars(parser.parse_args(argv))
    typed = vars(train_parser(defaults=False).parse_args(argv))  # the options have defaults: what was typed
    if args["model"] != "moe":  # like --ep: MoE's options alone would train a dense model unasked
        for name in (f.name for f in dataclasses.fields(MoEOptions) if f.name in typed):
            parser.error(f"--{name.replace('_', '-')} needs --model moe (the {args['model']} model has "
                         "no experts)")
    for field in dataclasses.fields(TrainConfig):
        env, choices = field.metadata.get("env"), field.metadata.get("choices")
        if env is None or args[field.name] is not None:  # the flag wins over the environment
            continue
        args[field.name] = os.environ.get(env, "").strip() or field.default
        if choices is not None and args[field.name] not in choices:
            parser.error(f"{env}={args[field.name]!r} is not one of {', '.join(choices)}")
    return TrainConfig(**{f.name: args[f.name] for f in dataclasses.fields(TrainConfig) if f.name in args})
