"""Observers (``docs/wire.md`` section 3): a ``stats`` request from a peer that is not the
attached client is answered on the input socket, never reaches the attached client, and
leaves its session as it was; :class:`StageObserver` reads a stage through that path."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

from enginecore.stage import StageClient, StageClosedError, StageObserver, StageStatistics

from .conftest import Server
from .raw import RawClient

encode = msgspec.msgpack.encode

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def observer_sock(server: Server) -> Iterator[zmq.Socket[bytes]]:
    """A raw DEALER on the stage's input socket that never says hello."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    try:
        yield sock
    finally:
        sock.close()
        ctx.term()


def _reply(sock: zmq.Socket[bytes], timeout: float = 5.0) -> Any:
    assert sock.poll(round(timeout * 1000)), f"no reply on the input socket in {timeout} s"
    parts = sock.recv_multipart()
    assert len(parts) == 1
    return msgspec.msgpack.decode(parts[0])


def _no_reply(sock: zmq.Socket[bytes], seconds: float = 0.3) -> None:
    assert not sock.poll(round(seconds * 1000)), msgspec.msgpack.decode(sock.recv())


def _events_until_pong(client: RawClient, seq: int) -> list[list[Any]]:
    """Everything the attached client receives up to the pong of its own ping *seq*: the
    stage's input thread handles one peer's messages in order, and an observer's were
    sent (and answered) before."""
    client.send("ping", seq)
    return client.until(lambda ev: ev == ["pong", seq])


class TestObserverProtocol:
    def test_stats_from_a_peer_with_no_client_attached(
        self, server: Server, observer_sock: zmq.Socket[bytes]
    ) -> None:
        observer_sock.send(encode(["stats", 7]))
        tag, call_id, result, error = _reply(observer_sock)
        assert (tag, call_id, error) == ("utility", 7, None)
        stats = StageStatistics.from_wire(result)
        assert stats.pid == server.proc.pid
        assert stats.name == "enginecore.stage.testing:scripted"

    def test_answered_on_the_input_socket_and_never_seen_by_the_attached_client(
        self, server: Server, observer_sock: zmq.Socket[bytes]
    ) -> None:
        with RawClient(server.address) as client:
            assert client.hello()[0] == "welcome"
            client.send("add", "r1", 3)
            observer_sock.send(encode(["stats", 7]))
            tag, call_id, result, error = _reply(observer_sock)
            assert (tag, call_id, error) == ("utility", 7, None)
            assert StageStatistics.from_wire(result).pid == server.proc.pid
            # The attached client's own stats still comes on its output socket, as before.
            client.send("stats", 7)
            seen = client.until(lambda ev: ev[0] == "utility")
            assert seen[-1][:2] == ["utility", 7]
            assert StageStatistics.from_wire(seen[-1][2]).live in (0, 1)
            if not _last_of("r1")(seen[-1]) and not any(map(_last_of("r1"), seen)):
                seen += client.until(_last_of("r1"))
            seen += _events_until_pong(client, 1)
            assert [ev[0] for ev in seen].count("utility") == 1  # its own answer, only
            assert not [ev for ev in seen if ev[0] == "error"]
            outputs = [p for ev in seen if ev[0] == "outputs" for p in ev[3]]
            assert outputs == [2, 1, 0]
            # The session goes on: a call, a request, and the stage still knows it attached.
            assert client.call(8, "div", 6, 3)[-1] == ["utility", 8, 2.0, None]
            client.send("hello", 2, "raw")  # the attached client again: welcomed
            assert client.reply()[0] == "welcome"
            with RawClient(server.address) as other:  # and nobody else
                assert other.hello()[0] == "reject"

    def test_bad_stats_requests_from_an_observer(
        self, server: Server, observer_sock: zmq.Socket[bytes]
    ) -> None:
        with RawClient(server.address) as client:
            assert client.hello()[0] == "welcome"
            # A call id that can be read: the request fails, on the input socket.
            observer_sock.send(encode(["stats", 5, "abc"])[:-2])
            tag, call_id, result, error = _reply(observer_sock)
            assert (tag, call_id, result) == ("utility", 5, None)
            assert error.startswith("ProtocolError('invalid message")
            # No call id to answer with: nothing at all, to anybody.
            for frame in (encode(["stats"]), encode(["stats", 1.5]), encode(["stats", "x"])):
                observer_sock.send(frame)
            _no_reply(observer_sock)
            # Oversized: trailing elements are ignored; it is answered like any other.
            observer_sock.send(encode(["stats", 6, b"\0" * (16 << 20), list(range(10_000))]))
            assert _reply(observer_sock, 10)[:2] == ["utility", 6]
            # A flood that the observer does not read leaves the stage alone.
            for i in range(3000):
                observer_sock.send(encode(["stats", 100 + i]))
            seen = _events_until_pong(client, 2)
            assert seen == [["pong", 2]]
            assert client.call(9, "div", 1, 4)[-1] == ["utility", 9, 0.25, None]
            client.send("add", "r2", 2)
            assert [p for ev in client.until(_last_of("r2")) for p in ev[3]] == [1, 0]
        assert server.proc.poll() is None

    def test_answered_while_the_loop_is_in_a_long_step(self, server: Server) -> None:
        with StageClient.connect(server.address) as client, StageObserver(server.address) as obs:
            before = obs.stats().steps
            client.call_utility("stall_next_step", 3.0)
            # The stalled step starts right after the call: the observer is answered at
            # once while it runs (the input thread answers), and it has not returned yet.
            started = time.monotonic()
            stats = obs.stats(timeout=2.0)
            assert time.monotonic() - started < 1.0
            assert stats.steps == before
            assert client.stats(timeout=2.0).steps == before  # the client's, too


def _last_of(req_id: str) -> Any:
    def done(ev: list[Any]) -> bool:
        return ev[0] == "outputs" and any(
            rid == req_id and fin for rid, fin in zip(ev[1], ev[2], strict=True)
        )

    return done


class TestStageObserver:
    def test_reads_a_stage_that_serves_a_client_and_disturbs_nothing(self, server: Server) -> None:
        with StageObserver(server.address) as obs:
            with StageClient.connect(server.address) as client:
                stream = client.add("r1", 200)
                seen = [obs.stats() for _ in range(5)]
                assert [s.pid for s in seen] == [server.proc.pid] * 5
                assert stream.collect(timeout=10) == list(range(199, -1, -1))
                assert client.call_utility("div", 1, 2) == 0.5
                assert client.health() == "ok"
                after = obs.stats()
                assert after.steps >= 200
                assert after.live == 0
                # The client's session is the one the stage keeps: another hello is refused.
                with pytest.raises(Exception, match="another client is attached"):
                    StageClient.connect(server.address, timeout=5)
            assert obs.stats().steps == after.steps  # an observer outlives the session

    def test_only_the_latest_request_is_answered(self, server: Server) -> None:
        with StageObserver(server.address) as obs:
            assert obs.request()
            assert obs.request()
            stats = obs.answer(5.0)
            assert stats is not None
            assert obs.answer(0.3) is None  # the first answer arrived, and was dropped

    def test_nothing_there_times_out(self) -> None:
        with socket.socket() as s:  # a port that nothing listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with StageObserver(f"tcp://127.0.0.1:{port}") as obs:
            started = time.monotonic()
            with pytest.raises(TimeoutError, match="no answer"):
                obs.stats(timeout=0.3)
            assert time.monotonic() - started < 2.0
            for _ in range(20):  # never blocks, even with the queue full
                obs.request()

    @pytest.mark.parametrize(
        ("timeout", "error"),
        [
            ("1", TypeError),
            (None, TypeError),
            (True, TypeError),
            (-1, ValueError),
            (float("nan"), ValueError),
        ],
        ids=["str", "none", "bool", "negative", "nan"],
    )
    def test_a_timeout_that_is_not_seconds_is_refused(
        self, timeout: Any, error: type[Exception]
    ) -> None:
        # Before: a bare comparison error, one second for True, and an immediate
        # TimeoutError for a negative or NaN timeout.
        with StageObserver("tcp://127.0.0.1:1") as obs:
            with pytest.raises(error, match="timeout"):
                obs.stats(timeout=timeout)
            with pytest.raises(error, match="timeout"):
                obs.answer(timeout)

    @pytest.mark.parametrize("timeout", [float("inf"), 1e300], ids=["inf", "huge"])
    def test_an_unbounded_timeout_waits_for_the_answer(
        self, server: Server, timeout: float
    ) -> None:
        # Before: OverflowError from the poll's millisecond count, before any answer.
        with StageObserver(server.address) as obs:
            assert obs.stats(timeout=timeout).pid == server.proc.pid
            assert obs.request()
            stats = obs.answer(timeout)
            assert stats is not None
            assert stats.pid == server.proc.pid

    def test_an_address_that_is_not_a_str_is_a_type_error(self) -> None:
        with pytest.raises(TypeError, match="address must be a str"):
            StageObserver(5)  # type: ignore[arg-type]

    @pytest.mark.parametrize(
        ("address", "message"),
        [
            # Before: libzmq's bare ZMQError "Invalid argument".
            ("nonsense", "must start with tcp:// or ipc://"),
            # Before: accepted (port 99999 is 34463 to libzmq), then only timed out.
            ("tcp://127.0.0.1:99999", "a port is 1 to 65535"),
        ],
    )
    def test_a_malformed_address_is_a_value_error(self, address: str, message: str) -> None:
        with pytest.raises(ValueError, match=message):
            StageObserver(address)

    def test_a_closed_observer_says_so(self) -> None:
        obs = StageObserver("tcp://127.0.0.1:1")
        obs.close()
        obs.close()  # idempotent
        # Before: a bare ZMQError ("Socket operation on non-socket").
        for call in (obs.stats, obs.request, obs.answer, obs.failure):
            with pytest.raises(StageClosedError, match="observer is closed"):
                call()
