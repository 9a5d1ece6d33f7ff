"""Kernel fusion: a lazy array language, a fusion pass and interpreters that count bytes.

    from minipar import fusion as fx
    a, b, d = fx.array(A, name="a"), fx.array(B, name="b"), fx.array(D, name="d")
    e = fx.maximum(a + b, d)                 # builds a graph, computes nothing
    out, stats = fx.run(e, fused=True)       # one kernel: reads a, b, d once, writes e once
    stats.bytes_read, stats.bytes_written, stats.kernels

ir.py builds expressions, fuse.py groups them into kernels, interpret.py runs them eagerly or fused
(tile by tile in cache on NumPy, generated CUDA on CuPy via codegen.py), training.py runs AdamW and
GELU through them, bench.py measures the difference. Lesson: lessons/10_fusion.md.
"""

from minipar.fusion.codegen import CudaKernel, cuda_kernel
from minipar.fusion.fuse import Kernel, fuse, one_kernel_per_op
from minipar.fusion.interpret import KernelStats, Stats, run
from minipar.fusion.ir import (
    Node,
    add,
    array,
    astype,
    divide,
    equal,
    exp,
    greater,
    greater_equal,
    less,
    less_equal,
    log,
    max,
    maximum,
    minimum,
    multiply,
    negative,
    not_equal,
    power,
    sqrt,
    subtract,
    sum,
    tanh,
    where,
)
from minipar.fusion.tiled import TILE
from minipar.fusion.training import adamw_update, gelu, gelu_backward

__all__ = [
    "CudaKernel", "Kernel", "KernelStats", "Node", "Stats", "TILE", "adamw_update", "add", "array",
    "astype", "cuda_kernel", "divide", "equal", "exp", "fuse", "gelu", "gelu_backward", "greater",
    "greater_equal", "less", "less_equal", "log", "max", "maximum", "minimum", "multiply", "negative",
    "not_equal", "one_kernel_per_op", "power", "run", "sqrt", "subtract", "sum", "tanh", "where",
]
