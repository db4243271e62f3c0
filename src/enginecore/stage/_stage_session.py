"""The stage side of the protocol, without IO: :class:`StageSession`.

The twin of the client's :class:`~._session.ClientSession`, and of h11's
``Connection(our_role=SERVER)``: it owns no socket and no thread, and it is told the time.
The input side (:mod:`._inbox`) receives a frame and hands it over with
:meth:`StageSession.receive`; the session decodes and checks it and turns it into

- **loop messages** (:attr:`StageSession.to_loop`, in arrival order): ``Add``, ``Abort``,
  ``Utility`` and the stage's controls (:mod:`._controls`), which the input side queues for
  the loop after each read;
- **events for the client** (:attr:`StageSession.events`): the error that scopes an
  invalid message to what it names, a ``pong``; the input side posts them to the outbox;
- **replies on the input socket** (:attr:`StageSession.replies`): ``welcome`` and
  ``reject``, and the answer to a ``stats`` request from a peer that is not the attached
  client (an *observer*, such as ``enginecore top``).

Sessions (``docs/wire.md`` section 3): one client at a time, in one of the
:class:`SessionState` states. A ``hello`` is rejected while another client is attached and
has been heard from within the session timeout. The output socket is a ``PUSH``, which deals
events out round-robin to every connected ``PULL``, so a new client must be the only one
before its first event is sent: a ``hello`` is not welcomed while anything is still
connected to the output socket (right after a ``bye``, the previous client's ``PULL`` often
still is). It is *held* (:attr:`StageSession.held`), unanswered, until the output socket has
no connection left (:meth:`StageSession.output_peers_changed`), then welcomed; at its
deadline (:data:`HELLO_HOLD_S`) it is rejected (:meth:`StageSession.settle`). A hello may be
held while a silent client is still attached, so the held hello is a pending request beside
the state, not a state of its own.

Nothing of one session reaches the next: a ``bye`` queues a
:class:`~._controls.SessionChange` for the loop, in order after the client's messages (its
live requests are aborted there, by default); welcoming a new client starts a new *epoch*
(:meth:`OutputSide.begin_session`: the outbox drops what it holds for the previous client)
and queues the new epoch's change. A utility call is sent to the loop under a stage-wide id
(:class:`CallTable`), so that its answer reaches only the session that made the call, even
when the engine answers it after that client is gone (a deferred utility). While no client
can read (none attached, or the attached one lost its output connection) the outbox is
*detached* and bounded (:class:`SessionGate`, its view of the session).
"""

from __future__ import annotations

import enum
import itertools
import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, Final, NamedTuple, Protocol

import msgspec

from .._messages import Abort, Message, make_add, make_utility
from . import _codec, _shm, _wire
from ._controls import (
    AddBurst,
    ClientInput,
    ClientJoined,
    ClientLeft,
    ClientsTarget,
    PipeAbort,
    PipeCredit,
    PipeFence,
    PipeGone,
    PipeInput,
    PipeLink,
    PipeRelease,
    PipeReplay,
    PipeRoute,
    SessionChange,
    Stop,
)
from ._edge import link_generation, link_token

__all__ = [
    "HEARTBEAT_TIMEOUT_MS",
    "HELLO_HOLD_S",
    "NOT_ATTACHED",
    "NO_SESSION",
    "OUTPUT_GRACE_S",
    "SESSION_LOST",
    "CallTable",
    "ClientsSide",
    "Held",
    "MultiStageSession",
    "OutputSide",
    "SessionGate",
    "SessionState",
    "StageSession",
    "key_revoked",
]

logger = logging.getLogger("enginecore.stage")

HEARTBEAT_TIMEOUT_MS: Final = 5000
"""The stage's ZMTP heartbeat timeout: a TCP peer that vanished is dropped after this."""

HELLO_HOLD_S: Final = HEARTBEAT_TIMEOUT_MS / 1000
"""How long a ``hello`` is held while the output socket still has a connection: as long as
the heartbeat needs to drop one whose peer vanished."""

# Exact types of received data that need no check (decoded ints are always in range).
_RECEIVED_FLAT: Final = frozenset({type(None), bool, int, float, str, bytes})
# Of a pipe message's items (_pipe_stage): MORE, FIRST, END, ONLY, and END or ONLY with
# REPORT (8).
_PIPE_KINDS: Final = frozenset({0, 1, 2, 3, 10, 11})


def _generational(entry: list[Any]) -> bool:
    """Whether a route's *entry* that is a list is ``[replica, generation]``, both ints >= 0
    (``docs/wire.md`` section 8, "Restarts")."""
    return (
        len(entry) == 2
        and type(entry[0]) is int
        and type(entry[1]) is int
        and entry[0] >= 0
        and entry[1] >= 0
    )


Event = tuple[Any, ...]

NOT_ATTACHED: Final = (
    "this stage serves several clients (--max-clients): send hello first; a peer that is "
    "not attached may only send hello and stats"
)
"""The ``reject`` reason for a message to a multi-client stage from a peer it has not
welcomed (anything but ``hello``, ``stats`` and ``bye``)."""

SESSION_LOST: Final = "session lost: "
"""How the ``reject`` reason begins for a message (a ``ping`` too) from a client that a
multi-client stage detached by itself (silent past the session timeout, its output
connection lost, or fallen behind): the rest says why. Such a client may say ``hello``
again."""

NO_SESSION: Final = (
    f"{SESSION_LOST}this peer has no session on this stage: the stage detached it (its log "
    "says why) and aborted its requests, or its connection was made again under a new "
    "routing id (a client without one of its own, after a pause longer than the 5 s "
    "heartbeat), or it never said hello. Send hello to attach"
)
"""The ``reject`` reason for a ``ping`` from a peer that a multi-client stage has no
session for, and does not remember detaching."""

OUTPUT_GRACE_S: Final = 1.0
"""How long a client of a multi-client stage may stay without an output connection, once it
had one, before the stage detaches it (a TCP connection that breaks reconnects within it)."""

_LOST_REMEMBERED: Final = 256  # detached clients whose later messages get SESSION_LOST


def key_revoked(key: str) -> str:
    """The ``reject`` reason for every message from a peer that connected with the CURVE
    public key *key* (Z85) once the stage no longer authorizes it (``authorize``, SIGHUP):
    its session is ended and its requests aborted."""
    return (
        f"{SESSION_LOST}the stage no longer authorizes this client's CURVE public key "
        f"{key or '(unknown)'}: its authorized client keys were changed (key rotation, "
        f"docs/security.md), and its live requests were aborted. Connect again with a key "
        f"the stage lists"
    )


class SessionState(enum.Enum):
    """Where the attached client is. The outbox is *detached* (bounded, since nobody can
    read) in ``NONE`` and ``OUTPUT_LOST``."""

    NONE = "none"
    """No client is attached: none yet, or the last one said ``bye``."""
    WELCOMED = "welcomed"
    """A client was welcomed, and its ``PULL`` has not connected yet: its first events wait
    for it, unbounded."""
    CONNECTED = "connected"
    """The attached client's ``PULL`` is connected to the output socket."""
    OUTPUT_LOST = "output lost"
    """The attached client's ``PULL`` was connected and no longer is; it may reconnect."""


class Held(NamedTuple):
    """A ``hello`` waiting for the output socket to lose its last connection."""

    ident: bytes
    deadline: float
    why: str
    """Why it is rejected at *deadline*."""


class OutputSide(Protocol):
    """What the session needs of the output side (:class:`~._outbox.Outbox`)."""

    resync: bool

    def begin_session(self) -> tuple[int, int]:
        """Drop what is queued for the previous client; the new epoch, and how many events
        were dropped."""
        ...

    def set_detached(self, detached: bool) -> int:
        """Whether no client can read; how many events were dropped past the bound in the
        detached period that ends (else 0)."""
        ...

    def cut_connections(self) -> None:
        """Close every connection of the output socket (a revoked client's ``PULL``); the
        monitor's ``CLOSED`` then tells :meth:`StageSession.output_closed`."""
        ...

    @property
    def detached_max(self) -> int: ...


class CallTable:
    """The utility calls the session has sent to the loop and the loop has not answered:
    the loop's call id (a stage-wide count) -> the session epoch and the client's call id.

    Client call ids are the clients' own: two clients may use the same one. The loop's ids
    are the stage's, so an answer names the session that made the call. The input side
    opens (:meth:`open`), the loop thread closes (:meth:`close`, once per call, rule 17):
    a ``dict`` item set and ``pop`` are each atomic, so no lock."""

    __slots__ = ("_calls", "_next")

    def __init__(self) -> None:
        self._calls: dict[int, tuple[int, int]] = {}
        self._next = itertools.count(1).__next__

    def open(self, epoch: int, call_id: int) -> int:
        """The loop's id for the client's call *call_id*, made in session *epoch*."""
        loop_id = self._next()
        self._calls[loop_id] = (epoch, call_id)
        return loop_id

    def close(self, loop_id: int) -> tuple[int, int] | None:
        """The epoch and client call id of the loop's call *loop_id* (``None`` if it is not
        one the session opened)."""
        return self._calls.pop(loop_id, None)

    def __len__(self) -> int:
        return len(self._calls)


class SessionGate:
    """The outbox's view of the session: which events to drop, and how many were dropped.
    Pure bookkeeping: the outbox calls every method under its lock.

    - *epoch*: the session the output side serves (:meth:`begin`, when a client is
      welcomed), and *loop_epoch* the one whose events the loop emits (:meth:`loop_begun`,
      in order with the loop's input). A loop event is dropped while they differ: it
      answers the previous client's messages, or is an output of its requests.
    - *detached*: no client can read. At most *detached_max* events (one per output) are
      kept; the rest are dropped and counted (:meth:`take_dropped`). The terminal event
      is never dropped.

    :attr:`gated` is true while any event may be dropped: the one flag the loop's hot path
    reads."""

    __slots__ = (
        "_detached_weight",
        "detached",
        "detached_max",
        "dropped",
        "epoch",
        "gated",
        "loop_epoch",
    )

    def __init__(self, detached_max: int) -> None:
        self.detached_max = detached_max
        self.epoch = 0
        self.loop_epoch = 0
        self.detached = True  # until a client is welcomed and connected
        self.gated = True
        self._detached_weight = 0  # kept in this detached period
        self.dropped = 0  # dropped past detached_max in this detached period

    def begin(self) -> int:
        """A new client is welcomed: its epoch. The loop's events are dropped until the loop
        has applied it."""
        self.epoch += 1
        self.gated = True
        return self.epoch

    def loop_begun(self, epoch: int) -> None:
        """The loop's events belong to session *epoch* from now on."""
        self.loop_epoch = epoch
        self.gated = self.detached or epoch != self.epoch

    def set_detached(self, detached: bool) -> int:
        """Whether no client can read; returns what was dropped past the bound in the period
        that ends (and starts counting again)."""
        self.detached = detached
        self.gated = detached or self.loop_epoch != self.epoch
        dropped, self.dropped = self.dropped, 0
        self._detached_weight = 0
        return dropped

    def take_dropped(self) -> int:
        """What was dropped past the bound in the detached period under way; counting
        starts again."""
        dropped, self.dropped = self.dropped, 0
        return dropped

    def admit(self, terminal: bool, weight: int) -> bool:
        """Whether an event of *weight* is kept while detached (counted if not). *terminal*:
        the stage's last event, always kept."""
        if terminal:
            return True
        if self._detached_weight + weight > self.detached_max:
            self.dropped += weight
            return False
        self._detached_weight += weight
        return True

    def admit_loop(self, terminal: bool, weight: int) -> bool:
        """Whether a loop event is kept: of the current session, and within the bound."""
        if self.loop_epoch != self.epoch:
            return False
        return not self.detached or self.admit(terminal, weight)


class StageSession:
    """The stage's half of the protocol for the input side (module docstring). Sans-IO:
    every method is told the time; nothing blocks. Used by one thread at a time (whichever
    holds the input side, :mod:`._input_queue`), except :attr:`output_peers` and
    :attr:`attached`, which the loop thread reads unlocked (a stale read is harmless).

    *output* is the output side (:class:`OutputSide`), *calls* the table that the loop's
    ``emit`` answers utility calls from. *engine_name* and *output_address* go into the
    ``welcome``; *session_timeout* is how long an attached client may be silent before a
    new ``hello`` can take its session over. *statistics* answers a ``stats`` message (the
    stage's statistics, :func:`~._statistics.stage_statistics`), on the calling thread.
    *max_message_bytes* (the input socket's bound on a frame, ``None``: none) is said in
    the ``welcome`` too.
    """

    def __init__(
        self,
        output: OutputSide,
        calls: CallTable,
        *,
        engine_name: str,
        output_address: str,
        session_timeout: float,
        statistics: Callable[[], Any] = dict,
        features: Sequence[str] = (),
        keep_requests: bool = False,
        max_message_bytes: int | None = None,
    ) -> None:
        self._output = output
        # The input socket's bound on a frame (serve --max-message-bytes), said in every
        # welcome so that a client refuses a bigger message instead of losing it.
        self.max_message_bytes = max_message_bytes
        # What became of a detached client's requests, for the reason a client whose
        # session was taken over is given (StageRuntime's keep_requests_on_detach).
        self._fate = (
            "its live requests were kept running in the stage (keep_requests_on_detach): "
            "the next client receives their outputs"
            if keep_requests
            else "its live requests were aborted"
        )
        self._calls = calls
        self._statistics = statistics
        # *features*: what the welcome says beyond the version (a pipeline's stage: "tags",
        # docs/wire.md section 8); none: the welcome as before, five elements.
        self._welcome = _wire.welcome_frame(
            output_address, os.getpid(), engine_name, tuple(features), max_message_bytes
        )
        self._session_timeout = session_timeout
        # shm: a pipeline's previous stage may send big arrays in shared memory (_shm).
        self._decoder = _codec.Decoder(_wire.ClientMsg, strict=False, shm=True)
        self.to_loop: list[Message] = []
        """Loop messages, in arrival order, for the input side to queue after a read."""
        self.gone_links: set[bytes] = set()
        """The routing ids of a pipeline's previous stage that the coordinator said is gone
        (``gone``): every later message from one is dropped before it is decoded."""
        self._generations: dict[bytes, int] = {}
        """The generation of each previous stage's link that sent a ``pipe`` message (its
        routing id's, :func:`._edge.link_generation`), told to the loop with each frame."""
        self.events: list[Event] = []
        """Events for the client (input errors, pongs), for the input side to post."""
        self.replies: list[tuple[bytes, bytes]] = []
        """``(routing id, body)`` to send on the input socket (welcome, reject, and the
        answer to an observer's ``stats``)."""
        self.state = SessionState.NONE
        self.client: bytes | None = None
        """The attached client's routing id."""
        self.epoch = 0
        """The session epoch the client's calls are made in."""
        self.held: Held | None = None
        self.output_peers = 0
        """Connections to the output socket (:meth:`output_peers_changed`)."""
        self._seen = 0.0  # when the attached client was last heard from
        self._unheard = False  # welcomed, and no message from it yet
        self._told_detached = True  # what the output side was last told
        self._taken_over: dict[bytes, str] = {}
        """Clients whose session the next client took over (they were silent past the
        session timeout), or that the stage ended (:meth:`_output_overflowed`): routing id
        -> the ``reject`` reason for their later messages (the last
        :data:`_LOST_REMEMBERED`, oldest first)."""
        self.expires = False
        """Whether :meth:`settle` has a deadline to keep besides a held ``hello`` (a
        multi-client stage's session timeouts): the input side calls it after every read,
        and waits no longer than :meth:`wait_ms`."""

    @property
    def attached(self) -> bool:
        """Whether a client is attached (welcomed, and has not left)."""
        return self.state is not SessionState.NONE

    @property
    def detached(self) -> bool:
        """Whether no client can read: none attached, or its output connection is lost."""
        return self.state is SessionState.NONE or self.state is SessionState.OUTPUT_LOST

    # -- frames ------------------------------------------------------------------------------

    def receive(self, ident: bytes, parts: list[Any], now: float) -> None:
        """Handle one message from *ident*: *parts* is its body and buffers (``bytes`` or
        ``zmq.Frame``). A bug here must not end the input side: an exception becomes an
        unscoped ``error`` event, and is logged."""
        try:
            self._receive(ident, parts, now)
        except Exception as exc:
            logger.exception("enginecore: error while handling an input frame")
            self.events.append(("error", None, f"stage failed to handle a frame: {exc!r}"))

    def _receive(self, ident: bytes, parts: list[Any], now: float) -> None:
        if self.gone_links and ident in self.gone_links:
            # A late message of a dead previous stage, which no order ties to the abort
            # that the coordinator sent after its `gone`: never applied, nor decoded (its
            # arrays in shared memory are not mapped again).
            self.to_loop.append(PipeGone("previous", 1))
            return
        try:
            msg = self._decoder.decode(parts)
        except Exception as exc:  # DecodeError; also RecursionError for a deep nesting
            self._report_bad_frame(ident, parts[0], exc)
            return
        if ident == self.client:
            self._seen = now
            if self._unheard:
                # The first message of a new client: its events follow. libzmq's IO thread
                # finished closing the previous client's output connection, down to the
                # command that tells the output socket, before it read this message; a
                # resync makes the output socket act on that command before it sends
                # anything more (Outbox._resync).
                self._unheard = False
                self._output.resync = True
        elif (
            self._taken_over
            and ident in self._taken_over
            and self._refused_after_takeover(ident, type(msg))
        ):
            return
        cls = type(msg)
        if cls is _wire.AddMsg:
            data = msg.data
            if type(data) not in _RECEIVED_FLAT:
                problem = _invalid(data, "data")
                if problem is not None:
                    self.events.append(("error", msg.req_id, f"invalid message: {problem}"))
                    return
            self.to_loop.append(make_add(msg.req_id, data))
        elif cls is _wire.AddsMsg:
            self._adds(msg)
        elif cls is _wire.AbortMsg:
            if msg.routes is not None:
                self._routes(msg.req_ids, msg.routes, abort=True)
            if msg.fence is True:  # a replay's fence (section 8): answered flagged
                self.to_loop.append(PipeFence(msg.req_ids))
            elif msg.tag is not None:  # an abort after a death (section 8): answered tagged
                self.to_loop.append(PipeAbort(msg.req_ids, msg.tag))
            else:
                self.to_loop.append(Abort(msg.req_ids))
        elif cls is _wire.PipeMsg:
            # The frame's size, and the bytes of its arrays in shared memory (the credit).
            self._pipe(msg, sum(map(len, parts)) + self._decoder.shm_bytes, ident)
        elif cls is _wire.CreditMsg:
            self.to_loop.append(PipeCredit(msg.items, msg.nbytes, msg.replica))
        elif cls is _wire.RouteMsg:
            self._routes(msg.req_ids, msg.routes)
        elif cls is _wire.GoneMsg:
            self._gone(msg)
        elif cls is _wire.LinkMsg:
            self._link(msg)
        elif cls is _wire.ReplayMsg:
            self.to_loop.append(PipeReplay(msg.req_id, msg.attempt))
        elif cls is _wire.ReleaseMsg:
            self.to_loop.append(PipeRelease(msg.req_ids))
        elif cls is _wire.UtilityMsg:
            args = msg.args
            if args and not set(map(type, args)) <= _RECEIVED_FLAT:
                problem = _invalid(args, "args")
                if problem is not None:
                    what = f"invalid message: {problem}"
                    self.events.append(("utility", msg.call_id, None, f"ProtocolError({what!r})"))
                    return
            loop_id = self._calls.open(self.epoch, msg.call_id)
            self.to_loop.append(make_utility(loop_id, msg.name, tuple(args)))
        elif cls is _wire.PingMsg:
            self.events.append(("pong", msg.seq))
        elif cls is _wire.StatsMsg:
            self._answer_stats(ident, ("utility", msg.call_id, self._statistics(), None))
        elif cls is _wire.ShutdownMsg:
            drain = msg.drain
            if drain is not msgspec.UNSET and not 0 <= drain < math.inf:
                self.events.append(
                    ("error", None, f"invalid message: shutdown drain must be >= 0, got {drain}")
                )
                return
            self.to_loop.append(Stop(None if drain is msgspec.UNSET else drain))
        elif cls is _wire.HelloMsg:
            self._hello(ident, msg, now)
        elif cls is _wire.ByeMsg:
            self._bye(ident)

    def _adds(self, msg: _wire.AddsMsg) -> None:
        req_ids, data = msg.req_ids, msg.data
        if len(req_ids) != len(data):
            what = (
                f"invalid message: adds has {len(req_ids)} request ids but {len(data)} data items"
            )
            self.events += [("error", rid, what) for rid in req_ids] or [("error", None, what)]
            return
        if not req_ids:
            return
        if set(map(type, data)) <= _RECEIVED_FLAT:  # nothing to check: one burst
            self.to_loop.append(AddBurst(req_ids, data))
            return
        ok_ids: list[str] = []
        ok_data: list[Any] = []
        errors: list[Event] = []
        for rid, item in zip(req_ids, data, strict=True):
            if type(item) not in _RECEIVED_FLAT:
                problem = _invalid(item, "data")
                if problem is not None:
                    errors.append(("error", rid, f"invalid message: {problem}"))
                    continue
            ok_ids.append(rid)
            ok_data.append(item)
        if ok_ids:
            self.to_loop.append(AddBurst(ok_ids, ok_data))
        self.events += errors

    def _routes(self, req_ids: list[str], routes: list[list[Any]], abort: bool = False) -> None:
        """Routes of a pipeline with replica pools (``docs/wire.md`` section 8): one
        :class:`PipeRoute`, or an unscoped ``error`` if they do not match the ids. An
        abort's routes may say ``-1``: the request's process of that stage died (the abort
        goes no further). A stage that restarts may be named ``[replica, generation]``
        (section 8, "Restarts"), both ints >= 0 (the decoder took only ints there)."""
        least = -1 if abort else 0
        if len(routes) != len(req_ids) or not all(
            type(r) is list
            and (
                all(type(i) is int and i >= least for i in r)
                or all(
                    (type(i) is int and i >= least) or (type(i) is list and _generational(i))
                    for i in r
                )
            )
            for r in routes
        ):
            self.events.append(
                (
                    "error",
                    None,
                    "invalid message: routes must be one list of replica indexes per request",
                )
            )
            return
        self.to_loop.append(PipeRoute(req_ids, routes, abort))

    def _link(self, msg: _wire.LinkMsg) -> None:
        """The coordinator's ``link`` (``docs/wire.md`` section 8): one :class:`PipeLink`,
        or an unscoped ``error`` for a generation that is not an int >= 0 (the decoder took
        only an int or nil there)."""
        generation = msg.generation
        if generation is not None and generation < 0:
            why = f"invalid message: link generation must be an int >= 0, got {generation}"
            self.events.append(("error", None, why))
            return
        link = PipeLink(msg.replica, msg.address, msg.slots, msg.server_key, generation)
        self.to_loop.append(link)

    def _pipe(self, msg: _wire.PipeMsg, nbytes: int, ident: bytes = b"") -> None:
        """Input from a pipeline's previous stage (*nbytes*: the frame's size, *ident*: the
        routing id of the link it came on): one :class:`PipeInput` of the items that are
        valid, and an ``error`` for the request of each one that is not. The control carries
        the whole frame's size and item count, so that the credit the stage gives back
        covers the invalid items too, and the sender: its replica index (the message's) and
        its process's generation (the link's routing id's), so that a ``gone`` of a dead
        process clears only what that process sent, not what its successor at the same
        index sent already (``docs/wire.md`` section 8, "Restarts")."""
        kinds, req_ids, data = msg.kinds, msg.req_ids, msg.data
        generations = self._generations
        generation = generations.get(ident)
        if generation is None:
            generation = link_generation(ident.decode("utf-8", "replace"))
            if len(generations) < 4096:  # a link's id, one per process ever linked in
                generations[ident] = generation
        received = (len(kinds), nbytes, msg.sender, generation)
        if msg.routes:
            routed = msg.routes
            self._routes(list(routed), list(routed.values()))
        if not len(kinds) == len(req_ids) == len(data):
            what = (
                f"invalid message: pipe has {len(kinds)} kinds, {len(req_ids)} request ids "
                f"and {len(data)} data items"
            )
            self.events += [("error", rid, what) for rid in req_ids] or [("error", None, what)]
            self.to_loop.append(PipeInput([], [], [], received))
            return
        if set(kinds) <= _PIPE_KINDS and set(map(type, data)) <= _RECEIVED_FLAT:
            self.to_loop.append(PipeInput(kinds, req_ids, data, received))
            return
        ok_kinds: list[int] = []
        ok_ids: list[str] = []
        ok_data: list[Any] = []
        for kind, rid, item in zip(kinds, req_ids, data, strict=True):
            problem = None
            if kind not in _PIPE_KINDS:
                problem = f"pipe kind must be 0, 1, 2, 3, 10 or 11, got {kind}"
            elif type(item) not in _RECEIVED_FLAT:
                problem = _invalid(item, "data")
            if problem is not None:
                if _shm.EXPIRED in problem:  # a payload whose lease expired: no data error
                    what = f"{_shm.EXPIRED}: {problem.replace(_shm.EXPIRED + ': ', '')}"
                else:
                    what = f"invalid message: {problem}"
                self.events.append(("error", rid, what))
                continue
            ok_kinds.append(kind)
            ok_ids.append(rid)
            ok_data.append(item)
        self.to_loop.append(PipeInput(ok_kinds, ok_ids, ok_data, received))

    def _gone(self, msg: _wire.GoneMsg) -> None:
        """The coordinator says the stage before this one (``"previous"``: its link's
        routing id is *link*) or after it (``"next"``) is gone. For the previous one, every
        later message from that link is dropped here, in the order the input socket gave
        them, and the shared-memory mappings of its slots are let go (an array the engine
        still holds keeps its own until it dies)."""
        side = msg.side
        if side == "previous":
            if not msg.link:
                self.events.append(("error", None, "invalid message: gone needs the link"))
                return
            self.gone_links.add(msg.link.encode())
            # A replica of a pool or a stage that restarts (its index after the link's
            # "-r", and the generation of the process that died), or the whole stage.
            token = link_token(msg.link)
            _shm.upstream_gone(token)
            if token is not None:  # which process: its credit owed goes with it
                replica, _, generation = token.partition(".")
                gone = PipeGone(side, 0, int(replica), int(generation) if generation else 0)
                self.to_loop.append(gone)
                return
        elif side != "next":
            why = f"invalid message: gone side must be previous or next, got {side!r}"
            self.events.append(("error", None, why))
            return
        self.to_loop.append(PipeGone(side, 0, msg.replica))

    def _report_bad_frame(self, ident: bytes, body: Any, exc: Exception) -> None:
        # Recover the tag and an id from the head of the body, so that the error reaches
        # the one request or call it concerns instead of leaving it hanging.
        raw = getattr(body, "buffer", body)  # a zmq.Frame's memoryview, or bytes
        tag, head = _codec.recover_head(raw)
        why = str(exc) if isinstance(exc, msgspec.DecodeError) else f"{type(exc).__name__}: {exc}"
        what = f"invalid message ({len(raw)} bytes): {why}"
        if tag == "add" and type(head) is str:
            self.events.append(("error", head, what))
        elif tag == "adds" and type(head) is list and head:
            self.events += [("error", rid, what) for rid in head]
        elif tag == "utility" and type(head) is int:
            self.events.append(("utility", head, None, f"ProtocolError({what!r})"))
        elif tag == "stats" and type(head) is int:
            self._answer_stats(ident, ("utility", head, None, f"ProtocolError({what!r})"))
        elif tag == "stats" and ident != self.client:
            # An observer's request with no call id to answer: the attached client is not
            # told of it (docs/wire.md section 3, "Observers").
            logger.debug("enginecore: an observer's invalid stats request: %s", what)
        elif tag == "hello":
            self._reject(ident, f"invalid hello: {what}")
        else:
            self.events.append(("error", None, what))

    def _answer_stats(self, ident: bytes, answer: Event) -> None:
        # The attached client's answer goes on the output socket, in order with its other
        # events; any other peer (an observer, such as `enginecore top`) gets it on the
        # input socket, like a welcome, so that it never reaches the attached client.
        if ident == self.client:
            self.events.append(answer)
        else:
            self.replies.append((ident, msgspec.msgpack.encode(answer)))

    # -- sessions ----------------------------------------------------------------------------

    def _wrong_version(self, ident: bytes, msg: _wire.HelloMsg) -> bool:
        """Reject a ``hello`` of another protocol version; whether it was one."""
        if msg.version == _wire.PROTOCOL_VERSION:
            return False
        self._reject(
            ident,
            f"protocol version {msg.version} is not supported; this stage speaks "
            f"version {_wire.PROTOCOL_VERSION}",
        )
        return True

    def _hello(self, ident: bytes, msg: _wire.HelloMsg, now: float) -> None:
        if self._wrong_version(ident, msg):
            return
        if ident == self.client:  # the attached client, again
            self._accept(ident, now)
            return
        if self.held is not None:
            if self.held.ident != ident:
                self._reject(ident, "another client is connecting to this stage")
            return  # the same client again: its first hello is still held
        silent = self.client is not None
        if silent and now - self._seen < self._session_timeout:
            self._reject(ident, "another client is attached to this stage")
            return
        if self.output_peers == 0:
            self._accept(ident, now)
            return
        if silent:
            why = (
                "another client is attached to this stage: it has been silent for the session "
                "timeout, but it is still connected to the output socket"
            )
        else:
            why = (
                f"another client is still connected to the output socket after "
                f"{HELLO_HOLD_S:g} s (a client that sends bye must close its PULL socket)"
            )
        self.held = Held(ident, now + HELLO_HOLD_S, why)

    def settle(self, now: float) -> None:
        """Welcome the held ``hello`` once the output socket has no connection left; reject
        it at its deadline. The input side calls it after every read while one is held,
        and waits no longer than :meth:`wait_ms`."""
        held = self.held
        if held is None:
            return
        if self.output_peers == 0:
            self.held = None
            self._accept(held.ident, now)
        elif now >= held.deadline:
            self.held = None
            self._reject(held.ident, held.why)

    def wait_ms(self, now: float) -> int | None:
        """How long the input side may wait for input before :meth:`settle` is due (``None``:
        no limit)."""
        if self.held is None:
            return None
        return max(0, math.ceil((self.held.deadline - now) * 1000))

    def _bye(self, ident: bytes) -> None:
        if ident == self.client:
            self._end_session()
        elif self.held is not None and self.held.ident == ident:
            self.held = None  # it gave up waiting

    def _end_session(self, *, abort: bool = False) -> None:
        """The attached client is gone (a ``bye``, or its key revoked: *abort*)."""
        self.client = None
        self.state = SessionState.NONE
        # After everything it sent (to_loop keeps arrival order).
        self.to_loop.append(SessionChange(None, abort=abort))
        self._tell_detached()

    def revoke(self, ident: bytes, key: str) -> bool:
        """*ident* connected with the CURVE key *key*, which the stage no longer authorizes
        (the input side's :class:`~._curve.KeyWatch` says so, at a message of it or at the
        change of the keys): its session ends as after a ``bye``, its live requests are
        aborted even on a stage that keeps them, a held ``hello`` of it is dropped, and it
        gets a ``reject`` (:func:`key_revoked`) that its client raises as
        :class:`~enginecore.stage.SessionLostError`. Its message, if any, is dropped.
        Whether it had a session (which ended)."""
        ended = ident == self.client
        if ended:
            self._end_session(abort=True)
            logger.warning(
                "enginecore: ended the session of the client whose CURVE key %s is no longer "
                "authorized; its live requests are aborted",
                key,
            )
            if self.output_peers:
                # Its PULL may stay connected, and a hello is welcomed only once nothing is:
                # a revoked client would keep every other one out. (A new client connects
                # its PULL only once welcomed, so nobody else's connection is cut.)
                self._output.cut_connections()
        elif self.held is not None and self.held.ident == ident:
            self.held = None
        self._reject(ident, key_revoked(key))
        return ended

    def with_session(self) -> list[bytes]:
        """The routing ids of the peers that have a session (or a held ``hello``)."""
        ids = [] if self.client is None else [self.client]
        if self.held is not None:
            ids.append(self.held.ident)
        return ids

    def _accept(self, ident: bytes, now: float) -> None:
        previous = self.client
        self._unheard = ident != previous
        if self._unheard:
            # A new client: nothing queued for the previous one may reach it. (Its output
            # connection is gone: a hello is only welcomed with no output peer.)
            epoch, dropped = self._output.begin_session()
            if dropped:
                logger.info(
                    "enginecore: dropped %d events of the previous client at a new session",
                    dropped,
                )
            self.epoch = epoch
            self.to_loop.append(SessionChange(epoch))
            self.state = SessionState.WELCOMED
            if previous is not None:  # it was silent past the session timeout
                taken = self._taken_over
                taken[previous] = (
                    f"{SESSION_LOST}another client took this client's session over (session "
                    f"{epoch}) after this client was silent for more than the session timeout "
                    f"({self._session_timeout:g} s); {self._fate}. Send hello to attach again"
                )
                while len(taken) > _LOST_REMEMBERED:
                    del taken[next(iter(taken))]
        self._taken_over.pop(ident, None)
        self.client = ident
        self._seen = now
        self._update_state()
        self.replies.append((ident, self._welcome))

    def _refused_after_takeover(self, ident: bytes, cls: type) -> bool:
        """A message from *ident*, a client whose session the next one took over: was it
        refused? It may still say ``hello`` (a new session, if the stage takes one), ask for
        ``stats`` (answered on the input socket, as an observer's) and say ``bye`` (then it
        is forgotten). Anything else, its pings included, never reaches the engine or the
        attached client's output, and is answered with a :data:`SESSION_LOST` ``reject``:
        its client fails its streams and calls with
        :class:`~enginecore.stage.SessionLostError` and closes its ``PULL``, which, once
        it connected again after its pause, the output socket would deal the attached
        client's events to."""
        if cls is _wire.HelloMsg or cls is _wire.StatsMsg:
            return False
        if cls is _wire.ByeMsg:
            del self._taken_over[ident]
        else:
            self._reject(ident, self._taken_over[ident])
        return True

    def output_peers_changed(self, delta: int) -> None:
        """The output socket's monitor saw a connection accepted (+1) or closed (-1)."""
        self.output_peers = max(0, self.output_peers + delta)
        self._update_state()

    def output_closed(self) -> None:
        """The output socket's monitor saw its listener close (the address unbound, by
        :meth:`OutputSide.cut_connections`, or the socket closed): every connection made
        through it is gone, without a disconnect of its own."""
        self.output_peers = 0
        self._update_state()

    def _update_state(self) -> None:
        state = self.state
        if state is not SessionState.NONE:
            if self.output_peers > 0:
                self.state = SessionState.CONNECTED
            elif state is SessionState.CONNECTED:
                self.state = SessionState.OUTPUT_LOST
        dropped = self._tell_detached()
        if dropped and state is SessionState.OUTPUT_LOST and self.state is SessionState.CONNECTED:
            self._output_overflowed(dropped)

    def _tell_detached(self) -> int:
        # The outbox learns each change once; it logs nothing itself, so the drops of a
        # detached period that ends are logged here. Returns them.
        detached = self.detached
        if detached == self._told_detached:
            return 0
        self._told_detached = detached
        dropped = self._output.set_detached(detached)
        log_detached_drops(dropped, self._output.detached_max)
        return dropped

    def _output_overflowed(self, dropped: int) -> None:
        """The attached client's output connection came back after the stage dropped
        *dropped* of its events past the detached bound: its streams miss outputs (their
        last ones perhaps) and its calls their answers, which would wait for ever. Its
        session ends, as a multi-client stage ends a reader that fell behind: its requests
        go as a ``bye``'s do, its ``PULL`` is cut, and its next message (a ``ping``) gets a
        :data:`SESSION_LOST` ``reject``, which its client raises as
        :class:`~enginecore.stage.SessionLostError` in every stream and call."""
        client = self.client
        assert client is not None  # CONNECTED: a client is attached
        epoch = self.epoch
        self._end_session()
        self._output.cut_connections()  # its PULL must not take the next client's events
        logger.warning(
            "enginecore: ended the session of client %r (session %d): its output connection "
            "was lost while %d events were dropped past the detached buffer (%d); %s",
            client,
            epoch,
            dropped,
            self._output.detached_max,
            self._fate,
        )
        self._taken_over[client] = (
            f"{SESSION_LOST}the stage ended this client's session (session {epoch}): its "
            f"output connection was lost for longer than the stage's detached buffer holds "
            f"({self._output.detached_max} events; {dropped} were dropped), and "
            f"{self._fate}. Send hello to attach again"
        )
        while len(self._taken_over) > _LOST_REMEMBERED:
            del self._taken_over[next(iter(self._taken_over))]

    def _reject(self, ident: bytes, reason: str) -> None:
        reject = _wire.RejectMsg(_wire.PROTOCOL_VERSION, reason)
        self.replies.append((ident, msgspec.msgpack.encode(reject)))


class ClientsSide(ClientsTarget, Protocol):
    """What :class:`MultiStageSession` needs of the output side
    (:class:`~._fanout.Fanout`)."""

    def open_session(self, epoch: int) -> str:
        """Bind session *epoch*'s output socket; its endpoint. Raises if it cannot."""
        ...

    def post_to(self, epoch: int, item: Any, weight: int) -> None:
        """Events for session *epoch*'s client (dropped once it has left)."""
        ...

    @property
    def gone_waiting(self) -> bool:
        """Whether :meth:`take_gone` has something (an unlocked peek)."""
        ...

    def take_gone(self) -> list[tuple[int, str]]:
        """The sessions whose client the output side cut (it fell behind), with why."""
        ...


class _Client:
    """One client attached to a multi-client stage."""

    __slots__ = ("epoch", "ident", "lost_at", "name", "peers", "seen", "welcome")

    def __init__(self, ident: bytes, epoch: int, name: str, seen: float, welcome: bytes) -> None:
        self.ident = ident
        self.epoch = epoch
        self.name = name
        self.seen = seen  # when it was last heard from
        self.welcome = welcome
        self.peers = 0  # connections to its output socket
        self.lost_at: float | None = None  # when its last output connection closed


class MultiStageSession(StageSession):
    """The input side's sessions on a stage that serves up to *max_clients* clients at once
    (``serve --max-clients``, ``docs/wire.md`` section 3). Sans-IO, as
    :class:`StageSession`, whose message handling it keeps; what differs:

    - each welcomed client gets its own output socket (*clients*,
      :meth:`ClientsSide.open_session`), named in its own ``welcome``; a ``hello`` is never
      held (no other client's ``PULL`` shares the socket). A ``hello`` while *max_clients*
      are attached first detaches those silent past the session timeout, then is rejected
      if none was;
    - the loop learns who sends what: a :class:`~._controls.ClientJoined` at a welcome, a
      :class:`~._controls.ClientInput` before a client's messages when the sender changes,
      a :class:`~._controls.ClientLeft` after its ``bye``, or once it has been silent past
      the session timeout (:meth:`settle`);
    - a client is also detached when its output socket's last connection closed and none
      came back within :data:`OUTPUT_GRACE_S` (:meth:`client_output_changed`; the monitor
      of each client's socket tells), and when the output side cut it for falling behind
      (:meth:`ClientsSide.take_gone`). These two and the session timeout are logged at
      WARNING, and the client's later messages, pings included, get a ``reject`` that
      begins with :data:`SESSION_LOST`;
    - the events it makes (an input error, a pong, a ``stats`` answer) go to the sender's own
      socket (:meth:`ClientsSide.post_to`), never to :attr:`events`;
    - a peer that is not attached may say ``hello``, ``stats`` (an observer) and ``bye``;
      anything else for the loop is refused with a ``reject`` (:data:`NOT_ATTACHED`) on the
      input socket, and never reaches the engine.

    *output* (the one-client output side) is kept for :class:`StageSession`'s bookkeeping;
    nothing of a multi-client session reaches it."""

    def __init__(
        self,
        output: OutputSide,
        calls: CallTable,
        *,
        clients: ClientsSide,
        max_clients: int,
        engine_name: str,
        output_address: str,
        session_timeout: float,
        statistics: Callable[[], Any] = dict,
        max_message_bytes: int | None = None,
    ) -> None:
        if max_clients < 2:
            raise ValueError(f"a multi-client session needs max_clients >= 2, got {max_clients}")
        super().__init__(
            output,
            calls,
            engine_name=engine_name,
            output_address=output_address,
            session_timeout=session_timeout,
            statistics=statistics,
            max_message_bytes=max_message_bytes,
        )
        self._clients = clients
        self._engine_name = engine_name
        self.max_clients = max_clients
        self.clients: dict[bytes, _Client] = {}
        """The attached clients, by routing id."""
        self._epochs = itertools.count(1)
        self._loop_sender: _Client | None = None  # whose messages the loop applies last
        # Clients detached for a lost output or for falling behind: routing id -> why (the
        # last _LOST_REMEMBERED, oldest first).
        self._lost: dict[bytes, str] = {}

    @property
    def attached(self) -> bool:
        """Whether any client is attached."""
        return bool(self.clients)

    @property
    def detached(self) -> bool:
        """Whether no client is attached."""
        return not self.clients

    def receive(self, ident: bytes, parts: list[Any], now: float) -> None:
        """As :meth:`StageSession.receive`, for the client *ident* is (module docstring)."""
        if self._clients.gone_waiting:
            self._take_gone()
        client = self.clients.get(ident)
        if client is not None:
            client.seen = now
            self.client = ident  # StageSession's checks ("the attached client") see it
            self.epoch = client.epoch  # its utility calls are made in its session
        else:
            self.client = None
            self.epoch = 0  # no session has epoch 0: an answer is dropped
        to_loop = self.to_loop
        before = len(to_loop)
        super().receive(ident, parts, now)
        if len(to_loop) > before:
            if client is None:
                # Only a hello's controls may come from a peer that is not attached (the
                # ClientLeft of a silent client it replaces, its ClientJoined).
                new = to_loop[before:]
                kept = [m for m in new if type(m) is ClientJoined or type(m) is ClientLeft]
                if len(kept) != len(new):
                    del to_loop[before:]
                    to_loop += kept
                    self._reject(ident, self._lost.get(ident, NOT_ATTACHED))
            else:
                if client is not self._loop_sender and type(to_loop[before]) is not ClientLeft:
                    to_loop.insert(before, ClientInput(self._clients, client.epoch))
                    self._loop_sender = client
                if type(to_loop[-1]) is Stop:
                    logger.warning(
                        "enginecore: client %r asked the stage to shut down; %d clients "
                        "are attached, and all get its last event",
                        client.name,
                        len(self.clients),
                    )
        if self.events:
            events, self.events = self.events, []
            if client is not None:
                self._clients.post_to(
                    client.epoch, events if len(events) > 1 else events[0], len(events)
                )
            elif ident in self._lost:
                # A ping (or a bad frame) from a client the stage detached: tell it.
                self._reject(ident, self._lost[ident])
            elif any(ev[0] == "pong" for ev in events):
                # A ping from a peer with no session: a client without a routing id of its
                # own whose connection was made again after the stage detached it, most
                # often (the Python clients keep theirs: _clientbase.routing_id).
                self._reject(ident, NO_SESSION)
            else:
                logger.info(
                    "enginecore: dropping %d events for a peer that is not attached: %r",
                    len(events),
                    events[:3],
                )

    def _hello(self, ident: bytes, msg: _wire.HelloMsg, now: float) -> None:
        if self._wrong_version(ident, msg):
            return
        client = self.clients.get(ident)
        if client is not None:  # an attached client, again
            self.replies.append((ident, client.welcome))
            return
        if len(self.clients) >= self.max_clients:
            self._expire(now)
        if len(self.clients) >= self.max_clients:
            self._reject(
                ident,
                f"this stage serves at most {self.max_clients} clients at once "
                f"(--max-clients), and {len(self.clients)} are attached",
            )
            return
        self._lost.pop(ident, None)
        epoch = next(self._epochs)
        try:
            address = self._clients.open_session(epoch)
        except Exception as exc:
            if isinstance(exc, OSError):  # a bind that failed (StageBindError): its message says it
                logger.error("enginecore: cannot open an output socket for a new client: %s", exc)
            else:  # not expected: its traceback
                logger.exception("enginecore: cannot open an output socket for a new client")
            self._reject(ident, f"the stage cannot open an output socket for this client: {exc}")
            return
        welcome = _wire.welcome_frame(
            address, os.getpid(), self._engine_name, max_message_bytes=self.max_message_bytes
        )
        self.clients[ident] = _Client(ident, epoch, msg.client, now, welcome)
        self.expires = True
        self.to_loop.append(ClientJoined(self._clients, epoch))
        self.replies.append((ident, welcome))
        logger.info(
            "enginecore: client %r attached (session %d, %d of %d), output %s",
            msg.client,
            epoch,
            len(self.clients),
            self.max_clients,
            address,
        )

    def _bye(self, ident: bytes) -> None:
        self._lost.pop(ident, None)
        client = self.clients.get(ident)
        if client is not None:
            self._detach(client, "said bye")

    def _detach(self, client: _Client, why: str, *, lost: bool = False) -> None:
        """Detach *client*: a ``ClientLeft`` after everything it sent. *lost*: the stage
        ended its session (silent, lost output, fell behind), which is logged at WARNING,
        and its later messages are answered with a :data:`SESSION_LOST` ``reject``."""
        del self.clients[client.ident]
        self.expires = bool(self.clients)
        # After everything it sent (to_loop keeps arrival order).
        self.to_loop.append(ClientLeft(self._clients, client.epoch))
        if not lost:
            logger.info("enginecore: client %r (session %d) %s", client.name, client.epoch, why)
            return
        logger.warning(
            "enginecore: detaching client %r (session %d): it %s; its live requests are "
            "aborted, and the other clients go on",
            client.name,
            client.epoch,
            why,
        )
        lost_ = self._lost
        lost_[client.ident] = (
            f"{SESSION_LOST}the stage detached this client (session {client.epoch}) because "
            f"it {why}; its requests were aborted. Send hello to attach again"
        )
        while len(lost_) > _LOST_REMEMBERED:
            del lost_[next(iter(lost_))]

    def revoke(self, ident: bytes, key: str) -> bool:
        """As :meth:`StageSession.revoke`: the client of *ident*, if attached, is detached
        (its requests aborted, its output socket closed), and gets a ``reject``. Whether it
        was attached."""
        client = self.clients.get(ident)
        if client is not None:
            self._detach(
                client, f"was revoked (its CURVE key {key} is no longer authorized)", lost=True
            )
        self._lost.pop(ident, None)  # its later messages are revoked again, by their key
        self._reject(ident, key_revoked(key))
        return client is not None

    def with_session(self) -> list[bytes]:
        """The routing ids of the attached clients."""
        return list(self.clients)

    def _take_gone(self) -> None:
        for epoch, why in self._clients.take_gone():
            for client in self.clients.values():
                if client.epoch == epoch:
                    self._detach(client, why, lost=True)
                    break

    def client_output_changed(self, epoch: int, delta: int, now: float) -> None:
        """The monitor of session *epoch*'s output socket saw a connection accepted (+1) or
        closed (-1). A client left with no output connection, having had one, is detached
        :data:`OUTPUT_GRACE_S` later unless one comes back (:meth:`settle`)."""
        for client in self.clients.values():
            if client.epoch == epoch:
                client.peers = max(0, client.peers + delta)
                if client.peers:
                    client.lost_at = None
                elif delta < 0:
                    client.lost_at = now
                return

    def _expire(self, now: float) -> None:
        timeout = self._session_timeout
        for client in list(self.clients.values()):
            if now - client.seen >= timeout:
                self._detach(
                    client, f"was silent for the session timeout ({timeout:g} s)", lost=True
                )
            elif client.lost_at is not None and now - client.lost_at >= OUTPUT_GRACE_S:
                self._detach(
                    client,
                    f"lost its output connection (none came back within {OUTPUT_GRACE_S:g} s)",
                    lost=True,
                )

    def settle(self, now: float) -> None:
        """Detach the clients silent past the session timeout, those whose output connection
        was lost past :data:`OUTPUT_GRACE_S`, and those the output side cut. The input side
        calls it after every read while a client is attached (:attr:`expires`), and when
        the output side's wake-up pipe fires."""
        if self._clients.gone_waiting:
            self._take_gone()
        self._expire(now)

    def wait_ms(self, now: float) -> int | None:
        """How long the input side may wait for input before the next deadline: a client's
        session timeout, or the end of a lost output's grace (``None``: none attached)."""
        if not self.clients:
            return None
        timeout = self._session_timeout
        first = math.inf
        for client in self.clients.values():
            due = client.seen + timeout
            if client.lost_at is not None:
                due = min(due, client.lost_at + OUTPUT_GRACE_S)
            first = min(first, due)
        return max(0, math.ceil((first - now) * 1000))


def log_detached_drops(dropped: int, detached_max: int, *, at_exit: bool = False) -> None:
    """Log, once per detached period, what the outbox dropped past its bound."""
    if dropped:
        logger.warning(
            "enginecore: dropped %d events (one per output) while no client could read "
            "them (the detached buffer holds %d)%s",
            dropped,
            detached_max,
            "; the stage stopped before a client attached" if at_exit else "",
        )


def _invalid(value: object, what: str) -> str | None:
    """Why a decoded *value* is not a valid wire value, or ``None`` if it is."""
    try:
        _codec.check_received(value, what)
    except ValueError as exc:
        return str(exc)
    except RecursionError:  # msgspec decodes deeper values than check_received can walk
        return f"{what}: nested too deeply"
    return None
