"""The step watchdog: :class:`StepWatchdog`.

A step that runs longer than ``step_timeout`` is reported once: every thread's stack goes to
stderr (:mod:`faulthandler`), the log says so, and the clients get a ``stalled`` event; when
that step returns, a ``resumed`` event. With ``kill_after``, a step that runs that long is
fatal: a ``fatal`` event, and the process ends (a Python thread cannot be interrupted, and a
stage whose loop is stuck can do nothing else useful).

It costs nothing while the stage is idle: its thread blocks on an event that only a step
sets, and only when the thread has disarmed itself, which it does when a look finds no step
running and none begun since its previous look. While steps keep coming, back to back or
now and then, it stays armed and looks once per ``step_timeout / 4`` (or sleeps until the
running step's deadline), so a step never pays a wake-up of the thread (an ``Event.set()``
cost 55-88 us of a stage's loop when the thread disarmed between two steps); once the stage
idles, it disarms at its next look and then never wakes. On the loop thread a step costs two
attribute stores, a clock read and two attribute reads (:meth:`StepWatchdog.begin` /
:meth:`StepWatchdog.end`).
"""

from __future__ import annotations

import faulthandler
import logging
import math
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Final

logger = logging.getLogger("enginecore.stage")

__all__ = ["STEP_TIMEOUT", "StepWatchdog", "check_watchdog"]

STEP_TIMEOUT: Final = 60.0
"""The default ``step_timeout`` of a launched or headless stage, in seconds."""


def check_watchdog(step_timeout: float | None, kill_after: float | None) -> None:
    """:class:`ValueError` (:class:`TypeError` for a non-number) unless *step_timeout* is
    ``None`` or a number of seconds > 0, and *kill_after* is ``None`` or a number of seconds
    >= *step_timeout* (which it then needs)."""
    for name, value in (("step_timeout", step_timeout), ("kill_after", kill_after)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise TypeError(f"{name} must be a number of seconds or None, got {value!r}")
    if step_timeout is not None and not 0 < step_timeout < math.inf:
        raise ValueError(f"step_timeout must be a number of seconds > 0, got {step_timeout}")
    if kill_after is not None:
        if step_timeout is None:
            raise ValueError("kill_after needs a step_timeout")
        if not step_timeout <= kill_after < math.inf:
            raise ValueError(
                f"kill_after must be a number of seconds >= step_timeout ({step_timeout} s), "
                f"got {kill_after}"
            )


class StepWatchdog:
    """Watches the loop thread's steps; see the module docstring.

    *post* queues an event for the clients (any thread, never blocks); *kill(message)* is
    called once, on the watchdog thread, when a step passes *kill_after*: it must end the
    process. ``start()`` once, ``close()`` when the loop has ended.
    """

    # The loop thread writes started (monotonic time of the running step's start, 0.0 when
    # none runs) and seq (bumped per step) with no lock: the watchdog thread only samples
    # them, and a sample that straddles a step boundary is caught by seq. armed (the
    # thread is awake or about to be) is written by both: the loop thread sets it, with the
    # event, only when it finds it False; the thread clears it, then re-reads started
    # (under the GIL, one of the two sees the other's write, so a step is never missed).
    # _lock guards stalled and the stalled/resumed pair of events: the loop thread and the
    # watchdog thread may both find that a reported step has ended, and one resumed is sent.

    def __init__(
        self,
        step_timeout: float,
        kill_after: float | None,
        *,
        post: Callable[[Any], None],
        kill: Callable[[str], None],
    ) -> None:
        check_watchdog(step_timeout, kill_after)
        self.step_timeout = step_timeout
        self.kill_after = kill_after
        self._post = post
        self._kill = kill
        self.started = 0.0
        self.seq = 0
        self.armed = False
        self.stalled = False
        self.wakeups = 0  # times the thread woke up: for tests of "no wake-ups while idle"
        self._event = threading.Event()
        self._cond = threading.Condition()
        self._closed = False
        self._lock = threading.Lock()
        self._reported = -1  # seq of the last step reported as stalled
        self._stalled_since = 0.0
        self._thread = threading.Thread(target=self._main, name="enginecore-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the thread (it may be asleep until its next check; it is a daemon)."""
        self._closed = True
        self._event.set()
        with self._cond:
            self._cond.notify_all()

    # -- the loop thread -----------------------------------------------------------------------

    def begin(self) -> None:
        """Loop thread, right before a step."""
        self.seq += 1
        self.started = time.monotonic()
        if not self.armed:
            self.armed = True
            self._event.set()

    def end(self) -> None:
        """Loop thread, right after a step (also one that raised)."""
        self.started = 0.0
        if self.stalled:
            self._resume()

    # -- the watchdog thread ------------------------------------------------------------------

    def _resume(self) -> None:
        with self._lock:
            if not self.stalled:
                return
            self.stalled = False
            took = time.monotonic() - self._stalled_since
            self._post(("resumed", took))
        logger.warning("enginecore: the stalled step returned after %.1f s", took)

    def _main(self) -> None:
        event = self._event
        timeout = self.step_timeout
        looked_at = -1  # the step count at the last look that found no step running
        while True:
            event.wait()
            self.wakeups += 1
            if self._closed:
                return
            seq, started = self.seq, self.started
            if started == 0.0:
                if seq != looked_at:
                    # Steps ran since the last look: stay armed, look again in a while.
                    looked_at = seq
                    self._sleep(timeout / 4)
                    continue
                # No step runs, and none began since the last look: disarm, then look
                # again (see the class comment).
                self.armed = False
                event.clear()
                if self.started != 0.0 and not self.armed:
                    self.armed = True
                    event.set()
                continue
            now = time.monotonic()
            ran = now - started
            if ran < timeout:
                self._sleep(timeout - ran)
                continue
            if seq != self._reported:
                self._reported = seq
                self._report_stall(seq, started, ran)
            kill_after = self.kill_after
            if kill_after is not None:
                if ran >= kill_after:
                    self._kill(
                        f"StepTimeout('the step ran for {ran:.1f} s, past kill_after="
                        f"{kill_after:g} s; the stage was ended')"
                    )
                    return
                self._sleep(min(kill_after - ran, timeout))
            else:
                self._sleep(timeout)

    def _sleep(self, seconds: float) -> None:
        # The event stays set while armed, so the thread sleeps on a condition of its own,
        # which close() notifies.
        # At most TIMEOUT_MAX (292 years): a step_timeout past it (1e300) means "never",
        # where a longer wait raised OverflowError and ended the watchdog's thread.
        with self._cond:
            self._cond.wait_for(lambda: self._closed, min(seconds, threading.TIMEOUT_MAX))

    def _report_stall(self, seq: int, started: float, ran: float) -> None:
        with self._lock:
            if self.seq != seq or self.started != started:
                return  # it ended meanwhile
            self.stalled = True
            self._stalled_since = started
            self._post(("stalled", ran, self.step_timeout))  # under the lock: before resumed
        logger.error(
            "enginecore: a step has run for %.1f s (step_timeout %g s); the stacks of all "
            "threads follow on stderr",
            ran,
            self.step_timeout,
        )
        try:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except (OSError, ValueError, AttributeError):  # no usable stderr (pythonw, closed)
            logger.error("enginecore: could not dump the threads' stacks (no stderr)")
        # The step may have ended while the lock was held, and the loop thread then found
        # stalled still False: then resume here (_resume sends it once).
        if self.seq != seq or self.started != started:
            self._resume()
