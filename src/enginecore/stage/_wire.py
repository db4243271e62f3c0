"""The wire format: msgspec msgpack frames between a stage and its client.

``docs/wire.md`` is the normative description; this module is its implementation. Every
frame is one msgpack value. Messages and events are msgpack arrays whose first element is a
string tag; receivers ignore extra trailing elements (room for compatible additions). No
pickle, ever: payloads are restricted to what :func:`check_encodable` accepts.
"""

from __future__ import annotations

from typing import Any, Final, TypeAlias, cast

import msgspec

__all__ = [
    "PROTOCOL_VERSION",
    "Aborted",
    "ErrorReport",
    "Fatal",
    "Output",
    "Shutdown",
    "StageEvent",
    "UtilityResult",
    "check_encodable",
]

PROTOCOL_VERSION: Final = 1
"""Bumped on any incompatible change of ``docs/wire.md``; checked in the handshake."""

# -- client -> stage (input socket) ---------------------------------------------------------


class HelloMsg(msgspec.Struct, array_like=True, frozen=True, tag="hello"):
    version: int
    client: str


class AddMsg(msgspec.Struct, array_like=True, frozen=True, tag="add"):
    req_id: str
    data: Any


class AbortMsg(msgspec.Struct, array_like=True, frozen=True, tag="abort"):
    req_ids: list[str]


class UtilityMsg(msgspec.Struct, array_like=True, frozen=True, tag="utility"):
    call_id: int
    name: str
    args: list[Any]


class ShutdownMsg(msgspec.Struct, array_like=True, frozen=True, tag="shutdown"):
    pass


class PingMsg(msgspec.Struct, array_like=True, frozen=True, tag="ping"):
    seq: int


class ByeMsg(msgspec.Struct, array_like=True, frozen=True, tag="bye"):
    pass


ClientMsg: TypeAlias = HelloMsg | AddMsg | AbortMsg | UtilityMsg | ShutdownMsg | PingMsg | ByeMsg

# -- stage -> client, handshake replies (input socket) --------------------------------------


class WelcomeMsg(msgspec.Struct, array_like=True, frozen=True, tag="welcome"):
    version: int
    output: str
    pid: int
    engine: str


class RejectMsg(msgspec.Struct, array_like=True, frozen=True, tag="reject"):
    version: int
    reason: str


HandshakeReply: TypeAlias = WelcomeMsg | RejectMsg

# -- stage -> client, events (output socket; each frame is an array of these) ----------------


class Output(msgspec.Struct, array_like=True, frozen=True, tag="output"):
    """One engine output. *req_id* is ``None`` when the engine's output could not be routed
    to a request; *finished* marks the request's last output."""

    req_id: str | None
    finished: bool
    payload: Any


class UtilityResult(msgspec.Struct, array_like=True, frozen=True, tag="utility"):
    """The answer to utility call *call_id*: *error* is ``None`` on success, else the remote
    exception's ``repr`` (and *result* is ``None``)."""

    call_id: int
    result: Any
    error: str | None


class Aborted(msgspec.Struct, array_like=True, frozen=True, tag="aborted"):
    """The engine's ``abort(req_ids)`` has returned: no output of these requests follows."""

    req_ids: list[str]


class ErrorReport(msgspec.Struct, array_like=True, frozen=True, tag="error"):
    """The stage could not handle something. With a *req_id* it concerns that request only
    (its ``add`` was invalid, or an output could not be encoded and the request was aborted);
    with ``req_id=None`` it is a protocol error (an undecodable or invalid frame). The stage
    keeps serving either way."""

    req_id: str | None
    message: str


class Pong(msgspec.Struct, array_like=True, frozen=True, tag="pong"):
    seq: int


class Shutdown(msgspec.Struct, array_like=True, frozen=True, tag="shutdown"):
    """The engine loop stopped because shutdown was requested. Last event of the stage."""


class Fatal(msgspec.Struct, array_like=True, frozen=True, tag="fatal"):
    """The engine loop died of an exception; *message* is its ``repr``. Last event."""

    message: str


StageEvent: TypeAlias = Output | UtilityResult | Aborted | ErrorReport | Shutdown | Fatal
"""What a client's ordered event stream yields."""

WireEvent: TypeAlias = Output | UtilityResult | Aborted | ErrorReport | Pong | Shutdown | Fatal

# Stage side: events are built as plain tuples in exactly the array shapes above (cheap on the
# hot path, and they encode identically). Client side: frames decode straight into structs.
event_batch_decoder: Final = msgspec.msgpack.Decoder(list[WireEvent])
client_msg_decoder: Final = msgspec.msgpack.Decoder(ClientMsg)
handshake_decoder: Final = msgspec.msgpack.Decoder(HandshakeReply)
any_decoder: Final = msgspec.msgpack.Decoder()


def new_encoder() -> msgspec.msgpack.Encoder:
    """An encoder per thread: msgspec encoders keep an internal buffer."""
    return msgspec.msgpack.Encoder()


# -- payload check --------------------------------------------------------------------------

_SCALARS: Final = frozenset({type(None), bool, float, str, bytes})
_INT_MIN: Final = -(2**63)
_INT_MAX: Final = 2**64 - 1
_MAX_DEPTH: Final = 64


def check_encodable(value: object, what: str = "value") -> None:
    """Raise :class:`TypeError` unless *value* can cross the wire unchanged.

    Allowed, by exact type: ``None``, ``bool``, ``int`` (-2**63 .. 2**64-1), ``float``,
    ``str``, ``bytes``, and ``list`` / ``tuple`` / ``dict`` of those (dict keys: ``str``,
    ``int``, ``bytes``), nested at most 64 deep. Tuples arrive as lists. Anything else (a
    subclass, a dataclass, a set, a NumPy scalar, ...) is refused, because msgpack would
    either fail or silently change it. The message names where the offending value sits.
    Never blocks; thread-safe.
    """
    t = type(value)
    if t in _SCALARS:
        return
    _check(value, what, 0)


def _check(value: object, path: str, depth: int) -> None:
    t = type(value)
    if t in _SCALARS:
        return
    if t is int:
        if not _INT_MIN <= cast(int, value) <= _INT_MAX:
            raise TypeError(f"{path}: int {value} is outside the msgpack range -2**63..2**64-1")
        return
    if depth >= _MAX_DEPTH:
        raise TypeError(f"{path}: nested deeper than {_MAX_DEPTH} levels")
    if t is list or t is tuple:
        for i, item in enumerate(cast("list[object]", value)):
            if type(item) not in _SCALARS:
                _check(item, f"{path}[{i}]", depth + 1)
        return
    if t is dict:
        for key, item in cast("dict[object, object]", value).items():
            if type(key) not in (str, int, bytes):
                raise TypeError(
                    f"{path}: dict key {key!r} of type {type(key).__name__} is not allowed "
                    f"on the wire (use str, int or bytes keys)"
                )
            if type(key) is int:
                _check(key, f"{path}[{key!r}] (key)", depth + 1)
            if type(item) not in _SCALARS:
                _check(item, f"{path}[{key!r}]", depth + 1)
        return
    raise TypeError(
        f"{path}: {t.__module__}.{t.__qualname__} is not wire-encodable; the wire carries "
        f"None, bool, int, float, str, bytes, and list/tuple/dict of them (see docs/wire.md)"
    )


def encode_message(encoder: msgspec.msgpack.Encoder, msg: tuple[Any, ...]) -> bytes:
    """Encode one client message tuple, already checked."""
    return encoder.encode(msg)
