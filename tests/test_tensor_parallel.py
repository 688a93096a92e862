"""Tensor parallelism over real Ray worker actors and gloo: TP=2 gives the greedy tokens of TP=1
and of transformers, each rank holding its shard of the weights and of every KV block."""

from __future__ import annotations

import os
import time

import pytest
import ray

from pagedserve import LLM
from tests.reference import assert_same_or_near_tie, hf_greedy
from tests.test_model_correctness import _assert_no_leak, _generate, _prompts

PROMPTS = _prompts(8, seed=7, high=60)
MAX_NEW = 16


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()


def _process_gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def _run(model: str, **engine_args) -> tuple[list[list[int]], dict, list[int]]:
    """Greedy tokens, stats and worker pids of one engine, shut down afterwards."""
    with LLM(model, kv_cache_memory=1 << 22, **engine_args) as llm:
        tokens = _generate(llm, PROMPTS, MAX_NEW)
        _assert_no_leak(llm)
        stats = llm.stats()
        # Dispatch overhead is measured apart from rank 0's compute: positive, and a part of the step.
        execute_seconds = llm.engine.metrics.execute_seconds
        assert 0 < stats["executor_overhead_us_per_step"] < 1e6 * execute_seconds / stats["num_steps"]
        # ... and rank 0's compute is the rest of the executor's time.
        assert 0 < stats["worker_compute_seconds"] < execute_seconds
        assert stats["worker_compute_seconds"] == pytest.approx(
            execute_seconds - 1e-6 * stats["executor_overhead_us_per_step"] * stats["num_steps"])
        pids = llm.engine.executor.worker_pids()
    return tokens, stats, pids


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_llama_one_kv_head"])
def test_tp2_gives_the_tokens_of_tp1_and_transformers(ray_session, request, fixture):
    model = request.getfixturevalue(fixture)
    tp1, stats1, _ = _run(model)
    tp2, stats2, pids = _run(model, tensor_parallel_size=2)
    assert len(set(pids)) == 2 and os.getpid() not in pids  # two worker actors, not this process
    assert tp2 == tp1
    hf = _hf(model)
    for prompt, ours in zip(PROMPTS, tp2):
        assert_same_or_near_tie(hf, prompt, ours, hf_greedy(hf, prompt, MAX_NEW))
    # Same kv_cache_memory per rank: 2 KV heads split over 2 ranks hold twice the blocks;
    # 1 KV head is replicated on both ranks, so the block count stays.
    factor = 2 if fixture == "tiny_llama" else 1
    assert stats2["kv_blocks_total"] == factor * stats1["kv_blocks_total"]
    assert all(_process_gone(pid) for pid in pids), "worker actors outlived LLM.shutdown()"


def test_tp2_under_preemption_chunked_prefill_and_prefix_hits(ray_session, tiny_llama):
    shared = [5, 6, 7, 8] * 10
    prompts = [shared + p for p in _prompts(10, seed=3, high=30)]
    with LLM(tiny_llama, tensor_parallel_size=2, kv_cache_memory=1 << 22) as roomy:
        expected = _generate(roomy, prompts)
    # 24 blocks of 16 tokens for 10 sequences of up to ~94 tokens: preemption is certain.
    tight_bytes = 24 * 2 * 2 * 16 * 1 * 16 * 4  # blocks x layers x K/V x tokens x heads/rank x dim x fp32
    with LLM(tiny_llama, tensor_parallel_size=2, kv_cache_memory=tight_bytes,
             max_num_batched_tokens=40) as tight:
        assert tight.stats()["kv_blocks_total"] == 24
        assert _generate(tight, prompts) == expected
        stats = tight.stats()
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
        _assert_no_leak(tight)


def test_a_size_that_does_not_divide_the_heads_is_refused_before_anything_starts(ray_session, tiny_llama):
    before = len(ray.util.placement_group_table())
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(3\) must divide the model's 4 attention heads"):
        LLM(tiny_llama, tensor_parallel_size=3)
    assert len(ray.util.placement_group_table()) == before


def test_uni_executor_refuses_tensor_parallelism():
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        LLM("unused", tensor_parallel_size=2, distributed_executor_backend="uni")


def test_tp2_parallel_samples_logprobs_and_beams_equal_tp1(ray_session, tiny_llama):
    from pagedserve import SamplingParams

    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    params = [SamplingParams(n=3, seed=2, temperature=1.0, max_tokens=6, ignore_eos=True, logprobs=2,
                             prompt_logprobs=1),
              SamplingParams(use_beam_search=True, beam_width=2, max_tokens=6),
              SamplingParams(temperature=0.0, max_tokens=6, repetition_penalty=1.5, logit_bias={7: 3.0})]

    def run(**engine_args):
        with LLM(tiny_llama, kv_cache_memory=1 << 22, **engine_args) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            _assert_no_leak(llm)
        logprobs = [(t, lp.logprob) for step in outs[0].outputs[0].logprobs for t, lp in sorted(step.items())]
        logprobs += [(t, step[t].logprob) for step, t in zip(outs[0].prompt_logprobs[1:], PROMPTS[0][1:])]
        return [[c.token_ids for c in o.outputs] for o in outs], logprobs

    (tokens2, logprobs2), (tokens1, logprobs1) = run(tensor_parallel_size=2), run()
    assert tokens2 == tokens1
    assert [t for t, _ in logprobs2] == [t for t, _ in logprobs1]
    assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(logprobs2, logprobs1))
