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
"""

from __future__ import annotations

import copy
import getpass
import hashlib
import os
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


def _wait_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"sshd exited ({proc.returncode}):\n{log.read_text()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"sshd not listening on 127.0.0.1:{port}:\n{log.read_text()}")


def _run_ray(args: list[str], env: dict, log: Path, timeout: float) -> None:
    with open(log, "ab") as out:
        out.write(f"\n$ ray {' '.join(args)}\n".encode())
        out.flush()
        result = subprocess.run([str(VENV_BIN / "ray"), *args], env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"ray {args[0]} failed ({result.returncode}):\n{log.read_text()[-6000:]}")


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
    privsep = Path("/run/sshd")  # sshd refuses to start without its privilege-separation folder
    own_privsep = not privsep.exists()
    sshd_proc = None
    log = work / "launcher.log"
    try:
        # Keys made here: the host key, and the client key that authorized_keys admits.
        for name in ("host_key", "id"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", cluster_name, "-f",
                            str(work / name)], check=True)
        shutil.copy(work / "id.pub", work / "authorized_keys")
        (work / "sshd_config").write_text("\n".join([
            f"ListenAddress 127.0.0.1:{ssh_port}",
            f"HostKey {work / 'host_key'}",
            f"PidFile {work / 'sshd.pid'}",
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
            f"SetEnv HOME={home}",
            "",
        ]))
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

        if own_privsep:
            privsep.mkdir(mode=0o755)
        with open(work / "sshd.log", "wb") as sshd_log:
            sshd_proc = subprocess.Popen(
                ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", sshd, "-D", "-e",
                 "-f", str(work / "sshd_config")],
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
            # SIGKILL to unshare: --kill-child kills sshd, the namespace's init, and with it every
            # process left in the namespace.
            sshd_proc.send_signal(signal.SIGKILL)
            sshd_proc.wait(timeout=30)
        if own_privsep:
            try:
                privsep.rmdir()
            except OSError:
                pass
        # ssh's connection-sharing sockets for this cluster name (a folder only it uses).
        from ray.autoscaler._private.command_runner import HASH_MAX_LENGTH

        user_hash = hashlib.sha256(getpass.getuser().encode()).hexdigest()[:HASH_MAX_LENGTH]
        cluster_hash = hashlib.sha256(cluster_name.encode()).hexdigest()[:HASH_MAX_LENGTH]
        shutil.rmtree(f"/tmp/ray_ssh_{user_hash}/{cluster_hash}", ignore_errors=True)
        try:
            os.rmdir(f"/tmp/ray_ssh_{user_hash}")  # only when no other cluster uses it
        except OSError:
            pass
        shutil.rmtree(work, ignore_errors=True)
