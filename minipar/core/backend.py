"""Backend: where arrays live, and how they reach MPI.

The idea: every array the engine computes on comes from one array module, ``xp``: NumPy on the CPU,
CuPy on a GPU. No module imports NumPy to compute on model data; each takes ``backend.current().xp``
or ``xp_of(array)``, so the same code runs on either (``--backend cupy`` or ``MINIPAR_BACKEND=cupy``).
One rank per GPU: rank r of a node uses GPU r % (GPUs on the node).

Reaching MPI: an ordinary MPI reads and writes host memory only. So by default a collective on device
arrays synchronises the stream (the kernels that write the array must have finished), copies the
array to host memory, communicates the host copy and copies the result back: it *stages* through the
host. An MPI built with CUDA support reads device memory itself (through ``__cuda_array_interface__``):
say so with ``MINIPAR_CUDA_AWARE=1`` and device buffers go to MPI directly, after the same
synchronisation. ``send_buffer`` and ``receive_buffer`` are the only doors to MPI; ``to_host`` and
``from_host`` the only copies between the two memories.

What it costs: a staged collective pays a device-to-host and a host-to-device copy (PCIe) on top of
the wire. The traffic ledger counts the wire only, which is the same on both paths.
Lesson: lessons/11_gpu.md.

    from minipar.core import backend
    be = backend.set_backend("numpy")        # or "cupy", local_rank=r
    host = be.to_host(x)                     # numpy.ndarray
    x2 = be.from_host(host)                  # back to be.xp
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType

import numpy

from minipar.core.options import option

# The type of the arrays the engine computes on, for annotations only: a numpy.ndarray, or on a GPU a
# cupy.ndarray, which has the same interface (CuPy ships no types, so the checker reads both as NumPy's).
Array = numpy.ndarray

BACKEND_NAMES = ("numpy", "cupy")
BACKEND_ENV = "MINIPAR_BACKEND"  # the backend `minipar train` uses when --backend is not given
CUDA_AWARE_ENV = "MINIPAR_CUDA_AWARE"  # 1: this MPI reads device memory, skip the staging copies


@dataclass
class BackendOptions:
    """The array backend (core/backend.py)."""
    backend: str = option("numpy", "array backend", BACKEND_NAMES, env=BACKEND_ENV)


class Backend:
    """An array module, the copies between it and host memory, and the buffers handed to MPI."""

    def __init__(self, name: str, xp: ModuleType, cuda_aware: bool = False, device: int | None = None):
        self.name = name
        self.xp = xp
        self.on_device = xp is not numpy  # arrays live in device memory, out of MPI's plain reach
        self.cuda_aware = cuda_aware and self.on_device
        self.device = device  # the GPU this process computes on (None: NumPy, or CUDA's current one)

    def to_host(self, a) -> numpy.ndarray:
        """A NumPy array with a's values: a copy of a device array, a itself when it already is one."""
        if self.on_device and isinstance(a, self.xp.ndarray):
            self.sync()
            return self.xp.asnumpy(a)
        return numpy.asarray(a)

    def from_host(self, a):
        """An array of this backend's module with a's values (no copy on NumPy, nor of device arrays)."""
        return self.xp.asarray(a)

    def sync(self) -> None:
        """Wait for the device work queued so far; MPI and timings are only honest after this."""
        if self.on_device:
            self.xp.cuda.get_current_stream().synchronize()

    def is_device_array(self, a) -> bool:
        """True when a is an array of this backend's module (for NumPy, any ndarray)."""
        return isinstance(a, self.xp.ndarray)

    def send_buffer(self, a, copy: bool = False):
        """The C-contiguous buffer MPI reads to send a: a host copy of a device array (staging), or the
        device array itself when MPI is CUDA-aware. copy=True: always a new buffer (a broadcast
        receives into it)."""
        if self.cuda_aware and isinstance(a, self.xp.ndarray):
            a = self.xp.array(a, order="C") if copy else self.xp.asarray(a, order="C")
            self.sync()  # MPI reads the memory outside the stream: queued kernels must be done
            return a
        host = self.to_host(a)
        return numpy.array(host, order="C") if copy else numpy.asarray(host, order="C")

    def receive_buffer(self, shape, dtype):
        """An empty buffer for MPI to write into: in device memory only when MPI is CUDA-aware."""
        return (self.xp if self.cuda_aware else numpy).empty(shape, dtype)

    def __repr__(self) -> str:
        details = f", device {self.device}" if self.device is not None else ""
        details += ", CUDA-aware MPI" if self.cuda_aware else ""
        return f"Backend({self.name!r}{details})"


def cupy_module() -> tuple[ModuleType, int]:
    """The cupy module and how many GPUs it sees; a one-line RuntimeError when either is missing."""
    try:
        import cupy
    except ImportError as error:
        reason = str(error).splitlines()[0] if str(error) else "not installed"
        raise RuntimeError(f"backend 'cupy' needs the cupy package (pip install cupy-cuda12x, matching "
                           f"your CUDA), and importing it failed: {reason}") from error
    try:
        gpus = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as error:
        raise RuntimeError(f"backend 'cupy' needs a CUDA GPU, and CUDA says: {error}") from error
    if gpus == 0:
        raise RuntimeError("backend 'cupy' needs a CUDA GPU, and none is visible (CUDA_VISIBLE_DEVICES?)")
    return cupy, gpus


def unavailable(name: str) -> str | None:
    """Why backend `name` cannot run in this process (one line), or None when it can."""
    if name not in BACKEND_NAMES:
        return f"unknown backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}"
    if name == "cupy":
        try:
            cupy_module()
        except RuntimeError as error:
            return str(error)
    return None


def cuda_aware_from_env() -> bool:
    return os.environ.get(CUDA_AWARE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def name_from_env() -> str:
    """The backend named by MINIPAR_BACKEND, or numpy."""
    return os.environ.get(BACKEND_ENV, "").strip() or "numpy"


_current = Backend("numpy", numpy)


def current() -> Backend:
    """The backend in use by this process."""
    return _current


def set_backend(name: str, local_rank: int | None = None, cuda_aware: bool | None = None) -> Backend:
    """Switch this process to backend 'numpy' or 'cupy'; raise a clear error if it cannot run here.

    local_rank: this rank's index among the ranks of its node; CuPy then computes on GPU
    local_rank % (GPUs on the node), one rank per GPU. None keeps CUDA's current device.
    cuda_aware: hand device buffers to MPI directly (default: MINIPAR_CUDA_AWARE=1).
    """
    global _current
    if name == "numpy":
        _current = Backend("numpy", numpy)
    elif name == "cupy":
        cupy, gpus = cupy_module()
        device = None if local_rank is None else local_rank % gpus
        if device is not None:
            cupy.cuda.Device(device).use()
        aware = cuda_aware_from_env() if cuda_aware is None else cuda_aware
        _current = Backend("cupy", cupy, cuda_aware=aware, device=device)
    else:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    return _current


def xp_of(array) -> ModuleType:
    """The array module (numpy or cupy) that array belongs to, like cupy.get_array_module."""
    if type(array) is numpy.ndarray:  # the common case, asked for by most ops of every step
        return numpy
    if type(array).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return numpy
