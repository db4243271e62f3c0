"""EngineCoreLoop.statistics(): exact counts, step times, busy and idle time, the engine's
own numbers, and a read that never waits for the loop. Every test runs on both loops: the
step() loop and the pipelined one (depths 1 and 3)."""

from __future__ import annotations

import dataclasses
import fractions
import logging
import re
import threading
import time
from collections.abc import Callable
from types import MappingProxyType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from enginecore import Abort, Add, Control, EngineCoreLoop, LoopStatistics, Utility

from .conftest import EventLog, LoopThread, RecordingEngine
from .pipeline_engines import CountdownPipeline

STEP_BUCKETS = LoopStatistics.STEP_BUCKETS
LOOPS = pytest.mark.parametrize(
    ("kind", "depth"), [("step", 1), ("pipelined", 1), ("pipelined", 3)], ids=str
)


def _engine_for(kind: str) -> RecordingEngine | CountdownPipeline:
    return RecordingEngine() if kind == "step" else CountdownPipeline()


def _steps_of(engine: RecordingEngine | CountdownPipeline) -> int:
    return engine.steps if isinstance(engine, RecordingEngine) else len(engine.collected)


def _on_step(engine: RecordingEngine | CountdownPipeline, hook: Callable[[int], None]) -> None:
    if isinstance(engine, RecordingEngine):
        engine.on_step = hook
    else:
        engine.on_collect = hook


class _Noop(Control):
    __slots__ = ()

    def apply(self, engine: Any, loop: EngineCoreLoop) -> None:
        pass


def _wait(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.001)


class TestBeforeAndAfter:
    @LOOPS
    def test_all_zero_before_run(self, kind: str, depth: int) -> None:
        loop = EngineCoreLoop(_engine_for(kind), EventLog(), pipeline_depth=depth)
        loop.submit(Add("a", 1))
        s = loop.statistics()
        assert isinstance(s, LoopStatistics)
        assert (s.steps, s.outputs, s.adds, s.busy_seconds, s.idle_seconds) == (0, 0, 0, 0, 0)
        assert s.step_histogram == (0,) * (len(STEP_BUCKETS) + 1)
        assert s.queue_depth == 1
        assert not s.running
        assert s.engine == {}
        assert s.engine_age is None
        assert s.step_quantile(0.5) == 0.0

    @pytest.mark.parametrize(
        ("q", "error"),
        [("0.5", TypeError), (None, TypeError), (True, TypeError), (float("nan"), ValueError)],
        ids=["str", "none", "bool", "nan"],
    )
    def test_step_quantile_refuses_a_q_that_is_not_a_fraction(
        self, q: Any, error: type[Exception]
    ) -> None:
        s = EngineCoreLoop(RecordingEngine(), EventLog()).statistics()
        with pytest.raises(error, match="q must be"):
            s.step_quantile(q)

    def test_frozen(self) -> None:
        s = EngineCoreLoop(RecordingEngine(), EventLog()).statistics()
        with pytest.raises(dataclasses.FrozenInstanceError):
            s.steps = 3  # type: ignore[misc]

    @LOOPS
    def test_counts_are_exact_after_the_run(self, kind: str, depth: int) -> None:
        engine = _engine_for(kind)
        log = EventLog()
        loop = EngineCoreLoop(engine, log, pipeline_depth=depth)
        loop.submit_many(
            [Add("a", 3), Add("b", 200), Abort(["b"]), Utility(1, "div", (1, 0)), _Noop()]
        )
        loop.submit(Utility(2, "div", (4, 2)))
        lt = LoopThread(loop).start()
        log.wait_for(lambda ev: ("output", ("a", 0)) in ev)
        loop.request_shutdown()
        lt.join()
        s = loop.statistics()
        assert s.steps == _steps_of(engine) == 3
        assert s.outputs == len(log.outputs()) == 3
        assert (s.adds, s.aborts, s.controls) == (2, 1, 1)
        assert (s.utility_calls, s.utility_errors) == (2, 1)
        assert s.peak_drain >= 5
        assert sum(s.step_histogram) == s.steps
        assert s.step_seconds > 0
        assert s.step_seconds_max > 0
        assert not s.running
        assert s.queue_depth == 0

    @LOOPS
    def test_thousands_of_fast_steps_are_all_counted(self, kind: str, depth: int) -> None:
        engine = _engine_for(kind)
        log = EventLog()
        loop = EngineCoreLoop(engine, log, pipeline_depth=depth)
        loop.submit(Add("a", 1000))  # not a multiple of the block (64)
        loop.submit(Add("b", 37))
        lt = LoopThread(loop).start()
        log.wait_for(lambda ev: ("output", ("a", 0)) in ev, timeout=30)
        loop.request_shutdown()
        lt.join()
        s = loop.statistics()
        assert s.steps == _steps_of(engine) == 1000
        assert s.outputs == 1037
        assert sum(s.step_histogram) == 1000

    @LOOPS
    def test_a_fatal_error_still_leaves_exact_counts(self, kind: str, depth: int) -> None:
        engine = _engine_for(kind)
        log = EventLog()
        loop = EngineCoreLoop(engine, log, pipeline_depth=depth)

        def boom(n: int) -> None:
            if n == 5:  # a collect's handle number is 0-based, a step's 1-based: either
                raise RuntimeError("boom")

        _on_step(engine, boom)
        loop.submit(Add("a", 100))
        LoopThread(loop).start().join()
        assert log.events[-1][0] == "fatal"
        s = loop.statistics()
        assert s.outputs == len(log.outputs())
        assert s.steps == sum(s.step_histogram) == len(log.outputs())
        assert not s.running

    @LOOPS
    def test_a_fatal_message_after_going_idle_counts_no_step_twice(
        self, kind: str, depth: int
    ) -> None:
        """Going idle in the middle of a block counts its steps; a fatal error in the
        message that ends the wait must not count them again."""
        engine = _engine_for(kind)
        log = EventLog()
        loop = EngineCoreLoop(engine, log, pipeline_depth=depth)
        loop.submit(Add("a", 100))  # 100 fast steps: 64 timed alone, then a block of 64
        lt = LoopThread(loop).start()
        _wait(lambda: loop.statistics().steps == 100)  # counted when the loop went idle
        loop.submit(_Boom())
        lt.join()
        assert log.events[-1][0] == "fatal"
        s = loop.statistics()
        assert s.steps == sum(s.step_histogram) == 100 == _steps_of(engine)
        assert s.outputs == len(log.outputs())

    @LOOPS
    def test_outputs_emitted_by_a_step_that_then_fails_are_counted(
        self, kind: str, depth: int
    ) -> None:
        """A step (or collect) whose outputs fail part-way: the one emitted counts as an
        output, the step that did not return as no step."""
        engine = _engine_for(kind)
        log = EventLog()
        loop = EngineCoreLoop(engine, log, pipeline_depth=depth)

        def first_then_fail(outs: Any) -> Any:
            yield next(iter(outs))
            raise RuntimeError("failed after its first output")

        if isinstance(engine, RecordingEngine):
            step = engine.step
            engine.step = lambda: first_then_fail(step())  # type: ignore[method-assign]
        else:
            collect = engine.collect
            engine.collect = lambda h: first_then_fail(collect(h))  # type: ignore[method-assign, assignment]
        loop.submit(Add("a", 3))
        LoopThread(loop).start().join()
        assert log.events[-1][0] == "fatal"
        assert len(log.outputs()) == 1
        s = loop.statistics()
        assert s.outputs == 1
        assert s.steps == sum(s.step_histogram) == 0


class _Boom(Control):
    __slots__ = ()

    def apply(self, engine: Any, loop: EngineCoreLoop) -> None:
        raise RuntimeError("boom")


class TestTimes:
    @LOOPS
    def test_slow_steps_are_timed_one_by_one(self, kind: str, depth: int) -> None:
        engine = _engine_for(kind)
        log = EventLog()
        loop = EngineCoreLoop(engine, log, pipeline_depth=depth)
        n_fast, n_slow = 300, 80

        def pace(n: int) -> None:
            if n > n_fast:
                time.sleep(0.003)

        _on_step(engine, pace)
        loop.submit(Add("a", n_fast + n_slow + 1))
        lt = LoopThread(loop).start()
        log.wait_for(lambda ev: ("output", ("a", 0)) in ev, timeout=30)
        loop.request_shutdown()
        lt.join()
        s = loop.statistics()
        assert s.steps == n_fast + n_slow + 1
        # The block that was running when the steps slowed down counts at its mean; from
        # then on each step is timed alone: at least 3 ms, so past the 2.5 ms bound.
        slow = sum(s.step_histogram[STEP_BUCKETS.index(0.0025) + 1 :])
        assert slow >= n_slow - 64
        assert s.step_seconds_max >= 0.003
        assert s.step_seconds >= n_slow * 0.003
        assert s.step_quantile(1.0) > 0.0025

    @LOOPS
    def test_idle_time_grows_while_blocked_and_busy_does_not(self, kind: str, depth: int) -> None:
        loop = EngineCoreLoop(_engine_for(kind), EventLog(), pipeline_depth=depth)
        lt = LoopThread(loop).start()
        _wait(lambda: loop.statistics().idle_seconds > 0)
        first = loop.statistics()
        time.sleep(0.05)
        second = loop.statistics()
        assert second.idle_seconds - first.idle_seconds >= 0.04
        assert second.busy_seconds - first.busy_seconds < 0.04
        assert second.running
        loop.request_shutdown()
        lt.join()
        last = loop.statistics()
        assert last.idle_seconds >= second.idle_seconds

    @LOOPS
    def test_reading_never_waits_for_a_step(self, kind: str, depth: int) -> None:
        engine = _engine_for(kind)
        log = EventLog()
        loop = EngineCoreLoop(engine, log, pipeline_depth=depth)
        inside, release = threading.Event(), threading.Event()

        def block(n: int) -> None:
            inside.set()
            assert release.wait(10)

        _on_step(engine, block)
        loop.submit(Add("a", 1))
        lt = LoopThread(loop).start()
        try:
            assert inside.wait(5)
            for i in range(3):
                loop.submit(Add(f"q{i}", 1))
            t0 = time.monotonic()
            s = loop.statistics()  # the loop is inside a step and holds nothing we need
            assert time.monotonic() - t0 < 1.0
            assert s.queue_depth == 3
            assert s.running
        finally:
            release.set()
            loop.request_shutdown()
            lt.join()


class _WithStats(RecordingEngine):
    def __init__(self, stats: Callable[[RecordingEngine], Any]) -> None:
        super().__init__()
        self._stats = stats
        self.stats_threads: set[int] = set()

    def stats(self) -> Any:
        self.stats_threads.add(threading.get_ident())
        return self._stats(self)


class _PipelinedWithStats(CountdownPipeline):
    def stats(self) -> dict[str, float]:
        return {"running": float(len(self._live))}


class TestEngineStats:
    def test_sampled_on_the_loop_thread_and_at_rest(self) -> None:
        engine = _WithStats(lambda e: {"running": len(e._remaining), "kv_usage": 0.5})
        log = EventLog()
        loop = EngineCoreLoop(engine, log)
        loop.submit(Add("a", 3))
        lt = LoopThread(loop).start()
        log.wait_for(lambda ev: ("output", ("a", 0)) in ev)
        # Going idle samples the engine: its numbers at rest.
        _wait(lambda: loop.statistics().engine.get("running") == 0)
        s = loop.statistics()
        assert s.engine == {"running": 0, "kv_usage": 0.5}
        assert s.engine_age is not None
        assert s.engine_age >= 0
        loop.request_shutdown()
        lt.join()
        assert engine.stats_threads == {lt.thread.ident}

    def test_a_pipelined_engine_has_them_too(self) -> None:
        engine = _PipelinedWithStats()
        log = EventLog()
        loop = EngineCoreLoop(engine, log, pipeline_depth=2)
        loop.submit(Add("a", 3))
        lt = LoopThread(loop).start()
        log.wait_for(lambda ev: ("output", ("a", 0)) in ev)
        _wait(lambda: loop.statistics().engine == {"running": 0.0})
        loop.request_shutdown()
        lt.join()

    def test_sampled_while_stepping(self) -> None:
        seen: list[float] = []
        engine = _WithStats(lambda e: {"steps": e.steps})

        def slow(n: int) -> None:
            time.sleep(0.002)
            if n == 60:  # >= 0.1 s in: several samples were due
                seen.append(loop.statistics().engine.get("steps", -1))

        engine.on_step = slow
        log = EventLog()
        loop = EngineCoreLoop(engine, log)
        loop.submit(Add("a", 61))
        lt = LoopThread(loop).start()
        log.wait_for(lambda ev: ("output", ("a", 0)) in ev, timeout=10)
        loop.request_shutdown()
        lt.join()
        assert 0 < seen[0] < 60

    def test_numpy_numbers_are_taken_as_ints_and_floats(self) -> None:
        # What an engine's arrays give (np.int64 from a sum, np.float32): counted as a
        # failed call before, every sample.
        engine = _WithStats(
            lambda e: {
                "running": np.int64(3),
                "kv_usage": np.float32(0.5),
                "share": fractions.Fraction(1, 4),
            }
        )
        log = EventLog()
        loop = EngineCoreLoop(engine, log)
        loop.submit(Add("a", 2))
        lt = LoopThread(loop).start()
        log.wait_for(lambda ev: ("output", ("a", 0)) in ev)
        _wait(lambda: bool(loop.statistics().engine))
        loop.request_shutdown()
        lt.join()
        s = loop.statistics()
        assert s.engine_errors == 0
        assert s.engine == {"running": 3, "kv_usage": 0.5, "share": 0.25}
        assert [type(s.engine[k]) for k in ("running", "kv_usage", "share")] == [int, float, float]

    @pytest.mark.parametrize(
        ("stats", "message"),
        [
            (lambda e: 1 / 0, "ZeroDivisionError"),
            (lambda e: [("a", 1)], "must return a dict"),
            (lambda e: {"a": "x"}, r"\['a'\] must be an int or a float"),
            (lambda e: {"a": True}, "must be an int or a float, got bool"),
            (lambda e: {"a": np.True_}, "must be an int or a float, got bool"),
            (lambda e: {"a": complex(1, 0)}, "must be an int or a float, got complex"),
            (lambda e: {1: 1}, "returned a key of type int"),
            # A stage could not send it (msgpack): its stats() calls and load reports failed.
            (lambda e: {"a": 2**64}, r"\['a'\] = 18446744073709551616 is outside"),
            (lambda e: {"a": -(2**63) - 1}, r"\['a'\] = -9223372036854775809 is outside"),
        ],
        ids=[
            "raises",
            "not-a-mapping",
            "a-string",
            "a-bool",
            "a-numpy-bool",
            "a-complex",
            "an-int-key",
            "huge",
            "-huge",
        ],
    )
    def test_a_bad_stats_is_logged_and_counted_and_the_loop_goes_on(
        self, stats: Callable[[RecordingEngine], Any], message: str, caplog: Any
    ) -> None:
        engine = _WithStats(stats)
        log = EventLog()
        loop = EngineCoreLoop(engine, log)
        loop.submit(Add("a", 2))
        with caplog.at_level(logging.ERROR, logger="enginecore"):
            lt = LoopThread(loop).start()
            log.wait_for(lambda ev: ("output", ("a", 0)) in ev)
            loop.request_shutdown()
            lt.join()
        assert log.events[-1] == ("shutdown",)
        s = loop.statistics()
        assert s.engine_errors >= 1
        assert s.engine == {}
        failures = [r for r in caplog.records if "engine.stats() failed" in r.getMessage()]
        assert len(failures) == 1  # the first one; then every 1000th
        assert failures[0].exc_info is not None
        text = logging.Formatter().formatException(failures[0].exc_info)
        assert re.search(message, text)


_MSG = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 4)),
    st.tuples(st.just("abort")),
    st.tuples(st.just("utility"), st.integers(0, 2)),
    st.tuples(st.just("control")),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches=st.lists(st.lists(_MSG, min_size=1, max_size=6), min_size=1, max_size=6))
def test_counts_match_what_was_sent(batches: list[list[tuple[Any, ...]]]) -> None:
    """Model check: whatever messages arrive, in whatever bursts, the counts are exact."""
    engine = RecordingEngine()
    log = EventLog()
    loop = EngineCoreLoop(engine, log)
    lt = LoopThread(loop).start()
    expect = {"add": 0, "abort": 0, "utility": 0, "errors": 0, "control": 0}
    n = 0
    for batch in batches:
        msgs: list[Any] = []
        for m in batch:
            n += 1
            if m[0] == "add":
                msgs.append(Add(f"r{n}", m[1]))
                expect["add"] += 1
            elif m[0] == "abort":
                msgs.append(Abort([f"r{n - 1}"]))
                expect["abort"] += 1
            elif m[0] == "utility":
                msgs.append(Utility(n, "div", (1, m[1])))
                expect["utility"] += 1
                expect["errors"] += m[1] == 0
            else:
                msgs.append(_Noop())
                expect["control"] += 1
        loop.submit_many(msgs)
    loop.request_shutdown()
    lt.join()
    s = loop.statistics()
    assert (s.adds, s.aborts, s.utility_calls, s.utility_errors, s.controls) == (
        expect["add"],
        expect["abort"],
        expect["utility"],
        expect["errors"],
        expect["control"],
    )
    assert s.outputs == len(log.outputs())
    assert s.steps == engine.steps == sum(s.step_histogram)


class TestStepTimer:
    """The block logic on its own: what the loop calls, fed with chosen durations."""

    def _timer(self) -> tuple[Any, Any]:
        from enginecore._stats import StepTimer, _Counters

        c = _Counters()
        return StepTimer(c, object()), c

    def test_blocks_only_after_a_run_of_fast_steps(self) -> None:
        from enginecore._stats import BLOCK

        timer, c = self._timer()
        block = 1
        for i in range(BLOCK - 1):
            block = timer.end_block(block, 1, 1e-6, 1, float(i))
            assert block == 1
        # A slow step in between starts the run again.
        assert timer.end_block(1, 1, 1e-3, 1, 0.0) == 1
        for _ in range(BLOCK - 1):
            assert timer.end_block(1, 1, 1e-6, 1, 0.0) == 1
        assert timer.end_block(1, 1, 1e-6, 1, 0.0) == BLOCK
        # A block whose mean is slow goes back to timing each step.
        assert timer.end_block(BLOCK, BLOCK, BLOCK * 20e-6, BLOCK, 0.0) == 1
        assert sum(c.histogram) == 3 * BLOCK
        assert c.outputs == 3 * BLOCK

    def test_a_fast_block_lands_in_the_first_bucket_and_a_slow_step_in_its_own(self) -> None:
        timer, c = self._timer()
        timer.end_block(64, 64, 64 * 5e-6, 64, 0.0)
        timer.end_block(1, 1, 0.003, 2, 0.0)
        assert c.histogram[0] == 64
        assert c.histogram[STEP_BUCKETS.index(0.005)] == 1
        assert c.max == pytest.approx(0.003)
        assert c.step_sum == pytest.approx(64 * 5e-6 + 0.003)

    @settings(max_examples=300, deadline=None)
    @given(
        blocks=st.lists(
            st.tuples(
                st.sampled_from([1, 64]),
                st.floats(0.0, 0.01, allow_nan=False) | st.sampled_from([64e-5, 63.9e-5]),
                st.integers(0, 300),
            ),
            max_size=20,
        )
    )
    def test_the_fast_block_path_counts_as_the_general_one(
        self, blocks: list[tuple[int, float, int]]
    ) -> None:
        """end_block's inlined path for whole blocks of fast steps leaves the same numbers
        and picks the same next block as the general count (_count) would."""
        fast, c = self._timer()
        general, g = self._timer()
        for steps, seconds, outputs in blocks:
            nxt = fast.end_block(steps, steps, seconds, outputs, 0.0)
            assert nxt == general._count(steps, steps, seconds, outputs)
            assert fast.block == general.block == nxt
            for name in ("outputs", "histogram", "step_sum", "max"):
                assert getattr(c, name) == getattr(g, name), name


def test_utility_calls_alone_do_not_sample_the_engine_again() -> None:
    made: list[int] = []

    def count(e: RecordingEngine) -> dict[str, float]:
        made.append(1)
        return {"calls": len(made)}

    engine = _WithStats(count)
    log = EventLog()
    loop = EngineCoreLoop(engine, log)
    lt = LoopThread(loop).start()
    for i in range(5):
        loop.submit(Utility(i, "div", (1, 1)))
    log.wait_for(lambda ev: len(ev) == 5)
    loop.submit(Add("a", 1))
    log.wait_for(lambda ev: ("output", ("a", 0)) in ev)
    _wait(lambda: loop.statistics().engine.get("calls") == 2)
    loop.request_shutdown()
    lt.join()
    # Once when it first went idle, once after the add and its step; none per utility call.
    assert len(made) == 2


def test_a_failing_stats_is_called_at_most_every_interval_not_every_step() -> None:
    # A stats() that fails keeps no sample: the 50 ms interval still counts from the call,
    # or a broken stats() would run (and raise) after every step.
    calls: list[float] = []

    def fail(e: RecordingEngine) -> Any:
        calls.append(time.perf_counter())
        raise RuntimeError("no stats")

    engine = _WithStats(fail)
    log = EventLog()
    loop = EngineCoreLoop(engine, log)
    loop.submit(Add("a", 300))
    started = time.perf_counter()
    lt = LoopThread(loop).start()
    log.wait_for(lambda ev: ("output", ("a", 0)) in ev, timeout=30)
    elapsed = time.perf_counter() - started
    loop.request_shutdown()
    lt.join()
    assert loop.statistics().engine_errors == len(calls)
    # One sample per 50 ms while stepping, and one on going idle (and one at start).
    assert len(calls) <= 3 + elapsed / 0.05, (len(calls), elapsed)
    assert len(calls) < 300


def test_a_snapshot_racing_the_loop_thread_never_sees_its_times_go_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A snapshot that read the clock before the loop thread's own clock read and write (an
    # idle wait ending, a stats() sample) but the written numbers after: busy_seconds
    # went back by the gap (a counter reset, for Prometheus' rate()), and engine_age was
    # negative. The clock is read after the numbers now.
    from enginecore import _stats

    c = _stats._Counters()
    c.started = 50.0
    c.idle = (10.0, 95.0)  # 10 s idle before; waiting since 95
    c.engine = (MappingProxyType({"running": 1}), 90.0)
    clock = SimpleNamespace(perf_counter=lambda: 99.0)
    monkeypatch.setattr(_stats, "time", clock)
    before = c.snapshot(0)
    assert (before.busy_seconds, before.idle_seconds) == (35.0, 14.0)

    def racing() -> float:
        # The loop thread, on another core: woke at 101 and sampled the engine at 100.5,
        # just after this snapshot's clock read (100).
        c.idle = (10.0 + 101.0 - 95.0, 0.0)
        c.engine = (MappingProxyType({"running": 2}), 100.5)
        clock.perf_counter = lambda: 102.0
        return 100.0

    clock.perf_counter = racing
    after = c.snapshot(0)
    assert after.busy_seconds >= before.busy_seconds
    assert after.idle_seconds >= before.idle_seconds
    assert after.engine_age is not None
    assert after.engine_age >= 0
