"""Block tables of sequences over the block pool: lazy growth, fork, copy-on-write, prefix cache.

A sequence's table grows only when its last block is full. Prefix caching identifies a full
block by a hash chained over its parent block's hash and its token ids (blake2b: stable across
processes and runs, unlike Python's `hash`), so equal hashes mean equal whole prefixes.

The CPU block pool (`cpu_pool`, the KV store's blocks, None without a store) is owned here: swap
preemption moves whole sequences into it, and with prefix caching it is also the prefix cache's
CPU tier: a hashed device block evicted by an
allocation is saved to the store under its hash before it is overwritten (the step's swap-outs
run first on the workers), and a prefix that runs out of device hits continues in the store:
those blocks are loaded onto fresh device blocks (swap-ins, before the forward pass) instead of
being recomputed. A CPU block whose checksum fails when read back is dropped from both tiers,
with the device block it was loaded onto (`drop_corrupt`). A block written into the CPU pool enters
its hash index only once the step that writes it has run (`end_step`): until then nobody finds it,
and a failed step's writes are never found at all.

Prefill/decode replicas share one store (coordinator/kv_handoff.py, `use_handoff_store`): it is
their CPU tier, `lock` serializes their use of it, and `publish` writes a prefill-only request's
prompt blocks into it under a lease for a decode replica to load.
"""

from __future__ import annotations

import contextlib
import hashlib
from array import array
from dataclasses import dataclass

from coordinator.block_pool import BlockPool
from coordinator.cpu_block_pool import CpuBlockPool
from coordinator.sequence import Sequence


def hash_block(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    if parent_hash is not None:
        h.update(parent_hash)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass(slots=True)
class PrefixCacheStats:
    """Lifetime counters of the prefix cache (tokens, except the CPU tier's block counts)."""

    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found, in either tier
    cpu_hits: int = 0  # of which loaded from the CPU tier
    cpu_saved_blocks: int = 0  # evicted device blocks saved to the CPU tier
    cpu_loaded_blocks: int = 0  # CPU-tier blocks loaded onto device blocks


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 watermark: float = 0.01, cpu_pool: CpuBlockPool | None = None):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        # Blocks kept free when admitting new sequences, so running ones can grow a while
        # without preempting; ignored when nothing runs (a lone prompt may use the whole pool).
        self.watermark_blocks = int(watermark * num_blocks)
        # Copy-on-write copies decided since the last drain: (src_block, dst_block).
        self.pending_copies: list[tuple[int, int]] = []
        self._num_registered: dict[int, int] = {}
        self.prefix_stats = PrefixCacheStats()
        # Tier transfers decided since the last drain: (cpu, device) loads.
        self.pending_loads: list[tuple[int, int]] = []
        # CPU blocks the running step writes, entered in the hash index once it has run.
        self._unwritten: list[tuple[int, bytes]] = []
        # (request id, cpu blocks, of which written) of the prefill-only requests this step publishes.
        self._unleased: list[tuple[str, list[int], int]] = []
        self.handoff = None  # coordinator.kv_handoff.HandoffStore, when the store is shared
        self.lock = contextlib.nullcontext()  # the shared store's lock, when there is one
        self.cpu_pool: CpuBlockPool | None = None
        self.replace_cpu_pool(cpu_pool)

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def cpu_tier_enabled(self) -> bool:
        """Whether the CPU pool also backs the prefix cache (prefix caching with a store)."""
        return self.cpu_pool is not None and self.enable_prefix_caching

    def num_filled_slots(self, running: list[Sequence]) -> int:
        """Slots of used blocks that hold a computed token's K/V, from the running sequences'
        tables (they hold every used block). Only a table's tail past its computed tokens can
        be partly empty; a tail block shared by forks counts once, at its fullest."""
        bs = self.block_size
        tail_fill: dict[int, int] = {}
        for seq in running:
            computed, table = seq.num_computed_tokens, seq.block_table
            for i in range(computed // bs, len(table)):
                fill = max(0, computed - i * bs)
                if fill >= tail_fill.get(table[i], 0):
                    tail_fill[table[i]] = fill
        return self.pool.num_used * bs - sum(bs - fill for fill in tail_fill.values())

    def fragmentation(self, running: list[Sequence]) -> float:
        """Allocated-but-empty slots over allocated slots (internal fragmentation)."""
        allocated = self.pool.num_used * self.block_size
        return 0.0 if allocated == 0 else 1.0 - self.num_filled_slots(running) / allocated

    # ---- prefix cache ----------------------------------------------------------------------
    def _extend_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        hashes, bs = seq.block_hashes, self.block_size
        for i in range(len(hashes), num_full_blocks):
            hashes.append(hash_block(hashes[-1] if hashes else None, seq.token_ids[i * bs:(i + 1) * bs]))

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """The longest run of cached blocks that prefixes `seq`. The last token is always left to
        compute, since the step that computes it yields the logits for the next one."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, max_blocks)
        blocks = []
        for h in seq.block_hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def get_cpu_tier_blocks(self, seq: Sequence, num_device_blocks: int) -> list[int]:
        """CPU blocks that continue `seq`'s prefix after its first `num_device_blocks` (device
        hits), up to the first miss; empty without a CPU tier."""
        if not self.cpu_tier_enabled:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, max_blocks)
        blocks = []
        for h in seq.block_hashes[num_device_blocks:max_blocks]:
            block = self.cpu_pool.lookup(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int, num_cpu_hit_tokens: int = 0) -> None:
        if self.enable_prefix_caching:
            stats = self.prefix_stats
            stats.queries += num_tokens
            stats.hits += num_hit_tokens + num_cpu_hit_tokens
            stats.cpu_hits += num_cpu_hit_tokens

    def replace_cpu_pool(self, cpu_pool: CpuBlockPool | None) -> None:
        """The KV store's block pool (a new store's after the old one died, or None: no store)."""
        self.cpu_pool = cpu_pool
        self.pool.evicted = [] if self.cpu_tier_enabled else None
        self.pending_loads = []

    def use_handoff_store(self, handoff) -> None:
        """Make the store prefill and decode replicas share this manager's CPU pool (a view of its
        allocator) and its lock this manager's."""
        self.handoff = handoff
        self.lock = handoff.lock
        self.replace_cpu_pool(handoff.pool.view())

    def reset_device_pool(self) -> None:
        """The workers' caches are gone (a rebuilt worker group): every device block is free and
        uncached again. Callers take the sequences' tables off first; the CPU pool stays."""
        self.pool = BlockPool(self.pool.num_blocks)
        self.pool.evicted = [] if self.cpu_tier_enabled else None
        self.pending_copies = []
        self.pending_loads = []
        self._num_registered = {}

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's reset_prefix_cache, for measuring cold prefills):
        only when no device block is in use, else nothing changes and False comes back. The CPU
        tier forgets its free blocks too; blocks that swapped sequences hold keep their hashes."""
        if self.pool.num_used:
            return False
        self.pool.forget_free()
        if self.cpu_pool is not None:
            with self.lock:
                self.cpu_pool.forget_free()
        return True

    def end_step(self, succeeded: bool = True) -> None:
        """The step's plan has run on the workers (or failed, `succeeded=False`): the CPU blocks it
        wrote enter the hash index (a failed step's never do: their data may be partial), its
        published blocks go to their requests' leases, and the CPU blocks it read or wrote may be
        reused."""
        unwritten, self._unwritten = self._unwritten, []
        unleased, self._unleased = self._unleased, []
        if self.cpu_pool is None:
            return
        if succeeded:
            for block, block_hash in unwritten:
                self.cpu_pool.register(block, block_hash)
            for request_id, blocks, written in unleased:
                self.handoff.grant(request_id, blocks)
                self.handoff.counters.published_blocks += written
        else:
            for _, blocks, _ in unleased:
                for block in blocks:
                    self.cpu_pool.decref(block)
        self.cpu_pool.end_step()

    def drop_corrupt(self, cpu_blocks, device_blocks) -> None:
        """`cpu_blocks` failed their checksum when read back onto `device_blocks`: no prefix hit
        in either tier may hand them out again. Call it before freeing the sequences that hold
        the device blocks, so that these return to the free queue uncached (at its head)."""
        for block in device_blocks:
            self.pool.forget(block)
        cpu = self.cpu_pool
        for block in cpu_blocks if cpu is not None else ():
            cpu.forget(block)
            if cpu.ref_counts[block] == 0:  # free already (the step ended): nothing in it to reuse
                cpu.free_queue.move_to_end(block, last=False)

    def save_evicted(self) -> list[tuple[int, int]]:
        """(device, cpu) copies that keep the blocks evicted since the last call in the CPU tier.
        A hash the tier holds already is only refreshed; with no CPU block free or evictable
        (all held by swapped sequences) a block is simply lost, as without a tier."""
        cpu, evicted = self.cpu_pool, self.pool.evicted
        if not self.cpu_tier_enabled or not evicted:
            return []
        self.pool.evicted = []
        saves = []
        for block, block_hash in evicted:
            known = cpu.lookup(block_hash)
            if known is not None:
                cpu.touch(known)
                continue
            if cpu.num_free == 0:
                continue
            target = cpu.allocate()
            self._unwritten.append((target, block_hash))  # found once the step has written it
            cpu.release_after_step(target)  # free (and cached) once the step has written it
            saves.append((block, target))
        self.prefix_stats.cpu_saved_blocks += len(saves)
        return saves

    def publish(self, seq: Sequence) -> list[tuple[int, int]]:
        """(device, cpu) writes, after this step's forward pass, of `seq`'s full blocks into the
        shared store, for a decode replica (a prefill-only request whose prompt this step
        completes). Blocks the store holds already are reused; at the first block the store has
        no room for, the rest are left out (the decode side computes them). The request's lease
        on the blocks starts once the step has run (`end_step`)."""
        cpu, bs = self.cpu_pool, self.block_size
        num_full = seq.num_tokens // bs
        self._extend_hashes(seq, num_full)
        writes, leased = [], []
        for i in range(num_full):
            block_hash = seq.block_hashes[i]
            known = cpu.lookup(block_hash)
            if known is not None:
                cpu.incref(known)
                self.handoff.counters.reused_blocks += 1
                leased.append(known)
                continue
            if cpu.num_free == 0:
                break
            target = cpu.allocate()  # its reference is the lease's
            self._unwritten.append((target, block_hash))
            writes.append((seq.block_table[i], target))
            leased.append(target)
        self._unleased.append((seq.request_id, leased, len(writes)))
        return writes

    # ---- allocation ------------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] = (),
                       keep_watermark: bool = False, cpu_blocks: list[int] = ()) -> bool:
        """Make `seq`'s table cover `num_new_tokens` more tokens (after `computed_blocks`, the
        device prefix-cache hits of a newly admitted sequence, and `cpu_blocks`, its CPU-tier
        hits, loaded onto new device blocks). All or nothing: returns False and changes nothing
        when the pool cannot provide the blocks."""
        pool, bs = self.pool, self.block_size
        table = seq.block_table
        num_computed = seq.num_computed_tokens + (len(computed_blocks) + len(cpu_blocks)) * bs
        total_blocks = len(table) + len(computed_blocks)
        needed = max(0, self.blocks_needed(num_computed + num_new_tokens) - total_blocks)  # loads too
        cow = (num_new_tokens > 0 and num_computed % bs != 0
               and pool.ref_counts[table[num_computed // bs]] > 1)
        revived = sum(1 for b in computed_blocks if pool.ref_counts[b] == 0)
        available = pool.num_free - revived - (self.watermark_blocks if keep_watermark else 0)
        if needed + cow > available:
            return False
        # Device hits leave the free queue before anything is allocated, so that no allocation
        # below can evict one of them.
        for b in computed_blocks:
            pool.incref(b)
            table.append(b)
        for c in cpu_blocks:
            self.cpu_pool.hold_for_step(c)  # nothing may overwrite it before the step reads it
            b = pool.allocate()
            pool.register(b, seq.block_hashes[len(table)])
            table.append(b)
            self.pending_loads.append((c, b))
        self.prefix_stats.cpu_loaded_blocks += len(cpu_blocks)
        if computed_blocks or cpu_blocks:
            seq.num_computed_tokens = num_computed
            self._num_registered[seq.seq_id] = len(table)
        if cow:
            self._copy_on_write(seq, num_computed // bs)
        for _ in range(needed - len(cpu_blocks)):
            table.append(pool.allocate())
        return True

    def _copy_on_write(self, seq: Sequence, index: int) -> None:
        src = seq.block_table[index]
        dst = self.pool.allocate()
        self.pool.decref(src)
        seq.block_table[index] = dst
        self.pending_copies.append((src, dst))

    def commit_computed(self, seq: Sequence) -> None:
        """After a step wrote K/V up to seq.num_computed_tokens: register the blocks that became
        full in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        start = self._num_registered.get(seq.seq_id, 0)
        if num_full > start:
            self._extend_hashes(seq, num_full)
            for i in range(start, num_full):
                self.pool.register(seq.block_table[i], seq.block_hashes[i])
            self._num_registered[seq.seq_id] = num_full

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (ref counts + 1); writes copy on demand."""
        for b in parent.block_table:
            self.pool.incref(b)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        self._num_registered[child.seq_id] = self._num_registered.get(parent.seq_id, 0)

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks, last block first, so that a sequence's tail is evicted
        from the prefix cache before its (more shareable) head."""
        for b in reversed(seq.block_table):
            self.pool.decref(b)
        seq.block_table = []
        seq.num_computed_tokens = 0
        self._num_registered.pop(seq.seq_id, None)

    # ---- swap ------------------------------------------------------------------------------
    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]] | None:
        """Move a group's blocks to the CPU store, one CPU block per distinct device block, so
        that sharing survives. Returns the (device, cpu) copies for the workers, or None, with
        nothing changed, when the store lacks room. Copy-on-write copies pending for these
        sequences are cancelled: the swap reads their source block instead, whose data the copy
        would have produced (the workers swap out before they copy)."""
        cpu = self.cpu_pool
        distinct = list(dict.fromkeys(b for seq in seqs for b in seq.block_table))
        if len(distinct) > cpu.num_free:
            return None
        pending = {dst: src for src, dst in self.pending_copies}
        cancelled = set(distinct) & pending.keys()
        self.pending_copies = [(s, d) for s, d in self.pending_copies if d not in cancelled]
        mapping = {b: cpu.allocate() for b in distinct}
        copies = [(pending.get(b, b), mapping[b]) for b in distinct]
        seen = set()
        for seq in seqs:
            seq.cpu_block_table = [mapping[b] for b in seq.block_table]
            for c in seq.cpu_block_table:
                if c in seen:
                    cpu.incref(c)
                seen.add(c)
            computed = seq.num_computed_tokens
            self.free(seq)
            seq.num_computed_tokens = computed  # its K/V live on in the store
        return copies

    def swap_in(self, seqs: list[Sequence]) -> list[tuple[int, int]] | None:
        """Bring a swapped group back onto fresh device blocks (sharing kept). Returns the
        (cpu, device) copies, or None, with nothing changed, when the device pool lacks room."""
        distinct = list(dict.fromkeys(c for seq in seqs for c in seq.cpu_block_table))
        if len(distinct) + self.watermark_blocks > self.pool.num_free:
            return None
        mapping = {c: self.pool.allocate() for c in distinct}
        seen = set()
        for seq in seqs:
            seq.block_table = [mapping[c] for c in seq.cpu_block_table]
            for b in seq.block_table:
                if b in seen:
                    self.pool.incref(b)
                seen.add(b)
            # Swapped-in blocks are not re-registered in the prefix cache.
            self._num_registered[seq.seq_id] = seq.num_computed_tokens // self.block_size
            for c in seq.cpu_block_table:  # read by this step: freed once it has run
                self.cpu_pool.release_after_step(c)
            seq.cpu_block_table = []
        return [(c, mapping[c]) for c in distinct]

    def free_cpu(self, seq: Sequence) -> None:
        """Release a swapped-out sequence's CPU blocks."""
        for c in seq.cpu_block_table:
            self.cpu_pool.decref(c)
        seq.cpu_block_table = []

    def drain_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def drain_loads(self) -> list[tuple[int, int]]:
        loads, self.pending_loads = self.pending_loads, []
        return loads
