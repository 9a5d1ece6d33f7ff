"""`python -m minipar bench profile`: where one process's training step spends its time, by phase
and by operation, for the default GPT or a wide one (AdamW, a memory ledger listening, as
`minipar train` runs it), under any `--recompute` mode (core/recompute.py: the recomputed forward
shows in backward, in the rows of the operations it runs again).

Phases, timed plainly (medians of --repeats steps, no profiler): forward (model and loss), backward,
optimizer (zero_grad and AdamW's step) and communication (none on one process: its row says 0 so
that a layout's profile can be set beside it). Operations, from one run of the same steps under
Python's cProfile: each Function's forward and backward (its array work), AdamW's update, and
bookkeeping, what is left of the forward and backward phases outside every operation: recording the
graph, Tensors, the activation meter and the ledger listening to it. The profiler adds its own cost to
every Python call, so bookkeeping's share reads high there; the phase times are the true ones.
Lesson: lessons/01_autograd.md.

    python -m minipar bench profile [--model default|wide] [--dtype float64|float32] [--batch 16]
                                    [--recompute none|selective|full] [--repeats 10] [--top 12] [--json]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time

from minipar.bench.timing import spread
from minipar.core import nn, optim
from minipar.core.autograd import Function
from minipar.core.recompute import RECOMPUTE_MODES, Recompute
from minipar.memory.ledger import MemoryLedger
from minipar.trainer.tasks import AdditionTask

PHASES = ("forward", "backward", "optimizer", "communication")
MODELS = {"default": nn.GPTConfig(), "wide": nn.GPTConfig(block_size=64, d_model=256)}  # --model


class GPTStep:
    """One training step of the default GPT, in phases that can be timed one by one."""

    def __init__(self, dtype: str, batch: int, model: str = "default", recompute: str = "none"):
        base = MODELS[model]
        cfg = nn.GPTConfig(block_size=base.block_size, d_model=base.d_model, dtype=dtype)
        self.model = nn.GPT(cfg, seed=0, recompute=recompute)
        self.opt = optim.AdamW(self.model.parameters(), lr=1e-3)
        self.tokens, self.targets = AdditionTask(cfg.block_size, 0).global_batch(0, batch)
        self.loss = None

    def forward(self):
        self.loss = self.model.loss(self.model(self.tokens), self.targets, self.targets.size)

    def backward(self):
        self.loss.backward()

    def optimizer(self):
        self.opt.step()
        self.opt.zero_grad()

    def communication(self):
        """One process exchanges nothing."""

    def run(self):
        for phase in PHASES:
            getattr(self, phase)()


def phase_seconds(step: GPTStep, repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds of each phase over `repeats` steps, after one untimed warm-up step, and their
    spreads (half the interquartile range)."""
    step.run()
    times: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for _ in range(repeats):
        for phase in PHASES:
            started = time.perf_counter()
            getattr(step, phase)()
            times[phase].append(time.perf_counter() - started)
    spreads = {phase: spread(seconds) for phase, seconds in times.items()}  # (median, half the IQR)
    return ({phase: middle for phase, (middle, _) in spreads.items()},
            {phase: half_range for phase, (_, half_range) in spreads.items()})


def function_code_names() -> dict[tuple, str]:
    """(file, first line, name) of every Function's forward and backward -> "Class.forward"..., the keys
    cProfile files their times under."""
    names, pending = {}, list(Function.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls is Recompute:  # its rules run the recomputed part's operations, which have their own rows:
            continue  # a row of its own would count them twice (what it adds is bookkeeping)
        for rule in ("forward", "backward"):
            if rule in cls.__dict__:
                code = getattr(cls, rule).__code__
                names[(code.co_filename, code.co_firstlineno, code.co_name)] = f"{cls.__name__}.{rule}"
    return names


def op_seconds(step: GPTStep, repeats: int) -> tuple[dict[str, float], dict[str, float], float]:
    """Seconds per step inside each operation (cumulative, under cProfile), its calls per step, and
    the profiled seconds per step of the forward and backward phases together."""
    names = function_code_names()
    update = optim.adamw_update.__code__
    names[(update.co_filename, update.co_firstlineno, update.co_name)] = "AdamW update"
    phase_codes = {(c.co_filename, c.co_firstlineno, c.co_name) for c in
                   (GPTStep.forward.__code__, GPTStep.backward.__code__)}
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(repeats):
        step.run()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]  # pstats keeps them untyped
    ops: dict[str, float] = {}
    calls: dict[str, float] = {}
    for key, (_, primitive_calls, _, cumulative, _) in stats.items():
        if key in names:
            ops[names[key]] = ops.get(names[key], 0.0) + cumulative / repeats
            calls[names[key]] = calls.get(names[key], 0.0) + primitive_calls / repeats
    graph_phases = sum(stats[key][3] for key in phase_codes if key in stats) / repeats
    return ops, calls, graph_phases


def profile_figures(dtype: str, batch: int, repeats: int, model: str = "default",
                    recompute: str = "none") -> dict:
    step = GPTStep(dtype, batch, model, recompute)
    with MemoryLedger():  # listening, as in `minipar train`: its work is part of the step
        phases, phase_spreads = phase_seconds(step, repeats)
        ops, calls, graph_phases = op_seconds(step, repeats)
    in_ops = sum(seconds for name, seconds in ops.items() if name != "AdamW update")
    return {
        "model": {"config": f"{model} GPT", "d_model": step.model.config.d_model,
                  "seq": step.model.config.block_size, "dtype": dtype, "batch": batch, "repeats": repeats,
                  "recompute": recompute},
        "phases_s": phases,
        "phases_s_spread": phase_spreads,
        "step_s": sum(phases.values()),
        "ops_s": dict(sorted(ops.items(), key=lambda item: -item[1])),
        "op_calls_per_step": calls,
        "bookkeeping_s": max(graph_phases - in_ops, 0.0),
        "profiled_forward_backward_s": graph_phases,
    }


def print_report(r: dict, top: int) -> None:
    m = r["model"]
    recompute = f", --recompute {m['recompute']}" if m["recompute"] != "none" else ""
    print(f"{m['config']} (d {m['d_model']}, seq {m['seq']}), {m['dtype']}, batch {m['batch']}{recompute}: "
          f"one training step, median of {m['repeats']} (± half the interquartile range)")
    print("  phase            ms    share        ±")
    for phase, seconds in r["phases_s"].items():
        print(f"  {phase:<14} {seconds * 1e3:6.2f}  {seconds / r['step_s']:6.1%}  "
              f"{r['phases_s_spread'][phase] * 1e3:7.2f}")
    print(f"  {'step':<14} {r['step_s'] * 1e3:6.2f}")
    profiled = r["profiled_forward_backward_s"] + r["ops_s"].get("AdamW update", 0.0)
    print(f"by operation, under cProfile ({profiled * 1e3:.1f} ms of forward, backward and AdamW per step)")
    rows = list(r["ops_s"].items())[:top] + [("bookkeeping (graph, meters, ledger)", r["bookkeeping_s"])]
    print(f"  {'operation':<36} {'ms':>6}     share  calls")
    for name, seconds in sorted(rows, key=lambda row: -row[1]):
        calls = r["op_calls_per_step"].get(name)
        count = f"{calls:6.0f}" if calls is not None else ""
        print(f"  {name:<36} {seconds * 1e3:6.2f}  {seconds / profiled:6.1%}  {count}")


def main(argv) -> int:
    p = argparse.ArgumentParser(prog="minipar bench profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=tuple(MODELS), default="default",
                   help="the default GPT (d 64, seq 32) or a wide one (d 256, seq 64)")
    p.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--recompute", choices=RECOMPUTE_MODES, default="none",
                   help="activation recomputation of the model (core/recompute.py)")
    p.add_argument("--repeats", type=int, default=10, help="steps timed (median) and profiled")
    p.add_argument("--top", type=int, default=12, help="operations listed, largest first")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    for name in ("batch", "repeats", "top"):
        if getattr(args, name) < 1:
            print(f"minipar bench profile: error: --{name} must be a positive integer, got "
                  f"{getattr(args, name)}", file=sys.stderr)
            return 2
    r = profile_figures(args.dtype, args.batch, args.repeats, args.model, args.recompute)
    if args.json:
        print(json.dumps(r))
    else:
        print_report(r, args.top)
    return 0
