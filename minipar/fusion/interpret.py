"""Two interpreters for lazy expressions, and the bytes each one moves.

Eager: one NumPy operation per node over whole arrays, so every intermediate is written to memory
and read back by the next operation. Fused: the fusion pass's kernels, each evaluated tile by tile:
a tile of a few ten thousand elements of every input is pushed through the whole chain in scratch
buffers small enough to stay in the CPU's L2 cache (NumPy's `out=` arguments, no new arrays), and
only the kernel's output goes back to memory. On CuPy arrays a fused kernel is instead compiled to
one CUDA kernel (codegen.py).

Both count bytes the way a real kernel moves them: it reads each distinct input once and writes its
output once. What fusion saves is exactly the intermediates' round trips; what it costs is a little
loop overhead per tile. Lesson: lessons/10_fusion.md.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from minipar.backend import xp_of
from minipar.fusion import codegen
from minipar.fusion.fuse import Kernel, fuse, one_kernel_per_op
from minipar.fusion.ir import Node, as_node

TILE = 32768  # elements per tile: a few such buffers fit in a 1-2 MiB L2 cache


@dataclass
class KernelStats:
    name: str
    bytes_read: int
    bytes_written: int


@dataclass
class Stats:
    """What a run moved to and from memory, kernel by kernel."""

    kernels: list[KernelStats] = field(default_factory=list)

    @property
    def bytes_read(self) -> int:
        return sum(k.bytes_read for k in self.kernels)

    @property
    def bytes_written(self) -> int:
        return sum(k.bytes_written for k in self.kernels)

    @property
    def bytes_moved(self) -> int:
        return self.bytes_read + self.bytes_written

    def __str__(self) -> str:
        rows = [f"{k.name:<36} {k.bytes_read:>12,} {k.bytes_written:>12,}" for k in self.kernels]
        total = f"{'total':<36} {self.bytes_read:>12,} {self.bytes_written:>12,}"
        return "\n".join([f"{'kernel':<36} {'bytes read':>12} {'written':>12}", *rows, total])


def run(expr, fused: bool = True, out=None, tile: int = TILE):
    """Evaluate `expr` (a node, or a list of nodes) and return (result(s), Stats).

    out: an array (or list, one per expression) to write the result into. An out array may be an
    input of the same expression (an in-place update, as in AdamW) as long as no kernel reads that
    input after the kernel that writes it; it must not be a view overlapping an input.
    """
    many = isinstance(expr, (list, tuple))
    roots = [as_node(e) for e in expr] if many else [as_node(expr)]
    outs = list(out) if many and out is not None else [out] * len(roots)
    if len(set(roots)) != len(roots) or len(outs) != len(roots):
        raise ValueError("give each expression once, and one out array per expression")
    for root, dest in zip(roots, outs):
        if dest is not None and (dest.shape != root.shape or dest.dtype != root.dtype):
            raise ValueError(f"out is {dest.dtype}{dest.shape}, the result is {root.dtype}{root.shape}")
    values = {n: n.value for n in _leaves(roots)}
    xp = xp_of(next(iter(values.values()), np.empty(0)))
    stats = Stats()
    plan = fuse(roots) if fused else one_kernel_per_op(roots)
    reads_left = {n: 0 for n in values} | {k.output: 0 for k in plan}
    for kernel in plan:
        for n in kernel.inputs:
            reads_left[n] += 1
    requested = dict(zip(roots, outs))
    for kernel in plan:
        arrays = [values[n] for n in kernel.inputs]
        dest = requested.get(kernel.output)
        if dest is None:
            dest = xp.empty(kernel.output.shape, kernel.output.dtype)
        if not fused:
            apply_node(xp, kernel.output, values, dest)
        elif xp is np:
            evaluate_tiled(kernel, arrays, dest, tile)
        else:
            codegen.launch(kernel, arrays, dest)
        stats.kernels.append(KernelStats(kernel.name, sum(a.nbytes for a in arrays), dest.nbytes))
        values[kernel.output] = dest
        for n in kernel.inputs:
            reads_left[n] -= 1
            if reads_left[n] == 0 and n not in requested and not n.is_leaf:
                del values[n]  # free intermediates as soon as their last reader has run
    results = [_result(xp, r, values[r], dest, stats) for r, dest in zip(roots, outs)]
    return (results if many else results[0]), stats


def _leaves(roots: list[Node]) -> list[Node]:
    seen, stack, leaves = set(), list(roots), []
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            leaves += [node] if node.is_leaf else []
            stack.extend(node.args)
    return leaves


def _result(xp, root: Node, value, dest, stats: Stats):
    """A leaf asked for as a result is its own array, or one copy kernel when out is given."""
    if root.is_leaf and dest is not None:
        xp.copyto(dest, value)
        stats.kernels.append(KernelStats("copy", value.nbytes, dest.nbytes))
        return dest
    if root.is_scalar:
        raise TypeError("nothing to run: the expression is a plain number")
    return value


def apply(xp, node: Node, args: list, out) -> None:
    """Compute one node from its arguments' values (arrays, or numbers for constants) into out."""
    if node.op == "where":  # numpy.where has no out= argument
        xp.copyto(out, xp.where(*args), casting="unsafe")
    elif node.op == "astype":
        xp.copyto(out, args[0], casting="unsafe")
    elif node.op == "sum":
        xp.sum(args[0], axis=node.axis, keepdims=node.keepdims, dtype=node.dtype, out=out)
    elif node.op == "max":
        xp.max(args[0], axis=node.axis, keepdims=node.keepdims, out=out)
    else:
        getattr(xp, node.op)(*args, out=out)


def apply_node(xp, node: Node, values: dict, out) -> None:
    """`apply`, taking the arguments from `values` (node -> array) and constants from the graph."""
    apply(xp, node, [a.value if a.is_scalar else values[a] for a in node.args], out)


class Scratch:
    """A kernel's tile buffers, recycled, so a chain of any length uses only a few cache-sized
    blocks: a value's buffer returns to the pool once its single consumer has run."""

    def __init__(self, xp, size: int):
        self.xp, self.size, self.free = xp, size, {}

    def take(self, dtype, shape):
        pool = self.free.setdefault(dtype, [])
        flat = pool.pop() if pool else self.xp.empty(self.size, dtype)
        return flat[: int(np.prod(shape, dtype=np.int64))].reshape(shape)

    def give_back(self, view) -> None:
        self.free[view.dtype].append(view.base if view.base is not None else view)


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
    """Run a fused kernel tile by tile: intermediates live in scratch tiles, dest is written once."""
    xp = xp_of(dest)
    shape, red = kernel.shape, kernel.reduction
    views = {n: xp.broadcast_to(a, shape) for n, a in zip(kernel.inputs, arrays)}
    target = dest
    if red is not None:  # bring the reduced axis last, so every tile reduces along its last axis
        views = {n: xp.moveaxis(v, red.axis, -1) for n, v in views.items()}
        target = xp.squeeze(dest, axis=red.axis) if red.keepdims else dest
        shape = shape[: red.axis] + shape[red.axis + 1 :] + (shape[red.axis],)
    body = kernel.nodes[:-1] if red is not None else kernel.nodes
    scratch = Scratch(xp, tile)
    for index in tiles(shape, tile):
        values = {n: v[index + (...,)] for n, v in views.items()}  # `...`: a view, never a copy
        if red is None:
            _evaluate_chain(xp, body, values, scratch, _tile_shape(shape, index), target[index + (...,)])
            continue
        if body:
            _evaluate_chain(xp, body, values, scratch, _tile_shape(shape, index), None)
        _reduce_tile(xp, red, values[red.args[0]], target, index, scratch)
        if body:
            scratch.give_back(values[body[-1]])


def _evaluate_chain(xp, body: list[Node], values: dict, scratch: Scratch, shape, out) -> None:
    """Push one tile through the chain, adding each node's tile to `values`. An intermediate has one
    consumer, so its buffer is free again right after that consumer; the last node goes to out."""
    intermediates = set(body)
    for node in body:
        dest = out if node is body[-1] and out is not None else scratch.take(node.dtype, shape)
        apply_node(xp, node, values, dest)
        for arg in dict.fromkeys(node.args):
            if arg in intermediates:
                scratch.give_back(values.pop(arg))
        values[node] = dest


def _tile_shape(shape: tuple[int, ...], index: tuple) -> tuple[int, ...]:
    """The shape of `array[index]` for an array of `shape` (index as made by `tiles`)."""
    runs = [len(range(*s.indices(n))) for s, n in zip(index, shape) if isinstance(s, slice)]
    return tuple(runs) + shape[len(index) :]


def _reduce_tile(xp, red: Node, value, target, index: tuple, scratch: Scratch) -> None:
    """Reduce a tile along its last axis into target. Where the reduced axis is longer than a tile,
    tiles hold parts of it (index then reaches that axis): the first part writes, the later ones
    combine their partial result with what is there."""
    if len(index) <= target.ndim:  # whole rows: the reduced axis lies entirely in this tile
        _reduce_last_axis(xp, red, value, target[index + (...,)])
        return
    out = target[index[:-1] + (...,)]
    if index[-1].start == 0:
        _reduce_last_axis(xp, red, value, out)
        return
    partial = scratch.take(red.dtype, ())
    _reduce_last_axis(xp, red, value, partial)
    (xp.add if red.op == "sum" else xp.maximum)(out, partial, out=out)
    scratch.give_back(partial)


def _reduce_last_axis(xp, red: Node, value, out) -> None:
    if red.op == "sum":
        xp.sum(value, axis=-1, dtype=red.dtype, out=out)
    else:
        xp.max(value, axis=-1, out=out)
