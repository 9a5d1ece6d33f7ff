"""`python -m minipar bench simulate`: the cost model of `minipar simulate` on this machine, against
measured `minipar train` steps (lesson 14, lessons/14_simulate.md).

Calibration: the achieved FLOP/s and a fixed cost per block and pass (Python's, whatever the
matrices' size: splitting the work over tp or dp ranks does not divide it) from one rank's median
step at two batch sizes (16 and 4), and the alpha-beta of an MPI all-reduce on 2 ranks (the
median time of an 8-byte and a 1 MiB all-reduce). Then each layout runs for real (`--steps 6`, the
median step after the first) and is predicted with a machine of os.cpu_count() cores: ranks beyond
the cores time-share them. Options: --steps N (default 6). `--plot FILE` instead draws Narayanan et
al.'s Table 1 and their ZeRO-3 comparison, published against predicted (needs matplotlib, the `viz`
extra): lessons/figures/14_simulate.png.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from minipar.simulate import presets
from minipar.simulate.machines import Machine
from minipar.simulate.model import ModelShape, hardware_flops
from minipar.simulate.step import Layout, simulate_step
from minipar.trainer.launch import run_mpi, run_train
from minipar.trainer.tasks import ALPHABET
from minipar_lab.bench import canvas
from minipar_lab.bench.timing import SPREAD, Progress, plus_minus, spread

MODEL = ModelShape(n_layer=4, d_model=64, n_head=4, seq_len=32, vocab=len(ALPHABET))  # train's default GPT
BATCH = 16
LAYOUTS = [  # (train flags, the simulator's layout)
    (["--dp", "2"], dict(dp=2)),
    (["--tp", "2"], dict(tp=2)),
    (["--pp", "2", "--microbatches", "4", "--schedule", "1f1b"], dict(pp=2, microbatches=4)),
    (["--dp", "2", "--zero", "2"], dict(dp=2, zero=2)),
    (["--dp", "4"], dict(dp=4)),
    (["--dp", "2", "--tp", "2"], dict(dp=2, tp=2)),
    (["--tp", "2", "--pp", "2", "--microbatches", "4", "--schedule", "1f1b"],
     dict(tp=2, pp=2, microbatches=4)),
    (["--dp", "8"], dict(dp=8)),
]
ALLREDUCE_PROBE = """
import json, time, numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
def seconds(n):
    a, out, times = np.ones(n), np.empty(n), []
    for _ in range(60):
        comm.Barrier(); t = time.perf_counter(); comm.Allreduce(a, out); times.append(time.perf_counter() - t)
    return sorted(times[10:])[len(times[10:]) // 2]
small, big = seconds(1), seconds(131072)
if comm.rank == 0:
    print(json.dumps({"small_s": small, "big_s": big, "big_bytes": 131072 * 8}))
"""


def step_times(ranks: int, flags: list[str], steps: int) -> tuple[float, float]:
    """The median step time after the first, and its spread (half the interquartile range)."""
    with tempfile.TemporaryDirectory() as folder:
        records = run_train(ranks, ["--steps", str(steps), *flags], Path(folder) / "log.jsonl")
    return spread([r["time_s"] for r in records[1:]])


def step_seconds(ranks: int, flags: list[str], steps: int) -> float:
    return step_times(ranks, flags, steps)[0]


def local_machine(steps: int) -> Machine:
    # one rank at two batch sizes: step = 3 (FLOPs / rate + L x overhead), two equations, two unknowns
    full, quarter = step_seconds(1, [], steps), step_seconds(1, ["--batch-size", str(BATCH // 4)], steps)
    flops_full, flops_quarter = hardware_flops(MODEL, BATCH), hardware_flops(MODEL, BATCH // 4)
    achieved = (flops_full - flops_quarter) / max(full - quarter, 1e-9)
    overhead = max(0.0, (full / 3 - flops_full / 3 / achieved) / MODEL.n_layer)
    one_rank = full
    probe = json.loads(run_mpi(2, ["-c", ALLREDUCE_PROBE]))
    latency = probe["small_s"] / 2  # 2(N-1) = 2 messages on 2 ranks
    bandwidth = probe["big_bytes"] / max(probe["big_s"] - probe["small_s"], 1e-9)  # 2(N-1)/N·S = S bytes
    print(f"calibration: 1 rank {one_rank * 1e3:.1f} ms/step (batch {BATCH}), {quarter * 1e3:.1f} ms "
          f"(batch {BATCH // 4}): {achieved / 1e9:.2f} GFLOP/s, {overhead * 1e3:.2f} ms per block and pass; "
          f"MPI all-reduce latency {latency * 1e6:.0f} us/message, {bandwidth / 1e9:.2f} GB/s; "
          f"{os.cpu_count()} cores")
    return Machine("local-cpu", achieved, 1.0, 10**12, gpus_per_node=64, intra_bandwidth=bandwidth,
                   intra_latency=latency, cores=os.cpu_count(), block_overhead=overhead)


def save_plot(path: str) -> str:
    """Two panels: Table 1's TFLOP/s per GPU by model size, and ZeRO-3 against 3D by GPU count."""
    plt = canvas.pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = presets.table1()
    sizes = [r["params_b"] for r in rows]
    left.plot(sizes, [r["published"] for r in rows], "o-", label="published (Narayanan et al. 2021)")
    left.plot(sizes, [r["predicted"] for r in rows], "s--", label="minipar simulate")
    left.set(xscale="log", xlabel="parameters (billions)", ylabel="TFLOP/s per A100",
             title="Table 1: weak scaling, 32 to 3072 GPUs", ylim=(0, 180))
    for scheme, marker in (("zero-3", "o"), ("ptd-p", "s")):
        mine = [r for r in presets.zero3_comparison() if r["scheme"] == scheme]
        gpus = [r["gpus"] for r in mine]
        right.plot(gpus, [r["published"] for r in mine], marker + "-", label=f"{scheme} published")
        right.plot(gpus, [r["predicted"] for r in mine], marker + "--", label=f"{scheme} predicted")
    right.set(xscale="log", xlabel="GPUs", ylabel="TFLOP/s per A100", title="175B: ZeRO-3 against 3D",
              ylim=(0, 180))
    for ax in (left, right):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    canvas.save(figure, path, dpi=80)
    return f"plot: {path}"


def main(argv) -> int:
    if "--plot" in argv:
        print(save_plot(argv[argv.index("--plot") + 1]))
        return 0
    steps = int(argv[argv.index("--steps") + 1]) if "--steps" in argv else 6
    machine = local_machine(steps)
    print("default GPT (4 layers, d_model 64, seq 32, batch 16, fp32); median step after the first")
    print(f"measured ms: {SPREAD} over the steps")
    print(f"{'layout':<52}{'ranks':>6}{'measured ms':>16}{'predicted ms':>14}{'error':>8}")
    progress = Progress("simulate", len(LAYOUTS))
    for flags, fields in LAYOUTS:
        layout = Layout(BATCH, precision="fp32", **fields)
        progress(" ".join(flags))
        measured, measured_spread = step_times(layout.gpus, flags, steps)
        predicted = simulate_step(MODEL, layout, machine)["step_s"]
        shown = plus_minus(measured, measured_spread, 1e3)
        print(f"{' '.join(flags):<52}{layout.gpus:>6}{shown:>16}{predicted * 1e3:>14.1f}"
              f"{predicted / measured - 1:>+8.0%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
