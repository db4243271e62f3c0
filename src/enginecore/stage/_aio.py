"""Waits with a timeout for the asyncio side, that never swallow a cancellation, and the
background tasks of pools and pipelines.

Not :func:`asyncio.wait_for`: before Python 3.12 it returns the result, and drops the
cancellation, when the awaited future completes in the loop iteration in which the waiting
task is cancelled (a TaskGroup's task, ``asyncio.timeout()``): the task then goes on as if
nothing had happened. A ``launch()`` cancelled as its stage reported ready returned a
client nobody would close; a consumer loop in a cancelled TaskGroup never stopped. Here the
task waits on a future of its own, which the awaited one or a timer completes: a cancel
always propagates.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine
from typing import Any

__all__ = ["background", "until", "wait_event"]


async def until(future: asyncio.Future[Any], deadline: float | None) -> bool:
    """Wait for *future* until *deadline* (a ``time.monotonic()`` reading; ``None``: no
    limit); whether it is done. On timeout it is cancelled; its exception is raised. A
    cancel of the waiting task propagates, and leaves *future* alone (a call's answer is
    then dropped by its owner, a stream's output stays buffered)."""
    if deadline is None:
        await future
        return True
    if not future.done():
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()

        def release(_: object = None) -> None:
            if not waiter.done():
                waiter.set_result(None)

        timer = loop.call_later(max(0.0, deadline - time.monotonic()), release)
        future.add_done_callback(release)
        try:
            await waiter
        finally:
            timer.cancel()
            future.remove_done_callback(release)
        if not future.done():
            future.cancel()
            return False
    future.result()  # its exception, if it has one
    return True


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait for *event* at most *timeout* seconds (``None``: no limit); whether it is set.
    A cancel of the waiting task propagates, whether or not the event was set meanwhile."""
    if event.is_set():
        return True
    waiting = asyncio.ensure_future(event.wait())
    try:
        deadline = None if timeout is None else time.monotonic() + timeout
        await until(waiting, deadline)
    finally:
        # Also when the coroutine is closed after its loop (GeneratorExit): a cancel then
        # raises "Event loop is closed", which must not replace what is under way.
        with contextlib.suppress(RuntimeError):
            waiting.cancel()
    return event.is_set()


def background(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None], tasks: set[asyncio.Task[Any]]
) -> asyncio.Task[None]:
    """*coro* as a task of its owner's that nobody awaits (a restart, a replica's
    supervision), kept in *tasks* (the owner's close waits for those) until it ends.

    A ``KeyboardInterrupt`` or ``SystemExit`` that ends it is not logged again as "Task
    exception was never retrieved" at exit: asyncio has already raised it out of the event
    loop (a Ctrl-C or ``SIGTERM`` that struck while a pipeline restarted a stage printed
    its traceback twice). Any other exception goes to the loop's exception handler at once,
    not only if the task is collected before the owner's close gathers it."""
    task = loop.create_task(coro)
    tasks.add(task)
    task.add_done_callback(lambda done: _forget(done, tasks))
    return task


def _forget(task: asyncio.Task[None], tasks: set[asyncio.Task[Any]]) -> None:
    tasks.discard(task)
    if task.cancelled():
        return
    exc = task.exception()  # marks it retrieved
    if exc is not None and isinstance(exc, Exception):
        task.get_loop().call_exception_handler(
            {"message": "enginecore background task failed", "exception": exc, "task": task}
        )
