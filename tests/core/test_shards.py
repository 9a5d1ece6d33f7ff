"""Shards of n elements over `parts` ranks: numpy.array_split's cut, and the padded equal parts."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from minipar.core.shards import padded_bounds, padded_numel, shard_bounds, shard_sizes


@given(n=st.integers(0, 60), parts=st.integers(1, 9))
def test_shard_bounds_cut_like_numpy_array_split(n, parts):
    expected = np.array_split(np.arange(n), parts)  # the first n % parts pieces one longer
    for index, piece in enumerate(expected):
        start, stop = shard_bounds(n, parts, index)
        np.testing.assert_array_equal(np.arange(n)[start:stop], piece)
    assert shard_sizes(n, parts) == [len(piece) for piece in expected]


@given(n=st.integers(1, 60), parts=st.integers(1, 9))
def test_padded_parts_are_equal_and_cover_the_rows(n, parts):
    total = padded_numel(n, parts)
    assert total % parts == 0 and n <= total < n + parts
    bounds = [padded_bounds(n, parts, i) for i in range(parts)]
    assert bounds[0][0] == 0 and bounds[-1][1] == total
    assert all(stop - start == total // parts for start, stop in bounds)
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
