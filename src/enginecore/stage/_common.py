"""Pieces shared by the blocking and the asyncio client."""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterator, Sequence
from typing import Any, Final
from urllib.parse import urlsplit

import msgspec

from . import _wire
from ._errors import EngineDeadError, ProtocolError, StageClosedError, describe_exit

__all__ = [
    "CLIENT_NAME",
    "build_abort",
    "build_add",
    "build_utility",
    "dead_error",
    "end_error",
    "new_call_ids",
    "output_address_for",
    "parse_welcome",
]

CLIENT_NAME: Final = "enginecore-python"

HELLO_FRAME: Final = msgspec.msgpack.encode(("hello", _wire.PROTOCOL_VERSION, CLIENT_NAME))
SHUTDOWN_FRAME: Final = msgspec.msgpack.encode(("shutdown",))
BYE_FRAME: Final = msgspec.msgpack.encode(("bye",))


def encode(msg: Any, what: str) -> bytes:
    """Encode a checked message. msgspec can still refuse a value that passed
    :func:`~enginecore.stage.check_encodable` (a ``str`` with a lone surrogate is not UTF-8);
    that is a :class:`TypeError` too, raised before anything is sent."""
    try:
        return msgspec.msgpack.encode(msg)
    except (ValueError, OverflowError, msgspec.EncodeError) as exc:
        raise TypeError(f"{what} cannot be encoded: {exc}") from exc


def new_call_ids() -> Iterator[int]:
    """A client's call ids: consecutive, from a random start in 1 .. 2**62. A stage answers
    every call it received, even after its caller detached, and that answer goes to the next
    client attached; a random start keeps it from matching one of that client's calls."""
    return itertools.count(secrets.randbits(62) + 1)


def build_add(req_id: str, data: Any) -> bytes:
    """Check and encode an ``add``; :class:`TypeError` if it cannot cross the wire."""
    if type(req_id) is not str:
        raise TypeError(f"req_id must be a str, got {type(req_id).__name__}")
    _wire.check_encodable(data, f"data of request {req_id!r}")
    return encode(("add", req_id, data), f"request {req_id!r}")


def build_abort(req_ids: Sequence[str]) -> tuple[list[str], bytes]:
    """Check and encode an ``abort``. A bare ``str`` is refused (it is a sequence of chars)."""
    if isinstance(req_ids, (str, bytes)):
        raise TypeError(f"abort() takes a sequence of request ids; write abort([{req_ids!r}])")
    ids = list(req_ids)
    for rid in ids:
        if type(rid) is not str:
            raise TypeError(f"request ids must be str, got {type(rid).__name__}")
    return ids, encode(("abort", ids), "abort")


def build_utility(call_id: int, name: str, args: tuple[Any, ...]) -> bytes:
    """Check and encode a ``utility`` call."""
    if type(name) is not str:
        raise TypeError(f"utility name must be a str, got {type(name).__name__}")
    _wire.check_encodable(args, f"arguments of utility {name!r}")
    return encode(("utility", call_id, name, list(args)), f"utility call {name!r}")


def ping_frame(seq: int) -> bytes:
    return msgspec.msgpack.encode(("ping", seq))


def parse_welcome(frame: bytes, address: str) -> _wire.WelcomeMsg:
    """Decode the handshake reply; :class:`ProtocolError` unless it is a welcome."""
    try:
        reply = _wire.handshake_decoder.decode(frame)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"invalid handshake reply from {address}: {exc}") from exc
    if isinstance(reply, _wire.RejectMsg):
        raise ProtocolError(
            f"stage at {address} rejected this client (it speaks protocol version "
            f"{reply.version}): {reply.reason}"
        )
    if reply.version != _wire.PROTOCOL_VERSION:
        raise ProtocolError(
            f"stage at {address} speaks protocol version {reply.version}, "
            f"this client {_wire.PROTOCOL_VERSION}"
        )
    return reply


def output_address_for(input_address: str, welcome_output: str) -> str:
    """Where to connect the output socket: the port from the welcome, on the host the client
    already reached (the stage may be bound to a wildcard or see another name)."""
    if not welcome_output.startswith("tcp://") or not input_address.startswith("tcp://"):
        return welcome_output
    host = urlsplit(input_address).hostname or "127.0.0.1"
    port = welcome_output.rsplit(":", 1)[1]
    if ":" in host:
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def dead_error(
    *,
    pid: int | None,
    exit_code: int | None,
    fatal: str | None,
    remote_shutdown: bool = False,
    reason: str | None = None,
) -> EngineDeadError:
    """The one :class:`EngineDeadError` every waiter gets; the message says all we know."""
    who = f"stage process {pid}" if pid is not None else "the stage"
    if reason is not None:
        msg = f"{who}: {reason}"
    elif exit_code is not None:
        msg = f"{who} {describe_exit(exit_code)}"
    else:
        msg = f"{who} is gone"
    if fatal is not None:
        msg += f"; fatal error in the engine loop: {fatal}"
    elif remote_shutdown:
        msg += "; it shut down, but not at this client's request"
    return EngineDeadError(msg, exit_code=exit_code, fatal=fatal)


def end_error(
    closing: bool,
    *,
    pid: int | None,
    exit_code: int | None,
    fatal: str | None,
    remote_shutdown: bool = False,
    reason: str | None = None,
) -> StageClosedError | EngineDeadError:
    """What every waiter gets once the stage is gone: :class:`StageClosedError` if this client
    was closing it, else the :func:`dead_error` built from the other arguments."""
    if closing:
        return StageClosedError("this stage client is closed")
    return dead_error(
        pid=pid,
        exit_code=exit_code,
        fatal=fatal,
        remote_shutdown=remote_shutdown,
        reason=reason,
    )
