"""Keep freed memory: glibc's malloc set up the way a training loop wants it (appendix 01b, speed layer).

The idea: a training step frees its activations at the end of backward and allocates the same sizes
again in the next forward. By default glibc serves a large allocation with a fresh mapping and gives
large freed regions back to the kernel (its mmap and trim thresholds), so the next step's arrays land
on pages the kernel must map and zero again on first touch: one minor page fault per 4 KiB, about 1 µs
each. Setting both thresholds by hand keeps what is freed in the process for the next allocation, as
PyTorch's caching allocator keeps GPU memory for the next step.

What it saves: the default GPT's step takes about 2,500 page faults on one process, 5.7 ms of 30 ms
(`python -m minipar bench recompute` shows the page faults of a step). What it costs: the process
holds its peak of freed memory until it ends (the memory ledger, which counts what is alive, is not
affected). The command line calls `keep_freed_memory()` once at start-up (install.py), unless
MINIPAR_KERNELS=plain; `MINIPAR_SYSTEM_MALLOC=1` leaves malloc as it was, and so does a C library
without `mallopt` (macOS).
"""

from __future__ import annotations

import ctypes
import os

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): an array above it is still
# mapped, and unmapped when freed; every array of the lessons' models is far below it
MMAP_THRESHOLD_BYTES = 32 * 2**20
TRIM_THRESHOLD_BYTES = 2**30


def keep_freed_memory() -> bool:
    """Set malloc's thresholds so that freed memory stays in the process; True if it did."""
    if os.environ.get("MINIPAR_SYSTEM_MALLOC") == "1":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc: nothing to set
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success and 0 for a value it refuses
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
