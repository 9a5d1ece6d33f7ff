"""The loss (and the accuracy, where the log has it) against the step, from `minipar train --log` files.

    python -m minipar plot loss [--log FILE ...] [--out DIR]

Without --log it trains the default GPT for 60 steps on one process first and draws that run's log.
Lesson: lessons/00_overview.md.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from minipar.trainer.launch import read_log, run_train
from minipar_lab.bench import canvas

FILE = "00_loss.png"
DEFAULT_RUN = ["--steps", "60"]  # the default GPT, one process


def add_arguments(p) -> None:
    p.add_argument("--log", type=Path, nargs="+", default=None,
                   help="JSON-lines logs of `minipar train --log`")


def curves(records: list[dict]) -> dict[str, list]:
    """{"step": [...], "loss": [...]} and "accuracy" where every record has that key; a loss the log
    wrote as null (not finite) is NaN, a gap in the line.

    A log written under `minipar launch` also holds its restart records ({"event": "restart", ...}, no
    step: left out) and, after each, the steps since the checkpoint a second time: the later record of
    a step counts, as the relaunched run's is the one the final weights came from."""
    records = [r for r in records if not (isinstance(r, dict) and isinstance(r.get("event"), str))]
    if not records:
        raise ValueError("not a `minipar train --log` file: it has no records")
    for line, record in enumerate(records, 1):
        if not (isinstance(record, dict) and _is_number(record.get("step"), integer=True)
                and (record.get("loss") is None and "loss" in record or _is_number(record.get("loss")))
                and (record.get("accuracy") is None or _is_number(record["accuracy"]))):
            raise ValueError(f"not a `minipar train --log` file: record {line} ({str(record)[:60]}) needs "
                             "an integer step and a number (or null) as its loss")
    records = sorted({r["step"]: r for r in records}.values(), key=lambda r: r["step"])  # the later counts
    series = {"step": [r["step"] for r in records],
              "loss": [float("nan") if r["loss"] is None else r["loss"] for r in records]}
    if records and all("accuracy" in r for r in records):
        series["accuracy"] = [r["accuracy"] for r in records]
    return series


def _is_number(value, integer: bool = False) -> bool:
    kinds = int if integer else (int, float)
    return isinstance(value, kinds) and not isinstance(value, bool)


def draw(args, path: Path) -> None:
    with tempfile.TemporaryDirectory() as folder:
        logs = args.log or [Path(folder) / "default_gpt.jsonl"]
        if not args.log:
            run_train(1, DEFAULT_RUN, logs[0])
        runs = {log.stem: curves(read_log(log)) for log in logs}
    plt = canvas.pyplot()
    with_accuracy = any("accuracy" in c for c in runs.values())
    figure, axes = plt.subplots(1, 2 if with_accuracy else 1, figsize=(10 if with_accuracy else 6, 4),
                                squeeze=False)
    for name, series in runs.items():
        axes[0][0].plot(series["step"], series["loss"], label=name)
        if "accuracy" in series:
            axes[0][1].plot(series["step"], series["accuracy"], label=name)
    axes[0][0].set(xlabel="step", ylabel="loss", title="training loss")
    if with_accuracy:
        axes[0][1].set(xlabel="step", ylabel="accuracy", title="accuracy", ylim=(0, 1))
    for ax in axes[0]:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    canvas.save(figure, path)
