"""Dynamic loss scaling, the Precision description and the 2-byte wire format."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipar.precision.formats import (
    PRECISIONS,
    DynamicLossScaler,
    Precision,
    pack_low,
    round_to_bf16,
    round_to_fp16,
    to_bf16_bits,
    to_fp16_bits,
    unpack_low,
)

ROUND_TO = {"bf16": round_to_bf16, "fp16": round_to_fp16}
TO_BITS = {"bf16": to_bf16_bits, "fp16": to_fp16_bits}


# ---- Precision ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name, compute, master, wire_bytes, loss_scaling", [
    ("fp64", np.float64, np.float64, 8, False),
    ("fp32", np.float32, np.float32, 4, False),
    ("bf16", np.float32, np.float32, 2, False),
    ("fp16", np.float32, np.float32, 2, True),
])
def test_precision_from_name(name, compute, master, wire_bytes, loss_scaling):
    p = Precision.from_name(name)
    assert (p.name, p.compute_dtype, p.master_dtype, p.wire_bytes, p.loss_scaling) == (
        name, compute, master, wire_bytes, loss_scaling)
    if name in ROUND_TO:
        assert p.round is ROUND_TO[name]
        assert pack_low(np.ones(3), name).nbytes == 3 * p.wire_bytes
    else:
        assert p.round is None
        assert np.dtype(p.compute_dtype).itemsize == p.wire_bytes


def test_unknown_precision_names_the_choices():
    with pytest.raises(ValueError, match="unknown precision 'fp4'.*bf16"):
        Precision.from_name("fp4")
    assert list(PRECISIONS) == ["fp64", "fp32", "bf16", "fp16", "fp8"]


# ---- pack_low / unpack_low ---------------------------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["bf16", "fp16"]),
       st.lists(st.floats(allow_nan=False, width=32), min_size=1, max_size=40))
def test_pack_then_unpack_gives_the_rounded_values(fmt, values):
    x = np.array(values, dtype=np.float32)
    packed = pack_low(x, fmt)
    assert packed.dtype == np.uint16 and packed.shape == x.shape
    assert np.array_equal(packed, TO_BITS[fmt](x))
    unpacked = unpack_low(packed, fmt)
    assert unpacked.dtype == np.float32
    assert np.array_equal(unpacked.view(np.uint32), ROUND_TO[fmt](x).view(np.uint32))


def test_pack_survives_the_bytes_of_a_message():
    x = np.random.default_rng(0).standard_normal((4, 6))
    for fmt in ("bf16", "fp16"):
        wire = pack_low(x, fmt).tobytes()
        assert len(wire) == x.size * 2
        received = unpack_low(np.frombuffer(wire, dtype=np.uint16), fmt).reshape(x.shape)
        assert np.array_equal(received, ROUND_TO[fmt](x))


def test_unknown_low_format():
    with pytest.raises(ValueError, match="unknown low-precision format 'fp8'"):
        pack_low(np.ones(2), "fp8")
    with pytest.raises(ValueError, match="unknown low-precision format 'fp32'"):
        unpack_low(np.ones(2, dtype=np.uint16), "fp32")


# ---- DynamicLossScaler -------------------------------------------------------------------------

def test_defaults_are_pytorchs():
    scaler = DynamicLossScaler()
    assert scaler.get_scale() == 2.0**16
    assert scaler.state_dict() == {"scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                   "growth_interval": 2000, "_growth_tracker": 0}


def test_scale_multiplies_the_loss():
    scaler = DynamicLossScaler(init_scale=8.0)
    assert scaler.scale(1.5) == 12.0
    assert np.array_equal(scaler.scale(np.array([1.0, -2.0])), [8.0, -16.0])


def test_unscale_divides_in_place_and_reports_clean_gradients():
    scaler = DynamicLossScaler(init_scale=4.0)
    grads = [np.array([4.0, 8.0], dtype=np.float32), np.array([[2.0]])]
    originals = list(grads)
    assert scaler.unscale_(grads) is False
    assert all(g is o for g, o in zip(grads, originals))
    assert np.array_equal(grads[0], [1.0, 2.0]) and grads[0].dtype == np.float32
    assert np.array_equal(grads[1], [[0.5]])


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_unscale_finds_an_inf_or_nan_in_any_gradient(bad):
    scaler = DynamicLossScaler()
    grads = [np.ones(3), np.array([1.0, bad, 2.0])]
    assert scaler.unscale_(grads) is True


def test_unscale_finds_an_overflow_caused_by_a_scale_below_one():
    scaler = DynamicLossScaler(init_scale=2.0**-10)
    grads = [np.array([np.finfo(np.float32).max / 2], dtype=np.float32)]
    with np.errstate(over="ignore"):
        assert scaler.unscale_(grads) is True


def test_a_gradient_that_underflows_in_fp16_survives_when_scaled():
    tiny = 1e-8  # below fp16's smallest subnormal, 6e-8
    assert round_to_fp16(tiny) == 0.0
    scaler = DynamicLossScaler()
    grads = [round_to_fp16(scaler.scale(np.array([tiny])))]  # the fp16 backward sees the scaled value
    assert scaler.unscale_(grads) is False
    assert abs(grads[0][0] - tiny) / tiny < 2.0**-11  # fp16 keeps 11 significant bits


def expected_scale(init_scale, growth_interval, found_infs):
    """Closed form: one backoff per overflow; one growth per full `growth_interval` of each run of
    clean steps (the count restarts after every overflow)."""
    clean_runs = "".join("x" if bad else "." for bad in found_infs).split("x")
    growths = sum(len(run) // growth_interval for run in clean_runs)
    return init_scale * 0.5 ** sum(found_infs) * 2.0**growths


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5), st.lists(st.booleans(), max_size=60))
def test_update_follows_backoff_and_growth(growth_interval, found_infs):
    scaler = DynamicLossScaler(init_scale=2.0**16, growth_interval=growth_interval)
    for found_inf in found_infs:
        scaler.update(found_inf)
    assert scaler.get_scale() == expected_scale(2.0**16, growth_interval, found_infs)


def test_growth_stops_below_fp32_infinity():
    scaler = DynamicLossScaler(init_scale=2.0**127, growth_interval=1)
    scaler.update(False)
    assert scaler.get_scale() == 2.0**127
    assert scaler.state_dict()["_growth_tracker"] == 0


def test_state_dict_round_trip_continues_identically():
    first = DynamicLossScaler(init_scale=1024.0, growth_interval=3)
    for found_inf in [False, False, True, False, False]:
        first.update(found_inf)
    second = DynamicLossScaler()
    second.load_state_dict(first.state_dict())
    for found_inf in [False, False, False, True, False]:
        first.update(found_inf)
        second.update(found_inf)
        assert second.get_scale() == first.get_scale()
    assert second.state_dict() == first.state_dict()


@pytest.mark.parametrize("kwargs, message", [
    ({"init_scale": 0.0}, "init_scale"),
    ({"init_scale": float("inf")}, "init_scale"),
    ({"growth_factor": 1.0}, "growth_factor"),
    ({"backoff_factor": 1.0}, "backoff_factor"),
    ({"backoff_factor": 0.0}, "backoff_factor"),
    ({"growth_interval": 0}, "growth_interval"),
    ({"growth_interval": 2.5}, "growth_interval"),
])
def test_invalid_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicLossScaler(**kwargs)
