"""Two interpreters for lazy expressions, and the bytes each one moves.

Eager: one NumPy operation per node over whole arrays, so every intermediate is written to memory
and read back by the next operation. Fused: the fusion pass's kernels (fuse.py), each evaluated
tile by tile with its intermediates in cache (tiled.py) on NumPy, or compiled to one CUDA kernel
(codegen.py) on CuPy; only a kernel's output goes back to memory.

Both count bytes the way a real kernel moves them: it reads each distinct input once and writes its
output once. What fusion saves is exactly the intermediates' round trips; what it costs is a little
loop overhead per tile. Lesson: lessons/10_fusion.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from minipar.core.backend import xp_of
from minipar.fusion import codegen
from minipar.fusion.fuse import fuse, one_kernel_per_op
from minipar.fusion.ir import Node, apply, as_node
from minipar.fusion.tiled import TILE, evaluate_tiled


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
    roots, outs = _roots_and_outs(expr, out)
    values = {n: n.value for n in _leaves(roots)}
    xp = xp_of(next(iter(values.values()), np.empty(0)))
    plan = fuse(roots) if fused else one_kernel_per_op(roots)
    last_reader = {n: k for k, kernel in enumerate(plan) for n in kernel.inputs}
    requested, stats = dict(zip(roots, outs)), Stats()
    for k, kernel in enumerate(plan):
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
            if last_reader[n] == k and not n.is_leaf and n not in requested:
                del values[n]  # free an intermediate as soon as its last reader has run
    results = [_result(xp, r, values[r], dest, stats) for r, dest in zip(roots, outs)]
    return (results if isinstance(expr, (list, tuple)) else results[0]), stats


def _roots_and_outs(expr, out) -> tuple[list[Node], list]:
    many = isinstance(expr, (list, tuple))
    roots = [as_node(e) for e in expr] if many else [as_node(expr)]
    outs = list(out) if many and out is not None else [out] * len(roots)
    if len(set(roots)) != len(roots) or len(outs) != len(roots):
        raise ValueError("give each expression once, and one out array per expression")
    for root, dest in zip(roots, outs):
        if dest is not None and (dest.shape != root.shape or dest.dtype != root.dtype):
            raise ValueError(f"out is {dest.dtype}{dest.shape}, the result is {root.dtype}{root.shape}")
    return roots, outs


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


def apply_node(xp, node: Node, values: dict, out) -> None:
    """`apply`, taking the arguments from `values` (node -> array) and constants from the graph."""
    apply(xp, node, [a.value if a.is_scalar else values[a] for a in node.args], out)
