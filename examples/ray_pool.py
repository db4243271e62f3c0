"""A replica pool on Ray: stages placed in Ray actors, data over ZMQ with CURVE.

Starts a local Ray cluster (2 CPUs; give ``--address auto`` to use a running one), places
three replicas of a "device" engine in a placement group (one bundle each): ``r0`` and
``r1`` form a restart group (``group=``: like the ranks of one model, they die and restart
together), ``r2`` stands alone. It sends a burst spread by load, kills ``r0``'s actor and
shows that the pool stops ``r1`` with it (the requests of both fail, ``r2``'s finish),
places the group again as one, and that closing the pool leaves no actor behind.

    pip install 'enginecore[ray]'
    python examples/ray_pool.py [--address auto]
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from enginecore.stage import ReplicaDeadError, ReplicaState, StagePool
from enginecore.stage.ray import RayPlacement, RayStage

DEVICE = "enginecore.stage.testing:device"


def free_cpus() -> float:
    """The cluster's free CPUs (every stage's actor holds some while it lives)."""
    resources: Any = ray.available_resources  # untyped in Ray
    return float(resources().get("CPU", 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="a running Ray cluster (default: start a local one)")
    args = parser.parse_args()
    if args.address:
        ray.init(address=args.address, logging_level=logging.ERROR)
    else:
        # A cluster of its own (Ray's default would join the latest one started here).
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.ERROR)
    signal.signal(signal.SIGTERM, on_sigterm)  # ray.init replaced it

    bundles = placement_group([{"CPU": 0.5}] * 3)
    ray.get(bundles.ready(), timeout=60)
    placements = [
        RayPlacement(num_cpus=0.5, placement_group=bundles, bundle_index=i) for i in range(3)
    ]
    try:
        with StagePool.launch_on_ray(
            DEVICE, replicas=3, placement=placements, restart=True, group=["tp", "tp", None]
        ) as pool:
            print("replicas  ", ", ".join(f"{r.name} {r.address}" for r in pool.replicas))
            print("groups    ", {r.name: r.group for r in pool.replicas})

            streams = pool.add_many([(f"req{i}", 400) for i in range(21)])
            spread = Counter(s.replica.name for s in streams if s.replica is not None)
            print("burst      21 requests ->", dict(sorted(spread.items())))

            for s in streams:
                s.get(timeout=10)  # every request has delivered its first output
            victim, rank, alone = pool.replicas
            stage = victim._client._launched
            assert isinstance(stage, RayStage)
            start = time.monotonic()
            ray.kill(stage.actor)
            failed: Counter[str] = Counter()
            finished, seen = 0, float("nan")
            for s in streams:
                try:
                    s.collect(timeout=30)
                    finished += 1
                except ReplicaDeadError as exc:
                    if exc.replica is alone:
                        raise
                    if not failed:
                        seen = time.monotonic() - start
                    failed[exc.replica.name] += 1
            print(f"kill       {victim.name}: ReplicaDeadError {dict(sorted(failed.items()))} "
                  f"(seen in {seen:.2f} s), {finished} finished on {alone.name}")  # fmt: skip

            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not all(
                r.state is ReplicaState.SERVING for r in (victim, rank)
            ):
                time.sleep(0.05)
            for r in pool.replicas:
                print(f"restart    {r.name} is {r.state.value}, restarts {r.restarts}")
            print("after      ", [pool.add(f"again{i}", 3).collect() for i in range(3)])
    finally:
        remove_placement_group(bundles)
    deadline = time.monotonic() + 10
    while free_cpus() < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    print("closed     CPUs free again:", free_cpus())
    ray.shutdown()


TERMINATED: list[int] = []


def on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM stops the example as Ctrl-C does (set again after ``ray.init``, which puts
    a handler of its own in place)."""
    TERMINATED.append(signum)
    raise KeyboardInterrupt


def interruptible(main: Callable[[], None]) -> int:
    """Run *main*; Ctrl-C or SIGTERM stops it early, cleanly: the ``with`` and ``finally``
    blocks close the pool and the placement group on the way out, then one line on stderr
    and status 130 or 143 (no traceback)."""
    terminated = TERMINATED
    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        main()
    except KeyboardInterrupt:
        print("terminated (SIGTERM)" if terminated else "interrupted (Ctrl-C)", file=sys.stderr)
        return 128 + (signal.SIGTERM if terminated else signal.SIGINT)
    return 0


if __name__ == "__main__":
    sys.exit(interruptible(main))
