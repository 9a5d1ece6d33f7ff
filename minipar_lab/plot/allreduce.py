"""The all-reduce's time against its message size, with the alpha-beta model fitted to it.

A ring all-reduce of S bytes over N ranks takes 2(N-1) steps, each a latency α plus S/N bytes at a
bandwidth β (lesson 02's model): t(S) = 2(N-1)·α + 2(N-1)/N·S/β. The points are bench dp's all-reduce probe
(`minipar_lab.bench.dp.all_reduce_seconds`: the slowest rank's median of repeated Comm.all_reduce calls,
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

from minipar.trainer.launch import run_mpi
from minipar_lab.bench import canvas

FILE = "02_allreduce.png"
SIZES = [8 * 4**i for i in range(11)]  # 8 B .. 8 MiB


def add_arguments(p) -> None:
    p.add_argument("--ranks", type=int, default=2, help="ranks N of the all-reduce")
    p.add_argument("--json", type=Path, default=None, help="a saved measurement instead of a run")


def ring_terms(nbytes, ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """The coefficients of α and of 1/β in a ring all-reduce's time: 2(N-1) and 2(N-1)/N·S."""
    size = np.asarray(nbytes, dtype=float)
    return np.full_like(size, 2 * (ranks - 1)), 2 * (ranks - 1) / ranks * size


def fit_alpha_beta(nbytes, seconds, ranks: int) -> tuple[float, float]:
    """(α in seconds, β in bytes per second), the model being linear in α and 1/β. α from the least
    squared *relative* error over all sizes (the small messages, whose time is mostly latency, decide
    it); then 1/β by least squares on the times with α fixed (the large ones decide it). One fit of
    either kind alone lets one end of six orders of magnitude decide both; on a real machine the two
    ends also differ in kind (MPI switches protocol, messages leave the cache), and the middle sizes
    show how far one straight model is from the truth."""
    a, b = ring_terms(nbytes, ranks)
    t = np.asarray(seconds, dtype=float)
    (alpha, _), *_ = np.linalg.lstsq(np.stack([a / t, b / t], axis=1), np.ones_like(t), rcond=None)
    per_byte = float(np.dot(b, t - alpha * a) / np.dot(b, b))
    return float(alpha), 1 / per_byte


def predicted(nbytes, ranks: int, alpha: float, beta: float) -> np.ndarray:
    """The model's seconds: 2(N-1)·α + 2(N-1)/N·S/β."""
    a, b = ring_terms(nbytes, ranks)
    return alpha * a + b / beta


def probe(repeats: int = 20) -> None:
    """Under mpiexec: bench dp's all-reduce probe at every size; rank 0 prints the measurement."""
    from mpi4py import MPI

    from minipar_lab.bench.dp import all_reduce_seconds

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
        measured = json.loads(run_mpi(args.ranks, ["-m", "minipar_lab.plot.allreduce", "--probe"]))
    ranks, sizes, seconds = measured["ranks"], measured["sizes"], measured["seconds"]
    alpha, beta = fit_alpha_beta(sizes, seconds, ranks)
    plt = canvas.pyplot()
    figure, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.plot(sizes, np.array(seconds) * 1e6, "o", label="measured (median)")
    dense = np.geomspace(min(sizes), max(sizes), 100)
    ax.plot(dense, predicted(dense, ranks, alpha, beta) * 1e6, "-",
            label=f"fit: α = {alpha * 1e6:.1f} µs, β = {beta / 1e9:.2f} GB/s")
    ax.set(xscale="log", yscale="log", xlabel="message bytes S", ylabel="all-reduce µs",
           title=f"all-reduce on N = {ranks} ranks: 2(N-1)·α + 2(N-1)/N·S/β")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    canvas.save(figure, path)


if __name__ == "__main__" and sys.argv[1:] == ["--probe"]:
    probe()
