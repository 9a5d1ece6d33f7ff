"""FP8 keeps the exactness contract: with fp64 accumulation (`--fp8-accumulate fp64`), an FP8 run on
dp 2 (ZeRO 0, 1, 3), tp 2 or pp 2, and on 8 ranks dp 2 x tp 2 x pp 2 with ZeRO-1 or ZeRO-3, equals
the FP8 run on one process to 1e-9, for the delayed
per-tensor recipe (its amaxes agreed across the ranks that share a tensor, after each step) and for
block scaling (tiles that hold the same values in every layout); and the delayed recipe's amax
agreement costs exactly one ring all-reduce of one fp64 per scaled tensor per step.

    OPENBLAS_NUM_THREADS=1 mpiexec -n 2 python -m pytest -m mpi -q tests/precision/test_fp8_layouts.py
    OPENBLAS_NUM_THREADS=1 mpiexec -n 8 python -m pytest -m mpi -q tests/precision/test_fp8_layouts.py
"""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_harness import at_world_size, mpi_given, mpi_test, needs_world_size
from one_process import assert_trains_like_one_process

from minipar.distributed.ledger import ring_bytes_sent
from minipar.trainer import loop as train
from minipar.trainer.config import TrainConfig
from minipar.trainer.validate import validate

WORLD = MPI.COMM_WORLD
LAYOUTS = [{"dp": 2}, {"dp": 2, "zero": 1}, {"dp": 2, "zero": 3}, {"tp": 2},
           {"pp": 2, "microbatches": 2}]


def tiny(layout: dict, recipe: str, seed: int) -> TrainConfig:
    """Block's N = 16 divides d / tp = 16, 4d / tp = 64 and each micro-batch's 16 tokens per rank."""
    return TrainConfig(model="gpt", precision="fp8", fp8_accumulate="fp64", fp8_recipe=recipe, fp8_block=16,
                       n_layer=2, n_head=2, d_model=32, seq_len=8, batch_size=4, steps=3, quiet=True,
                       seed=seed, **{"dp": 1, **layout})


def test_every_layout_here_is_accepted_on_two_ranks():
    assert all(validate(tiny(layout, "block", 0), 2) == [] for layout in LAYOUTS)
    assert validate(tiny({"dp": 2}, "block", 0).replace(batch_size=2), 2) != []  # 8 tokens per rank


@needs_world_size(2)
@mpi_given(max_examples=1, layout=st.sampled_from(LAYOUTS), recipe=st.sampled_from(["delayed", "block"]),
           seed=st.integers(0, 2**16),
           examples=[at_world_size((2,), layout={"dp": 2}, recipe="delayed", seed=0),
                     at_world_size((2,), layout={"tp": 2}, recipe="delayed", seed=1),
                     at_world_size((2,), layout={"tp": 2}, recipe="block", seed=2),
                     at_world_size((2,), layout={"pp": 2, "microbatches": 2}, recipe="block", seed=3),
                     at_world_size((2,), layout={"dp": 2, "zero": 3}, recipe="delayed", seed=4)])
def test_fp8_on_two_ranks_trains_like_fp8_on_one(layout, recipe, seed):
    cfg = tiny(layout, recipe, seed)
    trainer = train.Trainer(cfg, WORLD)
    records = trainer.run()
    full = trainer.full_state()
    if WORLD.rank == 0:
        assert_trains_like_one_process(cfg, records, full)


@needs_world_size(2)
@mpi_test
def test_the_delayed_recipe_sends_one_fp64_amax_per_tensor_per_step_over_dp():
    """Each of the 12 FP8 layers (2 blocks of 6) has three scaled tensors (input, weight, output
    gradient), so delayed scaling adds one all-reduce of 36 fp64 amaxes per step on dp, and block
    scaling none: the ring charge of 36 values over 2 ranks, shards of 18."""
    sent = {}
    for recipe in ("delayed", "block"):
        records = train.Trainer(tiny({"dp": 2}, recipe, 0).replace(steps=1), WORLD).run()
        sent[recipe] = records[-1]["comm"]["by_dim"]["dp"] if WORLD.rank == 0 else 0
    if WORLD.rank == 0:
        assert sent["delayed"] - sent["block"] == ring_bytes_sent("all_reduce", [18 * 8, 18 * 8], 0) == 288


@needs_world_size(8)
@mpi_test
@pytest.mark.parametrize("zero, recipe", [(1, "delayed"), (1, "block"), (3, "delayed"), (3, "block")])
def test_fp8_on_dp_tp_pp_with_zero_1_and_3_trains_like_fp8_on_one(zero, recipe):
    """dp 2 x tp 2 x pp 2 (8 ranks): a tensor's amax agreed over dp and tp, each stage's own layers,
    ZeRO-1's sharded step or ZeRO-3's FP8 gathers of the tensor-parallel weight shards. Block's N = 16
    divides d / tp = 16, 4d / tp = 64 and each micro-batch's 8 / 2 / 2 x 8 = 16 tokens per rank."""
    cfg = tiny({"dp": 2, "tp": 2, "pp": 2, "zero": zero, "microbatches": 2}, recipe, 0).replace(batch_size=8)
    trainer = train.Trainer(cfg, WORLD)
    records = trainer.run()
    full = trainer.full_state()
    if WORLD.rank == 0:
        assert_trains_like_one_process(cfg, records, full)
