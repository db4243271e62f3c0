"""One suite for both pipelines: :class:`BlockingAsyncPipeline`, an
:class:`~enginecore.stage.AsyncPipeline` behind :class:`~enginecore.stage.Pipeline`'s
blocking interface, :func:`launcher`, which the pipeline test modules' ``launch``
fixtures (``[sync]``, ``[async]``) open, and the checks the suites share."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, cast

import pytest

from enginecore.stage import (
    AsyncPipeline,
    EngineDeadError,
    Pipeline,
    PipelineStage,
    PipelineStageDeadError,
    StageStatistics,
)

from .conftest import BlockingAsyncStream, EventLoopThread, wait_until

Launch = Callable[..., Pipeline]


class BlockingAsyncPipeline:
    """An AsyncPipeline behind Pipeline's blocking interface: every call runs on the
    pipeline's event loop (in another thread) and the caller waits for it. A thin adapter:
    the behaviour under test is the async pipeline's."""

    def __init__(self, runner: EventLoopThread, pipe: AsyncPipeline) -> None:
        self._runner = runner
        self._pipe = pipe

    def _on_loop(self, fn: Any, *args: Any) -> Any:
        async def call() -> Any:
            return fn(*args)

        return self._runner.run(call())

    @property
    def stages(self) -> tuple[str, ...]:
        return self._pipe.stages

    @property
    def replicas(self) -> tuple[int, ...]:
        return self._pipe.replicas

    @property
    def closed(self) -> bool:
        return bool(self._on_loop(lambda: self._pipe.closed))

    @property
    def in_flight(self) -> int:
        return int(self._on_loop(lambda: self._pipe.in_flight))

    @property
    def bytes_in(self) -> int:
        return int(self._on_loop(lambda: self._pipe.bytes_in))

    @property
    def restarts(self) -> dict[str, int]:
        return cast(dict[str, int], self._on_loop(lambda: self._pipe.restarts))

    def add(self, req_id: str, data: Any, **kwargs: Any) -> BlockingAsyncStream:
        stream = self._runner.run(self._pipe.add(req_id, data, **kwargs))
        return BlockingAsyncStream(self._runner, stream)

    def add_many(self, items: Any, **kwargs: Any) -> list[BlockingAsyncStream]:
        streams = self._runner.run(self._pipe.add_many(items, **kwargs))
        return [BlockingAsyncStream(self._runner, s) for s in streams]

    def abort(self, req_ids: Any) -> None:
        self._runner.run(self._pipe.abort(req_ids))

    def call_utility(
        self, stage: str, name: str, /, *args: Any, timeout: Any = None, replica: Any = None
    ) -> Any:
        return self._runner.run(
            self._pipe.call_utility(stage, name, *args, timeout=timeout, replica=replica)
        )

    def health(self) -> Any:
        return self._on_loop(self._pipe.health)

    def stats(self, timeout: float | None = 5.0) -> Any:
        return self._runner.run(self._pipe.stats(timeout))

    def client(self, stage: str, replica: int = 0) -> Any:
        return self._pipe.client(stage, replica)

    def shutdown(self, timeout: float = 5.0, *, drain: float | None = None) -> dict[str, Any]:
        return self._runner.run(self._pipe.shutdown(timeout, drain=drain))

    # The coordinator's state, which some tests read (the routes, the segments' prefix).

    @property
    def _core(self) -> Any:
        return self._pipe._core

    @property
    def _shm_prefix(self) -> Any:
        return self._pipe._shm_prefix


def shutdown_in_background(pipe: Any, client: Any, drain: float) -> Future[Any]:
    """``client.shutdown(drain=drain)`` of a stage client of *pipe* (either pipeline),
    begun in the background: its exit code, from the future."""
    if isinstance(pipe, BlockingAsyncPipeline):
        return pipe._runner.submit(client.shutdown(drain=drain))
    done: Future[Any] = Future()

    def run() -> None:
        try:
            done.set_result(client.shutdown(drain=drain))
        except BaseException as exc:  # handed to the test, which reads the future
            done.set_exception(exc)

    threading.Thread(target=run, name="test-drain", daemon=True).start()
    return done


@contextlib.contextmanager
def launcher(kind: str, startup_timeout: float = 30) -> Iterator[Launch]:
    """``launch(stages, **kwargs)``: :meth:`Pipeline.launch` (*kind* ``"sync"``), or
    :meth:`AsyncPipeline.launch` behind a :class:`BlockingAsyncPipeline` (``"async"``;
    typed as a Pipeline: it has the same interface), with *startup_timeout* unless given;
    each pipeline it launched is shut down on exit."""
    runner = EventLoopThread() if kind == "async" else None
    opened: list[Any] = []

    def launch(stages: Sequence[PipelineStage | str], **kwargs: Any) -> Pipeline:
        kwargs.setdefault("startup_timeout", startup_timeout)
        if runner is None:
            pipe: Any = Pipeline.launch(stages, **kwargs)
        else:
            pipe = BlockingAsyncPipeline(runner, runner.run(AsyncPipeline.launch(stages, **kwargs)))
        opened.append(pipe)
        return cast(Pipeline, pipe)

    try:
        yield launch
    finally:
        try:
            for pipe in opened:
                pipe.shutdown()
        finally:
            if runner is not None:
                runner.stop()


def assert_death_contained(
    pipe: Any, streams: Sequence[Any], dead: str, why: str, timeout: float
) -> None:
    """After stage *dead* of *pipe* died: every stream of *streams* ends (within *timeout*
    seconds each) with :class:`~enginecore.stage.PipelineStageDeadError` naming it, its
    message saying *why*; the pipeline then refuses new requests and holds none; the stages
    still running drop the failed requests (the one after the dead one is told it is gone,
    out of the first one's abort's reach); and ``stats()`` lists every stage, the dead one
    as its error."""
    for stream in streams:
        with pytest.raises(PipelineStageDeadError) as info:
            stream.collect(timeout=timeout)
        assert info.value.stage == dead
        assert why in str(info.value)
    with pytest.raises(PipelineStageDeadError):
        pipe.add("later", 1)
    assert pipe.in_flight == 0
    live = [name for name in pipe.stages if name != dead]
    for name in live:
        assert wait_until(lambda name=name: pipe.call_utility(name, "num_requests") == 0, 10)
    stats = pipe.stats()
    assert list(stats) == list(pipe.stages)
    assert isinstance(stats[dead], EngineDeadError)
    assert why in str(stats[dead])
    for name in live:
        assert isinstance(stats[name], StageStatistics)
        assert stats[name].live == 0


def kill_in_barrier(pipe: Any, victim: int, process: tuple[int, int]) -> threading.Event:
    """Hook *pipe* (a Pipeline or an AsyncPipeline) so that the first restart of a process
    of stage 1 kills process *victim* (*process*: its stage and replica) while its link
    barrier is in flight: after the ``link`` went to the previous stage, as the barrier's
    first confirmation is asked for, and goes on only once the coordinator has seen the
    death. The event is set once that is done."""
    real_install = pipe._install
    killed = threading.Event()
    k_dead, r_dead = process

    def seen() -> bool:
        return not pipe._core.alive(k_dead)[r_dead]

    def install(k: int, r: int, client: Any) -> Any:
        barrier = real_install(k, r, client)
        if k != 1 or killed.is_set() or not barrier:
            return barrier
        target = barrier[0]
        # The barrier's call: call_utility (AsyncStageClient), call_utility_future (a
        # StageClient's, which the blocking pipeline waits on with its deadline).
        name = "call_utility" if isinstance(pipe, AsyncPipeline) else "call_utility_future"
        real_call = getattr(target, name)
        del_hook = functools.partial(target.__dict__.pop, name, None)
        if inspect.iscoroutinefunction(real_call):

            async def acall(*args: Any, **kwargs: Any) -> Any:
                del_hook()
                os.kill(victim, signal.SIGKILL)
                while not seen():  # the death is handled on this loop
                    await asyncio.sleep(0.01)
                killed.set()
                return await real_call(*args, **kwargs)

            setattr(target, name, acall)
        else:

            def call(*args: Any, **kwargs: Any) -> Any:
                del_hook()
                os.kill(victim, signal.SIGKILL)
                assert wait_until(seen, 10)  # on a receiver thread
                killed.set()
                return real_call(*args, **kwargs)

            setattr(target, name, call)
        return barrier

    pipe._install = install
    return killed
