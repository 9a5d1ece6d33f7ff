"""ZeRO's memory arithmetic: the model-state bytes one data-parallel rank holds at ZeRO stages 0-3.

The idea: plain data parallelism keeps a full copy of the parameters, the gradients and the optimizer
states on each of its N ranks. ZeRO partitions them over the ranks instead: stage 1 the optimizer
states, stage 2 the gradients too, stage 3 the parameters too. With Ψ parameters, p bytes per
parameter, g bytes per gradient and K bytes of optimizer state per parameter, one rank holds

    stage 0   (p+g+K)Ψ            stage 2   pΨ + (g+K)Ψ/N
    stage 1   (p+g)Ψ + KΨ/N       stage 3   (p+g+K)Ψ/N

(Rajbhandari et al., "ZeRO", 2020, section 5). The paper's mixed-precision Adam has p = g = 2 (fp16)
and K = 12 (fp32 master weights, momentum and variance): 16Ψ bytes without ZeRO. minipar in fp64 has
p = g = 8 and Adam's two fp64 moments K = 16, with no master copy. In bf16 or fp16 minipar keeps its
gradients in fp32: at stages 0-2 the parameters it holds are the fp32 masters (p = g = 4, K = 8; the
working copy is a temporary buffer), at stage 3 they are the 16-bit shards that are gathered, beside
the fp32 master shards (p = 2, g = 4, K = 4 + 8: parallel/zero3.py).

What it saves: stage 3 divides model states by N. What it costs: stages 1 and 2 send what DP's
all-reduce sends (a reduce-scatter plus an all-gather); stage 3 sends 1.5x that, gathering parameters
in forward and backward. Activations and temporary buffers are not model states and are not counted.
Lesson 04 (ZeRO) uses `python -m minipar plan` to reproduce the paper's 7.5B-parameter example.
The command itself (options, table, JSON) is in minipar/trainer/commands.py; this file is the arithmetic.
"""

from __future__ import annotations

import math
from fractions import Fraction

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
    # exercise 04.1: ZeRO's model-state bytes per parameter, stage by stage
    share = Fraction(1, dp)
    optimizer = k * share if stage >= 1 else Fraction(k)
    grads = grad_bytes * share if stage >= 2 else Fraction(grad_bytes)
    params = param_bytes * share if stage >= 3 else Fraction(param_bytes)
    return params + grads + optimizer
    # end exercise


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
