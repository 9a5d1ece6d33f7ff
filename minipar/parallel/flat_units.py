"""The flat per-unit buffers that every ZeRO stage shards, and the checks that the replicas agree.

Each unit of the model (`model.units()`: the embedding, a block, the head) is seen as one flat buffer
holding its parameters one after another, padded to a multiple of the N data-parallel ranks so that it
cuts into N equal shards; rank r owns shard r. Stages 1 and 2 (zero.py), stage 3 (zero3.py) and the
chunked engine (zero_chunked.py) all start from these `FlatUnit`s. The parameters stay views into the
buffer (`unflatten`), so the model computes with whatever values the buffer holds.

What it costs: the padding, fewer than N elements per unit. Lesson: lessons/04_zero.md.
"""

from __future__ import annotations

import zlib

import numpy as np

from minipar.core import backend
from minipar.core.backend import Array, xp_of
from minipar.core.shards import padded_bounds, padded_numel
from minipar.parallel.api import GradientPiece


def unflatten(flat, shapes) -> list:
    """Views into `flat`, one per shape, in order (the inverse of flattening; no copy)."""
    views, offset = [], 0
    for shape in shapes:
        size = 1
        for n in shape:
            size *= n
        views.append(flat[offset : offset + size].reshape(shape))
        offset += size
    return views


class FlatUnit:
    """One unit's parameters seen as a flat buffer of `padded` elements, of which this rank owns
    [start, stop). The padding past `numel` stays zero: zero gradients leave it zero under Adam and SGD.
    The updaters set what each stage keeps (the last five attributes)."""

    def __init__(self, module, named_params: list, comm):
        self.module = module
        self.names = [name for name, _ in named_params]
        self.params = [p for _, p in named_params]
        self.shapes = [p.shape for p in self.params]
        self.dtype = self.params[0].dtype
        self.xp = xp_of(self.params[0].data)
        self.numel = sum(p.size for p in self.params)
        self.padded = padded_numel(self.numel, comm.size)
        self.start, self.stop = padded_bounds(self.numel, comm.size, comm.rank)
        self.shard_numel = self.stop - self.start
        # What the ZeRO stages keep. `flat` may be None at any time; the others are set by the updater's
        # constructor, before any other use, so they are declared here without a value.
        self.flat: Array | None = None  # the whole buffer while it exists (always at stages 1-2)
        self.param_shard: Array  # this rank's [start, stop) of it: a view at stages 1-2, its own at 3
        self.state: dict  # the optimizer's state for param_shard (optimizer.init_state)
        self.grad_shard: Array  # from stage 2: this rank's shard of the summed gradients
        self.freed: Array  # stage 3: the empty array a released parameter's data points at

    def flatten(self, arrays):
        """The arrays one after another in a new zero-padded flat buffer (None counts as zeros)."""
        flat = self.xp.zeros(self.padded, dtype=self.dtype)
        for view, a in zip(unflatten(flat, self.shapes), arrays):
            if a is not None:
                view[...] = a
        return flat

    def grads_nbytes(self) -> int:
        return sum(p.grad.nbytes for p in self.params if p.grad is not None)

    def has_grads(self) -> bool:
        return any(p.grad is not None for p in self.params)

    def point_params_at(self, flat):
        """Make every parameter's data a view into `flat`, so the model computes with its values."""
        for p, view in zip(self.params, unflatten(flat, self.shapes)):
            p.data = view


def shard_pieces(tensors, grad_shard, start: int) -> list[GradientPiece]:
    """The gradient pieces of a flat buffer's shard: `tensors` are (name, param, offset in the buffer,
    numel; a released ZeRO-3 parameter's data is empty) and `grad_shard` holds the buffer's elements
    from `start` on; each piece is a view of it."""
    stop, pieces = start + grad_shard.size, []
    for name, param, offset, numel in tensors:
        lo, hi = max(offset, start), min(offset + numel, stop)
        if lo < hi:
            pieces.append(GradientPiece(name, param, grad_shard[lo - start : hi - start], offset=lo - offset))
    return pieces


def unit_tensors(unit: FlatUnit) -> list[tuple]:
    """(name, param, offset in the unit's flat buffer, numel) of each of the unit's parameters."""
    tensors, offset = [], 0
    for name, param, shape in zip(unit.names, unit.params, unit.shapes):
        numel = int(np.prod(shape, dtype=np.int64))
        tensors.append((name, param, offset, numel))
        offset += numel
    return tensors


def units_of(model, comm, unit_type: type[FlatUnit] = FlatUnit) -> list[FlatUnit]:
    """A FlatUnit (or unit_type) per unit of the model, in execution order; every parameter in one."""
    names = {id(p): name for name, p in model.named_parameters()}
    units = [unit_type(module, [(names[id(p)], p) for p in module.parameters()], comm)
             for _, module in model.units() if module.parameters()]
    covered = {id(p) for unit in units for p in unit.params}
    missing = [name for i, name in names.items() if i not in covered]
    if missing:
        raise ValueError(f"ZeRO shards parameters unit by unit, and {missing[0]} is in no unit of the model")
    return units


def replica_fingerprint(model) -> list[tuple]:
    """(name, shape, CRC-32 of the bytes) of every parameter: equal fingerprints, equal weights."""
    to_host = backend.current().to_host
    return [(name, tuple(p.shape), zlib.crc32(to_host(p.data).tobytes()))
            for name, p in model.named_parameters()]


def check_replicas_identical(model, comm) -> None:
    """Raise on every rank of `comm` if any replica's weights differ from rank 0's."""
    every = comm.allgather_obj(replica_fingerprint(model))
    for rank, theirs in enumerate(every[1:], start=1):
        differing = [a[0] for a, b in zip(every[0], theirs) if a != b]
        if differing or len(theirs) != len(every[0]):
            shown = ", ".join(differing[:3]) or "the parameter list"
            raise RuntimeError(f"data-parallel replicas start from different weights: dp rank {rank} differs "
                               f"from dp rank 0 in {shown}{' ...' if len(differing) > 3 else ''}")
