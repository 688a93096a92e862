"""The CPU KV store: a pool of `swap_space` bytes that swapped-out blocks live in.

Layout of the named shared-memory segment (created owner-only, mode 0600, by the store):

    [valid: num_cpu_blocks x tp_size bytes][data: num_cpu_blocks x tp_size x block_bytes_per_rank]

A worker of rank r copies its shard of a device block into data[cpu_block, r] and then sets
valid[cpu_block, r]; a block is valid once every rank has written its shard. Swapping in reads
the shard and clears the flag. The coordinator hands out CPU block ids (its second allocator)
and only moves ids; the data never passes through it.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from multiprocessing import resource_tracker, shared_memory

import numpy as np


@dataclass(frozen=True, slots=True)
class StoreLayout:
    segment: str
    num_blocks: int
    tp_size: int
    block_bytes: int  # per rank
    # The process that created the segment: its resource tracker holds the segment's only
    # registration, which `attach` keeps there and drops in every other process.
    owner_pid: int
    transport: str = "shm"  # how workers reach the pool: "shm" (map the segment) or "grpc"
    grpc_address: str = ""  # host:port of the store's KVStore service, with transport "grpc"
    # With transport "grpc": the bearer token every call must carry. It reaches the workers
    # inside Ray (never over the store's socket) and stays out of reprs and logs.
    secret: str = field(default="", repr=False)

    @property
    def header_bytes(self) -> int:
        return self.num_blocks * self.tp_size

    @property
    def size(self) -> int:
        return self.header_bytes + self.num_blocks * self.tp_size * self.block_bytes

    def check(self, blocks, rank: int, nbytes: int | None = None) -> None:
        """Refuse ids outside the pool, an unknown rank, or a shard of the wrong size."""
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"rank {rank} is not in [0, {self.tp_size})")
        bad = [b for b in blocks if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"cpu block {bad[0]} is not in [0, {self.num_blocks})")
        if nbytes is not None and nbytes != self.block_bytes:
            raise ValueError(f"a block shard is {self.block_bytes} bytes; got {nbytes}")


def check_device_blocks(blocks, num_blocks: int) -> None:
    """A worker's own half of a swap request: its device block ids must lie in its cache."""
    bad = [b for b in blocks if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"device block {bad[0]} is not in [0, {num_blocks})")


def attach(layout: StoreLayout) -> tuple[shared_memory.SharedMemory, np.ndarray, np.ndarray]:
    """Map the store's segment: (segment, valid[num_blocks, tp], data[num_blocks, tp, bytes])."""
    shm = shared_memory.SharedMemory(name=layout.segment)
    # Python 3.11 registers attached segments with its resource tracker, which would unlink the
    # store's segment when this process exits: only the store owns it. (A store in this same
    # process shares the registration, which its own unlink removes.) A multiprocessing child of
    # the store's process would share its tracker too, and drop the store's registration here:
    # pagedserve starts none (Ray workers and the store actor each have their own tracker).
    if os.getpid() != layout.owner_pid:
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
    return shm, *_views(shm, layout)


def unlink_segment(name: str) -> None:
    """Remove a dead store's segment name (its memory goes with the last mapping)."""
    import _posixshmem

    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass


def _views(shm, layout: StoreLayout) -> tuple[np.ndarray, np.ndarray]:
    buf = np.frombuffer(shm.buf, dtype=np.uint8)
    valid = buf[:layout.header_bytes].reshape(layout.num_blocks, layout.tp_size)
    data = buf[layout.header_bytes:layout.size].reshape(layout.num_blocks, layout.tp_size, layout.block_bytes)
    return valid, data


class KVStore:
    """Owns the segment. Runs as a Ray actor (`KVStoreActor`) beside Ray workers, or in process."""

    def __init__(self, num_blocks: int, tp_size: int, block_bytes: int, transport: str = "shm"):
        if num_blocks < 1:
            raise ValueError(f"swap_space holds no KV block ({block_bytes * tp_size} bytes each)")
        if transport not in ("shm", "grpc"):
            raise ValueError(f"kv_transport must be shm or grpc here; got {transport!r}")
        name = f"pagedserve-kv-{secrets.token_hex(6)}"
        self.layout = StoreLayout(name, num_blocks, tp_size, block_bytes, owner_pid=os.getpid())
        # SharedMemory creates with mode 0600: only this user's processes can map it.
        self._shm = shared_memory.SharedMemory(name=name, create=True, size=self.layout.size)
        self._valid, self._data = _views(self._shm, self.layout)
        self._valid[:] = 0
        self._server = None
        if transport == "grpc":
            from dataclasses import replace

            from kvstore.grpc_transport import serve

            # Loopback: the store is always placed on its workers' node, so nothing else needs
            # to reach it; and a per-store secret guards it even from this node's other users.
            secret = secrets.token_urlsafe(32)
            self.layout = replace(self.layout, transport="grpc", secret=secret)
            self._server, port = serve(self.layout, self._valid, self._data, "127.0.0.1")
            self.layout = replace(self.layout, grpc_address=f"127.0.0.1:{port}")

    def get_layout(self) -> StoreLayout:
        return self.layout

    def wait_until_dead(self) -> None:
        """Never returns: its result turns into an error when the store dies, which the engine
        notices with a non-blocking `ray.wait` (it never waits on the store)."""
        import threading

        threading.Event().wait()

    def stats(self) -> dict:
        return {"cpu_blocks_total": self.layout.num_blocks,
                "cpu_blocks_valid": int(self._valid.all(axis=1).sum())}

    def valid_blocks(self, blocks: list[int]) -> list[bool]:
        self.layout.check(blocks, 0)
        return [bool(self._valid[b].all()) for b in blocks]

    def close(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)
            self._server = None
        if self._shm is not None:
            self._valid = self._data = None
            self._shm.unlink()  # the name goes now; the memory when the last mapping does
            try:
                self._shm.close()
            except BufferError:
                pass
            self._shm = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class StoreHandle:
    """The engine's handle on its store, wherever it runs: in this process (the single-process
    engine) or as a Ray actor on the workers' node."""

    def __init__(self, num_blocks: int, tp_size: int, block_bytes: int, node_id: str | None = None,
                 transport: str = "shm"):
        if node_id is None:
            self._local, self._actor = KVStore(num_blocks, tp_size, block_bytes, transport), None
            self.layout = self._local.get_layout()
            return
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor_cls = ray.remote(num_cpus=0, max_concurrency=4)(KVStore)
        self._local = None
        # Same node as the workers: they map the segment the store creates.
        self._actor = actor_cls.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(
            num_blocks, tp_size, block_bytes, transport)
        self.layout = ray.get(self._actor.get_layout.remote())
        self._death = self._actor.wait_until_dead.remote()

    def alive(self) -> bool:
        """Whether the store still runs; costs no wait."""
        if self._actor is None:
            return self._local is not None
        import ray

        ready, _ = ray.wait([self._death], timeout=0)
        return not ready

    def stats(self) -> dict:
        if self._local is not None:
            return self._local.stats()
        import ray

        return ray.get(self._actor.stats.remote())

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
        elif self._actor is not None:
            import ray

            try:
                if self.alive():
                    ray.get(self._actor.close.remote(), timeout=10)
            except ray.exceptions.RayError:
                pass  # died meanwhile
            finally:
                ray.kill(self._actor)
            self._actor = None
