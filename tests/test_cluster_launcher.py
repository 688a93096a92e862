"""The cluster launcher files: cluster.yaml and deploy/cluster.local.yaml.

Both go through the functions `ray up` itself applies to a config before it launches anything;
deliberately broken copies must fail them. Then the local one really runs: `ray up` against
127.0.0.1 over ssh (a private sshd on a free port, started and stopped here), a request through
the server its head commands started, and `ray down`, after which the head's Ray must be gone.

Isolation of the real run, since `ray stop` (in the head commands and in `ray down`) kills every
Ray process it can see: sshd runs in its own PID namespace (`unshare --pid --mount-proc`), so
everything started over ssh sees, and can stop, only the processes of that namespace, never the
test run's own Ray session or anything else on the machine; killing sshd ends the namespace and
whatever is left in it. The ssh login gets its own HOME (sshd's SetEnv) whose ~/.profile puts
this venv's bin on the PATH: a login shell (`bash --login`, which Ray uses) reads /etc/profile,
which resets PATH, and then ~/.profile. Ray's `auth` has no ssh port setting, so the launcher
reaches the free port through a ProxyCommand (a small relay script). Apart from installing the Debian packages when they are
missing (openssh-server, rsync) and sshd's /run/sshd, nothing is written outside a temp folder.

A second real run makes a cluster of two machines: head_ip and one of worker_ips, each a network
namespace (tests/netns_cluster.py's NamespaceNetwork: 10.213.X.1 and .2 on a bridge) with an sshd
on its own port 22, each in its own PID namespace as above. There the login's home comes from a
copy of /etc/passwd bind-mounted in sshd's mount namespace (not SetEnv): the head's autoscaler
runs `ssh -i ~/ray_bootstrap_key.pem`, and ssh takes `~` from the passwd entry. Nothing is written
outside a temp folder there either (and the namespaces and bridge, removed at the end).
"""

from __future__ import annotations

import copy
import getpass
import hashlib
import json
import os
import pwd
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_YAML = ROOT / "cluster.yaml"
LOCAL_YAML = ROOT / "deploy" / "cluster.local.yaml"
VENV_BIN = Path(sys.executable).parent  # the interpreter's own bin folder: ray, pagedserve
DEBIAN_ROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # what /etc/profile sets
SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def _load(path: Path) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


def _ray_checked(raw: dict) -> dict:
    """Apply to a config what `ray up` does before launching (commands._bootstrap_config).

    The local provider goes through `_bootstrap_config` itself (without the cache file). For a
    cloud provider the last steps of that function call the cloud (autodetecting node resources,
    creating key pairs and security groups), so only the provider lookup, `prepare_config` and
    `validate_config` run: the merge with the provider's defaults, the JSON schema (where node
    `resources` must be integers) and the cross-field checks.
    """
    from ray.autoscaler._private.commands import _bootstrap_config
    from ray.autoscaler._private.providers import _NODE_PROVIDERS
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = copy.deepcopy(raw)
    provider = raw["provider"]["type"]
    assert _NODE_PROVIDERS.get(provider) is not None, f"Ray knows no provider {provider!r}"
    if provider == "local":
        return _bootstrap_config(raw, no_config_cache=True)
    config = prepare_config(raw)
    validate_config(config)
    return config


def _command_index(commands: list[str], needle: str) -> int:
    for i, command in enumerate(commands):
        if needle in " ".join(command.split()):
            return i
    raise AssertionError(f"no command contains {needle!r}: {commands}")


# ---------------------------------------------------------------------------------------------
# Ray's config validation


def test_cluster_yaml_passes_rays_validation():
    config = _ray_checked(_load(CLUSTER_YAML))
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    # The head serves: its GPUs hold the tensor-parallel group of the serve command.
    serve = next(c for c in config["head_start_ray_commands"] if "pagedserve serve" in c).split()
    tp = int(serve[serve.index("--tensor-parallel-size") + 1])
    assert serve[serve.index("--device") + 1] == "cuda" and head["resources"].get("GPU", 0) >= tp
    assert [name for name, t in types.items() if t["resources"].get("GPU", 0) > 0 and t is not head], \
        "GPU worker node types"
    for t in types.values():
        assert all(type(v) is int for v in t["resources"].values()), t["resources"]
    setup = config["setup_commands"]
    assert _command_index(setup, "pip install") <= _command_index(setup, "torch") \
        < _command_index(setup, "pagedserve[gpu]"), "torch is installed before pagedserve"
    start = config["head_start_ray_commands"]
    assert _command_index(start, "ray start --head") \
        < _command_index(start, "pagedserve serve --address auto --detach")


def test_local_yaml_passes_rays_bootstrap():
    raw = _load(LOCAL_YAML)
    assert "available_node_types" not in raw  # the local provider refuses it
    config = _ray_checked(raw)
    assert config["provider"]["head_ip"] == "127.0.0.1"
    assert list(config["available_node_types"]) == [config["head_node_type"]]
    start = config["head_start_ray_commands"]
    assert _command_index(start, "ray start --head") \
        < _command_index(start, "pagedserve serve --address auto --detach")


def _fractional_gpus(c):
    c["available_node_types"]["gpu-4x-a10g"]["resources"]["GPU"] = 3.5


def _misspelt_key(c):
    c["setup_comands"] = c.pop("setup_commands")


def _unknown_head_type(c):
    c["head_node_type"] = "no-such-type"


def _local_with_node_types(c):
    c["available_node_types"] = {"head": {"resources": {}, "node_config": {}}}


def _local_without_head_ip(c):
    del c["provider"]["head_ip"]


@pytest.mark.parametrize("path,breakage", [
    (CLUSTER_YAML, _fractional_gpus),
    (CLUSTER_YAML, _misspelt_key),
    (CLUSTER_YAML, _unknown_head_type),
    (LOCAL_YAML, _local_with_node_types),
    (LOCAL_YAML, _local_without_head_ip),
], ids=lambda v: v.__name__.strip("_") if callable(v) else v.name)
def test_broken_copies_fail_rays_validation(path, breakage):
    import click
    import jsonschema

    raw = _load(path)
    _ray_checked(raw)  # the file itself passes
    breakage(raw)
    with pytest.raises((jsonschema.ValidationError, ValueError, click.ClickException)):
        _ray_checked(raw)


# ---------------------------------------------------------------------------------------------
# A real `ray up` / `ray down` of deploy/cluster.local.yaml against 127.0.0.1 over ssh

_RELAY = """\
import os, socket, sys, threading
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
def upstream():
    while True:
        data = os.read(0, 65536)
        if not data:
            break
        sock.sendall(data)
    sock.shutdown(socket.SHUT_WR)
threading.Thread(target=upstream, daemon=True).start()
out = sys.stdout.buffer
while True:
    data = sock.recv(65536)
    if not data:
        break
    out.write(data)
    out.flush()
"""


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _apt_install(packages: list[str]) -> None:
    """Install Debian packages, or skip the test saying why that is impossible."""
    if os.geteuid() != 0:
        pytest.skip(f"needs {' '.join(packages)} (not installed, and not root to apt-get them)")
    if not shutil.which("apt-get"):
        pytest.skip(f"needs {' '.join(packages)} (not installed, and no apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    # Keep the package from starting a system-wide sshd on port 22 (where no policy exists yet).
    policy = Path("/usr/sbin/policy-rc.d")
    own_policy = not policy.exists()
    if own_policy:
        policy.write_text("#!/bin/sh\n# written by tests/test_cluster_launcher.py while it installs\nexit 101\n")
        policy.chmod(0o755)
    try:
        result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:  # a fresh machine may have no package lists yet
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
            result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
    finally:
        if own_policy:
            policy.unlink(missing_ok=True)
    if result.returncode != 0:
        pytest.skip(f"could not install {' '.join(packages)}: {result.stderr.strip()[-500:]}")


def _ensure_tools() -> str:
    """sshd, ssh-keygen, rsync (`ray up` copies its bootstrap files with it), unshare."""
    needed = {"sshd": "openssh-server", "ssh": "openssh-client", "ssh-keygen": "openssh-client",
              "rsync": "rsync", "unshare": "util-linux"}
    missing = sorted({pkg for tool, pkg in needed.items() if not shutil.which(tool, path=SBIN_PATH)})
    if missing:
        _apt_install(missing)
    sshd = shutil.which("sshd", path=SBIN_PATH)
    assert sshd, "sshd still missing after installing openssh-server"
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("needs a PID namespace (unshare --pid --mount-proc, i.e. root with CAP_SYS_ADMIN) so that "
                    f"the `ray stop` of ray up/down cannot kill other Ray processes: {probe.stderr.strip()}")
    return sshd


def _namespace_processes(ns: str) -> list[tuple[int, str]]:
    """(pid, command line) of every process in the PID namespace `ns` (a /proc/*/ns/pid link)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry.name}/ns/pid") != ns:
                continue
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if cmdline:  # zombies have none
            found.append((int(entry.name), cmdline))
    return found


def _non_sshd(processes):
    return [(pid, cmd) for pid, cmd in processes if not cmd.startswith("sshd")]


def _wait_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 20, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"sshd exited ({proc.returncode}):\n{log.read_text()}")
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"sshd not listening on {host}:{port}:\n{log.read_text()}")


def _run_ray(args: list[str], env: dict, log: Path, timeout: float) -> str:
    """Run the launcher's `ray <args>`, its output appended to `log`; returns that output."""
    with open(log, "ab") as out:
        out.write(f"\n$ ray {' '.join(args)}\n".encode())
        out.flush()
        start = out.tell()
        result = subprocess.run([str(VENV_BIN / "ray"), *args], env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"ray {args[0]} failed ({result.returncode}):\n{log.read_text()[-6000:]}")
    with open(log, "rb") as f:
        f.seek(start)
        return f.read().decode(errors="replace")


def _ssh_keys(work: Path, comment: str) -> None:
    """work/host_key (sshd's) and work/id (the client's, which work/authorized_keys admits)."""
    for name in ("host_key", "id"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f",
                        str(work / name)], check=True)
    shutil.copy(work / "id.pub", work / "authorized_keys")


def _write_sshd_config(path: Path, listen: str, work: Path, home: Path | None) -> None:
    """An sshd that admits this user with work/id on `listen` (host:port) only, and gives the
    login `home` as HOME (None: the user's own home directory)."""
    path.write_text("\n".join([
        f"ListenAddress {listen}",
        f"HostKey {work / 'host_key'}",
        f"PidFile {path.with_suffix('.pid')}",
        f"AuthorizedKeysFile {work / 'authorized_keys'}",
        f"AllowUsers {getpass.getuser()}",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "PermitRootLogin prohibit-password",
        "UsePAM no",
        "StrictModes no",  # the key files sit under /tmp, which is group/world writable
        "PrintMotd no",
        "PrintLastLog no",
        *([f"SetEnv HOME={home}"] if home is not None else []),
        "",
    ]))


def _sshd_command(sshd: str, config: Path, passwd: Path | None = None) -> list[str]:
    """sshd in the foreground as init of a PID namespace of its own (see the module's notes).

    `passwd`: a file bind-mounted on /etc/passwd in sshd's mount namespace (a private one, which
    `--mount-proc` makes): with the user's home directory changed there, it is HOME for every
    login and also what ssh expands `~` to in `-i ~/ray_bootstrap_key.pem` (from the passwd
    entry, not from HOME).
    """
    namespace = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
    if passwd is None:
        return [*namespace, sshd, "-D", "-e", "-f", str(config)]
    return [*namespace, "sh", "-c", 'mount --bind "$1" /etc/passwd && exec "$2" -D -e -f "$3"', "sh",
            str(passwd), sshd, str(config)]


def _passwd_with_home(path: Path, home: Path) -> None:
    """A copy of /etc/passwd in which this user's home directory is `home`."""
    user = pwd.getpwuid(os.getuid())
    lines = []
    for line in Path("/etc/passwd").read_text().splitlines():
        fields = line.split(":")
        if len(fields) == 7 and fields[0] == user.pw_name:
            fields[5] = str(home)
        lines.append(":".join(fields))
    assert any(line.startswith(f"{user.pw_name}:") for line in lines), f"{user.pw_name} not in /etc/passwd"
    path.write_text("\n".join(lines) + "\n")


def _kill_sshd(proc: subprocess.Popen) -> None:
    # SIGKILL to unshare: --kill-child kills sshd, the namespace's init, and with it every
    # process left in the namespace.
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def _make_privsep() -> bool:
    """sshd refuses to start without its privilege-separation folder; True when made here."""
    privsep = Path("/run/sshd")
    if privsep.exists():
        return False
    privsep.mkdir(mode=0o755)
    return True


def _remove_privsep() -> None:
    try:
        Path("/run/sshd").rmdir()
    except OSError:
        pass


def _remove_ssh_control_dir(cluster_name: str) -> None:
    """ssh's connection-sharing sockets for this cluster name (a folder only it uses)."""
    from ray.autoscaler._private.command_runner import HASH_MAX_LENGTH

    user_hash = hashlib.sha256(getpass.getuser().encode()).hexdigest()[:HASH_MAX_LENGTH]
    cluster_hash = hashlib.sha256(cluster_name.encode()).hexdigest()[:HASH_MAX_LENGTH]
    shutil.rmtree(f"/tmp/ray_ssh_{user_hash}/{cluster_hash}", ignore_errors=True)
    try:
        os.rmdir(f"/tmp/ray_ssh_{user_hash}")  # only when no other cluster uses it
    except OSError:
        pass


def _wait_healthy(target: str, timeout: float = 120) -> None:
    from pagedserve import Client

    deadline = time.monotonic() + timeout
    with Client(target, timeout=5) as client:
        while time.monotonic() < deadline:
            if client.health():
                return
            time.sleep(0.5)
    raise AssertionError(f"no SERVING health answer from {target} within {timeout:.0f} s")


@pytest.mark.timeout(900)  # apt-get on a fresh machine, then ray up (about 30 s here) and ray down
def test_ray_up_and_down_over_ssh(tiny_llama):
    sshd = _ensure_tools()
    # Short paths: Ray's unix sockets live under RAY_TMPDIR (the limit is 107 bytes).
    work = Path(tempfile.mkdtemp(prefix="ps-up-", dir="/tmp"))
    work.chmod(0o700)
    home, raytmp = work / "home", work / "rt"
    home.mkdir()
    raytmp.mkdir()
    ssh_port, ray_port, client_port, agent_port, dashboard_port, serve_port = _free_ports(6)
    cluster_name = f"pagedserve-test-{uuid.uuid4().hex[:8]}"
    own_privsep = False
    sshd_proc = None
    log = work / "launcher.log"
    try:
        # Keys made here: the host key, and the client key that authorized_keys admits.
        _ssh_keys(work, cluster_name)
        _write_sshd_config(work / "sshd_config", f"127.0.0.1:{ssh_port}", work, home)
        start_flags = (f"--port={ray_port} --ray-client-server-port={client_port} "
                       f"--dashboard-agent-listen-port={agent_port} --dashboard-port={dashboard_port} "
                       "--include-dashboard=false "
                       f"--num-cpus=4 --object-store-memory={100 * 2**20}")
        serve_flags = f"--model {tiny_llama} --port {serve_port} --kv-cache-memory 16777216"
        profile = [
            f"export RAY_TMPDIR={raytmp}",  # `--address auto` then reads this cluster's address file
            "export RAY_USAGE_STATS_ENABLED=0",
            f"export PAGEDSERVE_RAY_START_FLAGS={shlex.quote(start_flags)}",
            f"export PAGEDSERVE_SERVE_FLAGS={shlex.quote(serve_flags)}",
            'cd "$HOME"',
            "",
        ]
        path_line = f"export PATH={shlex.quote(str(VENV_BIN))}:\"$PATH\""
        (home / ".profile").write_text("\n".join(profile))
        (home / ".bashrc").write_text("# Ray sources ~/.bashrc before each command; nothing to do here\n")
        (work / "relay.py").write_text(_RELAY)

        # The launcher's own config: the committed file, with this sshd's user, key and port.
        config = _load(LOCAL_YAML)
        config["cluster_name"] = cluster_name
        config["auth"] = {"ssh_user": getpass.getuser(), "ssh_private_key": str(work / "id"),
                          "ssh_proxy_command": f"{sys.executable} {work / 'relay.py'} {ssh_port}"}
        rendered = work / "cluster.yaml"
        rendered.write_text(yaml.safe_dump(config, sort_keys=False))

        own_privsep = _make_privsep()
        with open(work / "sshd.log", "wb") as sshd_log:
            sshd_proc = subprocess.Popen(_sshd_command(sshd, work / "sshd_config"),
                                         stdin=subprocess.DEVNULL, stdout=sshd_log, stderr=subprocess.STDOUT)
        _wait_port(ssh_port, sshd_proc, work / "sshd.log")
        namespace = os.readlink(f"/proc/{sshd_proc.pid}/ns/pid_for_children")

        # The launcher's local state (cluster state file, config cache, bootstrap temp files)
        # goes under `work` too.
        env = dict(os.environ, RAY_TMPDIR=str(raytmp), TMPDIR=str(work), RAY_USAGE_STATS_ENABLED="0")
        env.pop("RAY_ADDRESS", None)
        # First without this venv on the login shell's PATH: the file's setup check must fail
        # `ray up` before anything starts (where no other pagedserve is on the default PATH).
        if not shutil.which("pagedserve", path=DEBIAN_ROOT_PATH):
            with pytest.raises(AssertionError, match="not on the login shell's PATH"):
                _run_ray(["up", "-y", "--no-config-cache", str(rendered)], env, log, timeout=120)
            assert not _non_sshd(_namespace_processes(namespace))

        (home / ".profile").write_text("\n".join([path_line, *profile]))
        started = time.monotonic()
        _run_ray(["up", "-y", "--no-config-cache", str(rendered)], env, log, timeout=420)
        up_seconds = time.monotonic() - started

        running = " ".join(cmd for _, cmd in _namespace_processes(namespace))
        assert "gcs_server" in running and "raylet" in running, running

        from pagedserve import Client

        target = f"127.0.0.1:{serve_port}"
        _wait_healthy(target)
        with Client(target, timeout=60) as client:
            completion = client.generate([1, 2, 3], max_tokens=4, temperature=0)
        assert 1 <= len(completion.token_ids) <= 4 and completion.finish_reason, completion

        started = time.monotonic()
        _run_ray(["down", "-y", str(rendered)], env, log, timeout=180)
        down_seconds = time.monotonic() - started

        # `ray down` says it succeeded whether or not its `ray stop` ran: look for the head's
        # processes themselves (sshd is all that may remain in the namespace).
        deadline = time.monotonic() + 30
        while _non_sshd(_namespace_processes(namespace)) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = _non_sshd(_namespace_processes(namespace))
        assert not left, "Ray still running after ray down:\n" + "\n".join(f"{p} {c[:200]}" for p, c in left)
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", serve_port), timeout=2).close()
        print(f"ray up {up_seconds:.1f} s, ray down {down_seconds:.1f} s")
    finally:
        if sshd_proc is not None:
            _kill_sshd(sshd_proc)
        if own_privsep:
            _remove_privsep()
        _remove_ssh_control_dir(cluster_name)
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# A real `ray up` / `ray down` of a two-machine cluster: head and worker, each a network namespace
# (tests/netns_cluster.py) with an sshd of its own

# Run on the head through `ray exec`: the cluster's alive nodes, by IP.
_ALIVE_NODES = """\
import json
import ray
ray.init(address="auto", log_to_driver=False)
print("ALIVE_NODES " + json.dumps(sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])))
"""

# Seconds a worker node's raylet keeps trying to reach a GCS that is gone before it exits (Ray's
# default is 60): `ray down` stops only the head (see the test), the worker then ends by itself.
_WORKER_GCS_TIMEOUT_S = 15

# What of a worker node's Ray outlives its raylet when the raylet exits on its own (see the test).
_WORKER_LEFTOVERS = ("ray/_private/log_monitor.py", "ray::DashboardAgent", "ray::RuntimeEnvAgent",
                     "dashboard/agent.py", "runtime_env/agent/main.py")


def _listing(processes: list[tuple[int, str]]) -> str:
    return "\n".join(f"{pid} {cmd[:200]}" for pid, cmd in processes)


def _alive_nodes(rendered: Path, env: dict, log: Path) -> list[str]:
    out = _run_ray(["exec", str(rendered), "python ~/alive_nodes.py"], env, log, timeout=120)
    lines = [line for line in out.splitlines() if line.startswith("ALIVE_NODES ")]
    assert lines, f"no ALIVE_NODES line in the output of ray exec:\n{out[-3000:]}"
    return json.loads(lines[-1].split(" ", 1)[1])


def _wait_empty(namespace: str, timeout: float) -> list[tuple[int, str]]:
    """Wait until only sshd is left in the PID namespace; what else is left after `timeout`."""
    deadline = time.monotonic() + timeout
    while (left := _non_sshd(_namespace_processes(namespace))) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.mark.timeout(600)
def test_ray_up_and_down_of_two_machines(tiny_llama):
    """`ray up` of deploy/cluster.local.yaml with head_ip and one worker_ips entry, each a network
    namespace (10.213.X.1 and .2, joined by a bridge whose .254 is this, the root, namespace) with
    its own sshd on port 22, each sshd in its own PID namespace (`ray stop` on a machine sees only
    that machine's processes) and its own home. `ray up`, run here, sets up the head over ssh; the
    autoscaler on the head then sets up the worker over ssh (setup and worker_start_ray_commands:
    `ray start --address=$RAY_HEAD_IP:6379`). The cluster runs with token auth: both machines'
    ~/.profile export RAY_AUTH_MODE=token and the same RAY_AUTH_TOKEN (the worker's `ray start`
    does not turn token auth on by itself, whatever the head runs with).
    """
    from tests.netns_cluster import NamespaceNetwork

    sshd = _ensure_tools()
    work = Path(tempfile.mkdtemp(prefix="ps-up2-", dir="/tmp"))
    work.chmod(0o700)
    cluster_name = f"pagedserve-test-{uuid.uuid4().hex[:8]}"
    log = work / "launcher.log"
    sshd_procs: list[subprocess.Popen] = []
    own_privsep = False
    try:
        with NamespaceNetwork(num_nodes=2) as net:
            try:
                head_ip, worker_ip = net.node_ips
                _ssh_keys(work, cluster_name)
                (work / "alive_nodes.py").write_text(_ALIVE_NODES)
                token = secrets.token_hex(32)
                serve_port = 50051  # each machine has its own ports
                start_flags = (f"--node-ip-address={head_ip} --include-dashboard=false "
                               f"--num-cpus=4 --object-store-memory={100 * 2**20}")
                serve_flags = f"--model {tiny_llama} --host {head_ip} --port {serve_port} --kv-cache-memory 16777216"
                namespaces = []
                own_privsep = _make_privsep()
                for i, (ip, role) in enumerate([(head_ip, "head"), (worker_ip, "worker")]):
                    # (A worker node keeps its session in the head's temp dir, which it learns from
                    # the head: rt0 here, on the one filesystem.)
                    home, raytmp = work / f"home-{role}", work / f"rt{i}"
                    home.mkdir()
                    raytmp.mkdir()
                    profile = [
                        f"export PATH={shlex.quote(str(VENV_BIN))}:\"$PATH\"",
                        f"export RAY_TMPDIR={raytmp}",
                        "export RAY_USAGE_STATS_ENABLED=0",
                        "export RAY_AUTH_MODE=token",
                        f"export RAY_AUTH_TOKEN={token}",
                    ]
                    if role == "head":
                        # Without a default route Ray would take 127.0.0.1 for the head's address;
                        # a worker finds its own by the route to the head.
                        profile += [f"export PAGEDSERVE_RAY_START_FLAGS={shlex.quote(start_flags)}",
                                    f"export PAGEDSERVE_SERVE_FLAGS={shlex.quote(serve_flags)}"]
                    else:
                        profile.append(f"export RAY_gcs_rpc_server_reconnect_timeout_s={_WORKER_GCS_TIMEOUT_S}")
                    (home / ".profile").write_text("\n".join([*profile, 'cd "$HOME"', ""]))
                    (home / ".bashrc").write_text("# Ray sources ~/.bashrc before each command; nothing to do here\n")
                    shutil.copy(work / "alive_nodes.py", home / "alive_nodes.py")
                    sshd_config = work / f"sshd_config_{role}"
                    _write_sshd_config(sshd_config, f"{ip}:22", work, None)
                    _passwd_with_home(work / f"passwd-{role}", home)
                    with open(work / f"sshd-{role}.log", "wb") as sshd_log:
                        command = _sshd_command(sshd, sshd_config, work / f"passwd-{role}")
                        sshd_procs.append(net.run_in_node(i, command,
                                                          stdout=sshd_log, stderr=subprocess.STDOUT))
                    _wait_port(22, sshd_procs[-1], work / f"sshd-{role}.log", host=ip)
                    namespaces.append(os.readlink(f"/proc/{sshd_procs[-1].pid}/ns/pid_for_children"))
                head_ns, worker_ns = namespaces

                # The committed file with this cluster's machines, user and key; one worker, always.
                config = _load(LOCAL_YAML)
                config["cluster_name"] = cluster_name
                config["min_workers"] = config["max_workers"] = 1
                config["provider"].update(head_ip=head_ip, worker_ips=[worker_ip])
                config["auth"] = {"ssh_user": getpass.getuser(), "ssh_private_key": str(work / "id")}
                checked = _ray_checked(config)
                node_type = checked["available_node_types"][checked["head_node_type"]]
                assert (node_type["min_workers"], node_type["max_workers"]) == (1, 1), node_type
                rendered = work / "cluster.yaml"
                rendered.write_text(yaml.safe_dump(config, sort_keys=False))

                # The launcher's local state goes under `work`; no Ray address or auth of this process.
                env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
                env.update(RAY_TMPDIR=str(work / "rt-local"), TMPDIR=str(work), RAY_USAGE_STATS_ENABLED="0")
                started = time.monotonic()
                _run_ray(["up", "-y", "--no-config-cache", str(rendered)], env, log, timeout=300)
                up_seconds = time.monotonic() - started

                head_running = " ".join(cmd for _, cmd in _namespace_processes(head_ns))
                assert "gcs_server" in head_running and "raylet" in head_running, head_running

                # `ray up` returns once the head is up; the head's autoscaler then starts the worker.
                deadline = time.monotonic() + 150
                while "raylet" not in " ".join(cmd for _, cmd in _namespace_processes(worker_ns)):
                    assert time.monotonic() < deadline, \
                        f"no raylet on the worker {150:.0f} s after ray up; the head's autoscaler log:\n" \
                        + _autoscaler_log(work / "rt0")
                    time.sleep(1)
                while (alive := _alive_nodes(rendered, env, log)) != sorted([head_ip, worker_ip]):
                    assert time.monotonic() < deadline, f"alive nodes {alive}, not the head and the worker"
                    time.sleep(2)
                joined_seconds = time.monotonic() - started

                from pagedserve import Client

                target = f"{head_ip}:{serve_port}"  # from the root namespace, over the bridge
                _wait_healthy(target)
                with Client(target, timeout=60) as client:
                    completion = client.generate([1, 2, 3], max_tokens=4, temperature=0)
                assert 1 <= len(completion.token_ids) <= 4 and completion.finish_reason, completion

                started = time.monotonic()
                _run_ray(["down", "-y", str(rendered)], env, log, timeout=180)
                down_seconds = time.monotonic() - started

                # `ray down` runs `ray stop` on the head only: for the local provider it marks the
                # workers terminated in its state file, nothing more.
                left = _wait_empty(head_ns, 30)
                assert not left, "Ray still running on the head after ray down:\n" + _listing(left)
                with pytest.raises(OSError):
                    socket.create_connection((head_ip, serve_port), timeout=2).close()
                # The worker's raylet exits once it has not reached the head's GCS for
                # _WORKER_GCS_TIMEOUT_S; Ray's log monitor (started by `ray start`, it never exits
                # on its own) and the agents (they see the raylet gone, then spend up to a minute
                # reporting that to the GCS) may stay behind: no raylet, no workers or actors,
                # nothing of pagedserve, nothing else.
                deadline = time.monotonic() + _WORKER_GCS_TIMEOUT_S + 45
                while True:
                    left = _non_sshd(_namespace_processes(worker_ns))
                    if not any("raylet" in cmd for _, cmd in left):
                        break
                    assert time.monotonic() < deadline, "the worker's raylet still running after ray down:\n" \
                        + _listing(left)
                    time.sleep(0.5)
                worker_left_seconds = time.monotonic() - started
                lingering = [(pid, cmd) for pid, cmd in left if not any(name in cmd for name in _WORKER_LEFTOVERS)]
                assert not lingering, "on the worker after its raylet exited:\n" + _listing(left)
                # What the next `ray up` runs first on the worker (`ray stop`, in a login shell over
                # ssh) removes them.
                ssh = ["ssh", "-i", str(work / "id"), "-o", "StrictHostKeyChecking=no", "-o",
                       "UserKnownHostsFile=/dev/null", "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
                       f"{getpass.getuser()}@{worker_ip}", "bash --login -c 'ray stop'"]
                stop = subprocess.run(ssh, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
                assert stop.returncode == 0, f"ray stop on the worker failed:\n{stop.stdout}\n{stop.stderr}"
                after_stop = _wait_empty(worker_ns, 30)
                assert not after_stop, "Ray still running on the worker after its ray stop:\n" + _listing(after_stop)
                print(f"ray up {up_seconds:.1f} s, worker joined {joined_seconds:.1f} s after ray up began, "
                      f"ray down {down_seconds:.1f} s, worker's raylet gone {worker_left_seconds:.1f} s after "
                      f"ray down began; left on the worker then: {[cmd[:60] for _, cmd in left] or 'nothing'}")
            finally:
                # First the sshds (each ends its PID namespace, all in it), then `net` kills
                # whatever else is in the network namespaces and deletes them and the bridge.
                for proc in sshd_procs:
                    if proc.poll() is None:
                        _kill_sshd(proc)
    finally:
        if own_privsep:
            _remove_privsep()
        _remove_ssh_control_dir(cluster_name)
        shutil.rmtree(work, ignore_errors=True)


def _autoscaler_log(raytmp: Path) -> str:
    """The tail of the head's autoscaler log (monitor.*), for a failure message."""
    logs = sorted({p.resolve() for p in raytmp.rglob("monitor.*")})
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs) or "(none)"
