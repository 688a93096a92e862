"""Real multi-node Ray on one machine: each node in its own network namespace (tests/netns_cluster.py).

The cluster is separate from the test session's Ray (the `ray_session` fixture is not used): its
nodes are `ray start` processes inside the namespaces, and the drivers here are scripts run inside
namespace 0, as a driver on the head machine of a real cluster would be.

The last tests run `pagedserve serve --address <head>` there, as a user on the head machine would,
and talk to it from this process (the root namespace) over gRPC through the bridge; the expected
tokens are the offline API's, in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import pagedserve
from tests.netns_cluster import VENV_BIN, NamespaceCluster
from tests.test_model_correctness import _prompts

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


def _driver(cluster: NamespaceCluster, script: str, *args: str, timeout: float = 180):
    """Run `script` as a Ray driver in node 0's namespace (argv: the head's address, `args`); its
    last JSON line on stdout. (Ray may print after it: a lost node's explanation, for one.)"""
    result = cluster.run(0, [sys.executable, "-c", script, cluster.head_address, *args], timeout=timeout)
    assert result.returncode == 0, f"driver failed ({result.returncode}):\n{result.stderr[-6000:]}"
    reports = [line for line in result.stdout.splitlines() if line.startswith(("{", "["))]
    assert reports, f"the driver printed no JSON:\n{result.stdout[-6000:]}"
    return json.loads(reports[-1])


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


# ---- `pagedserve serve` on the namespace cluster, driven from the root namespace over gRPC ----

# argv: the head's address, the number of replicas. Prints each replica's worker pids (rank order)
# as the coordinator reports them.
WORKER_PIDS = """
import json, sys
import ray

ray.init(address=sys.argv[1], namespace="pagedserve", log_to_driver=False)
actor = ray.get_actor("pagedserve-coordinator")
print(json.dumps([ray.get(actor.worker_pids.remote(r), timeout=60) for r in range(int(sys.argv[2]))]))
"""

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # tiny llama: layers x K/V x tokens x KV heads x head dim x fp32


def _tail(path: Path, chars: int = 6000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


@contextlib.contextmanager
def _pagedserve_serve(cluster: NamespaceCluster, model: str, log: Path, *flags: str, timeout: float = 240):
    """`pagedserve serve` as a user starts it on the head machine: in node 0's namespace, joining
    the cluster, gRPC on node 0's address. Yields its target ("ip:port", the port it printed once
    it serves; the test process reaches it over the bridge). Ends it with SIGTERM (it drains and
    stops its actor), or SIGKILL if that hangs; the cluster's close kills whatever is left."""
    cmd = [str(VENV_BIN / "pagedserve"), "serve", "--address", cluster.head_address, "--model", model,
           "--host", cluster.node_ips[0], "--port", "0", "--no-http", "--no-metrics", *flags]
    with open(log, "w") as err:
        proc = cluster.run_in_node(0, cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        lines: queue.Queue[str] = queue.Queue()  # stdout has one line: "serving <model> on <host>:<port>"
        threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put("")], daemon=True).start()
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            line = ""
        assert line.startswith("serving "), f"pagedserve serve did not serve ({line!r}):\n{_tail(log)}"
        yield line.split()[-1]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _offline(model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of the offline API in this process (one worker, a roomy pool: no preemption)."""
    params = pagedserve.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with pagedserve.LLM(model, kv_cache_memory=1 << 24) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _generate_concurrently(target: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    async def run():
        async with pagedserve.AsyncClient(target, timeout=180) as client:
            return await asyncio.gather(*(client.generate(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                                          for p in prompts))

    return [list(c.token_ids) for c in asyncio.run(run())]


def _node_of(cluster: NamespaceCluster, pid: int) -> int:
    """Which node's namespace process `pid` runs in (the pid namespace is shared)."""
    for i in range(cluster.num_nodes):
        if pid in {p.pid for p in cluster.processes(i)}:
            return i
    raise AssertionError(f"process {pid} is in none of the cluster's namespaces")


def _titled(cluster: NamespaceCluster, i: int, title: str) -> list[int]:
    """Pids of node i's processes whose title (Ray's workers set theirs) starts with `title`."""
    pids = []
    for proc in cluster.processes(i):
        try:
            if " ".join(proc.cmdline()).startswith(title):
                pids.append(proc.pid)
        except Exception:  # gone meanwhile
            continue
    return pids


def _listener_peers(cluster: NamespaceCluster, i: int, pid: int) -> set[str]:
    """Peers of the connections to what process `pid` (in node i) serves on node i's address
    alone: the KV store's gRPC service (Ray's own server in the process listens on every address)."""
    def ip(address: str) -> str:  # "[::ffff:10.213.7.1]:port" -> "10.213.7.1"
        return address.rsplit(":", 1)[0].removeprefix("[").removesuffix("]").removeprefix("::ffff:")

    # "State Recv-Q Send-Q local peer users:(("name",pid=N,fd=M))"
    rows = [line.split() for line in cluster.run(i, ["ss", "-Htanp"], timeout=30).stdout.splitlines()
            if f"pid={pid}," in line]
    ports = {r[3].rsplit(":", 1)[1] for r in rows if r[0] == "LISTEN" and ip(r[3]) == cluster.node_ips[i]}
    return {ip(r[4]) for r in rows if r[0] == "ESTAB" and r[3].rsplit(":", 1)[1] in ports}


def test_two_replicas_serve_from_two_nodes(tiny_llama, tmp_path):
    """`--data-parallel-size 2` on two 1-CPU nodes: a replica per node, the offline tokens from
    either, round-robin sends both some of the requests."""
    prompts = [[(97 * i + 13 * j) % 4000 + 5 for j in range(8 + 5 * i)] for i in range(6)]
    expected = _offline(tiny_llama, prompts, 8)
    with NamespaceCluster(num_nodes=2, cpus_per_node=1) as cluster, \
            _pagedserve_serve(cluster, tiny_llama, tmp_path / "serve.log", "--data-parallel-size", "2",
                              "--routing-policy", "round-robin", "--kv-cache-memory", str(1 << 22)) as target:
        replicas = _driver(cluster, WORKER_PIDS, "2")
        nodes = [{_node_of(cluster, pid) for pid in pids} for pids in replicas]
        assert nodes in ([{0}, {1}], [{1}, {0}]), nodes  # each replica's worker on a node of its own
        assert _generate_concurrently(target, prompts, 8) == expected
        with pagedserve.Client(target, timeout=60) as client:
            stats = client.stats()
    assert stats["num_replicas"] == 2 and stats["replicas_serving"] == 2
    assert stats["replica.0.routed"] > 0 and stats["replica.1.routed"] > 0
    assert stats["replica.0.routed"] + stats["replica.1.routed"] == len(prompts)


def test_tensor_parallel_ranks_on_two_nodes_swap_through_the_kv_store_over_grpc(tiny_llama, tmp_path):
    """`--tensor-parallel-size 2` where no node holds both ranks (1 CPU each): the ranks span the
    nodes (gloo on the nodes' interfaces), the KV store runs on rank 0's node and, with a pool of
    24 blocks for 10 concurrent sequences, swapped blocks go to it over gRPC, from both ranks;
    the tokens are the offline ones."""
    prompts = _prompts(10, seed=21, high=60)
    expected = _offline(tiny_llama, prompts, 24)
    tight = 24 * BLOCK_BYTES // 2  # 24 blocks: each rank holds one of the two KV heads
    with NamespaceCluster(num_nodes=2, cpus_per_node=1) as cluster, \
            _pagedserve_serve(cluster, tiny_llama, tmp_path / "serve.log", "--tensor-parallel-size", "2",
                              "--kv-cache-memory", str(tight), "--swap-space", "0.01", "--preemption-mode", "swap",
                              "--max-num-batched-tokens", "64") as target:
        (ranks,) = _driver(cluster, WORKER_PIDS, "1")
        nodes = [_node_of(cluster, pid) for pid in ranks]
        assert sorted(nodes) == [0, 1]
        assert [i for i in range(2) for _ in _titled(cluster, i, "ray::KVStore")] == [nodes[0]]
        assert _generate_concurrently(target, prompts, 24) == expected
        with pagedserve.Client(target, timeout=60) as client:
            stats = client.stats()
        # Over gRPC, not shared memory (which these namespaces could share): rank 1's node holds
        # a connection to the store's service.
        (store,) = _titled(cluster, nodes[0], "ray::KVStore")
        assert cluster.node_ips[nodes[1]] in _listener_peers(cluster, nodes[0], store)
    assert stats["kv_blocks_total"] == 24
    assert stats["num_swap_preemptions"] > 0 and stats["swap_out_bytes"] > 0
    assert stats["swap_in_bytes"] == stats["swap_out_bytes"] and stats["worker_restarts"] == 0


def test_a_lost_nodes_replica_is_rebuilt_on_the_head_and_every_request_completes(tiny_llama, tmp_path):
    """`--data-parallel-size 2` over a 3-CPU head and a 1-CPU node: a replica on each. Node 1's
    raylet is SIGKILLed with streams in flight on both: its replica's workers die with it, the
    replica is rebuilt on the head (room for one more rank), every stream ends with the offline
    tokens, and the server stays healthy."""
    prompts = [[(31 * i + 3 * j) % 3000 + 7 for j in range(20 + i)] for i in range(8)]
    max_tokens = 400  # long enough to be in flight when the raylet dies
    expected = _offline(tiny_llama, prompts, max_tokens)
    with NamespaceCluster(num_nodes=2, cpus_per_node=[3, 1]) as cluster, \
            _pagedserve_serve(cluster, tiny_llama, tmp_path / "serve.log", "--data-parallel-size", "2",
                              "--routing-policy", "round-robin", "--kv-cache-memory", str(1 << 22)) as target:
        replicas = _driver(cluster, WORKER_PIDS, "2")
        nodes = [{_node_of(cluster, pid) for pid in pids} for pids in replicas]
        assert nodes in ([{0}, {1}], [{1}, {0}]), nodes
        lost = nodes.index({1})
        results: list = [None] * len(prompts)
        started = [threading.Event() for _ in prompts]

        def consume(i: int) -> None:
            tokens = []
            try:
                with pagedserve.Client(target, timeout=300) as client:
                    for chunk in client.stream(prompts[i], max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
                        tokens += chunk.token_ids
                        started[i].set()
                results[i] = tokens
            except Exception as e:  # noqa: BLE001 - reported by the assertion below
                results[i] = e
            finally:
                started[i].set()

        threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for event in started:
            assert event.wait(120), "a stream produced nothing"
        in_flight = sum(r is None for r in results)  # unfinished streams (all of them, measured)
        cluster.kill_raylet(1)
        for t in threads:
            t.join(timeout=300)
        assert in_flight > 0
        assert [r if isinstance(r, list) else repr(r) for r in results] == expected
        with pagedserve.Client(target, timeout=60) as client:
            assert client.health()
            stats = client.stats()
        # Rebuilt on the head: inside the replica (its worker group) or by the router (the replica).
        assert {_node_of(cluster, pid) for pid in _driver(cluster, WORKER_PIDS, "2")[lost]} == {0}
    assert stats[f"replica.{lost}.worker_restarts"] + stats["replica_restarts"] > 0
    assert stats["num_replicas"] == 2 and stats["replicas_serving"] == 2


def test_prefill_and_decode_on_two_nodes_hand_over_through_the_store_over_grpc(tiny_llama, tmp_path):
    """`--prefill-replicas 1 --decode-replicas 1` on two 1-CPU nodes: a replica per node, the shared
    KV store on the prefill replica's node (whose rank maps its segment), and the decode replica's
    rank loading the handed-over blocks over the store's gRPC service from the other node; the
    tokens are the offline ones."""
    prompts = [[(53 * i + 7 * j) % 3000 + 9 for j in range(40 + 9 * i)] for i in range(6)]
    expected = _offline(tiny_llama, prompts, 8)
    with NamespaceCluster(num_nodes=2, cpus_per_node=1) as cluster, \
            _pagedserve_serve(cluster, tiny_llama, tmp_path / "serve.log", "--prefill-replicas", "1",
                              "--decode-replicas", "1", "--kv-cache-memory", str(1 << 22)) as target:
        (prefill,), (decode,) = _driver(cluster, WORKER_PIDS, "2")
        prefill_node, decode_node = _node_of(cluster, prefill), _node_of(cluster, decode)
        assert {prefill_node, decode_node} == {0, 1}
        assert _generate_concurrently(target, prompts, 8) == expected
        with pagedserve.Client(target, timeout=60) as client:
            stats = client.stats()
        (store,) = _titled(cluster, prefill_node, "ray::KVStore")
        assert cluster.node_ips[decode_node] in _listener_peers(cluster, prefill_node, store)
    assert stats["pd_handoffs"] == len(prompts) and stats["pd_fallback_recomputes"] == 0
    assert stats["pd_transfer_blocks_loaded"] == stats["pd_transfer_blocks_published"] > 0
