"""Offload: bytes moved between the device and the lower tier per step under LRU and OPT, against the
device budget. The rows are bench memory's offload runs (`minipar_lab.bench.memory.measure_offload`: real
`minipar train --offload cpu --device-mem-mb B --eviction E` runs of its 8-layer GPT on one rank,
the step after the first, which records OPT's trace), or a saved `bench memory --json`.

    python -m minipar plot offload [--budgets 2 4 6] [--bench-json FILE] [--out DIR]
Lesson: lessons/08_memory.md.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from minipar.memory.offload import MiB
from minipar_lab.bench import canvas
from minipar_lab.bench.memory import measure_offload

FILE = "08_offload.png"


def add_arguments(p) -> None:
    p.add_argument("--budgets", type=float, nargs="+", default=[2.0, 4.0, 6.0], help="device MiB")
    p.add_argument("--bench-json", type=Path, default=None, help="the output of `bench memory --json`")


def moved_by_policy(rows: list[dict], tier: str = "cpu") -> dict[str, tuple[list[float], list[float]]]:
    """{eviction: (budgets MiB, moved MiB per step)} of one tier's rows, budgets in increasing order."""
    curves: dict[str, tuple[list[float], list[float]]] = {}
    for row in sorted((r for r in rows if r["tier"] == tier), key=lambda r: r["budget_mb"]):
        budgets, moved = curves.setdefault(row["eviction"], ([], []))
        budgets.append(row["budget_mb"])
        moved.append(row["moved_bytes"] / MiB)
    return curves


def draw(args, path: Path) -> None:
    if args.bench_json:
        if not args.bench_json.is_file():
            raise FileNotFoundError(f"no bench memory JSON file {args.bench_json}")
        rows = json.loads(args.bench_json.read_text())["offload"]
    else:
        if min(args.budgets) <= 0:
            raise ValueError("--budgets must be positive")
        with tempfile.TemporaryDirectory() as folder:
            rows = measure_offload(args.budgets, steps=2, folder=Path(folder), tiers=("cpu",))
    plt = canvas.pyplot()
    figure, ax = plt.subplots(figsize=(6, 4))
    for eviction, (budgets, moved) in moved_by_policy(rows).items():
        ax.plot(budgets, moved, "o-", label=eviction.upper())
    states = rows[0]["states_over_budget"] * rows[0]["budget_mb"]
    ax.set(xlabel="device budget (MiB)", ylabel="moved MiB per step (device <-> cpu)", ylim=(0, None),
           title=f"offload to cpu: model states {states:.1f} MiB, one rank")
    ax.grid(alpha=0.3)
    ax.legend()
    canvas.save(figure, path)
