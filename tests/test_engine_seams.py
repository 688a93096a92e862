"""The engine's seams, each exercised on its own: the torch-free coordinator, the scheduler's
`update_from_output`, the output processor without a model, and the whole engine loop over a
fake executor that implements the `Executor` interface (no torch, no model)."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest

from coordinator.engine import LLMEngine
from coordinator.kv_cache_manager import KVCacheManager
from coordinator.output_processor import OutputProcessor
from coordinator.sampling_params import SamplingParams
from coordinator.scheduler import Scheduler
from coordinator.sequence import GroupUpdate, NewToken, Sequence, SequenceGroup, SequenceStatus
from coordinator.stats import IterationStats
from pagedserve.config import EngineConfig
from workers.executor import Executor, WorkerFailedError
from workers.model_config import ModelInfo
from workers.step_plan import StepOutput, StepPlan

EOS = 2
BLOCK = 8


def test_coordinator_modules_import_no_torch_and_no_kernels():
    modules = ["coordinator.scheduler", "coordinator.kv_cache_manager", "coordinator.block_pool",
               "coordinator.engine_core", "coordinator.output_processor", "coordinator.input_processor",
               "coordinator.engine", "coordinator.async_engine", "workers.executor", "workers.model_config"]
    code = (f"import sys\nfor m in {modules!r}: __import__(m)\n"
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'kernels', 'triton'))]\n"
            "print(bad)\nsys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# ---- a fake executor: paged "K/V" that is just the tokens, written and read through the tables ----

def next_token(context: list[int], sample: int) -> int:
    """The fake model: a token from the whole context (as the workers read it through the block
    tables), different per parallel sample, never EOS."""
    digest = hashlib.blake2b(repr((context, sample)).encode(), digest_size=4).digest()
    return 100 + int.from_bytes(digest, "little") % 5000


class FakeExecutor(Executor):
    """Implements the interface the engine sees. Its cache holds token ids per slot, so a wrong
    block table, slot or copy-on-write copy changes the tokens it returns."""

    def __init__(self, num_blocks: int, block_size: int, fail_at_step: int | None = None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.cache: dict[int, int] = {}
        self.steps = 0
        self.fail_at_step = fail_at_step
        self.calls: list[str] = []
        self.shut_down = False

    def collective_rpc(self, method: str, *args) -> list:
        self.calls.append(method)
        if method == "num_available_blocks":
            return [self.num_blocks]
        if method == "block_bytes":
            return [1024]
        return [None]

    def execute(self, plan: StepPlan) -> StepOutput:
        self.steps += 1
        if self.steps == self.fail_at_step:
            raise WorkerFailedError("rank 0 died")
        bs = self.block_size
        for src, dst in plan.copy:
            for off in range(bs):
                if src * bs + off in self.cache:
                    self.cache[dst * bs + off] = self.cache[src * bs + off]
        for slot, token in zip(plan.slot_mapping.tolist(), plan.input_ids.tolist()):
            self.cache[slot] = token
        seen_rows: dict[int, int] = {}
        ids, tokens = [], []
        for row, sampling in zip(plan.sample_indices.tolist(), plan.sampling):
            table, length = plan.block_tables[row], int(plan.context_lens[row])
            context = [self.cache[int(table[p // bs]) * bs + p % bs] for p in range(length)]
            sample = seen_rows.get(row, 0)
            seen_rows[row] = sample + 1
            ids.append(sampling.seq_id)
            tokens.append(next_token(context, sample))
        return StepOutput(ids, np.array(tokens, dtype=np.int64))

    def node_id(self):
        return None

    def worker_pids(self) -> list[int]:
        return []

    def shutdown(self) -> None:
        self.shut_down = True


def fake_engine(bundled_tokenizer, num_blocks=64, executor=None, **config) -> LLMEngine:
    config = EngineConfig(block_size=BLOCK, **config)
    model = ModelInfo(vocab_size=49152, max_context=1024, num_attention_heads=4, num_kv_heads=2,
                      intermediate_size=128, eos_token_ids=frozenset({EOS}))
    return LLMEngine(config, executor or FakeExecutor(num_blocks, BLOCK), model, bundled_tokenizer)


def reference(prompt: list[int], max_tokens: int, sample: int = 0) -> list[int]:
    tokens = list(prompt)
    tokens.append(next_token(tokens, sample))  # the first token: sample j of the prompt's logits
    for _ in range(max_tokens - 1):
        tokens.append(next_token(tokens, 0))
    return tokens[len(prompt):]


def run_all(engine: LLMEngine) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def test_engine_over_a_fake_executor_gives_the_reference_tokens_under_preemption(bundled_tokenizer):
    # 7 blocks of 8 tokens for 6 requests of up to 43 tokens: preemption is certain.
    engine = fake_engine(bundled_tokenizer, num_blocks=7, max_num_batched_tokens=16, preemption_mode="recompute",
                         enable_prefix_caching=True)
    prompts = {f"r{i}": [10 + i] * (3 + 5 * i) + [7, 8, 9] for i in range(6)}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, None, prompt, SamplingParams(max_tokens=12, temperature=0.0))
    finished = run_all(engine)
    for request_id, prompt in prompts.items():
        assert list(finished[request_id].outputs[0].token_ids) == reference(prompt, 12), request_id
    stats = engine.stats()
    assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_used"] == 0 and stats["requests_finished_length"] == 6
    assert stats["generation_tokens"] == 6 * 12 and not engine.scheduler.groups


def test_parallel_samples_fork_in_update_from_output_and_share_the_prompt(bundled_tokenizer):
    engine = fake_engine(bundled_tokenizer, enable_prefix_caching=False)
    prompt = list(range(300, 318))  # 2 full blocks + 2 tokens
    engine.add_request("n3", None, prompt, SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=1))
    group = engine.scheduler.groups["n3"]
    engine.step()  # the prompt, and the step's token for each of the 3 samples
    assert len(group.seqs) == 3 and group.first.fork_ids == []
    pool = engine.scheduler.kv.pool
    assert all(s.block_table == group.first.block_table for s in group.seqs)
    assert all(pool.ref_counts[b] == 3 for b in group.first.block_table)
    out = run_all(engine)["n3"]
    assert [list(c.token_ids) for c in out.outputs] == [reference(prompt, 5, j) for j in range(3)]
    assert pool.num_used == 0


def test_token_level_stops_end_sequences_in_the_scheduler(bundled_tokenizer):
    kv = KVCacheManager(16, 4, enable_prefix_caching=False)
    sched = Scheduler(kv, 8, 64, True, eos_token_ids=frozenset({EOS}), max_model_len=12)
    eos = sched.add_request("eos", [5, 6, 7], SamplingParams(max_tokens=10))
    stop_id = sched.add_request("stop-id", [5, 6, 7], SamplingParams(max_tokens=10, stop_token_ids=[42]))
    min_tok = sched.add_request("min", [5, 6, 7], SamplingParams(max_tokens=10, min_tokens=2))
    length = sched.add_request("len", [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], SamplingParams(max_tokens=10))
    out = sched.schedule()
    tokens = {eos.first.seq_id: EOS, stop_id.first.seq_id: 42, min_tok.first.seq_id: EOS, length.first.seq_id: 50}
    updates = sched.update_from_output(out, StepOutput(list(tokens), np.array(list(tokens.values()))),
                                       IterationStats())
    assert {u.group.request_id for u in updates} == {"eos", "stop-id", "min", "len"}
    assert eos.first.status is SequenceStatus.FINISHED_STOPPED
    assert stop_id.first.status is SequenceStatus.FINISHED_STOPPED and stop_id.first.stop_reason == 42
    assert min_tok.first.status is SequenceStatus.RUNNING  # EOS before min_tokens does not stop
    assert length.first.status is SequenceStatus.FINISHED_LENGTH  # max_model_len 12 reached
    assert set(sched.groups) == {"min"}  # finished requests left at once, their blocks freed
    assert sorted(sched.take_finished_seq_ids()) == sorted([eos.first.seq_id, stop_id.first.seq_id,
                                                             length.first.seq_id])
    assert kv.pool.num_used == 1


def test_a_failed_worker_surfaces_as_the_executors_typed_error(bundled_tokenizer):
    executor = FakeExecutor(64, BLOCK, fail_at_step=2)
    engine = fake_engine(bundled_tokenizer, executor=executor)
    engine.add_request("a", None, [1, 5, 6], SamplingParams(max_tokens=4))
    engine.step()
    with pytest.raises(WorkerFailedError):
        engine.step()
    engine.shutdown()
    assert executor.shut_down and executor.calls[:3] == ["num_available_blocks", "init_cache", "block_bytes"]


def test_a_refused_configuration_shuts_the_executor_down(bundled_tokenizer):
    executor = FakeExecutor(2, BLOCK)  # 16 tokens of pool
    with pytest.raises(ValueError, match="max_model_len \\(100\\) exceeds the KV pool"):
        fake_engine(bundled_tokenizer, executor=executor, max_model_len=100)
    assert executor.shut_down


# ---- the output processor, without a model -------------------------------------------------------

def _sample(request_id: str, prompt: list[int], params: SamplingParams, seq_id: int = 0) -> SequenceGroup:
    seq = Sequence(seq_id, request_id, prompt, params)
    seq.status = SequenceStatus.RUNNING
    return SequenceGroup(seq)


def _feed(processor: OutputProcessor, group: SequenceGroup, seq: Sequence, token: int):
    seq.token_ids.append(token)
    update = GroupUpdate(group, [NewToken(seq, token, None)], sampled=True)
    stopped = processor.detokenize([update])
    for s in stopped:
        s.status = SequenceStatus.FINISHED_STOPPED  # what the engine's scheduler.finish does
    return stopped, processor.make_outputs([update], IterationStats())


def test_output_processor_streams_deltas_and_cuts_at_a_stop_string(bundled_tokenizer):
    tok = bundled_tokenizer
    words = tok.encode(" the cat sat on the mat")
    group = _sample("s", [1, 2, 3], SamplingParams(stop=["on the"], max_tokens=50))
    processor = OutputProcessor(tok)
    processor.add_request(group, "prompt")
    streamed, stopped = "", []
    for token in words:
        stopped, outs = _feed(processor, group, group.first, token)
        streamed += outs[0].delta_text
        if stopped:
            break
    assert stopped == [group.first]
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "stop"
    assert outs[0].outputs[0].stop_reason == "on the"
    assert streamed == outs[0].outputs[0].text == " the cat sat "  # nothing past the stop leaked
    assert not processor.has_unfinished_requests()


def test_output_processor_relabels_a_length_finish_that_completes_a_stop_string(bundled_tokenizer):
    tok = bundled_tokenizer
    group = _sample("s", [1, 2, 3], SamplingParams(stop=["cat"], max_tokens=2))
    processor = OutputProcessor(tok)
    processor.add_request(group, None)
    first, second = tok.encode(" the cat")[:2]
    _feed(processor, group, group.first, first)
    group.first.status = SequenceStatus.FINISHED_LENGTH  # the scheduler ended it at max_tokens
    stopped, outs = _feed(processor, group, group.first, second)
    assert stopped == []  # already finished: nothing for the engine to end
    assert outs[0].outputs[0].finish_reason == "stop" and outs[0].outputs[0].text == " the "


def test_output_processor_abort_reports_what_was_generated(bundled_tokenizer):
    group = _sample("a", [1, 2, 3], SamplingParams(max_tokens=50))
    processor = OutputProcessor(bundled_tokenizer)
    processor.add_request(group, None)
    _feed(processor, group, group.first, 300)
    group.first.status = SequenceStatus.FINISHED_ABORTED
    stats = IterationStats()
    out = processor.abort_request("a", stats)
    assert out.finished and out.outputs[0].token_ids == [300] and out.outputs[0].finish_reason == "abort"
    assert stats.finish_reasons == ["abort"] and len(stats.e2e_latencies) == 1
    assert processor.abort_request("a", stats) is None


def test_a_burst_cannot_overfill_the_queue_while_its_prompts_are_tokenized(bundled_tokenizer):
    import asyncio

    from coordinator.async_engine import AsyncEngine, QueueFullError

    async def burst():
        engine = AsyncEngine(fake_engine(bundled_tokenizer), max_queued_requests=2)
        engine.start()

        async def first_output(i):
            stream = engine.generate(f"prompt number {i}", None, SamplingParams(max_tokens=2))
            try:
                return await anext(stream)
            finally:
                await stream.aclose()

        results = await asyncio.gather(*(first_output(i) for i in range(6)), return_exceptions=True)
        await engine.stop()
        return results

    results = asyncio.run(burst())
    refused = [r for r in results if isinstance(r, QueueFullError)]
    assert len(refused) == 4 and sum(not isinstance(r, BaseException) for r in results) == 2


def test_stats_between_steps_see_added_and_aborted_requests(bundled_tokenizer):
    engine = fake_engine(bundled_tokenizer)
    engine.add_request("a", None, [5, 6, 7], SamplingParams(max_tokens=3))
    engine.add_request("b", None, [5, 6, 8], SamplingParams(max_tokens=3))
    engine.refresh_stats()
    assert engine.stats()["num_requests_waiting"] == 2
    engine.step()
    engine.abort_request("a")
    engine.refresh_stats()
    stats = engine.stats()
    assert stats["num_requests_running"] == 1 and stats["requests_finished_abort"] == 1


def test_requests_are_logged_as_they_arrive_and_end_when_asked(bundled_tokenizer, capsys):
    import asyncio
    import logging

    from coordinator import request_log
    from coordinator.async_engine import AsyncEngine

    async def serve():
        engine = AsyncEngine(fake_engine(bundled_tokenizer), max_queued_requests=8)
        engine.start()
        async for _ in engine.generate("quiet", None, SamplingParams(max_tokens=2), "before"):
            pass
        request_log.enable(max_len=12)
        async for _ in engine.generate("a prompt longer than twelve characters", None,
                                       SamplingParams(max_tokens=3, ignore_eos=True), "r1"):
            pass
        stream = engine.generate(None, [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True), "r2")
        await anext(stream)
        await stream.aclose()  # the client left: aborted
        await engine.stop()

    try:
        asyncio.run(serve())
    finally:
        logging.getLogger("pagedserve.requests").handlers.clear()  # the next tests log nothing
    lines = [line for line in capsys.readouterr().err.splitlines() if "request" in line]
    assert not any("before" in line for line in lines)  # off until enabled
    assert "Received request r1: prompt: 'a prompt lon...'" in lines[0] and "max_tokens=3" in lines[0]
    assert "Finished request r1: length, 3 tokens generated" in lines[1]
    shown = bundled_tokenizer.decode([5, 6, 7])[:12] + "..."  # token ids are shown decoded
    assert f"Received request r2: prompt: {shown!r}, 3 prompt tokens" in lines[2]
    assert "Finished request r2: aborted" in lines[3]
