"""Comm: the collectives every technique is built from, with a ledger of the bytes each rank sends.

The idea: a thin wrapper over an mpi4py communicator that calls MPI's own fast collectives
(Allreduce, Reduce_scatter, Allgather, Bcast, Send/Recv) on contiguous buffers, and charges
each call to a ``TrafficLedger`` by the bandwidth-optimal ring cost per rank (S = payload bytes):

    all_reduce      2(N-1)/N * S      (a reduce-scatter followed by an all-gather)
    reduce_scatter   (N-1)/N * S      (S = the full input)
    all_gather       (N-1)/N * S      (S = the full output)
    broadcast              S          (a pipelined chain from the root: each rank forwards the
                                      payload once, but the chain's last, root-1 mod N, only
                                      receives and is charged 0: (N-1) * S over all ranks)
    send                   S          (charged to the sender; recv is free)
    sendrecv               S          (one hop of a ring: the send half is charged, as send)

What it saves: nothing by itself; it makes the cost of every technique visible and testable.
What it costs: nothing extra on the wire. Lesson: lessons/02_collectives.md.

The charge is exact integer bytes, not a rounded fraction: a rank is charged what it really sends
in the ring algorithm of ``minipar.dist.collectives`` (which counts its own bytes and must agree). The
data is cut into N shards by ``shard_bounds``; in a reduce-scatter rank r forwards every shard but
its own, in an all-gather every shard but that of its successor r+1 (the last one to arrive, which it
need not pass on). When N divides S these are exactly (N-1)/N * S; otherwise they differ from it by
less than one element, and the charges of all ranks still add up to exactly (N-1) * S.
Messages are counted the same way: N-1 per reduce-scatter or all-gather, 2(N-1) per all-reduce.

Each charge also says its link: "inter" when the bytes go to a rank on another node (the ring's
successor, or a send's destination), "intra" when they stay inside one; a Comm learns its members'
nodes from ``ProcessGrid`` (processor names) and, told none, takes them as one node
(lessons/07_3d.md, "Across nodes").

Control helpers (``allreduce_obj``, ``bcast_obj``, ``gather_obj``, ``allgather_obj``) move a few
pickled bytes to take decisions (loss values, sizes, flags); they are not charged, so the ledger
shows exactly the payload traffic that the cost model of each technique predicts.

Buffers come from the backend (backend.py): host copies of device arrays, staged after a stream
synchronisation, or the device arrays themselves when MPI is CUDA-aware (lessons/11_gpu.md).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import traceback
from collections import Counter

from mpi4py import MPI

from minipar.core import backend
from minipar.core.shards import shard_bounds, shard_sizes
from minipar.dist.watchdog import watching

REDUCE_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}

def world_ranks(mpi_comm) -> list[int]:
    """The COMM_WORLD ranks of a communicator's members, in its own rank order (a local call)."""
    group, world = mpi_comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return list(MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world))
    finally:
        group.Free()
        world.Free()


def ring_bytes_sent(op: str, shard_nbytes: list[int], rank: int) -> int:
    """Bytes `rank` sends in the ring algorithm for op, given the bytes of every rank's shard."""
    n = len(shard_nbytes)
    if n == 1:
        return 0
    total = sum(shard_nbytes)
    own, successor = shard_nbytes[rank], shard_nbytes[(rank + 1) % n]
    if op == "reduce_scatter":
        return total - own
    if op == "all_gather":
        return total - successor
    if op == "all_reduce":
        return 2 * total - own - successor
    raise ValueError(f"no ring cost for op {op!r}")


def ring_messages(op: str, size: int) -> int:
    """Messages one rank sends in the ring algorithm for op on `size` ranks."""
    return (2 if op == "all_reduce" else 1) * (size - 1)


LINKS = ("intra", "inter")  # bytes that stay inside a node, bytes that cross between nodes


class TrafficLedger:
    """Bytes and messages sent by this rank, keyed by (communicator name, op), and bytes by link."""

    def __init__(self):
        self._total_bytes: Counter[tuple[str, str]] = Counter()  # (dim, op) -> bytes sent since the start
        self._total_messages: Counter[tuple[str, str]] = Counter()
        self._total_links: Counter[tuple[str, str]] = Counter()  # (dim, link) -> bytes sent
        self.total_wait_s = 0.0  # seconds this rank spent inside watched MPI waits, since the start
        self.start_step()

    def charge(self, dim: str, op: str, nbytes: int, messages: int = 1, link: str = "intra") -> None:
        key = (dim, op)
        for counter, amount in ((self._total_bytes, nbytes), (self._step_bytes, nbytes),
                                (self._total_messages, messages), (self._step_messages, messages)):
            counter[key] += int(amount)
        for counter in (self._total_links, self._step_links):
            counter[(dim, link)] += int(nbytes)

    def start_step(self) -> None:
        """Begin a new step window; step_report() covers the traffic since."""
        self._step_bytes: Counter[tuple[str, str]] = Counter()
        self._step_messages: Counter[tuple[str, str]] = Counter()
        self._step_links: Counter[tuple[str, str]] = Counter()
        self.step_wait_s = 0.0  # the same, in this step window: the log's comm_wait_s

    def add_wait(self, seconds: float) -> None:
        """Time spent blocked in one MPI call or wait (a blocking collective counts whole; a
        non-blocking one only from its wait): what overlapping communication with computation hides."""
        self.step_wait_s += seconds
        self.total_wait_s += seconds

    def step_report(self) -> dict:
        return _report(self._step_bytes, self._step_messages)

    def total_report(self) -> dict:
        return _report(self._total_bytes, self._total_messages)

    def step_links(self) -> dict:
        """The step window's bytes by link: {"by_link": {intra, inter}, "by_dim_link": {dim: {...}}}."""
        return _link_report(self._step_links)

    def total_links(self) -> dict:
        return _link_report(self._total_links)


def _link_report(links: Counter[tuple[str, str]]) -> dict:
    """by_link: {intra, inter} bytes; by_dim_link: the same for each parallel dimension."""
    by_link = {link: 0 for link in LINKS}
    by_dim_link: dict[str, dict[str, int]] = {}
    for (dim, link), nbytes in links.items():
        by_link[link] += nbytes
        by_dim_link.setdefault(dim, {link: 0 for link in LINKS})[link] += nbytes
    return {"by_link": by_link, "by_dim_link": by_dim_link}


def _report(sent: Counter[tuple[str, str]], messages: Counter[tuple[str, str]]) -> dict:
    by_op: Counter[str] = Counter()
    by_dim: Counter[str] = Counter()
    by_dim_op: dict[str, dict[str, int]] = {}
    for (dim, op), nbytes in sent.items():
        by_op[op] += nbytes
        by_dim[dim] += nbytes
        by_dim_op.setdefault(dim, {})[op] = nbytes
    return {"sent_bytes": sum(sent.values()), "messages": sum(messages.values()),
            "by_op": dict(by_op), "by_dim": dict(by_dim), "by_dim_op": by_dim_op}


def _send_buffer(x, copy: bool = False):
    """x as a C-contiguous buffer MPI can read: staged to host memory unless MPI is CUDA-aware."""
    return backend.current().send_buffer(x, copy)


def _receive_buffer(shape, dtype):
    return backend.current().receive_buffer(shape, dtype)


def _device(a):
    return backend.current().from_host(a)


def node_local_rank(mpi_comm) -> int:
    """This rank's index among the ranks that share its node (MPI's shared-memory split): the GPU
    it uses, one rank per GPU. Collective over mpi_comm."""
    node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
    rank = node.Get_rank()
    node.Free()
    return rank


# Communicators that ProcessGrid made for a layout, kept for the next grid of the same layout over the
# same ranks (Comm.split's `reuse`); they live as long as the process, as COMM_WORLD does.
_REUSED_SPLITS: dict[tuple, MPI.Comm] = {}


class Comm:
    """An MPI communicator with a name ("world", "dp", "tp", "pp", ...) and a traffic ledger."""

    def __init__(self, mpi_comm, name: str = "world", ledger: TrafficLedger | None = None,
                 nodes: list[str] | None = None):
        self.mpi = mpi_comm
        self.name = name
        self.ledger = ledger if ledger is not None else TrafficLedger()
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        # the node of each rank, in rank order (ProcessGrid knows them); None: all on one node
        self.nodes = list(nodes) if nodes is not None else None
        self.world_ranks = world_ranks(mpi_comm)  # for the watchdog's line (watchdog.py)

    def link_to(self, peer: int) -> str:
        """"inter" when rank `peer` of this communicator is on another node than this rank, else "intra"."""
        if self.nodes is None or self.nodes[peer] == self.nodes[self.rank]:
            return "intra"
        return "inter"

    @property
    def successor(self) -> int:
        """The next rank on the ring: where the ring collectives (and a pipelined broadcast) send."""
        return (self.rank + 1) % self.size

    def __repr__(self) -> str:
        return f"Comm({self.name!r}, rank {self.rank} of {self.size})"

    def _charge_ring(self, op: str, shard_elements: list[int], itemsize: int) -> None:
        shard_nbytes = [count * itemsize for count in shard_elements]
        self.ledger.charge(self.name, op, ring_bytes_sent(op, shard_nbytes, self.rank),
                           ring_messages(op, self.size), link=self.link_to(self.successor))

    def all_reduce(self, x, op: str = "sum"):
        """A new array of x's shape: the elementwise op ("sum", "max", "min") over all ranks."""
        send = _send_buffer(x)
        received = _receive_buffer(send.shape, send.dtype)
        with self.watch("all_reduce"):
            self.mpi.Allreduce(send, received, op=REDUCE_OPS[op])
        self._charge_ring("all_reduce", shard_sizes(send.size, self.size), send.itemsize)
        return _device(received)

    def reduce_scatter(self, x, op: str = "sum"):
        """This rank's shard (shard_bounds of the flattened x) of the elementwise op over all ranks."""
        send = _send_buffer(x).reshape(-1)
        counts = shard_sizes(send.size, self.size)
        received = _receive_buffer(counts[self.rank], send.dtype)
        with self.watch("reduce_scatter"):
            self.mpi.Reduce_scatter(send, received, recvcounts=counts, op=REDUCE_OPS[op])
        self._charge_ring("reduce_scatter", counts, send.itemsize)
        return _device(received)

    def all_gather(self, shard, numel: int | None = None):
        """Flat concatenation of every rank's flattened shard, in rank order; shards may differ in size.

        Pass numel (the total) when the shards follow shard_bounds(numel, size, rank): it saves the
        small exchange of shard sizes that uneven shards otherwise need.
        """
        flat = shard.reshape(-1)
        counts = self.allgather_obj(flat.size) if numel is None else shard_sizes(numel, self.size)
        if counts[self.rank] != flat.size:
            raise ValueError(f"rank {self.rank} holds {flat.size} elements, but shard_bounds({numel}, "
                             f"{self.size}, {self.rank}) says {counts[self.rank]}")
        # Uneven shards are padded to the largest and sent with Allgather, not Allgatherv: MPICH's
        # Allgatherv ran 50x slower (420 ms vs 8 ms for 8 MB on 4 ranks sharing 2 cores).
        widest = max(counts)
        xp = backend.xp_of(flat)
        if flat.size != widest:  # padded where the shard lives, before MPI gets the buffer
            flat = xp.concatenate([flat, xp.zeros(widest - flat.size, flat.dtype)])
        send = _send_buffer(flat)
        received = _receive_buffer((self.size, widest), send.dtype)
        with self.watch("all_gather"):
            self.mpi.Allgather(send, received)
        self._charge_ring("all_gather", counts, send.itemsize)
        if all(count == widest for count in counts):
            return _device(received.reshape(-1))
        xp = backend.xp_of(received)
        return _device(xp.concatenate([row[:count] for row, count in zip(received, counts)]))

    def broadcast(self, x, root: int = 0):
        """A new array with root's x; every rank passes an x of the same shape and dtype.

        Charged as a pipelined chain root -> root+1 -> ... -> root-1 (mod N), the bandwidth-optimal
        broadcast for large payloads: each rank forwards the payload once to its successor, except
        the chain's last rank, whose successor is the root: it only receives and is charged nothing.
        The payload reaches N-1 ranks, so the ranks' charges add up to (N-1) * S.
        """
        buffer = _send_buffer(x, copy=True)  # a new buffer: the other ranks receive into it
        with self.watch("broadcast"):
            self.mpi.Bcast(buffer, root=root)
        forwards = self.successor != root  # never on one rank: its successor is itself, the root
        self.ledger.charge(self.name, "broadcast", buffer.nbytes if forwards else 0, int(forwards),
                           link=self.link_to(self.successor))
        return _device(buffer)

    def iall_reduce(self, x, op: str = "sum") -> PendingCollective:
        """Start an all-reduce of x without waiting: charged now, like all_reduce (same bytes, same
        messages); `wait()` on the result gives the array. MPI moves the data only inside MPI calls
        (unless MPICH's progress thread runs: MPIR_CVAR_ASYNC_PROGRESS=1), so whoever computes
        meanwhile calls `test()` now and then (DDP does, from its backward hooks)."""
        send = _send_buffer(x)
        received = _receive_buffer(send.shape, send.dtype)
        request = self.mpi.Iallreduce(send, received, op=REDUCE_OPS[op])
        self._charge_ring("all_reduce", shard_sizes(send.size, self.size), send.itemsize)
        return PendingCollective(self, "all_reduce", request, send, lambda: _device(received))

    def iall_gather(self, shard, numel: int) -> PendingCollective:
        """Start all_gather(shard, numel) without waiting (ZeRO-3's prefetch): charged now, like
        all_gather; `wait()` on the result gives the flat concatenation."""
        counts = shard_sizes(numel, self.size)
        flat = shard.reshape(-1)
        if counts[self.rank] != flat.size:
            raise ValueError(f"rank {self.rank} holds {flat.size} elements, but shard_bounds({numel}, "
                             f"{self.size}, {self.rank}) says {counts[self.rank]}")
        widest = max(counts)
        xp = backend.xp_of(flat)
        if flat.size != widest:  # padded as all_gather pads
            flat = xp.concatenate([flat, xp.zeros(widest - flat.size, flat.dtype)])
        send = _send_buffer(flat)
        received = _receive_buffer((self.size, widest), send.dtype)
        request = self.mpi.Iallgather(send, received)
        self._charge_ring("all_gather", counts, send.itemsize)

        def gathered():
            if all(count == widest for count in counts):
                return _device(received.reshape(-1))
            rows = backend.xp_of(received)
            return _device(rows.concatenate([row[:count] for row, count in zip(received, counts)]))

        return PendingCollective(self, "all_gather", request, send, gathered)

    def send(self, x, dest: int, tag: int = 0) -> None:
        """Blocking send of x to rank dest of this communicator."""
        buffer = _send_buffer(x)
        with self.watch(f"send to rank {dest}"):
            self.mpi.Send(buffer, dest=dest, tag=tag)
        self.ledger.charge(self.name, "send", buffer.nbytes, link=self.link_to(dest))

    def isend(self, x, dest: int, tag: int = 0):
        """Non-blocking send of x to rank dest, charged like send; returns the MPI request to Wait() on.

        A pipeline needs it: two neighbours that both block in a large Send would wait for each other."""
        buffer = _send_buffer(x)
        request = self.mpi.Isend(buffer, dest=dest, tag=tag)  # the request keeps the buffer alive
        self.ledger.charge(self.name, "send", buffer.nbytes, link=self.link_to(dest))
        return request

    def sendrecv(self, x, dest: int, source: int, tag: int = 0):
        """Send x to rank dest and receive an array of x's shape and dtype from rank source, at once:
        one step of a ring, where every rank sends and receives and none may block the others.
        Charged like send (x's bytes, to the sender)."""
        send = _send_buffer(x)
        received = _receive_buffer(send.shape, send.dtype)
        with self.watch(f"sendrecv to rank {dest}, from rank {source}"):
            self.mpi.Sendrecv(send, dest=dest, sendtag=tag, recvbuf=received, source=source, recvtag=tag)
        self.ledger.charge(self.name, "send", send.nbytes, link=self.link_to(dest))
        return _device(received)

    def irecv(self, shape, dtype, source: int, tag: int = 0) -> PendingCollective:
        """Post a receive of an array of the given shape and dtype from rank source, without waiting
        (a pipeline posts the next one while it computes); `wait()` gives the array. Free, as recv."""
        buffer = _receive_buffer(shape, dtype)
        request = self.mpi.Irecv(buffer, source=source, tag=tag)
        return PendingCollective(self, f"recv from rank {source}", request, None, lambda: _device(buffer))

    def recv(self, shape, dtype, source: int, tag: int = 0):
        """Blocking receive of an array of the given shape and dtype from rank source."""
        buffer = _receive_buffer(shape, dtype)
        with self.watch(f"recv from rank {source}"):
            self.mpi.Recv(buffer, source=source, tag=tag)
        return _device(buffer)

    def barrier(self) -> None:
        with self.watch("barrier"):
            self.mpi.Barrier()

    @contextlib.contextmanager
    def watch(self, op: str):
        """The context of one blocking call on this communicator, watched by the watchdog; its
        duration is charged to the ledger's wait time."""
        started = time.perf_counter()
        try:
            with watching(op, self.name, self.world_ranks, MPI.COMM_WORLD.Get_rank()):
                yield
        finally:
            self.ledger.add_wait(time.perf_counter() - started)

    def wait(self, request, op: str) -> None:
        """Wait for a request on this communicator under the watchdog (e.g. a pipeline's isend)."""
        with self.watch(op):
            request.Wait()

    def split(self, color: int, key: int, name: str, nodes: list[str] | None = None,
              reuse: tuple | None = None) -> Comm:
        """Sub-communicator of the ranks with the same color, ordered by key, sharing this ledger;
        nodes: the node of each of its ranks, in its rank order (for the link split).

        reuse: a key that names this split alike on every member (ProcessGrid passes its layout). A
        split made before under the same key, over the same ranks, is handed back instead of a new
        one: MPI has a few thousand communicator ids per process, and a test process builds hundreds
        of trainers. Every member makes the same call with the same key, so all of them find it or
        all of them make it: no rank can skip a Split that another one enters."""
        if reuse is None:
            return Comm(self.mpi.Split(color, key), name=name, ledger=self.ledger, nodes=nodes)
        made_before = (tuple(self.world_ranks), name, *reuse)
        if _REUSED_SPLITS.get(made_before, MPI.COMM_NULL) == MPI.COMM_NULL:  # none yet, or freed since
            _REUSED_SPLITS[made_before] = self.mpi.Split(color, key)
        return Comm(_REUSED_SPLITS[made_before], name=name, ledger=self.ledger, nodes=nodes)

    # Uncharged control messages: small Python objects, pickled.
    def allreduce_obj(self, obj, op: str = "sum"):
        with self.watch("allreduce_obj"):
            return self.mpi.allreduce(obj, op=REDUCE_OPS[op])

    def bcast_obj(self, obj, root: int = 0):
        with self.watch("bcast_obj"):
            return self.mpi.bcast(obj, root=root)

    def gather_obj(self, obj, root: int = 0):
        """List of every rank's obj on root, None elsewhere."""
        with self.watch("gather_obj"):
            return self.mpi.gather(obj, root=root)

    def allgather_obj(self, obj) -> list:
        with self.watch("allgather_obj"):
            return self.mpi.allgather(obj)


class PendingCollective:
    """A started collective (Comm.iall_reduce, Comm.iall_gather): `test()` drives MPI's progress and
    says whether it is done; `wait()` blocks under the watchdog, like any collective, and returns the
    result (`finish()`: the received buffer as the blocking call would return it)."""

    def __init__(self, comm: Comm, op: str, request, send, finish):
        # the send buffer is kept alive until the request completes: MPI reads it meanwhile
        self.comm, self.op, self.request, self.send, self.finish = comm, op, request, send, finish

    def test(self) -> bool:
        return bool(self.request.Test())

    def wait(self):
        with self.comm.watch(self.op):  # named as the blocking call is: the watchdog line reads the same
            self.request.Wait()
        self.send = None
        return self.finish()


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
        sizes = f"dp={self.dp_size} pp={self.pp_size}" + (f" cp={cp}" if cp > 1 else "") + f" tp={self.tp_size}"
        order = "tp varies fastest, then cp, then pp, then dp" if cp > 1 else "tp varies fastest, then pp, then dp"
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


def install_excepthook() -> None:
    """Make an uncaught exception on any rank print its traceback (prefixed by the rank) and
    abort the whole job, instead of leaving the other ranks waiting forever in a collective."""

    def abort_job(kind, value, tb):
        rank = MPI.COMM_WORLD.Get_rank()
        text = "".join(traceback.format_exception(kind, value, tb))
        sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
        sys.stderr.flush()
        # mpiexec forwards our stderr through a pipe, and once told to abort it may tear the job
        # down before reading what is still in it: about 1 traceback in 30 was lost without a pause.
        time.sleep(0.2)
        MPI.COMM_WORLD.Abort(1)

    sys.excepthook = abort_job


def inject_fault(rank: int, what: str, **where) -> None:
    """Raise on `rank` if MINIPAR_FAULT names this place: tests that a job losing a rank ends cleanly.

    MINIPAR_FAULT=rank:R,step:S raises on rank R at step S (trainer/loop.py: where = step=S);
    rank:R,step:S,stall:stop stops that rank there instead (SIGSTOP: the watchdog's test);
    rank:R,save:PHASE raises on rank R halfway through writing its checkpoint file (PHASE shard) or the
    manifest (PHASE manifest, checkpoint/sharded.py: where = save=PHASE). `what` says where, in the error."""
    spec = os.environ.get("MINIPAR_FAULT", "")
    fault = dict(part.split(":", 1) for part in spec.split(",") if ":" in part)
    named = {"rank": rank, **where}
    if "nudge" in fault:  # not a failure: fault_nudge's deviation
        return
    if where and all(fault.get(key) == str(value) for key, value in named.items()):
        if fault.get("stall") == "stop":  # rank:R,step:S,stall:stop: this rank stops, as if hung
            os.kill(os.getpid(), signal.SIGSTOP)
        raise RuntimeError(f"injected fault on rank {rank} {what} (MINIPAR_FAULT={spec})")


def fault_nudge(rank: int, step: int) -> float | None:
    """MINIPAR_FAULT=rank:R,step:S,nudge:X: the relative amount by which rank R moves its first
    parameter before step S (trainer/loop.py), a deviation from one process that --check-reference
    must report as FAIL; None elsewhere."""
    fault = dict(part.split(":", 1) for part in os.environ.get("MINIPAR_FAULT", "").split(",") if ":" in part)
    if fault.get("rank") == str(rank) and fault.get("step") == str(step) and "nudge" in fault:
        return float(fault["nudge"])
    return None


def wait_for_everyone(mpi_comm, nap_s: float = 0.001) -> None:
    """A barrier that naps instead of spinning: with more ranks than cores (8 ranks on a laptop), a
    rank busy-waiting in MPI would take the processor from the ranks that still have work to do."""
    arrived = mpi_comm.Ibarrier()
    while not arrived.Test():
        time.sleep(nap_s)
