"""StageClient: the blocking client of a stage process."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import itertools
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any, Final

import msgspec
import zmq

from . import _common, _wire
from ._errors import (
    EngineDeadError,
    RequestError,
    StageClosedError,
    StageStartupError,
    UtilityError,
)
from ._launch import Launched, launch_process
from ._wire import Aborted, ErrorReport, Fatal, Output, Pong, Shutdown, StageEvent, UtilityResult

__all__ = ["RequestStream", "StageClient"]

logger = logging.getLogger("enginecore.stage")

# After the process sentinel fires, how long to keep reading for frames still in flight (the
# fatal event, above all). Ends early when the terminal event arrives.
_EXIT_GRACE_S: Final = 0.3
# After a launched stage's last event (shutdown/fatal), how long its process may take to exit
# before the waiters are failed anyway (the exit code is then unknown).
_EXIT_AFTER_LAST_EVENT_S: Final = 1.0


class _End:
    """Queue marker: the stream (or event stream) ends; with *exc*, by raising it."""

    __slots__ = ("aborted", "exc")

    def __init__(self, exc: BaseException | None, aborted: bool = False) -> None:
        self.exc = exc
        self.aborted = aborted


class _Waiter:
    """What a blocking :meth:`StageClient.call_utility` waits on: a pre-acquired lock that
    the one thread resolving the call releases. Lighter than a ``Future`` (no condition
    variable, no callbacks). Exactly one thread resolves a call: the one that pops it from
    ``_calls`` under ``_lock``."""

    __slots__ = ("exc", "lock", "result")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()
        self.result: Any = None
        self.exc: BaseException | None = None

    def set_result(self, result: Any) -> None:
        self.result = result
        self.lock.release()

    def set_exception(self, exc: BaseException) -> None:
        self.exc = exc
        self.lock.release()


_FINISHED: Final = _End(None)
_ABORTED: Final = _End(None, aborted=True)


class RequestStream(Iterator[Any]):
    """The outputs of one request, in order, as an iterator. Returned by
    :meth:`StageClient.add`.

    Iteration yields each output's payload and stops after the request's finished output, or
    when its abort has been applied in the stage (then :attr:`aborted` is true). It raises
    :class:`~enginecore.stage.RequestError` if the stage reported an error for this request,
    :class:`~enginecore.stage.EngineDeadError` if the stage died and
    :class:`~enginecore.stage.StageClosedError` if the client was closed first.

    ``next()`` blocks until an output arrives; :meth:`get` takes a timeout. Outputs are
    buffered, so a stream may be consumed late. One consumer thread per stream.
    """

    def __init__(self, req_id: str) -> None:
        self.req_id: Final = req_id
        """The request's id."""
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._end: _End | None = None

    @property
    def finished(self) -> bool:
        """Whether iteration has reached the request's finished output. Never blocks."""
        return self._end is _FINISHED

    @property
    def aborted(self) -> bool:
        """Whether iteration stopped because the request was aborted. Never blocks."""
        return self._end is _ABORTED

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> Any:
        return self.get()

    def get(self, timeout: float | None = None) -> Any:
        """The next payload. Blocks up to *timeout* seconds (``None``: until one arrives).

        Raises :class:`StopIteration` when the stream has ended normally,
        :class:`TimeoutError` on timeout, else the stream's error (see the class docstring).
        """
        end = self._end
        if end is None:
            try:
                item = self._q.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(
                    f"no output for request {self.req_id!r} within {timeout} s"
                ) from None
            if type(item) is not _End:
                return item
            self._end = end = item
        if end.exc is not None:
            raise end.exc
        raise StopIteration

    def collect(self, timeout: float | None = None) -> list[Any]:
        """All remaining payloads until the stream ends; *timeout* bounds the whole wait."""
        deadline = None if timeout is None else time.monotonic() + timeout
        out: list[Any] = []
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                out.append(self.get(left))
            except StopIteration:
                return out


class StageClient:
    """Blocking client of one stage process: add, abort, call utilities, read outputs.

    Build one with :meth:`launch` (start a stage process and own it) or :meth:`connect`
    (attach to a headless stage, ``python -m enginecore serve``). Use it as a context manager.

    Thread-safety: every method may be called from any thread. One background thread reads
    the stage's events and watches for its death (the process sentinel for a launched stage,
    heartbeats for a connected one); when the stage is gone, every pending call, every
    waiting iterator and every later call raises the same
    :class:`~enginecore.stage.EngineDeadError`, within a second. After :meth:`close` they
    raise :class:`~enginecore.stage.StageClosedError` instead.
    """

    # Lock rules: _lock guards _streams, _calls, _failure, _closing and _call_ids; it is never
    # held while user code runs (futures are resolved after release) and never held while
    # taking _send_lock. _send_lock serialises every use of the DEALER socket (zmq sockets are
    # not thread-safe) and guards _sockets_closed. _close_lock makes close idempotent.
    # _failure goes None -> exception once; after that no stream or call is registered. The
    # receiver thread alone reads the PULL socket, until close() has joined it.

    def __init__(
        self,
        *,
        _ctx: zmq.Context[zmq.Socket[bytes]],
        _dealer: zmq.Socket[bytes],
        _pull: zmq.Socket[bytes],
        _address: str,
        _welcome: _wire.WelcomeMsg,
        _launched: Launched | None,
        _heartbeat: tuple[float, float] | None,
        _ordered_events: bool,
    ) -> None:
        self._ctx = _ctx
        self._dealer = _dealer
        self._pull = _pull
        self._address = _address
        self._launched = _launched
        self._pid = _welcome.pid
        self._engine_name = _welcome.engine
        self._heartbeat = _heartbeat
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        self._calls: dict[int, tuple[concurrent.futures.Future[Any] | _Waiter, str]] = {}
        self._call_ids = _common.new_call_ids()
        self._failure: BaseException | None = None
        self._closing = False
        self._close_lock = threading.Lock()
        self._closed_done = False
        self._sockets_closed = False
        self._fatal: str | None = None
        self._terminal = threading.Event()  # a Shutdown or Fatal event has arrived
        self._over = threading.Event()  # _terminal is set, or _failure is
        # The ordered event stream: the receiver thread puts one list per frame (or the
        # final _End); get_event() moves a list into _event_buf, under _event_lock, and
        # pops single events from it, so a frame costs one queue hand-off, not one per event.
        self._events: queue.SimpleQueue[Any] | None = (
            queue.SimpleQueue() if _ordered_events else None
        )
        self._event_buf: collections.deque[Any] = collections.deque()
        self._event_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        self._rx = threading.Thread(target=self._rx_main, name="enginecore-client", daemon=True)
        self._rx.start()

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
    ) -> StageClient:
        """Start a stage process running ``factory(**kwargs)`` and return its client.

        *factory* is an import string ``"pkg.module:callable"``, resolved in the child (a
        fresh interpreter, multiprocessing *spawn*); *kwargs* must be wire-encodable. With
        *ordered_events*, every event is also kept for :meth:`events` / :meth:`get_event`.

        Blocks until the stage is ready, at most *startup_timeout* seconds. Raises
        :class:`~enginecore.stage.StageStartupError` (with the child's traceback if the
        factory raised) if it does not come up; no process or socket file is left behind.
        """
        launched = launch_process(factory, kwargs, startup_timeout, name)
        try:
            return cls._open(
                launched.input_address,
                timeout=startup_timeout,
                launched=launched,
                heartbeat=None,
                ordered_events=ordered_events,
            )
        except BaseException as exc:
            launched.kill_and_clean()
            if isinstance(exc, Exception) and not isinstance(exc, StageStartupError):
                raise StageStartupError(f"handshake with stage {factory!r} failed: {exc}") from exc
            raise

    @classmethod
    def connect(
        cls,
        address: str,
        *,
        timeout: float = 10.0,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
        ordered_events: bool = False,
    ) -> StageClient:
        """Attach to a headless stage (``python -m enginecore serve``) at *address*.

        Blocks for the handshake, at most *timeout* seconds (:class:`TimeoutError`);
        :class:`~enginecore.stage.ProtocolError` if the stage rejects this client. The client
        pings every *heartbeat_interval* seconds and declares the stage dead
        (:class:`~enginecore.stage.EngineDeadError`) after *heartbeat_timeout* seconds without
        hearing from it. :meth:`close` detaches; :meth:`shutdown` stops the stage.
        """
        if heartbeat_interval <= 0 or heartbeat_timeout <= heartbeat_interval:
            raise ValueError("need 0 < heartbeat_interval < heartbeat_timeout")
        return cls._open(
            address,
            timeout=timeout,
            launched=None,
            heartbeat=(heartbeat_interval, heartbeat_timeout),
            ordered_events=ordered_events,
        )

    @classmethod
    def _open(
        cls,
        address: str,
        *,
        timeout: float,
        launched: Launched | None,
        heartbeat: tuple[float, float] | None,
        ordered_events: bool,
    ) -> StageClient:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        dealer = pull = None
        try:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.SNDHWM, 0)  # add() never blocks; death is detected elsewhere
            dealer.connect(address)
            dealer.send(_common.HELLO_FRAME)
            poller = zmq.Poller()
            poller.register(dealer, zmq.POLLIN)
            if launched is not None:
                poller.register(launched.process.sentinel, zmq.POLLIN)
            if not poller.poll(round(timeout * 1000)):
                raise TimeoutError(f"no handshake reply from the stage at {address} in {timeout} s")
            if launched is not None and not dealer.poll(0):
                raise StageStartupError("the stage process exited during the handshake")
            welcome = _common.parse_welcome(dealer.recv(), address)
            pull = ctx.socket(zmq.PULL)
            pull.setsockopt(zmq.LINGER, 0)
            pull.connect(_common.output_address_for(address, welcome.output))
        except BaseException:
            for sock in (dealer, pull):
                if sock is not None:
                    sock.close(linger=0)
            ctx.term()
            raise
        return cls(
            _ctx=ctx,
            _dealer=dealer,
            _pull=pull,
            _address=address,
            _welcome=welcome,
            _launched=launched,
            _heartbeat=heartbeat,
            _ordered_events=ordered_events,
        )

    # -- properties --------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        """The stage process's pid (as the stage reported it). Never blocks."""
        return self._pid

    @property
    def address(self) -> str:
        """The stage's input address. Never blocks."""
        return self._address

    @property
    def exit_code(self) -> int | None:
        """A launched stage's exit code once it has exited (``-N``: signal ``N``), else
        ``None``; always ``None`` for a connected stage. Never blocks."""
        if self._launched is None:
            return None
        return self._launched.reap()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` / :meth:`shutdown` has been called. Never blocks."""
        return self._closing

    # -- requests ----------------------------------------------------------------------------

    def add(self, req_id: str, data: Any) -> RequestStream:
        """Send request *req_id* with *data*; return the stream of its outputs.

        Raises :class:`TypeError` (before sending) if *data* is not wire-encodable,
        :class:`ValueError` if *req_id* is still live in this client, else the client's
        failure (:class:`~enginecore.stage.EngineDeadError` /
        :class:`~enginecore.stage.StageClosedError`). Never blocks; thread-safe.
        """
        frame = _common.build_add(req_id, data)
        stream = RequestStream(req_id)
        with self._lock:
            self._raise_if_failed()
            if req_id in self._streams:
                raise ValueError(f"request {req_id!r} is still live in this client")
            # Registered before sending: its first output can arrive right after.
            self._streams[req_id] = stream
        try:
            self._send(frame)
        except BaseException:
            with self._lock:
                self._streams.pop(req_id, None)
            raise
        return stream

    def abort(self, req_ids: Sequence[str]) -> None:
        """Ask the stage to abort *req_ids* (unknown ids are ignored).

        Their streams stop once the stage has applied the abort; no output of theirs follows.
        Raises :class:`TypeError` for a bare ``str``. Never blocks; thread-safe.
        """
        _, frame = _common.build_abort(req_ids)
        with self._lock:
            self._raise_if_failed()
        self._send(frame)

    # -- utilities ---------------------------------------------------------------------------

    def call_utility_future(self, name: str, /, *args: Any) -> concurrent.futures.Future[Any]:
        """Start ``engine.utility(name, args)`` in the stage; return a future of its result.

        The future fails with :class:`~enginecore.stage.UtilityError` if the utility raised,
        and with the client's failure if the stage dies or the client is closed first. Many
        calls may be in flight. Raises :class:`TypeError` (before sending) if *args* are not
        wire-encodable. Never blocks; thread-safe.
        """
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        call_id = self._register_call(name, args, future)
        future.add_done_callback(lambda f: self._forget_call(call_id) if f.cancelled() else None)
        return future

    def _register_call(
        self, name: str, args: tuple[Any, ...], waiter: concurrent.futures.Future[Any] | _Waiter
    ) -> int:
        """Check, register and send one call; return its id. *waiter* gets the answer."""
        with self._lock:
            self._raise_if_failed()
            call_id = next(self._call_ids)
        frame = _common.build_utility(call_id, name, args)
        with self._lock:
            self._raise_if_failed()
            self._calls[call_id] = (waiter, name)
        try:
            self._send(frame)
        except BaseException:
            with self._lock:
                self._calls.pop(call_id, None)
            raise
        return call_id

    def call_utility(self, name: str, /, *args: Any, timeout: float | None = None) -> Any:
        """Call ``engine.utility(name, args)`` in the stage and return its result. Blocks.

        Raises :class:`~enginecore.stage.UtilityError` (remote ``repr`` inside) if it raised,
        :class:`TimeoutError` after *timeout* seconds (the late answer is then dropped),
        :class:`~enginecore.stage.EngineDeadError` / :class:`~enginecore.stage.StageClosedError`
        if the stage dies or the client is closed. Thread-safe.
        """
        waiter = _Waiter()
        call_id = self._register_call(name, args, waiter)
        if not waiter.lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            self._forget_call(call_id)
            raise TimeoutError(f"utility {name!r} did not answer within {timeout} s")
        if waiter.exc is not None:
            raise waiter.exc
        return waiter.result

    def _forget_call(self, call_id: int) -> None:
        with self._lock:
            self._calls.pop(call_id, None)

    # -- the event stream --------------------------------------------------------------------

    def get_event(self, timeout: float | None = None) -> StageEvent:
        """The next event of the stage, in the stage's order (needs ``ordered_events=True``).

        Blocks up to *timeout* seconds (:class:`TimeoutError`). After the last event: raises
        :class:`StopIteration` if this client shut the stage down, else the client's failure.
        Thread-safe, but events are not duplicated: one consumer sees each event.
        """
        buf = self._event_buf
        if buf:
            try:
                return buf.popleft()  # type: ignore[no-any-return]
            except IndexError:  # another consumer took the last one
                pass
        return self._get_event_slow(timeout)

    def _get_event_slow(self, timeout: float | None) -> StageEvent:
        events = self._events
        if events is None:
            raise RuntimeError(
                "the event stream is off; create the client with ordered_events=True"
            )
        if timeout is not None and timeout < 0:
            raise ValueError("'timeout' must be a non-negative number")
        deadline = None if timeout is None else time.monotonic() + timeout
        # One refilling consumer at a time: the buffer then always holds a run of
        # consecutive events, so every consumer sees its events in the stage's order.
        if not self._event_lock.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError(f"no stage event within {timeout} s")
        try:
            buf = self._event_buf
            while True:
                try:
                    return buf.popleft()  # type: ignore[no-any-return]
                except IndexError:
                    pass
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    item = events.get(timeout=left)
                except queue.Empty:
                    raise TimeoutError(f"no stage event within {timeout} s") from None
                if type(item) is _End:
                    events.put(item)  # sticky: every later call ends the same way
                    if item.exc is not None:
                        raise item.exc
                    raise StopIteration
                buf.extend(item)
        finally:
            self._event_lock.release()

    def events(self) -> Iterator[StageEvent]:
        """Iterate over :meth:`get_event` until the stream ends. Blocks between events."""
        while True:
            try:
                event = self.get_event()
            except StopIteration:
                return
            yield event

    # -- closing -----------------------------------------------------------------------------

    def shutdown(self, timeout: float = 5.0) -> int | None:
        """Stop the stage and release everything; return its exit code (``None`` if unknown).

        Graceful first: a shutdown message, then up to *timeout* seconds for the stage to end
        (pending work is dropped); a launched stage that is still alive gets SIGTERM, one more
        second, then SIGKILL. Pending calls and iterators then raise
        :class:`~enginecore.stage.StageClosedError` (or keep the
        :class:`~enginecore.stage.EngineDeadError` they already had). Blocks; thread-safe;
        idempotent. Called from a future's done-callback (the client's receiver thread), it
        cannot wait there: it starts the close in the background and returns ``None``.
        """
        return self._close(stop_stage=True, timeout=timeout)

    def close(self) -> None:
        """Release this client. A launched stage is shut down (as :meth:`shutdown`); a
        connected stage is only detached from and keeps running. Blocks; idempotent."""
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

    def _close(self, *, stop_stage: bool, timeout: float) -> int | None:
        if threading.current_thread() is self._rx:
            # Called from a future's done-callback, which runs on the receiver thread: closing
            # joins that thread, so it cannot happen here. Finish it on another thread; a
            # later close() waits for it (_close_lock), and waiters are woken as usual.
            with self._lock:
                self._closing = True
            threading.Thread(
                target=self._close,
                kwargs={"stop_stage": stop_stage, "timeout": timeout},
                name="enginecore-client-close",
                daemon=True,
            ).start()
            return None
        with self._close_lock:  # a second caller waits for the first, then returns
            if self._closed_done:
                return self.exit_code
            with self._lock:
                self._closing = True
                alive = self._failure is None
            launched = self._launched
            if alive:
                with contextlib.suppress(zmq.ZMQError):
                    self._send_raw(_common.SHUTDOWN_FRAME if stop_stage else _common.BYE_FRAME)
            if launched is not None:
                if not launched.wait_exit(timeout):
                    logger.warning("enginecore: stage %s ignored shutdown; SIGTERM", self._pid)
                    launched.send_signal(signal.SIGTERM)
                if not launched.wait_exit(1.0):
                    logger.warning("enginecore: stage %s ignored SIGTERM; SIGKILL", self._pid)
                    launched.send_signal(signal.SIGKILL)
                    launched.wait_exit(None)
                launched.reap()
            elif stop_stage and alive:
                self._over.wait(timeout)
            os.write(self._wake_w, b"x")
            self._rx.join()
            self._fail(StageClosedError("this stage client is closed"))
            with self._send_lock:
                self._sockets_closed = True
                # A bye or shutdown to a live stage deserves a moment to leave the queue.
                self._dealer.close(linger=500 if alive else 0)
            self._pull.close(linger=0)
            self._ctx.term()
            os.close(self._wake_r)
            os.close(self._wake_w)
            if launched is not None:
                launched.release()
            self._closed_done = True
            return self.exit_code

    # -- internals ---------------------------------------------------------------------------

    def _raise_if_failed(self) -> None:
        # Called with _lock held.
        if self._failure is not None:
            raise self._failure
        if self._closing:
            raise StageClosedError("this stage client is closed")

    def _send(self, frame: bytes) -> None:
        with self._send_lock:
            if self._sockets_closed:
                raise StageClosedError("this stage client is closed")
            self._dealer.send(frame)

    def _send_raw(self, frame: bytes) -> None:
        with self._send_lock:
            if not self._sockets_closed:
                self._dealer.send(frame)

    def _fail(self, exc: BaseException) -> None:
        """Set the client's failure once and hand it to every waiter. Never blocks long."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = exc
            self._over.set()
            streams = list(self._streams.values())
            self._streams.clear()
            calls = list(self._calls.values())
            self._calls.clear()
        end = _End(exc)
        for stream in streams:
            stream._q.put(end)
        for future, _ in calls:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                future.set_exception(exc)
        if self._events is not None:
            # A clean end of the event stream when we shut the stage down ourselves.
            clean = isinstance(exc, StageClosedError) and self._terminal.is_set()
            self._events.put(_End(None if clean else exc))

    def _rx_main(self) -> None:
        try:
            self._rx_loop()
        except BaseException as exc:
            logger.exception("enginecore: the stage client's receiver thread failed")
            err = EngineDeadError(f"the stage client's receiver thread failed: {exc!r}")
            err.__cause__ = exc
            self._fail(err)

    def _rx_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        sentinel = self._launched.process.sentinel if self._launched is not None else None
        if sentinel is not None:
            poller.register(sentinel, zmq.POLLIN)
        heartbeat = self._heartbeat
        ping_seq = itertools.count()
        now = time.monotonic()
        last_heard = now
        next_ping = now
        exit_deadline: float | None = None  # set when a launched stage sent its last event
        while True:
            timeout_ms: int | None = None
            if exit_deadline is not None:
                timeout_ms = max(0, round((exit_deadline - time.monotonic()) * 1000))
            if heartbeat is not None:
                now = time.monotonic()
                if now >= next_ping:
                    with contextlib.suppress(zmq.ZMQError, StageClosedError):
                        self._send(_common.ping_frame(next(ping_seq)))
                    next_ping = now + heartbeat[0]
                wake_at = min(next_ping, last_heard + heartbeat[1])
                timeout_ms = max(0, round((wake_at - now) * 1000))
            ready = dict(poller.poll(timeout_ms))
            if self._pull in ready:
                last_heard = time.monotonic()
                if self._drain():
                    if self._failure is not None:
                        return
                    if exit_deadline is None:
                        exit_deadline = last_heard + _EXIT_AFTER_LAST_EVENT_S
            if self._wake_r in ready:
                return
            if sentinel is not None and sentinel in ready:
                self._on_process_exit()
                return
            if exit_deadline is not None and time.monotonic() >= exit_deadline:
                # The loop is over but the process lingers (an engine thread that keeps the
                # interpreter alive, say). Nothing more will be answered: fail the waiters now.
                self._fail(
                    _common.end_error(
                        self._closing,
                        pid=self._pid,
                        exit_code=None,
                        fatal=self._fatal,
                        remote_shutdown=True,
                        reason="its engine loop ended, but the process has not exited",
                    )
                )
                return
            if heartbeat is not None and time.monotonic() - last_heard > heartbeat[1]:
                self._fail(
                    _common.dead_error(
                        pid=self._pid,
                        exit_code=None,
                        fatal=None,
                        reason=(
                            f"no heartbeat from {self._address} for {heartbeat[1]} s; presumed dead"
                        ),
                    )
                )
                return

    def _on_process_exit(self) -> None:
        # The last frames may still be on their way: read until the terminal event, or
        # until the socket has been quiet for a moment.
        deadline = time.monotonic() + _EXIT_GRACE_S
        while not self._terminal.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or not self._pull.poll(round(left * 1000)):
                break
            self._drain()
        assert self._launched is not None
        exit_code = self._launched.reap()
        self._fail(
            _common.end_error(
                self._closing,
                pid=self._pid,
                exit_code=exit_code,
                fatal=self._fatal,
                remote_shutdown=self._terminal.is_set(),
            )
        )

    def _drain(self) -> bool:
        """Read every frame waiting and dispatch it. Returns whether a terminal event came."""
        pull = self._pull
        terminal = False
        while True:
            try:
                frame = pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return terminal
            try:
                batch = _wire.event_batch_decoder.decode(frame)
            except msgspec.DecodeError as exc:
                err = EngineDeadError(f"the stage sent an invalid frame: {exc}")
                err.__cause__ = exc
                self._fail(err)
                return True
            if self._dispatch(batch):
                terminal = True

    def _dispatch(self, batch: list[Any]) -> bool:
        terminal = False
        resolve: list[
            tuple[concurrent.futures.Future[Any] | _Waiter, Any, BaseException | None]
        ] = []
        events = self._events
        pongs = False
        with self._lock:
            streams = self._streams
            for ev in batch:
                cls = ev.__class__
                if cls is Output:
                    rid = ev.req_id
                    stream = streams.get(rid)  # None for an unrouted output
                    if stream is not None:
                        stream._q.put(ev.payload)
                        if ev.finished:
                            stream._q.put(_FINISHED)
                            del streams[rid]
                elif cls is UtilityResult:
                    entry = self._calls.pop(ev.call_id, None)
                    if entry is not None:
                        future, name = entry
                        if ev.error is None:
                            resolve.append((future, ev.result, None))
                        else:
                            resolve.append((future, None, UtilityError(name, ev.error)))
                elif cls is Aborted:
                    for rid in ev.req_ids:
                        stream = streams.pop(rid, None)
                        if stream is not None:
                            stream._q.put(_ABORTED)
                elif cls is ErrorReport:
                    self._on_error_report(ev)
                elif cls is Pong:
                    pongs = True
                elif cls is Fatal or cls is Shutdown:
                    if cls is Fatal:
                        self._fatal = ev.message
                    terminal = True
            if events is not None:
                if pongs:  # answers to our heartbeats, not stage events
                    batch = [ev for ev in batch if ev.__class__ is not Pong]
                if batch:
                    events.put(batch)
        for future, result, exc in resolve:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                if exc is None:
                    future.set_result(result)
                else:
                    future.set_exception(exc)
        if terminal:
            self._terminal.set()
            self._over.set()
            if self._launched is None:
                # No process to watch: the terminal event is the end.
                self._fail(
                    _common.end_error(
                        self._closing,
                        pid=self._pid,
                        exit_code=None,
                        fatal=self._fatal,
                        remote_shutdown=self._fatal is None,
                        reason=None if self._fatal is None else "its engine loop died",
                    )
                )
        return terminal

    def _on_error_report(self, ev: ErrorReport) -> None:
        # Called with _lock held.
        if ev.req_id is None:
            logger.warning("enginecore: the stage reported a protocol error: %s", ev.message)
            return
        stream = self._streams.pop(ev.req_id, None)
        if stream is not None:
            stream._q.put(_End(RequestError(ev.req_id, ev.message)))
        else:
            logger.warning("enginecore: the stage reported: request %r: %s", ev.req_id, ev.message)
