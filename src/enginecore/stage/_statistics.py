"""A stage's statistics and load reports: what the stage sends, and what a client makes of it.

Two signals, two paths (``docs/observability.md``):

- **Statistics**, on request: a client's ``["stats", call_id]`` is answered by whichever
  thread holds the stage's input side, from :meth:`~enginecore.EngineCoreLoop.statistics`
  and the stage's own counters; it never waits for the loop or a step. The answer is a
  ``utility`` event whose result is a map (:func:`stage_statistics`), which the client turns
  into a :class:`StageStatistics`.
- **Load reports**, pushed: while the stage steps, at most every *load_interval* seconds, the
  loop thread samples the engine's ``stats()`` right after a step and attaches a
  :class:`LoadReport` to that step's ``outputs`` event, as a fifth element that older clients
  ignore. Its age is computed when the output thread encodes the frame, so a client knows
  how old the numbers were when they left the stage. An idle stage sends none; as the loop
  goes idle after a report went out while it was busy, one more, alone
  (:meth:`LoadReporter.report_idle`); and while it idles, one when what is live changed
  (an abort, an add the engine holds), at most one an interval
  (:meth:`LoadReporter.report_changes`). A client that becomes the stage's current one
  (its session applied by the loop) after a report went out gets one at the next chance
  (:meth:`LoadReporter.resend`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

from .._stats import _EMPTY, STEP_BUCKETS, LoopStatistics

if TYPE_CHECKING:
    from .._loop import EngineCoreLoop

__all__ = [
    "LOAD_INTERVAL",
    "SHARED_LOAD_INTERVAL",
    "LoadReport",
    "LoadReporter",
    "StageLoad",
    "StageStatistics",
    "check_load_interval",
    "stage_statistics",
    "statistics_to_wire",
]

LOAD_INTERVAL: Final = 0.05
"""The default least time, in seconds, between two load reports of a stage."""

SHARED_LOAD_INTERVAL: Final = 0.005
"""``serve``'s default load interval for a stage that serves several clients
(``--max-clients`` above 1): each client's pool routes on the others' requests through
these reports only, so they must be about one engine step fresh (``docs/pool.md``)."""


def check_load_interval(value: object) -> float | None:
    """*value* as a load interval: a number > 0, or ``None`` (no load reports)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"load_interval must be a number of seconds or None, got {value!r}")
    if not 0 < value < math.inf:
        raise ValueError(f"load_interval must be > 0 seconds, got {value!r}")
    return float(value)


# -- the stage side ------------------------------------------------------------------------------


class LoadReport:
    """One load report, as the loop thread made it: encoded by the output thread's
    encoder hook (:meth:`wire`), which puts in its age at that moment."""

    __slots__ = ("at", "engine", "live", "seq")

    def __init__(self, seq: int, at: float, live: int, engine: Mapping[str, float]) -> None:
        self.seq = seq
        self.at = at  # time.perf_counter() of the sample
        self.live = live
        self.engine = engine

    def wire(self) -> dict[str, Any]:
        """The report's map on the wire, aged now."""
        return {
            "seq": self.seq,
            "age": max(0.0, time.perf_counter() - self.at),
            "live": self.live,
            "engine": dict(self.engine),
        }


def _no_sample(now: float) -> Mapping[str, float] | None:
    return None


def _no_post(events: list[tuple[Any, ...]], weight: int, last: bool = False) -> None:
    return None


class LoadReporter:
    """Loop thread: makes a :class:`LoadReport` at most every *interval* seconds. The step
    that posts outputs checks :attr:`next_at` against ``time.perf_counter()`` itself (one
    clock read per step with outputs) and calls :meth:`report` when it has passed; and on
    the last step before the loop idles, unless the latest report is already an idle one
    (:attr:`idle_reported`): an idle stage sends nothing, so its last report must say what
    is live once it idles, not while it was busy. So a stage that steps now and then sends at
    most two reports an interval, and a busy one one.

    A step cannot always know that the loop idles after it: a pipelined engine's collect
    (other steps may be in flight), a last step without outputs, an abort that ends the
    work without a step. So the stage's input queue calls :meth:`report_idle` when the
    loop blocks for its next message (``InputQueue.get``) while the latest report is a busy
    one: that report goes out alone (:attr:`post`, an ``outputs`` event with three empty
    lists), still at most two an interval. A plain engine's last step has usually sent it
    already: then the loop pays one flag test as it blocks, nothing per step.

    What is live may also change while the loop idles, with no step to report it: an abort
    applied while the engine holds requests it does not step (``has_work()`` false), an
    add it holds. So each time the idle loop is about to wait, the input queue calls
    :meth:`report_changes`, which compares the live count with the latest report's and
    sends one (alone, as :meth:`report_idle` does) once the interval allows: at most one
    an interval, and the steps pay nothing for it.

    Each of these counts a report as sent once it is posted: it reaches the clients whose
    session the loop has applied (a one-client stage's ``SessionChange``, a shared stage's
    ``ClientJoined``). A new client gets none made before that: those went to the clients
    before it, or were dropped while it was being welcomed (its handshake done on the
    input side, its session not yet applied by the loop) or while nobody was attached.
    So the loop calls :meth:`resend` once it applies a new client's session, and the next
    chance sends a report again; the steps pay nothing for it.

    The engine's numbers come from :attr:`sample`, which the stage sets to its loop's
    sampler (:meth:`enginecore._stats.StepTimer.sample_engine`) once the loop exists: the
    report's ``stats()`` call is also the loop's, which then skips its own for an interval,
    so a stepping stage calls ``stats()`` once per sample, not once for each. Until then,
    reports carry no engine numbers."""

    __slots__ = (
        "_live",
        "idle_reported",
        "interval",
        "next_at",
        "post",
        "reported_live",
        "sample",
        "seq",
    )

    def __init__(self, interval: float, live: set[str]) -> None:
        self.interval = interval
        self.next_at = 0.0
        self.seq = 0  # reports made so far
        self.idle_reported = True  # the latest report was made as the loop idled (or none)
        self.reported_live = 0  # the latest report's live count (none: nothing live)
        self._live = live
        self.sample: Callable[[float], Mapping[str, float] | None] = _no_sample
        """``sample(now)``: the engine's ``stats()`` sampled at *now*, or ``None`` (none,
        or it failed: logged and counted by the loop)."""
        self.post: Callable[[list[tuple[Any, ...]], int, bool], None] = _no_post
        """``post(events, weight, last)``: the stage output's ``post_step``, which sends
        :meth:`report_idle`'s report (set by the stage)."""

    def report(self, now: float, idle: bool = False) -> LoadReport:
        """A report sampled *now* (``time.perf_counter()``), on the step after which the
        loop idles if *idle*. A failed ``stats()`` leaves the engine's fields out."""
        self.next_at = now + self.interval
        self.idle_reported = idle
        self.seq += 1
        self.reported_live = live = len(self._live)
        engine = self.sample(now)
        return LoadReport(self.seq, now, live, _EMPTY if engine is None else engine)

    def report_idle(self) -> None:
        """Loop thread, as the loop blocks for its next message while the latest report was
        made busy (``not idle_reported``): send a report alone, made now, on an ``outputs``
        event with three empty lists (``docs/wire.md``), sent by the loop thread itself
        while the output thread is idle (``post_step(last=True)``)."""
        report = self.report(time.perf_counter(), idle=True)
        self.post([("outputs", [], [], [], report)], 0, True)

    def resend(self) -> None:
        """Loop thread, once it has applied a new client's session: no report made so far
        reached that client (see the class docstring), so none counts as sent. The next
        chance sends one: the next step with outputs (:attr:`next_at` has passed), or, if
        the loop idles first, the idle wait (``not idle_reported``: :meth:`report_idle`).
        Nothing while no report was ever made: a stage that has not stepped sends none."""
        if self.seq:
            self.next_at = 0.0
            self.idle_reported = False

    def report_changes(self) -> float | None:
        """Loop thread, as the idle loop is about to wait: if what is live is no longer what
        the latest report says, send a report alone (:meth:`report_idle`) if the interval
        has passed since the latest, else return the seconds left until it has (the wait's
        timeout: the loop calls this again then). ``None``: nothing to send."""
        if len(self._live) == self.reported_live:
            return None
        left = self.next_at - time.perf_counter()
        if left > 0:
            return left
        self.report_idle()
        return None


def stage_statistics(
    loop: EngineCoreLoop,
    *,
    live: set[str],
    outputs: Callable[[], int],
    backlog: Callable[[], int],
    reporter: LoadReporter | None,
    stalled: Callable[[], bool],
    name: str,
    factory: str,
    started: float,
    cut_clients: Callable[[], int] = lambda: 0,
) -> dict[str, Any]:
    """The map a ``stats`` request is answered with. Any thread; never waits."""
    return statistics_to_wire(
        StageStatistics(
            loop=loop.statistics(),
            name=name,
            factory=factory,
            pid=os.getpid(),
            uptime_seconds=time.monotonic() - started,
            outputs=outputs(),
            live=len(live),
            backlog=backlog(),
            load_reports=reporter.seq if reporter is not None else 0,
            load_interval=reporter.interval if reporter is not None else None,
            stalled=stalled(),
            cut_clients=cut_clients(),
        )
    )


# -- the wire form of the statistics -------------------------------------------------------------
#
# Derived from the dataclasses' fields, so that a field added to LoopStatistics or
# StageStatistics crosses the wire without another edit here; one whose annotation has no
# entry in _WIRE_TYPES stops the import with a TypeError that names it.


def _ints(value: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in value)


def _read_only(value: Any) -> Mapping[str, float]:
    return MappingProxyType(dict(value))


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


_Encode = Callable[[Any], Any]
_Decode = Callable[[Any], Any]

_WIRE_TYPES: Final[dict[str, tuple[_Encode | None, _Decode]]] = {
    # A field's annotation (a string: both modules postpone their annotations) ->
    # (its value to a msgpack value, None: as it is; a msgpack value back to its type).
    "int": (None, int),
    "float": (None, float),
    "bool": (None, bool),
    "str": (None, str),
    "float | None": (None, _float_or_none),
    "tuple[int, ...]": (list, _ints),
    "Mapping[str, float]": (dict, _read_only),
}


def _wire_fields(
    cls: type[Any], *skip: str
) -> tuple[tuple[str, _Encode | None, _Decode, Any], ...]:
    """``(name, encode, decode, default)`` for each field of the dataclass *cls* but *skip*
    (``default`` is ``dataclasses.MISSING`` for a field the wire must carry)."""
    out = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", repr(f.type))
        try:
            encode, decode = _WIRE_TYPES[kind]
        except KeyError:
            raise TypeError(
                f"{cls.__name__}.{f.name}: no wire form for {kind!r} (add one to _WIRE_TYPES)"
            ) from None
        out.append((f.name, encode, decode, f.default))
    return tuple(out)


def _encode(
    obj: Any, wire_fields: tuple[tuple[str, _Encode | None, _Decode, Any], ...]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, encode, _, _ in wire_fields:
        value = getattr(obj, name)
        out[name] = value if encode is None else encode(value)
    return out


def _decode(
    value: Mapping[str, Any], wire_fields: tuple[tuple[str, _Encode | None, _Decode, Any], ...]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, _, decode, default in wire_fields:
        if default is dataclasses.MISSING:
            out[name] = decode(value[name])
        else:  # a field that an older stage may not send
            out[name] = decode(value.get(name, default))
    return out


def statistics_to_wire(stats: StageStatistics) -> dict[str, Any]:
    """*stats* as the map a ``stats`` request is answered with (``docs/wire.md``): every
    field of :class:`~enginecore.LoopStatistics` under ``loop``, with ``step_buckets``, and
    every other field of :class:`StageStatistics` under ``stage``."""
    loop = _encode(stats.loop, _LOOP_WIRE)
    loop["step_buckets"] = list(STEP_BUCKETS)
    return {"loop": loop, "stage": _encode(stats, _STAGE_WIRE)}


# -- the client side -----------------------------------------------------------------------------


@dataclass(frozen=True)
class StageStatistics:
    """A stage's statistics, from ``client.stats()``: its loop's
    (:class:`~enginecore.LoopStatistics`) and the stage's own numbers."""

    loop: LoopStatistics
    """The stage's engine loop. Its ``outputs`` stays 0: a stage hands its outputs over
    itself, and counts them in :attr:`outputs`."""
    name: str
    """The stage's name (``launch(name=)``, ``serve --name``; by default its factory)."""
    factory: str
    """The stage's engine factory (as in the handshake)."""
    pid: int
    """The stage process's id."""
    uptime_seconds: float
    """Seconds since the stage started."""
    outputs: int
    """Outputs the stage has handed to its output thread."""
    live: int
    """Requests live in the stage: added, and not yet finished, aborted or ended."""
    backlog: int
    """Outputs (and other events) waiting for the output thread to send them."""
    load_reports: int
    """Load reports sent so far (the last one's sequence number)."""
    load_interval: float | None
    """The least time between two load reports; ``None``: the stage sends none."""
    stalled: bool = False
    """Whether a step has run past the stage's ``step_timeout`` and not returned yet (its
    watchdog's verdict; always ``False`` without a watchdog)."""
    cut_clients: int = 0
    """Clients a shared stage (``serve --max-clients`` above 1) has cut for falling behind:
    each stopped taking frames with more than ``--client-buffer`` events queued for it, and
    was detached, its requests aborted (``docs/pool.md``, "Sharing replicas between
    clients"). Always 0 on a stage that serves one client, and from an older stage."""

    @property
    def steps(self) -> int:
        """The loop's steps (``loop.steps``)."""
        return self.loop.steps

    @property
    def engine(self) -> Mapping[str, float]:
        """The engine's own numbers (``loop.engine``)."""
        return self.loop.engine

    @classmethod
    def from_wire(cls, value: Any) -> StageStatistics:
        """Build one from the map a stage answers ``stats`` with; :class:`ValueError` if it
        is not one."""
        try:
            lp, st = value["loop"], value["stage"]
            buckets = tuple(float(b) for b in lp["step_buckets"])
            loop = LoopStatistics(**_decode(lp, _LOOP_WIRE))
            stats = cls(loop=loop, **_decode(st, _STAGE_WIRE))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a stage's statistics: {exc!r}") from exc
        if buckets != STEP_BUCKETS:
            raise ValueError(
                f"the stage's step-time buckets {buckets} are not this client's {STEP_BUCKETS}"
            )
        return stats


_LOOP_WIRE: Final = _wire_fields(LoopStatistics)
_STAGE_WIRE: Final = _wire_fields(StageStatistics, "loop")


@dataclass(frozen=True)
class StageLoad:
    """The latest load report of a stage, from ``client.load()``."""

    seq: int
    """The report's sequence number: 1, 2, ... per stage process."""
    age: float
    """Seconds since the stage sampled it: its age when it left the stage, plus the time
    since this client received it."""
    live: int
    """Requests live in the stage when it was sampled."""
    engine: Mapping[str, float]
    """The engine's own numbers (its ``stats()``: ``running``, ``waiting``, ...)."""
    received_at: float
    """``time.monotonic()`` when this client received it."""
