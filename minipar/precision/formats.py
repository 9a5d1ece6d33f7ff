"""Low-precision number formats, emulated bit-exactly in NumPy, and dynamic loss scaling.

The idea: a bf16 or fp16 number is a float32 with fewer bits. Arrays stay float32 here, rounded to
the nearest value the 16-bit format can hold (ties to even), the same bits a GPU would produce, so a
model trained "in bf16" sees the numbers it would see on real hardware.
What it saves: half the bytes of fp32 per value in memory, and on the wire (`pack_low`/`unpack_low`).
What it costs: precision (8 significant bits in bf16, 11 in fp16) and, in fp16, range: small
gradients underflow to zero, which is why fp16 training multiplies the loss by a `DynamicLossScaler`.
Lesson: lessons/09_precision.md.

Conversion rules, the same as PyTorch's for every non-NaN input (and ml_dtypes' for float32 input;
ml_dtypes 0.7 rounds float64 once, 0.6 went through float32 as PyTorch does): float64 input is
first rounded to float32; round to nearest, ties to even; overflow becomes infinity; subnormals are
kept, never flushed; the sign of zero is kept. A NaN becomes the quiet NaN with the input's sign and
an empty payload: bf16 0x7FC0 / 0xFFC0 (bit-for-bit ml_dtypes), fp16 0x7E00 / 0xFE00 (PyTorch's
scalar rule; NumPy's own float16 cast keeps the top payload bits instead, so we override it).

The two FP8 formats (`round_to_e4m3`, `round_to_e5m2`; Micikevicius et al., "FP8 Formats for Deep
Learning", 2022) round straight from float32 or float64, never through a 16-bit format (a double
rounding moves some midpoints), and keep the input's dtype. E4M3 "fn" has no infinity: 448 is its
largest value and S.1111.111 its only NaN; E5M2 keeps IEEE's inf and NaN, largest 57344. Each rounds
saturating (clip to +-max first, the hardware's satfinite conversion) or not (beyond max: NaN in
E4M3, infinity in E5M2). FP8 training itself is precision/fp8.py.
"""

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

BF16_QUIET_NAN = 0x7FC0
FP16_QUIET_NAN = 0x7E00
SIGN_BIT_16 = 0x8000


def _as_float32(x) -> np.ndarray:
    with np.errstate(over="ignore"):  # a float64 beyond float32's range becomes inf, on purpose
        return np.asarray(x, dtype=np.float32)


def _sign_bits_16(f: np.ndarray) -> np.ndarray:
    return (f.view(np.uint32) >> 16).astype(np.uint16) & np.uint16(SIGN_BIT_16)


def to_bf16_bits(x) -> np.ndarray:
    """The bfloat16 bit patterns (uint16) nearest to `x`, rounding ties to even."""
    f = _as_float32(x)
    is_nan = np.isnan(f)
    bits = np.where(is_nan, np.uint32(0), f.view(np.uint32))  # NaN is set below; avoids a wrap-around
    # exercise 09.1: bf16 rounding to nearest, ties to even
    # bf16 is the top half of a float32. Adding 0x7FFF (just under half of the dropped part) rounds
    # up exactly when the dropped half is above 0x8000; the odd bit of the kept half breaks the tie
    # at 0x8000 towards even. A carry out of the mantissa lands in the exponent: the next binade,
    # or infinity after the largest finite value.
    odd = (bits >> 16) & np.uint32(1)
    rounded = ((bits + np.uint32(0x7FFF) + odd) >> 16).astype(np.uint16)
    # end exercise
    return np.where(is_nan, _sign_bits_16(f) | np.uint16(BF16_QUIET_NAN), rounded)


def from_bf16_bits(u) -> np.ndarray:
    """float32 values of bfloat16 bit patterns: the bits become the top half of a float32."""
    wide = np.asarray(u, dtype=np.uint16).astype(np.uint32)
    return np.asarray(wide << 16).view(np.float32)


def to_fp16_bits(x) -> np.ndarray:
    """The IEEE half-precision bit patterns (uint16) nearest to `x`, rounding ties to even."""
    f = _as_float32(x)
    with np.errstate(over="ignore", invalid="ignore"):
        half = f.astype(np.float16).view(np.uint16)
    return np.where(np.isnan(f), _sign_bits_16(f) | np.uint16(FP16_QUIET_NAN), half)


def from_fp16_bits(u) -> np.ndarray:
    """float32 values of half-precision bit patterns (every fp16 value is exact in float32)."""
    return np.asarray(u, dtype=np.uint16).view(np.float16).astype(np.float32)


def round_to_bf16(x) -> np.ndarray:
    """float32 array of the bfloat16 values nearest to `x`."""
    return from_bf16_bits(to_bf16_bits(x))


def round_to_fp16(x) -> np.ndarray:
    """float32 array of the fp16 values nearest to `x`."""
    return from_fp16_bits(to_fp16_bits(x))


@dataclass(frozen=True)
class FP8Format:
    """An FP8 format by its definition: mantissa bits, the exponent of its smallest normal binade
    (below it the spacing stays that binade's: the subnormals), its largest finite value, and what a
    value beyond it becomes when not saturating."""

    name: str
    mantissa_bits: int
    min_normal_exponent: int
    max_finite: float
    overflow: float


E4M3 = FP8Format("e4m3", 3, -6, 448.0, np.nan)        # 1.75 * 2^8; bias 7, no infinity
E5M2 = FP8Format("e5m2", 2, -14, 57344.0, np.inf)     # 1.75 * 2^15; bias 15, IEEE's inf and NaN


def round_to_fp8(x, fmt: FP8Format, saturate: bool) -> np.ndarray:
    """The values of `fmt` nearest to `x`, ties to even, in x's dtype (float64 stays float64, any
    other becomes float32: every FP8 value is exact in both)."""
    x = np.asarray(x)
    dtype = np.float64 if x.dtype == np.float64 else np.float32
    with np.errstate(invalid="ignore"):  # a signalling NaN becomes a quiet one, as it should
        wide = x.astype(np.float64)  # exact: all the work below is in float64, and exact there too
    if saturate:  # satfinite: +-inf and everything beyond max become +-max; NaN stays NaN
        wide = np.clip(wide, -fmt.max_finite, fmt.max_finite)
    # In the binade [2^e, 2^(e+1)) the format's values are spaced 2^(e - mantissa_bits) apart; below
    # the smallest normal binade the spacing stays that binade's (the subnormals). Dividing by the
    # spacing (a power of two: exact) puts the neighbours on consecutive integers, and rint rounds to
    # the nearest one, ties to even: an even integer is an even mantissa.
    finite = np.isfinite(wide)
    _, frexp_exponent = np.frexp(np.where(finite, wide, 1.0))  # |x| in [2^(e-1), 2^e)
    binade = np.maximum(frexp_exponent - 1, fmt.min_normal_exponent)
    spacing = np.ldexp(1.0, binade - fmt.mantissa_bits)
    rounded = np.rint(np.where(finite, wide, 0.0) / spacing) * spacing
    # a value that rounded past max (or was infinite) overflows: NaN in E4M3, +-inf in E5M2
    overflow = np.copysign(fmt.overflow, wide)
    out = np.where(np.abs(rounded) > fmt.max_finite, overflow, rounded)
    out = np.where(np.isinf(wide), overflow, out)
    out = np.where(np.isnan(wide), np.nan, out)
    return out.astype(dtype)


def round_to_e4m3(x, saturate: bool = True) -> np.ndarray:
    """x rounded to FP8 E4M3 (fn: max 448, no inf): saturating to +-448, or NaN beyond it."""
    return round_to_fp8(x, E4M3, saturate)


def round_to_e5m2(x, saturate: bool = True) -> np.ndarray:
    """x rounded to FP8 E5M2 (max 57344): saturating to +-57344, or +-inf beyond it."""
    return round_to_fp8(x, E5M2, saturate)


@functools.cache  # the table is built once per format: the FP8 ZeRO-3 gather reads it every step
def fp8_values(fmt: FP8Format) -> np.ndarray:
    """The 256 values of `fmt` (float64, read-only), indexed by bit pattern S.EEEE.MMM (E4M3) or
    S.EEEEE.MM (E5M2): exponent bias 1 - min_normal_exponent, exponent 0 the subnormals m·2^(min_normal -
    mantissa_bits); a pattern beyond max_finite is E4M3's NaN, or E5M2's infinity (mantissa 0) and NaN."""
    bits = np.arange(256)
    m_bits, exponent = fmt.mantissa_bits, (np.arange(256) & 0x7F) >> fmt.mantissa_bits
    mantissa = bits & ((1 << m_bits) - 1)
    normal = (1.0 + mantissa / 2.0**m_bits) * np.ldexp(1.0, exponent - 1 + fmt.min_normal_exponent)
    magnitude = np.where(exponent == 0, mantissa * 2.0**(fmt.min_normal_exponent - m_bits), normal)
    beyond = np.where((mantissa == 0) & np.isinf(fmt.overflow), np.inf, np.nan)
    magnitude = np.where(magnitude > fmt.max_finite, beyond, magnitude)
    values = np.where(bits >> 7, -magnitude, magnitude)
    values.flags.writeable = False
    return values


def to_fp8_bits(values, fmt: FP8Format) -> np.ndarray:
    """The 1-byte patterns (uint8) of values that are `fmt`'s already (round_to_fp8's output): what an
    FP8 tensor sends. The positive patterns are in the order of their values, so a search finds each."""
    table = fp8_values(fmt)[:128]
    finite = table[np.isfinite(table)]
    v = np.asarray(values, dtype=np.float64)
    magnitude = np.abs(np.where(np.isnan(v), 0.0, v))
    bits = np.searchsorted(finite, magnitude).astype(np.uint8)
    if np.any(np.isfinite(magnitude) & (finite[np.minimum(bits, finite.size - 1)] != magnitude)):
        raise ValueError(f"to_fp8_bits: a value that {fmt.name} cannot hold (round it first)")
    bits = np.where(np.isinf(magnitude), np.uint8(finite.size), bits)  # E5M2's infinity follows its max
    bits = np.where(np.isnan(v), np.uint8(0x7F), bits)  # a NaN pattern in both formats
    return (bits | (np.signbit(v).astype(np.uint8) << 7)).astype(np.uint8)


def from_fp8_bits(bits, fmt: FP8Format, dtype=np.float64) -> np.ndarray:
    """The values (in `dtype`: every FP8 value is exact in float32 and float64) of 1-byte patterns."""
    return fp8_values(fmt).astype(dtype)[np.asarray(bits, dtype=np.uint8)]


_TO_BITS = {"bf16": to_bf16_bits, "fp16": to_fp16_bits}
_FROM_BITS = {"bf16": from_bf16_bits, "fp16": from_fp16_bits}


def _check_low_format(fmt: str) -> None:
    if fmt not in _TO_BITS:
        raise ValueError(f"unknown low-precision format {fmt!r}; expected one of {sorted(_TO_BITS)}")


def pack_low(x, fmt: str) -> np.ndarray:
    """Round `x` to `fmt` ("bf16" or "fp16") and return the 2-byte patterns, ready to send."""
    _check_low_format(fmt)
    return _TO_BITS[fmt](x)


def unpack_low(u, fmt: str) -> np.ndarray:
    """float32 values of 2-byte patterns received in `fmt`."""
    _check_low_format(fmt)
    return _FROM_BITS[fmt](u)


@dataclass(frozen=True)
class Precision:
    """What a `--precision` choice means: which dtype the math runs in, which dtype the optimizer
    keeps its master weights in, how values are rounded after each op (None: no emulation), how
    many bytes a value costs on the wire, and whether a loss scaler is on by default."""

    name: str
    compute_dtype: type
    master_dtype: type
    round: Optional[Callable[[np.ndarray], np.ndarray]]
    wire_bytes: int
    loss_scaling: bool

    @classmethod
    def from_name(cls, name: str) -> "Precision":
        if name not in PRECISIONS:
            raise ValueError(f"unknown precision {name!r}; expected one of {list(PRECISIONS)}")
        return PRECISIONS[name]


# bf16 and fp16 compute in float32 arrays holding only representable values: NumPy has no bf16
# type, and rounding every op's output is what the hardware's 16-bit results look like.
# bf16 has fp32's exponent range, so it needs no loss scaling; fp16's smallest value is 6e-8.
PRECISIONS = {
    "fp64": Precision("fp64", np.float64, np.float64, None, 8, False),
    "fp32": Precision("fp32", np.float32, np.float32, None, 4, False),
    "bf16": Precision("bf16", np.float32, np.float32, round_to_bf16, 2, False),
    "fp16": Precision("fp16", np.float32, np.float32, round_to_fp16, 2, True),
    # fp8: only the Linear layers' products take FP8 operands (precision/fp8.py); the rest is fp32
    "fp8": Precision("fp8", np.float32, np.float32, None, 4, False),
}


class DynamicLossScaler:
    """PyTorch's GradScaler rule. Multiply the loss by `scale` so small gradients survive fp16;
    divide the gradients by it before the optimizer step. A step whose gradients hold an inf or NaN
    is skipped by the caller and the scale is multiplied by `backoff_factor`; after
    `growth_interval` clean steps in a row it is multiplied by `growth_factor` (never past fp32's
    largest value).

    `all_reduce_max(x: float) -> float`, when given, returns the maximum of `x` over all ranks, so
    every rank reaches the same verdict and skips (or takes) the same steps; the scaler itself
    knows nothing of MPI.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 all_reduce_max: Optional[Callable[[float], float]] = None):
        if not (np.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"init_scale must be a positive finite number, got {init_scale}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be above 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be between 0 and 1, got {backoff_factor}")
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ValueError(f"growth_interval must be a positive integer, got {growth_interval}")
        self._scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = growth_interval
        self._growth_tracker = 0
        self._all_reduce_max = all_reduce_max

    def get_scale(self) -> float:
        return self._scale

    def scale(self, loss):
        """The loss times the current scale; works for floats, arrays and autograd tensors."""
        return loss * self._scale

    def unscale_(self, grads) -> bool:
        """Divide each gradient array by the scale, in place; return True when any rank found an
        inf or NaN. Checked after unscaling, so an overflow caused by a scale below 1 counts too."""
        inv_scale = 1.0 / self._scale
        found_inf = False
        for grad in grads:
            np.multiply(grad, inv_scale, out=grad)
            found_inf = found_inf or not bool(np.isfinite(grad).all())
        if self._all_reduce_max is not None:
            found_inf = self._all_reduce_max(1.0 if found_inf else 0.0) > 0.0
        return found_inf

    def update(self, found_inf: bool) -> None:
        """Back off after an overflow; grow after `growth_interval` clean steps in a row."""
        # exercise 09.2: the dynamic loss scaler's update
        if found_inf:
            self._scale *= self._backoff_factor
            self._growth_tracker = 0
            return
        self._growth_tracker += 1
        if self._growth_tracker == self._growth_interval:
            grown = self._scale * self._growth_factor
            if grown <= float(np.finfo(np.float32).max):
                self._scale = grown
            self._growth_tracker = 0
        # end exercise

    def state_dict(self) -> dict:
        return {"scale": self._scale, "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self._scale = float(state["scale"])
        self._growth_factor = float(state["growth_factor"])
        self._backoff_factor = float(state["backoff_factor"])
        self._growth_interval = int(state["growth_interval"])
        self._growth_tracker = int(state["_growth_tracker"])
