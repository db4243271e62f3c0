"""Raw frames from a plain zmq socket: bad input becomes error events scoped to what it names,
nothing invalid reaches the engine, and the stage keeps serving (``docs/wire.md`` sections
2 and 6)."""

from __future__ import annotations

import datetime
import itertools
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from enginecore.stage import PROTOCOL_VERSION, ErrorReport, StageClient, UtilityResult
from enginecore.stage.testing import EchoEngine

from .raw import RawClient, in_process_stage

encode = msgspec.msgpack.encode


@pytest.fixture
def raw(client: StageClient) -> Iterator[zmq.Socket[bytes]]:
    """A DEALER connected to the stage's input socket, as a client in another language."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(client.address)
    try:
        yield sock
    finally:
        sock.close()
        ctx.term()


def _next_report(client: StageClient) -> ErrorReport | UtilityResult:
    while True:
        event = client.get_event(5)
        if isinstance(event, (ErrorReport, UtilityResult)):
            return event


def _raw_log(client: StageClient, raw: zmq.Socket[bytes]) -> object:
    """The engine's call log, asked for through *raw* itself, so it is ordered after
    everything *raw* sent before (ZMQ keeps order per peer, not across peers)."""
    raw.send(encode(["utility", 10_000, "log", []]))
    while True:
        event = client.get_event(5)
        if isinstance(event, UtilityResult) and event.call_id == 10_000:
            return event.result


def _still_serving(client: StageClient) -> None:
    assert client.add("check", 3).collect(timeout=5) == [2, 1, 0]
    assert client.call_utility("div", 6, 3, timeout=5) == 2


class TestPipeFrames:
    """The ``pipe`` message (docs/wire.md section 8) is for a pipeline's stages: any other
    stage refuses it per request, and a bad one is scoped to the requests it names."""

    def test_a_stage_that_is_not_a_pipeline_stage_refuses_first_items(
        self, client: StageClient, raw: zmq.Socket[bytes]
    ) -> None:
        raw.send(encode(["pipe", [1, 0, 3], ["a", "a", "b"], [1, 2, 3]]))
        reports = [_next_report(client), _next_report(client)]
        assert [(r.req_id, r.message) for r in reports if isinstance(r, ErrorReport)] == [
            ("a", "pipe refused: this stage is not a pipeline's stage"),
            ("b", "pipe refused: this stage is not a pipeline's stage"),
        ]
        assert _raw_log(client, raw) == []
        _still_serving(client)

    @pytest.mark.parametrize(
        ("frame", "ids", "match"),
        [
            (["pipe", [1, 1], ["a"], [1, 2]], ["a"], "2 kinds, 1 request ids and 2 data items"),
            (["pipe", [7], ["a"], [1]], ["a"], "pipe kind must be 0, 1, 2, 3, 10 or 11, got 7"),
            (["pipe", [1, 9], ["a", "b"], [1, 2]], ["b"], "got 9"),
        ],
    )
    def test_an_invalid_pipe_is_scoped_to_its_requests(
        self,
        client: StageClient,
        raw: zmq.Socket[bytes],
        frame: list[Any],
        ids: list[str],
        match: str,
    ) -> None:
        raw.send(encode(frame))
        reports = [_next_report(client) for _ in ids]
        assert [r.req_id for r in reports if isinstance(r, ErrorReport)] == ids
        assert all(match in r.message for r in reports if isinstance(r, ErrorReport))
        _still_serving(client)


class TestBadFrames:
    @pytest.mark.parametrize(
        ("frame", "match"),
        [
            (b"\xc1garbage", "malformed"),
            (encode(["add", "r1", 1])[:4], "truncated"),
            (b"", "truncated|length|malformed|Input data was truncated"),
            (encode({"add": "r1"}), "Expected `array`, got `object`"),
            (encode(["add", 7, 3]), r"Expected `str`, got `int` - at `\$\[1\]`"),
            (encode(["nosuch", 1]), "Invalid value 'nosuch'"),
            (encode(["abort", "r1"]), "Expected `array`, got `str`"),
            (encode(["adds", [], 5]), "Expected `array`, got `int`"),
            (encode(["adds", [], [1]]), "0 request ids but 1 data items"),
            (encode(42), "Expected `array`, got `int`"),
        ],
    )
    def test_protocol_error_event_and_the_stage_keeps_serving(
        self, client: StageClient, raw: zmq.Socket[bytes], frame: bytes, match: str
    ) -> None:
        raw.send(frame)
        report = _next_report(client)
        assert isinstance(report, ErrorReport)
        assert report.req_id is None
        assert report.message.startswith("invalid message")
        assert re.search(match, report.message), report.message
        _still_serving(client)
        assert client.call_utility("log", timeout=5) == ["add check"]

    @pytest.mark.parametrize(
        ("frame", "match"),
        [
            (encode(["add", "r9"]), "at least length 3"),
            (encode(["add", "r9", [1, 2, 3]])[:-2], "truncated"),
            (b"\x93\xa3add\xa2r9\xa2\xff\xfe", "UTF-8"),
            (encode(["add", "r9", msgspec.msgpack.Ext(9, b"x")]), "extension type 9"),
            (encode(["add", "r9", {"t": datetime.datetime.now(datetime.timezone.utc)}]), "-1"),
            (b"\x93\xa3add\xa2r9\x81\xcb" + encode(1.5)[1:] + b"\x01", "key 1.5 of type float"),
            (b"\x93\xa3add\xa2r9\x81\xc0\x01", "key None of type nil"),
            (b"\x93\xa3add\xa2r9\x81\xc3\x01", "key True of type bool"),
            (b"\x93\xa3add\xa2r9\x81\x92\x01\x02\x01", r"key \(1, 2\) of type array"),
            (b"\x93\xa3add\xa2r9" + b"\x91" * 5000 + b"\xc0", "RecursionError"),
        ],
    )
    def test_invalid_add_with_a_readable_id_is_request_scoped(
        self, client: StageClient, raw: zmq.Socket[bytes], frame: bytes, match: str
    ) -> None:
        raw.send(frame)
        report = _next_report(client)
        assert isinstance(report, ErrorReport)
        assert report.req_id == "r9"
        assert re.search(match, report.message), report.message
        assert _raw_log(client, raw) == []
        _still_serving(client)

    def test_invalid_adds_with_readable_ids_fails_each_request(
        self, client: StageClient, raw: zmq.Socket[bytes]
    ) -> None:
        raw.send(b"\x93\xa4adds\x92\xa1a\xa1b\x92\x01\xa2\xff\xfe")  # b's data: bad UTF-8
        reports = [_next_report(client), _next_report(client)]
        assert [r.req_id for r in reports if isinstance(r, ErrorReport)] == ["a", "b"]
        assert _raw_log(client, raw) == []
        _still_serving(client)

    def test_invalid_utility_with_a_readable_call_id_answers_that_call(
        self, client: StageClient, raw: zmq.Socket[bytes]
    ) -> None:
        for frame in (
            encode(["utility", 77, 5, []]),  # name is not a str
            b"\x94\xa7utility\x4d\xa4echo\x91\xa2\xff\xfe",  # an arg with bad UTF-8
            encode(["utility", 77, "echo", [msgspec.msgpack.Ext(-5, b"")]]),
        ):
            raw.send(frame)
            report = _next_report(client)
            assert isinstance(report, UtilityResult)
            assert report.call_id == 77
            assert report.result is None
            assert report.error is not None
            # docs/wire.md section 6, for every kind of invalid utility.
            assert report.error.startswith("ProtocolError('invalid message")
        _still_serving(client)

    def test_unreferenced_buffers_are_ignored(
        self, client: StageClient, raw: zmq.Socket[bytes]
    ) -> None:
        raw.send_multipart([encode(["add", "r1", 1]), b"extra", b"more"])
        assert _raw_log(client, raw) == ["add r1"]

    def test_a_reference_to_a_missing_buffer_fails_the_request(
        self, client: StageClient, raw: zmq.Socket[bytes]
    ) -> None:
        raw.send_multipart([encode(["add", "r1", msgspec.msgpack.Ext(2, encode(1))]), b"x"])
        report = _next_report(client)
        assert isinstance(report, ErrorReport)
        assert report.req_id == "r1"
        assert "buffer 1, which is not there" in report.message
        assert _raw_log(client, raw) == []

    def test_burst_of_mixed_frames_keeps_order_of_the_valid_ones(
        self, client: StageClient, raw: zmq.Socket[bytes]
    ) -> None:
        for i in range(50):
            raw.send(b"\xc1")
            raw.send(encode(["add", f"x{i}", 1]))
        assert _raw_log(client, raw) == [f"add x{i}" for i in range(50)]

    def test_extra_trailing_elements_are_ignored(
        self, client: StageClient, raw: zmq.Socket[bytes]
    ) -> None:
        raw.send(encode(["add", "fwd", 2, "a future field"]))
        assert _raw_log(client, raw) == ["add fwd"]


# -- fuzzing the message layer: frames that are not valid messages ---------------------------

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
)


def _containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    # A def, not a lambda: hypothesis >= 6.170 cannot see a parenthesised lambda's argument
    # used, and warns (an error here) that it cannot recurse.
    return st.lists(inner, max_size=4) | st.dictionaries(
        st.text(max_size=4) | st.integers(-9, 9), inner, max_size=3
    )


_values = st.recursive(_scalars, _containers, max_leaves=12)
_TAGS = ["add", "adds", "abort", "utility", "shutdown", "ping", "hello", "bye", "outputs", ""]
_frames = (
    st.binary(max_size=64)
    | _values.map(encode)
    | st.builds(
        lambda tag, rest: encode([tag, *rest]),
        st.sampled_from(_TAGS),
        st.lists(_values, max_size=4),
    )
)


def _decoded(frame: bytes) -> Any:
    try:
        return msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return None


def _is_str_list(value: object) -> bool:
    return type(value) is list and all(type(v) is str for v in value)


def _is_valid_message(frame: bytes) -> bool:
    """Whether the stage would accept *frame* as a message (docs/wire.md, section 4)."""
    msg = _decoded(frame)
    if type(msg) is not list or not msg or type(msg[0]) is not str:
        return False
    shapes: dict[str, tuple[type | tuple[type, ...], ...]] = {
        "add": (str, object),
        "adds": (list, list),
        "abort": (list,),
        "utility": (int, str, list),
        "shutdown": (),
        "ping": (int,),
        "hello": (int, str),
        "bye": (),
    }
    shape = shapes.get(msg[0])
    if shape is None or len(msg) - 1 < len(shape):
        return False
    if not all(
        isinstance(v, t) and not (t is int and type(v) is bool)
        for v, t in zip(msg[1:], shape, strict=False)
    ):
        return False
    if msg[0] == "abort":
        return _is_str_list(msg[1])
    if msg[0] == "adds":
        return _is_str_list(msg[1]) and len(msg[1]) == len(msg[2])
    return True


def _answers(frame: bytes) -> int:
    """How many error events the stage sends for the invalid *frame*: one per request id of
    an ``adds`` whose ids can be read, none for a ``hello`` (it is rejected on the input
    socket), else one."""
    msg = _decoded(frame)
    if type(msg) is list and msg and msg[0] == "hello":
        return 0
    if type(msg) is list and len(msg) >= 2 and msg[0] == "adds" and _is_str_list(msg[1]):
        return max(1, len(msg[1]))
    return 1


class TestFuzz:
    def test_fuzzed_frames_never_reach_the_engine_and_it_keeps_serving(
        self, client: StageClient, raw: zmq.Socket[bytes]
    ) -> None:
        sent: list[bytes] = []

        @settings(
            max_examples=300,
            deadline=None,
            database=None,
            suppress_health_check=[
                HealthCheck.function_scoped_fixture,
                HealthCheck.filter_too_much,
            ],
        )
        @given(_frames.filter(lambda f: not _is_valid_message(f)))
        def send(frame: bytes) -> None:
            raw.send(frame)
            sent.append(frame)

        send()
        assert sent
        # Every invalid frame is answered (an unscoped or request-scoped report, or a
        # failed utility call), all before the answer to a call sent after them (the input
        # thread reports them in arrival order); none reached the engine.
        raw.send(encode(["utility", 10_000, "log", []]))
        errors = 0
        while True:
            event = client.get_event(5)
            if isinstance(event, UtilityResult) and event.call_id == 10_000:
                assert event.result == []
                break
            if isinstance(event, ErrorReport) or (
                isinstance(event, UtilityResult) and event.error is not None
            ):
                errors += 1
        assert errors == sum(map(_answers, sent))
        hellos = sum(_answers(f) == 0 for f in sent)
        for _ in range(hellos):
            assert raw.poll(5000)
            assert msgspec.msgpack.decode(raw.recv())[0] == "reject"
        assert not raw.poll(0)
        _still_serving(client)

    def test_huge_invalid_frame_is_a_protocol_error(
        self, client: StageClient, raw: zmq.Socket[bytes]
    ) -> None:
        raw.send(encode(["add", 7, b"x" * (64 << 20)]))
        report = _next_report(client)
        assert isinstance(report, ErrorReport)
        assert report.req_id is None
        assert "67108" in report.message  # the frame's size, not the frame itself
        assert len(report.message) < 1000
        _still_serving(client)


# -- fuzzing the payloads: valid messages whose payloads hide something invalid --------------
# Payloads are built as msgpack bytes, so that they can hold what no msgpack library would
# produce from Python values: an invalid UTF-8 string, a float or nil map key, a foreign
# extension type. Each knows what the stage must make of it.

GOOD, ITEM, FRAME = 0, 1, 2
"""A payload that is valid; one that decodes but is not a valid wire value, so the stage
refuses that one item; one that does not decode at all, so the stage refuses the frame."""


@dataclass(frozen=True)
class Packed:
    data: bytes  # msgpack
    kind: int  # GOOD, ITEM or FRAME
    value: Any = None  # what the stage decodes, for a GOOD one


def _array(items: Sequence[Packed]) -> Packed:
    n = len(items)
    head = bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big")
    return Packed(
        head + b"".join(i.data for i in items),
        max((i.kind for i in items), default=GOOD),
        [i.value for i in items],
    )


def _map(pairs: Sequence[tuple[Packed, Packed]]) -> Packed:
    n = len(pairs)
    head = bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")
    data = head + b"".join(k.data + v.data for k, v in pairs)
    if any(FRAME in (k.kind, v.kind) for k, v in pairs):
        return Packed(data, FRAME)
    if any(k.kind != GOOD for k, _ in pairs):
        return Packed(data, ITEM)
    # A repeated key keeps its last value, as in any msgpack decoder: an invalid value that
    # a later one replaces is not part of what arrives.
    survivors = {k.value: v for k, v in pairs}
    kind = max((v.kind for v in survivors.values()), default=GOOD)
    return Packed(data, kind, {key: v.value for key, v in survivors.items()})


def _good(value: Any) -> Packed:
    return Packed(encode(value), GOOD, value)


_good_keys = (st.text(max_size=4) | st.integers(-9, 9)).map(_good)
_good_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8)
).map(_good)
_bad_keys = st.sampled_from(
    [
        Packed(encode(1.5), ITEM),  # float
        Packed(b"\xc0", ITEM),  # nil
        Packed(b"\xc2", ITEM),  # false
        Packed(b"\x92\x01\x02", ITEM),  # array
        Packed(encode(datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc)), ITEM),
        Packed(b"\xa2\xff\xfe", FRAME),  # invalid UTF-8
    ]
)
_bad_leaves = (
    st.builds(
        lambda code, data: Packed(encode(msgspec.msgpack.Ext(code, data)), ITEM),
        st.integers(-128, 127).filter(lambda c: c not in (-1, 1, 2, 3)),
        st.binary(max_size=4),
    )
    | st.datetimes(timezones=st.just(datetime.timezone.utc)).map(
        lambda t: Packed(encode(t), ITEM)  # the timestamp extension
    )
    | st.sampled_from(
        [
            Packed(encode(msgspec.msgpack.Ext(1, b"\xc1")), ITEM),  # an array, malformed
            Packed(encode(msgspec.msgpack.Ext(1, encode(["<f4", [0, 2**62, 2**62], b""]))), ITEM),
            Packed(encode(msgspec.msgpack.Ext(1, encode(["O", [1], b"\0" * 8]))), ITEM),
            Packed(encode(msgspec.msgpack.Ext(2, encode(0))), ITEM),  # no such buffer
            Packed(encode(msgspec.msgpack.Ext(3, encode("x"))), ITEM),
            Packed(b"\xa2\xff\xfe", FRAME),  # invalid UTF-8
            Packed(b"\xd9\x03a\xed\xa0\x80", FRAME),  # a surrogate, in UTF-8
        ]
    )
)


def _payload_containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    # A def, not a lambda: see _containers.
    return (
        st.lists(inner, max_size=4).map(_array)
        | st.lists(st.tuples(_good_keys, inner), max_size=3).map(_map)
        | st.tuples(_bad_keys, inner).map(lambda kv: _map([kv]))
    )


_payloads = st.recursive(_good_leaves | _bad_leaves, _payload_containers, max_leaves=8)
_messages = st.lists(
    st.tuples(st.sampled_from(["add", "adds", "utility"]), st.lists(_payloads, max_size=4)),
    min_size=1,
    max_size=4,
)


class _Recording(EchoEngine):
    """EchoEngine that also records every request and utility call it receives."""

    def __init__(self) -> None:
        super().__init__()
        self.received: list[tuple[str, Any]] = []

    def add(self, req_id: str, data: Any) -> None:
        self.received.append((req_id, data))
        super().add(req_id, data)

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        self.received.append((name, list(args)))
        return super().utility(name, args)


class TestPayloadFuzz:
    def test_invalid_payloads_never_reach_the_engine_and_each_gets_one_scoped_answer(
        self, no_leftovers: str
    ) -> None:
        engine = _Recording()
        ids = itertools.count()
        with in_process_stage(engine, no_leftovers) as (stage, raw):

            @settings(max_examples=300, deadline=None, database=None)
            @given(_messages)
            def exchange(messages: list[tuple[str, list[Packed]]]) -> None:
                engine.received.clear()
                outputs: dict[str, Any] = {}  # req_id -> the payload it must echo
                answers: dict[int, Any] = {}  # call_id -> its result (None: an error)
                failed: set[str] = set()  # req_ids that must end with an error
                for tag, payloads in messages:
                    if tag == "utility":
                        call_id = next(ids)
                        args = _array(payloads)
                        answers[call_id] = args.value if args.kind == GOOD else None
                        body = _array([_good("utility"), _good(call_id), _good("echo"), args])
                        raw.send_raw(body.data)
                        continue
                    rids = [f"r{next(ids)}" for _ in range(max(1, len(payloads)))]
                    items = payloads or [_good(0)]
                    # One frame per add; an adds that does not decode fails all its ids.
                    whole = tag == "adds" and max(p.kind for p in items) == FRAME
                    for rid, item in zip(rids, items, strict=True):
                        if whole or item.kind != GOOD:
                            failed.add(rid)
                        else:
                            outputs[rid] = item.value
                    if tag == "add":
                        for rid, item in zip(rids, items, strict=True):
                            raw.send_raw(_array([_good("add"), _good(rid), item]).data)
                    else:
                        body = _array([_good("adds"), _good(rids), _array(items)])
                        raw.send_raw(body.data)
                # Errors come from the input thread before the loop answers the first sync
                # call; outputs come from the step after it, before the second one's answer.
                events = raw.call(next(ids), "echo")
                events += raw.call(next(ids), "echo")
                got_outputs: dict[str, Any] = {}
                got_errors: list[str] = []
                got_answers: dict[int, Any] = {}
                for event in events:
                    if event[0] == "outputs":
                        for rid, finished, payload in zip(*event[1:], strict=True):
                            assert rid not in got_outputs
                            assert finished
                            got_outputs[rid] = payload
                    elif event[0] == "error":
                        assert event[1] is not None, event
                        got_errors.append(event[1])
                    elif event[0] == "utility" and event[1] in answers:
                        assert event[1] not in got_answers
                        got_answers[event[1]] = event[2] if event[3] is None else None
                        assert (event[3] is None) == (answers[event[1]] is not None), event
                assert sorted(got_errors) == sorted(failed)  # exactly one each
                assert got_outputs == outputs
                assert got_answers == answers
                # The engine received exactly the valid requests and calls, and nothing else.
                assert sorted(r for r, _ in engine.received if r.startswith("r")) == sorted(outputs)
                assert len([n for n, _ in engine.received if n == "echo"]) == 2 + sum(
                    1 for a in answers.values() if a is not None
                )

            exchange()
            # Still serving, and the loop is still the one it was.
            assert raw.call(10**9, "echo", "alive")[-1] == ["utility", 10**9, ["alive"], None]
            assert stage.exit_code is None


class TestHandshake:
    def test_wrong_protocol_version_is_rejected(
        self, client: StageClient, raw: zmq.Socket[bytes]
    ) -> None:
        raw.send(encode(["hello", PROTOCOL_VERSION + 1, "test"]))
        assert raw.poll(5000)
        tag, version, reason = msgspec.msgpack.decode(raw.recv())
        assert (tag, version) == ("reject", PROTOCOL_VERSION)
        assert "not supported" in reason

    @pytest.mark.parametrize(
        "frame",
        [
            encode(["hello"]),
            encode(["hello", "2", "x"]),
            encode(["hello", PROTOCOL_VERSION, 5]),
            encode(["hello", 2.0, "x"]),
            b"\x93\xa5hello\x02\xa2\xff\xfe",  # the client name is not UTF-8
            b"\x93\xa5hello\x02",  # truncated
        ],
    )
    def test_malformed_hello_is_rejected(self, no_leftovers: str, frame: bytes) -> None:
        with in_process_stage(EchoEngine(), no_leftovers) as (_, attached):
            other = RawClient(attached.address)
            try:
                other.send_raw(frame)
                tag, version, reason = other.reply()
            finally:
                other.close()
            assert (tag, version) == ("reject", PROTOCOL_VERSION)
            assert reason.startswith("invalid hello: invalid message"), reason
            assert attached.call(1, "echo", 1)[-1] == ["utility", 1, [1], None]

    def test_second_client_is_rejected_while_one_is_attached(
        self, client: StageClient, raw: zmq.Socket[bytes]
    ) -> None:
        raw.send(encode(["hello", PROTOCOL_VERSION, "test"]))
        assert raw.poll(5000)
        tag, _, reason = msgspec.msgpack.decode(raw.recv())
        assert tag == "reject"
        assert "another client is attached" in reason
