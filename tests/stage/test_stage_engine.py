"""The engine as the loop sees it inside a stage (``_stage_engine.py``): the stage's set of
live request ids against a model, through a real in-process stage and a raw client.

A hypothesis state machine plays one client: adds (one at a time or in ``adds`` frames),
duplicates, adds the engine rejects, aborts, requests that finish, and requests that the
routing hook ends with an error, as their last output or not. After every rule it compares
every event (load reports aside) and every engine call with a model whose only state is the
set of live ids: an id is live from an admitted add until its finished output, its abort or
its error.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from enginecore import Control, RequestRejected
from enginecore.stage._stage_engine import LIVE_IN_STAGE

from .raw import Event, RawClient, in_process_stage


class Manual:
    """Requests stay until told: utility ``finish(rid)`` makes the next step emit rid's
    finished output, ``fail(rid, last)`` an output that ends it with an error. Data
    ``"reject"`` is rejected. Records every ``add`` and ``abort`` call."""

    def __init__(self) -> None:
        self.live: set[str] = set()
        self.calls: list[tuple[Any, ...]] = []
        self._due: list[tuple[str, Any, bool]] = []

    def has_work(self) -> bool:
        return bool(self._due)

    def add(self, req_id: str, data: Any) -> None:
        self.calls.append(("add", req_id))
        if data == "reject":
            raise RequestRejected(f"rejected {req_id}")
        assert req_id not in self.live, "the stage let a live id through"
        self.live.add(req_id)

    def abort(self, req_ids: Sequence[str]) -> None:
        self.calls.append(("abort", tuple(req_ids)))
        self.live.difference_update(req_ids)

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        if name == "finish" and args[0] in self.live:
            self.live.discard(args[0])
            self._due.append((args[0], "done", True))
        elif name == "fail" and args[0] in self.live:
            rid, last = args
            if last:
                self.live.discard(rid)
            self._due.append((rid, RequestRejected(f"failed {rid}"), last))
        return None

    def step(self) -> list[tuple[str, Any, bool]]:
        due, self._due = self._due, []
        return due

    @staticmethod
    def route_outputs(
        outs: list[tuple[str, Any, bool]],
    ) -> tuple[list[str], list[bool], list[Any]]:
        return [o[0] for o in outs], [o[2] for o in outs], [o[1] for o in outs]


IDS = st.sampled_from("abc")


class LiveSetMachine(RuleBasedStateMachine):
    """One client against the model. The stage is shared by every run (see the test): each
    run has its own id prefix, so what earlier runs left live cannot interfere."""

    engine: Manual
    client: RawClient
    runs = itertools.count()
    call_ids = itertools.count(1)

    def __init__(self) -> None:
        super().__init__()
        self.prefix = f"m{next(self.runs)}-"
        self.live: set[str] = set()
        self.expected_events: list[Event] = []
        self.expected_calls: list[tuple[Any, ...]] = []

    def _sync(self) -> list[Event]:
        """Every event up to the answers to two calls in a row, those answers left out: the
        second is applied after the step the first may have triggered, and after the drop
        of any request that step ended with an error (queued during the step).

        Load reports are left out too, as a client keeps them apart: the model has no load.
        A report can go alone, on an ``outputs`` event with no outputs, whenever the idle
        stage's live count changed with no step (an add this engine holds, an abort;
        ``docs/observability.md``, "Load reports"), so among the events wherever the
        interval let it go. Each one left out must have carried a report."""
        client = self.client
        loads = len(client.loads)
        events = client.call(next(self.call_ids), "sync")[:-1]
        events += client.call(next(self.call_ids), "sync")[:-1]
        kept = [ev for ev in events if ev != ["outputs", [], [], []]]
        assert len(events) - len(kept) <= len(client.loads) - loads, "outputs with none, no load"
        return kept

    def _add(self, rid: str, reject: bool) -> None:
        if rid in self.live:
            self.expected_events.append(["error", rid, LIVE_IN_STAGE])
            return
        self.expected_calls.append(("add", rid))
        if reject:
            self.expected_events.append(["error", rid, f"rejected {rid}"])
        else:
            self.live.add(rid)

    @rule(rid=IDS, reject=st.booleans())
    def add(self, rid: str, reject: bool) -> None:
        rid = self.prefix + rid
        self.client.send("add", rid, "reject" if reject else 1)
        self._add(rid, reject)

    @rule(items=st.lists(st.tuples(IDS, st.booleans()), min_size=1, max_size=4))
    def adds(self, items: list[tuple[str, bool]]) -> None:
        rids = [self.prefix + rid for rid, _ in items]
        self.client.send("adds", rids, ["reject" if r else 1 for _, r in items])
        for rid, (_, reject) in zip(rids, items, strict=True):
            self._add(rid, reject)

    @rule(rids=st.lists(IDS, max_size=3))
    def abort(self, rids: list[str]) -> None:
        rids = [self.prefix + rid for rid in rids]
        self.client.send("abort", rids)
        self.expected_calls.append(("abort", tuple(rids)))
        self.expected_events.append(["aborted", rids])
        self.live.difference_update(rids)

    @rule(rid=IDS)
    def finish(self, rid: str) -> None:
        rid = self.prefix + rid
        call_id = next(self.call_ids)
        self.client.send("utility", call_id, "finish", [rid])
        self.expected_events.append(["utility", call_id, None, None])
        if rid in self.live:
            self.expected_events.append(["outputs", [rid], [True], ["done"]])
            self.live.discard(rid)

    @rule(rid=IDS, last=st.booleans())
    def fail(self, rid: str, last: bool) -> None:
        rid = self.prefix + rid
        call_id = next(self.call_ids)
        self.client.send("utility", call_id, "fail", [rid, last])
        self.expected_events.append(["utility", call_id, None, None])
        if rid in self.live:
            self.expected_events.append(["error", rid, f"failed {rid}"])
            if not last:  # the engine still had it: the stage drops it, with no event
                self.expected_calls.append(("abort", (rid,)))
            self.live.discard(rid)

    @invariant()  # after every rule, and once before the first
    def events_and_engine_calls_match_the_model(self) -> None:
        assert self._sync() == self.expected_events
        assert self.engine.calls == self.expected_calls
        assert {rid for rid in self.engine.live if rid.startswith(self.prefix)} == self.live
        self.expected_events.clear()
        self.expected_calls.clear()
        del self.engine.calls[:]


@pytest.fixture
def shared_stage(no_leftovers: str) -> Iterator[tuple[Manual, RawClient]]:
    engine = Manual()
    with in_process_stage(engine, no_leftovers) as (stage, client):
        yield engine, client
        assert stage.exit_code is None  # nothing the machine did was fatal


class TestLiveSet:
    def test_the_stage_tracks_live_ids_like_the_model(
        self, shared_stage: tuple[Manual, RawClient]
    ) -> None:
        LiveSetMachine.engine, LiveSetMachine.client = shared_stage
        run_state_machine_as_test(
            LiveSetMachine,
            settings=settings(
                max_examples=60,
                stateful_step_count=25,
                deadline=None,
                database=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )


def test_a_late_submit_after_the_loop_ended_is_dropped_not_raised() -> None:
    """The drain's timer, a signal's drain thread and the output thread submit to the loop
    from other threads, possibly after it ended, when ``submit()`` raises
    ``LoopEndedError`` (docs/contract.md, rule 17): they drop the message instead."""
    from enginecore import CountdownEngine, EngineCoreLoop, LoopEndedError
    from enginecore.stage._controls import DrainDeadline
    from enginecore.stage._stage_engine import submit_unless_ended

    loop = EngineCoreLoop(CountdownEngine(), lambda event: None)
    loop.request_shutdown()
    loop.run()
    with pytest.raises(LoopEndedError):
        loop.submit(DrainDeadline(1))
    left = list(loop.input_queue.queue)
    submit_unless_ended(loop, DrainDeadline(1))
    assert list(loop.input_queue.queue) == left


def test_the_stage_knows_the_loop_s_answers_to_utilities_it_never_applied() -> None:
    """A bare loop answers a Utility it ended without applying with a LoopEndedError
    (docs/contract.md, rule 17); a stage drops those answers (StageEngine.emit) and ends
    such calls its own way, EngineDeadError when it dies (tests/stage/test_death.py). Only
    those: a deferred call's answer at the end, or a utility's own error, still goes out."""
    from concurrent.futures import Future

    from enginecore import CountdownEngine, EngineCoreLoop, Utility
    from enginecore._loop import is_unapplied_answer

    class Deferring(CountdownEngine):
        def utility(self, name: str, args: tuple[Any, ...]) -> Any:
            if name == "later":
                return Future()
            return super().utility(name, args)

    events: list[Any] = []
    loop = EngineCoreLoop(Deferring(), events.append)
    loop.submit_many([Utility(1, "later", ()), Utility(2, "div", (1, 0))])
    loop.submit(Utility(3, "nope", ()))

    class Stop(Control):
        def apply(self, engine: Any, lp: EngineCoreLoop) -> None:
            lp.request_shutdown()
            lp.submit(Utility(4, 'it\'s "quoted"', ()))

    loop.submit(Stop())
    loop.run()
    answers = {e[1]: is_unapplied_answer(e) for e in events if e[0] == "utility"}
    assert answers == {1: False, 2: False, 3: False, 4: True}
    assert not is_unapplied_answer(("shutdown",))
