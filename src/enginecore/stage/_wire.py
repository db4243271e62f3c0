"""The wire format: the shapes of the messages and events between a stage and its client.

``docs/wire.md`` is the normative description; this module is its implementation, with
``_codec`` (payload values, out-of-band buffers). A ZMQ message is a msgpack body plus
optional out-of-band buffer frames. Messages and events are msgpack arrays whose first
element is a string tag; receivers ignore extra trailing elements (room for compatible
additions). No pickle, ever: payloads are restricted to what :func:`check_encodable`
accepts.
"""

from __future__ import annotations

from typing import Any, Final, TypeAlias

import msgspec

from ._codec import check_encodable

__all__ = [
    "DRAINING",
    "PROTOCOL_VERSION",
    "Aborted",
    "ErrorReport",
    "Fatal",
    "Outputs",
    "Shutdown",
    "StageEvent",
    "UtilityResult",
    "check_encodable",
    "is_ipv6_endpoint",
]

PROTOCOL_VERSION: Final = 2
"""Bumped on any incompatible change of ``docs/wire.md``; checked in the handshake."""

DRAINING: Final = "add refused: the stage is draining (shutting down once its live requests end)"
"""The message of the ``error`` event for an ``add`` that arrives during a drain. Here, not
in the stage engine's module: a pipeline whose first stage's client drains refuses an add
with the same words, without loading the stage's side."""


def is_ipv6_endpoint(address: str) -> bool:
    """Whether *address* is ``tcp://[HOST]:PORT``, an IPv6 host in brackets. The socket that
    binds or connects it needs ZMQ's ``IPV6`` option, which is off by default. It stays off
    for every other address: on, an IPv4 bind reports itself as
    ``tcp://[::ffff:127.0.0.1]:PORT``, and a name such as ``localhost`` may resolve to
    ``::1`` instead of ``127.0.0.1``."""
    return address.startswith("tcp://[")


# -- client -> stage (input socket) ---------------------------------------------------------


class HelloMsg(msgspec.Struct, array_like=True, frozen=True, tag="hello"):
    version: int
    client: str


class AddMsg(msgspec.Struct, array_like=True, frozen=True, tag="add"):
    req_id: str
    data: Any


class AddsMsg(msgspec.Struct, array_like=True, frozen=True, tag="adds"):
    req_ids: list[str]
    data: list[Any]


class AbortMsg(msgspec.Struct, array_like=True, frozen=True, tag="abort"):
    req_ids: list[str]
    # A pipeline with replica pools (docs/wire.md section 8): per id, the replicas of the
    # stages after the receiver that the request's route goes through (the abort chases
    # the data along it). Absent: replica 0 of each. A stage that restarts may be named
    # [replica, generation]: its process of that generation (section 8, "Restarts").
    routes: list[list[int | list[int]]] | None = None
    # A replay's fence (docs/wire.md section 8): true in the abort a stage sends down its
    # link for the coordinator's `replay`, and in that abort chased on; the stage answers it
    # with an `aborted` that says so. Absent (an older sender): an ordinary abort.
    fence: bool = False
    # A pipeline's abort sent after a death (docs/wire.md section 8, "Tagged aborts"): the
    # coordinator's tag, which the `aborted` answering it repeats, and the abort chased on
    # carries. Absent (an older sender, or any other abort): untagged.
    tag: int | None = None


class UtilityMsg(msgspec.Struct, array_like=True, frozen=True, tag="utility"):
    call_id: int
    name: str
    args: list[Any]


class ShutdownMsg(msgspec.Struct, array_like=True, frozen=True, tag="shutdown"):
    # Seconds to let live requests finish; absent (["shutdown"]): stop now. A nil here is
    # invalid, as any other value that is not a number >= 0 (docs/wire.md section 4).
    drain: float | msgspec.UnsetType = msgspec.UNSET


class PingMsg(msgspec.Struct, array_like=True, frozen=True, tag="ping"):
    seq: int


class ByeMsg(msgspec.Struct, array_like=True, frozen=True, tag="bye"):
    pass


class StatsMsg(msgspec.Struct, array_like=True, frozen=True, tag="stats"):
    # Answered by a utility event with this call id, from the input side (never the loop).
    call_id: int


class PipeMsg(msgspec.Struct, array_like=True, frozen=True, tag="pipe"):
    # A pipeline's previous stage -> this stage (docs/wire.md section 8): input for requests,
    # one item per (kind, req_id, data); kind 0 more, 1 first, 2 end (data nil), 3 first+end.
    kinds: list[int]
    req_ids: list[str]
    data: list[Any]
    # A pipeline with replica pools: the routes of the requests whose first input this
    # message carries (per id, the replicas of the stages after the receiver), and the
    # sending stage's replica index (for the credit it is owed). As an abort's routes, a
    # stage that restarts may be named [replica, generation].
    routes: dict[str, list[int | list[int]]] | None = None
    sender: int = 0


class CreditMsg(msgspec.Struct, array_like=True, frozen=True, tag="credit"):
    # The coordinator -> a pipeline's stage (docs/wire.md section 8): the next stage took
    # *items* pipe items, *nbytes* bytes of pipe messages, that this stage sent it;
    # *replica*: which replica of the next stage (a replica pool; 0 otherwise).
    items: int
    nbytes: int
    replica: int = 0


class GoneMsg(msgspec.Struct, array_like=True, frozen=True, tag="gone"):
    # The coordinator -> a pipeline's stage (docs/wire.md section 8): the stage before it
    # (*side* "previous": drop every later message from the link whose routing id is *link*)
    # or after it ("next": stop sending to it, free the shared-memory slots kept for it) is
    # gone.
    side: str
    link: str = ""
    # "next" in a pipeline with replica pools: which replica of the next stage is gone.
    replica: int = 0


class LinkMsg(msgspec.Struct, array_like=True, frozen=True, tag="link"):
    # The coordinator -> a pipeline's stage (docs/wire.md section 8): replica *replica* of
    # the next stage was started again, and listens at *address*: connect that link to it,
    # with an empty window and, if *slots* is not "", a new pool of shared-memory slots
    # named with that prefix; if *server_key* is not "", the process listens on TCP with
    # CURVE, that public key (Z85): the link is a CURVE client with this stage's link keys.
    # *generation*: the new process's, to a stage whose welcome said "gens" (None: not
    # said), which the routes' [replica, generation] are told against.
    replica: int
    address: str
    slots: str = ""
    server_key: str = ""
    generation: int | None = None


class RouteMsg(msgspec.Struct, array_like=True, frozen=True, tag="route"):
    # The coordinator -> the first stage of a pipeline with replica pools, right before the
    # add of *req_ids*: per id, the replicas of the stages after it that the request goes
    # through (a stage that restarts may be named [replica, generation]).
    req_ids: list[str]
    routes: list[list[int | list[int]]]


class ReplayMsg(msgspec.Struct, array_like=True, frozen=True, tag="replay"):
    # The coordinator -> a pipeline's stage whose edge retries (docs/wire.md section 8): the
    # next stage failed *req_id*; abort it down the link, then send its logged inputs again.
    # Answered by a `replayed` event naming *attempt*.
    req_id: str
    attempt: int


class ReleaseMsg(msgspec.Struct, array_like=True, frozen=True, tag="release"):
    # The coordinator -> a pipeline's stage whose edge retries: these requests are done in
    # the pipeline; forget their replay logs.
    req_ids: list[str]


ClientMsg: TypeAlias = (
    HelloMsg
    | AddMsg
    | AddsMsg
    | AbortMsg
    | UtilityMsg
    | ShutdownMsg
    | PingMsg
    | ByeMsg
    | StatsMsg
    | PipeMsg
    | CreditMsg
    | GoneMsg
    | LinkMsg
    | ReplayMsg
    | ReleaseMsg
    | RouteMsg
)

# -- stage -> client, handshake replies (input socket) --------------------------------------


class WelcomeMsg(msgspec.Struct, array_like=True, frozen=True, tag="welcome"):
    version: int
    output: str
    pid: int
    engine: str
    # What the stage does beyond the protocol's version (docs/wire.md section 3): a
    # pipeline's stage of this build says "tags" (section 8, "Tagged aborts") and "gens"
    # (section 8, "Restarts": routes and links that name generations). Absent from
    # an older build's welcome, and from that of a stage that is no pipeline's.
    features: tuple[str, ...] = ()
    # The largest frame (message part) the stage's input socket takes, in bytes, for a stage
    # served with --max-message-bytes: a bigger one costs the sender its connection, and
    # the message with it (docs/wire.md section 3). Absent (None): unbounded, or an older
    # build's welcome.
    max_message_bytes: int | None = None


def welcome_frame(
    output: str,
    pid: int,
    engine: str,
    features: tuple[str, ...] = (),
    max_message_bytes: int | None = None,
) -> bytes:
    """A stage's ``welcome``: five elements, then *features* only if any or if
    *max_message_bytes* follows it (a client that unpacks five, as section 10 of
    ``docs/wire.md`` did, still can with a stage that sets neither)."""
    head = ("welcome", PROTOCOL_VERSION, output, pid, engine)
    if max_message_bytes is not None:
        return msgspec.msgpack.encode((*head, list(features), max_message_bytes))
    if features:
        return msgspec.msgpack.encode((*head, list(features)))
    return msgspec.msgpack.encode(head)


MIN_MESSAGE_BYTES: Final = 1024
"""The least bound a stage's input socket may have on a frame (``max_message_bytes``,
``serve --max-message-bytes``): the handshakes' own frames go through the same check
(CURVE's INITIATE is some 300 bytes)."""


def check_max_message_bytes(max_message_bytes: int | None) -> None:
    """:class:`TypeError` / :class:`ValueError` for a bad ``max_message_bytes``: ``None``
    (unbounded) or an int >= :data:`MIN_MESSAGE_BYTES` (a smaller bound would refuse the
    handshakes' own frames)."""
    if max_message_bytes is None:
        return
    if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int):
        raise TypeError(f"max_message_bytes must be an int or None, got {max_message_bytes!r}")
    if max_message_bytes < MIN_MESSAGE_BYTES:
        raise ValueError(
            f"max_message_bytes must be >= {MIN_MESSAGE_BYTES}, got {max_message_bytes}"
        )


class RejectMsg(msgspec.Struct, array_like=True, frozen=True, tag="reject"):
    version: int
    reason: str


HandshakeReply: TypeAlias = WelcomeMsg | RejectMsg

# -- stage -> client, events (output socket; each frame is an array of these) ----------------


class Load(msgspec.Struct, frozen=True):
    """A stage's load report, as it rides on an :class:`Outputs` event (``docs/wire.md``
    section 5): its sequence number, its age in seconds when the stage sent it, the requests
    live in the stage, and the engine's own numbers."""

    seq: int
    age: float
    live: int
    engine: dict[str, float]


class Outputs(msgspec.Struct, array_like=True, frozen=True, tag="outputs"):
    """One engine step's outputs, in the order the step produced them, as three lists of
    equal length: output ``i`` belongs to request ``req_ids[i]`` (``None`` when the output
    could not be routed to a request), ``finished[i]`` marks that request's last output, and
    ``payloads[i]`` is its payload. ``load`` is the stage's load report when one rides on
    the event (``docs/wire.md``); the client keeps it for ``client.load()``, and the events
    it hands out never carry one."""

    req_ids: list[str | None]
    finished: list[bool]
    payloads: list[Any]
    load: Load | None = None

    def __len__(self) -> int:
        return len(self.payloads)


class UtilityResult(msgspec.Struct, array_like=True, frozen=True, tag="utility"):
    """The answer to utility call *call_id*: *error* is ``None`` on success, else the remote
    exception's ``repr`` (and *result* is ``None``)."""

    call_id: int
    result: Any
    error: str | None


class Aborted(msgspec.Struct, array_like=True, frozen=True, tag="aborted"):
    """The engine's ``abort(req_ids)`` has returned: no output of these requests follows.
    *fence* (a pipeline's stage, ``docs/wire.md`` section 8): the abort applied was a
    replay's fence, not the client's abort; absent from the wire (``False``) otherwise.
    *tag*: the abort applied was tagged (a pipeline's abort after a death), with this tag;
    absent (``None``) otherwise."""

    req_ids: list[str]
    fence: bool = False
    tag: int | None = None


class ErrorReport(msgspec.Struct, array_like=True, frozen=True, tag="error"):
    """The stage could not handle something. With a *req_id* it concerns that request only
    (its ``add`` was invalid, or an output could not be encoded and the request was aborted);
    with ``req_id=None`` it is a protocol error (an undecodable or invalid frame). The stage
    keeps serving either way."""

    req_id: str | None
    message: str


class Pong(msgspec.Struct, array_like=True, frozen=True, tag="pong"):
    seq: int


class Stalled(msgspec.Struct, array_like=True, frozen=True, tag="stalled"):
    """The stage's step watchdog: a step has run for *seconds*, past *step_timeout*. Sent
    once per such step; :class:`Resumed` follows when it returns."""

    seconds: float
    step_timeout: float


class Resumed(msgspec.Struct, array_like=True, frozen=True, tag="resumed"):
    """The step reported by :class:`Stalled` returned, after *seconds* in all."""

    seconds: float


class Credit(msgspec.Struct, array_like=True, frozen=True, tag="credit"):
    """A pipeline's stage took *items* pipe items from the stage before it, *nbytes* bytes
    of its pipe messages (``docs/wire.md`` section 8): the coordinator passes it on to that
    stage, whose window to this one has that much room again. Only pipeline stages send
    it. *links* (a pipeline with replica pools): the same, per replica of the stage before
    it, ``[replica, items, nbytes]`` each."""

    items: int
    nbytes: int
    links: list[list[int]] | None = None


class Replayed(msgspec.Struct, array_like=True, frozen=True, tag="replayed"):
    """A pipeline's stage answers the coordinator's ``replay`` of *req_id*, number
    *attempt* (``docs/wire.md`` section 8): it aborted the request down its link (always),
    then sent its logged inputs again (*ok*), or could not (*message* says why). Only
    pipeline stages send it."""

    req_id: str
    attempt: int
    ok: bool
    message: str


class Shutdown(msgspec.Struct, array_like=True, frozen=True, tag="shutdown"):
    """The engine loop stopped because shutdown was requested. Last event of the stage."""


class Fatal(msgspec.Struct, array_like=True, frozen=True, tag="fatal"):
    """The engine loop died of an exception; *message* is its ``repr``. Last event."""

    message: str


StageEvent: TypeAlias = (
    Outputs | UtilityResult | Aborted | ErrorReport | Credit | Replayed | Shutdown | Fatal
)
"""What a client's ordered event stream yields (:class:`Credit` and :class:`Replayed` only
from a pipeline's stage)."""

WireEvent: TypeAlias = (
    Outputs
    | UtilityResult
    | Aborted
    | ErrorReport
    | Credit
    | Replayed
    | Pong
    | Stalled
    | Resumed
    | Shutdown
    | Fatal
)

# Stage side: events are built as plain tuples in exactly the array shapes above (cheap on the
# hot path, and they encode identically). Client side: bodies decode straight into structs.
EventBatch: TypeAlias = list[WireEvent]
handshake_decoder: Final = msgspec.msgpack.Decoder(HandshakeReply)
