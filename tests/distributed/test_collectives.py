"""The ring collectives against MPI's, and the bytes they really send against Comm's charges.

Rings run on the world and on groups of at most 3 ranks (world 4 -> groups of 3 and 1, world 8 ->
3, 3 and 2), so N covers 1, 2, 3, 4 and 8. Float sums are compared bit for bit with a reference
that adds in the ring's order, and to 1e-12 with MPI's (which adds in an order of its own).
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy
import pytest
from mpi4py import MPI
from mpi_harness import at_world_size, mpi_given, mpi_test

from minipar.core.shards import shard_bounds, shard_sizes
from minipar.distributed.collectives import (
    UNCHANGED,
    Wire,
    all_to_all,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from minipar.distributed.communicator import Comm
from minipar.distributed.ledger import TrafficLedger, ring_bytes_sent

DTYPES = ["float64", "float32", "int64", "int32", "uint16"]
TO_FP32 = Wire(encode=lambda x: x.astype("float32"), decode=lambda wire: wire.astype("float64"))


def rank_data(seed: int, rank: int, numel: int, dtype: str) -> numpy.ndarray:
    rng = numpy.random.default_rng([seed, rank])
    if numpy.dtype(dtype).kind == "f":
        return rng.standard_normal(numel).astype(dtype)
    return rng.integers(0, 1000, size=numel).astype(dtype)


def ring_order_reduce(inputs: list[numpy.ndarray], wire: Wire = UNCHANGED) -> numpy.ndarray:
    """Each chunk c summed as the ring sums it: it starts at rank c+1 and ends at its owner c,
    crossing the wire between ranks."""
    size, numel = len(inputs), inputs[0].size
    reduced = numpy.empty_like(inputs[0])
    for chunk in range(size):
        part = slice(*shard_bounds(numel, size, chunk))
        partial = inputs[(chunk + 1) % size][part]
        for hop in range(2, size + 1):
            partial = inputs[(chunk + hop) % size][part] + wire.decode(wire.encode(partial))
        reduced[part] = partial
    return reduced


@pytest.fixture
def rings(comm):
    """The world's ring, and the ring of this rank's group of at most 3 (rank // 3)."""
    group = comm.split(color=comm.rank // 3, key=comm.rank, name="group")
    yield {"world": comm, "group": group}
    group.mpi.Free()


def fresh(ring: Comm) -> Comm:
    """The same communicator with an empty ledger, to read one call's traffic."""
    return Comm(ring.mpi, name=ring.name, ledger=TrafficLedger())


def traffic(ring: Comm) -> tuple[int, int]:
    report = ring.ledger.total_report()
    return report["sent_bytes"], report["messages"]


def assert_close_to_mpi(ring_result, mpi_result):
    if ring_result.dtype.kind == "f":
        tolerance = 1e-12 if ring_result.dtype == numpy.float64 else 1e-5
        numpy.testing.assert_allclose(ring_result, mpi_result, rtol=tolerance, atol=tolerance)
    else:
        assert numpy.array_equal(ring_result, mpi_result)


def exact_ring_fraction(factor: int, ring: Comm, nbytes: int) -> int:
    """factor * (N-1)/N * S, for the case N divides S."""
    assert (factor * (ring.size - 1) * nbytes) % ring.size == 0
    return factor * (ring.size - 1) * nbytes // ring.size


# rings of N >= 4 ranks with shards of unequal length (7 and 13 elements do not divide by 4 or 8)
UNEVEN_RINGS = [at_world_size((4, 8), which="world", numel=numel, dtype="float64", seed=5)
                for numel in (7, 13)]


@mpi_given(examples=UNEVEN_RINGS, which=st.sampled_from(["world", "group"]), numel=st.integers(0, 50),
           dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**32 - 1))
def test_ring_all_reduce(rings, which, numel, dtype, seed):
    ring = rings[which]
    inputs = [rank_data(seed, r, numel, dtype) for r in range(ring.size)]
    counted, charged = fresh(ring), fresh(ring)
    result = ring_all_reduce(counted, inputs[ring.rank].reshape(1, numel))
    assert result.shape == (1, numel) and result.dtype == numpy.dtype(dtype)
    assert numpy.array_equal(result.ravel(), ring_order_reduce(inputs))
    assert_close_to_mpi(result, charged.all_reduce(inputs[ring.rank].reshape(1, numel)))
    assert traffic(counted) == traffic(charged)
    if numel % ring.size == 0:
        assert traffic(counted)[0] == exact_ring_fraction(2, ring, result.nbytes)


@mpi_given(examples=UNEVEN_RINGS, which=st.sampled_from(["world", "group"]), numel=st.integers(0, 50),
           dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**32 - 1))
def test_ring_reduce_scatter(rings, which, numel, dtype, seed):
    ring = rings[which]
    inputs = [rank_data(seed, r, numel, dtype) for r in range(ring.size)]
    counted, charged = fresh(ring), fresh(ring)
    shard = ring_reduce_scatter(counted, inputs[ring.rank])
    own = slice(*shard_bounds(numel, ring.size, ring.rank))
    assert numpy.array_equal(shard, ring_order_reduce(inputs)[own])
    assert_close_to_mpi(shard, charged.reduce_scatter(inputs[ring.rank]))
    assert traffic(counted) == traffic(charged)
    if numel % ring.size == 0:
        assert traffic(counted)[0] == exact_ring_fraction(1, ring, inputs[0].nbytes)


@mpi_given(which=st.sampled_from(["world", "group"]), dtype=st.sampled_from(DTYPES),
           seed=st.integers(0, 2**32 - 1), even_split=st.booleans())
def test_ring_all_gather_of_uneven_shards(rings, which, dtype, seed, even_split):
    ring = rings[which]
    rng = numpy.random.default_rng(seed)
    numel = int(rng.integers(0, 40))
    counts = shard_sizes(numel, ring.size) if even_split else [int(c) for c in rng.integers(0, 7, ring.size)]
    shards = [rank_data(seed, r, counts[r], dtype) for r in range(ring.size)]
    counted, charged = fresh(ring), fresh(ring)
    gathered = ring_all_gather(counted, shards[ring.rank], numel=numel if even_split else None)
    assert numpy.array_equal(gathered, numpy.concatenate(shards))
    assert numpy.array_equal(gathered, charged.all_gather(shards[ring.rank]))
    assert traffic(counted) == traffic(charged)
    itemsize = numpy.dtype(dtype).itemsize
    assert traffic(counted)[0] == ring_bytes_sent("all_gather", [c * itemsize for c in counts], ring.rank)
    if even_split and numel % ring.size == 0:
        assert traffic(counted)[0] == exact_ring_fraction(1, ring, gathered.nbytes)


@mpi_given(which=st.sampled_from(["world", "group"]), numel=st.integers(0, 50),
           seed=st.integers(0, 2**32 - 1))
def test_fp32_wire_halves_the_bytes_and_every_rank_agrees(rings, which, numel, seed):
    ring = rings[which]
    inputs = [rank_data(seed, r, numel, "float64") for r in range(ring.size)]
    on_wire, plain = fresh(ring), fresh(ring)
    result = ring_all_reduce(on_wire, inputs[ring.rank], wire=TO_FP32)
    exact = ring_all_reduce(plain, inputs[ring.rank])
    assert result.dtype == numpy.float64
    assert numpy.array_equal(result, TO_FP32.decode(TO_FP32.encode(ring_order_reduce(inputs, TO_FP32))))
    assert len(set(ring.allgather_obj(result.tobytes()))) == 1  # replicas stay identical
    numpy.testing.assert_allclose(result, exact, rtol=1e-6 * ring.size, atol=1e-6 * ring.size)
    assert traffic(on_wire)[0] * 2 == traffic(plain)[0]


class Wiretap:
    """The test's own wrapper around an mpi4py communicator: every method call is counted, the bytes of
    each point-to-point send are measured from its buffer, and object methods (lower-case: pickled
    Python objects) and MPI's own collectives are flagged. What crossed the communicator, whatever the
    code under test writes in its counters."""

    POINT_TO_POINT = {"Send", "Isend", "Ssend", "Issend", "Sendrecv", "Bsend", "Rsend"}
    LOCAL = {"Get_rank", "Get_size", "Get_group", "Get_name", "Irecv", "Recv", "Sendrecv_replace"}

    def __init__(self, mpi):
        self.mpi = mpi
        self.calls: dict[str, int] = {}
        self.bytes_sent = 0
        self.messages = 0
        self.flagged: list[str] = []

    def __getattr__(self, name):
        real = getattr(self.mpi, name)
        if not callable(real):
            return real

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            if name in self.POINT_TO_POINT:
                buffer = args[0] if args else kwargs.get("buf", kwargs.get("sendbuf"))
                buffer = buffer[0] if isinstance(buffer, (list, tuple)) else buffer
                self.bytes_sent += numpy.asarray(buffer).nbytes
                self.messages += 1
            elif name[:1].islower():
                self.flagged.append(f"{name} (an object method: pickled Python objects)")
            elif name not in self.LOCAL:
                self.flagged.append(f"{name} (MPI's own collective, not the ring)")
            return real(*args, **kwargs)

        return counted


@mpi_given(examples=UNEVEN_RINGS, which=st.sampled_from(["world", "group"]), numel=st.integers(0, 50),
           dtype=st.sampled_from(["float64"]), seed=st.integers(0, 2**32 - 1))
def test_ring_reduce_scatter_traffic_is_what_crossed_the_communicator(rings, which, numel, dtype, seed):
    """Bytes and messages counted by a wiretap on the communicator, not by the ring's own counters; the
    chunks travel through the Wire (here fp32: half the bytes, each partial sum rounded on the way)."""
    ring = rings[which]
    inputs = [rank_data(seed, r, numel, dtype) for r in range(ring.size)]
    tap = Wiretap(ring.mpi)
    counted = Comm(tap, name=ring.name, ledger=TrafficLedger())
    shard = ring_reduce_scatter(counted, inputs[ring.rank], wire=TO_FP32)
    own = slice(*shard_bounds(numel, ring.size, ring.rank))
    assert tap.flagged == [], f"the ring used {tap.flagged}"
    wire_bytes = [count * 4 for count in shard_sizes(numel, ring.size)]  # fp32 on the wire
    expected = (ring_bytes_sent("reduce_scatter", wire_bytes, ring.rank), ring.size - 1)
    assert (tap.bytes_sent, tap.messages) == expected, \
        f"crossed the communicator: {tap.bytes_sent} bytes in {tap.messages} messages; a ring: {expected}"
    assert traffic(counted) == expected, f"the ledger says {traffic(counted)}, the wiretap saw {expected}"
    assert numpy.array_equal(shard, ring_order_reduce(inputs, TO_FP32)[own]), \
        "not the ring's sums with each partial sum passed through wire.encode and wire.decode"


@mpi_given(which=st.sampled_from(["world", "group"]), numel=st.integers(0, 40),
           seed=st.integers(0, 2**32 - 1))
def test_ring_all_gather_traffic_is_what_crossed_the_communicator(rings, which, numel, seed):
    """The all-gather's bytes counted by the wiretap, through the fp32 Wire (uneven shards included)."""
    ring = rings[which]
    counts = shard_sizes(numel, ring.size)
    shards = [rank_data(seed, r, counts[r], "float64") for r in range(ring.size)]
    tap = Wiretap(ring.mpi)
    counted = Comm(tap, name=ring.name, ledger=TrafficLedger())
    gathered = ring_all_gather(counted, shards[ring.rank], numel=numel, wire=TO_FP32)
    assert tap.flagged == [], f"the ring used {tap.flagged}"
    expected = (ring_bytes_sent("all_gather", [c * 4 for c in counts], ring.rank), ring.size - 1)
    assert (tap.bytes_sent, tap.messages) == expected, \
        f"crossed the communicator: {tap.bytes_sent} bytes in {tap.messages} messages; a ring: {expected}"
    assert traffic(counted) == expected, f"the ledger says {traffic(counted)}, the wiretap saw {expected}"
    rounded = [TO_FP32.decode(TO_FP32.encode(shard)) for shard in shards]
    assert numpy.array_equal(gathered, numpy.concatenate(rounded)), \
        "every shard, this rank's own too, must pass through wire.encode and wire.decode"


def test_a_ring_of_one_returns_its_input_and_sends_nothing():
    ring = Comm(MPI.COMM_SELF, name="solo")
    x = numpy.arange(6, dtype="int64").reshape(2, 3)
    assert numpy.array_equal(ring_all_reduce(ring, x), x)
    assert numpy.array_equal(ring_reduce_scatter(ring, x), x.ravel())
    assert numpy.array_equal(ring_all_gather(ring, x), x.ravel())
    assert numpy.array_equal(ring_all_reduce(ring, x.astype("float64"), wire=TO_FP32), x)
    report = ring.ledger.total_report()
    assert (report["sent_bytes"], report["messages"]) == (0, 0)
    assert report["by_dim_op"] == {"solo": {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0}}


# ---- links: each rank's bytes on the link to the rank it sends to ----------------------------------------

# A group of at most 3 ranks (the `rings` fixture's) with its last rank alone on node "b": the link to
# each rank's successor on the ring, and for all_to_all the bytes (4-element float64 blocks, 32 bytes) to
# each destination split by link, written out: with 3, rank 0 sends to 1 (intra) and 2 (inter), rank 1 to
# 0 (intra) and 2 (inter), rank 2 to 0 and 1 (both inter).
SUCCESSOR_LINKS = {1: ["intra"], 2: ["inter", "inter"], 3: ["intra", "inter", "inter"]}
ALL_TO_ALL_LINKS = {1: [(0, 0)], 2: [(0, 32), (0, 32)], 3: [(32, 32), (32, 32), (0, 64)]}


@mpi_test
def test_ring_collectives_and_all_to_all_charge_the_link_they_send_on(rings):
    group = rings["group"]
    n = group.size
    nodes = ["a"] * (n - 1) + ["b"] if n > 1 else ["a"]
    x = numpy.arange(6.0)
    ops = {"all_reduce": lambda c: ring_all_reduce(c, x),
           "reduce_scatter": lambda c: ring_reduce_scatter(c, x),
           "all_gather": lambda c: ring_all_gather(c, x[slice(*shard_bounds(6, n, c.rank))], 6)}
    wrong = []  # collected, not asserted at once: a rank that stopped early would leave the others waiting
    for op, call in ops.items():
        placed = Comm(group.mpi, name="group", ledger=TrafficLedger(), nodes=nodes)
        call(placed)
        sent, link = placed.ledger.step_report()["sent_bytes"], SUCCESSOR_LINKS[n][group.rank]
        by_link = placed.ledger.step_links()["by_link"]
        if (sent > 0) != (n > 1) or by_link != {"intra": 0, "inter": 0, link: sent}:
            wrong.append((op, by_link, f"expected all {sent} bytes {link}"))
    for nodes_here, expected in ((nodes, ALL_TO_ALL_LINKS[n][group.rank]), (["a"] * n, (32 * (n - 1), 0))):
        placed = Comm(group.mpi, name="group", ledger=TrafficLedger(), nodes=nodes_here)
        all_to_all(placed, numpy.zeros((n, 4)))
        by_link = placed.ledger.step_links()["by_link"]
        if (by_link["intra"], by_link["inter"]) != expected:
            wrong.append(("all_to_all", nodes_here, by_link, f"expected (intra, inter) = {expected}"))
    assert wrong == []


@mpi_test
def test_iall_to_all_delivers_and_charges_what_all_to_all_does(rings):
    """The non-blocking all-to-all of an overlapped F&B step (parallel/f_and_b.py): block s of rank r's
    buffer (filled with 10r + s) lands as block r on rank s, and the ledger's bytes, messages and links
    are the blocking one's, with rank n-1 on a node of its own."""
    group = rings["group"]
    n = group.size
    nodes = ["a"] * (n - 1) + ["b"] if n > 1 else ["a"]
    blocks = numpy.array([[10.0 * group.rank + s] * 4 for s in range(n)])
    expected = numpy.array([[10.0 * r + group.rank] * 4 for r in range(n)])
    wrong, charged = [], []
    for name, exchange in (("all_to_all", lambda c: all_to_all(c, blocks)),
                           ("iall_to_all", lambda c: c.iall_to_all(blocks).wait())):
        placed = Comm(group.mpi, name="group", ledger=TrafficLedger(), nodes=nodes)
        received = exchange(placed)
        if not numpy.array_equal(received, expected):
            wrong.append((name, received[:, 0]))
        charged.append((placed.ledger.step_report()["by_dim_op"], placed.ledger.step_report()["messages"],
                        placed.ledger.step_links()["by_link"]))
    assert wrong == [] and charged[0] == charged[1], (wrong, charged)
