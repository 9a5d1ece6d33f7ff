"""Comm: the collectives every technique is built from, each charged to the rank's traffic ledger.

The idea: a thin wrapper over an mpi4py communicator that calls MPI's own fast collectives
(Allreduce, Reduce_scatter, Allgather, Bcast, Send/Recv) on contiguous buffers, and charges each call
to a ``TrafficLedger`` (ledger.py) by the exact bytes this rank sends in the ring algorithm. A Comm
learns its members' nodes from ``ProcessGrid`` (grid.py: processor names) and, told none, takes them
as one node, so that each charge names its link, intra- or inter-node.

Control helpers (``allreduce_obj``, ``bcast_obj``, ``gather_obj``, ``allgather_obj``) move a few
pickled bytes to take decisions (loss values, sizes, flags); they are not charged, so the ledger
shows exactly the payload traffic that the cost model of each technique predicts.

Buffers come from the backend (backend.py): host copies of device arrays, staged after a stream
synchronisation, or the device arrays themselves when MPI is CUDA-aware (lessons/11_gpu.md).
What it saves: nothing by itself; it makes every technique's communication one readable call.
What it costs: nothing extra on the wire. Lesson: lessons/02_collectives.md.
"""

from __future__ import annotations

import contextlib
import itertools
import time

from mpi4py import MPI

from minipar.core import backend
from minipar.core.shards import shard_sizes
from minipar.distributed.ledger import TrafficLedger, ring_bytes_sent, ring_messages
from minipar.distributed.watchdog import watching

REDUCE_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


def world_ranks(mpi_comm) -> list[int]:
    """The COMM_WORLD ranks of a communicator's members, in its own rank order (a local call)."""
    group, world = mpi_comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return list(MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world))
    finally:
        group.Free()
        world.Free()


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


# Names of the non-blocking collectives in flight: a trace pairs each one's start with its wait.
_PENDING_IDS = itertools.count(1)

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

    def _charge_ring(self, op: str, shard_elements: list[int], itemsize: int,
                     pending: int | None = None) -> None:
        shard_nbytes = [count * itemsize for count in shard_elements]
        self.ledger.charge(self.name, op, ring_bytes_sent(op, shard_nbytes, self.rank),
                           ring_messages(op, self.size), link=self.link_to(self.successor), pending=pending)

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

    def all_gather(self, shard, numel: int | None = None, counts: list[int] | None = None):
        """Flat concatenation of every rank's flattened shard, in rank order; shards may differ in size.

        Pass numel (the total) when the shards follow shard_bounds(numel, size, rank), or `counts`
        (every rank's size) when all ranks know them otherwise: it saves the small exchange of shard
        sizes that uneven shards otherwise need.
        """
        flat = shard.reshape(-1)
        counts = counts or (self.allgather_obj(flat.size) if numel is None else shard_sizes(numel, self.size))
        self._check_share(flat.size, counts, numel)
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
        forwards = self.successor != root  # never on one rank: its successor is itself, the root
        with self.watch("broadcast"):
            self.mpi.Bcast(buffer, root=root)
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
        pending = next(_PENDING_IDS)
        self._charge_ring("all_reduce", shard_sizes(send.size, self.size), send.itemsize, pending)
        return PendingCollective(self, "all_reduce", request, send, lambda: _device(received), pending)

    def _check_share(self, size: int, counts: list[int], numel: int | None) -> None:
        """This rank's shard must have the size its gather expects (`numel`'s even split, or `counts`)."""
        if counts[self.rank] != size:
            said = f"shard_bounds({numel}, {self.size}, {self.rank})" if numel is not None else "counts"
            raise ValueError(f"rank {self.rank} holds {size} elements, but {said} says {counts[self.rank]}")

    def iall_gather(self, shard, numel: int | None = None,
                    counts: list[int] | None = None) -> PendingCollective:
        """Start all_gather(shard, numel or counts) without waiting (ZeRO-3's prefetch): charged now,
        like all_gather; `wait()` on the result gives the flat concatenation."""
        counts = counts or shard_sizes(numel or 0, self.size)
        flat = shard.reshape(-1)
        self._check_share(flat.size, counts, numel)
        widest = max(counts)
        xp = backend.xp_of(flat)
        if flat.size != widest:  # padded as all_gather pads
            flat = xp.concatenate([flat, xp.zeros(widest - flat.size, flat.dtype)])
        send = _send_buffer(flat)
        received = _receive_buffer((self.size, widest), send.dtype)
        request = self.mpi.Iallgather(send, received)
        pending = next(_PENDING_IDS)
        self._charge_ring("all_gather", counts, send.itemsize, pending)

        def gathered():
            if all(count == widest for count in counts):
                return _device(received.reshape(-1))
            rows = backend.xp_of(received)
            return _device(rows.concatenate([row[:count] for row, count in zip(received, counts)]))

        return PendingCollective(self, "all_gather", request, send, gathered, pending)

    def iall_to_all(self, blocks) -> PendingCollective:
        """Start collectives.all_to_all(self, blocks) without waiting (an overlapped F&B step's expert
        dispatch, parallel/f_and_b.py): block s of `blocks` goes to rank s. Charged now as the blocking
        one charges it, one message of a block to each other rank in the same order; `wait()` on the
        result gives the received blocks, block r from rank r."""
        send = _send_buffer(blocks)
        if send.shape[0] != self.size:
            raise ValueError(f"all_to_all needs {self.size} blocks (one per rank), got {send.shape[0]}")
        received = _receive_buffer(send.shape, send.dtype)
        request = self.mpi.Ialltoall(send, received)
        pending = next(_PENDING_IDS)
        for step in range(1, self.size):
            dest = (self.rank + step) % self.size
            self.ledger.charge(self.name, "all_to_all", send[dest].nbytes, 1, link=self.link_to(dest),
                               pending=pending)
        return PendingCollective(self, "all_to_all", request, send, lambda: _device(received), pending)

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
    def watch(self, op: str, pending: int | None = None):
        """The context of one blocking call on this communicator, watched by the watchdog; its
        duration is charged to the ledger's wait time. A blocking call charges its bytes inside it, so
        that the ledger's listeners (a trace) put the bytes on the call; `pending`: the wait of a
        non-blocking call (PendingCollective), charged when it started."""
        started = time.perf_counter()
        self.ledger.began(self.name, op, started)
        try:
            with watching(op, self.name, self.world_ranks, MPI.COMM_WORLD.Get_rank()):
                yield
        finally:
            self.ledger.waited(self.name, op, started, time.perf_counter(), pending)

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

    def __init__(self, comm: Comm, op: str, request, send, finish, pending: int | None = None):
        # the send buffer is kept alive until the request completes: MPI reads it meanwhile
        self.comm, self.op, self.request, self.send, self.finish = comm, op, request, send, finish
        self.pending = pending  # the name its start was charged under (None: a receive, uncharged)

    def test(self) -> bool:
        return bool(self.request.Test())

    def wait(self):
        with self.comm.watch(self.op, self.pending):  # named as the blocking call: the watchdog's line
            self.request.Wait()
        self.send = None
        return self.finish()


def wait_for_everyone(mpi_comm, nap_s: float = 0.001) -> None:
    """A barrier that naps instead of spinning: with more ranks than cores (8 ranks on a laptop), a
    rank busy-waiting in MPI would take the processor from the ranks that still have work to do."""
    arrived = mpi_comm.Ibarrier()
    while not arrived.Test():
        time.sleep(nap_s)
