"""Mixed precision: 16-bit working weights, activations and gradients over fp32 master weights, fp16's
dynamic loss scaler in training, and DDP's 16-bit gradient wire.

    pytest -m "not mpi" tests/precision/test_mixed_precision.py
    mpiexec -n K python -m pytest -m mpi tests/precision/test_mixed_precision.py      # K = 2, 4, 8

Tolerances, measured (tiny models, 20 steps): bf16 and fp16 runs stay within 1% of the fp32 loss at
every step (seen: at most 0.09% for the GPT, 0.33% for the MLP); a bf16 run at dp = K within 1% of the
single-process bf16 run (the 16-bit ring rounds each partial sum, so they are not bit-identical).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_harness import mpi_given, mpi_test

from minipar.core.autograd import Function
from minipar.core.shards import shard_bounds
from minipar.distributed.communicator import Comm
from minipar.distributed.grid import ProcessGrid
from minipar.parallel.api import MicrobatchRunner
from minipar.parallel.ddp import flatten
from minipar.parallel.flat_units import check_replicas_identical
from minipar.precision import mixed as mixed_precision
from minipar.precision.formats import DynamicLossScaler, round_to_bf16, round_to_fp16
from minipar.trainer import build
from minipar.trainer import loop as train
from minipar.trainer.config import TrainConfig
from minipar.trainer.engine import Engine
from minipar.trainer.validate import validate

ROUND = {"bf16": round_to_bf16, "fp16": round_to_fp16}
TRACKING_RTOL = 1e-2


def tiny(**changes) -> TrainConfig:
    base = TrainConfig(model="gpt", precision="bf16", n_layer=2, n_head=2, d_model=16, seq_len=8,
                       batch_size=8, steps=3, quiet=True, dp=1)
    return base.replace(**changes)


def single_process_engine(cfg: TrainConfig, scaler=None, runner=None) -> Engine:
    """build.build_engine's parts on one process, with a chosen loss scaler or inner runner."""
    grid = ProcessGrid(Comm(MPI.COMM_SELF), 1, 1, 1)
    model = build.build_model(cfg, grid)
    inner = runner(model) if runner else build.build_runner(cfg, grid, model)
    updater = build.build_updater(cfg, grid, model, scaler)
    runner = mixed_precision.wrap_runner(cfg, model, inner, updater)
    return Engine(cfg, grid, model, runner, updater)


def representable(array, fmt) -> bool:
    return np.array_equal(ROUND[fmt](array), array, equal_nan=True)


def losses(cfg: TrainConfig) -> np.ndarray:
    return np.array([r["loss"] for r in train.train(cfg, MPI.COMM_SELF)])


# ---- serial: what crosses an op boundary is 16-bit; what accumulates is fp32 ----

class Spy(Function):
    """Identity that records the activation passing forward and the gradient passing back."""

    @staticmethod
    def forward(ctx, x, seen):
        ctx.seen = seen
        seen.append(("activation", x.copy()))
        return x

    @staticmethod
    def backward(ctx, grad):
        ctx.seen.append(("gradient", grad.copy()))
        return grad, None


class WeightSpyRunner(MicrobatchRunner):
    """The plain runner, noting the weights it is handed and spying on every unit's output."""

    def __init__(self, model, microbatches):
        super().__init__(model, microbatches)
        self.seen, self.weights = [], None
        for _, unit in model.units():
            unit.register_forward_hook(self.spy_on_output)

    def spy_on_output(self, unit, args, output):
        return Spy.apply(output, self.seen)

    def forward_backward(self, inputs, targets, normaliser, scored=None):
        self.weights = [p.data.copy() for p in self.model.parameters()]
        return super().forward_backward(inputs, targets, normaliser, scored)


@settings(max_examples=12, deadline=None)
@given(fmt=st.sampled_from(["bf16", "fp16"]), model=st.sampled_from(["gpt", "mlp"]),
       microbatches=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_weights_activations_and_gradients_are_16_bit_and_masters_come_back(fmt, model, microbatches, seed):
    cfg = tiny(precision=fmt, model=model, microbatches=microbatches, seed=seed)
    engine = single_process_engine(cfg, runner=lambda m: WeightSpyRunner(m, microbatches))
    spy = engine.runner.runner
    masters = [p.data for p in engine.model.parameters()]
    x, y = train.make_task(cfg).global_batch(0, cfg.batch_size)
    engine.runner.forward_backward(x, y, engine.normaliser(y))

    for master, working in zip(masters, spy.weights):
        assert master.dtype == np.float32
        np.testing.assert_array_equal(working, ROUND[fmt](master))
    assert {kind for kind, _ in spy.seen} == {"activation", "gradient"}
    assert all(representable(array, fmt) for _, array in spy.seen)
    assert all(p.data is master for p, master in zip(engine.model.parameters(), masters))
    assert all(p.grad.dtype == np.float32 for p in engine.model.parameters())


@settings(max_examples=8, deadline=None)
@given(fmt=st.sampled_from(["bf16", "fp16"]), model=st.sampled_from(["gpt", "mlp"]),
       seed=st.integers(0, 2**16))
def test_micro_batch_gradients_accumulate_in_fp32(fmt, model, seed):
    cfg = tiny(precision=fmt, model=model, seed=seed, loss_scaling=False)
    x, y = train.make_task(cfg).global_batch(0, cfg.batch_size)
    normaliser = single_process_engine(cfg).normaliser(y)
    both = single_process_engine(cfg.replace(microbatches=2))
    both.runner.forward_backward(x, y, normaliser)
    halves = []
    for part in (slice(0, 4), slice(4, 8)):
        one = single_process_engine(cfg)
        one.runner.forward_backward(x[part], y[part], normaliser)
        halves.append([p.grad for p in one.model.parameters()])
    accumulated = [p.grad for p in both.model.parameters()]
    for total, first, second in zip(accumulated, *halves):
        np.testing.assert_array_equal(total, first + second)  # summed in fp32, not rounded again
    assert not all(representable(g, fmt) for g in accumulated)


def test_the_optimizer_steps_the_fp32_masters_so_small_updates_are_kept():
    lr = 1e-5
    cfg = tiny(optimizer="sgd", lr=lr, steps=1)
    engine = single_process_engine(cfg)
    before = [p.data.copy() for p in engine.model.parameters()]
    x, y = train.make_task(cfg).global_batch(0, cfg.batch_size)
    engine.model.zero_grad()
    engine.runner.forward_backward(x, y, engine.normaliser(y))
    grads = [p.grad.copy() for p in engine.model.parameters()]
    engine.updater.step()
    after = [p.data for p in engine.model.parameters()]
    for old, new, grad in zip(before, after, grads):
        np.testing.assert_array_equal(new, old - lr * grad)  # SGD's first step, in fp32
    changed = np.concatenate([(new != old).ravel() for old, new in zip(before, after)])
    lost_in_bf16 = np.concatenate([(round_to_bf16(new) == round_to_bf16(old)).ravel()
                                   for old, new in zip(before, after)])
    assert changed.mean() > 0.5 and (changed & lost_in_bf16).sum() > 0.9 * changed.sum()


def test_the_loss_and_integer_arrays_are_not_rounded():
    cast = mixed_precision.rounding_every_op(round_to_bf16)
    loss, ids, x = np.float32(1.0 + 2**-12), np.array([3, 5]), np.array([1.0 + 2**-12], np.float32)
    assert cast(np.asarray(loss)) == loss and cast(ids) is ids and cast(x)[0] == 1.0


# ---- serial: training tracks fp32; the scaler skips and halves; the bench's two windows ----

@pytest.mark.parametrize("fmt, model", [("bf16", "gpt"), ("bf16", "mlp"), ("fp16", "gpt")])
def test_16_bit_training_tracks_fp32_within_one_percent_over_20_steps(fmt, model):
    cfg = tiny(model=model, steps=20, batch_size=16)
    reference = losses(cfg.replace(precision="fp32"))
    records = train.train(cfg.replace(precision=fmt), MPI.COMM_SELF)
    np.testing.assert_allclose([r["loss"] for r in records], reference, rtol=TRACKING_RTOL)
    assert not any(r.get("loss_scaling", {}).get("skipped") for r in records)
    assert ("loss_scaling" in records[0]) == (fmt == "fp16")


def test_the_scaler_skips_overflowing_steps_halves_and_grows_after_clean_ones():
    cfg = tiny(model="mlp", precision="fp16", steps=16)  # its gradients overflow fp16 at scales >= 2^16
    engine = single_process_engine(cfg, DynamicLossScaler(init_scale=2.0**20, growth_interval=3))
    task = train.make_task(cfg)
    scales, skipped = [], []
    for step in range(cfg.steps):
        before = [p.data.copy() for p in engine.model.parameters()]
        loss = engine.train_step(*task.global_batch(step, cfg.batch_size))
        record = engine.runner.log_record()
        scales.append(record["loss_scale"])
        skipped.append(record["skipped"])
        unchanged = all(np.array_equal(a, p.data) for a, p in zip(before, engine.model.parameters()))
        assert unchanged == record["skipped"] and np.isfinite(loss)  # the fp32 loss is still reported
    clean_run = 0
    for step in range(1, cfg.steps):
        clean_run = 0 if skipped[step - 1] else clean_run + 1
        grown = clean_run == 3
        clean_run %= 3
        expected = scales[step - 1] * (0.5 if skipped[step - 1] else 2.0 if grown else 1.0)
        assert scales[step] == expected, (scales, skipped)
    assert skipped[:3] == [True] * 3 and not all(skipped) and max(scales[1:]) < 2.0**20
    assert any(later > earlier for earlier, later in zip(scales, scales[1:]))  # it grew at least once


def test_every_zero_layout_takes_mixed_precision_and_other_backends_are_clear_errors():
    # ZeRO-3 and chunked offload gather the 16-bit working copy (tests/precision/test_zero3_working_copy.py)
    assert validate(tiny(precision="bf16", zero=3, dp=2), 2) == []
    assert validate(tiny(precision="bf16", offload="cpu", device_mem_mb="auto", dp=2), 2) == []
    assert validate(tiny(precision="fp16", zero=1, dp=2), 2) == []  # the gradients-ready point (api.py)
    assert validate(tiny(precision="fp16", zero=2, dp=2, loss_scaling=False), 2) == []
    assert validate(tiny(precision="bf16", zero=2, dp=2), 2) == []
    assert "use --backend numpy" in validate(tiny(precision="fp16", backend="cupy"), 1)[0]


# ---- multi-rank: the 16-bit wire, and layouts against the single-process run ----

def ring_fold(local_flats: list[np.ndarray], round_to) -> np.ndarray:
    """What the 16-bit ring all-reduce must give: chunk c is summed around the ring starting after its
    owner, each partial sum rounded before it travels, and the finished chunk rounded once more."""
    n, numel = len(local_flats), local_flats[0].size
    result = np.empty(numel, np.float32)
    for c in range(n):
        chunk = slice(*shard_bounds(numel, n, c))
        partial = local_flats[(c + 1) % n][chunk]
        for k in range(2, n + 1):
            with np.errstate(invalid="ignore"):  # overflowed fp16 gradients: inf - inf is NaN, as in the ring
                partial = local_flats[(c + k) % n][chunk] + round_to(partial)
        result[chunk] = round_to(partial)
    return result


def ddp(comm, **changes) -> train.Trainer:
    return train.Trainer(tiny(dp=comm.size, **{"batch_size": 2 * comm.size, **changes}), comm.mpi)


@mpi_test
def test_ddp_sends_16_bit_gradients_half_the_bytes_of_fp32(comm):
    sent = {fmt: ddp(comm, precision=fmt, steps=1).run()[0]["comm"] for fmt in ("fp32", "bf16", "fp16")}
    for fmt in ("bf16", "fp16"):
        assert sent[fmt]["by_op"] == {"all_reduce": sent["fp32"]["sent_bytes"] // 2}
        assert sent[fmt]["by_dim"] == {"dp": sent["fp32"]["sent_bytes"] // 2}
        assert sent[fmt]["messages"] == sent["fp32"]["messages"]


@mpi_given(max_examples=6, fmt=st.sampled_from(["bf16", "fp16"]), model=st.sampled_from(["gpt", "mlp"]),
           bucket_mb=st.sampled_from([1e-6, 2e-3, 1.0]), seed=st.integers(0, 2**16))
def test_the_16_bit_ring_sum_is_the_ring_fold_of_every_replica_gradient(comm, fmt, model, bucket_mb, seed):
    trainer = ddp(comm, precision=fmt, model=model, bucket_mb=bucket_mb, seed=seed)
    engine, task = trainer.engine, trainer.task
    inputs, targets = task.global_batch(0, trainer.cfg.batch_size)
    mine = slice(2 * comm.rank, 2 * comm.rank + 2)
    engine.runner.forward_backward(inputs[mine], targets[mine], engine.normaliser(targets))
    buckets = engine.updater.buckets
    local = [flatten([p.grad for p in bucket]) for bucket in buckets]
    every_rank = comm.allgather_obj(local)
    engine.updater.all_reduce_gradients()
    for index, bucket in enumerate(buckets):
        want = ring_fold([flats[index] for flats in every_rank], ROUND[fmt])
        np.testing.assert_array_equal(flatten([p.grad for p in bucket]), want)


@mpi_given(max_examples=5, model=st.sampled_from(["gpt", "mlp"]), microbatches=st.sampled_from([1, 2]),
           seed=st.integers(0, 2**16))
def test_bf16_ddp_tracks_the_single_process_bf16_run(comm, model, microbatches, seed):
    trainer = ddp(comm, model=model, microbatches=microbatches, seed=seed, steps=4,
                  batch_size=2 * microbatches * comm.size)
    records = trainer.run()
    if comm.rank == 0:
        reference, _ = train.reference_run(trainer.cfg)
        np.testing.assert_allclose([r["loss"] for r in records], reference, rtol=TRACKING_RTOL)


@mpi_test
def test_fp16_replicas_skip_the_same_steps_and_stay_identical(comm):
    cfg = tiny(model="mlp", precision="fp16", dp=comm.size, batch_size=4 * comm.size, steps=10)
    grid = ProcessGrid(comm, comm.size, 1, 1)
    model = build.build_model(cfg, grid)
    updater = build.build_updater(cfg, grid, model, DynamicLossScaler(
        init_scale=2.0**20, all_reduce_max=lambda flag: comm.allreduce_obj(flag, "max")))
    runner = mixed_precision.wrap_runner(cfg, model, build.build_runner(cfg, grid, model), updater)
    engine, task = Engine(cfg, grid, model, runner, updater), train.make_task(cfg)
    verdicts = []
    for step in range(cfg.steps):
        engine.train_step(*task.global_batch(step, cfg.batch_size))
        verdicts.append((runner.log_record()["skipped"], runner.log_record()["loss_scale"]))
    assert comm.allgather_obj(verdicts) == [verdicts] * comm.size
    assert verdicts[0] == (True, 2.0**20) and not all(skipped for skipped, _ in verdicts)
    check_replicas_identical(model, comm)


def layouts(world: int):
    """Every (dp, tp, pp) with dp*tp*pp == world that the tiny GPT allows (4 heads, 4 pipeline units)."""
    return [(world // (tp * pp), tp, pp) for tp in (1, 2, 4) for pp in (1, 2, 4) if world % (tp * pp) == 0]


@mpi_given(max_examples=6, layout_index=st.integers(0, 100), fmt=st.sampled_from(["bf16", "fp16"]),
           seed=st.integers(0, 2**16))
def test_every_layout_tracks_the_single_process_run_in_16_bits(comm, layout_index, fmt, seed):
    options = layouts(comm.size)
    dp, tp, pp = options[layout_index % len(options)]
    cfg = tiny(precision=fmt, dp=dp, tp=tp, pp=pp, n_head=4, microbatches=2, batch_size=4 * dp, seed=seed,
               steps=3)
    records = train.Trainer(cfg, comm.mpi).run()
    if comm.rank == 0:
        reference, _ = train.reference_run(cfg)
        np.testing.assert_allclose([r["loss"] for r in records], reference, rtol=TRACKING_RTOL,
                                   err_msg=f"dp={dp} tp={tp} pp={pp}")
