"""Per-request timings (``stream.timings``): exact, with a clock passed in, on the session
that both clients share; then measured, through both clients (``[sync]`` / ``[async]``),
against real launched stages."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import msgspec
import pytest

from enginecore.stage import (
    EngineDeadError,
    RequestError,
    StageClient,
    StageClosedError,
    StreamTimings,
)
from enginecore.stage._session import StreamCore

from .conftest import COUNTDOWN, Launch
from .test_session import Session, frame, outputs, session


def check_consistent(t: StreamTimings) -> None:
    """What every snapshot satisfies, running or ended."""
    assert t.outputs >= 0
    assert len(t.gaps) == max(0, t.outputs - 1)
    assert all(gap >= 0 for gap in t.gaps)
    if t.outputs:
        assert t.first_output_at is not None
        assert t.last_output_at is not None
        assert t.time_to_first_output is not None
        assert t.sent_at <= t.first_output_at <= t.last_output_at
        assert t.time_to_first_output == t.first_output_at - t.sent_at
        assert t.time_to_first_output >= 0
    else:
        assert t.first_output_at is t.last_output_at is t.time_to_first_output is None
    if t.outputs > 1:
        assert t.mean_gap == pytest.approx(sum(t.gaps) / len(t.gaps))
        assert t.max_gap == max(t.gaps)
    else:
        assert t.mean_gap is t.max_gap is None
    if t.ended_at is None:
        assert t.total is None
        assert t.outcome is None
        assert t.error is None
    else:
        assert t.total == t.ended_at - t.sent_at
        assert t.total >= 0
        assert t.outcome in ("finished", "aborted", "error")
        assert (t.error is not None) == (t.outcome == "error")
        if t.last_output_at is not None:
            assert t.ended_at >= t.last_output_at
            assert t.time_to_first_output is not None
            assert t.time_to_first_output <= t.total


# -- exact: the session, with a clock passed in -------------------------------------------------


def opened(s: Session, req_id: str, sent_at: float) -> StreamCore:
    stream = StreamCore(req_id, sent_at=sent_at)
    s.open_request(req_id, stream)
    return stream


class TestSessionTimings:
    def test_each_output_arrives_with_its_frame_and_several_events_of_one_frame_share_it(
        self,
    ) -> None:
        s = session()
        a = opened(s, "a", 100.5)
        b = opened(s, "b", 100.75)
        s.receive(frame(outputs(("a", False, 3), ("b", False, 9))), 101.0)
        # Two steps' events in one frame: one arrival for both of a's outputs.
        s.receive(frame(outputs(("a", False, 2)), outputs(("a", False, 1))), 103.0)
        s.receive(frame(outputs(("a", True, 0))), 103.5)
        t = a.timings
        check_consistent(t)
        assert t == StreamTimings(
            sent_at=100.5,
            first_output_at=101.0,
            last_output_at=103.5,
            ended_at=103.5,
            outcome="finished",
            error=None,
            outputs=4,
            gaps=(2.0, 0.0, 0.5),
            time_to_first_output=0.5,
            mean_gap=2.5 / 3,
            max_gap=2.0,
            total=3.0,
        )
        tb = b.timings  # still running
        check_consistent(tb)
        assert (tb.outputs, tb.time_to_first_output) == (1, 0.25)
        assert (tb.ended_at, tb.outcome) == (None, None)

    def test_before_any_output(self) -> None:
        s = session()
        a = opened(s, "a", 100.0)
        t = a.timings
        check_consistent(t)
        assert (t.sent_at, t.outputs, t.gaps, t.time_to_first_output, t.total) == (
            100.0,
            0,
            (),
            None,
            None,
        )

    def test_a_snapshot_is_frozen_and_stays_as_it_was_taken(self) -> None:
        s = session()
        a = opened(s, "a", 100.0)
        s.receive(frame(outputs(("a", False, 1))), 101.0)
        before = a.timings
        with pytest.raises(dataclasses.FrozenInstanceError):
            before.outputs = 5  # type: ignore[misc]
        s.receive(frame(outputs(("a", True, 0))), 102.0)
        assert (before.outputs, before.ended_at) == (1, None)
        assert (a.timings.outputs, a.timings.ended_at) == (2, 102.0)

    def test_abort_and_error_end_at_their_frame(self) -> None:
        s = session()
        a = opened(s, "a", 100.0)
        b = opened(s, "b", 100.0)
        s.receive(frame(outputs(("a", False, 1), ("b", False, 1))), 101.0)
        s.receive(frame(["aborted", ["a"]], ["error", "b", "boom"]), 104.0)
        ta, tb = a.timings, b.timings
        check_consistent(ta)
        check_consistent(tb)
        assert (ta.outcome, ta.ended_at, ta.total, ta.error) == ("aborted", 104.0, 4.0, None)
        assert (tb.outcome, tb.ended_at) == ("error", 104.0)
        assert isinstance(tb.error, RequestError)
        assert tb.error.message == "boom"

    def test_the_stage_gone_ends_every_stream_when_the_client_finds_out(self) -> None:
        s = session()
        a = opened(s, "a", 100.0)
        s.receive(frame(outputs(("a", False, 1))), 101.0)
        err = EngineDeadError("gone")
        s.fail(err, now=107.0)
        t = a.timings
        check_consistent(t)
        assert (t.outcome, t.error, t.ended_at, t.outputs) == ("error", err, 107.0, 1)

    def test_an_undecodable_frame_ends_the_streams_at_its_arrival(self) -> None:
        s = session()
        a = opened(s, "a", 100.0)
        s.receive([msgspec.msgpack.encode([["nonsense"]])], 102.0)
        t = a.timings
        assert (t.outcome, t.ended_at) == ("error", 102.0)
        assert isinstance(t.error, EngineDeadError)

    def test_add_many_gives_every_stream_one_send_time(self) -> None:
        # The clients build add_many's streams with one reading (ClientBase); the session
        # keeps what it is given.
        s = session()
        streams = [StreamCore(rid, sent_at=100.0) for rid in ("a", "b")]
        s.open_requests(["a", "b"], streams)
        s.receive(frame(outputs(("a", True, 0), ("b", True, 0))), 100.25)
        assert [st.timings.time_to_first_output for st in streams] == [0.25, 0.25]


# -- measured: both clients, real stages ------------------------------------------------------


class TestClientTimings:
    def test_a_finished_stream(self, launch: Launch) -> None:
        client = launch(COUNTDOWN)
        before = time.monotonic()
        stream = client.add("r", 50)
        assert stream.collect(timeout=10) == list(range(49, -1, -1))
        after = time.monotonic()
        t = stream.timings
        check_consistent(t)
        assert before <= t.sent_at
        assert t.ended_at is not None
        assert t.ended_at <= after
        assert t.outputs == 50
        assert len(t.gaps) == 49
        assert t.outcome == "finished"
        assert t.ended_at == t.last_output_at  # the finished output ends it
        assert t.time_to_first_output is not None
        assert t.total is not None
        assert 0 <= t.time_to_first_output <= t.total

    def test_add_many_streams_share_one_send(self, launch: Launch) -> None:
        client = launch(COUNTDOWN)
        streams = client.add_many([(f"r{i}", 1 + i % 3) for i in range(20)])
        for s in streams:
            s.collect(timeout=10)
        timings = [s.timings for s in streams]
        for t in timings:
            check_consistent(t)
            assert t.outcome == "finished"
        assert len({t.sent_at for t in timings}) == 1
        assert [t.outputs for t in timings] == [1 + i % 3 for i in range(20)]

    def test_before_any_output_then_the_measured_wait(self, stage_client: StageClient) -> None:
        # The stage's loop sleeps 0.3 s before it can apply the add: no output can arrive
        # until then, and the time to first output covers the sleep.
        stage_client.call_utility_future("sleep", 0.3)
        stream = stage_client.add("r", 2)
        t = stream.timings
        check_consistent(t)
        assert (t.outputs, t.gaps, t.first_output_at, t.time_to_first_output) == (0, (), None, None)
        assert (t.ended_at, t.total, t.outcome, t.mean_gap, t.max_gap) == (None,) * 5
        assert t.sent_at <= time.monotonic()
        assert stream.collect(timeout=10) == [1, 0]
        t = stream.timings
        check_consistent(t)
        assert t.time_to_first_output is not None
        assert t.time_to_first_output >= 0.25  # 0.3 s, less the time between the two sends

    def test_a_slow_engine_gives_gaps_at_least_its_step_time(self, launch: Launch) -> None:
        # One step at a time, each waiting DEVICE_S for its "device": outputs are produced
        # DEVICE_S apart, and the first one DEVICE_S after the request arrived.
        device_s = 0.1
        client = launch(
            "enginecore.stage.testing:pipelined", kwargs={"depth": 1, "device_s": device_s}
        )
        stream = client.add("r", 6)
        assert stream.collect(timeout=10) == [5, 4, 3, 2, 1, 0]
        t = stream.timings
        check_consistent(t)
        assert t.outputs == 6
        assert t.time_to_first_output is not None
        assert t.time_to_first_output >= device_s  # exact: the sleep follows the send
        # A gap can be shorter than the step by the delivery latency of the output before
        # it (a loaded machine); their sum only by the first one's.
        assert sum(t.gaps) >= 5 * device_s - 0.05
        assert t.mean_gap is not None
        assert t.mean_gap >= device_s - 0.01
        assert min(t.gaps) >= device_s / 2

    def test_an_aborted_stream_ends_at_its_abort(self, stage_client: StageClient) -> None:
        stream = stage_client.add("long", 10**9)
        stream.get(5)
        stage_client.abort(["long"])
        stream.collect(timeout=5)
        assert stream.aborted
        t = stream.timings
        check_consistent(t)
        assert t.outcome == "aborted"
        assert t.outputs >= 1
        assert t.ended_at is not None

    def test_a_request_error_ends_the_stream(self, stage_client: StageClient) -> None:
        stream = stage_client.add("bad", "two")  # refused by the engine's add
        with pytest.raises(RequestError) as info:
            stream.collect(timeout=5)
        t = stream.timings
        check_consistent(t)
        assert (t.outcome, t.outputs, t.time_to_first_output) == ("error", 0, None)
        assert t.error is info.value
        assert t.total is not None

    def test_stage_death_ends_the_stream(self, stage_client: StageClient) -> None:
        stream = stage_client.add("long", 10**9)
        stream.get(5)
        os.kill(stage_client.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError) as info:
            stream.collect(timeout=5)
        t = stream.timings
        check_consistent(t)
        assert t.outcome == "error"
        assert t.error is info.value
        assert t.outputs >= 1
        assert t.ended_at is not None
        stage_client.shutdown()

    def test_closing_the_client_ends_the_stream(self, launch: Launch) -> None:
        client = launch(COUNTDOWN)
        stream = client.add("long", 10**9)
        stream.get(5)
        client.close()
        with pytest.raises(StageClosedError):
            stream.collect(timeout=5)
        t = stream.timings
        check_consistent(t)
        assert t.outcome == "error"
        assert isinstance(t.error, StageClosedError)

    def test_read_from_another_thread_while_outputs_arrive(self, launch: Launch) -> None:
        client = launch(COUNTDOWN)
        stream = client.add("r", 20_000)
        seen: list[StreamTimings] = []
        errors: list[BaseException] = []

        def watch() -> None:
            try:
                while True:
                    t = stream.timings
                    seen.append(t)
                    if t.ended_at is not None:
                        return
            except BaseException as exc:
                errors.append(exc)

        watcher = threading.Thread(target=watch)
        watcher.start()
        assert len(stream.collect(timeout=30)) == 20_000
        watcher.join(30)
        assert not errors
        for t in seen:
            check_consistent(t)
        assert [t.outputs for t in seen] == sorted(t.outputs for t in seen)
        assert seen[-1].outputs == 20_000
        assert seen[-1].outcome == "finished"
