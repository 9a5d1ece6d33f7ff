"""DDP: any dp trains to the single-process numbers; each step sends the ring all-reduce of the gradients.

    pytest -m "not mpi" tests/parallel/test_data_parallel.py                      # buckets, bad input, bench
    mpiexec -n K python -m pytest -m mpi tests/parallel/test_data_parallel.py      # K = 2, 4, 8: dp = K
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi_harness import mpi_given, mpi_test

from minipar.core import optim
from minipar.core.nn import Parameter
from minipar.distributed.grid import ProcessGrid
from minipar.parallel.ddp import DistributedDataParallel, flatten, plan_buckets, unflatten
from minipar.trainer import build
from minipar.trainer import loop as train
from minipar.trainer.config import TrainConfig
from minipar.trainer.launch import mpiexec
from minipar.trainer.validate import validate

TINY_GPT = ["--precision", "fp64", "--n-layer", "2", "--n-head", "2", "--d-model", "16", "--seq-len", "8"]


def tiny(**changes) -> TrainConfig:
    """A model small enough that 8 ranks on 2 cores train it in a blink."""
    base = TrainConfig(model="gpt", precision="fp64", n_layer=2, n_head=2, d_model=16, seq_len=8,
                       batch_size=8, steps=2, quiet=True)
    return base.replace(**changes)


def gradient_bytes(model) -> int:
    return sum(p.data.nbytes for p in model.parameters())


# ---- serial: bucketing ----

@settings(max_examples=60, deadline=None)
@given(params=st.lists(st.tuples(st.integers(1, 300), st.sampled_from(["float64", "float32"])), min_size=1,
                       max_size=20),
       cap=st.integers(1, 4000))
def test_buckets_take_every_parameter_once_last_first_within_the_cap(params, cap):
    params = [Parameter((n,), dtype=dtype) for n, dtype in params]
    buckets = plan_buckets(params, cap)
    assert [id(p) for b in buckets for p in b] == [id(p) for p in reversed(params)]
    for bucket in buckets:
        assert len({p.dtype for p in bucket}) == 1
        assert len(bucket) == 1 or sum(p.data.nbytes for p in bucket) <= cap
    for bucket, following in zip(buckets, buckets[1:]):  # closed only when the next one does not fit
        first = following[0]
        assert sum(p.data.nbytes for p in bucket) + first.data.nbytes > cap or first.dtype != bucket[0].dtype


@settings(max_examples=30, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(1, 4), max_size=3).map(tuple), min_size=1, max_size=6),
       seed=st.integers(0, 2**16))
def test_unflatten_gives_back_the_arrays_as_views_of_the_flat_buffer(shapes, seed):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(shape) for shape in shapes]
    flat = flatten(arrays)
    assert flat.shape == (sum(a.size for a in arrays),)
    views = unflatten(flat, shapes)
    for view, array in zip(views, arrays):
        assert view.shape == array.shape and np.array_equal(view, array) and np.shares_memory(view, flat)


# ---- serial: bad input, CLI and bench ----

def test_a_batch_that_dp_does_not_divide_is_a_clear_error():
    assert validate(TrainConfig(batch_size=10, dp=4), 4) == ["--batch-size 10 is not divisible by dp=4"]
    assert validate(TrainConfig(batch_size=10), 4) == ["--batch-size 10 is not divisible by dp=4"]


def test_bad_batch_size_ends_every_rank_with_one_line_and_exit_2():
    command = [mpiexec(), "-n", "2", sys.executable, "-m", "minipar", "train", "--batch-size", "7"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MPIEXEC_TIMEOUT": "60"})
    assert done.returncode == 2
    line = "minipar train: error: --batch-size 7 is not divisible by dp=2"
    # one line from each rank (mpiexec may interleave the two ranks' writes, so count rather than split)
    assert done.stderr.count(line) == 2 and not done.stderr.replace(line, "").strip()
    assert "Traceback" not in done.stdout


@mpi_given(max_examples=8,
           model=st.sampled_from(["gpt", "mlp"]),
           per_microbatch=st.integers(1, 2),
           microbatches=st.integers(1, 3),
           bucket_mb=st.sampled_from([1e-6, 2e-3, 0.02, 1.0]),
           optimizer=st.sampled_from(["adamw", "sgd"]),
           seed=st.integers(0, 2**16))
def test_ddp_trains_to_the_single_process_losses_and_weights(comm, model, per_microbatch, microbatches,
                                                             bucket_mb, optimizer, seed):
    cfg = tiny(model=model, dp=comm.size, batch_size=comm.size * microbatches * per_microbatch,
               microbatches=microbatches, bucket_mb=bucket_mb, optimizer=optimizer, seed=seed, steps=3)
    trainer = train.Trainer(cfg, comm.mpi)
    records = trainer.run()
    full = trainer.full_state()
    assert isinstance(trainer.engine.updater, DistributedDataParallel)
    if comm.rank == 0:
        losses, reference = train.reference_run(cfg)
        np.testing.assert_allclose([r["loss"] for r in records], losses, rtol=1e-9, atol=0)
        for name, (_, want) in reference.items():
            # atol: entries that sit near zero (biases barely moved from their zero start) carry
            # roundoff that no relative tolerance can compare.
            np.testing.assert_allclose(full[name], want, rtol=1e-9, atol=1e-12, err_msg=name)


@mpi_given(max_examples=6,
           bucket_mb=st.sampled_from([1e-6, 3e-3, 0.02, 1.0]),
           microbatches=st.sampled_from([1, 2, 4]),
           precision=st.sampled_from(["fp64", "fp32"]))
def test_each_step_sends_the_ring_all_reduce_of_the_gradient_bytes(comm, bucket_mb, microbatches, precision):
    n = comm.size
    trainer = train.Trainer(tiny(dp=n, batch_size=4 * n, microbatches=microbatches, bucket_mb=bucket_mb,
                                 precision=precision), comm.mpi)
    records = trainer.run()
    grad = gradient_bytes(trainer.engine.model)
    itemsize = 8 if precision == "fp64" else 4
    buckets = len(trainer.engine.updater.buckets)
    for record in records:
        sent = record["comm"]["sent_bytes"]
        assert record["comm"]["by_op"] == {"all_reduce": sent} and record["comm"]["by_dim"] == {"dp": sent}
        assert record["comm"]["messages"] == 2 * (n - 1) * buckets
        # Each bucket's ring cuts it into n shards; when n does not divide it a rank sends up to one
        # element more or less than 2(n-1)/n of it, and the ranks together exactly 2(n-1) times it.
        assert abs(sent - 2 * (n - 1) * grad / n) < 2 * itemsize * buckets
    every_rank = comm.allgather_obj([r["comm"]["sent_bytes"] for r in records])
    assert [sum(step) for step in zip(*every_rank)] == [2 * (n - 1) * grad] * len(records)


@mpi_test
def test_one_bucket_sends_exactly_two_n_minus_one_over_n_of_the_gradient_bytes(comm):
    n = comm.size
    trainer = train.Trainer(tiny(dp=n, bucket_mb=1.0), comm.mpi)
    grad = gradient_bytes(trainer.engine.model)
    assert (grad // 8) % 8 == 0, "pick a model whose parameter count 2, 4 and 8 divide"
    assert grad < 2**20 and len(trainer.engine.updater.buckets) == 1
    for record in trainer.run():
        assert record["comm"]["sent_bytes"] == 2 * (n - 1) * grad // n
        assert record["comm"]["messages"] == 2 * (n - 1)


@mpi_test
def test_the_ledger_shows_the_bucket_count_and_accumulation_does_not_add_messages(comm):
    n = comm.size

    def step_traffic(bucket_mb, microbatches):
        cfg = tiny(dp=n, batch_size=4 * n, bucket_mb=bucket_mb, microbatches=microbatches, steps=1)
        return train.Trainer(cfg, comm.mpi).run()[0]["comm"]

    n_params = len(build.build_model(tiny(), None).parameters())
    one_per_parameter = step_traffic(1e-6, 1)
    assert one_per_parameter["messages"] == 2 * (n - 1) * n_params
    whole = step_traffic(1.0, 1)
    assert whole["messages"] == 2 * (n - 1)
    for microbatches in (2, 4):
        accumulated = step_traffic(1.0, microbatches)
        assert accumulated["messages"] == whole["messages"]
        assert accumulated["sent_bytes"] == whole["sent_bytes"]


@mpi_test
def test_replicas_that_start_apart_are_refused_on_every_rank(comm):
    cfg = tiny(dp=comm.size)
    grid = ProcessGrid(comm, comm.size, 1, 1)
    model = build.build_model(cfg, grid)
    if comm.rank == comm.size - 1:
        weight = dict(model.named_parameters())["blocks.1.mlp.fc.weight"]
        weight.data[3, 2] = np.nextafter(weight.data[3, 2], np.inf)  # one bit in one weight
    with pytest.raises(RuntimeError, match=f"dp rank {comm.size - 1} differs from dp rank 0 in "
                                           "blocks.1.mlp.fc.weight$"):
        DistributedDataParallel(model, optim.SGD(model.parameters()), grid.dp, cfg.bucket_mb)
