"""Soak a replica pool under SIGKILLs, freezes, replicas added and removed, aborts and
reused request ids: no request may hang, end twice, lose or duplicate an output, or leave
anything behind. Not a timed benchmark: every expectation is a count, and the script exits 1
if one does not hold.

Usage (from the repository root)::

    python -m benchmarks.soak_pool                     # 60 s
    python -m benchmarks.soak_pool --seconds 120 --kind sync --freeze-share 0.5
    python -m benchmarks.soak_pool --seconds 60 --kind sync --ray   # replicas on Ray

The pool: ``--replicas`` (3) ``CountdownEngine`` stages, each restarted when it dies
(``RestartPolicy(first_delay=0.05)``, no limit on deaths), pinged every 0.25 s (a frozen
one leaves the routing after ~0.45 s). Requests of 1 to 40 outputs arrive while
``--concurrency`` are in flight, their ids drawn from a small set (``--ids``); 20 % are
aborted, at once or after a random number of outputs. A killer sends SIGKILL to a random
serving replica every 0.2 to 1.2 s, or (``--freeze-share``) freezes it for 0.1 to 3 s; and
every 1 to 3 s the pool grows by one replica (``add_replica``) or, back at its size plus
one, loses a random serving one (``remove_replica(drain=True)``: its requests run to their
end first). The chaos stops 5 s before the end (half the run if shorter); then every replica
left must serve and a last wave of requests complete.

Every request must end within ``--deadline`` seconds of its add, once: finished, with
exactly its outputs ``n-1, ..., 0`` in order; aborted (only one the soak aborted), or
failed with :class:`~enginecore.stage.ReplicaDeadError` (only if a replica was killed
during its life or at most ``KILL_SEEN_S`` before its add), with a prefix of its outputs.
``add`` may refuse with ``NoReplicaError`` or ``ValueError`` (its id still live in the
pool), nothing else. At the end: no request in the pool or in any replica, and after the
shutdown none of the processes the soak saw left, nor a child process of the soak started
during it (docs/soak.md).

With ``--ray``, the same soak with the replicas placed on a local Ray cluster that the soak
starts (``RAY_CPUS`` logical CPUs, a quarter of one per replica; shut down at the end):
``StagePool.launch_on_ray``, ``add_replica(..., ray=RayPlacement(...))``, heartbeats every
0.25 s instead of pings, presumed dead after ``--heartbeat-timeout`` (6 s, longer than the
longest freeze; at 4 s or less a freeze may end in a presumed death, and counts as a kill
for the requests near it, and the first freeze lasts the longest, 3 s, so that one does;
the report counts the requests so ended). The killer signals
the Ray actor's process, whose pid is the replica's ``pid`` (the stage runs in it, and says
so in its handshake). The seconds count once the pool serves, its launch aside. At
the end, besides the processes: no stage actor alive in Ray's actor table, and every CPU of
the cluster free again, within ``RAY_GONE_S`` (Ray ends an actor's process in its own time).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import logging
import random
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ._cli import RawHelp, at_least, run_main, seconds
from ._soak_chaos import (
    LONGEST_FREEZE_S,
    ChaosConfig,
    Report,
    Rules,
    chaos_threads,
    drive_async,
    drive_sync,
    run_kind,
    wave_async,
    wave_sync,
)

COUNTDOWN = "enginecore:CountdownEngine"
T = TypeVar("T")
RULES = Rules(held="is still live in this pool")
PING_S = 0.25


@dataclass
class Config(ChaosConfig):
    replicas: int = 3
    membership: bool = True
    kills: bool = True
    ray: bool = False  # the replicas placed on a local Ray cluster (ray_cluster)
    heartbeat_timeout: float = 6.0  # on Ray: a replica silent this long is presumed dead


# On Ray: a small share of a CPU per replica's actor, so that a restart never waits for
# the resources of the actor it replaces (Ray frees them once it has seen it die); the
# cluster has CPUs for every replica and more.
RAY_CPUS = 8
RAY_ACTOR_CPUS = 0.25
# A Ray replica's liveness is its heartbeat (no ping_interval): every PING_S, so that a
# frozen one leaves the routing as fast as a launched one; presumed dead after
# Config.heartbeat_timeout without a frame: by default longer than the longest freeze
# (LONGEST_FREEZE_S).
# How long a Ray actor's process may take to go after the pool's shutdown: Ray ends it
# (ray.kill) in its own time, not the pool.
RAY_GONE_S = 15.0


def _policy() -> Any:
    from enginecore.stage import RestartPolicy

    return RestartPolicy(first_delay=0.05, max_delay=0.2, max_failures=10**6)


def _options(cfg: Config) -> dict[str, Any]:
    """The options of each replica's start (at launch and at ``add_replica``): launched,
    pinged every ``PING_S``; or (``cfg.ray``) placed on Ray, its heartbeat every
    ``PING_S``."""
    if not cfg.ray:
        return {"ping_interval": PING_S, "startup_timeout": 60}
    return {
        "heartbeat_interval": PING_S,
        "heartbeat_timeout": cfg.heartbeat_timeout,
        "startup_timeout": 60,
    }


def _placement(cfg: Config, key: str) -> dict[str, Any]:
    """On Ray (``cfg.ray``), ``{key: RayPlacement(...)}`` (``"placement"`` at launch,
    ``"ray"`` at ``add_replica``); else nothing."""
    if not cfg.ray:
        return {}
    from enginecore.stage.ray import RayPlacement

    return {key: RayPlacement(num_cpus=RAY_ACTOR_CPUS)}


def _launch(cls: Any, cfg: Config) -> Any:
    """``cls.launch(...)`` or ``cls.launch_on_ray(...)`` (``cfg.ray``) of the soak's pool:
    a ``StagePool``, or the awaitable of an ``AsyncStagePool``."""
    launch = cls.launch_on_ray if cfg.ray else cls.launch
    return launch(
        COUNTDOWN,
        replicas=cfg.replicas,
        restart=_policy(),
        **_options(cfg),
        **_placement(cfg, "placement"),
    )


def _add(pool: Any, cfg: Config) -> Any:
    """``pool.add_replica(...)`` of one more replica like the others (on Ray too)."""
    return pool.add_replica(COUNTDOWN, **_options(cfg), **_placement(cfg, "ray"))


def _targets(pool: Any, report: Report) -> list[tuple[str, int]]:
    """The replicas of *pool* that serve and are healthy: (name, pid), each pid noted in
    ``report.pids``."""
    out = [
        (r.name, r.pid)
        for r in pool.replicas
        if r.state == "serving" and r.health == "ok" and r.pid is not None
    ]
    report.pids.update(pid for _, pid in out)
    return out


def _serving(pool: Any) -> list[Any]:
    return [r for r in pool.replicas if r.state == "serving"]


class _Membership(Protocol):
    """The pool's membership, blocking (each call returns once done)."""

    def grow(self) -> None: ...
    def shrink(self, replica: Any) -> None: ...
    def replicas(self) -> list[Any]: ...


def _changer(
    rng: random.Random,
    until: float,
    stop: threading.Event,
    report: Report,
    size: int,
    pool: _Membership,
) -> None:
    """Until *until*: every 1 to 3 s, add a replica, or, at *size* + 1 replicas, remove a
    random serving one (draining it)."""
    while not stop.wait(rng.uniform(1.0, 3.0)) and time.monotonic() < until:
        try:
            live = [r for r in pool.replicas() if r.state in ("serving", "starting", "dead")]
            if len(live) <= size:
                report.event("adding a replica")
                pool.grow()
                report.count(report.membership, "added")
                report.event("added a replica")
            else:
                serving = [r for r in live if r.state == "serving"]
                if serving:
                    gone = rng.choice(serving)
                    report.event(f"removing {gone.name} (pid {gone.pid}, health {gone.health})")
                    pool.shrink(gone)
                    report.count(report.membership, "removed")
                    report.event(f"removed {gone.name}")
        except Exception as exc:
            report.problem(f"membership: {type(exc).__name__}: {exc}")


class _View(Protocol):
    """What the last phase (:func:`_settle`) asks of either pool, blocking."""

    def serving(self) -> tuple[int, int]: ...
    def run_wave(self, n: int, timeout: float) -> list[list[Any] | Exception]: ...
    def in_flight(self) -> int: ...
    def held(self) -> dict[Any, Any]: ...
    def restarts(self) -> dict[str, int]:
        """The restarts of the replicas still in the pool (the membership changer noted
        those of the replicas it removed)."""
        ...

    def note_pids(self) -> None: ...


def _settle(view: _View, cfg: Config, report: Report) -> None:
    """After the chaos: every replica left serving (within the deadline), a last wave
    served, nothing held."""
    until = time.monotonic() + cfg.deadline
    while time.monotonic() < until and view.serving()[0] != view.serving()[1]:
        time.sleep(0.05)
    serving, replicas = view.serving()
    if serving != replicas or not serving:
        report.problem(f"{serving} of {replicas} replicas serve after the chaos")
    for got in view.run_wave(16, cfg.deadline):
        if isinstance(got, Exception):
            report.problem(f"last wave: {type(got).__name__}: {got}")
        report.last_wave += got == [4, 3, 2, 1, 0]
    until = time.monotonic() + 10
    while view.in_flight() and time.monotonic() < until:
        time.sleep(0.05)
    if view.in_flight():
        report.problem(f"the pool still holds {view.in_flight()} requests")
    for replica, held in view.held().items():
        if held != 0:
            report.problem(f"replica {replica} still holds requests: {held!r}")
    for name, restarts in view.restarts().items():
        report.note_restarts(name, restarts)
    view.note_pids()


def _threads(
    cfg: Config,
    stop: threading.Event,
    report: Report,
    until: float,
    targets: Callable[[], list[tuple[str, int]]],
    members: _Membership,
) -> list[threading.Thread]:
    """The chaos: the killer, and (``cfg.membership``) the membership changer, not started."""
    # On Ray, a freeze that may outlast the heartbeat timeout may be a death.
    freezes_kill = cfg.ray and cfg.heartbeat_timeout <= LONGEST_FREEZE_S + 1.0
    threads = chaos_threads(
        stop, report, until, cfg.seed, targets, cfg.freeze_share, cfg.kills, freezes_kill
    )
    if cfg.membership:
        threads.append(
            threading.Thread(
                target=_changer,
                args=(random.Random(cfg.seed + 2), until, stop, report),
                kwargs={"size": cfg.replicas, "pool": members},
                daemon=True,
            )
        )
    return threads


def _run_sync(cfg: Config, report: Report) -> None:
    from enginecore.stage import ReplicaDeadError, StagePool

    pool: StagePool
    with _launch(StagePool, cfg) as pool:
        load = cfg.load()
        stop = threading.Event()

        class Members:
            def grow(self) -> None:
                _add(pool, cfg)

            def shrink(self, replica: Any) -> None:
                try:
                    pool.remove_replica(replica, drain=True, timeout=cfg.deadline)
                finally:  # if it is still in the pool, the count after the chaos wins
                    report.note_restarts(replica.name, replica.restarts)

            def replicas(self) -> list[Any]:
                return list(pool.replicas)

        until = load.end_at - cfg.quiet
        threads = _threads(cfg, stop, report, until, lambda: _targets(pool, report), Members())
        for t in threads:
            t.start()
        try:
            drive_sync(pool, load, report, RULES, ReplicaDeadError, lambda r: _where(pool, r))
        finally:  # Ctrl-C too: the killer thaws what it froze, and stops
            stop.set()
        for t in threads:
            t.join(cfg.deadline)

        class View:
            def serving(self) -> tuple[int, int]:
                return len(_serving(pool)), len(pool.replicas)

            def run_wave(self, n: int, timeout: float) -> list[list[Any] | Exception]:
                return wave_sync(pool, n, timeout)

            def in_flight(self) -> int:
                return sum(r.in_flight for r in pool.replicas)

            def held(self) -> dict[Any, Any]:
                return dict(pool.call_utility("num_requests", broadcast=True, timeout=10))

            def restarts(self) -> dict[str, int]:
                return {r.name: r.restarts for r in pool.replicas}

            def note_pids(self) -> None:
                _targets(pool, report)

        _settle(View(), cfg, report)


async def _run_async(cfg: Config, report: Report) -> None:
    from enginecore.stage import AsyncStagePool, ReplicaDeadError

    loop = asyncio.get_running_loop()
    pool: AsyncStagePool = await _launch(AsyncStagePool, cfg)
    load = cfg.load()

    def on_loop(coro: Coroutine[Any, Any, T]) -> T:  # from another thread
        return asyncio.run_coroutine_threadsafe(coro, loop).result(120)

    async def read(fn: Callable[[], T]) -> T:
        return fn()

    try:
        stop = threading.Event()

        class Members:
            def grow(self) -> None:
                on_loop(_add(pool, cfg))

            def shrink(self, replica: Any) -> None:
                try:
                    on_loop(pool.remove_replica(replica, drain=True, timeout=cfg.deadline))
                finally:  # if it is still in the pool, the count after the chaos wins
                    report.note_restarts(replica.name, on_loop(read(lambda: replica.restarts)))

            def replicas(self) -> list[Any]:
                return on_loop(read(lambda: list(pool.replicas)))

        until = load.end_at - cfg.quiet
        threads = _threads(
            cfg,
            stop,
            report,
            until,
            lambda: on_loop(read(lambda: _targets(pool, report))),
            Members(),
        )
        for t in threads:
            t.start()
        try:
            await drive_async(
                pool, load, report, RULES, ReplicaDeadError, lambda r: _where(pool, r)
            )
        finally:  # Ctrl-C too: the killer thaws what it froze, and stops
            stop.set()
        for t in threads:
            await asyncio.to_thread(t.join, cfg.deadline)

        class View:
            def serving(self) -> tuple[int, int]:
                return on_loop(read(lambda: (len(_serving(pool)), len(pool.replicas))))

            def run_wave(self, n: int, timeout: float) -> list[list[Any] | Exception]:
                return on_loop(wave_async(pool, n, timeout))

            def in_flight(self) -> int:
                return on_loop(read(lambda: sum(r.in_flight for r in pool.replicas)))

            def held(self) -> dict[Any, Any]:
                return dict(on_loop(pool.call_utility("num_requests", broadcast=True, timeout=10)))

            def restarts(self) -> dict[str, int]:
                return on_loop(read(lambda: {r.name: r.restarts for r in pool.replicas}))

            def note_pids(self) -> None:
                on_loop(read(lambda: _targets(pool, report)))

        await asyncio.to_thread(_settle, View(), cfg, report)
    finally:
        await pool.shutdown()


def _where(pool: Any, rid: str) -> str:
    """What the pool says of a request that hung."""
    return f"on {[r.name for r in pool.replicas if r.state == 'serving']!r} serving"


def run(cfg: Config, report: Report | None = None) -> Report:
    """Run the soak; its report (*report*, filled as it goes, if given)."""
    with _ray_cluster(cfg.ray) as leftover_actors:
        report = run_kind(
            cfg.kind,
            lambda report: _run_sync(cfg, report),
            lambda report: _run_async(cfg, report),
            gone_within=RAY_GONE_S if cfg.ray else 0.0,
            report=report,
            children=not cfg.ray,  # Ray's actors are the raylet's children, not the soak's
        )
        for what in leftover_actors():
            report.problem(what)
    return report


@contextlib.contextmanager
def _ray_cluster(on: bool) -> Iterator[Callable[[], list[str]]]:
    """With *on*, a local Ray cluster of its own for the soak (``RAY_CPUS`` CPUs, no
    dashboard: as tests/stage/test_ray.py starts one), shut down on the way out; yields
    the check of what the pool left on it after its shutdown (:func:`_ray_leftovers`)."""
    if not on:
        yield list
        return
    import ray

    try:
        ray.init(
            address="local",  # its own, never the latest local cluster of another process
            num_cpus=RAY_CPUS,
            include_dashboard=False,
            logging_level=logging.ERROR,
            log_to_driver=False,
        )
        yield _ray_leftovers
    finally:  # also after a ray.init cut short (Ctrl-C): the processes it started
        ray.shutdown()


def _ray_leftovers() -> list[str]:
    """After the pool's shutdown: a stage actor that Ray still lists as alive, or CPUs of
    the cluster still held, within ``RAY_GONE_S``; each as a problem."""
    ray: Any = importlib.import_module("ray")  # untyped
    state: Any = importlib.import_module("ray._private.state")  # the actor table (private)

    def found() -> list[str]:
        alive = [
            info.get("ActorID", "?")
            for info in state.actors().values()
            if info.get("State") == "ALIVE" and info.get("ActorClassName") == "_StageActor"
        ]
        free = ray.available_resources().get("CPU", 0.0)
        return [f"stage actor {a} is alive after the shutdown" for a in alive] + (
            [] if free == RAY_CPUS else [f"{RAY_CPUS - free:g} CPUs of the cluster still held"]
        )

    until = time.monotonic() + RAY_GONE_S
    while (left := found()) and time.monotonic() < until:
        time.sleep(0.1)
    return left


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.soak_pool",
        description="\n\n".join(__doc__.split("\n\n")[:3]).replace("::", ":"),
        formatter_class=RawHelp,
    )
    ChaosConfig.arguments(parser)
    parser.add_argument(
        "--replicas",
        type=at_least(1),
        default=Config.replicas,
        help=f"replicas at the start (default {Config.replicas}); the membership changer "
        "adds one, then removes one",
    )
    parser.add_argument("--no-membership", action="store_true", help="no replica added or removed")
    parser.add_argument("--no-kills", action="store_true", help="no killer (and no freezes)")
    parser.add_argument(
        "--ray", action="store_true", help="place the replicas on a local Ray cluster"
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=seconds,
        default=None,
        help=f"with --ray: presume a silent replica dead after this many seconds (default "
        f"{Config.heartbeat_timeout:g}); at 4 or less, a freeze counts as a kill for the "
        "requests near it",
    )
    args = parser.parse_args(argv)
    if args.heartbeat_timeout is not None and not args.ray:
        parser.error("--heartbeat-timeout is for replicas on Ray: add --ray")
    cfg = Config(
        **ChaosConfig.settings(args),
        replicas=args.replicas,
        membership=not args.no_membership,
        kills=not args.no_kills,
        ray=args.ray,
        heartbeat_timeout=(
            Config.heartbeat_timeout if args.heartbeat_timeout is None else args.heartbeat_timeout
        ),
    )
    t0 = time.monotonic()
    report = Report()

    def title() -> str:
        where = ", on Ray" if cfg.ray else ""
        return f"soak_pool: {time.monotonic() - t0:.1f} s, {cfg.kind}{where}, seed {cfg.seed}"

    return report.finish(lambda: run(cfg, report), title, chaos=cfg.kills)


if __name__ == "__main__":
    sys.exit(run_main(main))
