"""The user's engine as the loop of a stage process sees it: :class:`StageEngine`.

Everything here runs on the loop thread. The adapter adds five things to the engine:

- request-scoped failure (:func:`make_add`): ``add`` of a request id that is live in the
  stage is refused without calling the engine, and a :class:`~enginecore.RequestRejected`
  from the engine's ``add`` ends only that request; either is an ``error`` event for it;
- its ``step()`` hands each step's outputs, routed and checked, to the output thread as one
  ``outputs`` event, and returns nothing to the loop (:func:`make_step`);
- after ``abort(req_ids)`` returns, an ``aborted`` event, ordered with the outputs, so none
  of the aborted requests' outputs follows it (flagged, ``["aborted", ids, true]``, for an
  ``abort`` flagged as a pipeline replay's fence: :meth:`StageEngine.pipe_fence`);
- the ordered stop: a client's ``shutdown`` is applied in order, after everything sent
  before it (:class:`~._controls.Stop`); with a drain, new adds are refused while the live
  requests run to completion, and those still live at the drain's deadline are aborted,
  each with an ``error`` event, before the loop stops;
- sessions: when a client detaches, its live requests are aborted, in order after what it
  sent, and the outbox learns which session the loop's events belong to
  (:class:`~._controls.SessionChange`); a utility answer reaches only the session whose
  client made the call (:meth:`StageEngine.emit`).

The stage's controls (:mod:`._controls`) call the methods of :class:`StageEngine` that do
their work; nothing else reaches it but the loop's ``add``, ``abort``, ``utility`` and
``step`` (or ``launch`` / ``collect``).

Every other exception from the engine stays fatal to the loop (``docs/contract.md``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import compress
from typing import TYPE_CHECKING, Any, Final, Protocol

from .._engine import Engine, PipelinedEngine
from .._exceptions import LoopEndedError, RequestRejected
from .._loop import is_unapplied_answer
from .._messages import Event, Message
from . import _codec
from ._codec import only_types
from ._controls import DrainDeadline, StageTarget
from ._outbox import BACKLOG_MAX, StageOutput
from ._routing import make_router
from ._statistics import LoadReporter
from ._watchdog import StepWatchdog
from ._wire import DRAINING

if TYPE_CHECKING:
    from .._loop import EngineCoreLoop
    from ._fanout import Fanout
    from ._stage_session import CallTable

logger = logging.getLogger("enginecore.stage")


def submit_unless_ended(loop: EngineCoreLoop, message: Message) -> None:
    """``loop.submit(message)``, or nothing once the loop has ended (a timer, a signal's
    thread or the output thread may be late: the loop has nothing left to apply it to)."""
    with contextlib.suppress(LoopEndedError):
        loop.submit(message)


__all__ = [
    "DRAINING",
    "LIVE_IN_STAGE",
    "InputSide",
    "StageEngine",
    "drain_timed_out",
    "make_add",
    "make_collect",
    "make_launch",
    "make_step",
]

LIVE_IN_STAGE: Final = (
    "add refused: this request id is live in the stage (added, and not yet finished, "
    "aborted or ended by an error)"
)
"""The message of the ``error`` event for an ``add`` of a request id that is live."""


def drain_timed_out(seconds: float) -> str:
    """The message of the ``error`` event that ends a request still live at the drain's
    deadline."""
    return (
        f"aborted: the stage shut down; its drain timed out after {seconds:g} s "
        f"before this request finished"
    )


# -- the adapter --------------------------------------------------------------------------------


class InputSide(Protocol):
    """What a step needs of the stage's input queue (:class:`~._input_queue.InputQueue`):
    whether the loop still holds the input side, how to give it back, and what to do with
    it after a step."""

    holds: bool

    def release(self) -> None: ...

    def after_step(self, took: float) -> None: ...


class StageEngine:
    """*engine* with the stage's ``add``, ``step``, ``abort`` and ``utility``, the loop's
    ``emit``, and the methods the stage's controls call (:mod:`._controls`).

    ``has_work`` and ``utility`` are the engine's own bound methods, and ``add`` and
    ``step`` are closures (:func:`make_add`, :func:`make_step`), all stored as attributes,
    so the hot path pays no attribute lookup for the adapter. For a
    :class:`~enginecore.PipelinedEngine`, ``launch`` and ``collect`` (:func:`make_launch`,
    :func:`make_collect`) take ``step``'s place, and ``cancel`` is the engine's if it has
    one. Outputs of requests the stage has aborted, and that are not live again, are
    dropped and counted in :attr:`stale` (an engine that returned outputs after an abort).
    *abort_on_detach*: whether a session change aborts the requests live in the stage.
    *input_side*: the stage's input queue, which the loop reads between short steps, and
    gives back to the input thread after a long step or before a launch
    (:mod:`._input_queue`). *calls*: the utility calls the session has sent to the loop
    (:class:`~._stage_session.CallTable`), which :meth:`emit` answers.

    The drain (a ``shutdown`` with a drain time, or ``serve``'s SIGTERM with
    ``--drain-timeout``; :meth:`stop`): from the moment it is applied, an ``add`` is refused
    with an ``error`` event (:data:`DRAINING`), utilities are answered and aborts applied as
    usual. Once no request is live in the stage (finished, aborted, or ended by an error),
    the loop is asked to stop. At the deadline, the requests still live are aborted in the
    engine, each ends with an ``error`` event (:func:`drain_timed_out`), and the loop is
    asked to stop. A ``shutdown`` without a drain during a drain stops at once; a second
    drain can only bring the deadline closer.
    """

    def __init__(
        self,
        engine: Engine | PipelinedEngine[Any],
        outbox: StageOutput,
        *,
        calls: CallTable,
        abort_on_detach: bool = True,
        watchdog: StepWatchdog | None = None,
        input_side: InputSide,
        load_interval: float | None = None,
        clients: Fanout | None = None,
    ) -> None:
        # The request ids live in the stage: added (the engine's add() returned), and not
        # yet finished (an output routed with finished=True), aborted (abort() returned) or
        # ended by an error. A request that an output ended with an error before its last
        # output stays live until its DropEnded control is applied: until then the engine
        # still has it, and an add of its id queued before that control must be refused.
        # Loop thread only (make_add, make_step, abort): no lock.
        self.live: set[str] = set()
        self.drain = _Drain(self)
        self.stale = _Stale()
        self.counts = _Counts()
        self.reporter = None if load_interval is None else LoadReporter(load_interval, self.live)
        if self.reporter is not None:
            self.reporter.post = outbox.post_step  # its report on going idle
        self.has_work = engine.has_work
        self.utility = engine.utility
        stats = getattr(engine, "stats", None)
        if callable(stats):
            self.stats = stats  # the loop samples it (EngineCoreLoop.statistics)
        self.add, self.add_burst = make_add(
            engine,
            outbox,
            self.live,
            self.drain,
            admit=None if clients is None else clients.admitter(self.live),
        )
        # A pipelined engine gets the loop's launch/collect (and cancel, if it has one), an
        # Engine the loop's step: the loop drives whichever this adapter has.
        if isinstance(engine, PipelinedEngine):
            self.launch = make_launch(engine, outbox, watchdog, input_side)
            self.collect = make_collect(
                engine,
                outbox,
                self.live,
                self.drain,
                watchdog,
                self.stale,
                self.counts,
                self.reporter,
            )
            cancel = getattr(engine, "cancel", None)
            if callable(cancel):
                self.cancel = cancel
        else:
            self.step = make_step(
                engine,
                outbox,
                self.live,
                self.drain,
                watchdog,
                self.stale,
                input_side,
                self.counts,
                self.reporter,
            )
        # A pipeline's stage (_pipe_stage.PipeStage) has pipe_input, pipe_received,
        # pipe_credit, chase_abort, and attach_emit, through which it emits its credit
        # events.
        pipe_input = getattr(engine, "pipe_input", None)
        self._pipe_input: Callable[[int, str, Any], None] | None = (
            pipe_input if callable(pipe_input) else None
        )
        self._pipe_received: Callable[[int, int, int, int], None] | None = getattr(
            engine, "pipe_received", None
        )
        self._pipe_credit: Callable[[int, int, int], None] | None = getattr(
            engine, "pipe_credit", None
        )
        self._pipe_route: Callable[[list[str], list[list[Any]], bool], None] | None = getattr(
            engine, "pipe_route", None
        )
        # chase_abort(req_ids), or chase_abort(req_ids, True) for a replay's fence.
        self._chase_abort: Callable[..., None] | None = getattr(engine, "chase_abort", None)
        self._pipe_gone: Callable[[str, int, int, int | None], None] | None = getattr(
            engine, "pipe_gone", None
        )
        self._pipe_late: Callable[[str, int], None] | None = getattr(engine, "pipe_late", None)
        self._pipe_link: Callable[[int, str, str, str, int | None], None] | None = getattr(
            engine, "pipe_link", None
        )
        self._pipe_replay: Callable[[str], tuple[bool, str]] | None = getattr(
            engine, "pipe_replay", None
        )
        self._pipe_release: Callable[[list[str]], None] | None = getattr(
            engine, "pipe_release", None
        )
        attach_emit = getattr(engine, "attach_emit", None)
        if callable(attach_emit):
            attach_emit(outbox.emit)
        self._abort = engine.abort
        self._emit = outbox.emit
        self._outbox = outbox
        self._calls = calls
        self._abort_on_detach = abort_on_detach
        self.epoch = 0  # the session the loop's events belong to (the last SessionChange's)
        self._clients = clients
        if clients is not None:
            # A client that joins gets the stage's load at the next chance, as on a
            # one-client stage (change_session): the reports before it went to the others.
            clients.bind(
                self.live,
                self._drop,
                joined=None if self.reporter is None else self.reporter.resend,
            )

    def abort(self, req_ids: Sequence[str]) -> None:
        """The loop's ``abort``: the engine's, then an ``aborted`` event, ordered with the
        outputs, so none of the aborted requests' outputs follows it (and, in a pipeline's
        stage, the abort sent on to the next stage: ``chase_abort``). On a multi-client
        stage, only the sender's own requests are aborted (``Fanout.own``); the event still
        lists every id of the message."""
        self._drop(req_ids if self._clients is None else self._clients.own(req_ids))
        self._emit(("aborted", list(req_ids)))
        if self._chase_abort is not None:
            self._chase_abort(req_ids)

    def pipe_fence(self, req_ids: Sequence[str]) -> None:
        """:class:`~._controls.PipeFence`: an ``abort`` flagged as a replay's fence
        (``docs/wire.md`` section 8), applied as :meth:`abort` applies one, answered by an
        ``aborted`` event flagged the same, and chased on still flagged."""
        self._drop(req_ids if self._clients is None else self._clients.own(req_ids))
        self._emit(("aborted", list(req_ids), True))
        if self._chase_abort is not None:
            self._chase_abort(req_ids, True)

    def pipe_abort(self, req_ids: Sequence[str], tag: int) -> None:
        """:class:`~._controls.PipeAbort`: an ``abort`` the coordinator tagged
        (``docs/wire.md`` section 8, "Tagged aborts"), applied as :meth:`abort` applies one,
        answered by an ``aborted`` event with the same tag, and chased on still tagged."""
        self._drop(req_ids if self._clients is None else self._clients.own(req_ids))
        self._emit(("aborted", list(req_ids), False, tag))
        if self._chase_abort is not None:
            self._chase_abort(req_ids, False, tag)

    def _drop(self, req_ids: Sequence[str]) -> None:
        self._abort(req_ids)
        self.live.difference_update(req_ids)
        self.stale.aborted(req_ids)
        if self.drain.active and not self.live:
            self.drain.done()

    # -- what the controls call (loop thread) ----------------------------------------------

    def stop(self, drain: float | None, loop: EngineCoreLoop) -> None:
        """:class:`~._controls.Stop`: stop now (*drain* ``None``), or drain first."""
        if drain is None:
            self.drain.cancel()
            loop.request_shutdown()
        else:
            self.drain.start(drain, loop)

    def drain_deadline(self, timer: int) -> None:
        """:class:`~._controls.DrainDeadline`: the drain's timer *timer* fired."""
        self.drain.deadline(timer)

    def drop_ended(self, req_ids: Sequence[str]) -> None:
        """:class:`~._controls.DropEnded`: drop requests the stage ended with an error."""
        self._drop(req_ids)
        self._outbox.ended_dropped(list(req_ids))

    def pipe_input(
        self,
        kinds: list[int],
        req_ids: list[str],
        data: list[Any],
        received: tuple[int, int, int, int],
    ) -> None:
        """:class:`~._controls.PipeInput`: input from a pipeline's previous stage, item by
        item. An item that starts a request (*kinds* bit 0) is refused as an ``add`` would
        be (draining, live in the stage, :class:`~enginecore.RequestRejected`) and makes the
        request live; any other item is for a live request, and is dropped if the request
        is not live (it ended here, with an error or an abort, while the previous stage
        still sent); an ``END`` of such a request goes to the engine's ``pipe_late``, for
        a request that ended here before its input did. A
        :class:`~enginecore.RequestRejected` ends that request with an ``error`` event.
        Any other exception is fatal, as from ``add``. The engine is first
        told what the frame holds (*received*: items, bytes, the sender's replica index and its
        process's generation),
        for the credit it gives back to the stage that sent it, and so that it knows which
        process of the previous stage sent the items that follow."""
        pipe_input = self._pipe_input
        emit = self._emit
        if pipe_input is None:
            why = "pipe refused: this stage is not a pipeline's stage"
            for kind, rid in zip(kinds, req_ids, strict=True):
                if kind & 1:
                    emit(("error", rid, why))
            return
        if self._pipe_received is not None:
            self._pipe_received(*received)
        live, drain = self.live, self.drain
        for kind, rid, item in zip(kinds, req_ids, data, strict=True):
            if kind & 1:
                if rid in live or drain.active:
                    emit(("error", rid, DRAINING if drain.active else LIVE_IN_STAGE))
                    continue
                try:
                    pipe_input(kind, rid, item)
                except RequestRejected as exc:
                    emit(("error", rid, str(exc)))
                    continue
                live.add(rid)
            elif rid in live:
                try:
                    pipe_input(kind, rid, item)
                except RequestRejected as exc:
                    self._drop((rid,))
                    emit(("error", rid, str(exc)))
            elif kind & 2 and self._pipe_late is not None:
                self._pipe_late(rid, kind)  # its END, after the request ended here

    def pipe_credit(self, items: int, nbytes: int, replica: int = 0) -> None:
        """:class:`~._controls.PipeCredit`: the next stage (its *replica*) took what this
        one sent it."""
        if self._pipe_credit is not None:
            self._pipe_credit(items, nbytes, replica)

    def pipe_gone(
        self, side: str, late: int, replica: int = 0, generation: int | None = None
    ) -> None:
        """:class:`~._controls.PipeGone`: the stage before this one (*side* ``"previous"``,
        its process *replica* of *generation*) or after it (``"next"``, its *replica*) died;
        *late*: messages of the gone previous stage that the input side dropped."""
        if self._pipe_gone is not None:
            self._pipe_gone(side, late, replica, generation)

    def pipe_link(
        self, replica: int, address: str, slots: str, server_key: str, generation: int | None
    ) -> None:
        """:class:`~._controls.PipeLink`: replica *replica* of the next stage was started
        again at *address* (with CURVE, *server_key*, if not ``""``), as its *generation*
        (``None``: not said)."""
        if self._pipe_link is not None:
            self._pipe_link(replica, address, slots, server_key, generation)

    def pipe_route(self, req_ids: list[str], routes: list[list[Any]], abort: bool) -> None:
        """:class:`~._controls.PipeRoute`: the routes of requests through the replica pools
        after this stage (*abort*: for the abort that follows)."""
        if self._pipe_route is not None:
            self._pipe_route(req_ids, routes, abort)

    def pipe_replay(self, req_id: str, attempt: int) -> None:
        """:class:`~._controls.PipeReplay`: the next stage failed *req_id*: the engine's
        wrapper aborts it down the link and sends its logged inputs again, and a
        ``replayed`` event answers, naming *attempt*."""
        if self._pipe_replay is None:
            ok, why = False, "this stage is not a pipeline's stage"
        else:
            ok, why = self._pipe_replay(req_id)
        self._emit(("replayed", req_id, attempt, ok, why))

    def pipe_release(self, req_ids: list[str]) -> None:
        """:class:`~._controls.PipeRelease`: *req_ids* are done; their replay logs go."""
        if self._pipe_release is not None:
            self._pipe_release(req_ids)

    def change_session(self, epoch: int | None, *, abort: bool = False) -> None:
        """:class:`~._controls.SessionChange`: the previous client is gone (*abort*: its
        live requests are aborted even on a stage that keeps them: its key was revoked)."""
        # Every request live now was added by the client that is leaving (or by a peer that
        # sent without a session): with abort_on_detach, every detach empties the set.
        if (self._abort_on_detach or abort) and self.live:
            ids = list(self.live)
            logger.info("enginecore: a client detached; aborting its %d live requests", len(ids))
            self._drop(ids)
        if epoch is not None:
            self.epoch = epoch
            self._outbox.loop_epoch(epoch)
            if self.reporter is not None:
                # No report made before reached the new client (dropped while it was being
                # welcomed, or gone to the one before it): the next chance sends one.
                self.reporter.resend()

    def emit(self, event: Event) -> None:
        """The loop's ``emit``: utility answers and the terminal event (never an
        ``output``: :func:`make_step` hands a step's outputs over itself). A utility answer
        goes out under its caller's call id, and only to the session that made the call:
        the answer to a call whose client has since been replaced (a deferred utility that
        completed after the new session began) is dropped."""
        if event[0] == "utility":
            if is_unapplied_answer(event):
                return  # as the stage ends, its own way: EngineDeadError if it died
            call = self._calls.close(event[1])
            if call is None or call[0] != self.epoch:
                return
            event = ("utility", call[1], event[2], event[3])
        self._emit(event)

    def emit_routed(self, event: Event) -> None:
        """The loop's ``emit`` on a multi-client stage (*clients* given): a utility answer
        goes to the session that made the call, if it is still attached (``Fanout.answer``);
        anything else as :meth:`emit`."""
        if event[0] == "utility":
            if is_unapplied_answer(event):
                return  # as in emit()
            call = self._calls.close(event[1])
            if call is not None and self._clients is not None:
                self._clients.answer(call[0], ("utility", call[1], event[2], event[3]))
            return
        self._emit(event)


class _Drain:
    """The drain of one :class:`StageEngine` (its docstring has the rules). Loop thread
    only, except the timer, which only queues its :class:`~._controls.DrainDeadline`."""

    def __init__(self, stage: StageEngine) -> None:
        self._stage = stage
        self.active = False  # read by make_add's and make_step's closures
        self._seconds = 0.0
        self._deadline_at = 0.0
        self._timer: threading.Timer | None = None
        self._timers = 0  # numbers the timers: a DrainDeadline names the one that queued it
        self._loop: EngineCoreLoop | None = None

    def start(self, seconds: float, loop: EngineCoreLoop) -> None:
        stage = self._stage
        now = time.monotonic()
        if self.active:
            if now + seconds >= self._deadline_at:
                return  # a second drain only brings the deadline closer
            self.cancel()
        self.active = True
        self._loop = loop
        self._seconds = seconds
        self._deadline_at = now + seconds
        logger.info(
            "enginecore: draining: %d live requests, at most %g s", len(stage.live), seconds
        )
        if not stage.live:
            self.done()
            return
        self._timers += 1
        # At most TIMEOUT_MAX (292 years): a longer drain (any client may ask for 1e300 s)
        # raised OverflowError in the timer's thread, and the drain never ended.
        wait = min(seconds, threading.TIMEOUT_MAX)
        timer = threading.Timer(wait, submit_unless_ended, (loop, DrainDeadline(self._timers)))
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
        if self._loop is not None:
            self._loop.request_shutdown()

    def deadline(self, timer: int) -> None:
        if not self.active or self._timer is None or timer != self._timers:
            return  # stale: the drain ended, or a closer deadline replaced it
        stage = self._stage
        ids = list(stage.live)
        if ids:
            stage._drop(ids)
            message = drain_timed_out(self._seconds)
            stage._outbox.post_step([("error", rid, message) for rid in ids], len(ids))
            logger.warning(
                "enginecore: the drain timed out after %g s; aborted %d live requests",
                self._seconds,
                len(ids),
            )
        self.done()


def make_add(
    engine: Engine | PipelinedEngine[Any],
    outbox: StageOutput,
    live: set[str],
    drain: _Drain,
    *,
    admit: Callable[[str], None] | None = None,
) -> tuple[Callable[[str, Any], None], Callable[[list[str], list[Any]], None]]:
    """The loop's ``add``, and the same for a burst (:class:`~._controls.AddBurst`):
    request-scoped failure around *engine*'s ``add``.

    During a *drain* an add is refused with an ``error`` event (:data:`DRAINING`). An id in
    *live* is refused with an ``error`` event (:data:`LIVE_IN_STAGE`), and the engine is not
    called: two clients of a ``serve`` stage (or one raw client) cannot make the engine see
    an id twice. A :class:`~enginecore.RequestRejected` from the engine becomes an
    ``error`` event carrying ``str(exc)``, and the id stays free. Either error is the
    request's only event, ordered with the loop's others. Any other exception propagates:
    fatal to the loop (the rest of a burst is not applied). On success the id joins
    *live* (through *admit*, if given: a multi-client stage also records the sender as the
    request's owner, ``Fanout.admitter``). A burst is applied item by item, the same way.
    """
    engine_add = engine.add
    emit = outbox.emit
    admit_ = live.add if admit is None else admit

    def add_burst(req_ids: Sequence[str], data: Sequence[Any]) -> None:
        for rid, item in zip(req_ids, data, strict=True):
            if rid in live or drain.active:
                emit(("error", rid, DRAINING if drain.active else LIVE_IN_STAGE))
                continue
            try:
                engine_add(rid, item)
            except RequestRejected as exc:
                emit(("error", rid, str(exc)))
                continue
            admit_(rid)

    def add(req_id: str, data: Any) -> None:
        # One body for both: a lone add pays a call and two 1-tuples (~0.1 µs).
        add_burst((req_id,), (data,))

    return add, add_burst


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


class _Counts:
    """The stage's own counts, kept by the loop thread, read by any thread."""

    __slots__ = ("outputs",)

    def __init__(self) -> None:
        self.outputs = 0  # handed to the output thread (after stale outputs are dropped)


def _make_handle_outputs(
    engine: Engine | PipelinedEngine[Any],
    outbox: StageOutput,
    live: set[str],
    drain: _Drain,
    stale: _Stale,
    watchdog: StepWatchdog | None,
    counts: _Counts | None = None,
    reporter: LoadReporter | None = None,
    has_work: Callable[[], bool] | None = None,
    what: str = "step",
) -> Callable[[Callable[[], Iterable[Any]]], None]:
    """``handle(produce)``: call *produce* (the engine's ``step``, or a ``collect`` of one
    handle) under the *watchdog*, route its outputs on the loop thread (before the engine
    can reuse one), drop those of requests aborted and not live again (*stale*), and post
    the rest to *outbox* as **one** ``outputs`` event, with a load report from *reporter*
    when one is due, or on the last step before the loop idles after a report
    (:mod:`._statistics`). With *has_work* (the engine's, for a step), a
    step after which the engine has no more work is the last before the loop idles: its
    event is sent by the loop thread itself when the output thread is idle
    (``Outbox.post_step(last=True)``), instead of waking that thread for it. An exception
    in *produce* or in routing
    propagates (fatal), and what was routed before it is still sent first. A request's
    output routed with ``finished=True`` takes its id out of *live*, as does one a
    pipeline's stage ended without an output (its ``take_ended``); during a *drain*, the
    step that leaves *live* empty ends it. *produce* returning something that is not
    iterable is a :class:`TypeError` that names the engine's method (*what*: ``step`` or
    ``collect``), fatal like any other mistake of the engine's."""
    route = make_router(engine)
    method = f"{type(engine).__name__}.{what}()"
    # A pipeline's stage gives back credit after each step, in the step's frame.
    take_credit: Callable[[], Any] | None = getattr(engine, "take_credit", None)
    # ... and ends some requests without an output (those it sent on: its END tells the
    # next stage, which reports the end to the coordinator): they leave *live* too.
    take_ended: Callable[[], list[str]] | None = getattr(engine, "take_ended", None)
    emit = outbox.emit if take_credit is not None else None
    post = outbox.post_step
    prepare_outputs = outbox.prepare_outputs
    flat = _codec.FLAT_TYPES
    forget = live.difference_update
    superset = live.issuperset
    recent = stale.recent  # the same dict for the life of the stage
    clock = time.perf_counter  # the loop's clock: a report's sample is also the loop's
    if counts is None:
        counts = _Counts()

    def handle(produce: Callable[[], Iterable[Any]]) -> None:
        rids: list[Any] = []
        fins: list[Any] = []
        payloads: list[Any] = []
        try:
            if watchdog is not None:
                watchdog.begin()
                try:
                    outs = produce()
                    if outs.__class__ is not list:
                        outs = _iterable(outs, method)
                    route(outs, rids, fins, payloads)
                finally:
                    watchdog.end()
            else:
                outs = produce()
                if outs.__class__ is not list:
                    outs = _iterable(outs, method)
                route(outs, rids, fins, payloads)
        finally:
            # Once the stage has aborted anything: in C, ~10 ns per output, the outputs of
            # requests not live are looked at further, for an abort the engine lost.
            if payloads and recent and not superset(rids):
                stale.drop(live, rids, fins, payloads)
            quiet = None if take_ended is None else take_ended()
            if quiet:
                forget(quiet)
            credit = None if take_credit is None else take_credit()
            if credit is not None and not payloads and emit is not None:
                emit(credit)
            # One hand-over per step (Outbox.post_step: a big step is sent at once while
            # the output thread idles, a small one queued to share a frame).
            if payloads:
                n = len(payloads)
                counts.outputs += n
                last = has_work is not None and not has_work()
                # The requests this step finished leave *live* before a report is sampled:
                # a report says what is live after the step, as the client counts its own
                # requests once the step's outputs are in. Both loops in C: ~2 ns per
                # output, ~20 ns more per finished one.
                finished = any(fins)
                if finished:
                    forget(compress(rids, fins))
                # One clock read per step with outputs: a load report rides on at most one
                # step's outputs every interval, and on the last step before the loop
                # idles if a report went out since the previous idle one (a router must not
                # keep the busy stage's last load while it sends nothing).
                report = None
                if reporter is not None:
                    now = clock()
                    if now >= reporter.next_at or (last and not reporter.idle_reported):
                        report = reporter.report(now, idle=last)
                # Fast path: every payload of an exact flat type (an out-of-range int is
                # caught when msgspec refuses it, in the output thread).
                events: list[tuple[Any, ...]]
                if only_types(payloads, flat):
                    if report is None:
                        events = [("outputs", rids, fins, payloads)]
                    else:
                        events = [("outputs", rids, fins, payloads, report)]
                else:
                    events = prepare_outputs(rids, fins, payloads)
                    if report is not None and events[0][0] == "outputs":
                        events[0] = (*events[0], report)
                if credit is not None:
                    events.append(credit)
                post(events, n, last)
                if finished and drain.active and not live:
                    drain.done()
            if quiet and drain.active and not live:
                drain.done()

    return handle


def _iterable(outs: Any, method: str) -> Iterable[Any]:
    """*outs*, what the engine's *method* returned, if it is iterable; else the
    :class:`TypeError` that says so (not the bare ``'NoneType' object is not iterable`` of
    the routing's ``for``). A ``str``, ``bytes`` or mapping is refused too: iterable,
    but not a collection of outputs (``return {rid: token}`` would route its keys)."""
    if isinstance(outs, (str, bytes, bytearray, Mapping)):
        # Iterable, but its items (characters, keys) are no outputs: a request would never
        # see its own, and nothing would say why.
        raise TypeError(
            f"{method} must return a list of outputs, got a {type(outs).__name__} "
            f"({_shown(outs)}): its items would be taken for the outputs"
        )
    try:
        iter(outs)
    except TypeError:
        raise TypeError(
            f"{method} must return an iterable of outputs (a list), got {_shown(outs)}"
        ) from None
    return outs  # type: ignore[no-any-return]


def _shown(value: object) -> str:
    """``repr(value)``, cut at 200 characters, or its type's name if ``repr`` raises."""
    try:
        return f"{value!r:.200}"
    except Exception:
        return f"<{type(value).__qualname__} whose repr() raised>"


def make_step(
    engine: Engine,
    outbox: StageOutput,
    live: set[str],
    drain: _Drain,
    watchdog: StepWatchdog | None,
    stale: _Stale,
    input_side: InputSide,
    counts: _Counts | None = None,
    reporter: LoadReporter | None = None,
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
    handle = _make_handle_outputs(
        engine, outbox, live, drain, stale, watchdog, counts, reporter, engine.has_work
    )
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
    outbox: StageOutput,
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
    outbox: StageOutput,
    live: set[str],
    drain: _Drain,
    watchdog: StepWatchdog | None,
    stale: _Stale,
    counts: _Counts | None = None,
    reporter: LoadReporter | None = None,
) -> Callable[[Any], tuple[()]]:
    """The loop's ``collect(handle)`` for a pipelined engine: the engine's collect of that
    handle, handled as a step is (:func:`_make_handle_outputs`); returns nothing to the
    loop."""
    handle_outputs = _make_handle_outputs(
        engine, outbox, live, drain, stale, watchdog, counts, reporter, what="collect"
    )
    engine_collect = engine.collect

    def collect(handle: Any) -> tuple[()]:
        handle_outputs(lambda: engine_collect(handle))
        return ()

    return collect


if TYPE_CHECKING:

    def _is_a_target(engine: StageEngine) -> StageTarget:
        return engine  # mypy checks that the adapter has what the controls call
