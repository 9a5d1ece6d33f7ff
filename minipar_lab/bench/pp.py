"""`python -m minipar bench pp`: the pipeline bubble measured in wall time, beside (K-1)/(M+K-1).

Runs `python -m minipar train --pp K` under `mpiexec -n K` for the naive schedule and for GPipe and
1F1B at each number of micro-batches M (each setting several times, interleaved), reads rank 0's
JSON-lines log and prints, as medians over the steps after a warm-up: the measured bubble
(1 - busy / (K x makespan): the stages' compute time against the wall time of the step), the
formula's bubble, each stage's share of the compute and its forward and backward time per
micro-batch (the formula assumes equal stages), the step time, and stage 0's activation peak
(GPipe holds M micro-batches there, 1F1B at most K). Each rank gets one BLAS thread, so K ranks
need K free cores.
Lesson: lessons/06b_pipeline_schedules.md (the bubble measured).

    python -m minipar bench pp [--stages 2] [--microbatches 1 2 4 8] [--steps 8] [--warmup 2]
                               [--repeats 3] [--json] [train options...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from minipar.trainer.arguments import parse_train_args
from minipar.trainer.launch import run_train
from minipar.trainer.validate import validate
from minipar_lab.bench.table import right_aligned
from minipar_lab.bench.timing import SPREAD, Progress, plus_minus, spread

DEFAULT_TRAIN_ARGS = ["--batch-size", "32", "--d-model", "128", "--n-layer", "2"]


def runs(microbatches: list[int]) -> list[tuple[str, int]]:
    """(schedule, M) pairs: naive once (it always runs one micro-batch), GPipe and 1F1B at every M."""
    return [("naive", 1)] + [(name, m) for m in microbatches for name in ("gpipe", "1f1b")]


def measure(stages: int, microbatches: list[int], steps: int, warmup: int, repeats: int,
            train_args: list[str]) -> dict:
    kept = {run: [] for run in runs(microbatches)}  # records after warm-up, all repeats
    with tempfile.TemporaryDirectory() as folder:
        progress = Progress("pp", repeats * len(kept))
        for repeat in range(repeats):  # interleaved: a change in the machine's load hits every run alike
            for schedule, m in kept:
                progress(f"{schedule} M={m} (repeat {repeat + 1})")
                args = [*train_args, "--pp", str(stages), "--schedule", schedule, "--microbatches", str(m),
                        "--steps", str(steps)]
                kept[schedule, m] += run_train(stages, args, Path(folder) / "pp.jsonl")[warmup:]
    rows = []
    for (schedule, m), records in kept.items():
        busy = np.median([r["pipeline"]["stage_busy_s"] for r in records], axis=0)
        forward = np.median([r["pipeline"]["stage_forward_s"] for r in records], axis=0) / m
        backward = np.median([r["pipeline"]["stage_backward_s"] for r in records], axis=0) / m
        bubble, bubble_spread = spread(records, lambda r: r["pipeline"]["bubble_measured"])
        step, step_spread = spread(records, lambda r: r["time_s"])
        rows.append({
            "schedule": schedule,
            "microbatches": m,
            "bubble_measured": bubble,
            "bubble_measured_spread": bubble_spread,  # half the interquartile range, over steps and repeats
            "bubble_formula": records[-1]["pipeline"]["bubble_formula"],
            "stage_busy_share": [float(b) for b in busy / busy.sum()],
            "stage_forward_s": [float(f) for f in forward],  # per micro-batch
            "stage_backward_s": [float(b) for b in backward],
            "step_s": step,
            "step_s_spread": step_spread,
            "stage0_activations_peak": int(records[-1]["mem"]["activations_peak"]),
            "stage0_sent_bytes": int(records[-1]["comm"]["sent_bytes"]),
        })
    return {"train_args": train_args, "stages": stages, "repeats": repeats, "rows": rows}


def per_stage(values, scale: float = 1.0, digits: int = 2) -> str:
    return "/".join(f"{v * scale:.{digits}f}" for v in values)


COLUMNS = [  # (header, how to show a row's figure); "a/b" lists stage 0, stage 1, ...
    ("schedule", lambda r: r["schedule"]),
    ("M", lambda r: r["microbatches"]),
    ("bubble measured", lambda r: plus_minus(r["bubble_measured"], r["bubble_measured_spread"], digits=3)),
    ("formula", lambda r: f"{r['bubble_formula']:.3f}"),
    ("compute share", lambda r: per_stage(r["stage_busy_share"])),
    ("F ms/mb", lambda r: per_stage(r["stage_forward_s"], 1e3, 1)),
    ("B ms/mb", lambda r: per_stage(r["stage_backward_s"], 1e3, 1)),
    ("step ms", lambda r: plus_minus(r["step_s"], r["step_s_spread"], 1e3)),
    ("stage-0 activations B", lambda r: r["stage0_activations_peak"]),
    ("stage-0 sent B", lambda r: r["stage0_sent_bytes"]),
]


def render(figures: dict, warmup: int) -> str:
    return "\n".join(
        [f"minipar train {' '.join(figures['train_args'])} --pp {figures['stages']}  (medians over "
         f"{figures['repeats']} interleaved runs, after {warmup} warm-up steps each; a shared machine)",
         f"per-stage figures a/b: stage 0/stage 1; F and B ms/mb: compute per micro-batch; a ± b: {SPREAD}"]
        + right_aligned(figures["rows"], COLUMNS))


def main(argv) -> int:
    p = argparse.ArgumentParser(prog="minipar bench pp", description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=2, help="pipeline stages K (= ranks)")
    p.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    p.add_argument("--repeats", type=int, default=3, help="runs of each setting, interleaved")
    p.add_argument("--json", action="store_true")
    args, train_args = p.parse_known_args(argv)
    train_args = train_args or DEFAULT_TRAIN_ARGS
    problems = [] if args.steps > args.warmup and args.repeats > 0 else [
        "--steps must exceed --warmup, and --repeats be positive"]
    for m in args.microbatches:
        cfg = parse_train_args([*train_args, "--pp", str(args.stages), "--microbatches", str(m)])
        problems += validate(cfg, args.stages)
    if problems:
        print(f"minipar bench pp: error: {'; '.join(dict.fromkeys(problems))}", file=sys.stderr)
        return 2
    figures = measure(args.stages, args.microbatches, args.steps, args.warmup, args.repeats, train_args)
    print(json.dumps(figures) if args.json else render(figures, args.warmup), flush=True)
    return 0
