"""Stages placed on Ray (``enginecore.stage.ray``), on a local Ray cluster this module
starts (2 CPUs, its own even when other clusters run on the machine) and shuts down after
its tests."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from enginecore.stage import (
    AsyncStageClient,
    AuthenticationError,
    CurveKeys,
    EngineDeadError,
    MessageTooLargeError,
    Pipeline,
    PipelineStage,
    ReplicaDeadError,
    ReplicaState,
    RestartPolicy,
    StageClient,
    StageClosedError,
    StageObserver,
    StagePool,
    StageStartupError,
    _logs,
)
from enginecore.stage._curve import keygen, secure_client
from enginecore.stage._poolbase import member_plan

from .conftest import _clients, wait_until
from .test_logs import Records

ray = pytest.importorskip("ray", reason="the ray extra is not installed")

from enginecore.stage.ray import (  # noqa: E402
    RayPlacement,
    RayPlan,
    RayStage,
    authorize_clients,
    authorize_clients_async,
    launch_on_ray,
)

COUNTDOWN = "enginecore.stage.testing:countdown"
SCRIPTED = "enginecore.stage.testing:scripted"
RELAY = "enginecore.stage.testing:relay"
ECHO = "enginecore.stage.testing:echo"
CPUS = 2

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

# A small share of a CPU per stage, so that a restart never waits for the dead actor's.
SMALL = RayPlacement(num_cpus=0.25)


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Iterator[None]:
    # address="local": a cluster of this module's own, never one that another process on the
    # machine started (Ray's default connects to the latest local cluster it finds).
    ray.init(
        address="local",
        num_cpus=CPUS,
        include_dashboard=False,
        logging_level=logging.ERROR,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


def alive_stage_actors() -> int | None:
    """How many stage actors Ray lists as alive, from its actor table (a private API,
    without the dashboard; ``None`` where this Ray version lacks it)."""
    try:
        from ray._private import state
    except ImportError:  # pragma: no cover - another Ray layout
        return None
    table = getattr(state, "actors", None)
    if table is None:  # pragma: no cover
        return None
    return sum(
        1
        for info in table().values()
        if info.get("State") == "ALIVE" and info.get("ActorClassName") == "_StageActor"
    )


def no_actor_left() -> bool:
    """No stage's actor is alive: every CPU of the cluster is free again, and Ray's actor
    table (where readable) lists none."""
    return wait_until(
        lambda: ray.available_resources().get("CPU") == CPUS and alive_stage_actors() in (0, None),
        10.0,
    )


def ray_stage(client: Any) -> RayStage:
    """The Ray stage a client owns (where a launched stage's process handle stands); of
    an AsyncStageClient behind the blocking adapter too."""
    stage = getattr(client, "_client", client)._launched
    assert isinstance(stage, RayStage)
    return stage


def actor_of(client: Any) -> Any:
    return ray_stage(client).actor


def test_stage_on_ray_serves_requests_and_utilities() -> None:
    with launch_on_ray(COUNTDOWN, placement=SMALL) as client:
        assert client.address.startswith("tcp://")
        assert ray_stage(client).node_ip in client.address  # bound on the node's IP
        assert ray_stage(client).curve is not None  # CURVE by default
        assert list(client.add("r1", 3)) == [2, 1, 0]
        assert client.call_utility("div", 1, 4) == 0.25
        assert client.stats().outputs == 3
        assert client.pid != 0
    assert no_actor_left()


def test_stage_on_ray_admits_only_its_client() -> None:
    with launch_on_ray(COUNTDOWN, placement=SMALL) as client:
        with pytest.raises(AuthenticationError):
            StageClient.connect(client.address, timeout=5)  # no CURVE keys
        assert list(client.add("r1", 2)) == [1, 0]  # the owner still serves
    assert no_actor_left()


def test_insecure_opts_out_of_curve() -> None:
    with launch_on_ray(COUNTDOWN, placement=SMALL, insecure=True) as client:
        assert ray_stage(client).curve is None
        assert list(client.add("r1", 2)) == [1, 0]
    assert no_actor_left()


def test_killed_actor_is_engine_dead_within_a_second() -> None:
    client = launch_on_ray(SCRIPTED, placement=SMALL, step_timeout=None)
    try:
        client.call_utility("pace", 0.01)  # a step every 10 ms: r1 lives on
        pending = client.call_utility_future("deferred_never")
        stream = client.add("r1", 10**6)
        stream_error: concurrent.futures.Future[BaseException] = concurrent.futures.Future()

        def read() -> None:
            try:
                list(stream)
            except BaseException as exc:
                stream_error.set_result(exc)

        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            ex.submit(read)
            start = time.monotonic()
            ray.kill(actor_of(client))
            with pytest.raises(EngineDeadError, match="its Ray actor died"):
                pending.result(5)
            seen = time.monotonic() - start
            assert isinstance(stream_error.result(5), EngineDeadError)
        assert seen < 1.0, f"the death took {seen:.2f} s to be seen"
        with pytest.raises(EngineDeadError):
            client.call_utility("div", 1, 2)
    finally:
        client.close()
    assert no_actor_left()


def test_a_factory_error_is_a_startup_error_and_leaves_no_actor() -> None:
    with pytest.raises(StageStartupError, match="failed on purpose"):
        launch_on_ray("enginecore.stage.testing:failing_factory", placement=SMALL)
    assert no_actor_left()


def autoscaler_reported() -> bool:
    """Ray's monitor has reported this cluster as one that does not scale (it does so a few
    seconds after the cluster starts, its first report without the nodes): until then,
    enginecore cannot tell, and an infeasible placement waits out its startup_timeout."""
    from ray.experimental.internal_kv import _internal_kv_get

    from enginecore.stage.ray import _fixed_cluster

    return wait_until(
        lambda: _fixed_cluster(
            _internal_kv_get("__autoscaling_status"),
            _internal_kv_get("__autoscaler_v2_enabled", namespace="__autoscaler"),
        ),
        30,
    )


@pytest.mark.parametrize(
    ("placement", "named"),
    [
        (RayPlacement(num_cpus=0.25, num_gpus=1), "GPU"),
        (RayPlacement(num_cpus=0.25, resources={"no-such-node": 1}), "no-such-node"),
        (RayPlacement(num_cpus=CPUS + 1), "CPU"),
    ],
    ids=["gpu", "custom", "cpus"],
)
def test_an_infeasible_placement_fails_at_once_naming_the_resource(
    ray_launch: Callable[..., StageClient], placement: RayPlacement, named: str
) -> None:
    # No node of this cluster (which does not scale) can ever offer it: the launch waited
    # out its whole startup_timeout (60 s) before it failed.
    assert autoscaler_reported()
    start = time.monotonic()
    with pytest.raises(StageStartupError, match=f"no node .* {named}") as info:
        ray_launch(COUNTDOWN, placement=placement, startup_timeout=60)
    assert time.monotonic() - start < 30
    assert "does not scale" in str(info.value)
    assert no_actor_left()


def test_a_placement_that_waits_for_resources_fails_after_the_startup_timeout(
    ray_launch: Callable[..., StageClient],
) -> None:
    # Feasible (the node has 2 CPUs) but not now (a stage holds a share): pending, so the
    # startup_timeout tells, not the infeasibility check.
    assert autoscaler_reported()
    with launch_on_ray(COUNTDOWN, placement=SMALL):
        start = time.monotonic()
        with pytest.raises(StageStartupError, match="not ready within"):
            ray_launch(COUNTDOWN, placement=RayPlacement(num_cpus=CPUS), startup_timeout=1)
        assert time.monotonic() - start < 10
    assert no_actor_left()


def test_the_rule_for_a_cluster_that_does_not_scale() -> None:
    # Only Ray's readonly monitor (every node its own type, node_<id>) says so; an
    # autoscaler's node types, a status that is missing or unreadable, and autoscaler v2
    # never do: then a placement waits as before.
    from enginecore.stage.ray import _fixed_cluster

    def status(mapping: dict[str, str]) -> bytes:
        import json

        return json.dumps({"autoscaler_report": {"node_type_mapping": mapping}}).encode()

    assert _fixed_cluster(status({"ab12": "node_ab12", "cd34": "node_cd34"}), None)
    assert _fixed_cluster(status({"ab12": "node_ab12"}), b"0")
    assert not _fixed_cluster(status({"ab12": "node_ab12"}), b"1")  # autoscaler v2
    assert not _fixed_cluster(status({"ab12": "node_ab12", "cd34": "gpu_workers"}), None)
    assert not _fixed_cluster(status({}), None)
    assert not _fixed_cluster(None, None)
    assert not _fixed_cluster(b"not json", None)
    assert not _fixed_cluster(b'{"autoscaler_report": null}', None)


def test_a_slow_start_fails_after_the_startup_timeout(
    ray_launch: Callable[..., StageClient],
) -> None:
    # Placed, but the factory (a model's load) outlasts the timeout: the actor is killed.
    start = time.monotonic()
    with pytest.raises(StageStartupError, match="not ready within"):
        ray_launch(
            "enginecore.stage.testing:sleeping_factory",
            {"seconds": 30.0},
            placement=SMALL,
            startup_timeout=1.5,
        )
    assert time.monotonic() - start < 10
    assert no_actor_left()


def test_a_placement_group_bundle() -> None:
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([{"CPU": 0.5}, {"CPU": 0.5}])
    ray.get(group.ready(), timeout=30)
    try:
        placement = RayPlacement(num_cpus=0.5, placement_group=group, bundle_index=1)
        with launch_on_ray(COUNTDOWN, placement=placement) as client:
            assert list(client.add("r1", 2)) == [1, 0]
    finally:
        remove_placement_group(group)
    assert no_actor_left()


def test_bad_arguments_fail_before_anything_is_placed() -> None:
    with pytest.raises(ValueError, match="bundle_index needs a placement_group"):
        RayPlacement(bundle_index=0)
    with pytest.raises(ValueError, match="connect_timeout"):
        launch_on_ray(COUNTDOWN, connect_timeout=60)
    with pytest.raises(TypeError, match="insecure must be a bool, got str"):
        launch_on_ray(COUNTDOWN, insecure="no")  # type: ignore[arg-type]  # was true: no CURVE
    with pytest.raises(TypeError, match="ordered_events must be a bool, got str"):
        launch_on_ray(COUNTDOWN, ordered_events="no")  # type: ignore[arg-type]  # was true
    with pytest.raises(TypeError, match="factory kwargs must be a dict, got list"):
        launch_on_ray(COUNTDOWN, [("n", 1)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="factory kwargs must be a dict, got str"):
        StagePool.launch_on_ray(COUNTDOWN, "n=1")  # type: ignore[arg-type]
    for bad in ("5", math.nan, math.inf):  # "5" was a bare comparison error, nan passed
        with pytest.raises((TypeError, ValueError), match="startup_timeout must be a number"):
            launch_on_ray(COUNTDOWN, startup_timeout=bad)  # type: ignore[arg-type]
        with pytest.raises((TypeError, ValueError), match="connect_timeout must be a number"):
            launch_on_ray(COUNTDOWN, connect_timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="placements for 2 replicas"):
        StagePool.launch_on_ray(COUNTDOWN, replicas=2, placement=[SMALL])
    with pytest.raises(TypeError):
        StagePool.launch_on_ray(COUNTDOWN, placement="anywhere")  # type: ignore[arg-type]
    for bad in ("2", 1.5, True):  # as launch()'s (a str once raised a bare comparison error)
        with pytest.raises(TypeError, match="replicas must be an int"):
            StagePool.launch_on_ray(COUNTDOWN, replicas=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        StagePool.launch_on_ray(COUNTDOWN, replicas=0)
    from enginecore.stage import AsyncStagePool

    with pytest.raises(TypeError, match="replicas must be an int"):
        asyncio.run(AsyncStagePool.launch_on_ray(COUNTDOWN, replicas="2"))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"num_cpus": "1"}, TypeError, "num_cpus must be a number >= 0, got '1'"),
        ({"num_cpus": True}, TypeError, "num_cpus must be a number >= 0, got True"),
        ({"num_gpus": math.nan}, ValueError, "num_gpus must be a number >= 0, got nan"),
        ({"num_gpus": -1}, ValueError, "num_gpus must be a number >= 0"),
        ({"resources": ["GPU"]}, TypeError, "resources must be a mapping"),
        ({"resources": {"tts": -1}}, ValueError, r"resources\['tts'\] must be a number >= 0"),
        ({"resources": {1: 1}}, TypeError, "a resource name must be a str"),
        ({"placement_group": "pg"}, TypeError, "placement_group must be a ray.util"),
        ({"runtime_env": ["pip"]}, TypeError, "runtime_env must be a mapping"),
        ({"bundle_index": 1.0}, TypeError, "bundle_index must be an int >= -1"),
        # Ray's own refusals, which came only at the launch, as Ray's bare ValueError.
        ({"resources": {"CPU": 1}}, ValueError, r"resources\['CPU'\]: give num_cpus"),
        ({"resources": {"GPU": 1}}, ValueError, r"resources\['GPU'\]: give num_gpus"),
        ({"num_cpus": 0.00001}, ValueError, "num_cpus must be 0 or at least 0.0001, got 1e-05"),
        ({"resources": {"tts": 1e-5}}, ValueError, r"resources\['tts'\] must be 0 or at least"),
    ],
)
def test_a_placement_is_checked_when_it_is_made(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    # Before, these passed and failed only at the launch, with Ray's bare errors
    # ("'<' not supported ...", an AssertionError, "cannot convert float NaN to integer").
    with pytest.raises(error, match=message):
        RayPlacement(**options)


def _stage_actors_ever() -> int:
    """How many stage actors Ray's actor table lists, in any state (dead ones too)."""
    from ray._private import state

    return sum(1 for info in state.actors().values() if info["ActorClassName"] == "_StageActor")


@pytest.mark.parametrize("kind", ["pool", "pipeline"])
def test_rays_own_refusal_of_a_placement_fails_the_launch_before_any_is_placed(
    kind: str,
) -> None:
    # Ray refuses some accelerator requests only in ActorClass.options() (a TPU count it
    # has no chip configuration for), which RayPlacement cannot call without importing
    # Ray. A pool or pipeline met the refusal when its launch reached that placement:
    # after it had placed (and then had to close) the replicas or stages before it.
    bad = RayPlacement(resources={"TPU": 0.5})
    before = _stage_actors_ever()
    launch: Callable[[], object] = (
        (lambda: StagePool.launch_on_ray(SCRIPTED, replicas=2, placement=[SMALL, bad]))
        if kind == "pool"
        else lambda: Pipeline.launch(
            # (its stages start last to first: the bad one last)
            [PipelineStage(SCRIPTED, placement=bad), PipelineStage(RELAY, placement=SMALL)]
        )
    )
    with pytest.raises(ValueError, match=r"RayPlacement\(.*.TPU.: 0.5.*not a supported chip"):
        launch()
    assert _stage_actors_ever() == before


def test_pool_of_two_ray_replicas_routes_survives_a_kill_and_restarts() -> None:
    restart = RestartPolicy(first_delay=0.2)
    with StagePool.launch_on_ray(SCRIPTED, replicas=2, placement=SMALL, restart=restart) as pool:
        r0, r1 = pool.replicas
        assert r0.launched
        assert r0.address is not None
        assert r0.address.startswith("tcp://")
        streams = pool.add_many([(f"a{i}", 3) for i in range(20)])
        assert {s.replica for s in streams} == {r0, r1}
        assert sum(len(s.collect()) for s in streams) == 60

        waiting = r0._client.call_utility_future("deferred_never")
        start = time.monotonic()
        ray.kill(actor_of(r0._client))
        with pytest.raises(ReplicaDeadError) as info:
            waiting.result(5)
        assert time.monotonic() - start < 1.0
        assert info.value.replica is r0
        # The other replica serves meanwhile.
        assert [s.collect() for s in pool.add_many([(f"b{i}", 2) for i in range(4)])] == [
            [1, 0]
        ] * 4
        assert wait_until(lambda: r0.state is ReplicaState.SERVING and r0.restarts == 1, 30)
        stream = pool.add("c", 2)
        assert stream.collect() == [1, 0]
        assert pool.call_utility("div", 1, 2, replica=r0) == 0.5
    assert no_actor_left()


def test_a_restart_group_on_ray_dies_and_is_placed_again_together() -> None:
    restart = RestartPolicy(first_delay=0.2)
    with StagePool.launch_on_ray(
        SCRIPTED, replicas=2, placement=SMALL, restart=restart, group="tp"
    ) as pool:
        r0, r1 = pool.replicas
        assert r0.group == r1.group == "tp"
        old = [ray_stage(r._client) for r in (r0, r1)]
        waiting = r1._client.call_utility_future("deferred_never")
        ray.kill(old[0].actor)
        with pytest.raises(ReplicaDeadError, match="restart group 'tp': replica r0 died") as info:
            waiting.result(5)
        assert info.value.replica is r1
        assert wait_until(lambda: r0.state is r1.state is ReplicaState.SERVING, 30)
        assert (r0.restarts, r1.restarts) == (1, 1)
        new = [ray_stage(r._client) for r in (r0, r1)]
        assert all(n is not o for n, o in zip(new, old, strict=True))
        assert old[1].reap() == -int(signal.SIGKILL)  # ray.kill-ed with its group
        streams = pool.add_many([(f"g{i}", 2) for i in range(4)])
        assert {s.replica for s in streams} == {r0, r1}
        assert [s.collect() for s in streams] == [[1, 0]] * 4
    assert no_actor_left()


def test_a_restart_in_a_removed_placement_group_fails_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Each restart of a replica whose placement group was removed waited out its
    # startup_timeout: max_failures x 60 s before the replica was marked failed.
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([{"CPU": 0.25}])
    ray.get(group.ready(), timeout=30)
    placement = RayPlacement(num_cpus=0.25, placement_group=group, bundle_index=0)
    restart = RestartPolicy(first_delay=0.05, max_delay=0.05, max_failures=3)
    with (
        caplog.at_level(logging.WARNING, "enginecore"),
        StagePool.launch_on_ray(
            SCRIPTED, placement=placement, restart=restart, startup_timeout=60
        ) as pool,
    ):
        (replica,) = pool.replicas
        remove_placement_group(group)  # its actor goes with it
        assert wait_until(lambda: replica.state is ReplicaState.FAILED, 20)
    assert f"placement group {group.id.hex()} was removed" in caplog.text
    assert no_actor_left()


def test_add_replica_on_ray_beside_a_launched_one() -> None:
    with StagePool.launch(COUNTDOWN, replicas=1) as pool:
        replica = pool.add_replica(COUNTDOWN, ray=SMALL)
        assert replica.launched
        assert replica.address is not None
        assert replica.address.startswith("tcp://")
        assert pool.call_utility("div", 3, 4, replica=replica) == 0.75
        assert pool.remove_replica(replica) == 0
    assert no_actor_left()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_ray_replica_refuses_a_ping_interval(kind: str) -> None:
    # A Ray replica's liveness is its heartbeat: ping_interval= was taken and dropped, so a
    # caller who asked for a faster check got none, without a word.
    from enginecore.stage import AsyncStagePool

    message = "a replica placed on Ray takes no ping_interval"
    if kind == "sync":
        pool = StagePool()
        with pytest.raises(TypeError, match=message):
            pool.add_replica(COUNTDOWN, ray=SMALL, ping_interval=0.2)
        assert not pool.replicas
        pool.close()
    else:

        async def main() -> None:
            pool = AsyncStagePool()
            with pytest.raises(TypeError, match=message):
                await pool.add_replica(COUNTDOWN, ray=SMALL, ping_interval=0.2)
            assert not pool.replicas
            await pool.close()

        asyncio.run(main())
    assert no_actor_left()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_close_stops_a_ray_replica_s_placement_under_way(kind: str) -> None:
    # A placement that waits for resources waits out the startup timeout; a close stops
    # that wait: the add_replica raises StageClosedError at once and no actor is left (the
    # blocking pool's waited the whole 60 s).
    from enginecore.stage import AsyncStagePool

    # Every CPU of the node, while a stage holds a share of one: it waits (an infeasible
    # placement, one that no node could ever take, is refused before any wait).
    every_cpu = RayPlacement(num_cpus=CPUS)
    with launch_on_ray(COUNTDOWN, placement=SMALL):
        if kind == "sync":
            pool = StagePool()
            with concurrent.futures.ThreadPoolExecutor(1) as ex:
                adding = ex.submit(pool.add_replica, COUNTDOWN, ray=every_cpu, startup_timeout=60)
                assert wait_until(lambda: len(pool.replicas) == 1, 10)
                pool.close()
                with pytest.raises(StageClosedError):
                    adding.result(10)
        else:

            async def main() -> None:
                pool = AsyncStagePool()
                adding = asyncio.ensure_future(
                    pool.add_replica(COUNTDOWN, ray=every_cpu, startup_timeout=60)
                )
                while not pool.replicas:
                    await asyncio.sleep(0.01)
                await pool.close()
                with pytest.raises(StageClosedError):
                    await asyncio.wait_for(adding, 10)

            asyncio.run(main())
    assert wait_until(no_actor_left, 10)


def test_async_pool_on_ray() -> None:
    import asyncio

    from enginecore.stage import AsyncStagePool

    async def main() -> None:
        pool = await AsyncStagePool.launch_on_ray(COUNTDOWN, replicas=1, placement=SMALL)
        async with pool:
            (replica,) = pool.replicas
            assert replica.address is not None
            assert replica.address.startswith("tcp://")
            stream = await pool.add("r1", 3)
            assert [x async for x in stream] == [2, 1, 0]
            assert await pool.call_utility("div", 1, 4) == 0.25

    asyncio.run(main())
    assert no_actor_left()


def test_a_silent_stage_is_dead_after_the_heartbeat_timeout() -> None:
    # A stopped actor process: Ray still believes it alive, only the heartbeat can tell.
    client = launch_on_ray(
        COUNTDOWN, placement=SMALL, heartbeat_interval=0.2, heartbeat_timeout=1.0
    )
    pid = client.pid
    try:
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="no heartbeat"):
            client.call_utility("div", 1, 2, timeout=10)
        assert 0.8 < time.monotonic() - start < 2.0
    finally:
        os.kill(pid, signal.SIGCONT)
        client.close()  # shutdown ignored by a stage it cannot reach: ray.kill
    assert no_actor_left()


def test_a_stage_presumed_dead_is_killed_at_its_close_without_waiting() -> None:
    # Presumed dead by its heartbeat (a stopped actor, which Ray believes alive), the stage
    # was sent no shutdown: the close kills its actor at once, instead of waiting 5 s for
    # an exit nobody asked for and 1 s more after an actor.stop it cannot take.
    client = launch_on_ray(
        COUNTDOWN, placement=SMALL, heartbeat_interval=0.2, heartbeat_timeout=3.0
    )
    stage = ray_stage(client)
    os.kill(stage.process.pid, signal.SIGSTOP)
    try:
        with pytest.raises(EngineDeadError, match="presumed dead"):
            client.call_utility("div", 1, 2, timeout=10)
        start = time.monotonic()
        client.close()
        assert time.monotonic() - start < 3.0  # 6 s before
        assert stage.wait_exit(0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stage.process.pid, signal.SIGCONT)
    assert no_actor_left()


def test_a_pool_replica_presumed_dead_is_killed_at_once_and_restarts() -> None:
    # The pool soak's case (benchmarks/soak_pool.py --ray): a replica stopped past its
    # heartbeat timeout is dead for the pool; its actor is ray.kill-ed as soon as that is
    # heard (it held its resources 6 s more before), and the replica is placed again.
    from enginecore.stage import AsyncStagePool

    async def main() -> None:
        pool = await AsyncStagePool.launch_on_ray(
            COUNTDOWN,
            replicas=1,
            placement=SMALL,
            restart=RestartPolicy(first_delay=0.05),
            heartbeat_interval=0.2,
            heartbeat_timeout=3.0,
        )
        async with pool:
            (replica,) = pool.replicas
            old = ray_stage(replica._client)
            os.kill(old.process.pid, signal.SIGSTOP)
            try:
                stream = await pool.add("r1", 10**9)
                with pytest.raises(ReplicaDeadError, match="presumed dead"):
                    await stream.collect(timeout=10)
                assert await asyncio.to_thread(old.wait_exit, 3.0)  # 6 s before
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(old.process.pid, signal.SIGCONT)
            assert await asyncio.to_thread(
                wait_until,
                lambda: replica.state is ReplicaState.SERVING and replica.pid != old.process.pid,
                30.0,
            )
            stream = await pool.add("r2", 3)
            assert await stream.collect(timeout=10) == [2, 1, 0]

    asyncio.run(main())
    assert no_actor_left()


def test_a_replica_presumed_dead_while_it_drains_is_killed_then() -> None:
    # remove_replica(drain=True) waits for the replica's exit; a replica that stops
    # answering meanwhile will not exit: once the heartbeat presumes it dead, its requests
    # end as dead (not closed: the drain let them run on) and its actor is killed, and the
    # removal returns, instead of waiting out the drain's timeout and 1 s after actor.stop.
    beat: dict[str, Any] = {"heartbeat_interval": 0.2, "heartbeat_timeout": 3.0}
    with StagePool.launch_on_ray(COUNTDOWN, placement=SMALL, **beat) as pool:
        (r0,) = pool.replicas
        stage = ray_stage(r0._client)
        stream = pool.add("long", 10**9)
        assert stream.get(timeout=10) == 10**9 - 1
        r1 = pool.add_replica(COUNTDOWN, ray=SMALL, **beat)
        os.kill(stage.process.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            pool.remove_replica(r0, drain=True, timeout=30)
            assert time.monotonic() - start < 12  # 31 s before
            assert stage.wait_exit(0)
            with pytest.raises(ReplicaDeadError, match="presumed dead"):
                stream.collect(timeout=10)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stage.process.pid, signal.SIGCONT)
        assert pool.call_utility("div", 1, 2, replica=r1) == 0.5
    assert no_actor_left()


def test_an_async_pool_replica_presumed_dead_while_it_drains_is_killed_then() -> None:
    # The asyncio twin of the test above (the AsyncStageClient's close awaits the exit).
    from enginecore.stage import AsyncStagePool

    beat: dict[str, Any] = {"heartbeat_interval": 0.2, "heartbeat_timeout": 3.0}

    async def main() -> None:
        pool = await AsyncStagePool.launch_on_ray(COUNTDOWN, placement=SMALL, **beat)
        async with pool:
            (r0,) = pool.replicas
            stage = ray_stage(r0._client)
            stream = await pool.add("long", 10**9)
            assert await stream.get(timeout=10) == 10**9 - 1
            r1 = await pool.add_replica(COUNTDOWN, ray=SMALL, **beat)
            os.kill(stage.process.pid, signal.SIGSTOP)
            try:
                start = time.monotonic()
                await pool.remove_replica(r0, drain=True, timeout=30)
                assert time.monotonic() - start < 12  # 31 s before
                assert stage.wait_exit(0)
                with pytest.raises(ReplicaDeadError, match="presumed dead"):
                    await stream.collect(timeout=10)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(stage.process.pid, signal.SIGCONT)
            assert await pool.call_utility("div", 1, 2, replica=r1) == 0.5

    asyncio.run(main())
    assert no_actor_left()


def test_importing_the_module_does_not_import_ray() -> None:
    code = (
        "import sys\n"
        "import enginecore.stage, enginecore.stage.ray\n"
        "from enginecore.stage.ray import RayPlacement\n"
        "RayPlacement(num_cpus=2)\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_an_unreachable_stage_fails_within_the_connect_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The actor's address as a client on another network would see it unroutable:
    # TEST-NET-2 (RFC 5737), where nothing answers.
    real_start = RayPlan.start

    def start(plan: RayPlan, grant: Any = None, cancel: Any = None) -> RayStage:
        stage = real_start(plan, grant, cancel)
        stage.input_address = "tcp://198.51.100.1:5570"
        return stage

    monkeypatch.setattr(RayPlan, "start", start)
    begin = time.monotonic()
    with pytest.raises(StageStartupError, match="handshake"):
        launch_on_ray(COUNTDOWN, placement=SMALL, connect_timeout=1.5)
    assert time.monotonic() - begin < 10
    assert no_actor_left()


# -- both clients: StageClient.launch_on_ray, AsyncStageClient.launch_on_ray -------------------


@pytest.fixture(params=["sync", "async"])
def ray_launch(request: pytest.FixtureRequest) -> Iterator[Callable[..., StageClient]]:
    """``StageClient.launch_on_ray``, or ``AsyncStageClient.launch_on_ray`` behind the
    blocking adapter; every client is closed afterwards."""
    with _clients(request.param, "launch_on_ray") as open_:
        yield open_


def test_both_clients_place_a_stage_on_ray(ray_launch: Callable[..., StageClient]) -> None:
    client = ray_launch(SCRIPTED, placement=SMALL, ordered_events=True)
    assert client.address.startswith("tcp://")
    assert ray_stage(client).curve is not None  # CURVE by default
    assert client.add("r1", 3).collect() == [2, 1, 0]
    assert len(client.get_events(5)) >= 1  # the ordered event stream is on
    assert client.call_utility("div", 1, 4) == 0.25
    pending = client.call_utility_future("deferred_never")
    start = time.monotonic()
    ray.kill(ray_stage(client).actor)
    with pytest.raises(EngineDeadError, match="its Ray actor died"):
        pending.result(5)
    assert time.monotonic() - start < 1.0
    client.close()
    assert no_actor_left()


def test_both_clients_bound_a_stage_on_ray(ray_launch: Callable[..., StageClient]) -> None:
    # launch_on_ray(max_message_bytes=): the actor's stage bounds its input socket (with
    # CURVE, allowing for its bytes: a frame of exactly the bound passes), and says so in its
    # welcome, so that the client refuses a bigger request before sending it.
    client = ray_launch(ECHO, placement=SMALL, max_message_bytes=4096)
    with pytest.raises(MessageTooLargeError, match="at most 4096 bytes"):
        client.add("big", b"x" * 4097)
    assert client.add("ok", b"x" * 4096).collect() == [b"x" * 4096]
    client.close()
    assert no_actor_left()


_CHECKED_END = """
except BaseException:  # shown, then out: Ray's excepthook may hang on a shut-down Ray
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)
print("checked", flush=True)
"""
"""The end of a script for :func:`_run_checked` whose checks run in one ``try:``."""


_SHUTDOWN_UNDER_CLIENTS = """
import asyncio, logging, ray, time
from enginecore.stage import (
    AsyncStageClient, EngineDeadError, ReplicaState, RestartPolicy, StageClient, StagePool)
from enginecore.stage.ray import RayPlacement, authorize_clients, authorize_clients_async

ray.init(address="local", num_cpus=1, include_dashboard=False,
         logging_level=logging.ERROR, log_to_driver=False)
SMALL = RayPlacement(num_cpus=0.25)

async def main():
    blocking = await asyncio.to_thread(
        StageClient.launch_on_ray, "enginecore.stage.testing:scripted", placement=SMALL)
    client = await AsyncStageClient.launch_on_ray(
        "enginecore.stage.testing:scripted", placement=SMALL)
    fast = RestartPolicy(first_delay=0.05, max_delay=0.05)
    pool = await asyncio.to_thread(
        StagePool.launch_on_ray, "enginecore.stage.testing:scripted", placement=SMALL,
        restart=fast)
    pending = [
        asyncio.wrap_future(blocking.call_utility_future("deferred_never")),
        asyncio.ensure_future(client.call_utility("deferred_never")),
    ]
    await asyncio.sleep(0.1)
    ray.shutdown()
    # A key rotation right after it (before the clients' watch has looked) calls Ray no
    # more: it raised Ray's "Can't find actor" after starting a new local cluster.
    for rotation in [
        lambda: asyncio.to_thread(authorize_clients, blocking, []),
        lambda: authorize_clients_async(client, []),
    ]:
        try:
            await rotation()
        except EngineDeadError as exc:
            assert "ray.shutdown" in str(exc), exc
        else:
            raise AssertionError("the rotation did not fail")
    assert authorize_clients(pool, []) == 0  # none of its stages runs
    assert not ray.is_initialized(), "a key rotation started a Ray cluster of its own"
    later = asyncio.to_thread(blocking.call_utility, "div", 1, 2)
    for call in [*pending, later, client.call_utility("div", 1, 2)]:
        try:
            await asyncio.wait_for(call, 4)  # well within the heartbeat's 5 s
        except EngineDeadError as exc:
            assert "ray.shutdown" in str(exc), exc
        else:
            raise AssertionError("the call did not fail")
    blocking.close()
    await client.close()
    # The pool's restarts are refused (StageStartupError) until it marks the replica failed.
    (replica,) = pool.replicas
    deadline = time.monotonic() + 30
    while replica.state is not ReplicaState.FAILED and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert replica.state is ReplicaState.FAILED, replica.state
    pool.close()
    assert not ray.is_initialized(), "a close or a restart started a Ray cluster of its own"

asyncio.run(main())
"""


def test_ray_shutdown_under_live_clients_ends_their_calls_and_starts_no_cluster() -> None:
    # ray.shutdown() ends the actors this process owns but completes no pending ray.get:
    # both clients once heard of it only from their heartbeat timeout, and their close
    # then ray.kill-ed the actor, which started a new local Ray cluster of its own, as a
    # pool's restart placed its replica again on one. In a process of its own, so that
    # this module's cluster stays up.
    subprocess.run([sys.executable, "-c", _SHUTDOWN_UNDER_CLIENTS], check=True, timeout=90)


def _run_checked(script: str, timeout: float, args: Sequence[str] = ()) -> None:
    """Runs *script* (with *args* as ``sys.argv[1:]``) in a Python process of its own (so
    that this module's cluster stays up): it must exit 0 and print ``checked`` last; its
    stderr says why not."""
    run = subprocess.run(
        [sys.executable, "-c", script, *args],
        check=False,
        timeout=timeout,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith("checked"), run.stderr


_SHUTDOWN_UNDER_STARTS = """
import asyncio, logging, os, ray, signal, sys, time, traceback
from ray._private import state
from enginecore.stage import (
    AsyncStageClient, EngineDeadError, ReplicaState, RestartPolicy, StageClient, StagePool,
    StageStartupError)
from enginecore.stage.ray import RayPlacement, authorize_clients, authorize_clients_async

ray.init(address="local", num_cpus=2, include_dashboard=False,
         logging_level=logging.ERROR, log_to_driver=False)
SMALL = RayPlacement(num_cpus=0.25)
SLOW = "enginecore.stage.testing:sleeping_factory"

def alive():
    return sum(1 for info in state.actors().values() if info.get("State") == "ALIVE")

async def main():
    # Two stages that do not answer (stopped), each with a key rotation under way.
    frozen = await asyncio.to_thread(
        StageClient.launch_on_ray, "enginecore.stage.testing:scripted", placement=SMALL,
        heartbeat_timeout=60)
    afrozen = await AsyncStageClient.launch_on_ray(
        "enginecore.stage.testing:scripted", placement=SMALL, heartbeat_timeout=60)
    for client in (frozen, afrozen):
        os.kill(client.pid, signal.SIGSTOP)
    rotations = [
        asyncio.ensure_future(asyncio.to_thread(authorize_clients, frozen, [], timeout=60)),
        asyncio.ensure_future(authorize_clients_async(afrozen, [], timeout=60)),
    ]
    await asyncio.sleep(0)  # the async rotation's call is under way
    fast = RestartPolicy(first_delay=0.05, max_delay=0.05)
    pool = await asyncio.to_thread(
        StagePool.launch_on_ray, SLOW, {"seconds": 4.0}, placement=SMALL, restart=fast,
        startup_timeout=60)
    (replica,) = pool.replicas
    ray.kill(replica._client._launched.actor)  # its restart sleeps 4 s in its actor
    blocking = asyncio.to_thread(
        StageClient.launch_on_ray, SLOW, {"seconds": 60.0}, placement=SMALL,
        startup_timeout=60)
    launch = asyncio.ensure_future(AsyncStageClient.launch_on_ray(
        SLOW, {"seconds": 60.0}, placement=SMALL, startup_timeout=60))
    blocking = asyncio.ensure_future(blocking)
    deadline = time.monotonic() + 60
    while alive() < 5 and time.monotonic() < deadline:  # all five actors placed
        await asyncio.sleep(0.02)
    assert alive() == 5, alive()
    ray.shutdown()
    for rotation in rotations:  # not after their timeout's 60 s
        try:
            await asyncio.wait_for(rotation, 10)
        except EngineDeadError as exc:
            assert "ray.shutdown" in str(exc), exc
        else:
            raise AssertionError("the rotation did not fail")
    frozen.close()
    await afrozen.close()
    for start in (blocking, launch):
        try:
            await asyncio.wait_for(start, 10)  # not the startup timeout's 60 s
        except StageStartupError as exc:
            assert "ray.shutdown" in str(exc), exc
        else:
            raise AssertionError("the start did not fail")
    # The restart under way at the shutdown is refused, as the ones after it.
    deadline = time.monotonic() + 30
    while replica.state is not ReplicaState.FAILED and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert replica.state is ReplicaState.FAILED, replica.state
    pool.close()
    assert not ray.is_initialized(), "a start started a Ray cluster of its own"

try:
    asyncio.run(main())
except BaseException:  # shown, then out: Ray's excepthook may hang on a shut-down Ray
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)
print("checked", flush=True)  # not a SystemExit(0) on the way
"""


def test_ray_shutdown_under_starts_and_rotations_fails_them_and_starts_no_cluster() -> None:
    # A ray.shutdown() while stages were being placed and keys rotated: a start's ray.get
    # raised SystemExit (a launch in a thread ended silently), a pool's restart under way
    # called Ray again (ray.wait), which started a new local cluster and placed the replica
    # there, and a blocking rotation's ray.get could wait out its timeout (60 s: a run in
    # CI went past 90 s), or a shutdown between a look and a call started a cluster. In a
    # process of its own, so that this module's cluster stays up.
    _run_checked(_SHUTDOWN_UNDER_STARTS, timeout=110)  # within the test's (120 s)


_SHUTDOWN_BETWEEN_LOOK_AND_CALL = (
    """
import logging, os, ray, sys, threading, traceback
from enginecore.stage import EngineDeadError, StageClient
from enginecore.stage.ray import RayPlacement, _calling_ray, _shutdown_lock, authorize_clients

ray.init(address="local", num_cpus=1, include_dashboard=False,
         logging_level=logging.ERROR, log_to_driver=False)
try:
    # Ray's own lock (a private name of Ray's): where it is missing, the race is back.
    assert _shutdown_lock(ray) is ray._private.worker._connect_or_shutdown_lock
    client = StageClient.launch_on_ray(
        "enginecore.stage.testing:scripted", placement=RayPlacement(num_cpus=0.25))
    actor = client._launched.actor
    shutdown = threading.Thread(target=ray.shutdown)
    with _calling_ray(ray, AssertionError):  # Ray is initialized: the look passes
        shutdown.start()  # lands between the look and the call
        shutdown.join(2.0)
        assert shutdown.is_alive(), "the shutdown did not wait for the call"
        actor.authorize.remote([])  # Ray's auto-init: a new cluster if Ray were shut down
    shutdown.join()
    assert not ray.is_initialized(), "a call after the look started a Ray cluster"
    try:
        authorize_clients(client, [])
    except EngineDeadError as exc:
        assert "ray.shutdown" in str(exc), exc
    else:
        raise AssertionError("the rotation did not fail")
    client.close()
    assert not ray.is_initialized(), "a Ray cluster was started again"
"""
    + _CHECKED_END
)


def test_a_ray_shutdown_between_a_look_and_a_call_to_ray_starts_no_cluster() -> None:
    # enginecore looked whether Ray was initialized, then called it: a ray.shutdown() in
    # another thread between the two let Ray's auto-init (ray.kill, actor creation and
    # actor calls) start a new local cluster. Each call now holds Ray's own lock around
    # ray.shutdown() from its look to its end.
    _run_checked(_SHUTDOWN_BETWEEN_LOOK_AND_CALL, timeout=90)


# The scripts' ray.init(), and a look at whether a placement is refused.
_REFUSES = """
def init():
    ray.init(address="local", num_cpus=1, include_dashboard=False,
             logging_level=logging.ERROR, log_to_driver=False)

def refuses() -> bool:
    # What a placement does first: refuse, or let Ray's default (ray.init()'s) have its way.
    try:
        with _calling_ray(ray, lambda: AssertionError("refused"), placement=True):
            return False
    except AssertionError:
        return True
"""


_PLACED_AGAIN_AFTER_INIT = (
    """
import logging, os, ray, sys, traceback
from enginecore.stage import StageClient, StageStartupError
from enginecore.stage.ray import RayPlacement, _calling_ray

SMALL = RayPlacement(num_cpus=0.25)
SCRIPTED = "enginecore.stage.testing:scripted"
"""
    + _REFUSES
    + """
def shut_down_under_a_stage():
    client = StageClient.launch_on_ray(SCRIPTED, placement=SMALL)
    ray.shutdown()
    assert client._launched.wait_exit(10), "the client did not hear of the shutdown"
    try:
        StageClient.launch_on_ray(SCRIPTED, placement=SMALL)
    except StageStartupError as exc:
        assert "ray.init()" in str(exc), exc
    else:
        raise AssertionError("a placement after the shutdown was not refused")
    return client

try:
    init()
    old = shut_down_under_a_stage()
    init()  # a new session: stages are placed again
    with StageClient.launch_on_ray(SCRIPTED, placement=SMALL) as client:
        assert client.add("r1", 2).collect() == [1, 0]
    ray.shutdown()  # a clean one, no stage under it
    assert not refuses(), "a clean ray.init()/ray.shutdown() kept the refusal"
    old.close()  # a client of the first session, closed only now
    assert not refuses(), "the close of a stage of an earlier session refused placements"
    init()
    shut_down_under_a_stage().close()
    init()  # nothing placed in this session
    ray.shutdown()
    assert not refuses(), "a ray.init() without a placement kept the refusal"
    assert not ray.is_initialized()
"""
    + _CHECKED_END
)


def test_the_refusal_after_a_shutdown_under_stages_ends_with_a_new_ray_session() -> None:
    # Once Ray was shut down under stages, placements were refused for the rest of the
    # process, after a new ray.init() and a clean ray.shutdown() too. In a process of its
    # own, so that this module's cluster stays up.
    _run_checked(_PLACED_AGAIN_AFTER_INIT, timeout=110)


_LATE_WATCH = (
    """
import logging, os, ray, sys, threading, traceback
from enginecore.stage import StageClient
from enginecore.stage.ray import RayPlacement, RayStage, _calling_ray

SMALL = RayPlacement(num_cpus=0.25)
SCRIPTED = "enginecore.stage.testing:scripted"
# The stage's watch looks only once a new Ray session is up (it was late, as a watch
# starved of the GIL, or a shutdown and an init within one of its 0.25 s polls).
late = threading.Event()
watch = RayStage._watch

def late_watch(stage):
    late.wait()
    watch(stage)

RayStage._watch = late_watch
"""
    + _REFUSES
    + """
try:
    init()
    old = StageClient.launch_on_ray(SCRIPTED, placement=SMALL)
    ray.shutdown()  # under the stage
    init()
    late.set()
    # Its session is over: its client hears of it all the same (Ray completes none of the
    # old actor's calls), without refusing the placements of the new session.
    assert old._launched.wait_exit(10), "the client never heard of its stage's end"
    assert "ray.shutdown" in (old._launched.death or ""), old._launched.death
    assert not refuses(), "a stage of an ended session refused the new one's placements"
    with StageClient.launch_on_ray(SCRIPTED, placement=SMALL) as client:
        assert client.add("r1", 2).collect() == [1, 0]
    ray.shutdown()  # a clean one: the new session had no stage under it
    assert not refuses(), "a stage of an earlier session kept the refusal"
    old.close()  # closed only now: still no refusal, and no call to Ray
    assert not refuses(), "the close of a stage of an earlier session refused placements"
    assert not ray.is_initialized(), "a close started a Ray cluster of its own"
    # Ray's default, as promised: the launch's first call to Ray starts a local cluster.
    with StageClient.launch_on_ray(SCRIPTED, placement=SMALL) as client:
        assert client.add("r1", 1).collect() == [0]
    assert ray.is_initialized()
    ray.shutdown()
"""
    + _CHECKED_END
)


def test_a_watch_that_sees_a_shutdown_only_in_a_later_ray_session_refuses_nothing() -> None:
    # A stage whose watch looked only after a new ray.init() waited on its dead actor for
    # the whole new session (its client never heard of the end), then took that session's
    # clean ray.shutdown() for one under it: placements were refused from then on. In a
    # process of its own, so that this module's cluster stays up.
    _run_checked(_LATE_WATCH, timeout=110)


_RESTART_WITHOUT_HOOKS = (
    """
import logging, os, ray, sys, time, traceback
from enginecore.stage import Pipeline, PipelineStage, ReplicaState, RestartPolicy, StagePool
from enginecore.stage import ray as enginecore_ray
from enginecore.stage.ray import RayPlacement, _calling_ray

# A Ray without ray.init()'s hooks for enginecore (a private list of Ray's; Ray's own
# stay, as a tuple): the refusal ends at enginecore's next call to Ray while it is
# initialized, here a pool's (or a pipeline's) restart.
import ray._common.usage.usage_lib  # Ray adds its own hook when it is imported

ray._private.worker._post_init_hooks = tuple(ray._private.worker._post_init_hooks)
SMALL = RayPlacement(num_cpus=0.25)
SCRIPTED = "enginecore.stage.testing:scripted"
KIND = sys.argv[1]
"""
    + _REFUSES
    + """
try:
    init()
    fast = RestartPolicy(first_delay=0.05, max_delay=0.05, max_failures=1000)
    if KIND == "pool":
        group = StagePool.launch_on_ray(SCRIPTED, placement=SMALL, restart=fast)
        (replica,) = group.replicas
        serving = lambda: replica.state is ReplicaState.SERVING
    else:
        group = Pipeline.launch([PipelineStage(SCRIPTED, placement=SMALL, restart=fast)])
        serving = lambda: set(group.health().values()) == {"ok"}
    ray.shutdown()  # under the stage: its restarts are refused
    deadline = time.monotonic() + 10
    while not enginecore_ray._shut_down_under_stages and time.monotonic() < deadline:
        time.sleep(0.02)
    assert refuses(), "no refusal after a shutdown under a stage"
    init()  # while the stage is restarted
    deadline = time.monotonic() + 30
    while not serving() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert serving(), "the stage was not placed again after ray.init()"
    assert group.add("r1", 2).collect() == [1, 0]
    group.close()
    ray.shutdown()  # a clean one
    assert not refuses(), "a clean ray.shutdown() kept the refusal"
    assert not ray.is_initialized()
"""
    + _CHECKED_END
)


@pytest.mark.parametrize("kind", ["pool", "pipeline"])
def test_a_restart_placed_again_after_ray_init_ends_the_refusal_without_ray_hooks(
    kind: str,
) -> None:
    # Without Ray's ray.init() hooks, the pool's or pipeline's restart is the call to Ray
    # that sees the new session, and a later clean ray.shutdown() refuses nothing. In a
    # process of its own, so that this module's cluster stays up.
    _run_checked(_RESTART_WITHOUT_HOOKS, timeout=110, args=[kind])


def test_both_clients_report_a_failed_start_and_leave_no_actor(
    ray_launch: Callable[..., StageClient],
) -> None:
    with pytest.raises(StageStartupError, match="failed on purpose"):
        ray_launch("enginecore.stage.testing:failing_factory", placement=SMALL)
    with pytest.raises(ValueError, match="connect_timeout"):
        ray_launch(COUNTDOWN, connect_timeout=60)
    assert no_actor_left()


def test_the_actor_imports_only_what_a_stage_runs(
    ray_launch: Callable[..., StageClient],
) -> None:
    def actor_modules(actor: Any) -> tuple[str, list[str]]:
        # Run in the actor (``__ray_call__``), sent by value: it imports nothing of its own.
        import enginecore

        found = sorted(m for m in __import__("sys").modules if m.startswith("enginecore"))
        return enginecore.__file__ or "", found

    client = ray_launch(COUNTDOWN, placement=SMALL)
    origin, modules = ray.get(actor_of(client).__ray_call__.remote(actor_modules))
    import enginecore

    assert origin == enginecore.__file__  # the actor runs this checkout's code
    assert "enginecore.stage._runtime" in modules
    client_side = {"ray", "_client", "_aclient", "_clientbase", "_pool", "_apool", "_pipeline"}
    assert not {f"enginecore.stage.{m}" for m in client_side} & set(modules)
    client.close()
    assert no_actor_left()


def test_async_launches_on_ray_hold_no_thread() -> None:
    # Each launch awaits its actor as a Ray future: with the loop's default executor's one
    # thread busy, three launches at once all come up (a launch that held an executor
    # thread would wait for it until its startup timeout).
    async def main() -> None:
        loop = asyncio.get_running_loop()
        busy = threading.Event()
        executor = concurrent.futures.ThreadPoolExecutor(1)
        loop.set_default_executor(executor)
        blocker = loop.run_in_executor(None, busy.wait)
        try:
            launches = (
                AsyncStageClient.launch_on_ray(COUNTDOWN, placement=SMALL) for _ in range(3)
            )
            clients = await asyncio.wait_for(asyncio.gather(*launches), 60)
            for client in clients:
                assert await client.call_utility("div", 1, 2) == 0.5
                await client.close()
        finally:
            busy.set()
            await blocker

    asyncio.run(main())
    assert no_actor_left()


def test_cancelling_an_async_launch_on_ray_leaves_no_actor() -> None:
    async def main() -> None:
        task = asyncio.ensure_future(AsyncStageClient.launch_on_ray(COUNTDOWN, placement=SMALL))
        await asyncio.sleep(0.2)  # placing, or starting
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert no_actor_left()


# -- logs of a stage placed on Ray ------------------------------------------------------------


@pytest.fixture
def test_records() -> Iterator[Records]:
    """A :class:`Records` on this process's ``enginecore.test`` logger."""
    handler = Records()
    log = logging.getLogger("enginecore.test")
    log.addHandler(handler)
    try:
        yield handler
    finally:
        log.removeHandler(handler)


@pytest.mark.parametrize("insecure", [False, True], ids=["curve", "insecure"])
def test_forwarded_logs_of_a_stage_on_ray(
    ray_launch: Callable[..., StageClient],
    test_records: Records,
    insecure: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The client connects to the log socket a second late (after it asked the actor to
    # start): the actor must wait for it before it builds the engine, or the record the
    # factory logs is dropped.
    real_forward_from = _logs.forward_from

    class Late:
        def __init__(self, *args: Any) -> None:
            self.source: Any = None
            self.timer = threading.Timer(1.0, self.connect, args)
            self.timer.start()

        def connect(self, *args: Any) -> None:
            self.source = real_forward_from(*args)

        def release(self) -> None:
            self.timer.join()
            self.source.release()

    monkeypatch.setattr(_logs, "forward_from", Late)
    client = ray_launch(
        SCRIPTED,
        {"log": "building the engine"},
        placement=SMALL,
        insecure=insecure,
        name="ray-logs",
        log_level="DEBUG",
        forward_logs=True,
    )
    # Logged while the engine was built, before the stage was up: not lost.
    built = test_records.wait_for("building the engine")
    assert built.stage == "ray-logs"  # type: ignore[attr-defined]
    assert built.process == client.pid
    assert client.call_utility("emit_log", "enginecore.test", logging.DEBUG, "fine detail")
    assert test_records.wait_for("fine detail").levelno == logging.DEBUG
    assert ray_stage(client).logs is not None
    client.close()
    assert no_actor_left()


# -- bring your own keys -------------------------------------------------------------------------


class OwnKeys:
    def __init__(self, root: Path) -> None:
        stage_public, self.stage_secret = keygen(root, "stage")
        _, client_secret = keygen(root, "client")
        _, observer_secret = keygen(root, "observer")
        mallory_public, mallory_secret = keygen(root, "mallory")
        self.client = CurveKeys.load(client_secret, stage_public)
        self.observer = CurveKeys.load(observer_secret, stage_public)
        self.observer_public = self.observer.public_key
        self.mallory = CurveKeys.load(mallory_secret, stage_public)
        self.wrong_server = CurveKeys.load(client_secret, mallory_public)


@pytest.fixture(scope="module")
def own_keys(tmp_path_factory: pytest.TempPathFactory) -> OwnKeys:
    # Module-scoped: made before the autouse no_leftovers fixture points tempfile at the
    # directory that it checks is empty afterwards.
    return OwnKeys(tmp_path_factory.mktemp("own-keys"))


def test_a_stage_on_ray_with_your_own_keys_admits_the_listed_clients(own_keys: OwnKeys) -> None:
    keys = own_keys
    with launch_on_ray(
        COUNTDOWN,
        placement=SMALL,
        curve=keys.client,
        stage_secret_key=keys.stage_secret,
        authorized_clients=[keys.observer_public],
    ) as client:
        stage = ray_stage(client)
        assert stage.curve == keys.client  # the stage's key is the one from its file
        assert list(client.add("r1", 2)) == [1, 0]
        with StageObserver(client.address, curve=keys.observer) as observer:
            assert observer.stats(5).outputs == 2  # a listed observer reads it
        with (
            StageObserver(client.address, curve=keys.mallory) as observer,
            pytest.raises(AuthenticationError, match="not among"),
        ):
            observer.stats(5)
        # The refusal names the remedy for a stage on Ray too, not only serve's directory.
        with pytest.raises(
            AuthenticationError, match=r"placed on Ray: authorized_clients= or authorize_clients"
        ):
            StageClient.connect(client.address, curve=keys.mallory, timeout=5)
    assert no_actor_left()


def test_your_own_keys_are_checked(own_keys: OwnKeys) -> None:
    keys = own_keys
    with pytest.raises(StageStartupError, match="is not the stage's key that curve names"):
        launch_on_ray(
            COUNTDOWN, placement=SMALL, curve=keys.wrong_server, stage_secret_key=keys.stage_secret
        )
    # Each names the node, with the actor's own error first (not Ray's coloured wrapping).
    node = r"on the node of this stage \(\d"
    with pytest.raises(
        StageStartupError, match=f"in its Ray actor: ValueError: .*no such file .*{node}"
    ) as info:
        launch_on_ray(COUNTDOWN, placement=SMALL, stage_secret_key="/no/such/stage.key_secret")
    traceback = info.value.child_traceback
    assert traceback is not None
    assert "_server_curve" in traceback
    assert traceback in str(info.value)  # as a launched stage's
    assert "\x1b[" not in str(info.value)  # no terminal colours (Ray's header had them)
    stage_dir = os.path.dirname(keys.stage_secret)
    with pytest.raises(StageStartupError, match=f"is a directory {node}"):  # was "no such file"
        launch_on_ray(COUNTDOWN, placement=SMALL, stage_secret_key=stage_dir)
    public_file = keys.stage_secret.removesuffix("_secret")  # the stage's NAME.key
    with pytest.raises(StageStartupError, match=f"{node}.* holds no secret key"):
        launch_on_ray(COUNTDOWN, placement=SMALL, stage_secret_key=public_file)
    # A file whose public key is not its secret key's (edited by hand): the stage announced
    # that public key, and the client, given it as curve.server_key, then waited out its
    # connect timeout (10 s) for a handshake that could never succeed.
    mixed = os.path.join(os.path.dirname(keys.stage_secret), "mixed.key_secret")
    with open(keys.stage_secret) as f:
        text = f.read()
    stage_public = keys.client.server_key.decode()
    with open(mixed, "w") as f:
        f.write(text.replace(stage_public, keys.observer_public.decode()))
    mixed_client = CurveKeys(
        keys.client.public_key, keys.client.secret_key, keys.observer_public
    )  # the stage's public key as that file states it
    with pytest.raises(StageStartupError, match=f"{node}.* is not one key pair"):
        launch_on_ray(COUNTDOWN, placement=SMALL, curve=mixed_client, stage_secret_key=mixed)
    with pytest.raises(ValueError, match="give stage_secret_key"):
        launch_on_ray(COUNTDOWN, curve=keys.client)
    with pytest.raises(ValueError, match="insecure=True uses no CURVE"):
        launch_on_ray(COUNTDOWN, insecure=True, authorized_clients=[keys.observer_public])
    with pytest.raises(ValueError, match="authorized_clients"):
        launch_on_ray(COUNTDOWN, authorized_clients=[b"short"])
    with pytest.raises(TypeError, match="authorized_clients must be a sequence of public keys"):
        launch_on_ray(COUNTDOWN, authorized_clients=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="stage_secret_key must be a path"):
        launch_on_ray(COUNTDOWN, stage_secret_key=5)  # type: ignore[arg-type]
    assert no_actor_left()


def test_a_pool_on_ray_with_your_own_keys_and_forwarded_logs(
    own_keys: OwnKeys, test_records: Records
) -> None:
    with StagePool.launch_on_ray(
        SCRIPTED,
        {"log": "replica built"},
        replicas=1,
        placement=SMALL,
        curve=own_keys.client,
        stage_secret_key=own_keys.stage_secret,
        authorized_clients=[own_keys.observer_public],
        forward_logs=True,
        name="pool",
    ) as pool:
        assert test_records.wait_for("replica built").stage == "pool/r0"  # type: ignore[attr-defined]
        (replica,) = pool.replicas
        assert replica.address is not None
        with StageObserver(replica.address, curve=own_keys.observer) as observer:
            assert observer.stats(5).pid == replica.pid
        assert pool.add("r1", 2).collect() == [1, 0]
    assert no_actor_left()


def test_the_log_socket_of_a_stage_on_ray_admits_its_owner_only(
    own_keys: OwnKeys, test_records: Records
) -> None:
    """A listed client may drive the stage, but not read its logs: a second reader of the
    bound PUSH would take records from the owner's, and no rotation could cut it."""
    import zmq

    keys = own_keys
    with launch_on_ray(
        SCRIPTED,
        {"log": "built with logs"},
        placement=SMALL,
        curve=keys.client,
        stage_secret_key=keys.stage_secret,
        authorized_clients=[keys.observer_public],
        forward_logs=True,
    ) as client:
        assert test_records.wait_for("built with logs") is not None  # the owner reads them
        source = ray_stage(client).logs
        assert source is not None
        assert source.address is not None
        with StageObserver(client.address, curve=keys.observer) as observer:
            assert observer.stats(5).pid == ray_stage(client).process.pid  # a listed client
        ctx = zmq.Context()
        reader = ctx.socket(zmq.PULL)
        events = reader.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        )
        try:
            secure_client(reader, keys.observer)
            reader.connect(source.address)
            assert events.poll(10_000), "no handshake within 10 s"
            event = zmq.utils.monitor.recv_monitor_message(events)
            assert event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH, event
        finally:
            events.close(linger=0)
            reader.close(linger=0)
            ctx.term()
        assert list(client.add("r1", 2)) == [1, 0]
    assert no_actor_left()


# -- key rotation without a restart --------------------------------------------------------------


def test_the_keys_of_a_stage_on_ray_rotate_without_a_restart(
    ray_launch: Callable[..., StageClient], own_keys: OwnKeys
) -> None:
    """authorize_clients (the sync client) and authorize_clients_async (the asyncio
    client): the listed observer, connected before, is cut at once; a newly listed key gets
    in, a removed one does not; the client that placed the stage goes on."""
    keys = own_keys
    client = ray_launch(
        COUNTDOWN,
        placement=SMALL,
        curve=keys.client,
        stage_secret_key=keys.stage_secret,
        authorized_clients=[keys.observer_public],
    )
    with StageObserver(client.address, curve=keys.observer) as before:
        assert before.stats(5).outputs == 0  # listed at the start
        new = [keys.mallory.public_key.decode()]  # str or bytes
        runner = getattr(client, "_runner", None)
        if runner is None:
            assert authorize_clients(client, new) == 1
        else:
            assert runner.run(authorize_clients_async(client._client, new)) == 1  # type: ignore[attr-defined]
        with pytest.raises(AuthenticationError, match="no longer authorizes this client's CURVE"):
            before.stats(5)  # connected before the rotation: cut
    with StageObserver(client.address, curve=keys.mallory) as newcomer:
        assert newcomer.stats(5).outputs == 0  # listed now
    with (
        StageObserver(client.address, curve=keys.observer) as removed,
        pytest.raises(AuthenticationError, match="not among"),
    ):
        removed.stats(5)
    assert list(client.add("r1", 2)) == [1, 0]  # the owner is always admitted
    with pytest.raises(ValueError, match="authorized client key"):
        authorize_clients(client, ["short"])
    client.close()
    assert no_actor_left()


def test_a_key_rotation_of_a_gone_stage_says_why(
    ray_launch: Callable[..., StageClient], own_keys: OwnKeys
) -> None:
    """A stage whose actor died, or whose client is closed, has no keys to rotate: the
    client's own errors, not Ray's ``ActorDiedError`` (the same for a closed pool, which
    returned 0 as if it had no replica to change)."""
    client = ray_launch(SCRIPTED, placement=SMALL)
    new = [own_keys.observer_public]
    runner = getattr(client, "_runner", None)

    def rotate() -> int:
        if runner is None:
            return authorize_clients(client, new)
        return runner.run(authorize_clients_async(client._client, new))  # type: ignore[no-any-return,attr-defined]

    pending = client.call_utility_future("deferred_never")
    ray.kill(actor_of(client))
    with pytest.raises(EngineDeadError):
        pending.result(5)  # the client has heard of the death
    with pytest.raises(EngineDeadError, match="on Ray has ended: its Ray actor died"):
        rotate()
    client.close()
    with pytest.raises(StageClosedError, match="client is closed"):
        rotate()
    pool = StagePool.launch_on_ray(COUNTDOWN, replicas=1, placement=SMALL)
    pool.close()
    with pytest.raises(StageClosedError, match="pool is closed"):
        authorize_clients(pool, new)
    assert no_actor_left()


def test_a_key_rotation_of_a_stage_that_does_not_answer_fails_after_its_timeout(
    ray_launch: Callable[..., StageClient],
) -> None:
    """The actor does not answer (its process stopped): Ray's ``GetTimeoutError`` past
    *timeout* (``TimeoutError`` for the async variant), waited for on the answer's future
    (no ``ray.get``, which a ``ray.shutdown()`` does not always end)."""
    client = ray_launch(SCRIPTED, placement=SMALL, heartbeat_timeout=60)
    runner = getattr(client, "_runner", None)

    def rotate() -> int:
        if runner is None:
            return authorize_clients(client, [], timeout=0.5)
        return runner.run(authorize_clients_async(client._client, [], timeout=0.5))  # type: ignore[no-any-return,attr-defined]

    os.kill(client.pid, signal.SIGSTOP)
    try:
        with pytest.raises(TimeoutError, match=r"took longer than 0\.5 s") as caught:
            rotate()
        if runner is None:
            assert isinstance(caught.value, ray.exceptions.GetTimeoutError)
    finally:
        os.kill(client.pid, signal.SIGCONT)
    client.close()
    assert no_actor_left()


def test_the_keys_of_a_pool_on_ray_rotate_for_its_replicas_and_their_restarts(
    own_keys: OwnKeys,
) -> None:
    keys = own_keys
    with StagePool.launch_on_ray(
        COUNTDOWN,
        replicas=1,
        placement=SMALL,
        curve=keys.client,
        stage_secret_key=keys.stage_secret,
        authorized_clients=[keys.observer_public],
    ) as pool:
        (replica,) = pool.replicas
        assert replica.address is not None
        assert authorize_clients(pool, [keys.mallory.public_key]) == 1
        with StageObserver(replica.address, curve=keys.mallory) as newcomer:
            assert newcomer.stats(5).outputs == 0
        with (
            StageObserver(replica.address, curve=keys.observer) as removed,
            pytest.raises(AuthenticationError, match="not among"),
        ):
            removed.stats(5)
        # A restart places the replica with the keys of the last rotation.
        assert member_plan(replica)[1].authorized_clients == (keys.mallory.public_key,)
        assert pool.add("r1", 2).collect() == [1, 0]
    with pytest.raises(TypeError, match="placed on Ray"):
        authorize_clients(object(), [keys.mallory.public_key])
    # Checked before any actor is called (before: a bare "'NoneType' object is not
    # iterable", an OverflowError, a rotation that "took longer than -1 s").
    with pytest.raises(TypeError, match="keys must be a sequence of public keys, got NoneType"):
        authorize_clients(pool, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="timeout must be a number of seconds > 0, got '5'"):
        authorize_clients(pool, [], timeout="5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout must be a number of seconds > 0, got -1"):
        asyncio.run(authorize_clients_async(pool, [], timeout=-1))
    with (
        StagePool.launch(COUNTDOWN, replicas=1) as local,  # rotated nothing, returned 0
        pytest.raises(TypeError, match="StagePool has no replica placed on Ray"),
    ):
        authorize_clients(local, [keys.mallory.public_key])
    assert no_actor_left()


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_rotation_during_a_restart_reaches_the_restarted_replica(
    own_keys: OwnKeys, tmp_path: Path, flavour: str
) -> None:
    """A rotation that lands while a replica's restart is being placed (with the keys
    before it) still reaches the restarted stage, before it serves: the removed key is
    refused and the new one admitted."""
    keys = own_keys
    gate = tmp_path / "gate"
    gate.mkdir()
    options: dict[str, Any] = {
        "replicas": 1,
        "placement": SMALL,
        "curve": keys.client,
        "stage_secret_key": keys.stage_secret,
        "authorized_clients": [keys.observer_public],
        "restart": RestartPolicy(first_delay=0.05),
    }
    gated = ("enginecore.stage.testing:gated_factory", {"directory": str(gate)})

    def starts() -> int:
        return len([f for f in os.listdir(gate) if f != "hold"])

    def check(pool: Any) -> None:
        (replica,) = pool.replicas
        assert replica.state is ReplicaState.SERVING
        assert replica.restarts == 1
        assert replica.address is not None
        with StageObserver(replica.address, curve=keys.mallory) as newcomer:
            assert newcomer.stats(5).pid == replica.pid  # listed by the rotation
        with (
            StageObserver(replica.address, curve=keys.observer) as removed,
            pytest.raises(AuthenticationError, match="not among"),
        ):
            removed.stats(5)

    def hold_a_restart(pool: Any) -> None:
        (replica,) = pool.replicas
        assert starts() == 1
        (gate / "hold").touch()
        ray.kill(actor_of(replica._client))

    if flavour == "sync":
        with StagePool.launch_on_ray(*gated, **options) as pool:
            hold_a_restart(pool)
            assert wait_until(lambda: starts() == 2, 30)  # the restart is in its factory
            assert authorize_clients(pool, [keys.mallory.public_key]) == 0  # none serves
            (gate / "hold").unlink()
            (replica,) = pool.replicas
            assert wait_until(lambda: replica.state is ReplicaState.SERVING, 30)
            check(pool)
            assert pool.add("r1", 2).collect() == [1, 0]
    else:
        from enginecore.stage import AsyncStagePool

        async def main() -> None:
            pool = await AsyncStagePool.launch_on_ray(*gated, **options)
            async with pool:
                hold_a_restart(pool)
                while starts() < 2:  # the restart is in its factory
                    await asyncio.sleep(0.01)
                assert await authorize_clients_async(pool, [keys.mallory.public_key]) == 0
                (gate / "hold").unlink()
                (replica,) = pool.replicas
                while replica.state is not ReplicaState.SERVING:
                    await asyncio.sleep(0.01)
                check(pool)  # blocks the event loop briefly: nothing else runs
                stream = await pool.add("r1", 2)
                assert [x async for x in stream] == [1, 0]

        asyncio.run(asyncio.wait_for(main(), 60))
    assert no_actor_left()


def test_a_restarted_stage_that_cannot_take_the_new_keys_is_killed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No stage is left admitting a removed key: one whose catch-up fails is killed (the
    pool then sees a death, and restarts it with the current keys), with a warning."""
    from enginecore.stage.ray import catch_up_keys, catch_up_keys_async

    class Refusing:
        def remote(self, keys: list[str]) -> Any:
            raise RuntimeError("the actor died")

    killed: list[str] = []
    stage = RayStage.__new__(RayStage)
    stage.actor = type("Actor", (), {"authorize": Refusing()})()
    stage.authorized_clients = (b"o" * 40,)
    stage.link_keys = ()
    stage.kill_and_clean = lambda: killed.append("killed")  # type: ignore[method-assign]
    member = type("Member", (), {"_launched": stage})()
    replica = type("Replica", (), {"name": "r0", "_authorized_clients": (b"m" * 40,)})()
    with caplog.at_level(logging.WARNING, "enginecore.stage"):
        catch_up_keys(replica, member)
        asyncio.run(catch_up_keys_async(replica, member))
    assert killed == ["killed", "killed"]
    assert caplog.text.count("replica r0 could not take the keys of a rotation") == 2
    replica._authorized_clients = stage.authorized_clients  # up to date: nothing to do
    catch_up_keys(replica, member)
    assert killed == ["killed", "killed"]


def test_the_keys_of_an_async_pool_on_ray_rotate(own_keys: OwnKeys) -> None:
    from enginecore.stage import AsyncStagePool

    keys = own_keys

    async def main() -> None:
        pool = await AsyncStagePool.launch_on_ray(
            COUNTDOWN,
            replicas=1,
            placement=SMALL,
            curve=keys.client,
            stage_secret_key=keys.stage_secret,
            authorized_clients=[keys.observer_public],
        )
        async with pool:
            (replica,) = pool.replicas
            assert replica.address is not None
            with StageObserver(replica.address, curve=keys.observer) as before:
                assert before.stats(5).outputs == 0
                assert await authorize_clients_async(pool, [keys.mallory.public_key]) == 1
                with pytest.raises(AuthenticationError, match="no longer authorizes"):
                    before.stats(5)  # blocks the event loop briefly: nothing else runs
            assert member_plan(replica)[1].authorized_clients == (keys.mallory.public_key,)
            stream = await pool.add("r1", 2)
            assert [x async for x in stream] == [1, 0]

    asyncio.run(main())
    assert no_actor_left()
