"""Stages placed on a Ray cluster of two nodes (issue 19, "several hosts").

Ray's ``cluster_utils.Cluster`` starts a head node and a worker node on this machine: two
raylets, each with its own resources and worker processes, as two hosts have. What can be
checked here, and is checked: that a replica runs on the node its placement names (a custom
resource, or a placement group's bundle *i*: the bundle order the Ray issues in
``ANCHORS-deployments.md`` got wrong), and that losing a node fails only the replicas on it,
within the heartbeat bound, while the others keep serving, and that a restart places the
lost replica on a node that is left. What cannot: a network between hosts (both nodes share
this machine's address; CURVE over TCP is tested in test_curve.py and test_ray.py). A
pipeline with stages on both nodes checks that its links (CURVE, stage to stage) reach
across nodes, and one whose stage on the worker feeds a local stage (on TCP) that that link
reaches back.

A Ray worker process is a child of its node's raylet, so the node a replica runs on is read
from the parent pid of its actor's process: no private Ray API.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest

from enginecore.stage import (
    Pipeline,
    PipelineStage,
    ReplicaDeadError,
    ReplicaState,
    RestartPolicy,
    StagePool,
)

from .conftest import wait_until

ray = pytest.importorskip("ray", reason="the ray extra is not installed")

from ray.cluster_utils import Cluster  # noqa: E402

from enginecore.stage.ray import RayPlacement, RayStage  # noqa: E402

SCRIPTED = "enginecore.stage.testing:scripted"

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


class Nodes:
    """The two nodes: their raylets' pids (read once: a removed node forgets its
    processes), and the cluster (to remove the worker)."""

    def __init__(self, cluster: Any, worker: Any) -> None:
        from ray._private import ray_constants

        self.cluster = cluster
        self.worker = worker
        self._names = {
            int(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid): name
            for node, name in ((cluster.head_node, "head"), (worker, "worker"))
        }

    def of(self, pid: int) -> str:
        """Which node the process *pid* (an actor's) runs on: ``"head"`` or ``"worker"``."""
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        assert ppid in self._names, f"process {pid}'s parent {ppid} is neither node's raylet"
        return self._names[ppid]


@pytest.fixture(scope="module")
def nodes() -> Iterator[Nodes]:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {"head": 1, "slot": 1},
            "include_dashboard": False,
        },
    )
    worker = cluster.add_node(num_cpus=1, resources={"worker": 1, "slot": 1})
    ray.init(address=cluster.address, logging_level=logging.ERROR, log_to_driver=False)
    try:
        cluster.wait_for_nodes()
        yield Nodes(cluster, worker)
    finally:
        ray.shutdown()
        cluster.shutdown()  # type: ignore[no-untyped-call]


def on(resource: str) -> RayPlacement:
    """A small placement that only the node carrying *resource* can satisfy."""
    return RayPlacement(num_cpus=0.25, resources={resource: 0.1})


def test_each_replica_runs_on_the_node_its_placement_names(nodes: Nodes) -> None:
    placements = [on("worker"), on("head"), on("worker")]
    with StagePool.launch_on_ray(SCRIPTED, replicas=3, placement=placements) as pool:
        pids = [r.pid for r in pool.replicas]
        assert all(pid is not None for pid in pids)
        assert [nodes.of(pid) for pid in pids if pid is not None] == ["worker", "head", "worker"]
        streams = pool.add_many([(f"a{i}", 3) for i in range(12)])
        assert {s.replica for s in streams} == set(pool.replicas)
        assert [s.collect() for s in streams] == [[2, 1, 0]] * 12


def test_a_placement_group_bundle_i_holds_replica_i(nodes: Nodes) -> None:
    from ray.util.placement_group import placement_group, remove_placement_group

    # Bundle 0 can only go to the worker and bundle 1 only to the head: the group's order,
    # not the order in which Ray happens to place its bundles, decides where replica i runs.
    group = placement_group(
        [{"CPU": 0.25, "worker": 0.1}, {"CPU": 0.25, "head": 0.1}], strategy="STRICT_SPREAD"
    )
    ray.get(group.ready(), timeout=60)
    try:
        placements = [
            RayPlacement(num_cpus=0.25, placement_group=group, bundle_index=i) for i in (1, 0)
        ]
        with StagePool.launch_on_ray(SCRIPTED, replicas=2, placement=placements) as pool:
            pids = [r.pid for r in pool.replicas]
            assert [nodes.of(pid) for pid in pids if pid is not None] == ["head", "worker"]
            assert pool.call_utility("div", 1, 2, broadcast=True) == dict.fromkeys(
                pool.replicas, 0.5
            )
    finally:
        remove_placement_group(group)


def test_a_pipeline_s_stages_run_on_the_nodes_their_placements_name(nodes: Nodes) -> None:
    # first (local) -> mid (on the worker) -> last (a pool: one replica per node): CURVE
    # links from this process to the worker's stage, and from it to each node's replica.
    relay = "enginecore.stage.testing:relay"
    stages = [
        PipelineStage("enginecore:CountdownEngine", name="first"),
        PipelineStage(relay, name="mid", placement=on("worker")),
        PipelineStage(relay, name="last", replicas=2, placement=[on("head"), on("worker")]),
    ]
    with Pipeline.launch(stages, startup_timeout=60) as pipe:
        where: dict[str, str] = {}
        for name, replica in (("mid", 0), ("last", 0), ("last", 1)):
            stage = pipe.client(name, replica)._launched
            assert isinstance(stage, RayStage)
            where[f"{name}[{replica}]"] = nodes.of(stage.process.pid)
        assert where == {"mid[0]": "worker", "last[0]": "head", "last[1]": "worker"}
        streams = pipe.add_many([(f"p{i}", 1 + i % 3) for i in range(30)])
        for i, stream in enumerate(streams):
            assert stream.collect(timeout=30) == list(range(i % 3, -1, -1))
        assert pipe.call_utility("last", "added") == [15, 15]


def test_a_stage_on_the_worker_feeds_a_local_pool_over_tcp(nodes: Nodes) -> None:
    # first (local) -> mid (on the worker) -> last (a local pool of two): each local replica
    # after the stage on Ray listens on TCP with CURVE and admits mid's link key.
    relay = "enginecore.stage.testing:relay"
    stages = [
        PipelineStage("enginecore:CountdownEngine", name="first"),
        PipelineStage(relay, name="mid", placement=on("worker")),
        PipelineStage(relay, name="last", replicas=2),
    ]
    with Pipeline.launch(stages, startup_timeout=60) as pipe:
        mid = pipe.client("mid")._launched
        assert isinstance(mid, RayStage)
        assert nodes.of(mid.process.pid) == "worker"
        assert pipe.client("first").address.startswith("ipc://")
        for replica in (0, 1):
            assert pipe.client("last", replica).address.startswith("tcp://")
        streams = pipe.add_many([(f"p{i}", 1 + i % 3) for i in range(30)])
        for i, stream in enumerate(streams):
            assert stream.collect(timeout=30) == list(range(i % 3, -1, -1))
        assert pipe.call_utility("last", "added") == [15, 15]


def test_a_lost_node_fails_only_its_replicas_and_a_restart_places_them_again(
    nodes: Nodes,
) -> None:
    """Runs last in this module: it removes the worker node."""
    from ray.util.placement_group import placement_group, remove_placement_group

    restart = RestartPolicy(first_delay=0.2)
    # r0 may only run on the worker, r1 only on the head; r2 needs a "slot", which each
    # node has one of: the head's is held by a placement group until the worker is gone,
    # so r2 starts on the worker and can only be placed again on the head.
    hold = placement_group([{"slot": 1, "head": 0.01}])
    ray.get(hold.ready(), timeout=60)
    placements = [on("worker"), on("head"), RayPlacement(num_cpus=0.25, resources={"slot": 1})]
    heartbeat_timeout = 3.0
    try:
        with StagePool.launch_on_ray(
            SCRIPTED,
            replicas=3,
            placement=placements,
            restart=restart,
            heartbeat_interval=0.5,
            heartbeat_timeout=heartbeat_timeout,
            startup_timeout=10.0,  # r0's placements: no node left satisfies them
        ) as pool:
            r0, r1, r2 = pool.replicas
            assert [nodes.of(r.pid) for r in pool.replicas if r.pid is not None] == [
                "worker",
                "head",
                "worker",
            ]
            waiting = {r: r._client.call_utility_future("deferred_never") for r in pool.replicas}

            start = time.monotonic()
            nodes.cluster.remove_node(nodes.worker, allow_graceful=False)
            for r in (r0, r2):
                with pytest.raises(ReplicaDeadError) as info:
                    waiting[r].result(heartbeat_timeout + 10)
                assert info.value.replica is r
            took = time.monotonic() - start
            assert took < heartbeat_timeout + 10, took
            # r1 is untouched: its call still waits, and it serves.
            assert not waiting[r1].done()
            assert pool.call_utility("div", 1, 4, replica=r1) == 0.25

            remove_placement_group(hold)  # the head's slot is free: r2 can go there
            assert wait_until(lambda: r2.state is ReplicaState.SERVING and r2.restarts >= 1, 60)
            assert r2.pid is not None
            assert nodes.of(r2.pid) == "head"
            # r0 can only run on the lost node: it stays out of the routing.
            assert r0.state is not ReplicaState.SERVING
            streams = pool.add_many([(f"b{i}", 2) for i in range(6)])
            assert {s.replica for s in streams} == {r1, r2}
            assert [s.collect() for s in streams] == [[1, 0]] * 6
    finally:
        remove_placement_group(hold)
