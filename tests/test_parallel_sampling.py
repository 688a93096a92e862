"""n > 1 and best_of on shared blocks, logprobs, penalties, and abort in every state."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from pagedserve import LLM, BeamSearchParams, SamplingParams
from tests.reference import hf_greedy

BLOCK = 16


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with LLM(tiny_llama, kv_cache_memory=1 << 24, block_size=BLOCK) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype="float32").eval()


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def _assert_all_free(llm):
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and not llm.engine.has_unfinished_requests()
    assert all(c == 0 for c in llm.engine.scheduler.kv.pool.ref_counts)


def _record_plans(llm) -> list:
    """Wrap the executor so that every step plan is kept."""
    plans, execute = [], llm.engine.executor.execute

    def recording(plan):
        plans.append(plan)
        return execute(plan)

    llm.engine.executor.execute = recording
    return plans


def test_n8_shares_the_prompt_blocks_and_copies_the_partial_block_once_per_writer(tiny_llama):
    with LLM(tiny_llama, kv_cache_memory=1 << 24, block_size=BLOCK, enable_prefix_caching=False) as llm:
        plans = _record_plans(llm)
        engine, pool = llm.engine, llm.engine.scheduler.kv.pool
        prompt = _prompt(500)  # 31 full blocks + 4 tokens in a partial 32nd
        engine.add_request("r", None, prompt, SamplingParams(n=8, temperature=1.0, seed=3, max_tokens=8,
                                                             ignore_eos=True))
        while not engine.scheduler.groups["r"].seqs[1:]:
            engine.step()  # prefill chunks, then the step that samples 8 tokens and forks
        seqs = engine.scheduler.groups["r"].seqs
        assert len(seqs) == 8 and len({s.seq_id for s in seqs}) == 8
        # One prompt's blocks, each held by all eight samples; nothing copied yet.
        assert pool.num_used == 32
        assert all(pool.ref_counts[b] == 8 for b in seqs[0].block_table)
        assert all(s.block_table == seqs[0].block_table for s in seqs)
        engine.step()  # every sample writes its first token into the shared partial block
        # The first seven writers copy it; the eighth finds it its own (ref count 1).
        assert len(plans[-1].copy) == 7
        assert pool.num_used == 32 + 7
        full = seqs[0].block_table[:31]
        assert all(s.block_table[:31] == full for s in seqs)
        assert all(pool.ref_counts[b] == 8 for b in full)
        assert len({s.block_table[31] for s in seqs}) == 8
        assert all(pool.ref_counts[s.block_table[31]] == 1 for s in seqs)
        while engine.has_unfinished_requests():
            engine.step()
        _assert_all_free(llm)


def test_sample_j_of_n_equals_a_single_request_seeded_seed_plus_j(llm):
    prompt = _prompt(40, seed=1)
    params = dict(temperature=1.0, max_tokens=12, ignore_eos=True)
    group = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=4, seed=7, **params), use_tqdm=False)[0]
    assert [c.index for c in group.outputs] == [0, 1, 2, 3]
    singles = llm.generate([{"prompt_token_ids": prompt}] * 4,
                           [SamplingParams(seed=7 + j, **params) for j in range(4)], use_tqdm=False)
    assert [c.token_ids for c in group.outputs] == [s.outputs[0].token_ids for s in singles]
    assert len({tuple(c.token_ids) for c in group.outputs}) > 1
    # The same again inside a different batch: seeded samples do not depend on their neighbours.
    mixed = llm.generate([{"prompt_token_ids": _prompt(30, seed=9)}, {"prompt_token_ids": prompt}],
                         [SamplingParams(n=3, **params), SamplingParams(n=4, seed=7, **params)], use_tqdm=False)
    assert [c.token_ids for c in mixed[1].outputs] == [c.token_ids for c in group.outputs]
    _assert_all_free(llm)


def test_seeded_samples_survive_preemption(tiny_llama, llm):
    prompts = [_prompt(60, seed=s) for s in range(6)]
    params = SamplingParams(n=3, seed=11, temperature=0.8, max_tokens=20, ignore_eos=True)
    roomy = [[c.token_ids for c in o.outputs] for o in
             llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    block_bytes = 2 * 2 * BLOCK * 2 * 16 * 4  # layers x K/V x tokens x kv heads x head dim x fp32
    with LLM(tiny_llama, kv_cache_memory=30 * block_bytes, block_size=BLOCK, max_num_batched_tokens=64) as tight:
        out = tight.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert tight.stats()["num_preemptions"] > 0
        assert [[c.token_ids for c in o.outputs] for o in out] == roomy
        _assert_all_free(tight)


def test_max_num_seqs_counts_every_sample_and_beam(tiny_llama, llm):
    """vLLM counts each sample toward max_num_seqs: under a cap of 4, requests of n=3 run one at
    a time (3 + 3 > 4) where they had forked to 9 running sequences; a request wider than the cap
    (best_of 6, beam_width 5) runs alone. The tokens are those of a run with room."""
    prompts = [{"prompt_token_ids": _prompt(30, seed=s)} for s in range(4)]
    sampled = [SamplingParams(n=3, seed=s, temperature=1.0, max_tokens=6, ignore_eos=True) for s in range(3)]
    sampled.append(SamplingParams(n=2, best_of=6, seed=5, temperature=1.0, max_tokens=6, ignore_eos=True))
    beams = BeamSearchParams(beam_width=5, max_tokens=6, ignore_eos=True).sampling_params()
    every = prompts + [prompts[0]]

    def tokens(engine_llm):
        out = engine_llm.generate(every, sampled + [beams], use_tqdm=False)
        return [[c.token_ids for c in o.outputs] for o in out]

    want = tokens(llm)
    with LLM(tiny_llama, kv_cache_memory=1 << 24, block_size=BLOCK, max_num_seqs=4) as capped:
        scheduler, seen = capped.engine.scheduler, []
        schedule = scheduler.schedule

        def recording():
            out = schedule()
            seen.append((len(scheduler.running), len({s.request_id for s in scheduler.running})))
            return out

        scheduler.schedule = recording
        assert tokens(capped) == want
        assert max(n for n, _ in seen) == 6  # best_of 6, alone
        assert all(n <= 4 for n, requests in seen if requests > 1)
        _assert_all_free(capped)


def test_best_of_returns_the_n_best_by_cumulative_logprob(llm):
    prompt = _prompt(25, seed=2)
    params = dict(temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
    every = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=5, logprobs=0, **params),
                         use_tqdm=False)[0].outputs
    best = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=2, best_of=5, **params),
                        use_tqdm=False)[0].outputs
    ranked = sorted(every, key=lambda c: c.cumulative_logprob, reverse=True)
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in best] == [0, 1]
    assert best[0].cumulative_logprob >= best[1].cumulative_logprob
    for c in every:  # the cumulative logprob is the sum of the sampled tokens' logprobs
        assert abs(c.cumulative_logprob - sum(step[t].logprob for step, t in zip(c.logprobs, c.token_ids))) < 1e-4
    _assert_all_free(llm)


def test_logprobs_equal_transformers_log_softmax(llm, hf):
    prompt = _prompt(20, seed=4)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=8, logprobs=5,
                                                                    ignore_eos=True), use_tqdm=False)[0].outputs[0]
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0].float()
    reference = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    assert len(out.logprobs) == len(out.token_ids) == 8
    tokenizer = llm.get_tokenizer()
    for step, token, ref in zip(out.logprobs, out.token_ids, reference):
        top = ref.topk(5)
        assert set(step) == {token} | set(top.indices.tolist())  # greedy: the token is the top one
        for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(step[tid].logprob - lp) < 1e-4
        assert step[token].rank == 1 and step[token].decoded_token == tokenizer.decode([token])


def test_repetition_penalty_equals_transformers(llm, hf):
    from transformers import GenerationConfig

    def hf_penalized(prompt):
        config = GenerationConfig(do_sample=False, max_new_tokens=16, repetition_penalty=2.0, eos_token_id=None,
                                  pad_token_id=0)
        with torch.inference_mode():
            return hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               generation_config=config)[0, len(prompt):].tolist()

    # A peaked random model rarely repeats itself: take prompts on which the penalty bites.
    prompts = [p for p in (_prompt(12, seed=s) for s in range(40)) if hf_penalized(p) != hf_greedy(hf, p, 16)][:3]
    assert prompts, "no prompt on which the repetition penalty changes transformers' output"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=2.0),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_penalized(p) for p in prompts]


def test_frequency_presence_bias_and_allowed_tokens_change_what_they_should(llm):
    prompt = _prompt(10, seed=8)
    greedy = dict(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run(**kw):
        return llm.generate({"prompt_token_ids": prompt}, SamplingParams(**greedy, **kw),
                            use_tqdm=False)[0].outputs[0].token_ids

    plain = run()
    # A strong frequency penalty forbids repeats; a strong presence penalty too.
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        penalized = run(**kw)
        assert len(set(penalized)) >= len(set(plain))
        assert penalized != plain or len(set(plain)) == len(plain)
    assert run(logit_bias={777: 100.0}) == [777] * 12
    allowed = run(allowed_token_ids=[5, 6, 7])
    assert set(allowed) <= {5, 6, 7}


def test_abort_in_every_state_returns_every_block(tiny_llama):
    with LLM(tiny_llama, kv_cache_memory=1 << 24, block_size=BLOCK, max_num_batched_tokens=64) as llm:
        engine = llm.engine
        sample = dict(temperature=1.0, seed=1, ignore_eos=True)
        engine.add_request("running", None, _prompt(40, 1), SamplingParams(n=3, max_tokens=50, **sample))
        engine.add_request("some-done", None, _prompt(20, 3), SamplingParams(n=4, max_tokens=50, **sample))
        engine.add_request("prefill", None, _prompt(300, 2), SamplingParams(max_tokens=50, **sample))
        for _ in range(3):
            engine.step()
        # One sample of "some-done" finishes early: cap it by hand as a stop would.
        done = engine.scheduler.groups["some-done"].seqs[1]
        engine.scheduler.finish(done, done.status.FINISHED_STOPPED)
        engine.add_request("waiting", None, _prompt(30, 4), SamplingParams(max_tokens=50, **sample))
        assert 0 < engine.scheduler.groups["prefill"].first.num_computed_tokens < 300  # mid-prefill
        states = {}
        pool = engine.scheduler.kv.pool
        for request_id in ("waiting", "prefill", "some-done", "running"):
            seqs = list(engine.scheduler.groups[request_id].seqs)
            states[request_id] = {s.status.value for s in seqs}
            # The blocks only this request holds (every reference to them is one of its samples').
            held = Counter(b for s in seqs if not s.status.finished for b in s.block_table)
            own = sum(1 for b, refs in held.items() if pool.ref_counts[b] == refs)
            before = pool.num_used
            out = engine.abort_request(request_id)
            assert out.finished and request_id not in engine.scheduler.groups
            assert request_id not in engine.output_processor.requests
            assert all(s.status.finished and s.status.value in ("abort", "stop") for s in seqs)
            assert before - pool.num_used == own
            assert (own > 0) == (request_id != "waiting")
        assert states["waiting"] == {"waiting"}
        assert states["running"] == {"running"}
        assert states["some-done"] == {"running", "stop"}
        _assert_all_free(llm)


def test_prompt_logprobs_equal_transformers_across_chunks_and_cached_prefixes(tiny_llama, hf):
    prompt = _prompt(45, seed=12)
    with LLM(tiny_llama, kv_cache_memory=1 << 24, block_size=BLOCK, max_num_batched_tokens=7) as llm:
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)  # now cached
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, prompt_logprobs=3),
                           use_tqdm=False)[0]
        _assert_all_free(llm)
    with torch.inference_mode():
        reference = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for position, step in enumerate(out.prompt_logprobs[1:]):
        token, ref = prompt[position + 1], reference[position]
        assert abs(step[token].logprob - ref[token].item()) < 1e-4
        # Deep in the tail many logprobs lie within float noise of each other: rank up to ties.
        lowest, highest = (int((ref > ref[token] + d).sum()) + 1 for d in (1e-4, -1e-4))
        assert lowest <= step[token].rank <= highest
        top = ref.topk(3)
        for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(step[tid].logprob - lp) < 1e-4
