"""A stage placed on Ray against a local headless stage, side by side in one run (issue 19).

A local Ray cluster is started for the run (``ray.init``, all CPUs, no dashboard) unless
this process is connected to one already. Both stages run the ``countdown`` engine of
``enginecore.stage.testing`` and are read by a ``StageClient`` over TCP on this host:

* the **headless** stage is ``python -m enginecore serve --bind tcp://127.0.0.1:*``;
* the **Ray** stage is ``enginecore.stage.ray.launch_on_ray`` (``insecure=True``: the cost of
  CURVE is ``bench_stage_curve``'s, measured apart), bound on the node's IP.

Metrics:

* **utility round trip**: back-to-back ``call_utility("div", 1, 2)``, blocks alternating
  (A B, B A, ...); p50 judged (goal <= 1.1x the headless stage in every block), p99
  reported.
* **output throughput**: a burst of 64 requests of 50 steps each (``add_many``), read to
  the end; outputs/s, rounds alternating; goal >= 0.8x the headless stage in every round.
* **killed actor**: ``ray.kill`` of a Ray stage's actor while a call waits; the seconds
  until that call raises ``EngineDeadError``. Goal: within 1 s in every round (the baseline
  column is the 1 s goal).
* **launching 8 stages** on Ray in parallel against one launch + 2 s (the baseline column):
  3 rounds, each a launch alone and then 8 at once (each round judged against its own
  single launch; the cluster's CPUs free again before each); quick mode, 1 round of 2.
* **against a plain Ray actor** (the side a Ray user would write instead of enginecore): an
  actor holding the same ``countdown`` engine whose caller drives it, with ``add_many``,
  ``step`` and ``utility`` methods called through ``ray.get(actor.method.remote(...))``.
  Its utility round trip is one actor call (``utility("div", 1, 2)``), blocks alternated
  with the Ray stage's ``call_utility``: goal, the Ray stage's p50 <= 1.0x the actor's in
  every block. Its burst is the same 64 x 50 requests: one ``add_many`` call, then
  ``step`` calls until every request has ended (one actor call per step), rounds
  alternated with the Ray stage's burst: goal, the Ray stage >= 1.0x the actor's outputs/s
  in every round. The actor takes the same ``num_cpus=0.5`` as the Ray stage.

The cyclic GC is on everywhere (``_harness.gc_on`` in the parent).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

from ._harness import (
    Record,
    Skipped,
    gc_on,
    higher_is_better,
    interleave,
    lower_is_better,
    main_single,
)
from .bench_stage_curve import as_report
from .bench_wake_latency import latency_records

NAME = "ray"
COUNTDOWN = "enginecore.stage.testing:countdown"
SCRIPTED = "enginecore.stage.testing:scripted"
ROUND_TRIP_GOAL = 1.1
THROUGHPUT_GOAL = 0.8
DEATH_GOAL_S = 1.0
LAUNCH_SLACK_S = 2.0
BURST = 64
STEPS = 50


@contextlib.contextmanager
def ray_cluster() -> Iterator[Any]:
    """Ray, connected: to this process's cluster if any, else a local one for the run."""
    try:
        import ray

        from enginecore.stage import ray as _stage_ray  # noqa: F401
    except ImportError as exc:
        raise Skipped(f"needs the ray extra (pip install -e '.[ray]'): {exc}") from None
    if ray.is_initialized():
        yield ray
        return
    ray.init(
        address="local",  # its own, not the latest local cluster of another process
        num_cpus=max(2, os.cpu_count() or 2),
        include_dashboard=False,
        logging_level=logging.ERROR,
        log_to_driver=False,
    )
    try:
        yield ray
    finally:
        ray.shutdown()


@contextlib.contextmanager
def both_stages() -> Iterator[tuple[Any, Any]]:
    """``(Ray stage client, headless stage client)``."""
    from enginecore.stage import StageClient
    from enginecore.stage.ray import RayPlacement, launch_on_ray

    from .bench_stage_curve import served

    with (
        served(engine=COUNTDOWN) as address,
        StageClient.connect(address) as headless,
        launch_on_ray(
            COUNTDOWN, placement=RayPlacement(num_cpus=0.5), insecure=True, step_timeout=None
        ) as on_ray,
    ):
        yield on_ray, headless
        with contextlib.suppress(Exception):
            headless.shutdown()


def sample_utility(client: Any, n: int) -> list[float]:
    call = client.call_utility
    clock = time.perf_counter_ns
    out: list[float] = []
    for _ in range(n):
        t0 = clock()
        call("div", 1, 2)
        out.append((clock() - t0) / 1e3)
    return out


def round_trip_records(on_ray: Any, headless: Any, samples: int, blocks: int) -> list[Record]:
    sides = {"loop": on_ray, "raw": headless}  # latency_records' names: judged, baseline
    per_block: dict[str, list[list[float]]] = {n: [] for n in sides}
    for client in sides.values():
        sample_utility(client, 100)  # warm-up
    names = list(sides)
    for i in range(blocks):
        for name in names if i % 2 == 0 else names[::-1]:
            with gc_on():
                per_block[name].append(sample_utility(sides[name], samples))
    pooled = {n: [x for block in per_block[n] for x in block] for n in names}
    p50, p99 = latency_records(
        "utility round trip, stage on Ray vs local headless", pooled, per_block, ROUND_TRIP_GOAL
    )
    p50, p99 = (dataclasses.replace(r, note=f"{r.note}; GC on") for r in (p50, p99))
    return [p50, as_report(p99)]


def throughput_record(on_ray: Any, headless: Any, rounds: int) -> Record:
    ids = iter(range(1 << 30))

    def burst(client: Any) -> float:
        items = [(f"t{next(ids)}", STEPS) for _ in range(BURST)]
        with gc_on():
            t0 = time.perf_counter()
            n = sum(len(s.collect()) for s in client.add_many(items))
            elapsed = time.perf_counter() - t0
        assert n == BURST * STEPS
        return n / elapsed

    out = interleave({"ray": lambda: burst(on_ray), "headless": lambda: burst(headless)}, rounds)
    return higher_is_better(
        "output throughput, stage on Ray vs local headless",
        out["ray"],
        out["headless"],
        "outputs/s",
        THROUGHPUT_GOAL,
        note=f"{rounds} rounds of {BURST} requests x {STEPS} steps; GC on",
    )


def death_record(ray: Any, rounds: int) -> Record:
    from enginecore.stage import EngineDeadError
    from enginecore.stage.ray import RayPlacement, RayStage, launch_on_ray

    seen: list[float] = []
    for _ in range(rounds):
        client = launch_on_ray(SCRIPTED, placement=RayPlacement(num_cpus=0.25), insecure=True)
        try:
            waiting = client.call_utility_future("deferred_never")
            t0 = time.perf_counter()
            stage = client._launched
            assert isinstance(stage, RayStage)
            ray.kill(stage.actor)
            try:
                waiting.result(10)
            except EngineDeadError:
                seen.append(time.perf_counter() - t0)
            else:  # pragma: no cover - a wrong answer, not a number
                raise RuntimeError("the call on a killed actor answered")
        finally:
            client.close()
    return lower_is_better(
        "killed Ray actor to EngineDeadError (baseline: the 1 s goal)",
        seen,
        [DEATH_GOAL_S] * rounds,
        "s",
        1.0,
        note=f"{rounds} kills, each of a fresh stage with a call waiting; GC on",
    )


def _cpus_free(ray: Any, cpus: float) -> None:
    """Wait until the cluster has *cpus* free again: the closed stages' actors are gone."""
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < cpus and time.monotonic() < deadline:
        time.sleep(0.01)  # Ray has no event for it


def launch_record(ray: Any, stages: int, rounds: int) -> Record:
    from enginecore.stage.ray import RayPlacement, launch_on_ray

    placement = RayPlacement(num_cpus=0.1)
    cpus = ray.cluster_resources().get("CPU", 0)

    def launch() -> Any:
        return launch_on_ray(COUNTDOWN, placement=placement, insecure=True)

    ones: list[float] = []
    manys: list[float] = []
    for _ in range(rounds):  # each round: one launch, then *stages* at once
        _cpus_free(ray, cpus)
        t0 = time.perf_counter()
        with launch():
            ones.append(time.perf_counter() - t0)
        _cpus_free(ray, cpus)
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(stages) as ex:
            clients = list(ex.map(lambda _: launch(), range(stages)))
        manys.append(time.perf_counter() - t0)
        for c in clients:
            c.close()
    per_round = ", ".join(f"{m:.2f}/{o:.2f}" for m, o in zip(manys, ones, strict=True))
    return lower_is_better(
        f"launching {stages} stages on Ray (baseline: one launch + 2 s)",
        manys,
        [one + LAUNCH_SLACK_S for one in ones],
        "s",
        1.0,
        note=f"{rounds} rounds, each {stages} at once / one alone (s): {per_round}; GC on",
    )


def plain_actor(ray: Any, num_cpus: float) -> Any:
    """A plain Ray actor holding a ``countdown`` engine, driven by its caller: what a Ray
    user writes instead of a stage. The class is made here, so that Ray ships it by value
    (its workers need not import this module)."""

    class PlainEngineActor:
        def __init__(self) -> None:
            from enginecore.stage.testing import countdown

            self.engine = countdown()

        def utility(self, name: str, *args: Any) -> Any:
            return self.engine.utility(name, args)

        def add_many(self, items: list[tuple[str, int]]) -> None:
            for rid, n in items:
                self.engine.add(rid, n)

        def step(self) -> list[Any]:
            return self.engine.step() if self.engine.has_work() else []

    actor = ray.remote(num_cpus=num_cpus)(PlainEngineActor).remote()
    ray.get(actor.utility.remote("div", 1, 2))  # up and answering
    return actor


def sample_actor_utility(ray: Any, actor: Any, n: int) -> list[float]:
    call, get = actor.utility.remote, ray.get
    clock = time.perf_counter_ns
    out: list[float] = []
    for _ in range(n):
        t0 = clock()
        get(call("div", 1, 2))
        out.append((clock() - t0) / 1e3)
    return out


def plain_actor_records(
    ray: Any, on_ray: Any, samples: int, blocks: int, rounds: int
) -> list[Record]:
    """The Ray stage against a plain Ray actor whose caller drives the engine."""
    actor = plain_actor(ray, 0.5)
    try:
        sides = {
            "loop": lambda: sample_utility(on_ray, samples),
            "raw": lambda: sample_actor_utility(ray, actor, samples),
        }
        sample_utility(on_ray, 100)  # warm-up
        sample_actor_utility(ray, actor, 100)
        per_block: dict[str, list[list[float]]] = {n: [] for n in sides}
        names = list(sides)
        for i in range(blocks):
            for name in names if i % 2 == 0 else names[::-1]:
                with gc_on():
                    per_block[name].append(sides[name]())
        pooled = {n: [x for block in per_block[n] for x in block] for n in names}
        p50, _ = latency_records(
            "utility round trip, stage on Ray vs a plain Ray actor", pooled, per_block, 1.0
        )
        p50 = dataclasses.replace(
            p50, note=f"{p50.note}; baseline: ray.get(actor.utility.remote(...)); GC on"
        )
        ids = iter(range(1 << 30))

        def burst_actor() -> float:
            items = [(f"p{next(ids)}", STEPS) for _ in range(BURST)]
            with gc_on():
                t0 = time.perf_counter()
                ray.get(actor.add_many.remote(items))
                left, n = BURST, 0
                while left:
                    outs = ray.get(actor.step.remote())
                    n += len(outs)
                    left -= sum(1 for _, remaining in outs if remaining == 0)
                elapsed = time.perf_counter() - t0
            assert n == BURST * STEPS
            return n / elapsed

        def burst_stage() -> float:
            items = [(f"q{next(ids)}", STEPS) for _ in range(BURST)]
            with gc_on():
                t0 = time.perf_counter()
                n = sum(len(s.collect()) for s in on_ray.add_many(items))
                elapsed = time.perf_counter() - t0
            assert n == BURST * STEPS
            return n / elapsed

        out = interleave({"ray": burst_stage, "actor": burst_actor}, rounds)
        burst = higher_is_better(
            "output throughput, stage on Ray vs a plain Ray actor driven by its caller",
            out["ray"],
            out["actor"],
            "outputs/s",
            1.0,
            note=f"{rounds} rounds of {BURST} requests x {STEPS} steps; baseline: one "
            "add_many call, then one step call per step; GC on",
        )
    finally:
        ray.kill(actor)
    return [p50, burst]


def run(quick: bool) -> list[Record]:
    samples, blocks, rounds, kills = (150, 2, 2, 1) if quick else (1000, 10, 10, 5)
    stages, launch_rounds = (2, 1) if quick else (8, 3)
    with ray_cluster() as ray:
        with both_stages() as (on_ray, headless):
            records = round_trip_records(on_ray, headless, samples, blocks)
            records.append(throughput_record(on_ray, headless, rounds))
            records += plain_actor_records(ray, on_ray, samples, blocks, rounds)
        records.append(death_record(ray, kills))
        records.append(launch_record(ray, stages, launch_rounds))
    return records


if __name__ == "__main__":
    main_single(run, __doc__)
