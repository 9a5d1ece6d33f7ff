"""`make portability`'s choice of configurations: one run per distinct OpenBLAS kernel the CPU can
execute, kernels whose instructions it lacks skipped (they die with SIGILL), and each NumPy SIMD level
this CPU has turned off with those above it. The probe and the CPU's flags are stood in for here."""

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("portability", Path(__file__).with_name("portability.py"))
portability = importlib.util.module_from_spec(spec)
spec.loader.exec_module(portability)

# what NumPy's wheel reports for each OPENBLAS_CORETYPE on an AVX2 machine (seen on an AMD EPYC)
REPORTED = {None: "Haswell", "Haswell": "Haswell", "Zen": "Haswell", "Sandybridge": "Sandybridge",
            "Nehalem": "Nehalem", "Prescott": "Katmai", "Katmai": "Katmai"}


@pytest.fixture
def avx2_machine(monkeypatch):
    monkeypatch.setattr(portability.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(portability, "cpu_flags", lambda: {"sse", "pni", "sse4_2", "avx", "avx2", "fma"})
    monkeypatch.setattr(portability, "probe", lambda env: {"kernel": REPORTED[env.get("OPENBLAS_CORETYPE")],
                                                           "found": ["X86_V3"]})


def test_each_kernel_runs_once_and_those_the_cpu_cannot_run_are_skipped(avx2_machine):
    chosen = portability.configurations()
    run = [env.get("OPENBLAS_CORETYPE") for label, env, skipped in chosen
           if not skipped and "NPY_DISABLE_CPU_FEATURES" not in env]
    assert run == ["Haswell", "Sandybridge", "Nehalem", "Prescott"]
    skipped = {label.split("=")[1]: why for label, env, why in chosen if why}
    assert set(skipped) == {"SapphireRapids", "Cooperlake", "SkylakeX", "Zen", "Katmai"}
    assert "avx512f" in skipped["SkylakeX"] and "already run" in skipped["Zen"]


def test_each_simd_level_is_turned_off_on_the_default_kernel(avx2_machine):
    numpy_runs = [env for _, env, why in portability.configurations() if "NPY_DISABLE_CPU_FEATURES" in env]
    assert [env["NPY_DISABLE_CPU_FEATURES"] for env in numpy_runs] == ["X86_V3"]
    assert all("OPENBLAS_CORETYPE" not in env for env in numpy_runs)
