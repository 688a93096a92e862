"""`pagedserve bench`: send a workload to a server (or an embedded one), print and save the figures."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from pathlib import Path

from pagedserve.config import EngineConfig


def add_bench_arguments(p) -> None:
    p.add_argument("--embedded", action="store_true",
                   help="start `pagedserve serve` with the engine flags given here, bench it, stop it")
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
    from pagedserve.bench.dataset import load_jsonl, synthetic

    if args.dataset == "synthetic":
        return synthetic(tokenizer, args.num_prompts, args.input_range, args.output_range,
                         args.length_distribution, args.bench_seed, args.shared_prefix_len)
    if not Path(args.dataset).is_file():
        raise ValueError(f"--dataset must be 'synthetic' or a JSONL file; {args.dataset!r} is neither")
    return load_jsonl(args.dataset, tokenizer, args.max_tokens, args.num_prompts)


def _engine_flags(args) -> dict:
    """The engine flags given on the command line that differ from the defaults."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
            if getattr(args, f.name) != f.default}


def run_bench(args, api_key: str | None) -> int:
    from transformers import AutoTokenizer

    from pagedserve.bench.embedded import EmbeddedServer
    from pagedserve.bench.report import format_table, summarize
    from pagedserve.bench.runner import run_workload
    from pagedserve.config import resolve_model

    try:
        _check(args)
        source = resolve_model(args.model)
        tokenizer = AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file)
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
        run = asyncio.run(run_workload(target, requests, args.request_rate, args.max_concurrency, args.bench_seed,
                                       api_key, args.temperature, progress=not args.no_progress,
                                       credentials=_credentials(args)))
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
            baseline["identical_outputs"] = sum(r.token_ids == o for r, o in zip(run.results, outputs))
    print(format_table(summary, baseline))
    if args.plot_dir:
        from pagedserve.bench.plots import write_plots

        for path in write_plots(run, args.plot_dir):
            print(f"plot: {path}")
    if args.result_json:
        _write_json(args, summary, baseline, run)
        print(f"figures: {args.result_json}")
    return 0 if summary["failed"] == 0 else 1


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
