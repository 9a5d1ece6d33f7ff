"""`python -m minipar bench precision`: fp16's narrow window, and what loss scaling does about it.

fp16 holds magnitudes from 6e-8 to 65504; bf16 (like fp32) from 1e-40 to 3e38. Two experiments train
the same MLPNet regression single-process with the real engine (trainer/build.py's model, runner and
updater, wrapped by precision/mixed.py) in fp32, bf16, fp16 without loss scaling and fp16 with the
dynamic loss scaler. Each changes only the *size* of the numbers, in a way that leaves training in
exact arithmetic unchanged, and so shows what the format alone does:

  small gradients  The loss is divided by K times the batch, as if the batch held K times more
                   samples (an LLM batch holds millions of tokens), so every per-sample gradient is
                   K times smaller; SGD's learning rate is K times larger to match. Without scaling,
                   fp16 rounds the small gradients to zero and training stalls; the loss scaler
                   multiplies them back into range. It starts far too high, so it first skips steps
                   (an inf gradient) and halves the scale until they fit, then grows it now and then.
  large values     Inputs and targets are S times larger (other units) and the learning rate S^2
                   times smaller. Activations pass 65504: fp16 overflows whatever the loss scale (the
                   scaler only moves the gradients' window), bf16 trains. This is why BLOOM chose bf16.

Prints one table per experiment; `--plot FILE` also saves a PNG when matplotlib is installed.
Lessons: lessons/09_precision.md (the picture), 09c_precision_appendix.md (the tables).

    python -m minipar bench precision [--steps 100] [--batch-size 256] [--divisor-log2 16] [--unit-log2 15]
                                      [--seed 0] [--plot FILE] [--json]
"""

from __future__ import annotations

import json
import math
import time

import numpy as np

from minipar.distributed.communicator import Comm
from minipar.distributed.grid import ProcessGrid
from minipar.precision import mixed as mixed_precision
from minipar.precision.formats import DynamicLossScaler
from minipar.trainer import build
from minipar.trainer.arguments import OneLineParser
from minipar.trainer.config import TrainConfig
from minipar.trainer.engine import Engine
from minipar.trainer.loop import make_task
from minipar_lab.bench import canvas

# run name -> (precision, the loss scaler's options or None); PyTorch's scaler starts at 2^16
PLAIN_RUNS = {"fp32": ("fp32", None), "bf16": ("bf16", None), "fp16": ("fp16", None),
              "fp16+scaler": ("fp16", {})}
HIGH_START = {"scaler@2^40": ("fp16", {"init_scale": 2.0**40})}  # far too high: watch it back off


class LargerBatchEngine(Engine):
    """Divides the loss by `loss_divisor` times the real batch: gradients as small as a bigger batch's."""

    def __init__(self, cfg, grid, model, runner, updater, loss_divisor: float):
        super().__init__(cfg, grid, model, runner, updater)
        self.loss_divisor = loss_divisor

    def normaliser(self, targets):
        return super().normaliser(targets) * self.loss_divisor


def build_engine(cfg: TrainConfig, precision: str, scaler_options, loss_divisor: float) -> LargerBatchEngine:
    """build.build_engine on one process, with this precision, loss scaler and loss divisor."""
    from mpi4py import MPI

    cfg = cfg.replace(precision=precision, loss_scaling=scaler_options is not None)
    scaler = DynamicLossScaler(**scaler_options) if scaler_options is not None else None
    grid = ProcessGrid(Comm(MPI.COMM_SELF), 1, 1, 1)
    model = build.build_model(cfg, grid)
    updater = build.build_updater(cfg, grid, model, scaler)
    runner = mixed_precision.wrap_runner(cfg, model, build.build_runner(cfg, grid, model), updater)
    return LargerBatchEngine(cfg, grid, model, runner, updater, loss_divisor)


def train_curve(cfg: TrainConfig, precision: str, scaler_options, loss_divisor: float, unit: float) -> dict:
    """Losses (in the experiment's original scale), loss scales and skipped steps of one run."""
    engine, task = build_engine(cfg, precision, scaler_options, loss_divisor), make_task(cfg)
    curve = {"loss": [], "scale": [], "skipped": []}
    with np.errstate(over="ignore", invalid="ignore"):  # the fp16 runs are meant to overflow
        for step in range(cfg.steps):
            inputs, targets = task.global_batch(step, cfg.batch_size)
            loss = engine.train_step(inputs * unit, targets * unit)
            scaling = getattr(engine.runner, "log_record", lambda: None)() or {"loss_scale": None,
                                                                                "skipped": False}
            curve["loss"].append(float(loss) * loss_divisor / unit**2)
            curve["scale"].append(scaling["loss_scale"])
            curve["skipped"].append(bool(scaling["skipped"]))
    return curve


def gradient_errors(cfg: TrainConfig, loss_divisor: float, probe_steps) -> list[dict]:
    """Along the fp32 run, the weight gradients fp16 computes on the same weights and batch, without
    and with a loss scale of 2^16: per layer, the share of values rounded to zero (non-zero in fp32)
    and the relative error (norm of the difference over the norm of the fp32 gradient)."""
    cfg = cfg.replace(lr=cfg.lr * loss_divisor)
    fp32 = build_engine(cfg, "fp32", None, loss_divisor)
    probes = {"fp16": build_engine(cfg, "fp16", None, loss_divisor),
              "fp16+scaler": build_engine(cfg, "fp16", {}, loss_divisor)}
    task, rows = make_task(cfg), []
    for step in range(max(probe_steps) + 1):
        inputs, targets = task.global_batch(step, cfg.batch_size)
        if step in probe_steps:
            for engine in (fp32, *probes.values()):
                engine.model.load_state_dict(fp32.model.state_dict())
                engine.model.zero_grad()
                engine.runner.forward_backward(inputs, targets, engine.normaliser(targets))
            for name, p in fp32.model.named_parameters():
                if not name.endswith("weight"):
                    continue
                row = {"step": step, "weight": name}
                for run, probe in probes.items():
                    scaling = probe.runner.loss_scaling
                    scale = scaling.scaler.get_scale() if scaling else 1.0  # back to the true gradient
                    row[run] = _compared(p.grad, dict(probe.model.named_parameters())[name].grad / scale)
                rows.append(row)
        fp32.train_step(inputs, targets)
    return rows


def _compared(exact, approximate) -> dict:
    zeroed = (approximate == 0) & (exact != 0)
    return {"zero": float(zeroed.mean()),
            "error": float(np.linalg.norm(approximate - exact) / np.linalg.norm(exact))}


def experiment(cfg: TrainConfig, runs: dict, loss_divisor: float = 1.0, unit: float = 1.0) -> dict:
    """Every run of one experiment, {name: curve}, each from the same initial weights and data."""
    cfg = cfg.replace(lr=cfg.lr * loss_divisor / unit**2)
    return {name: train_curve(cfg, precision, options, loss_divisor, unit)
            for name, (precision, options) in runs.items()}


def table(title: str, curves: dict, steps: int) -> str:
    """Loss of every run at ~10 steps, the last scaler's scale and skips, and a summary line."""
    shown = sorted(set(range(0, steps, max(1, steps // 10))) | {steps - 1})
    scaled = curves[list(curves)[-1]]
    lines = [title, f"{'step':>5} " + " ".join(f"{name:>12}" for name in curves)
             + f" {list(curves)[-1] + ' scale':>20}"]
    for step in shown:
        marker = "  skipped" if scaled["skipped"][step] else ""
        lines.append(f"{step:>5} " + " ".join(f"{curve['loss'][step]:>12.4g}" for curve in curves.values())
                     + f" {scaled['scale'][step]:>20.4g}{marker}")
    fp32, bf16 = np.array(curves["fp32"]["loss"]), np.array(curves["bf16"]["loss"])
    skips = ", ".join(f"{name} {sum(c['skipped'])}" for name, c in curves.items() if any(c["scale"]))
    largest = float(np.max(np.abs(bf16 - fp32) / np.abs(fp32)))
    lines.append(f"steps skipped of {steps}: {skips};  bf16 vs fp32: largest relative loss difference "
                 f"{largest:.2%} (at most {100 * power_of_ten_above(largest):g}%)")
    return "\n".join(lines)


def power_of_ten_above(value: float) -> float:
    """The least power of ten at least `value` (> 0): the bound a lesson checks. A largest difference
    between 16-bit and fp32 runs is rounding noise, 0.3% on one CPU and 0.9% on another (other matrix
    kernels and SIMD loops round differently, and a 16-bit run carries each difference on)."""
    return 10.0 ** math.ceil(math.log10(value)) if value > 0 else 0.0


def gradient_table(rows: list[dict]) -> str:
    lines = ["weight gradients of fp16 on the fp32 run's weights (small gradients): values rounded to zero, "
             "relative error", f"{'step':>5} {'weight':<24} {'fp16 zero':>10} {'error':>8} "
             f"{'fp16+scaler zero':>17} {'error':>8}"]
    for row in rows:
        plain, scaled = row["fp16"], row["fp16+scaler"]
        lines.append(f"{row['step']:>5} {row['weight']:<24} {plain['zero']:>10.0%} {plain['error']:>8.1%} "
                     f"{scaled['zero']:>17.0%} {scaled['error']:>8.3%}")
    return "\n".join(lines)


def save_plot(path: str, results: dict) -> str:
    plt = canvas.pyplot()
    figure, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4))
    for ax, (title, curves) in zip(np.atleast_1d(axes), results.items()):
        top = max(max(c["loss"]) for c in curves.values() if np.isfinite(c["loss"]).all())
        for index, (name, curve) in enumerate(curves.items()):
            losses = np.array(curve["loss"])
            line, = ax.plot(np.where(np.isfinite(losses), losses, np.nan), label=name)
            marks = {"v": ("step skipped", [s for s, skipped in enumerate(curve["skipped"]) if skipped]),
                     "x": ("loss not finite", list(np.flatnonzero(~np.isfinite(losses))))}
            for marker, (what, steps) in marks.items():
                if steps:  # along the top, one row per run, where no line can be drawn
                    ax.plot(steps, [top * 1.12 ** (index + 1)] * len(steps), marker, color=line.get_color(),
                            label=f"{name}: {what}")
        ax.set(title=title, xlabel="step", ylabel="loss", yscale="log")
        ax.legend()
    canvas.save(figure, path, dpi=120)
    return f"plot saved to {path}"


def parse(argv):
    p = OneLineParser(prog="minipar bench precision", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--divisor-log2", type=int, default=16, help="small gradients: K = 2^this")
    p.add_argument("--unit-log2", type=int, default=15, help="large values: S = 2^this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="save the curves as a PNG (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print the curves as JSON instead of tables")
    args = p.parse_args(argv)
    if args.steps < 2 or args.batch_size < 1:
        p.error(f"--steps must be at least 2 and --batch-size positive, got {args.steps}, {args.batch_size}")
    if not (0 <= args.divisor_log2 <= 40 and 0 <= args.unit_log2 <= 40):
        p.error("--divisor-log2 and --unit-log2 must be between 0 and 40")
    return args


def main(argv) -> int:
    try:
        args = parse(argv)
    except SystemExit as stop:  # a usage error (one line, code 2) or --help (code 0)
        return stop.code or 0
    if args.plot:
        canvas.pyplot()  # no matplotlib: say so now, not after the measuring
    cfg = TrainConfig(model="mlp", n_layer=4, d_model=32, optimizer="sgd", lr=0.02, steps=args.steps,
                      batch_size=args.batch_size, seed=args.seed, dp=1, quiet=True)
    divisor, unit = 2.0**args.divisor_log2, 2.0**args.unit_log2
    started = time.perf_counter()
    small, large = (f"small gradients: loss / (2^{args.divisor_log2} x batch)",
                    f"large values: inputs and targets x 2^{args.unit_log2}")
    results = {small: experiment(cfg, {**PLAIN_RUNS, **HIGH_START}, loss_divisor=divisor),
               large: experiment(cfg, PLAIN_RUNS, unit=unit)}
    gradients = gradient_errors(cfg, divisor, sorted({0, cfg.steps // 2, cfg.steps - 1}))
    if args.json:
        print(json.dumps({**results, "gradient_errors": gradients}))
        return 0
    print(f"MLPNet regression, {cfg.n_layer} layers of {cfg.d_model}, batch {cfg.batch_size}, SGD, "
          f"{cfg.steps} steps per run; losses in the original units ({time.perf_counter() - started:.1f} s)")
    for title, curves in results.items():
        print()
        print(table(title, curves, cfg.steps))
        if title == small:
            print()
            print(gradient_table(gradients))
    if args.plot:
        print(save_plot(args.plot, results))
    return 0
