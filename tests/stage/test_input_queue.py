"""The idle loop reads the input socket itself (``_input_queue``): who holds the input side,
when it changes hands, and that nothing waits on the wrong thread for it. In this process,
with a raw client on real sockets."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import pytest
import zmq

from enginecore.stage import _input_queue
from enginecore.stage._inbox import Inbox
from enginecore.stage._input_queue import LEASE_S, InputQueue
from enginecore.stage._runtime import EXIT_IO_FAILED, EXIT_OK
from enginecore.stage.testing import ScriptedEngine

from .conftest import wait_until
from .raw import InProcessStage, RawClient, in_process_stage


class SlowFirstStep(ScriptedEngine):
    """The first step after an add takes a second."""

    def __init__(self) -> None:
        super().__init__()
        self.slow = False

    def add(self, req_id: str, data: Any) -> None:
        super().add(req_id, data)
        self.slow = True

    def step(self) -> list[Any]:
        if self.slow:
            self.slow = False
            time.sleep(1.0)
        return super().step()


class GatedFirstStep(ScriptedEngine):
    """The first step waits for :attr:`go` (and sets :attr:`stepping` when it starts)."""

    def __init__(self) -> None:
        super().__init__()
        self.stepping = threading.Event()
        self.go = threading.Event()

    def step(self) -> list[Any]:
        if not self.stepping.is_set():
            self.stepping.set()
            if not self.go.wait(10):
                raise AssertionError("the test never let the first step go")
        return super().step()


def _queue(stage: InProcessStage) -> InputQueue:
    q = stage.runtime.loop.input_queue
    assert isinstance(q, InputQueue)
    return q


def _until_the_loop_reads(client: RawClient, q: InputQueue) -> None:
    """Call until the idle loop holds the input side and reads it. One call is enough,
    unless the machine is so loaded that the loop spent 50 ms between reading a call and
    waiting again: the input thread then took the input side back, and hands it over only
    with the next message."""
    for call_id in range(1000, 1100):
        client.call(call_id, "echo")
        if wait_until(lambda: q.holds and q.reading, 0.5):
            return
    raise AssertionError("the idle loop never came to read the input socket")


def _pong(client: RawClient, seq: int, timeout: float) -> list[Any]:
    """Send a ping; every event up to its pong."""
    client.send("ping", seq)
    return client.until(lambda ev: ev == ["pong", seq], timeout=timeout)


class TestTheIdleLoopReads:
    def test_calls_to_an_idle_stage_are_read_by_the_loop_thread(self, no_leftovers: str) -> None:
        with in_process_stage(ScriptedEngine(), no_leftovers) as (stage, client):
            q = _queue(stage)
            _until_the_loop_reads(client, q)
            reads, handovers, reclaims = q.loop_reads, q.handovers, q.reclaims
            for i in range(2, 52):
                assert client.call(i, "echo", i)[-1] == ["utility", i, [i], None]
            # Read by the loop itself, with no hand-over and no wake-up of the input thread
            # (but for one call per reclaim, on a machine loaded enough to cause one).
            reclaimed = q.reclaims - reclaims
            assert q.loop_reads - reads >= 50 - reclaimed
            assert q.handovers - handovers == reclaimed
            # Idle: the input thread never takes it back while the loop reads.
            _until_the_loop_reads(client, q)
            reclaims = q.reclaims
            time.sleep(3 * LEASE_S)
            assert q.reclaims == reclaims
            assert q.holds

    def test_between_short_steps_the_loop_reads_it_without_blocking(
        self, no_leftovers: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(_input_queue, "SHORT_STEP_S", 10.0)  # every step is short
        monkeypatch.setattr(_input_queue, "LEASE_S", 60.0)  # and no load makes one too long
        with in_process_stage(ScriptedEngine(), no_leftovers) as (stage, client):
            q = _queue(stage)
            _until_the_loop_reads(client, q)
            releases, handovers, reclaims = q.releases, q.handovers, q.reclaims
            client.send("add", "long", 10**9)  # read by the idle loop; then it steps on
            client.until(lambda ev: ev[0] == "outputs")
            # Read by the loop between its steps: it keeps the input side, and the input
            # thread is not involved.
            reads = q.step_reads
            _pong(client, 1, timeout=2)
            # The pong can reach us before after_step() counts the read that posted it.
            assert wait_until(lambda: q.step_reads > reads, timeout=2)
            assert q.holds
            assert (q.releases, q.handovers, q.reclaims) == (releases, handovers, reclaims)
            # An abort read between two steps applies before the next one.
            client.send("abort", ["long"])
            events = client.until(lambda ev: ev[0] == "aborted")
            assert events[-1] == ["aborted", ["long"]]
            # Nothing after it but the load report that the loop, blocking now, sends alone
            # (its latest report was made busy, at the first step): the stage is idle.
            assert _pong(client, 99, timeout=2) == [["outputs", [], [], []], ["pong", 99]]
            assert client.loads[-1]["live"] == 0

    def test_after_a_long_step_the_input_thread_reads_during_the_steps(
        self, no_leftovers: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(_input_queue, "SHORT_STEP_S", 0.0)  # every step is long
        with in_process_stage(ScriptedEngine(), no_leftovers) as (stage, client):
            q = _queue(stage)
            _until_the_loop_reads(client, q)
            releases = q.releases
            client.send("add", "long", 10**9)
            assert wait_until(lambda: q.releases == releases + 1, 5)  # the first step
            assert not q.holds
            reads = q.step_reads
            _pong(client, 1, timeout=2)
            client.send("abort", ["long"])
            assert client.until(lambda ev: ev[0] == "aborted")[-1] == ["aborted", ["long"]]
            assert (q.step_reads, q.releases) == (reads, releases + 1)

    def test_what_came_during_a_long_step_applies_before_the_next_one(
        self, no_leftovers: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # The loop holds the input side through its first step (no lease here): an abort
        # that arrives meanwhile is read after the step, before the input side is given
        # back, so the step after it never runs.
        monkeypatch.setattr(_input_queue, "SHORT_STEP_S", 0.0)
        monkeypatch.setattr(_input_queue, "LEASE_S", 60.0)
        engine = GatedFirstStep()
        with in_process_stage(engine, no_leftovers) as (stage, client):
            q = _queue(stage)
            _until_the_loop_reads(client, q)
            client.send("add", "r", 5)
            assert engine.stepping.wait(5)
            assert q.holds
            client.send("abort", ["r"])
            time.sleep(0.2)  # for the abort to reach the stage's socket; not observable
            engine.go.set()
            events = client.until(lambda ev: ev[0] == "aborted")
        assert events == [["outputs", ["r"], [False], [4]], ["aborted", ["r"]]]

    def test_a_step_past_the_lease_does_not_keep_it(self, no_leftovers: str) -> None:
        with in_process_stage(SlowFirstStep(), no_leftovers) as (stage, client):
            q = _queue(stage)
            _until_the_loop_reads(client, q)
            reclaims = q.reclaims
            client.send("add", "r", 5)  # read by the idle loop; its first step is slow
            assert wait_until(lambda: not q.holds, 5)
            # Taken back by the input thread, which reads while the step runs: the pong
            # comes first, and the abort applies before the next step.
            events = _pong(client, 7, timeout=0.9)
            assert not [ev for ev in events if ev[0] == "outputs"]
            client.send("abort", ["r"])
            events = client.until(lambda ev: ev[0] == "aborted")
            assert q.reclaims == reclaims + 1  # the lease took it back, not the step
        assert events == [["outputs", ["r"], [False], [4]], ["aborted", ["r"]]]

    def test_a_long_call_does_not_keep_the_input_side(self, no_leftovers: str) -> None:
        # A utility runs on the loop thread while it holds the input side: the input thread
        # takes it back after LEASE_S, and answers a ping long before the call returns.
        with in_process_stage(ScriptedEngine(), no_leftovers) as (stage, client):
            q = _queue(stage)
            _until_the_loop_reads(client, q)
            client.send("utility", 2, "sleep", [1.5])
            reclaims = q.reclaims
            assert wait_until(lambda: not q.reading, 5)
            events = _pong(client, 3, timeout=1.0)
            assert ["utility", 2, None, None] not in events
            assert q.reclaims == reclaims + 1
            assert client.until(lambda ev: ev[0] == "utility")[-1] == ["utility", 2, None, None]
            # Idle again: the next message hands it back to the loop.
            _until_the_loop_reads(client, q)


class TestWakingTheReadingLoop:
    def test_a_deferred_answer_from_another_thread_is_sent_at_once(self, no_leftovers: str) -> None:
        # The future's callback puts on the queue from a timer thread while the loop waits
        # in poll on the socket: the put must wake it, with nothing arriving on the socket.
        with in_process_stage(ScriptedEngine(), no_leftovers) as (stage, client):
            q = _queue(stage)
            _until_the_loop_reads(client, q)
            client.send("utility", 2, "deferred", [0.2, "done"])
            assert client.until(lambda ev: ev[0] == "utility", timeout=2)[-1] == [
                "utility",
                2,
                "done",
                None,
            ]

    def test_shutdown_from_another_thread_stops_a_loop_that_reads(self, no_leftovers: str) -> None:
        stage = InProcessStage(ScriptedEngine(), no_leftovers)
        try:
            with RawClient(stage.address) as client:
                assert client.hello()[0] == "welcome"
                q = _queue(stage)
                _until_the_loop_reads(client, q)
                started = time.monotonic()
                stage.runtime.loop.request_shutdown()
                assert client.until(lambda ev: ev[0] == "shutdown", timeout=2)
                assert stage.wait(timeout=2) == EXIT_OK
                assert time.monotonic() - started < 2
        finally:
            if stage.exit_code is None:
                stage.stop()

    def test_a_failure_while_the_loop_reads_stops_the_stage_as_an_io_failure(
        self, no_leftovers: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        stage = InProcessStage(ScriptedEngine(), no_leftovers)
        inbox = stage.runtime._inbox
        read = inbox.read

        def failing_read(poller: zmq.Poller, timeout_ms: int | None = None) -> dict[Any, int]:
            if threading.current_thread().name == "test-stage-loop":
                raise RuntimeError("injected")
            return read(poller, timeout_ms)

        caplog.set_level(logging.ERROR, logger="enginecore.stage")
        try:
            with RawClient(stage.address) as client:
                q = _queue(stage)
                inbox.read = failing_read  # type: ignore[method-assign]
                assert client.hello()[0] == "welcome"
                # The next message the idle loop reads fails: the hello's hand-over, or,
                # if the loop was not waiting yet then, a later one.
                for call_id in range(100):
                    stage._thread.join(0.1)
                    if not stage._thread.is_alive():
                        break
                    client.send("utility", call_id, "echo", [])
                assert stage.wait(timeout=5) == EXIT_IO_FAILED
                assert client.until(lambda ev: ev[0] == "shutdown", timeout=2)
        finally:
            if stage.exit_code is None:
                stage.stop()
        assert q.closed
        assert inbox.failed
        assert "reading the input socket failed" in caplog.text
        assert "RuntimeError: injected" in caplog.text


class TimedIdle(ScriptedEngine):
    """An engine with an idle deadline (``_input_queue.IdleTimer``), armed as a pipeline
    stage's held-back credit is: by a step (each step sets it :attr:`delay` ahead). Each
    time it fires, whether the loop held the input side then is recorded (:attr:`holds`,
    given the stage's queue) and :attr:`fired` is set."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self.due: float | None = None
        self.queue: InputQueue | None = None
        self.fired_on: list[tuple[str, bool]] = []
        self.fired = threading.Event()

    def step(self) -> list[Any]:
        self.due = time.monotonic() + self.delay
        return super().step()

    def idle_due(self) -> float | None:
        return self.due

    def idle_fire(self) -> None:
        assert self.due is not None
        assert time.monotonic() >= self.due
        assert self.queue is not None
        self.due = None
        self.fired_on.append((threading.current_thread().name, self.queue.holds))
        self.fired.set()


class TestTheIdleTimer:
    @pytest.mark.parametrize("holder", ["loop", "input thread"])
    def test_it_fires_on_the_loop_thread_while_the_loop_idles(
        self, holder: str, no_leftovers: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # Whoever holds the input side: the idle loop polls the socket itself after a
        # short step, or, after a long one (here every step), waits on the wake-up pipe
        # while the input thread reads.
        monkeypatch.setattr(_input_queue, "LEASE_S", 60.0)  # no load makes a step too long
        short = 10.0 if holder == "loop" else 0.0  # every step is short, or every one long
        monkeypatch.setattr(_input_queue, "SHORT_STEP_S", short)
        engine = TimedIdle(0.2)
        with in_process_stage(engine, no_leftovers) as (stage, client):
            engine.queue = q = _queue(stage)
            if holder == "loop":  # the add then comes to a loop that reads (not the queue)
                _until_the_loop_reads(client, q)
            started = time.monotonic()
            client.send("add", "r", 1)
            client.until(lambda ev: ev[0] == "outputs" and ev[2] == [True])
            assert engine.fired.wait(5)  # nothing else arrives: only the timer wakes it
            assert time.monotonic() - started >= 0.2
            assert engine.fired_on == [("test-stage-loop", holder == "loop")]
            assert engine.idle_due() is None
            # It waits on without the timer: a call is still answered, nothing fires.
            assert client.call(8, "echo", 1)[-1] == ["utility", 8, [1], None]
            assert q.loop_reads or holder == "input thread"
            assert len(engine.fired_on) == 1


def test_an_inbox_needs_the_stages_input_queue() -> None:
    with pytest.raises(TypeError, match="must be an InputQueue"):
        Inbox(
            None,  # type: ignore[arg-type]
            None,  # type: ignore[arg-type]
            None,  # type: ignore[arg-type]
            queue.Queue(),  # type: ignore[arg-type]
            None,  # type: ignore[arg-type]
            on_failure=lambda: None,
        )
