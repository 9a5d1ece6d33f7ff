"""Offload: blocks keep their values through device, cpu and disk; the device budget is never exceeded;
OPT never moves more than LRU; the disk folder never outlives its creation; a model several times the
budget trains within it to the single-process numbers; a budget too small is refused up front.

    pytest -m "not mpi" tests/memory/test_offload.py                       # the store, one-rank training, CLI
    mpiexec -n K python -m pytest -m mpi tests/memory/test_offload.py       # K = 2, 4, 8: dp = K
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_harness import mpi_test
from test_chunks import MODELS, assert_matches_reference, tight_budget_mb, tiny

from minipar.core import autograd
from minipar.memory.ledger import buffer_meter
from minipar.memory.offload import DiskTier, TieredStore
from minipar.trainer import build
from minipar.trainer import loop as train
from minipar.trainer.config import TrainConfig
from minipar.trainer.validate import validate

BLOCK_NUMEL = 6
BLOCK_BYTES = BLOCK_NUMEL * 8
CATEGORIES = ("params", "grads", "optimizer")


def store_of(blocks: int, capacity: int, lower: str, policy: str, others=lambda: 0, prefetch=True):
    arrays = {key: (np.full(BLOCK_NUMEL, float(key)), CATEGORIES[key % 3]) for key in range(blocks)}
    return TieredStore(arrays, capacity * BLOCK_BYTES, lower, policy, others=others, prefetch=prefetch)



@pytest.fixture(autouse=True)
def clean_meters():
    """Budgets count live activations: start from none (a test that ran a forward without a backward
    leaves its saved tensors counted in the process-wide meter)."""
    autograd.activation_meter.current = buffer_meter.current = 0

# ---- serial: the store ----

@settings(max_examples=40, deadline=None)
@given(blocks=st.integers(1, 7), capacity=st.integers(1, 4), lower=st.sampled_from(["cpu", "disk"]),
       policy=st.sampled_from(["lru", "opt"]), step=st.lists(st.integers(0, 6), min_size=1, max_size=12),
       steps=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_blocks_keep_their_values_through_every_tier_and_the_budget_holds(blocks, capacity, lower, policy,
                                                                          step, steps, seed):
    rng = np.random.default_rng(seed)
    store = store_of(blocks, capacity, lower, policy)
    shadow = {key: np.full(BLOCK_NUMEL, float(key)) for key in range(blocks)}
    for _ in range(steps):
        for key in (k % blocks for k in step):
            with store.use(key) as (data,):
                assert store.blocks[key].tier == "device" and store.resident() <= capacity * BLOCK_BYTES
                change = rng.standard_normal(data.shape)
                data += change
                shadow[key] += change
            assert store.resident() <= capacity * BLOCK_BYTES
        store.end_step()
    for key in range(blocks):
        np.testing.assert_array_equal(store.read(key), shadow[key])
    assert {b.tier for b in store.blocks.values()} <= {"device", lower}
    store.close()


@settings(max_examples=60, deadline=None)
@given(blocks=st.integers(2, 8), capacity=st.integers(1, 5), step=st.lists(st.integers(0, 7), min_size=2,
       max_size=30), steps=st.integers(2, 4))
def test_opt_moves_no_more_than_lru_on_any_repeated_trace(blocks, capacity, step, steps):
    """Demand paging (no prefetch), equal blocks, a fixed capacity: Belady's theorem. OPT misses least,
    and once the device is full every miss evicts exactly one block under either policy."""
    moved = {}
    for policy in ("lru", "opt"):
        store = store_of(blocks, capacity, "cpu", policy, prefetch=False)
        for _ in range(steps):
            for key in step:
                with store.use(key % blocks):
                    pass
            store.end_step()
            moved.setdefault(policy, []).append(store.last_step["moved_bytes"])
    assert moved["opt"][0] == moved["lru"][0]  # the first step records the trace: OPT is LRU there
    assert sum(moved["opt"]) <= sum(moved["lru"])


def test_lru_thrashes_on_a_loop_one_longer_than_the_device_and_opt_does_not():
    moved = {}
    for policy in ("lru", "opt"):
        store = store_of(4, 3, "cpu", policy, prefetch=False)
        for _ in range(3):
            for key in range(4):
                with store.use(key):
                    pass
            store.end_step()
        moved[policy] = store.last_step
    assert moved["lru"]["fetches"] == 4 and moved["opt"]["fetches"] == 1  # every access misses, or one
    assert moved["lru"]["by_direction"] == {"cpu->device": 4 * BLOCK_BYTES, "device->cpu": 4 * BLOCK_BYTES}


def test_prefetch_brings_the_next_block_of_the_trace_into_free_room():
    store = store_of(3, 3, "cpu", "opt")
    for _ in range(2):
        for key in range(3):
            with store.use(key):
                pass
        store.end_step()
    store.blocks[1].tier, store.blocks[1].data = "cpu", store.read(1).copy()  # as if evicted
    with store.use(0):
        pass
    assert store.blocks[1].tier == "device" and store.traffic()["prefetches"] == 1


def test_others_that_outgrow_the_budget_evict_blocks_then_raise_rather_than_overdraw():
    others = [0]
    store = store_of(3, 3, "cpu", "lru", others=lambda: others[0])
    for key in range(3):
        with store.use(key):
            pass
    store.end_step()
    others[0] = 2 * BLOCK_BYTES  # activations grew: two blocks must go, but only during a step
    store.relieve()
    assert store.resident() == 3 * BLOCK_BYTES
    with store.use(0):  # a step has begun
        pass
    store.relieve()
    assert store.resident() == BLOCK_BYTES and store.traffic()["evictions"] == 2
    others[0] = 3 * BLOCK_BYTES + 1
    with pytest.raises(MemoryError, match="budget"):
        store.relieve()
    pinned = store_of(1, 1, "cpu", "lru")
    with pinned.use(0), pytest.raises(MemoryError):  # a block in use never moves
        pinned.make_room(1)
    both = store_of(2, 1, "cpu", "lru")
    with pytest.raises(MemoryError), both.use(0, 1):  # two blocks at once in the room of one
        pass
    assert not any(both.pinned.values())  # the first one's pin is undone
    with pytest.raises(MemoryError, match="lower tier: None"):  # and without a lower tier nothing can
        store_of(3, 2, None, "lru")


def test_the_disk_folder_is_gone_at_once_and_even_when_creating_it_fails(tmp_path):
    disk = DiskTier({0: ((2, 3), np.float64), 1: ((4,), np.float32)}, parent=str(tmp_path))
    assert os.listdir(tmp_path) == []  # the files live on, unlinked, until their handles close
    disk.arrays[0][...] = 7.0
    assert disk.arrays[0].sum() == 42.0 and isinstance(disk.arrays[1], np.memmap)
    disk.close()
    with pytest.raises(TypeError):  # the second file fails: the first is closed, the folder gone
        DiskTier({0: ((2,), np.float64), 1: ((2,), "no such dtype")}, parent=str(tmp_path))
    assert os.listdir(tmp_path) == []


# ---- serial: training within a budget ----

@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_a_model_several_times_the_budget_trains_within_it_on_one_rank(offload):
    cfg = tiny(**{**MODELS["gpt"], "n_layer": 6}, dp=1, batch_size=2, microbatches=2, steps=3,
               offload=offload)
    check_trains_within_budget(cfg, comm=None)


@settings(max_examples=6, deadline=None)
@given(model=st.sampled_from(["gpt", "mlp"]), microbatches=st.integers(1, 2),
       optimizer=st.sampled_from(["adamw", "sgd"]))
def test_with_prefetch_in_training_opt_still_moves_no_more_than_lru(model, microbatches, optimizer):
    cfg = tiny(**MODELS[model], dp=1, batch_size=microbatches, microbatches=microbatches, optimizer=optimizer,
               steps=3, offload="cpu")
    cfg = cfg.replace(device_mem_mb=tight_budget_mb(cfg, SelfComm()))
    moved = {}
    for eviction in ("lru", "opt"):
        records = train.Trainer(cfg.replace(eviction=eviction), MPI.COMM_SELF).run()
        moved[eviction] = sum(r["offload"]["moved_bytes"] for r in records)
    assert 0 < moved["opt"] <= moved["lru"]


class SelfComm:
    """What tight_budget_mb needs of the harness's `comm`, for one process."""

    size, mpi = 1, MPI.COMM_SELF

    @staticmethod
    def allreduce_obj(value, op="sum"):
        return value


def check_trains_within_budget(cfg, comm):
    """Model states at least 3x the budget; every step's device peak within it; the reference's numbers."""
    comm = comm or SelfComm()
    budget = tight_budget_mb(cfg, comm)
    cfg = cfg.replace(device_mem_mb=budget)
    assert validate(cfg, comm.size) == []
    trainer = train.Trainer(cfg, comm.mpi)
    records = trainer.run()
    full = trainer.full_state()
    held = trainer.engine.updater.memory()  # {category: {tier: bytes}}
    assert sum(sum(tiers.values()) for tiers in held.values()) >= 3 * budget * 2**20
    offloaded = sum(tiers[cfg.offload] for tiers in held.values())
    assert records[-1]["mem"]["by_tier"][cfg.offload] == offloaded > 0
    for record in records:
        assert record["mem"]["device_peak"] <= budget * 2**20
        traffic = record["offload"]
        assert traffic["moved_bytes"] == sum(traffic["by_direction"].values()) > 0
        assert traffic["off_trace"] == 0
    if comm.size == 1 or comm.rank == 0:
        assert_matches_reference(cfg, records, full)


def test_too_small_a_budget_and_other_misuse_are_one_line_errors_up_front():
    cfg = tiny(dp=1)
    cases = [
        (cfg.replace(offload="cpu", device_mem_mb=0.01), "--device-mem-mb 0.01 is too small"),
        (cfg.replace(offload="disk"), "needs --device-mem-mb"),
        (cfg.replace(chunk_mb=0.0001), "fewer than the largest parameter"),
        (cfg.replace(offload="cpu", device_mem_mb=1.0, zero=2), "need --zero 3"),
        (cfg.replace(chunk_mb=-1.0), "--chunk-mb must be positive"),
        (cfg.replace(offload="none", device_mem_mb=0.01), "--offload none needs"),
    ]
    for bad, message in cases:
        errors = validate(bad, 1)
        assert len(errors) == 1 and message in errors[0] and "\n" not in errors[0], (bad, errors)
    command = [sys.executable, "-m", "minipar", "train", "--offload", "cpu", "--device-mem-mb", "0.01"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "--device-mem-mb 0.01 is too small" in done.stderr


# ---- multi-rank ----

@pytest.mark.parametrize("offload", ["cpu", "disk"])
@mpi_test
def test_a_model_several_times_the_budget_trains_within_it_on_every_rank(comm, offload):
    # an MLP: its activations are small beside its weights, so the model states of every rank, not just
    # the whole model's, are several times the budget
    cfg = tiny(model="mlp", d_model=64, n_layer=4 * comm.size + 4, dp=comm.size, batch_size=comm.size,
               steps=2, offload=offload, eviction="lru")
    check_trains_within_budget(cfg, comm)


def test_bench_memory_measures_both_tables_from_real_runs():
    command = [sys.executable, "-m", "minipar", "bench", "memory", "--ranks", "2", "--chunk-mb", "1",
               "--budgets", "4", "--steps", "2", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.splitlines()[-1])
    per_unit, searched, fixed = figures["messages"]
    assert per_unit["messages"] == 3 * 6 and fixed["messages"] == 3 * fixed["chunks"]  # N - 1 = 1
    psi = sum(p.size for p in build.build_model(TrainConfig(dp=1), None).parameters())  # the default GPT
    assert searched["chunks"] * searched["chunk_numel"] == searched["padding"] + psi
    lru, opt = figures["offload"][:2]
    assert (lru["eviction"], opt["eviction"]) == ("lru", "opt")
    assert 0 < opt["moved_bytes"] <= lru["moved_bytes"]
    assert all(row["device_peak_mb"] <= row["budget_mb"] for row in figures["offload"])
