"""`python -m minipar bench NAME`: every name runs its own file's main, a bad name is a one-line error,
and the autograd benchmark reports what it measured. (Timings are not asserted: appendix 01b's figures
come from running the benchmark.)"""

import importlib
import json
import subprocess
import sys

import numpy as np
import pytest

from minipar_lab.bench import autograd, registry

TINY = ["--batch", "4", "--width", "8", "--layers", "2", "--repeats", "2", "--no-torch"]


@pytest.mark.parametrize("name", registry.BENCHES)
def test_every_bench_is_a_file_of_the_package_with_a_main_and_a_docstring(name):
    module = importlib.import_module(f"minipar_lab.bench.{name}")
    assert callable(module.main)
    assert module.__doc__.startswith(f"`python -m minipar bench {name}`") and "lessons/" in module.__doc__


def test_bench_all_runs_only_benches_that_exist_and_not_the_gpu_one():
    assert set(registry.QUICK) < set(registry.BENCHES) and "gpu" not in registry.QUICK


@pytest.mark.parametrize("argv", [[], ["nope"], ["--help"]])
def test_an_unknown_bench_is_one_line_on_stderr_and_exit_2(argv):
    done = subprocess.run([sys.executable, "-m", "minipar", "bench", *argv], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "choose one of autograd, dp, pp" in done.stderr


def test_the_command_line_runs_the_named_bench_under_a_header(capsys):
    assert registry.main(["autograd", *TINY, "--json"]) == 0
    header, report = capsys.readouterr().out.splitlines()
    assert header == "== bench autograd"
    figures = json.loads(report)
    mlp = figures["mlp"]
    assert (mlp["batch"], mlp["width"], mlp["layers"]) == (4, 8, 2)
    assert all(mlp[k] > 0 for k in ("hand_s", "minipar_s", "hand_ratio")) and figures["gpt_step_s"] > 0
    small = figures["shallowspeed_mlp"]
    assert all(small[k] > 0 for k in ("hand_s", "minipar_s", "hand_ratio")) and "torch_ratio" not in small


def test_autograd_table_shows_both_times_and_their_ratio(capsys):
    assert autograd.main(TINY) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("MLP 2 x 8, batch 4, fp64, forward+backward, median of 2 alternating rounds "
                        "± half the interquartile range")
    assert [line.split()[0] for line in lines[1:4]] == ["hand-written", "minipar", "overhead"]
    assert lines[4].startswith("ShallowSpeed's MLP (784-128x6-10, batch 128, float32, GELU)")
    assert [line.split()[0] for line in lines[5:7]] == ["hand-written", "minipar"]
    assert lines[6].endswith("x hand-written")  # --no-torch: no PyTorch line
    assert lines[7].startswith("GPT (default config) training step: ") and lines[7].endswith(" ms")


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--width", "-1"], ["--layers", "0"]])
def test_autograd_bad_numbers_exit_2_with_one_line(argv, capsys):
    assert autograd.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "must be a positive integer" in err


@pytest.mark.parametrize("name", ["tracer", "simulate", "precision", "context"])
def test_a_bench_plot_without_matplotlib_is_one_line_and_exit_2_before_it_measures(name, tmp_path, capsys,
                                                                                   no_matplotlib):
    png = tmp_path / "figure.png"
    assert registry.main([name, "--plot", str(png)]) == 2
    out, err = capsys.readouterr()
    assert out == f"== bench {name}\n"  # no table: it stopped before measuring, not after
    assert err == f"minipar bench {name}: error: matplotlib is not installed: pip install -e '.[viz]'\n"
    assert not png.exists()


def test_bench_hand_written_step_computes_the_same_gradients():
    """The benchmark compares like with like: its NumPy step gives the autograd engine's gradients."""
    from minipar.core import nn
    from minipar.core.functional import mse_loss

    model = nn.MLPNet(nn.MLPConfig(d_in=5, d_hidden=6, d_out=3, n_layer=3), seed=0)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 5)), rng.standard_normal((4, 3))
    mse_loss(model(x), y, "sum").backward()
    weights = [(layer.linear.weight.data, layer.linear.bias.data) for layer in model.layers]
    hand = list(reversed(autograd.hand_written_mlp_step(weights, x, y)))
    for layer, (gw, gb) in zip(model.layers, hand):
        np.testing.assert_allclose(gw, layer.linear.weight.grad, rtol=1e-12)
        np.testing.assert_allclose(gb, layer.linear.bias.grad, rtol=1e-12)
