"""Checkpoints: pieces put back together exactly; resume equals an uninterrupted run, in any layout;
bad checkpoints refused with one line; a save never destroys the previous checkpoint before it is done.

    pytest -m "not mpi" tests/checkpoint/test_checkpoint.py                          # serial
    mpiexec -n K python -m pytest -m mpi tests/checkpoint/test_checkpoint.py         # K = 2, 4, 8
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings
from mpi4py import MPI
from mpi_harness import at_world_size, mpi_given, mpi_test, needs_world_size
from one_process import assert_trains_like_one_process

from minipar.checkpoint.sharded import CheckpointError
from minipar.core.shards import Shard, shard_bounds
from minipar.parallel.logical_state import Piece, assemble
from minipar.trainer import build
from minipar.trainer import loop as train
from minipar.trainer.config import TrainConfig
from minipar.trainer.validate import validate

MARKER = ".minipar-checkpoints"  # checkpoint/sharded.py: this folder is minipar's

WORLD = MPI.COMM_WORLD
TINY = TrainConfig(model="gpt", precision="fp64", n_layer=2, n_head=4, d_model=16, seq_len=8, batch_size=8,
                   steps=4, lr=1e-2, quiet=True)


# ---- pieces of logical tensors ----------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 7), min_size=1, max_size=3), tp=st.integers(1, 4), dp=st.integers(1, 5),
       axis_choice=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_pieces_of_any_layout_assemble_to_the_full_tensor(shape, tp, dp, axis_choice, seed):
    """Cut a tensor like tensor parallelism (padded, uneven) then ZeRO (flat, equal slices that
    straddle rows), shuffle the pieces, put them back together: the very same tensor."""
    full = np.random.default_rng(seed).standard_normal(shape)
    axis, pieces = axis_choice % len(shape), []
    per_rank = -(-shape[axis] // tp)  # vocabulary-style split: equal shards, the last one padded
    for t in range(tp):
        shard = Shard(tuple(shape), axis, t * per_rank, (t + 1) * per_rank) if tp > 1 else None
        numel = Piece(tuple(shape), shard).cut(full).size
        for d in range(dp):
            flat = shard_bounds(numel, dp, d) if dp > 1 else None
            piece = Piece(tuple(shape), shard, flat)
            pieces.append((piece, piece.cut(full).copy()))
    order = np.random.default_rng(seed + 1).permutation(len(pieces))
    np.testing.assert_array_equal(assemble([pieces[i] for i in order]), full)
    for piece, _ in pieces:
        assert Piece.from_json(json.loads(json.dumps(piece.to_json())), shape) == piece


# ---- resume equals an uninterrupted run: one process ------------------------------------------------


def run(cfg: TrainConfig, comm=MPI.COMM_SELF, loss_scale=None):
    """(records, full weights on the comm's rank 0) of a run in cfg's layout over comm."""
    trainer = train.Trainer(cfg.resolved(comm.Get_size()), comm)
    if loss_scale:  # fp16: start the scaler at this scale
        scaler = trainer.engine.loss_scaler
        scaler.load_state_dict({**scaler.state_dict(), "scale": loss_scale})
    try:
        records = trainer.run()
        return records, trainer.full_state()
    finally:  # MPI has a few thousand communicators per process, and hypothesis runs many examples
        for sub in (trainer.grid.dp, trainer.grid.pp, trainer.grid.tp):
            sub.mpi.Free()


@pytest.mark.parametrize("model, optimizer", [("gpt", "adamw"), ("gpt", "sgd"), ("mlp", "adamw")])
@pytest.mark.parametrize("saved_at", [1, 3])
def test_resume_on_one_process_is_bitwise_the_uninterrupted_run(tmp_path, model, optimizer, saved_at):
    cfg = TINY.replace(model=model, optimizer=optimizer)
    whole, whole_state = run(cfg)
    first, _ = run(cfg.replace(steps=saved_at, save=str(tmp_path)))
    rest, state = run(cfg.replace(resume=str(tmp_path)))
    assert [r["step"] for r in first + rest] == list(range(cfg.steps))
    assert [r["loss"] for r in first + rest] == [r["loss"] for r in whole]
    assert state.keys() == whole_state.keys()
    for name in state:
        np.testing.assert_array_equal(state[name], whole_state[name], err_msg=name)


@pytest.mark.parametrize("saved_at", [1, 4])
def test_fp16_resume_carries_the_loss_scaler(tmp_path, saved_at):
    """Started at a loss scale of 2^21, fp16 gradients overflow: the first three steps are skipped and
    the scale halves each time. The checkpoint carries the scale (and, after skipped steps, AdamW's
    lower step count), so the resumed run skips and steps exactly as the uninterrupted one."""
    cfg = TINY.replace(precision="fp16", steps=6)
    whole, whole_state = run(cfg, loss_scale=2.0**21)
    first, _ = run(cfg.replace(steps=saved_at, save=str(tmp_path)), loss_scale=2.0**21)
    scaler = json.loads((tmp_path / "manifest.json").read_text())["loss_scaler"]
    rest, state = run(cfg.replace(resume=str(tmp_path)))
    assert scaler["scale"] == 2.0 ** (21 - min(saved_at, 3))
    assert [r["loss_scaling"] for r in first + rest] == [r["loss_scaling"] for r in whole]
    assert [r["loss"] for r in first + rest] == [r["loss"] for r in whole]
    for name in state:
        np.testing.assert_array_equal(state[name], whole_state[name], err_msg=name)


FP8_DELAYED = TINY.replace(precision="fp8", fp8_recipe="delayed", fp8_accumulate="fp64")


@pytest.mark.parametrize("saved_at", [1, 3])
def test_fp8_delayed_resume_continues_the_amax_history(tmp_path, saved_at):
    """Delayed scaling scales step t by the max of the amaxes of the steps before it (scale 1 at the
    first). The checkpoint keeps that history, by layer name, so the resumed run scales and trains as
    the uninterrupted one, bit for bit; a history started anew would scale its first step by 1."""
    whole, whole_state = run(FP8_DELAYED)
    first, _ = run(FP8_DELAYED.replace(steps=saved_at, save=str(tmp_path)))
    history = json.loads((tmp_path / "manifest.json").read_text())["fp8_amax_history"]
    rest, state = run(FP8_DELAYED.replace(resume=str(tmp_path)))
    assert sorted(history) == [f"blocks.{b}.{layer}" for b in range(2) for layer in
                               ("attn.key", "attn.proj", "attn.query", "attn.value", "mlp.fc", "mlp.proj")]
    assert all(len(past) == saved_at for tensors in history.values() for past in tensors.values())
    assert all(sorted(tensors) == ["grad", "input", "weight"] for tensors in history.values())
    assert [r["loss"] for r in first + rest] == [r["loss"] for r in whole]
    for name in state:
        np.testing.assert_array_equal(state[name], whole_state[name], err_msg=name)


def test_saving_again_at_the_same_step_keeps_the_old_files_until_the_new_manifest(tmp_path):
    run(TINY.replace(steps=2, save=str(tmp_path)))
    first = json.loads((tmp_path / "manifest.json").read_text())
    run(TINY.replace(steps=2, resume=str(tmp_path), save=str(tmp_path)))  # no step to run: saves again
    second = json.loads((tmp_path / "manifest.json").read_text())
    assert first["folder"] == "step-000002" and second["folder"] == "step-000002.1"
    assert sorted(p.name for p in tmp_path.iterdir()) == [MARKER, "manifest.json", "step-000002.1"]
    renamed = json.dumps(first["tensors"]).replace("step-000002/", "step-000002.1/")
    assert second["tensors"] == json.loads(renamed)


# ---- bad checkpoints are refused with one line, before anything is read ------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of TINY after 2 steps, to damage copies of."""
    directory = tmp_path_factory.mktemp("saved")
    run(TINY.replace(steps=2, save=str(directory)))
    return directory


def damaged(saved: Path, tmp_path: Path, damage) -> Path:
    copy = tmp_path / "checkpoint"
    shutil.copytree(saved, copy)
    damage(copy, sorted(copy.glob("step-*/*.npz"))[0])
    return copy


def truncate(path: Path, keep=0.5):
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])


def flip_a_byte(path: Path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, message", [
    (lambda d, npz: shutil.rmtree(d), "no such directory"),
    (lambda d, npz: (d / "manifest.json").unlink(), "no manifest.json"),
    (lambda d, npz: truncate(d / "manifest.json"), "manifest.json is unreadable or truncated"),
    (lambda d, npz: (d / "manifest.json").write_text('{"format": "other"}'), "is not a minipar-checkpoint-1"),
    (lambda d, npz: (d / "manifest.json").write_text('{"format": "minipar-checkpoint-1"}'), "is malformed"),
    (lambda d, npz: npz.unlink(), "rank00000.npz is missing"),
    (lambda d, npz: truncate(npz), "rank00000.npz is truncated or altered"),
    (lambda d, npz: flip_a_byte(npz), "rank00000.npz is corrupt: its SHA-256 differs"),
])
def test_a_damaged_checkpoint_is_refused_in_one_line(saved, tmp_path, damage, message):
    directory = damaged(saved, tmp_path, damage)
    cfg = TINY.replace(resume=str(directory))
    errors = validate(cfg, 1)
    assert len(errors) == 1 and message in errors[0] and "\n" not in errors[0], errors
    with pytest.raises(CheckpointError, match=message):
        train.Trainer(cfg.resolved(1), MPI.COMM_SELF)


@pytest.mark.parametrize("changes, message", [
    (dict(n_layer=3), "another model (n_layer 2 there, 3 here)"),
    (dict(d_model=32), "another model (d_model 16 there, 32 here)"),
    (dict(model="mlp"), "another model (model 'gpt' there, 'mlp' here"),
    (dict(optimizer="sgd"), "optimizer 'adamw' there, 'sgd' here"),
    (dict(seed=5), "saved with --seed 0"),
    (dict(steps=1), "the checkpoint is at step 2, past --steps 1"),
])
def test_a_checkpoint_of_another_model_or_run_is_refused(saved, changes, message):
    errors = validate(TINY.replace(resume=str(saved), **changes), 1)
    assert len(errors) == 1 and message in errors[0], errors


def test_precision_and_layout_are_not_part_of_the_model(saved):
    # the global batch is a run setting since the second reliability round: it needs --allow-changes
    assert validate(TINY.replace(resume=str(saved), precision="fp32", batch_size=4, allow_changes=True),
                    1) == []


# ---- resume in another layout, world size included: multi-rank ---------------------------------------


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# Chunked ZeRO-3 (parallel/zero_chunked.py): chunks only, or with blocks offloaded to cpu or disk under
# a device budget (MiB) by ranks, measured to leave room for TINY's activations yet move blocks every step
BUDGET = {1: 0.45, 2: 0.25, 4: 0.15, 8: 0.1}
CHUNKING = {"": lambda ranks: {}, "chunks": lambda ranks: dict(chunk_mb=0.01),
            "cpu": lambda ranks: dict(offload="cpu", device_mem_mb=BUDGET[ranks]),
            "disk": lambda ranks: dict(offload="disk", device_mem_mb=BUDGET[ranks]),
            "fsdp": lambda ranks: dict(fsdp=True)}  # per-parameter sharding (fsdp.py): not a chunking


def layouts(world_size: int) -> list[tuple]:
    """Every (ranks, dp, tp, pp, zero, microbatches, chunking) that TINY trains on `ranks` <= world_size."""
    found = []
    for ranks in divisors(world_size):
        for tp in divisors(ranks):
            for pp in divisors(ranks // tp):
                for zero in (0, 1, 2, 3):
                    for microbatches in (1, 2):
                        for chunking in [c for c in CHUNKING if c != "fsdp"] if zero == 3 else [""]:
                            layout = (ranks, ranks // (tp * pp), tp, pp, zero, microbatches, chunking)
                            if not validate(configured(TINY, layout), ranks):
                                found.append(layout)
    return found


def configured(cfg: TrainConfig, layout: tuple) -> TrainConfig:
    ranks, dp, tp, pp, zero, microbatches, chunking = layout
    return cfg.replace(dp=dp, tp=tp, pp=pp, zero=zero, microbatches=microbatches, **CHUNKING[chunking](ranks))


def on_ranks(ranks: int, cfg: TrainConfig):
    """Run cfg on world ranks [0, ranks) (the others wait): (records, full weights) on rank 0."""
    sub = WORLD.Split(0 if WORLD.rank < ranks else MPI.UNDEFINED, WORLD.rank)
    if sub == MPI.COMM_NULL:
        return None, None
    try:
        return run(cfg, sub)
    finally:
        sub.Free()


def shared_directory():
    """A fresh directory that every rank names alike (created by rank 0)."""
    return Path(WORLD.bcast(tempfile.mkdtemp(prefix="minipar-ckpt-") if WORLD.rank == 0 else None))


LAYOUTS = layouts(WORLD.size)


@mpi_given(max_examples=8, examples=[  # a tensor-parallel save resumed at tp = 1, and the reverse
    at_world_size((2, 4, 8),
                  saved=(2, 1, 2, 1, 0, 1, ""), resumed=(1, 1, 1, 1, 0, 1, ""), saved_at=2, seed=3),
    at_world_size((2, 4, 8),
                  saved=(1, 1, 1, 1, 0, 1, ""), resumed=(2, 1, 2, 1, 0, 1, ""), saved_at=1, seed=4)],
           saved=st.sampled_from(LAYOUTS), resumed=st.sampled_from(LAYOUTS),
           saved_at=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_resume_in_another_layout_trains_like_one_process(saved, resumed, saved_at, seed):
    """Saved at one layout and world size, resumed at another: the losses after the save and the
    final weights agree with one uninterrupted single-process run to a relative 1e-9 (fp64)."""
    resumes_like_one_process(saved, resumed, saved_at, seed)


@mpi_given(max_examples=4, chunked=st.sampled_from([layout for layout in LAYOUTS if layout[-1]]),
           other=st.sampled_from(LAYOUTS), chunked_first=st.booleans(), saved_at=st.integers(1, 3))
def test_chunked_and_offloaded_state_resumes_in_any_layout(chunked, other, chunked_first, saved_at):
    """Chunked ZeRO-3's blocks (on the device, in CPU memory or on disk) save and load like the rest."""
    saved, resumed = (chunked, other) if chunked_first else (other, chunked)
    resumes_like_one_process(saved, resumed, saved_at, seed=0)


def resumes_like_one_process(saved: tuple, resumed: tuple, saved_at: int, seed: int,
                             base: TrainConfig = TINY):
    directory, cfg = shared_directory(), base.replace(seed=seed)
    try:
        on_ranks(saved[0], configured(cfg, saved).replace(steps=saved_at, save=str(directory)))
        records, full = on_ranks(resumed[0], configured(cfg, resumed).replace(resume=str(directory)))
        if WORLD.rank == 0:
            assert [r["step"] for r in records] == list(range(saved_at, cfg.steps))
            assert_trains_like_one_process(cfg, records, full)
    finally:  # no collective here: a rank that failed must reach the harness, which ends the job
        if WORLD.rank == 0:
            shutil.rmtree(directory)


# A save resumed in FSDP (2 ranks), and an FSDP save where FSDP shards dim 0 of the column-parallel
# weights that tp already cut on dim 0, resumed in FSDP without tp (4 ranks)
FSDP_CASES = [((2, 1, 1, 2, 0, 2, ""), (2, 2, 1, 1, 0, 1, "fsdp")),
              ((4, 2, 2, 1, 0, 1, "fsdp"), (2, 2, 1, 1, 0, 1, "fsdp"))]


@needs_world_size(2, 4)
@pytest.mark.parametrize("saved, resumed", [case for case in FSDP_CASES
                                            if WORLD.size == max(case[0][0], case[1][0])])
@mpi_test
def test_fsdp_checkpoints_reshard_like_every_other(saved, resumed):
    resumes_like_one_process(saved, resumed, saved_at=1, seed=7)



@needs_world_size(2)
@pytest.mark.parametrize("saved, resumed", [((2, 1, 1, 2, 0, 2, ""), (2, 2, 1, 1, 3, 1, "")),
                                            ((2, 1, 2, 1, 0, 1, ""), (2, 1, 1, 2, 1, 2, ""))])
@mpi_test
def test_fp8_delayed_history_resumes_in_another_layout(saved, resumed):
    """The history saved by layer name: a pipeline's stages each save their layers' (pp 2 resumed on
    dp 2 with ZeRO-3, whose FP8 gathers quantize with it), tp's ranks one agreed history (tp 2 resumed
    on pp 2); either equals one process's uninterrupted run to 1e-9."""
    resumes_like_one_process(saved, resumed, saved_at=2, seed=8, base=FP8_DELAYED)


@needs_world_size(2)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@mpi_test
def test_a_16_bit_fsdp_save_resumes_in_16_bit_zero3_bitwise_like_the_uninterrupted_run(precision):
    """On 2 ranks FSDP and ZeRO-3 train bit for bit alike in 16 bits (sums of two;
    tests/precision/test_zero3_working_copy.py). A checkpoint holds the fp32 masters, the moments and
    fp16's scaler, never the rounded working copy, and a load rounds the masters again: FSDP's
    per-parameter rows saved after one step and resumed in ZeRO-3's flat units continue exactly as
    the FSDP run that was never interrupted."""
    cfg = TINY.replace(precision=precision, dp=2, steps=3, seed=5)
    assert_resumed_run_is_the_whole_run(cfg.replace(fsdp=True), cfg.replace(fsdp=True, steps=1),
                                        cfg.replace(zero=3))


def assert_resumed_run_is_the_whole_run(whole_cfg, first_cfg, rest_cfg) -> None:
    """whole_cfg uninterrupted; first_cfg saving into a shared folder, then rest_cfg resuming from it: the
    losses and the final state must be the uninterrupted run's, bit for bit."""
    directory = shared_directory()
    try:
        whole, whole_state = run(whole_cfg, WORLD)
        first, _ = run(first_cfg.replace(save=str(directory)), WORLD)
        rest, state = run(rest_cfg.replace(resume=str(directory)), WORLD)
        if WORLD.rank == 0:
            assert [r["loss"] for r in first + rest] == [r["loss"] for r in whole]
            for name in whole_state:
                np.testing.assert_array_equal(state[name], whole_state[name], err_msg=name)
    finally:
        if WORLD.rank == 0:
            shutil.rmtree(directory)


SAME_WORLD = [(layout, precision) for layout in LAYOUTS if layout[0] == WORLD.size
              for precision in ("fp64", "bf16", "fp16")
              if not validate(configured(TINY, layout).replace(precision=precision), WORLD.size)]


@mpi_given(max_examples=6, case=st.sampled_from(SAME_WORLD), saved_at=st.integers(1, 3))
def test_resume_in_the_same_layout_is_bitwise_the_uninterrupted_run(case, saved_at):
    """Any precision: mixed precision's fp32 masters are the parameters, and fp16's scaler is saved."""
    layout, precision = case
    cfg = configured(TINY, layout).replace(precision=precision)
    assert_resumed_run_is_the_whole_run(cfg, cfg.replace(steps=saved_at), cfg)


# ---- save's split of the writing (lesson 12's excerpt): each piece written once, by its lowest holder --


@needs_world_size(2)
@mpi_test
def test_save_writes_each_piece_once_on_the_lowest_rank_that_holds_it():
    """DDP's replicas hold the same pieces: rank 0 writes every parameter and moment, rank 1's file holds
    nothing. ZeRO-1 shards the parameters and the moments: each rank writes its own slices, and the
    slices of each tensor add up to its size exactly once."""
    sizes = {name: p.size for name, p in build.build_model(TINY.replace(dp=1), None).named_parameters()}
    everything = {f"{name}/{kind}" for name in sizes for kind in ("param", "exp_avg", "exp_avg_sq")}
    for zero in (0, 1):
        directory = shared_directory()
        try:
            train.Trainer(TINY.replace(dp=2, zero=zero, steps=1, save=str(directory)), WORLD).run()
            WORLD.Barrier()
            files = sorted(directory.glob("*/rank*.npz"))
            assert [f.name for f in files] == ["rank00000.npz", "rank00001.npz"]
            held = [dict(np.load(f)) for f in files]
        finally:
            WORLD.Barrier()
            if WORLD.rank == 0:
                shutil.rmtree(directory)
        if zero == 0:
            assert set(held[0]) == everything and held[1] == {}
            continue
        for key in everything:
            name, kind = key.split("/")
            written = sum(h[key].size for h in held if key in h)
            assert written == sizes[name], (zero, key, written, sizes[name])
        assert any(key.endswith("exp_avg") for key in held[1])
