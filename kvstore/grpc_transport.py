"""The KV store over gRPC: the store serves its pool (`KVStoreService`), and a worker that cannot
map the segment swaps through `GrpcSwapSpace` (kvstore/swap_space.py's `SwapSpace`, as the
shared-memory one).

Data moves as raw bytes in chunks of at most CHUNK_BYTES; headers and manifests are msgpack. Every
chunk is checked against the pool's layout before a byte is written.

Checksums travel in the headers: the chunk where a shard starts names its checksum (`checksums`),
taken by the writing rank; the store keeps it beside the shard (a shard put without one gets the
store's own), sends it back with the shard, and the reading rank checks it, as over shared memory.

The bulk path avoids protobuf's copies: a worker writes each BlockChunk's wire bytes itself (two
length-delimited fields, so a shard's bytes are copied once, into the message), and the store
reads the fields of a received message as views of its buffer (`decode_chunk`). The wire format
is exactly kvstore.proto's, so any protobuf client or server interoperates.
"""

from __future__ import annotations

import collections
import hmac
from collections.abc import Iterator
from concurrent import futures

import grpc
import msgpack
import numpy as np

from kvstore.store import StoreLayout, check_device_blocks, shard_checksum
from pagedserve.v1 import kvstore_pb2, kvstore_pb2_grpc

# Streamed in 1 MiB chunks: on loopback here 1 MiB measured fastest (2 and 4 MiB chunks were
# 20-50% slower; one 64 MiB message ~0.4 GB/s, DESIGN.md).
CHUNK_BYTES = 1 << 20
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


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated or oversized varint")
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return value, pos
        shift += 7


def encode_chunk(header: bytes, parts: list) -> bytes:
    """A serialized BlockChunk{header, data = parts joined}: one copy of the parts' bytes."""
    size = sum(len(p) for p in parts)
    return b"".join([b"\x0a", _varint(len(header)), header, b"\x12", _varint(size), *parts])


def decode_chunk(raw: bytes) -> tuple[bytes, memoryview]:
    """(header, data) of a serialized BlockChunk, the data a view of `raw` (no copy). Fields may
    come in any order; unknown ones are skipped as protobuf would; malformed input is refused."""
    buf = memoryview(raw)
    fields = {1: b"", 2: buf[0:0]}
    pos = 0
    while pos < len(buf):
        tag, pos = _read_varint(buf, pos)
        number, wire_type = tag >> 3, tag & 7
        if wire_type == 2:
            length, pos = _read_varint(buf, pos)
            if pos + length > len(buf):
                raise ValueError("a field runs past the end of the message")
            if number in fields:
                fields[number] = buf[pos:pos + length]
            pos += length
        elif wire_type == 0:
            _, pos = _read_varint(buf, pos)
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire_type}")
    if pos != len(buf):
        raise ValueError("a field runs past the end of the message")
    return bytes(fields[1]), fields[2]


class KVStoreService(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, layout: StoreLayout, valid: np.ndarray, crc: np.ndarray, data: np.ndarray):
        if not layout.secret:
            raise ValueError("the store's gRPC service needs a secret (StoreLayout.secret)")
        self.layout, self.valid, self.crc, self.data = layout, valid, crc, data
        self._expected = f"Bearer {layout.secret}".encode()

    def _check_secret(self, context) -> None:
        """Refuse a caller without the store's secret before reading a byte it sent; the
        comparison takes the same time wherever the value differs."""
        got = dict(context.invocation_metadata() or ()).get("authorization", "")
        if not hmac.compare_digest(got.encode("utf-8", "replace"), self._expected):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong KV store secret")

    def _check_piece(self, rank, piece) -> tuple[int, int, int]:
        if not (isinstance(piece, list) and len(piece) == 3
                and all(isinstance(v, int) and not isinstance(v, bool) for v in piece)):
            raise ValueError("each piece must be [block, offset, length] integers")
        block, offset, length = piece
        self.layout.check([block], rank)
        if offset < 0 or length < 0 or offset + length > self.layout.block_bytes:
            raise ValueError(f"bytes [{offset}, {offset + length}) fall outside a {self.layout.block_bytes}-byte shard")
        return block, offset, length

    def _check_checksums(self, rank, entries) -> dict[int, int]:
        if not isinstance(entries, list):
            raise ValueError("checksums must be a list of [block, checksum] integers")
        out = {}
        for entry in entries:
            if not (isinstance(entry, list) and len(entry) == 2
                    and all(isinstance(v, int) and not isinstance(v, bool) for v in entry)
                    and 0 <= entry[1] < 1 << 32):
                raise ValueError("each checksum must be [block, checksum] integers")
            self.layout.check([entry[0]], rank)
            out[entry[0]] = entry[1]
        return out

    def PutBlocks(self, request_iterator, context):
        """`request_iterator` yields serialized BlockChunks (see `serve`): parsed as views."""
        self._check_secret(context)
        received: dict[tuple[int, int], int] = {}
        sums: dict[tuple[int, int], int] = {}
        writes = []
        try:
            for raw in request_iterator:
                header, data = decode_chunk(raw)
                header = _unpack(header, ("rank", "pieces"))
                rank, pieces = header["rank"], header["pieces"]
                if not isinstance(rank, int) or not isinstance(pieces, list):
                    raise ValueError("rank must be an integer and pieces a list")
                for block, crc in self._check_checksums(rank, header.get("checksums", [])).items():
                    sums[block, rank] = crc
                start = 0
                for piece in pieces:
                    block, offset, length = self._check_piece(rank, piece)
                    if start + length > len(data):
                        raise ValueError("a chunk's pieces are longer than its data")
                    # Each shard's pieces come in order and back to back (as _chunks sends them):
                    # no overlap, no gap, nothing past the shard, so memory stays bounded too.
                    if offset != received.get((block, rank), 0):
                        raise ValueError(f"shard of block {block} (rank {rank}): piece at byte {offset}, "
                                         f"expected {received.get((block, rank), 0)} (pieces in order, once)")
                    writes.append((block, rank, offset, data, start, length))
                    received[block, rank] = received.get((block, rank), 0) + length
                    start += length
                if start != len(data):
                    raise ValueError("a chunk's data is longer than its pieces")
            short = [k for k, n in received.items() if n != self.layout.block_bytes]
            if short:
                raise ValueError(f"shard of block {short[0][0]} (rank {short[0][1]}) incomplete: "
                                 f"{received[short[0]]} of {self.layout.block_bytes} bytes")
            stray = [k for k in sums if k not in received]
            if stray:
                raise ValueError(f"a checksum for block {stray[0][0]} (rank {stray[0][1]}), whose shard was not sent")
        except ValueError as e:  # nothing was written
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        for block, rank, offset, payload, start, length in writes:
            self.data[block, rank, offset:offset + length] = np.frombuffer(payload, np.uint8, length, start)
        for block, rank in received:
            crc = sums.get((block, rank))
            self.crc[block, rank] = shard_checksum(self.data[block, rank]) if crc is None else crc
            self.valid[block, rank] = 1
        return kvstore_pb2.PutReply(blocks=len(received))

    def GetBlocks(self, request, context):
        self._check_secret(context)
        try:
            manifest = _unpack(request.manifest, ("blocks", "rank"))
            blocks, rank = manifest["blocks"], manifest["rank"]
            release = manifest.get("release", True)  # False: the CPU prefix tier keeps the block
            if not isinstance(blocks, list) or not all(isinstance(b, int) for b in blocks):
                raise ValueError("blocks must be a list of integers")
            if not isinstance(rank, int) or isinstance(rank, bool):
                raise ValueError("rank must be an integer")
            if not isinstance(release, bool):
                raise ValueError("release must be a boolean")
            self.layout.check(blocks, rank)
            missing = [b for b in blocks if not self.valid[b, rank]]
            if missing:
                raise ValueError(f"cpu block {missing[0]} holds no shard of rank {rank}")
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        yield from _chunks(rank, [(b, self.data[b, rank], int(self.crc[b, rank])) for b in blocks])
        if release:
            for block in blocks:
                self.valid[block, rank] = 0


def _chunks(rank: int, shards) -> Iterator[bytes]:
    """Pack (block, bytes, checksum) shards into chunks of up to CHUNK_BYTES: several small shards
    share a message, a large one spans several (per-message costs dominate below ~1 MiB). A
    shard's checksum goes in the header of the chunk where the shard starts."""
    pieces, parts, sums, size = [], [], [], 0
    for block, shard, crc in shards:
        shard = memoryview(shard).cast("B")
        sums.append([block, crc])
        offset = 0
        while offset < len(shard):
            length = min(len(shard) - offset, CHUNK_BYTES - size)
            pieces.append([block, offset, length])
            parts.append(shard[offset:offset + length])
            size += length
            offset += length
            if size == CHUNK_BYTES:
                yield encode_chunk(msgpack.packb({"rank": rank, "pieces": pieces, "checksums": sums}), parts)
                pieces, parts, sums, size = [], [], [], 0
    if pieces:
        yield encode_chunk(msgpack.packb({"rank": rank, "pieces": pieces, "checksums": sums}), parts)


_SERVICE = "pagedserve.v1.KVStore"


def _handlers(service: KVStoreService) -> grpc.GenericRpcHandler:
    """The KVStore service with BlockChunks passed as wire bytes both ways (no protobuf copies);
    the small messages go through protobuf as usual."""
    return grpc.method_handlers_generic_handler(_SERVICE, {
        "PutBlocks": grpc.stream_unary_rpc_method_handler(
            service.PutBlocks, request_deserializer=None,
            response_serializer=kvstore_pb2.PutReply.SerializeToString),
        "GetBlocks": grpc.unary_stream_rpc_method_handler(
            service.GetBlocks, request_deserializer=kvstore_pb2.GetRequest.FromString,
            response_serializer=None),
    })


def serve(layout: StoreLayout, valid: np.ndarray, crc: np.ndarray, data: np.ndarray,
          host: str) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=_OPTIONS)
    server.add_generic_rpc_handlers((_handlers(KVStoreService(layout, valid, crc, data)),))
    port = server.add_insecure_port(f"{host}:0")
    server.start()
    return server, port


class _CallDetails(collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
        grpc.ClientCallDetails):
    pass


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer <secret>` to every call of a channel."""

    def __init__(self, secret: str):
        self._metadata = (("authorization", f"Bearer {secret}"),)

    def _details(self, d):
        return _CallDetails(d.method, d.timeout, tuple(d.metadata or ()) + self._metadata, d.credentials,
                            d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def store_channel(layout: StoreLayout) -> grpc.Channel:
    """A channel to the store's service that carries its secret on every call."""
    return grpc.intercept_channel(grpc.insecure_channel(layout.grpc_address, options=_OPTIONS),
                                  _BearerToken(layout.secret))


class GrpcSwapSpace:
    """A rank's swaps through the store's gRPC service (a `kvstore.swap_space.SwapSpace`)."""

    def __init__(self, layout: StoreLayout, rank: int, kv_cache):
        """`kv_cache`: the rank's device cache, or None for a client that only moves shards it
        is handed (`put_shards` / `get_shards`: kvstore/head_shards.py)."""
        import torch

        self.layout, self.rank = layout, rank
        if kv_cache is not None:
            self._kv_bytes = kv_cache.view(torch.uint8).view(kv_cache.shape[0], -1)
            layout.check([], rank, self._kv_bytes.shape[1])
        self._channel = store_channel(layout)
        # Chunks travel as wire bytes (encode_chunk / decode_chunk), not protobuf objects.
        self._put = self._channel.stream_unary(f"/{_SERVICE}/PutBlocks", request_serializer=None,
                                               response_deserializer=kvstore_pb2.PutReply.FromString)
        self._get = self._channel.unary_stream(f"/{_SERVICE}/GetBlocks",
                                               request_serializer=kvstore_pb2.GetRequest.SerializeToString,
                                               response_deserializer=None)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        check_device_blocks([d for d, _ in pairs], self._kv_bytes.shape[0])
        self.put_shards(self.rank, ((c, self._kv_bytes[d].cpu().numpy()) for d, c in pairs))

    def put_shards(self, shard: int, rows) -> None:
        """Write (cpu block, host bytes) rows as shard `shard` of their blocks, each with its checksum
        (a GPU's block is staged on the host by the caller)."""
        rows = list(rows)
        self.layout.check([c for c, _ in rows], shard)
        self._put(_chunks(shard, ((c, row, shard_checksum(row)) for c, row in rows)))

    def get_shards(self, shard: int, blocks: list[int], rows: dict, release: bool = True) -> list[int]:
        """Read shard `shard` of `blocks` into `rows` (block -> writable uint8 array of a shard's
        size); returns the blocks whose shard fails its checksum (or came without one)."""
        manifest = msgpack.packb({"blocks": blocks, "rank": shard, "release": release})
        sums = {}
        for raw in self._get(kvstore_pb2.GetRequest(manifest=manifest)):
            header, data = decode_chunk(raw)
            header = msgpack.unpackb(header)
            data = np.frombuffer(data, dtype=np.uint8)
            start = 0
            for block, offset, length in header["pieces"]:
                rows[block][offset:offset + length] = data[start:start + length]
                start += length
            sums.update((block, crc) for block, crc in header.get("checksums", ()))
        return [c for c in blocks if sums.get(c) != shard_checksum(rows[c])]

    def swap_in(self, pairs: list[tuple[int, int]], release: bool = True) -> list[int]:
        """Returns the cpu blocks whose shard fails its checksum (copied all the same: the caller
        must not use them)."""
        if not pairs:
            return []
        check_device_blocks([d for _, d in pairs], self._kv_bytes.shape[0])
        target = {c: d for c, d in pairs}
        on_gpu = self._kv_bytes.is_cuda
        # On a GPU each block is assembled in host memory, then copied over whole.
        rows = {c: (np.empty(self._kv_bytes.shape[1], np.uint8) if on_gpu else self._kv_bytes[d].numpy())
                for c, d in pairs}
        corrupt = self.get_shards(self.rank, [c for c, _ in pairs], rows, release)
        if on_gpu:
            import torch

            for c, d in target.items():
                self._kv_bytes[d].copy_(torch.from_numpy(rows[c]))
        return corrupt

    def finish(self) -> None:
        """Every call returns once its data has moved: nothing to wait for."""

    def close(self) -> None:
        self._channel.close()
