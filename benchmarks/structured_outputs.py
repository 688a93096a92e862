"""Structured outputs on the bundled SmolLM2 (fp32), measured in one run:

1. overhead: the decode step time of 32 sequences constrained by a JSON schema against the same 32
   unconstrained (same prompts, temperature 0.7, EOS ignored, so both batches stay 32 for every
   step), rounds alternated so that a busy machine slows both alike; and where the extra time
   goes: the coordinator's masks (llguidance), the worker's unpack and -inf fill, the matchers'
   advance;
2. validity: a set of real-world JSON schemas (nested objects, enums, arrays, bounded numbers,
   required fields, patterns; strict as OpenAI's structured outputs want them), each asked for
   through the chat template at temperature 0.7, several seeds: the share of outputs that parse
   and validate (jsonschema), with and without the schema enforced.

    .venv/bin/python benchmarks/structured_outputs.py
    .venv/bin/python benchmarks/structured_outputs.py --batch 4 --decode-tokens 8 --rounds 1 --samples 1   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import jsonschema  # noqa: E402
import torch  # noqa: E402

import offline_throughput as workload  # noqa: E402
from pagedserve import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

# A long list of records: no sequence completes it within the decode window, so the constrained
# batch stays full, and JSON masks are the costly kind (a lexer and a parser per token).
RECORDS = {"type": "array", "minItems": 100, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "tags"],
    "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                   "tags": {"type": "array", "items": {"type": "string"}}}}}

SCHEMAS = {
    "person": ("a person with their name, age and email address",
               {"type": "object", "required": ["name", "age", "email"],
                "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
                               "email": {"type": "string", "pattern": "^[^@ ]+@[^@ ]+\\.[a-z]{2,}$"}}}),
    "product": ("a product in an online shop",
                {"type": "object", "required": ["sku", "name", "price", "in_stock", "tags"],
                 "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                "name": {"type": "string"},
                                "price": {"type": "number", "minimum": 0, "maximum": 10000},
                                "in_stock": {"type": "boolean"},
                                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}}}),
    "address": ("a postal address in the United States",
                {"type": "object", "required": ["street", "city", "state", "zip"],
                 "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                "state": {"type": "string", "enum": ["CA", "NY", "TX", "WA", "FL"]},
                                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}),
    "event": ("a meeting with its title, day and attendees",
              {"type": "object", "required": ["title", "day", "attendees"],
               "properties": {"title": {"type": "string"},
                              "day": {"enum": ["monday", "tuesday", "wednesday", "thursday", "friday"]},
                              "attendees": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
                                  "type": "object", "required": ["name", "role"],
                                  "properties": {"name": {"type": "string"},
                                                 "role": {"enum": ["host", "guest", "optional"]}}}}}}),
    "weather": ("a weather forecast for a city over three days",
                {"type": "object", "required": ["city", "unit", "days"],
                 "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
                                "days": {"type": "array", "minItems": 3, "maxItems": 3, "items": {
                                    "type": "object", "required": ["high", "low", "sky"],
                                    "properties": {"high": {"type": "number", "minimum": -60, "maximum": 60},
                                                   "low": {"type": "number", "minimum": -60, "maximum": 60},
                                                   "sky": {"enum": ["sunny", "cloudy", "rain", "snow"]}}}}}}),
    "order": ("a customer's order with two line items",
              {"type": "object", "required": ["order_id", "customer", "items", "total"],
               "properties": {"order_id": {"type": "integer", "minimum": 1},
                              "customer": {"type": "object", "required": ["name", "vip"],
                                           "properties": {"name": {"type": "string"}, "vip": {"type": "boolean"}}},
                              "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
                                  "type": "object", "required": ["sku", "quantity", "unit_price"],
                                  "properties": {"sku": {"type": "string"},
                                                 "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                                                 "unit_price": {"type": "number", "minimum": 0}}}},
                              "total": {"type": "number", "minimum": 0}}}),
    "review": ("a short review of a film",
               {"type": "object", "required": ["title", "year", "rating", "genres", "summary"],
                "properties": {"title": {"type": "string"},
                               "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                               "rating": {"type": "number", "minimum": 0, "maximum": 10},
                               "genres": {"type": "array", "minItems": 1, "maxItems": 3,
                                          "items": {"enum": ["drama", "comedy", "action", "horror", "documentary"]}},
                               "summary": {"type": "string", "maxLength": 200}}}),
    "server": ("the configuration of a web server",
               {"type": "object", "required": ["host", "port", "tls", "workers", "routes"],
                "additionalProperties": False,
                "properties": {"host": {"type": "string"}, "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                               "tls": {"type": "boolean"}, "workers": {"type": "integer", "minimum": 1, "maximum": 64},
                               "routes": {"type": "array", "maxItems": 4, "items": {
                                   "type": "object", "required": ["path", "method"],
                                   "properties": {"path": {"type": "string", "pattern": "^/"},
                                                  "method": {"enum": ["GET", "POST", "PUT", "DELETE"]}}}}}}),
}


def strict(schema):
    """`additionalProperties: false` on every object, as OpenAI's strict structured outputs require:
    without it a schema allows any extra key, and a small model wanders off into keys of its own
    until max_tokens cuts the JSON short (measured: half the outputs of a first run)."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        if schema.get("type") == "object" and "properties" in schema:
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [strict(value) for value in schema]
    return schema


SCHEMAS = {name: (what, strict(schema)) for name, (what, schema) in SCHEMAS.items()}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32, help="sequences per batch (overhead)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=48, help="decode steps timed per round")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds of each kind")
    p.add_argument("--samples", type=int, default=4, help="seeds per schema (validity)")
    p.add_argument("--max-tokens", type=int, default=400, help="per output (validity)")
    p.add_argument("--result-json", default="benchmarks/results/structured_outputs.json")
    return p.parse_args(argv)


class Timer:
    """Seconds spent in a function, wrapped where its caller looks it up."""

    def __init__(self, owner, name: str):
        self.owner, self.name, self.seconds, self.calls = owner, name, 0.0, 0
        self.inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return self.inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        setattr(owner, name, timed)

    def take(self) -> float:
        seconds, self.seconds, self.calls = self.seconds, 0.0, 0
        return seconds


def decode_step_times(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[float]:
    """The wall time of each engine step in which all the batch decodes (no prefill chunk)."""
    engine, scheduler = llm.engine, llm.engine.scheduler
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", None, prompt, p)
    times = []
    while engine.has_unfinished_requests():
        decodes = len(scheduler.running) == len(prompts) and not scheduler.waiting and \
            all(seq.num_tokens - seq.num_computed_tokens == 1 for seq in scheduler.running)
        start = time.perf_counter()
        engine.step()
        if decodes:
            times.append(time.perf_counter() - start)
    return times


def overhead(llm: LLM, tokenizer, args) -> dict:
    import coordinator.plan_builder as plan_builder
    import coordinator.structured_output as structured_output
    import workers.worker as worker

    masks = Timer(plan_builder, "fill_bitmasks")
    apply = Timer(worker, "apply_token_bitmask")
    advance = Timer(structured_output.SequenceGrammar, "accept")
    prompts = workload.make_workload(tokenizer, argparse.Namespace(
        num_requests=args.batch, prompt_len_min=args.prompt_len, prompt_len_max=args.prompt_len,
        output_len_min=1, output_len_max=1, seed=0))
    prompts = [r.prompt_ids for r in prompts]
    # +1: the prefill samples the first token; EOS ignored, so every sequence runs them all
    common = dict(temperature=0.7, max_tokens=args.decode_tokens + 1, ignore_eos=True)
    plain = [SamplingParams(seed=i, **common) for i in range(args.batch)]
    constrained = [SamplingParams(seed=i, structured_outputs=StructuredOutputsParams(json=RECORDS), **common)
                   for i in range(args.batch)]
    for warm in (plain[0], constrained[0]):  # torch's first steps; llguidance's tokenizer and compile
        llm.generate({"prompt_token_ids": prompts[0]}, warm, use_tqdm=False)
    rows = {"unconstrained": [], "constrained": []}
    parts = {"masks_s": 0.0, "apply_s": 0.0, "advance_s": 0.0}
    steps = 0  # constrained steps that computed masks (every step of theirs)
    for _ in range(args.rounds):
        for kind, params in (("unconstrained", plain), ("constrained", constrained)):
            for t in (masks, apply, advance):
                t.take()
            rows[kind] += decode_step_times(llm, prompts, params)
            print(f"  {kind}: median decode step {statistics.median(rows[kind]) * 1e3:.1f} ms so far", flush=True)
            if kind == "constrained":
                steps += masks.calls
                parts["masks_s"] += masks.take()
                parts["apply_s"] += apply.take()
                parts["advance_s"] += advance.take()
    plain_ms = statistics.median(rows["unconstrained"]) * 1e3
    constrained_ms = statistics.median(rows["constrained"]) * 1e3
    return {"batch": args.batch, "decode_steps_timed": {k: len(v) for k, v in rows.items()},
            "step_ms_median": {"unconstrained": plain_ms, "constrained": constrained_ms},
            "step_ms_mean": {k: statistics.fmean(v) * 1e3 for k, v in rows.items()},
            "overhead_pct": (constrained_ms / plain_ms - 1) * 100,
            "per_step_ms": {k: v / steps * 1e3 for k, v in parts.items()},
            "mask_us_per_sequence": parts["masks_s"] / steps / args.batch * 1e6,
            # The same question without the noise of two wall-clock medians on shared cores: the
            # structured-output work a constrained step does, against an unconstrained step.
            "work_pct_of_unconstrained_step": sum(parts.values()) / steps * 1e3 / plain_ms * 100,
            "decode_tokens_per_s": {k: args.batch / (statistics.median(v)) for k, v in rows.items()}}


def validity(llm: LLM, args) -> dict:
    conversations, params, schemas = [], {"enforced": [], "free": []}, []
    for name, (what, schema) in SCHEMAS.items():
        ask = (f"Write {what} as a JSON object that follows this JSON schema:\n{json.dumps(schema)}\n"
               "Reply with the JSON object only.")
        for seed in range(args.samples):
            conversations.append([{"role": "user", "content": ask}])
            schemas.append((name, schema))
            common = dict(temperature=0.7, seed=seed, max_tokens=args.max_tokens)
            params["enforced"].append(SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), **common))
            params["free"].append(SamplingParams(**common))
    report = {}
    for kind, kind_params in params.items():
        start = time.perf_counter()
        outs = llm.chat(conversations, kind_params, use_tqdm=False)
        seconds = time.perf_counter() - start
        print(f"  validity, {kind}: {len(outs)} outputs in {seconds:.0f} s", flush=True)
        per_schema: dict[str, list[bool]] = {}
        failures, truncated = [], 0
        for out, (name, schema) in zip(outs, schemas):
            text = out.outputs[0].text
            truncated += out.outputs[0].finish_reason == "length"
            ok = valid(text, schema)
            per_schema.setdefault(name, []).append(ok)
            if not ok and len(failures) < 4:
                failures.append({"schema": name, "finish_reason": out.outputs[0].finish_reason, "text": text[:300]})
        results = [ok for oks in per_schema.values() for ok in oks]
        report[kind] = {"outputs": len(results), "valid": sum(results), "valid_pct": 100 * sum(results) / len(results),
                        "truncated_at_max_tokens": truncated, "seconds": seconds,
                        "valid_per_schema": {name: f"{sum(oks)}/{len(oks)}" for name, oks in per_schema.items()},
                        "examples_of_failures": failures}
    return report


def valid(text: str, schema: dict) -> bool:
    """Parses as JSON (a fenced block counts: an unconstrained model wraps its answer) and validates."""
    text = text.strip()
    if text.startswith("```"):
        text = text.strip("`").removeprefix("json").strip()
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer, _ = workload.load_tokenizer_and_config()
    res = {"args": vars(args), "model": workload.MODEL, "dtype": "float32",
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                       "load_average_at_start": os.getloadavg()}}
    with LLM(workload.MODEL, kv_cache_memory=1 << 30, max_num_seqs=max(args.batch, 64)) as llm:
        res["overhead"] = overhead(llm, tokenizer, args)
        res["machine"]["load_average_after_overhead"] = os.getloadavg()
        write_json(res, args.result_json)  # a part at a time: the validity runs take minutes
        res["validity"] = validity(llm, args)
    res["machine"]["load_average_at_end"] = os.getloadavg()
    write_json(res, args.result_json)
    o = res["overhead"]
    print(f"step time at batch {o['batch']}: {o['step_ms_median']['unconstrained']:.1f} ms unconstrained, "
          f"{o['step_ms_median']['constrained']:.1f} ms constrained: overhead {o['overhead_pct']:+.1f}% "
          f"(masks {o['per_step_ms']['masks_s']:.2f} ms, unpack+fill {o['per_step_ms']['apply_s']:.2f} ms, "
          f"advance {o['per_step_ms']['advance_s']:.2f} ms per step, {o['work_pct_of_unconstrained_step']:.1f}% of a "
          f"step; {o['mask_us_per_sequence']:.0f} us per mask)")
    for kind, v in res["validity"].items():
        print(f"validity {kind}: {v['valid']}/{v['outputs']} ({v['valid_pct']:.0f}%) parse and validate; "
              f"{v['truncated_at_max_tokens']} hit max_tokens; {v['valid_per_schema']}")
    print(f"\nwrote {args.result_json}")


def write_json(res: dict, path: str) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
