"""A roofline for the fusion lesson: attainable operations per second against arithmetic intensity
(operations per byte moved), min(compute roof, bandwidth x intensity), with the eager and the fused
8-operation chain placed on it.

All from bench fusion's chain (`minipar_lab.bench.fusion.bench_chain`, medians of alternating rounds): the
bandwidth roof is its copy ceiling (bytes the copy moves over its time), the compute roof its compute
floor (the chain's 8 operations per value over the floor's time: the interpreter's arithmetic with no
memory traffic), and each point is 8 operations per value over the bytes the interpreter counted and
the time it took. At bench fusion's 2**24 values (64 MiB an array) no array fits in a CPU's cache, so
every counted byte does cross the memory bus.

    python -m minipar plot roofline [--size 16777216] [--repeats 3] [--out DIR]
Lesson: lessons/10_fusion.md.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from minipar.fusion.tiled import TILE
from minipar_lab.bench import canvas
from minipar_lab.bench.fusion import bench_chain

FILE = "10_roofline.png"
CHAIN_OPS = 8  # chain8: add, multiply, subtract, multiply, maximum, add, sqrt, multiply per value
FLOAT32 = 4


def add_arguments(p) -> None:
    p.add_argument("--size", type=int, default=2**24, help="float32 values per array (bench fusion's)")
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds (medians)")


def attainable(intensity, compute_roof: float, bandwidth: float):
    """The roofline: min(compute roof, bandwidth x intensity), in operations per second."""
    return np.minimum(compute_roof, bandwidth * np.asarray(intensity, dtype=float))


def roofs(rows: dict, size: int) -> tuple[float, float]:
    """(compute roof in operations/s, bandwidth in bytes/s) of bench_chain's rows: the floor runs the
    chain's operations on every value, the copy moves 3 values' bytes per value (1.5 read, 1.5 written)."""
    return CHAIN_OPS * size / rows["floor"]["seconds"], 3 * size * FLOAT32 / rows["copy"]["seconds"]


def points(rows: dict, size: int) -> dict[str, tuple[float, float]]:
    """{mode: (intensity in operations/byte, achieved operations/s)} of the eager and the fused run."""
    return {mode: (CHAIN_OPS * size / rows[mode]["bytes_moved"], CHAIN_OPS * size / rows[mode]["seconds"])
            for mode in ("eager", "fused")}


def draw(args, path: Path) -> None:
    if args.size < 1 or args.repeats < 1:
        raise ValueError("--size and --repeats must be positive")
    rows = bench_chain(args.size, args.repeats, TILE)
    compute_roof, bandwidth = roofs(rows, args.size)
    placed = points(rows, args.size)
    plt = canvas.pyplot()
    figure, ax = plt.subplots(figsize=(6.5, 4.5))
    dense = np.geomspace(0.01, 100, 200)
    ax.plot(dense, attainable(dense, compute_roof, bandwidth) / 1e9, "-", color="black",
            label=f"roofs: {bandwidth / 1e9:.1f} GB/s (copy), {compute_roof / 1e9:.2f} Gop/s (floor)")
    for mode, (intensity, achieved) in placed.items():
        ax.plot([intensity], [achieved / 1e9], "o", markersize=9, label=f"{mode}: {intensity:.3f} op/B")
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (operations per byte moved)",
           ylabel="Gop/s", title=f"chain of 8 float32 operations, {args.size:,} values, one core")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    canvas.save(figure, path)
