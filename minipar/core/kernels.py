"""Where a faster form of a hot kernel plugs in: core runs the plain form unless one is installed.

The idea: core writes each operation the way a student would, one new array per operation and one
`a @ b` per product, because that is the form a reader checks against the maths. A few of them are
hot enough that a faster form pays (GELU's forward and backward, AdamW's update, Linear's products);
those faster forms live in their own layer, `minipar.speed`, and reach core only through this table:
`install(name, form)` returns a `RemovableHandle` (core/hooks.py), the form installed last runs, and
removing it brings back the one before, in the end the plain form written at the call site
(`chosen(name, plain)`). Nobody reassigns core's functions, and core never imports the speed layer.

What it saves: nothing by itself; it lets the bottom layer stay plain. What it costs: one dictionary
look-up per call of a hot kernel. A form installed here must give the plain form's bits (the speed
layer's tests prove each); `minipar train` installs them by default (minipar/speed/__init__.py says
how to turn them off). Lesson: lessons/01b_speed_appendix.md ("The speed layer").
"""

from __future__ import annotations

from collections.abc import Callable

from minipar.core.hooks import HookList, RemovableHandle

# the kernels core looks up: each call site names its plain form (tensor_ops.Linear, layer_ops.gelu_*,
# optim.adamw_update); "linear" is one of Linear's products by its role (FP8 quantizes by role), whose
# plain form is "matmul"
KERNELS = ("matmul", "linear", "gelu_forward", "gelu_backward", "adamw_update")

_installed = {name: HookList() for name in KERNELS}


def install(name: str, form: Callable) -> RemovableHandle:
    """Run `form` for kernel `name` from now on (its handle's `remove()` takes it out again)."""
    if name not in _installed:
        raise KeyError(f"no kernel {name!r}; the kernels are {', '.join(KERNELS)}")
    return _installed[name].add(form)


def chosen(name: str, plain: Callable) -> Callable:
    """The form of kernel `name` to run: the one installed last, else `plain`."""
    return _installed[name].last(plain)


def installed(name: str) -> list[Callable]:
    """The forms installed for `name`, oldest first (the last one runs)."""
    return list(_installed[name])
