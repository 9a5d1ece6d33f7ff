"""Overlap: DDP's all-reduces start in backward and change nothing but the waiting.

    pytest -m "not mpi" tests/parallel/test_overlap.py                      # the watched wait, the option
    mpiexec -n K python -m pytest -m mpi tests/parallel/test_overlap.py      # K = 2, 4: dp = K
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_harness import at_world_size, mpi_given, mpi_test

from minipar.core import nn, optim
from minipar.core.autograd import Tensor
from minipar.core.shards import padded_numel
from minipar.distributed import watchdog
from minipar.distributed.communicator import Comm
from minipar.memory.ledger import buffer_meter
from minipar.memory.offload import MiB
from minipar.parallel.ddp import DistributedDataParallel
from minipar.trainer import build
from minipar.trainer import loop as train
from minipar.trainer.config import TrainConfig
from minipar.trainer.tasks import local_slice


def tiny(**changes) -> TrainConfig:
    base = TrainConfig(model="gpt", precision="fp64", n_layer=2, n_head=2, d_model=16, seq_len=8,
                       batch_size=8, steps=2, quiet=True)
    return base.replace(**changes)


# ---- serial ----


def test_a_non_blocking_all_reduce_is_charged_at_once_and_its_wait_is_watched():
    comm = Comm(MPI.COMM_SELF.Dup(), name="dp")
    seen = []
    pending = comm.iall_reduce(np.arange(4.0))
    request = pending.request

    class Spy:  # the real request, looked at while its Wait runs
        def Wait(self):
            seen.append(watchdog.WATCHDOG.current)
            request.Wait()

    pending.request = Spy()
    before = comm.ledger.step_wait_s
    np.testing.assert_array_equal(pending.wait(), np.arange(4.0))
    assert seen[0] is not None and seen[0][:2] == ("all_reduce", "dp")
    assert watchdog.WATCHDOG.current is None
    assert comm.ledger.step_wait_s > before
    # one rank sends nothing, but the call is counted as an all-reduce like the blocking one
    assert comm.ledger.step_report()["by_op"] == {"all_reduce": 0}


def test_overlap_is_the_default_and_no_overlap_is_a_layout_option_the_reference_ignores():
    assert TrainConfig().no_overlap is False
    assert tiny(no_overlap=True).single_process().no_overlap is True  # no layout: the same arithmetic


# ---- mpi ----


# written out: overlap with accumulation (a bucket must wait for the last micro-batch), on both models
OVERLAPPED_ACCUMULATION = [at_world_size((2, 4), model=model, microbatches=3, bucket_mb=2e-3,
                                         no_overlap=False, recompute=recompute, seed=5)
                           for model, recompute in (("gpt", "full"), ("mlp", "none"))]


@mpi_given(max_examples=3, examples=OVERLAPPED_ACCUMULATION,
           model=st.sampled_from(["gpt", "mlp"]),
           microbatches=st.integers(1, 3),
           bucket_mb=st.sampled_from([1e-6, 2e-3, 1.0]),
           no_overlap=st.booleans(),
           recompute=st.sampled_from(["none", "full"]),
           seed=st.integers(0, 2**16))
def test_with_and_without_overlap_ddp_trains_to_the_single_process_result(
        comm, model, microbatches, bucket_mb, no_overlap, recompute, seed):
    cfg = tiny(model=model, dp=comm.size, batch_size=comm.size * microbatches, microbatches=microbatches,
               bucket_mb=bucket_mb, no_overlap=no_overlap, recompute=recompute, seed=seed, steps=3)
    trainer = train.Trainer(cfg, comm.mpi)
    records = trainer.run()
    full = trainer.full_state()
    if comm.rank == 0:
        losses, reference = train.reference_run(cfg)
        np.testing.assert_allclose([r["loss"] for r in records], losses, rtol=1e-9, atol=0)
        for name, (_, want) in reference.items():
            np.testing.assert_allclose(full[name], want, rtol=1e-9, atol=1e-12, err_msg=name)


def buckets_outside_the_first_unit(model, buckets) -> int:
    """The buckets backward can start: every unit's hook fires but the first one's (token ids or the
    input batch need no gradient, so its backward hook never runs)."""
    first = {id(p) for p in model.units()[0][1].parameters()}
    return sum(not any(id(p) in first for p in bucket) for bucket in buckets)


@mpi_test
def test_every_bucket_outside_the_first_unit_starts_in_backward_and_the_bytes_do_not_change(comm):
    n = comm.size
    runs = {}
    for no_overlap in (False, True):
        cfg = tiny(dp=n, batch_size=2 * n, microbatches=2, bucket_mb=1e-6, no_overlap=no_overlap)
        trainer = train.Trainer(cfg, comm.mpi)
        runs[no_overlap] = trainer.run()
        updater = trainer.engine.updater
        assert isinstance(updater, DistributedDataParallel) and updater.overlap is not no_overlap
        early = buckets_outside_the_first_unit(trainer.engine.model, updater.buckets)
        assert early > 0 and updater.started_in_backward == (0 if no_overlap else early)
    for overlapped, blocking in zip(runs[False], runs[True]):
        assert overlapped["comm"] == blocking["comm"]  # same bytes, messages, links
        for record in (overlapped, blocking):
            assert 0 <= record["comm_wait_s"] <= record["time_s"]


@mpi_test
def test_a_gradient_that_grows_after_its_bucket_started_is_still_summed_whole(comm):
    """A parameter used again after its unit's last backward (no model here does; a new one might)
    adds to a gradient whose all-reduce has started: the step must sum that part too."""
    n = comm.size
    summed = {}
    for no_overlap in (False, True):
        cfg = tiny(dp=n, batch_size=n, bucket_mb=1e-6, steps=1, no_overlap=no_overlap)
        trainer = train.Trainer(cfg, comm.mpi)
        engine, updater = trainer.engine, trainer.engine.updater
        inputs, targets = trainer.task.global_batch(0, cfg.batch_size)
        mine = local_slice(len(inputs), n, comm.rank)
        engine.model.zero_grad()
        engine.runner.forward_backward(inputs[mine], targets[mine], engine.normaliser(targets))
        head = engine.model.units()[-1][1].parameters()[0]
        late = np.full(head.shape, comm.rank + 1.0)
        head.grad = late if head.grad is None else head.grad + late  # None: its all-reduce took it
        if no_overlap:
            updater.all_reduce_gradients()
        else:
            assert updater.in_flight, "the head's bucket should be in flight"
            updater.finish_overlapped()
        summed[no_overlap] = {name: p.grad.copy() for name, p in engine.model.named_parameters()}
    for name, want in summed[True].items():
        np.testing.assert_allclose(summed[False][name], want, rtol=1e-12, atol=1e-15, err_msg=name)


@mpi_test
def test_a_late_gradient_on_one_parameter_of_a_shared_bucket_is_summed_too(comm):
    """The same with the head's three parameters (ln_f's weight and bias, lm_head's weight) in one
    bucket, exactly their bytes, and only ln_f's weight growing after the bucket started: the others'
    gradients went into the flat copy, so "any gradient grew" differs from "all grew" here, and the
    step must sum the late part. Expected: the all-reduce of the hook-made gradients plus sum over
    ranks of rank + 1, written out here; the blocking run gives the same."""
    n = comm.size
    head_bytes = sum(p.data.nbytes for p in build.build_model(tiny(), None).units()[-1][1].parameters())
    summed = {}
    for no_overlap in (False, True):
        cfg = tiny(dp=n, batch_size=n, bucket_mb=head_bytes / MiB, steps=1, no_overlap=no_overlap)
        trainer = train.Trainer(cfg, comm.mpi)
        engine, updater = trainer.engine, trainer.engine.updater
        head = engine.model.units()[-1][1]
        assert len(updater.buckets[0]) == 3 and {id(p) for p in updater.buckets[0]} == \
            {id(p) for p in head.parameters()}
        inputs, targets = trainer.task.global_batch(0, cfg.batch_size)
        mine = local_slice(len(inputs), n, comm.rank)
        engine.model.zero_grad()
        engine.runner.forward_backward(inputs[mine], targets[mine], engine.normaliser(targets))
        weight = head.ln_f.weight
        late = np.full(weight.shape, comm.rank + 1.0)
        if no_overlap:
            hook_made = comm.mpi.allreduce(weight.grad)
            weight.grad = weight.grad + late
            updater.all_reduce_gradients()
            np.testing.assert_allclose(weight.grad, hook_made + n * (n + 1) / 2, rtol=1e-12)
        else:
            assert 0 in updater.in_flight and all(p.grad is None for p in head.parameters())
            weight.grad = late  # the bucket's all-reduce took all three; only this one grows
            updater.finish_overlapped()
        summed[no_overlap] = {name: p.grad.copy() for name, p in engine.model.named_parameters()}
    for name, want in summed[True].items():
        np.testing.assert_allclose(summed[False][name], want, rtol=1e-12, atol=1e-15, err_msg=name)


@mpi_test
def test_ddp_unit_done_hook_starts_a_bucket_once_every_unit_in_it_has_had_its_last_micro_batch(comm):
    """unit_done_hook and start_ready_buckets (lesson 03's excerpt) on a 3-layer MLP, 2 micro-batches,
    buckets of at most 40 values: [layers.2's 12, layers.1's bias 5], [layers.1's weight 25,
    layers.0's bias 5], [layers.0's weight 15] (parameters last first). A bucket starts only when each
    of its units has seen its 2nd backward: none after the first micro-batch, only bucket 0 after the
    second (bucket 1 waits for layers.0, whose input needs no gradient: finish_overlapped sums it). The
    sums equal a plain copy's gradients over every rank's micro-batches, and a second step starts
    its count afresh."""
    model, plain = (nn.MLPNet(nn.MLPConfig(d_in=3, d_hidden=5, d_out=2, n_layer=3), seed=3) for _ in range(2))
    updater = DistributedDataParallel(model, optim.SGD(model.parameters()), comm, bucket_mb=40 * 8 / MiB,
                                      overlap=True, microbatches=2)
    assert [len(b) for b in updater.buckets] == [3, 2, 1]
    batches = [[(np.random.default_rng([r, m, 1]).normal(size=(2, 3)),
                 np.random.default_rng([r, m, 2]).normal(size=(2, 2))) for m in range(2)]
               for r in range(comm.size)]
    for x, y in (batch for rank in batches for batch in rank):
        plain.loss(plain(Tensor(x)), y, 4).backward()
    for step in range(2):
        model.zero_grad()
        for m, (x, y) in enumerate(batches[comm.rank]):
            model.loss(model(Tensor(x)), y, 4).backward()
            assert sorted(updater.in_flight) == ([] if m == 0 else [0]), (step, m, sorted(updater.in_flight))
        updater.synchronize_gradients()
        assert updater.started_in_backward == 1
        for (name, p), (_, want) in zip(model.named_parameters(), plain.named_parameters()):
            np.testing.assert_allclose(p.grad, want.grad, rtol=1e-12, atol=1e-15, err_msg=f"{step}: {name}")


# ---- ZeRO-3's prefetch ----


def unit_sizes(cfg) -> list[int]:
    """Parameters per unit of the full model, counted on a model ZeRO never touched."""
    model = build.build_model(cfg.replace(dp=1, zero=0), None)
    return [sum(p.size for p in module.parameters()) for _, module in model.units()]


@mpi_test
def test_zero3_prefetch_sends_the_same_bytes_and_holds_the_previous_unit_beside_the_current(comm):
    n = comm.size
    runs = {}
    for no_overlap in (False, True):
        cfg = tiny(dp=n, zero=3, batch_size=2 * n, microbatches=2, steps=2, no_overlap=no_overlap)
        trainer = train.Trainer(cfg, comm.mpi)
        runs[no_overlap] = trainer.run()
        assert trainer.engine.updater.prefetch is not no_overlap and not trainer.engine.updater.prefetched
    for prefetched, plain in zip(runs[False], runs[True]):
        assert prefetched["comm"] == plain["comm"]  # every prefetched gather is used: no extra bytes
    pad = [padded_numel(s, n) for s in unit_sizes(cfg)]
    sizes = unit_sizes(cfg)
    # the peak is at a unit's reduce-scatter in backward: its gradients, their padded flat copy, its
    # gathered parameters, and those of the unit before it, whose gather its backward started
    # (the first unit's gradients are sent at the step, with nothing else whole)
    held = [sizes[0] + 2 * pad[0]] + [sizes[i] + 2 * pad[i] + pad[i - 1] for i in range(1, len(sizes))]
    assert runs[False][0]["mem"]["buffers_peak"] == 8 * max(held)
    assert buffer_meter.current == 0


class GatherCounter:
    """The updater's communicator, with each all-gather it is asked for written down in order:
    ("wait", numel) for a blocking one, ("start", numel) for a non-blocking one (a prefetch)."""

    def __init__(self, comm):
        self.comm, self.calls = comm, []

    def all_gather(self, shard, numel=None, counts=None):  # the unit's total, or every rank's share of it
        self.calls.append(("wait", numel if counts is None else sum(counts)))
        return self.comm.all_gather(shard, numel=numel, counts=counts)

    def iall_gather(self, shard, numel=None, counts=None):
        self.calls.append(("start", numel if counts is None else sum(counts)))
        return self.comm.iall_gather(shard, numel=numel, counts=counts)

    def __getattr__(self, name):  # everything else: the communicator itself
        return getattr(self.comm, name)


@mpi_test
def test_zero3_prefetch_starts_each_units_gather_one_unit_ahead_and_uses_every_one(comm):
    """With prefetch, forward waits only for the first unit and backward only for the last: every
    other unit's gather was started while its neighbour computed (the next one in forward, the one
    before in backward). Without it, every gather waits. Fetching the wrong unit (two ahead, or the
    current one) keeps values and bytes, but makes the gathers of this order wait."""
    n = comm.size
    for no_overlap in (False, True):
        cfg = tiny(dp=n, zero=3, batch_size=n, microbatches=1, steps=1, no_overlap=no_overlap)
        trainer = train.Trainer(cfg, comm.mpi)
        updater = trainer.engine.updater
        updater.comm = counter = GatherCounter(updater.comm)
        trainer.run()
        pad = [padded_numel(s, n) for s in unit_sizes(cfg)]  # units in execution order
        last = len(pad) - 1
        if no_overlap:  # each unit waits for its gather in forward, then again in backward
            expected = [("wait", p) for p in pad] + [("wait", p) for p in reversed(pad)]
        else:  # unit i's forward starts unit i+1's gather; unit i's backward starts unit i-1's
            expected = ([("wait", pad[0])] + [("start", p) for p in pad[1:]]
                        + [("wait", pad[last])] + [("start", p) for p in reversed(pad[:last])])
        assert counter.calls == expected, (no_overlap, counter.calls)
        assert not updater.prefetched  # every gather started was used by the unit it was for


@mpi_given(max_examples=2,
           examples=[at_world_size((2, 4), model="gpt", microbatches=2, recompute="full", seed=3)],
           model=st.sampled_from(["gpt", "mlp"]),
           microbatches=st.integers(1, 3),
           recompute=st.sampled_from(["none", "full"]),
           seed=st.integers(0, 2**16))
def test_zero3_with_prefetch_trains_to_the_single_process_result(comm, model, microbatches, recompute, seed):
    cfg = tiny(model=model, dp=comm.size, zero=3, batch_size=comm.size * microbatches,
               microbatches=microbatches, recompute=recompute, seed=seed, steps=3)
    trainer = train.Trainer(cfg, comm.mpi)
    records = trainer.run()
    full = trainer.full_state()
    if comm.rank == 0:
        losses, reference = train.reference_run(cfg)
        np.testing.assert_allclose([r["loss"] for r in records], losses, rtol=1e-9, atol=0)
        for name, (_, want) in reference.items():
            np.testing.assert_allclose(full[name], want, rtol=1e-9, atol=1e-12, err_msg=name)


# ---- pipeline receives posted early ----


@mpi_given(max_examples=2,
           examples=[at_world_size((2, 4), schedule="1f1b", microbatches=3, seed=1)],
           schedule=st.sampled_from(["gpipe", "1f1b"]),
           microbatches=st.integers(2, 4),
           seed=st.integers(0, 2**16))
def test_a_pipeline_with_receives_posted_early_trains_like_one_process_and_sends_the_same(
        comm, schedule, microbatches, seed):
    n = comm.size
    runs, early = {}, {}
    for no_overlap in (False, True):
        cfg = tiny(pp=n, dp=1, n_layer=max(2, n - 2), schedule=schedule, microbatches=microbatches,
                   batch_size=microbatches + 1, seed=seed, steps=2, no_overlap=no_overlap)  # uneven
        trainer = train.Trainer(cfg, comm.mpi)
        runs[no_overlap] = trainer.run()
        early[no_overlap] = comm.allreduce_obj(trainer.engine.runner.received_early)
        full = trainer.full_state()
        if comm.rank == 0:
            losses, reference = train.reference_run(cfg)
            np.testing.assert_allclose([r["loss"] for r in runs[no_overlap]], losses, rtol=1e-9, atol=0)
            for name, (_, want) in reference.items():
                np.testing.assert_allclose(full[name], want, rtol=1e-9, atol=1e-12, err_msg=name)
    # every message of the step (each of the n-1 boundaries is crossed by every micro-batch, forward
    # and back), but the one each stage s > 0 receives in its first action, F of micro-batch 0
    assert early[True] == 0 and early[False] == 2 * (n - 1) * microbatches - (n - 1)
    for posted, plain in zip(runs[False], runs[True]):
        assert posted["comm"] == plain["comm"]
