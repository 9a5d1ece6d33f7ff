"""The fusion benchmark's command line: it runs, reports what it measured, and rejects bad input.
(Timings are not asserted here: the figures in lesson 10 come from running the benchmark.)"""

import json

import numpy as np
import pytest

from minipar_lab.bench.fusion import chain8, compute_floor, main


def test_bench_reports_medians_and_counted_bytes(capsys):
    assert main(["--size", "3000", "--repeats", "2", "--tile", "512", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    chain, adamw = report["results"]["chain8"], report["results"]["adamw"]
    assert (chain["eager"]["kernels"], chain["fused"]["kernels"], adamw["fused"]["kernels"]) == (8, 1, 3)
    assert chain["fused"]["bytes_moved"] == 3 * 3000 * 4 and adamw["fused"]["bytes_moved"] == 10 * 3000 * 4
    assert report["ratios"]["chain8"]["bytes_ratio"] == 7.0
    assert all(row["seconds"] > 0 for rows in report["results"].values() for row in rows.values())


def test_bench_prints_a_table(capsys):
    assert main(["--size", "1000", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "chain8: eager/fused time" in out and "adamw: eager/fused time" in out
    assert "bytes moved 7.0x" in out and "bytes moved 3.3x" in out


@pytest.mark.parametrize("argv", [["--size", "0"], ["--repeats", "-1"], ["--tile", "0"]])
def test_bad_numbers_exit_2_with_one_line(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "must be a positive integer" in err


def test_bench_times_the_copy_ceiling_and_the_chains_compute_floor(capsys):
    a, b = np.linspace(0.0, 1.0, 512, dtype=np.float32), np.linspace(1.0, 2.0, 512, dtype=np.float32)
    floor = compute_floor(a, b, tiles=3)
    floor()  # the floor runs the chain's own operations, on the one tile it holds
    assert np.array_equal(floor.out, chain8(a, b))
    assert main(["--size", "3000", "--repeats", "1", "--tile", "512", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert results["chain8"]["copy"]["seconds"] > 0 and results["chain8"]["floor"]["seconds"] > 0
    assert "copy" in results["adamw"] and "floor" not in results["adamw"]
