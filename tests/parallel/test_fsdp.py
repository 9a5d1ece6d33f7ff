"""FSDP2 and hybrid sharding (parallel/fsdp.py) train to one process; run on 2 and 4 ranks.

The oracle is the single-process run (fp64, 1e-9); the bytes are written from the definition: each
parameter padded on dim 0 to N·ceil(rows/N) rows, and hybrid sharding's inter-node bytes the ring
all-reduce of the gradient shards over dp_replicate, nothing else.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
from mpi_harness import at_world_size, mpi_given, mpi_test, needs_world_size

from minipar.distributed.ledger import ring_bytes_sent
from minipar.parallel.fsdp import FullyShardedDataParallel
from minipar.trainer import build
from minipar.trainer import loop as train
from minipar.trainer.config import TrainConfig


def tiny(**changes) -> TrainConfig:
    """3 heads of 3: odd row counts (the embedding's 21 rows), so dp > 1 pads dim 0."""
    base = TrainConfig(model="gpt", precision="fp64", n_layer=2, n_head=3, d_model=9, seq_len=8,
                       batch_size=8, steps=2, quiet=True, fsdp=True)
    return base.replace(**changes)


def trained(cfg, comm):
    trainer = train.Trainer(cfg, comm.mpi)
    records = trainer.run()
    return trainer, records, trainer.full_state()


def deviations(cfg, records, full) -> list[str]:
    """What differs from the single-process run, beyond fp64's 1e-9."""
    losses, reference = train.reference_run(cfg)
    wrong = [] if np.allclose([r["loss"] for r in records], losses, rtol=1e-9, atol=0) else ["loss"]
    return wrong + [name for name, (_, want) in reference.items()
                    if not np.allclose(full[name], want, rtol=1e-9, atol=1e-12)]


def test_a_ranks_shard_is_its_padded_dim_0_chunk_of_each_parameter_and_copy_out_inverts_copy_in():
    """Rank r's segment of the copy-in buffer: rows [r·c, (r+1)·c) of each parameter in turn, c =
    ceil(rows/N), zero rows past the end; copy-out gives the parameters back."""
    from types import SimpleNamespace

    from minipar.core.module import Module, Parameter
    from minipar.parallel.fsdp import PerParameterUnit

    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((5, 3)), rng.standard_normal(7)]
    module = Module()
    named = [(f"p{i}", Parameter(a.shape)) for i, a in enumerate(arrays)]
    for parts in (1, 2, 3, 4):
        unit = PerParameterUnit(module, named, SimpleNamespace(size=parts, rank=parts - 1))
        flat = unit.flatten(arrays)
        rows = [-(-5 // parts), -(-7 // parts)]
        assert unit.shard_numel == rows[0] * 3 + rows[1] and flat.size == parts * unit.shard_numel
        last = flat[unit.start : unit.stop]
        weight = np.zeros((rows[0] * parts, 3))
        weight[:5] = arrays[0]
        bias = np.zeros(rows[1] * parts)
        bias[:7] = arrays[1]
        expected = np.concatenate([weight[-rows[0]:].reshape(-1), bias[-rows[1]:]])
        assert np.array_equal(last, expected)
        assert all(np.array_equal(a, b) for a, b in zip(unit.whole_params(flat), arrays))


LAYOUTS = {2: [(2, 1, 1)], 4: [(4, 1, 1), (2, 2, 1), (2, 1, 2)]}  # (dp, tp, pp), dp > 1


@needs_world_size(2, 4)
@mpi_given(max_examples=1, pick=st.integers(0, 2), model=st.sampled_from(["gpt", "mlp"]),
           microbatches=st.integers(1, 2), seed=st.integers(0, 2**16),
           examples=[at_world_size((4,), pick=1, model="gpt", microbatches=2, seed=1),
                     at_world_size((4,), pick=2, model="gpt", microbatches=2, seed=2)])
def test_fsdp_trains_to_the_single_process_losses_and_weights(comm, pick, model, microbatches, seed):
    dp, tp, pp = LAYOUTS[comm.size][pick % len(LAYOUTS[comm.size])]
    model = "gpt" if tp > 1 else model  # tensor parallelism is written for the GPT
    cfg = tiny(model=model, dp=dp, tp=tp, pp=pp, batch_size=dp * microbatches * (2 if pp > 1 else 1),
               microbatches=microbatches * (2 if pp > 1 else 1), seed=seed,
               **({"n_head": 2, "d_model": 10} if tp > 1 and model == "gpt" else {}))
    trainer, records, full = trained(cfg, comm)
    assert isinstance(trainer.engine.updater, FullyShardedDataParallel)
    gathered = placed_in_full(trainer.engine.updater)
    if comm.rank == 0:
        assert deviations(cfg, records, full) == []
        assert gathered.keys() == full.keys()
        for name, whole in gathered.items():  # the placements' gathers give the trained parameters
            assert np.array_equal(whole, full[name]), name


def placed_in_full(updater) -> dict:
    """Each parameter made whole from its ShardedArray (a collective over the mesh: dp, then tp), the
    padding of a vocab-parallel tp shard cut off: {name: array}, on every rank of pipeline stage 0 and
    the other stages' parameters gathered to world rank 0 (stage by stage, as full_state does)."""
    from mpi4py import MPI

    mine, sharded = {}, updater.sharded_parameters()
    for unit in updater.sharded_units():
        for name, p in zip(unit.names, unit.params):
            whole = sharded[name].full()
            size = p.shard.full_shape if p.shard is not None else whole.shape
            mine[name] = whole[tuple(slice(0, n) for n in size)]
    every = MPI.COMM_WORLD.gather(mine, root=0)
    return {name: a for stage in every or [] for name, a in stage.items()}


@needs_world_size(2)
@mpi_test
def test_each_parameter_is_padded_on_dim_0_and_gathered_twice_and_reduce_scattered_once(comm):
    """Per step with one micro-batch: each unit gathered in forward and in backward and its gradients
    reduce-scattered: 3 (N-1)·ceil(rows/N)·row bytes per parameter, padding charged."""
    cfg = tiny(dp=2, steps=1, no_overlap=True)
    trainer = train.Trainer(cfg, comm.mpi)
    trainer.run()
    ledger = trainer.engine.updater.comm.ledger
    model = build.build_model(cfg.replace(dp=1, fsdp=False), None)
    padded = sum(-(-p.shape[0] // 2) * (p.size // p.shape[0]) for p in model.parameters())
    sent = ledger.total_report()["by_dim_op"]["dp"]
    assert sent == {"all_gather": 2 * padded * 8, "reduce_scatter": padded * 8}


@needs_world_size(4)
@mpi_test
def test_hybrid_trains_to_one_process_and_only_the_shards_all_reduce_crosses_nodes(comm):
    """dp 4 = (replicate 2) x (shard 2), ranks {0,1} and {2,3} on two nodes (ProcessGrid reads the
    node names: here each pair's own name)."""
    from unittest import mock

    cfg = tiny(dp=4, dp_replicate=2, steps=2, batch_size=8)
    node = f"node{comm.rank // 2}"
    with mock.patch("minipar.distributed.grid.MPI.Get_processor_name", return_value=node):
        trainer, records, full = trained(cfg, comm)
    model = build.build_model(cfg.replace(dp=1, fsdp=False, dp_replicate=1), None)
    shard = sum(-(-p.shape[0] // 2) * (p.size // p.shape[0]) for p in model.parameters()) * 8
    links = trainer.engine.updater.comm.ledger.total_links()["by_dim_link"]
    updater = trainer.engine.updater
    rank = updater.replicate.rank
    per_unit = [u.shard_numel for u in updater.units]  # elements, cut by the ring as array_split cuts
    all_reduce = sum(ring_bytes_sent("all_reduce", [(e - e // 2) * 8, e // 2 * 8], rank) for e in per_unit)
    assert sum(per_unit) * 8 == shard
    assert links["dp_replicate"] == {"intra": 0, "inter": 2 * all_reduce}  # 2 steps
    assert links["dp_shard"]["inter"] == 0
    assert sum(d["inter"] for dim, d in links.items() if dim != "dp_replicate") == 0
    if comm.rank == 0:
        assert deviations(cfg, records, full) == []
