"""`--check-reference`'s verdict: did this layout train the single-process model?

Two runs that round differently (a ring sums in another order than one process) start apart by a few
units of roundoff, and training then amplifies any difference, as a chaotic system does: after
enough steps two correct runs part ways however exact each is. So the verdict compares the steps
before that amplification: the losses of steps 1..H and the weights after step H, H = min(20, steps),
against a tolerance of the precision, PASS or FAIL (exit 1). The final weights' deviation is reported
apart, as drift: how far roundoff has grown by the end, not an error.

The weights are compared as one vector, ||w - w_ref|| / ||w_ref|| over every parameter together:
AdamW divides by the gradient's root-mean-square, so a tensor whose true gradient is nearly zero (a
bias that starts at zero) is moved by roundoff about as far as by a real gradient, and relative to its
own small norm can deviate far more than the model does; its share of the whole vector's norm is what
it changes in the model. Lesson: lessons/00_overview.md.
"""

from __future__ import annotations

import math

import numpy as np

HORIZON = 20  # steps compared for the verdict; past them the deviation is drift

# The unit roundoff u of each format (2^-p for p significand bits, the implicit one included) and
# the tolerance derived from it, G u, with a growth factor G per kind of run. fp64's tolerance is
# the correctness contract's 1e-9 (DESIGN.md), far above its roundoff: a layout bug is far larger.
# fp32 computes everything in the format: a layout sums in another order, each sum off by a few u,
# and each of the H steps compared adds its own, so G = 4 H = 80 (correct layouts reach 23 u: tp 4).
# bf16 and fp16 are mixed precision: the arithmetic is fp32 and each result is rounded to 16 bits, the
# same in every layout unless the fp32 values differ across a rounding boundary, where they differ by
# one 16-bit unit; such flips do not pile up like fp32's sums (correct layouts stay within 2 u: fp16
# tp 2 and tp 4 reach 1.8 u, bf16 at most 0.95 u), so G = 8. Measured in lesson 00.
UNIT_ROUNDOFF = {"fp64": 2.0**-53, "fp32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11}
GROWTH = {"fp32": 4 * HORIZON, "bf16": 8, "fp16": 8}
TOLERANCE = {"fp64": 1e-9, **{fmt: GROWTH[fmt] * UNIT_ROUNDOFF[fmt] for fmt in GROWTH}}


def horizon(steps: int) -> int:
    return min(HORIZON, steps)


def norm_relative_deviation(state: dict, reference: dict) -> float:
    """||w - w_ref|| / ||w_ref||, every parameter of `reference` in one vector."""
    error = sum(float(np.sum((np.asarray(state[name], dtype=np.float64) - ref) ** 2))
                for name, ref in reference.items())
    scale = sum(float(np.sum(np.asarray(ref, dtype=np.float64) ** 2)) for ref in reference.values())
    return math.sqrt(error / scale) if scale else math.sqrt(error)


def loss_deviation(records: list[dict], losses: list[float], steps: int) -> float:
    """The largest relative deviation of the run's losses from the reference's over its first `steps`
    steps (a resumed run's records start at its checkpoint's step)."""
    return max((abs(r["loss"] - losses[r["step"]]) / max(abs(losses[r["step"]]), 1e-30)
                for r in records if r["step"] < steps), default=0.0)


def verdict(precision: str, records, losses, snapshot, ref_snapshot, final, ref_final, steps: int) -> dict:
    """The check's figures: deviations up to the horizon against the tolerance, and the drift."""
    h = horizon(steps)
    compared = snapshot is not None and ref_snapshot is not None  # None: resumed past the horizon
    check = {"horizon": h, "tolerance": TOLERANCE[precision],
             "loss_deviation": loss_deviation(records, losses, h),
             "weight_deviation": norm_relative_deviation(snapshot, ref_snapshot) if compared else None,
             "drift": norm_relative_deviation(final, ref_final)}
    worst = max(check["loss_deviation"], check["weight_deviation"] or 0.0)
    check["passed"] = worst <= check["tolerance"]
    return check


def verdict_lines(check: dict, steps: int) -> list[str]:
    """The verdict, and the drift where the run went on past the horizon."""
    weights = "not compared (resumed past it)" if check["weight_deviation"] is None \
        else f"{check['weight_deviation']:.1e}"
    word = "PASS" if check["passed"] else "FAIL"
    lines = [f"check against one process: {word} over steps 1..{check['horizon']} (tolerance "
             f"{check['tolerance']:.1e}): loss {check['loss_deviation']:.1e}, weights {weights}"]
    if steps > check["horizon"]:
        lines.append(f"drift of the final weights from one process after step {steps}: {check['drift']:.1e} "
                     "(roundoff amplified by training, not an error)")
    return lines
