"""`simulate --search`: every layout of a model on a number of GPUs, ranked by predicted throughput.

The layouts tried: tp a divisor of the GPUs in a node (tensor parallelism stays on NVLink), pp a
divisor of the blocks, dp the rest; ZeRO 0-3; recompute none, selective or full; --sp with tp > 1;
micro-batch sizes 1, 2, 4, 8; the 1F1B schedule. Each distinct layout is tried once (a batch smaller
than dp x b gives the same layout for several b) and is either ranked (it fits) or refused with its
reason: a size that does not divide (step.layout_errors) or memory beyond the GPU's. The ranking is
by step time, the same as by MFU for one batch: hardware TFLOP/s would rank full recomputation up
for the forward it runs twice.
"""

from __future__ import annotations

import math
from collections import Counter

from minipar.simulate.machines import Machine
from minipar.simulate.model import ModelShape
from minipar.simulate.step import Layout, layout_errors, simulate_step


def _divisors(n: int) -> list[int]:
    """In increasing order, trying up to the square root: a million GPUs take a thousand tries."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def candidates(m: ModelShape, gpus: int, batch_size: int, mach: Machine, precision: str = "bf16",
               overlap: tuple[str, ...] = ()):
    """Every distinct layout the search considers (some do not divide: their errors say why)."""
    seen = set()
    for tp in _divisors(min(gpus, mach.gpus_per_node)):
        for pp in _divisors(gpus // tp) if gpus % tp == 0 else []:
            dp = gpus // (tp * pp)
            for b in (1, 2, 4, 8):
                microbatches = max(1, batch_size // (dp * b))
                for zero in (0, 1, 2, 3):
                    for recompute in ("none", "selective", "full"):
                        for sp in (False, True) if tp > 1 else (False,):
                            layout = Layout(batch_size, microbatches, dp, tp, pp, zero=zero,
                                            recompute=recompute, sp=sp, precision=precision, overlap=overlap)
                            if layout not in seen:
                                seen.add(layout)
                                yield layout


def search(m: ModelShape, gpus: int, batch_size: int, mach: Machine, precision: str = "bf16",
           top: int = 10, overlap: tuple[str, ...] = ()) -> dict:
    """{"ranked": the `top` fastest layouts that fit, "fitting": how many fit, "refused": {reason: how
    many layouts}}."""
    ranked, refused = [], Counter()
    for layout in candidates(m, gpus, batch_size, mach, precision, overlap):
        errors = layout_errors(m, layout)
        if errors:
            what = "too many to simulate" if "simulator" in errors[0] else "a size does not divide"
            refused[errors[0].split(" ")[0] + ": " + what] += 1
            continue
        result = simulate_step(m, layout, mach)
        if not result["memory"]["fits"]:
            refused["memory beyond the GPU's"] += 1
            continue
        ranked.append({"dp": layout.dp, "tp": layout.tp, "pp": layout.pp,
                       "microbatch_size": layout.microbatch_size,
                       "zero": layout.zero, "recompute": layout.recompute, "sp": layout.sp,
                       "tflops_per_gpu": result["tflops_per_gpu"], "mfu": result["mfu"],
                       "step_s": result["step_s"], "memory_gb": result["memory"]["total"] / 1e9})
    ranked.sort(key=lambda row: (row["step_s"], row["memory_gb"]))  # ties: the least memory
    return {"ranked": ranked[:top], "fitting": len(ranked), "refused": dict(refused)}
