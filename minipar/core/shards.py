"""How a size is cut into parts, and how a tensor's part is described: the one place minipar splits.

Two cuts, and every technique uses one of them:

    shard_bounds    numpy.array_split's cut: the first n % parts shards are one element longer. The
                    ring collectives cut a buffer this way, so any size works and nothing is padded.
    padded_bounds   equal parts of ceil(n / parts), the last ones running past n into zero padding, so
                    every rank holds the same shape: ZeRO's flat buffers (`padded_numel`), Megatron's
                    split of the vocabulary and of a layer's rows or columns.

A data-parallel rank's slice of the global batch is either cut (validation makes the batch divisible).
`Shard` says which part of a full tensor a parameter holds; `shard_of` cuts that part from the full
tensor, padding with zeros where a padded part runs past the end.
Lessons: lessons/02_collectives.md (the ring's cut), 04_zero.md and 05b_tensor_parallel_appendix.md (padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def shard_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of shard `index` when n elements are cut into `parts` shards.

    Like numpy.array_split: the first n % parts shards get one element more.
    """
    if parts < 1 or not 0 <= index < parts or n < 0:
        raise ValueError(f"no shard {index} of {parts} for {n} elements")
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def shard_sizes(n: int, parts: int) -> list[int]:
    """Number of elements in each of the `parts` shards of n elements (see shard_bounds)."""
    return [stop - start for start, stop in (shard_bounds(n, parts, i) for i in range(parts))]


def padded_numel(numel: int, parts: int) -> int:
    """The smallest multiple of `parts` that holds `numel` elements: every shard the same size."""
    return -(-numel // parts) * parts


def padded_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` when n rows are cut into `parts` equal parts. When parts does not
    divide n, the last parts run past the end into zero padding, as Megatron pads its vocabulary:
    every rank holds a tensor of the same shape."""
    per_part = padded_numel(n, parts) // parts
    return index * per_part, (index + 1) * per_part


@dataclass(frozen=True)
class Shard:
    """This rank holds [start, stop) of the full tensor along `axis`; rows past the end are padding."""

    full_shape: tuple
    axis: int
    start: int
    stop: int


def shard_of(full: np.ndarray, shard: Shard | None) -> np.ndarray:
    """Cut this rank's shard from a full tensor, padding with zeros past the end."""
    if shard is None:
        return full
    pad = max(0, shard.stop - full.shape[shard.axis])
    if pad:
        widths = [(0, 0)] * full.ndim
        widths[shard.axis] = (0, pad)
        full = np.pad(full, widths)
    index = [slice(None)] * full.ndim
    index[shard.axis] = slice(shard.start, shard.stop)
    return full[tuple(index)]
