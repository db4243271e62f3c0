"""Graceful drain: ``shutdown`` with a drain time, ``client.shutdown(drain=...)`` and
``serve --drain-timeout`` (docs/stage.md, "Operating a stage").

The stage's rules are checked on the wire with a raw client (exact events, in order); what
the clients promise runs through both clients; ``serve``'s signals through a subprocess.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest

from enginecore.stage import (
    EngineDeadError,
    RequestError,
    StageClient,
    StageClosedError,
    StageHealth,
)
from enginecore.stage._stage_engine import DRAINING
from enginecore.stage.testing import ScriptedEngine

from .conftest import SCRIPTED, Connect, Launch, Server, wait_until
from .raw import InProcessStage, RawClient

Event = list[Any]


Raw = tuple[InProcessStage, RawClient, ScriptedEngine]


@pytest.fixture
def raw(no_leftovers: str) -> Iterator[Raw]:
    """An in-process ScriptedEngine stage, a welcomed raw client, and the engine."""
    engine = ScriptedEngine()
    stage = InProcessStage(engine, no_leftovers)
    try:
        with RawClient(stage.address) as client:
            assert client.hello()[0] == "welcome"
            yield stage, client, engine
    finally:
        stage.stop()


def _until_shutdown(client: RawClient, timeout: float = 10.0) -> list[Event]:
    return client.until(lambda ev: ev[0] in ("shutdown", "fatal"), timeout)


def _outputs_of(events: list[Event], req_id: str) -> list[Any]:
    return [
        payload
        for ev in events
        if ev[0] == "outputs"
        for rid, payload in zip(ev[1], ev[3], strict=True)
        if rid == req_id
    ]


def _errors(events: list[Event]) -> list[tuple[Any, str]]:
    return [(ev[1], ev[2]) for ev in events if ev[0] == "error"]


def _is(kind: str, key: Any = None) -> Callable[[Event], bool]:
    return lambda ev: ev[0] == kind and (key is None or ev[1] == key)


class TestDrainOnTheWire:
    def test_live_requests_finish_new_adds_are_refused_and_utilities_answered(
        self, raw: Raw
    ) -> None:
        stage, client, engine = raw
        client.send("add", "a", 30_000)
        client.send("add", "b", 5)
        # Both live before the drain begins: sent at once, the shutdown could be read only
        # after a's last step (the loop may read the adds alone and step while the input
        # thread waits for the GIL), and then nothing would be live to drain.
        events = client.until(_is("outputs"))
        client.send("shutdown", 30)
        client.send("add", "late", 2)
        client.send("adds", ["late2", "late3"], [2, 2])  # one message: each id refused
        client.send("utility", 7, "echo", ["during"])
        events += _until_shutdown(client)
        # Everything of a and b, in full; the late add refused, the call answered.
        assert _outputs_of(events, "a") == list(range(29_999, -1, -1))
        assert _outputs_of(events, "b") == [4, 3, 2, 1, 0]
        assert _errors(events) == [("late", DRAINING), ("late2", DRAINING), ("late3", DRAINING)]
        assert ["utility", 7, ["during"], None] in events
        assert events[-1] == ["shutdown"]
        # The shutdown came right after the last output of the last live request.
        last = max(i for i, ev in enumerate(events) if ev[0] == "outputs")
        assert all(ev[0] in ("error", "utility") for ev in events[last + 1 : -1])
        assert stage.wait() == 0
        assert not [entry for entry in engine.log if entry.startswith("add late")]

    def test_at_the_deadline_live_requests_end_with_an_error(self, raw: Raw) -> None:
        stage, client, engine = raw
        client.send("add", "long", 10**9)
        client.send("add", "short", 3)
        client.until(_is("outputs"))
        started = time.monotonic()
        client.send("shutdown", 0.3)
        events = _until_shutdown(client)
        elapsed = time.monotonic() - started
        assert _outputs_of(events, "short")[-1] == 0
        [(rid, message)] = _errors(events)
        assert rid == "long"
        assert "drain timed out after 0.3 s" in message
        # No output of the request after its error: the error is its last event.
        at = events.index(["error", "long", message])
        assert _outputs_of(events[at:], "long") == []
        assert events[-1] == ["shutdown"]
        assert 0.3 <= elapsed < 5.0
        assert stage.wait() == 0
        assert engine.log[-1] == "abort long"

    def test_nothing_live_stops_at_once(self, raw: Raw) -> None:
        stage, client, _ = raw
        started = time.monotonic()
        client.send("shutdown", 60)
        assert _until_shutdown(client) == [["shutdown"]]
        assert time.monotonic() - started < 5.0
        assert stage.wait() == 0

    def test_aborting_the_last_live_request_ends_the_drain(self, raw: Raw) -> None:
        stage, client, _ = raw
        client.send("add", "long", 10**9)
        client.send("shutdown", 60)
        client.until(_is("outputs"))
        client.send("abort", ["long"])
        events = _until_shutdown(client)
        assert ["aborted", ["long"]] in events
        assert _errors(events) == []
        assert stage.wait() == 0

    def test_a_shutdown_without_drain_during_a_drain_stops_at_once(self, raw: Raw) -> None:
        stage, client, _ = raw
        client.send("add", "long", 10**9)
        client.send("shutdown", 60)
        client.until(_is("outputs"))
        client.send("shutdown")
        events = _until_shutdown(client)
        assert events[-1] == ["shutdown"]
        assert _errors(events) == []  # stopped, not timed out
        assert stage.wait() == 0

    def test_a_second_drain_only_brings_the_deadline_closer(self, raw: Raw) -> None:
        stage, client, _ = raw
        client.send("add", "long", 10**9)
        client.send("shutdown", 0.3)
        client.send("shutdown", 60)  # does not extend the first
        events = _until_shutdown(client)
        [(rid, message)] = _errors(events)
        assert rid == "long"
        assert "after 0.3 s" in message
        assert stage.wait() == 0

    @pytest.mark.parametrize("drain", [-1, float("nan"), float("inf"), "soon", None])
    def test_an_invalid_drain_is_an_error_and_the_stage_goes_on(self, raw: Raw, drain: Any) -> None:
        _, client, _ = raw
        client.send("shutdown", drain)
        events = client.until(_is("error"))
        assert events[-1][1] is None
        assert "invalid message" in events[-1][2]
        assert client.call(1, "echo", "alive")[-1] == ["utility", 1, ["alive"], None]


class TestClientDrain:
    def test_shutdown_drain_lets_live_streams_finish(self, launch: Launch) -> None:
        client = launch(SCRIPTED)
        stream = client.add("r", 20_000)
        assert stream.get(5) == 19_999
        assert client.shutdown(drain=30) == 0
        # Every output arrived, through the stream, before the stage stopped.
        rest = stream.collect(timeout=5)
        assert rest == list(range(19_998, -1, -1))

    def test_shutdown_drain_timeout_ends_streams_with_a_request_error(self, launch: Launch) -> None:
        client = launch(SCRIPTED)
        stream = client.add("r", 10**9)
        stream.get(5)
        started = time.monotonic()
        assert client.shutdown(drain=0.3) == 0
        assert time.monotonic() - started < 5.0
        with pytest.raises(RequestError, match=r"drain timed out after 0\.3 s"):
            stream.collect(timeout=5)

    def test_a_stage_killed_during_the_drain_ends_its_streams_with_its_death(
        self, launch: Launch
    ) -> None:
        # A drain lets the live requests run to their end: a stage that dies meanwhile
        # ends them with its death, as without a shutdown, not with StageClosedError.
        client = launch(SCRIPTED)
        stream = client.add("r", 10**9)
        stream.get(5)
        pid = client.pid
        closer = threading.Thread(target=client.shutdown, kwargs={"drain": 30})
        closer.start()
        try:
            assert wait_until(lambda: client.health() == StageHealth.DEAD, 10)  # closing
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="killed by SIGKILL") as info:
                stream.collect(timeout=10)
            assert not isinstance(info.value, StageClosedError)
        finally:
            closer.join(30)
        assert not closer.is_alive()

    def test_a_stage_the_client_kills_after_the_drain_ends_its_streams_closed(
        self, launch: Launch
    ) -> None:
        # Past the drain and the timeout, the client signals the stage itself: that is the
        # close's doing, and what is still live ends with StageClosedError.
        client = launch(SCRIPTED)
        client.call_utility_future("sleep", 30.0)  # the loop never gets to the drain
        stream = client.add("r", 3)
        client.shutdown(0.2, drain=0.2)
        with pytest.raises(StageClosedError):
            stream.collect(timeout=10)

    def test_a_drain_under_way_takes_the_closers_aborts(self, launch: Launch) -> None:
        # A server that drains on SIGTERM must still drop the requests of callers that went
        # away meanwhile: the stage applies aborts during a drain, and the client that
        # called shutdown(drain=...) sends them. New work stays refused.
        client = launch(SCRIPTED)
        gone = client.add("gone", 10**9)  # its caller left: only an abort ends it
        kept = client.add("kept", 10**9)
        gone.get(5)
        kept.get(5)
        codes: list[int | None] = []
        closer = threading.Thread(target=lambda: codes.append(client.shutdown(drain=60)))
        closer.start()
        try:
            assert wait_until(lambda: client.closed, 10)
            with pytest.raises(StageClosedError):
                client.add("late", 1)
            with pytest.raises(StageClosedError):
                client.call_utility("echo", 1, timeout=5)
            # Read-only, answered by the stage's input side: stats() is (a pool's replica
            # being drained read "up 0" in its metrics).
            assert client.stats(timeout=5).live == 2
            client.abort(["gone"])
            gone.collect(timeout=10)  # ended by the abort (it would run for hours)
            assert gone.aborted
            client.abort(["kept", "unknown"])
            kept.collect(timeout=10)
            assert kept.aborted
        finally:
            closer.join(30)
        assert not closer.is_alive()
        assert codes == [0]  # nothing live any more: the drain ended, not at its deadline
        with pytest.raises(StageClosedError):  # the close is over: refused again
            client.abort(["gone"])

    # Finite, so accepted; but the stage's drain timer and the client's wait for the
    # stage's exit (poll() takes at most 24.8 days, a lock 292 years) raised OverflowError
    # in their threads: the drain never ended, or shutdown() raised.
    HUGE: ClassVar = pytest.mark.parametrize(
        "how",
        [{"drain": 1e300}, {"timeout": 1e300}, {"drain": 1e300, "timeout": 1e300}],
        ids=["drain", "timeout", "both"],
    )

    @staticmethod
    def _shut_down_with(client: StageClient, how: dict[str, float]) -> int | None:
        stream = client.add("r", 20_000)  # live when the drain begins
        assert stream.get(5) == 19_999
        code = client.shutdown(**how)
        if "drain" in how:
            assert stream.collect(timeout=10) == list(range(19_998, -1, -1))
        return code

    @HUGE
    def test_seconds_past_what_a_thread_can_wait_mean_as_long_as_it_takes(
        self, launch: Launch, how: dict[str, float], capfd: pytest.CaptureFixture[str]
    ) -> None:
        assert self._shut_down_with(launch(SCRIPTED), how) == 0
        assert "OverflowError" not in capfd.readouterr().err  # the stage's drain timer

    @HUGE
    def test_so_they_do_for_a_connected_stage(
        self, connect: Connect, how: dict[str, float]
    ) -> None:
        server = Server("--engine", SCRIPTED, "--bind", "tcp://127.0.0.1:*")
        try:
            assert self._shut_down_with(connect(server.address), how) is None
            assert server.proc.wait(10) == 0
        finally:
            server.stop()

    @pytest.mark.parametrize("drain", [-1.0, float("nan")])
    def test_an_invalid_drain_raises_before_anything(self, launch: Launch, drain: float) -> None:
        client = launch(SCRIPTED)
        with pytest.raises(ValueError, match="drain must be"):
            client.shutdown(drain=drain)
        assert client.call_utility("echo", 1, timeout=5) == [1]


class TestServeDrain:
    def test_sigterm_drains_then_stops_and_a_second_one_stops_at_once(self) -> None:
        server = Server(
            "--engine", SCRIPTED, "--bind", "tcp://127.0.0.1:*", "--drain-timeout", "60"
        )
        try:
            with StageClient.connect(server.address) as client:
                long = client.add("long", 10**9)
                short = client.add("short", 50_000)
                long.get(5)
                short.get(5)  # both live in the stage before the signal
                server.proc.send_signal(signal.SIGTERM)
                # The short request runs to completion.
                assert short.collect(timeout=30)[-1] == 0
                # During the drain: utilities answered, adds refused for that request only.
                assert client.call_utility("echo", "x", timeout=5) == ["x"]
                with pytest.raises(RequestError, match="draining"):
                    client.add("late", 1).collect(timeout=5)
                assert server.proc.poll() is None  # "long" keeps it draining
                server.proc.send_signal(signal.SIGTERM)
                assert server.proc.wait(10) == 0
        finally:
            server.stop()

    def test_sigterm_drain_timeout_aborts_the_rest_with_an_error(self) -> None:
        server = Server(
            "--engine", SCRIPTED, "--bind", "tcp://127.0.0.1:*", "--drain-timeout", "0.3"
        )
        try:
            with StageClient.connect(server.address) as client:
                long = client.add("long", 10**9)
                long.get(5)
                server.proc.send_signal(signal.SIGTERM)
                with pytest.raises(RequestError, match=r"drain timed out after 0\.3 s"):
                    long.collect(timeout=10)
                assert server.proc.wait(10) == 0
        finally:
            server.stop()

    def test_negative_drain_timeout_is_refused(self) -> None:
        proc = subprocess.run(
            [sys.executable, "-m", "enginecore", "serve", "--engine", SCRIPTED,
             "--bind", "tcp://127.0.0.1:*", "--drain-timeout", "-1"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert proc.returncode == 2
        assert "--drain-timeout must be" in proc.stderr
