"""`python -m minipar bench checkpoint`: what `--save-async` hides of a periodic checkpoint's cost.

One process trains the GPT of `minipar train` three ways, each its own trainer: no saving, a synchronous
save every K steps (`--save DIR --save-every K`) and an asynchronous one (the same with `--save-async`).
A save writes every parameter with its AdamW moments (checkpoint/sharded.py: an .npz, its SHA-256,
fsync, rename, then the manifest), so at a wide model with few tokens a step the save costs a good part
of the step. A round times a few consecutive steps of each way in turn (timing.py `round_times`,
alternating, shuffled), as the training loop runs them: a round opens with a save's boundary (K divides
the round's steps), each step follows its boundary (the stage of the save in flight moved on, a save
started every K steps), and the round ends with the wait for its last save, timed: the wait the next
round's first boundary would make. So every save a round starts is paid for in that round, after K steps
to hide behind, as in a run, and no writer runs beside another way's steps. The table: the median step
of each way and its cost over no saving, as the median of the per-round ratios.

What the asynchronous save still pays on the training thread: the copy of the state, the collectives of
the boundaries and the hand-over to the writer thread; beside it, the writer needs CPU (CRC, hash, page-
cache copies, fsync, unlinks) and the GIL a little. With OPENBLAS_NUM_THREADS=1 the step keeps one core,
as a rank of `minipar train` does (it stands for one device), and the writer may have the other; with K
= 1 a save's writing has no step to hide behind that the next save does not wait for.
Lesson: lessons/12_reliability.md.

    python -m minipar bench checkpoint [--d-model 256] [--n-layer 4] [--seq-len 16] [--batch 4]
        [--save-every 1] [--steps-per-round 4] [--repeats 5] [--folder DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
from mpi4py import MPI

from minipar.checkpoint import sharded as checkpoint
from minipar.trainer.config import TrainConfig
from minipar.trainer.loop import Trainer
from minipar_lab.bench.table import right_aligned
from minipar_lab.bench.timing import SPREAD, plus_minus, round_times, spread

def modes(every: int) -> dict[str, dict]:
    return {"none": {}, "sync": {"save_every": every}, "async": {"save_every": every, "save_async": True}}


def trainers(cfg: TrainConfig, folder: Path, every: int = 1) -> dict[str, Trainer]:
    """One trainer per way of saving, each with its own save folder."""
    return {mode: Trainer(cfg.replace(save=str(folder / mode) if options else None, **options).resolved(1),
                          MPI.COMM_SELF)
            for mode, options in modes(every).items()}


def steps_of(trainer: Trainer, count: int) -> Callable:
    """`count` more training steps of `trainer`, each after its step boundary as the training loop runs
    them (loop.py `train_and_save`: the save in flight moved on, a save every K steps), then the wait
    for the save in flight, which the next boundary, a save's, would make."""
    next_step = [0]

    def run_steps() -> None:
        for _ in range(count):
            step = next_step[0]
            if step:  # the boundary after `step` steps: none before the first
                trainer.periodic_save(step)
            trainer.records.append(trainer.step(step))
            next_step[0] = step + 1
        trainer.pending_save = checkpoint.finish_save(trainer.pending_save, trainer.engine, wait=True)

    return run_steps


def with_cpu(work: Callable, seconds: list) -> Callable:
    """work, noting the CPU seconds of each run: (this thread's, the other threads' of the process: the
    writer's, and BLAS's where it has more than one thread). Unlike the step's time, they hardly move
    with the machine's load: what a save costs the training thread, and what it needs of another core."""
    def run() -> None:
        main, process = time.thread_time(), time.process_time()
        work()
        main = time.thread_time() - main
        seconds.append((main, time.process_time() - process - main))

    return run


def checkpoint_figures(d_model: int, n_layer: int, seq_len: int, batch: int, every: int, steps_per_round: int,
                       repeats: int, folder: Path) -> dict:
    """Median seconds a step (with its save) of each way; the ways' costs over no saving."""
    steps = (repeats + 1) * steps_per_round + 1  # the warm-up and every round, none of them the last step
    cfg = TrainConfig(n_layer=n_layer, d_model=d_model, n_head=max(1, d_model // 64), seq_len=seq_len,
                      batch_size=batch, steps=steps, quiet=True)
    ways = trainers(cfg, folder, every)
    cpu: dict[str, list] = {mode: [] for mode in ways}
    try:
        times = round_times({mode: with_cpu(steps_of(t, steps_per_round), cpu[mode])
                             for mode, t in ways.items()}, repeats)
    finally:
        for trainer in ways.values():
            trainer.memory.close()
    rows = []
    for mode in ways:
        step_s, step_spread = spread(times[mode] / steps_per_round)
        main_s, other_s = np.median(np.array(cpu[mode][1:]), axis=0) / steps_per_round  # [0]: the warm-up
        rows.append({"mode": mode, "step_ms": 1e3 * step_s, "step_ms_spread": 1e3 * step_spread,
                     "over_none": float(np.median(times[mode] / times["none"])) - 1,
                     "main_cpu_ms": 1e3 * main_s, "other_cpu_ms": 1e3 * other_s})
    saved = sorted((folder / "sync").glob("step-*"))
    return {"config": {"d_model": d_model, "n_layer": n_layer, "seq_len": seq_len, "batch": batch,
                       "save_every": every, "steps_per_round": steps_per_round, "repeats": repeats},
            "checkpoint_bytes": sum(p.stat().st_size for p in saved[-1].iterdir()) if saved else 0,
            "modes": rows}


def main(argv) -> int:
    parser = argparse.ArgumentParser(prog="minipar bench checkpoint")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--save-every", type=int, default=1, help="K: the saving ways save every K steps")
    parser.add_argument("--steps-per-round", type=int, default=4, help="a multiple of K")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--folder", type=Path, default=None, help="where the checkpoints go (a temporary "
                                                                  "folder by default)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.save_every < 1 or args.steps_per_round < 1 or args.steps_per_round % args.save_every:
        parser.error("--steps-per-round must be a positive multiple of --save-every (each round saves "
                     "as often)")
    load = os.getloadavg()[0]  # the step's time moves with it, the CPU columns hardly
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        figures = checkpoint_figures(args.d_model, args.n_layer, args.seq_len, args.batch,
                                     args.save_every, args.steps_per_round, args.repeats, Path(folder))
    figures["load_average"] = [load, os.getloadavg()[0]]
    if args.json:
        json.dump(figures, sys.stdout)
        print()
        return 0
    print(f"GPT d_model {args.d_model}, {args.n_layer} layers, seq {args.seq_len}, batch {args.batch}, fp32, "
          f"one process; checkpoint {figures['checkpoint_bytes'] / 2**20:.1f} MiB; median of {args.repeats} "
          f"alternating rounds of {args.steps_per_round} steps ({SPREAD}); load average "
          f"{load:.2f} at the start, {figures['load_average'][1]:.2f} at the end")
    every = f"--save-every {args.save_every}"
    names = {"none": "no saving", "sync": every, "async": f"{every} --save-async"}
    columns = [("saving", lambda r: names[r["mode"]]),
               ("step", lambda r: f"{plus_minus(r['step_ms'], r['step_ms_spread'])} ms"),
               ("over no saving", lambda r: f"{100 * r['over_none']:+.1f}%"),
               ("CPU: training thread", lambda r: f"{r['main_cpu_ms']:.1f} ms"),
               ("other threads", lambda r: f"{r['other_cpu_ms']:.1f} ms")]
    print("\n".join(right_aligned(figures["modes"], columns)))
    return 0
