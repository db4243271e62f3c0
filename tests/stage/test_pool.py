"""The replica pool, through both pools (``[sync]`` StagePool, ``[async]`` AsyncStagePool
behind a thin blocking adapter), on real stage processes and sockets."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import math
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import pytest

from enginecore.stage import (
    Aborted,
    AsyncPoolRequestStream,
    AsyncStageClient,
    AsyncStagePool,
    EngineDeadError,
    ErrorReport,
    LeastLoaded,
    NoReplicaError,
    Outputs,
    PipelineStage,
    PoolRequest,
    PoolRequestStream,
    Replica,
    ReplicaDeadError,
    ReplicaEvent,
    ReplicaGone,
    ReplicaState,
    ReplicaView,
    RequestError,
    RequestFailed,
    RestartPolicy,
    Routing,
    StageClient,
    StageClosedError,
    StageHealth,
    StagePool,
    StageStatistics,
    Sticky,
    UtilityError,
    UtilityResult,
    _session,
)

from .conftest import (
    BlockingAsyncStream,
    EventLoopThread,
    Server,
    child_pids,
    pid_gone,
    wait_until,
)

DEVICE = "enginecore.stage.testing:device"
COUNTDOWN = "enginecore.stage.testing:countdown"
BARRIER = "enginecore.stage.testing:barrier_factory"
RELAY = "enginecore.stage.testing:relay"

pytestmark = pytest.mark.timeout(60)


class BlockingAsyncPoolStream(BlockingAsyncStream):
    """An AsyncPoolRequestStream behind PoolRequestStream's blocking interface."""

    @property
    def replica(self) -> Replica | None:
        return cast(AsyncPoolRequestStream, self._stream).replica

    @property
    def migrations(self) -> int:
        return cast(AsyncPoolRequestStream, self._stream).migrations


class BlockingAsyncPool:
    """An AsyncStagePool behind StagePool's blocking interface; every call runs as a
    coroutine on the pool's event loop (another thread) and the caller waits for it."""

    def __init__(self, runner: EventLoopThread, pool: AsyncStagePool) -> None:
        self._runner = runner
        self._pool = pool

    replicas = property(lambda self: self._pool.replicas)
    closed = property(lambda self: self._pool.closed)

    def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        async def call() -> Any:
            return await fn(*args, **kwargs)

        return self._runner.run(call())

    def health(self) -> StageHealth:
        return self._pool.health()

    def add(self, req_id: str, data: Any, stream: bool = True, *, key: Any = None) -> Any:
        got = self._run(self._pool.add, req_id, data, stream, key=key)
        return None if got is None else BlockingAsyncPoolStream(self._runner, got)

    def add_many(self, items: Iterable[tuple[str, Any]], *, streams: bool = True) -> Any:
        got = self._run(self._pool.add_many, items, streams=streams)
        return None if got is None else [BlockingAsyncPoolStream(self._runner, s) for s in got]

    def get_event(self, timeout: float | None = None) -> Any:
        return self._run(self._pool.get_event, timeout)

    def get_events(self, timeout: float | None = None) -> Any:
        return self._run(self._pool.get_events, timeout)

    def abort(self, req_ids: Any) -> None:
        self._run(self._pool.abort, req_ids)

    def call_utility(self, name: str, /, *args: Any, **kwargs: Any) -> Any:
        return self._run(self._pool.call_utility, name, *args, **kwargs)

    def stats(self, timeout: float | None = 10.0) -> Any:
        return self._run(self._pool.stats, timeout)

    def add_replica(self, *args: Any, **kwargs: Any) -> Replica:
        return cast(Replica, self._run(self._pool.add_replica, *args, **kwargs))

    def remove_replica(self, replica: Replica, **kwargs: Any) -> int | None:
        return cast("int | None", self._run(self._pool.remove_replica, replica, **kwargs))

    def shutdown(self, timeout: float = 5.0, *, drain: float | None = None) -> Any:
        return self._run(self._pool.shutdown, timeout, drain=drain)

    def close(self) -> None:
        self._run(self._pool.close)

    def __enter__(self) -> BlockingAsyncPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


Open = Callable[..., StagePool]


@pytest.fixture(params=["sync", "async"])
def pools(request: pytest.FixtureRequest, no_leftovers: str) -> Iterator[tuple[Open, Open]]:
    """``(launch, connect)``: StagePool's or AsyncStagePool's (behind the adapter, typed as a
    StagePool). Every pool opened is closed afterwards."""
    runner = EventLoopThread() if request.param == "async" else None
    opened: list[Any] = []

    def opener(name: str) -> Open:
        def open_(*args: Any, **kwargs: Any) -> StagePool:
            if runner is None:
                pool: Any = getattr(StagePool, name)(*args, **kwargs)
            else:

                async def make() -> AsyncStagePool:
                    made: AsyncStagePool = await getattr(AsyncStagePool, name)(*args, **kwargs)
                    return made

                pool = BlockingAsyncPool(runner, runner.run(make()))
            opened.append(pool)
            return cast(StagePool, pool)

        return open_

    try:
        yield opener("launch"), opener("connect")
    finally:
        try:
            for pool in opened:
                pool.close()
        finally:
            if runner is not None:
                runner.stop()


@pytest.fixture
def launch(pools: tuple[Open, Open]) -> Open:
    """``launch(factory=DEVICE, replicas=2, **kwargs)``."""
    open_ = pools[0]

    def launch_(factory: str = DEVICE, **kwargs: Any) -> StagePool:
        kwargs.setdefault("replicas", 2)
        kwargs.setdefault("startup_timeout", 30)
        return open_(factory, **kwargs)

    return launch_


# -- serving -----------------------------------------------------------------------------------


def test_a_finished_stream_leaves_the_pools_table_as_it_ends(launch: Open) -> None:
    # The receiver takes a finished stream out of the pool's table of live requests as it
    # ends it. Before, ended streams stayed there (with every arrival reading) until the
    # table had doubled, and then add_many() scanned the whole table, under the lock and
    # before its send: every other burst of a pool of one paid for it.
    pool = launch(COUNTDOWN, replicas=1)
    core = getattr(pool, "_pool", pool)._core
    for burst in range(3):
        streams = pool.add_many([(f"b{burst}-{i}", 3) for i in range(600)])
        for s in streams:
            assert s.collect(10) == [2, 1, 0]
        assert wait_until(lambda: not core._live, 10), len(core._live)
    one = pool.add("one", 2)
    assert one.collect(10) == [1, 0]
    assert wait_until(lambda: not core._live, 10)


def test_a_pool_of_ones_burst_checks_the_pools_table_in_the_members_hold(launch: Open) -> None:
    # A burst on a pool of one routable replica goes without a reservation in the pool's
    # table: the pool's checks (open, no id live in the pool, with or without a stream)
    # run in the member's hold of the lock that registers the streams. All or nothing.
    pool = launch(replicas=1, kwargs={"step_s": 0.01}, ordered_events=True)
    core = getattr(pool, "_pool", pool)._core
    (replica,) = pool.replicas
    pool.add("live", 50)
    pool.add("quiet", 50, stream=False)
    for rid in ("live", "quiet"):
        with pytest.raises(ValueError, match="still live in this pool"):
            pool.add_many([("x", 1), (rid, 1)])
    assert "x" not in core._live
    streams = pool.add_many([("x", 2), ("y", 3)])
    assert [s.replica for s in streams] == [replica, replica]
    assert [core._live[rid].req_id for rid in ("x", "y")] == ["x", "y"]  # in the table
    assert [s.collect(10) for s in streams] == [[1, 0], [2, 1, 0]]
    assert wait_until(lambda: "x" not in core._live and "y" not in core._live, 10)
    pool.close()
    with pytest.raises(StageClosedError):
        pool.add_many([("z", 1)])


def test_requests_spread_over_the_replicas_and_stream_their_outputs(launch: Open) -> None:
    pool = launch(kwargs={"step_s": 0.01})
    r0, r1 = pool.replicas
    assert [r.name for r in pool.replicas] == ["r0", "r1"]
    assert r0.pid != r1.pid
    assert r0.launched
    assert r0.state is ReplicaState.SERVING
    assert r0.address is not None
    assert r0.restarts == 0
    streams = [pool.add(f"q{i}", 20) for i in range(8)]
    # Least loaded, exact in-flight counts: 4 each, before any output.
    assert sorted(r.in_flight for r in pool.replicas) == [4, 4]
    assert {s.replica for s in streams} == {r0, r1}
    for s in streams:
        assert s.collect(10) == list(range(19, -1, -1))
        assert s.finished
    assert [r.in_flight for r in pool.replicas] == [0, 0]
    assert pool.health() == StageHealth.OK == r0.health


@pytest.mark.parametrize("events", [False, True], ids=["streams", "event-stream"])
def test_one_receiver_thread_reads_every_replica(no_leftovers: str, events: bool) -> None:
    def names() -> list[str]:
        return sorted(t.name for t in threading.enumerate() if t.name.startswith("enginecore"))

    before = names()
    with StagePool.launch(COUNTDOWN, replicas=3, startup_timeout=30, ordered_events=events) as pool:
        assert names() == sorted([*before, "enginecore-pool-receiver"])
        streams = pool.add_many([(f"x{i}", 3) for i in range(9)])
        assert {s.replica for s in streams} == set(pool.replicas)
        assert all(s.collect(10) == [2, 1, 0] for s in streams)
        if events:  # the event stream takes no thread either
            pool.add_many([(f"y{i}", 3) for i in range(9)], streams=False)
            log = EventLog(pool)
            log.until_ended([f"y{i}" for i in range(9)])
            assert names() == sorted([*before, "enginecore-pool-receiver"])
    assert names() == before


def test_add_many_spreads_a_burst_and_keeps_the_order(launch: Open) -> None:
    pool = launch(replicas=3)
    streams = pool.add_many([(f"b{i}", 1 + i % 3) for i in range(30)])
    assert [s.req_id for s in streams] == [f"b{i}" for i in range(30)]
    counts: dict[str, int] = {}
    for s in streams:
        assert s.replica is not None
        counts[s.replica.name] = counts.get(s.replica.name, 0) + 1
    assert counts == {"r0": 10, "r1": 10, "r2": 10}
    for i, s in enumerate(streams):
        assert s.collect(10)[-1] == 0, i
    assert pool.add_many([]) == []


def test_bad_requests_are_refused_before_anything_is_sent(launch: Open) -> None:
    pool = launch(kwargs={"step_s": 0.01})
    live = pool.add("dup", 50)
    with pytest.raises(ValueError, match="still live in this pool"):
        pool.add("dup", 1)  # whichever replica it would go to
    with pytest.raises(ValueError, match="live in this pool"):
        pool.add_many([("x", 1), ("dup", 1)])
    with pytest.raises(ValueError, match="twice"):
        pool.add_many([("y", 1), ("y", 1)])
    with pytest.raises(TypeError):
        pool.add("z", {1, 2})
    with pytest.raises(TypeError):
        pool.abort("dup")
    with pytest.raises(TypeError, match="takes a sequence of request ids, got int"):
        pool.abort(5)  # type: ignore[arg-type]
    # Nothing of the refused ones was sent or reserved: the ids are free.
    assert pool.add("x", 1).collect(10) == [0]
    assert pool.add("y", 1).collect(10) == [0]
    pool.abort(["dup"])
    assert live.collect(10)[-1] > 0
    assert live.aborted
    assert pool.add("dup", 1).collect(10) == [0]  # free again once ended


def test_a_rejected_request_fails_alone(launch: Open) -> None:
    pool = launch()
    bad = pool.add("bad", -1)
    with pytest.raises(RequestError, match="int >= 1"):
        bad.collect(10)
    assert pool.add("good", 2).collect(10) == [1, 0]


def test_abort_reaches_the_replica_that_serves_the_request(launch: Open) -> None:
    pool = launch(kwargs={"step_s": 0.01})
    streams = [pool.add(f"a{i}", 10_000) for i in range(4)]
    assert {s.replica for s in streams} == set(pool.replicas)
    pool.abort(["a1", "a2", "unknown"])
    for i, s in enumerate(streams):
        if i in (1, 2):
            s.collect(10)
            assert s.aborted
    assert [r.in_flight for r in pool.replicas] == [1, 1]
    pool.abort(["a0", "a3"])
    for s in streams:
        s.collect(10)
        assert s.aborted


def test_utilities_go_to_one_replica_or_to_all(launch: Open) -> None:
    pool = launch(replicas=3)
    pids = {r.pid for r in pool.replicas}
    assert pool.call_utility("pid") in pids
    r2 = pool.replicas[2]
    assert pool.call_utility("pid", replica=r2) == r2.pid
    assert pool.call_utility("echo", 1, "a", replica=r2) == [1, "a"]
    answers = pool.call_utility("pid", broadcast=True)
    assert answers == {r: r.pid for r in pool.replicas}
    errors = pool.call_utility("nope", broadcast=True)
    assert set(errors) == set(pool.replicas)
    assert all(isinstance(e, UtilityError) for e in errors.values())
    with pytest.raises(UtilityError):
        pool.call_utility("nope")
    with pytest.raises(TypeError):
        pool.call_utility("pid", replica=r2, broadcast=True)
    stats = pool.stats()
    assert set(stats) == set(pool.replicas)
    for r, s in stats.items():
        assert isinstance(s, StageStatistics)
        assert s.pid == r.pid
        assert s.name.endswith(f"/{r.name}")
    # A bad timeout raises, as a single call's does, before anything is sent: not a
    # TimeoutError per replica "within -1 s" (blocking) or a ValueError each (asyncio).
    bads: list[tuple[Any, type[Exception]]] = [
        (-1, ValueError),
        (float("nan"), ValueError),
        ("1", TypeError),
    ]
    for bad, error in bads:
        with pytest.raises(error, match="'timeout' must be"):
            pool.call_utility("pid", broadcast=True, timeout=bad)
        with pytest.raises(error, match="'timeout' must be"):
            pool.stats(bad)
    assert pool.call_utility("pid", broadcast=True, timeout=10) == answers


def test_a_utility_call_to_a_replica_not_in_the_pool_is_refused(launch: Open) -> None:
    pool = launch(replicas=2)
    other = launch(replicas=1)
    theirs = other.replicas[0]
    with pytest.raises(ValueError, match="not in this pool"):
        pool.call_utility("pid", replica=theirs)  # never reaches the other pool's stage
    with pytest.raises(ValueError, match="not in this pool"):
        pool.call_utility("pid", replica=cast(Any, "r0"))
    removed = pool.replicas[1]
    pool.remove_replica(removed)
    with pytest.raises(NoReplicaError, match="removed"):
        pool.call_utility("pid", replica=removed)
    assert pool.call_utility("pid", replica=pool.replicas[0]) == pool.replicas[0].pid


def test_stats_asks_every_replica_at_once(no_leftovers: str) -> None:
    """The blocking pool's stats() asks every replica before it waits for one, as the
    asyncio pool's does (it asked them one after the other, so that each stopped replica
    added a whole *timeout* to the wait)."""
    with StagePool.launch(COUNTDOWN, replicas=3) as pool:
        r0, r1, r2 = pool.replicas
        asked: list[Replica] = []
        for r in pool.replicas:
            member = r._client
            start = member._start_call

            def recorded(*args: Any, _r: Replica = r, _start: Any = start, **kw: Any) -> Any:
                asked.append(_r)
                return _start(*args, **kw)

            member._start_call = recorded
        pid = cast(int, r0.pid)
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            os.kill(pid, signal.SIGSTOP)
            try:
                got = ex.submit(pool.stats, None)
                assert wait_until(lambda: {r1, r2} <= set(asked), 10), asked  # r0 silent
            finally:
                os.kill(pid, signal.SIGCONT)
            stats = got.result(10)
        assert set(stats) == {r0, r1, r2}
        assert all(isinstance(s, StageStatistics) for s in stats.values())
        with pytest.raises(ValueError, match="timeout"):
            pool.stats(-1)


def test_an_abort_racing_an_add_many_in_another_thread(no_leftovers: str) -> None:
    """abort() of ids that an add_many() in another thread is sending: each id is
    either aborted or ignored (not yet live on a replica), never an AttributeError (an
    id held while its frame left has no replica yet)."""
    with StagePool.launch(COUNTDOWN, replicas=2) as pool:
        errors: list[BaseException] = []
        burst = [0]
        stop = threading.Event()

        def aborter() -> None:
            while not stop.is_set():
                try:
                    pool.abort([f"b{burst[0]}-{i}" for i in range(100)])
                except BaseException as exc:  # whatever escapes is the bug
                    errors.append(exc)

        thread = threading.Thread(target=aborter)
        thread.start()
        try:
            for n in range(300):
                burst[0] = n
                for s in pool.add_many([(f"b{n}-{i}", 3) for i in range(100)]):
                    s.collect(10)  # finished or aborted, either ends it
        finally:
            stop.set()
            thread.join(10)
        assert not errors, errors[:3]


# -- a dead or stuck replica ---------------------------------------------------------------


def test_a_killed_replica_fails_only_its_own_requests(launch: Open) -> None:
    pool = launch(replicas=3, kwargs={"step_s": 0.01})
    streams = [pool.add(f"k{i}", 300) for i in range(9)]
    first = [s.get(10) for s in streams]  # every request has delivered
    assert first == [299] * 9
    victim = pool.replicas[1]
    mine = [s for s in streams if s.replica is victim]
    assert len(mine) == 3
    killed_at = time.monotonic()
    os.kill(cast(int, victim.pid), signal.SIGKILL)
    for s in mine:
        with pytest.raises(ReplicaDeadError) as info:
            s.collect(10)
        assert time.monotonic() - killed_at < 1.0
        err = info.value
        assert isinstance(err, EngineDeadError)
        assert err.replica is victim
        assert err.delivered >= 1
        assert "SIGKILL" in str(err)
        assert "r1" in str(err)
    assert victim.state is ReplicaState.DEAD
    assert victim.health == StageHealth.DEAD
    # The others serve on; new requests avoid the dead one.
    fresh = [pool.add(f"n{i}", 2) for i in range(6)]
    assert all(s.replica is not victim for s in fresh)
    for s in fresh:
        assert s.collect(10) == [1, 0]
    for s in streams:
        if s not in mine:
            pool.abort([s.req_id])
            s.collect(10)
    assert pool.health() == StageHealth.OK


def test_a_replica_whose_process_exited_leaves_the_routing_at_once(
    launch: Open, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sentinel is seen at once, but the replica is dead (and its requests fail) only
    # once its last frames are read (EXIT_GRACE_S, here widened). Before, it stayed in the
    # routing all that while: a request added after the exit went to it and failed.
    # Widened well past what a loaded machine takes between the kill and the checks below
    # (the pool's close then waits for it: not longer).
    monkeypatch.setattr(_session, "EXIT_GRACE_S", 6.0)
    monkeypatch.setattr(_session, "EXIT_READ_MAX_S", 8.0)
    pool = launch(COUNTDOWN, replicas=2, routing=Sticky())
    victim, other = pool.replicas
    key = next(f"u{i}" for i in range(100) if pool.add(f"h{i}", 1, key=f"u{i}").replica is victim)
    pid = cast(int, victim.pid)
    os.kill(pid, signal.SIGKILL)
    # Out of the routing once the exit is seen (the reaping may come just before that).
    assert wait_until(lambda: not victim.routable, 10)
    assert victim.state is ReplicaState.SERVING  # its last frames are still being read
    streams = [pool.add(f"a{i}", 2, key=key) for i in range(4)]
    streams += pool.add_many([(f"b{i}", 2) for i in range(4)])
    assert [s.replica for s in streams] == [other] * 8
    for s in streams:
        assert s.collect(10) == [1, 0]
    # None left to route to: refused at once, not sent to a dead stage.
    pid = cast(int, other.pid)
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: not other.routable, 10)
    with pytest.raises(NoReplicaError, match=r"r1 serving \(its process exited\)"):
        pool.add("late", 2)


def test_a_call_on_a_dying_replica_gets_replica_dead_error(launch: Open) -> None:
    pool = launch(replicas=2)
    victim, other = pool.replicas
    killer = threading.Timer(0.3, os.kill, (victim.pid, signal.SIGKILL))
    killer.start()
    try:
        with pytest.raises(ReplicaDeadError) as info:
            pool.call_utility("sleep", 30, replica=victim)
    finally:
        killer.join()
    assert info.value.replica is victim
    assert info.value.delivered == 0
    assert pool.call_utility("pid") == other.pid


def test_no_replica_left_raises(launch: Open) -> None:
    pool = launch(COUNTDOWN, replicas=1)
    (only,) = pool.replicas
    os.kill(cast(int, only.pid), signal.SIGKILL)
    assert wait_until(lambda: only.state is ReplicaState.DEAD, 5)
    with pytest.raises(NoReplicaError, match="r0 dead"):
        pool.add("x", 1)
    with pytest.raises(NoReplicaError):
        pool.call_utility("num_requests")
    # A call on every serving replica raises too, as a dead client's stats() does: an
    # empty answer would read as "nothing to report", not "no replica serves".
    with pytest.raises(NoReplicaError, match="no replica serves: r0 dead"):
        pool.stats()
    with pytest.raises(NoReplicaError, match="no replica serves: r0 dead"):
        pool.call_utility("num_requests", broadcast=True)
    assert pool.health() == StageHealth.DEAD


def test_restart_brings_a_killed_replica_back(launch: Open) -> None:
    pool = launch(COUNTDOWN, replicas=2, restart=True)
    victim = pool.replicas[0]
    old_pid = victim.pid
    os.kill(cast(int, old_pid), signal.SIGKILL)
    # (pid reads None from the exit on, while the replica's last frames are read: it is
    # never the dead process's)
    assert wait_until(
        lambda: victim.state is ReplicaState.SERVING and victim.pid not in (None, old_pid), 10
    )
    assert victim.restarts == 1
    assert pid_gone(cast(int, old_pid))
    streams = [pool.add(f"r{i}", 2) for i in range(4)]
    assert {s.replica for s in streams} == set(pool.replicas)
    for s in streams:
        assert s.collect(10) == [1, 0]


def test_a_replicas_pid_is_its_live_process_or_none(launch: Open) -> None:
    # pool.replicas reported the pid of a stage that had died (while the replica was dead,
    # restarting, or removed): a user who signals it may hit an unrelated process.
    pool = launch(replicas=2, restart=RestartPolicy(first_delay=2.0))
    victim, other = pool.replicas
    old = cast(int, victim.pid)
    assert pool.call_utility("pid", replica=victim) == old
    os.kill(old, signal.SIGKILL)
    assert wait_until(lambda: victim.state is ReplicaState.DEAD, 10)
    assert victim.pid is None
    assert f"pid={old}" not in repr(victim)
    assert wait_until(lambda: victim.state is ReplicaState.SERVING, 20)
    assert victim.pid is not None
    assert victim.pid != old
    assert pool.call_utility("pid", replica=victim) == victim.pid
    pool.remove_replica(other)
    assert other.state is ReplicaState.REMOVED
    assert other.pid is None


def test_a_restart_group_is_stopped_and_started_again_together(launch: Open) -> None:
    to_move: set[str] = set()
    moved: list[str] = []

    def resume(request: PoolRequest, delivered: int) -> PoolRequest | None:
        if request.req_id in to_move:
            moved.append(request.req_id)
            return PoolRequest(request.req_id, request.data - delivered, request.key)
        return None

    pool = launch(
        replicas=3,
        kwargs={"step_s": 0.01},
        restart=RestartPolicy(first_delay=0.2),
        group=["g", "g", None],
        on_replica_death=resume,
    )
    r0, r1, r2 = pool.replicas
    assert (r0.group, r1.group, r2.group) == ("g", "g", None)
    added = [pool.add(f"q{i}", 300) for i in range(6)]
    on: dict[Replica | None, list[Any]] = {}
    for s in added:
        assert s.get(10) == 299  # every request has delivered
        on.setdefault(s.replica, []).append(s)
    assert sorted(len(v) for v in on.values()) == [2, 2, 2]
    (fail0, move0), (fail1, move1) = on[r0], on[r1]
    to_move.update({move0.req_id, move1.req_id})
    old = {r: cast(int, r.pid) for r in (r0, r1, r2)}
    os.kill(old[r0], signal.SIGKILL)
    # r1 was stopped with its group: its requests end as a dead replica's, at once.
    with pytest.raises(ReplicaDeadError, match="restart group 'g': replica r0 died") as info:
        fail1.collect(10)
    assert info.value.replica is r1
    assert info.value.delivered >= 1
    with pytest.raises(ReplicaDeadError, match="SIGKILL") as info:
        fail0.collect(10)
    assert info.value.replica is r0
    # Those the hook moves go on on r2, the only one serving meanwhile.
    for s in (move0, move1):
        assert s.collect(10)[-1] == 0
        assert s.replica is r2
        assert s.migrations == 1
    assert sorted(moved) == sorted(to_move)
    assert wait_until(lambda: r0.state is r1.state is ReplicaState.SERVING, 15)
    assert (r0.restarts, r1.restarts, r2.restarts) == (1, 1, 0)
    assert pid_gone(old[r0])
    assert pid_gone(old[r1])
    assert r2.pid == old[r2]
    fresh = pool.add_many([(f"n{i}", 2) for i in range(6)])
    assert {s.replica for s in fresh} == {r0, r1, r2}
    for s in fresh:
        assert s.collect(10) == [1, 0]
    pool.abort([s.req_id for s in on[r2]])
    for s in on[r2]:  # untouched by the group's death
        assert s.collect(10)[-1] >= 0
        assert s.migrations == 0


def test_a_request_aborted_before_its_replica_died_does_not_move(launch: Open) -> None:
    """abort() sent, the replica stopped before it could apply it, then killed: the
    request is not handed to on_replica_death (it would run again elsewhere, its abort
    lost) but ends with ReplicaDeadError, with and without a stream."""
    seen: list[str] = []

    def resume(request: PoolRequest, delivered: int) -> PoolRequest | None:
        seen.append(request.req_id)
        return PoolRequest(request.req_id, 3)

    pool = launch(replicas=1, kwargs={"step_s": 0.01}, on_replica_death=resume, ordered_events=True)
    log = EventLog(pool)
    kept = pool.add("kept", 10**6)
    aborted = pool.add("aborted", 10**6)
    assert pool.add("quiet", 10**6, stream=False) is None
    [victim] = pool.replicas
    pool.add_replica(DEVICE, {"step_s": 0.01})  # where the kept one moves
    kept.get(10)
    aborted.get(10)
    pid = cast(int, victim.pid)
    os.kill(pid, signal.SIGSTOP)
    try:
        pool.abort(["aborted", "quiet"])
    finally:
        os.kill(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGCONT)
    with pytest.raises(ReplicaDeadError):
        aborted.collect(10)
    assert aborted.migrations == 0
    assert kept.collect(10)[-3:] == [2, 1, 0]  # moved on, and finished there
    assert kept.migrations == 1
    log.until_ended(["quiet"])
    [end] = log.ends["quiet"]
    assert isinstance(end, RequestFailed)
    assert isinstance(end.error, ReplicaDeadError)
    assert seen == ["kept"]


def test_on_replica_death_moves_a_request_on(launch: Open) -> None:
    seen: list[tuple[PoolRequest, int]] = []

    def resume(request: PoolRequest, delivered: int) -> PoolRequest | None:
        seen.append((request, delivered))
        if request.req_id == "give-up":
            return None
        return PoolRequest(request.req_id, request.data - delivered, request.key)

    pool = launch(kwargs={"step_s": 0.01}, on_replica_death=resume)
    moving = pool.add("move", 200, key="k")
    other = pool.add("give-up", 200)
    assert moving.replica is not other.replica
    got = [moving.get(10) for _ in range(3)]
    victim = moving.replica
    assert victim is not None
    stays = other.replica
    pool.abort(["give-up"])
    other.collect(10)
    os.kill(cast(int, victim.pid), signal.SIGKILL)
    rest = moving.collect(10)
    # Continued on the other replica, where it started again with what was left.
    assert moving.replica is stays
    assert moving.migrations == 1
    assert moving.finished
    assert got == [199, 198, 197]
    assert rest[-1] == 0
    assert len(got) + len(rest) >= 200
    assert len(seen) == 1
    assert seen[0][0] == PoolRequest("move", 200, "k")
    assert seen[0][1] >= 3


def test_a_stopped_replica_leaves_the_routing_until_it_answers(
    launch: Open, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="enginecore.stage")
    pool = launch(COUNTDOWN, replicas=2, ping_interval=0.2)
    r0, r1 = pool.replicas
    os.kill(cast(int, r0.pid), signal.SIGSTOP)
    try:
        assert wait_until(lambda: r0.health == StageHealth.STALLED, 5)
        # The warning says which replica, not only its process.
        said = f"replica r0 (stage process {r0.pid}) has not answered"
        assert wait_until(lambda: any(said in r.getMessage() for r in caplog.records), 5)
        assert wait_until(lambda: not r0.routable, 5)  # the receiver's timer has fired
        assert r1.routable
        streams = [pool.add(f"s{i}", 2) for i in range(6)]
        assert all(s.replica is r1 for s in streams)
        for s in streams:
            assert s.collect(10) == [1, 0]
    finally:
        os.kill(cast(int, r0.pid), signal.SIGCONT)
    assert wait_until(lambda: r0.health == StageHealth.OK, 5)
    assert r0.routable
    streams = [pool.add(f"t{i}", 2) for i in range(4)]
    assert {s.replica for s in streams} == {r0, r1}
    for s in streams:
        s.collect(10)


# -- membership --------------------------------------------------------------------------


def test_replicas_join_and_leave_while_serving(launch: Open) -> None:
    pool = launch(replicas=1, kwargs={"step_s": 0.005})
    (r0,) = pool.replicas
    before = [pool.add(f"a{i}", 600) for i in range(4)]  # 3 s: live while r1 starts
    r1 = pool.add_replica(DEVICE, {"step_s": 0.005}, startup_timeout=30)
    assert r1.name == "r1"
    assert r1.state is ReplicaState.SERVING
    after = [pool.add(f"b{i}", 40) for i in range(4)]
    assert all(s.replica is r1 for s in after)  # the least loaded: the new one
    code = pool.remove_replica(r0, drain=True)
    assert code == 0
    assert r0.state is ReplicaState.REMOVED
    assert pool.replicas == (r1,)
    for s in before + after:  # drained: nothing lost
        assert s.collect(10)[-1] == 0
    with pytest.raises(ValueError, match="not in this pool"):
        pool.remove_replica(r0)


def test_a_replica_killed_while_it_drains_fails_its_requests_with_its_death(
    launch: Open,
) -> None:
    # A drained removal lets the replica's requests run to their end: if it dies meanwhile,
    # they end with its death (ReplicaDeadError), as without a removal, not StageClosedError.
    pool, streams = _busy(launch)
    victim = pool.replicas[0]
    pid = victim.pid
    on_victim = [s for s in streams if s.replica is victim]
    assert on_victim
    remover = threading.Thread(
        target=pool.remove_replica, args=(victim,), kwargs={"drain": True, "timeout": 30}
    )
    remover.start()
    try:
        assert wait_until(lambda: victim.state is ReplicaState.DRAINING, 10)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        for s in on_victim:
            with pytest.raises(ReplicaDeadError) as info:
                s.collect(10)
            assert info.value.replica is victim
    finally:
        remover.join(30)
    assert not remover.is_alive()
    assert victim.state is ReplicaState.REMOVED
    survivors = [s for s in streams if s.replica is not victim]
    pool.abort([s.req_id for s in survivors])
    for s in survivors:
        s.collect(10)
        assert s.aborted


def _busy(launch: Open, **options: Any) -> tuple[Any, list[Any]]:
    """A pool of two device-engine replicas with four requests that run until aborted,
    each past its first output (so both replicas serve some)."""
    pool = launch(replicas=2, kwargs={"step_s": 0.005}, **options)
    streams = [pool.add(f"a{i}", 10**6) for i in range(4)]
    for s in streams:
        s.get(10)
    return pool, streams


def test_a_close_cuts_short_a_drained_removal_under_way(launch: Open) -> None:
    # close() does not wait for a remove_replica(drain=True) of another thread: the
    # draining stage stops at once, its requests end as a close ends them, and the removal
    # raises StageClosedError.
    pool, streams = _busy(launch)
    victim = pool.replicas[0]
    pid = victim.pid
    assert any(s.replica is victim for s in streams)
    outcome: list[object] = []

    def remove() -> None:
        try:
            outcome.append(pool.remove_replica(victim, drain=True, timeout=20))
        except BaseException as exc:
            outcome.append(exc)

    remover = threading.Thread(target=remove)
    remover.start()
    try:
        assert wait_until(lambda: victim.state is ReplicaState.DRAINING, 10)
        pool.close()
        for s in streams:  # the drained replica's too: not RequestError at the drain's end
            with pytest.raises(StageClosedError):
                s.collect(10)
    finally:
        remover.join(30)
    assert not remover.is_alive()
    assert len(outcome) == 1
    assert isinstance(outcome[0], StageClosedError), outcome
    assert (
        "the stage pool closed while replica r0 (stage 'enginecore.stage.testing:device/r0')"
        " drained" in str(outcome[0])
    )
    assert victim.state is ReplicaState.REMOVED
    assert pid_gone(cast(int, pid))


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
def test_a_removal_without_drain_cuts_short_a_drained_removal_under_way(
    launch: Open, stopped: bool
) -> None:
    # remove_replica(r, drain=False) while remove_replica(r, drain=True) drains r in another
    # thread: the user asked to stop waiting, so the drain is cut short, as a close cuts it
    # (the stage stops at once; one that does not, stopped here, is signalled after this
    # call's timeout), its requests still live end with StageClosedError, this call returns
    # the exit code and the drained removal raises StageClosedError. Before, the second
    # call waited for the drain's end (here 100 s) and its requests ended with
    # RequestError then.
    pool, streams = _busy(launch, ping_interval=0.2)
    victim = pool.replicas[0]
    pid = cast(int, victim.pid)
    on_victim = [s for s in streams if s.replica is victim]
    assert on_victim
    outcome: list[object] = []

    def remove() -> None:
        try:
            outcome.append(pool.remove_replica(victim, drain=True, timeout=100))
        except BaseException as exc:
            outcome.append(exc)

    if stopped:
        os.kill(pid, signal.SIGSTOP)
    remover = threading.Thread(target=remove)
    remover.start()
    try:
        assert wait_until(lambda: victim.state is ReplicaState.DRAINING, 10)
        code = pool.remove_replica(victim, drain=False, timeout=1)
        assert code == (-signal.SIGKILL if stopped else 0)
        for s in on_victim:
            with pytest.raises(StageClosedError, match="removed from its stage pool without"):
                s.collect(10)
    finally:
        remover.join(30)  # well before the drain's 100 s
        if not pid_gone(pid):
            os.kill(pid, signal.SIGKILL)
    assert not remover.is_alive(), "the drained removal was not cut short"
    assert len(outcome) == 1
    assert isinstance(outcome[0], StageClosedError), outcome
    assert "remove_replica(r0, drain=False) cut short the drain of replica r0" in str(outcome[0])
    assert victim.state is ReplicaState.REMOVED
    assert len(pool.replicas) == 1
    assert victim not in pool.replicas
    assert pid_gone(pid)
    survivors = [s for s in streams if s.replica is not victim]
    pool.abort([s.req_id for s in survivors])
    for s in survivors:
        s.collect(10)
        assert s.aborted


def test_a_close_cuts_short_the_drain_of_a_stopped_replica_too(launch: Open) -> None:
    # The stage of the drained replica is stopped (SIGSTOP): the cut cannot stop it, so the
    # close signals it after its own timeout, as it does any other replica that does not
    # stop, instead of waiting for the drain's 100 s.
    pool, streams = _busy(launch, ping_interval=0.2)
    victim = pool.replicas[0]
    pid = cast(int, victim.pid)
    outcome: list[object] = []

    def remove() -> None:
        try:
            outcome.append(pool.remove_replica(victim, drain=True, timeout=100))
        except BaseException as exc:
            outcome.append(exc)

    os.kill(pid, signal.SIGSTOP)
    remover = threading.Thread(target=remove)
    remover.start()
    try:
        assert wait_until(lambda: victim.state is ReplicaState.DRAINING, 10)
        pool.close()
        for s in streams:
            with pytest.raises(StageClosedError):
                s.collect(10)
    finally:
        remover.join(30)
        if not pid_gone(pid):
            os.kill(pid, signal.SIGKILL)
    assert not remover.is_alive()
    assert isinstance(outcome[0], StageClosedError), outcome
    assert pid_gone(pid)


@pytest.mark.parametrize("drain", [True, False], ids=["drained", "undrained"])
def test_a_removal_of_a_stopped_replica_keeps_to_its_timeout(launch: Open, drain: bool) -> None:
    # A SIGSTOPped replica cannot end its drain: the removal waits its timeout and 1 s for
    # the exit, then SIGTERM and a second, then SIGKILL; not the 5 s of a close on top.
    # Without a drain, the stage gets at most the timeout to exit (it got 5 s whatever
    # the timeout).
    pool, streams = _busy(launch, ping_interval=0.2)
    victim = pool.replicas[0]
    on_victim = [s for s in streams if s.replica is victim]
    assert on_victim
    os.kill(cast(int, victim.pid), signal.SIGSTOP)
    started = time.monotonic()
    code = pool.remove_replica(victim, drain=drain, timeout=1)
    took = time.monotonic() - started
    assert code == -signal.SIGKILL
    assert took < 1 + 2 + 2.5, took  # was 7 s and more: 1 + 5 + 1, then the kill
    for s in on_victim:
        with pytest.raises(StageClosedError):
            s.collect(10)
    assert len(pool.replicas) == 1
    assert victim not in pool.replicas
    survivors = [s for s in streams if s.replica is not victim]
    pool.abort([s.req_id for s in survivors])
    for s in survivors:
        s.collect(10)


def test_a_bad_removal_timeout_is_refused_before_the_replica_leaves(launch: Open) -> None:
    # Checked first: before, the stage's drain check raised (naming "drain") once the
    # replica had left the routing, and it stayed "draining" for good; None meant no drain.
    pool = launch(COUNTDOWN, replicas=2)
    r0 = pool.replicas[0]
    for bad, error in [(-1, ValueError), (float("nan"), ValueError), (float("inf"), ValueError)]:
        with pytest.raises(error, match="timeout must be a finite number of seconds >= 0"):
            pool.remove_replica(r0, timeout=bad)
    for wrong in ("1", None, True):
        with pytest.raises(TypeError, match="timeout must be a number of seconds"):
            pool.remove_replica(r0, drain=False, timeout=cast(Any, wrong))
    assert r0.state is ReplicaState.SERVING
    assert pool.replicas == (r0, pool.replicas[1])
    streams = [pool.add(f"x{i}", 2) for i in range(4)]
    assert {s.replica for s in streams} == set(pool.replicas)
    assert [s.collect(10) for s in streams] == [[1, 0]] * 4
    assert pool.remove_replica(r0, timeout=0) == 0


def test_a_pool_over_connected_and_launched_replicas(pools: tuple[Open, Open]) -> None:
    _, connect = pools
    server = Server("--engine", COUNTDOWN, "--bind", "tcp://127.0.0.1:*")
    try:
        # The default heartbeat: at 0.2 s, a replica starved of CPU for 0.4 s (a loaded test
        # machine) read "stalled", and routing sent every request to the other.
        pool = connect([server.address])
        (remote,) = pool.replicas
        assert not remote.launched
        assert remote.pid is None
        assert remote.address == server.address
        local = pool.add_replica(COUNTDOWN, startup_timeout=30)
        assert local.launched
        assert local.pid is not None
        streams = [pool.add(f"c{i}", 3) for i in range(6)]
        assert {s.replica for s in streams} == {remote, local}
        for s in streams:
            assert s.collect(10) == [2, 1, 0]
        assert pool.remove_replica(remote) is None  # detached from; the server runs on
        assert server.proc.poll() is None
        pool.close()
    finally:
        server.stop()


# -- closing -------------------------------------------------------------------------------


def test_close_ends_everything_with_stage_closed_error(launch: Open) -> None:
    pool = launch(kwargs={"step_s": 0.01})
    streams = [pool.add(f"c{i}", 10_000) for i in range(4)]
    pids = [r.pid for r in pool.replicas]
    pool.close()
    for s in streams:
        with pytest.raises(StageClosedError):
            s.collect(10)
    with pytest.raises(StageClosedError):
        pool.add("late", 1)
    with pytest.raises(StageClosedError, match="pool is closed"):
        pool.stats()  # as a closed client's: not {} ("no replica serves")
    assert pool.closed
    assert pool.health() == StageHealth.DEAD
    assert all(pid_gone(cast(int, p)) for p in pids)
    pool.close()  # idempotent


def test_a_removal_without_drain_and_a_close_name_the_replica_in_their_errors(
    launch: Open,
) -> None:
    # They said "this stage client is closed": with several pools, which one? The error
    # names the replica and its stage (whose name is the pool's: name= or the factory).
    pool = launch(name="llm", kwargs={"step_s": 0.01}, ordered_events=True)
    r0, r1 = pool.replicas
    streams = [pool.add(f"c{i}", 10_000) for i in range(4)]
    assert {s.replica for s in streams} == {r0, r1}
    pool.remove_replica(r0, drain=False)
    for s in streams:
        if s.replica is r0:
            with pytest.raises(
                StageClosedError,
                match=r"replica r0 \(stage 'llm/r0'\) was removed from its stage pool "
                "without a drain",
            ):
                s.collect(10)
    pool.close()
    for s in streams:
        if s.replica is r1:
            with pytest.raises(
                StageClosedError, match=r"the stage pool of replica r1 \(stage 'llm/r1'\) is closed"
            ):
                s.collect(10)
    gone: dict[Replica, str] = {}
    failed: list[str] = []
    while True:
        try:
            ev = pool.get_event(10)
        except (StopIteration, StopAsyncIteration):
            break
        if isinstance(ev, ReplicaGone):
            gone[ev.replica] = str(ev.error)
        elif isinstance(ev, RequestFailed):
            failed.append(str(ev.error))
    assert "removed from its stage pool without a drain" in gone[r0], gone
    assert "the stage pool of replica r1 (stage 'llm/r1') is closed" in gone[r1], gone
    assert len(failed) == 4, failed
    assert all("replica r" in f for f in failed), failed


def test_a_drained_removal_takes_aborts_of_the_replicas_requests(launch: Open) -> None:
    # A request routed to a replica that drains away (its caller gone) is dropped by an
    # abort, as on a replica that serves: the drain then ends at once, not at its timeout.
    pool, streams = _busy(launch)
    victim = pool.replicas[0]
    on_victim = [s for s in streams if s.replica is victim]
    assert on_victim
    codes: list[int | None] = []
    remover = threading.Thread(
        target=lambda: codes.append(pool.remove_replica(victim, drain=True, timeout=60))
    )
    remover.start()
    try:
        member = victim._client
        assert member is not None
        assert wait_until(lambda: member.closed, 10)  # its stage drains
        pool.abort([s.req_id for s in on_victim])
        for s in on_victim:
            s.collect(10)
            assert s.aborted
    finally:
        remover.join(30)
    assert not remover.is_alive()
    assert codes == [0]
    assert victim.state is ReplicaState.REMOVED
    rest = [s for s in streams if s.replica is not victim]
    pool.abort([s.req_id for s in rest])
    for s in rest:
        s.collect(10)
        assert s.aborted


def test_a_drained_shutdown_takes_aborts(launch: Open) -> None:
    pool, streams = _busy(launch)
    outcome: list[object] = []
    closer = threading.Thread(target=lambda: outcome.append(pool.shutdown(drain=60)))
    closer.start()
    try:
        members = [r._client for r in pool.replicas]
        assert wait_until(lambda: all(m is not None and m.closed for m in members), 10)
        with pytest.raises(StageClosedError):
            pool.add("late", 1)
        # stats() is taken during the drain, as a draining client's is (it raised
        # StageClosedError): the replicas still work; a utility call stays refused.
        got = pool.stats()
        assert set(got) == set(pool.replicas)
        assert all(isinstance(st, StageStatistics) for st in got.values()), got
        with pytest.raises(StageClosedError):
            pool.call_utility("num_requests")
        with pytest.raises(StageClosedError):
            pool.call_utility("num_requests", broadcast=True)
        pool.abort([s.req_id for s in streams])
        for s in streams:
            s.collect(10)
            assert s.aborted
    finally:
        closer.join(30)
    assert not closer.is_alive()
    assert len(outcome) == 1
    assert list(cast(dict[Any, Any], outcome[0]).values()) == [0, 0]
    with pytest.raises(StageClosedError):  # the shutdown is over: refused again
        pool.abort(["a0"])


def test_a_drained_removal_during_a_drained_shutdown_returns_its_exit_code(
    launch: Open,
) -> None:
    # A remove_replica(drain=True) begun while a shutdown(drain=) drained the pool took
    # itself for cut short and raised StageClosedError ("its requests still live ended with
    # StageClosedError"), while they ran to their end in the shutdown's drain.
    pool = launch(kwargs={"step_s": 0.01}, replicas=1)
    (replica,) = pool.replicas
    stream = pool.add("long", 300)
    outcome: list[object] = []
    closer = threading.Thread(target=lambda: outcome.append(pool.shutdown(drain=60)))
    closer.start()
    try:
        member = replica._client
        assert wait_until(lambda: member is not None and member.closed, 10)  # it drains
        assert pool.remove_replica(replica) == 0
    finally:
        closer.join(30)
    assert not closer.is_alive()
    assert stream.collect(10)[-1] == 0
    assert outcome == [{replica: 0}]


def test_shutdown_with_drain_finishes_live_requests(launch: Open) -> None:
    pool = launch(kwargs={"step_s": 0.005})
    streams = [pool.add(f"d{i}", 20) for i in range(6)]
    codes = pool.shutdown(drain=10)
    assert list(codes.values()) == [0, 0]
    for s in streams:
        assert s.collect(10)[-1] == 0


def test_shutdown_reports_the_exit_code_of_the_stage_it_stopped(launch: Open) -> None:
    # shutdown() returned a restarted replica's dead stage's exit code (-9), not that of
    # the stage it stopped (0), and it listed a replica removed before it (one that had
    # died), though not one removed while it served.
    pool = launch(COUNTDOWN, replicas=4, restart=True)
    restarted, died_removed, removed, kept = pool.replicas
    old = cast(int, restarted.pid)
    os.kill(old, signal.SIGKILL)
    assert wait_until(
        lambda: restarted.state is ReplicaState.SERVING and restarted.pid not in (None, old), 20
    )
    os.kill(cast(int, died_removed.pid), signal.SIGKILL)
    assert wait_until(lambda: died_removed.state is not ReplicaState.SERVING, 20)
    assert pool.remove_replica(died_removed) == -signal.SIGKILL
    assert pool.remove_replica(removed) == 0
    assert pool.shutdown() == {restarted: 0, kept: 0}
    assert pool.shutdown() == {restarted: 0, kept: 0}  # idempotent


@pytest.mark.parametrize("timeout", [-1.0, float("nan"), "5"])
def test_an_invalid_shutdown_timeout_raises_before_any_replica_stops(
    launch: Open, timeout: Any
) -> None:
    # Before, the pool closed anyway: each replica's shutdown refused the timeout (a
    # warning in the log), and the stage processes were left running, unowned.
    pool = launch(replicas=2)
    error = ValueError if isinstance(timeout, float) else TypeError
    with pytest.raises(error, match="timeout must be a"):
        pool.shutdown(timeout)
    assert all(r.state is ReplicaState.SERVING for r in pool.replicas)
    assert pool.add("after", 2).collect(10) == [1, 0]
    assert list(pool.shutdown().values()) == [0, 0]


@pytest.mark.timeout(90)
def test_an_async_pool_awaited_on_another_loop_raises_at_once(no_leftovers: str) -> None:
    # A replica's call failed with its client's error (a broadcast or stats() returned it
    # per replica), and a shutdown() failed for every replica and left them running.
    runner = EventLoopThread()
    pool: AsyncStagePool = runner.run(AsyncStagePool.launch(DEVICE, replicas=2))
    try:
        r0 = pool.replicas[0]

        async def elsewhere() -> None:
            calls = [
                pool.call_utility("num_requests", timeout=5),
                pool.call_utility("num_requests", timeout=5, broadcast=True),
                pool.stats(timeout=5),
                pool.remove_replica(r0),
                pool.shutdown(),
            ]
            for call in calls:
                with pytest.raises(RuntimeError, match="AsyncStagePool belongs to another"):
                    await call

        asyncio.run(elsewhere())
        assert all(r.state is ReplicaState.SERVING for r in pool.replicas)
        assert set(runner.run(pool.call_utility("num_requests", broadcast=True)).values()) == {0}
        assert list(runner.run(pool.shutdown()).values()) == [0, 0]
    finally:
        try:
            runner.run(pool.close())
        finally:
            runner.stop()


def test_a_failed_start_leaves_nothing(pools: tuple[Open, Open]) -> None:
    launch, _ = pools
    from enginecore.stage import StageStartupError

    with pytest.raises(StageStartupError):
        launch("enginecore.stage.testing:failing_factory", replicas=2, startup_timeout=30)


def test_a_failed_add_replica_uses_up_no_name(launch: Open) -> None:
    """add_replica() that fails leaves the pool "unchanged": its name (``r1`` here) is the
    next replica's, as if it had never been tried. It was used up: the next one was ``r2``,
    a gap in the names that metrics, logs and Sticky's homes (hashed from the names, so
    that two pools of the same replicas agree) then carried."""
    from enginecore.stage import StageStartupError

    pool = launch(replicas=1)
    with pytest.raises(StageStartupError):
        pool.add_replica("enginecore.stage.testing:failing_factory", startup_timeout=30)
    assert [r.name for r in pool.replicas] == ["r0"]
    added = pool.add_replica(DEVICE, startup_timeout=30)
    assert [r.name for r in pool.replicas] == ["r0", "r1"]
    stats = pool.stats()[added]
    assert isinstance(stats, StageStatistics)
    assert stats.name.endswith("/r1")


@pytest.fixture
def barrier_dir() -> Iterator[Path]:
    """A directory for ``barrier_factory``'s files, outside the test's private temp dir
    (whose files the leftover check counts)."""
    directory = Path(tempfile.mkdtemp(prefix="ecBar", dir="/tmp"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_the_replicas_start_together(launch: Open, barrier_dir: Path) -> None:
    """Each replica's factory returns only once all six are being built at the same time
    (``barrier_factory``: the children say so, no clock is read): a pool that started its
    replicas in waves would fail to start."""
    pool = launch(BARRIER, kwargs={"directory": str(barrier_dir), "parties": 6}, replicas=6)
    pids = sorted(str(r.pid) for r in pool.replicas)
    assert len(set(pids)) == 6
    assert sorted(os.listdir(barrier_dir)) == pids


class _Interrupt(BaseException):
    """What a Ctrl-C is to the blocking pool's launch: raised in the waiting thread."""


def test_an_interrupted_launch_stops_its_starts_at_once(barrier_dir: Path) -> None:
    # Before: the interrupt waited, inside the executor's exit, for every start to end by
    # itself (here the factories' 40 s barrier), then went on.
    def interrupt(signum: int, frame: object) -> None:
        raise _Interrupt

    previous = signal.signal(signal.SIGUSR1, interrupt)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGUSR1))
    started = time.monotonic()
    try:
        timer.start()
        with pytest.raises(_Interrupt):
            StagePool.launch(
                BARRIER,
                {"directory": str(barrier_dir), "parties": 99, "timeout": 40.0},
                replicas=2,
                startup_timeout=50,
            )
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)
    assert time.monotonic() - started < 20


class _CountingExecutor(concurrent.futures.ThreadPoolExecutor):
    """An event loop's default executor of one thread that counts what it is given."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.submitted = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


def test_an_async_pool_starts_its_replicas_together_without_a_thread_each(
    no_leftovers: str, barrier_dir: Path
) -> None:
    """The asyncio launch holds no executor thread while a stage starts: with a default
    executor of one thread, six replicas whose factories wait for each other still come
    up (a launch that held a thread each would start them one at a time, and the first
    would give up waiting), and the executor is never used."""

    async def main() -> tuple[int, list[int | None]]:
        executor = _CountingExecutor()
        asyncio.get_running_loop().set_default_executor(executor)
        kwargs = {"directory": str(barrier_dir), "parties": 6, "timeout": 15}
        async with await AsyncStagePool.launch(BARRIER, kwargs, replicas=6) as pool:
            pids = [r.pid for r in pool.replicas]
            await pool.shutdown()
        return executor.submitted, pids

    submitted, pids = asyncio.run(main())
    assert submitted == 0
    assert sorted(os.listdir(barrier_dir)) == sorted(str(pid) for pid in pids)


# -- routing policies ----------------------------------------------------------------------


GATED = "enginecore.stage.testing:gated_factory"


def test_a_pool_that_closes_kills_a_restart_in_progress(
    pools: tuple[Open, Open], barrier_dir: Path
) -> None:
    """close() while a replica's stage starts again (its factory held for 40 s): the
    start is stopped, its stage killed, instead of close() waiting for the factory (a
    model that loads for minutes). The blocking pool's start waits in a thread of the
    pool's, the asyncio pool's in a task: both are cancelled."""
    launch, _ = pools
    kwargs = {"directory": str(barrier_dir), "timeout": 40}
    pool = launch(GATED, kwargs, replicas=1, restart=RestartPolicy(first_delay=0.05))
    [r0] = pool.replicas
    first = cast(int, r0.pid)
    (barrier_dir / "hold").touch()
    os.kill(first, signal.SIGKILL)
    assert wait_until(lambda: len(os.listdir(barrier_dir)) >= 3, 20)  # first pid, hold, new
    [again] = [int(n) for n in os.listdir(barrier_dir) if n not in ("hold", str(first))]
    closer = threading.Thread(target=pool.close)
    closer.start()
    closer.join(20)  # well before the factory gives up (40 s)
    assert not closer.is_alive(), "close() waited for the restart's factory"
    assert wait_until(lambda: pid_gone(again), 10)


def test_a_replica_removed_while_it_starts_again_is_not_said_to_have_started(
    pools: tuple[Open, Open], barrier_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """remove_replica() while the replica's restart is under way (its factory held): the
    new stage, once up, is closed, not made to serve, and the pool does not log that the
    replica "started again" (it did, for a replica no longer in the pool)."""
    launch, _ = pools
    kwargs = {"directory": str(barrier_dir), "timeout": 40}
    pool = launch(GATED, kwargs, replicas=1, restart=RestartPolicy(first_delay=0.05))
    [r0] = pool.replicas
    first = cast(int, r0.pid)
    (barrier_dir / "hold").touch()
    os.kill(first, signal.SIGKILL)
    assert wait_until(lambda: len(os.listdir(barrier_dir)) >= 3, 20)  # first pid, hold, new
    [again] = [int(n) for n in os.listdir(barrier_dir) if n not in ("hold", str(first))]
    caplog.set_level(logging.WARNING, "enginecore.stage")
    pool.remove_replica(r0)
    assert r0.state is ReplicaState.REMOVED
    (barrier_dir / "hold").unlink()
    assert wait_until(lambda: pid_gone(again), 20)
    assert pool.replicas == ()
    assert r0.state is ReplicaState.REMOVED
    assert r0.pid is None
    pool.close()  # waits for the pool's restart thread (task): whatever it logs is in
    assert not [r.message for r in caplog.records if "started again" in r.message]


@pytest.mark.parametrize("how", ["restarting", "adding"])
def test_a_removal_stops_the_start_of_its_replica_at_once(
    pools: tuple[Open, Open], barrier_dir: Path, how: str
) -> None:
    """remove_replica() of a replica whose stage is being started (its restart, or the
    add_replica() that adds it, with its factory held for 40 s) stops that start at once,
    as a close does: the half-started stage is killed, instead of living on (a GPU held)
    until its factory returns. The removal returns the exit code of the replica's last
    stage (the killed one's for a restart, None for one that never served); an
    add_replica() that waited for it raises StageClosedError naming the removal."""
    launch, _ = pools
    kwargs = {"directory": str(barrier_dir), "timeout": 40}
    raised: list[BaseException] = []
    adding = None
    if how == "restarting":
        pool = launch(GATED, kwargs, replicas=1, restart=RestartPolicy(first_delay=0.05))
        [r0] = pool.replicas
        first = cast(int, r0.pid)
        (barrier_dir / "hold").touch()
        os.kill(first, signal.SIGKILL)
        old = {"hold", str(first)}
    else:
        pool = launch(COUNTDOWN, replicas=1)
        [serving] = pool.replicas
        (barrier_dir / "hold").touch()

        def add() -> None:
            try:
                pool.add_replica(GATED, kwargs)
            except BaseException as exc:
                raised.append(exc)

        adding = threading.Thread(target=add)
        adding.start()
        old = {"hold"}
    assert wait_until(lambda: len(set(os.listdir(barrier_dir)) - old) >= 1, 20)
    [again] = [int(n) for n in os.listdir(barrier_dir) if n not in old]
    if how == "adding":
        [r0] = [r for r in pool.replicas if r is not serving]
    assert r0.state == "starting"
    code = pool.remove_replica(r0)
    assert code == (-signal.SIGKILL if how == "restarting" else None)
    assert r0.state is ReplicaState.REMOVED
    # Gone while the factory is still held (it gives up after 40 s): killed, not waited for.
    assert wait_until(lambda: pid_gone(again), 10), "the half-started stage lives on"
    assert (barrier_dir / "hold").exists()
    if adding is not None:
        adding.join(10)
        assert not adding.is_alive(), "add_replica() waited for its start after the removal"
        assert len(raised) == 1, raised
        assert isinstance(raised[0], StageClosedError), raised
        assert "removed" in str(raised[0]), raised
    assert r0 not in pool.replicas
    assert len(pool.replicas) == (1 if how == "adding" else 0)
    pool.close()


def test_a_removal_of_a_dead_replica_returns_its_exit_code(launch: Open) -> None:
    """remove_replica() of a replica that died (no restart) returns at once with its
    stage's exit code, as a removal of a replica that starts again does."""
    pool = launch(COUNTDOWN, replicas=2)
    r0, _ = pool.replicas
    os.kill(cast(int, r0.pid), signal.SIGKILL)
    assert wait_until(lambda: r0.state is ReplicaState.DEAD, 20)
    assert pool.remove_replica(r0) == -signal.SIGKILL
    assert r0 not in pool.replicas


def test_a_removal_stops_only_its_own_start_in_a_restart_group(
    pools: tuple[Open, Open], barrier_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A restart group starts its members again together: removing one of them while the
    group starts stops that member's start only (its half-started stage killed at once);
    the others go on starting and serve, and the removal counts as no failed start of
    the group (no "did not start again", no further restart)."""
    launch, _ = pools
    kwargs = {"directory": str(barrier_dir), "timeout": 40}
    pool = launch(GATED, kwargs, replicas=2, group="g", restart=RestartPolicy(first_delay=0.05))
    r0, r1 = pool.replicas
    first = {str(r0.pid), str(r1.pid)}
    (barrier_dir / "hold").touch()
    caplog.set_level(logging.WARNING, "enginecore.stage")
    os.kill(cast(int, r0.pid), signal.SIGKILL)
    old = first | {"hold"}
    assert wait_until(lambda: len(set(os.listdir(barrier_dir)) - old) >= 2, 20)
    again = {int(n) for n in os.listdir(barrier_dir) if n not in old}
    pool.remove_replica(r0)
    assert r0.state is ReplicaState.REMOVED
    assert wait_until(lambda: any(pid_gone(p) for p in again), 10), "its stage lives on"
    assert (barrier_dir / "hold").exists()
    [left] = [p for p in again if not pid_gone(p)]
    (barrier_dir / "hold").unlink()
    assert wait_until(lambda: r1.state is ReplicaState.SERVING, 20)
    assert r1.pid == left
    assert r1.restarts == 1
    assert pool.replicas == (r1,)
    pool.close()  # waits for the pool's restart thread (task): whatever it logs is in
    assert not [r.message for r in caplog.records if "did not start again" in r.message]


@pytest.mark.parametrize("how", ["launching", "connecting"])
def test_a_pool_that_closes_stops_an_add_replica_in_progress(
    pools: tuple[Open, Open], barrier_dir: Path, no_leftovers: str, how: str
) -> None:
    """close() while add_replica() (another thread) waits for its replica: a launch whose
    factory is held for 40 s, or a connect (add_replica(address=...)) to where nothing
    answers, with a 40 s timeout. The add raises StageClosedError, a half-started stage is
    killed and the pool keeps nothing of it, instead of the add waiting out its factory or
    its timeout after close() returned."""
    launch, _ = pools
    (barrier_dir / "hold").touch()
    pool = launch(COUNTDOWN, replicas=1)
    raised: list[BaseException] = []

    def add() -> None:
        try:
            if how == "launching":
                pool.add_replica(GATED, {"directory": str(barrier_dir), "timeout": 40})
            else:
                pool.add_replica(address=f"ipc://{no_leftovers}/nothing-listens-here", timeout=40)
        except BaseException as exc:
            raised.append(exc)

    adding = threading.Thread(target=add)
    adding.start()
    pid = None
    try:
        if how == "launching":
            assert wait_until(lambda: len(os.listdir(barrier_dir)) >= 2, 20)  # hold, new pid
            [pid] = [int(n) for n in os.listdir(barrier_dir) if n != "hold"]
        else:
            assert wait_until(lambda: any(r.state == "starting" for r in pool.replicas), 20)
    finally:
        pool.close()
    adding.join(20)  # well before the factory or the connect gives up
    assert not adding.is_alive(), "add_replica() waited for its start after close()"
    assert len(raised) == 1, raised
    assert isinstance(raised[0], StageClosedError), raised
    assert "this stage pool is closed" in str(raised[0])
    if pid is not None:
        assert wait_until(lambda: pid_gone(pid), 10)
    assert all(r.state != "starting" for r in pool.replicas), pool.replicas


def test_a_cancelled_remove_replica_still_removes_it(no_leftovers: str) -> None:
    """remove_replica() cancelled while its replica drains: the removal it began goes on
    (its requests finish, its stage stops, it leaves pool.replicas) instead of leaving
    the replica "draining" in the pool for ever."""

    async def main() -> None:
        async with await AsyncStagePool.launch(
            DEVICE, {"step_s": 0.01}, replicas=2, restart=True
        ) as pool:
            r0, r1 = pool.replicas
            streams = [await pool.add(f"a{i}", 30) for i in range(4)]
            assert {s.replica for s in streams} == {r0, r1}
            pid = cast(int, r0.pid)
            removing = asyncio.ensure_future(pool.remove_replica(r0, timeout=20))
            await asyncio.sleep(0)
            assert r0.state.value == "draining"  # the removal began
            removing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await removing
            for s in streams:  # drained, not cut off
                assert (await s.collect(timeout=10))[-1] == 0
            deadline = time.monotonic() + 10
            while r0.state is not ReplicaState.REMOVED and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert r0.state is ReplicaState.REMOVED
            assert pool.replicas == (r1,)
            assert wait_until(lambda: pid_gone(pid), 10)

    asyncio.run(main())


def test_a_cancelled_add_replica_leaves_the_async_pool_unchanged(
    no_leftovers: str, barrier_dir: Path
) -> None:
    """add_replica() cancelled while its stage starts (its factory held) leaves no
    replica behind in pool.replicas (it was left "starting" for ever) and no process."""
    (barrier_dir / "hold").touch()

    async def main() -> None:
        async with await AsyncStagePool.launch(COUNTDOWN, replicas=1) as pool:
            before = pool.replicas
            adding = asyncio.ensure_future(pool.add_replica(GATED, {"directory": str(barrier_dir)}))
            while len(os.listdir(barrier_dir)) < 2:  # "hold" and the new stage's pid
                await asyncio.sleep(0.01)
            [pid] = [int(n) for n in os.listdir(barrier_dir) if n != "hold"]
            adding.cancel()
            with pytest.raises(asyncio.CancelledError):
                await adding
            assert pool.replicas == before
            assert all(r.state is ReplicaState.SERVING for r in pool.replicas)
            assert wait_until(lambda: pid_gone(pid), 10)
            assert await (await pool.add("a", 2)).collect(timeout=10) == [1, 0]

    asyncio.run(main())


def test_a_cancelled_read_of_an_async_pool_stream_stops_the_read_not_the_request(
    no_leftovers: str,
) -> None:
    """As the asyncio client's ("A stream is a buffer, not a task": ``docs/stage.md``,
    "asyncio"): a collect() cancelled (``asyncio.wait_for``, a task's ``cancel()``) leaves
    the request live on its replica, counted there, and loses nothing: a later collect()
    gets every output; abort() is how a reader that gives up ends it (``docs/pool.md``)."""

    async def main() -> None:
        async with await AsyncStagePool.launch(DEVICE, {"step_s": 0.01}, replicas=2) as pool:
            stream = await pool.add("x", 20)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(stream.collect(), 0.05)
            assert stream.replica is not None
            assert stream.replica.in_flight == 1
            assert await stream.collect(timeout=10) == list(range(19, -1, -1))
            gone = await pool.add("y", 10**6)
            reading = asyncio.ensure_future(gone.collect())
            await asyncio.sleep(0.05)
            reading.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reading
            assert gone.replica is not None
            assert gone.replica.in_flight == 1
            await pool.abort(["y"])
            await gone.collect(timeout=10)  # the rest of its outputs, then its end
            assert gone.aborted
            assert sum(r.in_flight for r in pool.replicas) == 0

    asyncio.run(main())


def test_sticky_keys_go_home(launch: Open) -> None:
    pool = launch(COUNTDOWN, replicas=3, routing=Sticky())
    homes: dict[str, Replica | None] = {}
    for i in range(30):
        key = f"user{i % 5}"
        s = pool.add(f"s{i}", 1, key=key)
        homes.setdefault(key, s.replica)
        assert s.replica is homes[key]
        s.collect(10)
    assert len(set(homes.values())) > 1


def test_a_replica_busy_with_a_utility_call_counts_it_as_load(
    launch: Open, barrier_dir: Path
) -> None:
    """A utility call runs on the stage's loop: while it is in flight, the replica's new
    requests wait behind it, as behind a request. The pool's own calls in flight count in
    the built-in load as its requests do (``docs/pool.md``, "Routing"): a replica held in a
    call lost ties to an idle one. Before, they counted for nothing, and a replica blocked
    in a call took every other new request (round robin between equals)."""
    pool = launch(RELAY, replicas=2)
    r0, r1 = pool.replicas
    gate = barrier_dir / "gate"
    gate.touch()
    calling = threading.Thread(
        target=pool.call_utility, args=("gate", str(gate), 30.0), kwargs={"replica": r0}
    )
    calling.start()
    try:
        assert wait_until(lambda: len(r0._session.calls) == 1, 10)  # type: ignore[union-attr]
        assert r0.in_flight == 0  # a call is no request
        for i in range(3):  # each time: loads 1 (the call) and 0
            stream = pool.add(f"q{i}", 1)
            assert stream.replica is r1
            pool.abort([stream.req_id])
            stream.collect(10)
            assert stream.aborted
    finally:
        gate.unlink()
        calling.join(30)
    assert not calling.is_alive()
    assert wait_until(lambda: not r0._session.calls, 10)  # type: ignore[union-attr]
    # Idle again, both: ties go round robin once more.
    assert {pool.add(f"t{i}", 1).replica for i in range(2)} == {r0, r1}


def test_a_score_function_routes(launch: Open) -> None:
    views: list[ReplicaView] = []

    def prefer_last(view: ReplicaView, request: PoolRequest) -> float:
        views.append(view)
        return -int(view.replica.name[1:])

    pool = launch(COUNTDOWN, replicas=3, routing=prefer_last)
    streams = [pool.add(f"p{i}", 2) for i in range(3)]
    assert all(s.replica is pool.replicas[2] for s in streams)
    assert views
    assert all(isinstance(v.in_flight, int) for v in views)
    for s in streams:
        s.collect(10)


def test_a_score_function_sees_the_request_and_a_bad_score_is_named(launch: Open) -> None:
    seen: list[PoolRequest] = []

    def by_size(view: ReplicaView, request: PoolRequest) -> float:
        seen.append(request)
        return float(abs(int(view.replica.name[1:]) - request.data % 2))

    pool = launch(COUNTDOWN, replicas=2, routing=by_size)
    # The score sees the request's data (before, None unless on_replica_death was set).
    assert pool.add("odd", 3, key="k").replica is pool.replicas[1]
    assert seen[-1] == PoolRequest("odd", 3, "k")
    assert pool.add("even", 2).replica is pool.replicas[0]
    r0, r1 = pool.replicas
    assert [s.replica for s in pool.add_many([("b1", 1), ("b2", 2)])] == [r1, r0]
    assert seen[-1] == PoolRequest("b2", 2, None)
    # A score that is not a real number, or NaN (which compares as neither better nor
    # worse, so that a NaN replica could win), is an error that names it, not a bare
    # comparison TypeError or a silent pick; nothing is sent.
    bad: list[Any] = [None]
    pool2 = launch(COUNTDOWN, replicas=2, routing=lambda view, request: bad[0])
    for value, error, match in [
        (None, TypeError, r"must be a real number, got NoneType \(None\) for replica r\d"),
        ("1", TypeError, "got str"),
        (True, TypeError, "got bool"),
        (1j, TypeError, "got complex"),
        (float("nan"), ValueError, "score of replica r\\d for request 'x' is NaN"),
    ]:
        bad[0] = value
        with pytest.raises(error, match=match):
            pool2.add("x", 1)
        with pytest.raises(error):
            pool2.add_many([("y", 1)])
    bad[0] = float("inf")  # a number, however large
    assert pool2.add("x", 1).collect(10) == [0]
    assert [r.in_flight for r in pool2.replicas] == [0, 0]


class _Returns(Routing):
    """A policy of one's own that returns whatever it is told to."""

    def __init__(self) -> None:
        self.pick: Callable[[Sequence[Replica]], Any] = lambda replicas: replicas[-1]

    def choose(
        self, replicas: Sequence[Replica], req_id: str, data: Any, key: Any, now: float
    ) -> Replica:
        return cast(Replica, self.pick(replicas))


def test_a_policy_that_chooses_no_replica_of_its_own_is_named(pools: tuple[Open, Open]) -> None:
    # Before: a bare AttributeError ('NoneType' object has no attribute '_client'), a
    # misleading NoReplicaError for a removed replica, and another pool's replica took the
    # request, through that pool's client, while this pool's table kept it live.
    launch = pools[0]
    policy = _Returns()
    pool = launch(COUNTDOWN, replicas=3, routing=policy, startup_timeout=30)
    other = launch(COUNTDOWN, replicas=1, startup_timeout=30)
    assert pool.add("ok", 2).collect(10) == [1, 0]
    removed = pool.replicas[2]
    pool.remove_replica(removed)
    wrongs: list[Any] = [None, "r0", 0, removed, other.replicas[0]]
    for wrong in wrongs:
        policy.pick = functools.partial(lambda wrong, replicas: wrong, wrong)
        with pytest.raises(TypeError, match=r"_Returns\.choose\(\) chose .* not one of the"):
            pool.add("x", 2)
        with pytest.raises(TypeError, match=r"_Returns\.assign\(\) chose .* not one of the"):
            pool.add_many([("y", 2), ("z", 2)])
    assert [r.in_flight for r in (*pool.replicas, *other.replicas)] == [0, 0, 0]
    policy.pick = lambda replicas: replicas[0]
    assert [s.collect(10) for s in pool.add_many([("x", 2), ("y", 2)])] == [[1, 0]] * 2


def test_bad_pool_arguments() -> None:
    with pytest.raises(TypeError, match="routing"):
        StagePool(routing=cast(Any, 3))
    with pytest.raises(ValueError, match="replicas"):
        StagePool.launch(COUNTDOWN, replicas=0)
    with pytest.raises(TypeError):
        StagePool.connect(cast(Any, "tcp://127.0.0.1:1"))
    with pytest.raises(ValueError, match="k >= 1"):
        LeastLoaded(k=0)
    with pytest.raises(ValueError, match="spill_above"):
        Sticky(spill_above=0.5)
    with pytest.raises(TypeError):
        StagePool().add_replica()
    with pytest.raises(ValueError, match="launches"):
        StagePool().add_replica(address="tcp://127.0.0.1:1", group="g")
    with pytest.raises(ValueError, match="2 groups for 3 replicas"):
        StagePool.launch(COUNTDOWN, replicas=3, group=["g", "g"])
    # Types named at once, not met later as a bare comparison error (or, for restart=,
    # as an AttributeError at the first death, on the receiver's thread).
    with pytest.raises(TypeError, match="restart must be a bool or a RestartPolicy"):
        StagePool(restart=cast(Any, "yes"))
    with pytest.raises(TypeError, match="max_migrations must be an int"):
        StagePool(max_migrations=cast(Any, "1"))
    with pytest.raises(TypeError, match="spill_above and slack must be numbers"):
        Sticky(spill_above=cast(Any, "2"))
    with pytest.raises(ValueError, match="spill_above"):
        Sticky(spill_above=float("nan"))
    with pytest.raises(TypeError, match="k and exhaustive must be ints"):
        LeastLoaded(k=cast(Any, 1.5))
    # Named, not a bare '<' TypeError; NaN and a fractional count not taken silently.
    # The seconds go through the shared check (_errors.positive_seconds) that names the
    # argument and the value it got.
    with pytest.raises(TypeError, match="first_delay must be a number of seconds > 0, got '1'"):
        RestartPolicy(first_delay=cast(Any, "1"))
    with pytest.raises(TypeError, match="window must be a number of seconds > 0, got None"):
        RestartPolicy(window=cast(Any, None))
    with pytest.raises(TypeError, match="max_delay must be a number of seconds > 0, got True"):
        RestartPolicy(max_delay=cast(Any, True))
    with pytest.raises(TypeError, match="max_failures must be an int, got float"):
        RestartPolicy(max_failures=cast(Any, 2.5))
    for name, bad in [("window", float("nan")), ("first_delay", 0), ("max_delay", -1.0)]:
        with pytest.raises(ValueError, match=f"{name} must be a number of seconds > 0, got"):
            RestartPolicy(**cast(Any, {name: bad}))
    with pytest.raises(ValueError, match="need first_delay <= max_delay, got 2 > 1"):
        RestartPolicy(first_delay=2, max_delay=1)
    with pytest.raises(ValueError, match="max_failures must be an int >= 1, got 0"):
        RestartPolicy(max_failures=0)
    stream_types = (PoolRequestStream, AsyncPoolRequestStream)
    assert all(hasattr(t, "replica") for t in stream_types)


def test_bad_launch_and_connect_arguments_are_refused_before_anything_starts(
    pools: tuple[Open, Open],
) -> None:
    launch, connect = pools
    for bad in ("2", 1.5, True):
        with pytest.raises(TypeError, match="replicas must be an int"):
            launch(COUNTDOWN, replicas=bad)
    for ping in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="ping_interval"):
            launch(COUNTDOWN, ping_interval=ping)
    with pytest.raises(TypeError, match="ping_interval"):
        launch(COUNTDOWN, ping_interval="1")
    with pytest.raises(TypeError, match="group must be a str"):
        launch(COUNTDOWN, replicas=2, group=5)
    with pytest.raises(ValueError, match="at least one address"):
        connect([])
    pool = launch(COUNTDOWN, replicas=1)
    with pytest.raises(ValueError, match="ping_interval"):
        pool.add_replica(COUNTDOWN, ping_interval=float("nan"))
    # An option of the other kind of replica, or none at all, is named, not ignored.
    with pytest.raises(TypeError, match=r"unexpected options \['bogus'\] for a launched"):
        pool.add_replica(COUNTDOWN, bogus=1)
    with pytest.raises(TypeError, match=r"\['ping_interval'\] for a connected"):
        pool.add_replica(address="tcp://127.0.0.1:1", ping_interval=1.0)
    assert len(pool.replicas) == 1


# -- the event stream, and requests without a stream --------------------------------------


class EventLog:
    """What a consumer of a pool's event stream saw, per request: its outputs and its
    terminal events (a finished output, Aborted, ErrorReport, RequestFailed), and the
    replica-wide events, in the order read."""

    def __init__(self, pool: StagePool) -> None:
        self.pool = pool
        self.outputs: dict[str, list[Any]] = {}
        self.ends: dict[str, list[Any]] = {}
        self.after_end: list[str] = []
        self.replica_events: list[Any] = []
        self.order: list[Any] = []  # every event but outputs, as read

    def read(self, timeout: float = 10.0) -> list[Any]:
        events = self.pool.get_events(timeout)
        for ev in events:
            if isinstance(ev, Outputs):
                for rid, fin, payload in zip(ev.req_ids, ev.finished, ev.payloads, strict=True):
                    assert rid is not None
                    if rid in self.ends:
                        self.after_end.append(rid)
                    self.outputs.setdefault(rid, []).append(payload)
                    if fin:
                        self.ends.setdefault(rid, []).append("finished")
                continue
            self.order.append(ev)
            if isinstance(ev, Aborted):
                for rid in ev.req_ids:
                    self.ends.setdefault(rid, []).append(ev)
            elif isinstance(ev, (RequestFailed, ErrorReport)):
                assert ev.req_id is not None
                self.ends.setdefault(ev.req_id, []).append(ev)
            else:
                assert isinstance(ev, (ReplicaEvent, ReplicaGone)), ev
                self.replica_events.append(ev)
        return events

    def read_to_the_end(self) -> None:
        """Read until the pool's event stream ends (StopIteration: the pool closed)."""
        while True:
            try:
                self.read()
            except StopIteration:
                return

    def until_ended(self, ids: Iterable[str], timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        wanted = set(ids)
        while not wanted <= set(self.ends):
            assert time.monotonic() < deadline, sorted(wanted - set(self.ends))[:5]
            self.read(max(0.0, deadline - time.monotonic()))

    def check_one_end_each(self) -> None:
        assert not self.after_end, self.after_end
        for rid, ends in self.ends.items():
            assert len(ends) == 1, (rid, ends)


def test_requests_without_streams_end_once_in_the_event_stream(launch: Open) -> None:
    pool = launch(kwargs={"step_s": 0.01}, ordered_events=True)
    log = EventLog(pool)
    assert pool.add_many([(f"q{i}", 5) for i in range(20)], streams=False) is None
    assert pool.add("one", 3, stream=False) is None
    streamed = pool.add("streamed", 4)
    # Exact in-flight counts before any output: the burst water-filled, then least loaded.
    assert sorted(r.in_flight for r in pool.replicas) == [11, 11]
    with pytest.raises(ValueError, match="still live in this pool"):
        pool.add("q3", 1, stream=False)
    with pytest.raises(ValueError, match="still live in this pool"):
        pool.add("one", 1)
    ids = [f"q{i}" for i in range(20)] + ["one", "streamed"]
    log.until_ended(ids)
    log.check_one_end_each()
    assert all(log.outputs[f"q{i}"] == [4, 3, 2, 1, 0] for i in range(20))
    assert log.outputs["one"] == [2, 1, 0]
    # A streamed request's outputs are in the event stream too, as in a single client's.
    assert log.outputs["streamed"] == streamed.collect(10) == [3, 2, 1, 0]
    assert [r.in_flight for r in pool.replicas] == [0, 0]
    assert not log.replica_events
    with pytest.raises(TimeoutError):
        pool.get_events(0.05)
    pool.add("q3", 1, stream=False)  # free again once ended
    log.until_ended(["q3"])


def test_an_infinite_timeout_waits_without_limit(launch: Open) -> None:
    # The blocking pool's event wait took math.inf to a lock: OverflowError.
    pool = launch(kwargs={"step_s": 0.2}, ordered_events=True)
    pool.add("q", 1, stream=False)
    assert pool.get_events(math.inf)
    # A bad timeout is refused with an event ready too (it was returned, unchecked).
    pool.add("q2", 1, stream=False)
    time.sleep(0.5)  # its events arrive (the refusal must not depend on it)
    with pytest.raises(ValueError, match="non-negative"):
        pool.get_event(-1)
    assert pool.get_event(5)
    assert all(isinstance(s, StageStatistics) for s in pool.stats(math.inf).values())


def test_aborts_and_rejects_of_requests_without_streams(launch: Open) -> None:
    pool = launch(kwargs={"step_s": 0.01}, ordered_events=True)
    log = EventLog(pool)
    pool.add_many([(f"a{i}", 10_000) for i in range(4)], streams=False)
    pool.add("bad", -1, stream=False)
    log.until_ended(["bad"])
    (bad,) = log.ends["bad"]
    assert isinstance(bad, ErrorReport)
    assert "int >= 1" in bad.message
    assert sum(r.in_flight for r in pool.replicas) == 4
    pool.abort(["a1", "a2"])
    log.until_ended(["a1", "a2"])
    assert all(isinstance(log.ends[rid][0], Aborted) for rid in ("a1", "a2"))
    assert sorted(r.in_flight for r in pool.replicas) == [1, 1]
    pool.abort(["a0", "a3"])
    log.until_ended(["a0", "a3"])
    log.check_one_end_each()
    assert [r.in_flight for r in pool.replicas] == [0, 0]


def test_an_abort_sent_twice_ends_its_request_once_in_the_event_stream(launch: Open) -> None:
    # The stage answers every abort, live id or not: an abort sent twice (or one racing
    # its request's finish) put a second Aborted into the event stream after the request
    # had ended, against "one end each" (and after the id was added again, it read as the
    # new request's end). The members knew the answer was stale, and dropped it only for
    # the streams.
    pool = launch(kwargs={"step_s": 0.01}, replicas=1, ordered_events=True)
    log = EventLog(pool)
    pool.add("quiet", 10_000, stream=False)
    streamed = pool.add("streamed", 10_000)
    pool.abort(["quiet", "streamed"])
    pool.abort(["quiet", "streamed"])
    pool.abort(["quiet"])
    # The stage answers in order: the answers to every abort come before the marker's
    # outputs (one replica).
    pool.add("marker", 2, stream=False)
    log.until_ended(["quiet", "streamed", "marker"])
    log.check_one_end_each()
    streamed.collect(10)
    assert streamed.aborted
    assert pool.replicas[0].in_flight == 0


def test_a_killed_replica_ends_each_request_without_stream_once(launch: Open) -> None:
    pool = launch(kwargs={"step_s": 0.01}, ordered_events=True)
    log = EventLog(pool)
    pool.add_many([(f"k{i}", 10_000) for i in range(6)], streams=False)
    streams = [pool.add(f"s{i}", 10_000) for i in range(2)]
    victim = pool.replicas[0]
    assert victim.in_flight == 4
    while len(log.outputs) < 8:  # every request has delivered
        log.read()
    killed_at = time.monotonic()
    os.kill(cast(int, victim.pid), signal.SIGKILL)
    mine = [s for s in streams if s.replica is victim]
    (lost,) = mine
    with pytest.raises(ReplicaDeadError):
        lost.collect(10)
    while not any(isinstance(e, ReplicaGone) for e in log.replica_events):
        log.read()
    assert time.monotonic() - killed_at < 1.0
    failed = {rid: ends[0] for rid, ends in log.ends.items()}
    assert len(failed) == 4  # the victim's three quiet requests and its stream's
    for rid, ev in failed.items():
        assert isinstance(ev, RequestFailed)
        assert isinstance(ev.error, ReplicaDeadError)
        assert ev.error.replica is victim
        # Every output it delivered came before its end, in the event stream.
        assert ev.error.delivered == len(log.outputs[rid]) >= 1
    assert lost.req_id in failed
    (gone,) = [e for e in log.replica_events if isinstance(e, ReplicaGone)]
    assert gone.replica is victim
    assert isinstance(gone.error, ReplicaDeadError)
    # The replica's requests ended before it went, in the stream's order.
    assert log.order.index(gone) > max(log.order.index(ev) for ev in failed.values())
    assert victim.in_flight == 0
    assert pool.replicas[1].in_flight == 4  # the other replica's, still running
    pool.abort([f"k{i}" for i in range(6)] + [s.req_id for s in streams])
    log.until_ended([f"k{i}" for i in range(6)] + [s.req_id for s in streams])
    log.check_one_end_each()
    assert pool.replicas[1].in_flight == 0


def test_a_request_without_stream_moves_on_when_its_replica_dies(launch: Open) -> None:
    moved: list[tuple[str, int]] = []

    def resume(request: PoolRequest, delivered: int) -> PoolRequest:
        moved.append((request.req_id, delivered))
        return PoolRequest(request.req_id, request.data - delivered, request.key)

    pool = launch(kwargs={"step_s": 0.01}, ordered_events=True, on_replica_death=resume)
    log = EventLog(pool)
    pool.add_many([("m0", 200), ("m1", 200)], streams=False)
    while len(log.outputs.get("m0", [])) < 3 or len(log.outputs.get("m1", [])) < 3:
        log.read()
    victim = pool.replicas[0]
    os.kill(cast(int, victim.pid), signal.SIGKILL)
    log.until_ended(["m0", "m1"])
    log.check_one_end_each()
    assert [ends[0] for ends in log.ends.values()] == ["finished", "finished"]
    ((rid, delivered),) = moved
    # One countdown across both replicas: nothing repeated, nothing lost.
    assert log.outputs[rid] == list(range(199, -1, -1))
    assert delivered >= 3
    assert [r.in_flight for r in pool.replicas] == [0, 0]


def test_utility_answers_and_a_close_in_the_event_stream(launch: Open) -> None:
    pool = launch(kwargs={"step_s": 0.01}, ordered_events=True)
    log = EventLog(pool)
    r1 = pool.replicas[1]
    assert pool.call_utility("pid", replica=r1) == r1.pid
    log.read()
    (answer,) = log.replica_events
    assert isinstance(answer, ReplicaEvent)
    assert answer.replica is r1
    assert isinstance(answer.event, UtilityResult)
    assert answer.event.result == r1.pid
    pool.add_many([(f"c{i}", 10**6) for i in range(4)], streams=False)
    pool.close()
    log.read_to_the_end()
    log.check_one_end_each()
    assert set(log.ends) == {f"c{i}" for i in range(4)}
    for ends in log.ends.values():
        assert isinstance(ends[0], RequestFailed)
        assert isinstance(ends[0].error, StageClosedError)
    gone = [e for e in log.replica_events if isinstance(e, ReplicaGone)]
    assert {e.replica for e in gone} == set(pool.replicas)
    with pytest.raises(StopIteration):
        pool.get_events(1)  # and so on, once ended


def test_a_drained_removal_loses_no_request_without_stream(launch: Open) -> None:
    pool = launch(kwargs={"step_s": 0.005}, ordered_events=True)
    log = EventLog(pool)
    pool.add_many([(f"d{i}", 50) for i in range(6)], streams=False)
    r0 = pool.replicas[0]
    assert r0.in_flight == 3
    pool.remove_replica(r0, drain=True)
    log.until_ended([f"d{i}" for i in range(6)])
    log.check_one_end_each()
    assert all(ends == ["finished"] for ends in log.ends.values())


def test_without_the_event_stream_requests_need_streams(launch: Open) -> None:
    pool = launch(COUNTDOWN)
    with pytest.raises(RuntimeError, match="ordered_events=True"):
        pool.add("x", 1, stream=False)
    with pytest.raises(RuntimeError, match="ordered_events=True"):
        pool.add_many([("x", 1)], streams=False)
    with pytest.raises(RuntimeError, match="ordered_events=True"):
        pool.get_events(1)
    assert pool.add("x", 1).collect(10) == [0]  # nothing was reserved


@pytest.mark.parametrize("how", ["wait_for", "cancel", "loop_ends"])
def test_a_cancelled_async_shutdown_still_stops_every_replica(no_leftovers: str, how: str) -> None:
    """AsyncStagePool.shutdown() cancelled while it waits for a frozen replica (SIGSTOP),
    with another one draining its removal: the shutdown goes on in a task of its own,
    every stream ends, no process is left, and a later call waits for that shutdown and
    returns its exit codes. (It stopped where it was cancelled: the pool closed, but the
    frozen replica ran on and its streams never ended; the end of asyncio.run() left it.)"""
    pids: list[int] = []

    async def main() -> None:
        pool = await AsyncStagePool.launch(
            DEVICE, {"step_s": 0.01}, replicas=3, startup_timeout=30, restart=True
        )
        streams = [await pool.add(f"a{i}", 10**6) for i in range(6)]
        for s in streams:
            await s.__anext__()
        r0, r1, r2 = pool.replicas
        pids.extend(cast(int, r.pid) for r in (r0, r1, r2))
        os.kill(pids[0], signal.SIGSTOP)
        removing = asyncio.ensure_future(pool.remove_replica(r1, timeout=60))
        await asyncio.sleep(0)
        assert r1.state.value == "draining"
        if how == "wait_for":
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(pool.shutdown(timeout=1), 0.05)
        else:
            task = asyncio.ensure_future(pool.shutdown(timeout=1))
            await asyncio.sleep(0)  # it waits for the replicas now
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert pool.closed
        if how == "loop_ends":
            return  # asyncio.run cancels the shutdown task: every replica is killed
        for s in streams:
            with pytest.raises(StageClosedError):
                await s.collect(timeout=30)
        with pytest.raises(StageClosedError):
            await removing
        codes = await asyncio.wait_for(pool.shutdown(), 30)
        assert set(codes) == {r0, r1, r2}
        assert await pool.shutdown() == codes
        await pool.close()
        assert all(pid_gone(p) for p in pids)

    asyncio.run(main())
    assert all(pid_gone(p) for p in pids)


@pytest.mark.parametrize("how", ["shutdown", "loop_ends"])
def test_a_cancelled_async_shutdown_stops_starting_and_restarting_replicas(
    no_leftovers: str, barrier_dir: Path, how: str
) -> None:
    """AsyncStagePool.shutdown() cancelled while a replica restarts (its factory held),
    another is being added (held too) and a third is frozen (SIGSTOP): no process is left,
    whether a later call waits for the shutdown or the event loop ends first."""
    kwargs = {"directory": str(barrier_dir)}
    pids: list[int] = []

    def started() -> set[int]:
        return {int(n) for n in os.listdir(barrier_dir) if n != "hold"}

    async def main() -> None:
        pool = await AsyncStagePool.launch(
            GATED, kwargs, replicas=2, startup_timeout=30, restart=RestartPolicy(first_delay=0.01)
        )
        r0, r1 = pool.replicas
        pids.extend(cast(int, r.pid) for r in (r0, r1))
        (barrier_dir / "hold").touch()
        os.kill(pids[0], signal.SIGKILL)  # r0 restarts: its new stage is held
        while len(started()) < 3:
            await asyncio.sleep(0.01)
        adding = asyncio.ensure_future(pool.add_replica(GATED, kwargs))
        while len(started()) < 4:
            await asyncio.sleep(0.01)
        pids.extend(started() - set(pids))
        os.kill(pids[1], signal.SIGSTOP)
        task = asyncio.ensure_future(pool.shutdown(timeout=1))
        await asyncio.sleep(0)  # it waits for the replicas now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert pool.closed
        if how == "loop_ends":
            return
        await asyncio.wait_for(pool.shutdown(), 30)
        with pytest.raises(StageClosedError):
            await adding
        assert all(pid_gone(p) for p in pids)

    asyncio.run(main())
    assert len(pids) == 4
    # Reaped and cleaned soon after, not at the interpreter's exit: when the loop ends
    # first, the kills' readers never run and a reaper thread takes their place.
    assert wait_until(lambda: not set(child_pids()) & set(pids), 10), "left as zombies"
    assert wait_until(lambda: not os.listdir(no_leftovers), 10), os.listdir(no_leftovers)


# -- parity with the single client --------------------------------------------------------------


def test_a_bad_connect_timeout_or_address_is_refused_as_the_clients_connect_refuses_it(
    pools: tuple[Open, Open],
) -> None:
    """connect() and add_replica(address=...) check the handshake *timeout* and each
    address as StageClient.connect() does, before any socket is made: a negative timeout
    was each replica's TimeoutError "... in -1 s", NaN a wait without end."""
    launch, connect = pools
    address = "tcp://127.0.0.1:1"
    for bad in (-1.0, 0, float("nan")):
        with pytest.raises(ValueError, match=f"timeout must be a number of seconds > 0, got {bad}"):
            connect([address], timeout=bad)
    with pytest.raises(TypeError, match="timeout must be a number of seconds > 0, got '1'"):
        connect([address], timeout="1")
    with pytest.raises(TypeError, match="address must be a str such as"):
        connect([address, cast(Any, 5)])
    with pytest.raises(ValueError, match="a port is 1 to 65535, got 'tcp://127\\.0\\.0\\.1:99999'"):
        connect([address, "tcp://127.0.0.1:99999"])
    pool = launch(COUNTDOWN, replicas=1)
    with pytest.raises(ValueError, match="timeout must be a number of seconds > 0, got -1"):
        pool.add_replica(address=address, timeout=-1.0)
    with pytest.raises(TypeError, match="address must be a str such as"):
        pool.add_replica(address=cast(Any, 5))
    with pytest.raises(ValueError, match="must start with tcp:// or ipc://"):
        pool.add_replica(address="nonsense")
    # Neither a factory nor an address: said so, not "not both".
    with pytest.raises(TypeError, match="takes a factory or an address=, one of the two"):
        pool.add_replica()
    assert len(pool.replicas) == 1


def test_a_wait_on_an_async_pool_stream_on_another_loop_raises_at_once(no_leftovers: str) -> None:
    """A wait on an AsyncStagePool's stream from another event loop raises RuntimeError at
    once, as one on an AsyncStageClient's or an AsyncPipeline's does (docs/pool.md): it
    waited for its whole timeout (for ever without one) on a future that the pool's loop
    never wakes, even as the outputs came."""
    runner = EventLoopThread()
    # A relay stage emits each request's input once and never ends it: after that output,
    # a read waits.
    pool: AsyncStagePool = runner.run(AsyncStagePool.launch(RELAY, replicas=1))
    try:
        stream = runner.run(pool.add("r", "x"))
        assert runner.run(stream.get(timeout=10)) == "x"

        async def elsewhere() -> None:
            reads = [stream.get(timeout=5), stream.collect(timeout=5), stream.__anext__()]
            for read in reads:
                with pytest.raises(RuntimeError, match="AsyncStagePool belongs to another"):
                    await read

        asyncio.run(elsewhere())
        runner.run(pool.abort(["r"]))
        assert runner.run(stream.collect(timeout=10)) == []  # on its own loop, it reads
        assert stream.aborted
    finally:
        try:
            runner.run(pool.close())
        finally:
            runner.stop()


def test_an_empty_add_many_after_close_is_refused_as_a_clients(launch: Open) -> None:
    # It returned [] where a client's add_many([]) raises StageClosedError.
    pool = launch()
    assert pool.add_many([]) == []  # open: nothing to add, nothing sent
    pool.shutdown()
    with pytest.raises(StageClosedError):
        pool.add_many([])


@pytest.mark.parametrize("how", ["close", "shutdown"])
def test_remove_replica_after_close_is_refused_as_add_replica_is(launch: Open, how: str) -> None:
    # remove_replica() after close()/shutdown() returned the replica's exit code, while
    # add_replica() (and every other call) raised StageClosedError.
    pool = launch(COUNTDOWN, replicas=1)
    (r0,) = pool.replicas
    getattr(pool, how)()
    with pytest.raises(StageClosedError, match="pool is closed"):
        pool.add_replica(COUNTDOWN, startup_timeout=30)
    for drain in (True, False):
        with pytest.raises(StageClosedError, match="pool is closed"):
            pool.remove_replica(r0, drain=drain)
    with pytest.raises(StageClosedError, match="pool is closed"):
        pool.remove_replica(r0, drain=False, timeout=0)


_NOWHERE = "ipc:///nonexistent/enginecore-test"
_ONE: Any = 1  # not a str
_YES: Any = "yes"  # not a bool, as a user's config file may give


async def _async_made(make: Callable[[], Any]) -> Any:
    got = make()
    return await got if asyncio.iscoroutine(got) else got


@pytest.mark.parametrize(
    ("make", "flag"),
    [
        (lambda: StageClient.launch(COUNTDOWN, ordered_events=_YES), "ordered_events"),
        (lambda: StageClient.connect(_NOWHERE, ordered_events=_YES), "ordered_events"),
        (lambda: AsyncStageClient.launch(COUNTDOWN, ordered_events=_YES), "ordered_events"),
        (lambda: AsyncStageClient.connect(_NOWHERE, ordered_events=_YES), "ordered_events"),
        (lambda: StagePool(ordered_events=_YES), "ordered_events"),
        (lambda: StagePool.launch(COUNTDOWN, ordered_events=_YES), "ordered_events"),
        (lambda: StagePool.connect([_NOWHERE], ordered_events=_YES), "ordered_events"),
        (lambda: AsyncStagePool(ordered_events=_YES), "ordered_events"),
        (lambda: AsyncStagePool.launch(COUNTDOWN, ordered_events=_YES), "ordered_events"),
        (lambda: AsyncStagePool.connect([_NOWHERE], ordered_events=_YES), "ordered_events"),
        (lambda: PipelineStage(COUNTDOWN, forward_logs=_YES), "forward_logs"),
    ],
    ids=[
        *(
            f"{cls}.{how}"
            for cls in ("StageClient", "AsyncStageClient")
            for how in ("launch", "connect")
        ),
        *(
            f"{cls}{how}"
            for cls in ("StagePool", "AsyncStagePool")
            for how in ("()", ".launch", ".connect")
        ),
        "PipelineStage",
    ],
)
def test_a_flag_that_is_not_a_bool_is_refused_before_anything_starts(
    make: Callable[[], Any], flag: str, no_leftovers: str
) -> None:
    # "yes" (or "no", or 0.0) was taken for its truth: a pool made with
    # ordered_events="no" kept an event stream that nobody reads, growing without bound.
    with pytest.raises(TypeError, match=f"^{flag} must be a bool, got str$"):
        asyncio.run(_async_made(make))


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: StagePool.launch(COUNTDOWN, name=_ONE), TypeError, "name must be a str, got int"),
        (
            lambda: AsyncStagePool.launch(COUNTDOWN, name=_ONE),
            TypeError,
            "name must be a str, got int",
        ),
        (lambda: PipelineStage(COUNTDOWN, name=_ONE), TypeError, "name must be a str, got int"),
        (lambda: PipelineStage(COUNTDOWN, step_timeout=0), ValueError, "step_timeout must be"),
        (lambda: PipelineStage(COUNTDOWN, log_level="nope"), ValueError, "log_level must be"),
    ],
    ids=[
        "StagePool.launch",
        "AsyncStagePool.launch",
        "PipelineStage-name",
        "step_timeout",
        "log_level",
    ],
)
def test_a_bad_stage_option_is_refused_before_anything_starts(
    make: Callable[[], Any], error: type[Exception], match: str, no_leftovers: str
) -> None:
    # A pool's name=1 was taken (its stages named "1/r0", where a client's launch raises),
    # and a PipelineStage's bad option was found only as its process started, after the
    # stages behind it had started.
    with pytest.raises(error, match=match):
        asyncio.run(_async_made(make))


def test_a_per_call_flag_that_is_not_a_bool_is_refused_before_anything_is_sent(
    launch: Open,
) -> None:
    # "no" was taken for true: add(stream="no") made a stream, call_utility(broadcast="no")
    # broadcast, remove_replica(drain="no") drained; a pipeline's add(wait=) refuses one.
    pool = launch(ordered_events=True)
    first = pool.replicas[0]
    with pytest.raises(TypeError, match=r"^stream must be a bool, got str$"):
        pool.add("a", 1, cast(bool, "no"))
    with pytest.raises(TypeError, match=r"^streams must be a bool, got str$"):
        pool.add_many([("b", 1)], streams=cast(bool, "no"))
    with pytest.raises(TypeError, match=r"^broadcast must be a bool, got str$"):
        pool.call_utility("num_requests", broadcast=cast(bool, "no"))
    with pytest.raises(TypeError, match=r"^drain must be a bool, got str$"):
        pool.remove_replica(first, drain=cast(bool, "no"))
    assert first.state is ReplicaState.SERVING  # it did not leave the routing
    assert all(r.in_flight == 0 for r in pool.replicas)  # nothing was sent
    assert pool.add("a", 2).collect(10) == [1, 0]  # the ids are free


@pytest.mark.parametrize("form", ["sync", "async"])
def test_a_clients_per_call_flag_that_is_not_a_bool_is_refused(
    form: str, no_leftovers: str
) -> None:
    if form == "sync":
        with StageClient.launch(COUNTDOWN, ordered_events=True) as client:
            with pytest.raises(TypeError, match=r"^stream must be a bool, got str$"):
                client.add("a", 1, cast(bool, "no"))
            with pytest.raises(TypeError, match=r"^streams must be a bool, got str$"):
                client.add_many([("b", 1)], streams=cast(bool, "no"))
            assert client.add("a", 2).collect(10) == [1, 0]
        return

    async def main() -> None:
        async with await AsyncStageClient.launch(COUNTDOWN, ordered_events=True) as client:
            with pytest.raises(TypeError, match=r"^stream must be a bool, got str$"):
                await client.add("a", 1, cast(bool, "no"))
            with pytest.raises(TypeError, match=r"^streams must be a bool, got str$"):
                await client.add_many([("b", 1)], streams=cast(bool, "no"))
            assert await (await client.add("a", 2)).collect(10) == [1, 0]

    asyncio.run(main())
