"""The coordinator as a Ray actor: it owns the engine (scheduler, block allocator) and serves gRPC
and the OpenAI-compatible HTTP API.

One async actor: the gRPC server, the HTTP server (uvicorn) and the engine loop share its event
loop, and engine steps run in a worker thread (see AsyncEngine), so the actor stays responsive
while the model computes.

`start(config, ServerOptions(...))` binds the gRPC server first and loads the model in a thread:
until the model is loaded health says NOT_SERVING and Generate answers UNAVAILABLE. The front
door's state (loading / serving / failed / stopping, refusal counts, auth) is one ServerState,
shared by the transports and read by the Prometheus collector. `start(wait=True)` (the default)
returns once it serves; `start(wait=False)` returns the port at once and `wait_ready()` waits.

`pagedserve serve` creates it as a named actor (ACTOR_NAME in NAMESPACE) so that
`pagedserve stop` can find it, with its config and options as constructor arguments, and calls
`launch()`. Detached, Ray restarts it when its process dies (with the same arguments): the new
process serves again by itself (`resume()`) on the ports the first one bound, with a fresh
engine. The dead process's worker actors and KV store were owned by it, so Ray ended them with
it; their requests are lost (their clients saw the connection drop: UNAVAILABLE).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import warnings

import ray

from coordinator.server_options import ServerOptions
from pagedserve.config import EngineConfig
from workers.priority import raise_to_normal_priority

log = logging.getLogger("pagedserve.server")

ACTOR_NAME = "pagedserve-coordinator"
DEFAULT_METRICS_PORT = 9400
NAMESPACE = "pagedserve"


@ray.remote(num_cpus=0)
class CoordinatorActor:
    def __init__(self, config: dict | None = None, options: ServerOptions | None = None):
        """`config` (EngineConfig fields) and `options`: what `launch()` serves, and what a
        restart of this actor serves again (see `resume`). Without them, call `start()`."""
        # The engine's ray.get calls (worker actors) run in threads, never on this actor's event
        # loop; Ray's warning about blocking gets in async actors would only mislead.
        os.environ.setdefault("RAY_WARN_BLOCKING_GET_INSIDE_ASYNC", "0")
        # Its engine loop hands each step to the workers: at Ray's nice 15 beside workers at 0 it
        # would wait for their spinning threads to yield between steps.
        raise_to_normal_priority()
        self._async_engine = None  # AsyncEngine, once the model is loaded
        self._state = None  # ServerState
        self._drain_timeout = 30.0
        self._server = None  # ServingServer
        self._load: asyncio.Task | None = None
        self._closing = False
        self._metrics = None  # MetricsServer
        self._http = None  # HttpServer: the OpenAI-compatible API
        self._registry = None  # the Prometheus registry both /metrics endpoints serve
        self._stats_log: asyncio.Task | None = None  # the periodic stats line (stats_logger)
        self.port = 0
        self._info: dict = {}
        self._launch_args = (config, options)
        self._resuming: asyncio.Task | None = None
        if config is not None and _restarted():
            # A constructor cannot await, but Ray runs an async actor's constructor on the actor's
            # event loop: the task starts once the constructor has returned. (A call to itself
            # through its own handle, made here, was measured never to run after a restart.)
            self._resuming = asyncio.get_running_loop().create_task(self.resume())
            self._resuming.add_done_callback(
                lambda t: t.cancelled() or t.exception() is None
                or log.error("the restarted coordinator failed to serve again: %r", t.exception()))

    async def launch(self, wait: bool = True) -> int:
        """`start()` with the constructor's config and options, remembering the bound ports (in
        Ray's GCS, which outlives this process) so that a restart binds the same ones."""
        config, options = self._launch_args
        if config is None:
            raise RuntimeError("this coordinator was created without a config: call start()")
        port = await self.start(config, options, wait=False)
        _remember_ports(_ports_key(), {"port": port, "metrics_port": self._info.get("metrics_port"),
                                       "http_port": self._info.get("http_port")})
        if wait:
            await self.wait_ready()
        return port

    async def resume(self) -> None:
        """Serve again after Ray restarted this actor: a fresh engine (new workers, a new KV
        store) behind the gRPC, metrics and HTTP ports that `launch()` bound in the first process."""
        config, launched = self._launch_args
        if self._closing or self._server is not None or config is None:
            return  # stopped (or started) before this ran
        launched = launched if launched is not None else ServerOptions()
        ports = _recall_ports(_ports_key()) or {}
        model = config.get("model", "")
        # start() binds only gRPC here; metrics and HTTP follow, each on its old port or, if that
        # was taken meanwhile, any free one (status says which): they must not keep gRPC down.
        options = dataclasses.replace(launched, port=ports.get("port", launched.port), metrics_port=None,
                                      default_metrics=False, http=False)
        log.warning("the coordinator's process died and Ray restarted it; serving %s again on port %d "
                    "(requests in flight in the dead process are lost)", model, options.port)
        try:
            await self.start(config, options, wait=False)
        except OSError as e:  # the port is taken meanwhile: say so where `status` shows it
            if self._state is not None:
                await self._state.set_failed(f"the restarted coordinator cannot serve again: {e}")
            raise
        if ports.get("metrics_port") is not None:
            try:
                self._start_metrics(options.metrics_host, ports["metrics_port"])
            except OSError:
                self._start_metrics(options.metrics_host, 0)
        if launched.http:
            try:
                await self._start_http(model, dataclasses.replace(launched, http_port=ports.get("http_port")))
            except OSError:
                await self._start_http(model, dataclasses.replace(launched, http_port=0))

    async def pid(self) -> int:
        """This actor's process id (for operators and fault tests)."""
        return os.getpid()

    async def start(self, config: dict, options: ServerOptions | None = None, wait: bool = True) -> int:
        """Bind the gRPC server and the Prometheus endpoint (see ServerOptions), then load the
        model and start the engine loop; returns the bound gRPC port. `wait=False` returns once
        bound; `wait_ready()` waits for the model."""
        from coordinator.grpc_server import ServingServer
        from coordinator.server_state import ServerState

        if self._server is not None:
            raise RuntimeError("this coordinator has already started")
        if options is None:
            options = ServerOptions()
        elif not isinstance(options, ServerOptions):
            raise TypeError(f"options must be a ServerOptions; got {type(options).__name__}")
        engine_config = EngineConfig(**config)
        if engine_config.distributed_executor_backend == "auto":
            # The server is the disaggregated shape: the engine here, the model in worker actors.
            engine_config = engine_config.replace(distributed_executor_backend="ray")
        self._state = ServerState(options.api_key, options.request_timeout)
        # Metrics carry the name clients use, as vLLM's model_name label does.
        self._metrics_model = (options.served_model_name or [engine_config.model])[0]
        self._drain_timeout = options.drain_timeout
        self._server = ServingServer(self._state, options.tls)
        self.port = await self._server.start(options.host, options.port)
        self._info = {"model": engine_config.model, "host": options.host, "port": self.port,
                      "tls": options.tls is not None, "auth": self._state.auth,
                      "drain_timeout": options.drain_timeout}
        # The model loads (workers start, import torch, read the weights: seconds) while the
        # metrics and HTTP servers start (their imports take a few tenths of a second).
        self._load = asyncio.get_running_loop().create_task(
            self._load_engine(engine_config, options))
        self._load.add_done_callback(lambda t: t.cancelled() or t.exception())  # reported by wait_ready
        await asyncio.sleep(0)  # the load's first step: its thread starts the workers
        try:
            if options.metrics_port is not None:
                self._start_metrics(options.metrics_host, options.metrics_port)
            elif options.default_metrics:
                try:
                    self._start_metrics(options.metrics_host, DEFAULT_METRICS_PORT)
                except OSError:  # another server on this machine has it: any free port (status says which)
                    self._start_metrics(options.metrics_host, 0)
            if options.http:
                await self._start_http(engine_config.model, options)
        except BaseException:
            self._closing = True  # the load, once done, shuts its engine down: this start failed
            raise
        if wait:
            await self.wait_ready()
        return self.port

    def _metrics_registry(self):
        from coordinator.prometheus import PagedserveCollector, make_registry

        if self._registry is None:
            state = self._state  # read from the metrics thread: see ServerState on what is safe there
            self._registry = make_registry(PagedserveCollector(
                self._metrics_model, lambda: state.engine.replica_engines() if state.engine is not None else [],
                lambda: dict(state.rejected),
                lambda: state.engine.cluster_counters() if hasattr(state.engine, "cluster_counters") else {}))
        return self._registry

    def _start_metrics(self, host: str, port: int) -> None:
        from coordinator.prometheus import MetricsServer

        self._metrics = MetricsServer(self._metrics_registry(), host, port)
        self._info["metrics_port"] = self._metrics.port

    async def _start_http(self, model: str, options: ServerOptions) -> None:
        """The OpenAI-compatible API on the same event loop as gRPC (same state, auth, TLS)."""
        from coordinator.http_server import HttpServer
        from coordinator.server_options import DEFAULT_HTTP_PORT

        self._http = HttpServer(self._state, model, self._metrics_registry(), options.tls,
                                options.auto_tool_parser, options.reasoning_parser, options.served_model_name,
                                options.allowed_origins)
        if options.http_port is not None:
            port = await self._http.start(options.http_host, options.http_port)
        else:
            try:
                port = await self._http.start(options.http_host, DEFAULT_HTTP_PORT)
            except OSError:  # another server on this machine has it: any free port (status says which)
                port = await self._http.start(options.http_host, 0)
        self._info.update(http_host=options.http_host, http_port=port)

    async def _load_engine(self, config: EngineConfig, options: ServerOptions) -> None:
        from coordinator.async_engine import AsyncEngine

        loop = asyncio.get_running_loop()
        try:
            # Loading takes seconds to minutes: threads, never the event loop.
            if options.num_replicas == 1:
                engine = await loop.run_in_executor(None, _load_llm_engine, config)
                served = AsyncEngine(engine, options.max_queued_requests)
            else:
                served = await self._load_replicas(config, options)
            # Every replica shares the first one's input processor: the template is set once.
            processor = served.llm_engine.input_processor
            processor.chat_template = options.chat_template
            processor.trust_request_chat_template = options.trust_request_chat_template
        except BaseException as e:
            await self._state.set_failed(f"the model failed to load: {e}")
            raise
        if self._closing:
            await loop.run_in_executor(None, _shutdown_served, served)
            return
        self._async_engine = served
        served.start()
        await self._state.set_engine(served)
        if options.log_requests:
            from coordinator import request_log

            request_log.enable(options.log_requests_max_len)
        if options.log_stats:
            from coordinator.stats_logger import log_stats_forever

            self._stats_log = loop.create_task(log_stats_forever(self._state.stats))

    async def _load_replicas(self, config: EngineConfig, options: ServerOptions):
        """`data_parallel_size` engines (the first alone, then the rest side by side), spread over
        the cluster's nodes, behind a Router. They share one input processor (tokenizer, checks,
        compiled grammars)."""
        from coordinator.async_engine import AsyncEngine
        from coordinator.router import Router

        if options.disaggregated:
            return await self._load_disaggregated(config, options)
        loop = asyncio.get_running_loop()
        configs = replica_configs(config, options.data_parallel_size)
        # The first alone: transformers' lazy imports are not safe to race from two threads.
        engines = [await loop.run_in_executor(None, _load_llm_engine, configs[0])]
        engines += await asyncio.gather(*(loop.run_in_executor(None, _load_llm_engine, c) for c in configs[1:]))
        for engine in engines[1:]:
            engine.input_processor = engines[0].input_processor
        shared_input = engines[0].input_processor

        def rebuild(index: int) -> AsyncEngine:  # a replica whose engine stopped (in a thread)
            engine = _load_llm_engine(configs[index])
            engine.input_processor = shared_input
            return _started_engine(engine, options.max_queued_requests, loop)

        policy = "prefix" if options.routing_policy == "auto" else options.routing_policy
        return Router([AsyncEngine(e, options.max_queued_requests) for e in engines], policy,
                      options.max_queued_requests, rebuild)

    async def _load_disaggregated(self, config: EngineConfig, options: ServerOptions):
        """Prefill and decode replicas (coordinator/kv_handoff.py) behind a Router, sharing one KV
        store on the first prefill replica's node: over shared memory when every rank runs
        there, else over gRPC for the ranks elsewhere (kv_transport "grpc": for every rank)."""
        from coordinator.kv_handoff import DEFAULT_STORE_GIB, open_handoff_store, pd_engine_configs
        from coordinator.router import Router

        loop = asyncio.get_running_loop()
        prefill, decode = pd_engine_configs(config, options.prefill_config, options.decode_config)
        roles = ["prefill"] * options.prefill_replicas + ["decode"] * options.decode_replicas
        configs = place_replicas([prefill] * options.prefill_replicas + [decode] * options.decode_replicas)
        engines = [await loop.run_in_executor(None, _load_llm_engine, configs[0])]
        try:
            engines += await asyncio.gather(*(loop.run_in_executor(None, _load_llm_engine, c) for c in configs[1:]))
            shared_input = engines[0].input_processor
            for engine in engines[1:]:
                engine.input_processor = shared_input

            def open_store():
                node = engines[0].executor.node_id()
                spans = any(e.executor.spans_nodes() or e.executor.node_id() != node for e in engines)
                transport = config.kv_transport if config.kv_transport != "auto" else ("grpc" if spans else "shm")
                shm_node = node if config.kv_transport == "auto" else ""
                return open_handoff_store(engines, config.swap_space or DEFAULT_STORE_GIB, options.pd_kv_lease,
                                          node, transport, shm_node)

            handoff = await loop.run_in_executor(None, open_store)
        except BaseException:
            for engine in engines:
                await loop.run_in_executor(None, engine.shutdown)
            raise

        def rebuild(index: int):  # a replica whose engine stopped (in a thread)
            engine = _load_llm_engine(configs[index])
            engine.input_processor = shared_input
            engine.use_handoff_store(router.handoff)  # the current store: a dead one is replaced
            return _started_engine(engine, options.max_queued_requests, loop)

        from coordinator.async_engine import AsyncEngine

        policy = "prefix" if options.routing_policy == "auto" else options.routing_policy
        router = Router([AsyncEngine(e, options.max_queued_requests) for e in engines], policy,
                        options.max_queued_requests, rebuild, roles, handoff, options.pd_min_prompt_tokens)
        return router

    async def wait_ready(self) -> dict:
        """Wait until the model is loaded and served; raises the load error if loading failed."""
        if self._load is None:
            raise RuntimeError("start() has not been called")
        await asyncio.shield(self._load)
        return await self.status()

    async def status(self) -> dict:
        """model, host, port, tls, auth, http_host and http_port (with HTTP on), metrics_port (with
        metrics on), and state: loading, serving, failed or stopping (with the reason when not
        serving)."""
        if self._state is None:
            return {"state": "new"}
        return {**self._info, "state": self._state.status, "reason": self._state.reason}

    async def worker_pids(self, replica: int | None = None) -> list[int]:
        """The process ids of the worker actors, of every replica or of one (for operators and
        fault tests)."""
        if self._async_engine is None:
            return []
        engines = self._async_engine.replica_engines()
        loop = asyncio.get_running_loop()
        pids = []
        for label, engine in engines:
            if replica is None or label == str(replica):
                pids += await loop.run_in_executor(None, engine.executor.worker_pids)
        return pids

    async def stats(self) -> dict:
        """The engine's figures and the refusal counts, as GetStats answers."""
        if self._state is None:
            raise RuntimeError("not started")
        return await self._state.stats()

    async def shutdown(self) -> None:
        """Drain: refuse new requests (UNAVAILABLE), let those in flight finish for up to
        drain_timeout, end the rest with UNAVAILABLE; then stop the engine loop and its workers."""
        self._closing = True
        _forget_ports(_ports_key())
        if self._stats_log is not None:
            self._stats_log.cancel()
        if self._state is not None:
            await self._state.stop()
        if self._async_engine is not None:
            unfinished = await self._async_engine.drain(self._drain_timeout)
            if unfinished:
                log.warning("drain time (%g s) passed; %d requests ended unfinished", self._drain_timeout, unfinished)
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._http is not None:
            await self._http.stop(grace=2)
        if self._server is not None:
            await self._server.stop(grace=2)  # time for the last responses to go out
        if self._async_engine is not None:
            await self._async_engine.stop()
            await asyncio.get_running_loop().run_in_executor(None, _shutdown_served, self._async_engine)
            self._async_engine = None


def _load_llm_engine(config: EngineConfig):
    from coordinator.engine import LLMEngine

    return LLMEngine.from_config(config)


def _started_engine(engine, max_queued_requests: int, loop: asyncio.AbstractEventLoop):
    """An AsyncEngine over `engine`, started on `loop` (from another thread)."""
    from coordinator.async_engine import AsyncEngine

    async def start():
        served = AsyncEngine(engine, max_queued_requests)
        served.start()
        return served

    return asyncio.run_coroutine_threadsafe(start(), loop).result()


def _shutdown_served(served) -> None:
    if hasattr(served, "shutdown_engines"):
        served.shutdown_engines()
    else:
        served.llm_engine.shutdown()


def replica_configs(config: EngineConfig, replicas: int) -> list[EngineConfig]:
    """`replicas` copies of `config`, placed (see place_replicas)."""
    return place_replicas([config] * replicas)


def place_replicas(configs: list[EngineConfig]) -> list[EngineConfig]:
    """Each replica's config: its worker group placed on a node of its own while the cluster's
    nodes last (round robin over nodes that can hold a whole group), and on CPU, unless set,
    `worker_cpus` splitting the cluster's free CPUs evenly among every replica's ranks (two
    replicas on a 2-core node: one core, one torch thread, each), less where the nodes could not
    hold every group at that size (a 3-CPU and a 1-CPU node: one CPU each, not two)."""
    replicas = len(configs)
    ranks = sum(c.tensor_parallel_size for c in configs)
    tp = max(c.tensor_parallel_size for c in configs)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    cpus = configs[0].worker_cpus
    if cpus == 0 and configs[0].device == "cpu":
        free = int(ray.available_resources().get("CPU", 0))
        cpus = max(1, free // ranks)
        while cpus > 1 and sum(int(n.get("Resources", {}).get("CPU", 0)) // (tp * cpus) for n in nodes) < replicas:
            cpus -= 1
    out = []
    for i, config in enumerate(configs):
        need = config.tensor_parallel_size * max(1, cpus)
        roomy = sorted((n for n in nodes if n.get("Resources", {}).get("CPU", 0) >= need),
                       key=lambda n: -n.get("Resources", {}).get("CPU", 0))
        node = config.placement_node or (roomy[i % len(roomy)]["NodeID"] if roomy else "")
        out.append(config.replace(worker_cpus=config.worker_cpus or cpus, placement_node=node))
    return out


def config_dict(config: EngineConfig) -> dict:
    return dataclasses.asdict(config)


def _restarted() -> bool:
    """Whether Ray restarted this actor (its previous process died)."""
    with warnings.catch_warnings():  # Ray's property reads a deprecated one of its own
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


# The ports a launched coordinator bound, kept in Ray's internal KV store (the GCS: it outlives
# the actor's process) under the actor's id, which a restarted actor keeps.
def _ports_key() -> str:
    return f"coordinator-ports-{ray.get_runtime_context().get_actor_id()}"


def _remember_ports(key: str, ports: dict) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(key, json.dumps(ports), overwrite=True, namespace=NAMESPACE)


def _recall_ports(key: str) -> dict | None:
    from ray.experimental import internal_kv

    value = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
    return json.loads(value) if value else None


def _forget_ports(key: str) -> None:
    from ray.experimental import internal_kv

    try:
        internal_kv._internal_kv_del(key, namespace=NAMESPACE)
    except Exception:  # a shutdown goes on whatever the GCS says
        pass
