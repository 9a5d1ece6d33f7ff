"""The traffic ledger: the bytes and messages each rank sends, charged by the ring algorithm's exact cost.

Every Comm (communicator.py) charges each collective to a ``TrafficLedger`` by the bandwidth-optimal
ring cost per rank (S = payload bytes):

    all_reduce      2(N-1)/N * S      (a reduce-scatter followed by an all-gather)
    reduce_scatter   (N-1)/N * S      (S = the full input)
    all_gather       (N-1)/N * S      (S = the full output)
    broadcast              S          (a pipelined chain from the root: each rank forwards the
                                      payload once, but the chain's last, root-1 mod N, only
                                      receives and is charged 0: (N-1) * S over all ranks)
    send                   S          (charged to the sender; recv is free)
    sendrecv               S          (one hop of a ring: the send half is charged, as send)

The charge is exact integer bytes, not a rounded fraction: a rank is charged what it really sends
in the ring algorithm of ``minipar.distributed.collectives`` (which counts its own bytes and must
agree). The data is cut into N shards by ``shard_bounds``; in a reduce-scatter rank r forwards every
shard but its own, in an all-gather every shard but that of its successor r+1 (the last one to
arrive, which it need not pass on). When N divides S these are exactly (N-1)/N * S; otherwise they
differ from it by less than one element, and the charges of all ranks still add up to exactly
(N-1) * S. Messages are counted the same way: N-1 per reduce-scatter or all-gather, 2(N-1) per
all-reduce. Each charge also says its link: "inter" when the bytes cross to another node, "intra" when
they stay inside one (lessons/07_3d.md, "Across nodes").

Listeners (`subscribe`, a `RemovableHandle` back) hear every charge and every watched wait as it
happens: the trace of `--trace` (trainer/trace.py) draws them on a timeline; without one, a charge
costs one test of an empty list.

What it saves: nothing by itself; it makes the cost of every technique visible and testable.
What it costs: nothing on the wire. Lesson: lessons/02_collectives.md.
"""

from __future__ import annotations

from collections import Counter

from minipar.core.hooks import HookList, RemovableHandle


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
        self.listeners = HookList()
        self.start_step()

    def subscribe(self, listener) -> RemovableHandle:
        """Tell `listener` of every charge, `listener.charged(dim, op, nbytes, link, pending)`, and of
        every watched wait once it ends, `listener.waited(dim, op, started, ended, pending)` (seconds of
        time.perf_counter). `pending` names a non-blocking call (Comm.iall_reduce, iall_gather): its
        charge when it starts, its wait when it ends; None for the others. A blocking call's charge comes
        inside its wait: after `began(dim, op, started)`, before `waited`."""
        return self.listeners.add(listener)

    def charge(self, dim: str, op: str, nbytes: int, messages: int = 1, link: str = "intra",
               pending: int | None = None) -> None:
        key = (dim, op)
        for counter, amount in ((self._total_bytes, nbytes), (self._step_bytes, nbytes),
                                (self._total_messages, messages), (self._step_messages, messages)):
            counter[key] += int(amount)
        for counter in (self._total_links, self._step_links):
            counter[(dim, link)] += int(nbytes)
        if self.listeners:  # none without --trace: no work per charge
            for listener in self.listeners:
                listener.charged(dim, op, int(nbytes), link, pending)

    def began(self, dim: str, op: str, started: float) -> None:
        """A watched wait began (Comm.watch): the listeners' charges until it ends are its own."""
        if self.listeners:
            for listener in self.listeners:
                listener.began(dim, op, started)

    def waited(self, dim: str, op: str, started: float, ended: float, pending: int | None = None) -> None:
        """A watched wait ended: its time is wait time (add_wait), and the listeners hear of it."""
        self.add_wait(ended - started)
        if self.listeners:
            for listener in self.listeners:
                listener.waited(dim, op, started, ended, pending)

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
