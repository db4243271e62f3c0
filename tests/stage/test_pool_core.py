"""The pool's decisions without processes: routing policies, load counting, the routable
set, the restart schedule. Replicas here are real member sessions (ClientSession) fed
events by hand."""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from enginecore.stage import (
    Aborted,
    ErrorReport,
    LeastLoaded,
    NoReplicaError,
    Outputs,
    PoolRequest,
    Replica,
    ReplicaState,
    ReplicaView,
    RestartPolicy,
    Scored,
    Sticky,
)
from enginecore.stage._pool_core import PoolCore, replica_load
from enginecore.stage._session import ClientSession, StreamCore
from enginecore.stage._wire import Load, Stalled


class Member:
    """What the core needs of a member client: its session."""

    def __init__(self, name: str) -> None:
        self._session: ClientSession[Any, Any] = ClientSession(
            pid=1,
            address=f"fake://{name}",
            launched=True,
            heartbeat=None,
            ordered_events=False,
            now=time.monotonic(),
            adopt_orphans=True,  # as a pool's member
        )

    def open(self, *ids: str) -> None:
        self._session.open_requests(list(ids), [StreamCore(rid) for rid in ids])

    def finish(self, *ids: str) -> None:
        n = len(ids)
        self._session.dispatch([Outputs(list(ids), [True] * n, [0] * n)], time.monotonic())

    def report(self, live: int, **engine: float) -> None:
        load = Load(seq=1, age=0.0, live=live, engine=dict(engine))
        self._session.dispatch([Outputs([], [], [], load)], time.monotonic())


def make_core(n: int, routing: Any = None, **kw: Any) -> tuple[PoolCore, list[Member]]:
    core = PoolCore(routing, kw.pop("restart", False), None, 1)
    members = []
    for _ in range(n):
        replica = core.new_replica({"factory": "fake"})
        member = Member(replica.name)
        assert core.started(replica, member)
        members.append(member)
    return core, members


def test_least_loaded_fills_the_emptiest_and_breaks_ties_round_robin() -> None:
    core, members = make_core(3)
    members[0].open("a", "b")
    members[1].open("c")
    assert core.route("x", None, None).name == "r2"
    members[2].open("d", "e")  # loads 2, 1, 2
    assert core.route("x", None, None).name == "r1"
    members[1].open("f")  # all equal: each gets its turn
    picks = Counter(core.route(f"t{i}", None, None).name for i in range(30))
    assert picks == {"r0": 10, "r1": 10, "r2": 10}


def test_other_clients_load_comes_from_the_report_taken_against_our_own() -> None:
    core, (m0, m1) = make_core(2)
    m0.open("a")
    m0.report(live=6)  # 5 requests of other clients on r0, measured when we had 1
    r0, r1 = core.replicas
    assert replica_load(r0, time.monotonic()) == 6
    assert replica_load(r1, time.monotonic()) == 0
    m0.finish("a")  # ours ended; the others' 5 are still counted
    assert replica_load(r0, time.monotonic()) == 5
    # However old, a report counts the others' until the next one (the stage sends one as
    # it idles: an old report is a long step's, not an empty replica's).
    assert replica_load(r0, time.monotonic() + 60) == 5
    m1.open("b")
    m1.report(live=1)  # the only request r1 has is ours
    assert replica_load(r1, time.monotonic()) == 1


def test_power_of_k_above_the_exhaustive_size_touches_k_replicas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    core, members = make_core(64, LeastLoaded(k=2, seed=7))
    for i, m in enumerate(members):
        m.open(*[f"m{i}-{j}" for j in range(i % 5)])
    looked: list[Replica] = []
    real = replica_load

    def spy(r: Replica, now: float) -> int:
        looked.append(r)
        return real(r, now)

    import enginecore.stage._pool_core as pc

    monkeypatch.setattr(pc, "replica_load", spy)
    chosen = core.route("x", None, None)
    assert len(looked) == 2
    assert chosen is min(looked, key=lambda r: real(r, time.monotonic()))


def test_a_burst_is_water_filled() -> None:
    core, members = make_core(3)
    members[0].open(*[f"a{i}" for i in range(4)])
    requests = [PoolRequest(f"q{i}", 1) for i in range(8)]
    chosen = Counter(r.name for r in core.route_many(requests))
    assert chosen == {"r1": 4, "r2": 4}  # loads end at 4, 4, 4


def test_a_stalled_replica_leaves_the_candidates_until_it_resumes() -> None:
    core, members = make_core(3)
    assert len(core.candidates()) == 3
    members[1]._session.dispatch([Stalled(seconds=5.0, step_timeout=1.0)], time.monotonic())
    assert [r.name for r in core.candidates()] == ["r0", "r2"]
    from enginecore.stage._wire import Resumed

    members[1]._session.dispatch([Resumed(seconds=6.0)], time.monotonic())
    assert len(core.candidates()) == 3
    for m in members:  # every one stalled: they stay candidates (queued beats refused)
        m._session.dispatch([Stalled(seconds=5.0, step_timeout=1.0)], time.monotonic())
    assert len(core.candidates()) == 3
    for r in core.replicas:
        core.set_state(r, ReplicaState.DEAD)
    with pytest.raises(NoReplicaError, match="r0 dead, r1 dead, r2 dead"):
        core.candidates()


def test_the_routable_set_is_not_recomputed_per_request() -> None:
    core, members = make_core(8)
    assert len(core.candidates()) == 8
    members[3]._session._step_stalled = True  # behind the session's back: no epoch bump
    assert len(core.candidates()) == 8  # so nothing looked at the replicas again
    core.health_epoch[0] += 1  # what the session does when it changes the flag itself
    assert [r.name for r in core.candidates()] == [f"r{i}" for i in range(8) if i != 3]


def test_sticky_keys_stay_home_and_spill_when_home_is_overloaded() -> None:
    policy = Sticky(spill_above=1.5, slack=2)
    core, members = make_core(4, policy)
    home = core.route("x", None, "user-1")
    assert all(core.route(f"x{i}", None, "user-1") is home for i in range(10))
    # Another client of the same replicas (a new core) agrees on the home.
    other, _ = make_core(4, Sticky())
    assert other.route("y", None, "user-1").name == home.name
    # Overload the home: mean load 10/4 = 2.5, line 1.5 * 2.5 + 2 = 5.75 < 10.
    members[int(home.name[1:])].open(*[f"h{i}" for i in range(10)])
    assert core.route("z", None, "user-1") is not home
    # Keys spread over the replicas, and only the dead replica's keys move when it dies.
    homes = {f"k{i}": core.route("q", None, f"k{i}") for i in range(200)}
    for m in members:
        for rid in list(m._session.streams):
            m.finish(rid)
    homes = {k: core.route("q", None, k) for k in homes}
    assert len(set(homes.values())) == 4
    gone = core.replicas[0]
    core.set_state(gone, ReplicaState.DEAD)
    after = {k: core.route("q", None, k) for k in homes}
    assert all(after[k] is homes[k] for k in homes if homes[k] is not gone)


def test_sticky_takes_any_str_key_and_names_an_unhashable_one() -> None:
    core, _ = make_core(3, Sticky())
    lone = "user-\ud800"  # a lone surrogate, as json.loads gives for "\\ud800"
    home = core.route("a", None, lone)
    assert all(core.route(f"a{i}", None, lone) is home for i in range(5))
    other, _ = make_core(3, Sticky())
    assert other.route("b", None, lone).name == home.name
    with pytest.raises(TypeError, match="Sticky key must be hashable, got list"):
        core.route("c", None, cast(Any, ["user"]))


def test_a_score_function_sees_views() -> None:
    seen: list[tuple[ReplicaView, PoolRequest]] = []

    def score(view: ReplicaView, request: PoolRequest) -> float:
        seen.append((view, request))
        return view.engine.get("kv", 0.0)

    core, members = make_core(3, score)
    assert isinstance(core.routing, Scored)
    members[0].report(live=0, kv=0.9)
    members[1].report(live=0, kv=0.1)
    members[2].report(live=0, kv=0.5)
    assert core.route("x", "data", "key").name == "r1"
    views = [v for v, _ in seen]
    assert {v.replica.name for v in views} == {"r0", "r1", "r2"}
    assert all(v.age is not None and v.age >= 0 for v in views)
    assert seen[0][1] == PoolRequest("x", "data", "key")


@given(st.lists(st.floats(0, 200), min_size=1, max_size=20))
def test_restart_delays_double_up_to_the_cap_and_fail_after_five(gaps: list[float]) -> None:
    policy = RestartPolicy()
    deaths: deque[float] = deque()
    now = 0.0
    for gap in gaps:
        now += gap
        recent = sum(1 for t in deaths if t > now - policy.window) + 1
        delay = policy.delay(deaths, now)
        if recent >= policy.max_failures:
            assert delay is None
            return
        assert delay == min(policy.max_delay, policy.first_delay * 2 ** (recent - 1))


def test_restart_policy_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="first_delay"):
        RestartPolicy(first_delay=0)
    with pytest.raises(ValueError, match="max_failures"):
        RestartPolicy(max_failures=0)


def test_a_death_schedules_a_restart_or_marks_failed() -> None:
    core, _ = make_core(1, restart=RestartPolicy(max_failures=2))
    (r,) = core.replicas
    assert core.died(r, 0.0).delay == 0.5
    states = [r.state]
    assert core.restarting(r)
    states.append(r.state)
    assert r.restarts == 1
    assert core.died(r, 1.0).delay is None
    states.append(r.state)
    assert states == [ReplicaState.DEAD, ReplicaState.STARTING, ReplicaState.FAILED]
    assert not core.restarting(r)


def test_a_members_session_reads_silent_after_one_and_three_quarter_intervals() -> None:
    from enginecore.stage import StageHealth
    from enginecore.stage._pool import _Member

    t0 = 100.0
    session: ClientSession[Any, Any] = ClientSession(
        pid=1, address="fake://m", launched=True, heartbeat=(0.2, None),
        ordered_events=False, now=t0, silent_after=_Member._silent_after,
    )  # fmt: skip
    assert _Member._silent_after == 1.75
    session.tick(t0 + 1.74 * 0.2)
    assert session.health(t0 + 1.74 * 0.2) == StageHealth.OK
    _, _, d = session.tick(t0 + 1.76 * 0.2)
    assert d is not None
    assert d.warnings
    assert session.health(t0 + 1.76 * 0.2) == StageHealth.STALLED
    single: ClientSession[Any, Any] = ClientSession(
        pid=1, address="fake://c", launched=True, heartbeat=(0.2, None),
        ordered_events=False, now=t0,
    )  # fmt: skip
    assert single.health(t0 + 1.9 * 0.2) == StageHealth.OK  # a client's: two intervals


# -- a member's requests without a stream -------------------------------------------------


def member_session(ordered_events: bool = True) -> ClientSession[Any, Any]:
    return ClientSession(
        pid=1,
        address="fake://m",
        launched=True,
        heartbeat=None,
        ordered_events=ordered_events,
        now=time.monotonic(),
        adopt_orphans=True,
    )


def test_a_member_counts_its_requests_without_a_stream() -> None:
    session = member_session()
    session.open_request("a", None)
    session.open_requests(["b", "c", "d"], None)
    session.open_request("s", StreamCore("s"))
    assert dict(session.quiet) == {"a": 0, "b": 0, "c": 0, "d": 0}
    assert session.in_flight == 5
    with pytest.raises(ValueError, match="still live"):
        session.open_request("b", StreamCore("b"))
    with pytest.raises(ValueError, match="still live"):
        session.open_requests(["x", "c"], None)
    now = time.monotonic()
    # Outputs of streamed, quiet and unrouted requests, mixed, two for one id in one step.
    ids: list[str | None] = ["a", "s", None, "b", "a", "c", "unknown"]
    session.dispatch([Outputs(ids, [False] * 7, list(range(7)))], now)
    assert dict(session.quiet) == {"a": 2, "b": 1, "c": 1, "d": 0}
    session.dispatch([Outputs(["a", "b", "s"], [True, False, True], [0, 0, 0])], now)
    assert dict(session.quiet) == {"b": 2, "c": 1, "d": 0}
    session.dispatch([Aborted(["c"]), ErrorReport("d", "refused")], now)
    assert dict(session.quiet) == {"b": 2}
    assert session.in_flight == 1
    session.cancel_streams(["b"])  # its frame could not be sent
    assert session.in_flight == 0
    # A session that is no pool's member keeps no such table.
    plain: ClientSession[Any, Any] = ClientSession(
        pid=1,
        address="fake://c",
        launched=True,
        heartbeat=None,
        ordered_events=True,
        now=now,
    )
    plain.open_request("a", None)
    assert dict(plain.quiet) == {}
    assert plain.in_flight == 0


def test_a_failed_member_hands_over_its_requests_without_a_stream() -> None:
    session = member_session()
    session.open_requests(["a", "b"], None)
    session.dispatch([Outputs(["a", "a", "b"], [False] * 3, [1, 2, 3])], time.monotonic())
    d = session.fail(RuntimeError("gone"))
    assert d is not None
    assert d.quiet_orphans == {"a": 2, "b": 1}
    assert dict(session.quiet) == {}
    assert session.in_flight == 0


@given(
    st.lists(
        st.tuples(st.sampled_from(["q0", "q1", "q2", "s0", "s1", None, "x"]), st.booleans()),
        max_size=30,
    )
)
def test_quiet_counts_match_a_count_per_output(outputs: list[tuple[str | None, bool]]) -> None:
    session = member_session()
    session.open_requests(["q0", "q1", "q2"], None)
    session.open_requests(["s0", "s1"], [StreamCore("s0"), StreamCore("s1")])
    expected = {"q0": 0, "q1": 0, "q2": 0}
    ended: set[str] = set()
    for rid, fin in outputs:
        if rid in ended:
            continue  # the stage sends nothing after a request's end
        if rid in expected:
            expected[rid] += 1
            if fin:
                del expected[rid]
        if fin and rid is not None:
            ended.add(rid)
        session.dispatch([Outputs([rid], [fin], [0])], time.monotonic())
    assert dict(session.quiet) == expected


_QUIET_OPS = st.one_of(
    st.tuples(
        st.just("out"),
        st.sampled_from(["q0", "q1", "q2", "q3", "s0", None, "x"]),
        st.booleans(),
    ),
    st.tuples(st.just("add"), st.sampled_from(["q0", "q1", "q2", "q3"]), st.just(False)),
    st.tuples(st.just("read"), st.none(), st.just(False)),
)


@given(st.lists(_QUIET_OPS, max_size=60), st.booleans())
def test_quiet_counts_are_exact_whenever_read_and_at_a_failure(
    ops: list[tuple[str, str | None, bool]], small_log: bool
) -> None:
    """The counts are kept lazily (a log of events, folded when read, before an id is
    added, when full, and at a failure; dropped once no such request is live): whenever
    they are read they equal a count per output of the requests live now, and an id used
    again counts only its new request's outputs."""
    from unittest import mock

    from enginecore.stage import _session

    session = member_session()
    session.open_requests(["s0"], [StreamCore("s0")])
    expected: dict[str, int] = {}
    with mock.patch.object(_session, "QUIET_LOG_MAX", 2 if small_log else _session.QUIET_LOG_MAX):
        for op, rid, drawn_fin in ops:
            fin = drawn_fin and rid != "s0"  # the streamed request stays live
            if op == "add":
                assert rid is not None
                if rid in expected:
                    with pytest.raises(ValueError, match="still live"):
                        session.open_request(rid, None)
                else:
                    session.open_request(rid, None)
                    expected[rid] = 0
            elif op == "read":
                assert dict(session.quiet) == expected
                assert session.in_flight == len(expected) + 1
            else:
                if rid in expected:
                    expected[rid] += 1
                    if fin:
                        del expected[rid]
                elif rid is not None and rid.startswith("q"):
                    continue  # not live: the stage sends nothing for it
                session.dispatch([Outputs([rid, rid], [False, fin], [0, 0])], time.monotonic())
                if rid in expected:
                    expected[rid] += 1  # the first of the pair
        assert session.in_flight == len(expected) + 1  # (no read of the counts before)
        d = session.fail(RuntimeError("gone"))
    assert d is not None
    assert dict(d.quiet_orphans or {}) == expected


def make_group_core(restart: Any = True) -> tuple[PoolCore, list[Replica]]:
    """r0 and r1 in restart group "g", r2 alone, every one serving."""
    core = PoolCore(None, restart, None, 1)
    for group in ("g", "g", None):
        replica = core.new_replica({"factory": "fake", "group": group})
        assert core.started(replica, Member(replica.name))
    return core, list(core.replicas)


def test_a_group_members_death_stops_its_group_and_restarts_it_whole() -> None:
    core, (r0, r1, r2) = make_group_core()
    assert (r0.group, r1.group, r2.group) == ("g", "g", None)
    assert "group" not in r0.spec
    death = core.died(r1, 0.0)
    assert death.delay == 0.5
    assert death.stop == (r0,)  # still serving: the pool stops it
    assert death.restart == (r0, r1)
    assert [r.state for r in core.replicas] == [
        ReplicaState.DEAD,
        ReplicaState.DEAD,
        ReplicaState.SERVING,
    ]
    assert list(core.candidates()) == [r2]
    # The stopped member's own death, when its session fails, changes nothing.
    assert core.died(r0, 0.1) == (None, (), ())
    assert all(core.restarting(r) for r in death.restart)
    assert [r0.restarts, r1.restarts, r2.restarts] == [1, 1, 0]
    for r in (r0, r1):
        assert core.started(r, Member(r.name))
    assert set(core.candidates()) == {r0, r1, r2}
    # The replica alone is its own group.
    assert core.died(r2, 0.2) == (0.5, (), (r2,))


def test_a_group_counts_its_deaths_together_and_fails_as_a_whole() -> None:
    core, (r0, r1, r2) = make_group_core(RestartPolicy(max_failures=3))
    delays = []
    for t, victim in enumerate([r0, r1]):
        death = core.died(victim, float(t))
        delays.append(death.delay)
        for r in death.restart:
            assert core.restarting(r)
        if t == 0:
            for r in death.restart:
                assert core.started(r, Member(r.name))
    assert delays == [0.5, 1.0]  # one backoff for the group, whichever member died
    # A failed start of the group (both starting) is its third death: it fails.
    assert [r0.state, r1.state] == [ReplicaState.STARTING] * 2
    death = core.died(r0, 2.0)
    assert death == (None, (), ())
    assert [r0.state, r1.state, r2.state] == [
        ReplicaState.FAILED,
        ReplicaState.FAILED,
        ReplicaState.SERVING,
    ]
    assert r2._deaths == deque()  # its own count is untouched


def test_a_start_begun_before_its_groups_death_does_not_count() -> None:
    core = PoolCore(None, True, None, 1)
    r0 = core.new_replica({"factory": "fake", "group": "g"})
    r1 = core.new_replica({"factory": "fake", "group": "g"})
    generation = r1._generation  # r1's start begins
    assert core.started(r0, Member("r0"))
    assert core.died(r0, 0.0).restart == (r0, r1)  # r1 still starting: nothing to stop
    assert not core.started(r1, Member("r1"), generation)  # the pool closes that member
    assert r1.state is ReplicaState.DEAD
    assert core.restarting(r1)
    assert core.started(r1, Member("r1"), r1._generation)


def test_without_restart_a_group_still_dies_together() -> None:
    core, (r0, r1, _) = make_group_core(False)
    assert core.died(r0, 0.0) == (None, (r1,), ())
    assert [r.state for r in core.replicas][:2] == [ReplicaState.DEAD] * 2


def test_draining_and_removed_members_leave_their_group() -> None:
    core, (r0, r1, _) = make_group_core()
    r3 = core.new_replica({"factory": "fake", "group": "g"})
    assert core.started(r3, Member("r3"))
    core.set_state(r1, ReplicaState.DRAINING)
    core.set_state(r3, ReplicaState.REMOVED)
    death = core.died(r0, 0.0)
    assert death.stop == ()
    assert death.restart == (r0,)
    assert r1.state is ReplicaState.DRAINING


def test_bad_groups_are_refused() -> None:
    core = PoolCore(None, True, None, 1)
    with pytest.raises(ValueError, match="launches"):
        core.new_replica({"address": "tcp://127.0.0.1:1", "group": "g"})
    with pytest.raises(TypeError, match="non-empty str"):
        core.new_replica({"factory": "fake", "group": 3})
    assert core.replicas == ()
