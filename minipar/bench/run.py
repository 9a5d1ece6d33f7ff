"""`python -m minipar bench NAME`: measured figures for the lessons, as medians and ratios.

Benchmarks live next to what they measure; this file is the registry and the autograd benchmark:
one training step of an MLP through minipar's autograd against the same MLP's forward and backward
written by hand in NumPy (the overhead of recording a graph), and one step of the default GPT.
Times are medians of repeated runs; ratios are measured in one run, since machines are noisy.
Lesson: lessons/01_autograd.md.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time

import numpy as np

from minipar.core import functional as F
from minipar.core import nn, optim
from minipar.trainer.tasks import AdditionTask

BENCHES = {
    "autograd": "minipar.bench.run:autograd_main",
    "dp": "minipar.bench.dp:main",
    "pp": "minipar.bench.pp:main",
    "tp": "minipar.bench.tp:main",
    "fusion": "minipar.bench.fusion:main",
    "precision": "minipar.bench.precision:main",
    "layouts": "minipar.bench.layouts:main",
    "memory": "minipar.bench.memory:main",
    "gpu": "minipar.bench.gpu:main",
}
QUICK = ("autograd", "dp", "pp", "tp", "fusion", "precision")  # what `bench all` runs (gpu needs a GPU)


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up: first-touch allocations and caches
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def paired_times(first, second, repeats: int) -> tuple[float, float, float]:
    """Median times of two functions run in alternation, and the median of their per-round ratios.

    Alternating puts both under the same load from moment to moment, so on a busy machine the ratio
    is far steadier than the quotient of two medians taken one after the other."""
    first(), second()  # warm-up
    rounds = []
    for _ in range(repeats):
        times = []
        for fn in (first, second):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        rounds.append(times)
    a, b = np.array(rounds).T
    return float(np.median(a)), float(np.median(b)), float(np.median(b / a))


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
        "gpt_step_s": median_time(gpt_step, max(3, repeats // 4)),
    }


def autograd_main(argv) -> int:
    p = argparse.ArgumentParser(prog="minipar bench autograd")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
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


def main(argv) -> int:
    if not argv or argv[0] not in (*BENCHES, "all"):
        print(f"minipar bench: error: choose one of {', '.join(BENCHES)}, all")
        return 2
    names = QUICK if argv[0] == "all" else (argv[0],)
    for name in names:
        module, function = BENCHES[name].split(":")
        print(f"== bench {name}", flush=True)
        code = getattr(importlib.import_module(module), function)(argv[1:])
        if code:
            return code
    return 0
