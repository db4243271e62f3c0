"""The replica pool: what N replicas deliver next to one stage, what a pool of one costs
next to a single client, and what one routing decision costs at 64 replicas.

Three parts, each side by side in one run, with the GC on in every process:

a. **Scaling.** The "device engine" (``enginecore.stage.testing:device``) sleeps 5 ms a step
   with the GIL released and batches every live request, like an accelerator whose step
   time does not grow with the batch. So one stage's throughput grows with its batch, and
   the question a pool answers is whether N replicas carry N times the work as fast as one
   stage carries one share: each replica's share is ``SHARE`` requests of ``STEPS`` outputs.
   The sides: a ``StageClient`` with one share, and a ``StagePool`` of N = 2 and 4 (and 8,
   reported only) with N shares, each sent with ``add_many`` and read to the end through
   every stream. Goal: the pool of N >= 0.9 * N times the single stage's outputs/s, in
   every round. All stages are up for the whole run (1 + 2 + 4 + 8 processes).
b. **A pool of one** against a single client on the same engine (``CountdownEngine``),
   2,000 requests of 8 outputs, as ``bench_stage_requests``: the burst (``add_many``, then
   every stream's outputs) and one ``add`` per request. Goal: >= 0.95x, every round. An A/A
   control, reported: the client's burst against a second client's, on a stage of its own.
   And the same burst without streams, read as a per-step consumer reads it: ``add_many(...,
   streams=False)`` then ``get_events()`` until every request's finished output came, on
   a pool and a client made with ``ordered_events=True``. Goal: >= 0.95x, every round.
c. **One routing decision** at 64 replicas (``LeastLoaded``: power of 2 choices above 8
   replicas), on 64 member sessions with live requests and load reports, without
   processes: an absolute budget of 2 µs per decision, judged on the slowest round; the
   baseline, for information, is ``random.choice`` over the same replicas. The same at 4
   replicas (every replica looked at) is reported.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from collections.abc import Callable
from itertools import count
from typing import Any

from ._harness import (
    Record,
    Skipped,
    gc_on,
    higher_is_better,
    interleave,
    main_single,
    report_only,
    spread,
)

NAME = "pool"
DEVICE = "enginecore.stage.testing:device"
COUNTDOWN = "enginecore:CountdownEngine"
SHARE = 64
STEPS = 80
GOAL_SCALING = 0.9
GOAL_POOL_OF_ONE = 0.95
ROUTE_BUDGET_US = 2.0
REQUESTS = 2000
COUNTDOWN_STEPS = 8

_ids = count()


def _items(n: int, steps: int) -> list[tuple[str, int]]:
    tag = next(_ids)
    return [(f"j{tag}-{i}", steps) for i in range(n)]


def _events_job(target: Any, n: int, steps: int) -> float:
    """Outputs/s of *n* requests of *steps* outputs through *target* (a client or pool with
    its event stream on), without streams: ``add_many(streams=False)``, then
    ``get_events()`` until every request finished."""
    from enginecore.stage import Outputs

    items = _items(n, steps)
    outputs = 0
    with gc_on():
        t0 = time.perf_counter()
        target.add_many(items, streams=False)
        live = n
        get_events = target.get_events
        while live:
            for ev in get_events():
                if ev.__class__ is Outputs:
                    live -= ev.finished.count(True)
                    outputs += len(ev.payloads)
        t1 = time.perf_counter()
    assert outputs == n * steps, "wrong outputs"
    return outputs / (t1 - t0)


def _job(target: Any, n: int, steps: int, burst: bool = True) -> float:
    """Outputs/s of *n* requests of *steps* outputs through *target* (a client or pool):
    ``add_many`` (or one ``add`` each), then every stream read to its end."""
    items = _items(n, steps)
    with gc_on():
        t0 = time.perf_counter()
        if burst:
            streams = target.add_many(items)
        else:
            add = target.add
            streams = [add(rid, k) for rid, k in items]
        got = [s.collect() for s in streams]
        t1 = time.perf_counter()
    expected = list(range(steps - 1, -1, -1))
    assert all(g == expected for g in got), "wrong outputs"
    return n * steps / (t1 - t0)


def scaling(rounds: int, share: int, steps: int, sizes: tuple[int, ...]) -> list[Record]:
    from enginecore.stage import StageClient, StagePool

    with contextlib.ExitStack() as stack:
        one = stack.enter_context(StageClient.launch(DEVICE, startup_timeout=120))
        pools = {
            n: stack.enter_context(StagePool.launch(DEVICE, replicas=n, startup_timeout=120))
            for n in sizes
        }

        def side(target: Any, n: int) -> Callable[[], float]:
            return lambda: _job(target, n * share, steps)

        sides = {"one": side(one, 1)}
        for n, pool in pools.items():
            sides[f"pool{n}"] = side(pool, n)
        res = interleave(sides, rounds=rounds)
    out = []
    for n in sizes:
        goal = GOAL_SCALING * n
        note = (
            f"pool of {n} device-engine replicas with {n}x the work against one stage "
            f"(StageClient); {share} requests x {steps} outputs per replica, 5 ms steps; GC on"
        )
        rec = higher_is_better(
            f"pool scaling, {n} replicas", res[f"pool{n}"], res["one"], "outputs/s", goal, note
        )
        if n > 4:  # reported, not a goal
            rec = report_only(rec)
        out.append(rec)
    return out


def pool_of_one(rounds: int, jobs: int) -> list[Record]:
    from enginecore.stage import StageClient, StagePool

    with contextlib.ExitStack() as stack:
        client = stack.enter_context(StageClient.launch(COUNTDOWN, startup_timeout=60))
        pool = stack.enter_context(StagePool.launch(COUNTDOWN, replicas=1, startup_timeout=60))
        client2 = stack.enter_context(StageClient.launch(COUNTDOWN, startup_timeout=60))

        def side(target: Any, burst: bool) -> Callable[[], float]:
            def run() -> float:
                rates = [_job(target, REQUESTS, COUNTDOWN_STEPS, burst) for _ in range(jobs)]
                return statistics.fmean(rates)

            return run

        res = interleave(
            {
                "client2 burst": side(client2, True),  # the A/A control, next to its pair
                "client burst": side(client, True),
                "pool burst": side(pool, True),
                "pool single": side(pool, False),
                "client single": side(client, False),
            },
            rounds=rounds,
        )
    job = f"{REQUESTS} requests x {COUNTDOWN_STEPS} outputs"
    return [
        higher_is_better(
            f"pool of one, burst, {job}", res["pool burst"], res["client burst"],
            "outputs/s", GOAL_POOL_OF_ONE, note="baseline: a StageClient on the same engine; GC on",
        ),
        higher_is_better(
            f"pool of one, one add each, {job}", res["pool single"], res["client single"],
            "outputs/s", GOAL_POOL_OF_ONE, note="baseline: a StageClient on the same engine; GC on",
        ),
        report_only(higher_is_better(
            f"pool of one, A/A control, burst, {job}", res["client burst"],
            res["client2 burst"], "outputs/s", GOAL_POOL_OF_ONE,
            note="a StageClient against a second StageClient on its own stage, run next to "
            "it: the spread of per-round ratios between two sides that cost the same; GC on",
        )),
    ]  # fmt: skip


def pool_of_one_events(rounds: int, jobs: int) -> list[Record]:
    from enginecore.stage import StageClient, StagePool

    with contextlib.ExitStack() as stack:
        client = stack.enter_context(
            StageClient.launch(COUNTDOWN, startup_timeout=60, ordered_events=True)
        )
        pool = stack.enter_context(
            StagePool.launch(COUNTDOWN, replicas=1, startup_timeout=60, ordered_events=True)
        )

        def side(target: Any) -> Callable[[], float]:
            def run() -> float:
                rates = [_events_job(target, REQUESTS, COUNTDOWN_STEPS) for _ in range(jobs)]
                return statistics.fmean(rates)

            return run

        res = interleave({"client": side(client), "pool": side(pool)}, rounds=rounds)
    job = f"{REQUESTS} requests x {COUNTDOWN_STEPS} outputs"
    return [
        higher_is_better(
            f"pool of one, burst without streams read by get_events, {job}", res["pool"],
            res["client"], "outputs/s", GOAL_POOL_OF_ONE,
            note="baseline: a StageClient(ordered_events=True) on the same engine; GC on",
        ),
    ]  # fmt: skip


def _fake_pool(n: int) -> Any:
    """A PoolCore over *n* replicas whose member sessions hold live requests and a load
    report each, without processes."""
    from enginecore.stage import Outputs
    from enginecore.stage._pool_core import PoolCore
    from enginecore.stage._session import ClientSession, StreamCore
    from enginecore.stage._wire import Load

    class Member:
        def __init__(self, i: int) -> None:
            self._session: ClientSession[Any, Any] = ClientSession(
                pid=i, address=f"fake://{i}", launched=True, heartbeat=None,
                ordered_events=False, now=time.monotonic(), adopt_orphans=True,
            )  # fmt: skip

    rng = random.Random(1)
    core = PoolCore(None, False, None, 1)
    for i in range(n):
        replica = core.new_replica({"factory": "fake"})
        member = Member(i)
        live = rng.randrange(0, 32)
        ids = [f"r{i}-{k}" for k in range(live)]
        member._session.open_requests(ids, [StreamCore(rid) for rid in ids])
        load = Load(seq=1, age=0.001, live=live + rng.randrange(0, 8), engine={"kv": 0.5})
        member._session.dispatch([Outputs([], [], [], load)], time.monotonic())
        core.started(replica, member)
    return core


def routing(rounds: int, calls: int) -> list[Record]:
    out = []
    for n in (64, 4):
        core = _fake_pool(n)
        replicas = list(core.replicas)
        choice = random.Random(2).choice

        def route(core: Any = core) -> float:
            r = core.route
            with gc_on():
                t0 = time.perf_counter()
                for _ in range(calls):
                    r("x", None, None)
                return (time.perf_counter() - t0) * 1e6 / calls

        def pick(replicas: list[Any] = replicas, choice: Any = choice) -> float:
            with gc_on():
                t0 = time.perf_counter()
                for _ in range(calls):
                    choice(replicas)
                return (time.perf_counter() - t0) * 1e6 / calls

        sides: dict[str, Callable[[], float]] = {"route": route, "choice": pick}
        res = interleave(sides, rounds=rounds)
        v, b = res["route"], res["choice"]
        goal = n == 64
        rec = Record(
            f"pool routing decision, {n} replicas",
            statistics.median(v),
            "µs",
            statistics.median(b),
            statistics.median(v) / statistics.median(b),
            f"<= {ROUTE_BUDGET_US:g} µs" if goal else "report",
            max(v) <= ROUTE_BUDGET_US if goal else True,
            spread(v),
            spread(b),
            "LeastLoaded (power of 2 choices above 8 replicas) over member sessions with "
            "live requests and load reports; absolute budget judged on the slowest round; "
            "baseline: random.choice, for information; GC on",
            tuple(v),
            "µs",
        )
        out.append(rec if goal else report_only(rec))
    return out


def run(quick: bool) -> list[Record]:
    try:
        import enginecore.stage  # noqa: F401
    except ImportError as exc:
        raise Skipped(f"needs the zmq extra (pip install -e '.[zmq]'): {exc}") from None
    if quick:
        return [
            *scaling(rounds=2, share=16, steps=4, sizes=(2,)),
            *pool_of_one(rounds=2, jobs=1),
            *pool_of_one_events(rounds=2, jobs=1),
            *routing(rounds=2, calls=2000),
        ]
    return [
        *routing(rounds=10, calls=100_000),
        *pool_of_one(rounds=10, jobs=8),
        *pool_of_one_events(rounds=10, jobs=8),
        *scaling(rounds=8, share=SHARE, steps=STEPS, sizes=(2, 4, 8)),
    ]


if __name__ == "__main__":
    main_single(run, __doc__)
