"""Pipeline parallelism: partition, stages, executor against single-process training, errors."""

import gc
import itertools
import subprocess
import sys
import time
import weakref
from pathlib import Path

import mpi_harness
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_harness import at_world_size, mpi_given, mpi_test, needs_world_size

from minipar.core.nn import GPT, GPTConfig, MLPConfig, MLPNet
from minipar.distributed.communicator import Comm
from minipar.parallel.api import MicrobatchRunner
from minipar.parallel.pipeline import (
    PipelineRunner,
    PipelineStage,
    bubble_formula,
    build_stage,
    partition,
    unit_cost,
)
from minipar.parallel.schedules import bubble_fraction, build_schedule, simulate
from minipar.parallel.tensor_gpt import TensorParallelGPT
from minipar.trainer.config import TrainConfig
from minipar.trainer.loop import Trainer, compare_with_reference
from minipar.trainer.validate import validate

MPIEXEC = str(Path(sys.executable).parent / "mpiexec")


def stage_costs(costs, bounds):
    """The stages' costs, costliest first."""
    return sorted((sum(costs[r.start:r.stop]) for r in bounds), reverse=True)


def brute_force_best(costs, stages):
    """The best stage costs (costliest first, compared lexicographically) over every way to cut."""
    every_cut = itertools.combinations(range(1, len(costs)), stages - 1)
    edges = [(0, *cuts, len(costs)) for cuts in every_cut]
    return min(stage_costs(costs, [range(a, b) for a, b in zip(e, e[1:])]) for e in edges)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 100), min_size=1, max_size=9), st.data())
def test_partition_is_contiguous_nonempty_and_balanced(costs, data):
    stages = data.draw(st.integers(1, len(costs)))
    bounds = partition(costs, stages)
    assert len(bounds) == stages
    assert bounds[0].start == 0 and bounds[-1].stop == len(costs)
    assert all(len(r) > 0 for r in bounds)
    assert all(a.stop == b.start for a, b in zip(bounds, bounds[1:]))
    assert stage_costs(costs, bounds) == brute_force_best(costs, stages)
    assert partition(list(costs), stages) == bounds  # deterministic: every rank cuts the same


def test_partition_rejects_more_stages_than_units():
    with pytest.raises(ValueError, match="cannot cut 3 units into 4"):
        partition([1, 2, 3], 4)


def tiny_gpt(vocab_size=13, n_layer=2):
    cfg = GPTConfig(vocab_size=vocab_size, block_size=8, n_layer=n_layer, n_head=2, d_model=16)
    return GPT(cfg, seed=None)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_stages_keep_global_names_and_the_initial_weights(stages):
    reference = tiny_gpt().init_parameters(seed=5).state_dict()
    pieces = [build_stage(tiny_gpt(), stages, s).init_parameters(seed=5).state_dict() for s in range(stages)]
    names = [name for piece in pieces for name in piece]
    assert sorted(names) == sorted(reference) and len(names) == len(set(names))
    for piece in pieces:
        for name, value in piece.items():
            assert np.array_equal(value, reference[name]), name


def test_a_stage_holds_only_its_units():
    stage = build_stage(tiny_gpt(n_layer=4), 3, 1)
    assert isinstance(stage, PipelineStage) and not stage.is_last
    assert [name for name, _ in stage.units()] == ["blocks.1", "blocks.2"]
    assert all(name.startswith(("blocks.1.", "blocks.2.")) for name, _ in stage.named_parameters())


@pytest.mark.parametrize("tensor_parallel", [False, True])
def test_the_other_stages_units_are_freed(tensor_parallel):
    """A stage keeps its own units only, even when the model's loss is a method (tensor parallelism's)."""
    cfg = GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=2, d_model=16)
    model = TensorParallelGPT(cfg, Comm(MPI.COMM_SELF, "tp"), None) if tensor_parallel else GPT(cfg, None)
    dropped = [weakref.ref(model), weakref.ref(model.embed), weakref.ref(model.blocks[0])]
    last = build_stage(model, 3, 2)
    del model
    gc.collect()
    assert [ref() for ref in dropped] == [None, None, None]
    assert [name for name, _ in last.units()] == ["blocks.1", "head"]
    logits = last(np.random.default_rng(0).standard_normal((2, 8, 16)))
    assert last.loss(logits, np.zeros((2, 8), dtype=np.int64), 16).data.shape == ()


def test_embedding_and_head_count_as_blocks():
    """With a large vocabulary the embedding and the head are the costliest units: each gets a stage."""
    big_vocab = tiny_gpt(vocab_size=4000, n_layer=4)
    assert unit_cost(big_vocab.embed) > 4 * unit_cost(big_vocab.blocks[0])
    costs = [unit_cost(unit) for _, unit in big_vocab.units()]
    assert partition(costs, 3) == [range(0, 1), range(1, 5), range(5, 6)]
    assert partition(costs, 4) == [range(0, 1), range(1, 3), range(3, 5), range(5, 6)]
    small_vocab = tiny_gpt(vocab_size=13, n_layer=4)
    costs = [unit_cost(unit) for _, unit in small_vocab.units()]
    assert partition(costs, 4) == [range(0, 2), range(2, 3), range(3, 4), range(4, 6)]


@given(st.integers(1, 12), st.integers(1, 40), st.sampled_from(["gpipe", "1f1b"]))
def test_bubble_formula_is_the_simulated_bubble(stages, microbatches, schedule):
    timeline = simulate(build_schedule(schedule, stages, microbatches))
    assert bubble_formula(stages, microbatches) == bubble_fraction(timeline)


@pytest.mark.parametrize("schedule", ["naive", "gpipe", "1f1b"])
@pytest.mark.parametrize("model_kind", ["gpt", "mlp"])
def test_one_stage_runner_equals_the_plain_loop(schedule, model_kind):
    """On one stage the executor is gradient accumulation: the same loss and gradients."""
    if model_kind == "gpt":
        def make():
            return tiny_gpt().init_parameters(seed=1)
        inputs = np.random.default_rng(0).integers(0, 13, (8, 8))
        targets = np.random.default_rng(1).integers(0, 13, (8, 8))
        normaliser = targets.size
    else:
        def make():
            return MLPNet(MLPConfig(d_hidden=16, n_layer=3), seed=1)
        inputs = np.random.default_rng(0).standard_normal((8, 16))
        targets = np.random.default_rng(1).standard_normal((8, 4))
        normaliser = len(targets)
    plain, piped = make(), build_stage(make(), 1, 0)
    expected = MicrobatchRunner(plain, 4).forward_backward(inputs, targets, normaliser)
    runner = PipelineRunner(piped, Comm(MPI.COMM_SELF, "pp"), schedule, 4, 16, "float64")
    assert runner.forward_backward(inputs, targets, normaliser) == pytest.approx(expected, rel=1e-12)
    grads = dict(plain.named_parameters())
    for name, p in piped.named_parameters():
        np.testing.assert_allclose(p.grad, grads[name].grad, rtol=1e-10, atol=1e-14)
    assert runner.timing()["bubble_formula"] == 0.0
    assert runner.comm.ledger.step_report()["sent_bytes"] == 0


def test_activation_shape_follows_the_batch_axes():
    stage = build_stage(tiny_gpt(), 1, 0)
    runner = PipelineRunner(stage, Comm(MPI.COMM_SELF, "pp"), "1f1b", 1, 16, "float64")
    assert runner.activation_shape(np.zeros((3, 8), dtype=np.int64)) == (3, 8, 16)
    assert runner.activation_shape(np.zeros((3, 5))) == (3, 16)


@pytest.mark.parametrize("changes, message", [
    ({"pp": 2, "microbatches": 3, "batch_size": 8},
     "the per-replica batch 8 is not divisible by --microbatches 3"),
    ({"pp": 8, "n_layer": 4},
     "--pp 8 is more stages than the model's 6 blocks (embedding, 4 layers and head)"),
    ({"pp": 4, "model": "mlp", "n_layer": 3}, "--pp 4 is more stages than the model's 3 blocks (3 layers)"),
])
def test_validate_names_the_pipeline_mistake(changes, message):
    cfg = TrainConfig(**changes)
    errors = validate(cfg, cfg.pp)
    assert len(errors) == 1 and errors[0].startswith(message)


def test_bad_pipeline_input_is_one_line_and_exit_2_on_every_rank():
    done = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "minipar", "train", "--pp", "2",
                           "--microbatches", "3", "--batch-size", "8"],
                          capture_output=True, text=True, timeout=120, env={"MPIEXEC_TIMEOUT": "60"})
    assert done.returncode == 2
    lines = done.stderr.replace("minipar train:", "\nminipar train:").split("\n")
    lines = [line for line in lines if line.strip()]
    assert lines == ["minipar train: error: the per-replica batch 8 is not divisible by --microbatches 3"] * 2


# ---- multi-rank: real pipelines under mpiexec ---------------------------------------------------

PIPELINE_SIZES = [k for k in (2, 4) if mpi_harness.WORLD.size % k == 0]


def pipeline_config(stages, microbatches, schedule, model, per_microbatch, seed, **changes):
    cfg = TrainConfig(model=model, dp=1, pp=stages, microbatches=microbatches, schedule=schedule,
                      precision="fp64", steps=2, batch_size=microbatches * per_microbatch, seq_len=8,
                      n_layer=2 if model == "gpt" else 4, n_head=2, d_model=16, seed=seed, quiet=True)
    return cfg.replace(**changes)


def run_in_groups(comm, cfg):
    """Train cfg on groups of cfg.dp*cfg.tp*cfg.pp neighbouring ranks; each group is one whole job."""
    size = cfg.dp * cfg.tp * cfg.pp
    group = comm.mpi.Split(comm.rank // size, comm.rank)
    try:
        trainer = Trainer(cfg, group)
        records = trainer.run()
        full = trainer.full_state()
        check = compare_with_reference(cfg, records, full) if group.rank == 0 else None
        return trainer, records, full, check
    finally:
        group.Free()


def assert_matches_reference(full, check):
    if check is None:
        return
    assert check["max_rel_loss_deviation"] <= 1e-9, check
    assert check["max_rel_weight_deviation"] <= 1e-9, check


def assert_messages_arrive_before_use(stage_actions, shared_clock: bool):
    """Causality across stages, read off the measured Gantt chart of a plain pipeline (F and B, one chunk).

    By the definition of a pipeline, stage s's forward of micro-batch m cannot start before stage s-1's
    forward of m has stopped (it needs that activation), nor stage s-1's backward of m before stage s's
    has stopped (it needs that gradient). With a clock offset d of stage s's times behind stage s-1's,
    that is d >= F_{s-1}(m).stop - F_s(m).start and d <= B_{s-1}(m).start - B_s(m).stop for every m.
    On one host the runner puts every stage on one clock (record_timing), so d = 0 must satisfy them, to
    the microsecond and with no tolerance: a start recorded before its receive completed, or a stage's
    times left on its own start (barrier exits differ by up to milliseconds on a loaded machine), fails.
    Across hosts each stage keeps its own start, and the check asks only that some constant d exists (the
    largest lower bound at most the smallest upper bound: a forward's gap plus a backward's is free of d).
    """
    times = [{label: (start, stop) for label, start, stop in actions} for actions in stage_actions]
    for stage in range(1, len(times)):
        before, after = times[stage - 1], times[stage]
        microbatches = sorted({int(label[1:]) for label in after})  # "F3" -> 3 (a chunk's "F3.1" raises)
        behind_at_least, forward = max((before[f"F{m}"][1] - after[f"F{m}"][0], m) for m in microbatches)
        behind_at_most, backward = min((before[f"B{m}"][0] - after[f"B{m}"][1], m) for m in microbatches)
        if shared_clock:  # one clock: the offset is 0
            causal = behind_at_least <= 0.0 <= behind_at_most
        else:
            causal = behind_at_least <= behind_at_most
        assert causal, (
            f"stages {stage - 1} and {stage} (shared clock: {shared_clock}): no clock offset lets every "
            f"message arrive before it is used: F{forward} needs stage {stage}'s clock at least "
            f"{behind_at_least * 1e6:.1f} us behind stage {stage - 1}'s, B{backward} at most "
            f"{behind_at_most * 1e6:.1f} us")


@needs_world_size(2, 4, 8)
@mpi_given(max_examples=12, examples=[  # edges random draws can miss: GPipe M >= 2 on 2 stages, 1F1B on 4
    at_world_size((2, 4, 8),
                  stages=2, microbatches=2, schedule="gpipe", model="gpt", per_microbatch=1, seed=0),
    at_world_size((4, 8), stages=4, microbatches=5, schedule="1f1b", model="gpt", per_microbatch=1, seed=1)],
           stages=st.sampled_from(PIPELINE_SIZES), microbatches=st.integers(1, 8),
           schedule=st.sampled_from(["naive", "gpipe", "1f1b"]), model=st.sampled_from(["gpt", "mlp"]),
           per_microbatch=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_pipeline_trains_to_the_single_process_losses_and_weights(comm, stages, microbatches, schedule,
                                                                  model, per_microbatch, seed):
    cfg = pipeline_config(stages, microbatches, schedule, model, per_microbatch, seed)
    trainer, records, full, check = run_in_groups(comm, cfg)
    assert_matches_reference(full, check)
    # Each boundary carries one activation forward and one gradient back per micro-batch.
    stage = trainer.grid.pp_rank
    run = 1 if schedule == "naive" else microbatches
    batch_axes = (cfg.batch_size // run, cfg.seq_len) if model == "gpt" else (cfg.batch_size // run,)
    boundary_bytes = int(np.prod(batch_axes)) * cfg.d_model * 8
    sends = (stage < stages - 1) + (stage > 0)
    assert records[-1]["comm"]["by_dim"].get("pp", 0) == run * sends * boundary_bytes
    assert records[-1]["comm"]["sent_bytes"] == run * sends * boundary_bytes
    timing = records[-1]["pipeline"]
    assert timing["bubble_formula"] == pytest.approx((stages - 1) / (run + stages - 1))
    assert len(timing["stage_busy_s"]) == stages
    assert min(timing["stage_forward_s"]) > 0 and min(timing["stage_backward_s"]) > 0
    forward, backward = timing["stage_forward_s"], timing["stage_backward_s"]
    assert timing["stage_busy_s"] == [f + b for f, b in zip(forward, backward)]
    assert 0.0 < timing["bubble_measured"] < 1.0
    assert 0.0 < timing["busy_s"] <= timing["makespan_s"]
    # the measured Gantt chart: each stage's actions in its schedule's order, one after another within
    # the step, their durations adding up to the stage's busy time
    for table, actions, busy in zip(build_schedule(schedule, stages, run), timing["stage_action_times_s"],
                                    timing["stage_busy_s"]):
        assert [label for label, _, _ in actions] == [str(action) for action in table]
        edges = [edge for _, start, stop in actions for edge in (start, stop)]
        assert edges == sorted(edges) and 0.0 <= edges[0] and edges[-1] <= timing["makespan_s"]
        assert sum(stop - start for _, start, stop in actions) == pytest.approx(busy, rel=1e-9)
    # and across stages: every activation and gradient used after it was made, on one clock (one host)
    assert timing["time_base"] == "shared"
    assert_messages_arrive_before_use(timing["stage_action_times_s"], shared_clock=True)


LATE_S = 0.05  # stage 1 leaves the barrier this long after stage 0


@needs_world_size(2)
@mpi_test
def test_a_stage_that_starts_late_is_charted_late_and_idle_on_one_clock(comm, monkeypatch):
    """Stage 1 sleeps LATE_S after the barrier before its step, so it really starts that much later.
    On one host the chart is on one clock (record_timing): stage 1's first action starts at LATE_S or
    later, every message is still used after it was made, and the makespan counts the wait, which
    stage 0 spends idle waiting for stage 1. Counted from each stage's own start instead, stage 1's
    first action would be charted at about 0, and the wait would be missing from the makespan."""
    cfg = pipeline_config(2, 2, "gpipe", "mlp", 2, seed=0, steps=1)
    trainer = Trainer(cfg, comm.mpi)
    runner = trainer.engine.runner
    if comm.rank == 1:
        barrier = runner.comm.barrier
        monkeypatch.setattr(runner.comm, "barrier", lambda: (barrier(), time.sleep(LATE_S)))
    timing = trainer.run()[-1]["pipeline"]
    assert timing["time_base"] == "shared"
    assert_messages_arrive_before_use(timing["stage_action_times_s"], shared_clock=True)
    stage_0, stage_1 = timing["stage_action_times_s"]
    # 0.8 LATE_S: stage 0 too may leave the barrier late, by up to milliseconds on a loaded machine;
    # counted from stage 1's own start, its first action would read about 0
    assert stage_1[0][1] >= 0.8 * LATE_S and stage_0[0][1] < LATE_S  # stage 0's first forward needs nobody
    assert timing["makespan_s"] >= 0.8 * LATE_S + sum(stop - start for _, start, stop in stage_1)
    assert timing["bubble_measured"] > 0.5  # both stages wait out LATE_S, far above their tiny compute
    # said to be on two nodes, whose clocks cannot be compared: each stage keeps its own start
    monkeypatch.setattr(runner.comm, "nodes", ["node-a", "node-b"])
    timing = trainer.run()[-1]["pipeline"]
    assert timing["time_base"] == "per stage" and timing["stage_action_times_s"][1][0][1] < LATE_S
    assert_messages_arrive_before_use(timing["stage_action_times_s"], shared_clock=False)


@needs_world_size(2, 4, 8)
@mpi_given(max_examples=6, schedule=st.sampled_from(["gpipe", "1f1b"]), microbatches=st.integers(1, 6),
           model=st.sampled_from(["gpt", "mlp"]))
def test_activations_held_are_the_microbatches_in_flight(comm, schedule, microbatches, model):
    """Stage s's activation peak is (micro-batches in flight) x (one micro-batch's activations):
    M for GPipe, min(K - s, M) for 1F1B."""
    stages = 2
    one = pipeline_config(stages, 1, "naive", model, 2, seed=0, steps=1)
    many = pipeline_config(stages, microbatches, schedule, model, 2, seed=0, steps=1)
    _, one_records, _, _ = run_in_groups(comm, one)
    trainer, many_records, _, _ = run_in_groups(comm, many)
    stage = trainer.grid.pp_rank
    in_flight = microbatches if schedule == "gpipe" else min(stages - stage, microbatches)
    assert one_records[0]["mem"]["activations_peak"] > 0
    assert many_records[0]["mem"]["activations_peak"] == in_flight * one_records[0]["mem"]["activations_peak"]


@mpi_test
@needs_world_size(4, 8)
@pytest.mark.parametrize("layout", [dict(dp=2, tp=1), dict(dp=1, tp=2)])
def test_pipeline_composes_with_data_and_tensor_parallelism(comm, layout):
    cfg = pipeline_config(2, 2, "1f1b", "gpt", 2, seed=3, **layout)
    _, _, full, check = run_in_groups(comm, cfg)
    assert_matches_reference(full, check)
