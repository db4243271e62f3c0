"""What only the blocking StageClient does: threads, and a blocking call_utility that
borrows the output socket from the receiver thread.

Everything both clients promise is in ``test_clients.py`` and ``test_death.py``, run through
each client.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time
from typing import Any

import pytest

from enginecore.stage import (
    EngineDeadError,
    Outputs,
    RequestStream,
    StageClient,
    StageClosedError,
    _client,
)

from .conftest import COUNTDOWN, ECHO, Server


class TestInputBatches:
    def test_a_burst_longer_than_one_input_batch_arrives_whole_and_in_order(
        self, client: StageClient
    ) -> None:
        # The input thread hands frames to the loop in batches of up to 512: a burst of
        # 1,300 frames spans three batches, and not one frame may be lost or reordered.
        # (The stage's behaviour: one client is enough to show it.)
        n = 1300
        for i in range(n):
            client.add(f"b{i}", 1_000_000)
        client.abort([f"b{i}" for i in range(0, n, 2)])
        log = client.call_utility("log", timeout=10)
        assert log[:n] == [f"add b{i}" for i in range(n)]
        assert log[n:] == [f"abort b{i}" for i in range(0, n, 2)]


class TestAddManyFrameFirst:
    def test_outputs_that_arrive_while_the_streams_are_built_are_not_lost(
        self, no_leftovers: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # add_many sends its frame, then builds the streams. Building is made slow here, so
        # an echo stage's outputs arrive before most streams exist: the receiver must wait
        # for the lock that add_many holds until they are registered.
        built: list[None] = []

        class Slow(RequestStream):
            __slots__ = ()

            def __init__(self, *args: Any) -> None:
                super().__init__(*args)
                built.append(None)
                if len(built) % 500 == 0:
                    time.sleep(0.02)

        with StageClient.launch(ECHO, startup_timeout=30) as client:
            monkeypatch.setattr(client, "_stream_type", Slow)
            items = [(f"r{i}", i) for i in range(5000)]
            streams = client.add_many(items)
            assert [s.collect(timeout=10) for s in streams] == [[i] for i in range(5000)]


class TestAddManyAtTheHighWaterMark:
    def test_the_streams_are_registered_first_when_the_frame_cannot_leave_at_once(
        self, client: StageClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # _send_nowait says the socket is full: add_many registers the streams, then sends
        # and waits, as add() does. Same result.
        tried: list[object] = []

        def full(parts: object) -> bool:
            tried.append(parts)
            return False

        monkeypatch.setattr(client, "_send_nowait", full)
        streams = client.add_many([("a", 2), ("b", 1)])
        assert len(tried) == 1
        assert [s.collect(timeout=5) for s in streams] == [[1, 0], [0]]


class TestThreads:
    def test_event_consumers_share_the_stream_in_order(self, client: StageClient) -> None:
        # Each event goes to exactly one consumer, and each consumer sees its share in the
        # stage's order.
        n, steps = 50, 40
        client.call_utility_future("sleep", 0.5)
        time.sleep(0.1)
        client.add_many([(f"c{i}", steps) for i in range(n)])
        seen: list[list[tuple[int, int]]] = [[], [], []]

        def consume(mine: list[tuple[int, int]], batch: bool) -> None:
            while True:
                try:
                    events = client.get_events(1) if batch else [client.get_event(1)]
                except TimeoutError:
                    return
                for event in events:
                    if isinstance(event, Outputs):
                        # (step, request): increasing in the stage's order
                        mine += [
                            (steps - 1 - left, int(rid[1:]))
                            for rid, left in zip(event.req_ids, event.payloads, strict=True)
                            if rid is not None
                        ]

        threads = [
            threading.Thread(target=consume, args=(mine, i == 0)) for i, mine in enumerate(seen)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        everything = [(s, i) for s in range(steps) for i in range(n)]
        assert sorted(x for mine in seen for x in mine) == everything
        for mine in seen:
            assert mine == sorted(mine)

    def test_calls_from_many_threads(self, client: StageClient) -> None:
        def work(t: int) -> list[object]:
            return [client.call_utility("echo", t, i, timeout=10) for i in range(50)]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(work, range(4)))
        assert results == [[[t, i] for i in range(50)] for t in range(4)]

    def test_adds_from_many_threads(self, client: StageClient) -> None:
        def work(t: int) -> list[list[object]]:
            streams = [client.add(f"t{t}-{i}", 3) for i in range(50)]
            streams += client.add_many([(f"t{t}-m{i}", 2) for i in range(50)])
            return [s.collect(timeout=10) for s in streams]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(work, range(4)))
        assert results == [[[2, 1, 0]] * 50 + [[1, 0]] * 50] * 4

    def test_a_stream_read_in_another_thread_is_woken(self, client: StageClient) -> None:
        stream = client.add("r", 2)
        got: list[object] = []
        reader = threading.Thread(target=lambda: got.extend(stream))
        reader.start()
        reader.join(10)
        assert got == [1, 0]

    def test_shutdown_is_idempotent_and_thread_safe(self, client: StageClient) -> None:
        codes: list[int | None] = []
        threads = [
            threading.Thread(target=lambda: codes.append(client.shutdown())) for _ in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert codes == [0, 0, 0]
        assert client.exit_code == 0

    def test_close_from_a_done_callback_closes_and_wakes_waiters(self, client: StageClient) -> None:
        # Done-callbacks run on the client's receiver thread, which close() must join.
        stream = client.add("long", 10_000_000)
        stream.get(5)
        errors: list[BaseException] = []

        def close_from_callback(_: concurrent.futures.Future[object]) -> None:
            try:
                client.close()
            except BaseException as exc:
                errors.append(exc)

        client.call_utility_future("echo").add_done_callback(close_from_callback)
        with pytest.raises(StageClosedError):
            stream.collect(timeout=5)
        assert errors == []
        assert client.closed
        client.close()  # waits for the close the callback started
        assert client.exit_code == 0

    @pytest.mark.parametrize("call", ["call_utility", "stats"])
    def test_a_blocking_call_from_a_done_callback_raises_instead_of_hanging(
        self, client: StageClient, call: str
    ) -> None:
        # The callback runs on the receiver thread, the only one that could read the answer:
        # before, the call waited for itself, forever (or until its timeout).
        outcome: concurrent.futures.Future[object] = concurrent.futures.Future()

        def blocking_call(_: concurrent.futures.Future[object]) -> None:
            try:
                outcome.set_result(
                    client.stats(timeout=None) if call == "stats" else client.call_utility("echo")
                )
            except BaseException as exc:
                outcome.set_result(exc)

        client.call_utility_future("sleep", 0.3).add_done_callback(blocking_call)
        exc = outcome.result(10)
        assert isinstance(exc, RuntimeError)
        assert "done-callback" in str(exc)
        assert "call_utility_future" in str(exc)
        assert client.call_utility("echo", 2, timeout=5) == [2]  # the client goes on

    @pytest.mark.parametrize("what", ["stream", "events"])
    def test_a_read_in_a_done_callback_raises_instead_of_hanging(
        self, client: StageClient, what: str
    ) -> None:
        # The callback runs on the receiver thread, the only one that fills a stream and the
        # events: before, a read with nothing to take waited for itself, for ever.
        stream = client.add("long", 10_000_000)
        first = stream.get(5)
        read = stream.get if what == "stream" else client.get_events
        outcome: concurrent.futures.Future[object] = concurrent.futures.Future()

        def read_in_callback(_: concurrent.futures.Future[object]) -> None:
            try:
                while True:  # what is buffered is taken; then it would have to wait
                    read()
            except BaseException as exc:
                outcome.set_result(exc)

        client.call_utility_future("sleep", 0.3).add_done_callback(read_in_callback)
        exc = outcome.result(10)
        assert isinstance(exc, RuntimeError)
        assert "done-callback" in str(exc)
        # The client goes on, on this thread.
        assert stream.get(5) < first
        assert client.call_utility("echo", 1, timeout=5) == [1]
        client.abort(["long"])

    def test_a_thread_given_a_dead_receivers_ident_is_no_done_callback(
        self, no_leftovers: str
    ) -> None:
        # A thread's ident is handed to the next thread started once it has ended (glibc
        # reuses the stack): after the stage died and the receiver thread ended, a call on
        # such a thread was refused as a done-callback's (seen with a pipeline's stats() of
        # a pool with a killed replica), instead of raising the client's EngineDeadError.
        with StageClient.launch(ECHO) as client:
            os.kill(client.pid, signal.SIGKILL)
            receiver = client._rx
            receiver.join(10)
            assert not receiver.is_alive()
            outcomes: list[tuple[int, BaseException | None]] = []

            def call() -> None:
                try:
                    client.stats(timeout=5)
                except BaseException as exc:
                    outcomes.append((threading.get_ident(), exc))
                else:
                    outcomes.append((threading.get_ident(), None))

            for _ in range(50):
                thread = threading.Thread(target=call)
                thread.start()
                thread.join(10)
                if outcomes[-1][0] == receiver.ident:
                    break
            ident, exc = outcomes[-1]
            assert ident == receiver.ident, "no thread was given the receiver's ident"
            assert isinstance(exc, EngineDeadError), exc

    def test_a_cancelled_future_drops_its_answer(self) -> None:
        with StageClient.launch(COUNTDOWN) as client:
            future = client.call_utility_future("div", 1, 2)
            future.cancel()
            assert client.call_utility("div", 1, 4, timeout=5) == 0.25


# -- a blocking call_utility borrows the output socket ----------------------------------------


@pytest.fixture
def long_borrow(monkeypatch: pytest.MonkeyPatch) -> None:
    """A borrowing call keeps the socket until its answer (or its deadline, or an event that
    is the receiver's job) instead of 50 ms, so a test can act while it borrows."""
    monkeypatch.setattr(_client, "_BORROW_MAX_S", 30.0)


def borrowing(client: StageClient, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """An event set when a blocking call starts reading the socket itself."""
    entered = threading.Event()
    read_until = client._read_until

    def watched(waiter: Any, deadline: float | None) -> None:
        entered.set()
        read_until(waiter, deadline)

    monkeypatch.setattr(client, "_read_until", watched)
    return entered


def call_in_thread(
    client: StageClient, *args: Any, **kwargs: Any
) -> tuple[threading.Thread, dict[str, Any]]:
    """``client.call_utility(*args, **kwargs)`` in a new thread; its outcome lands in the dict
    (``"value"`` or ``"exc"``)."""
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            outcome["value"] = client.call_utility(*args, **kwargs)
        except BaseException as exc:
            outcome["exc"] = exc

    thread = threading.Thread(target=call, daemon=True)  # a hung call must not hang exit
    thread.start()
    return thread, outcome


class TestBorrowedSocket:
    def test_a_blocking_call_reads_its_answer_and_serves_the_rest(
        self, client: StageClient, long_borrow: None, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # The caller reads the socket itself and dispatches a stream's outputs (read in
        # another thread) as the receiver would: nothing lost, nothing out of order.
        readers: set[int] = set()
        drain = client._drain

        def watched(waiter: Any) -> bool:
            readers.add(threading.get_ident())
            return drain(waiter)

        monkeypatch.setattr(client, "_drain", watched)
        n = 5000
        stream = client.add("s", n)
        got: list[object] = []
        consumer = threading.Thread(target=lambda: got.extend(stream), daemon=True)
        consumer.start()
        assert client.call_utility("sleep", 0.2, timeout=5) is None
        assert threading.get_ident() in readers
        consumer.join(10)
        assert got == list(range(n - 1, -1, -1))

    def test_an_idle_socket_is_taken_back_as_soon_as_anything_else_is_sent(
        self, monkeypatch: pytest.MonkeyPatch, no_leftovers: str
    ) -> None:
        monkeypatch.setattr(_client, "_IDLE_LEND_S", 30.0)

        def call_until_lent(client: StageClient) -> None:
            # A call that asks the receiver for the socket is lent it, unless the receiver
            # reads the answer first (a loaded machine): then the socket stays the
            # receiver's. Either is right; try again until it was lent.
            for _ in range(100):
                assert client.call_utility("div", 3, 1, timeout=5) == 3
                if client._owner is None:
                    return
            raise AssertionError("the receiver never lent the socket in 100 calls")

        with StageClient.launch(COUNTDOWN) as client:
            call_until_lent(client)
            assert client._owner is None  # idle: the next call takes it without a wake-up
            assert client.call_utility("div", 1, 4, timeout=5) == 0.25
            assert client._owner is None
            future = client.call_utility_future("div", 1, 8)
            assert client._owner is _client._RX  # its answer needs the receiver
            assert future.result(5) == 0.125
            call_until_lent(client)  # asked the receiver
            assert client.add("r", 2).collect(timeout=5) == [1, 0]
            assert client._owner is _client._RX
            # With anything else in flight, a call gives the socket back to the receiver.
            stream = client.add("long", 1_000_000)
            assert stream.get(5) == 999_999
            assert client.call_utility("div", 1, 2, timeout=5) == 0.5
            assert client._owner is _client._RX
            client.abort(["long"])
            stream.collect(timeout=5)
            assert stream.aborted

    def test_timeout_bounds_the_borrow(self, client: StageClient, long_borrow: None) -> None:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            client.call_utility("sleep", 1.0, timeout=0.2)
        assert 0.2 <= time.monotonic() - started < 0.9  # at the timeout, not the 1 s answer
        assert client.call_utility("echo", 1, timeout=5) == [1]

    def test_death_while_a_call_borrows_the_socket(
        self, client: StageClient, long_borrow: None, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        entered = borrowing(client, monkeypatch)
        killed_at: list[float] = []

        def kill() -> None:
            if entered.wait(5):
                os.kill(client.pid, signal.SIGKILL)
                killed_at.append(time.monotonic())

        killer = threading.Thread(target=kill, daemon=True)
        killer.start()
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            client.call_utility("sleep", 10)
        killer.join()
        assert time.monotonic() - killed_at[0] < 1.0

    def test_close_from_another_thread_while_a_call_borrows(
        self, server: Server, long_borrow: None, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # A connected stage has no sentinel, and close() only detaches: the borrower must
        # give the socket back when close() wakes it, or close() would wait for the answer.
        client = StageClient.connect(server.address)
        entered = borrowing(client, monkeypatch)
        thread, outcome = call_in_thread(client, "sleep", 1.0)
        assert entered.wait(5)
        started = time.monotonic()
        client.close()
        thread.join(5)
        assert time.monotonic() - started < 0.9  # woken by close(), not the 1 s answer
        assert isinstance(outcome.get("exc"), StageClosedError)

    def test_close_from_a_done_callback_on_a_borrowing_caller(
        self, client: StageClient, long_borrow: None
    ) -> None:
        # The future's answer is read by the thread blocked in call_utility, so its
        # done-callback runs there: close() must not wait for that thread.
        ran_on: list[int] = []
        errors: list[BaseException] = []

        def close_from_callback(_: concurrent.futures.Future[object]) -> None:
            ran_on.append(threading.get_ident())
            try:
                client.close()
            except BaseException as exc:
                errors.append(exc)

        client.call_utility_future("sleep", 0.5).add_done_callback(close_from_callback)
        thread, outcome = call_in_thread(client, "echo", "x")
        thread.join(10)
        assert not thread.is_alive()
        assert ran_on == [thread.ident]
        assert errors == []
        assert outcome == {"value": ["x"]}  # sent before the shutdown: answered
        client.close()  # waits for the close the callback started
        assert client.exit_code == 0

    def test_a_blocking_call_from_a_done_callback_on_a_borrowing_caller_raises(
        self, client: StageClient, long_borrow: None
    ) -> None:
        # The future's answer is read by the thread blocked in call_utility, so its
        # done-callback runs there: a blocking call in it could only wait for itself.
        outcome: concurrent.futures.Future[object] = concurrent.futures.Future()

        def blocking_call(_: concurrent.futures.Future[object]) -> None:
            try:
                outcome.set_result(client.call_utility("echo", "inner"))
            except BaseException as exc:
                outcome.set_result(exc)

        client.call_utility_future("sleep", 0.5).add_done_callback(blocking_call)
        thread, result = call_in_thread(client, "echo", "x")
        thread.join(10)
        assert result == {"value": ["x"]}
        assert isinstance(outcome.result(10), RuntimeError)

    def test_close_from_a_done_callback_run_by_close_itself(self, server: Server) -> None:
        # close() fails the pending future on its own thread, which runs its callbacks.
        client = StageClient.connect(server.address)
        errors: list[BaseException] = []

        def close_again(_: concurrent.futures.Future[object]) -> None:
            try:
                client.close()
            except BaseException as exc:
                errors.append(exc)

        future = client.call_utility_future("sleep", 1.0)
        future.add_done_callback(close_again)
        client.close()
        assert isinstance(future.exception(0), StageClosedError)
        assert errors == []

    def test_keyboard_interrupt_while_borrowing_gives_the_socket_back(
        self, client: StageClient, long_borrow: None, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        assert threading.current_thread() is threading.main_thread()
        entered = borrowing(client, monkeypatch)
        main = threading.get_ident()

        def interrupt() -> None:
            if entered.wait(5):
                signal.pthread_kill(main, signal.SIGINT)

        interrupter = threading.Thread(target=interrupt, daemon=True)
        interrupter.start()
        with pytest.raises(KeyboardInterrupt):
            client.call_utility("sleep", 0.5)
        interrupter.join()
        assert client.call_utility("echo", 1, timeout=5) == [1]
        assert client.add("r", 2).collect(timeout=5) == [1, 0]

    def test_a_failing_receiver_thread_fails_a_borrowing_call(
        self, client: StageClient, long_borrow: None, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        def broken(now: float) -> object:
            raise RuntimeError("broken timers")

        monkeypatch.setattr(client._session, "tick", broken)  # runs on the receiver thread
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match="receiver thread failed"):
            client.call_utility("sleep", 2.0, timeout=5)
        assert time.monotonic() - started < 1.5  # not at the answer (2 s): at the failure
        monkeypatch.undo()
        assert client.shutdown(timeout=0.1) is not None


class TestBorrowedSocketOfAConnectedStage:
    def test_heartbeats_go_on_while_a_call_borrows_or_the_socket_idles(
        self, server: Server, long_borrow: None
    ) -> None:
        client = StageClient.connect(server.address, heartbeat_interval=0.1, heartbeat_timeout=0.5)
        try:
            # The stage answers pings while its loop sleeps; the parked receiver thread
            # sends them, the borrowing caller reads the pongs.
            assert client.call_utility("sleep", 1.0, timeout=5) is None
            # The socket idles after the call: the receiver takes it back to read the pongs.
            time.sleep(1.0)  # twice the heartbeat timeout goes by, nothing else sent
            assert client.call_utility("echo", 1, timeout=5) == [1]
        finally:
            client.close()

    def test_death_while_a_call_borrows_is_seen_by_the_heartbeat(
        self, server: Server, long_borrow: None
    ) -> None:
        client = StageClient.connect(server.address, heartbeat_interval=0.1, heartbeat_timeout=0.5)
        try:
            thread, outcome = call_in_thread(client, "sleep", 10)
            time.sleep(0.3)  # some pongs come while the call borrows
            server.proc.kill()
            killed_at = time.monotonic()
            thread.join(5)
            assert time.monotonic() - killed_at < 1.0
            assert isinstance(outcome.get("exc"), EngineDeadError)
            assert "no heartbeat" in str(outcome["exc"])
        finally:
            client.close()
