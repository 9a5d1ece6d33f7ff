"""The fusion pass: group the nodes of an expression graph into kernels.

A kernel is a chain of elementwise operations plus at most one trailing reduction. It reads its
inputs from memory once and writes its one output once; every value in between lives only in
registers or cache. A kernel ends where a value must be materialised, i.e. written to memory:
- it is an output the caller asked for (a root),
- it has several consumers (a simple rule; recomputing it in each consumer is an exercise),
- it is a reduction (its output is smaller than its input, so nothing can be chained after it).
Leaves are already in memory and constants are folded into the kernel's code.

`one_kernel_per_op` is the eager plan with the same structure: each operation is its own kernel, so
every intermediate goes to memory and comes back. Lesson: lessons/10_fusion.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from minipar.fusion.ir import Node


@dataclass(eq=False)
class Kernel:
    """Operations run as one pass over memory: `nodes` in order (the last is the output) reading
    the materialised values `inputs` (leaves and other kernels' outputs)."""

    nodes: list[Node]
    inputs: list[Node]

    @property
    def output(self) -> Node:
        return self.nodes[-1]

    @property
    def reduction(self) -> Node | None:
        return self.output if self.output.is_reduction else None

    @property
    def shape(self) -> tuple[int, ...]:
        """The iteration space: the output's shape, or for a reduction the shape it reduces."""
        return self.output.args[0].shape if self.output.is_reduction else self.output.shape

    @property
    def name(self) -> str:
        ops = [n.op for n in self.nodes]
        if len(ops) == 1:
            return ops[0]
        shown = ops if len(ops) <= 6 else ops[:3] + [f"{len(ops) - 5}more"] + ops[-2:]
        return "fused_" + "_".join(shown)

    def __repr__(self) -> str:
        names = [repr(n) if n.is_leaf else f"{n.op}(...)" for n in self.inputs]
        return f"Kernel({self.name}: {len(self.nodes)} ops, reads {', '.join(names)})"


def topological_order(roots: list[Node]) -> list[Node]:
    """Every node reachable from roots, each after its arguments (iterative: chains can be long)."""
    order, seen, stack = [], set(), [(r, False) for r in reversed(roots)]
    while stack:
        node, args_done = stack.pop()
        if args_done:
            order.append(node)
        elif node not in seen:
            seen.add(node)
            stack.append((node, True))
            stack.extend((a, False) for a in reversed(node.args) if a not in seen)
    return order


def consumer_counts(order: list[Node]) -> dict[Node, int]:
    """How many distinct nodes use each node (x * x counts once: one kernel reads x once)."""
    counts = dict.fromkeys(order, 0)
    for node in order:
        for arg in set(node.args):
            counts[arg] += 1
    return counts


def fuse(roots: list[Node]) -> list[Kernel]:
    """The fused plan: kernels in an order that computes each input before it is read."""
    order = topological_order(roots)
    # exercise 10.1: the fusion pass
    consumers, outputs = consumer_counts(order), set(roots)
    materialised = {n for n in order if not n.is_scalar and (
        n.is_leaf or n.is_reduction or n in outputs or consumers[n] > 1)}
    kernels = []
    for root in order:
        if root.is_leaf or root not in materialised:
            continue
        members, inputs, stack = set(), set(), [root]
        while stack:
            node = stack.pop()
            members.add(node)
            for arg in node.args:
                if arg in materialised:
                    inputs.add(arg)
                elif not arg.is_scalar and arg not in members:
                    stack.append(arg)
        kernels.append(Kernel([n for n in order if n in members], [n for n in order if n in inputs]))
    return kernels
    # end exercise


def one_kernel_per_op(roots: list[Node]) -> list[Kernel]:
    """The eager plan: every operation is a kernel of its own."""
    kernels = []
    for node in topological_order(roots):
        if not (node.is_leaf or node.is_scalar):
            inputs = [a for a in dict.fromkeys(node.args) if not a.is_scalar]
            kernels.append(Kernel([node], inputs))
    return kernels
