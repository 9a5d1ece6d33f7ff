"""The all-reduce's time against its message size, with the alpha-beta model fitted to it.

A ring all-reduce of S bytes over N ranks takes 2(N-1) steps, each a latency alpha plus S/N bytes at
beta seconds per byte: t(S) = 2(N-1)·alpha + 2(N-1)/N·S·beta. The points are bench dp's all-reduce probe
(`minipar.bench.dp.all_reduce_seconds`: the slowest rank's median of repeated Comm.all_reduce calls,
a barrier before each) at sizes from 8 B to 8 MiB, in one `mpiexec -n N` launch; --json FILE plots a
saved measurement instead ({"ranks": N, "sizes": [...], "seconds": [...]}, what the probe prints).

    python -m minipar plot allreduce [--ranks 2] [--json FILE] [--out DIR]
Lesson: lessons/02_collectives.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from minipar.bench.timing import run_mpi
from minipar.plot import canvas

FILE = "02_allreduce.png"
SIZES = [8 * 4**i for i in range(11)]  # 8 B .. 8 MiB


def add_arguments(p) -> None:
    p.add_argument("--ranks", type=int, default=2, help="ranks N of the all-reduce")
    p.add_argument("--json", type=Path, default=None, help="a saved measurement instead of a run")


def ring_terms(nbytes, ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """The coefficients of alpha and beta in a ring all-reduce's time: 2(N-1) and 2(N-1)/N·S."""
    size = np.asarray(nbytes, dtype=float)
    return np.full_like(size, 2 * (ranks - 1)), 2 * (ranks - 1) / ranks * size


def fit_alpha_beta(nbytes, seconds, ranks: int) -> tuple[float, float]:
    """(alpha seconds, beta seconds per byte) minimising the squared *relative* error of the model
    against the times: the sizes span six orders of magnitude, and plain least squares would let the
    largest ones alone decide alpha."""
    a, b = ring_terms(nbytes, ranks)
    t = np.asarray(seconds, dtype=float)
    (alpha, beta), *_ = np.linalg.lstsq(np.stack([a / t, b / t], axis=1), np.ones_like(t), rcond=None)
    return float(alpha), float(beta)


def predicted(nbytes, ranks: int, alpha: float, beta: float) -> np.ndarray:
    a, b = ring_terms(nbytes, ranks)
    return alpha * a + beta * b


def probe(repeats: int = 20) -> None:
    """Under mpiexec: bench dp's all-reduce probe at every size; rank 0 prints the measurement."""
    from mpi4py import MPI

    from minipar.bench.dp import all_reduce_seconds

    seconds = [all_reduce_seconds(n, repeats) for n in SIZES]
    if MPI.COMM_WORLD.rank == 0:
        print(json.dumps({"ranks": MPI.COMM_WORLD.size, "sizes": SIZES, "seconds": seconds}))


def draw(args, path: Path) -> None:
    if args.json:
        if not args.json.is_file():
            raise FileNotFoundError(f"no measurement file {args.json}")
        measured = json.loads(args.json.read_text())
    else:
        if args.ranks < 2:
            raise ValueError("--ranks must be at least 2")
        measured = json.loads(run_mpi(args.ranks, ["-m", "minipar.plot.allreduce", "--probe"]))
    ranks, sizes, seconds = measured["ranks"], measured["sizes"], measured["seconds"]
    alpha, beta = fit_alpha_beta(sizes, seconds, ranks)
    plt = canvas.pyplot()
    figure, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.plot(sizes, np.array(seconds) * 1e6, "o", label="measured (median)")
    dense = np.geomspace(min(sizes), max(sizes), 100)
    ax.plot(dense, predicted(dense, ranks, alpha, beta) * 1e6, "-",
            label=f"fit: alpha = {alpha * 1e6:.1f} µs, 1/beta = {1 / beta / 1e9:.2f} GB/s")
    ax.set(xscale="log", yscale="log", xlabel="message bytes S", ylabel="all-reduce µs",
           title=f"all-reduce on N = {ranks} ranks: 2(N-1)·alpha + 2(N-1)/N·S·beta")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    canvas.save(figure, path)


if __name__ == "__main__" and sys.argv[1:] == ["--probe"]:
    probe()
