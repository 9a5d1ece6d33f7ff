"""--clip-grad-norm: the clipped gradients and the logged norm are NumPy's, from one process's gradients.

    pytest -m "not mpi" tests/parallel/test_clipping.py                    # the check, one process
    mpiexec -n K python -m pytest -m mpi tests/parallel/test_clipping.py    # K = 2, 4, 8

The oracle is the single-process run with the same option: a transform registered *first* at its
gradients-ready point records its unclipped gradients, step by step; NumPy takes their norm and the
coefficient min(1, MAX / (norm + 1e-6)). Every rank of the layout records the pieces it steps with
*after* clipping (a transform registered last), and they must equal the reference's gradients, cut the
same way, times the coefficient. MAX is small, so clipping acts at every step.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_harness import at_world_size, mpi_given, needs_world_size

from minipar.core.shards import shard_of
from minipar.distributed.ledger import ring_bytes_sent
from minipar.parallel.api import GradientTransform
from minipar.trainer import loop as train
from minipar.trainer.config import TrainConfig
from minipar.trainer.validate import validate

WORLD = MPI.COMM_WORLD
MAX_NORM = 1e-3  # far below the GPT's gradient norm (about 1): every step clips
RTOL = 1e-12


def tiny(**changes) -> TrainConfig:
    base = TrainConfig(model="gpt", precision="fp64", n_layer=2, n_head=4, d_model=16, seq_len=8,
                       batch_size=8, steps=2, quiet=True, clip_grad_norm=MAX_NORM)
    return base.replace(**changes)


def layouts(world: int) -> list[dict]:
    """The layouts of this world size the test draws from: data parallelism with each ZeRO stage and
    chunked ZeRO-3, tensor and pipeline parallelism, context and expert parallelism, FSDP2 (a piece is
    a parameter's own rows) and hybrid sharding (a replica's rows not counted), last."""
    options = [dict(zero=zero) for zero in (0, 1, 2, 3)] + [dict(zero=3, chunk_mb=0.01)]
    if world >= 2:
        options += [dict(tp=2, zero=1), dict(cp=2), dict(model="moe", ep=2, zero=2), dict(model="moe", ep=2)]
    if world >= 4:
        options += [dict(pp=2, tp=2), dict(pp=2, tp=2, zero=2), dict(tp=2, cp=2, zero=3),
                    dict(model="moe", tp=2, ep=2, zero=1)]
    if world >= 8:
        options += [dict(pp=2, tp=2, zero=3, microbatches=2), dict(model="moe", ep=4, zero=3)]
    if world >= 2:
        options += [dict(fsdp=True)]
    if world >= 4:
        options += [dict(fsdp=True, dp_replicate=2), dict(fsdp=True, tp=2)]
    if world >= 8:
        options += [dict(fsdp=True, pp=2, tp=2, microbatches=2)]
    return options


def layout_index(**layout) -> int:
    """Where `layout` is among this world size's layouts (0 where it is not one of them)."""
    return layouts(WORLD.size).index(layout) if layout in layouts(WORLD.size) else 0


class Recorder(GradientTransform):
    """Copies of the pieces it sees, step by step: (name, tp shard, offset, values)."""

    def __init__(self):
        self.steps: list[list[tuple]] = []

    def __call__(self, pieces) -> None:
        self.steps.append([(p.name, p.param.shard, p.offset, np.array(p.grad).reshape(-1).copy())
                           for p in pieces()])


def reference_gradients(cfg: TrainConfig, weights: list | None = None) -> tuple[list[dict], list[float]]:
    """The single-process run's unclipped gradients {name: array} and its logged norms, step by step
    (and its final weights, appended to `weights`)."""
    trainer = train.Trainer(cfg.single_process(), MPI.COMM_SELF)
    recorder = Recorder()
    trainer.engine.updater.register_gradients_ready_hook(recorder, first=True)
    records = trainer.run()
    full = [{name: values for name, _, _, values in step} for step in recorder.steps]
    shapes = {name: p.shape for name, p in trainer.engine.model.named_parameters()}
    norms = [r["grad_norm"] for r in records]
    if weights is not None:
        weights.append(trainer.full_state())
    return [{n: v.reshape(shapes[n]) for n, v in step.items()} for step in full], norms


def norm_of(gradients: dict) -> float:
    return float(np.sqrt(sum(float((g * g).sum()) for g in gradients.values())))


def check_clipped(cfg: TrainConfig, pieces_per_rank: list, records: list, full: dict | None = None) -> None:
    """On rank 0: every rank's clipped pieces and the logged norms against NumPy on the reference, and
    the trained weights `full` (where given) against the reference's, fp64's 1e-9."""
    weights: list = []
    reference, reference_norms = reference_gradients(cfg, weights)
    for name, want in weights[0].items() if full is not None else ():
        np.testing.assert_allclose(full[name], want, rtol=1e-9, atol=1e-12, err_msg=name)
    replicated = {name for rank in pieces_per_rank for step in rank for name, shard, _, _ in step
                  if shard is None} if cfg.tp > 1 else set()
    for step, gradients in enumerate(reference):
        norm = norm_of(gradients)
        assert records[step]["grad_norm"] == pytest.approx(norm, rel=RTOL, abs=0)
        assert reference_norms[step] == pytest.approx(norm, rel=RTOL, abs=0)
        coefficient = min(1.0, MAX_NORM / (norm + 1e-6))
        assert coefficient < 1  # the option acts
        if cfg.tp > 1:  # a tp-replicated parameter counted on every tp rank would move the norm visibly
            again = sum(float((gradients[n] ** 2).sum()) for n in replicated)
            twice = np.sqrt(norm**2 + (cfg.tp - 1) * again)
            assert replicated and (twice - norm) / norm > 1e-6, (replicated, twice, norm)
        got, want = [], []
        for rank in pieces_per_rank:
            for name, shard, offset, values in rank[step]:
                cut = shard_of(gradients[name], shard).reshape(-1)[offset : offset + values.size]
                got.append(values)
                want.append(cut * coefficient)
        got_all, want_all = np.concatenate(got), np.concatenate(want)
        assert np.linalg.norm(got_all - want_all) <= RTOL * np.linalg.norm(want_all), step


@needs_world_size(2, 4, 8)
@mpi_given(max_examples=4, shrink=False, layout_index=st.integers(0, 100), seed=st.integers(0, 2**16),
           examples=[at_world_size((2, 4, 8), layout_index=5, seed=3),  # tp = 2 with ZeRO-1
                     at_world_size((4, 8), layout_index=10, seed=4),  # pp x tp
                     at_world_size((2, 4, 8), layout_index=4, seed=5),  # chunked ZeRO-3
                     at_world_size((2,), layout_index=layout_index(fsdp=True), seed=6),
                     at_world_size((4,), layout_index=layout_index(fsdp=True, dp_replicate=2), seed=7),
                     at_world_size((4,), layout_index=layout_index(fsdp=True, tp=2), seed=8),
                     at_world_size((8,), layout_index=layout_index(fsdp=True, pp=2, tp=2, microbatches=2),
                                   seed=9)])
def test_clipped_gradients_and_the_logged_norm_are_numpys_from_one_process(layout_index, seed):
    options = layouts(WORLD.size)
    layout = options[layout_index % len(options)]
    rest = WORLD.size // (layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1))
    cfg = tiny(seed=seed, dp=rest, batch_size=4 * rest, **layout)
    assert validate(cfg, WORLD.size) == [], layout
    trainer = train.Trainer(cfg, WORLD)
    recorder = Recorder()
    trainer.engine.updater.register_gradients_ready_hook(recorder)  # after the clipping
    records = trainer.run()
    full = trainer.full_state()
    pieces = WORLD.gather([[[(n, s, o, v) for n, s, o, v in step] for step in recorder.steps]], root=0)
    counted = WORLD.gather(sum(1 for step in recorder.steps for _ in step), root=0)
    if WORLD.rank == 0:
        assert min(counted) > 0
        check_clipped(cfg, [rank[0] for rank in pieces], records, full)


@needs_world_size(4, 8)
@mpi_given(max_examples=2, shrink=False, layout_index=st.integers(0, 100))
def test_the_norm_costs_one_fp64_all_reduce_per_dimension_and_nothing_without_the_option(layout_index):
    """The per-step byte tests of the other files train without the option, and so send none of this."""
    options = [dict(pp=2, tp=2), dict(tp=2, cp=2, zero=3), dict(zero=2), dict(model="moe", ep=2, zero=1)]
    layout = options[layout_index % len(options)]
    rest = WORLD.size // (layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1))
    cfg = tiny(dp=rest, batch_size=4 * rest, **layout)
    clipped = train.Trainer(cfg, WORLD).run()
    plain = train.Trainer(cfg.replace(clip_grad_norm=None), WORLD).run()
    if WORLD.rank == 0:  # world rank 0 is rank 0 of each of its communicators
        sizes = {"dp" if cfg.cp == 1 else "dp_cp": rest * cfg.cp, "tp": cfg.tp, "pp": cfg.pp}
        one_value = {dim: ring_bytes_sent("all_reduce", [8] + [0] * (n - 1), 0) for dim, n in sizes.items()
                     if n > 1}
        for with_it, without in zip(clipped, plain):
            extra = {dim: with_it["comm"]["by_dim"].get(dim, 0) - without["comm"]["by_dim"].get(dim, 0)
                     for dim in set(with_it["comm"]["by_dim"]) | set(without["comm"]["by_dim"])}
            assert {dim: n for dim, n in extra.items() if n} == one_value
            assert "grad_norm" in with_it and "grad_norm" not in without


def test_the_option_must_be_positive():
    assert validate(tiny(clip_grad_norm=0.0), 1) == ["--clip-grad-norm must be positive, got 0.0"]
    assert validate(tiny(clip_grad_norm=-1.0), 1) == ["--clip-grad-norm must be positive, got -1.0"]
    not_finite = ["--clip-grad-norm must be a finite number, got nan"]
    assert validate(tiny(clip_grad_norm=float("nan")), 1) == not_finite
    assert validate(tiny(), 1) == []


def test_one_process_clips_like_pytorchs_rule_written_out():
    """One process, two steps: the logged norm is NumPy's over the unclipped gradients, and the step
    took the gradients times min(1, MAX / (norm + 1e-6)) (SGD without momentum: the step shows it)."""
    cfg = tiny(optimizer="sgd", momentum=0.0, lr=0.5, dp=1, steps=1)
    (gradients,), (norm,) = reference_gradients(cfg)
    assert norm == pytest.approx(norm_of(gradients), rel=RTOL, abs=0)
    before = train.Trainer(cfg, MPI.COMM_SELF).full_state()
    after = train.Trainer(cfg, MPI.COMM_SELF)
    after.run()
    coefficient = MAX_NORM / (norm + 1e-6)
    for name, weights in after.full_state().items():
        np.testing.assert_allclose(weights, before[name] - cfg.lr * coefficient * gradients[name],
                                   rtol=1e-13, atol=1e-16, err_msg=name)
