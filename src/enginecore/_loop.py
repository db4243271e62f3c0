"""EngineCoreLoop: the busy loop of a stage process.

The whole contract lives in this file (``docs/contract.md`` restates it with the test that
proves each rule):

1. Idle means blocked: with no work the loop blocks in ``input_queue.get()``, no timeout.
   It holds no message it applied, nor an output it emitted, while it waits.
2. The message taken by that blocking ``get()`` is processed like any other.
3. Before every step, every message already queued is applied, in queue order.
4. The drain is bounded: it takes a snapshot of what is queued when it begins.
5. Dispatch: Add -> ``engine.add``, Abort -> ``engine.abort``, Utility -> ``engine.utility``
   (``args`` as one tuple), Wakeup -> nothing, Control -> ``apply(engine, loop)`` (rule 18);
   anything else is logged and skipped.
6. After the drain: if shutdown was requested, stop without stepping; otherwise step only if
   ``has_work()`` is still true.
7. Events are tuples: ``("output", out)``, ``("utility", call_id, result, err)``,
   ``("shutdown",)``, ``("fatal", repr(exc))``; exactly one of the last two ends every run.
8. Utility exceptions are reported and the loop goes on; any other exception is fatal.
   Messages still queued then, or left of the drain it cut short, are never applied
   (their utilities are answered: rule 17).
9. ``request_shutdown()`` sets the flag *and* enqueues a Wakeup; idempotent, never waits.
   Called before ``run()``, that run applies nothing (rule 17 answers its utilities).
10. ``request_shutdown()`` never takes the queue's mutex in a way that could deadlock when it
    runs inside a signal handler.
11. Single writer: only the thread in ``run()`` touches the engine.

Pipelined engines (``PipelinedEngine``: ``launch() -> handle``, ``collect(handle)``) at
``pipeline_depth`` *d*:

12. *d* >= 1 (else ``ValueError``); *d* > 1 needs a PipelinedEngine (else ``TypeError``). A
    PipelinedEngine is driven through launch/collect at every depth; an Engine through
    ``step()``, on its own loop, exactly as rules 1-11 say.
13. Every message already queued is applied (rules 3-5) before every launch and every
    collect, so an abort queued before a collect begins reaches the engine before it.
14. After that drain: if fewer than *d* handles are in flight and ``has_work()``, launch;
    else, if any is in flight, collect the oldest (the blocking call: the loop never blocks
    on the input queue while a handle is in flight); else block in ``get()`` (rule 1).
    Handles are collected in launch order, each exactly once; one output event per output.
15. Shutdown: nothing is launched once the loop has seen it; every handle in flight is
    still collected (each after a drain) and its outputs emitted before ``("shutdown",)``.
16. An exception from ``launch`` or ``collect`` is fatal like one from ``step``. The handles
    not yet collected are released first: ``engine.cancel(handle)`` once each, in launch
    order, if the engine has it; then ``("fatal", ...)``.

Deferred utilities:

17. ``engine.utility`` may return a ``concurrent.futures.Future``; the loop never waits on
    it. Its done-callback (any thread) puts a message on ``input_queue``, and the loop
    answers the call when it applies that message, in order with its other events. A future
    still pending when the loop ends is answered with an error (``LoopEndedError``) before
    the last event; so is, after them, every ``Utility`` message never applied: those
    left of a drain a fatal error cut short, then those still queued (taken under the
    queue's mutex; the other messages stay queued, unapplied).
    From then on ``submit()``/``submit_many()`` raise ``LoopEndedError``.

Controls:

18. A ``Control`` message's ``apply(engine, loop)`` is called once, on the loop's thread, in
    queue order (rules 3-5, 13), with the loop's engine and the loop itself. An exception
    from it is fatal, like one from ``add`` (rules 8, 16). Ordinary messages pay nothing
    for it: it is dispatched after the four plain types.

Statistics:

19. ``statistics()`` may be called from any thread at any time and never waits for the loop,
    a step or the queue's mutex. Once the loop has emitted its last event, its counts are
    exact (``_stats.py`` says how steps are timed). The engine's optional ``stats()`` is
    called only on the loop's thread; an exception from it is logged and counted, never
    fatal.
"""

from __future__ import annotations

import contextlib
import dis
import logging
import os
import queue
import threading
import time
import types
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import CancelledError, Future
from typing import Any, cast

from ._engine import Engine, PipelinedEngine
from ._exceptions import LoopAlreadyRunError, LoopEndedError, describe, str_or_nothing
from ._messages import Abort, Add, Control, Event, Message, Utility, UtilityEvent, Wakeup
from ._stats import LoopStatistics, StepTimer, _Counters

__all__ = ["EngineCoreLoop"]

logger = logging.getLogger("enginecore")

_WAKEUP = Wakeup()
_MESSAGE_TYPES = (Add, Abort, Utility, Wakeup, Control)
_ENGINE_METHODS = ("has_work", "add", "abort", "utility", "step")
_PIPELINED_METHODS = ("has_work", "add", "abort", "utility", "launch", "collect")


class _UnappliedAnswer(tuple):  # type: ignore[type-arg]
    """The loop's answer to a ``Utility`` it ended without applying (rule 17):
    ``("utility", call_id, None, repr(LoopEndedError(...)))``, a tuple equal to that one,
    whose fields are the same plain values (its error text a plain ``str``), told apart
    from any other answer by its type alone, never by what its text says: a utility of the
    engine's own may raise a ``LoopEndedError`` that reads the same, and its answer must
    still go out. The mark lives in this process only: pickled, it is a plain tuple."""

    __slots__ = ()

    def __reduce__(self) -> tuple[type[tuple[Any, ...]], tuple[tuple[Any, ...]]]:
        return (tuple, (tuple(self),))


def is_unapplied_answer(event: Event) -> bool:
    """Whether *event* is the loop's answer to a ``Utility`` it ended without applying
    (rule 17): a stage answers those calls itself, as its process ends. Told by the
    event's type (:class:`_UnappliedAnswer`), which only the loop makes."""
    return type(event) is _UnappliedAnswer


def _ended_error(message: object) -> LoopEndedError:
    return LoopEndedError(
        f"the engine loop has ended: it applies no more messages, so this "
        f"{type(message).__name__} was not queued"
    )


def _outputs_not_iterable(exc: BaseException, method: str) -> BaseException:
    """*exc*, or, if it is the ``TypeError`` of iterating what ``engine.<method>()``
    returned (a forgotten ``return``: None), one that names the method, chained to it.

    Told apart without a cost on the hot path: that error is raised in the loop's own frame
    (the ``for`` over the result), so its traceback ends there; one raised inside the
    engine has the engine's frames after it.
    """
    tb = exc.__traceback__
    if type(exc) is TypeError and tb is not None and tb.tb_next is None:
        text = str_or_nothing(exc)
        if text.endswith("object is not iterable"):
            named = TypeError(f"engine.{method}() must return an iterable of outputs: {text}")
            named.__cause__ = exc
            return named.with_traceback(tb)
    return exc


_TRUTH_TESTS = frozenset(
    op
    for name, op in dis.opmap.items()
    if name in {"TO_BOOL", "UNARY_NOT"} or "_IF_FALSE" in name or "_IF_TRUE" in name
)
"""The opcodes that test a value's truth (they differ between Python versions)."""


def _has_work_not_bool(exc: BaseException, has_work: Callable[[], object]) -> BaseException:
    """*exc*, or, if it was raised by the loop's own truth test of what ``has_work()``
    returned (an object with no truth value: a numpy array of several elements), a
    ``TypeError`` that names ``has_work`` and the result's type, chained to it.

    Told apart on the fatal path only: the loop's frame (the first of the traceback) was at
    a truth test, and the only value of the engine's that a run loop tests is ``has_work()``'s
    result (the loop's other tests are of its own ints, flags and containers). One raised
    inside ``has_work`` leaves the loop's frame at the call instead. The result is gone by
    then: its type is learnt from one more ``has_work()`` call, and left out if that fails.
    """
    tb = exc.__traceback__
    if not isinstance(exc, Exception) or tb is None:
        return exc
    code = tb.tb_frame.f_code.co_code
    if not 0 <= tb.tb_lasti < len(code) or code[tb.tb_lasti] not in _TRUTH_TESTS:
        return exc
    try:
        kind = type(has_work())
    except Exception:
        what = "its result "
    else:
        name = kind.__qualname__
        if kind.__module__ != "builtins":
            name = f"{kind.__module__}.{name}"
        what = f"its result, a {name}, "
    named = TypeError(
        f"engine.has_work() must return a bool: {what}has no truth value "
        f"({type(exc).__name__}: {str_or_nothing(exc)})"
    )
    named.__cause__ = exc
    return named.with_traceback(tb)


class _Deferred:
    """A deferred utility call: its ``Utility`` message's id and name, and the future.

    It is also the internal ``input_queue`` message that says the future is done: as the
    future's done-callback it puts itself on the queue (from whichever thread completed the
    future, or from the loop's own thread if the future was already done), and the loop
    answers the call when it applies it, in order with everything else. Hashed by identity:
    the loop keeps the pending ones in a dict, so each call is answered once. Once the loop
    has ended it (:meth:`EngineCoreLoop._abandon_deferred`, under the queue's mutex), the
    callback queues nothing: nobody reads the queue any more.
    """

    __slots__ = ("abandoned", "call_id", "future", "name", "queue")

    def __init__(self, call_id: int, name: str, future: Future[Any], q: queue.Queue[Any]) -> None:
        self.call_id = call_id
        self.name = name
        self.future = future
        self.queue = q
        self.abandoned = False

    def __call__(self, future: Future[Any]) -> None:
        # The done-callback. What Queue.put does (the queue is unbounded; a put wakes a loop
        # blocked in get()), plus the check, under the mutex as submit()'s is, so that the
        # message either lands before the loop abandons the call or not at all. Never
        # called with the mutex held: the loop's own code holds it only to snapshot or end
        # the deque, and a queue subclass's get() (the stage's) holds it only for its own
        # bookkeeping; none of them completes a future.
        q = self.queue
        with q.mutex:
            if self.abandoned:
                return
            q.queue.append(self)
            q.unfinished_tasks += 1
            q.not_empty.notify()

    def answer(self) -> UtilityEvent:
        """The ``"utility"`` event for the done future. Never blocks."""
        future = self.future
        if future.cancelled():
            err = CancelledError(
                f"the future of utility {self.name!r:.200} (call {self.call_id}) was cancelled"
            )
            return ("utility", self.call_id, None, repr(err))
        exc = future.exception(timeout=0)
        if exc is not None:
            return ("utility", self.call_id, None, describe(exc))
        return ("utility", self.call_id, future.result(timeout=0), None)


class EngineCoreLoop:
    """Runs ``schedule -> execute -> update`` (``engine.step()``) for one stage.

    *engine* is driven only from the thread that calls :meth:`run`. *emit* receives every
    event, on that same thread, in order; it should hand events off (for example to an output
    queue) rather than do slow work.

    *engine* is an :class:`~enginecore.Engine` (``step()``), or a
    :class:`~enginecore.PipelinedEngine` (``launch()`` / ``collect(handle)``), which the loop
    keeps up to *pipeline_depth* steps in flight for: while the device runs step *n+1*, the
    loop collects and post-processes step *n*. It is checked on construction: an object that
    lacks one of the methods, has one that is not callable, or is a class rather than an
    instance, is a :class:`TypeError`. *pipeline_depth* must be at least 1
    (:class:`ValueError`), and above 1 only a PipelinedEngine can use it (:class:`TypeError`).
    An Engine runs exactly as it always has.

    Producers (IO threads) put :data:`~enginecore.Message` objects on :attr:`input_queue`, or
    call :meth:`submit`. Any thread, or a signal handler, may call :meth:`request_shutdown`.

    *input_queue*, if given, is the queue to use instead of a new :class:`queue.Queue`: an
    empty, unbounded, FIFO ``queue.Queue`` or subclass (:class:`TypeError` /
    :class:`ValueError` otherwise: a ``LifoQueue`` or ``PriorityQueue`` is refused). The loop
    calls its ``get()``, with no arguments, only while idle (rule 1), and otherwise takes
    messages from its deque under its ``mutex``. A subclass may override ``get()`` to wait
    for more than the queue, as long as it returns the next message once one is queued: a
    put from any thread (``Queue.put``, :meth:`submit`, :meth:`request_shutdown`) ends in
    ``not_empty.notify()`` under ``mutex``, which it can hook. A stage's queue reads its
    input socket there (``docs/stage.md``).

    Errors: an exception from ``engine.utility`` becomes that call's ``"utility"`` event and the
    loop goes on (any but ``KeyboardInterrupt``/``SystemExit``: an
    ``asyncio.CancelledError`` too); so does a future it returned that fails or is
    cancelled. An exception from ``has_work``, ``add``, ``abort``, ``step``, ``launch``,
    ``collect`` or from *emit* itself is fatal: it is logged with its traceback (a
    ``KeyboardInterrupt``: one warning line, no traceback), the handles
    still in flight are cancelled (if the engine has ``cancel``), every deferred utility
    still pending, and every ``Utility`` not applied (still queued, or left of the drain
    that failed), is answered with an error
    (:class:`~enginecore.LoopEndedError`), ``("fatal", repr(exc))`` is emitted and
    :meth:`run` returns. If emitting the final event itself fails (``("fatal", ...)`` or
    ``("shutdown",)``), :meth:`run` raises that exception, chained to the first one if any,
    so the failure can never pass unnoticed. One that is not an ``Exception``
    (``KeyboardInterrupt``, ``SystemExit``, ``GeneratorExit``, an ``asyncio.CancelledError``,
    any other ``BaseException``) is reported the same way and then re-raised. An exception
    whose ``repr()`` raises is reported with a stand-in naming its type.
    """

    # Concurrency invariants:
    # - _engine and _emit are touched only by the thread inside run() (single writer).
    # - _shutdown goes False -> True once and never back. Writers: request_shutdown() from any
    #   thread or a signal handler. Reader: the loop, after each drain. Setting it before the
    #   Wakeup is enqueued means whoever wakes up already sees it.
    # - input_queue.mutex guards input_queue.queue. The loop's own code holds it only to
    #   snapshot-and-clear the deque (bounded, O(n) memcpy); a queue subclass may also hold
    #   it on the loop thread, in its get() (the stage's InputQueue does, briefly, in get()
    #   and after_step()). request_shutdown() only ever *tries* to take it.
    # - _token is b"" until run() registers input_queue with the process-wide waker, then an
    #   8-byte id; run() unregisters it on the way out, so a late token is simply ignored.
    # - _deferred (the deferred utility calls not answered yet) is the loop thread's only:
    #   other threads reach the loop through the _Deferred they put on input_queue.

    __slots__ = (
        "__weakref__",
        "_cut",
        "_deferred",
        "_depth",
        "_emit",
        "_ended",
        "_engine",
        "_pipelined",
        "_run_lock",
        "_shutdown",
        "_started",
        "_stats",
        "_timer",
        "_token",
        "_unanswered",
        "input_queue",
    )

    def __init__(
        self,
        engine: Engine | PipelinedEngine[Any],
        emit: Callable[[Event], object],
        *,
        pipeline_depth: int = 1,
        input_queue: queue.Queue[Any] | None = None,
    ) -> None:
        if isinstance(engine, type):
            # Its methods are plain functions: it would pass the protocol check below, and
            # the first call in run() would fail for want of self.
            raise TypeError(
                f"engine must be an engine instance, got the class {engine.__name__}; "
                f"write {engine.__name__}()"
            )
        pipelined = isinstance(engine, PipelinedEngine)
        if not pipelined and not isinstance(engine, Engine):
            two_phase = hasattr(engine, "launch") or hasattr(engine, "collect")
            protocol = "PipelinedEngine" if two_phase else "Engine"
            names = _PIPELINED_METHODS if two_phase else _ENGINE_METHODS
            missing = [name for name in names if not callable(getattr(engine, name, None))]
            raise TypeError(
                f"engine must implement the enginecore.{protocol} protocol; "
                f"{type(engine).__name__} lacks {', '.join(missing)}"
            )
        # The protocols' isinstance() only looks for the names: a property or an attribute
        # by a method's name passes it, and would fail at the first call, in run().
        for name in _PIPELINED_METHODS if pipelined else _ENGINE_METHODS:
            method = getattr(engine, name)
            if not callable(method):
                raise TypeError(
                    f"engine.{name} must be a method, got {type(method).__name__} "
                    f"({type(engine).__name__}.{name} is not callable)"
                )
        if not callable(emit):
            raise TypeError(f"emit must be callable, got {type(emit).__name__}")
        if isinstance(pipeline_depth, bool) or not isinstance(pipeline_depth, int):
            raise TypeError(f"pipeline_depth must be an int, got {type(pipeline_depth).__name__}")
        if pipeline_depth < 1:
            raise ValueError(f"pipeline_depth must be >= 1, got {pipeline_depth}")
        if pipeline_depth > 1 and not pipelined:
            raise TypeError(
                f"pipeline_depth={pipeline_depth} needs an enginecore.PipelinedEngine "
                f"(launch() and collect(handle)); {type(engine).__name__} has only step()"
            )
        if input_queue is None:
            input_queue = queue.Queue()
        elif not isinstance(input_queue, queue.Queue):
            raise TypeError(f"input_queue must be a queue.Queue, got {type(input_queue).__name__}")
        elif (
            not isinstance(input_queue.queue, deque)
            or type(input_queue)._get is not queue.Queue._get
            or type(input_queue)._put is not queue.Queue._put
        ):
            # The loop takes messages from the deque's left and appends to its right (rules
            # 3, 9): a LifoQueue's or PriorityQueue's get() would reorder them.
            raise TypeError(
                f"input_queue must be a FIFO queue.Queue (a subclass may override get(), not "
                f"_get()/_put() or its deque), got {type(input_queue).__name__}"
            )
        elif input_queue.maxsize > 0:
            # A bounded queue would block submit() and request_shutdown()'s waker.
            raise ValueError(f"input_queue must be unbounded, got maxsize={input_queue.maxsize}")
        elif input_queue.qsize():
            raise ValueError("input_queue must be empty")
        self._engine = engine
        self._emit = emit
        self._pipelined = pipelined
        self._depth = pipeline_depth
        self.input_queue: queue.Queue[Any] = input_queue
        """The loop's input. Producers ``put()`` messages here, in the order they must apply.

        The loop owns it: do not ``get()`` from it, and do not replace it.
        """
        self._shutdown = False
        self._ended = False
        self._cut: tuple[list[Any] | tuple[Any], object] | None = None
        self._started = False
        self._run_lock = threading.Lock()
        self._token = b""
        self._deferred: dict[_Deferred, None] = {}
        # The Utility messages the end took off the queue and has not answered yet (rule 17).
        self._unanswered: deque[Utility] = deque()
        self._stats = _Counters()
        self._timer = StepTimer(self._stats, engine)

    @property
    def pipeline_depth(self) -> int:
        """How many steps may be in flight at once (1: a step is collected before the next
        launches). Never blocks."""
        return self._depth

    # -- producer side -----------------------------------------------------------------------

    def submit(self, message: Message) -> None:
        """Queue *message* for the loop: ``input_queue.put(message)``, with a type check.

        Raises :class:`TypeError` for an object that is not a message. Never blocks (the queue
        is unbounded); thread-safe; **not** safe in a signal handler (use
        :meth:`request_shutdown` there). A message submitted after :meth:`request_shutdown`
        is applied if it lands before the loop's next drain takes its snapshot (rule 6: the
        loop drains, then sees the flag), and never otherwise. Once the loop has ended (it
        emitted its last event, or is about to) it raises
        :class:`~enginecore.LoopEndedError` and queues nothing: what it would queue could
        never be applied, nor a ``Utility`` answered (rule 17).
        """
        if not isinstance(message, _MESSAGE_TYPES):
            raise TypeError(
                f"submit() takes Add, Abort, Utility, Wakeup or a Control, "
                f"got {type(message).__name__}"
            )
        q = self.input_queue
        with q.mutex:
            # What Queue.put does (the queue is unbounded), plus the check: under the mutex,
            # so a message either lands before the loop's last snapshot (_end_input) or is
            # refused, never queued behind it.
            if self._ended:
                raise _ended_error(message)
            q.queue.append(message)
            q.unfinished_tasks += 1
            q.not_empty.notify()

    def submit_many(self, messages: Iterable[Message]) -> None:
        """Queue *messages*, in order, as one burst: one lock and one wake-up of the loop.

        For an IO thread that has read several messages at once: ``put()`` for each would
        wake the loop (and contend for the mutex) once per message. The messages land together,
        so the loop applies them in the same drain. All are type-checked first; a
        :class:`TypeError` queues none of them. Never blocks (the queue is unbounded);
        thread-safe; **not** safe in a signal handler. Once the loop has ended it raises
        :class:`~enginecore.LoopEndedError` and queues none of them, as :meth:`submit` does.
        """
        try:
            batch = list(messages)
        except TypeError:
            if isinstance(messages, Iterable):
                raise  # from the iterable itself
            raise TypeError(
                f"submit_many() takes an iterable of messages (a list), got "
                f"{type(messages).__name__}; submit() queues one message"
            ) from None
        for message in batch:
            if not isinstance(message, _MESSAGE_TYPES):
                raise TypeError(
                    f"submit_many() takes Add, Abort, Utility, Wakeup or a Control, "
                    f"got {type(message).__name__}"
                )
        if not batch:
            return
        q = self.input_queue
        with q.mutex:
            if self._ended:
                raise _ended_error(batch[0])
            # What len(batch) calls of Queue.put would do, with a single notify: the loop is
            # the queue's only consumer.
            q.queue.extend(batch)
            q.unfinished_tasks += len(batch)
            q.not_empty.notify()

    def request_shutdown(self) -> None:
        """Ask the loop to stop; it emits ``("shutdown",)`` and :meth:`run` returns.

        Sets the shutdown flag and wakes a loop blocked in ``get()`` at once. Messages that
        were queued before the call are still applied (the loop drains, then sees the flag);
        no ``step()`` or ``launch()`` starts after the loop has seen it, and the steps a
        pipelined engine has in flight are still collected and their outputs emitted. Called
        before :meth:`run`, that run applies nothing, not even the messages queued before
        this call: it answers each ``Utility`` among them with a
        :class:`~enginecore.LoopEndedError` and emits ``("shutdown",)``.

        Never blocks, never raises, idempotent. Thread-safe and **safe inside a signal
        handler**: it only ever *tries* to take ``input_queue.mutex`` (the interrupted thread
        may be holding it); if the mutex is busy, the Wakeup is handed to a helper thread
        through a pipe with one ``os.write``. Has no effect on a loop that already ended
        (it queues nothing; :attr:`shutdown_requested` still says it was called).
        """
        if self._shutdown:
            return
        self._shutdown = True
        q = self.input_queue
        mutex = q.mutex
        if mutex.acquire(blocking=False):
            try:
                # Exactly what Queue.put does, minus the blocking acquire. Not once the loop
                # has ended (_end_input sets _ended under this mutex): nobody would read it,
                # and it would sit in the queue and in statistics().queue_depth for good.
                if not self._ended:
                    q.queue.append(_WAKEUP)
                    q.unfinished_tasks += 1
                    q.not_empty.notify()
            finally:
                mutex.release()
            return
        # The mutex is held: by another thread (briefly), or by the very thread this signal
        # handler interrupted, which would deadlock on a blocking acquire. Either way let the
        # waker thread do a normal put(). Before run() there is no token, and none is needed:
        # run() reads the flag after it registers.
        token, w = self._token, _WAKER.w
        if token and w >= 0 and not self._ended:
            # One atomic 8-byte write; the waker drains the pipe, so it cannot fill up.
            with contextlib.suppress(OSError):
                os.write(w, token)

    @property
    def shutdown_requested(self) -> bool:
        """Whether :meth:`request_shutdown` has been called. Never blocks."""
        return self._shutdown

    def statistics(self) -> LoopStatistics:
        """A snapshot of the loop's numbers (:class:`~enginecore.LoopStatistics`): steps,
        outputs, messages per kind, busy and idle time, the step-time histogram, drain sizes,
        the queue's depth, and the engine's own ``stats()``.

        Any thread may call it, at any time (all zero before :meth:`run`); it never waits
        for the loop, a step or the queue's mutex. Steps shorter than 10 µs are counted in
        blocks of 64, so they may show up to ~0.6 ms late (``docs/observability.md``).
        Not safe in a signal handler (it allocates).
        """
        # len() of the deque, not qsize(): qsize() takes the mutex.
        return self._stats.snapshot(len(self.input_queue.queue))

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> None:
        """Run the loop in the calling thread until shutdown or a fatal error.

        Blocks for the life of the loop. Returns after emitting ``("shutdown",)`` or
        ``("fatal", ...)``. A loop runs once: a second call raises
        :class:`~enginecore.LoopAlreadyRunError`. A ``BaseException`` that is not an
        ``Exception`` (``KeyboardInterrupt``, ``SystemExit``, ...) raised inside the loop is
        emitted as ``("fatal", ...)`` and then propagates.
        """
        with self._run_lock:
            if self._started:
                raise LoopAlreadyRunError("this EngineCoreLoop has already run; build a new one")
            self._started = True
        self._token = _WAKER.register(self.input_queue)
        self._stats.started = time.perf_counter()
        try:
            if self._pipelined:
                self._run_pipelined()
            else:
                self._run()
        finally:
            # No write to the waker here: waking a blocked thread costs ~10-40 µs on a VM,
            # and it would sit on every run()'s way out (docs/performance.md, shutdown).
            _WAKER.unregister(self._token)

    def _run(self) -> None:
        # The step() loop. Kept apart from the pipelined one, and unchanged by it, so an
        # Engine pays nothing for pipelining (docs/performance.md, "Pipelined steps").
        emit = self._emit
        timer = self._timer
        if self._shutdown:
            self._stopped_before_run()
            return
        engine = self._engine
        has_work = engine.has_work
        step = engine.step  # type: ignore[union-attr]  # not pipelined: an Engine
        apply = self._apply
        q = self.input_queue
        get = q.get
        pending = q.queue
        mutex = q.mutex
        # Statistics (_stats.py): steps are timed a block at a time. A block is one pass of
        # the for loop below, *block* iterations that each step, begun at *t0*; *done* is
        # the iteration's index (the steps of the block that have returned before it) and
        # *outs* counts the block's outputs. The for loop keeps the count of steps, which
        # costs less per step than a countdown and its test (docs/performance.md). Locals,
        # and small ints (CPython caches those up to 256): an increment that allocates
        # would cost the hot path ~25 ns.
        perf = time.perf_counter
        end_block = timer.end_block
        outs = done = 0
        block = 1  # timed alone until BLOCK fast steps in a row
        blocks = range(block)  # made again only when the block's size changes
        stopping = False
        batch: list[Any] | None = None  # the last drain's messages; dropped when idle
        t0 = perf()
        try:
            while True:
                for done in blocks:
                    # Unlocked peek: a deque's truth value is read atomically under the
                    # GIL, and a message that lands just after it is seen on the next
                    # iteration.
                    if pending:
                        with mutex:
                            # The snapshot is the drain's bound: a producer that outpaces us
                            # can delay a step but never starve it or the shutdown check.
                            batch = list(pending)
                            pending.clear()
                        apply(batch)
                        if block == 1:
                            t0 = perf()  # a step timed alone does not include the drain
                    if self._shutdown:
                        stopping = True
                        break
                    if has_work():
                        for out in step():
                            emit(("output", out))
                            outs += 1
                    else:
                        # The only blocking call: no timeout, so an idle loop costs no CPU.
                        # request_shutdown() enqueues a Wakeup to end it. The block ends
                        # here, with its *done* steps; a new one begins after the wait.
                        # The last batch drained must not live on while the loop waits:
                        # its messages' payloads (arrays, and the shared memory under
                        # them) would stay alive until the next message. Nor the last
                        # output emitted, which emit has handed off.
                        batch = out = None
                        t0 = timer.idle(block, done, t0, outs)
                        # Counted: a fatal error in the wait's message must not count them
                        # again.
                        outs = done = 0  # noqa: PLW2901
                        apply((get(),))
                        t0 = timer.woke(t0)
                        if timer.block != block:
                            block = timer.block
                            blocks = range(block)
                        break
                else:  # the block's steps have all returned
                    done = block
                    now = perf()
                    nxt = end_block(block, block, now - t0, outs, now)
                    t0 = now
                    outs = done = 0
                    if nxt < 0:  # it called engine.stats(): not part of a step
                        nxt = -nxt
                        t0 = perf()
                    if nxt != block:
                        block = nxt
                        blocks = range(block)
                if stopping:
                    break
            timer.flush(block, done, t0, outs)
            done = outs = 0
            if self._deferred:
                self._abandon_deferred()
            self._end_input()
        except BaseException as exc:
            timer.flush(block, done, t0, outs)
            self._die(_has_work_not_bool(_outputs_not_iterable(exc, "step"), has_work))
            if not isinstance(exc, Exception):
                raise
            return
        timer.stopped()
        emit(("shutdown",))

    def _run_pipelined(self) -> None:
        # Rules 12-16. One decision per iteration, each after a drain: launch, collect the
        # oldest handle, or block in get() when nothing is in flight.
        emit = self._emit
        timer = self._timer
        if self._shutdown:
            self._stopped_before_run()
            return
        engine: PipelinedEngine[Any] = self._engine  # type: ignore[assignment]
        has_work = engine.has_work
        launch = engine.launch
        collect = engine.collect
        depth = self._depth
        apply = self._apply
        q = self.input_queue
        get = q.get
        pending = q.queue
        mutex = q.mutex
        # Statistics, as in _run: a collect counts as a step.
        perf = time.perf_counter
        end_block = timer.end_block
        outs = 0
        block = left = 1  # timed alone until BLOCK fast steps in a row
        t0 = perf()
        # The handles launched and not yet passed to collect, oldest first. A handle leaves
        # it just before its collect() call: a collect that raises has still had its handle.
        inflight: deque[Any] = deque()
        batch: list[Any] | None = None  # the last drain's messages; dropped when idle
        try:
            while True:
                if pending:
                    with mutex:
                        batch = list(pending)
                        pending.clear()
                    apply(batch)
                    if block == 1:
                        t0 = perf()
                if self._shutdown:
                    if not inflight:
                        break
                elif len(inflight) < depth and has_work():
                    inflight.append(launch())
                    continue
                elif not inflight:
                    batch = out = None  # as in the plain loop: nothing lives on while idle
                    t0 = timer.idle(block, block - left, t0, outs)
                    # Counted: a fatal error in the wait's message must not count them again.
                    outs, left = 0, block
                    apply((get(),))
                    t0 = timer.woke(t0)
                    block = left = timer.block
                    continue
                # Full, or nothing more to launch, or shutting down: collect the oldest.
                # collect() is the blocking call while steps are in flight, never get().
                for out in collect(inflight.popleft()):
                    emit(("output", out))
                    outs += 1
                left -= 1
                if not left:
                    now = perf()
                    block = left = end_block(block, block, now - t0, outs, now)
                    t0 = now
                    outs = 0
                    if block < 0:
                        block = left = -block
                        t0 = perf()
            timer.flush(block, block - left, t0, outs)
            left, outs = block, 0
            if self._deferred:
                self._abandon_deferred()
            self._end_input()
        except BaseException as exc:
            timer.flush(block, block - left, t0, outs)
            try:
                if inflight:
                    self._cancel(inflight)
            finally:
                # Even if a cancel() raised KeyboardInterrupt: the fatal event goes out.
                self._die(_has_work_not_bool(_outputs_not_iterable(exc, "collect"), has_work))
            if not isinstance(exc, Exception):
                raise
            return
        timer.stopped()
        emit(("shutdown",))

    def _cancel(self, handles: deque[Any]) -> None:
        # Fatal path: release the steps the loop will never collect, in launch order.
        cancel = getattr(self._engine, "cancel", None)
        if not callable(cancel):
            handles.clear()
            return
        while handles:
            handle = handles.popleft()
            try:
                cancel(handle)
            except Exception:
                logger.exception("enginecore: engine.cancel() failed for a handle in flight")

    def _apply(self, batch: list[Any] | tuple[Any]) -> None:
        engine = self._engine
        c = self._stats
        c.last_drain = n = len(batch)
        if n > c.peak_drain:  # noqa: PLR1730  # max() is a call: ~40 ns a drain
            c.peak_drain = n
        adds = 0  # counted in a local, a small int: no allocation per Add
        try:
            for msg in batch:
                cls = msg.__class__
                if cls is Add:
                    engine.add(msg.req_id, msg.data)
                    adds += 1
                elif cls is Abort:
                    engine.abort(msg.req_ids)
                    c.aborts += 1
                elif cls is Utility:
                    self._call_utility(msg)
                elif cls is not Wakeup:
                    self._apply_unusual(msg)
        except BaseException:
            # Fatal (rule 8): the messages after msg are off the queue and never applied;
            # the end answers their utilities (rule 17). Free on the path without one.
            self._cut = (batch, msg)
            raise
        finally:
            if adds:
                c.adds += adds

    def _apply_unusual(self, msg: object) -> None:
        # A deferred utility's future is done; a control (rule 18); then subclasses of the
        # message types, which are honoured; anything else is a producer bug that must not
        # take the stage down.
        c = self._stats
        if msg.__class__ is _Deferred:
            self._answer_deferred(msg)
        elif isinstance(msg, Control):
            msg.apply(self._engine, self)
            c.controls += 1
        elif isinstance(msg, Add):
            self._engine.add(msg.req_id, msg.data)
            c.adds += 1
        elif isinstance(msg, Abort):
            self._engine.abort(msg.req_ids)
            c.aborts += 1
        elif isinstance(msg, Utility):
            self._call_utility(msg)
        elif not isinstance(msg, Wakeup):
            # describe(): the record must format even if the object's repr() raises.
            logger.error(
                "enginecore: ignoring an object of type %s on input_queue; "
                "expected Add, Abort, Utility, Wakeup or a Control: %.200s",
                type(msg).__name__,
                describe(msg),
            )

    def _call_utility(self, msg: Utility) -> None:
        c = self._stats
        c.utility_calls += 1
        try:
            result = self._engine.utility(msg.name, msg.args)
        except (KeyboardInterrupt, SystemExit):
            raise  # fatal, then out of run(), from anywhere (rule 8)
        except BaseException as exc:
            # Any other, asyncio.CancelledError included, is this call's answer: as when a
            # future it returned fails with it.
            c.utility_errors += 1
            event: Event = ("utility", msg.call_id, None, describe(exc))
        else:
            if isinstance(result, Future):
                self._defer(msg, result)
                return
            if isinstance(result, types.CoroutineType):
                # An `async def utility`: nothing here would ever run it, and its caller
                # would get a coroutine object (or a wire error) for an answer.
                result.close()  # never started: no "never awaited" warning
                c.utility_errors += 1
                error = TypeError(
                    f"utility {msg.name!r:.200} returned a coroutine (an async def?): the loop "
                    f"does not run coroutines; return the result, or a "
                    f"concurrent.futures.Future (asyncio.run_coroutine_threadsafe gives one)"
                )
                event = ("utility", msg.call_id, None, describe(error))
            elif getattr(type(result), "_asyncio_future_blocking", None) is not None:
                # An asyncio.Future or Task (what asyncio.isfuture() tests, without importing
                # asyncio): bound to its event loop and not thread-safe, the loop cannot wait
                # for it, and as a result its caller would get the future object itself.
                c.utility_errors += 1
                error = TypeError(
                    f"utility {msg.name!r:.200} returned an asyncio future "
                    f"({type(result).__name__}): the loop does not wait for those; return "
                    f"the result, or a concurrent.futures.Future "
                    f"(asyncio.run_coroutine_threadsafe gives one)"
                )
                event = ("utility", msg.call_id, None, describe(error))
            else:
                event = ("utility", msg.call_id, result, None)
        # Outside the try: an emit failure is fatal, not this call's error.
        self._emit(event)

    def _defer(self, msg: Utility, future: Future[Any]) -> None:
        call = _Deferred(msg.call_id, msg.name, future, self.input_queue)
        if future.done():
            # Answered now, exactly where a plain result would have been.
            self._emit(self._answer(call))
            return
        self._deferred[call] = None
        # If the future completes between done() and here, the callback runs right now, in
        # this thread: it only puts the call on the queue, and the next drain answers it.
        future.add_done_callback(call)

    def _answer(self, call: _Deferred) -> UtilityEvent:
        event = call.answer()
        if event[3] is not None:
            self._stats.utility_errors += 1
        return event

    def _answer_deferred(self, call: _Deferred) -> None:
        # At most once per call: _abandon_deferred may have answered it already.
        if self._deferred.pop(call, False) is None:
            self._emit(self._answer(call))

    def _abandon_deferred(self) -> None:
        # The loop ends: answer every pending deferred call, in the order they were made.
        # A future that is done (its callback's message not drained yet) gets its real
        # answer; one still pending gets a LoopEndedError. First, under the mutex, every
        # call is marked abandoned and the messages of those already done leave the queue:
        # a callback that fires from here on (another thread's, or the loop's own while an
        # answer is emitted) queues nothing on a queue nobody will read.
        deferred = self._deferred
        q = self.input_queue
        with q.mutex:
            for call in deferred:
                call.abandoned = True
            pending = q.queue
            if any(msg.__class__ is _Deferred for msg in pending):
                rest = [msg for msg in pending if msg.__class__ is not _Deferred]
                pending.clear()
                pending.extend(rest)
        while deferred:
            call = next(iter(deferred))
            del deferred[call]
            if call.future.done():
                event = self._answer(call)
            else:
                self._stats.utility_errors += 1
                err = LoopEndedError(
                    f"the engine loop ended before utility {call.name!r:.200} "
                    f"(call {call.call_id}) completed"
                )
                event = ("utility", call.call_id, None, repr(err))
            self._emit(event)

    def _end_input(self, left: list[Any] | None = None) -> None:
        # The loop ends (rules 8, 9, 17): it applies nothing more. Under the mutex, as the
        # drain's snapshot, so that submit() refuses from here on and nothing it queued can
        # be left behind unanswered. Every Utility still queued is taken off the queue and
        # answered with a LoopEndedError, in queue order, exactly once; the other messages
        # stay queued, never applied. *left*: what a drain that failed had not applied yet
        # (_left_of_drain), its utilities answered first. Runs once, at the end: the
        # message path pays nothing.
        q = self.input_queue
        with q.mutex:
            self._ended = True
            pending = q.queue
            calls = [msg for msg in pending if isinstance(msg, Utility)]
            if calls:
                rest = [msg for msg in pending if not isinstance(msg, Utility)]
                pending.clear()
                pending.extend(rest)
        if left:
            calls[:0] = [msg for msg in left if isinstance(msg, Utility)]
        self._unanswered.extend(calls)
        self._answer_unapplied()

    def _answer_unapplied(self) -> None:
        # Each call leaves _unanswered before its answer is emitted: if that emit raises
        # (or a KeyboardInterrupt lands in it), _die answers the ones after it, none twice.
        calls = self._unanswered
        emit = self._emit
        while calls:
            msg = calls.popleft()
            err = LoopEndedError(
                f"the engine loop ended before it applied utility {msg.name!r:.200} "
                f"(call {msg.call_id})"
            )
            emit(cast(UtilityEvent, _UnappliedAnswer(("utility", msg.call_id, None, repr(err)))))

    def _stopped_before_run(self) -> None:
        # request_shutdown() came before run(): apply nothing (rule 9); answer the queued
        # utilities, then ("shutdown",). An emit that fails for an answer is fatal (rule 8).
        try:
            self._end_input()
        except BaseException as exc:
            self._die(exc)
            if not isinstance(exc, Exception):
                raise
            return
        self._timer.stopped()
        self._emit(("shutdown",))

    def _left_of_drain(self) -> list[Any]:
        """The messages of the drain a fatal error cut short (:meth:`_apply`), after the
        one that raised: taken off the queue, never applied. The same message object twice
        in that drain: after its last occurrence, so that nothing is answered twice."""
        cut, self._cut = self._cut, None
        if cut is None:
            return []
        batch, msg = cut
        at = max((i for i, m in enumerate(batch) if m is msg), default=len(batch))
        return list(batch[at + 1 :])

    def _die(self, exc: BaseException) -> None:
        if isinstance(exc, KeyboardInterrupt):
            # The user's Ctrl-C (run() on the main thread), not a failure: one line, no
            # traceback; it ends the loop as any fatal exception does and propagates.
            logger.warning("enginecore: the engine loop was interrupted (KeyboardInterrupt)")
        else:
            logger.error("enginecore: fatal error in the engine loop", exc_info=exc)
        if self._deferred:
            try:
                self._abandon_deferred()
            except BaseException as emit_exc:
                # Still try the fatal event: it is the one every client waits for.
                logger.error(
                    "enginecore: emit failed for a deferred utility's answer", exc_info=emit_exc
                )
                self._deferred.clear()
        if not self._ended:
            try:
                self._end_input(self._left_of_drain())
            except BaseException as emit_exc:
                logger.error(
                    "enginecore: emit failed for a queued utility's answer", exc_info=emit_exc
                )
                self._unanswered.clear()
        elif self._unanswered:
            # The end was answering the calls it never applied when it failed (an emit that
            # raised, a KeyboardInterrupt): the others still get their answer.
            try:
                self._answer_unapplied()
            except BaseException as emit_exc:
                logger.error(
                    "enginecore: emit failed for a queued utility's answer", exc_info=emit_exc
                )
                self._unanswered.clear()
        self._timer.stopped()
        try:
            self._emit(("fatal", describe(exc)))
        except BaseException as emit_exc:
            logger.error("enginecore: emit failed for the fatal event", exc_info=emit_exc)
            raise


class _Waker:
    """One helper thread per process: turns a signal-safe ``os.write`` into ``q.put(Wakeup())``.

    request_shutdown() writes a loop's 8-byte token to the pipe when it cannot take the queue's
    mutex; the thread looks the token up and does a normal ``put``. The thread is started by
    the first run() in a process, is a daemon, and then sleeps in ``os.read`` for the life of
    the process at no CPU cost. Being shared, it never has to be woken just to be told to
    exit, which kept ~40 µs (p50) on every run()'s way out when each run had its own.
    """

    # Lock rules: _lock guards _queues, _next and the (re)start; a signal handler never takes
    # it, it only reads w and calls os.write. w is -1 until the thread runs, then a pipe fd
    # that is never closed in this process (so it is never a reused descriptor).

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[bytes, queue.Queue[Any]] = {}
        self._next = 0
        self.w = -1

    def register(self, q: queue.Queue[Any]) -> bytes:
        with self._lock:
            if self.w < 0:
                r, w = os.pipe()
                os.set_blocking(w, False)  # a signal handler must never block on a full pipe
                try:
                    threading.Thread(
                        target=self._forward, args=(r,), name="enginecore-waker", daemon=True
                    ).start()
                except BaseException:
                    os.close(r)
                    os.close(w)
                    raise
                self.w = w
            self._next += 1
            token = self._next.to_bytes(8, "little")
            self._queues[token] = q
            return token

    def unregister(self, token: bytes) -> None:
        with self._lock:
            self._queues.pop(token, None)

    def after_fork_in_child(self) -> None:
        # The thread did not survive the fork; the inherited pipe still leads to the parent's.
        w, self.w = self.w, -1
        self._lock = threading.Lock()
        self._queues = {}
        if w >= 0:
            with contextlib.suppress(OSError):
                os.close(w)

    def _forward(self, r: int) -> None:
        pending = b""
        while True:
            data = os.read(r, 4096)
            if not data:
                return
            pending += data
            # Writes of 8 bytes are atomic on a pipe, so tokens never interleave.
            while len(pending) >= 8:
                token, pending = pending[:8], pending[8:]
                with self._lock:
                    q = self._queues.get(token)
                if q is not None:
                    q.put(_WAKEUP)


_WAKER = _Waker()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WAKER.after_fork_in_child)
