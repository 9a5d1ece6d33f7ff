"""`python -m minipar bench fp8`: the default GPT trained in fp32, bf16 and each FP8 recipe, the amax
the delayed recipe records, and an outlier that one scale per tensor cannot hold.

Three measurements, single-process, with the real engine (trainer/build.py's build_engine, which wraps
the runner for bf16 by precision/mixed.py and for fp8 by precision/fp8.py):

  curves     The same initial weights and batches in fp32, bf16 and `--precision fp8` with the
             delayed, current and block recipes (block: `--fp8-block`, 16 by default: the default
             GPT's width, 64, is below DeepSeek-V3's 128). Each run's loss per step.
  amax       The delayed run's amax history (precision/fp8.py's PerTensorScaling, agreed after each
             step): for every FP8 layer, the amax of its input, weight and output gradient per step.
             The gradients' lie two to six decades below the activations': why a scale per
             tensor is needed at all.
  outliers   Block 1's `fc` input at step 0 with one channel set to `ratio` times the median of its
             magnitudes (Sun et al. 2024's "massive activations"), quantized to E4M3 with one scale
             for the tensor and with 1 x N tiles: the share of the other values that become zero.
             One scale flushes them past outlier / v = 448 x 2^10 = 2^18.8; tiles confine it to the
             outlier's own tile (lesson 09b derives both).

Prints a table of each; `--plot FILE` draws the three (matplotlib). The defaults take about 30 s on
2 cores (load 3; block scaling is half of it); `--n-layer` and `--d-model` shrink the model. Lesson: lessons/09b_fp8.md.

    python -m minipar bench fp8 [--steps 30] [--fp8-block 16] [--n-layer L] [--d-model D] [--seed 0]
                                [--plot FILE] [--json]
"""

from __future__ import annotations

import json
import time

import numpy as np

from minipar.core import kernels
from minipar.distributed.communicator import Comm
from minipar.distributed.grid import ProcessGrid
from minipar.precision import fp8
from minipar.precision.formats import E4M3
from minipar.trainer import build
from minipar.trainer.arguments import OneLineParser
from minipar.trainer.config import TrainConfig
from minipar.trainer.loop import make_task
from minipar.trainer.validate import validate
from minipar_lab.bench import canvas

# run name -> TrainConfig fields beyond the shared ones
RUNS = {"fp32": {"precision": "fp32"}, "bf16": {"precision": "bf16"},
        "fp8 delayed": {"precision": "fp8", "fp8_recipe": "delayed"},
        "fp8 current": {"precision": "fp8", "fp8_recipe": "current"},
        "fp8 block": {"precision": "fp8", "fp8_recipe": "block"}}
RATIOS = (1e2, 1e3, 1e4, 1e5, 1e6)
OUTLIER_CHANNEL = 5


def train(cfg: TrainConfig):
    """One single-process run: (its engine, the loss of each step)."""
    from mpi4py import MPI

    engine = build.build_engine(cfg, ProcessGrid(Comm(MPI.COMM_SELF), 1, 1, 1))
    task, losses = make_task(cfg), []
    for step in range(cfg.steps):
        inputs, targets = task.global_batch(step, cfg.batch_size)
        losses.append(float(engine.train_step(inputs, targets)))
    return engine, losses


def amax_history(engine) -> dict:
    """The delayed run's history by layer name: {name: {input, weight, grad: [amax per step]}}."""
    return fp8.amax_history(engine.runner)


def fc_input(cfg: TrainConfig) -> np.ndarray:
    """What block 1's (or the last block's) `fc` multiplies in the first step's forward: its input."""
    from mpi4py import MPI

    engine = build.build_engine(cfg.replace(precision="fp32"), ProcessGrid(Comm(MPI.COMM_SELF), 1, 1, 1))
    fc = engine.model.blocks[min(1, cfg.n_layer - 1)].mlp.fc
    seen = {}

    def recording(a, b, role):
        if role == "forward" and b.base is fc.weight.data:
            seen["input"] = a.copy()
        return a @ b

    inputs, _ = make_task(cfg).global_batch(0, cfg.batch_size)
    with kernels.install("linear", recording):
        engine.model(inputs)
    return seen["input"]


def outliers(x: np.ndarray, n: int) -> list[dict]:
    """For each ratio: the share of the values other than the outlier channel that quantize to zero
    (and were not zero), with one scale for the tensor, with 1 x n tiles, and with the tiles outside
    the outlier's own ("other tiles": what the outlier cannot reach)."""
    median, rest = np.median(np.abs(x)), np.arange(x.shape[1]) != OUTLIER_CHANNEL
    outside = np.arange(x.shape[1]) // n != OUTLIER_CHANNEL // n
    rows = []
    for ratio in RATIOS:
        spiked = x.copy()
        spiked[:, OUTLIER_CHANNEL] = ratio * median
        tensor = fp8.quantize(spiked, fp8.scale_for(float(np.abs(spiked).max()), E4M3), E4M3)
        tiles, _ = fp8.tile_quantize(spiked, n, E4M3)
        nonzero = x[:, rest] != 0
        rows.append({"ratio": ratio, "tensor": float(np.mean(tensor[:, rest][nonzero] == 0)),
                     "tiles": float(np.mean(tiles[:, rest][nonzero] == 0)),
                     "other_tiles": float(np.mean(tiles[:, outside][x[:, outside] != 0] == 0))})
    return rows


def measure(cfg: TrainConfig) -> dict:
    curves, amax = {}, {}
    for name, fields in RUNS.items():
        engine, curves[name] = train(cfg.replace(**fields))
        if name == "fp8 delayed":
            amax = amax_history(engine)
    return {"curves": curves, "amax": amax, "outliers": outliers(fc_input(cfg), cfg.fp8_block)}


def tables(results: dict, cfg: TrainConfig) -> str:
    curves, steps = results["curves"], cfg.steps
    shown = sorted(set(range(0, steps, max(1, steps // 6))) | {steps - 1})
    lines = [f"{'step':>5} " + " ".join(f"{name:>12}" for name in curves)]
    lines += [f"{step:>5} " + " ".join(f"{c[step]:>12.4f}" for c in curves.values()) for step in shown]
    last = max(1, steps // 5)  # the mean of the last fifth of the steps, against bf16's
    bf16 = float(np.mean(curves["bf16"][-last:]))
    lines.append(f"mean of the last {last} steps against bf16's: " + ", ".join(
        f"{name} {float(np.mean(c[-last:])) / bf16 - 1:+.2%}" for name, c in curves.items() if name != "bf16"))
    lines += ["", "delayed recipe, amax over the FP8 layers, least..largest (first step -> last):"]
    for tensor in ("input", "weight", "grad"):
        first = [h[tensor][0] for h in results["amax"].values()]
        final = [h[tensor][-1] for h in results["amax"].values()]
        lines.append(f"  {tensor:7} {min(first):.2e}..{max(first):.2e} -> {min(final):.2e}..{max(final):.2e}")
    lines += ["", "one outlier channel in block fc's input: values other than it flushed to zero (E4M3)",
              f"{'outlier/median':>15} {'one scale':>10} {f'1x{cfg.fp8_block} tiles':>10} {'other tiles':>12}"]
    lines += [f"{row['ratio']:>15.0e} {row['tensor']:>10.1%} {row['tiles']:>10.1%} {row['other_tiles']:>12.1%}"
              for row in results["outliers"]]
    return "\n".join(lines)


def save_plot(path: str, results: dict, cfg: TrainConfig) -> str:
    plt = canvas.pyplot()
    figure, (loss_ax, amax_ax, outlier_ax) = plt.subplots(1, 3, figsize=(17, 4.5))
    for name, curve in results["curves"].items():
        loss_ax.plot(curve, label=name, linestyle="--" if name.startswith("fp8") else "-")
    loss_ax.set(title=f"the default GPT ({cfg.n_layer} blocks of {cfg.d_model}): loss", xlabel="step",
                ylabel="loss")
    loss_ax.legend()
    colours = {"input": "tab:blue", "weight": "tab:green", "grad": "tab:red"}
    for history in results["amax"].values():
        for tensor, colour in colours.items():
            amax_ax.plot(history[tensor], color=colour, alpha=0.4, linewidth=0.8)
    for tensor, colour in colours.items():  # one legend entry per kind
        amax_ax.plot([], color=colour, label=f"{tensor} (every FP8 layer)")
    amax_ax.set(title="delayed recipe: amax per step", xlabel="step", ylabel="amax", yscale="log")
    amax_ax.legend()
    ratios = [row["ratio"] for row in results["outliers"]]
    outlier_ax.plot(ratios, [100 * row["tensor"] for row in results["outliers"]], "o-", label="one scale")
    outlier_ax.plot(ratios, [100 * row["tiles"] for row in results["outliers"]], "s-",
                    label=f"1x{cfg.fp8_block} tiles (all in the outlier's tile)")
    outlier_ax.plot(ratios, [100 * row["other_tiles"] for row in results["outliers"]], "^-",
                    label="the tiles without the outlier")
    outlier_ax.axvline(2**18.8, color="grey", linestyle=":", label="2^18.8: the median flushes")
    outlier_ax.set(title="one outlier channel: other values flushed to zero", xlabel="outlier / median",
                   ylabel="% of values", xscale="log")
    outlier_ax.legend()
    canvas.save(figure, path, dpi=110)
    return f"plot saved to {path}"


def parse(argv):
    defaults = TrainConfig()
    p = OneLineParser(prog="minipar bench fp8", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--fp8-block", type=int, default=16)
    p.add_argument("--n-layer", type=int, default=defaults.n_layer)
    p.add_argument("--d-model", type=int, default=defaults.d_model)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="save the three panels as a PNG (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print the measurements as JSON instead of tables")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error(f"--steps must be at least 2, got {args.steps}")
    cfg = TrainConfig(steps=args.steps, fp8_block=args.fp8_block, n_layer=args.n_layer, d_model=args.d_model,
                      seed=args.seed, quiet=True)
    errors = validate(cfg.replace(precision="fp8", fp8_recipe="block"), 1)
    if errors:
        p.error(errors[0].removeprefix("minipar train: error: "))
    return args, cfg


def main(argv) -> int:
    try:
        args, cfg = parse(argv)
    except SystemExit as stop:  # a usage error (one line, code 2) or --help (code 0)
        return stop.code or 0
    if args.plot:
        canvas.pyplot()  # no matplotlib: say so now, not after the training runs
    started = time.perf_counter()
    results = measure(cfg)
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"the default GPT, {cfg.n_layer} blocks of {cfg.d_model}, {cfg.steps} steps per run, one process "
          f"({time.perf_counter() - started:.0f} s)")
    print(tables(results, cfg))
    if args.plot:
        print(save_plot(args.plot, results, cfg))
    return 0
