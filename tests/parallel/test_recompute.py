"""Activation recomputation: exact in every layout, activation bytes equal to the formula, the traffic
it adds (tensor parallelism repeats a block's forward all-reduces) and the traffic it does not (ZeRO-3
gathers no more), and the bad input it refuses.

    python -m pytest tests/parallel/test_recompute.py -m "not mpi"
    mpiexec -n K python -m pytest -m mpi tests/parallel/test_recompute.py     # K = 2, 4
"""

from __future__ import annotations

import subprocess
import sys

import hypothesis.strategies as st
import numpy as np
from hypothesis import given, settings
from mpi4py import MPI
from mpi_harness import mpi_given, needs_world_size
from one_process import assert_trains_like_one_process, train

from minipar.core import functional as F
from minipar.core import nn
from minipar.core.autograd import Tensor, activation_meter, no_grad
from minipar.core.recompute import checkpoint
from minipar.core.shards import shard_sizes
from minipar.distributed.grid import factorisations
from minipar.distributed.ledger import ring_bytes_sent
from minipar.memory.activations import block_activation_values, gpt_activation_peak, head_values
from minipar.trainer.config import TrainConfig
from minipar.trainer.loop import compare_with_reference
from minipar.trainer.tasks import AdditionTask
from minipar.trainer.validate import validate

WORLD = MPI.COMM_WORLD
MODES = ("none", "selective", "full")


def tiny(**changes) -> TrainConfig:
    base = TrainConfig(precision="fp64", n_layer=2, n_head=2, d_model=8, seq_len=8, batch_size=4, steps=2,
                       quiet=True, dp=1)
    return base.replace(**changes)


# ----- serial: the Function, the per-block bytes, the peak of a run ---------------------------------------


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**16), shape=st.tuples(st.integers(1, 3), st.integers(1, 4)))
def test_checkpoint_gives_the_gradients_of_the_plain_function(seed, shape):
    rng = np.random.default_rng(seed)
    w = nn.Parameter(shape[::-1])
    w.data[...] = rng.standard_normal(w.shape)

    def function(x):
        return F.tanh(x @ w) * x.sum()

    x_data, grads = rng.standard_normal(shape), []
    for wrap in (function, lambda x: checkpoint(function, x, parameters=[w])):
        x = Tensor(x_data.copy(), requires_grad=True)
        w.grad = None
        wrap(x).sum().backward()
        grads.append((x.grad, w.grad))
    (x_plain, w_plain), (x_recomputed, w_recomputed) = grads
    np.testing.assert_array_equal(x_recomputed, x_plain)  # the same arithmetic: bit for bit
    np.testing.assert_array_equal(w_recomputed, w_plain)


def test_a_forward_without_a_graph_never_reaches_the_meter():
    """Recomputation's first pass runs under no_grad: not even a momentary byte may show in the peak."""
    model = nn.GPT(nn.GPTConfig(n_layer=1, n_head=2, d_model=4), seed=0)
    ids = np.zeros((2, 8), dtype=np.int64)
    activation_meter.reset_peak()
    before = activation_meter.current
    with no_grad():
        model(ids)
    assert activation_meter.peak == before == activation_meter.current


@settings(max_examples=4, deadline=None)
@given(s=st.integers(1, 6), b=st.integers(1, 3), heads=st.integers(1, 3), head_dim=st.integers(1, 3),
       mode=st.sampled_from(MODES))
def test_one_block_keeps_the_formulas_values(s, b, heads, head_dim, mode):
    h = heads * head_dim
    cfg = nn.GPTConfig(n_layer=1, n_head=heads, d_model=h)
    block = nn.GPT(cfg, recompute=mode).blocks[0]
    x = Tensor(np.random.default_rng(s).standard_normal((b, s, h)), requires_grad=True)
    before = activation_meter.current
    y = block(x)
    assert activation_meter.current - before == 8 * block_activation_values(s, b, h, heads, 1, mode)
    y.sum().backward()
    assert activation_meter.current == before


@settings(max_examples=4, deadline=None)
@given(seq=st.integers(2, 9), micro=st.integers(1, 3), heads=st.integers(1, 3), head_dim=st.integers(1, 3),
       n_layer=st.integers(1, 3), mode=st.sampled_from(MODES), precision=st.sampled_from(["fp64", "fp32"]))
def test_measured_activation_peak_equals_the_formula(seq, micro, heads, head_dim, n_layer, mode, precision):
    cfg = tiny(seq_len=seq, batch_size=2 * micro, microbatches=2, n_head=heads, d_model=heads * head_dim,
               n_layer=n_layer, recompute=mode, precision=precision, steps=1)
    records, _ = train(cfg)
    expected = gpt_activation_peak(seq, micro, heads * head_dim, heads, n_layer, AdditionTask.vocab_size,
                                   recompute=mode, bytes_per_value=8 if precision == "fp64" else 4)
    assert records[-1]["mem"]["activations_peak"] == expected


def test_selective_peak_is_the_core_recomputed_in_backward_when_heads_are_many():
    """With 4 heads of width 2 over 32 tokens the recomputed (a, s, s) core outweighs the head: the
    peak is in backward, not at the end of forward (the formula's second case)."""
    s, b, h, a = 32, 2, 8, 4
    records, _ = train(tiny(seq_len=s, batch_size=b, microbatches=1, n_head=a, d_model=h, n_layer=1,
                            recompute="selective", steps=1))
    end_of_forward = 8 * (block_activation_values(s, b, h, a, 1, "selective") +
                          head_values(s, b, h, AdditionTask.vocab_size))
    peak = records[-1]["mem"]["activations_peak"]
    assert peak == gpt_activation_peak(s, b, h, a, 1, AdditionTask.vocab_size, recompute="selective")
    assert peak > end_of_forward


def test_recomputation_saves_what_the_formula_says_at_long_sequences():
    """Selective drops the 3as²b term, full keeps one (b, s, h) per block: measured peaks in that order."""
    peaks = {mode: train(tiny(seq_len=32, recompute=mode, steps=1))[0][-1]["mem"]["activations_peak"]
             for mode in MODES}
    assert peaks["full"] < peaks["selective"] < peaks["none"]


def test_mlp_trains_like_one_process_with_full_recomputation():
    cfg = tiny(model="mlp", recompute="full", microbatches=2)
    records, full = train(cfg)
    check = compare_with_reference(cfg, records, full)
    assert check["max_rel_loss_deviation"] <= 1e-9 and check["max_rel_weight_deviation"] <= 1e-9, check


def test_selective_recomputation_of_the_mlp_is_refused_with_the_reason():
    assert validate(tiny(model="mlp", recompute="selective"), 1) == [
        "--recompute selective needs --model gpt (it recomputes the attention core; the MLP has none: "
        "use --recompute full)"]
    assert validate(tiny(recompute="partial"), 1) == [
        "--recompute must be one of none, selective, full, got 'partial'"]


def test_bad_recompute_is_one_line_and_exit_2():
    run = subprocess.run([sys.executable, "-m", "minipar", "train", "--model", "mlp", "--recompute",
                          "selective"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].startswith("minipar train: error: --recompute selective")


# ----- multi-rank: every layout trains like one process; the traffic recomputation adds ------------------


@needs_world_size(2, 4)
@mpi_given(max_examples=4, layout=st.sampled_from(factorisations(WORLD.size)), mode=st.sampled_from(MODES),
           zero=st.sampled_from([0, 1, 2, 3]), seed=st.integers(0, 2**16))
def test_every_layout_with_recomputation_trains_like_one_process(layout, mode, zero, seed):
    dp, pp, tp = layout
    cfg = tiny(dp=dp, pp=pp, tp=tp, zero=zero, recompute=mode, seed=seed, batch_size=4 * dp,
               microbatches=2, n_head=2 * tp, d_model=4 * tp, n_layer=max(2, pp))
    assert validate(cfg, WORLD.size) == []
    records, full = train(cfg)
    if WORLD.rank == 0:
        assert_trains_like_one_process(cfg, records, full)


def all_reduce_cost(n_values: int, comm_size: int, rank: int) -> int:
    """Bytes one ring all-reduce of n fp64 values sends from `rank` (distributed/ledger.py's model)."""
    return ring_bytes_sent("all_reduce", [8 * n for n in shard_sizes(n_values, comm_size)], rank)


@needs_world_size(2, 4)
@mpi_given(max_examples=2, mode=st.sampled_from(MODES), n_layer=st.integers(1, 3), seed=st.integers(0, 99))
def test_tensor_parallel_traffic_and_activation_bytes_by_formula(mode, n_layer, seed):
    """Full recomputation repeats each block's two forward all-reduces; the bytes kept are the formula's."""
    tp, micro, seq, d = WORLD.size, 2, 8, 2 * WORLD.size
    cfg = tiny(tp=tp, recompute=mode, n_layer=n_layer, n_head=WORLD.size, d_model=d, microbatches=2,
               batch_size=2 * micro, seq_len=seq, seed=seed, steps=1)
    records, _ = train(cfg)
    activation = all_reduce_cost(micro * seq * d, tp, WORLD.rank)
    loss = all_reduce_cost(micro * seq, tp, WORLD.rank)
    # per micro-batch: the embedding's g, 2 g per block forward, 3 in the loss, 2 f per block and the
    # head's f backward; full recomputation runs each block's 2 g again in backward
    per_block = 6 if mode == "full" else 4
    expected = 2 * ((1 + per_block * n_layer + 1) * activation + 3 * loss)
    assert records[-1]["comm"]["by_dim"]["tp"] == expected
    # and each tensor-parallel rank keeps the formula's bytes, with t = tp
    peak = gpt_activation_peak(seq, micro, d, WORLD.size, n_layer, AdditionTask.vocab_size, tp, mode)
    assert records[-1]["mem"]["activations_peak"] == peak


@needs_world_size(2)
@mpi_given(max_examples=1, seed=st.integers(0, 99))
def test_zero3_gathers_no_more_for_a_recomputed_block(seed):
    """The block is recomputed in its backward, after the backward pre-hook gathered its parameters:
    ZeRO-3's 3(N-1)/N·Ψ bytes (tests/parallel/test_zero.py) stay what they are without recomputation."""
    sent = {}
    for mode in ("none", "full"):
        records, _ = train(tiny(dp=2, zero=3, recompute=mode, seed=seed, batch_size=8, steps=1))
        sent[mode] = records[-1]["comm"]["by_dim"]["dp"]
    assert sent["full"] == sent["none"] > 0
