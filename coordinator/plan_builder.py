"""Turn the scheduler's decisions into a StepPlan: flat token ids, positions, slots, block tables."""

from __future__ import annotations

import numpy as np

from coordinator.beam_search import candidates_per_beam
from coordinator.scheduler import SchedulerOutput
from coordinator.sequence import Sequence
from coordinator.structured_output import fill_bitmasks
from workers.step_plan import PromptLogprobsRequest, SeqSampling, StepPlan


def sampling_for(seq: Sequence, eos_token_ids: frozenset[int], seq_id: int | None = None,
                 sample_index: int | None = None, ahead: list[int] = ()) -> SeqSampling:
    """How the worker picks `seq`'s next token. Sample j of a request draws with `seed + j`, as
    vLLM seeds parallel samples: a fork sampled from its parent's logits passes its own `seq_id`
    and `sample_index`; afterwards the forked sequence carries its index. `ahead`: the draft
    tokens before this position (speculative decoding), sampled as if they were already output:
    they count for the penalties, for min_tokens and for the seeded noise's position."""
    p = seq.params
    banned: tuple[int, ...] = ()
    if seq.num_output_tokens + len(ahead) < p.min_tokens:
        stops = set(p.stop_token_ids)
        if not p.ignore_eos:
            stops |= eos_token_ids
        banned = tuple(sorted(stops))
    index = seq.sample_index if sample_index is None else sample_index
    sampling = SeqSampling(seq.seq_id if seq_id is None else seq_id, p.temperature, p.top_p, p.top_k, p.min_p,
                           None if p.seed is None else p.seed + index, banned, position=seq.num_tokens + len(ahead))
    if p.allowed_token_ids is not None:
        sampling.allowed_token_ids = tuple(p.allowed_token_ids)
    if p.logit_bias:
        sampling.logit_bias = tuple(p.logit_bias.items())
    if p.has_penalties:
        sampling.presence_penalty = p.presence_penalty
        sampling.frequency_penalty = p.frequency_penalty
        sampling.repetition_penalty = p.repetition_penalty
        sampling.prompt_token_ids = tuple(seq.prompt_token_ids)
        sampling.output_token_ids = tuple(seq.output_token_ids) + tuple(ahead)
    if p.needs_logprobs:
        sampling.num_logprobs = p.logprobs or 0
    if p.use_beam_search:  # the candidates beam search ranks
        sampling.temperature = 0.0
        sampling.num_logprobs = candidates_per_beam(p.beam_width, 0 if p.ignore_eos else len(eos_token_ids))
    return sampling


def build_step_plan(sched: SchedulerOutput, block_size: int, finished_seq_ids: list[int],
                    eos_token_ids: frozenset[int]) -> StepPlan:
    scheduled = sched.scheduled
    num_seqs = len(scheduled)
    num_tokens = sched.num_tokens
    input_ids = np.empty(num_tokens, dtype=np.int64)
    positions = np.empty(num_tokens, dtype=np.int64)
    slot_mapping = np.empty(num_tokens, dtype=np.int64)
    query_lens = np.empty(num_seqs, dtype=np.int32)
    context_lens = np.empty(num_seqs, dtype=np.int32)
    max_blocks = max((len(seq.block_table) for seq, _ in scheduled), default=0)
    block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
    sample_indices = []
    sampling = []
    # (grammar, drafts) of the sequences that sample under a structured output: a mask row for
    # each sampled position (1 + its drafts).
    grammars = []
    num_mask_rows = 0
    prompt_logprobs = []
    drafts_of = sched.drafts
    logit_rows = [] if drafts_of else None  # the flat row of each sampling entry, with drafts
    t = 0
    for i, (seq, n) in enumerate(scheduled):
        start, table = seq.num_computed_tokens, seq.block_table
        end = start + n
        drafts = drafts_of.get(seq) if drafts_of else None
        if drafts:  # its last token, then its drafts: one causal chunk, every position sampled
            pos = np.arange(start, end)
            input_ids[t] = seq.token_ids[start]
            input_ids[t + 1:t + n] = drafts
            positions[t:t + n] = pos
            slot_mapping[t:t + n] = np.asarray(table)[pos // block_size] * block_size + pos % block_size
            query_lens[i] = n
            context_lens[i] = end
            block_tables[i, :len(table)] = table
            # A grammar's mask rows: one per position, each after the drafts before it.
            first_mask = -1
            if seq.grammar is not None and seq.grammar.active:
                first_mask, num_mask_rows = num_mask_rows, num_mask_rows + n
                grammars.append((seq.grammar, drafts))
            for j in range(n):
                sample_indices.append(i)
                sampling.append(sampling_for(seq, eos_token_ids, ahead=drafts[:j]))
                if first_mask >= 0:
                    sampling[-1].bitmask_index = first_mask + j
                logit_rows.append(t + j)
            t += n
            continue
        if n == 1:  # decodes: plain Python beats numpy's per-call overhead
            input_ids[t] = seq.token_ids[start]
            positions[t] = start
            slot_mapping[t] = table[start // block_size] * block_size + start % block_size
        else:
            pos = np.arange(start, end)
            input_ids[t:t + n] = seq.token_ids[start:end]
            positions[t:t + n] = pos
            slot_mapping[t:t + n] = np.asarray(table)[pos // block_size] * block_size + pos % block_size
        if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
            # Position p's logits predict prompt token p + 1, for every p before the prompt's last.
            last = min(end, seq.num_prompt_tokens - 1)
            prompt_logprobs.append(PromptLogprobsRequest(seq.seq_id, start, t, seq.token_ids[start + 1:last + 1],
                                                         seq.params.prompt_logprobs))
        query_lens[i] = n
        context_lens[i] = end
        block_tables[i, :len(table)] = table
        if end == seq.num_tokens:
            sample_indices.append(i)
            sampling.append(sampling_for(seq, eos_token_ids))
            if logit_rows is not None:
                logit_rows.append(t + n - 1)
            mask_row = -1
            if seq.grammar is not None and seq.grammar.active:  # (not while it waits out a reasoning block)
                mask_row = sampling[-1].bitmask_index = num_mask_rows
                num_mask_rows += 1
                grammars.append((seq.grammar, ()))
            # Parallel samples: the same logits row, once more per fork (sample index j); a fork's
            # first token has its parent's mask (its matcher is copied from the parent's after).
            for j, fork_id in enumerate(seq.fork_ids, start=1):
                sample_indices.append(i)
                if logit_rows is not None:
                    logit_rows.append(t + n - 1)
                sampling.append(sampling_for(seq, eos_token_ids, fork_id, j))
                sampling[-1].bitmask_index = mask_row
        t += n
    return StepPlan(
        seq_ids=[seq.seq_id for seq, _ in scheduled],
        input_ids=input_ids, positions=positions, query_lens=query_lens, context_lens=context_lens,
        block_tables=block_tables, slot_mapping=slot_mapping,
        sample_indices=np.asarray(sample_indices, dtype=np.int64), sampling=sampling,
        logit_rows=None if logit_rows is None else np.asarray(logit_rows, dtype=np.int64),
        copy=sched.copies, swap_out=sched.swap_out, swap_in=sched.swap_in, load=sched.load,
        publish=sched.publish,
        finished_seq_ids=finished_seq_ids, prompt_logprobs=prompt_logprobs,
        token_bitmask=fill_bitmasks(grammars) if grammars else None)
