"""FSDP2: every parameter sharded on dim 0 over the data-parallel ranks, made whole module by module.

The idea (PyTorch's `fully_shard`, FSDP2): in placements (placements.py) each parameter is
`Shard(0)` on the data-parallel mesh dimension: rank r holds rows [r·c, (r+1)·c) of it, c =
ceil(rows/N), and nothing is flattened across parameters, so a parameter keeps its identity and shape
(clipping, a checkpoint, fp8 scales see a parameter, not a range of a flat buffer). Like ZeRO-3
(zero3.py), whose hook points it reuses, a unit's parameters are all-gathered before its forward and
again before its backward (prefetching the neighbour unit unless --no-overlap), released after each,
and its gradients reduce-scattered as backward leaves it; the optimizer steps on the local shards.
As FSDP2 does, a unit's gather is one all-gather: each rank copies its chunk of every parameter into
one buffer (copy-in: rank-major, each chunk padded to c rows), and after the gather each parameter is
copied out of the N chunks (copy-out); the gradients go the other way, one reduce-scatter a unit.

Hybrid sharding (`--dp-replicate R`, HSDP): the data-parallel ranks are factored as (replicate R,
shard S = N/R), shard innermost (placements.py's `factor_data_parallel`): parameters are sharded over
the S ranks of a node and replicated across the R nodes, so the gathers stay inside a node and only
the gradient shards cross between nodes, as one all-reduce over "dp_replicate" at the step.

In bf16 or fp16 (`working`, as ZeRO-3's) each rank keeps its fp32 master rows and those rows rounded
to the 16-bit format, made again after every update; the gathers send the 2-byte patterns. Rounding
is elementwise, so each parameter's chunks rounded and then gathered are, bit for bit, the whole
parameter rounded: the working copy of the single-process run.

What it saves: model states (p+g+K)Ψ/N per rank (with R: /S), as ZeRO-3.
What it costs: ZeRO-3's bytes, 3(N-1)/N·Ψ per step, plus the padding: each parameter is padded on
dim 0 to a multiple of N rows (ZeRO-3 pads a unit once, to a multiple of N elements), and a copy-in
and a copy-out around each collective. Hybrid adds an all-reduce of the shards, 2(R-1)/R·Ψ/S.
Lesson: lessons/04b_placements.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np

from minipar.core.autograd import Tensor
from minipar.core.options import option
from minipar.distributed.collectives import Wire
from minipar.parallel.api import GradientPiece
from minipar.parallel.flat_units import FlatUnit
from minipar.parallel.logical_state import Piece, to_host
from minipar.parallel.placements import (
    DeviceMesh,
    Placement,
    Replicate,
    Shard,
    ShardedArray,
    StridedShard,
    chunk_bounds,
    factor_data_parallel,
)
from minipar.parallel.zero3 import ZeroStage3


@dataclass
class FSDPOptions:
    """Per-parameter sharding, FSDP2 (parallel/fsdp.py)."""
    fsdp: bool = option(False, "shard each parameter on dim 0 over the data-parallel ranks (FSDP2)",
                        single_process=False)
    dp_replicate: int = option(1, "with --fsdp: replicate R times, shard over dp/R ranks (hybrid sharding)",
                               single_process=1)


def config_errors(options: FSDPOptions, dp: int) -> list[str]:
    """--dp-replicate R: at least 1, only with --fsdp, and a divisor of the data-parallel ranks."""
    if options.dp_replicate < 1:
        return [f"--dp-replicate must be at least 1, got {options.dp_replicate}"]
    if options.dp_replicate > 1 and not options.fsdp:
        return [f"--dp-replicate {options.dp_replicate} needs --fsdp (hybrid sharding shards with FSDP)"]
    if dp % options.dp_replicate:
        return [f"--dp-replicate {options.dp_replicate} does not divide --dp {dp}"]
    return []


class PerParameterUnit(FlatUnit):
    """A unit whose flat buffer is rank-major: rank s's segment holds chunk s (padded to c_i rows) of
    every parameter i in turn, so rank s's shard is exactly its Shard(0) chunk of each parameter."""

    def __init__(self, module, named_params: list, comm):
        super().__init__(module, named_params, comm)
        self.parts, self.rank = comm.size, comm.rank
        self.rows = [shape[0] for shape in self.shapes]  # every parameter has a dim 0 (no scalars)
        self.row_numel = [int(np.prod(shape[1:], dtype=np.int64)) for shape in self.shapes]
        self.chunk_rows = [-(-rows // comm.size) for rows in self.rows]
        sizes = [c * r for c, r in zip(self.chunk_rows, self.row_numel)]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]  # of each chunk inside a segment
        self.shard_numel = sum(sizes)
        self.padded = self.shard_numel * comm.size
        self.start, self.stop = comm.rank * self.shard_numel, (comm.rank + 1) * self.shard_numel

    def flatten(self, arrays):
        """Copy-in: the arrays' chunks, rank by rank, each padded to its c rows (None counts as zeros)."""
        flat = self.xp.zeros(self.padded, dtype=self.dtype)
        segments = flat.reshape(self.parts, self.shard_numel)
        for i, a in enumerate(arrays):
            if a is None:
                continue
            rows = self.xp.zeros((self.chunk_rows[i] * self.parts, self.row_numel[i]), dtype=self.dtype)
            rows[: self.rows[i]] = a.reshape(self.rows[i], self.row_numel[i])
            size = self.chunk_rows[i] * self.row_numel[i]
            segments[:, self.offsets[i] : self.offsets[i] + size] = rows.reshape(self.parts, size)
        return flat

    def whole_params(self, flat) -> list:
        """Copy-out: each parameter from its N chunks in the gathered buffer, padding dropped."""
        segments = flat.reshape(self.parts, self.shard_numel)
        arrays = []
        for i, shape in enumerate(self.shapes):
            size = self.chunk_rows[i] * self.row_numel[i]
            rows = segments[:, self.offsets[i] : self.offsets[i] + size].reshape(-1, self.row_numel[i])
            arrays.append(self.xp.ascontiguousarray(rows[: self.rows[i]]).reshape(shape))
        return arrays

    def point_params_at(self, flat):
        for p, whole in zip(self.params, self.whole_params(flat)):
            p.data = whole

    def own_rows(self, i: int) -> tuple[int, int]:
        """[start, stop) of parameter i's rows this rank holds (torch.chunk's cut: maybe none)."""
        return chunk_bounds(self.rows[i], self.parts, self.rank)

    def own_chunk(self, shard, i: int):
        """Parameter i's rows in this rank's shard (a view, padding dropped), flat."""
        start, stop = self.own_rows(i)
        return shard[self.offsets[i] : self.offsets[i] + (stop - start) * self.row_numel[i]]


class FullyShardedDataParallel(ZeroStage3):
    """Updater and model wrapper: ZeRO-3's schedule on per-parameter Shard(0) chunks; with a
    `replicate` communicator (hybrid sharding), the gradient shards are all-reduced over it; with a
    `working` wire (bf16, fp16), the rounded rows are gathered (zero3.py)."""

    unit_type = PerParameterUnit

    def __init__(self, model, optimizer, comm, replicate=None, prefetch: bool = False,
                 working: Wire | None = None, tp=None):
        self.replicate = replicate
        super().__init__(model, optimizer, comm, prefetch=prefetch, working=working)
        names = {"dp_replicate": replicate, "dp_shard": comm} if replicate is not None else {"dp": comm}
        self.tp = tp if tp is not None and tp.size > 1 else None  # where parameters are tp shards
        self.mesh = DeviceMesh({**names, **({"tp": tp} if self.tp is not None else {})})

    def sharded_units(self) -> list[PerParameterUnit]:
        return cast("list[PerParameterUnit]", self.units)  # made by unit_type

    def synchronize_gradients(self):
        super().synchronize_gradients()
        if self.replicate is not None and self.replicate.size > 1:  # the replicas' shards summed
            for unit in self.units:
                unit.grad_shard[...] = self.replicate.all_reduce(unit.grad_shard)

    def ready_gradients(self):
        """Each parameter's own rows of its summed gradient (views), at their offset in it."""
        pieces, counted = [], self.replicate is None or self.replicate.rank == 0  # a replica counts once
        for unit in self.sharded_units():
            for i, (name, p) in enumerate(zip(unit.names, unit.params)):
                grad = unit.own_chunk(unit.grad_shard, i)
                if grad.size:
                    pieces.append(GradientPiece(name, p, grad, offset=unit.own_rows(i)[0] * unit.row_numel[i],
                                                counted=counted))
        return pieces

    def sharded_parameters(self) -> dict:
        """{name: ShardedArray}: each parameter's local rows, placed on the mesh (dp_replicate: Replicate,
        then dp or dp_shard, then tp). Shard(0) on dp cuts the parameter's rows, or, where tp shards dim
        0 too (column-parallel), the tp shard's rows: StridedShard(0), tp-major. A tp shard is Shard on
        its axis of the parameter padded as Megatron pads its vocabulary (padded_bounds)."""
        sharded = {}
        for unit in self.sharded_units():
            for i, (name, p) in enumerate(zip(unit.names, unit.params)):
                local = Tensor(unit.own_chunk(unit.param_shard, i).reshape(-1, *unit.shapes[i][1:]))
                shape, dp = tuple(unit.shapes[i]), Shard(0)
                tp: tuple[Placement, ...] = ()
                if self.tp is not None and p.shard is not None:
                    rows = list(p.shard.full_shape)
                    rows[p.shard.axis] = self.tp.size * (p.shard.stop - p.shard.start)
                    shape, tp = tuple(rows), (Shard(p.shard.axis),)
                    dp = StridedShard(0) if p.shard.axis == 0 else Shard(0)
                elif self.tp is not None:
                    tp = (Replicate(),)
                placements = ((Replicate(),) if self.replicate is not None else ()) + (dp,) + tp
                sharded[name] = ShardedArray(local, shape, placements, self.mesh)
        return sharded

    def checkpoint_pieces(self) -> dict:
        """{name: {kind: (Piece, array)}}: each parameter's own rows, as a flat range of its tp shard."""
        pieces = {}
        for unit in self.sharded_units():
            kinds = {"param": unit.param_shard, **unit.state}
            for i, (name, p) in enumerate(zip(unit.names, unit.params)):
                start, stop = unit.own_rows(i)
                if start == stop:
                    continue
                full_shape = p.shard.full_shape if p.shard else tuple(unit.shapes[i])
                row = unit.row_numel[i]
                piece = Piece(tuple(full_shape), p.shard, (start * row, stop * row))
                pieces[name] = {kind: (piece, to_host(unit.own_chunk(value, i)))
                                for kind, value in kinds.items() if hasattr(value, "shape")}
                pieces[name].update({kind: (Piece(()), np.asarray(count))
                                     for kind, count in kinds.items() if not hasattr(count, "shape")})
        return pieces

    def local_state(self) -> dict:
        """{name: (tensor-parallel shard or None, full local array)}: a collective over the shard ranks."""
        state = {}
        for unit in self.sharded_units():
            flat = self.comm.all_gather(unit.param_shard, numel=unit.padded)
            for name, p, whole in zip(unit.names, unit.params, unit.whole_params(flat)):
                state[name] = (p.shard, to_host(whole).copy())
        return state


def build(options: FSDPOptions, grid, model, optimizer, prefetch: bool,
          working: Wire | None = None) -> FullyShardedDataParallel:
    """FSDP over the data-parallel ranks (dp·cp), or hybrid: sharded over dp_shard, replicated over
    dp_replicate; `working`: the 16-bit format the parameters are gathered in (bf16, fp16)."""
    if options.dp_replicate > 1:
        replicate, shard = factor_data_parallel(grid.dp_cp, options.dp_replicate)
        return FullyShardedDataParallel(model, optimizer, shard, replicate=replicate, prefetch=prefetch,
                                        working=working, tp=grid.tp)
    return FullyShardedDataParallel(model, optimizer, grid.dp_cp, prefetch=prefetch, working=working,
                                    tp=grid.tp)
