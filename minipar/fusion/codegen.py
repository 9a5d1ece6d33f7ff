"""Code generation: turn a fused kernel into CUDA source for CuPy, and run it on a GPU.

A fused elementwise kernel becomes a `cupy.ElementwiseKernel`, a kernel ending in a reduction a
`cupy.ReductionKernel`. In both, the chain is one `__device__` function that computes one element
from one element of each input, in locals (registers): the GPU form of the CPU interpreter's cache
tiles. Every node is one line, its operands cast to the type NumPy would compute in, so the kernel
follows NumPy's type rules. The text is plain data, tested without a GPU; `launch` compiles and runs
it when CuPy and a GPU are there. Lesson: lessons/10_fusion.md.
"""

from __future__ import annotations

import functools
import re
import struct
from dataclasses import dataclass

import numpy as np

from minipar.fusion.fuse import Kernel
from minipar.fusion.ir import COMPARISONS, Node

C_TYPES = {
    "bool": "bool", "int8": "signed char", "int16": "short", "int32": "int", "int64": "long long",
    "uint8": "unsigned char", "uint16": "unsigned short", "uint32": "unsigned int",
    "uint64": "unsigned long long", "float32": "float", "float64": "double",
}
INFIX = {"add": "+", "subtract": "-", "multiply": "*", "divide": "/", "less": "<", "less_equal": "<=",
         "greater": ">", "greater_equal": ">=", "equal": "==", "not_equal": "!="}
# NumPy's maximum and minimum return NaN if either side is NaN (x != x only for NaN); fmax does not.
CHOOSE = {"maximum": "({0} > {1} || {0} != {0}) ? {0} : {1}",
          "minimum": "({0} < {1} || {0} != {0}) ? {0} : {1}"}
# CuPy's kernels name the output `out` here, the element index `i`, and their own variables `_...`.
RESERVED = {"out", "i", "int", "float", "double", "bool", "char", "short", "long",
            "signed", "unsigned", "if", "else", "for", "while", "do", "return", "const", "auto"}


@dataclass(frozen=True)
class CudaKernel:
    """The arguments of cupy.ElementwiseKernel (kind "elementwise") or cupy.ReductionKernel
    (kind "reduction"): `operation` is the elementwise body, or the reduction's map expression."""

    kind: str
    name: str
    in_params: str
    out_params: str
    preamble: str
    operation: str
    reduce_expr: str = ""
    post_map_expr: str = ""
    identity: str = ""
    reduce_type: str = ""

    def source(self) -> str:
        """The Python call that builds this kernel, as a reader would write it by hand."""
        fields = ["in_params", "out_params"] + (
            ["operation"] if self.kind == "elementwise"
            else ["operation", "reduce_expr", "post_map_expr", "identity"])
        args = [repr(getattr(self, f)) for f in fields]
        extra = f", reduce_type={self.reduce_type!r}" if self.kind == "reduction" else ""
        cls = "ElementwiseKernel" if self.kind == "elementwise" else "ReductionKernel"
        return (f"preamble = r'''\n{self.preamble}'''\n"
                f"cupy.{cls}({', '.join(args)}, name={self.name!r}{extra}, preamble=preamble)")


def cuda_kernel(kernel: Kernel) -> CudaKernel:
    """The CUDA form of a fused kernel."""
    names = _param_names(kernel.inputs)
    red = kernel.reduction
    chain = kernel.nodes[:-1] if red is not None else kernel.nodes
    element = red.args[0] if red is not None else kernel.output
    name = kernel.name if len(kernel.nodes) > 1 else f"fused_{kernel.name}"  # never a bare "sum"
    function = f"{name}_element"
    params = ", ".join(f"{_c_type(n.dtype)} {names[n]}" for n in kernel.inputs)
    lines = []
    for i, node in enumerate(chain):
        names[node] = f"t{i}"
        lines.append(f"    {_c_type(node.dtype)} t{i} = {_expression(node, names)};")
    body = "\n".join(lines + [f"    return {names[element]};"])
    preamble = f"__device__ {_c_type(element.dtype)} {function}({params}) {{\n{body}\n}}\n"
    in_params = ", ".join(f"{n.dtype} {names[n]}" for n in kernel.inputs)
    out_params = f"{kernel.output.dtype} out"
    call = f"{function}({', '.join(names[n] for n in kernel.inputs)})"
    if red is None:
        return CudaKernel("elementwise", name, in_params, out_params, preamble, f"out = {call}")
    reduce_expr = "a + b" if red.op == "sum" else CHOOSE["maximum"].format("a", "b")
    return CudaKernel("reduction", name, in_params, out_params, preamble, call,
                      reduce_expr, "out = a", _identity(red), _c_type(red.dtype))


def launch(kernel: Kernel, arrays: list, out) -> None:
    """Compile (once) and run a fused kernel on CuPy arrays, writing out."""
    compiled = _compile(cuda_kernel(kernel))
    if kernel.reduction is not None:
        compiled(*arrays, out, axis=kernel.reduction.axis, keepdims=kernel.reduction.keepdims)
    else:
        compiled(*arrays, out)


@functools.lru_cache(maxsize=256)
def _compile(k: CudaKernel):
    import cupy

    if k.kind == "elementwise":
        return cupy.ElementwiseKernel(k.in_params, k.out_params, k.operation, name=k.name,
                                      preamble=k.preamble)
    return cupy.ReductionKernel(k.in_params, k.out_params, k.operation, k.reduce_expr, k.post_map_expr,
                                k.identity, name=k.name, reduce_type=k.reduce_type, preamble=k.preamble)


def _param_names(inputs: list[Node]) -> dict[Node, str]:
    """Leaves keep their names where those are safe C identifiers; the rest are in0, in1, ..."""
    names, used = {}, set()
    for i, node in enumerate(inputs):
        name = node.name if node.is_leaf and node.name else ""
        ok = name.isidentifier() and name not in RESERVED and not re.fullmatch(r"_.*|(t|in)\d+", name)
        names[node] = name if ok and name not in used else f"in{i}"
        used.add(names[node])
    return names


def _c_type(dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype.name not in C_TYPES:
        raise TypeError(f"CUDA code generation supports {', '.join(C_TYPES)}; got {dtype}")
    return C_TYPES[dtype.name]


def _expression(node: Node, names: dict) -> str:
    """One node as a C expression over its operands, each cast to NumPy's computation type."""
    if node.op == "where":
        cond, x, y = node.args
        return f"{_operand(cond, np.bool_, names)} ? {_operand(x, node.dtype, names)} : " \
               f"{_operand(y, node.dtype, names)}"
    if node.op == "astype":
        return f"({_c_type(node.dtype)})({_operand(node.args[0], node.args[0].dtype, names)})"
    compute = _compute_dtype(node)
    ops = [_operand(a, compute, names) for a in node.args]
    if node.op in INFIX:
        return f"{ops[0]} {INFIX[node.op]} {ops[1]}"
    if node.op in CHOOSE:
        return CHOOSE[node.op].format(*ops)
    if node.op == "negative":
        return f"-({ops[0]})"
    if node.op == "power" and compute.kind in "iub":  # C has no integer pow; exact below 2**53
        return f"({_c_type(compute)})pow((double){ops[0]}, (double){ops[1]})"
    if node.op == "power":
        return f"pow({ops[0]}, {ops[1]})"
    return f"{node.op}({ops[0]})"  # exp, log, tanh, sqrt: CUDA's overloads for float and double


def _compute_dtype(node: Node):
    """The type NumPy computes in: the result's, except that comparisons compute in their
    operands' common type (NEP 50: a Python number does not widen an array's type)."""
    if node.op in COMPARISONS:
        return np.result_type(*(a.value if a.is_scalar else a.dtype for a in node.args))
    return node.dtype


def _operand(node: Node, dtype, names: dict) -> str:
    if node.is_scalar:
        return _literal(node.value, dtype)
    return names[node] if node.dtype == dtype else f"({_c_type(dtype)}){names[node]}"


def _literal(value, dtype) -> str:
    """A constant as C text of `dtype`. Floats go through double, as NumPy converts them, and
    keep every bit (repr round-trips; inf and nan are spelled by their bits)."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return "true" if value else "false"
    if dtype.kind in "iu":
        return f"(({_c_type(dtype)}){_integer(int(value))})"
    number = float(value)
    if np.isfinite(number):
        text = repr(number)
    else:
        text = f"__longlong_as_double(0x{struct.unpack('<Q', struct.pack('<d', number))[0]:016x}LL)"
    return text if dtype == np.float64 else f"(({_c_type(dtype)}){text})"


def _integer(value: int) -> str:
    """An integer literal C reads as 64 bits (the lowest int64 has no literal of its own)."""
    if value == -(2**63):
        return "(-9223372036854775807LL - 1)"
    return f"{value}ULL" if value >= 2**63 else f"{value}LL"


def _identity(red: Node) -> str:
    """The start value of a reduction: 0 for sum, the lowest value of the type for max."""
    dtype = red.dtype
    if red.op == "sum":
        return "0"
    if dtype == np.bool_:
        return "false"
    if dtype.kind in "iu":
        return f"(({_c_type(dtype)}){_integer(int(np.iinfo(dtype).min))})"
    return _literal(-np.inf, dtype)
