"""`pagedserve bench`: send a workload to a server (or an embedded one), print and save the figures."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from pathlib import Path

from pagedserve.config import EngineConfig

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"


def add_bench_arguments(p) -> None:
    p.add_argument("--embedded", action="store_true",
                   help="start `pagedserve serve` with the engine flags given here, bench it, stop it")
    p.add_argument("--backend", choices=("grpc", "openai"), default="grpc",
                   help="the door the requests go through: grpc (--target) or the OpenAI-compatible HTTP API "
                        "(--base-url); either way the server's stats are read over gRPC (--target) when it answers "
                        "(default: %(default)s)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="with --backend openai: /v1/completions (token-id prompts, the same tokens as gRPC) or "
                        "/v1/chat/completions (messages; a synthetic prompt is one user message) "
                        "(default: %(default)s)")
    p.add_argument("--base-url", default=None,
                   help="with --backend openai: the API's root (default: the embedded server's, else "
                        f"{DEFAULT_BASE_URL})")
    p.add_argument("--dataset", default="synthetic",
                   help="'synthetic' or a JSONL file of {\"prompt\": ...} or {\"messages\": [...]} lines, each with "
                        "an optional \"max_tokens\" (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", default="64:512",
                   help="synthetic prompt tokens: N or MIN:MAX (after the shared prefix) (default: %(default)s)")
    p.add_argument("--output-len", default="16:128", help="synthetic output tokens: N or MIN:MAX (default: %(default)s)")
    p.add_argument("--length-distribution", default="uniform", choices=("uniform", "normal", "exponential"))
    p.add_argument("--shared-prefix-len", type=int, default=0,
                   help="tokens of text every synthetic prompt starts with (a prefix-cache workload)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens of JSONL rows without max_tokens")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals; inf sends all at once (default: %(default)s)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--bench-seed", type=int, default=0, help="seed of the workload and the arrivals")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--result-json", default=None, help="write every figure (and per-request timings) here")
    p.add_argument("--plot-dir", default=None, help="write PNG plots here")
    p.add_argument("--baseline", choices=("none", "transformers"), default="none",
                   help="also run the prompts through transformers generate on static batches and print the ratio")
    p.add_argument("--baseline-batch-size", type=int, default=16)
    p.add_argument("--server-timeout", type=float, default=600.0, help="seconds for an embedded server to start")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _check(args) -> None:
    from pagedserve.bench.dataset import parse_range

    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1; got {args.num_prompts}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once); got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1; got {args.max_concurrency}")
    if args.baseline_batch_size < 1:
        raise ValueError(f"--baseline-batch-size must be >= 1; got {args.baseline_batch_size}")
    args.input_range = parse_range(args.input_len, "--input-len")
    args.output_range = parse_range(args.output_len, "--output-len")


def _workload(args, tokenizer):
    from pagedserve.bench.dataset import as_chat, load_jsonl, synthetic

    if args.dataset == "synthetic":
        requests = synthetic(tokenizer, args.num_prompts, args.input_range, args.output_range,
                             args.length_distribution, args.bench_seed, args.shared_prefix_len)
    elif not Path(args.dataset).is_file():
        raise ValueError(f"--dataset must be 'synthetic' or a JSONL file; {args.dataset!r} is neither")
    else:
        requests = load_jsonl(args.dataset, tokenizer, args.max_tokens, args.num_prompts)
    return as_chat(requests, tokenizer) if args.backend == "openai" and args.endpoint == "chat" else requests


def _engine_flags(args) -> dict:
    """The engine flags given on the command line that differ from the defaults."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
            if getattr(args, f.name) != f.default}


def run_bench(args, api_key: str | None) -> int:
    from pagedserve.bench.embedded import EmbeddedServer
    from workers.gguf_cache import load_tokenizer
    from pagedserve.bench.report import format_table, summarize
    from pagedserve.config import resolve_model

    try:
        _check(args)
        source = resolve_model(args.model)
        tokenizer = load_tokenizer(source, args.tokenizer)
        requests = _workload(args, tokenizer)
    except (ValueError, OSError) as e:
        print(f"pagedserve: error: {e}", file=sys.stderr)
        return 2
    server = None
    target = args.target
    try:
        if args.embedded:
            server = EmbeddedServer(_engine_flags(args))
            print(f"starting an embedded server for {args.model} ...", file=sys.stderr)
            server.wait_healthy(args.server_timeout)
            target = server.target
        run = asyncio.run(_run(args, target, server.base_url if server is not None else None, requests, api_key))
    except Exception as e:  # a server that is not there, or refused us: say so, no traceback
        print(f"pagedserve: error: {e}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()
    summary = summarize(run)
    baseline = None
    if args.baseline == "transformers":
        from pagedserve.bench.hf_baseline import run_transformers
        from workers.model_loader import resolve_dtype

        print("running the transformers baseline ...", file=sys.stderr)
        baseline = run_transformers(args.model, requests, args.baseline_batch_size,
                                    resolve_dtype(args.dtype, args.device), args.device)
        baseline["speedup"] = summary["output_token_throughput"] / baseline["output_token_throughput"]
        outputs = baseline.pop("outputs")
        if args.temperature == 0:  # greedy both: a sanity check of the comparison
            if args.backend == "grpc":
                baseline["identical_outputs"] = sum(r.token_ids == o for r, o in zip(run.results, outputs))
            else:  # HTTP streams text; a server holds back an incomplete UTF-8 character at the end
                baseline["identical_outputs"] = sum(
                    r.text == tokenizer.decode(o, skip_special_tokens=True).rstrip("\ufffd")
                    for r, o in zip(run.results, outputs))
    print(format_table(summary, baseline))
    if args.plot_dir:
        from pagedserve.bench.plots import write_plots

        for path in write_plots(run, args.plot_dir):
            print(f"plot: {path}")
    if args.result_json:
        _write_json(args, summary, baseline, run)
        print(f"figures: {args.result_json}")
    return 0 if summary["failed"] == 0 else 1


async def _run(args, target: str, embedded_base_url: str | None, requests, api_key: str | None):
    import pagedserve
    from pagedserve.bench.backends import GrpcBackend, OpenAIBackend
    from pagedserve.bench.runner import run_workload

    credentials = _credentials(args)
    poller = pagedserve.AsyncClient(target, token=api_key, credentials=credentials, timeout=10)
    if args.backend == "grpc":
        backend = GrpcBackend(target, api_key, credentials)
    else:
        backend = OpenAIBackend(args.base_url or embedded_base_url or DEFAULT_BASE_URL, args.endpoint, api_key,
                                _ssl_context(args), args.max_concurrency)
        try:  # any OpenAI-compatible server can be benched; pagedserve's stats come over gRPC when it answers
            await poller.stats()
        except pagedserve.ServingError as e:
            print(f"no server stats (gRPC {target}: {e.code.name}): the server's own figures are left out",
                  file=sys.stderr)
            await poller.close()
            poller = None
    return await run_workload(backend, requests, args.request_rate, args.max_concurrency, args.bench_seed,
                              args.temperature, progress=not args.no_progress, poller=poller)


def _ssl_context(args):
    import ssl

    return ssl.create_default_context(cafile=args.tls_ca) if args.tls_ca else None


def _credentials(args):
    import grpc

    if args.tls_ca:
        with open(args.tls_ca, "rb") as f:
            return grpc.ssl_channel_credentials(root_certificates=f.read())
    return grpc.ssl_channel_credentials() if args.tls else None


def _write_json(args, summary: dict, baseline: dict | None, run) -> None:
    options = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None), tuple))}
    data = {"args": options, "summary": summary, "baseline": baseline,
            "timeline": run.timeline,
            "requests": [{"prompt_len": r.prompt_len, "max_tokens": r.max_tokens, "output_len": r.output_len,
                          "send_time": r.send_time, "ttft": r.ttft, "e2e": r.e2e, "error": r.error}
                         for r in run.results]}
    Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result_json).write_text(json.dumps(data, indent=2, default=str))
