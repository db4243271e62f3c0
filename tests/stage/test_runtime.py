"""A stage's runtime end to end, in this process, with engines written for each test and a
raw client on real sockets: what a step sends, what the engine receives, how much goes in
one frame, and what happens to what cannot cross the wire."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from enginecore import CountdownEngine, RequestRejected
from enginecore.stage import PROTOCOL_VERSION
from enginecore.stage._runtime import EXIT_FATAL, EXIT_OK, StageBindError, StageRuntime
from enginecore.stage._stage_engine import LIVE_IN_STAGE
from enginecore.stage.testing import EchoEngine, ScriptedEngine

from .conftest import wait_until
from .raw import Event, InProcessStage, RawClient, in_process_stage


class Canned:
    """An engine whose steps return canned outputs: utility ``step`` makes the next step
    return the next list of *steps*. Records what it receives."""

    def __init__(self, *steps: list[Any]) -> None:
        self._steps = list(steps)
        self._due = 0
        self.added: list[tuple[str, Any]] = []
        self.aborted: list[str] = []

    def has_work(self) -> bool:
        return self._due > 0

    def add(self, req_id: str, data: Any) -> None:
        self.added.append((req_id, data))

    def abort(self, req_ids: Sequence[str]) -> None:
        self.aborted.extend(req_ids)

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        if name == "step":
            self._due += 1
        return list(args)

    def step(self) -> list[Any]:
        self._due -= 1
        return self._steps.pop(0)


def _but_lone_reports(client: RawClient, events: list[Event]) -> list[Event]:
    """*events* without the load reports that came alone (``["outputs", [], [], []]``, the
    report kept in ``client.loads``): an idle stage sends one when what is live changed
    with no step (an add that an engine here holds without stepping it, an abort), so
    among the events wherever its interval let it go (docs/observability.md). Each one
    left out must have carried a report."""
    kept = [ev for ev in events if ev != ["outputs", [], [], []]]
    assert len(events) - len(kept) <= len(client.loads), "outputs with none, and no report"
    return kept


def _step(client: RawClient, call_id: int) -> list[Event]:
    """Run the engine's next canned step; every event up to the answer to the second call
    after it, the two calls' answers left out (*call_id* + 1 and *call_id* + 1,000).

    Two calls, because the first may be answered before the step runs: when the loop took
    the ``step`` call in its blocking ``get()``, the next iteration drains what came since
    (the first call, sent as soon as the step call was answered) before it steps (rules 2
    and 3). The second call is sent after that drain, so the step's outputs come first."""
    events = client.call(call_id, "step")
    events += client.call(call_id + 1, "sync")[:-1]
    return _but_lone_reports(client, events + client.call(call_id + 1000, "sync")[:-1])


class TestOutputs:
    def test_each_step_is_one_outputs_event_in_the_order_the_step_produced(
        self, no_leftovers: str
    ) -> None:
        with in_process_stage(CountdownEngine(), no_leftovers) as (_, client):
            client.send("adds", ["a", "b", "c"], [3, 1, 2])
            events = client.until(lambda ev: ev[0] == "outputs" and ev[1] == ["a"])
        assert events == [
            ["outputs", ["a", "b", "c"], [False, True, False], [2, 0, 1]],
            ["outputs", ["a", "c"], [False, True], [1, 0]],
            ["outputs", ["a"], [True], [0]],
        ]

    def test_a_step_without_outputs_sends_nothing(self, no_leftovers: str) -> None:
        with in_process_stage(Canned([], [("r", 1)]), no_leftovers) as (_, client):
            assert _step(client, 1) == [["utility", 1, [], None]]
            assert _step(client, 3) == [
                ["utility", 3, [], None],
                ["outputs", ["r"], [False], [1]],
            ]

    def test_unrouted_outputs_have_no_request(self, no_leftovers: str) -> None:
        with in_process_stage(Canned([("r", 1), "tick", ("r", 2, 3)]), no_leftovers) as (
            _,
            client,
        ):
            assert _step(client, 1)[-1] == [
                "outputs",
                ["r", None, None],
                [False, False, False],
                [1, "tick", ["r", 2, 3]],
            ]


class TestRouteHooks:
    @pytest.mark.parametrize(
        "result",
        [
            None,
            (["a"], [False]),
            (("a",), [False], [1]),
            (["a", "b"], [False], [1]),
            (["a"], [1], [1]),
            ([7], [False], [1]),
        ],
    )
    def test_a_bad_route_outputs_result_is_fatal_with_the_reason(
        self, no_leftovers: str, result: Any
    ) -> None:
        engine = Canned([("a", 1)])
        engine.route_outputs = lambda outs: result  # type: ignore[attr-defined]
        with in_process_stage(engine, no_leftovers) as (stage, client):
            client.send("utility", 1, "step", [])
            events = client.until(lambda ev: ev[0] == "fatal")
            assert stage.wait() == EXIT_FATAL
        assert events[:-1] == [["utility", 1, [], None]]  # nothing of the step itself
        message = events[-1][1]
        assert "Canned.route_outputs() must return (req_ids: list[str | None]" in message
        assert "one item per output (1)" in message

    def test_a_bad_route_output_is_fatal_after_the_outputs_routed_before_it(
        self, no_leftovers: str
    ) -> None:
        engine = Canned([("a", 1), ("b", 2), ("c", 3)])
        engine.route_output = lambda out: out if out[0] == "b" else (out[0], False, out[1])  # type: ignore[attr-defined]
        with in_process_stage(engine, no_leftovers) as (stage, client):
            client.send("utility", 1, "step", [])
            events = client.until(lambda ev: ev[0] == "fatal")
            assert stage.wait() == EXIT_FATAL
        assert events[1:-1] == [["outputs", ["a"], [False], [1]]]
        assert "Canned.route_output() must return" in events[-1][1]

    @pytest.mark.parametrize("hook", ["route_outputs", "route_output", None])
    @pytest.mark.parametrize("result", [None, 5])
    def test_a_step_that_returns_no_iterable_is_fatal_naming_the_step(
        self, no_leftovers: str, hook: str | None, result: Any
    ) -> None:
        engine = Canned(result)
        if hook == "route_outputs":
            engine.route_outputs = lambda outs: ([None] * len(outs), [False] * len(outs), outs)  # type: ignore[attr-defined]
        elif hook == "route_output":
            engine.route_output = lambda out: (None, False, out)  # type: ignore[attr-defined]
        with in_process_stage(engine, no_leftovers) as (stage, client):
            client.send("utility", 1, "step", [])
            events = client.until(lambda ev: ev[0] == "fatal")
            assert stage.wait() == EXIT_FATAL
        message = events[-1][1]
        assert "Canned.step() must return an iterable of outputs (a list)" in message
        assert f"got {result!r}" in message

    @pytest.mark.parametrize("result", ["ab", b"ab", {"a": 1}], ids=repr)
    def test_a_step_that_returns_a_str_or_a_mapping_is_fatal_naming_the_step(
        self, no_leftovers: str, result: Any
    ) -> None:
        # Iterable, but characters or keys are no outputs: the request would wait for ever.
        engine = Canned(result)
        with in_process_stage(engine, no_leftovers) as (stage, client):
            client.send("utility", 1, "step", [])
            events = client.until(lambda ev: ev[0] == "fatal")
            assert stage.wait() == EXIT_FATAL
        message = events[-1][1]
        assert f"Canned.step() must return a list of outputs, got a {type(result).__name__}" in (
            message
        )


class _Unencodable:
    pass


class TestUnencodableOutputs:
    @pytest.mark.parametrize(
        ("bad", "why"),
        [
            ({1, 2}, "builtins.set is not wire-encodable"),  # refused on the loop thread
            ([1, _Unencodable()], r"output payload\[1\]: .*_Unencodable"),
            ("bad \ud800", "surrogates not allowed"),  # refused by msgspec, output thread
            (2**64, "can't serialize ints"),
            (np.array([object()]), "dtype object cannot cross the wire"),
        ],
    )
    def test_only_the_bad_outputs_request_ends(self, no_leftovers: str, bad: Any, why: str) -> None:
        step = [("a", 1), ("b", bad), ("c", np.float32(2.5)), ("d", b"x" * 2000)]
        engine = Canned(step)
        with in_process_stage(engine, no_leftovers) as (_, client):
            events = _step(client, 1)
            events += client.call(3, "sync")  # after the abort the stage queued for b
        outputs = [ev for ev in events if ev[0] == "outputs"]
        errors = [ev for ev in events if ev[0] == "error"]
        assert outputs == [["outputs", ["a", "c", "d"], [False] * 3, [1, 2.5, b"x" * 2000]]]
        assert len(errors) == 1
        assert errors[0][1] == "b"
        assert errors[0][2].startswith("output cannot be encoded, request aborted")
        assert re.search(why, errors[0][2]), errors[0][2]
        # The request was dropped from the engine (the output side feeds the loop's input),
        # with no aborted event: the error was its last event.
        assert engine.aborted == ["b"]
        assert not [ev for ev in events if ev[0] == "aborted"]

    def test_an_unencodable_last_output_ends_its_request_without_an_abort(
        self, no_leftovers: str
    ) -> None:
        engine = Canned([("a", {1}), ("b", 2)])
        engine.is_finished = lambda out: True  # type: ignore[attr-defined]
        with in_process_stage(engine, no_leftovers) as (_, client):
            events = _step(client, 1)
            events += client.call(3, "sync")
        assert ["outputs", ["b"], [True], [2]] in events
        [error] = [ev for ev in events if ev[0] == "error"]
        assert error[1] == "a"
        assert error[2].startswith("the last output cannot be encoded")
        assert engine.aborted == []  # the engine is done with it already

    def test_the_error_of_a_bad_output_ends_its_request_before_its_later_outputs(
        self, no_leftovers: str
    ) -> None:
        # A bad output, then more of its request in the same step, its last one included:
        # the error is the request's last event, once. (The last output went out first:
        # the request ended finished, the error came late and was ignored, and the bad
        # output was lost without a word; a second bad one made a second error.)
        engine = Canned([("a", {1}), ("a", 2), ("a", {3}), ("b", 1), ("a", "last")])
        engine.is_finished = lambda out: out[1] == "last"  # type: ignore[attr-defined]
        with in_process_stage(engine, no_leftovers) as (_, client):
            events = _step(client, 1)
            events += client.call(3, "sync")
        outputs = [ev for ev in events if ev[0] == "outputs"]
        assert outputs == [["outputs", ["b"], [False], [1]]]
        [error] = [ev for ev in events if ev[0] == "error"]
        assert error[1] == "a"
        assert error[2].startswith("output cannot be encoded, request aborted")

    def test_an_unrouted_unencodable_output_is_an_unscoped_error(self, no_leftovers: str) -> None:
        engine = Canned([("a", 1), {3}])
        with in_process_stage(engine, no_leftovers) as (_, client):
            events = _step(client, 1)
        assert ["outputs", ["a"], [False], [1]] in events
        [error] = [ev for ev in events if ev[0] == "error"]
        assert error[1] is None
        assert "unrouted engine output cannot be encoded" in error[2]
        assert engine.aborted == []


class TestFrames:
    def test_more_than_512_waiting_events_leave_in_frames_of_at_most_512_in_order(
        self, no_leftovers: str
    ) -> None:
        # 1,300 utility answers pile up while the attached client has not connected its PULL
        # yet (they wait for it, unbounded); when it connects, they leave in frames of at
        # most 512 events, in order.
        answered = threading.Event()

        class Counting(EchoEngine):
            def utility(self, name: str, args: tuple[Any, ...]) -> Any:
                if args == (1299,):
                    answered.set()
                return super().utility(name, args)

        stage = InProcessStage(Counting(), no_leftovers)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        pull = ctx.socket(zmq.PULL)
        try:
            dealer.connect(stage.address)
            dealer.send(msgspec.msgpack.encode(["hello", PROTOCOL_VERSION, "late pull"]))
            assert dealer.poll(5000)
            assert msgspec.msgpack.decode(dealer.recv())[0] == "welcome"
            for i in range(1300):
                dealer.send(msgspec.msgpack.encode(["utility", i, "echo", [i]]))
            assert answered.wait(10)
            time.sleep(0.05)  # the last answer reaches the output queue
            pull.connect(stage.runtime.output_address)
            frames: list[list[Any]] = []
            while sum(map(len, frames)) < 1300:
                assert pull.poll(5000)
                frames.append(msgspec.msgpack.decode(pull.recv()))
        finally:
            pull.close(linger=0)
            dealer.close(linger=0)
            ctx.term()
            stage.stop()
        assert [ev for frame in frames for ev in frame] == [
            ["utility", i, [i], None] for i in range(1300)
        ]
        assert max(map(len, frames)) == 512

    def test_input_errors_for_more_than_512_requests_leave_in_frames_of_512(
        self, no_leftovers: str
    ) -> None:
        ids = [f"r{i}" for i in range(1300)]
        with in_process_stage(EchoEngine(), no_leftovers) as (_, client):
            client.send("adds", ids, [1])  # 1,300 ids, one data item: every id fails
            events = client.until(lambda ev: ev[1] == "r1299")
            sizes = [len(msgspec.msgpack.decode(parts[0].bytes)) for parts in client.frames]
        assert [ev[1] for ev in events] == ids
        assert sizes == [512, 512, 276]
        assert all("1300 request ids but 1 data items" in ev[2] for ev in events)

    @pytest.mark.parametrize("path", ["loop thread", "output thread"])
    def test_a_step_whose_output_fails_to_encode_still_leaves_in_frames_of_at_most_512(
        self, no_leftovers: str, path: str
    ) -> None:
        # One step: a good output, one that msgspec refuses (2**64 passes the flat fast
        # path), and 600 that the loop refuses (a set), each ending its request: one
        # outputs event and 600 errors. The frame of the first 512 events grew to 513 when
        # the outputs event was replaced by its good outputs and an error for "p", after the
        # cut at 512. The loop thread sends a step of 512 outputs or more itself while the
        # output thread idles; the output thread sends it while it is busy, here with the
        # step's call answer, waiting for the client's PULL to connect.
        sets = [(f"s{i}", {i}) for i in range(600)]
        engine = _AbortSignalling(600, [("g", 1), ("p", 2**64), *sets])
        stage = InProcessStage(engine, no_leftovers)
        try:
            with RawClient(stage.address) as client:
                if path == "loop thread":
                    assert client.hello()[0] == "welcome"
                    client.send("utility", 1, "step", [])
                else:
                    client.send_hello()
                    client.send("utility", 1, "step", [])
                    # The loop posted the step: it has applied the drops of the sets' requests,
                    # which the step itself queued. Only now does the output thread get a peer.
                    assert engine.all_aborted.wait(10)
                    assert client.hello_reply()[0] == "welcome"
                events = client.until(lambda ev: ev[0] == "error" and ev[1] == "s599", 10)
                events += client.call(2, "sync")
                sizes = [len(msgspec.msgpack.decode(parts[0].bytes)) for parts in client.frames]
        finally:
            stage.stop()
        assert max(sizes) <= 512, sizes
        assert sum(sizes) == len(events) == 1 + 1 + 1 + 600 + 1  # answer, outputs, errors, sync
        assert [ev for ev in events if ev[0] == "outputs"] == [["outputs", ["g"], [False], [1]]]
        errors = [ev for ev in events if ev[0] == "error"]
        assert [ev[1] for ev in errors] == ["p", *(rid for rid, _ in sets)]
        assert "can't serialize ints" in errors[0][2]


class _AbortSignalling(Canned):
    """Canned whose ``all_aborted`` is set once *count* requests were aborted."""

    def __init__(self, count: int, *steps: list[Any]) -> None:
        super().__init__(*steps)
        self._count = count
        self.all_aborted = threading.Event()

    def abort(self, req_ids: Sequence[str]) -> None:
        super().abort(req_ids)
        if len(self.aborted) >= self._count:
            self.all_aborted.set()


class _Recording(EchoEngine):
    """EchoEngine that records what it receives."""

    def __init__(self) -> None:
        super().__init__()
        self.received: list[tuple[str, Any]] = []

    def add(self, req_id: str, data: Any) -> None:
        self.received.append((req_id, data))
        super().add(req_id, data)


class TestInput:
    def test_a_burst_of_more_than_512_messages_arrives_complete_and_in_order(
        self, no_leftovers: str
    ) -> None:
        # Queued in the client before the stage exists, so that the stage's input thread
        # finds them waiting and reads them in full bursts of 512. The hello goes first:
        # the answer is for this client's session (events of messages sent without one
        # never reach a client that is welcomed later).
        engine = _Recording()
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.SNDHWM, 0)
        pull = ctx.socket(zmq.PULL)
        dealer.connect(f"ipc://{no_leftovers}/in")
        try:
            dealer.send(msgspec.msgpack.encode(["hello", PROTOCOL_VERSION, "burst"]))
            for i in range(2100):
                dealer.send(msgspec.msgpack.encode(["add", f"r{i}", i]))
            dealer.send(msgspec.msgpack.encode(["utility", 1, "num_requests", []]))
            stage = InProcessStage(engine, no_leftovers)
            try:
                assert dealer.poll(5000)
                assert msgspec.msgpack.decode(dealer.recv())[0] == "welcome"
                pull.connect(stage.runtime.output_address)
                # Answered once the stage has applied the burst before it.
                events: list[Any] = []
                while not any(ev[0] == "utility" and ev[1] == 1 for ev in events):
                    assert pull.poll(10000)
                    events += msgspec.msgpack.decode(pull.recv())
            finally:
                stage.stop()
        finally:
            pull.close(linger=0)
            dealer.close(linger=0)
            ctx.term()
        assert engine.received == [(f"r{i}", i) for i in range(2100)]

    def test_adds_apply_in_list_order_between_other_messages(self, no_leftovers: str) -> None:
        engine = _Recording()
        with in_process_stage(engine, no_leftovers) as (_, client):
            client.send("adds", ["a", "b"], [1, 2])
            client.send("add", "c", 3)
            client.send("adds", ["d", "e", "f"], [4, 5, 6])
            client.send("adds", [], [])
            client.call(1, "echo")
        assert engine.received == [("a", 1), ("b", 2), ("c", 3), ("d", 4), ("e", 5), ("f", 6)]

    def test_adds_fails_only_its_invalid_items(self, no_leftovers: str) -> None:
        engine = _Recording()
        with in_process_stage(engine, no_leftovers) as (_, client):
            body = (
                b"\x93\xa4adds\x93\xa1a\xa1b\xa1c"
                b"\x93\x01\xc7\x01\x09x\x03"  # b's data: a foreign extension type
            )
            client.send_raw(body)
            events = client.call(1, "echo")
            events += client.call(2, "echo")
        assert engine.received == [("a", 1), ("c", 3)]
        [error] = [ev for ev in events if ev[0] == "error"]
        assert error[1] == "b"
        assert "extension type 9 is not allowed" in error[2]
        assert ["outputs", ["a", "c"], [True, True], [1, 3]] in events

    def test_adds_with_lists_of_different_lengths_fails_every_id(self, no_leftovers: str) -> None:
        engine = _Recording()
        with in_process_stage(engine, no_leftovers) as (_, client):
            client.send("adds", ["a", "b"], [1, 2, 3])
            events = client.call(1, "echo")
        assert [ev[1] for ev in events if ev[0] == "error"] == ["a", "b"]
        assert all("2 request ids but 3 data items" in ev[2] for ev in events[:-1])
        assert engine.received == []


class _Rejecting(_Recording):
    """Records every add; rejects the data ``"reject"`` (its message names the request),
    and raises ``KeyError`` for the data ``"crash"``."""

    def add(self, req_id: str, data: Any) -> None:
        self.received.append((req_id, data))
        if data == "reject":
            raise RequestRejected(f"no to {req_id}")
        if data == "crash":
            raise KeyError("crash")
        EchoEngine.add(self, req_id, data)


def _sync(client: RawClient, call_id: int) -> list[Event]:
    """Every event up to the answer to a utility call, that answer left out (and the load
    reports that came alone: :func:`_but_lone_reports`)."""
    return _but_lone_reports(client, client.call(call_id, "echo")[:-1])


class TestRequestScopedFailure:
    def test_a_rejected_add_is_an_error_for_that_request_only(self, no_leftovers: str) -> None:
        engine = _Rejecting()
        with in_process_stage(engine, no_leftovers) as (stage, client):
            client.send("add", "bad", "reject")
            client.send("add", "good", 7)
            events = _sync(client, 1) + _sync(client, 2)
            client.send("add", "bad", 8)  # the id was never admitted: free at once
            events += _sync(client, 3) + _sync(client, 4)
            assert stage.exit_code is None
        assert events == [
            ["error", "bad", "no to bad"],
            ["outputs", ["good"], [True], [7]],
            ["outputs", ["bad"], [True], [8]],
        ]
        assert engine.received == [("bad", "reject"), ("good", 7), ("bad", 8)]

    def test_bad_data_no_longer_kills_a_countdown_stage(self, no_leftovers: str) -> None:
        with in_process_stage(CountdownEngine(), no_leftovers) as (stage, client):
            client.send("adds", ["a", "bad", "c"], [2, {"prompt": 42}, 1])
            events = client.until(lambda ev: ev[0] == "outputs" and ev[1] == ["a"])
            assert stage.exit_code is None
        assert events == [
            ["error", "bad", "need an int >= 1 (a step count), got {'prompt': 42}"],
            ["outputs", ["a", "c"], [False, True], [1, 0]],
            ["outputs", ["a"], [True], [0]],
        ]

    def test_an_add_of_a_live_id_is_refused_without_calling_the_engine(
        self, no_leftovers: str
    ) -> None:
        engine = Canned()
        with in_process_stage(engine, no_leftovers) as (_, client):
            client.send("add", "a", 1)
            client.send("add", "a", 2)
            client.send("adds", ["b", "a", "b"], [3, 4, 5])
            events = _sync(client, 1)
        assert engine.added == [("a", 1), ("b", 3)]
        assert events == [
            ["error", "a", LIVE_IN_STAGE],
            ["error", "a", LIVE_IN_STAGE],
            ["error", "b", LIVE_IN_STAGE],
        ]

    def test_a_burst_is_applied_in_order_and_its_marker_id_is_an_ordinary_id(
        self, no_leftovers: str
    ) -> None:
        # An adds message reaches the loop as one Add whose req_id is a private marker
        # (_stage_engine.ADDS, compared by identity): a client's own "<adds>" is just an id.
        engine = Canned()
        with in_process_stage(engine, no_leftovers) as (_, client):
            client.send("add", "<adds>", 1)
            client.send("adds", ["x", "<adds>", "y"], [2, 3, 4])
            events = _sync(client, 1)
        assert engine.added == [("<adds>", 1), ("x", 2), ("y", 4)]
        assert events == [["error", "<adds>", LIVE_IN_STAGE]]

    def test_a_live_id_is_refused_across_clients(self, no_leftovers: str) -> None:
        # The serve scenario: a client adds "dup" and leaves; the next client's add
        # of "dup" killed the stage ("already live"). The engine must never see it. (By
        # default the detach aborts "dup": here it is kept running on purpose.)
        engine = ScriptedEngine()
        stage = InProcessStage(engine, no_leftovers, keep_requests_on_detach=True)
        try:
            with RawClient(stage.address) as first:
                assert first.hello()[0] == "welcome"
                first.send("add", "dup", 10**8)
                first.call(1, "echo")
                first.send("bye")
            with RawClient(stage.address) as second:
                assert second.hello()[0] == "welcome"
                second.send("add", "dup", 2)
                second.send("add", "mine", 2)
                error = second.until(lambda ev: ev[0] == "error")[-1]
                log = second.call(2, "log")[-1][2]
                second.send("abort", ["dup"])
                second.until(lambda ev: ev[0] == "aborted")
                assert stage.exit_code is None
        finally:
            stage.stop()
        assert error == ["error", "dup", LIVE_IN_STAGE]
        assert log == ["add dup", "add mine"]

    def test_any_other_exception_from_add_is_fatal(self, no_leftovers: str) -> None:
        engine = _Rejecting()
        with in_process_stage(engine, no_leftovers) as (stage, client):
            client.send("add", "a", "crash")
            client.send("add", "b", 1)
            events = client.until(lambda ev: ev[0] == "fatal")
            assert stage.wait() == EXIT_FATAL
        assert events == [["fatal", "KeyError('crash')"]]
        assert engine.received == [("a", "crash")]

    def test_a_rejection_message_that_cannot_be_encoded_still_reaches_its_request(
        self, no_leftovers: str
    ) -> None:
        class Surrogate(_Recording):
            def add(self, req_id: str, data: Any) -> None:
                raise RequestRejected("bad \ud800 text")

        with in_process_stage(Surrogate(), no_leftovers) as (_, client):
            client.send("add", "a", 1)
            events = _sync(client, 1)
        assert events == [["error", "a", ascii("bad \ud800 text")]]


class TestRoutingEndsARequest:
    def test_a_request_rejected_payload_ends_its_request_and_drops_it_from_the_engine(
        self, no_leftovers: str
    ) -> None:
        engine = Canned([("a", 1), ("b", RequestRejected("out of pages")), ("c", 3)])
        with in_process_stage(engine, no_leftovers) as (_, client):
            client.send("adds", ["a", "b", "c"], [0, 0, 0])
            events = _step(client, 1)
            events += _sync(client, 3)  # after the engine has dropped b
        assert events == [
            ["utility", 1, [], None],
            ["outputs", ["a", "c"], [False, False], [1, 3]],
            ["error", "b", "out of pages"],
        ]
        # Dropped from the engine without an aborted event: the error was b's last event.
        assert engine.aborted == ["b"]

    def test_a_finished_request_rejected_output_is_not_aborted(self, no_leftovers: str) -> None:
        engine = Canned([("a", RequestRejected("bad"))])
        engine.route_outputs = lambda outs: (  # type: ignore[attr-defined]
            [rid for rid, _ in outs],
            [True] * len(outs),
            [p for _, p in outs],
        )
        with in_process_stage(engine, no_leftovers) as (_, client):
            client.send("add", "a", 0)
            events = _step(client, 1)
            client.send("add", "a", 0)  # free again: the engine finished it
            events += _sync(client, 3)
        assert events == [["utility", 1, [], None], ["error", "a", "bad"]]
        assert engine.aborted == []
        assert engine.added == [("a", 0), ("a", 0)]

    def test_an_unrouted_request_rejected_output_is_an_unscoped_error(
        self, no_leftovers: str
    ) -> None:
        engine = Canned([RequestRejected("lost"), ("a", 1)])
        with in_process_stage(engine, no_leftovers) as (_, client):
            events = _step(client, 1)
        assert events == [
            ["utility", 1, [], None],
            ["outputs", ["a"], [False], [1]],
            ["error", None, "an unrouted engine output is an error: lost"],
        ]
        assert engine.aborted == []

    def test_an_add_queued_before_the_drop_is_refused(self, no_leftovers: str) -> None:
        # b is ended by an error during a step; until the engine has dropped b, its id is
        # still live there, so an add of b that was queued before the drop is refused. The
        # add is sent once the step has begun, and the step waits until it is in the loop's
        # queue: the drop, queued during the step, comes after it. (Sent unsynchronised, the
        # add may reach the loop before the step, depending on when the input thread reads.)
        started, gate = threading.Event(), threading.Event()

        class Gated(Canned):
            def step(self) -> list[Any]:
                started.set()
                assert gate.wait(10), "the test never opened the gate"
                return super().step()

        engine = Gated([("b", RequestRejected("gone"))])
        engine.route_outputs = lambda outs: (  # type: ignore[attr-defined]
            [rid for rid, _ in outs],
            [False] * len(outs),
            [p for _, p in outs],
        )
        with in_process_stage(engine, no_leftovers) as (stage, client):
            client.send("add", "b", 0)
            client.send("utility", 1, "step", [])
            assert started.wait(10)
            client.send("add", "b", 1)  # reaches the loop's queue while the step waits
            queue = stage.runtime.loop.input_queue
            assert wait_until(
                lambda: any(getattr(m, "data", None) == 1 for m in list(queue.queue)), 10
            )
            gate.set()
            events = _sync(client, 2)
            client.send("add", "b", 2)  # after the drop: free
            events += _sync(client, 4)
        assert events == [
            ["utility", 1, [], None],
            ["error", "b", "gone"],
            ["error", "b", LIVE_IN_STAGE],
        ]
        assert engine.added == [("b", 0), ("b", 2)]
        assert engine.aborted == ["b"]


def _frame_of(arr: Any) -> Any:
    """The object an array's memory belongs to, following ``base`` and ``obj``."""
    owner = arr
    while True:
        nxt = getattr(owner, "base", None)
        if nxt is None:
            nxt = getattr(owner, "obj", None)
        if nxt is None or nxt is owner:
            return owner
        owner = nxt


class TestArraysAndBuffers:
    @pytest.mark.parametrize(
        "arr",
        [
            np.arange(4096, dtype=np.float32).reshape(64, 64),  # out of band
            np.arange(6, dtype=np.int64).reshape(2, 3),  # inline
            np.array(3.5),  # 0-d
            np.array([True, False]),
            np.array([1 + 2j], dtype=np.complex128),
            np.array(["2024-01-01T00:00:00"] * 300, dtype="datetime64[ns]"),
            np.array([1, 2], dtype="timedelta64[s]"),
            np.array(["ab", "cde"], dtype="<U5"),
            np.array([b"xy"], dtype="S3"),
            np.zeros((0, 5), dtype=np.uint8),
            np.arange(20000, dtype=">i4")[::3],  # big-endian, not contiguous
        ],
        ids=lambda a: f"{a.dtype.str}{list(a.shape)}",
    )
    def test_array_round_trip(self, no_leftovers: str, arr: Any) -> None:
        engine = _Recording()
        with in_process_stage(engine, no_leftovers) as (_, client):
            client.send("add", "r", arr)
            [event] = client.events()
            parts = client.frames[-1]
        [(_, got)] = engine.received
        # What the engine gets: a read-only array, equal to what was sent.
        assert type(got) is np.ndarray
        assert not got.flags.writeable
        assert got.dtype == arr.dtype
        assert got.shape == arr.shape
        np.testing.assert_array_equal(got, arr)
        if arr.nbytes >= 1024:
            # Zero copy on receipt: a view on the zmq frame it arrived in.
            assert isinstance(_frame_of(got), zmq.Frame)
            assert len(parts) == 2
        else:
            assert len(parts) == 1
        assert event[:3] == ["outputs", ["r"], [True]]
        back = event[3][0]
        assert back.dtype == arr.dtype
        assert back.shape == arr.shape
        np.testing.assert_array_equal(back, arr)

    def test_bytes_buffers_and_scalars(self, no_leftovers: str) -> None:
        big = bytes(range(256)) * 8
        data = {
            "small bytes": b"ab",
            "big bytes": big,
            "bytearray": bytearray(b"xyz"),
            "big memoryview": memoryview(big),
            "numpy scalars": [np.float64(1.5), np.int64(-3), np.bool_(True), np.str_("s")],
        }
        engine = _Recording()
        with in_process_stage(engine, no_leftovers) as (_, client):
            client.send("add", "r", data)
            [event] = client.events()
            parts = client.frames[-1]
        [(_, got)] = engine.received
        assert got["small bytes"] == b"ab"
        assert type(got["big bytes"]) is bytes
        assert got["big bytes"] == big
        assert type(got["bytearray"]) is memoryview
        assert got["bytearray"].readonly
        assert bytes(got["bytearray"]) == b"xyz"
        assert type(got["big memoryview"]) is memoryview
        assert got["big memoryview"].readonly
        assert bytes(got["big memoryview"]) == big
        assert got["numpy scalars"] == [1.5, -3, True, "s"]
        assert [type(v) for v in got["numpy scalars"]] == [float, int, bool, str]
        assert len(parts) == 3  # the two big buffers went out of band, both ways
        back = event[3][0]
        assert back["big bytes"] == big
        assert bytes(back["big memoryview"]) == big
        assert bytes(back["bytearray"]) == b"xyz"


class TestLifecycle:
    def test_shutdown_is_applied_after_what_was_sent_before_it(self, no_leftovers: str) -> None:
        engine = _Recording()
        stage = InProcessStage(engine, no_leftovers)
        with RawClient(stage.address) as client:
            assert client.hello()[0] == "welcome"
            client.send("adds", ["a", "b"], [1, 2])
            client.send("shutdown")
            events = client.until(lambda ev: ev[0] == "shutdown")
        assert stage.wait() == EXIT_OK
        assert engine.received == [("a", 1), ("b", 2)]
        assert events[-1] == ["shutdown"]
        assert not any(ev[0] == "utility" for ev in events)  # the stop's own answer is not sent

    def test_handle_signals_empty_runs_off_the_main_thread(self, no_leftovers: str) -> None:
        with in_process_stage(EchoEngine(), no_leftovers) as (stage, client):
            assert client.call(1, "echo", "x") == [["utility", 1, ["x"], None]]
            assert stage.exit_code is None

    def test_welcome_names_the_output_socket(self, no_leftovers: str) -> None:
        stage = InProcessStage(EchoEngine(), no_leftovers)
        try:
            with RawClient(stage.address) as client:
                tag, version, output, _pid, engine = client.hello()
        finally:
            stage.stop()
        assert (tag, version, engine) == ("welcome", PROTOCOL_VERSION, "test")
        assert output == stage.runtime.output_address


@pytest.mark.parametrize("value", [-1.0, 0.0, float("nan"), float("inf")])
def test_a_session_timeout_that_is_not_a_positive_number_is_refused(value: float) -> None:
    # Checked before anything binds: a negative or NaN one let any new hello take over the
    # attached client's session at once.
    with pytest.raises(ValueError, match="session_timeout must be a number of seconds > 0"):
        StageRuntime(
            CountdownEngine(),
            "tcp://127.0.0.1:*",
            "tcp://127.0.0.1:*",
            engine_name="countdown",
            session_timeout=value,
            handle_signals=(),
        )


def test_a_bind_failure_names_the_socket_and_the_address(no_leftovers: str) -> None:
    address = f"ipc://{no_leftovers}/missing/stage"
    with pytest.raises(
        StageBindError, match=re.escape(f"cannot bind the input socket to {address!r}")
    ):
        StageRuntime(
            CountdownEngine(),
            address,
            address + ".out",
            engine_name="countdown",
            handle_signals=(),
        )


@pytest.mark.parametrize("which", ["input", "output"])
def test_an_ipc_path_another_stage_listens_on_is_refused(no_leftovers: str, which: str) -> None:
    # libzmq unlinks the socket file and binds anew: the second stage took the path over,
    # and the first was left listening on a file nobody can reach any more.
    first = InProcessStage(EchoEngine(), no_leftovers)
    try:
        taken = first.runtime.input_address if which == "input" else first.runtime.output_address
        free = f"ipc://{no_leftovers}/other"
        binds = (taken, free + ".out") if which == "input" else (free, taken)
        with pytest.raises(
            StageBindError,
            match=re.escape(f"cannot bind the {which} socket to {taken!r}: Address already in use"),
        ):
            StageRuntime(EchoEngine(), *binds, engine_name="second", handle_signals=())
        with RawClient(first.address) as client:  # the first one still serves
            assert client.hello()[0] == "welcome"
            assert client.call(1, "echo", "x")[-1][2] == ["x"]
    finally:
        first.stop()


def test_a_stale_ipc_socket_file_is_taken_over(no_leftovers: str) -> None:
    # A file whose process ended without removing it (killed): nobody listens, so the bind
    # may take it over, as before.
    path = f"{no_leftovers}/in"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()  # the file stays, nobody listens
    stage = InProcessStage(EchoEngine(), no_leftovers)
    try:
        with RawClient(stage.address) as client:
            assert client.hello()[0] == "welcome"
    finally:
        stage.stop()


def test_a_tcp_bind_error_names_the_address_once() -> None:
    # The bind's own error (a port taken after serve's check, or a StageRuntime made in
    # code) repeated the address: "...: Address already in use (addr='tcp://...')".
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(StageBindError) as info:
            StageRuntime(
                EchoEngine(), address, "tcp://127.0.0.1:*", engine_name="x", handle_signals=()
            )
    assert str(info.value) == f"cannot bind the input socket to {address!r}: Address already in use"


def test_an_ipc_path_that_is_not_a_socket_is_refused_and_kept(no_leftovers: str) -> None:
    # libzmq unlinked whatever was there: --bind ipc://notes.txt replaced the file with a
    # socket, and removed it at the stop.
    path = f"{no_leftovers}/notes.txt"
    with open(path, "w", encoding="utf-8") as f:
        f.write("keep me")
    try:
        with pytest.raises(StageBindError, match="exists and is a file that is not a socket"):
            StageRuntime(
                EchoEngine(), f"ipc://{path}", f"ipc://{path}.out", engine_name="x",
                handle_signals=(),
            )  # fmt: skip
        with open(path, encoding="utf-8") as f:
            assert f.read() == "keep me"
    finally:
        os.unlink(path)


@pytest.mark.parametrize("target", ["nowhere", "notes.txt"])
def test_an_ipc_path_that_is_a_symbolic_link_is_refused_and_kept(
    no_leftovers: str, target: str
) -> None:
    # A dangling link (or one to a file) passed the check, and the bind replaced the link.
    path = f"{no_leftovers}/s"
    os.symlink(f"{no_leftovers}/{target}", path)
    if target == "notes.txt":
        with open(f"{no_leftovers}/{target}", "w", encoding="utf-8") as f:
            f.write("keep me")
    try:
        with pytest.raises(StageBindError, match="exists and is a symbolic link"):
            StageRuntime(
                EchoEngine(), f"ipc://{path}", f"ipc://{path}.out", engine_name="x",
                handle_signals=(),
            )  # fmt: skip
        assert os.path.islink(path)
    finally:
        os.unlink(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{no_leftovers}/{target}")


def test_a_shared_stages_ipc_path_too_long_for_its_clients_is_refused_at_once(
    no_leftovers: str,
) -> None:
    # Each client's output path is the output path with "-<n>" after it: a path with no
    # room left for it failed at every connect() instead.
    path = os.path.join(no_leftovers, "d" * (100 - len(no_leftovers)))
    with pytest.raises(ValueError, match="a socket's path is at most 107 characters"):
        StageRuntime(
            EchoEngine(), f"ipc://{path}", f"ipc://{path}.out", engine_name="x",
            handle_signals=(), max_clients=2,
        )  # fmt: skip
    assert os.listdir(no_leftovers) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract sockets: Linux")
def test_an_abstract_ipc_name_binds_and_spares_a_file_of_that_name(
    no_leftovers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ipc://@NAME is in the abstract namespace: it binds, and its stop removes no file. But
    # libzmq's bind unlinks a file named "@NAME" in the working directory all the same: such
    # a file is refused as any other non-socket path, and kept.
    monkeypatch.chdir(no_leftovers)
    name = f"@enginecore-test-{os.getpid()}"
    runtime = StageRuntime(
        EchoEngine(), f"ipc://{name}", f"ipc://{name}.out", engine_name="x", handle_signals=()
    )
    runtime.abandon()
    assert runtime.run() == EXIT_OK
    with open(name, "w", encoding="utf-8") as f:
        f.write("keep me")
    try:
        with pytest.raises(StageBindError, match="is a file that is not a socket"):
            StageRuntime(
                EchoEngine(), f"ipc://{name}", f"ipc://{name}.out", engine_name="x",
                handle_signals=(),
            )  # fmt: skip
        with open(name, encoding="utf-8") as f:
            assert f.read() == "keep me"
    finally:
        os.unlink(name)
