"""Pipeline stages placed on Ray (``PipelineStage(..., placement=RayPlacement(...))``,
``docs/pipelines.md``, "Stages on other hosts"), on a local Ray cluster this module starts
(2 CPUs, its own) and shuts down after its tests: the outputs, the CURVE link into a stage
on Ray, a stage's death, replica pools on Ray, no shared memory on such links, and no actor
left after a shutdown. Each behaviour the two pipelines share is checked on both."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from enginecore.stage import (
    CurveKeys,
    Pipeline,
    PipelineStage,
    PipelineStageDeadError,
    RestartPolicy,
    StageHealth,
    StageStartupError,
    _shm,
)
from enginecore.stage._edge import FIRST, LINKS_UTILITY, link_id
from enginecore.stage._launch import Launched
from enginecore.stage._pipelinebase import pipe_kwargs

from .conftest import wait_until
from .pipelines import Launch, assert_death_contained, kill_in_barrier, launcher
from .raw import refused_handshake

ray = pytest.importorskip("ray", reason="the ray extra is not installed")

from enginecore.stage.ray import RayPlacement, RayStage, authorize_clients  # noqa: E402

# This module's own local cluster, as test_ray's (a module-scoped autouse fixture).
from .test_ray import CPUS, alive_stage_actors, ray_cluster  # noqa: E402, F401

COUNTDOWN = "enginecore:CountdownEngine"
RELAY = "enginecore.stage.testing:relay"
ECHO = "enginecore.stage.testing:echo"
DEVICE = "enginecore.stage.testing:device"
FAILING = "enginecore.stage.testing:failing_factory"
MIB = 2**20

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

# A small share of a CPU per stage: several stages fit on the 2 CPUs of the cluster.
SMALL = RayPlacement(num_cpus=0.25)


def no_actor_left() -> bool:
    """No stage's actor is alive: every CPU of the cluster is free again, and Ray's actor
    table (where readable) lists none."""
    return wait_until(
        lambda: ray.available_resources().get("CPU") == CPUS and alive_stage_actors() in (0, None),
        10.0,
    )


@pytest.fixture(params=["sync", "async"])
def launch(request: pytest.FixtureRequest, no_leftovers: str) -> Iterator[Launch]:
    """``launch(stages, **kwargs)``: either pipeline (``pipelines.launcher``); each is shut
    down after the test, and then no stage actor is left."""
    with launcher(request.param, startup_timeout=60) as launch_:
        yield launch_
    assert no_actor_left()


def ray_stage(pipe: Any, stage: str, replica: int = 0) -> RayStage:
    """The Ray stage behind *stage*'s client (of an AsyncPipeline's too)."""
    launched = pipe.client(stage, replica)._launched
    assert isinstance(launched, RayStage)
    return launched


def three(placed: str) -> list[PipelineStage]:
    """first -> mid -> last, with *placed* (``"mid"``, ``"last"``, ``"all"``) on Ray."""
    return [
        PipelineStage(
            COUNTDOWN if name == "first" else RELAY,
            name=name,
            placement=SMALL if placed in (name, "all") else None,
        )
        for name in ("first", "mid", "last")
    ]


class TestOutputs:
    @pytest.mark.parametrize("placed", ["mid", "last", "all"])
    def test_a_pipeline_with_stages_on_ray_gives_every_output(
        self, launch: Any, placed: str
    ) -> None:
        pipe = launch(three(placed))
        on_ray = ["first", "mid", "last"] if placed == "all" else [placed]
        for name in on_ray:
            stage = ray_stage(pipe, name)
            assert stage.curve is not None  # the coordinator's link is CURVE
            assert pipe.client(name).address.startswith("tcp://")
        if placed == "all":
            # Each stage on Ray admits the coordinator and the stage before's link key:
            # nothing else. The keys are the stages' own, not their server keys.
            for before, name in (("first", "mid"), ("mid", "last")):
                producer = ray_stage(pipe, before)
                assert producer.link_key is not None
                assert ray_stage(pipe, name).link_keys == (producer.link_key,)
                assert ray_stage(pipe, name).authorized_clients == ()
                assert producer.curve is not None
                assert producer.link_key != producer.curve.server_key
            assert ray_stage(pipe, "first").link_keys == ()
            assert ray_stage(pipe, "last").link_key is None  # it links nowhere
        assert pipe.add("r1", 3).collect(timeout=30) == [2, 1, 0]
        streams = pipe.add_many([(f"r{i}", 1 + i % 4) for i in range(100)])
        for i, stream in enumerate(streams):
            k = 1 + i % 4
            assert stream.collect(timeout=30) == list(range(k - 1, -1, -1))
        assert pipe.in_flight == 0
        assert pipe.call_utility("mid", "added") == 101

    def test_a_replica_pool_on_ray_serves_and_loses_only_a_dead_replica_s_requests(
        self, launch: Any
    ) -> None:
        pipe = launch(
            [
                PipelineStage(DEVICE, {"step_s": 0.005}, name="first"),
                PipelineStage(RELAY, name="mid", replicas=2, placement=SMALL),
                PipelineStage(RELAY, name="last"),
            ]
        )
        assert pipe.replicas == (1, 2, 1)
        assert pipe.add("warm", 2).collect(timeout=30) == [1, 0]
        streams = [pipe.add(f"r{i}", 10**6) for i in range(8)]
        for stream in streams:
            stream.get(timeout=30)  # each has reached the last stage, through a replica
        added = [pipe.call_utility("mid", "added", replica=r) for r in range(2)]
        assert sum(added) == 9, added
        assert min(added) >= 3, added  # both replicas serve
        ray.kill(ray_stage(pipe, "mid", 1).actor, no_restart=True)
        # The requests routed through replica 1 leave the pipeline; the others go on.
        assert wait_until(lambda: pipe.in_flight == 8 - added[1], 10), pipe.in_flight
        pipe.abort([f"r{i}" for i in range(8)])  # the survivors: aborted
        deaths: list[PipelineStageDeadError] = []
        aborted = 0
        for stream in streams:
            try:
                stream.collect(timeout=30)
            except PipelineStageDeadError as exc:
                deaths.append(exc)
            else:
                aborted += stream.aborted
        assert [(e.stage, e.replica) for e in deaths] == [("mid", 1)] * added[1]
        assert aborted == added[0] - 1  # less the warm-up request
        # New requests avoid the dead replica and get their outputs.
        assert pipe.add("later", 3).collect(timeout=30) == [2, 1, 0]

    def test_a_pool_on_ray_feeds_a_stage_on_ray_over_both_replicas_links(self, launch: Any) -> None:
        # The last stage admits both replicas' link keys: the second grant keeps the first.
        pipe = launch(
            [
                PipelineStage(COUNTDOWN, name="first"),
                PipelineStage(RELAY, name="mid", replicas=2, placement=SMALL),
                PipelineStage(RELAY, name="last", placement=SMALL),
            ]
        )
        streams = pipe.add_many([(f"r{i}", 1 + i % 3) for i in range(20)])
        for i, stream in enumerate(streams):
            assert stream.collect(timeout=30) == list(range(i % 3, -1, -1))
        assert pipe.call_utility("mid", "added") == [10, 10]
        assert pipe.call_utility("last", "added") == 20


class TestStartup:
    @pytest.mark.parametrize("failing", ["first", "mid"])
    def test_a_stage_that_fails_to_start_leaves_no_actor(self, launch: Any, failing: str) -> None:
        stages = [
            PipelineStage(FAILING if failing == "first" else COUNTDOWN, name="first"),
            PipelineStage(FAILING if failing == "mid" else RELAY, name="mid", placement=SMALL),
            PipelineStage(RELAY, name="last", placement=SMALL),
        ]
        # Named by its pipeline stage and factory, on Ray as locally (a stage on Ray was
        # "stage 'enginecore.stage._pipe_stage:pipe_stage'", the wrapper every stage runs).
        named = f"pipeline stage '{failing}' \\(factory '{FAILING}'\\)"
        with pytest.raises(StageStartupError, match=f"^{named}.*factory failed on purpose"):
            launch(stages)
        assert no_actor_left()


def local_curve(pipe: Any, stage: str) -> CurveKeys:
    """The coordinator's CURVE keys for a local stage that listens on TCP."""
    launched = pipe.client(stage)._launched
    assert isinstance(launched, Launched)
    assert launched.curve is not None
    return launched.curve


def test_a_stage_on_ray_on_another_host_feeds_a_local_stage_over_tcp(
    monkeypatch: pytest.MonkeyPatch, launch: Any
) -> None:
    # Ray tells the coordinator that this host is 127.0.0.2 (another address than the
    # actor's node, one machine here): the local stage after the stage on Ray listens
    # there, on TCP with CURVE, and the actor's link reaches it; the local stage after a
    # local one keeps ipc.
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.2")
    pipe = launch([*three("mid"), PipelineStage(RELAY, name="tail")])
    assert ray_stage(pipe, "mid").node_ip != "127.0.0.2"
    assert pipe.client("last").address.startswith("tcp://127.0.0.2:")
    assert local_curve(pipe, "last").server_key  # the coordinator's client is a CURVE one
    assert pipe.client("first").address.startswith("ipc://")
    assert pipe.client("tail").address.startswith("ipc://")
    assert pipe.add("r1", 3).collect(timeout=30) == [2, 1, 0]
    assert pipe.call_utility("last", "added") == 1


class TestCurveLinks:
    def test_a_peer_that_is_not_admitted_cannot_send_a_stage_on_ray_pipe_messages(
        self, launch: Any
    ) -> None:
        pipe = launch(three("mid"))
        assert pipe.add("r1", 2).collect(timeout=30) == [1, 0]
        stage = ray_stage(pipe, "mid")
        assert stage.curve is not None
        address = pipe.client("mid").address
        pipe_message = msgspec.msgpack.encode(["pipe", [FIRST], ["evil"], [5]])
        # A CURVE client with keys of its own, and the routing id of the real link.
        public, secret = zmq.curve_keypair()
        keys = (public, secret, stage.curve.server_key)
        refused_handshake(address, pipe_message, curve=keys, routing_id=link_id(0).encode())
        refused_handshake(address, pipe_message)  # a NULL client (no CURVE at all)
        # Nothing reached the stage: it added only the real request, and still serves.
        assert pipe.add("r2", 2).collect(timeout=30) == [1, 0]
        assert pipe.call_utility("mid", "added") == 2
        assert pipe.call_utility("last", "added") == 2

    def test_a_peer_that_is_not_admitted_cannot_send_a_local_stage_on_tcp_pipe_messages(
        self, launch: Any
    ) -> None:
        # The local stage after a stage on Ray listens on TCP: it admits the coordinator
        # and the link keys of the stage on Ray, nothing else.
        pipe = launch(three("mid"))
        assert pipe.add("r1", 2).collect(timeout=30) == [1, 0]
        address = pipe.client("last").address
        assert address.startswith("tcp://")
        pipe_message = msgspec.msgpack.encode(["pipe", [FIRST], ["evil"], [5]])
        public, secret = zmq.curve_keypair()
        keys = (public, secret, local_curve(pipe, "last").server_key)
        refused_handshake(address, pipe_message, curve=keys, routing_id=link_id(1).encode())
        refused_handshake(address, pipe_message)  # a NULL client (no CURVE at all)
        assert pipe.add("r2", 2).collect(timeout=30) == [1, 0]
        assert pipe.call_utility("last", "added") == 2

    def test_a_key_rotation_on_a_stage_of_the_pipeline_keeps_its_links(self, launch: Any) -> None:
        # authorize_clients on a pipeline's stage replaced every key it admitted, the link
        # keys of the stage before it too: the link was cut, and every later request hung.
        pipe = launch(three("all"))
        assert pipe.add("r1", 2).collect(timeout=30) == [1, 0]
        observer, _ = zmq.curve_keypair()
        for before, name in (("first", "mid"), ("mid", "last")):
            assert authorize_clients(pipe.client(name), [observer]) == 1
            stage = ray_stage(pipe, name)
            assert stage.authorized_clients == (observer,)
            assert stage.link_keys == (ray_stage(pipe, before).link_key,)
        assert pipe.add("r2", 2).collect(timeout=30) == [1, 0]
        assert pipe.call_utility("last", "added") == 2

    def test_the_links_around_a_stage_on_ray_use_no_shared_memory(self, launch: Any) -> None:
        pipe = launch(
            [
                PipelineStage(ECHO, name="a"),
                PipelineStage(RELAY, name="b", placement=SMALL),
                PipelineStage(RELAY, name="c"),
            ]
        )
        image = np.random.default_rng(0).random((512, 256))  # 1 MiB, above the threshold
        (back,) = pipe.add("r", image).collect(timeout=30)
        assert np.array_equal(back, image)
        stats = pipe.stats()
        assert "shm_sent" not in stats["a"].engine  # no pool of slots on a -> b
        assert "shm_sent" not in stats["b"].engine  # nor on b -> c
        assert _shm.segments(f"enginecore-{__import__('os').getpid()}-") == []


def test_pipe_kwargs_turn_shared_memory_off_on_a_link_with_an_end_on_ray() -> None:
    local = PipelineStage(RELAY, name="a")
    placed = PipelineStage(RELAY, name="b", placement=SMALL)
    out = pipe_kwargs(local, "ipc:///x", shm_prefix="p-", index=0, downstream_spec=placed)
    assert "shm_prefix" not in out
    inbound = pipe_kwargs(local, None, shm_prefix="p-", index=1, upstream=placed)
    assert "shm_upstream" not in inbound
    both_local = pipe_kwargs(local, "ipc:///x", shm_prefix="p-", index=0, downstream_spec=local)
    assert "shm_prefix" in both_local


class TestDeath:
    def test_a_killed_actor_fails_its_requests_naming_the_stage(self, launch: Any) -> None:
        pipe = launch(
            [
                PipelineStage(DEVICE, {"step_s": 0.005}, name="first"),
                PipelineStage(RELAY, name="mid", placement=SMALL),
                PipelineStage(RELAY, name="last"),
            ]
        )
        streams = [pipe.add(f"r{i}", 10**6) for i in range(10)]
        for stream in streams:
            stream.get(timeout=30)
        ray.kill(ray_stage(pipe, "mid").actor, no_restart=True)
        assert_death_contained(pipe, streams, "mid", "Ray actor", timeout=10)


def test_shutdown_leaves_no_actor(no_leftovers: str) -> None:
    pipe = Pipeline.launch(three("all"), startup_timeout=60)
    assert alive_stage_actors() in (3, None)
    assert pipe.add("r", 2).collect(timeout=30) == [1, 0]
    pipe.shutdown()
    assert no_actor_left()


def test_a_placement_is_checked_before_anything_starts() -> None:
    with pytest.raises(TypeError, match="placement must be a RayPlacement"):
        PipelineStage(RELAY, placement={"num_cpus": 1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_cpus"):
        PipelineStage(RELAY, placement=RayPlacement(num_cpus=-1))
    with pytest.raises(TypeError, match="one per replica"):
        PipelineStage(RELAY, replicas=2, placement=[SMALL, "x"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="1 placements for 2 replicas"):
        PipelineStage(RELAY, replicas=2, placement=[SMALL])
    stage = PipelineStage(RELAY, replicas=2, placement=[SMALL, RayPlacement(num_cpus=0.5)])
    assert stage.placement == (SMALL, RayPlacement(num_cpus=0.5))


FAST = RestartPolicy(first_delay=0.05, max_delay=0.05)


class TestRestart:
    @pytest.mark.parametrize(
        ("placed", "dies"),
        [
            ("mid", "mid"),
            ("all", "mid"),
            ("mid", "first"),
            ("first", "mid"),
            ("first", "first"),
            ("mid", "last"),
        ],
        ids=[
            "on-ray-between-local",
            "on-ray-between-ray",
            "local-before-ray",
            "local-after-ray",
            "on-ray-before-local",
            "local-last-after-ray",
        ],
    )
    def test_a_dead_process_on_or_next_to_ray_restarts_and_links_over_curve(
        self, launch: Any, placed: str, dies: str
    ) -> None:
        # A process on Ray comes back on Ray: the stage before it admitted before it links
        # (its `link` names the new CURVE server key), its own link key granted to a next
        # stage on Ray; a local process before a stage on Ray gets a new key pair, granted
        # first. A local process after a stage on Ray listens on TCP with CURVE: started
        # again, it admits the stage before's link keys from its start; a process on Ray
        # before it, started again, has its new link key admitted by it first. Each stage
        # on TCP admits only the coordinator and the keys of the stage before: the outputs
        # after the restart prove every link in was admitted.
        on_ray = {"first", "mid", "last"} if placed == "all" else {placed}
        pipe = launch(
            [
                PipelineStage(
                    DEVICE if name == "first" else RELAY,
                    {"step_s": 0.005} if name == "first" else None,
                    name=name,
                    placement=SMALL if name in on_ray else None,
                    restart=FAST if name == dies else False,
                )
                for name in ("first", "mid", "last")
            ]
        )
        streams = [pipe.add(f"r{i}", 10**6) for i in range(4)]
        for stream in streams:
            stream.get(timeout=30)
        if dies in on_ray:
            old = ray_stage(pipe, dies)
            ray.kill(old.actor, no_restart=True)
        else:
            os.kill(pipe.call_utility(dies, "pid"), signal.SIGKILL)
        for stream in streams:
            with pytest.raises(PipelineStageDeadError) as info:
                stream.collect(timeout=30)
            assert info.value.stage == dies
        assert wait_until(lambda: pipe.restarts[dies] == 1, 60)
        assert wait_until(lambda: set(pipe.health().values()) == {StageHealth.OK}, 30)
        if dies in on_ray:
            new = ray_stage(pipe, dies)
            assert new is not old
            assert new.curve is not None
            assert new.curve.server_key != old.curve.server_key  # type: ignore[union-attr]
            assert pipe.client(dies).address.startswith("tcp://")
        elif {"mid": "first", "last": "mid"}.get(dies) in on_ray:  # local after Ray: TCP
            assert pipe.client(dies).address.startswith("tcp://")
        else:  # local after a local stage (or first): ipc
            assert pipe.client(dies).address.startswith("ipc://")
        later = [pipe.add(f"later{i}", 3) for i in range(8)]
        assert [s.collect(timeout=30) for s in later] == [[2, 1, 0]] * 8
        assert pipe.in_flight == 0
        for name in ("first", "mid", "last"):  # no stage holds a request any more
            assert wait_until(lambda n=name: pipe.call_utility(n, "num_requests") == 0, 10)

    def test_a_restarted_process_on_ray_admits_only_the_stage_before_s_keys(
        self, launch: Any
    ) -> None:
        pipe = launch(
            [
                PipelineStage(COUNTDOWN, name="first", placement=SMALL),
                PipelineStage(RELAY, name="mid", placement=SMALL, restart=FAST),
                PipelineStage(RELAY, name="last", placement=SMALL),
            ]
        )
        first, old = ray_stage(pipe, "first"), ray_stage(pipe, "mid")
        ray.kill(old.actor, no_restart=True)
        assert wait_until(lambda: pipe.restarts["mid"] == 1, 60)
        assert wait_until(lambda: pipe.health()["mid"] == StageHealth.OK, 30)
        new = ray_stage(pipe, "mid")
        assert new.link_keys == (first.link_key,)
        # The last stage admits the new process's link key instead of the dead one's.
        assert new.link_key is not None
        assert new.link_key != old.link_key
        assert ray_stage(pipe, "last").link_keys == (new.link_key,)
        assert pipe.add("r", 3).collect(timeout=30) == [2, 1, 0]

    def test_a_local_stage_on_tcp_admits_a_restarted_producer_s_key_instead_of_the_dead_one_s(
        self, launch: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # What the coordinator asks the local stage after a stage on Ray to admit (besides
        # itself), over its launch pipe: the producer's link key before it starts, and at
        # its restart the new process's key alone.
        calls: list[tuple[Launched, list[bytes]]] = []
        authorize = Launched.authorize

        def record(self: Launched, keys: list[bytes], timeout: float = 30.0) -> int:
            calls.append((self, list(keys)))
            return authorize(self, keys, timeout)

        monkeypatch.setattr(Launched, "authorize", record)
        pipe = launch(
            [
                PipelineStage(COUNTDOWN, name="first", placement=SMALL, restart=FAST),
                PipelineStage(RELAY, name="mid"),
                PipelineStage(RELAY, name="last"),
            ]
        )
        mid = pipe.client("mid")._launched
        old = ray_stage(pipe, "first")
        assert old.link_key is not None
        assert calls == [(mid, [old.link_key])]
        ray.kill(old.actor, no_restart=True)
        assert wait_until(lambda: pipe.restarts["first"] == 1, 60)
        assert wait_until(lambda: pipe.health()["first"] == StageHealth.OK, 30)
        new = ray_stage(pipe, "first")
        assert new.link_key is not None
        assert new.link_key != old.link_key
        assert calls == [(mid, [old.link_key]), (mid, [new.link_key])]
        assert pipe.client("mid")._launched is mid  # the local stage went on
        assert pipe.add("r", 3).collect(timeout=30) == [2, 1, 0]

    @pytest.mark.parametrize("side", ["previous", "next"])
    def test_a_neighbour_on_ray_that_dies_while_a_process_on_ray_is_linked_in(
        self, launch: Any, side: str
    ) -> None:
        # test_pipeline_restart's TestNeighbourDiesWhileLinking, every stage on Ray: mid is
        # killed and started again; while its link barrier is in flight (the `link` sent
        # to first, its confirmation not in), a neighbour's process is killed. Both come
        # back on Ray, over new CURVE keys, the new mid is told of the death as the others
        # are, and requests go through.
        neighbour = "first" if side == "previous" else "last"
        pipe = launch(
            [
                PipelineStage(
                    DEVICE if name == "first" else RELAY,
                    {"step_s": 0.005} if name == "first" else None,
                    name=name,
                    placement=SMALL,
                    restart=FAST if name in ("mid", neighbour) else False,
                )
                for name in ("first", "mid", "last")
            ]
        )
        inner = getattr(pipe, "_pipe", pipe)  # the AsyncPipeline behind the adapter
        victim = pipe.call_utility(neighbour, "pid")
        killed = kill_in_barrier(inner, victim, (0 if side == "previous" else 2, 0))
        os.kill(pipe.call_utility("mid", "pid"), signal.SIGKILL)
        assert killed.wait(60)
        for name in ("mid", neighbour):
            assert wait_until(lambda n=name: pipe.restarts[n] == 1, 60), pipe.restarts
        assert wait_until(lambda: set(pipe.health().values()) == {StageHealth.OK}, 60)
        assert pipe.call_utility("mid", LINKS_UTILITY) == [True]  # linked to the live last
        assert [pipe.add(f"r{i}", 3).collect(timeout=30) for i in range(4)] == [[2, 1, 0]] * 4
        assert wait_until(lambda: pipe.in_flight == 0, 10)
        for name in ("first", "mid", "last"):
            assert wait_until(lambda n=name: pipe.call_utility(n, "num_requests") == 0, 10)


def test_a_placed_stage_does_not_import_ray_until_the_launch() -> None:
    code = (
        "import sys\n"
        "from enginecore.stage import PipelineStage\n"
        "from enginecore.stage.ray import RayPlacement\n"
        "PipelineStage('m:f', placement=RayPlacement(num_cpus=0.5))\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
