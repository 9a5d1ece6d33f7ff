"""ProcessGrid: world ranks laid out on a (dp, pp, cp, tp) grid, with a communicator per dimension.

The idea: one rank formula, tp fastest so that the chattiest partners are neighbours, and one
sub-communicator per parallel dimension (a split of the world); every technique talks over the one
its dimension names. What it saves or costs: nothing by itself; where ranks sit decides which bytes
cross between nodes. Lessons: lessons/02_collectives.md (the grid), lessons/07_3d.md (layouts).
"""

from __future__ import annotations

from mpi4py import MPI

from minipar.distributed.communicator import Comm


def factorisations(n: int) -> list[tuple[int, int, int]]:
    """Every (dp, pp, tp) with dp * pp * tp = n."""
    return [(dp, pp, n // (dp * pp)) for dp in range(1, n + 1) for pp in range(1, n + 1)
            if n % (dp * pp) == 0]


class ProcessGrid:
    """World ranks laid out on a (dp, pp, cp, tp) grid, tp fastest-varying, then cp, then pp, then dp.

    rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank, so tensor-parallel partners (the
    chattiest) are neighbours, and the context-parallel ring (lessons/13_context_parallel.md) comes
    next. Sub-communicators dp, pp, cp, tp join the ranks that differ in that coordinate only; dp_cp
    joins those that differ in dp or cp: the ranks holding the same parameters with context
    parallelism, over which gradients are summed (it is dp itself when cp = 1).
    `nodes[r]` is the node (MPI processor name, the hostname) of world rank r; the sub-communicators
    know their members' nodes, so the ledger splits their bytes into intra- and inter-node.
    """

    def __init__(self, world: Comm, dp: int, pp: int, tp: int, cp: int = 1):
        for dim, extent in (("dp", dp), ("pp", pp), ("tp", tp), ("cp", cp)):
            if not isinstance(extent, int) or extent < 1:
                raise ValueError(f"{dim} must be a positive integer, got {extent!r}")
        if dp * pp * cp * tp != world.size:
            named = f"dp*pp*tp = {dp}*{pp}*{tp}" if cp == 1 else f"dp*pp*cp*tp = {dp}*{pp}*{cp}*{tp}"
            raise ValueError(f"{named} = {dp * pp * cp * tp} does not equal the world size {world.size}")
        self.world = world
        self.dp_size, self.pp_size, self.cp_size, self.tp_size = dp, pp, cp, tp
        self.dp_rank, self.pp_rank, self.tp_rank, self.cp_rank = self.coords_of(world.rank)
        self.nodes: list[str] = world.allgather_obj(MPI.Get_processor_name())
        d, p, c, t = self.dp_rank, self.pp_rank, self.cp_rank, self.tp_rank
        layout = (dp, pp, cp, tp)  # the same on every rank: the grid's communicators are reused by it
        self.dp = world.split(color=(p * cp + c) * tp + t, key=d, name="dp", reuse=layout,
                              nodes=self._nodes_of([self.rank_of(i, p, t, c) for i in range(dp)]))
        self.pp = world.split(color=(d * cp + c) * tp + t, key=p, name="pp", reuse=layout,
                              nodes=self._nodes_of([self.rank_of(d, i, t, c) for i in range(pp)]))
        self.tp = world.split(color=(d * pp + p) * cp + c, key=t, name="tp", reuse=layout,
                              nodes=self._nodes_of([self.rank_of(d, p, i, c) for i in range(tp)]))
        self.cp = world.split(color=(d * pp + p) * tp + t, key=c, name="cp", reuse=layout,
                              nodes=self._nodes_of([self.rank_of(d, p, t, i) for i in range(cp)]))
        self.dp_cp = self.dp if cp == 1 else world.split(
            color=p * tp + t, key=d * cp + c, name="dp_cp", reuse=layout,
            nodes=self._nodes_of([self.rank_of(i // cp, p, t, i % cp) for i in range(dp * cp)]))

    def _nodes_of(self, world_ranks: list[int]) -> list[str]:
        return [self.nodes[r] for r in world_ranks]

    def coords_of(self, rank: int) -> tuple[int, int, int, int]:
        """(dp_rank, pp_rank, tp_rank, cp_rank) of a world rank: the 3D coordinates, then cp."""
        # exercise 07.1: the process grid: a rank and its coordinates
        dp_rank, rest = divmod(rank, self.pp_size * self.cp_size * self.tp_size)
        pp_rank, rest = divmod(rest, self.cp_size * self.tp_size)
        cp_rank, tp_rank = divmod(rest, self.tp_size)
        return dp_rank, pp_rank, tp_rank, cp_rank
        # end exercise

    def rank_of(self, dp_rank: int, pp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        """World rank at a grid coordinate."""
        # exercise 07.1: the process grid: a rank and its coordinates
        return ((dp_rank * self.pp_size + pp_rank) * self.cp_size + cp_rank) * self.tp_size + tp_rank
        # end exercise

    def describe(self) -> str:
        """The grid as text: for each dp replica, a pp-by-tp table of world ranks (one per cp rank)."""
        width = max(len(str(self.world.size - 1)), len(f"tp={self.tp_size - 1}")) + 2
        cp = self.cp_size
        indent = 16 if cp > 1 else 10
        sizes = (f"dp={self.dp_size} pp={self.pp_size}" + (f" cp={cp}" if cp > 1 else "")
                 + f" tp={self.tp_size}")
        order = ("tp varies fastest, then cp, then pp, then dp" if cp > 1
                 else "tp varies fastest, then pp, then dp")
        lines = [f"ProcessGrid {sizes} ({self.world.size} ranks; {order})",
                 "world rank at each (dp, pp, cp, tp):" if cp > 1 else "world rank at each (dp, pp, tp):"]
        if len(set(self.nodes)) > 1:  # across nodes: where each rank runs
            lines.insert(1, "nodes: " + ", ".join(
                f"{node} = ranks {[r for r, n in enumerate(self.nodes) if n == node]}"
                for node in dict.fromkeys(self.nodes)))
        for dp_rank in range(self.dp_size):
            header = "".join(f"tp={t}".rjust(width) for t in range(self.tp_size))
            lines.append(f"  dp={dp_rank}".ljust(indent) + header)
            for pp_rank in range(self.pp_size):
                for cp_rank in range(cp):
                    label = f"    pp={pp_rank}" + (f" cp={cp_rank}" if cp > 1 else "")
                    row = "".join(str(self.rank_of(dp_rank, pp_rank, t, cp_rank)).rjust(width)
                                  for t in range(self.tp_size))
                    lines.append(label.ljust(indent) + row)
        return "\n".join(lines)
