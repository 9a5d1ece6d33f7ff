"""`python -m minipar bench memory`: chunked ZeRO-3 against per-unit ZeRO-3, and offload under LRU and OPT.

Two measurements, from real `minipar train` runs (rank 0's JSON-lines log, medians over the steps after
the first, which records OPT's trace):

  messages   the default GPT at dp = --ranks in fp64, per-unit ZeRO-3 (zero3.py) beside chunked ZeRO-3
             at the searched chunk size and at fixed --chunk-mb sizes: messages and bytes sent per step,
             the chunks' padding, the temporary buffers (peak bytes, allocations per step and how many
             distinct sizes), and the step time.
  offload    a deeper GPT on one rank whose model states are several times the device budget, offloaded
             to cpu and to disk under LRU and OPT: bytes moved between tiers per step, fetches,
             prefetches and evictions, the device peak against the budget, and the step time.

    python -m minipar bench memory [--ranks 4] [--chunk-mb 0.25 1 2] [--budgets 2 4 6] [--steps 4] [--json]
Lesson: lessons/08_memory.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from minipar.memory.chunks import chunk_padding
from minipar.memory.offload import MiB
from minipar.parallel.zero_chunked import chunk_numel_for, tensor_sizes
from minipar.trainer import build
from minipar.trainer.arguments import parse_train_args
from minipar.trainer.launch import run_train
from minipar_lab.bench.table import right_aligned
from minipar_lab.bench.timing import SPREAD, Progress, median, plus_minus, spread

MESSAGES_ARGS = ["--precision", "fp64"]
OFFLOAD_ARGS = ["--precision", "fp64", "--n-layer", "8", "--batch-size", "1", "--seq-len", "8"]


def chunk_layout(train_args: list[str], ranks: int) -> tuple[int, int, int]:
    """(elements per chunk, chunks, padding elements) that these arguments give on `ranks` ranks."""
    cfg = parse_train_args(train_args).replace(dp=ranks)
    model = build.build_model(cfg.replace(dp=1), None)
    sizes = tensor_sizes(model)
    numel = chunk_numel_for(cfg, model, ranks)
    padding = int(chunk_padding(sizes, [numel])[0])
    return numel, (sum(sizes) + padding) // numel, padding


def step_figures(records: list[dict]) -> dict:
    """The median step time and its spread (half the interquartile range) over the records."""
    return dict(zip(("step_s", "step_s_spread"), spread(records, lambda r: r["time_s"])))


def measure_messages(ranks: int, chunk_mbs: list[float], steps: int, folder: Path) -> list[dict]:
    runs = [("per-unit ZeRO-3", ["--zero", "3"]), ("chunks, searched size", ["--device-mem-mb", "1024"])]
    runs += [(f"chunks of {mb:g} MiB", ["--chunk-mb", str(mb)]) for mb in chunk_mbs]
    rows, progress = [], Progress("memory", len(runs))
    for name, extra in runs:
        progress(f"dp={ranks} {name}")
        args = [*MESSAGES_ARGS, *extra, "--dp", str(ranks), "--steps", str(steps)]
        after_first = run_train(ranks, args, folder / "messages.jsonl")[1:]
        row = {"engine": name, "args": extra,
               "messages": int(median(after_first, lambda r: r["comm"]["messages"])),
               "sent_bytes": int(median(after_first, lambda r: r["comm"]["sent_bytes"])),
               "buffers_peak": int(median(after_first, lambda r: r["mem"]["buffers_peak"])),
               "buffer_allocations": int(median(after_first, lambda r: r["mem"]["buffer_allocations"])),
               "buffer_sizes": int(median(after_first, lambda r: r["mem"]["buffer_sizes"])),
               **step_figures(after_first)}
        if extra[0] != "--zero":
            row["chunk_numel"], row["chunks"], row["padding"] = chunk_layout(args, ranks)
        rows.append(row)
    return rows


def measure_offload(budgets: list[float], steps: int, folder: Path,
                    tiers: tuple[str, ...] = ("cpu", "disk")) -> list[dict]:
    rows, progress = [], Progress("memory", len(tiers) * len(budgets) * 2)
    for tier in tiers:
        for budget in budgets:
            for eviction in ("lru", "opt"):
                progress(f"offload {tier} budget {budget:g} MiB {eviction}")
                args = [*OFFLOAD_ARGS, "--offload", tier, "--device-mem-mb", str(budget),
                        "--eviction", eviction, "--steps", str(steps)]
                records = run_train(1, args, folder / "offload.jsonl")
                after_first = records[1:]  # the first step records OPT's trace
                held = sum(records[-1]["mem"]["by_tier"].values())  # after a step: the model states only
                rows.append({
                    "tier": tier, "budget_mb": budget, "eviction": eviction,
                    "states_over_budget": held / (budget * MiB),
                    "moved_bytes": int(median(after_first, lambda r: r["offload"]["moved_bytes"])),
                    **{k: int(median(after_first, lambda r, k=k: r["offload"][k]))
                       for k in ("fetches", "prefetches", "evictions")},
                    "device_peak_mb": max(r["mem"]["device_peak"] for r in records) / MiB,
                    **step_figures(after_first),
                })
    return rows


MESSAGE_COLUMNS = [
    ("engine", lambda r: r["engine"]),
    ("chunk elements", lambda r: r.get("chunk_numel", "-")),
    ("chunks", lambda r: r.get("chunks", "-")),
    ("padding", lambda r: r.get("padding", "-")),
    ("messages/step", lambda r: r["messages"]),
    ("sent B/step", lambda r: r["sent_bytes"]),
    ("buffers peak B", lambda r: r["buffers_peak"]),
    ("buffer allocs (sizes)", lambda r: f"{r['buffer_allocations']} ({r['buffer_sizes']})"),
    ("step s", lambda r: plus_minus(r["step_s"], r["step_s_spread"], digits=3)),
]
OFFLOAD_COLUMNS = [
    ("tier", lambda r: r["tier"]),
    ("budget MiB", lambda r: f"{r['budget_mb']:g}"),
    ("states/budget", lambda r: f"{r['states_over_budget']:.1f}x"),
    ("eviction", lambda r: r["eviction"]),
    ("moved MiB/step", lambda r: f"{r['moved_bytes'] / MiB:.2f}"),
    ("fetches", lambda r: r["fetches"]),
    ("prefetches", lambda r: r["prefetches"]),
    ("evictions", lambda r: r["evictions"]),
    ("device peak MiB", lambda r: f"{r['device_peak_mb']:.3f}"),
    ("step s", lambda r: plus_minus(r["step_s"], r["step_s_spread"], digits=3)),
]


def render(figures: dict) -> str:
    messages = f"minipar train {' '.join(MESSAGES_ARGS)} --dp {figures['ranks']} (the default GPT)"
    offload = f"minipar train {' '.join(OFFLOAD_ARGS)} --offload TIER --device-mem-mb B --eviction E"
    return "\n".join([messages + f", medians after step 0; a ± b: {SPREAD}"]
                     + right_aligned(figures["messages"], MESSAGE_COLUMNS)
                     + ["", offload + " (one rank)"] + right_aligned(figures["offload"], OFFLOAD_COLUMNS))


def main(argv) -> int:
    p = argparse.ArgumentParser(prog="minipar bench memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4, help="data-parallel ranks for the message comparison")
    p.add_argument("--chunk-mb", type=float, nargs="+", default=[0.25, 1.0, 2.0])
    p.add_argument("--budgets", type=float, nargs="+", default=[2.0, 4.0, 6.0], help="device MiB for offload")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.ranks < 1 or args.steps < 2 or min(args.chunk_mb + args.budgets) <= 0:
        print("minipar bench memory: error: --ranks must be positive, --steps at least 2 (the first one "
              "records the trace), and sizes positive", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as folder:
        figures = {"ranks": args.ranks,
                   "messages": measure_messages(args.ranks, args.chunk_mb, args.steps, Path(folder)),
                   "offload": measure_offload(args.budgets, args.steps, Path(folder))}
    print(json.dumps(figures) if args.json else render(figures), flush=True)
    return 0
