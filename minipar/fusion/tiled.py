"""Fused kernels on the CPU: evaluate a kernel tile by tile, its intermediates in cache.

A tile is a block of a few ten thousand elements of the kernel's iteration space. Each input's tile
is a view (no copy); the chain runs on it with NumPy's `out=` arguments into scratch buffers
allocated once per kernel, small enough to stay in the L2 cache, so intermediates never reach main
memory; only the output tile is written there. A buffer is reused as soon as the value in it has
been consumed, as a compiler reuses registers, so a chain of any length needs only a few buffers.
What it costs: one Python-level loop step per tile and operation, which is why tiles are not tiny.
Lesson: lessons/10_fusion.md.
"""

from __future__ import annotations

import itertools

import numpy as np

from minipar.core.backend import xp_of
from minipar.fusion.fuse import Kernel
from minipar.fusion.ir import Node, apply

TILE = 32768  # elements per tile: a few such buffers fit in a 1-2 MiB L2 cache


class TileProgram:
    """A kernel's chain compiled once for all its tiles. Every value has a slot: slot 0 holds the
    output tile, then come the input tiles, the constants and the scratch buffers. `steps` are
    (node, operand slots, result slot); a scratch slot is handed to a new value once the single
    consumer of the value it held has run."""

    def __init__(self, body: list[Node], inputs: list[Node], to_output: bool):
        constants = list(dict.fromkeys(a for node in body for a in node.args if a.is_scalar))
        self.constants = [c.value for c in constants]
        slot = {n: 1 + i for i, n in enumerate(inputs + constants)}
        first_buffer, intermediates = 1 + len(slot), set(body)
        self.buffer_dtypes, free, self.steps = [], {}, []
        for node in body:
            pool = free.setdefault(node.dtype, [])
            if to_output and node is body[-1]:
                slot[node] = 0
            elif pool:
                slot[node] = pool.pop()
            else:
                slot[node] = first_buffer + len(self.buffer_dtypes)
                self.buffer_dtypes.append(node.dtype)
            self.steps.append((node, [slot[a] for a in node.args], slot[node]))
            for arg in set(node.args) & intermediates:  # consumed: its buffer is free again
                free[arg.dtype].append(slot[arg])
        self.result = slot[body[-1]] if body else None

    def run(self, xp, input_tiles: list, out_tile, buffers: list):
        """Push one tile through the chain; returns the last value's tile."""
        slots = [out_tile, *input_tiles, *self.constants, *buffers]
        for node, operands, result in self.steps:
            apply(xp, node, [slots[i] for i in operands], slots[result])
        return slots[self.result] if self.result is not None else None


def tiles(shape: tuple[int, ...], size: int):
    """Index tuples cutting `shape` into blocks of at most `size` elements: whole trailing axes,
    a run along one axis, single positions along the leading axes (an empty space is one tile)."""
    if 0 in shape or not shape:
        yield ()
        return
    inner, axis = 1, len(shape) - 1
    while axis > 0 and inner * shape[axis] <= size:
        inner, axis = inner * shape[axis], axis - 1
    run_length = max(1, size // inner)
    for lead in itertools.product(*map(range, shape[:axis])):
        for start in range(0, shape[axis], run_length):
            yield lead + (slice(start, start + run_length),)


def evaluate_tiled(kernel: Kernel, arrays: list, dest, tile: int) -> None:
    """Run a fused kernel tile by tile into dest, which is written once."""
    xp = xp_of(dest)
    shape, red = kernel.shape, kernel.reduction
    views = [xp.broadcast_to(a, shape) for a in arrays]
    target = dest
    if red is not None:  # bring the reduced axis last, so every tile reduces along its last axis
        views = [xp.moveaxis(v, red.axis, -1) for v in views]
        target = xp.squeeze(dest, axis=red.axis) if red.keepdims else dest
        shape = shape[: red.axis] + shape[red.axis + 1 :] + (shape[red.axis],)
    body = kernel.nodes[:-1] if red is not None else kernel.nodes
    program = TileProgram(body, kernel.inputs, to_output=red is None)
    size = max(1, min(tile, int(np.prod(shape, dtype=np.int64))))
    flat_buffers = [xp.empty(size, dtype) for dtype in program.buffer_dtypes]
    buffers_by_shape = {}
    for index in tiles(shape, tile):
        at = index + (...,)  # `...` makes every index a view, even one picking single elements
        tile_shape = _tile_shape(shape, index)
        if tile_shape not in buffers_by_shape:
            used = int(np.prod(tile_shape, dtype=np.int64))
            buffers_by_shape[tile_shape] = [b[:used].reshape(tile_shape) for b in flat_buffers]
        input_tiles = [v[at] for v in views]
        value = program.run(xp, input_tiles, None if red is not None else target[at],
                            buffers_by_shape[tile_shape])
        if red is not None:  # with no chain before it, the reduction reads its one input directly
            _reduce_tile(xp, red, input_tiles[0] if value is None else value, target, index)


def _tile_shape(shape: tuple[int, ...], index: tuple) -> tuple[int, ...]:
    """The shape of `array[index]` for an array of `shape` (index as made by `tiles`)."""
    runs = [len(range(*s.indices(n))) for s, n in zip(index, shape) if isinstance(s, slice)]
    return tuple(runs) + shape[len(index) :]


def _reduce_tile(xp, red: Node, value, target, index: tuple) -> None:
    """Reduce a tile along its last axis into target. Where the reduced axis is longer than a tile,
    tiles hold parts of it (index then reaches that axis): the first part writes, the later ones
    combine their partial result with what is there."""
    if len(index) <= target.ndim:  # whole rows: the reduced axis lies entirely in this tile
        _reduce_last_axis(xp, red, value, target[index + (...,)])
        return
    out = target[index[:-1] + (...,)]
    if index[-1].start == 0:
        _reduce_last_axis(xp, red, value, out)
    else:
        partial = xp.empty((), red.dtype)
        _reduce_last_axis(xp, red, value, partial)
        (xp.add if red.op == "sum" else xp.maximum)(out, partial, out=out)


def _reduce_last_axis(xp, red: Node, value, out) -> None:
    if red.op == "sum":
        xp.sum(value, axis=-1, dtype=red.dtype, out=out)
    else:
        xp.max(value, axis=-1, out=out)
