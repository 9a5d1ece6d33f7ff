"""Which forms of the hot kernels a run uses: the speed layer's (the default) or core's plain ones.

The idea: the speed forms give the plain forms' bits (rules.py, tests/speed/test_rules.py) and keep no
number from changing (allocator.py), so they are the default: `minipar` installs them for every command
at start-up (`install_from_env`), and a training step runs inside `speed_forms()` (trainer/loop.py),
so that a run started from Python (a test, a notebook) is as fast as one from the command line.
MINIPAR_KERNELS=plain runs the bottom layer exactly as core writes it, to read a profile against the
code a student reads, or to rule the speed layer out when something looks wrong. MKL (blas.py) rounds
products in its own order, so it is installed only when MINIPAR_BLAS=mkl asks for it, and not with
MINIPAR_KERNELS=plain. Code that calls core's functions directly runs the plain forms.

What it saves and costs: see rules.py, blas.py and allocator.py. Lesson:
lessons/01b_speed_appendix.md ("The speed layer").
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from minipar.core import kernels
from minipar.core.hooks import RemovableHandle
from minipar.speed import blas, rules
from minipar.speed.allocator import keep_freed_memory

KERNELS_ENV = "MINIPAR_KERNELS"
KERNEL_CHOICES = ("speed", "plain")  # the first is the default
_from_env: list[RemovableHandle] = []  # what install_from_env installed last: replaced by its next call


def install_speed_forms() -> list[RemovableHandle]:
    """Install GELU's and AdamW's in-place, tiled rules in core's kernel table; their handles."""
    return [kernels.install("gelu_forward", rules.gelu_forward),
            kernels.install("gelu_backward", rules.gelu_backward),
            kernels.install("adamw_update", rules.adamw_update)]


def choice_errors(environ=os.environ) -> str | None:
    """Why MINIPAR_KERNELS and MINIPAR_BLAS cannot be honoured (one line), or None."""
    choice = environ.get(KERNELS_ENV) or KERNEL_CHOICES[0]
    if choice not in KERNEL_CHOICES:
        return f"unknown kernels {choice!r} in {KERNELS_ENV}; choose one of {', '.join(KERNEL_CHOICES)}"
    name = environ.get(blas.BLAS_ENV) or "numpy"
    if choice == "plain" and name != "numpy":
        return f"{blas.BLAS_ENV}={name} is a speed form: not with {KERNELS_ENV}=plain"
    return blas.unavailable(name)


@contextmanager
def speed_forms(environ=os.environ) -> Iterator[None]:
    """The rules installed for the `with` block, unless MINIPAR_KERNELS=plain (ValueError if junk)."""
    why = choice_errors({KERNELS_ENV: environ.get(KERNELS_ENV, "")})
    if why:
        raise ValueError(why)
    handles = [] if environ.get(KERNELS_ENV) == "plain" else install_speed_forms()
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def install_from_env(environ=os.environ) -> list[RemovableHandle]:
    """What the command line calls first: the forms MINIPAR_KERNELS and MINIPAR_BLAS choose, in place
    of those of the previous call (ValueError, one line, when they cannot be); the rules' handles."""
    why = choice_errors(environ)
    if why:
        raise ValueError(why)
    while _from_env:
        _from_env.pop().remove()
    blas.use(environ.get(blas.BLAS_ENV) or "numpy")
    if (environ.get(KERNELS_ENV) or KERNEL_CHOICES[0]) == "plain":
        return []
    keep_freed_memory()  # once set, for the life of the process (malloc's settings cannot be undone)
    _from_env.extend(install_speed_forms())
    return list(_from_env)
