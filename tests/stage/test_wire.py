"""The wire format's building blocks, without processes: payload checks and message shapes."""

from __future__ import annotations
import __future__

import dataclasses
import pathlib
import re
import subprocess
import sys
import types
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

import enginecore.stage
from enginecore.stage import (
    Aborted,
    ErrorReport,
    Fatal,
    Outputs,
    Shutdown,
    UtilityResult,
    _codec,
    _wire,
    check_encodable,
)
from enginecore.stage._session import ClientSession

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text()
    | st.binary()
)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.tuples(children, children)
        | st.dictionaries(st.text() | st.integers(-100, 100), children, max_size=4)
    ),
    max_leaves=20,
)


def _as_received(value: Any) -> Any:
    """What the other side decodes: tuples arrive as lists."""
    if isinstance(value, (list, tuple)):
        return [_as_received(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_received(v) for k, v in value.items()}
    return value


class TestCheckEncodable:
    @given(values)
    def test_accepted_values_round_trip_unchanged_but_for_tuples(self, value: Any) -> None:
        check_encodable(value)
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(value)) == _as_received(value)

    @dataclasses.dataclass
    class Point:
        x: int

    @pytest.mark.parametrize(
        ("value", "where"),
        [
            ({1}, "value: builtins.set"),
            ([1, {"a": object()}], "value[1]['a']: builtins.object"),
            ((1, Point(1)), "value[1]"),
            (2**64, "outside the msgpack range"),
            ({1.5: 1}, "dict key 1.5"),
            (types.SimpleNamespace(), "SimpleNamespace"),
        ],
    )
    def test_refused_values_name_where_they_are(self, value: object, where: str) -> None:
        with pytest.raises(TypeError, match=r"not wire-encodable|outside|dict key") as info:
            check_encodable(value)
        assert where in str(info.value)

    def test_subclasses_are_refused(self) -> None:
        class MyStr(str):
            pass

        with pytest.raises(TypeError, match="MyStr"):
            check_encodable(["ok", MyStr("no")])

    def test_depth_is_bounded(self) -> None:
        deep: list[Any] = []
        for _ in range(100):
            deep = [deep]
        with pytest.raises(TypeError, match="nested deeper"):
            check_encodable(deep)


class TestShapes:
    def test_events_encode_as_tagged_arrays(self) -> None:
        outputs = Outputs(["r", None], [True, False], [0, "x"])
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(outputs)) == [
            "outputs",
            ["r", None],
            [True, False],
            [0, "x"],
            None,  # no load report (the stage itself sends a 4-element event then)
        ]
        batch = [
            ("outputs", ["r"], [False], [[1]]),
            ("utility", 3, None, "ValueError('x')"),
            ("aborted", ["a"]),
            ("error", None, "m"),
            ("shutdown",),
            ("fatal", "E()"),
        ]
        decoder = _codec.Decoder(_wire.EventBatch, strict=True)
        assert decoder.decode([msgspec.msgpack.encode(batch)]) == [
            Outputs(["r"], [False], [[1]]),
            UtilityResult(3, None, "ValueError('x')"),
            Aborted(["a"]),
            ErrorReport(None, "m"),
            Shutdown(),
            Fatal("E()"),
        ]

    def test_a_fence_is_a_trailing_flag_on_abort_and_aborted(self) -> None:
        # docs/wire.md section 8: the replay's fence is an `abort` with a trailing true
        # (after the routes, nil without pools), answered by an `aborted` with one. Without
        # it (an older peer), both decode as before: not a fence.
        messages = _codec.Decoder(_wire.ClientMsg, strict=False)
        encoder = _codec.Encoder()

        def message(*msg: Any) -> Any:
            return messages.decode(encoder.encode(msg))

        assert message("abort", ["a"]) == _wire.AbortMsg(["a"])
        assert message("abort", ["a"]).fence is False
        assert message("abort", ["a"], [[1]]) == _wire.AbortMsg(["a"], [[1]], False)
        assert message("abort", ["a"], None, True) == _wire.AbortMsg(["a"], None, True)
        assert message("abort", ["a"], [[1, 0]], True) == _wire.AbortMsg(["a"], [[1, 0]], True)
        assert message("abort", ["a"], None, False).fence is False
        # A later element still is ignored (after the tag, section 8's "Tagged aborts").
        later = message("abort", ["a"], None, True, None, "later")
        assert later == _wire.AbortMsg(["a"], None, True)
        events = _codec.Decoder(_wire.EventBatch, strict=True)
        batch = [("aborted", ["a"]), ("aborted", ["b", "c"], True), ("aborted", ["d"], False)]
        assert events.decode([msgspec.msgpack.encode(batch)]) == [
            Aborted(["a"]),
            Aborted(["b", "c"], fence=True),
            Aborted(["d"]),
        ]
        assert Aborted(["a"]).fence is False
        # The struct round-trips, the flag included.
        for ev in (Aborted(["a"]), Aborted(["a"], fence=True)):
            assert events.decode([msgspec.msgpack.encode([ev])]) == [ev]

    def test_a_tag_is_a_trailing_int_on_abort_and_aborted(self) -> None:
        # docs/wire.md section 8, "Tagged aborts": a pipeline's abort after a death carries
        # the coordinator's tag after the fence flag, and the `aborted` answering it repeats
        # it there. Without it (an older peer, any other abort), both decode as before.
        messages = _codec.Decoder(_wire.ClientMsg, strict=False)
        encoder = _codec.Encoder()

        def message(*msg: Any) -> Any:
            return messages.decode(encoder.encode(msg))

        assert message("abort", ["a"]).tag is None
        assert message("abort", ["a"], [[1]], False, 7) == _wire.AbortMsg(["a"], [[1]], False, 7)
        assert message("abort", ["a"], None, False, 7, "later").tag == 7
        events = _codec.Decoder(_wire.EventBatch, strict=True)
        batch = [("aborted", ["a"], False, 7), ("aborted", ["b"])]
        assert events.decode([msgspec.msgpack.encode(batch)]) == [
            Aborted(["a"], tag=7),
            Aborted(["b"]),
        ]
        # The abort frame the coordinator sends: untagged, as before, unless tagged.
        frame = ClientSession.abort_frame(["a"], [[0]], 7)
        assert messages.decode(frame) == _wire.AbortMsg(["a"], [[0]], False, 7)
        assert messages.decode(ClientSession.abort_frame(["a"], [[0]])).tag is None

    def test_a_welcome_names_its_features_only_if_it_has_any(self) -> None:
        # docs/wire.md section 3: a pipeline's stage says "tags" after the five elements; any
        # other welcome is the five elements, as before. An older stage's decodes with none.
        plain = msgspec.msgpack.decode(_wire.welcome_frame("tcp://h:1", 42, "e"))
        assert plain == ["welcome", 2, "tcp://h:1", 42, "e"]
        tagged = _wire.welcome_frame("tcp://h:1", 42, "e", ("tags",))
        assert msgspec.msgpack.decode(tagged) == ["welcome", 2, "tcp://h:1", 42, "e", ["tags"]]
        reply = _wire.handshake_decoder.decode(tagged)
        assert isinstance(reply, _wire.WelcomeMsg)
        assert reply.features == ("tags",)
        reply = _wire.handshake_decoder.decode(_wire.welcome_frame("o", 1, "e"))
        assert isinstance(reply, _wire.WelcomeMsg)
        assert reply.features == ()


class TestPublicApi:
    def test_all_is_sorted_and_complete(self) -> None:
        # isort-style, as ruff's RUF022 keeps it: CONSTANTS, then Classes, then functions.
        def key(name: str) -> tuple[int, str]:
            return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)

        assert list(enginecore.stage.__all__) == sorted(set(enginecore.stage.__all__), key=key)
        for name in enginecore.stage.__all__:  # each resolves (imported on first use)
            getattr(enginecore.stage, name)
        public = {
            name
            for name, obj in vars(enginecore.stage).items()
            if not name.startswith("_")
            and not isinstance(obj, (types.ModuleType, __future__._Feature))
        }
        assert public == set(enginecore.stage.__all__)

    def test_names_are_imported_on_first_use(self) -> None:
        # What a stage process loads is tests/stage/test_layout.py's; here, the names.
        code = (
            "import sys\n"
            "import enginecore.stage as stage\n"
            "loaded = {m for m in sys.modules if m.startswith('enginecore.stage.')}\n"
            "assert not loaded, loaded\n"
            "assert stage.StageClient.__module__ == 'enginecore.stage._client'\n"
            "assert 'StageClient' in dir(stage)\n"
            "try:\n"
            "    stage.NoSuchName\n"
            "except AttributeError as exc:\n"
            "    assert 'NoSuchName' in str(exc)\n"
            "else:\n"
            "    raise AssertionError('no AttributeError')\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

    def test_exceptions_derive_from_the_root(self) -> None:
        for name in enginecore.stage.__all__:
            obj = getattr(enginecore.stage, name)
            if isinstance(obj, type) and issubclass(obj, BaseException):
                assert issubclass(obj, enginecore.EngineCoreError), name

    def test_clear_import_error_without_the_extra(self) -> None:
        code = (
            "import sys\n"
            "sys.modules['zmq'] = None\n"
            "import enginecore\n"
            "try:\n"
            "    import enginecore.stage\n"
            "except ImportError as exc:\n"
            "    print(exc)\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True
        ).stdout
        assert "pip install 'enginecore[zmq]'" in out


class TestWorkedExample:
    """docs/wire.md section 10: each frame it shows, in hex, is what this implementation
    sends for the value it names (so a port to another language can trust the bytes)."""

    @staticmethod
    def _frames() -> list[tuple[str, bytes]]:
        """The example's entries: (the line naming the value, its body as shown in hex)."""
        doc = (pathlib.Path(__file__).parents[2] / "docs" / "wire.md").read_text()
        section = doc.split("## 10. Worked example", 1)[1].split("```", 2)[1]
        frames: list[tuple[str, bytes]] = []
        for line in section.splitlines():
            if line.startswith(("client → stage", "stage → client")):
                frames.append((line, b""))
                continue
            shown = re.fullmatch(r"\s+(?:part 1: )?((?:[0-9a-f]{2} ?)+)", line)
            if shown is not None:  # not "part 2: the 4,096 bytes of the array"
                frames[-1] = (frames[-1][0], frames[-1][1] + bytes.fromhex(shown.group(1)))
        return frames

    def test_every_frame_is_what_the_implementation_sends(self) -> None:
        import numpy as np

        big = np.zeros((32, 32), "<f4")
        expected: list[object] = [
            ["hello", 2, "enginecore-python"],
            _wire.welcome_frame("tcp://127.0.0.1:40001", 4242, "enginecore:CountdownEngine"),
            ["add", "r1", 3],
            ["adds", ["r2", "r3"], [1, 2]],
            ["utility", 7, "div", [1, 4]],
            [("utility", 7, 0.25, None)],
            [("outputs", ["r1", "r2", "r3"], [False, True, False], [2, 0, 1])],
            ["abort", ["r1", "r3"]],
            [("aborted", ["r1", "r3"])],
            ["add", "img", np.zeros((2, 3), "<f4")],
            ["add", "big", big],
            ["shutdown"],
        ]
        frames = self._frames()
        assert len(frames) == len(expected), [line for line, _ in frames]
        for (line, shown), value in zip(frames, expected, strict=True):
            sent = value if isinstance(value, bytes) else _codec.Encoder().encode(value)[0]
            assert bytes(sent) == shown, line
