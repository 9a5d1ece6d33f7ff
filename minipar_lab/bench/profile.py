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

With --torch (PyTorch installed: an optional extra, never in `make setup` nor CI) the same step of the
same GPT written in PyTorch (bench/torch_gpt.py: minipar's weights, AdamW) runs under PyTorch's own
profiler, and the operations of both are set side by side, each row minipar's Functions against the
ATen kernels that do the same work (AGAINST_TORCH), the rest of each profiled step below them: where
the one-process gap to PyTorch is (appendix 01b, "Against PyTorch"). Both profilers add their own cost:
cProfile to every Python call, PyTorch's to every kernel. Lesson: lessons/01b_speed_appendix.md.

    python -m minipar bench profile [--model default|wide] [--dtype float64|float32] [--batch 16]
                                    [--recompute none|selective|full] [--repeats 10] [--top 12]
                                    [--torch] [--json]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

from minipar.core import nn, optim
from minipar.core.autograd import Function
from minipar.core.recompute import RECOMPUTE_MODES, Recompute
from minipar.memory.ledger import MemoryLedger
from minipar.trainer.arguments import fail
from minipar.trainer.tasks import AdditionTask
from minipar_lab.bench import torch_gpt
from minipar_lab.bench.timing import spread

PHASES = ("forward", "backward", "optimizer", "communication")
# --torch: a row of the comparison -> (minipar's operations, PyTorch's kernels doing the same work). A
# Linear is three products (x W^T with its bias, g W, g^T x): addmm with a bias, mm without and in
# backward. PyTorch's bias gradient is a sum outside them, in its rest; minipar's is in Linear.backward.
AGAINST_TORCH = {
    "Linear": (("Linear.forward", "Linear.backward"), ("aten::addmm", "aten::mm")),
    "attention products": (("MatMul.forward", "MatMul.backward"), ("aten::bmm",)),
    "GELU": (("GELU.forward", "GELU.backward"), ("aten::gelu", "aten::gelu_backward")),
    "LayerNorm": (("LayerNorm.forward", "LayerNorm.backward"),
                  ("aten::native_layer_norm", "aten::native_layer_norm_backward")),
    "softmax": (("CausalSoftmax.forward", "Softmax.backward"),  # its backward is Softmax's, inherited
                ("aten::_softmax", "aten::_softmax_backward_data")),
    "AdamW": (("AdamW update",), ("Optimizer.step#AdamW.step",)),
}
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
                    recompute: str = "none", against_torch: bool = False) -> dict:
    step = GPTStep(dtype, batch, model, recompute)
    with MemoryLedger():  # listening, as in `minipar train`: its work is part of the step
        phases, phase_spreads = phase_seconds(step, repeats)
        ops, calls, graph_phases = op_seconds(step, repeats)
    in_ops = sum(seconds for name, seconds in ops.items() if name != "AdamW update")
    figures = {
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
        "profiled_s": graph_phases + ops.get("AdamW update", 0.0),  # forward, backward and AdamW
    }
    if against_torch:
        figures["torch"] = torch_figures(step, figures, repeats)
    return figures


def torch_figures(step: GPTStep, mine: dict, repeats: int) -> dict:
    """--torch: PyTorch's step of step's GPT under its profiler, against minipar's profiled `mine`:
    per AGAINST_TORCH row both engines' seconds and calls per step, and each profiled step."""
    theirs = torch_gpt.TorchGPTStep(step.model, step.tokens, step.targets)
    seconds, calls, profiled = torch_gpt.op_seconds(theirs, repeats)
    rows = {}
    for row, (ours, kernels) in AGAINST_TORCH.items():
        rows[row] = {"minipar_s": sum(mine["ops_s"].get(name, 0.0) for name in ours),
                     "minipar_calls": sum(mine["op_calls_per_step"].get(name, 0.0) for name in ours),
                     "torch_s": sum(seconds.get(name, 0.0) for name in kernels),
                     "torch_kernel_calls": {name: calls.get(name, 0.0) for name in kernels}}
    return {"version": torch_gpt.torch_version(), "rows": rows, "torch_profiled_s": profiled,
            "minipar_profiled_s": mine["profiled_s"]}


def print_torch_report(t: dict) -> None:
    print(f"against PyTorch {t['version']} on one thread, the same step under its profiler (ms per step)")
    print(f"  {'operation':<20} {'minipar':>8} {'PyTorch':>8}  ratio")
    rows = list(t["rows"].items())
    rest = ("the rest", {"minipar_s": t["minipar_profiled_s"] - sum(r["minipar_s"] for _, r in rows),
                         "torch_s": t["torch_profiled_s"] - sum(r["torch_s"] for _, r in rows)})
    whole = ("profiled step", {"minipar_s": t["minipar_profiled_s"], "torch_s": t["torch_profiled_s"]})
    for name, r in rows + [rest, whole]:
        ratio = f"{r['minipar_s'] / r['torch_s']:5.2f}" if r["torch_s"] > 0 else "    -"
        print(f"  {name:<20} {r['minipar_s'] * 1e3:8.2f} {r['torch_s'] * 1e3:8.2f}  {ratio}")


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
    profiled = r["profiled_s"]
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
    p.add_argument("--torch", action="store_true",
                   help="set PyTorch's step beside it, op by op (PyTorch installed: an optional extra)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    for name in ("batch", "repeats", "top"):
        if getattr(args, name) < 1:
            return fail(p.prog, f"--{name} must be a positive integer, got {getattr(args, name)}")
    if args.torch and torch_gpt.unavailable():
        return fail(p.prog, f"--torch: {torch_gpt.unavailable()}")
    if args.torch and args.recompute != "none":
        return fail(p.prog, "--torch compares the step without recomputation (PyTorch's has none)")
    r = profile_figures(args.dtype, args.batch, args.repeats, args.model, args.recompute, args.torch)
    if args.json:
        print(json.dumps(r))
        return 0
    print_report(r, args.top)
    if args.torch:
        print_torch_report(r["torch"])
    return 0

