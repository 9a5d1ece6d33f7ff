"""The Runner and Updater interfaces: every part the builder returns satisfies them and answers them
correctly, the trainer's log works with a part that only has the interface's required method, and the
parts and the checkpoint import nothing from the trainer above them.

    pytest -m "not mpi" tests/parallel/test_api.py            # one process: every single-rank layout
    mpiexec -n 2 python -m pytest -m mpi tests/parallel/test_api.py   # DDP and the pipeline, built
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI
from mpi_harness import mpi_test, needs_world_size

import minipar
from minipar.core import autograd, optim
from minipar.distributed.communicator import Comm
from minipar.distributed.grid import ProcessGrid
from minipar.parallel.api import LocalUpdater, MicrobatchRunner, Runner, Updater
from minipar.parallel.ddp import DistributedDataParallel
from minipar.parallel.pipeline import PipelineRunner, build_stage
from minipar.parallel.zero import ZeroStage1, ZeroStage2
from minipar.parallel.zero3 import ZeroStage3
from minipar.parallel.zero_chunked import ChunkedZero3
from minipar.precision.formats import round_to_bf16
from minipar.precision.mixed import MixedPrecisionRunner
from minipar.trainer import build
from minipar.trainer import loop as train
from minipar.trainer.config import TrainConfig
from minipar.trainer.engine import Engine
from minipar.trainer.validate import validate

TINY = TrainConfig(model="gpt", precision="fp64", n_layer=2, n_head=2, d_model=16, seq_len=8, batch_size=8,
                   steps=2, quiet=True)

# (changes to TINY, the updater and runner classes the builder must choose on one rank)
ONE_RANK_LAYOUTS = {
    "plain": ({}, LocalUpdater, MicrobatchRunner),
    "mlp": ({"model": "mlp"}, LocalUpdater, MicrobatchRunner),
    "microbatches": ({"microbatches": 2}, LocalUpdater, MicrobatchRunner),
    "zero1": ({"zero": 1}, ZeroStage1, MicrobatchRunner),
    "zero2": ({"zero": 2}, ZeroStage2, MicrobatchRunner),
    "zero3": ({"zero": 3}, ZeroStage3, MicrobatchRunner),
    "chunked": ({"chunk_mb": 0.05}, ChunkedZero3, MicrobatchRunner),
    "offload": ({"offload": "cpu", "device_mem_mb": 0.5}, ChunkedZero3, MicrobatchRunner),
    "bf16": ({"precision": "bf16"}, LocalUpdater, MixedPrecisionRunner),
    "fp16": ({"precision": "fp16"}, LocalUpdater, MixedPrecisionRunner),
    "fp16-unscaled": ({"precision": "fp16", "loss_scaling": False}, LocalUpdater, MixedPrecisionRunner),
}
EXACT = [name for name, (changes, *_) in ONE_RANK_LAYOUTS.items() if "precision" not in changes]


def one_rank_engine(cfg: TrainConfig) -> Engine:
    assert validate(cfg, 1) == []
    return build.build_engine(cfg.resolved(1), ProcessGrid(Comm(MPI.COMM_SELF), 1, 1, 1))


def step_once(engine: Engine, cfg: TrainConfig) -> float:
    inputs, targets = train.make_task(cfg).global_batch(0, cfg.batch_size)
    return engine.train_step(inputs, targets)


def parameter_shapes(cfg: TrainConfig) -> dict:
    return {name: p.shape for name, p in build.build_model(cfg, None).named_parameters()}


# ---- every part the builder returns satisfies the interfaces ---------------------------------------


@pytest.mark.parametrize("layout", ONE_RANK_LAYOUTS)
def test_the_builder_returns_parts_of_the_interfaces_for_each_layout(layout):
    changes, updater_class, runner_class = ONE_RANK_LAYOUTS[layout]
    cfg = TINY.replace(**changes)
    engine = one_rank_engine(cfg)
    assert type(engine.updater) is updater_class and type(engine.runner) is runner_class
    assert isinstance(engine.updater, Updater) and isinstance(engine.runner, Runner)
    step_once(engine, cfg)
    shapes = parameter_shapes(cfg)
    # the parameters as the trainer and the checkpoint see them: every one, whole, on the host
    state = engine.updater.local_state()
    assert {name: array.shape for name, (_, array) in state.items()} == shapes
    assert all(isinstance(array, np.ndarray) and shard is None for shard, array in state.values())
    assert engine.updater.checkpoint_pieces().keys() == shapes.keys()
    held = engine.updater.memory()
    assert {"params", "grads", "optimizer"} <= held.keys()
    tiers = [bytes_ for v in held.values() for bytes_ in (v.values() if isinstance(v, dict) else [v])]
    assert all(isinstance(n, int) for n in tiers) and sum(tiers) > 0
    assert engine.runner.timing() is None


@pytest.mark.parametrize("layout", EXACT)
def test_every_updater_holds_the_weights_of_the_plain_step_after_a_step(layout):
    """local_state is what full_state and the reference check compare: an updater that kept the
    default while its parameters are sharded or freed would hand back the wrong (or empty) arrays."""
    cfg = TINY.replace(**ONE_RANK_LAYOUTS[layout][0])
    plain = TINY.replace(model=cfg.model)
    engine, reference = one_rank_engine(cfg), one_rank_engine(plain)
    assert step_once(engine, cfg) == pytest.approx(step_once(reference, plain), rel=1e-12)
    expected = reference.updater.local_state()
    for name, (_, array) in engine.updater.local_state().items():
        np.testing.assert_allclose(array, expected[name][1], rtol=1e-12, atol=1e-15, err_msg=name)


def test_only_chunked_offload_reports_tier_traffic():
    for layout in ONE_RANK_LAYOUTS:
        cfg = TINY.replace(**ONE_RANK_LAYOUTS[layout][0])
        engine = one_rank_engine(cfg)
        step_once(engine, cfg)
        traffic = engine.updater.tier_traffic()
        if layout in ("chunked", "offload"):
            assert isinstance(traffic, dict) and "moved_bytes" in traffic
        else:
            assert traffic is None, layout


def test_the_engines_loss_scaler_is_the_one_the_step_uses():
    """Only fp16 with scaling has one; setting its scale shows in the step's log record, so the
    checkpoint (which saves engine.loss_scaler) saves the live scaler, not a copy or another one."""
    for layout in ("plain", "bf16", "fp16-unscaled"):
        engine = one_rank_engine(TINY.replace(**ONE_RANK_LAYOUTS[layout][0]))
        assert engine.loss_scaler is None and engine.runner.log_record() is None, layout
    cfg = TINY.replace(precision="fp16")
    engine = one_rank_engine(cfg)
    engine.loss_scaler.load_state_dict({**engine.loss_scaler.state_dict(), "scale": 2.0**10})
    step_once(engine, cfg)
    assert engine.runner.log_record() == {"loss_scale": 2.0**10, "skipped": False}
    engine.loss_scaler.load_state_dict({**engine.loss_scaler.state_dict(), "scale": 2.0**40})
    step_once(engine, cfg)  # fp16 overflows at this scale: the step is skipped and the scale halves
    assert engine.runner.log_record() == {"loss_scale": 2.0**40, "skipped": True}
    assert engine.loss_scaler.get_scale() == 2.0**39


def test_pipeline_timing_reaches_the_log_through_mixed_precision():
    """A 16-bit pipeline: the mixed precision runner wraps the pipeline's, and must pass its timing on."""
    model = build_stage(build.build_model(TINY, None), 1, 0)
    pipeline = PipelineRunner(model, Comm(MPI.COMM_SELF, "pp"), "1f1b", 2, TINY.d_model, TINY.dtype)
    runner = MixedPrecisionRunner(pipeline, model.parameters(), round_to_bf16)
    assert runner.timing() is None  # no step yet
    inputs, targets = train.make_task(TINY).global_batch(0, TINY.batch_size)
    runner.forward_backward(inputs, targets, targets.size)
    assert runner.timing() is pipeline.timing() and runner.timing()["microbatches"] == 2


# ---- a part with only the required methods works in the trainer ------------------------------------


class HalfStepSGD(Updater):
    """An updater of its own: plain SGD at half the optimizer's rate, and nothing but `apply_optimizer`
    (its step is Updater's: nothing to synchronise, no transform at the gradients-ready point)."""

    def apply_optimizer(self):
        with autograd.no_grad():
            for p in self.model.parameters():
                p.data -= 0.5 * self.optimizer.lr * p.grad


class OneBatchRunner(Runner):
    """A runner of its own: the whole slice as one micro-batch, and nothing but `forward_backward`."""

    def __init__(self, model):
        self.model = model

    def forward_backward(self, inputs, targets, normaliser, scored=None):
        loss = self.model.loss(self.model(inputs), targets, normaliser)
        loss.backward()
        return loss.item()


def test_a_runner_and_updater_with_only_the_required_methods_train_log_and_report():
    cfg = TINY.replace(lr=0.1).resolved(1)
    trainer = train.Trainer(cfg, MPI.COMM_SELF)
    model = trainer.engine.model
    optimizer = optim.SGD(model.parameters(), lr=cfg.lr)
    trainer.engine = Engine(cfg, trainer.grid, model, OneBatchRunner(model), HalfStepSGD(model, optimizer))
    before = {name: p.data.copy() for name, p in model.named_parameters()}
    records = trainer.run()
    assert [r["step"] for r in records] == [0, 1]
    assert all(r.keys() == {"step", "loss", "tokens_per_s", "time_s", "mem", "comm"} for r in records)
    assert records[0]["mem"]["params"] == sum(a.nbytes for a in before.values())
    assert records[0]["mem"]["optimizer"] == 0  # SGD without momentum keeps no state
    full = trainer.full_state()
    assert full.keys() == before.keys() and any((full[n] != before[n]).any() for n in before)
    # the same two steps by the single-process parts with SGD at half the rate: the custom step ran
    reference = train.Trainer(cfg, MPI.COMM_SELF)
    same = reference.engine.model
    reference.engine = Engine(cfg, reference.grid, same, MicrobatchRunner(same, 1),
                              LocalUpdater(same, optim.SGD(same.parameters(), lr=cfg.lr / 2)))
    assert [r["loss"] for r in reference.run()] == pytest.approx([r["loss"] for r in records], rel=1e-12)
    for name, (_, array) in reference.engine.updater.local_state().items():
        np.testing.assert_allclose(full[name], array, rtol=1e-12, atol=1e-15, err_msg=name)


def test_a_part_without_its_required_method_cannot_be_made():
    class NoStep(Updater):
        pass

    class NoForwardBackward(Runner):
        pass

    with pytest.raises(TypeError, match="apply_optimizer"):
        NoStep(None, None)
    with pytest.raises(TypeError, match="forward_backward"):
        NoForwardBackward()


# ---- layers: the parts and the checkpoint are below the trainer --------------------------------------


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("module", ["checkpoint/sharded.py", "parallel/api.py", "parallel/ddp.py",
                                    "parallel/pipeline.py", "precision/mixed.py"])
def test_the_parts_and_the_checkpoint_import_nothing_from_the_trainer(module):
    path = Path(minipar.__file__).parent / module
    upward = sorted(name for name in imported_modules(path) if name.startswith("minipar.trainer"))
    assert upward == [], f"{module} imports {upward}"


# ---- on two ranks: the parts that need them ---------------------------------------------------------


@needs_world_size(2)
@pytest.mark.parametrize("changes, updater_class, runner_class", [
    ({"dp": 2}, DistributedDataParallel, MicrobatchRunner),
    ({"dp": 2, "zero": 3}, ZeroStage3, MicrobatchRunner),
    ({"pp": 2, "microbatches": 2}, LocalUpdater, PipelineRunner),
    ({"pp": 2, "microbatches": 2, "precision": "bf16"}, LocalUpdater, MixedPrecisionRunner),
])
@mpi_test
def test_on_two_ranks_the_builder_returns_parts_of_the_interfaces(comm, changes, updater_class, runner_class):
    cfg = TINY.replace(**changes)
    assert validate(cfg, comm.size) == []
    trainer = train.Trainer(cfg.resolved(comm.size), comm.mpi)
    assert type(trainer.engine.updater) is updater_class and type(trainer.engine.runner) is runner_class
    assert isinstance(trainer.engine.updater, Updater) and isinstance(trainer.engine.runner, Runner)
    records = trainer.run()
    full = trainer.full_state()  # a collective under ZeRO-3: local_state gathers the shards
    assert all(("pipeline" in r) == (cfg.pp > 1) for r in records)
    if comm.rank == 0:
        assert {name: a.shape for name, a in full.items()} == parameter_shapes(TINY)


# ---- the gradients-ready point: transforms attach with handles, see final gradients, may skip ---------


class Skipper:
    """A transform that records what it saw and says whether the step goes on."""

    def __init__(self, go_on: bool):
        self.go_on, self.seen = go_on, []

    def __call__(self, pieces):
        self.seen.append({piece.name: np.array(piece.grad).reshape(-1).copy() for piece in pieces()})
        return self.go_on

    def log_record(self):
        return {"seen": len(self.seen)}


@pytest.mark.parametrize("name", EXACT)
def test_a_transform_sees_every_gradient_once_and_a_skip_changes_nothing(name):
    """Every layout's pieces cover each parameter's gradient exactly once (summed back, they are the
    plain run's gradients); a transform that returns False leaves every weight and optimizer state as
    it was, the transforms after it do not run, and removing the handle detaches it."""
    changes = ONE_RANK_LAYOUTS[name][0]
    cfg = TINY.replace(**changes)
    engine, plain = one_rank_engine(cfg), one_rank_engine(cfg.single_process())
    looker, skipper, after = Skipper(True), Skipper(False), Skipper(True)
    handles = [engine.updater.register_gradients_ready_hook(t) for t in (looker, skipper, after)]
    before = engine.updater.checkpoint_pieces()
    step_once(engine, cfg)
    assert len(looker.seen) == 1 and len(skipper.seen) == 1 and after.seen == []
    assert engine.updater.log_record() == {"seen": 1}  # the skipper's, the last that ran
    for tensor, kinds in engine.updater.checkpoint_pieces().items():
        for kind, (_, array) in kinds.items():
            np.testing.assert_array_equal(array, before[tensor][kind][1], err_msg=f"{tensor} {kind}")
    recorder = Skipper(True)
    plain.updater.register_gradients_ready_hook(recorder)
    step_once(plain, cfg)
    assert looker.seen[0].keys() == recorder.seen[0].keys() == dict(plain.model.named_parameters()).keys()
    for tensor, flat in recorder.seen[0].items():  # one rank: each parameter's whole gradient, once
        # (relative to the tensor's norm: micro-batches sum in another order, near-zero entries differ)
        assert np.linalg.norm(looker.seen[0][tensor] - flat) <= 1e-12 * np.linalg.norm(flat), tensor
    handles[1].remove()  # the skipper gone, the step happens
    step_once(engine, cfg)
    assert len(skipper.seen) == 1 and len(after.seen) == 1
