"""Elementwise work in cache-sized tiles: each pass of a rule over a tile finds it in the cache.

The idea: an elementwise rule written in NumPy makes one pass over its arrays per operation. GELU's
backward makes about fifteen, AdamW's update about twelve. Over an array larger than the cache, every
pass is a trip to memory; run on one tile of about CACHE_TILE_BYTES at a time, all the passes over that
tile but the first find it in the cache. This is lesson 10's fused kernel on a CPU, written by hand for
the two hot rules. Every element meets the same operations in the same order, so the bits are those of
one call on the whole arrays (tests/speed/test_rules.py).

What it saves: about half of GELU's time on the wide GPT's (16, 64, 1024) activations; AdamW's update,
memory-bound inside a real step, only about 5% (appendix 01b, "The speed layer"). What it costs: one
Python loop step per tile (tiles are not tiny for that reason), and nothing at all below one tile.
LayerNorm and softmax are not tiled: the default GPT's arrays are under a tile, and on the wide GPT
LayerNorm in row tiles, tried, ran faster alone but made no faster step.
On a GPU (CuPy arrays) each rule runs on the whole arrays: there is no cache to fit. Lesson:
lessons/01b_speed_appendix.md.
"""

from __future__ import annotations

import numpy

from minipar.core.backend import xp_of

CACHE_TILE_BYTES = 256 * 2**10  # per array: a tile of each operand and two temporaries fit a 1-2 MiB L2


def tile_slices(size: int, itemsize: int) -> list[slice]:
    """Consecutive slices of range(size), each CACHE_TILE_BYTES of items of `itemsize` bytes."""
    step = max(1, CACHE_TILE_BYTES // itemsize)
    return [slice(start, start + step) for start in range(0, size, step)]


def _tiled(x, *more) -> bool:
    """Whether to tile: x is a NumPy array over a tile, and every array is contiguous and of its shape."""
    return (x.nbytes > CACHE_TILE_BYTES and xp_of(x) is numpy  # the size first: the cheap, common no
            and all(a.shape == x.shape and a.flags.c_contiguous for a in (x, *more)))


def in_cache_tiles(rule, x, *more):
    """rule(x, *more), an elementwise rule returning a new array of x's dtype, run tile by tile when
    `_tiled` says so (and the arrays share x's dtype); otherwise one call on the whole arrays."""
    if not _tiled(x, *more) or any(a.dtype != x.dtype for a in more):
        return rule(x, *more)
    out = numpy.empty_like(x)
    flat_out, flat_in = out.reshape(-1), [a.reshape(-1) for a in (x, *more)]
    for s in tile_slices(x.size, x.itemsize):
        flat_out[s] = rule(*(a[s] for a in flat_in))
    return out


def update_in_cache_tiles(rule, x, *more, **settings) -> None:
    """rule(x, *more, **settings), an elementwise rule that updates its 1-D arrays in place, run tile
    by tile when `_tiled` says so; otherwise one call on the whole arrays."""
    if not _tiled(x, *more) or x.ndim != 1:
        rule(x, *more, **settings)
        return
    for s in tile_slices(x.size, x.itemsize):
        rule(x[s], *(a[s] for a in more), **settings)
