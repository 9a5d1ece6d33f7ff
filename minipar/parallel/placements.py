"""Placements on a device mesh: one vocabulary for every way a tensor is spread over ranks.

The idea (PyTorch's DTensor, torchtitan, FSDP2; JAX's shardings say the same): name the parallel
dimensions of the process grid (a `DeviceMesh`: "dp", "pp", "tp", or "dp_replicate" and "dp_shard"
for hybrid sharding), and give every tensor one placement per mesh dimension:

    Shard(d)     the ranks of that dimension each hold a chunk of tensor dim d (torch.chunk's cut:
                 ceil(n/N) rows each, the last ones shorter or empty)
    Replicate()  each rank holds the whole tensor
    Partial()    each rank holds a summand: the tensor is the sum over the dimension's ranks

A `ShardedArray` is a local piece (a Tensor), the global shape and the placements. Changing the
placement on a dimension is a collective, and `redistribute` picks it, one mesh dimension at a time:

    Shard(d)  -> Replicate   all-gather            Partial  -> Replicate   all-reduce
    Partial   -> Shard(d)    reduce-scatter        Shard(i) -> Shard(j)    all-to-all
    Replicate -> Shard(d)    a local chunk         Replicate -> Partial    local (rank 0 keeps it,
    Shard(d)  -> Partial     local (zeros around)                          the others hold zeros)

It is differentiable as DTensor's redistribute: the gradient is redistributed from its own
placements back to the input's (an input that was Partial gets a Replicate gradient). The gradient
of a gathered weight that each rank used on its own data is Partial: it goes back by reduce-scatter
(FSDP's gradient); one that every rank holds whole (Replicate) is cut locally: no bytes.
DTensor's Replicate -> Partial divides by N on every rank; here rank 0 keeps the value, exact for
any N in floating point.

Uneven shards are padded for the collectives to ceil(n/N) rows, as FSDP2 pads dim 0: the padding
goes over the wire and is charged on the ledger (the all-gather of a Shard(0) tensor of n rows costs
(N-1)·ceil(n/N) rows per rank), and the local pieces themselves hold no padding. A tensor dim is
cut by at most two mesh dimensions: a Shard(d), and before it in the mesh a StridedShard(d) that cuts
each of its chunks again (DTensor's _StridedShard: FSDP's dp over a tp shard's rows, tp-major, so
the tp shards stay whole ranges and checkpoints reshard); redistribute undoes a StridedShard before
its Shard and makes it after. `tensor_parallel_mlp` and `tensor_parallel_attention` write Megatron's
layers (tensor.py) and, with `sequence`, sequence parallelism's (sequence.py: activations Shard(1),
the sequence, between the regions) in placements.
What it saves or costs: nothing of its own; each collective is charged to its mesh dimension's
communicator. Lesson: lessons/04b_placements.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minipar.core import functional as F
from minipar.core.autograd import Function, Tensor
from minipar.core.backend import xp_of
from minipar.core.nn import attention_core
from minipar.core.shards import padded_bounds, padded_numel
from minipar.distributed import collectives
from minipar.distributed.communicator import Comm


@dataclass(frozen=True)
class Shard:
    """The ranks of a mesh dimension each hold a chunk of tensor dim `dim`."""

    dim: int


@dataclass(frozen=True)
class StridedShard(Shard):
    """Shard(dim) of the chunks a later mesh dimension's Shard(dim) made: FSDP over tensor
    parallelism cuts each tp shard's rows over dp, tp-major (DTensor's _StridedShard, whose
    split_factor is here the later dimension's size)."""


@dataclass(frozen=True)
class Replicate:
    """Every rank of a mesh dimension holds the whole tensor."""


@dataclass(frozen=True)
class Partial:
    """Every rank of a mesh dimension holds a summand; the tensor is their sum."""


Placement = Shard | StridedShard | Replicate | Partial


class DeviceMesh:
    """Named mesh dimensions, each a communicator (its name is the ledger's dimension)."""

    def __init__(self, dims: dict[str, Comm]):
        self.dims = dict(dims)
        self.names = list(self.dims)

    @classmethod
    def from_grid(cls, grid, replicate: int = 1) -> DeviceMesh:
        """The process grid's dimensions (dp, pp, tp; cp when used). With replicate R > 1 the
        data-parallel dimension (dp·cp) is factored as (dp_replicate R, dp_shard S), shard innermost."""
        dims: dict[str, Comm] = {}
        if replicate > 1:
            dims["dp_replicate"], dims["dp_shard"] = factor_data_parallel(grid.dp_cp, replicate)
        else:
            dims["dp"] = grid.dp_cp
        dims.update(pp=grid.pp, tp=grid.tp)
        return cls(dims)

    def size(self, name: str) -> int:
        return self.dims[name].size

    def __repr__(self) -> str:
        return "DeviceMesh(" + ", ".join(f"{n}={c.size}" for n, c in self.dims.items()) + ")"


def factor_data_parallel(dp: Comm, replicate: int) -> tuple[Comm, Comm]:
    """dp's N ranks as (replicate R, shard S = N/R), shard innermost: dp rank i is replica i // S,
    shard i % S, so consecutive ranks (one node) share a shard group and replicas are nodes apart."""
    if replicate < 1 or dp.size % replicate:
        raise ValueError(f"--dp-replicate {replicate} does not divide the {dp.size} data-parallel ranks")
    shards = dp.size // replicate
    nodes = dp.nodes
    replica, shard = divmod(dp.rank, shards)
    key = (replicate, shards)
    shard_comm = dp.split(color=replica, key=shard, name="dp_shard", reuse=key,
                          nodes=None if nodes is None else nodes[replica * shards:(replica + 1) * shards])
    replica_comm = dp.split(color=shard, key=replica, name="dp_replicate", reuse=key,
                            nodes=None if nodes is None else nodes[shard::shards])
    return replica_comm, shard_comm


def chunk_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of chunk `index` of n rows cut as torch.chunk cuts: ceil(n/parts) rows each."""
    start, stop = padded_bounds(n, parts, index)
    return min(start, n), min(stop, n)


def _take(a, dim: int, start: int, stop: int):
    index = [slice(None)] * a.ndim
    index[dim] = slice(start, stop)
    return a[tuple(index)]


def _pad_rows(a, dim: int, rows: int):
    """a with zero rows appended along dim up to `rows`."""
    missing = rows - a.shape[dim]
    if missing == 0:
        return a
    widths = [(0, 0)] * a.ndim
    widths[dim] = (0, missing)
    return xp_of(a).pad(a, widths)


def _gather(a, comm: Comm, dim: int, n: int):
    """Shard(dim) -> Replicate: all-gather the padded chunks, drop the padding."""
    xp, per = xp_of(a), padded_numel(n, comm.size) // comm.size
    front = xp.ascontiguousarray(xp.moveaxis(_pad_rows(a, dim, per), dim, 0))
    gathered = comm.all_gather(front, numel=front.size * comm.size).reshape(comm.size * per, *front.shape[1:])
    return xp.moveaxis(gathered[:n], 0, dim)


def _reduce_scatter(a, comm: Comm, dim: int):
    """Partial -> Shard(dim): reduce-scatter over padded chunks, keep this rank's rows."""
    xp, n = xp_of(a), a.shape[dim]
    per = padded_numel(n, comm.size) // comm.size
    front = xp.ascontiguousarray(xp.moveaxis(_pad_rows(a, dim, per * comm.size), dim, 0))
    mine = comm.reduce_scatter(front).reshape(per, *front.shape[1:])
    start, stop = chunk_bounds(n, comm.size, comm.rank)
    return xp.moveaxis(mine[: stop - start], 0, dim)


def _all_to_all(a, comm: Comm, source: int, target: int, sizes: tuple):
    """Shard(source) -> Shard(target): block s (this rank's rows of source, chunk s of target, both
    padded) goes to rank s; the blocks received are stacked along source."""
    xp, parts = xp_of(a), comm.size
    per_source = padded_numel(sizes[source], parts) // parts
    per_target = padded_numel(sizes[target], parts) // parts
    padded = _pad_rows(_pad_rows(a, source, per_source), target, per_target * parts)
    blocks = xp.stack([_take(padded, target, s * per_target, (s + 1) * per_target) for s in range(parts)])
    received = collectives.all_to_all(comm, blocks)
    whole = xp.concatenate(list(received), axis=source)[
        tuple(slice(0, sizes[source]) if d == source else slice(None) for d in range(a.ndim))]
    start, stop = chunk_bounds(sizes[target], parts, comm.rank)
    return _take(whole, target, 0, stop - start)


def _check_supported(placements: tuple) -> None:
    """A tensor dim is cut by at most one plain Shard and one StridedShard, the StridedShard on an
    earlier mesh dimension than the Shard it cuts further (FSDP's dp before tp)."""
    for i, p in enumerate(placements):
        if type(p) is Shard and any(type(q) is Shard and q.dim == p.dim for q in placements[i + 1:]):
            raise ValueError(f"placements {placements}: Shard({p.dim}) on two mesh dimensions is not "
                             f"supported; StridedShard({p.dim}) on the first cuts the second's chunks")
        if isinstance(p, StridedShard) and not any(type(q) is Shard and q.dim == p.dim
                                                   for q in placements[i + 1:]):
            raise ValueError(f"placements {placements}: StridedShard({p.dim}) needs Shard({p.dim}) on a "
                             "later mesh dimension (it cuts that dimension's chunks)")
        if isinstance(p, StridedShard) and sum(q == p for q in placements) > 1:
            raise ValueError(f"placements {placements}: StridedShard({p.dim}) on two mesh dimensions")


def _level_shape(global_shape: tuple, mesh: DeviceMesh, placements: tuple, steps: tuple) -> tuple:
    """The shape a mesh dimension's step cuts: the global one, but for a StridedShard(d) among
    `steps` (its placement before or after), dim d is this rank's chunk of the later Shard(d)."""
    shape = list(global_shape)
    for step in steps:
        if isinstance(step, StridedShard):
            k = next(k for k, q in enumerate(placements) if type(q) is Shard and q.dim == step.dim)
            comm = mesh.dims[mesh.names[k]]
            start, stop = chunk_bounds(global_shape[step.dim], comm.size, comm.rank)
            shape[step.dim] = stop - start
    return tuple(shape)


def _step_order(now: tuple, to: tuple) -> list[int]:
    """The mesh dimensions to change, in an order whose every state is supported: a StridedShard
    undone first (its Shard still there), then the others in mesh order, a StridedShard made last."""
    changed = [i for i in range(len(now)) if now[i] != to[i]]
    first = [i for i in changed if isinstance(now[i], StridedShard)]
    last = [i for i in changed if isinstance(to[i], StridedShard) and i not in first]
    return first + [i for i in changed if i not in first and i not in last] + last


def change_placement(a, comm: Comm, now: Placement, to: Placement, global_shape: tuple):
    """The local piece after one mesh dimension goes from `now` to `to`: the collective or local step."""
    xp = xp_of(a)
    if now == to:
        return a
    if isinstance(now, Shard) and isinstance(to, Shard):
        if now.dim == to.dim:
            raise ValueError(f"{now} -> {to} on one mesh dimension: go through Replicate()")
        return _all_to_all(a, comm, now.dim, to.dim, global_shape)
    if isinstance(now, Shard):  # to Replicate, or to Partial through a zero-padded whole
        whole = _gather(a, comm, now.dim, global_shape[now.dim]) if isinstance(to, Replicate) else None
        if whole is None:
            start, _ = chunk_bounds(global_shape[now.dim], comm.size, comm.rank)
            shape = list(a.shape)
            shape[now.dim] = global_shape[now.dim]
            whole = xp.zeros(shape, dtype=a.dtype)
            _take(whole, now.dim, start, start + a.shape[now.dim])[...] = a
        return whole
    if isinstance(now, Partial):
        if isinstance(to, Replicate):
            return comm.all_reduce(a)
        assert isinstance(to, Shard)
        return _reduce_scatter(a, comm, to.dim)
    if isinstance(to, Shard):  # Replicate -> Shard: this rank's chunk, no communication
        return xp.ascontiguousarray(_take(a, to.dim, *chunk_bounds(a.shape[to.dim], comm.size, comm.rank)))
    return a.copy() if comm.rank == 0 else xp.zeros_like(a)  # Replicate -> Partial


def redistribute_local(a, mesh: DeviceMesh, global_shape: tuple, now: tuple, to: tuple):
    """The local piece of a tensor whose placements go from `now` to `to`, one mesh dim at a time."""
    _check_supported(now)
    _check_supported(to)
    placements = list(now)
    for i in _step_order(now, to):
        before, placements[i] = tuple(placements), to[i]
        _check_supported(tuple(placements))  # the steps between stay supported
        shape = _level_shape(global_shape, mesh, before, (now[i], to[i]))
        a = change_placement(a, mesh.dims[mesh.names[i]], now[i], to[i], shape)
    return a


def gradient_placements(placements: tuple) -> tuple:
    """A tensor's gradient placements by default: its own, with Partial made Replicate (the gradient
    of a sum of summands is the same for every summand)."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


class Redistribute(Function):
    """Forward: the local piece in the new placements. Backward: the gradient, which arrives in
    `grad_placements`, goes back to the input's gradient placements."""

    @staticmethod
    def forward(ctx, local, mesh, global_shape, now, to, grad_placements):
        ctx.mesh, ctx.global_shape, ctx.now, ctx.grad_placements = mesh, global_shape, now, grad_placements
        return redistribute_local(local, mesh, global_shape, now, to)

    @staticmethod
    def backward(ctx, grad):
        back = redistribute_local(grad, ctx.mesh, ctx.global_shape, ctx.grad_placements,
                                  gradient_placements(ctx.now))
        return back, None, None, None, None, None


@dataclass
class ShardedArray:
    """A tensor spread over a mesh: this rank's local piece, the global shape and one placement per
    mesh dimension (DTensor)."""

    local: Tensor
    global_shape: tuple
    placements: tuple
    mesh: DeviceMesh

    def redistribute(self, placements, grad_placements=None) -> ShardedArray:
        """The same tensor in new placements (a collective where one is needed); differentiable.
        grad_placements: how the gradient of the result arrives (default: the new placements, Partial
        made Replicate); Partial when each rank uses the result on its own data."""
        placements = tuple(placements)
        grads = gradient_placements(placements) if grad_placements is None else tuple(grad_placements)
        local = Redistribute.apply(self.local, self.mesh, self.global_shape, self.placements, placements,
                                   grads)
        return ShardedArray(local, self.global_shape, placements, self.mesh)

    def full(self):
        """The whole tensor on every rank (a collective unless already Replicate everywhere)."""
        every = tuple(Replicate() for _ in self.placements)
        return redistribute_local(self.local.data, self.mesh, self.global_shape, self.placements, every)


def distribute(full, mesh: DeviceMesh, placements, requires_grad: bool = False) -> ShardedArray:
    """A whole tensor, held alike on every rank, cut to this rank's piece (DTensor's distribute_tensor;
    Partial: rank 0 of that dimension holds it, the others zeros). No communication."""
    placements = tuple(placements)
    every = tuple(Replicate() for _ in placements)
    local = redistribute_local(np.asarray(full), mesh, tuple(full.shape), every, placements)
    return ShardedArray(Tensor(local, requires_grad), tuple(full.shape), placements, mesh)


def enter_tensor_parallel(x: Tensor, mesh: DeviceMesh, sequence: bool = False) -> Tensor:
    """The input of a tensor-parallel region made Replicate on "tp". Its gradient arrives Partial
    (each rank's columns give a summand of it) and goes back to the input's placement: Megatron's f
    (Replicate -> Replicate: nothing forward, an all-reduce backward), or, with sequence parallelism,
    the (b, s/t, h) piece Shard(1) all-gathered (a reduce-scatter along the sequence backward)."""
    now = Shard(1) if sequence else Replicate()
    shape = (x.shape[0], x.shape[1] * mesh.size("tp"), *x.shape[2:]) if sequence else tuple(x.shape)
    whole = ShardedArray(x, shape, (now,), mesh)
    return whole.redistribute((Replicate(),), grad_placements=(Partial(),)).local


def leave_tensor_parallel(partial: Tensor, mesh: DeviceMesh, sequence: bool = False) -> Tensor:
    """A row-parallel product's partial sums (Partial on "tp") made whole: Megatron's g (-> Replicate:
    an all-reduce, and a Replicate gradient that goes back for free), or, with sequence parallelism,
    this rank's positions (-> Shard(1): a reduce-scatter, and an all-gather of the gradient)."""
    to = Shard(1) if sequence else Replicate()
    return ShardedArray(partial, tuple(partial.shape), (Partial(),), mesh).redistribute((to,)).local


def _row_bias(y: Tensor, bias, mesh: DeviceMesh, sequence: bool) -> Tensor:
    """The row-parallel bias, Replicate, added to the whole output, or to this rank's positions: then
    each rank's gradient of it is a summand (Partial), all-reduced in backward."""
    if sequence:
        bias = ShardedArray(bias, tuple(bias.shape), (Replicate(),), mesh).redistribute(
            (Replicate(),), grad_placements=(Partial(),)).local
    return y + bias


def tensor_parallel_mlp(x: Tensor, fc, proj, mesh: DeviceMesh, sequence: bool = False) -> Tensor:
    """Megatron's MLP (tensor.py's ParallelMLP; with `sequence`, sequence.py's SequenceParallelMLP)
    in placements, on a mesh with a "tp" dimension: the fc weight is Shard(0) (column-parallel), the
    proj weight Shard(1) (row-parallel); the input Replicate (with `sequence`, a Shard(1) piece of
    the sequence), and so is the output."""
    copied = enter_tensor_parallel(x, mesh, sequence)  # f, or the sequence's all-gather
    hidden = F.gelu(F.linear(copied, fc.weight, fc.bias))  # Shard(-1): this rank's columns
    partial = F.linear(hidden, proj.weight)  # Partial: a summand of the output
    return _row_bias(leave_tensor_parallel(partial, mesh, sequence), proj.bias, mesh, sequence)  # g


def tensor_parallel_attention(x: Tensor, attn, mesh: DeviceMesh, sequence: bool = False) -> Tensor:
    """Megatron's attention (tensor.py's ParallelAttention; with `sequence`, sequence.py's
    SequenceParallelAttention) in placements: query, key and value weights Shard(0) (this rank's
    heads), proj Shard(1); one enter for the three (their input gradients summed locally first)."""
    copied = enter_tensor_parallel(x, mesh, sequence)
    q, k, v = (F.linear(copied, layer.weight, layer.bias) for layer in (attn.query, attn.key, attn.value))
    y = attention_core(q, k, v, attn.local_heads, attn.recompute_core, attn.attention)  # Shard(-1)
    partial = F.linear(y, attn.proj.weight)
    return _row_bias(leave_tensor_parallel(partial, mesh, sequence), attn.proj.bias, mesh, sequence)
