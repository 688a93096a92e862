"""The step channel: the Ray executor's calls to its worker actors over a socket of their own.

Why: a Ray actor call took ~1.8 ms each way on a loaded 2-core node (the plan's submit to the
worker starting it: 1.7 ms p50; its result back to the engine: 1.6 ms), twice in every engine
step, against ~0.1 ms for a socket write and read of the same pickled plan. vLLM sends its
scheduler output to its workers the same way (a message queue of its own), not as Ray calls.

Ray still creates, places, sets up and kills the workers, and watches them: a worker serves its
channel inside one long Ray task (`WorkerActor.serve_step_channel`), so a process that dies ends
both its socket (seen at once) and that task (Ray's view, which also covers a lost node).

Wire format: each message is an 8-byte big-endian length and a pickle. The executor connects to
the address the worker names in its reply to a Ray call, and must first send the 32 random bytes
named with it: a worker unpickles nothing from a connection that did not. The trust is Ray's own
(its calls carry pickles too, in plain TCP): the token keeps out whoever can reach the port
without being part of the cluster.
"""

from __future__ import annotations

import hmac
import pickle
import secrets
import selectors
import socket
import struct
import time
import traceback
from collections.abc import Callable
from typing import Any

_HEADER = struct.Struct("!Q")
TOKEN_BYTES = 32
ACCEPT_TIMEOUT_S = 60.0  # for the executor to connect once the worker listens
_LIVENESS_POLL_S = 1.0  # how often a wait asks Ray whether the serving tasks still run
# After one rank raised, how long its peers' replies to the same call are waited for before the
# channel is given up (a peer waiting in a collective for the failed rank never replies).
DRAIN_AFTER_ERROR_S = 2.0


class ChannelClosed(ConnectionError):
    """A worker's end went away (its process died, or it closed the channel)."""

    def __init__(self, rank: int, detail: str = ""):
        super().__init__(f"rank {rank}'s step channel closed{': ' + detail if detail else ''}")
        self.rank = rank


class ChannelTimeout(TimeoutError):
    def __init__(self, ranks: list[int], timeout: float):
        super().__init__(f"no reply from rank(s) {ranks} within {timeout} s")
        self.ranks = ranks


def _frame(payload: bytes) -> bytes:
    return _HEADER.pack(len(payload)) + payload


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    """`n` bytes, or None where the peer closed first."""
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 22))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


# ---- the worker's end ---------------------------------------------------------------------------
class ChannelListener:
    """A worker's listening socket, before the executor connects: `address` and `token` go to
    the executor through Ray."""

    def __init__(self, host: str):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, 0), family=family)
        self.address = (host, self._sock.getsockname()[1])
        self.token = secrets.token_bytes(TOKEN_BYTES)

    def accept(self, timeout: float = ACCEPT_TIMEOUT_S) -> socket.socket | None:
        """The executor's connection (the first one presenting the token), or None when none came
        within `timeout`. The listener closes either way: a channel has one client."""
        deadline = time.monotonic() + timeout
        try:
            while (left := deadline - time.monotonic()) > 0:
                self._sock.settimeout(left)
                try:
                    conn, _ = self._sock.accept()
                except TimeoutError:
                    return None
                conn.settimeout(min(10.0, left))
                try:
                    presented = _recv_exactly(conn, TOKEN_BYTES)
                except OSError:
                    presented = None
                if presented is not None and hmac.compare_digest(presented, self.token):
                    conn.settimeout(None)
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    return conn
                conn.close()
            return None
        finally:
            self._sock.close()


def serve(conn: socket.socket, handler: Callable[[str, tuple], Any]) -> None:
    """Answer the executor's calls, one at a time, until it closes the channel: each message is
    (method, args); each reply ("ok", result) or ("error", exception, its traceback as text)."""
    with conn:
        while True:
            header = _recv_exactly(conn, _HEADER.size)
            if header is None:
                return
            payload = _recv_exactly(conn, _HEADER.unpack(header)[0])
            if payload is None:
                return
            try:
                method, args = pickle.loads(payload)
                reply = pickle.dumps(("ok", handler(method, args)), protocol=5)
            except BaseException as e:  # the executor decides what a failure means
                reply = _error_reply(e)
            conn.sendall(_frame(reply))


def _error_reply(e: BaseException) -> bytes:
    text = "".join(traceback.format_exception(e))
    try:
        return pickle.dumps(("error", e, text), protocol=5)
    except Exception:  # an exception that does not pickle arrives as its text
        return pickle.dumps(("error", RuntimeError(f"{type(e).__name__}: {e}"), text), protocol=5)


# ---- the executor's end -------------------------------------------------------------------------
class StepChannel:
    """The executor's connections to every rank. `call` sends one (method, args) to every rank,
    pickled once, and returns their results in rank order; the first failure is raised as soon as
    it is seen, whichever rank it is (a rank waiting in a collective for a dead peer never
    answers). Not for concurrent use: the executor holds a lock around each call."""

    def __init__(self, addresses: list[tuple[str, int]], tokens: list[bytes],
                 alive: Callable[[], int | None] = lambda: None):
        """`alive()`: the rank whose worker Ray knows to be gone, or None (polled every second
        while waiting, for failures a socket does not show, as a node lost off the network)."""
        self._alive = alive
        self._socks: list[socket.socket] = []
        self._broken = ""  # why a call's replies were left unread: the next reply could be any call's
        self._broken_rank = 0  # the rank that failed then
        try:
            for address, token in zip(addresses, tokens):
                sock = socket.create_connection(address, timeout=ACCEPT_TIMEOUT_S)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.sendall(token)
                self._socks.append(sock)
        except BaseException:
            self.close()
            raise

    def call(self, method: str, args: tuple, timeout: float | None = None,
             drain_after_error: float = DRAIN_AFTER_ERROR_S) -> list:
        """Every rank's result of `method(*args)`. Raises ChannelClosed (a rank's end went away),
        ChannelTimeout (`timeout` seconds passed first) or the exception a rank raised, with the
        rank and its traceback in a note. After a rank raised, the others get `drain_after_error`
        seconds to reply to the same call (0: a caller that gives the group up anyway)."""
        if self._broken:
            raise ChannelClosed(self._broken_rank, self._broken)
        message = _frame(pickle.dumps((method, args), protocol=5))
        deadline = None if timeout is None else time.monotonic() + timeout
        rank = 0
        try:
            for rank, sock in enumerate(self._socks):
                # A stopped worker whose buffer is full must not block the sender for good.
                sock.settimeout(None if deadline is None else max(1e-3, deadline - time.monotonic()))
                try:
                    sock.sendall(message)
                except TimeoutError:
                    raise ChannelTimeout([rank], timeout) from None
                except OSError as e:
                    raise ChannelClosed(rank, str(e)) from e
            replies, error = self._replies(deadline, timeout, drain_after_error)
        except BaseException as e:  # whatever cut the call short (a Ctrl-C too) left bytes unread
            if not self._broken:
                self._broken_rank = getattr(e, "rank", getattr(e, "ranks", [rank])[0])
                self._broken = f"an earlier call ended before its replies were read ({type(e).__name__}: {e})"
            raise
        if error is not None:  # raised by a rank; every reply read, unless _replies said otherwise
            raise error
        return replies

    def _replies(self, deadline: float | None, timeout: float | None,
                 drain_after_error: float) -> tuple[list, BaseException | None]:
        """Every rank's reply, and the first error a rank raised (or None)."""
        replies: list = [None] * len(self._socks)
        pending = {rank: bytearray() for rank in range(len(self._socks))}  # rank -> its reply so far
        failures: list[tuple[int, BaseException]] = []
        try:
            self._collect(replies, pending, deadline, timeout, failures, drain_after_error)
        except ChannelClosed as closed:  # (a timeout after a rank raised ends the drain instead)
            if failures:  # a rank raises in a collective whose peer died: the death is the cause
                closed.__cause__ = failures[0][1]
            raise
        if failures:
            rank, error = failures[0]
            if pending:
                self._broken_rank = rank
                self._broken = f"rank(s) {sorted(pending)} did not reply after rank {rank} raised"
            return replies, error
        return replies, None

    def _collect(self, replies: list, pending: dict, deadline: float | None, timeout: float | None,
                 failures: list, drain_after_error: float) -> None:
        """Reads replies into `replies` until every rank's is in (each removed from `pending`). A
        rank's raised error goes to `failures` as (rank, error); then the others get
        `drain_after_error` seconds to reply, so that the channel stays in step (else it is marked
        broken: a later call fails as a death would)."""
        with selectors.DefaultSelector() as selector:
            for rank, sock in enumerate(self._socks):
                selector.register(sock, selectors.EVENT_READ, rank)
            while pending:
                wait = _LIVENESS_POLL_S if deadline is None else min(_LIVENESS_POLL_S, deadline - time.monotonic())
                if wait <= 0:
                    if failures:
                        return
                    raise ChannelTimeout(sorted(pending), timeout)
                events = selector.select(wait)
                if not events:
                    gone = self._alive()
                    if gone is not None:
                        raise ChannelClosed(gone, "Ray reports its worker gone")
                for key, _ in events:
                    rank = key.data
                    payload = self._read(key.fileobj, rank, pending[rank])
                    if payload is None:
                        continue
                    selector.unregister(key.fileobj)
                    del pending[rank]
                    try:
                        reply = pickle.loads(payload)
                    except Exception as e:  # e.g. an exception class this process cannot import
                        reply = ("error", RuntimeError(f"rank {rank}'s reply could not be read: {e!r}"), "")
                    if reply[0] == "ok":
                        replies[rank] = reply[1]
                    elif not failures:
                        _, error, text = reply
                        if hasattr(error, "add_note"):  # Python 3.11+
                            error.add_note(f"raised by tensor-parallel rank {rank}:\n{text}")
                        failures.append((rank, error))
                        drain_until = time.monotonic() + drain_after_error
                        deadline = drain_until if deadline is None else min(deadline, drain_until)

    @staticmethod
    def _read(sock: socket.socket, rank: int, buffer: bytearray) -> bytes | None:
        """Reads what is there; the whole reply once it has arrived, else None."""
        try:
            chunk = sock.recv(1 << 22)
        except OSError as e:
            raise ChannelClosed(rank, str(e)) from e
        if not chunk:
            raise ChannelClosed(rank)
        buffer += chunk
        if len(buffer) < _HEADER.size:
            return None
        size = _HEADER.unpack_from(buffer)[0]
        if len(buffer) < _HEADER.size + size:
            return None
        if len(buffer) > _HEADER.size + size:  # one call, one reply: more is a broken peer
            raise ChannelClosed(rank, "unexpected bytes after its reply")
        return bytes(buffer[_HEADER.size:])

    def close(self) -> None:
        for sock in self._socks:
            sock.close()
        self._socks = []
