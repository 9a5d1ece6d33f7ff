"""`python -m minipar train | plan | schedule | bench` (also the console script `minipar`).

Bad input ends every rank with one line naming the problem and exit code 2, before any collective:
every rank parses and validates the same arguments on its own, so no rank waits for another.
Lesson: lessons/00_overview.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from minipar.core.backend import BACKEND_ENV, name_from_env
from minipar.trainer.arguments import OneLineParser
from minipar.trainer.config import (
    BACKENDS,
    EVICTIONS,
    MODELS,
    OFFLOADS,
    PRECISIONS,
    SCHEDULES,
    TrainConfig,
    validate,
)


def train_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="minipar train", description="Train a model under mpiexec in any layout.")
    d = TrainConfig()
    p.add_argument("--model", choices=MODELS, default=d.model)
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: world / (tp*pp))")
    p.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=d.pp, help="pipeline stages")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=d.zero, help="ZeRO stage")
    p.add_argument("--microbatches", type=int, default=d.microbatches)
    p.add_argument("--schedule", choices=SCHEDULES, default=d.schedule)
    p.add_argument("--precision", choices=PRECISIONS, default=d.precision)
    p.add_argument("--offload", choices=OFFLOADS, default=d.offload)
    p.add_argument("--device-mem-mb", type=float, default=d.device_mem_mb)
    p.add_argument("--chunk-mb", type=float, default=d.chunk_mb)
    p.add_argument("--eviction", choices=EVICTIONS, default=d.eviction, help="offload's eviction policy")
    p.add_argument("--steps", type=int, default=d.steps, help="total steps (a resumed run continues to it)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch (sequences)")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default=d.optimizer)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help=f"array backend (default: ${BACKEND_ENV} if set, else {d.backend})")
    p.add_argument("--n-layer", type=int, default=d.n_layer)
    p.add_argument("--n-head", type=int, default=d.n_head)
    p.add_argument("--d-model", type=int, default=d.d_model)
    p.add_argument("--bucket-mb", type=float, default=d.bucket_mb, help="DDP gradient bucket size")
    p.add_argument("--fused", action="store_true", help="AdamW and GELU through the fusion interpreter")
    p.add_argument("--log", default=None, help="JSON-lines log written by rank 0")
    p.add_argument("--save", default=None, help="checkpoint directory written at the end")
    p.add_argument("--resume", default=None, help="checkpoint directory to continue from")
    p.add_argument("--check-reference", action="store_true",
                   help="also run single-process on rank 0 and report the largest deviation")
    p.add_argument("--quiet", action="store_true")
    return p


def parse_train_args(argv) -> TrainConfig:
    parser = train_parser()
    args = vars(parser.parse_args(argv))
    if args["backend"] is None:  # the flag wins over the environment
        args["backend"] = name_from_env()
        if args["backend"] not in BACKENDS:
            parser.error(f"{BACKEND_ENV}={args['backend']!r} is not one of {', '.join(BACKENDS)}")
    return TrainConfig(**{f.name: args[f.name] for f in dataclasses.fields(TrainConfig) if f.name in args})


def fail(prog: str, message: str) -> int:
    sys.stderr.write(f"{prog}: error: {message}\n")  # one write, so ranks' lines do not interleave
    sys.stderr.flush()
    return 2


def cmd_train(argv) -> int:
    cfg = parse_train_args(argv)
    from mpi4py import MPI

    world_size = MPI.COMM_WORLD.Get_size()
    errors = validate(cfg, world_size)
    if errors:
        return fail("minipar train", "; ".join(errors))
    from minipar.dist.comm import install_excepthook, wait_for_everyone
    from minipar.trainer import loop as train

    install_excepthook()
    train.train(cfg.resolved(world_size))
    wait_for_everyone(MPI.COMM_WORLD)  # e.g. while rank 0 alone runs --check-reference
    return 0


def cmd_plan(argv) -> int:
    from minipar.trainer import commands

    return commands.plan_main(argv)


def cmd_schedule(argv) -> int:
    from minipar.trainer import commands

    return commands.schedule_main(argv)


def cmd_bench(argv) -> int:
    from minipar.bench import run as bench

    return bench.main(argv)


COMMANDS = {"train": cmd_train, "plan": cmd_plan, "schedule": cmd_schedule, "bench": cmd_bench}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        if argv and argv[0] in ("-h", "--help"):
            print(f"usage: minipar {{{','.join(COMMANDS)}}} [options]   (minipar COMMAND --help for details)")
            return 0
        return fail("minipar", f"choose a command: {', '.join(COMMANDS)}")
    return COMMANDS[argv[0]](argv[1:])
