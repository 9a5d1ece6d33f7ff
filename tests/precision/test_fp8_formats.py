"""FP8 rounding (precision/formats.py) against the definitions and against ml_dtypes, bit for bit.

The oracle is ml_dtypes' float8_e4m3fn and float8_e5m2 casts (np.clip first for the saturating path,
as the hardware's satfinite conversion), on a structured set: every float32 upper half with the lower
halves {0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF} (every exponent, sign, NaN and inf, and the values just
around each bf16 midpoint), every FP8 midpoint and the values one float32 and one float64 ulp either
side, and random float64 draws. A rounding that goes through bf16 first fails the set.
"""

import ml_dtypes
import numpy as np
import pytest

from minipar.precision.formats import (
    E4M3,
    E5M2,
    from_fp8_bits,
    round_to_bf16,
    round_to_e4m3,
    round_to_e5m2,
    to_fp8_bits,
)

CASES = {"e4m3": (round_to_e4m3, ml_dtypes.float8_e4m3fn, E4M3.max_finite),
         "e5m2": (round_to_e5m2, ml_dtypes.float8_e5m2, E5M2.max_finite)}
LOW_HALVES = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)


def oracle(x, fp8_dtype, max_finite, saturate):
    if saturate:
        x = np.clip(x, -max_finite, max_finite)
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(fp8_dtype).astype(x.dtype)


def same_bits(ours, ref):
    """Equal values with equal signs (zeros included); NaN where NaN."""
    assert ours.dtype == ref.dtype
    nan = np.isnan(ref)
    bad = (np.isnan(ours) != nan) | (~nan & ((ours != ref) | (np.signbit(ours) != np.signbit(ref))))
    return np.flatnonzero(bad)


def every_fp32_upper_half():
    high = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    return (high[:, None] | LOW_HALVES[None, :]).ravel().view(np.float32)


def midpoints_and_neighbours(fp8_dtype):
    """Every midpoint of two neighbouring finite FP8 values (and the one above max, the overflow
    boundary), both signs, with one float32 and one float64 ulp either side."""
    values = np.arange(256, dtype=np.uint8).view(fp8_dtype).astype(np.float64)
    grid = np.unique(np.abs(values[np.isfinite(values)]))
    top_spacing = grid[-1] - grid[-2]
    mids = np.concatenate([(grid[:-1] + grid[1:]) / 2, [grid[-1] + top_spacing / 2]])
    mids = np.concatenate([mids, -mids])
    wide = np.concatenate([mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf)])
    m32 = mids.astype(np.float32)  # every midpoint has 5 significant bits: exact in float32
    up, down = np.float32(np.inf), np.float32(-np.inf)
    narrow = np.concatenate([m32, np.nextafter(m32, up), np.nextafter(m32, down)])
    return wide, narrow


@pytest.mark.parametrize("saturate", [True, False])
@pytest.mark.parametrize("name", list(CASES))
def test_fp8_rounding_equals_ml_dtypes(name, saturate):
    round_to, fp8_dtype, max_finite = CASES[name]
    wide, narrow = midpoints_and_neighbours(fp8_dtype)
    rng = np.random.default_rng(45)
    draws = rng.standard_normal(20_000) * np.exp2(rng.integers(-24, 20, 20_000))
    for x in (every_fp32_upper_half(), narrow, wide, draws, draws.astype(np.float32)):
        with np.errstate(over="ignore"):
            bad = same_bits(round_to(x, saturate=saturate), oracle(x, fp8_dtype, max_finite, saturate))
        assert bad.size == 0, f"{name}: {bad.size} differ, first {x[bad[:5]]}"


@pytest.mark.parametrize("name", list(CASES))
def test_a_double_rounding_through_bf16_fails_the_set(name):
    """The set can tell: rounding to bf16 first moves values just off an FP8 midpoint onto it."""
    _, fp8_dtype, max_finite = CASES[name]
    round_to = CASES[name][0]
    x = every_fp32_upper_half()
    with np.errstate(over="ignore"):
        twice = round_to(round_to_bf16(x), saturate=True)
        assert same_bits(twice, oracle(x, fp8_dtype, max_finite, True)).size > 0


def test_fp8_values_written_out_from_the_definitions():
    """E4M3: bias 7, 3 mantissa bits, no infinity, S.1111.111 the NaN, so the largest is
    1.110 x 2^8 = 448; the smallest subnormal 0.001 x 2^-6 = 2^-9. E5M2: bias 15, 2 mantissa bits,
    largest 1.11 x 2^15 = 57344, smallest subnormal 0.01 x 2^-14 = 2^-16."""
    x = np.array([2.0**-9, 2.0**-10, 1.5 * 2.0**-10, 1.0625, 1.1875, 448.0, 464.0, 465.0, 1e9])
    e4 = round_to_e4m3(x, saturate=False)
    # 2^-10 is the tie between 0 and 2^-9: to even (0); 1.0625 = 1 + 1/16, the tie between 1 and
    # 1.125: to even (1.0); 1.1875 the tie between 1.125 and 1.25: to even (1.25); 464 the tie
    # between 448 (mantissa 110) and 480 (111, the NaN pattern's neighbour): to 448; 465 overflows
    np.testing.assert_array_equal(e4, [2.0**-9, 0.0, 2.0**-9, 1.0, 1.25, 448.0, 448.0, np.nan, np.nan])
    assert round_to_e4m3(np.array([465.0, -1e9, np.inf]), saturate=True).tolist() == [448.0, -448.0, 448.0]
    e5 = round_to_e5m2(np.array([2.0**-16, 2.0**-17, 57344.0, 61439.0, 61440.0, -np.inf]), saturate=False)
    np.testing.assert_array_equal(e5, [2.0**-16, 0.0, 57344.0, 57344.0, np.inf, -np.inf])
    assert np.signbit(round_to_e4m3(np.float32(-1e-30)))
    assert round_to_e4m3(np.float32(1.0)).dtype == np.float32


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_fp8_bit_patterns_are_ml_dtypes(name):
    """What an FP8 value sends (ZeRO-3's FP8 all-gather): its 1-byte pattern, ml_dtypes' own, for every
    pattern (the values of the 256, NaN where NaN) and for rounded random values, signed zeros included."""
    fmt, fp8_dtype = {"e4m3": (E4M3, ml_dtypes.float8_e4m3fn), "e5m2": (E5M2, ml_dtypes.float8_e5m2)}[name]
    patterns = np.arange(256, dtype=np.uint8)
    values = patterns.view(fp8_dtype).astype(np.float64)
    assert not same_bits(from_fp8_bits(patterns, fmt), values).size
    finite = np.isfinite(values)  # NaN has several patterns: only the values' are one to one
    np.testing.assert_array_equal(to_fp8_bits(values[finite], fmt), patterns[finite])
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(4096) * np.exp2(rng.integers(-20, 20, 4096)), [0.0, -0.0]])
    rounded = CASES[name][0](x, saturate=True)
    np.testing.assert_array_equal(to_fp8_bits(rounded, fmt), oracle(x, fp8_dtype, fmt.max_finite, True)
                                  .astype(fp8_dtype).view(np.uint8))
    with pytest.raises(ValueError, match="cannot hold"):
        to_fp8_bits(np.array([1.0625]), fmt)  # between two values of both formats
