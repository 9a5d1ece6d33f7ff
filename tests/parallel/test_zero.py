"""ZeRO stages 1-3: the single-process numbers, the planner's bytes, and the ring's traffic, exactly.

    pytest -m "not mpi" tests/parallel/test_zero.py                       # padding, one rank, the hooks
    mpiexec -n K python -m pytest -m mpi tests/parallel/test_zero.py       # K = 2, 4, 8: dp = K
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_harness import mpi_given, mpi_test, needs_world_size

from minipar.core import nn, optim
from minipar.core.autograd import Tensor
from minipar.core.shards import padded_numel
from minipar.memory import planner
from minipar.memory.ledger import buffer_meter
from minipar.parallel.ddp import DistributedDataParallel
from minipar.parallel.zero import ZeroStage1, ZeroStage2
from minipar.parallel.zero3 import ZeroStage3
from minipar.trainer import build
from minipar.trainer import loop as train
from minipar.trainer.config import TrainConfig

ADAM_FP64 = {"k": 16, "param_bytes": 8, "grad_bytes": 8}  # minipar's own bytes: fp64, Adam's two moments
STAGE_CLASS = {0: DistributedDataParallel, 1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}


def tiny(**changes) -> TrainConfig:
    """A GPT small enough that 8 ranks on 2 cores train it in a blink; 3 heads of 3 make every unit's
    parameter count odd (the embedding has 21·9 = 189), so no dp > 1 divides it: shards are padded."""
    base = TrainConfig(model="gpt", precision="fp64", n_layer=2, n_head=3, d_model=9, seq_len=8,
                       batch_size=8, steps=2, quiet=True)
    return base.replace(**changes)


def unit_sizes(cfg) -> list[int]:
    """Parameters per unit of the full model, counted on a model ZeRO never touched."""
    model = build.build_model(cfg.replace(dp=1, zero=0), None)
    return [sum(p.size for p in module.parameters()) for _, module in model.units()]


def assert_matches_reference(cfg, records, full):
    losses, reference = train.reference_run(cfg)
    np.testing.assert_allclose([r["loss"] for r in records], losses, rtol=1e-9, atol=0)
    for name, (_, want) in reference.items():
        # atol: entries that sit near zero (biases barely moved from their zero start) carry
        # roundoff that no relative tolerance can compare
        np.testing.assert_allclose(full[name], want, rtol=1e-9, atol=1e-12, err_msg=name)


# ---- serial ----

@given(numel=st.integers(0, 10_000), parts=st.integers(1, 64))
def test_padding_gives_every_rank_an_equal_shard_and_wastes_less_than_one_element_each(numel, parts):
    padded = padded_numel(numel, parts)
    assert padded % parts == 0 and numel <= padded < numel + parts


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_rank_trains_to_the_reference_and_holds_the_formulas_bytes(stage):
    cfg = tiny(dp=1, zero=stage, microbatches=2, batch_size=4, steps=2)
    trainer = train.Trainer(cfg, MPI.COMM_SELF)
    records = trainer.run()
    assert isinstance(trainer.engine.updater, STAGE_CLASS[stage])
    assert_matches_reference(cfg, records, trainer.full_state())
    mem = records[-1]["mem"]
    formula = planner.model_state_bytes(sum(unit_sizes(cfg)), 1, stage, **ADAM_FP64)
    assert mem["params"] + mem["grads"] + mem["optimizer"] == formula


def test_stage3_frees_every_parameter_outside_its_units_forward_and_backward():
    trainer = train.Trainer(tiny(dp=1, zero=3, steps=1), MPI.COMM_SELF)
    params = trainer.engine.model.parameters()
    assert all(p.data.size == 0 for p in params)
    trainer.run()
    assert all(p.data.size == 0 and p.grad is None for p in params)
    model = trainer.engine.model
    logits = model(trainer.task.global_batch(0, 2)[0])  # any forward gathers and frees unit by unit
    assert logits.shape == (2, 8, 13) and all(p.data.size == 0 for p in params)


# ---- multi-rank: dp = world size ----

@mpi_given(max_examples=10,
           stage=st.sampled_from([1, 2, 3]),
           model=st.sampled_from(["gpt", "mlp"]),
           heads=st.sampled_from([(3, 3), (2, 4), (4, 4)]),
           microbatches=st.integers(1, 2),
           optimizer=st.sampled_from(["adamw", "sgd"]),
           weight_decay=st.sampled_from([0.0, 0.1]),
           seed=st.integers(0, 2**16))
def test_zero_trains_to_the_single_process_losses_and_weights(comm, stage, model, heads, microbatches,
                                                              optimizer, weight_decay, seed):
    n_head, head_dim = heads
    cfg = tiny(model=model, n_head=n_head, d_model=n_head * head_dim, dp=comm.size, zero=stage,
               batch_size=comm.size * microbatches, microbatches=microbatches, optimizer=optimizer,
               weight_decay=weight_decay, seed=seed, steps=3)
    trainer = train.Trainer(cfg, comm.mpi)
    records = trainer.run()
    full = trainer.full_state()
    assert isinstance(trainer.engine.updater, STAGE_CLASS[stage])
    if comm.rank == 0:
        assert_matches_reference(cfg, records, full)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@mpi_test
def test_model_state_bytes_per_rank_are_the_planners_formula(comm, stage):
    n = comm.size
    cfg = tiny(dp=n, zero=stage, batch_size=2 * n, steps=1)
    mem = train.Trainer(cfg, comm.mpi).run()[0]["mem"]
    sizes = unit_sizes(cfg)
    formula = planner.model_state_bytes(sum(sizes), n, stage, **ADAM_FP64)
    measured = mem["params"] + mem["grads"] + mem["optimizer"]
    assert abs(measured - formula) <= 0.02 * formula
    # and exactly: what the formula leaves out is the padding, fewer than n elements per unit
    whole, shard = sum(sizes), sum(padded_numel(s, n) for s in sizes) // n
    itemsize = 8
    expected = {0: (whole, whole, 2 * whole), 1: (shard * n, whole, 2 * shard),
                2: (shard * n, shard, 2 * shard), 3: (shard, shard, 2 * shard)}[stage]
    assert (mem["params"], mem["grads"], mem["optimizer"]) == tuple(itemsize * e for e in expected)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@mpi_test
def test_bytes_per_step_are_two_or_three_times_n_minus_one_over_n_of_the_model(comm, stage):
    n = comm.size
    cfg = tiny(dp=n, zero=stage, batch_size=2 * n, steps=2, bucket_mb=1.0)
    records = train.Trainer(cfg, comm.mpi).run()
    sizes = unit_sizes(cfg)
    psi, padded = sum(sizes), sum(padded_numel(s, n) for s in sizes)
    passes = 3 if stage == 3 else 2  # stage 3 gathers the parameters twice: forward and backward
    for record in records:
        traffic = record["comm"]
        sent = traffic["sent_bytes"]
        assert traffic["by_dim"] == {"dp": sent}
        if stage == 0:  # one bucket, all-reduced by the ring (uneven chunks: the ranks add up exactly)
            assert traffic["by_op"] == {"all_reduce": sent} and traffic["messages"] == 2 * (n - 1)
            assert sum(comm.allgather_obj(sent)) == passes * (n - 1) * psi * 8
            continue
        # every unit: one reduce-scatter, and one (stages 1, 2) or two (stage 3) all-gathers
        assert traffic["by_op"] == {"reduce_scatter": sent // passes, "all_gather": sent - sent // passes}
        assert traffic["messages"] == passes * (n - 1) * len(sizes)
        assert sent == passes * (n - 1) * padded // n * 8
        assert padded - psi < n * len(sizes)


@mpi_test
def test_stage3_sends_one_and_a_half_times_stage1(comm):
    n = comm.size
    sent = {stage: train.Trainer(tiny(dp=n, zero=stage, batch_size=2 * n, steps=1), comm.mpi).run()[0]
            ["comm"]["sent_bytes"] for stage in (1, 3)}
    assert 2 * sent[3] == 3 * sent[1]


@pytest.mark.parametrize("stage", [2, 3])
@mpi_test
def test_stages_2_and_3_hold_one_units_full_gradients_at_a_time(comm, stage):
    n = comm.size
    # without ZeRO-3's prefetch, which holds a second unit (tests/parallel/test_overlap.py)
    cfg = tiny(dp=n, zero=stage, batch_size=2 * n, steps=1, no_overlap=True)
    trainer = train.Trainer(cfg, comm.mpi)
    mem = trainer.run()[0]["mem"]
    assert all(p.grad is None for p in trainer.engine.model.parameters())
    sizes = unit_sizes(cfg)
    # at a unit's reduce-scatter: its gradients, their padded flat copy, and (stage 3) its gathered
    # parameters; every other unit is down to its shards
    held = [s + padded_numel(s, n) + (padded_numel(s, n) if stage == 3 else 0) for s in sizes]
    assert mem["buffers_peak"] == 8 * max(held)
    assert buffer_meter.current == 0  # and all of it released by the end of the step


@mpi_test
def test_stage3_gathered_buffers_are_dead_after_release_and_the_meter_saw_each(comm, monkeypatch):
    """Memory from the live buffers, not from what the code reports: every buffer all_gather returns to
    ZeRO-3 is watched by a weak reference, which must be dead after the step (a unit's release dropped
    the last reference; a list that keeps them is a leak the meter cannot see); and buffer_meter must
    grow by the buffer's bytes when a unit is gathered and shrink by them when it is released."""
    import gc
    import weakref

    from minipar.distributed.communicator import Comm

    n = comm.size
    watched, wrong = [], []
    real_gather = Comm.all_gather
    real_gather_params, real_release_params = ZeroStage3.gather_params, ZeroStage3.release_params

    def watched_gather(self, shard, numel=None, counts=None):
        flat = real_gather(self, shard, numel, counts)
        watched.append(weakref.ref(flat))
        return flat

    def metered(real, sign):
        def call(self, unit):
            was_whole, before = unit.flat is not None, buffer_meter.current
            real(self, unit)
            is_whole = unit.flat is not None
            if was_whole != is_whole:
                nbytes = unit.flat.nbytes if is_whole else unit.padded * unit.dtype.itemsize
                if buffer_meter.current - before != sign * nbytes:
                    wrong.append(f"{real.__name__}: buffer_meter moved by {buffer_meter.current - before}, "
                                 f"the buffer has {sign * nbytes}")
        return call

    monkeypatch.setattr(Comm, "all_gather", watched_gather)
    monkeypatch.setattr(ZeroStage3, "gather_params", metered(real_gather_params, +1))
    monkeypatch.setattr(ZeroStage3, "release_params", metered(real_release_params, -1))
    cfg = tiny(dp=n, zero=3, batch_size=2 * n, steps=2, no_overlap=True)  # no prefetch: every gather here
    trainer = train.Trainer(cfg, comm.mpi)
    trainer.run()
    gc.collect()
    units = len(unit_sizes(cfg))
    alive = sum(ref() is not None for ref in watched)
    gathers = len(watched)
    assert gathers >= 2 * units * cfg.steps, f"{gathers} all-gathers for {units} units in {cfg.steps} steps"
    assert alive == 0, f"{alive} gathered buffer(s) still alive after the step: released, but referred to"
    assert wrong == [], wrong[:3]
    assert buffer_meter.current == 0, f"buffer_meter holds {buffer_meter.current} bytes after the step"


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("layout", [{"pp": 2, "microbatches": 2}, {"tp": 2, "n_head": 2, "d_model": 10}])
@needs_world_size(4, 8)
@mpi_test
def test_zero_composes_with_pipeline_and_tensor_parallelism(comm, stage, layout):
    """ZeRO shards whatever parameters this rank's model holds, over its data-parallel group."""
    dp = comm.size // 2
    cfg = tiny(dp=dp, zero=stage, batch_size=2 * dp, steps=2, **layout)
    trainer = train.Trainer(cfg, comm.mpi)
    records = trainer.run()
    full = trainer.full_state()
    if comm.rank == 0:
        assert_matches_reference(cfg, records, full)


# ---- the step's own methods (lesson 04's excerpts), called one by one on a small MLP ----

LR = 0.5


def small_mlp():
    """3 layers of 3·5+5 = 20, 5·5+5 = 30 and 5·2+2 = 12 parameters: at dp 4 the first unit is padded."""
    return nn.MLPNet(nn.MLPConfig(d_in=3, d_hidden=5, d_out=2, n_layer=3), seed=3)


def rank_grads(model, rank: int, microbatch: int = 0) -> dict:
    """The gradient rank `rank` would hold for each parameter: a draw every rank can repeat."""
    return {name: np.random.default_rng([rank, microbatch, i]).normal(size=p.data.shape)
            for i, (name, p) in enumerate(model.named_parameters())}


def set_grads(model, grads: dict) -> None:
    for name, p in model.named_parameters():
        p.grad = grads[name].copy()


def sgd_on_the_summed_gradients(start: dict, n: int, microbatches: int) -> dict:
    """SGD by hand: each parameter minus LR times the sum over ranks and micro-batches."""
    probe = small_mlp()
    draws = [rank_grads(probe, r, m) for r in range(n) for m in range(microbatches)]
    return {name: start[name] - LR * sum(grads[name] for grads in draws) for name in start}


@mpi_test
def test_zero1_step_methods_update_every_parameter_with_the_summed_gradient(comm):
    """ZeroStage1's synchronize_gradients (reduce-scatter), apply_optimizer (update this rank's shard,
    then all_gather_params): afterwards every rank holds every parameter, each moved by the sum of the
    ranks' gradients, as SGD written by hand moves it."""
    model = small_mlp()
    start = {name: p.data.copy() for name, p in model.named_parameters()}
    updater = ZeroStage1(model, optim.SGD(model.parameters(), lr=LR), comm)
    set_grads(model, rank_grads(model, comm.rank))
    updater.synchronize_gradients()
    updater.apply_optimizer()
    updater.release_gradients()
    for name, want in sgd_on_the_summed_gradients(start, comm.size, 1).items():
        np.testing.assert_allclose(dict(model.named_parameters())[name].data, want, rtol=1e-13, atol=1e-15,
                                   err_msg=name)


@mpi_test
def test_zero2_reduce_scatter_grads_adds_each_micro_batch_and_release_starts_the_next_step_afresh(comm):
    """ZeroStage2: a unit's reduce_scatter_grads (what its backward hook calls) adds to this rank's
    shard and drops the full gradients; synchronize_gradients sends what no hook sent; two micro-batches
    sum. After release_gradients, a second step moves the parameters by its own gradients only."""
    model = small_mlp()
    start = {name: p.data.copy() for name, p in model.named_parameters()}
    updater = ZeroStage2(model, optim.SGD(model.parameters(), lr=LR), comm)
    set_grads(model, rank_grads(model, comm.rank, 0))
    for unit in updater.units:
        updater.reduce_scatter_grads(unit)
    assert all(p.grad is None for p in model.parameters())
    set_grads(model, rank_grads(model, comm.rank, 1))
    updater.synchronize_gradients()
    updater.apply_optimizer()
    updater.release_gradients()
    after_one = sgd_on_the_summed_gradients(start, comm.size, 2)
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.data, after_one[name], rtol=1e-13, atol=1e-15, err_msg=name)
    set_grads(model, rank_grads(model, comm.rank, 0))
    updater.synchronize_gradients()
    updater.apply_optimizer()
    after_two = sgd_on_the_summed_gradients(after_one, comm.size, 1)
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.data, after_two[name], rtol=1e-13, atol=1e-15, err_msg=name)


@mpi_test
def test_zero2_hook_unit_sends_each_unit_as_backward_leaves_it_but_the_first(comm):
    """ZeroStage2.hook_unit: after a backward, every unit but the first (its input, the data, needs no
    gradient) has sent its gradients and holds none; the step then equals SGD on the gradients of a
    plain copy of the model, summed over the ranks' inputs by hand."""
    model, plain = small_mlp(), small_mlp()
    start = {name: p.data.copy() for name, p in model.named_parameters()}
    inputs = [np.random.default_rng(100 + r).normal(size=(4, 3)) for r in range(comm.size)]
    targets = [np.random.default_rng(200 + r).normal(size=(4, 2)) for r in range(comm.size)]
    updater = ZeroStage2(model, optim.SGD(model.parameters(), lr=LR), comm)
    model.loss(model(Tensor(inputs[comm.rank])), targets[comm.rank], 4 * comm.size).backward()
    held = [all(p.grad is not None for p in unit.params) for unit in updater.units]
    assert held == [True, False, False], held
    updater.synchronize_gradients()
    updater.apply_optimizer()
    for x, y in zip(inputs, targets):  # every rank's backward, on one process: the gradients add up
        plain.loss(plain(Tensor(x)), y, 4 * comm.size).backward()
    for name, p in plain.named_parameters():
        np.testing.assert_allclose(dict(model.named_parameters())[name].data, start[name] - LR * p.grad,
                                   rtol=1e-12, atol=1e-15, err_msg=name)


@mpi_test
def test_zero3_hooks_make_a_unit_whole_only_for_its_forward_and_its_backward(comm):
    """ZeroStage3.hook_unit's gather_for_forward, release_after_forward, gather_for_backward and its
    reduce_scatter_grads (lesson 04's excerpt), without prefetch: hooks registered after ZeRO's see,
    at each unit's forward and backward, that unit's parameters whole and every other unit's empty;
    after the forward nothing is whole, after the backward only the first unit (its gradients wait
    for the step). The step equals SGD on a plain copy's gradients summed over every rank's input,
    read from the parameters the next forward gathers."""
    model, plain = small_mlp(), small_mlp()
    start = {name: p.data.copy() for name, p in model.named_parameters()}
    inputs = [np.random.default_rng(100 + r).normal(size=(4, 3)) for r in range(comm.size)]
    targets = [np.random.default_rng(200 + r).normal(size=(4, 2)) for r in range(comm.size)]
    updater = ZeroStage3(model, optim.SGD(model.parameters(), lr=LR), comm, prefetch=False)
    units = [unit.parameters() for _, unit in model.units()]

    def whole():
        return [all(p.data.size > 0 for p in params) for params in units]

    seen, gathered = [], {}
    for i, (_, unit) in enumerate(model.units()):
        def at_forward(module, args, i=i):
            seen.append(("forward", i, whole()))
            gathered.update({id(p): p.data.copy() for p in module.parameters()})
        unit.register_forward_pre_hook(at_forward)
        unit.register_full_backward_pre_hook(lambda module, i=i: seen.append(("backward", i, whole())))
    loss = model.loss(model(Tensor(inputs[comm.rank])), targets[comm.rank], 4 * comm.size)
    assert whole() == [False, False, False]
    loss.backward()
    assert whole() == [True, False, False]
    only = [[j == i for j in range(3)] for i in range(3)]
    assert seen == [("forward", i, only[i]) for i in range(3)] + [("backward", i, only[i]) for i in (2, 1, 0)]
    updater.synchronize_gradients()
    assert whole() == [False, False, False]
    updater.apply_optimizer()
    for x, y in zip(inputs, targets):
        plain.loss(plain(Tensor(x)), y, 4 * comm.size).backward()
    model(Tensor(inputs[0]))  # gathers each unit in turn: at_forward copies what the step made
    for (name, p), (_, ref) in zip(model.named_parameters(), plain.named_parameters()):
        np.testing.assert_allclose(gathered[id(p)], start[name] - LR * ref.grad, rtol=1e-12, atol=1e-15,
                                   err_msg=name)
