"""Across nodes, tested: two simulated nodes (network namespaces on a bridge), real TCP between them.

A serial test (plain pytest) that launches its own mpiexec: 2 nodes x 4 ranks, dp=2 across the nodes,
pp=2 and tp=2 inside each (the grid's block placement), checked against one process; the ledger's
inter-node bytes checked against the kernel's byte counters of each node's link; tp put across the
nodes by round-robin placement; a fault on a rank of node 2; nothing left behind. Skipped, in one
line, where network namespaces cannot be made (not root, or `ip netns add` refused).

    .venv/bin/python -m pytest -q tests/multinode/test_nodes.py       # make multinode: the figures
"""

from __future__ import annotations

import sys

import pytest
from cluster import SimulatedCluster, namespaces_unavailable, node_job

CFG = dict(dp=2, pp=2, tp=2, precision="fp64", n_layer=2, n_head=2, d_model=16, seq_len=8, batch_size=8,
           microbatches=2, steps=3, quiet=True)
HEADER_BYTES = 54  # Ethernet 14 + IPv4 20 + TCP 20: the least a packet adds to its payload
MOST_OVERHEAD_PER_PACKET = 128  # + TCP timestamps 12 + UCX's message header + control bytes (measured 74-86)
SECONDS = 20  # a job that lost a rank ends "within seconds", not at MPIEXEC_TIMEOUT


@pytest.fixture(scope="module")
def cluster():
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    with SimulatedCluster(nodes=2) as made:
        yield made
    assert made.leftovers() == []


@pytest.fixture(scope="module")
def block(cluster, tmp_path_factory):
    """The job in the grid's placement: ranks 0-3 on node1, 4-7 on node2."""
    found, result, _ = node_job(cluster, CFG, tmp_path_factory.mktemp("block") / "out.json")
    assert result.returncode == 0, result.stderr[-3000:]
    return found


@pytest.fixture(scope="module")
def round_robin(cluster, tmp_path_factory):
    """The same job with ranks dealt out one node at a time: even ranks on node1, odd on node2."""
    found, result, _ = node_job(cluster, CFG, tmp_path_factory.mktemp("rr") / "out.json", "round-robin")
    assert result.returncode == 0, result.stderr[-3000:]
    return found


def inter_node_bytes(found: dict, node: str, step: int) -> int:
    """The ledger's inter-node bytes of one step, summed over the ranks of one node."""
    return sum(r["comm"][step]["by_link"]["inter"] for r in found["ranks"] if r["node"] == node)


def test_two_nodes_train_like_one_process(block):
    assert block["check"]["max_rel_loss_deviation"] <= 1e-9, block["check"]
    assert block["check"]["max_rel_weight_deviation"] <= 1e-9, block["check"]


def test_ranks_run_on_the_nodes_mpiexec_was_told(block, round_robin):
    assert [r["node"] for r in block["ranks"]] == ["node1"] * 4 + ["node2"] * 4  # -hosts node1:4,node2:4
    assert [r["node"] for r in round_robin["ranks"]] == ["node1", "node2"] * 4  # -hosts node1,node2


def test_with_tp_inside_a_node_only_dp_crosses(block):
    for rank in block["ranks"]:
        for step in rank["comm"]:
            assert step["by_dim"]["dp"] > 0 and step["by_dim"]["tp"] > 0 and step["by_dim"]["pp"] > 0
            assert step["by_dim_link"]["dp"] == {"intra": 0, "inter": step["by_dim"]["dp"]}, rank
            assert step["by_dim_link"]["tp"]["inter"] == 0 and step["by_dim_link"]["pp"]["inter"] == 0


def test_round_robin_puts_tp_across_nodes_and_dp_pp_inside(block, round_robin):
    for rank, same_place in zip(round_robin["ranks"], block["ranks"]):
        for step, block_step in zip(rank["comm"], same_place["comm"]):
            assert step["by_dim"] == block_step["by_dim"]  # the layout's bytes do not depend on placement
            assert step["by_link"]["inter"] == step["by_dim"]["tp"], rank
            assert step["by_dim_link"]["dp"]["inter"] == 0 and step["by_dim_link"]["pp"]["inter"] == 0


@pytest.mark.parametrize("placement", ["block", "round_robin"])
def test_kernel_counters_agree_with_the_ledger(placement, request):
    """What each node's link sent in a step: the ledger's inter-node payload plus per-packet headers.

    Fails when MPI takes shared memory between the nodes (the link sees ~nothing), or when the ledger
    charges a collective to the wrong link or misses one (off by a whole shard, far beyond headers)."""
    found = request.getfixturevalue(placement)
    for link in found["links"]:
        for step, (sent, packets) in enumerate(link["per_step"]):
            payload = inter_node_bytes(found, link["node"], step)
            assert payload > 0
            assert payload + HEADER_BYTES * packets <= sent <= payload + MOST_OVERHEAD_PER_PACKET * packets, \
                (link["node"], step, sent, packets, payload)


def test_a_fault_on_node2_ends_every_rank_quickly(cluster):
    command = [sys.executable, "-m", "minipar", "train", "--dp", "2", "--pp", "2", "--tp", "2",
               "--n-layer", "2", "--n-head", "2", "--d-model", "16", "--seq-len", "8", "--batch-size", "8",
               "--steps", "4", "--quiet"]
    result, seconds = cluster.run(command, ranks_per_node=4, env={"MINIPAR_FAULT": "rank:5,step:1"})
    left = cluster.pids_after(SECONDS - seconds)  # mpiexec returns while the killed ranks still exit
    assert result.returncode != 0 and seconds < SECONDS, (result.returncode, seconds)
    assert "[rank 5]" in result.stderr and "injected fault on rank 5" in result.stderr, result.stderr[-2000:]
    assert left == []  # the job itself ended every rank on both nodes, before any teardown


def test_a_failing_body_still_leaves_nothing_behind():
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    with pytest.raises(RuntimeError, match="the job failed"):
        with SimulatedCluster(nodes=2, tag="99") as doomed:
            assert len(doomed.leftovers()) == 2 + 3  # the namespaces, the bridge and the two veths exist
            sleeper = doomed.run(["sleep", "0"], ranks_per_node=1)[0]  # a process ran inside and ended
            assert sleeper.returncode == 0, sleeper.stderr
            raise RuntimeError("the job failed")
    assert doomed.leftovers() == []


def test_ledger_splits_each_dimension_by_link():
    """Without namespaces: the link split adds up to the bytes by dimension, window and total alike."""
    from minipar.dist.comm import TrafficLedger

    ledger = TrafficLedger()
    ledger.charge("dp", "all_reduce", 100, messages=2, link="inter")
    ledger.start_step()
    ledger.charge("dp", "all_reduce", 10, messages=2, link="inter")
    ledger.charge("tp", "all_gather", 7)  # a Comm told no nodes charges inside one
    assert ledger.step_links() == {
        "by_link": {"intra": 7, "inter": 10},
        "by_dim_link": {"dp": {"intra": 0, "inter": 10}, "tp": {"intra": 7, "inter": 0}}}
    assert ledger.total_links()["by_link"] == {"intra": 7, "inter": 110}
