"""ZeRO planner: the paper's figures, the formulas against a per-rank count, the largest model, the CLI."""

import json
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipar.memory.planner import (
    STAGES,
    bytes_per_device,
    format_size,
    max_params,
    model_state_bytes,
)
from minipar.trainer.commands import plan_main

GB = 10**9


def test_paper_example_7_5b_on_64_ranks():
    sizes = bytes_per_device(7_500_000_000, 64, 12)
    assert sizes == {0: 120 * GB, 1: 31_406_250_000, 2: 16_640_625_000, 3: 1_875_000_000}
    assert all(isinstance(size, Fraction) for size in sizes.values())  # exact, never rounded
    assert [format_size(sizes[stage]) for stage in STAGES] == ["120 GB", "31.4 GB", "16.6 GB", "1.88 GB"]


# ZeRO paper, Table 1: GB per device for stages 1, 2, 3 as printed (stage 0 is 16Ψ at every DP degree).
# The paper rounds the 7.5B column (41.25 -> 41.3) and truncates the others (257.75 -> 257).
PAPER_TABLE_1 = {
    7.5e9: {1: (120, 120, 120), 4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5), 64: (31.4, 16.6, 1.88),
            256: (30.4, 15.4, 0.47), 1024: (30.1, 15.1, 0.12)},
    128e9: {1: (2048, 2048, 2048), 4: (896, 704, 512), 16: (608, 368, 128), 64: (536, 284, 32),
            256: (518, 263, 8), 1024: (513, 257, 2)},
    1e12: {1: (16000, 16000, 16000), 4: (7000, 5500, 4000), 16: (4750, 2875, 1000), 64: (4187, 2218, 250),
           256: (4046, 2054, 62.5), 1024: (4011, 2013, 15.6)},
}


@pytest.mark.parametrize("params", PAPER_TABLE_1)
def test_paper_table_1(params):
    for dp, printed in PAPER_TABLE_1[params].items():
        sizes = bytes_per_device(int(params), dp)
        assert sizes[0] == 16 * int(params)
        for stage, figure in zip((1, 2, 3), printed):
            decimals = len(str(figure).partition(".")[2])
            assert abs(float(sizes[stage]) / GB - figure) < 10.0**-decimals, (dp, stage)


def test_paper_table_2_largest_model_on_32gb():
    # ZeRO paper, Table 2, MP = 1 on 64 GPUs: 2B, 7.6B, 14.4B, 128B parameters fit in 32 GB.
    fits = [max_params(32 * GB, 64, stage) / 1e9 for stage in STAGES]
    assert [round(f, 1) for f in fits] == [2.0, 7.6, 14.4, 128.0]
    # More model parallelism splits the model first: MP = 16 fits 16 times as much (the paper rounds
    # 7.6B first and prints 121.6B; unrounded it is 122.3B).
    assert max_params(32 * GB, 64, 1, mp=16) == pytest.approx(16 * max_params(32 * GB, 64, 1), abs=16)


def brute_force_rank_bytes(params, dp, stage, k, param_bytes, grad_bytes):
    """Walk every element of a flat model, and add up the bytes each rank stores for it."""
    owned = [set(shard.tolist()) for shard in np.array_split(np.arange(params), dp)]
    bytes_of = {"params": param_bytes, "grads": grad_bytes, "optimizer": k}
    partitioned = {"optimizer": stage >= 1, "grads": stage >= 2, "params": stage >= 3}
    held = []
    for rank in range(dp):
        total = 0
        for element in range(params):
            for category, nbytes in bytes_of.items():
                if not partitioned[category] or element in owned[rank]:
                    total += nbytes
        held.append(total)
    return held


sizes = dict(k=st.integers(0, 16), param_bytes=st.integers(1, 8), grad_bytes=st.integers(1, 8))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 120), st.integers(1, 8), st.sampled_from(STAGES), st.fixed_dictionaries(sizes))
def test_formula_matches_a_per_rank_count(params, dp, stage, byte_sizes):
    held = brute_force_rank_bytes(params, dp, stage, **byte_sizes)
    predicted = model_state_bytes(params, dp, stage, **byte_sizes)
    assert sum(held) == dp * predicted  # the formula is the average rank
    per_element = byte_sizes["k"] + byte_sizes["param_bytes"] + byte_sizes["grad_bytes"]
    assert max(held) - predicted < per_element  # an uneven shard costs at most one element more
    if params % dp == 0:
        assert held == [predicted] * dp


@given(st.integers(1, 10**13), st.integers(1, 4096), st.fixed_dictionaries(sizes))
def test_formulas_as_the_paper_writes_them(params, dp, byte_sizes):
    p, g, k, n = byte_sizes["param_bytes"], byte_sizes["grad_bytes"], byte_sizes["k"], dp
    psi = Fraction(params)
    assert bytes_per_device(params, dp, **byte_sizes) == {
        0: (p + g + k) * psi,
        1: (p + g) * psi + k * psi / n,
        2: p * psi + (g + k) * psi / n,
        3: (p + g + k) * psi / n,
    }


@given(st.integers(1, 10**12), st.integers(1, 1024), st.sampled_from(STAGES), st.integers(1, 16),
       st.fixed_dictionaries(sizes))
def test_largest_model_is_the_last_that_fits(device_bytes, dp, stage, mp, byte_sizes):
    largest = max_params(device_bytes, dp, stage, mp=mp, **byte_sizes)
    if largest > 0:
        assert model_state_bytes(largest, dp, stage, mp=mp, **byte_sizes) <= device_bytes
    assert model_state_bytes(largest + 1, dp, stage, mp=mp, **byte_sizes) > device_bytes


def test_minipar_fp64_adam_prediction():
    # fp64 parameters and gradients, Adam's two fp64 moments, no master copy: 32 bytes a parameter.
    fp64 = dict(k=16, param_bytes=8, grad_bytes=8)
    assert bytes_per_device(1000, 4, **fp64) == {0: 32000, 1: 20000, 2: 14000, 3: 8000}


def test_cli_table(capsys):
    assert plan_main(["--params", "7.5e9", "--dp", "64", "--device-gb", "32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line[:1].isdigit()]
    assert [row[0] for row in rows] == ["0", "1", "2", "3"]
    for row, figure, largest in zip(rows, ["120", "31.4", "16.6", "1.88"], ["2B", "7.64B", "14.4B", "128B"]):
        assert figure in row and row[-1] == largest


def test_cli_json_shape(capsys):
    assert plan_main(["--params", "7.5e9", "--dp", "64", "--k", "12", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["params"] == 7_500_000_000 and report["dp"] == 64 and report["k"] == 12
    assert report["bytes_per_device"] == {"0": 120 * GB, "1": 31_406_250_000, "2": 16_640_625_000,
                                          "3": 1_875_000_000}
    assert "max_params" not in report
    assert plan_main(["--params", "10", "--dp", "3", "--json", "--device-gb", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bytes_per_device"]["3"] == pytest.approx(160 / 3)  # an average over uneven shards
    # Bytes per parameter in 1 GB: 16, 4 + 12/3, 2 + 14/3, 16/3.
    assert report["max_params"] == {"0": GB // 16, "1": GB // 8, "2": 3 * GB // 20, "3": 3 * GB // 16}


@pytest.mark.parametrize("argv", [
    ["--params", "0", "--dp", "4"],
    ["--params", "-5", "--dp", "4"],
    ["--params", "1.5", "--dp", "4"],
    ["--params", "nan", "--dp", "4"],
    ["--params", "1e9", "--dp", "0"],
    ["--params", "1e9", "--dp", "4", "--k", "-1"],
    ["--params", "1e9", "--dp", "4", "--device-gb", "0"],
    ["--params", "lots", "--dp", "4"],
    ["--dp", "4"],
])
def test_cli_bad_input_is_one_line_and_exit_2(argv, capsys):
    assert plan_main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("minipar plan: error: ")
    assert captured.err.count("\n") == 1
