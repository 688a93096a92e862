"""A worker rank's side of the CPU KV store: one interface, two transports, one factory.

Same node as the store: `ShmSwapSpace` maps the segment (kvstore/shm_transport.py). Other nodes:
`GrpcSwapSpace` streams blocks through the store's service (kvstore/grpc_transport.py). The
store's layout says which (`layout.transport`), so a worker only calls `open_swap_space`.

Every shard is checksummed (xxh3, kvstore/store.py) by the rank that writes it and checked by the rank that reads
it; a shard that fails is reported by `swap_in`, and the coordinator recomputes what it held.
"""

from __future__ import annotations

from typing import Protocol

from kvstore.store import StoreLayout


class SwapSpace(Protocol):
    """What a worker asks of the store. Block ids are checked before any byte moves: a request
    naming a block outside the device cache or the pool raises ValueError and changes nothing."""

    layout: StoreLayout

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, cpu block) pairs: write this rank's shards with their checksums and
        mark them valid."""

    def swap_in(self, pairs: list[tuple[int, int]], release: bool = True) -> list[int]:
        """(cpu block, device block) pairs: read this rank's shards back; `release=False` keeps
        them valid in the store (the CPU prefix tier). Returns the cpu blocks whose shard failed
        its checksum: their device blocks hold bad data, which nothing may use."""

    def finish(self) -> None:
        """Return once this step's copies are done (and their checksums written); the worker
        calls it before its step returns, so the store's data is complete whenever the
        coordinator sees the step executed."""

    def close(self) -> None:
        """Let go of the store (its pool stays: the store owns it)."""


def open_swap_space(layout: StoreLayout, rank: int, kv_cache, heads: tuple[int, int] | None = None,
                    writes_heads: bool = True, node_id: str = "") -> SwapSpace:
    """Rank `rank`'s swap space onto the store `layout` describes, over its transport. A store
    sharded by KV head (prefill/decode replicas' shared store) needs `heads`, the (first, count)
    KV heads this rank holds, and `writes_heads` (see kvstore/head_shards.py); `node_id` is this
    rank's Ray node, whose ranks map such a store's segment when it is the store's."""
    if layout.shard_by == "kv_head":
        from kvstore.head_shards import HeadShardedSwapSpace

        if heads is None:
            raise ValueError("a store sharded by KV head needs the rank's KV heads")
        local = layout.transport == "shm" or (bool(node_id) and node_id == layout.shm_node)
        return HeadShardedSwapSpace(layout, kv_cache, heads, writes_heads, local)
    # Imported here: a worker loads only its own transport's dependencies (torch, grpc).
    if layout.transport == "shm":
        from kvstore.shm_transport import ShmSwapSpace

        return ShmSwapSpace(layout, rank, kv_cache)
    if layout.transport == "grpc":
        from kvstore.grpc_transport import GrpcSwapSpace

        return GrpcSwapSpace(layout, rank, kv_cache)
    raise ValueError(f"kv_transport must be shm or grpc; got {layout.transport!r}")
