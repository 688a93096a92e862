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
    return parser


def run_demo(config: EngineConfig, prompts: list[str], max_tokens: int) -> dict:
    from coordinator.engine import LLMEngine
    from coordinator.sampling_params import SamplingParams

    print(f"loading {config.model} ...", file=sys.stderr, flush=True)
    engine = LLMEngine(config)
    tok = engine.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for i, prompt in enumerate(prompts):
        text = prompt
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True)
        engine.add_request(str(i), None, tok.encode(text), params)
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
