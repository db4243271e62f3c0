"""An :class:`~enginecore.stage.AsyncPipeline` is bound to the event loop that launched it
(``docs/pipelines.md``, "asyncio"): used from another one, it raises a clear
:class:`RuntimeError` at once, not a hang (its stages' events wake futures on its own loop
only) nor asyncio's "attached to a different loop"."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest

from enginecore.stage import AsyncPipeline

from .conftest import EventLoopThread

COUNTDOWN = "enginecore:CountdownEngine"
RELAY = "enginecore.stage.testing:relay"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

OTHER_LOOP = "AsyncPipeline belongs to another event loop"


@pytest.fixture
def on_its_loop(no_leftovers: str) -> Iterator[tuple[EventLoopThread, AsyncPipeline]]:
    """An AsyncPipeline launched on an event loop of its own thread; shut down there."""
    runner = EventLoopThread()
    try:
        pipe = runner.run(AsyncPipeline.launch([COUNTDOWN, RELAY]))
        try:
            yield runner, pipe
        finally:
            runner.run(pipe.shutdown())
    finally:
        runner.stop()


def _elsewhere(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run *coro* on a new event loop (this thread's), within 30 s."""

    async def bounded() -> Any:
        return await asyncio.wait_for(coro, 30)

    return asyncio.run(bounded())


class TestAnotherEventLoop:
    @pytest.mark.parametrize(
        "call", ["add", "add_many", "abort", "call_utility", "stats", "shutdown"]
    )
    def test_a_call_from_another_loop_raises_at_once(
        self, on_its_loop: tuple[EventLoopThread, AsyncPipeline], call: str
    ) -> None:
        runner, pipe = on_its_loop
        calls: dict[str, Callable[[], Coroutine[Any, Any, Any]]] = {
            "add": lambda: pipe.add("r", 3),
            "add_many": lambda: pipe.add_many([("r", 3)]),
            "abort": lambda: pipe.abort(["r"]),
            "call_utility": lambda: pipe.call_utility(RELAY, "pid"),
            "stats": pipe.stats,
            "shutdown": pipe.shutdown,
        }
        with pytest.raises(RuntimeError, match=OTHER_LOOP):
            _elsewhere(calls[call]())
        assert pipe.in_flight == 0  # nothing was admitted
        # On its own loop, it works as before.
        stream = runner.run(pipe.add("ok", 3))
        assert runner.run(stream.collect(timeout=10)) == [2, 1, 0]

    def test_a_stream_read_from_another_loop_raises_at_once(
        self, on_its_loop: tuple[EventLoopThread, AsyncPipeline]
    ) -> None:
        runner, pipe = on_its_loop
        runner.run(pipe.call_utility(RELAY, "hold", True))  # nothing arrives meanwhile
        stream = runner.run(pipe.add("r", 3))
        with pytest.raises(RuntimeError, match=OTHER_LOOP):
            _elsewhere(stream.collect(timeout=10))
        with pytest.raises(RuntimeError, match=OTHER_LOOP):
            _elsewhere(stream.get(timeout=10))
        runner.run(pipe.call_utility(RELAY, "hold", False))
        assert runner.run(stream.collect(timeout=10)) == [2, 1, 0]  # on its own loop
