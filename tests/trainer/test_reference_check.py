"""`--check-reference`'s verdict: PASS within the precision's tolerance over steps 1..min(20, steps), FAIL
(exit 1) beyond it, and the final weights' drift reported apart without deciding anything.

The oracles: unit roundoffs read from numpy's float formats and from the bf16 rounding itself; a norm
written out by hand; deviations planted in a run on either side of the tolerance, and beyond the
horizon; and a 2-rank job that MINIPAR_FAULT nudges, which must end with FAIL and exit code 1.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI
from test_train_cli import SMALL, minipar

from minipar.precision.formats import round_to_bf16
from minipar.trainer import loop, reference
from minipar.trainer.config import TrainConfig


def test_tolerances_are_the_growth_factor_times_the_unit_roundoff():
    u = {"fp32": np.finfo(np.float32).eps / 2, "fp16": np.finfo(np.float16).eps / 2}
    # bf16 keeps 8 significand bits: 1 + 2^-7 is the next number after 1, and 1 + 2^-8 ties back to 1
    assert round_to_bf16(np.float32(1 + 2.0**-7)) == 1 + 2.0**-7
    assert round_to_bf16(np.float32(1 + 2.0**-8)) == 1
    u["bf16"] = 2.0**-8
    for fmt, roundoff in u.items():
        assert reference.TOLERANCE[fmt] == pytest.approx(reference.GROWTH[fmt] * roundoff, rel=1e-15), fmt
    assert reference.TOLERANCE["fp64"] == 1e-9  # DESIGN.md's correctness contract
    # the growth factors written out, as reference.py derives them: 4 per step over 20 steps for fp32,
    # 8 for the 16-bit formats (a rounding flip does not pile up)
    assert reference.TOLERANCE["fp32"] == pytest.approx(80 * 2.0**-24, rel=1e-15)  # 4.77e-6
    assert reference.TOLERANCE["bf16"] == 0.03125 and reference.TOLERANCE["fp16"] == 0.00390625


def test_weights_are_compared_as_one_vector_relative_to_its_norm():
    ref = {"a": np.array([3.0, 0.0]), "b": np.array([[4.0]])}
    state = {"a": np.array([3.0, 1.0]), "b": np.array([[4.0]])}
    # ||(0, 1, 0)|| / ||(3, 0, 4)|| = 1 / sqrt(9 + 16)
    assert reference.norm_relative_deviation(state, ref) == pytest.approx(1 / 5, rel=1e-15)
    assert reference.norm_relative_deviation(ref, ref) == 0.0


def checked_run(**changes):
    cfg = TrainConfig(model="gpt", n_layer=1, n_head=2, d_model=8, seq_len=6, batch_size=4, steps=2,
                      precision="fp64", quiet=True, dp=1, check_reference=True).replace(**changes)
    trainer = loop.Trainer(cfg, MPI.COMM_SELF)
    records = trainer.run()
    trainer.memory.close()
    return cfg, records, trainer.snapshot, trainer.full_state()


def nudged(state: dict, amount: float) -> dict:
    """`state` with one tensor moved so that ||moved - state|| / ||state|| == amount."""
    norm = math.sqrt(sum(float(np.sum(a**2)) for a in state.values()))
    name = "blocks.0.mlp.fc.weight"
    moved = state[name].copy()
    moved.flat[3] += amount * norm
    return dict(state, **{name: moved})


def test_deviations_planted_either_side_of_the_tolerance_pass_and_fail():
    cfg, records, snapshot, full = checked_run()
    clean = loop.check_against_reference(cfg, records, snapshot, full)
    assert clean["passed"] and clean["loss_deviation"] == clean["weight_deviation"] == clean["drift"] == 0.0
    assert clean["horizon"] == 2 and clean["tolerance"] == 1e-9
    for amount, passed in [(5e-10, True), (2e-9, False)]:
        off_loss = [dict(r) for r in records]
        off_loss[1]["loss"] *= 1 + amount
        check = loop.check_against_reference(cfg, off_loss, snapshot, full)
        assert check["loss_deviation"] == pytest.approx(amount, rel=1e-6) and check["passed"] is passed
        check = loop.check_against_reference(cfg, records, nudged(snapshot, amount), full)
        assert check["weight_deviation"] == pytest.approx(amount, rel=1e-6) and check["passed"] is passed


def test_beyond_step_20_a_deviation_is_drift_and_decides_nothing():
    cfg, records, snapshot, full = checked_run(steps=22)
    assert records[19]["step"] == 19 and snapshot is not None
    late = [dict(r) for r in records]
    late[21]["loss"] *= 1 + 1e-3  # step 22
    check = loop.check_against_reference(cfg, late, snapshot, nudged(full, 1e-3))
    assert check["passed"] and check["horizon"] == 20 and check["loss_deviation"] == 0.0
    assert check["drift"] == pytest.approx(1e-3, rel=1e-6)
    late[19]["loss"] *= 1 + 1e-3  # step 20, the last one compared
    assert not loop.check_against_reference(cfg, late, snapshot, full)["passed"]


# ---- the job: PASS exits 0, FAIL exits 1 (each spawns mpiexec -n 2) ------------------------------------

def test_spawns_mpiexec_a_correct_layout_passes_and_a_nudged_one_fails_with_exit_code_1():
    args = ["train", "--dp", "2", "--steps", "3", "--precision", "fp32", "--check-reference", *SMALL]
    passed = minipar(*args, ranks=2)
    assert passed.returncode == 0, passed.stderr
    verdict = "check against one process: PASS over steps 1..3 (tolerance 4.8e-06)"
    assert verdict in passed.stdout, passed.stdout
    failed = minipar(*args, ranks=2, env={"MINIPAR_FAULT": "rank:0,step:1,nudge:1e-3"})
    assert failed.returncode == 1, failed.stderr
    assert "check against one process: FAIL over steps 1..3" in failed.stdout, failed.stdout
    assert failed.stderr.count("--check-reference: FAIL, the layout deviates") == 1, failed.stderr
