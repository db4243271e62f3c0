"""A model check of the replica pool: adds, bursts, aborts, steps, replica deaths,
restarts (of restart groups too, failed ones included), migrations and membership changes,
interleaved by hypothesis.

The pool under test is the real :class:`~enginecore.stage._poolbase.PoolBase` and
:class:`~enginecore.stage._pool_core.PoolCore` (what both pools share), over members that
are real :class:`~enginecore.stage._session.ClientSession` objects; only the sockets and the
stage processes are replaced, by a model stage per replica that reads the frames the
members send and answers with the events a stage sends. Requests go with a stream or
without one (``stream=False``), and the pool's event stream (``ordered_events=True``) is
read as a consumer reads it. Checked after every step, for every request, in its stream
(if it has one) and in the event stream alike: it ends at most once and nothing follows its
end, its outputs never repeat (a countdown that only goes down, across its moves), and a
live request is live in exactly one serving replica (so each replica's in-flight count is
exact), whose stage holds it; an ended one is live in none. The members of a restart group
are in one state (a member's death stops the others; they start again together). At the
end, after every stage has run dry: every request ended exactly once, in both, the same
way, and a request that failed with its replica says how many outputs it had delivered.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from enginecore.stage import (
    AsyncPoolRequestStream,
    ErrorReport,
    NoReplicaError,
    PoolRequest,
    ReplicaDeadError,
    ReplicaEvent,
    ReplicaGone,
    ReplicaState,
    RequestFailed,
    StageClosedError,
)
from enginecore.stage._errors import EngineDeadError
from enginecore.stage._pool_core import QuietTable, Replica
from enginecore.stage._poolbase import PoolBase, fail_with_group
from enginecore.stage._session import NO_LOCK, ClientSession, Deliveries, End
from enginecore.stage._wire import Aborted, Outputs

pytestmark = pytest.mark.timeout(600)


class ModelStage:
    """What one replica's stage does with the frames it gets: a countdown per request."""

    def __init__(self) -> None:
        self.live: dict[str, int] = {}
        self.aborted: list[str] = []

    def receive(self, parts: list[Any]) -> None:
        msg = msgspec.msgpack.decode(bytes(parts[0]))
        kind = msg[0]
        if kind == "add":
            self.take(msg[1], msg[2])
        elif kind == "adds":
            for rid, data in zip(msg[1], msg[2], strict=True):
                self.take(rid, data)
        elif kind == "abort":
            for rid in msg[1]:
                if self.live.pop(rid, None) is not None:
                    self.aborted.append(rid)
        else:  # shutdown, bye, ping: nothing the model needs
            pass

    def take(self, rid: str, n: int) -> None:
        assert rid not in self.live, f"{rid} added twice to one stage"
        assert n >= 1, f"{rid} added with {n} steps"
        self.live[rid] = n

    def step(self) -> list[Any]:
        events: list[Any] = []
        if self.aborted:
            events.append(Aborted(self.aborted))
            self.aborted = []
        if self.live:
            rids = list(self.live)
            payloads = [self.live[r] - 1 for r in rids]
            finished = [p == 0 for p in payloads]
            for r, p in zip(rids, payloads, strict=True):
                if p:
                    self.live[r] = p
                else:
                    del self.live[r]
            events.append(Outputs(rids, finished, payloads))  # type: ignore[arg-type]
        return events


class ModelMember:
    """A member client without sockets: its session is real; its sends go to the model
    stage."""

    _adopt_orphans = True
    _lock = NO_LOCK
    _stream_type = AsyncPoolRequestStream
    _launched = None  # no process to kill
    _max_frame = None  # a stage without --max-message-bytes: nothing split

    def __init__(self, pool: ModelPool, replica: Replica) -> None:
        self._pool = pool
        self._replica = replica
        self.stage = ModelStage()
        self._closed = False
        self._session: ClientSession[Any, Any] = ClientSession(
            pid=1,
            address=f"model://{replica.name}",
            launched=True,
            heartbeat=None,
            ordered_events=True,
            now=time.monotonic(),
            adopt_orphans=True,
        )
        self._event_sink = functools.partial(pool._member_events, self)

    # ClientBase's non-waiting operations, which the pool calls.
    from enginecore.stage._clientbase import ClientBase as _CB

    _send_request = _CB._send_request
    _send_requests = _CB._send_requests
    _send_abort = _CB._send_abort
    _claim_send = _CB._claim_send  # False: a model's sends never wait, as the asyncio pool's
    del _CB

    def _send(self, parts: list[Any]) -> None:
        if self._closed:
            raise StageClosedError("closed")
        self.stage.receive(parts)

    def _send_nowait(self, parts: list[Any]) -> bool:
        self._send(parts)
        return True

    def _sent(self) -> None:
        pass

    def _apply(self, d: Deliveries[Any, Any]) -> None:
        failure = self._session.failure
        if failure is None:
            self._event_sink()
            return
        self._pool._member_failed(self, d, failure)

    def deliver(self, events: list[Any]) -> None:
        if events:
            self._apply(self._session.dispatch(events, time.monotonic()))

    def kill(self) -> None:
        d = self._session.fail(EngineDeadError("stage process 1 was killed by SIGKILL"))
        if d is not None:
            self._apply(d)

    def close(self) -> None:
        self._session.begin_close()
        d = self._session.fail(StageClosedError("this stage client is closed"))
        self._closed = True
        if d is not None:
            self._apply(d)


class ModelPool(PoolBase[AsyncPoolRequestStream]):
    _stream_type = AsyncPoolRequestStream

    def __init__(self, hook: bool = True) -> None:
        super().__init__(
            None, True, self.resume if hook else None, max_migrations=2, ordered_events=True
        )
        self._lock = NO_LOCK
        self.gone: list[Replica] = []
        self.sizes: dict[str, int] = {}  # each request's first size

    def resume(self, request: PoolRequest, delivered: int) -> PoolRequest | None:
        """Move every other request on, with what it has left (*delivered* counts every
        attempt's outputs)."""
        if int(request.req_id[1:]) % 2:
            return None
        return PoolRequest(request.req_id, self.sizes[request.req_id] - delivered, request.key)

    def _wake(self, stream: AsyncPoolRequestStream) -> None:
        pass  # nobody waits: the model reads buffers

    def _wake_events(self) -> None:
        pass

    def _member_apply(self, member: Any, d: Deliveries[Any, Any]) -> None:
        member._event_sink()

    def _member_gone(self, member: Any, failure: BaseException) -> None:
        replica = member._replica
        if replica._client is member:
            death = self._core.died(replica, time.monotonic())
            self.gone.append(replica)
            for r in death.stop:  # as the pools do: the rest of its group, at once
                assert r.group is not None
                assert r.group == replica.group
                fail_with_group(r._client, r, replica)

    def start(self, replica: Replica) -> None:
        member = ModelMember(self, replica)
        assert self._core.started(replica, member)


class PoolModel(RuleBasedStateMachine):
    hook = True  # requests of a dead replica move on (on_replica_death) or fail
    groups: tuple[str | None, ...] = ("g", "g", None)  # the replicas at the start

    def __init__(self) -> None:
        super().__init__()
        self.pool = ModelPool(self.hook)
        for group in self.groups:
            self.pool.start(self.pool._core.new_replica({"factory": "model", "group": group}))
        self.streams: dict[str, AsyncPoolRequestStream] = {}
        self.quiet: set[str] = set()  # the requests without a stream
        self.sizes = self.pool.sizes
        self.seen: dict[str, list[Any]] = {}  # what each stream's consumer has read
        self.log: dict[str, list[Any]] = {}  # each request in the event stream, as read
        self.ids = 0

    # -- helpers ---------------------------------------------------------------------------

    def serving(self) -> list[Replica]:
        return [r for r in self.pool.replicas if r.state is ReplicaState.SERVING]

    def new_id(self) -> str:
        self.ids += 1
        return f"q{self.ids}"

    def requests(self) -> list[str]:
        return [*self.streams, *self.quiet]

    def in_events(self, rid: str) -> list[Any]:
        """*rid* in the event stream: what was read, then what waits to be read. Each
        output is its payload; an end is ``"finished"`` (after its last payload), or the
        event that ended it."""
        return self.log[rid] + self.parse(list(self.pool._events or ()), record=False)[rid]

    def parse(self, events: list[Any], *, record: bool) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {rid: [] for rid in self.log}
        for ev in events:
            if isinstance(ev, Outputs):
                for rid, fin, payload in zip(ev.req_ids, ev.finished, ev.payloads, strict=True):
                    assert rid in out, f"an output of {rid}, never added"
                    out[rid].append(payload)
                    if fin:
                        out[rid].append("finished")
            elif isinstance(ev, Aborted):
                for rid in ev.req_ids:
                    out[rid].append(ev)
            elif isinstance(ev, (RequestFailed, ErrorReport)):
                assert ev.req_id is not None
                out[ev.req_id].append(ev)
            else:
                assert isinstance(ev, (ReplicaEvent, ReplicaGone)), ev
                if record and isinstance(ev, ReplicaGone):
                    event("a replica's end in the event stream")
        if record:
            for rid, items in out.items():
                self.log[rid] += items
        return out

    def read(self, rid: str) -> None:
        stream = self.streams[rid]
        got = self.seen[rid]
        if got and type(got[-1]) is End:
            assert not stream._buf, f"{rid}: something after its end: {stream._buf}"
            return
        got.extend(stream._buf)
        stream._buf = []

    # -- rules ----------------------------------------------------------------------------

    @rule(n=st.integers(1, 6), key=st.sampled_from([None, "a", "b"]), quiet=st.booleans())
    def add(self, n: int, key: str | None, quiet: bool) -> None:
        rid = self.new_id()
        self.log[rid] = []
        try:
            if quiet:
                self.pool._add_quiet(rid, n, key)
                self.quiet.add(rid)
                self.sizes[rid] = n
                return
            if self.hook:
                frame = ClientSession.add_frame(rid, n)
                stream = self.pool._send(rid, frame, PoolRequest(rid, n, key), key, 0, None)
            else:  # add() itself: a pool of one replica takes its unrouted path
                core = self.pool._core
                if core._single is not None and core.health_epoch[0] == core._routable_epoch:
                    event("an add took the unrouted path")
                stream = self.pool._add_one(rid, n, key)
        except NoReplicaError:
            assert not self.serving()
            del self.log[rid]
            return
        self.streams[rid] = stream
        self.sizes[rid] = n
        self.seen[rid] = []

    @rule(sizes=st.lists(st.integers(1, 6), min_size=1, max_size=6), quiet=st.booleans())
    def add_many(self, sizes: list[int], quiet: bool) -> None:
        items = [(self.new_id(), n) for n in sizes]
        for rid, _ in items:
            self.log[rid] = []
        try:
            streams = self.pool._add_many(items, not quiet)
        except NoReplicaError:
            assert not self.serving()
            for rid, _ in items:
                del self.log[rid]
            return
        if quiet:
            assert streams == []
            for rid, n in items:
                self.quiet.add(rid)
                self.sizes[rid] = n
            return
        for (rid, n), stream in zip(items, streams, strict=True):
            self.streams[rid] = stream
            self.sizes[rid] = n
            self.seen[rid] = []

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        if not self.log:
            return
        ids = data.draw(st.lists(st.sampled_from(sorted(self.log)), max_size=3))
        self.pool._abort([*ids, "never-added"])

    @rule()
    def read_events(self) -> None:
        events = list(self.pool._events or ())
        assert self.pool._events is not None
        self.pool._events.clear()
        self.parse(events, record=True)

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        serving = self.serving()
        if serving:
            r = data.draw(st.sampled_from(serving))
            r._client.deliver(r._client.stage.step())

    @rule(data=st.data())
    def consume(self, data: st.DataObject) -> None:
        if self.streams:
            self.read(data.draw(st.sampled_from(sorted(self.streams))))

    @rule(data=st.data())
    def kill(self, data: st.DataObject) -> None:
        serving = self.serving()
        if serving:
            data.draw(st.sampled_from(serving))._client.kill()

    @precondition(lambda self: any(r.state is ReplicaState.DEAD for r in self.pool.replicas))
    @rule(data=st.data(), fails=st.booleans())
    def restart(self, data: st.DataObject, fails: bool) -> None:
        """A dead replica's restart timer fires: it starts again with its whole group, or
        the start fails (one more death of the replica, or of its group)."""
        dead = [r for r in self.pool.replicas if r.state is ReplicaState.DEAD]
        core = self.pool._core
        group = core.group_of(data.draw(st.sampled_from(dead)))
        starting = [r for r in group if core.restarting(r)]
        assert starting == list(group), f"{group} did not start together"
        if fails:
            event("a restart failed")
            death = core.died(starting[0], time.monotonic())
            assert death.stop == ()
            assert death.restart in ((), group)
            return
        if len(starting) > 1:
            event("a group started again")
        for r in starting:
            self.pool.start(r)

    @precondition(lambda self: len(self.pool.replicas) < 6)
    @rule(group=st.sampled_from([None, "g", "h"]))
    def add_replica(self, group: str | None) -> None:
        members = [r for r in self.pool.replicas if r.group == group and r.group is not None]
        if any(r.state is not ReplicaState.SERVING for r in members):
            group = None  # not beside a group that is down: it would serve alone
        self.pool.start(self.pool._core.new_replica({"factory": "model", "group": group}))

    @rule(data=st.data(), drain=st.booleans())
    def remove_replica(self, data: st.DataObject, drain: bool) -> None:
        serving = self.serving()
        if not serving:
            return
        r = data.draw(st.sampled_from(serving))
        core = self.pool._core
        core.set_state(r, ReplicaState.DRAINING)
        member: ModelMember = r._client
        if drain:
            while member.stage.live or member.stage.aborted:
                member.deliver(member.stage.step())
        member.close()
        core.set_state(r, ReplicaState.REMOVED)

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def groups_live_and_die_together(self) -> None:
        states: dict[str, set[ReplicaState]] = {}
        for r in self.pool.replicas:
            if r.group is not None and r.state is not ReplicaState.DRAINING:
                states.setdefault(r.group, set()).add(r.state)
        for group, seen in states.items():
            assert len(seen) == 1, f"group {group}: {seen}"

    @invariant()
    def streams_are_consistent(self) -> None:
        holders: dict[str, list[Replica]] = {}
        for r in self.pool.replicas:
            if r._client is None or r._session is None:
                continue
            for rid in r._session.streams:
                holders.setdefault(rid, []).append(r)
            for rid in r._session.quiet:
                holders.setdefault(rid, []).append(r)
        waiting = self.parse(list(self.pool._events or ()), record=False)
        for rid in self.requests():
            logged = self.log[rid] + waiting[rid]
            ends = [i for i, x in enumerate(logged) if type(x) is not int]
            assert len(ends) <= 1, f"{rid} ended twice in the event stream: {logged}"
            if ends:
                assert ends[0] == len(logged) - 1, f"{rid}: an event after its end: {logged}"
            if rid in self.streams:
                stream = self.streams[rid]
                items = self.seen[rid] + list(stream._buf)
                s_ends = [i for i, x in enumerate(items) if type(x) is End]
                assert len(s_ends) <= 1, f"{rid} ended twice: {items}"
                if s_ends:
                    assert s_ends[0] == len(items) - 1, f"{rid}: an output after its end: {items}"
                # The stream and the event stream agree, output for output.
                assert [x for x in items if type(x) is not End] == logged[: len(logged) - len(ends)]
                assert bool(s_ends) == bool(ends), f"{rid}: {items} / {logged}"
            entry = self.pool._core.stream_of(rid)  # what abort() routes by
            if ends:
                assert rid not in holders, f"{rid} ended but live in {holders[rid]}"
                assert entry is None, f"{rid} ended but live in the pool's table"
            else:
                where = holders.get(rid, [])
                assert len(where) == 1, f"{rid} live in {where}"
                (r,) = where
                assert entry is not None, f"{rid} live but not in the pool's table"
                assert entry._replica is r, f"{rid} on {r.name}, its entry says {entry._replica}"
                assert r.state in (ReplicaState.SERVING, ReplicaState.DRAINING)
                stage = r._client.stage
                assert rid in stage.live or rid in stage.aborted, (
                    f"{rid}: in {r.name}'s session only"
                )
            payloads = [x for x in logged if type(x) is int]
            assert payloads == sorted(set(payloads), reverse=True), f"{rid}: {payloads}"
            assert all(0 <= p < self.sizes[rid] for p in payloads)
        # The ids a replica's QuietTable stands for leave the pool's table as they end (the
        # table's prune does not look at them).
        for rid, entry in self.pool._core._live.items():
            if type(entry) is QuietTable:
                assert entry._live_as(rid), f"{rid} ended, still in the pool's table"
        # Each replica's in-flight count is exact: its requests not yet ended.
        for r in self.pool.replicas:
            if r.state in (ReplicaState.SERVING, ReplicaState.DRAINING):
                mine = [rid for rid, where in holders.items() if r in where]
                assert r.in_flight == len(mine)

    def teardown(self) -> None:
        moved = sum(s.migrations for s in self.streams.values())
        moved += sum(getattr(self.pool._core._live.get(r), "migrations", 0) for r in self.quiet)
        event("requests moved" if moved else "no request moved")
        event("a replica died" if self.pool.gone else "no replica died")
        # Run every stage dry, then every request has ended, exactly once, and as it should.
        for _ in range(20):
            for r in self.serving():
                r._client.deliver(r._client.stage.step())
        self.read_events()
        assert not any(r.in_flight for r in self.pool.replicas)
        for rid in self.requests():
            logged = self.log[rid]
            assert logged, f"{rid} never ended in the event stream"
            last = logged[-1]
            if last == "finished":
                assert logged[-2] == 0, f"{rid} finished early: {logged}"
            elif isinstance(last, RequestFailed):
                if rid in self.quiet:
                    event("a request without a stream failed")
                assert isinstance(last.error, (ReplicaDeadError, StageClosedError)), last
                if isinstance(last.error, ReplicaDeadError):
                    # Every output it delivered is in the event stream before its end.
                    assert last.error.delivered == len(logged) - 1
            else:
                assert isinstance(last, Aborted), f"{rid} never ended: {logged}"
            if rid not in self.streams:
                continue
            self.read(rid)
            items = self.seen[rid]
            assert items, f"{rid} never ended"
            end = items[-1]
            assert type(end) is End, f"{rid} never ended: {items}"
            if end.exc is None and not end.aborted:
                assert items[-2] == 0, f"{rid} finished early: {items}"
                assert last == "finished"
            elif end.exc is not None:
                assert isinstance(end.exc, (ReplicaDeadError, StageClosedError)), end.exc
                assert isinstance(last, RequestFailed)
                assert last.error is end.exc
                if isinstance(end.exc, ReplicaDeadError):
                    assert end.exc.delivered == len(items) - 1
                    assert end.exc.replica is self.streams[rid].replica
                    if "restart group" in str(end.exc):
                        event("a request ended with its replica's group")
            else:
                assert isinstance(last, Aborted)


class PoolModelWithoutHook(PoolModel):
    """The same, without ``on_replica_death``: a dead replica's requests fail, and while
    one replica is routable ``add()`` sends to it without routing."""

    hook = False
    groups = (None,)


TestPoolModel = PoolModel.TestCase
TestPoolModel.settings = settings(
    max_examples=2000,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPoolModelWithoutHook = PoolModelWithoutHook.TestCase
TestPoolModelWithoutHook.settings = settings(
    max_examples=1000,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
