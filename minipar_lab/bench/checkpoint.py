"""`python -m minipar bench checkpoint`: what `--save-async` hides of a periodic checkpoint's cost.

One process trains the GPT of `minipar train` three ways, each its own trainer: no saving, a
synchronous save after every step (`--save DIR --save-every 1`) and an asynchronous one (the same with
`--save-async`). A save writes every parameter with its AdamW moments (checkpoint/sharded.py: an .npz,
its SHA-256, fsync, rename, then the manifest), so at a wide model with few tokens a step the save costs
a good part of the step. A round times a few consecutive steps of each way in turn (timing.py
`round_times`, alternating, shuffled): the step, its save boundary (the commit of the save in flight,
then the next save: written, or copied and handed to the writer thread), so that an asynchronous save's
writer overlaps the steps after it as it does in training. Before each timed run the last writer is
waited for, untimed, so no way's steps run beside another way's writer. The table: the median step of
each way and its cost over no saving, as the median of the per-round ratios.

What the asynchronous save still pays on the main thread: the copy of the state, the agreement and the
commit; and its writer needs a core that the step does not use.
Lesson: lessons/12_reliability.md.

    python -m minipar bench checkpoint [--d-model 256] [--n-layer 4] [--seq-len 16] [--batch 4]
        [--steps-per-round 4] [--repeats 5] [--folder DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
from mpi4py import MPI

from minipar.checkpoint import sharded as checkpoint
from minipar.trainer.config import TrainConfig
from minipar.trainer.loop import Trainer
from minipar_lab.bench.table import right_aligned
from minipar_lab.bench.timing import SPREAD, plus_minus, round_times, spread

MODES = {"none": {}, "sync": {"save_every": 1}, "async": {"save_every": 1, "save_async": True}}


def trainers(cfg: TrainConfig, folder: Path) -> dict[str, Trainer]:
    """One trainer per way of saving, each with its own save folder."""
    return {mode: Trainer(cfg.replace(save=str(folder / mode) if options else None, **options).resolved(1),
                          MPI.COMM_SELF)
            for mode, options in MODES.items()}


def steps_of(trainer: Trainer, count: int) -> Callable:
    """`count` more training steps of `trainer`, each with its save boundary, as the training loop runs
    them (loop.py `train_and_save`)."""
    next_step = [0]

    def run_steps() -> None:
        for _ in range(count):
            step = next_step[0]
            trainer.records.append(trainer.step(step))
            trainer.periodic_save(step + 1)
            next_step[0] = step + 1

    return run_steps


def checkpoint_figures(d_model: int, n_layer: int, seq_len: int, batch: int, steps_per_round: int,
                       repeats: int, folder: Path) -> dict:
    """Median seconds a step (with its save) of each way; the ways' costs over no saving."""
    steps = (repeats + 1) * steps_per_round + 1  # the warm-up and every round, none of them the last step
    cfg = TrainConfig(n_layer=n_layer, d_model=d_model, n_head=max(1, d_model // 64), seq_len=seq_len,
                      batch_size=batch, steps=steps, quiet=True)
    ways = trainers(cfg, folder)

    def writers_done() -> None:
        for trainer in ways.values():
            if trainer.pending_save is not None and trainer.pending_save.thread is not None:
                trainer.pending_save.thread.join()

    try:
        times = round_times({mode: steps_of(t, steps_per_round) for mode, t in ways.items()}, repeats,
                            before=writers_done)
        for trainer in ways.values():
            checkpoint.finish_save(trainer.pending_save, trainer.engine, wait=True)
    finally:
        for trainer in ways.values():
            trainer.memory.close()
    rows = []
    for mode in MODES:
        step_s, step_spread = spread(times[mode] / steps_per_round)
        rows.append({"mode": mode, "step_ms": 1e3 * step_s, "step_ms_spread": 1e3 * step_spread,
                     "over_none": float(np.median(times[mode] / times["none"])) - 1})
    saved = sorted((folder / "sync").glob("step-*"))
    return {"config": {"d_model": d_model, "n_layer": n_layer, "seq_len": seq_len, "batch": batch,
                       "steps_per_round": steps_per_round, "repeats": repeats},
            "checkpoint_bytes": sum(p.stat().st_size for p in saved[-1].iterdir()) if saved else 0,
            "modes": rows}


def main(argv) -> int:
    parser = argparse.ArgumentParser(prog="minipar bench checkpoint")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps-per-round", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--folder", type=Path, default=None, help="where the checkpoints go (a temporary "
                                                                  "folder by default)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        figures = checkpoint_figures(args.d_model, args.n_layer, args.seq_len, args.batch,
                                     args.steps_per_round, args.repeats, Path(folder))
    if args.json:
        json.dump(figures, sys.stdout)
        print()
        return 0
    print(f"GPT d_model {args.d_model}, {args.n_layer} layers, seq {args.seq_len}, batch {args.batch}, fp32, "
          f"one process; checkpoint {figures['checkpoint_bytes'] / 2**20:.1f} MiB; median of {args.repeats} "
          f"alternating rounds of {args.steps_per_round} steps ({SPREAD})")
    names = {"none": "no saving", "sync": "--save-every 1", "async": "--save-every 1 --save-async"}
    columns = [("saving", lambda r: names[r["mode"]]),
               ("step", lambda r: f"{plus_minus(r['step_ms'], r['step_ms_spread'])} ms"),
               ("over no saving", lambda r: f"{100 * r['over_none']:+.1f}%")]
    print("\n".join(right_aligned(figures["modes"], columns)))
    return 0
