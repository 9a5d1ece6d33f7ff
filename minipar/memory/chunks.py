"""Gemini-style chunks: parameters packed into fixed-size chunks, and a state machine per tensor.

The idea (PatrickStar, Fang et al. 2021; Colossal-AI's Gemini): lay the parameters end to end, in
the order the model uses them, into chunks of one fixed size; every tensor is a view of its chunk.
Then everything moves a chunk at a time: ZeRO-3 all-gathers a chunk once before its first tensor is
used and reduce-scatters it once, as one message, when every gradient in it is ready; offload moves a
chunk's shard between device, CPU memory and disk. Each tensor's state says what may happen to it,
and a transition not drawn here is an error, never silently ignored:

    FREE --gather--> HOLD --its unit starts--> COMPUTE --forward done--> HOLD --chunk released--> FREE
                                                  |
                                            backward done
                                                  v
                     HOLD_AFTER_BWD --gradient copied into the chunk--> READY_FOR_REDUCE
                                                        --chunk reduce-scattered and released--> FREE

What it saves: fragmentation (every buffer has the one chunk size, so a freed one fits any other)
and per-message latency (a few large messages instead of one per tensor or module).
What it costs: padding at the end of each chunk, since a tensor never straddles two chunks;
`search_chunk_size` picks the size that wastes least. Lesson: lessons/08_memory.md.
"""

from __future__ import annotations

import enum

import numpy as np

from minipar.core.backend import xp_of


class TensorState(enum.Enum):
    FREE = "free"  # the chunk is not gathered: this rank holds only its shard
    HOLD = "hold"  # the chunk is gathered; the tensor holds its parameter values, unused
    COMPUTE = "compute"  # its unit is running (forward, or backward)
    HOLD_AFTER_BWD = "hold_after_bwd"  # its unit's backward is done: its gradient is complete
    READY_FOR_REDUCE = "ready_for_reduce"  # its gradient sits in the chunk, where its values were


S = TensorState
LEGAL_TRANSITIONS = frozenset({
    (S.FREE, S.HOLD), (S.HOLD, S.COMPUTE), (S.COMPUTE, S.HOLD), (S.HOLD, S.FREE),
    (S.COMPUTE, S.HOLD_AFTER_BWD), (S.HOLD_AFTER_BWD, S.READY_FOR_REDUCE), (S.READY_FOR_REDUCE, S.FREE),
})


class IllegalTransition(RuntimeError):
    """A tensor was asked to move between two states that the state machine does not connect."""


class ChunkTensor:
    """One parameter inside a chunk: where it sits, which unit uses it, and its state."""

    def __init__(self, name: str, param, unit: int, offset: int):
        self.name, self.param, self.unit, self.offset = name, param, unit, offset
        self.shape, self.numel = tuple(param.shape), int(param.size)
        self.state = TensorState.FREE

    def __repr__(self):
        where = f"[{self.offset}:{self.offset + self.numel}]"
        return f"ChunkTensor({self.name!r}, unit {self.unit}, {where}, {self.state.name})"


class Chunk:
    """`numel` elements holding whole tensors one after another, then zero padding.

    `payload` is the gathered full chunk while it exists (None otherwise); each tensor is a view of it.
    """

    def __init__(self, index: int, numel: int, dtype):
        self.index, self.numel, self.dtype = index, numel, np.dtype(dtype)
        self.tensors: list[ChunkTensor] = []
        self.used = 0
        self.payload = None

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def units(self) -> range:
        """The units whose tensors this chunk holds: always consecutive, since packing follows their order."""
        return range(self.tensors[0].unit, self.tensors[-1].unit + 1)

    def fits(self, numel: int) -> bool:
        return self.used + numel <= self.numel

    def append(self, name: str, param, unit: int) -> ChunkTensor:
        if not self.fits(param.size):
            raise ValueError(f"{name} ({param.size} elements) does not fit in chunk {self.index} "
                             f"({self.numel - self.used} of {self.numel} elements free)")
        tensor = ChunkTensor(name, param, unit, self.used)
        self.tensors.append(tensor)
        self.used += tensor.numel
        return tensor

    def tensors_of(self, unit: int) -> list[ChunkTensor]:
        return [t for t in self.tensors if t.unit == unit]

    def transition(self, tensor: ChunkTensor, state: TensorState):
        # exercise 08.1: the chunk tensor's state machine
        if (tensor.state, state) not in LEGAL_TRANSITIONS:
            raise IllegalTransition(f"{tensor.name} in chunk {self.index}: {tensor.state.name} -> "
                                    f"{state.name} is not a legal transition")
        tensor.state = state
        # end exercise

    def all_in(self, state: TensorState) -> bool:
        return all(t.state is state for t in self.tensors)

    def view(self, flat, tensor: ChunkTensor):
        """The tensor's elements inside a full-chunk array, in its shape (no copy)."""
        return flat[tensor.offset : tensor.offset + tensor.numel].reshape(tensor.shape)

    def flatten(self, arrays, xp=None):
        """A new full-chunk array with `arrays` (one per tensor, None for zeros) in place, padding zero."""
        xp = xp or xp_of(next(a for a in arrays if a is not None))
        flat = xp.zeros(self.numel, dtype=self.dtype)
        for tensor, array in zip(self.tensors, arrays):
            if array is not None:
                self.view(flat, tensor)[...] = array
        return flat


def pack_in_chunks(entries, chunk_numel: int) -> list[Chunk]:
    """Chunks of `chunk_numel` elements holding (name, param, unit) entries in the order given.

    A tensor goes into the current chunk if it fits, else opens the next one (tensors never straddle).
    """
    if not entries:
        raise ValueError("no parameters to pack into chunks")
    name, largest = max(((name, param.size) for name, param, _ in entries), key=lambda e: e[1])
    if largest > chunk_numel:
        raise ValueError(f"a chunk of {chunk_numel} elements cannot hold {name} ({largest} elements)")
    chunks = [Chunk(0, chunk_numel, entries[0][1].dtype)]
    for name, param, unit in entries:
        if not chunks[-1].fits(param.size):
            chunks.append(Chunk(len(chunks), chunk_numel, param.dtype))
        chunks[-1].append(name, param, unit)
    return chunks


def chunk_padding(sizes, chunk_numels) -> np.ndarray:
    """Elements wasted (chunk capacity minus tensor elements) when tensors of `sizes` are packed in
    order into chunks of each of `chunk_numels` elements (an array: every candidate at once)."""
    chunk_numels = np.asarray(chunk_numels, dtype=np.int64)
    if not sizes or max(sizes) > chunk_numels.min():
        raise ValueError("every chunk size must hold the largest tensor")
    used = np.zeros_like(chunk_numels)
    count = np.ones_like(chunk_numels)
    for size in sizes:
        opens = used + size > chunk_numels
        count += opens
        used = np.where(opens, size, used + size)
    return count * chunk_numels - sum(sizes)


def search_chunk_size(sizes, parts: int, search_range: int | None = None) -> tuple[int, int]:
    """(chunk elements, padding elements): the chunk size with the least padding for tensors of
    `sizes` packed in order, among every multiple of `parts` (so each of the parts ranks gets an equal
    shard) from the largest tensor up to `search_range` above it (default: the largest tensor again).
    Ties go to the smaller size, which needs less memory to gather."""
    smallest = -(-max(sizes) // parts) * parts
    search_range = max(sizes) if search_range is None else search_range
    candidates = np.arange(smallest, smallest + search_range + 1, parts, dtype=np.int64)
    waste = chunk_padding(list(sizes), candidates)
    best = int(np.argmin(waste))  # the first minimum: the smallest size among equals
    return int(candidates[best]), int(waste[best])
