"""Logical state, and the pieces of it that ranks hold: what a checkpoint saves and how it re-cuts it.

The idea: whatever the layout, training state is one set of *logical tensors*: for every parameter
name, the full parameter and each optimizer state of its shape (AdamW's exp_avg and exp_avg_sq and its
step count; SGD's momentum_buffer). A rank holds a *piece* of each logical tensor it touches, described
in two steps:

    shard   tensor parallelism: [start, stop) of the full tensor along one axis (`core/shards.py` Shard;
            None: the whole tensor). Rows past the end are padding (a vocabulary split unevenly).
    flat    ZeRO: then [start, stop) of that shard, flattened (None: the whole shard). A unit's
            flat buffer is cut into equal slices, so a rank's slice may begin and end mid-parameter.

    full (V x D), tp=2                       rank's shard, flattened, zero=2 (dp ranks 0 and 1)
    +-----------+
    | shard 0   | -> rows [0, V/2)     ->    [==== dp 0: flat 0..k ====|== dp 1: flat k..n ==]
    +-----------+
    | shard 1   | -> rows [V/2, V)     ->    [==== dp 0: flat 0..k ====|== dp 1: flat k..n ==]
    +-----------+

Saving writes every piece once with its description; loading puts the full tensor back together
(`assemble`) and cuts the piece the new layout needs (`Piece.cut`), so a checkpoint written at one
layout resumes at any other. The updaters (api.py's LocalUpdater, which DDP inherits; zero.py's
stages, which zero3.py inherits; zero_chunked.py) describe what they hold with these functions, in
two methods: `checkpoint_pieces()` and `load_logical(state)`. A count (the step) is a Piece of shape ().
Lesson: lessons/12_reliability.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minipar.core.backend import current as current_backend
from minipar.core.shards import Shard, shard_of


@dataclass(frozen=True)
class Piece:
    """Where an array sits in its logical tensor of `full_shape`: a tensor-parallel shard (None: the
    whole tensor), then a flat [start, stop) range of that shard (None: the whole shard)."""

    full_shape: tuple
    shard: Shard | None = None
    flat: tuple[int, int] | None = None

    def cut(self, full: np.ndarray) -> np.ndarray:
        """This piece of a full tensor (padding rows past its end are zeros, as in `shards.shard_of`)."""
        local = shard_of(full, self.shard)
        return local if self.flat is None else local.reshape(-1)[self.flat[0] : self.flat[1]]

    def local_shape(self) -> tuple:
        """The shape of the tensor-parallel shard (padding rows included)."""
        shape = list(self.full_shape)
        if self.shard is not None:
            shape[self.shard.axis] = self.shard.stop - self.shard.start
        return tuple(shape)

    def to_json(self) -> dict:
        shard = None if self.shard is None else [self.shard.axis, self.shard.start, self.shard.stop]
        return {"shard": shard, "flat": None if self.flat is None else list(self.flat)}

    @staticmethod
    def from_json(entry: dict, full_shape) -> Piece:
        full_shape = tuple(full_shape)
        shard = None if entry["shard"] is None else Shard(full_shape, *entry["shard"])
        return Piece(full_shape, shard, None if entry["flat"] is None else tuple(entry["flat"]))


def assemble(pieces: list[tuple[Piece, np.ndarray]]) -> np.ndarray:
    """The full tensor from pieces that together cover it: each shard's flat ranges, then the shards."""
    # exercise 12.1: resharding: a tensor assembled from the pieces of any layout
    full_shape = pieces[0][0].full_shape
    shards: dict[Shard | None, np.ndarray] = {}  # None: an unsplit tensor
    for piece, array in pieces:
        local = shards.setdefault(piece.shard, np.zeros(piece.local_shape(), dtype=array.dtype))
        start, stop = piece.flat or (0, local.size)
        local.reshape(-1)[start:stop] = array.reshape(-1)
    padded = list(full_shape)
    for shard in shards:
        if shard is not None:
            padded[shard.axis] = max(padded[shard.axis], shard.stop)
    full = np.zeros(padded, dtype=pieces[0][1].dtype)
    for shard, local in shards.items():
        index = [slice(None)] * full.ndim
        if shard is not None:
            index[shard.axis] = slice(shard.start, shard.stop)
        full[tuple(index)] = local
    return full[tuple(slice(0, n) for n in full_shape)]
    # end exercise


def to_host(array) -> np.ndarray:
    """A host copy: a checkpoint's pieces must not change when the optimizer next updates in place."""
    return np.array(current_backend().to_host(array))


def whole_pieces(named_params, optimizer) -> dict:
    """{name: {kind: (Piece, array)}} for parameters held whole (or as a tensor-parallel shard), with
    the optimizer's state for each: what LocalUpdater and DDP hold."""
    states = {id(p): s for p, s in zip(optimizer.params, optimizer.state)}
    pieces = {}
    for name, p in named_params:
        piece = Piece(tuple(p.full_shape), p.shard)
        pieces[name] = {"param": (piece, to_host(p.data))}
        for kind, value in (states.get(id(p)) or {}).items():
            if hasattr(value, "shape"):
                pieces[name][kind] = (piece, to_host(value).reshape(p.shape))
            else:  # a count (AdamW's step): held whole by every rank
                pieces[name][kind] = (Piece(()), np.asarray(value))
    return pieces


def load_whole(named_params, optimizer, state) -> None:
    """Set each parameter and its optimizer state from the logical `state` (the inverse of whole_pieces)."""
    from_host = current_backend().from_host
    states = {id(p): i for i, p in enumerate(optimizer.params)}
    for name, p in named_params:
        logical = state[name]
        piece = Piece(tuple(p.full_shape), p.shard)
        p.data[...] = from_host(piece.cut(logical["param"]).astype(p.dtype))
        fresh = optimizer.init_state(p.data.size, p.dtype, current_backend().xp)
        if not set(fresh) <= set(logical):
            continue  # saved before this parameter's first step: no state yet
        for kind, value in fresh.items():
            if hasattr(value, "shape"):
                fresh[kind] = from_host(piece.cut(logical[kind]).reshape(-1).astype(p.dtype))
            else:
                fresh[kind] = int(logical[kind])
        optimizer.state[states[id(p)]] = fresh


def flat_pieces(tensors, start: int, stop: int, shards: dict) -> dict:
    """{name: {kind: (Piece, array)}} for this rank's [start, stop) of a flat buffer of tensors (a ZeRO
    unit, a chunk): `tensors` lists (name, parameter, its local shape, its offset in the buffer).

    `shards` maps a kind ("param", "exp_avg", ...) to this rank's slice of that flat buffer, or to a
    count (the step) that holds for every tensor in the buffer."""
    pieces = {}
    for name, p, shape, offset in tensors:
        size = int(np.prod(shape))  # p.data may be freed (ZeRO-3): the buffer remembers the shapes
        first, last = max(start, offset), min(stop, offset + size)
        if first < last:
            full_shape = p.shard.full_shape if p.shard else tuple(shape)
            piece = Piece(tuple(full_shape), p.shard, (first - offset, last - offset))
            pieces[name] = {kind: (piece, to_host(shard[first - start : last - start]))
                            for kind, shard in shards.items() if hasattr(shard, "shape")}
            pieces[name].update({kind: (Piece(()), np.asarray(count))
                                 for kind, count in shards.items() if not hasattr(count, "shape")})
    return pieces


def flat_unit_pieces(unit, shards: dict) -> dict:
    """flat_pieces of a ZeRO unit (zero.py's FlatUnit): its parameters one after another."""
    sizes = [int(np.prod(shape)) for shape in unit.shapes]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return flat_pieces(zip(unit.names, unit.params, unit.shapes, offsets), unit.start, unit.stop, shards)


def flat_unit_buffer(unit, state, kind: str):
    """A ZeRO unit's whole padded flat buffer of `kind` ("param", "exp_avg", ...), from the logical state."""
    from_host = current_backend().from_host
    return unit.flatten([from_host(shard_of(state[name][kind], p.shard).astype(unit.dtype))
                         for name, p in zip(unit.names, unit.params)])
