"""make multinode: a 3D job on two simulated nodes, and the figures lesson 07 ("Across nodes") quotes.

1. `minipar train --dp N --pp 2 --tp 2 --check-reference` on N nodes x 4 ranks (N = $NODES, default
   2; dp across the nodes): its summary, with the
   link split (bytes that stayed inside a node, bytes that crossed, per dimension).
2. The kernel's count against the ledger, per step and node, for three placements of the same job
   (tp and pp inside a node; pp across; tp across): payload, link bytes, packets, overhead per packet;
   and the bytes the whole job sent that no step window holds (start-up, the final gathers).
3. The alpha-beta effect: step time with tp inside and across nodes, the link limited by tc tbf
   (netem's delay where the kernel has it; skipped in one line otherwise).
4. A fault on a rank of node 2 (rank 5): how long until every rank on both nodes has ended.
5. Hybrid sharding beside FSDP2 on 2 nodes x 2 ranks (`--fsdp --dp-replicate 2`, dp 4; lesson 04b):
   each node's inter-node bytes on the ledger, by dimension, and on the kernel's counters.
6. What is left afterwards: nothing.

Run as root (network namespaces): `make multinode [NODES=3]`, or `.venv/bin/python
tests/multinode/cluster.py` (NODES from the environment).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from cluster import SimulatedCluster, node_job

MODEL = dict(n_layer=4, n_head=4, d_model=64, seq_len=16)  # the default GPT
NODES = int(os.environ.get("NODES", "2"))
LAYOUT = dict(dp=NODES, pp=2, tp=2, microbatches=2)
# Hydra deals ranks out 4, 2 or 1 at a time: on 2 nodes that puts dp, then pp, then tp across them
PLACEMENTS = {"4 at a time (-hosts node1:4,node2:4,..)": 4, "2 at a time (node1:2,node2:2,..)": 2,
              "1 at a time (node1:1,node2:1,..)": 1}
FLAGS = ["--dp", str(NODES), "--pp", "2", "--tp", "2", "--microbatches", "2", "--n-layer", "4",
         "--n-head", "4", "--d-model", "64", "--seq-len", "16", "--batch-size", str(8 * NODES),
         "--precision", "fp64"]


def train_on_two_nodes(cluster: SimulatedCluster) -> bool:
    command = [sys.executable, "-m", "minipar", "train", *FLAGS, "--steps", "3", "--check-reference"]
    result, seconds = cluster.run(command, ranks_per_node=4)
    print(f"$ mpiexec -hosts node1:4,node2:4,... python -m minipar train {' '.join(FLAGS)} --steps 3 "
          f"--check-reference\n{result.stdout}(ended with {result.returncode} after {seconds:.1f} s)")
    return result.returncode == 0


def kernel_against_ledger(cluster: SimulatedCluster, folder: Path) -> bool:
    """Per node, then in all: on 2 nodes MPI's all-reduce and the ring send the same bytes over each
    link; on more, MPICH's algorithm (recursive halving with a fold for N not a power of 2) sends
    them by other routes, so only the total over the links still equals the ring's 2(N-1)·S."""
    print("\nlast step, per node: the ledger's inter-node payload, what the node's link sent (kernel)")
    print(f"{'placement':<40}{'node':>6}{'payload B':>12}{'link B':>12}{'packets':>9}{'B/packet':>10}"
          f"{'overhead':>10}{'outside steps B':>17}")
    ok = True
    cfg = {**MODEL, **LAYOUT, "batch_size": 8 * NODES, "precision": "fp64", "steps": 3, "quiet": True}
    for name, per_turn in PLACEMENTS.items():
        found, result, _ = node_job(cluster, cfg, folder / f"{per_turn}.json", per_turn)
        if result.returncode != 0:
            print(result.stderr[-2000:])
            return False
        ok &= found["check"]["max_rel_weight_deviation"] <= 1e-9
        jobs = {link["node"]: link["job"][0] for link in found["job_links"]}
        rows = []
        for link in found["links"]:
            step, (sent, packets) = len(link["per_step"]) - 1, link["per_step"][-1]  # the last step
            payload = sum(r["comm"][step]["by_link"]["inter"] for r in found["ranks"]
                          if r["node"] == link["node"])
            rows.append((link["node"], payload, sent, packets,
                         jobs[link["node"]] - sum(b for b, _ in link["per_step"])))
        rows.append(("all", *(sum(row[i] for row in rows) for i in range(1, 5))))
        for node, payload, sent, packets, outside in rows:
            print(f"{name:<40}{node:>6}{payload:>12,}{sent:>12,}{packets:>9}"
                  f"{(sent - payload) / packets:>10.1f}{(sent - payload) / payload:>10.2%}{outside:>17,}")
    return ok


def fault_on_node2(cluster: SimulatedCluster) -> bool:
    command = [sys.executable, "-m", "minipar", "train", *FLAGS, "--steps", "4", "--quiet"]
    result, seconds = cluster.run(command, ranks_per_node=4, env={"MINIPAR_FAULT": "rank:5,step:1"})
    left = cluster.pids_after(10)
    print(f"\nMINIPAR_FAULT=rank:5,step:1 (rank 5 runs on node2): mpiexec ended with {result.returncode} "
          f"after {seconds:.1f} s; processes left in the nodes: {len(left)}")
    return result.returncode != 0 and not left


def shaped_step_times(cluster: SimulatedCluster, folder: Path) -> None:
    """The alpha-beta effect: step time with tp inside and across nodes as the link gets slower."""
    print("\nstep time (rank 0, median of steps 1-3) with each node's outgoing link limited by tc tbf")
    print(f"{'link':<12}{'tp inside: s':>14}{'tp across: s':>14}{'across / inside':>17}"
          f"{'inside: B/rate':>16}{'across: B/rate':>16}")
    cfg = {**MODEL, **LAYOUT, "batch_size": 8 * NODES, "precision": "fp64", "steps": 4, "quiet": True}
    for rate, mbit in (("unshaped", None), ("400mbit", 400), ("100mbit", 100), ("25mbit", 25)):
        refused = cluster.shape_links(["tbf", "rate", rate, "burst", "64kb", "latency", "400ms"]
                                      if mbit else None)
        if refused:
            print(f"{rate:<12}skipped: {refused}")
            continue
        seconds, sent = {}, {}
        for per_turn in (4, 1):  # inside, then across: one after the other, at the same load
            found, result, _ = node_job(cluster, cfg, folder / f"shaped{per_turn}.json", per_turn)
            seconds[per_turn] = sorted(found["step_s"][1:])[1] if result.returncode == 0 else float("nan")
            sent[per_turn] = max(link["per_step"][-1][0] for link in found.get("links", [])) or 0
        model = [f"{sent[p] * 8 / (mbit * 1e6):>16.3f}" if mbit else f"{'-':>16}" for p in (4, 1)]
        print(f"{rate:<12}{seconds[4]:>14.3f}{seconds[1]:>14.3f}{seconds[1] / seconds[4]:>17.2f}"
              + "".join(model))
    cluster.shape_links(None)
    refused = cluster.shape_links(["netem", "delay", "1ms"])
    print(f"latency (tc netem delay): {'skipped: ' + refused if refused else 'see lesson 07, exercise 5'}")
    cluster.shape_links(None)


def hybrid_beside_fsdp(cluster: SimulatedCluster, folder: Path) -> bool:
    """Lesson 04b's figures: FSDP2 over dp 4 puts its rings across the two nodes; hybrid sharding
    (replicate 2 x shard 2, a shard group a node) sends only the replicas' all-reduce between them."""
    print("\nFSDP2 and hybrid sharding, dp 4 on 2 nodes x 2 ranks (the default GPT, fp64), the last of 3 "
          "steps: per node, the ledger's inter-node bytes by dimension and what the node's link sent")
    print(f"{'layout':<26}{'node':>6}{'ledger inter-node B by dimension':>36}{'link B':>11}{'packets':>9}"
          f"{'link / ledger':>15}{'B/packet over':>15}")
    ok = True
    base = {**MODEL, "dp": 4, "fsdp": True, "batch_size": 8, "precision": "fp64", "steps": 3, "quiet": True}
    # The prefetched gathers are MPI_Iallgather: with MPICH's ring for them (a CVAR), the gathers send
    # what the ledger's ring charges, and only the reduce-scatter's algorithm still differs.
    ring = {"MPIR_CVAR_IALLGATHER_INTRA_ALGORITHM": "sched_ring"}
    for name, changes, env in (("--fsdp", {}, {}), ("--fsdp, Iallgather ring", {}, ring),
                               ("--fsdp --dp-replicate 2", {"dp_replicate": 2}, {})):
        found, result, _ = node_job(cluster, {**base, **changes}, folder / "hybrid.json", ranks_per_node=2,
                                    env=env)
        if result.returncode != 0:
            print(result.stderr[-2000:])
            return False
        ok &= found["check"]["max_rel_weight_deviation"] <= 1e-9
        for link in found["links"]:
            step, (sent, packets) = len(link["per_step"]) - 1, link["per_step"][-1]
            ranks = [r["comm"][step] for r in found["ranks"] if r["node"] == link["node"]]
            by_dim = {dim: sum(r["by_dim_link"][dim]["inter"] for r in ranks)
                      for dim in ranks[0]["by_dim_link"]}
            payload = sum(by_dim.values())
            shown = ", ".join(f"{dim} {n:,}" for dim, n in by_dim.items() if dim.startswith("dp"))
            print(f"{name:<26}{link['node']:>6}{shown:>36}{sent:>11,}{packets:>9}{sent / payload:>15.4f}"
                  f"{(sent - payload) / packets:>15.1f}")
    return ok


def demo() -> int:
    with tempfile.TemporaryDirectory() as folder, SimulatedCluster(nodes=NODES) as cluster:
        print(f"{NODES} nodes: {', '.join(f'{n.host} {n.address}' for n in cluster.nodes)} on bridge "
              f"{cluster.bridge} {cluster.bridge_address}; UCX_TLS=tcp,self\n")
        ok = train_on_two_nodes(cluster)
        ok = kernel_against_ledger(cluster, Path(folder)) and ok
        shaped_step_times(cluster, Path(folder))
        ok = fault_on_node2(cluster) and ok
        ok = hybrid_beside_fsdp(cluster, Path(folder)) and ok
    left = cluster.leftovers()
    print(f"after teardown: {left or 'no namespace, interface or process left'}")
    return 0 if ok and not left else 1
