"""Decode speed with the model's weights on transparent huge pages (workers/huge_pages.py) against
the same engine with its weights left on the 4 KiB pages they were loaded into, in one run.

A decode step of a few rows streams every weight once, so its speed is the memory system's; a
page walk every 4 KiB of it is what huge pages take away. Each round builds the offline engine
twice, alternating which goes first, and times greedy decodes of `--output-len` tokens at each
stream count (`--streams`, default 1 and 4) after a warm-up. The 4 KiB engine is the same code
with the kernel's THP mode read as "unavailable" (nothing moved).

    .venv/bin/python benchmarks/huge_pages.py                # SmolLM2 fp32, ~3 minutes here
    .venv/bin/python benchmarks/huge_pages.py --model /tmp/tiny --rounds 1 --output-len 8
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve import LLM, SamplingParams  # noqa: E402
from workers import huge_pages  # noqa: E402

SIDES = ("4k", "huge")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--streams", default="1,4", help="comma-separated numbers of concurrent decodes")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--result-json", default="benchmarks/results/huge_pages.json")
    args = p.parse_args(argv)
    args.streams = [int(s) for s in args.streams.split(",")]
    if args.rounds < 1 or args.output_len < 1 or args.prompt_len < 1 or min(args.streams) < 1:
        p.error("--rounds, --output-len, --prompt-len and every --streams value must be >= 1")
    return args


def time_side(args, huge: bool) -> dict[int, float]:
    """Output tokens/s at each stream count, for one engine with or without huge-page weights."""
    saved = huge_pages.THP_SETTING
    if not huge:
        huge_pages.THP_SETTING = "/nonexistent"  # read as "unavailable": nothing is moved
    try:
        llm = LLM(model=args.model, dtype=args.dtype, kv_cache_memory=1 << 28)
    finally:
        huge_pages.THP_SETTING = saved
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    rates = {}
    for streams in args.streams:
        prompts = [{"prompt_token_ids": [100 + s + i for i in range(args.prompt_len)]} for s in range(streams)]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        rates[streams] = streams * args.output_len / (time.perf_counter() - start)
    llm.shutdown()
    del llm
    gc.collect()
    return rates


def main(argv=None) -> None:
    args = parse_args(argv)
    print(f"THP mode: {huge_pages.transparent_huge_pages()}")
    runs: dict[str, list[dict[int, float]]] = {side: [] for side in SIDES}
    for r in range(args.rounds):
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        for side in order:
            runs[side].append(time_side(args, huge=side == "huge"))
            print(f"round {r + 1} {side:>4}: " + ", ".join(f"{s} streams {v:.1f} tok/s"
                                                           for s, v in runs[side][-1].items()), flush=True)
    summary = {}
    for streams in args.streams:
        med = {side: statistics.median(run[streams] for run in runs[side]) for side in SIDES}
        summary[streams] = {**{f"{side}_tok_s": round(med[side], 2) for side in SIDES},
                            "ratio": round(med["huge"] / med["4k"], 3)}
        print(f"{streams} streams: 4 KiB {med['4k']:.1f} tok/s, huge pages {med['huge']:.1f} tok/s, "
              f"{summary[streams]['ratio']:.3f}x (medians of {args.rounds})")
    out = Path(args.result_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "thp_mode": huge_pages.transparent_huge_pages(),
                               "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                               "runs": {side: [{str(k): round(v, 2) for k, v in run.items()} for run in runs[side]]
                                        for side in SIDES},
                               "summary": {str(k): v for k, v in summary.items()}}, indent=2))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
