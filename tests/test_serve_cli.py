"""`pagedserve serve` / `stop` as real processes on real sockets.

The foreground tests start their own local Ray inside the `serve` process (ray.init(address="local"),
never the test session's) and check that Ctrl-C / SIGTERM leave none of its processes behind. The
detach test joins the test session's Ray by its address, as `ray up` does with `--address auto`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import psutil
import pytest
import ray

import pagedserve
from coordinator.actor import ACTOR_NAME, NAMESPACE
from tests.certs import self_signed_cert

CLI = [sys.executable, "-m", "pagedserve.cli"]
KV = str(1 << 24)
GREEDY = dict(max_tokens=4, temperature=0.0, ignore_eos=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**changes) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PAGEDSERVE_API_KEY")}
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _cli(*args, env=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], env=env or _env(), capture_output=True, text=True, timeout=timeout)


class _Serve:
    """A foreground `pagedserve serve` with its stdout read line by line in a thread."""

    def __init__(self, args: list[str], env: dict, stderr_path):
        self.stderr_path = stderr_path
        self._stderr = open(stderr_path, "w")
        self.proc = subprocess.Popen([*CLI, "serve", *args], env=env, stdout=subprocess.PIPE, stderr=self._stderr,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self._new_line = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.descendants: list[psutil.Process] = []

    def _read(self):
        for line in self.proc.stdout:
            with self._new_line:
                self.lines.append(line.rstrip("\n"))
                self._new_line.notify_all()

    def wait_for_line(self, prefix: str, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        with self._new_line:
            while True:
                for line in self.lines:
                    if line.startswith(prefix):
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise AssertionError(f"no line starting {prefix!r} (exit {self.proc.poll()}); "
                                         f"stdout {self.lines}; stderr:\n{self.stderr()}")
                self._new_line.wait(min(left, 1.0))

    def stderr(self) -> str:
        self._stderr.flush()
        with open(self.stderr_path) as f:
            return f.read()[-4000:]

    def record_descendants(self) -> None:
        """The processes it started (Ray's GCS, raylet, agents, workers), to check none outlives it."""
        self.descendants = psutil.Process(self.proc.pid).children(recursive=True)
        assert any("raylet" in p.name() for p in self.descendants), [p.name() for p in self.descendants]

    def leftovers(self, wait: float = 20) -> list[str]:
        deadline = time.monotonic() + wait
        while True:
            alive = [p for p in self.descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            if not alive or time.monotonic() > deadline:
                return [f"{p.pid} {p.name()}" for p in alive]
            time.sleep(0.2)

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        for p in self.descendants:
            try:
                p.kill()
            except psutil.Error:
                pass
        self._stderr.close()


def test_serve_in_the_foreground_until_ctrl_c(tiny_llama, tmp_path):
    port = _free_port()
    # the model as `vllm serve MODEL` takes it: positional
    server = _Serve([tiny_llama, "--port", str(port), "--kv-cache-memory", KV], _env(), tmp_path / "serve.err")
    try:
        line = server.wait_for_line("serving ")
        assert line == f"serving {tiny_llama} on 127.0.0.1:{port}"
        server.record_descendants()
        with pagedserve.Client(f"127.0.0.1:{port}", timeout=60) as client:
            assert client.health()
            completion = client.generate([11, 12, 13], **GREEDY)
            assert len(completion.token_ids) == 4 and completion.finish_reason == "length"
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(timeout=60) == 0, server.stderr()
        assert server.leftovers() == []
        with pagedserve.Client(f"127.0.0.1:{port}", timeout=2) as client:
            assert not client.health()  # the port is closed
    finally:
        server.cleanup()


def test_serve_with_tls_and_an_api_key_until_sigterm(tiny_llama, tmp_path):
    cert, key = self_signed_cert()
    (tmp_path / "cert.pem").write_bytes(cert)
    (tmp_path / "key.pem").write_bytes(key)
    port = _free_port()
    server = _Serve(["--model", tiny_llama, "--port", str(port), "--kv-cache-memory", KV,
                     "--tls-cert", str(tmp_path / "cert.pem"), "--tls-key", str(tmp_path / "key.pem")],
                    _env(PAGEDSERVE_API_KEY="s3cret"), tmp_path / "serve.err")
    try:
        line = server.wait_for_line("serving ")
        assert line == f"serving {tiny_llama} on 127.0.0.1:{port} (TLS, API key required)"
        server.record_descendants()
        target = ["--target", f"localhost:{port}", "--tls-ca", str(tmp_path / "cert.pem")]
        ok = _cli("generate", "Hello", "--max-tokens", "3", *target, env=_env(PAGEDSERVE_API_KEY="s3cret"))
        assert ok.returncode == 0 and ok.stdout.strip(), ok.stderr
        refused = _cli("stats", *target)
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
        stats = _cli("stats", "--api-key", "s3cret", *target)
        assert stats.returncode == 0 and "kv_blocks_used 0" in stats.stdout, stats.stderr
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0, server.stderr()
        assert server.leftovers() == []
    finally:
        server.cleanup()


def _kill_named_actor() -> None:
    try:
        ray.kill(ray.get_actor(ACTOR_NAME, namespace=NAMESPACE))
    except ValueError:
        pass


def test_detach_then_stop(ray_session, tiny_llama):
    address = ray.get_runtime_context().gcs_address
    # Joining by an explicit address: the CLI must send the session's Ray token by itself.
    env = _env(RAY_AUTH_MODE=None)
    port = _free_port()
    serve = ["serve", "--address", address, "--detach", "--model", tiny_llama, "--port", str(port),
             "--kv-cache-memory", KV]
    try:
        started = _cli(*serve, env=env, timeout=180)
        assert started.returncode == 0, started.stderr
        assert f"serving {tiny_llama} on 127.0.0.1:{port}" in started.stdout
        with pagedserve.Client(f"127.0.0.1:{port}", timeout=60) as client:  # still serving after the CLI exited
            assert client.health()
            assert len(client.generate([11, 12, 13], **GREEDY).token_ids) == 4

        again = _cli(*serve[:-4], "--port", str(_free_port()), "--kv-cache-memory", KV, env=env)
        assert again.returncode == 1 and "already runs" in again.stderr

        stopped = _cli("stop", "--address", address, env=env)
        assert stopped.returncode == 0, stopped.stderr
        assert f"stopped the pagedserve server ({tiny_llama} on 127.0.0.1:{port})" in stopped.stdout
        with pytest.raises(ValueError):
            ray.get_actor(ACTOR_NAME, namespace=NAMESPACE)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        with pytest.raises(grpc.FutureTimeoutError):
            grpc.channel_ready_future(channel).result(timeout=2)
        channel.close()

        nothing = _cli("stop", "--address", address, env=env)
        assert nothing.returncode == 1 and "no pagedserve server runs" in nothing.stderr
    finally:
        _kill_named_actor()
