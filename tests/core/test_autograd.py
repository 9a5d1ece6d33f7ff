"""The autograd engine: Function/ctx, topological order, accumulation, graph lifetime, activation meter.

The op-by-op gradients are checked in test_functional.py; here the engine's own rules are checked on
small graphs whose gradients are known in closed form.
"""

import weakref

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from minipar.core import functional as F
from minipar.core.autograd import Function, Tensor, activation_meter, cast_outputs, no_grad

EXAMPLES = settings(max_examples=20, deadline=None)
shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4)
seeds = st.integers(0, 2**32 - 1)


def leaf(seed, shape, salt=0):
    return Tensor(np.random.default_rng([seed, salt]).standard_normal(shape), requires_grad=True)


class Cube(Function):
    """x ** 3 written as a Function, counting its calls (for the tests of the engine's bookkeeping)."""

    calls = {"forward": 0, "backward": 0}

    @staticmethod
    def forward(ctx, x):
        Cube.calls["forward"] += 1
        ctx.save_for_backward(x)
        return x * x * x

    @staticmethod
    def backward(ctx, g):
        Cube.calls["backward"] += 1
        (x,) = ctx.saved
        return 3 * x * x * g


class Scale(Function):
    """y = w * x with a parameter w read through ctx.inputs in backward, never saved."""

    reads_in_backward = (1,)

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x)
        return w * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved
        w = ctx.inputs[1].data
        gx = g * w if ctx.needs_input_grad[0] else None
        gw = (g * x).sum() if ctx.needs_input_grad[1] else None
        return gx, gw


def test_custom_function_forward_and_backward():
    x = Tensor(np.array([1.0, -2.0, 3.0]), requires_grad=True)
    y = Cube.apply(x)
    np.testing.assert_array_equal(y.data, [1.0, -8.0, 27.0])
    assert y.requires_grad and y.node is not None and x.node is None
    y.sum().backward()
    np.testing.assert_array_equal(x.grad, [3.0, 12.0, 27.0])


def test_needs_input_grad_and_plain_arrays():
    x = np.array([1.0, 2.0])
    w = Tensor(np.array(3.0), requires_grad=True)
    y = Scale.apply(x, w)  # x is a plain array: no gradient is asked for it
    y.backward(np.array([1.0, 1.0]))
    assert w.grad == 3.0
    frozen = Tensor(np.array(3.0))  # a leaf that does not require grad
    z = Scale.apply(Tensor(x, requires_grad=True), frozen)
    z.backward(np.ones(2))
    assert frozen.grad is None and z.node is None


def test_parameters_are_read_at_backward_time_not_copied():
    """The contract ZeRO-3 relies on: p.data may be freed after forward and re-gathered before backward."""
    x = Tensor(np.array([[1.0, 2.0]]), requires_grad=True)
    w = Tensor(np.array([[1.0, 0.0], [0.0, 1.0]]), requires_grad=True)
    y = F.linear(x, w)
    gathered = np.array([[2.0, 0.0], [0.0, 5.0]])
    w.data = None  # freed
    w.data = gathered  # re-gathered (a different array object)
    y.backward(np.ones((1, 2)))
    np.testing.assert_array_equal(x.grad, np.ones((1, 2)) @ gathered)


def test_default_seed_gradient_is_ones():
    x = Tensor(np.array([2.0, 3.0]), requires_grad=True)
    (x * x).backward()
    np.testing.assert_array_equal(x.grad, [4.0, 6.0])


@EXAMPLES
@given(shape=shapes, seed=seeds)
def test_two_backward_passes_accumulate(shape, seed):
    x, w = leaf(seed, shape, 1), leaf(seed, shape, 2)

    def loss():
        return F.sum(F.tanh(x * w) + F.exp(w) / (1 + x * x))

    loss().backward()
    first_x, first_w = x.grad.copy(), w.grad.copy()
    loss().backward()
    # equal up to the order of the additions (x's several uses add into .grad one by one)
    np.testing.assert_allclose(x.grad, 2 * first_x, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(w.grad, 2 * first_w, rtol=1e-13, atol=1e-15)


@EXAMPLES
@given(shape=shapes, seed=seeds)
def test_a_tensor_used_twice_gets_both_contributions(shape, seed):
    x = leaf(seed, shape)
    (x * x).backward(np.ones(shape))
    np.testing.assert_allclose(x.grad, 2 * x.data, rtol=1e-15)
    x.grad = None
    (x + x + x).backward(np.ones(shape))
    np.testing.assert_array_equal(x.grad, 3 * np.ones(shape))
    x.grad = None
    y = F.tanh(x)  # a diamond: y feeds two branches that meet again
    (y * y + F.exp(y)).backward(np.ones(shape))
    t = np.tanh(x.data)
    np.testing.assert_allclose(x.grad, (2 * t + np.exp(t)) * (1 - t * t), rtol=1e-13)


def test_a_shared_node_runs_backward_once_with_the_summed_gradient():
    """Reverse topological order: every consumer of y contributes before y's backward runs."""
    Cube.calls.update(forward=0, backward=0)
    x = Tensor(np.array([2.0]), requires_grad=True)
    y = Cube.apply(x)
    z = y * 3.0 + F.tanh(y) * 0.0 + y  # three paths from z to y, of different depths
    z.backward()
    assert Cube.calls == {"forward": 1, "backward": 1}
    np.testing.assert_allclose(x.grad, [4.0 * 3 * 4.0])


def test_a_deep_chain_needs_no_recursion():
    x = Tensor(np.array([1.0]), requires_grad=True)
    y = x
    for _ in range(5000):
        y = y * 1.0001
    y.backward()
    np.testing.assert_allclose(x.grad, [1.0001**5000], rtol=1e-12)


def test_no_grad_records_nothing():
    x = leaf(0, (3,))
    before = activation_meter.current
    with no_grad():
        y = F.exp(x) * x
        assert activation_meter.current == before
    assert not y.requires_grad and y.node is None
    z = F.exp(x)  # recording is back on after the block
    assert z.requires_grad and z.node is not None


def test_no_grad_restores_after_an_exception():
    with pytest.raises(ValueError):
        with no_grad():
            raise ValueError("inside")
    assert F.exp(leaf(0, (2,))).requires_grad


def test_the_graph_is_freed_as_backward_goes():
    x = leaf(0, (4,))
    y = F.tanh(x)
    z = F.sum(y * y)
    z.backward()
    assert z.node is None and y.node.ctx is None and y.node.next == ()  # nothing saved, no links


def test_the_meter_counts_each_buffer_once_whoever_saves_it():
    activation_meter.reset_peak()
    start = activation_meter.current
    x = leaf(0, (10, 8))  # 640 bytes in float64
    square = x * x  # Mul saves x twice: one buffer
    assert activation_meter.current - start == 640
    first_row = x[0:1] * 2.0  # a view of x: the meter sees x's buffer, already held
    assert activation_meter.current - start == 640
    probs = F.softmax(square, axis=-1)  # saves its output (640 bytes)...
    mixed = probs @ leaf(1, (8, 3))  # ...which the product saves again, with its 192-byte right side
    assert activation_meter.current - start == 640 + 640 + 192
    del first_row  # its graph goes, but x is still saved by Mul's node
    assert activation_meter.current - start == 640 + 640 + 192
    mixed.sum().backward()  # the last saver of each buffer lets go
    assert activation_meter.current == start and activation_meter.peak - start == 640 + 640 + 192


def test_a_saved_view_counts_its_whole_base():
    start = activation_meter.current
    head = (leaf(2, (10, 8)) + 1.0)[0:1]  # Add and GetItem (a slice) save nothing; head is a view
    kept = head * leaf(3, (1, 8))  # Mul saves the view and its 64-byte right side
    assert activation_meter.current - start == 640 + 64  # the view keeps its 640-byte base alive
    del head
    kept.sum().backward()
    assert activation_meter.current == start


def test_an_intermediate_no_node_saved_is_freed_when_the_forward_drops_it():
    x = leaf(0, (4,))
    doubled = (x + 1.0) * 2.0  # Add saves nothing, Mul its inputs (x + 1 and 2)
    summed = F.sum(doubled)  # Sum saves nothing: nothing keeps `doubled`'s array but the name
    doubled_array = weakref.ref(doubled.data)
    del doubled
    assert doubled_array() is None  # PyTorch's graph of nodes frees it too; a graph of tensors would not
    summed.backward()
    np.testing.assert_array_equal(x.grad, np.full(4, 2.0))


def test_activation_meter_counts_bytes_saved_for_backward():
    activation_meter.reset_peak()
    start = activation_meter.current
    x, w = leaf(0, (10, 8), 1), leaf(0, (10, 8), 2)  # 640 bytes each in float64
    y = x * w  # Mul saves both inputs: 1280 bytes
    assert activation_meter.current - start == 1280
    z = F.tanh(y)  # Tanh saves its output: 640 more
    assert activation_meter.current - start == 1920
    s = F.sum(z)  # Sum saves nothing
    assert activation_meter.current - start == 1920
    s.backward()
    assert activation_meter.current == start  # released as each node's backward runs
    assert activation_meter.peak - start == 1920
    activation_meter.reset_peak()
    assert activation_meter.peak == activation_meter.current


def test_a_product_saves_each_factor_only_for_the_others_gradient():
    """PyTorch's rule: d(a b)/da needs b and d(a b)/db needs a, so a factor is kept only when the other
    one needs a gradient. Scaling by a constant keeps nothing; a constant mask is kept, the masked
    tensor not (tensor parallelism's lookup). The gradients are those of the formula."""
    x, w = leaf(0, (10, 8), 1), leaf(0, (10, 8), 2)  # 640 bytes each in float64
    mask = np.random.default_rng(3).integers(0, 2, (10, 1)).astype(np.float64)  # 80 bytes
    full_mask = np.broadcast_to(mask, (10, 8))
    for make, kept, x_grad in ((lambda: x * 0.5, 0, np.full((10, 8), 0.5)), (lambda: x * mask, 80, full_mask),
                               (lambda: mask * x, 80, full_mask), (lambda: x * w, 1280, w.data)):
        start = activation_meter.current
        y = make()
        assert activation_meter.current - start == kept
        x.grad = w.grad = None
        y.backward(np.ones((10, 8)))
        assert activation_meter.current == start
        np.testing.assert_array_equal(x.grad, x_grad)
    np.testing.assert_array_equal(w.grad, x.data)  # of the last, x * w
    (x * mask).backward(np.ones((10, 8)))  # accumulated on top
    np.testing.assert_array_equal(x.grad, w.data + full_mask)


def test_a_graph_dropped_without_backward_gives_its_activation_bytes_back():
    start = activation_meter.current
    x, w = leaf(0, (10, 8), 1), leaf(0, (10, 8), 2)
    z = F.tanh(x * w)  # Mul saves 1280 bytes, Tanh 640
    assert activation_meter.current - start == 1920
    del z  # the only reference to the graph: its contexts go with it, as PyTorch frees saved tensors
    assert activation_meter.current == start
    y = x * w
    y.backward(np.ones_like(y.data))  # released by backward, and not a second time when y goes
    del y
    assert activation_meter.current == start


def test_cast_outputs_rounds_outputs_and_gradients():
    seen = []

    def to_float32(a):
        seen.append(a.shape)
        return np.asarray(a, dtype=np.float32)

    x = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    with cast_outputs(to_float32):
        y = F.exp(x)
        assert y.dtype == np.float32
        F.sum(y).backward()
    assert x.grad.dtype == np.float32
    assert len(seen) == 4  # two outputs (exp, sum), two input-gradients (into y, into x)
    assert F.exp(x).dtype == np.float64  # switched off again


def test_tensor_conveniences():
    x = Tensor(np.arange(6.0).reshape(2, 3), requires_grad=True)
    assert (x.shape, x.ndim, x.size, x.dtype) == ((2, 3), 2, 6, np.float64)
    assert "shape=(2, 3)" in repr(x)
    assert x.reshape(3, 2).shape == (3, 2) and x.reshape((6,)).shape == (6,)
    assert x.T.shape == (3, 2) and x.transpose(1, 0).shape == (3, 2)
    assert x.sum().item() == 15.0 and x.mean(axis=0).shape == (3,)
    assert x.max(axis=1, keepdims=True).shape == (2, 1)
    d = x.detach()
    assert d.data is x.data and not d.requires_grad and d.node is None
    assert x.numpy() is x.data
