"""`bench precision` (minipar_lab/bench/precision.py): fp16's underflow and overflow where bf16 trains,
both tables printed and bad input refused in one line, and the summary bound that lesson 09 checks
instead of a largest difference whose second digit depends on the CPU's matrix kernel."""

import numpy as np
import pytest

from minipar_lab.bench import precision as precision_bench
from minipar_lab.bench.precision import power_of_ten_above

TRACKING_RTOL = 1e-2  # as tests/precision/test_mixed_precision.py: 16-bit runs follow fp32 within 1%


@pytest.mark.parametrize("value, bound", [(0.0090, 0.01), (0.0030, 0.01), (0.01, 0.01), (0.0101, 0.1),
                                          (4.3e-5, 1e-4), (6.1e-6, 1e-5), (1.0, 1.0), (0.0, 0.0)])
def test_the_bound_is_the_least_power_of_ten_at_least_the_value(value, bound):
    assert power_of_ten_above(value) == pytest.approx(bound, rel=1e-12)


def test_fp16_underflows_without_the_scaler_and_overflows_with_large_values_where_bf16_trains():
    cfg = precision_bench.TrainConfig(model="mlp", n_layer=4, d_model=32, optimizer="sgd", lr=0.02,
                                      steps=60, batch_size=256, dp=1, quiet=True)
    small = precision_bench.experiment(cfg, precision_bench.PLAIN_RUNS, loss_divisor=2.0**16)
    fp32 = np.array(small["fp32"]["loss"])
    for run in ("bf16", "fp16+scaler"):
        np.testing.assert_allclose(small[run]["loss"], fp32, rtol=TRACKING_RTOL, err_msg=run)
    assert small["fp16"]["loss"][-1] > 1.1 * fp32[-1]  # underflowed gradients: it falls behind

    for row in precision_bench.gradient_errors(cfg, 2.0**16, [0, 40]):  # what the curves come from
        assert row["fp16"]["error"] > 0.1 and row["fp16+scaler"]["error"] < 0.01, row
        assert row["fp16+scaler"]["zero"] == 0.0 and (row["fp16"]["zero"] > 0.05 or row["step"] == 0)

    large = precision_bench.experiment(cfg.replace(steps=10), precision_bench.PLAIN_RUNS, unit=2.0**15)
    np.testing.assert_allclose(large["bf16"]["loss"], large["fp32"]["loss"], rtol=TRACKING_RTOL)
    assert not np.isfinite(large["fp16"]["loss"]).any()
    assert not np.isfinite(large["fp16+scaler"]["loss"]).any() and all(large["fp16+scaler"]["skipped"])
    assert large["fp16+scaler"]["scale"] == [2.0**16 / 2**k for k in range(10)]


def test_bench_prints_both_tables_and_refuses_bad_input_in_one_line(capsys):
    assert precision_bench.main(["--steps", "3", "--batch-size", "16"]) == 0
    out = capsys.readouterr().out
    for part in ("small gradients", "rounded to zero", "large values", "skipped"):
        assert part in out
    assert precision_bench.main(["--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--steps must be at least 2" in err
