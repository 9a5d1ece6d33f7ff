"""`python -m minipar bench layouts`: every way of laying N ranks out as dp x pp x tp, measured.

Runs `python -m minipar train` under `mpiexec -n N` once per factorisation (same model, same global
batch) and prints, from rank 0's log, the tokens/s, what rank 0 holds (model states, activation peak)
and what each parallel dimension sends per step, with the pipeline's measured bubble.
Lesson: lessons/07_3d.md.

    python -m minipar bench layouts [--ranks 8] [--steps 6] [--zero 1] [--json] [train options]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from minipar.distributed.grid import factorisations
from minipar.memory.ledger import model_states
from minipar.trainer.arguments import parse_train_args
from minipar.trainer.launch import run_train
from minipar.trainer.validate import validate
from minipar_lab.bench.table import right_aligned
from minipar_lab.bench.timing import SPREAD, Progress, median, plus_minus, spread


def measure_layout(ranks, layout, steps, warmup, zero, train_args, folder) -> dict:
    dp, pp, tp = layout
    args = [*train_args, "--dp", str(dp), "--pp", str(pp), "--tp", str(tp), "--zero", str(zero),
            "--steps", str(steps)]
    records = run_train(ranks, args, Path(folder) / "layout.jsonl")[warmup:]
    last = records[-1]
    by_dim = last["comm"].get("by_dim", {})
    bubbles = [r["pipeline"]["bubble_measured"] for r in records if r.get("pipeline")]
    tokens, tokens_spread = spread(records, lambda r: r["tokens_per_s"])
    return {
        "dp": dp, "pp": pp, "tp": tp,
        "tokens_per_s": tokens,
        "tokens_per_s_spread": tokens_spread,  # half the interquartile range, over the steps
        "model_states": model_states(last["mem"]),
        "activations_peak": last["mem"]["activations_peak"],
        "dp_bytes": by_dim.get("dp", 0), "pp_bytes": by_dim.get("pp", 0), "tp_bytes": by_dim.get("tp", 0),
        "bubble": median(bubbles) if bubbles else None,
    }


COLUMNS = [  # (header, how to show a row's figure)
    ("dp", lambda r: r["dp"]),
    ("pp", lambda r: r["pp"]),
    ("tp", lambda r: r["tp"]),
    ("tokens/s", lambda r: plus_minus(r["tokens_per_s"], r["tokens_per_s_spread"], digits=0)),
    ("model states B", lambda r: f"{r['model_states']:,}"),
    ("activations B", lambda r: f"{r['activations_peak']:,}"),
    ("dp B/step", lambda r: f"{r['dp_bytes']:,}"),
    ("pp B/step", lambda r: f"{r['pp_bytes']:,}"),
    ("tp B/step", lambda r: f"{r['tp_bytes']:,}"),
    ("bubble", lambda r: "-" if r["bubble"] is None else f"{r['bubble']:.2f}"),
]


def render(rows: list[dict], header: str) -> str:
    return "\n".join([header] + right_aligned(rows, COLUMNS))


def main(argv) -> int:
    p = argparse.ArgumentParser(prog="minipar bench layouts", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--zero", type=int, default=1, choices=(0, 1))
    p.add_argument("--json", action="store_true")
    args, train_args = p.parse_known_args(argv)
    train_args = train_args or ["--microbatches", "4", "--batch-size", "16"]
    if args.ranks < 1 or args.steps <= args.warmup:
        print("minipar bench layouts: error: --ranks must be positive and --steps exceed --warmup",
              file=sys.stderr)
        return 2
    layouts, skipped = [], []
    for dp, pp, tp in factorisations(args.ranks):
        cfg = parse_train_args([*train_args, "--dp", str(dp), "--pp", str(pp), "--tp", str(tp)])
        errors = validate(cfg, args.ranks)
        if errors:
            skipped.append(f"  dp={dp} pp={pp} tp={tp}: {errors[0]}")
        else:
            layouts.append((dp, pp, tp))
    with tempfile.TemporaryDirectory() as folder:
        progress = Progress("layouts", len(layouts))
        rows = []
        for layout in layouts:
            progress("dp={} pp={} tp={}".format(*layout))
            rows.append(measure_layout(args.ranks, layout, args.steps, args.warmup, args.zero, train_args,
                                       folder))
    header = (f"{args.ranks} ranks, minipar train {' '.join(train_args)} --zero {args.zero}; "
              "rank 0's figures, "
              f"medians over {args.steps - args.warmup} steps after {args.warmup} warm-up; a ± b: {SPREAD}")
    if skipped and not args.json:
        header += "\nnot possible with this model:\n" + "\n".join(skipped)
    print(json.dumps(rows) if args.json else render(rows, header), flush=True)
    return 0
