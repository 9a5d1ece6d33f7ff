"""The ring's per-rank charges for uneven shards, written out by hand from the algorithm.

    pytest -m "not mpi" tests/distributed/test_ring_charges_by_hand.py

Other ledger tests compare Comm's charges with `ring_bytes_sent`, the function Comm charges with, or
check only sums over ranks and even shards, which a rank-swapped formula also passes. Here each rank's
bytes come from walking the ring: in a reduce-scatter rank r sends every chunk but the one it ends up
owning (its own shard); in an all-gather it forwards every chunk but its successor's (that one starts
at the successor and reaches r last); an all-reduce is both.
"""

import pytest

from minipar.distributed.ledger import ring_bytes_sent

# 8 float64 values on 3 ranks: array_split gives 3, 3, 2 elements = 24, 24, 16 bytes; total 64
# 10 float32 values on 4 ranks: 3, 3, 2, 2 elements = 12, 12, 8, 8 bytes; total 40
BY_HAND = {
    (24, 24, 16): {"reduce_scatter": [64 - 24, 64 - 24, 64 - 16],
                   "all_gather": [64 - 24, 64 - 16, 64 - 24],
                   "all_reduce": [40 + 40, 40 + 48, 48 + 40]},
    (12, 12, 8, 8): {"reduce_scatter": [28, 28, 32, 32],
                     "all_gather": [28, 32, 32, 28],
                     "all_reduce": [56, 60, 64, 60]},
}


@pytest.mark.parametrize("shards", BY_HAND)
@pytest.mark.parametrize("op", ["reduce_scatter", "all_gather", "all_reduce"])
def test_each_rank_is_charged_what_it_sends_around_the_ring(shards, op):
    assert [ring_bytes_sent(op, list(shards), rank) for rank in range(len(shards))] == BY_HAND[shards][op]
