"""A model check of the pipeline coordinator's core (:class:`PipelineCore`): adds, aborts,
stage steps, errors, stage deaths and closing, interleaved by hypothesis.

The core under test is the real :class:`~enginecore.stage._pipeline_core.PipelineCore`,
driven as the pipelines (``_pipelinebase``) drive it (``check_size``, ``admissible``,
``open_many``/``forget``, ``abort``, ``outputs``, ``error``, ``aborted``, ``stage_dead``,
``close``, and what each call's :class:`PipelineDeliveries` asks for). There are no
processes and no sockets: a simulation of 1 to 4 stages stands in for them, each one what
:class:`PipeStage` and the stage runtime (``StageEngine``) do with a request:

- **input**, each of two connections in order, with no order between them: from the
  coordinator (stage 0's adds and aborts; a later stage's aborts after a stage died) and,
  for stage ``k + 1``, what stage ``k`` sends on its link (``FIRST``/``MORE``/``END``/``ONLY``
  items, and each ``abort`` message it applied, after that data). An input item for a
  request that is not live in the stage (``MORE``/``END`` after the stage ended it, or
  ended it with an error) is dropped. An engine with ``feed`` has the request from its
  first item on; one without gets it at ``END``/``ONLY``. The engine may reject an add or
  an input (a :class:`~enginecore.RequestRejected`): an ``error`` event; if the request was
  live (a ``MORE``/``END`` rejected), the stage drops it (``DropEnded``).
- **a step** of a request the engine has: a payload for the caller (an ``outputs`` item,
  ``finished=False``, with a token unique in the run), a payload sent on to the next stage,
  and/or the request's end (the last ``FIRST`` becomes ``ONLY`` as ``PipeStage._split``
  does). A ``feed`` engine may end a request before its input has ended. The end is
  reported as ``PipeStage._split`` does (an end marker: ``finished=True``, the payload
  ``ENDED``/``SENT_ON``/``BEFORE`` bits): not at all by a stage that sent payloads on with
  its input complete, no ``REPORT`` on that input, and nothing sent to the caller (its
  ``END`` tells the next stage, which reports for it); ``ENDED | BEFORE`` by one that sent
  nothing on under the same conditions; its own end otherwise (``ENDED``, ``| SENT_ON``;
  ``| BEFORE`` unless it ended before its input did or its input said ``REPORT``), its
  ``END`` then with ``REPORT``. A stage that ended a request before its input did reports
  ``BEFORE`` when the previous stage's ``END`` without ``REPORT`` reaches it
  (``PipeStage.pipe_late``). Unrouted outputs and outputs of the engine's own requests
  reach the coordinator too.
- **an error** for a request it has: the engine's ``RequestRejected`` as the request's last
  output (it just ends there), or before it, or a failed edge (the stage drops it,
  ``DropEnded``). Either way nothing goes down the link: an abort of the stage's own does
  not chase.
- **an abort message** it gets: applied (the request leaves the stage if it was there),
  reported (``aborted``, every id, live here or not) and sent on down the link
  (``chase_abort``).
- **death**: its events up to some point still reach the coordinator, then its end
  (``stage_dead``); the rest is lost, and what is sent to it is dropped.
- **retry** (an edge's ``Retry(n)``, drawn per edge): a stage whose edge retries keeps a
  replay log of each request (what it sent on, and whether it ended it), from its first
  payload until an abort, its own error with ``DropEnded``, or the core's ``release`` (not
  of an id live there); a log may outgrow its bound (``overflow``: not retryable). The
  core's ``replay`` reaches it on its coordinator connection: it sends the *fence* (an
  ``abort``) down its link, then the logged items again (if it has them), and answers
  ``replayed``. Each stage applies a fence as any abort (chased on, answered ``aborted``),
  the fence and its ``aborted`` flagged as such (``fence``), or, drawn per example, not
  (stages of an older build: every ``aborted`` unflagged).
  Each request a stage holds carries the generation of its attempt there (the fences of
  it the stage had applied when it came); an attempt's payloads, ends and errors are the
  request's truth only while no later replay covers that stage.

Each stage's events reach the core in that stage's order; which stage's event comes next is
hypothesis's choice, as are the deliveries of each connection: every interleaving the real
pipeline allows. Each example draws the number of stages, the budgets (``max_in_flight``,
``max_bytes``), which stages have ``feed``, whether stages may die or the pipeline close,
and whether engines reject often. Ids are fresh, or ids the core has freed, added again.
The model's caller keeps at most :data:`MAX_CONCURRENT` requests in the pipeline, so that
requests go through every stage.

Checked after every rule:

- every stream gets at most one end, nothing after it, and only payloads of its own request
  (each payload's token belongs to that request), each once, and each stage's payloads in
  that stage's order with none skipped (a prefix of what the stage emitted);
- how it ends: **finished** only when the request is done (each stage it reached ended it,
  with no error) and with every payload any stage emitted for it; **aborted** only when the
  caller aborted it, once every stage has applied the coordinator's abort, and with every
  payload; an error naming the stage that reported it, the stage that died, or the
  pipeline's close, each only from that call;
- the core's table: a request is ``LIVE`` (not ended, not aborted), ``ABORTING`` (not ended,
  aborted by the caller, its abort sent) or ``CLOSING`` (ended, its abort sent); every
  request the core no longer holds has ended (or was forgotten); the core asks to abort a
  request at most once (but after a stage died), and only one it holds; a request leaves
  the core on its last end marker (done and live, never aborted: then no stage holds it),
  when every stage has applied the coordinator's abort (ABORTING or CLOSING: once it has
  counted ``n`` ``aborted`` of it while not live, and not before), or on a stage's death,
  close or ``forget``; once a stage's death reached it or it was closed, the core refuses
  every add with that failure, and never before;
- the budgets: the sum of every ``freed`` is the number of requests that left the core,
  ``in_flight`` is what was opened less that, ``room()`` is never negative, ``bytes_in`` is
  the sum of the held requests' shares (an add's bytes split as ``open_many`` does) and
  within ``max_bytes``; ``check_size`` refuses what can never fit, ``admissible`` says
  whether there is room;
- wakes: a stream is woken (``wake``) once, exactly when its consumer waited and its buffer
  grew, and only then;
- a stage's death: the requests the core held and had not aborted yet are aborted from the
  first stage (unless it is the dead one), and every request it held in the stage after
  the dead one (no abort from the first stage can get past the dead one, a closing
  request's neither), with every request that an earlier death ended;
- quiescence: once every queue and link is empty and no stage holds a request, the core
  holds none (``in_flight == 0``) and every stream has ended;
- retries: the core asks for a replay only of a live request, only after an error of the
  stage the edge enters, by the stage before it, at most ``n`` times per edge, and only
  while no payload of that stage or a later one has reached the stream; from then on what
  those stages did is of an earlier attempt: their payloads must never reach the stream
  (the no-duplicate and prefix checks above see to it), their ends and errors must not
  count. An error that ends a request whose edge retries says why it was not retried
  (``retried n times``, or ``not retried``: something reached the caller, or the replay
  failed); while a request is live the core awaits exactly the fences that are due, and a
  request leaves the core only once every fence is answered.

At the end every stage is run dry (each input and event delivered, each request a stage
holds with its input complete stepped to its end). Then every stream has ended and the core
holds nothing, always; and the stages hold nothing either, unless the pipeline was closed
(``close`` aborts nothing: the stages are shut down), or a stage died and the request
reached a stage from the dead one's link after the coordinator's abort of it did (the two
connections have no order between them). Two stages' deaths are no exception: a second
one cuts off the aborts that the first sent on their way through it, and the core sends
them again to the stage after it; nor is (:class:`PooledModel`) a replica's death after a
stage's: the aborts the failed core sent may have gone to that replica, and it sends them
again to the stage after it too.

The run-dry checks are skipped when a rule or a check has failed already: that failure is
the one to report. 2,000 examples of 50 steps: about 45 s on the project's 2-core VM.
:class:`RetryModel` is the same machine drawn where retries happen most (every edge after
the first retrying, requests two stages hold failing): 1,000 more examples, about 25 s.
:class:`PooledModel` is the same machine over a core whose stages are replica pools
(``PipelineCore(replicas=...)``), each simulated stage standing for all the replicas of its
stage: its events reach the core split by the replica each request's route names, as the
pipelines' IO layer hands a pool's events over (one replica's at a time), so the pooled
core's bookkeeping (routes, the filter on them, an abort's confirmation as a bit per stage,
the per-replica counts) must keep every rule above: 1,000 more examples. Every message a
stage's queues hold is addressed to one of its processes (:class:`Proc`, a replica of one
generation), and says which process of the previous stage sent it on a link: the
coordinator's goes to the process the request's route names there when it sends, a stage's
down the link at the index the route names next (an abort: the route it carries, as
``chase_abort``), to whichever process that link goes to when it sends; a request a stage
holds is held by the process that took it. Its faults include a replica's death (never its
stage's last): the requests it holds are lost there, what is sent to it is dropped, its
events so far reach the core before ``replica_dead``; the stage after it applies the
`gone` in order with the coordinator's messages (the dead process's link messages after it
are dropped), and every stage answers and chases the tagged abort sent after the death
with its tag (``docs/wire.md`` section 8). A request a replica's death ended is freed only
once no abort of it is left on its way to a process that would apply it, and no answer to
one on its way to the core: otherwise its id, added again, could be aborted by it (the race
the tags close; the check catches it when the core takes the first answer instead).

:class:`RestartModel` is the same machine over a core whose stages restart their dead
processes (``PipelineCore(restart=...)``; three or four stages, some of them pools, drawn
from :data:`LAYOUTS`), without a stage's death: a process of a stage that restarts dies (its
stage's last one too: adds are then refused, :class:`NoReplicaError`, until one is back),
or a pool's replica (never its last); or the pipeline closes. A death's restart is due at
once (``replica_dead`` asks for it, the policy never gives up), and runs as ``_restart``
and ``_link`` drive it, one at a time, each step a step of the machine, interleaved with
everything else: ``restarting`` (one more generation, a failed start's too); the start
fails (``start_failed``: due again); or, once ``linkable`` (from the third stage on, the
stage before has answered for every request of the dead process), the new process is put
in place (``_install``: the coordinator's messages to that replica go to it from now on,
and its own links go to the next stage's processes as they are now) and each live process
of the previous stage is sent a ``link`` on its coordinator connection (in no order with
its link from the stage before it); once each has applied it (its link at that index goes
to the new process from then on) or died, ``started`` (routed to again; refused if the
core heard the new process die meanwhile). So whatever the previous stage sends down that
index, data or an abort it chases, goes to the dead process (lost) before the ``link`` and
to the new one after it, which holds nothing, applies it, answers it (tagged, as its build
does) and chases it on as any stage does; an index of ``-1`` sends nothing. Ids the core
freed are added again, so that a stale abort that went into the new generation can meet
a new request of its id: the checks above (freed only once no abort of it, nor an answer,
is on its way; aborted only once every stage applied the coordinator's abort; exactly one
end) catch it. A restart still waiting to link its process in once every stage is run dry
fails the run (``linkable`` must not wait for ever). 1,000 examples: about 16 s.
:class:`RestartRaceModel` is the same machine drawn where a restarted process meets a
later death: four stages, the third restarting, a pool or a restarting stage before it;
up to three deaths from the second step on, a process before a restarted one more likely
to die, no close; restarts and deaths as often as the stages' work, and a slow last stage
(it takes its inputs a quarter as often). 1,000 examples: about 16 s. Without the ``-1``
routes (the core's module docstring, "Tagged aborts") it finds their race in 50 to 1,200
examples (a median of about 350, over ten seeds): stage 2's process dies while a request
is in the pipeline, the request is aborted, its new process is linked in once stage 1 has
answered, then the request's process of stage 0 dies; stage 1 chases the tagged abort sent
after that death into the new process (which never held the request, and passes it on),
and the request is freed while that copy is still on its way.
"""

from __future__ import annotations

import functools
import sys
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from enginecore.stage._edge import BEFORE, END, ENDED, FIRST, MORE, ONLY, REPORT, SENT_ON
from enginecore.stage._errors import (
    EngineDeadError,
    NoReplicaError,
    PipelineRequestError,
    PipelineStageDeadError,
    StageClosedError,
)
from enginecore.stage._pipeline_core import PipelineCore, PipelineDeliveries, RequestState
from enginecore.stage._pool_core import RestartPolicy
from enginecore.stage._session import ABORTED, FINISHED, End, StreamCore

pytestmark = pytest.mark.timeout(600)  # ~45 s; shrinking a failure takes minutes

LIVE, ABORTING, CLOSING = RequestState.LIVE, RequestState.ABORTING, RequestState.CLOSING


def show(items: list[Any]) -> list[Any]:
    """A stream's items, each end as what it is (``FINISHED``, ``ABORTED``, or its error)."""
    return [
        ("FINISHED" if x is FINISHED else "ABORTED" if x is ABORTED else f"End({x.exc!r})")
        if type(x) is End
        else x
        for x in items
    ]


class Inc:
    """One incarnation of a request id: one add, its stream, and what the model knows of it
    (the truth, ahead of what the core has heard)."""

    def __init__(self, no: int, rid: str, n: int, nbytes: int) -> None:
        self.no = no
        self.rid = rid
        self.nbytes = nbytes  # its share of the bytes budget
        self.stream = StreamCore(rid)
        self.seen: list[Any] = []  # what the consumer has taken from the stream
        self.emitted: list[list[int]] = [[] for _ in range(n)]  # tokens each stage emitted
        self.ended = [False] * n  # stage k ended it (its end marker emitted)
        self.sent = [0] * n  # and sent on that many payloads
        self.errors: list[int] = []  # stages that emitted an error for it
        self.caller_aborted = False
        self.coord_abort = False  # the core asked to abort it
        self.coord_applied: set[int] = set()  # stages that applied the core's abort
        self.confirms = 0  # aborted events the core got for it while it was not live
        self.raced = False  # it reached a stage after that stage applied a death's abort
        self.forgotten = False
        self.in_core = True
        self.end_seen = False
        # Retry: gen[k], the replays' fences issued that cover stage k (a stage's attempt
        # counts while its generation is this); fences_due[k], those stage k has not yet
        # answered to the core; retries[k], replays into stage k; delivered_from, the
        # stages whose payloads the consumer may have (the stream got).
        self.gen = [0] * n
        self.fences_due = [0] * n
        self.retries = [0] * n
        self.replay_stage: dict[int, int] = {}  # attempt -> the stage that failed
        # PooledModel: its route (a replica per stage), and the stages whose replica on it
        # died (replica_dead: that stage counts as having applied its aborts).
        self.route: tuple[int, ...] | None = None
        self.cut: set[int] = set()

    def __repr__(self) -> str:
        return f"<{self.rid}#{self.no}>"

    def items(self) -> list[Any]:
        return self.seen + self.stream._buf

    def done(self) -> bool:
        """Whether it is done in the pipeline, in truth: each stage it reached ended it."""
        last = len(self.ended) - 1
        for k, ended in enumerate(self.ended):
            if not ended:
                return False
            if k == last or self.sent[k] == 0:
                return True
        return True  # pragma: no cover


class Proc:
    """One process of a stage: replica *r* of stage *k*, started *gen* times before (a
    restart makes a new one in its place). *links*: per replica of the next stage, the
    process its link goes to now (a ``link`` message replaces one). A message sent to a
    process that is dead is lost."""

    __slots__ = ("dead", "gen", "k", "links", "r")

    def __init__(self, k: int, r: int, gen: int = 0) -> None:
        self.k = k
        self.r = r
        self.gen = gen
        self.dead = False
        self.links: list[Proc] = []

    def __repr__(self) -> str:
        return f"<process {self.k}.{self.r}#{self.gen}{' dead' if self.dead else ''}>"


# What a stage's queues hold: (the message, the process that sent it on a link or None,
# the process it was sent to or None: one for the whole stage, as a release or a gone).
Entry = tuple[tuple[Any, ...], "Proc | None", "Proc | None"]


class Req:
    """A request live in one simulated stage (the stage runtime's live set), held by its
    process *proc* there."""

    __slots__ = (
        "gen",
        "in_engine",
        "inc",
        "input_ended",
        "proc",
        "report",
        "sender",
        "sent",
        "spoke",
    )

    def __init__(
        self, inc: Inc, in_engine: bool, input_ended: bool, gen: int = 0, proc: Proc | None = None
    ) -> None:
        self.inc = inc
        self.proc = proc
        self.gen = gen  # the fences of its request this stage had applied when it came
        self.in_engine = in_engine  # the engine has it (it can step it)
        self.input_ended = input_ended
        self.sent = 0  # payloads sent on
        self.report = False  # its END said REPORT: it reports its own end
        self.spoke = False  # it sent the caller payloads: it reports its own end
        self.sender: Proc | None = None  # the process of the previous stage that fed it

    def current(self, k: int) -> bool:
        """Whether it is its request's attempt that counts in stage *k* (no replay's fence
        was issued after it came)."""
        return self.gen == self.inc.gen[k]


class Log:
    """A stage's replay log of one request (``PipeStage``): how many payloads it sent on,
    whether it ended the request, whether the log outgrew its bound."""

    __slots__ = ("ended", "flag", "inc", "items", "proc", "unlogged")

    def __init__(self, inc: Inc, proc: Proc | None = None) -> None:
        self.inc = inc
        self.proc = proc  # the process that keeps it
        self.items = 0
        self.ended = False
        self.flag = 0  # its END's REPORT bit
        self.unlogged = False


class SimStage:
    """One stage: its two inputs (from the coordinator, and from the previous stage's
    link), its live requests, and its event queue to the coordinator."""

    def __init__(self, k: int, last: bool, feed: bool, logs: bool = False) -> None:
        self.k = k
        self.last = last
        self.feed = feed  # the engine has feed(): it takes each input as it arrives
        self.logging = logs  # its edge retries: it keeps replay logs
        self.logs: dict[str, Log] = {}
        self.fenced: dict[int, int] = {}  # id(inc) -> the replays' fences applied here
        self.cq: deque[Entry] = deque()  # from the coordinator
        self.inq: deque[Entry] = deque()  # from the previous stage's links
        self.events: deque[tuple[Any, ...]] = deque()
        self.live: dict[str, Req] = {}
        # Ended here before their input did, awaiting the previous stage's END:
        self.early: dict[str, Req] = {}
        self.dead_aborted: dict[str, Inc] = {}  # a death's abort applied while absent here
        self.dead = False
        # PooledModel: the processes of the previous stage whose `gone` it applied (their
        # later link messages are dropped).
        self.gone_from: set[Proc] = set()

    def __repr__(self) -> str:
        return f"<stage {self.k}>"

    def steppable(self) -> list[str]:
        return sorted(rid for rid, r in self.live.items() if r.in_engine)


# What a step does with a request: (a payload for the caller, one sent on, its end), or an
# error, or a stray output; errors are rare in some examples, frequent in others.
STEPS = [(c, n, f) for c in (False, True) for n in (False, True) for f in (False, True)]
OTHERS = ["reject", "reject-and-drop", "unrouted", "engine-own", "overflow", "reject-later"]
ACTIONS = {
    False: st.sampled_from([*STEPS, *STEPS, *OTHERS, "reject-later"]),
    True: st.sampled_from([*STEPS, *OTHERS, "reject", "reject-and-drop", "reject-later"]),
}
# The retry model's: requests that stay in a stage while it sends on (so that two stages
# hold them), and errors past the first stage.
RETRY_ACTIONS = st.sampled_from(
    [*STEPS, (False, True, False), (True, True, False), "reject-later", "reject-later", "overflow"]
)
# An add: (how many ids, whether its send fails, whether it reuses freed ids, its bytes).
ADDS = [(c, False, r, b) for c in (1, 2) for r in (False, True) for b in (10, 35)]
ADD = st.sampled_from([*ADDS, (1, True, False, 10), (2, True, True, 35)])
# What happens next (the stages' work most often).
ACT = st.sampled_from(
    ["deliver_input", "step", "deliver"] * 3 + ["add", "caller", "caller", "fault"]
)

# The model's caller adds no more while the core holds this many requests: a few requests
# that go through every stage, rather than many stuck in the first.
MAX_CONCURRENT = 3


def _model_settings(max_examples: int) -> settings:
    """Every model's run: *max_examples* examples of 50 steps, no deadline."""
    return settings(
        max_examples=max_examples,
        stateful_step_count=50,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


class PipelineModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.incs: list[Inc] = []
        self.current: dict[str, Inc] = {}  # each id's latest incarnation
        self.by_stream: dict[int, Inc] = {}
        self.owner: dict[int, Inc] = {}  # token -> the incarnation it is a payload of
        self.token_stage: dict[int, int] = {}
        self.tokens = 0
        self.ids = 0
        self.opened = 0
        self.freed = 0
        self.closed = False
        self.failure: tuple[str, int] | None = None  # why the core must refuse adds
        self.orphans: dict[str, Inc] = {}  # what the core held when a stage died
        self.reused = 0
        self.steps = 0
        self.dying = 0  # PooledModel: the replica whose death the core is told of

    # -- setup -------------------------------------------------------------------------------

    @initialize(
        n=st.sampled_from([2, 3, 4, 1]),
        budget=st.sampled_from([None, 2, None, 1, 3]),
        max_bytes=st.sampled_from([None, None, 60, 40]),
        feeds=st.lists(st.booleans(), min_size=4, max_size=4),
        faults=st.sampled_from([None, 15, 5, 25]),
        first=st.integers(1, MAX_CONCURRENT),
        errors=st.booleans(),
        retry=st.lists(st.sampled_from([0, 1, 2, 1]), min_size=3, max_size=3),
        quiet=st.booleans(),
        flags=st.sampled_from([True, True, False]),
    )
    def setup(
        self,
        n: int,
        budget: int | None,
        max_bytes: int | None,
        feeds: list[bool],
        faults: int | None,
        first: int,
        errors: bool,
        retry: list[int],
        quiet: bool,
        flags: bool = True,
    ) -> None:
        self.n = n
        self.names = [f"stage{k}" for k in range(n)]
        self.retry = [0, *retry[: n - 1]]
        self.core: PipelineCore[StreamCore] = self.make_core(budget, max_bytes)
        # Each stage's processes (one per replica), each linked to every one of the next.
        self.procs = [[Proc(k, r) for r in range(c)] for k, c in enumerate(self.core.replicas)]
        for here, after in zip(self.procs, self.procs[1:], strict=False):
            for proc in here:
                proc.links = list(after)
        self.budget = budget
        self.max_bytes = max_bytes
        self.stages = [
            SimStage(k, k == n - 1, feeds[k], k < n - 1 and self.retry[k + 1] > 0) for k in range(n)
        ]
        # Quiet: a stage whose edge in retries sends the caller nothing (it may still be
        # retried then; most of its requests would not be, once it sent the caller any).
        self.quiet = quiet
        # Flags: the stages flag a fence's abort and its aborted (docs/wire.md section 8);
        # without (stages of an older build), every aborted is unflagged.
        self.flags = flags
        if any(self.retry):
            event("retrying edges" if flags else "retrying edges, fences unflagged")
        self.faults = faults  # from which step on this run may kill a stage or close
        self.errors = errors  # whether engines reject often
        self.actions = ACTIONS[errors]
        event(f"{n} stages")
        # Requests to begin with: hypothesis runs each example with some rules left out (swarm
        # testing), ``add`` among them at times.
        for _ in range(first):
            self.admit([self.new_id()], False, 10)

    def make_core(self, budget: int | None, max_bytes: int | None) -> PipelineCore[StreamCore]:
        """The core under test (:class:`PooledModel`: one whose stages are replica pools)."""
        return PipelineCore(self.names, budget, max_bytes, self.retry)

    # -- the core, as the IO layer calls it ----------------------------------------------------

    def in_core(self) -> list[Inc]:
        return [self.by_stream[id(r.stream)] for r in self.core._requests.values()]

    def call(
        self,
        fn: Callable[[float, PipelineDeliveries[StreamCore]], object],
        via: str,
        k: int | None = None,
        rid: str | None = None,
    ) -> PipelineDeliveries[StreamCore]:
        """Call the core (under the pipeline's lock), then do what its deliveries ask, and
        check what the call did to the streams and the core's table."""
        self.now += 1.0
        before = self.in_core()
        states = {id(i): self.core.state(i.rid) for i in before}
        waiting = {id(i.stream): len(i.stream._buf) for i in before if i.stream._waiting}
        d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
        fn(self.now, d)
        after = self.in_core()
        after_ids = {id(i) for i in after}
        assert after_ids <= {id(i) for i in before}, f"a request entered the core by {via}"

        # Wakes: each stream once, exactly those that waited and got something.
        woken = [id(s) for s in d.wake]
        assert len(set(woken)) == len(woken), f"a stream woken twice by one call ({via})"
        for sid in woken:
            assert sid in waiting, f"{self.by_stream[sid]} woken, but nobody waited ({via})"
        for sid, n0 in waiting.items():
            stream = self.by_stream[sid].stream
            grew = len(stream._buf) > n0
            assert grew == (sid in woken), f"{self.by_stream[sid]}: grew {grew}, woken ({via})"
            assert stream._waiting is not grew, f"{self.by_stream[sid]}: grew {grew}, waiting"

        # What ended in this call, and how.
        for inc in before:
            if inc.end_seen or inc.stream._ended is None:
                continue
            inc.end_seen = True
            self.check_end(inc, inc.stream._ended, via, k, rid, states[id(inc)])

        # What left the core in this call, and why.
        left = [i for i in before if id(i) not in after_ids]
        assert d.freed == len(left), f"freed {d.freed}, but {left} left the core ({via})"
        self.freed += d.freed
        for inc in left:
            inc.in_core = False
            self.check_freed(inc, via)
        for inc in after:  # the core keeps an aborted request until n confirmations
            if inc.cut:
                continue  # after a replica's death a stage may answer twice (tags)
            assert inc.confirms < self.n or any(inc.fences_due), (
                f"{inc} kept after {inc.confirms} confirmations, no fence due"
            )

        # Replays: only of a live request, by the stage before the one that failed it,
        # while it has replays left and nothing of that stage or a later one reached the
        # caller; what stages from there on did is of an earlier attempt from now on.
        if d.replays:
            assert via == "error", f"a replay asked for by {via}"
        for p, r, attempt in d.replays:
            inc = self.current[r]
            c = p + 1
            assert r == rid, f"a replay of {r}, after {rid} failed"
            assert c == k, f"a replay by {p}, after stage {k} failed"
            assert states[id(inc)] is LIVE, f"a replay of {inc}, {states[id(inc)]}"
            assert inc.stream._ended is None
            spoke = [t for t in inc.items() if type(t) is not End and self.token_stage[t] >= c]
            assert not spoke, f"{inc} replayed to stage {c}, its caller has {spoke} from there"
            inc.retries[c] += 1
            assert inc.retries[c] <= self.retry[c], f"{inc}: {inc.retries[c]} replays to {c}"
            inc.replay_stage[attempt] = c
            inc.errors = [e for e in inc.errors if e < c]
            for j in range(c, self.n):
                inc.emitted[j] = []
                inc.ended[j] = False
                inc.sent[j] = 0
                inc.gen[j] += 1
                inc.fences_due[j] += 1
            event("a request was replayed")
            self.to_stage(p, ("replay", r, inc, attempt), self.proc_at(p, inc.route))
        if d.releases:
            assert via == "outputs", f"releases by {via}"
            for r in d.releases:
                inc = self.current[r]
                assert not inc.in_core, f"{inc} released, still in the core"
                assert inc.stream._ended is FINISHED, f"{inc} released, not finished"
            for s in self.stages:
                if s.logging:
                    self.to_stage(s.k, ("release", list(d.releases)), None)

        # The aborts the core asks for: to the first stage (the abort chases the data from
        # there), and, after a death, to the stage after the dead one.
        if via == "dead":
            assert k is not None
            self.send_death_aborts(k, before, states, d)
        elif via == "replica_dead":
            assert k is not None
            self.send_replica_death_aborts(k, before, states, d)
        elif d.aborts:
            assert via in ("abort", "error", "replayed", "outputs"), f"an abort asked for by {via}"
            assert not d.stage_aborts, f"an abort of a later stage asked for by {via}"
            targets: dict[str, Inc] = {}
            for a in d.aborts:
                inc = self.current[a]
                assert inc.in_core, f"an abort of {inc}, which the core does not hold"
                assert self.core.state(a) in (ABORTING, CLOSING)
                assert not inc.coord_abort, f"{inc} aborted twice by the core"
                inc.coord_abort = True
                targets[a] = inc
            # (To a dead first stage the send fails, and the IO layer ignores it.)
            self.send_aborts(0, d.aborts, "core", targets, d.routes)
        else:
            assert not d.stage_aborts, f"an abort of a later stage asked for by {via}"
        return d

    def send_death_aborts(
        self,
        k: int,
        before: list[Inc],
        states: dict[int, RequestState | None],
        d: PipelineDeliveries[StreamCore],
    ) -> None:
        """Stage *k* died: the core aborts what it held from the first stage and in the
        stage after the dead one; check that and send them."""
        held = {i.rid: i for i in before}
        unaborted = {i.rid for i in before if states[id(i)] is LIVE}
        assert set(d.aborts) <= set(held), f"a dead stage's aborts of {d.aborts}"
        if k > 0:
            assert unaborted <= set(d.aborts), f"{unaborted} not aborted from the first stage"
        else:
            assert not d.aborts, f"aborts to the dead first stage: {d.aborts}"
        later = dict(d.stage_aborts)
        assert set(later) <= {k + 1}, f"a dead stage {k}'s aborts to stages {list(later)}"
        # Every one: no abort from the first stage gets past k, and neither does one that an
        # earlier death sent on its way through k.
        targets = {**self.orphans, **held}
        if k + 1 < self.n and targets:
            assert set(later.get(k + 1, ())) == set(targets), f"{later} after stage {k} died"
        else:
            assert not later, f"{later} after stage {k} died"
        self.orphans.update(held)
        if d.aborts:
            self.send_aborts(0, d.aborts, "dead", held, d.routes)
        if later:
            self.send_aborts(k + 1, later[k + 1], "dead", targets, d.routes)

    def send_replica_death_aborts(
        self,
        k: int,
        before: list[Inc],
        states: dict[int, RequestState | None],
        d: PipelineDeliveries[StreamCore],
    ) -> None:
        """A replica of stage *k* died (PooledModel): the requests routed through it end;
        the live ones are aborted from the first stage, all of them from the stage after it
        (after its `gone`), tagged: check that and send them."""
        r = self.dying
        later = dict(d.stage_aborts)
        if self.failure is not None:
            # The pipeline has failed: its requests are over, but the aborts sent at the
            # failure to the stage after a dead one may have gone to this process, dead
            # before the core heard: the stage after it gets those routed through it again.
            assert not d.aborts, f"aborts {d.aborts} from the first stage after the failure"
            targets = {
                rid: i
                for rid, i in self.orphans.items()
                if i.route is not None and i.route[k] == r and k not in i.cut
            }
            if k + 1 < self.n and targets:
                assert set(later) == {k + 1}, f"{later} after a replica of {k} died"
                assert set(later[k + 1]) == set(targets), f"{later} after a replica of {k} died"
                self.send_aborts(k + 1, later[k + 1], "dead", targets, d.routes)
            else:
                assert not later, f"{later} after a replica of {k} died"
            return
        held = {i.rid: i for i in before}
        through = {rid: i for rid, i in held.items() if i.route is not None and i.route[k] == r}
        live = {rid for rid in through if states[id(held[rid])] is LIVE}
        assert set(d.aborts) == (live if k > 0 else set()), f"{d.aborts}: {live} live"
        for rid in live:
            inc = held[rid]
            assert not inc.coord_abort, f"{inc} aborted twice by the core"
            inc.coord_abort = True
        # Aborted after it too, unless its replica there died before (no one to reach).
        after = {rid for rid, i in through.items() if k + 1 < self.n and k + 1 not in i.cut}
        if after:
            assert set(later) == {k + 1}, f"{later} after a replica of {k} died"
            assert set(later[k + 1]) == after, f"{later} after a replica of {k} died"
            # Tagged, unless a replica after it on the route died before (the abort
            # stops there: the stages after wait for that death's abort).
            tagged = {(k + 1, rid) for rid, i in through.items() if k + 1 not in i.cut}
            assert set(d.tags) == tagged, f"tags {d.tags}, not {tagged}"
        else:
            assert not later, f"{later} after a replica of {k} died"
        for stage, _, side, dead, dead_r in d.gone:
            if side == "previous":
                self.to_stage(stage, ("gone", self.procs[dead][dead_r]), None)
        if d.aborts:
            self.send_aborts(0, d.aborts, "core", held, d.routes)
        if later:
            by_tag: dict[int, list[str]] = {}
            for rid in later[k + 1]:
                by_tag.setdefault(d.tags.get((k + 1, rid), 0), []).append(rid)
            for tag, rids in by_tag.items():
                self.send_aborts(k + 1, rids, "post", held, d.routes, tag or None)

    # -- the coordinator's messages, as the IO layer sends them --------------------------------

    def proc_at(self, k: int, route: tuple[int, ...] | None) -> Proc | None:
        """The process of stage *k* that a message on *route* goes to now (``None``: a
        route that names none there, ``-1``: the IO layer sends nothing)."""
        i = route[k] if route else 0
        procs = self.procs[k]
        return procs[i] if 0 <= i < len(procs) else None

    def to_stage(self, k: int, item: tuple[Any, ...], dst: Proc | None) -> None:
        """The coordinator sends *item* to process *dst* of stage *k* (``None``: to each
        of the stage's processes; the model applies it once)."""
        s = self.stages[k]
        if not s.dead and (dst is not None or item[0] in ("release", "gone")):
            s.cq.append((item, None, dst))

    def send_aborts(
        self,
        k: int,
        rids: list[str],
        origin: str,
        targets: dict[str, Inc],
        routes: dict[str, tuple[int, ...]],
        tag: int | None = None,
    ) -> None:
        """``_send_routed_aborts``: an abort of *rids* to stage *k*, each to the process its
        route names there, with its route (which the stages chase it along)."""
        by: dict[int, tuple[Proc, list[str]]] = {}
        for rid in rids:
            dst = self.proc_at(k, routes.get(rid))
            if dst is not None:
                by.setdefault(id(dst), (dst, []))[1].append(rid)
        for dst, ids in by.values():
            item = self.abort_item(ids, origin, targets, tag, routes)
            self.to_stage(k, item, dst)

    @staticmethod
    def abort_item(
        rids: list[str],
        origin: str,
        targets: dict[str, Inc],
        tag: int | None,
        routes: Mapping[str, tuple[int, ...] | None],
    ) -> tuple[Any, ...]:
        """An ``abort`` message: its ids, where it comes from (``core``, ``dead``, ``post``
        after a replica's death, ``fence``), the incarnation each id is of, its tag and
        each id's route (``None``: none)."""
        ids = list(rids)
        return (
            "abort",
            ids,
            origin,
            {r: targets[r] for r in ids},
            tag,
            {r: routes.get(r) for r in ids},
        )

    def check_end(
        self,
        inc: Inc,
        end: End,
        via: str,
        k: int | None,
        rid: str | None,
        before: RequestState | None = None,
    ) -> None:
        if end is FINISHED:
            assert via == "outputs", f"{inc} finished by {via}"
            assert inc.done(), f"{inc} finished, but it is not done: {inc.ended} {inc.sent}"
            assert not inc.errors, f"{inc} finished, but stages {inc.errors} reported errors"
            self.check_complete(inc, "finished")
            event("a stream finished")
        elif end is ABORTED:
            assert via == "aborted", f"{inc} ended aborted by {via}"
            assert inc.caller_aborted, f"{inc} ended aborted, but the caller never aborted it"
            assert inc.coord_applied == set(range(self.n)), (
                f"{inc} ended aborted, but only stages {sorted(inc.coord_applied)} applied the "
                f"abort"
            )
            self.check_complete(inc, "aborted")
            event("a stream ended aborted")
        else:
            exc = end.exc
            if via == "error":
                assert type(exc) is PipelineRequestError, f"{inc}: {exc!r} ({via})"
                assert k is not None
                assert rid == inc.rid
                assert exc.stage == self.names[k]
                assert exc.req_id == inc.rid
                assert k in inc.errors, f"{inc}: an error of {exc.stage}, which reported none"
                if self.retry[k] and before is LIVE:  # why it was not retried
                    spoke = [
                        t for t in inc.items() if type(t) is not End and self.token_stage[t] >= k
                    ]
                    if inc.retries[k] == self.retry[k]:
                        assert "(retried " in exc.message, f"{inc}: {exc!r}"
                        event("a request failed after its retries")
                    else:
                        assert spoke, f"{inc}: {exc!r}, not retried, its caller had nothing"
                        assert "(not retried: " in exc.message, f"{inc}: {exc!r}"
                event("a stream ended with a stage's error")
            elif via == "replayed":
                assert type(exc) is PipelineRequestError, f"{inc}: {exc!r} ({via})"
                assert k is not None
                assert k + 1 < self.n
                assert exc.stage == self.names[k + 1]
                assert "(not retried: " in exc.message, f"{inc}: {exc!r}"
                assert before is LIVE
                event("a replay failed")
            elif via in ("dead", "replica_dead"):
                assert type(exc) is PipelineStageDeadError, f"{inc}: {exc!r} ({via})"
                assert k is not None
                assert exc.stage == self.names[k]
                assert type(exc.__cause__) is EngineDeadError
                assert exc.exit_code == -9
            elif via == "close":
                assert exc is self.close_exc, f"{inc}: {exc!r} ({via})"
            else:
                raise AssertionError(f"{inc} ended with {exc!r} by {via}")

    def check_complete(self, inc: Inc, how: str) -> None:
        tokens = [t for t in inc.items() if type(t) is not End]
        for k in range(self.n):
            got = [t for t in tokens if self.token_stage[t] == k]
            assert got == inc.emitted[k], (
                f"{inc} {how} with {got} of stage {k}, which emitted {inc.emitted[k]}"
            )

    def check_freed(self, inc: Inc, via: str) -> None:
        assert inc.stream._ended is not None or via == "forget", f"{inc} freed, not ended"
        if inc.cut and via in ("aborted", "replica_dead"):
            # A replica on its route died: freed only once no abort of it is left on its
            # way to a stage (one would hit a new request of its id there), nor an answer.
            self.check_no_abort_left(inc)
            return
        if via in ("outputs", "aborted"):
            assert not any(inc.fences_due), f"{inc} freed, fences due {inc.fences_due}"
            if via == "outputs":  # its last end marker, while live
                assert inc.done()
                assert inc.stream._ended is FINISHED
                assert not inc.coord_abort, f"{inc} freed before its abort went through"
            else:
                assert inc.confirms >= self.n, f"{inc} freed after {inc.confirms} confirmations"
                assert inc.coord_applied == set(range(self.n)), (
                    f"{inc} freed, but only stages {sorted(inc.coord_applied)} applied the "
                    f"coordinator's abort"
                )
            for s in self.stages:
                held = s.live.get(inc.rid)
                assert held is None or held.inc is not inc, f"{inc} freed, held by {s.k}"
        else:
            assert via in ("dead", "close", "forget"), f"{inc} freed by {via}"

    def check_no_abort_left(self, inc: Inc) -> None:
        """No abort of *inc* is on its way to a live stage (one it would still apply), and
        no answer to one is on its way to the core: its id may be added again."""
        for s in self.alive():
            for q in (s.cq, s.inq):
                for entry in q:
                    item = entry[0]
                    if item[0] != "abort" or item[2] == "fence":
                        continue
                    if any(item[3][rid] is inc for rid in item[1]) and not self.lost(
                        s, entry, q is s.inq
                    ):
                        raise AssertionError(
                            f"{inc} freed, its abort still on its way to stage {s.k} "
                            f"({item[2]}, tag {item[4]}, to {entry[2]}, from {entry[1]})"
                        )
        for s in self.stages:
            for ev in s.events:
                if ev[0] == "aborted" and ev[2] != "fence":
                    assert not any(ev[3][rid] is inc for rid in ev[1]), (
                        f"{inc} freed, an answer of stage {s.k} to its abort still on its way"
                    )

    def heard_dead(self, k: int, r: int, d: PipelineDeliveries[StreamCore]) -> None:
        """The core was told that process *r* of stage *k* died (``replica_dead``): no
        restart without a policy (:class:`RestartModel`: a restart is due)."""
        assert not d.restarts, f"restarts {d.restarts} without a policy"

    @staticmethod
    def lost(s: SimStage, entry: Entry, linked: bool) -> bool:
        """Whether a message that stage *s* takes is lost: the process it was sent to died
        (a process started again in its place is another), or (*linked*: it came on a
        link) it came from a process of the previous stage whose `gone` *s* has applied
        (PooledModel)."""
        _, src, dst = entry
        if dst is not None and dst.dead:
            return True
        return linked and src is not None and src in s.gone_from

    @staticmethod
    def _fed_by(req: Req, gone: Proc) -> bool:
        """Whether *req*'s input came from process *gone* of the previous stage, or from an
        older one at its index (``PipeStage.pipe_gone``: a sender is its replica index and
        its generation; a process started again in its place is another, whose data and
        this ``gone`` may come in either order)."""
        src = req.sender
        return src is not None and src.r == gone.r and src.gen <= gone.gen

    # -- the stages ------------------------------------------------------------------------

    def send_on(self, s: SimStage, item: tuple[Any, ...], src: Proc | None) -> None:
        """Process *src* of stage *s* sends *item* down its link to the next stage's
        process the route names next (``chase_abort``: an abort along each id's route, as
        the abort carries it), whichever process that link goes to now: nothing for an
        index outside its links (``-1``)."""
        if s.last:
            return
        nxt = self.stages[s.k + 1]
        if nxt.dead:
            return
        assert src is not None
        if item[0] != "abort":
            dst = self.link_of(s.k, src, item[2].route)
            if dst is not None:
                nxt.inq.append((item, src, dst))
            return
        routes = item[5]
        by: dict[int, tuple[Proc, list[str]]] = {}
        for rid in item[1]:
            dst = self.link_of(s.k, src, routes.get(rid))
            if dst is not None:
                by.setdefault(id(dst), (dst, []))[1].append(rid)
            else:
                event("an abort's chase stopped before a dead process (-1)")
        for dst, ids in by.values():
            nxt.inq.append((self.abort_item(ids, item[2], item[3], item[4], routes), src, dst))

    @staticmethod
    def link_of(k: int, src: Proc, route: tuple[int, ...] | None) -> Proc | None:
        """Where process *src* of stage *k* sends what *route* routes next: its link at
        that index (``None``: an index outside them, as ``links[index] if 0 <= index <
        len(links) else None``)."""
        i = route[k + 1] if route else 0
        links = src.links
        return links[i] if 0 <= i < len(links) else None

    def new_token(self, s: SimStage, inc: Inc | None, current: bool = True) -> int:
        """A payload for the caller; one of an earlier attempt (not *current*) must never
        reach it: it is not among what the stage emitted."""
        self.tokens += 1
        t = self.tokens
        self.token_stage[t] = s.k
        if inc is not None:
            self.owner[t] = inc
            if current:
                inc.emitted[s.k].append(t)
        return t

    def error_event(self, s: SimStage, rid: str, req: Req) -> None:
        s.events.append(("error", rid))
        if req.current(s.k):
            req.inc.errors.append(s.k)

    def drop_log(
        self, s: SimStage, rid: str, inc: Inc | None = None, proc: Proc | None = None
    ) -> None:
        log = s.logs.get(rid)
        if (
            log is not None
            and (inc is None or log.inc is inc)
            and (proc is None or log.proc is proc)
        ):
            del s.logs[rid]

    def replay(self, s: SimStage, rid: str, inc: Inc, attempt: int, proc: Proc | None) -> None:
        """``PipeStage.pipe_replay`` in process *proc*: the fence down the link, always;
        then the logged items again, if it has them; and the answer."""
        self.send_on(s, self.abort_item([rid], "fence", {rid: inc}, None, {rid: inc.route}), proc)
        log = s.logs.get(rid)
        ok = log is not None and not log.unlogged and log.proc is proc
        if ok:
            assert log is not None
            assert log.inc is inc, f"stage {s.k}: a replay of {inc} found the log of {log.inc}"
            kinds = [FIRST] + [MORE] * (log.items - 1)
            if log.ended:
                if log.items == 1:
                    kinds = [ONLY | log.flag]
                else:
                    kinds.append(END | log.flag)
            for kind in kinds:
                self.send_on(s, (kind, rid, inc), proc)
        s.events.append(("replayed", rid, attempt, ok))

    def take_input(self, s: SimStage, entry: Entry, reject: bool, linked: bool = False) -> None:
        """Process ``entry[2]`` of stage *s* takes a message (*linked*: from its link)."""
        item, _, dst = entry
        kind = item[0]
        if kind == "gone":  # PooledModel: a process of the previous stage died
            gone = item[1]
            s.gone_from.add(gone)
            # PipeStage.pipe_gone: what ended here early, with its input from that process,
            # waits no more for an END that may have been dropped; what its successor at
            # that index sent, taken before this gone, still waits.
            for rid in [rid for rid, req in s.early.items() if self._fed_by(req, gone)]:
                del s.early[rid]
            return
        if self.lost(s, entry, linked):  # what a dead process never gets
            return
        if kind == "link":  # RestartModel: replica item[1] of the next stage is item[2] now
            assert dst is not None
            dst.links[item[1]] = item[2]
            return
        if kind == "abort":  # applied, reported, chased on
            _, rids, origin, targets, tag, _ = item
            for rid in rids:
                req = s.live.get(rid)
                if req is not None and req.proc is dst:
                    del s.live[rid]
                else:
                    req = None  # (another process of the stage holds that id)
                early = s.early.get(rid)
                if early is not None and early.proc is dst:
                    del s.early[rid]
                target = targets[rid]
                assert req is None or req.inc is target, (
                    f"stage {s.k}: an abort of {target} hit {req.inc} ({origin}, tag {tag})"
                )
                self.drop_log(s, rid, proc=dst)
                if origin in ("core", "post"):
                    target.coord_applied.add(s.k)
                elif origin == "fence":
                    s.fenced[id(target)] = s.fenced.get(id(target), 0) + 1
                elif req is None:
                    s.dead_aborted[rid] = target
            s.events.append(("aborted", list(rids), origin, targets, tag))
            self.send_on(s, item, dst)
            return
        if kind == "replay":
            self.replay(s, item[1], item[2], item[3], dst)
            return
        if kind == "release":  # not that of a request live here: a new one of that id
            for rid in item[1]:
                if rid not in s.live:
                    self.drop_log(s, rid)
            return
        rid, inc = item[1], item[2]
        if kind == "add" or kind & FIRST:
            held = s.live.get(rid)
            assert held is None, f"stage {s.k}: {inc} arrived while {held.inc} is live here"
            if s.dead_aborted.get(rid) is inc and inc is not None:
                inc.raced = True
                event("a request reached a stage after a death's abort of it")
            gen = s.fenced.get(id(inc), 0)
            if reject and (kind == "add" or s.feed or kind & END):
                self.error_event(s, rid, Req(inc, False, False, gen, dst))  # never live
                return
            if kind == "add":
                s.live[rid] = Req(inc, True, True, gen, dst)
            else:
                only = kind & END != 0
                s.live[rid] = req = Req(inc, s.feed or only, only, gen, dst)
                req.report = kind & REPORT != 0
                req.sender = entry[1]  # the process that sent it (None: the coordinator)
            return
        req = s.live.get(rid)
        if req is not None and req.proc is not dst:
            req = None  # another process of the stage holds that id
        if req is None:
            early = s.early.get(rid)
            if early is not None and early.proc is not dst:
                early = None
            if kind & END and early is not None:
                # PipeStage.pipe_late: its input has ended too
                assert early.inc is inc, f"stage {s.k}: the END of {inc} reached {early.inc}"
                del s.early[rid]
                if not kind & REPORT:
                    s.events.append(("end", rid, BEFORE, early.gen))
                event("a stage got the END of a request it had ended")
                return
            event("input of a request no longer in the stage dropped")
            return
        assert req.inc is inc, f"stage {s.k}: input of {inc} reached {req.inc}"
        assert not req.input_ended
        if reject and (kind & END or s.feed):  # feed()/close_input()/add() rejected it
            self.error_event(s, rid, s.live.pop(rid))  # DropEnded: nothing chases
            self.drop_log(s, rid, proc=dst)
            return
        if kind & END:
            req.input_ended = True
            req.in_engine = True
            req.report = kind & REPORT != 0

    def step_request(
        self, s: SimStage, rid: str, to_caller: bool, to_next: bool, fin: bool
    ) -> None:
        req = s.live[rid]
        inc = req.inc
        current = req.current(s.k)
        on: list[list[Any]] = []
        if to_next and not s.last:
            on.append([MORE if req.sent else FIRST, rid, inc])
            if s.logging:  # PipeStage._log_item: a first payload starts a new log
                if not req.sent:
                    s.logs[rid] = Log(inc, req.proc)
                log = s.logs.get(rid)
                if log is not None and log.inc is inc:
                    log.items += 1
            req.sent += 1
        if to_caller:
            s.events.append(("out", rid, self.new_token(s, inc, current), req.gen))
            if not s.last:
                req.spoke = True
        if fin:
            del s.live[rid]
            before = req.input_ended and not req.report
            if not req.input_ended:
                s.early[rid] = req
            flag = REPORT if not before or req.spoke else 0
            if req.sent:
                if req.sent == 1 and on and on[-1][0] == FIRST:
                    on[-1][0] = ONLY | flag
                else:
                    on.append([END | flag, rid, inc])
                log = s.logs.get(rid)
                if log is not None and log.inc is inc:
                    log.ended = True
                    log.flag = flag
            report = ENDED | (SENT_ON if req.sent else 0) | (BEFORE if before else 0)
            if flag or not req.sent:
                s.events.append(("end", rid, report, req.gen))
            if current:
                inc.ended[s.k] = True
                inc.sent[s.k] = req.sent
        for it in on:
            self.send_on(s, tuple(it), req.proc)

    def deliver_events(self, s: SimStage, count: int) -> None:
        """The coordinator takes stage *s*'s next *count* events, as ``_take_events`` hands
        them to the core (outputs that follow each other: one ``outputs`` call)."""
        core, k = self.core, s.k
        while count > 0 and s.events:
            ev = s.events.popleft()
            count -= 1
            kind = ev[0]
            if kind in ("out", "end"):
                evs = [ev]
                while count > 0 and s.events and s.events[0][0] in ("out", "end"):
                    evs.append(s.events.popleft())
                    count -= 1
                rids = [e[1] for e in evs]
                fins = [e[0] == "end" for e in evs]
                payloads = [e[2] for e in evs]
                for e in evs:  # an earlier attempt's (the core drops it)
                    inc = self.current.get(e[1]) if len(e) > 3 else None
                    if inc is not None and inc.in_core and e[3] < inc.gen[k]:
                        event("an earlier attempt's output or end reached the core")
                self.call(functools.partial(core.outputs, k, rids, fins, payloads), "outputs")
            elif kind == "error":
                rid = ev[1]
                self.call(functools.partial(core.error, k, rid, "rejected"), "error", k, rid)
            elif kind == "aborted":
                rids, origin, targets, tag = ev[1], ev[2], ev[3], ev[4]
                for rid in rids:
                    if origin == "fence":
                        target = targets[rid]
                        if target.cut:
                            continue  # its fences after the dead replica are not counted
                        target.fences_due[k] -= 1
                        assert target.fences_due[k] >= 0, f"{target}: a fence too many in {k}"
                        continue
                    inc = self.current.get(rid)
                    if inc is not None and inc.in_core and self.core.state(rid) is not LIVE:
                        inc.confirms += 1
                fence = origin == "fence" and self.flags
                self.call(functools.partial(core.aborted, k, rids, fence=fence, tag=tag), "aborted")
            elif kind == "replayed":
                rid, attempt, ok = ev[1], ev[2], ev[3]
                why = "" if ok else "the previous stage no longer holds its inputs"
                self.call(
                    functools.partial(core.replayed, k, rid, attempt, ok, why), "replayed", k, rid
                )
            elif kind == "replica_dead":  # PooledModel: its events so far came first
                # As _take_events hands it over: also once the pipeline has failed (the core
                # then sends the aborts that may have gone to the dead process again), not
                # after the close.
                if not self.closed:
                    self.dying = r = ev[1]
                    if self.failure is None:
                        for inc in self.in_core():
                            if inc.route is not None and inc.route[k] == r:
                                inc.cut.add(k)
                    exc = EngineDeadError("stage process 1 was killed by SIGKILL", exit_code=-9)
                    d = self.call(
                        functools.partial(core.replica_dead, k, r, exc), "replica_dead", k
                    )
                    self.heard_dead(k, r, d)
            else:
                assert kind == "dead"
                if not self.closed:  # _take_events: a death after close is no news
                    self.failure = self.failure or ("dead", k)
                    exc = EngineDeadError("stage process 1 was killed by SIGKILL", exit_code=-9)
                    self.call(functools.partial(core.stage_dead, k, exc), "dead", k)

    # -- the one rule -----------------------------------------------------------------------
    #
    # One rule that draws what happens next, rather than a rule for each: hypothesis runs
    # each example with some rules left out (swarm testing), and without any one of
    # delivering inputs, stepping and delivering events nothing gets past the first stage.
    # The example's own knobs (stages, budgets, feed, faults, errors) vary it instead. An
    # action with nothing to do returns.

    choices = ACT  # what may happen next (RestartModel: restarts too)

    @rule(data=st.data())
    def act(self, data: st.DataObject) -> None:
        getattr(self, data.draw(self.choices))(data)

    # -- the caller --------------------------------------------------------------------------

    def new_id(self) -> str:
        self.ids += 1
        return f"r{self.ids}"

    def add(self, data: st.DataObject) -> None:
        """``Pipeline.add``/``add_many``: checked, admitted if there is room, sent to the
        first stage (or forgotten, when the send fails)."""
        count, fails, reuse, nbytes = data.draw(ADD)
        core = self.core
        free = sorted(rid for rid, inc in self.current.items() if not inc.in_core)
        ids: list[str] = []
        for _ in range(count):
            if reuse and free:
                rid = data.draw(st.sampled_from(free))
                free.remove(rid)
            else:
                rid = self.new_id()
            ids.append(rid)
        too_many = self.budget is not None and count > self.budget
        too_big = self.max_bytes is not None and nbytes > self.max_bytes
        if too_many or too_big:
            with pytest.raises(ValueError, match="more than max_"):
                core.check_size(count, nbytes)
            return
        core.check_size(count, nbytes)
        if core.failure is not None:
            with pytest.raises(type(core.failure)) as info:
                core.check(ids)
            assert info.value is core.failure
            return
        if fails and core._requests:  # check refuses an id in the pipeline, and a repeat
            with pytest.raises(ValueError, match="still in the pipeline"):
                core.check([*ids, min(core._requests)])
            with pytest.raises(ValueError, match="appears twice"):
                core.check([*ids, ids[-1]])
        core.check(ids)
        self.admit(ids, fails, nbytes)

    def admit(self, ids: list[str], fails: bool, nbytes: int) -> None:
        """Admit *ids*, *nbytes* in all, if there is room, and send them to the first stage,
        or forget them (*fails*: the send failed)."""
        core = self.core
        count = len(ids)
        room = core.room()
        fits = (room is None or room >= count) and (
            self.max_bytes is None or core.bytes_in + nbytes <= self.max_bytes
        )
        assert core.admissible(ids, nbytes) is fits, f"admissible: {count} ids, {nbytes} bytes"
        if not fits:
            event("an add waited for room")
            return
        if core.in_flight >= MAX_CONCURRENT:  # the model's caller waits, for depth's sake
            return
        share, extra = divmod(nbytes, count)
        incs = []
        for i, rid in enumerate(ids):
            if rid in self.current:
                self.reused += 1
            inc = Inc(len(self.incs), rid, self.n, share + (i < extra))
            self.incs.append(inc)
            self.current[rid] = inc
            self.by_stream[id(inc.stream)] = inc
            incs.append(inc)
        core.open_many(ids, [inc.stream for inc in incs], nbytes)
        for inc in incs:
            inc.route = core.route(inc.rid)
        self.opened += count
        if fails or self.stages[0].dead:
            for inc in incs:
                inc.forgotten = True
            self.call(lambda now, d: core.forget(ids, d), "forget")
            return
        for rid, inc in zip(ids, incs, strict=True):
            self.to_stage(0, ("add", rid, inc), self.proc_at(0, inc.route))

    def caller(self, data: st.DataObject) -> None:
        """A stream's consumer takes what has arrived (and may wait for more), or the caller
        aborts (``Pipeline.abort``) live, finished and unknown ids."""
        incs = [i for i in self.incs if not i.forgotten]
        choices: list[tuple[str, Inc | None]] = [(a, i) for i in incs for a in ("take", "wait")]
        choices += [("abort", None)] * max(1, len(choices) // 4)
        action, inc = data.draw(st.sampled_from(choices))
        if inc is None:
            pool = [*sorted(self.current), "never-added"]
            ids = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=2))
            live = [rid for rid in dict.fromkeys(ids) if self.core.state(rid) is LIVE]
            d = self.call(lambda now, d: self.core.abort(ids, d), "abort")
            assert d.aborts == live
            for rid in live:
                self.current[rid].caller_aborted = True
                assert self.core.state(rid) is ABORTING
            return
        stream = inc.stream
        if inc.seen and type(inc.seen[-1]) is End:
            assert not stream._buf, f"{inc}: something after its end: {show(stream._buf)}"
            return
        inc.seen.extend(stream._buf)
        stream._buf = []
        if action == "wait" and not (inc.seen and type(inc.seen[-1]) is End):
            stream._waiting = True

    # -- the stages -------------------------------------------------------------------------

    def alive(self) -> list[SimStage]:
        return [s for s in self.stages if not s.dead]

    def deliver_input(self, data: st.DataObject, among: list[SimStage] | None = None) -> None:
        """A stage (of *among*, by default any) takes the next 1 to 3 items of one of its
        inputs (adds, link items, aborts); the engine may reject the first (often in some
        examples, rarely in others)."""
        rejects = (False, True) if self.errors else (False, False, False, False, False, True)
        ready = [
            (s, q, c, r)
            for s in (self.alive() if among is None else among)
            for q in (s.cq, s.inq)
            if q
            for c in (1, 2, 3)
            for r in rejects
        ]
        if ready:
            s, q, count, reject = data.draw(st.sampled_from(ready))
            for i in range(min(count, len(q))):
                self.take_input(s, q.popleft(), reject and i == 0, q is s.inq)

    def step(self, data: st.DataObject) -> None:
        """A stage steps a request: a payload for the caller, one sent on, its end (any
        of them: an end with neither is the engine's ``NOTHING``). Or it ends the request
        with an error: the engine's ``RequestRejected`` as its last output (``reject``), or
        before it, or its edge failed (``reject-and-drop``: ``DropEnded``); nothing chases
        either. Or it emits an unrouted output, or one of a request of the engine's own: not
        the caller's."""
        what = data.draw(self.actions)
        alive = self.alive()
        if what == "overflow":  # a request's log outgrows its bound: it is not retryable
            logs = [(s, rid) for s in alive for rid in sorted(s.logs)]
            if logs:
                s, logged = data.draw(st.sampled_from(logs))
                s.logs[logged].unlogged = True
            return
        if what in ("unrouted", "engine-own"):
            if alive:
                s = data.draw(st.sampled_from(alive))
                if what == "engine-own" and data.draw(st.booleans()):
                    s.events.append(("end", what, 0))
                else:
                    rid = None if what == "unrouted" else what
                    s.events.append(("out", rid, self.new_token(s, None)))
            return
        ready = [(s, rid) for s in alive for rid in s.steppable()]
        if what == "reject-later":  # an error past the first stage (retried, if its edge is),
            # most often of a request it shares with the next stage (whose part of it the
            # replay's fence must then end)
            ready = [(s, rid) for s, rid in ready if s.k]
            shared = [
                (s, rid) for s, rid in ready if not s.last and rid in self.stages[s.k + 1].live
            ]
            ready = shared or ready
            what = "reject-and-drop"

        if not ready:
            return
        s, rid = data.draw(st.sampled_from(ready))
        if what in ("reject", "reject-and-drop"):
            self.error_event(s, rid, s.live.pop(rid))
            if what == "reject-and-drop":  # DropEnded: PipeStage.abort lets its log go
                self.drop_log(s, rid)
        else:
            to_caller, to_next, fin = (bool(x) for x in what)
            to_caller = to_caller and not (self.quiet and self.retry[s.k])
            self.step_request(s, rid, to_caller, to_next, fin)

    def deliver(self, data: st.DataObject) -> None:
        """The coordinator takes a stage's next 1 to 3 events (outputs that follow each
        other are one ``outputs`` event): any stage's, each stage's in order."""
        ready = [(s, c) for s in self.stages if s.events for c in (1, 2, 3)]
        if ready:
            s, count = data.draw(st.sampled_from(ready))
            self.deliver_events(s, count)

    def fault(self, data: st.DataObject) -> None:
        """In a run with faults, once it has run a while: a stage dies (the coordinator gets
        its events up to some point, then its end; the rest is lost), or the pipeline's
        shutdown closes the core (the stages go on; their events are no longer the core's
        business)."""
        if self.faults is None or self.steps < self.faults or not data.draw(st.booleans()):
            return
        alive = self.alive()
        if not self.closed and (not alive or data.draw(st.sampled_from([0, 1, 2, 3])) == 3):
            self.closed = True
            self.failure = self.failure or ("closed", 0)
            self.close_exc = StageClosedError("the pipeline was shut down")
            exc = self.close_exc
            self.call(lambda now, d: self.core.close(exc, now, d), "close")
            assert self.core.in_flight == 0
            return
        if not alive:
            return
        # A stage dies more often with an abort on its way to it (which then reaches no stage
        # after it), or with requests it shares with the next stage (which then waits for
        # their end).
        which = data.draw(st.sampled_from([s for s in alive for _ in range(self.weight(s))]))
        keep = data.draw(st.integers(0, len(which.events)))
        which.dead = True
        which.events = deque(list(which.events)[:keep])
        which.events.append(("dead",))
        which.live.clear()
        which.early.clear()
        which.logs.clear()
        which.inq.clear()
        which.cq.clear()

    def weight(self, s: SimStage) -> int:
        if any(entry[0][0] == "abort" for q in (s.cq, s.inq) for entry in q):
            return 4
        nxt = None if s.last else self.stages[s.k + 1].live
        return 2 if nxt and not nxt.keys().isdisjoint(s.live) else 1

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        """The checks after every rule (one invariant: hypothesis's cost is per invariant)."""
        if not hasattr(self, "core"):
            return
        self.steps += 1
        self.streams_are_consistent()
        self.budget_adds_up()
        self.quiescent_means_over()

    def streams_are_consistent(self) -> None:
        requests = self.core._requests
        for inc in self.incs:
            items = inc.items()
            ends = [i for i, x in enumerate(items) if type(x) is End]
            assert len(ends) <= 1, f"{inc} ended twice: {show(items)}"
            if ends:
                assert ends[0] == len(items) - 1, f"{inc}: something after its end: {show(items)}"
                assert items[-1] is inc.stream._ended
            if inc.forgotten:
                assert not items, f"{inc} was forgotten, yet got {show(items)}"
            tokens = items[:-1] if ends else items
            assert len(inc.stream._arrivals) == len(tokens)
            per: list[list[int]] = [[] for _ in range(self.n)]
            for t in tokens:
                owner = self.owner.get(t)
                assert owner is inc, f"{inc} got token {t}, a payload of {owner}"
                per[self.token_stage[t]].append(t)
            for k, got in enumerate(per):
                assert got == inc.emitted[k][: len(got)], (
                    f"{inc}: stage {k}'s payloads {got}, of {inc.emitted[k]} emitted"
                )
            req = requests.get(inc.rid)
            if req is not None and req.stream is inc.stream:
                assert inc.in_core
                what = f"{inc} {req.state.value}: {show(items)}"
                if req.state is LIVE:
                    assert not ends, f"{what}, ended"
                    assert not inc.caller_aborted, f"{what}, aborted by the caller"
                    assert not inc.coord_abort, f"{what}, aborted by the core"
                elif req.state is ABORTING:
                    assert not ends, f"{what}, ended"
                    assert inc.caller_aborted, f"{what}, not aborted by the caller"
                    assert inc.coord_abort, f"{what}, its abort not sent"
                else:
                    assert ends, f"{what}, not ended"
                    assert inc.coord_abort, f"{what}, its abort not sent"
                if req.fences is not None and req.state is LIVE:
                    assert req.fences == inc.fences_due, (
                        f"{inc}: the core awaits fences {req.fences}, {inc.fences_due} are due"
                    )
            else:
                assert not inc.in_core
                assert inc.stream._ended is not None or inc.forgotten, f"{inc} left, not ended"

    def budget_adds_up(self) -> None:
        core = self.core
        if self.failure is None:
            assert core.failure is None, f"the core refuses adds: {core.failure!r}"
        elif self.failure[0] == "closed":
            assert core.failure is self.close_exc, f"closed, yet: {core.failure!r}"
        else:
            assert type(core.failure) is PipelineStageDeadError, f"{self.failure}: {core.failure!r}"
            assert core.failure.stage == self.names[self.failure[1]]
        held = core.in_flight
        assert self.opened - self.freed == held == len(core._requests), (
            f"opened {self.opened}, freed {self.freed}, in flight {held}"
        )
        room = core.room()
        if self.budget is None:
            assert room is None
        else:
            assert room == self.budget - held, f"room {room}, budget {self.budget}, held {held}"
            assert room >= 0, f"room {room}"
        nbytes = sum(inc.nbytes for inc in self.in_core())
        assert core.bytes_in == nbytes, f"bytes_in {core.bytes_in}, the requests' {nbytes}"
        assert self.max_bytes is None or nbytes <= self.max_bytes

    def quiescent_means_over(self) -> None:
        """Nothing on its way and no stage holds a request: the core holds none, and every
        stream has ended."""
        for s in self.stages:
            if s.events or (not s.dead and (s.cq or s.inq or s.live)):
                return
        assert self.core.in_flight == 0, f"quiescent, yet the core holds {self.in_core()}"
        for inc in self.incs:
            assert inc.stream._ended is not None or inc.forgotten, f"{inc} never ended"

    def teardown(self) -> None:
        if not hasattr(self, "core") or sys.exc_info()[0] is not None:
            return  # a rule or a check failed: that is the failure to report
        # Run every stage dry: deliver every input and event, and step each request a stage
        # holds with its input complete to its end (a payload each way, then the end).
        progress = True
        while progress:
            progress = False
            for s in self.alive():
                for q in (s.cq, s.inq):
                    while q:
                        self.take_input(s, q.popleft(), False, q is s.inq)
                        progress = True
                for rid in s.steppable():
                    if s.live[rid].input_ended:
                        self.step_request(s, rid, True, True, True)
                        progress = True
            for s in self.stages:
                while s.events:
                    self.deliver_events(s, 3)
                    progress = True
        self.consistent()
        assert self.core.in_flight == 0, f"run dry, the core still holds {self.in_core()}"
        for inc in self.incs:
            assert inc.stream._ended is not None or inc.forgotten, f"{inc} never ended"
        dead = sum(s.dead for s in self.stages)
        if not self.closed:
            for s in self.alive():
                # A request a stage ended before its input did: that input's END came.
                assert dead or not s.early, f"run dry, stage {s.k} awaits the END of {s.early}"
                for r in s.live.values():
                    assert dead, f"run dry, stage {s.k} still holds {r.inc}"
                    assert r.inc.raced, f"run dry, stage {s.k} still holds {r.inc}"
        if dead:
            event("a stage died" if dead == 1 else "stages died")
        if self.closed:
            event("closed")
        if self.reused:
            event("ids were reused")


TestPipelineModel = PipelineModel.TestCase
TestPipelineModel.settings = _model_settings(2000)


class RetryModel(PipelineModel):
    """The same machine, drawn where retries happen most: three or four stages, every edge
    after the first retrying, the retried stages quiet, rare errors otherwise, no faults
    in half the runs."""

    @initialize(
        n=st.sampled_from([3, 4]),
        budget=st.sampled_from([None, 3]),
        feeds=st.lists(st.booleans(), min_size=4, max_size=4),
        faults=st.sampled_from([None, None, 25]),
        first=st.integers(2, MAX_CONCURRENT),
        retry=st.lists(st.sampled_from([1, 2]), min_size=3, max_size=3),
        quiet=st.sampled_from([True, True, False]),
        flags=st.sampled_from([True, True, False]),
    )
    def setup(
        self,
        n: int,
        budget: int | None,
        feeds: list[bool],
        faults: int | None,
        first: int,
        retry: list[int],
        quiet: bool,
        flags: bool = True,
    ) -> None:
        PipelineModel.setup.__wrapped__(  # type: ignore[attr-defined]
            self, n, budget, None, feeds, faults, first, False, retry, quiet, flags
        )
        self.actions = RETRY_ACTIONS


TestRetryModel = RetryModel.TestCase
TestRetryModel.settings = _model_settings(1000)


class RoutedCore(PipelineCore[StreamCore]):
    """A pooled core driven as :class:`PooledModel`'s simulated stages need: each stage's
    events split by the replica each request's route names there (a request not in the core
    goes to replica 0, whose events of it the core drops anyway), one core call per replica,
    in the order of each replica's first event (the events of one request keep their
    order; two replicas' have none between them)."""

    def _split(self, k: int, req_ids: Any) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for i, rid in enumerate(req_ids):
            route = self.route(rid) if rid is not None else None
            groups.setdefault(route[k] if route else 0, []).append(i)
        return groups

    def outputs(  # type: ignore[override]
        self, k: int, req_ids: Any, finished: Any, payloads: Any, now: float, d: Any
    ) -> None:
        for r, picked in self._split(k, req_ids).items():
            ids = [req_ids[i] for i in picked]
            fins = [finished[i] for i in picked]
            items = [payloads[i] for i in picked]
            super().outputs(k, ids, fins, items, now, d, r)

    def aborted(  # type: ignore[override]
        self, k: int, req_ids: Any, now: float, d: Any, fence: bool = False, tag: Any = None
    ) -> None:
        ids = list(req_ids)
        for r, picked in self._split(k, ids).items():
            super().aborted(k, [ids[i] for i in picked], now, d, r, fence, tag)

    def error(self, k: int, req_id: str, message: str, now: float, d: Any) -> None:  # type: ignore[override]
        super().error(k, req_id, message, now, d, next(iter(self._split(k, [req_id]))))

    def replayed(  # type: ignore[override]
        self, k: int, req_id: str, attempt: int, ok: bool, message: str, now: float, d: Any
    ) -> None:
        r = next(iter(self._split(k, [req_id])))
        super().replayed(k, req_id, attempt, ok, message, now, d, r)


class PooledModel(PipelineModel):
    """The same machine over a core whose stages are replica pools (module docstring)."""

    def make_core(self, budget: int | None, max_bytes: int | None) -> PipelineCore[StreamCore]:
        replicas = [(2, 3, 1, 2)[k] for k in range(self.n)]
        event(f"replicas {replicas}")
        core = RoutedCore(self.names, budget, max_bytes, self.retry, replicas)
        for k, count in enumerate(replicas):  # stages of this build: they answer tags
            for r in range(count):
                core.tagged(k, r, True)
        return core

    def fault(self, data: st.DataObject) -> None:
        """Also: one replica of a pool dies (never its stage's last): the requests routed
        through it are lost there, what is sent to it is dropped, and the coordinator hears
        of it after the events it had sent (``replica_dead``)."""
        if self.faults is None or self.steps < self.faults or self.closed or self.failure:
            super().fault(data)
            return
        pools = [s for s in self.alive() if sum(not p.dead for p in self.procs[s.k]) > 1]
        if not pools or not data.draw(st.booleans()):
            super().fault(data)
            return
        s = data.draw(st.sampled_from(pools))
        proc = data.draw(st.sampled_from([p for p in self.procs[s.k] if not p.dead]))
        self.kill(s, proc)
        event("a replica died")

    def kill(self, s: SimStage, proc: Proc) -> None:
        """Process *proc* of stage *s* dies: what it held is lost, what is sent to it is
        dropped, and the coordinator hears of it after the events it had sent."""
        proc.dead = True
        for held in (s.live, s.early, s.logs):
            for rid in [rid for rid, x in held.items() if x.proc is proc]:
                del held[rid]
        s.events.append(("replica_dead", proc.r))

    @invariant()
    def routed_counts(self) -> None:
        """Per stage, the core's count of requests on each replica adds up to the requests
        in the pipeline, and each request's route names a replica its stage has."""
        core = getattr(self, "core", None)
        if core is None:
            return
        for k in range(self.n):
            assert sum(core.load(k)) == core.in_flight
        for req in core._requests.values():
            assert req.route is not None
            assert all(0 <= r < n for r, n in zip(req.route, core.replicas, strict=True))


TestPooledModel = PooledModel.TestCase
TestPooledModel.settings = _model_settings(1000)


# What happens next in a run with restarts: a restart's next step as often as a fault.
RESTART_ACT = st.sampled_from(
    ["deliver_input", "step", "deliver"] * 3 + ["add", "caller", "fault", "restart", "restart"]
)
# Per layout: each stage's replicas, and whether its processes restart (only a stage that is
# a pool or restarts loses a process: a single process that does not restart is its stage).
Layout = tuple[tuple[int, ...], tuple[bool, ...]]
LAYOUTS: dict[int, list[Layout]] = {
    4: [
        ((2, 1, 1, 1), (False, False, True, True)),
        ((1, 1, 1, 1), (True, True, True, True)),
        ((1, 2, 1, 2), (False, True, True, False)),
        ((2, 1, 2, 1), (True, False, True, True)),
    ],
    3: [((1, 1, 1), (True, True, True)), ((2, 1, 1), (False, True, True))],
}
# Never failed for good: every dead process comes back (a stage's death is the base
# model's).
CLOSE_ODDS = [False] * 15 + [True]
POLICY = RestartPolicy(first_delay=1.0, max_delay=1.0, max_failures=1_000_000, window=1e9)


class Restart:
    """The restart under way (one at a time, as ``_restart_lock`` makes them): process *r*
    of stage *k*, its *generation*; once linked in (``_install``), the new process and the
    processes of the previous stage sent its ``link``."""

    def __init__(self, k: int, r: int, generation: int) -> None:
        self.k = k
        self.r = r
        self.generation = generation
        self.proc: Proc | None = None
        self.linked: list[Proc] = []
        self.heard = False  # the core was told the new process died (started refuses)


class RestartModel(PooledModel):
    """The same machine over a core whose stages restart their dead processes
    (``PipelineCore(restart=...)``, module docstring)."""

    choices = RESTART_ACT
    max_deaths = 1_000  # processes that die in a run, at most
    closes = True  # a fault may close the pipeline (once in 16)
    deaths = 0

    @initialize(
        n=st.sampled_from([4, 3]),
        budget=st.sampled_from([None, 2, 3]),
        feeds=st.lists(st.booleans(), min_size=4, max_size=4),
        faults=st.sampled_from([3, 8, 15]),
        first=st.integers(1, MAX_CONCURRENT),
        errors=st.booleans(),
        retry=st.lists(st.sampled_from([0, 1]), min_size=3, max_size=3),
        layout=st.integers(0, 3),
    )
    def setup(
        self,
        n: int,
        budget: int | None,
        feeds: list[bool],
        faults: int | None,
        first: int,
        errors: bool,
        retry: list[int],
        layout: int = 0,
    ) -> None:
        layouts = LAYOUTS[n]
        self.layout: Layout = layouts[layout % len(layouts)]
        self.due: list[tuple[int, int]] = []  # restarts whose delay is over
        self.restart_: Restart | None = None
        self.generations: dict[tuple[int, int], int] = {}  # starts of each process
        PipelineModel.setup.__wrapped__(  # type: ignore[attr-defined]
            self, n, budget, None, feeds, faults, first, errors, retry, False, True
        )
        self.up = [[True] * c for c in self.core.replicas]  # the core routes to it

    def make_core(self, budget: int | None, max_bytes: int | None) -> PipelineCore[StreamCore]:
        replicas, restarts = self.layout
        event(f"replicas {replicas}, restart {restarts}")
        policies = [POLICY if restarts[k] else None for k in range(self.n)]
        core = RoutedCore(self.names, budget, max_bytes, self.retry, replicas[: self.n], policies)
        for k in range(self.n):
            for r in range(replicas[k]):
                core.tagged(k, r, True)
        return core

    def heard_dead(self, k: int, r: int, d: PipelineDeliveries[StreamCore]) -> None:
        """A restart is due (the delay is over when the model says so), if its stage
        restarts; a new process that dies before it is routed to makes its restart moot
        (:meth:`PipelineCore.started` refuses)."""
        self.up[k][r] = False
        if self.core.restart[k] is None:
            assert not d.restarts, f"restarts {d.restarts} without a policy"
            return
        assert d.restarts == [(k, r, 1.0)], f"restarts {d.restarts} after {k}.{r} died"
        self.due.append((k, r))
        now = self.restart_
        if now is not None and (now.k, now.r) == (k, r):
            now.heard = True

    def add(self, data: st.DataObject) -> None:
        """Refused (:class:`NoReplicaError`) while a stage has no process to route to (its
        last died, and is coming back)."""
        if self.failure is None and any(not any(up) for up in self.up):
            with pytest.raises(NoReplicaError, match="restarting"):
                self.core.check([self.new_id()])
            event("an add was refused: a stage was restarting")
            return
        super().add(data)

    def fault(self, data: st.DataObject) -> None:
        """A process dies, of a stage that restarts (its last too) or of a pool (not its
        last); or, now and then, the pipeline closes. (A whole stage's death, which fails
        the pipeline, is :class:`PooledModel`'s.)"""
        if self.faults is None or self.steps < self.faults or self.closed:
            return
        if self.deaths >= self.max_deaths:
            return
        _, restarts = self.layout
        procs = [
            (s, p)
            for s in self.alive()
            if restarts[s.k] or sum(not p.dead for p in self.procs[s.k]) > 1
            for p in self.procs[s.k]
            if not p.dead
        ]
        if not procs:
            return
        if self.closes and data.draw(st.sampled_from(CLOSE_ODDS)):
            self.closed = True
            self.failure = self.failure or ("closed", 0)
            self.close_exc = StageClosedError("the pipeline was shut down")
            exc = self.close_exc
            self.call(lambda now, d: self.core.close(exc, now, d), "close")
            return
        s, proc = data.draw(st.sampled_from([x for x in procs for _ in range(self.weigh(*x))]))
        self.kill(s, proc)
        self.deaths += 1
        event("a process died")

    def weigh(self, s: SimStage, proc: Proc) -> int:
        """How likely *proc* is to be the one that dies, relative to the others."""
        return 1

    def restart(self, data: st.DataObject) -> None:
        """The next step of the restart under way (``_restart``, ``_link``), or the start of
        one that is due: ``restarting``; then the start fails (``start_failed``), or, once
        ``linkable``, the new process is put in place and the previous stage's processes are
        sent its ``link`` (on their coordinator connections: in no order with their links);
        once each has applied it (or died), ``started``."""
        core = self.core
        now = self.restart_
        if now is None:
            if not self.due:
                return
            k, r = data.draw(st.sampled_from(self.due))
            self.due.remove((k, r))
            generation = core.restarting(k, r)
            if self.failure is not None:
                assert generation is None, f"restarting {k}.{r} after the pipeline failed"
                return
            # One more each start (a failed one too): the new process's names never reuse one.
            tries = self.generations[k, r] = self.generations.get((k, r), 0) + 1
            assert generation == tries, f"{k}.{r}: generation {generation}, start {tries}"
            self.restart_ = Restart(k, r, generation)
            return
        k, r = now.k, now.r
        if now.proc is None:
            if self.failure is None and not core.linkable(k, r):
                event("a restart waited to link its process in")
                if data.draw(st.integers(0, 7)):
                    return
            elif data.draw(st.integers(0, 7)):
                self.install(now)
                return
            delays: list[float | None] = []
            exc = EngineDeadError("the stage did not start", exit_code=1)

            def failed(when: float, d: PipelineDeliveries[StreamCore]) -> None:
                delays.append(core.start_failed(k, r, exc, when, d))

            self.call(failed, "start_failed", k)
            self.restart_ = None
            if self.failure is not None:
                assert delays == [None]
                return
            assert delays == [1.0], f"{k}.{r}: a failed start, delay {delays}"
            self.due.append((k, r))
            event("a restart failed")
            return
        prev = self.stages[k - 1] if k else None
        if prev is not None and not prev.dead:
            for item, _, dst in prev.cq:
                if item[0] == "link" and item[2] is now.proc and dst is not None and not dst.dead:
                    return  # the barrier: not every process applied its link yet
        up = core.started(k, r)
        self.restart_ = None
        expect = self.failure is None and not now.heard
        assert up is expect, f"started({k}, {r}): {up}"
        if up:
            self.up[k][r] = True
            event("a process was started again")

    def install(self, now: Restart) -> None:
        """``_install``: the new process is put in place (what the coordinator sends to that
        replica goes to it from now on), with its own links to the next stage's processes as
        they are now; each live process of the previous stage is sent its ``link``."""
        k, r = now.k, now.r
        proc = now.proc = Proc(k, r, now.generation)
        if k + 1 < self.n:
            proc.links = list(self.procs[k + 1])
        self.procs[k][r] = proc
        self.core.tagged(k, r, True)
        if k > 0:
            for j, up in enumerate(self.core.alive(k - 1)):
                if up:
                    before = self.procs[k - 1][j]
                    self.to_stage(k - 1, ("link", r, proc), before)
                    now.linked.append(before)
        event("a new process was linked in")

    def teardown(self) -> None:
        """Also: a restart that waits to link its process in may once every stage is dry
        (``linkable`` does not wait for ever)."""
        super().teardown()
        now = self.restart_
        if now is None or now.proc is not None or self.failure is not None:
            return
        if sys.exc_info()[0] is None:
            assert self.core.linkable(now.k, now.r), f"run dry, {now.k}.{now.r} not linkable"


TestRestartModel = RestartModel.TestCase
TestRestartModel.settings = _model_settings(1000)


# The race model's: deaths and restarts as often as the stages' work.
RACE_ACT = st.sampled_from(
    [
        *("deliver_input", "deliver_input", "step", "deliver", "deliver"),
        *("add", "caller", "fault", "fault", "restart", "restart", "restart"),
    ]
)


class RestartRaceModel(RestartModel):
    """The same machine, drawn where a restarted process meets a later death: four stages,
    the third restarting and a pool or a restarting stage before it, deaths from the second
    step on, and deaths and restarts as often as the stages' work."""

    choices = RACE_ACT
    max_deaths = 3
    closes = False

    def deliver_input(self, data: st.DataObject, among: list[SimStage] | None = None) -> None:
        """The last stage is slow: it takes its inputs a quarter as often as otherwise, so
        that the aborts a death sends there wait while the stages before it go on."""
        quick = [s for s in self.alive() if not s.last]
        if any(s.cq or s.inq for s in quick) and data.draw(st.integers(0, 3)):
            super().deliver_input(data, quick)
        else:
            super().deliver_input(data)

    def weigh(self, s: SimStage, proc: Proc) -> int:
        """A process before one that was started again dies more often: the aborts its
        death sends chase down towards the new process."""
        later = [p for procs in self.procs[s.k + 1 :] for p in procs if p.gen and not p.dead]
        return 4 if later else 1

    @initialize(
        budget=st.sampled_from([None, 3]),
        feeds=st.lists(st.booleans(), min_size=4, max_size=4),
        first=st.integers(1, MAX_CONCURRENT),
        layout=st.sampled_from([0, 1, 3]),
    )
    def setup(self, budget: int | None, feeds: list[bool], first: int, layout: int) -> None:
        RestartModel.setup.__wrapped__(  # type: ignore[attr-defined]
            self, 4, budget, feeds, 2, first, False, [0, 0, 0], layout
        )


TestRestartRaceModel = RestartRaceModel.TestCase
TestRestartRaceModel.settings = _model_settings(1000)
