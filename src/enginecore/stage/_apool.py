"""AsyncStagePool: one asyncio client over N stage replicas.

The decisions are :class:`~enginecore.stage._pool_core.PoolCore`'s and the operations that
never wait :class:`~enginecore.stage._poolbase.PoolBase`'s, as for
:class:`~enginecore.stage.StagePool`; the transport is N ordinary
:class:`~enginecore.stage.AsyncStageClient` members, whose output sockets are read by
event-loop readers (no task per replica). This module owns the waiting and the tasks that
start, restart and stop replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Hashable, Iterable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, overload

from . import _aio, _clientbase, _session
from ._aclient import AsyncRequestStream, AsyncStageClient
from ._curve import CurveKeys
from ._errors import StageClosedError
from ._pool_core import (
    Death,
    DeathHook,
    PoolEvent,
    Replica,
    ReplicaState,
    RestartPolicy,
    Routing,
    ScoreFn,
)
from ._poolbase import (
    DRAIN_EXIT_S,
    STOP_EXIT_S,
    PoolBase,
    PoolStreamCore,
    connect_specs,
    cut_drain,
    drain_cut_error,
    escalate_steps,
    events_off,
    fail_with_group,
    launch_specs,
    member_plan,
    removal_timeout,
    removed_meanwhile,
    removed_while_starting,
    replica_spec,
    with_groups,
)
from ._session import Deliveries
from ._statistics import LOAD_INTERVAL, StageStatistics
from ._watchdog import STEP_TIMEOUT

if TYPE_CHECKING:
    from .ray import RayPlacement

__all__ = ["AsyncPoolRequestStream", "AsyncStagePool"]

logger = logging.getLogger("enginecore.stage")


class AsyncPoolRequestStream(AsyncRequestStream, PoolStreamCore):
    """An :class:`~enginecore.stage.AsyncRequestStream` of a pool: the same async
    iterator, plus the replica that serves it (:attr:`replica`) and how often it moved
    (:attr:`migrations`). Ends as :class:`~enginecore.stage.PoolRequestStream` does."""

    __slots__ = ("_aborted", "_migrations", "_replica", "_request")


class _AsyncMember(AsyncStageClient):
    """One replica's client: its session adopts its streams when it fails, and the pool
    decides their end."""

    _adopt_orphans = True
    _silent_after = 1.75  # a stopped replica leaves the routing within two ping intervals
    _stream_type = AsyncPoolRequestStream
    _pool: AsyncStagePool | None = None
    _replica: Replica

    def _apply(self, d: Deliveries[Any, Any]) -> None:
        pool = self._pool
        failure = self._session.failure
        if pool is None or failure is None:
            super()._apply(d)
            return
        pool._member_failed(self, d, failure)


class AsyncStagePool(PoolBase[AsyncPoolRequestStream]):
    """An asyncio client over N stage replicas: the same pool as
    :class:`~enginecore.stage.StagePool`, with coroutines instead of blocking calls
    (``docs/pool.md``). Not thread-safe: use it on the event loop that created it."""

    _stream_type = AsyncPoolRequestStream

    def __init__(
        self,
        *,
        routing: Routing | ScoreFn | None = None,
        restart: RestartPolicy | bool = False,
        on_replica_death: DeathHook | None = None,
        max_migrations: int = 1,
        ordered_events: bool = False,
    ) -> None:
        """An empty pool; add replicas with :meth:`add_replica`. The arguments are
        :class:`~enginecore.stage.StagePool`'s."""
        super().__init__(routing, restart, on_replica_death, max_migrations, ordered_events)
        self._event_waiters: list[asyncio.Future[None]] = []
        self._loop = asyncio.get_running_loop()
        # One thread: no lock; a LoopLock tells the pool's streams its loop, so that a wait
        # on one from another loop raises at once, as a client's or a pipeline's does.
        self._lock = _session.LoopLock(self._loop, "AsyncStagePool")
        self._closed = asyncio.Event()
        self._closing: _clientbase.ClosingTask[dict[Replica, int | None]] = _clientbase.ClosingTask(
            "the stage pool"
        )
        self._closed_done = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._starting: set[asyncio.Future[Any]] = set()  # add_replica()s' starts
        self._stopped_starts: set[asyncio.Future[Any]] = set()  # those close() cancelled
        # The start of each replica under way (a restart, an add_replica()): its removal
        # cancels it (its half-started stage is killed), as a close cancels every start.
        self._opening: dict[Replica, asyncio.Future[_AsyncMember]] = {}
        self._exit_codes: dict[Replica, int | None] = {}

    # -- construction ------------------------------------------------------------------------

    @classmethod
    async def _opened(cls, specs: list[dict[str, Any]], **settings: Any) -> AsyncStagePool:
        """A pool with *settings* (the constructor's arguments) over replicas started
        from *specs*, all at once; if one does not start, the pool is closed and its
        error raised."""
        pool = cls(**settings)
        try:
            await pool._add_replicas(specs)
        except BaseException:
            await pool.close()
            raise
        return pool

    @classmethod
    async def launch(
        cls,
        factory: str,
        /,
        kwargs: dict[str, Any] | None = None,
        *,
        replicas: int = 1,
        routing: Routing | ScoreFn | None = None,
        restart: RestartPolicy | bool = False,
        on_replica_death: DeathHook | None = None,
        max_migrations: int = 1,
        startup_timeout: float = 60.0,
        name: str | None = None,
        step_timeout: float | None = STEP_TIMEOUT,
        kill_after: float | None = None,
        log_level: int | str | None = None,
        forward_logs: bool = False,
        load_interval: float | None = LOAD_INTERVAL,
        max_message_bytes: int | None = None,
        ping_interval: float = _session.LAUNCHED_PING_S,
        ordered_events: bool = False,
        group: str | Sequence[str | None] | None = None,
    ) -> AsyncStagePool:
        """:meth:`StagePool.launch <enginecore.stage.StagePool.launch>`, awaited."""
        options = {
            "startup_timeout": startup_timeout,
            "name": name,
            "step_timeout": step_timeout,
            "kill_after": kill_after,
            "log_level": log_level,
            "forward_logs": forward_logs,
            "load_interval": load_interval,
            "max_message_bytes": max_message_bytes,
            "ping_interval": ping_interval,
        }
        return await cls._opened(
            with_groups(launch_specs(factory, kwargs, replicas, options), group),
            routing=routing,
            restart=restart,
            on_replica_death=on_replica_death,
            max_migrations=max_migrations,
            ordered_events=ordered_events,
        )

    @classmethod
    async def launch_on_ray(
        cls,
        factory: str,
        /,
        kwargs: dict[str, Any] | None = None,
        *,
        replicas: int = 1,
        placement: RayPlacement | Sequence[RayPlacement] | None = None,
        insecure: bool = False,
        curve: CurveKeys | None = None,
        stage_secret_key: str | os.PathLike[str] | None = None,
        authorized_clients: Sequence[bytes] = (),
        routing: Routing | ScoreFn | None = None,
        restart: RestartPolicy | bool = False,
        on_replica_death: DeathHook | None = None,
        max_migrations: int = 1,
        startup_timeout: float = 60.0,
        connect_timeout: float = 10.0,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
        name: str | None = None,
        step_timeout: float | None = STEP_TIMEOUT,
        kill_after: float | None = None,
        log_level: int | str | None = None,
        forward_logs: bool = False,
        load_interval: float | None = LOAD_INTERVAL,
        max_message_bytes: int | None = None,
        ordered_events: bool = False,
        group: str | Sequence[str | None] | None = None,
    ) -> AsyncStagePool:
        """:meth:`StagePool.launch_on_ray <enginecore.stage.StagePool.launch_on_ray>`,
        awaited."""
        from .ray import ray_specs

        options = {
            "insecure": insecure,
            "curve": curve,
            "stage_secret_key": stage_secret_key,
            "authorized_clients": authorized_clients,
            "startup_timeout": startup_timeout,
            "connect_timeout": connect_timeout,
            "heartbeat_interval": heartbeat_interval,
            "heartbeat_timeout": heartbeat_timeout,
            "name": name,
            "step_timeout": step_timeout,
            "kill_after": kill_after,
            "log_level": log_level,
            "forward_logs": forward_logs,
            "load_interval": load_interval,
            "max_message_bytes": max_message_bytes,
        }
        return await cls._opened(
            with_groups(ray_specs(factory, kwargs, replicas, placement, options), group),
            routing=routing,
            restart=restart,
            on_replica_death=on_replica_death,
            max_migrations=max_migrations,
            ordered_events=ordered_events,
        )

    @classmethod
    async def connect(
        cls,
        addresses: Sequence[str],
        *,
        routing: Routing | ScoreFn | None = None,
        on_replica_death: DeathHook | None = None,
        max_migrations: int = 1,
        timeout: float = 10.0,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
        curve: CurveKeys | None = None,
        ordered_events: bool = False,
    ) -> AsyncStagePool:
        """:meth:`StagePool.connect <enginecore.stage.StagePool.connect>`, awaited."""
        options = {
            "timeout": timeout,
            "heartbeat_interval": heartbeat_interval,
            "heartbeat_timeout": heartbeat_timeout,
            "curve": curve,
        }
        specs = connect_specs(addresses, options)
        return await cls._opened(
            specs,
            routing=routing,
            on_replica_death=on_replica_death,
            max_migrations=max_migrations,
            ordered_events=ordered_events,
        )

    async def add_replica(
        self,
        factory: str | None = None,
        /,
        kwargs: dict[str, Any] | None = None,
        *,
        address: str | None = None,
        **options: Any,
    ) -> Replica:
        """:meth:`StagePool.add_replica <enginecore.stage.StagePool.add_replica>`,
        awaited."""
        spec = replica_spec(factory, kwargs, address, options)
        return (await self._add_replicas([spec]))[0]

    async def _add_replicas(self, specs: list[dict[str, Any]]) -> list[Replica]:
        self._on_its_loop()
        self._check_open()
        new = [self._core.new_replica(spec) for spec in specs]
        starts = asyncio.gather(*(self._start(r) for r in new), return_exceptions=True)
        self._starting.add(starts)
        try:
            results: list[Any] = await starts
        except BaseException as exc:  # cancelled, and the starts with it: as a failed start
            by_close = starts in self._stopped_starts
            results = [StageClosedError("this stage pool is closed") if by_close else exc]
        finally:
            self._starting.discard(starts)
            self._stopped_starts.discard(starts)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for r in new:
                await self._stop_member(r, drain=None, timeout=5.0)
            self._core.add_failed(new)
            raise errors[0]
        removed = [r for r in new if r._client is None and removed_meanwhile(r, self._core)]
        if removed:  # remove_replica() stopped its start
            raise removed_while_starting(removed[0])
        return new

    async def _start(self, replica: Replica) -> None:
        """Start *replica*'s member client and make it serve."""
        await self._start_all([replica])

    async def _start_all(self, replicas: Sequence[Replica]) -> None:
        """:meth:`StagePool._start_all <enginecore.stage.StagePool._start_all>`: start the
        members of *replicas* at once, then make them serve; if one does not start, close
        those that did and raise its error. A replica's removal cancels its start: that is
        no failure (the others go on)."""
        generations = [r._generation for r in replicas]
        opening = [asyncio.ensure_future(self._open_member(r)) for r in replicas]
        for r, t in zip(replicas, opening, strict=True):
            self._opening[r] = t
            if removed_meanwhile(r, self._core):  # removed before its start began
                t.cancel()
        try:
            results = await asyncio.gather(*opening, return_exceptions=True)
        except BaseException:  # cancelled (a pool that closes stops a restart so)
            for t in opening:  # done: the gather waited for each; close those that opened
                if not t.cancelled() and t.exception() is None:
                    await t.result().close()
            raise
        finally:
            for r, t in zip(replicas, opening, strict=True):
                if self._opening.get(r) is t:
                    del self._opening[r]
        errors = [
            res
            for r, res in zip(replicas, results, strict=True)
            if isinstance(res, BaseException) and not removed_meanwhile(r, self._core)
        ]
        if errors:
            for m in results:
                if isinstance(m, _AsyncMember):
                    await m.close()
            raise errors[0]
        for replica, member, generation in zip(replicas, results, generations, strict=True):
            if not isinstance(member, _AsyncMember):
                continue  # removed while it started: its start was cancelled
            member._replica = replica
            member._session.label = f"replica {replica.name}"  # its warnings say which
            member._pool = self
            on_ray = "ray" in replica.spec
            if on_ray:  # a key rotation may have come while it was placed: before it serves
                from .ray import catch_up_keys_async

                await catch_up_keys_async(replica, member)
            if not self._core.started(replica, member, generation):
                await member.close()  # removed, dead with its group, or the pool closes
                continue
            if on_ray:  # and one that came since, before a rotation could see it serve
                await catch_up_keys_async(replica, member)
            if self._events is not None:
                member._event_sink = functools.partial(self._member_events, member)
                self._member_events(member)  # what came before the sink was set
            failure = member._session.failure
            if failure is not None:  # died before _pool was set: nobody saw it
                self._member_gone(member, failure)

    async def _open_member(self, replica: Replica) -> _AsyncMember:
        plan = member_plan(replica)
        events = self._events is not None  # each member keeps its events for the pool's
        if plan[0] == "connect":
            member = await _AsyncMember._open(plan[1]._replace(ordered_events=events))
        elif plan[0] == "ray":
            from .ray import open_on_ray_async

            member = await open_on_ray_async(plan[1], _AsyncMember._open, ordered_events=events)
        else:
            _, factory, kwargs, startup_timeout, options, ping_s = plan
            member = await _AsyncMember._launch(
                factory, kwargs, startup_timeout, events, options, ping_s=ping_s
            )
        assert isinstance(member, _AsyncMember)
        return member

    # -- what the base needs -----------------------------------------------------------------

    def _wake(self, stream: AsyncPoolRequestStream) -> None:
        wakeup = stream._wakeup
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)

    def _member_apply(self, member: Any, d: Deliveries[Any, Any]) -> None:
        AsyncStageClient._apply(member, d)

    def _wake_events(self) -> None:
        waiters, self._event_waiters = self._event_waiters, []
        for wakeup in waiters:
            if not wakeup.done():
                wakeup.set_result(None)

    # -- requests ----------------------------------------------------------------------------

    @overload
    async def add(
        self,
        req_id: str,
        data: Any,
        stream: Literal[True] = True,
        *,
        key: Hashable | None = None,
    ) -> AsyncPoolRequestStream: ...
    @overload
    async def add(
        self, req_id: str, data: Any, stream: Literal[False], *, key: Hashable | None = None
    ) -> None: ...
    @overload
    async def add(
        self, req_id: str, data: Any, stream: bool, *, key: Hashable | None = None
    ) -> AsyncPoolRequestStream | None: ...

    async def add(
        self, req_id: str, data: Any, stream: bool = True, *, key: Hashable | None = None
    ) -> AsyncPoolRequestStream | None:
        """:meth:`StagePool.add <enginecore.stage.StagePool.add>`; never waits."""
        if stream is True:
            return self._add_one(req_id, data, key)
        if stream is not False:  # "no" would make a stream
            _clientbase.check_flag(stream, "stream")
        self._add_quiet(req_id, data, key)
        return None

    @overload
    async def add_many(
        self, items: Iterable[tuple[str, Any]], *, streams: Literal[True] = True
    ) -> list[AsyncPoolRequestStream]: ...
    @overload
    async def add_many(
        self, items: Iterable[tuple[str, Any]], *, streams: Literal[False]
    ) -> None: ...
    @overload
    async def add_many(
        self, items: Iterable[tuple[str, Any]], *, streams: bool
    ) -> list[AsyncPoolRequestStream] | None: ...

    async def add_many(
        self, items: Iterable[tuple[str, Any]], *, streams: bool = True
    ) -> list[AsyncPoolRequestStream] | None:
        """:meth:`StagePool.add_many <enginecore.stage.StagePool.add_many>`; never
        waits."""
        out = self._add_many(items, streams)
        return out if streams else None

    async def abort(self, req_ids: Sequence[str]) -> None:
        """:meth:`StagePool.abort <enginecore.stage.StagePool.abort>`; never waits."""
        self._abort(req_ids)

    # -- the event stream --------------------------------------------------------------------

    async def get_event(self, timeout: float | None = None) -> PoolEvent:
        """:meth:`StagePool.get_event <enginecore.stage.StagePool.get_event>`, awaited;
        :class:`StopAsyncIteration` once the pool is closed and every event was read."""
        if timeout is not None:  # checked as a wait checks it, an event ready or not
            _clientbase.deadline_after(timeout)
        buf = self._events
        if buf:
            item = buf.popleft()
            if type(item) is not _session.End:
                return item  # type: ignore[no-any-return]
            _session.raise_end(item, StopAsyncIteration)
        return (await self._read_events(timeout, every=False))[0]  # type: ignore[no-any-return]

    async def get_events(self, timeout: float | None = None) -> list[PoolEvent]:
        """:meth:`StagePool.get_events <enginecore.stage.StagePool.get_events>`,
        awaited."""
        return await self._read_events(timeout, every=True)

    async def events(self) -> AsyncIterator[PoolEvent]:
        """Iterate over :meth:`get_event` until the pool is closed."""
        while True:
            try:
                event = await self.get_event()
            except StopAsyncIteration:
                return
            yield event

    async def _read_events(self, timeout: float | None, *, every: bool) -> list[Any]:
        buf = self._events
        if buf is None:
            raise events_off()
        deadline = _clientbase.deadline_after(timeout)
        while True:
            out = _session.take_events(buf, every)
            if out:
                return _session.events_before_end(out, StopAsyncIteration)
            if self._events_closed:
                raise StopAsyncIteration
            self._on_its_loop()
            wakeup: asyncio.Future[None] = self._loop.create_future()
            self._event_waiters.append(wakeup)
            self._events_waiting = True
            try:
                if not await _aio.until(wakeup, deadline) and not buf:
                    raise TimeoutError(f"no pool event within {timeout} s")
            finally:
                with contextlib.suppress(ValueError):  # gone if _wake_events woke it
                    self._event_waiters.remove(wakeup)

    # -- utilities ---------------------------------------------------------------------------

    async def call_utility(
        self,
        name: str,
        /,
        *args: Any,
        timeout: float | None = None,
        replica: Replica | None = None,
        broadcast: bool = False,
    ) -> Any:
        """:meth:`StagePool.call_utility <enginecore.stage.StagePool.call_utility>`,
        awaited."""
        self._on_its_loop()
        _clientbase.check_flag(broadcast, "broadcast")  # "no" would broadcast
        if broadcast:
            if replica is not None:
                raise TypeError("call_utility() takes replica= or broadcast=True, not both")
            _clientbase.deadline_after(timeout)  # a bad one raises, not once per replica
            serving = self._serving()
            results = await asyncio.gather(
                *(r._client.call_utility(name, *args, timeout=timeout) for r in serving),
                return_exceptions=True,
            )
            return dict(zip(serving, results, strict=True))
        member: _AsyncMember = self._utility_target(replica)
        return await member.call_utility(name, *args, timeout=timeout)

    async def stats(
        self, timeout: float | None = 10.0
    ) -> dict[Replica, StageStatistics | Exception]:
        """:meth:`StagePool.stats <enginecore.stage.StagePool.stats>`, awaited (the
        replicas answer at once)."""
        self._on_its_loop()
        _clientbase.deadline_after(timeout)  # a bad one raises, not once per replica
        serving = self._serving(stats=True)
        results = await asyncio.gather(
            *(r._client.stats(timeout) for r in serving), return_exceptions=True
        )
        return dict(zip(serving, results, strict=True))  # type: ignore[arg-type]

    # -- membership --------------------------------------------------------------------------

    def _on_its_loop(self) -> None:
        _clientbase.check_loop(self._loop, "AsyncStagePool")

    async def remove_replica(
        self, replica: Replica, *, drain: bool = True, timeout: float = 30.0
    ) -> int | None:
        """:meth:`StagePool.remove_replica <enginecore.stage.StagePool.remove_replica>`,
        awaited."""
        self._on_its_loop()
        _clientbase.check_flag(drain, "drain")  # "no" would drain
        timeout = removal_timeout(timeout)
        if not self._core.draining:  # closed: refused, as add_replica is
            self._check_open()
        if replica not in self._core.replicas:
            raise ValueError(f"{replica!r} is not in this pool")
        was = replica.state
        self._core.set_state(replica, ReplicaState.DRAINING)
        # A drained removal under way: the user asks to stop waiting for it.
        cutting = not drain and replica in self._drains
        if cutting:
            self._cut.add(replica)
            self._cut_by_removal.add(replica)
        start = self._opening.get(replica)
        if start is not None:  # its half-started stage is killed now, as a close does
            start.cancel()
        # A task of the pool's (close() waits for it), shielded: a cancelled caller stops
        # waiting, but the removal it began goes on to its end (else the replica stayed
        # "draining" in pool.replicas, its stage stopped or not).
        task = self._loop.create_task(
            self._remove(
                replica, was, timeout if drain else None, timeout, cutting=cutting, start=start
            )
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    async def _remove(
        self,
        replica: Replica,
        was: ReplicaState,
        drain: float | None,
        timeout: float,
        *,
        cutting: bool = False,
        start: asyncio.Future[Any] | None = None,
    ) -> int | None:
        if start is not None:  # its cancelled start: a kill and a reap, at once
            await asyncio.wait({start}, timeout=min(timeout, STOP_EXIT_S))
        code, cut, owner, by_removal = None, False, False, False
        if was in (ReplicaState.SERVING, ReplicaState.DRAINING, ReplicaState.STARTING):
            if drain is not None:
                # A close has begun: it stops the stage now (a drained shutdown drains
                # it: the removal waits for that drain, uncut).
                if self._core.closing and not self._core.draining:
                    cut, drain = True, None
                else:
                    self._drains.add(replica)
                    owner = True
            try:
                if cutting:
                    await self._cut_now(replica, min(timeout, STOP_EXIT_S))
                code = await self._stop_member(
                    replica,
                    drain=drain,
                    timeout=DRAIN_EXIT_S if drain is not None else min(timeout, STOP_EXIT_S),
                )
            finally:
                if owner:  # the drained removal: it reads, and clears, whether it was cut
                    self._drains.discard(replica)
                    cut = cut or replica in self._cut
                    by_removal = replica in self._cut_by_removal and not self._core.closing
                    self._cut.discard(replica)
                    self._cut_by_removal.discard(replica)
        elif replica._client is not None:  # dead or failed: its last stage's exit code
            code = replica._client.exit_code
        self._core.set_state(replica, ReplicaState.REMOVED)
        if cut:
            raise drain_cut_error(replica, by_removal=by_removal)
        return code

    async def _cut_now(self, replica: Replica, timeout: float) -> None:
        """:meth:`StagePool._cut_now <enginecore.stage.StagePool._cut_now>`, awaited: a
        removal without a drain stops the stage that another one drains."""
        member: _AsyncMember | None = replica._client
        if member is None:
            return
        cut_drain(member)
        launched = member._launched
        if launched is not None and not await _aio.wait_event(member._exited, timeout):
            for sig, wait in escalate_steps(member):
                launched.send_signal(sig)
                if await _aio.wait_event(member._exited, wait):
                    break

    async def _stop_member(
        self, replica: Replica, *, drain: float | None, timeout: float
    ) -> int | None:
        member: _AsyncMember | None = replica._client
        if member is None:
            return None
        if member._launched is not None:
            return await member.shutdown(timeout, drain=drain)
        if drain is not None:  # a connected stage: wait for the pool's requests, then detach
            deadline = time.monotonic() + drain
            while member._session.in_flight and member._session.failure is None:
                if time.monotonic() >= deadline or self._closed.is_set() or replica in self._cut:
                    break
                await asyncio.sleep(0.01)
        await member.close()
        return None

    # -- a dead replica ----------------------------------------------------------------------

    def _member_gone(self, member: Any, failure: BaseException) -> None:
        replica = member._replica
        if replica._client is not member:
            return  # an old member of a restarted replica
        death = self._core.died(replica, time.monotonic())
        if isinstance(failure, StageClosedError):
            return  # the pool closed it, and closes it
        logger.warning("enginecore: replica %s is gone: %s", replica.name, failure)
        _aio.background(self._loop, self._supervise(replica, member, death), self._tasks)

    async def _supervise(self, replica: Replica, member: _AsyncMember, death: Death) -> None:
        """Task: release a dead member and stop the rest of its restart group; with a
        delay, start the replica (or its whole group) again then, and again after each
        failed start, until it serves, fails for good or the pool closes."""
        try:
            await self._stop_group(replica, death.stop)
            await member.close()
            self._exit_codes[replica] = member.exit_code
            delay, group = death.delay, death.restart
            while delay is not None:
                if await _aio.wait_event(self._closed, delay):
                    return  # the pool closes
                starting = [r for r in group if self._core.restarting(r)]
                if not starting:
                    return
                names = ", ".join(r.name for r in starting)
                start = asyncio.ensure_future(self._start_all(starting))
                closing = asyncio.ensure_future(self._closed.wait())
                try:
                    await asyncio.wait({start, closing}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    closing.cancel()
                if not start.done():  # the pool closes: a stage being started is killed,
                    start.cancel()  # not waited for (its factory may take minutes)
                    await asyncio.wait({start})
                    return
                try:
                    await start
                    # (one removed while it started is not: its new stage was closed)
                    served = [r.name for r in starting if r.state is ReplicaState.SERVING]
                    if served:
                        logger.warning("enginecore: replica %s started again", ", ".join(served))
                    return
                except Exception as exc:
                    logger.warning("enginecore: replica %s did not start again: %s", names, exc)
                    left = [r for r in starting if r.state is ReplicaState.STARTING]
                    if not left:  # removed meanwhile, or the pool closes
                        return
                    death = self._core.died(left[0], time.monotonic())
                    await self._stop_group(left[0], death.stop)
                    delay, group = death.delay, death.restart
        except Exception:
            logger.exception("enginecore: a replica pool task failed")

    async def _stop_group(self, dead: Replica, stop: Sequence[Replica]) -> None:
        """Stop the members of *dead*'s restart group that still served (the core marked
        them dead): at once, so that their requests end now, then close them."""
        members = [(r, r._client) for r in stop]
        for r, m in members:
            fail_with_group(m, r, dead)
        for r, m in members:
            await m.close()
            self._exit_codes[r] = m.exit_code

    # -- closing -----------------------------------------------------------------------------

    async def shutdown(
        self, timeout: float = 5.0, *, drain: float | None = None
    ) -> dict[Replica, int | None]:
        """:meth:`StagePool.shutdown <enginecore.stage.StagePool.shutdown>`, awaited.
        Cancelling the call cancels only the wait: the shutdown goes on in a task of its
        own (every stream still ends), and a later call waits for it and returns or raises
        as it does; replicas still running when the event loop ends are killed."""
        _session.check_shutdown_timeout(timeout)  # a bad timeout or drain raises before
        _session.shutdown_frame(drain)  # anything is stopped
        return await self._close(stop=True, timeout=timeout, drain=drain)

    async def close(self) -> None:
        """:meth:`StagePool.close <enginecore.stage.StagePool.close>`, awaited; a cancelled
        call cancels only the wait, as for :meth:`shutdown`."""
        await self._close(stop=False, timeout=5.0, drain=None)

    async def __aenter__(self) -> AsyncStagePool:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _close(
        self, *, stop: bool, timeout: float, drain: float | None
    ) -> dict[Replica, int | None]:
        self._on_its_loop()
        if self._closing.unstarted():
            self._core.begin_close(drain is not None)
            self._closed.set()
            cut = list(self._drains) if drain is None else []
            for r in cut:  # a removal's drain under way stops now, as the others do
                self._cut.add(r)
                if r._client is not None:
                    cut_drain(r._client)
            for starts in list(self._starting):  # an add_replica() that waits for a start:
                self._stopped_starts.add(starts)  # its half-started stage is killed, and it
                starts.cancel()  # raises StageClosedError
            self._closing.start(self._shut_down(stop=stop, timeout=timeout, drain=drain, cut=cut))
        return dict(await self._closing.wait())

    async def _shut_down(
        self, *, stop: bool, timeout: float, drain: float | None, cut: list[Replica]
    ) -> dict[Replica, int | None]:
        """The shutdown task: stop every replica (all at once), wait for the restart tasks,
        end what is left."""
        replicas = list(self._core.replicas)

        async def stop_one(r: Replica) -> None:
            member: _AsyncMember | None = r._client
            if member is None:
                return
            launched = member._launched
            if (
                r in cut
                and launched is not None
                and not await _aio.wait_event(member._exited, timeout)
            ):
                # Its removal waits for the drain's end: a stage that did not stop on
                # the cut (stopped, stuck) is signalled now, as the others are.
                for sig, wait in escalate_steps(member):
                    launched.send_signal(sig)
                    if await _aio.wait_event(member._exited, wait):
                        break
            if stop or member._launched is not None:
                code = await member.shutdown(timeout, drain=drain)
            else:
                await member.close()
                code = None
            # Its current stage's: a restarted replica's dead stage's code is old.
            if code is not None or r not in self._exit_codes:
                self._exit_codes[r] = code

        try:
            results = await asyncio.gather(*(stop_one(r) for r in replicas), return_exceptions=True)
            for r, result in zip(replicas, results, strict=True):
                if isinstance(result, BaseException):
                    logger.warning("enginecore: closing %s failed: %r", r._described, result)
            while self._tasks:  # restart tasks see _closed and return
                await asyncio.gather(*list(self._tasks), return_exceptions=True)
        except BaseException:
            # The loop's end cancels this task (asyncio.run cancels the tasks left): no one
            # will wait for the replicas any more, so each one left is killed now.
            for r in self._core.replicas:
                member = r._client
                if member is not None:
                    member._kill_now()
                    self._exit_codes.setdefault(r, member.exit_code)
            self._finish_close()
            raise
        self._finish_close()
        # The replicas of the pool as it closed (not those removed before it).
        codes = self._exit_codes
        return {r: codes[r] for r in replicas if r in codes}

    def _finish_close(self) -> None:
        if self._closed_done:
            return
        closed = StageClosedError("this stage pool is closed")
        for s in self._core.live_streams():  # moving between replicas as the pool closed
            self._end(s, closed)
        self._core.closed()
        self._end_events()
        self._closed_done = True
