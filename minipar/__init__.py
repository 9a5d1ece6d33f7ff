"""minipar: distributed training from scratch, on NumPy and MPI, small enough to read.

    import minipar
    from minipar import Tensor
    from minipar.core import nn, optim, functional as F

The names below are imported on first use (PEP 562), not with the package: `python -m minipar`
imports this package before its `__main__`, and NumPy's import there would take a second or more
before the command line can catch Ctrl-C (minipar/__main__.py).
"""

import importlib

__all__ = ["Tensor", "no_grad", "functional", "nn", "optim"]
__version__ = "0.1.0"

_WHERE = {"Tensor": "minipar.core.autograd", "no_grad": "minipar.core.autograd",
          "functional": "minipar.core", "nn": "minipar.core", "optim": "minipar.core"}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'minipar' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # once: later look-ups find it without this function
    return value
