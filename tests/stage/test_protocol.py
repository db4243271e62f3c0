"""Raw frames from a plain zmq socket: bad input becomes error events, the stage keeps serving."""

from __future__ import annotations

import re
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from enginecore.stage import PROTOCOL_VERSION, ErrorReport, StageClient, UtilityResult


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
    raw.send(msgspec.msgpack.encode(["utility", 10_000, "log", []]))
    while True:
        event = client.get_event(5)
        if isinstance(event, UtilityResult) and event.call_id == 10_000:
            return event.result


def _still_serving(client: StageClient) -> None:
    assert client.add("check", 3).collect(timeout=5) == [2, 1, 0]
    assert client.call_utility("div", 6, 3, timeout=5) == 2


class TestBadFrames:
    @pytest.mark.parametrize(
        ("frame", "match"),
        [
            (b"\xc1garbage", "malformed"),
            (msgspec.msgpack.encode(["add", "r1", [1, 2, 3]])[:-2], "truncated|length"),
            (b"", "truncated|length|malformed|Input data was truncated"),
            (msgspec.msgpack.encode({"add": "r1"}), "Expected `array`, got `object`"),
            (msgspec.msgpack.encode(["add", 7, 3]), r"Expected `str`, got `int` - at `\$\[1\]`"),
            (msgspec.msgpack.encode(["nosuch", 1]), "Invalid value 'nosuch'"),
            (msgspec.msgpack.encode(["abort", "r1"]), "Expected `array`, got `str`"),
            (msgspec.msgpack.encode(42), "Expected `array`, got `int`"),
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

    def test_invalid_add_with_a_recoverable_id_is_request_scoped(
        self, client: StageClient, raw: zmq.Socket[bytes]
    ) -> None:
        raw.send(msgspec.msgpack.encode(["add", "r9"]))  # data missing
        report = _next_report(client)
        assert isinstance(report, ErrorReport)
        assert report.req_id == "r9"
        assert "at least length 3" in report.message
        _still_serving(client)

    def test_invalid_utility_with_a_recoverable_call_id_answers_that_call(
        self, client: StageClient, raw: zmq.Socket[bytes]
    ) -> None:
        raw.send(msgspec.msgpack.encode(["utility", 77, 5, []]))  # name is not a str
        report = _next_report(client)
        assert isinstance(report, UtilityResult)
        assert report.call_id == 77
        assert report.result is None
        assert report.error is not None
        assert report.error.startswith("ProtocolError(")
        _still_serving(client)

    def test_multipart_message_is_a_protocol_error(
        self, client: StageClient, raw: zmq.Socket[bytes]
    ) -> None:
        raw.send_multipart([msgspec.msgpack.encode(["add", "r1", 1]), b"extra"])
        report = _next_report(client)
        assert isinstance(report, ErrorReport)
        assert "one frame per message, got 2" in report.message
        _still_serving(client)

    def test_burst_of_mixed_frames_keeps_order_of_the_valid_ones(
        self, client: StageClient, raw: zmq.Socket[bytes]
    ) -> None:
        for i in range(50):
            raw.send(b"\xc1")
            raw.send(msgspec.msgpack.encode(["add", f"x{i}", 1]))
        assert _raw_log(client, raw) == [f"add x{i}" for i in range(50)]

    def test_extra_trailing_elements_are_ignored(
        self, client: StageClient, raw: zmq.Socket[bytes]
    ) -> None:
        raw.send(msgspec.msgpack.encode(["add", "fwd", 2, "a future field"]))
        assert _raw_log(client, raw) == ["add fwd"]


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=4) | st.integers(-9, 9), inner, max_size=3)
    ),
    max_leaves=12,
)
_TAGS = ["add", "abort", "utility", "shutdown", "ping", "hello", "bye", "output", "welcome", ""]
_frames = (
    st.binary(max_size=64)
    | _values.map(msgspec.msgpack.encode)
    | st.builds(
        lambda tag, rest: msgspec.msgpack.encode([tag, *rest]),
        st.sampled_from(_TAGS),
        st.lists(_values, max_size=4),
    )
)


def _is_valid_message(frame: bytes) -> bool:
    """Whether the stage would accept *frame* as a message (docs/wire.md, section 4)."""
    try:
        msg = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return False
    if type(msg) is not list or not msg or type(msg[0]) is not str:
        return False
    shapes: dict[str, tuple[type | tuple[type, ...], ...]] = {
        "add": (str, object),
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
    return all(
        isinstance(v, t) and not (t is int and type(v) is bool)
        for v, t in zip(msg[1:], shape, strict=False)
    ) and (msg[0] != "abort" or all(type(r) is str for r in msg[1]))


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
        # Every invalid frame is answered by exactly one error (an unscoped or request-scoped
        # report, or a failed utility call), all before the answer to a call sent after them
        # (the input thread reports them in arrival order); none reached the engine.
        raw.send(msgspec.msgpack.encode(["utility", 10_000, "log", []]))
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
        assert errors == len(sent)
        _still_serving(client)

    def test_huge_invalid_frame_is_a_protocol_error(
        self, client: StageClient, raw: zmq.Socket[bytes]
    ) -> None:
        raw.send(msgspec.msgpack.encode(["add", 7, b"x" * (64 << 20)]))
        report = _next_report(client)
        assert isinstance(report, ErrorReport)
        assert report.req_id is None
        assert "67108" in report.message  # the frame's size, not the frame itself
        assert len(report.message) < 1000
        _still_serving(client)


class TestHandshake:
    def test_wrong_protocol_version_is_rejected(
        self, client: StageClient, raw: zmq.Socket[bytes]
    ) -> None:
        raw.send(msgspec.msgpack.encode(["hello", PROTOCOL_VERSION + 1, "test"]))
        assert raw.poll(5000)
        tag, version, reason = msgspec.msgpack.decode(raw.recv())
        assert (tag, version) == ("reject", PROTOCOL_VERSION)
        assert "not supported" in reason

    def test_second_client_is_rejected_while_one_is_attached(
        self, client: StageClient, raw: zmq.Socket[bytes]
    ) -> None:
        raw.send(msgspec.msgpack.encode(["hello", PROTOCOL_VERSION, "test"]))
        assert raw.poll(5000)
        tag, _, reason = msgspec.msgpack.decode(raw.recv())
        assert tag == "reject"
        assert "another client is attached" in reason
