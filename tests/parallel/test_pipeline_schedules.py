"""Interleaved 1F1B and ZB-H1 run by the executor train to the single-process losses and weights.

    mpiexec -n K python -m pytest -m mpi tests/parallel/test_pipeline_schedules.py   # K = 2, 4, 8

Alone on K pipeline ranks (groups of K neighbouring ranks, each a whole job), and inside 3D layouts
with data parallelism (DDP, ZeRO-1, ZeRO-2: their gradients must wait for W) and tensor parallelism.
The ledger's messages are checked against the count written by hand: with V chunks rank s sends one
activation forward from each chunk but the very last, and one gradient back from each but the first.
"""

import mpi_harness
import numpy as np
import pytest
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_harness import mpi_given, needs_world_size
from one_process import assert_trains_like_one_process

from minipar.core.nn import MLPConfig, MLPNet
from minipar.distributed.grid import factorisations
from minipar.parallel.pipeline import build_stage
from minipar.trainer.config import TrainConfig
from minipar.trainer.loop import Trainer
from minipar.trainer.validate import validate

WORLD = MPI.COMM_WORLD
PIPELINE_SIZES = [k for k in (2, 4) if mpi_harness.WORLD.size % k == 0]


def schedule_config(stages, schedule, virtual, rounds, model, seed, **changes):
    """K·V chunks need that many units: a GPT has n_layer + 2, an MLP n_layer."""
    chunks = stages * virtual
    microbatches = rounds * stages
    cfg = TrainConfig(model=model, dp=1, pp=stages, microbatches=microbatches, schedule=schedule,
                      virtual_stages=virtual, precision="fp64", steps=2, batch_size=microbatches,
                      seq_len=6, n_layer=max(2, chunks - 2) if model == "gpt" else max(2, chunks),
                      n_head=2, d_model=8, seed=seed, quiet=True)
    return cfg.replace(**changes)


def run_in_groups(cfg):
    size = cfg.dp * cfg.tp * cfg.pp
    group = WORLD.Split(WORLD.rank // size, WORLD.rank)
    try:
        assert validate(cfg, size) == []
        trainer = Trainer(cfg, group)
        records = trainer.run()
        full = trainer.full_state()
        if group.rank == 0:
            assert_trains_like_one_process(cfg, records, full)
        return trainer, records
    finally:
        group.Free()


@needs_world_size(2, 4, 8)
@mpi_given(max_examples=4, stages=st.sampled_from(PIPELINE_SIZES),
           schedule=st.sampled_from(["interleaved", "zb-h1"]), virtual=st.sampled_from([2, 3]),
           rounds=st.integers(1, 2), model=st.sampled_from(["gpt", "mlp"]), seed=st.integers(0, 2**16))
def test_schedules_train_to_the_single_process_result(stages, schedule, virtual, rounds, model, seed):
    virtual = virtual if schedule == "interleaved" else 1
    cfg = schedule_config(stages, schedule, virtual, rounds, model, seed)
    trainer, records = run_in_groups(cfg)
    s, m = trainer.grid.pp_rank, cfg.microbatches
    sends = m * (2 * virtual - (s == 0) - (s == stages - 1))
    assert records[-1]["comm"]["messages"] == sends
    boundary_bytes = cfg.d_model * 8 * (cfg.seq_len if model == "gpt" else 1)  # one sequence a micro-batch
    assert records[-1]["comm"]["by_dim"]["pp"] == sends * boundary_bytes
    timing = records[-1]["pipeline"]
    expected = (stages - 1) / (3 * m + stages - 1) if schedule == "zb-h1" else \
        (stages - 1) / (virtual * m + stages - 1)
    assert timing["bubble_formula"] == pytest.approx(expected)


LAYOUTS = [(dp, pp, tp) for dp, pp, tp in factorisations(WORLD.size) if pp > 1 and dp * tp > 1]


@needs_world_size(4, 8)
@pytest.mark.parametrize("schedule, zero", [("interleaved", 1), ("zb-h1", 1), ("zb-h1", 2)])
@mpi_given(max_examples=2, layout=st.sampled_from(LAYOUTS or [(2, 2, 1)]), seed=st.integers(0, 2**16))
def test_schedules_inside_3d_layouts(schedule, zero, layout, seed):
    dp, pp, tp = layout
    virtual = 2 if schedule == "interleaved" else 1
    if dp == 1:  # no data parallelism to shard over: ZeRO has nothing to do, tensor parallelism does
        zero = 0
    cfg = schedule_config(pp, schedule, virtual, 1, "gpt", seed, dp=dp, tp=tp, zero=zero, n_head=2 * tp,
                          batch_size=2 * pp * dp)
    _, records = run_in_groups(cfg)
    if zero == 2 and schedule == "zb-h1":
        # ZeRO-2's hook must fire after W: fired after B it would send empty gradients, and the step
        # would send the real ones again (same numbers, but twice the traffic and no memory saved)
        _, plain = run_in_groups(cfg.replace(schedule="1f1b"))
        assert records[-1]["comm"]["by_dim_op"]["dp"] == plain[-1]["comm"]["by_dim_op"]["dp"]


@needs_world_size(2)
@pytest.mark.mpi
@pytest.mark.parametrize("model, microbatches", [("gpt", 4), ("mlp", 2)])
def test_zb_v_trains_to_the_single_process_result(model, microbatches):
    # K = 2 ranks, 4 chunks as a V; M = 2 is fewer than the 2K-1 that fill the V (actions dropped)
    cfg = TrainConfig(model=model, dp=1, pp=2, microbatches=microbatches, schedule="zb-v", precision="fp64",
                      steps=2, batch_size=microbatches, seq_len=6, n_layer=2 if model == "gpt" else 4,
                      n_head=2, d_model=8, seed=11, quiet=True)
    _, records = run_in_groups(cfg)
    # each rank sends from both chunks both ways, but the turn of the V on rank K-1 and the loss on
    # rank 0 send nothing: 2 of the 4 boundaries cross ranks, 2M messages a rank
    assert records[-1]["comm"]["messages"] == 2 * microbatches
    assert records[-1]["pipeline"]["formula"] == "(K-1)/(6M+K-1)"
    if microbatches >= 3:  # the V filled: each rank holds 2K chunk micro-batches, 1F1B's rank 0's K stages
        assert records[-1]["pipeline"]["stage_peak_inflight"] == [4, 4]


@needs_world_size(2)
@pytest.mark.mpi
@pytest.mark.parametrize("model, microbatches, overlap",
                         [("gpt", 4, True), ("mlp", 5, False), ("moe", 4, True)])
def test_dualpipev_trains_to_the_single_process_result(model, microbatches, overlap):
    # the F&B steps run one micro-batch's forward and another's whole backward, receives posted first
    cfg = TrainConfig(model=model, dp=1, pp=2, microbatches=microbatches, schedule="dualpipev",
                      precision="fp64", steps=2, batch_size=microbatches, seq_len=6,
                      n_layer=2 if model == "gpt" else 4, n_head=2, d_model=8, seed=3, quiet=True,
                      no_overlap=not overlap)
    _, records = run_in_groups(cfg)
    assert records[-1]["comm"]["messages"] == 2 * microbatches  # as ZB-V: 2 of 4 boundaries cross ranks
    labels = [label for label, _, _ in records[-1]["pipeline"]["stage_action_times_s"][0]]
    assert "F3.0" in labels and "BW1.1" in labels  # rank 0's F&B (F3.0 & BW1.1), timed part by part
    assert records[-1]["pipeline"]["stage_peak_inflight"] == [5, 5]  # the DualPipe README's PP + 1, PP = 2K
    assert_f_and_b_overlaps(records[-1]["pipeline"], microbatches, overlap)


def assert_f_and_b_overlaps(timing, microbatches, overlap):
    """Inside each F&B the backward's receive is posted before the forward computes and waited only
    after it: the message travels while the other micro-batch's forward runs (and the forward's output
    is sent, not waited for, before the backward computes). With --no-overlap nothing is posted early."""
    k = 2
    for rank, actions in enumerate(timing["stage_action_times_s"]):
        overlaps = timing["stage_overlaps_s"][rank]
        # rank s's F&B steps in torch's order: two in each of M-2K+s+1 steady rounds, one in each of
        # K-s-1 drain rounds, less rank K-1's very first, run as two plain steps
        assert len(overlaps) == 2 * (microbatches - 2 * k + rank + 1) + (k - rank - 1) - (rank == k - 1)
        times = {label: (start, stop) for label, start, stop in actions}
        for label, posted, waited, receive_posted in overlaps:
            forward, backward = label.split("&")
            assert posted <= times[forward][0] and times[forward][1] <= waited <= times[backward][0], label
            # K = 2: rank 0's chunk 0 and rank 1's chunk 1 receive their gradient from the other rank;
            # rank 0's chunk 1 starts from the loss and rank 1's chunk 0 from the turn of the V
            crosses = backward.endswith(".0") if rank == 0 else backward.endswith(".1")
            assert receive_posted is (overlap if crosses else None), label


@needs_world_size(4)
@pytest.mark.mpi
@pytest.mark.parametrize("zero", [0, 1, 2])
@pytest.mark.parametrize("schedule, microbatches", [("zb-v", 3), ("dualpipev", 4)])
def test_v_schedules_with_ddp_and_zero_on_dp_2_pp_2(schedule, microbatches, zero):
    """dp 2 as DDP, ZeRO-1 and ZeRO-2, each to one process, and the dp bytes by hand (fp64, 8 bytes a
    value; on 2 ranks a ring all-reduce of S bytes sends S, a reduce-scatter or an all-gather S/2).
    DDP: S, all-reduced at the step. ZeRO-1: S/2 + S/2. ZeRO-2: each unit's gradients reduce-scattered
    when backward has left it, W included, once per micro-batch (the embedding's, whose input needs no
    gradient, once at the step), then the all-gather. A hook fired after B would send twice."""
    cfg = TrainConfig(model="gpt", dp=2, pp=2, zero=zero, microbatches=microbatches, schedule=schedule,
                      precision="fp64", steps=2, batch_size=2 * microbatches, seq_len=6, n_layer=2, n_head=2,
                      d_model=8, seed=5, quiet=True)
    trainer, records = run_in_groups(cfg)
    sizes = {name: sum(p.data.size for p in unit.parameters()) for name, unit in trainer.engine.model.units()}
    held = sum(sizes.values())
    expected = 8 * held
    if zero == 2:
        sent = sum(size * (1 if name == "embed" else microbatches) for name, size in sizes.items())
        expected = 8 * (sent // 2 + held // 2)
    assert records[-1]["comm"]["by_dim"]["dp"] == expected, (records[-1]["comm"]["by_dim_op"]["dp"], sizes)


@needs_world_size(4)
@pytest.mark.mpi
@pytest.mark.parametrize("schedule, model, changes", [
    ("zb-v", "gpt", {"tp": 2}), ("dualpipev", "gpt", {"tp": 2}),
    ("zb-v", "moe", {"dp": 2, "ep": 2}), ("dualpipev", "moe", {"dp": 2, "ep": 2})])
def test_v_schedules_with_tp_2_and_with_ep_2(schedule, model, changes):
    """The V's chunks under tensor parallelism (a chunk's all-reduces inside its F, B and W) and under
    expert parallelism (a chunk's all-to-alls, inside DualPipeV's F&B too): the single process's losses
    and weights, 1e-9, and every rank's log shows the tp or ep bytes beside the pipeline's."""
    microbatches = 4
    dp = changes.get("dp", 1)
    # 4 blocks for the V's 4 chunks: every rank holds blocks, so every rank's log shows the tp or ep bytes
    cfg = TrainConfig(model=model, pp=2, microbatches=microbatches, schedule=schedule, precision="fp64",
                      steps=2, batch_size=dp * microbatches, seq_len=6, n_layer=4, n_head=2, d_model=8,
                      seed=7, quiet=True, **{"dp": 1, **changes})
    _, records = run_in_groups(cfg)
    dims = records[-1]["comm"]["by_dim"]
    assert dims["pp"] > 0 and dims.get("tp" if "tp" in changes else "ep", 0) > 0, dims


@needs_world_size(4)
@pytest.mark.mpi
@pytest.mark.parametrize("schedule, model", [("zb-v", "gpt"), ("dualpipev", "gpt"), ("zb-v", "moe"),
                                             ("dualpipev", "moe")])
def test_v_schedules_on_pp_4(schedule, model):
    """K = 4: 8 chunks, M = 2K = 8. Messages by hand: chunk 0 of rank s sends activations to s+1 and
    gradients to s-1, chunk 1 the other way; the loss on rank 0 and the turn of the V on rank K-1 send
    nothing, so the two end ranks send 2M and the two middle ones 4M. Peaks: 2K pairs (ZB-V), 2K + 1
    (DualPipeV, the DualPipe README's PP + 1)."""
    k, microbatches = 4, 8
    cfg = TrainConfig(model=model, dp=1, pp=k, microbatches=microbatches, schedule=schedule, precision="fp64",
                      steps=2, batch_size=microbatches, seq_len=6, n_layer=6, n_head=2, d_model=8, seed=13,
                      quiet=True)
    trainer, records = run_in_groups(cfg)
    s = trainer.grid.pp_rank
    assert records[-1]["comm"]["messages"] == (2 if s in (0, k - 1) else 4) * microbatches
    assert records[-1]["pipeline"]["stage_peak_inflight"] == [2 * k + (schedule == "dualpipev")] * k


@needs_world_size(8)
@pytest.mark.mpi
@pytest.mark.parametrize("schedule, model, changes", [
    ("zb-v", "gpt", {"tp": 2}), ("dualpipev", "gpt", {"tp": 2}),
    ("zb-v", "moe", {"dp": 2, "ep": 2, "zero": 1}), ("dualpipev", "moe", {"dp": 2, "ep": 2, "zero": 1})])
def test_v_schedules_on_pp_4_with_tp_2_and_with_ep_2_and_zero_1(schedule, model, changes):
    """pp 4 inside the layouts: tp 2 (GPT), and dp 2 with ZeRO-1 and ep 2 (MoE: experts sharded over
    edp, the rest over dp); the single process's losses and weights, 1e-9."""
    microbatches, dp = 8, changes.get("dp", 1)
    cfg = TrainConfig(model=model, pp=4, microbatches=microbatches, schedule=schedule, precision="fp64",
                      steps=2, batch_size=dp * microbatches, seq_len=6, n_layer=6, n_head=2, d_model=8,
                      seed=17, quiet=True, **{"dp": 1, **changes})
    trainer, records = run_in_groups(cfg)
    dims = records[-1]["comm"]["by_dim"]
    # 8 units for 8 chunks: rank 0 holds the embedding and the head, so only the others hold experts
    experts = any(".experts." in name for name, _ in trainer.engine.model.named_parameters())
    sends = dims.get("tp", 0) > 0 if "tp" in changes else (dims.get("ep", 0) > 0) == experts
    assert dims["pp"] > 0 and sends, dims


@needs_world_size(4)
@pytest.mark.mpi
def test_dualpipev_f_and_b_computes_one_part_while_the_others_all_to_all_is_in_flight():
    """DeepSeek-V3's overlap, read off the timing record: inside an F&B step (MoE, ep 2 in dp 2, pp 2)
    each part's first expert all-to-all is posted, then the other part computes (one of its compute
    stretches starts), and only then is the all-to-all waited for. With the turns off (--no-overlap)
    every all-to-all is waited at once, so the same check cannot pass. Both are exact to one process,
    and bit for bit the same: the turns move only the waits."""
    microbatches = 4
    cfg = TrainConfig(model="moe", dp=2, ep=2, pp=2, microbatches=microbatches, schedule="dualpipev",
                      precision="fp64", steps=2, batch_size=2 * microbatches, seq_len=6, n_layer=4, n_head=2,
                      d_model=8, seed=7, quiet=True)
    runs = {}
    for interleave in (True, False):
        trainer, records = run_in_groups(cfg.replace(no_overlap=not interleave))
        weights = {name: p.data.copy() for name, p in trainer.engine.model.named_parameters()}
        runs[interleave] = [record["loss"] for record in records], weights
        assert_all_to_alls_hidden(records[-1]["pipeline"], microbatches, interleave)
    (losses, weights), (plain_losses, plain_weights) = runs[True], runs[False]
    assert losses == plain_losses and all(np.array_equal(weights[n], plain_weights[n]) for n in weights)


def assert_all_to_alls_hidden(timing, microbatches, hidden_expected):
    for rank, exchanges in enumerate(timing["stage_exchanges_s"]):
        stretches = timing["stage_action_times_s"][rank]
        steps = {step for step, *_ in exchanges}
        # rank s's F&B steps (see assert_f_and_b_overlaps); each part's chunk holds an MoE block here
        assert len(steps) == 2 * (microbatches - 4 + rank + 1) + (1 - rank) - (rank == 1), steps
        for step in steps:
            forward, backward = step.split("&")
            for part, other in ((forward, backward), (backward, forward)):
                posted, waited = next((p, w) for s, q, p, w in exchanges if (s, q) == (step, part))
                hidden = any(label == other and posted <= start <= waited for label, start, _ in stretches)
                assert hidden is hidden_expected, (rank, step, part, posted, waited)


def test_v_stage_holds_chunks_s_and_2k_minus_1_minus_s():
    names = [build_stage(MLPNet(MLPConfig(d_hidden=8, n_layer=4), seed=None), 2, s, 2, "v").chunk_units
             for s in range(2)]
    assert names == [[["layers.0"], ["layers.3"]], [["layers.1"], ["layers.2"]]]
    assert build_stage(MLPNet(MLPConfig(d_hidden=8, n_layer=4), seed=None), 2, 0, 2, "v").is_last


def test_interleaved_stage_holds_its_round_robin_chunks():
    model = MLPNet(MLPConfig(d_hidden=8, n_layer=6), seed=None)  # 6 equal units, 3 chunks on 2 ranks
    names = [build_stage(MLPNet(MLPConfig(d_hidden=8, n_layer=6), seed=None), 2, s, 3).chunk_units
             for s in range(2)]
    assert names == [[["layers.0"], ["layers.2"], ["layers.4"]], [["layers.1"], ["layers.3"], ["layers.5"]]]
    assert len(model.units()) == 6


@pytest.mark.parametrize("changes, message", [
    ({"schedule": "interleaved", "pp": 2, "microbatches": 2},
     "--schedule interleaved needs --virtual-stages"),
    ({"schedule": "interleaved", "pp": 2, "virtual_stages": 2, "microbatches": 3, "batch_size": 6},
     "--schedule interleaved needs --microbatches 3 to be a multiple of --pp 2"),
    ({"schedule": "interleaved", "pp": 2, "virtual_stages": 4, "microbatches": 2, "n_layer": 4},
     "--pp 2 x --virtual-stages 4 = 8 chunks is more than the model's 6 blocks"),
    ({"schedule": "1f1b", "pp": 2, "virtual_stages": 2}, "--virtual-stages 2 needs --schedule interleaved"),
    ({"virtual_stages": 0}, "--virtual-stages must be a positive integer"),
    ({"schedule": "zb-h1", "pp": 2, "dp": 2, "zero": 3}, "--schedule zb-h1 runs with --zero 0, 1 or 2"),
    ({"schedule": "zb-v", "pp": 2, "dp": 2, "zero": 3}, "--schedule zb-v runs with --zero 0, 1 or 2"),
    ({"schedule": "dualpipev", "pp": 2, "microbatches": 3, "batch_size": 6},
     "--schedule dualpipev needs --microbatches >= 2 x --pp = 4, got 3"),
    ({"schedule": "zb-v", "pp": 4, "model": "mlp", "n_layer": 6, "microbatches": 4},
     "--schedule zb-v cuts the model into 2 x --pp 4 = 8 chunks, more than its 6 blocks"),
])
def test_validate_names_the_schedule_mistake(changes, message):
    cfg = TrainConfig(**changes)
    errors = validate(cfg, cfg.resolved(cfg.pp * (cfg.dp or 1)).dp * cfg.pp)
    assert len(errors) == 1 and errors[0].startswith(message), errors
