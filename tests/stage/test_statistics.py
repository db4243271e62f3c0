"""A stage's statistics (``client.stats()``) and load reports (``client.load()``), through
both clients (``[sync]`` / ``[async]``), against real launched stages; the raw protocol's
view of both (``docs/wire.md``)."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from pathlib import Path
from types import MappingProxyType
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from enginecore import LoopStatistics
from enginecore.stage import StageClosedError, StageLoad, StageObserver, StageStatistics
from enginecore.stage._statistics import _wire_fields, check_load_interval, statistics_to_wire
from enginecore.stage.testing import ScriptedEngine

from .conftest import SCRIPTED, Launch, Server, wait_until
from .raw import RawClient, in_process_stage, welcomed_once_free

PIPELINED = "enginecore.stage.testing:pipelined"
# Outside a pipeline a request's input never closes: after its first output it stays live,
# with nothing to step, and the loop idles.
RELAY = "enginecore.stage.testing:relay"


class TestStats:
    def test_counts_after_work(self, launch: Launch) -> None:
        client = launch(SCRIPTED, name="stats-1")
        streams = [client.add(f"r{i}", 5) for i in range(4)]
        for s in streams:
            s.collect(10)
        client.abort(["nope"])
        client.call_utility("echo", 1)
        stats = client.stats()
        assert isinstance(stats, StageStatistics)
        assert isinstance(stats.loop, LoopStatistics)
        assert stats.name == "stats-1"
        assert stats.factory == SCRIPTED
        assert stats.pid == client.pid
        assert stats.outputs == 20  # the stage's own count: its loop emits none itself
        assert stats.loop.outputs == 0
        assert stats.steps == stats.loop.steps >= 5
        assert sum(stats.loop.step_histogram) == stats.steps
        assert stats.loop.adds == 4
        assert stats.loop.aborts == 1
        assert stats.loop.utility_calls >= 1
        assert stats.live == 0
        assert stats.loop.running
        assert stats.uptime_seconds > 0
        assert not stats.stalled
        # Going idle sampled the engine's stats(): its numbers at rest.
        assert stats.engine["running"] == 0

    def test_answered_during_a_long_step(self, launch: Launch) -> None:
        client = launch(SCRIPTED, step_timeout=0.3)
        client.call_utility("stall_next_step", 3.0)  # the next step sleeps 3 s
        # The stage's watchdog says when the loop is inside that step.
        assert wait_until(lambda: client.health() == "stalled", timeout=5)
        t0 = time.monotonic()
        stats = client.stats(timeout=2.0)  # the loop is busy for ~2.5 s more: not waited for
        assert time.monotonic() - t0 < 2.0
        assert stats.loop.running
        assert stats.loop.step_seconds_max < 3.0  # that step has not ended
        assert stats.stalled  # the watchdog's verdict rides along

    def test_bad_timeout_and_closed_client(self, launch: Launch) -> None:
        client = launch(SCRIPTED)
        with pytest.raises(ValueError, match="non-negative"):
            client.stats(timeout=-1)
        with pytest.raises(ValueError, match="non-negative"):  # as stats(): both clients
            client.call_utility("echo", timeout=-1)
        client.close()
        with pytest.raises(StageClosedError):
            client.stats()

    def test_from_wire_refuses_what_is_not_statistics(self) -> None:
        with pytest.raises(ValueError, match="not a stage's statistics"):
            StageStatistics.from_wire({"loop": {}})
        with pytest.raises(ValueError, match="not a stage's statistics"):
            StageStatistics.from_wire([1, 2])


# -- the wire form: derived from the dataclasses' fields --------------------------------------

_NUMBER = st.floats(min_value=0, allow_nan=False, allow_infinity=False)
_COUNT = st.integers(0, 2**63 - 1)
_BY_ANNOTATION: dict[str, st.SearchStrategy[Any]] = {
    "int": _COUNT,
    "float": _NUMBER,
    "bool": st.booleans(),
    "str": st.text(),
    "float | None": st.none() | _NUMBER,
    "tuple[int, ...]": st.lists(_COUNT, max_size=14).map(tuple),
    "Mapping[str, float]": st.dictionaries(st.text(), _NUMBER, max_size=4).map(MappingProxyType),
}


def _every_field(cls: type[Any], **given_fields: Any) -> st.SearchStrategy[Any]:
    """Instances of the dataclass *cls*, with a value drawn for every field (a field of a
    new annotation fails here, as it does in the module: each needs a wire form)."""
    drawn = {
        f.name: _BY_ANNOTATION[str(f.type)]
        for f in dataclasses.fields(cls)
        if f.name not in given_fields
    }
    return st.builds(cls, **drawn, **given_fields)


_STATS = _every_field(StageStatistics, loop=_every_field(LoopStatistics))
_LOOP_NAMES = [f.name for f in dataclasses.fields(LoopStatistics)]
_STAGE_NAMES = [f.name for f in dataclasses.fields(StageStatistics) if f.name != "loop"]


class TestWireForm:
    @given(_STATS)
    def test_every_field_crosses_the_wire(self, stats: StageStatistics) -> None:
        wire = msgspec.msgpack.decode(msgspec.msgpack.encode(statistics_to_wire(stats)))
        assert set(wire["loop"]) == {*_LOOP_NAMES, "step_buckets"}
        assert set(wire["stage"]) == set(_STAGE_NAMES)
        back = StageStatistics.from_wire(wire)
        for name in _LOOP_NAMES:
            assert getattr(back.loop, name) == getattr(stats.loop, name), name
        for name in _STAGE_NAMES:
            assert getattr(back, name) == getattr(stats, name), name
        assert back == stats

    @pytest.mark.parametrize(
        ("part", "name"),
        [("loop", n) for n in _LOOP_NAMES] + [("stage", n) for n in _STAGE_NAMES],
    )
    @given(stats=_STATS)
    @settings(max_examples=5)
    def test_a_missing_field_is_refused(self, part: str, name: str, stats: StageStatistics) -> None:
        wire = statistics_to_wire(stats)
        del wire[part][name]
        if name == "stalled":  # added later: a stage that predates it does not send it
            assert not StageStatistics.from_wire(wire).stalled
            return
        if name == "cut_clients":  # the same
            assert StageStatistics.from_wire(wire).cut_clients == 0
            return
        with pytest.raises(ValueError, match="not a stage's statistics"):
            StageStatistics.from_wire(wire)

    def test_a_field_without_a_wire_form_stops_the_import(self) -> None:
        @dataclasses.dataclass(frozen=True)
        class _New:
            ratio: complex

        with pytest.raises(TypeError, match=r"_New\.ratio: no wire form for 'complex'"):
            _wire_fields(_New)

    def test_the_wire_doc_names_every_field(self) -> None:
        doc = (Path(__file__).parents[2] / "docs" / "wire.md").read_text()
        answer = doc[doc.index("**The `stats` answer.**") :].split("\n\n", 1)[0]
        for name in [*_LOOP_NAMES, *_STAGE_NAMES, "step_buckets"]:
            assert f"`{name}`" in answer, name


class TestLoad:
    def test_none_before_any_step_and_none_while_idle(self, launch: Launch) -> None:
        client = launch(SCRIPTED)
        assert client.load() is None
        client.call_utility("echo", 1)  # a round trip: nothing stepped, nothing reported
        assert client.load() is None

    def test_reports_while_stepping(self, launch: Launch) -> None:
        client = launch(SCRIPTED, load_interval=0.02)
        client.call_utility("pace", 0.005)  # a step every 5 ms
        stream = client.add("r", 60)  # ~0.3 s of steps
        first: StageLoad | None = None
        for _ in stream:
            load = client.load()
            if first is None and load is not None:
                first = load
        assert first is not None
        last = client.load()
        assert last is not None
        assert last.seq > first.seq >= 1
        # About one report per 20 ms over ~0.3 s; at most one per interval.
        assert 3 <= last.seq <= 0.3 / 0.02 + 5
        assert last.engine["pace"] == 0.005
        assert "running" in last.engine
        assert 0 <= last.live <= 1
        assert last.age >= 0
        # It ages while nothing new comes (the stage is idle now: it sends no more).
        time.sleep(0.05)
        later = client.load()
        assert later is not None
        assert later.seq == last.seq
        assert later.age >= last.age + 0.04
        assert client.stats().load_reports == last.seq

    def test_the_last_report_before_idle_says_what_is_left(self, launch: Launch) -> None:
        """An idle stage sends nothing, so the step after which it idles carries a report
        when one went out while it was busy: a router must not keep the busy stage's load
        (here for a minute, the interval) while the stage sits idle."""
        client = launch(SCRIPTED, load_interval=60)
        for stream in client.add_many([(f"r{i}", 5) for i in range(3)]):
            stream.collect(10)
        load = client.load()
        assert load is not None
        assert (load.seq, load.live) == (2, 0)  # the first step's report, then the idle one
        assert load.engine["running"] == 0
        # A second job: no report due for a minute, and the last one says idle already.
        client.add("again", 3).collect(10)
        load = client.load()
        assert load is not None
        assert (load.seq, load.live) == (2, 0)

    def test_a_pipelined_stage_reports_itself_idle(self, launch: Launch) -> None:
        """A pipelined engine's collect cannot know whether the loop idles after it (another
        step may be in flight), so no step carries the idle report: the stage sends it
        alone as the loop blocks. Without it the first step's busy report (3 live) would
        stand for the whole interval (here a minute) while the stage sits idle."""
        client = launch(PIPELINED, load_interval=60)
        for stream in client.add_many([(f"r{i}", 5) for i in range(3)]):
            stream.collect(10)
        # The idle report is posted as the loop blocks for its next message, so the answer
        # to the second call, at the latest, comes after it on the same socket.
        for _ in range(2):
            client.call_utility("num_requests")
        load = client.load()
        assert load is not None
        assert (load.seq, load.live) == (2, 0)  # the first collect's report, then the idle one
        assert load.engine["running"] == 0
        # A second job: no report due, and the last one says idle already: none is sent.
        client.add("again", 3).collect(10)
        for _ in range(2):
            client.call_utility("num_requests")
        load = client.load()
        assert load is not None
        assert (load.seq, load.live) == (2, 0)
        assert client.stats().load_reports == 2

    def test_none_when_turned_off(self, launch: Launch) -> None:
        client = launch(SCRIPTED, load_interval=None)
        client.add("r", 50).collect(10)
        assert client.load() is None
        assert client.stats().load_interval is None

    @pytest.mark.parametrize(
        ("value", "error"),
        [(0, ValueError), (-1, ValueError), (float("inf"), ValueError), ("1", TypeError)],
    )
    def test_bad_intervals_are_refused_before_launch(
        self, launch: Launch, value: Any, error: type[Exception]
    ) -> None:
        with pytest.raises(error, match="load_interval"):
            launch(SCRIPTED, load_interval=value)

    def test_events_handed_out_never_carry_it(self, launch: Launch) -> None:
        client = launch(SCRIPTED, ordered_events=True, load_interval=0.001)
        client.add("r", 20)
        seen: list[Any] = []
        while not any(getattr(e, "finished", [False])[-1:] == [True] for e in seen):
            seen += client.get_events(5)
        assert client.load() is not None
        assert all(getattr(e, "load", None) is None for e in seen)


def test_check_load_interval() -> None:
    assert check_load_interval(None) is None
    assert check_load_interval(1) == 1.0
    with pytest.raises(TypeError):
        check_load_interval(True)


class _Holding(ScriptedEngine):
    """Holds its requests without stepping them once utility ``hold`` was called: live in
    the stage, yet the loop idles (an engine waiting for a resource, a pipeline stage
    waiting for credit)."""

    def __init__(self) -> None:
        super().__init__()
        self.held = False
        self.steps = 0

    def has_work(self) -> bool:
        return not self.held and super().has_work()

    def step(self) -> list[tuple[str, int]]:
        self.steps += 1
        return super().step()

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        if name == "hold":
            self.held = True
            return None
        return super().utility(name, args)


class TestIdleLoad:
    """What is live can change while the loop idles (an abort, an add the engine holds):
    with no step to carry a report, the idle loop sends one, at most one an interval, so a
    router does not go on with the count from before."""

    def test_an_abort_while_idle_is_reported_without_a_step(self, no_leftovers: str) -> None:
        engine = _Holding()
        with in_process_stage(engine, no_leftovers, load_interval=0.05) as (_, client):
            client.send("adds", ["a", "b"], [10**6, 10**6])
            client.until(lambda ev: ev[0] == "outputs")  # stepping
            client.send("utility", 1, "hold", [])
            client.until(lambda ev: ev[0] == "utility")
            # Held: the loop idles with both live, and its last report says so.
            client.send("utility", 2, "echo", [])
            client.until(lambda ev: ev[0] == "utility")
            assert client.loads[-1]["live"] == 2, client.loads
            steps = engine.steps
            client.send("abort", ["a"])
            client.until(lambda ev: ev[0] == "aborted")
            # The report of the abort, with no step: it said 2 live until the next step.
            client.until(lambda ev: ev[0] == "outputs" and client.loads[-1]["live"] == 1)
            assert engine.steps == steps
            assert client.loads[-1]["engine"]["running"] == 1

    def test_an_add_held_while_idle_is_reported_without_a_step(self, no_leftovers: str) -> None:
        engine = _Holding()
        with in_process_stage(engine, no_leftovers, load_interval=0.05) as (_, client):
            client.send("utility", 1, "hold", [])
            client.until(lambda ev: ev[0] == "utility")
            client.send("add", "a", 5)
            client.until(lambda ev: ev[0] == "outputs" and client.loads[-1]["live"] == 1)
            assert engine.steps == 0
            assert [report["live"] for report in client.loads] == [1]


def _serve(*args: str, engine: str) -> Server:
    return Server("--engine", engine, "--bind", "tcp://127.0.0.1:*", *args)


def _stats(client: RawClient, call_id: int) -> StageStatistics:
    """The stage's statistics, asked by the attached raw *client*."""
    client.send("stats", call_id)
    answer = client.until(lambda ev: ev[0] == "utility" and ev[1] == call_id)[-1]
    return StageStatistics.from_wire(answer[2])


class TestNewClientLoad:
    """A report the stage made before a new client was its current one (for the client
    before it, for nobody, or while the new one was being welcomed) never reached it, so it
    does not count as sent to it: the stage sends the new client its load at the next
    chance (the idle wait, or the next step), rather than leaving it with none until what
    is live changes."""

    @pytest.mark.parametrize(
        ("keep", "live", "made"),
        [(False, 0, 2), (True, 1, 1)],
        ids=["aborted-on-detach", "kept-on-detach"],
    )
    def test_the_next_client_of_an_idle_stage_gets_its_load(
        self, no_leftovers: str, keep: bool, live: int, made: int
    ) -> None:
        """A one-client stage: the first client leaves a request live and idle (a relay
        engine holds it), then says ``bye``. With the requests aborted on detach, the stage
        reports the change alone while no client is attached (queued for nobody, dropped
        when the next client is welcomed); kept, it has nothing new to report. Either way
        the next client must get a report of what is live now."""
        args = ("--load-interval", "0.05", *(("--keep-requests-on-detach",) if keep else ()))
        srv = _serve(*args, engine=RELAY)
        try:
            with RawClient(srv.address) as first:
                assert first.hello()[0] == "welcome"
                first.send("add", "held", "x")
                first.until(lambda ev: ev[0] == "outputs" and ev[1] == ["held"])
                assert [r["live"] for r in first.loads] == [1]  # the step before it idled
                first.send("bye")
            with StageObserver(srv.address) as observer:
                # The stage has read the bye and made the reports it makes for it.
                assert wait_until(lambda: observer.stats(timeout=10).load_reports == made, 10)
            with welcomed_once_free(srv.address, rejected="another client is") as second:
                # Two round trips: the report is posted as the loop next blocks for a
                # message, so before the second call's answer at the latest.
                second.call(1, "echo")
                second.call(2, "echo")
                assert [(r["seq"], r["live"]) for r in second.loads] == [(made + 1, live)]
                assert second.loads[0]["engine"] == {}  # the relay engine has no stats()
        finally:
            assert srv.stop() == 0

    def test_a_client_that_takes_a_silent_clients_session_over_gets_its_load(
        self, no_leftovers: str
    ) -> None:
        """A one-client stage that keeps requests on detach: the first client leaves a
        request live and idle (a relay engine holds it), then goes silent, no ping and no
        ``bye``, its ``PULL`` still connected. Past the session timeout, the next client's
        ``hello`` is held until that ``PULL`` goes, then welcomed: it takes the session over,
        and the request is kept for it. The stage's one report went to the first client
        and nothing changes after, so the new client must still get a report of what is
        live now: the kept request."""
        srv = _serve(
            "--keep-requests-on-detach", "--session-timeout", "0.5", "--load-interval", "0.05",
            engine=RELAY,
        )  # fmt: skip
        try:
            with RawClient(srv.address) as first, RawClient(srv.address) as second:
                assert first.hello()[0] == "welcome"
                first.send("add", "held", "x")
                first.until(lambda ev: ev[0] == "outputs" and ev[1] == ["held"])
                assert [r["live"] for r in first.loads] == [1]  # the step before it idled
                # Silent from now on. Within the session timeout a hello is rejected at
                # once; past it, it is held while the first client's PULL is connected (it
                # is answered within 5 s only when that PULL goes).
                deadline = time.monotonic() + 10
                while True:
                    second.send_hello()
                    if not second.dealer.poll(1000):
                        break  # held
                    reply = second.reply()
                    assert reply[0] == "reject", reply
                    assert reply[2] == "another client is attached to this stage", reply
                    assert time.monotonic() < deadline, "the session never timed out"
                    time.sleep(0.05)
                first.close()  # no bye: its PULL goes, and the held hello is welcomed
                assert second.hello_reply()[0] == "welcome"
                second.until(lambda _: bool(second.loads), timeout=5)
                assert [(r["seq"], r["live"]) for r in second.loads] == [(2, 1)]
        finally:
            assert srv.stop() == 0

    def test_a_client_welcomed_during_a_step_gets_that_steps_report(
        self, no_leftovers: str
    ) -> None:
        """A shared stage welcomes a second client while its loop is inside a step, whose
        report (the one after which the loop idles) goes out before the loop has applied
        the new client's session: only the first client gets it. Nothing changes after:
        the second must still get the stage's load once it is attached."""
        srv = _serve(
            "--max-clients", "2", "--step-timeout", "0.2", "--load-interval", "60",
            engine=SCRIPTED,
        )  # fmt: skip
        try:
            with RawClient(srv.address) as first, RawClient(srv.address) as second:
                assert first.hello()[0] == "welcome"
                first.call(1, "pace", 2.0)  # every step sleeps 2 s first
                first.send("add", "r", 1)  # one step, after which the loop idles
                assert wait_until(lambda: _stats(first, 2).stalled, 10)  # inside it
                assert second.hello()[0] == "welcome"
                # Welcomed while the step runs: its report is not made yet.
                during = _stats(second, 1)
                assert (during.stalled, during.load_reports) == (True, 0)
                first.until(lambda ev: ev[0] == "outputs" and ev[2] == [True], timeout=10)
                assert (first.loads[0]["seq"], first.loads[0]["live"]) == (1, 0)
                second.call(2, "echo")
                second.call(3, "echo")
                assert [(r["seq"], r["live"]) for r in second.loads] == [(2, 0)]
                assert second.loads[0]["engine"]["running"] == 0
        finally:
            assert srv.stop() == 0


class TestRawProtocol:
    def test_stats_is_answered_as_a_utility_call(self, no_leftovers: str) -> None:
        with in_process_stage(ScriptedEngine(), no_leftovers) as (_, client):
            # The input side answers stats without the loop, so it may answer before the
            # loop's run() has begun (running: False); a utility's answer means it has.
            client.call(1, "echo")
            client.send("stats", 77)
            (answer,) = client.until(lambda ev: ev[0] == "utility")
            assert answer[0:2] == ["utility", 77]
            assert answer[3] is None
            assert set(answer[2]) == {"loop", "stage"}
            assert StageStatistics.from_wire(answer[2]).loop.running

    def test_a_bad_stats_message_is_an_unscoped_error(self, no_leftovers: str) -> None:
        with in_process_stage(ScriptedEngine(), no_leftovers) as (_, client):
            client.send("stats", "x")
            (error,) = client.until(lambda ev: ev[0] == "error")
            assert error[1] is None
            assert "invalid message" in error[2]
            client.send("ping", 1)
            client.until(lambda ev: ev[0] == "pong")

    def test_the_report_is_the_fifth_element_of_an_outputs_event(self, no_leftovers: str) -> None:
        with in_process_stage(ScriptedEngine(), no_leftovers) as (_, client):
            client.send("add", "r", 3)
            client.until(lambda ev: ev[0] == "outputs" and ev[2] == [True])
            assert client.loads, "no load report came with the outputs"
            report = client.loads[0]
            assert set(report) == {"seq", "age", "live", "engine"}
            assert report["seq"] == 1
            assert 0 <= report["age"] < 5
            assert report["live"] == 1
            assert report["engine"]["running"] == 1

    def test_a_report_counts_what_is_live_after_its_step(self, no_leftovers: str) -> None:
        """The requests a step finished are not in its report's ``live``: the client, which
        counts its own requests once the step's outputs are in, would otherwise take them
        for another client's."""
        with in_process_stage(ScriptedEngine(), no_leftovers, load_interval=60) as (_, client):
            client.send("adds", ["short", "long"], [1, 3])
            client.until(lambda ev: ev[0] == "outputs" and ev[1] == ["long"] and ev[2] == [True])
            assert [report["live"] for report in client.loads] == [1, 0]

    def test_one_stats_call_serves_a_report_and_the_loop(self, no_leftovers: str) -> None:
        """While a stage steps, a load report's ``engine.stats()`` call is also the loop's
        sample (``statistics().engine``): the loop does not call it again in between."""
        engine = ScriptedEngine()
        with in_process_stage(engine, no_leftovers, load_interval=0.05) as (stage, client):
            client.call(1, "pace", 0.005)  # a step every 5 ms
            client.send("add", "r", 80)  # ~0.4 s of steps: ~8 reports
            client.until(lambda ev: ev[0] == "outputs" and ev[2] == [True], timeout=10)
            # Each report carries the number of its own stats() call.
            calls = [report["engine"]["stats_calls"] for report in client.loads]
            assert len(calls) >= 4, calls
            # A loop that also sampled on its own, every 50 ms, made most gaps 2.
            gaps = [b - a for a, b in itertools.pairwise(calls)]
            assert gaps.count(1) >= len(gaps) - 1, calls
            # The loop's statistics show the report's sample, not one of their own.
            loop_sample = stage.runtime.loop.statistics().engine["stats_calls"]
            assert loop_sample <= calls[-1] + 1  # + 1: the sample on going idle


def test_statistics_from_another_thread_while_stepping(launch: Launch) -> None:
    """Many readers at once, during steps: each snapshot is consistent."""
    client = launch(SCRIPTED)
    client.call_utility("pace", 0.001)
    stream = client.add("r", 200)
    errors: list[BaseException] = []

    def read() -> None:
        try:
            for _ in range(20):
                s = client.stats()
                assert sum(s.loop.step_histogram) == s.steps
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    stream.collect(20)
    for t in threads:
        t.join(20)
    assert not errors
