"""A replica pool on Ray: stages placed in Ray actors, data over ZMQ with CURVE.

Starts a local Ray cluster (2 CPUs; give ``--address auto`` to use a running one), places
two replicas of a "device" engine in a placement group (one bundle each), sends a burst
spread by load, kills one replica's actor and shows that only its requests fail, that the
pool places it again, and that closing the pool leaves no actor behind.

    pip install 'enginecore[ray]'
    python examples/ray_pool.py [--address auto]
"""

from __future__ import annotations

import argparse
import logging
import time
from collections import Counter
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
        ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR)

    group = placement_group([{"CPU": 0.5}, {"CPU": 0.5}])
    ray.get(group.ready(), timeout=60)
    placements = [
        RayPlacement(num_cpus=0.5, placement_group=group, bundle_index=i) for i in range(2)
    ]
    try:
        with StagePool.launch_on_ray(
            DEVICE, replicas=2, placement=placements, restart=True
        ) as pool:
            print("replicas  ", ", ".join(f"{r.name} {r.address}" for r in pool.replicas))

            streams = pool.add_many([(f"req{i}", 50) for i in range(20)])
            spread = Counter(s.replica.name for s in streams if s.replica is not None)
            print("burst      20 requests ->", dict(sorted(spread.items())))

            for s in streams:
                s.get(timeout=10)  # every request has delivered its first output
            victim = pool.replicas[0]
            stage = victim._client._launched
            assert isinstance(stage, RayStage)
            start = time.monotonic()
            ray.kill(stage.actor)
            failed, finished, seen = 0, 0, float("nan")
            for s in streams:
                try:
                    s.collect(timeout=30)
                    finished += 1
                except ReplicaDeadError as exc:
                    if exc.replica is not victim:
                        raise
                    if not failed:
                        seen = time.monotonic() - start
                    failed += 1
            print(f"kill       {victim.name}: {failed} failed with ReplicaDeadError "
                  f"(seen in {seen:.2f} s), {finished} finished on the other")  # fmt: skip

            deadline = time.monotonic() + 30
            while victim.state is not ReplicaState.SERVING and time.monotonic() < deadline:
                time.sleep(0.05)
            print(f"restart    {victim.name} is {victim.state.value}, restarts {victim.restarts}")
            print("after      ", pool.add("again", 3).collect())
    finally:
        remove_placement_group(group)
    deadline = time.monotonic() + 10
    while free_cpus() < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    print("closed     CPUs free again:", free_cpus())
    ray.shutdown()


if __name__ == "__main__":
    main()
