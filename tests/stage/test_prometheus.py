"""Prometheus: the parent's StageCollector and ``serve --metrics-port``, scraped over real
HTTP from real stage processes and parsed with prometheus-client's own parser."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import inspect
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Final

import pytest
from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client import metrics as client_metrics
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import exposition as om_exposition
from prometheus_client.openmetrics import parser as om_parser
from prometheus_client.parser import text_string_to_metric_families

from enginecore import LoopStatistics
from enginecore.stage import (
    AsyncPipeline,
    AsyncStageClient,
    AsyncStagePool,
    Pipeline,
    PipelineStage,
    ReplicaState,
    RequestError,
    RestartPolicy,
    StageClient,
    StagePool,
)
from enginecore.stage.prometheus import StageCollector

from .conftest import COUNTDOWN, SCRIPTED, EventLoopThread, Server, wait_until

RELAY = "enginecore.stage.testing:relay"
FAST = RestartPolicy(first_delay=0.05, max_delay=0.05)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

pytestmark = pytest.mark.timeout(60)

# prometheus-client's OpenMetrics exposition and parser, and its switch for _created series,
# are untyped: typed here.
openmetrics_latest: Callable[[CollectorRegistry], bytes] = om_exposition.generate_latest
openmetrics_families: Callable[[str], Iterator[Metric]] = om_parser.text_string_to_metric_families
disable_created_metrics: Callable[[], None] = client_metrics.disable_created_metrics
enable_created_metrics: Callable[[], None] = client_metrics.enable_created_metrics


def parse(text: str) -> tuple[Samples, dict[str, str]]:
    """Every sample, keyed by (name, labels); and each family's type."""
    samples: Samples = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples, types


def labels(**kv: str) -> frozenset[tuple[str, str]]:
    return frozenset(kv.items())


def value(samples: Samples, name: str, **kv: str) -> float:
    return samples[(name, labels(**kv))]


def scrape(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        body: bytes = response.read()
    return body.decode()


def buckets(samples: Samples, name: str, stage: str) -> list[tuple[float, float]]:
    """The ``(le, count)`` pairs of one stage's histogram, in bound order."""
    found = [
        (float(dict(labels)["le"]), v)
        for (n, labels), v in samples.items()
        if n == f"{name}_bucket" and dict(labels)["stage"] == stage
    ]
    return sorted(found)


def assert_histogram(samples: Samples, name: str, stage: str, count: int) -> list[float]:
    """Cumulative buckets ending at +Inf == _count == *count*; returns the counts."""
    pairs = buckets(samples, name, stage)
    counts = [c for _, c in pairs]
    assert pairs[-1][0] == float("inf")
    assert counts == sorted(counts), f"not cumulative: {pairs}"
    assert counts[-1] == value(samples, f"{name}_count", stage=stage) == count
    return counts


@pytest.fixture
def http() -> Iterator[tuple[CollectorRegistry, str]]:
    """A registry served over real HTTP on a free loopback port."""
    registry = CollectorRegistry()
    httpd, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield registry, f"http://127.0.0.1:{httpd.server_address[1]}/metrics"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def settle(client: StageClient) -> LoopStatistics:
    """Once a utility round trip is answered, the loop has counted every step before it
    (it counts them before it goes idle, and applies the call after)."""
    client.call_utility("num_requests", timeout=10)
    return client.stats(timeout=10).loop


class TestCollector:
    def test_two_stages_in_one_process_are_exact_and_labelled(
        self, http: tuple[CollectorRegistry, str]
    ) -> None:
        registry, url = http
        metrics = StageCollector(registry)
        with (
            StageClient.launch(COUNTDOWN, startup_timeout=30) as a,
            StageClient.launch(COUNTDOWN, startup_timeout=30) as b,
        ):
            metrics.add(a, stage="prefill-0")
            metrics.add(b, stage="decode-0")
            assert metrics.stages == ("prefill-0", "decode-0")
            s1 = a.add("a1", 3)
            assert s1.collect(timeout=10) == [2, 1, 0]
            streams = b.add_many([("b1", 5), ("b2", 2)])  # one drain: 5 steps in all
            for s in streams:
                s.collect(timeout=10)
            assert metrics.observe(s1, "prefill-0") == s1.timings.time_to_first_output
            for s in streams:
                metrics.observe(s, "decode-0")
            metrics.observe(0.5, "decode-0")
            loops = {"prefill-0": settle(a), "decode-0": settle(b)}
            samples, types = parse(scrape(url))

        assert types["enginecore_steps"] == "counter"
        assert types["enginecore_step_seconds"] == "histogram"
        assert types["enginecore_live_requests"] == "gauge"
        want = {"prefill-0": (3, 3, 1), "decode-0": (5, 7, 2)}  # steps, outputs, adds
        for stage, (steps, outputs, adds) in want.items():
            assert value(samples, "enginecore_steps_total", stage=stage) == steps
            assert value(samples, "enginecore_outputs_total", stage=stage) == outputs
            assert value(samples, "enginecore_messages_total", stage=stage, kind="add") == adds
            assert value(samples, "enginecore_messages_total", stage=stage, kind="abort") == 0
            assert value(samples, "enginecore_messages_total", stage=stage, kind="utility") == 1
            assert value(samples, "enginecore_utility_errors_total", stage=stage) == 0
            assert value(samples, "enginecore_cut_clients_total", stage=stage) == 0
            assert value(samples, "enginecore_live_requests", stage=stage) == 0
            assert value(samples, "enginecore_queue_depth", stage=stage) == 0
            assert value(samples, "enginecore_stage_up", stage=stage) == 1
            assert value(samples, "enginecore_scrape_errors_total", stage=stage) == 0
            assert value(samples, "enginecore_busy_seconds_total", stage=stage) > 0
            assert value(samples, "enginecore_idle_seconds_total", stage=stage) > 0
            counts = assert_histogram(samples, "enginecore_step_seconds", stage, steps)
            # The scrape's buckets are the stage's own per-bucket counts, summed up.
            per_bucket = [counts[0]] + [y - x for x, y in itertools.pairwise(counts)]
            assert per_bucket == list(loops[stage].step_histogram)
            assert value(samples, "enginecore_step_seconds_sum", stage=stage) > 0
        ttft = "enginecore_time_to_first_output_seconds"
        assert_histogram(samples, ttft, "prefill-0", 1)
        assert_histogram(samples, ttft, "decode-0", 3)
        assert value(samples, f"{ttft}_sum", stage="prefill-0") == s1.timings.time_to_first_output
        # 0.5 s fell in the 0.5 bucket, the two fast streams below it.
        pairs = dict(buckets(samples, ttft, "decode-0"))
        assert pairs[0.25] == 2
        assert pairs[0.5] == 3
        info = [
            dict(labels)
            for (n, labels), _ in samples.items()
            if n == "enginecore_stage_info" and dict(labels)["stage"] == "prefill-0"
        ]
        assert info == [{"stage": "prefill-0", "engine": COUNTDOWN, "pid": str(a.pid)}]

    def test_a_dead_stage_and_a_frozen_one_are_skipped_without_hanging(
        self, http: tuple[CollectorRegistry, str]
    ) -> None:
        registry, url = http
        metrics = StageCollector(registry, timeout=0.5)
        with (
            StageClient.launch(COUNTDOWN, startup_timeout=30) as live,
            StageClient.launch(SCRIPTED, startup_timeout=30) as dead,
            StageClient.launch(COUNTDOWN, startup_timeout=30) as frozen,
        ):
            metrics.add(live, stage="live")
            metrics.add(dead, stage="dead")
            metrics.add(frozen, stage="frozen")
            with pytest.raises(Exception):  # noqa: B017,PT011 - the stage is gone either way
                dead.call_utility("exit", 3, timeout=10)
            os.kill(frozen.pid, signal.SIGSTOP)
            try:
                first, _ = parse(scrape(url))
                second, _ = parse(scrape(url))
            finally:
                os.kill(frozen.pid, signal.SIGCONT)
        for samples, n in ((first, 1), (second, 2)):
            assert value(samples, "enginecore_stage_up", stage="live") == 1
            assert value(samples, "enginecore_steps_total", stage="live") == 0
            for stage in ("dead", "frozen"):
                assert value(samples, "enginecore_stage_up", stage=stage) == 0
                assert value(samples, "enginecore_scrape_errors_total", stage=stage) == n
                assert ("enginecore_steps_total", frozenset({("stage", stage)})) not in samples

    def test_stages_behind_many_hanging_ones_are_asked_at_once(self, no_leftovers: str) -> None:
        # 33 clients of one frozen shared stage hang for the whole timeout each: the live
        # stage added after them is still asked at the start of the scrape, not queued
        # behind them past its end (a pool of 16 threads asked it after two timeouts).
        registry = CollectorRegistry()
        metrics = StageCollector(registry, timeout=3)
        srv = Server("--engine", COUNTDOWN, "--bind", "tcp://127.0.0.1:*", "--max-clients", "40")
        hung: list[StageClient] = []
        try:
            for i in range(33):
                hung.append(StageClient.connect(srv.address))
                metrics.add(hung[-1], stage=f"hung-{i}")
            with StageClient.launch(COUNTDOWN, startup_timeout=30) as live:
                metrics.add(live, stage="live")
                os.kill(srv.proc.pid, signal.SIGSTOP)
                try:
                    samples, _ = parse(generate_latest(registry).decode())
                finally:
                    os.kill(srv.proc.pid, signal.SIGCONT)
        finally:
            for client in hung:
                client.close()
            srv.stop()
        assert value(samples, "enginecore_stage_up", stage="live") == 1
        assert value(samples, "enginecore_scrape_errors_total", stage="live") == 0
        assert value(samples, "enginecore_stage_up", stage="hung-32") == 0

    def test_an_async_client_is_scraped_from_another_thread(self) -> None:
        registry = CollectorRegistry()
        metrics = StageCollector(registry, timeout=5)

        async def main() -> tuple[str, str]:
            async with await AsyncStageClient.launch(COUNTDOWN, startup_timeout=30) as client:
                metrics.add(client, stage="async-0")
                stream = await client.add("r", 4)
                await stream.collect()
                metrics.observe(stream, "async-0")
                await client.call_utility("num_requests")
                other = (await asyncio.to_thread(generate_latest, registry)).decode()
                # On the client's own event loop the collector cannot wait: skipped.
                here = generate_latest(registry).decode()
                return other, here

        other, here = asyncio.run(main())
        samples, _ = parse(other)
        assert value(samples, "enginecore_steps_total", stage="async-0") == 4
        assert value(samples, "enginecore_outputs_total", stage="async-0") == 4
        assert_histogram(samples, "enginecore_time_to_first_output_seconds", "async-0", 1)
        samples, _ = parse(here)
        assert value(samples, "enginecore_stage_up", stage="async-0") == 0
        assert value(samples, "enginecore_scrape_errors_total", stage="async-0") == 1

    def test_an_async_client_whose_event_loop_is_closed_is_skipped_cleanly(self) -> None:
        # Before: every such scrape made a coroutine that was never awaited (a
        # RuntimeWarning when collected; an error under this suite's filterwarnings).
        registry = CollectorRegistry()
        metrics = StageCollector(registry, timeout=5)

        async def main() -> None:
            async with await AsyncStageClient.launch(COUNTDOWN, startup_timeout=30) as client:
                metrics.add(client, stage="gone")

        asyncio.run(main())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            samples, _ = parse(generate_latest(registry).decode())
            gc.collect()
        assert value(samples, "enginecore_stage_up", stage="gone") == 0
        assert value(samples, "enginecore_scrape_errors_total", stage="gone") == 1

    def test_labels_and_registration_are_checked(self) -> None:
        registry = CollectorRegistry()
        metrics = StageCollector(registry)
        # A second collector's series would collide with the first one's in one registry.
        with pytest.raises(ValueError, match="Duplicated"):
            StageCollector(registry)
        with pytest.raises(TypeError):
            metrics.add(object(), stage="x")  # type: ignore[arg-type]
        with pytest.raises(KeyError, match="nope"):
            metrics.observe(0.1, "nope")
        with pytest.raises(ValueError, match="timeout"):
            StageCollector(timeout=0)
        with pytest.raises(ValueError, match="increasing"):
            StageCollector(ttft_buckets=(1.0, 0.5))
        # No stage: the scrape is empty, and fine.
        samples, _ = parse(generate_latest(registry).decode())
        assert not [k for k in samples if k[0].startswith("enginecore_")]

    @pytest.mark.parametrize(
        ("timeout", "error"),
        [
            ("1", TypeError),
            (None, TypeError),
            (True, TypeError),
            (float("inf"), ValueError),
            (1e300, ValueError),
            (3601, ValueError),
        ],
        ids=["str", "none", "bool", "inf", "huge", "over-an-hour"],
    )
    def test_a_timeout_that_is_not_seconds_is_refused_clearly(
        self, timeout: Any, error: type[Exception]
    ) -> None:
        with pytest.raises(error, match="timeout must be"):
            StageCollector(timeout=timeout)

    @pytest.mark.parametrize(
        ("seconds", "error"),
        [
            (float("nan"), ValueError),
            (-1.0, ValueError),
            (float("inf"), ValueError),
            (True, TypeError),
            ("0.5", TypeError),
        ],
        ids=["nan", "negative", "inf", "bool", "str"],
    )
    def test_observe_refuses_a_time_that_is_not_seconds(
        self, seconds: Any, error: type[Exception]
    ) -> None:
        # A NaN would turn the histogram's sum into NaN for the life of the process.
        registry = CollectorRegistry()
        metrics = StageCollector(registry)
        with StageClient.launch(COUNTDOWN, startup_timeout=30) as client:
            metrics.add(client, stage="s")
            with pytest.raises(error, match="seconds"):
                metrics.observe(seconds, "s")
            assert metrics.observe(0, "s") == 0.0
            samples, _ = parse(generate_latest(registry).decode())
        assert value(samples, "enginecore_time_to_first_output_seconds_sum", stage="s") == 0.0
        assert value(samples, "enginecore_time_to_first_output_seconds_count", stage="s") == 1

    def test_observe_of_a_stream_without_output_still_checks_the_label(self) -> None:
        # A request that ended before its first output (refused, aborted) records nothing,
        # but a label that is not reported is the caller's bug all the same: a typo must
        # not pass silently on exactly the requests that never produced anything.
        metrics = StageCollector()
        with StageClient.launch(COUNTDOWN, startup_timeout=30) as client:
            metrics.add(client, stage="s")
            stream = client.add("r1", 0)  # CountdownEngine refuses a count below 1
            with pytest.raises(RequestError):
                stream.collect()
            assert metrics.observe(stream, "s") is None
            with pytest.raises(KeyError, match="is reported as 'nope'"):
                metrics.observe(stream, "nope")

    def test_a_label_is_taken_once_and_can_be_removed(self) -> None:
        metrics = StageCollector()
        with StageClient.launch(COUNTDOWN, startup_timeout=30) as client:
            metrics.add(client, stage="s")
            with pytest.raises(ValueError, match="already"):
                metrics.add(client, stage="s")
            # The same client under a second label would count everything twice in a sum.
            with pytest.raises(ValueError, match="already reported as 's'"):
                metrics.add(client, stage="t")
            assert list(metrics.stages) == ["s"]
            metrics.remove("s")
            assert metrics.stages == ()
            with pytest.raises(KeyError, match="is reported as 's'"):
                metrics.remove("s")
            assert metrics.collect() == metrics.collect()  # nothing left to report


class Side:
    """The blocking or the asyncio form of a pool or a pipeline, driven from the test's
    thread: an awaitable a method returns is run on an event loop thread of its own, where
    the asyncio object lives, so that scrapes (from this thread) ask it as a server would."""

    def __init__(self, kind: str) -> None:
        self.runner = EventLoopThread() if kind == "async" else None

    def __call__(self, obj: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        result = getattr(obj, method)(*args, **kwargs)
        if inspect.isawaitable(result):
            assert self.runner is not None
            return self.runner.run(_awaited(result))
        return result

    def stop(self) -> None:
        if self.runner is not None:
            self.runner.stop()


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _scrape_while(act: Callable[[], object], registry: CollectorRegistry) -> str:
    """A scrape, with *act* done once the scrape is asking the stages (its threads run)."""
    done: concurrent.futures.Future[str] = concurrent.futures.Future()

    def scrape() -> None:
        try:
            done.set_result(generate_latest(registry).decode())
        except BaseException as exc:  # pragma: no cover - the test fails on it below
            done.set_exception(exc)

    thread = threading.Thread(target=scrape, name="test-scrape")
    thread.start()

    def asking() -> bool:
        return any(t.name.startswith("enginecore-metrics") for t in threading.enumerate())

    assert wait_until(asking, 10)
    act()
    thread.join(30)
    return done.result(0)


@pytest.fixture(params=["sync", "async"])
def side(request: pytest.FixtureRequest, no_leftovers: str) -> Iterator[Side]:
    s = Side(request.param)
    try:
        yield s
    finally:
        s.stop()


class TestPoolsAndPipelines:
    def test_a_pool_is_reported_per_replica_and_follows_its_replicas(self, side: Side) -> None:
        registry = CollectorRegistry()
        metrics = StageCollector(registry, timeout=5)
        cls = StagePool if side.runner is None else AsyncStagePool
        pool = side(cls, "launch", COUNTDOWN, replicas=2, startup_timeout=30)
        try:
            metrics.add(pool, stage="llm")
            streams = [side(pool, "add", f"q{i}", 3) for i in range(8)]
            for stream in streams:
                assert side(stream, "collect", 10) == [2, 1, 0]
                metrics.observe(stream, "llm")
            first, second = pool.replicas

            def adds() -> float:
                samples, _ = parse(generate_latest(registry).decode())
                return sum(
                    value(samples, "enginecore_messages_total", stage="llm", replica=r, kind="add")
                    for r in ("r0", "r1")
                )

            assert wait_until(lambda: adds() == 8, 10)  # every add, in one of the two
            samples, types = parse(generate_latest(registry).decode())
            assert types["enginecore_pool_replicas"] == "gauge"
            for r in (first, second):
                assert value(samples, "enginecore_stage_up", stage="llm", replica=r.name) == 1
                assert value(samples, "enginecore_steps_total", stage="llm", replica=r.name) > 0
            assert value(samples, "enginecore_pool_replicas", stage="llm", state="serving") == 2
            assert value(samples, "enginecore_pool_replicas", stage="llm", state="dead") == 0
            # One histogram for the pool: the time to first output is the pool's.
            assert_histogram(samples, "enginecore_time_to_first_output_seconds", "llm", 8)

            # A dead replica reads down, and is no scrape error: it has no process to ask.
            assert first.pid is not None
            os.kill(first.pid, signal.SIGKILL)
            assert wait_until(lambda: first.state is ReplicaState.DEAD, 20)
            samples, _ = parse(generate_latest(registry).decode())
            assert value(samples, "enginecore_stage_up", stage="llm", replica="r0") == 0
            assert value(samples, "enginecore_scrape_errors_total", stage="llm", replica="r0") == 0
            assert ("enginecore_steps_total", labels(stage="llm", replica="r0")) not in samples
            assert value(samples, "enginecore_stage_up", stage="llm", replica="r1") == 1
            assert value(samples, "enginecore_pool_replicas", stage="llm", state="dead") == 1
            assert value(samples, "enginecore_pool_replicas", stage="llm", state="serving") == 1

            # A removed replica's series go with it.
            side(pool, "remove_replica", first)
            samples, _ = parse(generate_latest(registry).decode())
            assert [k for k in samples if ("replica", "r0") in k[1]] == []
            assert value(samples, "enginecore_stage_up", stage="llm", replica="r1") == 1
        finally:
            side(pool, "shutdown")
        # A closed pool: its replicas are gone, nothing hangs.
        samples, _ = parse(generate_latest(registry).decode())
        assert [
            k for k in samples if ("replica", "r1") in k[1] and k[0] == "enginecore_steps_total"
        ] == []

    def test_a_pipeline_is_reported_per_stage_and_replica(self, side: Side) -> None:
        registry = CollectorRegistry()
        metrics = StageCollector(registry, timeout=5)
        cls = Pipeline if side.runner is None else AsyncPipeline
        pipe = side(
            cls,
            "launch",
            [COUNTDOWN, PipelineStage(RELAY, name="mid", replicas=2, restart=FAST)],
            startup_timeout=30,
        )
        try:
            metrics.add(pipe, pipeline="omni")
            assert metrics.stages == ("omni",)
            streams = [side(pipe, "add", f"p{i}", 3) for i in range(6)]
            for stream in streams:
                assert side(stream, "collect", 10) == [2, 1, 0]
                metrics.observe(stream, "omni")
            mid = [{"pipeline": "omni", "stage": "mid", "replica": r} for r in ("0", "1")]

            def mid_adds() -> float:
                samples, _ = parse(generate_latest(registry).decode())
                return sum(
                    value(samples, "enginecore_messages_total", kind="add", **m) for m in mid
                )

            assert wait_until(lambda: mid_adds() == 6, 10)
            samples, _ = parse(generate_latest(registry).decode())
            # One process: an empty replica (stored as no label), as the family has pooled ones.
            first = {"pipeline": "omni", "stage": COUNTDOWN, "replica": ""}
            assert value(samples, "enginecore_stage_up", **first) == 1
            assert value(samples, "enginecore_messages_total", kind="add", **first) == 6
            for m in mid:
                assert value(samples, "enginecore_stage_up", **m) == 1
            counts = [
                v
                for (n, lb), v in samples.items()
                if n == "enginecore_time_to_first_output_seconds_count"
            ]
            assert counts == [6]
            assert (
                value(samples, "enginecore_time_to_first_output_seconds_count", pipeline="omni")
                == 6
            )

            # A restart: the process started in place of a dead one is the one asked.
            old = side(pipe, "call_utility", "mid", "pid", replica=1)
            os.kill(old, signal.SIGKILL)
            assert wait_until(lambda: pipe.restarts["mid[1]"] >= 1, 20)

            def mid_pid() -> str | None:
                samples, _ = parse(generate_latest(registry).decode())
                for (n, lb), _v in samples.items():
                    if n == "enginecore_stage_info" and ("replica", "1") in lb:
                        return dict(lb)["pid"]
                return None

            assert wait_until(lambda: mid_pid() not in (None, str(old)), 20)
            assert mid_pid() == str(side(pipe, "call_utility", "mid", "pid", replica=1))
        finally:
            side(pipe, "shutdown")

    def test_every_family_has_one_set_of_label_names(self, no_leftovers: str) -> None:
        # A plain stage, a pool's replicas and a pipeline's stages in one scrape: a family
        # whose samples differ in their label names is invalid to client_golang's registry
        # and whatever re-exposes through one ("label dimensions inconsistent"). The ones
        # without a label carry it empty, which Prometheus stores as no label.
        registry = CollectorRegistry()
        metrics = StageCollector(registry, timeout=5)
        with (
            StageClient.launch(COUNTDOWN, startup_timeout=30) as client,
            StagePool.launch(COUNTDOWN, replicas=1, startup_timeout=30) as pool,
            Pipeline.launch(
                [COUNTDOWN, PipelineStage(RELAY, name="mid", replicas=2)], startup_timeout=30
            ) as pipe,
        ):
            metrics.add(client, stage="one")
            metrics.add(pool, stage="llm")
            metrics.add(pipe, pipeline="omni")
            for stream in (pool.add("a", 2), pipe.add("b", 2)):
                stream.collect(timeout=10)
                metrics.observe(stream, "llm" if stream.req_id == "a" else "omni")
            text = generate_latest(registry).decode()
        families = list(text_string_to_metric_families(text))
        assert len(families) > 20
        for family in families:
            names = {frozenset(s.labels) - {"le"} for s in family.samples}
            assert len(names) <= 1, f"{family.name}: {sorted(map(sorted, names))}"
        samples, _ = parse(text)
        assert value(samples, "enginecore_stage_up", pipeline="", stage="one", replica="") == 1
        assert value(samples, "enginecore_stage_up", pipeline="", stage="llm", replica="r0") == 1
        mid = {"pipeline": "omni", "stage": "mid", "replica": "1"}
        assert value(samples, "enginecore_stage_up", **mid) == 1
        ttft = "enginecore_time_to_first_output_seconds_count"
        assert value(samples, ttft, pipeline="", stage="one") == 0
        assert value(samples, ttft, pipeline="", stage="llm") == 1
        assert value(samples, ttft, pipeline="omni", stage="") == 1

    def test_a_replica_that_dies_while_it_is_asked_is_no_scrape_error(
        self, side: Side, caplog: pytest.LogCaptureFixture
    ) -> None:
        # Stopped, then killed while the scrape waits for it: the pool hears of its death
        # during the scrape. Down, as a replica already dead is, not a scrape error.
        registry = CollectorRegistry()
        metrics = StageCollector(registry, timeout=20)
        cls = StagePool if side.runner is None else AsyncStagePool
        pool = side(cls, "launch", COUNTDOWN, replicas=2, startup_timeout=30)
        try:
            metrics.add(pool, stage="llm")
            first = pool.replicas[0]
            assert first.pid is not None
            os.kill(first.pid, signal.SIGSTOP)
            text = _scrape_while(lambda: os.kill(first.pid, signal.SIGKILL), registry)
            samples, _ = parse(text)
            assert value(samples, "enginecore_stage_up", stage="llm", replica="r0") == 0
            assert value(samples, "enginecore_scrape_errors_total", stage="llm", replica="r0") == 0
            assert value(samples, "enginecore_stage_up", stage="llm", replica="r1") == 1
            assert "did not answer the metrics scrape" not in caplog.text
        finally:
            side(pool, "shutdown")

    def test_a_pipeline_process_that_dies_or_restarts_is_no_scrape_error(
        self, side: Side, caplog: pytest.LogCaptureFixture
    ) -> None:
        # As a pool's replica: dead while asked, then waiting for its restart, it reads
        # down and is not counted as a scrape error, every scrape.
        registry = CollectorRegistry()
        metrics = StageCollector(registry, timeout=20)
        cls = Pipeline if side.runner is None else AsyncPipeline
        slow = RestartPolicy(first_delay=60, max_delay=60)  # restarting until shutdown
        stages = [COUNTDOWN, PipelineStage(RELAY, name="mid", restart=slow)]
        pipe = side(cls, "launch", stages, startup_timeout=30)
        try:
            metrics.add(pipe, pipeline="omni")
            pid = side(pipe, "call_utility", "mid", "pid")
            os.kill(pid, signal.SIGSTOP)
            for text in (
                _scrape_while(lambda: os.kill(pid, signal.SIGKILL), registry),
                generate_latest(registry).decode(),
            ):
                samples, _ = parse(text)
                mid = {"pipeline": "omni", "stage": "mid"}
                assert value(samples, "enginecore_stage_up", **mid) == 0
                assert value(samples, "enginecore_scrape_errors_total", **mid) == 0
                assert value(samples, "enginecore_stage_up", pipeline="omni", stage=COUNTDOWN) == 1
            assert pipe.health()["mid"].value == "restarting"
            assert "did not answer the metrics scrape" not in caplog.text
        finally:
            side(pipe, "shutdown")

    def test_a_restarted_replicas_counters_carry_a_later_created(self, side: Side) -> None:
        """A replica's process that restarts counts from 0 again: its counters' and step
        histogram's ``_created`` is its process's start, the same at every scrape of one
        process and later for the next one, so that a scraper tells the reset from a
        decrease (OpenMetrics; Prometheus reads it as the series' created timestamp)."""
        registry = CollectorRegistry()
        metrics = StageCollector(registry, timeout=5)
        cls = StagePool if side.runner is None else AsyncStagePool
        pool = side(cls, "launch", COUNTDOWN, replicas=1, restart=FAST, startup_timeout=30)
        try:
            metrics.add(pool, stage="llm")
            (replica,) = pool.replicas
            assert side(side(pool, "add", "q0", 3), "collect", 10) == [2, 1, 0]
            at = labels(stage="llm", replica="r0")

            errors_since: list[float] = []

            def created() -> dict[str, float]:
                got = _created(generate_latest(registry).decode(), at)
                # The collector's own count of this replica's skipped scrapes: since it
                # was first reported, across its restarts.
                errors_since.append(got.pop("enginecore_scrape_errors"))
                assert set(got) == set(_RESETTING), got  # every one, and only those
                return got

            before = time.time()
            first = created()
            assert len(set(first.values())) == 1  # one process, one start
            start = first["enginecore_steps"]
            assert start <= before
            assert created() == first  # the same at the next scrape
            # In the OpenMetrics exposition, which a Prometheus server asks for.
            om = _created(openmetrics_latest(registry).decode(), at, openmetrics=True)
            assert om.pop("enginecore_scrape_errors") == errors_since[0]
            assert om == first
            assert metrics.observe(0.5, "llm") == 0.5
            ttft = _created(generate_latest(registry).decode(), labels(stage="llm"))
            assert set(ttft) == {"enginecore_time_to_first_output_seconds"}

            old = replica.pid
            assert old is not None
            os.kill(old, signal.SIGKILL)

            def restarted() -> bool:
                return replica.state is ReplicaState.SERVING and replica.pid not in (None, old)

            assert wait_until(restarted, 30)
            samples, _ = parse(generate_latest(registry).decode())
            assert value(samples, "enginecore_stage_up", stage="llm", replica="r0") == 1
            second = created()
            assert len(set(second.values())) == 1
            assert second["enginecore_steps"] > start
            assert created() == second
            # The collector's own series did not restart.
            assert len(set(errors_since)) == 1, errors_since
            assert _created(generate_latest(registry).decode(), labels(stage="llm")) == ttft
        finally:
            side(pool, "shutdown")

    def test_a_pool_or_pipeline_is_added_with_the_right_name(self, side: Side) -> None:
        metrics = StageCollector()
        cls = Pipeline if side.runner is None else AsyncPipeline
        pipe = side(cls, "launch", [COUNTDOWN], startup_timeout=30)
        try:
            with pytest.raises(TypeError, match="pipeline=<name>"):
                metrics.add(pipe, stage="omni")
            with pytest.raises(TypeError, match="pipeline=<name>"):
                metrics.add(pipe)
            with pytest.raises(ValueError, match="pipeline must be a non-empty str"):
                metrics.add(pipe, pipeline="")
            metrics.add(pipe, pipeline="omni")
            with pytest.raises(ValueError, match="already reported as 'omni'"):
                metrics.add(pipe, pipeline="omni")
            with pytest.raises(ValueError, match="already reported as 'omni'"):
                metrics.add(pipe, pipeline="omni2")
            metrics.remove("omni")
            assert metrics.stages == ()
        finally:
            side(pipe, "shutdown")
        pool_cls = StagePool if side.runner is None else AsyncStagePool
        pool = side(pool_cls, "launch", COUNTDOWN, replicas=1, startup_timeout=30)
        try:
            with pytest.raises(TypeError, match="stage=<label>"):
                metrics.add(pool, pipeline="x")
            with pytest.raises(TypeError, match="stage=<label>"):
                metrics.add(pool)
        finally:
            side(pool, "shutdown")


def test_the_stage_package_does_not_import_prometheus_client() -> None:
    code = "import sys, enginecore.stage\nassert 'prometheus_client' not in sys.modules\n"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr


_RESETTING: Final = (
    "enginecore_steps", "enginecore_outputs", "enginecore_utility_errors",
    "enginecore_busy_seconds", "enginecore_idle_seconds", "enginecore_engine_stats_errors",
    "enginecore_load_reports", "enginecore_cut_clients", "enginecore_step_seconds",
)  # fmt: skip
"""The families that count from the stage process's start (``enginecore_messages`` too, one
series per ``kind``: :func:`_created` checks those apart)."""


def _created(
    text: str, at: frozenset[tuple[str, str]], *, openmetrics: bool = False
) -> dict[str, float]:
    """Each family's ``_created`` for the series labelled *at* (``enginecore_messages``: the
    same for each kind, or an ``AssertionError``), from the classic text format's
    ``*_created`` gauges or, with *openmetrics*, the OpenMetrics samples."""
    found: dict[str, set[float]] = {}
    families = openmetrics_families(text) if openmetrics else text_string_to_metric_families(text)
    for family in families:
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                continue
            kv = dict(sample.labels)
            kv.pop("kind", None)
            if frozenset(kv.items()) == at:
                found.setdefault(sample.name.removesuffix("_created"), set()).add(sample.value)
    messages = found.pop("enginecore_messages", None)
    if messages is not None:  # its 4 kinds, one start
        assert len(messages) == 1, messages
        assert found.get("enginecore_steps") == messages, found
    out = {}
    for name, values in found.items():
        assert len(values) == 1, (name, values)
        out[name] = values.pop()
    return out


def _metrics_url(server: Server) -> str:
    match = re.search(r"metrics (http://\S+)\)", server.ready_line)
    assert match, server.ready_line
    return match.group(1)


class TestServeMetrics:
    def test_answers_during_a_two_second_step(self) -> None:
        server = Server(
            "--engine", SCRIPTED, "--bind", "tcp://127.0.0.1:*", "--name", "prefill-0",
            "--metrics-port", "0",
        )  # fmt: skip
        try:
            url = _metrics_url(server)
            assert url.startswith("http://127.0.0.1:")
            with StageClient.connect(server.address) as client:
                before, types = parse(scrape(url))
                assert types["enginecore_step_seconds"] == "histogram"
                steps = int(value(before, "enginecore_steps_total", stage="prefill-0"))
                # The loop applies this call, then starts the 2 s step at once.
                client.call_utility("stall_next_step", 2.0, timeout=10)
                t0 = time.monotonic()
                during, _ = parse(scrape(url))
                elapsed = time.monotonic() - t0
                # Still inside the step: it had not returned when the scrape was answered.
                assert value(during, "enginecore_steps_total", stage="prefill-0") == steps
                assert elapsed < 1.0, f"/metrics took {elapsed:.3f} s during a 2 s step"
                client.call_utility("echo", timeout=10)  # answered after the step returned
                after, _ = parse(scrape(url))
            assert value(after, "enginecore_steps_total", stage="prefill-0") == steps + 1
            counts = assert_histogram(after, "enginecore_step_seconds", "prefill-0", steps + 1)
            pairs = dict(buckets(after, "enginecore_step_seconds", "prefill-0"))
            assert pairs[2.5] - pairs[1.0] == 1  # the long step, in its bucket
            assert counts[-1] == steps + 1
            assert value(after, "enginecore_loop_running", stage="prefill-0") == 1
            assert value(after, "enginecore_step_stalled", stage="prefill-0") == 0
            assert value(after, "enginecore_stage_up", stage="prefill-0") == 1
            assert ("process_cpu_seconds", "counter") in {(k, v) for k, v in types.items()}
        finally:
            assert server.stop() == 0

    def test_counters_carry_the_stages_start_as_created(self) -> None:
        server = Server(
            "--engine", COUNTDOWN, "--bind", "tcp://127.0.0.1:*", "--name", "s0",
            "--metrics-port", "0",
        )  # fmt: skip
        try:
            url = _metrics_url(server)
            at = labels(stage="s0")
            first = _created(scrape(url), at)
            assert set(first) == set(_RESETTING)
            assert len(set(first.values())) == 1
            assert first["enginecore_steps"] <= time.time()
            samples, _ = parse(scrape(url))
            start = time.time() - value(samples, "enginecore_uptime_seconds", stage="s0")
            assert abs(first["enginecore_steps"] - start) < 5
            with StageClient.connect(server.address) as client:
                client.add("r", 3).collect(timeout=10)
            assert _created(scrape(url), at) == first  # the same at every scrape
            request = urllib.request.Request(
                url, headers={"Accept": "application/openmetrics-text; version=1.0.0"}
            )
            with urllib.request.urlopen(request, timeout=10) as response:
                om = response.read().decode()
            assert _created(om, at, openmetrics=True) == first
        finally:
            assert server.stop() == 0

    def test_a_processs_start_is_estimated_once_and_moves_only_for_a_new_process(
        self,
    ) -> None:
        from enginecore.stage.prometheus import _Starts

        with StageClient.launch(COUNTDOWN, startup_timeout=30) as client:
            real = client.stats(timeout=10)
        starts = _Starts(slack=2.0)
        key = ("", "s", "")

        def at(pid: int, uptime: float) -> Any:
            return dataclasses.replace(real, pid=pid, uptime_seconds=uptime)

        start = starts.created(key, at(7, 100.0), 1000.0)
        assert start == 900.0
        assert starts.created(key, at(7, 110.0), 1010.3) == start  # no jitter
        assert starts.created(key, at(7, 109.0), 1010.0) == start  # an older answer, late
        assert starts.created(key, at(7, 120.0), 5000.0) == start  # the wall clock stepped
        assert starts.created(key, at(8, 3.0), 1030.0) == 1027.0  # another process
        assert starts.created(key, at(8, 50.0), 1077.0) == 1027.0
        assert starts.created(key, at(8, 4.0), 1080.0) == 1076.0  # the same pid, started again
        starts.keep(set())
        assert starts.created(key, at(8, 10.0), 1086.0) == 1076.0  # forgotten: estimated anew

    def test_created_series_follow_prometheus_clients_switch(self) -> None:
        registry = CollectorRegistry()
        metrics = StageCollector(registry)
        with StageClient.launch(COUNTDOWN, startup_timeout=30) as client:
            metrics.add(client, stage="s")
            assert "_created" in generate_latest(registry).decode()
            disable_created_metrics()
            try:
                text = generate_latest(registry).decode()
            finally:
                enable_created_metrics()
        assert "enginecore_steps_total" in text
        assert "_created" not in text

    def test_the_endpoint_answers_while_the_engine_is_built(self) -> None:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "enginecore", "serve",
                "--engine", "enginecore.stage.testing:sleeping_factory",
                "--bind", "tcp://127.0.0.1:*", "--metrics-port", "0",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        try:
            assert proc.stderr is not None
            line = proc.stderr.readline()
            match = re.search(r"metrics on (http://\S+)", line)
            assert match, line
            samples, _ = parse(scrape(match.group(1)))
            stage = "enginecore.stage.testing:sleeping_factory"
            assert value(samples, "enginecore_stage_up", stage=stage) == 0
            assert ("enginecore_steps_total", frozenset({("stage", stage)})) not in samples
        finally:
            proc.kill()
            proc.wait()
            assert proc.stderr is not None
            proc.stderr.close()

    @pytest.mark.parametrize("port", ["-1", "65536", "http", ""])
    def test_a_bad_port_is_refused(self, port: str) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "enginecore", "serve", "--engine", COUNTDOWN,
             "--bind", "tcp://127.0.0.1:*", "--metrics-port", port],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert "--metrics-port" in done.stderr
        assert "0 to 65535" in done.stderr

    def test_a_port_in_use_is_refused_before_the_engine_is_built(self) -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            done = subprocess.run(
                [sys.executable, "-m", "enginecore", "serve",
                 "--engine", "enginecore.stage.testing:sleeping_factory",
                 "--bind", "tcp://127.0.0.1:*", "--metrics-port", str(port)],
                capture_output=True, text=True, timeout=30, check=False,
            )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert f"cannot serve metrics on 127.0.0.1:{port}" in done.stderr
        assert "Traceback" not in done.stderr


# The fields the metrics leave out, each for a reason; every other one must be read.
_NOT_EXPORTED = {
    "loop.outputs": "a stage's loop emits no outputs itself (always 0): stage.outputs is exported",
    "name": "the stage label comes from the collector's caller",
    "load_interval": "a setting, not a measurement (client.stats() has it)",
}


def test_every_statistics_field_is_exported_or_named_as_left_out() -> None:
    """A field added to LoopStatistics or StageStatistics fails here until the metrics
    export it or _NOT_EXPORTED says why not."""
    from dataclasses import fields

    from enginecore.stage import StageStatistics
    from enginecore.stage.prometheus import stage_families

    read: set[str] = set()

    class _Recording:
        def __init__(self, real: object, prefix: str) -> None:
            self._real, self._prefix = real, prefix

        def __getattr__(self, name: str) -> object:
            read.add(self._prefix + name)
            value = getattr(self._real, name)
            return _Recording(value, "loop.") if name == "loop" else value

    loop_fields: dict[str, Any] = {f.name: 0 for f in fields(LoopStatistics)}
    loop_fields |= {"step_histogram": (0,) * 13, "engine": {"running": 1.0}, "engine_age": 0.1}
    stage_fields: dict[str, Any] = {f.name: 0 for f in fields(StageStatistics)}
    stage_fields |= {"loop": LoopStatistics(**loop_fields), "name": "s", "factory": "f"}
    stats = StageStatistics(**stage_fields)
    stage_families([("s", _Recording(stats, ""))])  # type: ignore[list-item]
    every = {f"loop.{f.name}" for f in fields(LoopStatistics)} | {
        f.name for f in fields(StageStatistics) if f.name != "loop"
    }
    assert every - read - set(_NOT_EXPORTED) == set()
    assert set(_NOT_EXPORTED) <= every
