"""`python -m minipar bench tracer`: Gemini's memory tracer, measured on one rank.

Three measurements, from real training runs in this process (chunked ZeRO-3 with --offload cpu):

  least      the least device budget the warm-up step needs (`--device-mem-mb auto`) as the batch and
             the sequence grow, beside the up-front estimate that knows no activations, and the peaks
             of the activations and of the temporary buffers (gathered chunks, gradients handed over).
  placement  budgets from the least to the full model states (plus the non-model peak), LRU and OPT,
             for the GPT above and a deep, narrow MLP,
             placed by the trace (Gemini) or by the budget alone (static): bytes moved per step (median
             after the warm-up), prefetches evicted before their use, evictions in the middle of a
             computation, and the device peak against the budget.
  trace      the warm-up step's samples, moment by moment: blocks on the device, buffers, activations;
             `--plot FILE` draws them with the budget (needs matplotlib, the `viz` extra).

    python -m minipar bench tracer [--steps 4] [--plot lessons/figures/08_memory_trace.png] [--json]
Lesson: lessons/08_memory.md.
"""

from __future__ import annotations

import json

import numpy as np
from mpi4py import MPI

from minipar.memory.offload import MiB
from minipar.memory.tracer import round_up_mb
from minipar.parallel.zero_chunked import chunk_numel_for, device_bytes_needed
from minipar.trainer import build
from minipar.trainer.arguments import OneLineParser
from minipar.trainer.config import TrainConfig
from minipar_lab.bench import canvas
from minipar_lab.bench.table import right_aligned

# the run (--dp 2 --batch-size 16 --seq-len 16 --chunk-mb 0.25) as one of its two ranks sees it
BASE = TrainConfig(dp=1, zero=3, offload="cpu", chunk_mb=0.25, batch_size=8, seq_len=16, quiet=True)
SHAPES = [(2, 16), (8, 8), (8, 16), (8, 32), (16, 16)]  # (batch, sequence)
FRACTIONS = [0.0, 0.25, 0.5, 1.0]  # of the way from the least budget to everything on the device
# a deep, narrow MLP: small activations beside many blocks, where a blind prefetch can move a block twice
PLACED = {"gpt": BASE, "mlp": TrainConfig(model="mlp", n_layer=6, d_model=32, batch_size=4, dp=1,
                                          offload="cpu", precision="fp64", quiet=True)}


def train(cfg):
    from minipar.trainer.loop import Trainer

    trainer = Trainer(cfg, MPI.COMM_SELF)
    records = trainer.run()
    trainer.memory.close()
    return trainer, records


def measure_least() -> list[dict]:
    rows = []
    for batch, seq in SHAPES:
        cfg = BASE.replace(batch_size=batch, seq_len=seq, steps=1, device_mem_mb="auto")
        trainer, records = train(cfg)
        model = build.build_model(cfg.replace(offload="none", chunk_mb=None, device_mem_mb=None), None)
        up_front = device_bytes_needed(model, chunk_numel_for(cfg, model, 1), 1, 4, "cpu")
        summary = trainer.engine.updater.tracer.summary()
        rows.append({"batch": batch, "seq": seq, "least_bytes": records[0]["offload"]["budget_bytes"],
                     "up_front_bytes": up_front, "activations_peak": summary["activations_peak"],
                     "buffers_peak": summary["buffers_peak"], "moments": summary["moments"]})
    return rows


def measure_placement(steps: int) -> list[dict]:
    return [row for model, cfg in PLACED.items() for row in measure_placement_of(model, cfg, steps)]


def measure_placement_of(model: str, base: TrainConfig, steps: int) -> list[dict]:
    trainer, records = train(base.replace(steps=1, device_mem_mb="auto"))
    least = records[0]["offload"]["budget_bytes"]
    states = sum(sum(tiers.values()) for tiers in trainer.engine.updater.memory().values())
    everything = states + trainer.engine.updater.tracer.summary()["non_model_peak"]
    rows = []
    for fraction in FRACTIONS:
        budget_mb = round_up_mb(int(least + fraction * (everything - least)))
        for eviction in ("lru", "opt"):
            for static in (True, False):  # alternating, one of each per budget and policy
                cfg = base.replace(steps=steps, device_mem_mb=budget_mb, eviction=eviction,
                                   static_placement=static)
                after = train(cfg)[1][1:]
                rows.append({"model": model, "budget_mb": budget_mb, "fraction": fraction,
                             "eviction": eviction, "placement": "static" if static else "Gemini (traced)",
                             "moved_bytes": int(np.median([r["offload"]["moved_bytes"] for r in after])),
                             **{k: int(np.median([r["offload"][k] for r in after]))
                                for k in ("wasted_prefetches", "late_evictions", "evictions")},
                             "device_peak_mb": max(r["mem"]["device_peak"] for r in after) / MiB})
    return rows


def measure_trace(fraction: float = 0.25) -> dict:
    """The warm-up of a run whose budget is `fraction` of the way from the least to the full states."""
    trainer, records = train(BASE.replace(steps=1, device_mem_mb="auto"))
    least = records[0]["offload"]["budget_bytes"]
    states = sum(sum(tiers.values()) for tiers in trainer.engine.updater.memory().values())
    budget_mb = round_up_mb(int(least + fraction * states))
    trainer, _ = train(BASE.replace(steps=1, device_mem_mb=budget_mb))
    tracer = trainer.engine.updater.tracer
    return {"budget_bytes": budget_mb * MiB, "least_bytes": least, "samples": tracer.samples,
            "labels": [repr(label) for label in tracer.labels], **tracer.summary()}


LEAST_COLUMNS = [
    ("batch", lambda r: r["batch"]),
    ("seq", lambda r: r["seq"]),
    ("up-front MiB", lambda r: f"{r['up_front_bytes'] / MiB:.3f}"),
    ("activations peak MiB", lambda r: f"{r['activations_peak'] / MiB:.3f}"),
    ("buffers peak MiB", lambda r: f"{r['buffers_peak'] / MiB:.3f}"),
    ("least (auto) MiB", lambda r: f"{r['least_bytes'] / MiB:.4f}"),
]
PLACEMENT_COLUMNS = [
    ("model", lambda r: r["model"]),
    ("budget MiB", lambda r: f"{r['budget_mb']:.4f}"),
    ("of the way", lambda r: f"{r['fraction']:.0%}"),
    ("eviction", lambda r: r["eviction"]),
    ("placement", lambda r: r["placement"]),
    ("moved MiB/step", lambda r: f"{r['moved_bytes'] / MiB:.3f}"),
    ("wasted prefetches", lambda r: r["wasted_prefetches"]),
    ("evictions", lambda r: r["evictions"]),
    ("of them late", lambda r: r["late_evictions"]),
    ("device peak MiB", lambda r: f"{r['device_peak_mb']:.4f}"),
]


def render(figures: dict) -> str:
    trace = figures["trace"]
    return "\n".join(
        ["least budget by the warm-up's trace (--offload cpu --chunk-mb 0.25, the default GPT, fp32)"]
        + right_aligned(figures["least"], LEAST_COLUMNS)
        + ["", "placement (gpt: batch 8, sequence 16; mlp: 6 layers of width 32, batch 4, fp64): medians of "
           "the steps after the warm-up"]
        + right_aligned(figures["placement"], PLACEMENT_COLUMNS)
        + ["", f"trace: {trace['moments']} moments, least {trace['least_bytes'] / MiB:.4f} MiB, non-model "
           f"peak {trace['non_model_peak'] / MiB:.4f} MiB, budget {trace['budget_bytes'] / MiB:.4f} MiB"])


def moment_axis(samples: list[dict]) -> np.ndarray:
    """Each sample at its moment, the samples of one moment spread evenly until the next."""
    moments = np.array([s["moment"] for s in samples], dtype=float)
    for moment in np.unique(moments):
        where = np.flatnonzero(moments == moment)
        moments[where] += np.arange(len(where)) / len(where)
    return moments


def phases(trace: dict) -> dict:
    """Where forward, backward and the optimizer step begin: the activations' peak turns forward into
    backward, and the optimizer's first use of a moment estimate (Adam's exp_avg) opens the step."""
    samples = trace["samples"]
    backward = samples[int(np.argmax([s["activations"] for s in samples]))]["moment"]
    step = next(m for m, label in enumerate(trace["labels"]) if "exp_avg" in label) - 2  # param, grad first
    return {"forward": 0, "backward": backward, "optimizer step": step}


def save_plot(path: str, trace: dict) -> str:
    plt = canvas.pyplot()
    samples = trace["samples"]
    x = moment_axis(samples)
    layers = {"model states on the device (blocks)": [s["model"] for s in samples],
              "temporary buffers (gathered chunks, gradients)": [s["buffers"] for s in samples],
              "activations": [s["activations"] for s in samples]}
    figure, ax = plt.subplots(figsize=(12, 4.5))
    ax.stackplot(x, *(np.array(v) / MiB for v in layers.values()), labels=list(layers), alpha=0.8)
    ax.plot(x, np.array([s["need"] for s in samples]) / MiB, color="black", lw=0.8,
            label="need: blocks in use + non-model")
    ax.axhline(trace["budget_bytes"] / MiB, color="red", ls="--", label="budget (--device-mem-mb)")
    ax.axhline(trace["least_bytes"] / MiB, color="gray", ls=":", label="least budget (auto)")
    for name, moment in phases(trace).items():
        ax.axvline(moment, color="gray", lw=0.5)
        ax.text(moment + 0.3, trace["budget_bytes"] / MiB * 1.02, name, fontsize=8)
    ax.set(xlabel="moment of the step (each use of a block, each end of a use)", ylabel="MiB on the device",
           title="The warm-up step's memory: the default GPT, batch 8, sequence 16, chunks of 0.25 MiB, "
           "offload cpu", ylim=(0, trace["budget_bytes"] / MiB * 1.12))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    canvas.save(figure, path, dpi=110)
    return f"plot saved to {path}"


def main(argv) -> int:
    p = OneLineParser(prog="minipar bench tracer", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="steps per placement run (the first is the warm-up)")
    p.add_argument("--plot", default=None, help="save the warm-up's trace as a PNG (needs matplotlib)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error(f"--steps must be at least 2 (the first one is the warm-up), got {args.steps}")
    if args.plot:
        canvas.pyplot()  # no matplotlib: say so now, not after the measuring
    figures = {"least": measure_least(), "placement": measure_placement(args.steps), "trace": measure_trace()}
    if args.json:
        print(json.dumps({**figures, "trace": {k: v for k, v in figures["trace"].items() if k != "samples"}}))
    else:
        print(render(figures), flush=True)
    if args.plot:
        print(save_plot(args.plot, figures["trace"]), flush=True)
    return 0
