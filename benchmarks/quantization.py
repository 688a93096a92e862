"""int8 weights, measured: throughput against fp32 and bf16 in one run, and what they cost in accuracy.

Throughput: offline `LLM.generate` on the offline benchmark's workload (windows of real English
as prompts, seeded output lengths, EOS ignored), once per weight format: fp32, bf16, and int8
(`quantization="int8"`: the decoder's linears as int8 rows with per-channel scales; activations
and KV in fp32), plus a single stream (one request, `--single-tokens` output tokens), where
decode is bound by streaming the weights. Accuracy, on held-out text (other windows of the same
corpus): the mean absolute difference of each position's logprob of the true next token against
fp32 (teacher-forced, `prompt_logprobs`), the share of positions whose top-1 token equals fp32's,
and free-running greedy agreement (tokens equal to fp32's before the first difference).

    .venv/bin/python benchmarks/quantization.py                                       # ~10 minutes
    .venv/bin/python benchmarks/quantization.py --num-requests 4 --prompt-len-max 60 \\
        --output-len-max 8 --single-tokens 8 --eval-windows 2 --eval-len 32          # smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.offline_throughput import (  # noqa: E402
    MODEL, Stopwatch, add_workload_args, check_workload_args, make_workload, useful_tokens)
from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.bench.dataset import corpus_text  # noqa: E402

FORMATS = {"fp32": dict(dtype="float32"), "bf16": dict(dtype="bfloat16"),
           "int8": dict(dtype="float32", quantization="int8")}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(p)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--single-tokens", type=int, default=128, help="output tokens of the single stream")
    p.add_argument("--eval-windows", type=int, default=8, help="held-out windows for the accuracy figures")
    p.add_argument("--eval-len", type=int, default=256, help="tokens per held-out window")
    p.add_argument("--greedy-tokens", type=int, default=64, help="free-running greedy tokens per window")
    p.add_argument("--result-json", default="benchmarks/results/quantization.json")
    args = check_workload_args(p, p.parse_args(argv))
    args.dtype = "float32"  # each format sets its own
    return args


def held_out(tokenizer, args) -> list[list[int]]:
    """Windows from the corpus's second half, apart from the workload's seed stream."""
    corpus = tokenizer.encode(corpus_text(), add_special_tokens=False)
    rng = random.Random(args.seed + 7919)
    half = len(corpus) // 2
    starts = [rng.randint(half, len(corpus) - args.eval_len) for _ in range(args.eval_windows)]
    return [corpus[s:s + args.eval_len] for s in starts]


def measure(name: str, args, requests, windows) -> dict:
    engine = dict(model=args.model, kv_cache_memory=args.kv_cache_memory, block_size=args.block_size,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    with LLM(**engine, **FORMATS[name]) as llm:
        prompts = [{"prompt_token_ids": r.prompt_ids} for r in requests]
        params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in requests]
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # first-call costs
        with Stopwatch() as batch:
            llm.generate(prompts, params, use_tqdm=False)
        single_params = SamplingParams(max_tokens=args.single_tokens, temperature=0.0, ignore_eos=True)
        with Stopwatch() as single:
            llm.generate([prompts[0]], [single_params], use_tqdm=False)
        scored = llm.generate([{"prompt_token_ids": w} for w in windows],
                              SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
        greedy = llm.generate([{"prompt_token_ids": w[:args.eval_len // 2]} for w in windows],
                              SamplingParams(max_tokens=args.greedy_tokens, temperature=0.0, ignore_eos=True),
                              use_tqdm=False)
    prompt, output = useful_tokens(requests)
    true_logprobs, top1 = [], []
    for window, out in zip(windows, scored):
        for i, step in enumerate(out.prompt_logprobs[1:]):
            true_logprobs.append(step[window[i + 1]].logprob)
            top1.append(next(t for t, lp in step.items() if lp.rank == 1))
    return {"batch_s": batch.seconds, "batch_other_cpu_share": batch.other_cpu_share,
            "output_tokens_per_s": output / batch.seconds, "total_tokens_per_s": (prompt + output) / batch.seconds,
            "single_stream_tokens_per_s": args.single_tokens / single.seconds,
            "true_logprobs": true_logprobs, "top1": top1,
            "greedy": [list(o.outputs[0].token_ids) for o in greedy]}


def compare(base: dict, other: dict) -> dict:
    diffs = [abs(a - b) for a, b in zip(base["true_logprobs"], other["true_logprobs"])]
    same_top1 = sum(a == b for a, b in zip(base["top1"], other["top1"]))
    prefix = []
    for a, b in zip(base["greedy"], other["greedy"]):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(n / max(1, len(a)))
    return {"logprob_mean_abs_diff": sum(diffs) / len(diffs), "logprob_max_abs_diff": max(diffs),
            "top1_agreement": same_top1 / len(base["top1"]),
            "greedy_prefix_agreement": sum(prefix) / len(prefix),
            "greedy_identical": sum(p == 1.0 for p in prefix) / len(prefix)}


def main(argv=None) -> None:
    args = parse_args(argv)
    from pagedserve.config import resolve_model
    from workers.gguf_cache import load_tokenizer

    source = resolve_model(args.model)
    tokenizer = load_tokenizer(source)
    requests, windows = make_workload(tokenizer, args), held_out(tokenizer, args)
    runs = {}
    for name in FORMATS:
        runs[name] = measure(name, args, requests, windows)
        gc.collect()
        print(f"{name}: {runs[name]['output_tokens_per_s']:.1f} output tok/s, single stream "
              f"{runs[name]['single_stream_tokens_per_s']:.1f} tok/s", flush=True)
    base = runs["fp32"]
    report = {name: {k: v for k, v in r.items() if k not in ("true_logprobs", "top1", "greedy")}
              | {"throughput_vs_fp32": r["output_tokens_per_s"] / base["output_tokens_per_s"],
                 "single_stream_vs_fp32": r["single_stream_tokens_per_s"] / base["single_stream_tokens_per_s"]}
              | ({} if name == "fp32" else {"accuracy_vs_fp32": compare(base, r)})
              for name, r in runs.items()}
    res = {"args": vars(args), "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                           "torch": torch.__version__}, "formats": report}
    Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result_json).write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(f"{'format':<7}{'out tok/s':>10}{'x fp32':>8}{'1-stream':>10}{'x fp32':>8}{'|dlogp|':>9}"
          f"{'top-1 agr':>10}{'greedy agr':>11}")
    for name, r in report.items():
        acc = r.get("accuracy_vs_fp32", {})
        print(f"{name:<7}{r['output_tokens_per_s']:>10.1f}{r['throughput_vs_fp32']:>8.2f}"
              f"{r['single_stream_tokens_per_s']:>10.1f}{r['single_stream_vs_fp32']:>8.2f}"
              f"{acc.get('logprob_mean_abs_diff', 0):>9.4f}{acc.get('top1_agreement', 1):>10.3f}"
              f"{acc.get('greedy_prefix_agreement', 1):>11.3f}")
    print(f"results: {args.result_json}")


if __name__ == "__main__":
    main()
