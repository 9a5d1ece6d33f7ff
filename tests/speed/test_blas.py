"""Linear's products through the BLAS that MINIPAR_BLAS names (speed/blas.py).

By default `blas.matmul` is NumPy's `@`, bit for bit. With MKL (an optional package: these tests skip
where it is not installed, as in CI) every operand layout Linear uses (C-contiguous, the transpose of
one, a view that is neither) gives NumPy's product to within the rounding of a k-term dot product, and
a layout still trains to one process's losses and weights at 1e-9. A BLAS that cannot be used is one
line and exit 2 from the command line.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from minipar.speed import blas
from minipar.trainer.launch import mpiexec

needs_mkl = pytest.mark.skipif(blas.mkl_library() is None,
                               reason="MKL is not installed (optional: pip install mkl)")


@pytest.fixture
def mkl(monkeypatch):
    """MKL in use for every product, however small (the tests' operands are)."""
    monkeypatch.setattr(blas, "MKL_LEAST_MULTIPLY_ADDS", 1)
    blas.use("mkl")
    yield
    blas.use("numpy")


def operands(dtype, m=37, k=53, n=29):
    """a (m, k) and b (k, n) in each layout Linear hands to matmul: as made, and as the transpose of a
    C-contiguous array (x @ W.T, g.T @ x), and one strided view that is neither."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    a_t, b_t = np.ascontiguousarray(a.T).T, np.ascontiguousarray(b.T).T  # F-contiguous, same values
    strided = np.repeat(a, 2, axis=1)[:, ::2]
    assert a_t.flags.f_contiguous and not a_t.flags.c_contiguous and not strided.flags.c_contiguous
    return [(a, b), (a_t, b), (a, b_t), (a_t, b_t), (strided, b)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_by_default_matmul_is_numpys_product_bit_for_bit(dtype):
    assert blas.current() == "numpy"
    for a, b in operands(dtype):
        assert np.array_equal(blas.matmul(a, b), a @ b)


@needs_mkl
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mkl_gives_the_product_to_rounding_in_every_layout(dtype, mkl):
    u = np.finfo(dtype).eps / 2
    for a, b in operands(dtype):
        exact = a.astype(np.float64) @ b.astype(np.float64) if dtype == np.float32 else a @ b
        # a dot product of k terms, rounded in any order: |error| <= k u sum |a_i b_i| (Higham 3.1)
        bound = a.shape[1] * u * (np.abs(a) @ np.abs(b))
        got = blas.matmul(a, b)
        assert got.dtype == dtype and got.shape == (a.shape[0], b.shape[1]) and got.flags.c_contiguous
        assert np.all(np.abs(got - exact) <= 2 * bound)
    assert blas.current() == "mkl"


@needs_mkl
def test_mkl_multiplies_every_layout_it_can_and_only_those(mkl, monkeypatch):
    # MKL and OpenBLAS may well agree to the bit, so count the calls that reach MKL's gemm: a matmul that
    # silently fell back to `@` (a layout misread) would pass the rounding test above
    calls, gemm = [], blas._gemm[np.dtype(np.float64)]
    counting = lambda *args: calls.append(args[:6]) or gemm[0](*args)  # noqa: E731
    monkeypatch.setitem(blas._gemm, np.dtype(np.float64), (counting, *gemm[1:]))
    for a, b in operands(np.float64):
        blas.matmul(a, b)
    no, yes = blas.NO_TRANS, blas.TRANS
    flags = [(no, no), (yes, no), (no, yes), (yes, yes)]  # the strided view went to NumPy
    assert calls == [(blas.ROW_MAJOR, ta, tb, 37, 29, 53) for ta, tb in flags]


@needs_mkl
def test_small_products_stay_with_numpy(mkl, monkeypatch):
    calls, gemm = [], blas._gemm[np.dtype(np.float64)]
    counting = lambda *args: calls.append(args[3:6]) or gemm[0](*args)  # noqa: E731
    monkeypatch.setitem(blas._gemm, np.dtype(np.float64), (counting, *gemm[1:]))
    monkeypatch.setattr(blas, "MKL_LEAST_MULTIPLY_ADDS", 64 * 64 * 64)
    blas.matmul(np.ones((64, 63)), np.ones((63, 64)))  # 64 x 64 x 63 multiply-adds: under the least
    assert calls == []
    blas.matmul(np.ones((64, 64)), np.ones((64, 64)))
    assert calls == [(64, 64, 64)]


@needs_mkl
def test_mkl_falls_back_to_numpy_where_it_cannot_multiply(mkl):
    a = np.arange(12.0).reshape(3, 4)
    assert np.array_equal(blas.matmul(a, np.ones((4, 0))), np.zeros((3, 0)))  # an empty side
    mixed = blas.matmul(a.astype(np.float32), np.ones((4, 2)))  # two dtypes: NumPy's promotion
    assert mixed.dtype == np.float64 and np.array_equal(mixed, a @ np.ones((4, 2)))
    ints = np.arange(6).reshape(2, 3)
    assert np.array_equal(blas.matmul(ints, ints.T), ints @ ints.T)  # not a float: NumPy's


def test_each_layout_reaches_gemm_with_its_transpose_flag_and_leading_dimension(monkeypatch):
    """The dispatch alone, with no MKL (as in CI): a recording gemm in its place. Row-major gemm reads a
    C-contiguous operand as it is (leading dimension: its columns) and an F-contiguous one, the
    transpose of a C-contiguous array, transposed (leading dimension: its rows); a view that is neither,
    and a product under the least size, go to NumPy's `@`."""
    calls = []
    monkeypatch.setattr(blas, "MKL_LEAST_MULTIPLY_ADDS", 1)
    monkeypatch.setitem(blas._gemm, np.dtype(np.float64), (lambda *args: calls.append(args), 1.0, 0.0))
    pairs = list(operands(np.float64))
    for a, b in pairs:
        blas.matmul(a, b)
    no, yes = blas.NO_TRANS, blas.TRANS
    assert [(c[0], c[1], c[2], c[3], c[4], c[5], c[8], c[10], c[13]) for c in calls] == [
        (blas.ROW_MAJOR, ta, tb, 37, 29, 53, lda, ldb, 29)
        for ta, tb, lda, ldb in ((no, no, 53, 29), (yes, no, 37, 29), (no, yes, 53, 53), (yes, yes, 37, 53))]
    to_gemm = [(a, b) for a, b in pairs if a.flags.forc and b.flags.forc]  # the strided view goes to `@`
    assert [(c[7].value, c[9].value) for c in calls] == [(a.ctypes.data, b.ctypes.data) for a, b in to_gemm]
    calls.clear()
    monkeypatch.setattr(blas, "MKL_LEAST_MULTIPLY_ADDS", 64 * 64 * 64)
    small = blas.matmul(np.ones((64, 63)), np.ones((63, 64)))  # 64 x 64 x 63: under the least
    assert calls == [] and np.array_equal(small, np.full((64, 64), 63.0))
    blas.matmul(np.ones((64, 64)), np.ones((64, 64)))  # 64 x 64 x 64: the least itself goes to gemm
    assert len(calls) == 1


def test_an_unknown_or_missing_blas_is_refused_in_one_line(monkeypatch):
    assert "choose one of numpy, mkl" in blas.unavailable("openblas")
    monkeypatch.setattr(blas, "mkl_library", lambda: None)
    reason = blas.unavailable("mkl")
    assert reason.startswith("MINIPAR_BLAS=mkl needs Intel's MKL") and "\n" not in reason
    with pytest.raises(ValueError, match="pip install mkl"):
        blas.use("mkl")
    assert blas.current() == "numpy"


def test_the_command_line_stops_on_a_bad_blas_with_exit_2():
    env = {**os.environ, "MINIPAR_BLAS": "openblas"}
    done = subprocess.run([sys.executable, "-m", "minipar", "train", "--steps", "1"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("minipar: error: unknown BLAS 'openblas' in MINIPAR_BLAS; "
                           "choose one of numpy, mkl\n")


@needs_mkl
def test_a_layout_with_mkl_trains_like_one_process():
    env = {**os.environ, "MINIPAR_BLAS": "mkl", "OPENBLAS_NUM_THREADS": "1", "MPIEXEC_TIMEOUT": "120"}
    command = [mpiexec(), "-n", "2", sys.executable, "-m", "minipar", "train", "--tp", "2", "--precision",
               "fp64", "--steps", "3", "--check-reference"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "check against one process: PASS over steps 1..3 (tolerance 1.0e-09)" in done.stdout
