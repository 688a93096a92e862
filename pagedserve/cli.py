"""The `pagedserve` command. Every engine knob of `EngineConfig` is a flag, generated from it."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time

from pagedserve.config import EngineConfig

_TYPES = {"int": int, "float": float, "str": str, "int | None": int, "float | None": float}

DEMO_PROMPTS = [
    "The capital of France is",
    "Write a haiku about paged memory:",
    "Three tips for staying focused are",
    "A short story about a robot who learns to paint:",
]


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata.get('help', '')} (default: {f.default})"
        if f.type == "bool":
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                                help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, type=_TYPES[f.type], default=f.default, help=help_text)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


API_KEY_ENV = "PAGEDSERVE_API_KEY"
DEFAULT_TARGET = "127.0.0.1:50051"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM serving with a paged KV cache")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the server: the coordinator as a Ray actor serving gRPC",
                           description="Serve a model over gRPC until Ctrl-C or SIGTERM (or, with --detach, "
                                       "leave it running in the Ray cluster).")
    add_engine_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="interface the gRPC server binds (default: %(default)s)")
    serve.add_argument("--port", type=int, default=50051, help="gRPC port; 0 picks a free one (default: %(default)s)")
    serve.add_argument("--address", default=None,
                       help="join a running Ray cluster: 'auto' or its GCS address host:port "
                            "(default: start a local Ray for this server, stopped with it)")
    serve.add_argument("--detach", action="store_true",
                       help="start the server in a running Ray cluster (--address, default auto), print "
                            "where it serves and exit, leaving it running; end it with `pagedserve stop`")
    serve.add_argument("--max-queued-requests", type=int, default=1024,
                       help="requests waiting beyond this are refused with RESOURCE_EXHAUSTED (default: %(default)s)")
    serve.add_argument("--api-key", default=None,
                       help=f"require 'authorization: Bearer <key>' on Serving calls (default: ${API_KEY_ENV} "
                            "if set, else no auth); health and reflection stay open")
    serve.add_argument("--tls-cert", default=None, help="PEM certificate (chain) file: serve over TLS")
    serve.add_argument("--tls-key", default=None, help="PEM private key file of --tls-cert")

    demo = sub.add_parser("demo", help="an offline demo: stream a few prompts through the engine in this process")
    add_engine_flags(demo)
    demo.add_argument("--max-tokens", type=int, default=48, help="tokens generated per demo prompt")
    demo.add_argument("--prompt", action="append", help="a demo prompt (repeatable)")

    gen = sub.add_parser("generate", help="send a prompt to a running server")
    gen.add_argument("prompt")
    _add_client_flags(gen)
    gen.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--timeout", type=float, default=None, help="seconds before the request is abandoned")

    stats = sub.add_parser("stats", help="print a running server's stats")
    _add_client_flags(stats)

    stop = sub.add_parser("stop", help="stop the server running in a Ray cluster (one started with --detach)")
    stop.add_argument("--address", default="auto", help="the Ray cluster: 'auto' or host:port (default: %(default)s)")
    return parser


def _add_client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=DEFAULT_TARGET, help="server address (default: %(default)s)")
    parser.add_argument("--api-key", default=None, help=f"bearer token (default: ${API_KEY_ENV} if set)")
    parser.add_argument("--tls-ca", default=None, help="PEM file of the CA (or self-signed cert) to trust: use TLS")
    parser.add_argument("--tls", action="store_true", help="use TLS with the system's trusted CAs")


def _api_key(args) -> str | None:
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def _client(args, timeout: float | None):
    import grpc

    from pagedserve.client import Client

    credentials = None
    if args.tls_ca:
        with open(args.tls_ca, "rb") as f:
            credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
    elif args.tls:
        credentials = grpc.ssl_channel_credentials()
    return Client(args.target, token=_api_key(args), credentials=credentials, timeout=timeout)


def run_generate(args) -> int:
    from pagedserve.client import ServingError

    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    try:
        with _client(args, args.timeout) as client:
            if args.stream:
                for chunk in client.stream(prompt, **sampling):
                    print(chunk.text, end="", flush=True)
                print()
            else:
                print(client.generate(prompt, **sampling).text)
    except ServingError as e:
        print(f"pagedserve: {e.code.name}: {e.details}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"pagedserve: error: {e}", file=sys.stderr)
        return 2
    return 0


def run_stats(args) -> int:
    from pagedserve.client import ServingError

    try:
        with _client(args, 10) as client:
            stats = client.stats()
    except ServingError as e:
        print(f"pagedserve: {e.code.name}: {e.details}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"pagedserve: error: {e}", file=sys.stderr)
        return 2
    for key in sorted(stats):
        print(f"{key} {stats[key]:g}")
    return 0


# ---- serve / stop: the coordinator actor in a Ray cluster ----

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


def _connect_ray(address: str | None, tensor_parallel_size: int = 1) -> None:
    """Start a local Ray (address None) or join a running cluster ('auto' or host:port)."""
    _ray_token_auth_env(address)
    import ray

    from coordinator.actor import NAMESPACE

    if address is None:
        # "local": a new cluster even when another runs on this machine; it ends with this process.
        # At least one logical CPU per tensor-parallel rank, so that any size that divides the
        # model can be placed here, oversubscribed or not.
        cpus = max(os.cpu_count() or 1, tensor_parallel_size)
        ray.init(address="local", namespace=NAMESPACE, include_dashboard=False, num_cpus=cpus)
    else:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)


def _connect_or_explain(address: str | None, tensor_parallel_size: int = 1) -> bool:
    try:
        _connect_ray(address, tensor_parallel_size)
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
    import ray

    try:
        ray.get(actor.shutdown.remote(), timeout=30)
    except Exception as e:  # already dead, or stuck: kill it anyway
        _err(f"the server did not shut down cleanly ({type(e).__name__}); killing it")
    ray.kill(actor)


def run_serve(args, config: EngineConfig) -> int:
    try:
        tls = _read_tls(args)
    except ValueError as e:
        _err(f"error: {e}")
        return 2
    address = args.address or ("auto" if args.detach else None)
    api_key = _api_key(args)
    if not _connect_or_explain(address, config.tensor_parallel_size):
        return 1
    import ray

    from coordinator.actor import ACTOR_NAME, NAMESPACE, CoordinatorActor, config_dict
    # ray.init installs its own SIGTERM handler; SIGTERM ends the server like Ctrl-C does. SIGINT
    # too, explicitly: a shell starting us in the background (`&`) leaves SIGINT ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    actor = None
    try:
        options = {"name": ACTOR_NAME, "namespace": NAMESPACE}
        if args.detach:
            options["lifetime"] = "detached"
        try:
            actor = CoordinatorActor.options(**options).remote()
        except ValueError:  # the name is taken
            _err(f"a pagedserve server already runs in this Ray cluster (actor {ACTOR_NAME!r} in namespace "
                 f"{NAMESPACE!r}); stop it first with `pagedserve stop`")
            return 1
        _err(f"loading {config.model} ...")
        cert, key = tls if tls else (None, None)
        try:
            port = ray.get(actor.start.remote(config_dict(config), args.host, args.port, args.max_queued_requests,
                                              api_key, cert, key, False))
            _err(f"bound {_hostport(args.host, port)}; health says NOT_SERVING until the model is loaded")
            ray.get(actor.wait_ready.remote())
        except ray.exceptions.RayError as e:
            _err(f"the server failed to start: {_cause(e)}")
            return 1
        notes = [n for n, on in (("TLS", tls is not None), ("API key required", bool(api_key))) if on]
        print(f"serving {config.model} on {_hostport(args.host, port)}" + (f" ({', '.join(notes)})" if notes else ""),
              flush=True)
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


def run_demo(config: EngineConfig, prompts: list[str], max_tokens: int) -> dict:
    from coordinator.engine import LLMEngine
    from coordinator.sampling_params import SamplingParams

    print(f"loading {config.model} ...", file=sys.stderr, flush=True)
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for i, prompt in enumerate(prompts):
        if engine.has_chat_template:
            engine.add_request(str(i), None, engine.chat_prompt_ids([{"role": "user", "content": prompt}]), params)
        else:
            engine.add_request(str(i), prompt, None, params)
    texts = {str(i): "" for i in range(len(prompts))}
    start = time.monotonic()
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id] += out.delta_text
            if out.request_id == "0":  # stream the first request live; the rest print when done
                print(out.delta_text, end="", flush=True)
    elapsed = time.monotonic() - start
    print()
    for i, prompt in enumerate(prompts):
        print(f"\n### {prompt}\n{texts[str(i)].strip()}")
    stats = engine.stats()
    stats["seconds"] = round(elapsed, 2)
    print("\nstats:", ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items()))
    return stats


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        return run_generate(args)
    if args.command == "stats":
        return run_stats(args)
    if args.command == "stop":
        return run_stop(args)
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"pagedserve: error: {e}", file=sys.stderr)
        return 2
    if args.command == "demo":
        run_demo(config, args.prompt or DEMO_PROMPTS, args.max_tokens)
        return 0
    return run_serve(args, config)


if __name__ == "__main__":
    sys.exit(main())
