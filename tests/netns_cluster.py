"""A real multi-node Ray cluster on one machine: one Linux network namespace per node.

Each node gets its own namespace (so its own IP address, ports and interfaces), joined to the
others by a veth pair on a bridge in the root namespace, and a Ray node started inside it by
`ip netns exec ... ray start`. Node i has 10.213.X.(i+1) on an interface named `vnode<i>`, the
bridge has 10.213.X.254, so the test process (root namespace) reaches the nodes over the bridge.
The head runs in namespace 0.

Isolation from the test session's own Ray and from concurrent runs:
- every Ray node has its own --temp-dir and RAY_TMPDIR (session folders, unix sockets, the
  `ray_current_cluster` file); /dev/shm is shared, but plasma's files there are private temp files;
- the cluster runs with token auth and a token of its own (RAY_AUTH_MODE/RAY_AUTH_TOKEN in `env`),
  whatever ~/.ray/auth_token holds;
- no `ray stop` (it kills every Ray process it can see, the test session's too): cleanup kills
  exactly the processes whose network namespace is one of ours;
- names carry the owner's pid (namespaces `psns-<pid>-<rand>-<i>`, the bridge's alias), so leftovers
  of a crashed run are recognised by their dead owner and removed by the next run.

Needs root and `ip` (iproute2); without them (or where `ip netns add` fails) the test is skipped.

The namespaces and the bridge alone, without Ray, are `NamespaceNetwork` (what NamespaceCluster
builds on): tests/test_cluster_launcher.py runs an sshd in each namespace and lets `ray up` start
Ray there.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

VENV_BIN = Path(sys.executable).parent  # ray and pagedserve of this venv
PREFIX = "psns-"
ALIAS = "pagedserve-netns-cluster owner="  # on the bridge: whose it is
RAY_PORT = 6379  # each namespace has its own ports: the same numbers on every node


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def _netns_inode(name: str) -> int | None:
    try:
        return os.stat(f"/run/netns/{name}").st_ino
    except OSError:
        return None


def _processes_in(inodes: set[int]) -> list[psutil.Process]:
    """Every process whose network namespace is one of `inodes` (Ray's workers rename themselves,
    `ray start` daemons are reparented: the namespace is what surely tells them apart)."""
    found = []
    for proc in psutil.process_iter():
        try:
            link = os.readlink(f"/proc/{proc.pid}/ns/net")  # "net:[4026532345]"
        except OSError:
            continue
        if int(link[5:-1]) in inodes:
            found.append(proc)
    return found


def _kill(procs: list[psutil.Process]) -> None:
    """SIGKILL, as `ray stop --force` does: raylets and the GCS take seconds to leave on SIGTERM."""
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


def _remove_namespaces(names: list[str]) -> None:
    """Kill the processes inside (a namespace lives on while a process holds it), then delete.
    Deleting a namespace deletes its veth end, and with it the pair's end on the bridge."""
    inodes = {ino for ino in map(_netns_inode, names) if ino is not None}
    for _ in range(5):  # again for what was being forked (a raylet starting a worker) meanwhile
        procs = _processes_in(inodes) if inodes else []
        if not procs:
            break
        _kill(procs)
    for name in names:
        _ip("netns", "delete", name, check=False)


def _owner_alive(pid: str) -> bool:
    return pid.isdigit() and psutil.pid_exists(int(pid))


def remove_stale() -> None:
    """Remove what crashed earlier runs left: namespaces, bridges and temp folders whose owner
    process is gone (those of runs still going are left alone)."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    stale = [line.split()[0] for line in listed if line.startswith(PREFIX)]
    _remove_namespaces([name for name in stale if not _owner_alive(name[len(PREFIX):].split("-")[0])])
    for link in json.loads(_ip("-j", "link", "show", "type", "bridge", check=False).stdout or "[]"):
        alias = link.get("ifalias", "")
        if alias.startswith(ALIAS) and not _owner_alive(alias[len(ALIAS):]):
            _ip("link", "delete", link["ifname"], check=False)
    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        if not _owner_alive(folder.name[len(PREFIX):].split("-")[0]):
            shutil.rmtree(folder, ignore_errors=True)


def _free_subnet() -> ipaddress.IPv4Network:
    """A random 10.213.X.0/24 that no address or route on this machine touches (another run,
    a real network)."""
    used = _ip("-o", "addr").stdout + _ip("route").stdout
    for x in random.sample(range(1, 255), 254):
        net = ipaddress.ip_network(f"10.213.{x}.0/24")
        if f"10.213.{x}." not in used:
            return net
    raise RuntimeError("no free 10.213.X.0/24")


class NamespaceNetwork:
    """`num_nodes` network namespaces joined by a bridge in the root namespace, nothing running in
    them; a context manager (skips the test where namespaces cannot be made).

    Attributes (once entered): `node_ips` (node i's address, 10.213.X.(i+1)), `namespaces` (their
    names), `interfaces` (node i's interface name, inside its namespace), `bridge_ip` (the root
    namespace's address on the bridge, 10.213.X.254), `env` (variables run_in_node/run add: none
    here).
    """

    def __init__(self, num_nodes: int = 2, subnet: str | None = None):
        assert 1 <= num_nodes <= 253
        self.num_nodes = num_nodes
        self._subnet = ipaddress.ip_network(subnet) if subnet else None
        assert self._subnet is None or self._subnet.prefixlen == 24, "a /24: the bridge is .254"
        tag = f"{os.getpid()}-{secrets.token_hex(3)}"
        self.namespaces = [f"{PREFIX}{tag}-{i}" for i in range(num_nodes)]
        self.interfaces = [f"vnode{i}" for i in range(num_nodes)]
        self._bridge = f"psbr{tag.split('-')[1]}"  # at most 15 characters
        self._started: list[subprocess.Popen] = []
        self.env: dict[str, str] = {}

    # -- set up / tear down ------------------------------------------------------------------

    def __enter__(self) -> NamespaceNetwork:
        if os.geteuid() != 0:
            pytest.skip("network namespaces need root")
        if not shutil.which("ip"):
            pytest.skip("network namespaces need `ip` (iproute2)")
        remove_stale()
        probe = _ip("netns", "add", self.namespaces[0], check=False)
        if probe.returncode != 0:
            pytest.skip(f"cannot create a network namespace: {probe.stderr.strip()}")
        try:
            self._network()
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _setup(self) -> None:
        """What a subclass starts once the network is up (nothing here)."""

    def _network(self) -> None:
        net = self._subnet or _free_subnet()
        hosts = list(net.hosts())
        self.node_ips = [str(hosts[i]) for i in range(self.num_nodes)]
        self.bridge_ip = str(hosts[253])  # .254
        _ip("link", "add", self._bridge, "type", "bridge")
        _ip("link", "set", self._bridge, "alias", f"{ALIAS}{os.getpid()}")
        _ip("addr", "add", f"{self.bridge_ip}/{net.prefixlen}", "dev", self._bridge)
        _ip("link", "set", self._bridge, "up")
        for i, ns in enumerate(self.namespaces):
            if i > 0:
                _ip("netns", "add", ns)
            outer = f"{self._bridge}v{i}"[:15]
            # The pair's inner end is created inside the namespace: nothing to move or rename.
            _ip("link", "add", outer, "type", "veth", "peer", "name", self.interfaces[i], "netns", ns)
            _ip("link", "set", outer, "master", self._bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.node_ips[i]}/{net.prefixlen}", "dev", self.interfaces[i])
            _ip("-n", ns, "link", "set", self.interfaces[i], "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def close(self) -> None:
        """Kill everything in our namespaces, then delete them and the bridge."""
        _remove_namespaces(self.namespaces)
        for proc in self._started:  # reap our direct children (all dead now)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        _ip("link", "delete", self._bridge, check=False)

    # -- use ---------------------------------------------------------------------------------

    def node_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """This process's environment, less its Ray address and auth, plus `env`."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
        return {**env, **self.env, **(extra or {})}

    def run_in_node(self, i: int, cmd: list[str], env: dict[str, str] | None = None,
                    **popen_kwargs) -> subprocess.Popen:
        """Start `cmd` inside node i's namespace. `env`: variables on top of this process's
        environment and `env`. The process is killed when the network closes."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespaces[i], *cmd], env=self.node_env(env),
                                **{"stdin": subprocess.DEVNULL, **popen_kwargs})
        self._started.append(proc)
        return proc

    def run(self, i: int, cmd: list[str], timeout: float = 120, env: dict[str, str] | None = None) \
            -> subprocess.CompletedProcess:
        """Run `cmd` in node i's namespace to its end; its output as text."""
        return subprocess.run(["ip", "netns", "exec", self.namespaces[i], *cmd], env=self.node_env(env),
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)

    def processes(self, i: int) -> list[psutil.Process]:
        """Every process inside node i's namespace (Ray's and those of run_in_node)."""
        ino = _netns_inode(self.namespaces[i])
        return _processes_in({ino}) if ino is not None else []


class NamespaceCluster(NamespaceNetwork):
    """A Ray cluster of `num_nodes` nodes, one per network namespace; a context manager.

    Attributes (once entered): those of NamespaceNetwork, and `head_address` ("10.213.X.1:6379"),
    `temp_dirs` (node i's Ray temp dir), `env` (variables a process joining the cluster needs: the
    auth token).
    """

    def __init__(self, num_nodes: int = 2, cpus_per_node: int | list[int] = 1, subnet: str | None = None,
                 object_store_memory: int = 80 * 2**20, start_timeout: float = 120):
        super().__init__(num_nodes, subnet)
        # One count for every node, or node i's (a head with more room than the others).
        self.cpus_per_node = [cpus_per_node] * num_nodes if isinstance(cpus_per_node, int) else list(cpus_per_node)
        assert len(self.cpus_per_node) == num_nodes
        self.object_store_memory, self.start_timeout = object_store_memory, start_timeout
        self._work: Path | None = None
        self.env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
                    "RAY_USAGE_STATS_ENABLED": "0"}

    def _setup(self) -> None:
        self.head_address = f"{self.node_ips[0]}:{RAY_PORT}"
        self._start_ray()

    def _ray_start(self, i: int) -> subprocess.Popen:
        # Short paths: Ray's unix sockets live in the temp dir (at most 107 bytes).
        temp = self._work / f"n{i}"
        temp.mkdir()
        role = ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"] if i == 0 \
            else [f"--address={self.head_address}"]  # (which refuses --include-dashboard)
        args = [str(VENV_BIN / "ray"), "start", *role, f"--node-ip-address={self.node_ips[i]}",
                f"--num-cpus={self.cpus_per_node[i]}", f"--object-store-memory={self.object_store_memory}",
                f"--temp-dir={temp}", "--disable-usage-stats"]
        # All nodes start at once: a worker waits for the head's GCS this long (by default 20 s).
        env = {"RAY_TMPDIR": str(temp), "RAY_gcs_server_port_wait_time_s": str(int(self.start_timeout))}
        with open(self._work / f"ray-start-{i}.log", "wb") as log:
            return self.run_in_node(i, args, env=env, stdout=log, stderr=subprocess.STDOUT)

    def _start_ray(self) -> None:
        self._work = Path(tempfile.mkdtemp(prefix=f"{self.namespaces[0][:-2]}-"))
        self.temp_dirs = [str(self._work / f"n{i}") for i in range(self.num_nodes)]
        starts = [self._ray_start(i) for i in range(self.num_nodes)]
        for i, proc in enumerate(starts):
            try:
                rc = proc.wait(timeout=self.start_timeout)
            except subprocess.TimeoutExpired:
                rc = "timeout"
            if rc != 0:
                log = (self._work / f"ray-start-{i}.log").read_text(errors="replace")[-4000:]
                raise AssertionError(f"ray start on node {i} failed ({rc}):\n{log}")
        deadline = time.monotonic() + self.start_timeout
        while (alive := self.alive_nodes()) < self.num_nodes:
            if time.monotonic() > deadline:
                raise AssertionError(f"{alive} of {self.num_nodes} Ray nodes alive after {self.start_timeout:.0f} s")
            time.sleep(1)

    def close(self) -> None:
        """Kill everything in our namespaces, then delete them, the bridge and the temp dirs."""
        super().close()
        if self._work is not None:
            shutil.rmtree(self._work, ignore_errors=True)

    # -- use ---------------------------------------------------------------------------------

    def alive_nodes(self) -> int:
        """Alive nodes by `ray status`, run on the head node (0 while it cannot answer)."""
        result = self.run(0, [str(VENV_BIN / "ray"), "status", f"--address={self.head_address}"], timeout=60)
        if result.returncode != 0 or "Active:" not in result.stdout:
            return 0
        # "Active:\n 1 node_<id>\n 1 node_<id>\nPending:\n ..." (or " (no active nodes)")
        active = result.stdout.split("Active:", 1)[1].split("Pending:", 1)[0]
        return sum(int(line.split()[0]) for line in active.splitlines()
                   if line.strip() and line.split()[0].isdigit() and "node_" in line)

    def kill_raylet(self, i: int) -> int:
        """SIGKILL node i's raylet (as a crashed machine's would die); returns its pid."""
        for proc in self.processes(i):
            try:
                if proc.name() == "raylet":
                    proc.kill()
                    proc.wait(timeout=10)
                    return proc.pid
            except psutil.NoSuchProcess:
                continue
        raise AssertionError(f"no raylet in {self.namespaces[i]}")
