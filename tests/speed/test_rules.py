"""The speed layer's forms give the bits of core's plain forms, and reach core only when installed.

GELU's forward and backward and AdamW's update (speed/rules.py) are the plain forms' operations in
place, run tile by tile over arrays larger than a tile (speed/tiles.py): each must equal core's plain
form (core/layer_ops.py, core/optim.py; tests/core/test_speed_forms.py checks those against the
formulas written out) bit for bit, in fp64 and fp32, on small arrays and on arrays of several tiles
and a partial one, and a training run must be the same with them as without. Installed, they run in
core's place (core/kernels.py) until their handles are removed; the command line installs them unless
MINIPAR_KERNELS=plain.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from minipar.core import functional as F
from minipar.core import kernels, layer_ops, optim
from minipar.speed import blas, install, rules, tiles
from minipar.trainer.config import TrainConfig
from minipar.trainer.loop import reference_run

DTYPES = (np.float64, np.float32)


@pytest.fixture
def plain_core():
    """Core with no form installed (an in-process `minipar` command of another test installs them)."""
    install.install_from_env({"MINIPAR_KERNELS": "plain"})
    assert all(kernels.installed(name) == [] for name in kernels.KERNELS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_in_place_forms_give_the_plain_forms_bits(dtype):
    rng = np.random.default_rng(0)
    x = (3 * rng.standard_normal((7, 33))).astype(dtype)
    g = rng.standard_normal((7, 33)).astype(dtype)
    x_before = x.copy()
    forward, backward = rules.gelu_forward(x), rules.gelu_backward(x, g)
    assert forward.dtype == backward.dtype == dtype
    assert np.array_equal(forward, layer_ops.gelu_forward_plain(x))
    assert np.array_equal(backward, layer_ops.gelu_backward_plain(x, g))
    assert np.array_equal(x, x_before)  # the saved input is read, never written


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_over_several_tiles_gives_the_plain_forms_bits(dtype):
    rng = np.random.default_rng(5)
    x = (3 * rng.standard_normal((9, 6 * 4099))).astype(dtype)  # 3.4 to 6.8 tiles, the last partial
    g = rng.standard_normal(x.shape).astype(dtype)
    assert x.nbytes > 2 * tiles.CACHE_TILE_BYTES and x.size % (tiles.CACHE_TILE_BYTES // x.itemsize)
    x_before = x.copy()
    assert np.array_equal(rules.gelu_forward(x), layer_ops.gelu_forward_plain(x))
    assert np.array_equal(rules.gelu_backward(x, g), layer_ops.gelu_backward_plain(x, g))
    assert np.array_equal(x, x_before)
    strided = x[:, ::2]  # not contiguous: one call on the whole array, the same bits
    assert np.array_equal(rules.gelu_backward(strided, g[:, ::2]),
                          layer_ops.gelu_backward_plain(strided, g[:, ::2]))


def test_tiles_cover_every_element_once_in_order():
    x = np.arange(2.5 * tiles.CACHE_TILE_BYTES / 8)  # float64: two whole tiles and half of one
    seen = []

    def rule(part):
        seen.append((part[0], part.size))
        return -part

    assert np.array_equal(tiles.in_cache_tiles(rule, x), -x)
    step = tiles.CACHE_TILE_BYTES // 8
    assert seen == [(0.0, step), (float(step), step), (float(2 * step), step // 2)]
    assert tiles.in_cache_tiles(lambda part: seen.append(part.size) or part, x[:step]) is not None
    assert seen[-1] == step  # one tile or less: one call on the whole array


def test_gelu_backward_keeps_a_wider_gradients_dtype():
    x = np.linspace(-3, 3, 11, dtype=np.float32)
    g = np.ones(11)
    assert rules.gelu_backward(x, g).dtype == np.float64
    big_x = np.linspace(-3, 3, 3 * tiles.CACHE_TILE_BYTES // 4, dtype=np.float32)
    big_g = np.ones(big_x.size)  # over a tile, of two dtypes: the rule runs once, on the whole arrays
    assert np.array_equal(rules.gelu_backward(big_x, big_g), layer_ops.gelu_backward_plain(big_x, big_g))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [257, 100_003])  # within one tile, and over several and a partial one
def test_adamw_in_place_gives_the_plain_forms_bits(dtype, n):
    rng = np.random.default_rng(1)
    fast = [rng.standard_normal(n).astype(dtype) for _ in range(3)] + [np.zeros(n, dtype)]
    plain = [a.copy() for a in fast]
    for step in (1, 2, 3):
        grad = rng.standard_normal(n).astype(dtype)
        rules.adamw_update(fast[0], grad, fast[2], fast[3], step, 1e-2, 0.9, 0.999, 1e-8, 0.1)
        optim.adamw_update_plain(plain[0], grad, plain[2], plain[3], step, 1e-2, 0.9, 0.999, 1e-8, 0.1)
    for a, b in zip(fast, plain):
        assert a.dtype == dtype and np.array_equal(a, b)


def test_installed_forms_run_in_cores_place_until_their_handles_are_removed():
    before = {name: kernels.installed(name) for name in kernels.KERNELS}  # `minipar` run in this process?
    handles = install.install_speed_forms()
    try:
        calls = []
        spy = kernels.install("gelu_backward", lambda x, g: calls.append(x.shape) or g)
        x = np.ones((2, 3))
        assert F.gelu_backward(x, x) is x and calls == [(2, 3)]  # the one installed last runs
        spy.remove()
        assert kernels.chosen("gelu_backward", None) is rules.gelu_backward
        assert kernels.chosen("gelu_forward", None) is rules.gelu_forward
        assert kernels.chosen("adamw_update", None) is rules.adamw_update
    finally:
        for handle in handles:
            handle.remove()
    assert {name: kernels.installed(name) for name in kernels.KERNELS} == before
    with pytest.raises(KeyError, match="no kernel 'softmax'"):
        kernels.install("softmax", rules.gelu_forward)


TILED_GPT = dict(n_layer=1, d_model=192, n_head=4, batch_size=8, seq_len=16, steps=2,
                 quiet=True)  # fp32: fc weight 576 KiB, its output 384 KiB (a tile: 256 KiB)


@pytest.mark.parametrize("precision", ["fp64", "fp32"])
def test_a_run_with_the_speed_forms_is_the_plain_runs_bit_for_bit(precision, plain_core, monkeypatch):
    """A training step runs the speed forms (trainer/loop.py) unless MINIPAR_KERNELS=plain: both runs
    of a GPT whose activations and largest weights span several tiles end in the same bits."""
    cfg = TrainConfig(**TILED_GPT, precision=precision)
    monkeypatch.setenv("MINIPAR_KERNELS", "plain")
    plain_losses, plain_state = reference_run(cfg)
    monkeypatch.delenv("MINIPAR_KERNELS")
    calls = []
    tiled = rules.gelu_backward
    monkeypatch.setattr(rules, "gelu_backward", lambda x, g: calls.append(x.nbytes) or tiled(x, g))
    losses, state = reference_run(cfg)
    assert calls and max(calls) > tiles.CACHE_TILE_BYTES  # the speed form ran, over several tiles
    assert all(kernels.installed(name) == [] for name in kernels.KERNELS)  # and left with the step
    assert losses == plain_losses
    assert state.keys() == plain_state.keys()
    for name, (shard, array) in state.items():
        assert shard == plain_state[name][0] and np.array_equal(array, plain_state[name][1]), name


def test_a_step_installs_nothing_with_plain_kernels_and_refuses_junk():
    with install.speed_forms({"MINIPAR_KERNELS": "plain"}):
        assert all(kernels.installed(name) == [] for name in kernels.KERNELS)
    with install.speed_forms({}):
        assert kernels.chosen("adamw_update", None) is rules.adamw_update
    with pytest.raises(ValueError, match="unknown kernels 'fast'"):
        with install.speed_forms({"MINIPAR_KERNELS": "fast"}):
            pass


def test_the_environment_chooses_the_forms_and_a_second_choice_replaces_the_first():
    try:
        assert len(install.install_from_env({})) == 3  # the default: the speed forms
        assert len(install.install_from_env({"MINIPAR_KERNELS": "speed"})) == 3
        assert all(len(kernels.installed(name)) == 1 for name in ("gelu_forward", "adamw_update"))
        assert install.install_from_env({"MINIPAR_KERNELS": "plain"}) == []
        assert all(kernels.installed(name) == [] for name in kernels.KERNELS)
        assert blas.current() == "numpy"
    finally:
        install.install_from_env({"MINIPAR_KERNELS": "plain"})
    assert install.choice_errors({"MINIPAR_KERNELS": "fast"}) == (
        "unknown kernels 'fast' in MINIPAR_KERNELS; choose one of speed, plain")
    assert install.choice_errors({"MINIPAR_KERNELS": "plain", "MINIPAR_BLAS": "mkl"}) == (
        "MINIPAR_BLAS=mkl is a speed form: not with MINIPAR_KERNELS=plain")
    with pytest.raises(ValueError, match="unknown BLAS 'openblas'"):
        install.install_from_env({"MINIPAR_BLAS": "openblas"})


def test_the_command_line_stops_on_unknown_kernels_with_exit_2():
    env = {**os.environ, "MINIPAR_KERNELS": "fast"}
    done = subprocess.run([sys.executable, "-m", "minipar", "train", "--steps", "1"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("minipar: error: unknown kernels 'fast' in MINIPAR_KERNELS; "
                           "choose one of speed, plain\n")
