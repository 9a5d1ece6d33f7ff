"""`bench trace` (minipar_lab/bench/trace.py): each round runs one plain and one traced job of the same
training, only the traced one writes a trace, the two train alike, and the cost is the median of the
per-round ratios. Times are not asserted: the figure comes from running the benchmark."""

import numpy as np

from minipar.trainer.launch import read_log
from minipar_lab.bench import trace

TINY = ["--n-layer", "2", "--d-model", "16", "--n-head", "2", "--seq-len", "8", "--batch-size", "4",
        "--pp", "2", "--microbatches", "2"]


def test_each_round_runs_a_plain_and_a_traced_job_and_the_cost_is_the_median_ratio(tmp_path):
    figures = trace.trace_figures(2, TINY, repeats=2, steps=3, warmup=1, folder=tmp_path)
    traces = sorted(tmp_path.glob("trace-*"))
    assert [path.name for path in traces] == ["trace-0", "trace-1"]  # one a traced job, no more
    assert all((path / "trace.json").is_file() for path in traces)
    plain, traced = read_log(tmp_path / "plain.jsonl"), read_log(tmp_path / "traced.jsonl")
    assert len(plain) == 3 and [r["loss"] for r in plain] == [r["loss"] for r in traced]  # no number moves
    ratios = np.array(figures["per_round"])
    assert len(ratios) == 2 and figures["cost"] == float(np.median(ratios))
    assert [row["way"] for row in figures["ways"]] == ["plain", "traced"]
