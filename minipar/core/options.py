"""`option()`: one field of a technique's options object, declared once with its command-line help.

Each technique declares the options it reads as a small dataclass beside its code (TensorOptions in
parallel/tensor.py, ChunkedOptions in parallel/zero_chunked.py, ...); its checks (`config_errors`) and
builders take that object, so a technique can be built and checked without the trainer. The trainer's
TrainConfig (trainer/config.py) is composed of all of them by inheritance: a TrainConfig *is* a
TensorOptions, so the trainer passes itself. The command line, `--check-reference`'s single-process
values and the options' table in the tests are generated from these fields: one declaration each.
Lesson: lessons/00_overview.md.
"""

from __future__ import annotations

import dataclasses

_KEEP = object()  # single_process: the reference run keeps this field's value


def option(default, help: str, choices=None, *, command_line: bool = True, env: str | None = None,
           single_process=_KEEP, parse=None, gradient_transform: str | None = None):
    """A dataclass field with its command-line metadata.

    `choices`: the allowed values (argparse's choices, and the trainer's check). `command_line=False`:
    a field set from Python only, with no flag. `env`: an environment variable the flag falls back to.
    `single_process`: the value the single-process reference run uses instead (a layout option, or one
    about this run's files and output); fields without it (the model, the data, the optimizer, the
    precision) are what the reference must share with the run. `parse`: the function that reads the
    flag's text, where the field's type cannot (a number or a word). `gradient_transform`: the name of
    the module of a transform at the updater's gradients-ready point (parallel/api.py) that this option
    turns on; the module has `config_errors(options)`, which the trainer's checks gather, and
    `attach(options, grid, updater)`, which its builder calls, so declaring the field is the transform's
    one registration line.
    """
    metadata = {"help": help, "command_line": command_line}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if env is not None:
        metadata["env"] = env
    if single_process is not _KEEP:
        metadata["single_process"] = single_process
    if parse is not None:
        metadata["parse"] = parse
    if gradient_transform is not None:
        metadata["gradient_transform"] = gradient_transform
    return dataclasses.field(default=default, metadata=metadata)


def title(options_class) -> str:
    """The heading of an options class's flags in `--help`: its docstring's first line."""
    return (options_class.__doc__ or options_class.__name__).strip().splitlines()[0].rstrip(".")
