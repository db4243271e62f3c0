"""What the blocking and the asyncio replica pool share besides the decisions
(``_pool_core``): the operations that never wait (route and send requests, aborts; what
becomes of a dead member's requests and calls) and the read-only properties. The pools add
the waiting: starting, stopping and restarting replicas, utility calls."""

from __future__ import annotations

import collections
import contextlib
import logging
import signal
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Final, Generic, TypeVar

import zmq

from . import _clientbase, _session
from ._clientbase import ClientBase, Target, check_heartbeat
from ._errors import EngineDeadError, NoReplicaError, StageClosedError, positive_seconds
from ._pool_core import (
    DeathHook,
    PoolCore,
    PoolRequest,
    QuietRequest,
    Replica,
    ReplicaEvent,
    ReplicaGone,
    ReplicaState,
    RequestFailed,
    RestartPolicy,
    Routing,
    ScoreFn,
)
from ._session import ClientSession, Deliveries, End, StageHealth, StreamCore, abort_ids
from ._wire import Aborted, ErrorReport, Outputs

__all__ = [
    "DRAIN_EXIT_S",
    "PoolBase",
    "PoolStreamCore",
    "connect_specs",
    "cut_drain",
    "escalate_steps",
    "fail_with_group",
    "launch_specs",
    "member_plan",
    "replica_spec",
    "with_groups",
]

logger = logging.getLogger("enginecore.stage")


class PoolStreamCore(StreamCore):
    """What a pool adds to a member's stream: the replica that serves it, the request
    (kept only for ``on_replica_death``), and how often it moved. The concrete streams
    (:class:`~enginecore.stage.PoolRequestStream`,
    :class:`~enginecore.stage.AsyncPoolRequestStream`) hold the slots; a stream of
    ``add_many()`` gets them just after its frame left, so readers use ``getattr``."""

    __slots__ = ()
    _aborted: bool  # set by abort() with on_replica_death: the request never moves
    _migrations: int
    _replica: Replica
    _request: PoolRequest | None

    @property
    def replica(self) -> Replica | None:
        """The replica serving the request now."""
        return getattr(self, "_replica", None)

    @property
    def migrations(self) -> int:
        """How many times the request moved to another replica after a death."""
        return getattr(self, "_migrations", 0)


S = TypeVar("S", bound=PoolStreamCore)

# The events of a stage that a pool's event stream passes on as they are: each concerns one
# request, whose id is unique in the pool. The others are a ReplicaEvent.
_REQUEST_EVENTS: Final = frozenset({Outputs, Aborted})


_CLOSED: Final = End(None)  # the end of a pool's event stream: it closed


def events_off() -> RuntimeError:
    """What reading a pool's event stream (or adding a request without a stream) raises on
    a pool made without it."""
    return RuntimeError("the event stream is off; create the pool with ordered_events=True")


def launch_specs(
    factory: str, kwargs: dict[str, Any] | None, replicas: int, options: dict[str, Any]
) -> list[dict[str, Any]]:
    """The specs of *replicas* launched replicas (``launch()``); :class:`TypeError` for a
    count that is not an ``int``, :class:`ValueError` for fewer than one, and as
    :func:`check_ping_interval` for the options' ``ping_interval``."""
    if isinstance(replicas, bool) or not isinstance(replicas, int):
        raise TypeError(f"replicas must be an int, got {type(replicas).__name__}")
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    check_launch_options(options)
    return [{"factory": factory, "kwargs": kwargs, **options}] * replicas


def check_launch_options(options: dict[str, Any]) -> None:
    """Check what a launched replica's *options* hold that the pool uses before its stage
    starts: ``ping_interval`` (:func:`check_ping_interval`) and ``name`` (a ``str`` or
    ``None``: :class:`TypeError`, as ``StageClient.launch()`` raises; the pool makes
    ``"<name>/r<i>"`` of it, which would take any object)."""
    check_ping_interval(options)
    name = options.get("name")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")


def check_ping_interval(options: dict[str, Any]) -> None:
    """Check the ``ping_interval`` in a launched replica's *options*, if any: a positive,
    finite number of seconds (:class:`TypeError`, :class:`ValueError`). Checked before
    anything starts: a bad one would make the replica flap between stalled and serving,
    or stop the pool's receiver."""
    positive_seconds(options.get("ping_interval", _session.LAUNCHED_PING_S), "ping_interval")


def with_groups(
    specs: list[dict[str, Any]], group: str | Sequence[str | None] | None
) -> list[dict[str, Any]]:
    """*specs* with their restart groups (``launch(group=...)``): one group for every
    replica, or one (or ``None``) per replica. Checked before anything starts."""
    if group is None:
        return specs
    if isinstance(group, str):
        groups: list[str | None] = [group] * len(specs)
    elif not isinstance(group, Sequence):
        raise TypeError(
            f"group must be a str, or a sequence of one str or None per replica, "
            f"got {type(group).__name__}"
        )
    else:
        groups = list(group)
        if len(groups) != len(specs):
            raise ValueError(f"group lists {len(groups)} groups for {len(specs)} replicas")
    for g in groups:
        if g is not None and (not isinstance(g, str) or not g):
            raise TypeError(f"group must be a non-empty str or None, got {g!r}")
    return [{**spec, "group": g} for spec, g in zip(specs, groups, strict=True)]


def fail_with_group(member: Any, replica: Replica, dead: Replica) -> None:
    """Stop *member*, the client of *replica*, because *dead*, a member of its restart
    group, died: its session fails at once with an
    :class:`~enginecore.stage.EngineDeadError` that says so (its requests and calls end as
    a dead replica's: :class:`~enginecore.stage.ReplicaDeadError` naming *replica*, or a
    move through ``on_replica_death``), then its stage is killed (SIGKILL, or ``ray.kill``
    for a stage placed on Ray). The caller closes *member* afterwards."""
    err = EngineDeadError(
        f"stopped with its restart group {replica.group!r}: replica {dead.name} died"
    )
    with member._lock:
        d = member._session.fail(err)
    if d is not None:
        member._apply(d)
    launched = member._launched
    if launched is not None:
        with contextlib.suppress(OSError):
            launched.send_signal(signal.SIGKILL)


DRAIN_EXIT_S: Final = 1.0
# How long remove_replica(drain=False) lets a launched stage exit before the signals (at
# most its timeout).
STOP_EXIT_S: Final = 5.0


def removal_timeout(timeout: object) -> float:
    """``remove_replica``'s *timeout*, checked before the replica leaves the routing: a
    number of seconds, finite and >= 0."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
    if not 0 <= timeout < float("inf"):  # NaN too
        raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout}")
    return float(timeout)


"""How long ``remove_replica(drain=True, timeout=t)`` waits for a launched stage's exit
after the *t* seconds of its drain (the stage aborts what is still live then, and stops)
before it signals the stage (SIGTERM, one more second, SIGKILL): a stage that is stopped
(SIGSTOP) or stuck cannot hold the removal past *t* + 2 s and its kill."""


def cut_drain(member: Any) -> None:
    """The pool closes, without a drain, while *member*'s stage drains for a
    ``remove_replica(drain=True)``: stop it now, as the close does every other replica
    (a ``shutdown`` without a drain stops a draining stage at once), so that the close does
    not wait for the drain. Its requests still live end with
    :class:`~enginecore.stage.StageClosedError`, as a close ends them (not as a death
    during a drain). The removal's own close of *member* then sees the stage's exit."""
    with member._lock:
        alive = member._session.begin_close(False)
    if alive and member._launched is not None:
        with contextlib.suppress(zmq.ZMQError, StageClosedError):
            member._send(_session.shutdown_frame(None))


def drain_cut_error(replica: Replica, *, by_removal: bool) -> StageClosedError:
    """What a ``remove_replica(drain=True)`` raises when its drain was cut short: by a
    ``remove_replica(drain=False)`` of the same replica (*by_removal*), or by the pool's
    close."""
    if by_removal:
        return StageClosedError(
            f"remove_replica({replica.name}, drain=False) cut short the drain of "
            f"{replica._described}: its requests still live ended with StageClosedError"
        )
    return StageClosedError(
        f"the stage pool closed while {replica._described} drained: its requests still "
        "live ended with StageClosedError"
    )


def removed_meanwhile(replica: Replica, core: PoolCore) -> bool:
    """Whether *replica*, whose start failed or was stopped, was removed while it started
    (``remove_replica`` stops that start, as a close stops every start): then its start's
    failure is none, neither of its restart group nor of the ``add_replica`` (which
    raises :func:`removed_while_starting`)."""
    return not core.closing and replica.state in (ReplicaState.DRAINING, ReplicaState.REMOVED)


def removed_while_starting(replica: Replica) -> StageClosedError:
    """What an ``add_replica`` raises when ``remove_replica`` removed its replica while it
    started (the half-started stage killed)."""
    return StageClosedError(
        f"{replica._described} was removed from its stage pool while it started: its "
        "start was stopped"
    )


def escalate_steps(member: Any) -> Any:
    """A cut drain's stage (:func:`cut_drain`) did not stop within the close's timeout
    (stopped, stuck): mark the exit as the close's doing and return the signals to send,
    as a client's own close does after its timeout (SIGTERM, a second, SIGKILL)."""
    with member._lock:
        member._session.escalating()
    return _clientbase.escalate(member._session.pid, member._session.presumed_dead)


def connect_specs(addresses: Sequence[str], options: dict[str, Any]) -> list[dict[str, Any]]:
    """The specs of connected replicas (``connect()``), checked before anything opens:
    :class:`TypeError` for a bare ``str``, :class:`ValueError` for bad heartbeats."""
    if isinstance(addresses, str):
        raise TypeError("connect() takes a sequence of addresses")
    if not addresses:
        raise ValueError("connect() needs at least one address")
    for address in addresses:  # as StageClient.connect() checks them
        _clientbase.check_connect(address, options["timeout"])
    check_heartbeat(options["heartbeat_interval"], options["heartbeat_timeout"])
    return [{"address": a, **options} for a in addresses]


# The options of add_replica() for a replica the pool launches (launch()'s) and for one it
# connects to (connect()'s); a replica placed on Ray (ray=...) has its options checked by
# its plan.
_LAUNCH_OPTIONS: Final = frozenset(
    {
        "startup_timeout",
        "name",
        "step_timeout",
        "kill_after",
        "log_level",
        "forward_logs",
        "load_interval",
        "max_message_bytes",
        "ping_interval",
        "group",
    }
)
_CONNECT_OPTIONS: Final = frozenset(
    {"timeout", "heartbeat_interval", "heartbeat_timeout", "curve", "group"}
)


def replica_spec(
    factory: str | None, kwargs: dict[str, Any] | None, address: str | None, options: dict[str, Any]
) -> dict[str, Any]:
    """The spec of one replica (``add_replica()``): launched from *factory* or connected
    to *address*, one of the two."""
    if (factory is None) == (address is None):
        raise TypeError("add_replica() takes a factory or an address=, one of the two")
    if "ray" not in options:  # else checked by its plan, before anything is placed
        known = _LAUNCH_OPTIONS if factory is not None else _CONNECT_OPTIONS
        unknown = sorted(set(options) - known)
        if unknown:
            what = "a launched" if factory is not None else "a connected"
            raise TypeError(
                f"add_replica() got unexpected options {unknown} for {what} replica; it "
                f"takes {sorted(known)}"
            )
    if address is not None and options.get("group") is not None:
        raise ValueError(
            "group= is for replicas the pool launches: it cannot start a connected one again"
        )
    if factory is not None:
        if "ray" in options and "ping_interval" in options:  # it would go unused
            raise TypeError(
                "a replica placed on Ray takes no ping_interval: its liveness is its "
                "heartbeat (heartbeat_interval=, heartbeat_timeout=)"
            )
        check_launch_options(options)
        return {"factory": factory, "kwargs": kwargs, **options}
    if "ray" not in options:  # as StageClient.connect() checks them
        _clientbase.check_connect(address, options.get("timeout", 10.0))
    return {"address": address, **options}


def member_plan(replica: Replica) -> tuple[Any, ...]:
    """How to start *replica*'s member client, from its spec: ``("connect", target)``,
    ``("launch", factory, kwargs, startup_timeout, options, ping_s)``, or ``("ray",
    plan)`` for a stage placed on Ray (a spec with ``"ray": RayPlacement(...)``;
    :class:`enginecore.stage.ray.RayPlan`, with the keys of the last rotation,
    :func:`enginecore.stage.ray.authorize_clients`); the stage of a launched replica is named
    ``"<name or factory>/<replica name>"``."""
    spec = dict(replica.spec)
    if "ray" in spec:
        from .ray import plan_from_spec  # imports no Ray

        if replica._authorized_clients is not None:  # rotated since it was added
            spec["authorized_clients"] = replica._authorized_clients
        return ("ray", plan_from_spec(spec, replica.name))
    if "address" in spec:
        heartbeat = check_heartbeat(
            spec.pop("heartbeat_interval", 1.0), spec.pop("heartbeat_timeout", 5.0)
        )
        return (
            "connect",
            Target(
                spec["address"],
                spec.get("timeout", 10.0),
                None,
                heartbeat,
                False,
                spec.get("curve"),
            ),
        )
    factory = spec.pop("factory")
    kwargs = spec.pop("kwargs", None)
    startup_timeout = spec.pop("startup_timeout", 60.0)
    ping_s = spec.pop("ping_interval", _session.LAUNCHED_PING_S)
    base = spec.pop("name", None) or factory
    spec["name"] = f"{base}/{replica.name}"
    return ("launch", factory, kwargs, startup_timeout, spec, ping_s)


class PoolBase(Generic[S]):
    """The part of a pool that neither blocks nor awaits. A subclass sets ``_lock`` (the
    lock of every member's session and of the core: a lock for the blocking pool, a no-op
    for the asyncio one) and ``_stream_type``, and implements :meth:`_wake`,
    :meth:`_member_apply` and :meth:`_member_gone`."""

    _lock: Any
    _stream_type: Callable[[str, Any, float], S]

    def __init__(
        self,
        routing: Routing | ScoreFn | None,
        restart: RestartPolicy | bool,
        on_replica_death: DeathHook | None,
        max_migrations: int,
        ordered_events: bool = False,
    ) -> None:
        _clientbase.check_flag(ordered_events, "ordered_events")
        self._core = PoolCore(routing, restart, on_replica_death, max_migrations)
        # The pool's event stream (None when off): every replica's events, each replica's
        # in its order, then at most one End (the pool closed). Consumers pop from it; the
        # members' event sinks (_member_events) and the pool append, under the lock.
        self._events: collections.deque[Any] | None = (
            collections.deque() if ordered_events else None
        )
        self._events_waiting = False  # its consumer waits: the next append wakes it
        self._events_closed = False  # the End is in _events (or was read)
        # The replicas that a remove_replica(drain=True) drains now, and those of them whose
        # drain a close without a drain, or a remove_replica(drain=False), cut short (their
        # removal raises StageClosedError); _cut_by_removal: those the removal cut.
        self._drains: set[Replica] = set()
        self._cut: set[Replica] = set()
        self._cut_by_removal: set[Replica] = set()

    def _wake(self, stream: S) -> None:
        """Wake *stream*'s consumer, which waits."""
        raise NotImplementedError

    def _wake_events(self) -> None:
        """Wake the event stream's consumer, which waits."""
        raise NotImplementedError

    def _member_apply(self, member: Any, d: Deliveries[Any, Any]) -> None:
        """The member client's own ``_apply``."""
        raise NotImplementedError

    def _member_gone(self, member: Any, failure: BaseException) -> None:
        """*member*'s session has failed with *failure*: settle its replica."""
        raise NotImplementedError

    @property
    def replicas(self) -> tuple[Replica, ...]:
        """Every replica of the pool that was not removed, in the order they were added
        (dead and failed ones included: see :attr:`Replica.state`)."""
        return self._core.replicas

    def health(self) -> StageHealth:
        """``"ok"`` while a replica serves and is healthy, ``"stalled"`` while the serving
        ones are all stalled, ``"dead"`` when none serves or the pool is closed. Each
        replica's own is :attr:`Replica.health`. Never blocks on a stage."""
        if self._core.closing:
            return StageHealth.DEAD
        seen = {r.health for r in self._core.replicas if r.state is ReplicaState.SERVING}
        if StageHealth.OK in seen:
            return StageHealth.OK
        return StageHealth.STALLED if StageHealth.STALLED in seen else StageHealth.DEAD

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` / :meth:`shutdown` has begun."""
        return self._core.closing

    def _check_open(self) -> None:
        if self._core.closing:
            raise StageClosedError("this stage pool is closed")

    def _serving(self, stats: bool = False) -> list[Replica]:
        """The replicas a call on every one of them asks (``stats()``, a broadcast
        ``call_utility()``): the serving ones; :class:`NoReplicaError` if none serves, as
        ``add()`` and ``call_utility()`` raise (an empty answer would read as nothing to
        report, as a dead client's ``stats()`` does not answer either). With *stats*, also
        while a ``shutdown(drain=...)`` drains them, as a draining client's ``stats()``
        is taken (a replica whose drain is over answers its
        :class:`~enginecore.stage.StageClosedError`)."""
        if not (stats and self._core.draining):
            self._check_open()
        serving = [r for r in self._core.replicas if r.state is ReplicaState.SERVING]
        if not serving:
            raise NoReplicaError(
                "no replica serves: "
                + (
                    ", ".join(f"{r.name} {r.state.value}" for r in self._core.replicas)
                    or "none left"
                )
            )
        return serving

    def _utility_target(self, replica: Replica | None) -> Any:
        """The member client a utility call goes to: *replica*'s, else the least-loaded
        serving replica's."""
        self._check_open()
        # Not one of ours: another pool's replica or a name must not reach a member (a
        # removed replica, of this pool or another, is refused below as not serving).
        if (
            replica is not None
            and replica not in self._core._replicas
            and not (isinstance(replica, Replica) and replica.state is ReplicaState.REMOVED)
        ):
            raise ValueError(f"{replica!r} is not in this pool")
        target = replica if replica is not None else self._core.route("", None, None)
        if target._client is None or target.state is not ReplicaState.SERVING:
            raise NoReplicaError(f"replica {target.name} is {target.state.value}")
        return target._client

    def _add_one(self, req_id: str, data: Any, key: Hashable | None) -> S:
        """``add()``. A pool of one routable replica and no hook sends without routing
        (two reads: the core's ``_single`` and its epoch), with one hold of the member's
        lock; anything else goes through :meth:`_send`."""
        core = self._core
        replica = core._single
        if replica is None or core.health_epoch[0] != core._routable_epoch:
            return self._add_routed(req_id, data, key)
        parts = ClientSession.add_frame(req_id, data)
        new = self._stream_type(req_id, self._lock, time.monotonic())
        new._replica = replica
        member: ClientBase[Any, Any] = replica._client
        live = core._live
        try:
            member._send_request(req_id, parts, True, new, live)
        except (EngineDeadError, StageClosedError):
            with self._lock:
                core.untrack(req_id, new)
            if member._session.failure is None and not member._session.closing:
                raise
            return self._add_routed(req_id, data, key)
        except BaseException:
            with self._lock:
                core.untrack(req_id, new)
            raise
        if len(live) > core._prune_at:
            with self._lock:
                core._maybe_prune()
        return new

    def _add_routed(self, req_id: str, data: Any, key: Hashable | None) -> S:
        parts = ClientSession.add_frame(req_id, data)
        request = PoolRequest(req_id, data, key) if self._core.on_replica_death else None
        new: S = self._send(req_id, parts, request, key, 0, None, data=data)
        return new

    def _add_quiet(self, req_id: str, data: Any, key: Hashable | None) -> None:
        """``add(..., stream=False)``: route and send without a stream; its outputs go to
        the event stream only. The pool's table holds the replica's :class:`QuietTable`
        for it, or with ``on_replica_death`` its own record (:class:`QuietRequest`)."""
        if self._events is None:
            raise events_off()
        parts = ClientSession.add_frame(req_id, data)
        if self._core.on_replica_death is None:
            self._send(req_id, parts, None, key, 0, None, quiet=True, data=data)
            return
        request = PoolRequest(req_id, data, key)
        self._send(req_id, parts, request, key, 0, QuietRequest(req_id, request), quiet=True)

    def _send(
        self,
        req_id: str,
        parts: _session.Parts,
        request: PoolRequest | None,
        key: Hashable | None,
        migrations: int,
        stream: Any,
        *,
        quiet: bool = False,
        data: Any = None,
    ) -> Any:
        """Route and send one request; *stream* continues a moved one (its stream, or its
        :class:`QuietRequest`). A new request without a stream (*quiet*) has its record as
        *stream*, or ``None``: then the chosen replica's :class:`QuietTable` stands for
        it in the pool's table. The pool's check (the id free in the pool) and its table
        run under the member's hold of the lock that registers the stream
        (``_send_request(live=)``): one hold per request, as a single client's. A replica
        that left between the choice and the send gets the next choice instead, a few
        times. *data* is the request's, for the routing, when there is no *request*."""
        core = self._core
        if core.closing:
            raise StageClosedError("this stage pool is closed")
        live: dict[str, Any] | None
        new: Any
        if quiet:
            new, live = stream, core._live
        elif stream is None:
            new = self._stream_type(req_id, self._lock, time.monotonic())
            live = core._live
            if request is not None:  # else _request and _migrations read as their defaults
                new._request = request
        else:
            new, live = stream, None
            new._request = request
            new._migrations = migrations
            quiet = type(new) is QuietRequest
        table = quiet and new is None  # a QuietTable per replica stands for the request
        if request is not None:
            data = request.data
        try:
            for _ in range(8):
                replica = core.route(req_id, data, key)
                if table:
                    new = replica._quiet
                else:
                    new._replica = replica
                member: ClientBase[Any, Any] = replica._client
                try:
                    member._send_request(req_id, parts, not quiet, new, live)
                except (EngineDeadError, StageClosedError):
                    if member._session.failure is None and not member._session.closing:
                        raise
                    continue  # the replica went away meanwhile: route again
                if len(core._live) > core._prune_at:
                    with self._lock:
                        core._maybe_prune()
                return new
            raise NoReplicaError("no replica took the request: each one left as it was chosen")
        except BaseException:
            with self._lock:
                core.untrack(req_id, new)
            raise

    def _add_many(self, items: Iterable[tuple[str, Any]], streams: bool = True) -> list[S]:
        """``add_many()``: route, then one frame per replica. A pool of one (or a burst
        that all goes to one replica) sends the frame that checked the burst. Without
        *streams*, each request gets the pool's record (:class:`QuietRequest`) instead, and
        ``[]`` is returned."""
        if streams is not True and streams is not False:  # "no" would make streams
            _clientbase.check_flag(streams, "streams")
        if not streams and self._events is None:
            raise events_off()
        items = list(items)
        ids, whole = ClientSession.adds_frame(items)  # checks everything once
        if not ids:
            with self._lock:
                self._check_open()  # refused once closed, as a client's
            return []
        core = self._core
        if streams:
            replica = core._single
            if replica is not None and core.health_epoch[0] == core._routable_epoch:
                single = self._add_many_single(replica, ids, whole, items)
                if single is not None:
                    return single
        with self._lock:
            self._check_open()
            core.reserve(ids)
        out: list[S] | None = None
        try:
            keep = core.on_replica_death is not None
            candidates = core.candidates()
            requests: list[PoolRequest] | None = None
            if keep or len(candidates) > 1:
                requests = [PoolRequest(rid, data) for rid, data in items]
            groups: dict[Replica, list[int] | None]
            if len(candidates) == 1:
                groups = {candidates[0]: None}
            else:
                assert requests is not None
                chosen = core.assign(candidates, requests)
                index: dict[Replica, list[int]] = {}
                for i, r in enumerate(chosen):
                    index.setdefault(r, []).append(i)
                groups = dict(index) if len(index) > 1 else {chosen[0]: None}
            # Every replica's part is built, and checked against its stage's bound on
            # frames (split into frames within it), before any part is sent: a request too
            # large for its replica refuses the whole call with nothing sent anywhere.
            plan = []
            for replica, idx in groups.items():
                member: ClientBase[Any, Any] = replica._client
                group_items: list[tuple[str, Any]]
                if idx is None:  # the whole burst
                    group_ids, parts, group_items = ids, whole, items
                else:
                    group_ids = [ids[i] for i in idx]
                    group_items = [items[i] for i in idx]
                    parts = ClientSession.adds_frame(group_items)[1]
                bursts = None
                if member._max_frame is not None:
                    bursts = member._split_burst(group_ids, parts, group_items)
                plan.append((replica, idx, member, group_ids, parts, bursts))
            by_index: list[Any] = [None] * len(ids)
            for replica, idx, member, group_ids, parts, bursts in plan:
                sent: list[Any] | None
                try:
                    if streams or keep:
                        sent = member._send_requests(
                            group_ids,
                            parts,
                            streams,
                            core._live if streams else None,
                            bursts=bursts,
                        )
                    else:  # the replica's QuietTable stands for them, set before the send
                        member._send_requests(
                            group_ids, parts, False, core._live, replica._quiet, bursts=bursts
                        )
                        sent = []
                    if not streams and keep:
                        sent = self._quiet_records(member, replica, group_ids, idx, requests)
                except (EngineDeadError, StageClosedError):
                    if member._session.failure is None and not member._session.closing:
                        raise
                    sent = None
                positions = range(len(ids)) if idx is None else idx
                if sent is None:  # the replica left meanwhile: one by one to the others
                    with self._lock:
                        core.release(group_ids)
                    for i in positions:
                        rid, data = items[i]
                        frame = ClientSession.add_frame(rid, data)
                        request = requests[i] if keep and requests is not None else None
                        record = QuietRequest(rid, request) if keep and not streams else None
                        by_index[i] = self._send(
                            rid, frame, request, None, 0, record, quiet=not streams, data=data
                        )
                    continue
                if not streams:
                    continue  # the records are tracked: nothing to return
                if keep and requests is not None:
                    for i, stream in zip(positions, sent, strict=True):
                        stream._replica = replica
                        stream._request = requests[i]
                        stream._migrations = 0
                        by_index[i] = stream
                elif idx is None:  # the whole burst, in order: no hook, so _request and
                    for stream in sent:  # _migrations read as their defaults
                        stream._replica = replica
                    by_index = sent
                else:
                    for i, stream in zip(positions, sent, strict=True):
                        stream._replica = replica
                        by_index[i] = stream
                # The streams are in the pool's table already: the member put them there
                # as it registered them (the reader takes each out as it ends).
            out = by_index if streams else []
        finally:
            if out is None:
                with self._lock:
                    core.release(ids)
        return out

    def _add_many_single(
        self,
        replica: Replica,
        ids: list[str],
        whole: _session.Parts,
        items: list[tuple[str, Any]],
    ) -> list[S] | None:
        """``add_many()`` with streams on a pool of one routable replica and no hook, as
        :meth:`_add_one` sends: no reservation of the ids in the pool's table and no
        routing; the pool's check runs in the member's hold of the lock that registers
        the streams and puts them in the table. ``None``: nothing was sent (the frame
        could not leave at once, or the replica went away meanwhile), for the general
        path; so is a burst over the member's bound on frames, which the general path
        splits)."""
        core = self._core
        member: ClientBase[Any, Any] = replica._client
        live = core._live
        try:
            sent = member._send_requests(
                ids, whole, True, live, check=core.check_burst, items=items
            )
        except (EngineDeadError, StageClosedError):
            if member._session.failure is None and not member._session.closing:
                raise
            return None
        if sent is None:
            return None
        for stream in sent:  # no hook: _request and _migrations read as their defaults
            stream._replica = replica
        if len(live) > core._prune_at:
            with self._lock:
                core._maybe_prune()
        return sent

    def _quiet_records(
        self,
        member: ClientBase[Any, Any],
        replica: Replica,
        req_ids: list[str],
        idx: list[int] | None,
        requests: list[PoolRequest] | None,
    ) -> list[QuietRequest]:
        """The records of a burst without streams just sent to *member* (``idx``: their
        places in the burst, ``None`` for all of it), tracked in the pool's table. Pointed
        at the member's table of requests without a stream under the lock: if the member
        failed since the send, that table is a new, empty one, and the records read as
        ended (the pool settled the requests from the table handed over)."""
        assert requests is not None  # kept for on_replica_death
        positions = range(len(req_ids)) if idx is None else idx
        records = [
            QuietRequest(rid, requests[i]) for rid, i in zip(req_ids, positions, strict=True)
        ]
        with self._lock:
            table = member._session.quiet
            for record in records:
                record._replica = replica
                record._in = table
            self._core.track_many(req_ids, records)
        return records

    def _abort(self, req_ids: Sequence[str]) -> None:
        """``abort()``: each id to the replica that serves it."""
        ids = abort_ids(req_ids)
        by_replica: dict[Replica, list[str]] = {}
        hook = self._core.on_replica_death is not None
        with self._lock:
            if not self._core.draining:  # a drained shutdown under way takes aborts
                self._check_open()
            for rid in ids:
                stream = self._core.stream_of(rid)
                # getattr: an add_many() in another thread holds the id, or has sent it but
                # not yet marked its stream: not on a replica yet, so ignored, as an id
                # that is not live is.
                replica = getattr(stream, "_replica", None)
                if replica is not None:
                    by_replica.setdefault(replica, []).append(rid)
                    if hook:  # a stream or QuietRequest: its replica's death must not move it
                        stream._aborted = True
            sends: list[tuple[ClientBase[Any, Any], list[str]]] = []
            for replica, group in by_replica.items():
                member: ClientBase[Any, Any] | None = replica._client
                if member is not None:
                    # In the hold of the lock that found the requests: the answer is theirs,
                    # not that of a request added again with the same id after they ended.
                    member._session.note_abort(group)
                    sends.append((member, group))
        for member, group in sends:
            with contextlib.suppress(EngineDeadError, StageClosedError):
                member._send_abort(group, noted=True)  # a dead replica's streams end on their own

    def _member_failed(self, member: Any, d: Deliveries[Any, Any], failure: BaseException) -> None:
        """A member's deliveries once its session failed (on whichever thread applies
        them, without the lock): its calls get a ReplicaDeadError, its streams their fate."""
        replica = member._replica
        core = self._core
        if d.answers:
            d.answers = [
                (w, r, core.dead_error(replica, e, 0) if e is failure else e)
                for w, r, e in d.answers
            ]
        orphans = d.orphans or []
        d.orphans = None
        quiet = d.quiet_orphans
        d.quiet_orphans = None
        self._member_apply(member, d)  # the member's last events reach the event stream
        if d.over:
            # First: the core takes the replica, and the rest of its restart group, out of
            # the routing before its requests move (none may move to a member stopped next).
            self._member_gone(member, failure)
        for stream in orphans:
            err, again = core.fate(replica, stream, failure)
            if again is not None and self._move(replica, again, stream):
                continue
            self._end(stream, err)
        if quiet:
            self._settle_quiet(replica, quiet, failure)
        if d.over and self._events is not None and getattr(member, "_event_sink", None) is not None:
            self._emit(ReplicaGone(replica, core.dead_error(replica, failure, 0)))

    def _move(self, replica: Replica, again: PoolRequest, stream: Any) -> bool:
        """Send *again* (from ``on_replica_death``) to another replica, continuing
        *stream* (or a request's :class:`QuietRequest`); whether it went."""
        try:
            parts = ClientSession.add_frame(again.req_id, again.data)
            self._send(again.req_id, parts, again, again.key, stream.migrations + 1, stream)
            return True
        except Exception as exc:
            logger.warning(
                "enginecore: request %r could not move off replica %s: %s",
                again.req_id,
                replica.name,
                exc,
            )
            return False

    def _settle_quiet(
        self, replica: Replica, table: collections.Counter[str], failure: BaseException
    ) -> None:
        """The requests without a stream that *replica*'s failed member handed over
        (*table*: id -> outputs delivered): move each on (``on_replica_death``), or end it
        with one :class:`RequestFailed` in the event stream; either way, it leaves *table*
        (its record then reads as ended, unless it moved)."""
        core = self._core
        for rid, this_attempt in list(table.items()):
            record = core._live.get(rid)
            delivered = this_attempt
            if type(record) is not QuietRequest or record._in is not table:
                record = None  # an add_many() whose record was not made yet: no request
            else:
                delivered += record._earlier  # every attempt's, as a stream's arrivals
            err, again = core.fate(replica, record, failure, delivered)
            if again is not None and record is not None:
                earlier = record._earlier
                record._earlier = delivered  # before it can die again
                if self._move(replica, again, record):
                    with self._lock:
                        table.pop(rid, None)
                    continue
                record._earlier = earlier
            with self._lock:
                if rid in table:  # once, whoever settles it (a close may, meanwhile)
                    self._emit_locked(RequestFailed(rid, err))
                    del table[rid]
                    entry = core._live.get(rid)
                    if entry is not None and not entry._live_as(rid):
                        del core._live[rid]  # as the session drops the ids that end

    def _member_events(self, member: Any) -> None:
        """*member*'s event sink (its ``_event_sink``), called on the thread that read its
        frame, after the frame's deliveries: move its events to the pool's event stream,
        in order, under the lock. A request's event goes as it is; any other becomes a
        :class:`ReplicaEvent`; the member's own end is the pool's business
        (:class:`ReplicaGone`, from :meth:`_member_failed`)."""
        buf = member._session.events
        if not buf:
            return
        out = self._events
        assert out is not None
        replica = member._replica
        with self._lock:
            while buf:
                ev = buf.popleft()
                cls = ev.__class__
                if cls in _REQUEST_EVENTS or (cls is ErrorReport and ev.req_id is not None):
                    out.append(ev)
                elif cls is not End:
                    out.append(ReplicaEvent(replica, ev))
            woke = self._events_waiting
            self._events_waiting = False
        if woke:
            self._wake_events()

    def _emit(self, event: Any) -> None:
        """Append *event* to the event stream, under the lock, and wake its consumer."""
        with self._lock:
            self._emit_locked(event)

    def _emit_locked(self, event: Any) -> None:
        """:meth:`_emit`, with the lock held. Waking never blocks: it may run under it."""
        out = self._events
        if out is None:
            return
        out.append(event)
        if self._events_waiting:
            self._events_waiting = False
            self._wake_events()

    def _end_events(self) -> None:
        """The pool has closed: end the event stream (its consumer stops once it has read
        every event before)."""
        with self._lock:
            if self._events is not None and not self._events_closed:
                self._events_closed = True
                self._emit_locked(_CLOSED)

    def _end(self, stream: Any, exc: BaseException) -> None:
        """End *stream* with *exc* (once; the event stream gets its
        :class:`RequestFailed`). A request without a stream (its :class:`QuietRequest`,
        moving as the pool closed) gets only the event."""
        if type(stream) is QuietRequest:
            err = exc if isinstance(exc, Exception) else StageClosedError(str(exc))
            with self._lock:
                table = stream._in
                if stream.req_id in table:
                    self._emit_locked(RequestFailed(stream.req_id, err))
                    del table[stream.req_id]  # type: ignore[attr-defined]
            return
        with self._lock:
            if stream._ended is not None:
                return
            woke = stream._end_with(End(exc), time.monotonic())
            if self._events is not None:
                err = exc if isinstance(exc, Exception) else StageClosedError(str(exc))
                self._emit_locked(RequestFailed(stream.req_id, err))
        if woke:
            self._wake(stream)
