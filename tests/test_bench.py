"""`pagedserve bench`: workloads, arrivals, the figures, and whole runs against a real server."""

from __future__ import annotations

import json
import random
import statistics
from types import SimpleNamespace

import pytest
import ray

from pagedserve.bench.dataset import as_chat, draw_length, load_jsonl, parse_range, synthetic
from pagedserve.bench.report import summarize
from pagedserve.bench.runner import RequestResult, RunResult, TIMELINE_KEYS, arrival_times
from pagedserve.cli import main
from pagedserve.config import EngineConfig
from tests.serving import running_coordinator


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


def test_ranges_and_lengths():
    assert parse_range("32", "--input-len") == (32, 32)
    assert parse_range("8:64", "--input-len") == (8, 64)
    for bad in ("0:4", "9:3", "a:b", "1:2:3", ""):
        with pytest.raises(ValueError, match="--output-len"):
            parse_range(bad, "--output-len")
    rng = random.Random(0)
    for dist in ("uniform", "normal", "exponential"):
        values = [draw_length(rng, 10, 200, dist) for _ in range(2000)]
        assert min(values) >= 10 and max(values) <= 200
    exponential = [draw_length(rng, 10, 200, "exponential") for _ in range(2000)]
    assert statistics.median(exponential) < 105  # skewed short, unlike uniform's ~105


def test_synthetic_prompts_are_real_text_with_the_shared_prefix(tokenizer):
    a = synthetic(tokenizer, 20, (16, 64), (4, 8), seed=3, shared_prefix_len=48)
    b = synthetic(tokenizer, 20, (16, 64), (4, 8), seed=3, shared_prefix_len=48)
    assert a == b  # seeded
    prefix = a[0].prompt_ids[:48]
    for r in a:
        assert r.prompt_ids[:48] == prefix and 48 + 16 <= len(r.prompt_ids) <= 48 + 64 and 4 <= r.max_tokens <= 8
    assert len({tuple(r.prompt_ids) for r in a}) == 20
    text = tokenizer.decode(a[0].prompt_ids)
    assert sum(c.isalpha() for c in text) > len(text) / 2  # English prose, not random ids
    assert synthetic(tokenizer, 5, (16, 64), (4, 8), seed=4) != a[:5]


def test_jsonl_prompts_and_chat_messages(tokenizer, tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"prompt": "Hello there", "max_tokens": 5}) + "\n\n"
                    + json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    rows = load_jsonl(str(path), tokenizer, default_max_tokens=9)
    assert rows[0].prompt_ids == tokenizer.encode("Hello there") and rows[0].max_tokens == 5
    assert rows[1].max_tokens == 9 and len(rows[1].prompt_ids) > len(tokenizer.encode("Hi"))  # templated
    for line, words in ((json.dumps({"prompt": "x", "max_tokens": 0}), "line 1: max_tokens must be"),
                        (json.dumps({"text": "x"}), "line 1: needs a non-empty 'prompt'"),
                        ("{oops", "line 1: not JSON"),
                        (json.dumps({"messages": [{"role": "user"}]}), "line 1: each message needs")):
        path.write_text(line + "\n")
        with pytest.raises(ValueError, match=words):
            load_jsonl(str(path), tokenizer, 9)


def test_poisson_arrivals_have_the_asked_rate():
    assert arrival_times(5, float("inf"), 0) == [0.0] * 5
    times = arrival_times(4000, 8.0, seed=1)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times == sorted(times) and abs(statistics.mean(gaps) - 1 / 8) < 0.01
    assert abs(statistics.stdev(gaps) - 1 / 8) < 0.015  # exponential: sd = mean


def test_a_run_shorter_than_the_poll_reports_the_engines_peak_kv_usage():
    idle = {"t": 0.0, **{key: 0.0 for key in TIMELINE_KEYS}}
    before = {"kv_blocks_peak_used": 3.0, "kv_blocks_total": 40.0}
    rose = RunResult([], 0.2, [idle], before, {"kv_blocks_peak_used": 10.0, "kv_blocks_total": 40.0})
    assert summarize(rose)["peak_kv_usage"] == summarize(rose)["peak_kv_usage_engine"] == 0.25
    # An engine peak from before the run says nothing of it: the polled peak stands.
    earlier = RunResult([], 0.2, [dict(idle, kv_usage=0.1)], before, before)
    assert summarize(earlier)["peak_kv_usage"] == 0.1 and summarize(earlier)["peak_kv_usage_engine"] is None


def test_inter_token_latency_spreads_a_chunks_gap_over_its_tokens():
    r = RequestResult(prompt_len=3, max_tokens=4, send_time=1.0, chunk_times=[1.5, 1.7, 2.3],
                      chunk_tokens=[1, 1, 2], end_time=2.4)
    assert r.ttft == 0.5 and r.output_len == 4 and r.e2e == pytest.approx(1.4)
    assert r.inter_token_latencies() == pytest.approx([0.2, 0.3, 0.3])


@pytest.fixture(scope="module")
def doors(ray_session, tiny_llama):
    """One server, both doors: gRPC at `target`, the OpenAI-compatible API at `base_url`."""
    config = EngineConfig(model=tiny_llama, distributed_executor_backend="ray", kv_cache_memory=1 << 22)
    with running_coordinator(config) as (actor, target):
        port = ray.get(actor.status.remote())["http_port"]
        yield SimpleNamespace(target=target, base_url=f"http://127.0.0.1:{port}/v1")


@pytest.fixture(scope="module")
def server(doors):
    return doors.target


def test_bench_against_a_running_server_writes_the_table_json_and_plots(server, tiny_llama, tmp_path, capsys):
    out_json, plots = tmp_path / "r.json", tmp_path / "plots"
    code = main(["bench", "--target", server, "--model", tiny_llama, "--num-prompts", "12", "--input-len", "8:40",
                 "--output-len", "4:12", "--request-rate", "50", "--max-concurrency", "6", "--shared-prefix-len", "32",
                 "--result-json", str(out_json), "--plot-dir", str(plots), "--no-progress"])
    assert code == 0
    table = capsys.readouterr().out
    for row in ("request throughput", "time to first token p50 / p90 / p99", "inter-token latency",
                "end-to-end latency", "preemptions", "prefix cache hit rate", "peak KV usage"):
        assert row in table
    data = json.loads(out_json.read_text())
    s = data["summary"]
    assert s["completed"] == 12 and s["failed"] == 0
    assert s["output_tokens"] == sum(r["max_tokens"] for r in data["requests"])  # ignore_eos: exactly max_tokens
    assert all(r["output_len"] == r["max_tokens"] for r in data["requests"])
    assert s["prefix_cache_hit_rate"] > 0  # the shared 32-token prefix: 2 full blocks per later prompt
    assert 0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["p90"] <= s["ttft_ms"]["p99"]
    assert 0 < s["peak_kv_usage"] <= 1 and data["timeline"] and 0 < s["peak_kv_metadata_share"] < 1
    sends = sorted(r["send_time"] for r in data["requests"])
    assert sends[-1] > 0.05  # Poisson arrivals, not all at once
    for name in ("kv_usage_over_time.png", "latency_distributions.png"):
        png = (plots / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert s["peak_kv_usage_engine"] is not None  # the engine's peak rose during this run
    # A smaller second run on the same server: the engine's lifetime peak is not this run's.
    assert main(["bench", "--target", server, "--model", tiny_llama, "--num-prompts", "1", "--input-len", "8",
                 "--output-len", "2", "--result-json", str(out_json), "--no-progress"]) == 0
    assert json.loads(out_json.read_text())["summary"]["peak_kv_usage_engine"] is None


def test_bench_openai_backend_drives_completions_and_chat_over_http(doors, tiny_llama, tmp_path, capsys):
    """The gRPC run's workload through the HTTP door: the same prompt tokens, exactly max_tokens
    each, greedy texts equal transformers'; through chat, the prompts as user messages; stats over
    gRPC when it answers, left out when it does not."""
    common = ["bench", "--model", tiny_llama, "--num-prompts", "6", "--input-len", "8:24", "--output-len", "3:8",
              "--max-concurrency", "3", "--no-progress"]
    grpc_json, http_json, chat_json = tmp_path / "grpc.json", tmp_path / "http.json", tmp_path / "chat.json"
    assert main(common + ["--target", doors.target, "--result-json", str(grpc_json)]) == 0
    assert main(common + ["--target", doors.target, "--backend", "openai", "--base-url", doors.base_url,
                          "--baseline", "transformers", "--baseline-batch-size", "3",
                          "--result-json", str(http_json)]) == 0
    table = capsys.readouterr().out
    assert f"openai completions {doors.base_url}" in table and "identical greedy outputs             6 of 6" in table
    over_grpc, over_http = json.loads(grpc_json.read_text()), json.loads(http_json.read_text())
    assert over_http["summary"]["completed"] == 6 and over_http["summary"]["server_stats"]
    assert [(r["prompt_len"], r["output_len"]) for r in over_http["requests"]] == \
        [(r["prompt_len"], r["max_tokens"]) for r in over_grpc["requests"]]
    assert over_http["summary"]["itl_ms"]["p50"] > 0 and over_http["timeline"]

    assert main(common + ["--target", "127.0.0.1:1", "--backend", "openai", "--endpoint", "chat",
                          "--base-url", doors.base_url, "--result-json", str(chat_json)]) == 0
    out = capsys.readouterr()
    assert "no server stats (gRPC 127.0.0.1:1" in out.err and "openai chat" in out.out
    assert "prefix cache hit rate" not in out.out  # no stats: not shown as zeros
    chat = json.loads(chat_json.read_text())
    assert chat["summary"]["completed"] == 6 and not chat["timeline"]
    for r, plain in zip(chat["requests"], over_grpc["requests"]):
        assert r["output_len"] == r["max_tokens"] == plain["max_tokens"]
        assert r["prompt_len"] > plain["prompt_len"]  # the chat template's tokens around the text

    root = doors.base_url.removesuffix("/v1")  # a base URL without /v1: every path is a 404
    assert main(common + ["--target", doors.target, "--backend", "openai", "--base-url", root]) != 0
    assert f"(the base URL usually ends in /v1: {root}/v1)" in capsys.readouterr().err


def test_a_chat_workload_carries_messages_and_their_templated_tokens(tokenizer):
    plain = synthetic(tokenizer, 3, (8, 16), (2, 4), seed=5)
    for r, chat in zip(plain, as_chat(plain, tokenizer)):
        assert chat.messages == [{"role": "user", "content": tokenizer.decode(r.prompt_ids)}]
        assert chat.prompt_ids == list(tokenizer.apply_chat_template(chat.messages, tokenize=True,
                                                                     add_generation_prompt=True, return_dict=False))
        assert chat.max_tokens == r.max_tokens


def test_bench_refuses_bad_flags_naming_them(tiny_llama, capsys):
    assert main(["bench", "--model", tiny_llama, "--input-len", "0:5"]) == 2
    assert "--input-len must be" in capsys.readouterr().err
    assert main(["bench", "--model", tiny_llama, "--dataset", "/nonexistent.jsonl"]) == 2
    assert "--dataset must be 'synthetic' or a JSONL file" in capsys.readouterr().err
    assert main(["bench", "--model", tiny_llama, "--target", "127.0.0.1:1", "--num-prompts", "1",
                 "--no-progress"]) == 1
    assert "error" in capsys.readouterr().err
    assert main(["bench", "--model", tiny_llama, "--backend", "openai", "--base-url", "http://127.0.0.1:1/v1",
                 "--target", "127.0.0.1:1", "--num-prompts", "1", "--no-progress"]) == 1
    assert "pagedserve: error: " in capsys.readouterr().err


def test_bench_embedded_with_the_transformers_baseline(tiny_llama, tmp_path, capsys):
    out_json = tmp_path / "r.json"
    code = main(["bench", "--embedded", "--model", tiny_llama, "--kv-cache-memory", str(1 << 22),
                 "--num-prompts", "6", "--input-len", "8:24", "--output-len", "6", "--baseline", "transformers",
                 "--baseline-batch-size", "3", "--result-json", str(out_json), "--no-progress"])
    assert code == 0
    assert "pagedserve / transformers" in capsys.readouterr().out
    data = json.loads(out_json.read_text())
    assert data["summary"]["completed"] == 6
    baseline = data["baseline"]
    assert baseline["output_tokens"] == 36 and baseline["seconds"] > 0
    assert baseline["speedup"] == pytest.approx(data["summary"]["output_token_throughput"]
                                                / baseline["output_token_throughput"])
    assert baseline["identical_outputs"] >= 5  # greedy both ways (a near-tie may differ)
