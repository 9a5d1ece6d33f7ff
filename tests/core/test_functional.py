"""Every op in minipar.core.functional against central finite differences, in fp64, over shapes.

The check: draw inputs, run the op, back-propagate a fixed random cotangent R from the output (so every
output element matters), and compare each input's gradient with the derivative of sum(op(x) * R)
taken by a 4-point central difference in plain NumPy (no autograd). Error is measured as
|analytic - numeric| / max(|analytic|, |numeric|, FLOOR) and must be <= 1e-6. Inputs are drawn from a
seeded generator (hypothesis picks shapes, seeds and options) and kept away from kinks where an op
has them (relu at 0, ties in max, 0 in a denominator or a log).
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from minipar.core import functional as F
from minipar.core.autograd import Tensor, no_grad

RTOL = 1e-6
FLOOR = 1e-4  # gradients are O(0.1..1) here; below this, compare absolutely (roundoff of the stencil)
STEP = 1e-4
EXAMPLES = settings(max_examples=25, deadline=None)

shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4)
seeds = st.integers(0, 2**32 - 1)


def relative_error(a, b) -> float:
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.size == 0:
        return 0.0
    return float(np.max(np.abs(a - b) / np.maximum(np.maximum(np.abs(a), np.abs(b)), FLOOR)))


def numeric_derivative(loss, array, index):
    """d loss / d array[index] by the 4-point stencil (error O(h^4)); array is restored after."""
    original = array[index]
    values = []
    for offset in (2, 1, -1, -2):
        array[index] = original + offset * STEP
        values.append(loss())
    array[index] = original
    f2, f1, fm1, fm2 = values
    return (8 * (f1 - fm1) - (f2 - fm2)) / (12 * STEP)


def numeric_gradient(loss, arrays, i):
    """d loss / d arrays[i], element by element."""
    x = arrays[i]
    grad = np.zeros_like(x)
    for k in np.ndindex(x.shape):
        grad[k] = numeric_derivative(loss, x, k)
    return grad


def check_gradients(op, *arrays, wrt=None):
    """Analytic gradients of op(*tensors) against finite differences, for the inputs listed in `wrt`."""
    arrays = [np.array(a, dtype=np.float64) for a in arrays]
    wrt = range(len(arrays)) if wrt is None else wrt
    tensors = [Tensor(a.copy(), requires_grad=True) for a in arrays]
    out = op(*tensors)
    cotangent = np.asarray(np.random.default_rng(12345).standard_normal(out.shape))
    out.backward(cotangent)

    def loss():
        with no_grad():
            return float(np.sum(op(*[Tensor(a) for a in arrays]).data * cotangent))

    for i in wrt:
        numeric = numeric_gradient(loss, arrays, i)
        assert tensors[i].grad is not None, f"input {i} got no gradient"
        assert tensors[i].grad.shape == arrays[i].shape
        error = relative_error(tensors[i].grad, numeric)
        assert error <= RTOL, f"input {i}: relative error {error:.2e}"
    return out


def normal(seed, shape, salt=0):
    return np.random.default_rng([seed, salt]).standard_normal(shape)


def away_from_zero(seed, shape, salt=0, margin=0.3):
    """Values with |x| >= margin, random sign: safe for division, relu and log(|x|)."""
    z = normal(seed, shape, salt)
    return np.where(z >= 0, 1.0, -1.0) * (margin + np.abs(z))


def distinct(seed, shape):
    """Values at least 0.1 apart (no ties, and no kink crossed by the stencil): for max."""
    n = int(np.prod(shape))
    rng = np.random.default_rng([seed, 9])
    return (rng.permutation(n) * 0.1 + rng.uniform(0, 0.01, n)).reshape(shape) - 0.05 * n


# ---- binary elementwise ops, broadcasting ------------------------------------------------------

BINARY = {
    "add": (F.add, normal),
    "sub": (F.sub, normal),
    "mul": (F.mul, normal),
    "div": (F.div, away_from_zero),
}


@pytest.mark.parametrize("name", BINARY)
@EXAMPLES
@given(shapes=hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=3, max_side=3), seed=seeds)
def test_binary_ops_broadcast(name, shapes, seed):
    op, second = BINARY[name]
    a_shape, b_shape = shapes.input_shapes
    out = check_gradients(op, normal(seed, a_shape, 1), second(seed, b_shape, 2))
    assert out.shape == shapes.result_shape


@pytest.mark.parametrize("name", BINARY)
@EXAMPLES
@given(shape=shapes, seed=seeds, constant=st.floats(0.5, 3.0), constant_first=st.booleans())
def test_binary_ops_with_constants(name, shape, seed, constant, constant_first):
    """One side a Python float or a plain array (not a Tensor): only the Tensor side gets a gradient."""
    op, _ = BINARY[name]
    plain = away_from_zero(seed, shape, 3)
    for other in (constant, plain):
        def with_constant(x, other=other):
            return op(other, x) if constant_first else op(x, other)

        x = away_from_zero(seed, shape, 4)
        check_gradients(with_constant, x)


def test_tensor_operators_map_onto_functional():
    a, b = Tensor(np.array([1.5, -2.0]), True), np.array([0.5, 4.0])
    np.testing.assert_array_equal((a + b).data, a.data + b)
    np.testing.assert_array_equal((b + a).data, b + a.data)  # ndarray defers to Tensor.__radd__
    np.testing.assert_array_equal((b - a).data, b - a.data)
    np.testing.assert_array_equal((2.0 / a).data, 2.0 / a.data)
    np.testing.assert_array_equal((-a).data, -a.data)
    np.testing.assert_array_equal((a**3).data, a.data**3)
    assert isinstance(b * a, Tensor) and isinstance(b @ a, Tensor)


# ---- unary elementwise ops ----------------------------------------------------------------------

UNARY = {
    "neg": (F.neg, normal),
    "exp": (F.exp, normal),
    "log": (F.log, lambda seed, shape: np.abs(away_from_zero(seed, shape))),
    "tanh": (F.tanh, normal),
    "relu": (F.relu, away_from_zero),
    "gelu": (F.gelu, lambda seed, shape: 2 * normal(seed, shape)),
    "pow3": (lambda x: F.pow(x, 3), normal),
    "pow_half": (lambda x: F.pow(x, 0.5), lambda seed, shape: np.abs(away_from_zero(seed, shape))),
    "pow_neg2": (lambda x: x**-2, away_from_zero),
}


@pytest.mark.parametrize("name", UNARY)
@EXAMPLES
@given(shape=shapes, seed=seeds)
def test_unary_ops(name, shape, seed):
    op, draw = UNARY[name]
    check_gradients(op, draw(seed, shape))


def test_relu_and_gelu_values():
    x = np.array([-2.0, -0.5, 0.5, 2.0])
    np.testing.assert_array_equal(F.relu(Tensor(x)).data, [0, 0, 0.5, 2.0])
    # GPT-2's tanh approximation, written out independently
    expected = [0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v**3))) for v in x]
    np.testing.assert_allclose(F.gelu(Tensor(x)).data, expected, rtol=1e-15)


# ---- linear algebra ------------------------------------------------------------------------------


@EXAMPLES
@given(
    batch=hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=2, max_side=3),
    m=st.integers(1, 3), k=st.integers(1, 3), n=st.integers(1, 3), seed=seeds,
)
def test_matmul_batched_and_broadcast(batch, m, k, n, seed):
    a_shape = batch.input_shapes[0] + (m, k)
    b_shape = batch.input_shapes[1] + (k, n)
    out = check_gradients(F.matmul, normal(seed, a_shape, 1), normal(seed, b_shape, 2))
    assert out.shape == batch.result_shape + (m, n)


@EXAMPLES
@given(lead=hnp.array_shapes(min_dims=1, max_dims=2, max_side=3), d_in=st.integers(1, 4),
       d_out=st.integers(1, 4), bias=st.booleans(), seed=seeds)
def test_linear(lead, d_in, d_out, bias, seed):
    x, w, b = normal(seed, lead + (d_in,), 1), normal(seed, (d_out, d_in), 2), normal(seed, (d_out,), 3)
    if bias:
        out = check_gradients(F.linear, x, w, b)
    else:
        out = check_gradients(lambda x, w: F.linear(x, w), x, w)
    assert out.shape == lead + (d_out,)
    np.testing.assert_allclose(out.data, x @ w.T + (b if bias else 0), rtol=1e-14)


def test_linear_with_a_plain_array_input_skips_its_gradient():
    w = Tensor(normal(0, (3, 2)), requires_grad=True)
    F.linear(normal(1, (4, 2)), w).backward(np.ones((4, 3)))
    np.testing.assert_allclose(w.grad, np.ones((3, 4)) @ normal(1, (4, 2)))


# ---- reductions ----------------------------------------------------------------------------------


@st.composite
def shape_and_axis(draw):
    shape = draw(shapes)
    axis = draw(st.one_of(
        st.none(),
        st.integers(-len(shape), len(shape) - 1),
        st.lists(st.integers(0, len(shape) - 1), min_size=1, max_size=len(shape), unique=True).map(tuple),
    ))
    return shape, axis, draw(st.booleans())


REDUCTIONS = {"sum": (F.sum, np.sum), "mean": (F.mean, np.mean), "max": (F.max, np.max)}


@pytest.mark.parametrize("name", REDUCTIONS)
@EXAMPLES
@given(case=shape_and_axis(), seed=seeds)
def test_reductions(name, case, seed):
    shape, axis, keepdims = case
    op, reference = REDUCTIONS[name]
    x = distinct(seed, shape) if name == "max" else normal(seed, shape)
    out = check_gradients(lambda t: op(t, axis=axis, keepdims=keepdims), x)
    np.testing.assert_allclose(out.data, reference(x, axis=axis, keepdims=keepdims), rtol=1e-14)


def test_max_splits_the_gradient_between_ties():
    x = Tensor(np.array([[1.0, 3.0, 3.0], [2.0, 0.0, 1.0]]), requires_grad=True)
    F.max(x, axis=1).backward(np.array([1.0, 1.0]))
    np.testing.assert_array_equal(x.grad, [[0, 0.5, 0.5], [1, 0, 0]])


# ---- shape ops -----------------------------------------------------------------------------------


@EXAMPLES
@given(shape=shapes, seed=seeds, data=st.data())
def test_reshape(shape, seed, data):
    n = int(np.prod(shape))
    halves = [(2, n // 2)] if n % 2 == 0 else []
    new_shape = data.draw(st.sampled_from([(n,), (1, n), (n, 1), (-1,)] + halves))
    out = check_gradients(lambda t: F.reshape(t, new_shape), normal(seed, shape))
    assert out.size == n


@EXAMPLES
@given(shape=shapes, seed=seeds, data=st.data())
def test_transpose(shape, seed, data):
    perm = data.draw(st.permutations(range(len(shape))))
    negative = data.draw(st.lists(st.booleans(), min_size=len(shape), max_size=len(shape)))
    axes = tuple(a - len(shape) if neg else a for a, neg in zip(perm, negative))  # -1: the last axis
    for axes_arg in (axes, None):
        out = check_gradients(lambda t, a=axes_arg: F.transpose(t, a), normal(seed, shape))
        np.testing.assert_array_equal(out.data, normal(seed, shape).transpose(axes_arg))


@st.composite
def index_for(draw, shape):
    """A basic or advanced index: slices with steps, integers, or an integer array with repeats."""
    parts = []
    for n in shape[: draw(st.integers(1, len(shape)))]:
        kind = draw(st.sampled_from(["slice", "int", "array"]))
        if kind == "slice":
            parts.append(slice(draw(st.integers(0, n - 1)), None, draw(st.sampled_from([1, 2, -1]))))
        elif kind == "int":
            parts.append(draw(st.integers(-n, n - 1)))
        else:
            parts.append(np.array(draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=5))))
    if sum(isinstance(p, np.ndarray) for p in parts) > 1:  # keep to one advanced index (no pairing rules)
        parts = [p if not isinstance(p, np.ndarray) or i == 0 else slice(None) for i, p in enumerate(parts)]
    return tuple(parts)


@EXAMPLES
@given(shape=shapes, seed=seeds, data=st.data())
def test_getitem(shape, seed, data):
    index = data.draw(index_for(shape))
    x = normal(seed, shape)
    out = check_gradients(lambda t: t[index], x)
    np.testing.assert_array_equal(out.data, x[index])


def test_getitem_repeated_indices_add_up():
    x = Tensor(np.arange(4.0), requires_grad=True)
    x[np.array([1, 1, 3, 1])].backward(np.array([1.0, 2.0, 3.0, 4.0]))
    np.testing.assert_array_equal(x.grad, [0, 7, 0, 3])


@EXAMPLES
@given(shape=shapes, seed=seeds, data=st.data())
def test_concatenate(shape, seed, data):
    axis = data.draw(st.integers(0, len(shape) - 1))
    sizes = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    parts = [normal(seed, shape[:axis] + (k,) + shape[axis + 1:], i) for i, k in enumerate(sizes)]
    out = check_gradients(lambda *ts: F.concatenate(ts, axis=axis), *parts)
    np.testing.assert_array_equal(out.data, np.concatenate(parts, axis=axis))


# ---- normalisation and losses ----------------------------------------------------------------------


@pytest.mark.parametrize("op", [F.softmax, F.log_softmax], ids=["softmax", "log_softmax"])
@EXAMPLES
@given(shape=shapes, seed=seeds, data=st.data())
def test_softmax_and_log_softmax(op, shape, seed, data):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = 3 * normal(seed, shape)
    out = check_gradients(lambda t: op(t, axis=axis), x)
    shifted = x - x.max(axis=axis, keepdims=True)
    log_sum = np.log(np.exp(shifted).sum(axis=axis, keepdims=True))
    expected = np.exp(shifted - log_sum) if op is F.softmax else shifted - log_sum
    np.testing.assert_allclose(out.data, expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_causal_softmax_ignores_masked_scores_however_large(dtype):
    """Query i sees keys 0..i: row i is the softmax of scores[i, :i+1] alone, computed here one row at a
    time. The masked scores are +1000: a maximum taken over the whole row would subtract 1000 from the
    visible ones, whose exponentials underflow to 0 (0/0: NaN); row 2's visible scores are near +800, so
    a softmax with no maximum overflows. The gradient is softmax's on the visible part, 0 where masked."""
    T = 5
    rng = np.random.default_rng(11)
    scores = 3 * rng.standard_normal((2, T, T))
    scores[:, 2, :3] += 800.0
    masked = np.triu(np.ones((T, T), bool), k=1)
    scores[:, masked] = 1000.0
    g = rng.standard_normal(scores.shape)
    x = Tensor(scores.astype(dtype), True)
    y = F.causal_softmax(x)
    y.backward(g.astype(dtype))
    want, want_grad = np.zeros_like(scores), np.zeros_like(scores)
    for b in range(2):
        for i in range(T):
            seen = scores[b, i, :i + 1].astype(dtype).astype(np.float64)
            p = np.exp(seen - seen.max())
            p /= p.sum()
            want[b, i, :i + 1] = p
            want_grad[b, i, :i + 1] = p * (g[b, i, :i + 1] - (g[b, i, :i + 1] * p).sum())
    rtol = 1e-13 if dtype == np.float64 else 1e-5
    assert np.all(y.data[:, masked] == 0.0)
    np.testing.assert_allclose(y.data, want, rtol=rtol, atol=rtol * 1e-2)
    np.testing.assert_allclose(x.grad, want_grad, rtol=rtol, atol=rtol * 1e-2)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@EXAMPLES
@given(n=st.integers(1, 5), c=st.integers(1, 5), seed=seeds)
def test_cross_entropy(reduction, n, c, seed):
    logits = 3 * normal(seed, (n, c))
    targets = np.random.default_rng([seed, 5]).integers(0, c, n)
    out = check_gradients(lambda t: F.cross_entropy(t, targets, reduction), logits)
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    total = -log_probs[np.arange(n), targets].sum()
    assert out.shape == ()
    expected = total / n if reduction == "mean" else total
    np.testing.assert_allclose(out.item(), expected, rtol=1e-12, atol=1e-14)


@EXAMPLES
@given(lead=hnp.array_shapes(min_dims=1, max_dims=2, max_side=3), d=st.integers(2, 5), seed=seeds)
def test_layer_norm(lead, d, seed):
    x = normal(seed, lead + (d,), 1)
    weight, bias = 1 + 0.5 * normal(seed, (d,), 2), normal(seed, (d,), 3)
    out = check_gradients(lambda x, w, b: F.layer_norm(x, w, b), x, weight, bias)
    xhat = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(out.data, xhat * weight + bias, rtol=1e-12, atol=1e-14)


@EXAMPLES
@given(ids_shape=hnp.array_shapes(min_dims=1, max_dims=2, max_side=4), vocab=st.integers(1, 4),
       dim=st.integers(1, 3), seed=seeds)
def test_embedding_with_repeated_ids(ids_shape, vocab, dim, seed):
    ids = np.random.default_rng([seed, 6]).integers(0, vocab, ids_shape)  # repeats are likely
    weight = normal(seed, (vocab, dim))
    out = check_gradients(lambda w: F.embedding(ids, w), weight)
    np.testing.assert_array_equal(out.data, weight[ids])


def test_embedding_gradient_adds_repeats():
    w = Tensor(np.zeros((3, 2)), requires_grad=True)
    F.embedding(np.array([[2, 0, 2]]), w).backward(np.array([[[1.0, 1.0], [5.0, 5.0], [2.0, 3.0]]]))
    np.testing.assert_array_equal(w.grad, [[5, 5], [0, 0], [3, 4]])


@EXAMPLES
@given(shape=shapes, seed=seeds, p=st.sampled_from([0.1, 0.5, 0.9]))
def test_dropout_with_a_fixed_generator(shape, seed, p):
    x = normal(seed, shape)
    out = check_gradients(lambda t: F.dropout(t, p, np.random.default_rng(seed)), x)
    keep = np.random.default_rng(seed).random(shape) >= p
    np.testing.assert_allclose(out.data, np.where(keep, x / (1 - p), 0.0), rtol=1e-15)


def test_dropout_off_is_the_identity():
    x = Tensor(normal(0, (3, 4)), requires_grad=True)
    assert F.dropout(x, 0.5, np.random.default_rng(0), training=False) is x
    assert F.dropout(x, 0.0, np.random.default_rng(0)) is x


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@EXAMPLES
@given(shape=shapes, seed=seeds)
def test_mse_loss(reduction, shape, seed):
    prediction, target = normal(seed, shape, 1), normal(seed, shape, 2)
    out = check_gradients(lambda p, t: F.mse_loss(p, t, reduction), prediction, target)
    squared = np.sum((prediction - target) ** 2)
    np.testing.assert_allclose(out.item(), squared / prediction.size if reduction == "mean" else squared,
                               rtol=1e-12)


# ---- fp32 stays fp32 ------------------------------------------------------------------------------

FP32_CASES = {
    "add": lambda t: t + 2.0, "sub": lambda t: 1.0 - t, "mul": lambda t: t * 0.5, "div": lambda t: 3.0 / t,
    "pow": lambda t: t**2, "sum": lambda t: F.sum(t, 1), "mean": lambda t: F.mean(t, 0),
    "max": lambda t: F.max(t, 1),
    "exp": F.exp, "tanh": F.tanh, "relu": F.relu, "gelu": F.gelu, "softmax": F.softmax,
    "log_softmax": F.log_softmax, "getitem": lambda t: t[np.array([0, 0])], "transpose": lambda t: t.T,
    "concatenate": lambda t: F.concatenate([t, t]), "matmul": lambda t: t @ np.ones((4, 2), np.float32),
    "cross_entropy": lambda t: F.cross_entropy(t, np.array([0, 1, 2])),
    "mse_loss": lambda t: F.mse_loss(t, np.zeros((3, 4), np.float32)),
    "linear": lambda t: F.linear(t, Tensor(np.ones((2, 4), np.float32), True)),
    "layer_norm": lambda t: F.layer_norm(t, Tensor(np.ones(4, np.float32), True), np.zeros(4, np.float32)),
    "dropout": lambda t: F.dropout(t, 0.5, np.random.default_rng(0)),
}


@pytest.mark.parametrize("name", FP32_CASES)
def test_float32_outputs_and_gradients_stay_float32(name):
    """Mixed precision relies on it: no op may silently promote to float64."""
    x = Tensor(away_from_zero(0, (3, 4)).astype(np.float32), requires_grad=True)
    out = FP32_CASES[name](x)
    out.backward(np.ones(out.shape, np.float32))
    assert out.dtype == np.float32 and x.grad.dtype == np.float32


@pytest.mark.parametrize("wider", ["input", "weight", "bias"])
def test_a_product_of_two_dtypes_is_refused_naming_both(wider):
    """As PyTorch refuses it: NumPy would promote the product and its gradients to float64 in silence.
    Any one operand of three may be the wider one, the bias too; a missing bias is no dtype."""
    dtypes = {name: np.float64 if name == wider else np.float32 for name in ("input", "weight", "bias")}
    x = Tensor(np.ones((3, 4), dtypes["input"]), requires_grad=True)
    w = Tensor(np.ones((2, 4), dtypes["weight"]), requires_grad=True)
    b = Tensor(np.ones(2, dtypes["bias"]), requires_grad=True)
    with pytest.raises(TypeError, match="linear: expected both operands to have the same dtype") as refused:
        F.linear(x, w, b)
    assert "float32" in str(refused.value) and "float64" in str(refused.value)
    if wider != "bias":
        with pytest.raises(TypeError, match="float64"):
            F.linear(x, w)
        with pytest.raises(TypeError, match="matmul: expected both operands to have the same dtype"):
            F.matmul(x, Tensor(np.ones((4, 2), dtypes["weight"] if wider == "input" else np.float64)))
    assert F.linear(x.data.astype(np.float32), w.data.astype(np.float32)).dtype == np.float32


# ---- the checker itself can fail -------------------------------------------------------------------


def test_the_checker_catches_a_wrong_backward():
    from minipar.core.autograd import Function

    class WrongSquare(Function):
        @staticmethod
        def forward(ctx, a):
            ctx.save_for_backward(a)
            return a * a

        @staticmethod
        def backward(ctx, g):
            return g * ctx.saved[0] * 2.00001  # off by 5 parts in a million: just above RTOL

    with pytest.raises(AssertionError, match="relative error"):
        check_gradients(WrongSquare.apply, normal(0, (3,)))
