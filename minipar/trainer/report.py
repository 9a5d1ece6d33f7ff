"""The end-of-run summary that `minipar train` prints on rank 0.

One table per question a reader asks of a parallel run: did it learn (loss first and last), how fast
(tokens/s), what each rank held (memory by category), what each step cost on the wire (bytes by
collective and by parallel dimension), how much the pipeline idled (bubble), and whether the layout
trained the same model as one process (largest deviation). Lesson: lessons/07_3d.md.
"""

from __future__ import annotations

import numpy as np

from minipar.core.nn import MLPNet
from minipar.trainer.reference import verdict_lines

MEMORY_COLUMNS = ("params", "grads", "optimizer", "activations_peak", "buffers_peak", "device_peak")


def rank_memory_table(rows: list[dict]) -> list[str]:
    """rows: one per world rank, {"rank", "coords": (dp, pp, tp, cp), "mem": {...}}; the cp coordinate
    is shown where a rank has one past 0 (context parallelism)."""
    with_cp = any(len(row["coords"]) > 3 and row["coords"][3] for row in rows)
    header = ("  rank (dp,pp,cp,tp) " if with_cp else "  rank (dp,pp,tp) ") + \
        "".join(f"{c:>17}" for c in MEMORY_COLUMNS)
    lines = ["memory per rank after the last step (bytes)", header]
    for row in rows:
        dp, pp, tp, cp = (*row["coords"], 0)[:4]
        coords = f"({dp},{pp},{cp},{tp})" if with_cp else f"({dp},{pp},{tp})"
        lines.append(f"  {row['rank']:4d} {coords}   " +
                     "".join(f"{row['mem'].get(c, 0):>17,}" for c in MEMORY_COLUMNS))
    return lines


def comm_table(comm: dict) -> list[str]:
    lines = [f"communication per step, rank 0: {comm['sent_bytes']:,} bytes "
             f"in {comm.get('messages', 0)} messages"]
    by_op = {k: v for k, v in comm["by_op"].items() if v}
    by_dim = {k: v for k, v in comm.get("by_dim", {}).items() if v}
    lines.append("  by collective: " + (", ".join(f"{k} {v:,}" for k, v in sorted(by_op.items())) or "none"))
    lines.append("  by dimension:  " + (", ".join(f"{k} {v:,}" for k, v in sorted(by_dim.items())) or "none"))
    return lines + link_lines(comm)


def link_lines(comm: dict) -> list[str]:
    """Bytes that stayed inside a node and bytes that crossed between nodes, per parallel dimension."""
    by_dim_link = {dim: links for dim, links in sorted(comm.get("by_dim_link", {}).items())
                   if any(links.values())}
    return [f"  {name:<15}" + (", ".join(f"{dim} {links.get(link, 0):,}"
                                         for dim, links in by_dim_link.items()) or "none")
            for name, link in (("intra-node:", "intra"), ("inter-node:", "inter"))]


def pipeline_line(records: list[dict]) -> list[str]:
    timings = [r["pipeline"] for r in records[1:] if r.get("pipeline")] or \
              [r["pipeline"] for r in records if r.get("pipeline")]
    if not timings:
        return []
    measured = np.median([t.get("bubble_measured", np.nan) for t in timings])
    formula = timings[-1].get("bubble_formula", float("nan"))
    return [f"pipeline bubble: measured {measured:.3f} (median over steps), "
            f"formula {timings[-1].get('formula', '(K-1)/(M+K-1)')} = {formula:.3f}"]


def accuracy_line(cfg, records: list[dict]) -> list[str]:
    """What the accuracy counts (tasks.py's answer positions; nn.py's MLPNet tolerance), first and last."""
    if "accuracy" not in records[-1] or "accuracy" not in records[0]:
        return []
    what = "answer digits predicted exactly" if cfg.is_gpt else \
        f"outputs within {MLPNet.ACCURACY_TOLERANCE} of the target"
    return [f"accuracy ({what}): first {records[0]['accuracy']:.3f}, last {records[-1]['accuracy']:.3f}"]


def zero_stage(cfg) -> str:
    """Chunked offload is ZeRO-3 over chunks, whatever --zero said (0 or 3)."""
    return f"3 (chunked, offload {cfg.offload})" if cfg.chunked else str(cfg.zero)


def summary(cfg, records: list[dict], rank_rows: list[dict], check: dict | None,
            samples: list[str] = ()) -> str:
    """`samples`: decoded predictions of the trained model (loop.py decoded_predictions), if any."""
    last = records[-1]
    rate = np.median([r["tokens_per_s"] for r in records[1:]] or [last["tokens_per_s"]])
    unit = "tokens/s" if cfg.is_gpt else "samples/s"
    lines = [
        "",
        f"layout: dp={cfg.dp} pp={cfg.pp} {f'cp={cfg.cp} ' if cfg.cp > 1 else ''}tp={cfg.tp} "
        f"zero={zero_stage(cfg)} precision={cfg.precision} "
        f"microbatches={cfg.microbatches} schedule={cfg.schedule if cfg.pp > 1 else '-'}",
        f"loss: first {records[0]['loss']:.4f}, last {last['loss']:.4f} over {len(records)} steps",
        *accuracy_line(cfg, records),
        f"speed: {rate:,.0f} {unit} (median over steps after the first)",
        *rank_memory_table(rank_rows),
        *comm_table(last["comm"]),
        *pipeline_line(records),
    ]
    if samples:
        lines.append("predictions on a batch it did not train on (each answer digit given the ones before):")
        lines += [f"  {sample}" for sample in samples]
    if check:  # last: the verdict (and the drift where the run went past the steps it judges)
        lines += verdict_lines(check, cfg.steps)
    return "\n".join(lines)
