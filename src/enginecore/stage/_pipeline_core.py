"""A pipeline's coordinator, without IO: :class:`PipelineCore`.

The coordinator is the parent's half of a pipeline (``docs/pipelines.md``). Data goes from
stage to stage without it (:mod:`._pipe_stage`); it carries only control: admission, the
caller's abort, each request's end, and errors. It is the client of every stage, and hears
from each on that stage's output socket, in that stage's order; there is no order
*between* two stages. :class:`PipelineCore` decides, from those events, what each
request's caller-facing stream receives and when the request is over. It owns no socket
and no thread, is told the time, and is called under the pipeline's lock (the streams'
lock), by whichever thread read the events.

What a stage tells the coordinator about request ``r`` (``docs/wire.md`` section 8):

- an output of ``r`` with ``finished=False``: a payload for the caller (its edge sent it
  there, or it is the last stage's output), from any stage;
- an output of ``r`` with ``finished=True``: an end report, its payload an ``int`` of bits
  (:mod:`._edge`): ``ENDED``, that stage ended ``r``; ``SENT_ON``, having sent payloads of
  it on (so the next stage's end is still to come); ``BEFORE``, every stage before it
  ended ``r`` and sent it on. A stage that ends ``r`` with its input complete and sends
  payloads on reports nothing: its ``END`` tells the next stage, which reports for both.
  So a request that goes through every stage has one report, ``ENDED | BEFORE``, from the
  stage where it stops. A stage that ends ``r`` before its input did reports
  ``ENDED`` (``| SENT_ON``) at once, and ``BEFORE`` once the previous stage's ``END``
  reaches it; its own ``END`` then carries ``REPORT``, which makes every later stage
  report its own end as such (``ENDED``, ``| SENT_ON``) too. Each report is true when
  sent, whatever order the stages' reports arrive in;
- an ``error`` for ``r``: that stage ended ``r`` with an error;
- ``aborted`` for ``r``: that stage applied an abort of ``r`` (every stage applies a
  coordinator's abort once, since it chases the data through the stages); flagged
  ``fence`` (:meth:`PipelineCore.aborted`), a replay's fence (below).

**A request is done** when, walking from the first stage, every stage it reached has
ended it: stage 0 ended it, and for each stage ``k`` that ended it having sent payloads
on, stage ``k + 1`` ended it too (one ``ENDED | BEFORE`` report says so at once). Then
its stream ends (finished) and its id and its place in the admission budget are free.

**Exactly one end.** A stream gets its payloads, then one end, then nothing:

- finished, when the request is done;
- aborted, once every stage has applied the caller's abort (no stage can then produce
  anything more for it); if the request is done before that, finished;
- an error, at once, when a stage reports one (:class:`~._errors.PipelineRequestError`,
  naming the stage): the coordinator aborts the request in every stage, and keeps it (its
  id and its budget) until every stage has applied that abort;
- an error naming the stage, when a stage dies (:class:`~._errors.PipelineStageDeadError`):
  every live request ends with it, and the pipeline takes no more requests;
- :class:`~._errors.StageClosedError` when the pipeline is closed under it.

**Retry** (``retry[k] = n > 0``: the edge into stage ``k`` is ``Retry(n)``). When stage
``k`` reports an error for a live request, and nothing of stage ``k`` or a later one has
reached the caller for it, the request is not ended: the coordinator asks stage ``k - 1``
to replay it (:attr:`PipelineDeliveries.replays`, ``["replay", rid, attempt]``). That
stage sends an ``abort`` of it down its link, the *fence* (flagged as such on the wire),
then the request's logged inputs again. Every stage ``j >= k`` applies the fence once and
answers ``aborted``, flagged too; until the coordinator has counted that answer
(``fences[j]``), every event of stage ``j`` for the request is of an earlier attempt and is
dropped: an output never reaches the caller, an
end or an error is not counted. What stages ``>= k`` had ended is forgotten. After ``n``
replays of one edge, the next error ends the request (``"... (retried n times)"``); an
error after stage ``k`` or a later one sent the caller something ends it too (``"... (not
retried: ...)"``), and so does a replay that failed (the ``replayed`` answer: the producer
no longer held the inputs, or they outgrew its log's bound). An error it would retry of a
request the caller aborted (the two crossed) is dropped: no replay, and the request ends
aborted once every stage has applied the abort. A fence's ``aborted`` (flagged)
is never counted as the confirmation of a coordinator's abort, nor an unflagged one as a
fence's answer: a request leaves only when both are in. (A stage of an older build answers
fences unflagged: an unflagged answer while a fence is due is then taken for the fence's,
as before the flag; if the coordinator had aborted the request and the fence's flagged
answer follows, the unflagged one was the abort's, which overtook the fence, and confirms
it then.) A request done while live is *released*
(:attr:`PipelineDeliveries.releases`): the stages that keep replay logs forget it; one done
while a fence is unanswered (a replay made moot by a later one is still on its way) is
aborted in every stage instead, so that what that replay sends ends too, and is kept until
the abort and every fence are answered.

**Replica pools** (``replicas[k] > 1``: stage ``k`` runs as that many processes). Each
request gets a *route* when it is admitted, one replica per stage: per stage, the live
replica with the fewest requests the coordinator routed there that are still in the
pipeline (ties: round robin). Every event of stage ``k`` about the request comes from
``route[k]``; one from another replica of that stage is dropped. The IO layer sends the
route with the request (and with each abort: :attr:`PipelineDeliveries.routes`). A
replica's death (:meth:`replica_dead`) ends only the requests routed through it, each with
a :class:`~._errors.PipelineStageDeadError` naming the stage and the replica; their
aborts go from the first stage and from the stage after the dead one, and the dead replica
counts as having applied them. A retry of such a request under way is moot: its fences at
the dead replica and after it are dropped (those after it went through the dead replica,
which may not have passed them on, or the next stage dropped them after its ``gone``). An
answer to one of them may still come (the dead replica had passed it on): flagged, it is
ignored, and each later stage's unflagged answer, to the abort sent after the death,
confirms that abort. New requests avoid it. When
the last replica of a stage dies, the stage is dead (:meth:`stage_dead`). The
coordinator's abort is confirmed once per stage (a bit per stage), by the answer of the
abort that counts there ("Tagged aborts").

**Tagged aborts** (after a death). A request aborted already (its abort chasing through
the stages) whose process of stage ``k`` dies is aborted again, from stage ``k + 1``: the
dead process may or may not have passed the first abort on before it died, so stage ``k +
1`` and every later one may apply the abort twice, and answer twice. Taking the first
answer for the confirmation would free the request while the second abort is still on its
way: its id added again, that abort could reach stage ``k + 1`` after the new request's
data (it comes on the coordinator's connection, the data on a link: no order between
them) and abort the new request there, for good; or its answer confirm the new request's
own abort early, freeing that id before every stage applied that abort. So the abort sent
after the death carries a *tag* (``docs/wire.md`` section 8, a number the core never gives
twice), which each stage repeats in its ``aborted`` and in the abort it chases on; from
stage ``k + 1`` up to the next dead process of the route, the core takes only the answer
with that tag (:meth:`replica_dead`, :meth:`aborted`). That answer comes after any answer
to the first abort's copy: stage ``k + 1`` applies a copy the dead process sent before its
``gone`` (on the coordinator's connection, before the tagged abort) or drops it, and each
later stage gets both copies in that order on one link. So once every tagged answer is in,
no copy of either abort is left on its way to a stage after the dead one, nor an answer to
one. A stage of an older build (its ``welcome`` does not say ``"tags"``: :meth:`tagged`)
drops the tag and chases untagged: from the first such process on the route, any answer
confirms, as before tags (the race stays open there). With restarts, a copy could also
reach stage ``k + 1`` through the dead process's replacement: stage ``k - 1`` gets the
abort of such a request on its link from stage ``k - 2`` (for ``k >= 2``), in no order with
the coordinator's ``link`` to it, and would chase a copy it applies after that ``link``
down the new link into the new process, which would pass it on untagged. So the new
process is linked in only once stage ``k - 1`` has answered for every request the dead one
held (:meth:`linkable`, "Restarts"). A later abort of such a request (a death at a stage
before ``k - 1``, after that link, sends one from the stage after it, tagged) must not go
there either: it would go on with a tag that stages after ``k`` do not wait for. So the
route an abort carries (:attr:`PipelineDeliveries.routes`) has ``-1`` for each stage whose
process on it died (bit ``k`` of ``cut``): the stage before it has no link at that index,
and chases it no further; the stages after it got the abort sent after that death (a route
through a process of an older build, which would refuse the ``-1``, goes as it is). A whole
stage's death (:meth:`stage_dead`) sends its aborts untagged: the pipeline has failed, every
request is freed at once, and no id is added again.

**Restarts** (``restart[k]``, a :class:`~._pool_core.RestartPolicy`: stage ``k``'s dead
processes are started again). Such a pipeline is routed even without pools, so that a dead
process's requests are told from the others by their routes. A death is counted by the
policy (:meth:`replica_dead`): the process is ``dead`` with a restart due after the
returned delay (:attr:`PipelineDeliveries.restarts`), or ``failed`` after ``max_failures``
deaths in the window. Its requests end as a pool replica's do, even when it was its stage's
last live process: the pipeline then refuses adds (:class:`~._errors.NoReplicaError`) until
one is back, and fails only when a stage has no process live or coming back. The IO layer
starts the process when the delay is over (:meth:`restarting`: ``starting``, one more
generation), links it in, and then :meth:`started` makes it routable; a start that failed
is a death too (:meth:`start_failed`), and so is a death while starting; a restart the IO
layer gives up (an ``AsyncPipeline``'s restart task cancelled, the pipeline open) makes
the process ``failed`` at once (:meth:`abandoned`). It links it in
(sends the stage before the ``link``) only once :meth:`linkable`: from the third stage on
(the first stage hears only the coordinator, in order), the stage before has
answered for every request routed through the dead process (the abort that confirms it
there, and every fence due there), or its process on the route died. Until then that stage
may still apply an abort, a replay's fence or the request's data, which it would send down
the new link, into a process that never held the request; once it has applied the abort, it
sends nothing more of it, and what it sent before went to the dead process. No stage
answers differently for it: any build answers aborts and applies messages in order. The
IO layer then waits for that stage to confirm the ``link`` (its loop applied it), up to the
startup timeout, and makes the new process routable anyway after it: a request routed to it
may then reach that stage ahead of the ``link`` (on another connection), and the stage holds
such data until the ``link`` rather than dropping it (``PipeStage.pipe_link``). It could
not tell such a request from one of the dead process by its route alone (replica indexes,
which outlive a process): data applied there before even the ``gone`` would go down the old
link, to the dead process, and be lost; and an abort of it applied there before the
``link`` would not be chased to the new process, whose answer the coordinator waits for. So
the route a message carries (:meth:`wire_route`) names each process of a stage that
restarts as ``[replica, generation]``, the generation the request was routed to (the
current one of a process on its route that is live: the requests routed through a process
are all cut when it dies, before it is started again as the next generation), and the
``link`` names the new process's (``docs/wire.md`` section 8, "Restarts"). The stage holds
what is meant for a newer generation than its link's, aborts included, for that
generation's ``link``, and drops what is meant for an older one. Only to processes whose
``welcome`` says ``"gens"`` (:meth:`generational`): an older build refuses a route entry
that is not an int, and gets plain routes (the two cases stay open through it).

**Drain** (``shutdown(drain=...)``: the stages drain and stop one after the other, first
to last, and no add comes any more). Once stage ``k`` has stopped (:meth:`stopped`, after
its last event), it holds no request and answers nothing more: it counts as having applied
every abort, and an abort "from the first stage" goes to the first stage still running
(:meth:`_abort_from_first`), which chases it on as the first stage would. An abort that
stage ``k`` received only after its drain ended was neither answered nor chased: it is sent
again from stage ``k + 1``. Since no id is used again, an abort applied twice, or an answer
for an id already freed, is harmless. A retried edge out of a stopped stage retries no
more: that stage cannot replay.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Generic, TypeVar

from ._edge import BEFORE, ENDED, SENT_ON
from ._errors import (
    EngineDeadError,
    NoReplicaError,
    PipelineFullError,
    PipelineRequestError,
    PipelineStageDeadError,
)
from ._pool_core import ReplicaState, RestartPolicy
from ._session import ABORTED, FINISHED, End, StreamCore

__all__ = ["PipelineCore", "PipelineDeliveries", "RequestState", "check_budget"]

S = TypeVar("S", bound=StreamCore)

_HERE = ENDED | BEFORE  # the usual end report: the request stops in that stage, done


def check_budget(max_in_flight: object, max_bytes: object = None) -> None:
    """:class:`TypeError` / :class:`ValueError` unless each of *max_in_flight* and
    *max_bytes* is ``None`` or an ``int`` >= 1."""
    for what, value in (("max_in_flight", max_in_flight), ("max_bytes", max_bytes)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{what} must be an int or None, got {value!r}")
        if value < 1:
            raise ValueError(f"{what} must be >= 1, got {value}")


class RequestState(enum.Enum):
    """Where a request is, as the coordinator sees it."""

    LIVE = "live"
    """In the pipeline; its stream is open."""
    ABORTING = "aborting"
    """The caller aborted it; the stream is open until every stage has applied the abort
    (or the request is done first)."""
    CLOSING = "closing"
    """Its stream has ended; it waits for every stage to apply the abort the coordinator
    sent, before its id and budget are free."""


class _Replays:
    """A request's replays (retry), once it has one: *retries[k]*, the replays into stage
    *k*; *attempt*, the last replay's number, and *why*, the error that asked for it."""

    __slots__ = ("attempt", "retries", "why")

    def __init__(self) -> None:
        self.retries: dict[int, int] = {}
        self.attempt = 0
        self.why = ""


_LIVE = RequestState.LIVE


class _Request(Generic[S]):
    __slots__ = (
        "confirms",
        "cut",
        "ended",
        "fences",
        "nbytes",
        "replays",
        "req_id",
        "route",
        "sent",
        "spoke",
        "state",
        "stream",
        "taken",
        "want",
    )

    def __init__(self, req_id: str, stream: S, nbytes: int) -> None:
        self.req_id = req_id
        self.nbytes = nbytes  # its share of the bytes budget
        self.stream = stream
        self.state = _LIVE
        self.ended = self.sent = self.confirms = self.spoke = self.taken = self.cut = 0
        # ended, bit k: stage k ended it; sent, bit k: and sent payloads on; confirms, bit
        # k: stage k applied the coordinator's abort. Retry: bit k of spoke, stage k sent
        # the caller a payload (counted only where an edge retries); fences[k], the fences
        # stage k has still to answer (its events until then are an earlier attempt's);
        # bit k of taken, an unflagged answer of stage k counted as a fence's while the
        # coordinator's abort was out (it may have been that abort's: aborted()); replays,
        # once it has one.
        self.fences: list[int] | None = None
        self.replays: _Replays | None = None
        self.route: tuple[int, ...] | None = None  # with replica pools: one per stage
        # After a death on its route (replica_dead): bit k of cut, its process of stage k
        # died (that stage counts as having applied the aborts); want[k], the tag of the
        # abort whose answer alone confirms stage k (0: an untagged one, as before any
        # death), "Tagged aborts" in the module docstring.
        self.want: list[int] | None = None


@dataclass(slots=True, eq=False)
class PipelineDeliveries(Generic[S]):
    """What the IO layer must do after a core call, outside the lock."""

    wake: list[S] = field(default_factory=list)
    """Streams whose consumer waits and whose buffer has grown: wake each once."""
    aborts: list[str] = field(default_factory=list)
    """Request ids to abort in the first stage (the abort chases the data from there)."""
    freed: int = 0
    """Places freed in the admission budget: wake whoever waits for room."""
    stage_aborts: list[tuple[int, list[str]]] = field(default_factory=list)
    """``(stage, ids)``: request ids to abort in that stage, which a dead stage cuts off
    from the first one (the abort chases on from there)."""
    gone: list[tuple[int, int, str, int, int]] = field(default_factory=list)
    """``(stage, replica, side, dead, dead_replica)``: tell that replica of that stage that
    replica *dead_replica* of stage *dead*, on its *side* (``"previous"`` or ``"next"``),
    is gone; sent before :attr:`stage_aborts`, so that the stage after a dead one drops the
    dead one's late data before it applies the aborts."""
    replays: list[tuple[int, str, int]] = field(default_factory=list)
    """``(stage, req_id, attempt)``: ask that stage to replay the request to the next one
    (``["replay", req_id, attempt]``): the next stage failed it, and its edge retries."""
    releases: list[str] = field(default_factory=list)
    """Requests done in the pipeline: the stages that keep replay logs forget them
    (``["release", ids]``)."""
    routes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """With replica pools: the route of every request named above (its replica of each
    stage), to send each message to the right replica and the aborts along the route.
    ``-1`` for a stage whose process on the route died: nothing of the request is sent
    there, and an abort chased along the route stops before it (``docs/wire.md`` section
    8: the stage before it has no link at that index)."""
    restarts: list[tuple[int, int, float]] = field(default_factory=list)
    """``(stage, replica, delay)``: start that process again after *delay* seconds (its
    stage restarts, :meth:`PipelineCore.restarting`)."""
    tags: dict[tuple[int, str], int] = field(default_factory=dict)
    """``(stage, req_id) -> tag``: the tag to send with that abort of :attr:`stage_aborts`
    (``["abort", ids, routes, false, tag]``, ``docs/wire.md`` section 8); an abort not
    named here is sent untagged."""


class PipelineCore(Generic[S]):
    """The coordinator's decisions (module docstring). *stages* are the stages' names, in
    order; *max_in_flight* the admission budget in requests, *max_bytes* in bytes of the
    requests' frames (``None``: none); *retry*, per stage, how many times a request that
    stage fails is replayed to it by the stage before it (``0``, the default: the edge's
    policy is ``fail``; always ``0`` for the first stage). A request
    holds its place from :meth:`open` until it is over in every stage."""

    def __init__(
        self,
        stages: Sequence[str],
        max_in_flight: int | None = None,
        max_bytes: int | None = None,
        retry: Sequence[int] | None = None,
        replicas: Sequence[int] | None = None,
        restart: Sequence[RestartPolicy | None] | None = None,
    ) -> None:
        if not stages:
            raise ValueError("a pipeline needs at least one stage")
        replicas = [1] * len(stages) if replicas is None else list(replicas)
        if len(replicas) != len(stages) or min(replicas) < 1:
            raise ValueError(f"replicas must be one count >= 1 per stage, got {replicas}")
        self.replicas = tuple(replicas)
        policies = [None] * len(stages) if restart is None else list(restart)
        if len(policies) != len(stages):
            raise ValueError(f"restart must be one policy or None per stage, got {policies}")
        self.restart: tuple[RestartPolicy | None, ...] = tuple(policies)
        """Per stage, its :class:`RestartPolicy` (``None``: a dead process stays dead)."""
        self.pooled = max(replicas) > 1 or any(p is not None for p in policies)
        """Whether requests have routes: a stage is a replica pool, or restarts (a dead
        process's requests are then told from the others by their routes)."""
        # Per process (stage, replica): its state as a pool's replica's (ReplicaState:
        # SERVING; DEAD, restarted later if its stage restarts, else for good; STARTING;
        # FAILED), its recent deaths (the policy's window), its restarts, and its
        # generation (how many times it was started before: its link's and slots' names).
        self._states = [[ReplicaState.SERVING] * r for r in replicas]
        self._deaths: list[list[deque[float]]] = [[deque() for _ in range(r)] for r in replicas]
        self._restarts = [[0] * r for r in replicas]
        self._generations = [[0] * r for r in replicas]
        self._down: set[int] = set()  # stages with no live process, one coming back
        self._alive = [[True] * r for r in replicas]
        self._load = [[0] * r for r in replicas]  # requests routed there, in the pipeline
        self._turn = [0] * len(replicas)  # round robin among the least loaded
        check_budget(max_in_flight, max_bytes)
        retry = [0] * len(stages) if retry is None else list(retry)
        if len(retry) != len(stages) or retry[0] or min(retry) < 0:
            raise ValueError(f"retry must be one count >= 0 per stage, 0 first, got {retry}")
        self.retry = tuple(retry)
        self._retrying = any(retry)
        self.max_bytes = max_bytes
        self.bytes_in = 0
        """The bytes of the requests in the pipeline (their frames, as sent)."""
        self.stages = tuple(stages)
        self.max_in_flight = max_in_flight
        self._n = len(stages)
        self._requests: dict[str, _Request[S]] = {}
        self.failure: BaseException | None = None
        """Why the pipeline takes no more requests: a stage died, or it was closed."""
        # The ids a stage's death ended (stage_dead), and their routes.
        self._orphans: dict[str, tuple[int, ...] | None] = {}
        self._all = (1 << len(stages)) - 1  # every stage's bit
        # Per process (stage, replica): whether it answers a tagged abort with the tag and
        # chases it tagged (a stage of this build: tagged(); an older build drops the tag).
        # _tag: the last tag given to the aborts of a death (replica_dead).
        self._tagging = [[False] * r for r in replicas]
        self._tag = 0
        # Per process: whether it takes routes and links that name generations (its welcome
        # says "gens": generational()); only a pipeline with a stage that restarts sends any.
        self._generational = [[False] * r for r in replicas]
        self._regenerates = any(p is not None for p in policies)
        # The failure as an End: check() raises it with the traceback it had then, so that
        # refused adds do not grow it (see _session.End).
        self._failure_end: End | None = None
        # A shutdown(drain=...) under way: the stages before _first have drained and
        # stopped (stopped()), _stopped has their bits. They count as having applied
        # every abort, and an abort "from the first stage" goes to stage _first.
        self._first = 0
        self._stopped = 0

    # -- admission ---------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Requests holding a place in the budget (live, aborting or closing)."""
        return len(self._requests)

    def room(self) -> int | None:
        """Places left in the budget (``None``: no budget)."""
        if self.max_in_flight is None:
            return None
        return self.max_in_flight - len(self._requests)

    def state(self, req_id: str) -> RequestState | None:
        """Where *req_id* is; ``None`` if it is not in the pipeline."""
        req = self._requests.get(req_id)
        return None if req is None else req.state

    def check(self, req_ids: Sequence[str]) -> None:
        """Raise what an add of *req_ids* raises before anything is sent: the pipeline's
        :attr:`failure`, or :class:`ValueError` for an id in the pipeline or repeated."""
        if self._failure_end is not None:
            self._failure_end.raise_exc()
        if self._down:
            k = min(self._down)
            raise NoReplicaError(
                f"no process of stage {self.stages[k]!r} can take requests: it is "
                f"restarting (see the pipeline's health())"
            )
        requests = self._requests
        unique = set(req_ids)
        if len(unique) == len(req_ids) and (not requests or unique.isdisjoint(requests)):
            return  # the usual case, in C
        seen: set[str] = set()
        for rid in req_ids:
            req = requests.get(rid)
            if req is not None:
                why = ""
                if req.state is not RequestState.LIVE:  # "still"? its stream may have ended
                    why = (
                        " (it ended or was aborted; its id is free once every stage has "
                        "applied its abort)"
                    )
                raise ValueError(f"request {rid!r} is still in the pipeline{why}")
            if rid in seen:
                raise ValueError(f"request {rid!r} appears twice")
            seen.add(rid)

    def admissible(self, req_ids: Sequence[str], nbytes: int = 0) -> bool:
        """Whether *req_ids*, *nbytes* in all, may be opened now: :meth:`check` (which
        raises) and room in the budget for all of them."""
        self.check(req_ids)
        room = self.room()
        if room is not None and room < len(req_ids):
            return False
        return self.max_bytes is None or self.bytes_in + nbytes <= self.max_bytes

    def check_size(self, count: int, nbytes: int) -> None:
        """:class:`ValueError` for an add that could never fit: more requests, or more
        bytes, than the whole budget."""
        if self.max_in_flight is not None and count > self.max_in_flight:
            raise ValueError(
                f"{count} requests at once, more than max_in_flight ({self.max_in_flight})"
            )
        if self.max_bytes is not None and nbytes > self.max_bytes:
            raise ValueError(f"{nbytes} bytes at once, more than max_bytes ({self.max_bytes})")

    def full_error(self, timeout: float | None) -> PipelineFullError:
        """What an add without room raises: at once (*timeout* ``None``), or after
        *timeout* seconds."""
        budget = f"max_in_flight {self.max_in_flight}, max_bytes {self.max_bytes}"
        holds = f"{len(self._requests)} requests, {self.bytes_in} bytes"
        if timeout is None:
            return PipelineFullError(f"no room in the pipeline: it holds {holds} ({budget})")
        return PipelineFullError(
            f"no room in the pipeline within {timeout} s: it holds {holds} ({budget})"
        )

    def open(
        self, req_id: str, stream: S, nbytes: int = 0, exited: Collection[tuple[int, int]] = ()
    ) -> None:
        """Admit *req_id*, *nbytes* of the bytes budget (checked with :meth:`admissible`).
        *exited*: the processes (stage, replica) whose exit was seen but whose death is not
        reported yet (the client reads their last frames first): not routed to
        (:meth:`_pick`)."""
        req = self._requests[req_id] = _Request(req_id, stream, nbytes)
        self.bytes_in += nbytes
        if self.pooled:
            req.route = self._pick(exited)

    def _pick(self, exited: Collection[tuple[int, int]] = ()) -> tuple[int, ...]:
        """A new request's route: per stage, the live replica with the fewest requests
        routed there (ties: round robin), counted in. A replica in *exited* (its process
        has exited, its death not reported yet) is taken only when no other is alive, as a
        :class:`~enginecore.stage.StagePool` routes."""
        route: list[int] = []
        for k, (load, alive) in enumerate(zip(self._load, self._alive, strict=True)):
            count = len(load)
            if count == 1:
                load[0] += 1
                route.append(0)
                continue
            start = self._turn[k]
            best = -1
            for i in range(count):
                r = (start + i) % count
                if alive[r] and (best < 0 or load[r] < load[best]) and (k, r) not in exited:
                    best = r
            if best < 0 and exited:  # every live replica has exited: one of them anyway
                for i in range(count):
                    r = (start + i) % count
                    if alive[r] and (best < 0 or load[r] < load[best]):
                        best = r
            best = max(best, 0)  # every replica dead: the pipeline has failed (check raises)
            self._turn[k] = (best + 1) % count
            load[best] += 1
            route.append(best)
        return tuple(route)

    def route(self, req_id: str) -> tuple[int, ...] | None:
        """The route of *req_id* (its replica of each stage), or ``None`` (no replica
        pools, or not in the pipeline)."""
        req = self._requests.get(req_id)
        return None if req is None else req.route

    def open_many(
        self,
        req_ids: Sequence[str],
        streams: Sequence[S],
        nbytes: int,
        exited: Collection[tuple[int, int]] = (),
    ) -> None:
        """:meth:`open` for a burst of *nbytes* in all, each request with its share."""
        requests = self._requests
        share, extra = divmod(nbytes, len(req_ids))
        if self.pooled:
            for i, (rid, stream) in enumerate(zip(req_ids, streams, strict=True)):
                req = requests[rid] = _Request(rid, stream, share + (i < extra))
                req.route = self._pick(exited)
        elif extra:
            for i, (rid, stream) in enumerate(zip(req_ids, streams, strict=True)):
                requests[rid] = _Request(rid, stream, share + (i < extra))
        else:
            # In C: a request per id, no Python loop (~0.1 us a request less).
            requests.update(
                zip(req_ids, map(_Request, req_ids, streams, repeat(share)), strict=True)
            )
        self.bytes_in += nbytes

    def forget(self, req_ids: Iterable[str], d: PipelineDeliveries[S]) -> None:
        """Undo :meth:`open`: the add could not be sent."""
        for rid in req_ids:
            req = self._requests.get(rid)
            if req is not None:
                self._release(req, d)

    def withdraw(
        self,
        req_ids: Iterable[str],
        message: str,
        now: float,
        d: PipelineDeliveries[S],
        cause: BaseException | None = None,
    ) -> None:
        """Requests of a burst that reached the first stage (one replica of it) while the
        send of the rest of the burst failed: the add fails as a whole, so each ends with
        the first stage's :class:`~enginecore.stage.PipelineRequestError` (*message*, its
        ``__cause__`` *cause*) and is aborted in every stage, as a request that stage
        refused; its id and place stay until every stage has applied the abort."""
        for rid in req_ids:
            req = self._requests.get(rid)
            if req is not None and req.state is RequestState.LIVE:
                self._fail(req, 0, message, now, d, cause)

    # -- what the caller does ----------------------------------------------------------------

    def abort(self, req_ids: Iterable[str], d: PipelineDeliveries[S]) -> None:
        """The caller's abort: each live request goes to ``ABORTING`` and is aborted in the
        first stage; other ids are ignored."""
        requests = self._requests
        out: list[str] = []
        for rid in req_ids:
            req = requests.get(rid)
            if req is not None and req.state is RequestState.LIVE:
                req.state = RequestState.ABORTING
                out.append(rid)
                if req.route is not None:
                    d.routes[rid] = req.route
        if out:
            self._abort_from_first(out, d)

    def _abort_from_first(self, req_ids: list[str], d: PipelineDeliveries[S]) -> None:
        """Abort *req_ids* from the first stage (the abort chases the data from there), or,
        during a drain, from the first stage still running (:meth:`stopped`)."""
        first = self._first
        if not first:
            d.aborts += req_ids
        elif first < self._n:
            d.stage_aborts.append((first, req_ids))

    # -- what a stage says --------------------------------------------------------------------

    def outputs(
        self,
        k: int,
        req_ids: Sequence[str | None],
        finished: Sequence[bool],
        payloads: Sequence[Any],
        now: float,
        d: PipelineDeliveries[S],
        r: int = 0,
    ) -> None:
        """An ``outputs`` event of stage *k* (its replica *r*): payloads for the caller and
        ends in that stage (module docstring). Ids not in the pipeline are dropped
        (unrouted outputs, and those of a request whose stream has ended), and so are those
        of a request not routed through that replica."""
        requests = self._requests
        closing = RequestState.CLOSING
        wake = d.wake
        retrying = self._retrying
        pooled = self.replicas[k] > 1
        for rid, fin, payload in zip(req_ids, finished, payloads, strict=True):
            req = requests.get(rid) if rid is not None else None
            if req is None:
                continue
            if pooled and req.route is not None and req.route[k] != r:
                continue
            fences = req.fences
            if fences is not None and fences[k]:
                continue  # an earlier attempt's, in a stage that has not answered a fence yet
            if fin:
                if type(payload) is not int:
                    continue  # not an end report (an engine's own output, not routed)
                if payload == _HERE or self._ended(req, k, payload):
                    self._finish(req, now, d)
            elif req.state is not closing:
                if retrying:
                    req.spoke |= 1 << k
                stream = req.stream
                stream._buf.append(payload)
                stream._arrivals.append(now)
                if stream._waiting:
                    stream._waiting = False
                    wake.append(stream)

    def error(
        self,
        k: int,
        req_id: str,
        message: str,
        now: float,
        d: PipelineDeliveries[S],
        r: int = 0,
    ) -> None:
        """Stage *k* (its replica *r*) ended *req_id* with an error: the stream ends with it
        now, and the request is aborted in every stage (unless the caller's abort already
        is)."""
        req = self._requests.get(req_id)
        if req is None or req.state is RequestState.CLOSING:
            return
        if req.route is not None and req.route[k] != r:
            return  # not routed through that replica: not this request's
        fences = req.fences
        if fences is not None and fences[k]:
            return  # an earlier attempt's
        allowed = self.retry[k]
        if allowed and k <= self._first:
            # The stage that would replay it has drained and stopped (stopped()): no
            # replay can come, and the request would wait for it until the shutdown.
            before = self.stages[k - 1]
            message = f"{message} (not retried: stage {before!r} has drained and stopped)"
            allowed = 0
        if allowed:
            done = 0 if req.replays is None else req.replays.retries.get(k, 0)
            if done >= allowed:
                message = f"{message} (retried {allowed} time{'s' if allowed > 1 else ''})"
            elif req.spoke >> k:
                spoke = min(j for j in range(k, self._n) if req.spoke >> j & 1)
                message = (
                    f"{message} (not retried: stage {self.stages[spoke]!r} had sent the "
                    f"caller outputs of it)"
                )
            elif req.state is RequestState.LIVE:
                self._replay(req, k, message, d)
                return
            else:
                # An error it would retry, after the caller's abort: the two crossed, and
                # the request ends aborted once every stage has applied the abort
                # (module docstring, "Retry"); no replay, which the abort makes moot.
                return
        self._fail(req, k, message, now, d)

    def replayed(
        self,
        k: int,
        req_id: str,
        attempt: int,
        ok: bool,
        message: str,
        now: float,
        d: PipelineDeliveries[S],
        r: int = 0,
    ) -> None:
        """Stage *k* (its replica *r*) answered the replay *attempt* of *req_id*: if it
        could not replay it (*ok* false, *message* why), the request ends with the error
        that asked for the replay, unless a later replay superseded this one or it has ended
        already."""
        req = self._requests.get(req_id)
        if req is None or ok or req.state is not RequestState.LIVE:
            return
        if req.route is not None and req.route[k] != r:
            return
        replays = req.replays
        if replays is None or attempt != replays.attempt:
            return
        self._fail(req, k + 1, f"{replays.why} (not retried: {message})", now, d)

    def _replay(self, req: _Request[S], k: int, message: str, d: PipelineDeliveries[S]) -> None:
        """Stage *k* failed the live *req*, whose edge into *k* retries: fence stages *k* on,
        forget what they had ended, and ask stage ``k - 1`` to replay it."""
        n = self._n
        replays = req.replays
        if replays is None:
            replays = req.replays = _Replays()
        replays.retries[k] = replays.retries.get(k, 0) + 1
        replays.attempt += 1
        replays.why = message
        fences = req.fences
        if fences is None:
            fences = req.fences = [0] * n
        for j in range(k, n):
            fences[j] += 1
        req.ended &= (1 << k) - 1
        req.sent &= (1 << k) - 1
        d.replays.append((k - 1, req.req_id, replays.attempt))
        if req.route is not None:
            d.routes[req.req_id] = req.route

    def _fail(
        self,
        req: _Request[S],
        k: int,
        message: str,
        now: float,
        d: PipelineDeliveries[S],
        cause: BaseException | None = None,
    ) -> None:
        """End *req* with stage *k*'s error, and abort it in every stage (unless the
        caller's abort already is on its way)."""
        error = PipelineRequestError(req.req_id, self.stages[k], message)
        if cause is not None:
            error.__cause__ = cause
        self._end(req, End(error), now, d)
        if req.state is RequestState.LIVE:
            self._abort_from_first([req.req_id], d)
            if req.route is not None:
                d.routes[req.req_id] = req.route
        req.state = RequestState.CLOSING

    def aborted(
        self,
        k: int,
        req_ids: Iterable[str],
        now: float,
        d: PipelineDeliveries[S],
        r: int = 0,
        fence: bool = False,
        tag: int | None = None,
    ) -> None:
        """Stage *k* applied an abort of *req_ids*: a replay's fence if *fence* (the
        ``aborted`` event's flag); *tag*, the tag of the abort it applied (``None``:
        untagged). Once every stage has applied the coordinator's abort of a request,
        nothing more can come of it: an aborting one's stream ends (aborted), and its place
        is free. (An abort the coordinator did not send, of a live request, is ignored.) An
        unflagged answer confirms only with the tag the request waits for from that stage
        (module docstring, "Tagged aborts"): after a death, the answer to a copy of the
        abort that the dead process passed on confirms nothing. A stage's answer to a
        replay's fence (:meth:`error`) is not a confirmation: it ends that stage's earlier
        attempt, and a request leaves only once every fence is answered too. A fence's
        answer when none is due (its process died: :meth:`replica_dead`) is ignored. An
        unflagged answer while a fence is due is taken for the fence's (a stage of an older
        build flags nothing); if the request was aborted and the flagged answer to that
        fence comes later, the unflagged one was the abort's (module docstring, "Retry")."""
        requests = self._requests
        bit = 1 << k
        every = self._all
        pooled = self.replicas[k] > 1
        live = RequestState.LIVE
        for rid in req_ids:
            req = requests.get(rid)
            if req is None:
                continue
            if pooled and req.route is not None and req.route[k] != r:
                continue  # a replica the request does not go through
            fences = req.fences
            if not fence and (tag or 0) != (0 if req.want is None else req.want[k]):
                continue  # not the answer that confirms stage k (module docstring)
            if fence:
                # A fence's answer: never the confirmation of an abort.
                if fences is not None and fences[k]:
                    fences[k] -= 1  # stage k applied a replay's fence: its next events are new
                elif req.taken & bit:
                    # Its fences were taken as answered already, by an unflagged answer
                    # that was the abort's (it overtook the fence): that one confirms.
                    req.taken &= ~bit
                    req.confirms |= bit
                else:
                    continue  # a fence no longer counted: its process died (replica_dead)
            elif fences is not None and fences[k]:
                # Unflagged while a fence is due: a stage that flags nothing (an older
                # build) answered the fence; or, once the coordinator has aborted the
                # request, the abort overtook the fence (then the fence's flagged answer
                # comes later, and says so).
                fences[k] -= 1
                if req.state is not live:
                    req.taken |= bit
            elif req.state is live:
                continue
            else:
                req.confirms |= bit
            self._confirmed(req, now, d, every)

    def _confirmed(
        self, req: _Request[S], now: float, d: PipelineDeliveries[S], every: int
    ) -> None:
        """Once every stage has applied the coordinator's abort of *req*, and every fence is
        answered, it is over: an aborting one's stream ends (aborted), its place is free."""
        fences = req.fences
        if req.confirms | self._stopped == every and (fences is None or not any(fences)):
            if req.state is RequestState.ABORTING:
                self._end(req, ABORTED, now, d)
            self._release(req, d)

    def replica_dead(
        self, k: int, r: int, exc: EngineDeadError, now: float, d: PipelineDeliveries[S]
    ) -> bool:
        """Replica *r* of stage *k* is gone. The last live one of its stage: the stage is
        dead (:meth:`stage_dead`). Otherwise only the requests routed through it end, each
        with a :class:`~._errors.PipelineStageDeadError` naming the stage and *r* (a closing
        one's stream has ended already); each is aborted from the first stage (a live one)
        and from its replica of the stage after this one (the abort sent from the first
        stage stops at the dead replica), tagged (module docstring, "Tagged aborts"), unless
        that replica died before (then no stage is left to answer for the later ones: the
        request is over once the others have), and the dead replica counts as having
        applied the abort. The stages next to it are told it is gone, and new requests avoid it.

        With a restart policy (its stage restarts): the death is counted, and unless it
        makes the process ``failed``, :attr:`PipelineDeliveries.restarts` says when to start
        it again; until then it is ``dead``, and if it was its stage's last live process,
        adds are refused (:class:`~._errors.NoReplicaError`) but the pipeline goes on.

        Once the pipeline has failed (:meth:`stage_dead`), the requests it held are aborted
        again from the stage after *r*, those routed through it: the aborts sent at the
        failure may have gone to it, dead before the coordinator heard.

        Whether the death is news: ``False`` if the process was down already and not
        starting (then nothing changes: a restart given up, :meth:`abandoned`, whose new
        process the IO layer stopped after it)."""
        alive = self._alive[k]
        if not alive[r] and self._states[k][r] is not ReplicaState.STARTING:
            return False
        # (A process started again that dies before it is up is one more death of it: a
        # failed start, which :meth:`started` then refuses.)
        alive[r] = False
        policy = self.restart[k]
        delay = None
        if policy is not None and self.failure is None:
            delay = policy.delay(self._deaths[k][r], now)
            self._states[k][r] = ReplicaState.FAILED if delay is None else ReplicaState.DEAD
        else:
            self._states[k][r] = ReplicaState.DEAD
        if delay is not None:
            d.restarts.append((k, r, delay))
        if not any(alive):
            if not self._coming(k):
                self.stage_dead(k, exc, now, d, r)
                return True
            self._down.add(k)
        self._gone_around(k, r, d)
        if self.failure is not None:
            # The pipeline has failed (stage_dead): its requests are over, but the aborts
            # sent then to the stages still running may have gone to this process (dead
            # before the coordinator heard of it). The stage after it gets those routed
            # through it again, so that none holds one until shutdown.
            if k + 1 < self._n:
                through = [
                    (rid, route)
                    for rid, route in self._orphans.items()
                    if route is not None and route[k] == r
                ]
                if through:
                    d.routes.update(through)
                    d.stage_aborts.append((k + 1, [rid for rid, _ in through]))
            return True
        error = PipelineStageDeadError(
            str(exc),
            stage=self.stages[k],
            exit_code=exc.exit_code,
            fatal=exc.fatal,
            replica=r if self.replicas[k] > 1 else None,  # a stage of one process: its own
        )
        error.__cause__ = exc
        end = End(error)
        bit = 1 << k
        after: list[str] = []
        first: list[str] = []  # (from the first stage still running, unless it is this one)
        tag = 0  # the tag of the aborts this death sends, once one is tagged
        for req in [q for q in self._requests.values() if q.route is not None and q.route[k] == r]:
            rid = req.req_id
            state = req.state
            if state is not RequestState.CLOSING:
                self._end(req, end, now, d)
            if state is RequestState.LIVE and k > self._first:
                first.append(rid)
            req.state = RequestState.CLOSING
            fences = req.fences
            if fences is not None:
                # A replay's fences at this stage and after it are moot: the request has
                # ended. Those after it went through the dead process, which may not have
                # sent them on (or the next stage dropped them after its gone): an answer
                # may never come, and is not waited for. One that comes (the dead process
                # had passed the fence on) is flagged, a fence's: ignored. Each later
                # stage's unflagged answer to the abort sent after the death confirms it.
                fences[k:] = repeat(0, self._n - k)
                req.taken &= bit - 1
            req.confirms |= bit
            req.cut |= bit
            sent_route = self._sent_route(req)
            assert sent_route is not None  # routed: the requests routed through the dead one
            d.routes[rid] = sent_route  # -1 at each dead process: the aborts stop before it
            if k + 1 < self._n and not req.cut >> (k + 1) & 1:
                after.append(rid)
                tag = self._want_tag(req, k, tag)
                if tag and req.want is not None and req.want[k + 1] == tag:
                    d.tags[k + 1, rid] = tag
            else:
                # The last stage, or its process of the next stage died before (an abort
                # sent there would reach no one): every stage may have applied the aborts.
                self._confirmed(req, now, d, self._all)
        if first:
            self._abort_from_first(first, d)
        if after:
            d.stage_aborts.append((k + 1, after))
        return True

    def _sent_route(self, req: _Request[S]) -> tuple[int, ...] | None:
        """*req*'s route as the IO layer sends it (:attr:`PipelineDeliveries.routes`):
        ``-1`` for each stage whose process on it died (bit of ``cut``). No message of the
        request goes there, and an abort chased along the route stops at the stage before
        it (module docstring, "Tagged aborts"): a restarted process at that index never
        held it. Only where every live process on the route is of this build (its
        ``welcome`` says ``"tags"``: :meth:`tagged`); an older build refuses a ``-1``, and
        gets the route as it is."""
        route, cut = req.route, req.cut
        if route is None or not cut:
            return route
        tagging = self._tagging
        if not all(cut >> j & 1 or tagging[j][r] for j, r in enumerate(route)):
            return route
        return tuple(-1 if cut >> j & 1 else r for j, r in enumerate(route))

    def _want_tag(self, req: _Request[S], k: int, tag: int) -> int:
        """The abort of *req* sent to stage ``k + 1`` after its process of stage *k* died
        is tagged (*tag*, or a new one if 0; returned): from stage ``k + 1`` on, up to its
        next dead process, each stage that passes tags on is confirmed only by its answer
        to that abort (its answer to an earlier copy, which the dead process may have
        passed on, comes before it: module docstring, "Tagged aborts"). From the first
        process on the route that drops tags (an older build), the stages get untagged
        copies only: any answer confirms, as before tags."""
        n = self._n
        want = req.want
        if want is None:
            want = req.want = [0] * n
        route = req.route
        assert route is not None  # routed: a death ends only the requests routed through it
        tagging = True
        for j in range(k + 1, n):
            if req.cut >> j & 1:
                break  # the abort stops at that dead process: later stages wait for its own
            if tagging and self._tagging[j][route[j]]:
                if not tag:
                    self._tag = tag = self._tag + 1
                want[j] = tag
                req.confirms &= ~(1 << j)  # its answer to this abort is still to come
            else:
                tagging = False
                want[j] = 0
        return tag

    def _gone_around(self, k: int, r: int, d: PipelineDeliveries[S]) -> None:
        """Tell the live replicas of the stages next to stage *k* that its replica *r* is
        gone: the next stage's first (``"previous"``), then the previous stage's."""
        if k + 1 < self._n:
            for j, up in enumerate(self._alive[k + 1]):
                if up:
                    d.gone.append((k + 1, j, "previous", k, r))
        if k > 0:
            for j, up in enumerate(self._alive[k - 1]):
                if up:
                    d.gone.append((k - 1, j, "next", k, r))

    def stage_dead(
        self,
        k: int,
        exc: EngineDeadError,
        now: float,
        d: PipelineDeliveries[S],
        r: int | None = None,
    ) -> None:
        """Stage *k* is gone: every request still in the pipeline ends with a
        :class:`~._errors.PipelineStageDeadError` naming it (a closing one's stream has
        ended already), its place is free, and the pipeline takes no more requests. Each is
        aborted in the stages still running, so that none keeps working on it: the live ones
        from the first stage (unless it is the dead one), and all of them from the stage
        after the dead one, which no abort from the first stage can reach now (a closing
        one's abort, sent when its stream ended, may not have got past the dead stage).
        The core keeps those ids: if another stage dies later, the stage after that one
        gets their aborts too, since the ones on their way may have died with it.

        Its neighbours are told it is gone (:attr:`PipelineDeliveries.gone`): the stage
        after it drops whatever of its data arrives later (its last ``pipe`` messages and
        the coordinator's abort travel on two connections, with no order between them),
        and the stage before it stops sending to it and frees the shared-memory slots it
        kept for it.

        With replica pools: *r* is the replica that died last (the stage's others died
        before it), and the error names it."""
        if r is not None:
            self._alive[k][r] = False
        self._down.discard(k)
        error = PipelineStageDeadError(
            str(exc),
            stage=self.stages[k],
            exit_code=exc.exit_code,
            fatal=exc.fatal,
            replica=r if self.replicas[k] > 1 else None,
        )
        error.__cause__ = exc
        if self.failure is None:
            self.failure = error
            self._failure_end = End(error)
        requests = self._requests
        if requests:
            if k > self._first:  # (a stage before it drained and stopped: from the next)
                closing = RequestState.CLOSING
                live = [rid for rid, req in requests.items() if req.state is not closing]
                if live:
                    self._abort_from_first(live, d)
            self._orphans.update((rid, self._sent_route(req)) for rid, req in requests.items())
        if self.pooled:
            d.routes.update((rid, route) for rid, route in self._orphans.items() if route)
        # A stage's death also cuts the aborts that an earlier death sent on their way
        # through it: the stage after it gets them again (a stage ignores an abort of an id
        # it does not hold, and no id is reused once the pipeline has failed).
        self._gone_around(k, 0 if r is None else r, d)
        if k + 1 < self._n and self._orphans:
            d.stage_aborts.append((k + 1, list(self._orphans)))
        self._end_all(error, now, d)

    # -- restarts ---------------------------------------------------------------------------

    def _coming(self, k: int) -> bool:
        """Whether a process of stage *k* that is not live now will be: starting, or dead
        with a restart pending."""
        if self.restart[k] is None:
            return False
        return any(s is ReplicaState.STARTING or s is ReplicaState.DEAD for s in self._states[k])

    def coming(self, k: int, r: int) -> bool:
        """Whether process *r* of stage *k* is down and coming back: being started again,
        or dead with its restart pending."""
        state = self._states[k][r]
        return self.restart[k] is not None and (
            state is ReplicaState.STARTING or state is ReplicaState.DEAD
        )

    def restarting(self, k: int, r: int) -> int | None:
        """The restart timer of process *r* of stage *k* fired: whether to start it now
        (it is then ``starting``), as the generation to start it with; ``None``: not (the
        pipeline failed or closed meanwhile)."""
        states = self._states[k]
        if self.failure is not None or states[r] is not ReplicaState.DEAD:
            return None
        if self.restart[k] is None:
            return None
        states[r] = ReplicaState.STARTING
        self._restarts[k][r] += 1
        self._generations[k][r] += 1
        return self._generations[k][r]

    def linkable(self, k: int, r: int) -> bool:
        """Whether process *r* of stage *k*, started again, may be linked in now (the stage
        before it sent its ``link``): stage ``k - 1`` has answered for every request routed
        through that process that is still in the pipeline (module docstring,
        "Restarts"), i.e. applied the abort that confirms it there and every fence due
        there. Those are the dead process's requests (no request is routed to a process
        that is not live); once that stage has applied the abort of one, it sends nothing
        more of it, and whatever it sent before went down the link to the dead process.
        Until then, a copy of an abort (or a replay's fence, or the request's data) that
        it applies late would go down the new link to the new process, which would pass
        it on untagged, with no order to the tagged abort. Always true for the first two
        stages: the first stage hears only the coordinator, and applies its messages in
        order, so it applies every abort and replay sent before the ``link`` before it; and
        once the pipeline has failed (no request is left). A death of the previous stage's
        process counts as its answer."""
        if k <= 1:
            return True
        bit = 1 << (k - 1)
        j = k - 1
        for req in self._requests.values():
            route = req.route
            if route is None or route[k] != r:
                continue
            if not req.confirms & bit:
                return False
            fences = req.fences
            if fences is not None and fences[j]:
                return False
        return True

    def started(self, k: int, r: int) -> bool:
        """Process *r* of stage *k* is up again, linked to its neighbours: requests are
        routed to it from the next one admitted. ``False``: the pipeline failed or closed
        meanwhile (the new process is to be stopped)."""
        if self.failure is not None or self._states[k][r] is not ReplicaState.STARTING:
            return False
        self._states[k][r] = ReplicaState.SERVING
        self._alive[k][r] = True
        self._down.discard(k)
        return True

    def start_failed(
        self, k: int, r: int, exc: EngineDeadError, now: float, d: PipelineDeliveries[S]
    ) -> float | None:
        """Starting process *r* of stage *k* again failed at *now*: one more death of it.
        The delay before the next try, or ``None``: it failed too often (it is ``failed``;
        if no other process of its stage is live or coming, the stage is dead,
        :meth:`stage_dead`), or the pipeline failed or closed meanwhile."""
        states = self._states[k]
        policy = self.restart[k]
        if policy is None or states[r] is not ReplicaState.STARTING or self.failure is not None:
            return None
        delay = policy.delay(self._deaths[k][r], now)
        if delay is None:
            self._failed(k, r, exc, now, d)
        else:
            states[r] = ReplicaState.DEAD
        return delay

    def abandoned(
        self, k: int, r: int, exc: EngineDeadError, now: float, d: PipelineDeliveries[S]
    ) -> bool:
        """The IO layer gave up the restart of process *r* of stage *k* at *now*, before the
        process was up (an :class:`~enginecore.stage.AsyncPipeline`'s restart task was
        cancelled, the pipeline still open): nothing will start it again, so it is
        ``failed``, as after ``max_failures`` (:meth:`start_failed`): out for good, and if
        no other process of its stage is live or coming, the stage is dead
        (:meth:`stage_dead`, with *exc*). Whether it was coming back (``dead`` with its
        restart pending, or ``starting``); ``False`` changes nothing: it is up or failed
        already, or the pipeline failed or closed meanwhile (no restart was due)."""
        if self.failure is not None or not self.coming(k, r):
            return False
        self._failed(k, r, exc, now, d)
        return True

    def _failed(
        self, k: int, r: int, exc: EngineDeadError, now: float, d: PipelineDeliveries[S]
    ) -> None:
        """Process *r* of stage *k*, down, will not be started again: ``failed``; its stage
        is dead if that leaves it no process live or coming back."""
        self._states[k][r] = ReplicaState.FAILED
        if not any(self._alive[k]) and not self._coming(k):
            self.stage_dead(k, exc, now, d, r)

    def process_state(self, k: int, r: int) -> ReplicaState:
        """Where process *r* of stage *k* is: ``serving``; ``dead`` (restarted later if its
        stage restarts, else for good); ``starting`` (being started again); ``failed``
        (died too often: out for good)."""
        return self._states[k][r]

    def restarts(self, k: int, r: int) -> int:
        """How many times process *r* of stage *k* was started again."""
        return self._restarts[k][r]

    def generation(self, k: int, r: int) -> int:
        """How many times process *r* of stage *k* was started before the current one: its
        link's and its shared-memory slots' names carry it (:func:`._edge.slot_token`)."""
        return self._generations[k][r]

    @property
    def first(self) -> int:
        """The first stage still running: 0, but during a ``shutdown(drain=...)`` the
        number of stages that have drained and stopped (:meth:`stopped`)."""
        return self._first

    def stopped(self, k: int, now: float, d: PipelineDeliveries[S]) -> None:
        """Stage *k* (every process of it) has drained and stopped during a
        ``shutdown(drain=...)``, as every stage before it has, and the coordinator has
        every event it sent (its last one included). No add comes any more, so no id is
        used again: from now on stage *k* counts as having applied every abort (it holds no
        request, and can answer nothing more), and an abort that would go to the first
        stage goes to stage ``k + 1`` (:meth:`_abort_from_first`), which chases it on. A
        request whose abort is out and that stage *k* never answered (it arrived after the
        stage's drain ended, so it was not chased on either) is aborted again from stage
        ``k + 1``; an abort that reaches a stage twice is answered twice, the second time
        for an id no longer here, which is dropped. A fence still due at stage *k* is
        moot. (Stage *k*'s last data may in principle be overtaken at stage ``k + 1`` by
        an abort sent there now, since they come on two connections: the request then
        ends aborted for the caller, and that stage may still run what arrives after,
        dropped, to its end, as it would have without the abort.)"""
        if k < self._first:
            return
        bit = 1 << k
        self._stopped |= (bit << 1) - 1
        self._first = k + 1
        nxt = k + 1
        again: list[str] = []
        for req in list(self._requests.values()):
            fences = req.fences
            if fences is not None:
                fences[: k + 1] = repeat(0, k + 1)
            if req.state is RequestState.LIVE:
                continue
            if (
                not req.confirms & bit
                and nxt < self._n
                and not req.cut >> nxt & 1
                and not req.confirms >> nxt & 1
            ):
                again.append(req.req_id)
                route = self._sent_route(req)
                if route is not None:
                    d.routes[req.req_id] = route
                want = req.want
                if want is not None and want[nxt]:
                    d.tags[nxt, req.req_id] = want[nxt]
            self._confirmed(req, now, d, self._all)
        if again:
            d.stage_aborts.append((nxt, again))

    def close(self, exc: BaseException, now: float, d: PipelineDeliveries[S]) -> None:
        """The pipeline is closed: every stream still open ends with *exc*."""
        if self.failure is None:
            self.failure = exc
            self._failure_end = End(exc)
        self._end_all(exc, now, d)

    # -- inside ---------------------------------------------------------------------------------

    @staticmethod
    def _ended(req: _Request[S], k: int, report: int) -> bool:
        """Stage *k*'s end report (module docstring) of *req*: whether it is done now."""
        if report & BEFORE:
            below = (1 << k) - 1
            req.ended |= below
            req.sent |= below
        if report & ENDED:
            req.ended |= 1 << k
        if report & SENT_ON:
            req.sent |= 1 << k
        # Done: every stage up to the first one that sent nothing on ended it.
        sent = req.sent
        need = (((sent + 1) & ~sent) << 1) - 1
        return req.ended & need == need

    def _finish(self, req: _Request[S], now: float, d: PipelineDeliveries[S]) -> None:
        state = req.state
        if state is RequestState.CLOSING:
            return  # the stream has ended; the abort's confirmations free it
        self._end(req, FINISHED, now, d)
        if state is RequestState.LIVE:
            if req.route is not None:
                d.routes[req.req_id] = req.route
            if req.fences is not None and any(req.fences):
                # A replay is still on its way (a later one made it moot): abort the request
                # in every stage, so that what it replays ends too, and keep the id until
                # every stage has applied that abort and answered every fence.
                self._abort_from_first([req.req_id], d)
                req.state = RequestState.CLOSING
                return
            self._release(req, d)
            if self._retrying:
                d.releases.append(req.req_id)
        else:  # aborting: the abort is on its way through the stages; wait for it
            req.state = RequestState.CLOSING

    def _end(self, req: _Request[S], end: End, now: float, d: PipelineDeliveries[S]) -> None:
        if req.stream._end_with(end, now):
            d.wake.append(req.stream)

    def _end_all(self, exc: BaseException, now: float, d: PipelineDeliveries[S]) -> None:
        end = End(exc)
        for req in self._requests.values():
            if req.state is not RequestState.CLOSING:
                self._end(req, end, now, d)
        d.freed += len(self._requests)
        self._requests.clear()
        self.bytes_in = 0
        for load in self._load:
            load[:] = [0] * len(load)

    def _release(self, req: _Request[S], d: PipelineDeliveries[S]) -> None:
        """*req* is over in every stage: its id and its place in the budget are free."""
        del self._requests[req.req_id]
        self.bytes_in -= req.nbytes
        d.freed += 1
        route = req.route
        if route is not None:
            for load, replica in zip(self._load, route, strict=True):
                load[replica] -= 1

    def tagged(self, k: int, r: int, tags: bool = True) -> None:
        """Whether process *r* of stage *k* (as launched now, or started again) answers a
        tagged abort with its tag and chases it tagged (its ``welcome`` says so,
        ``docs/wire.md`` section 8). Until told, a process is taken for an older build's:
        the aborts sent after a death are confirmed by its first answer, as before tags."""
        self._tagging[k][r] = tags

    def generational(self, k: int, r: int, gens: bool = True) -> None:
        """Whether process *r* of stage *k* (as launched now, or started again) takes routes
        that name a generation for each process of a stage that restarts, and a ``link``
        that names the new process's (its ``welcome`` says ``"gens"``, ``docs/wire.md``
        section 8, "Restarts"; a build that says it says ``"tags"`` too). Until told, a
        process is taken for an older build's, which would refuse them: it gets plain
        routes and links, as before."""
        self._generational[k][r] = gens

    def says_generations(self, k: int, r: int) -> bool:
        """Whether process *r* of stage *k* is sent a ``link`` that names the new process's
        generation (:meth:`generational`)."""
        return self._generational[k][r]

    def wire_route(self, route: Sequence[int], start: int) -> list[Any]:
        """*route* (as :attr:`PipelineDeliveries.routes` has it: ``-1`` at a dead process)
        from stage *start* on, as the route a message carries: each process of a stage that
        restarts as ``[replica, generation]`` (module docstring, "Restarts"), so that the
        stage before it tells a request meant for a process started again from one meant
        for the dead one at that index. Only where every process on the route takes them
        (:meth:`generational`: the stages before *start* passed the route on, and each
        stage sends on what follows it); otherwise, and without restarts, the plain
        indexes. The generation of a live process on a route is the current one: the
        requests routed to a process are all cut (``-1``) when it dies, before it is
        started again as the next generation."""
        rest = list(route[start:])
        if not self._regenerates:
            return rest
        generational = self._generational
        if not all(r < 0 or generational[j][r] for j, r in enumerate(route)):
            return rest
        restart, generations = self.restart, self._generations
        return [
            [r, generations[j][r]] if r >= 0 and restart[j] is not None else r
            for j, r in enumerate(rest, start)
        ]

    def load(self, k: int) -> list[int]:
        """Per replica of stage *k*: the requests routed there that are in the pipeline."""
        return list(self._load[k])

    def alive(self, k: int) -> list[bool]:
        """Per replica of stage *k*: whether the coordinator has not seen it die."""
        return list(self._alive[k])
