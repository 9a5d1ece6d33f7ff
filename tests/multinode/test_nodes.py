"""Across nodes, tested: two simulated nodes (network namespaces on a bridge), real TCP between them.

A serial test (plain pytest) that launches its own mpiexec: 2 nodes x 4 ranks, dp=2 across the nodes,
pp=2 and tp=2 inside each (the grid's placement), checked against one process; the ledger's
inter-node bytes checked against the kernel's byte counters of each node's link; pp, then tp, put
across the nodes by dealing ranks out 2, then 1, at a time; hybrid sharding (2 nodes x 2 ranks,
`--fsdp --dp-replicate 2`) sending only the replicas' all-reduce between the nodes, on the ledger
(to the byte, from the shapes) and on the kernel's counters; a fault on a rank of node 2; nothing
left behind. Skipped, in one line, where network namespaces cannot be made (not root, or `ip netns
add` refused).

    .venv/bin/python -m pytest -q tests/multinode/test_nodes.py       # make multinode: the figures
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import cluster as simulated
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


# Hydra deals ranks out `per_turn` at a time, node after node: with 2 nodes, rank r runs on node
# (r // per_turn) % 2 + 1. In the grid (tp fastest, then pp, then dp) that puts one dimension across.
PLACEMENTS = {"tp_pp_inside": 4, "pp_across": 2, "tp_across": 1}


def node_of(rank: int, per_turn: int) -> str:
    return f"node{(rank // per_turn) % 2 + 1}"


def partner(rank: int, dim: str) -> int:
    """The other member of rank's dp, pp or tp group (each of size 2 here), by the grid's formula."""
    stride = {"tp": 1, "pp": 2, "dp": 4}[dim]
    return rank ^ stride


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory):
    """The job in each placement: its JSON (node_job.py)."""
    found = {}
    for name, per_turn in PLACEMENTS.items():
        found[name], result, _ = node_job(cluster, CFG, tmp_path_factory.mktemp(name) / "out.json", per_turn)
        assert result.returncode == 0, result.stderr[-3000:]
    return found


def inter_node_bytes(found: dict, node: str, step: int) -> int:
    """The ledger's inter-node bytes of one step, summed over the ranks of one node."""
    return sum(r["comm"][step]["by_link"]["inter"] for r in found["ranks"] if r["node"] == node)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_two_nodes_train_like_one_process(jobs, placement):
    check = jobs[placement]["check"]
    assert check["max_rel_loss_deviation"] <= 1e-9 and check["max_rel_weight_deviation"] <= 1e-9, check


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_ranks_run_on_the_nodes_mpiexec_was_told(jobs, placement):
    ranks = jobs[placement]["ranks"]
    assert [r["node"] for r in ranks] == [node_of(r, PLACEMENTS[placement]) for r in range(8)]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_dimension_crosses_exactly_where_its_partner_is_on_the_other_node(jobs, placement):
    """tp inside a node (the grid's placement): only dp crosses; dealt out 2 or 1 at a time: pp or tp."""
    for rank in jobs[placement]["ranks"]:
        for step in rank["comm"]:
            assert set(step["by_dim"]) == {"dp", "pp", "tp"} and all(step["by_dim"].values())
            for dim, sent in step["by_dim"].items():
                crosses = node_of(partner(rank["rank"], dim), PLACEMENTS[placement]) != rank["node"]
                assert step["by_dim_link"][dim] == ({"intra": 0, "inter": sent} if crosses else
                                                    {"intra": sent, "inter": 0}), (rank["rank"], dim)
    crossing = {"tp_pp_inside": "dp", "pp_across": "pp", "tp_across": "tp"}[placement]
    for rank, in_grid_placement in zip(jobs[placement]["ranks"], jobs["tp_pp_inside"]["ranks"]):
        for step, grid_step in zip(rank["comm"], in_grid_placement["comm"]):
            assert step["by_dim"] == grid_step["by_dim"]  # a layout's bytes do not depend on placement
            assert step["by_link"]["inter"] == step["by_dim"][crossing]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_kernel_counters_agree_with_the_ledger(jobs, placement):
    """What each node's link sent in a step: the ledger's inter-node payload plus per-packet headers.

    Fails when MPI takes shared memory between the nodes (the link sees ~nothing), or when the ledger
    charges a collective to the wrong link or misses one (off by a whole shard, far beyond headers)."""
    found = jobs[placement]
    for link in found["links"]:
        for step, (sent, packets) in enumerate(link["per_step"]):
            payload = inter_node_bytes(found, link["node"], step)
            assert payload > 0
            assert payload + HEADER_BYTES * packets <= sent <= payload + MOST_OVERHEAD_PER_PACKET * packets, \
                (link["node"], step, sent, packets, payload)


# Hybrid sharding (--fsdp --dp-replicate 2) on 2 nodes x 2 ranks: dp 4 = (replicate 2) x (shard 2),
# shard innermost, so each node is one shard group and the replicas are the nodes.
HYBRID = dict(dp=4, fsdp=True, dp_replicate=2, precision="fp64", n_layer=2, n_head=3, d_model=9, seq_len=8,
              batch_size=8, steps=3, quiet=True)


@pytest.fixture(scope="module")
def hybrid_job(cluster, tmp_path_factory):
    found, result, _ = node_job(cluster, HYBRID, tmp_path_factory.mktemp("hybrid") / "out.json",
                                ranks_per_node=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return found


def replicas_all_reduce_bytes(replica: int) -> int:
    """What a rank sends over dp_replicate in a step, from the shapes: each unit's gradient shard (every
    parameter's rows padded to a multiple of S = 2, a rank keeping half) all-reduced by a 2-rank ring,
    the shard cut in two as array_split cuts, fp64."""
    from minipar.distributed.ledger import ring_bytes_sent
    from minipar.trainer import build
    from minipar.trainer.config import TrainConfig

    model = build.build_model(TrainConfig(**{**HYBRID, "dp": 1, "fsdp": False, "dp_replicate": 1}), None)
    units = [sum(-(-p.shape[0] // 2) * (p.size // p.shape[0]) for p in unit.parameters())
             for _, unit in model.units()]
    return sum(ring_bytes_sent("all_reduce", [(e - e // 2) * 8, e // 2 * 8], replica) for e in units)


def test_hybrid_sharding_on_two_nodes_trains_like_one_process(hybrid_job):
    assert [r["node"] for r in hybrid_job["ranks"]] == ["node1", "node1", "node2", "node2"]
    check = hybrid_job["check"]
    assert check["max_rel_loss_deviation"] <= 1e-9 and check["max_rel_weight_deviation"] <= 1e-9, check


def test_hybrid_sharding_sends_only_the_replicas_all_reduce_between_nodes(hybrid_job):
    """The gathers and reduce-scatters (dp_shard) stay inside a node; what crosses is the all-reduce of
    the gradient shards over dp_replicate, every step, to the byte."""
    for rank in hybrid_job["ranks"]:
        expected = replicas_all_reduce_bytes(replica=rank["rank"] // 2)
        for step in rank["comm"]:
            assert step["by_dim_link"]["dp_replicate"] == {"intra": 0, "inter": expected}, rank["rank"]
            assert step["by_dim_link"]["dp_shard"]["inter"] == 0 < step["by_dim_link"]["dp_shard"]["intra"]
            assert step["by_link"]["inter"] == expected


def test_hybrid_sharding_kernel_counters_agree_with_the_ledger(hybrid_job):
    """Each node's link sent its ranks' all-reduce bytes plus per-packet headers, step by step: a
    gather across the nodes (shard groups not one node each) would add a whole shard's bytes."""
    for link in hybrid_job["links"]:
        for step, (sent, packets) in enumerate(link["per_step"]):
            payload = inter_node_bytes(hybrid_job, link["node"], step)
            assert payload == 2 * replicas_all_reduce_bytes(0 if link["node"] == "node1" else 1)
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
        with SimulatedCluster(nodes=2, tag=str((os.getpid() + 50_000) % 100_000)) as doomed:
            # a rank that outlives its job, on node 2
            subprocess.Popen(["ip", "netns", "exec", doomed.nodes[1].netns, "sleep", "60"])
            while not doomed.pids():  # until it has entered the namespace
                time.sleep(0.01)
            assert len(doomed.leftovers()) == 2 + 3 + 1  # the namespaces, bridge, veths and the process
            raise RuntimeError("the job failed")
    assert doomed.leftovers() == []


def test_ledger_splits_each_dimension_by_link():
    """Without namespaces: the link split adds up to the bytes by dimension, window and total alike."""
    from minipar.distributed.ledger import TrafficLedger

    ledger = TrafficLedger()
    ledger.charge("dp", "all_reduce", 100, messages=2, link="inter")
    ledger.start_step()
    ledger.charge("dp", "all_reduce", 10, messages=2, link="inter")
    ledger.charge("tp", "all_gather", 7)  # a Comm told no nodes charges inside one
    assert ledger.step_links() == {
        "by_link": {"intra": 7, "inter": 10},
        "by_dim_link": {"dp": {"intra": 0, "inter": 10}, "tp": {"intra": 7, "inter": 0}}}
    assert ledger.total_links()["by_link"] == {"intra": 7, "inter": 110}


def test_where_namespaces_cannot_be_made_the_reason_is_one_line(monkeypatch):
    monkeypatch.setattr(simulated.os, "geteuid", lambda: 1000)
    assert namespaces_unavailable() == "network namespaces need root"
    monkeypatch.setattr(simulated.os, "geteuid", lambda: 0)
    refused = subprocess.CompletedProcess([], 1, "", "mount --make-shared /run/netns failed: "
                                                     "Operation not permitted\n")
    monkeypatch.setattr(simulated, "ip", lambda *args, check=True: refused)
    assert namespaces_unavailable() == \
        "`ip netns add` refused: mount --make-shared /run/netns failed: Operation not permitted"


def test_summary_prints_each_dimension_by_link():
    from minipar.trainer.report import comm_table

    comm = {"sent_bytes": 17, "messages": 3, "by_op": {"all_reduce": 17}, "by_dim": {"dp": 10, "tp": 7},
            "by_link": {"intra": 7, "inter": 10},
            "by_dim_link": {"dp": {"intra": 0, "inter": 10}, "tp": {"intra": 7, "inter": 0},
                            "pp": {"intra": 0, "inter": 0}}}
    assert comm_table(comm)[-2:] == ["  intra-node:    dp 0, tp 7", "  inter-node:    dp 10, tp 0"]
