"""Gemini chunks: packing, the padding search, the tensor state machine, and chunked ZeRO-3 training to
the single-process numbers with one message per chunk, with and without offload.

    pytest -m "not mpi" tests/memory/test_chunks.py                       # packing, search, states, one rank
    mpiexec -n K python -m pytest -m mpi tests/memory/test_chunks.py       # K = 2, 4, 8: dp = K
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_harness import mpi_given, mpi_test

from minipar.core import autograd
from minipar.core.shards import padded_numel
from minipar.memory.chunks import (
    LEGAL_TRANSITIONS,
    Chunk,
    IllegalTransition,
    TensorState,
    chunk_padding,
    pack_in_chunks,
    search_chunk_size,
)
from minipar.memory.ledger import buffer_meter
from minipar.parallel.zero_chunked import ChunkedZero3, chunk_numel_for, device_bytes_needed
from minipar.trainer import build
from minipar.trainer import loop as train
from minipar.trainer.config import TrainConfig
from minipar.trainer.validate import validate


def tiny(**changes) -> TrainConfig:
    base = TrainConfig(model="gpt", precision="fp64", n_layer=2, n_head=3, d_model=9, seq_len=8,
                       batch_size=8, steps=2, quiet=True)
    return base.replace(**changes)


def assert_matches_reference(cfg, records, full):
    losses, reference = train.reference_run(cfg)
    np.testing.assert_allclose([r["loss"] for r in records], losses, rtol=1e-9, atol=0)
    for name, (_, want) in reference.items():
        # atol: entries that sit near zero (biases barely moved from their zero start) carry
        # roundoff that no relative tolerance can compare
        np.testing.assert_allclose(full[name], want, rtol=1e-9, atol=1e-12, err_msg=name)


MODELS = {  # deep and narrow: model states large beside the activations of one sample, so blocks move
    "gpt": {"model": "gpt", "n_layer": 4, "n_head": 2, "d_model": 16, "seq_len": 4},
    "mlp": {"model": "mlp", "n_layer": 6, "d_model": 32},
}


def tight_budget_mb(cfg, comm) -> float:
    """The least budget this run fits: what the engine needs before activations (the up-front check's
    figure), the activation peak of the same run measured without offload, and one block to spare."""
    probe = train.Trainer(cfg.replace(offload="none", chunk_mb=None, device_mem_mb=None, zero=0, steps=1),
                          comm.mpi).run()[0]["mem"]
    model = build.build_model(cfg.replace(dp=1, offload="none", chunk_mb=None, device_mem_mb=None), None)
    chunk_numel = chunk_numel_for(cfg, model, comm.size)
    rows = 4 if cfg.optimizer == "adamw" else 3  # parameters, gradients and Adam's two moments, or momentum
    block = rows * chunk_numel // comm.size * 8
    needed = device_bytes_needed(model, chunk_numel, comm.size, rows, "cpu")
    budget = comm.allreduce_obj(needed + probe["activations_peak"] + block, op="max")
    return budget / 2**20


def packed_by_hand(sizes, chunk_numel) -> list[list[int]]:
    """The packing rule written the obvious way: the indices of the tensors in each chunk."""
    chunks, used = [[]], 0
    for i, size in enumerate(sizes):
        if used + size > chunk_numel:
            chunks.append([])
            used = 0
        chunks[-1].append(i)
        used += size
    return chunks


sizes_strategy = st.lists(st.integers(1, 60), min_size=1, max_size=25)



@pytest.fixture(autouse=True)
def clean_meters():
    """Budgets count live activations: start from none (a test that ran a forward without a backward
    leaves its saved tensors counted in the process-wide meter)."""
    autograd.activation_meter.current = buffer_meter.current = 0

# ---- serial: packing and the search ----

@given(sizes=sizes_strategy, extra=st.integers(0, 80), seed=st.integers(0, 2**16))
def test_tensors_are_views_of_their_chunk_packed_in_order_without_straddling(sizes, extra, seed):
    chunk_numel = max(sizes) + extra
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(size) for size in sizes]
    chunks = pack_in_chunks([(f"t{i}", p, i // 3) for i, p in enumerate(params)], chunk_numel)
    assert [[int(t.name[1:]) for t in c.tensors] for c in chunks] == packed_by_hand(sizes, chunk_numel)
    for chunk in chunks:
        offsets = [t.offset for t in chunk.tensors]
        assert offsets == list(itertools.accumulate([0] + [t.numel for t in chunk.tensors[:-1]]))
        assert chunk.used <= chunk.numel == chunk_numel
        flat = chunk.flatten([t.param for t in chunk.tensors])
        for tensor in chunk.tensors:
            view = chunk.view(flat, tensor)
            assert np.shares_memory(view, flat) and np.array_equal(view, tensor.param)
        assert not flat[chunk.used :].any()  # the padding is zero
    assert int(chunk_padding(sizes, [chunk_numel])[0]) == len(chunks) * chunk_numel - sum(sizes)


@given(sizes=sizes_strategy, parts=st.integers(1, 8), search_range=st.integers(0, 100))
def test_the_search_picks_the_least_padding_among_every_multiple_of_the_ranks(sizes, parts, search_range):
    size, waste = search_chunk_size(sizes, parts, search_range)
    assert size % parts == 0 and size >= max(sizes)
    smallest = -(-max(sizes) // parts) * parts
    for candidate in range(smallest, smallest + search_range + 1, parts):
        theirs = len(packed_by_hand(sizes, candidate)) * candidate - sum(sizes)
        assert waste <= theirs and (waste < theirs or size <= candidate)  # ties go to the smaller size
    assert waste == len(packed_by_hand(sizes, size)) * size - sum(sizes)


def test_a_chunk_smaller_than_a_tensor_is_refused_with_its_name():
    with pytest.raises(ValueError, match="big"):
        pack_in_chunks([("small", np.zeros(3), 0), ("big", np.zeros(9), 0)], 8)


def test_the_search_pads_the_default_gpt_far_less_than_chunks_of_its_largest_tensor():
    cfg = TrainConfig(dp=4)
    model = build.build_model(cfg.replace(dp=1), None)
    sizes = [p.size for p in model.parameters()]
    chunk_numel = chunk_numel_for(cfg, model, 4)
    waste, naive = chunk_padding(sizes, [chunk_numel, max(sizes)])
    assert chunk_numel % 4 == 0 and 5 * waste < naive
    assert chunk_numel_for(cfg.replace(chunk_mb=0.5), model, 4) == 2**19 // 4  # fp32 elements


# ---- serial: the state machine ----

def test_exactly_the_drawn_transitions_are_legal_and_any_other_is_an_error():
    assert len(LEGAL_TRANSITIONS) == 7
    for old, new in itertools.product(TensorState, TensorState):
        chunk = Chunk(0, 4, "float64")
        tensor = chunk.append("w", np.zeros(2), unit=0)
        tensor.state = old
        if (old, new) in LEGAL_TRANSITIONS:
            chunk.transition(tensor, new)
            assert tensor.state is new
        else:
            with pytest.raises(IllegalTransition, match=f"w in chunk 0: {old.name} -> {new.name}"):
                chunk.transition(tensor, new)
            assert tensor.state is old


def test_a_tensor_goes_round_the_whole_cycle_in_forward_and_backward():
    S = TensorState
    chunk = Chunk(0, 4, "float64")
    tensor = chunk.append("w", np.zeros(2), unit=0)
    cycle = [S.HOLD, S.COMPUTE, S.HOLD, S.FREE,  # forward: gathered, used, released
             S.HOLD, S.COMPUTE, S.HOLD_AFTER_BWD, S.READY_FOR_REDUCE, S.FREE]  # backward, reduce-scatter
    for state in cycle:
        chunk.transition(tensor, state)
    with pytest.raises(IllegalTransition):  # a reduced chunk is not computed on before it is gathered
        chunk.transition(tensor, S.COMPUTE)


# ---- serial: one rank ----

@pytest.mark.parametrize("offload", ["none", "cpu", "disk"])
def test_one_rank_trains_to_the_reference_and_leaves_every_tensor_free(offload):
    budget = None if offload == "none" else 0.5
    cfg = tiny(dp=1, microbatches=2, steps=3, chunk_mb=0.004, offload=offload, device_mem_mb=budget)
    assert validate(cfg, 1) == []
    trainer = train.Trainer(cfg, MPI.COMM_SELF)
    records = trainer.run()
    updater = trainer.engine.updater
    assert isinstance(updater, ChunkedZero3) and len(updater.chunks) > 1
    assert_matches_reference(cfg, records, trainer.full_state())
    for chunk in updater.chunks:
        assert chunk.payload is None and chunk.all_in(TensorState.FREE)
    assert all(p.data.size == 0 and p.grad is None for p in trainer.engine.model.parameters())
    assert all(r["offload"]["off_trace"] == 0 for r in records)


def test_every_gathered_buffer_has_the_chunk_size_and_each_unit_hands_over_its_gradients_once():
    cfg = tiny(dp=1, steps=2, chunk_mb=0.004)
    trainer = train.Trainer(cfg, MPI.COMM_SELF)
    records = trainer.run()
    chunks = trainer.engine.updater.chunks
    model = build.build_model(cfg.replace(chunk_mb=None), None)
    unit_grads = {8 * sum(p.size for p in module.parameters()) for _, module in model.units()}
    for record in records:  # the ledger counts temporary buffers and their sizes
        assert record["mem"]["buffer_allocations"] == 2 * len(chunks) + len(model.units())
        assert record["mem"]["buffer_sizes"] == len(unit_grads | {chunks[0].nbytes})


def test_a_forward_outside_training_gathers_and_releases_chunk_by_chunk():
    trainer = train.Trainer(tiny(dp=1, steps=1, chunk_mb=0.004), MPI.COMM_SELF)
    trainer.run()
    logits = trainer.engine.model(trainer.task.global_batch(0, 2)[0])
    assert logits.shape == (2, 8, 13)
    assert all(c.payload is None and c.all_in(TensorState.FREE) for c in trainer.engine.updater.chunks)


# ---- multi-rank: dp = world size ----

@mpi_given(max_examples=8,
           model=st.sampled_from(["gpt", "mlp"]),
           offload=st.sampled_from(["none", "cpu", "disk"]),
           chunk_mb=st.sampled_from([None, 0.01, 0.03]),
           eviction=st.sampled_from(["lru", "opt"]),
           microbatches=st.integers(1, 2),
           optimizer=st.sampled_from(["adamw", "sgd"]),
           seed=st.integers(0, 2**16))
def test_chunked_zero3_trains_to_the_single_process_losses_and_weights(comm, model, offload, chunk_mb,
                                                                       eviction, microbatches, optimizer,
                                                                       seed):
    cfg = tiny(**MODELS[model], dp=comm.size, batch_size=comm.size * microbatches, microbatches=microbatches,
               optimizer=optimizer, seed=seed, steps=3, offload=offload, chunk_mb=chunk_mb, eviction=eviction,
               zero=3)
    # without offload, a roomy budget still selects chunked ZeRO-3 when no --chunk-mb does
    budget = (64.0 if chunk_mb is None else None) if offload == "none" else tight_budget_mb(cfg, comm)
    cfg = cfg.replace(device_mem_mb=budget)
    assert validate(cfg, comm.size) == []
    trainer = train.Trainer(cfg, comm.mpi)
    records = trainer.run()
    full = trainer.full_state()
    assert isinstance(trainer.engine.updater, ChunkedZero3)
    if offload != "none":
        assert all(r["mem"]["device_peak"] <= budget * 2**20 for r in records)
        assert all(r["offload"]["off_trace"] == 0 for r in records)
        moved = comm.allreduce_obj(sum(r["offload"]["moved_bytes"] for r in records[1:]))
        assert moved > 0  # on some rank blocks move after the first step: offload is exercised
    if comm.rank == 0:
        assert_matches_reference(cfg, records, full)


@mpi_test
def test_one_all_gather_per_chunk_each_way_and_one_reduce_scatter_per_chunk(comm):
    n = comm.size
    cfg = tiny(dp=n, batch_size=2 * n, steps=2, chunk_mb=0.004)
    trainer = train.Trainer(cfg, comm.mpi)
    records = trainer.run()
    chunks = trainer.engine.updater.chunks
    numel = chunks[0].numel
    assert numel % n == 0
    for record in records:
        traffic = record["comm"]
        assert traffic["messages"] == 3 * len(chunks) * (n - 1)
        assert traffic["by_op"] == {"all_gather": 2 * len(chunks) * (n - 1) * numel // n * 8,
                                    "reduce_scatter": len(chunks) * (n - 1) * numel // n * 8}


@mpi_test
def test_against_per_unit_zero3_the_same_bytes_but_for_padding(comm):
    """zero3.py sends one message per unit each way; chunks send one per chunk. The bytes differ only
    by what each pads: units to a multiple of N, chunks to the chunk size."""
    n = comm.size
    cfg = tiny(dp=n, batch_size=2 * n, steps=1, zero=3)
    per_unit = train.Trainer(cfg, comm.mpi)
    model = build.build_model(cfg.replace(dp=1, zero=0), None)  # ZeRO-3 has freed the trainer's
    units = [sum(p.size for p in module.parameters()) for _, module in model.units()]
    unit_traffic = per_unit.run()[0]["comm"]
    chunked = train.Trainer(cfg.replace(chunk_mb=0.004), comm.mpi)
    chunk_traffic = chunked.run()[0]["comm"]
    capacity = sum(c.numel for c in chunked.engine.updater.chunks)
    assert unit_traffic["sent_bytes"] == 3 * (n - 1) * sum(padded_numel(u, n) for u in units) // n * 8
    assert chunk_traffic["sent_bytes"] == 3 * (n - 1) * capacity // n * 8
    assert unit_traffic["messages"] == 3 * (n - 1) * len(units)
    assert chunk_traffic["messages"] == 3 * (n - 1) * len(chunked.engine.updater.chunks)
