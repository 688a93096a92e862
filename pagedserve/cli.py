"""The `pagedserve` command. Every engine knob of `EngineConfig` is a flag, generated from it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from coordinator.server_options import REASONING_PARSERS, ROUTING_POLICIES, TOOL_CALL_PARSERS
from pagedserve.config import BUNDLED_MODEL_ALIAS, EngineConfig

_TYPES = {"int": int, "float": float, "str": str, "int | None": int, "float | None": float, "str | None": str}

DEMO_PROMPTS = [
    "The capital of France is",
    "Write a haiku about paged memory:",
    "Three tips for staying focused are",
    "A short story about a robot who learns to paint:",
]


def _json_map(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object of engine settings")
    return value


_TYPES["dict | None"] = _json_map  # speculative_config


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _json_origins(text: str) -> list[str]:
    """vLLM's --allowed-origins: a JSON list of origins ('["*"]'), or one origin as it is."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = [text]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise argparse.ArgumentTypeError('must be a JSON list of origins, e.g. \'["https://app.example"]\'')
    return value


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
    """ValueError for a bad value (naming the flag's field), or a positional MODEL beside a
    different --model."""
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if fields["model"] not in (tag, BUNDLED_MODEL_ALIAS):  # --model given too, and differently
            raise ValueError(f"model: the positional MODEL {tag!r} and --model {fields['model']!r} differ; "
                             "give one of them")
        fields["model"] = tag
    return EngineConfig(**fields)


API_KEY_ENV = "PAGEDSERVE_API_KEY"
DEFAULT_TARGET = "127.0.0.1:50051"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM serving with a paged KV cache")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the server: the coordinator as a Ray actor serving gRPC and the "
                                         "OpenAI-compatible HTTP API",
                           description="Serve a model over gRPC and HTTP (OpenAI's API) until Ctrl-C or SIGTERM "
                                       "(or, with --detach, leave it running in the Ray cluster).")
    add_engine_flags(serve)
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model, as `vllm serve MODEL` takes it: the same as --model")
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
    serve.add_argument("--drain-timeout", type=float, default=30.0,
                       help="on Ctrl-C / SIGTERM / `pagedserve stop`: seconds in-flight requests may finish "
                            "in (new ones get UNAVAILABLE); the rest end with UNAVAILABLE (default: %(default)s)")
    serve.add_argument("--request-timeout", type=float, default=None,
                       help="seconds: the deadline of a request that brings none of its own; past it the "
                            "request is aborted, its blocks freed, and the client told DEADLINE_EXCEEDED "
                            "(default: none)")
    serve.add_argument("--api-key", default=None,
                       help=f"require 'authorization: Bearer <key>' on Serving calls and the HTTP API (default: "
                            f"${API_KEY_ENV} if set, else no auth); health, reflection, /health, /version and "
                            "/metrics stay open")
    serve.add_argument("--tls-cert", default=None, help="PEM certificate (chain) file: serve over TLS")
    serve.add_argument("--tls-key", default=None, help="PEM private key file of --tls-cert")
    serve.add_argument("--metrics-host", default="127.0.0.1",
                       help="interface of the Prometheus endpoint /metrics (default: %(default)s)")
    serve.add_argument("--metrics-port", type=int, default=None,
                       help="port of the Prometheus endpoint; 0 picks a free one (default: 9400, or a free "
                            "port, printed, when 9400 is taken)")
    serve.add_argument("--no-metrics", action="store_true", help="serve no Prometheus endpoint")
    serve.add_argument("--http-host", default="127.0.0.1",
                       help="interface of the OpenAI-compatible HTTP API (default: %(default)s)")
    serve.add_argument("--http-port", type=int, default=None,
                       help="port of the OpenAI-compatible HTTP API; 0 picks a free one (default: 8000, or a "
                            "free port, printed, when 8000 is taken)")
    serve.add_argument("--no-http", action="store_true", help="serve no HTTP API (gRPC only)")
    serve.add_argument("--data-parallel-size", type=int, default=1,
                       help="engine replicas behind this one server, each with its own scheduler, KV pool and "
                            "workers, spread over the Ray cluster's nodes (default: %(default)s)")
    serve.add_argument("--routing-policy", default="auto", choices=ROUTING_POLICIES,
                       help="how requests are sent to replicas: prefix (cached prefix against load; the auto "
                            "choice), least-loaded or round-robin (default: %(default)s)")
    serve.add_argument("--prefill-replicas", type=int, default=0,
                       help="prefill/decode disaggregation: replicas that only compute prompts and hand their KV "
                            "blocks to decode replicas through a shared KV store (default: 0, off)")
    serve.add_argument("--decode-replicas", type=int, default=0,
                       help="replicas that load handed-over prompts and decode (with --prefill-replicas)")
    serve.add_argument("--prefill-config", type=_json_map, default=None, metavar="JSON",
                       help='engine settings of the prefill replicas over the flags\' values, e.g. '
                            '\'{"tensor_parallel_size": 2}\' (model, dtype and block_size must match the decode side)')
    serve.add_argument("--decode-config", type=_json_map, default=None, metavar="JSON",
                       help="engine settings of the decode replicas over the flags' values")
    serve.add_argument("--pd-min-prompt-tokens", type=int, default=0,
                       help="prompts shorter than this go straight to a decode replica (default: %(default)s)")
    serve.add_argument("--pd-kv-lease", type=float, default=60.0,
                       help="seconds a handed-over prompt's blocks stay reserved in the shared store for their "
                            "decode replica; past it they are freed and the prompt is recomputed (default: %(default)s)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='serve tool_choice "auto" (the default with tools) over HTTP, finding calls in the '
                            "model's text with --tool-call-parser; without it only named and \"required\" tool "
                            "choices are served")
    serve.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                       help="how tool calls are written in the model's text: hermes, <tool_call>{json}</tool_call> "
                            "(Qwen 2.5/3, Hermes); mistral, [TOOL_CALLS]; llama3_json, {\"name\", \"parameters\"} "
                            "(Llama 3.1-3.3); pythonic, [f(a=1)] (Llama 3.2/4)")
    serve.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="the model id(s) HTTP clients send, in place of --model's path or alias; responses "
                            "carry the first")
    serve.add_argument("--allowed-origins", type=_json_origins, default=["*"], metavar="JSON",
                       help='origins whose browser pages may call the HTTP API (CORS), as vLLM\'s: a JSON list, '
                            'default \'["*"]\' (any; the API key still applies); \'[]\' answers no cross-origin '
                            "request")
    serve.add_argument("--disable-log-stats", action="store_true",
                       help="no periodic line of throughput, queues and KV cache usage on stderr (vLLM's flag)")
    serve.add_argument("--enable-log-requests", action="store_true",
                       help="log each request as it arrives (id, prompt, sampling settings) and as it ends "
                            "(vLLM's flag; off by default: prompts are users' data)")
    serve.add_argument("--disable-log-requests", action="store_true",
                       help="vLLM's older flag: requests are not logged unless --enable-log-requests, so it "
                            "changes nothing")
    serve.add_argument("--max-log-len", type=int, default=None, metavar="CHARS",
                       help="characters of a prompt a request's log line shows (default: all)")
    serve.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                       help="return a thinking model's <think> block as reasoning_content, apart from the "
                            "content: deepseek_r1 (the reply starts inside it), qwen3 (an explicit <think>)")
    serve.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                       help="a Jinja chat template (a file, or the template inline) in place of the model's, for "
                            "chat requests of both APIs; needed for a model without one")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="let HTTP requests bring their own chat_template (refused otherwise: a template is "
                            "code the server runs, sandboxed)")

    demo = sub.add_parser("demo", help="an offline demo: stream a few prompts through the engine in this process")
    add_engine_flags(demo)
    demo.add_argument("--max-tokens", type=int, default=48, help="tokens generated per demo prompt")
    demo.add_argument("--prompt", action="append", help="a demo prompt (repeatable)")

    gen = sub.add_parser("generate", help="send a prompt to a running server")
    gen.add_argument("prompt")
    _add_client_flags(gen)
    gen.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    gen.add_argument("--timeout", type=_positive_float, default=None, help="seconds before the request is abandoned")
    # Optional sampling fields: left unset, the server's defaults apply (its generation config's,
    # else SamplingParams'), as for any client: `--n 2` then samples rather than repeating one reply.
    for flag, kind, help_text in _SAMPLING_FLAGS:
        gen.add_argument(flag, type=kind, default=None, help=help_text)
    gen.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    gen.add_argument("--beam-search", action="store_true", help="beam search instead of sampling")
    gen.add_argument("--priority", type=int, default=0, help="lower runs first on a server with "
                                                            "--scheduling-policy priority")

    stats = sub.add_parser("stats", help="print a running server's stats")
    _add_client_flags(stats)

    bench = sub.add_parser("bench", help="benchmark a running server (or an embedded one): throughput, latency, "
                                         "KV usage, prefix hits; table, JSON and plots",
                           description="Send a workload to a server and report what it did. Engine flags apply "
                                       "to --embedded (and --model names the tokenizer and the baseline's model).")
    add_engine_flags(bench)
    _add_client_flags(bench)
    from pagedserve.bench.command import add_bench_arguments

    add_bench_arguments(bench)
    stop = sub.add_parser("stop", help="stop the server running in a Ray cluster (one started with --detach)")
    stop.add_argument("--address", default="auto", help="the Ray cluster: 'auto' or host:port (default: %(default)s)")
    return parser


_SAMPLING_FLAGS = (
    ("--max-tokens", int, "tokens to generate (default: the server's: its generation config's max_new_tokens, "
                          "else 16)"),
    ("--temperature", float, "0 for greedy (default: the server's: its generation config's, else 1.0)"),
    ("--n", int, "samples to return (they share the prompt's KV blocks)"),
    ("--best-of", int, "samples to generate; the n with the highest cumulative logprob are returned"),
    ("--seed", int, "seed of this request's sampling (sample j uses seed + j)"),
    ("--top-p", float, "nucleus sampling mass"),
    ("--top-k", int, "sample among the k most likely tokens"),
    ("--min-p", float, "drop tokens below this share of the most likely one"),
    ("--presence-penalty", float, "[-2, 2], over generated tokens"),
    ("--frequency-penalty", float, "[-2, 2], over generated tokens"),
    ("--repetition-penalty", float, "(0, 2], over prompt and generated tokens"),
    ("--logprobs", int, "print each token's logprob and the top k"),
    ("--beam-width", int, "beams kept by --beam-search (default 4)"),
    ("--length-penalty", float, "beam score = cumulative logprob / length ** this (default 1)"),
)


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
    sampling = {"priority": args.priority}
    for flag, _, _ in _SAMPLING_FLAGS:
        name = flag.removeprefix("--").replace("-", "_")
        if getattr(args, name) is not None:
            sampling[name] = getattr(args, name)
    if args.stop:
        sampling["stop"] = args.stop
    if args.beam_search:
        sampling["use_beam_search"] = True
    try:
        with _client(args, args.timeout) as client:
            if args.stream:
                for chunk in client.stream(prompt, **sampling):
                    prefix = f"[{chunk.index}] " if sampling.get("n", 1) > 1 else ""
                    print(prefix + chunk.text, end="\n" if prefix else "", flush=True)
                print()
            else:
                for completion in client.generate_all(prompt, **sampling):
                    if sampling.get("n", 1) > 1:
                        print(f"--- sample {completion.index} ---")
                    print(completion.text)
                    for step in completion.logprobs:
                        tops = ", ".join(f"{t['decoded_token']!r}: {t['logprob']:.3f}" for t in step["top"])
                        print(f"  {step['decoded_token']!r} {step['logprob']:.4f} (rank {step['rank']})"
                              + (f"  top: {tops}" if tops else ""))
    except ServingError as e:
        print(f"pagedserve: {e.code.name}: {e.details}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:  # ValueError: a request the client refuses to build
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


def run_demo(config: EngineConfig, prompts: list[str], max_tokens: int) -> dict:
    from coordinator.engine import LLMEngine
    from coordinator.sampling_params import SamplingParams

    print(f"loading {config.model} ...", file=sys.stderr, flush=True)
    engine = LLMEngine.from_config(config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    chat = engine.input_processor.has_chat_template
    for i, prompt in enumerate(prompts):
        messages = [{"role": "user", "content": prompt}] if chat else None
        engine.add_request(str(i), None if chat else prompt, None, params, messages=messages)
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
    try:
        status = _run_command(argv)
        sys.stdout.flush()  # a reader that left shows here, not as a warning at exit
        return status
    except BrokenPipeError:  # the reader left (`pagedserve stats | head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 1


def _run_command(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        return run_generate(args)
    if args.command == "stats":
        return run_stats(args)
    if args.command == "stop":
        from pagedserve.serve_command import run_stop

        return run_stop(args)
    if args.command == "bench":
        from pagedserve.bench.command import run_bench

        return run_bench(args, _api_key(args))
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"pagedserve: error: {e}", file=sys.stderr)
        return 2
    if args.command == "demo":
        run_demo(config, args.prompt or DEMO_PROMPTS, args.max_tokens)
        return 0
    from pagedserve.serve_command import run_serve

    return run_serve(args, config, _api_key(args))


if __name__ == "__main__":
    sys.exit(main())
