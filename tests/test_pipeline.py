"""Pipelined engines and deferred utilities: one test class (at least) per rule, 12 to 17.

The rule numbers match the docstring of ``enginecore/_loop.py`` and ``docs/contract.md``.
``test_pipeline_model.py`` checks the same rules against a sequential model under random
interleavings. The engine is ``CountdownPipeline`` (``tests/pipeline_engines.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from enginecore import (
    Abort,
    Add,
    CountdownEngine,
    Engine,
    EngineCoreLoop,
    LoopEndedError,
    PipelinedEngine,
    Utility,
)

from .conftest import EventLog, LoopThread, RecordingEngine
from .pipeline_engines import Boom, CountdownPipeline, NoCancelPipeline
from .test_loop import _wait_until_blocked


class _IdsThatFail(list[str]):
    """Request ids whose iteration raises: the engine's ``abort()`` fails on them."""

    def __iter__(self) -> Any:
        raise Boom("abort")


ROOT = Path(__file__).parent.parent


def _loop(depth: int, engine: CountdownPipeline | None = None) -> tuple[
    EngineCoreLoop, CountdownPipeline, EventLog
]:  # fmt: skip
    engine = engine if engine is not None else CountdownPipeline()
    log = EventLog()
    return EngineCoreLoop(engine, log, pipeline_depth=depth), engine, log


def _kinds(calls: Iterable[tuple[Any, ...]]) -> list[str]:
    return [c[0] for c in calls]


def _stop_when_idle(loop: EngineCoreLoop, engine: CountdownPipeline) -> None:
    """Shut the loop down the first time it would block in get(): nothing to launch and
    nothing in flight. Runs on the loop thread, so run() can be called in the test's."""
    real_get = loop.input_queue.get

    def get(*args: Any, **kwargs: Any) -> Any:
        assert engine.in_flight == 0, "blocked in get() with a handle in flight"
        loop.request_shutdown()
        return real_get(*args, **kwargs)

    loop.input_queue.get = get  # type: ignore[method-assign]


class TestRule12DepthAndEngineShape:
    @pytest.mark.parametrize("depth", [0, -1])
    def test_depth_below_one_is_a_value_error(self, depth: int) -> None:
        with pytest.raises(ValueError, match=f"pipeline_depth must be >= 1, got {depth}"):
            EngineCoreLoop(CountdownPipeline(), print, pipeline_depth=depth)

    @pytest.mark.parametrize("depth", [2.0, True, "2"])
    def test_depth_that_is_not_an_int_is_a_type_error(self, depth: Any) -> None:
        with pytest.raises(TypeError, match="pipeline_depth must be an int"):
            EngineCoreLoop(CountdownPipeline(), print, pipeline_depth=depth)

    def test_depth_above_one_needs_a_pipelined_engine(self) -> None:
        with pytest.raises(TypeError, match=r"pipeline_depth=2 needs an enginecore\.Pipelined"):
            EngineCoreLoop(CountdownEngine(), print, pipeline_depth=2)

    def test_a_half_pipelined_engine_is_named_with_what_it_lacks(self) -> None:
        class NoCollect:
            def has_work(self) -> bool:
                return False

            def launch(self) -> int:
                return 0

        with pytest.raises(TypeError, match="PipelinedEngine protocol; NoCollect lacks add, "):
            EngineCoreLoop(NoCollect(), print)  # type: ignore[arg-type]

    def test_protocols_are_checked_structurally(self) -> None:
        assert isinstance(CountdownPipeline(), PipelinedEngine)
        assert not isinstance(CountdownPipeline(), Engine)  # no step()
        assert not isinstance(CountdownEngine(), PipelinedEngine)

    def test_depth_is_exposed_and_defaults_to_one(self) -> None:
        assert EngineCoreLoop(CountdownEngine(), print).pipeline_depth == 1
        assert EngineCoreLoop(CountdownPipeline(), print, pipeline_depth=3).pipeline_depth == 3

    def test_depth_one_runs_launch_and_collect_back_to_back(self) -> None:
        loop, engine, log = _loop(1)
        _stop_when_idle(loop, engine)
        loop.submit(Add("a", 3))
        loop.run()
        assert _kinds(engine.calls) == ["add"] + ["launch", "collect"] * 3
        assert log.events == [
            ("output", ("a", 2)),
            ("output", ("a", 1)),
            ("output", ("a", 0)),
            ("shutdown",),
        ]

    def test_a_pipelined_engine_that_also_steps_is_never_stepped(self) -> None:
        class Both(CountdownPipeline):
            def step(self) -> list[Any]:
                raise AssertionError("step() called on a pipelined engine")

        loop, engine, log = _loop(1, Both())
        _stop_when_idle(loop, engine)
        loop.submit(Add("a", 2))
        loop.run()
        assert log.outputs() == [("a", 1), ("a", 0)]

    def test_a_step_engine_at_depth_one_never_sees_launch_or_collect(self) -> None:
        class Trap(RecordingEngine):
            def launch(self) -> None:
                raise AssertionError("launch() called")

        engine, log = Trap(), EventLog()
        loop = EngineCoreLoop(engine, log)
        engine.on_idle = lambda: loop.request_shutdown() if engine.steps else None
        loop.submit(Add("a", 2))
        loop.run()
        assert log.events == [("output", ("a", 1)), ("output", ("a", 0)), ("shutdown",)]


class TestRule13DrainBeforeEveryLaunchAndCollect:
    @pytest.mark.parametrize("depth", [1, 2, 3, 4])
    def test_abort_queued_between_launch_and_collect_drops_the_step_in_flight(
        self, depth: int
    ) -> None:
        loop, engine, log = _loop(depth)
        _stop_when_idle(loop, engine)
        # Put while launch 0 runs: after the drain that preceded it, before its collect.
        engine.on_launch = lambda h: loop.submit(Abort(["x"])) if h == 0 else None
        loop.submit_many([Add("x", 5), Add("y", 2)])
        loop.run()
        abort_at = engine.calls.index(("abort", ("x",)))
        assert abort_at < engine.calls.index(("collect", 0))
        assert all(out[0] != "x" for out in log.outputs())  # not even launch 0's
        assert log.outputs() == [("y", 1), ("y", 0)]

    def test_every_message_put_during_a_collect_applies_before_the_next_launch(self) -> None:
        loop, engine, log = _loop(2)
        _stop_when_idle(loop, engine)

        def during_collect(h: int) -> None:
            if h == 0:
                loop.submit_many([Add("late", 1), Utility(1, "div", (1, 2)), Abort(["a"])])

        engine.on_collect = during_collect
        loop.submit(Add("a", 4))
        loop.run()
        kinds = _kinds(engine.calls)
        first_collect = engine.calls.index(("collect", 0))
        assert kinds[first_collect : first_collect + 5] == [
            "collect",
            "add",
            "utility",
            "abort",
            "launch",
        ]
        # a's outputs of launch 1, in flight when the abort applied, are dropped too.
        assert log.events == [
            ("output", ("a", 3)),
            ("utility", 1, 0.5, None),
            ("output", ("late", 0)),
            ("shutdown",),
        ]


class TestRule14LaunchOrCollect:
    @pytest.mark.parametrize("depth", [1, 2, 3, 4])
    def test_at_most_depth_handles_in_flight_collected_in_launch_order_once_each(
        self, depth: int
    ) -> None:
        loop, engine, log = _loop(depth)
        _stop_when_idle(loop, engine)
        loop.submit_many([Add("a", 20), Add("b", 7)])
        loop.run()
        assert engine.max_in_flight == depth
        assert engine.collected == engine.launched == list(range(20))
        assert engine.cancelled == []
        assert log.outputs() == CountdownEngine_outputs({"a": 20, "b": 7})

    def test_fills_the_pipeline_then_alternates_collect_and_launch(self) -> None:
        loop, engine, _ = _loop(3)
        _stop_when_idle(loop, engine)
        loop.submit(Add("a", 5))
        loop.run()
        assert [c for c in engine.calls if c[0] != "add"] == [
            ("launch", 0),
            ("launch", 1),
            ("launch", 2),
            ("collect", 0),
            ("launch", 3),
            ("collect", 1),
            ("launch", 4),
            ("collect", 2),
            ("collect", 3),  # nothing left to launch: collect, never block on the queue
            ("collect", 4),
        ]

    def test_has_work_false_with_handles_in_flight_collects_the_oldest(self) -> None:
        loop, engine, _ = _loop(4, CountdownPipeline(record_has_work=True))
        _stop_when_idle(loop, engine)

        def after_second_launch(h: int) -> None:
            if h == 1:
                engine.throttled = True  # the engine cannot launch more for now

        def on_collect(h: int) -> None:
            engine.throttled = False

        engine.on_launch = after_second_launch
        engine.on_collect = on_collect
        loop.submit(Add("a", 3))
        loop.run()
        assert engine.calls[1:] == [
            ("has_work", True),
            ("launch", 0),
            ("has_work", True),
            ("launch", 1),
            ("has_work", False),  # throttled, 2 of 4 in flight: collect the oldest
            ("collect", 0),
            ("has_work", True),
            ("launch", 2),
            ("has_work", False),  # nothing left to launch
            ("collect", 1),
            ("has_work", False),
            ("collect", 2),
            ("has_work", False),  # nothing in flight either: block in get()
        ]

    def test_full_pipeline_does_not_ask_has_work(self) -> None:
        loop, engine, _ = _loop(2, CountdownPipeline(record_has_work=True))
        _stop_when_idle(loop, engine)
        loop.submit(Add("a", 3))
        loop.run()
        # Launch, launch, then full: collect without a has_work() call in between.
        assert engine.calls[1:6] == [
            ("has_work", True),
            ("launch", 0),
            ("has_work", True),
            ("launch", 1),
            ("collect", 0),
        ]

    @pytest.mark.slow
    def test_idle_pipelined_loop_blocks_and_wakes_for_new_work(self) -> None:
        loop, engine, log = _loop(3)
        lt = LoopThread(loop).start()
        try:
            _wait_until_blocked(loop)
            loop.submit(Add("r", 4))
            log.wait_for(lambda ev: ("output", ("r", 0)) in ev)
            _wait_until_blocked(loop)
            assert engine.in_flight == 0
            calls = len(engine.calls)
            clock = time.pthread_getcpuclockid(lt.thread.ident or 0)
            cpu0 = time.clock_gettime(clock)
            time.sleep(0.5)  # the idle period being measured, not a synchronisation guess
            assert time.clock_gettime(clock) - cpu0 < 0.005
            assert len(engine.calls) == calls
        finally:
            loop.request_shutdown()
            lt.join()
        assert log.outputs() == [("r", 3), ("r", 2), ("r", 1), ("r", 0)]

    def test_only_the_loop_thread_touches_the_engine(self) -> None:
        loop, engine, _ = _loop(3)
        lt = LoopThread(loop).start()

        def produce(t: int) -> None:
            for i in range(200):
                loop.submit_many([Add(f"{t}-{i}", 3), Abort([f"{t}-{i - 1}"])])

        producers = [threading.Thread(target=produce, args=(t,)) for t in range(3)]
        for p in producers:
            p.start()
        for p in producers:
            p.join()
        loop.request_shutdown()
        lt.join()
        assert engine.threads == {lt.thread.ident}
        assert engine.collected == engine.launched


def CountdownEngine_outputs(requests: dict[str, int]) -> list[tuple[str, int]]:
    """What a step()-only CountdownEngine emits for *requests* added at once."""
    engine, out = CountdownEngine(), []
    for rid, k in requests.items():
        engine.add(rid, k)
    while engine.has_work():
        out.extend(engine.step())
    return out


class TestRule15ShutdownCollectsWhatIsInFlight:
    @pytest.mark.parametrize("depth", [1, 2, 4])
    def test_nothing_launched_after_shutdown_and_every_handle_collected_before_the_event(
        self, depth: int
    ) -> None:
        loop, engine, log = _loop(depth)
        engine.on_launch = lambda h: loop.request_shutdown() if h == depth - 1 else None
        loop.submit(Add("a", 100))
        loop.run()
        assert engine.launched == list(range(depth))
        assert engine.collected == engine.launched
        assert log.events == [("output", ("a", 99 - i)) for i in range(depth)] + [("shutdown",)]

    def test_an_abort_that_arrives_while_shutting_down_still_applies_before_a_collect(
        self,
    ) -> None:
        loop, engine, log = _loop(3)

        def on_launch(h: int) -> None:
            if h == 2:
                loop.request_shutdown()

        engine.on_launch = on_launch
        engine.on_collect = lambda h: loop.submit(Abort(["b"])) if h == 0 else None
        loop.submit_many([Add("a", 10), Add("b", 10)])
        loop.run()
        assert log.events == [
            ("output", ("a", 9)),
            ("output", ("b", 9)),  # collect 0 had begun when the abort was put
            ("output", ("a", 8)),
            ("output", ("a", 7)),
            ("shutdown",),
        ]

    def test_shutdown_before_run_launches_nothing(self) -> None:
        loop, engine, log = _loop(2)
        loop.submit(Add("a", 1))
        loop.request_shutdown()
        loop.run()
        assert engine.calls == []
        assert log.events == [("shutdown",)]


class TestRule16ErrorsReleaseWhatIsInFlight:
    @pytest.mark.parametrize("where", ["launch", "collect"])
    def test_failure_is_fatal_and_every_other_handle_is_cancelled_once_in_order(
        self, where: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        loop, engine, log = _loop(4)

        def arm(h: int) -> None:
            if h == 3:
                engine.fail_next = where

        engine.on_launch = arm
        loop.submit(Add("a", 100))
        with caplog.at_level(logging.ERROR, logger="enginecore"):
            loop.run()
        assert log.events[-1] == ("fatal", repr(Boom(where)))
        assert sum(1 for e in log.events if e[0] in ("fatal", "shutdown")) == 1
        if where == "launch":
            # Launch 3 raised: it made no handle. 0, 1, 2 were in flight.
            assert engine.collected == []
            assert engine.cancelled == [0, 1, 2]
        else:
            # Launches 0-3 succeeded, collect 0 raised: its handle is not cancelled.
            assert engine.collected == [0]
            assert engine.cancelled == [1, 2, 3]
        assert sorted(engine.collected + engine.cancelled) == engine.launched
        assert engine.in_flight == 0
        assert _kinds(engine.calls)[-1] == "cancel"  # released before the fatal event

    @pytest.mark.parametrize("where", ["add", "abort", "has_work", "emit"])
    def test_any_fatal_error_with_handles_in_flight_cancels_them(self, where: str) -> None:
        engine = CountdownPipeline()
        events: list[Any] = []

        def emit(event: Any) -> None:
            if where == "emit" and event[0] == "output":
                raise Boom("emit")
            events.append(event)

        loop = EngineCoreLoop(engine, emit, pipeline_depth=3)

        def on_launch(h: int) -> None:
            if h == 2:
                if where == "has_work":
                    engine.fail_next = "has_work"
                elif where == "add":
                    loop.submit(Add("bad", 0))
                elif where == "abort":
                    loop.submit(Abort(_IdsThatFail()))

        engine.on_launch = on_launch
        loop.submit(Add("a", 50))
        loop.run()
        assert events[-1][0] == "fatal"
        assert ("shutdown",) not in events
        assert engine.in_flight == 0
        assert sorted(engine.collected + engine.cancelled) == engine.launched
        assert engine.cancelled  # something was in flight and was released

    def test_an_engine_without_cancel_just_drops_the_handles(self) -> None:
        loop, engine, log = _loop(3, NoCancelPipeline())
        engine.on_launch = lambda h: setattr(engine, "fail_next", "collect") if h == 2 else None
        loop.submit(Add("a", 9))
        loop.run()
        assert log.events == [("fatal", "Boom('collect')")]
        assert engine.collected == [0]

    def test_a_failing_cancel_is_logged_and_the_others_still_cancelled(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        class BadCancel(CountdownPipeline):
            def cancel(self, handle: int) -> None:
                super().cancel(handle)
                if handle == 1:
                    raise Boom("cancel")

        loop, engine, log = _loop(4, BadCancel())
        engine.on_launch = lambda h: setattr(engine, "fail_next", "launch") if h == 3 else None
        loop.submit(Add("a", 9))
        with caplog.at_level(logging.ERROR, logger="enginecore"):
            loop.run()
        assert engine.cancelled == [0, 1, 2]
        assert log.events == [("fatal", "Boom('launch')")]
        assert any("cancel() failed" in r.getMessage() for r in caplog.records)

    def test_keyboard_interrupt_from_cancel_still_emits_the_fatal_event(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        class InterruptedCancel(CountdownPipeline):
            def cancel(self, handle: int) -> None:
                super().cancel(handle)
                raise KeyboardInterrupt

        loop, engine, log = _loop(3, InterruptedCancel())
        engine.on_launch = lambda h: setattr(engine, "fail_next", "launch") if h == 2 else None
        loop.submit(Add("a", 9))
        with caplog.at_level(logging.ERROR, logger="enginecore"), pytest.raises(KeyboardInterrupt):
            loop.run()
        assert engine.cancelled == [0]
        assert log.events == [("fatal", "Boom('launch')")]

    def test_keyboard_interrupt_in_collect_cancels_reports_and_propagates(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        loop, engine, log = _loop(2)

        def interrupt(h: int) -> None:
            raise KeyboardInterrupt

        engine.on_collect = interrupt
        loop.submit(Add("a", 5))
        with caplog.at_level(logging.ERROR, logger="enginecore"), pytest.raises(KeyboardInterrupt):
            loop.run()
        assert log.events == [("fatal", "KeyboardInterrupt()")]
        # Collect 0 was called (and interrupted): the loop counts its handle as collected.
        assert engine.cancelled == [1]


class _RacyFuture(Future[Any]):
    """Already finished, yet says it is not done the first time: the future that completes
    between the loop's done() check and its add_done_callback(), so the callback runs at
    once, in the loop's own thread."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self.set_result(result)
        self._lie = True

    def done(self) -> bool:
        if self._lie:
            self._lie = False
            return False
        return super().done()


class TestRule17DeferredUtilities:
    def test_a_future_completed_later_by_another_thread_answers_and_wakes_an_idle_loop(
        self,
    ) -> None:
        engine, log = CountdownPipeline(), EventLog()
        engine.futures["f"] = fut = Future[Any]()
        loop = EngineCoreLoop(engine, log)
        lt = LoopThread(loop).start()
        try:
            loop.submit(Utility(1, "future", ("f",)))
            loop.submit(Utility(2, "div", (1, 4)))
            log.wait_for(lambda ev: len(ev) == 1)  # the plain call is not held up
            _wait_until_blocked(loop)  # and the loop went idle without waiting on the future
            threading.Thread(target=fut.set_result, args=("done",)).start()
            log.wait_for(lambda ev: len(ev) == 2)
        finally:
            loop.request_shutdown()
            lt.join()
        assert log.events == [
            ("utility", 2, 0.25, None),
            ("utility", 1, "done", None),
            ("shutdown",),
        ]

    def test_an_already_done_future_is_answered_in_place(
        self, loop: EngineCoreLoop, engine: RecordingEngine, log: EventLog
    ) -> None:
        done: Future[Any] = Future()
        done.set_result(42)
        engine.utility = lambda name, args: done if name == "f" else 0.5  # type: ignore[method-assign]
        engine.on_idle = loop.request_shutdown
        loop.submit_many([Utility(1, "f", ()), Utility(2, "g", ())])
        loop.run()
        assert log.events == [("utility", 1, 42, None), ("utility", 2, 0.5, None), ("shutdown",)]

    def test_a_callback_that_runs_in_the_loop_thread_is_answered_at_the_next_drain(
        self, loop: EngineCoreLoop, engine: RecordingEngine, log: EventLog
    ) -> None:
        racy = _RacyFuture("late but fine")
        engine.utility = lambda name, args: racy if name == "f" else 0.5  # type: ignore[method-assign]
        engine.on_idle = lambda: loop.request_shutdown() if len(log.events) == 2 else None
        loop.submit_many([Utility(1, "f", ()), Utility(2, "g", ())])
        loop.run()
        # Call 2 was in the same drain; call 1's answer came through the queue after it.
        assert log.events == [
            ("utility", 2, 0.5, None),
            ("utility", 1, "late but fine", None),
            ("shutdown",),
        ]

    def test_a_failed_future_answers_with_its_exception_and_a_cancelled_one_says_so(
        self,
    ) -> None:
        engine, log = CountdownPipeline(), EventLog()
        engine.futures.update(bad=Future(), gone=Future())
        loop = EngineCoreLoop(engine, log)
        lt = LoopThread(loop).start()
        try:
            loop.submit_many([Utility(1, "future", ("bad",)), Utility(2, "future", ("gone",))])
            _wait_until_blocked(loop)
            engine.futures["bad"].set_exception(ZeroDivisionError("division by zero"))
            log.wait_for(lambda ev: len(ev) == 1)
            assert engine.futures["gone"].cancel()
            log.wait_for(lambda ev: len(ev) == 2)
        finally:
            loop.request_shutdown()
            lt.join()
        assert log.events[0] == ("utility", 1, None, "ZeroDivisionError('division by zero')")
        assert log.events[1] == (
            "utility",
            2,
            None,
            "CancelledError(\"the future of utility 'future' (call 2) was cancelled\")",
        )

    def test_an_answer_is_ordered_with_the_outputs(self) -> None:
        # Completed while launch 1 runs: answered in the drain before collect 0.
        loop, engine, log = _loop(2)
        _stop_when_idle(loop, engine)
        engine.futures["f"] = fut = Future[Any]()
        engine.on_launch = lambda h: fut.set_result("x") if h == 1 else None
        loop.submit_many([Utility(1, "future", ("f",)), Add("a", 3)])
        loop.run()
        assert log.events == [
            ("utility", 1, "x", None),
            ("output", ("a", 2)),
            ("output", ("a", 1)),
            ("output", ("a", 0)),
            ("shutdown",),
        ]

    @pytest.mark.slow
    @pytest.mark.parametrize("depth", [1, 3])
    def test_ten_thousand_concurrent_deferred_utilities_are_all_answered(self, depth: int) -> None:
        n = 10_000
        engine, log = CountdownPipeline(), EventLog()
        loop = EngineCoreLoop(engine, log, pipeline_depth=depth)
        go = threading.Event()

        def square(i: int) -> int:
            go.wait()
            return i * i

        with ThreadPoolExecutor(4) as pool:
            for i in range(n):
                engine.futures[i] = pool.submit(square, i)
            lt = LoopThread(loop).start()
            for i in range(0, n, 100):
                loop.submit_many(
                    [Utility(j, "future", (j,)) for j in range(i, i + 100)]
                    + [Add(f"r{i}", 2), Abort([f"r{i - 100}"])]
                )
            # Every call is pending (or applied) now; four pool threads complete them all
            # while the loop steps.
            go.set()
            log.wait_for(lambda ev: sum(1 for e in ev if e[0] == "utility") == n, timeout=30)
            loop.request_shutdown()
            lt.join(timeout=30)
        answers = [e for e in log.events if e[0] == "utility"]
        assert sorted(e[1] for e in answers) == list(range(n))  # each exactly once
        assert all(e[2] == e[1] ** 2 and e[3] is None for e in answers)
        assert log.events[-1] == ("shutdown",)

    @pytest.mark.parametrize("depth", [1, 2])
    def test_every_future_pending_at_shutdown_is_answered_with_an_error(self, depth: int) -> None:
        n = 1000
        loop, engine, log = _loop(depth)
        for i in range(n):
            engine.futures[i] = Future()
        engine.futures["early"] = early = Future[Any]()
        lt = LoopThread(loop).start()
        loop.submit_many([Utility(i, "future", (i,)) for i in range(n)])
        loop.submit_many([Utility(n, "future", ("early",)), Add("a", 10**9)])
        log.wait_for(lambda ev: len(ev) >= 3)  # stepping, every call applied, none answered
        # Completed, but its message may still be queued when the loop ends: a real answer.
        early.set_result("ok")
        loop.request_shutdown()
        lt.join()
        pending_err = [e for e in log.events if e[0] == "utility" and e[1] < n]
        assert [e[1] for e in pending_err] == list(range(n))  # in the order of the calls
        for call_id, event in enumerate(pending_err):
            assert event[2] is None
            assert event[3] == repr(
                LoopEndedError(
                    f"the engine loop ended before utility 'future' (call {call_id}) completed"
                )
            )
        assert [e for e in log.events if e[:2] == ("utility", n)] == [("utility", n, "ok", None)]
        assert log.events[-1] == ("shutdown",)
        # A future completed after the end: no second answer (nor a message queued:
        # TestRule17FuturesDoneAfterTheEnd).
        engine.futures[0].set_result("too late")
        assert log.events[-1] == ("shutdown",)
        assert sum(1 for e in log.events if e[:2] == ("utility", 0)) == 1

    def test_pending_futures_are_answered_before_a_fatal_event(self) -> None:
        loop, engine, log = _loop(2)
        engine.futures["f"] = Future()
        engine.on_launch = lambda h: setattr(engine, "fail_next", "collect") if h == 1 else None
        loop.submit_many([Utility(7, "future", ("f",)), Add("a", 5)])
        loop.run()
        assert log.events == [
            (
                "utility",
                7,
                None,
                repr(LoopEndedError("the engine loop ended before utility 'future' (call 7) "
                                    "completed")),
            ),
            ("fatal", "Boom('collect')"),
        ]  # fmt: skip

    def test_emit_failing_for_a_pending_answer_still_emits_the_fatal_event(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        engine = CountdownPipeline()
        engine.futures["f"] = Future()
        events: list[Any] = []

        def emit(event: Any) -> None:
            if event[0] == "utility":
                raise Boom("emit utility")
            events.append(event)

        loop = EngineCoreLoop(engine, emit)
        engine.on_launch = lambda h: setattr(engine, "fail_next", "launch")
        loop.submit_many([Utility(1, "future", ("f",)), Add("a", 1)])
        with caplog.at_level(logging.ERROR, logger="enginecore"):
            loop.run()
        assert events == [("fatal", "Boom('launch')")]
