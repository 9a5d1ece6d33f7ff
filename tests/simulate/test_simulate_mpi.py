"""The simulator's memory per GPU against the ledgers of real 2-rank runs, ZeRO 1-3 over dp = 2.
Needs 2 ranks: mpiexec -n 2 python -m pytest -m mpi tests/simulate/test_simulate_mpi.py."""

import hypothesis.strategies as st
from mpi4py import MPI
from mpi_harness import mpi_given, needs_world_size

from minipar.simulate.model import ModelShape
from minipar.simulate.step import Layout, activation_memory, model_state_memory
from minipar.trainer.config import TrainConfig
from minipar.trainer.loop import train
from minipar.trainer.tasks import ALPHABET


@needs_world_size(2)
@mpi_given(max_examples=3, zero=st.sampled_from([1, 2, 3]), recompute=st.sampled_from(["none", "full"]))
def test_memory_equals_every_ranks_ledger_under_zero(zero, recompute):
    cfg = TrainConfig(model="gpt", precision="fp64", steps=1, batch_size=4, seq_len=16, n_layer=2, n_head=2,
                      d_model=16, dp=2, zero=zero, recompute=recompute, quiet=True)
    measured = train(cfg, MPI.COMM_WORLD)[-1]["mem"]  # each rank's own records
    layout = Layout(4, dp=2, zero=zero, recompute=recompute, precision="fp64")
    shape = ModelShape(2, 16, 2, 16, len(ALPHABET))
    predicted = {**model_state_memory(shape, layout), "activations_peak": activation_memory(shape, layout, 1)}
    assert {k: measured[k] for k in predicted} == predicted
