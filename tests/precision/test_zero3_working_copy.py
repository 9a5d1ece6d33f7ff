"""bf16 and fp16 with ZeRO-3, chunked ZeRO-3 and FSDP: fp32 master shards, the 16-bit working copy
gathered.

    pytest -m "not mpi" tests/precision/test_zero3_working_copy.py                    # one rank
    mpiexec -n K python -m pytest -m mpi tests/precision/test_zero3_working_copy.py    # K = 2, 4, 8

Each rank rounds its master shard and the 2-byte patterns are all-gathered (zero3.py, zero_chunked.py,
fsdp.py; precision/mixed.py's `parameter_wire`). The oracles: rounding being elementwise, a shard rounded then
gathered is, bit for bit, the whole rounded (what the single-process run and ZeRO 1-2, which hold
whole parameters, compute with); ZeRO-2 reduce-scatters the same fp32 gradients unit by unit as ZeRO-3,
so the two train bit for bit alike, and so do FSDP and ZeRO-3 on 2 ranks (the same sums of two); the
wire bytes and the model states are written from the formulas (2 bytes a gathered value, FSDP's shard
each parameter's rows padded to a multiple of N; p = 2, g = 4 and the fp32 master in K = 4 + 8 for
Adam).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_harness import at_world_size, mpi_given, mpi_test, needs_world_size

from minipar.core.shards import padded_numel
from minipar.distributed.ledger import ring_bytes_sent
from minipar.memory import planner
from minipar.precision.formats import round_to_bf16, round_to_fp16
from minipar.precision.mixed import parameter_wire
from minipar.trainer import build
from minipar.trainer import loop as train
from minipar.trainer.config import TrainConfig

WORLD = MPI.COMM_WORLD
ROUND = {"bf16": round_to_bf16, "fp16": round_to_fp16}
TOLERANCE = {"bf16": 8 * 2.0**-8, "fp16": 8 * 2.0**-11}  # --check-reference's, DESIGN.md
# enough training that the weights move more than 4 tolerances (measured: 50 u in bf16, 90 u in fp16),
# and no more: a larger step amplifies roundoff (DDP's 16-bit ring and ZeRO's fp32 reduce-scatter part
# by 9 u in fp16 at lr 1e-2 on 8 ranks; here at most 3.9 u in bf16 and 2 u in fp16)
TRAINING = {"bf16": {"lr": 1e-2, "steps": 5}, "fp16": {"lr": 3e-3, "steps": 3}}
LAYOUTS = {"zero3": {"zero": 3},  # chunked: small chunks, so that a unit spans several and moves
           "cpu": {"zero": 3, "offload": "cpu", "device_mem_mb": "auto", "chunk_mb": 0.004},
           "disk": {"zero": 3, "offload": "disk", "device_mem_mb": "auto", "chunk_mb": 0.004}}


def tiny(**changes) -> TrainConfig:
    """3 heads of 3: every unit's size is odd, so the shards are padded at every dp > 1."""
    base = TrainConfig(model="gpt", precision="bf16", n_layer=2, n_head=3, d_model=9, seq_len=8,
                       batch_size=8, steps=3, quiet=True, lr=1e-2)
    return base.replace(**changes)


def unit_sizes(cfg) -> list[int]:
    """Parameters per unit of the full model, counted on a model ZeRO never touched."""
    model = build.build_model(cfg.replace(dp=1, zero=0), None)
    return [sum(p.size for p in module.parameters()) for _, module in model.units()]


def flat_weights(full: dict) -> np.ndarray:
    return np.concatenate([full[name].reshape(-1) for name in sorted(full)])


def run(cfg: TrainConfig, comm) -> tuple[list, list, np.ndarray | None]:
    """(losses, the fp16 scaler's skips, the final weights on rank 0) of one run."""
    trainer = train.Trainer(cfg, comm)
    records = trainer.run()
    full = trainer.full_state()
    skips = [r["loss_scaling"]["skipped"] for r in records if "loss_scaling" in r]
    return [r["loss"] for r in records], skips, None if full is None else flat_weights(full)


# ---- one rank: nothing is sent, so everything is bit-equal ----

@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_one_rank_zero3_and_chunked_are_bit_equal_to_the_plain_16_bit_step(precision):
    """On one rank a gathered unit is the rank's own shard: the working copy must be the master rounded
    after every update (a fp32 unit gathered, or a shard rounded once and never again, move the
    losses), and the gradients are the plain step's."""
    cfg = tiny(precision=precision, dp=1, microbatches=2)
    plain = run(cfg, MPI.COMM_SELF)
    for name, layout in LAYOUTS.items():
        losses, skips, weights = run(cfg.replace(**layout), MPI.COMM_SELF)
        assert (losses, skips) == plain[:2], name
        np.testing.assert_array_equal(weights, plain[2], err_msg=name)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_one_rank_fsdp_in_16_bits_is_bit_equal_to_the_plain_step(precision):
    """FSDP's per-parameter rows on one rank are each parameter whole: its working copy must be the
    master rounded after every update, as ZeRO-3's."""
    cfg = tiny(precision=precision, dp=1, microbatches=2)
    losses, skips, weights = run(cfg.replace(fsdp=True), MPI.COMM_SELF)
    plain = run(cfg, MPI.COMM_SELF)
    assert (losses, skips) == plain[:2]
    np.testing.assert_array_equal(weights, plain[2])


def test_one_rank_zero3_in_bf16_holds_the_planners_bytes_for_16_bit_parameters_with_fp32_masters():
    cfg = tiny(dp=1, zero=3, n_head=2, d_model=16, steps=1)  # even units: no padding on one rank
    mem = train.Trainer(cfg, MPI.COMM_SELF).run()[0]["mem"]
    psi = sum(unit_sizes(cfg))
    # 2-byte shards of the working copy, fp32 gradients, and K = 4 (master) + 8 (AdamW's moments)
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (2 * psi, 4 * psi, 12 * psi)
    assert sum(mem[k] for k in ("params", "grads", "optimizer")) == planner.model_state_bytes(
        psi, 1, 3, k=12, param_bytes=2, grad_bytes=4)


def test_device_mem_mb_auto_in_bf16_is_two_half_chunks_below_fp32():
    """The warm-up's least budget peaks early in backward, with a chunk's parameter block in use, that
    chunk arriving and a chunk of gradients still held (lessons/08_memory.md): in bf16 the first two are
    2-byte values and the third is fp32 gradients, so the least budget is 2 x (chunk x 2 bytes) lower.
    Counting gathered units at the emulation's 4 bytes leaves it equal; forgetting that gradients widen
    a chunk back to 4 bytes lowers it by 3 half chunks."""
    cfg = TrainConfig(dp=1, zero=3, offload="cpu", device_mem_mb="auto", chunk_mb=0.25, batch_size=8,
                      seq_len=16, steps=1, quiet=True)
    least = {}
    for precision in ("fp32", "bf16"):
        trainer = train.Trainer(cfg.replace(precision=precision), MPI.COMM_SELF)
        trainer.run()
        least[precision] = trainer.engine.updater.tracer.minimum
        chunk_numel = trainer.engine.updater.chunks[0].numel
    assert chunk_numel == 0.25 * 2**20 // 4  # --chunk-mb counts fp32 values
    # The emulation's activations are fp32's but for one buffer per block: the softmax keeps its output
    # unrounded for its own backward, and the product with v saves the rounded one, a second (a, s, s)
    # buffer per sequence (fp32 has one buffer for both), all of them held early in backward.
    rounded_softmax = cfg.n_layer * cfg.batch_size * cfg.n_head * cfg.seq_len**2 * 4
    assert least["bf16"] == least["fp32"] - 2 * chunk_numel * 2 + rounded_softmax


# ---- multi-rank ----

@mpi_given(max_examples=4, precision=st.sampled_from(["bf16", "fp16"]), seed=st.integers(0, 2**16),
           numel=st.integers(1, 300))
def test_rounding_a_shard_then_gathering_equals_gathering_then_rounding(comm, precision, seed, numel):
    """Element by element, bits included: ties to even, subnormals, values past fp16's range, infinities,
    NaNs and signed zeros among ordinary ones; the gather sends 2 bytes a value, half of fp32's."""
    rng = np.random.default_rng(seed)
    padded = padded_numel(numel, comm.size)
    values = (rng.standard_normal(padded) * 2.0 ** rng.integers(-30, 20, padded)).astype(np.float32)
    edges = np.array([1 + 2**-8, 1 + 3 * 2**-8, 2**-25, 1.5 * 2**-25, 65520, -7e4, 1e-40, np.inf, -np.inf,
                      np.nan, -0.0, 0.0], np.float32)
    values[rng.integers(0, padded, edges.size)] = edges
    shard = np.split(values, comm.size)[comm.rank]
    wire = parameter_wire(precision)
    before = comm.ledger.total_report()["sent_bytes"]
    gathered = wire.decode(comm.all_gather(wire.encode(shard), numel=padded))
    sent = comm.ledger.total_report()["sent_bytes"] - before
    whole_rounded = ROUND[precision](values)
    np.testing.assert_array_equal(gathered.view(np.uint32), whole_rounded.view(np.uint32))
    assert sent == (comm.size - 1) * (padded // comm.size) * 2  # a ring's all-gather, 2-byte values


@mpi_given(max_examples=1, shrink=False, precision=st.sampled_from(["bf16", "fp16"]),
           layout=st.sampled_from(sorted(LAYOUTS)), microbatches=st.sampled_from([1, 2]),
           seed=st.integers(0, 2**16),
           examples=[at_world_size((2, 4, 8), precision="bf16", layout="zero3", microbatches=2, seed=1),
                     at_world_size((2, 4, 8), precision="fp16", layout="cpu", microbatches=1, seed=2),
                     at_world_size((2, 4, 8), precision="bf16", layout="disk", microbatches=1, seed=3)])
def test_zero3_and_chunked_in_16_bits_train_like_no_zero_on_the_same_layout(
        comm, precision, layout, microbatches, seed):
    """The first step's loss (the forward on the rounded initial weights) is bit-equal to DDP's and
    ZeRO-2's on the same ranks; ZeRO-3 trains bit for bit like ZeRO-2 (the same fp32 reduce-scatters,
    unit by unit), chunked ZeRO-3 too on 2 ranks (a sum of two is the same in any order); and all are
    within the precision's --check-reference tolerance of DDP and of one process, measured as it
    measures the weights (norm-relative) relative to how far training moved them."""
    dp = comm.size
    cfg = tiny(precision=precision, dp=dp, batch_size=2 * dp * microbatches, microbatches=microbatches,
               seed=seed, **TRAINING[precision])
    runs = {name: run(cfg.replace(**changes), comm.mpi)
            for name, changes in (("ddp", {}), ("zero2", {"zero": 2}), (layout, LAYOUTS[layout]))}
    single = run(cfg.replace(dp=1), MPI.COMM_SELF) if comm.rank == 0 else None
    if comm.rank != 0:
        return
    assert runs[layout][0][0] == runs["ddp"][0][0] == runs["zero2"][0][0]  # (one process sums otherwise)
    if layout == "zero3" or dp == 2:
        assert runs[layout][:2] == runs["zero2"][:2]
        np.testing.assert_array_equal(runs[layout][2], runs["zero2"][2])
    start = flat_weights(train.Trainer(cfg.replace(dp=1), MPI.COMM_SELF).full_state())
    for without, (losses, _, weights) in (("ddp", runs["ddp"]), ("one process", single)):
        scale = np.linalg.norm(weights)
        assert np.linalg.norm(weights - start) > 4 * TOLERANCE[precision] * scale  # training moved them
        deviation = np.linalg.norm(runs[layout][2] - weights) / scale
        assert deviation <= TOLERANCE[precision], (without, deviation)
        np.testing.assert_allclose(runs[layout][0], losses, rtol=TOLERANCE[precision], atol=0)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@mpi_test
def test_zero3_gathers_16_bit_parameters_at_half_of_fp32s_bytes_and_holds_the_planners_states(
        comm, precision):
    """Rank 0's bytes of one step, from the formulas: each unit padded to a multiple of N, gathered twice
    (forward, backward) by a ring that sends (N-1)/N of it, at 2 bytes a value in 16 bits and 4 in
    fp32; the gradients reduce-scattered once, in fp32 either way. Model states: in fp32 p = g = 4 and
    K = 8; in 16 bits p = 2 (the working copy's shard), g = 4 and K = 4 + 8 (the master and AdamW's
    moments), the planner's formula up to the padding."""
    n = comm.size
    cfg = tiny(precision=precision, dp=n, zero=3, batch_size=2 * n, steps=1)
    record = train.Trainer(cfg, comm.mpi).run()[0]
    sizes = unit_sizes(cfg)
    shard = sum(padded_numel(s, n) for s in sizes) // n  # elements of this rank's shards
    value_bytes = 4 if precision == "fp32" else 2
    assert record["comm"]["by_op"] == {"all_gather": 2 * (n - 1) * shard * value_bytes,
                                       "reduce_scatter": (n - 1) * shard * 4}
    mem = record["mem"]
    k = 8 if precision == "fp32" else 12
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (value_bytes * shard, 4 * shard, k * shard)
    formula = planner.model_state_bytes(sum(sizes), n, 3, k=k, param_bytes=value_bytes, grad_bytes=4)
    assert 0 <= mem["params"] + mem["grads"] + mem["optimizer"] - formula < (4 + k + value_bytes) * len(sizes)



# ---- FSDP2 (parallel/fsdp.py): the same working copy, gathered per parameter ----

def per_parameter_shard(cfg) -> int:
    """Elements of a rank's FSDP shard, from the shapes: each parameter's rows padded to a multiple
    of N = dp, a rank keeping ceil(rows/N) of them (dim 0, FSDP2's torch.chunk)."""
    model = build.build_model(cfg.replace(dp=1, fsdp=False), None)
    return sum(-(-p.shape[0] // cfg.dp) * (p.size // p.shape[0]) for p in model.parameters())


def fsdp_beside_zero3(cfg: TrainConfig, comm, **fsdp) -> tuple[dict, dict, tuple | None]:
    """{layout: (losses, skips, weights)} of --fsdp (with the options `fsdp`: --dp-replicate) and
    --zero 3 on the same ranks, the first record of the FSDP run, and the single-process run (on rank
    0)."""
    trainer = train.Trainer(cfg.replace(fsdp=True, **fsdp), comm.mpi)
    records = trainer.run()
    full = trainer.full_state()
    runs = {"fsdp": ([r["loss"] for r in records], [r["loss_scaling"]["skipped"] for r in records
                                                    if "loss_scaling" in r],
                     None if full is None else flat_weights(full)),
            "zero3": run(cfg.replace(zero=3), comm.mpi)}
    single = run(cfg.replace(dp=1, tp=1), MPI.COMM_SELF) if comm.rank == 0 else None
    return runs, records[0], single


def assert_within_tolerance_of_one_process(cfg, weights, losses, single) -> None:
    """--check-reference's measure: the weights' norm-relative deviation, relative to how far
    training moved them (more than 4 tolerances), and the losses, within the 16-bit tolerance."""
    tolerance = TOLERANCE[cfg.precision]
    start = flat_weights(train.Trainer(cfg.replace(dp=1, tp=1), MPI.COMM_SELF).full_state())
    scale = np.linalg.norm(single[2])
    assert np.linalg.norm(single[2] - start) > 4 * tolerance * scale  # training moved them
    assert np.linalg.norm(weights - single[2]) / scale <= tolerance
    np.testing.assert_allclose(losses, single[0], rtol=tolerance, atol=0)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@needs_world_size(2)
@mpi_test
def test_fsdp_in_16_bits_trains_bit_for_bit_like_zero3_gathering_2_bytes_a_value(comm, precision):
    """On 2 ranks FSDP and ZeRO-3 reduce-scatter the same fp32 gradients (a sum of two is the same in
    either order, whichever rank's chunk holds a value) and gather the same rounded values, so losses,
    fp16 skips and weights are bit-equal, and within the tolerance of one process. Rank 0's bytes of
    the first step, from the formulas: the per-parameter shard gathered twice (forward, backward) at
    2 bytes a value, the gradients reduce-scattered once in fp32; it holds its 2-byte shard, fp32
    gradients and K = 4 + 8 (the master and AdamW's moments)."""
    cfg = tiny(precision=precision, dp=2, batch_size=4, **TRAINING[precision])
    runs, first, single = fsdp_beside_zero3(cfg, comm)
    shard = per_parameter_shard(cfg)
    assert first["comm"]["by_op"] == {"all_gather": 2 * shard * 2, "reduce_scatter": shard * 4}
    assert (first["mem"]["params"], first["mem"]["grads"], first["mem"]["optimizer"]) == \
        (2 * shard, 4 * shard, 12 * shard)
    if comm.rank != 0:
        return
    assert runs["fsdp"][:2] == runs["zero3"][:2]
    np.testing.assert_array_equal(runs["fsdp"][2], runs["zero3"][2])
    assert_within_tolerance_of_one_process(cfg, runs["fsdp"][2], runs["fsdp"][0], single)


@needs_world_size(4)
@mpi_test
def test_fsdp_in_fp16_over_tensor_parallel_shards_trains_bit_for_bit_like_zero3(comm):
    """dp 2 x tp 2: FSDP cuts each tp shard's rows over dp; the same sums of two as ZeRO-3's."""
    cfg = tiny(precision="fp16", dp=2, tp=2, n_head=2, d_model=10, batch_size=4, **TRAINING["fp16"])
    runs, _, single = fsdp_beside_zero3(cfg, comm)
    if comm.rank != 0:
        return
    assert runs["fsdp"][:2] == runs["zero3"][:2]
    np.testing.assert_array_equal(runs["fsdp"][2], runs["zero3"][2])
    assert_within_tolerance_of_one_process(cfg, runs["fsdp"][2], runs["fsdp"][0], single)



# ---- hybrid sharding (--dp-replicate R): the 16-bit rows gathered inside a shard group ----

@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@needs_world_size(2, 4)
@mpi_test
def test_hybrid_in_16_bits_gathers_2_bytes_inside_a_shard_group_and_all_reduces_fp32_shards(
        comm, precision):
    """--dp-replicate 2 over N = 2 or 4 ranks: shard groups of S = N/2. Rank 0's bytes of the first
    step, from the formulas: on dp_shard the per-parameter shard (rows padded to a multiple of S)
    gathered twice at 2 bytes a value and the gradients reduce-scattered in fp32, on dp_replicate the
    ring all-reduce of each unit's fp32 gradient shard (cut in two as array_split cuts); it holds a
    2-byte shard, fp32 gradients and K = 4 + 8. Within --check-reference's tolerance of one process.
    At N = 2 (S = 1) nothing is gathered and the all-reduce sums two whole fp32 gradients, ZeRO-3's
    sum of two: losses, fp16 skips and weights are ZeRO-3's bit for bit (an all-reduce of gradients
    rounded to 16 bits, or a forward on unrounded weights, moves them)."""
    shards = comm.size // 2
    cfg = tiny(precision=precision, dp=comm.size, batch_size=2 * comm.size, **TRAINING[precision])
    runs, first, single = fsdp_beside_zero3(cfg, comm, dp_replicate=2)
    shard = per_parameter_shard(cfg.replace(dp=shards))
    model = build.build_model(cfg.replace(dp=1), None)
    per_unit = [sum(-(-p.shape[0] // shards) * (p.size // p.shape[0]) for p in unit.parameters())
                for _, unit in model.units()]
    replica = comm.rank // shards
    all_reduce = sum(ring_bytes_sent("all_reduce", [(e - e // 2) * 4, e // 2 * 4], replica) for e in per_unit)
    assert sum(per_unit) == shard
    assert first["comm"]["by_dim_op"] == {"dp_replicate": {"all_reduce": all_reduce},  # none at S = 1
                                          "dp_shard": {"all_gather": 2 * (shards - 1) * shard * 2,
                                                       "reduce_scatter": (shards - 1) * shard * 4}}
    assert (first["mem"]["params"], first["mem"]["grads"], first["mem"]["optimizer"]) == \
        (2 * shard, 4 * shard, 12 * shard)
    if comm.rank != 0:
        return
    if shards == 1:
        assert runs["fsdp"][:2] == runs["zero3"][:2]
        np.testing.assert_array_equal(runs["fsdp"][2], runs["zero3"][2])
    assert_within_tolerance_of_one_process(cfg, runs["fsdp"][2], runs["fsdp"][0], single)
