"""Real multi-node Ray on one machine: each node in its own network namespace (tests/netns_cluster.py).

The cluster is separate from the test session's Ray (the `ray_session` fixture is not used): its
nodes are `ray start` processes inside the namespaces, and the drivers here are scripts run inside
namespace 0, as a driver on the head machine of a real cluster would be.
"""

from __future__ import annotations

import json
import socket
import sys
import time

import pytest

from tests.netns_cluster import NamespaceCluster

pytestmark = pytest.mark.timeout(300)  # a cluster starts in 15-30 s on 2 busy cores

# argv: the head's address. Prints the alive nodes and, for each, the IP its pinned task saw.
PINNED_TASKS = """
import json, sys
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

ray.init(address=sys.argv[1], log_to_driver=False)
nodes = [n for n in ray.nodes() if n["Alive"]]

@ray.remote(num_cpus=1)
def where():
    import os
    return ray.util.get_node_ip_address(), os.readlink("/proc/self/ns/net")

refs = [where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
        for n in nodes]
print(json.dumps({"nodes": [n["NodeManagerAddress"] for n in nodes], "seen": ray.get(refs, timeout=120)}))
"""

# argv: the head's address. One actor per node joins a gloo group of 2 (rendezvous on node 0) and
# all-reduces a tensor: first as is, then (new actors) with GLOO_SOCKET_IFNAME set to the interface
# that holds its node's IP. Prints each try's results (or errors): the first one back of the first
# try, both of the second, by rank.
GLOO_ALL_REDUCE = """
import json, sys
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

ray.init(address=sys.argv[1], log_to_driver=False)

@ray.remote(num_cpus=1)
class Rank:
    def all_reduce(self, master, rank, set_ifname):
        import datetime, os
        import psutil, torch
        import torch.distributed as dist

        ip = ray.util.get_node_ip_address()
        ifname = next(name for name, addrs in psutil.net_if_addrs().items()
                      if any(a.address == ip for a in addrs))
        if set_ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
        try:
            dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=rank, world_size=2,
                                    timeout=datetime.timedelta(seconds=30))
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"}
        try:
            t = torch.tensor([float(rank + 1), 10.0])
            dist.all_reduce(t)
            return {"ip": ip, "ifname": ifname, "sum": t.tolist()}
        finally:
            dist.destroy_process_group()

nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: n["NodeManagerAddress"])
tries = {}
for port, set_ifname in [(29500, False), (29501, True)]:  # a new rendezvous port for each group
    ranks = [Rank.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
             for n in nodes]
    master = f"{nodes[0]['NodeManagerAddress']}:{port}"
    refs = [r.all_reduce.remote(master, i, set_ifname) for i, r in enumerate(ranks)]
    # Without the interface, the rank that connects fails soon; the one that waits for it hangs.
    ready, _ = ray.wait(refs, num_returns=1 if not set_ifname else 2, timeout=120)
    tries[set_ifname] = ray.get(ready)
    for r in ranks:
        ray.kill(r)
print(json.dumps({"default": tries[False], "ifname": tries[True]}))
"""


def _driver(cluster: NamespaceCluster, script: str, timeout: float = 180):
    """Run `script` as a Ray driver in node 0's namespace; its last stdout line, as JSON."""
    result = cluster.run(0, [sys.executable, "-c", script, cluster.head_address], timeout=timeout)
    assert result.returncode == 0, f"driver failed ({result.returncode}):\n{result.stderr[-6000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_tasks_run_on_both_nodes_and_the_root_namespace_reaches_the_head():
    with NamespaceCluster(num_nodes=2, cpus_per_node=1) as cluster:
        out = _driver(cluster, PINNED_TASKS)
        assert sorted(out["nodes"]) == sorted(cluster.node_ips)
        assert sorted(ip for ip, _ in out["seen"]) == sorted(cluster.node_ips)
        assert len({netns for _, netns in out["seen"]}) == 2, out  # really two network namespaces

        # The test process (root namespace) reaches a server on node 0 over the bridge.
        port = 18080
        server = cluster.run_in_node(0, [sys.executable, "-c",
                                         "import socket; s = socket.create_server((%r, %d)); c, _ = s.accept(); "
                                         "c.sendall(b'hello from ns0')" % (cluster.node_ips[0], port)])
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection((cluster.node_ips[0], port), timeout=5) as conn:
                    assert conn.recv(100) == b"hello from ns0"
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline and server.poll() is None, "no server on node 0"
                time.sleep(0.2)
        assert server.wait(timeout=10) == 0


def test_gloo_all_reduce_across_nodes_needs_the_nodes_interface():
    with NamespaceCluster(num_nodes=2, cpus_per_node=1) as cluster:
        out = _driver(cluster, GLOO_ALL_REDUCE)
        # Gloo's default device is the address the hostname resolves to (here 127.0.0.1, by
        # /etc/hosts; no address of the node's namespace in any case): the ranks cannot connect.
        assert len(out["default"]) == 1 and "Gloo connectFullMesh failed" in out["default"][0].get("error", ""), \
            out["default"]
        out = out["ifname"]
        assert [r.get("sum") for r in out] == [[3.0, 20.0], [3.0, 20.0]], out
        assert [r["ip"] for r in out] == cluster.node_ips
        assert [r["ifname"] for r in out] == cluster.interfaces
