"""Tensor algebra with backward rules: arithmetic, matrix products, reductions, elementwise math.

Part of `minipar.core.functional` (imported as F): each operation is a `Function` whose forward and backward
are written out in array code, so a reader can check every gradient by hand. Binary operations
broadcast like NumPy; their backward sums the gradient back to each input's shape (`unbroadcast`).
Lesson: lessons/01_autograd.md.
"""

from __future__ import annotations

import math

from minipar.core import kernels
from minipar.core.autograd import Function, Tensor
from minipar.core.backend import xp_of


def _data(x):
    return x.data if isinstance(x, Tensor) else x


def unbroadcast(grad, shape):
    """Sum `grad` over the axes that broadcasting added or stretched to reach `shape`."""
    if grad.shape == tuple(shape):
        return grad
    extra = grad.ndim - len(shape)
    if extra:
        grad = grad.sum(axis=tuple(range(extra)))
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    if stretched:
        grad = grad.sum(axis=stretched, keepdims=True)
    return grad


def _shape(x):
    return x.shape if hasattr(x, "shape") else ()


# ---- elementwise arithmetic -------------------------------------------------------------------


class Add(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.shapes = (_shape(a), _shape(b))
        return a + b

    @staticmethod
    def backward(ctx, g):
        return unbroadcast(g, ctx.shapes[0]), unbroadcast(g, ctx.shapes[1])


class Sub(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.shapes = (_shape(a), _shape(b))
        return a - b

    @staticmethod
    def backward(ctx, g):
        gb = unbroadcast(-g, ctx.shapes[1]) if ctx.needs_input_grad[1] else None  # a target needs none
        return unbroadcast(g, ctx.shapes[0]), gb


class Mul(Function):
    @staticmethod
    def forward(ctx, a, b):
        # each factor is needed only for the other's gradient, so only that is saved, as PyTorch
        # saves: a product with a constant (attention's scaling of its scores) keeps nothing
        needs = ctx.needs_input_grad
        ctx.save_for_backward(a if needs[1] else None, b if needs[0] else None)
        ctx.shapes = (_shape(a), _shape(b))
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved
        ga = unbroadcast(g * b, ctx.shapes[0]) if ctx.needs_input_grad[0] else None
        gb = unbroadcast(g * a, ctx.shapes[1]) if ctx.needs_input_grad[1] else None
        return ga, gb


class Div(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a / b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved
        ga = unbroadcast(g / b, _shape(a)) if ctx.needs_input_grad[0] else None
        gb = unbroadcast(-g * a / (b * b), _shape(b)) if ctx.needs_input_grad[1] else None
        return ga, gb


class Neg(Function):
    @staticmethod
    def forward(ctx, a):
        return -a

    @staticmethod
    def backward(ctx, g):
        return -g


class Pow(Function):
    """x ** p for a constant exponent p."""

    @staticmethod
    def forward(ctx, a, p):
        ctx.save_for_backward(a)
        ctx.p = p
        return a**p

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved
        return g * ctx.p * a ** (ctx.p - 1), None


def add(a, b):
    return Add.apply(a, b)


def sub(a, b):
    return Sub.apply(a, b)


def mul(a, b):
    return Mul.apply(a, b)


def div(a, b):
    return Div.apply(a, b)


def neg(a):
    return Neg.apply(a)


def pow(a, exponent):
    return Pow.apply(a, exponent)


# ---- linear algebra ---------------------------------------------------------------------------


class MatMul(Function):
    """Batched matrix product with broadcasting over leading axes (inputs at least 2-D)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved
        ga = unbroadcast(g @ b.swapaxes(-1, -2), a.shape) if ctx.needs_input_grad[0] else None
        gb = unbroadcast(a.swapaxes(-1, -2) @ g, b.shape) if ctx.needs_input_grad[1] else None
        return ga, gb


class Linear(Function):
    """y = x W^T + b with W of shape (out, in), as torch.nn.functional.linear.

    Leading axes are folded into rows first, so that each product is one 2-D matrix product (one BLAS
    call) rather than a batch of small ones. Where NumPy's batched product also calls BLAS the bits
    are the same; for some shapes (the GPT's 13-wide head) it runs its own loop, which adds in
    another order: the two then differ in the last bit."""

    reads_in_backward = (1, 2)  # the weight (its data then: ZeRO-3 re-gathers it) and whether a bias

    @staticmethod
    def forward(ctx, x, weight, bias=None):
        ctx.save_for_backward(x)
        y = linear_product(_rows(x), weight.T, "forward")
        if bias is not None:
            y += bias
        return y if x.ndim == 2 else y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved
        weight, bias = _data(ctx.inputs[1]), ctx.inputs[2]
        g2 = _rows(g)
        gx = _unrows(linear_product(g2, weight, "input_grad"), x) if ctx.needs_input_grad[0] else None
        gw = linear_product(g2.T, _rows(x), "weight_grad") if ctx.needs_input_grad[1] else None
        gb = g2.sum(axis=0) if bias is not None and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def linear_product(a, b, role: str):
    """a @ b of two 2-D arrays, one of Linear's three products (`role`: "forward" x W^T, "input_grad"
    g W, "weight_grad" g^T x): the form installed for "linear" (core/kernels.py; precision/fp8.py
    quantizes each operand its own way), else `matrix_product`."""
    return kernels.chosen("linear", _linear_product_of_role)(a, b, role)


def _linear_product_of_role(a, b, role: str):
    return matrix_product(a, b)


def matrix_product(a, b):
    """a @ b of two 2-D arrays: NumPy's `@`, or the form installed for "matmul" (core/kernels.py;
    speed/blas.py: MKL's gemm with MINIPAR_BLAS=mkl, which rounds in another order)."""
    return kernels.chosen("matmul", _linear_product_plain)(a, b)


def _linear_product_plain(a, b):
    return a @ b


def _rows(a):
    """a as a 2-D matrix of rows: its leading axes folded into one (a 2-D array as it is)."""
    return a if a.ndim == 2 else a.reshape(-1, a.shape[-1])


def _unrows(rows, like):
    """rows (2-D) back in the shape of `like`, whose leading axes _rows folded (a 2-D one as it is)."""
    return rows if like.ndim == 2 else rows.reshape(like.shape)


def same_dtype(op: str, *operands) -> None:
    """A matrix product of two dtypes is refused, as PyTorch refuses it: NumPy would promote the whole
    product (and its gradients) to the wider type in silence, doubling the bytes of an fp32 model fed
    float64 data. Elementwise ops promote, as in PyTorch."""
    first = getattr(operands[0], "dtype", None)
    for x in operands[1:]:  # a plain loop, no generator: this runs for every product of every step
        if x is not None and getattr(x, "dtype", None) != first:
            named = " and ".join(str(getattr(y, "dtype", None)) for y in operands if y is not None)
            raise TypeError(f"{op}: expected both operands to have the same dtype, got {named}")


def matmul(a, b):
    same_dtype("matmul", a, b)
    return MatMul.apply(a, b)


def linear(x, weight, bias=None):
    same_dtype("linear", x, weight, bias)
    return Linear.apply(x, weight, bias)


# ---- reductions ---------------------------------------------------------------------------------


def _expand_to(g, shape, axis, keepdims):
    if axis is not None and not keepdims:
        axes = (axis,) if isinstance(axis, int) else axis
        axes = tuple(ax % len(shape) for ax in axes)
        for ax in sorted(axes):
            g = xp_of(g).expand_dims(g, ax)
    xp = xp_of(g)
    if g.ndim == 0:  # a full reduction (a loss's): filling an array costs less Python than broadcast_to
        out = xp.empty(shape, g.dtype)
        out[...] = g  # an assignment, so that a device's 0-d array never passes through the host
        return out
    return xp.broadcast_to(g, shape)


class Sum(Function):
    @staticmethod
    def forward(ctx, a, axis=None, keepdims=False):
        ctx.shape, ctx.axis, ctx.keepdims = a.shape, axis, keepdims
        return a.sum(axis=axis, keepdims=keepdims)

    @staticmethod
    def backward(ctx, g):
        return _expand_to(g, ctx.shape, ctx.axis, ctx.keepdims), None, None


class Max(Function):
    """Maximum over axes; the gradient is split evenly between tied maxima."""

    @staticmethod
    def forward(ctx, a, axis=None, keepdims=False):
        out = a.max(axis=axis, keepdims=True)
        ctx.save_for_backward(a == out)
        ctx.shape, ctx.axis, ctx.keepdims = a.shape, axis, keepdims
        if keepdims:
            return out
        return out.reshape(()) if axis is None else xp_of(out).squeeze(out, axis=axis)

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved
        share = (mask / mask.sum(axis=ctx.axis, keepdims=True)).astype(g.dtype)  # bool / int is float64
        return _expand_to(g, ctx.shape, ctx.axis, ctx.keepdims) * share, None, None


def sum(a, axis=None, keepdims=False):
    return Sum.apply(a, axis, keepdims)


def mean(a, axis=None, keepdims=False):
    shape = _data(a).shape
    axes = range(len(shape)) if axis is None else ((axis,) if isinstance(axis, int) else axis)
    count = math.prod(shape[ax] for ax in axes)
    return mul(Sum.apply(a, axis, keepdims), 1.0 / count)


def max(a, axis=None, keepdims=False):
    return Max.apply(a, axis, keepdims)


# ---- elementwise functions ----------------------------------------------------------------------


class Exp(Function):
    @staticmethod
    def forward(ctx, a):
        out = xp_of(a).exp(a)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        return g * ctx.saved[0]


class Log(Function):
    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return xp_of(a).log(a)

    @staticmethod
    def backward(ctx, g):
        return g / ctx.saved[0]


class Tanh(Function):
    @staticmethod
    def forward(ctx, a):
        out = xp_of(a).tanh(a)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved
        return g * (1 - out * out)


class ReLU(Function):
    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a > 0)
        return xp_of(a).maximum(a, 0)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.saved[0]



def exp(a):
    return Exp.apply(a)


def log(a):
    return Log.apply(a)


def tanh(a):
    return Tanh.apply(a)


def relu(a):
    return ReLU.apply(a)
