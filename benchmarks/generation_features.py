"""Generation features on shared blocks, measured in one run on the bundled SmolLM2 (fp32):

1. parallel sampling n = 1, 4, 8 on the same prompts: peak KV blocks (against what n unshared
   copies of each sequence would hold) and generated tokens/s;
2. beam search, widths 2 and 4: pagedserve (all prompts batched) against transformers'
   `generate(num_beams=k)` (one prompt at a time) on the same prompts: seconds, tokens/s, and how
   many best beams agree;
3. priority scheduling under load: time to first token of high- and low-priority requests with
   scheduling_policy "priority" against "fcfs" on the same queue.

    .venv/bin/python benchmarks/generation_features.py
    .venv/bin/python benchmarks/generation_features.py --prompts 2 --new-tokens 4 --priority-requests 8   # smoke
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

import offline_throughput as workload  # noqa: E402
from pagedserve import LLM, SamplingParams  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--beam-tokens", type=int, default=24)
    p.add_argument("--priority-requests", type=int, default=48)
    p.add_argument("--result-json", default="benchmarks/results/generation_features.json")
    return p.parse_args(argv)


def prompts_from_corpus(tokenizer, count: int, length: int) -> list[list[int]]:
    args = argparse.Namespace(num_requests=count, prompt_len_min=length, prompt_len_max=length,
                              output_len_min=1, output_len_max=1, seed=0)
    return [r.prompt_ids for r in workload.make_workload(tokenizer, args)]


def parallel_sampling(prompts, new_tokens: int) -> list[dict]:
    rows = []
    for n in (1, 4, 8):
        with LLM(workload.MODEL, kv_cache_memory=1 << 30) as llm:
            llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2), use_tqdm=False)
            block = llm.engine.config.block_size
            params = SamplingParams(n=n, temperature=0.8, seed=0, max_tokens=new_tokens, ignore_eos=True)
            start = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            seconds = time.perf_counter() - start
            stats = llm.stats()
        generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
        unshared = sum(n * -(-(len(p) + new_tokens) // block) for p in prompts)
        rows.append({"n": n, "seconds": seconds, "generated_tokens": generated,
                     "generated_tokens_per_s": generated / seconds,
                     "peak_blocks": stats["kv_blocks_peak_used"], "unshared_blocks": unshared})
        gc.collect()
    return rows


def beam_search(prompts, new_tokens: int) -> list[dict]:
    from tests.test_beam_search import hf_beam

    hf, _ = workload.load_hf_model(torch.float32)
    rows = []
    # No prefix caching: each width computes its prompts, as transformers does.
    with LLM(workload.MODEL, kv_cache_memory=1 << 30, enable_prefix_caching=False) as llm:
        llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2), use_tqdm=False)
        for width in (2, 4):
            params = SamplingParams(use_beam_search=True, beam_width=width, max_tokens=new_tokens)
            start = time.perf_counter()
            ours = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            ours_s = time.perf_counter() - start
            start = time.perf_counter()
            theirs = [hf_beam(hf, p, width, new_tokens) for p in prompts]
            hf_s = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in ours)
            rows.append({"width": width, "pagedserve_s": ours_s, "transformers_s": hf_s,
                         "pagedserve_tokens_per_s": tokens / ours_s, "transformers_tokens_per_s": tokens / hf_s,
                         "speedup": hf_s / ours_s, "peak_blocks": llm.stats()["kv_blocks_peak_used"],
                         "identical": sum(o.outputs[0].token_ids == t for o, t in zip(ours, theirs)),
                         "prompts": len(prompts)})
    del hf
    gc.collect()
    return rows


def priority(prompts, requests: int) -> dict:
    """Every 4th request is important (priority 0), the rest not (1); all queued at once, 8 run at a time."""
    work = [prompts[i % len(prompts)][:64 + 8 * (i % 5)] for i in range(requests)]
    prio = [0 if i % 4 == 3 else 1 for i in range(requests)]
    result = {}
    for policy in ("fcfs", "priority"):
        with LLM(workload.MODEL, kv_cache_memory=1 << 30, max_num_seqs=8, scheduling_policy=policy,
                 enable_prefix_caching=False) as llm:
            llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2), use_tqdm=False)
            outs = llm.generate([{"prompt_token_ids": p} for p in work],
                                SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False,
                                priority=prio)
        ttft = {0: [], 1: []}
        for o, level in zip(outs, prio):
            ttft[level].append(o.metrics.first_token_time - o.metrics.arrival_time)
        result[policy] = {"high_ttft_mean_s": statistics.mean(ttft[0]), "low_ttft_mean_s": statistics.mean(ttft[1]),
                          "low_finished": sum(o.finished for o, lv in zip(outs, prio) if lv == 1),
                          "low_requests": prio.count(1)}
    return result


def main(argv=None) -> None:
    args = parse_args(argv)
    tokenizer, _ = workload.load_tokenizer_and_config()
    prompts = prompts_from_corpus(tokenizer, args.prompts, args.prompt_len)
    result = {"args": vars(args)}
    result["parallel_sampling"] = parallel_sampling(prompts, args.new_tokens)
    print(f"parallel sampling: {args.prompts} prompts x {args.prompt_len} tokens, {args.new_tokens} new each")
    for r in result["parallel_sampling"]:
        print(f"  n={r['n']}: {r['generated_tokens_per_s']:7.1f} gen tok/s ({r['seconds']:.2f} s), peak "
              f"{r['peak_blocks']} blocks vs {r['unshared_blocks']} unshared ({r['peak_blocks'] / r['unshared_blocks']:.2f}x)")
    result["beam_search"] = beam_search(prompts, args.beam_tokens)
    print(f"beam search: {args.prompts} prompts, {args.beam_tokens} tokens")
    for r in result["beam_search"]:
        print(f"  width {r['width']}: pagedserve {r['pagedserve_s']:.2f} s, transformers {r['transformers_s']:.2f} s "
              f"({r['speedup']:.2f}x); identical best beams {r['identical']} of {r['prompts']}")
    result["priority"] = priority(prompts, args.priority_requests)
    print(f"priority under load: {args.priority_requests} requests queued at once, 8 running at a time")
    for policy, r in result["priority"].items():
        print(f"  {policy:8s}: TTFT high {r['high_ttft_mean_s']:.2f} s, low {r['low_ttft_mean_s']:.2f} s; "
              f"low-priority finished {r['low_finished']} of {r['low_requests']}")
    workload.write_json(result, args.result_json)


if __name__ == "__main__":
    main()
