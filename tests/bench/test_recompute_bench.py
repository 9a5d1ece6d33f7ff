"""`bench recompute` (minipar_lab/bench/recompute.py): the measured peaks equal the formulas, and the
recomputed parts it times are what each mode runs again, with the graph off."""

import numpy as np

from minipar.core import nn
from minipar.core.autograd import activation_meter, no_grad
from minipar.trainer.tasks import AdditionTask
from minipar_lab.bench.recompute import attention_inputs, recompute_figures, recomputed_forwards

MODES = ("none", "selective", "full")


def test_bench_recompute_reports_the_formulas_peaks():
    figures = recompute_figures(seq_len=8, batch=2, precision="fp64", repeats=1)
    assert [row["recompute"] for row in figures["modes"]] == list(MODES)
    assert all(row["activations_peak"] == row["formula"] for row in figures["modes"])
    rows = {row["recompute"]: row for row in figures["modes"]}
    assert rows["none"]["recomputed_forward_ms"] == 0 and rows["none"]["extra_ms"] == 0
    assert rows["selective"]["recomputed_forward_ms"] > 0 and rows["full"]["recomputed_forward_ms"] > 0
    assert all(isinstance(row["page_faults"], int) and row["page_faults"] >= 0 for row in figures["modes"])


def test_bench_recompute_times_the_recomputed_parts_with_the_graph_off():
    """The yardstick of recomputation's extra time is the part each mode runs again, as its first pass
    runs it: the blocks (full), the attention cores on the q, k, v the blocks give them (selective),
    the graph off: nothing reaches the activation meter. The q, k, v are checked for every block against
    the plain model walked block by block: a later block's depend on what the recording attention
    returned to the blocks before it, which the first block's cannot show."""
    cfg = nn.GPTConfig(vocab_size=AdditionTask.vocab_size, block_size=8, n_layer=2, n_head=2, d_model=8)
    models = {mode: nn.GPT(cfg, seed=0, recompute=mode) for mode in MODES}
    ids, _ = AdditionTask(8, 0).global_batch(0, 2)
    expected = []
    with no_grad():
        x = models["none"].embed(ids)
        for block in models["none"].blocks:
            h = block.ln_1(x)
            expected.append((block.attn.query(h).data, block.attn.key(h).data, block.attn.value(h).data))
            x = block(x)  # the next block's input
    cores = attention_inputs(cfg, ids)
    assert len(cores) == len(expected) == cfg.n_layer
    for layer, (qkv, want) in enumerate(zip(cores, expected)):
        for name, got, array in zip("qkv", qkv, want, strict=True):
            assert np.array_equal(got, array), f"block {layer}'s {name}"
    activation_meter.reset_peak()
    before = activation_meter.current
    for part in recomputed_forwards(models, cfg, ids).values():
        part()
    assert activation_meter.current == before and activation_meter.peak == before
