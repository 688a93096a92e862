"""From the scheduler's per-step updates to what clients see: detokenized text, stop strings,
logprobs, n / best_of selection, beam-search results, streaming deltas, request metrics.

Torch-free and model-free: it needs a tokenizer (anything with `decode`) and the sequences the
scheduler updated. A step is processed in two calls, so that the engine can end the sequences a
stop string finished before their outputs are built:

    stopped = output_processor.detokenize(updates)      # text, logprobs; which hit a stop string
    (the engine finishes `stopped` in the scheduler: their blocks come back in this step)
    outputs = output_processor.make_outputs(updates, stats)
"""

from __future__ import annotations

import time
from collections import Counter

from coordinator.outputs import RequestOutput
from coordinator.request_state import RequestState
from coordinator.sampling_params import RequestOutputKind
from coordinator.sequence import GroupUpdate, Sequence, SequenceGroup, SequenceStatus
from coordinator.stats import IterationStats


class OutputProcessor:
    def __init__(self, tokenizer, stream_interval: int = 1):
        """`stream_interval` (EngineConfig's): a streamed request's output is made when a sample has
        its first token or that many tokens not yet sent, and when the request ends."""
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.requests: dict[str, RequestState] = {}

    def add_request(self, group: SequenceGroup, prompt: str | None) -> None:
        self.requests[group.request_id] = RequestState(group, prompt, self.tokenizer)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def detokenize(self, updates: list[GroupUpdate]) -> list[Sequence]:
        """Record the step's tokens (text, logprobs) and prompt logprobs. Returns the running
        sequences a stop string ended, for the caller to finish; one the scheduler already
        ended by length is relabelled stopped, as its text now ends at the stop string."""
        stopped = []
        for update in updates:
            req = self.requests.get(update.group.request_id)
            if req is None:
                continue  # aborted meanwhile
            for position, entries in update.prompt_logprobs:
                req.record_prompt_logprobs(position, entries)
            keep_logprobs = req.params.logprobs is not None
            # A step may append several tokens to a sequence (accepted drafts): each is decoded
            # and checked as if it came alone, so that min_tokens counts it where it stands.
            later = Counter(new.seq.seq_id for new in update.new_tokens)
            ended: set[int] = set()
            for new in update.new_tokens:
                seq = new.seq
                later[seq.seq_id] -= 1
                completion = req.completion_of(seq)
                if new.logprobs is not None:
                    completion.record_logprobs(new.logprobs, self.tokenizer, keep=keep_logprobs)
                if seq.seq_id in ended:
                    continue  # a stop string ended its text at an earlier token of this step
                new_from = len(completion.detok.text)
                completion.detok.step(seq.token_ids[:len(seq.token_ids) - later[seq.seq_id]])
                if (seq.params.stop and seq.status != SequenceStatus.FINISHED_STOPPED
                        and seq.num_output_tokens - later[seq.seq_id] >= seq.params.min_tokens
                        and completion.truncate_at_stop_string(new_from)):
                    ended.add(seq.seq_id)
                    if seq.status.finished:
                        seq.status = SequenceStatus.FINISHED_STOPPED
                    else:
                        stopped.append(seq)
        return stopped

    def make_outputs(self, updates: list[GroupUpdate], stats: IterationStats) -> list[RequestOutput]:
        """One RequestOutput per request that sampled this step (None-free: with best_of > n,
        beams or output_kind FINAL_ONLY, only once it is done; under a stream interval, only when
        one is due). Finished requests leave, their metrics in `stats`."""
        now = time.monotonic()
        outputs = []
        for update in updates:
            req = self.requests.get(update.group.request_id)
            if req is None or not update.sampled:
                continue
            if req.params.output_kind is RequestOutputKind.FINAL_ONLY and not req.finished:
                continue  # its deltas add up: the final output then carries every token
            if self.stream_interval > 1 and not req.finished and not req.stream_due(self.stream_interval):
                continue  # likewise, until a sample has `stream_interval` tokens to send
            out = req.output()
            if req.finished:
                reason = out.outputs[0].finish_reason if out is not None and out.outputs else None
                self._finish(req, reason or "abort", now, stats)
            if out is not None:
                outputs.append(out)
        return outputs

    def abort_request(self, request_id: str, stats: IterationStats, reason: str = "abort") -> RequestOutput | None:
        """The request's output as it stands, after the scheduler aborted its sequences."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish(req, reason, time.monotonic(), stats)
        return req.output()

    def _finish(self, req: RequestState, reason: str, now: float, stats: IterationStats) -> None:
        stats.finish_reasons.append(reason)
        stats.e2e_latencies.append(now - req.first.arrival_time)
        del self.requests[req.request_id]
