"""The first check on a new cluster: 2 ranks on 2 nodes bounce messages; latency and bandwidth.

    mpiexec -hosts node1,node2 -n 2 python -m mpi4py tests/multinode/pingpong.py        # Hydra + ssh
    srun -N 2 -n 2 --mpi=pmi2 python -m mpi4py tests/multinode/pingpong.py             # Slurm

Rank 0 prints both hostnames (two different names: the ranks really are on two nodes), the Python
each runs (the same environment everywhere), then the one-way time of a message of each size
(half the round trip, median of repeats) and the bandwidth it reaches: alpha is the time of the
smallest message, 1/beta the bandwidth of the largest (lessons/07_3d.md, "Across nodes").
"""

from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI

SIZES = [8, 1 << 10, 1 << 16, 1 << 20, 1 << 24]  # bytes
REPEATS = 20


def one_way_seconds(world, nbytes: int) -> float:
    buffer, peer, times = np.zeros(nbytes, np.uint8), 1 - world.rank, []
    for _ in range(REPEATS):
        world.Barrier()
        started = time.perf_counter()
        if world.rank == 0:
            world.Send(buffer, dest=peer)
            world.Recv(buffer, source=peer)
        else:
            world.Recv(buffer, source=peer)
            world.Send(buffer, dest=peer)
        times.append((time.perf_counter() - started) / 2)
    return float(np.median(times))


def main() -> None:
    world = MPI.COMM_WORLD
    if world.size != 2:
        sys.exit("pingpong.py: error: run it on exactly 2 ranks (one per node)")
    where = world.gather((MPI.Get_processor_name(), sys.executable))
    if world.rank == 0:
        for rank, (host, python) in enumerate(where):
            print(f"rank {rank}: {host}  {python}")
        if where[0][0] == where[1][0]:
            print("warning: both ranks on one host: this measures shared memory, not the network")
    for nbytes in SIZES:
        seconds = one_way_seconds(world, nbytes)
        if world.rank == 0:
            print(f"{nbytes:>10,} B  one way {seconds * 1e6:10.1f} us  {nbytes / seconds / 1e9:8.3f} GB/s")


if __name__ == "__main__":
    main()
