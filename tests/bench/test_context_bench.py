"""`bench context`'s work map (the picture of lesson 13): the score blocks each rank computes under the
causal mask, 3, 7, 11, 15 for a contiguous split of 8 chunks over 4 ranks and 9 each for the zig-zag
(counted by hand in tests/parallel/test_context.py)."""

from minipar_lab.bench.context import work_map


def test_the_work_map_counts_each_ranks_causal_blocks():
    for zigzag, expected in ((False, [3, 7, 11, 15]), (True, [9, 9, 9, 9])):
        cells = work_map(4, zigzag)
        assert [sum(row.count(rank) for row in cells) for rank in range(4)] == expected
