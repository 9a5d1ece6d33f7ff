"""ZeRO's memory arithmetic: the model-state bytes one data-parallel rank holds at ZeRO stages 0-3.

The idea: plain data parallelism keeps a full copy of the parameters, the gradients and the optimizer
states on each of its N ranks. ZeRO partitions them over the ranks instead: stage 1 the optimizer
states, stage 2 the gradients too, stage 3 the parameters too. With Ψ parameters, p bytes per
parameter, g bytes per gradient and K bytes of optimizer state per parameter, one rank holds

    stage 0   (p+g+K)Ψ            stage 2   pΨ + (g+K)Ψ/N
    stage 1   (p+g)Ψ + KΨ/N       stage 3   (p+g+K)Ψ/N

(Rajbhandari et al., "ZeRO", 2020, section 5). The paper's mixed-precision Adam has p = g = 2 (fp16)
and K = 12 (fp32 master weights, momentum and variance): 16Ψ bytes without ZeRO. minipar in fp64 has
p = g = 8 and Adam's two fp64 moments K = 16, with no master copy.

What it saves: stage 3 divides model states by N. What it costs: stages 1 and 2 send what DP's
all-reduce sends (a reduce-scatter plus an all-gather); stage 3 sends 1.5x that, gathering parameters
in forward and backward. Activations and temporary buffers are not model states and are not counted.
Lesson 04 (ZeRO) uses `python -m minipar plan` to reproduce the paper's 7.5B-parameter example.
"""

from __future__ import annotations

import argparse
import json
import math
from fractions import Fraction

from minipar.trainer.arguments import OneLineParser

STAGES = (0, 1, 2, 3)
PARTITIONED = {
    0: "nothing (plain DP)",
    1: "optimizer states",
    2: "+ gradients",
    3: "+ parameters",
}


def bytes_per_parameter(stage: int, dp: int, k: int = 12, *, param_bytes: int = 2,
                        grad_bytes: int = 2) -> Fraction:
    """Model-state bytes one rank holds per model parameter: each part whole, or 1/N when partitioned."""
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    share = Fraction(1, dp)
    optimizer = k * share if stage >= 1 else Fraction(k)
    grads = grad_bytes * share if stage >= 2 else Fraction(grad_bytes)
    params = param_bytes * share if stage >= 3 else Fraction(param_bytes)
    return params + grads + optimizer


def model_state_bytes(params: int, dp: int, stage: int, k: int = 12, *, param_bytes: int = 2,
                      grad_bytes: int = 2, mp: int = 1) -> Fraction:
    """Bytes of parameters, gradients and optimizer states per device, exact.

    `mp` model-parallel devices (tensor or pipeline) split the model first, so each data-parallel group
    holds Ψ/mp parameters. With uneven shards this is the average over ranks; the fullest rank holds
    at most one element's bytes more.
    """
    per_parameter = bytes_per_parameter(stage, dp, k, param_bytes=param_bytes, grad_bytes=grad_bytes)
    return Fraction(params, mp) * per_parameter


def bytes_per_device(params: int, dp: int, k: int = 12, *, param_bytes: int = 2, grad_bytes: int = 2,
                     mp: int = 1) -> dict[int, Fraction]:
    """`model_state_bytes` for every ZeRO stage: {0: ..., 1: ..., 2: ..., 3: ...}."""
    return {stage: model_state_bytes(params, dp, stage, k, param_bytes=param_bytes, grad_bytes=grad_bytes,
                                     mp=mp)
            for stage in STAGES}


def max_params(device_bytes: float, dp: int, stage: int, k: int = 12, *, param_bytes: int = 2,
               grad_bytes: int = 2, mp: int = 1) -> int:
    """The largest model (in parameters) whose model states fit in `device_bytes` on each device."""
    per_parameter = bytes_per_parameter(stage, dp, k, param_bytes=param_bytes, grad_bytes=grad_bytes)
    return math.floor(Fraction(device_bytes) * mp / per_parameter)


def formula(stage: int, param_bytes: int = 2, grad_bytes: int = 2) -> str:
    """The paper's formula for `stage`, written with these byte sizes."""
    p, g = param_bytes, grad_bytes
    return {
        0: f"({p}+{g}+K)Ψ",
        1: f"({p}+{g})Ψ + KΨ/N",
        2: f"{p}Ψ + ({g}+K)Ψ/N",
        3: f"({p}+{g}+K)Ψ/N",
    }[stage]


def format_size(nbytes: Fraction) -> str:
    """Bytes in decimal units, as the paper counts (GB = 1e9 bytes), to three figures: 120 GB, 1.88 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            value = float(nbytes) / scale
            return f"{value:.3g} {unit}" if value < 1000 else f"{value:,.0f} {unit}"
    return f"{float(nbytes):.3g} B"


def format_count(params: int) -> str:
    """A parameter count the way papers write it: 7.64B, 128B, 2.05T."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if params >= scale:
            return f"{params / scale:.3g}{unit}"
    return str(params)


def _json_number(value: Fraction) -> int | float:
    return value.numerator if value.denominator == 1 else float(value)


def _format_bytes(value: Fraction) -> str:
    return f"{_json_number(value):,}" if value.denominator == 1 else f"{float(value):,.1f}"


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = OneLineParser(prog="minipar plan", description="ZeRO model-state memory per device.")
    parser.add_argument("--params", type=float, required=True, help="model parameters Ψ, e.g. 7.5e9")
    parser.add_argument("--dp", type=int, required=True, help="data-parallel degree N")
    parser.add_argument("--k", type=int, default=12, help="optimizer-state bytes per parameter (12)")
    parser.add_argument("--param-bytes", type=int, default=2, help="bytes per parameter (2, fp16)")
    parser.add_argument("--grad-bytes", type=int, default=2, help="bytes per gradient (2, fp16)")
    parser.add_argument("--mp", type=int, default=1, help="model-parallel degree splitting the model first")
    parser.add_argument("--device-gb", type=float, help="also: the largest model that fits in this many GB")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = parser.parse_args(argv)
    if not (args.params > 0 and args.params.is_integer()):
        parser.error(f"--params must be a positive whole number of parameters, got {args.params:g}")
    args.params = int(args.params)
    for name, least in (("dp", 1), ("mp", 1), ("param_bytes", 1), ("grad_bytes", 1), ("k", 0)):
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')} must be at least {least}, got {getattr(args, name)}")
    if args.device_gb is not None and not (0 < args.device_gb < math.inf):
        parser.error(f"--device-gb must be a positive number, got {args.device_gb:g}")
    return args


def _table(args: argparse.Namespace, sizes: dict[int, Fraction], fits: dict[int, int] | None) -> str:
    lines = [
        f"ZeRO-DP model states per device: Ψ = {args.params:,} parameters, N = {args.dp} data-parallel "
        f"ranks, K = {args.k}, {args.param_bytes}-byte parameters, {args.grad_bytes}-byte gradients",
    ]
    if args.mp > 1:
        lines.append(f"model parallel over {args.mp} devices first: every figure is divided by {args.mp}")
    width = max(len(_format_bytes(size)) for size in sizes.values())
    header = f"{'stage':<6} {'partitioned':<19} {'per device':>10} {'bytes':>{width}}  {'formula':<20}"
    if fits is not None:
        header += f"  largest Ψ in {args.device_gb:g} GB"
    lines.append(header.rstrip())
    for stage in STAGES:
        row = (f"{stage:<6} {PARTITIONED[stage]:<19} {format_size(sizes[stage]):>10} "
               f"{_format_bytes(sizes[stage]):>{width}}  "
               f"{formula(stage, args.param_bytes, args.grad_bytes):<20}")
        if fits is not None:
            row += f"  {format_count(fits[stage])}"
        lines.append(row.rstrip())
    lines.append("(GB = 1e9 bytes, MB = 1e6, kB = 1e3; activations and temporary buffers not included)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """The `minipar plan` command: model-state bytes per device for ZeRO stages 0-3."""
    try:
        args = _parse(argv)
    except SystemExit as exit_request:  # a one-line usage error (2), or --help (0)
        return int(exit_request.code or 0)
    sizes_of = {"param_bytes": args.param_bytes, "grad_bytes": args.grad_bytes, "mp": args.mp}
    sizes = bytes_per_device(args.params, args.dp, args.k, **sizes_of)
    fits = None
    if args.device_gb is not None:
        device_bytes = Fraction(repr(args.device_gb)) * 10**9  # the decimal typed, exactly
        fits = {stage: max_params(device_bytes, args.dp, stage, args.k, **sizes_of) for stage in STAGES}
    if not args.json:
        print(_table(args, sizes, fits))
        return 0
    report = {"params": args.params, "dp": args.dp, "k": args.k, **sizes_of,
              "bytes_per_device": {str(stage): _json_number(sizes[stage]) for stage in STAGES}}
    if fits is not None:
        report["device_gb"] = args.device_gb
        report["max_params"] = {str(stage): fits[stage] for stage in STAGES}
    print(json.dumps(report))
    return 0
