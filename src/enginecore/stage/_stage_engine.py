"""The user's engine as the loop of a stage process sees it: :class:`StageEngine`.

Everything here runs on the loop thread. The adapter adds four things to the engine:

- request-scoped failure (:func:`make_add`): ``add`` of a request id that is live in the
  stage is refused without calling the engine, and a :class:`~enginecore.RequestRejected`
  from the engine's ``add`` ends only that request; either is an ``error`` event for it;
- its ``step()`` hands each step's outputs, routed and checked, to the output thread as one
  ``outputs`` event, and returns nothing to the loop (:func:`make_step`);
- after ``abort(req_ids)`` returns, an ``aborted`` event, ordered with the outputs, so none
  of the aborted requests' outputs follows it;
- the ordered stop: a client's ``shutdown`` is applied in order, after everything sent
  before it (:func:`ordered_stop`); with a drain, new adds are refused while the live
  requests run to completion, and those still live at the drain's deadline are aborted,
  each with an ``error`` event, before the loop stops;
- sessions: when a client detaches, its live requests are aborted, in order after what it
  sent, and the outbox learns which session the loop's events belong to
  (:func:`session_change`).

Every other exception from the engine stays fatal to the loop (``docs/contract.md``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from itertools import compress
from typing import Any, Final, Protocol

from .._engine import Engine, PipelinedEngine
from .._exceptions import RequestRejected
from .._messages import Abort, Add, Event, Utility
from .._messages import make_add as make_add_message
from . import _codec
from ._codec import only_types
from ._outbox import BACKLOG_MAX, Outbox
from ._routing import make_router
from ._watchdog import StepWatchdog

logger = logging.getLogger("enginecore.stage")

__all__ = [
    "ADDS",
    "DRAINING",
    "LIVE_IN_STAGE",
    "InputSide",
    "StageEngine",
    "adds",
    "drain_timed_out",
    "drop_ended",
    "make_add",
    "make_collect",
    "make_launch",
    "make_step",
    "ordered_stop",
    "session_change",
]

LIVE_IN_STAGE: Final = (
    "add refused: this request id is live in the stage (added, and not yet finished, "
    "aborted or ended by an error)"
)
"""The message of the ``error`` event for an ``add`` of a request id that is live."""


# -- the ordered stop -------------------------------------------------------------------------
# The loop has no "stop after what is queued" message, so the stage builds one out of a
# utility call that only it can make: the input thread queues ordered_stop(), the loop applies
# it in order, StageEngine.utility() sees the token and calls request_shutdown(), and
# StageEngine.emit() drops the call's answer, which no client asked for.


class _StopCallId(int):
    """The call id of an ordered stop; its ``utility`` answer is never sent."""


# A wire message can never carry this object, so only the stage itself can make this call.
_STOP_TOKEN: Final = object()


def ordered_stop(drain: float | None = None) -> Utility:
    """The ``input_queue`` message for a client's ``shutdown``: stop now, or after a drain
    of at most *drain* seconds (see :class:`StageEngine`).

    Applied *in order*: everything the client sent before it is applied first, exactly like
    a message. (``request_shutdown()`` called from the input thread would not be: called
    before ``run()`` has started, it makes the run skip what is already queued.)
    """
    return Utility(_StopCallId(0), "shutdown", (_STOP_TOKEN, drain))


# The same trick for the drain's deadline, queued by a timer thread.
_DEADLINE_TOKEN: Final = object()
_DRAIN_DEADLINE: Final = Utility(_StopCallId(0), "drain deadline", (_DEADLINE_TOKEN,))

DRAINING: Final = "add refused: the stage is draining (shutting down once its live requests end)"
"""The message of the ``error`` event for an ``add`` that arrives during a drain."""


def drain_timed_out(seconds: float) -> str:
    """The message of the ``error`` event that ends a request still live at the drain's
    deadline."""
    return (
        f"aborted: the stage shut down; its drain timed out after {seconds:g} s "
        f"before this request finished"
    )


# -- dropping a request that the stage has ended ------------------------------------------------


class _EndedIds(list[str]):
    """The ids of an abort that the stage makes itself, for a request it has already ended
    with an ``error`` event (an output that could not be encoded, or that the routing hook
    made a :class:`~enginecore.RequestRejected`). :meth:`StageEngine.abort` drops it from
    the engine and sends no ``aborted`` event: the error was the request's last event, and
    the client may already have added the id again. (An ``aborted`` event would then end
    the new request's stream.)"""


def drop_ended(req_id: str) -> Abort:
    """The ``input_queue`` message that drops *req_id*, which the stage has ended with an
    error, from the engine. Queued before the error event is sent, so it is applied before
    anything the client sends once it has seen the error."""
    return Abort(_EndedIds((req_id,)))


# -- sessions ---------------------------------------------------------------------------------


class _SessionChange(list[str]):
    """The ids of the abort that the input thread queues when a client detaches (``bye``)
    or a new one is welcomed (*epoch*, see ``Outbox.begin_session``). Applied in order, after
    everything the previous client sent: :meth:`StageEngine.abort` aborts the requests live
    in the stage, unless they are to be kept, and sends no ``aborted`` event (nobody asked).
    """

    def __init__(self, epoch: int | None) -> None:
        super().__init__()
        self.epoch = epoch


def session_change(epoch: int | None) -> Abort:
    """The ``input_queue`` message for the end of a session (*epoch* ``None``: a ``bye``) or
    the start of the session *epoch*."""
    return Abort(_SessionChange(epoch))


# -- the adapter --------------------------------------------------------------------------------


class InputSide(Protocol):
    """What a step needs of the stage's input queue (:class:`~._input_queue.InputQueue`):
    whether the loop still holds the input side, how to give it back, and what to do with
    it after a step."""

    holds: bool

    def release(self) -> None: ...

    def after_step(self, took: float) -> None: ...


class StageEngine:
    """*engine* with the stage's ``add``, ``step``, ``abort`` and ``utility``, and the loop's
    ``emit``.

    ``has_work`` is the engine's own bound method, and ``add`` and ``step`` are closures
    (:func:`make_add`, :func:`make_step`), all stored as attributes, so the hot path pays
    no attribute lookup for the adapter. For a :class:`~enginecore.PipelinedEngine`,
    ``launch`` and ``collect`` (:func:`make_launch`, :func:`make_collect`) take ``step``'s
    place, and ``cancel`` is the engine's if it has one. Outputs of requests the stage has
    aborted, and that are not live again, are dropped and counted in :attr:`stale` (an
    engine that returned outputs after an abort). Set :attr:`request_shutdown` to the loop's, and
    :attr:`submit` to the loop's ``submit`` (the drain's timer uses it).
    *abort_on_detach*: whether a session change aborts the requests live in the stage.
    *input_side*: the stage's input queue, which the loop reads between short steps, and
    gives back to the input thread after a long step or before a launch
    (:mod:`._input_queue`).

    The drain (a ``shutdown`` with a drain time, or ``serve``'s SIGTERM with
    ``--drain-timeout``): from the moment it is applied, an ``add`` is refused with an
    ``error`` event (:data:`DRAINING`), utilities are answered and aborts applied as usual.
    Once no request is live in the stage (finished, aborted, or ended by an error), the
    loop is asked to stop. At the deadline, the requests still live are aborted in the
    engine, each ends with an ``error`` event (:func:`drain_timed_out`), and the loop is
    asked to stop. A ``shutdown`` without a drain during a drain stops at once; a second
    drain can only bring the deadline closer.
    """

    def __init__(
        self,
        engine: Engine | PipelinedEngine[Any],
        outbox: Outbox,
        *,
        abort_on_detach: bool = True,
        watchdog: StepWatchdog | None = None,
        input_side: InputSide,
    ) -> None:
        # The request ids live in the stage: added (the engine's add() returned), and not
        # yet finished (an output routed with finished=True), aborted (abort() returned) or
        # ended by an error. A request that an output ended with an error before its last
        # output stays live until drop_ended()'s abort is applied: until then the engine
        # still has it, and an add of its id queued before that abort must be refused.
        # Loop thread only (make_add, make_step, abort): no lock.
        self.live: set[str] = set()
        self.drain = _Drain(self)
        self.stale = _Stale()
        self.has_work = engine.has_work
        self.add = make_add(engine, outbox, self.live)
        # A pipelined engine gets the loop's launch/collect (and cancel, if it has one), an
        # Engine the loop's step: the loop drives whichever this adapter has.
        if isinstance(engine, PipelinedEngine):
            self.launch = make_launch(engine, outbox, watchdog, input_side)
            self.collect = make_collect(engine, outbox, self.live, self.drain, watchdog, self.stale)
            cancel = getattr(engine, "cancel", None)
            if callable(cancel):
                self.cancel = cancel
        else:
            self.step = make_step(
                engine, outbox, self.live, self.drain, watchdog, self.stale, input_side
            )
        self._utility = engine.utility
        self._abort = engine.abort
        self._emit = outbox.emit
        self._outbox = outbox
        self._abort_on_detach = abort_on_detach
        self.request_shutdown: Callable[[], None] = lambda: None
        self.submit: Callable[[Utility], None] = lambda msg: None

    def abort(self, req_ids: Sequence[str]) -> None:
        cls = req_ids.__class__
        if cls is _SessionChange:
            self._change_session(req_ids.epoch)  # type: ignore[attr-defined]
        else:
            self._abort(req_ids)
            self.live.difference_update(req_ids)
            self.stale.aborted(req_ids)
            if cls is not _EndedIds:
                self._emit(("aborted", list(req_ids)))
            else:
                self._outbox.ended_dropped(list(req_ids))
        if self.drain.active and not self.live:
            self.drain.done()

    def _change_session(self, epoch: int | None) -> None:
        # Every request live now was added by the client that is leaving (or by a peer that
        # sent without a session): with abort_on_detach, every detach empties the set.
        if self._abort_on_detach and self.live:
            ids = list(self.live)
            self._abort(ids)
            self.live.clear()
            self.stale.aborted(ids)
            logger.info("enginecore: a client detached; aborted its %d live requests", len(ids))
        if epoch is not None:
            self._outbox.loop_epoch(epoch)

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        if args:
            token = args[0]
            if token is _STOP_TOKEN:
                drain = args[1]
                if drain is None:
                    self.drain.cancel()
                    self.request_shutdown()
                else:
                    self.drain.start(drain)
                return None
            if token is _DEADLINE_TOKEN:
                self.drain.deadline()
                return None
        return self._utility(name, args)

    def refuse_add(self, req_id: str, data: Any) -> None:
        """The loop's ``add`` during a drain: an ``error`` event (one per request of a
        burst), and the engine is not called."""
        if req_id is ADDS:
            for rid in data[0]:
                self._emit(("error", rid, DRAINING))
        else:
            self._emit(("error", req_id, DRAINING))

    def emit(self, event: Event) -> None:
        """The loop's ``emit``: utility answers and the terminal event (never an
        ``output``: :func:`make_step` hands a step's outputs over itself)."""
        if event[0] != "utility" or type(event[1]) is not _StopCallId:
            self._emit(event)


class _Drain:
    """The drain of one :class:`StageEngine` (its docstring has the rules). Loop thread
    only, except the timer, which only queues the deadline message."""

    def __init__(self, stage: StageEngine) -> None:
        self._stage = stage
        self.active = False  # read by make_step's closure once per step that ends requests
        self._seconds = 0.0
        self._deadline_at = 0.0
        self._timer: threading.Timer | None = None

    def start(self, seconds: float) -> None:
        stage = self._stage
        now = time.monotonic()
        if self.active:
            if now + seconds >= self._deadline_at:
                return  # a second drain only brings the deadline closer
            self.cancel()
        self.active = True
        self._seconds = seconds
        self._deadline_at = now + seconds
        stage.add = stage.refuse_add  # the loop looks add up per message
        logger.info(
            "enginecore: draining: %d live requests, at most %g s", len(stage.live), seconds
        )
        if not stage.live:
            self.done()
            return
        timer = threading.Timer(seconds, stage.submit, (_DRAIN_DEADLINE,))
        timer.daemon = True
        timer.name = "enginecore-drain"
        self._timer = timer
        timer.start()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def done(self) -> None:
        """No request is live any more: stop."""
        self.cancel()
        self._stage.request_shutdown()

    def deadline(self) -> None:
        if not self.active or self._timer is None:
            return  # stale: the drain ended before its timer fired
        stage = self._stage
        ids = list(stage.live)
        if ids:
            stage._abort(ids)
            stage.live.clear()
            stage.stale.aborted(ids)
            message = drain_timed_out(self._seconds)
            stage._outbox.post_step([("error", rid, message) for rid in ids], len(ids))
            logger.warning(
                "enginecore: the drain timed out after %g s; aborted %d live requests",
                self._seconds,
                len(ids),
            )
        self.done()


class _AddsId(str):
    """The ``req_id`` of an ``Add`` that carries a client's whole ``adds`` burst."""

    __slots__ = ()


ADDS: Final = _AddsId("<adds>")
"""``Add(ADDS, (req_ids, data))`` is a burst of adds, one message on the loop's queue:
:func:`make_add` applies each in order, as if each were its own ``Add`` (no ``Add`` per
request to build, and one dispatch by the loop). Compared by identity: a client's
``"<adds>"`` is an ordinary id."""


def adds(req_ids: list[str], data: list[Any]) -> Add:
    """The one ``Add`` message of a burst (same lengths; the input thread checks)."""
    return make_add_message(ADDS, (req_ids, data))


def make_add(
    engine: Engine | PipelinedEngine[Any], outbox: Outbox, live: set[str]
) -> Callable[[str, Any], None]:
    """The loop's ``add``: request-scoped failure around *engine*'s ``add``.

    An id in *live* is refused with an ``error`` event (:data:`LIVE_IN_STAGE`), and the
    engine is not called: two clients of a ``serve`` stage (or one raw client) cannot make
    the engine see an id twice. A :class:`~enginecore.RequestRejected` from the engine
    becomes an ``error`` event carrying ``str(exc)``, and the id stays free. Either error
    is the request's only event, ordered with the loop's others. Any other exception
    propagates: fatal to the loop (the rest of a burst is not applied). On success the id
    joins *live*. A burst (:data:`ADDS`) is applied item by item, the same way.
    """
    engine_add = engine.add
    emit = outbox.emit
    admit = live.add

    def add(req_id: str, data: Any) -> None:
        # One body for both: a lone add pays a 1-tuple (~0.07 µs).
        for rid, item in zip(*data, strict=True) if req_id is ADDS else ((req_id, data),):
            if rid in live:
                emit(("error", rid, LIVE_IN_STAGE))
                continue
            try:
                engine_add(rid, item)
            except RequestRejected as exc:
                emit(("error", rid, str(exc)))
                continue
            admit(rid)

    return add


class _Stale:
    """Outputs the engine returned for requests the stage has aborted (a client's abort, a
    detach, or an error that ended the request) and that are not live again: dropped, and
    counted. An engine that keeps its contract never returns one; a pipelined engine that
    loses track of an abort between a launch and its collect would, and no client may see
    an output after ``aborted``. (Outputs of ids the stage never saw pass, as before: an
    engine may have requests of its own.) It remembers the last :data:`REMEMBERED` aborted
    ids: enough for any step still in flight when the abort came."""

    REMEMBERED: Final = 4096

    __slots__ = ("_logged_at", "count", "recent")

    def __init__(self) -> None:
        self.count = 0
        self.recent: dict[str, None] = {}  # insertion-ordered: the oldest goes first
        self._logged_at = -1e9

    def aborted(self, req_ids: Iterable[str]) -> None:
        """Loop thread: *req_ids* were dropped from the engine by the stage or a client."""
        recent = self.recent
        recent.update(dict.fromkeys(req_ids))
        over = len(recent) - self.REMEMBERED
        if over > 0:
            for rid in list(itertools.islice(recent, over)):
                del recent[rid]

    def drop(self, live: set[str], rids: list[Any], fins: list[Any], payloads: list[Any]) -> None:
        """Remove, in place, every output of a request aborted and not live again."""
        recent = self.recent
        keep = [i for i, rid in enumerate(rids) if rid in live or rid not in recent]
        dropped = len(rids) - len(keep)
        if not dropped:
            return
        dropped_ids = sorted({rid for rid in rids if rid not in live and rid in recent})
        rids[:] = [rids[i] for i in keep]
        fins[:] = [fins[i] for i in keep]
        payloads[:] = [payloads[i] for i in keep]
        self.count += dropped
        now = time.monotonic()
        if now - self._logged_at >= 1.0:  # an engine bug, but a flood must not flood the log
            self._logged_at = now
            logger.warning(
                "enginecore: dropped %d outputs of aborted requests, e.g. %r (%d so far): the "
                "engine returned outputs after their abort",
                dropped,
                dropped_ids[:3],
                self.count,
            )


def _make_handle_outputs(
    engine: Engine | PipelinedEngine[Any],
    outbox: Outbox,
    live: set[str],
    drain: _Drain,
    stale: _Stale,
    watchdog: StepWatchdog | None,
) -> Callable[[Callable[[], Iterable[Any]]], None]:
    """``handle(produce)``: call *produce* (the engine's ``step``, or a ``collect`` of one
    handle) under the *watchdog*, route its outputs on the loop thread (before the engine
    can reuse one), drop those of requests aborted and not live again (*stale*), and post
    the rest to *outbox* as **one** ``outputs`` event. An exception in *produce* or in
    routing propagates (fatal), and what was routed before it is still sent first. A
    request's output routed with ``finished=True`` takes its id out of *live*; during a
    *drain*, the step that leaves *live* empty ends it."""
    route = make_router(engine)
    post = outbox.post_step
    prepare_outputs = outbox.prepare_outputs
    flat = _codec.FLAT_TYPES
    forget = live.difference_update
    superset = live.issuperset
    recent = stale.recent  # the same dict for the life of the stage

    def handle(produce: Callable[[], Iterable[Any]]) -> None:
        rids: list[Any] = []
        fins: list[Any] = []
        payloads: list[Any] = []
        try:
            if watchdog is not None:
                watchdog.begin()
                try:
                    route(produce(), rids, fins, payloads)
                finally:
                    watchdog.end()
            else:
                route(produce(), rids, fins, payloads)
        finally:
            # Once the stage has aborted anything: in C, ~10 ns per output, the outputs of
            # requests not live are looked at further, for an abort the engine lost.
            if payloads and recent and not superset(rids):
                stale.drop(live, rids, fins, payloads)
            # One hand-over per step (Outbox.post_step: a big step is sent at once while
            # the output thread idles, a small one queued to share a frame).
            if payloads:
                # Fast path: every payload of an exact flat type (an out-of-range int is
                # caught when msgspec refuses it, in the output thread).
                if only_types(payloads, flat):
                    post([("outputs", rids, fins, payloads)], len(payloads))
                else:
                    post(prepare_outputs(rids, fins, payloads), len(payloads))
                # Both loops in C: ~2 ns per output, ~20 ns more per finished one.
                if any(fins):
                    forget(compress(rids, fins))
                    if drain.active and not live:
                        drain.done()

    return handle


def make_step(
    engine: Engine,
    outbox: Outbox,
    live: set[str],
    drain: _Drain,
    watchdog: StepWatchdog | None,
    stale: _Stale,
    input_side: InputSide,
) -> Callable[[], tuple[()]]:
    """The loop's ``step``: *engine*'s step, handled as :func:`_make_handle_outputs` says
    (routed, checked and posted as one ``outputs`` event); it returns nothing to the loop.
    A payload that cannot cross the wire, or that is a :class:`~enginecore.RequestRejected`,
    ends only its request (:meth:`Outbox.prepare_outputs`). Before a step, waits while the
    output thread is far behind a connected client (:meth:`Outbox.wait_for_room`). While
    the loop holds the *input_side* (``_input_queue``: it read the message that ended its
    idle wait), the step is timed, and ``input_side.after_step`` then reads the input socket
    without blocking (a short step) or hands it to the input thread (a long one).
    """
    handle = _make_handle_outputs(engine, outbox, live, drain, stale, watchdog)
    engine_step = engine.step
    wait_for_room = outbox.wait_for_room
    monotonic = time.monotonic

    def step() -> tuple[()]:
        if outbox.backlog > BACKLOG_MAX:  # unlocked peek; wait_for_room re-checks
            wait_for_room()
        if input_side.holds:  # unlocked peek; after_step() re-checks
            started = monotonic()
            handle(engine_step)
            input_side.after_step(monotonic() - started)
        else:
            handle(engine_step)
        return ()

    return step


def make_launch(
    engine: PipelinedEngine[Any],
    outbox: Outbox,
    watchdog: StepWatchdog | None,
    input_side: InputSide,
) -> Callable[[], Any]:
    """The loop's ``launch`` for a pipelined engine: the engine's, under the *watchdog*,
    after giving the *input_side* back to the input thread (which reads while the loop
    waits in ``collect``; a step in flight is presumed to release the GIL) and waiting
    while the output thread is far behind a connected client (back-pressure applies to
    launching new steps; the steps in flight are still collected)."""
    engine_launch = engine.launch
    wait_for_room = outbox.wait_for_room

    def launch() -> Any:
        if input_side.holds:
            input_side.release()
        if outbox.backlog > BACKLOG_MAX:
            wait_for_room()
        if watchdog is None:
            return engine_launch()
        watchdog.begin()
        try:
            return engine_launch()
        finally:
            watchdog.end()

    return launch


def make_collect(
    engine: PipelinedEngine[Any],
    outbox: Outbox,
    live: set[str],
    drain: _Drain,
    watchdog: StepWatchdog | None,
    stale: _Stale,
) -> Callable[[Any], tuple[()]]:
    """The loop's ``collect(handle)`` for a pipelined engine: the engine's collect of that
    handle, handled as a step is (:func:`_make_handle_outputs`); returns nothing to the
    loop."""
    handle_outputs = _make_handle_outputs(engine, outbox, live, drain, stale, watchdog)
    engine_collect = engine.collect

    def collect(handle: Any) -> tuple[()]:
        handle_outputs(lambda: engine_collect(handle))
        return ()

    return collect
