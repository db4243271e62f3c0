"""What only the blocking StageClient does: threads.

Everything both clients promise is in ``test_clients.py`` and ``test_death.py``, run through
each client.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from enginecore.stage import Outputs, StageClient, StageClosedError

from .conftest import COUNTDOWN


class TestInputBatches:
    def test_a_burst_longer_than_one_input_batch_arrives_whole_and_in_order(
        self, client: StageClient
    ) -> None:
        # The input thread hands frames to the loop in batches of up to 512: a burst of
        # 1,300 frames spans three batches, and not one frame may be lost or reordered.
        # (The stage's behaviour: one client is enough to show it.)
        n = 1300
        for i in range(n):
            client.add(f"b{i}", 1_000_000)
        client.abort([f"b{i}" for i in range(0, n, 2)])
        log = client.call_utility("log", timeout=10)
        assert log[:n] == [f"add b{i}" for i in range(n)]
        assert log[n:] == [f"abort b{i}" for i in range(0, n, 2)]


class TestThreads:
    def test_event_consumers_share_the_stream_in_order(self, client: StageClient) -> None:
        # Each event goes to exactly one consumer, and each consumer sees its share in the
        # stage's order.
        n, steps = 50, 40
        client.call_utility_future("sleep", 0.5)
        time.sleep(0.1)
        client.add_many([(f"c{i}", steps) for i in range(n)])
        seen: list[list[tuple[int, int]]] = [[], [], []]

        def consume(mine: list[tuple[int, int]], batch: bool) -> None:
            while True:
                try:
                    events = client.get_events(1) if batch else [client.get_event(1)]
                except TimeoutError:
                    return
                for event in events:
                    if isinstance(event, Outputs):
                        # (step, request): increasing in the stage's order
                        mine += [
                            (steps - 1 - left, int(rid[1:]))
                            for rid, left in zip(event.req_ids, event.payloads, strict=True)
                            if rid is not None
                        ]

        threads = [
            threading.Thread(target=consume, args=(mine, i == 0)) for i, mine in enumerate(seen)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        everything = [(s, i) for s in range(steps) for i in range(n)]
        assert sorted(x for mine in seen for x in mine) == everything
        for mine in seen:
            assert mine == sorted(mine)

    def test_calls_from_many_threads(self, client: StageClient) -> None:
        def work(t: int) -> list[object]:
            return [client.call_utility("echo", t, i, timeout=10) for i in range(50)]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(work, range(4)))
        assert results == [[[t, i] for i in range(50)] for t in range(4)]

    def test_adds_from_many_threads(self, client: StageClient) -> None:
        def work(t: int) -> list[list[object]]:
            streams = [client.add(f"t{t}-{i}", 3) for i in range(50)]
            streams += client.add_many([(f"t{t}-m{i}", 2) for i in range(50)])
            return [s.collect(timeout=10) for s in streams]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(work, range(4)))
        assert results == [[[2, 1, 0]] * 50 + [[1, 0]] * 50] * 4

    def test_a_stream_read_in_another_thread_is_woken(self, client: StageClient) -> None:
        stream = client.add("r", 2)
        got: list[object] = []
        reader = threading.Thread(target=lambda: got.extend(stream))
        reader.start()
        reader.join(10)
        assert got == [1, 0]

    def test_shutdown_is_idempotent_and_thread_safe(self, client: StageClient) -> None:
        codes: list[int | None] = []
        threads = [
            threading.Thread(target=lambda: codes.append(client.shutdown())) for _ in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert codes == [0, 0, 0]
        assert client.exit_code == 0

    def test_close_from_a_done_callback_closes_and_wakes_waiters(self, client: StageClient) -> None:
        # Done-callbacks run on the client's receiver thread, which close() must join.
        stream = client.add("long", 10_000_000)
        stream.get(5)
        errors: list[BaseException] = []

        def close_from_callback(_: concurrent.futures.Future[object]) -> None:
            try:
                client.close()
            except BaseException as exc:
                errors.append(exc)

        client.call_utility_future("echo").add_done_callback(close_from_callback)
        with pytest.raises(StageClosedError):
            stream.collect(timeout=5)
        assert errors == []
        assert client.closed
        client.close()  # waits for the close the callback started
        assert client.exit_code == 0

    def test_a_cancelled_future_drops_its_answer(self) -> None:
        with StageClient.launch(COUNTDOWN) as client:
            future = client.call_utility_future("div", 1, 2)
            future.cancel()
            assert client.call_utility("div", 1, 4, timeout=5) == 0.25
