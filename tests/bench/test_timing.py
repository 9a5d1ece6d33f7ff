"""The shared timing helpers take times as their docstrings say: a warm-up left out, the works taking
turns round by round, hooks where they belong, and a ratio that is the median of per-round ratios.

The clock is a fake one that each work advances by a chosen number of seconds, so that every
figure is known exactly and no test depends on the machine's load."""

import resource
import subprocess
import sys
import time

import pytest

from minipar_lab.bench import timing


class FakeClock:
    """perf_counter() that moves only when a work says how long it took, and a log of the calls."""

    def __init__(self):
        self.now, self.calls = 0.0, []

    def __call__(self):
        return self.now

    def work(self, name, seconds):
        """A work that takes seconds[0], then seconds[1], ... (the first is the warm-up's)."""
        durations = iter(seconds)

        def run():
            self.calls.append(name)
            self.now += next(durations)
        return run


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(time, "perf_counter", fake)
    return fake


def test_the_works_take_turns_after_one_warm_up_of_each_which_is_not_counted(clock):
    works = {"a": clock.work("a", [100, 1, 2, 3]), "b": clock.work("b", [100, 4, 5, 6])}
    times = timing.round_times(works, repeats=3)
    rounds = [clock.calls[i:i + 2] for i in range(2, 8, 2)]
    assert clock.calls[:2] == ["a", "b"]  # the warm-ups, then one of each per round: both see the same load
    assert all(sorted(pair) == ["a", "b"] for pair in rounds)  # not a, a, a, b, b, b
    assert times["a"].tolist() == [1, 2, 3] and times["b"].tolist() == [4, 5, 6]


def test_each_work_follows_each_other_about_equally_often(clock):
    """A work in a fixed place of the round would always follow the same other work, and inherit its
    cache and its freed memory: the orders are shuffled, the same ones in every run."""
    names = "abc"
    works = {name: clock.work(name, iter(lambda: 1, None)) for name in names}
    timing.round_times(works, repeats=300)
    calls = clock.calls[3:]
    followed = {(before, after): 0 for before in names for after in names if before != after}
    for before, after in zip(calls, calls[1:]):
        if before != after:
            followed[before, after] += 1
    # 300 shuffled rounds: 129 to 138 of each of the 6 pairs with the shuffle's seed; a fixed order
    # a, b, c never puts a right after b (min 0). The bound leaves room for other correct seeds: 0.8
    # failed one (9)
    assert min(followed.values()) > 0.6 * max(followed.values())
    clock.calls.clear()
    timing.round_times(works, repeats=300)
    assert clock.calls[3:] == calls  # seeded: every rank and every run takes the same orders


def test_sync_is_timed_with_the_work_and_before_is_not(clock):
    def sync():  # device work that finishes only when waited for
        clock.calls.append("sync")
        clock.now += 10

    def before():  # a barrier: waiting for the other ranks is not the work's time
        clock.calls.append("before")
        clock.now += 1000

    seconds = timing.median_seconds(clock.work("w", [7, 1, 2, 3]), 3, sync=sync, before=before)
    assert seconds == 12  # the median of 1, 2, 3 plus the sync's 10 each
    assert clock.calls[:2] == ["w", "sync"]  # the warm-up waits for its device work too
    assert clock.calls[2:] == ["before", "w", "sync"] * 3


def test_median_of_a_figure_across_log_records():
    records = [{"time_s": 3.0}, {"time_s": 1.0}, {"time_s": 100.0}, {"time_s": 2.0}]
    assert timing.median(records, lambda r: r["time_s"]) == 2.5  # even count: mean of the middle two
    assert timing.median([4, 1, 9]) == 4.0 and isinstance(timing.median([4, 1, 9]), float)


TOUCH_64_MIB = """
import resource
from minipar_lab.bench.timing import minor_page_faults
before = minor_page_faults(resource.RUSAGE_SELF)
pages = b"1" * (64 << 20)  # above malloc's mmap threshold: fresh pages, each written once
print(minor_page_faults(resource.RUSAGE_SELF) - before)
"""


def test_minor_page_faults_are_this_processs_or_its_finished_childrens():
    before = timing.minor_page_faults(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-c", TOUCH_64_MIB], capture_output=True, text=True, timeout=60,
                          check=True)
    child_touching = int(done.stdout)
    assert child_touching >= 32  # 64 MiB: 16384 pages of 4 KiB, or 32 huge pages at the fewest
    assert timing.minor_page_faults(resource.RUSAGE_CHILDREN) - before >= child_touching


def test_spread_is_the_median_and_half_the_interquartile_range_computed_by_hand():
    # 1..5: quartiles 2 and 4 (linear interpolation between order statistics), so 3 ± 1
    assert timing.spread([5, 1, 4, 2, 3]) == (3.0, 1.0)
    # 10, 20, 30, 40: quartiles at positions 0.75 and 2.25 -> 17.5 and 32.5, so 25 ± 7.5
    assert timing.spread([40, 10, 30, 20]) == (25.0, 7.5)
    # one interruption moves neither figure much: 1, 1, 1, 1, 100 -> 1 ± 0
    assert timing.spread([1.0, 1.0, 100.0, 1.0, 1.0]) == (1.0, 0.0)
    assert timing.spread([{"time_s": 0.5}, {"time_s": 1.5}], key=lambda r: r["time_s"]) == (1.0, 0.25)


def test_plus_minus_shows_a_median_and_its_spread():
    assert timing.plus_minus(0.0654, 0.0031, scale=1e3) == "65.4 ± 3.1"
    assert timing.plus_minus(3.0, 1.0, digits=0) == "3 ± 1"


def test_progress_writes_one_numbered_line_per_configuration_to_stderr(capsys):
    progress = timing.Progress("dp", 8)
    progress("dp=1")
    progress("dp=2 overlap")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "[bench dp] 1/8 dp=1\n[bench dp] 2/8 dp=2 overlap\n"
