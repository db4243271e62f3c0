"""What the blocking and the asyncio replica pool share, without IO: the replicas and their
states, routing, the pool's table of live requests, what becomes of a dead replica's
requests, and when a dead replica is started again.

A pool is N stage clients (its *members*, one per replica) behind one front. Each member is
an ordinary :class:`~enginecore.stage.StageClient` or
:class:`~enginecore.stage.AsyncStageClient` whose session adopts its streams when it fails
(``ClientSession(adopt_orphans=True)``), so that the pool decides each one's end: a
:class:`~enginecore.stage.ReplicaDeadError`, or a move to another replica through the
user's ``on_replica_death`` hook. A stream is the member's own stream object (no wrapper):
the pool adds nothing per output.

Load. No coordinator: each pool knows its own requests on each replica exactly (the
member's live requests, ``session.in_flight``: its streams and its requests without one),
and each replica's load report (which rides on its output frames,
``docs/observability.md``) says how many requests live in the stage from every client.
The pool counts a replica's load as its own live requests plus the others' (the report's
``live`` minus the pool's own, taken when the pool first sees that report) until the next
report: a stage sends one as it goes idle, so a report that ages describes an idle stage, or
one in a long step (or with a long ``load_interval``) whose other clients' requests are still
there, not an empty one.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import logging
import math
import numbers
import random
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, NamedTuple, TypeAlias

from ._errors import (
    EngineDeadError,
    NoReplicaError,
    ReplicaDeadError,
    StageClosedError,
    positive_seconds,
)
from ._session import StageHealth
from ._wire import StageEvent

if TYPE_CHECKING:
    from ._session import ClientSession
    from ._statistics import StageLoad

__all__ = [
    "Death",
    "LeastLoaded",
    "PoolCore",
    "PoolEvent",
    "PoolRequest",
    "QuietRequest",
    "QuietTable",
    "Replica",
    "ReplicaEvent",
    "ReplicaGone",
    "ReplicaState",
    "ReplicaView",
    "RequestFailed",
    "RestartPolicy",
    "Routing",
    "Scored",
    "Sticky",
]

logger = logging.getLogger("enginecore.stage")

_EMPTY: Final[Mapping[str, float]] = MappingProxyType({})


class ReplicaState(str, enum.Enum):
    """Where a replica is in its life, as its pool sees it. A ``str``: compares equal to
    its value.

    - ``STARTING``: being launched or connected (the first time, or a restart).
    - ``SERVING``: takes requests (unless its health reads ``stalled``).
    - ``DRAINING``: being removed; takes nothing new, finishes what it has.
    - ``DEAD``: gone; its requests failed. Restarted later if the pool restarts replicas
      and it was launched by the pool, else out for good. The members of a restart group
      (``group=``) are dead together.
    - ``FAILED``: died too often (the pool's :class:`RestartPolicy`); out for good.
    - ``REMOVED``: removed from the pool (``remove_replica``).
    """

    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    DEAD = "dead"
    FAILED = "failed"
    REMOVED = "removed"


class PoolRequest(NamedTuple):
    """A request as routing and ``on_replica_death`` see it."""

    req_id: str
    data: Any
    key: Hashable | None = None


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What a routing score sees of one replica."""

    replica: Replica
    in_flight: int
    """This pool's requests live on the replica (exact)."""
    load: int
    """The replica's load as the built-in routing counts it: :attr:`in_flight`, plus this
    pool's utility calls in flight on it, plus the other clients' requests in its latest
    load report."""
    live: int | None
    """Requests live in the stage, every client's, from its latest load report; ``None``
    before the first report."""
    engine: Mapping[str, float]
    """The engine's own numbers (its ``stats()``) from that report; empty before it."""
    age: float | None
    """How old that report is, in seconds; ``None`` before the first."""


ScoreFn = Callable[[ReplicaView, PoolRequest], float]
"""``score(view, request) -> float``: the replica with the lowest score gets the request."""


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """When a pool starts a dead replica again: after *first_delay* seconds, doubling with
    each death within *window* seconds, up to *max_delay*; after *max_failures* deaths
    (failed restarts included) within *window*, the replica is marked ``failed`` and stays
    out. The replicas of a restart group (``group=``) count their deaths together: one
    member's death (or a failed start of the group) is one death of the group, which
    restarts, or fails, as a whole. The three durations are finite numbers of seconds > 0
    (:class:`TypeError`, :class:`ValueError` otherwise, naming the argument), with
    ``first_delay <= max_delay``; *max_failures* is an int >= 1."""

    first_delay: float = 0.5
    max_delay: float = 30.0
    max_failures: int = 5
    window: float = 60.0

    def __post_init__(self) -> None:
        for name in ("first_delay", "max_delay", "window"):
            positive_seconds(getattr(self, name), name)  # finite, > 0: NaN refused too
        if isinstance(self.max_failures, bool) or not isinstance(self.max_failures, int):
            raise TypeError(f"max_failures must be an int, got {type(self.max_failures).__name__}")
        if self.first_delay > self.max_delay:
            raise ValueError(
                f"need first_delay <= max_delay, got {self.first_delay} > {self.max_delay}"
            )
        if self.max_failures < 1:
            raise ValueError(f"max_failures must be an int >= 1, got {self.max_failures}")

    def delay(self, deaths: deque[float], now: float) -> float | None:
        """Record a death at *now* in *deaths* (the replica's recent deaths); the delay
        before the next start, or ``None`` once the replica has failed."""
        deaths.append(now)
        while deaths and deaths[0] <= now - self.window:
            deaths.popleft()
        if len(deaths) >= self.max_failures:
            return None
        return float(min(self.max_delay, self.first_delay * 2 ** (len(deaths) - 1)))


class Replica:
    """One replica of a pool: a stage process the pool launched, or a stage it connected
    to. Listed by ``pool.replicas``; names the replica in
    :class:`~enginecore.stage.ReplicaDeadError` and in broadcast results. Hashable (by
    identity); every property reads the pool's view now, without waiting."""

    __slots__ = (
        "_authorized_clients",
        "_client",
        "_deaths",
        "_generation",
        "_quiet",
        "_restarts",
        "_session",
        "_state",
        "group",
        "name",
        "spec",
    )

    def __init__(self, name: str, spec: Mapping[str, Any], group: str | None = None) -> None:
        self.name: Final = name
        """The replica's name in its pool: ``"r0"``, ``"r1"``, ..."""
        self.spec: Final = spec
        """How the pool starts it: ``{"factory": ..., "kwargs": ...}`` (launched; with
        ``"ray": RayPlacement(...)``, placed on Ray) or ``{"address": ...}``."""
        self.group: Final = group
        """Its restart group (``group=``), or ``None``: the replicas of a group are stopped
        when one of them dies, and started again together."""
        self._state = ReplicaState.STARTING
        self._client: Any = None  # the member client, once started
        self._session: ClientSession[Any, Any] | None = None  # its session (routing reads it)
        self._deaths: deque[float] = deque()
        self._restarts = 0
        self._quiet: QuietTable | None = None  # its member's, in a pool without a hook
        # Bumped by each death of the replica or of its group: a start begun before it no
        # longer counts (PoolCore.started(generation=)).
        self._generation = 0
        # A replica placed on Ray: the authorized_clients of the last key rotation
        # (enginecore.stage.ray.authorize_clients), which its next start uses instead of
        # its spec's.
        self._authorized_clients: tuple[bytes, ...] | None = None

    @property
    def state(self) -> ReplicaState:
        """Where the replica is in its life (:class:`ReplicaState`)."""
        return self._state

    @property
    def launched(self) -> bool:
        """Whether the pool launched it (else it connected to a running stage)."""
        return "factory" in self.spec

    @property
    def address(self) -> str | None:
        """Its stage's input address; ``None`` before its first start."""
        session = self._session
        if session is not None:
            return session.address
        address: str | None = self.spec.get("address")
        return address

    @property
    def pid(self) -> int | None:
        """Its stage process's pid where the pool launched it, while that process serves
        or drains (the new one after a restart); ``None`` while the replica starts, once
        its process has exited (dead, failed, removed), and for a connected replica."""
        session = self._session
        if (
            session is None
            or not self.launched
            or self._state not in (ReplicaState.SERVING, ReplicaState.DRAINING)
            or session.exited
        ):
            return None
        return session.pid

    @property
    def in_flight(self) -> int:
        """This pool's requests live on it (exact)."""
        session = self._session
        if session is None or self._state not in (ReplicaState.SERVING, ReplicaState.DRAINING):
            return 0
        return session.in_flight

    @property
    def routable(self) -> bool:
        """Whether the pool's routing may pick it now: serving, its stage not gone, and
        not stalled (a step past its ``step_timeout``, or silent for 1.75 ping intervals:
        set by the pool's receiver when its timer fires, a moment after :attr:`health`
        starts to read ``"stalled"``)."""
        return routable(self)

    @property
    def restarts(self) -> int:
        """How many times the pool has started it again after a death."""
        return self._restarts

    @property
    def health(self) -> StageHealth:
        """Its stage's health (:class:`~enginecore.stage.StageHealth`); ``"dead"`` unless
        it is serving or draining."""
        if self._state not in (ReplicaState.SERVING, ReplicaState.DRAINING):
            return StageHealth.DEAD
        client = self._client
        health: StageHealth = client.health()
        return health

    def load(self) -> StageLoad | None:
        """Its stage's latest load report (:class:`~enginecore.stage.StageLoad`), or
        ``None``."""
        session = self._session
        return None if session is None else session.load(time.monotonic())

    def view(self, now: float) -> ReplicaView:
        """What a routing score sees of it at *now*."""
        session = self._session
        assert session is not None
        in_flight = session.in_flight
        latest = session._load
        if latest is None:
            load = in_flight + len(session._utility_calls)
            return ReplicaView(self, in_flight, load, None, _EMPTY, None)
        report, received, _ = latest
        return ReplicaView(
            self,
            in_flight,
            replica_load(self, now),
            report.live,
            MappingProxyType(report.engine),
            report.age + max(0.0, now - received),
        )

    @property
    def _described(self) -> str:
        """The replica and its stage, for an error that must say which pool's replica it
        concerns: ``"replica r0 (stage 'llm/r0')"`` (a launched one's stage name, the
        pool's ``name`` or factory), or ``"replica r0 (at tcp://...)"``."""
        if self.launched:
            base = self.spec.get("name") or self.spec["factory"]
            return f"replica {self.name} (stage '{base}/{self.name}')"
        return f"replica {self.name} (at {self.address})"

    def __repr__(self) -> str:
        pid = self.pid
        where = f" pid={pid}" if pid is not None else "" if self.launched else f" {self.address}"
        group = f" group={self.group!r}" if self.group is not None else ""
        return f"<Replica {self.name} {self._state.value}{where}{group} in_flight={self.in_flight}>"


def replica_load(r: Replica, now: float) -> int:
    """*r*'s load: the pool's own live requests and utility calls in flight on it (a call
    runs on the stage's loop: new requests wait behind it, as behind a request), plus the
    other clients' requests in its latest load report (its ``live`` minus the pool's own
    live when it arrived), however old: the stage reports as it goes idle, so an old report
    is not an empty replica (a shared one in a step longer than a second kept its others'
    requests). *now* is unused. On the routing path: a few reads. *r* must have started
    (routing only sees serving replicas)."""
    session: ClientSession[Any, Any] = r._session  # type: ignore[assignment]
    own = (
        len(session._streams)
        + len(session._quiet)  # type: ignore[arg-type]  # a member's
        + len(session._utility_calls)
    )
    latest = session._load
    if latest is None:
        return own
    others = latest[0].live - latest[2]
    if others <= 0:
        return own
    return own + others


def routable(r: Replica) -> bool:
    """Whether *r* may take a request now: serving, its stage not gone (nor its process
    exited, while its last frames are read) and not stalled (a step past its
    ``step_timeout``, or 1.75 ping intervals without a frame)."""
    session = r._session
    return (
        r._state is ReplicaState.SERVING
        and session is not None
        and session._failure is None
        and not session.exited
        and not session._step_stalled
        and not session._silent
    )


# -- routing ---------------------------------------------------------------------------------


class Routing:
    """How a pool picks the replica for each request. Subclass it and implement
    :meth:`choose`, or pass ``routing=`` a plain ``score(view, request) -> float``
    (:class:`Scored`). A policy object belongs to one pool."""

    def choose(
        self, replicas: Sequence[Replica], req_id: str, data: Any, key: Hashable | None, now: float
    ) -> Replica:
        """The replica, among *replicas* (those that may take a request now: two or more;
        with one, the pool does not ask), that gets request *req_id*. Runs on the caller's
        thread under no lock; must not block. *now* is a ``time.monotonic()`` reading.
        Anything but one of *replicas* is refused (:class:`TypeError`; nothing is sent)."""
        raise NotImplementedError

    def assign(
        self, replicas: Sequence[Replica], requests: Sequence[PoolRequest], now: float
    ) -> list[Replica]:
        """The replica of each of *requests* (``add_many``), in order. By default one
        :meth:`choose` each; a policy that can do better (spread a burst) overrides it."""
        return [self.choose(replicas, r.req_id, r.data, r.key, now) for r in requests]

    def membership_changed(self) -> None:
        """The pool's serving replicas changed (a death, a restart, an added or removed
        replica): forget what was derived from them."""


class LeastLoaded(Routing):
    """The default: the replica with the least load (its exact in-flight count from this
    pool, plus this pool's utility calls in flight on it, plus the other clients' requests
    in its latest load report). Up to *exhaustive*
    replicas, every one is looked at and ties go round-robin; above that, *k* replicas
    drawn at random are ("power of k choices": ~1 µs whatever the pool's size)."""

    def __init__(self, *, k: int = 2, exhaustive: int = 8, seed: int | None = None) -> None:
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in (k, exhaustive)):
            raise TypeError("k and exhaustive must be ints")
        if k < 1 or exhaustive < 1:
            raise ValueError("need k >= 1 and exhaustive >= 1")
        self.k: Final = k
        self.exhaustive: Final = exhaustive
        self._turn = itertools.count()
        self._random = random.Random(seed).random

    def choose(
        self, replicas: Sequence[Replica], req_id: str, data: Any, key: Hashable | None, now: float
    ) -> Replica:
        n = len(replicas)
        if n == 1:
            return replicas[0]
        if n <= self.exhaustive:
            start = next(self._turn) % n  # ties: whoever comes first from a rotating start
            best = replicas[start]
            best_load = replica_load(best, now)
            for i in range(start + 1, start + n):
                r = replicas[i % n]
                load = replica_load(r, now)
                if load < best_load:
                    best, best_load = r, load
            return best
        rand = self._random
        best = replicas[int(rand() * n)]
        if self.k == 2:  # the default, without the loop
            other = replicas[int(rand() * n)]
            return other if replica_load(other, now) < replica_load(best, now) else best
        best_load = replica_load(best, now)
        for _ in range(self.k - 1):
            r = replicas[int(rand() * n)]
            load = replica_load(r, now)
            if load < best_load:
                best, best_load = r, load
        return best

    def assign(
        self, replicas: Sequence[Replica], requests: Sequence[PoolRequest], now: float
    ) -> list[Replica]:
        """Spread a burst: each request to the least-loaded replica, counting the ones
        assigned before it (water-filling; ties round-robin)."""
        n = len(replicas)
        if n == 1:
            return [replicas[0]] * len(requests)
        loads = [replica_load(r, now) for r in replicas]
        start = next(self._turn) % n
        order = [(start + i) % n for i in range(n)]
        out: list[Replica] = []
        for _ in requests:
            i = min(order, key=loads.__getitem__)
            loads[i] += 1
            out.append(replicas[i])
        return out


class Sticky(Routing):
    """Send a request with a key (``add(..., key=...)``) to the key's *home* replica while
    it lives, and a request without one as :class:`LeastLoaded` does. Homes come from
    rendezvous hashing of the key and the replicas' names (stable across processes: every
    client of the same replicas agrees on them), so a replica that leaves moves only its own
    keys. A request spills to the least-loaded replica while its home is overloaded: its
    load above *spill_above* times the mean load of the replicas plus *slack*.

    The defaults (1.25, 2) hold the home of a hot key to about 1.5 times the mean at 8
    requests a replica (``benchmarks/bench_pool_faults.py``: Zipf(1.1) keys, max/mean
    outstanding 1.39-1.46 where 1.5 and 2 let it reach 1.45-1.71, for a share at home within
    a point or two of the same cap without slack); the slack keeps a light load at home."""

    def __init__(self, *, spill_above: float = 1.25, slack: int = 2, seed: int | None = None):
        if not all(
            isinstance(n, (int, float)) and not isinstance(n, bool) for n in (spill_above, slack)
        ):
            raise TypeError("spill_above and slack must be numbers")
        if not (spill_above >= 1 and slack >= 0):  # NaN too
            raise ValueError("need spill_above >= 1 and slack >= 0")
        self.spill_above: Final = spill_above
        self.slack: Final = slack
        self._least = LeastLoaded(seed=seed)
        self._homes: dict[Hashable, Replica] = {}
        self._members: Sequence[Replica] | None = None

    def home(self, replicas: Sequence[Replica], key: Hashable) -> Replica:
        """*key*'s home among *replicas*: the highest rendezvous hash."""
        if self._members is not replicas:
            self._members = replicas
            self._homes.clear()
        try:
            home = self._homes.get(key)
        except TypeError:
            raise TypeError(f"a Sticky key must be hashable, got {type(key).__name__}") from None
        if home is None:
            k = _key_bytes(key)
            home = max(replicas, key=lambda r: _rendezvous(k, r.name))
            if len(self._homes) >= 65_536:
                self._homes.clear()
            self._homes[key] = home
        return home

    def choose(
        self, replicas: Sequence[Replica], req_id: str, data: Any, key: Hashable | None, now: float
    ) -> Replica:
        if key is None or len(replicas) == 1:
            return self._least.choose(replicas, req_id, data, key, now)
        home = self.home(replicas, key)
        total = 0
        for r in replicas:
            total += replica_load(r, now)
        if replica_load(home, now) <= self.spill_above * total / len(replicas) + self.slack:
            return home
        return self._least.choose(replicas, req_id, data, key, now)

    def assign(
        self, replicas: Sequence[Replica], requests: Sequence[PoolRequest], now: float
    ) -> list[Replica]:
        if all(r.key is None for r in requests):
            return self._least.assign(replicas, requests, now)
        return super().assign(replicas, requests, now)

    def membership_changed(self) -> None:
        self._members = None
        self._homes.clear()


class Scored(Routing):
    """Route by a user's ``score(view, request) -> float``: the replica with the lowest
    score gets the request (ties round-robin). *view* is a :class:`ReplicaView`, *request*
    a :class:`PoolRequest`. The score runs on the caller's thread for every replica that
    may take the request; it must be quick and must not block."""

    def __init__(self, score: ScoreFn) -> None:
        if not callable(score):
            raise TypeError(f"score must be callable, got {type(score).__name__}")
        self.score: Final = score
        self._turn = itertools.count()

    def choose(
        self, replicas: Sequence[Replica], req_id: str, data: Any, key: Hashable | None, now: float
    ) -> Replica:
        return self._pick(replicas, PoolRequest(req_id, data, key), now, None)

    def assign(
        self, replicas: Sequence[Replica], requests: Sequence[PoolRequest], now: float
    ) -> list[Replica]:
        extra: dict[Replica, int] = {}
        out: list[Replica] = []
        for request in requests:
            r = self._pick(replicas, request, now, extra)
            extra[r] = extra.get(r, 0) + 1
            out.append(r)
        return out

    def _pick(
        self,
        replicas: Sequence[Replica],
        request: PoolRequest,
        now: float,
        extra: dict[Replica, int] | None,
    ) -> Replica:
        n = len(replicas)
        start = next(self._turn) % n
        best: Replica | None = None
        best_score = 0.0
        for i in range(start, start + n):
            r = replicas[i % n]
            view = r.view(now)
            if extra:
                more = extra.get(r, 0)
                if more:
                    view = ReplicaView(
                        r,
                        view.in_flight + more,
                        view.load + more,
                        view.live,
                        view.engine,
                        view.age,
                    )
            score = self.score(view, request)
            kind = type(score)
            if kind is not int and (kind is not float or math.isnan(score)):
                score = _checked_score(score, r, request)  # another real passes; else named
            if best is None or score < best_score:
                best, best_score = r, score
        assert best is not None
        return best


def _described(r: Replica) -> str:
    """*r*'s name and state, for "no replica can take requests"."""
    session = r._session
    if r._state is ReplicaState.SERVING and session is not None and session.exited:
        return f"{r.name} serving (its process exited)"
    return f"{r.name} {r._state.value}"


def _checked_score(score: object, r: Replica, request: PoolRequest) -> float:
    """*score*, a routing score that is not a plain float or int, if it is a real number
    (not a bool, not NaN); else the error that names the replica and the request."""
    if not isinstance(score, numbers.Real) or isinstance(score, bool):
        raise TypeError(
            f"a routing score must be a real number, got {type(score).__name__} ({score!r})"
            f" for replica {r.name} and request {request.req_id!r}"
        )
    if math.isnan(score):
        raise ValueError(
            f"the routing score of replica {r.name} for request {request.req_id!r} is NaN"
        )
    return score  # type: ignore[return-value]


def _key_bytes(key: Hashable) -> bytes:
    if isinstance(key, bytes):
        return b"b" + key
    if isinstance(key, str):
        return b"s" + key.encode("utf-8", "surrogatepass")  # a lone surrogate too
    return b"r" + repr(key).encode()


def _rendezvous(key: bytes, name: str) -> int:
    digest = hashlib.blake2b(key + b"\0" + name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def as_routing(routing: Routing | ScoreFn | None) -> Routing:
    """A pool's ``routing=`` argument as a :class:`Routing`."""
    if routing is None:
        return LeastLoaded()
    if isinstance(routing, Routing):
        return routing
    if callable(routing):
        return Scored(routing)
    raise TypeError(
        f"routing must be a Routing or a score(view, request) callable, "
        f"got {type(routing).__name__}"
    )


# -- the core --------------------------------------------------------------------------------


class _Held:
    """What the live table holds for an id of an ``add_many`` while its frame is sent."""

    __slots__ = ()
    _ended = None
    _replica = None

    def _live_as(self, req_id: str) -> bool:
        return True


_HELD: Final = _Held()


class QuietRequest:
    """What the live table holds for a request without a stream (``add(..., stream=False)``):
    the replica that serves it and, for ``on_replica_death``, the request as sent and how
    often it moved. It is live while its id is in ``_in``: the table of requests without a
    stream of the member session it was sent on (``ClientSession.quiet``, which forgets it
    when it ends), or, once that member failed, the table it handed over
    (``Deliveries.quiet_orphans``), until the pool has settled it. ``_in`` is set under the
    lock that registers the id (``ClientBase._send_request``). ``_earlier``: the outputs its
    dead attempts delivered (a table counts only its own attempt's)."""

    __slots__ = ("_aborted", "_earlier", "_in", "_migrations", "_replica", "_request", "req_id")

    def __init__(self, req_id: str, request: PoolRequest | None) -> None:
        self.req_id: Final = req_id
        self._request = request
        self._migrations = 0
        self._earlier = 0
        self._replica: Replica | None = None
        self._in: Mapping[str, int] = _EMPTY_TABLE

    def _live_as(self, req_id: str) -> bool:
        """Whether the request is live (its id in ``_in``)."""
        return req_id in self._in

    @property
    def _ended(self) -> bool | None:
        """As a stream's (``None`` while live), for the table's prune."""
        return None if self.req_id in self._in else True

    @property
    def migrations(self) -> int:
        return self._migrations


class QuietTable:
    """What the live table holds for every request without a stream of one member session,
    in a pool without ``on_replica_death`` (nothing to keep per request, so nothing is
    made per request): the replica, and the session's table of such requests (``_in``,
    ``ClientSession.quiet``; once the member failed, the table it handed over, until the
    pool has settled each id). An id is live while it is in that table. Made when the
    member starts serving (:meth:`PoolCore.started`)."""

    __slots__ = ("_in", "_replica")
    # For the table's prune, which reads a stream's _ended: its ids leave the pool's table
    # as they end (the member session, or the pool when it settles a dead member's), so
    # the prune never looks at them.
    _ended = None

    def __init__(self, replica: Replica, table: Mapping[str, int]) -> None:
        self._replica = replica
        self._in = table

    def _live_as(self, req_id: str) -> bool:
        return req_id in self._in


_EMPTY_TABLE: Final[Mapping[str, int]] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class ReplicaEvent:
    """In a pool's event stream (``ordered_events=True``): an event of one replica's stage
    that concerns the replica rather than one request: an answer to a utility call
    (:class:`~enginecore.stage.UtilityResult`, whose ``call_id`` is the replica's), a
    protocol error the stage reported (:class:`~enginecore.stage.ErrorReport` without a
    ``req_id``), or its last event (:class:`~enginecore.stage.Shutdown`,
    :class:`~enginecore.stage.Fatal`)."""

    replica: Replica
    event: Any
    """The stage's event, as a single client's event stream has it."""


@dataclass(frozen=True, slots=True)
class ReplicaGone:
    """In a pool's event stream: *replica*'s stage is gone (it died, was removed, or the
    pool closed). It comes after every event of that stage and after the end of each of its
    requests that did not move (:class:`RequestFailed`). A restarted replica's events
    follow later."""

    replica: Replica
    error: BaseException
    """What its requests and calls got: a :class:`~enginecore.stage.ReplicaDeadError`, or
    :class:`~enginecore.stage.StageClosedError` when the pool closed it."""


@dataclass(frozen=True, slots=True)
class RequestFailed:
    """In a pool's event stream: request *req_id* ended with *error*, raised by the pool
    rather than reported by a stage: a :class:`~enginecore.stage.ReplicaDeadError` (its
    replica died; ``.replica``, ``.delivered``), or
    :class:`~enginecore.stage.StageClosedError` (the pool closed, or removed its replica
    without a drain). Like a finished output, :class:`~enginecore.stage.Aborted` and
    :class:`~enginecore.stage.ErrorReport`, it is the request's one last event."""

    req_id: str
    error: Exception


DeathHook = Callable[[PoolRequest, int], "PoolRequest | None"]
"""``on_replica_death(request, delivered) -> new request | None``."""


class Death(NamedTuple):
    """What a pool does once a replica died (:meth:`PoolCore.died`)."""

    delay: float | None
    """Seconds before :attr:`restart` starts again; ``None``: nothing starts again."""
    stop: tuple[Replica, ...] = ()
    """The other members of its restart group that still serve: the core has marked them
    dead (out of the routing); the pool stops them now, and their requests end as a dead
    replica's do."""
    restart: tuple[Replica, ...] = ()
    """What starts again after :attr:`delay`: the replica, or its whole group."""


_NOTHING: Final = Death(None)


class PoolCore:
    """The replicas, routing and live-request table of one pool; the decisions the pools
    make alike. Not thread-safe: the blocking pool calls what changes state under its lock.
    Never blocks, never does IO; calls user code only in :meth:`route` (the routing policy)
    and :meth:`fate` (``on_replica_death``), which the pools call without a lock."""

    def __init__(
        self,
        routing: Routing | ScoreFn | None,
        restart: RestartPolicy | bool,
        on_replica_death: DeathHook | None,
        max_migrations: int,
    ) -> None:
        if on_replica_death is not None and not callable(on_replica_death):
            raise TypeError("on_replica_death must be callable")
        if isinstance(max_migrations, bool) or not isinstance(max_migrations, int):
            raise TypeError(f"max_migrations must be an int, got {type(max_migrations).__name__}")
        if max_migrations < 0:
            raise ValueError("max_migrations must be >= 0")
        if not isinstance(restart, (bool, RestartPolicy)):
            # checked now: else the first death would meet it, on the receiver's thread
            raise TypeError(
                f"restart must be a bool or a RestartPolicy, got {type(restart).__name__}"
            )
        self.routing: Final = as_routing(routing)
        # A policy of the user's own: its choices are checked (one of the candidates).
        self._checked = type(self.routing) not in (LeastLoaded, Sticky, Scored)
        if restart is True:
            restart = RestartPolicy()
        self.restart: Final[RestartPolicy | None] = restart or None
        self.on_replica_death: Final = on_replica_death
        self.max_migrations: Final = max_migrations
        self._replicas: list[Replica] = []
        self._serving: tuple[Replica, ...] = ()
        # Bumped by the member sessions (ClientSession(health_epoch=)) whenever one's
        # routability changes, and by every change of membership: candidates() recomputes
        # the routable replicas only then.
        self.health_epoch = [0]
        self._routable: tuple[Replica, ...] = ()
        self._routable_epoch = -1
        self._next_name = 0  # replica r<n>'s n: the next name given
        self._group_deaths: dict[str, deque[float]] = {}  # each restart group's deaths
        self._live: dict[str, Any] = {}  # req_id -> its stream (ended ones pruned lazily)
        self._prune_at = 1024
        self.closing = False
        # That close is a shutdown with a drain, under way: the pool still takes aborts
        # (PoolBase._abort), which reach the replicas as they drain.
        self.draining = False
        # The one replica to send to without routing: set when the routable set is one
        # replica and no hook needs the request kept; valid while health_epoch is
        # _routable_epoch (a pool of one's add reads only these two).
        self._single: Replica | None = None

    # -- membership ----------------------------------------------------------------------

    @property
    def replicas(self) -> tuple[Replica, ...]:
        """Every replica not removed, in the order they were added."""
        return tuple(self._replicas)

    def new_replica(self, spec: Mapping[str, Any]) -> Replica:
        """A new replica, ``starting``. A ``"group"`` in *spec* (a ``str``) names its
        restart group; only a replica the pool launches may have one."""
        spec = dict(spec)
        group = spec.pop("group", None)
        if group is not None:
            if not isinstance(group, str) or not group:
                raise TypeError(f"group must be a non-empty str or None, got {group!r}")
            if "factory" not in spec:
                raise ValueError(
                    "group= is for replicas the pool launches: it cannot start a connected "
                    "one again"
                )
        replica = Replica(f"r{self._next_name}", MappingProxyType(spec), group)
        self._next_name += 1
        if group is not None:
            self._group_deaths.setdefault(group, deque())
        self._replicas.append(replica)
        return replica

    def add_failed(self, replicas: Sequence[Replica]) -> None:
        """The ``add_replica`` (or launch) of *replicas* failed: they are removed, and
        their names are given again, as if never given (the pool is unchanged), unless a
        later name was given meanwhile (an add that went on at the same time keeps its
        name, and no two replicas of the pool share one)."""
        for replica in replicas:
            self.set_state(replica, ReplicaState.REMOVED)
        given = {r.name for r in replicas}
        while self._next_name and f"r{self._next_name - 1}" in given:
            self._next_name -= 1

    def started(self, replica: Replica, client: Any, generation: int | None = None) -> bool:
        """*replica*'s member *client* is up: it serves from the next routing decision on.
        ``False`` (nothing changed) if the replica was removed or the pool closes
        meanwhile, or (with *generation*, its ``_generation`` when the start began) if it
        or its group died since: the caller closes *client*."""
        if self.closing or replica._state is not ReplicaState.STARTING:
            return False
        if generation is not None and generation != replica._generation:
            return False
        replica._client = client
        replica._session = client._session
        replica._quiet = QuietTable(replica, client._session.quiet)
        client._session._pool_live = self._live
        client._session._health_epoch = self.health_epoch
        replica._state = ReplicaState.SERVING
        self._refresh()
        return True

    def set_state(self, replica: Replica, state: ReplicaState) -> None:
        """Move *replica* to *state* (leaves the routing unless it is ``serving``)."""
        replica._state = state
        if state is ReplicaState.REMOVED and replica in self._replicas:
            self._replicas.remove(replica)
        self._refresh()

    def died(self, replica: Replica, now: float) -> Death:
        """*replica*'s stage (or a start of it) failed at *now*: it leaves the routing, and
        so does the rest of its restart group (:attr:`Death.stop`: the members that still
        serve, for the pool to stop). Returns what to start again and when
        (:class:`Death`), counted on the replica's deaths, or on its group's. A replica
        being drained or removed just goes; one already dead (stopped with its group)
        changes nothing."""
        if self.closing or replica._state not in (ReplicaState.SERVING, ReplicaState.STARTING):
            return _NOTHING
        group = self.group_of(replica)
        for r in group:
            r._generation += 1  # a start of a member under way no longer counts
        stop = tuple(r for r in group if r is not replica and r._state is ReplicaState.SERVING)
        if self.restart is None or not replica.launched:
            for r in group:
                r._state = ReplicaState.DEAD
            self._refresh()
            return Death(None, stop, ())
        deaths = replica._deaths if replica.group is None else self._group_deaths[replica.group]
        delay = self.restart.delay(deaths, now)
        for r in group:
            r._state = ReplicaState.DEAD if delay is not None else ReplicaState.FAILED
        self._refresh()
        if delay is None:
            logger.error(
                "enginecore: %s died %d times within %g s; %s out",
                f"replica {replica.name}"
                if replica.group is None
                else f"restart group {replica.group!r} ({', '.join(r.name for r in group)})",
                self.restart.max_failures,
                self.restart.window,
                "it stays" if replica.group is None else "they stay",
            )
            return Death(None, stop, ())
        return Death(delay, stop, group)

    def group_of(self, replica: Replica) -> tuple[Replica, ...]:
        """*replica* and the other members of its restart group that are neither being
        drained nor removed (just *replica* outside a group)."""
        if replica.group is None:
            return (replica,)
        return tuple(
            r
            for r in self._replicas
            if r.group == replica.group
            and r._state not in (ReplicaState.DRAINING, ReplicaState.REMOVED)
        )

    def restarting(self, replica: Replica) -> bool:
        """The restart timer of a ``dead`` replica fired: whether to start it now (it is
        then ``starting``)."""
        if self.closing or replica._state is not ReplicaState.DEAD:
            return False
        replica._restarts += 1
        replica._state = ReplicaState.STARTING
        return True

    def begin_close(self, drain: bool = False) -> None:
        """The pool begins to close: nothing new is routed (the epoch moves, so no add
        takes the path that skips the checks); *drain*: a shutdown with a drain, which
        still takes aborts until :meth:`closed`."""
        self.closing = True
        self.draining = drain
        self._single = None
        self.health_epoch[0] += 1

    def closed(self) -> None:
        """The pool has closed: every replica left is ``dead``."""
        self.draining = False
        for r in self._replicas:
            if r._state is not ReplicaState.FAILED:
                r._state = ReplicaState.DEAD
        self._refresh()

    def _refresh(self) -> None:
        self._serving = tuple(r for r in self._replicas if r._state is ReplicaState.SERVING)
        self.health_epoch[0] += 1
        self.routing.membership_changed()

    # -- routing -------------------------------------------------------------------------

    def candidates(self) -> Sequence[Replica]:
        """The replicas that may take a request now; if none is healthy, the serving ones
        that are stalled (better queued than refused); :class:`NoReplicaError` if none
        serves. Recomputed only when a member's health or the membership changed (the
        health epoch), so a decision costs the same at 64 replicas as at 2."""
        epoch = self.health_epoch[0]  # read first: a change while computing bumps it again
        if epoch != self._routable_epoch:
            routable = self._routable = self._compute_routable()
            single = len(routable) == 1 and self.on_replica_death is None and not self.closing
            self._single = routable[0] if single else None
            self._routable_epoch = epoch
        routable = self._routable
        if not routable:
            raise NoReplicaError(
                "no replica can take requests: "
                + (", ".join(_described(r) for r in self._replicas) or "none left")
            )
        return routable

    def _compute_routable(self) -> tuple[Replica, ...]:
        serving = self._serving
        healthy = tuple(r for r in serving if routable(r))
        if len(healthy) == len(serving):
            return serving  # the common case: the same tuple (Sticky caches on it)
        if healthy:
            return healthy
        return tuple(
            r
            for r in serving
            if r._session is not None and r._session._failure is None and not r._session.exited
        )

    def route(self, req_id: str, data: Any, key: Hashable | None) -> Replica:
        """The replica for one request (the only candidate, without asking the policy)."""
        candidates: Sequence[Replica] = self._routable
        if self.health_epoch[0] != self._routable_epoch or not candidates:
            candidates = self.candidates()
        if len(candidates) == 1:
            return candidates[0]
        chosen = self.routing.choose(candidates, req_id, data, key, time.monotonic())
        if self._checked and not any(chosen is r for r in candidates):
            raise self._bad_choice("choose", chosen)
        return chosen

    def route_many(self, requests: Sequence[PoolRequest]) -> list[Replica]:
        """The replica of each request of a burst."""
        return self.assign(self.candidates(), requests)

    def assign(
        self, candidates: Sequence[Replica], requests: Sequence[PoolRequest]
    ) -> list[Replica]:
        """The policy's replica for each of *requests* among *candidates* (checked, for a
        policy of the user's own)."""
        chosen = self.routing.assign(candidates, requests, time.monotonic())
        if self._checked:
            if not isinstance(chosen, list) or len(chosen) != len(requests):
                raise TypeError(
                    f"{type(self.routing).__name__}.assign() must return a list of "
                    f"{len(requests)} replicas, one per request, got {chosen!r:.200}"
                )
            ids = {id(r) for r in candidates}
            for r in chosen:
                if id(r) not in ids:
                    raise self._bad_choice("assign", r)
        return chosen

    def _bad_choice(self, method: str, chosen: object) -> Exception:
        return TypeError(
            f"{type(self.routing).__name__}.{method}() chose {chosen!r:.200}, which is not "
            "one of the replicas it was given"
        )

    # -- the live-request table (under the blocking pool's lock) -------------------------

    def check_free(self, req_ids: Sequence[str]) -> None:
        """:class:`ValueError` if one of *req_ids* is live in this pool."""
        live = self._live
        for rid in req_ids:
            stream = live.get(rid)
            if stream is not None and stream._live_as(rid):
                raise ValueError(f"request {rid!r} is still live in this pool")

    def check_burst(self, req_ids: list[str]) -> None:
        """A burst that goes to the one routable replica without a reservation, in the
        member's hold of the lock that registers its streams: :class:`StageClosedError`
        once the pool closes, :class:`ValueError` if one of *req_ids* is live in this pool
        (checked in C, as :meth:`reserve`)."""
        if self.closing:
            raise StageClosedError("this stage pool is closed")
        self._check_clash(req_ids)

    def _check_clash(self, req_ids: list[str]) -> None:
        """:class:`ValueError` naming the first of *req_ids* (in the caller's order) live
        in this pool; the set intersection runs in C: a burst has thousands of ids."""
        live = self._live
        clash = live.keys() & req_ids
        if clash:
            for rid in req_ids:
                if rid in clash and live[rid]._live_as(rid):
                    raise ValueError(f"request {rid!r} is still live in this pool")

    def reserve(self, req_ids: list[str]) -> None:
        """Check that none of *req_ids* is live in this pool (:class:`ValueError`), then
        hold them (``add_many`` sends their frame next). The checks run in C: a burst has
        thousands of ids."""
        self._check_clash(req_ids)
        self._live.update(dict.fromkeys(req_ids, _HELD))
        self._maybe_prune()

    def release(self, req_ids: list[str]) -> None:
        """Drop the hold of those of *req_ids* that are still only held (or stood for by
        a :class:`QuietTable` whose member took them back: a send that failed)."""
        live = self._live
        for rid in req_ids:
            entry = live.get(rid)
            if entry is _HELD or (type(entry) is QuietTable and not entry._live_as(rid)):
                del live[rid]

    def track_many(self, req_ids: list[str], streams: Sequence[Any]) -> None:
        """:meth:`track` for many (their holds are replaced)."""
        self._live.update(zip(req_ids, streams, strict=True))

    def _maybe_prune(self) -> None:
        """Drop the ended streams from the live table, in place (a member may hold a
        reference to it: ``_send_request(live=)``), once it has doubled since the last
        prune."""
        live = self._live
        if len(live) > self._prune_at:
            for rid in [rid for rid, s in live.items() if s._ended is not None]:
                del live[rid]
            self._prune_at = max(1024, 2 * len(live))

    def untrack(self, req_id: str, stream: Any) -> None:
        """Forget *req_id* if its entry is *stream* (a reservation whose send failed)."""
        if stream is not None and self._live.get(req_id) is stream:
            del self._live[req_id]

    def stream_of(self, req_id: str) -> Any:
        """The live stream of *req_id*, or ``None``."""
        stream = self._live.get(req_id)
        return stream if stream is not None and stream._live_as(req_id) else None

    def live_streams(self) -> list[Any]:
        """Every stream (or :class:`QuietRequest`) the pool still tracks as live; not the
        requests of a :class:`QuietTable`, which are settled with their member."""
        return [s for rid, s in self._live.items() if type(s) is not QuietTable and s._live_as(rid)]

    # -- a dead replica's requests -------------------------------------------------------

    def dead_error(self, replica: Replica, failure: BaseException, delivered: int) -> Exception:
        """What a request or call of dead *replica* ends with: a
        :class:`StageClosedError` that names the replica when the pool closed the member
        (the pool closes, or removed the replica without a drain), else a
        :class:`ReplicaDeadError`."""
        if isinstance(failure, StageClosedError):
            # The member's own words ("this stage client is closed") do not say which
            # pool's replica: with several pools, a user could not tell.
            if self.closing:
                return StageClosedError(f"the stage pool of {replica._described} is closed")
            if replica._state in (ReplicaState.DRAINING, ReplicaState.REMOVED):
                return StageClosedError(
                    f"{replica._described} was removed from its stage pool without a drain"
                )
        if isinstance(failure, StageClosedError) or not isinstance(failure, EngineDeadError):
            return failure if isinstance(failure, Exception) else StageClosedError(str(failure))
        err = ReplicaDeadError(
            f"replica {replica.name}: {failure}",
            replica=replica,
            delivered=delivered,
            exit_code=failure.exit_code,
            fatal=failure.fatal,
        )
        err.__cause__ = failure
        return err

    def fate(
        self, replica: Replica, stream: Any, failure: BaseException, delivered: int | None = None
    ) -> tuple[Exception, PoolRequest | None]:
        """What becomes of *stream* (or a request without one, its :class:`QuietRequest`,
        with the outputs it had *delivered*), live on *replica* when its member failed with
        *failure*: its error, and the request to send to another replica instead (from
        ``on_replica_death``, within ``max_migrations``, and never for a request that
        ``abort()`` was called for), or ``None`` (end it with the error). Calls the user's
        hook: call it without a lock."""
        if delivered is None:
            delivered = len(stream._arrivals)
        err = self.dead_error(replica, failure, delivered)
        hook = self.on_replica_death
        # getattr: a stream of add_many() whose replica died before the pool marked it
        request: PoolRequest | None = getattr(stream, "_request", None)
        if (
            hook is None
            or request is None
            or self.closing
            or not isinstance(err, ReplicaDeadError)
            or getattr(stream, "_migrations", 0) >= self.max_migrations
            or getattr(stream, "_aborted", False)  # abort() asked for its end: no move
        ):
            return err, None
        try:
            again = hook(request, delivered)
        except Exception:
            logger.exception(
                "enginecore: on_replica_death raised for request %r; it fails", request.req_id
            )
            return err, None
        if again is None:
            return err, None
        if not isinstance(again, PoolRequest) or again.req_id != request.req_id:
            logger.error(
                "enginecore: on_replica_death must return a PoolRequest with the same req_id "
                "(%r) or None, got %r; the request fails",
                request.req_id,
                again,
            )
            return err, None
        return err, again


PoolEvent: TypeAlias = StageEvent | ReplicaEvent | ReplicaGone | RequestFailed
"""What a pool's event stream holds: a request's events as its replica's stage sent them
(:class:`~enginecore.stage.Outputs`, :class:`~enginecore.stage.Aborted`, an
:class:`~enginecore.stage.ErrorReport` with a ``req_id``), a :class:`ReplicaEvent`, a
:class:`ReplicaGone`, or a :class:`RequestFailed`."""
