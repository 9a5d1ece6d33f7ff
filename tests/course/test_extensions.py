"""The extension projects' contracts (minipar_lab/course/extensions.py, lessons/course.md).

Each extension's test skips while its adapter returns None, and holds the student's code to the
contract once it does. Each contract is a function that returns what is wrong (None: kept), tested
here on implementations it must refuse, and where one exists in the reference, on one it must accept:
so a contract can fail, and cannot refuse everything.
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings
from mpi_harness import mpi_test, needs_world_size

from minipar.distributed.collectives import ring_all_reduce
from minipar_lab.course import extensions

NOT_BUILT = "the adapter in minipar_lab/course/extensions.py returns None: wire your code in"

# ---- E1: recursive-doubling all-reduce ----


def sent_bytes(comm) -> int:
    return comm.ledger.total_report()["sent_bytes"]


def all_reduce_contract_broken(comm, all_reduce) -> str | None:
    """Integers equal MPI's sum and floats to 1e-12; log2(N)·S bytes sent by every rank."""
    for dtype, numel in (("int64", 37), ("float64", 64)):
        rng = np.random.default_rng([numel, comm.rank])
        x = rng.integers(-1000, 1000, numel).astype(dtype) if dtype == "int64" else rng.standard_normal(numel)
        before = sent_bytes(comm)
        got = np.asarray(all_reduce(comm, x.copy()))
        sent = sent_bytes(comm) - before
        want = np.empty_like(x)
        comm.mpi.Allreduce(x, want)  # MPI's own sum, uncharged
        if got.shape != x.shape or not np.allclose(got, want, rtol=1e-12, atol=0):
            return f"{dtype}: the result is not the sum over the ranks"
        if sent != int(math.log2(comm.size)) * x.nbytes:
            return f"{dtype}: sent {sent} bytes, recursive doubling sends log2(N)·S = " \
                   f"{int(math.log2(comm.size)) * x.nbytes}"
    return None


@needs_world_size(2, 4, 8)
@mpi_test
def test_e1_recursive_doubling_all_reduce_keeps_the_contract(comm):
    if extensions.recursive_doubling_all_reduce(comm, np.zeros(1)) is None:
        pytest.skip(NOT_BUILT)
    assert all_reduce_contract_broken(comm, extensions.recursive_doubling_all_reduce) is None


@needs_world_size(2, 4, 8)
@mpi_test
def test_e1_contract_refuses_a_wrong_sum_and_the_rings_bytes_but_on_two_ranks(comm):
    assert "not the sum" in all_reduce_contract_broken(comm, lambda comm, x: x)
    verdict = all_reduce_contract_broken(comm, ring_all_reduce)  # right sum; 2(N-1)/N·S bytes
    assert verdict is None if comm.size == 2 else "recursive doubling sends" in verdict


# ---- E2: a ZeRO-3 prefetch plan ----


def uses_of(units: int) -> list[int]:
    return list(range(units)) + list(reversed(range(units)))


def simulate_plan(plan, sizes: list[int]) -> dict:
    """Run a plan over one step's uses: bytes gathered, the peak of whole units' bytes, stalls."""
    uses = uses_of(len(sizes))
    if not isinstance(plan, list) or len(plan) != len(uses):
        raise ValueError(f"a plan is a list of {len(uses)} lists (one per use), got {plan!r}")
    whole, waiting, gathered, stalls, peak = set(), set(), 0, 0, 0
    for t, unit in enumerate(uses):
        if unit not in whole:
            stalls, gathered = stalls + 1, gathered + sizes[unit]
            whole.add(unit)
        waiting.discard(unit)
        for ahead in plan[t]:
            if ahead in whole or not 0 <= ahead < len(sizes):
                raise ValueError(f"use {t} prefetches unit {ahead}, which is whole or no unit")
            whole.add(ahead)
            waiting.add(ahead)
            gathered += sizes[ahead]
        peak = max(peak, sum(sizes[u] for u in whole))
        if t + 1 == len(uses) or uses[t + 1] != unit:
            whole.discard(unit)
    if waiting:
        raise ValueError(f"units {sorted(waiting)} were prefetched and never used")
    return {"gathered": gathered, "peak": peak, "stalls": stalls}


def one_ahead_plan(sizes: list[int], budget: int) -> list[list[int]]:
    """The yardstick: at each use, start the next use's gather when it is another unit and fits."""
    uses, plan, held = uses_of(len(sizes)), [], set()
    for t, unit in enumerate(uses):
        held.add(unit)
        ahead = uses[t + 1] if t + 1 < len(uses) else None
        start = (ahead is not None and ahead not in held
                 and sum(sizes[u] for u in held) + sizes[ahead] <= budget)
        plan.append([ahead] if start else [])
        held = {ahead} if start else set()
        if ahead == unit:
            held.add(unit)
    return plan


def prefetch_contract_broken(plan_of, sizes: list[int], budget: int) -> str | None:
    try:
        mine = simulate_plan(plan_of(sizes, budget), sizes)
    except ValueError as error:
        return str(error)
    plain = 2 * sum(sizes) - sizes[-1]  # no prefetch: every use gathers, the last unit once for both
    if mine["gathered"] != plain:
        return f"gathers {mine['gathered']} bytes, ZeRO-3 without prefetch {plain}"
    if mine["peak"] > budget:
        return f"holds {mine['peak']} bytes of whole units, over the budget {budget}"
    yardstick = simulate_plan(one_ahead_plan(sizes, budget), sizes)["stalls"]
    if mine["stalls"] > yardstick:
        return f"{mine['stalls']} stalls, one-ahead prefetching has {yardstick}"
    return None


PLANS = dict(sizes=st.lists(st.integers(1, 100), min_size=1, max_size=6), extra=st.integers(0, 400))


@settings(max_examples=60, deadline=None)
@given(**PLANS)
def test_e2_prefetch_plan_keeps_the_contract(sizes, extra):
    if extensions.zero3_prefetch_plan([1], 1) is None:
        pytest.skip(NOT_BUILT)
    assert prefetch_contract_broken(extensions.zero3_prefetch_plan, sizes, max(sizes) + extra) is None


@settings(max_examples=60, deadline=None)
@given(**PLANS)
def test_e2_contract_holds_one_ahead_and_refuses_no_prefetch_and_prefetching_everything(sizes, extra):
    budget = max(sizes) + extra
    assert prefetch_contract_broken(one_ahead_plan, sizes, budget) is None
    stalls = simulate_plan(one_ahead_plan(sizes, budget), sizes)["stalls"]
    nothing = prefetch_contract_broken(lambda sizes, budget: [[] for _ in uses_of(len(sizes))], sizes, budget)
    assert (nothing is None) == (stalls == len(sizes) * 2 - 1)

    def everything_at_once(sizes, budget):
        return [list(range(1, len(sizes)))] + [[] for _ in uses_of(len(sizes))[1:]]

    greedy = prefetch_contract_broken(everything_at_once, sizes, budget)
    assert greedy is not None or len(sizes) == 1  # the backward's gathers are missing: other bytes


def test_e2_the_simulator_counts_a_written_out_case():
    sizes = [10, 20, 30]  # uses 0 1 2 2 1 0: 90 bytes gathered (the last unit once for both uses)
    assert one_ahead_plan(sizes, 50) == [[1], [2], [], [1], [0], []]
    assert simulate_plan(one_ahead_plan(sizes, 50), sizes) == {"gathered": 90, "peak": 50, "stalls": 1}
    assert simulate_plan([[] for _ in range(6)], sizes) == {"gathered": 90, "peak": 30, "stalls": 5}


# ---- E3: a 2D tensor-parallel matmul (SUMMA) on 2 x 2 ranks ----


def summa_contract_broken(comm, matmul, n: int = 6) -> str | None:
    q = math.isqrt(comm.size)
    i, j = divmod(comm.rank, q)
    rows = comm.split(color=i, key=j, name="rows")
    columns = comm.split(color=j, key=i, name="columns")
    rng = np.random.default_rng(n)
    a, b = rng.standard_normal((n, n)), rng.standard_normal((n, n))
    w = n // q
    block = (slice(i * w, (i + 1) * w), slice(j * w, (j + 1) * w))
    before = sent_bytes(comm)
    got = np.asarray(matmul(a[block].copy(), b[block].copy(), rows, columns))
    sent = sent_bytes(comm) - before
    verdicts = comm.allgather_obj(bool(got.shape == (w, w) and np.allclose(got, (a @ b)[block], rtol=1e-12,
                                                                               atol=1e-12)))
    if not all(verdicts):
        return f"ranks {[r for r, ok in enumerate(verdicts) if not ok]} hold a wrong block of C"
    if sent > 2 * q * a[block].nbytes:
        return f"rank {comm.rank} sent {sent} bytes, SUMMA at most {2 * q * a[block].nbytes}"
    return None


@needs_world_size(4)
@mpi_test
def test_e3_summa_matmul_keeps_the_contract(comm):
    if extensions.summa_matmul(np.zeros((1, 1)), np.zeros((1, 1)), comm, comm) is None:
        pytest.skip(NOT_BUILT)
    assert summa_contract_broken(comm, extensions.summa_matmul) is None


@needs_world_size(4)
@mpi_test
def test_e3_contract_refuses_a_local_product_and_gathering_whole_operands(comm):
    assert "wrong block" in summa_contract_broken(comm, lambda a, b, rows, columns: a @ b)

    def gather_everything(a_block, b_block, rows, columns):  # right, but 1-D's traffic
        q, w = rows.size, a_block.shape[0]
        a = comm.all_gather(a_block).reshape(q, q, w, w).transpose(0, 2, 1, 3).reshape(q * w, q * w)
        b = comm.all_gather(b_block).reshape(q, q, w, w).transpose(0, 2, 1, 3).reshape(q * w, q * w)
        i, j = columns.rank, rows.rank
        return (a @ b)[i * w:(i + 1) * w, j * w:(j + 1) * w]

    assert "SUMMA at most" in summa_contract_broken(comm, gather_everything)
