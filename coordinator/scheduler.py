"""The scheduler: which sequences run this step, how many tokens each, and who is preempted.

One token budget per step (`max_num_batched_tokens`) and a cap on running sequences
(`max_num_seqs`, which counts the samples or beams a running request will still fork into: a
request is admitted once there are seats for all of them, or alone where it is wider than the
cap); no separate prefill and decode phases: each sequence's computed tokens catch
up to its total, a prefill chunk or one decode token at a time, so chunked prefill falls out of
the budget. Order: running sequences first (their decodes, then their unfinished prefill chunks,
oldest first), then waiting ones, FCFS.

Policies: `fcfs` admits in arrival order and nobody overtakes the head of the queue. `priority`
admits the waiting sequence with the lowest effective priority first (ties: earlier arrival),
where effective priority = priority - (steps waited // PRIORITY_AGING_STEPS): a request gains one
level per PRIORITY_AGING_STEPS engine steps spent waiting, so a low-priority request is overtaken
by later high-priority arrivals for a bounded number of steps and never starves. Its preemption
victim is the running sequence with the largest priority value (ties: the newest).

Preemption: when a running sequence cannot get its next block, the newest running sequence (under
`priority`, the least important one) is preempted, with the CPU KV store by swap (it and the other
running samples or beams of its request move to the store together and come back, FCFS and
before any new admission, once blocks are free), otherwise by recompute: its blocks are freed
(its full blocks stay in the prefix cache), it goes back to the front of the waiting queue with
its generated tokens kept, and on readmission its prefill recomputes (or re-finds in the prefix
cache) the whole context. A step that preempts admits nothing and swaps nothing in. A beam
search whose beams cannot all hold their blocks at once parks the beams that wait for a
preempted sibling (`_park_idle_beams`): they leave the pool until the search advances.

Loads from the CPU prefix tier may be spread over steps (`max_loaded_blocks_per_step`, set on a P/D
decode replica): a sequence whose prefix continues in the tier loads at most the step's remaining
load budget and computes nothing in that step; it loads more, or starts computing, in the next.

Speculative decoding (`speculative`, coordinator/spec_decode.py): a decode with n-gram drafts is
scheduled for its last token plus the drafts; `update_from_output` keeps the accepted ones.

After the workers ran a step, `update_from_output` does the scheduler's own bookkeeping, as vLLM's
does: computed tokens advance, full blocks enter the prefix cache, sampled tokens are appended,
a request's samples fork off its first sequence, beam searches advance, structured outputs'
matchers advance (coordinator/structured_output.py), and a sequence that hit a token-level stop
(EOS, a stop token id, max_tokens, max_model_len, a complete structured output) is finished and
its blocks freed at once. Stop strings need text: the output processor finds them and calls `finish`.

Workers run a step's transfers in a fixed order: swap-outs (preempted groups, CPU prefix-tier
saves of evicted blocks), then copy-on-write copies, then swap-ins (swapped groups coming back,
CPU prefix-tier loads), then the forward pass. So every device block is read before it is
overwritten; CPU blocks read by a step are held until `KVCacheManager.end_step`, so no write reuses them.
A CPU block read back whose checksum fails is reported by the workers, and `update_from_output`
recomputes the sequences that hold it before anything computed from it is kept or streamed.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from coordinator.beam_search import BeamState, advance_beams
from coordinator.kv_cache_manager import KVCacheManager
from coordinator.sampling_params import SamplingParams
from coordinator.sequence import GroupUpdate, NewToken, Sequence, SequenceGroup, SequenceStatus, check_stop
from coordinator.spec_decode import propose_ngram, speculates
from coordinator.stats import IterationStats
from pagedserve.config import SpeculativeConfig
from workers.step_plan import StepOutput

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)
    preempted: list[Sequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    load: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block), CPU tier
    publish: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu) after the forward pass
    queue_times: list[float] = field(default_factory=list)  # of requests scheduled for the first time
    # Speculative decoding: a decode's draft tokens, computed after its last token in this step.
    drafts: dict[Sequence, list[int]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


PRIORITY_AGING_STEPS = 64
# preemption_mode "auto" swaps a victim with at least this many computed tokens when the store has
# room. benchmarks/swap.py measures both costs of SmolLM2 on these 2 cores in one run: a swap out
# and back through shared memory costs ~30 us fixed + 6.9 us per token (46 KB of fp32 K/V), while
# recomputing costs ~1,565 us per token of prefill; swapping is cheaper from 0.02 tokens on. So
# every victim with a computed token swaps; one with none has nothing to swap and recomputes.
AUTO_SWAP_MIN_TOKENS = 1
# A request in the batch of this many consecutive faulted steps (no step with it succeeded in
# between), the only such request of its batch, is a poison request: it is ended so that the
# others can resume. Where several share that count they are run one per step (isolated), so
# that the next fault names one; innocents are never ended for sharing a batch with a poison.
POISON_FAULTS = 2


def kv_shared(kv: KVCacheManager) -> bool:
    """Whether `kv`'s CPU pool is the store prefill and decode replicas share."""
    return kv.handoff is not None and kv.cpu_pool is not None


class Scheduler:
    """`policy` and `preemption_mode` come checked by EngineConfig; `eos_token_ids` and
    `max_model_len` end sequences in `update_from_output`."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool, policy: str = "fcfs", preemption_mode: str = "recompute",
                 eos_token_ids: frozenset[int] = frozenset(), max_model_len: int | None = None,
                 long_prefill_token_threshold: int = 0, max_loaded_blocks_per_step: int = 0,
                 speculative: SpeculativeConfig | None = None):
        self.policy = policy
        self.preemption_mode = preemption_mode
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.groups: dict[str, SequenceGroup] = {}  # unfinished requests by id
        self._seq_ids = itertools.count()
        self.finished_seq_ids: list[int] = []  # since the last plan: workers drop their state
        self.peak_blocks_used = 0
        self.swap_out_blocks = 0
        self.swap_in_blocks = 0
        self.num_swap_preemptions = 0  # of num_preemptions, those that swapped
        self.num_steps = 0
        self._waiting_since: dict[int, int] = {}  # seq_id -> step it (re)entered the queue
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        # The most prompt tokens one sequence computes per step (0: the budget's): small on a P/D
        # decode replica, whose prompt tails must not stretch its decodes' steps.
        self.chunk_cap = long_prefill_token_threshold or max_num_batched_tokens
        self.max_loaded_blocks_per_step = max_loaded_blocks_per_step  # 0: every hit at admission
        self.speculative = speculative  # n-gram drafts for decodes (coordinator/spec_decode.py)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Groups swapped out together (a request's running samples or beams), oldest first.
        self.swapped: deque[list[Sequence]] = deque()
        self.num_preemptions = 0
        # request id -> consecutive faulted steps it was in the batch of (see POISON_FAULTS).
        self.fault_suspects: dict[str, int] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, publish_kv: bool = False) -> SequenceGroup:
        """Queue a request (checked already: the input processor refuses what could fail).
        `publish_kv`: a prefill replica's prefill-only request, whose full prompt blocks go to
        the store shared with decode replicas in the step that completes them."""
        first = Sequence(next(self._seq_ids), request_id, prompt_token_ids, params)
        first.priority = priority
        first.publish_kv = publish_kv and kv_shared(self.kv)
        beam = None
        if params.use_beam_search:  # beams fork as the search goes
            beam = BeamState(params.beam_width, params.length_penalty, params.early_stopping)
        else:
            first.fork_ids = [next(self._seq_ids) for _ in range(params.best_of - 1)]
        group = self.groups[request_id] = SequenceGroup(first, beam)
        self.add(first)
        return group

    def abort_request(self, request_id: str) -> SequenceGroup | None:
        """End a request in any state; every block of every sample comes back at once."""
        group = self.groups.pop(request_id, None)
        self.fault_suspects.pop(request_id, None)
        if group is None:
            return None
        group.first.fork_ids = []
        for seq in group.seqs:
            if not seq.status.finished:
                self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        if group.beam is not None:
            group.beam.done = True  # the hypotheses so far are the answer
        return group

    @property
    def num_waiting_requests(self) -> int:
        """Requests with a sequence waiting for admission: a request's preempted samples or parked
        beams count it once."""
        return len({seq.request_id for seq in self.waiting})

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._waiting_since[seq.seq_id] = self.num_steps
        self.waiting.append(seq)

    def effective_priority(self, seq: Sequence) -> int:
        waited = self.num_steps - self._waiting_since.get(seq.seq_id, self.num_steps)
        return seq.priority - waited // PRIORITY_AGING_STEPS

    def _next_waiting(self) -> Sequence | None:
        """The next sequence to admit, None where every waiting one is a parked beam."""
        if self.policy == "fcfs":
            return next((s for s in self.waiting if not self._parked(s)), None)
        return min((s for s in self.waiting if not self._parked(s)),
                   key=lambda s: (self.effective_priority(s), s.arrival_time), default=None)

    def _parked(self, seq: Sequence) -> bool:
        """A beam out of the pool that already has its next candidates: it needs nothing computed
        before its search advances (which appends its token), so it is not admitted till then."""
        group = self.groups.get(seq.request_id)
        return group is not None and group.beam is not None and seq.seq_id in group.pending_beam_logprobs

    def _idle_beam(self, seq: Sequence) -> bool:
        return seq.num_computed_tokens == seq.num_tokens and self._parked(seq)

    def _park_idle_beams(self, out: SchedulerOutput) -> bool:
        """Where everything running is a beam that has its candidates and waits for a sibling
        beam that cannot get blocks, nothing would ever free: those beams leave the pool (as a
        recompute preemption) and wait parked until their search advances, so that the sibling
        computes. A search whose beams cannot all hold their blocks at once thus goes on, one
        part of its beams at a time. Not in a step that swapped in (it moved on; its copies may be
        writing into those beams' blocks). Returns whether any was parked."""
        idle = [s for s in self.running if self._idle_beam(s)]
        if not idle or len(idle) != len(self.running) or out.swap_in:
            return False
        for seq in idle:  # (none is in out.scheduled: a sequence with nothing to compute never is)
            self.running.remove(seq)
            self._recompute(seq)
        return True

    def _victim(self) -> Sequence:
        """The running sequence to preempt: a beam that only waits for a sibling (it holds blocks
        and can do nothing), else the newest, or under `priority` the least important."""
        idle = next((s for s in reversed(self.running) if self._idle_beam(s)), None)
        if idle is not None:
            self.running.remove(idle)
            return idle
        if self.policy == "fcfs":
            return self.running.pop()
        victim = max(reversed(self.running), key=lambda s: (s.priority, s.arrival_time))
        self.running.remove(victim)
        return victim

    def add_running(self, seq: Sequence) -> None:
        """A fork of a running sequence: it runs from the next step on, on its parent's blocks."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        kv = self.kv
        self._load_budget = self.max_loaded_blocks_per_step or None

        # Decodes first, then unfinished prefill chunks, each oldest first: a long prompt's chunks
        # must not stall the decodes of sequences that arrived after it.
        remaining = {seq: seq.num_tokens - seq.num_computed_tokens for seq in self.running}
        order = [seq for seq in self.running if remaining[seq] == 1] + \
                [seq for seq in self.running if remaining[seq] > 1]
        scheduled: dict[Sequence, int] = {}
        for seq in order:
            if budget <= 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            if remaining[seq] > 1 and self._load_budget is not None and self._loads_instead(seq):
                continue  # its next blocks are in the CPU tier: loaded this step or a later one
            num_new = min(remaining[seq], budget, self.chunk_cap)
            drafts = self._drafts(seq, budget) if self.speculative is not None and remaining[seq] == 1 else None
            if drafts and kv.allocate_slots(seq, 1 + len(drafts)):
                out.drafts[seq] = drafts  # (no room for them: it decodes one token, as usual)
                scheduled[seq] = 1 + len(drafts)
                budget -= 1 + len(drafts)
                continue
            while not kv.allocate_slots(seq, num_new):
                group = self._preempt(self._victim(), out)
                for s in group:
                    out.drafts.pop(s, None)
                    budget += scheduled.pop(s, 0)  # their slots this step are given back
                out.preempted += group
                if seq in group:
                    break
            else:
                scheduled[seq] = num_new
                budget -= num_new
        out.scheduled = list(scheduled.items())

        # Bring work back only if nothing was preempted: what was just evicted comes first.
        # Swapped groups return FCFS before anything new is admitted.
        if not out.preempted:
            self._swap_in(out)
            if not self.swapped:
                self._admit_waiting(out, budget)
        if kv_shared(kv):  # (a store lost meanwhile: the prompt is simply not handed over)
            for seq, n in out.scheduled:
                if seq.publish_kv and seq.num_computed_tokens + n == seq.num_tokens:
                    out.publish += kv.publish(seq)
        out.copies = kv.drain_copies()
        out.load = kv.drain_loads()
        out.swap_out += kv.save_evicted()
        self.peak_blocks_used = max(self.peak_blocks_used, kv.pool.num_used)
        now = time.monotonic()
        for seq, _ in out.scheduled:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
                if seq.num_preemptions == 0 and self._is_first(seq):
                    out.queue_times.append(now - seq.arrival_time)
        return out

    def take_finished_seq_ids(self) -> list[int]:
        finished, self.finished_seq_ids = self.finished_seq_ids, []
        return finished

    def _is_first(self, seq: Sequence) -> bool:
        """Whether `seq` is its request's first sequence (a bare sequence counts as its own)."""
        group = self.groups.get(seq.request_id)
        return group is None or seq is group.first

    # ---- after the step ------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, output: StepOutput, stats: IterationStats
                           ) -> list[GroupUpdate]:
        """The workers ran `out`: clear its batch of earlier faults, advance each sequence, append
        its sampled token, fork, advance beams, finish what stopped (see the module docstring). Returns each touched request's
        update, for the output processor; token timings and counts go to `stats`. Sequences that
        read a CPU block whose checksum failed recompute instead (`_recompute_corrupt`)."""
        self.clear_fault_suspects(out)
        corrupt = output.corrupt_cpu_blocks
        discarded = self._recompute_corrupt(out, corrupt, stats) if corrupt else set()
        token_list = output.token_ids.tolist()
        sampled = dict(zip(output.seq_ids, token_list))
        logprobs = dict(zip(output.seq_ids, output.logprobs)) if output.logprobs else {}
        rows_of: dict[int, list[int]] = {}  # a speculating sequence's rows: its last token's, its drafts'
        if out.drafts:
            for row, seq_id in enumerate(output.seq_ids):
                rows_of.setdefault(seq_id, []).append(row)
        now = time.monotonic()
        updates: dict[str, GroupUpdate] = {}

        def update_of(seq: Sequence) -> GroupUpdate:
            update = updates.get(seq.request_id)
            if update is None:
                group = self.groups.get(seq.request_id) or SequenceGroup(seq)
                update = updates[seq.request_id] = GroupUpdate(group)
            return update

        for seq, n in out.scheduled:
            if seq in discarded:
                continue  # computed from bad K/V: nothing of it is kept, its sampled token neither
            if seq in out.drafts:
                self._accept_drafts(seq, out.drafts[seq], rows_of[seq.seq_id], token_list, output.logprobs,
                                    update_of(seq), now, stats)
                continue
            seq.num_computed_tokens += n
            self.kv.commit_computed(seq)
            if seq.seq_id in output.prompt_logprobs:
                update_of(seq).prompt_logprobs.append(output.prompt_logprobs[seq.seq_id])
            if seq.seq_id not in sampled:
                continue  # a prefill chunk that is not the last
            update = update_of(seq)
            update.sampled = True
            self._record_token_time(seq, update.group, now, stats)
            group = update.group
            if group.beam is not None:
                group.pending_beam_logprobs[seq.seq_id] = logprobs[seq.seq_id]
                continue
            for s in [seq] + (self._fork(group, seq) if seq.fork_ids else []):
                token = sampled[s.seq_id]
                s.token_ids.append(token)
                stats.num_generation_tokens += 1
                update.new_tokens.append(NewToken(s, token, logprobs.get(s.seq_id)))
                status = check_stop(s, token, self.eos_token_ids, self.max_model_len)
                if status is None and s.grammar is not None and s.grammar.accept(token):
                    status = SequenceStatus.FINISHED_STOPPED  # its structured output is complete
                if status is not None:
                    self.finish(s, status)
        for update in updates.values():
            if update.group.beam is not None and update.sampled:
                stats.num_generation_tokens += advance_beams(self, update.group, self.eos_token_ids,
                                                             self.max_model_len)
        return list(updates.values())

    def _accept_drafts(self, seq: Sequence, drafts: list[int], rows: list[int], tokens: list[int],
                       logprobs: list | None, update: GroupUpdate, now: float, stats: IterationStats) -> None:
        """A speculating decode: its last token and drafts were computed, and each position
        sampled. Keep the drafts up to the first that differs from its position's sample, then
        that sample (or, all accepted, the last position's): 1 to len(drafts) + 1 new tokens. Only
        the accepted positions count as computed; the rejected ones' K/V is overwritten later."""
        sampled = [tokens[r] for r in rows]
        accepted = 0
        while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
            accepted += 1
        seq.num_computed_tokens += 1 + accepted
        self.kv.commit_computed(seq)
        stats.spec_draft_tokens += len(drafts)
        stats.spec_accepted_tokens += accepted
        stats.spec_verify_steps += 1
        update.sampled = True
        self._record_token_time(seq, update.group, now, stats)
        for row, token in zip(rows[:accepted + 1], sampled[:accepted + 1]):
            seq.token_ids.append(token)
            stats.num_generation_tokens += 1
            update.new_tokens.append(NewToken(seq, token, logprobs[row] if logprobs else None))
            status = check_stop(seq, token, self.eos_token_ids, self.max_model_len)
            if status is None and seq.grammar is not None and seq.grammar.accept(token):
                status = SequenceStatus.FINISHED_STOPPED  # its structured output is complete
            if status is not None:
                self.finish(seq, status)
                return

    def _recompute_corrupt(self, out: SchedulerOutput, corrupt: list[int], stats: IterationStats) -> set[Sequence]:
        """CPU blocks this step read back (`out.swap_in`, `out.load`) failed their checksum: the
        running sequences holding the device blocks they went to recompute (to the front of
        waiting, tokens kept; not counted as preemptions), and neither prefix-cache tier keeps
        the blocks. A swap-in's sequences had not run on the data yet (they run from the next
        step on); a load's ran this very step, so the caller drops what it computed for them.
        Returns those sequences."""
        bad = set(corrupt)
        devices = {d for c, d in out.swap_in + out.load if c in bad}
        self.kv.drop_corrupt(bad, devices)
        victims = [seq for seq in self.running if not devices.isdisjoint(seq.block_table)]
        for seq in reversed(victims):
            self.running.remove(seq)
            self.kv.free(seq)
            self._requeue_at_front(seq)
        stats.kv_checksum_failures += len(bad)
        log.warning("KV store blocks %s failed their checksum; recomputing request(s) %s", sorted(bad),
                    ", ".join(dict.fromkeys(seq.request_id for seq in victims)) or "(none)")
        return set(victims)

    @staticmethod
    def _record_token_time(seq: Sequence, group: SequenceGroup, now: float, stats: IterationStats) -> None:
        if seq.last_token_time is not None:
            stats.inter_token_latencies.append(now - seq.last_token_time)
        seq.last_token_time = now
        if seq.first_token_time is None:
            seq.first_token_time = now
            if seq is group.first:
                stats.num_prompt_tokens += seq.num_prompt_tokens
                stats.time_to_first_tokens.append(now - seq.arrival_time)

    def _fork(self, group: SequenceGroup, parent: Sequence) -> list[Sequence]:
        """The parent's prompt is computed: fork the other samples onto its blocks (ref counts,
        no copy; the first write into the shared partial block copies it)."""
        children = [self.spawn(parent, fork_id) for fork_id in parent.fork_ids]
        for j, child in enumerate(children, start=1):
            child.sample_index = j
        group.seqs += children
        parent.fork_ids = []
        return children

    def spawn(self, parent: Sequence, seq_id: int | None = None) -> Sequence:
        """A new sample or beam continuing `parent`: its tokens and timings, its blocks shared."""
        child = Sequence(next(self._seq_ids) if seq_id is None else seq_id, parent.request_id,
                         parent.prompt_token_ids, parent.params)
        child.token_ids = list(parent.token_ids)
        child.priority, child.arrival_time = parent.priority, parent.arrival_time
        child.first_scheduled_time, child.first_token_time = parent.first_scheduled_time, parent.first_token_time
        child.last_token_time = parent.last_token_time
        child.num_cached_prompt_tokens = parent.num_cached_prompt_tokens
        if parent.grammar is not None:  # each sample its own matcher, in the parent's state
            child.grammar = parent.grammar.copy()
        if parent.status == SequenceStatus.RUNNING:
            self.kv.fork(parent, child)
            self.add_running(child)
        else:  # the parent was preempted: the child recomputes (or re-finds) its context too
            self.add(child)
        return child

    def _forks_to_come(self, seq: Sequence) -> int:
        """How many more sequences `seq` turns into at its first token: its samples' forks
        (n/best_of), or a beam search's first step, which forks its one beam into beam_width."""
        if seq.fork_ids:
            return len(seq.fork_ids)
        group = self.groups.get(seq.request_id)
        if group is not None and group.beam is not None and group.seqs == [seq] and seq.num_output_tokens == 0:
            return group.params.beam_width - 1
        return 0

    def _seats_taken(self) -> int:
        """Running sequences and the forks they will make: max_num_seqs caps all of them, as vLLM
        counts every sample of a request, so a fork never lifts a step past the cap."""
        return len(self.running) + sum(self._forks_to_come(s) for s in self.running)

    def _swap_in(self, out: SchedulerOutput) -> None:
        # (A group larger than max_num_seqs, a wide beam search, comes back once nothing runs.)
        while self.swapped and (not self.running or self._seats_taken() + sum(
                1 + self._forks_to_come(s) for s in self.swapped[0]) <= self.max_num_seqs):
            copies = self.kv.swap_in(self.swapped[0])
            if copies is None:
                return
            for seq in self.swapped.popleft():
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)  # scheduled from the next step on
            out.swap_in += copies
            self.swap_in_blocks += len(copies)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        kv = self.kv
        isolated = None  # the one twice-faulted request this step may admit (all its samples)
        if self.waiting and len(self.running) >= self.max_num_seqs:
            self._park_idle_beams(out)  # beams waiting for a sibling must not hold every seat
        seats = self._seats_taken()
        while self.waiting and budget > 0 and seats < self.max_num_seqs:
            seq = self._next_waiting()
            if seq is None:
                break
            need = 1 + self._forks_to_come(seq)
            if self.running and seats + need > self.max_num_seqs:
                break  # it waits for seats for all its samples (a request wider than the cap runs alone)
            if self.fault_suspects.get(seq.request_id, 0) >= POISON_FAULTS:
                if isolated not in (None, seq.request_id):
                    break
                isolated = seq.request_id
            # Prompt logprobs need every prompt position computed: no prefix-cache hits for them.
            computed, loaded = [], []
            if seq.params.prompt_logprobs is None:
                computed = kv.get_computed_blocks(seq)
                loaded = kv.get_cpu_tier_blocks(seq, len(computed))
            spread = self._load_budget is not None and len(loaded) > self._load_budget
            if spread:  # the rest of its hits load in later steps; nothing is computed meanwhile
                if not self._load_budget:
                    break
                loaded = loaded[:self._load_budget]
            num_new = 0 if spread else seq.num_tokens - (len(computed) + len(loaded)) * kv.block_size
            if num_new > budget and not self.enable_chunked_prefill:
                break
            num_new = min(num_new, budget, self.chunk_cap)
            if not kv.allocate_slots(seq, num_new, computed, keep_watermark=bool(self.running), cpu_blocks=loaded):
                if self._park_idle_beams(out):
                    continue  # the head again, with their blocks back
                break  # nobody overtakes the head of the queue (the first in policy order)
            if self._load_budget is not None:
                self._load_budget -= len(loaded)
            kv.record_prefix_query(seq.num_tokens, len(computed) * kv.block_size, len(loaded) * kv.block_size)
            if seq.first_scheduled_time is None:  # its first admission
                seq.num_cached_prompt_tokens = (len(computed) + len(loaded)) * kv.block_size
            self.waiting.remove(seq)
            self._waiting_since.pop(seq.seq_id, None)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seats += need
            if num_new:
                out.scheduled.append((seq, num_new))
            budget -= num_new

    def _drafts(self, seq: Sequence, budget: int) -> list[int]:
        """n-gram drafts for a decode, as many as its budget, max_tokens and max_model_len leave
        room for (a step gains up to drafts + 1 tokens)."""
        if not speculates(seq):
            return []
        spec, p = self.speculative, seq.params
        k = min(spec.num_speculative_tokens, budget - 1)
        if p.max_tokens is not None:
            k = min(k, p.max_tokens - seq.num_output_tokens - 1)
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - seq.num_tokens - 1)
        drafts = propose_ngram(seq.token_ids, k, spec.prompt_lookup_min, spec.prompt_lookup_max)
        if seq.grammar is not None:  # a draft the grammar refuses could never be accepted
            drafts = seq.grammar.valid_prefix(drafts)
        return drafts

    def _loads_instead(self, seq: Sequence) -> bool:
        """Whether a running prefill's next blocks are CPU-tier hits (admitted with part of them
        under the step's load budget): load what this step's budget allows and compute nothing;
        True while any remain to load."""
        kv, bs = self.kv, self.kv.block_size
        done = seq.num_computed_tokens // bs
        if seq.num_computed_tokens % bs or len(seq.block_table) != done or seq.params.prompt_logprobs is not None:
            return False
        hits = kv.get_cpu_tier_blocks(seq, done)
        if not hits:
            return False
        take = hits[:self._load_budget]
        if take and kv.allocate_slots(seq, 0, cpu_blocks=take, keep_watermark=True):
            self._load_budget -= len(take)
            kv.record_prefix_query(0, 0, len(take) * bs)  # its query was counted at admission
            if seq.first_scheduled_time is None:
                seq.num_cached_prompt_tokens += len(take) * bs
            return True
        return not take  # the budget is spent: wait for the next step rather than recompute them

    def _preempt(self, victim: Sequence, out: SchedulerOutput) -> list[Sequence]:
        """Swap the victim out with every running sequence of its request (they may share
        blocks), or recompute the victim alone. Returns the sequences taken off `running`.
        A request whose samples are all that runs is not swapped: it would come back to the
        same full pool and go out again, forever (n samples that cannot all fit at once); its
        victim recomputes alone, as under recompute, and its other samples go on."""
        others_run = any(s.request_id != victim.request_id for s in self.running)
        if self._swappable(victim) and others_run and not self._idle_beam(victim):
            group = [victim] + [s for s in self.running if s.request_id == victim.request_id]
            copies = self.kv.swap_out(group)
            if copies is not None:
                for seq in group:
                    if seq is not victim:
                        self.running.remove(seq)
                    seq.status = SequenceStatus.SWAPPED
                    seq.num_preemptions += 1
                self.num_preemptions += 1
                self.num_swap_preemptions += 1
                self.swapped.append(group)
                out.swap_out += copies
                self.swap_out_blocks += len(copies)
                return group
        self._recompute(victim)
        return [victim]

    def recompute_swapped(self) -> int:
        """The store is gone: every swapped group goes back to waiting (oldest first, ahead of
        new work) to recompute its context; no request is lost. Returns how many sequences."""
        groups, self.swapped = list(self.swapped), deque()
        seqs = [seq for group in groups for seq in group]
        for seq in reversed(seqs):
            self.kv.free_cpu(seq)
            self._requeue_at_front(seq)
        return len(seqs)

    def record_fault(self, failed: SchedulerOutput | None) -> list[str]:
        """A worker fault ended step `failed`: every request in its batch is a suspect once more.
        Returns the poison request, for the caller to end: the only one of the batch now in
        POISON_FAULTS consecutive faulted batches (several: they are isolated instead)."""
        if failed is None:
            return []
        batch = {seq.request_id for seq, _ in failed.scheduled}
        for request_id in batch:
            self.fault_suspects[request_id] = self.fault_suspects.get(request_id, 0) + 1
        hot = [r for r in batch if self.fault_suspects[r] >= POISON_FAULTS]
        return hot if len(hot) == 1 else []

    def clear_fault_suspects(self, out: SchedulerOutput) -> None:
        """Step `out` ran: the requests in its batch are cleared of any earlier fault."""
        if self.fault_suspects:
            for seq, _ in out.scheduled:
                self.fault_suspects.pop(seq.request_id, None)

    def reset_after_worker_loss(self, failed: SchedulerOutput | None = None) -> int:
        """The worker group was lost with every device block: the device pool starts empty (its
        prefix cache with it), and every running sequence goes back to the front of waiting with
        its tokens kept, to recompute as recompute preemption does (not counted as one).
        Swapped groups keep their CPU blocks and swap back in, and the CPU prefix tier stays,
        except what the interrupted step `failed` was writing into the store: the groups it
        swapped out recompute, and the tier blocks it saved lose their hash. Returns how many
        sequences moved to waiting."""
        moved = self._forget_store_writes(failed) if failed is not None else 0
        running, self.running = self.running, []
        self.kv.reset_device_pool()
        for seq in reversed(running):
            seq.block_table = []  # its blocks went with the pool
            self._requeue_at_front(seq)
        for group in self.groups.values():
            group.pending_beam_logprobs.clear()  # every beam samples its position again
        for swapped in self.swapped:
            for seq in swapped:  # a swapped beam that had sampled: its last position again
                group = self.groups.get(seq.request_id)
                if group is not None and group.beam is not None and seq.num_computed_tokens == seq.num_tokens:
                    seq.num_computed_tokens -= 1
        return moved + len(running)

    def _forget_store_writes(self, failed: SchedulerOutput) -> int:
        """Undo what step `failed` wrote into the CPU store: its data may be partial."""
        cpu = self.kv.cpu_pool
        if cpu is None:
            return 0
        for _, cpu_block in failed.swap_out:
            cpu.forget(cpu_block)  # a tier save: the block no longer stands for its hash
        preempted = {seq.seq_id for seq in failed.preempted}
        interrupted = [group for group in self.swapped if any(seq.seq_id in preempted for seq in group)]
        seqs = [seq for group in interrupted for seq in group]
        for group in interrupted:
            self.swapped.remove(group)
        for seq in reversed(seqs):
            self.kv.free_cpu(seq)
            self._requeue_at_front(seq)
        return len(seqs)

    def _swappable(self, seq: Sequence) -> bool:
        if self.kv.cpu_pool is None or self.preemption_mode == "recompute":
            return False
        return self.preemption_mode == "swap" or seq.num_computed_tokens >= AUTO_SWAP_MIN_TOKENS

    def _recompute(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._requeue_at_front(seq)

    def _requeue_at_front(self, seq: Sequence) -> None:
        """Back to the head of waiting with its tokens kept: on readmission it recomputes (or
        re-finds in the prefix cache) its whole context. Its blocks are the caller's to free."""
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self._waiting_since[seq.seq_id] = self.num_steps
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Remove a sequence from whichever queue holds it and free its blocks at once; its
        request leaves `groups` when this was its last unfinished sequence."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self._waiting_since.pop(seq.seq_id, None)
        elif seq.status == SequenceStatus.SWAPPED:
            group = next(g for g in self.swapped if seq in g)
            group.remove(seq)
            if not group:
                self.swapped.remove(group)
            self.kv.free_cpu(seq)
        self.kv.free(seq)
        seq.status = status
        seq.finish_time = time.monotonic()
        self.finished_seq_ids.append(seq.seq_id)
        group = self.groups.get(seq.request_id)
        if group is not None and group.finished:
            del self.groups[seq.request_id]
            self.fault_suspects.pop(seq.request_id, None)
