"""Stage pipelines (``docs/pipelines.md``): real stage processes, data sent stage to stage.

Every test launches a :class:`~enginecore.stage.Pipeline` of real stages, and again an
:class:`~enginecore.stage.AsyncPipeline` (``[sync]``, ``[async]``: one suite for both).
The conftest's autouse fixture checks that no process and no socket file is left behind.
The coordinator's rules alone are checked against a model in ``test_pipeline_model.py``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib.util
import logging
import os
import pathlib
import random
import signal
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

import msgspec
import numpy as np
import pytest
import zmq

from enginecore import CountdownEngine, RequestRejected
from enginecore.stage import (
    NOTHING,
    AsyncPipeline,
    Pipeline,
    PipelineFullError,
    PipelineRequestError,
    PipelineStage,
    PipelineStageDeadError,
    Retry,
    StageClient,
    StageClosedError,
    StageStartupError,
    StageStatistics,
    _shm,
)
from enginecore.stage._edge import BEFORE, END, ENDED, FIRST, MORE, ONLY, REPORT, SENT_ON, link_id
from enginecore.stage._pipe_stage import CREDIT_DELAY_S, PipeStage, payload_size
from enginecore.stage._pipeline_core import PipelineCore
from enginecore.stage._pipelinebase import (
    DEFAULT_WINDOW,
    DEFAULT_WINDOW_BYTES,
    PIPE_FACTORY,
    PipelineBase,
    pipe_kwargs,
)
from enginecore.stage._session import ClientSession
from enginecore.stage._wire import ErrorReport
from enginecore.stage.testing import HeadEngine, RelayEngine

from .conftest import child_pids, settled_engine, wait_until
from .pipelines import BlockingAsyncPipeline, Launch, assert_death_contained, launcher
from .raw import in_process_stage

COUNTDOWN = "enginecore:CountdownEngine"
RELAY = "enginecore.stage.testing:relay"
ECHO = "enginecore.stage.testing:echo"
DEVICE = "enginecore.stage.testing:device"
FLAKY = "enginecore.stage.testing:flaky"
T = "enginecore.stage.testing"

pytestmark = pytest.mark.slow


@pytest.fixture(params=["sync", "async"])
def launch(request: pytest.FixtureRequest, no_leftovers: str) -> Iterator[Launch]:
    """``launch(stages, **kwargs)``: either pipeline (``pipelines.launcher``); each is shut
    down after the test."""
    with launcher(request.param) as launch_:
        yield launch_


def _wait_live(pipe: Pipeline, stage: str, n: int) -> None:
    """Until *n* requests are live in the relay stage *stage* (its utility says so)."""
    assert wait_until(lambda: pipe.call_utility(stage, "num_requests") == n, 10)


@contextlib.contextmanager
def _next_processes(
    n: int = 2, links: int = 1, **kwargs: Any
) -> Iterator[tuple[PipeStage, list[zmq.Socket[Any]], list[str]]]:
    """A routed :class:`PipeStage` around a ``CountdownEngine``, with *n* ``ROUTER``
    sockets on TCP for the next stage's processes (``routers``, at ``addresses``): its
    *links* links go to the first ones (unless *kwargs* name ``downstream``), the others
    stand for processes started in their place (:meth:`PipeStage.pipe_link`). All closed
    after."""
    ctx = zmq.Context()
    routers: list[zmq.Socket[Any]] = []
    addresses: list[str] = []
    try:
        for _ in range(n):
            router = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            routers.append(router)
            addresses.append(f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}")
        kwargs.setdefault("downstream", addresses[:links])
        stage = PipeStage(CountdownEngine(), stage="s", routed=True, **kwargs)
        try:
            yield stage, routers, addresses
        finally:
            for link in stage._links:
                if link is not None:
                    link.close(linger=0)
    finally:
        for router in routers:
            router.close()
        ctx.term()


def _received(router: zmq.Socket[Any], arrays: bool = False) -> Any:
    """The next message on *router* (a next stage's process), decoded: one frame, or with
    *arrays*, any number of frames after it (arrays out of band)."""
    assert router.poll(5000)
    if arrays:
        _ident, body, *_frames = router.recv_multipart()
    else:
        _ident, body = router.recv_multipart()
    return msgspec.msgpack.decode(body)


def _step_while_room(stage: PipeStage, most: int = 20) -> int:
    """Step *stage* as the loop does, while ``has_work()`` says so (at most *most*
    times): how many steps it took."""
    for n in range(most):
        if not stage.has_work():
            return n
        stage.route_outputs(stage.step())
    return most


def _held_counts_hold(stage: PipeStage) -> bool:
    """The held counters per link equal what is held (recomputed: data items, not aborts,
    their payload sizes, and the requests whose first item is held)."""
    for index in range(len(stage._links)):
        held = [h for h in stage._holding.get(index, []) if h[0] >= 0]
        if stage._held_items[index] != len(held):
            return False
        if stage._held_firsts.get(index, set()) != {h[1] for h in held if h[0] & FIRST}:
            return False
        if stage._held_bytes[index] != sum(payload_size(h[2]) for h in held):
            return False
    return True


class TestDataFlow:
    def test_each_output_goes_to_the_next_stage_and_the_last_stage_to_the_caller(
        self, launch: Any
    ) -> None:
        pipe = launch([COUNTDOWN, RELAY, RELAY])
        assert pipe.stages == (COUNTDOWN, f"{RELAY}[1]", f"{RELAY}[2]")
        stream = pipe.add("r1", 3)
        assert stream.collect(timeout=10) == [2, 1, 0]
        assert stream.finished
        assert pipe.in_flight == 0
        # The id is free again once the request is over in every stage.
        assert pipe.add("r1", 2).collect(timeout=10) == [1, 0]

    def test_an_engine_without_feed_gets_one_list_when_the_previous_stage_ends(
        self, launch: Any
    ) -> None:
        pipe = launch([COUNTDOWN, ECHO])
        assert pipe.add("r", 3).collect(timeout=10) == [[2, 1, 0]]

    def test_a_burst_reaches_the_end_with_every_output_once(self, launch: Any) -> None:
        pipe = launch([COUNTDOWN, RELAY, RELAY])
        streams = pipe.add_many([(f"r{i}", 1 + i % 5) for i in range(300)])
        for i, stream in enumerate(streams):
            k = 1 + i % 5
            assert stream.collect(timeout=30) == list(range(k - 1, -1, -1))
        assert pipe.in_flight == 0

    def test_a_streaming_stage_takes_input_while_the_previous_stage_still_runs(
        self, launch: Any
    ) -> None:
        pipe = launch([PipelineStage(DEVICE, {"step_s": 0.02}, name="slow"), RELAY])
        stream = pipe.add("r", 200)
        assert stream.get(timeout=10) == 199  # out of the last stage...
        assert pipe.call_utility("slow", "num_requests") == 1  # ...while the first still runs
        pipe.abort(["r"])
        stream.collect(timeout=10)
        assert stream.aborted

    def test_the_link_carries_pipe_items_and_chased_aborts_in_order(self) -> None:
        # One PipeStage in this process, its link connected to a plain ROUTER: what goes on
        # to the next stage, and what the coordinator is told, step by step.
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        stage = PipeStage(CountdownEngine(), stage="s", downstream=f"tcp://127.0.0.1:{port}")
        try:

            def received() -> Any:
                assert router.poll(5000)
                _ident, body = router.recv_multipart()
                return msgspec.msgpack.decode(body)

            stage.add("a", 1)
            stage.add("b", 2)
            # Step 1: a's one output goes on as one ONLY item (first and last), and a ends
            # here having sent it on: no report to the coordinator (the next stage's end
            # report covers this one), but the runtime takes it out of its live requests;
            # b's first output goes on as FIRST.
            assert stage.step() == []
            assert stage.take_ended() == ["a"]
            assert received() == ["pipe", [ONLY, FIRST], ["a", "b"], [0, 1]]
            # Step 2: b's last output goes on as MORE, then its END.
            assert stage.step() == []
            assert stage.take_ended() == ["b"]
            assert stage.take_ended() == []
            assert received() == ["pipe", [MORE, END], ["b", "b"], [0, None]]
            # An abort goes on after the data, whether or not this stage knew the ids.
            stage.add("c", 5)
            stage.step()
            stage.abort(["c", "unknown"])  # an abort of the stage's own: no chase
            stage.chase_abort(["c", "unknown"])  # an abort message: chases
            assert received() == ["pipe", [FIRST], ["c"], [4]]
            assert received() == ["abort", ["c", "unknown"]]
            assert not stage.has_work()
        finally:
            assert stage._links[0] is not None
            stage._links[0].close(linger=0)
            router.close()
            ctx.term()

    def test_a_fence_is_flagged_on_the_link_and_in_its_aborted(self, no_leftovers: str) -> None:
        # docs/wire.md section 8: the replay's fence goes down the link as
        # ["abort", ids, nil, true]; a stage that applies a flagged abort answers
        # ["aborted", ids, true] and chases it on flagged. An unflagged abort: as before.
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        stage = PipeStage(
            CountdownEngine(),
            stage="s",
            downstream=f"tcp://127.0.0.1:{port}",
            replay_bytes=1 << 20,
        )

        def received() -> Any:
            assert router.poll(5000)
            _ident, body = router.recv_multipart()
            return msgspec.msgpack.decode(body)

        def items() -> list[Any]:  # the pipe items that arrive next, up to an END
            got: list[Any] = []
            while not got or not got[-1][0] & END:
                msg = received()
                assert msg[0] == "pipe", msg
                got += zip(msg[1], msg[2], msg[3], strict=True)
            return got

        try:
            with in_process_stage(cast(Any, stage), no_leftovers) as (_, client):
                client.send("add", "a", 2)
                assert items() == [(FIRST, "a", 1), (MORE, "a", 0), (END, "a", None)]
                client.send("replay", "a", 1)  # the fence, flagged; then the log again
                assert received() == ["abort", ["a"], None, True]
                assert items() == [(FIRST, "a", 1), (MORE, "a", 0), (END, "a", None)]
                replayed = client.until(lambda ev: ev[0] == "replayed")
                assert replayed[-1] == ["replayed", "a", 1, True, ""]
                client.send("abort", ["b"], None, True)  # a fence from the previous stage
                assert client.until(lambda ev: ev[0] == "aborted")[-1] == ["aborted", ["b"], True]
                assert received() == ["abort", ["b"], None, True]  # chased on, flagged
                client.send("abort", ["b"])  # an ordinary abort (or an older sender's fence)
                assert client.until(lambda ev: ev[0] == "aborted")[-1] == ["aborted", ["b"]]
                assert received() == ["abort", ["b"]]
        finally:
            assert stage._links[0] is not None
            stage._links[0].close(linger=0)
            router.close()
            ctx.term()

    def test_end_reports_where_a_request_stops_and_before_its_input_ended(self) -> None:
        # A middle stage (HeadEngine(1): it ends a request at its first input) linked to a
        # plain ROUTER: its end report, its END's REPORT bit, and its report once the
        # previous stage's END reaches it.
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        emitted: list[Any] = []
        stage = PipeStage(HeadEngine(1), stage="s", downstream=f"tcp://127.0.0.1:{port}")
        stage.attach_emit(emitted.append)
        try:
            stage.pipe_input(FIRST, "r", "x")  # its input is still open
            stage.pipe_input(ONLY, "q", "y")  # its input is complete
            assert stage.step() == ["r"]
            # r ended before its input did: reported (ENDED, SENT_ON), and its END says
            # REPORT; q went on as usual: no report.
            assert stage.route_outputs(["r"]) == (["r"], [True], [ENDED | SENT_ON])
            assert stage.take_ended() == ["q"]
            assert router.poll(5000)
            _ident, body = router.recv_multipart()
            assert msgspec.msgpack.decode(body) == [
                "pipe",
                [ONLY | REPORT, ONLY],
                ["r", "q"],
                ["x", "y"],
            ]
            assert emitted == []
            stage.pipe_late("q", END)  # not one that ended early: nothing
            stage.pipe_late("r", END)  # the previous stage's END: every stage before it
            stage.pipe_late("r", END)  # once
            assert emitted == [("outputs", ["r"], [True], [BEFORE])]
        finally:
            assert stage._links[0] is not None
            stage._links[0].close(linger=0)
            router.close()
            ctx.term()
        # The next stage, told REPORT, reports its own end only.
        last = PipeStage(RelayEngine(), stage="t")
        last.pipe_input(ONLY | REPORT, "r", "x")
        assert last.step() == ["r", "r"]
        assert last.route_outputs(["r"]) == (["r", "r"], [False, True], ["x", ENDED])

    def test_what_ended_early_waits_no_more_for_an_end_from_a_gone_previous_process(
        self,
    ) -> None:
        # The last stage ends a and b at their first input, before their input ended: each
        # waits for its END from the previous stage (a pool: a from replica 1, b from 0).
        # Replica 1 dies: its END of a may have been among the messages the input side
        # drops after the gone, and a may be over for the coordinator already (the previous
        # stage reported its own end), so no abort comes to clear it either. It waits no
        # more: a late END of a is dropped; b's END still counts.
        emitted: list[Any] = []
        stage = PipeStage(HeadEngine(1), stage="t", routed=True)
        stage.attach_emit(emitted.append)
        stage.pipe_received(1, 10, 1)
        stage.pipe_input(FIRST, "a", "x")
        stage.pipe_received(1, 10, 0)
        stage.pipe_input(FIRST, "b", "y")
        stage.route_outputs(stage.step())  # both end here, before their input did
        stage.pipe_gone("previous", 1, 1)  # a late message dropped: not the gone itself
        stage.pipe_gone("previous", 0, 1)
        stage.pipe_late("a", END)
        stage.pipe_late("b", END)
        assert emitted == [("outputs", ["b"], [True], [BEFORE])]

    def test_a_gone_previous_process_clears_only_what_its_generation_sent(self) -> None:
        # docs/wire.md section 8, "Restarts": process 0 of the previous stage died and was
        # started again (generation 1). A stage frozen through the restart reads the queued
        # messages of both, and the gone of the dead one, in any order: here a (from the
        # dead one), b (from the new one), c (a late message of the dead one), then the
        # gone of generation 0. It clears what generation 0 sent (a's and c's wait for
        # their END, the credit owed to it); b still gets its BEFORE report when its END
        # comes, and the credit owed to generation 1 goes back to replica 0, refilling the
        # new process's window. No credit for the late c either: it would go to replica 0,
        # the new process, whose window never held it.
        emitted: list[Any] = []
        stage = PipeStage(HeadEngine(1), stage="t", routed=True)
        stage.attach_emit(emitted.append)
        stage.pipe_received(1, 10, 0, 0)
        stage.pipe_input(FIRST, "a", "x")
        stage.pipe_received(1, 20, 0, 1)
        stage.pipe_input(FIRST, "b", "y")
        stage.pipe_received(1, 40, 0, 0)
        stage.pipe_input(FIRST, "c", "z")
        stage.route_outputs(stage.step())  # all three end here, before their input did
        stage.pipe_gone("previous", 0, 0, 0)
        assert stage.take_credit(force=True) == ("credit", 1, 20, [[0, 1, 20]])
        for rid in ("a", "b", "c"):
            stage.pipe_late(rid, END)
        assert emitted == [("outputs", ["b"], [True], [BEFORE])]
        # The gone of a process whose successor sent nothing yet still clears its credit
        # and its early ends; a gone that names no generation (a link without a replica)
        # clears every generation's.
        stage.pipe_received(1, 10, 2, 0)
        stage.pipe_input(FIRST, "d", "w")
        stage.route_outputs(stage.step())
        stage.pipe_gone("previous", 0, 2, 0)
        assert stage.take_credit(force=True) is None
        stage.pipe_received(1, 10, 0, 1)
        stage.pipe_input(FIRST, "e", "v")
        stage.route_outputs(stage.step())
        stage.pipe_gone("previous", 0, 0)
        assert stage.take_credit(force=True) is None
        stage.pipe_late("d", END)
        stage.pipe_late("e", END)
        assert emitted == [("outputs", ["b"], [True], [BEFORE])]

    def test_what_goes_to_a_gone_process_of_a_restarting_stage_waits_for_its_link(self) -> None:
        # docs/wire.md section 8, "Restarts": process 0 of the next stage died (gone) and
        # one is started in its place (next_restarts). A request routed to the new process
        # whose data this stage applies before the link (the data comes on another
        # connection than the link) is held, in order, its END and later items too, and
        # goes down the new link first, before anything newer; one aborted meanwhile
        # (here b) leaves nothing to send. Held items are not in flight until sent, but
        # count against the window meanwhile.
        with _next_processes(window=4, next_restarts=True) as (stage, (old, new), addresses):
            stage.pipe_gone("next", 0, 0)
            stage.pipe_route(["a", "b"], [[0, 5], [0, 6]], abort=False)
            stage.add("a", 3)  # 2, 1, 0
            stage.add("b", 2)  # 1, 0
            stage.route_outputs(stage.step())  # a: FIRST 2; b: FIRST 1
            stage.route_outputs(stage.step())  # a: MORE 1; b: MORE 0, END
            assert stage.take_ended() == ["b"]
            stats = stage.stats()
            assert (stats["edge_held"], stats["edge_in_flight"], stats["edge_dropped"]) == (5, 0, 0)
            assert not stage.has_work()  # held items count against the window (4)
            stage.abort(["b"])  # its abort, applied here: its held items go
            stats = stage.stats()
            assert (stats["edge_held"], stats["edge_dropped"]) == (2, 3)
            assert stage.has_work()  # room again
            stage.pipe_link(0, addresses[1], "")
            assert stage.stats()["edge_in_flight"] == 2  # sent now: in flight now
            stage.route_outputs(stage.step())  # a: MORE 0, END, after what was held
            assert _received(new) == ["pipe", [FIRST, MORE], ["a", "a"], [2, 1], {"a": [5]}, 0]
            assert _received(new) == ["pipe", [MORE, END], ["a", "a"], [0, None], {}, 0]
            assert not new.poll(100)
            assert not old.poll(0)
            stats = stage.stats()
            assert (stats["edge_in_flight"], stats["edge_sent"]) == (4, 4)
            assert stats["edge_held"] == 0
            # e's first item went to the process that dies next; its later items are
            # dropped, not held (of no use to the new process: they would take room in the
            # window until a link that may never come). An id freed and added again while
            # the old request's END is held: the old one is over, its held END goes; and
            # so do the held items of a request released (done).
            stage.pipe_route(["e"], [[0]], abort=False)
            stage.add("e", 2)  # 1, 0
            stage.route_outputs(stage.step())
            assert _received(new) == ["pipe", [FIRST], ["e"], [1], {"e": []}, 0]
            stage.pipe_gone("next", 0, 0)
            stage.pipe_route(["c", "d"], [[0], [0]], abort=False)
            stage.add("c", 1)
            stage.add("d", 1)
            stage.route_outputs(stage.step())  # c: ONLY 0; d: ONLY 0; e: MORE 0, END
            stats = stage.stats()
            assert (stats["edge_held"], stats["edge_dropped"]) == (2, 5)
            stage.pipe_route(["c"], [[0]], abort=False)
            stage.add("c", 2)  # the id again
            stage.pipe_release(["d"])
            stats = stage.stats()
            assert (stats["edge_held"], stats["edge_dropped"]) == (0, 7)
            stage.route_outputs(stage.step())  # c (the new one): FIRST 1
            stage.pipe_link(0, addresses[1], "")
            assert _received(new) == ["pipe", [FIRST], ["c"], [1], {"c": []}, 0]
            assert not new.poll(100)
            assert stage.stats()["edge_dropped"] == 7

    def test_routes_that_name_generations_tell_a_restarted_process_from_the_dead_one(
        self,
    ) -> None:
        # docs/wire.md section 8, "Restarts": a route names each process of a stage that
        # restarts as [replica, generation], and a link the new process's generation.
        # Process 0 of the next stage (generation 0) died and generation 1 is routed to
        # before this stage has even applied the gone (its loop held up: the data comes on
        # another connection). The data of a request routed to generation 1 is held, not
        # sent down the old link (to the dead process: lost); an abort of such a request,
        # applied before the link, is held in order (its data goes with it) and chased
        # down the new link after what was held before it; what is meant for generation 0
        # is dropped once that process is known gone (or once generation 1 is linked), and
        # its abort is chased no further.
        with _next_processes(window=8, next_restarts=True, next_generations=[0]) as (
            stage,
            (old, new),
            addresses,
        ):
            stage.pipe_route(
                ["z", "a", "b"], [[[0, 0]], [[0, 1], [1, 4]], [[0, 1], 6]], abort=False
            )
            stage.add("z", 1)  # ONLY 0, to generation 0: the link's
            stage.add("a", 2)  # 1, 0
            stage.add("b", 2)  # 1, 0
            stage.route_outputs(stage.step())  # z: ONLY 0; a: FIRST 1; b: FIRST 1
            assert _received(old) == ["pipe", [ONLY], ["z"], [0], {"z": []}, 0]
            stats = stage.stats()
            assert (stats["edge_held"], stats["edge_in_flight"]) == (2, 1)
            assert "edge_dropped" not in stats  # none yet
            # b's abort, applied here before the link: its held data goes, the abort is
            # held (the coordinator waits for generation 1's answer), after a's FIRST.
            stage.pipe_route(["b"], [[[0, 1], [1, 5]]], abort=True)
            stage.abort(["b"])
            stage.chase_abort(["b"])
            stats = stage.stats()
            assert (stats["edge_held"], stats["edge_dropped"]) == (1, 1)
            stage.route_outputs(stage.step())  # a: MORE 0, END
            assert not old.poll(100)  # nothing of a or b down the old link
            stage.pipe_gone("next", 0, 0)  # the dead process's gone, late
            stage.pipe_route(["d"], [[[0, 0]]], abort=False)
            stage.add("d", 1)
            stage.route_outputs(stage.step())  # d: ONLY 0, for the dead process: held
            stats = stage.stats()  # (until the link says which generation comes)
            assert (stats["edge_held"], stats["edge_dropped"]) == (4, 1)
            stage.pipe_link(0, addresses[1], "", "", 1)
            assert _received(new) == ["pipe", [FIRST], ["a"], [1], {"a": [[1, 4]]}, 0]
            assert _received(new) == ["abort", ["b"], [[[1, 5]]]]
            assert _received(new) == ["pipe", [MORE, END], ["a", "a"], [0, None], {}, 0]
            assert not new.poll(100)
            stats = stage.stats()
            assert (stats["edge_held"], stats["edge_dropped"]) == (0, 2)  # d: dropped
            # After the link: data routed to generation 0 (its process died) is dropped,
            # and an abort routed there goes no further (as -1); generation 1's go on.
            stage.pipe_route(["e", "c"], [[[0, 0]], [[0, 1]]], abort=False)
            stage.add("e", 1)
            stage.add("c", 1)
            stage.route_outputs(stage.step())  # e: dropped; c: ONLY 0
            assert _received(new) == ["pipe", [ONLY], ["c"], [0], {"c": []}, 0]
            assert stage.stats()["edge_dropped"] == 3
            stage.pipe_route(["f", "g"], [[[0, 0]], [[0, 1]]], abort=True)
            stage.abort(["f", "g"])
            stage.chase_abort(["f", "g"])
            assert _received(new) == ["abort", ["g"], [[]]]
            assert not new.poll(100)
            assert not old.poll(0)

    def test_what_is_meant_for_a_gone_link_s_own_generation_waits_for_the_next_link(
        self,
    ) -> None:
        # A link that is gone, to a process of the generation a request's route names: the
        # items are held for the next link, sent if it is of that generation (a stage
        # started with a link to a dead process, told its successor's generation at its
        # launch), dropped if it is of a newer one (that process died).
        with _next_processes(next_restarts=True, next_generations=[1]) as (
            stage,
            (old, new),
            addresses,
        ):
            stage.pipe_gone("next", 0, 0)
            stage.pipe_route(["a"], [[[0, 1]]], abort=False)
            stage.add("a", 1)
            stage.route_outputs(stage.step())  # a: ONLY 0, held
            stage.pipe_route(["b"], [[[0, 1]]], abort=True)
            stage.abort(["b"])
            stage.chase_abort(["b"])  # held too
            assert stage.stats()["edge_held"] == 1
            stage.pipe_link(0, addresses[1], "", "", 1)
            assert new.poll(5000)
            assert msgspec.msgpack.decode(new.recv_multipart()[1]) == [
                "pipe",
                [ONLY],
                ["a"],
                [0],
                {"a": []},
                0,
            ]
            assert new.poll(5000)
            assert msgspec.msgpack.decode(new.recv_multipart()[1]) == ["abort", ["b"], [[]]]
            stage.pipe_gone("next", 0, 0)
            stage.pipe_route(["c"], [[[0, 1]]], abort=False)
            stage.add("c", 1)
            stage.route_outputs(stage.step())  # c: held, for generation 1, which died
            stage.pipe_link(0, addresses[0], "", "", 2)
            assert not old.poll(200)
            assert not new.poll(0)
            stats = stage.stats()
            assert (stats["edge_held"], stats["edge_dropped"]) == (0, 1)

    def test_a_fence_held_for_a_restarted_process_goes_before_the_replay_it_fences(
        self,
    ) -> None:
        # A replay's fence for a request routed to generation 1, applied here before the
        # link, then the request's items again (from the stage before): the fence is held
        # and the items after it, and both go down the new link in that order. A tagged
        # abort keeps its tag.
        with _next_processes(next_restarts=True, next_generations=[0]) as (
            stage,
            (old, new),
            addresses,
        ):
            stage.pipe_route(["a"], [[[0, 1]]], abort=False)
            stage.add("a", 1)
            stage.route_outputs(stage.step())  # a: ONLY 0, held
            stage.pipe_route(["a"], [[[0, 1]]], abort=True)
            stage.abort(["a"])
            stage.chase_abort(["a"], True)  # the fence
            stage.pipe_route(["a"], [[[0, 1]]], abort=False)
            stage.add("a", 1)  # the replay's items (here: the request again)
            stage.route_outputs(stage.step())
            stage.pipe_route(["t"], [[[0, 1]]], abort=True)
            stage.abort(["t"])
            stage.chase_abort(["t"], False, 9)
            assert not old.poll(100)
            stage.pipe_link(0, addresses[1], "", "", 1)
            assert _received(new) == ["abort", ["a"], [[]], True]
            assert _received(new) == ["pipe", [ONLY], ["a"], [0], {"a": []}, 0]
            assert _received(new) == ["abort", ["t"], [[]], False, 9]
            assert not new.poll(100)

    def test_a_window_full_of_held_data_holds_the_steps_back(self) -> None:
        # What is held for a process of the next stage that restarts counts against its
        # link's window: a stage whose held data reaches the window waits (has_work False,
        # counted once in edge_waits), as for a full window, instead of holding without
        # bound while the new process starts.
        with _next_processes(window=4, next_restarts=True) as (stage, routers, _):
            stage.pipe_gone("next", 0, 0)
            stage.pipe_route(["a", "b"], [[0], [0]], abort=False)
            stage.add("a", 5)
            stage.add("b", 5)
            assert _step_while_room(stage) == 2  # 2 items a step: 4 held
            stats = stage.stats()
            assert (stats["edge_held"], stats["edge_in_flight"]) == (4, 0)
            assert stats["edge_waits"] == 1
            assert not stage.has_work()
            assert stage.stats()["edge_waits"] == 1  # the same wait
            assert _held_counts_hold(stage)
            assert not routers[0].poll(100)

    def test_held_data_sent_down_the_new_link_is_in_flight_until_credited(self) -> None:
        # The link comes: what was held goes down it, out of the hold and into the window
        # as in flight (its encoded size), so the stage still waits; the new process's
        # credit gives it back, and the stage steps again.
        with _next_processes(window=4, next_restarts=True) as (stage, routers, addresses):
            stage.pipe_gone("next", 0, 0)
            stage.pipe_route(["a", "b"], [[0], [0]], abort=False)
            stage.add("a", 5)
            stage.add("b", 5)
            assert _step_while_room(stage) == 2
            assert stage.stats()["edge_held_bytes"] == 4 * 8  # an int is 8
            stage.pipe_link(0, addresses[1], "")
            assert _received(routers[1]) == [
                "pipe",
                [FIRST, FIRST, MORE, MORE],
                ["a", "b", "a", "b"],
                [4, 4, 3, 3],
                {"a": [], "b": []},
                0,
            ]
            stats = stage.stats()
            assert (stats["edge_held"], stats["edge_held_bytes"]) == (0, 0)
            assert (stats["edge_in_flight"], stats["edge_sent"]) == (4, 4)
            sent_bytes = stats["edge_in_flight_bytes"]
            assert sent_bytes == stats["edge_sent_bytes"] > 0
            assert not stage.has_work()  # in flight now: the window is still full
            assert _held_counts_hold(stage)
            stage.pipe_credit(4, int(sent_bytes), 0)
            stats = stage.stats()
            assert (stats["edge_in_flight"], stats["edge_in_flight_bytes"]) == (0, 0)
            assert _step_while_room(stage) == 2  # 2 more a step, down the new link
            assert _received(routers[1])[1:4] == [[MORE, MORE], ["a", "b"], [2, 2]]
            assert stage.stats()["edge_in_flight"] == 4

    def test_a_dropped_request_s_held_data_frees_its_share_of_the_window(self) -> None:
        # Held data that is dropped (its request's abort, the release of a request done,
        # an id used again, or at the link: meant for a dead generation, or of a request
        # whose first item went to the dead process) leaves the window too.
        with _next_processes(window=4, next_restarts=True, next_generations=[0]) as (
            stage,
            routers,
            addresses,
        ):
            stage.pipe_gone("next", 0, 0)
            stage.pipe_route(["a", "b"], [[[0, 1]], [[0, 1]]], abort=False)
            stage.add("a", 5)
            stage.add("b", 5)
            assert _step_while_room(stage) == 2  # a, b: 2 each, held
            stage.abort(["a"])
            stats = stage.stats()
            assert (stats["edge_held"], stats["edge_dropped"]) == (2, 2)
            assert _held_counts_hold(stage)
            assert _step_while_room(stage) == 2  # b alone: 4 held again
            assert stage.stats()["edge_waits"] == 2
            # A request that ended here (c: ONLY 0), released (done in the pipeline).
            stage.abort(["b"])
            stage.pipe_route(["c"], [[[0, 1]]], abort=False)
            stage.add("c", 1)
            stage.route_outputs(stage.step())
            assert stage.stats()["edge_held"] == 1
            stage.pipe_release(["c"])
            assert stage.stats()["edge_held"] == 0
            # An id used again: the old request's held items go.
            stage.pipe_route(["d"], [[[0, 1]]], abort=False)
            stage.add("d", 1)
            stage.route_outputs(stage.step())
            stage.pipe_route(["d"], [[[0, 1]]], abort=False)
            stage.add("d", 5)
            assert stage.stats()["edge_held"] == 0
            assert _held_counts_hold(stage)
            # At the link: d's (generation 1) go, e's (generation 0: dead) are dropped,
            # f's (generation 2) stay held, counted.
            stage.pipe_route(["e", "f"], [[[0, 0]], [[0, 2]]], abort=False)
            stage.add("e", 5)
            stage.add("f", 5)
            assert _step_while_room(stage) == 2  # d, e, f: 2 each: 6 held
            stage.pipe_link(0, addresses[1], "", "", 1)
            assert _received(routers[1])[1:4] == [[FIRST, MORE], ["d", "d"], [4, 3]]
            stats = stage.stats()
            assert (stats["edge_held"], stats["edge_in_flight"]) == (2, 2)
            assert _held_counts_hold(stage)
            assert not stage.has_work()  # f's held and d's in flight fill it
            stage.pipe_credit(2, int(stats["edge_in_flight_bytes"]), 0)
            assert stage.has_work()

    def test_later_items_of_a_request_sent_to_the_dead_process_are_not_held(self) -> None:
        # A request whose first item went to the process that died: its later items are
        # of no use to the new one (dropped at the link anyway), and the coordinator may
        # count it done with no abort to come; held, they would fill the window until a
        # link that may never come (a restart that fails for good). Dropped at once.
        with _next_processes(window=2, next_restarts=True) as (stage, routers, _):
            stage.pipe_route(["a"], [[0]], abort=False)
            stage.add("a", 6)
            stage.route_outputs(stage.step())  # a: FIRST 5, to the process that dies
            assert _received(routers[0])[1:3] == [[FIRST], ["a"]]
            stage.pipe_gone("next", 0, 0)  # (its window empty: what it had is let go)
            assert _step_while_room(stage) == 5  # every later item, none held
            stats = stage.stats()
            assert (stats["edge_held"], stats["edge_dropped"]) == (0, 6)  # 4, 3 ... 0, END
            assert stage.stats()["edge_waits"] == 0

    def test_held_bytes_count_against_the_byte_window(self) -> None:
        # The byte window bounds held data too, by its payload_size: an array's nbytes.
        def edge(n: int) -> tuple[Any, Any]:
            return np.full(256, n, dtype=np.float32), NOTHING  # 1 KiB

        with _next_processes(window_bytes=3000, next_restarts=True, edge=edge) as (
            stage,
            routers,
            addresses,
        ):
            stage.pipe_gone("next", 0, 0)
            stage.pipe_route(["a", "b"], [[0], [0]], abort=False)
            stage.add("a", 9)
            stage.add("b", 9)
            assert _step_while_room(stage) == 2  # 2 KiB, then 4 KiB: the window's reached
            stats = stage.stats()
            assert (stats["edge_held"], stats["edge_held_bytes"]) == (4, 4096)
            assert stats["edge_waits"] == 1
            stage.abort(["a"])
            assert stage.stats()["edge_held_bytes"] == 2048
            assert _step_while_room(stage) == 1
            assert stage.stats()["edge_held_bytes"] == 3072
            stage.pipe_link(0, addresses[1], "")
            assert _received(routers[1], arrays=True)[1:3] == [
                [FIRST, MORE, MORE],
                ["b", "b", "b"],
            ]
            stats = stage.stats()
            assert stats["edge_held_bytes"] == 0
            assert stats["edge_in_flight_bytes"] > 3072  # encoded: the arrays and more
            assert not stage.has_work()

    @pytest.mark.parametrize("seed", range(6))
    def test_held_counts_match_what_is_held_through_any_sequence(self, seed: int) -> None:
        # Random adds (routes with and without generations, ids used again), steps, aborts
        # (chased: held for a newer generation), releases, gones, links and credits on two
        # links: after each, the held counters are what is held, recomputed.
        rng = random.Random(seed)
        with _next_processes(2, links=2, window=6, next_restarts=True, next_generations=[0, 0]) as (
            stage,
            _routers,
            addresses,
        ):
            gens = [0, 0]
            routes: dict[str, list[Any]] = {}
            for n in range(300):
                op = rng.choice(
                    [
                        "add",
                        "add",
                        "step",
                        "step",
                        "step",
                        "abort",
                        "release",
                        "gone",
                        "link",
                        "credit",
                    ]
                )
                index = rng.randrange(2)
                ids = list(routes)
                if op == "add":
                    free = [rid for rid in ids if rid not in stage._live]
                    rid = rng.choice(free) if free and rng.random() < 0.3 else f"r{n}"
                    if rng.random() < 0.2:
                        route: list[Any] = [index]
                    else:
                        route = [[index, max(0, gens[index] + rng.choice([-1, 0, 1]))]]
                    routes[rid] = route
                    stage.pipe_route([rid], [route], abort=False)
                    stage.add(rid, rng.randint(1, 4))
                elif op == "step":
                    if stage._inner.has_work():
                        stage.route_outputs(stage.step())
                elif op == "abort" and ids:
                    rid = rng.choice(ids)
                    stage.pipe_route([rid], [routes[rid]], abort=True)
                    stage.abort([rid])
                    stage.chase_abort([rid])
                elif op == "release" and ids:
                    stage.pipe_release([rng.choice(ids)])
                elif op == "gone":
                    stage.pipe_gone("next", 0, index)
                elif op == "link":
                    gens[index] += rng.choice([0, 1])
                    stage.pipe_link(index, addresses[index], "", "", gens[index])
                elif op == "credit":
                    stage.pipe_credit(rng.randint(1, 4), rng.randint(1, 100), index)
                assert _held_counts_hold(stage), (n, op)
                stats = stage.stats()
                assert stats["edge_held"] == sum(stage._held_items)

    def test_a_replay_for_a_process_that_died_is_refused(self) -> None:
        # docs/wire.md section 8, "Restarts": a request whose route names a generation of
        # the next stage's process other than its link's now went to a process that died
        # (its link was replaced since): its replay is refused, with no fence down the new
        # link (the new process never held the request). One routed to the new process
        # replays there.
        with _next_processes(next_restarts=True, next_generations=[0], replay_bytes=1 << 20) as (
            stage,
            routers,
            addresses,
        ):
            stage.pipe_route(["a"], [[[0, 0]]], abort=False)
            stage.add("a", 3)
            stage.route_outputs(stage.step())  # a: FIRST 2, to generation 0, logged
            assert _received(routers[0])[1:4] == [[FIRST], ["a"], [2]]
            stage.pipe_gone("next", 0, 0)
            stage.pipe_link(0, addresses[1], "", "", 1)
            assert stage.pipe_replay("a") == (False, "the next stage is gone")
            assert not routers[1].poll(100)
            stage.pipe_route(["b"], [[[0, 1]]], abort=False)
            stage.add("b", 3)
            stage.route_outputs(stage.step())  # a: dropped (generation 0); b: FIRST 2
            assert _received(routers[1])[1:4] == [[FIRST], ["b"], [2]]
            assert stage.pipe_replay("b") == (True, "")
            assert _received(routers[1]) == ["abort", ["b"], [[]], True]
            assert _received(routers[1])[1:4] == [[FIRST], ["b"], [2]]

    def test_without_a_restart_what_goes_to_a_gone_process_is_dropped(self) -> None:
        # A next stage that does not restart: nothing will take what would go to a dead
        # process (the coordinator ends its requests): dropped and counted, as before.
        with _next_processes(1) as (stage, _routers, _addresses):
            stage.pipe_gone("next", 0, 0)
            stage.pipe_route(["a"], [[0]], abort=False)
            stage.add("a", 2)
            stage.route_outputs(stage.step())
            stats = stage.stats()
            assert (stats["edge_dropped"], stats["edge_in_flight"]) == (1, 0)
            assert "edge_held" not in stats

    def test_an_abort_chases_no_further_than_a_dead_process_on_its_route(self) -> None:
        # docs/wire.md section 8, "Restarts": -1 in an abort's route is a stage whose
        # process on the request's route died; a restarted process at that index never
        # held the request. The stage before it applies the abort and answers it, and
        # sends it no further; the coordinator sends nothing there either.
        with _next_processes(2, links=2) as (stage, routers, _addresses):
            stage.pipe_route(["x", "y"], [[-1, 0], [1, -1]], abort=True)
            stage.abort(["x", "y"])
            stage.chase_abort(["x", "y"], tag=7)
            assert routers[1].poll(5000)
            _ident, body = routers[1].recv_multipart()
            assert msgspec.msgpack.decode(body) == ["abort", ["y"], [[-1]], False, 7]
            assert not routers[0].poll(100)  # x: nothing down any link
            assert not routers[1].poll(0)

        sent: list[Any] = []

        class Replica:  # the coordinator's connection to one process: what it is sent
            def __init__(self, k: int, r: int) -> None:
                self.at = (k, r)

            def _send(self, parts: Any) -> None:
                sent.append((self.at, msgspec.msgpack.decode(parts[0])))

        coordinator = object.__new__(PipelineBase)  # only its routing of aborts, no I/O
        coordinator._replicas = [[Replica(k, r) for r in range(2)] for k in range(4)]
        coordinator._core = PipelineCore(["a", "b", "c", "d"], replicas=[2, 2, 2, 2])
        routes = {"x": (1, 0, -1, 1), "y": (0, -1, 0, 0)}
        coordinator._send_routed_aborts(1, ["x", "y"], routes, {(1, "x"): 7})
        assert sent == [((1, 0), ["abort", ["x"], [[-1, 1]], False, 7])]

    @pytest.mark.parametrize("payloads", [["a", "b", "c"], [{"a": 1}, [2], {"c": 3}]])
    def test_a_step_of_payloads_only_goes_on_as_its_columns(self, payloads: list[Any]) -> None:
        # A relay between two stages (no edge function): a step that ends no request is
        # sent on as it is (flat payloads take _split's fast path, others the general one),
        # the first payload of each request FIRST, the next ones MORE, in the step's order.
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        stage = PipeStage(RelayEngine(), stage="s", downstream=f"tcp://127.0.0.1:{port}")

        def received() -> Any:
            assert router.poll(5000)
            _ident, body = router.recv_multipart()
            return msgspec.msgpack.decode(body)

        try:
            stage.pipe_input(FIRST, "r", payloads[0])
            stage.pipe_input(MORE, "r", payloads[1])
            stage.pipe_input(FIRST, "q", payloads[2])
            assert stage.step() == []
            assert stage.take_ended() == []
            assert received() == ["pipe", [FIRST, MORE, FIRST], ["r", "r", "q"], payloads]
            stage.pipe_input(MORE, "r", payloads[2])
            stage.pipe_input(END, "q", None)
            assert stage.step() == []  # q ends: the general path
            assert received() == ["pipe", [MORE, END], ["r", "q"], [payloads[2], None]]
            stage.pipe_input(MORE, "r", payloads[0])
            assert stage.step() == []
            assert received() == ["pipe", [MORE], ["r"], [payloads[0]]]
        finally:
            assert stage._links[0] is not None
            stage._links[0].close(linger=0)
            router.close()
            ctx.term()

    def test_a_request_a_stage_ended_early_is_done_once_the_first_stage_ended_it(
        self, launch: Any
    ) -> None:
        # head ends r at its second input, while the device stage still produces it (6
        # steps of 0.06 s); the relay after it ends it soon after. r is done only once the
        # device stage has ended it too: its id is free, and nothing is left in any stage.
        pipe = launch(
            [
                PipelineStage(DEVICE, {"step_s": 0.06}, name="device"),
                PipelineStage(f"{T}:head", {"n": 2}),
                RELAY,
            ]
        )
        started = time.monotonic()
        stream = pipe.add("r", 6)
        assert stream.collect(timeout=10) == [5, 4]
        assert stream.finished
        assert time.monotonic() - started >= 0.3  # not before the device's 6 steps
        assert pipe.call_utility("device", "num_requests") == 0
        assert pipe.in_flight == 0
        assert pipe.add("r", 1).collect(timeout=10) == [0]  # the id is free again

    def test_arrays_cross_every_stage_intact(self, launch: Any) -> None:
        pipe = launch([ECHO, RELAY])
        image = np.random.default_rng(0).random((256, 256, 4)).astype(np.float32)  # 1 MiB
        (back,) = pipe.add("img", {"pixels": image}).collect(timeout=10)
        assert np.array_equal(back["pixels"], image)

    def test_a_pipelined_engine_can_be_a_stage(self, launch: Any) -> None:
        pipe = launch([f"{T}:pipelined", RELAY])
        assert pipe.add("r", 4).collect(timeout=10) == [3, 2, 1, 0]


class TestOmniExample:
    @pytest.mark.parametrize("tokens", [0, -2, "abc", 2.5, True])
    def test_the_thinker_refuses_a_bad_token_count_alone(self, tokens: Any) -> None:
        # A bad "tokens" used to stream forever (0) or raise ValueError from add(), which
        # is fatal to the stage and so to the whole pipeline.
        path = pathlib.Path(__file__).parents[2] / "examples" / "omni_pipeline.py"
        spec = importlib.util.spec_from_file_location("omni_pipeline_under_test", path)
        assert spec is not None
        assert spec.loader is not None
        omni = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(omni)
        thinker = omni.Thinker()
        with pytest.raises(RequestRejected, match="tokens must be an int >= 1"):
            thinker.add("r", {"prompt": "hi", "tokens": tokens})
        assert not thinker.has_work()
        thinker.add("r", {"prompt": "hi there"})
        assert [out[2]["text"] for out in thinker.step() + thinker.step()] == ["hi", "there"]


class TestRelayEngine:
    def test_gate_blocks_until_its_file_is_removed_or_the_timeout(self, no_leftovers: str) -> None:
        engine = RelayEngine()
        gate = pathlib.Path(no_leftovers, "gate")
        engine.utility("gate", (str(gate), 5.0))  # no file: no wait
        gate.touch()
        in_it = threading.Event()

        def blocked() -> None:
            in_it.set()
            engine.utility("gate", (str(gate), 30.0))

        thread = threading.Thread(target=blocked)
        thread.start()
        assert in_it.wait(10)
        thread.join(0.2)
        assert thread.is_alive()  # still held: the file is there
        gate.unlink()
        thread.join(10)
        assert not thread.is_alive()
        gate.touch()
        with pytest.raises(RuntimeError, match=r"held for 0\.05 s"):
            engine.utility("gate", (str(gate), 0.05))
        gate.unlink()


class TestEdges:
    def test_tee_sends_each_output_to_the_caller_and_on(self, launch: Any) -> None:
        pipe = launch([PipelineStage(COUNTDOWN, edge=f"{T}:tee"), RELAY])
        out = pipe.add("r", 2).collect(timeout=10)
        assert sorted(out) == [0, 0, 1, 1]  # two stages' payloads: no order between them

    def test_an_edge_that_sends_nothing_on_ends_the_request_in_its_stage(self, launch: Any) -> None:
        pipe = launch([PipelineStage(COUNTDOWN, edge=f"{T}:to_caller"), RELAY])
        assert pipe.add("r", 3).collect(timeout=10) == [2, 1, 0]
        assert pipe.call_utility(f"{RELAY}", "num_requests") == 0
        assert pipe.in_flight == 0

    @pytest.mark.parametrize(
        ("data", "why"),
        [
            ("boom", "ValueError"),
            ("unencodable", "not wire-encodable"),
            ("unprintable", "_Unprintable"),
        ],
    )
    def test_a_failing_edge_ends_only_its_request_naming_the_stage(
        self, launch: Any, data: str, why: str
    ) -> None:
        pipe = launch([PipelineStage(ECHO, name="first", edge=f"{T}:checked_edge"), RELAY])
        with pytest.raises(PipelineRequestError, match=why) as info:
            pipe.add("bad", data).collect(timeout=10)
        assert info.value.stage == "first"
        assert "the edge to the next stage failed" in info.value.message
        assert pipe.add("good", "fine").collect(timeout=10) == [["fine"]][0]
        assert wait_until(lambda: pipe.in_flight == 0, 10)

    def test_an_edge_output_for_the_caller_that_cannot_cross_the_wire_fails_its_request(
        self, launch: Any
    ) -> None:
        # The stage drops the output and ends its request with an error. (The request's
        # end went out before that error, in the same step: the request ended finished,
        # without the output and without a word.)
        pipe = launch([PipelineStage(ECHO, name="first", edge=f"{T}:checked_edge"), RELAY])
        with pytest.raises(PipelineRequestError, match="cannot be encoded") as info:
            pipe.add("bad", "unencodable to the caller").collect(timeout=10)
        assert info.value.stage == "first"
        assert pipe.add("good", "fine").collect(timeout=10) == ["fine"]
        assert wait_until(lambda: pipe.in_flight == 0, 10)

    def test_nothing_is_falsy_and_one_object(self) -> None:
        from enginecore.stage import _edge

        assert NOTHING is _edge._Nothing()
        assert not NOTHING
        assert repr(NOTHING) == "NOTHING"


class TestAbort:
    def test_an_abort_reaches_a_request_in_the_first_stage(self, launch: Any) -> None:
        pipe = launch([PipelineStage(DEVICE, {"step_s": 0.005}), RELAY])
        stream = pipe.add("r", 10**6)
        stream.get(timeout=10)
        pipe.abort(["r"])
        stream.collect(timeout=10)
        assert stream.aborted
        assert pipe.in_flight == 0
        assert pipe.add("r", 1).collect(timeout=10) == [0]

    def test_an_abort_chases_a_request_into_a_later_stage(self, launch: Any) -> None:
        pipe = launch([COUNTDOWN, PipelineStage(RELAY, name="held")])
        pipe.call_utility("held", "hold", True)
        stream = pipe.add("r", 2)
        _wait_live(pipe, "held", 1)  # the first stage has finished it and sent it on
        pipe.abort(["r"])
        assert stream.collect(timeout=10) == []
        assert stream.aborted
        _wait_live(pipe, "held", 0)
        pipe.call_utility("held", "hold", False)
        assert pipe.in_flight == 0

    def test_an_abort_of_an_unknown_or_ended_id_is_ignored(self, launch: Any) -> None:
        pipe = launch([COUNTDOWN, RELAY])
        assert pipe.add("r", 1).collect(timeout=10) == [0]
        pipe.abort(["r", "nobody"])
        assert pipe.add("r", 1).collect(timeout=10) == [0]
        with pytest.raises(TypeError):
            pipe.abort("r")
        with pytest.raises(TypeError, match="takes a sequence of request ids, got int"):
            pipe.abort(5)


class TestErrors:
    def test_stats_asks_every_stage_at_once_and_checks_its_timeout(self, launch: Any) -> None:
        """stats() asks every stage before it waits for one (the blocking pipeline asked
        them one after the other, so that each stopped stage added a whole *timeout*); a
        timeout that is not seconds is the call's error, not each stage's entry."""
        pipe = launch(
            [COUNTDOWN, PipelineStage(RELAY, name="mid"), PipelineStage(RELAY, name="last")]
        )
        with pytest.raises(ValueError, match="timeout"):
            pipe.stats(-1)
        with pytest.raises(TypeError, match="timeout"):
            pipe.stats("1")
        asked: list[str] = []
        for name in pipe.stages:
            client = pipe.client(name)
            stats = client.stats

            def recorded(*args: Any, _name: str = name, _stats: Any = stats, **kw: Any) -> Any:
                asked.append(_name)
                return _stats(*args, **kw)

            client.stats = recorded
        pid = pipe.client(COUNTDOWN).pid
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            os.kill(pid, signal.SIGSTOP)
            try:
                got = ex.submit(pipe.stats, None)
                assert wait_until(lambda: {"mid", "last"} <= set(asked), 10), asked
            finally:
                os.kill(pid, signal.SIGCONT)
            stats = got.result(10)
        assert list(stats) == [COUNTDOWN, "mid", "last"]
        assert all(isinstance(s, StageStatistics) for s in stats.values())

    def test_an_error_in_a_later_stage_names_it_and_aborts_the_request_everywhere(
        self, launch: Any
    ) -> None:
        pipe = launch([ECHO, PipelineStage(RELAY, name="talker")])
        with pytest.raises(PipelineRequestError) as info:
            pipe.add("r", "reject").collect(timeout=10)
        assert info.value.stage == "talker"
        assert info.value.req_id == "r"
        assert "refused on purpose" in str(info.value)
        assert wait_until(lambda: pipe.in_flight == 0, 10)
        assert pipe.add("r", "fine").collect(timeout=10) == ["fine"]

    def test_an_error_in_a_middle_stage_after_it_sent_some_on(self, launch: Any) -> None:
        # "mid" sends 2 and 1 on, then its edge fails on 0: the request ends with the error,
        # the last stage drops its part of it, and the id is free again only once every
        # stage has applied the coordinator's abort (each answers it exactly once).
        pipe = launch(
            [
                COUNTDOWN,
                PipelineStage(RELAY, name="mid", edge=f"{T}:last_fails"),
                PipelineStage(RELAY, name="last"),
            ]
        )
        for _ in range(3):
            stream = pipe.add("r", 3)
            with pytest.raises(PipelineRequestError, match="refuses 0") as info:
                stream.collect(timeout=10)
            assert info.value.stage == "mid"
            assert wait_until(lambda: pipe.in_flight == 0, 10)
            assert wait_until(lambda: pipe.call_utility("last", "num_requests") == 0, 10)

    def test_an_error_in_the_first_stage_names_it(self, launch: Any) -> None:
        pipe = launch([PipelineStage(COUNTDOWN, name="first"), RELAY])
        with pytest.raises(PipelineRequestError, match="need an int") as info:
            pipe.add("r", "three").collect(timeout=10)
        assert info.value.stage == "first"

    def test_bad_data_and_live_ids_are_refused_before_sending(self, launch: Any) -> None:
        pipe = launch([COUNTDOWN, RELAY])
        with pytest.raises(TypeError, match="not wire-encodable"):
            pipe.add("r", object())
        assert pipe.in_flight == 0
        pipe.call_utility(f"{RELAY}", "hold", True)
        pipe.add("r", 1)
        with pytest.raises(ValueError, match="still in the pipeline"):
            pipe.add("r", 1)
        with pytest.raises(ValueError, match="twice"):
            pipe.add_many([("a", 1), ("a", 1)])
        with pytest.raises(TypeError, match="req_id must be a str"):
            pipe.add(3, 1)
        pipe.call_utility(f"{RELAY}", "hold", False)

    def test_a_stage_killed_under_load_fails_every_request_naming_it(self, launch: Any) -> None:
        pipe = launch(
            [
                PipelineStage(DEVICE, {"step_s": 0.005}, name="first"),
                PipelineStage(RELAY, name="mid"),
                PipelineStage(RELAY, name="last"),
            ]
        )
        streams = [pipe.add(f"r{i}", 10**6) for i in range(20)]
        for stream in streams:
            stream.get(timeout=10)
        pid = pipe.call_utility("mid", "pid")
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        assert_death_contained(pipe, streams, "mid", "SIGKILL", timeout=5)
        assert time.monotonic() - killed_at < 5  # within a second, on a quiet machine

    def test_a_dead_previous_stage_s_late_data_is_dropped_after_its_gone(
        self, no_leftovers: str
    ) -> None:
        # A dead stage's last `pipe` messages and the coordinator's abort reach the next
        # stage on two connections, with no order between them. The coordinator sends
        # `gone` (the dead link's routing id) before the abort; from then on the stage drops
        # every message of that link, unread, and counts it. Here the test plays the dead
        # stage's link (a DEALER with its routing id) and the coordinator (a client), and
        # the late message comes after the abort, for certain.
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        links: list[zmq.Socket[bytes]] = []
        client = StageClient.launch(
            PIPE_FACTORY, {"factory": RELAY, "stage": "b"}, startup_timeout=30
        )

        def link(generation: int) -> zmq.Socket[bytes]:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTING_ID, link_id(0, generation).encode())
            sock.connect(client.address)
            links.append(sock)
            return sock

        def pipe(sock: zmq.Socket[bytes], rid: str) -> None:
            sock.send(msgspec.msgpack.encode(["pipe", [FIRST], [rid], [1]]))

        try:
            dead = link(0)
            pipe(dead, "r1")
            assert wait_until(lambda: client.stats().live == 1, 10)
            client._send(ClientSession.gone_frame("previous", link_id(0)))
            client._send_abort(["r1", "r2"])
            assert wait_until(lambda: client.stats().live == 0, 10)
            pipe(dead, "r2")  # sent before the death, read after the abort
            assert wait_until(lambda: client.stats().engine.get("pipe_dropped") == 1, 10)
            assert client.stats().live == 0  # r2 never became live
            # Only that link is cut: another one (a new start of the stage) is heard.
            pipe(link(1), "r3")
            assert wait_until(lambda: client.stats().live == 1, 10)
            assert client.call_utility("num_requests") == 1
        finally:
            for sock in links:
                sock.close()
            client.shutdown()
            ctx.term()

    def test_a_bad_gone_is_an_error_and_changes_nothing(self, no_leftovers: str) -> None:
        with StageClient.launch(
            PIPE_FACTORY, {"factory": RELAY, "stage": "b"}, startup_timeout=30, ordered_events=True
        ) as client:
            client._send(ClientSession.gone_frame("sideways", "x"))
            client._send(ClientSession.gone_frame("previous", ""))
            errors = [client.get_event(timeout=10), client.get_event(timeout=10)]
            assert all(isinstance(e, ErrorReport) and e.req_id is None for e in errors)
            messages = [cast(ErrorReport, e).message for e in errors]
            assert "gone side must be previous or next, got 'sideways'" in messages[0]
            assert "gone needs the link" in messages[1]
            assert "pipe_dropped" not in client.stats().engine


class TestCredits:
    def test_a_slow_stage_holds_its_producer_to_the_window(self, launch: Any) -> None:
        pipe = launch(
            [
                PipelineStage(COUNTDOWN, name="fast", window=16),
                PipelineStage(RELAY, {"step_s": 0.01}, name="slow"),
            ]
        )
        stream = pipe.add("r", 400)
        most = 0
        for i, payload in enumerate(stream):
            assert payload == 399 - i
            if i % 10 == 0:
                most = max(most, pipe.stats()["fast"].engine["edge_in_flight"])
        # fast's numbers once they count the end it sent (the stream may be over first).
        edge = _engine(pipe, "fast", lambda e: e["edge_sent"] >= 401)
        # A step starts only below the window (16), and a countdown step sends one payload,
        # and the end with the last one: never more than 17.
        assert 0 < most <= 17
        assert edge["edge_waits"] > 0  # the window held the producer back
        assert edge["edge_sent"] == 401  # 400 payloads and the end
        # Everything taken, and credited back (the last credit rides with the last stage's
        # end, so it may reach the first stage just after the stream ended).
        assert wait_until(lambda: pipe.stats()["fast"].engine["edge_in_flight"] == 0, 10)

    def test_inputs_an_engine_still_holds_count_against_the_window(self, launch: Any) -> None:
        # The slow stage takes every input at once but sends out one a step: without
        # pending_inputs() its backlog would grow to the whole request.
        pipe = launch(
            [
                PipelineStage(COUNTDOWN, name="fast", window=8),
                PipelineStage(RELAY, {"step_s": 0.002, "per_step": 1}, name="slow"),
            ]
        )
        stream = pipe.add("r", 300)
        most = 0
        for i, payload in enumerate(stream):
            assert payload == 299 - i
            if i % 5 == 0:
                most = max(most, pipe.stats()["fast"].engine["edge_in_flight"])
        assert 0 < most <= 9
        assert wait_until(lambda: pipe.stats()["fast"].engine["edge_in_flight"] == 0, 10)

    def test_the_byte_window_bounds_the_bytes_in_flight(self, launch: Any) -> None:
        chunk = 100_000  # bytes sent on per output (the inflate edge)
        pipe = launch(
            [
                PipelineStage(COUNTDOWN, name="fast", edge=f"{T}:inflate", window_bytes=2 * chunk),
                PipelineStage(RELAY, {"step_s": 0.005}, name="slow"),
            ]
        )
        stream = pipe.add("r", 60)
        most = 0
        received = []
        for payload in stream:
            received.append(payload)
            most = max(most, pipe.stats()["fast"].engine["edge_in_flight_bytes"])
        assert sorted(p for p in received if isinstance(p, int)) == list(range(60))
        assert sum(len(p) for p in received if isinstance(p, bytes)) == 60 * chunk
        # Never past the window plus what one step sends (one payload: a countdown step
        # advances the request by one), frame headers included.
        assert chunk <= most <= 3 * chunk + 300
        assert wait_until(lambda: pipe.stats()["fast"].engine["edge_in_flight_bytes"] == 0, 10)

    @pytest.mark.parametrize(
        ("bad", "error"),
        [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError), ("8", TypeError)],
    )
    def test_a_bad_window_is_refused(self, bad: Any, error: type[Exception]) -> None:
        # A value of the wrong type is a TypeError (as for a pool's replicas), a bad int a
        # ValueError; the message is the same.
        for what in ("window", "window_bytes", "shm_threshold"):
            with pytest.raises(error, match=f"^{what} must be an int >= 1 or None"):
                PipelineStage(COUNTDOWN, **{what: bad})
        if error is TypeError:
            with pytest.raises(TypeError, match="shm_pool_bytes must be an int >= 1"):
                PipelineStage(COUNTDOWN, shm_pool_bytes=bad)
        with pytest.raises(error, match="replicas must be an int >= 1"):
            PipelineStage(COUNTDOWN, replicas=bad)

    @pytest.mark.parametrize(("bad", "error"), [(0, ValueError), ("1", TypeError)])
    def test_a_bad_shm_lease_is_refused(self, bad: Any, error: type[Exception]) -> None:
        with pytest.raises(error, match="shm_lease must be seconds > 0"):
            PipelineStage(COUNTDOWN, shm_lease=bad)

    def test_names_that_would_share_a_key_of_health_and_stats_are_refused(self) -> None:
        # An empty name was taken for the factory string, so two stages could be named
        # the same; a stage named like a pool's process ("mid[1]") shared its key, and
        # health()/stats() silently had one entry for the two.
        with pytest.raises(ValueError, match="must not be empty"):
            Pipeline.launch([COUNTDOWN, PipelineStage(RELAY, name=""), RELAY])
        with pytest.raises(ValueError, match="would share the key 'mid\\[1\\]'"):
            Pipeline.launch(
                [
                    PipelineStage(COUNTDOWN, name="mid[1]"),
                    PipelineStage(RELAY, name="mid", replicas=2),
                ]
            )
        with pytest.raises(TypeError, match="name must be a str"):
            Pipeline.launch([COUNTDOWN, PipelineStage(RELAY, name=3)])  # type: ignore[arg-type]

    @pytest.mark.parametrize("bad", [[1], ("step_s", 0.1), "step_s=0.1"])
    def test_kwargs_that_are_not_a_mapping_are_refused(self, bad: Any) -> None:
        with pytest.raises(TypeError, match="kwargs must be a mapping"):
            PipelineStage(RELAY, kwargs=bad)

    def test_credit_in_the_stage_process_step_by_step(self) -> None:
        # The producer side: a full window stops steps until credit comes; the consumer
        # side: what a pipe frame brought is given back after the next step (the runtime
        # takes it into the step's frame), or at once when the loop would go idle.
        emitted: list[Any] = []
        stage = PipeStage(CountdownEngine(), stage="s", window=2)
        stage.attach_emit(emitted.append)
        stage._links = [type("Link", (), {})()]
        stage._out_items, stage._out_bytes, stage._last = [0], [0], False
        stage._shms = [None]
        stage._send_on = lambda kinds, *rest: stage._count_sent(0, len(kinds), [b"x" * 10])  # type: ignore[method-assign]
        stage.add("a", 5)
        stage.add("b", 5)
        assert stage.has_work()
        stage.step()  # two payloads sent on: the window (2) is full
        assert not stage.has_work()
        assert stage.stats()["edge_waits"] == 1
        stage.pipe_credit(1, 10)
        assert stage.has_work()
        stage.pipe_received(3, 300)
        stage.step()
        assert stage.take_credit() == ("credit", 3, 300)  # after the step
        assert stage.take_credit() is None
        assert emitted == []
        stage.pipe_received(1, 50)
        stage._inner.abort(["a", "b"])
        assert not stage.has_work()
        assert emitted[-1] == ("credit", 1, 50)  # the loop would go idle: given back now

    def test_credit_goes_back_in_batches_or_once_the_stage_idles(self) -> None:
        # Below its batch (a quarter of the previous stage's window, in items or bytes), credit is
        # held back after a step, and given back when the idle wait's timer fires,
        # CREDIT_DELAY_S after the loop went idle; a batch goes back after the step.
        emitted: list[Any] = []
        stage = PipeStage(RelayEngine(), stage="s", credit_items=4, credit_bytes=1000)
        stage.attach_emit(emitted.append)
        assert stage.idle_due() is None
        stage.pipe_input(ONLY, "a", 1)
        stage.pipe_received(1, 10)
        stage.step()
        assert stage.take_credit() is None  # 1 item, 10 bytes: held back
        before = time.monotonic()
        assert not stage.has_work()  # the loop would go idle: a deadline, no event yet
        after = time.monotonic()
        assert emitted == []
        due = stage.idle_due()
        assert due is not None
        assert before + CREDIT_DELAY_S <= due <= after + CREDIT_DELAY_S
        stage.pipe_input(ONLY, "b", 2)  # more came before it: the deadline stays
        stage.pipe_received(1, 10)
        stage.step()
        assert stage.take_credit() is None
        assert not stage.has_work()
        assert stage.idle_due() == due
        stage.idle_fire()  # whatever is held back goes, however little
        assert emitted == [("credit", 2, 20)]
        assert stage.idle_due() is None
        assert not stage.has_work()  # nothing held back: no deadline
        assert stage.idle_due() is None
        # A batch goes back after the step that took it: 4 items, or 1,000 bytes.
        for i in range(4):
            stage.pipe_input(ONLY, f"c{i}", i)
        stage.pipe_received(4, 40)
        stage.step()
        assert stage.take_credit() == ("credit", 4, 40)
        stage.pipe_input(ONLY, "d", 1)
        stage.pipe_received(1, 1000)
        stage.step()
        assert stage.take_credit() == ("credit", 1, 1000)
        assert stage.idle_due() is None
        # A deadline armed, then a batch reached before it: given back, the deadline gone.
        stage.pipe_input(ONLY, "e", 1)
        stage.pipe_received(1, 10)
        stage.step()
        assert not stage.has_work()
        assert stage.idle_due() is not None
        stage.pipe_received(3, 30)
        assert stage.take_credit() == ("credit", 4, 40)
        assert stage.idle_due() is None
        assert emitted == [("credit", 2, 20)]

    @pytest.mark.parametrize(
        ("window", "batch"), [(None, DEFAULT_WINDOW // 4), (1, 1), (3, 1), (8, 2), (4096, 1024)]
    )
    def test_the_credit_batch_is_a_quarter_of_the_previous_stages_window(
        self, window: int | None, batch: int
    ) -> None:
        upstream = PipelineStage(COUNTDOWN, window=window, window_bytes=window)
        kwargs = pipe_kwargs(PipelineStage(RELAY), None, index=1, upstream=upstream)
        default_bytes = DEFAULT_WINDOW_BYTES // 4 if window is None else batch
        assert (kwargs["credit_items"], kwargs["credit_bytes"]) == (batch, default_bytes)
        first = pipe_kwargs(upstream, "ipc:///nowhere", index=0)
        assert "credit_items" not in first  # no stage before it

    def test_credit_for_inputs_an_engine_holds_waits_until_they_go_out(self) -> None:
        emitted: list[Any] = []
        stage = PipeStage(RelayEngine(per_step=1), stage="s")
        stage.attach_emit(emitted.append)
        stage.pipe_input(FIRST, "r", "a")
        stage.pipe_input(MORE, "r", "b")
        stage.pipe_input(MORE, "r", "c")
        stage.pipe_received(3, 300)
        stage.step()  # "a" out; "b" and "c" still held
        assert stage.take_credit() == ("credit", 1, 100)
        stage.step()
        assert stage.take_credit() == ("credit", 1, 100)
        assert stage.take_credit() is None  # "c" is still held
        stage.pipe_input(END, "r", None)
        stage.pipe_received(1, 30)
        stage.step()  # "c", the last: nothing held any more, everything given back
        assert stage.take_credit() == ("credit", 2, 130)
        # Its end report: it ends here, and every stage before it ended it (its END came).
        assert stage.route_outputs([]) == (["r", "r"], [False, True], ["c", ENDED | BEFORE])
        assert emitted == []

    def test_no_deadline_while_the_engine_holds_everything_it_took(self) -> None:
        # Credit for inputs the engine still holds is not given back (they count against the
        # window): an idle wait's deadline for it would fire, give nothing and be set again,
        # waking a stage that waits (on a hold, or a full window) every CREDIT_DELAY_S.
        emitted: list[Any] = []
        stage = PipeStage(RelayEngine(per_step=1), stage="s", credit_items=4, credit_bytes=1000)
        stage.attach_emit(emitted.append)
        stage.utility("hold", (True,))
        stage.pipe_input(FIRST, "r", "a")
        stage.pipe_input(MORE, "r", "b")
        stage.pipe_received(2, 20)
        for _ in range(3):
            assert not stage.has_work()
            assert stage.idle_due() is None
        stage.pipe_input(MORE, "r", "c")  # one more, then one of the three goes out
        stage.pipe_received(1, 10)
        stage.utility("hold", (False,))
        stage.step()
        stage.utility("hold", (True,))
        assert stage.take_credit() is None  # 1 item below the batch: held back
        assert not stage.has_work()
        due = stage.idle_due()  # now something is owed: a deadline
        assert due is not None
        stage.idle_fire()
        assert emitted == [("credit", 1, 10)]
        assert not stage.has_work()
        assert stage.idle_due() is None  # the two still held: no deadline again


def _refuses_adds(pipe: Any) -> bool:
    """Whether *pipe*'s shutdown has begun: an add is refused (``StageClosedError``)."""
    try:
        pipe.add("late", 1).collect(timeout=10)
    except StageClosedError:
        return True
    return False


class TestAdmission:
    def test_max_in_flight_waits_or_refuses_and_frees_at_the_end(self, launch: Any) -> None:
        pipe = launch([COUNTDOWN, PipelineStage(RELAY, name="held")], max_in_flight=2)
        pipe.call_utility("held", "hold", True)
        a = pipe.add("a", 1)
        pipe.add("b", 1)
        with pytest.raises(PipelineFullError):
            pipe.add("c", 1, wait=False)
        with pytest.raises(TypeError, match="wait must be a bool, got str"):
            pipe.add("c", 1, wait="no")  # truthy: it would have waited
        started = time.monotonic()
        with pytest.raises(PipelineFullError, match=r"within 0\.2 s"):
            pipe.add("c", 1, timeout=0.2)
        assert time.monotonic() - started >= 0.2
        with pytest.raises(ValueError, match="more than max_in_flight"):
            pipe.add_many([("x", 1), ("y", 1), ("z", 1)])
        pipe.abort(["a"])
        a.collect(timeout=10)
        c = pipe.add("c", 1, timeout=10)  # a's place is free once it is over everywhere
        pipe.call_utility("held", "hold", False)
        assert c.collect(timeout=10) == [0]
        assert wait_until(lambda: pipe.in_flight == 0, 10)

    def test_max_bytes_counts_the_frames_that_bring_requests_in(self, launch: Any) -> None:
        pipe = launch([ECHO, PipelineStage(RELAY, name="held")], max_bytes=250_000)
        pipe.call_utility("held", "hold", True)
        chunk = np.zeros(100_000, dtype=np.uint8)
        a = pipe.add("a", chunk)
        pipe.add("b", chunk)
        assert 200_000 < pipe.bytes_in < 201_000  # the frames: the arrays and a header each
        with pytest.raises(PipelineFullError, match="it holds 2 requests"):
            pipe.add("c", chunk, wait=False)
        pipe.add("small", 1)  # a few bytes still fit
        with pytest.raises(ValueError, match="more than max_bytes"):
            pipe.add("huge", np.zeros(300_000, dtype=np.uint8))
        pipe.abort(["a"])
        a.collect(timeout=10)
        pipe.add("c", chunk, timeout=10)
        pipe.call_utility("held", "hold", False)
        assert wait_until(lambda: pipe.in_flight == 0, 10)
        assert pipe.bytes_in == 0

    def test_a_waiting_add_wakes_when_a_request_finishes(self, launch: Any) -> None:
        pipe = launch([COUNTDOWN, RELAY], max_in_flight=1)
        first = pipe.add("a", 50)
        second = pipe.add("b", 1, timeout=10)  # waits for a
        assert first.finished is False or first.collect(timeout=10)
        assert second.collect(timeout=10) == [0]

    @pytest.mark.parametrize("what", ["max_in_flight", "max_bytes"])
    @pytest.mark.parametrize("bad", [0, -1, 1.5, True])
    def test_a_bad_budget_is_refused_before_any_stage_starts(
        self, launch: Any, what: str, bad: Any
    ) -> None:
        before = set(child_pids())
        with pytest.raises((TypeError, ValueError), match=what):
            launch([COUNTDOWN], **{what: bad})
        assert set(child_pids()) == before


class TestLifecycle:
    def test_shutdown_with_a_drain_lets_live_requests_finish_through_every_stage(
        self, launch: Any
    ) -> None:
        pipe = launch([PipelineStage(DEVICE, {"step_s": 0.002}), RELAY, RELAY])
        streams = [pipe.add(f"r{i}", 20) for i in range(10)]
        pipe.shutdown(drain=10)
        for stream in streams:
            assert stream.collect(timeout=10) == list(range(19, -1, -1))

    def test_shutdown_without_a_drain_ends_live_streams_closed(self, launch: Any) -> None:
        pipe = launch([PipelineStage(DEVICE, {"step_s": 0.005}), RELAY])
        stream = pipe.add("r", 10**6)
        stream.get(timeout=10)
        pipe.shutdown()
        with pytest.raises(StageClosedError):
            stream.collect(timeout=10)
        with pytest.raises(StageClosedError):
            pipe.add("s", 1)
        pipe.shutdown()  # idempotent

    @pytest.mark.parametrize("drain", [None, 10.0])
    def test_shutdown_returns_every_processs_exit_code_by_its_name(
        self, launch: Any, drain: float | None
    ) -> None:
        # As a pool's shutdown() returns {replica: exit code}; it returned None, so a
        # process that had died or did not stop cleanly went unseen.
        pipe = launch(
            [PipelineStage(COUNTDOWN, name="a"), PipelineStage(RELAY, name="b", replicas=2)]
        )
        os.kill(pipe.client("b", 1).pid, signal.SIGKILL)
        assert wait_until(lambda: pipe.health()["b[1]"] != "ok", 10)
        codes = {"a": 0, "b[0]": 0, "b[1]": -signal.SIGKILL}
        assert pipe.shutdown(drain=drain) == codes
        assert pipe.shutdown() == codes  # idempotent, the same answer

    def test_shutdown_without_a_drain_stops_every_stage_at_once(self, launch: Any) -> None:
        # Stage a is frozen (SIGSTOP), so its stop waits out the shutdown's timeout. The
        # stages were stopped one after the other: b heard of the shutdown only once a had
        # exited. All are told at once now, as a pool's replicas are: b exits while a is
        # still frozen.
        pipe = launch([PipelineStage(COUNTDOWN, name="a"), PipelineStage(RELAY, name="b")])
        a, b = pipe.client("a").pid, pipe.client("b").pid
        os.kill(a, signal.SIGSTOP)
        stopper = threading.Thread(target=pipe.shutdown, kwargs={"timeout": 30})
        try:
            stopper.start()
            assert wait_until(lambda: b not in child_pids(), 20)
            with open(f"/proc/{a}/stat") as f:  # a: still there, still frozen
                assert f.read().rsplit(")", 1)[1].split()[0] == "T"
        finally:
            os.kill(a, signal.SIGCONT)
            stopper.join(60)
        assert not stopper.is_alive()
        assert not child_pids()

    def test_an_add_during_a_drain_is_refused_as_the_pipeline_shut_down(self, launch: Any) -> None:
        # Once shutdown(drain=...) has begun, an add is the pipeline's StageClosedError
        # ("the pipeline was shut down"), as after it, not a stage client's internal one
        # ("this stage client is closed"), and an add waiting for room is woken to it.
        pipe = launch([PipelineStage(DEVICE, {"step_s": 0.01}), RELAY])
        stream = pipe.add("long", 10**6)
        stream.get(timeout=10)
        closer = threading.Thread(target=pipe.shutdown, kwargs={"drain": 3.0})
        closer.start()
        refused: list[StageClosedError] = []

        def refused_now() -> bool:
            try:
                pipe.add("late", 1).collect(timeout=10)  # done before the shutdown began
            except StageClosedError as exc:
                refused.append(exc)
            return bool(refused)

        assert wait_until(refused_now, 10)
        closer.join(30)
        assert "the pipeline was shut down" in str(refused[0])

    def test_an_abort_during_a_drain_reaches_the_first_stage(self, launch: Any) -> None:
        # The first stage drains its request (the pipeline's shutdown has begun): the
        # caller's abort still reaches it. (Its client, closing, refused to send it: the
        # request ran on until the deadline.)
        pipe = launch([PipelineStage(DEVICE, {"step_s": 0.005}), RELAY])
        stream = pipe.add("r", 10**6)
        stream.get(timeout=10)
        closer = threading.Thread(target=pipe.shutdown, kwargs={"drain": 40.0})
        closer.start()
        assert wait_until(lambda: _refuses_adds(pipe), 10)
        pipe.abort(["r"])
        stream.collect(timeout=30)
        assert stream.aborted
        closer.join(30)
        assert not closer.is_alive()

    @pytest.mark.parametrize("when", ["before its own drain", "in its own drain"])
    def test_a_stage_that_dies_during_a_drain_ends_its_requests_as_a_death(
        self, launch: Any, when: str
    ) -> None:
        # A stage killed while shutdown(drain=...) drains the stages before it, or itself:
        # its requests end with its PipelineStageDeadError at once, and are aborted in the
        # stages still draining, as at any other time. (The death was ignored once the
        # shutdown had begun: the drains waited out their deadline for requests that could
        # not finish, and they ended with StageClosedError, naming no stage.)
        first = PipelineStage(DEVICE, {"step_s": 0.005}, name="a")
        pipe = launch([first, PipelineStage(RELAY, name="b"), RELAY])
        victim = pipe.call_utility("b", "pid")
        if when == "before its own drain":
            stream = pipe.add("r", 10**6)  # the first stage's drain lasts
            stream.get(timeout=10)
        else:
            pipe.call_utility("b", "hold", True)  # b's drain lasts
            stream = pipe.add("r", 3)
        closer = threading.Thread(target=pipe.shutdown, kwargs={"drain": 40.0})
        closer.start()
        assert wait_until(lambda: _refuses_adds(pipe), 10)
        if when == "in its own drain":  # its client closes once the first stage's is done
            assert wait_until(lambda: pipe.client("b").closed, 10)
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(PipelineStageDeadError) as info:
            stream.collect(timeout=30)
        assert info.value.stage == "b"
        closer.join(30)  # the drains are over: the request was aborted everywhere
        assert not closer.is_alive()

    @pytest.mark.parametrize(
        ("bad", "error"),
        [(0, ValueError), (-1, ValueError), (float("nan"), ValueError), ("5", TypeError)],
    )
    def test_a_bad_startup_timeout_is_refused_before_any_process_starts(
        self, bad: Any, error: type[Exception], no_leftovers: str
    ) -> None:
        with pytest.raises(error, match="startup_timeout must be"):
            Pipeline.launch([COUNTDOWN, RELAY], startup_timeout=bad)
        with pytest.raises(error, match="startup_timeout must be"):
            asyncio.run(AsyncPipeline.launch([COUNTDOWN, RELAY], startup_timeout=bad))

    def test_shutdown_right_after_a_death_leaves_no_thread_behind(self, launch: Any) -> None:
        # After a death the parent unlinks the segments around the dead stage, and again
        # half a second later, on a timer thread: shutdown() cancels it (its own unlink
        # covers every segment of the pipeline), so no thread of the pipeline outlives it.
        before = {t for t in threading.enumerate() if isinstance(t, threading.Timer)}
        pipe = launch([COUNTDOWN, PipelineStage(RELAY, name="mid")])
        os.kill(pipe.call_utility("mid", "pid"), signal.SIGKILL)
        assert wait_until(lambda: pipe.health()["mid"] == "dead", 10)
        pipe.shutdown()
        timers = {t for t in threading.enumerate() if isinstance(t, threading.Timer)}
        assert not timers - before

    def test_a_cancelled_collect_of_an_async_stream_keeps_what_it_read(
        self, no_leftovers: str
    ) -> None:
        # asyncio.wait_for(stream.collect(), t) or a task's cancel() while collect() waits
        # for the end: the payloads it had read stay in the stream, as with its timeout.
        async def main() -> list[Any]:
            stages = [
                PipelineStage(COUNTDOWN, name="first", edge=f"{T}:tee"),
                PipelineStage(RELAY, name="last"),
            ]
            async with await AsyncPipeline.launch(stages, startup_timeout=30) as pipe:
                await pipe.call_utility("last", "hold", True)  # r does not end meanwhile
                stream = await pipe.add("r", 5)

                async def sent() -> bool:  # its answer follows the tee's 5 to the caller
                    stats = (await pipe.stats())["first"]
                    assert not isinstance(stats, Exception)
                    return bool(stats.engine.get("edge_sent", 0) >= 5)

                while not await sent():
                    await asyncio.sleep(0.01)
                task = asyncio.ensure_future(stream.collect())
                for _ in range(3):
                    await asyncio.sleep(0)  # it takes the 5, then waits for the end
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                await pipe.call_utility("last", "hold", False)
                return await stream.collect(timeout=10)

        assert asyncio.run(main()) == [4, 3, 2, 1, 0] * 2

    def test_a_collect_interrupted_by_ctrl_c_keeps_what_it_read(self, no_leftovers: str) -> None:
        # The blocking stream's collect(), waiting for the end, gets a KeyboardInterrupt:
        # the payloads it had read stay in the stream, as with its timeout (and as a
        # cancelled async collect() keeps them). They were lost.
        stages = [
            PipelineStage(COUNTDOWN, name="first", edge=f"{T}:tee"),
            PipelineStage(RELAY, name="last"),
        ]
        with Pipeline.launch(stages, startup_timeout=30) as pipe:
            pipe.call_utility("last", "hold", True)  # r does not end meanwhile
            stream = pipe.add("r", 5)

            def sent() -> bool:  # its answer follows the tee's 5 to the caller
                stats = pipe.stats()["first"]
                assert not isinstance(stats, Exception)
                return bool(stats.engine.get("edge_sent", 0) >= 5)

            assert wait_until(sent, 10)
            timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
            timer.start()
            try:
                with pytest.raises(KeyboardInterrupt):
                    stream.collect(timeout=30)  # it takes the 5, then waits for the end
            finally:
                timer.join()
            pipe.call_utility("last", "hold", False)
            assert stream.collect(timeout=10) == [4, 3, 2, 1, 0] * 2

    @pytest.mark.parametrize(
        ("drain", "cancel"), [(None, "caller"), (30.0, "caller"), (None, "every task")]
    )
    def test_a_cancelled_async_shutdown_still_stops_every_stage(
        self, drain: float | None, cancel: str, no_leftovers: str
    ) -> None:
        # asyncio.wait_for(pipe.shutdown(), t) or a task's cancel() while shutdown() waits
        # for a stage: the shutdown goes on, and a second call waits for it. (It stopped
        # where it was cancelled, and the second call returned at once: the stages after
        # it kept running, and their streams never ended.) An application that cancels
        # every task as it exits cancels the shutdown's own: a second call does the rest.
        async def main() -> None:
            stages = [PipelineStage(DEVICE, {"step_s": 0.005}), PipelineStage(RELAY, name="b")]
            pipe = await AsyncPipeline.launch(stages, startup_timeout=30)
            stream = await pipe.add("r", 10**6 if drain is None else 400)
            await stream.__anext__()
            assert len(child_pids()) == 2
            task = asyncio.ensure_future(pipe.shutdown(drain=drain))
            await asyncio.sleep(0)  # it waits for the first stage now
            if cancel == "caller":
                task.cancel()
            else:
                for other in asyncio.all_tasks():
                    if other is not asyncio.current_task():
                        other.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(pipe.shutdown(), 60)
            assert not child_pids()
            if drain is None:
                with pytest.raises(StageClosedError):
                    await stream.collect(timeout=10)
            else:
                assert len(await stream.collect(timeout=10)) == 399

        asyncio.run(main())

    @pytest.mark.parametrize("drain", [None, 10.0])
    def test_a_shutdown_interrupted_by_ctrl_c_is_finished_by_the_next_call(
        self, drain: float | None, no_leftovers: str
    ) -> None:
        # A KeyboardInterrupt while Pipeline.shutdown() waits for a stage (every stage at
        # once without a drain; stage by stage with one): a second call finishes it, stops
        # what the first had not, and ends the streams. (It returned at once: the stages
        # not yet stopped kept running, and their streams never ended.)
        pipe = Pipeline.launch([COUNTDOWN, PipelineStage(RELAY, name="b")], startup_timeout=30)
        try:
            pipe.call_utility("b", "hold", True)  # before the add: r stays in b
            stream = pipe.add("r", 3)
            first = pipe.client(COUNTDOWN)
            real = first.shutdown
            main = threading.main_thread().ident
            assert main == threading.get_ident()

            def interrupted(*args: Any, **kwargs: Any) -> Any:
                code = real(*args, **kwargs)
                if threading.get_ident() == main:
                    raise KeyboardInterrupt
                signal.pthread_kill(main, signal.SIGINT)  # Ctrl-C, while the caller waits
                return code

            first.shutdown = interrupted  # type: ignore[method-assign]
            with pytest.raises(KeyboardInterrupt):
                pipe.shutdown(drain=drain)
            del first.shutdown  # the real one again
            assert not pipe.client("b").closed or drain is None  # drained: b not reached
        finally:
            pipe.shutdown()
        assert not child_pids()
        with pytest.raises(StageClosedError):
            stream.collect(timeout=10)

    @pytest.mark.parametrize(
        ("drain", "error"), [(-1.0, ValueError), (float("nan"), ValueError), ("5", TypeError)]
    )
    def test_a_bad_drain_is_refused_and_the_pipeline_goes_on(
        self, launch: Any, drain: Any, error: type[Exception]
    ) -> None:
        pipe = launch([COUNTDOWN, RELAY])
        with pytest.raises(error, match="drain must be"):
            pipe.shutdown(drain=drain)
        assert pipe.add("r", 2).collect(timeout=10) == [1, 0]

    def test_a_stage_that_fails_to_start_leaves_nothing_behind(self, launch: Any) -> None:
        with pytest.raises(StageStartupError, match="on purpose"):
            launch([COUNTDOWN, f"{T}:failing_factory", RELAY])

    @pytest.mark.parametrize("factory", ["failing_factory", "exiting_factory"])
    def test_a_stage_that_fails_to_start_is_named_in_the_error(
        self, launch: Any, factory: str
    ) -> None:
        # The error names the pipeline's stage and its factory, not the wrapper every
        # stage process runs (enginecore.stage._pipe_stage:pipe_stage).
        with pytest.raises(StageStartupError) as info:
            launch([COUNTDOWN, PipelineStage(f"{T}:{factory}", name="vocoder"), RELAY])
        message = str(info.value)
        assert f"pipeline stage 'vocoder' (factory '{T}:{factory}')" in message
        assert "_pipe_stage" not in message.split("\n", maxsplit=1)[0]

    def test_stats_and_health_by_stage_name(self, launch: Any) -> None:
        pipe = launch([PipelineStage(COUNTDOWN, name="a"), PipelineStage(RELAY, name="b")])
        pipe.add("r", 3).collect(timeout=10)
        assert set(pipe.health()) == {"a", "b"}
        assert all(h == "ok" for h in pipe.health().values())
        stats = pipe.stats()
        assert stats["a"].loop.adds == 1
        assert stats["b"].loop.adds == 1  # b's add came from a
        assert stats["b"].name == "b"
        # Each stage's factory is the user's, not the wrapper every stage is launched with
        # (it is what enginecore_stage_info{engine=} shows for a pipeline's process).
        assert (stats["a"].factory, stats["b"].factory) == (COUNTDOWN, RELAY)
        with pytest.raises(KeyError, match="no stage named 'c'"):
            pipe.client("c")
        with pytest.raises(IndexError, match=r"stage 'b' has no replica 1 \(it has 1: 0\)"):
            pipe.call_utility("b", "pid", replica=1)

    def test_a_stopped_stage_is_stalled_and_its_warning_names_it(
        self, launch: Any, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.WARNING, logger="enginecore.stage")
        pipe = launch([PipelineStage(COUNTDOWN, name="a"), PipelineStage(RELAY, name="b")])
        pid = pipe.call_utility("b", "pid")
        os.kill(pid, signal.SIGSTOP)
        try:
            assert wait_until(lambda: pipe.health()["b"] == "stalled", 10)
            said = f"pipeline stage 'b' (stage process {pid}) has not answered"
            assert wait_until(lambda: any(said in r.getMessage() for r in caplog.records), 5)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert wait_until(lambda: pipe.health()["b"] == "ok", 10)
        assert pipe.add("r", 2).collect(timeout=10) == [1, 0]

    @pytest.mark.parametrize(
        ("stages", "why"),
        [
            ([], "one or more stages"),
            (COUNTDOWN, "one or more stages"),
            ([PipelineStage(COUNTDOWN, edge=f"{T}:tee")], "has no next stage"),
            ([PipelineStage(COUNTDOWN, name="x"), PipelineStage(RELAY, name="x")], "named 'x'"),
        ],
    )
    def test_bad_stage_lists_are_refused_before_any_stage_starts(
        self, launch: Any, stages: Any, why: str
    ) -> None:
        before = set(child_pids())
        with pytest.raises(ValueError, match=why):
            launch(stages)
        assert set(child_pids()) == before

    def test_an_edge_must_be_an_import_string(self) -> None:
        with pytest.raises(TypeError, match="import string"):
            PipelineStage(COUNTDOWN, edge=print)  # type: ignore[arg-type]


MIB = 1 << 20


class TestRetry:
    """``on_next_error=Retry(n)``: a request the next stage fails is sent to it again."""

    @pytest.mark.parametrize("when", ["add", "first"])
    def test_a_failed_request_is_replayed_to_the_stage_that_failed_it(
        self, launch: Any, when: str
    ) -> None:
        pipe = launch(
            [
                PipelineStage(COUNTDOWN, name="first", on_next_error=Retry(2)),
                PipelineStage(FLAKY, {"fail_first": 2, "when": when}, name="flaky"),
            ]
        )
        assert pipe.add("r", 3).collect(timeout=10) == [2, 1, 0]
        assert pipe.call_utility("flaky", "attempts", "r") == 3
        # The engine's numbers are the loop's last sample (taken when it goes idle): wait.
        assert wait_until(lambda: pipe.stats()["first"].engine["replays"] == 2, 10)
        # Done: its id and place are free, and the first stage forgot its log.
        assert wait_until(lambda: pipe.in_flight == 0, 10)
        assert wait_until(lambda: pipe.stats()["first"].engine["replay_logged"] == 0, 10)
        assert pipe.add("r", 2).collect(timeout=10) == [1, 0]
        # A request of one payload, which ended in the first stage: replayed as its one
        # input (kind "first and end").
        assert pipe.add("one", 1).collect(timeout=10) == [0]
        assert pipe.call_utility("flaky", "attempts", "one") == 3

    def test_a_request_the_first_stage_still_produces_is_replayed_then_goes_on(
        self, launch: Any
    ) -> None:
        # The first stage sends one payload every 50 ms: the next stage fails the request
        # at its first, and the replay (of what was sent so far) comes while the first
        # stage still produces; what it sends after follows the replay, in order.
        pipe = launch(
            [
                PipelineStage(DEVICE, {"step_s": 0.05}, name="first", on_next_error=Retry(1)),
                PipelineStage(FLAKY, {"fail_first": 1}, name="flaky"),
            ]
        )
        assert pipe.add("r", 8).collect(timeout=20) == [7, 6, 5, 4, 3, 2, 1, 0]
        assert pipe.call_utility("flaky", "attempts", "r") == 2

    def test_after_n_retries_the_error_names_the_stage_and_says_so(self, launch: Any) -> None:
        pipe = launch(
            [
                PipelineStage(COUNTDOWN, name="first", on_next_error=Retry(2)),
                PipelineStage(FLAKY, {"fail_first": 3}, name="flaky"),
            ]
        )
        with pytest.raises(PipelineRequestError, match=r"retried 2 times") as info:
            pipe.add("r", 3).collect(timeout=10)
        assert info.value.stage == "flaky"
        assert "fails on purpose" in info.value.message
        assert pipe.call_utility("flaky", "attempts", "r") == 3
        assert wait_until(lambda: pipe.in_flight == 0, 10)
        assert wait_until(lambda: pipe.stats()["first"].engine["replay_logged"] == 0, 10)
        # The fourth attempt of the id succeeds: the pipeline goes on.
        assert pipe.add("r", 1).collect(timeout=10) == [0]

    def test_fail_is_the_default(self, launch: Any) -> None:
        pipe = launch([COUNTDOWN, PipelineStage(FLAKY, {"fail_first": 1}, name="flaky")])
        with pytest.raises(PipelineRequestError, match="fails on purpose") as info:
            pipe.add("r", 3).collect(timeout=10)
        assert info.value.stage == "flaky"
        assert pipe.call_utility("flaky", "attempts", "r") == 1

    def test_the_replay_fences_what_the_failed_attempt_sent_on(self, launch: Any) -> None:
        # "mid" sends 2 and 1 on to "last", then fails the request at its end. "last" holds
        # its outputs meanwhile, so nothing reached the caller: the request is retried.
        # The first stage's abort down the link (the fence) drops the failed attempt's part
        # in "last"; without it, the replay's first input would find the request still live
        # there. The caller gets each payload once.
        pipe = launch(
            [
                PipelineStage(COUNTDOWN, name="first", on_next_error=Retry(1)),
                PipelineStage(FLAKY, {"fail_first": 1, "when": "last"}, name="mid"),
                PipelineStage(RELAY, name="last"),
            ]
        )
        pipe.call_utility("last", "hold", True)
        stream = pipe.add("r", 3)
        assert wait_until(lambda: pipe.call_utility("mid", "attempts", "r") == 2, 10)
        pipe.call_utility("last", "hold", False)
        assert stream.collect(timeout=10) == [2, 1, 0]
        assert wait_until(lambda: pipe.in_flight == 0, 10)
        assert pipe.call_utility("last", "num_requests") == 0

    def test_no_retry_once_the_failed_stage_sent_the_caller_something(self, launch: Any) -> None:
        pipe = launch(
            [
                PipelineStage(COUNTDOWN, name="first", on_next_error=Retry(3)),
                PipelineStage(FLAKY, {"fail_first": 5, "when": "last"}, name="last"),
            ]
        )
        stream = pipe.add("r", 3)
        assert stream.get(timeout=10) == 2
        assert stream.get(timeout=10) == 1
        with pytest.raises(PipelineRequestError, match="not retried") as info:
            stream.get(timeout=10)  # then the error: never a payload twice
        assert info.value.stage == "last"
        assert pipe.call_utility("last", "attempts", "r") == 1

    def test_a_request_over_the_replay_log_bound_is_not_retried(self, launch: Any) -> None:
        # "mid" fails each request once, at its end, after the first stage ended it (its
        # log is complete); "last" holds what it got, so that nothing reaches the caller
        # before the retry.
        pipe = launch(
            [
                PipelineStage(COUNTDOWN, name="first", on_next_error=Retry(3, max_bytes=20)),
                PipelineStage(FLAKY, {"fail_first": 1, "when": "last"}, name="mid"),
                PipelineStage(RELAY, name="last"),
            ]
        )
        pipe.call_utility("last", "hold", True)
        # Two ints (8 bytes each, as the log counts them) fit in 20 bytes: retried.
        stream = pipe.add("small", 2)
        assert wait_until(lambda: pipe.call_utility("mid", "attempts", "small") == 2, 10)
        pipe.call_utility("last", "hold", False)
        assert stream.collect(timeout=10) == [1, 0]
        # Three do not: the first stage let the log go, and the replay fails.
        pipe.call_utility("last", "hold", True)
        with pytest.raises(PipelineRequestError, match="exceeded the replay log's bound") as info:
            pipe.add("big", 3).collect(timeout=10)
        assert info.value.stage == "mid"
        assert "fails on purpose" in info.value.message
        pipe.call_utility("last", "hold", False)
        assert pipe.call_utility("mid", "attempts", "big") == 1
        assert wait_until(lambda: pipe.in_flight == 0, 10)

    def test_many_requests_retried_at_once_each_end_once(self, launch: Any) -> None:
        pipe = launch(
            [
                PipelineStage(COUNTDOWN, name="first", on_next_error=Retry(1)),
                PipelineStage(FLAKY, {"fail_first": 1, "when": "first"}, name="mid"),
                PipelineStage(RELAY, name="last"),
            ]
        )
        streams = pipe.add_many([(f"r{i}", 5) for i in range(30)])
        for stream in streams:
            assert stream.collect(timeout=20) == [4, 3, 2, 1, 0]
        assert wait_until(lambda: pipe.in_flight == 0, 10)
        assert _engine(pipe, "first", _replayed)["replays"] == 30

    def test_the_callers_abort_after_a_retry_ends_the_request_aborted(self, launch: Any) -> None:
        # The stages answer the replay's fence and the abort: the stream ends aborted only
        # once all are in, and the id is free again.
        pipe = launch(
            [
                PipelineStage(COUNTDOWN, name="first", on_next_error=Retry(1)),
                PipelineStage(FLAKY, {"fail_first": 1, "when": "last"}, name="mid"),
                PipelineStage(RELAY, name="last"),
            ]
        )
        pipe.call_utility("last", "hold", True)
        stream = pipe.add("r", 3)
        assert wait_until(lambda: pipe.call_utility("mid", "attempts", "r") == 2, 10)
        pipe.abort(["r"])
        assert stream.collect(timeout=10) == []
        assert stream.aborted
        assert wait_until(lambda: pipe.in_flight == 0, 10)
        pipe.call_utility("last", "hold", False)
        assert pipe.call_utility("last", "num_requests") == 0
        assert wait_until(lambda: pipe.stats()["first"].engine["replay_logged"] == 0, 10)
        assert pipe.add("r", 2).collect(timeout=10) == [1, 0]

    def test_an_error_it_would_retry_after_the_callers_abort_ends_the_request_aborted(
        self, launch: Any, no_leftovers: str
    ) -> None:
        # The other order: the caller aborts first, and the next stage fails the request
        # before that abort reaches it. The two crossed: the stream ends aborted, not with
        # that error (which a retry would have hidden), and nothing is replayed.
        pipe = launch(
            [
                PipelineStage(RELAY, name="first", on_next_error=Retry(3)),
                PipelineStage(FLAKY, {"fail_first": 3, "when": "first"}, name="mid"),
            ]
        )
        pipe.call_utility("mid", "hold", True)  # mid takes r, and steps only when told
        stream = pipe.add("r", "x")
        assert wait_until(lambda: pipe.call_utility("mid", "num_requests") == 1, 10)
        gate = pathlib.Path(no_leftovers, "gate")
        gate.touch()  # first's loop blocks: the abort waits there, behind the gate
        holder = threading.Thread(target=pipe.call_utility, args=("first", "gate", str(gate), 30.0))
        holder.start()
        assert wait_until(lambda: pipe.stats()["first"].loop.utility_calls >= 1, 10)
        pipe.abort(["r"])
        pipe.call_utility("mid", "hold", False)  # mid fails r: its error reaches the caller
        # mid's answer comes after its error on the same connection: the error is in.
        assert wait_until(lambda: pipe.call_utility("mid", "num_requests") == 0, 10)
        gate.unlink()
        holder.join(10)
        assert stream.collect(timeout=10) == []
        assert stream.aborted
        assert wait_until(lambda: pipe.in_flight == 0, 10)
        assert pipe.stats()["first"].engine["replays"] == 0
        assert pipe.add("r", "y").collect(timeout=10) == ["y"]

    @pytest.mark.skipif(not _shm.available(), reason="no /dev/shm")
    def test_arrays_in_shared_memory_are_replayed(self, launch: Any) -> None:
        # The log holds the arrays the first stage sent; the replay writes them into its
        # slots again.
        pipe = launch(
            [
                PipelineStage(
                    COUNTDOWN, name="first", edge=f"{T}:to_array", on_next_error=Retry(1)
                ),
                PipelineStage(FLAKY, {"fail_first": 1, "when": "first"}, name="flaky"),
            ]
        )
        arrays = pipe.add("r", 3).collect(timeout=10)
        assert [float(a[0]) for a in arrays] == [2.0, 1.0, 0.0]
        assert all(a.shape == (1 << 18,) and (a == a[0]).all() for a in arrays)
        stats = _engine(pipe, "first", _replayed)
        assert stats["replays"] == 1
        assert stats["shm_sent"] >= 4  # the first attempt's one at least, and the replay's

    def test_bad_policies_are_refused(self) -> None:
        with pytest.raises(ValueError, match="'fail' or Retry"):
            PipelineStage(COUNTDOWN, on_next_error="retry")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="'fail' or Retry"):
            PipelineStage(COUNTDOWN, on_next_error=2)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="times must be an int >= 1"):
            Retry(0)
        with pytest.raises(TypeError, match="times must be an int >= 1"):
            Retry(True)
        with pytest.raises(ValueError, match="max_bytes must be an int >= 1"):
            Retry(1, max_bytes=0)
        with pytest.raises(ValueError, match="no next stage, so no on_next_error"):
            Pipeline.launch([COUNTDOWN, PipelineStage(RELAY, on_next_error=Retry(1))])


def _segments() -> list[str]:
    """The shared-memory segments of this process's pipelines in ``/dev/shm``."""
    return _shm.segments(f"enginecore-{os.getpid()}-")


@pytest.mark.skipif(not _shm.available(), reason="needs /dev/shm (Linux)")
class TestSharedMemory:
    def test_a_big_array_goes_through_shared_memory_and_arrives_equal(self, launch: Any) -> None:
        pipe = launch([PipelineStage(ECHO, name="a"), PipelineStage(RELAY, name="b")])
        image = np.random.default_rng(0).random((512, 256))  # 1 MiB of float64
        small = np.arange(1000.0)  # below the threshold: on ZeroMQ
        (back,) = pipe.add("r", {"image": image, "small": small}).collect(timeout=30)
        assert np.array_equal(back["image"], image)
        assert np.array_equal(back["small"], small)
        edge = _engine(pipe, "a", lambda e: e["shm_sent"] > 0)
        assert edge["shm_sent"] == 1
        assert edge["shm_sent_bytes"] == image.nbytes
        assert edge["edge_sent_bytes"] > image.nbytes  # the window counts the shm bytes...
        # ...and so does the credit the next stage gives back.
        assert wait_until(lambda: pipe.stats()["a"].engine["edge_in_flight_bytes"] == 0, 10)
        assert len(_segments()) == 1  # the slot, kept for the next payload
        pipe.shutdown()
        assert _segments() == []  # a clean shutdown leaves nothing in /dev/shm

    def test_a_hop_is_timed_inside_the_pipeline(self, launch: Any) -> None:
        # The edges bench_pipeline_faults times the 64 MiB hop with: the first stamps the
        # output as it leaves, the second answers the seconds since, and nothing goes on.
        pipe = launch(
            [
                PipelineStage(ECHO, name="a", edge=f"{T}:stamp"),
                PipelineStage(RELAY, name="b", edge=f"{T}:hop_seconds"),
                PipelineStage(RELAY, name="c"),
            ]
        )
        started = time.perf_counter()
        (hop,) = pipe.add("r", np.ones(MIB, dtype=np.uint8)).collect(timeout=30)
        assert 0 < hop < time.perf_counter() - started
        assert _engine(pipe, "a", lambda e: e["shm_sent"] > 0)["shm_sent"] == 1
        # b's numbers once they count what it took: c never heard of it.
        assert _engine(pipe, "b", lambda e: e["shm_taken"] > 0)["edge_sent"] == 0

    def test_below_the_threshold_or_without_one_arrays_stay_on_zeromq(self, launch: Any) -> None:
        pipe = launch(
            [
                PipelineStage(ECHO, name="a", shm_threshold=None),
                PipelineStage(RELAY, name="b", shm_threshold=4 * MIB),
                PipelineStage(RELAY, name="c"),
            ]
        )
        image = np.ones((512, 512), dtype=np.float32)  # 1 MiB
        (back,) = pipe.add("r", image).collect(timeout=30)
        assert np.array_equal(back, image)
        stats = pipe.stats()
        assert "shm_sent" not in stats["a"].engine
        assert stats["b"].engine["shm_sent"] == 0
        assert _segments() == []

    def test_a_slot_is_never_rewritten_while_the_next_stage_holds_its_array(
        self, launch: Any
    ) -> None:
        # The echo stage (no feed) holds every input of a request until the request ends
        # (and its output was sent, a zero-copy frame: until ZeroMQ let go of it); the pool
        # has room for 3 of the 8 arrays: the others go on ZeroMQ, counted, and no slot is
        # rewritten while an array on it is alive. Then a streaming stage, which lets each
        # array go as soon as its output is sent: slots are reused, every array intact.
        pipe = launch(
            [
                PipelineStage(COUNTDOWN, name="a", edge=f"{T}:to_array", shm_pool_bytes=3 * MIB),
                PipelineStage(ECHO, name="b"),
            ]
        )
        for r in range(3):
            (arrays,) = pipe.add(f"r{r}", 8).collect(timeout=30)
            assert [float(a[0]) for a in arrays] == [7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.0]
            assert all(bool(np.all(a == a[0])) for a in arrays)
        edge = _engine(pipe, "a", lambda e: e["shm_sent"] + e["shm_fallbacks"] >= 24)
        assert edge["shm_sent"] >= 3  # the first request's first three, at least
        assert edge["shm_fallbacks"] >= 5
        assert edge["shm_sent"] + edge["shm_fallbacks"] == 24
        assert edge["shm_slot_bytes"] <= 3 * MIB
        pipe.shutdown()
        relayed = launch(
            [
                PipelineStage(COUNTDOWN, name="a", edge=f"{T}:to_array", shm_pool_bytes=2 * MIB),
                PipelineStage(RELAY, name="b"),
            ]
        )
        outputs = relayed.add("r", 40).collect(timeout=60)
        assert [float(a[0]) for a in outputs] == [float(k) for k in range(39, -1, -1)]
        assert all(bool(np.all(a == a[0])) for a in outputs)
        edge = _engine(relayed, "a", lambda e: e["shm_sent"] + e["shm_fallbacks"] >= 40)
        assert edge["shm_sent"] + edge["shm_fallbacks"] == 40
        assert edge["shm_retired"] == 0

    def test_a_payload_whose_lease_expired_fails_its_request_with_a_named_error(
        self, launch: Any
    ) -> None:
        pipe = launch(
            [PipelineStage(ECHO, name="a", shm_lease=0.2), PipelineStage(RELAY, name="b")]
        )
        first = np.full(MIB // 4, 1.0, dtype=np.float32)
        pid = pipe.call_utility("b", "pid")
        os.kill(pid, signal.SIGSTOP)  # b can read nothing: the payload waits in its socket
        try:
            stream = pipe.add("r", first)
            assert wait_until(lambda: len(_segments()) == 1, 10)  # the payload's slot
            assert wait_until(_lease_ran_out, 10)  # what is under test (0.2 s): until it did
        finally:
            os.kill(pid, signal.SIGCONT)
        with pytest.raises(PipelineRequestError) as info:
            stream.collect(timeout=10)
        assert info.value.stage == "b"
        assert "SharedMemoryLeaseExpired: " in info.value.message
        assert "expired" in info.value.message
        # The pipeline goes on. The producer retires the expired slot (never rewrites it)
        # and takes a new one.
        second = np.full(MIB // 4, 2.0, dtype=np.float32)
        (back,) = pipe.add("r2", second).collect(timeout=10)
        assert np.array_equal(back, second)
        # a's numbers once they count the second payload it sent (r2 may be back first).
        edge = _engine(pipe, "a", lambda e: e["shm_sent"] >= 2)
        assert edge["shm_retired"] == 1
        assert len(_segments()) == 1
        taker = _engine(pipe, "b", lambda e: e["shm_taken"] > 0)
        assert (taker["shm_taken"], taker["shm_refused"]) == (1, 1)
        # The refused payload's bytes came back as credit too: nothing is left in flight.
        assert wait_until(lambda: pipe.stats()["a"].engine["edge_in_flight_bytes"] == 0, 10)

    @pytest.mark.parametrize(
        ("bad", "error"),
        [
            ({"shm_threshold": 0}, ValueError),
            ({"shm_threshold": 1.5}, TypeError),  # the wrong type: TypeError
            ({"shm_pool_bytes": 0}, ValueError),
            ({"shm_pool_bytes": True}, TypeError),
            ({"shm_lease": 0}, ValueError),
            ({"shm_lease": -1.0}, ValueError),
            ({"shm_lease": True}, TypeError),
            ({"shm_lease": "10"}, TypeError),
        ],
    )
    def test_bad_shared_memory_options_are_refused(
        self, bad: dict[str, Any], error: type[Exception]
    ) -> None:
        with pytest.raises(error, match=next(iter(bad))):
            PipelineStage(ECHO, **bad)

    @pytest.mark.parametrize("killed", ["a", "b"])
    def test_a_killed_stage_leaves_no_segment_within_the_lease_and_a_second(
        self, launch: Any, killed: str
    ) -> None:
        # a and b each send the next stage 1 MiB arrays through their slots. The parent
        # unlinks the killed stage's segments (it cannot), and those of the stage before
        # it (which can no longer be released); a live stage after it keeps its own until
        # the pipeline shuts down.
        lease = 1.0
        pipe = launch(
            [
                PipelineStage(
                    DEVICE, {"step_s": 0.005}, name="a", edge=f"{T}:to_array", shm_lease=lease
                ),
                PipelineStage(RELAY, name="b", shm_lease=lease),
                PipelineStage(RELAY, name="c"),
            ]
        )
        stream = pipe.add("r", 10**6)
        for _ in range(5):
            stream.get(timeout=10)

        def stages() -> set[str]:  # the stages with segments: <prefix>-<stage>-<n>
            return {name.split("-")[3] for name in _segments()}

        assert wait_until(lambda: stages() == {"0", "1"}, 10)
        os.kill(pipe.call_utility(killed, "pid"), signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(PipelineStageDeadError) as info:
            stream.collect(timeout=5)
        assert info.value.stage == killed
        gone = {"0"} if killed == "a" else {"0", "1"}
        assert wait_until(lambda: not stages() & gone, lease + 1.0)
        assert time.monotonic() - killed_at < lease + 1.0
        pipe.shutdown()
        assert _segments() == []

    @pytest.mark.parametrize("killed", ["a", "b"])
    def test_a_killed_stage_s_neighbours_let_go_of_its_memory_at_once(
        self, launch: Any, killed: str
    ) -> None:
        # a -> b -> c, 1 MiB arrays through shared memory on both edges; the lease is long
        # (60 s), so nothing here waits for it. When a stage dies, the stage before it
        # unmaps its slots (the dead one can release none of them), and the stage after it
        # lets go of its mappings of the dead one's slots once the abort dropped the arrays
        # it held: no surviving process maps a segment of either any more, and no request
        # is left live in a stage after the dead one. (Before: both stayed mapped, their
        # memory held, until shutdown.)
        lease = 60.0
        pipe = launch(
            [
                PipelineStage(
                    DEVICE, {"step_s": 0.005}, name="a", edge=f"{T}:to_array", shm_lease=lease
                ),
                PipelineStage(RELAY, name="b", shm_lease=lease),
                PipelineStage(RELAY, name="c"),
            ]
        )
        pids = {name: pipe.call_utility(name, "pid") for name in ("a", "b", "c")}
        streams = [pipe.add(f"r{i}", 10**6) for i in range(3)]
        for stream in streams:
            for _ in range(3):
                stream.get(timeout=10)
        assert wait_until(lambda: _mapped(pids["c"], "1"), 10)  # c maps b's slots
        assert _mapped(pids["a"], "0")
        os.kill(pids[killed], signal.SIGKILL)
        for stream in streams:
            with pytest.raises(PipelineStageDeadError):
                stream.collect(timeout=5)
        k = "ab".index(killed)
        before, after = "abc"[k - 1] if k else None, "abc"[k + 1]

        # The stage after the dead one: nothing live, no array held, no slot mapped.
        # (The engine's numbers in the statistics are a sample its loop takes when it goes
        # idle: an array that a zero-copy frame still held then is let go later. The maps
        # are the truth.)
        assert wait_until(lambda: _stage_stats(pipe, after).live == 0, 10)
        assert wait_until(lambda: not _mapped(pids[after], str(k)), 10)
        assert wait_until(lambda: _stage_stats(pipe, after).engine["shm_mapped"] == 0, 10)
        if before is not None:  # the stage before it: its slots unmapped, none kept

            def before_done() -> bool:
                engine = _stage_stats(pipe, before).engine
                return (engine["shm_slots"], engine["shm_slot_bytes"]) == (0, 0)

            assert wait_until(before_done, 10)
            assert not _mapped(pids[before], str(k - 1))
            assert "edge_dropped" in _stage_stats(pipe, before).engine
        pipe.shutdown()
        assert _segments() == []


def _lease_ran_out() -> bool:
    """Whether the one slot of this test's pipeline holds its first payload (generation 1),
    written with its lease, and the lease is over: read from the slot's header, which no
    one renews while the next stage is stopped (it must refuse the payload)."""
    names = _segments()
    if len(names) != 1:
        return False
    fd = os.open(os.path.join(_shm.SHM_DIR, names[0]), os.O_RDONLY)
    try:
        raw = os.pread(fd, 64, 0)
    finally:
        os.close(fd)
    if len(raw) < 64:  # created, not sized yet: no header to read
        return False
    header = struct.unpack("=8q", raw)
    until = header[_shm._H_LEASE_UNTIL]  # written after the generation: 0 until then
    return bool(header[_shm._H_GEN] == 1 and 0 < until < time.monotonic_ns())


def _engine(pipe: Any, stage: str, settled: Any) -> Any:
    """Stage *stage*'s engine numbers once *settled* holds for them (``settled_engine``:
    they are a sample its loop takes when it goes idle, which may lag a result)."""
    return settled_engine(lambda: pipe.stats()[stage].engine, settled)


def _replayed(engine: Any) -> bool:
    """Whether a first stage's engine numbers are a sample taken after it replayed, and
    after every request left its replay log (ended)."""
    return bool(engine["replays"] > 0 and engine["replay_logged"] == 0)


def _stage_stats(pipe: Any, stage: str) -> Any:
    """One stage's statistics (``pipe.stats()`` asks every stage, a dead one too)."""
    if isinstance(pipe, BlockingAsyncPipeline):
        return pipe._runner.run(pipe._pipe.client(stage).stats())
    return pipe.client(stage).stats()


def _mapped(pid: int, stage: str) -> list[str]:
    """The shared-memory segments of stage *stage* of this process's pipelines that process
    *pid* maps now (unlinked or not)."""
    head = f"/dev/shm/enginecore-{os.getpid()}-"
    with open(f"/proc/{pid}/maps") as f:
        paths = {line.split(maxsplit=5)[5].strip() for line in f if head in line}
    return sorted(p for p in paths if p[len("/dev/shm/") :].split("-")[3] == stage)


# -- parity of the blocking and asyncio pipelines ---------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"timeout": float("inf")}, ValueError, "timeout must be a finite number of seconds"),
        ({"timeout": None}, TypeError, "timeout must be a number of seconds, got NoneType"),
        ({"timeout": -1.0}, ValueError, "timeout must be a finite number of seconds >= 0"),
        ({"drain": float("inf")}, ValueError, "drain must be a number of seconds >= 0, got inf"),
        # Both bad: the timeout is named first, by either pipeline, as by a client or a pool.
        ({"timeout": -1.0, "drain": -1.0}, ValueError, "timeout must be"),
    ],
)
def test_a_shutdown_timeout_or_drain_no_stage_accepts_is_refused_before_anything_stops(
    launch: Any, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    """A timeout or drain that a stage's client refuses (infinite, or no timeout) is the
    pipeline's error, with the client's message: given to each stage's client, whose errors
    the shutdown suppresses, it returned at once with every stage still running."""
    pipe = launch([COUNTDOWN, RELAY])
    with pytest.raises(error, match=match):
        pipe.shutdown(**kwargs)
    assert all(health == "ok" for health in pipe.health().values())
    assert pipe.add("r", 2).collect(timeout=10) == [1, 0]
    pipe.shutdown()
    assert all(health == "dead" for health in pipe.health().values())


def test_an_empty_add_many_after_shutdown_is_refused_as_a_clients(launch: Any) -> None:
    # It returned [] where a client's add_many([]) raises StageClosedError.
    pipe = launch([COUNTDOWN, RELAY])
    assert pipe.add_many([]) == []  # open: nothing to add, nothing sent
    pipe.shutdown()
    with pytest.raises(StageClosedError):
        pipe.add_many([])


def test_an_abort_after_shutdown_is_refused_as_a_clients(launch: Any) -> None:
    # It was ignored, where a closed client's (and pool's) abort raises StageClosedError.
    pipe = launch([COUNTDOWN, RELAY])
    pipe.abort(["nobody"])  # open: an unknown id is ignored
    pipe.shutdown()
    with pytest.raises(StageClosedError, match="shut down"):
        pipe.abort(["nobody"])
