"""`minipar simulate`: predicted step time, throughput and memory per GPU of a run at any scale.

The cost model is minipar/simulate/ (this file parses the options, checks them in one line with exit
code 2, and prints a table or JSON). `--preset NAME` takes a published run's model and layout
(minipar/simulate/presets.py), its precision included; without a preset `--precision` is required
(a silent default would be 2x off for half the runs compared). Any model or layout flag given as well
overrides the preset. `--table1`
prints Narayanan et al.'s Table 1, published against predicted; `--published` the other published
runs (minipar/simulate/published.py), each on its own cluster and in its publisher's FLOP formula,
with the median error. Lesson: lessons/14_simulate.md.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace

from minipar.parallel import schedules
from minipar.simulate import kernels, presets, published, search
from minipar.simulate.machines import GPUS, machine
from minipar.simulate.model import ModelShape
from minipar.simulate.step import OVERLAPS, PRECISION_BYTES, Layout, layout_errors, simulate_step
from minipar.trainer.arguments import OneLineParser

MODEL_FLAGS = {"n_layer": 4, "d_model": 64, "n_head": 4, "seq_len": 32, "vocab": 27}
LAYOUT_FLAGS = {"batch_size": 16, "microbatches": 1, "dp": 1, "tp": 1, "pp": 1, "virtual_stages": 1}


def _parser() -> OneLineParser:
    parser = OneLineParser(prog="minipar simulate", description="Predict a training step at any scale.")
    parser.add_argument("--preset", choices=sorted(presets.MEGATRON_TABLE1) + sorted(presets.PRESETS))
    parser.add_argument("--table1", action="store_true", help="Narayanan et al. 2021 Table 1, every row")
    parser.add_argument("--published", action="store_true",
                        help="the other published runs (Megatron 2022, Megatron-Core, BLOOM, GPT-NeoX)")
    for name in list(MODEL_FLAGS) + list(LAYOUT_FLAGS):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    parser.add_argument("--schedule", choices=list(schedules.SCHEDULES), default=None)
    parser.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=None)
    parser.add_argument("--recompute", choices=("none", "selective", "full"), default=None)
    parser.add_argument("--sp", action="store_true", default=None)
    parser.add_argument("--precision", choices=list(PRECISION_BYTES), default=None)
    parser.add_argument("--overlap", nargs="+", choices=OVERLAPS, default=None,
                        help="communication that runs under compute: dp (bucketed gradient reduction and "
                             "ZeRO's gathers), tp (collectives under their GEMMs), pp (sends); default none")
    parser.add_argument("--gpu", choices=list(GPUS), default="a100-80gb")
    parser.add_argument("--gpus-per-node", type=int, default=None)
    for link in ("intra", "inter"):
        parser.add_argument(f"--{link}-bandwidth", type=float, default=None, help="GB/s each way per GPU")
        parser.add_argument(f"--{link}-latency", type=float, default=None, help="microseconds per message")
    parser.add_argument("--search", action="store_true",
                        help="rank every layout on --gpus GPUs by predicted step time")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs for --search")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return parser


def _positive(parser, args, names) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")


MAX_GPUS = 10**7  # --search: the largest machine it ranks layouts for (today's largest: about 10^5)


def _links_given(parser, args) -> None:
    """Every bandwidth and latency given is a positive finite number: 0 divides, nan and inf print
    nonsense, and a negative bandwidth prints a normal-looking time."""
    for link in ("intra", "inter"):
        for kind, unit in (("bandwidth", "GB/s"), ("latency", "microseconds")):
            value = getattr(args, f"{link}_{kind}")
            if value is not None and not 0 < value < math.inf:
                parser.error(f"--{link}-{kind} must be a positive finite number of {unit}, got {value:g}")


def _run_of(parser, args) -> tuple[ModelShape, Layout]:
    """The model and layout: the preset's (or the defaults), overridden by every flag given."""
    if args.preset:
        shape, layout, _ = presets.preset(args.preset)
    else:
        shape, layout = ModelShape(**MODEL_FLAGS), Layout(LAYOUT_FLAGS["batch_size"])
    shape = replace(shape, **{k: getattr(args, k) for k in MODEL_FLAGS if getattr(args, k) is not None})
    given = {k: getattr(args, k) for k in list(LAYOUT_FLAGS) + ["schedule", "zero", "recompute", "sp",
                                                                 "precision"] if getattr(args, k) is not None}
    if args.overlap is not None:
        given["overlap"] = tuple(sorted(set(args.overlap)))
    layout = replace(layout, **given)
    errors = layout_errors(shape, layout)
    if errors:
        parser.error(errors[0])
    if not args.preset and args.precision is None:
        # bytes per value, kernel traffic and memory all scale with it: no silent default
        parser.error("--precision is required without --preset (fp32, bf16, fp16, fp8 or fp64)")
    return shape, layout


def _search_run_of(parser, args) -> tuple[ModelShape, Layout]:
    """The model and the global batch a search keeps; the layout flags are what it varies."""
    shape, layout = _run_of(parser, argparse.Namespace(**{**vars(args), **{k: None for k in LAYOUT_FLAGS
                                                                           if k != "batch_size"}}))
    return shape, layout


def _print_search(found: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(found))
        return
    print(f"{found['fitting']} layouts fit; the best {len(found['ranked'])}:")
    print(f"{'dp':>4}{'tp':>4}{'pp':>4}{'b':>3}{'zero':>5} {'recompute':<10}{'sp':<4}{'TFLOP/s':>8}{'MFU':>7}"
          f"{'step s':>9}{'GB':>7}")
    for r in found["ranked"]:
        print(f"{r['dp']:>4}{r['tp']:>4}{r['pp']:>4}{r['microbatch_size']:>3}{r['zero']:>5} "
              f"{r['recompute']:<10}"
              f"{'yes' if r['sp'] else 'no':<4}{r['tflops_per_gpu']:>8.1f}{r['mfu']:>7.1%}{r['step_s']:>9.3g}"
              f"{r['memory_gb']:>7.1f}")
    for reason, count in found["refused"].items():
        print(f"refused: {count} layouts ({reason})")


def _machine(args):
    gb, us = 1e9, 1e-6
    return machine(args.gpu, gpus_per_node=args.gpus_per_node,
                   intra_bandwidth=args.intra_bandwidth and args.intra_bandwidth * gb,
                   inter_bandwidth=args.inter_bandwidth and args.inter_bandwidth * gb,
                   intra_latency=args.intra_latency and args.intra_latency * us,
                   inter_latency=args.inter_latency and args.inter_latency * us)


def _print_table1(rows, as_json: bool) -> None:
    if as_json:
        print(json.dumps(rows))
        return
    print(f"{'run':<15}{'GPUs':>6}{'tp':>4}{'pp':>4}{'dp':>4}{'published':>11}{'predicted':>11}{'error':>8}"
          f"{'bubble':>8}")
    for r in rows:
        print(f"{r['name']:<15}{r['gpus']:>6}{r['tp']:>4}{r['pp']:>4}{r['dp']:>4}{r['published']:>11}"
              f"{r['predicted']:>11.1f}{r['error']:>+8.1%}{r['bubble_fraction']:>8.3f}")


def _print_published(rows, as_json: bool) -> None:
    median = published.median_abs_error(rows)
    if as_json:
        print(json.dumps({"runs": rows, "median_abs_error": median}))
        return
    print(f"{'run':<16}{'kind':<15}{'GPUs':>5}{'tp':>3}{'pp':>3}{'dp':>4}{'figure':>8}{'published':>10}"
          f"{'predicted':>10}{'error':>8}")
    for r in rows:
        figure = "TFLOP/s" if r["metric"] == "tflops" else "MFU %"
        print(f"{r['name']:<16}{r['kind']:<15}{r['gpus']:>5}{r['tp']:>3}{r['pp']:>3}{r['dp']:>4}{figure:>8}"
              f"{r['published']:>10.1f}{r['predicted']:>10.1f}{r['error']:>+8.1%}")
    print(f"median |error| {median:.1%} over {len(rows)} runs; beyond 20%: "
          f"{', '.join(r['name'] for r in rows if abs(r['error']) > 0.20) or 'none'}")


def _print_result(shape, layout, result) -> None:
    print(f"model: {result['parameters'] / 1e9:.3g}B parameters (L={shape.n_layer}, h={shape.d_model}, "
          f"a={shape.n_head}, s={shape.seq_len}, V={shape.vocab}) on {result['gpus']} GPUs "
          f"(dp {layout.dp} x tp {layout.tp} x pp {layout.pp})")
    print(f"step: {result['step_s']:.4g} s, {result['tflops_per_gpu']:.1f} TFLOP/s per GPU, "
          f"MFU {result['mfu']:.1%}, bubble {result['bubble_fraction']:.3f}")
    comm = ", ".join(f"{dim} {seconds:.3g} s" for dim, seconds in result["comm_s"].items())
    if layout.overlap:
        exposed = ", ".join(f"{dim} {seconds:.3g} s" for dim, seconds in result["exposed_comm_s"].items())
        comm += f" (overlapped: {' '.join(layout.overlap)}; exposed: {exposed})"
    print(f"compute {result['compute_s']:.4g} s; communication: {comm}")
    mem = result["memory"]
    parts = ", ".join(f"{k} {mem[k] / 2**30:.2f}" for k in ("params", "grads", "optimizer", "activations"))
    verdict = "fits" if mem["fits"] else "does NOT fit"
    print(f"memory per GPU (GiB): {parts}; total {mem['total'] / 2**30:.2f} of "
          f"{mem['capacity'] / 2**30:.1f}: {verdict}")


def simulate_main(argv: list[str]) -> int:
    """The `minipar simulate` command."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        _positive(parser, args, list(MODEL_FLAGS) + list(LAYOUT_FLAGS) + ["gpus_per_node"])
        _links_given(parser, args)
        mach = _machine(args)
        if args.table1:
            _print_table1(presets.table1(mach), args.json)
            return 0
        if args.published:  # each run on its own cluster: the machine flags do not apply
            _print_published(published.table(), args.json)
            return 0
        if args.search and args.gpus is None:
            parser.error("--search needs --gpus N")
        _positive(parser, args, ["gpus"])
        if args.gpus is not None and args.gpus > MAX_GPUS:
            parser.error(f"--gpus {args.gpus:,} is more than the {MAX_GPUS:,} a search takes")
        shape, layout = _run_of(parser, args) if not args.search else _search_run_of(parser, args)
        if mach.kernels is not None and not kernels.supports(mach.kernels, layout.precision):
            parser.error(kernels.precision_error(mach.name, layout.precision))
    except SystemExit as exit_request:
        return int(exit_request.code or 0)
    if args.search:
        _print_search(search.search(shape, args.gpus, layout.batch_size, mach, layout.precision,
                                    overlap=layout.overlap), args.json)
        return 0
    result = simulate_step(shape, layout, mach)
    if args.json:
        print(json.dumps(result))
    else:
        _print_result(shape, layout, result)
    return 0
