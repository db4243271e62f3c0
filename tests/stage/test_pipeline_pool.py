"""Replica pools as pipeline stages (``docs/pipelines.md``, "Replica pools as stages"):
``PipelineStage(..., replicas=n)``, real stage processes, data sent replica to replica.

One suite for :class:`~enginecore.stage.Pipeline` and
:class:`~enginecore.stage.AsyncPipeline` (``[sync]``, ``[async]``), as in
``test_stage_pipeline.py``; the conftest's autouse fixture checks that no process, socket
file or shared-memory segment is left behind. The coordinator's routing and its count of
the requests routed to each replica are checked alone, against a model, at the end."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from enginecore.stage import (
    EngineDeadError,
    PipelineRequestError,
    PipelineStage,
    PipelineStageDeadError,
    Retry,
    StageHealth,
    StageStartupError,
    StageStatistics,
    _shm,
)
from enginecore.stage._errors import EngineDeadError as _Dead
from enginecore.stage._pipeline_core import PipelineCore, PipelineDeliveries, RequestState
from enginecore.stage._session import StreamCore

from .conftest import wait_until
from .pipelines import Launch, launcher, shutdown_in_background

COUNTDOWN = "enginecore:CountdownEngine"
RELAY = "enginecore.stage.testing:relay"
DEVICE = "enginecore.stage.testing:device"
FLAKY = "enginecore.stage.testing:flaky"
T = "enginecore.stage.testing"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture(params=["sync", "async"])
def launch(request: pytest.FixtureRequest, no_leftovers: str) -> Iterator[Launch]:
    """``launch(stages, **kwargs)``: either pipeline (``pipelines.launcher``); each is shut
    down after the test."""
    with launcher(request.param) as launch_:
        yield launch_


class TestRouting:
    def test_a_pool_stage_spreads_requests_over_its_replicas(self, launch: Any) -> None:
        pipe = launch([COUNTDOWN, PipelineStage(RELAY, name="mid", replicas=2), RELAY])
        assert pipe.replicas == (1, 2, 1)
        streams = [pipe.add(f"r{i}", 3) for i in range(20)]
        assert [s.collect(timeout=10) for s in streams] == [[2, 1, 0]] * 20
        added = pipe.call_utility("mid", "added")  # a pool without replica=: one per replica
        assert len(added) == 2
        assert sum(added) == 20
        assert min(added) > 0  # both replicas saw some
        pids = pipe.call_utility("mid", "pid")
        assert len(set(pids)) == 2
        assert pipe.call_utility("mid", "pid", replica=1) == pids[1]
        stats = pipe.stats()
        assert list(stats) == [COUNTDOWN, "mid[0]", "mid[1]", RELAY]
        assert all(isinstance(s, StageStatistics) for s in stats.values())
        assert list(pipe.health()) == list(stats)
        # Every credit came back, on each link: nothing in flight on any edge.
        for key in (COUNTDOWN, "mid[0]", "mid[1]"):
            assert wait_until(lambda k=key: pipe.stats()[k].engine.get("edge_in_flight") == 0, 10)
        assert pipe.in_flight == 0

    @pytest.mark.parametrize(
        "replicas",
        [(1, 2, 3), (2, 1, 2), (3, 2, 1)],
        ids=["mid-and-last", "first-and-last", "first-and-mid"],
    )
    def test_outputs_stay_in_order_and_complete_through_pools(
        self, launch: Any, replicas: tuple[int, int, int]
    ) -> None:
        first, mid, last = replicas
        pipe = launch(
            [
                PipelineStage(COUNTDOWN, replicas=first),
                PipelineStage(RELAY, name="mid", replicas=mid, window=3),
                PipelineStage(RELAY, name="last", replicas=last),
            ],
            max_in_flight=16,
        )
        streams = pipe.add_many([(f"a{i}", 6) for i in range(12)])  # a burst, split over replicas
        streams += [pipe.add(f"b{i}", 6) for i in range(12)]
        for stream in streams:
            assert stream.collect(timeout=20) == [5, 4, 3, 2, 1, 0]
        assert pipe.in_flight == 0
        if last > 1:
            assert min(pipe.call_utility("last", "added")) > 0

    def test_a_retry_into_a_pool_replays_on_the_request_s_replica(self, launch: Any) -> None:
        pipe = launch(
            [
                PipelineStage(COUNTDOWN, on_next_error=Retry(2)),
                PipelineStage(FLAKY, {"fail_first": 1}, name="flaky", replicas=2),
            ]
        )
        streams = [pipe.add(f"r{i}", 3) for i in range(6)]
        assert [s.collect(timeout=10) for s in streams] == [[2, 1, 0]] * 6
        assert pipe.in_flight == 0
        # Each request failed its first attempt: one replay each, whose fence (an abort on
        # the wire) its replica counts in its loop's aborts (observability.md).
        stats = pipe.stats()
        assert sum(stats[f"flaky[{r}]"].loop.aborts for r in (0, 1)) == 6

    @pytest.mark.parametrize("bad", [0, -1])
    def test_replicas_below_one_are_a_value_error(self, bad: int) -> None:
        with pytest.raises(ValueError, match="replicas must be an int >= 1"):
            PipelineStage(RELAY, replicas=bad)

    @pytest.mark.parametrize("bad", [1.5, True, "2", None])
    def test_replicas_not_an_int_are_a_type_error(self, bad: Any) -> None:
        with pytest.raises(TypeError, match="replicas must be an int >= 1"):
            PipelineStage(RELAY, replicas=bad)

    def test_a_pool_that_fails_to_start_leaves_nothing_behind(self, launch: Any) -> None:
        # The last stage's replicas start first; then the pool's first replica fails: every
        # process started is shut down (the conftest checks that none is left).
        with pytest.raises(StageStartupError, match="on purpose"):
            launch(
                [
                    COUNTDOWN,
                    PipelineStage(f"{T}:failing_factory", replicas=2),
                    PipelineStage(RELAY, replicas=2),
                ]
            )

    def test_a_replica_it_does_not_have_is_an_index_error(self, launch: Any) -> None:
        pipe = launch([COUNTDOWN, PipelineStage(RELAY, name="mid", replicas=2)])
        with pytest.raises(IndexError):
            pipe.call_utility("mid", "pid", replica=2)


class TestCredits:
    def test_each_link_into_a_pool_has_its_own_window_and_credit(self, launch: Any) -> None:
        # Each replica of the slow pool takes every input at once but sends out one a step
        # (pending_inputs() holds the credit of its backlog): the producer's link to each
        # replica stays within its window, and each replica gives its own credit back.
        pipe = launch(
            [
                PipelineStage(COUNTDOWN, name="fast", window=8),
                PipelineStage(RELAY, {"step_s": 0.002, "per_step": 1}, name="slow", replicas=2),
            ]
        )
        streams = [pipe.add("a", 200), pipe.add("b", 200)]
        assert {pipe._core.route("a")[1], pipe._core.route("b")[1]} == {0, 1}
        most = 0
        for stream in streams:
            for i, payload in enumerate(stream):
                assert payload == 199 - i
                if i % 5 == 0:  # the engine's stats are {} until the loop's first sample
                    most = max(most, pipe.stats()["fast"].engine.get("edge_in_flight", 0))
        assert 0 < most <= 2 * 9  # two links, each at most its window and one step's
        assert wait_until(lambda: pipe.stats()["fast"].engine.get("edge_waits", 0) > 0, 10)
        assert pipe.call_utility("slow", "added") == [1, 1]
        assert wait_until(lambda: pipe.stats()["fast"].engine.get("edge_in_flight") == 0, 10)


class TestAbort:
    def test_an_abort_reaches_the_replica_that_holds_the_request(self, launch: Any) -> None:
        pipe = launch([COUNTDOWN, PipelineStage(RELAY, name="held", replicas=2)])
        pipe.call_utility("held", "hold", True)  # every replica
        streams = {rid: pipe.add(rid, 2) for rid in ("x", "y", "z")}
        assert wait_until(lambda: sum(pipe.call_utility("held", "num_requests")) == 3, 10)
        route = pipe._core.route("y")
        pipe.abort(["y"])
        assert streams["y"].collect(timeout=10) == []
        assert streams["y"].aborted
        held = pipe.call_utility("held", "num_requests", replica=route[1])
        others = pipe.call_utility("held", "num_requests", replica=1 - route[1])
        assert held + others == 2  # only y left, from the replica it was on
        pipe.call_utility("held", "hold", False)
        assert streams["x"].collect(timeout=10) == [1, 0]
        assert streams["z"].collect(timeout=10) == [1, 0]
        assert pipe.in_flight == 0


class TestABurstSplitOverReplicas:
    def test_a_burst_whose_second_send_fails_leaves_nothing_running(self, launch: Any) -> None:
        # add_many is all or nothing. A burst split over the first stage's replicas goes as
        # one frame per replica: when the second was refused (its replica's client drains),
        # every stream ended with the refusal, but the part already sent to the first
        # replica was forgotten, not aborted: it ran there, its outputs going nowhere.
        pipe = launch([PipelineStage(RELAY, name="first", replicas=2), RELAY])
        pipe.call_utility("first", "hold", True)  # every replica: its requests stay there
        pipe.add_many([("long0", 1), ("long1", 1)])
        assert [pipe._core.route(f"long{i}")[0] for i in range(2)] == [0, 1]
        assert wait_until(lambda: sum(pipe.call_utility("first", "num_requests")) == 2, 10)
        client = pipe.client("first", replica=1)
        draining = shutdown_in_background(pipe, client, drain=30)
        try:
            assert wait_until(lambda: client.closed, 10)  # its drain has begun (long1 holds it)
            # Loads 1 and 1, replica 0's turn: "a" goes to replica 0, "b" to replica 1.
            burst = pipe.add_many([("a", 1), ("b", 1)])
            for stream in burst:
                with pytest.raises(PipelineRequestError, match="the stage is draining") as info:
                    stream.collect(timeout=10)
                assert info.value.stage == "first"
            assert pipe.call_utility("first", "added", replica=0) == 2  # "a" reached it
            # ... and is aborted there: only long0 is left, and the pipeline holds only
            # the two long requests once the abort is answered.
            held = pipe.call_utility
            assert wait_until(lambda: held("first", "num_requests", replica=0) == 1, 10)
            assert wait_until(lambda: pipe.in_flight == 2, 10)
        finally:
            pipe.abort(["long0", "long1"])
            assert draining.result(30) == 0
        assert wait_until(lambda: pipe.in_flight == 0, 10)


class TestReplicaDeath:
    def test_a_killed_replica_ends_only_its_requests_and_the_pool_goes_on(
        self, launch: Any
    ) -> None:
        pipe = launch(
            [
                PipelineStage(DEVICE, {"step_s": 0.005}, name="first"),
                PipelineStage(RELAY, name="mid", replicas=2),
                PipelineStage(RELAY, name="last"),
            ]
        )
        streams = {f"r{i}": pipe.add(f"r{i}", 10**6) for i in range(12)}
        for stream in streams.values():
            stream.get(timeout=10)
        on = {rid: pipe._core.route(rid)[1] for rid in streams}
        assert set(on.values()) == {0, 1}
        pid = pipe.call_utility("mid", "pid", replica=0)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        for rid, stream in streams.items():
            if on[rid] != 0:
                continue
            with pytest.raises(PipelineStageDeadError) as info:
                stream.collect(timeout=5)
            assert info.value.stage == "mid"
            assert info.value.replica == 0
            assert "replica 0" in str(info.value)
            assert "SIGKILL" in str(info.value)
        assert time.monotonic() - killed_at < 5  # within a second, on a quiet machine
        # The requests on replica 1 go on; new ones go to replica 1 and succeed.
        survivors = [rid for rid in streams if on[rid] == 1]
        for rid in survivors:
            assert not streams[rid].finished
            streams[rid].get(timeout=10)
        later = [pipe.add(f"later{i}", 3) for i in range(4)]
        assert [s.collect(timeout=10) for s in later] == [[2, 1, 0]] * 4
        pipe.abort(survivors)
        for rid in survivors:
            streams[rid].collect(timeout=10)
            assert streams[rid].aborted
        assert wait_until(lambda: pipe.in_flight == 0, 10)
        # The stages still running dropped the dead replica's requests too.
        assert wait_until(lambda: pipe.call_utility("first", "num_requests") == 0, 10)
        assert wait_until(lambda: pipe.call_utility("last", "num_requests") == 0, 10)
        stats = pipe.stats()
        assert isinstance(stats["mid[0]"], EngineDeadError)
        assert isinstance(stats["mid[1]"], StageStatistics)
        health = pipe.health()
        assert (health["mid[0]"], health["mid[1]"]) == (StageHealth.DEAD, StageHealth.OK)

    def test_the_abort_after_a_death_is_tagged_and_frees_the_id_once_answered(
        self, launch: Any
    ) -> None:
        # docs/wire.md section 8, "Tagged aborts": every stage says "tags" in its welcome;
        # a replica's death aborts its requests from the stage after it with a tag, which
        # that stage answers with: only then is the id free (an untagged answer would keep
        # it in the pipeline for good), and it can be added again. (The race the tag closes,
        # an id freed by the answer to the first abort's copy, is test_pipeline_core's.)
        pipe = launch(
            [
                COUNTDOWN,
                PipelineStage(RELAY, name="mid", replicas=2),
                PipelineStage(RELAY, name="last"),
            ]
        )
        assert all(all(row) for row in pipe._core._tagging)  # from their welcomes
        pipe.call_utility("mid", "hold", True)
        stream = pipe.add("r", 3)
        route = pipe._core.route("r")
        assert wait_until(
            lambda: pipe.call_utility("mid", "num_requests", replica=route[1]) == 1, 10
        )
        os.kill(pipe.call_utility("mid", "pid", replica=route[1]), signal.SIGKILL)
        with pytest.raises(PipelineStageDeadError):
            stream.collect(timeout=10)
        assert wait_until(lambda: pipe.in_flight == 0, 10)  # last answered the tagged abort
        assert pipe.stats()["last"].loop.aborts == 1  # counted as the abort it is
        pipe.call_utility("mid", "hold", False, replica=1 - route[1])
        assert pipe.add("r", 3).collect(timeout=10) == [2, 1, 0]
        assert wait_until(lambda: pipe.call_utility("last", "num_requests") == 0, 10)

    def test_requests_added_right_after_a_replica_exits_are_routed_around_it(
        self, launch: Any
    ) -> None:
        # Once the replica's process has exited (its client saw the exit), no new request
        # is routed to it, as a StagePool does: not for the exit's grace (the client reads
        # the dead process's last frames before it reports the death), where each request
        # routed there would end with its PipelineStageDeadError.
        pipe = launch([COUNTDOWN, PipelineStage(RELAY, name="mid", replicas=2), RELAY])
        os.kill(pipe.call_utility("mid", "pid", replica=0), signal.SIGKILL)
        session = pipe.client("mid", 0)._session
        assert wait_until(lambda: session.exited, 10)
        streams = [pipe.add(f"r{i}", 3) for i in range(8)]
        assert [s.collect(timeout=10) for s in streams] == [[2, 1, 0]] * 8
        assert wait_until(lambda: pipe.health()["mid[0]"] == StageHealth.DEAD, 10)
        later = [pipe.add(f"later{i}", 3) for i in range(4)]  # after the death: as before
        assert [s.collect(timeout=10) for s in later] == [[2, 1, 0]] * 4

    def test_when_every_replica_is_dead_the_stage_is_dead(self, launch: Any) -> None:
        pipe = launch(
            [
                PipelineStage(DEVICE, {"step_s": 0.005}, name="first"),
                PipelineStage(RELAY, name="mid", replicas=2),
            ]
        )
        streams = [pipe.add(f"r{i}", 10**6) for i in range(6)]
        for stream in streams:
            stream.get(timeout=10)
        for pid in pipe.call_utility("mid", "pid"):
            os.kill(pid, signal.SIGKILL)
        for stream in streams:
            with pytest.raises(PipelineStageDeadError) as info:
                stream.collect(timeout=5)
            assert info.value.stage == "mid"
        assert wait_until(
            lambda: pipe.health()["mid[0]"] == pipe.health()["mid[1]"] == StageHealth.DEAD, 10
        )
        with pytest.raises(PipelineStageDeadError):
            pipe.add("later", 1)
        assert pipe.in_flight == 0


@pytest.mark.skipif(not _shm.available(), reason="needs /dev/shm (Linux)")
class TestSharedMemory:
    def test_big_arrays_cross_pools_through_per_link_slots_and_a_dead_replica_s_go(
        self, launch: Any
    ) -> None:
        pipe = launch(
            [
                PipelineStage(COUNTDOWN, name="a", edge=f"{T}:to_array"),
                PipelineStage(RELAY, name="b", replicas=2),
                PipelineStage(RELAY, name="c", replicas=2),
            ]
        )
        streams = [pipe.add(f"r{i}", 4) for i in range(8)]
        for stream in streams:
            outputs = stream.collect(timeout=30)
            assert [float(x[0]) for x in outputs] == [3.0, 2.0, 1.0, 0.0]
            assert all(bool(np.all(x == x[0])) for x in outputs)

        def total(keys: tuple[str, ...], what: str) -> int:
            stats = pipe.stats()
            return sum(int(stats[key].engine.get(what, 0)) for key in keys)

        # The engines' numbers are each loop's last sample (taken when it goes idle): wait.
        assert wait_until(lambda: total(("a",), "shm_sent") == 32, 10)
        assert wait_until(lambda: total(("b[0]", "b[1]"), "shm_sent") == 32, 10)
        assert wait_until(lambda: total(("c[0]", "c[1]"), "shm_taken") == 32, 10)
        prefix = pipe._shm_prefix
        names = [n.removeprefix(prefix) for n in _shm.segments(prefix)]
        # Per link: <stage>-<consumer replica>-<producer replica>-<n>.
        assert {n.rsplit("-", 1)[0] for n in names} >= {"0-0-0", "0-1-0"}
        assert all(re.fullmatch(r"(0-[01]-0|1-[01]-[01])-\d+", n) for n in names), names
        os.kill(pipe.call_utility("b", "pid", replica=0), signal.SIGKILL)

        def b0_slots() -> list[str]:
            own = [n for n in _shm.segments(prefix + "1-") if n.split("-")[-2] == "0"]
            return _shm.segments(prefix + "0-0-") + own

        assert wait_until(lambda: not b0_slots(), 5)  # its slots, and a's for it
        later = [pipe.add(f"later{i}", 2) for i in range(4)]  # on b[1], through its slots
        for stream in later:
            assert [float(x[0]) for x in stream.collect(timeout=30)] == [1.0, 0.0]
        assert wait_until(lambda: total(("b[1]",), "shm_sent") >= 8, 10)
        pipe.shutdown()
        assert _shm.segments(prefix) == []


# -- the coordinator's routing, against a model ------------------------------------------------


def _route(core: PipelineCore[StreamCore], rid: str) -> tuple[int, ...]:
    """*rid*'s route; ``(-1, -1, -1)`` once it has left the pipeline."""
    return core.route(rid) or (-1, -1, -1)


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("open"), st.integers(1, 3)),
        st.tuples(st.just("done"), st.integers(0, 50)),
        st.tuples(st.just("kill"), st.integers(0, 2), st.integers(0, 2)),
        st.tuples(st.just("stray"), st.integers(0, 50)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(_ops)
def test_routes_pick_the_least_loaded_live_replica_and_the_counts_match(ops: list[Any]) -> None:
    """Per stage, a new request's replica is a live one with the fewest requests routed
    there (the coordinator's count); the count is the requests in the pipeline on that
    replica, through finishes and replica deaths; a dead replica's requests end with its
    error, naming the replica, and the pipeline fails only with a stage's last replica.
    Events of a request from a replica off its route are dropped (a payload, an end, an
    abort's confirmation), and an abort goes along the route."""
    replicas = (1, 3, 2)
    core: PipelineCore[StreamCore] = PipelineCore(["a", "b", "c"], replicas=replicas)
    alive = [[True] * r for r in replicas]
    streams: dict[str, StreamCore] = {}
    seq = 0
    for op in ops:
        d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
        if core.failure is not None:
            break
        if op[0] == "open":
            for _ in range(op[1]):
                rid = f"r{seq}"
                seq += 1
                loads = [core.load(k) for k in range(3)]
                stream = StreamCore(rid)
                core.open(rid, stream)
                streams[rid] = stream
                route = core.route(rid)
                assert route is not None
                for k, r in enumerate(route):
                    assert alive[k][r]
                    live = [loads[k][j] for j in range(replicas[k]) if alive[k][j]]
                    assert loads[k][r] == min(live)
        elif op[0] == "done":
            ids = [rid for rid in streams if core.state(rid) is not None]
            if not ids:
                continue
            rid = ids[op[1] % len(ids)]
            route = core.route(rid)
            assert route is not None
            # One report from the last stage: ended here, every stage before ended it.
            core.outputs(2, [rid], [True], [5], 1.0, d, route[2])
            assert core.state(rid) is None
            assert streams[rid]._ended is not None
        elif op[0] in ("stray", "abort"):
            ids = [rid for rid in streams if core.state(rid) is RequestState.LIVE]
            if not ids:
                continue
            rid = ids[op[1] % len(ids)]
            route = _route(core, rid)
            if alive[2][1 - route[2]]:  # the last stage's other replica, if it lives
                before = len(streams[rid]._buf)
                core.outputs(2, [rid], [False], ["x"], 1.0, d, 1 - route[2])
                core.outputs(2, [rid], [True], [5], 1.0, d, 1 - route[2])  # an end: not its
                assert len(streams[rid]._buf) == before
                assert core.state(rid) is RequestState.LIVE
            if op[0] == "abort":
                core.abort([rid], d)
                assert d.routes[rid] == route  # the abort goes along the route
                for j in range(3):
                    if replicas[j] > 1:  # a confirmation from off the route is not one
                        core.aborted(j, [rid], 1.0, d, (route[j] + 1) % replicas[j])
                        assert core.state(rid) is RequestState.ABORTING
                for j in range(3):
                    core.aborted(j, [rid], 1.0, d, route[j])
                assert core.state(rid) is None
                assert streams[rid]._ended is not None
        else:
            k, r = op[1], op[2] % replicas[op[1]]
            on = [rid for rid in streams if _route(core, rid)[k] == r]
            was = alive[k][r]
            alive[k][r] = False
            core.replica_dead(k, r, _Dead("killed"), 1.0, d)
            if not any(alive[k]):
                assert core.failure is not None
                break
            for rid in on if was else []:
                end = streams[rid]._ended
                assert end is not None
                assert isinstance(end.exc, PipelineStageDeadError)
                assert (end.exc.stage, end.exc.replica) == (["a", "b", "c"][k], r)
                # Its abort goes on from the stage after the dead replica; the dead one
                # counts as having applied it; the others confirm it.
                route = _route(core, rid)
                for j in range(3):
                    if j != k:
                        core.aborted(j, [rid], 1.0, d, route[j])
                assert core.state(rid) is None
        # The coordinator's counts: the requests in the pipeline on each replica.
        for k in range(3):
            counts = [0] * replicas[k]
            for rid in streams:
                if core.state(rid) is not None:
                    counts[_route(core, rid)[k]] += 1
            assert core.load(k) == counts
