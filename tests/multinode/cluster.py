"""Simulated nodes on one machine: network namespaces on a bridge, so that MPI must use TCP between them.

Each node is a network namespace with its own address (10.213.K.1i/24 on an interface eth0) joined
to a bridge in the root namespace (10.213.K.1); ranks get their own hostname from a UTS namespace.
mpiexec (MPICH's Hydra) runs in the root namespace and starts one proxy per node through
`enter_node.sh`, which enters the node's namespaces where ssh would log in to another machine.
`-iface BRIDGE` makes the proxies call back to the bridge's address (else they try 127.0.0.1, their
own loopback). Pitfall: the namespaces share one kernel and one /dev/shm, and MPICH's UCX transport
would quietly take shared memory between them; UCX_TLS=tcp,self forces TCP, and the link's byte
counters prove it (lessons/07_3d.md, "Across nodes").

No traffic leaves the namespaces made here: they have no route but their own subnet, and the bridge
has no uplink. `down()` (also on any failure, and on leaving the `with` block) kills what still runs
in the namespaces, deletes them and the bridge; `leftovers()` names whatever is still there.

    sudo python tests/multinode/cluster.py           # make multinode: the demo job and its figures
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
LAUNCHER = HERE / "enter_node.sh"
# UCX over TCP between nodes; MPICH's own shared memory inside a node (it groups ranks by hostname)
TCP_ONLY = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0", "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1"}


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def namespaces_unavailable() -> str | None:
    """Why network namespaces cannot be made here (one line), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"minipar-probe-{os.getpid()}"
    try:
        made = ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        return "no `ip` command (iproute2)"
    if made.returncode != 0:
        return f"`ip netns add` refused: {made.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


def free_subnet(start: int) -> str:
    """A 10.213.K /24 that no interface here uses yet (two clusters at once must not share one)."""
    in_use = ip("-o", "addr", "show", check=False).stdout
    for k in range(200):
        subnet = f"10.213.{20 + (start + k) % 200}"
        if f" {subnet}." not in in_use:
            return subnet
    raise RuntimeError("no free 10.213.K.0/24 subnet for the simulated nodes")


@dataclass(frozen=True)
class Node:
    host: str       # its hostname, as mpiexec -hosts names it
    netns: str      # its network namespace
    address: str    # its address on the bridge
    veth: str       # the root namespace's end of its link (the node's end is eth0)


class SimulatedCluster:
    """`nodes` simulated nodes on a bridge; names carry a tag (default: this process id) so runs differ."""

    def __init__(self, nodes: int = 2, tag: str | None = None):
        self.tag = tag or str(os.getpid() % 100_000)
        self.prefix = f"minipar{self.tag}-"
        subnet = free_subnet(int(self.tag))
        self.bridge, self.bridge_address = f"mnb{self.tag}", f"{subnet}.1"
        self.netns_inodes: list[int] = []  # what identifies a namespace, also once its name is gone
        self.nodes = [Node(f"node{i}", f"{self.prefix}node{i}", f"{subnet}.{10 + i}", f"mnv{self.tag}n{i}")
                      for i in range(1, nodes + 1)]

    def __enter__(self) -> SimulatedCluster:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for node in self.nodes:
            ip("netns", "add", node.netns)
            self.netns_inodes.append(os.stat(f"/run/netns/{node.netns}").st_ino)
            ip("link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns", node.netns)
            ip("link", "set", node.veth, "master", self.bridge, "up")
            ip("-n", node.netns, "addr", "add", f"{node.address}/24", "dev", "eth0")
            ip("-n", node.netns, "link", "set", "eth0", "up")
            ip("-n", node.netns, "link", "set", "lo", "up")

    def pids(self) -> list[int]:
        """Processes in the cluster's namespaces, found by the namespace each process is in (so also
        after `ip netns del`, which forgets the name while a process keeps its namespace alive)."""
        ours, found = {f"net:[{inode}]" for inode in self.netns_inodes}, []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and os.readlink(entry / "ns" / "net") in ours:
                    found.append(int(entry.name))
            except OSError:  # ended meanwhile, or not ours to read
                pass
        return found

    def pids_after(self, seconds: float) -> list[int]:
        """Processes still running after waiting up to `seconds` for the namespaces to empty."""
        deadline = time.monotonic() + seconds
        while (pids := self.pids()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return pids

    def down(self) -> None:
        """Kill what runs in the namespaces, then delete the links, the namespaces and the bridge."""
        for _ in range(50):
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        for node in self.nodes:  # the veth pair first: a deleted namespace frees its links only later
            ip("link", "del", node.veth, check=False)
            ip("netns", "del", node.netns, check=False)
        ip("link", "del", self.bridge, check=False)

    def leftovers(self) -> list[str]:
        """Namespaces, interfaces and processes of this cluster that still exist (empty after down())."""
        namespaces = ip("netns", "list", check=False).stdout
        links = ip("-o", "link", "show", check=False).stdout
        left = [f"namespace {n.netns}" for n in self.nodes if n.netns in namespaces.split()]
        left += [f"interface {name}" for name in [self.bridge] + [n.veth for n in self.nodes]
                 if f" {name}:" in links or f" {name}@" in links]
        return left + [f"process {pid}" for pid in self.pids()]

    def link_counters(self) -> dict[str, dict[str, int]]:
        """Each node's eth0 byte and packet counters, read inside its namespace (/sys/class/net)."""
        names = ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")
        files = [f"/sys/class/net/eth0/statistics/{name}" for name in names]
        counters = {}
        for node in self.nodes:
            read = subprocess.run(["ip", "netns", "exec", node.netns, "cat", *files],
                                  capture_output=True, text=True, check=True)
            counters[node.host] = dict(zip(names, map(int, read.stdout.split())))
        return counters

    def shape_links(self, qdisc: list[str] | None) -> str | None:
        """Give every node's outgoing link a tc queueing discipline (e.g. ["tbf", "rate", "100mbit",
        "burst", "64kb", "latency", "100ms"], or ["netem", "delay", "1ms"]), or take it off (None).
        Returns why the kernel refused it (one line), or None."""
        for node in self.nodes:
            action = ["replace", "dev", "eth0", "root", *qdisc] if qdisc else ["del", "dev", "eth0", "root"]
            done = subprocess.run(["ip", "netns", "exec", node.netns, "tc", "qdisc", *action],
                                  capture_output=True, text=True)
            if done.returncode != 0 and qdisc:
                return f"tc qdisc {' '.join(qdisc)}: {done.stderr.strip()}"
        return None

    def mpiexec(self, command: list[str], ranks_per_node: int, per_turn: int | None = None) -> list[str]:
        """The mpiexec line that starts `command` on every node. Hydra deals ranks out `per_turn` at a
        time, node after node, round and round: per_turn = ranks_per_node (the default) puts ranks
        0..k-1 on node1 (the grid's tensor-parallel partners together); per_turn = 1 deals them out
        one at a time (tp partners apart)."""
        hosts = ",".join(f"{node.host}:{per_turn or ranks_per_node}" for node in self.nodes)
        return [MPIEXEC, "-n", str(ranks_per_node * len(self.nodes)), "-hosts", hosts, "-launcher", "ssh",
                "-launcher-exec", str(LAUNCHER), "-iface", self.bridge, *command]

    def run(self, command: list[str], ranks_per_node: int, per_turn: int | None = None, env=None,
            timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
        """Run a job on the cluster: (its result, seconds it took). A job past timeout is killed whole."""
        environment = {**os.environ, **TCP_ONLY, "MINIPAR_NETNS_PREFIX": self.prefix,
                       "MPIEXEC_TIMEOUT": str(int(timeout)), **(env or {})}
        started = time.monotonic()
        job = subprocess.Popen(self.mpiexec(command, ranks_per_node, per_turn), cwd=ROOT, env=environment,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
        try:
            out, err = job.communicate(timeout=timeout + 10)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            out, err = job.communicate()
        return subprocess.CompletedProcess(job.args, job.returncode, out, err), time.monotonic() - started


def node_job(cluster: SimulatedCluster, cfg: dict, out: Path, per_turn: int | None = None,
             ranks_per_node: int = 4, env=None) -> tuple[dict, subprocess.CompletedProcess, float]:
    """Run tests/multinode/node_job.py (training with the link read at step boundaries): its JSON."""
    command = [sys.executable, "-m", "mpi4py", str(HERE / "node_job.py"), json.dumps(cfg), str(out)]
    result, seconds = cluster.run(command, ranks_per_node, per_turn, env=env)
    found = json.loads(out.read_text()) if result.returncode == 0 and out.exists() else {}
    return found, result, seconds


def main() -> int:
    """make multinode: the 3D job on 2 nodes, its link split, the kernel's bytes, tp across nodes, a fault."""
    from demo import demo  # the demo's figures, beside this file

    reason = namespaces_unavailable()
    if reason:
        print(f"make multinode: skipped: {reason}")
        return 0
    return demo()


if __name__ == "__main__":
    sys.exit(main())
