"""ClientSession without IO: frames built with msgspec, a clock passed in, no process.

Like h11's ``test_connection.py``: what each frame means for the streams and calls in flight,
when the stage counts as gone, and what the frames a client sends look like.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from enginecore.stage import (
    Aborted,
    EngineDeadError,
    Outputs,
    RequestError,
    SessionLostError,
    Shutdown,
    StageClosedError,
    StageHealth,
    UtilityError,
    UtilityResult,
)
from enginecore.stage._codec import Decoder
from enginecore.stage._session import (
    ABORTED,
    EXIT_AFTER_LAST_EVENT_S,
    EXIT_GRACE_S,
    EXIT_READ_MAX_S,
    FINISHED,
    ClientSession,
    Deliveries,
    End,
    StageState,
    StreamCore,
)


class _Str(str):
    """A subclass of str: not a wire type."""


class _Pair(NamedTuple):
    req_id: str
    data: Any


class Waiter:
    """A utility call's waiter, as the clients' futures are."""

    def __init__(self) -> None:
        self.result: Any = None
        self.exc: BaseException | None = None


Session = ClientSession[StreamCore, Waiter]
D = Deliveries[StreamCore, Waiter]


def session(
    *,
    launched: bool = True,
    heartbeat: tuple[float, float | None] | None = None,
    ordered_events: bool = False,
    now: float = 100.0,
) -> Session:
    return ClientSession(
        pid=42,
        address="tcp://127.0.0.1:5570",
        launched=launched,
        heartbeat=heartbeat,
        ordered_events=ordered_events,
        now=now,
    )


def frame(*events: list[Any]) -> list[bytes]:
    """One message from the stage: a body listing *events*, no buffers."""
    return [msgspec.msgpack.encode(list(events))]


def outputs(*triples: tuple[str | None, bool, Any]) -> list[Any]:
    return ["outputs", [t[0] for t in triples], [t[1] for t in triples], [t[2] for t in triples]]


def open_streams(s: Session, *req_ids: str) -> list[StreamCore]:
    streams = [StreamCore(rid) for rid in req_ids]
    s.open_requests(list(req_ids), streams)
    return streams


def decode(parts: list[Any]) -> Any:
    return Decoder(strict=True).decode(parts)


def received(s: Session, parts: list[bytes], now: float = 100.0) -> D:
    return s.receive(parts, now)


class TestRouting:
    def test_outputs_go_to_their_streams_and_finished_ends_one(self) -> None:
        s = session()
        a, b = open_streams(s, "a", "b")
        received(s, frame(outputs(("a", False, 2), ("b", False, "x"), ("a", True, 0))))
        assert list(a._buf) == [2, 0, FINISHED]
        assert list(b._buf) == ["x"]
        assert set(s.streams) == {"b"}  # a ended: forgotten, its id free again
        open_streams(s, "a")

    def test_a_waiting_consumer_is_woken_once_per_frame(self) -> None:
        s = session()
        a, b = open_streams(s, "a", "b")
        assert not a._take(wait=True)  # its consumer waits
        d = received(s, frame(outputs(("a", False, 3), ("a", False, 2)), outputs(("a", False, 1))))
        assert d.wake == [a]  # once, though three outputs came
        assert not a._waiting
        assert list(a._buf) == [3, 2, 1]
        assert received(s, frame(outputs(("a", False, 0)))).wake == []  # nobody waits now
        assert list(b._buf) == []

    def test_unrouted_unknown_and_streamless_outputs_are_dropped(self) -> None:
        s = session(ordered_events=True)
        (a,) = open_streams(s, "a")
        s.open_requests(["quiet"], None)  # stream=False: only the event stream sees it
        ev = outputs((None, False, "tick"), ("quiet", False, 1), ("gone", True, 0), ("a", False, 5))
        d = received(s, frame(ev))
        assert list(a._buf) == [5]
        assert d.wake == []
        assert s.events is not None
        assert list(s.events) == [
            Outputs([None, "quiet", "gone", "a"], [False, False, True, False], ["tick", 1, 0, 5])
        ]

    def test_aborted_ends_the_streams_it_lists(self) -> None:
        s = session()
        a, b = open_streams(s, "a", "b")
        assert not b._take(wait=True)  # its consumer waits
        d = received(s, frame(["aborted", ["b", "unknown"]]))
        assert list(b._buf) == [ABORTED]
        assert d.wake == [b]
        assert list(a._buf) == []
        assert set(s.streams) == {"a"}

    def test_request_scoped_error_ends_only_that_stream(self) -> None:
        s = session()
        a, _b = open_streams(s, "a", "b")
        d = received(s, frame(["error", "a", "output cannot be encoded"]))
        (end,) = a._buf
        assert isinstance(end, End)
        assert isinstance(end.exc, RequestError)
        assert end.exc.req_id == "a"
        assert "output cannot be encoded" in str(end.exc)
        assert set(s.streams) == {"b"}
        assert d.warnings == []

    def test_errors_nobody_else_sees_become_warnings(self) -> None:
        s = session()
        d = received(s, frame(["error", None, "bad frame"], ["error", "gone", "late"]))
        assert d.warnings == [
            "the stage reported a protocol error: bad frame",
            "the stage reported: request 'gone': late",
        ]
        # With the event stream on, its reader sees a request's report: no warning.
        s = session(ordered_events=True)
        d = received(s, frame(["error", "gone", "late"]))
        assert d.warnings == []


class TestAbortAnswers:
    """The stage answers every ``abort`` with one ``aborted``, known id or not, in order with
    its other events (docs/wire.md section 5). An answer to an abort of a request that has
    ended since (finished, failed) must not end a request added again with the same id
    before the answer came."""

    def test_an_answer_ends_the_request_it_was_sent_for(self) -> None:
        s = session()
        (a,) = open_streams(s, "a")
        s.note_abort(["a"])
        received(s, frame(["aborted", ["a"]]))
        assert list(a._buf) == [ABORTED]
        assert s._aborts_due == s._aborts_stale == {}

    def test_an_abort_of_an_ended_id_does_not_end_the_id_added_again(self) -> None:
        s = session()
        (a1,) = open_streams(s, "a")
        received(s, frame(outputs(("a", True, 0))))  # a ended: its id is free
        s.note_abort(["a"])  # too late, sent anyway: the stage answers it all the same
        (a2,) = open_streams(s, "a")  # the id again, before the answer came
        received(s, frame(["aborted", ["a"]], outputs(("a", False, 1))))
        assert list(a1._buf) == [0, FINISHED]
        assert list(a2._buf) == [1]  # live, and still routed to
        assert s.streams == {"a": a2}
        assert s._aborts_due == s._aborts_stale == {}

    @pytest.mark.parametrize("how", ["finished", "error"])
    def test_a_request_that_ends_before_its_abort_is_applied(self, how: str) -> None:
        s = session()
        (a1,) = open_streams(s, "a")
        s.note_abort(["a"])  # sent while a was live...
        end = outputs(("a", True, 0)) if how == "finished" else ["error", "a", "it failed"]
        received(s, frame(end))  # ...but it ended first
        assert list(a1._buf)[-1] is not ABORTED
        (a2,) = open_streams(s, "a")
        received(s, frame(["aborted", ["a"]]))  # the answer: to the abort of a1
        assert list(a1._buf)[-1] is not ABORTED
        assert a2._buf == []
        assert s.streams == {"a": a2}
        s.note_abort(["a"])  # a2's own abort ends a2
        received(s, frame(["aborted", ["a"]]))
        assert list(a2._buf) == [ABORTED]
        assert s._aborts_due == s._aborts_stale == {}

    def test_two_aborts_of_one_request_the_second_answer_ends_nothing(self) -> None:
        s = session()
        (a1,) = open_streams(s, "a")
        s.note_abort(["a"])
        s.note_abort(["a"])
        received(s, frame(["aborted", ["a"]]))  # the first answer ends a1
        assert list(a1._buf) == [ABORTED]
        (a2,) = open_streams(s, "a")
        received(s, frame(["aborted", ["a"]]))  # the second answers a1's abort too
        assert a2._buf == []
        assert s.streams == {"a": a2}

    def test_an_abort_that_could_not_be_sent_is_not_waited_for(self) -> None:
        s = session()
        (a,) = open_streams(s, "a")
        s.note_abort(["a"])
        s.unnote_abort(["a"])
        received(s, frame(outputs(("a", True, 0))))
        assert list(a._buf) == [0, FINISHED]
        assert s._aborts_due == s._aborts_stale == {}
        s.note_abort(["a"])  # stale from the start: a has ended
        s.unnote_abort(["a"])
        assert s._aborts_due == s._aborts_stale == {}

    def test_an_unsent_second_abort_of_an_ended_id_leaves_nothing_stale_behind(self) -> None:
        s = session()
        s.note_abort(["a"])  # no live "a": both answers would be stale...
        s.note_abort(["a"])
        s.unnote_abort(["a"])  # ...but the second could not be sent: one answer comes
        received(s, frame(["aborted", ["a"]]))
        assert s._aborts_due == s._aborts_stale == {}
        (a,) = open_streams(s, "a")
        s.note_abort(["a"])  # a's own abort ends a
        received(s, frame(["aborted", ["a"]]))
        assert list(a._buf) == [ABORTED]

    def test_a_pool_members_request_without_a_stream_added_again(self) -> None:
        s: Session = ClientSession(
            pid=42,
            address="ipc:///x",
            launched=True,
            heartbeat=None,
            ordered_events=True,
            now=100.0,
            adopt_orphans=True,  # as a pool's member: it tracks requests without a stream
        )
        s.open_requests(["a"], None)
        s.note_abort(["a"])
        received(s, frame(outputs(("a", True, 0))))  # finished before the abort came
        assert dict(s.quiet) == {}
        s.open_requests(["a"], None)  # the id again
        received(s, frame(["aborted", ["a"]]))  # the answer to the first one's abort
        assert dict(s.quiet) == {"a": 0}
        s.note_abort(["a"])
        received(s, frame(["aborted", ["a"]]))
        assert dict(s.quiet) == {}

    def test_answers_not_noted_here_end_the_streams_they_list(self) -> None:
        # A pipeline's stage answers aborts it chased itself, and the coordinator's tagged
        # and fenced aborts are not noted: those answers go by the id alone, as before.
        s = session()
        a, b = open_streams(s, "a", "b")
        s.note_abort(["a"])
        received(s, frame(["aborted", ["b"]], ["aborted", ["a"], False, 7]))
        assert list(a._buf) == [ABORTED]
        assert list(b._buf) == [ABORTED]

    def test_the_event_stream_still_gets_every_answer(self) -> None:
        s = session(ordered_events=True)
        open_streams(s, "a")
        received(s, frame(outputs(("a", True, 0))))
        s.note_abort(["a"])
        received(s, frame(["aborted", ["a"]]))
        assert s.events is not None
        assert list(s.events)[-1] == Aborted(["a"])

    def test_a_failure_forgets_the_answers_due(self) -> None:
        s = session(launched=False)
        open_streams(s, "a")
        s.note_abort(["a", "b"])
        received(s, frame(["shutdown"]))
        assert s.state is StageState.GONE
        assert s._aborts_due == s._aborts_stale == {}

    @given(
        st.lists(
            st.sampled_from(["add", "abort", "finish", "fail", "answer"]), min_size=1, max_size=40
        )
    )
    def test_against_a_model_every_answer_ends_only_its_own_request(self, ops: list[str]) -> None:
        # One id, used again and again. The model: the stage, which answers each abort in
        # order, and for each abort the request (its stream) that was live when it was sent.
        s = session()
        live: StreamCore | None = None  # the client's live request of the id
        pending: list[StreamCore | None] = []  # one per abort sent and not answered: whose
        aborted: list[StreamCore] = []  # the streams an answer ended
        for op in ops:
            if op == "add" and live is None:
                (live,) = open_streams(s, "a")
            elif op == "abort":
                s.note_abort(["a"])
                pending.append(live)
            elif op in ("finish", "fail") and live is not None:
                end = outputs(("a", True, 0)) if op == "finish" else ["error", "a", "failed"]
                received(s, frame(end))
                live = None
            elif op == "answer" and pending:
                target = pending.pop(0)
                received(s, frame(["aborted", ["a"]]))
                if target is not None and target is live:
                    aborted.append(target)
                    live = None
                if live is not None:
                    assert s.streams == {"a": live}, "an answer ended a later request"
        for stream in aborted:
            assert list(stream._buf)[-1] is ABORTED
        if live is not None:
            assert live._buf == []
        for _ in pending:  # the answers still to come
            received(s, frame(["aborted", ["a"]]))
        assert s._aborts_due == s._aborts_stale == {}


class Unenterable:
    """A stream lock that fails the test if it is taken."""

    def __enter__(self) -> None:
        raise AssertionError("the lock was taken")

    def __exit__(self, *exc: object) -> None:
        pass


class TestTakeEnded:
    """``collect()``'s fast path: everything at once, only once the end has arrived."""

    def test_an_ended_stream_is_taken_whole(self) -> None:
        s = session()
        (a,) = open_streams(s, "a")
        s.receive(frame(outputs(("a", False, 1), ("a", True, 0))), 1.0)
        assert a._take_ended() == [1, 0]
        assert a.finished
        assert a._take_ended() is None  # kept end: the slow path returns [] from now on

    def test_an_ended_stream_is_taken_without_its_lock(self) -> None:
        # The receiver never touches a buffer again once it ends with an End, so the fast
        # path need not wait for the receiver's lock (held while it dispatches a frame).
        s = session()
        a = StreamCore("a", lock=Unenterable())
        s.open_requests(["a"], [a])
        s.receive(frame(outputs(("a", False, 1), ("a", True, 0))), 1.0)
        got = a._take_ended()
        assert got == [1, 0]
        assert not a._buf
        assert a._buf is not got  # the list handed out is not the stream's
        assert a.finished

    def test_an_ended_stream_keeps_no_container_of_its_own(self) -> None:
        # A burst ends thousands of streams: each ended one shares its empty buffer and its
        # kept end (one object fewer each for the cyclic GC), and the shared buffer is a
        # tuple, so an append after the end fails instead of reaching every stream.
        s = session()
        a, b = open_streams(s, "a", "b")
        s.receive(frame(outputs(("a", True, 0), ("b", True, 0))), 1.0)
        assert a._take_ended() == [0]
        assert b._take_ended() == [0]
        assert a._buf is b._buf
        assert a._ready is b._ready
        with pytest.raises(AttributeError):
            a._buf.append(1)
        assert a._take(wait=False) is False
        assert a.finished
        assert b.finished

    def test_a_stream_without_its_end_is_left_alone(self) -> None:
        s = session()
        (a,) = open_streams(s, "a")
        s.receive(frame(outputs(("a", False, 1))), 1.0)
        assert a._take_ended() is None
        assert a._buf == [1]  # nothing taken

    def test_an_error_end_raises_and_drops_the_payloads(self) -> None:
        s = session()
        (a,) = open_streams(s, "a")
        s.receive(frame(outputs(("a", False, 1)), ["error", "a", "boom"]), 1.0)
        with pytest.raises(RequestError, match="boom"):
            a._take_ended()
        with pytest.raises(RequestError, match="boom"):  # kept for every later read
            a._take_all([])

    def test_not_while_the_consumer_has_payloads_in_hand(self) -> None:
        s = session()
        (a,) = open_streams(s, "a")
        s.receive(frame(outputs(("a", False, 2))), 1.0)
        assert a._take(wait=False)  # the consumer took [2] and has not read it
        s.receive(frame(outputs(("a", True, 1))), 2.0)
        assert a._take_ended() is None  # order: 2 must come before 1
        out: list[Any] = []
        assert a._take_all(out)
        assert out == [2, 1]


class TestUtilities:
    def test_answers_are_matched_by_call_id(self) -> None:
        s = session()
        w1, w2 = Waiter(), Waiter()
        s.open_call(7, w1, "div")
        s.open_call(8, w2, "div")
        d = received(
            s, frame(["utility", 8, None, "ZeroDivisionError()"], ["utility", 7, 0.5, None])
        )
        (first, result2, exc2), (second, result1, exc1) = d.answers
        assert (first, result2) == (w2, None)
        assert isinstance(exc2, UtilityError)
        assert exc2.name == "div"
        assert exc2.remote_repr == "ZeroDivisionError()"
        assert (second, result1, exc1) == (w1, 0.5, None)
        assert s.calls == {}

    def test_an_unknown_call_id_is_ignored(self) -> None:
        # A detached client's call, answered after this client attached; or a timed-out one.
        s = session()
        w = Waiter()
        s.open_call(1, w, "echo")
        s.forget_call(1)
        d = received(s, frame(["utility", 1, "late", None], ["utility", 99, "stray", None]))
        assert d.answers == []

    def test_call_ids_are_consecutive_from_a_random_start_below_2_53(self) -> None:
        starts = set()
        for _ in range(20):
            s = session()
            first = s.new_call_id()
            assert 1 <= first <= 2**52
            assert [s.new_call_id() for _ in range(3)] == [first + 1, first + 2, first + 3]
            starts.add(first)
        assert len(starts) > 1


class TestEventStream:
    def test_pong_is_filtered_out_and_counts_as_a_sign_of_life(self) -> None:
        s = session(launched=False, heartbeat=(1.0, 5.0), ordered_events=True)
        d = s.receive(frame(["pong", 0], ["utility", 5, 1, None]), 103.0)
        assert s.events is not None
        assert list(s.events) == [UtilityResult(5, 1, None)]
        assert not d.wake_events
        assert s.last_heard == 103.0
        s.receive(frame(["pong", 1]), 104.0)
        assert len(s.events) == 1

    def test_the_events_of_a_frame_are_one_hand_off(self) -> None:
        s = session(ordered_events=True)
        s.wait_for_events()
        d = received(s, frame(outputs(("a", False, 1)), ["aborted", ["a"]]))
        assert d.wake_events
        assert not s.events_waiting
        assert s.events is not None
        assert list(s.events) == [Outputs(["a"], [False], [1]), Aborted(["a"])]
        assert not received(s, frame(["aborted", ["b"]])).wake_events  # nobody waits now

    def test_off_by_default(self) -> None:
        s = session()
        received(s, frame(outputs(("a", False, 1))))
        assert s.events is None
        with pytest.raises(RuntimeError, match="ordered_events=True"):
            s.open_requests(["a"], None)


class TestState:
    """The state is read through properties and changed only through the session's methods
    (as h11's ``our_state``)."""

    @pytest.mark.parametrize(
        "name",
        [
            "streams",
            "calls",
            "state",
            "failure",
            "closing",
            "events",
            "events_waiting",
            "events_end",
            "last_heard",
            "release_due",
        ],
    )
    def test_is_read_only_from_outside(self, name: str) -> None:
        s = session(ordered_events=True)
        before = getattr(s, name)
        with pytest.raises(AttributeError):
            setattr(s, name, before)

    def test_register_streams_registers_without_checks_and_cancel_forgets(self) -> None:
        s = session()
        a, b = StreamCore("a"), StreamCore("b")
        s.register_streams(["a", "b"], [a, b])
        assert dict(s.streams) == {"a": a, "b": b}
        received(s, frame(outputs(("b", True, 1))))
        assert list(b._buf) == [1, FINISHED]
        s.cancel_streams(["a", "unknown"])
        assert dict(s.streams) == {}

    def test_waiting_for_events_is_cleared_by_the_next_event_or_by_the_consumer(self) -> None:
        s = session(ordered_events=True)
        assert not s.events_waiting
        s.wait_for_events()
        assert s.events_waiting
        s.stop_waiting_for_events()  # the consumer timed out
        assert not s.events_waiting
        assert not received(s, frame(["aborted", ["a"]])).wake_events
        s.wait_for_events()
        assert received(s, frame(["aborted", ["b"]])).wake_events
        assert not s.events_waiting

    def test_release_due_after_a_heartbeat_death_until_released(self) -> None:
        s = session(launched=False, heartbeat=(1.0, 5.0), now=0.0)
        assert not s.release_due
        assert s.tick(5.0)[2] is not None
        assert s.release_due
        s.released()
        assert not s.release_due

    def test_no_release_due_when_the_client_was_closing(self) -> None:
        s = session(launched=False, heartbeat=(1.0, 5.0), now=0.0)
        s.begin_close()
        assert s.closing
        assert s.tick(5.0)[2] is not None
        assert not s.release_due


class TestStreamCoreReceiverSide:
    def test_route_appends_ends_finished_streams_and_wakes_each_waiter_once(self) -> None:
        a, b, c = StreamCore("a"), StreamCore("b"), StreamCore("c")
        assert not a._take(wait=True)  # a's consumer waits; b's and c's do not
        streams = {"a": a, "b": b, "c": c}
        wake: list[StreamCore] = []
        StreamCore._route(
            streams, ["a", "x", "b", "a"], [False, False, True, False], [1, 2, 3, 4], wake, 1.0
        )
        assert wake == [a]
        assert not a._waiting
        assert list(a._buf) == [1, 4]
        assert list(b._buf) == [3, FINISHED]
        assert list(c._buf) == []
        assert set(streams) == {"a", "c"}

    def test_end_with_appends_the_end_and_says_whether_the_consumer_waited(self) -> None:
        a, b = StreamCore("a"), StreamCore("b")
        assert not a._take(wait=True)
        assert a._end_with(ABORTED, 1.0)
        assert not a._waiting
        assert not b._end_with(FINISHED, 1.0)
        assert list(a._buf) == [ABORTED]
        assert list(b._buf) == [FINISHED]


class TestLastEvent:
    def test_connected_stage_ends_with_its_last_event(self) -> None:
        s = session(launched=False)
        (a,) = open_streams(s, "a")
        d = received(s, frame(["shutdown"]))
        assert d.over
        assert isinstance(s.failure, EngineDeadError)
        assert "it shut down, but not at this client's request" in str(s.failure)
        assert s.state is StageState.GONE
        assert a._buf[0].exc is s.failure

    def test_connected_stage_fatal(self) -> None:
        s = session(launched=False)
        received(s, frame(["fatal", "RuntimeError('boom')"]))
        assert isinstance(s.failure, EngineDeadError)
        assert s.failure.fatal == "RuntimeError('boom')"
        assert "its engine loop died" in str(s.failure)

    def test_our_own_shutdown_of_a_connected_stage_ends_cleanly(self) -> None:
        s = session(launched=False, ordered_events=True)
        assert s.begin_close()
        received(s, frame(["shutdown"]))
        assert isinstance(s.failure, StageClosedError)
        assert s.events is not None
        assert list(s.events) == [Shutdown(), s.events_end]
        assert s.events_end is not None
        assert s.events_end.exc is None

    def test_our_own_close_without_the_last_event_ends_the_event_stream_with_its_error(
        self,
    ) -> None:
        # A clean end (StopIteration) only once the stage's last event came: a close that
        # gave up before it is the event stream's error.
        s = session(launched=False, ordered_events=True)
        assert s.begin_close()
        s.fail(s.closed_error(), 101.0)
        assert isinstance(s.failure, StageClosedError)
        assert s.events_end is not None
        assert s.events_end.exc is s.failure

    def test_launched_stage_waits_for_the_process_then_gives_up(self) -> None:
        s = session(launched=True)
        d = s.receive(frame(["fatal", "E()"]), 200.0)
        assert d.over
        assert s.failure is None
        assert s.state is StageState.STOPPED
        assert s.tick(200.5) == (None, 200.0 + EXIT_AFTER_LAST_EVENT_S, None)
        _, wake_at, gone = s.tick(200.0 + EXIT_AFTER_LAST_EVENT_S)
        assert wake_at is None
        assert gone is not None
        assert isinstance(s.failure, EngineDeadError)
        assert "has not exited" in str(s.failure)
        assert s.failure.exit_code is None
        assert s.failure.fatal == "E()"

    def test_launched_stage_gone_when_it_exits_after_its_last_event(self) -> None:
        s = session(launched=True)
        received(s, frame(["shutdown"]))
        d = s.process_exited(0, 100.2)
        assert d is not None
        assert d.over
        assert isinstance(s.failure, EngineDeadError)
        assert s.failure.exit_code == 0
        assert str(s.failure) == (
            "stage process 42 exited with code 0; it shut down, but not at this client's request"
        )

    def test_frames_in_flight_get_a_grace_period_after_the_exit(self) -> None:
        s = session(launched=True)
        assert s.process_exited(1, 300.0) is None
        assert s.tick(300.1) == (None, 300.0 + EXIT_GRACE_S, None)
        d = s.receive(frame(["fatal", "RuntimeError('late')"]), 300.2)
        assert d.over
        assert isinstance(s.failure, EngineDeadError)
        assert (s.failure.exit_code, s.failure.fatal) == (1, "RuntimeError('late')")

    def test_no_last_event_within_the_grace_period(self) -> None:
        s = session(launched=True)
        s.process_exited(-9, 300.0)
        _, _, d = s.tick(300.0 + EXIT_GRACE_S)
        assert d is not None
        assert isinstance(s.failure, EngineDeadError)
        assert str(s.failure) == "stage process 42 was killed by SIGKILL"

    def test_each_frame_read_after_the_exit_extends_the_grace(self) -> None:
        # A loaded client still reading a fast stream's backlog must reach the fatal event
        # queued behind it: the grace runs from the last frame read, not from the exit.
        s = session(launched=True)
        open_streams(s, "a")
        s.process_exited(1, 300.0)
        t = 300.0
        for _ in range(4):  # a backlog read past the first EXIT_GRACE_S
            t += EXIT_GRACE_S * 0.9
            received(s, frame(outputs(("a", False, 1))), t)
            assert s.tick(t) == (None, t + EXIT_GRACE_S, None)
        assert t > 300.0 + EXIT_GRACE_S
        d = received(s, frame(["fatal", "RuntimeError('behind the backlog')"]), t + 0.1)
        assert d.over
        assert isinstance(s.failure, EngineDeadError)
        assert (s.failure.exit_code, s.failure.fatal) == (1, "RuntimeError('behind the backlog')")

    def test_the_grace_ends_after_the_last_frame_read(self) -> None:
        s = session(launched=True)
        open_streams(s, "a")
        s.process_exited(-9, 300.0)
        received(s, frame(outputs(("a", False, 1))), 300.2)
        assert s.tick(300.0 + EXIT_GRACE_S)[2] is None  # read 0.1 s ago: not yet
        _, wake_at, d = s.tick(300.2 + EXIT_GRACE_S)
        assert (wake_at, d is not None) == (None, True)
        assert str(s.failure) == "stage process 42 was killed by SIGKILL"

    def test_frames_read_after_the_exit_extend_it_only_up_to_the_cap(self) -> None:
        s = session(launched=True)
        open_streams(s, "a")
        s.process_exited(-9, 300.0)
        t = 300.0
        while t < 300.0 + EXIT_READ_MAX_S:
            assert s.failure is None
            received(s, frame(outputs(("a", False, 1))), t)
            t += EXIT_GRACE_S / 2
        assert s.tick(t)[1] is None  # the cap passed: gone, though frames still came
        assert isinstance(s.failure, EngineDeadError)

    def test_closing_turns_every_end_into_stage_closed(self) -> None:
        s = session(launched=True)
        s.begin_close()
        s.process_exited(-9, 300.0)
        s.tick(301.0)
        assert isinstance(s.failure, StageClosedError)


class TestFail:
    def test_fails_once_with_the_same_object_everywhere(self) -> None:
        s = session(ordered_events=True)
        a, b = open_streams(s, "a", "b")
        assert not a._take(wait=True)  # its consumer waits
        w = Waiter()
        s.open_call(3, w, "echo")
        s.wait_for_events()
        err = EngineDeadError("gone")
        d = s.fail(err)
        assert d is not None
        assert d.over
        assert d.wake_events
        assert d.wake == [a]
        assert d.answers == [(w, None, err)]
        assert a._buf[0].exc is err
        assert b._buf[0].exc is err
        assert s.events is not None
        assert s.events[-1].exc is err
        assert s.streams == {}
        assert s.calls == {}
        assert s.fail(EngineDeadError("again")) is None
        assert s.failure is err
        with pytest.raises(EngineDeadError) as info:
            s.check_open()
        assert info.value is err
        with pytest.raises(EngineDeadError):
            open_streams(s, "c")

    def test_frames_after_the_end_are_ignored(self) -> None:
        s = session(ordered_events=True)
        s.fail(EngineDeadError("gone"))
        d = received(s, frame(outputs(("a", False, 1)), ["utility", 1, 2, None]))
        assert (d.wake, d.answers, d.wake_events) == ([], [], False)
        assert s.events is not None
        assert len(s.events) == 1

    def test_closing_refuses_new_work(self) -> None:
        s = session()
        assert s.begin_close()
        with pytest.raises(StageClosedError):
            open_streams(s, "a")
        with pytest.raises(StageClosedError):
            s.open_call(1, Waiter(), "echo")

    def test_a_draining_close_takes_aborts_until_the_client_signals_the_process(self) -> None:
        s = session()
        assert s.begin_close(drain=True)
        s.check_abortable()  # the stage still applies aborts while it drains
        with pytest.raises(StageClosedError):
            s.check_open()
        s.escalating()  # the client gave up on the drain
        with pytest.raises(StageClosedError):
            s.check_abortable()

    @pytest.mark.parametrize(
        "parts",
        [
            [b"\xc1"],
            frame(["nope"]),
            frame(["outputs", ["a", "b"], [False], [1, 2]]),  # lists of different lengths
            [msgspec.msgpack.encode([["utility", 1, msgspec.msgpack.Ext(9, b""), None]])],
        ],
    )
    def test_an_invalid_frame_is_the_end(self, parts: list[bytes]) -> None:
        s = session()
        (a,) = open_streams(s, "a")
        d = received(s, parts)
        assert d.over
        assert isinstance(s.failure, EngineDeadError)
        assert "invalid frame" in str(s.failure)
        assert a._buf[0].exc is s.failure


class TestHeartbeat:
    def test_pings_on_schedule_and_dead_exactly_at_last_heard_plus_timeout(self) -> None:
        s = session(launched=False, heartbeat=(1.0, 5.0), now=100.0)
        ping, wake_at, d = s.tick(100.0)
        assert ping is not None
        assert decode(ping) == ["ping", 0]
        assert (wake_at, d) == (101.0, None)
        assert s.tick(100.5) == (None, 101.0, None)
        ping, wake_at, _ = s.tick(101.0)
        assert ping is not None
        assert decode(ping) == ["ping", 1]
        assert wake_at == 102.0
        s.receive(frame(["pong", 1]), 102.5)
        ping, wake_at, _ = s.tick(104.9)  # no ping since 101: one is due
        assert ping is not None
        assert wake_at == 105.9
        assert s.tick(107.4)[2] is None
        ping, wake_at, _ = s.tick(107.49)
        assert wake_at == pytest.approx(107.5)  # the deadline comes before the next ping
        _, wake_at, d = s.tick(107.5)  # last_heard + heartbeat_timeout, not a ping later
        assert d is not None
        assert wake_at is None
        assert isinstance(s.failure, EngineDeadError)
        assert (
            str(s.failure)
            == "stage process 42: no heartbeat from tcp://127.0.0.1:5570 for 5.0 s; presumed dead"
        )
        assert s.tick(200.0) == (None, None, None)
        assert s.presumed_dead  # an owner kills it at its close, without waiting

    def test_presumed_dead_during_a_drain_is_a_death(self) -> None:
        # A drain lets the live requests run to their end: a stage that stops answering
        # meanwhile (stopped, cut off) fails them as dead (a pool: ReplicaDeadError), as a
        # process that exits during the drain does; found by soak_pool --ray with freezes
        # past the heartbeat timeout of replicas being removed.
        s = session(launched=True, heartbeat=(1.0, 5.0), now=0.0)
        assert s.begin_close(drain=True)
        s.tick(5.0)
        assert isinstance(s.failure, EngineDeadError)
        assert "presumed dead" in str(s.failure)
        assert s.presumed_dead

    def test_presumed_dead_during_a_plain_close_is_a_closed_client(self) -> None:
        s = session(launched=True, heartbeat=(1.0, 5.0), now=0.0)
        assert s.begin_close()
        s.tick(5.0)
        assert isinstance(s.failure, StageClosedError)

    def test_only_the_heartbeat_presumes_a_stage_dead(self) -> None:
        s = session(launched=False, heartbeat=(1.0, 5.0), now=0.0)
        s.fail(EngineDeadError("its process exited"), 1.0)
        s.tick(10.0)  # past the heartbeat timeout, but the session had failed already
        assert not s.presumed_dead

    def test_every_frame_is_a_sign_of_life(self) -> None:
        s = session(launched=False, heartbeat=(1.0, 5.0), now=0.0)
        s.receive(frame(outputs((None, False, 1))), 4.0)
        s.tick(8.9)
        assert s.failure is None
        s.tick(9.0)
        assert isinstance(s.failure, EngineDeadError)

    def test_a_launched_stage_without_heartbeat_has_no_timer(self) -> None:
        s = session(launched=True)
        assert s.tick(1e9) == (None, None, None)


class TestInputReply:
    """What a stage sends on the input socket after the handshake: a ``reject`` once a
    multi-client stage has ended this client's session."""

    def test_a_reject_fails_every_waiter_with_session_lost_and_releases(self) -> None:
        s = session(launched=False, heartbeat=(1.0, 60.0), now=0.0)
        [core] = open_streams(s, "r1")
        waiter = Waiter()
        s.open_call(7, waiter, "echo")
        reason = "session lost: the stage detached this client (session 3) because it fell behind"
        d = s.input_reply(msgspec.msgpack.encode(["reject", 2, reason]), 1.0)
        assert d is not None
        assert isinstance(s.failure, SessionLostError)
        assert isinstance(s.failure, EngineDeadError)
        # The stage's reason says what became of the requests (not always aborted).
        assert str(s.failure) == f"stage process 42 ended this client's session: {reason}"
        assert [exc for _, _, exc in d.answers] == [s.failure]
        assert core._ended is not None
        assert core._ended.exc is s.failure
        assert s.release_due
        assert s.input_reply(msgspec.msgpack.encode(["reject", 2, "again"]), 2.0) is None

    @pytest.mark.parametrize(
        "body",
        [b"\xc1", msgspec.msgpack.encode(["welcome", 2, "x", 1, "e"]), msgspec.msgpack.encode(7)],
    )
    def test_anything_else_is_ignored(self, body: bytes) -> None:
        s = session(launched=False, heartbeat=(1.0, 60.0), now=0.0)
        assert s.input_reply(body, 1.0) is None
        assert s.failure is None

    def test_while_closing_it_is_a_closed_client(self) -> None:
        s = session(launched=False, heartbeat=(1.0, 60.0), now=0.0)
        s.begin_close()
        s.input_reply(msgspec.msgpack.encode(["reject", 2, "session lost: ..."]), 1.0)
        assert isinstance(s.failure, StageClosedError)
        assert not s.release_due


class TestHealth:
    def test_silence_for_two_intervals_is_stalled_and_said_once(self) -> None:
        s = session(launched=False, heartbeat=(1.0, 5.0), now=0.0)
        assert s.health(0.0) is StageHealth.OK
        _, wake_at, d = s.tick(0.0)
        assert d is None
        assert wake_at == 1.0
        _, wake_at, d = s.tick(1.0)
        assert wake_at == 2.0  # the next ping and the silence deadline coincide
        assert s.health(1.99) is StageHealth.OK
        assert s.health(2.0) is StageHealth.STALLED  # even before tick() says so
        _, _, d = s.tick(2.0)
        assert d is not None
        [warning] = d.warnings
        assert "stage process 42 has not answered for 2.0 s" in warning
        assert s.tick(2.5)[2] is None  # said once
        # An answer ends it, and says so.
        d = s.receive(frame(["pong", 1]), 3.0)
        assert d.warnings == ["stage process 42 answers again, after 3.0 s of silence"]
        assert s.health(3.0) is StageHealth.OK

    def test_a_launched_stage_is_never_presumed_dead_from_silence(self) -> None:
        s = session(launched=True, heartbeat=(1.0, None), now=0.0)
        ping, wake_at, _ = s.tick(0.0)
        assert ping is not None
        assert wake_at == 1.0
        s.tick(1e6)
        assert s.failure is None
        assert s.health(1e6) is StageHealth.STALLED

    def test_stalled_and_resumed_events(self) -> None:
        s = session(ordered_events=True, now=0.0)
        d = s.receive(frame(["stalled", 61.5, 60.0]), 1.0)
        assert s.health(1.0) == "stalled"
        assert d.warnings == [
            "stage process 42: a step has run for 61.5 s (step_timeout 60 s); the stage "
            "logged every thread's stack"
        ]
        d = s.receive(frame(["resumed", 70.25], outputs(("r", True, 0))), 2.0)
        assert s.health(2.0) == "ok"
        assert d.warnings == ["stage process 42: the stalled step returned after 70.2 s"]
        # Liveness events stay out of the ordered event stream.
        assert s.events is not None
        assert [type(ev).__name__ for ev in s.events] == ["Outputs"]

    def test_dead_once_failed_or_closing(self) -> None:
        s = session(now=0.0)
        s.begin_close()
        assert s.health(0.0) is StageHealth.DEAD
        s = session(now=0.0)
        s.fail(EngineDeadError("gone"))
        assert s.health(0.0) is StageHealth.DEAD


class TestFrames:
    def test_add(self) -> None:
        assert decode(ClientSession.add_frame("r", {"k": [1, "x"]})) == [
            "add",
            "r",
            {"k": [1, "x"]},
        ]

    def test_adds_is_one_frame_in_order(self) -> None:
        ids, parts = ClientSession.adds_frame([("a", 1), ["b", None], ("c", "x")])  # type: ignore[list-item]
        assert ids == ["a", "b", "c"]
        assert decode(parts) == ["adds", ["a", "b", "c"], [1, None, "x"]]
        assert decode(ClientSession.adds_frame([])[1]) == ["adds", [], []]

    @pytest.mark.parametrize(
        ("items", "error", "match"),
        [
            ([("a", 1), ("a", 2)], ValueError, "'a' appears twice"),
            ([("a", {1})], TypeError, "data of request 'a'"),
            ([("a", 2**64)], TypeError, "request 'a'"),
            ([(1, 1)], TypeError, "req_id must be a str"),
            ([("a", 1, 2)], TypeError, "pairs"),
            (["ab"], TypeError, "pairs"),
            # What the fast path (one dict() of the pairs) does not take, the checks name.
            ([("a", 1), (["x"], 2)], TypeError, "req_id must be a str"),  # unhashable
            ([(1, 1), (True, 2)], TypeError, "req_id must be a str"),  # equal keys
            ([("a", 1), (_Str("a"), 2)], TypeError, "req_id must be a str"),
            ([("a", 1), (_Str("b"), 2)], TypeError, "req_id must be a str"),
            ([_Pair("a", 1)], TypeError, "pairs, got _Pair"),  # exact types only
            ([("a", 1), ("b", 2**64)], TypeError, "request 'b'"),
            ([("a", 1), ("b", -(2**64))], TypeError, "request 'b'"),
        ],
    )
    def test_adds_refused(self, items: list[Any], error: type[Exception], match: str) -> None:
        with pytest.raises(error, match=match):
            ClientSession.adds_frame(items)

    @given(
        st.lists(
            st.tuples(
                st.sampled_from(["a", "b", "c", "d", "e", "f"]),
                st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.text()),
            ),
            max_size=8,
        )
    )
    def test_adds_frame_is_the_pairs_in_order_or_names_the_repeated_id(
        self, items: list[tuple[str, Any]]
    ) -> None:
        ids = [rid for rid, _ in items]
        repeated = next((rid for i, rid in enumerate(ids) if rid in ids[:i]), None)
        if repeated is not None:
            with pytest.raises(ValueError, match=f"'{repeated}' appears twice"):
                ClientSession.adds_frame(items)
            return
        got_ids, parts = ClientSession.adds_frame(items)
        assert got_ids == ids
        assert decode(parts) == ["adds", ids, [data for _, data in items]]

    def test_a_live_id_is_refused_and_nothing_is_registered(self) -> None:
        s = session()
        open_streams(s, "a")
        with pytest.raises(ValueError, match="'a' is still live"):
            open_streams(s, "b", "a")
        assert set(s.streams) == {"a"}
        s.cancel_streams(["a"])
        assert s.streams == {}

    def test_abort_and_utility(self) -> None:
        assert decode(ClientSession.abort_frame(("a", "b"))) == ["abort", ["a", "b"]]
        with pytest.raises(TypeError, match=r"abort\(\['a'\]\)"):
            ClientSession.abort_frame("a")
        parts = ClientSession.utility_frame(7, "echo", (1, (2, 3)))
        assert decode(parts) == ["utility", 7, "echo", [1, [2, 3]]]
        with pytest.raises(TypeError, match="arguments of utility 'echo'"):
            ClientSession.utility_frame(7, "echo", ({1},))
        # Flat arguments skip the checks, but an error still names what it refuses.
        assert decode(ClientSession.utility_frame(8, "f", (None, True, 2**64 - 1, 0.5, "s"))) == [
            "utility", 8, "f", [None, True, 2**64 - 1, 0.5, "s"],
        ]  # fmt: skip
        with pytest.raises(TypeError, match=r"arguments of utility 'f'\[1\]: int 18446744073"):
            ClientSession.utility_frame(9, "f", (1, 2**64))
        with pytest.raises(TypeError, match=r"utility call 'f' cannot be encoded.*surrogates"):
            ClientSession.utility_frame(9, "f", ("\udc80",))

    def test_arrays_travel_out_of_band_without_a_copy(self) -> None:
        big = np.arange(1000, dtype=np.float64)
        small = np.arange(3, dtype=np.int8)
        parts = ClientSession.add_frame("r", {"big": big, "small": small})
        assert len(parts) == 2  # the body, then big's buffer; small is inline
        assert np.shares_memory(np.frombuffer(parts[1], dtype=np.float64), big)
        tag, rid, data = decode(parts)
        assert (tag, rid) == ("add", "r")
        assert np.array_equal(data["big"], big)
        assert np.array_equal(data["small"], small)
        _ids, parts = ClientSession.adds_frame([("a", big), ("b", big[::2])])
        assert len(parts) == 3
        assert np.array_equal(decode(parts)[2][1], big[::2])

    def test_arrays_in_utility_args_and_outputs(self) -> None:
        arr = np.ones((40, 40), dtype=np.float32)
        parts = ClientSession.utility_frame(1, "echo", (arr,))
        assert len(parts) == 2
        # An output payload that is an array arrives as a read-only view on its frame.
        s = session()
        (a,) = open_streams(s, "a")
        body = msgspec.msgpack.encode(
            [
                [
                    "outputs",
                    ["a"],
                    [True],
                    [msgspec.msgpack.Ext(1, msgspec.msgpack.encode(["<f4", [40, 40], 0]))],
                ]
            ]
        )
        s.receive([body, memoryview(arr.tobytes())], 100.0)
        got = a._buf[0]
        assert np.array_equal(got, arr)
        assert not got.flags.writeable
        assert a._buf[1] is FINISHED
