"""Restarting a dead pipeline stage process (``docs/pipelines.md``, "Restart"):
``PipelineStage(..., restart=True | RestartPolicy(...))``, with real stage processes killed
with SIGKILL, for a replica of a pool and for a stage of one process, first, middle or last.

One suite for :class:`~enginecore.stage.Pipeline` and
:class:`~enginecore.stage.AsyncPipeline` (``[sync]``, ``[async]``), as in
``test_pipeline_pool.py``; the conftest's autouse fixture checks that no process, socket
file or shared-memory segment is left behind. The coordinator's decisions are checked alone
at the end (no IO)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import pathlib
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from enginecore.stage import (
    AsyncPipeline,
    EngineDeadError,
    NoReplicaError,
    Pipeline,
    PipelineStage,
    PipelineStageDeadError,
    ReplicaState,
    RestartPolicy,
    Retry,
    StageClient,
    StageHealth,
    _shm,
)
from enginecore.stage._curve import Authenticator, ServerCurve, secure_server
from enginecore.stage._edge import END, FIRST, LINKS_UTILITY, MORE, ONLY, link_id
from enginecore.stage._errors import EngineDeadError as _Dead
from enginecore.stage._pipeline_core import PipelineCore, PipelineDeliveries, RequestState
from enginecore.stage._pipelinebase import PIPE_FACTORY, PipelineBase, pipe_kwargs
from enginecore.stage._session import ClientSession, StreamCore
from enginecore.stage._wire import ErrorReport

from .conftest import settled_engine, wait_until
from .pipelines import Launch, kill_in_barrier, launcher

COUNTDOWN = "enginecore:CountdownEngine"
RELAY = "enginecore.stage.testing:relay"
DEVICE = "enginecore.stage.testing:device"
FLAKY = "enginecore.stage.testing:flaky"
T = "enginecore.stage.testing"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

FAST = RestartPolicy(first_delay=0.05, max_delay=0.05)
"""Restart at once (50 ms): the tests wait for the new process, not for a backoff."""


@pytest.fixture(params=["sync", "async"])
def launch(request: pytest.FixtureRequest, no_leftovers: str) -> Iterator[Launch]:
    """``launch(stages, **kwargs)``: either pipeline (``pipelines.launcher``); each is shut
    down after the test."""
    with launcher(request.param) as launch_:
        yield launch_


def _held(pipe: Any, stage: str) -> int:
    """The requests live in every process of *stage*."""
    held = pipe.call_utility(stage, "num_requests")
    return sum(held) if isinstance(held, list) else int(held)


def _up(pipe: Any, key: str, restarts: int = 1) -> bool:
    """Whether process *key* is up again after *restarts* restarts."""
    return bool(pipe.restarts[key] == restarts and pipe.health()[key] == StageHealth.OK)


def _utility_calls(pipe: Any, stage: str) -> int:
    """The utility calls that the loop of *stage* (one process) has begun: it counts one as
    it begins it, and the stage's input side answers ``stats`` while the loop is in it."""
    return int(pipe.stats()[stage].loop.utility_calls)


class _Silence:
    """Puts the loop of each process of the stage before a restarted one asleep in a
    utility for *seconds*: :meth:`send`, from ``_install`` (which the test wraps), on the
    clients it returns, before the barrier's own calls go out on the same connections. A
    loop applies its messages in order, so it answers the barrier only after the sleep,
    however long the restart took (on a loaded machine too)."""

    def __init__(self, pipe: Any, seconds: float) -> None:
        self._pipe = pipe
        self._seconds = seconds
        self._calls: list[Any] = []

    def send(self, targets: Sequence[Any]) -> None:
        for target in targets:
            if isinstance(target, StageClient):
                self._calls.append(target.call_utility_future("sleep", self._seconds))
            else:
                # AsyncPipeline._link, on its loop: this task runs (and sends) before the
                # barrier's own, which are made once _install has returned.
                call = target.call_utility("sleep", self._seconds)
                self._calls.append(asyncio.ensure_future(call))

    def outcomes(self, timeout: float) -> list[BaseException | None]:
        """Each sleep's outcome once it is over: ``None``, or its error."""
        calls = self._calls
        if calls and not isinstance(calls[0], concurrent.futures.Future):

            async def gather() -> list[Any]:
                return await asyncio.wait_for(
                    asyncio.gather(*calls, return_exceptions=True), timeout
                )

            return [
                o if isinstance(o, BaseException) else None
                for o in self._pipe._runner.run(gather())
            ]
        concurrent.futures.wait(calls, timeout)
        return [call.exception(0) for call in calls]


class TestOptions:
    @pytest.mark.parametrize("bad", ["yes", 1, 0.5, None, {"max_failures": 2}])
    def test_restart_must_be_a_bool_or_a_policy(self, bad: Any) -> None:
        with pytest.raises(TypeError, match="restart must be a bool or a RestartPolicy"):
            PipelineStage(RELAY, restart=bad)

    def test_a_bad_policy_is_a_value_error_before_any_process_starts(self) -> None:
        with pytest.raises(ValueError, match="max_failures"):
            PipelineStage(RELAY, restart=RestartPolicy(max_failures=0))

    def test_a_stage_before_one_that_restarts_holds_for_a_dead_process_s_successor(
        self,
    ) -> None:
        # pipe_kwargs: a stage whose next stage restarts holds what goes to a dead process
        # of it for the link to its successor (PipeStage.pipe_link); before a pool that
        # does not restart, nothing will take it: dropped, as before.
        kwargs = pipe_kwargs(
            PipelineStage(RELAY),
            ["ipc:///x"],
            routed=True,
            downstream_spec=PipelineStage(RELAY, restart=True),
        )
        assert kwargs["next_restarts"] is True
        kwargs = pipe_kwargs(
            PipelineStage(RELAY),
            ["ipc:///x", "ipc:///y"],
            routed=True,
            downstream_spec=PipelineStage(RELAY, replicas=2),
        )
        assert "next_restarts" not in kwargs

    def test_without_a_death_nothing_restarts(self, launch: Any) -> None:
        pipe = launch([COUNTDOWN, PipelineStage(RELAY, name="mid", restart=True)])
        assert pipe.add("r", 3).collect(timeout=10) == [2, 1, 0]
        assert pipe.restarts == {COUNTDOWN: 0, "mid": 0}
        assert set(pipe.health().values()) == {StageHealth.OK}


class TestPoolReplica:
    @pytest.mark.parametrize("position", [0, 1, 2], ids=["first", "middle", "last"])
    def test_a_killed_replica_restarts_and_takes_requests_again(
        self, launch: Any, position: int
    ) -> None:
        names = ["first", "mid", "last"]
        factories = [DEVICE, RELAY, RELAY]
        pipe = launch(
            [
                PipelineStage(
                    factory,
                    {"step_s": 0.005} if factory == DEVICE else None,
                    name=name,
                    replicas=2 if k == position else 1,
                    restart=FAST if k == position else False,
                )
                for k, (factory, name) in enumerate(zip(factories, names, strict=True))
            ]
        )
        pool, key = names[position], f"{names[position]}[0]"
        streams = {f"r{i}": pipe.add(f"r{i}", 10**6) for i in range(8)}  # under load
        for stream in streams.values():
            stream.get(timeout=10)
        on = {rid: pipe._core.route(rid)[position] for rid in streams}
        assert set(on.values()) == {0, 1}
        old = pipe.call_utility(pool, "pid", replica=0)
        os.kill(old, signal.SIGKILL)
        for rid, stream in streams.items():
            if on[rid] == 0:
                with pytest.raises(PipelineStageDeadError) as info:
                    stream.collect(timeout=10)
                assert (info.value.stage, info.value.replica) == (pool, 0)
        assert wait_until(lambda: _up(pipe, key), 30)
        new = pipe.call_utility(pool, "pid", replica=0)
        assert new != old
        # The survivors went on; new requests go to the new process too, and complete.
        survivors = [rid for rid in streams if on[rid] == 1]
        for rid in survivors:
            assert not streams[rid].finished
            streams[rid].get(timeout=10)
        later = [pipe.add(f"later{i}", 3) for i in range(6)]
        to_new = [pipe._core.route(f"later{i}")[position] for i in range(6)].count(0)
        assert 0 < to_new < 6  # the least loaded: the new process first, then both
        assert [s.collect(timeout=10) for s in later] == [[2, 1, 0]] * 6
        if position:  # a relay: it counts what it took since it started
            assert pipe.call_utility(pool, "added", replica=0) == to_new
        pipe.abort(survivors)
        assert wait_until(lambda: pipe.in_flight == 0, 10)
        assert pipe.restarts[f"{pool}[1]"] == 0
        assert set(pipe.health().values()) == {StageHealth.OK}
        if position < 2:  # its new link to the next stage gets its credit back
            assert wait_until(lambda: pipe.stats()[key].engine["edge_in_flight"] == 0, 10)
        for name in names:  # and no stage holds a request any more
            assert wait_until(lambda n=name: _held(pipe, n) == 0, 10)

    def test_a_replica_that_dies_too_often_is_failed_and_stays_out(self, launch: Any) -> None:
        policy = RestartPolicy(first_delay=0.05, max_delay=0.05, max_failures=2)
        pipe = launch(
            [
                PipelineStage(DEVICE, {"step_s": 0.005}, name="first"),
                PipelineStage(RELAY, name="mid", replicas=2, restart=policy),
            ]
        )
        os.kill(pipe.call_utility("mid", "pid", replica=1), signal.SIGKILL)
        assert wait_until(lambda: _up(pipe, "mid[1]"), 30)
        os.kill(pipe.call_utility("mid", "pid", replica=1), signal.SIGKILL)
        assert wait_until(lambda: pipe.health()["mid[1]"] == StageHealth.DEAD, 10)
        assert pipe._core.process_state(1, 1) is ReplicaState.FAILED
        later = [pipe.add(f"later{i}", 3) for i in range(4)]  # all on mid[0]
        assert {pipe._core.route(f"later{i}")[1] for i in range(4)} == {0}
        assert [s.collect(timeout=10) for s in later] == [[2, 1, 0]] * 4
        assert pipe.restarts["mid[1]"] == 1


class TestSingleProcessStage:
    @pytest.mark.parametrize("position", [0, 1, 2], ids=["first", "middle", "last"])
    def test_a_killed_stage_restarts_and_the_pipeline_goes_on(
        self, launch: Any, position: int
    ) -> None:
        # A backoff long enough to see the stage restarting: adds are refused meanwhile.
        policy = RestartPolicy(first_delay=0.5)
        names = ["first", "mid", "last"]
        factories = [DEVICE, RELAY, RELAY]
        stages = [
            PipelineStage(
                factory,
                {"step_s": 0.005} if factory == DEVICE else None,
                name=name,
                restart=policy if k == position else False,
            )
            for k, (factory, name) in enumerate(zip(factories, names, strict=True))
        ]
        pipe = launch(stages)
        killed = names[position]
        streams = [pipe.add(f"r{i}", 10**6) for i in range(4)]  # under load
        for stream in streams:
            stream.get(timeout=10)
        old = pipe.call_utility(killed, "pid")
        os.kill(old, signal.SIGKILL)
        for stream in streams:
            with pytest.raises(PipelineStageDeadError) as info:
                stream.collect(timeout=10)
            assert info.value.stage == killed
            assert info.value.replica is None
        # Every request ended; the stage is down, its restart pending: an add is refused at
        # once, with the error that names the stage, and its health says so.
        assert pipe.health()[killed] == StageHealth.RESTARTING
        with pytest.raises(NoReplicaError, match=f"stage '{killed}'.*restarting"):
            pipe.add("refused", 3)
        assert wait_until(lambda: _up(pipe, killed), 30)
        assert pipe.call_utility(killed, "pid") != old
        later = [pipe.add(f"later{i}", 3) for i in range(4)]
        assert [s.collect(timeout=10) for s in later] == [[2, 1, 0]] * 4
        assert wait_until(lambda: pipe.in_flight == 0, 10)
        # The other stages dropped the dead stage's requests.
        for name in names:
            assert wait_until(lambda n=name: pipe.call_utility(n, "num_requests") == 0, 10)

    def test_the_last_death_allowed_makes_the_pipeline_dead(self, launch: Any) -> None:
        policy = RestartPolicy(first_delay=0.05, max_delay=0.05, max_failures=2)
        pipe = launch([COUNTDOWN, PipelineStage(RELAY, name="mid", restart=policy)])
        os.kill(pipe.call_utility("mid", "pid"), signal.SIGKILL)
        assert wait_until(lambda: _up(pipe, "mid"), 30)
        assert pipe.add("r", 2).collect(timeout=10) == [1, 0]
        os.kill(pipe.call_utility("mid", "pid"), signal.SIGKILL)
        assert wait_until(lambda: pipe.health()["mid"] == StageHealth.DEAD, 10)
        with pytest.raises(PipelineStageDeadError, match="mid"):
            pipe.add("later", 1)

    def test_failed_starts_count_until_the_stage_is_dead(self, launch: Any) -> None:
        # Every start after the first fails: two of them and the first death make three
        # deaths (max_failures): the stage is failed, and with it the pipeline.
        policy = RestartPolicy(first_delay=0.05, max_delay=0.05, max_failures=3)
        marker = f"/tmp/ecR-{os.getpid()}-{time.monotonic_ns()}"  # outside the checked dir
        try:
            relay_once = PipelineStage(
                f"{T}:relay_once", {"marker": marker}, name="mid", restart=policy
            )
            pipe = launch([COUNTDOWN, relay_once])
            os.kill(pipe.call_utility("mid", "pid"), signal.SIGKILL)
            # Two tries, then dead for good. (Both at once: the stage's client sees a death
            # before the pipeline's coordinator does, and in between health() passes on
            # the client's "dead", at the first death too: docs/pipelines.md, "Health".)
            assert wait_until(
                lambda: pipe.restarts["mid"] == 2 and pipe.health()["mid"] == StageHealth.DEAD,
                30,
            )
            with pytest.raises(PipelineStageDeadError, match="mid") as info:
                pipe.add("later", 1)
            # The failed start names the stage's factory, not the wrapper every stage
            # process runs.
            first_line = str(info.value).split("\n", maxsplit=1)[0]
            assert f"pipeline stage 'mid' (factory '{T}:relay_once')" in first_line
            assert "_pipe_stage" not in first_line
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(marker)

    def test_a_death_the_coordinator_has_not_heard_of_reads_restarting_and_is_known(
        self, no_leftovers: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # A stage's client sees its process die before the pipeline's coordinator hears of
        # it (the client's event sink, on the thread that read the end, hands it over). In
        # between, health() read the client's "dead", final to a caller watching for it,
        # though the stage was to be started again. health() now hands the end over itself:
        # it reads RESTARTING, and RESTARTING still means the pipeline knows (add refuses).
        # Pipeline only: an AsyncPipeline's reader sees the death and calls the sink in one
        # loop callback, so no read on its loop falls between them.
        gate = threading.Event()
        held = threading.Event()
        take = Pipeline._take_events

        def gated(self: Any, k: int, r: int = 0, client: Any = None) -> None:
            if (
                k == 1
                and threading.current_thread() is not threading.main_thread()
                and client is not None
                and client.exit_code is not None
                and not gate.is_set()
            ):
                held.set()
                gate.wait(30)
            take(self, k, r, client)

        monkeypatch.setattr(Pipeline, "_take_events", gated)
        with launcher("sync") as launch:
            pipe = launch(
                [COUNTDOWN, PipelineStage(RELAY, name="mid", restart=RestartPolicy(first_delay=30))]
            )
            try:
                os.kill(pipe.call_utility("mid", "pid"), signal.SIGKILL)
                assert held.wait(30)  # the sink is held: the coordinator has not heard
                assert pipe.client("mid").health() == StageHealth.DEAD
                assert pipe.health()["mid"] == StageHealth.RESTARTING
                with pytest.raises(NoReplicaError):
                    pipe.add("r", 1)
                assert isinstance(pipe.stats()["mid"], EngineDeadError)
            finally:
                gate.set()
            started = time.monotonic()
            pipe.shutdown()
            assert time.monotonic() - started < 10  # the 30 s backoff ended at once
            assert pipe.restarts["mid"] == 0

    def test_an_unexpected_error_in_the_restart_fails_the_process_never_restarting_for_good(
        self, launch: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        # A bug in the restart itself (not a failed start, which is counted and tried
        # again) was logged, and left the process "restarting" for good: add refused ("it
        # is restarting") forever. Now it is logged and the process failed, the stage dead.
        def broken(self: Any, k: int, r: int) -> int | None:
            raise RuntimeError("a bug in the restart")

        monkeypatch.setattr(PipelineBase, "_restarting", broken)
        pipe = launch([COUNTDOWN, PipelineStage(RELAY, name="mid", restart=FAST)])
        os.kill(pipe.call_utility("mid", "pid"), signal.SIGKILL)
        assert wait_until(lambda: pipe.health()["mid"] == StageHealth.DEAD, 30)
        with pytest.raises(PipelineStageDeadError, match="its restart failed") as info:
            pipe.add("r", 1)
        assert info.value.stage == "mid"
        assert "a bug in the restart" in str(info.value)

        def logged(text: str) -> bool:  # the restart's thread logs just after the failure
            errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
            return any(text in m and "'mid'" in m for m in errors)

        assert wait_until(lambda: logged("it is failed and stays out"), 10)
        assert any("restarting a pipeline stage failed" in r.getMessage() for r in caplog.records)
        assert pipe.restarts["mid"] == 0


class TestShutdown:
    def test_shutdown_as_a_restart_thread_starts_waits_for_it(
        self, no_leftovers: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # Pipeline only (AsyncPipeline restarts in tasks, on one thread): a shutdown() that
        # came between a restart thread's registration and its start() joined a thread not
        # yet started, and raised RuntimeError (seen on a loaded host).
        pipe = Pipeline.launch(
            [COUNTDOWN, PipelineStage(RELAY, name="mid", restart=RestartPolicy(first_delay=30))],
            startup_timeout=30,
        )
        real_start = threading.Thread.start
        closed: list[BaseException | None] = []

        def close() -> None:
            try:
                pipe.shutdown()
            except BaseException as exc:
                closed.append(exc)
            else:
                closed.append(None)

        def start(thread: threading.Thread) -> None:
            if thread.name == "enginecore-pipeline-restart":
                closer = threading.Thread(target=close)
                real_start(closer)
                # The shutdown waits for this start (or, before the fix, marked the pipeline
                # stopping and joined the thread not yet started).
                pipe._stopping.wait(0.5)
            real_start(thread)

        monkeypatch.setattr(threading.Thread, "start", start)
        os.kill(pipe.call_utility("mid", "pid"), signal.SIGKILL)
        assert wait_until(lambda: closed, 30)
        assert closed == [None]

    def test_shutdown_during_the_backoff_stops_at_once(self, launch: Any) -> None:
        pipe = launch(
            [COUNTDOWN, PipelineStage(RELAY, name="mid", restart=RestartPolicy(first_delay=30))]
        )
        os.kill(pipe.call_utility("mid", "pid"), signal.SIGKILL)
        assert wait_until(lambda: pipe.health()["mid"] == StageHealth.RESTARTING, 10)
        assert isinstance(pipe.stats()["mid"], EngineDeadError)  # the dead process's
        with pytest.raises(NoReplicaError):
            pipe.add("r", 1)
        started = time.monotonic()
        pipe.shutdown()
        assert time.monotonic() - started < 10  # not the 30 s backoff
        assert pipe.restarts["mid"] == 0

    def test_shutdown_while_a_restart_starts_leaves_no_process(self, launch: Any) -> None:
        # The restart's start is under way (or about to be) when the shutdown begins: it
        # either never starts the process or stops what it started (the conftest checks
        # that no process is left).
        pipe = launch(
            [
                COUNTDOWN,
                PipelineStage(
                    RELAY, name="mid", restart=RestartPolicy(first_delay=0.001, max_delay=0.001)
                ),
            ]
        )
        stream = pipe.add("r", 10**6)
        stream.get(timeout=10)
        os.kill(pipe.call_utility("mid", "pid"), signal.SIGKILL)
        with pytest.raises(PipelineStageDeadError):
            stream.collect(timeout=10)
        pipe.shutdown()
        assert pipe.health()["mid"] == StageHealth.DEAD


@pytest.mark.parametrize("cancelled", ["restart", "shutdown"])
def test_async_a_restart_cancelled_before_linking_in_stops_its_new_process(
    no_leftovers: str, cancelled: str, caplog: pytest.LogCaptureFixture
) -> None:
    # AsyncPipeline's restart is a task: cancelled (an application that cancels every task,
    # asyncio.run's teardown; or a shutdown's task that waits for it) after the new process
    # started, before it was put in place (here: held in the link barrier), it stopped
    # nothing, and the new process ran on (the conftest's no_leftovers) until the parent's
    # exit. It stops it now, as the sync Pipeline's restart thread stops what it started.
    new_pids: list[int] = []

    async def main() -> None:
        pipe = await AsyncPipeline.launch(
            [COUNTDOWN, PipelineStage(RELAY, name="mid", restart=FAST)], startup_timeout=30
        )
        try:
            real_start, real_await = pipe._start, pipe._await_linkable
            waiting, gate = asyncio.Event(), asyncio.Event()

            async def start(k: int, r: int, generation: int) -> Any:
                client = await real_start(k, r, generation)
                new_pids.append(client.pid)
                return client

            async def await_linkable(k: int, r: int) -> bool:
                waiting.set()
                await gate.wait()  # never set: the restart is held here
                return await real_await(k, r)

            pipe._start = start  # type: ignore[method-assign]
            pipe._await_linkable = await_linkable  # type: ignore[method-assign]
            os.kill(await pipe.call_utility("mid", "pid"), signal.SIGKILL)
            await asyncio.wait_for(waiting.wait(), 30)
            (restart,) = pipe._restart_tasks
            if cancelled == "restart":
                restart.cancel()
            else:  # the shutdown's task waits for the restart; it is cancelled
                closing = asyncio.ensure_future(pipe.shutdown())
                await asyncio.sleep(0)  # shutdown() starts its task,
                await asyncio.sleep(0)  # which begins to wait for the restart
                task = pipe._closing.task
                assert task is not None
                assert not task.done()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await closing
            await asyncio.gather(restart, return_exceptions=True)
            assert restart.cancelled()
        finally:
            await pipe.shutdown()  # (again: the rest of the cancelled one)

    try:
        asyncio.run(main())
        assert len(new_pids) == 1
        assert wait_until(lambda: _dead(new_pids[0]), 10), "the new process runs on"
        # A cancel by the pipeline's own shutdown is no failure: nothing is logged for it.
        cancel_logged = _CANCELLED in caplog.text
        assert cancel_logged == (cancelled == "restart")
    finally:
        for pid in new_pids:  # before the fix: not left to the next tests
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


SLOW = RestartPolicy(first_delay=600.0, max_delay=600.0)
"""A backoff that outlasts the test: the restart task waits in it."""

_CANCELLED = "its restart task was cancelled"
"""What the error logged for a restart task cancelled while the pipeline is open says."""


async def _restart_task(pipe: AsyncPipeline) -> asyncio.Task[None]:
    """The one restart task of *pipe*, once its coordinator has heard a death (the death's
    handling schedules it)."""
    deadline = time.monotonic() + 30
    while not pipe._restart_tasks:
        assert time.monotonic() < deadline, "no restart was scheduled"
        await asyncio.sleep(0.01)
    (task,) = pipe._restart_tasks
    return task


async def _cancel(task: asyncio.Task[None]) -> None:
    """Cancel *task* as an application does, and check that the cancel propagated: the task
    ends cancelled (it did not swallow it, nor end some other way)."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()


def _cancel_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        rec.getMessage()
        for rec in caplog.records
        if rec.levelno == logging.ERROR and _CANCELLED in rec.getMessage()
    ]


class TestAsyncRestartTaskCancelled:
    """An :class:`AsyncPipeline`'s restart is a task of its own, which an application may
    cancel while the pipeline stays open (one that cancels every task it does not own, a
    TaskGroup's teardown). It left the process ``restarting`` for good: ``health()`` said
    so, and ``add`` refused ("it is restarting") forever, with no retry and no word. Now
    the process is failed, as after ``max_failures`` (docs/pipelines.md, "Restart"), an
    error says why, and the cancel still propagates; a process the task had started is
    stopped."""

    def test_cancelled_in_its_backoff_the_process_is_failed_and_the_stage_dead(
        self, no_leftovers: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        async def main() -> None:
            pipe = await AsyncPipeline.launch(
                [COUNTDOWN, PipelineStage(RELAY, name="mid", restart=SLOW)], startup_timeout=30
            )
            try:
                os.kill(await pipe.call_utility("mid", "pid"), signal.SIGKILL)
                restart = await _restart_task(pipe)
                assert pipe.health()["mid"] == StageHealth.RESTARTING
                await _cancel(restart)
                assert pipe.health()["mid"] == StageHealth.DEAD  # not "restarting" for good
                assert pipe.restarts["mid"] == 0  # no try was made
                with pytest.raises(PipelineStageDeadError, match="restart task was cancelled") as e:
                    await pipe.add("later", 1)  # not NoReplicaError ("it is restarting")
                assert e.value.stage == "mid"
                assert not pipe._restart_tasks
            finally:
                await pipe.shutdown()

        asyncio.run(main())
        (message,) = _cancel_errors(caplog)
        assert "'mid'" in message

    def test_cancelled_in_its_backoff_a_pool_serves_on_with_its_other_replica(
        self, no_leftovers: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        async def main() -> None:
            pipe = await AsyncPipeline.launch(
                [COUNTDOWN, PipelineStage(RELAY, name="mid", replicas=2, restart=SLOW)],
                startup_timeout=30,
            )
            try:
                os.kill(await pipe.call_utility("mid", "pid", replica=0), signal.SIGKILL)
                await _cancel(await _restart_task(pipe))
                health = pipe.health()
                assert health["mid[0]"] == StageHealth.DEAD
                assert health["mid[1]"] == StageHealth.OK
                streams = [await pipe.add(f"r{i}", 3) for i in range(4)]
                for stream in streams:
                    assert await stream.collect(timeout=10) == [2, 1, 0]
                assert pipe._core.process_state(1, 0) is ReplicaState.FAILED
            finally:
                await pipe.shutdown()

        asyncio.run(main())
        (message,) = _cancel_errors(caplog)
        assert "'mid', process 0" in message

    @pytest.mark.parametrize("replicas", [1, 2])
    def test_cancelled_while_linking_in_its_new_process_is_stopped(
        self, no_leftovers: str, caplog: pytest.LogCaptureFixture, replicas: int
    ) -> None:
        # The cancel lands in the link barrier: the new process is in place (_install),
        # not yet routable (_started). It was left so until the pipeline's shutdown: alive,
        # unrouted, and the process "restarting" for good.
        new_pids: list[int] = []

        async def main() -> None:
            pipe = await AsyncPipeline.launch(
                [COUNTDOWN, PipelineStage(RELAY, name="mid", replicas=replicas, restart=FAST)],
                startup_timeout=30,
            )
            try:
                real_start, real_install = pipe._start, pipe._install
                installed, gate = asyncio.Event(), asyncio.Event()

                async def start(k: int, r: int, generation: int) -> Any:
                    client = await real_start(k, r, generation)
                    new_pids.append(client.pid)
                    return client

                def install(k: int, r: int, client: Any) -> Any:
                    barrier = real_install(k, r, client)
                    assert barrier
                    for target in barrier:

                        async def held(*args: Any, target: Any = target, **kw: Any) -> Any:
                            target.__dict__.pop("call_utility", None)
                            await gate.wait()  # never set: the barrier waits here

                        target.call_utility = held  # type: ignore[method-assign]
                    installed.set()
                    return barrier

                pipe._start = start  # type: ignore[method-assign]
                pipe._install = install  # type: ignore[method-assign]
                os.kill(await pipe.call_utility("mid", "pid", replica=0), signal.SIGKILL)
                await asyncio.wait_for(installed.wait(), 30)
                await _cancel(await _restart_task(pipe))
                deadline = time.monotonic() + 10
                while not _dead(new_pids[0]):
                    assert time.monotonic() < deadline, "the new process runs on, unrouted"
                    await asyncio.sleep(0.01)
                key = "mid" if replicas == 1 else "mid[0]"
                assert pipe.health()[key] == StageHealth.DEAD
                assert pipe._core.process_state(1, 0) is ReplicaState.FAILED
                assert not pipe._linking
                if replicas == 1:
                    with pytest.raises(PipelineStageDeadError, match="restart task was cancel"):
                        await pipe.add("later", 1)
                else:
                    assert pipe.health()["mid[1]"] == StageHealth.OK
                    streams = [await pipe.add(f"r{i}", 3) for i in range(4)]
                    for stream in streams:
                        assert await stream.collect(timeout=10) == [2, 1, 0]
            finally:
                await pipe.shutdown()

        try:
            asyncio.run(main())
            assert len(new_pids) == 1
            (message,) = _cancel_errors(caplog)
            assert "'mid'" in message
            # The end of the new process, stopped by the restart, is not another death.
            assert "its client was shut down" not in caplog.text
        finally:
            for pid in new_pids:  # before the fix: not left to the next tests
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


class TestRetry:
    """``on_next_error=Retry(n)`` on the edge into a stage that restarts (docs/pipelines.md,
    "Retry" and "Restart"). A retry goes to the request's own process, over the link that
    process has now: it never waits for a restart, and never moves to another replica. A
    death is not retried, also while a retry is under way: the request ends with the dead
    process's error, and its id and its place in the budget are free once the stages still
    running have dropped it (not left in the pipeline for good)."""

    def test_a_retry_into_a_restarted_stage_goes_to_its_new_process(self, launch: Any) -> None:
        pipe = launch(
            [
                PipelineStage(COUNTDOWN, name="first", on_next_error=Retry(1)),
                PipelineStage(FLAKY, {"fail_first": 1}, name="mid", restart=FAST),
                PipelineStage(RELAY, name="last"),
            ]
        )
        assert pipe.add("before", 3).collect(timeout=10) == [2, 1, 0]  # retried once
        old = pipe.call_utility("mid", "pid")
        os.kill(old, signal.SIGKILL)
        assert wait_until(lambda: _up(pipe, "mid"), 30)
        # The new process fails the request's first attempt (it counts its own): the
        # replay reaches it over the link made when it came back, and the request goes on.
        assert pipe.add("after", 3).collect(timeout=10) == [2, 1, 0]
        assert pipe.call_utility("mid", "pid") != old
        assert pipe.call_utility("mid", "attempts", "after") == 2
        assert pipe.call_utility("mid", "attempts", "before") == 0  # the dead one's
        # first's numbers once they are a sample from after both requests left its log.
        engine = settled_engine(
            lambda: pipe.stats()["first"].engine,
            lambda e: e["replays"] >= 2 and e["replay_logged"] == 0,
        )
        assert engine["replays"] == 2
        assert wait_until(lambda: pipe.in_flight == 0, 10)
        for name in ("first", "mid", "last"):
            assert wait_until(lambda n=name: _held(pipe, n) == 0, 10)

    def test_a_retry_while_another_replica_restarts_stays_on_its_replica(self, launch: Any) -> None:
        # mid[0] is down for the whole test (a long backoff): the request is routed to
        # mid[1], which fails it, and the retry goes to mid[1] again.
        pipe = launch(
            [
                PipelineStage(COUNTDOWN, name="first", on_next_error=Retry(1)),
                PipelineStage(
                    FLAKY,
                    {"fail_first": 1},
                    name="mid",
                    replicas=2,
                    restart=RestartPolicy(first_delay=30),
                ),
                PipelineStage(RELAY, name="last"),
            ]
        )
        os.kill(pipe.call_utility("mid", "pid", replica=0), signal.SIGKILL)
        assert wait_until(lambda: pipe.health()["mid[0]"] == StageHealth.RESTARTING, 10)
        stream = pipe.add("r", 3)
        assert pipe._core.route("r")[1] == 1
        assert stream.collect(timeout=10) == [2, 1, 0]
        assert pipe.call_utility("mid", "attempts", "r", replica=1) == 2
        assert pipe.health()["mid[0]"] == StageHealth.RESTARTING  # not waited for
        assert pipe.restarts["mid[0]"] == 0
        assert wait_until(lambda: pipe.in_flight == 0, 10)

    @pytest.mark.parametrize("replicas", [1, 2], ids=["single", "pool"])
    @pytest.mark.parametrize("at", ["fence", "input"])
    def test_a_death_while_a_retry_comes_ends_the_request_and_frees_its_id(
        self, launch: Any, at: str, replicas: int
    ) -> None:
        # "mid" fails the request's first attempt, and its process dies when the retry
        # comes: as it applies the replay's fence, which then never reaches "last"
        # ("fence"), or as the inputs come again, after the fence went on ("input"; "last"
        # may or may not have applied it: its gone drops what of mid comes after it).
        pipe = launch(
            [
                PipelineStage(RELAY, name="first", on_next_error=Retry(2)),
                PipelineStage(
                    f"{T}:dying_on_retry", {"at": at}, name="mid", replicas=replicas, restart=FAST
                ),
                PipelineStage(RELAY, name="last"),
            ],
            max_in_flight=1,
        )
        with pytest.raises(PipelineStageDeadError) as info:  # a death is not retried
            pipe.add("r", "retry").collect(timeout=10)
        assert info.value.stage == "mid"
        assert info.value.replica in ((None,) if replicas == 1 else (0, 1))
        key = "mid" if replicas == 1 else f"mid[{info.value.replica}]"
        # Its id and its place in the budget are free: not held for a fence's answer that
        # the dead process never let through.
        assert wait_until(lambda: pipe.in_flight == 0, 10), pipe.in_flight
        assert wait_until(lambda: _up(pipe, key), 30)
        assert pipe.add("r", "again", wait=False).collect(timeout=10) == ["again"]
        assert pipe.restarts[key] == 1
        assert wait_until(lambda: pipe.in_flight == 0, 10)
        for name in ("first", "mid", "last"):
            assert wait_until(lambda n=name: _held(pipe, n) == 0, 10)

    @pytest.mark.parametrize("replicas", [1, 2], ids=["single", "pool"])
    def test_a_fence_answered_after_the_death_does_not_free_the_request_early(
        self, launch: Any, replicas: int, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # "mid" passes the replay's fence on to "last", then dies as the inputs come again
        # (once the fence has left the process).
        # "last" is asleep in a utility meanwhile (its input thread still reads): it applies
        # the fence, then the gone and the abort the coordinator sent after the death, only
        # once it wakes, so its answer to the fence reaches the coordinator after the death,
        # which stopped counting that fence. That answer is flagged: the request stays until
        # last's answer to the abort, and only that one frees it (docs/wire.md section 8).
        pipe = launch(
            [
                PipelineStage(RELAY, name="first", on_next_error=Retry(2)),
                PipelineStage(
                    f"{T}:dying_on_retry",
                    {"at": "input", "delay_s": 0.2},  # the fence has left when it dies
                    name="mid",
                    replicas=replicas,
                    restart=FAST,
                ),
                PipelineStage(RELAY, name="last"),
            ],
            max_in_flight=1,
        )
        core = pipe._core
        real = core.aborted
        seen: list[tuple[bool, Any, Any]] = []  # last's answers about r: fence, state before/after

        def aborted(k: int, req_ids: Any, *args: Any, **kwargs: Any) -> None:
            ids = list(req_ids)
            before = core.state("r")
            real(k, ids, *args, **kwargs)
            if k == 2 and "r" in ids:
                fence = bool(kwargs.get("fence", args[3] if len(args) > 3 else False))
                seen.append((fence, before, core.state("r")))

        monkeypatch.setattr(core, "aborted", aborted)
        calls = _utility_calls(pipe, "last")
        asleep = threading.Thread(target=pipe.call_utility, args=("last", "sleep", 2.0))
        asleep.start()
        try:
            assert wait_until(lambda: _utility_calls(pipe, "last") > calls, 10)  # in it now
            with pytest.raises(PipelineStageDeadError):
                pipe.add("r", "retry").collect(timeout=10)
        finally:
            asleep.join(10)
        assert wait_until(lambda: pipe.in_flight == 0, 10), pipe.in_flight
        closing = RequestState.CLOSING
        # last answered the fence after the death (r had ended: closing), flagged, and r
        # stayed; its answer to the abort, unflagged, freed it.
        assert seen == [(True, closing, closing), (False, closing, None)], seen

    @pytest.mark.parametrize("replicas", [1, 2], ids=["single", "pool"])
    @pytest.mark.parametrize("replay", ["racing", "after-death", "after-restart"])
    def test_a_stage_that_fails_a_request_then_dies_ends_it_once(
        self, launch: Any, replay: str, replicas: int
    ) -> None:
        # mid fails r (its first attempt, at the add) and is killed as the coordinator takes
        # that error, so the replay it asks first for is on its way while mid is dead:
        # "racing", sent at once (first may apply it before or after it hears mid is gone);
        # "after-death", held until the coordinator has handled the death (its gone and
        # abort reach first before the replay: what a death taken with the error in one
        # batch does); "after-restart", held until mid's new process is up and linked, so
        # that the replay reaches first after it linked to the new process, which then gets
        # the fence of a request of the dead generation. In each: r ends once, with mid's
        # death (not retried), nothing of it is left in any process, the new process is not
        # held by the late fence, and r's id serves again (retried in the new process). In a
        # pool, the process killed is r's replica of mid; the other goes on untouched.
        pipe = launch(
            [
                PipelineStage(COUNTDOWN, name="first", on_next_error=Retry(2)),
                PipelineStage(
                    FLAKY, {"fail_first": 1}, name="mid", replicas=replicas, restart=FAST
                ),
                PipelineStage(RELAY, name="last"),
            ]
        )
        inner = getattr(pipe, "_pipe", pipe)
        core = inner._core
        pool = replicas > 1
        pids = [pipe.call_utility("mid", "pid", replica=r) for r in range(replicas)]
        dead: list[int] = []  # r's replica of mid, killed
        killed, sent = threading.Event(), threading.Event()
        real_error, real_send, real_aborted = core.error, inner._send_aborts, core.aborted
        answers: list[tuple[int, bool]] = []  # the stages' aborted answers about r: fence?

        def aborted(k: int, req_ids: Any, *args: Any) -> None:
            ids = list(req_ids)
            if "r" in ids and killed.is_set():
                answers.append((k, bool(args[3]) if len(args) > 3 else False))
            real_aborted(k, ids, *args)

        def error(k: int, req_id: str, *args: Any) -> None:
            real_error(k, req_id, *args)
            if k == 1 and req_id == "r" and not killed.is_set():
                dead.append(core.route("r")[1])
                os.kill(pids[dead[0]], signal.SIGKILL)  # before the replay asked for is sent
                killed.set()

        def ready() -> bool:
            (r,) = dead
            if replay == "after-death":
                return not core.alive(1)[r]
            return core.restarts(1, r) == 1 and core.process_state(1, r) is ReplicaState.SERVING

        def send_aborts(d: PipelineDeliveries[Any]) -> None:
            if not d.replays or replay == "racing" or sent.is_set():
                real_send(d)
                if d.replays:
                    sent.set()
                return
            held = PipelineDeliveries[Any](replays=list(d.replays), routes=dict(d.routes))
            d.replays.clear()
            real_send(d)

            def send() -> None:
                real_send(held)
                sent.set()

            def wait_and_send() -> None:
                if wait_until(ready, 30):
                    send()

            if isinstance(inner, AsyncPipeline):  # on the pipeline's event loop

                async def later() -> None:
                    while not ready():
                        await asyncio.sleep(0.01)
                    send()

                tasks.append(asyncio.get_running_loop().create_task(later()))
            else:  # the death is handled on mid's receiver thread, which delivers this
                threading.Thread(target=wait_and_send).start()

        tasks: list[Any] = []
        core.error = error
        core.aborted = aborted
        inner._send_aborts = send_aborts
        stream = pipe.add("r", 3)
        with pytest.raises(PipelineStageDeadError) as info:  # a death is not retried
            stream.collect(timeout=10)
        assert info.value.stage == "mid"
        assert killed.is_set()
        assert info.value.replica == (dead[0] if pool else None)
        key = f"mid[{dead[0]}]" if pool else "mid"
        assert sent.wait(30)
        assert wait_until(lambda: _up(pipe, key), 30)
        # Its one end stays the death: the late replay, fence or abort changed nothing.
        with pytest.raises(PipelineStageDeadError) as again:
            stream.collect(timeout=1)
        assert again.value is info.value
        assert not stream.finished
        assert not stream.aborted
        if replay == "after-restart":  # the late fence did reach the new process
            assert wait_until(lambda: (1, True) in answers, 10), answers  # and it answered
        assert wait_until(lambda: pipe.in_flight == 0, 10), pipe.in_flight
        for name in ("first", "mid", "last"):
            assert wait_until(lambda n=name: _held(pipe, n) == 0, 10)
        assert wait_until(lambda: pipe.stats()["first"].engine["replay_logged"] == 0, 10)
        # Nothing of it reached the new process.
        assert pipe.call_utility("mid", "attempts", "r", replica=dead[0] if pool else None) == 0
        # r's id serves again: mid fails its first attempt (a new process, or the other
        # replica, which never saw r), and the retry goes on, to the process that failed
        # it: both attempts are on one process of mid, none on the other. (Read from the
        # processes, not from r's route, which is gone once r is done: possibly already
        # when add returns.)
        assert pipe.add("r", 3).collect(timeout=10) == [2, 1, 0]
        attempts = pipe.call_utility("mid", "attempts", "r")
        assert (sorted(attempts) if pool else attempts) == ([0, 2] if pool else 2), attempts
        assert [pipe.add(f"n{i}", 2).collect(timeout=10) for i in range(3)] == [[1, 0]] * 3
        assert wait_until(lambda: pipe.in_flight == 0, 10)
        assert pipe.restarts[key] == 1


def _dead(pid: int) -> bool:
    """Whether process *pid* has exited (a zombie not reaped yet counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:  # reaped
        return True


class TestNeighbourDiesWhileLinking:
    """A process of a stage next to a restarted one dies while the restart's link barrier is
    in flight (docs/pipelines.md, "Restart"): after the new process was installed and the
    ``link`` sent to the previous stage, before its confirmations are in. A hook in the
    parent kills the neighbour right there (deterministic: the barrier then waits on a dead
    process, or the new process was linked to a dead one). The restart completes, the
    neighbour's death is handled as any (restarted, or left out), the new process is told
    the neighbour is gone as the others are, nothing hangs, and requests go through."""

    @pytest.mark.parametrize(
        "case",
        ["previous-restarts", "next-restarts", "previous-pool", "next-pool"],
    )
    def test_the_restart_completes_and_the_new_process_knows_the_neighbour_is_gone(
        self, launch: Any, case: str
    ) -> None:
        side, kind = case.split("-")
        pool = kind == "pool"
        neighbour = "first" if side == "previous" else "last"
        factories = {"first": DEVICE, "mid": RELAY, "last": RELAY}
        stages = [
            PipelineStage(
                factories[name],
                {"step_s": 0.005} if name == "first" else None,
                name=name,
                replicas=2 if pool and name == neighbour else 1,
                restart=FAST if name == "mid" or (name == neighbour and not pool) else False,
            )
            for name in ("first", "mid", "last")
        ]
        pipe = launch(stages)
        inner = getattr(pipe, "_pipe", pipe)  # the AsyncPipeline behind the adapter
        victim = pipe.call_utility(neighbour, "pid", replica=0 if pool else None)
        at = 0 if side == "previous" else 2
        killed = kill_in_barrier(inner, victim, (at, 0))
        os.kill(pipe.call_utility("mid", "pid"), signal.SIGKILL)
        assert killed.wait(30)
        key = f"{neighbour}[0]" if pool else neighbour
        assert wait_until(lambda: _up(pipe, "mid"), 30), (pipe.restarts, pipe.health())
        if pool:
            assert wait_until(lambda: pipe.health()[key] == StageHealth.DEAD, 10)
            assert pipe.restarts[key] == 0
        else:
            assert wait_until(lambda: _up(pipe, key), 30), (pipe.restarts, pipe.health())
        assert [pipe.add(f"r{i}", 3).collect(timeout=10) for i in range(4)] == [[2, 1, 0]] * 4
        if pool and side == "next":
            # The new mid was told that last[0] is gone: its link to it is down.
            assert pipe.call_utility("mid", LINKS_UTILITY) == [False, True]
        elif side == "next":
            assert pipe.call_utility("mid", LINKS_UTILITY) == [True]  # linked to the new one
        if side == "previous":
            # The new mid was told that first[0]'s link is gone, as the stage's other
            # processes were: it drops that link's late data (counted from then on).
            # (Once mid's sample is one taken after the gone: it lags what mid did.)
            engine = settled_engine(
                lambda: pipe.stats()["mid"].engine, lambda e: "pipe_dropped" in e
            )
            assert engine["pipe_dropped"] == 0
        assert wait_until(lambda: pipe.in_flight == 0, 10)
        for name in ("first", "mid", "last"):
            replica = 1 if pool and name == neighbour else None  # not the dead one
            assert wait_until(
                lambda n=name, r=replica: pipe.call_utility(n, "num_requests", replica=r) == 0,
                10,
            )

    @pytest.mark.parametrize("after", [False, True], ids=["before-install", "after-install"])
    def test_an_error_while_linking_in_is_a_failed_start_not_a_stuck_restart(
        self, launch: Any, after: bool
    ) -> None:
        # Linking the new process in raises (before or after it was put in place): the
        # restart neither hangs nor dies in its thread with the process left "starting"
        # for good (health RESTARTING, adds refused for ever). It is a failed start:
        # logged, the process stopped, counted by the policy, and started again.
        pipe = launch([DEVICE, PipelineStage(RELAY, name="mid", restart=FAST)])
        inner = getattr(pipe, "_pipe", pipe)
        real_install = inner._install
        failed = threading.Event()

        def install(k: int, r: int, client: Any) -> Any:
            if not failed.is_set():
                failed.set()
                if after:
                    real_install(k, r, client)
                raise RuntimeError("linking failed on purpose")
            return real_install(k, r, client)

        inner._install = install
        os.kill(pipe.call_utility("mid", "pid"), signal.SIGKILL)
        assert failed.wait(30)
        assert wait_until(lambda: _up(pipe, "mid", restarts=2), 30), (
            pipe.restarts,
            pipe.health(),
        )
        assert pipe.add("r", 3).collect(timeout=10) == [2, 1, 0]
        assert wait_until(lambda: pipe.in_flight == 0, 10)

    def test_a_last_failed_start_while_linking_in_leaves_no_link_to_it(self, launch: Any) -> None:
        # The failed start is the policy's last: the replica is failed, the stage goes on
        # with its other one, and the previous stage, sent a link to the stopped process,
        # was told it is gone (its link to it is down, as after a death).
        policy = RestartPolicy(first_delay=0.05, max_delay=0.05, max_failures=2)
        pipe = launch([DEVICE, PipelineStage(RELAY, name="mid", replicas=2, restart=policy)])
        inner = getattr(pipe, "_pipe", pipe)
        real_install = inner._install

        def install(k: int, r: int, client: Any) -> Any:
            real_install(k, r, client)
            raise RuntimeError("linking failed on purpose")

        inner._install = install
        os.kill(pipe.call_utility("mid", "pid", replica=0), signal.SIGKILL)
        assert wait_until(lambda: pipe.health()["mid[0]"] == StageHealth.DEAD, 30)
        assert pipe.call_utility(DEVICE, LINKS_UTILITY) == [False, True]
        assert [pipe.add(f"r{i}", 3).collect(timeout=10) for i in range(3)] == [[2, 1, 0]] * 3
        assert pipe.restarts["mid[0]"] == 1

    def test_a_silent_previous_stage_does_not_hold_shutdown_in_the_barrier(
        self, launch: Any, caplog: pytest.LogCaptureFixture
    ) -> None:
        # first is alive but silent (its loop asleep in a utility for 30 s, from just
        # before the barrier's call) while mid's new process is being linked in: the barrier
        # waits for its confirmation up to the startup timeout (30 s here). A shutdown
        # meanwhile ends that wait at once, and the new process is stopped (the conftest
        # checks that no process is left).
        pipe = launch([RELAY, PipelineStage(RELAY, name="mid", restart=FAST)])
        inner = getattr(pipe, "_pipe", pipe)
        real_install = inner._install
        silence = _Silence(pipe, 30)
        linking = threading.Event()

        def install(k: int, r: int, client: Any) -> Any:
            barrier = real_install(k, r, client)
            silence.send(barrier)
            linking.set()
            return barrier

        inner._install = install
        os.kill(pipe.call_utility("mid", "pid"), signal.SIGKILL)
        assert linking.wait(30)
        started = time.monotonic()
        pipe.shutdown()
        # Not the barrier's 30 s: the stages' own shutdown only (first's loop is asleep:
        # its client waits for it up to its timeout, 5 s, then kills it).
        assert time.monotonic() - started < 15
        (ended,) = silence.outcomes(10)
        assert ended is not None  # the sleep did not run its course: the shutdown ended it
        assert pipe.restarts["mid"] == 1
        assert pipe.health()["mid"] != StageHealth.OK
        assert "linking it in failed" not in caplog.text  # the wait ended cleanly

    def test_the_barrier_waits_for_silent_processes_together_up_to_the_startup_timeout(
        self, launch: Any, caplog: pytest.LogCaptureFixture
    ) -> None:
        # Both processes of first are silent (asleep in a utility, from just before the
        # barrier's calls, for longer than two startup timeouts) while mid's new process is
        # being linked in. The barrier asks both at once and waits the startup timeout in
        # all, not once per process (two); then the new process takes requests anyway, with
        # a warning for each process of first, which did not confirm.
        timeout = 5.0
        pipe = launch(
            [
                PipelineStage(RELAY, name="first", replicas=2),
                PipelineStage(RELAY, name="mid", restart=FAST),
            ],
            startup_timeout=timeout,
        )
        inner = getattr(pipe, "_pipe", pipe)
        real_install, real_started = inner._install, inner._started
        silence = _Silence(pipe, 2 * timeout + 2)
        barrier: list[float] = []  # when mid's barrier began, and when it ended

        def install(k: int, r: int, client: Any) -> Any:
            targets = real_install(k, r, client)
            silence.send(targets)
            barrier.append(time.monotonic())
            return targets

        def started(k: int, r: int) -> bool:
            barrier.append(time.monotonic())
            return bool(real_started(k, r))

        inner._install, inner._started = install, started
        os.kill(pipe.call_utility("mid", "pid"), signal.SIGKILL)
        assert wait_until(lambda: _up(pipe, "mid"), 30)
        begun, ended = barrier
        # The barrier alone (not the restart, nor the time until the test sees mid up):
        # one startup timeout, where asking one process at a time would take two.
        assert ended - begun < 2 * timeout
        assert caplog.text.count("did not confirm its new link") == 2
        assert silence.outcomes(30) == [None, None]  # both slept their course
        assert pipe.add("r", "x").collect(timeout=10) == ["x"]  # first has applied it since


class TestLinkedOnlyOnceThePreviousStageAnswered:
    """A restarted process of stage ``k`` is linked in only once the stage before it has
    answered for every request the dead process held (docs/pipelines.md, "Restart";
    ``PipelineCore.linkable``). Here ``k`` is "last", and the abort of its dead process's
    request reaches "mid" from "first" on their link, so it has no order with the
    coordinator's ``gone`` and ``link`` to mid: "first" is asleep in a utility across the
    death and the restart, and applies it (and mid after it) only once it wakes. Linked in
    before that, the new process got that abort from mid (and would have passed it on
    untagged, with no order to the tagged abort sent after the death, to a next stage)."""

    @pytest.mark.parametrize("replicas", [1, 2], ids=["single", "pool"])
    def test_a_late_abort_upstream_never_reaches_the_new_process(
        self, launch: Any, replicas: int, monkeypatch: pytest.MonkeyPatch, no_leftovers: str
    ) -> None:
        pipe = launch(
            [
                PipelineStage(RELAY, name="first"),
                PipelineStage(RELAY, name="mid"),
                PipelineStage(RELAY, name="last", replicas=replicas, restart=FAST),
            ]
        )
        pool = replicas > 1
        key = "last[0]" if pool else "last"
        core = pipe._core
        real = core.aborted
        late: list[tuple[int, list[str]]] = []  # last's answers about r once it is dead
        gate = pathlib.Path(no_leftovers, "gate")  # first's loop is blocked while it exists
        gate.touch()
        waiting = self._waiting(pipe)

        def aborted(k: int, req_ids: Any, *args: Any, **kwargs: Any) -> None:
            ids = list(req_ids)
            if k == 2 and "r" in ids and core.restarts(2, 0):
                late.append((k, ids))
            real(k, ids, *args, **kwargs)

        monkeypatch.setattr(core, "aborted", aborted)
        pipe.call_utility("last", "hold", True, replica=0 if pool else None)
        stream = pipe.add("r", "x")
        assert core.route("r")[2] == 0
        assert wait_until(lambda: _held(pipe, "last") == 1, 10)  # r is in last[0]
        victim = pipe.call_utility("last", "pid", replica=0 if pool else None)

        calls = _utility_calls(pipe, "first")
        blocked = threading.Thread(target=pipe.call_utility, args=("first", "gate", str(gate)))
        blocked.start()
        try:
            assert wait_until(lambda: _utility_calls(pipe, "first") > calls, 10)  # in it now
            os.kill(victim, signal.SIGKILL)
            with pytest.raises(PipelineStageDeadError):
                stream.collect(timeout=10)
            # The new process started, and waits for first, then mid, to apply r's abort:
            # not linked in while first's loop is blocked.
            assert waiting.wait(30)
            assert not _up(pipe, key)
        finally:
            gate.unlink()
            blocked.join(30)
        assert wait_until(lambda: _up(pipe, key), 30), (pipe.restarts, pipe.health())
        assert wait_until(lambda: pipe.in_flight == 0, 10), pipe.in_flight
        # Requests through every process of last: each goes on mid's link to it after
        # anything mid sent there before, so any answer of the new process about r (to an
        # abort mid passed on to it) has reached the coordinator once they are out. Held in
        # last until their routes are read (a request that ended has none).
        pipe.call_utility("last", "hold", True)
        streams = [pipe.add(f"n{i}", i) for i in range(2 * replicas)]
        assert {core.route(f"n{i}")[2] for i in range(2 * replicas)} == set(range(replicas))
        pipe.call_utility("last", "hold", False)
        assert [s.collect(timeout=10) for s in streams] == [[i] for i in range(2 * replicas)]
        assert late == []  # nothing of the dead process's request reached the new one
        assert pipe.add("r", "again").collect(timeout=10) == ["again"]
        assert wait_until(lambda: pipe.in_flight == 0, 10)
        for name in ("first", "mid", "last"):
            assert wait_until(lambda n=name: _held(pipe, n) == 0, 10)

    @staticmethod
    def _waiting(pipe: Any) -> threading.Event:
        """Set once a restart of *pipe* waits to link its new process in."""
        inner = getattr(pipe, "_pipe", pipe)
        real = inner._link_wait
        waiting = threading.Event()

        def link_wait(k: int, r: int, wake: Any) -> None:
            real(k, r, wake)
            if wake is not None:
                waiting.set()

        inner._link_wait = link_wait
        return waiting

    @staticmethod
    def _kill_last_while_first_blocked(pipe: Any, gate: pathlib.Path) -> threading.Thread:
        """r held in last (its one process), first's loop blocked while the file *gate*
        exists (made here; the test removes it), then last killed: r's abort waits in
        first. Returns the thread whose utility call blocks first."""
        pipe.call_utility("last", "hold", True)
        stream = pipe.add("r", "x")
        assert wait_until(lambda: _held(pipe, "last") == 1, 10)
        victim = pipe.call_utility("last", "pid")
        gate.touch()

        def block() -> None:
            with contextlib.suppress(Exception):  # or ended by the shutdown
                pipe.call_utility("first", "gate", str(gate))

        calls = _utility_calls(pipe, "first")
        blocked = threading.Thread(target=block)
        blocked.start()
        assert wait_until(lambda: _utility_calls(pipe, "first") > calls, 10)  # in it now
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(PipelineStageDeadError):
            stream.collect(timeout=10)
        return blocked

    def test_a_shutdown_ends_the_wait_at_once(
        self, launch: Any, caplog: pytest.LogCaptureFixture, no_leftovers: str
    ) -> None:
        pipe = launch(
            [
                PipelineStage(RELAY, name="first"),
                PipelineStage(RELAY, name="mid"),
                PipelineStage(RELAY, name="last", restart=FAST),
            ]
        )
        waiting = self._waiting(pipe)
        gate = pathlib.Path(no_leftovers, "gate")
        blocked = self._kill_last_while_first_blocked(pipe, gate)
        try:
            assert waiting.wait(30)
            started = time.monotonic()
            pipe.shutdown()
            # Not the startup timeout (60 s): the stages' own shutdown only (first's loop
            # is blocked: its client waits for it up to its timeout, 5 s, then kills it).
            assert time.monotonic() - started < 15
        finally:
            gate.unlink()
            blocked.join(40)
        assert pipe.restarts["last"] == 1
        assert pipe.health()["last"] != StageHealth.OK
        assert "did not answer for the requests" not in caplog.text  # it ended cleanly

    def test_a_death_of_the_previous_process_ends_the_wait(
        self, launch: Any, no_leftovers: str
    ) -> None:
        # r went through mid[0], which dies while the restart waits for it: it sends
        # nothing more, so the new last is linked in (to mid[1]) while first is blocked.
        pipe = launch(
            [
                PipelineStage(RELAY, name="first"),
                PipelineStage(RELAY, name="mid", replicas=2),
                PipelineStage(RELAY, name="last", restart=FAST),
            ]
        )
        waiting = self._waiting(pipe)
        mid0 = pipe.call_utility("mid", "pid", replica=0)
        gate = pathlib.Path(no_leftovers, "gate")
        blocked = self._kill_last_while_first_blocked(pipe, gate)
        try:
            assert pipe._core.route("r")[1] == 0
            assert waiting.wait(30)
            assert not _up(pipe, "last")
            os.kill(mid0, signal.SIGKILL)
            assert wait_until(lambda: _up(pipe, "last"), 30), (pipe.restarts, pipe.health())
            assert blocked.is_alive()  # first is still blocked
        finally:
            gate.unlink()
            blocked.join(30)
        assert pipe.health()["mid[0]"] == StageHealth.DEAD
        assert [pipe.add(f"n{i}", i).collect(timeout=10) for i in range(3)] == [[0], [1], [2]]
        assert wait_until(lambda: pipe.in_flight == 0, 10)

    def test_a_wait_past_the_startup_timeout_is_a_failed_start(
        self, launch: Any, caplog: pytest.LogCaptureFixture, no_leftovers: str
    ) -> None:
        # first is blocked past the startup timeout (5 s): the first start's wait ends it
        # as a failed start (the new process stopped, counted by the policy), and a later
        # start, after the backoff, is linked in once first and mid applied r's abort.
        pipe = launch(
            [
                PipelineStage(RELAY, name="first"),
                PipelineStage(RELAY, name="mid"),
                PipelineStage(RELAY, name="last", restart=FAST),
            ],
            startup_timeout=5,
        )
        gate = pathlib.Path(no_leftovers, "gate")
        blocked = self._kill_last_while_first_blocked(pipe, gate)

        def up() -> bool:  # two starts or more (a fast start may time out twice)
            return bool(pipe.restarts["last"] >= 2 and pipe.health()["last"] == StageHealth.OK)

        failed = "did not answer for the requests of its dead process"
        try:
            assert wait_until(lambda: failed in caplog.text, 30)  # a start's wait ended
            assert pipe.health()["last"] != StageHealth.OK  # not linked in meanwhile
        finally:
            gate.unlink()
            blocked.join(30)
        assert wait_until(up, 40), (pipe.restarts, pipe.health())
        assert pipe.add("r", "again").collect(timeout=10) == ["again"]
        assert wait_until(lambda: pipe.in_flight == 0, 10)

    def test_an_abort_after_a_later_death_upstream_never_reaches_the_new_process(
        self, launch: Any, monkeypatch: pytest.MonkeyPatch, no_leftovers: str
    ) -> None:
        # a -> b -> c -> d, a and c restart. r is held in c when c is killed: r ends, its
        # abort goes from a and, tagged, to d, whose loop is blocked (a gate). a and b
        # apply theirs, so the new c is linked in. Then a is killed too: r, still waiting
        # for d, is
        # aborted again from b, tagged. b must not chase that abort into the new c, which
        # never held r (it would go on to d with a tag d is not waited for): r's route
        # says -1 at c (docs/wire.md section 8).
        pipe = launch(
            [
                PipelineStage(RELAY, name="a", restart=FAST),
                PipelineStage(RELAY, name="b"),
                PipelineStage(RELAY, name="c", restart=FAST),
                PipelineStage(RELAY, name="d"),
            ]
        )
        core = pipe._core
        real = core.aborted
        late: list[Any] = []  # any answer of the new c about r
        second: list[bool] = []  # b answered the abort after a's death: was d blocked?
        gate = pathlib.Path(no_leftovers, "gate")  # d's loop is blocked while it exists
        gate.touch()
        a_killed = threading.Event()

        def aborted(k: int, req_ids: Any, *args: Any, **kwargs: Any) -> None:
            ids = list(req_ids)
            if "r" in ids and k == 2 and core.restarts(2, 0):
                late.append((ids, args, kwargs))
            if "r" in ids and k == 1 and a_killed.is_set():
                second.append(gate.exists())
            real(k, ids, *args, **kwargs)

        monkeypatch.setattr(core, "aborted", aborted)
        pipe.call_utility("c", "hold", True)
        stream = pipe.add("r", "x")
        assert wait_until(lambda: _held(pipe, "c") == 1, 10)
        victims = [pipe.call_utility(name, "pid") for name in ("c", "a")]

        calls = _utility_calls(pipe, "d")
        blocked = threading.Thread(target=pipe.call_utility, args=("d", "gate", str(gate)))
        blocked.start()
        try:
            assert wait_until(lambda: _utility_calls(pipe, "d") > calls, 10)  # in it now
            os.kill(victims[0], signal.SIGKILL)
            with pytest.raises(PipelineStageDeadError):
                stream.collect(timeout=10)
            assert wait_until(lambda: _up(pipe, "c"), 30), (pipe.restarts, pipe.health())
            assert core.state("r") is RequestState.CLOSING  # d has not answered yet
            a_killed.set()
            os.kill(victims[1], signal.SIGKILL)
            assert wait_until(lambda: bool(second), 10)
            assert wait_until(lambda: _up(pipe, "a"), 30), (pipe.restarts, pipe.health())
        finally:
            gate.unlink()
            blocked.join(30)
        assert second == [True]  # the scenario ran: b answered while d was still blocked
        assert wait_until(lambda: pipe.in_flight == 0, 10), pipe.in_flight
        # A request through the new c goes on b's link after anything b sent there before;
        # c's answer to such an abort would precede its answer to this utility call.
        assert pipe.add("n", 1).collect(timeout=10) == [1]
        assert pipe.call_utility("c", "num_requests") == 0
        assert late == []
        assert pipe.add("r", "again").collect(timeout=10) == ["again"]
        assert wait_until(lambda: pipe.in_flight == 0, 10)


@pytest.mark.skipif(not _shm.available(), reason="needs /dev/shm (Linux)")
class TestSharedMemory:
    @pytest.mark.parametrize("replicas", [1, 2], ids=["single", "pool"])
    def test_a_restarted_stage_takes_and_sends_big_arrays_through_new_slots(
        self, launch: Any, replicas: int
    ) -> None:
        pipe = launch(
            [
                PipelineStage(COUNTDOWN, name="a", edge=f"{T}:to_array"),
                PipelineStage(RELAY, name="b", replicas=replicas, restart=FAST),
                PipelineStage(RELAY, name="c"),
            ]
        )
        key = "b[0]" if replicas > 1 else "b"

        def run(tag: str, n: int) -> None:
            streams = [pipe.add(f"{tag}{i}", 3) for i in range(n)]
            for stream in streams:
                outputs = stream.collect(timeout=30)
                assert [float(x[0]) for x in outputs] == [2.0, 1.0, 0.0]
                assert all(bool(np.all(x == x[0])) for x in outputs)

        run("before", 4)
        prefix = pipe._shm_prefix
        assert wait_until(lambda: pipe.stats()[key].engine.get("shm_sent", 0) > 0, 10)
        os.kill(pipe.call_utility("b", "pid", replica=0), signal.SIGKILL)

        def dead_slots() -> list[str]:  # b's first process's, and a's for it
            own = [n for n in _shm.segments(prefix + "1-") if n.split("-")[-2] == "0"]
            return _shm.segments(prefix + "0-0-") + own

        assert wait_until(lambda: not dead_slots(), 10)
        assert wait_until(lambda: _up(pipe, key), 30)
        run("after", 4 * replicas)
        # Through the new process: it takes a's arrays and sends its own, on slots named
        # with its generation (a's for it: 0-0.1-0-<n>; its own: 1-0-0.1-<n>).
        assert wait_until(lambda: pipe.stats()[key].engine.get("shm_taken", 0) >= 12, 10)
        assert wait_until(lambda: pipe.stats()[key].engine.get("shm_sent", 0) >= 12, 10)
        names = [n.removeprefix(prefix) for n in _shm.segments(prefix)]
        assert any(n.startswith("0-0.1-0-") for n in names), names
        assert any(n.startswith("1-0-0.1-") for n in names), names
        pipe.shutdown()
        assert _shm.segments(prefix) == []


# -- the coordinator's decisions, without IO ---------------------------------------------------


def _core(replicas: Sequence[int], policy: RestartPolicy) -> PipelineCore[StreamCore]:
    return PipelineCore(["a", "b", "c"], replicas=replicas, restart=[None, policy, None])


def test_core_a_dead_stage_with_a_restart_ends_its_requests_and_refuses_adds() -> None:
    core = _core((1, 1, 1), RestartPolicy(first_delay=0.25))
    assert core.pooled  # routes tell a dead process's requests from the others
    streams = [StreamCore(f"r{i}") for i in range(3)]
    for s in streams:
        core.open(s.req_id, s)
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.replica_dead(1, 0, _Dead("killed"), 1.0, d)
    assert d.restarts == [(1, 0, 0.25)]
    assert core.failure is None
    for s in streams:
        assert s._ended is not None
        assert isinstance(s._ended.exc, PipelineStageDeadError)
    with pytest.raises(NoReplicaError, match="stage 'b'"):
        core.check(["new"])
    assert core.process_state(1, 0) is ReplicaState.DEAD
    assert core.restarting(1, 0) == 1  # generation 1
    assert core.process_state(1, 0) is ReplicaState.STARTING
    with pytest.raises(NoReplicaError):
        core.check(["new"])
    assert core.started(1, 0)
    core.check(["new"])
    assert core.restarts(1, 0) == 1
    assert core.generation(1, 0) == 1


def _four(
    replicas: Sequence[int] = (1, 1, 1, 1), retry: Sequence[int] | None = None
) -> PipelineCore[StreamCore]:
    """a -> b -> c -> d, c restarts, every process tags (a stage of this build)."""
    core: PipelineCore[StreamCore] = PipelineCore(
        ["a", "b", "c", "d"],
        replicas=replicas,
        retry=retry,
        restart=[None, None, RestartPolicy(first_delay=0.1), None],
    )
    for k, n in enumerate(replicas):
        for r in range(n):
            core.tagged(k, r)
    return core


def test_core_the_corner_a_late_abort_upstream_into_the_new_process() -> None:
    # The corner "linkable" closes (module docstring, "Restarts"): c dies holding r; the
    # abort from a reaches b on a's link, in no order with the coordinator's gone and link
    # to b. Were the new c linked in before b applied it (as before: once started), b would
    # chase it down the new link into the new c, which passes it on to d untagged; yet the
    # core frees r once a and b answer (d's tagged answer is in): that copy may then reach
    # d after r's id is added again, and abort the new request there.
    core = _four()
    s = StreamCore("r")
    core.open("r", s)
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.replica_dead(2, 0, _Dead("killed"), 1.0, d)
    assert d.aborts == ["r"]
    assert d.stage_aborts == [(3, ["r"])]
    tag = d.tags[3, "r"]
    core.aborted(3, ["r"], 1.1, d, 0, False, tag)  # d applied the tagged abort
    assert core.restarting(2, 0) == 1
    assert not core.linkable(2, 0)  # b has not applied r's abort: the link must wait
    core.aborted(0, ["r"], 1.2, d)
    assert not core.linkable(2, 0)
    core.aborted(1, ["r"], 1.3, d)  # b applied it: it chased it to the dead c's link
    assert core.state("r") is None  # r is free: the copy must not be on its way via a new c
    assert core.linkable(2, 0)
    assert core.started(2, 0)


def test_core_linkable_waits_for_every_request_of_the_dead_process_only() -> None:
    core = _four(replicas=(1, 2, 2, 1))
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    for i in range(4):
        core.open(f"r{i}", StreamCore(f"r{i}"))
    routes = {rid: core.route(rid) or () for rid in ("r0", "r1", "r2", "r3")}
    on = [rid for rid, route in routes.items() if route[2] == 0]
    others = [rid for rid in routes if rid not in on]
    assert on
    assert others
    core.replica_dead(2, 0, _Dead("killed"), 1.0, d)
    assert core.restarting(2, 0) == 1
    assert core.linkable(1, 0)  # after the first stage, which hears only the coordinator
    for rid in on:
        assert not core.linkable(2, 0)
        core.aborted(1, [rid], 1.1, d, routes[rid][1])
    assert core.linkable(2, 0)  # b answered for each; the others' fate does not matter
    assert all(core.state(rid) is RequestState.LIVE for rid in others)


def test_core_linkable_once_the_previous_process_dies_or_the_pipeline_fails() -> None:
    # A death of b's process ends the wait (it sends nothing more); so does the pipeline's
    # failure (no request is left), and the IO layer's started() then refuses.
    core = _four(replicas=(1, 2, 1, 1))
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.open("r", StreamCore("r"))
    route = core.route("r")
    assert route is not None
    core.replica_dead(2, 0, _Dead("killed"), 1.0, d)
    assert core.restarting(2, 0) == 1
    assert not core.linkable(2, 0)
    core.replica_dead(1, route[1], _Dead("killed"), 1.1, d)
    assert core.linkable(2, 0)
    core = _four()
    core.open("r", StreamCore("r"))
    core.replica_dead(2, 0, _Dead("killed"), 1.0, d)
    assert core.restarting(2, 0) == 1
    assert not core.linkable(2, 0)
    core.stage_dead(1, _Dead("killed"), 1.1, d)
    assert core.linkable(2, 0)
    assert not core.started(2, 0)


def test_core_linkable_waits_for_the_fences_due_at_the_previous_stage() -> None:
    # b failed r, so a replays it into b: its fence goes down b's link to c after it, and
    # so does what b sends of the replay; c dies meanwhile. The new c is linked in only once
    # b has answered the fence and applied the abort, in either order.
    for fence_first in (True, False):
        core = _four(retry=[0, 1, 0, 0])
        d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
        core.open("r", StreamCore("r"))
        core.error(1, "r", "failed", 1.0, d)
        assert d.replays == [(0, "r", 1)]
        core.replica_dead(2, 0, _Dead("killed"), 1.1, d)
        assert core.restarting(2, 0) == 1
        core.aborted(0, ["r"], 1.2, d)
        answers = [True, False] if fence_first else [False, True]
        for fence in answers:
            assert not core.linkable(2, 0)
            core.aborted(1, ["r"], 1.3, d, 0, fence)
        assert core.linkable(2, 0)


def test_core_failed_starts_count_as_deaths_until_the_stage_is_dead() -> None:
    core = _core((1, 2, 1), RestartPolicy(first_delay=0.1, max_failures=3))
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.replica_dead(1, 0, _Dead("killed"), 1.0, d)
    assert d.restarts == [(1, 0, 0.1)]
    assert core.restarting(1, 0) == 1
    assert core.start_failed(1, 0, _Dead("no"), 1.5, d) == 0.2  # doubled
    assert core.restarting(1, 0) == 2
    assert core.start_failed(1, 0, _Dead("no"), 2.0, d) is None  # the third death
    assert core.process_state(1, 0) is ReplicaState.FAILED
    assert core.failure is None  # replica 1 serves
    core.check(["x"])
    core.replica_dead(1, 1, _Dead("killed"), 3.0, d)
    assert core.failure is None  # its own restart is pending
    core.replica_dead(1, 1, _Dead("killed"), 3.0, d)  # twice: nothing more
    assert core.restarting(1, 1) == 1
    core.start_failed(1, 1, _Dead("no"), 3.1, d)
    assert core.restarting(1, 1) == 2
    assert core.start_failed(1, 1, _Dead("no"), 3.2, d) is None
    assert isinstance(core.failure, PipelineStageDeadError)
    with pytest.raises(PipelineStageDeadError):
        core.check(["x"])


def test_core_a_death_while_starting_is_a_failed_start() -> None:
    core = _core((1, 2, 1), RestartPolicy(first_delay=0.1, max_failures=5))
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.replica_dead(1, 0, _Dead("killed"), 1.0, d)
    assert core.restarting(1, 0) == 1
    d = PipelineDeliveries()
    core.replica_dead(1, 0, _Dead("died while starting"), 1.2, d)  # before it was up
    assert d.restarts == [(1, 0, 0.2)]  # a second death: the delay doubled
    assert not core.started(1, 0)  # the IO layer stops what it started
    assert core.process_state(1, 0) is ReplicaState.DEAD
    assert core.restarting(1, 0) == 2
    assert core.started(1, 0)


def test_core_a_restart_given_up_fails_the_process_as_max_failures_would() -> None:
    # The IO layer gives a restart up (AsyncPipeline: its task was cancelled, the pipeline
    # open): in the backoff (dead) or while starting, the process is failed; its stage is
    # dead once it has no process live or coming back.
    core = _core((1, 2, 1), RestartPolicy(first_delay=0.1))
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.replica_dead(1, 0, _Dead("killed"), 1.0, d)
    assert core.abandoned(1, 0, _Dead("given up"), 1.1, d)  # in its backoff
    assert core.process_state(1, 0) is ReplicaState.FAILED
    assert core.restarting(1, 0) is None  # no start after it
    assert not core.abandoned(1, 0, _Dead("given up"), 1.1, d)  # failed already: nothing
    assert not core.abandoned(1, 1, _Dead("given up"), 1.1, d)  # serving: nothing
    assert core.failure is None
    core.check(["x"])  # replica 1 serves
    core.replica_dead(1, 1, _Dead("killed"), 2.0, d)
    with pytest.raises(NoReplicaError):
        core.check(["x"])  # restarting
    assert core.restarting(1, 1) == 1
    d = PipelineDeliveries()
    assert core.abandoned(1, 1, _Dead("its restart task was cancelled"), 2.1, d)  # starting
    assert core.process_state(1, 1) is ReplicaState.FAILED
    assert not core.started(1, 1)  # the IO layer stops what it started
    assert isinstance(core.failure, PipelineStageDeadError)
    assert core.failure.stage == "b"
    assert core.failure.replica == 1
    with pytest.raises(PipelineStageDeadError, match="restart task was cancelled"):
        core.check(["x"])
    # Once the pipeline failed or closed, there is nothing to give up.
    core = _core((1, 1, 1), RestartPolicy(first_delay=0.1))
    core.replica_dead(1, 0, _Dead("killed"), 1.0, d)
    core.close(EngineDeadError("closed"), 1.0, d)
    assert not core.abandoned(1, 0, _Dead("given up"), 1.1, d)


@pytest.mark.parametrize("late_fence", [False, True], ids=["fence lost", "fence late"])
def test_core_a_death_during_a_retry_frees_the_request(late_fence: bool) -> None:
    # b failed r and a replays it (fences at b and c); then b's process dies. c's fence
    # passed through b: it may never come (b died first, or c's gone dropped it), or come
    # before c's answer to the abort the coordinator sends it after the death.
    core: PipelineCore[StreamCore] = PipelineCore(
        ["a", "b", "c"],
        replicas=(1, 1, 1),
        retry=[0, 2, 0],
        restart=[None, RestartPolicy(first_delay=0.1), None],
    )
    stream = StreamCore("r")
    core.open("r", stream)
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.error(1, "r", "refused", 1.0, d)
    assert d.replays == [(0, "r", 1)]
    assert stream._ended is None
    d = PipelineDeliveries()
    core.replica_dead(1, 0, _Dead("killed"), 1.1, d)
    assert stream._ended is not None
    assert isinstance(stream._ended.exc, PipelineStageDeadError)  # not retried
    assert d.aborts == ["r"]  # from the first stage
    assert d.stage_aborts == [(2, ["r"])]  # and from the stage after the dead one
    core.aborted(0, ["r"], 1.2, d)
    assert core.state("r") is not None  # c has not answered yet
    # Unflagged (a stage of an older build, docs/wire.md section 8): the fence's answer,
    # or the abort's, which cannot be told apart (test_pipeline_core.py: a flagged one).
    core.aborted(2, ["r"], 1.3, d)
    assert core.state("r") is None  # free: the id, and its place in the budget
    assert core.in_flight == 0
    if late_fence:
        core.aborted(2, ["r"], 1.4, d)  # the other answer: nothing more
    assert core.restarting(1, 0) == 1
    assert core.started(1, 0)
    core.check(["r"])  # the id may be used again


def test_core_no_restart_once_the_pipeline_failed_or_closed() -> None:
    core = _core((1, 1, 1), RestartPolicy(first_delay=0.1))
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.replica_dead(1, 0, _Dead("killed"), 1.0, d)
    core.close(EngineDeadError("closed"), 1.0, d)
    assert core.restarting(1, 0) is None
    core = _core((1, 1, 1), RestartPolicy(first_delay=0.1))
    core.replica_dead(1, 0, _Dead("killed"), 1.0, d)
    assert core.restarting(1, 0) == 1
    core.close(EngineDeadError("closed"), 1.0, d)
    assert not core.started(1, 0)


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("open"), st.integers(1, 3), st.just(0)),
        st.tuples(st.just("done"), st.integers(0, 50), st.just(0)),
        st.tuples(st.just("kill"), st.integers(0, 2), st.integers(0, 2)),
        st.tuples(st.just("start"), st.integers(0, 2), st.integers(0, 2)),
        st.tuples(st.just("fail_start"), st.integers(0, 2), st.integers(0, 2)),
        st.tuples(st.just("give_up"), st.integers(0, 2), st.integers(0, 2)),
        st.tuples(st.just("give_up_start"), st.integers(0, 2), st.integers(0, 2)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(_ops)
def test_core_restarts_against_a_model(ops: list[tuple[str, int, int]]) -> None:
    """Deaths, restarts (the backoff over: ``restarting``, then ``started``), failed
    starts and restarts given up (``abandoned``: in the backoff, or while starting) of every
    stage's processes, interleaved with requests, against a model of each process's state
    (``up``, ``dead`` with a restart pending, ``starting``, ``failed`` after
    ``max_failures`` deaths or a restart given up): routes name live processes only, the
    counts per process are the requests routed there, a dead process's requests end with
    its error, an add is refused (``NoReplicaError``) while a stage has no live process but
    one coming, and the pipeline fails only once a stage has neither."""
    replicas = (1, 3, 2)
    names = ["a", "b", "c"]
    policy = RestartPolicy(first_delay=0.1, max_delay=0.4, max_failures=3, window=1e9)
    core: PipelineCore[StreamCore] = PipelineCore(names, replicas=replicas, restart=[policy] * 3)
    state = [["up"] * n for n in replicas]
    deaths = [[0] * n for n in replicas]
    gens = [[0] * n for n in replicas]
    streams: dict[str, StreamCore] = {}
    seq = 0
    now = 0.0
    for op, x, y in ops:
        now += 1.0
        d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
        if core.failure is not None:
            break
        down = [k for k in range(3) if "up" not in state[k]]
        if op == "open":
            if down:
                with pytest.raises(NoReplicaError, match=f"stage '{names[min(down)]}'"):
                    core.check(["new"])
                continue
            for _ in range(x):
                rid = f"r{seq}"
                seq += 1
                stream = StreamCore(rid)
                core.open(rid, stream)
                streams[rid] = stream
                route = core.route(rid)
                assert route is not None
                assert all(state[k][r] == "up" for k, r in enumerate(route))
        elif op == "done":
            ids = [rid for rid in streams if core.state(rid) is not None]
            if not ids:
                continue
            rid = ids[x % len(ids)]
            route = core.route(rid)
            assert route is not None
            core.outputs(2, [rid], [True], [5], now, d, route[2])
            assert core.state(rid) is None
        elif op == "kill":
            k, r = x, y % replicas[x]
            if state[k][r] != "up":
                continue
            on = [rid for rid in streams if (core.route(rid) or (-1,) * 3)[k] == r]
            core.replica_dead(k, r, _Dead("killed"), now, d)
            deaths[k][r] += 1
            state[k][r] = "failed" if deaths[k][r] >= 3 else "dead"
            assert d.restarts == ([] if state[k][r] == "failed" else [(k, r, d.restarts[0][2])])
            for rid in on:
                end = streams[rid]._ended
                assert end is not None
                assert isinstance(end.exc, PipelineStageDeadError)
                assert end.exc.stage == names[k]
                assert end.exc.replica == (r if replicas[k] > 1 else None)
                # The other stages confirm its abort (the dead one counts as having).
                route = core.route(rid)
                if route is not None:
                    for j in range(3):
                        if j != k:
                            core.aborted(j, [rid], now, d, route[j])
                assert core.state(rid) is None
        elif op == "give_up":  # in the backoff
            k, r = x, y % replicas[x]
            given_up = core.abandoned(k, r, _Dead("cancelled"), now, d)
            assert given_up == (state[k][r] == "dead")
            if given_up:
                state[k][r] = "failed"
        else:  # the backoff is over: a start, which succeeds, fails or is given up
            k, r = x, y % replicas[x]
            generation = core.restarting(k, r)
            if state[k][r] != "dead":
                assert generation is None
                continue
            gens[k][r] += 1
            assert generation == gens[k][r]
            assert core.process_state(k, r) is ReplicaState.STARTING
            if op == "start":
                assert core.started(k, r)
                state[k][r] = "up"
            elif op == "give_up_start":
                assert core.abandoned(k, r, _Dead("cancelled"), now, d)
                assert not core.started(k, r)
                state[k][r] = "failed"
            else:
                delay = core.start_failed(k, r, _Dead("no"), now, d)
                deaths[k][r] += 1
                state[k][r] = "failed" if deaths[k][r] >= 3 else "dead"
                assert (delay is None) == (state[k][r] == "failed")
        # The pipeline failed exactly when a stage has no process live or coming back.
        gone = any(all(s == "failed" for s in state[k]) for k in range(3))
        assert (core.failure is not None) == gone
        if gone:
            break
        for k in range(3):
            assert core.alive(k) == [s == "up" for s in state[k]]
            counts = [0] * replicas[k]
            for rid in streams:
                route = core.route(rid)
                if route is not None:
                    counts[route[k]] += 1
            assert core.load(k) == counts
            for r in range(replicas[k]):
                assert core.restarts(k, r) == gens[k][r]


class TestLinkMessage:
    """The ``link`` message at the stage (``docs/wire.md`` section 8), the test playing the
    coordinator (a client) and the next stage's replica, before and after its restart (two
    ``ROUTER`` sockets)."""

    def test_a_link_reconnects_to_the_new_address_with_a_fresh_window(
        self, no_leftovers: str
    ) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        nexts: list[zmq.Socket[bytes]] = []

        def next_stage() -> tuple[zmq.Socket[bytes], str]:
            sock = ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(f"ipc://{no_leftovers}/next{len(nexts)}")
            nexts.append(sock)
            return sock, f"ipc://{no_leftovers}/next{len(nexts) - 1}"

        def taken(sock: zmq.Socket[bytes]) -> tuple[bytes, list[Any]]:
            assert sock.poll(10_000), "nothing came on the link"
            ident, body, *_ = sock.recv_multipart()
            return ident, msgspec.msgpack.decode(body)

        old, old_address = next_stage()
        kwargs = {
            "factory": COUNTDOWN,
            "stage": "a",
            "downstream": [old_address],
            "window": 2,
            "routed": True,
            "replica": 0,
            "link_id": link_id(0, 0, replica=0),
        }
        client = StageClient.launch(PIPE_FACTORY, kwargs, startup_timeout=30, ordered_events=True)
        try:
            client._send(ClientSession.route_frame(["r1"], [[0]]))
            client._send_request("r1", ClientSession.add_frame("r1", 5), False)
            sent: list[str] = []
            while len(sent) < 2:  # the window (2) fills up, and no credit comes back
                ident, msg = taken(old)
                assert ident == b"pipe-link-0.0-r0"
                assert msg[0] == "pipe"
                sent += msg[2]
            assert set(sent) == {"r1"}
            assert client.call_utility(LINKS_UTILITY) == [True]
            assert wait_until(lambda: client.stats().engine["edge_waits"] > 0, 10)
            assert not old.poll(100)  # held back by the window
            client._send(ClientSession.abort_frame(["r1"], [[]]))  # r1 goes; no credit back
            ident, msg = taken(old)
            assert msg[:2] == ["abort", ["r1"]]
            assert client.stats().engine["edge_in_flight"] >= 2
            # The next stage's process was started again at a new address (its gone not
            # sent: the link replaces the one still open).
            new, new_address = next_stage()
            client._send(ClientSession.link_frame(0, new_address))
            assert client.call_utility(LINKS_UTILITY) == [True]
            # The new link's window is empty: two requests' items go out at once.
            client._send(ClientSession.route_frame(["r2", "r3"], [[0], [0]]))
            client._send_requests(
                ["r2", "r3"], ClientSession.adds_frame([("r2", 1), ("r3", 1)])[1], False
            )
            got: list[str] = []
            while len(got) < 2:
                ident, msg = taken(new)
                assert ident == b"pipe-link-0.0-r0"  # this stage's own link: unchanged
                got += msg[2]
            assert sorted(got) == ["r2", "r3"]
            assert not old.poll(100)  # nothing more to the old address
            # A gone, then a link again (the usual order).
            client._send(ClientSession.gone_frame("next", "", 0))
            assert client.call_utility(LINKS_UTILITY) == [False]
            client._send(ClientSession.link_frame(0, old_address))
            assert client.call_utility(LINKS_UTILITY) == [True]
            client._send(ClientSession.route_frame(["r4"], [[0]]))
            client._send_request("r4", ClientSession.add_frame("r4", 1), False)
            assert taken(old)[1][2] == ["r4"]
        finally:
            client.shutdown()
            for i, sock in enumerate(nexts):
                sock.close()
                with contextlib.suppress(FileNotFoundError):  # the test's own ipc files
                    os.unlink(f"{no_leftovers}/next{i}")
            ctx.term()

    def test_a_link_with_a_server_key_connects_as_a_curve_client_with_the_link_keys(
        self, no_leftovers: str
    ) -> None:
        # A restarted next stage on Ray listens on TCP with CURVE: the `link` names its
        # server key, and the stage connects with its own link key pair, which the next
        # stage's authenticator admits (and nothing else). A stage without link keys does
        # not connect such a link.
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        server_public, server_secret = zmq.curve_keypair()
        link_public, link_secret = zmq.curve_keypair()
        curve = ServerCurve(server_public, server_secret, frozenset([link_public]), "")
        auth = Authenticator(ctx, curve)
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        secure_server(sock, curve)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        address = f"tcp://127.0.0.1:{port}"
        gone_next = ClientSession.gone_frame("next", "", 0)
        base = {
            "factory": COUNTDOWN,
            "downstream": [f"ipc://{no_leftovers}/nowhere"],
            "routed": True,
            "replica": 0,
            "link_id": link_id(0, 0, replica=0),
        }
        keyed = {**base, "stage": "a", "link_keys": [link_public, link_secret]}
        keyless = {**base, "stage": "b"}
        try:
            with StageClient.launch(
                PIPE_FACTORY, keyless, startup_timeout=30, ordered_events=True
            ) as client:
                client._send(gone_next)
                client._send(ClientSession.link_frame(0, address, "", server_public.decode()))
                assert client.call_utility(LINKS_UTILITY) == [False]  # not replaced
            with StageClient.launch(
                PIPE_FACTORY, keyed, startup_timeout=30, ordered_events=True
            ) as client:
                client._send(gone_next)
                client._send(ClientSession.link_frame(0, address, "", server_public.decode()))
                assert client.call_utility(LINKS_UTILITY) == [True]
                client._send(ClientSession.route_frame(["r1"], [[0]]))
                client._send_request("r1", ClientSession.add_frame("r1", 2), False)
                assert sock.poll(10_000), "nothing came on the CURVE link"
                ident, body, *_ = sock.recv_multipart()
                assert ident == b"pipe-link-0.0-r0"
                msg = msgspec.msgpack.decode(body)
                assert (msg[0], msg[2]) == ("pipe", ["r1"])
        finally:
            sock.close()
            auth.stop()
            ctx.term()

    def test_a_bad_link_is_an_error_and_changes_nothing(self, no_leftovers: str) -> None:
        with StageClient.launch(
            PIPE_FACTORY, {"factory": RELAY, "stage": "b"}, startup_timeout=30, ordered_events=True
        ) as client:
            client._send([msgspec.msgpack.encode(["link", "zero", 5])])
            error = client.get_event(timeout=10)
            assert isinstance(error, ErrorReport)
            assert error.req_id is None
            assert "invalid message" in error.message
            assert client.call_utility(LINKS_UTILITY) == []  # the last stage: no link

    def test_data_for_a_gone_process_waits_for_the_link_to_its_successor(
        self, no_leftovers: str
    ) -> None:
        # docs/wire.md section 8, "Restarts", in a stage process: process 0 of its next
        # stage is gone and restarts (next_restarts, which pipe_kwargs sets for a next stage
        # that restarts). In a pipeline, a request routed to the new process can reach this
        # stage before the `link` does (its data comes on another connection; the
        # coordinator makes the new process routable without this stage's answer once the
        # link's start waited past startup_timeout); here the test plays the coordinator
        # and sends them in that order. r1's items are held and go down the new link
        # first, in order, before r3's, sent later; r2, aborted before the link, leaves
        # nothing to send.
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        new = ctx.socket(zmq.ROUTER)
        new.setsockopt(zmq.LINGER, 0)
        new.bind(f"ipc://{no_leftovers}/next-new")
        kwargs = {
            "factory": COUNTDOWN,
            "stage": "a",
            "downstream": [f"ipc://{no_leftovers}/next-dead"],
            "routed": True,
            "replica": 0,
            "link_id": link_id(0, 0, replica=0),
            "next_restarts": True,
        }
        client = StageClient.launch(PIPE_FACTORY, kwargs, startup_timeout=30, ordered_events=True)

        def engine(key: str) -> float:
            return float(client.stats().engine.get(key, -1))

        def items() -> list[tuple[int, str, Any]]:  # what comes on the new link next
            assert new.poll(10_000), "nothing came on the new link"
            _ident, body, *_ = new.recv_multipart()
            msg = msgspec.msgpack.decode(body)
            assert msg[0] == "pipe"
            return list(zip(msg[1], msg[2], msg[3], strict=True))

        try:
            client._send(ClientSession.gone_frame("next", "", 0))
            assert client.call_utility(LINKS_UTILITY) == [False]
            client._send(ClientSession.route_frame(["r1", "r2"], [[0], [0]]))
            client._send_requests(
                ["r1", "r2"], ClientSession.adds_frame([("r1", 3), ("r2", 3)])[1], False
            )
            # Each: 2, 1, 0 and its END, held (nothing in flight).
            assert wait_until(lambda: engine("edge_held") == 8, 10)
            assert engine("edge_in_flight") == 0
            client._send(ClientSession.abort_frame(["r2"], [[]]))
            assert wait_until(lambda: engine("edge_held") == 4, 10)
            assert engine("edge_dropped") == 4
            client._send(ClientSession.link_frame(0, f"ipc://{no_leftovers}/next-new"))
            client._send(ClientSession.route_frame(["r3"], [[0]]))
            client._send_request("r3", ClientSession.add_frame("r3", 1), False)
            got: list[tuple[int, str, Any]] = []
            while len(got) < 5:
                got += items()
            assert got == [
                (FIRST, "r1", 2),
                (MORE, "r1", 1),
                (MORE, "r1", 0),
                (END, "r1", None),
                (ONLY, "r3", 0),
            ]
            assert not new.poll(100)
            assert client.call_utility(LINKS_UTILITY) == [True]
            assert engine("edge_in_flight") == 5  # sent: in flight now (no credit back)
        finally:
            client.shutdown()
            new.close()
            with contextlib.suppress(FileNotFoundError):  # the test's own ipc file
                os.unlink(f"{no_leftovers}/next-new")
            ctx.term()
