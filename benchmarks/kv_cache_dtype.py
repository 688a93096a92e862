"""A bf16 KV cache under the fp32 model (`kv_cache_dtype="bfloat16"`), against the fp32 cache, in
one run: what half the bytes per block buys and what the rounding costs.

- capacity: KV blocks in the same `--kv-cache-memory`;
- long contexts: `--seqs` greedy sequences with prompts of `--prompt-len` tokens and
  `--output-len` outputs each (attention reads every context token per step: the cache's bytes
  are what it streams), wall time and output tokens/s, fp32 and bf16 cache runs interleaved
  `--repeats` times;
- a tight pool: the same workload in `--tight-memory` bytes, where the fp32 cache preempts (and
  recomputes) and the bf16 one holds twice the tokens;
- accuracy: greedy agreement of the two caches' outputs on real English prompts, and the mean
  absolute difference of the generated tokens' logprobs (the bf16 cache scoring the fp32
  cache's continuation: prompt logprobs over prompt + output).

    .venv/bin/python benchmarks/kv_cache_dtype.py            # SmolLM2 fp32, ~5 minutes here
    .venv/bin/python benchmarks/kv_cache_dtype.py --smoke --model /tmp/tiny
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve import LLM, SamplingParams  # noqa: E402

MiB = 1 << 20
CACHES = ("auto", "bfloat16")
ENGLISH = [
    "The history of the printing press begins in the fifteenth century, when",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain, step by step, how a hash table handles collisions.",
    "The three most important causes of the French Revolution were",
    "Summarize the plot of Romeo and Juliet in four sentences.",
    "Here is a recipe for a simple tomato soup. Ingredients:",
    "A good code review looks for the following things:",
    "The water cycle describes how water moves between the oceans, the air and the land:",
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    p.add_argument("--tight-memory", type=int, default=None,
                   help="KV pool bytes of the tight run (default: 60%% of what the fp32 cache needs)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--accuracy-tokens", type=int, default=64)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat")
    p.add_argument("--result-json", default=None, help="default benchmarks/results/kv_cache_dtype[_smoke].json")
    args = p.parse_args(argv)
    if args.smoke:
        args.seqs, args.prompt_len, args.output_len, args.repeats, args.accuracy_tokens = 4, 64, 8, 1, 8
    args.result_json = args.result_json or f"benchmarks/results/kv_cache_dtype{'_smoke' if args.smoke else ''}.json"
    return args


def prompts(args) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randint(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.seqs)]


def timed_run(args, cache: str, memory: int) -> dict:
    with LLM(args.model, kv_cache_memory=memory, kv_cache_dtype=cache) as llm:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts(args)], params, use_tqdm=False)
        wall = time.perf_counter() - start
        stats = llm.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"wall_s": wall, "output_tokens_per_s": tokens / wall, "kv_blocks_total": stats["kv_blocks_total"],
            "preemptions": stats["num_preemptions"], "outputs": [o.outputs[0].token_ids for o in outs]}


def accuracy(args) -> dict:
    """Greedy continuations under each cache; then the bf16 cache scores the fp32 one's tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=args.accuracy_tokens, logprobs=0)
    runs = {}
    for cache in CACHES:
        with LLM(args.model, kv_cache_dtype=cache) as llm:
            tok = llm.get_tokenizer()
            ids = [tok.encode(t) for t in ENGLISH]
            runs[cache] = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    agree = prefix = total = 0
    for a, b in zip(runs["auto"], runs["bfloat16"]):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        agree += ta == tb
        prefix += next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        total += len(ta)
    diffs = []
    with LLM(args.model, kv_cache_dtype="bfloat16") as llm:
        score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        for ids, ref in zip(ids, runs["auto"]):
            out = ref.outputs[0]
            full = list(ids) + list(out.token_ids)
            got = llm.generate([{"prompt_token_ids": full}], score, use_tqdm=False)[0].prompt_logprobs
            for pos, (tok_id, entry) in enumerate(zip(out.token_ids, out.logprobs)):
                diffs.append(abs(got[len(ids) + pos][tok_id].logprob - entry[tok_id].logprob))
    return {"prompts": len(ENGLISH), "identical_outputs": agree, "agreeing_tokens": prefix, "tokens": total,
            "logprob_mean_abs_diff": statistics.fmean(diffs), "logprob_max_abs_diff": max(diffs)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    fp32_need = args.seqs * -(-(args.prompt_len + args.output_len) // 16) * 16  # tokens in whole blocks
    runs = {"long": {c: [] for c in CACHES}, "tight": {}}
    for _ in range(args.repeats):  # interleaved: this machine's speed drifts within minutes
        for cache in CACHES:
            runs["long"][cache].append(timed_run(args, cache, args.kv_cache_memory))
    block_bytes = args.kv_cache_memory // runs["long"]["auto"][0]["kv_blocks_total"]  # an fp32 block's, to a byte
    tight = args.tight_memory or int(0.6 * fp32_need // 16 * block_bytes)
    for cache in CACHES:
        runs["tight"][cache] = timed_run(args, cache, tight)
    long_best = {c: min(r["wall_s"] for r in runs["long"][c]) for c in CACHES}
    report = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "args": {k: v for k, v in vars(args).items()},
        "kv_blocks_per_gib": {c: runs["long"][c][0]["kv_blocks_total"] * (1 << 30) // args.kv_cache_memory
                              for c in CACHES},
        "long_contexts": {c: {"wall_s": [r["wall_s"] for r in runs["long"][c]],
                              "output_tokens_per_s_best": args.seqs * args.output_len / long_best[c]}
                          for c in CACHES},
        "long_speedup": long_best["auto"] / long_best["bfloat16"],
        "long_identical_outputs": sum(a == b for a, b in zip(runs["long"]["auto"][0]["outputs"],
                                                              runs["long"]["bfloat16"][0]["outputs"])),
        "tight": {"kv_cache_memory": tight, **{c: {k: v for k, v in runs["tight"][c].items() if k != "outputs"}
                                                for c in CACHES}},
        "tight_speedup": runs["tight"]["auto"]["wall_s"] / runs["tight"]["bfloat16"]["wall_s"],
        "accuracy": accuracy(args),
    }
    Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result_json).write_text(json.dumps(report, indent=2) + "\n")
    lc, t, a = report["long_contexts"], report["tight"], report["accuracy"]
    print(f"KV blocks per GiB: fp32 {report['kv_blocks_per_gib']['auto']}, bf16 {report['kv_blocks_per_gib']['bfloat16']}")
    print(f"{args.seqs} x {args.prompt_len}+{args.output_len} tokens: fp32 cache "
          f"{', '.join(f'{w:.2f}' for w in lc['auto']['wall_s'])} s, bf16 cache "
          f"{', '.join(f'{w:.2f}' for w in lc['bfloat16']['wall_s'])} s: {report['long_speedup']:.2f}x "
          f"(best of each), outputs identical {report['long_identical_outputs']}/{args.seqs}")
    print(f"tight pool of {tight / MiB:.1f} MiB: fp32 cache {t['auto']['wall_s']:.2f} s "
          f"({t['auto']['preemptions']} preemptions), bf16 cache {t['bfloat16']['wall_s']:.2f} s "
          f"({t['bfloat16']['preemptions']} preemptions): {report['tight_speedup']:.2f}x")
    print(f"accuracy: {a['identical_outputs']}/{a['prompts']} greedy outputs identical, {a['agreeing_tokens']}/"
          f"{a['tokens']} tokens before the first difference; logprob |diff| mean {a['logprob_mean_abs_diff']:.4f}, "
          f"max {a['logprob_max_abs_diff']:.4f}")
    print(f"results: {args.result_json}")
    return report


if __name__ == "__main__":
    main()
