"""EngineCoreLoop: one behaviour-named test (at least) for each rule of the contract.

The rule numbers match the docstring of ``enginecore/_loop.py`` and ``docs/contract.md``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import pickle
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest

from enginecore import (
    Abort,
    Add,
    Control,
    CountdownEngine,
    EngineCoreLoop,
    LoopAlreadyRunError,
    LoopEndedError,
    Message,
    RequestRejected,
    Utility,
    Wakeup,
)

from .conftest import EventLog, LoopThread, RecordingEngine
from .pipeline_engines import CountdownPipeline


def _blocked_in_get(loop: EngineCoreLoop) -> bool:
    # The loop is parked in input_queue.get() when it is a waiter on the queue's condition.
    # Reading the waiter list is the only way to observe "blocked" without a sleep.
    return bool(loop.input_queue.not_empty._waiters)  # type: ignore[attr-defined]


def _wait_until_blocked(loop: EngineCoreLoop, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not _blocked_in_get(loop):
        if time.monotonic() > deadline:
            raise AssertionError("the loop never blocked in input_queue.get()")
        time.sleep(0.001)


class TestReferenceTrace:
    def test_design_card_trace_is_emitted_exactly(self) -> None:
        log = EventLog()
        loop = EngineCoreLoop(CountdownEngine(), log)
        for msg in (
            Add("a", 2),
            Add("b", 1),
            Utility(7, "div", (1, 0)),
            Abort(["b"]),
            Utility(8, "div", (6, 3)),
        ):
            loop.input_queue.put(msg)

        def feeder() -> None:
            time.sleep(0.2)
            loop.input_queue.put(Add("c", 1))
            time.sleep(0.2)
            loop.request_shutdown()

        t = threading.Thread(target=feeder)
        t.start()
        loop.run()
        t.join()
        assert log.events == [
            ("utility", 7, None, "ZeroDivisionError('division by zero')"),
            ("utility", 8, 2.0, None),
            ("output", ("a", 1)),
            ("output", ("a", 0)),
            ("output", ("c", 0)),
            ("shutdown",),
        ]


def _engine_for(kind: str) -> RecordingEngine | CountdownPipeline:
    return RecordingEngine() if kind == "step" else CountdownPipeline()


LOOPS = pytest.mark.parametrize(
    ("kind", "depth"), [("step", 1), ("pipelined", 1), ("pipelined", 3)], ids=str
)
"""Every shared rule is tested on both loops: the step() loop, and the pipelined one at
depth 1 (launch and collect back to back) and 3."""


def _make(
    kind: str, depth: int
) -> tuple[RecordingEngine | CountdownPipeline, EventLog, EngineCoreLoop]:
    engine, log = _engine_for(kind), EventLog()
    return engine, log, EngineCoreLoop(engine, log, pipeline_depth=depth)


def _on_step(engine: RecordingEngine | CountdownPipeline, hook: Callable[[int], None]) -> None:
    """Run ``hook(n)`` as the n-th step (1-based) begins: ``step()``, or ``launch()``."""
    if isinstance(engine, RecordingEngine):
        engine.on_step = hook
    else:
        engine.on_launch = lambda handle: hook(handle + 1)


def _steps(engine: RecordingEngine | CountdownPipeline) -> int:
    """How many steps began: ``step()`` calls, or ``launch()`` calls."""
    return engine.steps if isinstance(engine, RecordingEngine) else len(engine.launched)


def _applied(engine: RecordingEngine | CountdownPipeline) -> list[tuple[Any, ...]]:
    """The engine's calls as the shared rules order them: a ``launch`` is a ``("step",)``,
    and the collects are left out."""
    return [
        ("step",) if call[0] == "launch" else call
        for call in engine.calls
        if call[0] not in ("collect", "cancel", "has_work")
    ]


def _count_has_work(engine: Any) -> list[int]:
    """Counts the engine's ``has_work()`` calls (the loop binds the method when it runs)."""
    count = [0]
    inner = engine.has_work

    def has_work() -> bool:
        count[0] += 1
        return bool(inner())

    engine.has_work = has_work
    return count


class TestRule1IdleBlocks:
    @pytest.mark.slow
    @LOOPS
    def test_idle_loop_calls_has_work_a_handful_of_times_and_uses_no_cpu(
        self, kind: str, depth: int
    ) -> None:
        engine, log, loop = _make(kind, depth)
        calls = _count_has_work(engine)
        loop.submit(Add("r", 2))  # some work first: idle is what follows it
        lt = LoopThread(loop).start()
        try:
            log.wait_for(lambda ev: len(ev) == 2)
            _wait_until_blocked(loop)
            clock = time.pthread_getcpuclockid(lt.thread.ident or 0)
            calls_before = calls[0]
            thread_cpu_before = time.clock_gettime(clock)
            process_cpu_before = time.process_time()
            time.sleep(1.0)  # the idle period being measured, not a synchronisation guess
            thread_cpu = time.clock_gettime(clock) - thread_cpu_before
            process_cpu = time.process_time() - process_cpu_before
        finally:
            loop.request_shutdown()
            lt.join()
        assert calls[0] - calls_before == 0
        assert calls[0] < 10
        assert _steps(engine) == 2
        # A get(timeout=0.01) poll would cost ~10 ms here and 100 has_work() calls; a spin ~1 s.
        assert thread_cpu < 0.005, f"idle loop thread used {thread_cpu:.4f} s of CPU"
        assert process_cpu < 0.05, f"idle process used {process_cpu:.4f} s of CPU"

    @LOOPS
    def test_add_after_idle_runs_to_completion(self, kind: str, depth: int) -> None:
        _, log, loop = _make(kind, depth)
        lt = LoopThread(loop).start()
        _wait_until_blocked(loop)
        loop.submit(Add("r", 3))
        log.wait_for(lambda ev: ("output", ("r", 0)) in ev)
        loop.request_shutdown()
        lt.join()
        assert log.events == [
            ("output", ("r", 2)),
            ("output", ("r", 1)),
            ("output", ("r", 0)),
            ("shutdown",),
        ]


class TestRule2BlockingGetMessageIsProcessed:
    @LOOPS
    def test_first_message_after_idle_is_not_lost(self, kind: str, depth: int) -> None:
        engine, log, loop = _make(kind, depth)
        lt = LoopThread(loop).start()
        _wait_until_blocked(loop)
        loop.input_queue.put(Add("only", 1))  # the one message the blocking get() returns
        log.wait_for(lambda ev: len(ev) == 1)
        loop.request_shutdown()
        lt.join()
        assert engine.calls[0] == ("add", "only", 1)
        assert log.events == [("output", ("only", 0)), ("shutdown",)]


class TestRule3FifoBeforeEveryStep:
    @LOOPS
    def test_prequeued_add_abort_add_reach_engine_in_order(self, kind: str, depth: int) -> None:
        engine, log, loop = _make(kind, depth)
        for msg in (Add("r1", 2), Abort(["r1"]), Add("r2", 1)):
            loop.input_queue.put(msg)
        lt = LoopThread(loop).start()
        log.wait_for(lambda ev: len(ev) == 1)
        _wait_until_blocked(loop)
        loop.request_shutdown()
        lt.join()
        assert _applied(engine) == [
            ("add", "r1", 2),
            ("abort", ("r1",)),
            ("add", "r2", 1),
            ("step",),
        ]
        # r1 was aborted before the step that would have run it: not a single output.
        assert log.events == [("output", ("r2", 0)), ("shutdown",)]

    @LOOPS
    def test_messages_queued_during_a_step_all_apply_before_the_next_step(
        self, kind: str, depth: int
    ) -> None:
        engine, log, loop = _make(kind, depth)

        def during_step(n: int) -> None:
            if n == 1:  # a producer puts these while step 1 runs
                for msg in (Add("x", 1), Abort(["a", "x"]), Utility(1, "div", (4, 2))):
                    loop.input_queue.put(msg)

        _on_step(engine, during_step)
        loop.input_queue.put(Add("a", 5))
        lt = LoopThread(loop).start()
        log.wait_for(lambda ev: ("utility", 1, 2.0, None) in ev)
        _wait_until_blocked(loop)
        loop.request_shutdown()
        lt.join()
        assert _applied(engine) == [
            ("add", "a", 5),
            ("step",),
            ("add", "x", 1),
            ("abort", ("a", "x")),
            ("utility", "div", (4, 2)),
        ]
        # Both requests were aborted before step 2 could run them, so there was no step 2.
        # A pipelined engine drops the step in flight's output of "a" too (rule 13).
        first = [("output", ("a", 4))] if kind == "step" else []
        assert log.events == [*first, ("utility", 1, 2.0, None), ("shutdown",)]


class TestRule4BoundedDrain:
    @LOOPS
    def test_self_refilling_queue_cannot_starve_step(self, kind: str, depth: int) -> None:
        """An add() that enqueues another Add models a producer faster than the loop.

        A drain "until Empty" would never return; the snapshot drain steps after each batch.
        """
        engine, log, loop = _make(kind, depth)
        original_add = engine.add
        counter = iter(range(1_000_000))

        def add(req_id: str, data: Any) -> None:
            original_add(req_id, data)
            loop.input_queue.put(Add(f"r{next(counter)}", 1))

        engine.add = add  # type: ignore[method-assign]
        _on_step(engine, lambda n: loop.request_shutdown() if n == 3 else None)
        loop.input_queue.put(Add("seed", 1))
        lt = LoopThread(loop).start()
        lt.join(timeout=10)
        assert _steps(engine) == 3
        assert log.events[-1] == ("shutdown",)

    @pytest.mark.slow
    @LOOPS
    def test_flood_from_many_producers_still_steps_and_shuts_down_promptly(
        self, kind: str, depth: int
    ) -> None:
        engine, log, loop = _make(kind, depth)
        stepped = threading.Event()
        _on_step(engine, lambda n: stepped.set())
        stop = threading.Event()

        def producer(tag: int) -> None:
            i = 0
            put = loop.input_queue.put
            while not stop.is_set():
                put(Add(f"p{tag}-{i}", 2))
                put(Abort([f"p{tag}-{i}"]))
                i += 1

        producers = [threading.Thread(target=producer, args=(t,)) for t in range(3)]
        for p in producers:
            p.start()
        try:
            loop.input_queue.put(Add("steady", 10**9))  # always has work
            lt = LoopThread(loop).start()
            for _ in range(5):  # the loop keeps stepping under the flood
                stepped.clear()
                assert stepped.wait(5), "the steps starved by the flood"
            started = time.monotonic()
            loop.request_shutdown()
            lt.join(timeout=5)
            elapsed = time.monotonic() - started
        finally:
            stop.set()
            for p in producers:
                p.join()
        assert log.events[-1] == ("shutdown",)
        assert elapsed < 5


class TestRule5Dispatch:
    @LOOPS
    def test_utility_args_are_passed_as_one_tuple(self, kind: str, depth: int) -> None:
        engine, log, loop = _make(kind, depth)
        seen: list[tuple[Any, ...]] = []

        def echo(name: str, args: tuple[Any, ...]) -> Any:
            seen.append(args)
            return args

        engine.utility = echo  # type: ignore[method-assign]
        loop.input_queue.put(Utility(1, "echo", (1, 2, 3)))
        loop.input_queue.put(Utility(2, "echo", ()))
        loop.input_queue.put(Utility(3, "echo", ((1, 2),)))
        lt = LoopThread(loop).start()
        log.wait_for(lambda ev: len(ev) == 3)
        loop.request_shutdown()
        lt.join()
        assert seen == [(1, 2, 3), (), ((1, 2),)]
        assert log.events[:3] == [
            ("utility", 1, (1, 2, 3), None),
            ("utility", 2, (), None),
            ("utility", 3, ((1, 2),), None),
        ]

    @LOOPS
    def test_wakeup_does_nothing_to_the_engine(self, kind: str, depth: int) -> None:
        engine, log, loop = _make(kind, depth)
        lt = LoopThread(loop).start()
        for _ in range(3):
            loop.input_queue.put(Wakeup())
        loop.input_queue.put(Utility(1, "div", (1, 1)))
        log.wait_for(lambda ev: len(ev) == 1)
        loop.request_shutdown()
        lt.join()
        assert engine.calls == [("utility", "div", (1, 1))]

    @LOOPS
    def test_non_message_is_logged_and_skipped(
        self, kind: str, depth: int, caplog: pytest.LogCaptureFixture
    ) -> None:
        _, log, loop = _make(kind, depth)
        lt = LoopThread(loop).start()
        with caplog.at_level(logging.ERROR, logger="enginecore"):
            loop.input_queue.put(("add", "r", 1))
            loop.input_queue.put(None)
            loop.input_queue.put(Add("r", 1))
            log.wait_for(lambda ev: ("output", ("r", 0)) in ev)
        loop.request_shutdown()
        lt.join()
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 2
        assert "tuple" in errors[0].getMessage()
        assert "NoneType" in errors[1].getMessage()

    @LOOPS
    def test_non_message_whose_repr_raises_is_still_logged_and_skipped(
        self, kind: str, depth: int, caplog: pytest.LogCaptureFixture
    ) -> None:
        class Unprintable:
            def __repr__(self) -> str:
                raise RuntimeError("no repr")

        _, log, loop = _make(kind, depth)
        lt = LoopThread(loop).start()
        with caplog.at_level(logging.ERROR, logger="enginecore"):
            loop.input_queue.put(Unprintable())
            loop.input_queue.put(Add("r", 1))
            log.wait_for(lambda ev: ("output", ("r", 0)) in ev)
        loop.request_shutdown()
        lt.join()
        # The record must format: a logging error instead of it would hide the producer bug.
        (error,) = [r for r in caplog.records if r.levelno == logging.ERROR]
        text = error.getMessage()
        assert "Unprintable" in text
        assert "repr() raised RuntimeError: no repr" in text

    @LOOPS
    def test_message_subclasses_are_dispatched(self, kind: str, depth: int) -> None:
        class TracedAdd(Add):
            __slots__ = ()

        class TracedAbort(Abort):
            __slots__ = ()

        class TracedUtility(Utility):
            __slots__ = ()

        class TracedWakeup(Wakeup):
            __slots__ = ()

        engine, log, loop = _make(kind, depth)
        lt = LoopThread(loop).start()
        loop.submit_many(
            [TracedAbort(["x"]), TracedWakeup(), TracedUtility(1, "div", (1, 2)), TracedAdd("t", 1)]
        )
        log.wait_for(lambda ev: ("output", ("t", 0)) in ev)
        loop.request_shutdown()
        lt.join()
        assert _applied(engine) == [
            ("abort", ("x",)),
            ("utility", "div", (1, 2)),
            ("add", "t", 1),
            ("step",),
        ]
        assert log.events == [("utility", 1, 0.5, None), ("output", ("t", 0)), ("shutdown",)]


class TestRule6AfterTheDrain:
    @LOOPS
    def test_drain_of_only_wakeup_abort_utility_does_not_step(self, kind: str, depth: int) -> None:
        engine, log, loop = _make(kind, depth)
        lt = LoopThread(loop).start()
        for msg in (Wakeup(), Abort(["nope"]), Utility(1, "div", (1, 1))):
            loop.input_queue.put(msg)
        log.wait_for(lambda ev: len(ev) == 1)
        _wait_until_blocked(loop)
        loop.request_shutdown()
        lt.join()
        assert _steps(engine) == 0

    @LOOPS
    def test_no_step_after_shutdown_is_seen(self, kind: str, depth: int) -> None:
        engine, log, loop = _make(kind, depth)
        _on_step(engine, lambda n: loop.request_shutdown() if n == 2 else None)
        loop.input_queue.put(Add("long", 100))
        loop.run()
        assert _steps(engine) == 2
        assert log.events == [("output", ("long", 99)), ("output", ("long", 98)), ("shutdown",)]

    @LOOPS
    def test_messages_queued_before_shutdown_are_still_applied(self, kind: str, depth: int) -> None:
        engine, log, loop = _make(kind, depth)

        def during_step(n: int) -> None:
            loop.input_queue.put(Utility(5, "div", (1, 2)))
            loop.request_shutdown()

        _on_step(engine, during_step)
        loop.input_queue.put(Add("a", 10))
        loop.run()
        answer, output = ("utility", 5, 0.5, None), ("output", ("a", 9))
        # The pipelined loop drains before the collect too (rule 13): the answer comes first.
        expected = [output, answer] if kind == "step" else [answer, output]
        assert log.events == [*expected, ("shutdown",)]
        assert _steps(engine) == 1


class TestRule7EventShapes:
    @LOOPS
    @pytest.mark.parametrize("when", ["before-run", "running"])
    def test_shutdown_event_is_a_one_element_tuple(self, kind: str, depth: int, when: str) -> None:
        _, log, loop = _make(kind, depth)
        if when == "before-run":
            loop.request_shutdown()
            loop.run()
            assert log.events == [("shutdown",)]
        else:
            loop.submit(Add("a", 1))
            lt = LoopThread(loop).start()
            log.wait_for(lambda ev: len(ev) == 1)
            loop.request_shutdown()
            lt.join()
            assert log.events == [("output", ("a", 0)), ("shutdown",)]
        assert type(log.events[-1]) is tuple
        assert len(log.events[-1]) == 1

    @LOOPS
    def test_each_output_of_a_step_is_one_event_in_order(self, kind: str, depth: int) -> None:
        engine, log, loop = _make(kind, depth)
        for rid in "abc":
            loop.input_queue.put(Add(rid, 1))
        lt = LoopThread(loop).start()
        log.wait_for(lambda ev: len(ev) == 3)
        loop.request_shutdown()
        lt.join()
        assert _steps(engine) == 1
        assert log.events == [
            ("output", ("a", 0)),
            ("output", ("b", 0)),
            ("output", ("c", 0)),
            ("shutdown",),
        ]
        assert all(type(e) is tuple and len(e) == 2 for e in log.events[:3])


class _Boom(Exception):
    pass


class TestRule8Errors:
    @LOOPS
    def test_utility_error_is_reported_for_its_call_and_the_loop_goes_on(
        self, kind: str, depth: int
    ) -> None:
        _, log, loop = _make(kind, depth)
        lt = LoopThread(loop).start()
        loop.input_queue.put(Utility(1, "no-such-utility", ()))
        loop.input_queue.put(Utility(2, "div", (1, 0)))
        loop.input_queue.put(Add("after", 1))
        log.wait_for(lambda ev: ("output", ("after", 0)) in ev)
        loop.request_shutdown()
        lt.join()
        first = log.events[0]
        assert first[:3] == ("utility", 1, None)
        assert "no-such-utility" in str(first[-1])
        assert log.events[1:] == [
            ("utility", 2, None, "ZeroDivisionError('division by zero')"),
            ("output", ("after", 0)),
            ("shutdown",),
        ]

    @LOOPS
    @pytest.mark.parametrize("where", ["step", "add", "abort", "has_work"])
    def test_engine_exception_is_fatal_and_ends_the_run(
        self, kind: str, depth: int, where: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        engine, log, loop = _make(kind, depth)
        name = "launch" if where == "step" and kind != "step" else where
        inner = getattr(engine, name)

        def failing(*args: Any) -> Any:
            if where == "has_work" and not engine.calls:
                return inner(*args)
            raise _Boom(where)

        setattr(engine, name, failing)
        loop.input_queue.put(Abort(["x"]))
        loop.input_queue.put(Add("a", 3))
        loop.input_queue.put(Utility(9, "div", (1, 1)))
        with caplog.at_level(logging.ERROR, logger="enginecore"):
            loop.run()  # returns: a fatal error is reported, not raised
        assert log.events[-1] == ("fatal", repr(_Boom(where)))
        assert ("shutdown",) not in log.events
        if where in ("add", "abort"):
            # Messages after the failing one are never processed: the utility is answered
            # without reaching the engine (TestRule17UtilitiesLeftOfAFailedDrain).
            assert ("utility", "div", (1, 1)) not in engine.calls
            assert [e for e in log.events if e[0] == "utility"] == [_ended(9)]
        assert _steps(engine) == 0
        assert any("fatal error" in r.getMessage() for r in caplog.records)

    def test_request_rejected_from_add_is_fatal_in_a_bare_loop(self) -> None:
        # Request-scoped failure belongs to the stage runtime, which wraps the engine; the
        # loop has no per-request error event, so for it a rejection is an add() failure.
        log = EventLog()
        loop = EngineCoreLoop(CountdownEngine(), log)
        loop.input_queue.put(Add("bad", {"prompt": 42}))
        loop.input_queue.put(Add("good", 1))
        loop.run()
        assert log.events == [
            ("fatal", repr(RequestRejected("need an int >= 1 (a step count), got {'prompt': 42}")))
        ]

    @LOOPS
    def test_messages_queued_after_fatal_are_never_processed(self, kind: str, depth: int) -> None:
        engine, log, loop = _make(kind, depth)

        def blow_up(n: int) -> None:
            loop.input_queue.put(Add("b", 1))
            loop.input_queue.put(Utility(1, "div", (1, 1)))
            raise _Boom("step")

        _on_step(engine, blow_up)
        loop.input_queue.put(Add("a", 1))
        loop.run()
        # Not applied; the utility is answered (TestRule17QueuedUtilitiesAtTheEnd).
        err = "LoopEndedError(\"the engine loop ended before it applied utility 'div' (call 1)\")"
        assert log.events == [("utility", 1, None, err), ("fatal", "_Boom('step')")]
        assert ("add", "b", 1) not in engine.calls
        assert list(loop.input_queue.queue) == [Add("b", 1)]

    @LOOPS
    def test_emit_failure_is_fatal(
        self, kind: str, depth: int, caplog: pytest.LogCaptureFixture
    ) -> None:
        events: list[Any] = []

        def emit(event: Any) -> None:
            if event[0] == "output":
                raise _Boom("emit")
            events.append(event)

        loop = EngineCoreLoop(_engine_for(kind), emit, pipeline_depth=depth)
        loop.input_queue.put(Add("a", 1))
        with caplog.at_level(logging.ERROR, logger="enginecore"):
            loop.run()
        assert events == [("fatal", "_Boom('emit')")]

    @LOOPS
    def test_emit_failing_for_the_fatal_event_too_raises_from_run(
        self, kind: str, depth: int, caplog: pytest.LogCaptureFixture
    ) -> None:
        def emit(event: Any) -> None:
            raise _Boom(event[0])

        loop = EngineCoreLoop(_engine_for(kind), emit, pipeline_depth=depth)
        loop.input_queue.put(Add("a", 1))
        with caplog.at_level(logging.ERROR, logger="enginecore"), pytest.raises(_Boom) as info:
            loop.run()
        assert info.value.args == ("fatal",)
        assert isinstance(info.value.__context__, _Boom)
        assert info.value.__context__.args == ("output",)

    @LOOPS
    @pytest.mark.parametrize("when", ["before-run", "running"])
    def test_emit_failing_for_the_shutdown_event_raises_from_run(
        self, kind: str, depth: int, when: str
    ) -> None:
        events: list[Any] = []

        def emit(event: Any) -> None:
            if event[0] == "shutdown":
                raise _Boom(event[0])
            events.append(event)

        engine = _engine_for(kind)
        loop = EngineCoreLoop(engine, emit, pipeline_depth=depth)
        if when == "before-run":
            loop.request_shutdown()
        else:
            _on_step(engine, lambda n: loop.request_shutdown())
            loop.submit(Add("a", 2))
        with pytest.raises(_Boom, match="shutdown"):
            loop.run()
        assert events == ([] if when == "before-run" else [("output", ("a", 1))])

    @LOOPS
    def test_keyboard_interrupt_in_step_is_reported_then_propagates(
        self, kind: str, depth: int, caplog: pytest.LogCaptureFixture
    ) -> None:
        engine, log, loop = _make(kind, depth)

        def interrupt(n: int) -> None:
            raise KeyboardInterrupt

        _on_step(engine, interrupt)
        loop.input_queue.put(Add("a", 1))
        with caplog.at_level(logging.INFO, logger="enginecore"), pytest.raises(KeyboardInterrupt):
            loop.run()
        assert log.events == [("fatal", "KeyboardInterrupt()")]
        # The user's Ctrl-C: one line, no traceback (it was an error record with one).
        assert [(r.levelname, r.getMessage(), r.exc_info) for r in caplog.records] == [
            ("WARNING", "enginecore: the engine loop was interrupted (KeyboardInterrupt)", None)
        ]


class TestRule9RequestShutdown:
    @LOOPS
    def test_wakes_an_idle_loop_from_another_thread(self, kind: str, depth: int) -> None:
        _, log, loop = _make(kind, depth)
        lt = LoopThread(loop).start()
        _wait_until_blocked(loop)
        loop.request_shutdown()
        lt.join(timeout=0.5)
        assert log.events == [("shutdown",)]

    @LOOPS
    def test_is_idempotent(self, kind: str, depth: int) -> None:
        _, log, loop = _make(kind, depth)
        lt = LoopThread(loop).start()
        _wait_until_blocked(loop)
        for _ in range(5):
            loop.request_shutdown()
        lt.join()
        loop.request_shutdown()  # after the end: no effect, no error
        assert log.events == [("shutdown",)]
        assert loop.shutdown_requested
        assert loop.input_queue.qsize() == 0

    @LOOPS
    def test_from_another_thread_while_a_step_runs(self, kind: str, depth: int) -> None:
        # The step finishes and its outputs go out (a pipelined loop collects what it has
        # in flight: rule 15); no step begins after it.
        engine, log, loop = _make(kind, depth)
        in_step, release = threading.Event(), threading.Event()

        def hold(n: int) -> None:
            in_step.set()
            assert release.wait(5)

        _on_step(engine, hold)
        loop.submit(Add("long", 100))
        lt = LoopThread(loop).start()
        assert in_step.wait(5)
        stopper = threading.Thread(target=loop.request_shutdown)
        stopper.start()
        stopper.join(5)
        assert not stopper.is_alive()  # it did not wait for the step
        release.set()
        lt.join()
        assert _steps(engine) == 1
        assert log.events == [("output", ("long", 99)), ("shutdown",)]

    @LOOPS
    def test_repeated_calls_queue_one_wakeup(self, kind: str, depth: int) -> None:
        # As a signal handler that runs again and again: each call after the first is free.
        _, log, loop = _make(kind, depth)
        for _ in range(5):
            loop.request_shutdown()
        assert list(loop.input_queue.queue) == [Wakeup()]
        loop.run()
        assert log.events == [("shutdown",)]

    @LOOPS
    def test_has_no_effect_after_a_fatal_end(self, kind: str, depth: int) -> None:
        engine, log, loop = _make(kind, depth)

        def blow_up(n: int) -> None:
            raise _Boom("step")

        _on_step(engine, blow_up)
        loop.submit(Add("a", 1))
        loop.run()
        loop.request_shutdown()
        assert log.events == [("fatal", "_Boom('step')")]
        # Nothing queued for a loop that will never read it, nor counted as waiting.
        assert loop.input_queue.qsize() == 0
        assert loop.statistics().queue_depth == 0

    @LOOPS
    def test_before_run_applies_nothing_and_answers_the_queued_utilities(
        self, kind: str, depth: int
    ) -> None:
        engine, log, loop = _make(kind, depth)
        loop.input_queue.put(Add("a", 1))
        loop.input_queue.put(Utility(1, "div", (1, 1)))
        loop.request_shutdown()
        loop.run()
        err = "LoopEndedError(\"the engine loop ended before it applied utility 'div' (call 1)\")"
        assert log.events == [("utility", 1, None, err), ("shutdown",)]
        assert engine.calls == []

    @LOOPS
    def test_never_blocks_on_a_held_queue_mutex_and_still_wakes_the_loop(
        self, kind: str, depth: int
    ) -> None:
        """The signal-handler situation without a signal: the caller holds the mutex.

        A request_shutdown() built on ``Queue.put`` deadlocks right here (the mutex is not
        reentrant); ours hands the Wakeup to the waker thread and returns.
        """
        _, log, loop = _make(kind, depth)
        lt = LoopThread(loop).start()
        _wait_until_blocked(loop)
        returned = threading.Event()
        with loop.input_queue.mutex:
            loop.request_shutdown()
            returned.set()
        assert returned.is_set()
        lt.join(timeout=2)
        assert log.events == [("shutdown",)]

    @LOOPS
    def test_run_twice_raises(self, kind: str, depth: int) -> None:
        _, _, loop = _make(kind, depth)
        loop.request_shutdown()
        loop.run()
        with pytest.raises(LoopAlreadyRunError, match="already run"):
            loop.run()


class TestRule11SingleWriter:
    @LOOPS
    def test_only_the_loop_thread_touches_the_engine(self, kind: str, depth: int) -> None:
        engine, log = _engine_for(kind), EventLog()
        stats_threads: set[int] = set()

        def stats() -> dict[str, float]:  # the optional hook: the loop's thread only too
            stats_threads.add(threading.get_ident())
            return {}

        engine.stats = stats  # type: ignore[union-attr, method-assign]
        loop = EngineCoreLoop(engine, log, pipeline_depth=depth)
        lt = LoopThread(loop).start()

        def produce(t: int) -> None:
            # Every way in from another thread: put, submit, submit_many, statistics.
            for i in range(200):
                msgs: list[Message] = [
                    Add(f"{t}-{i}", 2),
                    Abort([f"{t}-{i}"]),
                    Utility(i, "div", (i, 1)),
                ]
                if i % 3 == 0:
                    for m in msgs:
                        loop.input_queue.put(m)
                elif i % 3 == 1:
                    for m in msgs:
                        loop.submit(m)
                else:
                    loop.submit_many(msgs)
                loop.statistics()

        producers = [threading.Thread(target=produce, args=(t,)) for t in range(3)]
        for p in producers:
            p.start()
        for p in producers:
            p.join()
        loop.request_shutdown()
        lt.join()
        assert engine.threads == {lt.thread.ident}
        assert stats_threads <= {lt.thread.ident}
        assert sum(1 for e in log.events if e[0] == "utility") == 600


class TestConstruction:
    def test_rejects_an_object_that_is_not_an_engine(self) -> None:
        class Half:
            def has_work(self) -> bool:
                return False

        with pytest.raises(TypeError, match="lacks add, abort, utility, step"):
            EngineCoreLoop(Half(), print)  # type: ignore[arg-type]

    @pytest.mark.parametrize("pipelined", [False, True], ids=["step", "pipelined"])
    def test_rejects_an_engine_whose_method_is_not_callable(self, pipelined: bool) -> None:
        # A method written as a property passes the protocol's isinstance() check (it only
        # looks for the names); without this, the first call in run() was a fatal
        # "'bool' object is not callable" that did not say which method.
        base: Any = CountdownPipeline if pipelined else CountdownEngine

        class AProperty(base):  # type: ignore[misc]
            @property
            def has_work(self) -> bool:
                return False

        with pytest.raises(TypeError, match=r"engine\.has_work must be a method, got bool"):
            EngineCoreLoop(AProperty(), print)

    @pytest.mark.parametrize("pipelined", [False, True], ids=["step", "pipelined"])
    def test_rejects_the_engine_class_instead_of_an_instance(self, pipelined: bool) -> None:
        # The class has every method, as functions: it passed the protocol check, and the
        # first call in run() was a fatal "has_work() missing 1 required positional
        # argument: 'self'" that did not say what was wrong.
        cls: Any = CountdownPipeline if pipelined else CountdownEngine
        name = cls.__name__
        with pytest.raises(
            TypeError, match=rf"an engine instance, got the class {name}.*{name}\(\)"
        ):
            EngineCoreLoop(cls, print)

    def test_rejects_a_non_callable_emit(self) -> None:
        with pytest.raises(TypeError, match="emit must be callable"):
            EngineCoreLoop(CountdownEngine(), [])  # type: ignore[arg-type]

    @pytest.mark.parametrize(
        ("bad", "error", "match"),
        [
            ([], TypeError, "input_queue must be a queue.Queue, got list"),
            (queue.Queue(maxsize=4), ValueError, "must be unbounded, got maxsize=4"),
            ("full", ValueError, "input_queue must be empty"),
            # Not FIFO: the idle get() would return the last message (an Abort before the
            # Add it follows), or order them, and put() compare them.
            (queue.LifoQueue(), TypeError, "input_queue must be a FIFO.*got LifoQueue"),
            (queue.PriorityQueue(), TypeError, "input_queue must be a FIFO.*got PriorityQueue"),
        ],
        ids=["list", "bounded", "not-empty", "lifo", "priority"],
    )
    def test_rejects_an_input_queue_it_cannot_use(
        self, bad: Any, error: type[Exception], match: str
    ) -> None:
        if bad == "full":
            bad = queue.Queue()
            bad.put(Add("r", 1))
        with pytest.raises(error, match=match):
            EngineCoreLoop(CountdownEngine(), print, input_queue=bad)

    @pytest.mark.parametrize("depth", [1, 2])
    def test_a_given_input_queue_is_used_and_only_its_idle_get_blocks(self, depth: int) -> None:
        # A subclass that overrides get() sees exactly the loop's idle waits (rule 1): one
        # per idle period, none while there is work. The loop drains everything else from
        # the deque under the mutex.
        class Counting(queue.Queue[Any]):
            gets = 0

            def get(self, block: bool = True, timeout: float | None = None) -> Any:
                Counting.gets += 1
                return super().get(block, timeout)

        q = Counting()
        log = EventLog()
        engine: Any = CountdownEngine() if depth == 1 else CountdownPipeline()
        loop = EngineCoreLoop(engine, log, pipeline_depth=depth, input_queue=q)
        assert loop.input_queue is q
        lt = LoopThread(loop).start()
        _wait_until_blocked(loop)
        assert Counting.gets == 1
        loop.submit_many([Add("a", 3), Add("b", 2)])
        log.wait_for(lambda evs: sum(ev[0] == "output" for ev in evs) == 5)
        _wait_until_blocked(loop)
        assert Counting.gets == 2  # the steps in between never called get()
        loop.request_shutdown()
        lt.join()
        assert log.events[-1] == ("shutdown",)

    def test_submit_many_queues_a_burst_in_order_with_one_drain(
        self, loop: EngineCoreLoop, engine: RecordingEngine, log: EventLog
    ) -> None:
        engine.on_idle = lambda: loop.request_shutdown() if engine.steps else None
        loop.submit_many([Add("a", 1), Abort(["a"]), Add("b", 1), Utility(1, "div", (1, 2))])
        loop.submit_many([])
        loop.run()
        assert engine.calls == [
            ("add", "a", 1),
            ("abort", ("a",)),
            ("add", "b", 1),
            ("utility", "div", (1, 2)),
            ("step",),
        ]
        assert log.events == [("utility", 1, 0.5, None), ("output", ("b", 0)), ("shutdown",)]

    def test_submit_many_wakes_an_idle_loop(
        self, loop: EngineCoreLoop, log: EventLog, running: LoopThread
    ) -> None:
        _wait_until_blocked(loop)
        loop.submit_many(Add(f"r{i}", 1) for i in range(3))
        log.wait_for(lambda ev: len(ev) == 3)
        assert log.outputs() == [("r0", 0), ("r1", 0), ("r2", 0)]

    def test_submit_many_rejects_the_whole_burst_for_one_bad_message(
        self, loop: EngineCoreLoop
    ) -> None:
        with pytest.raises(TypeError, match="got int"):
            loop.submit_many([Add("a", 1), 42])  # type: ignore[list-item]
        assert loop.input_queue.empty()

    @pytest.mark.parametrize("one", [Add("a", 1), 7], ids=["a-message", "int"])
    def test_submit_many_of_one_message_says_to_pass_an_iterable(
        self, loop: EngineCoreLoop, one: Any
    ) -> None:
        # It said only "'Add' object is not iterable", without naming submit_many().
        name = type(one).__name__
        with pytest.raises(TypeError, match=rf"submit_many\(\) takes an iterable .* got {name}"):
            loop.submit_many(one)
        assert loop.input_queue.empty()

    def test_submit_rejects_non_messages(self, loop: EngineCoreLoop) -> None:
        with pytest.raises(TypeError, match="got tuple"):
            loop.submit(("add", "r", 1))  # type: ignore[arg-type]
        assert loop.input_queue.empty()


class _Record(Control):
    """A control that records, on the loop's thread, what the engine had seen when it ran."""

    __slots__ = ("seen", "then")

    def __init__(self, seen: list[Any], then: Callable[[EngineCoreLoop], None] | None = None):
        self.seen = seen
        self.then = then

    def apply(self, engine: Any, loop: EngineCoreLoop) -> None:
        self.seen.append((threading.get_ident(), list(engine.calls), loop))
        if self.then is not None:
            self.then(loop)


class TestRule18Controls:
    """Rule 18, on both loops: the step() loop and the pipelined one."""

    @LOOPS
    def test_applied_once_on_the_loop_thread_in_queue_order(self, kind: str, depth: int) -> None:
        engine = _engine_for(kind)
        log = EventLog()
        loop = EngineCoreLoop(engine, log, pipeline_depth=depth)
        seen: list[Any] = []
        for msg in (Add("a", 1), _Record(seen), Abort(["a"]), Add("b", 1), _Record(seen)):
            loop.submit(msg)
        lt = LoopThread(loop).start()
        log.wait_for(lambda ev: ("output", ("b", 0)) in ev)
        loop.request_shutdown()
        lt.join()
        assert [s[0] for s in seen] == [lt.thread.ident, lt.thread.ident]
        assert seen[0][1] == [("add", "a", 1)]
        assert seen[1][1] == [("add", "a", 1), ("abort", ("a",)), ("add", "b", 1)]
        assert seen[0][2] is loop
        assert ("output", ("a", 0)) not in log.events

    @LOOPS
    def test_a_control_queued_during_a_step_applies_before_the_next(
        self, kind: str, depth: int
    ) -> None:
        engine = _engine_for(kind)
        log = EventLog()
        loop = EngineCoreLoop(engine, log, pipeline_depth=depth)
        seen: list[Any] = []
        steps = 0

        def on_step(_: int) -> None:
            nonlocal steps
            steps += 1
            if steps == 1:
                loop.submit(_Record(seen, lambda lp: seen.append(("steps", steps))))

        if isinstance(engine, RecordingEngine):
            engine.on_step = on_step
        else:
            engine.on_launch = on_step
        loop.submit(Add("a", 3))
        lt = LoopThread(loop).start()
        log.wait_for(lambda ev: ("output", ("a", 0)) in ev)
        loop.request_shutdown()
        lt.join()
        # Queued during step (or launch) 1; applied before step 2 began.
        assert seen[-1] == ("steps", 1)

    @LOOPS
    def test_the_loop_it_gets_can_submit_and_shut_down(self, kind: str, depth: int) -> None:
        engine = _engine_for(kind)
        log = EventLog()
        loop = EngineCoreLoop(engine, log, pipeline_depth=depth)
        seen: list[Any] = []
        loop.submit(_Record(seen, lambda lp: lp.submit(Add("late", 1))))
        loop.submit(_Record(seen, lambda lp: lp.request_shutdown()))
        loop.submit(Utility(1, "div", (4, 2)))  # in the same drain: still applied
        LoopThread(loop).start().join()
        assert log.events == [("utility", 1, 2.0, None), ("shutdown",)]
        # Submitted by the first control, queued behind the shutdown: never applied.
        assert all(call[:2] != ("add", "late") for call in engine.calls)

    @LOOPS
    def test_an_exception_from_apply_is_fatal(self, kind: str, depth: int) -> None:
        engine = _engine_for(kind)
        log = EventLog()
        loop = EngineCoreLoop(engine, log, pipeline_depth=depth)

        def fail(lp: EngineCoreLoop) -> None:
            raise ValueError("control failed")

        loop.submit(Add("a", 5))
        loop.submit(_Record([], fail))
        loop.submit(Add("never", 1))
        LoopThread(loop).start().join()
        assert log.events == [("fatal", "ValueError('control failed')")]
        assert all(call[:2] != ("add", "never") for call in engine.calls)

    def test_a_control_without_apply_is_fatal_and_says_so(self) -> None:
        class Bare(Control):
            __slots__ = ()

        log = EventLog()
        loop = EngineCoreLoop(CountdownEngine(), log)
        loop.submit(Bare())
        LoopThread(loop).start().join()
        assert log.events == [("fatal", "NotImplementedError('Bare must implement apply()')")]

    def test_submit_takes_a_control_and_still_refuses_other_objects(self) -> None:
        loop = EngineCoreLoop(CountdownEngine(), EventLog())
        loop.submit(_Record([]))
        loop.submit_many([_Record([]), Wakeup()])
        assert loop.input_queue.qsize() == 3
        with pytest.raises(TypeError, match="Wakeup or a Control, got object"):
            loop.submit(object())  # type: ignore[arg-type]


class _Unprintable(Exception):
    """An exception whose ``repr()`` itself raises (a buggy ``__repr__`` in an engine)."""

    def __repr__(self) -> str:
        raise RuntimeError("__repr__ is broken")


_UNPRINTABLE = "_Unprintable(<repr() raised RuntimeError: __repr__ is broken>)"


class _DividedRaises:
    """``x / 1`` raises :class:`_Unprintable`, or returns a future that fails with it: the
    ``div`` utility of both test engines then fails that way, with no engine subclass."""

    def __init__(self, deferred: bool = False) -> None:
        self.deferred = deferred

    def __truediv__(self, other: object) -> Future[Any]:
        if not self.deferred:
            raise _Unprintable
        future: Future[Any] = Future()
        threading.Timer(0.01, future.set_exception, (_Unprintable(),)).start()
        return future


class TestRule8UnprintableExceptions:
    """An exception whose repr() raises still gets its event, on both loops: a utility's is
    that call's answer (the loop goes on), any other's is the fatal event (run() returns)."""

    @LOOPS
    @pytest.mark.parametrize("deferred", [False, True], ids=["raised", "deferred"])
    def test_a_utility_error_is_still_that_calls_answer(
        self, kind: str, depth: int, deferred: bool
    ) -> None:
        log = EventLog()
        loop = EngineCoreLoop(_engine_for(kind), log, pipeline_depth=depth)
        loop.submit(Utility(1, "div", (_DividedRaises(deferred), 1)))
        lt = LoopThread(loop).start()
        log.wait_for(lambda ev: len(ev) == 1)
        loop.submit(Utility(2, "div", (4, 2)))
        log.wait_for(lambda ev: len(ev) == 2)
        loop.request_shutdown()
        lt.join()
        assert log.events == [
            ("utility", 1, None, _UNPRINTABLE),
            ("utility", 2, 2.0, None),
            ("shutdown",),
        ]

    @LOOPS
    def test_a_fatal_error_still_ends_the_run_with_a_fatal_event(
        self, kind: str, depth: int, caplog: pytest.LogCaptureFixture
    ) -> None:
        def fail(lp: EngineCoreLoop) -> None:
            raise _Unprintable

        log = EventLog()
        loop = EngineCoreLoop(_engine_for(kind), log, pipeline_depth=depth)
        loop.submit(Add("a", 5))
        loop.submit(_Record([], fail))
        with caplog.at_level(logging.ERROR, logger="enginecore"):
            loop.run()  # returns: reported, not raised
        assert log.events == [("fatal", _UNPRINTABLE)]


class TestRule8StepOutputsNotIterable:
    """A step (or collect) that returns no iterable, often a forgotten ``return``, is fatal
    with an error that names the method, not only "'NoneType' object is not iterable"."""

    @LOOPS
    @pytest.mark.parametrize("returned", [None, 7], ids=["none", "int"])
    def test_the_fatal_error_names_the_method(
        self, kind: str, depth: int, returned: Any, caplog: pytest.LogCaptureFixture
    ) -> None:
        engine = _engine_for(kind)
        method = "step" if kind == "step" else "collect"
        original = getattr(engine, method)

        def bad(*args: Any) -> Any:
            original(*args)
            return returned

        setattr(engine, method, bad)
        log = EventLog()
        loop = EngineCoreLoop(engine, log, pipeline_depth=depth)
        loop.submit(Add("a", 2))
        with caplog.at_level(logging.ERROR, logger="enginecore"):
            LoopThread(loop).start().join()
        not_iterable = f"'{type(returned).__name__}' object is not iterable"
        named = TypeError(f"engine.{method}() must return an iterable of outputs: {not_iterable}")
        assert log.events == [("fatal", repr(named))]

    @LOOPS
    def test_a_type_error_raised_inside_the_engine_is_left_as_it_is(
        self, kind: str, depth: int
    ) -> None:
        engine = _engine_for(kind)
        method = "step" if kind == "step" else "collect"

        def bad(*args: Any) -> Any:
            return list(None)  # type: ignore[call-overload]

        setattr(engine, method, bad)
        log = EventLog()
        loop = EngineCoreLoop(engine, log, pipeline_depth=depth)
        loop.submit(Add("a", 2))
        LoopThread(loop).start().join()
        assert log.events == [("fatal", repr(TypeError("'NoneType' object is not iterable")))]


class _NoTruthValue:
    """Has no truth value: ``bool()`` of it raises, as of a numpy array of several elements."""

    def __bool__(self) -> bool:
        raise ValueError("the truth value of this is ambiguous")


class TestRule8HasWorkWithoutATruthValue:
    """A ``has_work()`` whose result has no truth value (a numpy array of several elements)
    is fatal with an error that names ``has_work`` and the result's type, not only the
    truth test's own error, which names neither."""

    @LOOPS
    @pytest.mark.parametrize("returned", ["numpy", "python"])
    def test_the_fatal_error_names_has_work_and_the_type(
        self, kind: str, depth: int, returned: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        if returned == "numpy":
            np = pytest.importorskip("numpy")
            result: Any = np.array([True, False])
            type_name, cause = "numpy.ndarray", ValueError
        else:
            result, type_name, cause = _NoTruthValue(), f"{__name__}._NoTruthValue", ValueError
        engine = _engine_for(kind)
        engine.has_work = lambda: result  # type: ignore[method-assign]
        log = EventLog()
        loop = EngineCoreLoop(engine, log, pipeline_depth=depth)
        loop.submit(Add("a", 2))
        with caplog.at_level(logging.ERROR, logger="enginecore"):
            LoopThread(loop).start().join()
        assert len(log.events) == 1
        assert log.events[0][0] == "fatal"
        text = log.events[0][1]
        assert text.startswith("TypeError(")
        assert "engine.has_work() must return a bool" in text
        assert type_name in text
        assert cause.__name__ in text
        # The log's traceback keeps the truth test's own error, as the cause.
        (record,) = [r for r in caplog.records if r.exc_info]
        assert record.exc_info is not None
        assert isinstance(record.exc_info[1], TypeError)
        assert isinstance(record.exc_info[1].__cause__, cause)

    @LOOPS
    def test_an_error_raised_inside_has_work_is_left_as_it_is(self, kind: str, depth: int) -> None:
        engine = _engine_for(kind)

        def bad() -> bool:
            return bool(_NoTruthValue())

        engine.has_work = bad  # type: ignore[method-assign]
        log = EventLog()
        loop = EngineCoreLoop(engine, log, pipeline_depth=depth)
        loop.submit(Add("a", 2))
        LoopThread(loop).start().join()
        assert log.events == [("fatal", repr(ValueError("the truth value of this is ambiguous")))]


class _DividedCancelled:
    """``x / 1`` raises :class:`asyncio.CancelledError`, a ``BaseException`` that is not an
    ``Exception`` (a utility that runs ``asyncio.run()`` on a task that was cancelled)."""

    def __truediv__(self, other: object) -> Any:
        raise asyncio.CancelledError("the utility's task was cancelled")


class _NotAnException(BaseException):
    """A ``BaseException`` of the user's own, not an ``Exception``."""


class TestRule8BaseExceptionsPropagate:
    @LOOPS
    @pytest.mark.parametrize(
        "exc_type",
        [KeyboardInterrupt, SystemExit, GeneratorExit, asyncio.CancelledError, _NotAnException],
    )
    def test_any_base_exception_from_the_engine_is_reported_then_propagates(
        self, kind: str, depth: int, exc_type: type[BaseException]
    ) -> None:
        # Rule 8: an exception from the engine is fatal; one that is not an Exception (any
        # BaseException, not only KeyboardInterrupt/SystemExit) is emitted as fatal, then
        # run() raises it instead of returning.
        engine = _engine_for(kind)

        def fail() -> None:
            raise exc_type

        _on_first_step(engine, fail)
        log = EventLog()
        loop = EngineCoreLoop(engine, log, pipeline_depth=depth)
        loop.submit(Add("a", 2))
        with pytest.raises(exc_type):
            loop.run()
        assert log.events == [("fatal", repr(exc_type()))]


class TestRule8UtilityBaseExceptions:
    @LOOPS
    def test_a_base_exception_from_a_utility_is_that_calls_answer(
        self, kind: str, depth: int
    ) -> None:
        # As when a future it returned fails with it: the call's answer, and the loop goes on.
        log = EventLog()
        loop = EngineCoreLoop(_engine_for(kind), log, pipeline_depth=depth)
        loop.submit_many([Utility(1, "div", (_DividedCancelled(), 1)), Utility(2, "div", (4, 2))])
        lt = LoopThread(loop).start()
        log.wait_for(lambda ev: len(ev) == 2)
        loop.request_shutdown()
        lt.join()
        cancelled = asyncio.CancelledError("the utility's task was cancelled")
        assert log.events == [
            ("utility", 1, None, repr(cancelled)),
            ("utility", 2, 2.0, None),
            ("shutdown",),
        ]

    @LOOPS
    @pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
    def test_keyboard_interrupt_and_system_exit_from_a_utility_still_propagate(
        self, kind: str, depth: int, exc_type: type[BaseException]
    ) -> None:
        class Interrupting:
            def __truediv__(self, other: object) -> Any:
                raise exc_type

        log = EventLog()
        loop = EngineCoreLoop(_engine_for(kind), log, pipeline_depth=depth)
        loop.submit(Utility(1, "div", (Interrupting(), 1)))
        with pytest.raises(exc_type):
            loop.run()
        assert log.events == [("fatal", repr(exc_type()))]


class TestRule17CoroutinesAreNotAnswers:
    @LOOPS
    def test_a_utility_that_returns_a_coroutine_is_answered_with_a_clear_error(
        self, kind: str, depth: int, recwarn: pytest.WarningsRecorder
    ) -> None:
        # An `async def utility` returns a coroutine that nothing would run: it was the
        # call's answer (a bare loop's caller got a coroutine object, with a "never
        # awaited" warning at its collection; a stage's a wire-encoding error).
        async def later() -> int:
            return 3

        class AsyncDivisor:
            def __truediv__(self, other: object) -> Any:
                return later()

        log = EventLog()
        loop = EngineCoreLoop(_engine_for(kind), log, pipeline_depth=depth)
        loop.submit_many([Utility(1, "div", (AsyncDivisor(), 1)), Utility(2, "div", (4, 2))])
        lt = LoopThread(loop).start()
        log.wait_for(lambda ev: len(ev) == 2)
        loop.request_shutdown()
        lt.join()
        events: list[Any] = list(log.events)
        first, second, last = events
        assert first[:3] == ("utility", 1, None)
        error: str = first[3]
        assert error.startswith("TypeError(")
        assert "returned a coroutine" in error
        assert "concurrent.futures.Future" in error
        assert (second, last) == (("utility", 2, 2.0, None), ("shutdown",))
        assert loop.statistics().utility_errors == 1
        gc.collect()
        assert not [w for w in recwarn if "never awaited" in str(w.message)]

    @LOOPS
    def test_a_utility_that_returns_an_asyncio_future_is_answered_with_a_clear_error(
        self, kind: str, depth: int
    ) -> None:
        # Not a concurrent.futures.Future: the loop cannot wait for it (it is bound to an
        # event loop, and not thread-safe), and as a plain result the caller got the future
        # object itself (a stage's caller a wire-encoding error).
        aio = asyncio.new_event_loop()
        try:
            pending = aio.create_future()

            class AsyncioDivisor:
                def __truediv__(self, other: object) -> Any:
                    return pending

            log = EventLog()
            loop = EngineCoreLoop(_engine_for(kind), log, pipeline_depth=depth)
            loop.submit_many([Utility(1, "div", (AsyncioDivisor(), 1)), Utility(2, "div", (4, 2))])
            lt = LoopThread(loop).start()
            log.wait_for(lambda ev: len(ev) == 2)
            loop.request_shutdown()
            lt.join()
        finally:
            aio.close()
        events: list[Any] = list(log.events)
        first, second, last = events
        assert first[:3] == ("utility", 1, None)
        error: str = first[3]
        assert error.startswith("TypeError(")
        assert "returned an asyncio future" in error
        assert "concurrent.futures.Future" in error
        assert (second, last) == (("utility", 2, 2.0, None), ("shutdown",))
        assert loop.statistics().utility_errors == 1
        assert not pending.cancelled()  # the loop never cancels a future


class _Note(Control):
    """A control that does nothing: what the test watches is whether it stays alive."""

    def apply(self, engine: Any, loop: EngineCoreLoop) -> None:
        pass


class TestIdleLoopHoldsNothing:
    @pytest.mark.parametrize("pipelined", [False, True], ids=["step", "pipelined"])
    def test_an_idle_loop_keeps_no_message_it_drained_alive(self, pipelined: bool) -> None:
        # The messages drained in one batch while the loop stepped must not live on while
        # it waits: their payloads (a pipeline stage's arrays, and the shared memory under
        # them) would stay until the next message came.
        engine: Any = CountdownPipeline() if pipelined else CountdownEngine()
        log = EventLog()
        loop = EngineCoreLoop(engine, log)
        note = _Note()
        ref = weakref.ref(note)
        loop.input_queue.put(Add("r", 3))  # queued before run(): one drained batch
        loop.input_queue.put(note)
        del note
        lt = LoopThread(loop).start()
        try:
            log.wait_for(lambda ev: ("output", ("r", 0)) in ev)
            _wait_until_blocked(loop)
            assert ref() is None
        finally:
            loop.request_shutdown()
            lt.join()


class _Payload:
    """An output: what the test watches is whether it stays alive."""


class _PayloadEngine(CountdownEngine):
    """Each step's one output is a :class:`_Payload`, which it keeps a weak reference to."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref[_Payload]] = []

    def step(self) -> list[Any]:
        super().step()
        out = _Payload()
        self.refs.append(weakref.ref(out))
        return [out]


class _PayloadPipeline(_PayloadEngine):
    def launch(self) -> list[Any]:
        return self.step()

    def collect(self, handle: list[Any]) -> list[Any]:
        return handle


class TestIdleLoopHoldsNoOutput:
    @LOOPS
    def test_an_idle_loop_keeps_no_output_it_emitted_alive(self, kind: str, depth: int) -> None:
        # As for the messages (rule 1): once emit has handed an output off, the loop must
        # not keep it while it waits (an encoder stage's array, the shared memory under it).
        engine = _PayloadEngine() if kind == "step" else _PayloadPipeline()
        log = EventLog()

        def emit(event: Any) -> None:
            log(event[:1])  # the kind only: the test's own log keeps no output

        loop = EngineCoreLoop(engine, emit, pipeline_depth=depth)
        loop.submit(Add("r", 2))
        lt = LoopThread(loop).start()
        try:
            log.wait_for(lambda ev: len(ev) == 2)
            _wait_until_blocked(loop)
            assert len(engine.refs) == 2
            assert [ref() for ref in engine.refs] == [None, None]
        finally:
            loop.request_shutdown()
            lt.join()


class TestRule17UnappliedAnswersAreToldApartByType:
    """A stage drops the loop's answers to the utilities it never applied (rule 17) and
    forwards every other answer. It tells them apart by the type the loop gives those
    events, never by their text: an engine's utility may raise (or a deferred one fail with) a
    ``LoopEndedError`` whose ``repr`` is exactly the loop's, and its caller must get it."""

    @LOOPS
    def test_a_utility_s_own_error_that_reads_like_the_loop_s_is_not_taken_for_it(
        self, kind: str, depth: int
    ) -> None:
        from enginecore._loop import is_unapplied_answer

        engine = _engine_for(kind)
        log = EventLog()
        loop = EngineCoreLoop(engine, log, pipeline_depth=depth)
        mimic = LoopEndedError("the engine loop ended before it applied utility 'div' (call 1)")
        failed: Future[Any] = Future()
        failed.set_exception(LoopEndedError(*mimic.args))

        def utility(name: str, args: tuple[Any, ...]) -> Any:
            if name == "deferred":
                return failed
            raise mimic

        engine.utility = utility  # type: ignore[method-assign]

        def stop(lp: EngineCoreLoop) -> None:
            lp.request_shutdown()
            lp.submit(Utility(1, "div", ()))  # behind the drain's snapshot: never applied

        loop.submit_many([Utility(1, "div", ()), Utility(1, "deferred", ()), _Record([], stop)])
        LoopThread(loop).start().join()
        answers = [e for e in log.events if e[0] == "utility"]
        # Three answers with the very same text; only the last is the loop's own.
        assert answers == [_ended(1)] * 3
        assert [is_unapplied_answer(e) for e in answers] == [False, False, True]
        # Marked by the event's type alone: equal to the plain tuple, with the same plain
        # fields (encoders that take only exact types still take them), and a plain tuple
        # once pickled.
        assert all(type(e[3]) is str for e in answers)
        assert not is_unapplied_answer(tuple(answers[-1]))
        assert type(pickle.loads(pickle.dumps(answers[-1]))) is tuple
        assert not is_unapplied_answer(("shutdown",))
        s = loop.statistics()
        assert (s.utility_calls, s.utility_errors) == (2, 2)


def _ended(call_id: int, name: str = "div") -> tuple[Any, ...]:
    err = LoopEndedError(
        f"the engine loop ended before it applied utility {name!r} (call {call_id})"
    )
    return ("utility", call_id, None, repr(err))


def _on_first_step(engine: RecordingEngine | CountdownPipeline, hook: Callable[[], None]) -> None:
    calls = 0

    def once(_: int) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            hook()

    if isinstance(engine, RecordingEngine):
        engine.on_step = once
    else:
        engine.on_launch = once


class TestRule17QueuedUtilitiesAtTheEnd:
    """Rules 8, 9 and 17, on both loops: a ``Utility`` still queued when the loop ends is
    not applied but answered with a ``LoopEndedError``, in queue order, exactly once, before
    the last event; the other messages stay queued, unapplied; ``submit()`` afterwards
    raises ``LoopEndedError`` and queues nothing."""

    @LOOPS
    def test_utilities_queued_behind_a_fatal_error_are_answered(
        self, kind: str, depth: int
    ) -> None:
        engine = _engine_for(kind)
        log = EventLog()
        loop = EngineCoreLoop(engine, log, pipeline_depth=depth)
        late: list[Message] = [Utility(1, "div", (1, 1)), Add("late", 1), Utility(2, "div", (4, 2))]

        def fail() -> None:
            loop.submit_many(late)
            raise _Boom("step")

        _on_first_step(engine, fail)
        loop.submit(Add("a", 3))
        LoopThread(loop).start().join()
        assert log.events == [_ended(1), _ended(2), ("fatal", "_Boom('step')")]
        assert ("utility", "div", (1, 1)) not in engine.calls
        assert all(call[:2] != ("add", "late") for call in engine.calls)
        # The Add is left where it was, never applied; the answered calls are gone.
        assert list(loop.input_queue.queue) == [late[1]]
        s = loop.statistics()
        assert (s.utility_calls, s.utility_errors) == (0, 0)

    @LOOPS
    def test_utilities_queued_before_a_shutdown_before_run_are_answered(
        self, kind: str, depth: int
    ) -> None:
        engine = _engine_for(kind)
        log = EventLog()
        loop = EngineCoreLoop(engine, log, pipeline_depth=depth)
        add = Add("a", 1)
        loop.submit_many([Utility(3, "div", (1, 1)), add, Utility(4, "nope", ())])
        loop.request_shutdown()
        loop.run()
        assert log.events == [_ended(3), _ended(4, "nope"), ("shutdown",)]
        assert engine.calls == []
        assert list(loop.input_queue.queue) == [add, Wakeup()]

    @LOOPS
    def test_a_utility_queued_after_the_last_drain_is_answered(self, kind: str, depth: int) -> None:
        engine = _engine_for(kind)
        log = EventLog()
        loop = EngineCoreLoop(engine, log, pipeline_depth=depth)
        pending: Future[Any] = Future()
        engine.utility = lambda name, args: pending  # type: ignore[method-assign]

        def stop(lp: EngineCoreLoop) -> None:
            lp.request_shutdown()
            lp.submit(Utility(6, "div", (1, 1)))  # behind the drain's snapshot

        loop.submit_many([Utility(5, "slow", ()), _Record([], stop)])
        LoopThread(loop).start().join()
        deferred = LoopEndedError("the engine loop ended before utility 'slow' (call 5) completed")
        # The deferred call first (it was made first), then the queued one.
        assert log.events == [
            ("utility", 5, None, repr(deferred)),
            _ended(6),
            ("shutdown",),
        ]
        s = loop.statistics()
        assert (s.utility_calls, s.utility_errors) == (1, 1)

    @LOOPS
    def test_submit_after_the_end_raises_and_queues_nothing(self, kind: str, depth: int) -> None:
        engine = _engine_for(kind)
        log = EventLog()
        loop = EngineCoreLoop(engine, log, pipeline_depth=depth)
        loop.submit(Add("a", 2))
        lt = LoopThread(loop).start()
        log.wait_for(lambda ev: ("output", ("a", 0)) in ev)
        loop.request_shutdown()
        lt.join()
        left = list(loop.input_queue.queue)
        with pytest.raises(LoopEndedError, match=r"has ended.*Utility was not queued"):
            loop.submit(Utility(7, "div", (1, 1)))
        with pytest.raises(LoopEndedError, match=r"has ended.*Add was not queued"):
            loop.submit_many([Add("b", 1), Utility(8, "div", (1, 1))])
        assert list(loop.input_queue.queue) == left
        assert log.events[-1] == ("shutdown",)
        assert all(e[0] != "utility" for e in log.events)


class TestRule17AnEndCutShort:
    """Rules 8 and 17, on both loops: when the emit of one unapplied call's answer raises
    (or a KeyboardInterrupt lands in it), the calls after it are still answered, each once,
    before the fatal event."""

    @LOOPS
    @pytest.mark.parametrize("exc_type", [_Boom, KeyboardInterrupt])
    @pytest.mark.parametrize("when", ["before-run", "at-the-end"])
    def test_the_calls_after_a_failed_answer_are_still_answered(
        self, kind: str, depth: int, exc_type: type[BaseException], when: str
    ) -> None:
        events: list[Any] = []
        failed: list[Any] = []

        def emit(event: Any) -> None:
            if event == _ended(1) and not failed:
                failed.append(event)
                raise exc_type("emit")
            events.append(event)

        loop = EngineCoreLoop(_engine_for(kind), emit, pipeline_depth=depth)
        calls = [Utility(i, "div", (1, 1)) for i in (1, 2, 3)]

        def stop(lp: EngineCoreLoop) -> None:
            lp.request_shutdown()
            lp.submit_many(calls)  # behind the drain's snapshot: never applied

        if when == "before-run":
            loop.submit_many(calls)
            loop.request_shutdown()
        else:
            loop.submit(_Record([], stop))
        if exc_type is KeyboardInterrupt:
            with pytest.raises(KeyboardInterrupt):
                loop.run()
        else:
            loop.run()
        assert failed == [_ended(1)]
        assert events == [_ended(2), _ended(3), ("fatal", repr(exc_type("emit")))]


class TestRule17FuturesDoneAfterTheEnd:
    """Rule 17, on both loops: a deferred utility's future still pending when the loop ends
    is answered with a ``LoopEndedError``; completed later, it queues nothing on the loop's
    input queue, which nobody reads any more (not even when it completes while the end is
    answering it), and its caller gets no second answer."""

    @LOOPS
    @pytest.mark.parametrize("done", ["after-the-end", "while-the-end-answers"])
    def test_a_late_future_queues_nothing(self, kind: str, depth: int, done: str) -> None:
        fut: Future[Any] = Future()
        ended = (
            "utility",
            1,
            None,
            repr(LoopEndedError("the engine loop ended before utility 'f' (call 1) completed")),
        )
        log = EventLog()

        def emit(event: Any) -> None:
            log(event)
            if done == "while-the-end-answers" and event == ended:
                fut.set_result("too late")  # its callback runs here, on the loop's thread

        engine = _engine_for(kind)
        engine.utility = lambda name, args: fut  # type: ignore[method-assign]
        loop = EngineCoreLoop(engine, emit, pipeline_depth=depth)
        loop.submit_many([Utility(1, "f", ()), _Record([], EngineCoreLoop.request_shutdown)])
        loop.run()
        if done == "after-the-end":
            fut.set_result("too late")
        assert log.events == [ended, ("shutdown",)]
        # Nothing but the Wakeup of the control's request_shutdown(), after the last drain.
        assert [m for m in loop.input_queue.queue if not isinstance(m, Wakeup)] == []

    @LOOPS
    @pytest.mark.parametrize("end", ["shutdown", "fatal"])
    def test_a_future_done_before_the_end_gets_its_real_answer(
        self, kind: str, depth: int, end: str
    ) -> None:
        # Completed after the loop's last drain took its snapshot, before the end answers
        # the pending calls: its done-callback's message is still queued. The caller gets
        # the result, not a LoopEndedError, and the message leaves the queue.
        fut: Future[Any] = Future()
        engine = _engine_for(kind)
        engine.utility = lambda name, args: fut  # type: ignore[method-assign]
        log = EventLog()
        loop = EngineCoreLoop(engine, log, pipeline_depth=depth)

        def complete_then_end(lp: EngineCoreLoop) -> None:
            fut.set_result(42)  # the callback queues its message, on the loop's thread
            if end == "fatal":
                raise _Boom("control failed")
            lp.request_shutdown()

        loop.submit_many([Utility(1, "f", ()), _Record([], complete_then_end)])
        LoopThread(loop).start().join()
        last = ("fatal", repr(_Boom("control failed"))) if end == "fatal" else ("shutdown",)
        assert log.events == [("utility", 1, 42, None), last]
        assert [m for m in loop.input_queue.queue if not isinstance(m, Wakeup)] == []

    @LOOPS
    def test_at_a_fatal_end_pending_futures_are_answered_before_unapplied_calls(
        self, kind: str, depth: int
    ) -> None:
        fut: Future[Any] = Future()
        engine = _engine_for(kind)
        engine.utility = lambda name, args: fut  # type: ignore[method-assign]
        log = EventLog()
        loop = EngineCoreLoop(engine, log, pipeline_depth=depth)

        def fail(lp: EngineCoreLoop) -> None:
            raise _Boom("control failed")

        loop.submit_many([Utility(1, "f", ()), _Record([], fail), Utility(2, "div", (1, 1))])
        LoopThread(loop).start().join()
        pending = LoopEndedError("the engine loop ended before utility 'f' (call 1) completed")
        assert log.events == [
            ("utility", 1, None, repr(pending)),
            _ended(2),
            ("fatal", repr(_Boom("control failed"))),
        ]


class TestRule17UtilitiesLeftOfAFailedDrain:
    """Rules 8 and 17, on both loops: a fatal error in the middle of a drain leaves the
    rest of that drain unapplied; each ``Utility`` among it is answered with a
    ``LoopEndedError``, before those still queued and the fatal event, exactly once."""

    @LOOPS
    def test_the_utilities_after_the_message_that_failed_are_answered(
        self, kind: str, depth: int
    ) -> None:
        engine = _engine_for(kind)
        log = EventLog()
        loop = EngineCoreLoop(engine, log, pipeline_depth=depth)

        def fail(lp: EngineCoreLoop) -> None:
            lp.submit(Utility(4, "div", (1, 1)))  # queued behind the drain
            raise ValueError("control failed")

        again = Utility(3, "div", (9, 3))
        msgs: list[Message] = [Utility(1, "div", (4, 2)), _Record([], fail), Utility(2, "nope", ())]
        loop.submit_many([*msgs, Add("x", 1), again])
        LoopThread(loop).start().join()
        assert log.events == [
            ("utility", 1, 2.0, None),
            _ended(2, "nope"),
            _ended(3),
            _ended(4),
            ("fatal", "ValueError('control failed')"),
        ]
        assert ("utility", "nope", ()) not in engine.calls
        assert all(call[:2] != ("add", "x") for call in engine.calls)

    def test_a_message_object_twice_in_the_drain_is_never_answered_twice(self) -> None:
        engine = RecordingEngine()
        log = EventLog()
        loop = EngineCoreLoop(engine, log)
        boom = _Record([], lambda lp: (_ for _ in ()).throw(ValueError("control failed")))
        call = Utility(5, "div", (1, 1))
        # The first time it is applied, the control raises: what follows was not applied,
        # but the same object comes again later, so only what follows its last occurrence
        # is known not to have been applied.
        loop.submit_many([call, boom, Utility(6, "div", (1, 1)), boom, Utility(7, "div", (1, 1))])
        LoopThread(loop).start().join()
        answers = [e[1] for e in log.events if e[0] == "utility"]
        assert len(answers) == len(set(answers))
        assert answers[0] == 5
        assert 7 in answers
        assert log.events[-1] == ("fatal", "ValueError('control failed')")

    def test_a_call_between_two_occurrences_of_the_message_that_failed_is_answered_once(
        self,
    ) -> None:
        # The same control twice in one drain, failing the second time: the call between
        # them was applied and answered; only what follows the last occurrence is not.
        engine = RecordingEngine()
        log = EventLog()
        loop = EngineCoreLoop(engine, log)
        applied = [0]

        def second_time_fails(lp: EngineCoreLoop) -> None:
            applied[0] += 1
            if applied[0] == 2:
                raise ValueError("control failed")

        twice = _Record([], second_time_fails)
        loop.submit_many([twice, Utility(6, "div", (1, 1)), twice, Utility(7, "div", (1, 1))])
        LoopThread(loop).start().join()
        assert log.events == [
            ("utility", 6, 1.0, None),
            _ended(7),
            ("fatal", "ValueError('control failed')"),
        ]
