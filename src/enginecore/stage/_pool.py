"""StagePool: one blocking client over N stage replicas.

The decisions (routing, the live-request table, what becomes of a dead replica's requests,
when to restart one) are :class:`~enginecore.stage._pool_core.PoolCore`'s, shared with
:class:`~enginecore.stage.AsyncStagePool`; the transport is N ordinary
:class:`~enginecore.stage.StageClient` members. This module owns the waiting and the
threads that start, restart and stop replicas.

Every member shares the pool's one lock: a stream that moves from a dead replica to a live
one (``on_replica_death``) keeps the lock its consumer and its new receiver append under.
And one thread reads every member's events (a :class:`~enginecore.stage._client.Receiver`),
not one per replica: it runs each member's receiver code (frames, liveness timers, the
process sentinel) as that member's own thread would, so a pool costs nothing per output
that a single client does not. A member never lends its output socket to a blocking
``call_utility`` (which then waits to be woken, as a future does).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import threading
import time
from collections.abc import Hashable, Iterable, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, overload

from . import _clientbase, _session
from ._client import Receiver, RequestStream, StageClient
from ._curve import CurveKeys
from ._errors import StageClosedError
from ._launch import at_exit
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

__all__ = ["PoolRequestStream", "StagePool"]

logger = logging.getLogger("enginecore.stage")


class PoolRequestStream(RequestStream, PoolStreamCore):
    """A :class:`~enginecore.stage.RequestStream` of a pool: the same iterator, plus the
    replica that serves it (:attr:`replica`) and how often it moved (:attr:`migrations`).

    If its replica dies, iteration raises :class:`~enginecore.stage.ReplicaDeadError`,
    unless the pool's ``on_replica_death`` sent it to another replica: then it goes on
    with that replica's outputs, after every output it had."""

    __slots__ = ("_aborted", "_migrations", "_replica", "_request")


class _Member(StageClient):
    """One replica's client: its session adopts its streams when it fails, and the pool
    decides their end."""

    _adopt_orphans = True
    _silent_after = 1.75  # a stopped replica leaves the routing within two ping intervals
    _stream_type = PoolRequestStream
    _pool: StagePool | None = None
    _replica: Replica

    def _apply(self, d: Deliveries[Any, Any]) -> None:
        pool = self._pool
        failure = self._session.failure
        if pool is None or failure is None:
            super()._apply(d)
            return
        pool._member_failed(self, d, failure)


class _Start:
    """One replica's start under way: the pipe whose read end its launch waits on besides
    its stage (``cancel=``), written to stop the start; *done* is set once it ended."""

    __slots__ = ("done", "stopped", "wait_end", "write_end")

    def __init__(self) -> None:
        self.wait_end, self.write_end = multiprocessing.Pipe(duplex=False)
        self.stopped = False
        self.done = threading.Event()

    def stop(self) -> None:
        """Stop the start (in the pool's lock, before :meth:`close`)."""
        if not self.stopped:
            self.stopped = True
            self.write_end.send_bytes(b"stop")

    def close(self) -> None:
        """The start has ended (in the pool's lock): release the pipe."""
        self.stopped = True
        self.write_end.close()
        self.wait_end.close()
        self.done.set()


class StagePool(PoolBase[PoolRequestStream]):
    """A blocking client over N stage replicas: launched by the pool
    (:meth:`launch`), headless stages it connects to (:meth:`connect`), or both
    (:meth:`add_replica`). Same operations as :class:`~enginecore.stage.StageClient`; each
    request goes to one replica, chosen by the pool's routing (default
    :class:`~enginecore.stage.LeastLoaded`), and its stream
    (:class:`PoolRequestStream`) is that replica's.

    A replica that dies fails only its own requests and calls, with
    :class:`~enginecore.stage.ReplicaDeadError`, and leaves the routing; the others keep
    serving. A stalled replica (a step past its ``step_timeout``, or no answer to pings for
    1.75 intervals) leaves the routing until it answers again. With *restart*, a launched
    replica that died is started again (:class:`~enginecore.stage.RestartPolicy`).
    ``docs/pool.md`` is the guide.

    Thread-safety: every method may be called from any thread.
    """

    def __init__(
        self,
        *,
        routing: Routing | ScoreFn | None = None,
        restart: RestartPolicy | bool = False,
        on_replica_death: DeathHook | None = None,
        max_migrations: int = 1,
        ordered_events: bool = False,
    ) -> None:
        """An empty pool; add replicas with :meth:`add_replica`. *routing*: a
        :class:`~enginecore.stage.Routing` (:class:`~enginecore.stage.LeastLoaded`,
        :class:`~enginecore.stage.Sticky`, ...) or a ``score(view, request) -> float``
        (lowest wins). *restart*: ``True`` or a
        :class:`~enginecore.stage.RestartPolicy` to start dead launched replicas again.
        *on_replica_death*: ``hook(request, delivered) -> PoolRequest | None``, called for
        each request live on a replica that died (but not one :meth:`abort` was called for);
        a returned request (same ``req_id``) goes to another replica and its stream goes
        on, at most *max_migrations* times per request. *ordered_events*: keep every
        replica's events for :meth:`get_events` (and allow requests without a stream)."""
        super().__init__(routing, restart, on_replica_death, max_migrations, ordered_events)
        self._lock = threading.Lock()  # every member's session lock, and the core's
        self._event_lock = threading.Lock()  # one waiting consumer of the event stream
        self._event_wakeup: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._hub = Receiver()  # one thread reads every member's events
        self._closed = threading.Event()  # set when close begins: timers stop waiting
        # The starts under way (a restart, an add_replica()), one per replica: each one's
        # launch also waits on a pipe (launch_process's cancel) that a close writes (every
        # start's, and any start that begins after is stopped as it begins) or a removal
        # of its replica: the launch stops waiting and kills its half-started stage.
        self._starts: dict[Replica, _Start] = {}
        self._starts_stopped = False
        self._close_lock = threading.Lock()
        self._closed_done = False
        self._shutdown_codes: dict[Replica, int | None] = {}  # what _close() returned
        self._threads: set[threading.Thread] = set()  # restart timers and closers
        self._exit_codes: dict[Replica, int | None] = {}

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def _opened(cls, specs: list[dict[str, Any]], **settings: Any) -> StagePool:
        """A pool with *settings* (the constructor's arguments) over replicas started
        from *specs*, all at once; if one does not start, the pool is closed and its
        error raised."""
        pool = cls(**settings)
        try:
            pool._add_replicas(specs)
        except BaseException:
            pool.close()
            raise
        return pool

    @classmethod
    def launch(
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
    ) -> StagePool:
        """Start *replicas* stage processes running ``factory(**kwargs)``, in parallel,
        and return their pool. The stage options are
        :meth:`StageClient.launch <enginecore.stage.StageClient.launch>`'s; each replica's
        stage is named ``"<name or factory>/r<i>"``. *ping_interval*: how often each
        replica is pinged; one silent for 1.75 intervals (a stopped process) leaves the
        routing. *ordered_events*: the pool's event stream (:meth:`get_events`). *group*: a
        restart group for every replica, or one (or ``None``) per replica: when a member of
        a group dies, the others are stopped, and with *restart* the group starts again as
        a whole (``docs/pool.md``). If a replica does not start, the others are stopped and
        its :class:`~enginecore.stage.StageStartupError` is raised."""
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
        return cls._opened(
            with_groups(launch_specs(factory, kwargs, replicas, options), group),
            routing=routing,
            restart=restart,
            on_replica_death=on_replica_death,
            max_migrations=max_migrations,
            ordered_events=ordered_events,
        )

    @classmethod
    def launch_on_ray(
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
    ) -> StagePool:
        """Place *replicas* stages running ``factory(**kwargs)`` on Ray, in parallel,
        and return their pool (``docs/ray.md``). *placement*: one
        :class:`~enginecore.stage.ray.RayPlacement` for every replica, or one per replica
        (e.g. the bundles of a placement group). The other options are
        :func:`enginecore.stage.ray.launch_on_ray`'s: CURVE unless *insecure* (your own keys
        with *curve*, *stage_secret_key* and *authorized_clients*), heartbeats
        (a replica silent for *heartbeat_timeout* is dead), and the stage options. An
        actor's death is a :class:`~enginecore.stage.ReplicaDeadError` for that replica
        within a second; with *restart*, the replica's actor is placed again. *group*:
        restart groups, as :meth:`launch`'s (e.g. the ranks of one placement group, which
        must restart together). Each replica's stage is named ``"<name or
        factory>/r<i>"``. If one does not start, the others are stopped and its
        :class:`~enginecore.stage.StageStartupError` is raised."""
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
        return cls._opened(
            with_groups(ray_specs(factory, kwargs, replicas, placement, options), group),
            routing=routing,
            restart=restart,
            on_replica_death=on_replica_death,
            max_migrations=max_migrations,
            ordered_events=ordered_events,
        )

    @classmethod
    def connect(
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
    ) -> StagePool:
        """Connect to headless stages (``python -m enginecore serve``) at *addresses* and
        return their pool; heartbeats as
        :meth:`StageClient.connect <enginecore.stage.StageClient.connect>`'s, and so is
        *curve* (:class:`~enginecore.stage.CurveKeys`, for stages served with CURVE; the
        same keys for every address, or per replica with ``add_replica(address=...,
        curve=...)``). A connected replica that dies stays out (the pool cannot start it
        again)."""
        options = {
            "timeout": timeout,
            "heartbeat_interval": heartbeat_interval,
            "heartbeat_timeout": heartbeat_timeout,
            "curve": curve,
        }
        specs = connect_specs(addresses, options)
        return cls._opened(
            specs,
            routing=routing,
            on_replica_death=on_replica_death,
            max_migrations=max_migrations,
            ordered_events=ordered_events,
        )

    def add_replica(
        self,
        factory: str | None = None,
        /,
        kwargs: dict[str, Any] | None = None,
        *,
        address: str | None = None,
        **options: Any,
    ) -> Replica:
        """Add a replica while the pool serves: launch ``factory(**kwargs)`` (options as
        :meth:`launch`'s; with ``ray=RayPlacement(...)``, place it on Ray, options as
        :meth:`launch_on_ray`'s), or connect to *address* (options as :meth:`connect`'s).
        A launched replica may join a restart group (``group="name"``, see :meth:`launch`).
        Blocks until it is up; it takes requests from the next routing decision on. Raises
        what the start raises; the pool is unchanged then (the next replica added gets the
        name this one had: ``docs/pool.md``, "Building a pool"). A :meth:`close`, or a
        :meth:`remove_replica` of the new replica, while it starts stops the start (the
        half-started stage killed): this raises :class:`~enginecore.stage.StageClosedError`."""
        spec = replica_spec(factory, kwargs, address, options)
        return self._add_replicas([spec])[0]

    def _add_replicas(self, specs: list[dict[str, Any]]) -> list[Replica]:
        with self._lock:
            self._check_open()
            new = [self._core.new_replica(spec) for spec in specs]
        errors: list[BaseException] = []
        if len(new) == 1:
            try:
                self._start(new[0])
            except BaseException as exc:
                errors.append(exc)
        else:
            with concurrent.futures.ThreadPoolExecutor(len(new)) as ex:
                futures = [ex.submit(self._start, r) for r in new]
                try:
                    for fut in futures:
                        failed = fut.exception()
                        if failed is not None:
                            errors.append(failed)
                except BaseException:
                    # Ctrl-C in a launch (the pool then closes): the starts stop now, as a
                    # close stops them, not at their startup_timeout, which the executor's
                    # exit would wait for before the interrupt went on.
                    self._stop_starts()
                    raise
        if errors:
            for r in new:
                self._stop_member(r, drain=None, timeout=5.0)
            with self._lock:
                self._core.add_failed(new)
            if self._closed.is_set() and isinstance(errors[0], StageClosedError):
                raise StageClosedError("this stage pool is closed") from errors[0]
            raise errors[0]
        with self._lock:
            removed = [r for r in new if r._client is None and removed_meanwhile(r, self._core)]
        if removed:  # remove_replica() stopped its start
            raise removed_while_starting(removed[0])
        return new

    _stream_type = PoolRequestStream

    def _wake(self, stream: PoolRequestStream) -> None:
        stream._wakeup.put(None)  # type: ignore[union-attr]  # made before it waited

    def _wake_events(self) -> None:
        self._event_wakeup.put(None)

    def _member_apply(self, member: Any, d: Deliveries[Any, Any]) -> None:
        StageClient._apply(member, d)

    def _start(self, replica: Replica) -> None:
        """Start *replica*'s member client and make it serve. Raises what the start raises
        (the replica is then left ``starting``, for the caller to settle)."""
        self._start_all([replica])

    def _start_all(self, replicas: Sequence[Replica]) -> None:
        """Start the member clients of *replicas* (in parallel), then make them serve; if
        one does not start, close those that did and raise its error (the replicas are
        then left ``starting``, for the caller to settle). A replica that died (or whose
        group died), was removed, or whose pool closes meanwhile is not made to serve: its
        new member is closed."""
        with self._lock:
            generations = [r._generation for r in replicas]
        members: list[_Member | None] = [None] * len(replicas)
        failures: list[tuple[Replica, BaseException]] = []
        if len(replicas) == 1:
            try:
                members[0] = self._open_member(replicas[0])
            except BaseException as exc:
                failures.append((replicas[0], exc))
        else:
            with concurrent.futures.ThreadPoolExecutor(len(replicas)) as ex:
                futures = [ex.submit(self._open_member, r) for r in replicas]
                for i, fut in enumerate(futures):
                    failed = fut.exception()
                    if failed is None:
                        members[i] = fut.result()
                    else:
                        failures.append((replicas[i], failed))
        with self._lock:  # a start that its replica's removal stopped is no failure
            errors = [exc for r, exc in failures if not removed_meanwhile(r, self._core)]
        if errors:
            for m in members:
                if m is not None:
                    m.close()
            raise errors[0]
        for replica, member, generation in zip(replicas, members, generations, strict=True):
            if member is None:
                continue  # removed while it started: its start was stopped
            member._replica = replica
            member._session.label = f"replica {replica.name}"  # its warnings say which
            member._pool = self
            on_ray = "ray" in replica.spec
            if on_ray:  # a key rotation may have come while it was placed: before it serves
                from .ray import catch_up_keys

                catch_up_keys(replica, member)
            with self._lock:
                serving = self._core.started(replica, member, generation)
            if not serving:  # removed, dead with its group, or the pool closes
                member.close()
                continue
            if on_ray:  # and one that came since, before a rotation could see it serve
                catch_up_keys(replica, member)
            if self._events is not None:
                member._event_sink = functools.partial(self._member_events, member)
                self._member_events(member)  # what came before the sink was set
            failure = member._session.failure
            if failure is not None:  # died before _pool was set: nobody saw it
                self._member_gone(member, failure)

    def _stop_starts(self) -> None:
        """Stop every start under way, and any that begins from now on: each one's
        half-started stage is killed and its launch raises :class:`StageClosedError`."""
        with self._lock:
            self._starts_stopped = True
            for start in self._starts.values():
                start.stop()

    def _open_member(self, replica: Replica) -> _Member:
        """Open *replica*'s member client; a close, or a removal of the replica, stops the
        start (:class:`StageClosedError`, the half-started stage killed)."""
        start = _Start()
        with self._lock:
            self._starts[replica] = start
            if self._starts_stopped or removed_meanwhile(replica, self._core):
                start.stop()  # the pool closes, or the replica was removed, meanwhile
        try:
            return self._open_member_with(replica, start.wait_end)
        finally:
            with self._lock:
                if self._starts.get(replica) is start:
                    del self._starts[replica]
                start.close()

    def _open_member_with(
        self, replica: Replica, cancel: multiprocessing.connection.Connection
    ) -> _Member:
        plan = member_plan(replica)
        events = self._events is not None  # each member keeps its events for the pool's
        if plan[0] == "connect":
            member = _Member._open(
                plan[1]._replace(ordered_events=events),
                self._lock,
                self._hub,
                cancel=cancel,  # a close (or removal) cuts the handshake short
            )
        elif plan[0] == "ray":
            from .ray import open_on_ray

            member = open_on_ray(
                plan[1],
                lambda t: _Member._open(t._replace(ordered_events=events), self._lock, self._hub),
                cancel=cancel,  # a close (or removal) stops the placement's wait
            )
        else:
            _, factory, kwargs, startup_timeout, options, ping_s = plan
            member = _Member._launch(
                factory,
                kwargs,
                startup_timeout,
                events,
                options,
                ping_s=ping_s,
                lock=self._lock,
                hub=self._hub,
                cancel=cancel,
            )
        assert isinstance(member, _Member)
        return member

    # -- the replicas ------------------------------------------------------------------------

    # -- requests ----------------------------------------------------------------------------

    @overload
    def add(
        self,
        req_id: str,
        data: Any,
        stream: Literal[True] = True,
        *,
        key: Hashable | None = None,
    ) -> PoolRequestStream: ...
    @overload
    def add(
        self, req_id: str, data: Any, stream: Literal[False], *, key: Hashable | None = None
    ) -> None: ...
    @overload
    def add(
        self, req_id: str, data: Any, stream: bool, *, key: Hashable | None = None
    ) -> PoolRequestStream | None: ...

    def add(
        self, req_id: str, data: Any, stream: bool = True, *, key: Hashable | None = None
    ) -> PoolRequestStream | None:
        """Send request *req_id* with *data* to one replica (the pool's routing; *key*
        names a home for :class:`~enginecore.stage.Sticky` routing) and return the stream
        of its outputs. With ``stream=False`` there is no stream and ``None`` is returned:
        the request's events appear only in the pool's event stream (:meth:`get_events`;
        the pool must have been made with ``ordered_events=True``, else
        :class:`RuntimeError`), and it counts in its replica's in-flight count until its
        last event. Raises :class:`TypeError` (before sending) if *data* is not
        wire-encodable, :class:`ValueError` if *req_id* is live in this pool,
        :class:`~enginecore.stage.NoReplicaError` if no replica serves, and
        :class:`~enginecore.stage.StageClosedError` after :meth:`close`. Never blocks;
        thread-safe."""
        if stream is True:
            return self._add_one(req_id, data, key)
        if stream is not False:  # "no" would make a stream
            _clientbase.check_flag(stream, "stream")
        self._add_quiet(req_id, data, key)
        return None

    @overload
    def add_many(
        self, items: Iterable[tuple[str, Any]], *, streams: Literal[True] = True
    ) -> list[PoolRequestStream]: ...
    @overload
    def add_many(self, items: Iterable[tuple[str, Any]], *, streams: Literal[False]) -> None: ...
    @overload
    def add_many(
        self, items: Iterable[tuple[str, Any]], *, streams: bool
    ) -> list[PoolRequestStream] | None: ...

    def add_many(
        self, items: Iterable[tuple[str, Any]], *, streams: bool = True
    ) -> list[PoolRequestStream] | None:
        """Send many ``(req_id, data)`` requests, spread over the replicas by the pool's
        routing (one frame per replica), and return their streams in order
        (``streams=False``: ``None``, as :meth:`add` with ``stream=False``). All or
        nothing before sending: :class:`TypeError` for a bad pair or payload,
        :class:`ValueError` for an id live in this pool or repeated; else as
        :meth:`add`. Never blocks; thread-safe.

        A replica whose stage has a bound on frames (``serve --max-message-bytes``) that its
        part is over gets it in several frames, each within the bound (as
        :meth:`StageClient.add_many <enginecore.stage.StageClient.add_many>`: its stage may
        step between them). Every replica's part is built and checked before any is sent:
        a request too large for its replica (alone, or an array over the bound) raises
        :class:`~enginecore.stage.MessageTooLargeError` with nothing sent to any replica."""
        out = self._add_many(items, streams)
        return out if streams else None

    def abort(self, req_ids: Sequence[str]) -> None:
        """Abort *req_ids* on the replicas that serve them (ids not live in this pool are
        ignored). Their streams stop once the stage has applied the abort. Raises
        :class:`TypeError` for a bare ``str``. To a replica with a bound on frames that its
        ids' ``abort`` is over, they go in several, each within it. Never blocks;
        thread-safe."""
        self._abort(req_ids)

    # -- the event stream --------------------------------------------------------------------

    def get_event(self, timeout: float | None = None) -> PoolEvent:
        """The next event of the pool's event stream (needs ``ordered_events=True``, else
        :class:`RuntimeError`): every replica's events, each replica's in its stage's
        order, with no order between two replicas (``docs/pool.md``). A request's events
        are the stage's (:class:`~enginecore.stage.Outputs`,
        :class:`~enginecore.stage.Aborted`, :class:`~enginecore.stage.ErrorReport`), or
        the pool's :class:`~enginecore.stage.RequestFailed`; a replica's are a
        :class:`~enginecore.stage.ReplicaEvent` or :class:`~enginecore.stage.ReplicaGone`.

        Blocks up to *timeout* seconds (:class:`TimeoutError`; :class:`ValueError` if
        negative). Once the pool is closed and every event has been read, raises
        :class:`StopIteration`. Thread-safe; each event goes to one consumer."""
        if timeout is not None:  # checked as a wait checks it, an event ready or not
            _clientbase.deadline_after(timeout)
        buf = self._events
        if buf:
            try:
                item = buf.popleft()
            except IndexError:  # another consumer took the last one
                pass
            else:
                if type(item) is not _session.End:
                    return item  # type: ignore[no-any-return]
                _session.raise_end(item, StopIteration)
        return self._read_events(timeout, every=False)[0]  # type: ignore[no-any-return]

    def get_events(self, timeout: float | None = None) -> list[PoolEvent]:
        """Every event already received, at least one: the batch form of
        :meth:`get_event`, for consumers that handle whole steps at once. Blocks only while
        there is none, up to *timeout* seconds; raises like :meth:`get_event`, but only
        once every event before the end has been returned. Thread-safe."""
        return self._read_events(timeout, every=True)

    def events(self) -> Iterator[PoolEvent]:
        """Iterate over :meth:`get_event` until the pool is closed. Blocks between
        events."""
        while True:
            try:
                event = self.get_event()
            except StopIteration:
                return
            yield event

    def _read_events(self, timeout: float | None, *, every: bool) -> list[Any]:
        buf = self._events
        if buf is None:
            raise events_off()
        deadline = _clientbase.deadline_after(timeout)
        # One waiting consumer at a time, so one wake-up token suffices.
        if not self._event_lock.acquire(
            timeout=-1 if timeout is None or deadline is None else timeout
        ):
            raise TimeoutError(f"no pool event within {timeout} s")
        try:
            while True:
                out = _session.take_events(buf, every)
                if out:
                    break
                with self._lock:
                    if buf:
                        continue
                    if self._events_closed:
                        raise StopIteration
                    self._events_waiting = True
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    self._event_wakeup.get(timeout=left)
                except queue.Empty:
                    with self._lock:
                        self._events_waiting = False
                    if not buf:
                        raise TimeoutError(f"no pool event within {timeout} s") from None
        finally:
            self._event_lock.release()
        return _session.events_before_end(out, StopIteration)

    # -- utilities ---------------------------------------------------------------------------

    def call_utility(
        self,
        name: str,
        /,
        *args: Any,
        timeout: float | None = None,
        replica: Replica | None = None,
        broadcast: bool = False,
    ) -> Any:
        """Call ``engine.utility(name, args)`` on one replica (*replica*, one of
        :attr:`replicas`: :class:`ValueError` for another, :class:`NoReplicaError` for one
        removed or not serving; else the least loaded) and return its result, raising as
        :meth:`StageClient.call_utility <enginecore.stage.StageClient.call_utility>` does
        (:class:`~enginecore.stage.ReplicaDeadError` if the replica dies first).

        With *broadcast*, call it on every serving replica at once and return
        ``{replica: result or exception}`` (the exceptions are returned, not raised;
        *timeout* bounds the whole wait, and a replica that has not answered by then gets a
        :class:`TimeoutError`; :class:`NoReplicaError` if no replica serves). Thread-safe."""
        _clientbase.check_flag(broadcast, "broadcast")  # "no" would broadcast
        if broadcast:
            if replica is not None:
                raise TypeError("call_utility() takes replica= or broadcast=True, not both")
            return self._broadcast(name, args, timeout)
        member: _Member = self._utility_target(replica)
        return member.call_utility(name, *args, timeout=timeout)

    def _broadcast(
        self, name: str, args: tuple[Any, ...], timeout: float | None
    ) -> dict[Replica, Any]:
        deadline = _clientbase.deadline_after(timeout)  # a bad one raises before a send
        futures: dict[Replica, concurrent.futures.Future[Any]] = {}
        out: dict[Replica, Any] = {}
        for r in self._serving():
            try:
                futures[r] = r._client.call_utility_future(name, *args)
            except Exception as exc:
                out[r] = exc
        for r, fut in futures.items():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                out[r] = fut.result(left)
            except concurrent.futures.TimeoutError:
                fut.cancel()
                out[r] = TimeoutError(f"utility {name!r:.200} did not answer within {timeout} s")
            except Exception as exc:
                out[r] = exc
        return out

    def stats(self, timeout: float | None = 10.0) -> dict[Replica, StageStatistics | Exception]:
        """Every serving replica's statistics (:meth:`StageClient.stats
        <enginecore.stage.StageClient.stats>`), as ``{replica: statistics or exception}``:
        asked of every replica at once, so *timeout* bounds the whole wait (a replica that
        has not answered by then gets a :class:`TimeoutError`). Thread-safe.
        :class:`NoReplicaError` if no replica serves (every one dead, failed, starting or
        draining), as :meth:`add` raises; :class:`~enginecore.stage.StageClosedError` once
        the pool is closed (during a ``shutdown(drain=...)``, the replicas draining are
        asked, as a draining client's ``stats()`` is taken)."""
        deadline = _clientbase.deadline_after(timeout)  # ValueError if negative
        asked: dict[Replica, Any] = {}
        for r in self._serving(stats=True):
            member: _Member = r._client
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            try:
                asked[r] = (member, member._start_call("stats", (), future, stats=True), future)
            except Exception as exc:
                asked[r] = exc
        out: dict[Replica, StageStatistics | Exception] = {}
        for r, call in asked.items():
            if isinstance(call, Exception):
                out[r] = call
                continue
            member, call_id, future = call
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                out[r] = StageStatistics.from_wire(future.result(left))
            except concurrent.futures.TimeoutError:
                member._forget_call(call_id)  # the late answer is dropped
                out[r] = TimeoutError(f"stats did not answer within {timeout} s")
            except Exception as exc:
                out[r] = exc
        return out

    # -- membership --------------------------------------------------------------------------

    def remove_replica(
        self, replica: Replica, *, drain: bool = True, timeout: float = 30.0
    ) -> int | None:
        """Take *replica* out of the pool while it serves. It leaves the routing at once;
        with *drain*, its live requests run to completion first (at most *timeout*
        seconds; those still live then are aborted by the stage and end with
        :class:`~enginecore.stage.RequestError`); without, they end with
        :class:`~enginecore.stage.StageClosedError`. A launched replica is stopped, a
        connected one detached from. Returns the exit code (``None`` if unknown). Blocks:
        with *drain*, at most *timeout* seconds plus 1 s for the stage to exit, then
        SIGTERM, one more second, and SIGKILL (a stopped or stuck stage); without, at most
        *timeout* (5 s at most) for the exit, then the same signals. *timeout* must be a
        finite number of seconds >= 0 (checked before the replica leaves the routing).

        A replica that does not serve is removed at once: a dead or failed one, and one
        that starts (again, or by an :meth:`add_replica` that waits for it), whose start
        is stopped as :meth:`close` stops it (the half-started stage killed). Returns
        then the exit code of its last stage (``None`` if it never had one); that
        :meth:`add_replica` raises :class:`~enginecore.stage.StageClosedError`. In a
        restart group, the other members' starts go on.

        A :meth:`close` (or :meth:`shutdown` without a drain) while the replica drains
        cuts the drain short: the stage stops at once, its requests still live end with
        :class:`~enginecore.stage.StageClosedError` as the close ends every other one,
        the replica is removed, and this call raises
        :class:`~enginecore.stage.StageClosedError` (a ``shutdown(drain=...)`` does not
        cut it: the removal waits for the pool's drain and returns the exit code). So
        does a call without *drain* for
        the same replica (another thread's): it stops the stage as a close would (one that
        does not stop is signalled after its *timeout*) and returns the exit code.

        Once the pool closes (:meth:`close`, :meth:`shutdown`), this raises
        :class:`~enginecore.stage.StageClosedError`, as :meth:`add_replica` does (not
        while a ``shutdown(drain=...)`` drains the pool: see above)."""
        _clientbase.check_flag(drain, "drain")  # "no" would drain
        timeout = removal_timeout(timeout)
        with self._lock:
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
            start = self._starts.get(replica)
            if start is not None:  # its half-started stage is killed now, as a close does
                start.stop()
        if start is not None:  # (a kill and a reap: at once, unless a handshake is stuck)
            start.done.wait(min(timeout, STOP_EXIT_S))
        code, cut, owner, by_removal = None, False, False, False
        if was in (ReplicaState.SERVING, ReplicaState.DRAINING, ReplicaState.STARTING):
            if drain:
                with self._lock:
                    # A close has begun: it stops the stage now (a drained shutdown
                    # drains it: the removal waits for that drain, uncut).
                    if self._core.closing and not self._core.draining:
                        cut, drain = True, False
                    else:
                        self._drains.add(replica)
                        owner = True
            try:
                if cutting:
                    self._cut_now(replica, min(timeout, STOP_EXIT_S))
                code = self._stop_member(
                    replica,
                    drain=timeout if drain else None,
                    timeout=DRAIN_EXIT_S if drain else min(timeout, STOP_EXIT_S),
                )
            finally:
                if owner:  # the drained removal: it reads, and clears, whether it was cut
                    with self._lock:
                        self._drains.discard(replica)
                        cut = cut or replica in self._cut
                        by_removal = replica in self._cut_by_removal and not self._core.closing
                        self._cut.discard(replica)
                        self._cut_by_removal.discard(replica)
        elif replica._client is not None:  # dead or failed: its last stage's exit code
            code = replica._client.exit_code
        with self._lock:
            self._core.set_state(replica, ReplicaState.REMOVED)
        if cut:
            raise drain_cut_error(replica, by_removal=by_removal)
        return code

    def _cut_now(self, replica: Replica, timeout: float) -> None:
        """A removal without a drain cuts short the drain of *replica* that another one
        waits for: stop its stage at once, as a close does (:func:`cut_drain`), and signal
        it after *timeout* if it has not exited (stopped, stuck)."""
        member: _Member | None = replica._client
        if member is None:
            return
        cut_drain(member)
        launched = member._launched
        if launched is not None and not launched.wait_exit(timeout):
            for sig, wait in escalate_steps(member):
                launched.send_signal(sig)
                if launched.wait_exit(wait):
                    break

    def _stop_member(self, replica: Replica, *, drain: float | None, timeout: float) -> int | None:
        member: _Member | None = replica._client
        if member is None:
            return None
        if member._launched is not None:
            return member.shutdown(timeout, drain=drain)
        if drain is not None:  # a connected stage: wait for the pool's requests, then detach
            deadline = time.monotonic() + drain
            while member._session.in_flight and member._session.failure is None:
                if time.monotonic() >= deadline or self._closed.is_set() or replica in self._cut:
                    break
                time.sleep(0.01)
        member.close()
        return None

    # -- a dead replica ----------------------------------------------------------------------

    def _member_gone(self, member: _Member, failure: BaseException) -> None:
        replica = member._replica
        with self._lock:
            if replica._client is not member:
                return  # an old member of a restarted replica
            death = self._core.died(replica, time.monotonic())
        if isinstance(failure, StageClosedError):
            return  # the pool closed it, and closes it
        if at_exit():
            return  # a pool never closed, its stages stopped as the program ends
        logger.warning("enginecore: replica %s is gone: %s", replica.name, failure)
        self._spawn(self._supervise, replica, member, death)

    def _supervise(self, replica: Replica, member: _Member, death: Death) -> None:
        """Thread: release a dead member and stop the rest of its restart group; with a
        delay, start the replica (or its whole group) again then, and again after each
        failed start, until it serves, fails for good or the pool closes."""
        self._stop_group(replica, death.stop)
        member.close()
        with self._lock:
            self._exit_codes[replica] = member.exit_code
        delay, group = death.delay, death.restart
        while delay is not None:
            if self._closed.wait(delay):
                return
            with self._lock:
                starting = [r for r in group if self._core.restarting(r)]
            if not starting:
                return
            names = ", ".join(r.name for r in starting)
            try:
                self._start_all(starting)
                # (one removed while it started is not: its new stage was closed)
                served = [r.name for r in starting if r.state is ReplicaState.SERVING]
                if served:
                    logger.warning("enginecore: replica %s started again", ", ".join(served))
                return
            except Exception as exc:
                if self._closed.is_set():
                    return  # the pool closes (and cancelled the start)
                logger.warning("enginecore: replica %s did not start again: %s", names, exc)
                with self._lock:
                    left = [r for r in starting if r.state is ReplicaState.STARTING]
                    if not left:  # removed meanwhile, or the pool closes
                        return
                    death = self._core.died(left[0], time.monotonic())
                self._stop_group(left[0], death.stop)
                delay, group = death.delay, death.restart

    def _stop_group(self, dead: Replica, stop: Sequence[Replica]) -> None:
        """Stop the members of *dead*'s restart group that still served (the core marked
        them dead): at once, so that their requests end now, then close them."""
        members = [(r, r._client) for r in stop]
        for r, m in members:
            fail_with_group(m, r, dead)
        for r, m in members:
            m.close()
            with self._lock:
                self._exit_codes[r] = m.exit_code

    def _spawn(self, target: Any, *args: Any) -> None:
        def run() -> None:
            try:
                target(*args)
            except Exception:
                logger.exception("enginecore: a replica pool thread failed")
            finally:
                with self._lock:
                    self._threads.discard(thread)

        thread = threading.Thread(target=run, name="enginecore-pool", daemon=True)
        with self._lock:
            self._threads.add(thread)
            thread.start()  # in the lock: shutdown() never joins a thread not yet started

    # -- closing -----------------------------------------------------------------------------

    def shutdown(
        self, timeout: float = 5.0, *, drain: float | None = None
    ) -> dict[Replica, int | None]:
        """Stop every replica (connected ones too) as
        :meth:`StageClient.shutdown <enginecore.stage.StageClient.shutdown>` does, all at
        once, with *drain* if given; return ``{replica: exit code}`` for the replicas in
        the pool as it closed (a restarted one's current stage's code; a dead one's, its
        last stage's; not those removed before). Pending calls and
        streams then raise :class:`~enginecore.stage.StageClosedError` (or keep the error
        they had). Blocks; idempotent."""
        _session.check_shutdown_timeout(timeout)  # a bad timeout or drain raises before
        _session.shutdown_frame(drain)  # anything is stopped
        return self._close(stop=True, timeout=timeout, drain=drain)

    def close(self) -> None:
        """Release the pool: launched replicas are shut down, connected ones detached
        from (a replica that :meth:`remove_replica` drains too: its drain is cut short).
        Blocks; idempotent."""
        self._close(stop=False, timeout=5.0, drain=None)

    def __enter__(self) -> StagePool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _close(
        self, *, stop: bool, timeout: float, drain: float | None
    ) -> dict[Replica, int | None]:
        with self._close_lock:
            if self._closed_done:
                return dict(self._shutdown_codes)
            with self._lock:
                self._core.begin_close(drain is not None)
                replicas = list(self._core.replicas)
                cut = [r for r in self._drains if drain is None]
                self._cut.update(cut)
            self._closed.set()
            for r in cut:  # a removal's drain under way stops now, as the others do
                if r._client is not None:
                    cut_drain(r._client)
            self._stop_starts()  # starts in progress stop waiting

            def stop_one(r: Replica) -> None:
                member: _Member | None = r._client
                if member is None:
                    return
                launched = member._launched
                if r in cut and launched is not None and not launched.wait_exit(timeout):
                    # Its removal waits for the drain's end: a stage that did not stop on
                    # the cut (stopped, stuck) is signalled now, as the others are.
                    for sig, wait in escalate_steps(member):
                        launched.send_signal(sig)
                        if launched.wait_exit(wait):
                            break
                if stop or member._launched is not None:
                    code = member.shutdown(timeout, drain=drain)
                else:
                    member.close()
                    code = None
                with self._lock:
                    # Its current stage's: a restarted replica's dead stage's code is old.
                    if code is not None or r not in self._exit_codes:
                        self._exit_codes[r] = code

            if replicas:
                with concurrent.futures.ThreadPoolExecutor(len(replicas)) as ex:
                    futures = [(r, ex.submit(stop_one, r)) for r in replicas]
                    for r, fut in futures:
                        exc = fut.exception()
                        if exc is not None:
                            logger.warning("enginecore: closing %s failed: %r", r._described, exc)
            while True:  # restart timers see _closed and return
                with self._lock:
                    threads = [t for t in self._threads if t is not threading.current_thread()]
                if not threads:
                    break
                for t in threads:
                    t.join()
            with self._lock:
                left = self._core.live_streams()
            closed = StageClosedError("this stage pool is closed")
            for s in left:  # moving between replicas as the pool closed
                self._end(s, closed)
            with self._lock:
                self._core.closed()
            self._end_events()
            self._hub.close()
            # The replicas of the pool as it closed (not those removed before it).
            codes = self._exit_codes
            self._shutdown_codes = {r: codes[r] for r in replicas if r in codes}
            self._closed_done = True
            return dict(self._shutdown_codes)
