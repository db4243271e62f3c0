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
  how old the numbers were when they left the stage. An idle stage sends none.
"""

from __future__ import annotations

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
    "LoadReport",
    "LoadReporter",
    "StageLoad",
    "StageStatistics",
    "check_load_interval",
    "stage_statistics",
]

LOAD_INTERVAL: Final = 0.05
"""The default least time, in seconds, between two load reports of a stage."""


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


class LoadReporter:
    """Loop thread: makes a :class:`LoadReport` at most every *interval* seconds. The step
    that posts outputs checks :attr:`next_at` against ``time.perf_counter()`` itself (one
    clock read per step with outputs) and calls :meth:`report` when it has passed.

    The engine's numbers come from :attr:`sample`, which the stage sets to its loop's
    sampler (:meth:`enginecore._stats.StepTimer.sample_engine`) once the loop exists: the
    report's ``stats()`` call is also the loop's, which then skips its own for an interval,
    so a stepping stage calls ``stats()`` once per sample, not once for each. Until then,
    reports carry no engine numbers."""

    __slots__ = ("_live", "interval", "next_at", "sample", "seq")

    def __init__(self, interval: float, live: set[str]) -> None:
        self.interval = interval
        self.next_at = 0.0
        self.seq = 0  # reports made so far
        self._live = live
        self.sample: Callable[[float], Mapping[str, float] | None] = _no_sample
        """``sample(now)``: the engine's ``stats()`` sampled at *now*, or ``None`` (none,
        or it failed: logged and counted by the loop)."""

    def report(self, now: float) -> LoadReport:
        """A report sampled *now* (``time.perf_counter()``). A failed ``stats()`` leaves
        the engine's fields out."""
        self.next_at = now + self.interval
        self.seq += 1
        engine = self.sample(now)
        return LoadReport(self.seq, now, len(self._live), _EMPTY if engine is None else engine)


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
) -> dict[str, Any]:
    """The map a ``stats`` request is answered with. Any thread; never waits."""
    s = loop.statistics()
    return {
        "loop": {
            "steps": s.steps,
            "outputs": s.outputs,
            "adds": s.adds,
            "aborts": s.aborts,
            "utility_calls": s.utility_calls,
            "utility_errors": s.utility_errors,
            "controls": s.controls,
            "busy_seconds": s.busy_seconds,
            "idle_seconds": s.idle_seconds,
            "step_seconds": s.step_seconds,
            "step_seconds_max": s.step_seconds_max,
            "step_histogram": list(s.step_histogram),
            "step_buckets": list(STEP_BUCKETS),
            "last_drain": s.last_drain,
            "peak_drain": s.peak_drain,
            "queue_depth": s.queue_depth,
            "engine": dict(s.engine),
            "engine_age": s.engine_age,
            "engine_errors": s.engine_errors,
            "running": s.running,
        },
        "stage": {
            "name": name,
            "factory": factory,
            "pid": os.getpid(),
            "uptime_seconds": time.monotonic() - started,
            "outputs": outputs(),
            "live": len(live),
            "backlog": backlog(),
            "load_reports": reporter.seq if reporter is not None else 0,
            "load_interval": reporter.interval if reporter is not None else None,
            "stalled": stalled(),
        },
    }


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
            loop = LoopStatistics(
                steps=int(lp["steps"]),
                outputs=int(lp["outputs"]),
                adds=int(lp["adds"]),
                aborts=int(lp["aborts"]),
                utility_calls=int(lp["utility_calls"]),
                utility_errors=int(lp["utility_errors"]),
                controls=int(lp["controls"]),
                busy_seconds=float(lp["busy_seconds"]),
                idle_seconds=float(lp["idle_seconds"]),
                step_seconds=float(lp["step_seconds"]),
                step_seconds_max=float(lp["step_seconds_max"]),
                step_histogram=tuple(int(n) for n in lp["step_histogram"]),
                last_drain=int(lp["last_drain"]),
                peak_drain=int(lp["peak_drain"]),
                queue_depth=int(lp["queue_depth"]),
                engine=MappingProxyType(dict(lp["engine"])),
                engine_age=None if lp["engine_age"] is None else float(lp["engine_age"]),
                engine_errors=int(lp["engine_errors"]),
                running=bool(lp["running"]),
            )
            interval = st["load_interval"]
            stats = cls(
                loop=loop,
                name=str(st["name"]),
                factory=str(st["factory"]),
                pid=int(st["pid"]),
                uptime_seconds=float(st["uptime_seconds"]),
                outputs=int(st["outputs"]),
                live=int(st["live"]),
                backlog=int(st["backlog"]),
                load_reports=int(st["load_reports"]),
                load_interval=None if interval is None else float(interval),
                stalled=bool(st.get("stalled", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a stage's statistics: {exc!r}") from exc
        if buckets != STEP_BUCKETS:
            raise ValueError(
                f"the stage's step-time buckets {buckets} are not this client's {STEP_BUCKETS}"
            )
        return stats


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
