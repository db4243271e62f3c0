"""Authenticated, encrypted TCP with ZeroMQ CURVE (``docs/security.md``): real ``serve``
processes and sockets. Whatever is refused must deliver nothing to the engine: each test
checks that with the scripted engine's ``log`` utility (every ``add`` it saw), through a
listed client, after the attempt, and that the stage still serves that client."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import pytest
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from enginecore.stage import (
    PROTOCOL_VERSION,
    AsyncStagePool,
    AuthenticationError,
    CurveKeys,
    ProtocolError,
    SessionLostError,
    StageClient,
    StageObserver,
    StagePool,
)
from enginecore.stage._curve import (
    ServerCurve,
    keygen,
    read_authorized,
    secure_server,
    start_authenticator,
)

from .conftest import SCRIPTED, Connect, Server
from .raw import RawClient, refused_handshake


class Keys(NamedTuple):
    stage_secret: Path
    stage_public: Path
    authorized: Path  # alice's public key only
    alice: CurveKeys  # listed
    mallory: CurveKeys  # a valid key pair, not listed
    wrong_server: CurveKeys  # alice's pair, with mallory's public key as the server's


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    root = tmp_path_factory.mktemp("curve")
    stage_public, stage_secret = keygen(root / "stage", "stage")
    keygen(root / "authorized", "alice")
    _, alice_secret = keygen(root / "alice", "alice")
    os.replace(root / "authorized" / "alice.key_secret", root / "alice" / "alice.key_secret")
    mallory_public, mallory_secret = keygen(root / "mallory", "mallory")
    return Keys(
        stage_secret=Path(stage_secret),
        stage_public=Path(stage_public),
        authorized=root / "authorized",
        alice=CurveKeys.load(alice_secret, stage_public),
        mallory=CurveKeys.load(mallory_secret, stage_public),
        wrong_server=CurveKeys.load(alice_secret, mallory_public),
    )


def _curve_args(keys: Keys) -> list[str]:
    return [
        "--curve-secret-key",
        str(keys.stage_secret),
        "--authorized-clients",
        str(keys.authorized),
    ]


@pytest.fixture
def curve_server(keys: Keys, no_leftovers: str, tmp_path: Path) -> Iterator[Server]:
    """A headless ScriptedEngine stage with CURVE on a free loopback port; its stderr in
    ``srv.stderr_path``."""
    stderr_path = tmp_path / "stage.err"
    with open(stderr_path, "w") as err:
        srv = Server(
            "--engine",
            SCRIPTED,
            "--bind",
            "tcp://127.0.0.1:*",
            "--session-timeout",
            "1",
            *_curve_args(keys),
            stderr=err,
        )
    srv.stderr_path = stderr_path  # type: ignore[attr-defined]
    try:
        yield srv
    finally:
        srv.stop()


def _engine_saw_nothing_and_still_serves(connect: Connect, address: str, keys: Keys) -> None:
    client = connect(address, curve=keys.alice)
    assert client.call_utility("log") == []  # no add ever reached the engine
    assert client.add("ok", 2).collect() == [1, 0]
    assert client.call_utility("log") == ["add ok"]
    client.close()


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


def _output_port(srv: Server) -> int:
    match = re.search(r"\(output (\S+),", srv.ready_line)
    assert match is not None, srv.ready_line
    return _port(match.group(1))


# -- what gets in ------------------------------------------------------------------------------


def test_a_listed_key_works_end_to_end(connect: Connect, curve_server: Server, keys: Keys) -> None:
    assert f"curve {keys.alice.server_key.decode()}" in curve_server.ready_line
    client = connect(curve_server.address, curve=keys.alice, timeout=10)
    assert client.add("r1", 3).collect() == [2, 1, 0]
    assert client.call_utility("log") == ["add r1"]
    assert client.health() == "ok"
    client.shutdown()
    # The stage stops on the client's shutdown; wait for it rather than stop() it, whose
    # SIGTERM would race the exit it is already in.
    assert curve_server.proc.wait(10) == 0


# -- key rotation: SIGHUP reloads --authorized-clients -----------------------------------------


class _Stderr:
    """A serve process's stderr, read as it comes (``os.read`` on the pipe, no buffering)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        self._fd = proc.stderr.fileno()
        self.text = ""

    def wait_for(self, text: str, timeout: float = 10.0) -> str:
        """Read until *text* has been written (the stage's own word that it acted)."""
        deadline = time.monotonic() + timeout
        while text not in self.text:
            left = deadline - time.monotonic()
            assert left > 0, f"the stage never wrote {text!r}; it wrote {self.text!r}"
            if select.select([self._fd], [], [], left)[0]:
                chunk = os.read(self._fd, 65536)
                assert chunk, f"stderr closed before {text!r}; it wrote {self.text!r}"
                self.text += chunk.decode()
        return self.text

    def line(self, text: str, timeout: float = 10.0) -> str:
        """The whole line that *text* is written in, once it is (read up to its end)."""
        at = self.wait_for(text, timeout).index(text)
        deadline = time.monotonic() + timeout
        while "\n" not in self.text[at:]:
            left = deadline - time.monotonic()
            assert left > 0, f"the line of {text!r} never ended; the stage wrote {self.text!r}"
            if select.select([self._fd], [], [], left)[0]:
                chunk = os.read(self._fd, 65536)
                assert chunk, f"stderr closed in the line of {text!r}: {self.text!r}"
                self.text += chunk.decode()
        start = self.text.rfind("\n", 0, at) + 1
        return self.text[start : self.text.index("\n", at)]


def test_sighup_rotates_the_authorized_keys(
    connect: Connect, keys: Keys, no_leftovers: str, tmp_path: Path
) -> None:
    authorized = tmp_path / "authorized"  # a directory of its own, with alice's key
    authorized.mkdir()
    shutil.copy(keys.authorized / "alice.key", authorized)
    srv = Server(
        "--engine", SCRIPTED, "--bind", "tcp://127.0.0.1:*", "--max-clients", "2",
        "--curve-secret-key", str(keys.stage_secret), "--authorized-clients", str(authorized),
        stderr=subprocess.PIPE,
    )  # fmt: skip
    stderr = _Stderr(srv.proc)
    try:
        before = connect(srv.address, curve=keys.alice)  # connected before the rotation
        with pytest.raises(AuthenticationError, match="not among the stage's authorized"):
            connect(srv.address, curve=keys.mallory, timeout=5)

        # Rotate: mallory's key in, alice's out; SIGHUP.
        shutil.copy(keys.authorized.parent / "mallory" / "mallory.key", authorized)
        (authorized / "alice.key").unlink()
        srv.proc.send_signal(signal.SIGHUP)
        stderr.wait_for("1 keys (1 added, 1 removed)")
        newcomer = connect(srv.address, curve=keys.mallory, timeout=5)  # now listed
        assert newcomer.add("m", 2).collect(timeout=10) == [1, 0]
        with pytest.raises(AuthenticationError, match="not among the stage's authorized"):
            connect(srv.address, curve=keys.alice, timeout=5)  # removed: a new one is refused
        with pytest.raises(SessionLostError, match="no longer authorizes"):
            before.add("a", 2).collect(timeout=10)  # one made before is cut too

        # A directory left without any key changes nothing: mallory still gets in.
        (authorized / "mallory.key").unlink()
        srv.proc.send_signal(signal.SIGHUP)
        stderr.wait_for("kept the 1 authorized client keys")
        newcomer.close()
        again = connect(srv.address, curve=keys.mallory, timeout=5)
        assert again.call_utility("log") == ["add m"]  # the refused added nothing
        again.close()
        before.close()
    finally:
        assert srv.stop() == 0
        assert srv.proc.stderr is not None
        srv.proc.stderr.close()


@pytest.mark.parametrize("max_clients", [1, 2])
def test_a_connected_client_whose_key_is_removed_loses_its_session(
    connect: Connect, keys: Keys, no_leftovers: str, tmp_path: Path, max_clients: int
) -> None:
    """A client connected before a rotation keeps working while its key stays listed; once
    a rotation removes it, its next message is refused, its live request is aborted (its
    stream ends with SessionLostError, and the engine saw the abort), and the stage goes
    on for the others."""
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    shutil.copy(keys.authorized / "alice.key", authorized)
    bob_public, bob_secret = keygen(tmp_path / "bob", "bob")
    shutil.copy(bob_public, authorized)
    bob_keys = CurveKeys.load(bob_secret, keys.stage_public)
    srv = Server(
        "--engine", SCRIPTED, "--bind", "tcp://127.0.0.1:*",
        "--max-clients", str(max_clients), "--session-timeout", "30",
        "--curve-secret-key", str(keys.stage_secret), "--authorized-clients", str(authorized),
        stderr=subprocess.PIPE,
    )  # fmt: skip
    stderr = _Stderr(srv.proc)
    try:
        alice = connect(srv.address, curve=keys.alice)
        alice.call_utility("pace", 0.02)
        stream = iter(alice.add("long", 100_000))
        assert next(stream) == 99_999

        # A rotation that keeps alice's key (mallory's added): she goes on.
        shutil.copy(keys.authorized.parent / "mallory" / "mallory.key", authorized)
        srv.proc.send_signal(signal.SIGHUP)
        # No key removed: nobody was cut, and the log says none was (it said "were cut").
        assert "cut" not in stderr.line("3 keys (1 added, 0 removed)")
        assert alice.call_utility("echo", 1, timeout=10) == [1]
        assert next(stream) < 99_999

        # A rotation that removes it: the stage cuts her session before it logs the reload.
        (authorized / "alice.key").unlink()
        srv.proc.send_signal(signal.SIGHUP)
        line = stderr.line("2 keys (0 added, 1 removed)")
        assert line.endswith("clients cut (connected with a removed key): 1"), line
        key = keys.alice.public_key.decode()
        assert f"CURVE key {key} is no longer authorized" in stderr.text
        revoked = f"no longer authorizes this client's CURVE public key {key}"
        with pytest.raises(SessionLostError, match=re.escape(revoked)):
            for _ in stream:  # its outputs stop, though alice sent nothing since
                pass
        with pytest.raises(SessionLostError, match=re.escape(revoked)):
            alice.call_utility("echo", 2, timeout=10)

        # The others go on; the engine saw alice's request aborted, and nothing she sent
        # after the rotation.
        bob = connect(srv.address, curve=bob_keys, timeout=10)
        assert bob.add("b", 2).collect(timeout=10) == [1, 0]
        assert bob.call_utility("log") == ["add long", "abort long", "add b"]
        with pytest.raises(AuthenticationError, match="not among the stage's authorized"):
            connect(srv.address, curve=keys.alice, timeout=5)  # a new connection: refused

        # A key removed that no connected client used (mallory's): nobody was cut.
        (authorized / "mallory.key").unlink()
        srv.proc.send_signal(signal.SIGHUP)
        assert "cut" not in stderr.line("1 keys (0 added, 1 removed)")
        assert bob.call_utility("echo", 3, timeout=10) == [3]
    finally:
        assert srv.stop() == 0
        assert srv.proc.stderr is not None
        srv.proc.stderr.close()


def test_a_revoked_raw_peer_is_rejected_and_delivers_nothing(
    connect: Connect, keys: Keys, no_leftovers: str, tmp_path: Path
) -> None:
    """Not only our clients: any peer connected with a key that a rotation removed gets a
    reject for each message (an add, a stats request), and none reaches the engine; a
    StageObserver says so with AuthenticationError, not a timeout."""
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    shutil.copy(keys.authorized / "alice.key", authorized)
    shutil.copy(keys.authorized.parent / "mallory" / "mallory.key", authorized)
    srv = Server(
        "--engine", SCRIPTED, "--bind", "tcp://127.0.0.1:*",
        "--curve-secret-key", str(keys.stage_secret), "--authorized-clients", str(authorized),
        stderr=subprocess.PIPE,
    )  # fmt: skip
    stderr = _Stderr(srv.proc)
    ctx = zmq.Context()
    try:
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.setsockopt(zmq.RCVTIMEO, 10_000)
        raw.curve_serverkey = keys.mallory.server_key
        raw.curve_publickey = keys.mallory.public_key
        raw.curve_secretkey = keys.mallory.secret_key
        raw.connect(srv.address)
        raw.send(msgspec.msgpack.encode(["stats", 1]))  # an observer's request: answered
        assert msgspec.msgpack.decode(raw.recv())[:2] == ["utility", 1]
        observer = StageObserver(srv.address, curve=keys.mallory)
        assert observer.stats(5).outputs == 0

        (authorized / "mallory.key").unlink()
        srv.proc.send_signal(signal.SIGHUP)
        stderr.wait_for("1 keys (0 added, 1 removed)")
        for message in (["add", "x", 1], ["stats", 2]):
            raw.send(msgspec.msgpack.encode(message))
            reply = msgspec.msgpack.decode(raw.recv())
            assert reply[0] == "reject", reply
            assert "no longer authorizes" in reply[2], reply
        with pytest.raises(AuthenticationError, match=r"refused this observer: .*no longer auth"):
            observer.stats(5)
        observer.close()
        _engine_saw_nothing_and_still_serves(connect, srv.address, keys)
    finally:
        ctx.destroy(linger=0)
        assert srv.stop() == 0
        assert srv.proc.stderr is not None
        srv.proc.stderr.close()


def test_a_revoked_client_that_stays_connected_does_not_keep_others_out(
    connect: Connect, keys: Keys, no_leftovers: str, tmp_path: Path
) -> None:
    """A one-client stage welcomes a hello only once nothing is connected to its output
    socket, and a PUSH cannot close one peer: a revoked client that kept its PULL open kept
    every other client out (each hello held 5 s, then rejected). The stage now binds its
    output address again, which drops that connection; the revoked peer cannot connect
    again, and none of the next client's events reach it."""
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    shutil.copy(keys.authorized / "alice.key", authorized)
    shutil.copy(keys.authorized.parent / "mallory" / "mallory.key", authorized)
    srv = Server(
        "--engine", SCRIPTED, "--bind", "tcp://127.0.0.1:*", "--session-timeout", "30",
        "--curve-secret-key", str(keys.stage_secret), "--authorized-clients", str(authorized),
        stderr=subprocess.PIPE,
    )  # fmt: skip
    stderr = _Stderr(srv.proc)
    try:
        with RawClient(srv.address, curve=keys.mallory) as mallory:
            assert mallory.hello()[0] == "welcome"
            mallory.send("add", "m", 10**8)
            assert mallory.until(lambda ev: ev[0] == "outputs")  # its PULL is connected
            (authorized / "mallory.key").unlink()
            srv.proc.send_signal(signal.SIGHUP)
            stderr.wait_for("1 keys (0 added, 1 removed)")
            # mallory keeps both sockets open and reads nothing more.
            start = time.monotonic()
            alice = connect(srv.address, curve=keys.alice, timeout=10)
            assert time.monotonic() - start < 4  # not held until the hello's 5 s deadline
            assert alice.add("a", 3).collect(timeout=10) == [2, 1, 0]
            assert alice.call_utility("log") == ["add m", "abort m", "add a"]
            assert mallory.pull is not None
            while mallory.pull.poll(200):  # what it got before the cut, and nothing after
                body = msgspec.msgpack.decode(mallory.pull.recv_multipart()[0])
                assert all(ev[0] != "outputs" or "a" not in ev[1] for ev in body), body
    finally:
        assert srv.stop() == 0
        assert srv.proc.stderr is not None
        srv.proc.stderr.close()


def _raw_peer(ctx: zmq.Context[Any], address: str, keys: CurveKeys, routing_id: bytes) -> Any:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.curve_serverkey = keys.server_key
    sock.curve_publickey = keys.public_key
    sock.curve_secretkey = keys.secret_key
    sock.connect(address)
    return sock


def test_a_routing_id_taken_over_by_another_key_is_checked_for_that_key(
    keys: Keys, no_leftovers: str, tmp_path: Path
) -> None:
    """A peer may choose its routing id, and reuse one that a peer with another key used
    before: the stage reads the key again after every new connection, so a rotation that
    removes the new peer's key cuts it, whatever key the routing id had before."""
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    shutil.copy(keys.authorized / "alice.key", authorized)
    shutil.copy(keys.authorized.parent / "mallory" / "mallory.key", authorized)
    srv = Server(
        "--engine", SCRIPTED, "--bind", "tcp://127.0.0.1:*",
        "--curve-secret-key", str(keys.stage_secret), "--authorized-clients", str(authorized),
        stderr=subprocess.PIPE,
    )  # fmt: skip
    stderr = _Stderr(srv.proc)
    ctx = zmq.Context()
    try:
        first = _raw_peer(ctx, srv.address, keys.alice, b"peer")
        first.send(msgspec.msgpack.encode(["stats", 1]))
        assert msgspec.msgpack.decode(first.recv())[:2] == ["utility", 1]  # alice's key known
        first.close(linger=0)
        # The same routing id, mallory's key: its request is delivered once the stage has
        # let go of the first connection (libzmq refuses a routing id in use until then).
        second = _raw_peer(ctx, srv.address, keys.mallory, b"peer")
        second.send(msgspec.msgpack.encode(["stats", 2]))
        assert msgspec.msgpack.decode(second.recv())[:2] == ["utility", 2]

        (authorized / "mallory.key").unlink()
        srv.proc.send_signal(signal.SIGHUP)
        stderr.wait_for("1 keys (0 added, 1 removed)")
        second.send(msgspec.msgpack.encode(["add", "x", 1]))
        reply = msgspec.msgpack.decode(second.recv())
        assert reply[0] == "reject", reply
        assert keys.mallory.public_key.decode() in reply[2], reply
        with StageClient.connect(srv.address, curve=keys.alice) as client:
            assert client.call_utility("log") == []  # the add never reached the engine
    finally:
        ctx.destroy(linger=0)
        assert srv.stop() == 0
        assert srv.proc.stderr is not None
        srv.proc.stderr.close()


def test_authorize_needs_a_curve_stage(tmp_path: Path) -> None:
    from enginecore import CountdownEngine

    from .raw import InProcessStage

    stage = InProcessStage(CountdownEngine(), str(tmp_path))
    try:
        with pytest.raises(RuntimeError, match="does not use CURVE"):
            stage.runtime.authorize(frozenset([keys_of(tmp_path)]))
    finally:
        stage.stop()


def test_authorize_takes_str_keys_and_refuses_bad_ones_without_harm(
    keys: Keys, no_leftovers: str
) -> None:
    # StageRuntime.authorize (a stage run in code, docs/security.md) with Z85 keys as str,
    # as authorize_clients takes them, or with raw 32-byte keys: the input thread failed
    # on them (AttributeError / UnicodeDecodeError) and the stage shut down, while
    # authorize() returned as if all went well.
    from enginecore import CountdownEngine

    from .raw import InProcessStage

    stage_public, stage_secret = zmq.curve_keypair()
    alice = CurveKeys(keys.alice.public_key, keys.alice.secret_key, stage_public)
    curve = ServerCurve(stage_public, stage_secret, frozenset([alice.public_key]), "-")
    stage = InProcessStage(CountdownEngine(), no_leftovers, curve=curve)
    try:
        client = StageClient.connect(stage.address, curve=alice)
        assert client.add("a", 2).collect(timeout=10) == [1, 0]
        stage.runtime.authorize(frozenset([alice.public_key.decode()]))
        assert client.add("b", 2).collect(timeout=10) == [1, 0]  # still admitted
        raw = zmq.utils.z85.decode(alice.public_key)
        for bad, error, match in [
            (frozenset([raw]), ValueError, "an authorized client key must be a 40-character"),
            (frozenset(["é" * 40]), ValueError, "not a valid Z85"),
            (alice.public_key, TypeError, "a collection of client public keys, not one key"),
            (frozenset([7]), TypeError, "must be a Z85 key"),
        ]:
            with pytest.raises(error, match=match):
                stage.runtime.authorize(bad)  # type: ignore[arg-type]
        assert client.add("c", 2).collect(timeout=10) == [1, 0]  # nothing changed
        client.close()
    finally:
        assert stage.stop() == 0


def keys_of(directory: Path) -> bytes:
    """A fresh client public key, written by ``keygen`` into *directory*."""
    public, _ = keygen(directory / "k", "k")
    return Path(public).read_bytes().split(b'public-key = "')[1][:40]


# -- what does not get in, and delivers nothing ------------------------------------------------


def test_a_multi_client_stage_gives_each_client_a_curve_socket(
    connect: Connect, keys: Keys, no_leftovers: str
) -> None:
    # Each client's own output socket is a CURVE server too: a CURVE client's PULL would
    # never connect to a plain one, and no output would arrive.
    srv = Server(
        "--engine", SCRIPTED, "--bind", "tcp://127.0.0.1:*", "--max-clients", "2",
        *_curve_args(keys),
    )  # fmt: skip
    try:
        first = connect(srv.address, curve=keys.alice)
        second = connect(srv.address, curve=keys.alice)
        assert first.add("a", 2).collect(timeout=10) == [1, 0]
        assert second.add("b", 3).collect(timeout=10) == [2, 1, 0]
    finally:
        srv.stop()


def test_a_null_client_gets_a_named_error_and_delivers_nothing(
    connect: Connect, curve_server: Server, keys: Keys
) -> None:
    started = time.monotonic()
    with pytest.raises(AuthenticationError, match="requires CURVE"):
        connect(curve_server.address, timeout=5)
    assert time.monotonic() - started < 4  # from the socket monitor, not the timeout

    # A NULL-mechanism zmq client that sends hello and an add without waiting for anything.
    hello = msgspec.msgpack.encode(["hello", PROTOCOL_VERSION, "raw"])
    refused_handshake(curve_server.address, hello, msgspec.msgpack.encode(["add", "evil", 3]))
    _engine_saw_nothing_and_still_serves(connect, curve_server.address, keys)


def test_an_unknown_key_gets_a_named_error_and_delivers_nothing(
    connect: Connect, curve_server: Server, keys: Keys
) -> None:
    started = time.monotonic()
    with pytest.raises(AuthenticationError, match="not among the stage's authorized") as info:
        connect(curve_server.address, curve=keys.mallory, timeout=5)
    assert time.monotonic() - started < 4
    assert isinstance(info.value, ProtocolError)
    assert keys.mallory.public_key.decode() in str(info.value)
    _engine_saw_nothing_and_still_serves(connect, curve_server.address, keys)
    err = curve_server.stderr_path.read_text()  # type: ignore[attr-defined]
    assert f"refused a CURVE client whose public key {keys.mallory.public_key.decode()}" in err


def test_refusals_not_reported_yet_are_counted_at_the_stop(
    connect: Connect, curve_server: Server, keys: Keys
) -> None:
    # The refusals after the first within 10 s were counted for the next report, which a
    # burst that ended never got: the log showed one refusal however many there were.
    for _ in range(3):
        with pytest.raises(AuthenticationError, match="not among the stage's authorized"):
            connect(curve_server.address, curve=keys.mallory, timeout=5)
    assert curve_server.stop() == 0
    err = curve_server.stderr_path.read_text()  # type: ignore[attr-defined]
    assert err.count("refused a CURVE client whose public key") == 1, err
    match = re.search(r"refused (\d+) more CURVE clients whose key is not authorized", err)
    assert match is not None, err
    assert int(match.group(1)) >= 2
    assert keys.mallory.secret_key.decode() not in err


def _zmtp_null_greeting() -> bytes:
    # ZMTP 3.0: signature, version 3.0, mechanism NULL, as-server 0, filler.
    return b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32


def _short_frame(flags: int, body: bytes) -> bytes:
    return bytes([flags, len(body)]) + body


def _send_and_wait_for_close(port: int, payload: bytes) -> None:
    """Send *payload* to the stage's *port*; return once the stage has closed the
    connection (it read and refused what it got)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(payload)
            while sock.recv(65536):
                pass  # the stage's greeting, if it sends one, then EOF
        except (ConnectionResetError, BrokenPipeError):
            pass  # closed while we wrote: refused as well


def _handshake(address: str, client: tuple[bytes, bytes], server_key: bytes) -> bool:
    """Whether a CURVE DEALER with the key pair *client* completes its handshake with the
    server at *address* (its first handshake event, success or failure: no waiting for a
    message that does not come)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.curve_publickey, dealer.curve_secretkey = client
        dealer.curve_serverkey = server_key
        monitor = dealer.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        )
        dealer.connect(address)
        assert monitor.poll(10_000), f"no handshake event from {address}"
        return bool(recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED)
    finally:
        ctx.destroy(linger=0)


def test_a_curve_socket_admits_no_key_while_no_zap_handler_answers() -> None:
    # CURVE without a ZAP handler admits any key pair that knows the server's public key:
    # a stage's sockets outlive its handler for a moment at teardown. They must refuse
    # every key then (fail closed), not admit every key.
    server_public, server_secret = zmq.curve_keypair()
    listed, unlisted = zmq.curve_keypair(), zmq.curve_keypair()
    curve = ServerCurve(server_public, server_secret, frozenset([listed[0]]), "-")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    auth = start_authenticator(ctx, curve)
    try:
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        secure_server(router, curve)
        address = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
        assert _handshake(address, listed, server_public)
        assert not _handshake(address, unlisted, server_public)
        auth.stop()  # the handler is gone; the socket is still bound
        assert not _handshake(address, unlisted, server_public)
        assert not _handshake(address, listed, server_public)
    finally:
        auth.stop()
        ctx.destroy(linger=0)


def test_raw_garbage_delivers_nothing(connect: Connect, curve_server: Server, keys: Keys) -> None:
    ready = _short_frame(0x04, b"\x05READY" + b"\x0bSocket-Type" + b"\0\0\0\x06DEALER")
    hello = _short_frame(0x00, msgspec.msgpack.encode(["hello", PROTOCOL_VERSION, "raw"]))
    add = _short_frame(0x00, msgspec.msgpack.encode(["add", "evil", 3]))
    payloads = [
        os.urandom(4096),
        b"\0" * 64,
        _zmtp_null_greeting() + ready + hello + add,  # a well-formed NULL client, unasked
        msgspec.msgpack.encode(["add", "evil", 3]),  # a bare message, no ZMTP at all
    ]
    for port in (_port(curve_server.address), _output_port(curve_server)):
        for payload in payloads:
            _send_and_wait_for_close(port, payload)
    _engine_saw_nothing_and_still_serves(connect, curve_server.address, keys)


def test_a_wrong_server_key_is_a_named_error_within_the_timeout(
    connect: Connect, curve_server: Server, keys: Keys
) -> None:
    started = time.monotonic()
    with pytest.raises(AuthenticationError, match=r"server public key .* is likely wrong"):
        connect(curve_server.address, curve=keys.wrong_server, timeout=5)
    assert time.monotonic() - started < 4
    _engine_saw_nothing_and_still_serves(connect, curve_server.address, keys)


def test_a_curve_client_of_a_plain_stage_is_a_named_error(
    connect: Connect, server: Server, keys: Keys
) -> None:
    with pytest.raises(AuthenticationError, match="the stage does not"):
        connect(server.address, curve=keys.alice, timeout=5)


def test_a_plain_stage_that_never_answers_is_still_a_timeout(
    connect: Connect, no_leftovers: str
) -> None:
    # Nothing listens: TimeoutError, as before (not an AuthenticationError).
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(TimeoutError, match="no handshake reply"):
        connect(f"tcp://127.0.0.1:{port}", timeout=0.3)


def test_a_curve_stage_that_never_answers_is_a_timeout_not_an_authentication_error(
    connect: Connect, curve_server: Server, keys: Keys
) -> None:
    # A stopped (or overloaded) stage: the kernel still completes the TCP connect, and the
    # CURVE handshake never starts. That was an AuthenticationError ("... the CURVE
    # handshake did not complete"), which sends the user to check keys that are right; the
    # stage does not answer, which is a TimeoutError (docs/security.md).
    curve_server.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(TimeoutError, match="does not answer") as info:
            connect(curve_server.address, curve=keys.alice, timeout=0.5)
        assert not isinstance(info.value, ProtocolError)
        assert "CURVE handshake did not complete in 0.5 s" in str(info.value)
    finally:
        curve_server.proc.send_signal(signal.SIGCONT)
    _engine_saw_nothing_and_still_serves(connect, curve_server.address, keys)


# -- pools -------------------------------------------------------------------------------------


def test_pools_connect_with_curve_and_name_a_refused_replica(
    curve_server: Server, keys: Keys
) -> None:
    address = curve_server.address
    with StagePool.connect([address], curve=keys.alice) as pool:
        assert pool.add("p1", 2).collect() == [1, 0]
        with pytest.raises(AuthenticationError):
            pool.add_replica(address=address, curve=keys.mallory, timeout=5)
        assert len(pool.replicas) == 1

    async def main() -> list[Any]:
        apool = await AsyncStagePool.connect([address], curve=keys.alice)
        try:
            return await (await apool.add("p2", 2)).collect()
        finally:
            await apool.close()

    assert asyncio.run(main()) == [1, 0]


# -- serve and keygen on the command line ------------------------------------------------------


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "enginecore", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.mark.parametrize("flag", ["--insecure", "--allow-remote"])
def test_a_non_loopback_bind_starts_with_insecure(no_leftovers: str, flag: str) -> None:
    err_path = Path(no_leftovers, "err")
    with open(err_path, "w") as err:
        srv = Server("--engine", SCRIPTED, "--bind", "tcp://0.0.0.0:*", flag, stderr=err)
    try:
        assert "curve" not in srv.ready_line
    finally:
        assert srv.stop() == 0
    text = err_path.read_text()
    err_path.unlink()
    assert "WARNING: --insecure" in text
    # The deprecated alias said nothing of it.
    assert ("--allow-remote is deprecated: use --insecure" in text) == (flag == "--allow-remote")


def test_a_non_loopback_bind_starts_with_curve(
    connect: Connect, keys: Keys, no_leftovers: str
) -> None:
    srv = Server("--engine", SCRIPTED, "--bind", "tcp://0.0.0.0:*", *_curve_args(keys))
    try:
        address = "tcp://127.0.0.1:" + str(_port(srv.address))
        client = connect(address, curve=keys.alice)
        assert client.add("r", 1).collect() == [0]
        client.close()
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--curve-secret-key", "X"], "go together"),
        (["--authorized-clients", "X"], "go together"),
        (["--curve-secret-key", "/no/such/file", "--authorized-clients", "/tmp"], "no such"),
    ],
)
def test_bad_curve_arguments_are_usage_errors(args: list[str], message: str) -> None:
    result = _run("serve", "--engine", SCRIPTED, *args)
    assert result.returncode == 2
    assert message in result.stderr


def test_curve_files_are_checked_at_start(keys: Keys, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    result = _run(
        "serve", "--engine", SCRIPTED, "--curve-secret-key", str(keys.stage_secret),
        "--authorized-clients", str(empty),
    )  # fmt: skip
    assert result.returncode == 2
    assert "no client public key" in result.stderr
    result = _run(
        "serve", "--engine", SCRIPTED, "--curve-secret-key", str(keys.stage_public),
        "--authorized-clients", str(keys.authorized),
    )  # fmt: skip
    assert result.returncode == 2
    assert "holds no secret key" in result.stderr
    # A public key that is not the secret key's (a file edited by hand): the ready line
    # announced it, and every client given it waited out its connect timeout.
    public = zmq.auth.load_certificate(keys.stage_secret)[0]
    other = keys.mallory.public_key  # another pair's
    mixed = tmp_path / "mixed.key_secret"
    mixed.write_text(keys.stage_secret.read_text().replace(public.decode(), other.decode()))
    mixed.chmod(0o600)
    result = _run(
        "serve", "--engine", SCRIPTED, "--curve-secret-key", str(mixed),
        "--authorized-clients", str(keys.authorized),
    )  # fmt: skip
    assert result.returncode == 2
    assert "is not one key pair" in result.stderr
    # A client key that cannot be read is named by its file.
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "broken.key").write_text('metadata\ncurve\n    public-key = "short"\n')
    result = _run(
        "serve", "--engine", SCRIPTED, "--curve-secret-key", str(keys.stage_secret),
        "--authorized-clients", str(bad),
    )  # fmt: skip
    assert result.returncode == 2
    assert "broken.key" in result.stderr


def test_a_secret_key_among_the_authorized_keys_is_a_warning(
    keys: Keys, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A client's secret key copied to the stage by mistake (its NAME.key_secret, or that
    # file renamed NAME.key) was taken without a word: it should not be there at all.
    authorized = tmp_path / "authorized"
    shutil.copytree(keys.authorized, authorized)
    mallory_secret = _secret_file(keys, "mallory")
    shutil.copy(mallory_secret, authorized / "mallory.key_secret")
    shutil.copy(mallory_secret, authorized / "renamed.key")
    with caplog.at_level(logging.WARNING, logger="enginecore.stage"):
        admitted = read_authorized(authorized)
    assert admitted == {keys.alice.public_key, keys.mallory.public_key}  # as before
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "renamed.key, an authorized client's key, holds its secret key too" in warnings[0]
    assert (
        "mallory.key_secret, in the directory of authorized client keys, is a secret"
        in (warnings[1])
    )
    for text in warnings:
        assert "a secret key should never leave its client's host" in text
        assert keys.mallory.secret_key.decode() not in text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="enginecore.stage"):
        read_authorized(keys.authorized)  # public keys only: nothing to say
    assert not caplog.records


def test_keygen_writes_a_key_pair_and_never_overwrites(tmp_path: Path) -> None:
    result = _run("keygen", str(tmp_path / "k"), "--name", "node1")
    assert result.returncode == 0, result.stderr
    public, secret = tmp_path / "k" / "node1.key", tmp_path / "k" / "node1.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    keys = CurveKeys.load(secret, public)  # its own pair, as a client of itself
    assert keys.server_key == keys.public_key
    before = secret.read_bytes()
    again = _run("keygen", str(tmp_path / "k"), "--name", "node1")
    assert again.returncode == 1
    assert "not overwriting" in again.stderr
    assert secret.read_bytes() == before
    (tmp_path / "file").write_text("")  # a path that is a file: said so, not "File exists"
    onto_a_file = _run("keygen", str(tmp_path / "file"))
    assert onto_a_file.returncode == 1
    assert "exists and is not a directory" in onto_a_file.stderr
    # serve given the key directory instead of the key file: said so, not "no such file"
    served = _run(
        "serve", "--engine", "enginecore:CountdownEngine", "--curve-secret-key",
        str(tmp_path / "k"), "--authorized-clients", str(tmp_path / "k"),
    )  # fmt: skip
    assert served.returncode == 2
    assert "is a directory; give the stage's NAME.key_secret file in it" in served.stderr


@pytest.mark.parametrize("planted", ["node1.key", "node1.key_secret"])
def test_keygen_never_writes_through_a_symbolic_link(tmp_path: Path, planted: str) -> None:
    # A link planted where a key goes (a shared directory) that points nowhere yet: keygen
    # wrote the key through it, to wherever the link pointed.
    target = tmp_path / "elsewhere"
    (tmp_path / "k").mkdir()
    (tmp_path / "k" / planted).symlink_to(target)
    result = _run("keygen", str(tmp_path / "k"), "--name", "node1")
    assert result.returncode == 1
    assert f"{planted} exists; not overwriting a key" in result.stderr
    assert not target.exists()
    assert sorted(p.name for p in (tmp_path / "k").iterdir()) == [planted]  # nothing else


def test_keygen_modes_do_not_depend_on_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        public, secret = keygen(tmp_path / "k", "node1")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(public).st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o700
    keys = CurveKeys.load(secret, public)  # zmq.auth reads them
    assert zmq.auth.load_certificates(str(tmp_path / "k")) == {keys.public_key: True}


def test_curve_keys_are_checked_and_hide_the_secret(keys: Keys) -> None:
    assert keys.alice.secret_key.decode() not in repr(keys.alice)
    with pytest.raises(ValueError, match="40-character"):
        CurveKeys(public_key=b"short", secret_key=keys.alice.secret_key, server_key=b"x" * 40)
    with pytest.raises(ValueError, match="holds no secret key"):
        CurveKeys.load(keys.stage_public, keys.stage_public)
    # A key of the wrong form in a file: the error names the files (it named the key only).
    short = keys.stage_secret.parent / "short.key_secret"
    short.write_text('metadata\ncurve\n    public-key = "abc"\n    secret-key = "def"\n')
    with pytest.raises(ValueError, match=r"40-character.*read from .*short\.key_secret"):
        CurveKeys.load(short, keys.stage_public)
    short.unlink()
    # Text that is not ASCII: a ValueError naming the key (was a bare UnicodeEncodeError).
    with pytest.raises(ValueError, match="server_key is not a valid Z85"):
        CurveKeys(keys.alice.public_key, keys.alice.secret_key, "é" * 40)  # type: ignore[arg-type]


def test_curve_keys_whose_public_key_is_not_the_secret_keys_are_refused(keys: Keys) -> None:
    # Before, they were accepted, and connect() blamed the server key ("likely wrong").
    with pytest.raises(ValueError, match="public_key is not the public key of secret_key"):
        CurveKeys(keys.alice.public_key, keys.mallory.secret_key, keys.alice.server_key)
    with pytest.raises(ValueError, match="public_key is not the public key of secret_key"):
        CurveKeys(keys.alice.server_key, keys.alice.secret_key, keys.alice.server_key)


# -- observers: StageObserver and top ----------------------------------------------------------


def _secret_file(keys: Keys, name: str) -> Path:
    return keys.authorized.parent / name / f"{name}.key_secret"


def test_an_observer_with_a_listed_key_reads_a_curve_stage(
    connect: Connect, curve_server: Server, keys: Keys
) -> None:
    client = connect(curve_server.address, curve=keys.alice)
    assert client.add("r1", 2).collect() == [1, 0]
    with StageObserver(curve_server.address, curve=keys.alice) as observer:
        stats = observer.stats(timeout=5)
        assert stats.outputs == 2
        assert observer.failure() is None
    assert client.add("r2", 1).collect() == [0]  # the client's session went on beside it
    client.close()


@pytest.mark.parametrize(
    ("which", "message"),
    [
        ("none", "requires CURVE"),
        ("mallory", "not among the stage's authorized"),
        ("wrong_server", "server public key .* is likely wrong"),
    ],
)
def test_a_refused_observer_gets_a_named_error_not_a_timeout(
    connect: Connect, curve_server: Server, keys: Keys, which: str, message: str
) -> None:
    curve = None if which == "none" else getattr(keys, which)
    started = time.monotonic()
    with StageObserver(curve_server.address, curve=curve) as observer:
        with pytest.raises(AuthenticationError, match=message):
            observer.stats(timeout=5)
        assert time.monotonic() - started < 4  # from the socket monitor, not the timeout
        assert isinstance(observer.failure(), AuthenticationError)
    _engine_saw_nothing_and_still_serves(connect, curve_server.address, keys)


def test_top_observes_a_curve_stage_with_its_keys(curve_server: Server, keys: Keys) -> None:
    pytest.importorskip("rich")
    base = ["top", curve_server.address, "--once", "--interval", "0.3"]
    ok = _run(
        *base, "--curve-secret-key", str(_secret_file(keys, "alice")),
        "--curve-server-key", str(keys.stage_public),
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert str(curve_server.proc.pid) in ok.stdout
    refused = _run(
        *base, "--curve-secret-key", str(_secret_file(keys, "mallory")),
        "--curve-server-key", str(keys.stage_public),
    )  # fmt: skip
    assert refused.returncode == 1
    assert "not among the stage's authorized" in refused.stdout
    plain = _run(*base)
    assert plain.returncode == 1
    assert "requires CURVE" in plain.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--curve-secret-key", "X"], "go together"),
        (["--curve-server-key", "X"], "go together"),
        (["--curve-secret-key", "/no/such", "--curve-server-key", "/no/such"], "curve"),
        (["--curve-secret-key", "X"] + ["--curve-server-key", "Y"] * 3, "once per ADDRESS"),
    ],
)
def test_bad_top_curve_arguments_are_usage_errors(args: list[str], message: str) -> None:
    result = _run("top", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "--once", *args)
    assert result.returncode == 2
    assert message in result.stderr


def test_a_peer_announcing_a_huge_frame_to_the_output_port_is_cut_off_at_once(
    no_leftovers: str,
) -> None:
    """Before any handshake, a peer could announce a frame of gigabytes to the output port
    and libzmq kept the connection (and what arrived of the frame, in memory) until the
    handshake interval ended. The output socket takes no message from a peer: a frame over
    64 KiB ends the connection at once."""
    server = Server("--engine", SCRIPTED, "--bind", "tcp://127.0.0.1:*")
    try:
        match = re.search(r"\(output (tcp://\S+?)[,)]", server.ready_line)
        assert match, server.ready_line
        port = int(match.group(1).rpartition(":")[2])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as peer:
            # ZMTP 3.0's greeting, NULL mechanism, then a command frame of 3 GiB.
            peer.sendall(
                b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)
            )
            greeting = b""
            while len(greeting) < 64:
                chunk = peer.recv(64 - len(greeting))
                assert chunk, "the stage closed before its greeting"
                greeting += chunk
            peer.sendall(b"\x06" + (3 * 2**30).to_bytes(8, "big") + bytes(65536))
            peer.settimeout(5)  # without the bound: still open here, reading the frame
            with contextlib.suppress(ConnectionResetError):  # cut off: what is wanted
                while peer.recv(65536):  # the stage's own READY command, then the end
                    pass
        assert server.proc.poll() is None
    finally:
        assert server.stop() == 0
