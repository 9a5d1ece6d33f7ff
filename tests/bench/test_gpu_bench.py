"""`bench gpu` (minipar_lab/bench/gpu.py): without CuPy one line and exit 2, the two backends compared on
the fake device (tests/fake_device.py), and the deviation it reports computed by hand."""

import sys

import numpy
import pytest
from fake_device import fake_cupy

from minipar.core import backend
from minipar.trainer.config import TrainConfig
from minipar_lab.bench import gpu as gpu_bench


def tiny(**changes) -> TrainConfig:
    base = TrainConfig(model="gpt", precision="fp64", n_layer=2, n_head=2, d_model=16, seq_len=8,
                       batch_size=8, steps=2, quiet=True)
    return base.replace(**changes)


def test_bench_gpu_without_cupy_says_why_and_exits_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert gpu_bench.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("minipar bench gpu: error: backend 'cupy' needs the cupy package")
    assert err.count("\n") == 1


# ----- serial: training on the fake device -------------------------------------------------------


def test_bench_gpu_compares_the_two_backends(capsys):
    with fake_cupy():
        row = gpu_bench.compare_backends(tiny(steps=3))
    assert row["deviation"] == {"loss": 0.0, "weight": 0.0} and row["tolerance"] == 1e-9
    assert row["numpy_ms"] > 0 and row["cupy_ms"] > 0 and backend.current().name == "numpy"
    kernel_ms = {"chain8": {"numpy": 2.0, "gpu_per_op": 0.5, "gpu_fused": 0.1}}  # the layout, not figures
    kernel_spread = {"chain8": {"numpy": 0.2, "gpu_per_op": 0.05, "gpu_fused": 0.01}}
    result = {"steps": 3, "agreement": [row], "wide": row,
              "fused_kernels": {"size": 8, "ms": kernel_ms, "ms_spread": kernel_spread}}
    text = gpu_bench.report(result)
    assert "numpy/cupy" in text and "chain8" in text and gpu_bench.agrees(result)


def test_bench_gpus_deviation_is_the_largest_relative_one_of_any_step_and_any_tensor():
    def run(losses, w, v):
        return {"records": [{"step": i, "loss": loss} for i, loss in enumerate(losses)], "losses": losses,
                "state": {"w": numpy.array(w), "v": numpy.array(v), "empty": numpy.zeros(0)}}
    numpy_run = run([2.0, 4.0, 1.0], [10.0, -20.0], [100.0, 1.0])
    cupy_run = run([2.0, 4.2, 1.5], [11.0, -20.0], [100.0, 1.5])
    # relative to the NumPy run's losses, the last step included: 0.5 of 1 (0.5 of CuPy's 1.5 would be
    # 0.33, and step 1's 0.2 of 4 is 0.05). Each tensor's largest error over its largest magnitude: w
    # 1 of |-20|, 0.05 (element by element it would be 1 of 10, 0.1), v 0.5 of 100, 0.005 (element by
    # element 0.5 of 1); the largest tensor's, 0.05
    assert gpu_bench.deviation(cupy_run, numpy_run) == pytest.approx({"loss": 0.5, "weight": 0.05})
    assert gpu_bench.deviation(numpy_run, numpy_run) == {"loss": 0.0, "weight": 0.0}


# ----- multi-rank: every collective stages, or hands device memory to a CUDA-aware MPI -----------
