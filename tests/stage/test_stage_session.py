"""The stage's half of the protocol without a socket or a thread (``_stage_session.py``):
the handshake and sessions, validation into loop messages or scoped errors, the call table,
and the outbox's view of the session (``SessionGate``). Time is passed in."""

from __future__ import annotations

import logging
import math
from typing import Any

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from enginecore import Abort, Add, Utility
from enginecore.stage import _wire
from enginecore.stage._controls import (
    AddBurst,
    ClientInput,
    ClientJoined,
    ClientLeft,
    PipeAbort,
    PipeCredit,
    PipeFence,
    PipeGone,
    PipeInput,
    PipeLink,
    PipeRoute,
    SessionChange,
    Stop,
)
from enginecore.stage._stage_session import (
    _LOST_REMEMBERED,
    HELLO_HOLD_S,
    NO_SESSION,
    NOT_ATTACHED,
    OUTPUT_GRACE_S,
    SESSION_LOST,
    CallTable,
    MultiStageSession,
    SessionGate,
    SessionState,
    StageSession,
)

A, B, C = b"client-a", b"client-b", b"client-c"
V = _wire.PROTOCOL_VERSION


class FakeOutput:
    """The output side, as the session sees it: records what it is told."""

    def __init__(self) -> None:
        self.resync = False
        self.epoch = 0
        self.detached: list[bool] = []
        self.dropped_at_attach = 0
        self.detached_max = 8
        self.cuts = 0  # cut_connections() calls

    def begin_session(self) -> tuple[int, int]:
        self.epoch += 1
        return self.epoch, 0

    def set_detached(self, detached: bool) -> int:
        self.detached.append(detached)
        dropped, self.dropped_at_attach = self.dropped_at_attach, 0
        return dropped

    def cut_connections(self) -> None:
        self.cuts += 1


def state_of(session: StageSession) -> SessionState:
    # A call, so that mypy does not narrow the state across the session's methods.
    return session.state


def frame(*msg: Any) -> list[Any]:
    return [msgspec.msgpack.encode(list(msg))]


def replies(session: StageSession) -> list[tuple[bytes, Any]]:
    out = [(ident, msgspec.msgpack.decode(body)) for ident, body in session.replies]
    session.replies.clear()
    return out


def take(session: StageSession) -> tuple[list[Any], list[Any]]:
    to_loop, events = list(session.to_loop), list(session.events)
    session.to_loop.clear()
    session.events.clear()
    return to_loop, events


@pytest.fixture
def output() -> FakeOutput:
    return FakeOutput()


@pytest.fixture
def calls() -> CallTable:
    return CallTable()


@pytest.fixture
def session(output: FakeOutput, calls: CallTable) -> StageSession:
    return StageSession(
        output, calls, engine_name="eng", output_address="ipc://out", session_timeout=10.0
    )


def welcome(session: StageSession, ident: bytes = A, now: float = 0.0) -> None:
    session.receive(ident, frame("hello", V, "test"), now)
    [(who, reply)] = replies(session)
    assert (who, reply[0]) == (ident, "welcome")
    take(session)


class TestHandshake:
    def test_hello_is_welcomed_and_starts_a_session(
        self, session: StageSession, output: FakeOutput
    ) -> None:
        assert state_of(session) is SessionState.NONE
        session.receive(A, frame("hello", V, "test"), 0.0)
        [(who, reply)] = replies(session)
        assert who == A
        assert reply[:3] == ["welcome", V, "ipc://out"]
        assert reply[4] == "eng"
        assert state_of(session) is SessionState.WELCOMED
        assert session.client == A
        assert session.epoch == 1
        [change] = session.to_loop
        assert isinstance(change, SessionChange)
        assert change.epoch == 1
        # A client that has not connected its PULL yet can read: not detached.
        assert output.detached == [False]

    def test_a_wrong_version_is_rejected(self, session: StageSession) -> None:
        session.receive(A, frame("hello", V + 1, "test"), 0.0)
        [(who, reply)] = replies(session)
        assert who == A
        assert reply[0] == "reject"
        assert "not supported" in reply[2]
        assert state_of(session) is SessionState.NONE
        assert not session.to_loop

    def test_an_invalid_hello_is_rejected(self, session: StageSession) -> None:
        session.receive(A, frame("hello", "two", "test"), 0.0)
        [(_, reply)] = replies(session)
        assert reply[0] == "reject"
        assert reply[2].startswith("invalid hello: invalid message (")

    def test_hello_again_from_the_attached_client_is_welcomed_in_the_same_session(
        self, session: StageSession, output: FakeOutput
    ) -> None:
        welcome(session)
        session.receive(A, frame("hello", V, "test"), 1.0)
        [(_, reply)] = replies(session)
        assert reply[0] == "welcome"
        assert session.epoch == 1
        assert output.epoch == 1
        assert not session.to_loop

    def test_another_client_is_rejected_while_the_attached_one_was_heard_recently(
        self, session: StageSession
    ) -> None:
        welcome(session)
        session.receive(A, frame("ping", 1), 5.0)
        session.receive(B, frame("hello", V, "test"), 14.0)
        [(who, reply)] = replies(session)
        assert who == B
        assert reply[0] == "reject"
        assert reply[2] == "another client is attached to this stage"
        assert session.client == A

    def test_a_silent_client_is_taken_over(self, session: StageSession) -> None:
        welcome(session)
        session.receive(B, frame("hello", V, "test"), 10.0)
        [(who, reply)] = replies(session)
        assert (who, reply[0]) == (B, "welcome")
        assert session.client == B
        assert session.epoch == 2
        [change] = session.to_loop
        assert isinstance(change, SessionChange)
        assert change.epoch == 2

    @pytest.mark.parametrize(
        "msg",
        [
            ("ping", 7),
            ("add", "r1", 1),
            ("adds", ["r1"], [1]),
            ("abort", ["r1"]),
            ("utility", 3, "div", [1, 2]),
            ("shutdown",),
        ],
    )
    def test_a_taken_over_client_that_comes_back_is_told_its_session_is_lost(
        self, session: StageSession, msg: tuple[Any, ...]
    ) -> None:
        # It was stopped (SIGSTOP) past the session timeout and B took over: nothing it
        # sends reaches the engine or B's output stream, and it learns why, so that its
        # client fails its streams and calls (SessionLostError) and closes its PULL (which
        # the output socket would otherwise deal B's events to).
        welcome(session)
        session.receive(B, frame("hello", V, "test"), 10.0)
        replies(session)
        take(session)
        session.receive(A, frame(*msg), 11.0)
        assert take(session) == ([], [])
        [(who, reply)] = replies(session)
        assert (who, reply[0]) == (A, "reject")
        assert reply[2].startswith(SESSION_LOST)
        assert "another client took this client's session over (session 2)" in reply[2]
        assert "silent for more than the session timeout (10 s)" in reply[2]
        assert "its live requests were aborted" in reply[2]
        assert session.client == B

    def test_a_taken_over_client_of_a_stage_that_keeps_requests_is_told_so(
        self, output: FakeOutput, calls: CallTable
    ) -> None:
        # keep_requests_on_detach: its requests run on, for the next client; its reason
        # must not say they were aborted.
        session = StageSession(
            output,
            calls,
            engine_name="eng",
            output_address="ipc://out",
            session_timeout=10.0,
            keep_requests=True,
        )
        welcome(session)
        session.receive(B, frame("hello", V, "test"), 10.0)
        replies(session)
        take(session)
        session.receive(A, frame("ping", 1), 11.0)
        [(who, reply)] = replies(session)
        assert (who, reply[0]) == (A, "reject")
        assert "its live requests were kept running in the stage" in reply[2]
        assert "aborted" not in reply[2]

    def test_a_taken_over_client_may_attach_again_observe_and_say_bye(
        self, session: StageSession
    ) -> None:
        welcome(session)
        session.receive(B, frame("hello", V, "test"), 10.0)
        replies(session)
        session.receive(A, frame("stats", 4), 11.0)  # answered on the input socket
        [(who, reply)] = replies(session)
        assert (who, reply[0]) == (A, "utility")
        session.receive(A, frame("bye"), 11.0)  # nothing to end: B's session goes on
        assert session.client == B
        session.receive(A, frame("ping", 1), 11.0)  # forgotten after its bye: as before
        assert not session.replies
        session.receive(A, frame("hello", V, "test"), 30.0)  # B silent since 10.0
        [(who, reply)] = replies(session)
        assert (who, reply[0]) == (A, "welcome")
        take(session)
        session.receive(A, frame("ping", 2), 31.0)
        assert not session.replies
        assert take(session) == ([], [("pong", 2)])

    def test_a_silent_client_still_connected_holds_the_hello_then_it_is_rejected(
        self, session: StageSession
    ) -> None:
        welcome(session)
        session.output_peers_changed(1)
        session.receive(B, frame("hello", V, "test"), 20.0)
        assert not session.replies
        assert session.held is not None
        assert session.wait_ms(20.0) == round(HELLO_HOLD_S * 1000)
        session.settle(20.0 + HELLO_HOLD_S / 2)
        assert not session.replies
        session.settle(20.0 + HELLO_HOLD_S)
        [(who, reply)] = replies(session)
        assert (who, reply[0]) == (B, "reject")
        assert "silent for the session timeout" in reply[2]
        assert session.held is None
        assert session.wait_ms(30.0) is None

    def test_a_hello_is_held_until_the_output_socket_has_no_connection(
        self, session: StageSession
    ) -> None:
        session.output_peers_changed(1)  # the previous client's PULL, after its bye
        session.receive(A, frame("hello", V, "test"), 0.0)
        assert session.held is not None
        assert not session.replies
        session.settle(0.1)
        assert not session.replies
        session.output_peers_changed(-1)
        session.settle(0.2)
        [(who, reply)] = replies(session)
        assert (who, reply[0]) == (A, "welcome")
        assert session.held is None
        assert state_of(session) is SessionState.WELCOMED

    def test_a_held_hello_that_times_out_says_why(self, session: StageSession) -> None:
        session.output_peers_changed(1)
        session.receive(A, frame("hello", V, "test"), 0.0)
        session.settle(HELLO_HOLD_S)
        [(_, reply)] = replies(session)
        assert reply[0] == "reject"
        assert "still connected to the output socket" in reply[2]

    def test_while_a_hello_is_held_another_is_rejected_and_the_same_one_waits(
        self, session: StageSession
    ) -> None:
        session.output_peers_changed(1)
        session.receive(A, frame("hello", V, "test"), 0.0)
        session.receive(A, frame("hello", V, "test"), 0.1)
        assert not session.replies
        session.receive(B, frame("hello", V, "test"), 0.2)
        [(who, reply)] = replies(session)
        assert (who, reply[0]) == (B, "reject")
        assert reply[2] == "another client is connecting to this stage"

    def test_waiting_wait_ms_is_enough_for_the_held_hello_s_deadline(
        self, session: StageSession
    ) -> None:
        # The input side waits wait_ms() and then calls settle(): rounded down, it would
        # wake before the deadline, settle nothing, and spin on waits of 0 ms until it.
        session.output_peers_changed(1)
        session.receive(A, frame("hello", V, "test"), 0.0)
        now = HELLO_HOLD_S - 0.0004
        wait = session.wait_ms(now)
        assert wait == 1
        session.settle(now + wait / 1000)
        [(who, reply)] = replies(session)
        assert (who, reply[0]) == (A, "reject")
        assert session.held is None

    def test_a_client_that_attached_again_is_no_longer_taken_over(
        self, session: StageSession
    ) -> None:
        welcome(session)
        session.receive(B, frame("hello", V, "test"), 10.0)  # A silent: B takes over
        replies(session)
        session.receive(A, frame("hello", V, "test"), 30.0)  # B silent: A takes over
        [(who, reply)] = replies(session)
        assert (who, reply[0]) == (A, "welcome")
        session.receive(A, frame("bye"), 31.0)  # its own session ends, as any other's
        take(session)
        session.receive(A, frame("ping", 1), 32.0)  # not told of the session B took
        assert not session.replies
        assert take(session) == ([], [("pong", 1)])

    def test_only_the_last_taken_over_clients_are_remembered(self, session: StageSession) -> None:
        # Each client is taken over by the next: what the session remembers is bounded.
        clients = [b"client-%d" % i for i in range(_LOST_REMEMBERED + 2)]
        for i, ident in enumerate(clients):
            session.receive(ident, frame("hello", V, "test"), 20.0 * i)
        replies(session)
        take(session)
        now = 20.0 * len(clients)
        for ident in (clients[-2], clients[1]):  # the last _LOST_REMEMBERED taken over
            session.receive(ident, frame("ping", 1), now)
            [(who, reply)] = replies(session)
            assert (who, reply[0]) == (ident, "reject")
            assert reply[2].startswith(SESSION_LOST)
        session.receive(clients[0], frame("ping", 2), now)  # the oldest is forgotten
        assert not session.replies
        assert take(session) == ([], [("pong", 2)])

    def test_a_held_client_that_says_bye_gives_up(self, session: StageSession) -> None:
        session.output_peers_changed(1)
        session.receive(A, frame("hello", V, "test"), 0.0)
        session.receive(A, frame("bye"), 0.1)
        assert session.held is None
        assert not session.to_loop
        session.output_peers_changed(-1)
        session.settle(0.2)
        assert not session.replies


class TestSessions:
    def test_bye_ends_the_session_after_what_the_client_sent(
        self, session: StageSession, output: FakeOutput
    ) -> None:
        welcome(session)
        session.receive(A, frame("add", "r1", 1), 1.0)
        session.receive(A, frame("bye"), 1.0)
        add, change = session.to_loop
        assert isinstance(add, Add)
        assert isinstance(change, SessionChange)
        assert change.epoch is None
        assert state_of(session) is SessionState.NONE
        assert session.client is None
        assert output.detached == [False, True]

    def test_bye_from_another_client_changes_nothing(self, session: StageSession) -> None:
        welcome(session)
        session.receive(B, frame("bye"), 1.0)
        assert session.client == A
        assert not session.to_loop

    def test_the_state_follows_the_clients_output_connection(
        self, session: StageSession, output: FakeOutput
    ) -> None:
        welcome(session)
        assert state_of(session) is SessionState.WELCOMED
        session.output_peers_changed(1)
        assert state_of(session) is SessionState.CONNECTED
        session.output_peers_changed(-1)
        assert state_of(session) is SessionState.OUTPUT_LOST
        assert session.detached
        session.output_peers_changed(1)
        assert state_of(session) is SessionState.CONNECTED
        # Told once per change: attached, lost, back.
        assert output.detached == [False, True, False]

    def test_output_peers_never_go_negative(self, session: StageSession) -> None:
        session.output_peers_changed(-1)
        assert session.output_peers == 0
        assert state_of(session) is SessionState.NONE

    def test_the_first_message_of_a_new_client_resyncs_the_output_socket(
        self, session: StageSession, output: FakeOutput
    ) -> None:
        welcome(session)
        assert not output.resync
        session.receive(B, frame("ping", 1), 1.0)  # not the client: no resync
        assert not output.resync
        session.receive(A, frame("ping", 2), 1.0)
        assert output.resync
        output.resync = False
        session.receive(A, frame("ping", 3), 1.0)  # only the first
        assert not output.resync

    def test_drops_of_a_detached_period_are_logged_when_it_ends(
        self, session: StageSession, output: FakeOutput, caplog: pytest.LogCaptureFixture
    ) -> None:
        output.dropped_at_attach = 5
        with caplog.at_level(logging.WARNING, logger="enginecore.stage"):
            welcome(session)
        assert "dropped 5 events" in caplog.text

    def test_an_attached_client_whose_events_were_dropped_while_its_output_was_lost_is_ended(
        self, session: StageSession, output: FakeOutput, caplog: pytest.LogCaptureFixture
    ) -> None:
        # Its streams miss outputs (perhaps their last) and its calls their answers: they
        # would wait for ever. Its session ends instead, and its next message learns why.
        welcome(session)
        session.receive(A, frame("add", "r1", 1), 0.5)
        session.output_peers_changed(1)
        take(session)
        session.output_peers_changed(-1)
        assert state_of(session) is SessionState.OUTPUT_LOST
        output.dropped_at_attach = 3  # past the bound while it could not read
        with caplog.at_level(logging.WARNING, logger="enginecore.stage"):
            session.output_peers_changed(1)
        assert "ended the session of client" in caplog.text
        assert state_of(session) is SessionState.NONE
        assert session.client is None
        assert output.cuts == 1  # its PULL must not take the next client's events
        [change], _ = take(session)
        assert isinstance(change, SessionChange)
        assert change.epoch is None
        assert not change.abort  # its requests go as a bye's do (kept, on a stage that keeps)
        session.receive(A, frame("ping", 1), 1.0)
        [(who, reply)] = replies(session)
        assert (who, reply[0]) == (A, "reject")
        assert reply[2].startswith(SESSION_LOST)
        assert "output connection was lost" in reply[2]
        assert "3 were dropped" in reply[2]
        assert "its live requests were aborted" in reply[2]
        assert take(session) == ([], [])  # nothing of it reaches the engine

    def test_a_client_whose_output_came_back_without_drops_goes_on(
        self, session: StageSession, output: FakeOutput
    ) -> None:
        welcome(session)
        session.output_peers_changed(1)
        session.output_peers_changed(-1)
        session.output_peers_changed(1)  # nothing dropped
        assert state_of(session) is SessionState.CONNECTED
        assert session.client == A
        assert output.cuts == 0


class TestRevoke:
    """A CURVE key the stage no longer authorizes (``revoke``, called by the input side's
    ``KeyWatch``): the session ends as after a ``bye``, with its requests aborted."""

    def test_the_attached_client_s_session_ends_and_its_requests_are_aborted(
        self, session: StageSession, output: FakeOutput
    ) -> None:
        welcome(session)
        session.receive(A, frame("add", "r1", 1), 1.0)
        session.revoke(A, "KEY-A")
        add, change = session.to_loop
        assert isinstance(add, Add)
        assert isinstance(change, SessionChange)
        assert change.epoch is None
        assert change.abort  # even on a stage that keeps a detached client's requests
        assert state_of(session) is SessionState.NONE
        assert session.client is None
        assert output.detached == [False, True]
        [(who, reply)] = replies(session)
        assert who == A
        assert reply[0] == "reject"
        assert reply[2].startswith(SESSION_LOST)
        assert "no longer authorizes this client's CURVE public key KEY-A" in reply[2]

    def test_a_revoked_client_s_output_connection_is_cut(
        self, session: StageSession, output: FakeOutput
    ) -> None:
        # A revoked client that keeps its PULL connected would keep everyone else out: a
        # hello is welcomed only once nothing is connected to the output socket.
        welcome(session)
        session.output_peers_changed(1)  # A's PULL
        session.revoke(A, "KEY-A")
        assert output.cuts == 1
        session.receive(B, frame("hello", V, "b"), 20.0)
        assert session.held is not None  # until the output side has cut it
        replies(session)
        session.output_closed()  # the monitor saw the address unbound
        assert session.output_peers == 0
        session.settle(20.1)
        assert session.held is None
        assert session.client == B
        [(who, reply)] = replies(session)
        assert (who, reply[0]) == (B, "welcome")

    def test_nothing_is_cut_without_a_connection_or_for_another_peer(
        self, session: StageSession, output: FakeOutput
    ) -> None:
        welcome(session)
        session.output_peers_changed(1)
        session.revoke(B, "KEY-B")  # not the attached client: its connection is not A's
        assert output.cuts == 0
        session.output_peers_changed(-1)  # A closed its PULL itself
        session.revoke(A, "KEY-A")
        assert output.cuts == 0

    def test_a_bye_does_not_abort(self, session: StageSession) -> None:
        welcome(session)
        session.receive(A, frame("bye"), 1.0)
        [change] = session.to_loop
        assert isinstance(change, SessionChange)
        assert not change.abort

    def test_another_peer_is_rejected_and_the_session_goes_on(self, session: StageSession) -> None:
        welcome(session)
        session.revoke(B, "KEY-B")
        assert session.to_loop == []
        assert session.client == A
        [(who, reply)] = replies(session)
        assert (who, reply[0]) == (B, "reject")
        assert "KEY-B" in reply[2]

    def test_a_held_hello_is_dropped(self, session: StageSession) -> None:
        welcome(session)
        session.output_peers_changed(1)  # A's output stays connected: B's hello is held
        session.receive(B, frame("hello", V, "b"), 20.0)
        assert session.held is not None
        session.revoke(B, "KEY-B")
        assert session.held is None
        assert session.client == A
        [(who, reply)] = replies(session)
        assert (who, reply[0]) == (B, "reject")

    def test_a_multi_client_stage_detaches_only_that_client(self) -> None:
        session = multi(FakeClients())
        for ident in (A, B):
            session.receive(ident, frame("hello", V, "x"), 0.0)
        replies(session)
        session.to_loop.clear()
        session.revoke(A, "KEY-A")
        assert controls(session.to_loop) == [("left", 1)]
        assert list(session.clients) == [B]
        [(who, reply)] = replies(session)
        assert who == A
        assert reply[0] == "reject"
        assert "no longer authorizes this client's CURVE public key KEY-A" in reply[2]


class TestValidation:
    def test_valid_messages_become_loop_messages_in_arrival_order(
        self, session: StageSession, calls: CallTable
    ) -> None:
        welcome(session)
        session.receive(A, frame("add", "r1", {"k": [1, 2]}), 1.0)
        session.receive(A, frame("abort", ["r1"]), 1.0)
        session.receive(A, frame("utility", 7, "div", [1, 2]), 1.0)
        session.receive(A, frame("adds", ["a", "b"], [1, None]), 1.0)
        session.receive(A, frame("shutdown"), 1.0)
        session.receive(A, frame("shutdown", 2.5), 1.0)
        add, abort, utility, burst, stop, drain = session.to_loop
        assert add == Add("r1", {"k": [1, 2]})
        assert abort == Abort(["r1"])
        assert isinstance(utility, Utility)
        assert (utility.name, utility.args) == ("div", (1, 2))
        assert calls.close(utility.call_id) == (1, 7)  # the session's epoch, the client's id
        assert isinstance(burst, AddBurst)
        assert (burst.req_ids, burst.data) == (["a", "b"], [1, None])
        assert isinstance(stop, Stop)
        assert stop.drain is None
        assert isinstance(drain, Stop)
        assert drain.drain == 2.5
        assert not session.events

    def test_a_fenced_abort_becomes_a_pipe_fence(self, session: StageSession) -> None:
        # docs/wire.md section 8: an abort flagged as a replay's fence is applied as a
        # PipeFence (answered flagged); an unflagged one, an older sender's included, stays
        # a plain Abort. Its routes, if any, come first, as for any abort.
        welcome(session)
        session.receive(A, frame("abort", ["r1"], None, True), 1.0)
        session.receive(A, frame("abort", ["r2"], [[1]], True), 1.0)
        session.receive(A, frame("abort", ["r3"], None, False), 1.0)
        session.receive(A, frame("abort", ["r4"]), 1.0)
        fence, route, routed, plain, older = session.to_loop
        assert isinstance(fence, PipeFence)
        assert fence.req_ids == ["r1"]
        assert isinstance(route, PipeRoute)
        assert (route.req_ids, route.routes, route.abort) == (["r2"], [[1]], True)
        assert isinstance(routed, PipeFence)
        assert routed.req_ids == ["r2"]
        assert plain == Abort(["r3"])
        assert older == Abort(["r4"])
        assert not session.events

    def test_an_aborts_route_may_name_a_dead_process_and_no_other_route_may(
        self, session: StageSession
    ) -> None:
        # docs/wire.md section 8: -1 in an abort's routes is a stage whose process on the
        # request's route died (the abort goes no further). A data route (a route message,
        # a pipe message's routes) names a live replica: -1 there is an invalid message.
        welcome(session)
        session.receive(A, frame("abort", ["r1"], [[-1, 0]], False, 7), 1.0)
        route, abort = session.to_loop
        assert isinstance(route, PipeRoute)
        assert (route.req_ids, route.routes, route.abort) == (["r1"], [[-1, 0]], True)
        assert isinstance(abort, PipeAbort)
        assert (abort.req_ids, abort.tag) == (["r1"], 7)
        assert not session.events
        session.to_loop.clear()
        session.receive(A, frame("route", ["r2"], [[-1]]), 1.0)
        session.receive(A, frame("abort", ["r3"], [[-2]]), 1.0)
        refusal = (
            "error",
            None,
            "invalid message: routes must be one list of replica indexes per request",
        )
        assert session.events == [refusal, refusal]
        assert [type(m) for m in session.to_loop] == [Abort]  # r3's abort, without a route

    def test_a_route_may_name_the_generation_of_a_process_and_a_link_its_own(
        self, session: StageSession
    ) -> None:
        # docs/wire.md section 8, "Restarts": a stage that restarts may be named
        # [replica, generation] in any route (route, pipe, abort: with -1 beside it in an
        # abort's), and a link may name the new process's generation.
        welcome(session)
        session.receive(A, frame("route", ["r1"], [[[0, 1], 2]]), 1.0)
        session.receive(A, frame("abort", ["r2"], [[-1, [1, 3]]]), 1.0)
        session.receive(A, frame("pipe", [1], ["r3"], [5], {"r3": [[0, 0], 1]}, 0), 1.0)
        session.receive(A, frame("link", 1, "ipc:///x", "", "", 2), 1.0)
        session.receive(A, frame("link", 1, "ipc:///x", ""), 1.0)
        route, aborted_route, abort, pipe_route, _pipe, link, older = session.to_loop
        assert isinstance(route, PipeRoute)
        assert (route.routes, route.abort) == ([[[0, 1], 2]], False)
        assert isinstance(aborted_route, PipeRoute)
        assert (aborted_route.routes, aborted_route.abort) == ([[-1, [1, 3]]], True)
        assert abort == Abort(["r2"])
        assert isinstance(pipe_route, PipeRoute)
        assert pipe_route.routes == [[[0, 0], 1]]
        assert isinstance(link, PipeLink)
        assert (link.replica, link.address, link.generation) == (1, "ipc:///x", 2)
        assert isinstance(older, PipeLink)
        assert older.generation is None
        assert not session.events

    @pytest.mark.parametrize(
        "entry",
        [[0, -1], [-1, 0], [0], [0, 1, 2], []],
    )
    def test_a_bad_generation_in_a_route_is_an_unscoped_error(
        self, session: StageSession, entry: list[Any]
    ) -> None:
        # A generation or a replica below 0, or not a pair: the routes are refused (the
        # abort goes without them, as for any bad route). One that is not an int at all
        # is refused by the decoder, with the whole message, as a replica that is not one.
        welcome(session)
        session.receive(A, frame("route", ["r1"], [[entry]]), 1.0)
        session.receive(A, frame("abort", ["r2"], [[entry]]), 1.0)
        assert [type(m) for m in session.to_loop] == [Abort]  # r2's abort, without a route
        assert len(session.events) == 2
        for kind, rid, what in session.events:
            assert (kind, rid) == ("error", None)
            assert what.startswith("invalid message")

    @pytest.mark.parametrize("generation", [-1, "1", 1.5, [1]])
    def test_a_bad_generation_in_a_link_is_an_unscoped_error(
        self, session: StageSession, generation: Any
    ) -> None:
        welcome(session)
        session.receive(A, frame("link", 0, "ipc:///x", "", "", generation), 1.0)
        session.receive(A, frame("route", ["r1"], [[[0, "1"]]]), 1.0)
        session.receive(A, frame("abort", ["r2"], [[[0, [1]]]]), 1.0)
        assert not session.to_loop
        assert len(session.events) == 3
        for kind, rid, what in session.events:
            assert (kind, rid) == ("error", None)
            assert what.startswith("invalid message")

    def test_ping_is_answered_with_pong(self, session: StageSession) -> None:
        session.receive(A, frame("ping", 42), 0.0)
        assert session.events == [("pong", 42)]
        assert not session.to_loop

    def test_an_invalid_add_payload_is_a_request_scoped_error(self, session: StageSession) -> None:
        session.receive(A, frame("add", "r1", {1.5: "float key"}), 0.0)
        to_loop, [(kind, rid, message)] = take(session)
        assert not to_loop
        assert (kind, rid) == ("error", "r1")
        assert message.startswith("invalid message: data")

    def test_an_adds_keeps_its_valid_items_and_scopes_an_error_to_each_bad_one(
        self, session: StageSession
    ) -> None:
        session.receive(A, frame("adds", ["a", "b", "c"], [1, {1.5: 0}, 3]), 0.0)
        [burst], [(kind, rid, message)] = take(session)
        assert isinstance(burst, AddBurst)
        assert (burst.req_ids, burst.data) == (["a", "c"], [1, 3])
        assert (kind, rid) == ("error", "b")
        assert message.startswith("invalid message: data")

    def test_a_pipe_becomes_one_control_and_a_bad_item_errs_for_its_request(
        self, session: StageSession
    ) -> None:
        # From any peer (the previous stage of a pipeline never says hello).
        # The control carries the whole frame's items and bytes: the credit given back.
        body = frame("pipe", [1, 0, 2], ["a", "a", "a"], [1, 2, None])
        session.receive(B, body, 0.0)
        [pipe], events = take(session)
        assert isinstance(pipe, PipeInput)
        assert (pipe.kinds, pipe.req_ids, pipe.data) == ([1, 0, 2], ["a", "a", "a"], [1, 2, None])
        assert pipe.received == (3, len(body[0]), 0, 0)
        assert not events
        body = frame("pipe", [3, 4, 1], ["a", "b", "c"], [1, 2, {1.5: 0}])
        session.receive(B, body, 0.0)
        [pipe], events = take(session)
        assert (pipe.kinds, pipe.req_ids, pipe.data) == ([3], ["a"], [1])
        assert pipe.received == (3, len(body[0]), 0, 0)  # the refused items are given back too
        assert [(kind, rid) for kind, rid, _ in events] == [("error", "b"), ("error", "c")]
        assert events[0][2] == "invalid message: pipe kind must be 0, 1, 2, 3, 10 or 11, got 4"
        assert events[1][2].startswith("invalid message: data")
        body = frame("pipe", [1], ["a", "b"], [1])
        session.receive(B, body, 0.0)
        [pipe], events = take(session)
        assert (pipe.kinds, pipe.received) == ([], (1, len(body[0]), 0, 0))
        what = "invalid message: pipe has 1 kinds, 2 request ids and 1 data items"
        assert events == [("error", "a", what), ("error", "b", what)]

    def test_a_pipe_names_its_sender_s_generation_and_a_gone_the_dead_one_s(
        self, session: StageSession
    ) -> None:
        # docs/wire.md section 8, "Restarts": process 0 of stage 1 died and was started
        # again (generation 1). A consumer that reads the new process's data before the
        # gone of the dead one (two connections, no order) must tell them apart: the frame
        # carries its link's generation, the gone names the dead one's, and the late
        # message of the dead link is dropped unread, not the new one's.
        welcome(session)
        new = frame("pipe", [1], ["a"], ["x"], {"a": []}, 0)
        session.receive(b"pipe-link-1.1-r0", new, 0.0)
        session.receive(A, frame("gone", "previous", "pipe-link-1.0-r0"), 0.0)
        session.receive(b"pipe-link-1.0-r0", frame("pipe", [1], ["b"], ["y"], {}, 0), 0.0)
        session.receive(b"pipe-link-1.1-r0", frame("pipe", [0], ["a"], ["z"], {}, 0), 0.0)
        to_loop, events = take(session)
        assert not events
        route, pipe, gone, late, more = to_loop
        assert isinstance(route, PipeRoute)
        assert isinstance(pipe, PipeInput)
        assert isinstance(more, PipeInput)
        assert pipe.req_ids == ["a"]
        assert pipe.received == (1, len(new[0]), 0, 1)
        assert more.data == ["z"]
        assert more.received[2:] == (0, 1)
        assert isinstance(gone, PipeGone)
        assert isinstance(late, PipeGone)
        assert (gone.side, gone.late, gone.replica, gone.generation) == ("previous", 0, 0, 0)
        assert (late.side, late.late) == ("previous", 1)
        # Generation 2 of replica 3; and a link without a replica (a stage of one process
        # that does not restart): generation 0, and its gone names none (any process).
        session.receive(b"pipe-link-1.2-r3", frame("pipe", [1], ["c"], [1], {}, 3), 0.0)
        session.receive(b"pipe-link-0.0", frame("pipe", [1], ["d"], [1]), 0.0)
        session.receive(A, frame("gone", "previous", "pipe-link-1.2-r3"), 0.0)
        session.receive(A, frame("gone", "previous", "pipe-link-0.0"), 0.0)
        (c, d, gone3, gone0), _ = take(session)
        assert c.received[2:] == (3, 2)
        assert d.received[2:] == (0, 0)
        assert (gone3.replica, gone3.generation) == (3, 2)
        assert (gone0.replica, gone0.generation) == (0, None)

    def test_a_credit_becomes_a_control(self, session: StageSession) -> None:
        session.receive(A, frame("credit", 3, 1200), 0.0)
        [credit], events = take(session)
        assert isinstance(credit, PipeCredit)
        assert (credit.items, credit.nbytes) == (3, 1200)
        assert not events

    def test_an_adds_with_unequal_lengths_errs_for_every_id(self, session: StageSession) -> None:
        session.receive(A, frame("adds", ["a", "b"], [1]), 0.0)
        to_loop, events = take(session)
        assert not to_loop
        what = "invalid message: adds has 2 request ids but 1 data items"
        assert events == [("error", "a", what), ("error", "b", what)]
        session.receive(A, frame("adds", [], [1]), 0.0)
        assert take(session) == (
            [],
            [("error", None, "invalid message: adds has 0 request ids but 1 data items")],
        )

    def test_an_empty_adds_is_nothing(self, session: StageSession) -> None:
        session.receive(A, frame("adds", [], []), 0.0)
        assert take(session) == ([], [])

    def test_an_invalid_utility_argument_fails_the_call_as_wire_md_shows(
        self, session: StageSession, calls: CallTable
    ) -> None:
        session.receive(A, frame("utility", 9, "f", [{1.5: 0}]), 0.0)
        to_loop, [(kind, call_id, result, error)] = take(session)
        assert not to_loop
        assert (kind, call_id, result) == ("utility", 9, None)
        assert error.startswith("ProtocolError('invalid message: args[0]")
        assert len(calls) == 0

    @pytest.mark.parametrize("drain", [-1.0, float("inf"), float("nan")])
    def test_a_shutdown_drain_that_is_not_a_number_at_least_zero_stops_nothing(
        self, session: StageSession, drain: float
    ) -> None:
        session.receive(A, frame("shutdown", drain), 0.0)
        to_loop, [(kind, rid, message)] = take(session)
        assert not to_loop
        assert (kind, rid) == ("error", None)
        assert message.startswith("invalid message: shutdown drain must be >= 0")

    def test_a_shutdown_with_nil_drain_stops_nothing(self, session: StageSession) -> None:
        session.receive(A, frame("shutdown", None), 0.0)
        to_loop, [(kind, rid, message)] = take(session)
        assert not to_loop
        assert (kind, rid) == ("error", None)
        assert message.startswith("invalid message (")

    def test_a_frame_that_is_not_msgpack_is_an_unscoped_error(self, session: StageSession) -> None:
        session.receive(A, [b"\xc1"], 0.0)
        to_loop, [(kind, rid, message)] = take(session)
        assert not to_loop
        assert (kind, rid) == ("error", None)
        assert message.startswith("invalid message (1 bytes): ")

    @pytest.mark.parametrize(
        ("msg", "scoped"),
        [
            (("add", "r1"), [("error", "r1")]),
            (("adds", ["a", "b"], "not a list"), [("error", "a"), ("error", "b")]),
            (("utility", 5, 17, []), [("utility", 5)]),
            (("abort", "r1"), [("error", None)]),
            (("no such tag", 1), [("error", None)]),
            ((1, 2, 3), [("error", None)]),
        ],
    )
    def test_a_bad_frame_is_scoped_to_what_it_names(
        self, session: StageSession, msg: tuple[Any, ...], scoped: list[tuple[Any, ...]]
    ) -> None:
        session.receive(A, frame(*msg), 0.0)
        to_loop, events = take(session)
        assert not to_loop
        assert [ev[:2] for ev in events] == scoped
        for ev in events:
            text = ev[3] if ev[0] == "utility" else ev[2]
            assert "invalid message (" in text

    def test_a_failure_while_handling_a_frame_is_an_unscoped_error_not_a_crash(
        self, session: StageSession, output: FakeOutput, caplog: pytest.LogCaptureFixture
    ) -> None:
        def broken() -> tuple[int, int]:
            raise RuntimeError("injected")

        output.begin_session = broken  # type: ignore[method-assign]
        with caplog.at_level(logging.ERROR, logger="enginecore.stage"):
            session.receive(A, frame("hello", V, "test"), 0.0)
        assert session.events == [
            ("error", None, "stage failed to handle a frame: RuntimeError('injected')")
        ]
        assert "error while handling an input frame" in caplog.text


class TestCallTable:
    def test_ids_are_the_stages_and_each_call_closes_once(self) -> None:
        table = CallTable()
        a = table.open(1, 7)
        b = table.open(2, 7)  # another client's call 7
        assert a != b
        assert len(table) == 2
        assert table.close(b) == (2, 7)
        assert table.close(a) == (1, 7)
        assert table.close(a) is None
        assert len(table) == 0


class TestSessionGate:
    def test_loop_events_of_a_previous_session_are_dropped(self) -> None:
        gate = SessionGate(detached_max=10)
        gate.set_detached(False)
        assert gate.admit_loop(False, 1)
        epoch = gate.begin()
        assert gate.gated
        assert not gate.admit_loop(False, 1)  # the loop has not applied the new session
        gate.loop_begun(epoch)
        assert not gate.gated
        assert gate.admit_loop(False, 1)

    def test_detached_keeps_up_to_the_bound_and_counts_the_rest(self) -> None:
        gate = SessionGate(detached_max=3)
        assert gate.detached
        assert gate.admit(False, 2)
        assert not gate.admit(False, 2)
        assert gate.admit(False, 1)
        assert gate.admit(True, 100)  # the last event is never dropped
        assert gate.take_dropped() == 2
        assert not gate.admit(False, 1)
        assert gate.set_detached(False) == 1  # the period's drops, and counting restarts
        assert not gate.gated
        gate.set_detached(True)
        assert gate.admit(False, 3)

    def test_a_session_the_loop_begins_while_detached_stays_gated(self) -> None:
        # The client's output connection was lost before the loop applied its session:
        # the detached bound still holds for the loop's events.
        gate = SessionGate(detached_max=1)
        gate.set_detached(False)
        epoch = gate.begin()
        gate.set_detached(True)
        gate.loop_begun(epoch)
        assert gate.gated
        assert gate.admit_loop(False, 1)
        assert not gate.admit_loop(False, 1)
        assert gate.take_dropped() == 1


# -- a stage that serves several clients (serve --max-clients) ---------------------------------


class FakeClients:
    """The multi-client output side (``_fanout.Fanout``), as the session sees it: records
    the sockets it opens and the events posted to each session."""

    def __init__(self, fail: bool = False) -> None:
        self.opened: list[int] = []
        self.posted: list[tuple[int, Any]] = []
        self.fail = fail
        self.gone: list[tuple[int, str]] = []

    def open_session(self, epoch: int) -> str:
        if self.fail:
            raise OSError("address in use")
        self.opened.append(epoch)
        return f"ipc://out-{epoch}"

    def post_to(self, epoch: int, item: Any, weight: int) -> None:
        self.posted.append((epoch, item))

    # What the loop cut (a client that fell behind), for the session to take.
    @property
    def gone_waiting(self) -> bool:
        return bool(self.gone)

    def take_gone(self) -> list[tuple[int, str]]:
        gone, self.gone = self.gone, []
        return gone

    # ClientsTarget: the loop thread's side, never called by the session.
    def joined(self, epoch: int) -> None:
        raise AssertionError("the session never applies a control")

    def sender(self, epoch: int) -> None:
        raise AssertionError("the session never applies a control")

    def left(self, epoch: int) -> None:
        raise AssertionError("the session never applies a control")


def multi(clients: FakeClients, max_clients: int = 2, timeout: float = 10.0) -> MultiStageSession:
    return MultiStageSession(
        FakeOutput(),
        CallTable(),
        clients=clients,
        max_clients=max_clients,
        engine_name="eng",
        output_address="ipc://out",
        session_timeout=timeout,
    )


def controls(to_loop: list[Any]) -> list[tuple[str, int]]:
    """The client controls in *to_loop*, as (kind, epoch)."""
    kinds = {ClientJoined: "joined", ClientInput: "input", ClientLeft: "left"}
    return [(kinds[type(m)], m.epoch) for m in to_loop if type(m) in kinds]


class TestMultiClient:
    def test_each_client_is_welcomed_with_an_output_socket_of_its_own(self) -> None:
        clients = FakeClients()
        session = multi(clients)
        session.receive(A, frame("hello", V, "a"), 0.0)
        session.receive(B, frame("hello", V, "b"), 0.0)
        got = replies(session)
        assert [(who, r[0], r[2]) for who, r in got] == [
            (A, "welcome", "ipc://out-1"),
            (B, "welcome", "ipc://out-2"),
        ]
        assert clients.opened == [1, 2]
        assert controls(session.to_loop) == [("joined", 1), ("joined", 2)]
        assert session.attached
        assert session.expires

    def test_a_hello_when_full_is_rejected_with_the_reason(self) -> None:
        clients = FakeClients()
        session = multi(clients)
        for ident in (A, B):
            session.receive(ident, frame("hello", V, "x"), 0.0)
        replies(session)
        session.receive(C, frame("hello", V, "c"), 1.0)
        [(who, reply)] = replies(session)
        assert who == C
        assert reply[0] == "reject"
        assert "at most 2 clients" in reply[2]
        assert "--max-clients" in reply[2]
        assert clients.opened == [1, 2]

    def test_a_hello_when_full_detaches_a_client_silent_past_the_timeout(self) -> None:
        clients = FakeClients()
        session = multi(clients, timeout=10.0)
        session.receive(A, frame("hello", V, "a"), 0.0)
        session.receive(B, frame("hello", V, "b"), 5.0)
        take(session)
        replies(session)
        session.receive(C, frame("hello", V, "c"), 10.5)  # A silent 10.5 s, B 5.5 s
        [(who, reply)] = replies(session)
        assert (who, reply[0], reply[2]) == (C, "welcome", "ipc://out-3")
        assert controls(session.to_loop) == [("left", 1), ("joined", 3)]
        assert set(session.clients) == {B, C}

    def test_a_silent_client_is_detached_at_its_session_timeout(self) -> None:
        session = multi(FakeClients(), timeout=10.0)
        session.receive(A, frame("hello", V, "a"), 0.0)
        session.receive(B, frame("hello", V, "b"), 0.0)
        session.receive(B, frame("ping", 1), 6.0)
        take(session)
        assert session.wait_ms(6.0) == 4000  # A's deadline comes first
        session.settle(9.9)
        assert not session.to_loop
        session.settle(10.0)
        assert controls(session.to_loop) == [("left", 1)]
        assert set(session.clients) == {B}
        assert session.wait_ms(10.0) == 6000
        session.receive(B, frame("bye"), 11.0)
        assert controls(session.to_loop) == [("left", 1), ("left", 2)]
        assert not session.expires
        assert session.wait_ms(11.0) is None

    def test_the_loop_learns_who_sends_only_when_the_sender_changes(self) -> None:
        session = multi(FakeClients())
        session.receive(A, frame("hello", V, "a"), 0.0)
        session.receive(B, frame("hello", V, "b"), 0.0)
        take(session)
        session.receive(A, frame("add", "a1", 1), 1.0)
        session.receive(A, frame("add", "a2", 1), 1.0)
        session.receive(B, frame("abort", ["b1"]), 1.0)
        session.receive(A, frame("utility", 7, "echo", []), 1.0)
        session.receive(B, frame("bye"), 1.0)
        kinds = [
            (type(m).__name__, getattr(m, "epoch", None) or getattr(m, "req_id", None))
            for m in session.to_loop
        ]
        assert kinds == [
            ("ClientInput", 1),
            ("Add", "a1"),
            ("Add", "a2"),
            ("ClientInput", 2),
            ("Abort", None),
            ("ClientInput", 1),
            ("Utility", None),
            ("ClientLeft", 2),
        ]

    def test_utility_calls_are_opened_in_the_senders_session(self) -> None:
        calls = CallTable()
        session = MultiStageSession(
            FakeOutput(),
            calls,
            clients=FakeClients(),
            max_clients=2,
            engine_name="eng",
            output_address="ipc://out",
            session_timeout=10.0,
        )
        session.receive(A, frame("hello", V, "a"), 0.0)
        session.receive(B, frame("hello", V, "b"), 0.0)
        take(session)
        session.receive(B, frame("utility", 5, "echo", []), 0.0)
        session.receive(A, frame("utility", 5, "echo", []), 0.0)
        ids = [m.call_id for m in session.to_loop if isinstance(m, Utility)]
        assert [calls.close(i) for i in ids] == [(2, 5), (1, 5)]

    def test_events_go_to_the_senders_own_socket(self) -> None:
        clients = FakeClients()
        session = multi(clients)
        session.receive(A, frame("hello", V, "a"), 0.0)
        session.receive(B, frame("hello", V, "b"), 0.0)
        take(session)
        replies(session)
        session.receive(B, frame("ping", 3), 0.0)
        session.receive(A, [b"\xc1"], 0.0)  # not msgpack: an unscoped error
        session.receive(A, frame("stats", 9), 0.0)
        assert [(e, ev[0]) for e, ev in clients.posted] == [
            (2, "pong"),
            (1, "error"),
            (1, "utility"),
        ]
        assert not session.events
        assert not session.replies

    def test_a_peer_that_is_not_attached_cannot_reach_the_engine(self) -> None:
        clients = FakeClients()
        session = multi(clients)
        session.receive(A, frame("hello", V, "a"), 0.0)
        take(session)
        replies(session)
        messages: list[tuple[Any, ...]] = [
            ("add", "x", 1),
            ("abort", ["x"]),
            ("shutdown",),
            ("utility", 1, "echo", []),
        ]
        for msg in messages:
            session.receive(C, frame(*msg), 0.0)
            [(who, reply)] = replies(session)
            assert (who, reply[0], reply[2]) == (C, "reject", NOT_ATTACHED)
        assert not session.to_loop
        session.receive(C, frame("stats", 4), 0.0)  # an observer's: answered on the input socket
        [(who, reply)] = replies(session)
        assert (who, reply[0], reply[1]) == (C, "utility", 4)
        assert not clients.posted

    def test_a_socket_that_cannot_be_bound_rejects_the_hello(self, caplog: Any) -> None:
        session = multi(FakeClients(fail=True))
        with caplog.at_level(logging.ERROR, logger="enginecore.stage"):
            session.receive(A, frame("hello", V, "a"), 0.0)
        [(who, reply)] = replies(session)
        assert who == A
        assert reply[0] == "reject"
        assert "address in use" in reply[2]
        assert not session.to_loop
        assert not session.attached

    def test_the_attached_client_saying_hello_again_is_welcomed_again(self) -> None:
        clients = FakeClients()
        session = multi(clients)
        for _ in range(2):
            session.receive(A, frame("hello", V, "a"), 0.0)
        assert [r[2] for _, r in replies(session)] == ["ipc://out-1", "ipc://out-1"]
        assert clients.opened == [1]

    def test_a_client_whose_output_connection_closed_is_detached_after_the_grace(
        self, caplog: Any
    ) -> None:
        session = multi(FakeClients(), timeout=100.0)
        session.receive(A, frame("hello", V, "a"), 0.0)
        session.receive(B, frame("hello", V, "b"), 0.0)
        take(session)
        replies(session)
        session.client_output_changed(1, +1, 0.1)  # A's PULL connects
        session.client_output_changed(2, +1, 0.1)
        session.client_output_changed(1, -1, 5.0)  # and goes, without a bye
        assert session.wait_ms(5.0) == OUTPUT_GRACE_S * 1000  # before B's session timeout
        session.settle(5.0 + OUTPUT_GRACE_S - 0.01)
        assert not session.to_loop
        with caplog.at_level(logging.WARNING, logger="enginecore.stage"):
            session.settle(5.0 + OUTPUT_GRACE_S)
        assert controls(session.to_loop) == [("left", 1)]
        assert set(session.clients) == {B}
        assert "lost its output connection" in caplog.text
        # What it sends afterwards, a ping too, is answered: its session is lost.
        take(session)
        for msg in (("ping", 1), ("add", "x", 1)):
            session.receive(A, frame(*msg), 7.0)
            [(who, reply)] = replies(session)
            assert who == A
            assert reply[0] == "reject"
            assert reply[2].startswith(SESSION_LOST)
            assert "lost its output connection" in reply[2]
        assert not session.to_loop
        # It may attach again, as a new session.
        session.receive(A, frame("hello", V, "a"), 8.0)
        [(_, reply)] = replies(session)
        assert (reply[0], reply[2]) == ("welcome", "ipc://out-3")
        session.receive(A, frame("ping", 2), 8.0)
        assert not replies(session)

    def test_an_output_that_comes_back_within_the_grace_keeps_its_session(self) -> None:
        session = multi(FakeClients(), timeout=100.0)
        session.receive(A, frame("hello", V, "a"), 0.0)
        take(session)
        session.client_output_changed(1, +1, 0.1)
        session.client_output_changed(1, -1, 1.0)
        session.client_output_changed(1, +1, 1.5)  # a TCP connection that broke, reconnected
        session.settle(1.0 + OUTPUT_GRACE_S + 1)
        assert not session.to_loop
        assert session.wait_ms(3.0) == 97_000  # only its session timeout is left
        # A client that never connected its PULL waits for its session timeout as before.
        session.receive(B, frame("hello", V, "b"), 0.0)
        take(session)
        session.settle(50.0)
        assert not session.to_loop
        assert set(session.clients) == {A, B}

    def test_a_client_the_output_side_cut_is_detached_in_order(self, caplog: Any) -> None:
        clients = FakeClients()
        session = multi(clients, timeout=100.0)
        session.receive(A, frame("hello", V, "a"), 0.0)
        session.receive(B, frame("hello", V, "b"), 0.0)
        session.receive(A, frame("add", "a1", 1), 0.0)
        take(session)
        replies(session)
        clients.gone.append((1, "fell behind: 70000 events"))
        with caplog.at_level(logging.WARNING, logger="enginecore.stage"):
            session.receive(B, frame("add", "b1", 1), 1.0)  # the next read takes it first
        assert [type(m).__name__ for m in session.to_loop] == ["ClientLeft", "ClientInput", "Add"]
        assert controls(session.to_loop)[0] == ("left", 1)
        assert "fell behind: 70000 events" in caplog.text
        assert set(session.clients) == {B}
        session.receive(A, frame("ping", 3), 1.0)
        [(who, reply)] = replies(session)
        assert who == A
        assert reply[2].startswith(SESSION_LOST)
        assert "fell behind" in reply[2]
        # A cut that settle() finds (the wake-up pipe fired), and one of a client that has
        # already left, which is ignored.
        take(session)
        clients.gone += [(1, "again"), (2, "fell behind")]
        session.settle(2.0)
        assert controls(session.to_loop) == [("left", 2)]
        assert not session.attached

    def test_a_ping_from_a_peer_without_a_session_is_rejected(self) -> None:
        # A client whose connection was made again after a long pause has a new routing id.
        clients = FakeClients()
        session = multi(clients)
        session.receive(A, frame("hello", V, "a"), 0.0)
        take(session)
        replies(session)
        session.receive(C, frame("ping", 4), 1.0)
        assert replies(session) == [(C, ["reject", V, NO_SESSION])]
        assert NO_SESSION.startswith(SESSION_LOST)
        assert not clients.posted

    def test_a_bye_forgets_a_lost_session(self) -> None:
        clients = FakeClients()
        session = multi(clients)
        session.receive(A, frame("hello", V, "a"), 0.0)
        take(session)
        clients.gone.append((1, "fell behind"))
        session.settle(1.0)
        replies(session)
        session.receive(A, frame("bye"), 1.0)
        session.receive(A, frame("ping", 1), 1.0)
        # A peer that said bye is a stranger again.
        assert replies(session) == [(A, ["reject", V, NO_SESSION])]

    def test_max_clients_must_be_at_least_two(self) -> None:
        with pytest.raises(ValueError, match="max_clients >= 2"):
            multi(FakeClients(), max_clients=1)


class MultiSessionMachine(RuleBasedStateMachine):
    """Hellos, messages, byes, silences, timeouts, output connections that come and go, and
    clients cut for falling behind, from four peers on a stage of two clients, checked
    against a model: never more than two attached; every loop message comes from an
    attached client, after a ClientInput naming it (as the loop tracks it); every
    ClientJoined is followed by at most one ClientLeft; events only reach attached clients'
    sessions; the next deadline is the earliest session timeout or output grace."""

    PEERS = (A, B, C, b"client-d")

    def __init__(self) -> None:
        super().__init__()
        self.clients = FakeClients()
        self.session = multi(self.clients, max_clients=2, timeout=10.0)
        self.now = 0.0
        self.attached: dict[bytes, int] = {}  # the model: peer -> epoch
        self.seen: dict[bytes, float] = {}
        self.peers: dict[int, int] = {}  # epoch -> output connections
        self.lost_at: dict[int, float] = {}  # epoch -> when its last one closed
        self.loop_sender: int | None = None
        self.joined: set[int] = set()
        self.left: set[int] = set()

    def _check(self, ident: bytes | None) -> None:
        session = self.session
        for ident_, reply in replies(session):
            if reply[0] == "welcome":
                self.attached[ident_] = int(reply[2].rsplit("-", 1)[1])
                self.seen[ident_] = self.now
        for msg in session.to_loop:
            if isinstance(msg, ClientJoined):
                assert msg.epoch not in self.joined
                self.joined.add(msg.epoch)
            elif isinstance(msg, ClientLeft):
                assert msg.epoch in self.joined
                assert msg.epoch not in self.left
                self.left.add(msg.epoch)
                self.attached = {p: e for p, e in self.attached.items() if e != msg.epoch}
            elif isinstance(msg, ClientInput):
                self.loop_sender = msg.epoch
            else:
                assert ident is not None
                assert self.attached.get(ident) == self.loop_sender
                assert self.loop_sender in self.joined
                assert self.loop_sender not in self.left
        session.to_loop.clear()
        for epoch, _ in self.clients.posted:
            assert epoch in self.joined
            assert epoch not in self.left
        self.clients.posted.clear()
        assert len(session.clients) <= 2
        assert {c.epoch for c in session.clients.values()} == set(self.attached.values())

    @rule(peer=st.sampled_from(PEERS))
    def hello(self, peer: bytes) -> None:
        self.session.receive(peer, frame("hello", V, "p"), self.now)
        if peer in self.attached:
            self.seen[peer] = self.now
        self._check(peer)

    @rule(
        peer=st.sampled_from(PEERS),
        msg=st.sampled_from(
            [("add", "r", 1), ("abort", ["r"]), ("utility", 1, "echo", []), ("ping", 1)]
        ),
    )
    def message(self, peer: bytes, msg: tuple[Any, ...]) -> None:
        self.session.receive(peer, frame(*msg), self.now)
        if peer in self.attached:
            self.seen[peer] = self.now
        self._check(peer)

    @rule(peer=st.sampled_from(PEERS))
    def bye(self, peer: bytes) -> None:
        self.session.receive(peer, frame("bye"), self.now)
        self._check(peer)

    @rule(peer=st.sampled_from(PEERS), delta=st.sampled_from([1, -1]))
    def output_connection(self, peer: bytes, delta: int) -> None:
        epoch = self.attached.get(peer)
        if epoch is None or (delta < 0 and not self.peers.get(epoch)):
            return
        self.session.client_output_changed(epoch, delta, self.now)
        self.peers[epoch] = self.peers.get(epoch, 0) + delta
        if self.peers[epoch]:
            self.lost_at.pop(epoch, None)
        else:
            self.lost_at[epoch] = self.now
        self._check(None)

    @rule(peer=st.sampled_from(PEERS))
    def cut(self, peer: bytes) -> None:
        epoch = self.attached.get(peer)
        if epoch is not None:
            self.clients.gone.append((epoch, "fell behind"))
            self.session.settle(self.now)
            self._check(None)
            assert peer not in self.attached

    @rule(seconds=st.sampled_from([0.5, 1.0, 4.0, 10.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        self.session.settle(self.now)
        self._check(None)

    @invariant()
    def nobody_silent_past_the_timeout_after_a_settle(self) -> None:
        wait = self.session.wait_ms(self.now)
        if self.attached:
            due = min(self.seen[p] + 10.0 for p in self.attached)
            for epoch in self.attached.values():
                if epoch in self.lost_at:
                    due = min(due, self.lost_at[epoch] + OUTPUT_GRACE_S)
            assert wait == max(0, math.ceil((due - self.now) * 1000))
        else:
            assert wait is None


TestMultiSessionMachine = MultiSessionMachine.TestCase
TestMultiSessionMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
