"""Which BLAS multiplies Linear's matrices: NumPy's own (OpenBLAS, the default) or Intel's MKL.

The idea: a GPT step is mostly the matrix products of its Linear layers, and NumPy hands them to the
BLAS library it was built with, OpenBLAS. PyTorch's CPU build uses MKL, which on an Intel CPU is
1.1x-1.3x faster on the same products (`bench autograd` measures it). To compare the two engines
rather than their BLAS libraries, or just to train faster on Intel, `MINIPAR_BLAS=mkl` makes Linear's
2-D products call MKL's `cblas_?gemm` directly (through ctypes, from the optional `mkl` package:
`pip install mkl`, never in `make setup` nor CI). Everything else stays NumPy: batched products
(attention), elementwise rules and reductions.

What it costs: nothing by default (nothing is installed: core's Linear multiplies with `a @ b`). With
MKL the bits of a product differ from OpenBLAS's in the last place, as two BLAS libraries add in
different orders: the one form of the speed layer that does not give the plain form's bits, so it is
chosen only by option. Every layout runs the same library, so the exactness contract holds
(tests/speed/test_blas.py). One BLAS thread per process, as with OpenBLAS. `use("mkl")` installs
`matmul` as core's "matmul" kernel (core/kernels.py); `use("numpy")` removes it. Lesson:
lessons/01b_speed_appendix.md ("The speed layer").
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy

from minipar.core import kernels
from minipar.core.backend import xp_of
from minipar.core.hooks import RemovableHandle

BLAS_ENV = "MINIPAR_BLAS"
BLAS_NAMES = ("numpy", "mkl")
# cblas.h: CblasRowMajor, CblasNoTrans, CblasTrans
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112

# numpy dtype -> (MKL's cblas_?gemm, alpha 1 and beta 0 in its real type), filled by use("mkl"); empty:
# NumPy's BLAS
_gemm: dict = {}
_installed: list[RemovableHandle] = []  # the handle of `matmul` in core's kernel table while MKL is in use
# A call through ctypes costs about 4 us; below this many multiply-adds (a 128 x 128 x 128 product, about
# 25 us on one core) MKL saves less than that, and NumPy's `@` multiplies instead. At least 1, so that
# an empty product never reaches MKL
MKL_LEAST_MULTIPLY_ADDS = 2**21


def mkl_library() -> Path | None:
    """MKL's runtime library as the `mkl` package installs it (in the environment's lib folder)."""
    found = sorted(Path(sys.prefix, "lib").glob("libmkl_rt.so*"))
    return found[-1] if found else None


def unavailable(name: str) -> str | None:
    """Why BLAS `name` cannot be used here (one line), or None when it can."""
    if name not in BLAS_NAMES:
        return f"unknown BLAS {name!r} in {BLAS_ENV}; choose one of {', '.join(BLAS_NAMES)}"
    if name == "mkl" and mkl_library() is None:
        return f"{BLAS_ENV}=mkl needs Intel's MKL (optional: pip install mkl; not in make setup nor CI)"
    return None


def use(name: str) -> None:
    """Multiply Linear's matrices with `name` from now on ("numpy" or "mkl"); ValueError if it cannot."""
    reason = unavailable(name)
    if reason:
        raise ValueError(reason)
    _gemm.clear()
    while _installed:
        _installed.pop().remove()
    if name == "mkl":
        lib = ctypes.CDLL(str(mkl_library()))
        lib.MKL_Set_Num_Threads(1)  # one BLAS thread per process, as OPENBLAS_NUM_THREADS=1
        for dtype, function, real in ((numpy.float32, lib.cblas_sgemm, ctypes.c_float),
                                      (numpy.float64, lib.cblas_dgemm, ctypes.c_double)):
            function.restype = None  # its arguments are wrapped by hand in matmul: cheaper than argtypes
            _gemm[numpy.dtype(dtype)] = (function, real(1.0), real(0.0))
        _installed.append(kernels.install("matmul", matmul))


def current() -> str:
    return "mkl" if _gemm else "numpy"


def matmul(a, b):
    """a @ b for 2-D arrays: through MKL when it is in use and both operands are row- or column-major
    arrays of one float dtype that it multiplies; otherwise NumPy's `@`."""
    gemm = _gemm.get(a.dtype) if _gemm else None
    if gemm is None or b.dtype != a.dtype or xp_of(a) is not numpy:  # the default: one dict check
        return a @ b
    layout_a, layout_b = _layout(a), _layout(b)
    (m, k), n = a.shape, b.shape[-1]
    if layout_a is None or layout_b is None or m * n * k < MKL_LEAST_MULTIPLY_ADDS:
        return a @ b
    function, one, zero = gemm
    out = numpy.empty((m, n), a.dtype)
    pointer = ctypes.c_void_p
    function(ROW_MAJOR, layout_a[0], layout_b[0], m, n, k, one, pointer(a.ctypes.data), layout_a[1],
             pointer(b.ctypes.data), layout_b[1], zero, pointer(out.ctypes.data), n)
    return out


def _layout(x) -> tuple[int, int] | None:
    """(transpose flag, leading dimension) of a 2-D operand for a row-major gemm: a C-contiguous array
    as it is, an F-contiguous one (the transpose of a C-contiguous array, `w.T`) transposed."""
    if x.ndim != 2:
        return None
    if x.flags.c_contiguous:
        return NO_TRANS, max(1, x.shape[1])
    if x.flags.f_contiguous:
        return TRANS, max(1, x.shape[0])
    return None
