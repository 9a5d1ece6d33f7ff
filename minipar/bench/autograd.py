"""`python -m minipar bench autograd`: what recording a graph costs, against NumPy written by hand.

One forward and backward of an MLP (Linear-GELU-...-Linear, summed squared error) through minipar's
autograd, and the same computation written by hand in NumPy (hand_written_mlp_step, which
tests/trainer/test_train_cli.py checks gives the same gradients), timed in alternating rounds: their
medians and the median of the per-round ratios, the overhead. Also the median time of one training
step of the default GPT (AdamW). Lesson: lessons/01_autograd.md.

    python -m minipar bench autograd [--batch 256] [--width 512] [--layers 4] [--repeats 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from minipar.bench.timing import median_seconds, paired_times
from minipar.core import functional as F
from minipar.core import nn, optim
from minipar.trainer.tasks import AdditionTask


def hand_written_mlp_step(weights, x, y):
    """Forward and backward of Linear-GELU-...-Linear with a summed squared error, by hand."""
    activations, pre = [x], []
    h = x
    for i, (w, b) in enumerate(weights):
        z = h @ w.T + b
        pre.append(z)
        h = F.gelu_forward(z) if i < len(weights) - 1 else z
        activations.append(h)
    g = 2.0 * (h - y)
    grads = []
    for i in reversed(range(len(weights))):
        if i < len(weights) - 1:
            g = F.gelu_backward(pre[i], g)
        grads.append((g.T @ activations[i], g.sum(axis=0)))
        if i:  # the data needs no gradient, and autograd does not compute one either
            g = g @ weights[i][0]
    return grads


def autograd_figures(batch: int, width: int, layers: int, repeats: int) -> dict:
    cfg = nn.MLPConfig(d_in=width, d_hidden=width, d_out=width, n_layer=layers)
    model = nn.MLPNet(cfg, seed=0)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((batch, width)), rng.standard_normal((batch, width))
    weights = [(layer.linear.weight.data, layer.linear.bias.data) for layer in model.layers]

    def minipar_step():
        model.zero_grad()
        F.mse_loss(model(x), y, "sum").backward()

    gpt = nn.GPT(nn.GPTConfig(), seed=0)
    opt = optim.AdamW(gpt.parameters(), lr=1e-3)
    tokens, targets = AdditionTask(32, 0).global_batch(0, 16)

    def gpt_step():
        opt.zero_grad()
        gpt.loss(gpt(tokens), targets, targets.size).backward()
        opt.step()

    hand, mine, ratio = paired_times(lambda: hand_written_mlp_step(weights, x, y), minipar_step, repeats)
    return {
        "mlp": {"batch": batch, "width": width, "layers": layers},
        "hand_numpy_s": hand,
        "minipar_s": mine,
        "overhead_ratio": ratio,
        "gpt_step_s": median_seconds(gpt_step, max(3, repeats // 4)),
    }


def main(argv) -> int:
    p = argparse.ArgumentParser(prog="minipar bench autograd", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=30, help="alternating rounds timed (median)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    for name in ("batch", "width", "layers", "repeats"):
        if getattr(args, name) < 1:
            print(f"minipar bench autograd: error: --{name} must be a positive integer, got "
                  f"{getattr(args, name)}", file=sys.stderr)
            return 2
    r = autograd_figures(args.batch, args.width, args.layers, args.repeats)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"MLP {args.layers} x {args.width}, batch {args.batch}, fp64, forward+backward, "
          f"median of {args.repeats} alternating rounds")
    print(f"  hand-written NumPy   {r['hand_numpy_s'] * 1e3:8.2f} ms")
    print(f"  minipar autograd     {r['minipar_s'] * 1e3:8.2f} ms")
    print(f"  overhead ratio       {r['overhead_ratio']:8.3f}x")
    print(f"GPT (default config) training step: {r['gpt_step_s'] * 1e3:.1f} ms")
    return 0
