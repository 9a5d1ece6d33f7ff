"""`python -m minipar bench dp`: measured tokens/s of data parallelism, and the bytes it sends.

Runs `python -m minipar train` under `mpiexec -n 1` and `mpiexec -n N` (N = 2 by default) on the
same global batch, reads the JSON-lines logs, and prints for each N: the median tokens/s over the
steps after a warm-up, the speed-up over N = 1, and rank 0's bytes sent per step beside the ring
all-reduce's 2(N-1)/N x gradient bytes. Each N > 1 runs three ways, alternating: DDP's all-reduces
overlapping backward with progress polled from its hooks (the default), the same with MPICH's
progress thread (MPIR_CVAR_ASYNC_PROGRESS=1), and blocking at the step (--no-overlap); with the
median time each step waited on communication (the log's comm_wait_s). To show where the missing
speed-up goes it also times the ceiling: N independent processes at once, each on B/N samples (what
N ranks reach when they share the machine but never wait for each other), and one all-reduce of the
whole gradient on its own: what the communication costs.
Lessons: lessons/03_data_parallel.md, and 03b_data_parallel_appendix.md (the measured tables).

    python -m minipar bench dp [--sizes 1 2] [--steps 20] [--warmup 3] [--repeats 3] [--json] [train options]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from minipar.core.nn import GPT, MLPNet
from minipar.trainer.arguments import parse_train_args
from minipar.trainer.build import model_config
from minipar.trainer.launch import run_mpi, run_train, run_train_concurrently
from minipar_lab.bench.table import right_aligned
from minipar_lab.bench.timing import SPREAD, Progress, median, median_seconds, plus_minus, spread

DEFAULT_TRAIN_ARGS = ["--batch-size", "32"]


def all_reduce_seconds(nbytes: int, repeats: int = 20) -> float:
    """Under mpiexec: the median seconds of one all-reduce of `nbytes` over COMM_WORLD, the slowest
    rank's; a barrier before each, so that no rank's time includes waiting for the others to arrive."""
    from mpi4py import MPI

    from minipar.distributed.communicator import Comm

    comm, buffer = Comm(MPI.COMM_WORLD), np.ones(nbytes // 8)
    seconds = median_seconds(lambda: comm.all_reduce(buffer), repeats, before=comm.barrier)
    return comm.allreduce_obj(seconds, op="max")


def watched_and_blocking_seconds(nbytes: int, rounds: int = 15, repeats: int = 20) -> tuple[float, float]:
    """Under mpiexec: the median seconds of one MPI Allreduce of `nbytes` inside the watchdog's context
    (distributed/watchdog.py, as Comm runs every collective) and alone, in alternating rounds
    so that a change in the machine's load hits both alike; the slowest rank's medians."""
    from mpi4py import MPI

    from minipar.distributed.communicator import Comm

    comm, buffer = Comm(MPI.COMM_WORLD), np.ones(max(1, nbytes // 8))
    received = np.empty_like(buffer)

    def watched_all_reduce():
        with comm.watch("all_reduce"):
            comm.mpi.Allreduce(buffer, received)

    watched, blocking = [], []
    for _ in range(rounds):
        watched.append(median_seconds(watched_all_reduce, repeats, before=comm.mpi.Barrier))
        blocking.append(median_seconds(lambda: comm.mpi.Allreduce(buffer, received), repeats,
                                       before=comm.mpi.Barrier))
    return comm.allreduce_obj(median(watched), op="max"), comm.allreduce_obj(median(blocking), op="max")


def gradient_bytes(train_args: list[str]) -> int:
    """Bytes of one full gradient: every parameter of the model, in the training dtype."""
    cfg = parse_train_args(train_args)
    model = (GPT if cfg.model == "gpt" else MLPNet)(model_config(cfg), seed=None)
    return sum(p.data.nbytes for p in model.parameters())


ASYNC_PROGRESS = {"MPIR_CVAR_ASYNC_PROGRESS": "1"}  # MPICH: a thread per rank drives MPI's progress
WAYS = {  # how DDP's all-reduces run: (extra train arguments, extra environment)
    "overlap": ([], {}),
    "async": ([], ASYNC_PROGRESS),
    "blocking": (["--no-overlap"], {}),
}


def measure(sizes: list[int], steps: int, warmup: int, repeats: int, train_args: list[str]) -> dict:
    args = [*train_args, "--steps", str(steps)]
    batch = parse_train_args(args).batch_size
    grad_bytes = gradient_bytes(args)
    # the records after warm-up of every repeat, and the all-reduce probe's times
    kept: dict[tuple, list] = {(kind, n): [] for kind in (*WAYS, "ceiling", "all_reduce") for n in sizes}
    progress = Progress("dp", repeats * sum(1 if n == 1 else len(WAYS) + 2 for n in sizes))
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(repeats):  # interleaved: a change in the machine's load hits every run alike
            for n in sizes:
                for way, (extra_args, extra_env) in WAYS.items() if n > 1 else [("overlap", ([], {}))]:
                    progress(f"dp={n} {way if n > 1 else 'one process'} (repeat {repeat + 1})")
                    log = Path(folder) / f"{way}.jsonl"
                    kept[way, n] += run_train(n, [*args, *extra_args], log, extra_env)[warmup:]
                if n > 1:
                    progress(f"dp={n} ceiling: {n} independent processes (repeat {repeat + 1})")
                    share = [*args, "--batch-size", str(batch // n)]
                    for records in run_train_concurrently(n, share, Path(folder)):
                        kept["ceiling", n] += records[warmup:]
                    progress(f"dp={n} one all-reduce of the gradient (repeat {repeat + 1})")
                    probe = ["-m", "minipar_lab.bench.dp", "--all-reduce-seconds", str(grad_bytes)]
                    kept["all_reduce", n].append(float(run_mpi(n, probe)))
    rows = [size_row(n, kept, grad_bytes) for n in sizes]
    base = rows[0]
    for row in rows:
        for way in WAYS:
            row[f"{way}_speedup"] = row[f"{way}_tokens_per_s"] / base["tokens_per_s"]
        row["speedup"] = row["overlap_speedup"]
        row["ceiling_speedup"] = base["step_s"] / row["ceiling_step_s"]
        row["buckets"] = row["messages_per_step"] // (2 * (row["dp"] - 1)) if row["dp"] > 1 else 0
    return {"train_args": args, "global_batch": batch, "gradient_bytes": grad_bytes, "repeats": repeats,
            "rows": rows}


def size_row(n: int, kept: dict, grad_bytes: int) -> dict:
    """The medians of one data-parallel size; at N = 1 every way is the one plain run."""
    records = kept["overlap", n]
    (tokens, tokens_spread), (step, step_spread) = (spread(records, lambda r: r["tokens_per_s"]),
                                                    spread(records, lambda r: r["time_s"]))
    all_reduce, all_reduce_spread = spread(kept["all_reduce", n]) if n > 1 else (0.0, 0.0)
    row = {
        "dp": n,
        "tokens_per_s": tokens,
        "tokens_per_s_spread": tokens_spread,  # half the interquartile range, over steps and repeats
        "step_s": step,
        "step_s_spread": step_spread,
        "ceiling_step_s": median(kept["ceiling", n] or records, lambda r: r["time_s"]),
        "all_reduce_s": all_reduce,
        "all_reduce_s_spread": all_reduce_spread,
        "sent_bytes_per_step": int(median(records, lambda r: r["comm"]["sent_bytes"])),
        "messages_per_step": int(median(records, lambda r: r["comm"]["messages"])),
        "ring_formula_bytes": 2 * (n - 1) * grad_bytes / n,
    }
    for way in WAYS:
        runs = kept[way, n] or records
        row[f"{way}_tokens_per_s"] = median(runs, lambda r: r["tokens_per_s"])
        row[f"{way}_comm_wait_s"] = median(runs, lambda r: r.get("comm_wait_s", 0.0))  # none at dp=1
    return row


COLUMNS = [  # (header, how to show a row's figure)
    ("dp", lambda r: r["dp"]),
    ("tokens/s", lambda r: plus_minus(r["tokens_per_s"], r["tokens_per_s_spread"], digits=0)),
    ("overlap", lambda r: f"{r['overlap_speedup']:.2f}x"),
    ("async", lambda r: f"{r['async_speedup']:.2f}x"),
    ("blocking", lambda r: f"{r['blocking_speedup']:.2f}x"),
    ("ceiling", lambda r: f"{r['ceiling_speedup']:.2f}x"),
    ("step ms", lambda r: plus_minus(r["step_s"], r["step_s_spread"], 1e3)),
    ("wait ms o/a/b", lambda r: "/".join(f"{r[f'{way}_comm_wait_s'] * 1e3:.1f}" for way in WAYS)),
    ("all-reduce G ms", lambda r: plus_minus(r["all_reduce_s"], r["all_reduce_s_spread"], 1e3, 2)),
    ("sent B/step", lambda r: r["sent_bytes_per_step"]),
    ("2(N-1)/N*grad B", lambda r: f"{r['ring_formula_bytes']:.0f}"),
    ("messages", lambda r: r["messages_per_step"]),
    ("buckets", lambda r: r["buckets"]),
]


def render(figures: dict, warmup: int) -> str:
    return "\n".join(
        [f"minipar train {' '.join(figures['train_args'])}",
         f"same global batch of {figures['global_batch']} for every dp; medians over {figures['repeats']} "
         f"interleaved runs of each, after {warmup} warm-up steps; a ± b: {SPREAD}",
         f"gradient bytes {figures['gradient_bytes']}"]
        + right_aligned(figures["rows"], COLUMNS)
        + ["speed-ups over dp=1 of DDP's three ways: overlap (all-reduces start in backward, progress "
           "polled from its hooks),",
           "  async (the same, with MPICH's progress thread: MPIR_CVAR_ASYNC_PROGRESS=1), blocking "
           "(--no-overlap: every bucket at the step)",
           "ceiling: dp independent processes at once, each on B/dp samples (no waiting on each other)",
           "wait ms o/a/b: the median comm_wait_s of a step (time blocked in MPI), overlap/async/blocking",
           "tokens/s, step ms, sent, messages: the overlap runs",
           "all-reduce G: one all-reduce of the whole gradient alone (a separate run, median of 20)"])


def main(argv) -> int:
    p = argparse.ArgumentParser(prog="minipar bench dp", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2], help="data-parallel sizes, starting at 1")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="steps of each run left out of the medians")
    p.add_argument("--repeats", type=int, default=3, help="runs of each size, interleaved")
    p.add_argument("--json", action="store_true")
    args, train_args = p.parse_known_args(argv)
    train_args = train_args or DEFAULT_TRAIN_ARGS
    batch = parse_train_args(train_args).batch_size
    sizes_fit = args.sizes[0] == 1 and all(n >= 1 and batch % n == 0 for n in args.sizes)
    if not sizes_fit or args.steps <= args.warmup or args.repeats < 1:
        print(f"minipar bench dp: error: --sizes must start at 1 and divide the batch {batch}, "
              f"--steps must exceed --warmup, and --repeats must be positive", file=sys.stderr)
        return 2
    figures = measure(args.sizes, args.steps, args.warmup, args.repeats, train_args)
    print(json.dumps(figures) if args.json else render(figures, args.warmup), flush=True)
    return 0


if __name__ == "__main__":  # the all-reduce probe that measure() launches under mpiexec
    if sys.argv[1:2] == ["--watched-and-blocking"]:  # the watchdog's cost: lessons/12_reliability.md
        times = watched_and_blocking_seconds(int(sys.argv[2]))
        from mpi4py import MPI

        if MPI.COMM_WORLD.rank == 0:
            print(json.dumps({"bytes": int(sys.argv[2]), "watched_s": times[0], "blocking_s": times[1]}))
    elif sys.argv[1:2] == ["--all-reduce-seconds"]:
        seconds = all_reduce_seconds(int(sys.argv[2]))
        from mpi4py import MPI

        if MPI.COMM_WORLD.rank == 0:
            print(seconds)
