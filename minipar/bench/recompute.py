"""`python -m minipar bench recompute`: what activation recomputation saves and what it costs.

For the GPT of `minipar train` (its defaults: 4 blocks, d_model 64, 4 heads, 32 tokens, batch 16) on
one process: the activation peak of one forward and backward under --recompute none, selective and
full, measured by the activation meter and from memory/activations.py's formula side by side, and the
median time of that forward and backward for each mode, timed in alternating rounds together with a
forward alone (the recomputation's yardstick: full recomputation adds about one forward of the blocks).
Lesson: lessons/01_autograd.md.

    python -m minipar bench recompute [--seq-len 32] [--batch 16] [--precision fp32] [--repeats 15] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

from minipar.bench.table import right_aligned
from minipar.bench.timing import SPREAD, plus_minus, round_times, spread
from minipar.core import nn
from minipar.core.autograd import activation_meter
from minipar.core.recompute import RECOMPUTE_MODES
from minipar.memory.activations import gpt_activation_peak
from minipar.trainer.build import model_config
from minipar.trainer.config import TrainConfig
from minipar.trainer.tasks import AdditionTask


def recompute_figures(seq_len: int, batch: int, precision: str, repeats: int) -> dict:
    cfg = TrainConfig(seq_len=seq_len, batch_size=batch, precision=precision)
    mcfg = model_config(cfg)
    models = {mode: nn.GPT(mcfg, seed=0, recompute=mode) for mode in RECOMPUTE_MODES}
    ids, targets = AdditionTask(seq_len, 0).global_batch(0, batch)
    peaks = {}

    def step(model):
        model.zero_grad()
        model.loss(model(ids), targets, targets.size).backward()

    for mode, model in models.items():
        activation_meter.reset_peak()
        before = activation_meter.current
        step(model)
        peaks[mode] = activation_meter.peak - before
    works = {mode: (lambda model=model: step(model)) for mode, model in models.items()}
    works["forward only"] = lambda: models["none"].loss(models["none"](ids), targets, targets.size)
    times_of = round_times(works, repeats)
    seconds = {name: float(sorted(times)[len(times) // 2]) for name, times in times_of.items()}
    spreads = {name: spread(times)[1] for name, times in times_of.items()}  # half the interquartile range
    bytes_per_value = 8 if precision == "fp64" else 4
    rows = [{"recompute": mode, "activations_peak": peaks[mode],
             "formula": gpt_activation_peak(seq_len, batch, mcfg.d_model, mcfg.n_head, mcfg.n_layer,
                                            mcfg.vocab_size, recompute=mode, bytes_per_value=bytes_per_value),
             "step_ms": 1e3 * seconds[mode],
             "step_ms_spread": 1e3 * spreads[mode],
             "extra_ms": 1e3 * (seconds[mode] - seconds["none"])} for mode in RECOMPUTE_MODES]
    return {"seq_len": seq_len, "batch": batch, "precision": precision, "repeats": repeats,
            "forward_ms": 1e3 * seconds["forward only"], "modes": rows}


def main(argv) -> int:
    parser = argparse.ArgumentParser(prog="minipar bench recompute")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--precision", choices=("fp64", "fp32"), default="fp32")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    figures = recompute_figures(args.seq_len, args.batch, args.precision, args.repeats)
    if args.json:
        json.dump(figures, sys.stdout)
        print()
        return 0
    print(f"GPT defaults, seq {args.seq_len}, batch {args.batch}, {args.precision}: median of "
          f"{args.repeats} alternating rounds ({SPREAD}); one forward alone {figures['forward_ms']:.1f} ms")
    columns = [("--recompute", lambda r: r["recompute"]),
               ("activations_peak (B)", lambda r: f"{r['activations_peak']:,}"),
               ("formula (B)", lambda r: f"{r['formula']:,}"),
               ("forward+backward", lambda r: f"{plus_minus(r['step_ms'], r['step_ms_spread'])} ms"),
               ("extra", lambda r: f"{r['extra_ms']:+.1f} ms")]
    print("\n".join(right_aligned(figures["modes"], columns)))
    return 0
