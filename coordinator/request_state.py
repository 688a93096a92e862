"""What the output processor tracks per request beyond the scheduler's sequences: one Completion
per sample (its detokenizer, what has been streamed, its logprobs), and how RequestOutputs are built.

A request with `best_of` samples starts as one sequence; when its prompt's last token is computed
it forks into `best_of` sequences sharing the prompt's blocks (Scheduler._fork), and each new
sample gets its Completion when its first token arrives.
"""

from __future__ import annotations

from coordinator.detokenizer import IncrementalDetokenizer
from coordinator.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from coordinator.sampling_params import SamplingParams
from coordinator.sequence import Sequence, SequenceGroup
from workers.step_plan import TokenLogprobs


def logprob_dict(entry: TokenLogprobs, tokenizer) -> dict[int, Logprob]:
    """vLLM's shape: {token id: Logprob} for the top k and the chosen (or actual) token."""
    decode = tokenizer.decode
    step = {tid: Logprob(lp, rank, decode([tid])) for rank, (tid, lp) in
            enumerate(zip(entry.top_ids, entry.top_logprobs), start=1)}
    step[entry.token_id] = Logprob(entry.logprob, entry.rank, decode([entry.token_id]))
    return step


class Completion:
    __slots__ = ("seq", "detok", "sent_tokens", "sent_chars", "logprobs", "cumulative_logprob")

    def __init__(self, seq: Sequence, tokenizer):
        self.seq = seq
        self.detok = IncrementalDetokenizer(tokenizer, seq.num_prompt_tokens, seq.params.skip_special_tokens)
        self.sent_tokens = 0
        self.sent_chars = 0
        self.logprobs: list[dict[int, Logprob]] = []
        self.cumulative_logprob = 0.0

    def record_logprobs(self, entry: TokenLogprobs, tokenizer, keep: bool) -> None:
        self.cumulative_logprob += entry.logprob
        if keep:
            self.logprobs.append(logprob_dict(entry, tokenizer))

    def truncate_at_stop_string(self, new_from: int) -> bool:
        """Cut the text at the earliest stop string (after it with include_stop_str_in_output)
        that ends in the text added from `new_from` on: as in vLLM, a stop string is looked for
        only in new text, so one generated before `min_tokens` were reached never ends the
        sequence later."""
        params = self.seq.params
        text, stops = self.detok.text, params.stop
        hits = [(text.find(s, max(0, new_from - len(s) + 1)), s) for s in stops]  # each may end in new text
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        self.detok.text = text[:index + len(stop)] if params.include_stop_str_in_output else text[:index]
        self.seq.stop_reason = stop
        return True

    def output(self, index: int, params: SamplingParams) -> CompletionOutput:
        seq = self.seq
        finished = seq.status.finished
        out_tokens = seq.output_token_ids
        delta_tokens = out_tokens[self.sent_tokens:]
        self.sent_tokens = len(out_tokens)
        text = self.detok.text
        if not finished and params.stop:
            # Hold back a tail that could still grow into a stop string, so none ever leaks.
            text = text[:max(0, len(text) - max(map(len, params.stop)) + 1)]
        delta_text = text[self.sent_chars:]
        self.sent_chars = max(self.sent_chars, len(text))
        return CompletionOutput(
            index, text, out_tokens, seq.status.value if finished else None, seq.stop_reason,
            cumulative_logprob=self.cumulative_logprob if params.needs_logprobs else None,
            logprobs=list(self.logprobs) if params.logprobs is not None else None,
            delta_text=delta_text, delta_token_ids=delta_tokens)


class RequestState:
    """`completions`: one per sample, in output order. Under beam search there are none: the
    result is the group's `beam.hypotheses`."""

    __slots__ = ("request_id", "prompt", "params", "group", "completions", "_by_seq_id", "tokenizer",
                 "prompt_logprobs")

    def __init__(self, group: SequenceGroup, prompt: str | None, tokenizer):
        self.request_id = group.request_id
        self.prompt = prompt
        self.params = group.params
        self.group = group
        self.tokenizer = tokenizer
        self.completions: list[Completion] = []
        self._by_seq_id: dict[int, Completion] = {}
        if group.beam is None:
            self.completion_of(group.first)
        self.prompt_logprobs: dict[int, dict] = {}  # prompt position p -> logprobs of token p + 1

    def completion_of(self, seq: Sequence) -> Completion:
        """The sample's Completion; a new one for a sample just forked."""
        completion = self._by_seq_id.get(seq.seq_id)
        if completion is None:
            completion = self._by_seq_id[seq.seq_id] = Completion(seq, self.tokenizer)
            self.completions.append(completion)
        return completion

    @property
    def first(self) -> Sequence:
        return self.group.first

    def record_prompt_logprobs(self, first_position: int, entries: list[TokenLogprobs]) -> None:
        """Chunks arrive in order; a recomputed prompt (after preemption) brings the same again."""
        for offset, entry in enumerate(entries):
            self.prompt_logprobs.setdefault(first_position + offset, logprob_dict(entry, self.tokenizer))

    def _prompt_logprobs_list(self) -> list | None:
        if self.params.prompt_logprobs is None:
            return None
        return [None] + [self.prompt_logprobs.get(p) for p in range(self.first.num_prompt_tokens - 1)]

    @property
    def finished(self) -> bool:
        return self.group.finished

    def stream_due(self, interval: int) -> bool:
        """Whether a streamed output is due under a stream interval: a sample has its first token,
        or `interval` tokens, not yet sent (vLLM's rule)."""
        for c in self.completions:
            unsent = c.seq.num_output_tokens - c.sent_tokens
            if unsent and (c.sent_tokens == 0 or unsent >= interval):
                return True
        return False

    def _beam_output(self) -> RequestOutput | None:
        beam = self.group.beam
        if not beam.done:
            return None
        outputs = []
        for i, h in enumerate(beam.hypotheses[:self.params.n]):
            text = self.tokenizer.decode(h.token_ids, skip_special_tokens=self.params.skip_special_tokens)
            outputs.append(CompletionOutput(i, text, h.token_ids, "stop" if h.ended_by_eos else "length",
                                            cumulative_logprob=h.cumulative_logprob,
                                            delta_text=text, delta_token_ids=list(h.token_ids)))
        first = self.first
        metrics = RequestMetrics(first.arrival_time, first.first_scheduled_time, first.first_token_time,
                                 first.finish_time, first.num_cached_prompt_tokens, first.num_preemptions)
        return RequestOutput(self.request_id, self.prompt, first.prompt_token_ids, outputs, True, metrics,
                             prompt_logprobs=self._prompt_logprobs_list(),
                             delta_text=outputs[0].delta_text if outputs else "",
                             delta_token_ids=outputs[0].delta_token_ids if outputs else [])

    def output(self) -> RequestOutput | None:
        """The request's state now: every sample, with what it added since the last output. With
        best_of > n nothing streams: the n best (by cumulative logprob) come when all are done;
        likewise under beam search, the n best hypotheses."""
        if self.group.beam is not None:
            return self._beam_output()
        params = self.params
        finished = self.finished
        completions = self.completions
        if params.best_of > params.n:
            if not finished:
                return None
            completions = sorted(completions, key=lambda c: c.cumulative_logprob, reverse=True)[:params.n]
        outputs = [c.output(i, params) for i, c in enumerate(completions)]
        first = self.first
        metrics = RequestMetrics(first.arrival_time, first.first_scheduled_time, first.first_token_time,
                                 max((c.seq.finish_time or 0.0) for c in self.completions) if finished else None,
                                 first.num_cached_prompt_tokens,
                                 sum(c.seq.num_preemptions for c in self.completions))
        return RequestOutput(self.request_id, self.prompt, first.prompt_token_ids, outputs, finished, metrics,
                             prompt_logprobs=self._prompt_logprobs_list(),
                             delta_text=outputs[0].delta_text, delta_token_ids=outputs[0].delta_token_ids)
