"""AsyncStageClient: the asyncio client of a stage process, on ``zmq.asyncio``."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import signal
import time
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Any, Final

import msgspec
import zmq
import zmq.asyncio

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

__all__ = ["AsyncRequestStream", "AsyncStageClient"]

logger = logging.getLogger("enginecore.stage")

_EXIT_GRACE_S: Final = 0.3
_EXIT_AFTER_LAST_EVENT_S: Final = 1.0


class _End:
    __slots__ = ("aborted", "exc")

    def __init__(self, exc: BaseException | None, aborted: bool = False) -> None:
        self.exc = exc
        self.aborted = aborted


_FINISHED: Final = _End(None)
_ABORTED: Final = _End(None, aborted=True)


class AsyncRequestStream(AsyncIterator[Any]):
    """The outputs of one request as an async iterator; returned by
    :meth:`AsyncStageClient.add`. Same semantics as :class:`~enginecore.stage.RequestStream`:
    it stops after the finished output or an applied abort (:attr:`aborted`), and raises
    :class:`~enginecore.stage.RequestError`, :class:`~enginecore.stage.EngineDeadError` or
    :class:`~enginecore.stage.StageClosedError`. Use it on the client's event loop only.
    """

    def __init__(self, req_id: str) -> None:
        self.req_id: Final = req_id
        """The request's id."""
        self._q: asyncio.Queue[Any] = asyncio.Queue()
        self._end: _End | None = None

    @property
    def finished(self) -> bool:
        """Whether iteration has reached the request's finished output. Never blocks."""
        return self._end is _FINISHED

    @property
    def aborted(self) -> bool:
        """Whether iteration stopped because the request was aborted. Never blocks."""
        return self._end is _ABORTED

    def __aiter__(self) -> AsyncRequestStream:
        return self

    async def __anext__(self) -> Any:
        return await self.get()

    async def get(self, timeout: float | None = None) -> Any:
        """The next payload; waits up to *timeout* seconds (:class:`TimeoutError`).

        Raises :class:`StopAsyncIteration` once the stream has ended normally.
        """
        end = self._end
        if end is None:
            try:
                item = await asyncio.wait_for(self._q.get(), timeout)
            except asyncio.TimeoutError:
                raise TimeoutError(
                    f"no output for request {self.req_id!r} within {timeout} s"
                ) from None
            if type(item) is not _End:
                return item
            self._end = end = item
        if end.exc is not None:
            raise end.exc
        raise StopAsyncIteration

    async def collect(self, timeout: float | None = None) -> list[Any]:
        """All remaining payloads until the stream ends; *timeout* bounds the whole wait."""
        out: list[Any] = []

        async def run() -> None:
            async for item in self:
                out.append(item)

        try:
            await asyncio.wait_for(run(), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"request {self.req_id!r} did not end within {timeout} s") from None
        return out


class AsyncStageClient:
    """The asyncio twin of :class:`~enginecore.stage.StageClient`, on ``zmq.asyncio``.

    Same abilities and error semantics; coroutines instead of blocking calls. Not
    thread-safe: use it from the event loop that created it. A background task reads the
    stage's events; a launched stage's death is seen through its process sentinel (an event
    loop reader), a connected stage's through heartbeats. Use ``async with``.
    """

    def __init__(
        self,
        *,
        _ctx: zmq.asyncio.Context,
        _dealer: zmq.asyncio.Socket,
        _pull: zmq.asyncio.Socket,
        _address: str,
        _welcome: _wire.WelcomeMsg,
        _launched: Launched | None,
        _heartbeat: tuple[float, float] | None,
        _ordered_events: bool,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._ctx = _ctx
        self._dealer = _dealer
        self._pull = _pull
        self._address = _address
        self._pid = _welcome.pid
        self._launched = _launched
        self._heartbeat = _heartbeat
        self._streams: dict[str, AsyncRequestStream] = {}
        self._calls: dict[int, tuple[asyncio.Future[Any], str]] = {}
        self._call_ids = _common.new_call_ids()
        self._failure: BaseException | None = None
        self._closing = False
        self._closed_done = False
        self._close_lock = asyncio.Lock()
        self._fatal: str | None = None
        self._terminal = asyncio.Event()
        self._exited = asyncio.Event()
        self._events: asyncio.Queue[Any] | None = asyncio.Queue() if _ordered_events else None
        self._last_heard = time.monotonic()
        self._tasks: list[asyncio.Task[None]] = [
            asyncio.ensure_future(self._rx_main()),
        ]
        if _heartbeat is not None:
            self._tasks.append(asyncio.ensure_future(self._heartbeat_main(*_heartbeat)))
        if _launched is not None:
            self._loop.add_reader(_launched.process.sentinel, self._on_sentinel)

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
    ) -> AsyncStageClient:
        """Start a stage process running ``factory(**kwargs)``; see
        :meth:`StageClient.launch <enginecore.stage.StageClient.launch>`. The blocking part
        of the start runs in a worker thread; cancelling this coroutine kills the stage."""
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(None, launch_process, factory, kwargs, startup_timeout, name)
        try:
            launched = await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(_kill_if_launched)
            raise
        try:
            return await cls._open(
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
    async def connect(
        cls,
        address: str,
        *,
        timeout: float = 10.0,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
        ordered_events: bool = False,
    ) -> AsyncStageClient:
        """Attach to a headless stage; see
        :meth:`StageClient.connect <enginecore.stage.StageClient.connect>`."""
        if heartbeat_interval <= 0 or heartbeat_timeout <= heartbeat_interval:
            raise ValueError("need 0 < heartbeat_interval < heartbeat_timeout")
        return await cls._open(
            address,
            timeout=timeout,
            launched=None,
            heartbeat=(heartbeat_interval, heartbeat_timeout),
            ordered_events=ordered_events,
        )

    @classmethod
    async def _open(
        cls,
        address: str,
        *,
        timeout: float,
        launched: Launched | None,
        heartbeat: tuple[float, float] | None,
        ordered_events: bool,
    ) -> AsyncStageClient:
        loop = asyncio.get_running_loop()
        ctx = zmq.asyncio.Context()
        dealer = pull = None
        exited: asyncio.Future[bytes] = loop.create_future()

        def on_exit() -> None:
            if not exited.done():
                exited.set_result(b"")

        if launched is not None:
            loop.add_reader(launched.process.sentinel, on_exit)
        try:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.SNDHWM, 0)
            dealer.connect(address)
            await dealer.send(_common.HELLO_FRAME)
            recv: asyncio.Future[bytes] = asyncio.ensure_future(dealer.recv())
            done, _ = await asyncio.wait(
                {recv, exited}, timeout=timeout, return_when="FIRST_COMPLETED"
            )
            if recv not in done:
                recv.cancel()
                with contextlib.suppress(asyncio.CancelledError, zmq.ZMQError):
                    await recv
                if exited in done:
                    raise StageStartupError("the stage process exited during the handshake")
                raise TimeoutError(f"no handshake reply from the stage at {address} in {timeout} s")
            welcome = _common.parse_welcome(recv.result(), address)
            pull = ctx.socket(zmq.PULL)
            pull.setsockopt(zmq.LINGER, 0)
            pull.connect(_common.output_address_for(address, welcome.output))
        except BaseException:
            for sock in (dealer, pull):
                if sock is not None:
                    sock.close(linger=0)
            ctx.term()
            raise
        finally:
            if launched is not None:
                loop.remove_reader(launched.process.sentinel)
            if not exited.done():
                exited.cancel()
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
        """The stage process's pid. Never blocks."""
        return self._pid

    @property
    def address(self) -> str:
        """The stage's input address. Never blocks."""
        return self._address

    @property
    def exit_code(self) -> int | None:
        """A launched stage's exit code once it has exited, else ``None``. Never blocks."""
        return None if self._launched is None else self._launched.reap()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` / :meth:`shutdown` has been called. Never blocks."""
        return self._closing

    # -- requests ----------------------------------------------------------------------------

    async def add(self, req_id: str, data: Any) -> AsyncRequestStream:
        """Send request *req_id*; return the async stream of its outputs. Errors as
        :meth:`StageClient.add <enginecore.stage.StageClient.add>`."""
        frame = _common.build_add(req_id, data)
        self._raise_if_failed()
        if req_id in self._streams:
            raise ValueError(f"request {req_id!r} is still live in this client")
        stream = AsyncRequestStream(req_id)
        self._streams[req_id] = stream
        try:
            await self._send(frame)
        except BaseException:
            self._streams.pop(req_id, None)
            raise
        return stream

    async def abort(self, req_ids: Sequence[str]) -> None:
        """Ask the stage to abort *req_ids*; their streams stop once it is applied."""
        _, frame = _common.build_abort(req_ids)
        self._raise_if_failed()
        await self._send(frame)

    async def call_utility(self, name: str, /, *args: Any, timeout: float | None = None) -> Any:
        """Call ``engine.utility(name, args)`` in the stage and return its result.

        Raises :class:`~enginecore.stage.UtilityError`, :class:`TimeoutError`,
        :class:`~enginecore.stage.EngineDeadError` or
        :class:`~enginecore.stage.StageClosedError`, as the blocking client does. Many calls
        may be in flight (``asyncio.gather``). Cancelling the coroutine drops the answer.
        """
        self._raise_if_failed()
        call_id = next(self._call_ids)
        frame = _common.build_utility(call_id, name, args)
        future: asyncio.Future[Any] = self._loop.create_future()
        self._calls[call_id] = (future, name)
        try:
            await self._send(frame)
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"utility {name!r} did not answer within {timeout} s") from None
        finally:
            self._calls.pop(call_id, None)

    # -- the event stream --------------------------------------------------------------------

    async def get_event(self, timeout: float | None = None) -> StageEvent:
        """The next stage event, in order (needs ``ordered_events=True``); see
        :meth:`StageClient.get_event <enginecore.stage.StageClient.get_event>`. Raises
        :class:`StopAsyncIteration` after the last event of a stage this client shut down."""
        events = self._events
        if events is None:
            raise RuntimeError(
                "the event stream is off; create the client with ordered_events=True"
            )
        try:
            item = await asyncio.wait_for(events.get(), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no stage event within {timeout} s") from None
        if type(item) is _End:
            events.put_nowait(item)
            if item.exc is not None:
                raise item.exc
            raise StopAsyncIteration
        return item  # type: ignore[no-any-return]

    async def events(self) -> AsyncIterator[StageEvent]:
        """Iterate over :meth:`get_event` until the stream ends."""
        while True:
            try:
                event = await self.get_event()
            except StopAsyncIteration:
                return
            yield event

    # -- closing -----------------------------------------------------------------------------

    async def shutdown(self, timeout: float = 5.0) -> int | None:
        """Stop the stage (graceful, then SIGTERM, then SIGKILL for a launched stage) and
        release everything; return its exit code. Idempotent; see
        :meth:`StageClient.shutdown <enginecore.stage.StageClient.shutdown>`."""
        return await self._close(stop_stage=True, timeout=timeout)

    async def close(self) -> None:
        """Release this client: a launched stage is shut down, a connected one detached."""
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

    async def _close(self, *, stop_stage: bool, timeout: float) -> int | None:
        async with self._close_lock:
            if self._closed_done:
                return self.exit_code
            self._closing = True
            alive = self._failure is None
            if alive:
                with contextlib.suppress(zmq.ZMQError):
                    await self._dealer.send(
                        _common.SHUTDOWN_FRAME if stop_stage else _common.BYE_FRAME
                    )
            launched = self._launched
            if launched is not None:
                if not await self._wait_exit(timeout):
                    logger.warning("enginecore: stage %s ignored shutdown; SIGTERM", self._pid)
                    launched.send_signal(signal.SIGTERM)
                if not await self._wait_exit(1.0):
                    logger.warning("enginecore: stage %s ignored SIGTERM; SIGKILL", self._pid)
                    launched.send_signal(signal.SIGKILL)
                    await self._wait_exit(None)
                self._loop.remove_reader(launched.process.sentinel)
                launched.reap()
            elif stop_stage and alive:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._terminal.wait(), timeout)
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self._fail(StageClosedError("this stage client is closed"))
            self._dealer.close(linger=500 if alive else 0)
            self._pull.close(linger=0)
            self._ctx.term()
            if launched is not None:
                launched.release()
            self._closed_done = True
            return self.exit_code

    async def _wait_exit(self, timeout: float | None) -> bool:
        try:
            await asyncio.wait_for(self._exited.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    # -- internals ---------------------------------------------------------------------------

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closing:
            raise StageClosedError("this stage client is closed")

    async def _send(self, frame: bytes) -> None:
        if self._closed_done:
            raise StageClosedError("this stage client is closed")
        await self._dealer.send(frame)

    def _fail(self, exc: BaseException) -> None:
        if self._failure is not None:
            return
        self._failure = exc
        streams = list(self._streams.values())
        self._streams.clear()
        calls = list(self._calls.values())
        self._calls.clear()
        end = _End(exc)
        for stream in streams:
            stream._q.put_nowait(end)
        for future, _ in calls:
            if not future.done():
                future.set_exception(exc)
        if self._events is not None:
            clean = isinstance(exc, StageClosedError) and self._terminal.is_set()
            self._events.put_nowait(_End(None if clean else exc))

    async def _rx_main(self) -> None:
        try:
            while True:
                frame = await self._pull.recv()
                self._last_heard = time.monotonic()
                try:
                    batch = _wire.event_batch_decoder.decode(frame)
                except msgspec.DecodeError as exc:
                    err = EngineDeadError(f"the stage sent an invalid frame: {exc}")
                    err.__cause__ = exc
                    self._fail(err)
                    return
                self._dispatch(batch)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            logger.exception("enginecore: the stage client's receiver task failed")
            err = EngineDeadError(f"the stage client's receiver task failed: {exc!r}")
            err.__cause__ = exc
            self._fail(err)

    async def _heartbeat_main(self, interval: float, timeout: float) -> None:
        for seq in itertools.count():
            with contextlib.suppress(zmq.ZMQError):
                await self._dealer.send(_common.ping_frame(seq))
            await asyncio.sleep(interval)
            if self._failure is not None:
                return
            if time.monotonic() - self._last_heard > timeout:
                self._fail(
                    _common.dead_error(
                        pid=self._pid,
                        exit_code=None,
                        fatal=None,
                        reason=f"no heartbeat from {self._address} for {timeout} s; presumed dead",
                    )
                )
                return

    def _on_sentinel(self) -> None:
        assert self._launched is not None
        self._loop.remove_reader(self._launched.process.sentinel)
        self._exited.set()
        self._tasks.append(asyncio.ensure_future(self._on_process_exit()))

    async def _on_process_exit(self) -> None:
        # Frames may still be in flight; the receiver task keeps reading meanwhile.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._terminal.wait(), _EXIT_GRACE_S)
        assert self._launched is not None
        exit_code = self._launched.reap()  # the sentinel fired: the process has exited
        self._fail(
            _common.end_error(
                self._closing,
                pid=self._pid,
                exit_code=exit_code,
                fatal=self._fatal,
                remote_shutdown=self._terminal.is_set(),
            )
        )

    async def _expect_exit(self) -> None:
        # After the last event the process should exit at once; if it lingers (an engine
        # thread keeping the interpreter alive, say), nothing more will be answered.
        if await self._wait_exit(_EXIT_AFTER_LAST_EVENT_S):
            return  # _on_sentinel takes it from here
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

    def _dispatch(self, batch: list[Any]) -> None:
        streams = self._streams
        events = self._events
        terminal = False
        for ev in batch:
            cls = ev.__class__
            if cls is Output:
                rid = ev.req_id
                stream = streams.get(rid) if rid is not None else None
                if stream is not None:
                    stream._q.put_nowait(ev.payload)
                    if ev.finished:
                        stream._q.put_nowait(_FINISHED)
                        del streams[rid]
            elif cls is UtilityResult:
                entry = self._calls.pop(ev.call_id, None)
                if entry is not None and not entry[0].done():
                    future, name = entry
                    if ev.error is None:
                        future.set_result(ev.result)
                    else:
                        future.set_exception(UtilityError(name, ev.error))
            elif cls is Aborted:
                for rid in ev.req_ids:
                    stream = streams.pop(rid, None)
                    if stream is not None:
                        stream._q.put_nowait(_ABORTED)
            elif cls is ErrorReport:
                if ev.req_id is None:
                    logger.warning(
                        "enginecore: the stage reported a protocol error: %s", ev.message
                    )
                else:
                    stream = streams.pop(ev.req_id, None)
                    if stream is not None:
                        stream._q.put_nowait(_End(RequestError(ev.req_id, ev.message)))
                    else:
                        logger.warning(
                            "enginecore: the stage reported: request %r: %s", ev.req_id, ev.message
                        )
            elif cls is Pong:
                continue
            elif cls is Fatal or cls is Shutdown:
                if cls is Fatal:
                    self._fatal = ev.message
                terminal = True
            if events is not None:
                events.put_nowait(ev)
        if terminal:
            self._terminal.set()
            if self._launched is not None:
                self._tasks.append(asyncio.ensure_future(self._expect_exit()))
            else:
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


def _kill_if_launched(fut: asyncio.Future[Launched]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        fut.result().kill_and_clean()
