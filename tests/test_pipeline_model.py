"""A hypothesis state machine checks the pipelined loop (rules 12-17) against a sequential model.

Like ``test_loop_model.py``: the loop runs on its own thread, deterministically, parking at
three checkpoints: on entering ``launch()``, on entering ``collect()`` and just before its
blocking ``input_queue.get()``. While it is parked, the state machine plays the producers
(adds, aborts, utilities, deferred utilities and their completion from "another thread",
shutdown), changes what the engine can do (``has_work()`` throttled, the next launch,
collect or has_work failing) and ``release``\\ s the loop to its next checkpoint. The depth is
drawn from 1 to 4. Random producers against random launch/collect timing put aborts between
a launch and its collect at every depth.

Everything the engine sees and everything the loop emits goes into one trace, as do the
producers' puts and the checkpoints. After every rule the trace must equal the model's, the
contract written as the simplest sequential code. Two properties are also checked on the
trace directly, independently of the model:

- **abort exactness**: no collect that begins after an ``Abort`` naming a request was put
  returns an output for it (requests ids are never reused here);
- **handles**: every handle launched is collected or cancelled, exactly once, in launch order
  (``collected + cancelled == launched``), and the run ends with exactly one terminal event.

At least 2,000 examples run (``max_examples``): ~9 s on the project's 2-core VM.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from concurrent.futures import CancelledError, Future
from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from enginecore import Abort, Add, EngineCoreLoop, LoopEndedError, Utility, Wakeup

from .pipeline_engines import CountdownPipeline


def _answer(call_id: int, name: str, fut: Future[Any]) -> tuple[Any, ...]:
    """The loop's "utility" event for a done future (the documented text, rule 17)."""
    if fut.cancelled():
        err = CancelledError(f"the future of utility {name!r} (call {call_id}) was cancelled")
        return ("utility", call_id, None, repr(err))
    exc = fut.exception()
    if exc is not None:
        return ("utility", call_id, None, repr(exc))
    return ("utility", call_id, fut.result(), None)


def _ended(call_id: int, name: str) -> tuple[Any, ...]:
    err = LoopEndedError(
        f"the engine loop ended before utility {name!r} (call {call_id}) completed"
    )
    return ("utility", call_id, None, repr(err))


class _Done:
    """The model's "this deferred call's future is done" message."""

    def __init__(self, key: int) -> None:
        self.key = key


class PipelineModel:
    """The loop contract at depth *depth*, as a sequential program over a CountdownPipeline."""

    def __init__(self, depth: int, futures: dict[Any, Future[Any]]) -> None:
        self.depth = depth
        self.engine = CountdownPipeline(record_has_work=True)
        self.engine.futures = futures  # the very futures the real engine hands out
        self.trace = self.engine.calls  # engine calls, emits, puts and checkpoints
        self.pending: deque[Any] = deque()
        self.shutdown = False
        self.inflight: deque[int] = deque()
        self.deferred: dict[int, tuple[int, str, Future[Any]]] = {}  # in call order
        self.at = "start"  # "launch" | "collect" | "get" | "done": where the loop is parked
        self.left: list[Any] = []  # the messages of the drain under way not applied yet

    def put(self, msg: Any) -> None:
        self.pending.append(msg)

    def request_shutdown(self) -> None:
        if not self.shutdown:
            self.shutdown = True
            self.pending.append(Wakeup())

    def future_done(self, key: int) -> None:
        # The real done-callback puts its message only for a call the loop has deferred.
        if key in self.deferred:
            self.pending.append(_Done(key))

    def _emit(self, event: tuple[Any, ...]) -> None:
        self.trace.append(("emit", event))

    def _apply(self, msg: Any) -> None:
        engine = self.engine
        if isinstance(msg, Add):
            engine.add(msg.req_id, msg.data)
        elif isinstance(msg, Abort):
            engine.abort(msg.req_ids)
        elif isinstance(msg, Utility):
            try:
                result = engine.utility(msg.name, msg.args)
            except Exception as exc:
                self._emit(("utility", msg.call_id, None, repr(exc)))
                return
            if isinstance(result, Future):
                if result.done():
                    self._emit(_answer(msg.call_id, msg.name, result))
                else:
                    self.deferred[msg.args[0]] = (msg.call_id, msg.name, result)
            else:
                self._emit(("utility", msg.call_id, result, None))
        elif isinstance(msg, _Done) and msg.key in self.deferred:
            self._emit(_answer(*self.deferred.pop(msg.key)))

    def _abandon(self) -> None:
        for call_id, name, fut in self.deferred.values():
            self._emit(_answer(call_id, name, fut) if fut.done() else _ended(call_id, name))
        self.deferred.clear()
        # Then the utilities never applied, those of a drain that failed first, then those
        # still queued: answered in order, and taken off the queue; the other messages stay
        # there (rule 17).
        for msg in [*self.left, *self.pending]:
            if isinstance(msg, Utility):
                err = LoopEndedError(
                    f"the engine loop ended before it applied utility {msg.name!r} "
                    f"(call {msg.call_id})"
                )
                self._emit(("utility", msg.call_id, None, repr(err)))
        self.pending = deque(m for m in self.pending if not isinstance(m, Utility))

    def _fatal(self, exc: Exception) -> None:
        for handle in self.inflight:
            self.engine.cancel(handle)
        self.inflight.clear()
        self._abandon()
        self._emit(("fatal", repr(exc)))
        self.at = "done"

    def _park(self, where: str) -> None:
        self.at = where
        self.trace.append(("enter", where))

    def run_to_checkpoint(self) -> None:
        # One iteration: drain a snapshot, then launch, collect, block or end (rules 13-15).
        try:
            batch = list(self.pending)
            self.pending.clear()
            for i, msg in enumerate(batch):
                self.left = batch[i + 1 :]
                self._apply(msg)
            self.left = []
            if self.shutdown:
                if self.inflight:
                    self._park("collect")
                else:
                    self._abandon()
                    self._emit(("shutdown",))
                    self.at = "done"
            elif len(self.inflight) < self.depth and self.engine.has_work():
                self._park("launch")
            elif self.inflight:
                self._park("collect")
            else:
                self._park("get")
        except Exception as exc:
            self._fatal(exc)

    def release(self) -> None:
        try:
            if self.at == "launch":
                self.inflight.append(self.engine.launch())
            elif self.at == "collect":
                for out in self.engine.collect(self.inflight.popleft()):
                    self._emit(("output", out))
            else:  # "get": the blocking get() returns the oldest message
                self._apply(self.pending.popleft())
        except Exception as exc:
            self._fatal(exc)
            return
        self.run_to_checkpoint()


class PipelineMachine(RuleBasedStateMachine):
    @initialize(
        depth=st.integers(1, 4),
        faults=st.integers(0, 3),
        initial=st.lists(st.integers(1, 10), min_size=1, max_size=3),
        moves=st.integers(0, 8),
    )
    def start(self, depth: int, faults: int, initial: list[int], moves: int) -> None:
        # A fault (an invalid add, a failing launch, collect or has_work) ends the run; one
        # run in four may inject them, so that the others get far enough to fill deep
        # pipelines.
        self.faults = faults == 0
        self.futures: dict[Any, Future[Any]] = {}
        self.model = PipelineModel(depth, self.futures)
        self.notices: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.go = threading.Semaphore(0)
        self.engine = CountdownPipeline(record_has_work=True)
        self.engine.futures = self.futures
        self.trace = self.engine.calls
        self.engine.on_launch = lambda h: self._park("launch")
        self.engine.on_collect = lambda h: self._park("collect")
        self.loop = EngineCoreLoop(
            self.engine, lambda ev: self.trace.append(("emit", ev)), pipeline_depth=depth
        )
        real_get = self.loop.input_queue.get

        def parking_get(*args: Any, **kwargs: Any) -> Any:
            self._park("get")
            return real_get(*args, **kwargs)

        self.loop.input_queue.get = parking_get  # type: ignore[method-assign]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.real_at = self.notices.get(timeout=10)
        self.model.run_to_checkpoint()
        self.next_id = 0
        self.requests: list[str] = []
        self.open_futures: list[int] = []
        # Requests queued at once, so that every run has steps to pipeline.
        for steps in initial:
            self.add(steps, 0)
        self._move(moves)

    # -- plumbing ----------------------------------------------------------------------------

    def _park(self, where: str) -> None:
        self.trace.append(("enter", where))
        self.notices.put(where)
        if not self.go.acquire(timeout=10):
            raise RuntimeError("state machine never released the loop")

    def _run(self) -> None:
        try:
            self.loop.run()
        finally:
            self.notices.put("done")

    def _fresh(self) -> int:
        self.next_id += 1
        return self.next_id

    def _put(self, msg: Any) -> None:
        for trace in (self.trace, self.model.trace):
            trace.append(("put", msg))
        self.loop.input_queue.put(msg)
        self.model.put(msg)

    def _release_once(self) -> None:
        self.go.release()
        self.real_at = self.notices.get(timeout=10)
        self.model.release()

    # -- producers ---------------------------------------------------------------------------

    @rule(steps=st.integers(1, 8), moves=st.integers(0, 4))
    def add(self, steps: int, moves: int) -> None:
        rid = f"r{self._fresh()}"
        self.requests.append(rid)
        self._put(Add(rid, steps))
        self._move(moves)

    @rule(moves=st.integers(0, 4))
    def add_invalid(self, moves: int) -> None:
        # In a run with faults, an add the engine rejects (fatal in a bare loop); in the
        # others the loop just moves on (a precondition would make hypothesis redraw).
        if self.faults:
            self._put(Add(f"r{self._fresh()}", 0))
        self._move(moves)

    @rule(picks=st.lists(st.integers(0, 1 << 16), min_size=1, max_size=2), moves=st.integers(0, 4))
    def abort(self, picks: list[int], moves: int) -> None:
        # Requests put so far, in any state: queued, stepping, in flight, finished, aborted.
        self._put(Abort([self.requests[p % len(self.requests)] for p in picks]))
        self._move(moves)

    def _abort_in_flight(self, pick: int) -> None:
        # A request with an output in a step in flight (or about to be, when the loop is
        # parked inside launch): the abort lands between a launch and its collect.
        in_flight = {out[0] for outs in self.engine._outstanding.values() for out in outs}
        pool = sorted(in_flight) or self.requests
        self._put(Abort([pool[pick % len(pool)]]))

    @rule(a=st.integers(-3, 3), b=st.integers(0, 2), moves=st.integers(0, 4))
    def utility(self, a: int, b: int, moves: int) -> None:
        self._put(Utility(self._fresh(), "div", (a, b)))
        self._move(moves)

    @rule(ready=st.booleans(), moves=st.integers(0, 4))
    def deferred_utility(self, ready: bool, moves: int) -> None:
        key = self._fresh()
        self.futures[key] = fut = Future[Any]()
        if ready:
            fut.set_result(key)
        else:
            self.open_futures.append(key)
        self._put(Utility(key, "future", (key,)))
        self._move(moves)

    @rule(
        pick=st.integers(0, 1 << 16),
        how=st.sampled_from(["result", "exception", "cancel"]),
        moves=st.integers(0, 4),
    )
    def complete_future(self, pick: int, how: str, moves: int) -> None:
        # The test thread plays the thread that completes the future: the real callback
        # runs here and now, while the loop is parked.
        if not self.open_futures:
            self._move(moves)
            return
        key = self.open_futures.pop(pick % len(self.open_futures))
        fut = self.futures[key]
        if how == "result":
            fut.set_result(-key)
        elif how == "exception":
            fut.set_exception(KeyError(key))
        else:
            assert fut.cancel()
        for trace in (self.trace, self.model.trace):
            trace.append(("completed", key))
        self.model.future_done(key)
        self._move(moves)

    @rule()
    def wakeup(self) -> None:
        self._put(Wakeup())

    @rule()
    def request_shutdown(self) -> None:
        for trace in (self.trace, self.model.trace):
            trace.append(("request_shutdown",))
        self.loop.request_shutdown()
        self.model.request_shutdown()

    # -- the engine's side -------------------------------------------------------------------

    @rule(throttled=st.booleans(), moves=st.integers(0, 4))
    def throttle(self, throttled: bool, moves: int) -> None:
        self.engine.throttled = self.model.engine.throttled = throttled
        self._move(moves)

    @rule(where=st.sampled_from(["launch", "collect", "has_work"]), moves=st.integers(0, 4))
    def fail_next(self, where: str, moves: int) -> None:
        if self.faults:
            self.engine.fail_next = self.model.engine.fail_next = where
        self._move(moves)

    # -- the loop ----------------------------------------------------------------------------

    def _can_release(self) -> bool:
        at = self.model.at
        return at in ("launch", "collect") or (at == "get" and bool(self.model.pending))

    def _move(self, times: int) -> None:
        # Let the loop run to its next checkpoint up to *times* times: the producers and
        # the loop race, and every rule lets the loop move on a little.
        for _ in range(times):
            if not self._can_release():
                break
            self._release_once()

    @rule(times=st.integers(1, 8), abort_at=st.integers(-4, 7), pick=st.integers(0, 7))
    def release(self, times: int, abort_at: int, pick: int) -> None:
        # Let the loop move on, and (unless abort_at < 0) abort a request in flight on the
        # way, just before move number abort_at.
        for i in range(times):
            if i == abort_at:
                self._abort_in_flight(pick)
            if not self._can_release():
                break
            self._release_once()

    # -- checks ------------------------------------------------------------------------------

    @invariant()
    def loop_matches_model(self) -> None:
        if not hasattr(self, "model"):
            return
        assert self.real_at == self.model.at
        assert self.trace == self.model.trace
        assert self.engine.in_flight <= self.model.depth

    def teardown(self) -> None:
        if not hasattr(self, "model"):
            return
        # What the run covered (pytest --hypothesis-show-statistics).
        event(f"depth {self.model.depth}: at most {self.engine.max_in_flight} in flight")
        event(f"aborts that dropped outputs in flight: {min(self.engine.aborts_in_flight, 3)}+")
        for trace in (self.trace, self.model.trace):
            trace.append(("request_shutdown",))
        self.loop.request_shutdown()
        self.model.request_shutdown()
        while self.model.at != "done":
            self._release_once()
        assert self.real_at == "done"
        self.thread.join(10)
        assert not self.thread.is_alive()
        assert self.trace == self.model.trace
        self._check_properties()

    def _check_properties(self) -> None:
        events = [item[1] for item in self.trace if item[0] == "emit"]
        assert events[-1][0] in ("shutdown", "fatal")
        assert sum(1 for e in events if e[0] in ("shutdown", "fatal")) == 1
        # Every handle collected or cancelled, exactly once, in launch order.
        engine = self.engine
        assert engine.collected + engine.cancelled == engine.launched
        assert engine.in_flight == 0
        # Every deferred call the engine saw is answered exactly once (its call id is its
        # future's key), and nothing else of it; one the loop ended before applying is
        # answered once too, and never reached the engine.
        made = [item[2][0] for item in self.trace if item[:2] == ("utility", "future")]
        answered = [e[1] for e in events if e[0] == "utility" and e[1] in self.futures]
        unapplied = [
            e[1]
            for e in events
            if e[0] == "utility" and e[1] in self.futures and "before it applied" in str(e[3])
        ]
        assert not set(made) & set(unapplied)
        assert sorted(answered) == sorted(made + unapplied)
        # Abort exactness, seen from the producer: once an Abort naming rid is put, no
        # collect that begins afterwards returns an output of rid.
        abort_put: dict[str, int] = {}
        collect_began = -1
        for pos, item in enumerate(self.trace):
            if item[0] == "put" and isinstance(item[1], Abort):
                for rid in item[1].req_ids:
                    abort_put.setdefault(rid, pos)
            elif item == ("enter", "collect"):
                collect_began = pos
            elif item[0] == "emit" and item[1][0] == "output":
                rid = item[1][1][0]
                assert abort_put.get(rid, len(self.trace)) > collect_began, (
                    f"output {item[1]} from a collect that began after {rid}'s abort was put"
                )


PipelineMachine.TestCase.settings = settings(
    max_examples=2000,
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPipelineAgainstModel = PipelineMachine.TestCase
TestPipelineAgainstModel.pytestmark = [pytest.mark.slow]  # type: ignore[attr-defined]  # ~9 s
