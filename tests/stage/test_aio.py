"""The asyncio side's waits with a timeout (``_aio``): they time out, and a cancel that comes
in the same loop iteration as what they wait for is never swallowed (``asyncio.wait_for``
before Python 3.12 returned the result instead, and the cancelled task went on: a
``launch()`` cancelled as its stage reported ready returned a client nobody closed)."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from enginecore.stage._aio import background, until, wait_event

pytestmark = pytest.mark.timeout(30)


def _cancelled_as_it_completes(
    wait: Callable[[asyncio.Event, asyncio.Future[Any]], Awaitable[Any]],
) -> None:
    """Run *wait* in a task; from one callback, complete what it waits for and cancel the
    task: the task must end cancelled."""

    async def main() -> None:
        event = asyncio.Event()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(wait(event, future))
        await asyncio.sleep(0)  # it waits now

        def both() -> None:
            event.set()
            future.set_result(1)
            task.cancel()

        asyncio.get_running_loop().call_soon(both)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()

    asyncio.run(main())


@pytest.mark.parametrize("timeout", [None, 30.0])
def test_wait_event_never_swallows_a_cancel(timeout: float | None) -> None:
    _cancelled_as_it_completes(lambda event, _: wait_event(event, timeout))


@pytest.mark.parametrize("timeout", [None, 30.0])
def test_until_never_swallows_a_cancel(timeout: float | None) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    _cancelled_as_it_completes(lambda _, future: until(future, deadline))


def test_wait_event_says_whether_the_event_was_set() -> None:
    async def main() -> None:
        event = asyncio.Event()
        assert await wait_event(event, 0.01) is False
        asyncio.get_running_loop().call_later(0.01, event.set)
        assert await wait_event(event, 30) is True
        assert await wait_event(event, 0) is True  # set already: no wait
        assert len(asyncio.all_tasks()) == 1  # no waiting task left behind

    asyncio.run(main())


def test_until_times_out_cancelling_the_future_and_raises_its_error() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        late: asyncio.Future[Any] = loop.create_future()
        assert await until(late, time.monotonic() + 0.01) is False
        assert late.cancelled()
        failed: asyncio.Future[Any] = loop.create_future()
        loop.call_soon(failed.set_exception, ValueError("its error"))
        with pytest.raises(ValueError, match="its error"):
            await until(failed, time.monotonic() + 30)

    asyncio.run(main())


def test_a_wait_closed_after_its_loop_closes_quietly() -> None:
    # A launch() whose loop closed while it waited, then closed (at exit, by the garbage
    # collector): the wait's clean-up raised "Event loop is closed" in place of the
    # GeneratorExit, and the launch's own clean-up (kill the half-started stage) never ran.
    loop = asyncio.new_event_loop()
    event = asyncio.Event()
    coro = wait_event(event, 30)
    task = loop.create_task(coro)
    loop.run_until_complete(asyncio.sleep(0.01))  # it waits now
    loop.close()
    coro.close()  # raised RuntimeError
    del task


def test_a_background_task_ended_by_keyboard_interrupt_is_not_reported_twice() -> None:
    """The interrupt leaves the event loop once; the task that it ended is not logged as
    "Task exception was never retrieved" when collected (a Ctrl-C during an
    AsyncPipeline's restart printed its traceback a second time). An ordinary exception
    goes to the loop's exception handler when the task ends; the set forgets both."""
    loop = asyncio.new_event_loop()
    seen: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    tasks: set[asyncio.Task[Any]] = set()

    async def interrupted() -> None:
        raise KeyboardInterrupt

    async def failing() -> None:
        raise ValueError("broken")

    try:
        background(loop, interrupted(), tasks)
        with pytest.raises(KeyboardInterrupt):
            loop.run_forever()
        background(loop, failing(), tasks)
        loop.run_until_complete(asyncio.sleep(0.01))
    finally:
        loop.close()
    assert not tasks
    gc.collect()  # an unretrieved exception is logged when its task is collected
    assert [type(c.get("exception")) for c in seen] == [ValueError], seen
    assert seen[0]["message"] == "enginecore background task failed"
