"""The front door's state shared by the transports, and the coordinator's server options: no Ray,
no model, no sockets."""

from __future__ import annotations

import ast
import asyncio
import logging
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator import server_state
from coordinator.async_engine import EngineDeadError, QueueFullError
from coordinator.server_options import ServerOptions
from coordinator.server_state import REJECT_REASONS, ServerState, error_kind


class FakeEngine:
    """What ServerState uses of an AsyncEngine: its loop ends (None: stopped, else the failure)."""

    def __init__(self):
        self.ended: asyncio.Future = asyncio.get_running_loop().create_future()
        self.restart_listeners = []

    def add_restart_listener(self, listener):
        self.restart_listeners.append(listener)

    async def wait_stopped(self):
        return await self.ended

    async def stats(self) -> dict:
        return {"kv_blocks_used": 0}


def _recording(state: ServerState) -> list[tuple[str, str]]:
    seen = []

    async def listener(status):
        seen.append((status, state.reason))

    state.add_listener(listener)
    return seen


async def _settle():
    for _ in range(5):  # the watcher task: wakes, then tells the listeners
        await asyncio.sleep(0)


def test_loading_then_serving_then_failed_for_good_when_the_engine_loop_fails():
    async def run():
        state = ServerState()
        seen = _recording(state)
        assert state.status == "loading" and not state.serving and "loading" in state.reason
        engine = FakeEngine()
        await state.set_engine(engine)
        assert state.serving and state.engine is engine and seen == [("serving", "")]
        engine.ended.set_result(RuntimeError("injected step failure"))
        await _settle()
        assert state.status == "failed" and "injected step failure" in state.reason
        assert seen[-1] == ("failed", state.reason) and len(seen) == 2
        await state.stop()  # failed stays failed, with its reason
        assert state.status == "failed" and len(seen) == 2
        with pytest.raises(RuntimeError, match="set once"):
            await state.set_engine(FakeEngine())

    asyncio.run(run())


def test_stop_while_serving_refuses_with_a_reason_and_a_clean_engine_stop_is_no_failure():
    async def run():
        state = ServerState()
        seen = _recording(state)
        engine = FakeEngine()
        await state.set_engine(engine)
        await state.stop()
        assert state.status == "stopping" and "shutting down" in state.reason
        engine.ended.set_result(None)
        await _settle()
        assert state.status == "stopping"
        assert [status for status, _ in seen] == ["serving", "stopping"]

    asyncio.run(run())


def test_a_load_failure_is_failed_with_its_reason_and_stop_while_loading_is_stopping():
    async def run():
        state = ServerState()
        seen = _recording(state)
        await state.set_failed("the model failed to load: no such file")
        assert state.status == "failed" and seen == [("failed", "the model failed to load: no such file")]
        loading = ServerState()
        await loading.stop()
        assert loading.status == "stopping"

    asyncio.run(run())


def test_a_failing_listener_does_not_keep_the_others_uninformed(caplog):
    async def run():
        state = ServerState()

        async def broken(status):
            raise RuntimeError("listener bug")

        state.add_listener(broken)
        seen = _recording(state)
        await state.set_engine(FakeEngine())
        assert seen == [("serving", "")]

    with caplog.at_level(logging.ERROR, logger="pagedserve.server"):
        asyncio.run(run())
    assert "listener" in caplog.text


def test_bearer_token_right_key_passes_wrong_or_missing_is_refused_and_counted(monkeypatch):
    compared = []
    real = server_state.hmac.compare_digest

    def compare_digest(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(server_state.hmac, "compare_digest", compare_digest)
    state = ServerState("s3cret")
    assert state.auth
    assert state.check_auth("Bearer s3cret") is None
    assert state.rejected["unauthenticated"] == 0
    assert state.check_auth("Bearer wrong") == "wrong bearer token"
    assert state.check_auth("s3cret") == "wrong bearer token"
    assert state.check_auth("Bearer s\u00e9cret") == "wrong bearer token"  # not ASCII: refused, no error
    for missing in (None, ""):
        assert state.check_auth(missing).startswith("missing bearer token (")
    assert state.rejected["unauthenticated"] == 5
    # Every present value went through the constant-time comparison, right or wrong.
    assert [a for a, _ in compared] == [b"Bearer s3cret", b"Bearer wrong", b"s3cret", "Bearer s\u00e9cret".encode()]
    assert {b for _, b in compared} == {b"Bearer s3cret"}


def test_without_a_key_everyone_passes_and_an_empty_key_is_refused():
    state = ServerState()
    assert not state.auth and state.check_auth(None) is None and state.check_auth("Bearer x") is None
    assert state.rejected["unauthenticated"] == 0
    with pytest.raises(ValueError, match="API key must not be empty"):
        ServerState("")


def test_each_engine_error_has_one_status_kind():
    assert error_kind(ValueError("temperature must be >= 0")) == "invalid_argument"
    assert error_kind(QueueFullError("the queue is full")) == "queue_full"
    cause = RuntimeError("boom")
    assert error_kind(EngineDeadError("stopped", "r1", cause, in_flight=False)) == "unavailable"
    assert error_kind(EngineDeadError("died", "r1", cause, in_flight=True)) == "internal"
    assert error_kind(KeyError("a bug")) == "internal"


def test_refusals_are_counted_by_reason_and_an_engine_death_under_a_request_fails_the_server(caplog):
    async def run():
        state = ServerState()
        assert dict(state.rejected) == dict.fromkeys(REJECT_REASONS, 0)  # every reason, from the start
        with pytest.raises(RuntimeError, match="loading"):
            await state.stats()
        await state.set_engine(FakeEngine())
        assert await state.request_failed(ValueError("bad")) == "invalid_argument"
        assert await state.request_failed(QueueFullError("full")) == "queue_full"
        assert await state.request_failed(QueueFullError("full")) == "queue_full"
        state.reject("unavailable")
        with pytest.raises(ValueError, match="kind must be one of"):
            state.reject("internal")
        stats = await state.stats()
        assert stats["kv_blocks_used"] == 0
        assert {k: v for k, v in stats.items() if k.startswith("requests_rejected_")} == {
            "requests_rejected_invalid_argument": 1, "requests_rejected_queue_full": 2,
            "requests_rejected_unavailable": 1, "requests_rejected_unauthenticated": 0}
        died = EngineDeadError("the engine failed while serving request 'doomed-1'", "doomed-1",
                               RuntimeError("injected worker failure"), in_flight=True)
        assert await state.request_failed(died) == "internal"
        assert state.status == "failed" and "injected worker failure" in state.reason
        assert sum(state.rejected.values()) == 4  # a bug is not a refusal

    with caplog.at_level(logging.ERROR, logger="pagedserve.server"):
        asyncio.run(run())
    assert "doomed-1" in caplog.text


def test_server_options_defaults_tls_pair_and_pickling():
    options = ServerOptions()
    assert (options.host, options.port, options.max_queued_requests) == ("127.0.0.1", 50051, 1024)
    assert options.api_key is None
    assert options.tls is None and options.metrics_port is None and not options.default_metrics
    assert options.http and (options.http_host, options.http_port) == ("127.0.0.1", None)  # 8000, or free
    tls = ServerOptions(port=0, tls_cert=b"CERT", tls_key=b"KEY", api_key="k", metrics_port=0)
    assert tls.tls == (b"CERT", b"KEY")
    assert pickle.loads(pickle.dumps(tls)) == tls  # Ray ships it to the actor


@pytest.mark.parametrize("kwargs,words", [
    ({"port": -1}, "port must be an integer in 0..65535"),
    ({"port": 65536}, "port must be an integer in 0..65535"),
    ({"port": "50051"}, "port must be an integer"),
    ({"metrics_port": 70000}, "metrics_port must be an integer in 0..65535"),
    ({"max_queued_requests": 0}, "max_queued_requests must be an integer >= 1"),
    ({"host": ""}, "host must be a non-empty"),
    ({"metrics_host": None}, "metrics_host must be a non-empty"),
    ({"api_key": ""}, "api_key must be a non-empty string"),
    ({"tls_cert": b"CERT"}, "tls_cert is set, tls_key is not"),
    ({"tls_key": b"KEY"}, "tls_key is set, tls_cert is not"),
    ({"tls_cert": "cert.pem", "tls_key": b"KEY"}, "tls_cert must be the PEM file's bytes"),
    ({"default_metrics": 1}, "default_metrics must be True or False"),
    ({"http_port": 70000}, "http_port must be an integer in 0..65535"),
    ({"http_host": ""}, "http_host must be a non-empty"),
    ({"http": "yes"}, "http must be True or False"),
])
def test_server_options_refuse_bad_values_naming_the_field(kwargs, words):
    with pytest.raises(ValueError) as info:
        ServerOptions(**kwargs)
    assert words in str(info.value)


def test_options_import_nothing_and_the_state_names_no_transport():
    code = ("import sys, coordinator.server_options; "
            "print(sorted(m for m in sys.modules if m.startswith(('coordinator.', 'grpc'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "['coordinator.server_options']"  # the CLI checks options before Ray starts
    tree = ast.parse(Path(server_state.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {name for name in imported if name.split(".")[0] in ("grpc", "grpc_health", "fastapi", "starlette")}


def test_a_worker_restart_turns_readiness_off_and_back_on():
    async def run():
        state = ServerState()
        seen = _recording(state)
        engine = FakeEngine()
        await state.set_engine(engine)
        (restart,) = engine.restart_listeners
        await restart(True)
        assert state.status == "restarting" and not state.serving and "workers restarting" in state.reason
        await restart(False)
        assert state.serving
        await state.stop()
        await restart(True)  # a rebuild finishing during shutdown does not bring it back
        await restart(False)
        assert state.status == "stopping"
        return [status for status, _ in seen]

    assert asyncio.run(run()) == ["serving", "restarting", "serving", "stopping"]
