"""The KV store over gRPC: the store serves its pool (`KVStoreService`), and a worker that cannot
map the segment swaps through `GrpcSwapSpace` (the same interface as the shared-memory one).

Data moves as raw bytes in chunks of at most CHUNK_BYTES; headers and manifests are msgpack. Every
chunk is checked against the pool's layout before a byte is written.
"""

from __future__ import annotations

from concurrent import futures

import grpc
import msgpack
import numpy as np

from kvstore.store import StoreLayout
from pagedserve.v1 import kvstore_pb2, kvstore_pb2_grpc

# Streamed in chunks of a few MiB: one 64 MiB message measured ~0.4 GB/s here, 1-4 MiB chunks
# 1-1.7 GB/s (DESIGN.md).
CHUNK_BYTES = 4 << 20
_MAX_MESSAGE = CHUNK_BYTES + (1 << 16)
_OPTIONS = [("grpc.max_send_message_length", _MAX_MESSAGE), ("grpc.max_receive_message_length", _MAX_MESSAGE),
            ("grpc.so_reuseport", 0)]


def _unpack(raw: bytes, fields: tuple[str, ...]) -> dict:
    try:
        msg = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:
        raise ValueError(f"malformed msgpack: {e}") from None
    if not isinstance(msg, dict) or any(f not in msg for f in fields):
        raise ValueError(f"expected a map with {', '.join(fields)}")
    return msg


class KVStoreService(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, layout: StoreLayout, valid: np.ndarray, data: np.ndarray):
        self.layout, self.valid, self.data = layout, valid, data

    def _check_chunk(self, header: dict, size: int) -> tuple[int, int, int]:
        block, rank, offset = header["block"], header["rank"], header["offset"]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (block, rank, offset)):
            raise ValueError("block, rank and offset must be integers")
        self.layout.check([block], rank)
        if offset < 0 or offset + size > self.layout.block_bytes:
            raise ValueError(f"bytes [{offset}, {offset + size}) fall outside a {self.layout.block_bytes}-byte shard")
        return block, rank, offset

    def PutBlocks(self, request_iterator, context):
        received: dict[tuple[int, int], int] = {}
        writes = []
        try:
            for chunk in request_iterator:
                block, rank, offset = self._check_chunk(_unpack(chunk.header, ("block", "rank", "offset")),
                                                        len(chunk.data))
                writes.append((block, rank, offset, chunk.data))
                received[block, rank] = received.get((block, rank), 0) + len(chunk.data)
            short = [k for k, n in received.items() if n != self.layout.block_bytes]
            if short:
                raise ValueError(f"shard of block {short[0][0]} (rank {short[0][1]}) incomplete: "
                                 f"{received[short[0]]} of {self.layout.block_bytes} bytes")
        except ValueError as e:  # nothing was written
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        for block, rank, offset, payload in writes:
            self.data[block, rank, offset:offset + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        for block, rank in received:
            self.valid[block, rank] = 1
        return kvstore_pb2.PutReply(blocks=len(received))

    def GetBlocks(self, request, context):
        try:
            manifest = _unpack(request.manifest, ("blocks", "rank"))
            blocks, rank = manifest["blocks"], manifest["rank"]
            if not isinstance(blocks, list) or not all(isinstance(b, int) for b in blocks):
                raise ValueError("blocks must be a list of integers")
            self.layout.check(blocks, rank)
            missing = [b for b in blocks if not self.valid[b, rank]]
            if missing:
                raise ValueError(f"cpu block {missing[0]} holds no shard of rank {rank}")
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        size = self.layout.block_bytes
        for block in blocks:
            for offset in range(0, size, CHUNK_BYTES):
                header = msgpack.packb({"block": block, "rank": rank, "offset": offset})
                yield kvstore_pb2.BlockChunk(header=header, data=self.data[block, rank, offset:offset + CHUNK_BYTES].tobytes())
            self.valid[block, rank] = 0


def serve(layout: StoreLayout, valid: np.ndarray, data: np.ndarray, host: str) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=_OPTIONS)
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(KVStoreService(layout, valid, data), server)
    port = server.add_insecure_port(f"{host}:0")
    server.start()
    return server, port


class GrpcSwapSpace:
    """A rank's swaps through the store's gRPC service (the interface of SwapSpace)."""

    def __init__(self, layout: StoreLayout, rank: int, kv_cache, address: str):
        import torch

        self._kv_bytes = kv_cache.view(torch.uint8).view(kv_cache.shape[0], -1)
        layout.check([], rank, self._kv_bytes.shape[1])
        self.layout, self.rank = layout, rank
        self._channel = grpc.insecure_channel(address, options=_OPTIONS)
        self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)

    def _device(self, blocks: list[int]) -> None:
        bad = [b for b in blocks if not 0 <= b < self._kv_bytes.shape[0]]
        if bad:
            raise ValueError(f"device block {bad[0]} is not in [0, {self._kv_bytes.shape[0]})")

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        self._device([d for d, _ in pairs])
        self.layout.check([c for _, c in pairs], self.rank)

        def chunks():
            for device, cpu in pairs:
                shard = self._kv_bytes[device].numpy()
                for offset in range(0, shard.size, CHUNK_BYTES):
                    header = msgpack.packb({"block": cpu, "rank": self.rank, "offset": offset})
                    yield kvstore_pb2.BlockChunk(header=header, data=shard[offset:offset + CHUNK_BYTES].tobytes())

        self._stub.PutBlocks(chunks())

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        import torch

        self._device([d for _, d in pairs])
        target = {c: d for c, d in pairs}
        manifest = msgpack.packb({"blocks": [c for c, _ in pairs], "rank": self.rank})
        for chunk in self._stub.GetBlocks(kvstore_pb2.GetRequest(manifest=manifest)):
            header = msgpack.unpackb(chunk.header)
            row = self._kv_bytes[target[header["block"]]]
            start = header["offset"]
            row[start:start + len(chunk.data)] = torch.frombuffer(bytearray(chunk.data), dtype=torch.uint8)

    def close(self) -> None:
        self._channel.close()
