"""Hypothesis: random expression graphs give the same results fused and eager, for any tile size.

Elementwise results agree bit for bit; a sum may add in another order, so it agrees to rounding.
The fused plan never moves more bytes nor runs more kernels than the eager one.
"""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fusion_run import same_bits

from minipar import fusion as fx

UNARY = ["negative", "exp", "log", "tanh", "sqrt"]
BINARY = ["add", "subtract", "multiply", "divide", "power", "maximum", "minimum"]
COMPARISONS = ["less", "less_equal", "greater", "greater_equal", "equal", "not_equal"]
SCALARS = st.sampled_from([0.0, 0.5, -1.5, 2, 3.0, 1e-3, np.float32(0.25)])


@st.composite
def leaves(draw):
    """1-3 arrays whose shapes broadcast together (some axes of the full shape left at 1 or out)."""
    full = draw(st.lists(st.integers(1, 5), min_size=0, max_size=3))
    arrays = []
    for _ in range(draw(st.integers(1, 3))):
        drop = draw(st.integers(0, len(full)))
        shape = [1 if draw(st.booleans()) else n for n in full[drop:]]
        dtype = draw(st.sampled_from([np.float32, np.float64]))
        seed = draw(st.integers(0, 2**32 - 1))
        values = np.random.default_rng(seed).standard_normal(shape) * draw(st.sampled_from([0.5, 3.0]))
        arrays.append(fx.array(np.asarray(values, dtype=dtype)))
    return arrays


@st.composite
def graphs(draw, max_ops=10):
    """A random DAG of elementwise operations over random leaves: operands are drawn from every
    value built so far, so values get several consumers and the plan has several kernels."""
    values = draw(leaves())

    def operand():
        return draw(st.sampled_from(values)) if draw(st.integers(0, 5)) else draw(SCALARS)

    for _ in range(draw(st.integers(1, max_ops))):
        kind = draw(st.sampled_from(["unary", "binary", "binary", "where", "cast"]))
        if kind == "unary":
            node = getattr(fx, draw(st.sampled_from(UNARY)))(draw(st.sampled_from(values)))
        elif kind == "binary":
            node = getattr(fx, draw(st.sampled_from(BINARY)))(draw(st.sampled_from(values)), operand())
        elif kind == "where":
            test = getattr(fx, draw(st.sampled_from(COMPARISONS)))(draw(st.sampled_from(values)), operand())
            node = fx.where(test, draw(st.sampled_from(values)), operand())
        else:
            node = draw(st.sampled_from(values)).astype(draw(st.sampled_from([np.float32, np.float64])))
        values.append(node)
    computed = [v for v in values if not v.is_leaf]
    extra = draw(st.lists(st.sampled_from(computed), max_size=2, unique_by=id))
    return [computed[-1]] + [v for v in extra if v is not computed[-1]]


tile_sizes = st.sampled_from([1, 2, 3, 7, 16, 64, 32768])


@settings(max_examples=80, deadline=None)
@given(graphs(), tile_sizes)
def test_random_elementwise_graphs_fused_equal_eager_bitwise(roots, tile):
    with np.errstate(all="ignore"):
        eager, eager_stats = fx.run(roots, fused=False)
        fused, fused_stats = fx.run(roots, fused=True, tile=tile)
    for e, f in zip(eager, fused):
        assert same_bits(e, f)
    assert fused_stats.bytes_read <= eager_stats.bytes_read
    assert fused_stats.bytes_written <= eager_stats.bytes_written
    assert len(fused_stats.kernels) <= len(eager_stats.kernels)


@settings(max_examples=50, deadline=None)
@given(graphs(max_ops=6), st.sampled_from(["sum", "max"]), st.integers(0, 2), st.booleans(), tile_sizes)
def test_random_graph_then_a_reduction_agrees_to_rounding(roots, op, axis, keepdims, tile):
    value = roots[0]
    if value.ndim == 0:
        value = value + fx.array(np.zeros(3))
    expr = getattr(value, op)(axis % value.ndim, keepdims=keepdims)
    with np.errstate(all="ignore"):
        (eager, magnitude), _ = fx.run([expr, fx.sum(abs_(value), axis % value.ndim, keepdims)], fused=False)
        fused, stats = fx.run(expr, fused=True, tile=tile)
    assert stats.kernels[-1].bytes_written == eager.nbytes
    if op == "max":
        assert same_bits(eager, fused)
    else:
        assert fused.dtype == eager.dtype and fused.shape == eager.shape
        ulp = np.finfo(eager.dtype).eps
        finite = np.isfinite(magnitude)
        assert same_bits(eager[~finite], fused[~finite])
        bound = 4 * value.shape[axis % value.ndim] * ulp * magnitude[finite]
        assert np.all(np.abs(eager[finite] - fused[finite]) <= bound)


def abs_(x):
    return fx.maximum(x, -x)
