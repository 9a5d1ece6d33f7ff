"""Tensor parallelism: every layer, the whole GPT and training agree with the single-process model
(fp64, relative 1e-9); the ledger shows two all-reduces per block each way; bad tp is a one-line error.

Multi-rank tests run the tensor-parallel layers over the whole world (tp = world size) or, for
training, over tp ranks of a dp x tp grid. The single-process counterpart is built on every rank
from the same (seed, name), so each rank checks its own shard against the matching cut of the
reference: `shard_of(reference, p.shard)`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given
from mpi_harness import mpi_given

from minipar.core import functional as F
from minipar.core import nn, optim
from minipar.core.autograd import Tensor, no_grad
from minipar.core.shards import Shard, padded_bounds, shard_of, shard_sizes
from minipar.distributed.ledger import ring_bytes_sent
from minipar.parallel.mappings import copy_to_tensor_parallel, reduce_from_tensor_parallel
from minipar.parallel.tensor import (
    ColumnParallelLinear,
    ParallelAttention,
    ParallelMLP,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from minipar.parallel.tensor_gpt import TensorParallelGPT
from minipar.trainer.config import TrainConfig
from minipar.trainer.engine import assemble_full_state
from minipar.trainer.loop import Trainer, reference_run
from minipar.trainer.validate import validate

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
RTOL = 1e-9
seeds = st.integers(0, 2**31 - 1)


def assert_close(actual, expected, what=""):
    """Relative 1e-9, elementwise and against the tensor's largest entry (floored at 1e-3).

    The tensor-wide part matters for entries near zero: AdamW divides each gradient by its own
    magnitude, so an entry whose gradient is small or mostly roundoff moves by an amount whose
    relative error says nothing (the reason the GPT has no attention key bias: see nn.py)."""
    expected = np.asarray(expected)
    scale = max(float(np.max(np.abs(expected))) if expected.size else 0.0, 1e-3)
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=RTOL * scale, err_msg=what)


def upstream_gradient(seed, shape):
    return np.random.default_rng([seed, 7]).standard_normal(shape)


def forward_backward(module, x, dy):
    """y = module(x) and the gradients of sum(y * dy): y, x.grad, {name: grad}."""
    y = module(x)
    F.sum(y * dy).backward()
    grads = {name: p.grad for name, p in module.named_parameters()}
    return y.data, (x.grad if isinstance(x, Tensor) else None), grads


def set_random_parameters(ref_module, tp_module, seed):
    """Random values for every parameter, biases included (they start at zero), each rank's shard
    cut from the reference's: a bias added on the wrong side of an all-reduce shows at once."""
    rng = np.random.default_rng([seed, 19])
    shards = dict(tp_module.named_parameters())
    for name, p in ref_module.named_parameters():
        p.data[...] = rng.standard_normal(p.shape)
        shards[name].data[...] = shard_of(p.data, shards[name].shard)


def assert_shards_match(tp_module, ref_grads):
    """Every parameter's gradient on this rank is the matching cut of the reference gradient."""
    for name, p in tp_module.named_parameters():
        assert_close(p.grad, shard_of(ref_grads[name], p.shard), name)


def random_input(seed, shape):
    return np.random.default_rng([seed, 3]).standard_normal(shape)


# ----- serial ---------------------------------------------------------------------------------------


@given(size=st.integers(1, 50), parts=st.integers(1, 8))
def test_padded_bounds_cover_the_rows_in_equal_parts(size, parts):
    bounds = [padded_bounds(size, parts, i) for i in range(parts)]
    assert bounds[0][0] == 0 and bounds[-1][1] >= size
    assert all(stop == start for (_, stop), (start, _) in zip(bounds, bounds[1:]))
    assert len({stop - start for start, stop in bounds}) == 1
    assert bounds[-1][1] - size < parts  # less than one row of padding per rank


@pytest.mark.parametrize("tp, heads", [(3, 4), (2, 3), (4, 6)])
def test_tp_that_does_not_divide_heads_names_both(tp, heads):
    cfg = TrainConfig(tp=tp, n_head=heads, d_model=12 * heads)
    errors = validate(cfg, world_size=tp)
    assert len(errors) == 1
    assert f"--tp {tp}" in errors[0] and f"--n-head {heads}" in errors[0]


def test_tp_needs_the_gpt():
    errors = validate(TrainConfig(model="mlp", tp=2), world_size=2)
    assert errors == ["--tp 2 needs --model gpt (tensor parallelism splits the GPT's layers)"]


def test_tp3_with_4_heads_is_one_line_on_every_rank_exit_2():
    result = subprocess.run(
        [str(VENV_BIN / "mpiexec"), "-n", "3", sys.executable, "-m", "minipar", "train", "--tp", "3",
         "--n-head", "4"],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "MPIEXEC_TIMEOUT": "60"},
    )
    assert result.returncode == 2, result.stderr
    # one error per rank (mpiexec may interleave the ranks' lines, so count the messages)
    errors = result.stderr.split("minipar train: error: ")[1:]
    assert len(errors) == 3, result.stderr
    assert all("--tp 3" in e and "--n-head 4" in e for e in errors), result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


# ----- multi-rank: the operators and each layer alone --------------------------------------------------


@mpi_given(seed=seeds, shape=st.sampled_from([(3,), (2, 5), (2, 3, 4)]))
def test_f_and_g_are_conjugate(comm, seed, shape):
    """f: identity forward, all-reduce backward. g: all-reduce forward, identity backward."""
    mine = [np.random.default_rng([seed, r]).standard_normal(shape) for r in range(comm.size)]
    x = Tensor(mine[comm.rank], requires_grad=True)
    y = copy_to_tensor_parallel(x, comm)
    assert np.array_equal(y.data, x.data)
    y.backward(mine[comm.rank] * 2)
    assert_close(x.grad, 2 * sum(mine))

    x = Tensor(mine[comm.rank], requires_grad=True)
    y = reduce_from_tensor_parallel(x, comm)
    assert_close(y.data, sum(mine))
    y.backward(mine[comm.rank] * 3)
    assert np.array_equal(x.grad, mine[comm.rank] * 3)


@mpi_given(seed=seeds, d_in=st.integers(1, 6), d_out=st.integers(1, 12), bias=st.booleans(),
           gather=st.booleans())
def test_column_parallel_linear(comm, seed, d_in, d_out, bias, gather):
    """Split output: this rank's columns. Gathered: the whole output, even when tp does not divide it."""
    if not gather:
        d_out = d_out * comm.size
    ref = nn.Linear(d_in, d_out, bias=bias)
    layer = ColumnParallelLinear(d_in, d_out, comm, bias=bias, gather_output=gather)
    set_random_parameters(ref, layer, seed)
    x = random_input(seed, (2, 3, d_in))
    dy = upstream_gradient(seed, (2, 3, d_out))
    ref_y, ref_dx, ref_grads = forward_backward(ref, Tensor(x, requires_grad=True), dy)
    mine = slice(None) if gather else slice(layer.start, layer.stop)
    y, dx, _ = forward_backward(layer, Tensor(x, requires_grad=True), dy[..., mine])
    assert_close(y, ref_y[..., mine], "output")
    assert_close(dx, ref_dx, "input gradient (f all-reduced it)")
    assert_shards_match(layer, ref_grads)


@mpi_given(seed=seeds, d_out=st.integers(1, 6), per_rank=st.integers(1, 3), bias=st.booleans())
def test_row_parallel_linear(comm, seed, d_out, per_rank, bias):
    d_in = per_rank * comm.size
    ref, layer = nn.Linear(d_in, d_out, bias=bias), RowParallelLinear(d_in, d_out, comm, bias=bias)
    set_random_parameters(ref, layer, seed)
    x, dy = random_input(seed, (2, 3, d_in)), upstream_gradient(seed, (2, 3, d_out))
    ref_y, ref_dx, ref_grads = forward_backward(ref, Tensor(x, requires_grad=True), dy)
    x_parallel = Tensor(x[..., layer.start : layer.stop], requires_grad=True)
    y, dx, _ = forward_backward(layer, x_parallel, dy)
    assert_close(y, ref_y, "output (g summed the partial products)")
    assert_close(dx, ref_dx[..., layer.start : layer.stop], "input gradient slice")
    assert_shards_match(layer, ref_grads)


def small_gpt_config(comm_size, heads_per_rank, head_dim, vocab, n_layer=2, seq_len=8):
    return nn.GPTConfig(vocab_size=vocab, block_size=seq_len, n_layer=n_layer,
                        n_head=heads_per_rank * comm_size, d_model=heads_per_rank * comm_size * head_dim)


@mpi_given(seed=seeds, heads_per_rank=st.integers(1, 2), head_dim=st.integers(1, 4),
           kind=st.sampled_from(["mlp", "attention"]))
def test_parallel_mlp_and_attention(comm, seed, heads_per_rank, head_dim, kind):
    cfg = small_gpt_config(comm.size, heads_per_rank, head_dim, vocab=5)
    if kind == "mlp":
        ref, layer = nn.MLP(cfg), ParallelMLP(cfg, comm)
    else:
        ref, layer = nn.CausalSelfAttention(cfg), ParallelAttention(cfg, comm)
    set_random_parameters(ref, layer, seed)
    x, dy = random_input(seed, (2, 5, cfg.d_model)), upstream_gradient(seed, (2, 5, cfg.d_model))
    ref_y, ref_dx, ref_grads = forward_backward(ref, Tensor(x, requires_grad=True), dy)
    y, dx, _ = forward_backward(layer, Tensor(x, requires_grad=True), dy)
    assert_close(y, ref_y, "output")
    assert_close(dx, ref_dx, "input gradient")
    assert_shards_match(layer, ref_grads)


@mpi_given(seed=seeds, vocab=st.integers(1, 11), dim=st.integers(1, 4))
def test_vocab_parallel_embedding(comm, seed, vocab, dim):
    ref, layer = nn.Embedding(vocab, dim), VocabParallelEmbedding(vocab, dim, comm)
    set_random_parameters(ref, layer, seed)
    ids = np.random.default_rng([seed, 5]).integers(0, vocab, size=(3, 4))
    dy = upstream_gradient(seed, (3, 4, dim))
    ref_y, _, ref_grads = forward_backward(ref, ids, dy)
    y, _, _ = forward_backward(layer, ids, dy)
    assert_close(y, ref_y, "looked-up rows")
    assert_shards_match(layer, ref_grads)


@mpi_given(seed=seeds, vocab=st.integers(1, 11), rows=st.integers(1, 12))
def test_vocab_parallel_cross_entropy(comm, seed, vocab, rows):
    rng = np.random.default_rng([seed, 11])
    full_logits = rng.standard_normal((rows, vocab)) * 3
    targets = rng.integers(0, vocab, size=rows)
    ref_logits = Tensor(full_logits, requires_grad=True)
    ref_loss = F.cross_entropy(ref_logits, targets, "sum")
    ref_loss.backward()
    start, stop = padded_bounds(vocab, comm.size, comm.rank)
    # this rank's columns; padding columns hold junk that the loss must ignore
    mine = shard_of(full_logits, Shard(full_logits.shape, 1, start, stop)) + (
        np.arange(start, stop) >= vocab) * 100.0
    logits = Tensor(mine, requires_grad=True)
    loss = vocab_parallel_cross_entropy(logits, targets, start, vocab, comm)
    loss.backward()
    assert_close(loss.data, ref_loss.data, "loss")
    assert_close(logits.grad, shard_of(ref_logits.grad, Shard(full_logits.shape, 1, start, stop)),
                 "gradient: softmax minus one-hot, zero in the padding")


@mpi_given(max_examples=3, seed=seeds)
def test_vocab_parallel_cross_entropy_far_from_zero_and_its_correct_count(comm, seed):
    """VocabParallelCrossEntropy (lesson 05's excerpt) at logits near 800, where exp overflows unless
    each row is shifted by its maximum over every rank's columns, against the summed cross-entropy,
    softmax minus one-hot and the argmax written here in NumPy. 7 words over the ranks, so the last
    rank has padding (junk at 900, which the loss must ignore). Half the targets are their row's
    largest logit: `correct` must say which."""
    rng = np.random.default_rng([seed, 12])
    rows, vocab = 6, 7
    full = 800.0 + rng.standard_normal((rows, vocab)) * 4
    targets = rng.integers(0, vocab, size=rows)
    targets[::2] = full[::2].argmax(axis=1)
    shift = full.max(axis=1, keepdims=True)
    probs = np.exp(full - shift) / np.exp(full - shift).sum(axis=1, keepdims=True)
    log_sum_exp = shift[:, 0] + np.log(np.exp(full - shift).sum(axis=1))
    want_loss = float(np.sum(log_sum_exp - full[range(rows), targets]))
    want_grad = probs.copy()
    want_grad[range(rows), targets] -= 1
    start, stop = padded_bounds(vocab, comm.size, comm.rank)
    mine = np.full((rows, stop - start), 900.0)  # padding columns: junk above every real logit
    real = min(stop, vocab) - start
    mine[:, : max(real, 0)] = full[:, start : start + max(real, 0)]
    logits = Tensor(mine, requires_grad=True)
    correct = np.zeros(rows, dtype=bool)
    loss = vocab_parallel_cross_entropy(logits, targets, start, vocab, comm, correct)
    loss.backward()
    assert_close(loss.data, want_loss, "loss")
    assert_close(logits.grad[:, : max(real, 0)], want_grad[:, start : start + max(real, 0)], "gradient")
    assert not logits.grad[:, max(real, 0) :].any()
    assert correct.tolist() == (full.argmax(axis=1) == targets).tolist()


# ----- multi-rank: the whole GPT -------------------------------------------------------------------------


def train_steps(model, ids, targets, steps, lr=1e-2):
    """AdamW steps on one batch; the losses, and after each backward the gradients of replicated
    parameters (shard None), which f and g must make identical on every tp rank."""
    opt = optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    losses, replicated_grads = [], []
    for _ in range(steps):
        model.zero_grad()
        loss = model.loss(model(ids), targets, targets.size)
        loss.backward()
        losses.append(loss.item())
        replicated_grads.append({n: p.grad for n, p in model.named_parameters() if p.shard is None})
        with no_grad():
            opt.step()
    return losses, replicated_grads


@mpi_given(max_examples=8, seed=seeds, heads_per_rank=st.integers(1, 2), head_dim=st.integers(1, 4),
           vocab=st.integers(2, 20), n_layer=st.integers(1, 2))
def test_gpt_trains_like_the_single_process_gpt(comm, seed, heads_per_rank, head_dim, vocab, n_layer):
    cfg = small_gpt_config(comm.size, heads_per_rank, head_dim, vocab, n_layer)
    rng = np.random.default_rng([seed, 13])
    ids, targets = rng.integers(0, vocab, size=(2, 8)), rng.integers(0, vocab, size=(2, 8))
    reference = nn.GPT(cfg, seed=seed)
    ref_losses, _ = train_steps(reference, ids, targets, steps=3)
    model = TensorParallelGPT(cfg, comm, seed=seed)
    losses, replicated = train_steps(model, ids, targets, steps=3)
    assert_close(losses, ref_losses, "losses")
    ref_state = dict(reference.named_parameters())
    pieces = comm.allgather_obj({n: (p.shard, p.data) for n, p in model.named_parameters()})
    full = assemble_full_state(pieces)
    assert set(full) == set(ref_state)
    for name, p in ref_state.items():
        assert_close(full[name], p.data, name)
    everyone = comm.allgather_obj(replicated)
    for step, grads in enumerate(replicated):
        for name, grad in grads.items():
            assert all(np.array_equal(grad, other[step][name]) for other in everyone), name


def all_reduces(report):
    """(bytes, messages) of the all-reduces in a ledger report."""
    return report["by_op"].get("all_reduce", 0), report["messages"]


def ring_all_reduce(n_values, comm):
    """What one all-reduce of n fp64 values costs this rank: (bytes, messages)."""
    shard_nbytes = [8 * count for count in shard_sizes(n_values, comm.size)]
    return ring_bytes_sent("all_reduce", shard_nbytes, comm.rank), 2 * (comm.size - 1)


@mpi_given(max_examples=5, seed=seeds, n_layer=st.integers(1, 3), batch=st.integers(1, 3),
           seq=st.integers(1, 6), head_dim=st.integers(1, 3))
def test_ledger_two_all_reduces_per_block_each_way(comm, seed, n_layer, batch, seq, head_dim):
    cfg = small_gpt_config(comm.size, 1, head_dim, vocab=13, n_layer=n_layer, seq_len=seq)
    model = TensorParallelGPT(cfg, comm, seed=seed)
    ids = np.random.default_rng([seed, 17]).integers(0, 13, size=(batch, seq))
    ledger = comm.ledger
    activation = ring_all_reduce(batch * seq * cfg.d_model, comm)
    loss_bytes, loss_messages = ring_all_reduce(batch * seq, comm)

    def times(count, cost):
        return count * cost[0], count * cost[1]

    ledger.start_step()
    logits = model(ids)
    forward = ledger.step_report()
    ledger.start_step()
    loss = model.loss(logits, ids, ids.size)
    at_loss = ledger.step_report()
    ledger.start_step()
    loss.backward()
    backward = ledger.step_report()

    # forward: the embedding's g, then g in attention and g in the MLP of every block
    assert all_reduces(forward) == times(1 + 2 * n_layer, activation)
    # the loss: max, target logit, sum of exp: 3 * batch * seq values, never batch * seq * vocab
    assert all_reduces(at_loss) == times(3, (loss_bytes, loss_messages))
    # backward: f in the MLP and f in attention of every block, then the head's f
    assert all_reduces(backward) == times(2 * n_layer + 1, activation)
    for report in (forward, at_loss, backward):
        assert set(report["by_op"]) <= {"all_reduce"}


# ----- multi-rank: training through the Trainer (python -m minipar train --tp N) ------------------------


def layouts(world_size):
    """(dp, tp) pairs of this world with 2 <= tp <= 4."""
    return [(world_size // tp, tp) for tp in (2, 4) if world_size % tp == 0]


@mpi_given(max_examples=6, seed=seeds, layout=st.integers(0, 1), heads_per_rank=st.integers(1, 2),
           head_dim=st.sampled_from([2, 4]), n_layer=st.integers(1, 2))
def test_trainer_matches_the_single_process_run(comm, seed, layout, heads_per_rank, head_dim, n_layer):
    choices = layouts(comm.size)
    dp, tp = choices[layout % len(choices)]
    cfg = TrainConfig(dp=dp, tp=tp, precision="fp64", steps=3, batch_size=2 * dp, seq_len=8, seed=seed,
                      n_layer=n_layer, n_head=heads_per_rank * tp, d_model=heads_per_rank * tp * head_dim,
                      quiet=True)
    assert validate(cfg, comm.size) == []
    trainer = Trainer(cfg, comm.mpi)
    records = trainer.run()
    full = trainer.full_state()
    assert all(set(r["comm"]["by_dim"]) <= {"tp", "dp"} for r in records)
    if comm.rank == 0:
        ref_losses, ref_state = reference_run(cfg)
        assert_close([r["loss"] for r in records], ref_losses, "losses")
        for name, (_, ref) in ref_state.items():
            assert_close(full[name], ref, name)
