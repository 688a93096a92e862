"""The scheduler: which sequences run this step, how many tokens each, and who is preempted.

One token budget per step (`max_num_batched_tokens`) and a cap on running sequences
(`max_num_seqs`); no separate prefill and decode phases: each sequence's computed tokens catch
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
cache) the whole context. A step that preempts admits nothing and swaps nothing in.

Workers run a step's transfers in a fixed order: swap-outs (preempted groups, CPU prefix-tier
saves of evicted blocks), then copy-on-write copies, then swap-ins (swapped groups coming back,
CPU prefix-tier loads), then the forward pass. So every device block is read before it is
overwritten; CPU blocks read by a step are held until `end_step`, so no write reuses them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from coordinator.kv_cache_manager import KVCacheManager
from coordinator.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)
    preempted: list[Sequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    load: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block), CPU tier

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


PRIORITY_AGING_STEPS = 64
POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("auto", "swap", "recompute")
# preemption_mode "auto" swaps a victim with at least this many computed tokens when the store has
# room. benchmarks/swap.py measures both costs of SmolLM2 on these 2 cores in one run: a swap out
# and back through shared memory costs ~30 us fixed + 6.9 us per token (46 KB of fp32 K/V), while
# recomputing costs ~1,565 us per token of prefill; swapping is cheaper from 0.02 tokens on. So
# every victim with a computed token swaps; one with none has nothing to swap and recomputes.
AUTO_SWAP_MIN_TOKENS = 1


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool, policy: str = "fcfs", cpu=None,
                 preemption_mode: str = "recompute"):
        if policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}; got {preemption_mode!r}")
        if preemption_mode == "swap" and cpu is None:
            raise ValueError("preemption_mode 'swap' needs a CPU KV store: set swap_space > 0")
        self.policy = policy
        self.cpu = cpu  # the CPU block pool of the KV store, or None
        kv.attach_cpu_tier(cpu)
        self.preemption_mode = preemption_mode
        self.swap_out_blocks = 0
        self.swap_in_blocks = 0
        self.num_swap_preemptions = 0  # of num_preemptions, those that swapped
        self.num_steps = 0
        self._waiting_since: dict[int, int] = {}  # seq_id -> step it (re)entered the queue
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Groups swapped out together (a request's running samples or beams), oldest first.
        self.swapped: deque[list[Sequence]] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._waiting_since[seq.seq_id] = self.num_steps
        self.waiting.append(seq)

    def effective_priority(self, seq: Sequence) -> int:
        waited = self.num_steps - self._waiting_since.get(seq.seq_id, self.num_steps)
        return seq.priority - waited // PRIORITY_AGING_STEPS

    def _next_waiting(self) -> Sequence:
        if self.policy == "fcfs":
            return self.waiting[0]
        return min(self.waiting, key=lambda s: (self.effective_priority(s), s.arrival_time))

    def _victim(self) -> Sequence:
        """The running sequence to preempt: the newest, or under `priority` the least important."""
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
            num_new = min(remaining[seq], budget)
            while not kv.allocate_slots(seq, num_new):
                group = self._preempt(self._victim(), out)
                for s in group:
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
        out.copies = kv.drain_copies()
        out.load = kv.drain_loads()
        out.swap_out += kv.save_evicted()
        return out

    def end_step(self) -> None:
        """The step's plan has run on the workers: CPU blocks it read or wrote may be reused."""
        if self.cpu is not None:
            self.cpu.end_step()

    def replace_cpu(self, cpu) -> None:
        """A new KV store (or none) after the old one died; its pool starts empty."""
        self.cpu = cpu
        self.kv.attach_cpu_tier(cpu)

    def _swap_in(self, out: SchedulerOutput) -> None:
        while self.swapped and len(self.running) + len(self.swapped[0]) <= self.max_num_seqs:
            copies = self.kv.swap_in(self.swapped[0], self.cpu)
            if copies is None:
                return
            for seq in self.swapped.popleft():
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)  # scheduled from the next step on
            out.swap_in += copies
            self.swap_in_blocks += len(copies)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        kv = self.kv
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self._next_waiting()
            # Prompt logprobs need every prompt position computed: no prefix-cache hits for them.
            computed, loaded = [], []
            if seq.params.prompt_logprobs is None:
                computed = kv.get_computed_blocks(seq)
                loaded = kv.get_cpu_tier_blocks(seq, len(computed))
            num_new = seq.num_tokens - (len(computed) + len(loaded)) * kv.block_size
            if num_new > budget and not self.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if not kv.allocate_slots(seq, num_new, computed, keep_watermark=bool(self.running), cpu_blocks=loaded):
                break  # nobody overtakes the head of the queue (the first in policy order)
            kv.record_prefix_query(seq.num_tokens, len(computed) * kv.block_size, len(loaded) * kv.block_size)
            if seq.num_preemptions == 0:
                seq.num_cached_prompt_tokens = (len(computed) + len(loaded)) * kv.block_size
            self.waiting.remove(seq)
            self._waiting_since.pop(seq.seq_id, None)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new

    def _preempt(self, victim: Sequence, out: SchedulerOutput) -> list[Sequence]:
        """Swap the victim out with every running sequence of its request (they may share
        blocks), or recompute the victim alone. Returns the sequences taken off `running`."""
        if self._swappable(victim):
            group = [victim] + [s for s in self.running if s.request_id == victim.request_id]
            copies = self.kv.swap_out(group, self.cpu)
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
            self.kv.free_cpu(seq, self.cpu)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self._waiting_since[seq.seq_id] = self.num_steps
            self.waiting.appendleft(seq)
        return len(seqs)

    def _swappable(self, seq: Sequence) -> bool:
        if self.cpu is None or self.preemption_mode == "recompute":
            return False
        return self.preemption_mode == "swap" or seq.num_computed_tokens >= AUTO_SWAP_MIN_TOKENS

    def _recompute(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting_since[seq.seq_id] = self.num_steps
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Remove a sequence from whichever queue holds it and free its blocks at once."""
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
            self.kv.free_cpu(seq, self.cpu)
        self.kv.free(seq)
        seq.status = status
