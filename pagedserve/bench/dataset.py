"""Benchmark workloads as token ids: synthetic prompts cut from real English text, or a JSONL file
of prompts or chat messages. Everything is tokenized up front, so the server and the transformers
baseline see exactly the same tokens."""

from __future__ import annotations

import importlib
import inspect
import json
import random
import warnings
from dataclasses import dataclass

CORPUS_MODULES = ("collections", "json", "os", "re", "typing", "argparse", "logging", "unittest",
                  "email", "http", "inspect", "pathlib", "functools", "itertools", "textwrap")
DISTRIBUTIONS = ("uniform", "normal", "exponential")


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: list[int]
    max_tokens: int
    # A chat request's messages; prompt_ids are then their chat-templated tokens (what the server runs).
    messages: list[dict] | None = None


def corpus_text() -> str:
    """Docstrings of stdlib modules and their public members: real English prose, no network,
    the same on every machine with the same Python."""
    seen, parts = set(), []
    with warnings.catch_warnings():  # typing.io and typing.re warn when touched
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in CORPUS_MODULES:
            module = importlib.import_module(name)
            # Submodules are left out: which ones are attributes depends on what was imported.
            members = [getattr(module, k) for k in sorted(dir(module)) if not k.startswith("_")]
            members = [m for m in members if not inspect.ismodule(m)]
            for obj in [module, *members]:
                doc = inspect.getdoc(obj)
                if doc and doc not in seen:  # re-exported objects share docstrings
                    seen.add(doc)
                    parts.append(doc)
    return "\n\n".join(parts)


def parse_range(text: str, name: str) -> tuple[int, int]:
    """'N' or 'MIN:MAX' (inclusive, MIN >= 1) -> (MIN, MAX); ValueError naming the flag."""
    try:
        parts = [int(p) for p in str(text).split(":")]
    except ValueError:
        raise ValueError(f"{name} must be N or MIN:MAX (integers); got {text!r}") from None
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or not 1 <= parts[0] <= parts[1]:
        raise ValueError(f"{name} must be N or MIN:MAX with 1 <= MIN <= MAX; got {text!r}")
    return parts[0], parts[1]


def draw_length(rng: random.Random, lo: int, hi: int, distribution: str) -> int:
    """A length in [lo, hi]: uniform; normal around the middle (sd = range / 6); or exponential
    from lo with mean a quarter of the range (many short, few long, as chat traffic)."""
    if distribution == "uniform":
        return rng.randint(lo, hi)
    if distribution == "normal":
        value = rng.gauss((lo + hi) / 2, max(hi - lo, 1) / 6)
    elif distribution == "exponential":
        value = lo + rng.expovariate(4 / max(hi - lo, 1))
    else:
        raise ValueError(f"length distribution must be one of {', '.join(DISTRIBUTIONS)}; got {distribution!r}")
    return min(hi, max(lo, round(value)))


def synthetic(tokenizer, num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int],
              distribution: str = "uniform", seed: int = 0, shared_prefix_len: int = 0) -> list[BenchRequest]:
    """Prompts are windows of the corpus at random offsets, after a common prefix of
    `shared_prefix_len` tokens when asked (a prefix-cache workload: the input length counts the
    tokens after the prefix)."""
    corpus = tokenizer.encode(corpus_text(), add_special_tokens=False)
    if shared_prefix_len < 0:
        raise ValueError(f"shared_prefix_len must be >= 0; got {shared_prefix_len}")
    if shared_prefix_len + input_len[1] > len(corpus):
        raise ValueError(f"shared prefix ({shared_prefix_len}) + input length ({input_len[1]}) exceed the "
                         f"{len(corpus)}-token corpus")
    rng = random.Random(seed)
    prefix = corpus[:shared_prefix_len]
    rest = corpus[shared_prefix_len:]
    requests = []
    for _ in range(num_prompts):
        length = draw_length(rng, *input_len, distribution)
        start = rng.randint(0, len(rest) - length)
        requests.append(BenchRequest(prefix + rest[start:start + length], draw_length(rng, *output_len, distribution)))
    return requests


def load_jsonl(path: str, tokenizer, default_max_tokens: int, num_prompts: int | None = None) -> list[BenchRequest]:
    """One request per line: {"prompt": str} or {"messages": [{"role", "content"}, ...]}, with an
    optional "max_tokens"; chat messages go through the model's chat template."""
    requests = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected an object with 'prompt' or 'messages'")
            max_tokens = row.get("max_tokens", default_max_tokens)
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
                raise ValueError(f"{where}: max_tokens must be an integer >= 1; got {max_tokens!r}")
            if isinstance(row.get("prompt"), str) and row["prompt"]:
                ids = tokenizer.encode(row["prompt"])
            elif isinstance(row.get("messages"), list) and row["messages"]:
                messages = row["messages"]
                if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                           for m in messages):
                    raise ValueError(f"{where}: each message needs string 'role' and 'content'")
                ids = list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                         return_dict=False))
            else:
                raise ValueError(f"{where}: needs a non-empty 'prompt' string or 'messages' list")
            requests.append(BenchRequest(ids, max_tokens, row.get("messages")))
            if num_prompts is not None and len(requests) == num_prompts:
                break
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests


def as_chat(requests: list[BenchRequest], tokenizer) -> list[BenchRequest]:
    """The workload for a chat endpoint: a request without messages becomes one user message of its
    prompt's text, and its prompt_ids the chat-templated tokens of that (what the server will run)."""
    out = []
    for r in requests:
        if r.messages is not None:
            out.append(r)
            continue
        messages = [{"role": "user", "content": tokenizer.decode(r.prompt_ids)}]
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        out.append(BenchRequest(list(ids), r.max_tokens, messages))
    return out
