"""A stage that serves several clients at once (``serve --max-clients N``, ``_fanout.py``):
raw zmq clients on a real ``serve`` process, the sync and async clients through one
parametrised suite, two pools over the same shared stages, and the fan-out's routing
against a model (a hypothesis state machine, with fake outboxes)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from itertools import count
from pathlib import Path
from typing import Any

import pytest
import zmq
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

from enginecore.stage import (
    PROTOCOL_VERSION,
    EngineDeadError,
    Outputs,
    ProtocolError,
    ReplicaDeadError,
    RequestError,
    SessionLostError,
    StageClient,
    StageObserver,
    StagePool,
)
from enginecore.stage._fanout import LIVE_FOR_ANOTHER, Fanout
from enginecore.stage._outbox import BACKLOG_MAX
from enginecore.stage._stage_engine import LIVE_IN_STAGE
from enginecore.stage._stage_session import NOT_ATTACHED, SESSION_LOST

from .conftest import SCRIPTED, Connect, Server, wait_until
from .raw import Event, RawClient, welcomed_once_free

DEVICE = "enginecore.stage.testing:device"


def _serve(*args: str, engine: str = SCRIPTED, clients: int = 2) -> Server:
    return Server("--engine", engine, "--max-clients", str(clients), *args)


@pytest.fixture
def shared(no_leftovers: str) -> Iterator[Server]:
    """A ``serve --max-clients 2`` ScriptedEngine stage on ipc, in the test's private dir (so
    that the fixture checks that the clients' socket files are removed)."""
    srv = _serve("--bind", f"ipc://{no_leftovers}/in", "--session-timeout", "2")
    try:
        yield srv
    finally:
        assert srv.stop() == 0


def _welcomed(client: RawClient) -> str:
    reply = client.hello()
    assert reply[0] == "welcome", reply
    return str(reply[2])


def _finished(rid: str) -> Callable[[Event], bool]:
    return lambda ev: ev[0] == "outputs" and rid in ev[1] and ev[2][ev[1].index(rid)]


def _outputs_of(events: list[Event]) -> dict[str, list[Any]]:
    got: dict[str, list[Any]] = {}
    for ev in events:
        if ev[0] == "outputs":
            for rid, payload in zip(ev[1], ev[3], strict=True):
                got.setdefault(rid, []).append(payload)
    return got


class TestRawClients:
    def test_each_client_gets_its_own_output_socket_and_only_its_own_events(
        self, shared: Server
    ) -> None:
        with RawClient(shared.address) as a, RawClient(shared.address) as b:
            out_a, out_b = _welcomed(a), _welcomed(b)
            assert out_a != out_b
            for i in range(5):  # interleaved
                a.send("add", f"a{i}", 3 + i)
                b.send("add", f"b{i}", 4 + i)
            events_a = a.until(_finished("a4"), timeout=10)
            events_b = b.until(_finished("b4"), timeout=10)
            got_a, got_b = _outputs_of(events_a), _outputs_of(events_b)
            assert got_a == {f"a{i}": list(range(2 + i, -1, -1)) for i in range(5)}
            assert got_b == {f"b{i}": list(range(3 + i, -1, -1)) for i in range(5)}
            # The same call id from both: each gets the answer to its own call.
            assert a.call(7, "echo", "from a")[-1] == ["utility", 7, ["from a"], None]
            assert b.call(7, "echo", "from b")[-1] == ["utility", 7, ["from b"], None]
            # Every client sees the whole stage's load.
            assert a.loads
            assert b.loads

    def test_an_abort_reaches_only_its_senders_requests(self, shared: Server) -> None:
        with RawClient(shared.address) as a, RawClient(shared.address) as b:
            _welcomed(a)
            _welcomed(b)
            a.send("add", "long-a", 10**8)
            b.send("add", "long-b", 10**8)
            a.until(lambda ev: ev[0] == "outputs" and "long-a" in ev[1])
            b.until(lambda ev: ev[0] == "outputs" and "long-b" in ev[1])
            b.send("abort", ["long-a", "long-b"])  # long-a is a's: not b's to abort
            assert b.until(lambda ev: ev[0] == "aborted")[-1] == ["aborted", ["long-a", "long-b"]]
            log = b.call(1, "log")[-1][2]
            assert "abort long-b" in log
            assert "abort long-a" not in log
            a.until(lambda ev: ev[0] == "outputs" and "long-a" in ev[1])  # still running
            a.send("abort", ["long-a"])
            a.until(lambda ev: ev[0] == "aborted")

    def test_an_id_live_for_another_client_is_refused_for_that_add_only(
        self, shared: Server
    ) -> None:
        with RawClient(shared.address) as a, RawClient(shared.address) as b:
            _welcomed(a)
            _welcomed(b)
            a.send("add", "same", 10**8)
            a.until(lambda ev: ev[0] == "outputs" and "same" in ev[1])
            b.send("add", "same", 3)
            [error] = [ev for ev in b.until(lambda ev: ev[0] == "error") if ev[0] == "error"]
            assert error == ["error", "same", LIVE_FOR_ANOTHER]
            a.until(lambda ev: ev[0] == "outputs" and "same" in ev[1])  # a's goes on
            a.send("abort", ["same"])
            a.until(lambda ev: ev[0] == "aborted")
            # Once a's has ended, b may use the id.
            b.send("add", "same", 2)
            assert _outputs_of(b.until(_finished("same")))["same"] == [1, 0]

    def test_a_clients_bye_aborts_only_its_requests(self, shared: Server) -> None:
        with RawClient(shared.address) as a, RawClient(shared.address) as b:
            _welcomed(a)
            _welcomed(b)
            a.send("add", "a-long", 10**8)
            b.send("add", "b-long", 10**8)
            a.until(lambda ev: ev[0] == "outputs" and "a-long" in ev[1])
            a.send("bye")
            b.send("add", "b-short", 3)
            events = b.until(_finished("b-short"))
            assert "b-long" in _outputs_of(events)  # b's long request still runs
            log = b.call(2, "log")[-1][2]
            assert "abort a-long" in log
            assert "abort b-long" not in log
            b.send("abort", ["b-long"])
            b.until(lambda ev: ev[0] == "aborted")

    def test_a_silent_client_is_detached_at_the_session_timeout(self, shared: Server) -> None:
        with RawClient(shared.address) as a, RawClient(shared.address) as b:
            _welcomed(a)
            _welcomed(b)
            a.send("add", "a-long", 10**8)  # then a says nothing more (the timeout is 2 s)
            a.until(lambda ev: ev[0] == "outputs" and "a-long" in ev[1])
            b.send("add", "b-long", 10**8)
            started = time.monotonic()
            seq = 0
            while True:  # b stays heard from; a goes silent
                seq += 1
                log = b.call(seq, "log")[-1][2]
                if "abort a-long" in log:
                    break
                assert time.monotonic() - started < 10, "the silent client was never detached"
            assert time.monotonic() - started > 1.5  # not before its timeout (2 s)
            assert "abort b-long" not in log
            # Its place is free again.
            with RawClient(shared.address) as c:
                _welcomed(c)
            # b leaves with its request (a bye aborts it). Not an abort and a wait for its
            # answer: b was silent while c attached, for longer than the 2 s timeout on a
            # loaded machine, and a detached b gets no answer.
            b.send("bye")

    def test_a_hello_when_full_is_rejected_with_the_reason(self, shared: Server) -> None:
        with RawClient(shared.address) as a, RawClient(shared.address) as b:
            _welcomed(a)
            _welcomed(b)
            with RawClient(shared.address) as c:
                reply = c.hello()
                assert reply[0] == "reject"
                assert "at most 2 clients" in reply[2]
            b.send("bye")
        with welcomed_once_free(shared.address, rejected="at most") as c:  # b's place
            c.send("bye")
        with RawClient(shared.address) as a2:
            a2.send("bye")  # a is still attached: nothing more to do

    def test_a_peer_without_a_session_cannot_reach_the_engine(self, shared: Server) -> None:
        with RawClient(shared.address) as a, RawClient(shared.address) as stranger:
            _welcomed(a)
            stranger.send("add", "x", 3)
            assert stranger.reply() == ["reject", PROTOCOL_VERSION, NOT_ATTACHED]
            stranger.send("shutdown")
            assert stranger.reply() == ["reject", PROTOCOL_VERSION, NOT_ATTACHED]
            assert a.call(1, "log")[-1][2] == []

    def test_a_shutdown_from_one_client_ends_every_clients_session(self, shared: Server) -> None:
        with RawClient(shared.address) as a, RawClient(shared.address) as b:
            _welcomed(a)
            _welcomed(b)
            b.send("add", "b-long", 10**8)
            b.until(lambda ev: ev[0] == "outputs")
            a.send("shutdown")
            assert a.until(lambda ev: ev[0] == "shutdown")[-1] == ["shutdown"]
            assert b.until(lambda ev: ev[0] == "shutdown", timeout=10)[-1] == ["shutdown"]
        assert shared.proc.wait(10) == 0


def _aborted_in_engine(client: RawClient, rids: Sequence[str], timeout: float) -> float:
    """Poll the engine's call log through *client* until every one of *rids* was aborted;
    how long that took (``AssertionError`` past *timeout*)."""
    started = time.monotonic()
    seq = count(1000)
    while True:
        log = client.call(next(seq), "log", timeout=10)[-1][2]
        if all(f"abort {rid}" in log for rid in rids):
            return time.monotonic() - started
        assert time.monotonic() - started < timeout, f"never aborted: {rids}"
        time.sleep(0.05)


_STOPPED_CLIENT = """
import sys
from enginecore.stage import StageClient

with StageClient.connect(sys.argv[1], heartbeat_timeout=120.0) as client:
    streams = [client.add(f"c-{i}", 10**8) for i in range(50)]
    next(iter(streams[0]))
    print("streaming", flush=True)  # then the test stops this process
    try:
        for _ in streams[0]:
            pass
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}", flush=True)
"""


class _Relay:
    """A TCP relay in front of a stage's input socket (``tcp://host:port``): it forwards
    bytes both ways, and :meth:`break_client_sides` closes the client's end of every
    connection while it keeps the stage's end open, reading and dropping what the stage
    sends (its heartbeats go unanswered): a connection broken on one side only."""

    def __init__(self, address: str) -> None:
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        self._target = (host, int(port))
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self._server.getsockname()[1]}"
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._clients: list[socket.socket] = []
        self._broken: set[socket.socket] = set()
        self.accepted = 0
        threading.Thread(target=self._accept, name="test-relay", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
                upstream = socket.create_connection(self._target)
            except OSError:
                return
            with self._lock:
                self._sockets += [client, upstream]
                self._clients.append(client)
                self.accepted += 1
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if dst not in self._broken:
                    dst.sendall(data)
        except OSError:
            pass
        if src in self._broken or dst in self._broken:
            return  # the stage's end stays open
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def break_client_sides(self) -> None:
        with self._lock:
            clients, self._clients = self._clients, []
            self._broken.update(clients)
        for sock in clients:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._server.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class TestClientsThatCannotKeepUp:
    """A client of a shared stage that stops reading, or whose output connection goes,
    is detached by itself: the others keep getting their outputs (issue 18)."""

    @pytest.fixture
    def stage(self, no_leftovers: str) -> Iterator[tuple[Server, Path]]:
        # A session timeout far longer than the test: only the new rules may detach.
        logs = Path(tempfile.mkdtemp(prefix="ecLog", dir="/tmp"))  # not in no_leftovers'
        log = logs / "stage.log"
        try:
            with log.open("w") as err:
                srv = Server(
                    "--engine",
                    SCRIPTED,
                    "--max-clients",
                    "2",
                    "--bind",
                    f"ipc://{no_leftovers}/in",
                    "--session-timeout",
                    "120",
                    "--client-buffer",
                    "1000",
                    "--log-level",
                    "INFO",
                    stderr=err,
                )
                try:
                    yield srv, log
                finally:
                    assert srv.stop() == 0
        finally:
            shutil.rmtree(logs, ignore_errors=True)

    def test_a_client_that_stops_reading_is_detached_and_the_other_goes_on(
        self, stage: tuple[Server, Path]
    ) -> None:
        srv, log = stage
        observer = StageObserver(srv.address)
        with observer, RawClient(srv.address) as slow, RawClient(srv.address) as fast:
            assert observer.stats(timeout=10).cut_clients == 0
            assert slow.hello(rcvhwm=1)[0] == "welcome"  # and it never reads again
            _welcomed(fast)
            slow_ids = [f"slow-{i}" for i in range(50)]
            for rid in slow_ids:
                slow.send("add", rid, 10**8)
            # Before: the loop waited for the slow client once 65,536 events were queued for
            # it, and the fast one got nothing (its calls included) until the slow one's
            # session timed out (120 s here).
            _aborted_in_engine(fast, slow_ids, timeout=60)
            # The stage counts the cut (the loop cut it before it aborted its requests).
            assert observer.stats(timeout=10).cut_clients == 1
            # The fast client is served: a job of it completes.
            for i in range(20):
                fast.send("add", f"job-{i}", 200)
            got = _outputs_of(fast.until(_finished("job-19"), timeout=30))
            assert got["job-19"] == list(range(199, -1, -1))
            # The slow client is told, on its input socket, when it speaks again.
            slow.send("ping", 1)
            reply = slow.reply(timeout=5)
            assert reply[0] == "reject"
            assert reply[2].startswith(SESSION_LOST), reply
            assert "fell behind" in reply[2]
            # ... and may attach again.
            assert slow.pull is not None
            slow.pull.close()
            assert slow.hello()[0] == "welcome"
            slow.send("add", "again", 2)
            assert _outputs_of(slow.until(_finished("again")))["again"] == [1, 0]
            assert observer.stats(timeout=10).cut_clients == 1  # once
            # `enginecore top` shows it, beside the clients, as an observer.
            top = subprocess.run(
                [sys.executable, "-m", "enginecore", "top", srv.address, "--once"],
                check=False,
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert top.returncode == 0, top.stderr
            header, row = (
                [c.strip() for c in line.strip().strip("│┃").replace("┃", "│").split("│")]
                for line in top.stdout.splitlines()
                if "address" in line or srv.address in line
            )
            assert dict(zip(header, row, strict=True))["cut"] == "1", top.stdout
        text = log.read_text()
        assert "fell behind" in text, text
        assert "past the client buffer (1000)" in text
        assert "aborting its 50 live requests" in text

    def test_a_client_that_never_connects_its_output_cannot_hold_the_loop(
        self, stage: tuple[Server, Path]
    ) -> None:
        srv, log = stage
        with RawClient(srv.address) as absent, RawClient(srv.address) as other:
            absent.send_hello()
            assert absent.reply()[0] == "welcome"  # and it never connects its PULL
            _welcomed(other)
            absent_ids = [f"absent-{i}" for i in range(20)]
            for rid in absent_ids:
                absent.send("add", rid, 10**8)
            _aborted_in_engine(other, absent_ids, timeout=60)
            other.send("add", "job", 50)
            assert _outputs_of(other.until(_finished("job"), timeout=30))["job"][-1] == 0
        assert "fell behind" in log.read_text()

    def test_a_stopped_client_process_is_cut_and_told_when_it_runs_again(
        self, stage: tuple[Server, Path]
    ) -> None:
        """A StageClient in a process under SIGSTOP stops reading: the stage cuts it while
        another client works; after SIGCONT its stream fails with SessionLostError (read
        from the stage's reject after its next ping), never a silent hang."""
        srv, _ = stage
        child = subprocess.Popen(
            [sys.executable, "-c", _STOPPED_CLIENT, srv.address],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "streaming"
            with RawClient(srv.address) as other:
                _welcomed(other)
                os.kill(child.pid, signal.SIGSTOP)
                try:
                    _aborted_in_engine(other, [f"c-{i}" for i in range(50)], timeout=60)
                    for i in range(5):
                        other.send("add", f"job-{i}", 100)
                    got = _outputs_of(other.until(_finished("job-4"), timeout=30))
                    assert got["job-4"] == list(range(99, -1, -1))
                finally:
                    os.kill(child.pid, signal.SIGCONT)
                out, _ = child.communicate(timeout=30)
            # Stopped longer than the stage's 5 s ZMTP heartbeat (a loaded machine), its
            # input connection was dropped and made again, under the client's own routing
            # id: the stage still knows it, and says why it detached it.
            assert out.startswith("SessionLostError: "), out
            assert "session lost: the stage detached this client" in out, out
            assert "fell behind" in out, out
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()

    def test_a_client_whose_connection_is_made_again_is_told_why_it_was_cut(
        self, no_leftovers: str
    ) -> None:
        """The input connection of a stopped client breaks on its side while the stage
        cuts it (a relay closes the client's end and keeps the stage's open, as a broken
        TCP connection): once it runs again, its DEALER connects anew. It keeps its routing
        id, and takes it over from the connection the stage has not seen close, so the
        stage knows it and says why it detached it; a new peer would be told that it has
        no session."""
        srv = Server(
            "--engine",
            SCRIPTED,
            "--max-clients",
            "2",
            "--bind",
            "tcp://127.0.0.1:*",
            "--session-timeout",
            "120",
            "--client-buffer",
            "1000",
        )
        relay = _Relay(srv.address)
        try:
            child = subprocess.Popen(
                [sys.executable, "-c", _STOPPED_CLIENT, relay.address],
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                assert child.stdout is not None
                assert child.stdout.readline().strip() == "streaming"
                with RawClient(srv.address) as other:
                    _welcomed(other)
                    os.kill(child.pid, signal.SIGSTOP)
                    try:
                        _aborted_in_engine(other, [f"c-{i}" for i in range(50)], timeout=40)
                        relay.break_client_sides()
                    finally:
                        os.kill(child.pid, signal.SIGCONT)
                    out, _ = child.communicate(timeout=30)
                assert relay.accepted == 2, "the client's connection was not made again"
                assert out.startswith("SessionLostError: "), out
                assert "session lost: the stage detached this client" in out, out
                assert "fell behind" in out, out
            finally:
                if child.poll() is None:
                    child.kill()
                    child.wait()
        finally:
            relay.close()
            assert srv.stop() == 0

    def test_a_client_whose_output_connection_goes_is_detached_within_a_second_or_so(
        self, stage: tuple[Server, Path]
    ) -> None:
        srv, log = stage
        with RawClient(srv.address) as gone, RawClient(srv.address) as other:
            _welcomed(gone)
            _welcomed(other)
            # ~200 steps a second: its queue stays far below the client buffer meanwhile.
            other.call(1, "pace", 0.005)
            gone.send("add", "gone-long", 10**8)
            gone.until(lambda ev: ev[0] == "outputs" and "gone-long" in ev[1])
            other.send("add", "other-long", 10**8)
            other.until(lambda ev: ev[0] == "outputs" and "other-long" in ev[1])
            assert gone.pull is not None
            gone.pull.close()  # no bye: as if its process died
            took = _aborted_in_engine(other, ["gone-long"], timeout=30)
            # OUTPUT_GRACE_S (1 s), then the detach; not the 120 s session timeout.
            assert took < 5, took
            log_now = other.call(2, "log")[-1][2]
            assert "abort other-long" not in log_now
            gone.send("add", "x", 3)
            reply = gone.reply(timeout=5)
            assert reply[0] == "reject"
            assert reply[2].startswith(SESSION_LOST)
            assert "lost its output connection" in reply[2]
            other.send("abort", ["other-long"])
            other.until(lambda ev: ev[0] == "aborted")
            gone.pull = None
        assert "lost its output connection" in log.read_text()


class TestServeOptions:
    def _fails(self, *args: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "enginecore", "serve", "--engine", SCRIPTED, *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 2
        return proc.stderr

    def test_max_clients_below_one_is_refused(self) -> None:
        assert "--max-clients must be >= 1" in self._fails("--max-clients", "0")

    def test_keep_requests_on_detach_needs_one_client(self) -> None:
        err = self._fails("--max-clients", "2", "--keep-requests-on-detach")
        assert "--keep-requests-on-detach needs --max-clients 1" in err

    @pytest.mark.parametrize("args", [(), ("--max-clients", "1")])
    def test_client_buffer_needs_more_than_one_client(self, args: tuple[str, ...]) -> None:
        # It was accepted, and did nothing: a one-client stage has no client to cut.
        err = self._fails(*args, "--client-buffer", "10")
        assert "--client-buffer needs --max-clients above 1" in err

    @pytest.mark.parametrize(
        ("args", "expected"),
        [
            (("--max-clients", "2"), 0.005),  # shared: a report about every engine step
            (("--max-clients", "1"), 0.05),
            (("--max-clients", "2", "--load-interval", "0.05"), 0.05),
            (("--max-clients", "2", "--load-interval", "0"), None),
        ],
    )
    def test_the_default_load_interval_is_short_on_a_shared_stage(
        self, args: tuple[str, ...], expected: float | None
    ) -> None:
        srv = Server("--engine", SCRIPTED, "--bind", "tcp://127.0.0.1:*", *args)
        try:
            with StageObserver(srv.address) as observer:
                assert observer.stats(timeout=10).load_interval == expected
        finally:
            assert srv.stop() == 0

    def test_the_tcp_clients_get_ports_of_their_own(self) -> None:
        srv = _serve("--bind", "tcp://127.0.0.1:*")
        try:
            with RawClient(srv.address) as a, RawClient(srv.address) as b:
                ports = {_welcomed(a).rpartition(":")[2], _welcomed(b).rpartition(":")[2]}
                assert len(ports) == 2
                a.send("add", "a", 2)
                b.send("add", "b", 3)
                assert _outputs_of(a.until(_finished("a"))) == {"a": [1, 0]}
                assert _outputs_of(b.until(_finished("b"))) == {"b": [2, 1, 0]}
        finally:
            assert srv.stop() == 0

    def test_a_clients_ipc_path_taken_by_another_process_is_skipped(
        self, no_leftovers: str
    ) -> None:
        # Each client's output socket is bound at the output path with "-<n>" appended. A
        # live socket of another serve there was taken over (that stage became unreachable),
        # and a regular file there was replaced, then deleted at exit. They are skipped now.
        other = Server("--engine", SCRIPTED, "--bind", f"ipc://{no_leftovers}/s.out-1")
        kept = Path(no_leftovers, "s.out-2")
        kept.write_text("mine")
        Path(no_leftovers, "s.out-3").symlink_to(Path(no_leftovers, "nowhere"))
        srv = _serve("--bind", f"ipc://{no_leftovers}/s", clients=3)
        try:
            with RawClient(srv.address) as a, RawClient(srv.address) as b:
                paths = {_welcomed(a), _welcomed(b)}
                taken = {f"ipc://{no_leftovers}/s.out-{n}" for n in (1, 2, 3)}
                assert len(paths) == 2
                assert not paths & taken, paths
                a.send("add", "a", 2)
                b.send("add", "b", 3)
                assert _outputs_of(a.until(_finished("a"))) == {"a": [1, 0]}
                assert _outputs_of(b.until(_finished("b"))) == {"b": [2, 1, 0]}
            with RawClient(other.address) as c:  # the other stage still answers
                _welcomed(c)
        finally:
            assert srv.stop() == 0
            assert other.stop() == 0
        assert kept.read_text() == "mine"
        assert Path(no_leftovers, "s.out-3").is_symlink()
        kept.unlink()
        Path(no_leftovers, "s.out-3").unlink()

    def test_an_ipc_path_too_long_for_the_clients_sockets_is_a_usage_error(
        self, no_leftovers: str
    ) -> None:
        # A path that fits, but not with a client's "-<n>" after it: the stage started, and
        # every connect() failed on a raw ZMQError while the stage printed a traceback.
        base = os.path.join(no_leftovers, "d" * (100 - len(no_leftovers)))
        assert len(base) + len(".out") <= 107
        err = self._fails("--bind", f"ipc://{base}", "--max-clients", "2")
        assert "a socket's path is at most 107 characters" in err, err
        assert "Traceback" not in err
        assert err.strip().splitlines()[-1].startswith("python -m enginecore serve: error:")
        Server("--engine", SCRIPTED, "--bind", f"ipc://{base}").stop()  # one client: fine

    def test_a_client_whose_output_socket_cannot_be_bound_is_refused_in_one_log_line(
        self, no_leftovers: str
    ) -> None:
        # The client got a clear reject, but the stage logged a traceback of its own frames
        # for a bind that failed (its directory removed while the stage ran).
        sub = Path(no_leftovers, "sub")
        sub.mkdir()
        log = Path(no_leftovers, "stage.err")
        with log.open("w") as err:
            srv = Server(
                "--engine", SCRIPTED, "--bind", f"ipc://{no_leftovers}/in",
                "--output-bind", f"ipc://{sub}/out", "--max-clients", "2",
                stderr=err,
            )  # fmt: skip
        try:
            shutil.rmtree(sub)
            with pytest.raises(ProtocolError, match="cannot open an output socket"):
                StageClient.connect(srv.address, timeout=10)
        finally:
            assert srv.stop() == 0
        text = log.read_text()
        log.unlink()
        assert "cannot open an output socket for a new client: " in text, text
        assert "Traceback" not in text, text


# -- the clients ---------------------------------------------------------------------------


def test_two_clients_share_a_stage(connect: Connect, shared: Server) -> None:
    first = connect(shared.address)
    second = connect(shared.address)
    s1 = [first.add(f"one-{i}", 3) for i in range(10)]
    s2 = [second.add(f"two-{i}", 4) for i in range(10)]
    assert [s.collect(timeout=10) for s in s1] == [[2, 1, 0]] * 10
    assert [s.collect(timeout=10) for s in s2] == [[3, 2, 1, 0]] * 10
    assert first.call_utility("echo", 1, timeout=5) == [1]
    assert second.call_utility("echo", 2, timeout=5) == [2]
    # A request id another client has live is refused for that add alone.
    long = first.add("long", 10**8)
    next(iter(long))  # it runs
    with pytest.raises(RequestError, match="live in the stage for another client"):
        second.add("long", 3).collect(timeout=5)
    # One client's close aborts its own requests only.
    kept = second.add("kept", 10**8)
    first.close()
    assert second.add("after", 2).collect(timeout=10) == [1, 0]
    log = second.call_utility("log", timeout=5)
    assert "abort long" in log
    assert "abort kept" not in log
    second.abort(["kept"])
    kept.collect(timeout=5)


def test_another_clients_steps_reach_a_client_as_load_reports_not_as_events(
    connect: Connect, shared: Server
) -> None:
    """A shared stage sends each client its load reports, on their own while the steps are
    another client's. They update that client's load(), and are no event of its: its
    ordered event stream gets no empty Outputs (one Outputs is one step of its own)."""
    watcher = connect(shared.address, ordered_events=True)
    worker = connect(shared.address)
    assert worker.add("w", 20).collect(timeout=10) == list(range(19, -1, -1))
    assert wait_until(lambda: watcher.load() is not None, 10)
    # A request of its own: every event before its end has been read once it is.
    assert watcher.add("mine", 2).collect(timeout=10) == [1, 0]
    events: list[Any] = []
    while not any(type(ev) is Outputs and True in ev.finished for ev in events):
        events += watcher.get_events(timeout=10)
    assert [ev for ev in events if type(ev) is Outputs and not ev.req_ids] == []
    assert [ev.req_ids for ev in events if type(ev) is Outputs] == [["mine"], ["mine"]]


def test_a_client_whose_session_the_stage_ended_gets_session_lost(
    connect: Connect, no_leftovers: str
) -> None:
    """A client the stage detached by itself (here: silent past a 1 s session timeout, as
    a stopped process is) learns it from the stage's reject, read after its next ping: its
    streams and calls fail with SessionLostError, long before its own heartbeat timeout."""
    srv = _serve("--bind", f"ipc://{no_leftovers}/in", "--session-timeout", "1")
    try:
        # Pings every 3 s: the stage finds it silent after 1 s; its heartbeat timeout (60 s)
        # would be the only other way for it to learn anything.
        client = connect(srv.address, heartbeat_interval=3.0, heartbeat_timeout=60.0)
        stream = client.add("long", 10**8)
        next(iter(stream))
        started = time.monotonic()
        with pytest.raises(SessionLostError, match="ended this client's session") as caught:
            stream.collect(timeout=30)
        assert time.monotonic() - started < 15
        assert SESSION_LOST in str(caught.value)
        assert "silent for the session timeout" in str(caught.value)
        assert isinstance(caught.value, EngineDeadError)
        with pytest.raises(SessionLostError):
            client.call_utility("echo", 1, timeout=5)
        # The stage aborted its request and serves the next client.
        other = connect(srv.address)
        assert "abort long" in other.call_utility("log", timeout=5)
        assert other.add("x", 2).collect(timeout=10) == [1, 0]
    finally:
        assert srv.stop() == 0


def test_a_pool_whose_session_a_shared_stage_ended_sees_that_replica_die(
    no_leftovers: str,
) -> None:
    srv = _serve("--bind", f"ipc://{no_leftovers}/in", "--session-timeout", "1")
    try:
        with StagePool.connect(
            [srv.address], heartbeat_interval=3.0, heartbeat_timeout=60.0
        ) as pool:
            stream = pool.add("long", 10**8)
            next(iter(stream))
            with pytest.raises(ReplicaDeadError) as caught:
                stream.collect(timeout=30)
            assert isinstance(caught.value.__cause__, SessionLostError)
            assert SESSION_LOST in str(caught.value)
            assert not pool.replicas[0].routable
    finally:
        assert srv.stop() == 0


def test_two_pools_share_two_stages(no_leftovers: str) -> None:
    servers = [_serve("--bind", "tcp://127.0.0.1:*", engine=SCRIPTED) for _ in range(2)]
    try:
        addresses = [s.address for s in servers]
        with StagePool.connect(addresses) as p1, StagePool.connect(addresses) as p2:
            results: dict[str, list[list[Any]]] = {}

            def run(name: str, pool: StagePool) -> None:
                streams = [pool.add(f"{name}-{i}", 20) for i in range(40)]
                results[name] = [s.collect(timeout=30) for s in streams]

            threads = [
                threading.Thread(target=run, args=(n, p)) for n, p in (("p1", p1), ("p2", p2))
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert results["p1"] == [list(range(19, -1, -1))] * 40
            assert results["p2"] == [list(range(19, -1, -1))] * 40
            # Each pool sees the other's requests in the stages' load reports.
            long1 = [p1.add(f"l1-{i}", 10**8) for i in range(4)]
            for stream in long1:
                next(iter(stream))

            # p2 has nothing on the stages, yet their reports reach it (every 50 ms while
            # they step): no event to wait on but the report itself.
            def others_seen() -> bool:
                loads = [r.load() for r in p2.replicas]
                return all(load is not None and load.live >= 1 for load in loads) and (
                    sum(load.live for load in loads if load is not None) == 4
                )

            assert wait_until(others_seen, 10), [r.load() for r in p2.replicas]
            assert all(r.in_flight == 0 for r in p2.replicas)
            p1.abort([stream.req_id for stream in long1])
    finally:
        for server in servers:
            assert server.stop() == 0
    assert os.listdir(no_leftovers) == []


# -- the routing, without sockets ----------------------------------------------------------


class FakeOutbox:
    """One client's outbox, as the fan-out sees it: records every event it is handed."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.ended = False
        self.started = False
        self.backlog = 0
        self.stuck = False
        self.failed = False
        self.waited = 0

    @property
    def running(self) -> bool:
        return self.started and not self.ended

    def start(self) -> None:
        self.started = True

    def post(self, item: Any, weight: int | None = None) -> None:
        self._take([item] if isinstance(item, tuple) else item)

    def post_step(self, events: list[tuple[Any, ...]], weight: int, last: bool = False) -> None:
        self._take(events)

    def emit(self, ev: tuple[Any, ...]) -> None:
        self._take([ev])

    def _take(self, events: list[tuple[Any, ...]]) -> None:
        assert not self.ended, f"events after the client left: {events}"
        self.events += events

    def ended_dropped(self, req_ids: list[str]) -> None:
        pass

    def wait_for_room(self) -> None:
        self.waited += 1

    def end(self) -> int:
        dropped, self.backlog = self.backlog, 0
        self.ended = True
        return dropped

    def close(self, timeout: float) -> None:
        pass

    def join(self, timeout: float | None = None) -> None:
        pass

    def take_dropped(self) -> int:
        return 0


BOUND = 16  # the machine's client buffer


class FanoutMachine(RuleBasedStateMachine):
    """Clients join and leave, add, abort, and the engine steps, on a :class:`Fanout` with fake
    outboxes, driven as the loop drives it (``ClientInput`` before a client's messages, the
    adapter's live set and drop), against a model of who owns each live request: every
    output, and the load report of every reported step, reaches exactly the clients it
    should; an abort and a departure end only their client's requests; a client stuck past
    its bound is cut, and nothing reaches it afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.outboxes: dict[int, FakeOutbox] = {}
        self.fanout = Fanout(
            self._open, prepare_outputs=_unused, detached_max=8, client_buffer=BOUND
        )
        self.live: set[str] = set()
        self.dropped: list[list[str]] = []
        self.fanout.bind(self.live, self._drop)
        self.admit = self.fanout.admitter(self.live)
        self.owner: dict[str, int] = {}  # the model
        self.epochs = count(1)
        self.rids = count()
        self.seq = count(1)

    def teardown(self) -> None:
        self.fanout.unlink_all()  # closes its wake-up pipe

    def _open(self, epoch: int) -> tuple[FakeOutbox, str, None]:
        outbox = FakeOutbox()
        self.outboxes[epoch] = outbox
        return outbox, f"ipc://x-{epoch}", None

    def _drop(self, req_ids: Sequence[str]) -> None:
        self.dropped.append(list(req_ids))
        self.live.difference_update(req_ids)

    def _attached(self) -> list[int]:
        return [e for e, o in self.outboxes.items() if not o.ended]

    def _take_all(self) -> dict[int, list[tuple[Any, ...]]]:
        got = {}
        for e in self._attached():
            got[e], self.outboxes[e].events = self.outboxes[e].events, []
        return got

    @rule()
    def join(self) -> None:
        epoch = next(self.epochs)
        self.fanout.open_session(epoch)
        self.fanout.joined(epoch)

    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        attached = self._attached()
        if not attached:
            return
        epoch = data.draw(st.sampled_from(attached))
        theirs = {rid for rid, e in self.owner.items() if e == epoch}
        self.fanout.left(epoch)
        assert self.outboxes[epoch].ended
        if theirs:
            assert set(self.dropped.pop()) == theirs
        assert not self.dropped
        for rid in theirs:
            del self.owner[rid]
        assert self.live == set(self.owner)

    @rule(data=st.data(), taken=st.booleans())
    def add(self, data: st.DataObject, taken: bool) -> None:
        attached = self._attached()
        if not attached:
            return
        epoch = data.draw(st.sampled_from(attached))
        self.fanout.sender(epoch)
        if taken and self.owner:
            rid = data.draw(st.sampled_from(sorted(self.owner)))
            self.fanout.emit(("error", rid, LIVE_IN_STAGE))  # make_add's refusal
            [event] = self._take_all()[epoch]
            mine = self.owner[rid] == epoch
            assert event == ("error", rid, LIVE_IN_STAGE if mine else LIVE_FOR_ANOTHER)
            return
        rid = f"r{next(self.rids)}"
        self.admit(rid)
        self.owner[rid] = epoch

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        attached = self._attached()
        if not attached:
            return
        epoch = data.draw(st.sampled_from(attached))
        ids = data.draw(st.lists(st.sampled_from([*sorted(self.owner), "unknown"]), max_size=4))
        self.fanout.sender(epoch)
        own = list(self.fanout.own(ids))
        assert own == [rid for rid in ids if self.owner.get(rid, epoch) == epoch]
        self._drop(own)
        for rid in own:
            self.owner.pop(rid, None)
        self.fanout.emit(("aborted", ids))
        self.dropped.clear()
        got = self._take_all()
        assert got[epoch] == [("aborted", ids)]
        assert all(not events for e, events in got.items() if e != epoch)

    @rule(data=st.data(), stuck=st.booleans())
    def fall_behind(self, data: st.DataObject, stuck: bool) -> None:
        """A client has more than its bound queued; if it is stuck (its socket full), the
        next step with outputs for it cuts it, and the session's ClientLeft then ends its
        requests; if not (its output thread is behind), it goes on."""
        attached = [e for e in self._attached() if e in set(self.owner.values())]
        if not attached:
            return
        epoch = data.draw(st.sampled_from(attached))
        outbox = self.outboxes[epoch]
        outbox.backlog, outbox.stuck = BOUND + 1, stuck
        rids = sorted(self.owner)
        ev = ("outputs", rids, [False] * len(rids), [f"p-{r}" for r in rids])
        self.fanout.post_step([ev], len(rids))
        got = self._take_all()
        for e, events in got.items():
            seen = [r for x in events if x[0] == "outputs" for r in x[1]]
            assert seen == [r for r in rids if self.owner[r] == e]
        if not stuck:
            assert not self.fanout.gone_waiting
            assert epoch in got
            outbox.backlog = 0
            return
        assert epoch not in got
        assert outbox.ended
        [(cut, why)] = self.fanout.take_gone()
        assert cut == epoch
        assert f"past the client buffer ({BOUND})" in why
        assert not self.fanout.gone_waiting
        # Until its ClientLeft, what the loop emits for it goes nowhere.
        self.fanout.sender(epoch)
        self.fanout.emit(("aborted", ["x"]))
        self.fanout.answer(epoch, ("utility", 1, None, None))
        assert not any(self._take_all().values())
        theirs = {rid for rid, e in self.owner.items() if e == epoch}
        self.fanout.left(epoch)
        assert set(self.dropped.pop()) == theirs
        assert not self.dropped
        for rid in theirs:
            del self.owner[rid]
        assert self.live == set(self.owner)

    @rule(data=st.data(), report=st.booleans())
    def step(self, data: st.DataObject, report: bool) -> None:
        rids = (
            data.draw(st.lists(st.sampled_from(sorted(self.owner)), unique=True))
            if self.owner
            else []
        )
        if not rids:
            return
        fins = [data.draw(st.booleans()) for _ in rids]
        load = {"seq": next(self.seq)} if report else None
        ev: tuple[Any, ...] = ("outputs", list(rids), list(fins), [f"p-{r}" for r in rids])
        if load is not None:
            ev = (*ev, load)
        self.fanout.post_step([ev], len(rids))
        got = self._take_all()
        for epoch, events in got.items():
            outputs = [e for e in events if e[0] == "outputs"]
            mine = [r for r in rids if self.owner[r] == epoch]
            seen = [r for e in outputs for r in e[1]]
            assert seen == mine
            assert all(e[3] == [f"p-{r}" for r in e[1]] for e in outputs)
            reports = [e[4] for e in outputs if len(e) > 4]
            assert reports == ([load] if load is not None else [])
        for rid, fin in zip(rids, fins, strict=True):
            if fin:  # the adapter forgets a finished request after the post
                self.live.discard(rid)
                del self.owner[rid]


class TestWaitForRoom:
    """Before a step, past BACKLOG_MAX queued for a client: the loop waits only for a client
    that takes frames (its output thread is behind); a stuck one past its bound is cut."""

    def _fanout(self, bound: int) -> tuple[Fanout, dict[int, FakeOutbox]]:
        boxes: dict[int, FakeOutbox] = {}

        def open_(epoch: int) -> tuple[FakeOutbox, str, None]:
            boxes[epoch] = FakeOutbox()
            return boxes[epoch], f"ipc://x-{epoch}", None

        fanout = Fanout(open_, prepare_outputs=_unused, detached_max=8, client_buffer=bound)
        fanout.bind(set(), lambda ids: None)
        for epoch in (1, 2):
            fanout.open_session(epoch)
            fanout.joined(epoch)
        return fanout, boxes

    def test_a_client_whose_output_thread_is_behind_is_waited_for(self) -> None:
        fanout, boxes = self._fanout(bound=10)
        boxes[1].backlog = BACKLOG_MAX + 1
        fanout.wait_for_room()
        assert boxes[1].waited == 1
        assert not boxes[1].ended
        assert not fanout.gone_waiting
        fanout.unlink_all()

    def test_a_stuck_client_past_its_bound_is_cut_not_waited_for(self) -> None:
        fanout, boxes = self._fanout(bound=10)
        boxes[1].backlog, boxes[1].stuck = BACKLOG_MAX + 1, True
        fanout.wait_for_room()
        assert boxes[1].waited == 0
        assert boxes[1].ended
        assert [e for e, _ in fanout.take_gone()] == [1]
        assert fanout.cut_clients == 1
        assert not boxes[2].ended
        fanout.unlink_all()

    def test_a_stuck_client_within_its_bound_is_neither_cut_nor_waited_for(self) -> None:
        fanout, boxes = self._fanout(bound=BACKLOG_MAX * 2)
        boxes[1].backlog, boxes[1].stuck = BACKLOG_MAX + 1, True
        fanout.wait_for_room()
        assert boxes[1].waited == 0
        assert not boxes[1].ended
        assert not fanout.gone_waiting
        fanout.unlink_all()

    def test_the_wake_up_pipe_is_readable_until_the_cut_is_taken(self) -> None:
        fanout, boxes = self._fanout(bound=1)
        boxes[2].backlog, boxes[2].stuck = 2, True
        fanout.post_step([("outputs", ["r"], [False], [1])], 1)  # r: nobody's, so the first's
        assert not fanout.gone_waiting
        fanout.sender(2)
        fanout.admitter(set())("mine")
        fanout.post_step([("outputs", ["mine"], [False], [1])], 1)
        assert fanout.gone_waiting
        poller = zmq.Poller()
        poller.register(fanout.wake_fd, zmq.POLLIN)
        assert dict(poller.poll(0))
        assert [e for e, _ in fanout.take_gone()] == [2]
        assert not dict(poller.poll(0))
        fanout.unlink_all()


def _unused(rids: list[Any], fins: list[Any], payloads: list[Any]) -> list[tuple[Any, ...]]:
    raise AssertionError("not called: every payload is flat")


TestFanoutMachine = FanoutMachine.TestCase
TestFanoutMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
