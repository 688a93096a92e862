"""Beam search on shared blocks equals transformers' beam search, and frees dropped beams at once."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, BeamSearchParams, SamplingParams
from tests.test_parallel_sampling import _assert_all_free, _prompt

NEW = 12


def hf_beam(model, prompt: list[int], width: int, new_tokens: int = NEW, **kw) -> list[int]:
    """transformers' best beam (generated tokens; the EOS kept, padding dropped)."""
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             num_beams=width, do_sample=False, max_new_tokens=new_tokens, pad_token_id=0,
                             **kw)[0, len(prompt):].tolist()
    for i, t in enumerate(out):
        if t in eos:
            return out[:i + 1]
    return out


@pytest.fixture(scope="module")
def hf(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype="float32").eval()


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_equals_transformers(tiny_llama, hf, width):
    prompts = [_prompt(n, seed=s) for s, n in ((1, 5), (2, 17), (3, 33))]
    with LLM(tiny_llama, kv_cache_memory=1 << 24) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(use_beam_search=True, beam_width=width, n=width, max_tokens=NEW),
                            use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            assert out.outputs[0].token_ids == hf_beam(hf, prompt, width)
            assert len(out.outputs) == width
            scores = [c.cumulative_logprob / len(c.token_ids) for c in out.outputs]
            assert scores == sorted(scores, reverse=True)
        _assert_all_free(llm)


def test_length_penalty_and_early_stopping_follow_transformers(tiny_llama, hf):
    prompt = _prompt(9, seed=5)
    with LLM(tiny_llama, kv_cache_memory=1 << 24) as llm:
        for kw in ({"length_penalty": 0.0, "early_stopping": "never"}, {"length_penalty": 2.0, "early_stopping": True}):
            ours = llm.generate({"prompt_token_ids": prompt},
                                SamplingParams(use_beam_search=True, beam_width=3, max_tokens=NEW, **kw),
                                use_tqdm=False)[0].outputs[0].token_ids
            assert ours == hf_beam(hf, prompt, 3, **kw)


def test_beams_share_blocks_and_dropped_beams_free_theirs_at_once(tiny_llama):
    with LLM(tiny_llama, kv_cache_memory=1 << 24, block_size=16, enable_prefix_caching=False) as llm:
        engine, pool = llm.engine, llm.engine.scheduler.kv.pool
        engine.add_request("b", None, _prompt(100, seed=8), SamplingParams(use_beam_search=True, beam_width=4,
                                                                           max_tokens=30, ignore_eos=True))
        seen_shared = False
        while engine.has_unfinished_requests():
            engine.step()
            group = engine.scheduler.groups.get("b")
            if group is None:
                break
            beams = group.seqs
            assert len(beams) <= 4
            held = {b for s in beams for b in s.block_table}
            assert pool.num_used == len(held)  # no block outlives the beams that held it
            shared = [b for b in held if pool.ref_counts[b] > 1]
            seen_shared |= bool(shared)
            # The prompt's 6 full blocks are held once and shared by every beam.
            assert all(pool.ref_counts[b] == len(beams) for b in beams[0].block_table[:6])
        assert seen_shared
        _assert_all_free(llm)


def test_beam_search_refuses_what_it_does_not_combine_with():
    with pytest.raises(ValueError, match="n \\(5\\) must be <= beam_width \\(4\\)"):
        SamplingParams(use_beam_search=True, beam_width=4, n=5)
    with pytest.raises(ValueError, match="stop is not supported with use_beam_search"):
        SamplingParams(use_beam_search=True, stop=["x"])
    with pytest.raises(ValueError, match="early_stopping must be"):
        SamplingParams(use_beam_search=True, early_stopping="sometimes")


def test_llm_beam_search_is_vllms_api_over_the_same_search(tiny_llama, hf, bundled_tokenizer):
    prompts = [_prompt(n, seed=s) for s, n in ((1, 5), (2, 17))]
    with LLM(tiny_llama, kv_cache_memory=1 << 24) as llm:
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(beam_width=3, max_tokens=NEW))
        for prompt, out in zip(prompts, outs):
            assert len(out.sequences) == 3
            best = out.sequences[0]
            generated = hf_beam(hf, prompt, 3)
            assert best.tokens == prompt + generated  # the prompt's tokens, then the beam's
            assert best.text == bundled_tokenizer.decode(generated, skip_special_tokens=True)
            scores = [s.cum_logprob / (len(s.tokens) - len(prompt)) for s in out.sequences]
            assert scores == sorted(scores, reverse=True)
        for bad, field in ((dict(temperature=0.7), "temperature"), (dict(beam_width=0), "beam_width"),
                           (dict(max_tokens=0), "max_tokens")):
            with pytest.raises(ValueError, match=field):
                llm.beam_search([{"prompt_token_ids": prompts[0]}], BeamSearchParams(**{"beam_width": 2, "max_tokens": 4,
                                                                                       **bad}))
        _assert_all_free(llm)


@pytest.mark.parametrize("mode,policy", [("recompute", "fcfs"), ("swap", "fcfs"), ("recompute", "priority")])
def test_beams_that_cannot_all_hold_their_blocks_at_once_still_finish(tiny_llama, mode, policy):
    """16 beams of 150 tokens outgrow a 24-block pool: a preempted beam could not come back while
    its siblings held their blocks waiting for it (a stall). Now the waiting siblings leave the
    pool until the search advances, and the search (and a request beside it) ends as with room."""
    prompts = [{"prompt_token_ids": _prompt(20, seed=3)}, {"prompt_token_ids": _prompt(30, seed=4)}]
    params = [BeamSearchParams(beam_width=16, max_tokens=150, ignore_eos=True).sampling_params(),
              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)]

    def run(llm):
        return [[c.token_ids for c in out.outputs] for out in llm.generate(prompts, params, use_tqdm=False)]

    _tight_pool_gives_what_room_gives(tiny_llama, run, preemption_mode=mode, scheduling_policy=policy)


@pytest.mark.parametrize("mode,max_num_seqs", [("swap", 64), ("recompute", 64), ("swap", 8), ("recompute", 8)])
def test_a_request_that_arrives_after_the_beams_fork_does_not_stall_them(tiny_llama, mode, max_num_seqs):
    """A request newer than every beam is the first victim: under swap it went out and came back
    to a pool held by beams waiting for a preempted sibling, forever. Beams that wait are now the
    first victims, and beams wider than max_num_seqs neither hold every seat nor stay swapped."""
    beam = BeamSearchParams(beam_width=16, max_tokens=150, ignore_eos=True).sampling_params()
    greedy = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    beam_prompt, late_prompt = _prompt(20, seed=3), _prompt(30, seed=4)

    def run(llm) -> dict:
        engine, outputs = llm.engine, {}
        engine.add_request("beams", None, beam_prompt, beam)
        for step in range(20_000):
            if step == 6:  # the beams have forked by now
                engine.add_request("late", None, late_prompt, greedy)
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = [c.token_ids for c in out.outputs]
            if not engine.has_unfinished_requests():
                return outputs
        raise AssertionError(f"not finished after 20,000 steps: {sorted(outputs)} finished")

    _tight_pool_gives_what_room_gives(tiny_llama, run, preemption_mode=mode, max_num_seqs=max_num_seqs)


def _tight_pool_gives_what_room_gives(model: str, run, **flags) -> None:
    """`run(llm)` returns the same in a 24-block pool (preempting, engine `flags`) as with room,
    and leaves every block free."""
    from tests.test_kv_swap import TIGHT

    with LLM(model, kv_cache_memory=1 << 24) as roomy:
        want = run(roomy)
    with LLM(model, kv_cache_memory=TIGHT, swap_space=0.01, **flags) as tight:
        assert run(tight) == want
        assert tight.stats()["num_preemptions"] > 0
        _assert_all_free(tight)
