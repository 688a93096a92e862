"""lm-evaluation-harness against a live server: `lm_eval.simple_evaluate` with model
`local-completions` (base_url: /v1/completions; token-id prompts, batched, echo + logprobs for the
loglikelihoods) and with lm-eval's own `hf` backend on the same weights (fp32, CPU), over two small
tasks whose YAML and JSONL the test writes: a multiple-choice (loglikelihood) task and a
generate_until task. Per item the loglikelihoods agree within 1e-3 and the greedy flags, the
accuracies and the generations are equal.

lm_eval runs in a child process whose environment forbids the hub (HF_HUB_OFFLINE,
HF_DATASETS_OFFLINE, a fresh HF_HOME): everything it reads is a local file, so the test proves
that nothing is downloaded. One server for the module (the coordinator actor, TP=1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import ray

from pagedserve.config import EngineConfig
from tests.reference import hf_greedy
from tests.serving import running_coordinator

pytest.importorskip("lm_eval")

ROOT = Path(__file__).resolve().parent.parent
LOGLIKELIHOOD_TOLERANCE = 1e-3
API_BATCH_SIZE = 4  # prompts per /v1/completions request: lm-eval sends them as a list of token-id lists
HF_BATCH_SIZE = 8  # the reference backend's batches (padded); 8 rather than 1 saves seconds, same results
GEN_MAX_TOKENS = 12

QUESTIONS = [
    ("The capital of France is", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("Water freezes at a temperature of", ["zero degrees", "fifty degrees", "one hundred degrees"], 0),
    ("The largest planet in the solar system is", ["Mercury", "Jupiter", "Mars", "Venus"], 1),
    ("A week has this many days:", ["five", "six", "seven", "ten"], 2),
    ("The opposite of hot is", ["cold", "loud", "heavy"], 0),
    ("Bees make", ["honey", "steel", "glass", "paper"], 0),
    ("The color of a clear daytime sky is", ["green", "blue", "purple"], 1),
    ("Two plus two equals", ["three", "four", "five", "twenty-two"], 1),
    ("A cat says", ["moo", "woof", "meow", "quack"], 2),
    # Longer than a KV block (16 tokens): the choices of one question share full prompt blocks, which
    # a request with prompt logprobs must compute rather than take from the prefix cache.
    ("Paged attention, like virtual memory in an operating system, splits the key-value cache of "
     "every sequence being served into fixed-size", ["blocks", "bananas", "sentences"], 0),
]
GEN_PROMPTS = ["Once upon a time", "The recipe for bread:", "def fibonacci(n):", "Q: What is a GPU?\nA:",
               "In 1492, Columbus"]

MC_TASK = """\
task: pagedserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: question
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GEN_TASK = """\
task: pagedserve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: prompt
doc_to_target: target
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: {max_tokens}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""

# Run in the child: both evaluations, per-item results to a JSON file.
EVALUATE = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager

tasks_dir, out, runs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
manager = TaskManager(include_path=tasks_dir, include_defaults=False)
results = {}
for name, (model, model_args, batch_size) in runs.items():
    r = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["pagedserve_mc", "pagedserve_gen"],
                                task_manager=manager, batch_size=batch_size, bootstrap_iters=0, log_samples=True)
    results[name] = {"metrics": {t: {k: v for k, v in m.items() if isinstance(v, (int, float))}
                                 for t, m in r["results"].items()},
                     "samples": {t: sorted(([s["doc_id"], s["filtered_resps"]] for s in samples))
                                 for t, samples in r["samples"].items()}}
with open(out, "w") as f:
    json.dump(results, f)
"""


@pytest.fixture(scope="module")
def server(ray_session, tiny_llama):
    config = EngineConfig(model=tiny_llama, kv_cache_memory=1 << 22, max_num_seqs=8,
                          distributed_executor_backend="uni")
    with running_coordinator(config) as (actor, _):
        port = ray.get(actor.status.remote())["http_port"]
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    mc, gen = folder / "mc.jsonl", folder / "gen.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    gen.write_text("".join(json.dumps({"prompt": p, "target": ""}) + "\n" for p in GEN_PROMPTS))
    (folder / "pagedserve_mc.yaml").write_text(MC_TASK.format(data=mc))
    (folder / "pagedserve_gen.yaml").write_text(GEN_TASK.format(data=gen, max_tokens=GEN_MAX_TOKENS))
    return folder


@pytest.fixture(scope="module")
def evaluations(server, tiny_llama, tasks_dir, tmp_path_factory) -> dict:
    home = tmp_path_factory.mktemp("hf_home")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(home), "HF_DATASETS_CACHE": str(home / "datasets"), "OPENAI_API_KEY": "",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    runs = {"pagedserve": ("local-completions",
                           {"base_url": f"{server}/v1/completions", "model": tiny_llama, "tokenizer": tiny_llama,
                            "tokenizer_backend": "huggingface", "tokenized_requests": True, "max_retries": 1,
                            "num_concurrent": 1},
                           API_BATCH_SIZE),
            "hf": ("hf", {"pretrained": tiny_llama, "dtype": "float32", "device": "cpu"}, HF_BATCH_SIZE)}
    out = tasks_dir / "results.json"
    done = subprocess.run([sys.executable, "-c", EVALUATE, str(tasks_dir), str(out), json.dumps(runs)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, "\n".join(line for line in done.stderr.splitlines() if "rror" in line)[-6000:]
    return json.loads(out.read_text())


def test_loglikelihoods_and_accuracy_equal_lm_evals_hf_backend(evaluations):
    ours, hf = evaluations["pagedserve"], evaluations["hf"]
    assert [doc for doc, _ in ours["samples"]["pagedserve_mc"]] == list(range(len(QUESTIONS)))
    for (doc, served), (_, reference) in zip(ours["samples"]["pagedserve_mc"], hf["samples"]["pagedserve_mc"]):
        assert len(served) == len(reference) == len(QUESTIONS[doc][1])
        for (ll, greedy), (ll_ref, greedy_ref) in zip(served, reference):
            assert ll == pytest.approx(ll_ref, abs=LOGLIKELIHOOD_TOLERANCE), f"item {doc}"
            assert greedy == greedy_ref, f"item {doc}"
    assert ours["metrics"]["pagedserve_mc"]["acc,none"] == hf["metrics"]["pagedserve_mc"]["acc,none"]


def test_generations_equal_greedy(evaluations, tiny_llama):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    served = [resps[0] for _, resps in evaluations["pagedserve"]["samples"]["pagedserve_gen"]]
    assert served == [resps[0] for _, resps in evaluations["hf"]["samples"]["pagedserve_gen"]]
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for prompt, text in zip(GEN_PROMPTS, served):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        greedy = tokenizer.decode(hf_greedy(model, ids, GEN_MAX_TOKENS), skip_special_tokens=True)
        assert text == greedy.split("\n\n")[0]
    assert any(served)


def _post(url: str, body: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs_alone(server):
    """How scoring clients ask for a text's loglikelihood (vLLM and OpenAI's legacy API accept it):
    the prompt echoed with its logprobs, nothing generated, streamed or not; without echo,
    max_tokens 0 is a 400 naming the field."""
    url, prompts = server + "/v1/completions", [[504, 3575, 282, 4649, 314], [11, 12, 13]]
    body = {"prompt": prompts, "echo": True, "logprobs": 2, "temperature": 0}
    status, scored = _post(url, {**body, "max_tokens": 0})
    scored = json.loads(scored)
    generated = json.loads(_post(url, {**body, "max_tokens": 1})[1])
    assert status == 200 and len(scored["choices"]) == 2
    for choice, longer in zip(scored["choices"], generated["choices"]):
        lp, more = choice["logprobs"], longer["logprobs"]
        assert lp["tokens"] == more["tokens"][:-1] and lp["text_offset"] == more["text_offset"][:-1]
        assert lp["token_logprobs"][0] is None
        assert lp["token_logprobs"][1:] == pytest.approx(more["token_logprobs"][1:-1], abs=1e-5)
        assert [sorted(top) for top in lp["top_logprobs"][1:]] == [sorted(top) for top in more["top_logprobs"][1:-1]]
        assert choice["text"] == "".join(lp["tokens"]) and longer["text"].startswith(choice["text"])
        assert choice["finish_reason"] == "length"
    assert scored["usage"]["prompt_tokens"] == 8 and scored["usage"]["completion_tokens"] == 0

    status, stream = _post(url, {**body, "prompt": prompts[0], "max_tokens": 0, "stream": True})
    events = [e.removeprefix("data: ") for e in stream.decode().split("\n\n") if e]
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    whole = scored["choices"][0]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert sum((c["choices"][0]["logprobs"]["tokens"] for c in chunks), []) == whole["logprobs"]["tokens"]

    status, error = _post(url, {"prompt": "hi", "max_tokens": 0})
    error = json.loads(error)["error"]
    assert status == 400 and error["param"] == "max_tokens" and "echo" in error["message"]
