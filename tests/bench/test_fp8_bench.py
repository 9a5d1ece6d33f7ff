"""`bench fp8` (minipar_lab/bench/fp8.py): its curves are what `minipar train` trains, its amax is
each weight's largest magnitude, its outlier shares follow the 2^18.8 threshold worked out here on a
tensor of ones, and bad input is one line. Serial; a 2-block model of width 32, 2 steps."""

import numpy as np
import pytest
from mpi4py import MPI

from minipar.trainer.loop import train
from minipar_lab.bench import fp8 as fp8_bench

SMALL = ["--steps", "2", "--n-layer", "2", "--d-model", "32"]


@pytest.fixture(scope="module")
def measured():
    _, cfg = fp8_bench.parse(SMALL)
    return cfg, fp8_bench.measure(cfg)


def test_each_curve_is_the_trainers_run_of_that_precision(measured):
    cfg, results = measured
    assert list(results["curves"]) == ["fp32", "bf16", "fp8 delayed", "fp8 current", "fp8 block"]
    runs = {"fp32": {"precision": "fp32"}, "fp8 block": {"precision": "fp8", "fp8_recipe": "block"}}
    for name, fields in runs.items():
        losses = [r["loss"] for r in train(cfg.replace(**fields), MPI.COMM_SELF)]
        np.testing.assert_allclose(results["curves"][name], losses, rtol=1e-6, err_msg=name)
    assert results["curves"]["fp8 block"] != results["curves"]["fp32"]


def test_the_amax_of_a_weight_is_its_largest_magnitude(measured):
    """The delayed run's first step quantizes the initial weights: their amax is max |W|, read here off
    the model the trainer builds (the same seed), by the layers' own names."""
    from minipar.core.nn import GPT
    from minipar.trainer.build import model_config

    cfg, results = measured
    weights = dict(GPT(model_config(cfg), seed=cfg.seed).named_parameters())
    assert len(results["amax"]) == cfg.n_layer * 6  # q, k, v, attention proj, fc, mlp proj
    for name, history in results["amax"].items():
        assert history["weight"][0] == np.abs(weights[name + ".weight"].data).max(), name
        assert all(len(history[t]) == cfg.steps for t in ("input", "weight", "grad"))
        assert history["grad"][0] < 1e-2 < history["input"][0]  # the window a scale must move


def test_outliers_flush_one_scale_past_2_to_the_18_point_8_and_only_the_outliers_tile():
    """Ones, the outlier r times the median (1): one scale puts a one at 448 / r, zero once that is
    below half of E4M3's smallest subnormal 2^-9, i.e. r > 448 x 2^10 = 458752: at 1e6, not at 1e5.
    Tiles of 16: the outlier's tile (15 other channels of 31) is scaled as the tensor; the other is not."""
    rows = {row["ratio"]: row for row in fp8_bench.outliers(np.ones((4, 32)), 16)}
    assert [rows[r]["tensor"] for r in fp8_bench.RATIOS] == [0, 0, 0, 0, 1]
    assert rows[1e6]["tiles"] == pytest.approx(15 / 31) and rows[1e5]["tiles"] == 0
    assert all(row["other_tiles"] == 0 for row in rows.values())


@pytest.mark.parametrize("argv, message", [
    (["--steps", "1"], "--steps must be at least 2"),
    (["--fp8-block", "48"], "--fp8-block 48 must divide"),
])
def test_bad_input_is_one_line_and_exit_code_2(argv, message, capsys):
    assert fp8_bench.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and err.startswith("minipar bench fp8: error:")


def test_the_plot_is_a_png_of_the_measurements(measured, tmp_path):
    cfg, results = measured
    path = tmp_path / "fp8.png"
    assert fp8_bench.save_plot(str(path), results, cfg) == f"plot saved to {path}"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000
