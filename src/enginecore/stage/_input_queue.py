"""The stage's input queue: while the loop is idle, or runs short steps, the loop thread
reads the input socket itself (:class:`InputQueue`).

A message that reaches an idle stage would otherwise cross two threads: the input thread
wakes, reads and decodes it and puts it on the queue, and the loop thread wakes to apply it.
Each wake-up of a blocked thread costs ~30-40 µs on a VM, the biggest share of a utility
round trip (``docs/performance.md``). So the two threads pass the input side (the input
socket and the output socket's monitor, which are used by one thread at a time) between
them:

- **While the loop is idle, it reads the input side itself.** When the loop goes idle
  (``get()`` finds the queue empty) it says it wants the input side and waits for a message
  (on the wake-up pipe, below). The input thread hands the input side over after it has
  queued the next burst it reads, with the same lock and the same wake-up; the first
  message after a busy period that began with a long step still crosses threads. While it
  holds it, the idle loop reads the socket in ``get()``: one ``poll`` over the input socket,
  the monitor and a wake-up pipe, then the input thread's own handling
  (:meth:`InputReader.read`, the :class:`~._inbox.Inbox`'s), and it returns the first
  message. A message goes from the socket to the engine on one thread, as in a hand-written
  loop that blocks on its pipe.
- **Between short steps, the loop keeps it and reads it without blocking**
  (:meth:`InputQueue.after_step`, after every step shorter than :data:`SHORT_STEP_S`; it
  asks the sockets with ``ZMQ_EVENTS``, which keeps the GIL, and reads only if something
  is waiting): what
  arrived during step *n* is queued before the loop's drain, so it is applied before step
  *n + 1*, as the input thread would have done. With an engine whose steps hold the GIL,
  the input thread could only read once it got the GIL (at the step's socket send, or after
  a switch interval, 5 ms by default): measured, requests sent one message each were then
  read in bursts between groups of steps, and a job of them took ~15-20 % longer.
- **After a longer step, the input thread holds it** (:meth:`InputQueue.release`: one
  ``notify``), for the rest of the busy period: it reads during the steps, in parallel with
  an engine that releases the GIL while it steps. A pipelined launch gives it back too.
- **A long call** (an ``add``, a utility or a step that runs while the loop holds the
  input side) must not leave the socket unread: pings would go unanswered and a
  ``hello`` would wait. The parked input thread takes the input side back once the loop
  has not read it for :data:`LEASE_S` (out of ``get()``, and no read between steps). It
  watches with the step watchdog's trick: it waits with a timeout only after the loop,
  leaving a read, found it disarmed and woke it; it disarms when it finds the loop reading.
  So it wakes about once per lease while calls or steps keep coming, and never while the
  stage idles.

A put from any other thread (a deferred utility's callback, a drain timer, the signal
waker, ``request_shutdown()`` from a signal handler), and the input thread's hand-over, end
in ``not_empty.notify()`` under the queue's mutex; while the idle loop waits, that notify
writes a byte to a wake-up pipe (``os.write``: safe in a signal handler). The idle loop
always waits in a ``poll`` that includes this pipe: with the input side, also on the
sockets; without it, on the pipe alone, never in ``Condition.wait()``. So a signal that the
kernel gives to another thread, which writes the pipe through
:func:`signal.set_wakeup_fd` (:meth:`InputQueue.signals_wake`), wakes the loop in every
idle state.

**The engine's idle deadline.** An engine may have one (:class:`IdleTimer`: a pipeline
stage gives back the credit it held back 2 ms after it went idle). Either ``poll`` of the
idle wait then times out at :meth:`IdleTimer.idle_due`, and ``get()`` calls
:meth:`IdleTimer.idle_fire` on the loop thread, the engine idle, and waits on: a deadline
costs one wake-up, and an engine without one nothing.

Every change of hands happens under the queue's mutex, which is also the memory barrier a
zmq socket needs to move between threads. The loop thread touches the sockets only inside
``get()`` or :meth:`InputQueue.after_step`, with :attr:`InputQueue.reading` set; the input
thread only while the loop does not hold them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Final, Protocol

import zmq

__all__ = ["LEASE_S", "SHORT_STEP_S", "IdleReport", "InputQueue", "InputReader"]

logger = logging.getLogger("enginecore.stage")

SHORT_STEP_S: Final = 0.001
"""A step shorter than this leaves the input side with the loop, which reads between steps;
after a longer one the input thread reads, during the steps (:meth:`InputQueue.after_step`)."""

LEASE_S: Final = 0.05
"""How long the loop may hold the input side without reading it (running an ``add``, an
``abort``, a utility or a step) before the input thread takes it back."""


class InputReader(Protocol):
    """What the input queue needs of the input side (:class:`~._inbox.Inbox`): the reading
    that either thread does while it holds the input side."""

    @property
    def pending(self) -> list[Any]:
        """The loop messages read and not yet queued, in order; the queue empties it."""
        ...

    def register(self, poller: zmq.Poller) -> None:
        """Add the sockets to read to *poller*."""
        ...

    def read(self, poller: zmq.Poller, timeout_ms: int | None = None) -> dict[Any, int]:
        """Wait in *poller* up to *timeout_ms* (``None``: no limit), read and handle what
        is waiting, leave the loop messages in :attr:`pending`; what *poller* found."""
        ...

    def has_input(self) -> bool:
        """Whether :meth:`read` has something to do at once (without a poll)."""
        ...

    def readable(self, ready: dict[Any, int]) -> bool:
        """Whether *ready* includes the input socket."""
        ...


class IdleReport(Protocol):
    """What the idle wait needs of the stage's load reports
    (:class:`~._statistics.LoadReporter`): whether the latest report was made as the loop
    idled, and how to send one that is."""

    idle_reported: bool

    def report_idle(self) -> None:
        """Send a load report made now, as the loop goes idle."""
        ...

    def report_changes(self) -> float | None:
        """While the loop idles: send a report if what is live changed since the latest
        and the interval allows; else the seconds until it will (``None``: nothing due)."""
        ...


class IdleTimer(Protocol):
    """A deadline of the engine's own for its idle loop (a pipeline stage's credit held
    back: :class:`~._pipe_stage.PipeStage`): the idle wait calls :meth:`idle_fire` on the
    loop thread once :meth:`idle_due` has passed, then waits on."""

    def idle_due(self) -> float | None:
        """When to fire (``time.monotonic()``), or ``None``."""
        ...

    def idle_fire(self) -> None:
        """The deadline passed while the loop idled."""
        ...


class _NotEmpty(threading.Condition):
    """The queue's ``not_empty``: a notify also wakes the loop's ``poll`` while it reads."""

    def __init__(self, q: InputQueue) -> None:
        super().__init__(q.mutex)
        self._q = q

    def notify(self, n: int = 1) -> None:
        super().notify(n)
        q = self._q
        if q.reading or q.waiting:
            # Full: a wake-up is pending anyway. Closed: teardown, nobody reads.
            with contextlib.suppress(OSError):
                os.write(q.wake_w, b"\0")


class InputQueue(queue.Queue[Any]):
    """The loop's ``input_queue`` in a stage; see the module docstring.

    :meth:`attach` it to the input side (an :class:`InputReader`) before the loop runs.
    :meth:`close` at teardown, after the loop has returned and before ``Context.term()``.
    """

    # Under mutex: holds (the loop thread holds the input side), reading (and is using it,
    # in get() or after_step()), wants (the loop is waiting in get() for the input side), waiting
    # (it waits in a poll on the wake-up pipe alone, for a message or the input side), closed
    # (teardown: the input thread keeps it), armed (the parked input thread watches the
    # lease) and left_at (monotonic time the loop last stopped reading while holding).

    def __init__(self) -> None:
        super().__init__()
        self.not_empty = _NotEmpty(self)
        self.turn = threading.Condition(self.mutex)  # the parked input thread waits here
        self.holds = False
        self.reading = False
        self.wants = False
        self.waiting = False  # the loop waits in poll on the wake-up pipe alone
        self.closed = False
        self.armed = False
        self.left_at = 0.0
        self.handovers = 0  # times the input thread handed the input side to the loop
        self.reclaims = 0  # times it took it back from a long call
        self.releases = 0  # times a step gave it back
        self.loop_reads = 0  # messages get() returned that the loop read itself
        self.step_reads = 0  # reads between steps (after_step) that found the socket readable
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._reader: InputReader | None = None
        # The stage's load reports (None: it sends none): the idle wait sends one when the
        # latest was made while the loop was busy (get()).
        self.idle_report: IdleReport | None = None
        # The engine's idle deadline, if it has one (get() fires it while it waits).
        self.idle_timer: IdleTimer | None = None
        self._on_failure: Callable[[], None] = lambda: None
        self._poller = zmq.Poller()
        self._pipe_poll = select.poll()
        self._pipe_poll.register(self.wake_r, select.POLLIN)

    def attach(self, reader: InputReader, on_failure: Callable[[], None]) -> None:
        """Use *reader*'s sockets and handling (once, before the loop runs). If a read on
        the loop thread fails, the input side is closed for good and *on_failure()* is
        called (the runtime stops the stage), as when the input thread fails."""
        self._reader = reader
        self._on_failure = on_failure
        reader.register(self._poller)
        self._poller.register(self.wake_r, zmq.POLLIN)

    # -- the loop thread ---------------------------------------------------------------------

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """The loop's idle wait: the next message, reading the input socket while the loop
        holds it. Any other call is :meth:`queue.Queue.get`'s.

        The loop calls it only when it is about to block with nothing in flight (rule 1;
        for a pipelined engine, no step in flight either), which no step can know for sure:
        if the latest load report went out while the loop was busy, :attr:`idle_report`
        sends one more first, so that the stage's last report describes it idle."""
        if not block or timeout is not None or self._reader is None:
            return super().get(block, timeout)
        report = self.idle_report
        if report is not None and not report.idle_reported:
            report.report_idle()
        while True:
            with self.mutex:
                self.waiting = False
                if self.queue:
                    self.wants = False
                    if self.holds:  # handed over with the message: the lease starts now
                        self._leave()
                    return self.queue.popleft()
                if self.holds and not self.closed:
                    self.reading = True
                    break
                # Not Condition.wait(): a poll on the wake-up pipe, which a signal taken by
                # any thread also writes to (signals_wake), and so does every notify now.
                self.wants = True
                self.waiting = True
            self._wait_pipe()
        return self._read(self._reader)

    def _wait_pipe(self) -> None:
        self._pipe_poll.poll(self._idle_ms())
        self._drain_pipe()

    def _idle_ms(self) -> int | None:
        """The idle wait's timeout: until :attr:`idle_timer` is due, or a load report of a
        change in what is live (:attr:`idle_report`) may go (in ms, rounded up), or
        ``None``. Fires the timer, then sends the report, first if they are due already."""
        left = None
        timer = self.idle_timer
        if timer is not None:
            due = timer.idle_due()
            if due is not None and due <= time.monotonic():
                timer.idle_fire()
                due = timer.idle_due()
            if due is not None:
                left = due - time.monotonic()
        report = self.idle_report
        if report is not None:
            wait = report.report_changes()
            if wait is not None and (left is None or wait < left):
                left = wait
        if left is None:
            return None
        return max(1, math.ceil(left * 1000))

    def _drain_pipe(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self.wake_r, 4096)

    def _read(self, reader: InputReader) -> Any:
        poller = self._poller
        pending = reader.pending
        try:
            while True:
                ready = reader.read(poller, self._idle_ms())
                if self.wake_r in ready:
                    self._drain_pipe()
                with self.mutex:
                    self._take(pending)
                    if self.queue:
                        self._leave()
                        self.loop_reads += 1
                        return self.queue.popleft()
        except Exception:
            self._read_failed(reader)
            return super().get()
        except BaseException:  # KeyboardInterrupt under the default SIGINT handler
            with self.mutex:
                self._leave()
            raise

    def _read_failed(self, reader: InputReader) -> None:
        # What the input thread does when it fails: the stage can no longer read, so it
        # stops (exit code EXIT_IO_FAILED). Nobody reads the input side again.
        logger.exception("enginecore: reading the input socket failed; shutting down")
        with self.mutex:
            self._leave()
            self.closed = True
            self._take(reader.pending)
        self._on_failure()

    def _take(self, pending: list[Any]) -> bool:
        # Under mutex: queue what was read, in order (what Queue.put would do for each,
        # without a notify); whether there was anything.
        if not pending:
            return False
        self.queue.extend(pending)
        self.unfinished_tasks += len(pending)
        pending.clear()
        return True

    def _leave(self) -> None:
        # Under mutex: the loop stops reading, holding the input side (the lease starts).
        self.reading = False
        self.left_at = time.monotonic()
        if not self.armed:
            self.armed = True
            self.turn.notify()

    def after_step(self, took: float) -> None:
        """Loop thread, after a step that took *took* seconds, outside ``get()``: if it
        still holds the input side, read what is waiting on it without blocking (what came
        during the step, which the loop then applies before the next one); after a step of
        :data:`SHORT_STEP_S` or more, also give the input side back (as :meth:`release`),
        so that the input thread reads during the next steps."""
        reader = self._reader
        if reader is None:
            return
        with self.mutex:
            if not self.holds or self.closed:
                return
            self.reading = True
        pending = reader.pending
        try:
            # Most steps find nothing: then ask the sockets without a poll, which would
            # release the GIL and hand it to the output thread on every step (measured:
            # ~10 % of the output stream with steps of 256 outputs).
            ready = reader.read(self._poller, 0) if reader.has_input() else {}
            if self.wake_r in ready:
                self._drain_pipe()
        except Exception:
            self._read_failed(reader)
            return
        except BaseException:
            with self.mutex:
                self._leave()
            raise
        with self.mutex:
            self._take(pending)
            if reader.readable(ready):
                self.step_reads += 1
            if took < SHORT_STEP_S:
                self._leave()
            else:
                self.reading = False
                self._give_back()

    def release(self) -> None:
        """Loop thread, outside ``get()``: give the input side back to the input thread, so
        that it reads while the loop works (before a pipelined launch, after a long step).
        Cheap when the loop does not hold it (an unlocked read: only the loop, inside
        ``get()``, can come to hold it)."""
        if self.holds:
            with self.mutex:
                if self.holds:
                    self._give_back()

    def _give_back(self) -> None:
        # Under mutex, holding the input side: the input thread's again.
        self.holds = False
        self.releases += 1
        self.turn.notify()

    @contextlib.contextmanager
    def signals_wake(self) -> Iterator[None]:
        """In the main thread: make a signal wake the idle loop's ``poll``.

        Python runs a signal handler in the main thread, between bytecodes, and the kernel
        may deliver the signal to any thread: to the parked input thread, say, which does
        not interrupt the main thread's ``poll``, so the handler (``request_shutdown()``)
        would not run until the next message (seen: a SIGTERM after a SIGSTOP/SIGCONT
        went unanswered). :func:`signal.set_wakeup_fd` makes the C-level handler write to
        the wake-up pipe, whichever thread takes the signal; the handler then runs as soon
        as the loop's thread runs Python again. The previous wake-up fd is restored on
        exit. Elsewhere than in the main thread this does nothing (signals cannot be
        handled there)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        try:
            yield
        finally:
            signal.set_wakeup_fd(previous)

    def close(self) -> None:
        """Teardown (the loop has returned): the input thread keeps the input side, so that
        ``Context.term()`` finds it in ``poll`` and it closes the sockets. Then the pipe is
        closed by :meth:`close_pipe`, once the input thread has ended."""
        with self.mutex:
            self.closed = True
            self.holds = False
            self.turn.notify()

    def close_pipe(self) -> None:
        """Close the wake-up pipe: once nothing can read or write it any more."""
        for fd in (self.wake_r, self.wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- the input thread --------------------------------------------------------------------

    def wait_turn(self) -> None:
        """Input thread: return once it holds the input side (at once if it does); while the
        loop holds it, watch the lease (module docstring)."""
        if not self.holds:  # unlocked: only the input thread hands it over
            return
        with self.mutex:
            while self.holds:
                if not self.armed:
                    self.turn.wait()
                    continue
                self.turn.wait(LEASE_S)
                if not self.holds:
                    break
                if self.reading:
                    self.armed = False  # the loop idles, reading: nothing to watch
                elif time.monotonic() - self.left_at >= LEASE_S:
                    self.holds = False  # a long call: read while it runs
                    self.reclaims += 1

    def hand_over(self, pending: list[Any]) -> None:
        """Input thread, after each read: queue *pending* (in order, one lock, one notify),
        and hand the input side to the loop if it is waiting for it."""
        with self.mutex:
            if not self._take(pending) and not self.wants:
                return
            if self.wants and not self.closed:
                self.wants = False
                self.holds = True
                self.handovers += 1
            self.not_empty.notify()
