"""Sequence parallelism: trains to the single-process numbers in every layout with tp > 1; its two
collectives are each other's adjoint; the tp traffic is tensor parallelism's plus the replicated
parameters' gradient all-reduces plus one re-gather per gathered input in backward, by formula; the
activation bytes are memory/activations.py's; bad input is one line.

    python -m pytest tests/parallel/test_sequence.py -m "not mpi"
    mpiexec -n K python -m pytest -m mpi tests/parallel/test_sequence.py     # K = 2, 4, 8
"""

from __future__ import annotations

import subprocess
import sys

import hypothesis.strategies as st
import numpy as np
from mpi4py import MPI
from mpi_harness import mpi_given, mpi_test, needs_world_size
from one_process import assert_trains_like_one_process, train

from minipar.core.autograd import Tensor
from minipar.core.shards import shard_sizes
from minipar.distributed.grid import factorisations
from minipar.distributed.ledger import ring_bytes_sent
from minipar.memory.activations import block_activation_values, gpt_activation_peak, head_values
from minipar.parallel.mappings import gather_from_sequence_parallel, reduce_scatter_to_sequence_parallel
from minipar.trainer.config import TrainConfig
from minipar.trainer.loop import compare_with_reference
from minipar.trainer.tasks import AdditionTask
from minipar.trainer.validate import validate

WORLD = MPI.COMM_WORLD
LAYOUTS = [(dp, pp, tp) for dp, pp, tp in factorisations(WORLD.size) if tp > 1]


def tiny(**changes) -> TrainConfig:
    base = TrainConfig(sp=True, precision="fp64", n_layer=2, n_head=4, d_model=8, seq_len=8, batch_size=4,
                       steps=2, quiet=True)
    return base.replace(**changes)


# ----- serial: the checks ------------------------------------------------------------------------------


def test_sp_needs_tp_the_gpt_and_a_sequence_tp_divides():
    assert validate(tiny(tp=1, dp=1), 1) == [
        "--sp needs --tp > 1, got --tp 1 (sequence parallelism splits the sequence over the tensor-parallel "
        "ranks)"]
    assert validate(tiny(tp=4, dp=1, seq_len=10), 4) == [
        "--sp: --seq-len 10 is not divisible by --tp 4 "
        "(each tensor-parallel rank keeps seq_len/tp positions)"]
    assert validate(tiny(model="mlp", dp=2), 2) == [
        "--sp needs --model gpt (sequence parallelism cuts the GPT's sequence; the MLP has none)"]


def test_sp_without_tp_is_one_line_and_exit_2():
    run = subprocess.run([sys.executable, "-m", "minipar", "train", "--sp"], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "minipar train: error: --sp needs --tp > 1, got --tp 1 (sequence parallelism splits the sequence "
        "over the tensor-parallel ranks)"]


# ----- multi-rank ----------------------------------------------------------------------------------------


@needs_world_size(2, 4, 8)
@mpi_given(max_examples=3, layout=st.sampled_from(LAYOUTS or [(1, 1, 2)]), zero=st.sampled_from([0, 1, 2, 3]),
           recompute=st.sampled_from(["none", "selective", "full"]), microbatches=st.sampled_from([1, 2]),
           seed=st.integers(0, 2**16))
def test_sequence_parallel_trains_like_one_process(layout, zero, recompute, microbatches, seed):
    dp, pp, tp = layout
    cfg = tiny(dp=dp, pp=pp, tp=tp, zero=zero, recompute=recompute, microbatches=microbatches, seed=seed,
               n_head=2 * tp, d_model=4 * tp, seq_len=2 * tp, batch_size=2 * dp * microbatches,
               n_layer=max(2, pp))
    assert validate(cfg, WORLD.size) == []
    records, full = train(cfg)
    if WORLD.rank == 0:
        assert_trains_like_one_process(cfg, records, full)


@needs_world_size(4)
@mpi_test
def test_ddp_overlapping_with_sp_leaves_late_replicated_gradients_to_the_step():
    # Found when overlap and --sp met: a replicated LayerNorm weight reaches its gradient through a
    # Function of its own, after its unit's input hook has fired, so a bucket holding it cannot start in
    # backward. Small buckets put such a weight in a bucket of its own unit (dp 2 x tp 2, ZeRO 0).
    cfg = tiny(dp=2, tp=2, n_head=4, d_model=8, seq_len=4, batch_size=4, bucket_mb=1e-4)
    assert validate(cfg, WORLD.size) == []
    records, full = train(cfg)
    if WORLD.rank == 0:
        check = compare_with_reference(cfg, records, full)
        assert check["max_rel_weight_deviation"] <= 1e-9, check


@mpi_given(max_examples=3, seed=st.integers(0, 2**16), batch=st.integers(1, 3), piece=st.integers(1, 3),
           width=st.integers(1, 4))
def test_gather_and_reduce_scatter_are_adjoint(comm, seed, batch, piece, width):
    """<gather(x), y> = <x, reduce_scatter(y)> summed over ranks, for any x (b, s/t, h), y (b, s, h);
    and the forward of each is the other's backward."""
    rng = np.random.default_rng([seed, comm.rank])
    x = Tensor(rng.standard_normal((batch, piece, width)), requires_grad=True)
    y = Tensor(rng.standard_normal((batch, piece * comm.size, width)), requires_grad=True)
    gathered = gather_from_sequence_parallel(x, comm)
    scattered = reduce_scatter_to_sequence_parallel(y, comm)
    left = comm.mpi.allreduce(float((gathered.data * y.data).sum()))
    right = comm.mpi.allreduce(float((x.data * scattered.data).sum()))
    np.testing.assert_allclose(left, right, rtol=1e-12)
    # gathered holds every rank's piece in rank order along the sequence
    pieces = comm.mpi.allgather(x.data)
    np.testing.assert_array_equal(gathered.data, np.concatenate(pieces, axis=1))
    gathered.backward(y.data)
    np.testing.assert_array_equal(x.grad, scattered.data)  # gather's backward is the reduce-scatter


def all_reduce_cost(n_values: int, comm_size: int, rank: int) -> int:
    """Bytes one ring all-reduce of n fp64 values sends from `rank` (distributed/ledger.py's model)."""
    return ring_bytes_sent("all_reduce", [8 * n for n in shard_sizes(n_values, comm_size)], rank)


@needs_world_size(2, 4)
@mpi_given(max_examples=2, n_layer=st.integers(1, 3), microbatches=st.sampled_from([1, 2]),
           seed=st.integers(0, 99))
def test_tp_traffic_is_tensor_parallelisms_plus_the_replicated_gradients(n_layer, microbatches, seed):
    t, micro, h = WORLD.size, 2, 2 * WORLD.size
    s = 2 * t
    cfg = tiny(tp=t, dp=1, n_layer=n_layer, n_head=t, d_model=h, seq_len=s, microbatches=microbatches,
               batch_size=micro * microbatches, seed=seed, steps=1)
    records, _ = train(cfg)
    step = records[-1]["comm"]
    activation = all_reduce_cost(micro * s * h, t, WORLD.rank)  # a reduce-scatter plus an all-gather
    loss = all_reduce_cost(micro * s, t, WORLD.rank)
    # tensor parallelism: 2L + 1 activation all-reduces each way per micro-batch, 3 small in the loss
    tensor_parallel = microbatches * (2 * (2 * n_layer + 1) * activation + 3 * loss)
    # the replicated parameters: per block ln_1 and ln_2 (weight, bias) and the two row biases, the
    # head's ln_f (weight, bias), the position embedding (seq_len, h): one all-reduce each per micro-batch
    replicated = microbatches * ((6 * n_layer + 2) * all_reduce_cost(h, t, WORLD.rank)
                                 + all_reduce_cost(s * h, t, WORLD.rank))
    # Megatron's re-gathers: each gathered input (QKV's and fc's per block, lm_head's) is kept as this
    # rank's piece and all-gathered again in backward, once for all its readers. A ring all-gather of t
    # pieces of b·(s/t)·h fp64 values has each rank pass on the t - 1 pieces that are not its successor's
    piece = micro * (s // t) * h * 8
    regathers = microbatches * (2 * n_layer + 1) * (t - 1) * piece
    assert step["by_dim"]["tp"] == tensor_parallel + replicated + regathers
    # the activations go by reduce-scatter and all-gather; all-reduces carry the loss's and the gradients'
    along_sequence = step["by_op"]["reduce_scatter"] + step["by_op"]["all_gather"]
    assert along_sequence == tensor_parallel - microbatches * 3 * loss + regathers
    assert step["by_op"]["all_reduce"] == microbatches * 3 * loss + replicated
    # per gathered input: its gather forward, its re-gather backward, and the all-gather that is the
    # backward of the reduce-scatter before it (2L + 1 reduce-scatters forward: the embedding, 2 a block)
    assert step["by_op"]["all_gather"] == 3 * regathers
    assert step["by_op"]["reduce_scatter"] == 2 * regathers


@needs_world_size(2, 4)
@mpi_given(max_examples=2, recompute=st.sampled_from(["none", "selective", "full"]),
           seq_mult=st.integers(1, 3), n_layer=st.integers(1, 2))
def test_activation_peak_is_the_formulas_and_below_tensor_parallelisms(recompute, seq_mult, n_layer):
    t, micro, h = WORLD.size, 2, 2 * WORLD.size
    s = seq_mult * t
    peaks = {}
    for sp in (True, False):
        cfg = tiny(sp=sp, tp=t, dp=1, n_layer=n_layer, n_head=t, d_model=h, seq_len=s, batch_size=micro,
                   recompute=recompute, steps=1)
        records, _ = train(cfg)
        peaks[sp] = records[-1]["mem"]["activations_peak"]
        vocab = AdditionTask.vocab_size
        assert peaks[sp] == gpt_activation_peak(s, micro, h, t, n_layer, vocab, t, recompute, sp=sp)
    assert peaks[True] < peaks[False]


@needs_world_size(2)
@mpi_test
def test_selective_peak_with_sp_is_the_core_recomputed_in_backward_over_the_pieces_kept():
    """4 heads of width 2 over 32 tokens at tp 2: the recomputed (a/t, s, s) core outweighs the head, so
    the peak is in backward, on top of what the block still keeps when its core is rerun: ln_1's piece
    and the QKV input's piece (the gathered input is kept as its s/t positions, not whole), q, k, v."""
    s, b, h, a, t = 32, 2, 8, 4, WORLD.size
    records, _ = train(tiny(tp=t, dp=1, seq_len=s, batch_size=b, n_head=a, d_model=h, n_layer=1,
                            recompute="selective", steps=1))
    vocab = AdditionTask.vocab_size
    end_of_forward = 8 * (block_activation_values(s, b, h, a, t, "selective", sp=True)
                          + head_values(s, b, h, vocab, t, sp=True))
    peak = records[-1]["mem"]["activations_peak"]
    assert peak == gpt_activation_peak(s, b, h, a, 1, vocab, t, "selective", sp=True)
    assert peak > end_of_forward
