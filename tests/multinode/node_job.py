"""One rank of a training job on simulated nodes, with each node's link read at every step boundary.

    mpiexec ... python -m mpi4py tests/multinode/node_job.py CONFIG_JSON OUT_JSON   (cluster.py starts it)

Every rank trains the TrainConfig in CONFIG_JSON, step by step as `Trainer.run` would. Around each
step all ranks meet (a barrier), and between the barriers that end one step and start the next (while
no rank can send) the first rank of each node reads the bytes and packets its node's interfaces have
sent (/sys/class/net/*/statistics/tx_bytes, tx_packets, in its own namespace): the kernel's count of
what crossed between nodes during the step. Rank 0 writes OUT_JSON: every
rank's node and per-step ledger (its comm report), every node's per-step link bytes, the link bytes
of the whole job, and the comparison with one process. The kernel's count is the oracle for the
ledger's inter-node bytes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mpi4py import MPI

from minipar.distributed.communicator import wait_for_everyone
from minipar.trainer.config import TrainConfig
from minipar.trainer.loop import Trainer, compare_with_reference


def link_sent() -> tuple[int, int]:
    """(bytes, packets) sent by this namespace's interfaces other than loopback (kernel counters)."""
    interfaces = [path / "statistics" for path in Path("/sys/class/net").iterdir() if path.name != "lo"]
    return (sum(int((stats / "tx_bytes").read_text()) for stats in interfaces),
            sum(int((stats / "tx_packets").read_text()) for stats in interfaces))


def since(before: tuple[int, int]) -> tuple[int, int]:
    now = link_sent()
    return now[0] - before[0], now[1] - before[1]


def main(config_json: str, out: str) -> None:
    world = MPI.COMM_WORLD
    job_start = link_sent()
    cfg = TrainConfig(**json.loads(config_json)).resolved(world.size)
    trainer = Trainer(cfg, world)
    node = MPI.Get_processor_name()
    nodes = world.allgather(node)
    reads_link = nodes.index(node) == world.rank  # the node's first rank speaks for the node
    records, link_per_step = [], []
    wait_for_everyone(world)
    before = link_sent()
    for step in range(cfg.steps):
        # Every rank waits here until the reader has read `before`: read after this barrier instead, a
        # rank let go first could send its first bytes of the step before the reader had read, and
        # they would fall in no step's window (seen under load: a step 1 KB short of its ledger).
        wait_for_everyone(world)
        records.append(trainer.step(step))
        wait_for_everyone(world)
        link_per_step.append(since(before))
        before = link_sent()
    wait_for_everyone(world)  # no rank sends the next messages (below) before every node has read
    trainer.memory.close()
    full = trainer.full_state()
    ledgers = world.gather({"rank": world.rank, "node": node, "coords": trainer.grid.coords_of(world.rank),
                            "comm": [r["comm"] for r in records]})
    links = world.gather({"node": node, "per_step": link_per_step} if reads_link else None)
    wait_for_everyone(world)
    job_link = world.gather({"node": node, "job": since(job_start)} if reads_link else None)
    if world.rank == 0:
        check = compare_with_reference(cfg, records, full)
        Path(out).write_text(json.dumps({
            "check": check, "losses": [r["loss"] for r in records], "step_s": [r["time_s"] for r in records],
            "ranks": ledgers,
            "links": [x for x in links if x], "job_links": [x for x in job_link if x],
            "grid": trainer.grid.describe()}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
