"""What the blocking and the asyncio client share besides the protocol (``_session``): the
operations that never wait (register and send requests, aborts, calls; begin a close), the
read-only properties, socket set-up and teardown, and the steps of a stubborn stage's
shutdown. The clients add the waiting."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from typing import Any, Generic, NamedTuple, NoReturn, TypeVar

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from . import _codec, _session, _wire
from ._address import check_address
from ._curve import HANDSHAKE_EVENTS, CurveKeys, HandshakeWatch, secure_client
from ._errors import (
    AuthenticationError,
    MessageTooLargeError,
    StageClosedError,
    StageStartupError,
    positive_seconds,
)
from ._launch import Launched
from ._session import ClientSession, Deliveries, Parts, StageHealth, StreamCore, output_address_for
from ._statistics import StageLoad
from ._wire import WelcomeMsg, is_ipv6_endpoint

__all__ = [
    "ClientBase",
    "ClosingTask",
    "Target",
    "check_heartbeat",
    "close_sockets",
    "deadline_after",
    "dealer_for",
    "escalate",
    "handshake_watch",
    "passed",
    "pull_for",
    "raise_startup_error",
    "routing_id",
    "stop_watching",
]

logger = logging.getLogger("enginecore.stage")

S = TypeVar("S", bound=StreamCore)
T = TypeVar("T")
W = TypeVar("W")
Sock = TypeVar("Sock", bound=zmq.Socket[Any])


class Target(NamedTuple):
    """What a client is opened on, and how."""

    address: str  # the stage's input address
    timeout: float  # for the handshake
    launched: Launched | None  # the process, for a launched stage
    # (interval, timeout): a connected stage is presumed dead after timeout; a launched one
    # is pinged (timeout None) only so that a stopped process reads as stalled.
    heartbeat: tuple[float, float | None] | None
    ordered_events: bool
    curve: CurveKeys | None = None  # the client's CURVE keys and the stage's public key


def _track_sent(live: dict[str, Any], req_ids: list[str], streams: list[Any]) -> None:
    """Under the lock, after a pool's burst with streams went to a member: each id's entry
    in the pool's table of live requests (the pool's hold, ``PoolCore.reserve``) becomes
    its stream. A stream that ended meanwhile already left the member's session, and the
    reader, which takes out of the table only the stream itself, left the hold there: it
    is dropped, else it would keep the id live in the pool for ever."""
    for rid, stream in zip(req_ids, streams, strict=True):
        if stream._ended is None:
            live[rid] = stream
        else:
            live.pop(rid, None)


class ClientBase(Generic[S, W]):
    """The part of a client that neither blocks nor awaits: its session, the operations that
    only register and send, and the properties.

    A subclass sets ``_lock`` (what guards the session: a lock for the blocking client, a
    no-op for the asyncio one, whose methods all run on one thread) and ``_stream_type``,
    and implements :meth:`_send` (never waits) and :meth:`_apply`.
    """

    _lock: contextlib.AbstractContextManager[Any]
    _stream_type: Callable[[str, contextlib.AbstractContextManager[Any], float], S]
    # Called, if set, after a frame's deliveries (a pipeline takes the ordered event stream
    # as it grows): set by each client's __init__ (None), then by a pipeline.
    _event_sink: Callable[[], None] | None

    # Set by a pipeline on its own client of each of its processes: that process's name
    # ("mid", "mid[1]"). The pipeline takes every event of the stage and sends its requests
    # and aborts with _send_request(s) / _send_abort, keeping no stream of this client's:
    # the public request and event calls, which could only bypass it and hang, raise
    # (_piped_error). A class attribute: nothing to set, one load to read, elsewhere.
    _pipeline_key: str | None = None

    _adopt_orphans = False  # a pool's member client: see ClientSession(adopt_orphans=)
    _silent_after = 2.0  # ping intervals without a frame that read as stalled (a pool's: 1.75)

    def __init__(self, target: Target, welcome: WelcomeMsg) -> None:
        self._launched = target.launched
        self.features: frozenset[str] = frozenset(welcome.features)
        """What the stage's ``welcome`` says it does beyond the protocol's version
        (``docs/wire.md`` section 3): a pipeline's stage of this build, ``"tags"`` and
        ``"gens"``."""
        self._max_frame: int | None = welcome.max_message_bytes
        """The largest frame the stage's input socket takes (``serve --max-message-bytes``,
        said in its ``welcome``): a bigger message is refused before it is sent
        (:meth:`_check_frames`), since the stage would drop the connection and the message
        with it. ``None``: unbounded (or a stage too old to say)."""
        self._session: ClientSession[S, W] = ClientSession(
            pid=welcome.pid,
            address=target.address,
            launched=target.launched is not None,
            heartbeat=target.heartbeat,
            ordered_events=target.ordered_events,
            now=time.monotonic(),
            adopt_orphans=self._adopt_orphans,
            silent_after=self._silent_after,
        )

    def _check_frames(self, parts: Parts, what: str) -> None:
        """:class:`MessageTooLargeError` if a frame of *parts* (the body or an out-of-band
        buffer: libzmq's bound is on each) is larger than the stage takes. Called before
        anything is registered or sent: the message is refused whole, and nothing is lost
        (a frame past the bound costs the connection, and libzmq's reconnection does not
        send it again: its request would wait forever)."""
        limit = self._max_frame
        if limit is None:
            return
        for part in parts:
            size = len(part) if type(part) is bytes else memoryview(part).nbytes
            if size > limit:
                raise self._too_large(what, size, limit)

    def _too_large(self, what: str, size: int, limit: int) -> MessageTooLargeError:
        return MessageTooLargeError(
            f"{what} is too large for the stage at {self._session.address}: a frame "
            f"of {size} bytes, and the stage takes frames of at most {limit} bytes "
            f"(serve --max-message-bytes); nothing was sent",
            size,
            limit,
        )

    def _fit(
        self,
        count: int,
        parts: Parts,
        build: Callable[[int, int], Parts],
        name: Callable[[int], str],
        what: str,
    ) -> list[tuple[int, int, Parts]] | None:
        """Only with a bound (``_max_frame``): ``None`` if *parts*, a message of *count*
        items, fits as it is; else the spans ``(lo, hi, parts)`` of the items, in order,
        whose messages (``build(lo, hi)``) each fit, found by halving the items until they
        do. :class:`MessageTooLargeError` for an out-of-band buffer over the bound (one
        item's own frame: no split makes it smaller) or for an item whose message alone is
        over it (*name* names it). Builds and checks everything before anything is sent."""
        limit = self._max_frame
        assert limit is not None
        self._check_frames(parts[1:], what)  # out-of-band buffers: whatever the split
        if len(parts[0]) <= limit:
            return None
        out: list[tuple[int, int, Parts]] = []
        todo = [(0, count, parts)]
        while todo:
            lo, hi, p = todo.pop()
            size = len(p[0])
            if size <= limit:
                out.append((lo, hi, p))
            elif hi - lo == 1:
                raise self._too_large(f"{name(lo)}, alone, in {what},", size, limit)
            else:
                mid = (lo + hi) // 2
                todo.append((mid, hi, build(mid, hi)))  # popped after the first half
                todo.append((lo, mid, build(lo, mid)))
        return out

    def _split_burst(
        self, req_ids: list[str], parts: Parts, items: Iterable[tuple[str, Any]] | None
    ) -> list[tuple[list[str], Parts]] | None:
        """Only with a bound: ``None`` if the ``adds`` *parts* fit as one frame; else the
        bursts, ``(ids, parts)`` in order, that each fit (:meth:`_fit`, re-encoding halves
        of *items*, the ``(req_id, data)`` pairs of *req_ids*).
        :class:`MessageTooLargeError` if a request alone does not fit (or, without *items*,
        if the whole does not)."""
        what = f"add_many() of {len(req_ids)} requests"
        if items is None:
            self._check_frames(parts, what)
            return None
        pairs = items if type(items) is list else list(items)
        spans = self._fit(
            len(req_ids),
            parts,
            lambda lo, hi: ClientSession.adds_frame(pairs[lo:hi])[1],
            lambda i: f"request {req_ids[i]!r:.200}",
            what,
        )
        if spans is None:
            return None
        return [(req_ids[lo:hi], p) for lo, hi, p in spans]

    def _send(self, parts: Parts) -> None:
        """Send one message; :class:`StageClosedError` once the sockets are closed."""
        raise NotImplementedError

    def _apply(self, d: Deliveries[S, W]) -> None:
        """Carry out what the session decided, without the session's lock."""
        raise NotImplementedError

    def _send_request(
        self,
        req_id: str,
        parts: Parts,
        stream: bool,
        new: S | None = None,
        live: dict[str, Any] | None = None,
    ) -> S | None:
        """Register the request's stream (or check it may go without), then send. The
        stream's ``sent_at`` is read just before (no output can arrive earlier). A replica
        pool passes a stream it made (*new*: one that moves from a dead replica to this one
        keeps its outputs so far) and, for a new request, its table of live requests
        (*live*, ``req_id -> stream``), checked and filled under the same hold of the lock
        (the pool's lock is its members'): :class:`ValueError` if *req_id* is there with
        another stream that has not ended. Without a stream, *new* is the pool's record of
        the request (a ``QuietRequest``), pointed here at the session's table of requests
        without a stream, under the lock that registers it there.

        A pool's member claims the next send (:meth:`_claim_send`) in that same hold of the
        lock: a removal of the replica, which marks the session closing under the lock and
        then sends the stage its ``shutdown``, either comes first (the registration raises
        :class:`StageClosedError`, and the pool routes the request to another replica) or
        sends after this request (the stage drains it); sent after the ``shutdown``, the
        stage would refuse it ("draining")."""
        if stream is not True and stream is not False:  # "no" would make a stream
            check_flag(stream, "stream")
        if self._max_frame is not None:
            self._check_frames(parts, f"request {req_id!r}")
        if new is None and stream:
            new = self._stream_type(req_id, self._lock, time.monotonic())
        with self._lock:
            if live is not None:
                held = live.get(req_id)
                # Without a stream, *new* may stand for many requests (a pool's QuietTable):
                # only its table says whether *req_id* is one of them.
                if held is not None and (held is not new or not stream) and held._live_as(req_id):
                    raise ValueError(f"request {req_id!r} is still live in this pool")
                live[req_id] = new
            if stream:
                self._session.open_request(req_id, new)
            else:
                self._session.open_request(req_id, None)
                if new is not None:
                    new._in = self._session.quiet  # type: ignore[attr-defined]
            claimed = live is not None and self._claim_send()
        try:
            if claimed:
                self._send_claimed(parts)
            else:
                self._send(parts)
        except BaseException:
            with self._lock:
                self._session.cancel_streams((req_id,))
            raise
        return new

    def _send_requests(
        self,
        req_ids: list[str],
        parts: Parts,
        streams: bool,
        live: dict[str, Any] | None = None,
        entry: Any = None,
        check: Callable[[list[str]], None] | None = None,
        items: Iterable[tuple[str, Any]] | None = None,
        bursts: list[tuple[list[str], Parts]] | None = None,
    ) -> list[S] | None:
        """:meth:`_send_request` for many requests in one message. A replica pool passes
        its table of live requests (*live*): without *streams*, it is filled with *entry*
        for every id under the same hold of the lock that registers them, before the send
        (no Python after it, where the reader of the outputs may hold the GIL); with
        *streams*, each id gets its stream, in the hold of the lock that registers the
        streams (so that the reader, which takes a finished stream out of the table, finds
        it there), or after a send that had to wait, for the streams not ended by then.

        With streams, the frame goes first when it can leave at once (:meth:`_send_nowait`),
        and the streams are built and registered after it, under the lock that the reader
        of the stage's events dispatches under: the stage starts on the burst while this
        thread builds the streams (~0.15 µs each), and no output can be routed before its
        stream is registered. Otherwise (the socket is at its high-water mark): register,
        then send and wait, as :meth:`_send_request`. Either way every stream's
        ``sent_at`` is one clock reading, taken just before the send.

        *check* (a pool of one's burst, with *streams* and *live*): the pool's own check of
        *req_ids* (open, none live in its table), run first in the hold of the lock that
        registers the streams, instead of a reservation of the ids in the table before it.
        With it the burst goes only if its frame can leave at once; otherwise nothing is
        registered or sent and ``None`` is returned (the pool takes its general path).

        With a bound on frames (``serve --max-message-bytes``) that *parts* are over, the
        requests go in several frames, each within it (:meth:`_split_burst`, from *items*,
        the ``(req_id, data)`` pairs; a pool passes the *bursts* it split already), all
        built and checked before anything is registered or sent (:meth:`_send_bursts`);
        with *check*, ``None`` instead (the pool's general path splits)."""
        if streams is not True and streams is not False:  # "no" would make streams
            check_flag(streams, "streams")
        if self._max_frame is not None:
            if bursts is None:
                bursts = self._split_burst(req_ids, parts, items)
            if bursts is not None:
                if check is not None:
                    return None
                return self._send_bursts(req_ids, bursts, streams, live, entry)
        session = self._session
        lock = self._lock
        if streams and req_ids:
            with lock:
                if check is not None:
                    check(req_ids)
                session.check_open()
                session.check_free(req_ids)
                sent_at = time.monotonic()
                sent = self._send_nowait(parts)
                if sent:
                    stream_type = self._stream_type
                    early = [stream_type(rid, lock, sent_at) for rid in req_ids]
                    session.register_streams(req_ids, early)
                    if live is not None:
                        live.update(zip(req_ids, early, strict=True))
            if sent:
                self._sent()
                return early
            if check is not None:
                return None
        if streams:
            sent_at = time.monotonic()
            stream_type = self._stream_type
            new = [stream_type(rid, lock, sent_at) for rid in req_ids]
        else:
            new = None
        with lock:
            session.open_requests(req_ids, new)
            if live is not None and new is None:
                live.update(dict.fromkeys(req_ids, entry))
        if req_ids:
            try:
                self._send(parts)
            except BaseException:
                with lock:
                    session.cancel_streams(req_ids)
                raise
        if live is not None and new is not None:
            with lock:
                _track_sent(live, req_ids, new)
        return new

    def _send_bursts(
        self,
        req_ids: list[str],
        bursts: list[tuple[list[str], Parts]],
        streams: bool,
        live: dict[str, Any] | None,
        entry: Any,
    ) -> list[S] | None:
        """:meth:`_send_requests` of *req_ids* in several frames (*bursts*, in order, that
        together name them all): every request registered first, as for one frame (the same
        streams, in the same order, one ``sent_at``), then the frames sent one after the
        other; the stage may step between them. If a send fails (the client failed or was
        closed, or the wait for the socket was interrupted), the requests of the frames not
        sent are forgotten and the failure raised; those sent stay registered."""
        session = self._session
        lock = self._lock
        new: list[S] | None = None
        if streams:
            sent_at = time.monotonic()
            stream_type = self._stream_type
            new = [stream_type(rid, lock, sent_at) for rid in req_ids]
        with lock:
            session.open_requests(req_ids, new)
            if live is not None and new is None:
                live.update(dict.fromkeys(req_ids, entry))
        done = 0
        try:
            for ids, parts in bursts:
                self._send(parts)
                done += len(ids)
        except BaseException:
            with lock:
                session.cancel_streams(req_ids[done:])
            raise
        if live is not None and new is not None:
            with lock:
                _track_sent(live, req_ids, new)
        return new

    def _send_nowait(self, parts: Parts) -> bool:
        """Send one message if the socket takes it at once; ``False`` (nothing sent) if it
        is at its high-water mark. Never waits, so it may run under the session's lock;
        :class:`StageClosedError` once the sockets are closed."""
        raise NotImplementedError

    def _claim_send(self) -> bool:
        """Under the session's lock: take the right to send the next message, so that what
        another thread sends after this hold of the lock (a close's ``shutdown``) goes
        after it; :meth:`_send_claimed` sends it and gives the right back. ``False``: this
        client's sends never wait, so they cannot be overtaken (the asyncio one)."""
        return False

    def _send_claimed(self, parts: Parts) -> None:
        """Send one message with the right :meth:`_claim_send` took (given back even if the
        send fails); as :meth:`_send`."""
        raise NotImplementedError

    def _sent(self) -> None:
        """After :meth:`_send_nowait` sent, outside the session's lock: what :meth:`_send`
        does after a send."""

    def _send_abort(self, req_ids: Sequence[str], *, noted: bool = False) -> None:
        """Send an ``abort`` of *req_ids*, its answer noted as due first
        (:meth:`ClientSession.note_abort`; *noted*: a pool did it already, under the lock it
        found the ids' replica under)."""
        parts = ClientSession.abort_frame(req_ids)
        ids = list(req_ids)
        if self._max_frame is not None:
            try:
                spans = self._fit(
                    len(ids),
                    parts,
                    lambda lo, hi: ClientSession.abort_frame(ids[lo:hi]),
                    lambda i: f"request id {ids[i]!r:.200}",
                    f"abort() of {len(ids)} requests",
                )
            except MessageTooLargeError:
                if noted:  # nothing goes: no answer comes
                    with self._lock:
                        self._session.unnote_abort(ids)
                raise
            if spans is not None:
                self._send_aborts(ids, spans, noted)
                return
        session = self._session
        with self._lock:
            session.check_abortable()  # a drain under way still takes aborts
            if not noted:
                session.note_abort(ids)
        try:
            self._send(parts)
        except BaseException:
            with self._lock:
                session.unnote_abort(ids)
            raise

    def _send_aborts(
        self, ids: list[str], spans: list[tuple[int, int, Parts]], noted: bool
    ) -> None:
        """:meth:`_send_abort` of *ids* over the bound on frames: noted all at once, then
        one ``abort`` per span (:meth:`_fit`), in order; the stage answers each. If a send
        fails, the ids not sent are unnoted and the failure raised."""
        session = self._session
        with self._lock:
            session.check_abortable()
            if not noted:
                session.note_abort(ids)
        done = 0
        try:
            for _lo, hi, parts in spans:
                self._send(parts)
                done = hi
        except BaseException:
            with self._lock:
                session.unnote_abort(ids[done:])
            raise

    def _start_call(
        self, name: str, args: tuple[Any, ...], waiter: W, *, stats: bool = False
    ) -> int:
        """Register and send one utility call; return its id. *waiter* gets the answer.
        With *stats*, a ``stats`` request instead, answered like a call by the stage itself
        (never by its engine or its loop); *name* then only names it in errors."""
        session = self._session
        call_id = session.new_call_id()
        parts = session.call_frame(call_id, name, args, stats)
        if self._max_frame is not None:
            self._check_frames(parts, f"utility call {name!r:.100}")
        with self._lock:
            session.open_call(call_id, waiter, name, stats=stats)
        try:
            self._send(parts)
        except BaseException:
            self._forget_call(call_id)
            raise
        return call_id

    def _forget_call(self, call_id: int) -> None:
        with self._lock:
            self._session.forget_call(call_id)

    def _begin_close(self, stop_stage: bool, drain: float | None = None) -> bool:
        """Refuse new work and tell the stage (``shutdown``, with *drain* if given, or
        ``bye`` to detach). Returns whether the stage was still there."""
        frame = _session.shutdown_frame(drain) if stop_stage else _session.BYE_FRAME
        with self._lock:
            alive = self._session.begin_close(drain is not None)
        if alive:
            with contextlib.suppress(zmq.ZMQError, StageClosedError):
                self._send(frame)
        return alive

    def _kill_if_presumed_dead(self) -> None:
        """The session is over (``Deliveries.over``): if the heartbeat presumed the stage
        dead while a close waited for its exit (a drain), that exit will not come: kill it
        now (``ray.kill`` on Ray), on a thread of its own, so that the close goes on at once
        and the thread applying this (a receiver, an event loop) is not held by Ray."""
        session = self._session
        launched = self._launched
        if launched is None or not (session.presumed_dead and session.closing):
            return
        threading.Thread(
            target=_kill_quietly, args=(launched,), name="enginecore-kill", daemon=True
        ).start()

    def _fail_closed(self) -> None:
        """The end of a close: whoever still waits gets :class:`StageClosedError` (or, if
        the process died during a drain, that death's error: ``ClientSession.end_error``)."""
        with self._lock:
            d = self._session.fail(self._session.closed_error())
        if d is not None:
            self._apply(d)

    def _piped_error(self, call: str) -> RuntimeError:
        """What *call* (a request or event-stream method) raises on a pipeline's own client
        (``_pipeline_key`` set), which :meth:`Pipeline.client
        <enginecore.stage.Pipeline.client>` hands out: it would bypass the pipeline, which
        reads every event of the stage and keeps no stream of this client's, and hang."""
        if call in ("add", "add_many"):
            why = (
                "a request added here would never end (the pipeline keeps no stream of "
                f"this client's, and tracks only its own requests); use pipe.{call}(...)"
            )
        elif call == "abort":
            why = (
                "an abort here would leave the request's pipeline stream waiting and its "
                "place in the budget held; use pipe.abort(...), which ends it in every stage"
            )
        else:
            why = (
                "the pipeline takes every event of this stage, so none would come here; read "
                "requests' outputs from the streams that pipe.add(...) returns"
            )
        return RuntimeError(
            f"{call}() on the client of pipeline stage {self._pipeline_key!r}: this client "
            f"belongs to the pipeline; {why}. It serves utilities, stats, health, load and "
            "shutdown only"
        )

    def load(self) -> StageLoad | None:
        """The stage's latest load report (:class:`~enginecore.stage.StageLoad`): its
        sequence number, how old it is, the requests live in the stage and the engine's own
        numbers (its ``stats()``). ``None`` until the first one. A stage attaches one to
        its outputs at most every ``load_interval`` seconds while it steps (and one on the
        step after which it idles), and none while it is idle (``docs/observability.md``).
        Never blocks, never sends; thread-safe."""
        return self._session.load(time.monotonic())

    def health(self) -> StageHealth:
        """``"ok"``, ``"stalled"`` or ``"dead"`` (:class:`~enginecore.stage.StageHealth`):
        whether the stage answers, and whether a step has run past its ``step_timeout``.
        ``"stalled"`` goes back to ``"ok"`` once the step returns or the stage answers
        again. Never blocks, never waits for the stage; thread-safe."""
        with self._lock:
            return self._session.health(time.monotonic())

    @property
    def pid(self) -> int:
        """The stage process's pid (as the stage reported it). Never blocks."""
        pid = self._session.pid
        assert pid is not None
        return pid

    @property
    def address(self) -> str:
        """The stage's input address. Never blocks."""
        return self._session.address

    @property
    def exit_code(self) -> int | None:
        """A launched stage's exit code once it has exited (``-N``: signal ``N``), else
        ``None``; always ``None`` for a connected stage. Never blocks."""
        return None if self._launched is None else self._launched.reap()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` / :meth:`shutdown` has been called. Never blocks."""
        return self._session.closing


def deadline_after(timeout: float | None) -> float | None:
    """The ``time.monotonic()`` reading *timeout* seconds from now (``None``: no deadline,
    as for a timeout past :data:`threading.TIMEOUT_MAX`, ``math.inf`` included: a blocking
    wait that long raises :class:`OverflowError`); :class:`TypeError` if *timeout* is not a
    number (a ``bool`` neither), :class:`ValueError` if it is negative or NaN (which would
    never pass)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(
            f"'timeout' must be a number of seconds or None, got {type(timeout).__name__}"
        )
    if not timeout >= 0:  # NaN too
        raise ValueError(f"'timeout' must be a non-negative number, got {timeout!r}")
    if timeout > threading.TIMEOUT_MAX:
        return None
    return time.monotonic() + timeout


def passed(deadline: float | None) -> bool:
    """Whether *deadline* (from :func:`deadline_after`) has passed."""
    return deadline is not None and time.monotonic() >= deadline


def check_heartbeat(interval: float, timeout: float) -> tuple[float, float]:
    """``connect()``'s heartbeat arguments, checked: each a finite number of seconds > 0
    (:func:`~._errors.positive_seconds`: a NaN timeout would never declare a silent stage
    dead), the interval below the timeout (:class:`ValueError`)."""
    interval = positive_seconds(interval, "heartbeat_interval")
    timeout = positive_seconds(timeout, "heartbeat_timeout")
    if timeout <= interval:
        raise ValueError(
            f"need 0 < heartbeat_interval < heartbeat_timeout, got {interval:g} and {timeout:g}"
        )
    return interval, timeout


def check_flag(value: object, what: str) -> None:
    """An option that is a ``bool`` (``ordered_events``, ...): :class:`TypeError` for
    anything else, before anything starts (``"no"`` would be taken for true)."""
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be a bool, got {type(value).__name__}")


def check_connect(address: object, timeout: object) -> None:
    """``connect()``'s *address* (a ``str``: :class:`TypeError`; ``ipc://PATH`` or
    ``tcp://HOST:PORT``: :class:`ValueError`, :func:`~._address.check_address`) and
    handshake *timeout* (:func:`~._errors.positive_seconds`), checked before any socket is
    made."""
    if not isinstance(address, str):
        raise TypeError(
            f"address must be a str such as 'tcp://127.0.0.1:5570', got {type(address).__name__}"
        )
    check_address(address, bind=False)
    positive_seconds(timeout, "timeout")


def raise_startup_error(factory: str, exc: BaseException) -> NoReturn:
    """Raise what ``launch()`` raises when the handshake with a started stage failed."""
    if isinstance(exc, Exception) and not isinstance(exc, StageStartupError):
        raise StageStartupError(f"handshake with stage {factory!r} failed: {exc}") from exc
    raise exc


def routing_id() -> bytes:
    """A client's routing id on the stage's input ``ROUTER``: ``ec`` and 14 random bytes
    (libzmq reserves ids that begin with a zero byte), made once per client. A fixed id
    keeps the client the same peer when its connection is made again (a pause longer than
    the stage's 5 s ZMTP heartbeat, a TCP connection that broke): a stage that detached it
    answers with why (``session lost: the stage detached this client ... because it fell
    behind``) rather than not knowing it. The stage lets a new connection take over the
    id (``ZMQ_ROUTER_HANDOVER``) from one that it has not seen close yet."""
    return b"ec" + os.urandom(14)


def dealer_for(
    ctx: zmq.Context[Sock], address: str, curve: CurveKeys | None = None, *, watch: bool = False
) -> tuple[Sock, Sock | None]:
    """The input socket, connected to *address* (a CURVE client with *curve*) under a
    :func:`routing_id` of its own; with *watch*, also its monitor socket
    (:data:`~._curve.HANDSHAKE_EVENTS`), attached before the connect so that no event is
    missed: :func:`handshake_watch` reads it."""
    dealer = ctx.socket(zmq.DEALER)
    monitor = None
    try:
        dealer.setsockopt(zmq.ROUTING_ID, routing_id())
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.SNDHWM, 0)  # sends never block; death is detected elsewhere
        dealer.setsockopt(zmq.IPV6, is_ipv6_endpoint(address))
        if curve is not None:
            secure_client(dealer, curve)
        monitor = dealer.get_monitor_socket(HANDSHAKE_EVENTS) if watch else None
        dealer.connect(address)
    except BaseException:
        # Closed here: the caller never gets them, and its context's term() would wait
        # for them for ever (connect() to an address ZeroMQ refuses hung).
        stop_watching(dealer, monitor)
        dealer.close(linger=0)
        raise
    return dealer, monitor


def handshake_watch(target: Target) -> HandshakeWatch:
    """What reads the DEALER's monitor during a connect's handshake."""
    return HandshakeWatch(target.address, target.curve)


def stop_watching(dealer: zmq.Socket[Any] | None, monitor: zmq.Socket[Any] | None) -> None:
    """Detach and close the handshake monitor (after the handshake, or on failure)."""
    if monitor is None:
        return
    if dealer is not None and not dealer.closed:
        with contextlib.suppress(zmq.ZMQError):
            dealer.disable_monitor()
    monitor.close(linger=0)


def pull_for(
    ctx: zmq.Context[Sock], address: str, welcome: WelcomeMsg, curve: CurveKeys | None = None
) -> Sock:
    """The output socket, connected where the welcome says (a CURVE client with *curve*)."""
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    output = output_address_for(address, welcome.output)
    pull.setsockopt(zmq.IPV6, is_ipv6_endpoint(output))
    if curve is not None:
        secure_client(pull, curve)
    pull.connect(output)
    return pull


# How long a connect that gives up lets its bye leave (only a stage that does not take it
# makes the context's term() wait that long).
BYE_LINGER_MS = 500


def may_hold_a_session(exc: BaseException, reply: bytes | None) -> bool:
    """Whether a connect that failed with *exc* after sending its ``hello`` may hold a
    session on the stage: the stage may have welcomed it, or holds its ``hello`` to welcome
    it later (``docs/wire.md`` section 3), unless it rejected it or the security handshake
    failed (then nothing reached it)."""
    if isinstance(exc, AuthenticationError):
        return False
    if reply is None:  # no answer yet (a timeout, a cancellation): it may come
        return True
    try:
        return not isinstance(_wire.handshake_decoder.decode(reply), _wire.RejectMsg)
    except msgspec.DecodeError:
        return False


def give_up_session(
    ctx: zmq.Context[Any], dealer: zmq.Socket[Any], pull: zmq.Socket[Any] | None
) -> None:
    """Say ``bye`` for a connect that gives up (either client's; a socket of
    ``zmq.asyncio`` too), and close its sockets: the stage ends the session it welcomed, or
    drops the ``hello`` it holds, instead of keeping every other client of a one-client
    stage out for its session timeout. Best effort: the bye gets :data:`BYE_LINGER_MS` to
    leave, waited for by a short-lived thread (the context's ``term()``), not by the caller
    (a stage that is unreachable never takes it)."""
    with contextlib.suppress(zmq.ZMQError):
        _codec.send_parts(zmq.Socket.shadow(dealer.underlying), _session.BYE_FRAME, zmq.NOBLOCK)
    dealer.close(linger=BYE_LINGER_MS)
    if pull is not None:
        pull.close(linger=0)
    threading.Thread(target=ctx.term, name="enginecore-bye", daemon=True).start()


def handshake_failed(
    ctx: zmq.Context[Any],
    dealer: zmq.Socket[Any] | None,
    monitor: zmq.Socket[Any] | None,
    pull: zmq.Socket[Any] | None,
    launched: Launched | None,
    exc: BaseException,
    reply: bytes | None,
    watch: HandshakeWatch | None,
) -> None:
    """Either client's ``connect()``/``launch()`` failed with *exc* after making its
    sockets (*reply*: the stage's answer to ``hello``, if one came; *watch*: what its
    monitor said so far): close them. A connected stage that may hold this ``hello`` to
    welcome it later, or have welcomed it (a timeout, a cancel, a bad welcome), is told
    ``bye``, or the session would keep every other client of a one-client stage out for its
    session timeout. Not while the security handshake is incomplete (a stopped stage): the
    ``hello`` has not left, and closing at once drops it; a bye lingering behind it would
    let the stage take the ``hello`` alone once it runs again."""
    gave_up = (
        dealer is not None
        and launched is None
        and may_hold_a_session(exc, reply)
        and (reply is not None or _handshake_done(monitor, watch))
    )
    stop_watching(dealer, monitor)
    if gave_up:
        assert dealer is not None
        give_up_session(ctx, dealer, pull)
    else:
        close_sockets(ctx, dealer, pull)


def _handshake_done(monitor: zmq.Socket[Any] | None, watch: HandshakeWatch | None) -> bool:
    """Whether the connection's security handshake completed (then a ``hello`` may have
    left): the events *watch* read, then those still queued on *monitor*. Unwatched: it may
    have."""
    if watch is not None and watch.succeeded:
        return True
    if monitor is None:
        return True
    # Through a plain socket: an asyncio monitor's too, read without waiting.
    sock: zmq.Socket[bytes] = zmq.Socket.shadow(monitor.underlying)
    while True:
        try:
            event = recv_monitor_message(sock, zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError:
            return True
        if int(event["event"]) == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return True


def close_sockets(ctx: zmq.Context[Any], *socks: zmq.Socket[Any] | None) -> None:
    """Close *socks* without lingering, then the context."""
    for sock in socks:
        if sock is not None:
            sock.close(linger=0)
    ctx.term()


def _kill_quietly(launched: Launched) -> None:
    with contextlib.suppress(OSError):
        launched.send_signal(signal.SIGKILL)


def exit_wait(presumed_dead: bool, timeout: float) -> float:
    """How long a close waits for a launched stage's exit before :func:`escalate`:
    *timeout*, or nothing for a stage the heartbeat presumed dead (a stage placed on Ray
    that stopped answering): it was sent no ``shutdown``, and its process, if it runs on,
    is stopped or cut off."""
    return 0.0 if presumed_dead else timeout


def escalate(
    pid: int | None, presumed_dead: bool = False
) -> Iterator[tuple[signal.Signals, float | None]]:
    """The steps after a launched stage ignored ``shutdown``: each signal to send, and how
    long to wait for the exit after it (``None``: as long as it takes). A stage the
    heartbeat presumed dead gets SIGKILL at once (``ray.kill`` on Ray)."""
    if presumed_dead:
        logger.warning("enginecore: stage %s presumed dead; SIGKILL", pid)
        yield signal.SIGKILL, None
        return
    logger.warning("enginecore: stage %s ignored shutdown; SIGTERM", pid)
    yield signal.SIGTERM, 1.0
    logger.warning("enginecore: stage %s ignored SIGTERM; SIGKILL", pid)
    yield signal.SIGKILL, None


def check_loop(loop: object, owner: str) -> None:
    """:class:`RuntimeError` unless the running event loop is *loop*, the one the asyncio
    *owner* (``"AsyncStageClient"``, ``"AsyncStagePool"``, ``"AsyncPipeline"``) was opened
    on; ``None`` checks nothing (a pipeline built outside a loop, in a test).

    Elsewhere a wait would be on a future that the owner's loop sets from another thread
    (late, or never: a hang), a call would fail with a message that names no owner, and a
    close would fail for every stage, leaving them running. The message names the owner's
    blocking twin, which serves other threads and loops."""
    if loop is not None and asyncio.get_running_loop() is not loop:
        raise RuntimeError(
            f"this {owner} belongs to another event loop: use it, and its streams, from the "
            f"loop it was opened on (its events are handled there); from other threads or "
            f"loops, use a {owner.removeprefix('Async')}"
        )


class ClosingTask(Generic[T]):
    """The close of an asyncio client, pool or pipeline: run once, in a task of its own,
    each caller awaiting it through :func:`asyncio.shield`.

    A task, so that a cancelled caller (``asyncio.wait_for``, a task's ``cancel()``, an
    ``async with`` whose exit is cancelled) cancels only its own wait: stopped where it was
    cancelled, the close would leave stages running and their streams open. A later caller
    waits for the same task. The task's error reaches every caller still waiting; with none
    left (each was cancelled), it is logged as ``closing <what> failed``, not lost as "Task
    exception was never retrieved".
    """

    __slots__ = ("_task", "_waiters", "_what")

    def __init__(self, what: str) -> None:
        self._task: asyncio.Future[T] | None = None
        self._waiters = 0
        self._what = what

    @property
    def task(self) -> asyncio.Future[T] | None:
        """The close's task; None before it began."""
        return self._task

    def unstarted(self, *, redo_unfinished: bool = False) -> bool:
        """Whether a close is still to be started: none began, or (with *redo_unfinished*)
        the last one ended without finishing (cancelled itself, or failed) and the caller
        does the rest (for a close whose steps are each idempotent)."""
        task = self._task
        if task is None:
            return True
        if not redo_unfinished or not task.done():
            return False
        return task.cancelled() or task.exception() is not None

    def start(self, close: Coroutine[Any, Any, T]) -> None:
        """Run *close* as the close's task (on the running loop)."""
        task = self._task = asyncio.ensure_future(close)
        task.add_done_callback(self._done)

    async def wait(self) -> T:
        """Await the close's task; a cancelled call cancels only this wait."""
        task = self._task
        if task is None:
            raise RuntimeError("enginecore: the close was not started")
        self._waiters += 1
        try:
            return await asyncio.shield(task)
        finally:
            self._waiters -= 1

    def _done(self, task: asyncio.Future[T]) -> None:
        if task.cancelled():
            return
        exc = task.exception()  # retrieved: a later redo or wait sees it too
        if exc is not None and not self._waiters:
            logger.warning("enginecore: closing %s failed: %r", self._what, exc)
