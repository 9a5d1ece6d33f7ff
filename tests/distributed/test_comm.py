"""Comm, its traffic ledger, ProcessGrid, the backend, and the multi-rank harness itself."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import hypothesis.strategies as st
import numpy
import pace
import pytest
from hypothesis import given
from mpi4py import MPI
from mpi_harness import MultiRankFailure, mpi_given, mpi_test, needs_world_size, run_and_share_verdict

from minipar.core import backend
from minipar.core.shards import shard_bounds, shard_sizes
from minipar.distributed.communicator import Comm
from minipar.distributed.grid import ProcessGrid
from minipar.distributed.ledger import TrafficLedger, ring_bytes_sent

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
DTYPES = ["float64", "float32", "int64", "int32", "uint16", "uint8", "float16"]
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


def rank_data(seed: int, rank: int, shape, dtype: str) -> numpy.ndarray:
    """The array rank `rank` contributes: any rank can rebuild every other rank's."""
    rng = numpy.random.default_rng([seed, rank])
    if numpy.dtype(dtype).kind == "f":
        return numpy.asarray(rng.standard_normal(shape)).astype(dtype)
    return numpy.asarray(rng.integers(0, 50, size=shape)).astype(dtype)


def assert_sum_equal(result: numpy.ndarray, inputs: list[numpy.ndarray]) -> None:
    """Integers exactly (wrapping like C); floats to the rounding of their dtype, summed in any order."""
    if result.dtype.kind != "f":
        assert numpy.array_equal(result, numpy.sum(numpy.stack(inputs), axis=0, dtype=result.dtype))
        return
    expected = numpy.sum(numpy.stack(inputs).astype("float64"), axis=0)
    tolerance = {"float16": 5e-2, "float32": 1e-5, "float64": 1e-12}[result.dtype.name]
    numpy.testing.assert_allclose(result.astype("float64"), expected, rtol=tolerance, atol=tolerance)


# ----- serial: partition rule, ring charges, ledger, backend --------------------------------------


@given(n=st.integers(0, 200), parts=st.integers(1, 12))
def test_shard_bounds_is_numpy_array_split(n, parts):
    expected = [len(piece) for piece in numpy.array_split(numpy.arange(n), parts)]
    assert shard_sizes(n, parts) == expected
    bounds = [shard_bounds(n, parts, i) for i in range(parts)]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(stop == start for (_, stop), (start, _) in zip(bounds, bounds[1:]))


@pytest.mark.parametrize("n, parts, index", [(5, 0, 0), (5, 2, 2), (5, 2, -1), (-1, 2, 0)])
def test_shard_bounds_refuses_impossible_shards(n, parts, index):
    with pytest.raises(ValueError):
        shard_bounds(n, parts, index)


@given(n=st.integers(0, 100), parts=st.integers(1, 9), itemsize=st.sampled_from([1, 2, 4, 8]))
def test_ring_charges_add_up_to_the_ring_total(n, parts, itemsize):
    shard_nbytes = [count * itemsize for count in shard_sizes(n, parts)]
    total = n * itemsize
    for op, factor in (("reduce_scatter", 1), ("all_gather", 1), ("all_reduce", 2)):
        charges = [ring_bytes_sent(op, shard_nbytes, rank) for rank in range(parts)]
        assert sum(charges) == factor * (parts - 1) * total
        if n % parts == 0:
            assert charges == [factor * (parts - 1) * total // parts] * parts
        # uneven shards: no rank is more than one element per pass off the exact fraction
        exact = factor * (parts - 1) * total
        assert all(abs(c * parts - exact) <= factor * parts * itemsize for c in charges)


def test_ledger_keeps_a_step_window_and_a_total():
    ledger = TrafficLedger()
    ledger.charge("dp", "all_reduce", 100, messages=2)
    ledger.start_step()
    ledger.charge("dp", "all_reduce", 10, messages=2)
    ledger.charge("tp", "all_gather", 7)
    assert ledger.step_report() == {
        "sent_bytes": 17, "messages": 3, "by_op": {"all_reduce": 10, "all_gather": 7},
        "by_dim": {"dp": 10, "tp": 7}, "by_dim_op": {"dp": {"all_reduce": 10}, "tp": {"all_gather": 7}}}
    total = ledger.total_report()
    assert total["sent_bytes"] == 117 and total["messages"] == 5 and total["by_dim"] == {"dp": 110, "tp": 7}
    ledger.start_step()
    assert ledger.step_report()["sent_bytes"] == 0


def test_single_rank_comm_returns_its_input_and_charges_nothing():
    comm = Comm(MPI.COMM_SELF)
    x = numpy.arange(7.0).reshape(7, 1)
    assert numpy.array_equal(comm.all_reduce(x), x)
    assert numpy.array_equal(comm.reduce_scatter(x), x.ravel())
    assert numpy.array_equal(comm.all_gather(x), x.ravel())
    assert numpy.array_equal(comm.broadcast(x), x)
    report = comm.ledger.total_report()
    assert report["sent_bytes"] == 0 and report["messages"] == 0
    assert set(report["by_op"]) == {"all_reduce", "reduce_scatter", "all_gather", "broadcast"}


def test_single_rank_grid_and_its_errors():
    grid = ProcessGrid(Comm(MPI.COMM_SELF), dp=1, pp=1, tp=1)
    assert (grid.dp_rank, grid.pp_rank, grid.tp_rank) == (0, 0, 0)
    assert (grid.dp.name, grid.pp.name, grid.tp.name) == ("dp", "pp", "tp")
    with pytest.raises(ValueError, match="does not equal the world size 1"):
        ProcessGrid(Comm(MPI.COMM_SELF), dp=2, pp=1, tp=1)
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        ProcessGrid(Comm(MPI.COMM_SELF), dp=1, pp=1, tp=0)


def test_coordinates_of_every_rank_for_every_four_way_layout():
    """The grid's numbering written out by enumeration, cp included (no world size is needed to test
    it): ranks in the order of itertools.product over (dp, pp, cp, tp), tp fastest; coords_of gives
    (dp, pp, tp, cp) and rank_of is its inverse."""
    import itertools

    for dp, pp, cp, tp in itertools.product((1, 2, 3), repeat=4):
        grid = object.__new__(ProcessGrid)  # the numbering alone: no communicators
        grid.dp_size, grid.pp_size, grid.cp_size, grid.tp_size = dp, pp, cp, tp
        ranks = itertools.product(range(dp), range(pp), range(cp), range(tp))
        for rank, (d, p, c, t) in enumerate(ranks):
            layout = f"dp={dp} pp={pp} cp={cp} tp={tp}, rank {rank}"
            assert grid.coords_of(rank) == (d, p, t, c), f"coords_of: {layout}"
            assert grid.rank_of(d, p, t, c) == rank, f"rank_of: {layout}"


def test_numpy_backend_round_trip():
    be = backend.set_backend("numpy")
    assert be is backend.current() and be.xp is numpy
    x = numpy.arange(6.0).reshape(2, 3)
    assert be.to_host(x) is x and be.from_host(x) is x and be.is_device_array(x)
    assert isinstance(be.to_host([1.0, 2.0]), numpy.ndarray)
    assert backend.xp_of(x) is numpy
    be.sync()


def test_backend_errors_are_clear():
    with pytest.raises(ValueError, match="unknown backend 'torch'"):
        backend.set_backend("torch")
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="needs the cupy package"):
            backend.set_backend("cupy")
        assert backend.current().name == "numpy"


# ----- serial: real mpiexec jobs (excepthook, harness verdicts) -----------------------------------


def run_mpi_job(args: list[str], ranks: int, extra_env: dict | None = None, cwd=REPO):
    env = {**os.environ, "MPIEXEC_TIMEOUT": "60", "PYTHONPATH": str(REPO / "tests"), **(extra_env or {})}
    start = time.monotonic()
    job = subprocess.run([str(VENV_BIN / "mpiexec"), "-n", str(ranks), sys.executable, *args],
                         capture_output=True, text=True, timeout=120, env=env, cwd=cwd)
    return job, time.monotonic() - start


def test_excepthook_aborts_every_rank_with_a_ranked_traceback():
    program = ("from mpi4py import MPI\nfrom minipar.distributed.faults import install_excepthook\n"
               "install_excepthook()\n"
               "if MPI.COMM_WORLD.rank == 1:\n    raise ValueError('bad shape on purpose')\n"
               "MPI.COMM_WORLD.Barrier()\n")
    job, seconds = run_mpi_job(["-c", program], ranks=2)
    assert job.returncode != 0 and seconds < pace.allowance(), job
    assert "[rank 1] ValueError: bad shape on purpose" in job.stderr, job
    assert "[rank 0]" not in job.stderr


HARNESS_DEMO = '''
import numpy
import hypothesis.strategies as st
from mpi_harness import mpi_given, mpi_test

@mpi_test
def test_passes(comm):
    assert comm.all_reduce(numpy.ones(2))[0] == comm.size

@mpi_test
def test_fails_on_last_rank(comm):
    comm.all_reduce(numpy.ones(2))
    assert comm.rank != comm.size - 1, "wrong on the last rank"

@mpi_given(n=st.integers(0, 30))
def test_property_fails_on_rank_1(comm, n):
    comm.all_reduce(numpy.ones(n))
    assert not (comm.rank == 1 and n >= 4), f"rank 1 cannot take n={n}"

@mpi_test
def test_rank_1_skips_a_collective(comm):
    if comm.rank == 1:
        raise RuntimeError("rank 1 left early")
    comm.all_reduce(numpy.ones(2))

@mpi_test
def test_deadlock_rank_0_waits_for_a_message_never_sent(comm):
    if comm.rank == 0:
        comm.mpi.recv(source=1, tag=99)

'''


def run_harness_demo(tmp_path, tests: list[str], extra_env=None):
    """Run the named tests of the demo (by node id: -k would also match words in tmp_path's name)."""
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (tmp_path / "test_demo.py").write_text(HARNESS_DEMO)
    args = ["-m", "pytest", "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path), "-m", "mpi", "-q",
            *(f"{tmp_path / 'test_demo.py'}::{name}" for name in tests)]
    return run_mpi_job(args, ranks=3, extra_env=extra_env, cwd=tmp_path)


def test_harness_fails_everywhere_and_reports_on_rank_0(tmp_path):
    job, seconds = run_harness_demo(
        tmp_path, ["test_passes", "test_fails_on_last_rank", "test_property_fails_on_rank_1"])
    assert job.returncode != 0 and seconds < pace.allowance(jobs=6), (seconds, job)
    assert "TIMED OUT" not in job.stdout + job.stderr
    out = job.stdout
    assert out.count("2 failed, 1 passed") == 1, (out, job.stderr, seconds)  # only rank 0 reports
    assert "failed on rank(s) [2] of 3" in out and "wrong on the last rank" in out
    assert "rank 1 cannot take n=4" in out and "n=4," in out  # hypothesis shrank to the edge


def abort_report(tmp_path, job, rank: int) -> str:
    """What rank wrote before it aborted the job: read from its file (MINIPAR_TEST_REPORT_DIR), which
    no launcher can lose; its terminal copy may be cut short when mpiexec kills the job."""
    report = tmp_path / "reports" / f"rank-{rank}.txt"
    assert report.exists(), (job.stdout, job.stderr)
    return report.read_text()


def run_aborting_demo(tmp_path, test: str, **env):
    (tmp_path / "reports").mkdir()
    job, seconds = run_harness_demo(tmp_path, [test], extra_env={
        "MINIPAR_TEST_REPORT_DIR": str(tmp_path / "reports"), "MPIEXEC_TIMEOUT": "100", **env})
    # it aborted on its own, well before mpiexec's timeout would have ended a hang (at this machine's
    # pace: a few start-ups, tests/pace.py, and the grace or deadlock seconds and the harness's pause)
    assert job.returncode != 0 and seconds < pace.allowance(jobs=4) + 4, (seconds, job)
    assert "TIMED OUT" not in job.stdout + job.stderr, job
    return job


def test_harness_aborts_when_a_failed_rank_would_be_waited_for(tmp_path):
    job = run_aborting_demo(tmp_path, "test_rank_1_skips_a_collective", MINIPAR_TEST_GRACE_S="1")
    report = abort_report(tmp_path, job, rank=1)
    assert "[rank 1] failed, and 1 s later the other ranks are still in the test body" in report
    assert "RuntimeError: rank 1 left early" in report


def test_harness_watchdog_prints_every_ranks_stack_and_aborts_a_deadlock(tmp_path):
    job = run_aborting_demo(tmp_path, "test_deadlock_rank_0_waits_for_a_message_never_sent",
                            MINIPAR_TEST_DEADLOCK_S="3")
    waiting = abort_report(tmp_path, job, rank=0)
    assert "test_deadlock_rank_0_waits_for_a_message_never_sent still running after 3 s" in waiting
    assert "in test_deadlock_rank_0_waits_for_a_message_never_sent" in waiting  # its stack, down to the recv
    for rank in (1, 2):  # done with the body, they wait for rank 0: their stacks say so
        assert "in _wait_for_every_rank" in abort_report(tmp_path, job, rank), rank


def test_harness_draws_the_same_examples_in_every_run():
    """In one process the harness runs as on rank 0 of a world of one: call a property twice."""
    drawn = []

    @mpi_given(max_examples=5, n=st.integers(0, 10**6), word=st.text(max_size=5))
    def record(n, word):
        drawn.append((n, word))

    record()
    record()
    assert len(drawn) == 10 and drawn[:5] == drawn[5:] and len(set(drawn)) > 1, drawn


# ----- multi-rank: every collective against a local reference -------------------------------------


@mpi_given(shape=shapes, dtype=st.sampled_from(DTYPES), op=st.sampled_from(["sum", "max", "min"]),
           seed=st.integers(0, 2**32 - 1))
def test_all_reduce(comm, shape, dtype, op, seed):
    comm.ledger.start_step()  # one fixture serves every example: count this one's traffic
    inputs = [rank_data(seed, r, shape, dtype) for r in range(comm.size)]
    result = comm.all_reduce(inputs[comm.rank], op=op)
    assert result.shape == inputs[0].shape and result.dtype == inputs[0].dtype
    if op == "sum":
        assert_sum_equal(result, inputs)
    else:
        expected = getattr(numpy, "maximum" if op == "max" else "minimum").reduce(numpy.stack(inputs))
        assert numpy.array_equal(result, expected)
    sizes = [count * result.itemsize for count in shard_sizes(result.size, comm.size)]
    expected_charge = ring_bytes_sent("all_reduce", sizes, comm.rank)
    assert comm.ledger.step_report()["by_dim_op"] == {"world": {"all_reduce": expected_charge}}
    assert comm.ledger.step_report()["messages"] == 2 * (comm.size - 1)


@mpi_given(n=st.integers(0, 40), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**32 - 1))
def test_reduce_scatter_gives_each_rank_its_shard_of_the_sum(comm, n, dtype, seed):
    comm.ledger.start_step()
    inputs = [rank_data(seed, r, (n,), dtype) for r in range(comm.size)]
    shard = comm.reduce_scatter(inputs[comm.rank].reshape(1, n))
    start, stop = shard_bounds(n, comm.size, comm.rank)
    assert_sum_equal(shard, [x[start:stop] for x in inputs])
    charges = comm.allgather_obj(comm.ledger.step_report()["sent_bytes"])
    assert sum(charges) == (comm.size - 1) * n * numpy.dtype(dtype).itemsize


@mpi_given(seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from(DTYPES), use_numel=st.booleans())
def test_all_gather_of_uneven_shards(comm, seed, dtype, use_numel):
    comm.ledger.start_step()
    rng = numpy.random.default_rng(seed)
    numel = int(rng.integers(0, 30))
    counts = shard_sizes(numel, comm.size) if use_numel else list(rng.integers(0, 6, size=comm.size))
    shards = [rank_data(seed, r, (int(counts[r]),), dtype) for r in range(comm.size)]
    gathered = comm.all_gather(shards[comm.rank], numel=numel if use_numel else None)
    assert numpy.array_equal(gathered, numpy.concatenate(shards))
    itemsize = numpy.dtype(dtype).itemsize
    expected = ring_bytes_sent("all_gather", [int(c) * itemsize for c in counts], comm.rank)
    assert comm.ledger.step_report()["by_op"] == {"all_gather": expected}


@mpi_given(shape=shapes, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**32 - 1))
def test_broadcast_from_every_root(comm, shape, dtype, seed):
    """A chain broadcast root -> root+1 -> ... sends the S bytes N-1 times: to each rank but the root.
    Each rank is the chain's last (it sends nothing) for one root of the N, so over every root it
    sends (N-1) x S, in N-1 messages."""
    comm.ledger.start_step()
    for root in range(comm.size):
        mine = rank_data(seed, comm.rank, shape, dtype)
        received = comm.broadcast(mine, root=root)
        assert numpy.array_equal(received, rank_data(seed, root, shape, dtype))
        assert received is not mine
    nbytes = int(numpy.prod(shape, dtype=int)) * numpy.dtype(dtype).itemsize
    report = comm.ledger.step_report()
    assert report["by_op"] == {"broadcast": (comm.size - 1) * nbytes}
    assert report["messages"] == comm.size - 1


@mpi_test
def test_broadcast_charges_the_chain_what_it_sends(comm):
    """Root 0 on N ranks: ranks 0..N-2 each forward the 8 x 10 = 80 bytes to the next; rank N-1 only
    receives. The charges, written out, add up to (N-1) x S: the payload reaches N-1 ranks once each."""
    S = 80
    expected = {root: [S] * comm.size for root in (0, comm.size - 1)}
    expected[0][comm.size - 1] = 0  # chain 0 -> 1 -> ... -> N-1: the last sends nothing
    expected[comm.size - 1][comm.size - 2] = 0  # chain N-1 -> 0 -> ... -> N-2
    for root, by_rank in expected.items():
        comm.ledger.start_step()
        comm.broadcast(numpy.arange(10.0), root=root)
        charges = comm.allgather_obj(comm.ledger.step_report()["sent_bytes"])
        assert charges == by_rank
        assert sum(charges) == (comm.size - 1) * S


@mpi_test
def test_send_and_recv_around_the_ring_charge_only_the_sender(comm):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    message = numpy.full((2, 3), comm.rank, dtype="int32")
    if comm.rank % 2 == 0:  # even ranks send first so blocking sends cannot deadlock
        comm.send(message, dest=right, tag=5)
        received = comm.recv((2, 3), "int32", source=left, tag=5)
    else:
        received = comm.recv((2, 3), "int32", source=left, tag=5)
        comm.send(message, dest=right, tag=5)
    assert numpy.array_equal(received, numpy.full((2, 3), left))
    assert comm.ledger.total_report() == {"sent_bytes": 24, "messages": 1, "by_op": {"send": 24},
                                          "by_dim": {"world": 24}, "by_dim_op": {"world": {"send": 24}}}


@mpi_test
def test_isend_lets_every_rank_send_before_it_receives(comm):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    big = numpy.full(100_000, float(comm.rank))  # large enough that a blocking Send could wait
    request = comm.isend(big, dest=right, tag=7)
    received = comm.recv(big.shape, big.dtype, source=left, tag=7)
    request.Wait()
    assert numpy.array_equal(received, numpy.full(100_000, float(left)))
    assert comm.ledger.total_report()["by_op"] == {"send": big.nbytes}


@mpi_test
def test_split_shares_the_ledger_and_control_messages_are_free(comm):
    half = comm.split(color=comm.rank % 2, key=-comm.rank, name="half")  # key reverses the order
    members = half.allgather_obj(comm.rank)
    assert members == sorted(range(comm.rank % 2, comm.size, 2), reverse=True)
    assert half.name == "half" and half.ledger is comm.ledger and half.size == len(members)
    assert comm.allreduce_obj(comm.rank, op="max") == comm.size - 1
    assert comm.bcast_obj({"rank": comm.rank}, root=1) == {"rank": 1}
    gathered = comm.gather_obj(comm.rank * 10)
    assert gathered == (list(range(0, 10 * comm.size, 10)) if comm.rank == 0 else None)
    assert comm.ledger.total_report()["sent_bytes"] == 0
    half.all_reduce(numpy.ones(4))
    comm.barrier()
    assert set(comm.ledger.total_report()["by_dim"]) == {"half"}


# The link of each rank's successor on the ring, written out, when a group's last rank is alone on a
# node "b" and the others share node "a": with 3, rank 0 sends to 1 (same node), rank 1 to 2 and rank 2
# to 0 (across); with 2, both cross. With 3 a charge taken to the predecessor's link is wrong too.
SUCCESSOR_LINKS = {1: ["intra"], 2: ["inter", "inter"], 3: ["intra", "inter", "inter"]}


def last_rank_alone(size: int) -> list[str]:
    return ["a"] * (size - 1) + ["b"] if size > 1 else ["a"]


def node_groups(comm) -> Comm:
    """Groups of at most 3 ranks (rank // 3): 2 ranks make one pair, 4 ranks a ring of 3 and one alone."""
    return comm.split(color=comm.rank // 3, key=comm.rank, name="group")


def links_charged(group: Comm, nodes, call) -> tuple[dict, int]:
    """(bytes by link, bytes sent) of one call on the group's ranks placed on `nodes`, a fresh ledger."""
    placed = Comm(group.mpi, name="group", ledger=TrafficLedger(), nodes=nodes)
    call(placed)
    placed.barrier()
    return placed.ledger.step_links()["by_link"], placed.ledger.step_report()["sent_bytes"]


@mpi_test
def test_each_charge_names_the_link_its_bytes_take(comm):
    """A ring collective's bytes go to the successor, a send's to its destination: charged "inter" when
    that rank is on another node, "intra" when on this one or when no nodes are given."""
    group = node_groups(comm)
    n, right, left = group.size, (group.rank + 1) % group.size, (group.rank - 1) % group.size
    x = numpy.arange(6.0)

    def isend_then_recv(c):
        request = c.isend(x, dest=right)
        c.recv(x.shape, x.dtype, source=left)
        request.Wait()

    calls = {"all_reduce": lambda c: c.all_reduce(x),
             "reduce_scatter": lambda c: c.reduce_scatter(x),
             "all_gather": lambda c: c.all_gather(x[slice(*shard_bounds(6, n, c.rank))], 6),
             "iall_reduce": lambda c: c.iall_reduce(x).wait(),
             "iall_gather": lambda c: c.iall_gather(x[slice(*shard_bounds(6, n, c.rank))], 6).wait(),
             "broadcast": lambda c: c.broadcast(x, root=0),
             "sendrecv": lambda c: c.sendrecv(x, dest=right, source=left),
             "isend": isend_then_recv}
    wrong = []  # collected, not asserted at once: a rank that stopped early would leave the others waiting
    for op, call in calls.items():
        for nodes, expected in ((last_rank_alone(n), SUCCESSOR_LINKS[n][group.rank]),
                                (["a"] * n, "intra"), (None, "intra")):
            by_link, sent = links_charged(group, nodes, call)
            other = "intra" if expected == "inter" else "inter"
            chain_end = op == "broadcast" and group.rank == n - 1  # only receives
            if by_link != {expected: sent, other: 0} or not (sent > 0 or n == 1 or chain_end):
                wrong.append((op, nodes, by_link, f"expected all {sent} bytes {expected}"))
    group.mpi.Free()
    assert wrong == []


def factorisations(size: int):
    return [(dp, pp, size // (dp * pp)) for dp in range(1, size + 1) for pp in range(1, size + 1)
            if size % (dp * pp) == 0]


@mpi_test
def test_process_grid_for_every_factorisation(comm):
    for dp, pp, tp in factorisations(comm.size):
        grid = ProcessGrid(comm, dp=dp, pp=pp, tp=tp)
        coords = (grid.dp_rank, grid.pp_rank, grid.tp_rank)
        assert grid.rank_of(*coords) == comm.rank == coords[0] * pp * tp + coords[1] * tp + coords[2]
        for sub, axis in ((grid.dp, 0), (grid.pp, 1), (grid.tp, 2)):
            peers = [list(coords[:axis]) + [i] + list(coords[axis + 1:]) for i in range(sub.size)]
            assert sub.allgather_obj(comm.rank) == [grid.rank_of(*peer) for peer in peers]
            assert sub.rank == coords[axis] and sub.ledger is comm.ledger
        grid.tp.all_reduce(numpy.ones(tp * 2))
        assert comm.ledger.step_report()["by_dim"]["tp"] == 2 * (tp - 1) * 16
        comm.ledger.start_step()
        text = grid.describe()
        assert f"dp={dp} pp={pp} tp={tp}" in text and len(text.splitlines()) == 2 + dp * (pp + 1)


def test_grid_coordinates_put_tp_fastest_then_cp_then_pp_then_dp():
    """The numbering of DESIGN.md, rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank,
    written out as nested loops for a grid of four dimensions of different extents (no MPI: the
    arithmetic of coords_of and rank_of only)."""
    sizes = SimpleNamespace(dp_size=2, pp_size=3, cp_size=2, tp_size=2)
    rank = 0
    for d in range(2):
        for p in range(3):
            for c in range(2):
                for t in range(2):
                    assert ProcessGrid.coords_of(sizes, rank) == (d, p, t, c)
                    assert ProcessGrid.rank_of(sizes, d, p, t, c) == rank
                    rank += 1


@mpi_test
def test_with_cp_the_dp_cp_group_orders_ranks_dp_major(comm):
    """dp_cp joins the ranks that hold the same parameters; its rank is dp_rank * cp + cp_rank, the
    order ZeRO shards over and checkpoints record (a cp-major order shards differently)."""
    if comm.size % 2:
        return
    for dp, cp in ((comm.size // 2, 2), (1, comm.size)):
        grid = ProcessGrid(comm, dp=dp, pp=1, tp=1, cp=cp)
        assert grid.dp_cp.size == dp * cp
        assert grid.dp_cp.rank == grid.dp_rank * cp + grid.cp_rank
        assert grid.cp.rank == grid.cp_rank and grid.dp.rank == grid.dp_rank


@mpi_test
def test_a_layout_built_again_reuses_its_communicators(comm):
    # MPI has about 2,048 communicator ids per process, and every Trainer builds a grid: 550 grids of
    # 4 communicators each run out of them (as the 4-rank test process did) if each grid splits anew.
    first = ProcessGrid(comm, dp=comm.size, pp=1, tp=1)
    for _ in range(550):
        again = ProcessGrid(Comm(comm.mpi), dp=comm.size, pp=1, tp=1)
    assert again.dp.mpi is first.dp.mpi and again.tp.mpi is first.tp.mpi
    assert again.dp.ledger is not first.dp.ledger  # each grid charges its own world's ledger
    other = ProcessGrid(comm, dp=1, pp=1, tp=comm.size)  # another layout: its own communicators
    assert other.dp.mpi is not first.dp.mpi and other.dp.size == 1
    assert other.tp.allgather_obj(comm.rank) == list(range(comm.size))


@needs_world_size(8)
@mpi_test
def test_process_grid_describe_table(comm):
    grid = ProcessGrid(comm, dp=2, pp=2, tp=2)
    assert grid.describe().splitlines()[2:] == [
        "  dp=0      tp=0  tp=1",
        "    pp=0       0     1",
        "    pp=1       2     3",
        "  dp=1      tp=0  tp=1",
        "    pp=0       4     5",
        "    pp=1       6     7"]


@mpi_test
def test_harness_shares_a_failure_on_one_rank_with_every_rank(comm):
    def fails_on_last_rank():
        comm.all_reduce(numpy.ones(1))
        assert comm.rank != comm.size - 1, "only the last rank is wrong"

    with pytest.raises(MultiRankFailure, match=rf"failed on rank\(s\) \[{comm.size - 1}\]") as failure:
        run_and_share_verdict(fails_on_last_rank)
    assert "only the last rank is wrong" in str(failure.value)
    run_and_share_verdict(lambda: None)  # and the next body starts clean
