"""`bench dp` (minipar_lab/bench/dp.py): the ring bytes of a real two-rank run, a row's medians and
spread taken as the table says, and sizes that do not divide the batch refused."""

import contextlib
import io
import json

from minipar.core.nn import GPT
from minipar.trainer import build
from minipar.trainer.config import TrainConfig
from minipar_lab.bench import dp as data_bench

TINY_GPT = ["--precision", "fp64", "--n-layer", "2", "--n-head", "2", "--d-model", "16", "--seq-len", "8"]


def tiny(**changes) -> TrainConfig:
    base = TrainConfig(model="gpt", precision="fp64", n_layer=2, n_head=2, d_model=16, seq_len=8,
                       batch_size=8, steps=2, quiet=True)
    return base.replace(**changes)


def gradient_bytes(model) -> int:
    return sum(p.data.nbytes for p in model.parameters())


def test_bench_dp_reports_the_ring_bytes_of_a_real_two_rank_run():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = data_bench.main(["--steps", "3", "--warmup", "1", "--repeats", "1", "--json", *TINY_GPT,
                                "--batch-size", "8", "--bucket-mb", "0.01"])
    assert code == 0
    figures = json.loads(out.getvalue())
    grad = gradient_bytes(GPT(build.model_config(tiny()), seed=None))
    one, two = figures["rows"]
    assert (one["dp"], one["sent_bytes_per_step"], one["speedup"]) == (1, 0, 1.0)
    assert two["dp"] == 2 and (grad // 8) % 2 == 0  # an even element count: the ring splits it exactly
    assert two["sent_bytes_per_step"] == two["ring_formula_bytes"] == grad
    assert two["buckets"] > 1 and two["messages_per_step"] == 2 * two["buckets"]
    assert all(r["tokens_per_s"] > 0 for r in figures["rows"]) and two["all_reduce_s"] > 0


def test_bench_dps_row_takes_the_all_reduce_probes_median_and_spread_and_none_at_one_process():
    def step(seconds):
        return {"tokens_per_s": 1 / seconds, "time_s": seconds, "comm": {"sent_bytes": 8, "messages": 2}}
    kept = {(kind, n): [] for kind in (*data_bench.WAYS, "ceiling", "all_reduce") for n in (1, 2, 4)}
    kept["overlap", 1] = kept["overlap", 2] = kept["overlap", 4] = [step(0.5), step(0.25), step(2.0)]
    kept["all_reduce", 2] = kept["all_reduce", 4] = [1.0, 2.0, 3.0, 10.0]  # quartiles 1.75, 4.75: 2.5 ± 1.5
    row = data_bench.size_row(2, kept, grad_bytes=16)
    assert (row["all_reduce_s"], row["all_reduce_s_spread"]) == (2.5, 1.5)
    # medians of 0.5, 0.25, 2.0 s (the mean would be 0.917) and of 2, 4, 0.5 tokens/s (the mean 2.17)
    assert (row["step_s"], row["tokens_per_s"], row["ring_formula_bytes"]) == (0.5, 2.0, 16)
    assert data_bench.size_row(4, kept, grad_bytes=16)["ring_formula_bytes"] == 24  # 2 (N-1)/N x 16
    one = data_bench.size_row(1, kept, grad_bytes=16)
    assert (one["all_reduce_s"], one["all_reduce_s_spread"], one["ring_formula_bytes"]) == (0.0, 0.0, 0)


def test_bench_dp_refuses_sizes_that_do_not_divide_the_batch(capsys):
    assert data_bench.main(["--sizes", "1", "3", "--batch-size", "8"]) == 2
    assert "--sizes" in capsys.readouterr().err


# ---- multi-rank: dp = world size ----
