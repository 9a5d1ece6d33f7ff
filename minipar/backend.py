"""Backend: where arrays live, and how they reach MPI.

The idea: every array the engine computes on comes from one array module, ``xp`` (NumPy on the CPU,
CuPy on a GPU), and every buffer handed to MPI is a host NumPy array. ``to_host`` and ``from_host``
are the only two doors between the two worlds, so switching to a GPU changes this file and nothing
else. What it costs: on a GPU each collective pays a device-to-host and a host-to-device copy (a
CUDA-aware MPI would skip them). Lesson: lessons/02_collectives.md.

    from minipar import backend
    backend.set_backend("numpy")
    be = backend.current()
    host = be.to_host(x)              # numpy.ndarray, ready for MPI
    x2 = be.from_host(host)           # back to be.xp
"""

from __future__ import annotations

import numpy

BACKEND_NAMES = ("numpy", "cupy")


class Backend:
    """An array module plus the copies between it and host memory."""

    def __init__(self, name: str, xp):
        self.name = name
        self.xp = xp

    def to_host(self, a) -> numpy.ndarray:
        """A NumPy array with a's values (no copy when a already is one)."""
        if self.name == "cupy" and isinstance(a, self.xp.ndarray):
            return self.xp.asnumpy(a)
        return numpy.asarray(a)

    def from_host(self, a: numpy.ndarray):
        """An array of this backend's module with a's values (no copy on NumPy)."""
        return self.xp.asarray(a)

    def sync(self) -> None:
        """Wait for queued device work; timings are only honest after this."""
        if self.name == "cupy":
            self.xp.cuda.get_current_stream().synchronize()

    def is_device_array(self, a) -> bool:
        """True when a is an array of this backend's module (for NumPy, any ndarray)."""
        return isinstance(a, self.xp.ndarray)

    def __repr__(self) -> str:
        return f"Backend({self.name!r})"


def _cupy_backend() -> Backend:
    try:
        import cupy
    except ImportError as error:
        raise RuntimeError("backend 'cupy' needs the cupy package: pip install cupy") from error
    try:
        gpus = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as error:
        raise RuntimeError(f"backend 'cupy' needs a CUDA GPU, and CUDA says: {error}") from error
    if gpus == 0:
        raise RuntimeError("backend 'cupy' needs a CUDA GPU, and none is visible")
    return Backend("cupy", cupy)


_current = Backend("numpy", numpy)


def current() -> Backend:
    """The backend in use by this process."""
    return _current


def set_backend(name: str) -> Backend:
    """Switch this process to backend 'numpy' or 'cupy'; raise a clear error if it cannot run here."""
    global _current
    if name == "numpy":
        _current = Backend("numpy", numpy)
    elif name == "cupy":
        _current = _cupy_backend()
    else:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    return _current


def xp_of(array):
    """The array module (numpy or cupy) that array belongs to, like cupy.get_array_module."""
    if type(array).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return numpy
