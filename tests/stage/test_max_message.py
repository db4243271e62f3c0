"""``serve --max-message-bytes N`` (``launch(max_message_bytes=N)``): the largest frame the
stage's input socket takes. A peer that sends a bigger one is disconnected by libzmq before
the frame is held in memory; the stage says its bound in its ``welcome``, and the Python
clients refuse a bigger message before sending it (``docs/security.md``, ``docs/wire.md``).
Real processes, real sockets."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from enginecore import __main__ as cli
from enginecore.stage import CurveKeys, MessageTooLargeError, Outputs, StageClient, StagePool
from enginecore.stage._codec import OOB_THRESHOLD
from enginecore.stage._curve import keygen
from enginecore.stage._session import ClientSession
from enginecore.stage._wire import (
    MIN_MESSAGE_BYTES,
    WelcomeMsg,
    handshake_decoder,
    welcome_frame,
)

from .conftest import ECHO, SCRIPTED, Connect, Launch, Server
from .raw import RawClient
from .test_curve import Keys, _curve_args

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def curve_keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    """A stage's key pair and a listed client's (``alice``), as ``test_curve`` makes them."""
    root = tmp_path_factory.mktemp("curve")
    stage_public, stage_secret = keygen(root / "stage", "stage")
    keygen(root / "authorized", "alice")
    _, alice_secret = keygen(root / "alice", "alice")
    os.replace(root / "authorized" / "alice.key_secret", root / "alice" / "alice.key_secret")
    alice = CurveKeys.load(alice_secret, stage_public)
    return Keys(Path(stage_secret), Path(stage_public), root / "authorized", alice, alice, alice)


def _add_of_size(size: int, req_id: str = "r") -> bytes:
    """An ``add`` of bytes data whose encoding is exactly *size* bytes long."""
    for n in range(size, size - 16, -1):
        body = msgspec.msgpack.encode(["add", req_id, b"x" * n])
        if len(body) == size:
            return body
    raise AssertionError(f"no add of exactly {size} bytes")


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


class _Watched(RawClient):
    """A raw client whose DEALER's connection events are watched (a monitor socket)."""

    def __init__(self, address: str, curve: CurveKeys | None = None) -> None:
        super().__init__(address, curve=curve)
        # (Its connection may be made before the monitor starts: only disconnections count.)
        self.monitor = self.dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def disconnected(self, timeout: float) -> bool:
        """Whether the stage drops this connection within *timeout* seconds."""
        if not self.monitor.poll(round(timeout * 1000)):
            return False
        return bool(recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED)

    def __enter__(self) -> _Watched:
        return self

    def close(self) -> None:
        self.dealer.disable_monitor()
        self.monitor.close()
        super().close()


def _serve(*extra: str) -> Server:
    return Server("--engine", ECHO, "--bind", "tcp://127.0.0.1:*", "--max-clients", "2", *extra)


class TestWelcome:
    def test_the_welcome_says_the_bound_as_its_seventh_element(self) -> None:
        frame = welcome_frame("tcp://h:1", 7, "e", (), max_message_bytes=LIMIT)
        assert msgspec.msgpack.decode(frame) == ["welcome", 2, "tcp://h:1", 7, "e", [], LIMIT]
        reply = handshake_decoder.decode(frame)
        assert isinstance(reply, WelcomeMsg)
        assert reply.max_message_bytes == LIMIT

    def test_without_a_bound_the_welcome_is_as_before(self) -> None:
        # Five elements (six with a pipeline stage's features): what older clients read.
        assert msgspec.msgpack.decode(welcome_frame("tcp://h:1", 7, "e")) == [
            "welcome",
            2,
            "tcp://h:1",
            7,
            "e",
        ]
        reply = handshake_decoder.decode(welcome_frame("tcp://h:1", 7, "e", ("tags",)))
        assert isinstance(reply, WelcomeMsg)
        assert reply.max_message_bytes is None


class TestRawPeer:
    def test_an_oversized_frame_drops_its_peer_and_nothing_else(self, no_leftovers: str) -> None:
        srv = _serve("--max-message-bytes", str(LIMIT))
        try:
            with _Watched(srv.address) as peer, RawClient(srv.address) as other:
                welcome = peer.hello()
                assert welcome[0] == "welcome"
                assert welcome[6] == LIMIT
                assert other.hello()[0] == "welcome"
                before = _rss_kib(srv.proc.pid)
                # 256 MiB declared in one frame: libzmq reads the frame's size and drops the
                # connection, without taking in the payload.
                peer.send_raw(b"\x00" * (256 * 1024 * 1024))
                assert peer.disconnected(30), "the oversized frame's connection was kept"
                grown = _rss_kib(srv.proc.pid) - before
                assert grown < 64 * 1024, f"the stage grew by {grown} KiB"
                # The stage still serves: the other client, and the peer once reconnected.
                other.send("add", "a", "small")
                events = other.until(lambda ev: ev[0] == "outputs")
                assert events[-1][1] == ["a"]
        finally:
            assert srv.stop() == 0

    def test_a_frame_at_the_bound_passes_and_one_byte_more_does_not(
        self, no_leftovers: str
    ) -> None:
        srv = _serve("--max-message-bytes", str(LIMIT))
        try:
            with _Watched(srv.address) as peer:
                assert peer.hello()[0] == "welcome"
                peer.send_raw(_add_of_size(LIMIT, "at"))
                events = peer.until(lambda ev: ev[0] == "outputs")
                assert events[-1][1] == ["at"]
                peer.send_raw(_add_of_size(LIMIT + 1, "over"))
                assert peer.disconnected(10)
        finally:
            assert srv.stop() == 0

    def test_without_the_option_a_big_frame_is_taken(self, no_leftovers: str) -> None:
        # Today's behaviour, the default: unbounded, and the welcome says nothing more.
        srv = _serve()
        try:
            with _Watched(srv.address) as peer:
                welcome = peer.hello()
                assert len(welcome) == 5
                peer.send_raw(_add_of_size(LIMIT + 1, "big"))
                events = peer.until(lambda ev: ev[0] == "outputs")
                assert events[-1][1] == ["big"]
        finally:
            assert srv.stop() == 0


def test_with_curve_the_bound_is_on_the_frame_as_the_client_encodes_it(
    connect: Connect, curve_keys: Keys, no_leftovers: str
) -> None:
    # CURVE adds its own bytes to each frame on the wire, and its handshake's commands go
    # through the same check: at the least bound, the handshake passes, a frame of exactly
    # the bound passes, and one byte more is refused, as without CURVE.
    least = 1024
    srv = _serve("--max-message-bytes", str(least), *_curve_args(curve_keys))
    try:
        client = connect(srv.address, curve=curve_keys.alice)
        assert client.call_utility("echo", "x", timeout=10) == ["x"]
        with _Watched(srv.address, curve=curve_keys.alice) as peer:
            assert peer.hello()[6] == least
            peer.send_raw(_add_of_size(least, "at"))
            assert peer.until(lambda ev: ev[0] == "outputs")[-1][1] == ["at"]
            peer.send_raw(_add_of_size(least + 1, "over"))
            assert peer.disconnected(10)
        with pytest.raises(MessageTooLargeError):
            client.add("over", b"x" * (least + 1))
        assert client.add("ok", b"x" * (least // 2)).collect(10) == [b"x" * (least // 2)]
    finally:
        assert srv.stop() == 0


def _closed_within(port: int, payload: bytes, timeout: float) -> bool:
    """Whether the stage closes a raw TCP connection to *port* within *timeout* seconds
    after *payload* (its greeting is read and dropped)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(payload)
            while sock.recv(65536):
                pass
        except TimeoutError:
            return False
        except (ConnectionResetError, BrokenPipeError):
            pass
    return True


def test_a_peer_without_a_key_is_dropped_at_the_size_it_declares(
    curve_keys: Keys, no_leftovers: str
) -> None:
    # Before any handshake: a CURVE greeting, then a command frame that declares 1 GiB.
    # Unbounded, libzmq waits for it (and holds what arrives) until the 30 s handshake
    # interval; bounded, it drops the connection at the frame's header.
    greeting = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\0")
    greeting += b"\0" * 32
    header = bytes([0x06]) + (1 << 30).to_bytes(8, "big")
    srv = _serve("--max-message-bytes", "1024", *_curve_args(curve_keys))
    try:
        port = int(srv.address.rpartition(":")[2])
        assert _closed_within(port, greeting + header + b"\0" * 4096, 10)
    finally:
        assert srv.stop() == 0


def _refused(client: StageClient, what: Any) -> None:
    with pytest.raises(MessageTooLargeError, match=rf"at most {LIMIT} bytes") as info:
        what()
    assert isinstance(info.value, ValueError)
    assert "--max-message-bytes" in str(info.value)


def _still_serves(client: StageClient) -> None:
    assert client.add("ok", "small").collect(10) == ["small"]
    assert client.call_utility("echo", "x", timeout=10) == ["x"]


class TestClients:
    def test_an_oversized_message_is_refused_before_it_is_sent(
        self, connect: Connect, no_leftovers: str
    ) -> None:
        srv = _serve("--max-message-bytes", str(LIMIT))
        try:
            client = connect(srv.address)
            big = b"x" * (LIMIT + 1)
            _refused(client, lambda: client.add("big", big))
            _refused(client, lambda: client.add("big", big, stream=False))
            _refused(client, lambda: client.add_many([("a", "small"), ("b", big)]))
            _refused(client, lambda: client.call_utility("echo", big, timeout=10))
            # An array goes out of band, in a frame of its own: each frame is held to the
            # bound, not the message (libzmq's MAXMSGSIZE is on a frame).
            _refused(client, lambda: client.add("arr", np.zeros(LIMIT + 1, dtype=np.uint8)))
            two = [np.ones(LIMIT, dtype=np.uint8), np.zeros(LIMIT, dtype=np.uint8)]
            got = client.add("arr", two).collect(10)
            assert [a.tobytes() for a in got[0]] == [a.tobytes() for a in two]
            # Nothing was registered: the ids are free, the session goes on.
            _still_serves(client)
            assert client.add("big", b"x" * (LIMIT // 2)).collect(10) == [b"x" * (LIMIT // 2)]
            assert client.health() == "ok"
        finally:
            assert srv.stop() == 0

    def test_a_launched_stage_takes_the_bound(self, launch: Launch) -> None:
        client = launch(ECHO, max_message_bytes=LIMIT)
        _refused(client, lambda: client.add("big", b"x" * (LIMIT + 1)))
        _still_serves(client)

    @pytest.mark.parametrize("value", [0, -1, 1023, True, 1.5, "4096"])
    def test_launch_refuses_a_bad_bound_before_starting(self, launch: Launch, value: Any) -> None:
        with pytest.raises((TypeError, ValueError), match="max_message_bytes"):
            launch(ECHO, max_message_bytes=value)


class TestServeOption:
    @pytest.mark.parametrize("value", ["0", "-5", "abc", "1.5", "1023"])
    def test_a_bad_value_is_a_usage_error(self, value: str) -> None:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "enginecore",
                "serve",
                "--engine",
                ECHO,
                "--max-message-bytes",
                value,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 2, result.stderr
        assert "--max-message-bytes: must be an int >= 1024" in result.stderr
        assert "invalid _" not in result.stderr

    def test_the_cli_floor_is_the_stage_s(self) -> None:
        # The parser is built without importing the stage (pyzmq): its own copy.
        assert cli._MIN_MESSAGE_BYTES == MIN_MESSAGE_BYTES

    def test_the_help_names_it(self) -> None:
        result = subprocess.run(
            [sys.executable, "-m", "enginecore", "serve", "--help"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert "--max-message-bytes" in result.stdout


def test_a_pool_member_refuses_it_too_and_the_pool_goes_on(no_leftovers: str) -> None:
    # A pool's replicas are clients: each one's welcome carries its stage's bound, and the
    # pool's add raises the member's refusal, with nothing left tracked for the id.
    srv = _serve("--max-message-bytes", str(LIMIT))
    try:
        with StagePool.connect([srv.address]) as pool:
            with pytest.raises(MessageTooLargeError):
                pool.add("big", b"x" * (LIMIT + 1))
            with pytest.raises(MessageTooLargeError):
                pool.add_many([("a", "small"), ("big", b"x" * (LIMIT + 1))])
            assert pool.add("big", "small").collect(10) == ["small"]
            assert pool.add("a", "small").collect(10) == ["small"]
    finally:
        assert srv.stop() == 0


def test_a_launched_pool_takes_the_bound(no_leftovers: str) -> None:
    with StagePool.launch(ECHO, replicas=2, max_message_bytes=LIMIT, startup_timeout=30) as pool:
        with pytest.raises(MessageTooLargeError):
            pool.add("big", b"x" * (LIMIT + 1))
        assert pool.add("big", "small").collect(10) == ["small"]


LEAST = MIN_MESSAGE_BYTES
IDS = [f"request-{i:04d}" for i in range(200)]  # any message naming them all: ~2.6 kB


def _scripted(*extra: str) -> Server:
    return Server("--engine", SCRIPTED, "--bind", "tcp://127.0.0.1:*", "--max-clients", "2", *extra)


class TestSplit:
    """Over the bound, an ``abort`` or an ``add_many`` of many small parts goes in several
    frames instead of being refused: only a part that alone does not fit is."""

    def test_an_abort_of_many_ids_goes_in_several_frames(self, launch: Launch) -> None:
        client = launch(SCRIPTED, max_message_bytes=LEAST)
        assert len(ClientSession.abort_frame(IDS)[0]) > 2 * LEAST
        client.call_utility("pace", 0.01, timeout=10)
        streams = [client.add(rid, 1_000_000) for rid in IDS]
        client.abort(IDS)
        for stream in streams:
            stream.collect(10)
            assert stream.aborted
        assert client.call_utility("num_requests", timeout=10) == 0
        log = client.call_utility("log", timeout=10)
        assert [e for e in log if e.startswith("abort")] == [f"abort {rid}" for rid in IDS]

    def test_an_abort_with_an_id_that_alone_is_too_large_sends_nothing(
        self, launch: Launch
    ) -> None:
        client = launch(SCRIPTED, max_message_bytes=LEAST)
        client.call_utility("pace", 0.01, timeout=10)
        stream = client.add("live", 1_000_000)
        huge = "h" * (LEAST + 1)
        with pytest.raises(MessageTooLargeError, match=r"request id 'hhh") as info:
            client.abort([*IDS, "live", huge])
        assert info.value.limit == LEAST
        assert info.value.size > LEAST
        log = client.call_utility("log", timeout=10)
        assert not [e for e in log if e.startswith("abort")]
        client.abort(["live"])  # the session goes on
        stream.collect(10)
        assert stream.aborted

    def test_an_add_many_of_many_small_requests_goes_in_several_frames(
        self, launch: Launch
    ) -> None:
        client = launch(SCRIPTED, max_message_bytes=LEAST)
        items = [(rid, 3) for rid in IDS]
        assert len(ClientSession.adds_frame(items)[1][0]) > 2 * LEAST
        streams = client.add_many(items)
        assert [s.req_id for s in streams] == IDS
        assert [s.collect(10) for s in streams] == [[2, 1, 0]] * len(IDS)
        log = client.call_utility("log", timeout=10)
        assert log == [f"add {rid}" for rid in IDS]  # in order, each once

    def test_an_add_many_without_streams_goes_in_several_frames(self, launch: Launch) -> None:
        client = launch(SCRIPTED, max_message_bytes=LEAST, ordered_events=True)
        assert client.add_many([(rid, 1) for rid in IDS], streams=False) is None
        assert client.call_utility("log", timeout=10) == [f"add {rid}" for rid in IDS]
        ended: list[str | None] = []
        while len(ended) < len(IDS):
            event = client.get_event(10)
            if isinstance(event, Outputs):
                ended += [r for r, f in zip(event.req_ids, event.finished, strict=True) if f]
        assert sorted(map(str, ended)) == IDS

    def test_an_add_many_with_one_request_too_large_sends_nothing(self, launch: Launch) -> None:
        client = launch(SCRIPTED, max_message_bytes=LEAST)
        items: list[tuple[str, Any]] = [(rid, 3) for rid in IDS]
        items.insert(150, ("big", "x" * (LEAST + 1)))  # a str: in the body, not out of band
        with pytest.raises(MessageTooLargeError, match=r"request 'big'"):
            client.add_many(items)
        assert client.call_utility("log", timeout=10) == []
        # Nothing was registered: every id is free.
        assert [s.collect(10) for s in client.add_many(items[:3])] == [[2, 1, 0]] * 3

    def test_an_add_many_of_arrays_splits_their_frames_with_them(
        self, connect: Connect, no_leftovers: str
    ) -> None:
        # Each array goes out of band, in a frame of its own; the body names them all. Split,
        # each part's body names its own arrays, and each request gets its own data back.
        srv = _serve("--max-message-bytes", str(LEAST))
        try:
            client = connect(srv.address)
            size = OOB_THRESHOLD  # out of band, and at the bound: each array's frame fits
            items = [(rid, np.full(size, i % 251, dtype=np.uint8)) for i, rid in enumerate(IDS)]
            parts = ClientSession.adds_frame(items)[1]
            assert len(parts) == len(IDS) + 1
            assert len(parts[0]) > LEAST
            streams = client.add_many(items)
            assert [s.req_id for s in streams] == IDS
            for stream, (_, data) in zip(streams, items, strict=True):
                assert [a.tobytes() for a in stream.collect(10)] == [data.tobytes()]
            # An array over the bound is its own frame: refused, whatever splitting does.
            too_big = [("a", "small"), ("b", np.zeros(LEAST + 1, dtype=np.uint8))]
            with pytest.raises(MessageTooLargeError):
                client.add_many(too_big)
            _still_serves(client)
        finally:
            assert srv.stop() == 0


def test_a_pool_refuses_an_add_many_before_any_replica_s_part_is_sent(
    no_leftovers: str,
) -> None:
    # Routed over two replicas: the request too large is refused before the other
    # replica's part leaves, whichever replica it was routed to.
    servers = [_scripted("--max-message-bytes", str(LEAST)) for _ in range(2)]
    try:
        watchers = [StageClient.connect(s.address) for s in servers]
        try:
            with StagePool.connect([s.address for s in servers]) as pool:
                for at in (0, 1, 2, 3):
                    items: list[tuple[str, Any]] = [(f"s{i}", 3) for i in range(8)]
                    items.insert(at, ("big", "x" * (LEAST + 1)))
                    with pytest.raises(MessageTooLargeError, match=r"request 'big'"):
                        pool.add_many(items)
                    for watcher in watchers:
                        assert watcher.call_utility("log", timeout=10) == []
                # Over the bound, many small requests go, split on each replica.
                items = [(rid, 3) for rid in IDS]
                streams = pool.add_many(items)
                assert [s.req_id for s in streams] == IDS
                assert [s.collect(10) for s in streams] == [[2, 1, 0]] * len(IDS)
                logs = [watcher.call_utility("log", timeout=10) for watcher in watchers]
                assert sorted(e for log in logs for e in log) == sorted(f"add {r}" for r in IDS)
                assert all(logs)  # both replicas took a part
                # An abort of them all: each replica's share goes in several frames.
                for watcher in watchers:
                    watcher.call_utility("pace", 0.01, timeout=10)
                streams = pool.add_many([(rid, 1_000_000) for rid in IDS])
                pool.abort(IDS)
                for stream in streams:
                    stream.collect(10)
                    assert stream.aborted
                logs = [watcher.call_utility("log", timeout=10) for watcher in watchers]
                aborts = [e for log in logs for e in log if e.startswith("abort")]
                assert sorted(aborts) == sorted(f"abort {r}" for r in IDS)
        finally:
            for watcher in watchers:
                watcher.close()
    finally:
        for srv in servers:
            assert srv.stop() == 0


def test_a_pool_s_request_that_ends_before_its_burst_is_tracked_frees_its_id(
    no_leftovers: str,
) -> None:
    # A pool's add_many over two replicas holds its ids in the pool's table, and puts the
    # streams there after each member's sends. Split, a member sends its part's frames one
    # after the other, and a request of the first may end before the last is sent: its
    # stream, skipped as ended, left the hold there, and the id read as live for ever.
    servers = [_serve("--max-message-bytes", str(LEAST)) for _ in range(2)]
    try:
        with StagePool.connect([s.address for s in servers]) as pool:
            patched: list[tuple[Any, Any]] = []
            for replica in pool._core.candidates():
                member = replica._client
                send = member._send
                patched.append((member, send))

                def send_and_wait(parts: Any, send: Any = send, member: Any = member) -> None:
                    send(parts)
                    # Until the stage's answers have ended this frame's requests (ECHO: one
                    # output each).
                    ids = set(msgspec.msgpack.decode(parts[0])[1])
                    deadline = time.monotonic() + 10
                    while ids & member._session._streams.keys():
                        assert time.monotonic() < deadline
                        time.sleep(0.001)

                member._send = send_and_wait
            items = [(rid, "x") for rid in IDS]
            streams = pool.add_many(items)
            assert {s.replica for s in streams} == set(pool._core.candidates())
            assert [s.collect(10) for s in streams] == [["x"]] * len(IDS)
            again = pool.add_many(items)  # the ids are free again
            assert [s.collect(10) for s in again] == [["x"]] * len(IDS)
            for member, send in patched:  # the close's own messages (bye) sent as they are
                member._send = send
    finally:
        for srv in servers:
            assert srv.stop() == 0
