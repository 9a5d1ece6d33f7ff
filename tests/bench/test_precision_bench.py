"""`bench precision`'s summary bound: what lesson 09 checks instead of a largest difference whose second
digit depends on the CPU's matrix kernel."""

import pytest

from minipar.bench.precision import power_of_ten_above


@pytest.mark.parametrize("value, bound", [(0.0090, 0.01), (0.0030, 0.01), (0.01, 0.01), (0.0101, 0.1),
                                          (4.3e-5, 1e-4), (6.1e-6, 1e-5), (1.0, 1.0), (0.0, 0.0)])
def test_the_bound_is_the_least_power_of_ten_at_least_the_value(value, bound):
    assert power_of_ten_above(value) == pytest.approx(bound, rel=1e-12)
