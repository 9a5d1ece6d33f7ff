"""`python -m minipar bench recompute`: what activation recomputation saves and what it costs.

For the GPT of `minipar train` (its defaults: 4 blocks, d_model 64, 4 heads, 32 tokens, batch 16) on
one process: the activation peak of one forward and backward under --recompute none, selective and
full, measured by the activation meter and from memory/activations.py's formula side by side; the
median time of that forward and backward for each mode and its extra time over none; and, timed in the
same alternating rounds, the yardstick of that extra: the recomputed part's forward alone, as the
first pass runs it (graph off): the blocks for full, the attention cores for selective. A mode pays that
forward once more and should cost about that much more. The minor page faults of a step (fresh pages
the kernel hands out) show what else differs between the modes: under glibc's defaults
(MINIPAR_SYSTEM_MALLOC=1; the command line otherwise keeps freed memory, speed/allocator.py) malloc
returns a freed large block to the kernel, so a mode that keeps more activations also touches more
fresh pages each step (lessons/01b_speed_appendix.md measures it both ways).
Lesson: lessons/01_autograd.md (recomputation), lessons/01b_speed_appendix.md (its cost, measured).

    python -m minipar bench recompute [--seq-len 32] [--batch 16] [--precision fp32] [--repeats 15] [--json]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from typing import Callable

import numpy as np

from minipar.core import nn
from minipar.core.autograd import Tensor, activation_meter, no_grad
from minipar.core.recompute import RECOMPUTE_MODES
from minipar.memory.activations import gpt_activation_peak
from minipar.trainer.build import model_config
from minipar.trainer.config import TrainConfig
from minipar.trainer.tasks import AdditionTask
from minipar_lab.bench.table import right_aligned
from minipar_lab.bench.timing import SPREAD, minor_page_faults, plus_minus, round_times, spread


def training_step(model, ids, targets) -> None:
    model.zero_grad()
    model.loss(model(ids), targets, targets.size).backward()


def attention_inputs(mcfg: nn.GPTConfig, ids) -> list[tuple]:
    """The (q, k, v) arrays each block gives its attention core, recorded by a same-seed GPT whose
    attention keeps them (a constructor argument: the measured models are left as they are)."""
    seen = []

    def recording(q, k, v, n_head):
        seen.append((q.data, k.data, v.data))
        return nn.causal_attention(q, k, v, n_head)

    with no_grad():
        nn.GPT(mcfg, seed=0, attention=recording)(ids)
    return seen


def recomputed_forwards(models: dict, mcfg: nn.GPTConfig, ids) -> dict[str, Callable]:
    """Each recomputing mode's recomputed part, run forward as its first pass runs it (graph off, the
    part's inputs given): what the mode computes a second time in backward."""
    with no_grad():
        embedded = models["full"].embed(ids).data
    cores = attention_inputs(mcfg, ids)

    def blocks():
        with no_grad():
            x = Tensor(embedded)
            for block in models["full"].blocks:
                x = block(x)

    def attention_cores():
        with no_grad():
            for q, k, v in cores:
                nn.attention_core(Tensor(q), Tensor(k), Tensor(v), mcfg.n_head, recompute=True)

    return {"full": blocks, "selective": attention_cores}


def counting_faults(work: Callable, counts: list) -> Callable:
    """work, appending to `counts` the page faults of each run (two system calls: microseconds)."""
    def counted():
        before = minor_page_faults(resource.RUSAGE_SELF)
        work()
        counts.append(minor_page_faults(resource.RUSAGE_SELF) - before)
    return counted


def activation_peaks(models: dict, ids, targets) -> dict[str, int]:
    """Bytes the activation meter peaks at during one forward and backward of each model."""
    peaks = {}
    for mode, model in models.items():
        activation_meter.reset_peak()
        before = activation_meter.current
        training_step(model, ids, targets)
        peaks[mode] = activation_meter.peak - before
    return peaks


def recompute_figures(seq_len: int, batch: int, precision: str, repeats: int) -> dict:
    cfg = TrainConfig(seq_len=seq_len, batch_size=batch, precision=precision)
    mcfg = model_config(cfg)
    models = {mode: nn.GPT(mcfg, seed=0, recompute=mode) for mode in RECOMPUTE_MODES}
    ids, targets = AdditionTask(seq_len, 0).global_batch(0, batch)
    peaks = activation_peaks(models, ids, targets)
    faults: dict[str, list] = {mode: [] for mode in models}
    works = {mode: counting_faults(lambda model=model: training_step(model, ids, targets), faults[mode])
             for mode, model in models.items()}
    works.update({f"{mode} part": part for mode, part in recomputed_forwards(models, mcfg, ids).items()})
    none = models["none"]
    works["forward only"] = lambda: none.loss(none(ids), targets, targets.size)
    times_of = round_times(works, repeats)
    spreads = {name: spread(times) for name, times in times_of.items()}  # (median, half the IQR)
    ms = {name: 1e3 * middle for name, (middle, _) in spreads.items()}
    ms_spread = {name: 1e3 * half_range for name, (_, half_range) in spreads.items()}
    bytes_per_value = 8 if precision == "fp64" else 4
    rows = [{"recompute": mode, "activations_peak": peaks[mode],
             "formula": gpt_activation_peak(seq_len, batch, mcfg.d_model, mcfg.n_head, mcfg.n_layer,
                                            mcfg.vocab_size, recompute=mode, bytes_per_value=bytes_per_value),
             "step_ms": ms[mode], "step_ms_spread": ms_spread[mode], "extra_ms": ms[mode] - ms["none"],
             "recomputed_forward_ms": ms.get(f"{mode} part", 0.0),
             "recomputed_forward_ms_spread": ms_spread.get(f"{mode} part", 0.0),
             "page_faults": int(np.median(faults[mode][1:]))}  # faults[mode][0]: the warm-up's
            for mode in RECOMPUTE_MODES]
    return {"seq_len": seq_len, "batch": batch, "precision": precision, "repeats": repeats,
            "forward_ms": ms["forward only"], "modes": rows}


def recomputed_forward(row: dict) -> str:
    if row["recompute"] == "none":
        return "-"
    return f"{plus_minus(row['recomputed_forward_ms'], row['recomputed_forward_ms_spread'])} ms"


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
          f"{args.repeats} alternating rounds ({SPREAD}); one forward with the graph, embedding to loss, "
          f"{figures['forward_ms']:.1f} ms")
    columns = [("--recompute", lambda r: r["recompute"]),
               ("activations_peak (B)", lambda r: f"{r['activations_peak']:,}"),
               ("formula (B)", lambda r: f"{r['formula']:,}"),
               ("forward+backward", lambda r: f"{plus_minus(r['step_ms'], r['step_ms_spread'])} ms"),
               ("extra", lambda r: f"{r['extra_ms']:+.1f} ms"),
               ("recomputed part's forward", recomputed_forward),
               ("page faults", lambda r: f"{r['page_faults']:,}")]
    print("\n".join(right_aligned(figures["modes"], columns)))
    return 0
