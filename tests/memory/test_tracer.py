"""Gemini's memory tracer: the warm-up step's peaks per moment and least budget (by hand), placement by
the trace (no more bytes than the static one, and less where a blind prefetch moves a block twice),
budgets from the least to the full model states trained within them to the single-process numbers,
budgets below the least refused in one line after the warm-up step, and `--device-mem-mb auto`.

    pytest -m "not mpi" tests/memory/test_tracer.py                       # the store, one rank, the CLI
    mpiexec -n K python -m pytest -m mpi tests/memory/test_tracer.py       # K = 2, 4: dp = K
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_harness import mpi_given, needs_world_size
from test_chunks import MODELS, tiny

from minipar.core import autograd
from minipar.memory.ledger import buffer_meter
from minipar.memory.offload import TieredStore
from minipar.memory.tracer import BudgetTooSmall, MemoryTracer, round_up_mb
from minipar.parallel.zero_chunked import chunk_numel_for, device_bytes_needed
from minipar.trainer import build
from minipar.trainer import loop as train
from minipar.trainer.launch import mpiexec
from minipar.trainer.validate import validate

MiB = 2**20
BLOCK = 48  # six float64s


@pytest.fixture(autouse=True)
def clean_meters():
    autograd.activation_meter.current = buffer_meter.current = 0


class Script:
    """A step written out: ("use", keys) uses blocks together, ("others", bytes) sets the non-model
    memory (what the engine's meters do); `run` plays it on a store as the meters would."""

    def __init__(self, events):
        self.events, self.others = events, 0

    def store(self, blocks: int, budget: float, policy: str, traced: bool) -> TieredStore:
        self.others = 0
        tracer = MemoryTracer({"others": lambda: self.others}) if traced else None
        arrays = {key: (np.zeros(BLOCK // 8), "params") for key in range(blocks)}
        return TieredStore(arrays, budget, "cpu", policy, others=lambda: self.others, tracer=tracer)

    def run(self, store: TieredStore, steps: int, check=None) -> list[dict]:
        moved = []
        for _ in range(steps):
            for kind, value in self.events:
                if kind == "others":
                    self.others = value
                    store.relieve()
                    check and check(store)
                else:
                    with store.use(*value):
                        check and check(store)
            store.end_step()
            moved.append(store.last_step)
        return moved

    def least_budget(self) -> int:
        """By hand: at each use, its blocks (all in use together) beside the others then; between uses,
        the others alone (any block not in use can leave)."""
        others, least = 0, 0
        for kind, value in self.events:
            if kind == "others":
                others = value
                least = max(least, others)
            else:
                least = max(least, len(value) * BLOCK + others)
        return least


# ---- serial: the store and its tracer ----

def test_the_warm_up_records_each_moments_peak_and_the_least_budget_by_hand():
    activations, buffers = [0], [0]
    tracer = MemoryTracer({"activations": lambda: activations[0], "buffers": lambda: buffers[0]})
    store = TieredStore({key: (np.zeros(6), "params") for key in "AB"}, 1000, "cpu", "opt", tracer=tracer,
                        others=tracer.others)

    def change(meter, nbytes):
        meter[0] = nbytes
        store.relieve()

    with store.use("A"):  # moment 0: fetch A (48 B), then a 100-byte chunk gathered beside it
        change(buffers, 100)
    for nbytes in (30, 70, 10):  # moment 1: activations rise to 70 and fall to 10 (the chunk stays)
        change(activations, nbytes)
    with store.use("A", "B"):  # moments 2 and 3: A is resident, B is fetched beside it (48 + 110 + 48)
        change(buffers, 0)
    store.end_step()  # the use's end was moment 4, with 10 B of activations left
    assert tracer.labels == [("use", "A"), ("done", ("A",)), ("use", "A"), ("use", "B"), ("done", ("A", "B"))]
    assert tracer.peaks == [100, 170, 110, 110, 10]
    assert tracer.minimum == 48 + 110 + 48  # blocks in use and bytes about to come count, others too
    assert tracer.summary()["activations_peak"] == 70 and tracer.summary()["buffers_peak"] == 100
    assert not tracer.recording and tracer.growth_ahead() == 0


def test_the_trace_saves_a_prefetch_that_the_growing_activations_would_evict():
    """Two blocks, room for both only while the others are zero; LRU. The static store prefetches block 1
    after using 0, then the others grow and LRU evicts 1 (used last step, before 0): six moves a step.
    The traced store sees the growth coming, does not prefetch, and moves four (worked out in the
    lesson)."""
    script = Script([("use", (0,)), ("others", 48), ("use", (1,)), ("use", (0,)), ("others", 0)])
    static = script.run(script.store(2, 2 * BLOCK + 4, "lru", traced=False), steps=3)
    traced = script.run(script.store(2, 2 * BLOCK + 4, "lru", traced=True), steps=3)
    assert [s["moved_bytes"] for s in static[1:]] == [6 * BLOCK] * 2
    assert [s["wasted_prefetches"] for s in static[1:]] == [1, 1] and static[1]["late_evictions"] == 1
    assert [s["moved_bytes"] for s in traced[1:]] == [4 * BLOCK] * 2
    assert traced[1]["wasted_prefetches"] == traced[1]["late_evictions"] == 0


EVENT = st.one_of(st.tuples(st.just("others"), st.sampled_from([0, 24, 48, 72, 96])),
                  st.tuples(st.just("use"), st.lists(st.integers(0, 4), min_size=1, max_size=2, unique=True)
                            .map(tuple)))


@settings(max_examples=40, deadline=None)
@given(events=st.lists(EVENT, min_size=1, max_size=10), blocks=st.integers(2, 5),
       policy=st.sampled_from(["lru", "opt"]), spare=st.integers(0, 3 * BLOCK))
def test_from_the_least_budget_on_no_step_runs_out_and_the_trace_moves_no_more(events, blocks, policy, spare):
    events = [("use", (0,)), *[(k, tuple(b % blocks for b in v) if k == "use" else v) for k, v in events],
              ("others", 0)]  # a step starts with a use (a gather) and ends with its activations freed
    events = [(k, tuple(dict.fromkeys(v)) if k == "use" else v) for k, v in events]
    script = Script(events)
    least = script.least_budget()
    below = script.store(blocks, least - 1, policy, traced=True)
    script.run(below, steps=1)  # the warm-up overdraws rather than fail, and measures
    assert below.tracer.minimum == least

    def within_budget(store):
        assert store.resident() + script.others <= store.budget

    budget = least + spare
    moved = {}
    for traced in (False, True):
        store = script.store(blocks, budget, policy, traced)
        steps = script.run(store, steps=3, check=within_budget)
        moved[traced] = sum(s["moved_bytes"] for s in steps[1:])
        if traced:
            assert store.tracer.minimum == least
            assert all(s["late_evictions"] == s["wasted_prefetches"] == 0 for s in steps[1:])
    assert moved[True] <= moved[False]


# ---- serial: training within budgets from the least to the full model states ----

def run(cfg, comm=MPI.COMM_SELF):
    trainer = train.Trainer(cfg, comm)
    records = trainer.run()
    return trainer, records, trainer.full_state()


def assert_like_one_process(records, full, reference):
    losses, weights = reference
    np.testing.assert_allclose([r["loss"] for r in records], losses, rtol=1e-9, atol=0)
    for name, (_, want) in weights.items():
        np.testing.assert_allclose(full[name], want, rtol=1e-9, atol=1e-12, err_msg=name)


def check_budgets(cfg, comm, fractions):
    """`auto` and the budgets at `fractions` of the way from the least to the full model states (plus
    the non-model peak): within budget on every step, as one process, and no more bytes than static."""
    rank0 = comm.Get_rank() == 0
    reference = train.reference_run(cfg) if rank0 else None
    trainer, records, full = run(cfg.replace(device_mem_mb="auto"), comm)
    least = records[0]["offload"]["budget_bytes"]
    # auto's warm-up runs with no room to spare: its device peak is the least need, as the ledger saw it
    assert least - 1e-4 * MiB < comm.allreduce(records[0]["mem"]["device_peak"], op=MPI.MAX) <= least
    states = sum(sum(tiers.values()) for tiers in trainer.engine.updater.memory().values())
    everything = states + trainer.engine.updater.tracer.summary()["non_model_peak"]
    for fraction in fractions:
        budget_mb = round_up_mb(int(least + fraction * (everything - least)))
        moved = {}
        for static in (True, False):
            _, records, full = run(cfg.replace(device_mem_mb=budget_mb, static_placement=static), comm)
            assert all(r["mem"]["device_peak"] <= budget_mb * MiB for r in records)
            moved[static] = sum(r["offload"]["moved_bytes"] for r in records[1:])
            if not static:
                assert all(r["offload"]["late_evictions"] == r["offload"]["wasted_prefetches"] == 0
                           for r in records[1:])
            if rank0:
                assert_like_one_process(records, full, reference)
        assert moved[False] <= moved[True]
        if fraction >= 1:  # room for everything: after the warm-up nothing moves
            assert moved[False] == 0
    return least


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_budgets_from_the_least_to_the_full_states_train_within_them_like_one_process(offload):
    cfg = tiny(**MODELS["gpt"], dp=1, batch_size=4, steps=3, offload=offload, eviction="lru")
    least = check_budgets(cfg, MPI.COMM_SELF, fractions=[0.0, 0.4, 1.0])
    model = build.build_model(cfg.replace(offload="none"), None)
    up_front = device_bytes_needed(model, chunk_numel_for(cfg, model, 1), 1, 4, offload)
    assert least > up_front  # the activations: what the up-front check cannot know


def test_bf16_budgets_from_the_least_to_the_full_states_train_within_them_like_one_process():
    """In bf16 a gathered chunk holds 2-byte values until gradients widen it to fp32, and each chunk
    has a block more (its 16-bit shard): every budget from the least up is still kept on every step,
    and the up-front figure, counted with those bytes, still stays below the least."""
    cfg = tiny(**MODELS["gpt"], dp=1, batch_size=4, steps=3, offload="cpu", precision="bf16")
    least = check_budgets(cfg, MPI.COMM_SELF, fractions=[0.0, 1.0])
    model = build.build_model(cfg.replace(offload="none"), None)
    up_front = device_bytes_needed(model, chunk_numel_for(cfg, model, 1), 1, 4, "cpu", working_itemsize=2)
    assert least > up_front


def test_below_the_least_every_budget_is_refused_after_the_warm_up_and_nothing_is_written(tmp_path):
    cfg = tiny(**MODELS["gpt"], dp=1, batch_size=4, steps=3, offload="cpu", log=str(tmp_path / "log.jsonl"))
    _, records, _ = run(cfg.replace(device_mem_mb="auto", log=None))
    least = records[0]["offload"]["budget_bytes"]
    model = build.build_model(cfg.replace(offload="none"), None)
    up_front = device_bytes_needed(model, chunk_numel_for(cfg, model, 1), 1, 4, "cpu")
    for budget in (least - 1e-4 * MiB, (least + up_front) / 2, up_front):  # above the up-front figure
        budget_mb = budget / MiB
        assert validate(cfg.replace(device_mem_mb=budget_mb), 1) == []
        trainer = train.Trainer(cfg.replace(device_mem_mb=budget_mb), MPI.COMM_SELF)
        with pytest.raises(BudgetTooSmall) as refusal:
            trainer.run()
        assert trainer.records == [] and not os.path.exists(cfg.log)  # before step 0 is recorded
        message = str(refusal.value)
        assert "\n" not in message and f"at least --device-mem-mb {least / MiB:.4f}" in message
    below = validate(cfg.replace(device_mem_mb=up_front / MiB * 0.99), 1)  # below that: refused up front
    assert len(below) == 1 and "is too small" in below[0]


def test_the_issues_reproducer_is_refused_on_every_rank_and_auto_takes_the_figure_it_names(tmp_path):
    log = tmp_path / "log.jsonl"
    args = ["--dp", "2", "--zero", "3", "--offload", "cpu", "--chunk-mb", "0.25", "--batch-size", "16",
            "--seq-len", "16", "--steps", "2", "--quiet", "--log", str(log)]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "MPIEXEC_TIMEOUT": "100"}

    def train_on_2(budget):
        command = [mpiexec(), "-n", "2", sys.executable, "-m", "minipar", "train", *args,
                   "--device-mem-mb", budget]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)

    refused = train_on_2("1.5")
    lines = refused.stderr.splitlines()
    assert refused.returncode == 2 and len(lines) == 2 and not log.exists(), refused.stderr
    assert all(line.startswith("minipar train: error: --device-mem-mb 1.5 is too small") for line in lines)
    least = re.search(r"at least --device-mem-mb ([0-9.]+)", lines[0]).group(1)
    chose = train_on_2("auto")
    assert chose.returncode == 0 and log.exists(), chose.stderr
    chosen = json.loads(log.read_text().splitlines()[0])["offload"]["budget_bytes"] / MiB
    assert abs(chosen - float(least)) < 1e-9
    misuse = subprocess.run([sys.executable, "-m", "minipar", "train", "--device-mem-mb", "auto",
                             "--static-placement"], capture_output=True, text=True, timeout=60)
    assert misuse.returncode == 2 and misuse.stderr.count("\n") == 1 and "--static-placement" in misuse.stderr


# ---- multi-rank ----

@needs_world_size(2, 4)
@mpi_given(max_examples=2, offload=st.sampled_from(["cpu", "disk"]), fraction=st.floats(0.0, 1.0),
           eviction=st.sampled_from(["lru", "opt"]))
def test_on_every_rank_budgets_from_the_least_fit_and_below_it_all_refuse(comm, offload, fraction, eviction):
    cfg = tiny(**MODELS["gpt"], dp=comm.size, batch_size=2 * comm.size, steps=2, offload=offload,
               eviction=eviction)
    least = check_budgets(cfg, comm.mpi, fractions=[fraction])
    with pytest.raises(BudgetTooSmall):  # on every rank: the verdict is combined over them
        train.Trainer(cfg.replace(device_mem_mb=(least - 1e-4 * MiB) / MiB), comm.mpi).run()
