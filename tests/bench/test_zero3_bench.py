"""`bench zero3`: the runs it makes and the figures it draws from their logs, with `run_train`
replaced by logs whose speeds are set by hand (the real runs are what the lesson quotes)."""

import resource

import pytest

from minipar_lab.bench import zero3


def test_each_round_runs_every_way_under_both_allocators_and_ratios_are_per_round(monkeypatch):
    calls = []
    # tokens/s in rounds 0, 1, 2 (a load that comes and goes); malloc's defaults halve every speed.
    # Per-round ratios 0.8, 1.0, 1.0: median 1.0, where the quotient of the medians says 80/100.
    speeds = {"ddp": [100, 50, 100], "zero3": [80, 50, 100]}

    faulted = [0]  # the children's page faults so far: a start-up of 1000 per run, then 7 per step
    # and rank with freed memory kept, 3000 with malloc's defaults

    def run_train(ranks, args, log, env):
        steps = int(args[args.index("--steps") + 1])
        faulted[0] += 1000 + steps * ranks * (3000 if env else 7)
        if steps == 1:  # the warm-up step alone, for its faults
            return [{"tokens_per_s": 1e9, "comm_wait_s": 9.0}]
        calls.append((ranks, args, env))
        round_ = sum(1 for _, a, e in calls if a == args and e == env) - 1
        way = "zero3" if "--zero" in args else "ddp"
        speed = speeds[way][round_] / (2 if env else 1)
        return [{"tokens_per_s": 1e9, "comm_wait_s": 9.0}] + [
            {"tokens_per_s": speed, "comm_wait_s": 0.002}] * 3

    monkeypatch.setattr(zero3, "run_train", run_train)
    monkeypatch.setattr(zero3, "minor_page_faults", lambda who: faulted[0] if who == resource.RUSAGE_CHILDREN
                        else pytest.fail("the ranks' faults are the finished children's, not this process's"))
    figures = zero3.zero3_figures(dp=2, batch_size=8, steps=4, warmup=1, rounds=3)
    assert len(calls) == 3 * 4 * 2 and all(ranks == 2 for ranks, _, _ in calls)
    assert calls[0][1] == ["--dp", "2", "--batch-size", "8", "--steps", "4"] and calls[0][2] == {}
    assert figures["kept"]["zero3"]["faults_per_step"] == pytest.approx(7)
    assert figures["malloc"]["ddp"]["faults_per_step"] == pytest.approx(3000)
    assert calls[1][2] == {"MINIPAR_SYSTEM_MALLOC": "1"}
    for allocator, scale in (("kept", 1), ("malloc", 2)):
        assert figures[allocator]["zero3"]["vs_ddp"] == pytest.approx(1.0)
        assert figures[allocator]["zero3"]["tokens_per_s"] == pytest.approx(80 / scale)
        assert figures[allocator]["ddp --no-overlap"]["vs_ddp"] == pytest.approx(1.0)
        assert figures[allocator]["ddp"]["comm_wait_ms"] == pytest.approx(2.0)  # the warm-up step left out
    lines = zero3.table(figures)
    assert lines[0].split() == ["way", "tokens/s", "(kept)", "wait", "ms", "vs", "ddp", "faults/step",
                                "tokens/s", "(malloc)", "wait", "ms", "vs", "ddp", "faults/step"]
    assert lines[3].split() == ["zero3", "80", "2.00", "1.00x", "7", "40", "2.00", "1.00x", "3000"]


def test_a_step_that_faults_never_reads_zero_not_below(monkeypatch):
    """faults/step is a full run's faults less a warm-up-only run's: when the warm-up run happens to
    fault more (noise; the steps themselves fault never), the figure is 0, not "-0" in the table."""
    faulted = [0]

    def run_train(ranks, args, log, env):
        steps = int(args[args.index("--steps") + 1])
        faulted[0] += 1100 if steps == 1 else 1000  # no step faults; start-ups differ by 100
        return [{"tokens_per_s": 1e9, "comm_wait_s": 9.0}] + [{"tokens_per_s": 50.0, "comm_wait_s": 0.0}] * 3

    monkeypatch.setattr(zero3, "run_train", run_train)
    monkeypatch.setattr(zero3, "minor_page_faults", lambda who: faulted[0])
    figures = zero3.zero3_figures(dp=2, batch_size=8, steps=4, warmup=1, rounds=1)
    assert {f["faults_per_step"] for ways in figures.values() for f in ways.values()} == {0.0}
    assert "-0" not in "\n".join(zero3.table(figures))
