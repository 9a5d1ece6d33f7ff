"""keep_freed_memory: a step's fresh arrays stop costing page faults (the oracle is the page count).

Each case runs in its own process, because malloc's settings are process-wide and cannot be undone."""

from __future__ import annotations

import os
import subprocess
import sys

SIZES = [2**k for k in range(14, 21)] * 3  # float64 arrays of 128 KiB .. 8 MiB, as a step's activations
STEPS = 10
PAGES = STEPS * sum(n * 8 // 4096 for n in SIZES)  # every page of every array, every step

SCRIPT = f"""
import resource, sys
import numpy as np
from minipar.speed.allocator import keep_freed_memory
print(keep_freed_memory())
def step():
    arrays = [np.ones(n) for n in {SIZES}]  # every page written
    del arrays
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range({STEPS}):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(system_malloc: bool) -> tuple[str, int]:
    env = {**os.environ, "MINIPAR_SYSTEM_MALLOC": "1" if system_malloc else "0"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
                          check=True, timeout=60)
    applied, count = done.stdout.split()
    return applied, int(count)


def test_kept_memory_is_reused_without_page_faults():
    applied, count = faults(system_malloc=False)
    assert applied == "True"
    assert count < 0.01 * PAGES, f"{count} page faults of {PAGES} pages: freed memory was given back"


def test_the_system_malloc_gives_freed_memory_back():
    """The opt-out leaves glibc's defaults, which refault a large part of the pages every step (its
    dynamic thresholds spare some): what keep_freed_memory saves."""
    applied, count = faults(system_malloc=True)
    assert applied == "False"
    assert count > 0.1 * PAGES, f"only {count} page faults of {PAGES} pages"
