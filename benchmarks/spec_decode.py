"""Speculative decoding (n-gram proposals), measured: decode tokens/s with and without it, in one run.

Three workloads, all greedy, on the bundled model through the offline API:
- **input-grounded**: the model is asked (its chat template) to copy out, or lightly edit, a
  passage of real English it is given (windows of the corpus the other benchmarks use): outputs
  that copy from the prompt, where prompt lookup finds its drafts;
- **json-extraction**: the model is given a record (a name, a city, a title and a quote from the
  corpus) and returns it as JSON under a JSON schema (structured outputs): drafts copied from the
  prompt must also satisfy the grammar, and each draft position samples under its own mask;
- **plain**: the offline benchmark's workload (continuations of windows of text), where drafts
  are rarely right: speculation must cost little there.
Each at 1 stream and `--streams` streams, with `num_speculative_tokens` K and without. Reported:
decode tokens/s (each batch's time less the time of its prefills alone, prefix caching off), the
speed-up, the acceptance rate, tokens per decode step, and whether the greedy outputs are identical.

Both engines are held at once and take turns batch by batch (a batch: `streams` prompts), in the
order A B, then B A for the next batch and the next round (`--rounds`, default 2). This machine's
speed drifts by 10-20% over minutes: with every baseline run first and every speculative run
minutes later, the drift landed in the ratio; runs seconds apart share it. A mode's tokens/s is
its tokens over its seconds, summed over every batch and round.

    .venv/bin/python benchmarks/spec_decode.py                              # ~8 minutes
    .venv/bin/python benchmarks/spec_decode.py --max-tokens 16 --passages 2 --rounds 1 # smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import sys
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.offline_throughput import MODEL, Stopwatch  # noqa: E402
from pagedserve import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from pagedserve.bench.dataset import corpus_text  # noqa: E402

INSTRUCTIONS = ("Copy the following text exactly, word for word:\n\n{}",
                "Rewrite the following text with every sentence kept, fixing any typos:\n\n{}")
RECORD_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "city", "title", "quote"],
                 "properties": {key: {"type": "string"} for key in ("name", "city", "title", "quote")}}
NAMES = ("Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov", "Donald Knuth")
CITIES = ("London", "Manchester", "Arlington", "Amsterdam", "Boston", "Stanford")
TITLES = ("analyst", "mathematician", "rear admiral", "professor", "engineer", "author")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=MODEL)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--passages", type=int, default=8, help="requests per workload")
    p.add_argument("--passage-tokens", type=int, default=160, help="tokens of each passage")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--streams", type=int, default=4, help="the batched case's concurrent requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2,
                   help="passes of both engines over every case (taking turns batch by batch)")
    p.add_argument("--result-json", default="benchmarks/results/spec_decode.json")
    return p.parse_args(argv)


def _chat(tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                              add_generation_prompt=True, return_dict=False))


def workloads(tokenizer, args) -> dict[str, tuple[list[list[int]], StructuredOutputsParams | None]]:
    """name -> (prompts, the structured output they are sampled under, if any)."""
    corpus = tokenizer.encode(corpus_text(), add_special_tokens=False)
    rng = random.Random(args.seed)
    windows = []
    for _ in range(args.passages):
        start = rng.randint(0, len(corpus) - args.passage_tokens)
        windows.append(corpus[start:start + args.passage_tokens])
    grounded = [_chat(tokenizer, INSTRUCTIONS[i % len(INSTRUCTIONS)].format(tokenizer.decode(window)))
                for i, window in enumerate(windows)]
    records = []
    for i, window in enumerate(windows):
        quote = " ".join(tokenizer.decode(window[:48]).replace('"', "'").split())
        records.append(_chat(tokenizer, "Return this record as a JSON object with the keys name, city, title and "
                                        f"quote, each value copied exactly:\n\nname: {NAMES[i % len(NAMES)]}\n"
                                        f"city: {CITIES[i % len(CITIES)]}\ntitle: {TITLES[i % len(TITLES)]}\n"
                                        f"quote: {quote}"))
    schema = StructuredOutputsParams(json=RECORD_SCHEMA, disable_any_whitespace=True)
    return {"input-grounded": (grounded, None), "json-extraction": (records, schema), "plain": (windows, None)}


def run(llm: LLM, prompts: list[list[int]], streams: int, max_tokens: int,
        structured: StructuredOutputsParams | None = None) -> tuple[dict, list]:
    """Decode tokens/s over the prompts, `streams` at a time (the time of the same batches with
    max_tokens 1, their prefills, taken off: prefix caching is off); the greedy outputs."""
    with Stopwatch() as prefill:
        for i in range(0, len(prompts), streams):
            llm.generate([{"prompt_token_ids": p} for p in prompts[i:i + streams]],
                         SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=structured)
    before = llm.stats()
    outputs, tokens = [], 0
    with Stopwatch() as watch:
        for i in range(0, len(prompts), streams):
            batch = llm.generate([{"prompt_token_ids": p} for p in prompts[i:i + streams]], params, use_tqdm=False)
            outputs += [list(o.outputs[0].token_ids) for o in batch]
            tokens += sum(len(o.outputs[0].token_ids) for o in batch)
    watch.seconds -= prefill.seconds
    tokens -= len(prompts)  # the first token of each came with its prefill
    after = llm.stats()
    drafted = after.get("spec_draft_tokens_total", 0) - before.get("spec_draft_tokens_total", 0)
    accepted = after.get("spec_accepted_tokens_total", 0) - before.get("spec_accepted_tokens_total", 0)
    return {"tokens": tokens, "seconds": watch.seconds, "tokens_per_s": tokens / watch.seconds,
            "other_cpu_share": watch.other_cpu_share, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None}, outputs


def _add(total: dict, r: dict) -> None:
    """Fold one batch's figures for a mode into its totals: tokens/s as tokens over seconds."""
    for field in ("tokens", "seconds", "draft_tokens", "accepted_tokens"):
        total[field] = total.get(field, 0) + r[field]
    total["tokens_per_s"] = total["tokens"] / total["seconds"]
    total["acceptance_rate"] = total["accepted_tokens"] / total["draft_tokens"] if total["draft_tokens"] else None
    total["other_cpu_share"] = max(total.get("other_cpu_share", 0.0), r["other_cpu_share"])


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1; got {args.rounds}")
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}
    results, outputs = {}, {}
    with contextlib.ExitStack() as stack:
        engines = {"baseline": stack.enter_context(LLM(args.model, enable_prefix_caching=False)),
                   "ngram": stack.enter_context(LLM(args.model, enable_prefix_caching=False, speculative_config=spec))}
        loads = workloads(engines["baseline"].get_tokenizer(), args)
        for llm in engines.values():  # warm-up
            llm.generate([{"prompt_token_ids": loads["plain"][0][0]}], SamplingParams(max_tokens=4), use_tqdm=False)
        for round_ in range(args.rounds):
            for name, (prompts, structured) in loads.items():
                for streams in (1, args.streams):
                    key = f"{name}/{streams}"
                    for b, start in enumerate(range(0, len(prompts), streams)):
                        # A B, then B A: runs next to each other share the machine's speed of the moment.
                        for mode in list(engines)[::1 if (round_ + b) % 2 == 0 else -1]:
                            r, out = run(engines[mode], prompts[start:start + streams], streams, args.max_tokens,
                                         structured)
                            _add(results.setdefault(key, {}).setdefault(mode, {}), r)
                            outputs.setdefault((key, mode, round_), []).extend(out)
                    so_far = results[key]
                    print(f"round {round_ + 1} {key:<18} so far: baseline {so_far['baseline']['tokens_per_s']:7.1f} "
                          f"tok/s, ngram {so_far['ngram']['tokens_per_s']:7.1f} tok/s, acceptance "
                          f"{so_far['ngram']['acceptance_rate']}", flush=True)
    for key, r in results.items():
        r["speedup"] = r["ngram"]["tokens_per_s"] / r["baseline"]["tokens_per_s"]
        r["identical_outputs"] = all(outputs[(key, "ngram", i)] == outputs[(key, "baseline", 0)]
                                     and outputs[(key, "baseline", i)] == outputs[(key, "baseline", 0)]
                                     for i in range(args.rounds))
        steps = r["ngram"]["tokens"] - r["ngram"]["accepted_tokens"]  # each step: one token, plus what it accepted
        r["ngram"]["mean_tokens_per_step"] = r["ngram"]["tokens"] / steps if steps else None
    res = {"args": vars(args), "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
           "results": results}
    Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result_json).write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(f"{'workload/streams':<20}{'base tok/s':>11}{'ngram tok/s':>12}{'speed-up':>9}{'accept':>8}"
          f"{'tok/step':>9}{'same':>6}")
    for key, r in results.items():
        acc = r["ngram"]["acceptance_rate"]
        print(f"{key:<20}{r['baseline']['tokens_per_s']:>11.1f}{r['ngram']['tokens_per_s']:>12.1f}"
              f"{r['speedup']:>9.2f}{'-' if acc is None else f'{acc:.2f}':>8}"
              f"{r['ngram']['mean_tokens_per_step'] or 0:>9.2f}{'yes' if r['identical_outputs'] else 'no':>6}")
    print(f"results: {args.result_json}")


if __name__ == "__main__":
    main()
