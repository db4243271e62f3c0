"""StageClient against a real launched stage process: round trips, aborts, utilities."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from enginecore.stage import (
    Aborted,
    ErrorReport,
    Output,
    RequestError,
    Shutdown,
    StageClient,
    StageClosedError,
    UtilityError,
    UtilityResult,
)

from .conftest import COUNTDOWN


class TestRoundTrip:
    def test_add_streams_outputs_until_finished(self, client: StageClient) -> None:
        stream = client.add("r1", 3)
        assert list(stream) == [2, 1, 0]
        assert stream.finished
        assert not stream.aborted

    def test_events_carry_req_id_and_finished(self, client: StageClient) -> None:
        client.add("r1", 2)
        assert client.get_event(5) == Output("r1", False, 1)
        assert client.get_event(5) == Output("r1", True, 0)

    def test_many_requests_interleave_and_all_finish(self, client: StageClient) -> None:
        streams = [client.add(f"r{i}", 1 + i % 7) for i in range(300)]
        for i, stream in enumerate(streams):
            assert stream.collect(timeout=10) == list(range(i % 7, -1, -1))

    def test_countdown_factory_works_without_ordered_events(self) -> None:
        with StageClient.launch(COUNTDOWN) as client:
            assert client.add("a", 2).collect(timeout=5) == [1, 0]
            with pytest.raises(RuntimeError, match="ordered_events=True"):
                client.get_event(0)

    def test_req_id_reusable_after_finish_but_not_while_live(self, client: StageClient) -> None:
        client.add("r", 100_000)
        with pytest.raises(ValueError, match="still live"):
            client.add("r", 1)
        client.add("done", 1).collect(timeout=5)
        assert client.add("done", 2).collect(timeout=5) == [1, 0]


class TestAbort:
    def test_no_output_after_abort_is_applied(self, client: StageClient) -> None:
        stream = client.add("long", 1_000_000)
        client.add("short", 3)
        assert stream.get(5) == 999_999
        client.abort(["long"])
        rest = stream.collect(timeout=5)  # outputs produced before the abort applied
        assert stream.aborted
        assert not stream.finished
        assert rest == list(range(999_998, 999_998 - len(rest), -1))
        # The event stream: an Aborted marker, and after it no output of "long".
        seen_abort = False
        while True:
            event: object = client.get_event(5)
            if isinstance(event, Aborted):
                assert event.req_ids == ["long"]
                seen_abort = True
                break
        assert client.call_utility("num_requests", timeout=5) == 0
        for event in _drain_events(client):
            assert not (isinstance(event, Output) and event.req_id == "long")
        assert seen_abort

    def test_abort_unknown_ids_is_harmless(self, client: StageClient) -> None:
        client.abort(["nope"])
        assert client.add("r", 1).collect(timeout=5) == [0]

    def test_abort_rejects_a_bare_string(self, client: StageClient) -> None:
        with pytest.raises(TypeError, match=r"abort\(\['r1'\]\)"):
            client.abort("r1")

    def test_add_abort_add_reach_the_engine_in_order(self, client: StageClient) -> None:
        # The loop's contract end to end: three frames back to back, applied in order.
        client.add("r1", 1_000_000)
        client.abort(["r1"])
        client.add("r2", 1)
        assert client.call_utility("log", timeout=5) == ["add r1", "abort r1", "add r2"]

    def test_a_burst_longer_than_one_input_batch_arrives_whole_and_in_order(
        self, client: StageClient
    ) -> None:
        # The input thread hands frames to the loop in batches of up to 512: a burst of
        # 1,300 frames spans three batches, and not one frame may be lost or reordered.
        n = 1300
        for i in range(n):
            client.add(f"b{i}", 1_000_000)
        client.abort([f"b{i}" for i in range(0, n, 2)])
        log = client.call_utility("log", timeout=10)
        assert log[:n] == [f"add b{i}" for i in range(n)]
        assert log[n:] == [f"abort b{i}" for i in range(0, n, 2)]

    def test_a_step_longer_than_one_output_frame_arrives_whole_and_in_order(
        self, client: StageClient
    ) -> None:
        # The stage sends at most 512 events per frame: one step of 1,300 outputs is handed
        # to the output thread as one batch and leaves in three frames, none lost or reordered.
        n = 1300
        # While the loop sleeps, every add queues up: one drain applies them all, then a step.
        client.call_utility_future("sleep", 1.0)
        time.sleep(0.2)
        streams = [client.add(f"s{i}", 2) for i in range(n)]
        outputs: list[tuple[str | None, bool, object]] = []
        while len(outputs) < 2 * n:
            event = client.get_event(10)
            if isinstance(event, Output):
                outputs.append((event.req_id, event.finished, event.payload))
        assert outputs == [(f"s{i}", False, 1) for i in range(n)] + [
            (f"s{i}", True, 0) for i in range(n)
        ]
        assert all(stream.collect(timeout=5) == [1, 0] for stream in streams)

    def test_get_event_times_out_and_consumers_share_the_stream_in_order(
        self, client: StageClient
    ) -> None:
        with pytest.raises(TimeoutError):
            client.get_event(0)
        with pytest.raises(TimeoutError):
            client.get_event(0.05)
        with pytest.raises(ValueError, match="non-negative"):
            client.get_event(-1)
        # The client hands events over a frame at a time; each event still goes to exactly
        # one consumer, and each consumer sees its share in the stage's order.
        n, steps = 50, 40
        client.call_utility_future("sleep", 0.5)
        time.sleep(0.1)
        for i in range(n):
            client.add(f"c{i}", steps)
        seen: list[list[tuple[int, int]]] = [[], [], []]

        def consume(mine: list[tuple[int, int]]) -> None:
            while True:
                try:
                    event = client.get_event(1)
                except TimeoutError:
                    return
                if isinstance(event, Output):
                    assert event.req_id is not None
                    # (step, request): increasing in the stage's order
                    mine.append((steps - 1 - event.payload, int(event.req_id[1:])))

        threads = [threading.Thread(target=consume, args=(m,)) for m in seen]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        everything = [(s, i) for s in range(steps) for i in range(n)]
        assert sorted(x for mine in seen for x in mine) == everything
        for mine in seen:
            assert mine == sorted(mine)


class TestUtility:
    def test_result_and_error(self, client: StageClient) -> None:
        assert client.call_utility("div", 1, 4, timeout=5) == 0.25
        with pytest.raises(UtilityError, match="ZeroDivisionError") as info:
            client.call_utility("div", 1, 0, timeout=5)
        assert info.value.remote_repr == "ZeroDivisionError('division by zero')"
        assert info.value.name == "div"

    def test_many_calls_in_flight_are_matched_by_call_id(self, client: StageClient) -> None:
        client.add("busy", 10_000)  # calls interleave with steps
        futures = [client.call_utility_future("div", i, i % 3) for i in range(300)]
        for i, future in enumerate(futures):
            if i % 3 == 0:
                with pytest.raises(UtilityError):
                    future.result(10)
            else:
                assert future.result(10) == i / (i % 3)

    def test_calls_from_many_threads(self, client: StageClient) -> None:
        def work(t: int) -> list[object]:
            return [client.call_utility("echo", t, i, timeout=10) for i in range(50)]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(work, range(4)))
        assert results == [[[t, i] for i in range(50)] for t in range(4)]

    def test_timeout_then_the_client_still_works(self, client: StageClient) -> None:
        with pytest.raises(TimeoutError, match="sleep"):
            client.call_utility("sleep", 0.5, timeout=0.05)
        assert client.call_utility("echo", "after", timeout=5) == ["after"]

    def test_unknown_utility_is_a_utility_error(self, client: StageClient) -> None:
        with pytest.raises(UtilityError, match="no utility 'nope'"):
            client.call_utility("nope", timeout=5)

    def test_utility_event_in_the_ordered_stream(self, client: StageClient) -> None:
        client.call_utility("echo", 1, timeout=5)
        event = client.get_event(5)
        assert isinstance(event, UtilityResult)
        assert (event.result, event.error) == ([1], None)


class TestPayloads:
    @pytest.mark.parametrize(
        "data", [{1, 2}, object(), 2**70, {(1, 2): 3}, [1, [2, {3}]], 1 + 2j, bytearray(b"x")]
    )
    def test_unencodable_request_data_is_refused_before_sending(
        self, client: StageClient, data: object
    ) -> None:
        with pytest.raises(TypeError, match="data of request 'r'"):
            client.add("r", data)
        assert client.call_utility("log", timeout=5) == []

    def test_lone_surrogates_are_refused_with_type_error_before_sending(
        self, client: StageClient
    ) -> None:
        # check_encodable passes any exact str; UTF-8 encoding is what refuses these.
        bad = "x\ud800"
        with pytest.raises(TypeError, match="surrogates"):
            client.add("r", {"k": bad})
        with pytest.raises(TypeError, match="surrogates"):
            client.add(bad, 1)
        with pytest.raises(TypeError, match="surrogates"):
            client.call_utility("echo", [bad])
        with pytest.raises(TypeError, match="surrogates"):
            client.call_utility(bad)
        with pytest.raises(TypeError, match="surrogates"):
            client.abort([bad])
        with pytest.raises(TypeError, match="surrogates"):
            StageClient.launch(COUNTDOWN, {"x": bad})
        assert client.call_utility("log", timeout=5) == []

    def test_unencodable_utility_args_are_refused(self, client: StageClient) -> None:
        with pytest.raises(TypeError, match="arguments of utility 'echo'"):
            client.call_utility("echo", {1})

    def test_rich_payloads_round_trip(self, client: StageClient) -> None:
        value = [
            None,
            True,
            -(2**63),
            2**64 - 1,
            1.5,
            "é",
            b"\x00\xff",
            {"k": [1, (2, 3)]},
            {7: b""},
        ]
        assert client.call_utility("echo", *value, timeout=5) == [
            None,
            True,
            -(2**63),
            2**64 - 1,
            1.5,
            "é",
            b"\x00\xff",
            {"k": [1, [2, 3]]},
            {7: b""},
        ]

    def test_unencodable_output_ends_only_that_request(self, client: StageClient) -> None:
        bad = client.add("bad", 10_000_000)
        good = client.add("good", 5)
        client.call_utility("poison", "bad", timeout=5)
        with pytest.raises(RequestError, match="not wire-encodable") as info:
            bad.collect(timeout=5)
        assert info.value.req_id == "bad"
        assert good.collect(timeout=5)[-1] == 0
        # The stage aborted the poisoned request so the engine stops working on it.
        assert client.call_utility("log", timeout=5)[-1] == "abort bad"

    @pytest.mark.parametrize("kind", ["int_too_big", "int_too_small", "int_subclass", "nested"])
    def test_each_kind_of_unencodable_output_ends_only_its_request(
        self, client: StageClient, kind: str
    ) -> None:
        # Outputs take a fast path for exact scalars; everything else is checked in full.
        bad = client.add("bad", 10_000_000)
        good = client.add("good", 5)
        client.call_utility("poison", "bad", kind, timeout=5)
        with pytest.raises(RequestError, match="output cannot be encoded") as info:
            bad.collect(timeout=5)
        assert info.value.req_id == "bad"
        assert good.collect(timeout=5)[-1] == 0
        assert client.call_utility("log", timeout=5)[-1] == "abort bad"

    @pytest.mark.parametrize(
        "payload", [2**64 - 1, -(2**63), 7, True, False, None, 1.5, "é", b"\x00", [1, "a"]]
    )
    def test_edge_payloads_pass_the_output_fast_path(
        self, client: StageClient, payload: object
    ) -> None:
        client.call_utility("payload", "r", payload, timeout=5)  # r's first output's payload
        got = client.add("r", 3).collect(timeout=5)
        assert got == [payload, 1, 0]
        assert type(got[0]) is type(payload)

    def test_output_that_fails_only_in_msgspec_ends_only_that_request(
        self, client: StageClient
    ) -> None:
        # A lone surrogate passes check_encodable (exact str) but not UTF-8 encoding: the
        # output must still end its own request, not vanish as an unscoped protocol error.
        bad = client.add("bad", 10_000_000)
        good = client.add("good", 5)
        client.call_utility("poison", "bad", "surrogate", timeout=5)
        with pytest.raises(RequestError, match="surrogate") as info:
            bad.collect(timeout=5)
        assert info.value.req_id == "bad"
        assert good.collect(timeout=5)[-1] == 0
        assert client.call_utility("log", timeout=5)[-1] == "abort bad"

    def test_utility_result_that_fails_only_in_msgspec_is_reported(
        self, client: StageClient
    ) -> None:
        with pytest.raises(UtilityError, match="surrogate"):
            client.call_utility("unencodable_result", "surrogate", timeout=5)
        assert client.call_utility("echo", 1, timeout=5) == [1]

    def test_unencodable_utility_result_is_reported(self, client: StageClient) -> None:
        with pytest.raises(UtilityError, match=r"TypeError.*builtins\.set is not wire-encodable"):
            client.call_utility("unencodable_result", timeout=5)

    def test_unrouted_output_goes_to_the_event_stream(self, client: StageClient) -> None:
        client.call_utility("unrouted", "tick", timeout=5)
        events = [client.get_event(5), client.get_event(5)]
        assert Output(None, False, "tick") in events


class TestClose:
    def test_calls_after_close_raise_closed(self, client: StageClient) -> None:
        assert client.shutdown() == 0
        assert client.closed
        with pytest.raises(StageClosedError):
            client.add("r", 1)
        with pytest.raises(StageClosedError):
            client.call_utility("echo")
        with pytest.raises(StageClosedError):
            client.abort(["r"])

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

    def test_shutdown_applies_everything_sent_before_it(self) -> None:
        # Sent right after launch, racing the stage's start: still all applied, in order.
        with StageClient.launch(COUNTDOWN) as client:
            futures = [client.call_utility_future("div", i, 1) for i in range(20)]
            assert client.shutdown() == 0
        assert [f.result(0) for f in futures] == [float(i) for i in range(20)]

    def test_waiters_get_closed_error(self, client: StageClient) -> None:
        stream = client.add("long", 10_000_000)
        stream.get(5)
        client.shutdown()
        with pytest.raises(StageClosedError):
            stream.collect(timeout=5)

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

    def test_shutdown_escalates_to_sigterm_then_sigkill(self, client: StageClient) -> None:
        # The loop is stuck in a 30 s utility: the shutdown message cannot be applied, and
        # SIGTERM only sets a flag the loop cannot look at, so only SIGKILL ends it.
        future = client.call_utility_future("sleep", 30)
        assert client.shutdown(timeout=0.2) == -9
        with pytest.raises(StageClosedError):
            future.result(5)

    def test_event_stream_ends_after_our_shutdown(self, client: StageClient) -> None:
        client.add("r", 1).collect(timeout=5)
        client.shutdown()
        events = list(client.events())
        assert events[-1] == Shutdown()

    def test_ipc_dir_is_private_and_removed(self, no_leftovers: str) -> None:
        import os
        import stat

        with StageClient.launch(COUNTDOWN) as client:
            path = client.address.removeprefix("ipc://")
            ipc_dir = os.path.dirname(path)
            assert ipc_dir.startswith(no_leftovers)
            assert stat.S_IMODE(os.stat(ipc_dir).st_mode) == 0o700
        assert not os.path.exists(ipc_dir)


def _drain_events(client: StageClient) -> list[object]:
    """Every event until a utility barrier comes back: all that was emitted before it."""
    client.call_utility_future("echo", "barrier")
    events: list[object] = []
    while True:
        event = client.get_event(5)
        if isinstance(event, UtilityResult) and event.result == ["barrier"]:
            return events
        events.append(event)


def test_error_report_is_public_and_typed() -> None:
    assert ErrorReport("r", "m").req_id == "r"
