"""A hypothesis state machine drives a live loop and checks it against a reference model.

The loop runs on its own thread, but deterministically: it parks at two checkpoints, on
entering ``step()`` and just before its blocking ``input_queue.get()``. While it is parked the
state machine plays the producers (put messages, request shutdown); ``release`` lets it run to
its next checkpoint. The model is the contract written as the simplest possible code. After
every rule the engine calls and the events must match the model exactly.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from enginecore import (
    Abort,
    Add,
    CountdownEngine,
    EngineCoreLoop,
    Event,
    LoopEndedError,
    Utility,
    Wakeup,
)

from .conftest import RecordingEngine

IDS = st.sampled_from(["a", "b", "c"])
_SHUTDOWN = object()


class ContractModel:
    """The loop contract as a sequential program over a CountdownEngine."""

    def __init__(self) -> None:
        self.engine = CountdownEngine()
        self.pending: deque[Any] = deque()
        self.shutdown = False
        self.calls: list[tuple[Any, ...]] = []
        self.events: list[Event] = []
        self.at = "start"  # "step" | "get" | "done": where the real loop is parked

    def put(self, msg: Any) -> None:
        self.pending.append(msg)

    def request_shutdown(self) -> None:
        if not self.shutdown:
            self.shutdown = True
            self.pending.append(Wakeup())

    def _apply(self, msg: Any, rest: list[Any] | None = None) -> bool:
        """Apply one message (*rest*: those after it in its drain); False if it was fatal."""
        try:
            if isinstance(msg, Add):
                self.calls.append(("add", msg.req_id, msg.data))
                self.engine.add(msg.req_id, msg.data)
            elif isinstance(msg, Abort):
                self.calls.append(("abort", tuple(msg.req_ids)))
                self.engine.abort(msg.req_ids)
            elif isinstance(msg, Utility):
                self.calls.append(("utility", msg.name, msg.args))
                try:
                    result = self.engine.utility(msg.name, msg.args)
                except Exception as exc:
                    self.events.append(("utility", msg.call_id, None, repr(exc)))
                else:
                    self.events.append(("utility", msg.call_id, result, None))
        except Exception as exc:
            self._end(rest or [])
            self.events.append(("fatal", repr(exc)))
            self.at = "done"
            return False
        return True

    def _end(self, rest: list[Any] | None = None) -> None:
        # Rule 17: what is still queued is not applied; its utilities are answered, in
        # order (those of a drain that failed first), and leave the queue; the rest stays.
        for msg in [*(rest or []), *self.pending]:
            if isinstance(msg, Utility):
                err = LoopEndedError(
                    f"the engine loop ended before it applied utility {msg.name!r} "
                    f"(call {msg.call_id})"
                )
                self.events.append(("utility", msg.call_id, None, repr(err)))
        self.pending = deque(m for m in self.pending if not isinstance(m, Utility))

    def run_to_checkpoint(self) -> None:
        # One loop iteration: drain a snapshot, check shutdown, then step or block.
        if self.pending:
            batch = list(self.pending)
            self.pending.clear()
            for i, msg in enumerate(batch):
                if not self._apply(msg, batch[i + 1 :]):
                    return
        if self.shutdown:
            self._end()
            self.events.append(("shutdown",))
            self.at = "done"
        elif self.engine.has_work():
            self.at = "step"
        else:
            self.at = "get"

    def release(self) -> None:
        if self.at == "step":
            self.calls.append(("step",))
            self.events.extend(("output", out) for out in self.engine.step())
        # At "get", the blocking get() returns the oldest message.
        elif not self._apply(self.pending.popleft()):
            return
        self.run_to_checkpoint()


class ParkingEngine(RecordingEngine):
    """Parks the loop thread at the entry of step(); the get() checkpoint is in LoopMachine."""

    def __init__(self, park: Any) -> None:
        super().__init__()
        self.on_step = lambda n: park("step")


class LoopMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.model = ContractModel()
        self.notices: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.go = threading.Semaphore(0)
        self.events: list[Event] = []
        self.engine = ParkingEngine(self._park)
        self.loop = EngineCoreLoop(self.engine, self.events.append)
        real_get = self.loop.input_queue.get

        def parking_get(*args: Any, **kwargs: Any) -> Any:
            self._park("get")
            return real_get(*args, **kwargs)

        self.loop.input_queue.get = parking_get  # type: ignore[method-assign]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self._expect_checkpoint()
        self.model.run_to_checkpoint()
        self.next_call_id = 0

    # -- plumbing ----------------------------------------------------------------------------

    def _park(self, where: str) -> None:
        self.notices.put(where)
        if not self.go.acquire(timeout=10):
            raise RuntimeError("state machine never released the loop")

    def _run(self) -> None:
        try:
            self.loop.run()
        finally:
            self.notices.put("done")

    def _expect_checkpoint(self) -> None:
        self.real_at = self.notices.get(timeout=10)

    def _put(self, msg: Any) -> None:
        if not isinstance(msg, (Add, Abort, Utility, Wakeup)):
            self.loop.input_queue.put(msg)  # submit() would refuse it
        elif self.model.at == "done":
            # Rule 17: refused once the loop has ended, and nothing is queued.
            with pytest.raises(LoopEndedError):
                self.loop.submit(msg)
            return
        else:
            self.loop.submit(msg)
        self.model.put(msg)

    # -- producers (also after the run ended: then nothing may happen) -------------------------

    @rule(req_id=IDS, steps=st.integers(1, 3))
    def add(self, req_id: str, steps: int) -> None:
        self._put(Add(req_id, steps))

    @rule(req_id=IDS)
    def add_invalid(self, req_id: str) -> None:
        self._put(Add(req_id, 0))  # CountdownEngine.add raises RequestRejected: fatal here

    @rule(req_ids=st.lists(IDS, max_size=3))
    def abort(self, req_ids: list[str]) -> None:
        self._put(Abort(req_ids))

    @rule(a=st.integers(-3, 3), b=st.integers(0, 2), name=st.sampled_from(["div", "nope"]))
    def utility(self, a: int, b: int, name: str) -> None:
        self.next_call_id += 1
        self._put(Utility(self.next_call_id, name, (a, b)))

    @rule()
    def wakeup(self) -> None:
        self._put(Wakeup())

    @rule(garbage=st.sampled_from([None, 42, ("add", "a", 1)]))
    def not_a_message(self, garbage: object) -> None:
        self._put(garbage)  # logged and skipped

    @rule()
    def request_shutdown(self) -> None:
        self.loop.request_shutdown()
        self.model.request_shutdown()

    # -- the loop ----------------------------------------------------------------------------

    @precondition(
        lambda self: self.model.at == "step" or (self.model.at == "get" and self.model.pending)
    )
    @rule()
    def release(self) -> None:
        self.go.release()
        self._expect_checkpoint()
        self.model.release()

    @invariant()
    def loop_matches_model(self) -> None:
        assert self.real_at == self.model.at
        assert self.engine.calls == self.model.calls
        assert self.events == self.model.events

    def teardown(self) -> None:
        self.loop.request_shutdown()
        while self.real_at != "done":
            self.go.release()
            self._expect_checkpoint()
        self.thread.join(10)
        assert not self.thread.is_alive()
        assert self.events[-1][0] in ("shutdown", "fatal")
        assert sum(1 for e in self.events if e[0] in ("shutdown", "fatal")) == 1


LoopMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLoopAgainstModel = LoopMachine.TestCase
