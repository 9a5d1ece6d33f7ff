"""Bit-exact bfloat16 and fp16 rounding, checked against an independent reference.

The reference below works on one float32 bit pattern at a time with Python integers: it decodes the
exact value as significand * 2**power, divides by the spacing of the target format at that value with
divmod, breaks ties towards an even count, and re-encodes. It shares nothing with the vectorised
add-a-bias trick in minipar.precision.formats, and the same function serves both formats.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipar.precision.formats import (
    from_bf16_bits,
    from_fp16_bits,
    round_to_bf16,
    round_to_fp16,
    to_bf16_bits,
    to_fp16_bits,
)

BF16 = (8, 7)  # exponent bits, mantissa bits
FP16 = (5, 10)


def reference_round(bits32: int, exp_bits: int, man_bits: int) -> int:
    """Bit pattern of the format (exp_bits, man_bits) nearest to the float32 `bits32`, ties to even."""
    sign_out = (bits32 >> 31) << (exp_bits + man_bits)
    all_ones_exponent = ((1 << exp_bits) - 1) << man_bits
    exponent, mantissa = (bits32 >> 23) & 0xFF, bits32 & 0x7FFFFF
    if exponent == 0xFF:  # inf stays inf; any NaN becomes the quiet NaN, sign kept, payload dropped
        quiet_bit = (1 << (man_bits - 1)) if mantissa else 0
        return sign_out | all_ones_exponent | quiet_bit
    if exponent == 0:
        significand, power = mantissa, -149
    else:
        significand, power = mantissa | (1 << 23), exponent - 150
    if significand == 0:
        return sign_out
    bias = (1 << (exp_bits - 1)) - 1
    min_normal_exponent = 1 - bias
    top_exponent = significand.bit_length() - 1 + power  # floor(log2 |value|)
    spacing = max(top_exponent, min_normal_exponent) - man_bits  # log2 of the gap between neighbours
    shift = spacing - power
    assert shift > 0  # both targets keep fewer mantissa bits than float32
    count, remainder = divmod(significand, 1 << shift)
    half = 1 << (shift - 1)
    if remainder > half or (remainder == half and count % 2 == 1):
        count += 1
    if count < (1 << man_bits):  # still below the smallest normal: a subnormal (or zero)
        return sign_out | count
    if count == 1 << (man_bits + 1):  # rounding carried into the next power of two
        count, spacing = count // 2, spacing + 1
    biased_exponent = spacing + man_bits + bias
    if biased_exponent >= (1 << exp_bits) - 1:
        return sign_out | all_ones_exponent  # overflow: infinity
    return sign_out | (biased_exponent << man_bits) | (count - (1 << man_bits))


def as_float32(bit_patterns) -> np.ndarray:
    return np.array(bit_patterns, dtype=np.uint32).view(np.float32)


def expected_bits(bit_patterns, fmt) -> np.ndarray:
    return np.array([reference_round(b, *fmt) for b in bit_patterns], dtype=np.uint16)


def assert_bits_equal(actual, expected, bit_patterns):
    bad = np.flatnonzero(actual != expected)
    assert bad.size == 0, [(hex(bit_patterns[i]), hex(actual[i]), hex(expected[i])) for i in bad[:5]]


float32_patterns = st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64)
# Patterns whose dropped half is a tie, or one step either side of it, in every binade.
bf16_near_ties = st.lists(
    st.builds(lambda top, low: (top << 16) | low, st.integers(0, 0xFFFF),
              st.sampled_from([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF])),
    min_size=1, max_size=64)
# float32 patterns around fp16's range (exponents 2**-27 .. 2**18), with the 13 dropped bits at a
# tie or next to it, so that subnormals, the largest finite value and overflow are all reached.
fp16_near_ties = st.lists(
    st.builds(lambda sign, exponent, kept, dropped: (sign << 31) | (exponent << 23) | (kept << 13) | dropped,
              st.integers(0, 1), st.integers(100, 145), st.integers(0, 0x3FF),
              st.sampled_from([0, 1, 0x0FFF, 0x1000, 0x1001, 0x1FFF])),
    min_size=1, max_size=64)


@settings(max_examples=300, deadline=None)
@given(float32_patterns)
def test_bf16_matches_reference_on_random_bit_patterns(patterns):
    assert_bits_equal(to_bf16_bits(as_float32(patterns)), expected_bits(patterns, BF16), patterns)


@settings(max_examples=300, deadline=None)
@given(bf16_near_ties)
def test_bf16_matches_reference_near_ties(patterns):
    assert_bits_equal(to_bf16_bits(as_float32(patterns)), expected_bits(patterns, BF16), patterns)


@settings(max_examples=300, deadline=None)
@given(float32_patterns)
def test_fp16_matches_reference_on_random_bit_patterns(patterns):
    assert_bits_equal(to_fp16_bits(as_float32(patterns)), expected_bits(patterns, FP16), patterns)


@settings(max_examples=300, deadline=None)
@given(fp16_near_ties)
def test_fp16_matches_reference_near_ties(patterns):
    assert_bits_equal(to_fp16_bits(as_float32(patterns)), expected_bits(patterns, FP16), patterns)


def test_bf16_every_binade_tie_and_neighbours_exhaustively():
    tops = np.arange(1 << 16, dtype=np.uint32) << 16
    patterns = (tops[:, None] | np.array([0x7FFF, 0x8000, 0x8001], dtype=np.uint32)).ravel().tolist()
    assert_bits_equal(to_bf16_bits(as_float32(patterns)), expected_bits(patterns, BF16), patterns)


@pytest.mark.parametrize("bits32, bf16", [
    (0x3F808000, 0x3F80),  # 1 + 2**-8, halfway between 1 and 1 + 2**-7: down to the even 1.0
    (0x3F818000, 0x3F82),  # 1 + 3 * 2**-8, halfway between odd and even: up to the even one
    (0xBF818000, 0xBF82),  # the same tie, negative
    (0x3F808001, 0x3F81),  # just above the tie: up
    (0x3F807FFF, 0x3F80),  # just below the tie: down
    (0x7F7F0000, 0x7F7F),  # largest finite bf16, 3.3895e38
    (0x7F7F7FFF, 0x7F7F),  # just below the tie with infinity: stays finite
    (0x7F7F8000, 0x7F80),  # the tie between the largest finite (odd) and infinity: overflows
    (0x7F7FFFFF, 0x7F80),  # float32's largest value overflows to bf16 infinity
    (0xFF7FFFFF, 0xFF80),  # ... and to -inf when negative
    (0x7F800000, 0x7F80),  # inf
    (0xFF800000, 0xFF80),  # -inf
    (0x00000000, 0x0000),  # +0
    (0x80000000, 0x8000),  # -0 keeps its sign
    (0x00010000, 0x0001),  # smallest bf16 subnormal, 2**-133: kept, not flushed
    (0x00008000, 0x0000),  # half of it: tie, down to the even zero
    (0x80008001, 0x8001),  # just above half, negative: the smallest negative subnormal
    (0x00018000, 0x0002),  # 1.5 subnormal steps: tie, up to the even 2
    (0x807FFFFF, 0x8080),  # largest float32 subnormal rounds up to the smallest normal, -2**-126
    (0x00000001, 0x0000),  # smallest float32 subnormal: far below half a step
])
def test_bf16_named_cases(bits32, bf16):
    assert int(to_bf16_bits(as_float32([bits32]))[0]) == bf16
    assert reference_round(bits32, *BF16) == bf16


@pytest.mark.parametrize("bits32, bf16", [
    (0x7FC00000, 0x7FC0),  # the quiet NaN
    (0xFFC00000, 0xFFC0),  # negative quiet NaN keeps its sign
    (0x7F800001, 0x7FC0),  # signalling NaN whose top half alone would read as +inf
    (0xFF800001, 0xFFC0),
    (0x7FFFFFFF, 0x7FC0),  # all-ones payload: adding a rounding bias would carry out of the exponent
    (0xFFFFFFFF, 0xFFC0),  # and wrap past 2**32 in uint32
    (0x7FA12345, 0x7FC0),  # any payload is dropped
    (0xFFC12345, 0xFFC0),
])
def test_bf16_nan_is_the_quiet_nan_with_its_sign(bits32, bf16):
    assert int(to_bf16_bits(as_float32([bits32]))[0]) == bf16
    assert np.isnan(from_bf16_bits(np.uint16(bf16)))


@pytest.mark.parametrize("value, fp16", [
    (65504.0, 0x7BFF),  # largest finite fp16
    (65519.996, 0x7BFF),  # float32 just below the tie with infinity
    (65520.0, 0x7C00),  # the tie between 65504 (odd) and infinity: overflows
    (-65520.0, 0xFC00),
    (1e6, 0x7C00),
    (2.0**-14, 0x0400),  # smallest normal
    (2.0**-24, 0x0001),  # smallest subnormal: kept
    (2.0**-25, 0x0000),  # half of it: tie, to the even zero
    (np.nextafter(np.float32(2.0**-25), np.float32(1)), 0x0001),  # just above half
    (3 * 2.0**-25, 0x0002),  # 1.5 steps: tie, up to the even 2
    (-(2.0**-26), 0x8000),  # underflows to -0, sign kept
    (-0.0, 0x8000),
    (1 + 2.0**-11, 0x3C00),  # tie between 1 and 1 + 2**-10: to even 1.0
    (1 + 3 * 2.0**-11, 0x3C02),  # tie between odd and even: up
    (float("nan"), 0x7E00),
    (-float("nan"), 0xFE00),
])
def test_fp16_named_cases(value, fp16):
    assert int(to_fp16_bits(np.float32(value))) == fp16


@pytest.mark.parametrize("bits32, fp16", [
    (0x7F800001, 0x7E00),  # NumPy's float16 cast would keep a signalling 0x7C01 here
    (0xFF800001, 0xFE00),
    (0x7FFFFFFF, 0x7E00),
    (0xFFC12345, 0xFE00),
])
def test_fp16_nan_is_the_quiet_nan_with_its_sign(bits32, fp16):
    assert int(to_fp16_bits(as_float32([bits32]))[0]) == fp16


@settings(max_examples=300, deadline=None)
@given(float32_patterns)
def test_fp16_agrees_with_numpys_float16(patterns):
    values = as_float32(patterns)
    with np.errstate(over="ignore"):
        numpy_bits = values.astype(np.float16).view(np.uint16)
    ours = to_fp16_bits(values)
    is_nan = np.isnan(values)
    assert_bits_equal(ours[~is_nan], numpy_bits[~is_nan], np.array(patterns)[~is_nan])
    assert np.array_equal(ours[is_nan] >> 15, numpy_bits[is_nan] >> 15)  # NaNs agree on the sign


@pytest.mark.parametrize("to_bits, from_bits", [(to_bf16_bits, from_bf16_bits),
                                                (to_fp16_bits, from_fp16_bits)])
def test_every_16_bit_pattern_survives_a_round_trip(to_bits, from_bits):
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    values = from_bits(patterns)
    assert values.dtype == np.float32
    back = to_bits(values)
    is_nan = np.isnan(values)
    assert np.array_equal(back[~is_nan], patterns[~is_nan])
    assert np.all(np.isnan(from_bits(back[is_nan])))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(allow_nan=False, width=64), min_size=1, max_size=32))
def test_float64_input_is_rounded_to_float32_first(values):
    doubles = np.array(values, dtype=np.float64)
    with np.errstate(over="ignore"):
        singles = doubles.astype(np.float32)
    assert np.array_equal(to_bf16_bits(doubles), to_bf16_bits(singles))
    assert np.array_equal(to_fp16_bits(doubles), to_fp16_bits(singles))


def test_float64_double_rounding_follows_the_libraries():
    # 1 + 2**-8 + 2**-30 is above bf16's tie, but float32 cannot hold the 2**-30, so the value seen
    # by the bf16 rounding is the tie itself, which goes to the even 1.0 (as PyTorch does).
    assert int(to_bf16_bits(np.float64(1 + 2.0**-8 + 2.0**-30))) == 0x3F80
    assert int(to_fp16_bits(np.float64(1 + 2.0**-11 + 2.0**-30))) == 0x3C00


@pytest.mark.parametrize("round_to, to_bits", [(round_to_bf16, to_bf16_bits), (round_to_fp16, to_fp16_bits)])
def test_round_to_returns_representable_float32_of_the_same_shape(round_to, to_bits):
    x = np.random.default_rng(0).standard_normal((3, 4, 5)) * 1e3
    rounded = round_to(x)
    assert rounded.dtype == np.float32 and rounded.shape == x.shape
    assert np.array_equal(round_to(rounded), rounded)  # already representable: unchanged
    assert np.array_equal(to_bits(rounded), to_bits(x))
    assert round_to(2.5).shape == () and round_to([1.0, 2.0]).shape == (2,)


def test_bf16_value_is_the_top_half_of_the_float32():
    rounded = round_to_bf16(np.random.default_rng(1).standard_normal(1000))
    assert np.all(rounded.view(np.uint32) & 0xFFFF == 0)
