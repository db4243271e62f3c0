"""The client side of the stage protocol, written once for both clients, without IO.

:class:`ClientSession` is to :class:`~enginecore.stage.StageClient` and
:class:`~enginecore.stage.AsyncStageClient` what ``h11.Connection`` is to an HTTP client: it
knows the requests and utility calls in flight, what each frame from the stage means, and
when the stage counts as gone; the clients own the sockets, the threads or tasks, the locks
and the waiting. It never blocks, never does IO and never calls user code: what a frame means
comes back as :class:`Deliveries`, which the client applies after releasing its lock.

It also builds every client -> stage frame (``docs/wire.md``): payloads go through
``_codec.prepare`` (:class:`TypeError` before anything is sent) and an ``_codec.Encoder``, so
numpy arrays and buffers travel as out-of-band frames. A frame is a list of parts,
``[body, *buffers]``, to send as one multipart message.

Lifecycle. The stage side is :class:`StageState` (``RUNNING`` -> ``STOPPED`` when its last
event, ``shutdown`` or ``fatal``, arrives -> ``GONE`` once :attr:`ClientSession.failure` is
set and every waiter has it). The client side is :attr:`ClientSession.closing`, set when
``close()`` calls :meth:`ClientSession.begin_close`. After ``GONE`` nothing is registered and
frames are ignored. Callers read this state through read-only properties and change it only
through the session's methods.

Liveness (both clients, same rule). A launched stage is gone when its process exits; the
frames still in flight are read until ``EXIT_GRACE_S`` passes without one (at once if the last
event comes, ``EXIT_READ_MAX_S`` after the exit at the latest), and if the last event comes but
the process lingers, the waiters fail ``EXIT_AFTER_LAST_EVENT_S`` later anyway. A connected
stage is pinged every ``heartbeat_interval`` and is presumed dead at exactly
``last_heard + heartbeat_timeout``; its last event ends it at once. A launched stage is
pinged too (``LAUNCHED_PING_S``), only for :meth:`ClientSession.health`: two intervals
without a frame read as stalled, never as dead. So does a ``stalled`` event from the stage's
step watchdog, until its ``resumed``.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import itertools
import secrets
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Final, Generic, NoReturn, TypeVar, cast
from urllib.parse import urlsplit

import msgspec

from . import _codec, _timings, _wire
from ._codec import encode_plain, only_types
from ._errors import (
    EngineDeadError,
    ProtocolError,
    RequestError,
    SessionLostError,
    StageClosedError,
    UtilityError,
    describe_exit,
)
from ._statistics import StageLoad
from ._timings import StreamTimings
from ._wire import (
    Aborted,
    Credit,
    ErrorReport,
    Fatal,
    Outputs,
    Pong,
    Replayed,
    Resumed,
    Stalled,
    UtilityResult,
)

__all__ = [
    "ABORTED",
    "BYE_FRAME",
    "CLIENT_NAME",
    "EXIT_AFTER_LAST_EVENT_S",
    "EXIT_GRACE_S",
    "EXIT_READ_MAX_S",
    "FINISHED",
    "HELLO_FRAME",
    "NO_LOCK",
    "SHUTDOWN_FRAME",
    "ClientSession",
    "Deliveries",
    "End",
    "StageState",
    "StreamCore",
    "abort_ids",
    "event_stream_off",
    "events_before_end",
    "output_address_for",
    "parse_welcome",
    "raise_end",
    "shutdown_frame",
    "take_events",
]

CLIENT_NAME: Final = "enginecore-python"

# A pool member's log of outputs events not yet counted (ClientSession._quiet_log) is folded
# into the counts once it holds more ids than this (its memory bound).
QUIET_LOG_MAX: Final = 1 << 16

# After a launched stage's process has exited, how long to keep reading the frames still in
# flight (the fatal event, above all): the stage is gone once this long has passed without a
# frame, so a client still reading a backlog (a fast stream's outputs queued before the fatal)
# reaches its end, however loaded the machine. Ends early when the last event arrives, and at
# the latest EXIT_READ_MAX_S after the exit.
EXIT_GRACE_S: Final = 0.3
EXIT_READ_MAX_S: Final = 5.0
# After a launched stage's last event (shutdown/fatal), how long its process may take to exit
# before the waiters are failed anyway (the exit code is then unknown).
EXIT_AFTER_LAST_EVENT_S: Final = 1.0

Parts = list[Any]
"""One multipart message: ``[body, *buffers]`` (bytes or memoryviews)."""


HELLO_FRAME: Final = [encode_plain(("hello", _wire.PROTOCOL_VERSION, CLIENT_NAME), "hello")]
SHUTDOWN_FRAME: Final = [encode_plain(("shutdown",), "shutdown")]
BYE_FRAME: Final = [encode_plain(("bye",), "bye")]


def shutdown_frame(drain: float | None) -> Parts:
    """The ``shutdown`` frame: stop now (*drain* ``None``), or after a drain of at most
    *drain* seconds. :class:`ValueError` for a drain that is not a number >= 0."""
    if drain is None:
        return SHUTDOWN_FRAME
    if isinstance(drain, bool) or not isinstance(drain, (int, float)):
        raise TypeError(f"drain must be a number of seconds, got {type(drain).__name__}")
    if not 0 <= drain < float("inf"):
        raise ValueError(f"drain must be a number of seconds >= 0, got {drain}")
    return [encode_plain(("shutdown", float(drain)), "shutdown")]


def check_shutdown_timeout(timeout: float) -> None:
    """:class:`TypeError` unless *timeout* (``shutdown(timeout=)``) is a number,
    :class:`ValueError` unless it is a finite number of seconds >= 0: checked before
    anything is sent, as the drain is."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
    if not 0 <= timeout < float("inf"):
        raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout}")


# Exact types of a value that needs no conversion; msgspec checks the int range itself.
_FLAT: Final = _codec.FLAT_TYPES
# Exact types that need not even that (prepare() would return them unchanged).
_PLAIN: Final = frozenset({type(None), bool, float, str})
_STR: Final = frozenset({str})
_PAIR_TYPES: Final = frozenset({tuple, list})  # of an (req_id, data) pair of add_many()

_tls = threading.local()
_encode_flat: Final = msgspec.msgpack.encode  # thread-safe; for values without buffers


def _encoder() -> _codec.Encoder:
    """This thread's encoder (each thread has its own)."""
    try:
        encoder: _codec.Encoder = _tls.encoder
    except AttributeError:
        encoder = _tls.encoder = _codec.Encoder()
    return encoder


def _encode(msg: object, what: str) -> Parts:
    """``[body, *buffers]`` of a message built from prepared values; :class:`TypeError` if
    msgspec still refuses it. Thread-safe: each thread has its own encoder."""
    try:
        return _encoder().encode(msg)
    except _codec.ENCODE_ERRORS as exc:
        raise TypeError(f"{what} cannot be encoded: {exc}") from exc


def _check_req_id(req_id: object) -> None:
    if type(req_id) is not str:
        raise TypeError(f"req_id must be a str, got {type(req_id).__name__}")


def abort_ids(req_ids: object) -> list[str]:
    """The ids of an ``abort()`` (clients, pools, pipelines), as a list: :class:`TypeError`
    for a bare ``str`` or ``bytes`` (a sequence of chars), for anything not iterable, and
    for an id that is not a ``str``."""
    if isinstance(req_ids, (str, bytes)):
        raise TypeError(f"abort() takes a sequence of request ids; write abort([{req_ids!r}])")
    try:
        ids: list[str] = list(req_ids)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(
            f"abort() takes a sequence of request ids, got {type(req_ids).__name__}"
        ) from None
    for rid in ids:
        _check_req_id(rid)
    return ids


# -- streams --------------------------------------------------------------------------------


class End:
    """Stream marker: the stream ends here; with *exc*, by raising it. It is the last item a
    stream's buffer ever receives: the session forgets a stream when it ends it.

    One error often ends many streams (a dead stage's ends all of them), and a stream that
    ended raises it again on every later read. Raising an exception object again prepends
    the new frames to its traceback, so a shared error would grow by a few frames per
    raise, and keep every frame's locals alive. :meth:`raise_exc` raises it with the
    traceback it had when the stream ended instead, as ``asyncio.Future.result()`` does."""

    __slots__ = ("aborted", "exc", "tb")

    def __init__(self, exc: BaseException | None, aborted: bool = False) -> None:
        self.exc = exc
        self.tb = None if exc is None else exc.__traceback__
        self.aborted = aborted

    def raise_exc(self) -> NoReturn:
        """Raise :attr:`exc` (not ``None``) with its traceback as of this end."""
        assert self.exc is not None
        raise self.exc.with_traceback(self.tb)


FINISHED: Final = End(None)
ABORTED: Final = End(None, aborted=True)

# What a consumer that reached the end keeps as ``_ready`` and ``_buf``: shared, not made
# per stream (a burst ends thousands of streams, and each container made per stream is one
# more object for the cyclic GC to track). A tuple, so that an append, which nothing may
# do after an End, fails loudly instead of reaching every stream.
_FINISHED_ALONE: Final = (FINISHED,)
_TAKEN: Final = cast("list[Any]", ())


NO_LOCK: Final = contextlib.nullcontext()
"""The lock of a stream (and client) that lives on one thread: the asyncio client's."""


class LoopLock(contextlib.nullcontext):  # type: ignore[type-arg]
    """The lock of an asyncio client's (or pipeline's) streams: :data:`NO_LOCK`'s nothing
    (one thread), and the event loop its *owner* runs on (:attr:`loop`; ``None``: none
    known), which a stream's wait checks for (:func:`._clientbase.check_loop`): on another
    loop it would wait on a future that the owner's loop sets from another thread (late,
    or never). It costs a stream nothing: it is the owner's."""

    def __init__(self, loop: object, owner: str) -> None:
        super().__init__()
        self.loop = loop
        self.owner = owner


_SC = TypeVar("_SC", bound="StreamCore")


class StreamCore:
    """What the session knows of one request's stream: its buffer and whether its consumer
    waits. The base of :class:`~enginecore.stage.RequestStream` and
    :class:`~enginecore.stage.AsyncRequestStream`, which add the waiting.

    Two lists. The receiver (the session, through :meth:`_route` and :meth:`_end_with`)
    appends payloads, then at most one :class:`End`, to ``_buf``, under ``_lock``; when it
    appends to a stream whose ``_waiting`` is set, it clears the flag and hands the stream
    back in :attr:`Deliveries.wake`, so a consumer is woken once per frame, not per output.
    The one consumer reads ``_ready`` from ``_pos`` on, without the lock; when it has read
    everything, it takes ``_buf`` as its new ``_ready`` (swapping in an empty list, under the
    lock; once ``_buf`` ends with an :class:`End`, the receiver is done with it, and
    ``collect()`` takes it without the lock). Lists rather than a ``deque``: a deque
    allocates a 528-byte block outside pymalloc (about 0.4 us and 760 bytes a stream), and a
    burst makes thousands of streams.

    Timings (:attr:`timings`). The sender sets ``_sent_at``; the receiver appends each
    output's arrival, the frame's one clock reading (the same float object for every
    output of the frame: 8 bytes an output), to ``_arrivals``, and sets ``_ended_at`` then
    ``_ended`` when it appends the :class:`End`. Nothing else is done per output: the gaps
    and their summaries are computed when :attr:`timings` is read.
    """

    __slots__ = (
        "_arrivals",
        "_buf",
        "_end",
        "_ended",
        "_ended_at",
        "_lock",
        "_pos",
        "_ready",
        "_sent_at",
        "_waiting",
        "_wakeup",
        "req_id",
    )

    _STOP: ClassVar[type[Exception]]  # what ends iteration: StopIteration, StopAsyncIteration

    def __init__(
        self,
        req_id: str,
        lock: contextlib.AbstractContextManager[Any] = NO_LOCK,
        sent_at: float = 0.0,
    ) -> None:
        # The subclasses add no __init__ of their own: a burst makes thousands of streams.
        self.req_id: Final = req_id
        """The request's id."""
        self._sent_at = sent_at  # time.monotonic() just before the request's frame was sent
        self._arrivals: list[float] = []  # the receiver's: one arrival reading per output
        self._ended_at: float | None = None  # the receiver's: when the End was appended
        self._ended: End | None = None  # that End; set after _ended_at
        self._buf: list[Any] = []  # the receiver's side, guarded by _lock
        self._ready: Sequence[Any] = ()  # the consumer's side, read from _pos on
        self._pos = 0
        self._waiting = False
        self._wakeup: Any = None  # what the consumer waits on, made before its first wait
        self._end: End | None = None
        self._lock = lock  # what the receiver appends under

    @property
    def finished(self) -> bool:
        """Whether iteration has reached the request's finished output. Never blocks."""
        return self._end is FINISHED

    @property
    def aborted(self) -> bool:
        """Whether iteration stopped because the request was aborted. Never blocks."""
        return self._end is ABORTED

    @property
    def timings(self) -> StreamTimings:
        """A snapshot of this request's timings (:class:`~enginecore.stage.StreamTimings`):
        when it was sent, when its first output arrived, the gaps between outputs, when it
        ended and how. Reflects what has arrived, read by the consumer or not. Any thread
        may read it at any time; it waits at most for the frame being applied (the blocking
        client's lock), never for the stage."""
        with self._lock:
            # _ended before _arrivals: the receiver appends the last arrival before it sets
            # _ended (and _ended_at before _ended), so an end seen here comes with every
            # arrival, even read without the lock (the asyncio stream, from another thread).
            end = self._ended
            ended_at = self._ended_at
            arrivals = self._arrivals[:]
        return _timings.snapshot(self._sent_at, arrivals, None if end is None else ended_at, end)

    def _live_as(self, req_id: str) -> bool:
        """Whether this stream, an entry of a replica pool's table of live requests, is
        live (not ended): the table's entries answer alike, whatever they are."""
        return self._ended is None

    def _pop(self) -> Any:
        """The consumer's next item, which must be there (``_pos < len(_ready)``); the end
        of the stream raises (:meth:`_stop`)."""
        pos = self._pos
        item = self._ready[pos]
        self._pos = pos + 1
        if type(item) is End:
            self._stop(item)
        return item

    def _take(self, *, wait: bool) -> bool:
        """Consumer, once ``_ready`` is read: take what the receiver appended as the new
        ``_ready``. Whether there was anything; if not and *wait*, mark the consumer as
        waiting, under the same lock, so that the next append wakes it."""
        with self._lock:
            buf = self._buf
            if not buf:
                self._waiting = wait
                return False
            self._buf = []
        self._ready = buf
        self._pos = 0
        return True

    def _keep(self, end: End) -> None:
        """The consumer reached *end*: remember it, and keep it for every later read."""
        self._end = end
        self._ready = _FINISHED_ALONE if end is FINISHED else (end,)
        self._pos = 0

    def _stop(self, end: End) -> NoReturn:
        """:meth:`_keep` *end*, then raise the stream's error or its stop
        (``StopIteration`` / ``StopAsyncIteration``)."""
        self._keep(end)
        if end.exc is not None:
            end.raise_exc()
        raise self._STOP

    def _take_ended(self) -> list[Any] | None:
        """Consumer, the fast path of ``collect()``: if nothing is ready and the stream's
        end has arrived, take everything at once and return the payloads (raising the
        stream's error if it ended with one); else ``None``, and nothing is taken.

        Without the lock: an :class:`End` is the last item the receiver ever appends (the
        session forgets the stream as it appends it), so once ``_buf`` ends with one, no
        thread but the consumer touches it again; before that, the consumer only looks
        (a list's last item is read atomically). ~0.14 instead of ~0.32 us a call: a burst
        ends with one ``collect()`` per request, on the critical path."""
        buf = self._buf
        if not buf or buf[-1].__class__ is not End or self._pos < len(self._ready):
            return None
        self._buf = _TAKEN  # the receiver appends nothing after an End
        end: End = buf.pop()
        # _keep(end), inline: this runs once per request of a burst.
        self._end = end
        self._ready = _FINISHED_ALONE if end is FINISHED else (end,)
        self._pos = 0
        if end.exc is not None:
            end.raise_exc()
        return buf

    def _take_all(self, out: list[Any]) -> bool:
        """Move every payload received so far to *out*. Whether the stream has ended
        normally; an ending by error raises it. The :class:`End` can only be the last item."""
        ready, pos = self._ready, self._pos
        if pos < len(ready):
            out += ready[pos:]
        self._ready = ()
        self._pos = 0
        with self._lock:
            buf = self._buf
            if buf:
                self._buf = []
        out += buf
        if not out or type(out[-1]) is not End:
            return False
        end: End = out.pop()
        self._keep(end)
        if end.exc is not None:
            end.raise_exc()
        return True

    def _put_back(self, out: list[Any]) -> None:
        """Return payloads taken by :meth:`_take_all` (a read that timed out): they are read
        first."""
        self._ready = out
        self._pos = 0

    # The receiver's side: ClientSession calls these under the stream's lock (the client's).

    @staticmethod
    def _route(
        streams: dict[str, _SC],
        req_ids: Sequence[str],
        finished: Sequence[bool],
        payloads: Sequence[Any],
        wake: list[_SC],
        now: float,
        pool_live: dict[str, object] | None = None,
    ) -> None:
        """Receiver: append one outputs event's payloads to their streams in *streams* (the
        session's live streams), ids without a stream skipped, each with its arrival *now*
        (the frame's clock reading); a finished request's stream also gets :data:`FINISHED`,
        ended at *now*, and leaves *streams*, and *pool_live* (a pool member's: the pool's
        table of live requests) if it is that table's entry, so that the pool need not scan
        its table for ended streams. A stream whose consumer waits has the flag cleared and
        goes to *wake*, once. One call per event, not per output: a call per output costs
        ~50 ns more each, on the hottest path of the receiver."""
        get = streams.get
        for rid, fin, payload in zip(req_ids, finished, payloads, strict=True):
            stream = get(rid)
            if stream is None:
                continue  # unrouted, not streamed (stream=False), or ended already
            buf = stream._buf
            buf.append(payload)
            stream._arrivals.append(now)
            if fin:
                stream._ended_at = now
                stream._ended = FINISHED
                buf.append(FINISHED)
                del streams[rid]
                if pool_live is not None and stream is pool_live.get(rid):
                    del pool_live[rid]
            if stream._waiting:
                stream._waiting = False
                wake.append(stream)

    def _end_with(self, end: End, now: float) -> bool:
        """Receiver: append *end*, the last item this stream ever receives (the session
        forgets it), which ended it at *now*. Whether the consumer was waiting: the flag is
        then cleared, and the caller must wake it."""
        self._ended_at = now
        self._ended = end
        self._buf.append(end)
        if self._waiting:
            self._waiting = False
            return True
        return False


# -- what a frame means ---------------------------------------------------------------------


class StageState(enum.Enum):
    """The stage as the session sees it."""

    RUNNING = "running"
    STOPPED = "stopped"  # its last event (shutdown/fatal) arrived; the process may linger
    GONE = "gone"  # ClientSession.failure is set; every waiter has it


S = TypeVar("S", bound=StreamCore)
W = TypeVar("W")


_LIVENESS: Final = frozenset({Pong, Stalled, Resumed})  # events kept out of the event stream


class StageHealth(str, enum.Enum):
    """What ``client.health()`` says about the stage. A ``str``: compares equal to its value.

    - ``OK``: the stage answers, and no step has run past its ``step_timeout``.
    - ``STALLED``: alive as far as the client knows, but a step has run past the stage's
      ``step_timeout`` (the stage said so), or the stage has not answered the client's pings
      for two intervals (a stopped or starved process). Back to ``OK`` when that ends.
    - ``DEAD``: the stage is gone (any waiter has its error), or this client is closed.
    - ``RESTARTING``: only in a pipeline's ``health()``: the stage process died and is
      being started again (its stage restarts, ``PipelineStage(restart=...)``), or waits for
      its restart's backoff.
    """

    OK = "ok"
    STALLED = "stalled"
    DEAD = "dead"
    RESTARTING = "restarting"


LAUNCHED_PING_S: Final = 1.0
"""How often a launched client pings its stage: only to tell a stopped stage (SIGSTOP) from
a quiet one; the process itself says when it is gone."""


@dataclass(slots=True, eq=False)
class Deliveries(Generic[S, W]):
    """What the client must do after a session call, outside its lock."""

    wake: list[S] = field(default_factory=list)
    """Streams whose consumer waits and whose buffer has grown: wake each once."""
    answers: list[tuple[W, Any, BaseException | None]] = field(default_factory=list)
    """``(waiter, result, exc)``: resolve each utility waiter (``exc`` wins if set)."""
    wake_events: bool = False
    """The ordered event stream has grown and its consumer waits: wake it."""
    warnings: list[str] = field(default_factory=list)
    """Messages to log as warnings (stage-reported problems nobody else would see)."""
    over: bool = False
    """The stage sent its last event, or the session failed (a close may stop waiting)."""
    orphans: list[S] | None = None
    """Streams left live when the session failed, for a session that adopts them
    (``adopt_orphans``): a replica pool ends each one itself or moves it to another
    replica. ``None`` for every other session and delivery."""
    quiet_orphans: collections.Counter[str] | None = None
    """The same for the requests without a stream (:attr:`ClientSession.quiet`): each
    id left live when the session failed, with the outputs it had delivered. The pool
    removes an id once it has settled it."""


class ClientSession(Generic[S, W]):
    """The protocol state of one client: requests and calls in flight, the stage's
    lifecycle, liveness. Not thread-safe: the blocking client calls every method that
    changes state under its lock; the frame builders (``*_frame``) touch no state and are
    thread-safe. Never blocks, never calls user code. *now* arguments are
    ``time.monotonic()`` readings (injected, so tests can drive the clock).

    The state is read through read-only properties and changed only by the methods (as
    h11's ``our_state``): no caller assigns it. :attr:`streams` and :attr:`calls` are the
    session's own dicts, typed as read-only mappings; :attr:`events` is the event buffer,
    which consumers pop from (:func:`take_events`) and only the session appends to.
    """

    def __init__(
        self,
        *,
        pid: int | None,
        address: str,
        launched: bool,
        heartbeat: tuple[float, float | None] | None,
        ordered_events: bool,
        now: float,
        adopt_orphans: bool = False,
        health_epoch: list[int] | None = None,
        silent_after: float = 2.0,
    ) -> None:
        self.pid: Final = pid
        # What the session's warnings call the stage, before its process: a pool member's
        # "replica r1", a pipeline's "pipeline stage 'mid'" (set by its owner); None: a
        # client's own stage, named by its process or address alone.
        self.label: str | None = None
        # When the session fails, hand its live streams over (Deliveries.orphans) instead of
        # ending them: a replica pool's member client, whose pool decides each stream's end.
        self._adopt_orphans = adopt_orphans
        # A counter shared by a pool's member sessions, bumped whenever one's routability
        # changes (stalled, silent, failed): the pool recomputes its routable replicas only
        # then, not per request.
        self._health_epoch = health_epoch
        # How many ping intervals without a frame make the stage "silent" (stalled): two
        # for a client; a pool's members use 1.75, so that a stopped replica leaves the
        # routing within two intervals of its last frame, wake-up latency included, while
        # a pong may still be late by three quarters of an interval.
        self._silent_after = silent_after
        self.address: Final = address
        self.launched: Final = launched
        self.heartbeat: Final = heartbeat
        self._streams: dict[str, S] = {}
        # A pool's member (adopt_orphans) also tracks its requests without a stream: id ->
        # outputs delivered, so that the pool knows its exact in-flight count and what a
        # dead replica's requests had delivered. Its keys are exact at all times; its counts
        # are brought up to date only when someone may read them (_fold_quiet): until then,
        # each outputs event's ids are kept in _quiet_log, one append per event, and once no
        # such request is live the log is dropped uncounted (a burst that completes is never
        # counted id by id). _quiet_logged bounds the log's ids.
        self._quiet: collections.Counter[str] | None = (
            collections.Counter() if adopt_orphans else None
        )
        self._quiet_log: list[list[str | None]] = []
        self._quiet_logged = 0
        # The pool's table of live requests (PoolCore._live), set when the member starts
        # serving: a request without a stream leaves it here as it leaves _quiet, so that
        # the pool never has to look for the ended ones among them.
        self._pool_live: dict[str, Any] | None = None
        # call id -> (waiter, utility name). Call ids are consecutive from a random start in
        # 1 .. 2**52. A stage drops the answers to the calls of a client that detached
        # (docs/wire.md section 4); the random start is a second guard: no answer meant for
        # another session can match one of this client's calls. Below 2**53, ids stay exact
        # as JS doubles.
        self._calls: dict[int, tuple[W, str]] = {}
        # The ids of those calls that are utilities, not stats requests (which the stage's
        # input side answers, never its loop): a pool counts them in a replica's load.
        self._utility_calls: set[int] = set()
        self._call_ids: Iterator[int] = itertools.count(secrets.randbits(52) + 1)
        self._state = StageState.RUNNING
        self._failure: BaseException | None = None  # set once, with state GONE
        self._failure_end: End | None = None  # the same, as the End that check_open raises
        self._closing = False  # close() has begun: nothing new is registered
        # That close lets the live requests run to their end first (shutdown with drain),
        # and whether the client has given up on it and signals the process (escalating):
        # a launched process that exits on its own before its last event died then.
        self._drain_close = False
        self._escalated = False
        # The heartbeat presumed the stage dead (its process may run on, unreachable or
        # stopped): a client that owns it kills it at its close, without waiting for it.
        self._presumed_dead = False
        self._fatal: str | None = None  # the fatal event's message, if one came
        # The ordered event stream (None when off): events in the stage's order, then at
        # most one End. Consumers pop from it; _events_waiting as StreamCore._waiting.
        self._events: collections.deque[Any] | None = (
            collections.deque() if ordered_events else None
        )
        self._events_waiting = False
        self._events_end: End | None = None  # the End appended to events, once it is
        self._last_heard = now
        # The latest load report, when it was received, and how many of this client's
        # streams were live then (a pool counts the other clients' requests from it).
        self._load: tuple[_wire.Load, float, int] | None = None
        self._step_stalled = False  # the stage reported a step past its step_timeout
        self._silent = False  # warned that the stage has not answered for _silent_after intervals
        # Set when the heartbeat presumed a connected stage dead: the client should send a
        # bye and close its output socket (its _release_session), so that a stage that was
        # only unreachable or stopped lets the next client attach at once.
        self._release_due = False
        self._next_ping = now
        self._ping_seq = itertools.count()
        self._exit_code: int | None = None
        self._exit_reason: str | None = None  # why it ended, beyond its exit code
        # The launched process has exited (its sentinel fired): set by process_exited only;
        # pools and pipelines read it (a replica or stage whose process is gone).
        self.exited = False
        self._grace_until: float | None = None  # set when the process exited first
        self._grace_cap = 0.0  # the latest _grace_until may be pushed to, by frames read
        self._linger_until: float | None = None  # set when the last event came first
        self._decoder = _codec.Decoder(_wire.EventBatch, strict=True)  # receiver's only
        # Aborts sent (note_abort) whose ``aborted`` has not come yet, per request id, and
        # how many of those answers are stale: they answer an abort of an earlier request of
        # that id, which ended since (finished, failed, or ended by an earlier answer). The
        # stage answers every abort, known id or not, in order with the other events; a
        # stale answer must not end a request added again with the same id meanwhile.
        self._aborts_due: dict[str, int] = {}
        self._aborts_stale: dict[str, int] = {}

    # -- the state, read-only ------------------------------------------------------------------

    @property
    def streams(self) -> Mapping[str, S]:
        """The live streams, by request id: registered by :meth:`open_request` and its
        kin, forgotten when their end is appended."""
        return self._streams

    @property
    def quiet(self) -> Mapping[str, int]:
        """A pool member's live requests without a stream (``stream=False``): request id
        -> outputs delivered so far; empty for any other session (which does not track
        them). The mapping stays the session's: its ids follow the requests, its counts
        are exact when this property is read (read it again for later counts)."""
        if self._quiet is None:
            return _NO_QUIET
        if self._quiet_log:
            self._fold_quiet()
        return self._quiet

    @property
    def in_flight(self) -> int:
        """The live requests: streams, and a pool member's requests without a stream."""
        quiet = self._quiet
        return len(self._streams) + (len(quiet) if quiet is not None else 0)

    @property
    def utility_calls(self) -> int:
        """How many of :attr:`calls` are utility calls (not ``stats`` requests): work
        queued for the stage's loop, which a pool counts in the replica's load."""
        return len(self._utility_calls)

    @property
    def calls(self) -> Mapping[int, tuple[W, str]]:
        """The utility calls in flight: call id -> ``(waiter, utility name)``."""
        return self._calls

    @property
    def state(self) -> StageState:
        """The stage's lifecycle as this session sees it."""
        return self._state

    @property
    def failure(self) -> BaseException | None:
        """What every waiter gets once the stage is gone (set once, with :attr:`state`
        ``GONE``); ``None`` before."""
        return self._failure

    def quiet_and_running(self) -> bool:
        """Whether nothing is in flight (no stream, no call, no ordered event stream) and
        the stage runs, not closing: what a blocking call that got its answer checks before
        it leaves the output socket idle. One call, not five property reads (it runs once
        per ``call_utility``)."""
        return (
            not self._streams
            and not self._calls
            and self._events is None
            and self._state is StageState.RUNNING
            and not self._closing
        )

    @property
    def closing(self) -> bool:
        """Whether ``close()`` has begun (:meth:`begin_close`): nothing new is registered."""
        return self._closing

    @property
    def events(self) -> collections.deque[Any] | None:
        """The ordered event stream's buffer (``None`` when it is off): events in the stage's
        order, then at most one :class:`End`. Consumers pop from it; only the session
        appends."""
        return self._events

    @property
    def events_waiting(self) -> bool:
        """Whether the event stream's consumer waits (:meth:`wait_for_events`): the next
        event appended clears it and sets :attr:`Deliveries.wake_events`."""
        return self._events_waiting

    @property
    def events_end(self) -> End | None:
        """The :class:`End` appended to :attr:`events`, once it is."""
        return self._events_end

    @property
    def last_heard(self) -> float:
        """When the last frame from the stage arrived (a ``time.monotonic()`` reading)."""
        return self._last_heard

    @property
    def presumed_dead(self) -> bool:
        """Whether the session failed because the heartbeat presumed the stage dead: its
        process may still run (stopped, or cut off). A client that owns the stage (placed
        on Ray) kills it at its close at once: it was never asked to exit, so waiting for
        its exit would only hold its resources and delay a pool's restart."""
        return self._presumed_dead

    @property
    def release_due(self) -> bool:
        """Whether the heartbeat presumed a connected stage dead while this client was not
        closing: the client should send a ``bye`` and close its output socket, so that a
        stage that was only unreachable or stopped lets the next client attach at once; it
        then calls :meth:`released`."""
        return self._release_due

    # -- frames (thread-safe, no state) ------------------------------------------------------

    @staticmethod
    def add_frame(req_id: str, data: Any) -> Parts:
        """An ``add``; :class:`TypeError` if *req_id* is not a ``str`` or *data* cannot
        cross the wire."""
        if type(req_id) is not str:
            _check_req_id(req_id)
        if type(data) in _FLAT:  # the common case: no conversion, no buffers
            try:
                return [_encode_flat(("add", req_id, data))]
            except (ValueError, OverflowError):
                pass  # say why, below
        data = _codec.prepare(data, f"data of request {req_id!r}")
        return _encode(("add", req_id, data), f"request {req_id!r}")

    @staticmethod
    def adds_frame(items: Iterable[tuple[str, Any]]) -> tuple[list[str], Parts]:
        """An ``adds`` for ``(req_id, data)`` pairs, and its ids. :class:`TypeError` for a
        bad pair, id or payload; :class:`ValueError` if an id is repeated."""
        pairs: list[Any] = list(items)
        ids: list[str]
        data: list[Any]
        # The fast path, all in C (~0.1 instead of ~0.19 ms for 2,000 pairs, before the
        # burst's frame can leave): dict() splits the pairs and finds a repeated id in one
        # pass. Anything it does not take (a repeated or unhashable id, a pair that is not
        # one, an id that is not a str, data that needs prepare()) takes the checks below,
        # which say what is wrong.
        try:
            by_id: dict[Any, Any] | None = dict(pairs)
        except (TypeError, ValueError):
            by_id = None
        if (
            by_id is not None
            and len(by_id) == len(pairs)
            and only_types(pairs, _PAIR_TYPES)
            and only_types(ids := list(by_id), _STR)
            and only_types(data := list(by_id.values()), _FLAT)
        ):
            try:
                return ids, [_encode_flat(("adds", ids, data))]
            except (ValueError, OverflowError):
                pass  # an int out of range: say which request, below
        if not only_types(pairs, _PAIR_TYPES):
            bad = next(p for p in pairs if type(p) is not tuple and type(p) is not list)
            raise TypeError(f"add_many() takes (req_id, data) pairs, got {type(bad).__name__}")
        try:
            ids_t, data_t = zip(*pairs, strict=True) if pairs else ((), ())
        except ValueError:
            raise TypeError("add_many() takes (req_id, data) pairs") from None
        ids = list(ids_t)
        data = list(data_t)
        if not set(map(type, ids)) <= {str}:
            for rid in ids:
                _check_req_id(rid)
        if len(set(ids)) != len(ids):
            seen: set[str] = set()
            for rid in ids:
                if rid in seen:
                    raise ValueError(f"request {rid!r} appears twice in this add_many()")
                seen.add(rid)
        wire_data = data
        if not set(map(type, data)) <= _FLAT:
            wire_data = [
                item if type(item) in _PLAIN else _codec.prepare(item, f"data of request {rid!r}")
                for rid, item in zip(ids, data, strict=True)
            ]
        try:
            return ids, _encode(("adds", ids, wire_data), "add_many()")
        except TypeError:
            # Name the request: an int out of range, say, skipped prepare() on the fast path.
            for rid, item in zip(ids, data, strict=True):
                ClientSession.add_frame(rid, item)
            raise

    @staticmethod
    def abort_frame(
        req_ids: Sequence[str], routes: list[list[Any]] | None = None, tag: int | None = None
    ) -> Parts:
        """An ``abort``. A bare ``str`` is refused (it is a sequence of chars). *routes*: a
        pipeline with replica pools' (``docs/wire.md`` section 8), one per id; *tag*, a
        pipeline's tag for an abort after a death (section 8, "Tagged aborts")."""
        ids = abort_ids(req_ids)
        if tag is not None:
            return _encode(("abort", ids, routes, False, tag), "abort")
        if routes is not None:
            return _encode(("abort", ids, routes), "abort")
        return _encode(("abort", ids), "abort")

    @staticmethod
    def credit_frame(items: int, nbytes: int, replica: int = 0) -> Parts:
        """A ``credit`` for a pipeline's stage (``docs/wire.md`` section 8): of the next
        stage's replica *replica* (a replica pool's; named only when not 0)."""
        if replica:
            return [_encode_flat(("credit", items, nbytes, replica))]
        return [_encode_flat(("credit", items, nbytes))]

    @staticmethod
    def gone_frame(side: str, link: str = "", replica: int = 0) -> Parts:
        """A ``gone`` for a pipeline's stage (``docs/wire.md`` section 8): the stage on
        *side* (``"previous"``, whose link's routing id is *link*, or ``"next"``: its
        replica *replica*, in a replica pool) died."""
        if replica:
            return [_encode_flat(("gone", side, link, replica))]
        return [_encode_flat(("gone", side, link))]

    @staticmethod
    def link_frame(
        replica: int,
        address: str,
        slots: str = "",
        server_key: str = "",
        generation: int | None = None,
    ) -> Parts:
        """A ``link`` for a pipeline's stage (``docs/wire.md`` section 8): replica *replica*
        of the next stage was started again and listens at *address*; *slots*: the new
        link's shared-memory slot prefix (``""``: none); *server_key*: its CURVE public key
        (Z85), for a process on TCP (``""``: ipc, no CURVE); *generation*: the new
        process's, for a stage whose ``welcome`` says ``"gens"`` (``None``: not said)."""
        if generation is not None:
            return [_encode_flat(("link", replica, address, slots, server_key, generation))]
        if server_key:
            return [_encode_flat(("link", replica, address, slots, server_key))]
        return [_encode_flat(("link", replica, address, slots))]

    @staticmethod
    def route_frame(req_ids: list[str], routes: list[list[Any]]) -> Parts:
        """A ``route`` for the first stage of a pipeline with replica pools (``docs/wire.md``
        section 8): per id, the replicas of the stages after it that the request goes
        through; sent right before the request's add."""
        return [_encode_flat(("route", req_ids, routes))]

    @staticmethod
    def replay_frame(req_id: str, attempt: int) -> Parts:
        """A ``replay`` for a pipeline's stage whose edge retries (``docs/wire.md`` section
        8): abort *req_id* down the link and send its logged inputs again."""
        return [_encode_flat(("replay", req_id, attempt))]

    @staticmethod
    def release_frame(req_ids: list[str]) -> Parts:
        """A ``release`` for a pipeline's stage whose edge retries: forget the replay logs of
        *req_ids*, which are done."""
        return [_encode_flat(("release", req_ids))]

    @staticmethod
    def utility_frame(call_id: int, name: str, args: tuple[Any, ...]) -> Parts:
        """A ``utility`` call; :class:`TypeError` if *args* cannot cross the wire."""
        if type(name) is not str:
            raise TypeError(f"utility name must be a str, got {type(name).__name__}")
        if not args or set(map(type, args)) <= _codec.FLAT_TYPES:
            # Nothing to convert, and the messages for an error are built only then: this
            # runs once per call, on the round trip's critical path.
            try:
                return _encoder().encode(("utility", call_id, name, list(args)))
            except _codec.ENCODE_ERRORS:
                pass  # the slow path names what it refuses
        prepared = cast("Sequence[Any]", _codec.prepare(args, f"arguments of utility {name!r}"))
        return _encode(("utility", call_id, name, list(prepared)), f"utility call {name!r}")

    @staticmethod
    def call_frame(call_id: int, name: str, args: tuple[Any, ...], stats: bool) -> Parts:
        """The frame of one call: with *stats*, a ``stats`` request (answered like a utility
        call, by the stage itself; *name* then only names it in errors); else a ``utility``
        call (:meth:`utility_frame`: :class:`TypeError` if *args* cannot cross the wire)."""
        if stats:
            return [encode_plain(("stats", call_id), "stats")]
        return ClientSession.utility_frame(call_id, name, args)

    # -- opening and forgetting (under the client's lock) -----------------------------------

    def check_open(self) -> None:
        """Raise the failure (the same object every time, with the traceback it had when it
        became the failure: see :class:`End`), or
        :class:`~enginecore.stage.StageClosedError` once closing has begun."""
        if self._failure_end is not None:
            self._failure_end.raise_exc()
        if self._closing:
            raise StageClosedError("this stage client is closed")

    def check_abortable(self) -> None:
        """Before an ``abort``: raise as :meth:`check_open`, except while this client's
        shutdown drains the stage (``shutdown(drain=...)``, until the client gives up on it
        and signals the process): the stage still applies aborts then, and an abort is the
        only way to drop a request that no one waits for any more before the drain ends."""
        if self._failure_end is not None:
            self._failure_end.raise_exc()
        if self._closing and not (self._drain_close and not self._escalated):
            raise StageClosedError("this stage client is closed")

    def note_abort(self, req_ids: Iterable[str]) -> None:
        """Under the lock, just before an ``abort`` of *req_ids* is sent: its answer is due.
        For an id with no live request here (its end came already, or it never was), that
        answer is stale from the start: it ends nothing, even if the id is added again
        before it comes (:meth:`dispatch`)."""
        due, stale = self._aborts_due, self._aborts_stale
        streams, quiet = self._streams, self._quiet
        for rid in req_ids:
            due[rid] = due.get(rid, 0) + 1
            if rid not in streams and (quiet is None or rid not in quiet):
                stale[rid] = stale.get(rid, 0) + 1

    def unnote_abort(self, req_ids: Iterable[str]) -> None:
        """The ``abort`` noted by :meth:`note_abort` could not be sent: no answer comes."""
        due, stale = self._aborts_due, self._aborts_stale
        for rid in req_ids:
            left = due.get(rid, 0) - 1
            if left > 0:
                due[rid] = left
                if stale.get(rid, 0) > left:
                    stale[rid] = left
            else:
                due.pop(rid, None)
                stale.pop(rid, None)

    def _answered(self, req_ids: list[str]) -> list[str]:
        """Receiver, a plain ``aborted`` event: the ids of *req_ids* whose request it ends,
        without those whose answer is stale (:meth:`note_abort`). An answer that ends a
        request makes any other answer still due for it stale."""
        due, stale = self._aborts_due, self._aborts_stale
        out = []
        for rid in req_ids:
            n = due.get(rid)
            if n is None:  # not noted here (a pipeline's stage chases aborts itself)
                out.append(rid)
                continue
            if n > 1:
                due[rid] = n - 1
            else:
                del due[rid]
            was = stale.get(rid)
            if was:
                if was > 1:
                    stale[rid] = was - 1
                else:
                    del stale[rid]
                continue
            if n > 1:
                stale[rid] = n - 1
            out.append(rid)
        return out

    def _ended_with_aborts_due(self, req_ids: Iterable[str | None]) -> None:
        """Receiver: requests *req_ids* ended otherwise than by an ``aborted`` (finished,
        failed): the answers still due to aborts of them are stale."""
        due, stale = self._aborts_due, self._aborts_stale
        for rid in req_ids:
            n = due.get(rid)  # type: ignore[arg-type]  # None is never a key
            if n is not None:
                stale[rid] = n  # type: ignore[index]

    def check_free(self, req_ids: Iterable[str]) -> None:
        """:class:`ValueError` if one of *req_ids* still has a live stream (or, for a
        pool's member, is live without one)."""
        streams = self._streams
        if streams and not streams.keys().isdisjoint(req_ids):
            live = next(rid for rid in req_ids if rid in streams)
            raise ValueError(f"request {live!r} is still live in this client")
        quiet = self._quiet
        if quiet and not quiet.keys().isdisjoint(req_ids):
            live = next(rid for rid in req_ids if rid in quiet)
            raise ValueError(f"request {live!r} is still live in this client")

    def open_request(self, req_id: str, stream: S | None) -> None:
        """:meth:`open_requests` for one request, without the lists (``add()`` is hot)."""
        if self._failure is not None or self._closing:
            self.check_open()
        streams = self._streams
        quiet = self._quiet
        if req_id in streams or (quiet is not None and req_id in quiet):
            raise ValueError(f"request {req_id!r} is still live in this client")
        if stream is not None:
            streams[req_id] = stream
        elif self._events is None:
            raise event_stream_off()
        elif quiet is not None:
            if self._quiet_log:  # its id may be in the log, from an earlier request
                self._fold_quiet()
            quiet[req_id] = 0

    def open_requests(self, req_ids: list[str], streams: Sequence[S] | None) -> None:
        """Before sending requests *req_ids*: register their *streams* (in the same order;
        outputs may follow at once), or check that the ordered event stream is on when
        they have none. Raises like :meth:`check_open` and :meth:`check_free`, or
        :class:`RuntimeError`; registers all or none."""
        self.check_open()
        self.check_free(req_ids)
        if streams is None:
            if self._events is None:
                raise event_stream_off()
            if self._quiet is not None:
                if self._quiet_log:  # their ids may be in the log, from earlier requests
                    self._fold_quiet()
                dict.update(self._quiet, dict.fromkeys(req_ids, 0))  # not Counter's: adds
        else:
            self._streams.update(zip(req_ids, streams, strict=True))

    def register_streams(self, req_ids: list[str], streams: Sequence[S]) -> None:
        """Register *streams* for *req_ids* (in the same order) without the checks of
        :meth:`open_requests`: for a caller that made them (:meth:`check_open`,
        :meth:`check_free`) under the same hold of the lock, then sent the frame first."""
        self._streams.update(zip(req_ids, streams, strict=True))

    def cancel_streams(self, req_ids: Iterable[str]) -> None:
        """Forget streams (and a pool member's requests without one) whose frame could
        not be sent."""
        quiet = self._quiet
        for rid in req_ids:
            self._streams.pop(rid, None)
            if quiet is not None:
                quiet.pop(rid, None)

    def new_call_id(self) -> int:
        """The next call id (thread-safe: ``itertools.count`` steps atomically)."""
        return next(self._call_ids)

    def open_call(self, call_id: int, waiter: W, name: str, *, stats: bool = False) -> None:
        """Register a call; its answer goes to *waiter*. Raises like :meth:`check_open`; a
        ``stats`` request (*stats*) like :meth:`check_abortable`: read-only, answered by
        the stage's input side, it is taken while this client's shutdown drains the stage
        (a pool's replica being drained stays in its metrics). If the stage stops before
        it answers, it fails as every call left at the close does."""
        if stats:
            self.check_abortable()
        else:
            self.check_open()
            self._utility_calls.add(call_id)
        self._calls[call_id] = (waiter, name)

    def forget_call(self, call_id: int) -> None:
        """Drop a call (timed out, cancelled, or its frame could not be sent): a late answer
        is then ignored."""
        self._calls.pop(call_id, None)
        self._utility_calls.discard(call_id)

    # -- receiving ----------------------------------------------------------------------------

    def wait_for_events(self) -> None:
        """The event stream's consumer found :attr:`events` empty and is about to wait:
        the next event appended (or the stream's end) clears :attr:`events_waiting` and sets
        :attr:`Deliveries.wake_events`, once."""
        self._events_waiting = True

    def stop_waiting_for_events(self) -> None:
        """The event stream's consumer stopped waiting without being woken (it timed out):
        clear :attr:`events_waiting`."""
        self._events_waiting = False

    def decode(self, parts: Sequence[Any]) -> list[Any] | EngineDeadError:
        """Decode one message from the output socket (zmq frames, bytes or memoryviews),
        or the error that an undecodable message is. Only the receiver calls it."""
        try:
            batch: list[Any] = self._decoder.decode(parts)
        except msgspec.DecodeError as exc:
            err = EngineDeadError(f"the stage sent an invalid frame: {exc}")
            err.__cause__ = exc
            return err
        for ev in batch:
            if ev.__class__ is Outputs and not (
                len(ev.req_ids) == len(ev.finished) == len(ev.payloads)
            ):
                return EngineDeadError(
                    "the stage sent an invalid frame: an outputs event with lists of "
                    "different lengths"
                )
        return batch

    def receive(self, parts: Sequence[Any], now: float) -> Deliveries[S, W]:
        """:meth:`decode` then :meth:`dispatch`."""
        return self.dispatch(self.decode(parts), now)

    def dispatch(self, batch: list[Any] | EngineDeadError, now: float) -> Deliveries[S, W]:
        """Apply one decoded message (a list of events) received at *now*."""
        d: Deliveries[S, W] = Deliveries()
        if self._failure is not None:
            return d  # late frames after the end: nobody is left to receive them
        if type(batch) is not list:
            assert isinstance(batch, EngineDeadError)
            self._fail_into(d, batch, now)
            return d
        if self._silent:
            self._silent = False
            self._health_changed()
            d.warnings.append(
                f"{self._who()} answers again, after {now - self._last_heard:.1f} s of silence"
            )
        self._last_heard = now
        if self._grace_until is not None:  # the process exited and its backlog still comes
            self._grace_until = min(now + EXIT_GRACE_S, self._grace_cap)
        streams = self._streams
        wake = d.wake
        pongs = terminal = loaded = False
        stale: dict[int, Aborted | None] | None = None  # aborted events to cut down
        for ev in batch:
            cls = ev.__class__
            if cls is Outputs:
                if streams:
                    StreamCore._route(
                        streams, ev.req_ids, ev.finished, ev.payloads, wake, now, self._pool_live
                    )
                if self._quiet:
                    self._log_quiet(ev.req_ids, ev.finished)
                if self._aborts_due and True in ev.finished:
                    self._ended_with_aborts_due(itertools.compress(ev.req_ids, ev.finished))
                if ev.load is not None:
                    self._load = (ev.load, now, self.in_flight)
                    loaded = True
            elif cls is UtilityResult:
                entry = self._calls.pop(ev.call_id, None)
                if entry is not None:  # else: timed out, or a detached client's call
                    self._utility_calls.discard(ev.call_id)
                    waiter, name = entry
                    if ev.error is None:
                        d.answers.append((waiter, ev.result, None))
                    else:
                        d.answers.append((waiter, None, UtilityError(name, ev.error)))
            elif cls is Aborted:
                ended = ev.req_ids
                if self._aborts_due and not ev.fence and ev.tag is None:
                    ended = self._answered(ended)
                    if self._adopt_orphans and len(ended) != len(ev.req_ids):
                        # A pool's event stream ends each request once: a stale answer
                        # (an abort sent twice, or after the request's end) is not passed
                        # on, as its stream drops it (a pool member knows every request
                        # live on it, streamed or not).
                        if stale is None:
                            stale = {}
                        stale[id(ev)] = Aborted(ended) if ended else None
                for rid in ended:
                    self._end_stream(rid, ABORTED, wake, now)
                if self._quiet:
                    self._forget_quiet(ended)
            elif cls is ErrorReport:
                self._on_error_report(ev, d, now)
            elif cls is Credit or cls is Replayed:
                pass  # a pipeline's: for the ordered event stream (the coordinator)
            elif cls is Pong:
                pongs = True  # an answer to our heartbeat, not a stage event
            elif cls is Stalled:
                pongs = True  # liveness, not a stage event
                self._step_stalled = True
                self._health_changed()
                d.warnings.append(
                    f"{self._who()}: a step has run for {ev.seconds:.1f} s (step_timeout "
                    f"{ev.step_timeout:g} s); the stage logged every thread's stack"
                )
            elif cls is Resumed:
                pongs = True
                self._step_stalled = False
                self._health_changed()
                d.warnings.append(
                    f"{self._who()}: the stalled step returned after {ev.seconds:.1f} s"
                )
            else:  # Shutdown or Fatal: the stage's last event
                if cls is Fatal:
                    self._fatal = ev.message
                terminal = True
        events = self._events
        if events is not None:
            if stale is not None:
                batch = [e for e in (stale.get(id(e), e) for e in batch) if e is not None]
            if loaded:  # the report is the client's (load()), not part of the event
                batch = [ev for ev in map(_without_load, batch) if ev is not None]
            events.extend([ev for ev in batch if ev.__class__ not in _LIVENESS] if pongs else batch)
            if self._events_waiting and events:
                self._events_waiting = False
                d.wake_events = True
        if terminal:
            self._on_last_event(d, now)
        return d

    def _log_quiet(self, req_ids: list[str | None], finished: list[bool]) -> None:
        """Receiver, a pool member's outputs event: keep its ids for the counts (one append,
        not one step per output), and forget the requests without a stream that finished,
        in the pool's table of live requests too (one Python step each). Once none is
        live, the log goes uncounted: nobody can ask for those counts any more."""
        quiet = self._quiet
        assert quiet is not None
        if True in finished:
            pop = quiet.pop
            live = self._pool_live
            for rid in itertools.compress(req_ids, finished):
                if pop(rid, None) is not None and live is not None:  # type: ignore[arg-type]
                    live.pop(rid, None)  # type: ignore[arg-type]
            if not quiet:
                self._quiet_log.clear()
                self._quiet_logged = 0
                return
        self._quiet_log.append(req_ids)
        self._quiet_logged += len(req_ids)
        if self._quiet_logged > QUIET_LOG_MAX:
            self._fold_quiet()

    def _fold_quiet(self) -> None:
        """Bring the counts of :attr:`quiet` up to date from the log: in C, one
        ``Counter.update`` per logged event; the ids it added (requests that have ended,
        streamed ones, or none), which are the newest keys of the dict, are popped again.
        Called before an id is added (a new request must not count an earlier one's
        outputs), before the counts are read, and when the log is full."""
        quiet = self._quiet
        assert quiet is not None
        before = len(quiet)
        for ids in self._quiet_log:
            quiet.update(ids)  # type: ignore[arg-type]  # None ids are popped below
        for _ in range(len(quiet) - before):
            quiet.popitem()
        self._quiet_log.clear()
        self._quiet_logged = 0

    def _forget_quiet(self, req_ids: Iterable[str]) -> None:
        """Requests without a stream that ended (aborted, refused): out of the member's
        table, and out of the pool's."""
        quiet = self._quiet
        assert quiet is not None
        live = self._pool_live
        for rid in req_ids:
            if quiet.pop(rid, None) is not None and live is not None:
                live.pop(rid, None)

    def _health_changed(self) -> None:
        epoch = self._health_epoch
        if epoch is not None:
            epoch[0] += 1

    def _end_stream(self, req_id: str, end: End, wake: list[S], now: float) -> bool:
        stream = self._streams.pop(req_id, None)
        if stream is None:
            return False
        if stream._end_with(end, now):
            wake.append(stream)
        return True

    def _on_error_report(self, ev: ErrorReport, d: Deliveries[S, W], now: float) -> None:
        if ev.req_id is None:
            d.warnings.append(f"the stage reported a protocol error: {ev.message}")
            return
        end = End(RequestError(ev.req_id, ev.message))
        ended = self._end_stream(ev.req_id, end, d.wake, now)
        if self._aborts_due:
            self._ended_with_aborts_due((ev.req_id,))
        if self._quiet:
            self._forget_quiet((ev.req_id,))
        if not ended and self._events is None:  # with the event stream on, its reader sees it
            d.warnings.append(f"the stage reported: request {ev.req_id!r}: {ev.message}")

    def _on_last_event(self, d: Deliveries[S, W], now: float) -> None:
        d.over = True
        self._state = StageState.STOPPED
        if not self.launched:
            # No process to watch: the last event is the end.
            self._fail_into(
                d,
                self.end_error(
                    remote_shutdown=self._fatal is None,
                    reason=None if self._fatal is None else "its engine loop died",
                ),
                now,
            )
        elif self.exited:
            err = self.end_error(
                exit_code=self._exit_code, remote_shutdown=True, reason=self._exit_reason
            )
            self._fail_into(d, err, now)
        else:
            self._linger_until = now + EXIT_AFTER_LAST_EVENT_S

    # -- liveness -----------------------------------------------------------------------------

    def tick(self, now: float) -> tuple[Parts | None, float | None, Deliveries[S, W] | None]:
        """Run the liveness timers at *now*. Returns a ping to send (or ``None``), when to
        call again (a ``time.monotonic()`` reading; ``None``: no timer runs, wait for a frame
        or the process), and the deliveries if the stage is now presumed gone."""
        if self._failure is not None:
            return None, None, None
        if self._grace_until is not None:  # the process exited; its last frames are late
            if now >= self._grace_until:
                err = self.end_error(exit_code=self._exit_code, reason=self._exit_reason)
                return None, None, self.fail(err, now)
            return None, self._grace_until, None
        if self._linger_until is not None:  # the last event came; the process lingers
            if now >= self._linger_until:
                err = self.end_error(
                    remote_shutdown=True,
                    reason="its engine loop ended, but the process has not exited",
                )
                return None, None, self.fail(err, now)
            return None, self._linger_until, None
        if self.heartbeat is None:
            return None, None, None
        interval, timeout = self.heartbeat
        if timeout is not None:
            dead_at = self._last_heard + timeout
            if now >= dead_at:
                reason = f"no heartbeat from {self.address} for {timeout} s; presumed dead"
                d = self.fail(self.end_error(reason=reason, presumed=True), now)
                self._presumed_dead = d is not None
                self._release_due = not self._closing
                return None, None, d
        d = None
        silent_at = self._last_heard + self._silent_after * interval
        if not self._silent and now >= silent_at:
            self._silent = True
            self._health_changed()
            d = Deliveries()
            d.warnings.append(
                f"{self._who()} has not answered for {now - self._last_heard:.1f} s: it may be "
                f"stopped (SIGSTOP) or starved of CPU; health() reads 'stalled'"
            )
        ping = None
        if now >= self._next_ping:
            ping = [encode_plain(("ping", next(self._ping_seq)), "ping")]
            self._next_ping = now + interval
        wake_at = self._next_ping
        if timeout is not None:
            wake_at = min(wake_at, dead_at)
        if not self._silent:
            wake_at = min(wake_at, silent_at)
        return ping, wake_at, d

    def load(self, now: float) -> StageLoad | None:
        """The stage's latest load report, aged to *now*; ``None`` before the first. Any
        thread (one attribute read)."""
        latest = self._load
        if latest is None:
            return None
        report, received, _ = latest
        return StageLoad(
            seq=report.seq,
            age=report.age + max(0.0, now - received),
            live=report.live,
            engine=MappingProxyType(report.engine),
            received_at=received,
        )

    def health(self, now: float) -> StageHealth:
        """What :class:`StageHealth` says at *now*. Changes nothing."""
        if self._failure is not None or self._closing:
            return StageHealth.DEAD
        if self._step_stalled or self._silent:
            return StageHealth.STALLED
        silent_after = self._silent_after * self.heartbeat[0] if self.heartbeat else 0.0
        if self.heartbeat is not None and now >= self._last_heard + silent_after:
            return StageHealth.STALLED  # silent, and tick() has not run yet to say so
        return StageHealth.OK

    def _who(self) -> str:
        where = f"stage process {self.pid}" if self.pid is not None else f"at {self.address}"
        if self.label is not None:
            return f"{self.label} ({where})"
        return where if self.pid is not None else f"the stage {where}"

    def process_exited(
        self, exit_code: int | None, now: float, reason: str | None = None
    ) -> Deliveries[S, W] | None:
        """The launched process has exited with *exit_code* (*reason*: why, where more is
        known, e.g. a Ray actor's death; it then words the error). If its last event has
        come, the stage is gone now; else the stage is gone at the first :meth:`tick`
        ``EXIT_GRACE_S`` after the last frame read (the exit, if none comes), and
        ``EXIT_READ_MAX_S`` after the exit at the latest."""
        if self._failure is not None:
            return None
        self.exited = True
        self._exit_code = exit_code
        self._exit_reason = reason
        self._linger_until = None
        self._health_changed()  # a pool's member: out of the routing at once
        if self._state is StageState.STOPPED:
            err = self.end_error(exit_code=exit_code, remote_shutdown=True, reason=reason)
            return self.fail(err, now)
        self._grace_until = now + EXIT_GRACE_S
        self._grace_cap = now + EXIT_READ_MAX_S
        return None

    # -- ending ---------------------------------------------------------------------------------

    def begin_close(self, drain: bool = False) -> bool:
        """``close()`` has begun: refuse new requests and calls; *drain*: it is a shutdown
        that lets the live requests end first (:meth:`end_error`). Returns whether the
        stage was still there (then a ``shutdown`` or ``bye`` is worth sending)."""
        self._closing = True
        self._drain_close = drain
        return self._failure is None

    def escalating(self) -> None:
        """The client gave up waiting for its close and signals the process: an exit
        before the last event is its doing, not a death (:meth:`end_error`)."""
        self._escalated = True

    def closed_error(self) -> BaseException:
        """What the waiters left at the end of ``close()`` get (:meth:`end_error`)."""
        return self.end_error(exit_code=self._exit_code, reason=self._exit_reason)

    def released(self) -> None:
        """The client has acted on :attr:`release_due` (or decided not to): clear it."""
        self._release_due = False

    def input_reply(self, body: Any, now: float) -> Deliveries[S, W] | None:
        """A message the stage sent on the input socket after the handshake (the clients
        read it after each ping). The only one a stage sends there to a client it welcomed
        is a ``reject``: a stage that serves several clients ended this client's session
        (its output lost, it fell behind, or it was silent past the session timeout;
        ``docs/wire.md`` section 3). Then every waiter fails with
        :class:`~enginecore.stage.SessionLostError`, and the session is released as after a
        heartbeat death. Anything else is ignored (``None``)."""
        if self._failure is not None:
            return None
        try:
            msg = msgspec.msgpack.decode(body)
        except (msgspec.DecodeError, TypeError):
            return None
        if not (isinstance(msg, list) and len(msg) >= 3 and msg[0] == "reject"):
            return None
        if self._closing:
            exc: BaseException = StageClosedError("this stage client is closed")
        else:
            # The reason says what became of this client's requests: a stage that keeps a
            # detached client's requests (--keep-requests-on-detach) did not abort them.
            exc = SessionLostError(f"{self._who()} ended this client's session: {msg[2]}")
        d = self.fail(exc, now)
        self._release_due = not self._closing
        return d

    def fail(self, exc: BaseException, now: float | None = None) -> Deliveries[S, W] | None:
        """Set the failure once (later calls return ``None``) and hand *exc*, the same
        object, to every stream, call and the ordered event stream. The streams end at
        *now* (``None``: a ``time.monotonic()`` reading taken here)."""
        if self._failure is not None:
            return None
        d: Deliveries[S, W] = Deliveries()
        self._fail_into(d, exc, time.monotonic() if now is None else now)
        return d

    def _fail_into(self, d: Deliveries[S, W], exc: BaseException, now: float) -> None:
        if self._failure is not None:
            return
        last_event_came = self._state is StageState.STOPPED
        self._failure = exc
        self._failure_end = End(exc)
        self._state = StageState.GONE
        self._health_changed()
        d.over = True
        if self._adopt_orphans:
            d.orphans = list(self._streams.values())
            if self._quiet:
                if self._quiet_log:
                    self._fold_quiet()  # the counts the pool hands to on_replica_death
                d.quiet_orphans = self._quiet  # the pool settles each, then removes it
                self._quiet = collections.Counter()
        else:
            end = End(exc)
            wake = d.wake
            for stream in self._streams.values():
                if stream._end_with(end, now):
                    wake.append(stream)
        self._streams.clear()
        self._aborts_due.clear()  # no answer comes any more
        self._aborts_stale.clear()
        d.answers.extend((waiter, None, exc) for waiter, _ in self._calls.values())
        self._calls.clear()
        self._utility_calls.clear()
        if self._events is not None:
            # A clean end (StopIteration) when this client shut the stage down itself and
            # the stage's last event came.
            clean = isinstance(exc, StageClosedError) and last_event_came
            self._events_end = End(None if clean else exc)
            self._events.append(self._events_end)
            if self._events_waiting:
                self._events_waiting = False
                d.wake_events = True

    def end_error(
        self,
        *,
        exit_code: int | None = None,
        remote_shutdown: bool = False,
        reason: str | None = None,
        presumed: bool = False,
    ) -> StageClosedError | EngineDeadError:
        """What every waiter gets once the stage is gone: :class:`StageClosedError` if this
        client was closing it, else an :class:`EngineDeadError` whose message says all we
        know (the exit, the fatal error, a shutdown that this client did not ask for).

        A shutdown with drain lets the live requests run to their end: a launched process
        that exits before its last event, unless the client signalled it after the drain and
        the timeout, died during the drain, and so did a stage the heartbeat presumes dead
        (*presumed*) during it; their requests get that death's :class:`EngineDeadError`
        (a replica pool's, :class:`ReplicaDeadError`), not :class:`StageClosedError`."""
        died_draining = (
            self._drain_close
            and (self.exited or presumed)
            and not self._escalated
            and not remote_shutdown
            and self._state is not StageState.STOPPED
        )
        if self._closing and not died_draining:
            return StageClosedError("this stage client is closed")
        who = f"stage process {self.pid}" if self.pid is not None else "the stage"
        if reason is not None:
            msg = f"{who}: {reason}"
        elif exit_code is not None:
            msg = f"{who} {describe_exit(exit_code)}"
        else:
            msg = f"{who} is gone"
        if self._fatal is not None:
            msg += f"; fatal error in the engine loop: {self._fatal}"
        elif remote_shutdown:
            msg += "; it shut down, but not at this client's request"
        return EngineDeadError(msg, exit_code=exit_code, fatal=self._fatal)


# -- the handshake --------------------------------------------------------------------------


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


def event_stream_off() -> RuntimeError:
    """What reading the ordered event stream (or adding a request without a stream) raises
    on a client made without it."""
    return RuntimeError("the event stream is off; create the client with ordered_events=True")


# -- the ordered event stream, consumer side ------------------------------------------------


def take_events(buf: collections.deque[Any], every: bool) -> list[Any]:
    """Pop the first event (or *every* event) from the session's event buffer; ``[]`` if
    it is empty. Safe while the receiver appends and other consumers pop."""
    popleft = buf.popleft
    out: list[Any] = []
    try:
        out.append(popleft())
        while every:
            out.append(popleft())
    except IndexError:
        pass
    return out


def raise_end(end: End, stop: type[Exception]) -> NoReturn:
    """End a consumer's read: the failure in *end*, else *stop* (``StopIteration`` or
    ``StopAsyncIteration``)."""
    if end.exc is not None:
        end.raise_exc()
    raise stop


def events_before_end(out: list[Any], stop: type[Exception]) -> list[Any]:
    """*out* (popped from the event buffer) without its closing :class:`End`; if that
    leaves nothing, end the read as :func:`raise_end` does. Later reads find the buffer
    empty and :attr:`ClientSession.events_end` set."""
    if type(out[-1]) is End:
        end: End = out.pop()
        if not out:
            raise_end(end, stop)
    return out


_NO_QUIET: Final[Mapping[str, int]] = MappingProxyType({})


def _without_load(ev: Any) -> Any:
    """*ev*, without the load report if it is an ``outputs`` event that carries one;
    ``None`` for an ``outputs`` event that is only a report (a shared stage's, while the
    steps are another client's): no event of this client's, whose ``Outputs`` are steps."""
    if ev.__class__ is Outputs and ev.load is not None:
        if not ev.req_ids:
            return None
        return Outputs(ev.req_ids, ev.finished, ev.payloads)
    return ev
