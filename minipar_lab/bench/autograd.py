"""`python -m minipar bench autograd`: what recording a graph costs, against NumPy written by hand.

One forward and backward of an MLP (Linear-GELU-...-Linear, summed squared error) through minipar's
autograd, and the same computation written by hand in NumPy (hand_written_mlp_step, which
tests/trainer/test_train_cli.py checks gives the same gradients), timed in alternating rounds: their
medians and the median of the per-round ratios, the overhead. Also the median time of one training
step of the default GPT (AdamW).

A second, smaller MLP has ShallowSpeed's shape (its train.py: 784 inputs, six hidden layers of about
128, 10 outputs, batch 128, fp32; here every hidden layer is 128 wide and the activation is GELU, as
minipar's MLPNet has it): at this size the per-op bookkeeping weighs most against the arithmetic.

When PyTorch is installed (an optional extra, never in `make setup` nor CI: `pip install torch`, a
CPU build), both MLPs and the same GPT written in PyTorch (same weights, AdamW) are timed against
minipar's in alternating rounds, on the default and a wide GPT (d 256, seq 64), fp32 and fp64, on
one thread; its first loss is checked against minipar's so that the two really compute the same step.
In the same rounds the GPT's Linear products alone are timed through NumPy's BLAS and PyTorch's
(torch_gpt.LinearProducts): the part of the gap that is the BLAS library's, and what is left, the
ratio of everything else. Without PyTorch the bench says so in one line.
Lesson: lessons/01b_speed_appendix.md.

    python -m minipar bench autograd [--batch 256] [--width 512] [--layers 4] [--repeats 30]
                                     [--torch-repeats 7] [--no-torch] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from minipar.core import functional as F
from minipar.core import nn, optim
from minipar.core.tensor_ops import linear_product
from minipar.speed import blas
from minipar.trainer.tasks import AdditionTask
from minipar_lab.bench import torch_gpt
from minipar_lab.bench.profile import MODELS
from minipar_lab.bench.timing import Progress, plus_minus, round_times, spread


def hand_written_mlp_step(weights, x, y):
    """Forward and backward of Linear-GELU-...-Linear with a summed squared error, by hand, its matrix
    products as minipar's Linear runs them (`linear_product`: NumPy's `@`, or MKL with MINIPAR_BLAS=mkl)."""
    activations, pre = [x], []
    h = x
    for i, (w, b) in enumerate(weights):
        z = linear_product(h, w.T, "forward") + b
        pre.append(z)
        h = F.gelu_forward(z) if i < len(weights) - 1 else z
        activations.append(h)
    g = 2.0 * (h - y)
    grads = []
    for i in reversed(range(len(weights))):
        if i < len(weights) - 1:
            g = F.gelu_backward(pre[i], g)
        grads.append((linear_product(g.T, activations[i], "weight_grad"), g.sum(axis=0)))
        if i:  # the data needs no gradient, and autograd does not compute one either
            g = linear_product(g, weights[i][0], "input_grad")
    return grads


# ShallowSpeed's MLP (github.com/siboehm/ShallowSpeed, train.py: layer_sizes [784, 128, 127, 126, 125,
# 124, 123, 10], GLOBAL_BATCH_SIZE 128, float32), its hidden widths made one, 128
SHALLOWSPEED_MLP = nn.MLPConfig(d_in=784, d_hidden=128, d_out=10, n_layer=7, dtype="float32")
SHALLOWSPEED_BATCH = 128


def mlp_works(cfg: nn.MLPConfig, batch: int, with_torch: bool) -> dict:
    """One forward and backward of MLPNet(cfg) on a batch of random data (summed squared error): by
    hand in NumPy, through minipar's autograd, and in PyTorch when `with_torch` and it is installed."""
    model = nn.MLPNet(cfg, seed=0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, cfg.d_in)).astype(cfg.dtype)
    y = rng.standard_normal((batch, cfg.d_out)).astype(cfg.dtype)
    weights = [(layer.linear.weight.data, layer.linear.bias.data) for layer in model.layers]

    parameters = model.parameters()

    def minipar_step():
        for p in parameters:  # as an optimizer's zero_grad and the PyTorch step do: a list, no tree walk
            p.grad = None
        F.mse_loss(model(x), y, "sum").backward()

    works = {"hand": lambda: hand_written_mlp_step(weights, x, y), "minipar": minipar_step}
    if with_torch and torch_gpt.unavailable() is None:  # the same MLP in PyTorch, in the same rounds
        works["torch"] = torch_gpt.TorchMLPStep(model, x, y)
    return works


def mlp_figures(times: dict) -> dict:
    """Medians and spreads of mlp_works' rounds, and the per-round ratios' medians."""
    figures = {}
    for name, seconds in times.items():
        figures[f"{name}_s"], figures[f"{name}_s_spread"] = spread(seconds)
    figures["hand_ratio"] = float(np.median(times["minipar"] / times["hand"]))
    if "torch" in times:
        figures["torch_ratio"] = float(np.median(times["minipar"] / times["torch"]))
    return figures


def autograd_figures(batch: int, width: int, layers: int, repeats: int, with_torch: bool = True) -> dict:
    cfg = nn.MLPConfig(d_in=width, d_hidden=width, d_out=width, n_layer=layers)
    gpt = nn.GPT(nn.GPTConfig(), seed=0)
    opt = optim.AdamW(gpt.parameters(), lr=1e-3)
    tokens, targets = AdditionTask(32, 0).global_batch(0, 16)

    def gpt_step():
        opt.zero_grad()
        gpt.loss(gpt(tokens), targets, targets.size).backward()
        opt.step()

    times = round_times(mlp_works(cfg, batch, with_torch), repeats)
    figures: dict = {"mlp": {"batch": batch, "width": width, "layers": layers, **mlp_figures(times)}}
    figures["gpt_step_s"], figures["gpt_step_s_spread"] = spread(
        round_times({"gpt": gpt_step}, max(3, repeats // 4))["gpt"])
    figures["shallowspeed_mlp"] = mlp_figures(round_times(
        mlp_works(SHALLOWSPEED_MLP, SHALLOWSPEED_BATCH, with_torch), repeats))
    return figures


TORCH_MODELS = MODELS  # the default and the wide GPT, as bench profile has them


def torch_figures(repeats: int, batch: int = 16) -> dict:
    """minipar's GPT step against PyTorch's, alternating, for each of TORCH_MODELS in fp32 and fp64:
    medians, the median per-round ratio minipar / PyTorch and its spread (the rounds' quartiles)."""
    figures, progress = {}, Progress("autograd", 2 * len(TORCH_MODELS))
    for name, base in TORCH_MODELS.items():
        for dtype in ("float32", "float64"):
            progress(f"{name} GPT in {dtype}: minipar against PyTorch")
            cfg = nn.GPTConfig(block_size=base.block_size, d_model=base.d_model, dtype=dtype)
            tokens, targets = AdditionTask(cfg.block_size, 0).global_batch(0, batch)
            mine = torch_gpt.MiniparGPTStep(cfg, tokens, targets)
            theirs = torch_gpt.TorchGPTStep(mine.model, tokens, targets)
            products = torch_gpt.LinearProducts(mine.model, tokens.size)
            first_losses = (mine(), theirs())
            times = round_times({"minipar": mine, "torch": theirs, "minipar_products": products.minipar,
                                 "torch_products": products.torch}, repeats)
            ratios = times["minipar"] / times["torch"]
            rest = (times["minipar"] - times["minipar_products"]) / (times["torch"] - times["torch_products"])
            figures[f"{name} {dtype}"] = {
                "d_model": cfg.d_model, "seq": cfg.block_size, "batch": batch,
                "minipar_s": float(np.median(times["minipar"])), "torch_s": float(np.median(times["torch"])),
                "ratio": float(np.median(ratios)),
                "ratio_quartiles": [float(q) for q in np.percentile(ratios, [25, 75])],
                "products_ratio": float(np.median(times["minipar_products"] / times["torch_products"])),
                "products_share": float(np.median(times["minipar_products"] / times["minipar"])),
                "rest_ratio": float(np.median(rest)),
                "first_loss_gap": abs(first_losses[0] - first_losses[1]) / abs(first_losses[1]),
            }
    return figures


def print_torch_figures(figures: dict, repeats: int) -> None:
    print(f"GPT training step (AdamW), minipar (BLAS: {blas.current()}) against PyTorch "
          f"{torch_gpt.torch_version()} on {torch_gpt.torch_threads()} thread(s), median of {repeats} "
          f"alternating rounds")
    print("  model                            minipar ms  PyTorch ms  ratio (quartiles)  products (share)  "
          "rest  first-loss gap")
    for name, f in figures.items():
        low, high = f["ratio_quartiles"]
        label = f"{name} (d {f['d_model']}, seq {f['seq']})"
        print(f"  {label:<32} {f['minipar_s'] * 1e3:10.2f}  {f['torch_s'] * 1e3:10.2f}  "
              f"{f['ratio']:5.2f} ({low:.2f}-{high:.2f})  {f['products_ratio']:8.2f} "
              f"({f['products_share']:.0%})  {f['rest_ratio']:4.2f}  {f['first_loss_gap']:.1e}")
    print("  products: the step's Linear products alone, minipar's BLAS over PyTorch's (the same rounds),")
    print("  and their share of minipar's step; rest: the step without them, minipar over PyTorch")


def main(argv) -> int:
    p = argparse.ArgumentParser(prog="minipar bench autograd", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=30, help="alternating rounds timed (median)")
    p.add_argument("--torch-repeats", type=int, default=7,
                   help="alternating rounds of the PyTorch comparison (median), when PyTorch is installed")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison even when installed")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    for name in ("batch", "width", "layers", "repeats", "torch_repeats"):
        if getattr(args, name) < 1:
            flag = name.replace("_", "-")
            print(f"minipar bench autograd: error: --{flag} must be a positive integer, got "
                  f"{getattr(args, name)}", file=sys.stderr)
            return 2
    r = autograd_figures(args.batch, args.width, args.layers, args.repeats, not args.no_torch)
    missing = "--no-torch" if args.no_torch else torch_gpt.unavailable()
    r["torch"] = None if missing else torch_figures(args.torch_repeats)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"MLP {args.layers} x {args.width}, batch {args.batch}, fp64, forward+backward, "
          f"median of {args.repeats} alternating rounds ± half the interquartile range")
    mlp = r["mlp"]
    print(f"  hand-written NumPy   {plus_minus(mlp['hand_s'], mlp['hand_s_spread'], 1e3, 2):>15} ms")
    print(f"  minipar autograd     {plus_minus(mlp['minipar_s'], mlp['minipar_s_spread'], 1e3, 2):>15} ms")
    print(f"  overhead ratio       {mlp['hand_ratio']:8.3f}x")
    if "torch_ratio" in mlp:
        print(f"  PyTorch              {mlp['torch_s'] * 1e3:15.2f} ms, "
              f"minipar / PyTorch {mlp['torch_ratio']:.3f}x")
    print_small_mlp(r["shallowspeed_mlp"], args.repeats)
    gpt_step = plus_minus(r["gpt_step_s"], r["gpt_step_s_spread"], 1e3)
    print(f"GPT (default config) training step: {gpt_step} ms")
    if missing:
        print(f"PyTorch comparison skipped: {missing}")
    else:
        print_torch_figures(r["torch"], args.torch_repeats)
    return 0


def print_small_mlp(f: dict, repeats: int) -> None:
    c = SHALLOWSPEED_MLP
    print(f"ShallowSpeed's MLP ({c.d_in}-{c.d_hidden}x{c.n_layer - 1}-{c.d_out}, batch {SHALLOWSPEED_BATCH}, "
          f"{c.dtype}, GELU), forward+backward, median of {repeats} alternating rounds")
    print(f"  hand-written NumPy   {plus_minus(f['hand_s'], f['hand_s_spread'], 1e3, 3):>15} ms")
    print(f"  minipar autograd     {plus_minus(f['minipar_s'], f['minipar_s_spread'], 1e3, 3):>15} ms, "
          f"{f['hand_ratio']:.3f}x hand-written")
    if "torch_ratio" in f:
        print(f"  PyTorch              {plus_minus(f['torch_s'], f['torch_s_spread'], 1e3, 3):>15} ms, "
              f"minipar / PyTorch {f['torch_ratio']:.3f}x")
