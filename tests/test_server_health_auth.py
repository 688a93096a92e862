"""The gRPC server's health transitions (loading -> serving -> engine failed), bearer-token auth and
TLS, over real sockets; the server runs in a background event loop, the clients are sync."""

from __future__ import annotations

import asyncio
import logging
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.async_engine import AsyncEngine
from coordinator.grpc_server import SERVICE_NAME, ServingServer
from coordinator.server_state import ServerState
from pagedserve import LLM, Client, ServingError
from tests.certs import self_signed_cert

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _Loop:
    """An asyncio loop in a thread: servers and engines live there, tests call into it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout=30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout)

    def engine(self, llm: LLM) -> AsyncEngine:
        async def make():
            engine = AsyncEngine(llm.engine)
            engine.start()
            return engine
        return self.run(make())

    def server(self, engine: AsyncEngine | None = None, api_key: str | None = None,
               tls: tuple[bytes, bytes] | None = None) -> ServingServer:
        async def make():
            server = ServingServer(ServerState(api_key), tls)
            await server.start("127.0.0.1", 0)
            if engine is not None:
                await server.state.set_engine(engine)
            return server
        return self.run(make())

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def loop():
    lp = _Loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def engine(loop, tiny_llama):
    engine = loop.engine(LLM(tiny_llama, kv_cache_memory=1 << 22))
    yield engine
    loop.run(engine.stop())


def _health(target: str, service: str = SERVICE_NAME, credentials=None) -> int:
    channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    with channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=10).status


def _code(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(ServingError) as info:
        fn()
    return info.value.code, info.value.details


GREEDY = dict(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_not_serving_until_the_engine_is_set_then_serving(loop, engine):
    server = loop.server()
    target = f"127.0.0.1:{server.port}"
    try:
        assert _health(target) == NOT_SERVING and _health(target, "") == NOT_SERVING
        with Client(target, timeout=30) as client:
            assert not client.health()
            code, details = _code(lambda: client.generate([11, 12, 13], **GREEDY))
            assert code == grpc.StatusCode.UNAVAILABLE and "loading" in details
            assert _code(client.stats)[0] == grpc.StatusCode.UNAVAILABLE
            loop.run(server.state.set_engine(engine))
            assert _health(target) == SERVING and _health(target, "") == SERVING
            assert len(client.generate([11, 12, 13], **GREEDY).token_ids) == 4
    finally:
        loop.run(server.stop(grace=None))


def test_engine_failure_fails_the_stream_and_turns_health_not_serving(loop, tiny_llama, caplog):
    llm = LLM(tiny_llama, kv_cache_memory=1 << 22)
    executor = llm.engine.executor
    real_execute, calls = executor.execute, []

    def execute(plan):  # the first step (prefill) works; the second raises, as a bug in a worker would
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("injected worker failure")
        return real_execute(plan)

    executor.execute = execute
    engine = loop.engine(llm)
    server = loop.server(engine)
    target = f"127.0.0.1:{server.port}"
    try:
        with Client(target, timeout=30) as client, caplog.at_level(logging.ERROR, logger="pagedserve.server"):
            assert client.health()
            received = []

            def stream():
                for chunk in client.stream([11, 12, 13], request_id="doomed-1", **GREEDY):
                    received.append(chunk)

            code, details = _code(stream)
            assert code == grpc.StatusCode.INTERNAL
            assert "doomed-1" in details and "injected worker failure" in details
            assert len(received) == 1  # the stream was in flight: one chunk, then the failure
            assert "doomed-1" in caplog.text  # logged with its request id
            assert _health(target) == NOT_SERVING and not client.health()
            code, details = _code(lambda: client.generate([11, 12, 13], **GREEDY))
            assert code == grpc.StatusCode.UNAVAILABLE and "injected worker failure" in details
            assert _code(client.stats)[0] == grpc.StatusCode.UNAVAILABLE
    finally:
        loop.run(server.stop(grace=None))
        loop.run(engine.stop())


def test_bearer_token_guards_serving_but_not_health(loop, engine):
    server = loop.server(engine, api_key="s3cret")
    target = f"127.0.0.1:{server.port}"
    try:
        with Client(target, timeout=30) as anonymous:
            code, details = _code(lambda: anonymous.generate([11, 12, 13], **GREEDY))
            assert code == grpc.StatusCode.UNAUTHENTICATED and "missing" in details
            assert _code(anonymous.stats)[0] == grpc.StatusCode.UNAUTHENTICATED
            assert anonymous.health()  # probes need no secret
        with Client(target, token="wrong", timeout=30) as wrong:
            code, details = _code(lambda: list(wrong.stream([11, 12, 13], **GREEDY)))
            assert code == grpc.StatusCode.UNAUTHENTICATED and "wrong" in details
        with Client(target, token="s3cret", timeout=30) as client:
            assert len(client.generate([11, 12, 13], **GREEDY).token_ids) == 4
            assert client.stats()["kv_blocks_used"] == 0
    finally:
        loop.run(server.stop(grace=None))


def test_tls_with_a_self_signed_certificate(loop, engine):
    cert, key = self_signed_cert()
    server = loop.server(engine, api_key="s3cret", tls=(cert, key))
    credentials = grpc.ssl_channel_credentials(root_certificates=cert)
    try:
        for host in ("127.0.0.1", "localhost"):
            with Client(f"{host}:{server.port}", token="s3cret", credentials=credentials, timeout=30) as client:
                assert client.health()
                assert len(client.generate([11, 12, 13], **GREEDY).token_ids) == 4
        with Client(f"127.0.0.1:{server.port}", token="s3cret", timeout=5) as plaintext:
            assert _code(plaintext.stats)[0] == grpc.StatusCode.UNAVAILABLE
    finally:
        loop.run(server.stop(grace=None))
