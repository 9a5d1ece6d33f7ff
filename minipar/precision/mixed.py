"""Mixed-precision training: fp32 master weights, bf16 or fp16 arithmetic, and loss scaling for fp16.

The idea (Micikevicius et al., "Mixed Precision Training", 2018), as three pieces of an engine:
- `MixedPrecisionRunner` keeps the fp32 weights as the *master* copy. For forward and backward it
  hands the model a 16-bit working copy (every weight rounded), and rounds every op's output and every
  gradient flowing back (`autograd.cast_outputs`). Gradients still accumulate into fp32 `.grad` arrays,
  so the many small micro-batch contributions are not rounded away; the optimizer updates the fp32
  master. The scalar loss stays fp32, as under PyTorch's autocast (cross-entropy runs in fp32).
- `LossScaling` (fp16 only) is PyTorch's `scaler.unscale_` and `scaler.step(optimizer)`: the runner
  multiplied the loss by the scale, so every gradient is `scale` times larger and small ones survive
  fp16; at the updater's gradients-ready point (after DDP's all-reduce or ZeRO's reduce-scatter) the
  gradients are divided by it, every rank learns whether any rank saw an inf or NaN, and on overflow
  the step is skipped and the scale halved (`precision.DynamicLossScaler`).
- `gradient_all_reduce` lets DDP send gradients in the 16-bit format over a ring (summing in fp32).
- `parameter_wire` gives ZeRO-3, chunked ZeRO-3 and FSDP (which hold no whole parameters to round)
  the 16-bit format of the working copy: each rank rounds its fp32 master shard and the 2-byte
  patterns are all-gathered, so the gathered unit is the working copy (zero3.py, zero_chunked.py,
  fsdp.py).

What it saves: half the bytes of every value computed in 16 bits (activations, the working weights,
the gradient all-reduce) and, on hardware, 16-bit matrix units. Here NumPy holds the 16-bit values in
float32 arrays, so only the wire bytes really halve; the memory ledger shows the emulation's bytes.
What it costs: precision (results differ from fp32 at the 16-bit rounding level), a 16-bit copy of
the weights, and for fp16 the steps the scaler skips. Lesson: lessons/09_precision.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from minipar.core import autograd
from minipar.core.backend import BackendOptions
from minipar.core.options import option
from minipar.distributed.collectives import Wire, ring_all_reduce
from minipar.memory.ledger import buffer_meter
from minipar.parallel.api import GradientTransform, RunnerWrapper, Updater
from minipar.precision.formats import PRECISIONS, DynamicLossScaler, Precision, pack_low, unpack_low

LOW_PRECISIONS = ("bf16", "fp16")


def rounding_every_op(round_to):
    """The cast for `autograd.cast_outputs`: round float arrays to the 16-bit format, but keep 0-d
    results (the loss and its scaling) in fp32 and leave integer arrays alone. The rounded values
    keep the array's dtype, like the working weights: a matrix product takes one dtype (tensor_ops)."""

    def cast(array):
        if array.ndim == 0 or array.dtype.kind != "f":
            return array
        return round_to(array).astype(array.dtype, copy=False)

    return cast


class MixedPrecisionRunner(RunnerWrapper):
    """Runs the inner runner on 16-bit working weights and activations; gradients land in fp32.

    With a `LossScaling` (fp16), the loss is multiplied by its current scale: the runners divide
    the summed loss by `normaliser`, so passing `normaliser / scale` scales it without touching them.
    """

    def __init__(self, runner, params, round_to, loss_scaling: LossScaling | None = None):
        self.runner, self.params, self.round_to = runner, list(params), round_to
        self.loss_scaling = loss_scaling
        self.cast = rounding_every_op(round_to)

    def forward_backward(self, inputs, targets, normaliser, scored=None) -> float:
        scale = self.loss_scaling.scaler.get_scale() if self.loss_scaling else 1.0
        masters = [p.data for p in self.params]
        working = [self.round_to(m).astype(m.dtype, copy=False) for m in masters]
        buffer_meter.add(sum(w.nbytes for w in working))  # the working copy lives for forward+backward
        for p, w in zip(self.params, working):
            p.data = w
        try:  # an overflow to inf is expected in fp16: the loss scaler deals with it, so no warnings
            with autograd.cast_outputs(self.cast), np.errstate(over="ignore", invalid="ignore"):
                loss = self.runner.forward_backward(inputs, targets, normaliser / scale, scored)
        finally:
            for p, m in zip(self.params, masters):
                p.data = m
            buffer_meter.release(sum(w.nbytes for w in working))
        return loss / scale

    def log_record(self) -> dict | None:
        """The loss scale of the last step and whether it was skipped (fp16), for the train log."""
        if self.loss_scaling is None:
            return None
        return {"loss_scale": self.loss_scaling.last_scale, "skipped": self.loss_scaling.skipped}


class LossScaling(GradientTransform):
    """PyTorch's `scaler.unscale_(optimizer)` and the verdict of `scaler.step(optimizer)`, at the
    updater's gradients-ready point (parallel/api.py): the runner multiplied the loss by the scale, so
    the synchronised gradients are divided by it, every rank learns whether any rank's gradients hold
    an inf or NaN, and on overflow the step is skipped on every rank (no parameter, moment or step
    count changes); then the scaler backs off or grows. Each rank checks only what it steps with
    (a ZeRO shard): an overflow anywhere reaches the shard that sums it, and the verdict is shared."""

    def __init__(self, scaler: DynamicLossScaler):
        self.scaler = scaler
        self.last_scale, self.skipped, self.skipped_steps = scaler.get_scale(), False, 0

    def __call__(self, pieces) -> bool:
        self.last_scale = self.scaler.get_scale()
        with np.errstate(over="ignore", invalid="ignore"):  # a collective: every rank steps or none does
            self.skipped = self.scaler.unscale_(piece.grad for piece in pieces())
        self.scaler.update(self.skipped)
        self.skipped_steps += self.skipped
        return not self.skipped


def low_precision_wire(fmt: str) -> Wire:
    """Ring chunks travel as 2-byte patterns of `fmt`; each hop adds in fp32, then rounds again."""
    return Wire(encode=partial(pack_low, fmt=fmt), decode=partial(unpack_low, fmt=fmt))


def parameter_wire(precision: str) -> Wire | None:
    """For ZeRO-3, chunked ZeRO-3 and FSDP in bf16 or fp16: a shard of fp32 masters to the 2-byte
    patterns of its working copy (gathered at half of fp32's bytes) and back; None for fp64 and fp32."""
    return low_precision_wire(precision) if precision in LOW_PRECISIONS else None


def gradient_all_reduce(precision: str, comm):
    """DDP's gradient sum for this precision: a ring on the 16-bit wire, or None (Comm's own)."""
    if precision not in LOW_PRECISIONS:
        return None
    wire = low_precision_wire(precision)

    def all_reduce(flat):
        with np.errstate(invalid="ignore"):  # overflowed fp16 gradients (inf - inf): the scaler skips them
            return ring_all_reduce(comm, flat, wire)

    return all_reduce


def attach_loss_scaling(options: PrecisionOptions, updater: Updater, world,
                        scaler: DynamicLossScaler | None = None):
    """For fp16 (unless `options.loss_scaling` is off): a `LossScaling` registered first at the updater's
    gradients-ready point, so the gradients are unscaled and checked before any other transform sees
    them; returns it (None for other precisions).

    The scaler is `scaler` if given, else one with PyTorch's defaults whose overflow verdict is shared
    over `world`. The sync before the point carries the scaled gradients, as under PyTorch's DDP.
    """
    fmt = Precision.from_name(options.precision)
    if not (fmt.loss_scaling and options.loss_scaling):
        return None
    scaler = scaler or DynamicLossScaler(all_reduce_max=lambda flag: world.allreduce_obj(flag, op="max"))
    loss_scaling = LossScaling(scaler)
    updater.register_gradients_ready_hook(loss_scaling, first=True)
    return loss_scaling


def loss_scaling_of(updater: Updater) -> LossScaling | None:
    """The fp16 loss scaling registered at the updater's gradients-ready point, or None."""
    return next((t for t in updater.gradient_transforms if isinstance(t, LossScaling)), None)


def wrap_runner(options: PrecisionOptions, model, runner, updater: Updater):
    """The runner for `options.precision`: itself for fp64/fp32, a MixedPrecisionRunner for bf16/fp16.

    The updater's loss scaling (attach_loss_scaling) tells the runner which scale to multiply the
    loss by. With ZeRO-3 or chunked offload the runner rounds no weights: the gathered units are the
    working copy already (`parameter_wire`); it still rounds every op's output.
    """
    fmt = Precision.from_name(options.precision)
    if fmt.round is None:
        return runner
    params = [] if updater.gathers_parameters else model.parameters()
    return MixedPrecisionRunner(runner, params, fmt.round, loss_scaling_of(updater))


# ---- the options of `minipar train --precision` and their checks (trainer/validate.py gathers them) ----


@dataclass
class PrecisionOptions:
    """Number formats (precision/formats.py, precision/mixed.py)."""
    precision: str = option("fp32", "number format of the arithmetic (bf16, fp16: mixed precision; fp8: "
                            "the Linear layers' products, precision/fp8.py)",
                            PRECISIONS)
    loss_scaling: bool = option(True, "fp16: a dynamic loss scaler (precision/mixed.py); False trains "
                                "without (Python only: no flag)", command_line=False)

    @property
    def dtype(self) -> str:
        """The arrays' dtype: fp64 computes in float64, every other format over float32 values."""
        return "float64" if self.precision == "fp64" else "float32"


def config_errors(options: PrecisionOptions, backend: BackendOptions) -> list[str]:
    """16-bit emulation runs in NumPy."""
    if options.precision in LOW_PRECISIONS and backend.backend != "numpy":
        return [f"--precision {options.precision} emulates the 16-bit format in NumPy: use --backend numpy"]
    return []
