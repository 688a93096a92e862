"""The CPU KV store: a pool of `swap_space` bytes that swapped-out blocks live in.

Layout of the named shared-memory segment (created owner-only, mode 0600, by the store):

    [valid: num_cpu_blocks x tp_size bytes][pad][crc: num_cpu_blocks x tp_size uint32][pad]
    [data: num_cpu_blocks x tp_size x block_bytes_per_rank]

A worker of rank r copies its shard of a device block into data[cpu_block, r], then writes the
shard's checksum into crc[cpu_block, r] and sets valid[cpu_block, r]; a block is valid once every
rank has written its shard. Swapping in reads the shard, checks it against its crc (a mismatch is
reported, never served: see workers/worker.py) and clears the flag. The coordinator hands out CPU
block ids (its second allocator) and only moves ids; the data never passes through it.
"""

from __future__ import annotations

import os
import secrets
import threading
from dataclasses import dataclass, field
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import xxhash


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
    # What a block's shards are: "rank" (shard r is tensor-parallel rank r's KV heads: one
    # engine's store) or "kv_head" (shard h is KV head h, so `tp_size` counts KV heads: the store
    # prefill and decode replicas share, which any tensor-parallel size reads and writes).
    shard_by: str = "rank"
    # A Ray node id whose ranks map the segment even with transport "grpc" (the shared store
    # serves ranks on its own node over shared memory, the others over gRPC); "": none.
    shm_node: str = ""

    @property
    def crc_offset(self) -> int:
        return _round_up(self.num_blocks * self.tp_size, 8)  # uint32 views need aligned memory

    @property
    def header_bytes(self) -> int:
        return _round_up(self.crc_offset + 4 * self.num_blocks * self.tp_size, 64)

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


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def shard_checksum(shard) -> int:
    """The checksum of one block shard (any contiguous buffer): xxh3-64's low 32 bits, which fit
    the store's uint32 slots and the wire's fields. Measured here on a 240 KB shard: xxh3 29 GB/s,
    faster than copying it (21 GB/s), where zlib's crc32 ran at 2.4 GB/s; on a P/D handoff of a
    1.5k-token prompt crc32 was 40 of the decode step's 74 ms of loading."""
    return xxhash.xxh3_64_intdigest(shard) & 0xFFFFFFFF


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


def _name_prefix() -> str | None:
    """pagedserve-kv-<pid namespace>-: with the creator's pid after it, a later store on this node
    can tell a dead store's segment (see unlink_orphaned_segments). None without procfs."""
    try:
        return f"pagedserve-kv-{os.stat('/proc/self/ns/pid').st_ino:x}-"
    except OSError:
        return None


def _segment_name() -> str:
    prefix = _name_prefix()
    token = secrets.token_hex(6)
    return f"{prefix}{os.getpid():x}-{token}" if prefix else f"pagedserve-kv-{token}"


def unlink_orphaned_segments() -> list[str]:
    """Remove this node's segments whose creating store process is gone; returns their names. A
    store ends with its owner (the coordinator): when Ray ends it after the coordinator's process
    died, nothing unlinks its segment (no close, no resource tracker left). Only names made in this
    pid namespace are judged, so a store in another container sharing /dev/shm is left alone."""
    prefix = _name_prefix()
    try:
        names = os.listdir("/dev/shm") if prefix else []
    except OSError:
        return []
    removed = []
    for name in names:
        try:
            pid = int(name[len(prefix):].split("-")[0], 16) if name.startswith(prefix) else None
        except ValueError:
            continue
        if pid is not None and not _running(pid):
            unlink_segment(name)
            removed.append(name)
    return removed


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]  # after the command name (it may hold spaces)
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie is dead, only not yet reaped


def checksums(shm, layout: StoreLayout) -> np.ndarray:
    """The checksum of every shard, crc[num_blocks, tp], in a segment mapped by `attach`."""
    shape = (layout.num_blocks, layout.tp_size)
    return np.frombuffer(shm.buf, np.uint32, shape[0] * shape[1], layout.crc_offset).reshape(shape)


def _views(shm, layout: StoreLayout) -> tuple[np.ndarray, np.ndarray]:
    buf = np.frombuffer(shm.buf, dtype=np.uint8)
    valid = buf[:layout.num_blocks * layout.tp_size].reshape(layout.num_blocks, layout.tp_size)
    data = buf[layout.header_bytes:layout.size].reshape(layout.num_blocks, layout.tp_size, layout.block_bytes)
    return valid, data


PAGE_BYTES = 4096
TOUCH_CHUNK_BYTES = 64 << 20  # a stop request is seen between chunks


class KVStore:
    """Owns the segment. Runs as a Ray actor (`KVStoreActor`) beside Ray workers, or in process."""

    def __init__(self, num_blocks: int, tp_size: int, block_bytes: int, transport: str = "shm",
                 host: str = "127.0.0.1", shard_by: str = "rank", shm_node: str = ""):
        """`host`: the address the gRPC service binds and workers dial (transport "grpc");
        `shard_by`, `shm_node`: see StoreLayout."""
        if num_blocks < 1:
            raise ValueError(f"swap_space holds no KV block ({block_bytes * tp_size} bytes each)")
        if transport not in ("shm", "grpc"):
            raise ValueError(f"kv_transport must be shm or grpc here; got {transport!r}")
        unlink_orphaned_segments()  # a dead coordinator's store left its segment on this node
        name = _segment_name()
        self.layout = StoreLayout(name, num_blocks, tp_size, block_bytes, owner_pid=os.getpid(),
                                  shard_by=shard_by, shm_node=shm_node)
        # SharedMemory creates with mode 0600: only this user's processes can map it.
        self._shm = shared_memory.SharedMemory(name=name, create=True, size=self.layout.size)
        self._valid, self._data = _views(self._shm, self.layout)
        self._crc = checksums(self._shm, self.layout)
        self._valid[:] = 0
        self._server = None
        self._stop_touching = threading.Event()
        self._toucher = threading.Thread(target=self._touch_pages, name="kvstore-touch", daemon=True)
        self._toucher.start()
        if transport == "grpc":
            from dataclasses import replace

            from kvstore.grpc_transport import serve

            # A per-store secret guards it from anyone else who can reach `host` (this node's
            # other users on loopback; the cluster's network on a node address).
            secret = secrets.token_urlsafe(32)
            self.layout = replace(self.layout, transport="grpc", secret=secret)
            host = f"[{host}]" if ":" in host else host  # an IPv6 node address
            self._server, port = serve(self.layout, self._valid, self._crc, self._data, host)
            self.layout = replace(self.layout, grpc_address=f"{host}:{port}")

    def _touch_pages(self) -> None:
        """Read one byte of every page of the segment, once, in the background: this gives the
        segment its memory now rather than on each page's first write. Measured here (a 64 MiB
        segment, one process writing it, another copying it out): 138 ms on pages the segment
        had never touched, 14 ms once touched; P/D handoffs' transfer time per request 130 ->
        25 ms (benchmarks/disaggregation.py). A read changes nothing, so it may run while
        workers write blocks."""
        segment = np.frombuffer(self._shm.buf, np.uint8)  # held until done: close() waits for it
        for start in range(0, len(segment), TOUCH_CHUNK_BYTES):
            if self._stop_touching.is_set():
                break
            int(segment[start:start + TOUCH_CHUNK_BYTES:PAGE_BYTES].sum())  # numpy drops the GIL here
        del segment

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
        self._stop_touching.set()
        if self._server is not None:
            self._server.stop(grace=None)
            self._server = None
        if self._shm is not None:
            self._valid = self._crc = self._data = None
            self._shm.unlink()  # the name goes now; the memory when the last mapping does
            # The toucher stops at its next chunk (milliseconds); its view of the segment must be
            # gone before the mapping closes.
            self._toucher.join(timeout=5)
            try:
                self._shm.close()
            except BufferError:
                # A view is still out (a gRPC reply being sent): the mapping closes with the last
                # one. Dropped here, or SharedMemory.__del__ would try again and fail the same way.
                self._shm._mmap = None
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
                 transport: str = "shm", shard_by: str = "rank", shm_node: str = ""):
        """`shard_by` "kv_head": the store prefill/decode replicas share; `shm_node`: see StoreLayout."""
        if node_id is None:
            self._local, self._actor = KVStore(num_blocks, tp_size, block_bytes, transport,
                                               shard_by=shard_by), None
            self.layout = self._local.get_layout()
            return
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor_cls = ray.remote(num_cpus=0, max_concurrency=4)(KVStore)
        self._local = None
        # gRPC on the node's address, not loopback: ranks on other nodes dial it (transport
        # "auto" picks gRPC when the ranks span nodes).
        host = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), "127.0.0.1") \
            if transport == "grpc" else "127.0.0.1"
        # Same node as the workers: they map the segment the store creates.
        self._actor = actor_cls.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(
            num_blocks, tp_size, block_bytes, transport, host, shard_by, shm_node)
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
