"""`python -m minipar bench fusion`: fused against eager, timed on this machine.

Two workloads: a chain of 8 elementwise operations over two float32 arrays (2**24 values by
default), and the AdamW update over four. Each runs eagerly (one NumPy operation per node) and
fused (tile by tile in cache); the table shows the median of repeated runs, the bytes each moved
by the interpreters' count, and fused-over-eager ratios measured in the same run. The chain's line
"numpy" is the same expression as plain NumPy code, for reference.

Two limits for the fused run, timed in the same rounds: "copy", the copy ceiling (a copy moving
the same bytes as the fused run, its inputs read once and its output written once: the time memory
alone takes), and for the chain "floor", the compute floor (the fused kernel's per-tile program on
one tile, which stays in cache, run once per tile: the time the arithmetic and the interpreter's
per-tile work take with no memory traffic). Like the copy, the eager and the fused chain write their
result into an array allocated once, so that no run pays for fresh pages of its result (bench_chain).
Lesson: lessons/10_fusion.md.

    python -m minipar bench fusion [--size 16777216] [--repeats 5] [--tile 32768] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from minipar import fusion as fx
from minipar.fusion.fuse import fuse
from minipar.fusion.interpret import run
from minipar.fusion.ir import array
from minipar.fusion.tiled import TILE, TileProgram
from minipar.fusion.training import adamw_update
from minipar_lab.bench.timing import SPREAD, plus_minus, round_times, spread

ADAMW_HYPERPARAMETERS = dict(step=10, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def chain8(a, b, ops=np):
    """8 elementwise operations: add, multiply, subtract, multiply, maximum, add, sqrt, multiply.
    `ops` is the module providing maximum and sqrt: numpy for arrays, minipar.fusion for nodes."""
    return ops.sqrt(ops.maximum(((a + b) * a - b) * 0.5, a) + 1.0) * b


def bench_chain(size: int, repeats: int, tile: int) -> dict:
    rng = np.random.default_rng(0)
    a_values, b_values = rng.random(size, dtype=np.float32), rng.random(size, dtype=np.float32)
    expr = chain8(array(a_values, name="a"), array(b_values, name="b"), ops=fx)
    # Each run writes its result into an array it is given, as the copy writes into its target: a fresh
    # result array would add its first touch (the kernel zeroing 64 MiB of new pages, 7 ms here) to a
    # time meant to be traffic and arithmetic. Eager still allocates its seven intermediates: that is eager.
    results = {mode: np.empty_like(a_values) for mode in ("eager", "fused")}
    works = {"eager": lambda: run(expr, fused=False, tile=tile, out=results["eager"])[1],
             "fused": lambda: run(expr, fused=True, tile=tile, out=results["fused"])[1],
             "numpy": lambda: chain8(a_values, b_values),
             "copy": copy_ceiling(3 * size),
             "floor": compute_floor(a_values[:tile].copy(), b_values[:tile].copy(), -(-size // tile))}
    return _rows(works, repeats)


def copy_ceiling(values_moved: int):
    """A float32 copy moving `values_moved` values, half read and half written: memory's time for them."""
    source, target = np.ones(values_moved // 2, np.float32), np.empty(values_moved // 2, np.float32)
    return lambda: np.copyto(target, source)


def compute_floor(a_tile, b_tile, tiles: int):
    """The fused chain's per-tile program run `tiles` times on the same tile, which stays in cache:
    the fused run's arithmetic and per-tile loop without its memory traffic (nor its one-off planning)."""
    (kernel,) = fuse([chain8(array(a_tile, name="a"), array(b_tile, name="b"), ops=fx)])
    program = TileProgram(kernel.nodes, kernel.inputs, to_output=True)
    inputs, out = [node.value for node in kernel.inputs], np.empty_like(a_tile)
    buffers = [np.empty(a_tile.size, dtype) for dtype in program.buffer_dtypes]

    def floor():
        for _ in range(tiles):
            program.run(np, inputs, out, buffers)

    floor.out = out  # type: ignore[attr-defined]  # the tile's result, for a test to check
    return floor


def bench_adamw(size: int, repeats: int, tile: int) -> dict:
    rng = np.random.default_rng(1)
    param, grad, exp_avg = (rng.standard_normal(size, dtype=np.float32) for _ in range(3))
    exp_avg_sq = rng.random(size, dtype=np.float32)

    def step(fused):
        return adamw_update(param, grad, exp_avg, exp_avg_sq, **ADAMW_HYPERPARAMETERS, fused=fused)

    return _rows({"eager": lambda: step(False), "fused": lambda: step(True),
                  "copy": copy_ceiling(10 * size)}, repeats)


def _rows(works: dict, repeats: int) -> dict:
    """One row per callable: median seconds and their spread (the callables timed in alternating rounds,
    so that a busy machine slows them alike and their ratios stay honest), and kernels and bytes where
    it returns Stats."""
    rows = {name: dict(zip(("seconds", "seconds_spread"), spread(times)))
            for name, times in round_times(works, repeats).items()}
    for name, work in works.items():
        stats = work()
        if hasattr(stats, "kernels"):
            rows[name].update(kernels=len(stats.kernels), bytes_moved=stats.bytes_moved)
    return rows


def _table(results: dict, size: int, repeats: int, tile: int) -> str:
    lines = [f"fusion benchmark: {size:,} float32 values, median of {repeats} runs, tile {tile:,} elements; "
             f"ms: {SPREAD}",
             f"{'workload':<10}{'mode':<8}{'kernels':>8}{'MB moved':>11}{'ms':>16}"]
    for workload, rows in results.items():
        for mode, row in rows.items():
            kernels = row.get("kernels", "")
            moved = f"{row['bytes_moved'] / 1e6:.1f}" if "bytes_moved" in row else ""
            ms = plus_minus(row["seconds"], row["seconds_spread"], 1e3)
            lines.append(f"{workload:<10}{mode:<8}{kernels:>8}{moved:>11}{ms:>16}")
    for workload, rows in results.items():
        eager, fused = rows["eager"], rows["fused"]
        floor = ""
        if "floor" in rows:
            floor = f", {fused['seconds'] / rows['floor']['seconds']:.2f}x the compute floor"
        lines.append(f"{workload}: eager/fused time {eager['seconds'] / fused['seconds']:.2f}x, "
                     f"bytes moved {eager['bytes_moved'] / fused['bytes_moved']:.1f}x; fused takes "
                     f"{fused['seconds'] / rows['copy']['seconds']:.2f}x the copy ceiling{floor}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m minipar bench fusion",
                                     description="Fused against eager: an 8-op chain and AdamW.")
    parser.add_argument("--size", type=int, default=2**24, help="values per array (default 2**24)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median)")
    parser.add_argument("--tile", type=int, default=TILE, help="elements per tile of the fused interpreter")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args(argv)
    for name in ("size", "repeats", "tile"):
        if getattr(args, name) < 1:
            value = getattr(args, name)
            print(f"minipar bench fusion: error: --{name} must be a positive integer, got {value}",
                  file=sys.stderr)
            return 2
    results = {"chain8": bench_chain(args.size, args.repeats, args.tile),
               "adamw": bench_adamw(args.size, args.repeats, args.tile)}
    if args.json:
        ratios = {w: {"speedup": r["eager"]["seconds"] / r["fused"]["seconds"],
                      "bytes_ratio": r["eager"]["bytes_moved"] / r["fused"]["bytes_moved"]}
                  for w, r in results.items()}
        print(json.dumps({"size": args.size, "repeats": args.repeats, "tile": args.tile,
                          "results": results, "ratios": ratios}))
    else:
        print(_table(results, args.size, args.repeats, args.tile))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
