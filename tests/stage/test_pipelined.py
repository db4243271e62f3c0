"""Pipelined engines and deferred utilities in a stage (issue 9's stage part): the stage runs a
``PipelinedEngine`` at its depth with no client change, drops outputs that an engine returns
after a request's abort (and counts them), and never leaves a deferred utility's caller
hanging, not even when the stage is killed."""

from __future__ import annotations

import logging
import os
import random
import signal
import time

import pytest

from enginecore import CountdownEngine, PipelinedEngine
from enginecore.stage import (
    Aborted,
    EngineDeadError,
    Outputs,
    StageHealth,
    UtilityError,
)
from enginecore.stage._runtime import pipeline_depth_of
from enginecore.stage._stage_engine import StageEngine
from enginecore.stage.testing import PipelinedCountdownEngine

from .conftest import SCRIPTED, Launch, wait_until
from .raw import InProcessStage, RawClient

PIPELINED = "enginecore.stage.testing:pipelined"


class TestPipelinedStage:
    def test_requests_complete_through_both_clients(self, launch: Launch) -> None:
        client = launch(PIPELINED, kwargs={"depth": 3, "device_s": 0.001})
        streams = [client.add(f"r{i}", 20) for i in range(50)]
        for stream in streams:
            assert stream.collect(timeout=10) == list(range(19, -1, -1))
        assert client.call_utility("num_requests", timeout=5) == 0

    def test_no_output_after_aborted_under_random_aborts(self, launch: Launch) -> None:
        # Aborts land between launches and collects at depth 4, with the device slow enough
        # that most steps are in flight when one arrives.
        client = launch(PIPELINED, kwargs={"depth": 4, "device_s": 0.002}, ordered_events=True)
        rng = random.Random(7)
        ids = [f"r{i}" for i in range(200)]
        client.add_many([(rid, rng.randint(1, 30)) for rid in ids], streams=False)
        doomed = set(rng.sample(ids, 80))
        for rid in sorted(doomed):
            if rng.random() < 0.5:
                time.sleep(0.001)
            client.abort([rid])
        client.call_utility("num_requests", timeout=10)  # after every abort's event
        aborted_at: dict[str, int] = {}
        late = 0
        position = 0
        done: set[str] = set()
        # Every doomed id gets its aborted event, even one that finished before its abort
        # (its event may come after the other requests are all accounted for).
        while len(done | set(aborted_at)) < len(ids) or not doomed <= set(aborted_at):
            event = client.get_event(timeout=10)
            position += 1
            if isinstance(event, Aborted):
                for rid in event.req_ids:
                    aborted_at.setdefault(rid, position)
            elif isinstance(event, Outputs):
                for out_id, fin in zip(event.req_ids, event.finished, strict=True):
                    if out_id in aborted_at:
                        late += 1
                    elif fin and out_id is not None:
                        done.add(out_id)
        assert late == 0
        assert set(aborted_at) == doomed
        assert set(ids) - doomed <= done  # (some doomed ones finished before their abort)

    def test_outputs_after_an_abort_are_dropped_and_counted(
        self, no_leftovers: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        # An engine that breaks the contract: its steps in flight keep the aborted
        # request's outputs. The stage drops them; the client never sees one.
        caplog.set_level(logging.WARNING, logger="enginecore")
        engine = PipelinedCountdownEngine(4, device_s=0.02, exact_abort=False)
        stage = InProcessStage(engine, no_leftovers)
        try:
            with RawClient(stage.address) as client:
                assert client.hello()[0] == "welcome"
                client.send("add", "r", 10_000)
                client.until(lambda ev: ev[0] == "outputs")
                client.send("abort", ["r"])
                events = client.until(lambda ev: ev[0] == "aborted")
                after = client.call(1, "num_requests")
        finally:
            stage.stop()
        assert [ev for ev in after if ev[0] == "outputs"] == []
        stage_engine = stage.runtime.loop._engine
        assert isinstance(stage_engine, StageEngine)
        assert stage_engine.stale.count > 0
        assert any("outputs of aborted requests" in r.getMessage() for r in caplog.records)
        assert events[-1] == ["aborted", ["r"]]

    def test_a_drain_lets_the_steps_in_flight_finish(self, launch: Launch) -> None:
        client = launch(PIPELINED, kwargs={"depth": 3, "device_s": 0.002})
        streams = [client.add(f"r{i}", 30) for i in range(20)]
        assert streams[0].get(5) == 29
        assert client.shutdown(drain=30) == 0
        for stream in streams:
            assert stream.collect(timeout=5)[-1] == 0

    def test_a_stalled_collect_is_seen_by_the_watchdog(self, launch: Launch) -> None:
        client = launch(PIPELINED, kwargs={"depth": 2, "device_s": 0.5}, step_timeout=0.1)
        stream = client.add("r", 2)
        assert wait_until(lambda: client.health() == StageHealth.STALLED, 5)
        assert stream.collect(timeout=10) == [1, 0]
        assert wait_until(lambda: client.health() == StageHealth.OK, 5)

    def test_depth_comes_from_the_engine(self) -> None:
        assert pipeline_depth_of(CountdownEngine()) == 1
        assert pipeline_depth_of(PipelinedCountdownEngine(5)) == 5
        engine = PipelinedCountdownEngine()
        del engine.pipeline_depth
        assert isinstance(engine, PipelinedEngine)
        assert pipeline_depth_of(engine) == 2
        engine.pipeline_depth = 0
        with pytest.raises(ValueError, match="pipeline_depth must be >= 1"):
            pipeline_depth_of(engine)
        engine.pipeline_depth = "2"  # type: ignore[assignment]
        with pytest.raises(TypeError, match="pipeline_depth must be an int"):
            pipeline_depth_of(engine)


class TestDeferredUtilities:
    def test_the_loop_goes_on_while_a_deferred_call_waits(self, launch: Launch) -> None:
        client = launch(SCRIPTED)
        pending = client.call_utility_future("deferred", 0.5, "later")
        # Meanwhile the loop steps and answers other calls.
        assert client.add("r", 100).collect(timeout=5)[-1] == 0
        assert client.call_utility("echo", 1, timeout=5) == [1]
        assert not pending.done()
        assert pending.result(5) == "later"

    def test_many_concurrent_deferred_calls_are_all_answered(self, launch: Launch) -> None:
        client = launch(SCRIPTED)
        futures = [client.call_utility_future("deferred", 0.01 * (i % 10), i) for i in range(2000)]
        assert [f.result(30) for f in futures] == list(range(2000))

    def test_a_pending_deferred_call_fails_at_shutdown(self, launch: Launch) -> None:
        client = launch(SCRIPTED)
        pending = client.call_utility_future("deferred_never")
        assert client.call_utility("echo", 1, timeout=5) == [1]  # it was applied
        assert client.shutdown() == 0
        # Answered by the loop, before its shutdown event: an error, not a hang, and not
        # the client's own StageClosedError.
        with pytest.raises(UtilityError, match="LoopEndedError"):
            pending.result(5)

    def test_sigkill_fails_every_deferred_waiter_within_a_second(self, launch: Launch) -> None:
        client = launch(SCRIPTED)
        pending = [client.call_utility_future("deferred_never") for _ in range(20)]
        assert client.call_utility("echo", 1, timeout=5) == [1]  # all applied, all pending
        killed_at = time.monotonic()
        os.kill(client.pid, signal.SIGKILL)
        for future in pending:
            with pytest.raises(EngineDeadError, match="SIGKILL"):
                future.result(5)
        assert time.monotonic() - killed_at < 1.0
