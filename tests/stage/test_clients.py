"""Both clients against a real launched stage: one suite, run through StageClient and
through AsyncStageClient (``[sync]`` / ``[async]``), because they promise the same behaviour.

The death matrix is in ``test_death.py`` (same fixture); what only one client can do
(threads, done-callbacks, cancellation) is in ``test_client.py`` / ``test_aclient.py``.
"""

from __future__ import annotations

import asyncio
import math
import signal
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pytest

from enginecore.stage import (
    Aborted,
    AsyncStageClient,
    EngineDeadError,
    ErrorReport,
    Outputs,
    ProtocolError,
    RequestError,
    Shutdown,
    StageClient,
    StageClosedError,
    StageEvent,
    UtilityError,
    UtilityResult,
)

from .conftest import COUNTDOWN, ECHO, SCRIPTED, Connect, Launch, Server
from .raw import RawClient


def outputs_of(events: Iterable[object]) -> list[tuple[str | None, bool, Any]]:
    """Every output in *events*, flattened: ``(req_id, finished, payload)``."""
    return [
        triple
        for event in events
        if isinstance(event, Outputs)
        for triple in zip(event.req_ids, event.finished, event.payloads, strict=True)
    ]


def events_until(client: StageClient, done: Callable[[list[StageEvent]], bool]) -> list[StageEvent]:
    """Events, a batch at a time, until *done(events so far)*."""
    events: list[StageEvent] = []
    while not done(events):
        events += client.get_events(5)
    return events


def finished(*req_ids: str) -> Callable[[list[StageEvent]], bool]:
    """For :func:`events_until`: until every one of *req_ids* has had its finished output."""

    def done(events: list[StageEvent]) -> bool:
        ended = {rid for rid, fin, _ in outputs_of(events) if fin}
        return ended >= set(req_ids)

    return done


def events_until_barrier(client: StageClient) -> list[StageEvent]:
    """Every event until a utility barrier comes back: all that was emitted before it."""
    client.call_utility_future("echo", "barrier")
    events: list[StageEvent] = []
    while True:
        event = client.get_event(5)
        if isinstance(event, UtilityResult) and event.result == ["barrier"]:
            return events
        events.append(event)


class TestRoundTrip:
    def test_add_streams_outputs_until_finished(self, stage_client: StageClient) -> None:
        stream = stage_client.add("r1", 3)
        assert list(stream) == [2, 1, 0]
        assert stream.finished
        assert not stream.aborted
        with pytest.raises(StopIteration):  # an ended stream stays ended
            stream.get(0)

    def test_each_step_is_one_outputs_event(self, stage_client: StageClient) -> None:
        stage_client.add("r1", 2)
        assert stage_client.get_event(5) == Outputs(["r1"], [False], [1])
        assert stage_client.get_event(5) == Outputs(["r1"], [True], [0])

    def test_many_requests_interleave_and_all_finish(self, stage_client: StageClient) -> None:
        streams = [stage_client.add(f"r{i}", 1 + i % 7) for i in range(300)]
        for i, stream in enumerate(streams):
            assert stream.collect(timeout=10) == list(range(i % 7, -1, -1))

    def test_countdown_factory_works_without_ordered_events(self, launch: Launch) -> None:
        client = launch(COUNTDOWN)
        assert client.add("a", 2).collect(timeout=5) == [1, 0]
        with pytest.raises(RuntimeError, match="ordered_events=True"):
            client.get_event(0)
        with pytest.raises(RuntimeError, match="ordered_events=True"):
            client.get_events(0)

    def test_req_id_reusable_after_finish_but_not_while_live(
        self, stage_client: StageClient
    ) -> None:
        stage_client.add("r", 100_000)
        with pytest.raises(ValueError, match="still live"):
            stage_client.add("r", 1)
        # A bound for a failure only: "r" runs flat out beside them, on a loaded machine.
        stage_client.add("done", 1).collect(timeout=30)
        assert stage_client.add("done", 2).collect(timeout=30) == [1, 0]

    def test_collect_timeout_keeps_what_it_read(self, stage_client: StageClient) -> None:
        stream = stage_client.add("long", 1_000_000)
        assert stream.get(5) == 999_999
        with pytest.raises(TimeoutError, match="did not end"):
            stream.collect(timeout=0.2)
        assert stream.get(5) == 999_998  # nothing was lost to the timeout
        with pytest.raises(ValueError, match="non-negative"):
            stream.get(-1)
        with pytest.raises(ValueError, match="non-negative"):  # NaN would never pass
            stream.collect(timeout=float("nan"))
        for bad in ("1", True):  # a bare comparison error, and True taken for 1 s, before
            with pytest.raises(TypeError, match="'timeout' must be a number of seconds"):
                stream.get(bad)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="'timeout' must be a number of seconds"):
                stage_client.call_utility("echo", 1, timeout=bad)  # type: ignore[arg-type]
        assert stream.get(5) == 999_997

    def test_collect_of_a_stream_whose_end_has_come(self, stage_client: StageClient) -> None:
        # collect()'s fast path (no lock): the end is in the buffer before the first read.
        stream = stage_client.add("r", 3)
        bad = stage_client.add("bad", "two")
        events_until(
            stage_client,
            lambda evs: finished("r")(evs) and any(isinstance(e, ErrorReport) for e in evs),
        )  # each event is dispatched together with its stream's outputs
        with pytest.raises(ValueError, match="non-negative"):
            stream.collect(timeout=-1)  # checked first, as on the slow path
        assert stream.collect(timeout=0) == [2, 1, 0]
        assert stream.finished
        assert stream.collect(timeout=0) == []  # ended: every later read ends the same way
        with pytest.raises(StopIteration):
            stream.get(0)
        with pytest.raises(RequestError, match="got 'two'"):  # an error end raises it
            bad.collect(timeout=0)
        with pytest.raises(RequestError, match="got 'two'"):
            bad.collect(timeout=0)


class TestAddMany:
    def test_one_frame_applied_in_order(self, stage_client: StageClient) -> None:
        streams = stage_client.add_many([("a", 2), ("b", 1), ("c", 3)])
        assert [s.req_id for s in streams] == ["a", "b", "c"]
        assert [s.collect(timeout=5) for s in streams] == [[1, 0], [0], [2, 1, 0]]
        assert stage_client.call_utility("log", timeout=5) == ["add a", "add b", "add c"]

    def test_refused_whole_before_sending(self, stage_client: StageClient) -> None:
        stage_client.add("live", 1_000_000)
        with pytest.raises(ValueError, match="'live' is still live"):
            stage_client.add_many([("x", 1), ("live", 1)])
        with pytest.raises(ValueError, match="'y' appears twice"):
            stage_client.add_many([("y", 1), ("z", 1), ("y", 2)])
        with pytest.raises(TypeError, match="data of request 'bad'"):
            stage_client.add_many([("ok", 1), ("bad", {1, 2})])
        with pytest.raises(TypeError, match="request 'big'"):
            stage_client.add_many([("ok", 1), ("big", 2**70)])
        with pytest.raises(TypeError, match="pairs"):
            stage_client.add_many([("ok", 1, 2)])  # type: ignore[list-item]
        with pytest.raises(TypeError, match="req_id must be a str"):
            stage_client.add_many([(1, 1)])  # type: ignore[list-item]
        assert stage_client.call_utility("log", timeout=5) == ["add live"]
        # None of the refused ids was registered: all are free.
        assert stage_client.add_many([("x", 1), ("y", 1)])[1].collect(timeout=5) == [0]

    def test_nothing_to_add(self, stage_client: StageClient) -> None:
        assert stage_client.add_many([]) == []
        assert stage_client.add_many([], streams=False) is None

    def test_without_streams_outputs_are_events(self, stage_client: StageClient) -> None:
        assert stage_client.add_many([("a", 1), ("b", 2)], streams=False) is None
        events = events_until(stage_client, finished("a", "b"))
        assert outputs_of(events) == [("a", True, 0), ("b", False, 1), ("b", True, 0)]


class TestWithoutStream:
    def test_outputs_only_in_the_event_stream(self, stage_client: StageClient) -> None:
        assert stage_client.add("quiet", 2, stream=False) is None
        loud = stage_client.add("loud", 2)
        assert loud.collect(timeout=5) == [1, 0]
        events = events_until(stage_client, finished("quiet", "loud"))
        assert [o for o in outputs_of(events) if o[0] == "quiet"] == [
            ("quiet", False, 1),
            ("quiet", True, 0),
        ]

    def test_needs_the_event_stream(self, launch: Launch) -> None:
        client = launch(COUNTDOWN)
        with pytest.raises(RuntimeError, match="ordered_events=True"):
            client.add("r", 1, stream=False)
        with pytest.raises(RuntimeError, match="ordered_events=True"):
            client.add_many([("r", 1)], streams=False)

    def test_error_report_reaches_the_event_stream(self, stage_client: StageClient) -> None:
        stage_client.add("bad", 10_000_000, stream=False)
        stage_client.call_utility("poison", "bad", timeout=5)
        events = events_until(
            stage_client, lambda evs: any(isinstance(e, ErrorReport) for e in evs)
        )
        reports = [e for e in events if isinstance(e, ErrorReport)]
        assert [(r.req_id, "not wire-encodable" in r.message) for r in reports] == [("bad", True)]


class TestRequestScopedFailure:
    """Issue 8, item 1: one bad request ends with an error for that request only."""

    def test_a_rejected_add_ends_only_its_request_while_200_streams_complete(
        self, launch: Launch
    ) -> None:
        client = launch(COUNTDOWN)
        streams = client.add_many([(f"r{i}", 20) for i in range(200)])
        bad = client.add("bad", {"prompt": 42})  # killed the stage before (issue 8)
        with pytest.raises(RequestError) as info:
            bad.collect(timeout=10)
        assert info.value.req_id == "bad"
        assert info.value.message == "need an int >= 1 (a step count), got {'prompt': 42}"
        for stream in streams:
            assert stream.collect(timeout=10) == list(range(19, -1, -1))
            assert stream.finished
        # The stage goes on, and the rejected id was never admitted.
        assert client.add("bad", 2).collect(timeout=5) == [1, 0]
        assert client.call_utility("num_requests", timeout=5) == 0

    def test_add_many_ends_only_its_rejected_items(self, stage_client: StageClient) -> None:
        a, bad, c = stage_client.add_many([("a", 2), ("bad", "two"), ("c", 1)])
        with pytest.raises(RequestError, match="got 'two'"):
            bad.collect(timeout=5)
        assert (a.collect(timeout=5), c.collect(timeout=5)) == ([1, 0], [0])
        assert stage_client.call_utility("log", timeout=5) == ["add a", "add bad", "add c"]

    def test_a_rejected_add_without_a_stream_is_an_error_report(
        self, stage_client: StageClient
    ) -> None:
        stage_client.add("bad", -1, stream=False)
        events = events_until_barrier(stage_client)
        assert [e for e in events if isinstance(e, ErrorReport)] == [
            ErrorReport("bad", "need an int >= 1 (a step count), got -1")
        ]

    def test_routing_ends_a_request_with_an_error(self, stage_client: StageClient) -> None:
        failing = stage_client.add("failing", 10_000_000)
        other = stage_client.add("other", 5)
        failing.get(5)
        stage_client.call_utility("reject", "failing", "out of KV pages", timeout=5)
        with pytest.raises(RequestError) as info:
            failing.collect(timeout=5)
        assert (info.value.req_id, info.value.message) == ("failing", "out of KV pages")
        assert other.collect(timeout=5)[-1] == 0
        # The stage dropped it from the engine, which was still stepping it...
        assert stage_client.call_utility("log", timeout=5)[-1] == "abort failing"
        # ...with no Aborted event: the error was its last event, and the id is free again.
        events = events_until_barrier(stage_client)
        assert not [e for e in events if isinstance(e, Aborted)]
        assert stage_client.add("failing", 2).collect(timeout=5) == [1, 0]

    def test_routing_ends_a_request_with_an_error_on_its_last_output(
        self, stage_client: StageClient
    ) -> None:
        failing = stage_client.add("failing", 10_000_000)
        stage_client.call_utility("reject", "failing", "stop", True, timeout=5)
        with pytest.raises(RequestError, match="stop"):
            failing.collect(timeout=5)
        assert stage_client.add("failing", 1).collect(timeout=5) == [0]
        # The engine finished it itself: the stage had nothing to abort.
        assert stage_client.call_utility("log", timeout=5) == ["add failing", "add failing"]

    def test_the_event_stream_sees_one_error_per_failed_request(
        self, stage_client: StageClient
    ) -> None:
        stage_client.add_many([("x", 3), ("y", 0), ("z", 10_000_000)], streams=False)
        stage_client.call_utility("reject", "z", "no", timeout=5)
        events = events_until(stage_client, finished("x"))
        events += events_until_barrier(stage_client)
        assert [e for e in events if isinstance(e, ErrorReport)] == [
            ErrorReport("y", "need an int >= 1 (a step count), got 0"),
            ErrorReport("z", "no"),
        ]
        assert not [e for e in events if isinstance(e, Aborted)]
        assert {rid for rid, fin, _ in outputs_of(events) if fin} == {"x"}


class TestEventStream:
    def test_get_events_returns_everything_received(self, stage_client: StageClient) -> None:
        stage_client.add("r", 3).collect(timeout=5)
        assert stage_client.call_utility("echo", "x", timeout=5) == ["x"]
        # The answer came after the outputs, on the same socket: all are here already.
        events = stage_client.get_events(5)
        assert events[:3] == [
            Outputs(["r"], [False], [2]),
            Outputs(["r"], [False], [1]),
            Outputs(["r"], [True], [0]),
        ]
        assert len(events) == 4
        assert isinstance(events[3], UtilityResult)
        assert events[3].result == ["x"]
        with pytest.raises(TimeoutError):
            stage_client.get_events(0)

    def test_timeouts(self, stage_client: StageClient) -> None:
        with pytest.raises(TimeoutError):
            stage_client.get_event(0)
        with pytest.raises(TimeoutError):
            stage_client.get_events(0.05)
        with pytest.raises(ValueError, match="non-negative"):
            stage_client.get_event(-1)
        with pytest.raises(ValueError, match="non-negative"):
            stage_client.get_events(-1)
        # With an event ready too (it was returned, the timeout unchecked), and it stays.
        assert stage_client.call_utility("echo", 1, timeout=5) == [1]
        for bad in (-1, float("nan")):
            with pytest.raises(ValueError, match="non-negative"):
                stage_client.get_event(bad)
        with pytest.raises(TypeError, match="number of seconds"):
            stage_client.get_event("1")  # type: ignore[arg-type]
        assert isinstance(stage_client.get_event(5), UtilityResult)

    def test_get_events_waits_for_the_first(self, stage_client: StageClient) -> None:
        future = stage_client.call_utility_future("sleep", 0.3)
        started = time.monotonic()
        events = stage_client.get_events(5)
        assert time.monotonic() - started > 0.2
        assert len(events) == 1
        assert isinstance(events[0], UtilityResult)
        assert future.result(5) is None

    def test_an_infinite_timeout_waits_without_limit(self, stage_client: StageClient) -> None:
        # Each wait below outlasts a borrowed socket's read (the stage sleeps 0.3 s first):
        # a blocking wait with a timeout past threading.TIMEOUT_MAX raised OverflowError.
        for huge in (math.inf, 1e300):
            assert stage_client.call_utility("sleep", 0.3, timeout=huge) is None
            stage_client.call_utility_future("sleep", 0.3)
            assert isinstance(stage_client.get_events(huge)[0], UtilityResult)
            stage_client.call_utility_future("sleep", 0.3)
            stream = stage_client.add(f"r{huge}", 2)
            assert stream.get(huge) == 1
            assert stream.collect(huge) == [0]
            stage_client.get_events(5)  # the answer to the second sleep
            assert stage_client.stats(timeout=huge).live == 0

    def test_stream_ends_after_our_shutdown(self, stage_client: StageClient) -> None:
        stage_client.add("r", 1).collect(timeout=5)
        assert stage_client.shutdown() == 0
        events = stage_client.get_events(5)
        assert events[-1] == Shutdown()
        with pytest.raises(StopIteration):
            stage_client.get_events(5)
        with pytest.raises(StopIteration):
            stage_client.get_event(5)
        assert list(stage_client.events()) == []

    def test_unrouted_output_goes_to_the_event_stream(self, stage_client: StageClient) -> None:
        stage_client.call_utility("unrouted", "tick", timeout=5)
        events = events_until(stage_client, lambda evs: bool(outputs_of(evs)))
        assert outputs_of(events) == [(None, False, "tick")]


class TestAbort:
    def test_no_output_after_abort_is_applied(self, stage_client: StageClient) -> None:
        stream = stage_client.add("long", 1_000_000)
        short = stage_client.add("short", 3)
        assert stream.get(5) == 999_999
        stage_client.abort(["long"])
        rest = stream.collect(timeout=5)  # outputs produced before the abort applied
        assert stream.aborted
        assert not stream.finished
        assert rest == list(range(999_998, 999_998 - len(rest), -1))
        events = events_until_barrier(stage_client)
        aborted_at = [i for i, e in enumerate(events) if isinstance(e, Aborted)]
        assert len(aborted_at) == 1
        assert events[aborted_at[0]] == Aborted(["long"])
        assert all(rid != "long" for rid, _, _ in outputs_of(events[aborted_at[0] :]))
        assert short.collect(timeout=5) == [2, 1, 0]  # (it may still be running until here)
        assert stage_client.call_utility("num_requests", timeout=5) == 0

    def test_abort_unknown_ids_is_harmless(self, stage_client: StageClient) -> None:
        stage_client.abort(["nope"])
        assert stage_client.add("r", 1).collect(timeout=5) == [0]

    def test_an_abort_of_an_ended_request_does_not_end_its_id_added_again(
        self, stage_client: StageClient
    ) -> None:
        # The stage answers every abort, known id or not (docs/wire.md section 5): the
        # answer to this one comes after the id was added again, and is not the new one's.
        assert stage_client.add("r", 1).collect(timeout=5) == [0]
        stage_client.call_utility_future("sleep", 0.5)  # the loop busy: both queue up
        stage_client.abort(["r"])  # too late: r has finished
        again = stage_client.add("r", 3)
        assert again.collect(timeout=5) == [2, 1, 0]
        assert again.finished
        assert stage_client.call_utility("num_requests", timeout=5) == 0

    def test_abort_rejects_a_bare_string(self, stage_client: StageClient) -> None:
        with pytest.raises(TypeError, match=r"abort\(\['r1'\]\)"):
            stage_client.abort("r1")
        # Not iterable at all: said so, not Python's "'int' object is not iterable".
        with pytest.raises(TypeError, match="abort\\(\\) takes a sequence of request ids, got int"):
            stage_client.abort(5)  # type: ignore[arg-type]

    def test_add_abort_add_reach_the_engine_in_order(self, stage_client: StageClient) -> None:
        # The loop's contract end to end: three frames back to back, applied in order.
        stage_client.add("r1", 1_000_000)
        stage_client.abort(["r1"])
        stage_client.add("r2", 1)
        assert stage_client.call_utility("log", timeout=5) == ["add r1", "abort r1", "add r2"]

    def test_a_big_step_arrives_whole_and_in_order(self, stage_client: StageClient) -> None:
        n = 1300
        # While the loop sleeps, every add queues up: one drain applies them all, then a step.
        stage_client.call_utility_future("sleep", 1.0)
        time.sleep(0.2)
        streams = stage_client.add_many([(f"s{i}", 2) for i in range(n)])
        outputs: list[tuple[str | None, bool, Any]] = []
        while len(outputs) < 2 * n:
            outputs += outputs_of(stage_client.get_events(10))
        assert outputs == [(f"s{i}", False, 1) for i in range(n)] + [
            (f"s{i}", True, 0) for i in range(n)
        ]
        assert all(stream.collect(timeout=5) == [1, 0] for stream in streams)


class TestUtility:
    def test_result_and_error(self, stage_client: StageClient) -> None:
        assert stage_client.call_utility("div", 1, 4, timeout=5) == 0.25
        with pytest.raises(UtilityError, match="ZeroDivisionError") as info:
            stage_client.call_utility("div", 1, 0, timeout=5)
        assert info.value.remote_repr == "ZeroDivisionError('division by zero')"
        assert info.value.name == "div"

    def test_many_calls_in_flight_are_matched_by_call_id(self, stage_client: StageClient) -> None:
        stage_client.add("busy", 10_000)  # calls interleave with steps
        futures = [stage_client.call_utility_future("div", i, i % 3) for i in range(300)]
        for i, future in enumerate(futures):
            if i % 3 == 0:
                with pytest.raises(UtilityError):
                    future.result(10)
            else:
                assert future.result(10) == i / (i % 3)

    def test_timeout_then_the_client_still_works(self, stage_client: StageClient) -> None:
        with pytest.raises(TimeoutError, match="sleep"):
            stage_client.call_utility("sleep", 0.5, timeout=0.05)
        assert stage_client.call_utility("echo", "after", timeout=5) == ["after"]

    def test_unknown_utility_is_a_utility_error(self, stage_client: StageClient) -> None:
        with pytest.raises(UtilityError, match="no utility 'nope'"):
            stage_client.call_utility("nope", timeout=5)

    def test_utility_event_in_the_ordered_stream(self, stage_client: StageClient) -> None:
        stage_client.call_utility("echo", 1, timeout=5)
        event = stage_client.get_event(5)
        assert isinstance(event, UtilityResult)
        assert (event.result, event.error) == ([1], None)


class TestUtilityAmongOtherTraffic:
    """A blocking call may read the stage's events itself while it waits (the sync client
    borrows the socket from its receiver thread): whatever else arrives meanwhile is handled
    as the receiver would handle it."""

    def test_blocking_calls_while_a_request_streams(self, stage_client: StageClient) -> None:
        n = 2000
        stream = stage_client.add("s", n)
        futures = [stage_client.call_utility_future("echo", "f", i) for i in range(20)]
        got = [stage_client.call_utility("echo", i, timeout=5) for i in range(100)]
        assert got == [[i] for i in range(100)]
        assert [f.result(5) for f in futures] == [["f", i] for i in range(20)]
        assert stream.collect(timeout=10) == list(range(n - 1, -1, -1))
        # The ordered event stream has every output and every answer, in the stage's order.
        events = events_until(stage_client, finished("s"))
        assert outputs_of(events) == [("s", left == 0, left) for left in range(n - 1, -1, -1)]
        answers = [e.result for e in events if isinstance(e, UtilityResult)]
        assert answers == [["f", i] for i in range(20)] + [[i] for i in range(100)]

    def test_calls_futures_and_requests_alternate(self, launch: Launch) -> None:
        # Without the ordered event stream: back-to-back calls, each followed at once by
        # other work whose answer must still be read.
        client = launch(COUNTDOWN)
        for i in range(50):
            assert client.call_utility("div", i, 2, timeout=5) == i / 2
        assert client.add("r", 3).collect(timeout=5) == [2, 1, 0]
        for i in range(20):
            assert client.call_utility("div", i, 1, timeout=5) == i
            assert client.call_utility_future("div", i, 4).result(5) == i / 4
            assert client.call_utility("div", i, 1, timeout=5) == i
            assert client.add(f"q{i}", 2).collect(timeout=5) == [1, 0]
        future = client.call_utility_future("div", 1, 4)
        assert client.call_utility("div", 1, 2, timeout=5) == 0.5
        assert future.result(5) == 0.25
        with pytest.raises(UtilityError, match="ZeroDivisionError"):
            client.call_utility("div", 1, 0, timeout=5)
        assert client.call_utility("div", 3, 1, timeout=5) == 3


class TestPayloads:
    @pytest.mark.parametrize(
        "data",
        [
            {1, 2},
            object(),
            2**70,
            {(1, 2): 3},
            [1, [2, {3}]],
            1 + 2j,
            np.array([object()]),
            np.zeros(2, dtype=[("a", "i4")]),
        ],
    )
    def test_unencodable_request_data_is_refused_before_sending(
        self, stage_client: StageClient, data: object
    ) -> None:
        with pytest.raises(TypeError, match="data of request 'r'"):
            stage_client.add("r", data)
        assert stage_client.call_utility("log", timeout=5) == []
        assert stage_client.add("r", 1).collect(timeout=5) == [0]  # nothing was registered

    def test_lone_surrogates_are_refused_with_type_error_before_sending(
        self, stage_client: StageClient
    ) -> None:
        # prepare() passes any exact str; UTF-8 encoding is what refuses these.
        bad = "x\ud800"
        with pytest.raises(TypeError, match="surrogates"):
            stage_client.add("r", {"k": bad})
        with pytest.raises(TypeError, match="surrogates"):
            stage_client.add(bad, 1)
        with pytest.raises(TypeError, match="surrogates"):
            stage_client.add_many([("r", bad)])
        with pytest.raises(TypeError, match="surrogates"):
            stage_client.call_utility("echo", [bad])
        with pytest.raises(TypeError, match="surrogates"):
            stage_client.call_utility(bad)
        with pytest.raises(TypeError, match="surrogates"):
            stage_client.abort([bad])
        assert stage_client.call_utility("log", timeout=5) == []

    def test_unencodable_utility_args_are_refused(self, stage_client: StageClient) -> None:
        with pytest.raises(TypeError, match="arguments of utility 'echo'"):
            stage_client.call_utility("echo", {1})

    def test_rich_payloads_round_trip(self, stage_client: StageClient) -> None:
        value = [None, True, -(2**63), 2**64 - 1, 1.5, "é", b"\x00\xff", {"k": [1, (2, 3)]}]
        assert stage_client.call_utility("echo", *value, {7: b""}, timeout=5) == [
            None,
            True,
            -(2**63),
            2**64 - 1,
            1.5,
            "é",
            b"\x00\xff",
            {"k": [1, [2, 3]]},
            {7: b""},
        ]

    def test_unencodable_output_ends_only_that_request(self, stage_client: StageClient) -> None:
        bad = stage_client.add("bad", 10_000_000)
        good = stage_client.add("good", 5)
        stage_client.call_utility("poison", "bad", timeout=5)
        with pytest.raises(RequestError, match="not wire-encodable") as info:
            bad.collect(timeout=5)
        assert info.value.req_id == "bad"
        with pytest.raises(RequestError):  # the stream stays ended
            bad.get(0)
        assert good.collect(timeout=5)[-1] == 0
        # The stage aborted the poisoned request so the engine stops working on it.
        assert stage_client.call_utility("log", timeout=5)[-1] == "abort bad"

    @pytest.mark.parametrize(
        "kind", ["int_too_big", "int_too_small", "int_subclass", "nested", "surrogate"]
    )
    def test_each_kind_of_unencodable_output_ends_only_its_request(
        self, stage_client: StageClient, kind: str
    ) -> None:
        # Outputs take a fast path for exact scalars; everything else is checked in full.
        bad = stage_client.add("bad", 10_000_000)
        good = stage_client.add("good", 5)
        stage_client.call_utility("poison", "bad", kind, timeout=5)
        with pytest.raises(RequestError) as info:
            bad.collect(timeout=5)
        assert info.value.req_id == "bad"
        assert good.collect(timeout=5)[-1] == 0
        assert stage_client.call_utility("log", timeout=5)[-1] == "abort bad"

    @pytest.mark.parametrize("kind", ["int_too_big", "int_too_small", "surrogate", "set"])
    def test_no_output_follows_the_error_of_an_unencodable_output(
        self, stage_client: StageClient, kind: str
    ) -> None:
        # msgspec refuses the first three only on the output thread, after the loop has
        # stepped the request again: those outputs must not follow the error (found by
        # the soak; thousands did).
        stage_client.add("bad", 100_000, stream=False)
        stage_client.call_utility("poison", "bad", kind, timeout=5)
        stage_client.call_utility("sleep", 0.1, timeout=5)  # many more steps meanwhile
        stage_client.abort(["bad"])  # its aborted event ends the stream of events
        seen_error, after_error = False, 0
        while True:
            event = stage_client.get_event(timeout=5)
            if isinstance(event, ErrorReport) and event.req_id == "bad":
                seen_error = True
            elif isinstance(event, Outputs) and seen_error:
                after_error += event.req_ids.count("bad")
            elif isinstance(event, Aborted):
                break
        assert seen_error
        assert after_error == 0
        # The id is free again, and a new request of it is not filtered.
        assert stage_client.add("bad", 3).collect(timeout=5) == [2, 1, 0]

    @pytest.mark.parametrize(
        "payload", [2**64 - 1, -(2**63), 7, True, False, None, 1.5, "é", b"\x00", [1, "a"]]
    )
    def test_edge_payloads_pass_the_output_fast_path(
        self, stage_client: StageClient, payload: object
    ) -> None:
        stage_client.call_utility("payload", "r", payload, timeout=5)  # r's first payload
        got = stage_client.add("r", 3).collect(timeout=5)
        assert got == [payload, 1, 0]
        assert type(got[0]) is type(payload)

    def test_utility_result_that_fails_only_in_msgspec_is_reported(
        self, stage_client: StageClient
    ) -> None:
        with pytest.raises(UtilityError, match="surrogate"):
            stage_client.call_utility("unencodable_result", "surrogate", timeout=5)
        assert stage_client.call_utility("echo", 1, timeout=5) == [1]

    def test_unencodable_utility_result_is_reported(self, stage_client: StageClient) -> None:
        with pytest.raises(UtilityError, match=r"TypeError.*builtins\.set is not wire-encodable"):
            stage_client.call_utility("unencodable_result", timeout=5)


ARRAYS = [
    np.arange(10, dtype=np.float32),  # inline (< 1 KiB)
    np.arange(100_000, dtype=np.float64).reshape(100, 1000),  # out of band
    np.array(3.5),  # 0-d
    np.zeros((0, 4), dtype=np.int16),  # empty
    np.array([True, False]),
    np.array(["ab", "c"]),
    np.arange(6, dtype=np.complex128).reshape(3, 2).T,  # not contiguous: sent as a copy
    np.array([1, 2], dtype="datetime64[ns]"),
]


class TestArrays:
    @pytest.mark.parametrize("arr", ARRAYS, ids=lambda a: f"{a.dtype.str}{list(a.shape)}")
    def test_arrays_round_trip_as_request_data_and_outputs(
        self, launch: Launch, arr: np.ndarray[Any, Any]
    ) -> None:
        client = launch(ECHO)
        (got,) = client.add("r", {"x": arr, "n": 1}).collect(timeout=10)
        assert got["n"] == 1
        back = got["x"]
        assert isinstance(back, np.ndarray)
        assert back.dtype == arr.dtype
        assert back.shape == arr.shape
        assert np.array_equal(back, arr)
        assert not back.flags.writeable  # a view on the received frame

    def test_arrays_and_buffers_as_utility_arguments(self, launch: Launch) -> None:
        client = launch(ECHO)
        big = bytes(range(256)) * 8
        arr = np.arange(1000, dtype=np.uint16)
        got = client.call_utility("echo", arr, big, bytearray(b"ba"), memoryview(big), timeout=10)
        assert np.array_equal(got[0], arr)
        assert got[1] == big
        assert type(got[1]) is bytes
        assert bytes(got[2]) == b"ba"
        assert type(got[2]) is memoryview
        assert bytes(got[3]) == big
        assert got[3].readonly

    def test_numpy_scalars_travel_as_python_values(self, launch: Launch) -> None:
        client = launch(ECHO)
        (got,) = client.add("r", [np.float32(1.5), np.int64(-3), np.bool_(True)]).collect(10)
        assert got == [1.5, -3, True]
        assert [type(x) for x in got] == [float, int, bool]

    def test_many_arrays_in_one_add_many(self, launch: Launch) -> None:
        client = launch(ECHO)
        arrs = [np.full(500 * (i + 1), i, dtype=np.int32) for i in range(5)]
        streams = client.add_many([(f"r{i}", a) for i, a in enumerate(arrs)])
        for a, stream in zip(arrs, streams, strict=True):
            (back,) = stream.collect(timeout=10)
            assert np.array_equal(back, a)


class TestClose:
    def test_calls_after_close_raise_closed(self, stage_client: StageClient) -> None:
        assert stage_client.shutdown() == 0
        assert stage_client.closed
        with pytest.raises(StageClosedError):
            stage_client.add("r", 1)
        with pytest.raises(StageClosedError):
            stage_client.add_many([("r", 1)])
        with pytest.raises(StageClosedError):
            stage_client.call_utility("echo")
        with pytest.raises(StageClosedError):
            stage_client.call_utility_future("echo").result(5)
        with pytest.raises(StageClosedError):
            stage_client.abort(["r"])
        assert stage_client.shutdown() == 0  # idempotent

    def test_shutdown_applies_everything_sent_before_it(self, launch: Launch) -> None:
        # Sent right after launch, racing the stage's start: still all applied, in order.
        client = launch(COUNTDOWN)
        futures = [client.call_utility_future("div", i, 1) for i in range(20)]
        assert client.shutdown() == 0
        assert [f.result(0) for f in futures] == [float(i) for i in range(20)]

    @pytest.mark.parametrize("timeout", [-1.0, float("nan"), float("inf"), "5", None])
    def test_an_invalid_shutdown_timeout_raises_before_anything(
        self, stage_client: StageClient, timeout: Any
    ) -> None:
        # Before, -1 sent SIGTERM at once ("ignored shutdown"), and NaN, inf or a str raised
        # an unrelated error halfway through the close (the asyncio client's, again at
        # every later shutdown(), with a "never awaited" warning).
        error = ValueError if isinstance(timeout, float) else TypeError
        with pytest.raises(error, match="timeout must be a"):
            stage_client.shutdown(timeout)
        assert stage_client.call_utility("echo", 1, timeout=5) == [1]
        assert stage_client.shutdown() == 0

    def test_a_utilitys_own_loop_ended_error_reaches_its_caller(
        self, stage_client: StageClient
    ) -> None:
        # The stage drops the loop's answers to calls it never applied (rule 17) and ends
        # those calls its own way; it told them apart by their text, so a utility's own
        # LoopEndedError that read the same was dropped, and its caller waited until its
        # timeout.
        message = "the engine loop ended before it applied utility 'mimic' (call 1)"
        with pytest.raises(UtilityError, match="LoopEndedError") as info:
            stage_client.call_utility("raise_loop_ended", message, timeout=10)
        assert "applied utility 'mimic'" in str(info.value)
        assert stage_client.call_utility("echo", 1, timeout=5) == [1]

    def test_waiters_get_closed_error(self, stage_client: StageClient) -> None:
        stream = stage_client.add("long", 10_000_000)
        stream.get(5)
        assert stage_client.shutdown() == 0
        with pytest.raises(StageClosedError):
            stream.collect(timeout=5)
        with pytest.raises(StageClosedError):
            stream.get(0)  # and stays so

    def test_shutdown_escalates_to_sigterm_then_sigkill(self, stage_client: StageClient) -> None:
        # The loop is stuck in a 30 s utility: the shutdown message cannot be applied, and
        # SIGTERM only sets a flag the loop cannot look at, so only SIGKILL ends it.
        future = stage_client.call_utility_future("sleep", 30)
        assert stage_client.shutdown(timeout=0.2) == -9
        with pytest.raises(StageClosedError):
            future.result(5)
        # The stage never sent its last event: the event stream ends with the close.
        with pytest.raises(StageClosedError):
            list(stage_client.events())

    def test_ipc_dir_is_private_and_removed(self, launch: Launch, no_leftovers: str) -> None:
        import os
        import stat

        client = launch(COUNTDOWN)
        ipc_dir = os.path.dirname(client.address.removeprefix("ipc://"))
        assert ipc_dir.startswith(no_leftovers)
        assert stat.S_IMODE(os.stat(ipc_dir).st_mode) == 0o700
        client.close()
        assert not os.path.exists(ipc_dir)


@pytest.mark.parametrize(
    ("interval", "timeout", "error"),
    [
        (float("nan"), 5.0, ValueError),
        (1.0, float("nan"), ValueError),  # a silent stage would never be presumed dead
        (1.0, float("inf"), ValueError),
        (0, 5.0, ValueError),
        (2.0, 1.0, ValueError),
        ("1", 5.0, TypeError),
        (1.0, None, TypeError),
        (True, 5.0, TypeError),
    ],
    ids=["nan-interval", "nan-timeout", "inf-timeout", "zero", "order", "str", "none", "bool"],
)
def test_bad_heartbeats_are_refused_before_connecting(
    connect: Connect, interval: Any, timeout: Any, error: type[Exception]
) -> None:
    with pytest.raises(error, match="heartbeat_"):
        connect("tcp://127.0.0.1:1", heartbeat_interval=interval, heartbeat_timeout=timeout)


@pytest.mark.parametrize(
    ("address", "timeout", "error", "message"),
    [
        # A non-str address left the client's own sockets open: the context's term() in
        # the cleanup then waited for them for ever.
        (5, 1.0, TypeError, "address must be a str"),
        (b"tcp://127.0.0.1:1", 1.0, TypeError, "address must be a str"),
        # A negative handshake timeout was a TimeoutError "in -1 s", NaN or a str an
        # unrelated error from inside the handshake.
        ("tcp://127.0.0.1:1", -1.0, ValueError, "timeout must be a number of seconds > 0"),
        ("tcp://127.0.0.1:1", float("nan"), ValueError, "timeout must be"),
        ("tcp://127.0.0.1:1", float("inf"), ValueError, "timeout must be"),
        ("tcp://127.0.0.1:1", "1", TypeError, "timeout must be"),
        # A malformed address was libzmq's bare ZMQError "Invalid argument"; a port past
        # 65535 was taken modulo 65536 (99999: port 34463), then only timed out.
        ("nonsense", 1.0, ValueError, "must start with tcp:// or ipc://, got 'nonsense'"),
        ("tcp://127.0.0.1", 1.0, ValueError, "must look like tcp://HOST:PORT"),
        ("tcp://127.0.0.1:99999", 1.0, ValueError, "a port is 1 to 65535"),
        ("tcp://127.0.0.1:0", 1.0, ValueError, "a port is 1 to 65535"),
        ("tcp://::1:5570", 1.0, ValueError, r"brackets: tcp://\[::1\]:5570"),
        ("tcp://*:5570", 1.0, ValueError, "connect to a host"),
        ("ipc://", 1.0, ValueError, "empty ipc path"),
    ],
    ids=[
        "int-address",
        "bytes-address",
        "negative",
        "nan",
        "inf",
        "str-timeout",
        "no-scheme",
        "no-port",
        "port-past-65535",
        "port-0",
        "bare-ipv6",
        "wildcard",
        "empty-ipc",
    ],
)
def test_a_bad_address_or_timeout_is_refused_before_connecting(
    connect: Connect, address: Any, timeout: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        connect(address, timeout=timeout)


@pytest.mark.parametrize("how", ["sync-timeout", "async-timeout", "async-cancel"])
def test_a_connect_given_up_while_its_hello_is_held_leaves_no_session(
    no_leftovers: str, how: str
) -> None:
    """A one-client stage holds a hello while the previous client's PULL is connected. The
    connect that sent it gave up (its timeout; a cancel: asyncio.timeout, a TaskGroup) and
    closed its sockets without a word: the stage welcomed the held hello once that PULL
    went, and the ghost session kept every other client out ("another client is attached")
    for the session timeout. Now it says bye as it gives up."""
    srv = Server("--engine", SCRIPTED, "--bind", "tcp://127.0.0.1:*", "--session-timeout", "1")
    try:
        with RawClient(srv.address) as silent:
            assert silent.hello()[0] == "welcome"
            time.sleep(1.2)  # silent past the session timeout, its PULL still connected
            if how == "sync-timeout":
                with pytest.raises(TimeoutError):
                    StageClient.connect(srv.address, timeout=0.5)  # held for up to 5 s
            else:

                async def give_up() -> None:
                    if how == "async-timeout":
                        with pytest.raises(TimeoutError):
                            await AsyncStageClient.connect(srv.address, timeout=0.5)
                        return
                    connecting = asyncio.ensure_future(
                        AsyncStageClient.connect(srv.address, timeout=30)
                    )
                    await asyncio.sleep(0.3)  # its hello is held (for up to 5 s)
                    assert not connecting.done()
                    connecting.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await connecting

                asyncio.run(give_up())
        # The silent client's PULL is gone: a held hello would be welcomed now.
        with StageClient.connect(srv.address, timeout=10) as client:
            assert client.call_utility("echo", 1, timeout=10) == [1]
    finally:
        srv.stop()


class TestConnectedStage:
    """A client of a headless stage (``python -m enginecore serve``), through each client:
    these were tested with the blocking client only (``test_serve.py``)."""

    def test_second_client_is_rejected_while_one_is_attached(
        self, connect: Connect, server: Server
    ) -> None:
        client = connect(server.address)
        with pytest.raises(ProtocolError, match="another client is attached"):
            connect(server.address)
        assert client.call_utility("echo", 1, timeout=5) == [1]

    def test_shutdown_from_the_client_stops_the_server(
        self, connect: Connect, server: Server
    ) -> None:
        client = connect(server.address)
        assert client.add("r", 1).collect(timeout=5) == [0]
        assert client.shutdown() is None  # no process to read an exit code from
        assert server.proc.wait(5) == 0
        with pytest.raises(StageClosedError):
            client.add("x", 1)
        assert client.shutdown() is None  # idempotent

    def test_sigterm_to_the_server_is_seen_as_death(self, connect: Connect, server: Server) -> None:
        client = connect(server.address)
        stream = client.add("r", 1_000_000_000)
        stream.get(5)
        server.proc.send_signal(signal.SIGTERM)
        with pytest.raises(EngineDeadError, match="not at this client's request"):
            stream.collect(timeout=5)
        with pytest.raises(EngineDeadError, match="not at this client's request"):
            client.call_utility("echo", 1, timeout=5)
        assert client.health() == "dead"
        assert server.proc.wait(5) == 0

    def test_a_clients_close_aborts_its_requests(self, connect: Connect, server: Server) -> None:
        first = connect(server.address)
        first.add("big", 10**8).get(5)
        first.close()
        second = connect(server.address)
        assert second.call_utility("log", timeout=5) == ["add big", "abort big"]
        # The id is free again: the request is gone from the stage.
        assert second.add("big", 2).collect(timeout=5) == [1, 0]

    def test_answer_to_a_detached_clients_call_does_not_resolve_the_next_clients_call(
        self, connect: Connect, server: Server
    ) -> None:
        # The caller's call fails at its close; the stage drops the answer (it is the
        # previous session's), so the next client's calls are answered as their own.
        first = connect(server.address)
        pending = first.call_utility_future("sleep", 0.5)
        first.close()
        with pytest.raises(StageClosedError):
            pending.result(5)
        second = connect(server.address)
        assert second.call_utility("echo", "second", timeout=5) == ["second"]
