"""Core's kernels give the same bits as their plain forms, written out here.

GELU's forward and backward and AdamW's update are core's plain forms (the speed layer's in-place,
tiled forms are checked against them in tests/speed/test_rules.py); Softmax and LayerNorm are written
in place (fewer temporaries), and the causal softmax is one op: each must equal, bit for bit, the plain
one-temporary-per-operation form below, in fp64 and fp32. Linear folds its leading axes into one 2-D
matrix product: that is its definition now, and it agrees with NumPy's batched product to rounding
(not always bit for bit: see the test). The memory ledger's running device total must equal the sum
of its current device bytes after any sequence of sets.
"""

import math

import numpy as np
import pytest

from minipar.core import functional as F
from minipar.core import optim
from minipar.core.autograd import Tensor
from minipar.memory.ledger import CATEGORIES, TIERS, MemoryLedger

C = math.sqrt(2.0 / math.pi)
DTYPES = (np.float64, np.float32)


def plain_gelu(x):
    return 0.5 * x * (1.0 + np.tanh(C * (x + 0.044715 * x * x * x)))


def plain_gelu_backward(x, g):
    t = np.tanh(C * (x + 0.044715 * x * x * x))
    d_inner = C * (1.0 + 3 * 0.044715 * x * x)
    return g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * d_inner)


def plain_adamw(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    param *= 1 - lr * weight_decay
    exp_avg *= beta1
    exp_avg += (1 - beta1) * grad
    exp_avg_sq *= beta2
    exp_avg_sq += (1 - beta2) * grad * grad
    denom = np.sqrt(exp_avg_sq) / (1 - beta2**step) ** 0.5 + eps
    param -= (lr / (1 - beta1**step)) * exp_avg / denom


@pytest.mark.parametrize("dtype", DTYPES)
def test_cores_gelu_forms_give_the_plain_forms_bits(dtype):
    rng = np.random.default_rng(0)
    x = (3 * rng.standard_normal((7, 33))).astype(dtype)
    g = rng.standard_normal((7, 33)).astype(dtype)
    x_before = x.copy()
    forward, backward = F.gelu_forward(x), F.gelu_backward(x, g)
    assert forward.dtype == backward.dtype == dtype
    assert np.array_equal(forward, plain_gelu(x))
    assert np.array_equal(backward, plain_gelu_backward(x, g))
    assert np.array_equal(x, x_before)  # the saved input is read, never written


def test_gelu_backward_keeps_a_wider_gradients_dtype():
    x = np.linspace(-3, 3, 11, dtype=np.float32)
    g = np.ones(11)
    assert F.gelu_backward(x, g).dtype == np.float64


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [257, 100_003])  # small, and over several tiles (tests/speed: the tiled form)
def test_cores_adamw_gives_the_plain_forms_bits(dtype, n):
    rng = np.random.default_rng(1)
    fast = [rng.standard_normal(n).astype(dtype) for _ in range(3)] + [np.zeros(n, dtype)]
    plain = [a.copy() for a in fast]
    for step in (1, 2, 3):
        grad = rng.standard_normal(n).astype(dtype)
        optim.adamw_update(fast[0], grad, fast[2], fast[3], step, 1e-2, 0.9, 0.999, 1e-8, 0.1)
        plain_adamw(plain[0], grad, plain[2], plain[3], step, 1e-2, 0.9, 0.999, 1e-8, 0.1)
    for a, b in zip(fast, plain):
        assert a.dtype == dtype and np.array_equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_is_one_product_of_rows_and_agrees_with_the_batched_product(dtype):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 5, 8)).astype(dtype)
    w = rng.standard_normal((6, 8)).astype(dtype)
    b = rng.standard_normal(6).astype(dtype)
    xt, wt, bt = Tensor(x, True), Tensor(w, True), Tensor(b, True)
    y = F.linear(xt, wt, bt)
    g = rng.standard_normal(y.shape).astype(dtype)
    y.backward(g)
    rows = x.reshape(-1, 8)
    assert np.array_equal(y.data, (rows @ w.T + b).reshape(3, 5, 6))
    # NumPy's batched x @ w.T may add in another order (its own loop, not BLAS, for some shapes)
    np.testing.assert_allclose(y.data, x @ w.T + b, rtol=1e-5 if dtype == np.float32 else 1e-13)
    assert np.array_equal(xt.grad, (g.reshape(-1, 6) @ w).reshape(x.shape))
    assert np.array_equal(wt.grad, g.reshape(-1, 6).T @ x.reshape(-1, 8))
    assert np.array_equal(bt.grad, g.reshape(-1, 6).sum(axis=0))


def test_linear_of_one_vector_keeps_its_shape():
    x, w = Tensor(np.arange(4.0), True), Tensor(np.ones((3, 4)), True)
    y = F.linear(x, w)
    y.backward(np.ones(3))
    assert y.shape == (3,) and x.grad.shape == (4,) and np.array_equal(y.data, [6.0, 6.0, 6.0])


def test_ledger_running_device_total_is_the_sum_of_its_device_bytes():
    rng = np.random.default_rng(3)
    with MemoryLedger() as ledger:
        highest = 0
        for _ in range(200):
            category, tier = CATEGORIES[rng.integers(5)], TIERS[rng.integers(3)]
            ledger.set(category, int(rng.integers(0, 1000)), tier)
            total = sum(ledger.current[(c, "device")] for c in CATEGORIES)
            highest = max(highest, total)
            assert ledger.device_total() == total
        assert ledger.device_peak == highest


def plain_softmax(a, axis):
    e = np.exp(a - a.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def plain_layer_norm(x, w, b, g, eps=1e-5):
    centred = x - x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt((centred * centred).mean(axis=-1, keepdims=True) + eps)
    xhat = centred * rstd
    gxhat = g * w
    gx = rstd * (gxhat - gxhat.mean(axis=-1, keepdims=True)
                 - xhat * (gxhat * xhat).mean(axis=-1, keepdims=True))
    return xhat * w + b, gx


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_and_layer_norm_in_place_give_the_plain_forms_bits(dtype):
    rng = np.random.default_rng(4)
    a = rng.standard_normal((2, 3, 6, 6)).astype(dtype)
    for axis in (-1, 1):
        assert np.array_equal(F.softmax(Tensor(a), axis).data, plain_softmax(a, axis))
    x = rng.standard_normal((3, 4, 16)).astype(dtype)
    w, b = rng.standard_normal(16).astype(dtype), rng.standard_normal(16).astype(dtype)
    g = rng.standard_normal(x.shape).astype(dtype)
    xt = Tensor(x, True)
    y = F.layer_norm(xt, Tensor(w, True), Tensor(b, True))
    y.backward(g)
    want_y, want_gx = plain_layer_norm(x, w, b, g)
    assert y.data.dtype == dtype and np.array_equal(y.data, want_y)
    assert np.array_equal(xt.grad, want_gx)


def plain_causal_softmax(scores, g):
    """softmax(scores + mask) and its gradient, as the two ops (add, softmax) give them."""
    T = scores.shape[-1]
    probs = plain_softmax(scores + np.triu(np.full((T, T), -np.inf, scores.dtype), k=1), -1)
    return probs, probs * (g - (g * probs).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_softmax_in_one_op_gives_the_two_ops_bits(dtype):
    rng = np.random.default_rng(9)
    scores = (4 * rng.standard_normal((2, 3, 7, 7))).astype(dtype)
    g = rng.standard_normal(scores.shape).astype(dtype)
    x = Tensor(scores, True)
    y = F.causal_softmax(x)
    y.backward(g)
    want, want_grad = plain_causal_softmax(scores, g)
    assert y.data.dtype == x.grad.dtype == dtype
    assert np.array_equal(y.data, want) and np.array_equal(x.grad, want_grad)
    above = np.triu(np.ones((7, 7), bool), k=1)
    assert not y.data[..., above].any() and np.all(y.data[..., ~above] > 0)  # a query sees no later key


def test_causal_softmax_on_a_device_runs_the_plain_form_with_the_same_bits():
    """The fake device refuses max(where=...), as CuPy does: the NumPy path run there fails."""
    from fake_device import fake_cupy

    from minipar.core import backend

    rng = np.random.default_rng(10)
    scores, g = rng.standard_normal((2, 2, 5, 5)), rng.standard_normal((2, 2, 5, 5))
    with fake_cupy():  # it sets the backend back to NumPy on leaving
        be = backend.set_backend("cupy")
        x = Tensor(be.from_host(scores), True)
        y = F.causal_softmax(x)
        y.backward(be.from_host(g))
        on_device = be.to_host(y.data), be.to_host(x.grad)
    want, want_grad = plain_causal_softmax(scores, g)
    assert np.array_equal(on_device[0], want) and np.array_equal(on_device[1], want_grad)
