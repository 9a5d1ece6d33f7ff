"""CUDA code generation: the source text, that text compiled for the host CPU and run against
NumPy (needs a C++ compiler), and the CuPy kernels on a GPU (needs cupy and a GPU)."""

import shutil
import subprocess

import numpy as np
import pytest

from minipar import fusion as fx
from minipar.fusion.codegen import _literal, _param_names, cuda_kernel


def only_kernel(expr):
    kernels = fx.fuse([expr])
    assert len(kernels) == 1
    return cuda_kernel(kernels[0])


def test_seed_example_becomes_one_elementwise_kernel():
    a, b, d = (fx.array(np.ones(8, np.float32), name=n) for n in "abd")
    k = only_kernel(fx.maximum(a + b, d))
    assert k.kind == "elementwise" and k.name == "fused_add_maximum"
    assert k.in_params == "float32 a, float32 b, float32 d" and k.out_params == "float32 out"
    assert k.operation == "out = fused_add_maximum_element(a, b, d)"
    assert k.preamble == (
        "__device__ float fused_add_maximum_element(float a, float b, float d) {\n"
        "    float t0 = a + b;\n"
        "    float t1 = (t0 > d || t0 != t0) ? t0 : d;\n"
        "    return t1;\n"
        "}\n")
    assert "cupy.ElementwiseKernel('float32 a, float32 b, float32 d', 'float32 out'" in k.source()


def test_row_sum_becomes_a_reduction_kernel():
    a, b = fx.array(np.ones((2, 3)), name="a"), fx.array(np.ones((2, 3)), name="b")
    k = only_kernel((a + b).sum(-1))
    assert k.kind == "reduction" and (k.operation, k.reduce_expr) == ("fused_add_sum_element(a, b)", "a + b")
    assert (k.post_map_expr, k.identity, k.reduce_type) == ("out = a", "0", "double")
    assert "    double t0 = a + b;\n    return t0;\n" in k.preamble
    k = only_kernel(fx.array(np.ones((2, 3), np.float32), name="x").max(0))
    assert k.identity == "((float)__longlong_as_double(0xfff0000000000000LL))"
    assert k.preamble.endswith("    return x;\n}\n")


def test_operands_are_cast_to_numpys_computation_type():
    x, y = fx.array(np.ones(3, np.float32), name="x"), fx.array(np.ones(3), name="y")
    k = only_kernel(fx.where(x > 0.1, x * 2, y) + (x <= y).astype(np.float32))
    lines = k.preamble.splitlines()[1:-2]
    assert lines == [
        "    bool t0 = x > ((float)0.1);",  # float32 compared with a Python float: in float32
        "    float t1 = x * ((float)2.0);",
        "    double t2 = t0 ? (double)t1 : y;",
        "    bool t3 = (double)x <= y;",
        "    float t4 = (float)(t3);",
        "    double t5 = t2 + (double)t4;",
    ]


def test_literals_keep_every_bit():
    assert _literal(0.1, np.float64) == "0.1" and _literal(0.1, np.float32) == "((float)0.1)"
    assert _literal(np.inf, np.float64) == "__longlong_as_double(0x7ff0000000000000LL)"
    assert _literal(3, np.int32) == "((int)3LL)" and _literal(True, np.bool_) == "true"
    assert _literal(-(2**63), np.int64) == "((long long)(-9223372036854775807LL - 1))"


def test_parameter_names_are_safe_identifiers():
    leaves = [fx.array(np.ones(2), name=n) for n in ["x", "x", "out", "t0", "in1", "float", "2x", None]]
    names = list(_param_names(leaves).values())
    assert names == ["x", "in1", "in2", "in3", "in4", "in5", "in6", "in7"]
    with pytest.raises(TypeError, match="float16"):
        only_kernel(fx.exp(fx.array(np.ones(2, np.float16))))


def host_program(cases) -> str:
    """A C++ program running each case's generated element function (and, for reductions, its
    reduce expression and identity) over the case's inputs, printing results in hex."""
    parts = ["#include <cmath>\n#include <cstdio>\n#include <cstring>\nusing namespace std;\n"
             "#define __device__ static\n"
             "static double __longlong_as_double(long long b) { double d; memcpy(&d, &b, 8); return d; }\n"]
    main = ["int main() {"]
    for i, (kernel, inputs) in enumerate(cases):
        k, cols = cuda_kernel(kernel), inputs[0].shape[-1]
        parts.append(f"namespace case{i} {{\n{k.preamble}}}\n")
        for j, values in enumerate(inputs):
            c_type = "double" if values.dtype.kind == "f" else "long long"
            data = ", ".join(_literal(v, np.float64) if values.dtype.kind == "f" else str(int(v))
                             for v in values.ravel().tolist())
            parts.append(f"static const {c_type} case{i}_in{j}[] = {{{data}}};\n")
        args = ", ".join(f"case{i}_in{j}[r * {cols} + c]" for j in range(len(inputs)))
        function = k.operation.removeprefix("out = ").split("(")[0]
        call = f"case{i}::{function}({args})"
        rows = inputs[0].size // cols
        if k.kind == "elementwise":
            main.append(f"for (int r = 0; r < {rows}; r++) for (int c = 0; c < {cols}; c++) "
                        f"printf(\"%a\\n\", (double)({call}));")
        else:
            main.append(f"for (int r = 0; r < {rows}; r++) {{ {k.reduce_type} a = {k.identity}; "
                        f"for (int c = 0; c < {cols}; c++) {{ {k.reduce_type} b = {call}; "
                        f"a = {k.reduce_expr}; }} printf(\"%a\\n\", (double)a); }}")
    return "".join(parts) + "\n".join(main) + "\nreturn 0; }\n"


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler")
def test_generated_source_compiled_for_the_cpu_computes_what_numpy_does(tmp_path):
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((3, 8)).astype(np.float32)
    f32[0, :3] = [np.nan, np.inf, -0.0]
    f32[2, 0] = 0.1  # float32(0.1) > 0.1 is False in float32 and True in double
    f64 = rng.standard_normal((3, 8)) * 3
    f64[1, :2] = [np.nan, -np.inf]
    ints = rng.integers(-5, 6, (3, 8)).astype(np.int32)
    x32, x64, i32 = fx.array(f32, name="x"), fx.array(f64, name="y"), fx.array(ints, name="k")
    expressions = [
        fx.maximum(x32 + x32 * 0.5, -x32),
        fx.minimum(x64, 0.5) + fx.maximum(x32, 0.0),  # NaN on the left must win
        x32 * 0.1 + 0.3,
        fx.minimum(x64, np.inf) / (x64 - 1.0) - fx.maximum(x64, x32),
        fx.where(x32 > 0.1, (x32 * 2).astype(np.float64), x64) + (x32 <= x64).astype(np.float32),
        fx.training.gelu_expression(x64),
        fx.training.gelu_expression(x32),
        fx.exp(x32) + fx.log(fx.sqrt(x64 * x64 + 1.0)) ** 1.5 - fx.tanh(x64),
        i32 * 3 - i32**2 + (i32 > 0) + fx.sqrt(i32 * i32).astype(np.int32),
        (x64 * x32 + 1.0).sum(-1),
        fx.maximum(x64, x32).max(-1),
        (x64 > 0).sum(-1),
        i32.max(-1),
    ]
    cases = []
    for expr in expressions:
        (kernel,) = fx.fuse([expr])
        cases.append((kernel, [np.broadcast_to(a.value, kernel.shape) for a in kernel.inputs]))
    source = tmp_path / "kernels.cpp"
    source.write_text(host_program(cases))
    subprocess.run(["g++", "-O0", "-std=c++17", "-o", str(tmp_path / "kernels"), str(source)], check=True)
    printed = subprocess.run([str(tmp_path / "kernels")], check=True, capture_output=True, text=True)
    results = iter(float.fromhex(line) for line in printed.stdout.split())
    for expr in expressions:
        with np.errstate(all="ignore"):
            expected = fx.run(expr, fused=False)[0]
        got = np.array([next(results) for _ in range(expected.size)]).reshape(expected.shape)
        exact_ops = not any(op in repr(expr) for op in ("exp", "log", "tanh", "power", "sum"))
        # libm's exp, log, tanh, pow differ from NumPy's in the last bit, which cancellation magnifies
        (kernel,) = fx.fuse([expr])
        single = any(n.dtype == np.float32 for n in kernel.nodes + kernel.inputs)
        rtol = 0 if exact_ops else 1e-5 if single else 1e-12
        np.testing.assert_allclose(got, expected.astype(np.float64), rtol=rtol, atol=0, err_msg=repr(expr))
        assert np.array_equal(np.signbit(got), np.signbit(expected)) or not exact_ops
    assert next(results, None) is None


def test_generated_kernels_run_on_a_gpu():
    cupy = pytest.importorskip("cupy")
    try:
        cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("no CUDA GPU")
    rng = np.random.default_rng(0)
    host = rng.standard_normal((64, 33)), rng.standard_normal(33).astype(np.float32)
    x, y = fx.array(cupy.asarray(host[0])), fx.array(cupy.asarray(host[1]))
    for expr in [fx.maximum(x + y, x * 0.5), fx.tanh(x - y).sum(1, keepdims=True), (x * y).max(0),
                 fx.where(x > y, x, -y) / (y + 2.0)]:
        fused, stats = fx.run(expr, fused=True)
        eager = fx.run(expr, fused=False)[0]
        assert isinstance(fused, cupy.ndarray) and len(stats.kernels) == 1
        np.testing.assert_allclose(cupy.asnumpy(fused), cupy.asnumpy(eager), rtol=1e-6)
