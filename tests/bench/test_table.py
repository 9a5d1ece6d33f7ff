"""The benchmarks' tables line up: each column as wide as its widest cell, header included, right-aligned,
two spaces apart (the lessons quote these tables as they are printed)."""

from minipar_lab.bench.table import right_aligned


def test_columns_are_right_aligned_to_their_widest_cell_two_spaces_apart():
    columns = [("dp", lambda r: r["dp"]), ("tokens/s", lambda r: f"{r['tokens']:.0f}")]
    lines = right_aligned([{"dp": 1, "tokens": 12.4}, {"dp": 128, "tokens": 123456.0}], columns)
    assert lines == [" dp  tokens/s",
                     "  1        12",
                     "128    123456"]


def test_no_rows_is_the_header_alone():
    assert right_aligned([], [("a", str), ("bb", str)]) == ["a  bb"]
