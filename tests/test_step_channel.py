"""The step channel (workers/step_channel.py) over real sockets: workers served by threads here;
the Ray executor's use of it (SIGKILL, SIGSTOP, TP 2) is covered by test_worker_recovery.py."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from workers.step_channel import (TOKEN_BYTES, ChannelClosed, ChannelListener, ChannelTimeout, StepChannel,
                                  serve)


class FakeWorker:
    """Stands in for a Worker: each method records that it ran."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.release = threading.Event()
        self.act_as: dict[str, str] = {}  # method -> the method whose behaviour it takes
        self.connection: socket.socket | None = None

    def __call__(self, method: str, args: tuple):
        self.calls.append((method, args))
        method = self.act_as.get(method, method)
        if method == "fail":
            raise ValueError(f"bad value {args[0]}")
        if method == "block":  # never answers until released (a rank waiting on a dead peer)
            self.release.wait(30)
        if method == "sleep":
            time.sleep(args[0])
        if method == "close":  # the connection ends as a dead process's would
            self.connection.shutdown(socket.SHUT_RDWR)
        return (method, args)


def start_workers(count: int):
    workers, listeners, threads = [], [], []
    for _ in range(count):
        worker, listener = FakeWorker(), ChannelListener("127.0.0.1")

        def run(listener=listener, worker=worker):
            worker.connection = listener.accept(timeout=10)
            if worker.connection is not None:
                try:
                    serve(worker.connection, worker)
                except OSError:  # its reply could not go out: the channel was shut
                    pass

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        workers.append(worker)
        listeners.append(listener)
        threads.append(thread)
    return workers, listeners, threads


def connect(count: int, **kwargs) -> tuple[list[FakeWorker], StepChannel]:
    workers, listeners, _ = start_workers(count)
    return workers, StepChannel([x.address for x in listeners], [x.token for x in listeners], **kwargs)


@contextlib.contextmanager
def connected_with_steps(step_as: dict[int, str]):
    """Two ranks whose "step" behaves as `step_as` says (rank -> behaviour), and the channel to
    them; on the way out every blocked rank is released and the channel closed."""
    workers, channel = connect(2)
    for rank, behaviour in step_as.items():
        workers[rank].act_as["step"] = behaviour
    try:
        yield channel
    finally:
        for worker in workers:
            worker.release.set()
        channel.close()


def test_calls_reach_every_rank_and_results_come_back_in_rank_order():
    workers, channel = connect(3)
    try:
        big = bytes(range(256)) * 40_000  # 10 MB: arrives in many reads
        assert channel.call("execute", (1, big), timeout=30) == [("execute", (1, big))] * 3
        assert channel.call("init_cache", (7,)) == [("init_cache", (7,))] * 3
        assert [w.calls[-1] for w in workers] == [("init_cache", (7,))] * 3
    finally:
        channel.close()


def test_an_error_raised_by_a_method_passes_as_it_is():
    workers, channel = connect(2)
    try:
        with pytest.raises(ValueError, match="bad value 3") as info:
            channel.call("fail", (3,))
        assert any("rank 0" in note or "rank 1" in note for note in info.value.__notes__)
        assert "ValueError" in info.value.__notes__[-1]  # with the worker's traceback
    finally:
        channel.close()


def test_the_first_failure_is_seen_while_another_rank_never_answers():
    # Rank 0 waits in a collective for its peer, which dies.
    with connected_with_steps({0: "block", 1: "close"}) as channel:
        start = time.monotonic()
        with pytest.raises(ChannelClosed) as info:
            channel.call("step", (), timeout=20)
        assert info.value.rank == 1
        assert time.monotonic() - start < 5


def test_a_rank_that_closes_is_reported_by_rank():
    workers, channel = connect(2)
    workers[1].act_as["step"] = "close"
    try:
        assert channel.call("ok", ()) == [("ok", ())] * 2
        with pytest.raises(ChannelClosed) as info:
            channel.call("step", ())
        assert info.value.rank == 1
    finally:
        channel.close()


def test_a_silent_rank_times_out_naming_it():
    workers, channel = connect(1)
    try:
        start = time.monotonic()
        with pytest.raises(ChannelTimeout) as info:
            channel.call("sleep", (3,), timeout=0.5)
        assert info.value.ranks == [0]
        assert time.monotonic() - start < 2.5
    finally:
        channel.close()


def test_a_rank_ray_reports_gone_ends_the_wait():
    gone: list[int | None] = [None]
    workers, channel = connect(1, alive=lambda: gone[0])
    try:
        threading.Timer(0.3, lambda: gone.__setitem__(0, 0)).start()
        with pytest.raises(ChannelClosed, match="Ray reports"):
            channel.call("block", ())  # no timeout: only the liveness poll can end it
    finally:
        workers[0].release.set()
        channel.close()


def test_a_connection_without_the_token_is_refused_and_nothing_reaches_the_worker():
    workers, listeners, _ = start_workers(1)
    listener = listeners[0]
    with socket.create_connection(listener.address) as intruder:
        intruder.sendall(b"x" * TOKEN_BYTES)
        intruder.settimeout(5)
        assert intruder.recv(1) == b""  # closed on it
    channel = StepChannel([listener.address], [listener.token])  # the executor still gets in
    try:
        assert channel.call("ok", ()) == [("ok", ())]
        assert workers[0].calls == [("ok", ())]
    finally:
        channel.close()


def test_an_error_on_one_rank_leaves_the_channel_in_step_for_the_next_call():
    workers, channel = connect(2)
    workers[1].act_as["init"] = "fail"
    try:
        with pytest.raises(ValueError, match="bad value 5"):
            channel.call("init", (5,))
        # Rank 0's reply to that call was read too: the next call gets this call's replies.
        assert channel.call("ok", (6,)) == [("ok", (6,))] * 2
    finally:
        channel.close()


def test_a_peer_that_never_replies_after_an_error_breaks_the_channel():
    with connected_with_steps({0: "block", 1: "fail"}) as channel:
        with pytest.raises(ValueError):
            channel.call("step", (1,))
        with pytest.raises(ChannelClosed, match="did not reply after rank 1 raised") as info:
            channel.call("ok", ())  # a reply could now be any call's: refused, as a death
        assert info.value.rank == 1


def test_a_caller_that_gives_the_group_up_does_not_wait_for_the_peers_of_a_failed_rank():
    with connected_with_steps({0: "block", 1: "fail"}) as channel:
        start = time.monotonic()
        with pytest.raises(ValueError):
            channel.call("step", (1,), timeout=30, drain_after_error=0)
        assert time.monotonic() - start < 1.5  # not the default drain of DRAIN_AFTER_ERROR_S
        with pytest.raises(ChannelClosed):
            channel.call("ok", ())


def test_a_call_cut_short_by_an_interrupt_leaves_the_channel_refusing_calls():
    """Its replies may still arrive: a next call must not take them for its own."""
    interrupt = [False]

    def alive():
        if interrupt[0]:
            raise KeyboardInterrupt
        return None

    workers, channel = connect(1, alive=alive)
    try:
        interrupt[0] = True
        with pytest.raises(KeyboardInterrupt):
            channel.call("sleep", (1.5,))  # the liveness poll after 1 s raises
        interrupt[0] = False
        time.sleep(1.0)  # the reply to "sleep" is now waiting in the socket
        with pytest.raises(ChannelClosed, match="ended before its replies were read"):
            channel.call("ok", ())
    finally:
        channel.close()


def test_a_rank_that_raises_beside_a_peer_that_died_is_reported_as_the_death():
    """A rank's collective fails when its peer is killed: the death is the cause, whichever of the
    two the executor reads first."""
    with connected_with_steps({0: "fail", 1: "close"}) as channel:
        with pytest.raises(ChannelClosed) as info:
            channel.call("step", (4,), timeout=10, drain_after_error=2)
        assert info.value.rank == 1
