"""AsyncStageClient: the same abilities and error semantics, on asyncio."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable

import pytest

from enginecore.stage import (
    Aborted,
    AsyncStageClient,
    EngineDeadError,
    Output,
    RequestError,
    Shutdown,
    StageClosedError,
    StageStartupError,
    UtilityError,
)

from .conftest import SCRIPTED

Body = Callable[[AsyncStageClient], Awaitable[None]]


def run_with_stage(body: Body, **kwargs: object) -> None:
    async def main() -> None:
        async with await AsyncStageClient.launch(SCRIPTED, **kwargs) as client:  # type: ignore[arg-type]
            await body(client)

    asyncio.run(main())


class TestAsyncRoundTrip:
    def test_add_streams_outputs_until_finished(self) -> None:
        async def body(client: AsyncStageClient) -> None:
            stream = await client.add("r1", 3)
            assert [x async for x in stream] == [2, 1, 0]
            assert stream.finished

        run_with_stage(body)

    def test_abort_mid_stream(self) -> None:
        async def body(client: AsyncStageClient) -> None:
            stream = await client.add("long", 1_000_000)
            assert await stream.get(5) == 999_999
            await client.abort(["long"])
            await stream.collect(timeout=5)
            assert stream.aborted
            # Nothing of "long" after the Aborted event.
            seen_abort = False
            await client.call_utility("echo", "barrier", timeout=5)
            while True:
                event = await client.get_event(5)
                if isinstance(event, Aborted):
                    seen_abort = True
                elif seen_abort and isinstance(event, Output):
                    assert event.req_id != "long"
                elif getattr(event, "result", None) == ["barrier"]:
                    break
            assert seen_abort

        run_with_stage(body, ordered_events=True)

    def test_many_utility_calls_in_flight(self) -> None:
        async def body(client: AsyncStageClient) -> None:
            results = await asyncio.gather(
                *(client.call_utility("div", i, i % 3, timeout=10) for i in range(200)),
                return_exceptions=True,
            )
            for i, result in enumerate(results):
                if i % 3 == 0:
                    assert isinstance(result, UtilityError)
                    assert "ZeroDivisionError" in result.remote_repr
                else:
                    assert result == i / (i % 3)

        run_with_stage(body)

    def test_utility_timeout(self) -> None:
        async def body(client: AsyncStageClient) -> None:
            with pytest.raises(TimeoutError):
                await client.call_utility("sleep", 0.5, timeout=0.05)
            assert await client.call_utility("echo", 1, timeout=5) == [1]

        run_with_stage(body)

    def test_unencodable_payloads(self) -> None:
        async def body(client: AsyncStageClient) -> None:
            with pytest.raises(TypeError, match="not wire-encodable"):
                await client.add("r", {1})
            bad = await client.add("bad", 10_000_000)
            await client.call_utility("poison", "bad", timeout=5)
            with pytest.raises(RequestError):
                await bad.collect(timeout=5)

        run_with_stage(body)

    def test_event_stream_ends_after_our_shutdown(self) -> None:
        async def main() -> None:
            client = await AsyncStageClient.launch(SCRIPTED, ordered_events=True)
            await (await client.add("r", 1)).collect(timeout=5)
            assert await client.shutdown() == 0
            events = [event async for event in client.events()]
            assert events[-1] == Shutdown()
            with pytest.raises(StageClosedError):
                await client.add("x", 1)
            assert await client.shutdown() == 0  # idempotent

        asyncio.run(main())


class TestAsyncDeath:
    def test_sigkill_fails_every_waiter_within_1s(self) -> None:
        async def body(client: AsyncStageClient) -> None:
            stream = await client.add("r", 1_000_000_000)
            await stream.get(5)
            calls = [asyncio.ensure_future(client.call_utility("sleep", 10)) for _ in range(3)]
            await asyncio.sleep(0)  # let the calls be sent
            os.kill(client.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            with pytest.raises(EngineDeadError, match="killed by SIGKILL"):
                await stream.collect(timeout=5)
            for call in calls:
                with pytest.raises(EngineDeadError):
                    await asyncio.wait_for(call, 5)
            assert time.monotonic() - killed_at < 1.0
            with pytest.raises(EngineDeadError):
                await client.call_utility("echo")

        run_with_stage(body)

    def test_fatal_step(self) -> None:
        async def body(client: AsyncStageClient) -> None:
            stream = await client.add("r", 10_000_000)
            await stream.get(5)
            await client.call_utility("fail_next_step", timeout=5)
            with pytest.raises(EngineDeadError, match="scripted step failure") as info:
                await stream.collect(timeout=5)
            assert info.value.exit_code == 1

        run_with_stage(body)

    def test_lingering_process_after_fatal(self) -> None:
        async def main() -> None:
            client = await AsyncStageClient.launch(SCRIPTED)
            await client.call_utility("linger", 30, timeout=5)
            stream = await client.add("r", 10_000_000)
            await stream.get(5)
            await client.call_utility("fail_next_step", timeout=5)
            with pytest.raises(EngineDeadError, match="has not exited"):
                await stream.collect(timeout=5)
            assert await client.shutdown(timeout=0.1) == -signal.SIGTERM

        asyncio.run(main())

    def test_failing_factory(self) -> None:
        async def main() -> None:
            with pytest.raises(StageStartupError, match="RuntimeError") as info:
                await AsyncStageClient.launch("enginecore.stage.testing:failing_factory")
            assert info.value.child_traceback is not None

        asyncio.run(main())

    def test_cancelled_launch_leaves_no_stage_behind(self) -> None:
        # The fixture checks that no child process or socket file is left.
        async def main() -> None:
            task = asyncio.ensure_future(AsyncStageClient.launch(SCRIPTED))
            await asyncio.sleep(0.05)  # the spawn is under way in a worker thread
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(main())  # returns after the worker thread finished and cleaned up

    def test_shutdown_waiters_get_closed_error(self) -> None:
        async def main() -> None:
            client = await AsyncStageClient.launch(SCRIPTED)
            stream = await client.add("r", 1_000_000_000)
            await stream.get(5)
            await client.shutdown()
            with pytest.raises(StageClosedError):
                await stream.collect(timeout=5)

        asyncio.run(main())
