"""The loop's statistics: what :meth:`EngineCoreLoop.statistics` returns, and how it is kept.

The loop thread keeps the numbers in a :class:`_Counters`; any other thread reads them,
without a lock, into a frozen :class:`LoopStatistics`. Each field is read atomically (the
GIL); the histogram is copied in one C call, and :attr:`LoopStatistics.steps` is its sum, so
the two always agree.

**Timing steps costs almost nothing.** A clock read is ~50 ns here, as much as the loop's
whole budget for statistics, so the loop does not time every step (``docs/observability.md``
has the measurements):

- Steps are timed in *blocks* of :data:`BLOCK` steps, with one clock read per block. While
  a block's steps average under :data:`FAST_STEP` seconds, each of them counts at the
  block's mean in the histogram. Such a block took under ``BLOCK * FAST_STEP`` (0.64 ms) in
  all, so each of its steps really was under the first bucket's bound (1 ms): the histogram
  is exact, and only :attr:`~LoopStatistics.step_seconds_max` is the block's mean.
- Once a block averages :data:`FAST_STEP` or more (any real engine), every step is timed on
  its own: two clock reads and a few additions, under 2 % of a 10 µs step. After
  :data:`BLOCK` steps in a row under :data:`FAST_STEP`, blocks resume.
- A step's time runs from the end of the previous step, drain or idle wait to the end of
  emitting its outputs: ``has_work()``, the step, and the emits. A block that a drain
  interrupts includes that drain.

Busy and idle time are exact: the clock is read around every idle wait, which is free,
since the loop has nothing to do.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from bisect import bisect_left
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Final

__all__ = ["BLOCK", "FAST_STEP", "STEP_BUCKETS", "LoopStatistics"]

logger = logging.getLogger("enginecore")

STEP_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
"""The upper bounds, in seconds, of the step-time histogram's buckets (each bound included);
:attr:`LoopStatistics.step_histogram` has one more bucket, for longer steps."""

BLOCK: Final = 64
"""Fast steps are timed this many at a time."""

FAST_STEP: Final = 10e-6
"""Steps shorter than this on average (seconds) are timed in blocks; longer ones one by one."""

_FAST_BLOCK: Final = BLOCK * FAST_STEP  # a whole block under this is a block of fast steps
assert STEP_BUCKETS[0] >= _FAST_BLOCK  # so each of its steps is in the first bucket

ENGINE_STATS_INTERVAL: Final = 0.05
"""The loop calls ``engine.stats()`` at most this often (seconds) while it steps, and once
more each time it goes idle after a step, an add, an abort or a control. A sample taken
for a stage's load report (:meth:`StepTimer.sample_engine`) counts as the loop's own."""

_EMPTY: Final[Mapping[str, float]] = MappingProxyType({})


@dataclass(frozen=True)
class LoopStatistics:
    """A snapshot of an :class:`~enginecore.EngineCoreLoop`'s numbers, from
    :meth:`~enginecore.EngineCoreLoop.statistics`. Counts run from the start of
    :meth:`~enginecore.EngineCoreLoop.run`; all zero before it."""

    STEP_BUCKETS: ClassVar[tuple[float, ...]] = STEP_BUCKETS
    """The upper bounds, in seconds, of :attr:`step_histogram`'s buckets (each bound
    included); the histogram has one more bucket, for longer steps."""

    steps: int
    """Steps that returned: ``step()`` calls, or ``collect()`` calls of a pipelined engine.
    The sum of :attr:`step_histogram`."""
    outputs: int
    """``("output", ...)`` events emitted (a stage hands its outputs over itself, and counts
    them in its own statistics)."""
    adds: int
    """``Add`` messages applied."""
    aborts: int
    """``Abort`` messages applied (in a stage: every ``abort`` message, a pipeline's fence
    and tagged abort included, ``docs/observability.md``)."""
    utility_calls: int
    """``Utility`` messages applied."""
    utility_errors: int
    """Utility calls answered with an error (raised, a future that failed, or one still
    pending when the loop ended). A ``Utility`` still queued when the loop ended, answered
    with a ``LoopEndedError`` without being applied, counts in neither."""
    controls: int
    """``Control`` messages applied."""
    busy_seconds: float
    """Time in :meth:`~enginecore.EngineCoreLoop.run` not spent blocked waiting for a
    message."""
    idle_seconds: float
    """Time blocked waiting for a message, including the current wait."""
    step_seconds: float
    """The total time of the :attr:`steps` (``docs/observability.md`` says what a step's
    time covers)."""
    step_seconds_max: float
    """The longest step (for steps timed in a block: the block's mean)."""
    step_histogram: tuple[int, ...]
    """Steps per bucket: ``step_histogram[i]`` counts steps of at most ``STEP_BUCKETS[i]``
    seconds (and more than the bound before); the last one, longer steps. Not
    cumulative."""
    last_drain: int
    """Messages applied by the last drain that applied any."""
    peak_drain: int
    """The most messages one drain applied."""
    queue_depth: int
    """Messages waiting in ``input_queue`` now."""
    engine: Mapping[str, float]
    """The engine's own numbers, from its optional ``stats()`` (read-only; empty without
    it), as of :attr:`engine_age` seconds ago."""
    engine_age: float | None
    """Seconds since ``engine.stats()`` returned :attr:`engine`; ``None`` before its
    first call."""
    engine_errors: int
    """Calls of ``engine.stats()`` that raised or returned something else than a mapping
    of names to numbers (each logged; :attr:`engine` keeps the previous sample)."""
    running: bool
    """Whether :meth:`~enginecore.EngineCoreLoop.run` is running now."""

    @property
    def step_seconds_mean(self) -> float:
        """The mean step time; 0.0 before the first step."""
        return self.step_seconds / self.steps if self.steps else 0.0

    def step_quantile(self, q: float) -> float:
        """An estimate of the *q*-quantile (0 ≤ *q* ≤ 1) of the step time, from the
        histogram: the upper bound of the bucket it falls in (``math.inf`` for the last).
        0.0 before the first step. :class:`ValueError` for a *q* outside [0, 1] (NaN
        included), :class:`TypeError` for one that is not a number (``bool`` included)."""
        if isinstance(q, bool) or not isinstance(q, (int, float)):
            raise TypeError(f"q must be a number between 0 and 1, got {q!r}")
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q must be between 0 and 1, got {q!r}")
        return quantile(self.step_histogram, STEP_BUCKETS, q)


def quantile(histogram: tuple[int, ...], bounds: tuple[float, ...], q: float) -> float:
    """The upper bound of the bucket that holds the *q*-quantile of *histogram*."""
    total = sum(histogram)
    if not total:
        return 0.0
    rank = max(1, math.ceil(q * total))
    seen = 0
    for i, n in enumerate(histogram):
        seen += n
        if seen >= rank:
            return bounds[i] if i < len(bounds) else math.inf
    return math.inf  # pragma: no cover - the loop always returns


def bucket(seconds: float) -> int:
    """The index of the histogram bucket for a step of *seconds*."""
    return bisect_left(STEP_BUCKETS, seconds)


class _Counters:
    """The loop's numbers. Written by the loop thread only; read by any thread."""

    __slots__ = (
        "aborts",
        "adds",
        "controls",
        "engine",
        "engine_errors",
        "histogram",
        "idle",
        "last_drain",
        "max",
        "outputs",
        "peak_drain",
        "sampled",
        "started",
        "step_sum",
        "stopped",
        "utility_calls",
        "utility_errors",
    )

    def __init__(self) -> None:
        self.adds = 0
        self.aborts = 0
        self.utility_calls = 0
        self.utility_errors = 0
        self.controls = 0
        self.outputs = 0
        self.last_drain = 0
        self.peak_drain = 0
        self.histogram = [0] * (len(STEP_BUCKETS) + 1)
        self.step_sum = 0.0
        self.max = 0.0
        self.started = 0.0  # perf_counter at run()'s start; 0.0 before
        self.stopped = 0.0  # perf_counter at run()'s end; 0.0 before
        # (the idle waits that ended, in seconds; the start of the current one, or 0.0):
        # one tuple, so a reader never sees one half updated without the other.
        self.idle = (0.0, 0.0)
        # (the engine's last stats() sample; the perf_counter it was taken at, 0.0: never)
        self.engine: tuple[Mapping[str, float], float] = (_EMPTY, 0.0)
        self.engine_errors = 0
        # The perf_counter of the last stats() call, failed or not: the 50 ms interval
        # counts from it, so a stats() that fails is not called again after every step.
        self.sampled = 0.0

    def snapshot(self, queue_depth: int) -> LoopStatistics:
        # Read the moving parts first, each once: the loop thread may write between reads.
        # The idle pair before stopped (the loop writes them in the other order at its
        # end), and the clock last: the loop reads its clock before it writes, so no time
        # read here is later than now, and busy and idle never go back between snapshots.
        histogram = tuple(self.histogram)
        idle, idle_since = self.idle
        started, stopped = self.started, self.stopped
        engine, engine_at = self.engine
        now = time.perf_counter()
        if idle_since:
            idle += (stopped or now) - idle_since
        if started:
            elapsed = (stopped or now) - started
            busy = max(0.0, elapsed - idle)
        else:
            busy = 0.0
        return LoopStatistics(
            steps=sum(histogram),
            outputs=self.outputs,
            adds=self.adds,
            aborts=self.aborts,
            utility_calls=self.utility_calls,
            utility_errors=self.utility_errors,
            controls=self.controls,
            busy_seconds=busy,
            idle_seconds=idle,
            step_seconds=self.step_sum,
            step_seconds_max=self.max,
            step_histogram=histogram,
            last_drain=self.last_drain,
            peak_drain=self.peak_drain,
            queue_depth=queue_depth,
            engine=engine,
            engine_age=(now - engine_at) if engine_at else None,
            engine_errors=self.engine_errors,
            running=bool(started) and not stopped,
        )

    def sample_engine(self, stats: Callable[[], Any], now: float) -> Mapping[str, float] | None:
        """Loop thread: call the engine's ``stats()`` and keep its numbers. Returns them, or
        ``None`` if the call failed (logged, counted; the previous sample stays)."""
        self.sampled = now
        try:
            raw = stats()
            sample = _check_engine_stats(raw)
        except Exception:
            self.engine_errors += 1
            if self.engine_errors == 1 or self.engine_errors % 1000 == 0:
                logger.exception(
                    "enginecore: engine.stats() failed (%d so far); its statistics keep "
                    "the previous sample",
                    self.engine_errors,
                )
            return None
        self.engine = (sample, now)
        return sample


_INT_MIN: Final = -(2**63)
_INT_MAX: Final = 2**64 - 1
"""The ints of an engine's ``stats()`` that msgpack (a stage's wire) can carry."""


def _check_engine_stats(raw: object) -> Mapping[str, float]:
    if not isinstance(raw, Mapping):
        raise TypeError(
            f"engine.stats() must return a dict of str to int or float, got {type(raw).__name__}"
        )
    out: dict[str, float] = {}
    for key, given in raw.items():
        value = given
        if not isinstance(key, str):
            raise TypeError(f"engine.stats() returned a key of type {type(key).__name__}")
        if type(value) is not int and type(value) is not float:
            # Another number type that says what it is: numpy's (np.int64 from an array's
            # sum, np.float32), fractions. Taken as the int or float it stands for, which
            # the stage's wire carries; a bool (numpy's is no number) is refused.
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(
                    f"engine.stats()[{key!r}] must be an int or a float, got {type(value).__name__}"
                )
            value = int(value) if isinstance(value, numbers.Integral) else float(value)
        if isinstance(value, int) and not _INT_MIN <= value <= _INT_MAX:
            # A stage sends the sample (msgpack): it could answer no stats() call, and send
            # no load report, for as long as this one stayed the latest.
            raise ValueError(
                f"engine.stats()[{key!r}] = {value} is outside the ints a stage can send "
                f"(-2**63..2**64-1); return a float for it"
            )
        out[key] = value
    return MappingProxyType(out)


class StepTimer:
    """The loop thread's side of the statistics: what the loop calls at the end of a block
    of steps, around an idle wait, and at the end. The loop keeps the block itself in locals
    (its size, the steps done, its start, the outputs so far); this turns them into the
    :class:`_Counters`' numbers and chooses the next block's size (:data:`BLOCK` or 1)."""

    __slots__ = ("_at_rest", "_c", "_fast_run", "_stats", "block")

    def __init__(self, counters: _Counters, engine: object) -> None:
        self._c = counters
        stats = getattr(engine, "stats", None)
        self._stats: Callable[[], Any] | None = stats if callable(stats) else None
        self._fast_run = 0  # steps timed alone in a row that were fast
        self.block = 1  # the size of the next block, after an idle wait
        self._at_rest: tuple[float, ...] = ()  # what idle() last sampled the engine after

    def end_block(self, block: int, steps: int, seconds: float, outputs: int, now: float) -> int:
        """*steps* steps (of a block of *block*) took *seconds*, ending at *now*, and
        emitted *outputs* outputs. Returns the next block's size, negated if it called
        ``engine.stats()`` (the loop then restarts its clock, so no step includes it)."""
        c = self._c
        if steps == BLOCK and seconds < _FAST_BLOCK:
            # The common case of fast steps, what _count does for it, inlined: every step
            # of the block is under FAST_STEP on average, so in the first bucket, and the
            # next block is a whole one too. ~0.2 µs instead of ~0.5 µs a block (a few ns
            # an iteration: the statistics' budget is 50 ns).
            c.outputs += outputs
            c.histogram[0] += steps
            c.step_sum += seconds
            mean = seconds / steps
            if mean > c.max:  # noqa: PLR1730  # max() is a call
                c.max = mean
            self.block = nxt = BLOCK
        else:
            nxt = self._count(block, steps, seconds, outputs)
        if self._stats is not None and now - c.sampled >= ENGINE_STATS_INTERVAL:
            c.sample_engine(self._stats, now)
            return -nxt
        return nxt

    def sample_engine(self, now: float) -> Mapping[str, float] | None:
        """Loop thread: sample the engine's ``stats()`` at *now* (``time.perf_counter()``)
        for someone else than the loop, a stage's load report: the sample is the one
        :meth:`~enginecore.EngineCoreLoop.statistics` shows, and the loop's own interval
        counts from it, so one call serves both. Returns it; ``None`` if the engine has no
        ``stats()`` or the call failed (logged, counted)."""
        if self._stats is None:
            return None
        return self._c.sample_engine(self._stats, now)

    def _count(self, block: int, steps: int, seconds: float, outputs: int) -> int:
        c = self._c
        c.outputs += outputs
        mean = seconds / steps
        c.histogram[bisect_left(STEP_BUCKETS, mean)] += steps
        c.step_sum += seconds
        c.max = max(c.max, mean)
        if mean >= FAST_STEP:
            nxt = 1  # time each step on its own, until BLOCK fast ones in a row
            self._fast_run = 0
        elif block > 1:
            nxt = BLOCK
        else:
            self._fast_run += 1
            if self._fast_run >= BLOCK:
                nxt = BLOCK
                self._fast_run = 0
            else:
                nxt = 1
        self.block = nxt
        return nxt

    def flush(self, block: int, steps: int, started: float, outputs: int) -> None:
        """The loop is about to wait or end: count the *steps* of the current block, and
        its *outputs*."""
        if steps:
            self._count(block, steps, time.perf_counter() - started, outputs)
        else:
            self._c.outputs += outputs

    def idle(self, block: int, steps: int, started: float, outputs: int) -> float:
        """The loop is about to block in ``get()``: count the block so far, sample the
        engine (its numbers at rest) if anything but utility calls reached it since the
        last time, and start the idle clock. Returns the time it started."""
        self.flush(block, steps, started, outputs)
        c = self._c
        if self._stats is not None:
            # Only if the engine's state may have changed since the last time it went idle:
            # a step, an add, an abort or a control. Not after a lone utility call, whose
            # round trip would pay for it.
            marks = (c.step_sum, c.adds, c.aborts, c.controls)  # step_sum grows every step
            if marks != self._at_rest:
                self._at_rest = marks
                c.sample_engine(self._stats, time.perf_counter())
        now = time.perf_counter()
        c.idle = (c.idle[0], now)
        return now

    def woke(self, since: float) -> float:
        """The idle wait that began at *since* ended. Returns the time."""
        now = time.perf_counter()
        c = self._c
        c.idle = (c.idle[0] + now - since, 0.0)
        return now

    def stopped(self) -> None:
        """The loop is about to emit its last event."""
        c = self._c
        c.stopped = time.perf_counter()
        if c.idle[1]:
            c.idle = (c.idle[0] + c.stopped - c.idle[1], 0.0)
