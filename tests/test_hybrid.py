"""3D parallelism: every factorisation of the world into dp x pp x tp trains to the single-process numbers.

    mpiexec -n K python -m pytest -m mpi tests/test_hybrid.py      # K = 4 and 8 (2 runs the dp/pp/tp pairs)
"""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_harness import mpi_given

from minipar import train
from minipar.config import TrainConfig, validate
from minipar.parallel.hybrid_bench import factorisations

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
        check = train.compare_with_reference(cfg, records, full)
        assert check["max_rel_loss_deviation"] <= 1e-9, check
        assert check["max_rel_weight_deviation"] <= 1e-9, check


@pytest.mark.parametrize("layout", factorisations(WORLD.size) if WORLD.size in (2, 4, 8) else [(1, 1, 1)])
@mpi_given(max_examples=2, zero=st.sampled_from([0, 1]), schedule=st.sampled_from(["gpipe", "1f1b"]),
           microbatches=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**16))
def test_every_layout_trains_like_one_process(layout, zero, schedule, microbatches, seed):
    dp, pp, tp = layout
    trains_like_the_reference(tiny(dp, pp, tp, zero=zero, schedule=schedule,
                                   microbatches=microbatches, seed=seed))


def test_factorisations_are_complete():
    assert sorted(factorisations(8)) == sorted(
        [(1, 1, 8), (1, 2, 4), (1, 4, 2), (1, 8, 1), (2, 1, 4), (2, 2, 2), (2, 4, 1), (4, 1, 2), (4, 2, 1),
         (8, 1, 1)])
    assert len(factorisations(4)) == 6
