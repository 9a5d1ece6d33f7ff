"""`python -m minipar bench tp`: what tensor parallelism sends, against data parallelism, measured.

Runs `python -m minipar train` on one process, then on N processes as `--tp N` and as `--dp N`, on the
same global batch, and reads rank 0's logs: bytes sent and all-reduces per step, parameter bytes
per rank, median tokens/s after a warm-up. To measure the traffic of one transformer block it also
runs each layout for one step with one block more (`--n-layer L+1`): the difference is what a block
sends. Beside it the formulas: tensor parallel 4 all-reduces of (batch, seq, d_model) activations,
data parallel one all-reduce of the block's gradient, each at the ring's 2(N-1)/N.
Lesson: lessons/05_tensor_parallel.md.

    python -m minipar bench tp [--size 2] [--steps 12] [--warmup 2] [--repeats 2] [--json] [train options]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from minipar.core.nn import Block
from minipar.trainer.arguments import parse_train_args
from minipar.trainer.build import model_config
from minipar.trainer.launch import run_train
from minipar.trainer.validate import validate
from minipar_lab.bench.table import right_aligned
from minipar_lab.bench.timing import SPREAD, Progress, median, plus_minus, spread


def first_step_bytes(ranks, args, log) -> int:
    return run_train(ranks, [*args, "--steps", "1"], log)[0]["comm"]["sent_bytes"]


def block_formulas(cfg, n: int) -> dict:
    """Bytes one block should send per rank per step in each layout, by the ring's 2(N-1)/N."""
    itemsize = 8 if cfg.precision == "fp64" else 4
    activation = cfg.batch_size * cfg.seq_len * cfg.d_model * itemsize  # every tp rank sees the whole batch
    block_params = sum(p.data.size for p in Block(model_config(cfg)).parameters())
    ring = 2 * (n - 1) / n
    return {"tp": 4 * ring * activation, "dp": ring * block_params * itemsize}


def measure(n: int, steps: int, warmup: int, repeats: int, train_args: list[str]) -> dict:
    cfg = parse_train_args(train_args)
    layouts = {"single": (1, ["--dp", "1"]), "tp": (n, ["--tp", str(n), "--dp", "1"]),
               "dp": (n, ["--dp", str(n)])}
    kept = {name: [] for name in layouts}
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "train.jsonl"
        progress = Progress("tp", repeats * len(layouts) + 2 * (len(layouts) - 1))
        for repeat in range(repeats):  # interleaved: a change in the machine's load hits every layout alike
            for name, (ranks, extra) in layouts.items():
                progress(f"{name if name == 'single' else f'{name}={n}'} (repeat {repeat + 1})")
                kept[name] += run_train(ranks, [*train_args, *extra, "--steps", str(steps)], log)[warmup:]
        deeper = [*train_args, "--n-layer", str(cfg.n_layer + 1)]
        per_block = {}
        for name, (ranks, extra) in layouts.items():
            if name != "single":
                progress(f"{name}={n}: one step at {cfg.n_layer + 1} layers (for the bytes of a block)")
                deeper_bytes = first_step_bytes(ranks, [*deeper, *extra], log)
                progress(f"{name}={n}: one step at {cfg.n_layer} layers")
                per_block[name] = deeper_bytes - first_step_bytes(ranks, [*train_args, *extra], log)
    formulas = block_formulas(cfg, n)
    rows = []
    for name, records in kept.items():
        sent = int(median(records, lambda r: r["comm"]["sent_bytes"]))
        messages = int(median(records, lambda r: r["comm"]["messages"]))
        tokens, tokens_spread = spread(records, lambda r: r["tokens_per_s"])
        rows.append({
            "layout": name if name == "single" else f"{name}={n}",
            "tokens_per_s": tokens,
            "tokens_per_s_spread": tokens_spread,  # half the interquartile range, over steps and repeats
            "params_bytes": records[-1]["mem"]["params"],
            "sent_bytes_per_step": sent,
            "all_reduces_per_step": messages // (2 * (n - 1)) if name != "single" else 0,
            "block_bytes": per_block.get(name, 0),
            "block_formula_bytes": formulas.get(name, 0.0),
        })
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    return {"train_args": train_args, "size": n, "repeats": repeats, "rows": rows}


COLUMNS = [
    ("layout", lambda r: r["layout"]),
    ("tokens/s", lambda r: plus_minus(r["tokens_per_s"], r["tokens_per_s_spread"], digits=0)),
    ("speed-up", lambda r: f"{r['speedup']:.2f}x"),
    ("params B/rank", lambda r: r["params_bytes"]),
    ("sent B/step", lambda r: r["sent_bytes_per_step"]),
    ("all-reduces/step", lambda r: r["all_reduces_per_step"]),
    ("sent B/block", lambda r: r["block_bytes"]),
    ("formula B/block", lambda r: f"{r['block_formula_bytes']:.0f}"),
]


def render(figures: dict, warmup: int) -> str:
    return "\n".join(
        [f"minipar train {' '.join(figures['train_args']) or '(default options)'}   (rank 0's figures)",
         f"medians over {figures['repeats']} interleaved runs of each layout, after {warmup} warm-up steps; "
         f"a ± b: {SPREAD}"]
        + right_aligned(figures["rows"], COLUMNS)
        + ["sent B/block: one step with --n-layer L+1 minus one with L; formula: tp 4 x 2(N-1)/N x "
           "batch*seq*d_model values, dp 2(N-1)/N x the block's parameters"])


def main(argv) -> int:
    p = argparse.ArgumentParser(prog="minipar bench tp", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=2, help="N: ranks of the tp run and of the dp run")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="steps of each run left out of the medians")
    p.add_argument("--repeats", type=int, default=2, help="runs of each layout, interleaved")
    p.add_argument("--json", action="store_true")
    args, train_args = p.parse_known_args(argv)
    cfg = parse_train_args(train_args)
    problems = validate(cfg.replace(tp=args.size, dp=1), args.size) + validate(cfg.replace(dp=args.size),
                                                                                   args.size)
    if args.size < 2 or problems or args.steps <= args.warmup or args.repeats < 1:
        print(f"minipar bench tp: error: --size must be at least 2 and fit the model as tp and as dp "
              f"({'; '.join(problems) or 'ok'}), --steps must exceed --warmup, --repeats must be positive",
              file=sys.stderr)
        return 2
    figures = measure(args.size, args.steps, args.warmup, args.repeats, train_args)
    print(json.dumps(figures) if args.json else render(figures, args.warmup), flush=True)
    return 0
