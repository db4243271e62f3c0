"""AsyncStageClient: the asyncio client of a stage process.

The protocol is :class:`~enginecore.stage._session.ClientSession`'s, as for the blocking
client; this module owns the IO: the sockets, the output socket's reader, the liveness timer,
the process sentinel's reader and the waiting.

The output socket is read by a plain event-loop reader on its ``ZMQ_FD`` with non-blocking
``recv()`` calls (:meth:`AsyncStageClient._on_readable`), not by awaiting ``zmq.asyncio``'s
``recv``: that one costs a future, a handful of ``EVENTS`` look-ups and scheduled callbacks
per frame, about 20 µs of a utility round trip here. ``ZMQ_FD`` only signals that something
changed, and stays quiet while frames that were there already wait: the reader therefore
reads one frame, then, if ``ZMQ_EVENTS`` says another waits, calls itself again on the next
loop iteration (asking re-arms the signal, as a ``recv()`` that finds nothing does, for
half its cost). One frame (a step) per loop iteration, so the
tasks that a frame woke run before the next one is read. Sends do not wait either (a plain
view of the DEALER, ``NOBLOCK``; it has no high-water mark): ``zmq.asyncio`` is awaited only
for the handshake.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Literal, cast, overload

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from . import _aio, _clientbase, _codec, _session
from ._clientbase import Target
from ._curve import CurveKeys, HandshakeWatch
from ._errors import EngineDeadError, StageClosedError, StageStartupError
from ._launch import kill_and_clean_async, launch_process_async
from ._session import ClientSession, Deliveries, End, StreamCore
from ._statistics import LOAD_INTERVAL, StageStatistics
from ._watchdog import STEP_TIMEOUT
from ._wire import StageEvent, WelcomeMsg

if TYPE_CHECKING:
    from typing_extensions import Self

    from .ray import RayPlacement

__all__ = ["AsyncRequestStream", "AsyncStageClient"]

# Plain ints: zmq's constants are enum flags, and `int & flag` goes through enum's Python
# code (~1 µs).
_EVENTS: Final = int(zmq.EVENTS)
_POLLIN: Final = int(zmq.POLLIN)

logger = logging.getLogger("enginecore.stage")


class AsyncRequestStream(StreamCore, AsyncIterator[Any]):
    """The outputs of one request, in order, as an async iterator. Returned by
    :meth:`AsyncStageClient.add` and :meth:`AsyncStageClient.add_many`.

    ``async for`` yields each output's payload and stops after the request's finished
    output, or when its abort has been applied in the stage (then :attr:`aborted` is true).
    It raises :class:`~enginecore.stage.RequestError` if the stage reported an error for
    this request, :class:`~enginecore.stage.EngineDeadError` if the stage died and
    :class:`~enginecore.stage.StageClosedError` if the client was closed first; once ended,
    every later read ends the same way.

    Reading waits (without blocking the event loop) until an output arrives; :meth:`get`
    and :meth:`collect` take a timeout. Outputs are buffered, so a stream may be consumed
    late. Not thread-safe: use it on the client's event loop, from one task at a time (a
    second task that waits on it while one does raises :class:`RuntimeError`); but
    :attr:`timings` (a :class:`~enginecore.stage.StreamTimings` snapshot: when the request
    was sent, when its outputs arrived, when and how it ended) may be read from any thread.
    """

    # _wakeup is the future a waiting reader awaits; the output socket's reader resolves it
    # when it finds _waiting set, once per frame.
    __slots__ = ()

    _STOP = StopAsyncIteration
    _wakeup: asyncio.Future[None] | None

    def __aiter__(self) -> Self:  # a pool's or a pipeline's stream: its own type
        return self

    async def __anext__(self) -> Any:
        if self._pos < len(self._ready):  # no lock: only the consumer touches _ready
            return self._pop()
        return await self.get()

    async def get(self, timeout: float | None = None) -> Any:
        """The next payload. Waits up to *timeout* seconds (``None``: until one arrives).

        Raises :class:`StopAsyncIteration` when the stream has ended normally,
        :class:`TimeoutError` on timeout (:class:`ValueError` if *timeout* is negative), else
        the stream's error (see the class docstring).
        """
        deadline = _clientbase.deadline_after(timeout)
        if self._pos >= len(self._ready) and not await self._wait(deadline):
            raise TimeoutError(f"no output for request {self.req_id!r} within {timeout} s")
        return self._pop()

    async def collect(self, timeout: float | None = None) -> list[Any]:
        """All remaining payloads until the stream ends, as one list. *timeout* bounds the
        whole wait (:class:`TimeoutError`, and the payloads read so far stay in the stream,
        as they do when the call is cancelled).
        Raises the stream's error if it ends with one; the payloads before it are then
        dropped."""
        deadline = None if timeout is None else _clientbase.deadline_after(timeout)
        done = self._take_ended()  # the end has come: all in one take
        if done is not None:
            return done
        out: list[Any] = []
        try:
            while not self._take_all(out):
                if _clientbase.passed(deadline) or not await self._wait(deadline):
                    self._put_back(out)
                    raise TimeoutError(f"request {self.req_id!r} did not end within {timeout} s")
        except asyncio.CancelledError:  # asyncio.wait_for, a task's cancel(): as a timeout
            self._put_back(out)
            raise
        return out

    async def _wait(self, deadline: float | None) -> bool:
        """Once everything read: wait until more has arrived and take it (``True``), or
        until *deadline* passes."""
        if self._wakeup is not None:
            # Another task waits on this stream: one wake-up future per stream, so the
            # other task's would be lost and it would wait for ever, even past the end.
            raise RuntimeError(
                f"request {self.req_id!r}: another task is already waiting on this stream; "
                "read a stream from one task at a time"
            )
        lock = self._lock
        if isinstance(lock, _session.LoopLock):  # its client's, or its pipeline's
            _clientbase.check_loop(lock.loop, lock.owner)
        loop = asyncio.get_running_loop()
        while not self._take(wait=True):
            self._wakeup = wakeup = loop.create_future()
            try:
                if not await _aio.until(wakeup, deadline):
                    return self._take(wait=False)
            finally:
                self._wakeup = None
        return True


class AsyncStageClient(_clientbase.ClientBase[AsyncRequestStream, asyncio.Future[Any]]):
    """asyncio client of one stage process: add, abort, call utilities, read outputs.

    Build one with ``await`` :meth:`launch` (start a stage process and own it) or
    :meth:`connect` (attach to a headless stage, ``python -m enginecore serve``). Use it as
    ``async with``. Same abilities and error semantics as
    :class:`~enginecore.stage.StageClient`, with coroutines instead of blocking calls.

    Not thread-safe: use it from the event loop that created it. An event-loop reader reads
    the stage's events; a launched stage's death is seen through its process sentinel
    (another reader), a connected stage's through heartbeats. When the stage is gone,
    every pending call, every waiting iterator and every later call raises the same
    :class:`~enginecore.stage.EngineDeadError`, within a second. After :meth:`close` they
    raise :class:`~enginecore.stage.StageClosedError` instead.

    A pipeline's own client of a stage (:meth:`AsyncPipeline.client
    <enginecore.stage.AsyncPipeline.client>`) raises :class:`RuntimeError` from
    :meth:`add`, :meth:`add_many`, :meth:`abort`, :meth:`get_event`, :meth:`get_events` and
    :meth:`events` (at the call): the pipeline owns the stage's requests and events.
    """

    _stream_type = AsyncRequestStream

    def __init__(
        self, target: Target, welcome: WelcomeMsg, ctx: zmq.asyncio.Context, *socks: Any
    ) -> None:
        """Private: use :meth:`launch` or :meth:`connect`."""
        super().__init__(target, welcome)
        self._ctx = ctx
        self._dealer: zmq.asyncio.Socket
        self._pull: zmq.asyncio.Socket
        self._dealer, self._pull = socks
        self._loop = asyncio.get_running_loop()
        # One thread: nothing to guard against; its streams' waits check their loop by it.
        self._lock = _session.LoopLock(self._loop, "AsyncStageClient")
        # A plain view of the same socket, for sending without a future (the DEALER has no
        # high-water mark: a send never waits).
        self._dealer_now: zmq.Socket[bytes] = zmq.Socket.shadow(self._dealer.underlying)
        # Likewise for reading: the output socket is only ever read through this view, by
        # _on_readable, so zmq.asyncio never watches it (it would, after an await on it).
        self._pull_now: zmq.Socket[bytes] = zmq.Socket.shadow(self._pull.underlying)
        self._pull_fd: int = self._pull_now.fileno()  # ZMQ_FD
        self._reading = False  # _on_readable is registered as the reader of _pull_fd
        self._read_again: asyncio.Handle | None = None  # its call on the next iteration
        self._sockets_closed = False
        self._closing: _clientbase.ClosingTask[int | None] = _clientbase.ClosingTask(
            "the stage client"
        )
        self._closed_done = False
        self._released = False  # a bye was sent after the heartbeat presumed the stage dead
        self._over = asyncio.Event()  # Deliveries.over came: last event, or failure
        self._exited = asyncio.Event()  # the launched process's sentinel fired
        self._event_waiters: list[asyncio.Future[None]] = []
        # Called, if set, after a frame's deliveries: an asyncio pipeline takes the ordered
        # event stream as it grows (_apipeline). It must not block.
        self._event_sink: Callable[[], None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        # Never closed, then collected (asyncio.run() ended first): its sockets and context
        # are closed then, or pyzmq's Context.__del__ would wait for ever in term() for
        # sockets collected in the same pass. Not at exit (the stage is stopped then).
        self._finalizer = weakref.finalize(
            self, _collected_unclosed, ctx, self._dealer, self._pull, target.address
        )
        self._finalizer.atexit = False
        self._loop.add_reader(self._pull_fd, self._on_readable)
        self._reading = True
        self._read_soon()  # frames that came before the reader did: no signal for them
        if self._launched is not None:
            self._loop.add_reader(self._launched.process.sentinel, self._on_sentinel)
        self._run_timers()

    # -- construction ------------------------------------------------------------------------

    @classmethod
    async def launch(
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
    ) -> AsyncStageClient:
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

        Waits until the stage is ready, at most *startup_timeout* seconds (a number > 0,
        else :class:`TypeError` / :class:`ValueError` before anything starts), without holding
        a thread: the process is spawned on the event loop's thread (one fork and exec),
        and its ready report awaited with event-loop readers on its pipe and its sentinel,
        so the event loop keeps running and any number of launches (an async pool's
        replicas) progress together, whatever the size of the default executor. Raises
        :class:`~enginecore.stage.StageStartupError` (with the child's traceback if the
        factory raised) if it does not come up. Cancelling it (also Ctrl-C under
        :func:`asyncio.run`) stops the wait at once and kills the half-started stage before
        the cancellation propagates. No process or socket file is left behind either way.
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
        return await cls._launch(factory, kwargs, startup_timeout, ordered_events, options)

    @classmethod
    async def launch_on_ray(
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
    ) -> AsyncStageClient:
        """:meth:`StageClient.launch_on_ray <enginecore.stage.StageClient.launch_on_ray>`,
        awaited: the actor's answers are awaited as Ray's futures, with no thread held, so
        the event loop keeps running and many launches at once all progress together.
        Cancelling it kills the actor; no actor is left behind either way."""
        from .ray import RayPlan, open_on_ray_async

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
        client: AsyncStageClient = await open_on_ray_async(
            plan, cls._open, ordered_events=ordered_events
        )
        return client

    @classmethod
    async def _launch(
        cls,
        factory: str,
        kwargs: dict[str, Any] | None,
        startup_timeout: float,
        ordered_events: bool,
        options: dict[str, Any],
        *,
        ping_s: float = _session.LAUNCHED_PING_S,
    ) -> AsyncStageClient:
        """:meth:`launch`, with the stage's *options* (its keyword arguments from *name*
        on, and ``listen``: a pipeline's stage that listens on TCP, ``_launch.TcpListen``)
        as a dict and how often to ping the stage (*ping_s*: a pool's health check)."""
        options = dict(options)
        # Started on this thread, then awaited on the event loop: no executor thread is
        # held while the factory builds the engine, so a pool's replicas start together.
        launched = await launch_process_async(
            factory, kwargs, startup_timeout, options.pop("name", None), **options
        )
        try:
            return await cls._open(
                Target(
                    launched.input_address,
                    startup_timeout,
                    launched,
                    (ping_s, None),
                    ordered_events,
                    launched.curve,  # a stage that listens on TCP (TcpListen): CURVE
                )
            )
        except BaseException as exc:
            await kill_and_clean_async(launched)
            _clientbase.raise_startup_error(factory, exc)

    @classmethod
    async def connect(
        cls,
        address: str,
        *,
        timeout: float = 10.0,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
        ordered_events: bool = False,
        curve: CurveKeys | None = None,
    ) -> AsyncStageClient:
        """Attach to a headless stage (``python -m enginecore serve``) at *address*.

        Waits for the handshake, at most *timeout* seconds (:class:`TimeoutError`; a finite
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
        return await cls._open(Target(address, timeout, None, heartbeat, ordered_events, curve))

    @classmethod
    async def _open(cls, target: Target) -> AsyncStageClient:
        address, launched = target.address, target.launched
        loop = asyncio.get_running_loop()
        ctx = zmq.asyncio.Context()
        dealer = pull = None
        exited: asyncio.Future[Any] = loop.create_future()

        def on_exit() -> None:
            if not exited.done():
                exited.set_result(None)

        if launched is not None:
            loop.add_reader(launched.process.sentinel, on_exit)
        monitor = None
        reply: bytes | None = None
        watch: HandshakeWatch | None = None
        try:
            # A connected stage's handshake is watched through the socket monitor: a refused
            # CURVE key is otherwise silent (docs/security.md).
            dealer, monitor = _clientbase.dealer_for(
                ctx, address, target.curve, watch=launched is None
            )
            await dealer.send(_session.HELLO_FRAME[0])
            watch = _clientbase.handshake_watch(target)
            reply = await _handshake_reply(dealer, monitor, exited, target, watch)
            welcome = _session.parse_welcome(reply, address)
            _clientbase.stop_watching(dealer, monitor)
            monitor = None
            pull = _clientbase.pull_for(ctx, address, welcome, target.curve)
        except BaseException as exc:
            _clientbase.handshake_failed(ctx, dealer, monitor, pull, launched, exc, reply, watch)
            raise
        finally:
            if launched is not None:
                loop.remove_reader(launched.process.sentinel)
            exited.cancel()
        return cls(target, welcome, ctx, dealer, pull)

    # -- requests ----------------------------------------------------------------------------

    @overload
    async def add(
        self, req_id: str, data: Any, stream: Literal[True] = True
    ) -> AsyncRequestStream: ...
    @overload
    async def add(self, req_id: str, data: Any, stream: Literal[False]) -> None: ...
    @overload
    async def add(self, req_id: str, data: Any, stream: bool) -> AsyncRequestStream | None: ...

    async def add(self, req_id: str, data: Any, stream: bool = True) -> AsyncRequestStream | None:
        """Send request *req_id* with *data*; return the async stream of its outputs.

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
        :class:`~enginecore.stage.StageClosedError` after :meth:`close`). Never waits: the
        frame is queued for sending before it returns.
        """
        if self._pipeline_key is not None:
            raise self._piped_error("add")
        self._on_its_loop()  # its stream could be read on no other loop
        parts = ClientSession.add_frame(req_id, data)
        return self._send_request(req_id, parts, stream)

    @overload
    async def add_many(
        self, items: Iterable[tuple[str, Any]], *, streams: Literal[True] = True
    ) -> list[AsyncRequestStream]: ...
    @overload
    async def add_many(
        self, items: Iterable[tuple[str, Any]], *, streams: Literal[False]
    ) -> None: ...
    @overload
    async def add_many(
        self, items: Iterable[tuple[str, Any]], *, streams: bool
    ) -> list[AsyncRequestStream] | None: ...

    async def add_many(
        self, items: Iterable[tuple[str, Any]], *, streams: bool = True
    ) -> list[AsyncRequestStream] | None:
        """Send many ``(req_id, data)`` requests in one frame; return their async streams in
        order (``streams=False``: ``None``, as :meth:`add` with ``stream=False``).

        The stage applies them in order, as one burst. All or nothing: :class:`TypeError`
        for a bad pair or payload, :class:`ValueError` for an id that has a live stream or
        appears twice, both before anything is sent; else as :meth:`add`. Never waits.

        Against a stage with a bound on frames (``serve --max-message-bytes``) that the
        burst's frame is over, the requests go in several frames, each within it (halves,
        in order), all built and checked before anything is registered or sent, with the
        same streams in the same order: the stage applies them in order, but may step
        between two frames. Only a request whose frame alone is over the bound, or an array
        over it (each goes in a frame of its own), refuses the call, with nothing sent
        (:class:`~enginecore.stage.MessageTooLargeError`)."""
        if self._pipeline_key is not None:
            raise self._piped_error("add_many")
        self._on_its_loop()
        if self._max_frame is not None:  # kept: over the bound, the burst is split from it
            items = list(items)
        ids, parts = ClientSession.adds_frame(items)
        return self._send_requests(ids, parts, streams, items=items)

    async def abort(self, req_ids: Sequence[str]) -> None:
        """Ask the stage to abort *req_ids* (unknown ids are ignored).

        Their streams stop once the stage has applied the abort; no output of theirs follows.
        Raises :class:`TypeError` for a bare ``str``, else the client's failure; while this
        client's :meth:`shutdown` with a *drain* drains the stage, the abort is still sent.
        Against a stage with a bound on frames (``serve --max-message-bytes``) that the
        abort's frame is over, it goes as several ``abort`` messages, each within it (an
        :class:`~enginecore.stage.Aborted` each); only an id that alone does not fit raises
        :class:`~enginecore.stage.MessageTooLargeError`, with nothing sent. Never waits.
        """
        if self._pipeline_key is not None:
            raise self._piped_error("abort")
        self._on_its_loop()
        self._send_abort(req_ids)

    def _on_its_loop(self) -> None:
        if not self._closed_done:  # closed: every call raises StageClosedError, on any loop
            _clientbase.check_loop(self._loop, "AsyncStageClient")

    # -- utilities ---------------------------------------------------------------------------

    async def call_utility(self, name: str, /, *args: Any, timeout: float | None = None) -> Any:
        """Call ``engine.utility(name, args)`` in the stage and return its result.

        Waits up to *timeout* seconds (``None``: until answered); many calls may be in
        flight (``asyncio.gather``). Raises :class:`~enginecore.stage.UtilityError` (remote
        ``repr`` inside) if it raised, :class:`TimeoutError` after *timeout* (the late answer
        is then dropped, as it is when the call is cancelled), :class:`TypeError` (before
        sending) for arguments that cannot cross the wire, and
        :class:`~enginecore.stage.EngineDeadError` /
        :class:`~enginecore.stage.StageClosedError` if the stage dies or the client is
        closed.
        """
        return await self._call(name, args, timeout)

    async def stats(self, timeout: float | None = 10.0) -> StageStatistics:
        """The stage's statistics (:class:`~enginecore.stage.StageStatistics`): its loop's
        (steps, step times, busy and idle time, messages, queue depth, the engine's own
        ``stats()``) and the stage's (outputs, live requests, backlog, load reports).

        Answered by the stage's input side from numbers it keeps as it goes: it never
        waits for the engine loop or a step, so it answers within a round trip even during
        a long step. Raises :class:`TimeoutError` after *timeout* seconds, and
        :class:`~enginecore.stage.EngineDeadError` /
        :class:`~enginecore.stage.StageClosedError` as :meth:`call_utility` does."""
        return StageStatistics.from_wire(await self._call("stats", (), timeout, stats=True))

    async def _call(
        self, name: str, args: tuple[Any, ...], timeout: float | None, *, stats: bool = False
    ) -> Any:
        self._on_its_loop()
        future: asyncio.Future[Any] = self._loop.create_future()
        call_id = self._start_call(name, args, future, stats=stats)
        try:
            if not await _aio.until(future, _clientbase.deadline_after(timeout)):
                what = "stats" if stats else f"utility {name!r:.200}"
                raise TimeoutError(f"{what} did not answer within {timeout} s")
            return future.result()
        finally:
            self._forget_call(call_id)

    # -- the event stream --------------------------------------------------------------------

    async def get_event(self, timeout: float | None = None) -> StageEvent:
        """The next event of the stage, in the stage's order (needs ``ordered_events=True``,
        else :class:`RuntimeError`). A step's outputs are one
        :class:`~enginecore.stage.Outputs` event.

        Waits up to *timeout* seconds (:class:`TimeoutError`; :class:`ValueError` if
        negative). After the last event: raises :class:`StopAsyncIteration` if this client
        shut the stage down, else the client's failure. Several tasks may read; each event
        goes to one of them.
        """
        if self._pipeline_key is not None:
            raise self._piped_error("get_event")
        if timeout is not None:  # checked as a wait checks it, an event ready or not
            _clientbase.deadline_after(timeout)
        buf = self._session.events
        if buf:
            item = buf.popleft()
            if type(item) is not End:
                return item  # type: ignore[no-any-return]
            _session.raise_end(item, StopAsyncIteration)
        return (await self._take_events(timeout, every=False))[0]  # type: ignore[no-any-return]

    async def get_events(self, timeout: float | None = None) -> list[StageEvent]:
        """Every event already received, in the stage's order, at least one: the batch form
        of :meth:`get_event`, for consumers that handle a whole step (or more) at once.

        Waits only while there is none, up to *timeout* seconds; raises like
        :meth:`get_event`, but only once every event before the end has been returned.
        """
        if self._pipeline_key is not None:
            raise self._piped_error("get_events")
        return await self._take_events(timeout, every=True)

    async def _take_events(self, timeout: float | None, *, every: bool) -> list[Any]:
        session = self._session
        buf = session.events
        if buf is None:
            raise _session.event_stream_off()
        deadline = _clientbase.deadline_after(timeout)
        while True:
            out = _session.take_events(buf, every)
            if out:
                return _session.events_before_end(out, StopAsyncIteration)
            if session.events_end is not None:
                _session.raise_end(session.events_end, StopAsyncIteration)
            self._on_its_loop()
            wakeup: asyncio.Future[None] = self._loop.create_future()
            self._event_waiters.append(wakeup)
            session.wait_for_events()
            try:
                if not await _aio.until(wakeup, deadline) and not buf:
                    raise TimeoutError(f"no stage event within {timeout} s")
            finally:
                with contextlib.suppress(ValueError):  # gone if _apply woke it
                    self._event_waiters.remove(wakeup)

    def events(self) -> AsyncIterator[StageEvent]:
        """Iterate over :meth:`get_event` until the stream ends. Waits between events;
        raises the client's failure unless this client shut the stage down."""
        if self._pipeline_key is not None:  # at the call, not at the first __anext__()
            raise self._piped_error("events")
        return self._iter_events()

    async def _iter_events(self) -> AsyncIterator[StageEvent]:
        while True:
            try:
                event = await self.get_event()
            except StopAsyncIteration:
                return
            yield event

    # -- closing -----------------------------------------------------------------------------

    async def shutdown(self, timeout: float = 5.0, *, drain: float | None = None) -> int | None:
        """Stop the stage and release everything; return its exit code (``None`` if unknown,
        always for a connected stage).

        Graceful first: a shutdown message (everything sent before it is applied first),
        then up to *timeout* seconds for the stage to end; a launched stage that is still
        alive gets SIGTERM, one more second, then SIGKILL. Pending calls and iterators then
        raise :class:`~enginecore.stage.StageClosedError` (or keep the
        :class:`~enginecore.stage.EngineDeadError` they already had), and so does every later
        call.

        With *drain* (seconds), the stage drains first: it refuses new adds (also those of
        other tasks of this client, which raise ``StageClosedError`` at once, as their
        utility calls do), answers utilities, and lets its live requests run to completion,
        delivered to their streams as usual; then it stops. Meanwhile other tasks may still
        :meth:`abort` this client's requests (those whose callers went away), and await
        :meth:`stats`: until the shutdown is over or gives up on the drain and signals the
        process. Requests still live after *drain* seconds are aborted and their streams
        raise :class:`~enginecore.stage.RequestError`. The wait is then at most *drain* +
        *timeout*. :class:`ValueError` for a negative drain, before anything.

        Waits; idempotent (a second call waits for the first, and returns or raises as it
        does). Cancelling the call (``asyncio.wait_for``, a task's ``cancel()``) cancels
        only the wait: the shutdown goes on in a task of its own, and a later call waits for
        it; if the event loop ends first, the stage is killed (SIGKILL) and reaped. Once
        the client's loop has closed, a call on any loop closes it so at once.
        """
        _session.check_shutdown_timeout(timeout)  # a bad timeout or drain raises before
        _session.shutdown_frame(drain)  # anything is sent
        return await self._close(stop_stage=True, timeout=timeout, drain=drain)

    async def close(self) -> None:
        """Release this client. A launched stage is shut down (as :meth:`shutdown`); a
        connected stage is only detached from and keeps running. Waits; idempotent; a
        cancelled call cancels only the wait, as for :meth:`shutdown`."""
        await self._close(stop_stage=self._launched is not None, timeout=5.0)

    async def __aenter__(self) -> AsyncStageClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _close(
        self, *, stop_stage: bool, timeout: float, drain: float | None = None
    ) -> int | None:
        if self._loop.is_closed():
            # Its loop has ended (asyncio.run() returned first): nothing can await the stage
            # there any more, and nothing else could ever close it. As at the loop's end.
            self._kill_now(stop_stage)
            return self.exit_code
        _clientbase.check_loop(self._loop, "AsyncStageClient")  # its close task's loop
        if self._closing.unstarted():
            alive = self._begin_close(stop_stage, drain)
            self._closing.start(self._shut_down(alive, stop_stage, timeout, drain))
        return await self._closing.wait()

    async def _shut_down(
        self, alive: bool, stop_stage: bool, timeout: float, drain: float | None
    ) -> int | None:
        """The shutdown task: wait for the stage's end (or escalate), then release all."""
        launched = self._launched
        try:
            if drain is not None:
                timeout += drain
            if launched is not None:
                presumed = self._session.presumed_dead
                waited = _clientbase.exit_wait(presumed, timeout)
                if not await _aio.wait_event(self._exited, waited):
                    self._session.escalating()
                    for sig, wait in _clientbase.escalate(self._session.pid, presumed):
                        launched.send_signal(sig)
                        if await _aio.wait_event(self._exited, wait):
                            break
                await _aio.wait_event(self._over, _session.EXIT_READ_MAX_S)  # its last frames
            elif stop_stage and alive:
                await _aio.wait_event(self._over, timeout)
        except BaseException:
            # The loop's end cancels this task (asyncio.run cancels the tasks left), or a
            # wait failed: no one will wait for the stage any more, so it is killed now.
            self._kill_now()
            raise
        self._release_all(alive)
        return self.exit_code

    def _kill_now(self, stop_stage: bool | None = None) -> None:
        """Without the event loop: begin the close if not begun (a connected stage is told
        to stop with *stop_stage*, else detached from), SIGKILL a launched stage and wait
        (blocking, briefly) for its exit, then release everything. For a close that cannot
        be awaited any more (its loop ends, or has ended). Idempotent."""
        if self._closed_done:
            return
        session = self._session
        if stop_stage is None:
            stop_stage = self._launched is not None
        alive = self._begin_close(stop_stage) if not session.closing else False
        launched = self._launched
        if launched is not None:
            session.escalating()  # its end is this close's doing, not a death
            with contextlib.suppress(OSError):  # gone already
                launched.send_signal(signal.SIGKILL)
            launched.wait_exit(5.0)
            launched.reap()
        self._exited.set()  # a shutdown task still waiting ends at once
        self._over.set()
        self._release_all(alive)

    def _release_all(self, alive: bool) -> None:
        """The end of a close: stop reading, fail what still waits, close the sockets and
        release a launched stage's process. Idempotent."""
        if self._closed_done:
            return
        self._closed_done = True
        self._finalizer.detach()
        launched = self._launched
        if launched is not None:
            self._loop.remove_reader(launched.process.sentinel)
        self._stop_reading()
        if self._timer is not None:
            self._timer.cancel()
        self._fail_closed()
        self._sockets_closed = True
        # A bye or shutdown to a live stage deserves a moment to leave the queue.
        self._dealer.close(linger=500 if alive or self._released else 0)
        _clientbase.close_sockets(self._ctx, self._pull)
        if launched is not None:
            launched.release()

    # -- IO ----------------------------------------------------------------------------------

    def _send(self, parts: _session.Parts) -> None:
        if self._sockets_closed:
            raise StageClosedError("this stage client is closed")
        _codec.send_parts(self._dealer_now, parts, zmq.NOBLOCK)

    def _send_nowait(self, parts: _session.Parts) -> bool:
        try:
            self._send(parts)
        except zmq.Again:
            return False
        return True

    def _apply(self, d: Deliveries[AsyncRequestStream, asyncio.Future[Any]]) -> None:
        """Carry out what the session decided."""
        for stream in d.wake:
            wakeup = stream._wakeup
            if wakeup is not None and not wakeup.done():
                wakeup.set_result(None)
        for future, result, exc in d.answers:
            if not future.done():  # else the caller was cancelled
                if exc is None:
                    future.set_result(result)
                else:
                    future.set_exception(exc)
        if d.wake_events:
            waiters, self._event_waiters = self._event_waiters, []
            for wakeup in waiters:
                if not wakeup.done():
                    wakeup.set_result(None)
        for message in d.warnings:
            logger.warning("enginecore: %s", message)
        if d.over:
            self._over.set()
            self._kill_if_presumed_dead()
        sink = self._event_sink
        if sink is not None:
            sink()

    def _on_readable(self) -> None:
        """Reader of the output socket: read and apply one frame, if there is one, and if so
        call again on the next loop iteration (see the module docstring)."""
        if self._read_again is not None:  # called by the FD's signal: one pending call only
            self._read_again.cancel()
            self._read_again = None
        if not self._reading:
            return
        session = self._session
        try:
            try:
                frame = self._pull_now.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return  # nothing left; the next frame will signal
            parts = [frame]
            while frame.more:  # the rest of a multipart message is there already
                frame = self._pull_now.recv(copy=False)
                parts.append(frame)
            # The frame's arrival: one clock reading, shared by every output in it (timings).
            d = session.receive(parts, time.monotonic())
            self._apply(d)
            if session.failure is not None:
                self._stop_reading()
                return
            if d.over:
                self._run_timers()  # the last event: the linger deadline starts
            # Another frame waiting? Asking costs ~1.2 µs and re-arms the FD's signal as a
            # receive that finds nothing does; that receive, on the next loop iteration,
            # costs a scheduled callback and ~2.5 µs (pyzmq builds an Again). A lone frame
            # (a utility's answer, most often) ends here.
            if not cast(int, self._pull_now.getsockopt(_EVENTS)) & _POLLIN:
                return
        except Exception as exc:
            logger.exception("enginecore: the stage client's output reader failed")
            self._stop_reading()
            err = EngineDeadError(f"the stage client's output reader failed: {exc!r}")
            err.__cause__ = exc
            failed = session.fail(err)
            if failed is not None:
                self._apply(failed)
            return
        self._read_soon()

    def _read_soon(self) -> None:
        if self._read_again is None and self._reading:
            self._read_again = self._loop.call_soon(self._on_readable)

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._pull_fd)
        if self._read_again is not None:
            self._read_again.cancel()
            self._read_again = None

    def _run_timers(self) -> None:
        """Run the session's liveness timers and schedule the next run."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        ping, wake_at, d = self._session.tick(time.monotonic())
        if d is not None:
            self._apply(d)
        if self._session.release_due:
            self._release_session()
        if ping is not None:
            with contextlib.suppress(zmq.ZMQError, StageClosedError):
                self._send(ping)
            if self._read_input():
                return
        if wake_at is not None:
            self._timer = self._loop.call_later(wake_at - time.monotonic(), self._run_timers)

    def _read_input(self) -> bool:
        """After a ping: what the stage sent on the input socket since the handshake (only a
        ``reject``: a stage that serves several clients ended this client's session,
        ``ClientSession.input_reply``). Whether the session has now failed."""
        if self._sockets_closed:
            return False
        bodies: list[bytes] = []
        with contextlib.suppress(zmq.ZMQError):
            while True:
                bodies.append(self._dealer_now.recv(zmq.NOBLOCK))
        for body in bodies:
            d = self._session.input_reply(body, time.monotonic())
            if d is not None:
                self._apply(d)
                if self._session.release_due:
                    self._release_session()
                return True
        return False

    def _release_session(self) -> None:
        """After the heartbeat presumed the stage dead: send a best-effort ``bye`` and
        disconnect from the stage's output, so that a stage that was only unreachable or
        stopped takes the next client at once instead of after its session timeout. The
        input socket stays open (closed by :meth:`close`)."""
        self._session.released()
        self._stop_reading()
        with contextlib.suppress(zmq.ZMQError, StageClosedError):
            self._send(_session.BYE_FRAME)
            self._released = True
        self._pull.close(linger=0)

    def _on_sentinel(self) -> None:
        launched = self._launched
        assert launched is not None
        self._loop.remove_reader(launched.process.sentinel)
        self._exited.set()
        # A Ray stage says why its actor ended (enginecore.stage.ray.RayStage.death).
        death = getattr(launched, "death", None)
        d = self._session.process_exited(launched.reap(), time.monotonic(), death)
        if d is not None:
            self._apply(d)
        self._run_timers()  # the grace period for the frames still in flight


async def _handshake_reply(
    dealer: zmq.asyncio.Socket,
    monitor: zmq.asyncio.Socket | None,
    exited: asyncio.Future[Any],
    target: Target,
    watch: HandshakeWatch,
) -> bytes:
    """The stage's reply to ``hello``, within ``target.timeout``: :class:`TimeoutError`,
    :class:`~enginecore.stage.AuthenticationError` as soon as *monitor* says the security
    handshake failed (fed to *watch*), :class:`~enginecore.stage.StageStartupError` if
    *exited* is set."""
    loop = asyncio.get_running_loop()
    recv: asyncio.Future[bytes] = asyncio.ensure_future(dealer.recv())
    events: asyncio.Future[Any] | None = None
    deadline = loop.time() + target.timeout
    try:
        while True:
            if monitor is not None and events is None:
                events = asyncio.ensure_future(recv_monitor_message(monitor))
            left = deadline - loop.time()
            if left <= 0:
                raise watch.timed_out(target.timeout)
            waits: set[asyncio.Future[Any]] = {recv, exited}
            if events is not None:
                waits.add(events)
            done, _ = await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if recv in done:
                return recv.result()
            if exited in done:
                raise StageStartupError("the stage process exited during the handshake")
            if events is not None and events in done:
                watch.feed(events.result())
                events = None
                if watch.failure is not None:
                    raise watch.failure
    finally:
        for fut in (recv, events):
            if fut is not None and not fut.done():
                fut.cancel()
                with contextlib.suppress(asyncio.CancelledError, zmq.ZMQError):
                    await fut


def _collected_unclosed(ctx: zmq.asyncio.Context, dealer: Any, pull: Any, address: str) -> None:
    """An :class:`AsyncStageClient` never closed was collected: say so, as an unclosed file
    does, and close what would otherwise hang the context's own finalizer."""
    warnings.warn(
        f"unclosed AsyncStageClient of the stage at {address}: close it, or use it as an "
        "async context manager",
        ResourceWarning,
        stacklevel=1,
    )
    _clientbase.close_sockets(ctx, dealer, pull)
