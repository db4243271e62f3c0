"""The asyncio stage pipeline: :class:`AsyncPipeline` and :class:`AsyncPipelineStream`.

The twin of :class:`~._pipeline.Pipeline`, with coroutines, on one event loop: the same
coordinator (:mod:`._pipeline_core`) and the same shared operations
(:mod:`._pipelinebase`), over one :class:`~._aclient.AsyncStageClient` per stage. Each
stage's events go to the core from that client's event-loop reader
(``AsyncStageClient._event_sink``), as it appends them to its ordered event stream: no task
of the pipeline's own. Use it from the event loop that launched it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

from . import _aio, _clientbase
from ._aclient import AsyncRequestStream, AsyncStageClient
from ._edge import LINKS_UTILITY
from ._errors import StageStartupError
from ._pipeline_core import PipelineDeliveries, check_budget
from ._pipelinebase import (
    PIPE_FACTORY,
    LaunchLinks,
    PipelineBase,
    PipelineStage,
    check_drain,
    check_startup_timeout,
    check_timeout,
    launch_options,
    named_startup_error,
    order_clients,
    retry_counts,
    stage_specs,
)
from ._session import LoopLock
from ._statistics import StageStatistics

logger = logging.getLogger("enginecore.stage")

__all__ = ["AsyncPipeline", "AsyncPipelineStream"]


class AsyncPipelineStream(AsyncRequestStream):
    """The outputs of one request of an :class:`AsyncPipeline`: what
    :class:`~enginecore.stage.PipelineStream` is to a :class:`~enginecore.stage.Pipeline`,
    as an async iterator (``async for``, :meth:`get`, :meth:`collect`, :attr:`finished`,
    :attr:`aborted`, :attr:`timings`). Read it on the pipeline's event loop: a wait on
    another loop raises :class:`RuntimeError` (it would never be woken)."""

    __slots__ = ()


async def _grant(links: LaunchLinks, key: bytes) -> None:
    """Before a stage's process that links with *key* starts: the next stage (on TCP)
    admits it (:meth:`LaunchLinks.grant`)."""
    await _authorize(links.grant(key))


async def _authorize(grants: list[tuple[AsyncStageClient, list[bytes]]]) -> None:
    """Each stage of *grants* (on Ray, or local on TCP) admits its keys from now on, its
    owner's too (a key rotation); returns once each has. A local stage's answer comes on
    its death pipe, read on a worker thread (a round trip, while the loop runs on)."""
    from ._launch import Launched

    for target, keys in grants:
        launched = target._launched
        if isinstance(launched, Launched):
            await asyncio.to_thread(launched.authorize, keys)
        else:
            from .ray import grant_links_async

            await grant_links_async(target, keys)


class AsyncPipeline(PipelineBase[AsyncPipelineStream, AsyncStageClient]):
    """:class:`~enginecore.stage.Pipeline` for asyncio: the same abilities, errors and
    budget, with coroutines. Build one with ``await AsyncPipeline.launch(stages)``;
    :meth:`add`, :meth:`add_many`, :meth:`abort`, :meth:`call_utility`, :meth:`stats` and
    :meth:`shutdown` are coroutines, :meth:`health` and :attr:`in_flight` are not. An
    :meth:`add` without room in the budget awaits it (or raises
    :class:`~enginecore.stage.PipelineFullError`: ``wait=False``, or its *timeout*)."""

    def __init__(
        self,
        clients: Sequence[AsyncStageClient],
        names: Sequence[str],
        *,
        max_in_flight: int | None = None,
        max_bytes: int | None = None,
        shm_prefix: str | None = None,
        retry: Sequence[int] | None = None,
        replicas: Sequence[int] | None = None,
        specs: Sequence[PipelineStage] | None = None,
        startup_timeout: float = 60.0,
        link_keys: Mapping[tuple[int, int], bytes] | None = None,
    ) -> None:
        # Private: use launch().
        # The event loop it belongs to (its clients' readers run there): the one it is
        # launched on. Every coroutine, and its streams' waits, check that they run there
        # (_on_its_loop; the streams through their lock, a LoopLock).
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # built outside a loop (a test): no check
            self._loop = None
        self._streams_lock = LoopLock(self._loop, "AsyncPipeline")
        super().__init__(
            clients,
            names,
            max_in_flight,
            max_bytes,
            self._streams_lock,
            shm_prefix,
            retry,
            replicas,
            specs,
            startup_timeout,
            link_keys,
        )
        self._room_waiters: list[asyncio.Future[None]] = []
        self._closing: _clientbase.ClosingTask[None] = _clientbase.ClosingTask("the pipeline")
        # Restarts (PipelineStage(restart=...)): one task per process being restarted, one
        # start at a time; set when the pipeline closes, which ends every backoff.
        self._restart_tasks: set[asyncio.Task[None]] = set()
        self._restart_lock = asyncio.Lock()
        self._stopping = asyncio.Event()
        for k, stage_clients in enumerate(self._replicas):
            for r, client in enumerate(stage_clients):
                client._event_sink = functools.partial(self._take_events, k, r, client)
                self._take_events(k, r, client)  # anything that came before the sink was set

    @classmethod
    async def launch(
        cls,
        stages: Sequence[PipelineStage | str],
        *,
        max_in_flight: int | None = None,
        max_bytes: int | None = None,
        startup_timeout: float = 60.0,
    ) -> AsyncPipeline:
        """Start one stage process per item of *stages* (``replicas`` of them for a replica
        pool), as :meth:`Pipeline.launch <enginecore.stage.Pipeline.launch>` does, without
        blocking the event loop. If one fails to start (or the launch is cancelled), the
        ones started are shut down (a stage on Ray: its actor killed)."""
        specs = stage_specs(stages)
        check_budget(max_in_flight, max_bytes)
        check_startup_timeout(startup_timeout)
        clients: list[AsyncStageClient] = []
        links = LaunchLinks(specs, startup_timeout)
        try:
            for k, r in links.plan:
                kwargs, plan, key = links.process(k, r)
                if key is not None:
                    await _grant(links, key)
                if plan is None:
                    options = launch_options(specs, k, r)
                    try:
                        client = await AsyncStageClient._launch(
                            PIPE_FACTORY, kwargs, startup_timeout, True, options
                        )
                    except StageStartupError as exc:
                        raise named_startup_error(specs[k], r, exc) from None
                else:
                    from .ray import open_on_ray_async

                    grant = functools.partial(_grant, links)
                    try:
                        client = await open_on_ray_async(
                            plan, AsyncStageClient._open, ordered_events=True, grant=grant
                        )
                    except StageStartupError as exc:  # named as a local stage's is
                        raise named_startup_error(specs[k], r, exc) from None
                clients.append(client)
                links.started(k, r, client)
        except BaseException:
            for client in clients:
                with contextlib.suppress(Exception):
                    await client.shutdown()
            links.unlink()
            raise
        clients = order_clients(specs, clients)
        names = [s.name or s.factory for s in specs]
        return cls(
            clients,
            names,
            max_in_flight=max_in_flight,
            max_bytes=max_bytes,
            shm_prefix=links.prefix,
            retry=retry_counts(specs),
            replicas=[spec.replicas for spec in specs],
            specs=specs,
            startup_timeout=startup_timeout,
            link_keys=links.link_keys,
        )

    # -- requests ---------------------------------------------------------------------------

    async def add(
        self, req_id: str, data: Any, *, wait: bool = True, timeout: float | None = None
    ) -> AsyncPipelineStream:
        """Send request *req_id* with *data* to the first stage; return its stream. As
        :meth:`Pipeline.add <enginecore.stage.Pipeline.add>`: awaits room in the budget."""
        return (await self._admit([(req_id, data)], wait, timeout, many=False))[0]

    async def add_many(
        self,
        items: Iterable[tuple[str, Any]],
        *,
        wait: bool = True,
        timeout: float | None = None,
    ) -> list[AsyncPipelineStream]:
        """Send many requests to the first stage in one frame; return their streams. As
        :meth:`Pipeline.add_many <enginecore.stage.Pipeline.add_many>`."""
        return await self._admit(list(items), wait, timeout, many=True)

    def _on_its_loop(self) -> None:
        _clientbase.check_loop(self._loop, "AsyncPipeline")

    async def _admit(
        self, items: list[tuple[str, Any]], wait: bool, timeout: float | None, many: bool
    ) -> list[AsyncPipelineStream]:
        self._on_its_loop()
        if type(wait) is not bool:
            raise TypeError(f"wait must be a bool, got {type(wait).__name__}")
        if not items:
            self._check_open()  # refused as a client's once shut down, or failed
            self._core.check(())
            return []
        core = self._core
        ids, parts, nbytes = self._frame(items, many)
        deadline = _clientbase.deadline_after(timeout)
        while not self._check_open() and not core.admissible(ids, nbytes):
            if not wait:
                raise core.full_error(None)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise core.full_error(timeout)
            room = asyncio.get_running_loop().create_future()
            self._room_waiters.append(room)
            try:
                await asyncio.wait([room], timeout=left)
            finally:
                if not room.done():
                    room.cancel()
                    self._room_waiters.remove(room)
        now = time.monotonic()
        streams = [AsyncPipelineStream(rid, self._streams_lock, now) for rid in ids]
        failed = self._open_and_send(ids, streams, parts, nbytes, many, items)
        if failed is not None:
            self._failed_send(failed)
        return streams

    async def abort(self, req_ids: Sequence[str]) -> None:
        """Abort requests in every stage that holds them, as :meth:`Pipeline.abort
        <enginecore.stage.Pipeline.abort>`. Never waits."""
        self._on_its_loop()
        self._abort(req_ids)

    # -- stages ------------------------------------------------------------------------------

    async def call_utility(
        self,
        stage: str,
        name: str,
        /,
        *args: Any,
        timeout: float | None = None,
        replica: int | None = None,
    ) -> Any:
        """Call utility *name* of the stage named *stage*. A replica pool: with *replica*,
        that replica's answer; without, a list of every replica's answers, in order (the
        first error raises: the first in replica order, as :meth:`Pipeline.call_utility
        <enginecore.stage.Pipeline.call_utility>`'s, whichever came first; the replicas
        are asked at once, and the calls still pending then are cancelled)."""
        self._on_its_loop()
        clients, many = self._utility_clients(stage, replica)
        if not many:
            return await clients[0].call_utility(name, *args, timeout=timeout)
        calls = [
            asyncio.ensure_future(client.call_utility(name, *args, timeout=timeout))
            for client in clients
        ]
        try:
            return [await call for call in calls]  # in replica order: its first error
        finally:
            for call in calls:
                if not call.done():
                    call.cancel()  # a cancelled call's late answer is dropped
                elif not call.cancelled():
                    call.exception()  # retrieved: no "never retrieved" warning

    async def stats(self, timeout: float | None = 10.0) -> dict[str, StageStatistics | Exception]:
        """:meth:`Pipeline.stats <enginecore.stage.Pipeline.stats>`, awaited: every stage
        is asked at once, and a stage that failed to answer (dead, or not within
        *timeout* seconds) has its exception as its entry. :class:`ValueError` for a
        negative or NaN *timeout*, :class:`TypeError` for a non-number."""
        _clientbase.deadline_after(timeout)  # the call's error, not each stage's entry
        self._on_its_loop()
        self._check_shut_down()
        results = await asyncio.gather(
            *(client.stats(timeout) for client in self._clients), return_exceptions=True
        )
        out: dict[str, StageStatistics | Exception] = {}
        for name, result in zip(self._keys, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result  # a cancellation, or an exit: not the stage's answer
            out[name] = result
        return out

    # -- restarts ----------------------------------------------------------------------------

    def _schedule_restart(self, k: int, r: int, delay: float) -> None:
        if self._closed:
            return
        _aio.background(asyncio.get_running_loop(), self._restart(k, r, delay), self._restart_tasks)

    async def _restart(self, k: int, r: int, delay: float | None) -> None:
        """Task: :meth:`Pipeline._restart <enginecore.stage.Pipeline._restart>`'s, on the
        event loop. Cancelled before the process is up, it lets the cancel propagate, and:

        - unless the pipeline closes (a cancel of its shutdown's task, which waits for this
          one, is no failure), the process is failed, as after ``max_failures``, and an
          error says so (:meth:`_give_up_restart`): nothing would start it again, and it
          would read ``restarting`` for good, ``add`` refused while its stage had no live
          process;
        - the process it started is stopped: one not yet put in place is nobody's, and one
          put in place but not yet routable would never be routed to. Only one put in place
          as the pipeline closes is left to its shutdown, which stops it.

        An unexpected error in the restart itself (not a failed start: those are counted and
        tried again) is logged and ends it the same way, the process failed."""
        starting = False  # this try has begun to start the process (``starting``: its own)
        client: AsyncStageClient | None = None  # what this try started, not yet up
        try:
            with contextlib.suppress(Exception):
                await self._replicas[k][r].shutdown(1.0)  # dead: reap it, close its sockets
            while delay is not None:
                if await _aio.wait_event(self._stopping, delay):
                    return
                async with self._restart_lock:
                    generation = self._restarting(k, r)
                    if generation is None:
                        return
                    starting = True
                    try:
                        client = await self._start(k, r, generation)
                    except Exception as exc:
                        starting = False
                        delay = self._start_failed(k, r, exc)
                        continue
                    try:
                        up = await self._link(k, r, client)
                    except Exception as exc:  # a failed start: stop it, count it, try again
                        self._link_failed(k, r, exc)
                        with contextlib.suppress(Exception):
                            await client.shutdown(1.0)
                        client, starting = None, False
                        delay = self._unheard_start(k, r, exc)
                        continue
                    if not up:  # the pipeline failed or closes
                        with contextlib.suppress(Exception):
                            await client.shutdown(1.0)
                    return
        except BaseException as exc:
            # Cancelled (an application that cancels every task it does not own, a
            # TaskGroup's teardown, asyncio.run's end, a shutdown's cancelled task). First
            # the process is failed (so that the end of the one started here, stopped
            # below, is no news to the core); then what was started is stopped. Its
            # shutdown goes on in a task of its own even if this wait is cancelled too (and
            # kills it if the loop ends first). Nothing here replaces the cancel.
            # An unexpected error (a bug: the restart's own failures are handled above)
            # gives the restart up the same way, once logged: never restarting for good.
            cancelled = not isinstance(exc, Exception)
            if cancelled:
                why = "its restart task was cancelled while the pipeline was open"
            else:
                logger.exception("enginecore: restarting a pipeline stage failed")
                why = f"its restart failed ({exc!r})"
            try:
                self._give_up_restart(k, r, starting, why)
            except Exception:
                logger.exception("enginecore: giving up a pipeline stage's restart failed")
            if client is not None and (not self._closed or self._replicas[k][r] is not client):
                with contextlib.suppress(Exception):
                    await client.shutdown(1.0)
            if cancelled:
                raise

    async def _start(self, k: int, r: int, generation: int) -> AsyncStageClient:
        """:meth:`Pipeline._start <enginecore.stage.Pipeline._start>`'s, awaited."""
        kwargs, plan, key = self._restart_plan(k, r, generation)
        if key is not None:  # a local process whose next stage is on Ray
            await _authorize(self._grants(k, r, key))
        if plan is None:  # on TCP: the stage before's link keys admitted at start
            options = launch_options(self._specs, k, r, self._admitted(k) or ())
            try:
                return await AsyncStageClient._launch(
                    PIPE_FACTORY, kwargs, self._startup_timeout, True, options
                )
            except StageStartupError as exc:
                raise named_startup_error(self._specs[k], r, exc) from None
        from .ray import grant_links_async, open_on_ray_async

        async def grant(key: bytes) -> None:
            await _authorize(self._grants(k, r, key))

        try:
            client: AsyncStageClient = await open_on_ray_async(
                plan, AsyncStageClient._open, ordered_events=True, grant=grant
            )
        except StageStartupError as exc:  # named as a local stage's is
            raise named_startup_error(self._specs[k], r, exc) from None
        try:
            admitted = self._admitted(k)
            if admitted is not None:  # before the stage before it links to it
                await grant_links_async(client, admitted)
        except BaseException:
            with contextlib.suppress(Exception):
                await client.shutdown(1.0)
            raise
        return client

    async def _link(self, k: int, r: int, client: AsyncStageClient) -> bool:
        """:meth:`Pipeline._link <enginecore.stage.Pipeline._link>`'s, awaited: the
        previous stage's processes asked at once, each call with the startup timeout, and
        a shutdown ends the wait at once; first, the wait until the new process may be
        linked in (:meth:`_linkable`), as there."""
        if not await self._await_linkable(k, r):
            return False
        timeout = self._startup_timeout
        calls = [
            asyncio.ensure_future(target.call_utility(LINKS_UTILITY, timeout=timeout))
            for target in self._install(k, r, client)
        ]
        if calls:
            stopping = asyncio.ensure_future(self._stopping.wait())
            pending: set[asyncio.Future[Any]] = set(calls)
            try:
                while pending and not stopping.done():
                    _, pending = await asyncio.wait(
                        [*pending, stopping], return_when=asyncio.FIRST_COMPLETED
                    )
                    pending.discard(stopping)
            finally:
                stopping.cancel()
                for call in pending:
                    call.cancel()
            for call in calls:
                if not call.done() or call.cancelled():
                    continue  # cancelled as the pipeline closes (a task ends on its next turn)
                exc = call.exception()
                if exc is not None:  # a process that died: its death tells
                    self._link_unconfirmed(k, r, exc)
        return self._started(k, r)  # False once the pipeline closes

    async def _await_linkable(self, k: int, r: int) -> bool:
        """:meth:`Pipeline._await_linkable
        <enginecore.stage.Pipeline._await_linkable>`'s, awaited."""
        if self._linkable(k, r):
            return not self._stopping.is_set()
        ready = asyncio.Event()
        self._link_wait(k, r, ready.set)
        try:
            deadline = time.monotonic() + self._startup_timeout
            while not self._linkable(k, r):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._unlinkable(k, r)
                await _aio.wait_event(ready, left)
                ready.clear()
        finally:
            self._link_wait(k, r, None)
        return not self._stopping.is_set()

    # -- closing -----------------------------------------------------------------------------

    async def shutdown(
        self, timeout: float = 5.0, *, drain: float | None = None
    ) -> dict[str, int | None]:
        """Stop every stage, as :meth:`Pipeline.shutdown <enginecore.stage.Pipeline.shutdown>`
        (the same exit codes returned)
        (with *drain*, the stages drain one after the other, first to last). Idempotent: a
        second call waits for the first. Cancelling the call (``asyncio.wait_for``, a task's
        ``cancel()``) cancels only the wait: the shutdown goes on, in a task of its own, and
        a later call waits for it (or, if that task was cancelled itself, does the rest)."""
        self._on_its_loop()
        check_timeout(timeout)
        check_drain(drain)
        if self._closing.unstarted(redo_unfinished=True):
            # Not begun, or its task did not finish (cancelled itself: an application that
            # cancels every task as it exits; or failed): this call does it (each step is
            # idempotent).
            self._closed = True
            waiters, self._room_waiters = self._room_waiters, []
            for room in waiters:  # an add waiting for room: it is refused
                if not room.done():
                    room.set_result(None)
            self._stopping.set()
            self._wake_link_waits(every=True)  # a restart waiting to link in: it stops
            self._closing.start(self._shut_down(timeout, drain))
        await self._closing.wait()
        return self._shutdown_result()

    async def _shut_down(self, timeout: float, drain: float | None) -> None:
        if self._restart_tasks:  # a start under way: it stops what it started
            await asyncio.gather(*list(self._restart_tasks), return_exceptions=True)
        deadline = None if drain is None else time.monotonic() + drain
        self._draining = drain is not None  # health(): the stage draining is alive
        for k, wave in self._stop_waves(drain is not None):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            results: list[int | BaseException | None]
            if len(wave) == 1:
                # Awaited here, not in a task of gather's: its client is closing from this
                # step on (the pipeline refuses adds from the step before), as before the
                # stages stopped together.
                try:
                    results = [await wave[0][1].shutdown(timeout, drain=left)]
                except Exception as exc:
                    results = [exc]
            else:
                results = await asyncio.gather(
                    *(client.shutdown(timeout, drain=left) for _, client in wave),
                    return_exceptions=True,
                )
            for (name, _), result in zip(wave, results, strict=True):
                if not isinstance(result, BaseException):
                    self._exit_codes[name] = result
                    continue
                if not isinstance(result, Exception):
                    raise result  # an interrupt: the next call does the rest
                logger.warning("enginecore: stopping pipeline stage %r failed: %r", name, result)
                self._exit_codes[name] = None
            if k is not None:
                self._stage_stopped(k)  # later aborts go to the stages still draining
        self._close_core()

    close = shutdown

    async def __aenter__(self) -> AsyncPipeline:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.shutdown()

    def _hands_over_deaths(self) -> bool:
        # No: a stage's events are handled on the event loop only (_deliver sets futures).
        # There is nothing to hand over on it either: a client's reader sees a death and
        # calls its event sink in one callback, so health() read on the loop is always the
        # coordinator's. (Read from another thread, it may read DEAD in that callback.)
        return False

    def _deliver(self, d: PipelineDeliveries[AsyncPipelineStream]) -> None:
        for stream in d.wake:
            wakeup = stream._wakeup
            if wakeup is not None and not wakeup.done():
                wakeup.set_result(None)
        if d.aborts or d.stage_aborts or d.gone or d.replays or d.releases:
            self._send_aborts(d)
        if d.freed and self._room_waiters:
            waiters, self._room_waiters = self._room_waiters, []
            for room in waiters:
                if not room.done():
                    room.set_result(None)
