"""Stage pipelines against their documented promises (``docs/pipelines.md``): what a
black-box audit of :class:`~enginecore.stage.Pipeline` and
:class:`~enginecore.stage.AsyncPipeline` found, each with real stage processes, both forms
(``[sync]``, ``[async]``)."""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from enginecore.stage import (
    AsyncPipeline,
    PipelineRequestError,
    PipelineStage,
    PipelineStageDeadError,
    RestartPolicy,
    Retry,
    StageClient,
    StageHealth,
    StageStatistics,
    UtilityError,
)

from .conftest import wait_until
from .pipelines import BlockingAsyncPipeline, Launch, launcher, shutdown_in_background

COUNTDOWN = "enginecore:CountdownEngine"
RELAY = "enginecore.stage.testing:relay"
T = "enginecore.stage.testing"

pytestmark = pytest.mark.slow


@pytest.fixture(params=["sync", "async"])
def launch(request: pytest.FixtureRequest, no_leftovers: str) -> Iterator[Launch]:
    """``launch(stages, **kwargs)``: either pipeline; each is shut down after the test."""
    with launcher(request.param) as launch_:
        yield launch_


class TestStageArgumentsAsAClients:
    """``PipelineStage(factory, kwargs)`` takes them "as for ``StageClient.launch``": a
    factory that is not ``pkg.module:factory`` and kwargs that cannot cross the wire are
    that launch's :class:`ValueError` / :class:`TypeError`, with its message, before any
    process of the pipeline starts (the stages start last to first: the first stage's
    mistake was found only after the others had started, in its child, as a
    ``StageStartupError``, or as a ``TypeError`` naming the wrapper's
    ``kwargs['kwargs']``)."""

    @pytest.mark.parametrize(
        ("factory", "kwargs", "error", "message"),
        [
            ("nocolon", None, ValueError, "engine factory must look like 'pkg.module:factory'"),
            ("", None, ValueError, "engine factory must look like 'pkg.module:factory'"),
            (RELAY, {"x": object()}, TypeError, "factory kwargs['x']: builtins.object"),
            (RELAY, {1: 2}, TypeError, "factory kwargs must have str keys"),
        ],
    )
    def test_a_bad_factory_or_kwargs_fails_before_any_process_starts(
        self,
        launch: Launch,
        factory: str,
        kwargs: Any,
        error: type[Exception],
        message: str,
    ) -> None:
        with pytest.raises(error) as client_error:
            StageClient.launch(factory, kwargs)
        assert message in str(client_error.value)
        # The last stage, started first, makes the file (outside the checked dir).
        marker = f"/tmp/ecA-{os.getpid()}-{time.monotonic_ns()}"
        last = PipelineStage(f"{T}:relay_once", {"marker": marker})
        try:
            with pytest.raises(error) as pipe_error:
                launch([PipelineStage(factory, kwargs), last])
            assert str(pipe_error.value) == str(client_error.value)
            assert not os.path.exists(marker)  # no process started
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(marker)


def _shut_down_client(pipe: Any, stage: str) -> None:
    """``pipe.client(stage).shutdown()``, on the pipeline's event loop for the async form."""
    client = pipe.client(stage)
    if isinstance(pipe, BlockingAsyncPipeline):
        pipe._runner.run(client.shutdown())
    else:
        client.shutdown()


class TestAStageStoppedThroughItsClient:
    """``pipe.client(stage)`` is the stage's client, "for what the pipeline does not wrap".
    A stage stopped through it (its ``shutdown()``) is gone for the pipeline as a stage
    that exited on its own is: its requests end with ``PipelineStageDeadError`` naming it,
    and later adds raise it. Its clean end was taken for nothing: its requests waited
    forever, and the pipeline took new ones that could never end."""

    def test_its_requests_end_and_later_adds_raise(self, launch: Launch) -> None:
        pipe = launch([COUNTDOWN, PipelineStage(RELAY, name="mid"), RELAY])
        stream = pipe.add("long", 10**9)
        assert stream.get(timeout=10) == 10**9 - 1  # through every stage
        _shut_down_client(pipe, "mid")
        with pytest.raises(PipelineStageDeadError) as info:
            stream.collect(timeout=10)
        assert info.value.stage == "mid"
        with pytest.raises(PipelineStageDeadError, match="mid"):
            pipe.add("later", 1)
        assert pipe.in_flight == 0

    @pytest.mark.parametrize("stage", ["first", "mid"])
    def test_an_add_while_its_client_drains_is_refused_by_that_stage(
        self, launch: Launch, stage: str
    ) -> None:
        # While pipe.client(stage).shutdown(drain=) drained the first stage, pipe.add raised
        # the client's bare StageClosedError ("this stage client is closed"); a later
        # stage's refusal ends the stream with PipelineRequestError naming it. Both now.
        pipe = launch(
            [PipelineStage(COUNTDOWN, name="first"), PipelineStage(RELAY, name="mid"), RELAY]
        )
        stream = pipe.add("long", 10**9)
        assert stream.get(timeout=10) == 10**9 - 1  # live in every stage: the drain waits
        client = pipe.client(stage)
        draining = shutdown_in_background(pipe, client, drain=30)
        try:
            assert wait_until(lambda: client.closed, 10)  # its drain has begun
            # ...and the stage has read its drain: its input side answers stats() in the
            # order it reads frames. (Without it, under load, "late" reached "mid" from the
            # first stage, on another connection, before the parent's drain did: admitted.)
            if isinstance(pipe, BlockingAsyncPipeline):
                pipe._runner.run(client.stats())
            else:
                client.stats()
            late = pipe.add("late", 1)
            with pytest.raises(PipelineRequestError, match="the stage is draining") as info:
                late.collect(timeout=10)
            assert info.value.stage == stage
            assert info.value.req_id == "late"
        finally:
            pipe.abort(["long"])
            assert draining.result(30) == 0
        with contextlib.suppress(PipelineStageDeadError):  # aborted, or the stage gone first
            stream.collect(timeout=10)
        with pytest.raises(PipelineStageDeadError, match=stage):
            pipe.add("later", 1)
        assert pipe.in_flight == 0


# The calls a pipeline's own client of a stage refuses, and the pipeline call that does it.
REFUSED = [
    ("add", ("x", 1), "pipe.add"),
    ("add_many", ([("x", 1)],), "pipe.add_many"),
    ("abort", (["long"],), "pipe.abort"),
    ("get_event", (1.0,), "streams"),
    ("get_events", (1.0,), "streams"),
    ("events", (), "streams"),
]


def _client_call(pipe: Any, client: Any, name: str, *args: Any) -> Any:
    """``client.name(*args)``; for the async form on the pipeline's event loop, awaited when
    it answers an awaitable (``events()`` answers an async iterator: only called)."""
    if not isinstance(pipe, BlockingAsyncPipeline):
        return getattr(client, name)(*args)

    async def call() -> Any:
        result = getattr(client, name)(*args)
        return await result if inspect.isawaitable(result) else result

    return pipe._runner.run(call())


def _processes(pipe: Any) -> list[tuple[str, int]]:
    """Every process of *pipe*: (stage, replica)."""
    return [(s, r) for s, n in zip(pipe.stages, pipe.replicas, strict=True) for r in range(n)]


class TestThePipelinesClientOfAStage:
    """``pipe.client(stage)`` is the pipeline's own client of the stage: it takes every
    event of the stage and keeps no stream of its own. Its request and event calls could
    only bypass the pipeline and hang: an ``add`` returned a stream that never got anything,
    an ``abort`` of a pipeline request in a later stage left its pipeline stream waiting and
    its place in the budget held, and ``get_event(s)``/``events()`` never returned. They
    raise :class:`RuntimeError` at once, saying what to use instead, on every process of
    the pipeline (a replica pool's too, and one started again), in both forms; the calls
    the docs present it for go on."""

    @pytest.mark.parametrize(("name", "args", "instead"), REFUSED, ids=[r[0] for r in REFUSED])
    def test_request_and_event_calls_raise_at_once(
        self, launch: Launch, name: str, args: tuple[Any, ...], instead: str
    ) -> None:
        pipe = launch(
            [
                PipelineStage(COUNTDOWN, name="first"),
                PipelineStage(RELAY, name="mid", replicas=2),
                PipelineStage(RELAY, name="last"),
            ]
        )
        stream = pipe.add("long", 10**9)
        assert stream.get(timeout=10) == 10**9 - 1  # through every stage
        for stage, replica in _processes(pipe):
            client = pipe.client(stage, replica)
            key = f"{stage}[{replica}]" if stage == "mid" else stage
            with pytest.raises(RuntimeError, match=f"pipeline stage '{re.escape(key)}'") as info:
                _client_call(pipe, client, name, *args)
            assert f"{name}()" in str(info.value)
            assert instead in str(info.value)
        # Nothing reached the stages, nor the pipeline's accounting: its request goes on,
        # ends by its abort, and the pipeline serves new ones.
        assert stream.get(timeout=10) == 10**9 - 2
        assert pipe.in_flight == 1
        pipe.abort(["long"])
        stream.collect(timeout=10)
        assert stream.aborted
        assert pipe.add("after", 3).collect(timeout=10) == [2, 1, 0]
        assert wait_until(lambda: pipe.in_flight == 0, 10)
        for stage in pipe.stages:
            assert wait_until(lambda s=stage: _live(pipe, s) == 0, 10)

    def test_what_it_is_for_still_works(self, launch: Launch) -> None:
        pipe = launch(
            [
                PipelineStage(COUNTDOWN, name="first"),
                PipelineStage(RELAY, name="mid", replicas=2),
            ]
        )
        stream = pipe.add("long", 10**9)
        assert stream.get(timeout=10) == 10**9 - 1
        live = dict.fromkeys(pipe.stages, 0)
        for stage, replica in _processes(pipe):
            client = pipe.client(stage, replica)
            live[stage] += _client_call(pipe, client, "call_utility", "num_requests")
            assert isinstance(_client_call(pipe, client, "stats"), StageStatistics)
            assert client.health() == StageHealth.OK
            load = client.load()
            assert load is None or load.live >= 0
            assert client.address
            assert client.exit_code is None
            assert not client.closed
            assert "tags" in client.features
        assert live == {"first": 1, "mid": 1}  # "long" is in each stage, on one replica
        pipe.abort(["long"])
        stream.collect(timeout=10)
        assert pipe.add("after", 2).collect(timeout=10) == [1, 0]

    def test_a_restarted_stages_new_client_refuses_them_too(self, launch: Launch) -> None:
        policy = RestartPolicy(first_delay=0.05, max_delay=0.05)
        pipe = launch([COUNTDOWN, PipelineStage(RELAY, name="mid", restart=policy)])
        old = pipe.client("mid")
        os.kill(old.pid, signal.SIGKILL)
        assert wait_until(lambda: pipe.restarts["mid"] == 1, 30)
        assert wait_until(lambda: pipe.health()["mid"] == StageHealth.OK, 30)
        new = pipe.client("mid")
        assert new is not old
        with pytest.raises(RuntimeError, match=r"use pipe\.add\("):
            _client_call(pipe, new, "add", "x", 1)
        assert pipe.add("r", 2).collect(timeout=10) == [1, 0]


def _live(pipe: Any, stage: str) -> int:
    """The live requests of every process of *stage*."""
    answer = pipe.call_utility(stage, "num_requests")
    return sum(answer) if isinstance(answer, list) else int(answer)


class TestAPoolStagesUtilityErrorIsTheFirstReplicas:
    """``pipe.call_utility(pool_stage, ...)`` answers "a list of their answers, in replica
    order (the first error raises)": the first replica's error in that order, in both forms.
    The async form raised whichever error came first in time (``asyncio.gather``): a dead
    replica 1's ``EngineDeadError``, at once, before replica 0's answer, where the blocking
    form raised replica 0's ``UtilityError``."""

    def test_replica_0s_error_raises_before_a_dead_replica_1s(self, launch: Launch) -> None:
        pipe = launch([COUNTDOWN, PipelineStage(RELAY, name="mid", replicas=2)])
        os.kill(pipe.call_utility("mid", "pid", replica=1), signal.SIGKILL)
        assert wait_until(lambda: pipe.health()["mid[1]"] == StageHealth.DEAD, 10)
        with pytest.raises(UtilityError, match="no utility 'nope'"):
            pipe.call_utility("mid", "nope")
        assert pipe.call_utility("mid", "echo", 1, replica=0) == [1]  # replica 0 goes on


def _waiting_for_room(pipe: Any) -> bool:
    """Whether an ``add`` of *pipe* waits for room in the budget now."""
    inner = getattr(pipe, "_pipe", pipe)
    if isinstance(inner, AsyncPipeline):
        return bool(inner._room_waiters)
    return bool(inner._room._waiters)  # threading.Condition's


class TestSentAtIsWhenTheRequestIsSent:
    """``stream.timings.sent_at`` is read "just before the request's frame is handed to the
    socket" (docs/observability.md), on both forms: an ``add`` that waited for room in the
    budget is sent once it has room. The blocking form read it before the wait, so its
    ``time_to_first_output`` and ``total`` counted the wait for admission too (the async
    form's did not)."""

    def test_an_add_that_waited_for_room_was_sent_after_the_wait(self, launch: Launch) -> None:
        pipe = launch([COUNTDOWN, RELAY], max_in_flight=1)
        first = pipe.add("first", 10**9)
        added: list[Any] = []
        waiter = threading.Thread(target=lambda: added.append(pipe.add("second", 2)))
        waiter.start()
        try:
            assert wait_until(lambda: _waiting_for_room(pipe), 10)
            room_made = time.monotonic()
            pipe.abort(["first"])  # its place is free only once every stage applied it
            first.collect(timeout=10)
        finally:
            waiter.join(10)
        (second,) = added
        assert second.collect(timeout=10) == [1, 0]
        assert second.timings.sent_at >= room_made


class TestRetryMaxBytesIsBoundedAsTheOtherByteOptions:
    """``Retry(n, max_bytes=...)`` travels to the stage process, as ``window_bytes`` does:
    one of 2**63 or more is a :class:`ValueError` at once, as theirs is ("below 2**63"). It
    was taken, and the launch failed after the later stages had started, with a
    ``TypeError`` about ``factory kwargs['replay_bytes']`` (a name the caller never gave)."""

    def test_max_bytes_of_2_63_is_a_value_error(self) -> None:
        with pytest.raises(ValueError, match=r"Retry max_bytes must be an int >= 1 .*2\*\*63"):
            Retry(1, max_bytes=2**63)

    def test_the_largest_max_bytes_launches_and_retries(self, launch: Launch) -> None:
        retry = Retry(1, max_bytes=2**63 - 1)
        pipe = launch([PipelineStage(COUNTDOWN, on_next_error=retry), f"{T}:flaky"])
        assert pipe.add("r", 3).collect(timeout=10) == [2, 1, 0]  # retried once


class TestALongStartupTimeout:
    """``startup_timeout`` is "a number > 0" (finite): the blocking launch waited for each
    stage's ready report with one ``poll`` of the whole timeout, which takes at most about
    24 days (an int of milliseconds), so ``startup_timeout=1e7`` raised ``OverflowError``
    ("timeout is too large") in ``Pipeline.launch`` (and ``StageClient.launch``) while
    ``AsyncPipeline.launch`` started the pipeline."""

    @pytest.mark.parametrize("seconds", [1e7, 1e300])
    def test_it_launches(self, launch: Launch, seconds: float) -> None:
        pipe = launch([COUNTDOWN, RELAY], startup_timeout=seconds)
        assert pipe.add("r", 2).collect(timeout=10) == [1, 0]

    def test_a_restart_that_waits_to_link_in_is_not_a_failed_start(
        self, launch: Launch, caplog: pytest.LogCaptureFixture
    ) -> None:
        # "c" dies holding a request while "b", the stage before it, is in a 3 s step: the
        # restart waits, up to the startup timeout, for b to apply that request's abort
        # before it links the new process in. The blocking form waited on a
        # threading.Event with the whole timeout, past threading.TIMEOUT_MAX: an
        # OverflowError, so a failed start, logged, and a second start.
        policy = RestartPolicy(first_delay=0.05, max_delay=0.05)
        slow = PipelineStage(RELAY, {"step_s": 3.0}, name="b")
        last = PipelineStage(RELAY, name="c", restart=policy)
        pipe = launch([COUNTDOWN, slow, last], startup_timeout=1e300)
        stream = pipe.add("long", 10**9)
        assert stream.get(timeout=30) == 10**9 - 1  # c holds it; b is in its next step
        os.kill(pipe.call_utility("c", "pid"), signal.SIGKILL)
        with pytest.raises(PipelineStageDeadError):
            stream.collect(timeout=10)
        assert wait_until(lambda: pipe.health()["c"] == StageHealth.OK, 30)
        assert pipe.add("r", 2).collect(timeout=30) == [1, 0]
        assert pipe.restarts["c"] == 1
        assert "linking it in failed" not in caplog.text
