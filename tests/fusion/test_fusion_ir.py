"""Fusion IR: lazy nodes follow NumPy's shapes, dtypes and operator rules, and compute nothing."""

import numpy as np
import pytest

from minipar import fusion as fx


def test_nodes_know_numpy_shapes_and_dtypes():
    a = fx.array(np.ones((3, 1), np.float32))
    b = fx.array(np.ones(4, np.float64))
    assert (a * 0.5).dtype == np.float32  # a Python float does not widen float32 (NEP 50)
    assert (a + b).shape == (3, 4) and (a + b).dtype == np.float64
    assert (a < 1).dtype == np.bool_ and fx.sqrt(fx.array(np.arange(3))).dtype == np.float64
    assert fx.where(a > 0, a, b).shape == (3, 4)
    assert a.astype(np.int32).dtype == np.int32
    assert (a + b).sum(1).shape == (3,) and (a + b).max(0, keepdims=True).shape == (1, 4)
    assert fx.array(np.ones(3, np.bool_)).sum(0).dtype == np.sum(np.ones(3, np.bool_)).dtype


def test_python_operators_build_nodes_both_ways():
    values = np.arange(3.0)
    x = fx.array(values, name="x")
    for expr, op in [(2 - x, "subtract"), (2 / x, "divide"), (2**x, "power"), (-x, "negative"),
                     (values + x, "add"), (x == 1, "equal"), (x != 1, "not_equal"), (1 < x, "greater")]:
        assert isinstance(expr, fx.Node) and expr.op == op
    assert repr(fx.maximum(x + 1, x).sum(0)) == "sum(maximum(add(x, 1), x), axis=0)"
    assert fx.run(2 - x)[0].tolist() == [2.0, 1.0, 0.0]


def test_errors_are_raised_when_building():
    a, b = fx.array(np.ones(3)), fx.array(np.ones(4))
    with pytest.raises(ValueError):
        a + b
    with pytest.raises(ValueError, match="axis"):
        a.sum(1)
    with pytest.raises(ValueError, match="axis"):
        a.sum(None)
    with pytest.raises(TypeError, match="truth value"):
        bool(a > 0)
    with pytest.raises(TypeError):
        a + "text"


def test_leaves_wrap_without_copying_and_nodes_hash_by_identity():
    values = np.zeros(3)
    leaf = fx.array(values)
    assert leaf.value is values
    values += 1.0  # a later in-place update is what the next run sees
    assert fx.run(leaf * 2)[0].tolist() == [2.0, 2.0, 2.0]
    assert len({leaf, fx.array(values)}) == 2
    assert fx.array([1, 2]).dtype == np.asarray([1, 2]).dtype
