"""What only the AsyncStageClient does: launching off the event loop, cancellation, and
sharing the loop with other tasks.

Everything both clients promise is in ``test_clients.py`` and ``test_death.py``, run through
each client.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from enginecore.stage import AsyncStageClient, StageClosedError, _clientbase

from .conftest import SCRIPTED, EventLoopThread, child_pids, pid_gone, wait_until

SLEEPING = "enginecore.stage.testing:sleeping_factory"
DEVICE = "enginecore.stage.testing:device"


def spawned_children(pid: int) -> list[int]:
    """The children of *pid* that multiprocessing spawned (``spawn_main``): not its
    resource tracker, and not a child between its fork and its exec, whose command line is
    still its parent's (the tracker-to-be was counted as a stage so, and gone a moment
    later, on a loaded host)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                spawned = b"spawn_main" in f.read()
        except (OSError, ValueError):
            continue
        if ppid == pid and spawned:
            found.append(int(entry))
    return found


Body = Callable[[AsyncStageClient], Awaitable[None]]


def run_with_stage(body: Body, *, ordered_events: bool = False) -> None:
    async def main() -> None:
        async with await AsyncStageClient.launch(SCRIPTED, ordered_events=ordered_events) as c:
            await body(c)

    asyncio.run(main())


class TestLaunch:
    def test_cancelled_launch_leaves_no_stage_behind(self) -> None:
        # The fixture checks that no child process or socket file is left.
        async def main() -> None:
            task = asyncio.ensure_future(AsyncStageClient.launch(SCRIPTED))
            await asyncio.sleep(0.05)  # the spawn is under way in a worker thread
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(main())  # returns after the worker thread finished and cleaned up

    def test_cancelling_a_slow_launch_kills_the_stage_at_once(self) -> None:
        # The factory would take 60 s; the cancellation is seen in well under a second, and
        # the stage is already gone when it is (the fixture checks no child or file is left).
        async def main() -> float:
            before = set(child_pids())
            task = asyncio.ensure_future(
                AsyncStageClient.launch(SLEEPING, {"seconds": 60}, startup_timeout=120)
            )
            while not set(child_pids()) - before:  # the stage process is running
                await asyncio.sleep(0.01)
            (stage,) = set(child_pids()) - before
            start = time.monotonic()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            elapsed = time.monotonic() - start
            assert pid_gone(stage)
            return elapsed

        assert asyncio.run(main()) < 1.0

    def test_ctrl_c_during_a_slow_launch_exits_at_once(self, no_leftovers: str) -> None:
        script = textwrap.dedent(
            f"""
            import asyncio, tempfile
            from enginecore.stage import AsyncStageClient
            tempfile.tempdir = {no_leftovers!r}
            asyncio.run(AsyncStageClient.launch({SLEEPING!r}, {{"seconds": 60}}))
            """
        )
        proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
        try:
            assert wait_until(lambda: spawned_children(proc.pid), 30), "the stage never started"
            (stage,) = spawned_children(proc.pid)
            start = time.monotonic()
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
            elapsed = time.monotonic() - start
        finally:
            proc.kill()
            proc.communicate()  # reaps it, and closes the stderr pipe
        assert "KeyboardInterrupt" in err
        assert pid_gone(stage)
        assert elapsed < 1.0


class TestLaunchClosedWithItsLoop:
    def test_a_launch_closed_with_its_event_loop_leaves_no_stage(
        self, no_leftovers: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # The loop closed while a launch awaited its stage, then the coroutine closed (at
        # exit, or by the garbage collector): its clean-up awaited with no loop ("Exception
        # ignored ... no running event loop"), and the half-started stage stayed up until
        # the program's exit hook.
        unraisable: list[Any] = []
        monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
        before = set(child_pids())
        loop = asyncio.new_event_loop()
        coro = AsyncStageClient.launch(SLEEPING, startup_timeout=60)
        task = loop.create_task(coro)
        while not set(child_pids()) - before:  # spawned; its engine is being built
            loop.run_until_complete(asyncio.sleep(0.05))
        loop.close()
        coro.close()
        assert unraisable == []
        assert wait_until(lambda: not set(child_pids()) - before, 10)
        del task


class TestCancellation:
    @pytest.mark.parametrize("how", ["wait_for", "cancel", "close", "aexit", "loop_ends"])
    def test_a_cancelled_shutdown_still_stops_the_stage(self, how: str) -> None:
        # shutdown()/close() cancelled while it waits for a stage that cannot stop (frozen:
        # SIGSTOP): the shutdown goes on in a task of its own, the stream ends, the stage
        # is killed, and a later call waits for that shutdown and returns its exit code.
        # (It stopped where it was cancelled: closed, but the stage left frozen and its
        # streams never ended until a later call; the end of asyncio.run() left it.)
        pids: list[int] = []

        async def main() -> None:
            c = await AsyncStageClient.launch(DEVICE, {"step_s": 0.01}, startup_timeout=30)
            pid = c.pid
            assert pid is not None
            pids.append(pid)
            stream = await c.add("r", 10**6)
            await stream.__anext__()
            os.kill(pid, signal.SIGSTOP)
            if how == "wait_for":
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(c.shutdown(timeout=1), 0.05)
            else:
                closing: Awaitable[Any]
                if how == "close":
                    closing = c.close()
                elif how == "aexit":  # an `async with` whose exit is cancelled
                    closing = c.__aexit__(None, None, None)
                else:
                    closing = c.shutdown(timeout=1)
                task = asyncio.ensure_future(closing)
                await asyncio.sleep(0)  # it waits for the stage now
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            assert c.closed
            if how == "loop_ends":
                return  # asyncio.run cancels the shutdown task: the stage is killed
            with pytest.raises(StageClosedError):
                await stream.collect(timeout=30)
            code = await asyncio.wait_for(c.shutdown(), 30)
            assert code is not None
            assert code == c.exit_code
            assert await c.shutdown() == code
            assert pid_gone(pid)

        asyncio.run(main())
        assert pid_gone(pids[0])

    def test_a_failed_shutdown_reaches_its_callers_and_kills_the_stage(
        self, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        # An error in the shutdown task reaches every caller that waits for it (and is
        # logged, not "never retrieved", when none does); the stage is killed all the same.
        def broken(pid: int | None, presumed: bool) -> list[Any]:
            raise RuntimeError("no signals today")

        monkeypatch.setattr(_clientbase, "escalate", broken)

        async def main() -> None:
            for waiting in (True, False):
                c = await AsyncStageClient.launch(DEVICE, startup_timeout=30)
                pid = c.pid
                assert pid is not None
                os.kill(pid, signal.SIGSTOP)
                task = asyncio.ensure_future(c.shutdown(timeout=0.1))
                await asyncio.sleep(0)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                if waiting:
                    with pytest.raises(RuntimeError, match="no signals today"):
                        await asyncio.wait_for(c.shutdown(), 30)
                    with pytest.raises(RuntimeError, match="no signals today"):
                        await c.close()
                else:
                    closing = c._closing.task
                    assert closing is not None
                    await asyncio.wait({closing})
                    await asyncio.sleep(0)  # its done callbacks run
                assert pid_gone(pid)

        with caplog.at_level(logging.WARNING, logger="enginecore.stage"):
            asyncio.run(main())
        failed = [r.getMessage() for r in caplog.records if "closing the stage" in r.getMessage()]
        assert len(failed) == 1, failed
        assert "no signals today" in failed[0]
        assert "never retrieved" not in caplog.text

    def test_a_cancelled_call_drops_its_answer(self) -> None:
        async def body(client: AsyncStageClient) -> None:
            call = asyncio.ensure_future(client.call_utility("sleep", 0.2))
            await asyncio.sleep(0)  # the call is sent
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            assert await client.call_utility("echo", 1, timeout=5) == [1]

        run_with_stage(body)

    def test_a_cancelled_reader_leaves_the_stream_readable(self) -> None:
        async def body(client: AsyncStageClient) -> None:
            sleeping = asyncio.ensure_future(client.call_utility("sleep", 0.3))
            await asyncio.sleep(0)  # the call is sent
            stream = await client.add("r", 2)  # applied after the sleep: no output yet
            reader = asyncio.ensure_future(stream.get())
            await asyncio.sleep(0)  # the reader runs until it waits
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader
            assert await stream.collect(timeout=5) == [1, 0]
            await sleeping

        run_with_stage(body)

    def test_a_cancelled_collect_keeps_the_payloads_it_had_read(self) -> None:
        # asyncio.wait_for(stream.collect(), t), or a task's cancel(), while collect() waits
        # for the end: what it had taken from the stream stays there, as after its own
        # timeout (it was lost before). A relay stage outside a pipeline emits each request's
        # input once and never ends it, so collect() takes "x" and then waits.
        async def main() -> None:
            async with await AsyncStageClient.launch("enginecore.stage.testing:relay") as c:
                stream = await c.add("r", "x")
                probe = await c.add("p", "y")
                # p's output comes in r's frame or after it: r's "x" has arrived by now.
                assert await probe.get() == "y"
                collect = asyncio.ensure_future(stream.collect())
                for _ in range(3):
                    await asyncio.sleep(0)  # it takes "x", then waits for the end
                assert not collect.done()
                collect.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await collect
                assert await asyncio.wait_for(stream.get(), 5) == "x"
                await c.abort(["r", "p"])

        asyncio.run(main())

    def test_a_cancelled_event_reader_leaves_the_stream_readable(self) -> None:
        async def body(client: AsyncStageClient) -> None:
            reader = asyncio.ensure_future(client.get_event())
            await asyncio.sleep(0)  # the reader runs until it waits
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader
            await client.call_utility("echo", 1, timeout=5)
            assert (await client.get_events(5))[0].result == [1]  # type: ignore[union-attr]

        run_with_stage(body, ordered_events=True)


class TestCancelledAsItIsAnswered:
    @pytest.mark.parametrize("wait", ["call_utility", "stats", "get", "get_event"])
    def test_a_cancel_that_comes_with_the_answer_is_not_swallowed(self, wait: str) -> None:
        # A wait with a timeout went through asyncio.wait_for, which (before Python 3.12)
        # returns the result, and drops the cancellation, when the awaited answer and the
        # cancel come in the same loop iteration: a task cancelled by a TaskGroup, or by
        # asyncio.timeout(), went on as if nothing had happened (a consumer loop never
        # stopped, and the TaskGroup waited for it for ever). Here the cancel is sent by
        # the very callback that delivers the answer.
        async def body(client: AsyncStageClient) -> None:
            if wait == "get":  # r's output comes after a wait: paced before r is added
                await client.call_utility("pace", 0.2)  # (after, a step could come first)
            stream = await client.add("r", 1) if wait == "get" else None
            waits: dict[str, Callable[[], Awaitable[Any]]] = {
                "call_utility": lambda: client.call_utility("sleep", 0.2, timeout=30),
                "stats": lambda: client.stats(timeout=30),
                "get": lambda: stream.get(timeout=30),  # type: ignore[union-attr]
                "get_event": lambda: client.get_event(timeout=30),
            }
            task = asyncio.ensure_future(waits[wait]())
            if wait == "get_event":  # the answer is the event it gets
                answer = asyncio.ensure_future(client.call_utility("sleep", 0.2))
            await asyncio.sleep(0)  # it waits now
            session = client._session

            def answered() -> bool:
                if stream is not None:
                    return bool(stream._buf)
                if wait == "get_event":
                    return bool(session.events)
                return not session._calls

            def cancel_as_answered() -> None:  # called right after a frame's deliveries
                if answered():
                    task.cancel()

            client._event_sink = cancel_as_answered
            try:
                with pytest.raises(asyncio.CancelledError):
                    await task
            finally:
                client._event_sink = None
            if stream is not None:
                await client.call_utility("pace", 0)
                assert await stream.collect(timeout=30) == [0]  # the output stayed there
            if wait == "get_event":
                await answer
                assert (await client.get_event(timeout=30)).result is None  # type: ignore[union-attr]

        run_with_stage(body, ordered_events=True)


class TestClosingTask:
    """The close that the asyncio client, pool and pipeline share, without sockets."""

    def test_a_cancelled_wait_leaves_the_close_running_for_the_next(self) -> None:
        async def main() -> None:
            closing: _clientbase.ClosingTask[int] = _clientbase.ClosingTask("a thing")
            release = asyncio.Event()
            runs = 0

            async def close() -> int:
                nonlocal runs
                runs += 1
                await release.wait()
                return 7

            assert closing.unstarted()
            closing.start(close())
            assert not closing.unstarted()
            first = asyncio.ensure_future(closing.wait())
            await asyncio.sleep(0)
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            task = closing.task
            assert task is not None
            assert not task.done()  # only the wait was cancelled
            release.set()
            assert await closing.wait() == 7
            assert runs == 1

        asyncio.run(main())

    @pytest.mark.parametrize("waiting", [True, False])
    def test_an_error_reaches_the_waiters_or_else_the_log(
        self, waiting: bool, caplog: pytest.LogCaptureFixture
    ) -> None:
        async def main() -> None:
            closing: _clientbase.ClosingTask[None] = _clientbase.ClosingTask("a thing")

            async def close() -> None:
                await asyncio.sleep(0)
                raise RuntimeError("no close today")

            closing.start(close())
            if waiting:
                with pytest.raises(RuntimeError, match="no close today"):
                    await closing.wait()
            else:
                task = closing.task
                assert task is not None
                await asyncio.wait({task})
                await asyncio.sleep(0)  # its done callbacks run

        with caplog.at_level(logging.WARNING, logger="enginecore.stage"):
            asyncio.run(main())
        logged = [r.getMessage() for r in caplog.records if "closing a thing" in r.getMessage()]
        assert len(logged) == (0 if waiting else 1), logged
        assert "never retrieved" not in caplog.text

    def test_an_unfinished_close_is_redone_only_when_asked(self) -> None:
        async def main() -> None:
            closing: _clientbase.ClosingTask[None] = _clientbase.ClosingTask("a thing")

            async def close() -> None:
                await asyncio.Event().wait()

            closing.start(close())
            task = closing.task
            assert task is not None
            assert not closing.unstarted(redo_unfinished=True)  # still running
            task.cancel()
            await asyncio.wait({task})
            assert not closing.unstarted()
            assert closing.unstarted(redo_unfinished=True)

        asyncio.run(main())

    def test_waiting_before_the_start_is_a_clear_error(self) -> None:
        closing: _clientbase.ClosingTask[None] = _clientbase.ClosingTask("a thing")
        with pytest.raises(RuntimeError, match="not started"):
            asyncio.run(closing.wait())


class TestUnclosed:
    @pytest.mark.timeout(60)
    def test_a_client_never_closed_does_not_hang_the_garbage_collector(
        self, no_leftovers: str
    ) -> None:
        # asyncio.run() ends with the client never closed, and a gc.collect() finalises
        # its ZeroMQ context: pyzmq's Context.__del__ waited for ever in term() for the
        # client's sockets, garbage in the same pass but not closed yet. Now the client's
        # own finalizer closes them (with a ResourceWarning, as an unclosed file), and the
        # stage is stopped at exit, as any stage left unclosed.
        script = textwrap.dedent(
            f"""
            import asyncio, gc, tempfile, warnings
            from enginecore.stage import AsyncStageClient
            tempfile.tempdir = {no_leftovers!r}
            async def main():
                client = await AsyncStageClient.launch({SCRIPTED!r})
                await client.call_utility("num_requests")
            asyncio.run(main())
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                gc.collect()
            print("collected", [str(w.message) for w in seen if w.category is ResourceWarning])
            """
        )
        proc = subprocess.run(
            [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=40
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("collected"), proc.stdout
        assert "unclosed AsyncStageClient" in proc.stdout, proc.stdout


class TestEventLoop:
    def test_other_tasks_run_while_a_call_waits(self) -> None:
        async def body(client: AsyncStageClient) -> None:
            ticks = 0

            async def tick() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0.01)

            ticker = asyncio.ensure_future(tick())
            await client.call_utility("sleep", 0.3, timeout=5)
            ticker.cancel()
            assert ticks >= 10

        run_with_stage(body)

    def test_many_event_readers(self) -> None:
        async def body(client: AsyncStageClient) -> None:
            readers = [asyncio.ensure_future(client.get_event(5)) for _ in range(3)]
            await asyncio.sleep(0)  # the reader runs until it waits
            for i in range(3):
                await client.call_utility("echo", i, timeout=5)
            got = sorted(e.result[0] for e in await asyncio.gather(*readers))  # type: ignore[union-attr]
            assert got == [0, 1, 2]

        run_with_stage(body, ordered_events=True)


class TestAnotherEventLoop:
    @pytest.mark.timeout(60)
    def test_a_wait_on_another_loop_raises_at_once(self, no_leftovers: str) -> None:
        # A call awaited on another loop failed with asyncio's "attached to a different
        # loop" (naming no client); a stream read there waited on a future that the
        # client's loop set from its thread: woken late, by chance, or never.
        runner = EventLoopThread()
        client = runner.run(AsyncStageClient.launch(SCRIPTED, ordered_events=True))
        try:
            # Each step sleeps 2 s first: neither the stream nor the events have anything
            # yet, so each read below has to wait.
            runner.run(client.call_utility("pace", 2.0, timeout=5))
            stream = runner.run(client.add("r1", 3))
            runner.run(client.get_events(timeout=5))  # the answer to "pace": none is left

            async def elsewhere() -> None:
                calls = [
                    client.call_utility("echo", 1, timeout=5),
                    client.stats(timeout=5),
                    client.get_events(timeout=5),
                    stream.collect(timeout=5),
                    client.shutdown(),
                ]
                for call in calls:
                    with pytest.raises(RuntimeError, match="belongs to another event loop"):
                        await call

            asyncio.run(elsewhere())
            # Nothing was taken or stopped: on its own loop, the client serves on.
            assert runner.run(stream.collect(timeout=30)) == [2, 1, 0]
            assert runner.run(client.call_utility("echo", 2, timeout=5)) == [2]
            assert runner.run(client.shutdown()) == 0
        finally:
            try:
                runner.run(client.shutdown())
            finally:
                runner.stop()


class TestAnotherEventLoopSends:
    @pytest.mark.timeout(60)
    def test_an_add_or_abort_on_another_loop_raises_and_sends_nothing(
        self, no_leftovers: str
    ) -> None:
        # add(), add_many() and abort() never wait, so they went out from any loop: the
        # request ran in the stage while its stream could be read on no loop (each read
        # raised), and nothing ever aborted it. Now they raise as the waits do, before
        # anything is sent.
        runner = EventLoopThread()
        client = runner.run(AsyncStageClient.launch(SCRIPTED))
        try:

            async def elsewhere() -> None:
                sends = [
                    client.add("r1", 3),
                    client.add("r2", 3, stream=False),
                    client.add_many([("r3", 3)]),
                    client.abort(["r1"]),
                ]
                for send in sends:
                    with pytest.raises(RuntimeError, match="belongs to another event loop"):
                        await send

            asyncio.run(elsewhere())
            assert runner.run(client.call_utility("log", timeout=10)) == []
            stream = runner.run(client.add("r1", 2))  # its id is free
            assert runner.run(stream.collect(timeout=30)) == [1, 0]
        finally:
            try:
                runner.run(client.shutdown())
            finally:
                runner.stop()

    @pytest.mark.timeout(60)
    @pytest.mark.parametrize("how", ["shutdown", "close"])
    def test_a_client_whose_loop_has_closed_can_still_be_closed(
        self, how: str, no_leftovers: str
    ) -> None:
        # asyncio.run(AsyncStageClient.launch(...)) returns a client whose loop is gone (a
        # pytest-asyncio fixture of a wider scope than the test's loop does the same). Its
        # close() and shutdown() raised "belongs to another event loop", for ever: nothing
        # could stop the stage or close the sockets until the garbage collector warned and
        # the program's exit killed it. Now they close it at once, as the end of the loop
        # does for a close under way: the stage is killed and reaped.
        client = asyncio.run(AsyncStageClient.launch(SCRIPTED))
        pid = client.pid
        assert pid is not None

        async def close() -> int | None:
            if how == "close":
                await client.close()
                return client.exit_code
            return await client.shutdown()

        with warnings.catch_warnings():
            warnings.simplefilter("error", ResourceWarning)
            code = asyncio.run(close())
        assert code == -signal.SIGKILL == client.exit_code
        assert pid_gone(pid)
        assert client.closed
        assert asyncio.run(client.shutdown()) == code  # idempotent

        async def add() -> None:
            await client.add("r", 1)

        with pytest.raises(StageClosedError):
            asyncio.run(add())


class TestOneReaderPerStream:
    def test_a_second_task_waiting_on_a_stream_raises_and_the_first_reads_on(self) -> None:
        # Before, the second waiter replaced the first's wake-up: one of the two tasks
        # waited for ever, even after the stream had ended.
        async def body(c: AsyncStageClient) -> None:
            await c.call_utility("pace", 0.01)
            stream = await c.add("r", 50)
            first = asyncio.ensure_future(stream.collect(timeout=30))
            while stream._wakeup is None:  # the first task waits on the stream now
                await asyncio.sleep(0)
            with pytest.raises(RuntimeError, match="another task is already waiting"):
                await stream.get(timeout=30)
            assert await first == list(range(49, -1, -1))

        run_with_stage(body)
