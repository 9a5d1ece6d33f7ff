"""Fusion: the plans, the counted bytes, and fused results against eager ones on fixed examples."""

import numpy as np
import pytest

from minipar import fusion as fx
from minipar.fusion.tiled import tiles


def same_bits(x, y) -> bool:
    """Bitwise equality (a NaN matches any NaN)."""
    x, y = np.asarray(x), np.asarray(y)
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    if x.dtype.kind != "f":
        return bool(np.array_equal(x, y))
    bits = x.view(f"u{x.itemsize}") == y.view(f"u{y.itemsize}")
    return bool(np.all(bits | (np.isnan(x) & np.isnan(y))))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_seed_example_eager_moves_6nw_fused_4nw(dtype):
    n, w = 1000, np.dtype(dtype).itemsize
    rng = np.random.default_rng(0)
    a, b, d = (fx.array(rng.standard_normal(n).astype(dtype), name=k) for k in "abd")
    c = a + b
    e = fx.maximum(c, d)
    eager, eager_stats = fx.run(e, fused=False)
    fused, fused_stats = fx.run(e, fused=True, tile=96)
    assert eager_stats.bytes_read + eager_stats.bytes_written == 6 * n * w
    assert fused_stats.bytes_read + fused_stats.bytes_written == 4 * n * w
    assert (len(eager_stats.kernels), len(fused_stats.kernels)) == (2, 1)
    assert same_bits(eager, fused)
    assert same_bits(fused, np.maximum(a.value + b.value, d.value))


@pytest.mark.parametrize("tile", [1, 7, 50, 10_000])
def test_row_sum_fused_moves_2rcw_plus_rw(tile):
    rows, cols, w = 13, 50, 8
    rng = np.random.default_rng(1)
    a, b = fx.array(rng.standard_normal((rows, cols))), fx.array(rng.standard_normal((rows, cols)))
    expr = (a + b).sum(-1)
    fused, stats = fx.run(expr, fused=True, tile=tile)
    eager, eager_stats = fx.run(expr, fused=False)
    assert stats.bytes_read + stats.bytes_written == 2 * rows * cols * w + rows * w
    assert eager_stats.bytes_moved == 2 * rows * cols * w + rows * cols * w + rows * cols * w + rows * w
    np.testing.assert_allclose(fused, eager, rtol=1e-13)
    np.testing.assert_allclose(fused, (a.value + b.value).sum(-1), rtol=1e-13)


def test_fusion_plan_ends_kernels_at_shared_values_roots_and_reductions():
    x, y = fx.array(np.ones(4), name="x"), fx.array(np.ones(4), name="y")
    shared = fx.exp(x * y)  # two consumers: materialised
    total = (shared + 1.0).sum(0)  # add fuses into the reduction
    expr = fx.tanh(shared) - total  # reduction output: read by a later kernel
    kernels = fx.fuse([expr])
    assert [[n.op for n in k.nodes] for k in kernels] == [
        ["multiply", "exp"], ["add", "sum"], ["tanh", "subtract"]]
    assert [k.inputs for k in kernels][0] == [x, y]
    assert kernels[2].inputs == [shared, total]
    assert [len(k.nodes) for k in fx.one_kernel_per_op([expr])] == [1] * 6


def test_a_value_used_twice_by_one_node_counts_as_one_consumer():
    """fuse.py's own example: in y * y, y has one consumer (one kernel reads it once), so exp(a) * exp(a)
    is one kernel reading a and writing the result: 2nw bytes, against 3 kernels and 5nw eager (exp
    reads a, writes y; multiply reads y once, writes). y used by y * y and by tanh(y) has 2 consumers
    and is materialised. Counting each argument slot would end a kernel at y: 2 kernels, 4nw."""
    n, w = 100, 8
    a = fx.array(np.linspace(-1.0, 1.0, n), name="a")
    y = fx.exp(a)
    square = y * y
    kernels = fx.fuse([square])
    assert [[node.op for node in k.nodes] for k in kernels] == [["exp", "multiply"]]
    assert kernels[0].inputs == [a]
    fused, stats = fx.run(square, fused=True, tile=32)
    assert (stats.bytes_read, stats.bytes_written) == (n * w, n * w)
    np.testing.assert_allclose(fused, np.exp(a.value) ** 2, rtol=1e-15)
    both = fx.tanh(y) + y * y
    assert [[node.op for node in k.nodes] for k in fx.fuse([both])] == [
        ["exp"], ["tanh", "multiply", "add"]]


def chain_of_eight(a, b, ops=np):
    """8 elementwise operations (bench fusion's chain, written out): add, multiply, subtract, multiply,
    maximum, add, sqrt, multiply. `ops` provides maximum and sqrt: numpy for arrays, fusion for nodes."""
    return ops.sqrt(ops.maximum(((a + b) * a - b) * 0.5, a) + 1.0) * b


def test_chain_of_eight_is_one_kernel_and_moves_seven_times_less():
    rng = np.random.default_rng(2)
    a, b = (fx.array(rng.random(3000, dtype=np.float32)) for _ in range(2))
    expr = chain_of_eight(a, b, ops=fx)
    fused, stats = fx.run(expr, fused=True, tile=256)
    eager, eager_stats = fx.run(expr, fused=False)
    assert len(stats.kernels) == 1 and len(eager_stats.kernels) == 8
    assert eager_stats.bytes_moved == 7 * stats.bytes_moved == 7 * 3 * 3000 * 4
    assert same_bits(fused, eager) and same_bits(fused, chain_of_eight(a.value, b.value))


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("op", ["sum", "max"])
def test_reductions_over_any_axis_with_broadcast_inputs(axis, keepdims, op):
    rng = np.random.default_rng(3)
    big, row = rng.standard_normal((3, 4, 5)), rng.standard_normal((4, 1))
    expr = getattr(fx.array(big) * fx.array(row) + 0.5, op)(axis, keepdims=keepdims)
    expected = getattr(big * row + 0.5, op)(axis=axis, keepdims=keepdims)
    for tile in (1, 3, 4, 21, 1000):
        fused, stats = fx.run(expr, fused=True, tile=tile)
        assert fused.shape == expected.shape
        np.testing.assert_allclose(fused, expected, rtol=1e-13)
        if op == "max":
            assert same_bits(fused, expected)
        assert stats.bytes_read == big.nbytes + row.nbytes and stats.bytes_written == expected.nbytes


def test_in_place_out_and_several_roots():
    rng = np.random.default_rng(4)
    m, g = rng.standard_normal(100), rng.standard_normal(100)
    expected_m = 0.9 * m + 0.1 * g
    expected_sq = expected_m * expected_m
    new_m = 0.9 * fx.array(m) + 0.1 * fx.array(g)
    sq = np.empty(100)
    (result_m, result_sq), stats = fx.run([new_m, new_m * new_m], out=[m, sq], tile=16)
    assert result_m is m and result_sq is sq
    assert same_bits(m, expected_m) and same_bits(sq, expected_sq)
    assert [(k.bytes_read, k.bytes_written) for k in stats.kernels] == [(1600, 800), (800, 800)]


def test_leaf_root_is_its_array_or_one_copy():
    values = np.arange(5.0)
    assert fx.run(fx.array(values))[0] is values
    out = np.empty(5)
    result, stats = fx.run(fx.array(values), out=out)
    assert result is out and np.array_equal(out, values) and stats.bytes_moved == 80


def test_scalars_zero_d_and_empty_arrays():
    zero_d = fx.array(np.float32(2.0) * np.ones((), np.float32))
    for fused in (False, True):
        assert same_bits(fx.run(fx.exp(zero_d) * 3, fused=fused)[0], np.exp(zero_d.value) * 3)
        empty = fx.array(np.ones((3, 0)))
        assert fx.run(fx.tanh(empty), fused=fused)[0].shape == (3, 0)
        assert same_bits(fx.run(empty.sum(1), fused=fused)[0], np.zeros(3))
        with pytest.raises(ValueError):
            fx.run(empty.max(1), fused=fused)


def test_where_comparisons_and_casts_match_numpy():
    rng = np.random.default_rng(5)
    x32 = rng.standard_normal((6, 7)).astype(np.float32)
    y64 = rng.standard_normal(7)
    x, y = fx.array(x32), fx.array(y64)
    expr = fx.where(x > 0.25, (x * 2).astype(np.float64), y - 1) + (x <= y).astype(np.float32)
    expected = np.where(x32 > 0.25, (x32 * 2).astype(np.float64), y64 - 1) + (x32 <= y64).astype(np.float32)
    for fused in (False, True):
        result = fx.run(expr, fused=fused, tile=5)[0]
        assert result.dtype == np.float64 and same_bits(result, expected)


def test_tiles_cover_the_space_once_within_the_size():
    for shape in [(10,), (3, 4, 5), (2, 1, 7), (1,), (4, 9)]:
        for size in (1, 2, 5, 12, 60, 1000):
            seen = np.zeros(shape, int)
            for index in tiles(shape, size):
                block = seen[index + (...,)]
                assert block.size <= size
                block += 1
            assert (seen == 1).all()


def test_bad_out_and_duplicate_roots_are_errors():
    a = fx.array(np.ones(3))
    with pytest.raises(ValueError, match="out is"):
        fx.run(a + 1, out=np.empty(4))
    with pytest.raises(ValueError, match="out is"):
        fx.run(a + 1, out=np.empty(3, np.float32))
    with pytest.raises(ValueError, match="once"):
        fx.run([a + 1] * 2)
