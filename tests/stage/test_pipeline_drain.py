"""A pipeline's ``shutdown(drain=...)`` as the caller sees it while it drains
(``docs/pipelines.md``, "Shutdown" and "Stages"): ``health()`` and a late ``abort()``.

One suite for :class:`~enginecore.stage.Pipeline` and
:class:`~enginecore.stage.AsyncPipeline` (``[sync]``, ``[async]``), as in
``test_stage_pipeline.py``; the conftest's autouse fixture checks that nothing is left
behind."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from enginecore.stage import PipelineStage, StageClosedError, StageHealth, StageStatistics

from .conftest import wait_until
from .pipelines import Launch, launcher

RELAY = "enginecore.stage.testing:relay"
DEVICE = "enginecore.stage.testing:device"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture(params=["sync", "async"])
def launch(request: pytest.FixtureRequest, no_leftovers: str) -> Iterator[Launch]:
    """``launch(stages, **kwargs)``: either pipeline (``pipelines.launcher``); each is shut
    down after the test."""
    with launcher(request.param) as launch_:
        yield launch_


def _refuses_adds(pipe: Any) -> bool:
    """Whether *pipe*'s shutdown has begun: an add is refused (``StageClosedError``)."""
    try:
        pipe.add("late", 1).collect(timeout=10)
    except StageClosedError:
        return True
    return False


class TestHealthWhileDraining:
    def test_a_stage_still_draining_reads_ok_and_one_that_stopped_reads_dead(
        self, launch: Any
    ) -> None:
        # The first stage drains a long request: it is alive and working, and must not read
        # dead (its client, closing, says "dead"); the stages after it have not begun to
        # drain. Once the request is aborted, every drain ends, and every stage reads dead.
        first = PipelineStage(DEVICE, {"step_s": 0.005}, name="a")
        pipe = launch([first, PipelineStage(RELAY, name="b"), RELAY])
        stream = pipe.add("r", 10**6)
        stream.get(timeout=10)
        closer = threading.Thread(target=pipe.shutdown, kwargs={"drain": 40.0})
        closer.start()
        try:
            assert wait_until(lambda: _refuses_adds(pipe), 10)
            assert pipe.client("a").closed  # its drain has begun
            assert pipe.health() == {"a": "ok", "b": "ok", RELAY: "ok"}
        finally:
            pipe.abort(["r"])
        stream.collect(timeout=30)
        assert stream.aborted
        closer.join(60)
        assert not closer.is_alive()
        assert set(pipe.health().values()) == {StageHealth.DEAD}  # all stopped


class TestAbortWhileDraining:
    @pytest.mark.parametrize(
        ("stages", "replicas"), [(2, 1), (3, 1), (2, 2)], ids=["two", "three", "pool"]
    )
    def test_an_abort_reaches_a_request_held_in_a_later_stage_once_the_first_stopped(
        self, launch: Any, stages: int, replicas: int
    ) -> None:
        # r passed through a, which has drained and stopped; b holds it (its device
        # waits), and drains. The abort goes to b, the first stage still running (to r's
        # replica of it), which chases it on (to c): r ends aborted at once, and the drain
        # with it, instead of running on until r is done or the deadline.
        names = ["a", "b", "c"][:stages]
        pipe = launch(
            [PipelineStage(RELAY, name=n, replicas=replicas if n == "b" else 1) for n in names]
        )
        pipe.call_utility("b", "hold", True)  # b's steps emit nothing: r stays there

        def held() -> int:
            got = pipe.call_utility("b", "num_requests")
            return sum(got) if isinstance(got, list) else int(got)

        stream = pipe.add("r", "payload")
        assert wait_until(lambda: held() == 1, 10)
        closer = threading.Thread(target=pipe.shutdown, kwargs={"drain": 60.0})
        closer.start()
        try:
            # b drains once a has stopped (the stages drain in order).
            assert wait_until(lambda: pipe.client("b").closed, 10)
            assert pipe.health()["a"] == StageHealth.DEAD
            pipe.abort(["r"])
            assert stream.collect(timeout=10) == []
            assert stream.aborted
        finally:
            closer.join(60)
        assert not closer.is_alive()


class TestShutdownArguments:
    @pytest.mark.parametrize(
        ("bad", "error"),
        [("5", TypeError), (True, TypeError), (-1, ValueError), (float("nan"), ValueError)],
    )
    def test_a_bad_timeout_is_refused_before_anything_stops(
        self, launch: Any, bad: Any, error: type[Exception]
    ) -> None:
        # As a bad drain is: the stages' clients would each have raised it, unseen (every
        # stage's shutdown error is suppressed, so that the others stop too).
        pipe = launch([PipelineStage(DEVICE, name="a"), RELAY])
        with pytest.raises(error, match="timeout must be"):
            pipe.shutdown(bad)
        assert pipe.add("r", 3).collect(timeout=10) == [2, 1, 0]  # nothing stopped


def test_stats_and_utilities_after_shutdown_are_refused_as_a_clients(launch: Any) -> None:
    # stats() answered a dict of each stage client's "this stage client is closed", and
    # call_utility() raised a stage client's error, where a closed client's and a closed
    # pool's raise StageClosedError: the pipeline's, naming the pipeline.
    pipe = launch(["enginecore:CountdownEngine", RELAY])
    assert all(isinstance(s, StageStatistics) for s in pipe.stats().values())
    assert not pipe.closed  # as a client's and a pool's closed
    pipe.shutdown()
    assert pipe.closed
    with pytest.raises(StageClosedError, match="the pipeline was shut down"):
        pipe.stats()
    with pytest.raises(StageClosedError, match="the pipeline was shut down"):
        pipe.call_utility(pipe.stages[0], "num_requests")
    with pytest.raises(ValueError, match="timeout"):  # a bad timeout is still named first
        pipe.stats(-1.0)
