"""`python -m minipar bench context`: context parallelism at cp = 1, 2, 4, measured.

Runs `python -m minipar train --cp C --dp 1` on C processes for each C (same model, same global batch),
interleaved, and reads rank 0's logs: tokens/s (median after a warm-up), the activation peak, and the
bytes per step on the cp ring and over dp x cp, beside the ring's formula (parallel/context.py's
`ring_attention_bytes` for every layer and micro-batch). Lesson: lessons/13_context_parallel.md.

    python -m minipar bench context [--sizes 1,2,4] [--steps 8] [--warmup 2] [--repeats 2] [--json]
                                    [--plot FILE] [train options]

`--plot FILE` also saves a PNG (needs matplotlib, the `viz` extra): which rank computes each block of
the causal mask under a contiguous and under the zig-zag split, and the measured activation peaks.
`work_map` draws the same assignment as text.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from minipar.parallel.context import chunks_of, ring_attention_bytes
from minipar.trainer.arguments import parse_train_args
from minipar.trainer.launch import run_train
from minipar.trainer.validate import validate
from minipar_lab.bench import canvas
from minipar_lab.bench.table import right_aligned
from minipar_lab.bench.timing import SPREAD, Progress, plus_minus, spread


def ring_formula(cfg, cp: int) -> int:
    """Bytes rank 0 should send on the cp ring per step: every layer, every micro-batch."""
    itemsize = 8 if cfg.precision == "fp64" else 4
    batch = cfg.batch_size // cfg.microbatches
    return cfg.n_layer * cfg.microbatches * ring_attention_bytes(batch, cfg.seq_len, cfg.d_model, cp, cfg.tp,
                                                                 itemsize)


def measure(sizes: list[int], steps: int, warmup: int, repeats: int, train_args: list[str]) -> dict:
    cfg = parse_train_args(train_args)
    kept: dict[int, list] = {cp: [] for cp in sizes}
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "train.jsonl"
        progress = Progress("context", repeats * len(sizes))
        for repeat in range(repeats):  # interleaved, so a change in the machine's load hits every cp alike
            for cp in sizes:
                progress(f"cp={cp} (repeat {repeat + 1})")
                args = [*train_args, "--cp", str(cp), "--dp", "1", "--steps", str(steps)]
                kept[cp] += run_train(cp * cfg.tp, args, log)[warmup:]
    rows = []
    for cp, records in kept.items():
        by_dim = records[-1]["comm"].get("by_dim", {})
        tokens, tokens_spread = spread(records, lambda r: r["tokens_per_s"])
        rows.append({
            "cp": cp,
            "tokens_per_s": tokens,
            "tokens_per_s_spread": tokens_spread,  # half the interquartile range, over steps and repeats
            "activations_peak": records[-1]["mem"]["activations_peak"],
            "cp_bytes": by_dim.get("cp", 0),
            "cp_formula_bytes": ring_formula(cfg, cp),
            "gradient_bytes": by_dim.get("dp_cp", 0),
        })
    for row in rows:
        row["activations_ratio"] = row["activations_peak"] / rows[0]["activations_peak"]
    return {"train_args": train_args, "repeats": repeats, "rows": rows}


COLUMNS = [
    ("cp", lambda r: r["cp"]),
    ("tokens/s", lambda r: plus_minus(r["tokens_per_s"], r["tokens_per_s_spread"], digits=0)),
    ("activations B", lambda r: f"{r['activations_peak']:,}"),
    ("vs cp=1", lambda r: f"{r['activations_ratio']:.3f}"),
    ("cp ring B/step", lambda r: f"{r['cp_bytes']:,}"),
    ("formula B/step", lambda r: f"{r['cp_formula_bytes']:,}"),
    ("gradients B/step", lambda r: f"{r['gradient_bytes']:,}"),
]


def render(figures: dict, warmup: int) -> str:
    return "\n".join(
        [f"minipar train {' '.join(figures['train_args']) or '(default options)'} --cp C --dp 1   "
         "(rank 0's figures)",
         f"medians over {figures['repeats']} interleaved runs of each cp, after {warmup} warm-up steps; "
         f"a ± b: {SPREAD}"]
        + right_aligned(figures["rows"], COLUMNS)
        + ["formula: per layer and micro-batch (C-1) x 2S forward, (C-1) x 4S + 2S backward, "
           "S = batch * T/C * d_model/tp * itemsize"])


def work_map(cp: int, zigzag: bool = True) -> list[list[int | None]]:
    """cells[a][b]: the rank that computes query chunk a against key chunk b (None above the diagonal,
    which the causal mask skips), the sequence cut into 2C chunks."""
    owner = {}
    for rank in range(cp):
        for chunk in (chunks_of(rank, cp) if zigzag else (2 * rank, 2 * rank + 1)):
            owner[chunk] = rank
    return [[owner[a] if b <= a else None for b in range(2 * cp)] for a in range(2 * cp)]


def draw_work_map(cp: int, zigzag: bool = True) -> str:
    """work_map as text: one row per query chunk, the computing rank's digit in each block it computes."""
    cells = work_map(cp, zigzag)
    counts = [sum(row.count(rank) for row in cells) for rank in range(cp)]
    split = "zig-zag" if zigzag else "contiguous"
    lines = [f"{split} split, cp={cp}: query chunk (row) x key chunk (column)"]
    lines += [f"  q{a:<2d} " + " ".join("." if cell is None else str(cell) for cell in row)
              for a, row in enumerate(cells)]
    lines.append("  blocks per rank: " + ", ".join(f"rank {r} {n}" for r, n in enumerate(counts)))
    return "\n".join(lines)


def save_plot(path: str, figures: dict, cp: int = 4) -> str:
    plt = canvas.pyplot()
    import numpy as np

    figure, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    colours = canvas.listed_colormap(plt.get_cmap("tab10").colors[:cp])
    for ax, zigzag in zip(axes, (False, True)):
        cells = np.array([[np.nan if c is None else c for c in row] for row in work_map(cp, zigzag)])
        ax.imshow(cells, cmap=colours, vmin=-0.5, vmax=cp - 0.5)
        counts = [int(np.sum(cells == r)) for r in range(cp)]
        ax.set(title=f"{'zig-zag' if zigzag else 'contiguous'} split, cp={cp}: blocks per rank {counts}",
               xlabel="key chunk", ylabel="query chunk")
        for a, row in enumerate(cells):
            for b, rank in enumerate(row):
                if not np.isnan(rank):
                    ax.text(b, a, f"r{int(rank)}", ha="center", va="center", fontsize=8)
    rows = figures["rows"]
    axes[2].bar([str(r["cp"]) for r in rows], [r["activations_peak"] / 2**20 for r in rows])
    axes[2].set(title="activation peak per rank, measured", xlabel="cp", ylabel="MiB")
    canvas.save(figure, path, dpi=110)
    return f"plot saved to {path}"


def main(argv) -> int:
    what = ("Runs `minipar train --cp C --dp 1` on C processes for each C of --sizes, on the same model and "
            "global batch, and prints per cp: tokens/s (median after --warmup), rank 0's activation peak, "
            "and the bytes per step on the cp ring beside the ring-attention formula.")
    p = argparse.ArgumentParser(prog="minipar bench context", description=f"{__doc__.splitlines()[0]} {what}",
                                epilog="Every other option is a `minipar train` option, given to each run: "
                                       "--seq-len, --batch-size, --n-layer, --d-model, --tp, ... "
                                       "(lesson 13: lessons/13_context_parallel.md).")
    p.add_argument("--sizes", default="1,2,4", help="the cp values, comma-separated")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="steps of each run left out of the medians")
    p.add_argument("--repeats", type=int, default=2, help="runs of each cp, interleaved")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", default=None, help="save the causal balance and the activations as a PNG")
    args, train_args = p.parse_known_args(argv)
    cfg = parse_train_args(train_args)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip().isdigit()]
    problems = [e for cp in sizes for e in validate(cfg.replace(cp=cp, dp=1), cp * cfg.tp)]
    if not sizes or problems or args.steps <= args.warmup or args.repeats < 1:
        print(f"minipar bench context: error: --sizes must list cp values that fit the model "
              f"({'; '.join(problems) or 'ok'}), --steps must exceed --warmup, --repeats must be positive",
              file=sys.stderr)
        return 2
    if args.plot:
        canvas.pyplot()  # no matplotlib: say so now, not after the measuring
    figures = measure(sizes, args.steps, args.warmup, args.repeats, train_args)
    print(json.dumps(figures) if args.json else render(figures, args.warmup), flush=True)
    if args.plot:
        print(save_plot(args.plot, figures, max(sizes)), flush=True)
    return 0
