"""The KV store prefill and decode replicas share, and the leases that carry a request's prompt
blocks from one to the other (prefill/decode disaggregation; the router drives the handoff).

One store (kvstore/store.py, sharded by KV head so that any tensor-parallel size reads and writes
it) is every P/D replica's CPU tier: its block allocator is one `CpuBlockPool`, of which each
replica's KVCacheManager holds a view (shared blocks and hash index, its own step holds), and
every use of it runs under `lock`: an engine's scheduling and bookkeeping, never its forward pass.

The handoff, block by block:
1. A prefill replica computes a prompt's full blocks; in the step that completes them its
   scheduler allocates store blocks (a block the store holds already is reused) and the workers
   write them after the forward pass (StepPlan.publish).
2. Once that step has run, and only then, the blocks enter the hash index (a decode replica can
   find them) and the request's lease holds a reference on each (`grant`). A failed step
   registers nothing and frees what it allocated: a decode replica never reads a partial block.
3. The decode replica admits the request as any other: its prefix lookup runs on into the store
   (the CPU tier), the blocks load onto its device blocks before the forward pass (checksummed
   per head), and it computes the rest: the last partial block and the last prompt token.
4. The router releases the lease once the decode side has produced a token (the loads are done),
   or when the request ends. A lease older than `lease_seconds` is expired by `expire`: its blocks
   leave the hash index when nothing else holds them, and the decode side recomputes the prompt.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.cpu_block_pool import CpuBlockPool


@dataclass(slots=True)
class Lease:
    blocks: list[int]
    expires: float  # time.monotonic()


@dataclass(slots=True)
class HandoffCounters:
    """Lifetime figures of the handoffs (blocks are whole blocks, every KV head)."""

    leases_granted: int = 0
    leases_expired: int = 0
    published_blocks: int = 0  # written by prefill replicas (blocks the store held already: not)
    reused_blocks: int = 0  # asked for by a prefill replica and found in the store already
    publish_seconds: list[float] = field(default_factory=list)  # per step that published, taken by stats


class HandoffStore:
    """`store`: a StoreHandle sharded by KV head (or None in unit tests: the allocator alone).
    `num_blocks` comes from it; `block_bytes` is a whole block's (every head)."""

    def __init__(self, store, num_blocks: int, block_bytes: int, lease_seconds: float = 60.0,
                 open_store: Callable[[], object] | None = None):
        """`open_store()`: a new StoreHandle like `store`, for `restarted()`."""
        if lease_seconds <= 0:
            raise ValueError(f"pd_kv_lease must be > 0 seconds; got {lease_seconds}")
        self.store = store
        self._open_store = open_store
        self.restarts = 0  # dead stores this one replaces, counted over the chain
        self._closed = False
        self.pool = CpuBlockPool(num_blocks)
        self.block_bytes = block_bytes
        self.lease_seconds = lease_seconds
        self.lock = threading.RLock()
        self.leases: dict[str, Lease] = {}
        self.counters = HandoffCounters()

    @property
    def layout(self):
        return self.store.layout

    def grant(self, key: str, blocks: list[int], now: float | None = None) -> None:
        """The step that wrote `blocks` for request `key` has run: its lease holds them (one
        reference each, taken by the allocation). Under `lock`."""
        now = time.monotonic() if now is None else now
        old = self.leases.pop(key, None)
        if old is not None:  # a request published twice (recomputed): the new lease replaces it
            self._drop(old.blocks)
        self.leases[key] = Lease(blocks, now + self.lease_seconds)
        self.counters.leases_granted += 1

    def lease_blocks(self, key: str) -> int:
        with self.lock:
            lease = self.leases.get(key)
            return 0 if lease is None else len(lease.blocks)

    def release(self, key: str) -> bool:
        """Let go of `key`'s lease, if it has one; its blocks stay cached until evicted."""
        with self.lock:
            lease = self.leases.pop(key, None)
            if lease is None:
                return False
            for block in lease.blocks:
                self.pool.decref(block)
            return True

    def expire(self, now: float | None = None) -> list[str]:
        """End every lease past its time: the store's copy of its blocks is freed (nothing finds
        them any more unless another request holds them too). Returns the expired keys."""
        now = time.monotonic() if now is None else now
        with self.lock:
            expired = [key for key, lease in self.leases.items() if lease.expires <= now]
            for key in expired:
                self._drop(self.leases.pop(key).blocks)
            self.counters.leases_expired += len(expired)
            return expired

    def _drop(self, blocks: list[int]) -> None:
        for block in blocks:
            if self.pool.decref(block):
                self.pool.forget(block)
                self.pool.free_queue.move_to_end(block, last=False)  # reused first: it holds nothing now

    def cached_prefix(self, hashes: list[bytes]) -> int:
        """How many leading `hashes` the store holds (a hint: read without the lock)."""
        n = 0
        for h in hashes:
            if self.pool.lookup(h) is None:
                break
            n += 1
        return n

    def stats(self) -> dict:
        with self.lock:
            return {"pd_store_blocks_total": self.pool.num_blocks, "pd_store_blocks_used": self.pool.num_used,
                    "pd_store_blocks_cached": self.pool.num_cached, "pd_leases": len(self.leases),
                    "pd_leases_expired": self.counters.leases_expired}

    def alive(self) -> bool:
        return not self._closed and (self.store is None or self.store.alive())

    def restarted(self) -> "HandoffStore":
        """A new, empty store of the same size and placement for this dead one (whose blocks and
        leases are lost: their requests recompute). The lifetime counters carry over."""
        if self._open_store is None:
            raise RuntimeError("this handoff store was opened without a way to open another")
        new = HandoffStore(self._open_store(), self.pool.num_blocks, self.block_bytes, self.lease_seconds,
                           self._open_store)
        new.counters = self.counters
        new.restarts = self.restarts + 1
        return new

    def close(self) -> None:
        self._closed = True
        if self.store is not None:
            self.store.close()
            self.store = None


# The shared store's size when the server's swap_space is 0 (GiB): SmolLM2's fp32 blocks are
# 737 KB, so about 23k tokens of prompts in flight.
DEFAULT_STORE_GIB = 1.0


# A decode replica's defaults, so that a handed-over prompt never stretches its decodes' steps
# much (measured on SmolLM2, one core, 4 decodes, a 1.5k-token prompt handed over: the step that
# loaded its 93 blocks and computed its 17-token tail took 380 ms against 150-180):
# - its tail (up to a block and a token) is computed a token per step: one-token chunks take the
#   decode attention kernel, adding a decode's cost to a step instead of a prefill chunk's;
# - its blocks load at most DECODE_LOAD_BLOCKS per step (~0.45 ms each: 93 cost 40 ms).
DECODE_PREFILL_CHUNK = 1
DECODE_LOAD_BLOCKS = 16


def pd_engine_configs(config, prefill_overrides: dict | None, decode_overrides: dict | None) -> list:
    """[prefill config, decode config]: `config` with each side's overrides (EngineConfig fields),
    checked, and without a store of their own (they share one of the server's swap_space). The
    decode side caps its prompt chunks and its loads per step (DECODE_PREFILL_CHUNK,
    DECODE_LOAD_BLOCKS) unless the server's config or the decode side's sets them."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(config)}
    base = config.replace(swap_space=0.0,
                          preemption_mode="auto" if config.preemption_mode == "swap" else config.preemption_mode)
    out = []
    for side, overrides in (("prefill", prefill_overrides or {}), ("decode", decode_overrides or {})):
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(f"{side}_config: {unknown[0]!r} is not an engine setting")
        if "swap_space" in overrides:
            raise ValueError(f"{side}_config: swap_space sizes the store both sides share; set it for the server")
        if side == "decode":
            defaults = {"long_prefill_token_threshold": config.long_prefill_token_threshold or DECODE_PREFILL_CHUNK,
                        "max_loaded_blocks_per_step": config.max_loaded_blocks_per_step or DECODE_LOAD_BLOCKS}
            overrides = {**defaults, **overrides}
        try:
            out.append(base.replace(**overrides))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{side}_config: {e}") from None
    check_matching(*out)
    return out


# Settings a prefill and a decode replica must share: the store holds whole blocks of one
# model's K/V (computed by the same weights: quantized or not), in one dtype, of one block size.
MATCHING_SETTINGS = ("model", "dtype", "kv_cache_dtype", "block_size", "quantization")


def check_matching(prefill_config, decode_config) -> None:
    """Refuse prefill and decode settings that could not share blocks, naming both values."""
    for name in MATCHING_SETTINGS:
        p, d = getattr(prefill_config, name), getattr(decode_config, name)
        if p != d:
            raise ValueError(f"prefill and decode replicas must have the same {name}: prefill {name}={p!r}, "
                             f"decode {name}={d!r}")
    if not (prefill_config.enable_prefix_caching and decode_config.enable_prefix_caching):
        raise ValueError("prefill/decode disaggregation needs enable_prefix_caching on both sides: a decode "
                         "replica finds the handed-over blocks by their prefix hashes")


def head_block_bytes(engine) -> int:
    """Bytes of one KV head of one block (a shard of the shared store), from a built engine."""
    heads, tp = engine.model_info.num_kv_heads, engine.config.tensor_parallel_size
    local_heads = heads // tp if tp <= heads else 1
    return engine.executor.block_bytes() // local_heads


def open_handoff_store(engines: list, space_gib: float, lease_seconds: float, node_id: str | None = None,
                       transport: str = "shm", shm_node: str = "") -> HandoffStore:
    """The store `engines` (every prefill and decode replica's LLMEngine) share, of `space_gib`
    GiB, on `node_id` (None: in this process), each engine attached to it. With `transport`
    "grpc" ranks reach it over gRPC, except those on `shm_node`, which map its segment."""
    from kvstore.store import StoreHandle

    for engine in engines[1:]:
        check_matching(engines[0].config, engine.config)
    shard = head_block_bytes(engines[0])
    for engine in engines[1:]:
        if head_block_bytes(engine) != shard:
            raise ValueError(f"replicas disagree on a KV head's block size ({shard} and "
                             f"{head_block_bytes(engine)} bytes): model, dtype and block_size must match")
    heads = engines[0].model_info.num_kv_heads
    num_blocks = int(space_gib * (1 << 30)) // (shard * heads)
    if num_blocks < 1:
        raise ValueError(f"swap_space ({space_gib} GiB) holds no KV block ({shard * heads} bytes); the "
                         "prefill/decode store needs room for the prompts in flight")
    def open_store():
        return StoreHandle(num_blocks, heads, shard, node_id, transport, shard_by="kv_head", shm_node=shm_node)

    handoff = HandoffStore(open_store(), num_blocks, shard * heads, lease_seconds, open_store)
    try:
        for engine in engines:
            engine.use_handoff_store(handoff)
    except BaseException:
        handoff.close()
        raise
    return handoff
