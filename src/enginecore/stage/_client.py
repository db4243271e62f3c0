"""StageClient: the blocking client of a stage process.

The protocol (what a frame means, which request or call it concerns, when the stage counts
as gone) is :class:`~enginecore.stage._session.ClientSession`'s; this module owns only the
IO: the sockets, the receiver thread, the locks and the waiting.

Utility round trip. A blocking :meth:`StageClient.call_utility` reads its answer from the
output socket itself instead of being woken by the receiver thread: that thread hand-off (a
futex wake and a GIL hand-over, ~30-50 µs here) sat on the critical path of every call, and
cost CPU on a machine where the stage's own threads want it at the same moment.

One thread at a time reads the PULL socket: the *owner* (``StageClient._owner``), which is
the receiver thread (``_RX``), a borrowing ``call_utility`` (its waiter), or nobody
(``None``: the socket is *idle*, lent out but unread). A blocking call, unless another call
borrows the socket already:

1. takes the socket at once if it is idle; else (the receiver owns it) leaves its waiter in
   ``_want`` and writes a byte to the wake pipe, so the receiver wakes, hands the socket
   over through the waiter and parks, while the call is on its way to the stage;
2. polls the socket, the wake pipe and the process sentinel itself, and dispatches every
   frame as the receiver would (same session code, same locks): other calls, streams and
   the ordered event stream are served meanwhile, and done-callbacks of futures run on it;
3. stops once its answer is in, after at most ``_BORROW_MAX_S``, at its deadline, or at once
   if the wake pipe (``close()``, the stage presumed dead) or the sentinel fires (the
   receiver runs the death path), and gives the socket back: to the receiver thread, which
   it wakes, unless it has its answer and nothing else is in flight (no stream, no other
   call, no ordered event stream, the stage running): then it leaves the socket idle, so
   that the next call, typically right after, takes it without waking anyone.

While the socket is not its own, the parked receiver thread still runs the liveness timers
(pings, the heartbeat deadline, the grace period after an exit), which need no socket
reading; it takes an idle socket back after ``_IDLE_LEND_S`` (it looks at it again at least
every ``_BORROW_MAX_S`` while the socket is lent, with no wake-up per call), or as soon as
anything else is sent (``_send``: a request, an abort, a future's call, the close). So
back-to-back calls run with no thread hand-off on the client side, like a hand-written
``recv()`` loop, and anything else is read promptly: within ~55 ms for an unsolicited event
(a protocol error's warning, a ``stalled`` event) right after a call; the stage's death
through its sentinel at once.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import multiprocessing.connection
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Literal, overload

import zmq
from zmq.utils.monitor import recv_monitor_message

from . import _clientbase, _codec, _session
from ._clientbase import ClientBase, Target
from ._curve import CurveKeys, HandshakeWatch
from ._errors import EngineDeadError, StageClosedError, StageStartupError
from ._launch import _POLL_MAX_S, launch_process
from ._session import ClientSession, Deliveries, End, StreamCore
from ._statistics import LOAD_INTERVAL, StageStatistics
from ._watchdog import STEP_TIMEOUT
from ._wire import StageEvent, WelcomeMsg

if TYPE_CHECKING:
    from typing_extensions import Self

    from .ray import RayPlacement

__all__ = ["Receiver", "RequestStream", "StageClient"]

logger = logging.getLogger("enginecore.stage")

# At most this many frames are read in a row before the reader looks at its other wake-ups
# (close, the process sentinel, a caller that wants the socket) again.
_DRAIN_MAX = 256
# How long a blocking call_utility may hold the output socket waiting for its answer before
# it gives the socket back to the receiver thread and waits like any other caller.
_BORROW_MAX_S = 0.05
# How long the output socket may stay idle (lent, unread) after a call_utility got its
# answer, for the next call to take it without waking the receiver thread.
_IDLE_LEND_S = 0.005
# The thread reading a client's events (its receiver thread, or a call_utility borrowing
# the socket) keeps that client's _lock here as ``reads``, while the lock is the client's
# own, so that a stream of that client read on it without an output to take (in a
# done-callback) raises instead of waiting for itself.
_tls = threading.local()


class _Waiter:
    """What a blocking :meth:`StageClient.call_utility` waits on: a queue that gets a token
    when the call is resolved (:attr:`done`), or when the receiver thread has handed the
    output socket over to the caller (then the client's ``_owner`` is this waiter). Lighter
    than a ``Future`` (no condition variable, no callbacks); a token may be stale, so the
    caller looks at the state after each one. Exactly one thread resolves a call: the one
    that pops it from the session under ``_lock``."""

    __slots__ = ("done", "end", "result", "wakeup")

    def __init__(self) -> None:
        self.wakeup: queue.SimpleQueue[None] = queue.SimpleQueue()
        self.result: Any = None
        self.end: End | None = None  # how the call failed, if it did
        self.done = False

    def set_result(self, result: Any) -> None:
        self.result = result
        self.done = True
        self.wakeup.put(None)

    def set_exception(self, exc: BaseException) -> None:
        # A dead stage's error fails every call with one object: raised with the traceback
        # it had here, it does not grow by a raise per call (_session.End).
        self.end = End(exc)
        self.done = True
        self.wakeup.put(None)


# StageClient._owner when the receiver thread reads the socket.
_RX: Final = "receiver thread"

_AnyWaiter = concurrent.futures.Future[Any] | _Waiter


class RequestStream(StreamCore, Iterator[Any]):
    """The outputs of one request, in order, as an iterator. Returned by
    :meth:`StageClient.add` and :meth:`StageClient.add_many`.

    Iteration yields each output's payload and stops after the request's finished output, or
    when its abort has been applied in the stage (then :attr:`aborted` is true). It raises
    :class:`~enginecore.stage.RequestError` if the stage reported an error for this request,
    :class:`~enginecore.stage.EngineDeadError` if the stage died and
    :class:`~enginecore.stage.StageClosedError` if the client was closed first; once ended,
    every later read ends the same way.

    ``next()`` blocks until an output arrives; :meth:`get` and :meth:`collect` take a
    timeout. Outputs are buffered, so a stream may be consumed late. One consumer thread per
    stream; the thread reading the stage's events may fill it meanwhile.

    :attr:`timings` (any thread, any time) is a snapshot of when the request was sent, when
    its outputs arrived and when and how it ended: a
    :class:`~enginecore.stage.StreamTimings`.
    """

    # The reader (the receiver thread, or a call_utility that borrows the socket) appends
    # under the client's _lock; the consumer reads its own list without it and takes it only
    # to swap lists (StreamCore). _wakeup gets a token when the reader finds _waiting set.
    __slots__ = ()

    _STOP = StopIteration
    _wakeup: queue.SimpleQueue[None] | None

    def __iter__(self) -> Self:  # a pool's or a pipeline's stream: its own type
        return self

    def __next__(self) -> Any:
        if self._pos < len(self._ready):  # no lock: only the consumer touches _ready
            return self._pop()
        return self.get()

    def get(self, timeout: float | None = None) -> Any:
        """The next payload. Blocks up to *timeout* seconds (``None``: until one arrives).

        Raises :class:`StopIteration` when the stream has ended normally,
        :class:`TimeoutError` on timeout (:class:`ValueError` if *timeout* is negative), else
        the stream's error (see the class docstring).
        """
        deadline = _clientbase.deadline_after(timeout)
        if self._pos >= len(self._ready) and not self._wait(deadline):
            raise TimeoutError(f"no output for request {self.req_id!r} within {timeout} s")
        return self._pop()

    def collect(self, timeout: float | None = None) -> list[Any]:
        """All remaining payloads until the stream ends, as one list. Blocks; *timeout*
        bounds the whole wait (:class:`TimeoutError`, and the payloads read so far stay in
        the stream, as they do if a ``KeyboardInterrupt`` interrupts the wait). Raises the
        stream's error if it ends with one (see the class docstring); the payloads before it
        are then dropped."""
        deadline = None if timeout is None else _clientbase.deadline_after(timeout)
        done = self._take_ended()  # the end has come: all in one take, without the lock
        if done is not None:
            return done
        out: list[Any] = []
        while not self._take_all(out):
            try:
                more = not _clientbase.passed(deadline) and self._wait(deadline)
            except BaseException:
                # Interrupted as it waits (Ctrl-C): what it read stays in the stream, first.
                self._put_back(out + list(self._ready[self._pos :]))
                raise
            if not more:
                self._put_back(out)
                raise TimeoutError(f"request {self.req_id!r} did not end within {timeout} s")
        return out

    def _wait(self, deadline: float | None) -> bool:
        """Once everything read: block until more has arrived and take it (``True``), or
        until *deadline* passes."""
        if getattr(_tls, "reads", None) is self._lock:
            if self._take(wait=False):
                return True
            raise RuntimeError(
                f"request {self.req_id!r}: a stream cannot wait on the thread that reads the "
                "stage's events (a done-callback of a call_utility_future future runs "
                "there); read it on another thread"
            )
        if self._wakeup is None:  # made before the receiver can see _waiting
            self._wakeup = queue.SimpleQueue()
        while not self._take(wait=True):
            try:
                # A token may be stale (a wake-up that came after a timeout): then _take
                # finds nothing and the loop waits again.
                self._wakeup.get(timeout=_left(deadline))
            except queue.Empty:
                return self._take(wait=False)
        return True


class StageClient(ClientBase[RequestStream, _AnyWaiter]):
    """Blocking client of one stage process: add, abort, call utilities, read outputs.

    Build one with :meth:`launch` (start a stage process and own it) or :meth:`connect`
    (attach to a headless stage, ``python -m enginecore serve``). Use it as a context manager.

    Thread-safety: every method may be called from any thread. One background thread reads
    the stage's events and watches for its death (the process sentinel for a launched stage,
    heartbeats for a connected one); when the stage is gone, every pending call, every
    waiting iterator and every later call raises the same
    :class:`~enginecore.stage.EngineDeadError`, within a second. After :meth:`close` they
    raise :class:`~enginecore.stage.StageClosedError` instead. While a blocking
    :meth:`call_utility` waits, it may read the stage's events itself instead of that thread
    (see the module docstring); done-callbacks of futures then run on the thread reading.

    A pipeline's own client of a stage (:meth:`Pipeline.client
    <enginecore.stage.Pipeline.client>`) raises :class:`RuntimeError` at once from
    :meth:`add`, :meth:`add_many`, :meth:`abort`, :meth:`get_event`, :meth:`get_events` and
    :meth:`events`: the pipeline owns the stage's requests and events.
    """

    # Lock rules: _lock guards the session (every session method that changes its state:
    # streams, calls, failure, closing, the event stream's waiting flag, release_due) and
    # who reads the output socket (_owner, _want); the reader
    # takes it once per frame, and it is never held while user code runs (futures are
    # resolved after release, see _apply) nor while waiting for _send_lock's socket: only
    # _send_nowait (add_many's frame, NOBLOCK) and _claim_send (a pool member's add, which
    # sends after releasing _lock) take _send_lock under it, and nothing takes _lock under
    # _send_lock. _cond (on _lock) is
    # where the receiver thread parks while it does not own the socket. _send_lock serialises
    # every use of the DEALER socket (zmq sockets are not thread-safe) and guards
    # _sockets_closed, the one send-after-close guard. _event_lock lets one event-stream
    # consumer at a time wait. _close_lock makes close idempotent.
    #
    # Only the owner (module docstring) uses the PULL socket, _poller and the session's
    # decoder; _owner changes only under _lock. The receiver hands the socket over only to
    # _want, after a byte on the wake pipe; it takes it back when a borrower sets _owner to
    # _RX (and notifies _cond), or, when idle (None), after _IDLE_LEND_S or on _resume.
    # close() sets _stopping, writes to the wake pipe (a borrower polls it too, and gives the
    # socket back at once) and resumes the receiver, which then returns; close() joins it
    # before it closes anything. Only a claim made under _lock while the session is open
    # writes to the pipe, so no byte is written once close() may have closed it.

    _lock: threading.Lock
    _stream_type = RequestStream

    def __init__(
        self,
        target: Target,
        welcome: WelcomeMsg,
        ctx: zmq.Context[Any],
        *socks: zmq.Socket[bytes],
        lock: threading.Lock | None = None,
        hub: Receiver | None = None,
    ) -> None:
        """Private: use :meth:`launch` or :meth:`connect`. With *hub*, the stage's events
        are read by that shared :class:`Receiver`'s thread instead of one of the client's
        own, and :meth:`call_utility` never borrows the output socket."""
        super().__init__(target, welcome)
        self._ctx = ctx
        self._dealer, self._pull = socks
        self._lock = threading.Lock() if lock is None else lock
        self._own_lock = lock is None  # not a pool's, shared with other clients
        self._send_lock = threading.Lock()
        self._sockets_closed = False
        self._close_lock = threading.Lock()
        self._closed_done = False
        self._released = False  # a bye was sent after the heartbeat presumed the stage dead
        self._over = threading.Event()  # Deliveries.over came: last event, or failure
        self._event_lock = threading.Lock()
        self._event_wakeup: queue.SimpleQueue[None] = queue.SimpleQueue()
        # Called, if set, on the thread that read a frame, after the frame's deliveries:
        # a pipeline takes the ordered event stream as it grows, with no thread of its own
        # (_pipeline). It must not block.
        self._event_sink: Callable[[], None] | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)  # a full pipe is readable already: drop the byte
        self._stopping = False  # close() wants the receiver thread to return
        self._cond = threading.Condition(self._lock)  # the receiver parks on it
        self._owner: object = _RX  # who reads the PULL socket: _RX, a _Waiter, None (idle)
        self._want: _Waiter | None = None  # a call_utility waiting for the receiver's socket
        self._idle_until = 0.0  # when the receiver takes an idle socket back
        self._exit_seen = False  # the receiver saw the process sentinel
        self._reader: int | None = None  # ident of a borrower that reads the socket now
        self._closer: int | None = None  # ident of the thread inside _close, if any
        self._poller = zmq.Poller()  # used by the thread reading the socket
        self._poller.register(self._pull, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._sentinel = self._launched.process.sentinel if self._launched is not None else None
        if self._sentinel is not None:
            self._poller.register(self._sentinel, zmq.POLLIN)
        self._hub = hub
        if hub is None:
            self._rx = threading.Thread(target=self._rx_main, name="enginecore-client", daemon=True)
            self._rx.start()
        else:
            self._rx = hub._thread
            hub.attach(self)

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def launch(
        cls,
        factory: str,
        /,
        kwargs: dict[str, Any] | None = None,
        *,
        startup_timeout: float = 60.0,
        ordered_events: bool = False,
        name: str | None = None,
        step_timeout: float | None = STEP_TIMEOUT,
        kill_after: float | None = None,
        log_level: int | str | None = None,
        forward_logs: bool = False,
        load_interval: float | None = LOAD_INTERVAL,
        max_message_bytes: int | None = None,
    ) -> StageClient:
        """Start a stage process running ``factory(**kwargs)`` and return its client.

        *factory* is an import string ``"pkg.module:callable"``, resolved in the child (a
        fresh interpreter, multiprocessing *spawn*); *kwargs* must be plain wire values (no
        arrays). With *ordered_events*, every event is also kept for :meth:`get_event` /
        :meth:`get_events` / :meth:`events`.

        The stage's step watchdog: a step that runs longer than *step_timeout* seconds
        (``None``: no watchdog) makes the stage log every thread's stack once, and
        :meth:`health` reads ``"stalled"`` until the step returns; with *kill_after*, a step
        that runs that long is fatal (:class:`~enginecore.stage.EngineDeadError` carrying
        the fatal message). :class:`ValueError` for values that are not seconds > 0, or a
        *kill_after* below *step_timeout*, before anything is started.

        Logging in the stage: every record carries the stage's name (*name*, else
        *factory*) as ``stage`` and its pid as ``process``; while the engine configures no
        handler, records go to the stage's stderr as ``time level stage[pid] logger:
        message``. *log_level* (an ``int`` or a name such as ``"DEBUG"``; ``None``: Python's
        default, ``WARNING``) is the level of the stage's root logger. With
        *forward_logs*, the stage's records are re-emitted in this process, through
        ``logging.getLogger(record.name).handle(record)``, instead of being written to its
        stderr (``docs/observability.md``). :class:`TypeError` / :class:`ValueError` for a
        bad *log_level*, before anything is started.

        Load reports: while the stage steps, at most every *load_interval* seconds
        (``None``: never), and on the step after which it idles, it attaches its load
        (live requests, the engine's ``stats()``) to a step's outputs; :meth:`load`
        returns the latest (``docs/observability.md``).
        :class:`TypeError` / :class:`ValueError` for a value that is not seconds > 0.

        Frame size: with *max_message_bytes* (an int >= 1024), the stage's input socket
        takes no frame (message part) larger than that many bytes, as ``serve
        --max-message-bytes`` (``docs/security.md``); the client refuses a bigger
        ``add`` / ``add_many`` / utility call before sending it
        (:class:`~enginecore.stage.MessageTooLargeError`). ``None``: unbounded.
        :class:`TypeError` / :class:`ValueError` for another value, before anything starts.

        Blocks until the stage is ready, at most *startup_timeout* seconds (a number > 0:
        :class:`TypeError` / :class:`ValueError` otherwise, before anything starts). Raises
        :class:`~enginecore.stage.StageStartupError` (with the child's traceback if the
        factory raised) if it does not come up; no process or socket file is left behind.
        """
        _clientbase.check_flag(ordered_events, "ordered_events")
        options = {
            "name": name,
            "step_timeout": step_timeout,
            "kill_after": kill_after,
            "log_level": log_level,
            "forward_logs": forward_logs,
            "load_interval": load_interval,
            "max_message_bytes": max_message_bytes,
        }
        return cls._launch(factory, kwargs, startup_timeout, ordered_events, options)

    @classmethod
    def launch_on_ray(
        cls,
        factory: str,
        /,
        kwargs: dict[str, Any] | None = None,
        *,
        placement: RayPlacement | None = None,
        insecure: bool = False,
        curve: CurveKeys | None = None,
        stage_secret_key: str | os.PathLike[str] | None = None,
        authorized_clients: Sequence[bytes] = (),
        startup_timeout: float = 60.0,
        connect_timeout: float = 10.0,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
        ordered_events: bool = False,
        name: str | None = None,
        step_timeout: float | None = STEP_TIMEOUT,
        kill_after: float | None = None,
        log_level: int | str | None = None,
        forward_logs: bool = False,
        load_interval: float | None = LOAD_INTERVAL,
        max_message_bytes: int | None = None,
    ) -> StageClient:
        """Place a stage running ``factory(**kwargs)`` on Ray, in an actor's own process,
        and return its client, which owns the actor (``pip install 'enginecore[ray]'``;
        ``docs/ray.md``): :func:`enginecore.stage.ray.launch_on_ray`, whose arguments these
        are (placement, CURVE keys, the handshake and heartbeat timeouts, the stage
        options of :meth:`launch`). Blocks until the stage is ready;
        :class:`~enginecore.stage.StageStartupError` otherwise, with no actor left
        behind."""
        from .ray import RayPlan, open_on_ray

        _clientbase.check_flag(ordered_events, "ordered_events")
        plan = RayPlan.make(
            factory,
            kwargs,
            placement=placement,
            insecure=insecure,
            curve=curve,
            stage_secret_key=stage_secret_key,
            authorized_clients=authorized_clients,
            startup_timeout=startup_timeout,
            connect_timeout=connect_timeout,
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
            name=name,
            step_timeout=step_timeout,
            kill_after=kill_after,
            log_level=log_level,
            forward_logs=forward_logs,
            load_interval=load_interval,
            max_message_bytes=max_message_bytes,
        )
        client: StageClient = open_on_ray(plan, cls._open, ordered_events=ordered_events)
        return client

    @classmethod
    def _launch(
        cls,
        factory: str,
        kwargs: dict[str, Any] | None,
        startup_timeout: float,
        ordered_events: bool,
        options: dict[str, Any],
        *,
        ping_s: float = _session.LAUNCHED_PING_S,
        lock: threading.Lock | None = None,
        hub: Receiver | None = None,
        cancel: multiprocessing.connection.Connection | None = None,
    ) -> StageClient:
        """:meth:`launch`, with the stage's *options* (its keyword arguments from *name*
        on, and ``listen``: a pipeline's stage that listens on TCP, ``_launch.TcpListen``)
        as a dict, how often to ping the stage (*ping_s*: a pool's health check), the
        lock of the client's session (*lock*: one for every member of a pool), the
        shared :class:`Receiver` that reads its events (*hub*), and a pipe end whose
        readiness cancels the start (*cancel*: a pool's, written when it closes or
        removes the replica: :class:`StageClosedError`)."""
        options = dict(options)
        launched = launch_process(
            factory, kwargs, startup_timeout, options.pop("name", None), cancel=cancel, **options
        )
        try:
            return cls._open(
                Target(
                    launched.input_address,
                    startup_timeout,
                    launched,
                    (ping_s, None),
                    ordered_events,
                    launched.curve,  # a stage that listens on TCP (TcpListen): CURVE
                ),
                lock,
                hub,
            )
        except BaseException as exc:
            launched.kill_and_clean()
            _clientbase.raise_startup_error(factory, exc)

    @classmethod
    def connect(
        cls,
        address: str,
        *,
        timeout: float = 10.0,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
        ordered_events: bool = False,
        curve: CurveKeys | None = None,
    ) -> StageClient:
        """Attach to a headless stage (``python -m enginecore serve``) at *address*.

        Blocks for the handshake, at most *timeout* seconds (:class:`TimeoutError`; a finite
        number > 0, else :class:`ValueError`, and *address* a ``str``, else :class:`TypeError`);
        :class:`~enginecore.stage.ProtocolError` if the stage rejects this client. The client
        pings every *heartbeat_interval* seconds and declares the stage dead
        (:class:`~enginecore.stage.EngineDeadError`) once *heartbeat_timeout* seconds have
        passed without hearing from it. :meth:`close` detaches; :meth:`shutdown` stops the
        stage.

        *curve* (:class:`~enginecore.stage.CurveKeys`: this client's key pair and the
        stage's public key) connects to a stage served with ``--curve-secret-key``: both
        sockets are encrypted, and the stage admits only its authorized client keys. A
        refused key, a wrong server key, or CURVE on one side only raise
        :class:`~enginecore.stage.AuthenticationError` as soon as the handshake fails,
        within *timeout* at the latest (``docs/security.md``).
        """
        _clientbase.check_connect(address, timeout)
        _clientbase.check_flag(ordered_events, "ordered_events")
        heartbeat = _clientbase.check_heartbeat(heartbeat_interval, heartbeat_timeout)
        return cls._open(Target(address, timeout, None, heartbeat, ordered_events, curve))

    @classmethod
    def _open(
        cls,
        target: Target,
        lock: threading.Lock | None = None,
        hub: Receiver | None = None,
        *,
        cancel: multiprocessing.connection.Connection | None = None,
    ) -> StageClient:
        """Connect to *target* and do the handshake, up to its timeout. *cancel*: a pipe
        end whose readiness cuts the handshake short (a pool's, written when it closes or
        removes the replica: :class:`StageClosedError`)."""
        address, timeout, launched = target.address, target.timeout, target.launched
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        dealer = pull = monitor = None
        reply: bytes | None = None
        watch: HandshakeWatch | None = None
        try:
            # A connected stage's handshake is watched through the socket monitor: a refused
            # CURVE key is otherwise silent (docs/security.md).
            dealer, monitor = _clientbase.dealer_for(
                ctx, address, target.curve, watch=launched is None
            )
            dealer.send(_session.HELLO_FRAME[0])
            poller = zmq.Poller()
            poller.register(dealer, zmq.POLLIN)
            if launched is not None:
                poller.register(launched.process.sentinel, zmq.POLLIN)
            if monitor is not None:
                poller.register(monitor, zmq.POLLIN)
            if cancel is not None:
                poller.register(cancel.fileno(), zmq.POLLIN)
            watch = _clientbase.handshake_watch(target)
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise watch.timed_out(timeout)
                # At most _POLL_MAX_S a poll (it takes an int of ms), then look again.
                ready = dict(poller.poll(max(1, round(min(left, _POLL_MAX_S) * 1000))))
                if monitor is not None and monitor in ready:
                    while True:
                        try:
                            watch.feed(recv_monitor_message(monitor, zmq.NOBLOCK))
                        except zmq.Again:
                            break
                    if watch.failure is not None:
                        raise watch.failure
                if dealer.poll(0):
                    break
                if launched is not None and launched.process.sentinel in ready:
                    raise StageStartupError("the stage process exited during the handshake")
                if cancel is not None and cancel.fileno() in ready:
                    raise StageClosedError(
                        f"the connection to the stage at {address} was cancelled"
                    )
            reply = dealer.recv()
            welcome = _session.parse_welcome(reply, address)
            _clientbase.stop_watching(dealer, monitor)
            monitor = None
            pull = _clientbase.pull_for(ctx, address, welcome, target.curve)
        except BaseException as exc:
            _clientbase.handshake_failed(ctx, dealer, monitor, pull, launched, exc, reply, watch)
            raise
        return cls(target, welcome, ctx, dealer, pull, lock=lock, hub=hub)

    # -- requests ----------------------------------------------------------------------------

    @overload
    def add(self, req_id: str, data: Any, stream: Literal[True] = True) -> RequestStream: ...
    @overload
    def add(self, req_id: str, data: Any, stream: Literal[False]) -> None: ...
    @overload
    def add(self, req_id: str, data: Any, stream: bool) -> RequestStream | None: ...

    def add(self, req_id: str, data: Any, stream: bool = True) -> RequestStream | None:
        """Send request *req_id* with *data*; return the stream of its outputs.

        With ``stream=False`` there is no stream and ``None`` is returned: the request's
        outputs appear only in the ordered event stream (the client must have been made with
        ``ordered_events=True``, else :class:`RuntimeError`), for consumers that read whole
        steps with :meth:`get_events`.

        *data* may hold numpy arrays and buffers; they travel without a copy, so do not
        modify them after the call. Raises :class:`TypeError` (before sending) if *data* is
        not wire-encodable, :class:`ValueError` if *req_id* has a live stream in this client,
        :class:`~enginecore.stage.MessageTooLargeError` (a :class:`ValueError`, before
        sending) for a frame larger than the stage takes (``serve --max-message-bytes``),
        else the client's failure (:class:`~enginecore.stage.EngineDeadError`, or
        :class:`~enginecore.stage.StageClosedError` after :meth:`close`). Never blocks;
        thread-safe.
        """
        if self._pipeline_key is not None:
            raise self._piped_error("add")
        parts = ClientSession.add_frame(req_id, data)
        return self._send_request(req_id, parts, stream)

    @overload
    def add_many(
        self, items: Iterable[tuple[str, Any]], *, streams: Literal[True] = True
    ) -> list[RequestStream]: ...
    @overload
    def add_many(self, items: Iterable[tuple[str, Any]], *, streams: Literal[False]) -> None: ...
    @overload
    def add_many(
        self, items: Iterable[tuple[str, Any]], *, streams: bool
    ) -> list[RequestStream] | None: ...

    def add_many(
        self, items: Iterable[tuple[str, Any]], *, streams: bool = True
    ) -> list[RequestStream] | None:
        """Send many ``(req_id, data)`` requests in one frame; return their streams in order
        (``streams=False``: ``None``, as :meth:`add` with ``stream=False``).

        The stage applies them in order, as one burst. All or nothing: :class:`TypeError`
        for a bad pair or payload, :class:`ValueError` for an id that has a live stream or
        appears twice, both before anything is sent; else as :meth:`add`. Never blocks;
        thread-safe.

        Against a stage with a bound on frames (``serve --max-message-bytes``) that the
        burst's frame is over, the requests go in several frames, each within it (halves,
        in order), all built and checked before anything is registered or sent, with the
        same streams in the same order: the stage applies them in order, but may step
        between two frames. Only a request whose frame alone is over the bound, or an array
        over it (each goes in a frame of its own), refuses the call, with nothing sent
        (:class:`~enginecore.stage.MessageTooLargeError`)."""
        if self._pipeline_key is not None:
            raise self._piped_error("add_many")
        if self._max_frame is not None:  # kept: over the bound, the burst is split from it
            items = list(items)
        ids, parts = ClientSession.adds_frame(items)
        return self._send_requests(ids, parts, streams, items=items)

    def abort(self, req_ids: Sequence[str]) -> None:
        """Ask the stage to abort *req_ids* (unknown ids are ignored).

        Their streams stop once the stage has applied the abort; no output of theirs follows.
        Raises :class:`TypeError` for a bare ``str``, else the client's failure; while this
        client's :meth:`shutdown` with a *drain* drains the stage, the abort is still sent.
        Against a stage with a bound on frames (``serve --max-message-bytes``) that the
        abort's frame is over, it goes as several ``abort`` messages, each within it (an
        :class:`~enginecore.stage.Aborted` each); only an id that alone does not fit raises
        :class:`~enginecore.stage.MessageTooLargeError`, with nothing sent. Never blocks;
        thread-safe.
        """
        if self._pipeline_key is not None:
            raise self._piped_error("abort")
        self._send_abort(req_ids)

    # -- utilities ---------------------------------------------------------------------------

    def call_utility_future(self, name: str, /, *args: Any) -> concurrent.futures.Future[Any]:
        """Start ``engine.utility(name, args)`` in the stage; return a future of its result.

        The future fails with :class:`~enginecore.stage.UtilityError` if the utility raised,
        and with the client's failure if the stage dies or the client is closed first.
        Cancelling it drops the answer. Many calls may be in flight. Raises
        :class:`TypeError` (before sending) if *args* are not wire-encodable, else the
        client's failure. Never blocks; thread-safe.
        """
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        call_id = self._start_call(name, args, future)
        future.add_done_callback(lambda f: self._forget_call(call_id) if f.cancelled() else None)
        return future

    def call_utility(self, name: str, /, *args: Any, timeout: float | None = None) -> Any:
        """Call ``engine.utility(name, args)`` in the stage and return its result.

        Blocks up to *timeout* seconds (``None``: until answered; :class:`ValueError` if
        negative). Raises :class:`~enginecore.stage.UtilityError` (remote ``repr`` inside)
        if it raised,
        :class:`TimeoutError` after *timeout* (the late answer is then dropped),
        :class:`TypeError` (before sending) for arguments that cannot cross the wire, and
        :class:`~enginecore.stage.EngineDeadError` /
        :class:`~enginecore.stage.StageClosedError` if the stage dies or the client is
        closed. Thread-safe.

        While no other ``call_utility`` does so, the calling thread reads the stage's events
        itself until its answer is in (for at most 50 ms), instead of being woken by the
        receiver thread: one thread wake-up less per call. It then handles every event as
        the receiver thread would, so done-callbacks of futures may run on it.
        """
        return self._call(name, args, timeout)

    def stats(self, timeout: float | None = 10.0) -> StageStatistics:
        """The stage's statistics (:class:`~enginecore.stage.StageStatistics`): its loop's
        (steps, step times, busy and idle time, messages, queue depth, the engine's own
        ``stats()``) and the stage's (outputs, live requests, backlog, load reports).

        Answered by the stage's input side from numbers it keeps as it goes: it never
        waits for the engine loop or a step, so it answers within a round trip even during
        a long step. Raises :class:`TimeoutError` after *timeout* seconds, and
        :class:`~enginecore.stage.EngineDeadError` /
        :class:`~enginecore.stage.StageClosedError` as :meth:`call_utility` does.
        Thread-safe."""
        return StageStatistics.from_wire(self._call("stats", (), timeout, stats=True))

    def _call(
        self, name: str, args: tuple[Any, ...], timeout: float | None, *, stats: bool = False
    ) -> Any:
        deadline = None if timeout is None else _clientbase.deadline_after(timeout)  # ValueError
        if self._reads_here(threading.get_ident()):
            # A future's done-callback, on the thread that reads the stage's events: the
            # answer could only be read by this very thread, which would wait for itself.
            what = "stats()" if stats else f"call_utility({name!r:.200})"
            raise RuntimeError(
                f"{what} cannot block on the thread that reads the stage's events (a "
                "done-callback of a call_utility_future future runs there); use "
                "call_utility_future() and a callback of its own, or another thread"
            )
        session = self._session
        call_id = session.new_call_id()
        # Encoded first: arguments that cannot cross the wire raise before anything else.
        parts = session.call_frame(call_id, name, args, stats)
        if self._max_frame is not None:
            self._check_frames(parts, f"utility call {name!r:.100}")
        waiter = _Waiter()
        try:
            try:
                self._open_claimed(call_id, waiter, name, stats)
                with self._send_lock:  # _send, inlined: this is the round trip's hot path
                    if self._sockets_closed:
                        raise StageClosedError("this stage client is closed")
                    _codec.send_parts(self._dealer, parts, 0)
                if self._owner is None:
                    self._resume()  # as _send: what the message brings back needs a reader
                while not waiter.done:
                    if self._owner is waiter:  # ours since the claim, or handed over
                        self._read_until(waiter, deadline)
                        if waiter.done:
                            break
                    try:
                        waiter.wakeup.get(timeout=_left(deadline))
                    except queue.Empty:
                        what = "stats" if stats else f"utility {name!r:.200}"
                        raise TimeoutError(f"{what} did not answer within {timeout} s") from None
            except BaseException:
                self._forget_call(call_id)  # a late answer is dropped
                raise
        finally:
            # Whatever happened, even an interrupt inside _open_claimed: the socket is not left
            # with this call. _read_until gave it back already, unless the receiver was
            # still to hand it over: then _want is still this waiter (_lend sets _owner
            # before it clears _want, so one of the two shows it, read in this order).
            if self._want is waiter or self._owner is waiter:
                self._give_back(waiter)
        if waiter.end is not None:
            waiter.end.raise_exc()
        return waiter.result

    # -- the event stream --------------------------------------------------------------------

    def get_event(self, timeout: float | None = None) -> StageEvent:
        """The next event of the stage, in the stage's order (needs ``ordered_events=True``,
        else :class:`RuntimeError`). A step's outputs are one
        :class:`~enginecore.stage.Outputs` event.

        Blocks up to *timeout* seconds (:class:`TimeoutError`; :class:`ValueError` if
        negative). After the last event: raises :class:`StopIteration` if this client shut
        the stage down, else the client's failure. Thread-safe, but events are not
        duplicated: one consumer sees each event, and each consumer sees its events in the
        stage's order.
        """
        if self._pipeline_key is not None:
            raise self._piped_error("get_event")
        if timeout is not None:  # checked as a wait checks it, an event ready or not
            _clientbase.deadline_after(timeout)
        buf = self._session.events
        if buf:
            try:
                item = buf.popleft()
            except IndexError:  # another consumer took the last one
                pass
            else:
                if type(item) is not End:
                    return item  # type: ignore[no-any-return]
                _session.raise_end(item, StopIteration)
        return self._take_events(timeout, every=False)[0]  # type: ignore[no-any-return]

    def get_events(self, timeout: float | None = None) -> list[StageEvent]:
        """Every event already received, in the stage's order, at least one: the batch form
        of :meth:`get_event`, for consumers that handle a whole step (or more) at once.

        Blocks only while there is none, up to *timeout* seconds; raises like
        :meth:`get_event`, but only once every event before the end has been returned.
        Thread-safe.
        """
        if self._pipeline_key is not None:
            raise self._piped_error("get_events")
        return self._take_events(timeout, every=True)

    def _take_events(self, timeout: float | None, *, every: bool) -> list[Any]:
        session = self._session
        buf = session.events
        if buf is None:
            raise _session.event_stream_off()
        deadline = _clientbase.deadline_after(timeout)
        # One waiting consumer at a time, so one wake-up token suffices.
        if not self._event_lock.acquire(
            timeout=-1 if timeout is None or deadline is None else timeout
        ):
            raise TimeoutError(f"no stage event within {timeout} s")
        try:
            while True:
                out = _session.take_events(buf, every)
                if out:
                    break
                with self._lock:
                    if session.events_end is not None and not buf:
                        _session.raise_end(session.events_end, StopIteration)
                    if buf:
                        continue
                    if getattr(_tls, "reads", None) is self._lock:
                        raise RuntimeError(
                            "get_event() cannot wait on the thread that reads the stage's "
                            "events (a done-callback of a call_utility_future future runs "
                            "there); read the event stream on another thread"
                        )
                    session.wait_for_events()
                try:
                    self._event_wakeup.get(timeout=_left(deadline))
                except queue.Empty:
                    with self._lock:
                        session.stop_waiting_for_events()
                    if not buf:
                        raise TimeoutError(f"no stage event within {timeout} s") from None
        finally:
            self._event_lock.release()
        return _session.events_before_end(out, StopIteration)

    def events(self) -> Iterator[StageEvent]:
        """Iterate over :meth:`get_event` until the stream ends. Blocks between events;
        raises the client's failure unless this client shut the stage down."""
        if self._pipeline_key is not None:  # at the call, not at the first next()
            raise self._piped_error("events")
        return self._iter_events()

    def _iter_events(self) -> Iterator[StageEvent]:
        while True:
            try:
                event = self.get_event()
            except StopIteration:
                return
            yield event

    # -- closing -----------------------------------------------------------------------------

    def shutdown(self, timeout: float = 5.0, *, drain: float | None = None) -> int | None:
        """Stop the stage and release everything; return its exit code (``None`` if unknown,
        always for a connected stage).

        Graceful first: a shutdown message (everything sent before it is applied first),
        then up to *timeout* seconds for the stage to end; a launched stage that is still
        alive gets SIGTERM, one more second, then SIGKILL. Pending calls and iterators then
        raise :class:`~enginecore.stage.StageClosedError` (or keep the
        :class:`~enginecore.stage.EngineDeadError` they already had), and so does every later
        call.

        With *drain* (seconds), the stage drains first: it refuses new adds (also those of
        other threads of this client, which raise ``StageClosedError`` at once, as their
        utility calls do), answers the utilities sent before, and lets its live requests
        run to completion, delivered to their streams as usual; then it stops. Meanwhile
        other threads may still :meth:`abort` this client's requests (those whose callers
        went away), and read :meth:`stats`: until this call returns or gives up on the
        drain and signals the process.
        Requests still live after *drain* seconds are aborted and their streams raise
        :class:`~enginecore.stage.RequestError`. The wait is then at most *drain* +
        *timeout*. :class:`ValueError` for a negative drain or *timeout* (or one that is
        not finite), :class:`TypeError` for one that is not a number, before anything.

        Blocks; thread-safe; idempotent (a second call waits for the first). Called
        from a future's done-callback (which runs on the thread reading the stage's events:
        the client's receiver thread, or a thread blocked in :meth:`call_utility`), it
        cannot wait there: it starts the close in the background and returns ``None``.
        """
        _session.check_shutdown_timeout(timeout)  # a bad timeout or drain raises before
        _session.shutdown_frame(drain)  # anything
        return self._close(stop_stage=True, timeout=timeout, drain=drain)

    def close(self) -> None:
        """Release this client. A launched stage is shut down (as :meth:`shutdown`); a
        connected stage is only detached from and keeps running. Blocks; thread-safe;
        idempotent."""
        self._close(stop_stage=self._launched is not None, timeout=5.0)

    def __enter__(self) -> StageClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _close(self, *, stop_stage: bool, timeout: float, drain: float | None = None) -> int | None:
        me = threading.get_ident()
        if me == self._closer:
            # Called from a done-callback run by this very close() (it fails the waiters):
            # the close is under way on this thread and ends when the callback returns.
            return None
        if self._reads_here(me):
            # Called from a future's done-callback, which runs on the thread reading the
            # socket: the receiver thread, or a call_utility that borrowed the socket (the
            # receiver is parked until it gives it back). Closing joins the receiver, so it
            # cannot happen here. Finish it on another thread; a later close() waits for it
            # (_close_lock), and waiters are woken as usual.
            with self._lock:
                self._session.begin_close()
            threading.Thread(
                target=self._close,
                kwargs={"stop_stage": stop_stage, "timeout": timeout, "drain": drain},
                name="enginecore-client-close",
                daemon=True,
            ).start()
            return None
        with self._close_lock:  # a second caller waits for the first, then returns
            if self._closed_done:
                return self.exit_code
            self._closer = me
            try:
                return self._close_now(stop_stage, timeout, drain)
            finally:
                self._closer = None

    def _close_now(self, stop_stage: bool, timeout: float, drain: float | None) -> int | None:
        """The close itself, under _close_lock."""
        alive = self._begin_close(stop_stage, drain)
        if drain is not None:
            timeout += drain
        launched = self._launched
        if launched is not None:
            presumed = self._session.presumed_dead
            if not launched.wait_exit(_clientbase.exit_wait(presumed, timeout)):
                with self._lock:
                    self._session.escalating()
                for sig, wait in _clientbase.escalate(self._session.pid, presumed):
                    launched.send_signal(sig)
                    if launched.wait_exit(wait):
                        break
            self._over.wait(_session.EXIT_READ_MAX_S)  # its last frames: the session says when
        elif stop_stage and alive:
            # At most TIMEOUT_MAX (292 years): a longer wait (timeout or drain 1e300)
            # raised OverflowError.
            self._over.wait(min(timeout, threading.TIMEOUT_MAX))
        self._stopping = True  # before the byte: the receiver reads the flag after it
        _poke(self._wake_w)  # for the receiver or a borrower, whichever polls
        self._resume()  # for a receiver parked with an idle socket
        if self._hub is None:
            self._rx.join()
        else:
            self._hub.detach(self)
        self._fail_closed()
        with self._send_lock:
            self._sockets_closed = True
            # A bye or shutdown to a live stage deserves a moment to leave the queue.
            self._dealer.close(linger=500 if alive or self._released else 0)
        _clientbase.close_sockets(self._ctx, self._pull)
        os.close(self._wake_r)
        os.close(self._wake_w)
        if launched is not None:
            launched.release()
        self._closed_done = True
        return self.exit_code

    # -- IO ----------------------------------------------------------------------------------

    def _send(self, parts: _session.Parts) -> None:
        self._send_now(parts)
        if self._owner is None:
            # The output socket idles after a call_utility: what this message brings back
            # (outputs, an answer) needs a reader. Read after sending, and after whatever
            # it answers was registered: a borrower that left the socket idle before saw
            # no such registration (it looks under _lock), and one that comes later sees it.
            self._resume()

    def _send_nowait(self, parts: _session.Parts) -> bool:
        with self._send_lock:
            if self._sockets_closed:
                raise StageClosedError("this stage client is closed")
            try:
                _codec.send_parts(self._dealer, parts, zmq.NOBLOCK)
            except zmq.Again:
                return False
            return True

    def _sent(self) -> None:
        if self._owner is None:
            self._resume()  # as _send: what the message brings back needs a reader

    def _send_now(self, parts: _session.Parts) -> None:
        with self._send_lock:
            if self._sockets_closed:
                raise StageClosedError("this stage client is closed")
            _codec.send_parts(self._dealer, parts, 0)

    def _claim_send(self) -> bool:
        self._send_lock.acquire()  # under _lock, as _send_nowait takes it
        return True

    def _send_claimed(self, parts: _session.Parts) -> None:
        try:
            if self._sockets_closed:
                raise StageClosedError("this stage client is closed")
            _codec.send_parts(self._dealer, parts, 0)
        finally:
            self._send_lock.release()
        if self._owner is None:
            self._resume()  # as _send: what the message brings back needs a reader

    def _apply(self, d: Deliveries[RequestStream, _AnyWaiter]) -> None:
        """Carry out what the session decided; called without _lock held."""
        for stream in d.wake:
            stream._wakeup.put(None)  # type: ignore[union-attr]  # set before _waiting
        for waiter, result, exc in d.answers:
            try:  # not contextlib.suppress: ~0.4 µs per answer more
                if exc is None:
                    waiter.set_result(result)
                else:
                    waiter.set_exception(exc)
            except concurrent.futures.InvalidStateError:  # cancelled
                pass
        if d.wake_events:
            self._event_wakeup.put(None)
        for message in d.warnings:
            logger.warning("enginecore: %s", message)
        if d.over:
            self._over.set()
            self._kill_if_presumed_dead()
        sink = self._event_sink
        if sink is not None:
            sink()

    def _rx_main(self) -> None:
        if self._own_lock:
            _tls.reads = self._lock
        try:
            self._rx_loop()
        except BaseException as exc:
            self._rx_failed(exc)
        else:
            self._rx_done()

    def _rx_done(self) -> None:
        """The receiver (its own thread, or the shared one) stops reading this client."""
        if self._session.release_due and not self._stopping:
            self._release_session()

    def _rx_failed(self, exc: BaseException) -> None:
        """The receiver raised while reading this client: the stage counts as gone."""
        logger.error("enginecore: the stage client's receiver failed", exc_info=exc)
        err = EngineDeadError(f"the stage client's receiver thread failed: {exc!r}")
        err.__cause__ = exc
        with self._lock:
            d = self._session.fail(err)
        if d is not None:
            self._apply(d)
        _poke(self._wake_w)  # a borrower stops polling at once

    def _rx_timers(self) -> float | None:
        """Run the liveness timers and send a ping that is due; when to run them again
        (``None``: no timer). Sets nothing if the session has failed (the caller checks)."""
        with self._lock:
            ping, wake_at, d = self._session.tick(time.monotonic())
        if d is not None:
            self._apply(d)
        if ping is not None and self._session.failure is None:
            with contextlib.suppress(zmq.ZMQError, StageClosedError):
                self._send_now(ping)
            self._read_input()
        return wake_at

    def _read_input(self) -> None:
        """After a ping: what the stage sent on the input socket since the handshake. Only a
        ``reject`` comes there: a stage that serves several clients ended this client's
        session (``ClientSession.input_reply``). A non-blocking read, once a ping interval."""
        bodies: list[bytes] = []
        with self._send_lock:
            if self._sockets_closed:
                return
            with contextlib.suppress(zmq.ZMQError):
                while True:
                    bodies.append(self._dealer.recv(zmq.NOBLOCK))
        for body in bodies:
            with self._lock:
                d = self._session.input_reply(body, time.monotonic())
            if d is not None:
                self._apply(d)
                _poke(self._wake_w)  # a borrower stops polling at once

    def _rx_exited(self) -> None:
        """The launched process's sentinel fired."""
        assert self._launched is not None
        exit_code = self._launched.reap()
        with self._lock:
            self._exit_seen = True
            # A Ray stage says why its actor ended (enginecore.stage.ray.RayStage.death).
            death = getattr(self._launched, "death", None)
            d = self._session.process_exited(exit_code, time.monotonic(), death)
        if d is not None:
            self._apply(d)

    def _rx_loop(self) -> None:
        session = self._session
        poller = self._poller
        pull, wake_r = self._pull, self._wake_r
        while True:
            wake_at = self._rx_timers()
            if session.failure is not None:
                return
            timeout_ms = None
            if wake_at is not None:  # rounded up: waking early would spin until the deadline
                timeout_ms = max(0, math.ceil((wake_at - time.monotonic()) * 1000))
            ready = dict(poller.poll(timeout_ms))
            if pull in ready and self._drain(None):
                return
            sentinel = self._sentinel
            if sentinel is not None and sentinel in ready:
                poller.unregister(sentinel)
                self._sentinel = None
                self._rx_exited()
            if wake_r in ready:
                os.read(wake_r, 4096)  # every byte: one wake-up serves them all
                if self._stopping:
                    return
                self._lend()

    def _release_session(self) -> None:
        """Receiver thread, owning the output socket, after the heartbeat presumed the stage
        dead: send a best-effort ``bye`` and disconnect from the stage's output, so that a
        stage that was only unreachable or stopped takes the next client at once instead of
        after its session timeout. The input socket stays open (closed by :meth:`close`)."""
        with self._lock:
            self._session.released()
        with self._send_lock:
            if self._sockets_closed:
                return
            with contextlib.suppress(zmq.ZMQError):
                _codec.send_parts(self._dealer, _session.BYE_FRAME, zmq.NOBLOCK)
                self._released = True
        if self._hub is None:
            self._poller.unregister(self._pull)
        self._pull.close(linger=0)

    def _lend(self) -> None:
        """Receiver thread, after a byte on the wake pipe: hand the socket over to the
        caller in ``_want``, if one still waits for it, and park until it is back."""
        with self._lock:
            waiter = self._want
            if waiter is None:
                return
            self._owner = waiter  # before clearing _want: see call_utility's finally
            self._want = None
        waiter.wakeup.put(None)
        self._park()

    def _park(self) -> None:
        """Receiver thread, while another thread owns the socket or it idles: run the
        liveness timers; return once the socket is the receiver's again (given back, or
        taken back when idle: after ``_IDLE_LEND_S``, on :meth:`_resume`, on close, or once
        the stage is gone)."""
        session = self._session
        cond = self._cond
        while True:
            with cond:
                ping, wake_at, d = session.tick(time.monotonic())
            if d is not None:
                self._apply(d)
                _poke(self._wake_w)  # presumed dead: a borrower stops polling at once
            if ping is not None:
                with contextlib.suppress(zmq.ZMQError, StageClosedError):
                    self._send_now(ping)
                self._read_input()
            with cond:
                while True:
                    owner = self._owner
                    if owner is _RX:
                        return
                    now = time.monotonic()
                    until = wake_at
                    if owner is None:
                        idle_until = self._idle_until
                        if now >= idle_until or self._stopping or session.failure is not None:
                            self._owner = _RX
                            return
                        if until is None or idle_until < until:
                            until = idle_until
                    else:
                        # Borrowed: look again within _BORROW_MAX_S, which bounds a borrow,
                        # so a socket the borrower left idle is taken back soon after
                        # _IDLE_LEND_S (to read what the stage sends unasked: a stalled
                        # event, outputs of a kept request) without a wake-up per call.
                        check = now + _BORROW_MAX_S
                        if until is None or check < until:
                            until = check
                    if until is not None and now >= until:
                        break  # a timer is due
                    cond.wait(None if until is None else until - now)

    def _resume(self) -> None:
        """Have the receiver thread take the socket back now if it idles."""
        with self._cond:
            if self._owner is None:
                self._owner = _RX
                self._cond.notify()

    def _reads_here(self, me: int) -> bool:
        """Whether the thread of ident *me* reads the stage's events now: a call_utility
        borrowing the socket, or the receiver thread while it runs (a dead thread's ident
        is given to the next thread started: a call there is no done-callback)."""
        return me == self._reader or (me == self._rx.ident and self._rx.is_alive())

    def _open_claimed(self, call_id: int, waiter: _Waiter, name: str, stats: bool) -> None:
        """Caller of call_utility, before it sends: register the call (raises as
        :meth:`ClientSession.open_call`) and, under the same hold of ``_lock``, become the
        socket's borrower or ask the receiver for it. Not while another call does, nor with
        a shared receiver; the call then waits for its answer. (``_call`` has refused a
        thread that reads the socket already: a done-callback would wait for itself.)"""
        session = self._session
        with self._lock:
            session.open_call(call_id, waiter, name, stats=stats)
            if session.closing or self._hub is not None:  # the hub never lends a socket
                return  # a stats request may be open while closing: it claims nothing
            owner = self._owner
            if owner is None:  # idle: no one to wake
                self._owner = waiter
            elif owner is _RX and self._want is None:
                self._want = waiter
                _poke(self._wake_w)  # under _lock while open: close() has not closed the pipe

    def _give_back(self, waiter: _Waiter) -> None:
        """Caller: stop borrowing. If the socket is *waiter*'s, leave it idle when the call
        has its answer and nothing else is in flight, else give it back to the receiver
        thread. Idempotent."""
        with self._lock:
            if self._want is waiter:
                self._want = None
            if self._owner is not waiter:
                return
            if waiter.done and not self._exit_seen and self._session.quiet_and_running():
                self._owner = None
                # No wake-up: the parked receiver looks again within _BORROW_MAX_S.
                self._idle_until = time.monotonic() + _IDLE_LEND_S
            else:
                self._owner = _RX
                self._cond.notify()

    def _read_until(self, waiter: _Waiter, deadline: float | None) -> None:
        """Caller, owning the socket: read and dispatch frames as the receiver would, until
        *waiter* is resolved, for at most ``_BORROW_MAX_S`` or until *deadline*; at once if
        the wake pipe (close, death) or the process sentinel fires. Then give the socket
        back, whatever happens (an interrupt, above all)."""
        self._reader = threading.get_ident()
        reads = getattr(_tls, "reads", None)
        if self._own_lock:
            _tls.reads = self._lock
        try:
            now = time.monotonic()
            end = now + _BORROW_MAX_S
            if deadline is not None and deadline < end:
                end = deadline
            # zmq_poll itself, not Poller.poll (a Python wrapper that checks its timeout).
            items = self._poller.sockets
            pull = self._pull
            session = self._session
            while not waiter.done and session.failure is None:
                timeout_ms = math.ceil((end - now) * 1000)
                if timeout_ms <= 0:
                    return
                ready = zmq.zmq_poll(items, timeout_ms)
                if not ready:
                    return
                if ready[0][0] is pull:
                    self._drain(waiter)
                if len(ready) > 1 or ready[0][0] is not pull:
                    return  # close(), death or the process's exit: the receiver's job
                if waiter.done:
                    return  # the usual end: no clock reading for a round that won't come
                now = time.monotonic()
        finally:
            _tls.reads = reads
            self._reader = None
            self._give_back(waiter)

    def _drain(self, waiter: _Waiter | None) -> bool:
        """Read and apply the frames waiting (a bounded number; a borrower stops after the
        one that resolves its *waiter*); whether the session ended. Only the socket's owner
        calls it."""
        session = self._session
        lock = self._lock
        # recv() and Frame.more, not recv_multipart(): pyzmq's RCVMORE getsockopt after each
        # part costs more than a whole single-part recv.
        recv = self._pull.recv
        monotonic = time.monotonic
        for _ in range(_DRAIN_MAX):
            try:
                frame = recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            parts = [frame]
            while frame.more:  # the rest of a multipart message is there already
                frame = recv(copy=False)
                parts.append(frame)
            # The frame's arrival: one clock reading, shared by every output in it (timings).
            now = monotonic()
            batch = session.decode(parts)  # outside the lock: only the owner decodes
            with lock:
                d = session.dispatch(batch, now)
            self._apply(d)
            if session.failure is not None:
                return True
            if waiter is not None and waiter.done:
                break
        return False


def _poke(fd: int) -> None:
    """Write a wake-up byte; a full pipe (the reader is behind) needs no more."""
    with contextlib.suppress(BlockingIOError):
        os.write(fd, b"x")


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class Receiver:
    """One thread that reads the events of many blocking clients: a replica pool's members
    (:class:`~enginecore.stage.StagePool`), so that a pool of N stages costs one receiver
    thread, not N. For each attached client it does what the client's own receiver thread
    would (``StageClient._rx_loop``): it reads and applies its frames, runs its liveness
    timers, and watches its process's sentinel; it never lends a client's output socket
    (a client attached to a hub does not borrow it in ``call_utility``).

    A client attaches itself when it is made with ``hub=`` and detaches in ``close()``;
    one whose session has ended is dropped. :meth:`close` stops the thread, once every
    client has detached."""

    def __init__(self, name: str = "enginecore-pool-receiver") -> None:
        self._lock = threading.Lock()
        self._clients: list[StageClient] = []
        self._leaving: dict[StageClient, threading.Event] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._stopping = False
        self._changed = True
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def attach(self, client: StageClient) -> None:
        """Start reading *client*'s events."""
        with self._lock:
            if self._stopping:
                raise StageClosedError("this receiver is closed")
            self._clients.append(client)
            self._changed = True
        _poke(self._wake_w)

    def detach(self, client: StageClient) -> None:
        """Stop reading *client*'s events; returns once the thread no longer touches it
        (at once on the receiver's own thread)."""
        done = threading.Event()
        with self._lock:
            if client not in self._clients:
                return
            if threading.get_ident() == self._thread.ident:
                self._clients.remove(client)
                self._changed = True
                return
            self._leaving[client] = done
            self._changed = True
        _poke(self._wake_w)
        done.wait()

    def close(self) -> None:
        """Stop the thread (the clients must have detached). Idempotent."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            self._changed = True
        _poke(self._wake_w)
        if threading.get_ident() != self._thread.ident:
            self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _main(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        by_socket: dict[Any, StageClient] = {}  # a pull socket or sentinel -> its client
        clients: list[StageClient] = []
        due: dict[StageClient, float | None] = {}  # when each client's timers run next
        while True:
            if self._changed:
                with self._lock:
                    self._changed = False
                    for client, done in self._leaving.items():
                        if client in self._clients:
                            self._clients.remove(client)
                        done.set()
                    self._leaving.clear()
                    wanted = list(self._clients)
                    if self._stopping:
                        return
                for client in clients:
                    if client not in wanted:
                        self._forget(poller, by_socket, client)
                        due.pop(client, None)
                for client in wanted:
                    if client not in clients:
                        poller.register(client._pull, zmq.POLLIN)
                        by_socket[client._pull] = client
                        if client._sentinel is not None:
                            poller.register(client._sentinel, zmq.POLLIN)
                            by_socket[client._sentinel] = client
                        due[client] = 0.0  # its timers run at once
                clients = wanted
            now = time.monotonic()
            ended: list[StageClient] = []
            soonest: float | None = None
            for client, next_at in due.items():
                at = next_at
                if at is not None and at <= now:
                    try:
                        at = due[client] = client._rx_timers()
                    except Exception as exc:
                        client._rx_failed(exc)
                    if client._session.failure is not None:
                        ended.append(client)
                        continue
                if at is not None and (soonest is None or at < soonest):
                    soonest = at
            for client in ended:
                self._end(poller, by_socket, due, client, clients)
            timeout_ms = None
            if soonest is not None:
                timeout_ms = max(0, math.ceil((soonest - time.monotonic()) * 1000))
            for sock, _ in poller.poll(timeout_ms):
                if sock == self._wake_r:
                    os.read(self._wake_r, 4096)
                    continue
                owner = by_socket.get(sock)
                if owner is None or owner not in due:
                    continue  # ended earlier in this round
                try:
                    if sock is owner._pull:
                        owner._drain(None)
                    else:
                        poller.unregister(sock)
                        del by_socket[sock]
                        owner._sentinel = None
                        owner._rx_exited()
                except Exception as exc:
                    owner._rx_failed(exc)
                if owner._session.failure is not None:
                    self._end(poller, by_socket, due, owner, clients)
                else:
                    due[owner] = 0.0  # a frame or an exit may have moved its timers

    def _end(
        self,
        poller: zmq.Poller,
        by_socket: dict[Any, StageClient],
        due: dict[StageClient, float | None],
        client: StageClient,
        clients: list[StageClient],
    ) -> None:
        """*client*'s session ended: stop reading it (as its own receiver would return)."""
        self._forget(poller, by_socket, client)
        due.pop(client, None)
        with self._lock:
            if client in self._clients:
                self._clients.remove(client)
        if client in clients:
            clients.remove(client)
        client._rx_done()

    @staticmethod
    def _forget(poller: zmq.Poller, by_socket: dict[Any, StageClient], client: StageClient) -> None:
        for sock in [s for s, c in by_socket.items() if c is client]:
            poller.unregister(sock)
            del by_socket[sock]
