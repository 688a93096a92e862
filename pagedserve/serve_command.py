"""`pagedserve serve` and `pagedserve stop`: the coordinator actor in a local or joined Ray cluster.

The CLI's parser lives in `pagedserve/cli.py`; this module is what those two commands do.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

from coordinator.chat_template import load_chat_template
from coordinator.server_options import ServerOptions
from pagedserve.config import EngineConfig

def _err(message: str) -> None:
    print(f"pagedserve: {message}", file=sys.stderr, flush=True)


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _ray_token_auth_env(address: str | None) -> None:
    """Ray 2.60 turns token auth on for clusters started by ray.init(), but a client joining with
    an explicit address sends its token only when RAY_AUTH_MODE=token, and Ray reads that when it
    is imported. Sending a token to a cluster without auth does no harm: send it whenever one is
    at hand."""
    if address is None or "RAY_AUTH_MODE" in os.environ:
        return
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH") or \
            os.path.isfile(os.path.expanduser("~/.ray/auth_token")):
        os.environ["RAY_AUTH_MODE"] = "token"
        if "ray" in sys.modules:  # imported already (main() called in-process): refresh its config
            try:
                from ray._raylet import Config
                Config.initialize("")
            except Exception:
                pass


def _connect_ray(address: str | None, num_ranks: int = 1) -> None:
    """Start a local Ray (address None) or join a running cluster ('auto' or host:port)."""
    _ray_token_auth_env(address)
    import ray

    from coordinator.actor import NAMESPACE
    from workers.local_ray import init_local_ray

    if address is None:
        # "local": a new cluster even when another runs on this machine; it ends with this process.
        # At least one logical CPU per worker rank (every replica's), so that any size that
        # divides the model can be placed here, oversubscribed or not.
        cpus = max(os.cpu_count() or 1, num_ranks)
        # Its log monitor starts once the server is up (start_deferred_log_monitor).
        init_local_ray(address="local", namespace=NAMESPACE, include_dashboard=False, num_cpus=cpus)
    else:
        _check_reachable(address)
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)


# How long an explicit host:port may take to accept a TCP connection. Ray itself retries an
# unreachable GCS for minutes, printing a timeout a line at a time.
REACH_TIMEOUT_S = 5.0


def _check_reachable(address: str) -> None:
    """ConnectionError unless something accepts TCP at `address` when it is host:port (Ray's GCS);
    'auto' and URLs (ray://...) are left to Ray."""
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_TIMEOUT_S).close()
    except OSError as e:
        raise ConnectionError(f"nothing accepts connections at {address} ({e})") from None


def _connect_or_explain(address: str | None, num_ranks: int = 1) -> bool:
    try:
        _connect_ray(address, num_ranks)
    except Exception as e:  # ConnectionError, AuthenticationError, ...
        hint = ""
        if address is not None:
            hint = (" (start one with `ray start --head`, or leave out --address to start a local Ray; "
                    "a cluster with token auth needs its token in ~/.ray/auth_token or $RAY_AUTH_TOKEN)")
        _err(f"cannot {'start a local Ray' if address is None else f'join the Ray cluster at {address!r}'}: "
             f"{type(e).__name__}: {e}{hint}")
        return False
    return True


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _read_tls(args) -> tuple[bytes, bytes] | None:
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_cert is None:
        return None
    try:
        with open(args.tls_cert, "rb") as f:
            cert = f.read()
        with open(args.tls_key, "rb") as f:
            key = f.read()
    except OSError as e:
        raise ValueError(f"cannot read the TLS files: {e}") from None
    return cert, key


def _cause(e: BaseException) -> str:
    import ray

    if isinstance(e, ray.exceptions.RayTaskError):
        cause = e.cause if getattr(e, "cause", None) is not None else e
        return f"{type(cause).__name__}: {cause}"
    return f"{type(e).__name__}: {e}"


def _end_actor(actor) -> None:
    """Drain and stop the server (its own drain_timeout bounds the drain), then kill the actor."""
    import ray

    try:
        drain = ray.get(actor.status.remote(), timeout=30).get("drain_timeout", 30.0)
        ray.get(actor.shutdown.remote(), timeout=drain + 30)
    except Exception as e:  # already dead, or stuck: kill it anyway
        _err(f"the server did not shut down cleanly ({type(e).__name__}); killing it")
    ray.kill(actor)


def _server_options(args, api_key: str | None) -> ServerOptions:
    """The front door's options from the flags, checked before Ray starts (ValueError)."""
    tls = _read_tls(args)
    cert, key = tls if tls else (None, None)
    metrics_port = None if args.no_metrics else args.metrics_port
    return ServerOptions(host=args.host, port=args.port, max_queued_requests=args.max_queued_requests,
                         api_key=api_key, tls_cert=cert, tls_key=key, metrics_host=args.metrics_host,
                         metrics_port=metrics_port, default_metrics=metrics_port is None and not args.no_metrics,
                         request_timeout=args.request_timeout, drain_timeout=args.drain_timeout,
                         http=not args.no_http, http_host=args.http_host, http_port=args.http_port,
                         data_parallel_size=args.data_parallel_size, routing_policy=args.routing_policy,
                         prefill_replicas=args.prefill_replicas, decode_replicas=args.decode_replicas,
                         prefill_config=args.prefill_config, decode_config=args.decode_config,
                         pd_min_prompt_tokens=args.pd_min_prompt_tokens, pd_kv_lease=args.pd_kv_lease,
                         enable_auto_tool_choice=args.enable_auto_tool_choice,
                         tool_call_parser=args.tool_call_parser,
                         chat_template=None if args.chat_template is None else load_chat_template(args.chat_template),
                         trust_request_chat_template=args.trust_request_chat_template,
                         reasoning_parser=args.reasoning_parser, served_model_name=args.served_model_name,
                         allowed_origins=tuple(args.allowed_origins), log_stats=not args.disable_log_stats,
                         log_requests=args.enable_log_requests, log_requests_max_len=args.max_log_len)


def run_serve(args, config: EngineConfig, api_key: str | None) -> int:
    try:
        server_options = _server_options(args, api_key)
    except ValueError as e:
        _err(f"error: {e}")
        return 2
    address = args.address or ("auto" if args.detach else None)
    if not _connect_or_explain(address, config.tensor_parallel_size * server_options.num_replicas):
        return 1
    import ray

    from coordinator.actor import ACTOR_NAME, NAMESPACE
    from workers.local_ray import start_deferred_log_monitor
    # ray.init installs its own SIGTERM handler; SIGTERM ends the server like Ctrl-C does. SIGINT
    # too, explicitly: a shell starting us in the background (`&`) leaves SIGINT ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    actor = None
    try:
        try:
            actor = create_coordinator(config, server_options, args.detach)
        except ValueError:  # the name is taken
            _err(f"a pagedserve server already runs in this Ray cluster (actor {ACTOR_NAME!r} in namespace "
                 f"{NAMESPACE!r}); stop it first with `pagedserve stop`")
            return 1
        _err(f"loading {config.model} ...")
        try:
            port = ray.get(actor.launch.remote(wait=False))
            _err(f"bound {_hostport(args.host, port)}; health says NOT_SERVING until the model is loaded")
            ray.get(actor.wait_ready.remote())
        except ray.exceptions.RayError as e:
            _err(f"the server failed to start: {_cause(e)}")
            return 1
        status = ray.get(actor.status.remote())
        if "metrics_port" in status:
            _err(f"Prometheus metrics on http://{_hostport(args.metrics_host, status['metrics_port'])}/metrics")
        if "http_port" in status:
            scheme = "https" if server_options.tls is not None else "http"
            _err(f"OpenAI-compatible API on {scheme}://{_hostport(args.http_host, status['http_port'])}/v1")
        notes = [n for n, on in (("TLS", server_options.tls is not None), ("API key required", bool(api_key)))
                 if on]
        print(f"serving {config.model} on {_hostport(args.host, port)}" + (f" ({', '.join(notes)})" if notes else ""),
              flush=True)
        if address is None:
            start_deferred_log_monitor()  # the workers' lines written so far, then as they come
        if args.detach:
            actor = None  # stays running in the cluster
            _err(f"detached; stop it with `pagedserve stop --address {address}`")
            return 0
        return _serve_until_stopped(actor)
    except KeyboardInterrupt:
        _err("stopping ...")
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # finish the cleanup
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            if actor is not None:
                _end_actor(actor)
            ray.shutdown()
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def create_coordinator(config: EngineConfig, options: ServerOptions, detach: bool):
    """The named coordinator actor that `serve` starts with `launch()` (ValueError: the name is
    taken). Detached, it outlives this process and Ray restarts it, with no limit, whenever its
    process dies: it then serves again by itself on the same node and ports, with a fresh engine
    (CoordinatorActor.resume); `stop` ends it for good. Not detached, this process watches it and
    exits when it dies."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from coordinator.actor import ACTOR_NAME, NAMESPACE, CoordinatorActor, config_dict

    # Pinned to this node, detached or not: --host is an address of this node (127.0.0.1 by
    # default), which another node cannot bind (a 0-CPU actor goes to any node of a cluster), and
    # a restart must serve on it again, not wherever Ray finds room.
    node = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor_options = {"name": ACTOR_NAME, "namespace": NAMESPACE, "scheduling_strategy": node}
    if detach:
        actor_options.update(lifetime="detached", max_restarts=-1)
    return CoordinatorActor.options(**actor_options).remote(config_dict(config), options)


def _serve_until_stopped(actor) -> int:
    """Block until Ctrl-C / SIGTERM (KeyboardInterrupt); watch that the server still serves."""
    import ray

    while True:
        time.sleep(2.0)
        try:
            status = ray.get(actor.status.remote(), timeout=30)
        except ray.exceptions.GetTimeoutError:
            continue
        except ray.exceptions.RayActorError as e:
            _err(f"the server's actor ended: {_cause(e)}")
            return 1
        if status["state"] == "failed":
            _err(f"{status['reason']}; shutting down")
            return 1


def run_stop(args) -> int:
    if not _connect_or_explain(args.address):
        return 1
    import ray

    from coordinator.actor import ACTOR_NAME, NAMESPACE
    try:
        try:
            actor = ray.get_actor(ACTOR_NAME, namespace=NAMESPACE)
        except ValueError:
            _err(f"no pagedserve server runs in the Ray cluster at {args.address!r} "
                 f"(no actor {ACTOR_NAME!r} in namespace {NAMESPACE!r})")
            return 1
        try:
            status = ray.get(actor.status.remote(), timeout=10)
            where = f"{status['model']} on {_hostport(status['host'], status['port'])}" if "model" in status else "not started"
        except Exception as e:
            where = f"not answering: {type(e).__name__}"
        _end_actor(actor)
        print(f"stopped the pagedserve server ({where})", flush=True)
        return 0
    finally:
        ray.shutdown()

