"""The `pagedserve` command. Every engine knob of `EngineConfig` is a flag, generated from it."""

from __future__ import annotations

import argparse
import dataclasses
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM serving with a paged KV cache")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the engine (for now: an offline demo that streams a few prompts)")
    add_engine_flags(serve)
    serve.add_argument("--max-tokens", type=int, default=48, help="tokens generated per demo prompt")
    serve.add_argument("--prompt", action="append", help="a demo prompt (repeatable)")

    gen = sub.add_parser("generate", help="send a prompt to a running server")
    gen.add_argument("prompt")
    gen.add_argument("--target", default="127.0.0.1:50051", help="server address (default: %(default)s)")
    gen.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--timeout", type=float, default=None, help="seconds before the request is abandoned")

    stats = sub.add_parser("stats", help="print a running server's stats")
    stats.add_argument("--target", default="127.0.0.1:50051")
    return parser


def run_generate(args) -> int:
    from pagedserve.client import Client, ServingError

    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    try:
        with Client(args.target, timeout=args.timeout) as client:
            if args.stream:
                for chunk in client.stream(prompt, **sampling):
                    print(chunk.text, end="", flush=True)
                print()
            else:
                print(client.generate(prompt, **sampling).text)
    except ServingError as e:
        print(f"pagedserve: {e.code.name}: {e.details}", file=sys.stderr)
        return 1
    return 0


def run_stats(args) -> int:
    from pagedserve.client import Client, ServingError

    try:
        with Client(args.target, timeout=10) as client:
            stats = client.stats()
    except ServingError as e:
        print(f"pagedserve: {e.code.name}: {e.details}", file=sys.stderr)
        return 1
    for key in sorted(stats):
        print(f"{key} {stats[key]:g}")
    return 0


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
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"pagedserve: error: {e}", file=sys.stderr)
        return 2
    if args.command == "serve":
        run_demo(config, args.prompt or DEMO_PROMPTS, args.max_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
