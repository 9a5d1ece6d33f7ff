"""MemoryLedger: current and peak bytes by category and tier, fed by the engines and the meters.

The oracle is a sequence of events written out by hand, with the peaks each should leave."""

from minipar.core import autograd
from minipar.memory.ledger import MemoryLedger, buffer_meter


def test_peaks_are_high_water_marks_of_the_window_and_restart_at_reset():
    with MemoryLedger() as ledger:
        ledger.set("params", 1000)
        ledger.add("grads", 300)
        ledger.add("grads", -300)  # the gradients released: their peak stays
        autograd.activation_meter.add(500)
        autograd.activation_meter.release(200)
        buffer_meter.add(64)
        buffer_meter.release(64)
        buffer_meter.add(32)
        buffer_meter.release(32)
        report = ledger.report()
        assert report["params"] == 1000 and report["grads"] == 300
        assert report["activations_peak"] == 500 and report["buffers_peak"] == 64
        assert report["buffer_allocations"] == 2 and report["buffer_sizes"] == 2  # 64 B and 32 B
        assert report["device_peak"] == 1000 + 500  # the params with the activations at their peak
        ledger.reset_peaks()  # a new step starts from what is held now: 1000 params, 300 activations
        report = ledger.report()
        assert report["grads"] == 0 and report["activations_peak"] == 300 and report["buffers_peak"] == 0
        assert report["device_peak"] == 1300 and report["buffer_allocations"] == 0
        autograd.activation_meter.release(300)


def test_bytes_moved_to_a_lower_tier_leave_the_device_but_stay_held():
    with MemoryLedger() as ledger:
        ledger.set("optimizer", 800)
        ledger.set("optimizer", 300)
        ledger.set("optimizer", 500, tier="cpu")  # offloaded: 300 on the device, 500 on the host
        report = ledger.report()
        assert report["optimizer"] == 800  # held, over every tier
        assert report["by_tier"] == {"device": 300, "cpu": 500, "disk": 0}
        assert ledger.device_total() == 300 and report["device_peak"] == 800
