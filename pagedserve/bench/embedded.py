"""An embedded server for a benchmark: `pagedserve serve` started as a subprocess, exactly as a
user starts it (its own local Ray, the coordinator actor, worker actors), stopped with Ctrl-C. Both
doors on free ports: gRPC at `target`, the OpenAI-compatible API at `base_url`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pagedserve


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedServer:
    def __init__(self, engine_flags: dict, port: int | None = None, metrics_port: int | None = None,
                 http_port: int | None = None):
        self.port = port or free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.http_port = http_port or free_port()
        self.base_url = f"http://127.0.0.1:{self.http_port}/v1"
        cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--port", str(self.port),
               "--http-port", str(self.http_port)]
        cmd += ["--metrics-port", str(metrics_port)] if metrics_port is not None else ["--no-metrics"]
        for name, value in engine_flags.items():
            flag = f"--{name.replace('_', '-')}"
            if isinstance(value, bool):
                cmd.append(flag if value else f"--no-{name.replace('_', '-')}")
            else:
                cmd += [flag, str(value)]
        # stderr passes through: a refused configuration says why there.
        self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, start_new_session=True)

    def wait_healthy(self, timeout: float) -> float:
        """Seconds until health says SERVING; RuntimeError if the server exits or takes too long."""
        start = time.monotonic()
        with pagedserve.Client(self.target, timeout=2) as client:
            while time.monotonic() - start < timeout:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the server exited with {self.process.returncode} before serving")
                try:
                    if client.health():
                        return time.monotonic() - start
                except pagedserve.ServingError:
                    pass
                time.sleep(0.5)
        raise RuntimeError(f"the server did not report SERVING within {timeout} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)  # Ctrl-C, as a user stops it
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
