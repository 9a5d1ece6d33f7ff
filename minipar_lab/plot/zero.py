"""ZeRO: model-state bytes per rank against the data-parallel size N, for stages 0-3: what the memory
ledger of a real run records (one `mpiexec -n N` launch per N, all four stages in it, rank 0's `mem`),
and the paper's formulas as lines (memory/planner.py; Rajbhandari et al. 2020, section 5):

    stage 0 (p+g+K)Ψ    stage 1 (p+g)Ψ + KΨ/N    stage 2 pΨ + (g+K)Ψ/N    stage 3 (p+g+K)Ψ/N

with fp64 Adam's p = g = 8 and K = 16 bytes per parameter.

    python -m minipar plot zero [--sizes 1 2 4 8] [--out DIR]
Lesson: lessons/04_zero.md.
"""

from __future__ import annotations

import json
import sys
from fractions import Fraction
from pathlib import Path

from minipar.memory import planner
from minipar.memory.ledger import model_states
from minipar.trainer.build import build_model
from minipar.trainer.config import TrainConfig
from minipar.trainer.launch import run_mpi
from minipar_lab.bench import canvas

FILE = "04_zero_memory.png"
MODEL = dict(precision="fp64", n_layer=2, n_head=2, d_model=32, seq_len=8, batch_size=8)  # small: 8 ranks
FP64_ADAM = dict(k=16, param_bytes=8, grad_bytes=8)


def add_arguments(p) -> None:
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8], help="data-parallel sizes N")


def parameters() -> int:
    """Ψ of the model measured."""
    return sum(p.data.size for p in build_model(TrainConfig(**MODEL), None).parameters())


def formula_bytes(psi: int, sizes: list[int]) -> dict[int, list[Fraction]]:
    """Per stage, the model-state bytes per rank at each N by the paper's formula (fp64 Adam)."""
    return {stage: [planner.model_state_bytes(psi, n, stage, **FP64_ADAM) for n in sizes]
            for stage in planner.STAGES}


def measured_bytes(sizes: list[int]) -> dict[int, list[int]]:
    """Per stage, rank 0's model-state bytes after one step at each N (one launch per N)."""
    by_size = [json.loads(run_mpi(n, ["-m", "minipar_lab.plot.zero", "--ledgers"])) for n in sizes]
    return {stage: [model_states(ledgers[str(stage)]) for ledgers in by_size] for stage in planner.STAGES}


def ledgers() -> None:
    """Under mpiexec: one step at every stage; rank 0 prints {stage: mem}."""
    from mpi4py import MPI

    from minipar.trainer import loop

    world = MPI.COMM_WORLD
    runs = {stage: TrainConfig(**MODEL, dp=world.size, zero=stage, steps=1, quiet=True)
            for stage in planner.STAGES}
    mem = {stage: loop.train(cfg, world)[0]["mem"] for stage, cfg in runs.items()}
    if world.rank == 0:
        print(json.dumps(mem))


def draw(args, path: Path) -> None:
    sizes = sorted(args.sizes)
    if sizes[0] < 1 or any(MODEL["batch_size"] % n for n in sizes):
        raise ValueError(f"--sizes must divide the batch of {MODEL['batch_size']}")
    psi, measured = parameters(), measured_bytes(sizes)
    dense = list(range(1, max(sizes) + 1))
    lines = formula_bytes(psi, dense)
    plt = canvas.pyplot()
    figure, ax = plt.subplots(figsize=(6.5, 4.5))
    for stage in planner.STAGES:
        line, = ax.plot(dense, [float(b) / 2**20 for b in lines[stage]], "-", alpha=0.6,
                        label=f"stage {stage}: {planner.PARTITIONED[stage]} (formula)")
        ax.plot(sizes, [b / 2**20 for b in measured[stage]], "o", color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set(xlabel="data-parallel ranks N", ylabel="model states per rank (MiB)",
           title=f"ZeRO, Ψ = {psi:,} fp64 parameters, Adam\nmemory ledger (dots), formula (lines)")
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    canvas.save(figure, path)


if __name__ == "__main__" and sys.argv[1:] == ["--ledgers"]:
    ledgers()
