"""3D parallelism: every factorisation of the world into dp x pp x tp trains to the single-process numbers.

    mpiexec -n K python -m pytest -m mpi tests/trainer/test_hybrid.py  # K = 4, 8 (2: the dp/pp/tp pairs)
"""

from __future__ import annotations

import math

import pytest
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_harness import mpi_given, mpi_test, needs_world_size
from one_process import assert_trains_like_one_process

from minipar.distributed.grid import factorisations
from minipar.trainer import loop as train
from minipar.trainer.config import TrainConfig
from minipar.trainer.validate import validate

WORLD = MPI.COMM_WORLD


def tiny(dp, pp, tp, **changes) -> TrainConfig:
    """Small enough for 8 ranks on 2 cores; 6 layers so that pp=8 still has a unit per stage."""
    base = TrainConfig(model="gpt", precision="fp64", n_layer=6, n_head=8, d_model=16, seq_len=6,
                       batch_size=8, steps=2, quiet=True, dp=dp, pp=pp, tp=tp)
    return base.replace(**changes)


def trains_like_the_reference(cfg: TrainConfig):
    assert validate(cfg, WORLD.size) == []
    trainer = train.Trainer(cfg, WORLD)
    records = trainer.run()
    full = trainer.full_state()
    if WORLD.rank == 0:
        assert_trains_like_one_process(cfg, records, full)


@pytest.mark.parametrize("layout", factorisations(WORLD.size) if WORLD.size in (2, 4, 8) else [(1, 1, 1)])
@mpi_given(max_examples=2, zero=st.sampled_from([0, 1]), schedule=st.sampled_from(["gpipe", "1f1b"]),
           microbatches=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**16))
def test_every_layout_trains_like_one_process(layout, zero, schedule, microbatches, seed):
    dp, pp, tp = layout
    per_replica = tiny(dp, pp, tp).batch_size // dp  # micro-batches must divide each replica's batch
    trains_like_the_reference(tiny(dp, pp, tp, zero=zero, schedule=schedule,
                                   microbatches=math.gcd(microbatches, per_replica), seed=seed))


def test_factorisations_are_complete():
    assert sorted(factorisations(8)) == sorted(
        [(1, 1, 8), (1, 2, 4), (1, 4, 2), (1, 8, 1), (2, 1, 4), (2, 2, 2), (2, 4, 1), (4, 1, 2), (4, 2, 1),
         (8, 1, 1)])
    assert len(factorisations(4)) == 6


def expected_bytes_per_dimension(cfg: TrainConfig, trainer) -> dict:
    """What each dimension must send per step on this rank, from the techniques' own formulas."""
    grid, w = trainer.grid, 8  # fp64
    unit_names = [name for name, _ in trainer.engine.model.units()]
    blocks = sum(name.startswith("blocks.") for name in unit_names)
    has_embed, has_head = "embed" in unit_names, "head" in unit_names
    b, M = cfg.batch_size // cfg.dp // cfg.microbatches, cfg.microbatches
    activation = b * cfg.seq_len * cfg.d_model * w
    ring = lambda n: 2 * (n - 1) / n  # noqa: E731  all-reduce: 2(N-1)/N of the payload
    # Megatron: per block 2 all-reduces forward (attention, MLP outputs) and 2 backward (their inputs);
    # the embedding 1 forward; the head 1 backward (lm_head's input) and the loss 3 of b*T values.
    loss = 3 * b * cfg.seq_len * w
    tp_payload = 4 * blocks * activation + has_embed * activation + has_head * (activation + loss)
    # Pipeline: an activation forward unless last, its gradient backward unless first, per micro-batch.
    pp_sends = (grid.pp_rank < grid.pp.size - 1) + (grid.pp_rank > 0)
    # ZeRO-1: reduce-scatter + all-gather of each unit's flat parameters, padded to a multiple of dp.
    padded = sum(-(-sum(p.size for p in unit.parameters()) // grid.dp.size) * grid.dp.size
                 for _, unit in trainer.engine.model.units())
    return {"tp": M * ring(grid.tp.size) * tp_payload, "pp": M * pp_sends * activation,
            "dp": ring(grid.dp.size) * padded * w}


@needs_world_size(4, 8)
@pytest.mark.parametrize("layout", factorisations(WORLD.size))
@mpi_test
def test_each_dimension_sends_what_its_formula_says(layout):
    dp, pp, tp = layout
    cfg = tiny(dp, pp, tp, zero=1, microbatches=2, steps=1)
    trainer = train.Trainer(cfg, WORLD)
    sent = trainer.run()[-1]["comm"]["by_dim"]
    for dim, expected in expected_bytes_per_dimension(cfg, trainer).items():
        assert sent.get(dim, 0) == pytest.approx(expected, abs=0.5), (dim, sent, expected)
