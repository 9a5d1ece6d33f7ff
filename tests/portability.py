"""`make portability`: the lessons and the serial tests under every matrix kernel and NumPy feature set
this CPU can run, so that a figure which holds on one CPU only fails here and not on a user's laptop.

Two things pick their code by CPU at run time, and both can change the last bits of a float:
- NumPy's OpenBLAS is built with DYNAMIC_ARCH: it picks its matrix kernel (Haswell, SkylakeX, Zen, ...)
  by CPU, and kernels add the products in different orders. OPENBLAS_CORETYPE=NAME forces one; a kernel
  whose instructions the CPU lacks dies with SIGILL, so those are skipped by the CPU's flags. Several
  names map to one kernel (`Zen` is `Haswell` in NumPy's wheel): runs are deduplicated by the kernel
  name OpenBLAS reports (threadpoolctl reads it).
- NumPy's own loops (exp, tanh, ...) have SIMD paths per instruction-set level, chosen at import;
  NPY_DISABLE_CPU_FEATURES=X86_V3 (say) turns a level off, so the next one down runs.

Bit-equality tests between layouts stay bit-equal under any one kernel (every rank uses the same one);
what must not move between kernels are the figures compared with stored text (lessons/checked_output.py).

    python tests/portability.py [--phases lessons serial] [--list]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# OPENBLAS_CORETYPE names to try on x86-64, and the CPU flags (/proc/cpuinfo) each kernel executes.
X86_KERNELS = {
    "SapphireRapids": {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_bf16"},
    "Cooperlake": {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"},
    "SkylakeX": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"},
    "Haswell": {"avx2", "fma"},
    "Zen": {"avx2", "fma"},
    "Sandybridge": {"avx"},
    "Nehalem": {"sse4_2"},
    "Prescott": {"pni"},
    "Katmai": {"sse"},
}

PHASES = {
    "lessons": ["-m", "pytest", "-q", "lessons/"],
    "serial": ["-m", "pytest", "-q", "-m", "not mpi"],
}

PROBE = """
import json, threadpoolctl
try:
    from numpy._core import _multiarray_umath as umath
except ImportError:  # NumPy 1.x
    from numpy.core import _multiarray_umath as umath
info = [i for i in threadpoolctl.threadpool_info() if i.get("internal_api") == "openblas"]
found = [name for name in umath.__cpu_dispatch__ if umath.__cpu_features__.get(name)]
print(json.dumps({"kernel": info[0]["architecture"] if info else "none", "found": found}))
"""


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def probe(env: dict[str, str]) -> dict | None:
    """The kernel OpenBLAS runs and NumPy's dispatched features under env; None if it cannot start."""
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True)
    return json.loads(done.stdout) if done.returncode == 0 else None


def configurations() -> list[tuple[str, dict[str, str], str]]:
    """(label, extra environment, why skipped or ''), one per distinct kernel and NumPy feature set."""
    base = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    base.pop("OPENBLAS_CORETYPE", None)
    base.pop("NPY_DISABLE_CPU_FEATURES", None)
    default = probe(base)
    if default is None:
        raise SystemExit("portability: python cannot import numpy and threadpoolctl (make setup)")
    chosen, seen = [], set()
    if platform.machine() in ("x86_64", "AMD64"):
        flags = cpu_flags()
        for name, needs in X86_KERNELS.items():
            missing = needs - flags
            if missing:
                chosen.append((f"OPENBLAS_CORETYPE={name}", {}, f"CPU lacks {' '.join(sorted(missing))}"))
                continue
            found = probe({**base, "OPENBLAS_CORETYPE": name})
            if found is None or found["kernel"] in seen:
                why = "did not start" if found is None else f"runs {found['kernel']}, already run"
                chosen.append((f"OPENBLAS_CORETYPE={name}", {}, why))
                continue
            seen.add(found["kernel"])
            chosen.append((f"OPENBLAS_CORETYPE={name} (kernel {found['kernel']})",
                           {"OPENBLAS_CORETYPE": name}, ""))
    else:
        chosen.append((f"default kernel {default['kernel']}", {}, ""))
    # NumPy: each dispatched level this CPU has, turned off (with every level above it) on the default kernel
    for index in range(len(default["found"])):
        disabled = default["found"][index:]
        chosen.append((f"NPY_DISABLE_CPU_FEATURES={','.join(disabled)} (kernel {default['kernel']})",
                       {"NPY_DISABLE_CPU_FEATURES": ",".join(disabled)}, ""))
    return [(label, {**base, **extra}, why) for label, extra, why in chosen]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="portability", description=__doc__.splitlines()[0])
    parser.add_argument("--phases", nargs="+", choices=list(PHASES), default=list(PHASES))
    parser.add_argument("--list", action="store_true", help="only list the configurations")
    args = parser.parse_args(argv)
    rows, failed = [], False
    for label, env, skipped in configurations():
        if skipped or args.list:
            rows.append((label, skipped or "listed", ""))
            print(f"[portability] {label}: {skipped or 'to run'}", flush=True)
            continue
        for phase in args.phases:
            started = time.time()
            done = subprocess.run([sys.executable, *PHASES[phase]], cwd=ROOT, env=env, capture_output=True,
                                  text=True)
            seconds = time.time() - started
            summary = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
            verdict = "passed" if done.returncode == 0 else "FAILED"
            rows.append((label, f"{phase}: {verdict}", f"{seconds:.0f} s"))
            print(f"[portability] {label} {phase}: {summary} ({seconds:.0f} s)", flush=True)
            if done.returncode != 0:
                failed = True
                print(done.stdout[-6000:], flush=True)
    print("\nconfiguration | result | time")
    for row in rows:
        print(" | ".join(row))
    print("portability:", "FAILED" if failed else "every configuration passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
