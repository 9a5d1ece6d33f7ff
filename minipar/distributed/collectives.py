"""Ring collectives built from nothing but Sendrecv: the algorithms behind Comm's cost model.

The idea: put the N ranks on a ring and cut the data into N chunks. In a reduce-scatter each rank
passes one partial sum to its right neighbour per step; after N-1 steps rank r holds the full sum of
chunk r. In an all-gather each rank passes one finished chunk per step; after N-1 steps everyone has
every chunk. An all-reduce is a reduce-scatter followed by an all-gather.

What it saves: bandwidth. Each rank sends (N-1)/N * S bytes per reduce-scatter or all-gather and
2(N-1)/N * S per all-reduce: under 2S however large N grows, which is optimal. What it costs:
2(N-1) messages, so latency grows with N (tree algorithms trade the other way). These functions
count the bytes they really send and record them in the Comm's ledger, so tests can check them
against the charges of ``minipar.distributed.communicator.Comm``. Lesson: lessons/02_collectives.md.

A ``Wire`` lets the chunks travel in another format than the working dtype, e.g. bf16 while summing
in fp32: ``encode`` turns a chunk into its wire array, element for element (k values -> k wire
values), and ``decode`` turns a received wire array back; sums are taken in the working dtype. Every
rank ends with the same values, because a rank's own chunk also passes through encode and decode in
the all-gather. The ledger records the real wire bytes.

Floating-point sums depend on their order. Here chunk c is summed around the ring starting after its
owner: x[c] + (x[c-1] + (... + (x[c+2] + x[c+1]))); MPI picks its own order, so fp results agree
with Comm's to rounding (integers agree exactly).

    mpiexec -n 4 python -m minipar.distributed.collectives --numel 1000000     # bytes and times, ring vs MPI
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable

import numpy

from minipar.core import backend
from minipar.core.shards import shard_bounds, shard_sizes
from minipar.distributed.communicator import Comm


def _same(x: numpy.ndarray) -> numpy.ndarray:
    return x


@dataclass(frozen=True)
class Wire:
    """How a chunk travels: encode(chunk) -> wire array of the same length, decode(wire) -> chunk."""

    encode: Callable[[numpy.ndarray], numpy.ndarray] = _same
    decode: Callable[[numpy.ndarray], numpy.ndarray] = _same


UNCHANGED = Wire()  # chunks travel in their working dtype

class _Ring:
    """This rank's place on the ring, and a count of what it really sent."""

    def __init__(self, comm: Comm):
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self.right, self.left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
        self.bytes_sent = 0
        self.messages = 0

    def pass_right(self, send: numpy.ndarray, recv_count: int, recv_dtype) -> numpy.ndarray:
        """Send to the right neighbour while receiving recv_count elements from the left one."""
        send = numpy.ascontiguousarray(send)
        received = numpy.empty(recv_count, recv_dtype)
        self.comm.mpi.Sendrecv(send, dest=self.right, recvbuf=received, source=self.left)
        self.bytes_sent += send.nbytes
        self.messages += 1
        return received

    def record(self, op: str) -> None:
        self.comm.ledger.charge(self.comm.name, op, self.bytes_sent, self.messages,
                                link=self.comm.link_to(self.right))


def _reduce_scatter(ring: _Ring, flat: numpy.ndarray, wire: Wire) -> numpy.ndarray:
    # exercise 02.1: the ring reduce-scatter
    bounds = [shard_bounds(flat.size, ring.size, c) for c in range(ring.size)]
    wire_dtype = wire.encode(flat[:0]).dtype
    partial = flat[slice(*bounds[(ring.rank - 1) % ring.size])].copy()
    for step in range(ring.size - 1):
        arriving = (ring.rank - step - 2) % ring.size  # after the last step, this rank's own chunk
        start, stop = bounds[arriving]
        received = ring.pass_right(wire.encode(partial), stop - start, wire_dtype)
        partial = flat[start:stop] + wire.decode(received)
    return partial
    # end exercise


def _all_gather(ring: _Ring, shard: numpy.ndarray, counts: list[int], wire: Wire) -> numpy.ndarray:
    # exercise 02.2: the ring all-gather
    offsets = numpy.concatenate([[0], numpy.cumsum(counts)])
    gathered = numpy.empty(int(offsets[-1]), shard.dtype)
    travelling = wire.encode(shard)
    gathered[offsets[ring.rank]:offsets[ring.rank + 1]] = wire.decode(travelling)
    for step in range(ring.size - 1):
        arriving = (ring.rank - step - 1) % ring.size
        travelling = ring.pass_right(travelling, counts[arriving], travelling.dtype)
        gathered[offsets[arriving]:offsets[arriving + 1]] = wire.decode(travelling)
    return gathered
    # end exercise


def _host_flat(x) -> numpy.ndarray:
    return numpy.asarray(backend.current().to_host(x)).reshape(-1)


def ring_reduce_scatter(comm: Comm, x, wire: Wire = UNCHANGED):
    """This rank's shard (shard_bounds) of the elementwise sum of the flattened x over all ranks."""
    ring = _Ring(comm)
    shard = _reduce_scatter(ring, _host_flat(x), wire)
    ring.record("reduce_scatter")
    return backend.current().from_host(shard)


def ring_all_gather(comm: Comm, shard, numel: int | None = None, wire: Wire = UNCHANGED):
    """Flat concatenation of every rank's shard in rank order (sizes exchanged unless numel given)."""
    flat = _host_flat(shard)
    counts = comm.allgather_obj(flat.size) if numel is None else shard_sizes(numel, comm.size)
    if counts[comm.rank] != flat.size:
        raise ValueError(f"rank {comm.rank} holds {flat.size} elements, but shard_bounds({numel}, "
                         f"{comm.size}, {comm.rank}) says {counts[comm.rank]}")
    ring = _Ring(comm)
    gathered = _all_gather(ring, flat, counts, wire)
    ring.record("all_gather")
    return backend.current().from_host(gathered)


def ring_all_reduce(comm: Comm, x, wire: Wire = UNCHANGED):
    """Elementwise sum of x over all ranks, as a reduce-scatter then an all-gather on the ring."""
    host = numpy.asarray(backend.current().to_host(x))
    ring = _Ring(comm)
    shard = _reduce_scatter(ring, host.reshape(-1), wire)
    summed = _all_gather(ring, shard, shard_sizes(host.size, comm.size), wire)
    ring.record("all_reduce")
    return backend.current().from_host(summed.reshape(host.shape))


def all_to_all(comm: Comm, blocks):
    """Block s of this rank's `blocks` (leading axis = comm.size) goes to rank s; returns the blocks
    received, block r from rank r. Built from Sendrecv in N-1 steps: at step i each rank sends to
    rank + i and receives from rank - i, so no two ranks wait on each other. Every rank keeps its own
    block and sends the other N-1: (N-1)/N of the buffer, charged per step to its destination's link.
    Expert parallelism dispatches tokens with it (parallel/experts.py, lessons/15_experts.md)."""
    host = numpy.ascontiguousarray(backend.current().to_host(blocks))
    if host.shape[0] != comm.size:
        raise ValueError(f"all_to_all needs {comm.size} blocks (one per rank), got {host.shape[0]}")
    received = numpy.empty_like(host)
    received[comm.rank] = host[comm.rank]
    for step in range(1, comm.size):
        dest, source = (comm.rank + step) % comm.size, (comm.rank - step) % comm.size
        with comm.watch(f"all_to_all to rank {dest}, from rank {source}"):
            comm.mpi.Sendrecv(host[dest], dest=dest, recvbuf=received[source], source=source)
            comm.ledger.charge(comm.name, "all_to_all", host[dest].nbytes, 1, link=comm.link_to(dest))
    return backend.current().from_host(received)


def _median_seconds(comm: Comm, run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        comm.barrier()
        start = time.perf_counter()
        run()
        backend.current().sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def benchmark(comm: Comm, numel: int, repeats: int = 5) -> list[dict]:
    """Per op: bytes this rank's ring sent (counted) and Comm charged (model), and median seconds
    of the ring and of MPI's own collective on numel float64 elements."""
    x = numpy.random.default_rng(comm.rank).standard_normal(numel)
    shard = x[slice(*shard_bounds(numel, comm.size, comm.rank))]
    cases = {"reduce_scatter": (partial(ring_reduce_scatter, comm, x), partial(comm.reduce_scatter, x)),
             "all_gather": (partial(ring_all_gather, comm, shard, numel),
                            partial(comm.all_gather, shard, numel)),
             "all_reduce": (partial(ring_all_reduce, comm, x), partial(comm.all_reduce, x))}
    rows = []
    for op, (ring_run, mpi_run) in cases.items():
        comm.ledger.start_step()
        ring_seconds = _median_seconds(comm, ring_run, repeats)
        ring_bytes = comm.ledger.step_report()["by_op"][op] // repeats
        comm.ledger.start_step()
        mpi_seconds = _median_seconds(comm, mpi_run, repeats)
        model_bytes = comm.ledger.step_report()["by_op"][op] // repeats
        rows.append({"op": op, "ring_bytes": ring_bytes, "model_bytes": model_bytes,
                     "ring_s": ring_seconds, "mpi_s": mpi_seconds})
    return rows


def main(argv=None) -> None:
    from mpi4py import MPI

    parser = argparse.ArgumentParser(prog="python -m minipar.distributed.collectives",
                                     description="Ring collectives vs MPI's: bytes sent and time.")
    parser.add_argument("--numel", type=int, default=1_000_000, help="float64 elements per rank")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    comm = Comm(MPI.COMM_WORLD)
    rows = benchmark(comm, args.numel, args.repeats)
    every_rank = comm.gather_obj([row["ring_bytes"] for row in rows])
    if comm.rank == 0:
        counted = [" ".join(str(sent[index]) for sent in every_rank) for index in range(len(rows))]
        width = max(36, *(len(text) for text in counted))
        print(f"{comm.size} ranks, {args.numel} float64 elements (S = {8 * args.numel} bytes)")
        print(f"{'op':<15} {'bytes each rank sent (ring, counted)':<{width}} {'Comm charge':>12} "
              f"{'ring ms':>8} {'MPI ms':>8}")
        for text, row in zip(counted, rows):
            print(f"{row['op']:<15} {text:<{width}} {row['model_bytes']:>12} "
                  f"{1e3 * row['ring_s']:>8.2f} {1e3 * row['mpi_s']:>8.2f}")


if __name__ == "__main__":
    main()
