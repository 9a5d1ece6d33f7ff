"""`python -m minipar bench gpu`: the same GPT on CuPy and on NumPy, and the fused kernels on a GPU.

Three measurements, one process, one GPU:
1. agreement: the default GPT trains a few steps on each backend from the same weights and data;
   the per-step losses must agree to a relative 1e-9 in fp64 and 1e-5 in fp32 (the GPU sums in
   another order, nothing else differs). Also with `--fused` (GELU and AdamW as generated kernels).
2. step time: median training step on each backend (the first step, which compiles kernels, is
   left out), for the default GPT and a wider one, and their ratio measured in the same run.
3. fused kernels: an 8-operation elementwise chain and the AdamW update over 2**24 float32 values,
   as NumPy runs them (one operation at a time), on the GPU one kernel per operation, and on the GPU
   as the one fused kernel that minipar.fusion.codegen generates.
Without CuPy or a GPU it prints why, on one line, and exits 2. Exit 1 if the losses disagree.
Lesson: lessons/11_gpu.md.

    python -m minipar bench gpu [--steps 6] [--size 16777216] [--repeats 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from minipar.core import backend, optim
from minipar.fusion import training as fused_training
from minipar.fusion.interpret import run
from minipar.fusion.ir import array
from minipar.trainer import loop as train
from minipar.trainer.config import TrainConfig
from minipar.trainer.reference import loss_deviation
from minipar_lab.bench import fusion as fusion_bench
from minipar_lab.bench.timing import SPREAD, plus_minus, round_times, spread

TOLERANCE = {"fp64": 1e-9, "fp32": 1e-5}
WIDE = dict(n_layer=4, n_head=8, d_model=256, batch_size=32, seq_len=64)  # enough work for a GPU


def train_on(cfg: TrainConfig) -> dict:
    """Records, losses, step times and final weights of a single-process run of cfg (rank 0's view)."""
    from mpi4py import MPI

    trainer = train.Trainer(cfg.replace(dp=1, tp=1, pp=1, quiet=True, log=None), MPI.COMM_SELF)
    records = trainer.run()
    return {"records": records, "losses": [r["loss"] for r in records],
            "step_s": [r["time_s"] for r in records], "state": trainer.full_state()}


def deviation(run: dict, reference: dict) -> dict:
    """Largest relative deviation of the losses (reference.loss_deviation, over every step), and of the
    weights (each tensor's largest error over its largest magnitude, train.relative_deviation), as
    train.compare_with_reference judges them."""
    losses = loss_deviation(run["records"], reference["losses"], len(reference["losses"]))
    weights = max(train.relative_deviation(run["state"][name], ref)
                  for name, ref in reference["state"].items() if ref.size)
    return {"loss": losses, "weight": weights}


def step_ms(run: dict) -> tuple[float, float]:
    """The median step in milliseconds after step 0 (which compiles kernels), and its spread."""
    middle, half_range = spread(run["step_s"][1:] or run["step_s"])
    return 1e3 * middle, 1e3 * half_range


def compare_backends(cfg: TrainConfig) -> dict:
    """Train cfg on NumPy and on CuPy; the deviation of CuPy's losses and both step times."""
    on_numpy = train_on(cfg.replace(backend="numpy"))
    on_cupy = train_on(cfg.replace(backend="cupy"))
    backend.set_backend("numpy")
    return {"precision": cfg.precision, "fused": cfg.fused, "deviation": deviation(on_cupy, on_numpy),
            "tolerance": TOLERANCE[cfg.precision],
            **dict(zip(("numpy_ms", "numpy_ms_spread"), step_ms(on_numpy))),
            **dict(zip(("cupy_ms", "cupy_ms_spread"), step_ms(on_cupy)))}


def median_ms(work, repeats: int, sync) -> tuple[float, float]:
    """Median milliseconds of work(), device work included (sync waits for it), after one untimed
    warm-up that compiles the kernels, and their spread (half the interquartile range)."""
    middle, half_range = spread(round_times({"work": work}, repeats, sync)["work"])
    return 1e3 * middle, 1e3 * half_range


def fused_kernel_times(size: int, repeats: int) -> dict:
    """Milliseconds of the chain and of AdamW (NumPy, the GPU one kernel per op, the GPU fused): medians
    under "ms", their spreads under "ms_spread"."""
    cupy = backend.set_backend("cupy").xp
    sync = backend.current().sync
    rng = np.random.default_rng(0)
    a, b = rng.random(size, dtype=np.float32), rng.random(size, dtype=np.float32)
    a_gpu, b_gpu = cupy.asarray(a), cupy.asarray(b)
    chain = fusion_bench.chain8(array(a_gpu, name="a"), array(b_gpu, name="b"), ops=fusion_bench.fx)
    hyper = fusion_bench.ADAMW_HYPERPARAMETERS
    host = [rng.standard_normal(size, dtype=np.float32) for _ in range(3)]
    host.append(rng.random(size, dtype=np.float32))  # exp_avg_sq is positive
    device = [cupy.asarray(x) for x in host]
    times = {
        "chain8": {"numpy": median_ms(lambda: fusion_bench.chain8(a, b), repeats, sync),
                   "gpu_per_op": median_ms(lambda: run(chain, fused=False), repeats, sync),
                   "gpu_fused": median_ms(lambda: run(chain, fused=True), repeats, sync)},
        "adamw": {"numpy": median_ms(lambda: optim.adamw_update(*host, **hyper), repeats, sync),
                  "gpu_per_op": median_ms(lambda: fused_training.adamw_update(*device, **hyper, fused=False),
                                          repeats, sync),
                  "gpu_fused": median_ms(lambda: fused_training.adamw_update(*device, **hyper, fused=True),
                                         repeats, sync)},
    }
    backend.set_backend("numpy")
    medians = {workload: {way: ms for way, (ms, _) in ways.items()} for workload, ways in times.items()}
    spreads = {workload: {way: half for way, (_, half) in ways.items()} for workload, ways in times.items()}
    return {"ms": medians, "ms_spread": spreads}


def measure(args) -> dict:
    default = TrainConfig(steps=args.steps)
    agreement = [compare_backends(default.replace(precision=p, fused=f))
                 for p in ("fp64", "fp32") for f in (False, True)]
    wide = compare_backends(default.replace(precision="fp32", **WIDE))
    return {"steps": args.steps, "agreement": agreement, "wide": {**wide, "config": WIDE},
            "fused_kernels": {"size": args.size, **fused_kernel_times(args.size, args.repeats)}}


def report(result: dict) -> str:
    lines = [f"GPT trained {result['steps']} steps on NumPy and on CuPy (one process, one GPU); "
             f"median step time leaves out step 0; ms: {SPREAD}",
             f"{'model':<8}{'precision':<10}{'fused':<7}{'max rel loss dev':>17}{'tolerance':>10}"
             f"{'numpy ms':>15}{'cupy ms':>14}{'numpy/cupy':>11}"]
    rows = [("default", row) for row in result["agreement"]] + [("wide", result["wide"])]
    for model, row in rows:
        lines.append(f"{model:<8}{row['precision']:<10}{'yes' if row['fused'] else 'no':<7}"
                     f"{row['deviation']['loss']:>17.2e}{row['tolerance']:>10.0e}"
                     f"{plus_minus(row['numpy_ms'], row['numpy_ms_spread']):>15}"
                     f"{plus_minus(row['cupy_ms'], row['cupy_ms_spread']):>14}"
                     f"{row['numpy_ms'] / row['cupy_ms']:>10.1f}x")
    lines.append(f"wide = {', '.join(f'{k} {v}' for k, v in WIDE.items())}")
    kernels = result["fused_kernels"]
    lines.append(f"fused kernels, {kernels['size']:,} float32 values, ms: {SPREAD} "
                 "(numpy: one operation at a time on the CPU)")
    lines.append(f"{'workload':<10}{'numpy':>16}{'gpu per op':>18}{'gpu fused':>18}{'numpy/fused':>13}"
                 f"{'per op/fused':>14}")
    for workload, ms in kernels["ms"].items():
        spreads = kernels["ms_spread"][workload]
        lines.append(f"{workload:<10}{plus_minus(ms['numpy'], spreads['numpy'], digits=2):>16}"
                     f"{plus_minus(ms['gpu_per_op'], spreads['gpu_per_op'], digits=3):>18}"
                     f"{plus_minus(ms['gpu_fused'], spreads['gpu_fused'], digits=3):>18}"
                     f"{ms['numpy'] / ms['gpu_fused']:>12.0f}x{ms['gpu_per_op'] / ms['gpu_fused']:>13.1f}x")
    return "\n".join(lines)


def agrees(result: dict) -> bool:
    rows = result["agreement"] + [result["wide"]]
    return all(row["deviation"]["loss"] <= row["tolerance"] for row in rows)


def main(argv) -> int:
    parser = argparse.ArgumentParser(prog="python -m minipar bench gpu",
                                     description="The GPT and the fused kernels on CuPy against NumPy.")
    parser.add_argument("--steps", type=int, default=6, help="training steps per run (default 6)")
    parser.add_argument("--size", type=int, default=2**24, help="values per array in the kernel timings")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per kernel measurement")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args(argv)
    for name in ("steps", "size", "repeats"):
        if getattr(args, name) < 1:
            print(f"minipar bench gpu: error: --{name} must be a positive integer", file=sys.stderr)
            return 2
    reason = backend.unavailable("cupy")
    if reason:
        print(f"minipar bench gpu: error: {reason}", file=sys.stderr)
        return 2
    result = measure(args)
    print(json.dumps(result) if args.json else report(result), flush=True)
    return 0 if agrees(result) else 1
