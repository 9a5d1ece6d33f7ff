"""`bench layouts`: one layout's row from rank 0's log, with `run_train` replaced by records set by hand
(the real runs are what lesson 07 quotes)."""

from minipar_lab.bench import layouts


def test_a_layouts_row_is_read_off_the_steps_after_the_warm_up(monkeypatch, tmp_path):
    mem = {"params": 1, "grads": 20, "optimizer": 300, "activations_peak": 4000}
    comm = {"by_dim": {"dp": 5, "tp": 7}}
    # the steps after the warm-up: medians 110 and 0.3, where the means are 170 and 0.467 and the last
    # step's 100 and 0.2; each step its own mem, the last one's read
    steps = ((110, 0.3, 10), (300, 0.9, 20), (100, 0.2, 0))
    records = [{"tokens_per_s": 1.0, "mem": {**mem, "params": 10**9}, "comm": comm, "pipeline": None}] + [
        {"tokens_per_s": speed, "mem": {**mem, "params": mem["params"] + extra}, "comm": comm,
         "pipeline": {"bubble_measured": bubble}} for speed, bubble, extra in steps]
    monkeypatch.setattr(layouts, "run_train", lambda ranks, args, log: records)
    row = layouts.measure_layout(4, (2, 2, 1), 4, 1, 1, [], tmp_path)
    assert (row["dp"], row["pp"], row["tp"]) == (2, 2, 1)
    assert row["tokens_per_s"] == 110 and row["bubble"] == 0.3  # medians of the 3 steps after the warm-up
    assert row["model_states"] == 321 and row["activations_peak"] == 4000  # the last step's mem
    assert (row["dp_bytes"], row["pp_bytes"], row["tp_bytes"]) == (5, 0, 7)
