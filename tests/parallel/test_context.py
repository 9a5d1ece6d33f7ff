"""Context parallelism (parallel/context.py): the zig-zag split, the online softmax, ring attention,
and every layout with cp > 1 training to the single-process numbers.

    python -m pytest tests/parallel/test_context.py -m "not mpi"
    mpiexec -n K python -m pytest -m mpi tests/parallel/test_context.py      # K = 2, 4, 8
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings
from mpi4py import MPI
from mpi_harness import mpi_given, needs_world_size
from one_process import assert_trains_like_one_process

from minipar.core.autograd import Tensor
from minipar.core.nn import causal_attention
from minipar.distributed.communicator import Comm
from minipar.parallel.context import (
    OnlineSoftmax,
    RingAttention,
    causal_blocks,
    chunks_of,
    zigzag_positions,
)
from minipar.trainer import loop
from minipar.trainer.config import TrainConfig
from minipar.trainer.validate import validate

WORLD = MPI.COMM_WORLD


# ---- the split ---------------------------------------------------------------------------------------


def test_zigzag_positions_are_written_out_by_hand():
    assert [list(zigzag_positions(16, 4, r)) for r in range(4)] == [
        [0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert [list(zigzag_positions(8, 2, r)) for r in range(2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]


@given(cp=st.integers(1, 8), chunk=st.integers(1, 3))
@settings(max_examples=10, deadline=None)
def test_the_ranks_hold_every_position_once_and_equal_causal_work(cp, chunk):
    """Zig-zag: the ranks' positions partition the sequence, and each rank computes 2C + 1 of the
    C(2C+1) score blocks under the causal mask (half of the (2C)^2, plus half the diagonal)."""
    held = np.concatenate([zigzag_positions(2 * cp * chunk, cp, r) for r in range(cp)])
    assert sorted(held) == list(range(2 * cp * chunk))
    assert [causal_blocks(cp, r) for r in range(cp)] == [2 * cp + 1] * cp
    assert sum(b <= a for a in range(2 * cp) for b in range(2 * cp)) == cp * (2 * cp + 1)


def test_a_contiguous_split_would_not_balance():
    """What the zig-zag is for, counted by hand on the 8 x 8 chunk grid of cp = 4: contiguous pairs of
    chunks (2r, 2r+1) give rank r 1+2, 3+4, 5+6, 7+8 blocks; zig-zag pairs chunk r with 7-r, r+1 + 8-r = 9."""
    assert chunks_of(0, 4) == (0, 7) and chunks_of(3, 4) == (3, 4)
    for zigzag, expected in ((False, [3, 7, 11, 15]), (True, [9, 9, 9, 9])):
        held = [chunks_of(rank, 4) if zigzag else (2 * rank, 2 * rank + 1) for rank in range(4)]
        assert [sum(chunk + 1 for chunk in chunks) for chunks in held] == expected  # chunk q sees q + 1


# ---- the online softmax and ring attention on one rank -----------------------------------------------


def softmax_rows(s):
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@given(blocks=st.integers(1, 5), seed=st.integers(0, 2**16))
@settings(max_examples=10, deadline=None)
def test_the_online_softmax_over_blocks_is_the_softmax_of_the_whole_row(blocks, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 3, 4))
    scores = [rng.standard_normal((2, 3, 5)) * 10 for _ in range(blocks)]  # * 10: the maximum moves
    values = [rng.standard_normal((2, 5, 4)) for _ in range(blocks)]
    acc = OnlineSoftmax(q)
    for s, v in zip(scores, values):
        acc.add(s, v)
    out, lse = acc.result()
    whole = np.concatenate(scores, axis=-1)
    np.testing.assert_allclose(out, softmax_rows(whole) @ np.concatenate(values, axis=-2), rtol=1e-12)
    np.testing.assert_allclose(lse[..., 0], stable_log_sum_exp(whole), rtol=1e-12)


def stable_log_sum_exp(s):
    """m + log(sum(exp(s - m))): the reference that stays finite for any finite scores."""
    m = s.max(axis=-1)
    return m + np.log(np.exp(s - m[..., None]).sum(axis=-1))


@pytest.mark.parametrize("offsets", [(800.0, 800.0, 800.0), (400.0, -400.0), (-400.0, 400.0),
                                     (400.0, -400.0, 400.0), (-800.0, -790.0)],
                         ids=["around_800", "plus_400_then_minus_400", "minus_400_then_plus_400",
                              "400_-400_400", "around_-800"])
def test_the_online_softmax_stays_finite_and_exact_for_large_scores(offsets):
    """The lesson's numerical edge: scores near 800 overflow exp() without the running maximum (NaN);
    a block of +400 then one of -400 overflows if each block is shifted by its own maximum (inf)."""
    rng = np.random.default_rng(13)
    q = rng.standard_normal((2, 3, 4))
    scores = [rng.standard_normal((2, 3, 5)) + offset for offset in offsets]
    values = [rng.standard_normal((2, 5, 4)) for _ in offsets]
    acc = OnlineSoftmax(q)
    for s, v in zip(scores, values):
        acc.add(s, v)
    out, lse = acc.result()
    whole = np.concatenate(scores, axis=-1)
    assert np.isfinite(out).all() and np.isfinite(lse).all(), "the output or the log-sum-exp overflowed"
    np.testing.assert_allclose(out, softmax_rows(whole) @ np.concatenate(values, axis=-2), rtol=1e-10)
    np.testing.assert_allclose(lse[..., 0], stable_log_sum_exp(whole), rtol=1e-12)


@given(heads=st.sampled_from([1, 2]), chunk=st.integers(1, 3), seed=st.integers(0, 2**16))
@settings(max_examples=6, deadline=None)
def test_ring_attention_on_one_rank_is_causal_attention_and_its_gradients(heads, chunk, seed):
    """cp = 1: the ring is one rank holding chunks 0 and 1; values and gradients must be those of
    nn.causal_attention's dense masked softmax, differentiated by autograd."""
    rng = np.random.default_rng(seed)
    B, T, C = 2, 2 * chunk, 4 * heads
    arrays = [rng.standard_normal((B, T, C)) for _ in range(3)]
    upstream = rng.standard_normal((B, T, C))
    results = []
    for attend in (lambda q, k, v: causal_attention(q, k, v, heads),
                   lambda q, k, v: RingAttention.apply(q, k, v, heads, Comm(MPI.COMM_SELF))):
        q, k, v = (Tensor(a.copy(), requires_grad=True) for a in arrays)
        y = attend(q, k, v)
        (y * Tensor(upstream)).sum().backward()
        results.append([y.data, q.grad, k.grad, v.grad])
    for ring, dense in zip(results[1], results[0]):
        np.testing.assert_allclose(ring, dense, rtol=1e-10, atol=1e-12)


# ---- bad input -----------------------------------------------------------------------------------------


def test_bad_cp_is_refused_in_one_line():
    base = TrainConfig(cp=2, dp=1, seq_len=8)
    assert validate(base, 2) == []
    assert validate(base.replace(seq_len=6), 2) == [
        "--seq-len 6 is not divisible by 2*cp = 4: the zig-zag split cuts the sequence into 2*cp chunks"]
    assert validate(base.replace(model="mlp"), 2) == [
        "--cp 2 needs --model gpt (context parallelism splits the GPT's sequence)"]
    assert validate(base, 4) == ["dp*tp*pp*cp = 1*1*1*2 = 2 does not match the world size 4 (mpiexec -n)"]
    assert validate(base.replace(cp=0), 1) == ["--cp must be a positive integer, got 0"]
    assert base.replace(dp=None).resolved(4).dp == 2
    assert TrainConfig(cp=4).single_process().cp == 1


def test_the_command_line_refuses_a_bad_cp_with_exit_code_2():
    command = [sys.executable, "-m", "minipar", "train", "--cp", "3", "--seq-len", "8", "--dp", "1",
               "--steps", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("minipar train: error: dp*tp*pp*cp = 1*1*1*3 = 3 does not match the "
                                  "world size 1")
    assert "--seq-len 8 is not divisible by 2*cp = 6" in done.stderr


# ---- every layout with cp > 1 trains like one process -------------------------------------------------


def tiny(**changes) -> TrainConfig:
    """2 layers (pp up to 4), 4 heads (tp up to 4), 16 positions (cp up to 8), 8 sequences (dp up to 4)."""
    base = TrainConfig(model="gpt", precision="fp64", n_layer=2, n_head=4, d_model=16, seq_len=16,
                       batch_size=8, steps=2, quiet=True)
    return base.replace(**changes)


def grids(world: int) -> list[tuple[int, int, int, int]]:
    """Every (dp, pp, cp, tp) of `world` ranks with cp > 1 that tiny() accepts."""
    found = []
    for cp in range(2, world + 1):
        for tp in range(1, world // cp + 1):
            for pp in range(1, world // (cp * tp) + 1):
                dp, rest = divmod(world, cp * tp * pp)
                if not rest and not validate(tiny(dp=dp, pp=pp, cp=cp, tp=tp), world):
                    found.append((dp, pp, cp, tp))
    return found


def trains_like_one_process(cfg: TrainConfig):
    assert validate(cfg, WORLD.size) == []
    trainer = loop.Trainer(cfg, WORLD)
    records = trainer.run()
    full = trainer.full_state()
    trainer.memory.close()
    if WORLD.rank == 0:
        assert_trains_like_one_process(cfg, records, full)
    return records, trainer


# cp alone and with each other dimension and ZeRO stage, on 4 ranks: (dp, pp, cp, tp, zero, microbatches)
NAMED = [(1, 1, 4, 1, 0, 1), (2, 1, 2, 1, 0, 2), (1, 1, 2, 2, 0, 1), (1, 2, 2, 1, 0, 2), (2, 1, 2, 1, 1, 1),
         (2, 1, 2, 1, 2, 2), (2, 1, 2, 1, 3, 1)]


@needs_world_size(4)
@pytest.mark.parametrize("layout", NAMED)
@mpi_given(max_examples=1, seed=st.integers(0, 2**16))
def test_cp_with_each_dimension_trains_like_one_process(layout, seed):
    dp, pp, cp, tp, zero, microbatches = layout
    trains_like_one_process(tiny(dp=dp, pp=pp, cp=cp, tp=tp, zero=zero, microbatches=microbatches, seed=seed))


@needs_world_size(2, 8)
@mpi_given(max_examples=3, grid=st.sampled_from(grids(WORLD.size) or [(1, 1, 1, 1)]),
           zero=st.sampled_from([0, 1, 2, 3]), microbatches=st.sampled_from([1, 2]),
           seed=st.integers(0, 2**16))
def test_random_layouts_with_cp_train_like_one_process(grid, zero, microbatches, seed):
    dp, pp, cp, tp = grid
    trains_like_one_process(tiny(dp=dp, pp=pp, cp=cp, tp=tp, zero=zero, seed=seed,
                                 microbatches=math.gcd(microbatches, 8 // dp)))


# ---- bytes on the wire, from the ledger, against the formula derived by hand ---------------------------


@needs_world_size(2, 4, 8)
@mpi_given(max_examples=2, microbatches=st.sampled_from([1, 2]))
def test_cp_bytes_per_step_equal_their_formula(microbatches):
    """Rank 0's ledger for one step. On the cp ring, per attention layer and micro-batch, with S the bytes
    of this rank's keys (b * T/C * d/tp * 8): forward C-1 hops of keys and values (2S each), backward C-1
    hops of keys, values and their gradients (4S) and one hop taking the gradients home (2S); messages
    C-1 + C-1 + 1. ZeRO-1 over dp x cp: reduce-scatter and all-gather of each unit's parameters padded to
    a multiple of N = dp*cp, (N-1)/N of it each; no byte on the plain dp communicator."""
    cp, tp = (2, 1) if WORLD.size == 2 else (WORLD.size // 2, 2) if WORLD.size == 8 else (2, 2)
    dp = WORLD.size // (cp * tp)
    cfg = tiny(dp=dp, cp=cp, tp=tp, zero=1, microbatches=microbatches, steps=1)
    trainer = loop.Trainer(cfg, WORLD)
    comm = trainer.run()[-1]["comm"]
    trainer.memory.close()
    b, w = cfg.batch_size // dp // microbatches, 8
    S = b * (cfg.seq_len // cp) * (cfg.d_model // tp) * w
    per_layer = (cp - 1) * 2 * S + (cp - 1) * 4 * S + 2 * S
    assert comm["by_dim_op"]["cp"] == {"send": cfg.n_layer * microbatches * per_layer}
    n = dp * cp
    units = trainer.engine.model.units()
    padded = sum(-(-sum(p.size for p in unit.parameters()) // n) * n for _, unit in units)
    assert comm["by_dim_op"]["dp_cp"] == {"reduce_scatter": (n - 1) * padded // n * w,
                                          "all_gather": (n - 1) * padded // n * w}
    assert comm["by_dim"].get("dp", 0) == 0
    if tp == 1:  # messages: the ring's, then ZeRO-1's N-1 per collective, two collectives per unit
        cp_messages = cfg.n_layer * microbatches * (2 * (cp - 1) + 1)
        assert comm["messages"] == cp_messages + 2 * (n - 1) * len(units)


# ---- activation memory ---------------------------------------------------------------------------------


@needs_world_size(4)
@mpi_given(max_examples=1, seed=st.integers(0, 10))
def test_activations_per_rank_are_about_a_cpth_of_the_sequence_dependent_part(seed):
    """Rank 0's measured activation peak with cp = 4 against one process's. One process keeps, per layer,
    one (T, T) array per head and sequence (the softmax's output, which its backward and the matmul
    save, one buffer: B * H * T^2 * 8 bytes; the scaling of the scores by a constant keeps nothing);
    the rest grows with T. The ring keeps no (T, T) array,
    so its peak must be a quarter of the rest, give or take the ring's own saves (its output and
    log-sum-exp per local position: 6% here), and below a quarter of the whole."""
    cfg = tiny(cp=4, dp=1, seed=seed, steps=1, batch_size=4)
    trainer = loop.Trainer(cfg, WORLD)
    ring_peak = trainer.run()[-1]["mem"]["activations_peak"]
    trainer.memory.close()
    if WORLD.rank == 0:
        single = loop.Trainer(cfg.single_process(), MPI.COMM_SELF)
        one_peak = single.run()[-1]["mem"]["activations_peak"]
        single.memory.close()
        quadratic = cfg.n_layer * cfg.batch_size * cfg.n_head * cfg.seq_len ** 2 * 8
        linear = one_peak - quadratic
        assert ring_peak < one_peak / 4
        assert abs(ring_peak * 4 - linear) <= 0.1 * linear, (ring_peak, one_peak, quadratic)


# ---- checkpoints: saved in one cp, resumed in another --------------------------------------------------


def on_ranks(ranks: int, cfg: TrainConfig):
    """Run cfg on world ranks [0, ranks): (records, full weights) on rank 0."""
    sub = WORLD.Split(0 if WORLD.rank < ranks else MPI.UNDEFINED, WORLD.rank)
    if sub == MPI.COMM_NULL:
        return None, None
    try:
        trainer = loop.Trainer(cfg, sub)
        records = trainer.run()
        full = trainer.full_state()
        trainer.memory.close()
        return records, full
    finally:
        sub.Free()


RESUMABLE = [(1, 1, 1, 1, 0), (2, 1, 1, 1, 1), (1, 1, 2, 1, 0), (1, 1, 2, 1, 3), (2, 1, 2, 1, 2),
             (1, 1, 4, 1, 0), (1, 1, 2, 2, 1), (1, 2, 2, 1, 0)]  # (dp, pp, cp, tp, zero)


def resumable(world: int) -> list[tuple]:
    return [layout for layout in RESUMABLE if math.prod(layout[:4]) <= world]


@needs_world_size(2, 4, 8)
@mpi_given(max_examples=3, saved=st.sampled_from(resumable(WORLD.size)),
           resumed=st.sampled_from(resumable(WORLD.size)), saved_at=st.integers(1, 2))
def test_a_checkpoint_resumes_in_another_cp_like_one_process(saved, resumed, saved_at):
    if saved[2] == resumed[2] == 1:
        saved = (1, 1, 2, 1, 0)  # at least one side with context parallelism
    directory = Path(WORLD.bcast(tempfile.mkdtemp(prefix="minipar-cp-") if WORLD.rank == 0 else None))
    cfg = tiny(steps=3)

    def laid_out(layout):
        dp, pp, cp, tp, zero = layout
        return cfg.replace(dp=dp, pp=pp, cp=cp, tp=tp, zero=zero)

    try:
        on_ranks(math.prod(saved[:4]), laid_out(saved).replace(steps=saved_at, save=str(directory)))
        records, full = on_ranks(math.prod(resumed[:4]), laid_out(resumed).replace(resume=str(directory)))
        if WORLD.rank == 0:
            assert [r["step"] for r in records] == list(range(saved_at, cfg.steps))
            assert_trains_like_one_process(cfg, records, full)
    finally:
        if WORLD.rank == 0:
            shutil.rmtree(directory)
