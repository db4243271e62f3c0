"""The output side of a stage process: one queue, one thread, the output socket, and the one
policy for what cannot cross the wire.

::

    loop thread   -- post(a step's outputs) --+
    input thread  -- post(pong, input error) -+--> queue --> output thread --> PUSH --> client
    loop thread   -- emit(one event) ---------+    (or sent at once, while the output thread idles)

The output thread blocks on its queue (no timeout), takes everything waiting and sends it in
frames of at most :data:`MAX_BATCH` events. It ends after the terminal event (``shutdown`` or
``fatal``) or after :meth:`Outbox.close`. While it is idle (nothing queued, nothing unsent),
the loop thread sends a single event (a utility answer, ``aborted``), a step of at least
:data:`MAX_BATCH` outputs, or the last step before the loop idles itself, which saves a
thread wake-up (:meth:`Outbox.emit`, :meth:`Outbox.post_step`); other steps are queued, so
that consecutive ones share a frame.

What cannot cross the wire ends the request or call it belongs to with an error event, and
nothing else (:meth:`Outbox._replacements`, the one place that decides it). The same policy
serves an output that the engine's routing hook ended with a
:class:`~enginecore.RequestRejected` payload (:meth:`Outbox.prepare_outputs`): the
request's ``error`` event takes the output's place, and is the request's last event. If
that output was not its request's last, the request is also dropped from the engine,
through the ``abort_request`` callback: the one edge from the output side back to the
loop's input.

Sessions (``docs/wire.md`` section 3). Nothing produced for one client reaches the next:

- when a new client is welcomed, the input thread calls :meth:`Outbox.begin_session`, which
  drops everything queued, bumps the session *epoch* and queues a marker. A batch the
  output thread took before the marker (it may be waiting for a peer to send it to) is
  older than the new client, and is dropped: each frame is sent under the lock only while
  the output thread has consumed every marker (:meth:`Outbox._send`);
- the loop thread's events are dropped while the loop has not yet applied the new session
  (:meth:`Outbox.loop_epoch`, called in order with the loop's input): they answer the
  previous client's messages, or are outputs of its requests.

While no client can read (none attached, or the attached one lost its output connection),
at most ``detached_max`` events (one per output) are queued; the rest are dropped and
counted, and the input thread logs the count once the period ends (:meth:`set_detached`).
The terminal event is never dropped.
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Final, Protocol

import zmq

from .._exceptions import RequestRejected
from . import _codec
from ._stage_session import SessionGate

__all__ = ["BACKLOG_MAX", "MAX_BATCH", "Outbox", "StageOutput"]

logger = logging.getLogger("enginecore.stage")

MAX_BATCH: Final = 512
"""Upper bound on one output frame, in events: keeps frames (and latency) bounded under load."""

BACKLOG_MAX: Final = 65536
"""The loop waits before a step while more outputs than this are queued for a connected
client (:meth:`Outbox.wait_for_room`). A stage that serves several clients never waits: a
client with more than its bound queued (by default this) is detached (:mod:`._fanout`)."""

_STOP: Final = ("stop",)  # ends the output thread after what is queued before it; never sent
# Never dropped, by a session change or the detached bound.
_LAST: Final = frozenset({"stop", "shutdown", "fatal"})
# Kept across a new session: the last events, and the loop's "dropped" markers (the output
# thread's filter must forget an id even if the new session reuses it at once).
_KEPT: Final = _LAST | {"dropped"}
_ENCODE_ERRORS: Final = _codec.ENCODE_ERRORS
# How long cut_connections waits for its address to be free again (libzmq closes the
# listener after unbind returns); past it, the output thread fails, and the stage stops.
_REBIND_S: Final = 5.0

Events = list[tuple[Any, ...]]


class StageOutput(Protocol):
    """What the loop thread, the input side and the runtime need of the output side: an
    :class:`Outbox` (one client at a time), or a :class:`~._fanout.Fanout` (a stage that
    serves several clients, one ``Outbox`` each)."""

    @property
    def backlog(self) -> int: ...

    @property
    def detached_max(self) -> int: ...

    @property
    def terminal(self) -> str | None: ...

    @property
    def failed(self) -> bool: ...

    def start(self) -> None: ...

    def close(self, timeout: float) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...

    def post(self, item: Any, weight: int | None = None) -> None: ...

    def post_step(self, events: Events, weight: int, last: bool = False) -> None: ...

    def emit(self, ev: tuple[Any, ...]) -> None: ...

    def prepare_outputs(self, rids: list[Any], fins: list[Any], payloads: list[Any]) -> Events: ...

    def ended_dropped(self, req_ids: list[str]) -> None: ...

    def wait_for_room(self) -> None: ...

    def loop_epoch(self, epoch: int) -> None: ...

    def take_dropped(self) -> int: ...


class Outbox:
    """The output socket, its queue and its thread. ``start()`` once, ``close()`` once.

    *abort_request(req_id)* is called (on the loop or the output thread) for a request
    that an output ended with an error before its last output (the output could not be
    encoded, or was a :class:`~enginecore.RequestRejected`): it must drop the request from
    the engine without an ``aborted`` event; *on_failure()* once if the output thread fails;
    *may_wait()* says whether :meth:`wait_for_room` may keep the loop waiting (a client is
    connected to read, and the loop is not stopping). *detached_max* bounds what is queued
    while no client can read (:meth:`set_detached`).
    """

    # Threads and what they own:
    # - The output thread owns the socket, except while _idle (below).
    # - _lock guards _idle, backlog, _ended and every put on _queue. _idle is True while the
    #   output thread has sent everything it took and nothing is queued: then, and only
    #   under _lock, the loop thread may send on the socket itself (a zmq socket is used by
    #   one thread at a time; the lock orders the two users). Once the output thread has
    #   ended, _idle stays False.
    # - backlog counts what is queued or taken by the output thread and not yet sent, one
    #   per output and one per other event: _send takes a frame's weight off as it sends it.
    #   The loop thread peeks at it unlocked before each step (a stale read delays the wait
    #   by one step at most); _drained is signalled after every frame sent. begin_session
    #   counts all of it but the last events as dropped, including a batch the output
    #   thread holds for the previous client, and sets it to what is left.
    # - terminal is written under _lock by the thread that posts the terminal event (the
    #   loop's), failed by the output thread; both are read after the output thread has
    #   ended, or has been given up on (it may never take the terminal event: see post).
    # - resync is set by the input thread and cleared by whichever thread sends next, before
    #   it processes the socket's commands (_resync), so a set is never lost.
    # - _lock also guards the session state, _gate (a SessionGate): its epoch (bumped by
    #   begin_session, input thread), loop_epoch (the session the loop has applied,
    #   loop_epoch), detached and its counters (set_detached), and gated = "a loop event
    #   may be dropped" (stale loop epoch, or detached): the one flag the loop's hot path
    #   reads. The output thread sends a frame only under _lock and only while its own
    #   epoch (the last marker it took) is the gate's, so a begin_session between taking a
    #   batch and sending it is seen.

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        *,
        abort_request: Callable[[str], None],
        on_failure: Callable[[], None],
        may_wait: Callable[[], bool],
        detached_max: int = 1024,
        recheck_ms: int | None = None,
    ) -> None:
        self._sock = sock
        # How long the output thread waits for a peer before it checks again whether its
        # session has ended (None: until a peer takes the frame or ctx.term()). A client's
        # own socket (a multi-client stage, _fanout) sets it: end() must stop the thread
        # while the stage runs on.
        self._recheck_ms = recheck_ms
        self._final_linger: int | None = None  # end(): close without delivering
        self._abort_request = abort_request
        self._on_failure = on_failure
        self._may_wait = may_wait
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        self._idle = True
        self._ended = False
        self.backlog = 0
        self._loop_encoder = _codec.Encoder()  # the loop thread's, for emit()
        # "shutdown" or "fatal" once the loop has handed it over (post), whether or not it is
        # ever sent: the stage's exit code says how the loop ended (as Fanout.terminal).
        self.terminal: str | None = None
        self.failed = False
        self.resync = False  # see _resync
        # Whether the client takes no frames: the last send found the socket full (the
        # high-water mark: the client's PULL is behind) or without a peer (not connected
        # yet, or gone). Written by the thread that sends; read unlocked by a multi-client
        # stage's fan-out.
        self.stuck = False
        # The session's view (epochs, the detached bound, drop counts): under _lock.
        self._gate = SessionGate(detached_max)
        # Requests the output thread ended with an error (an output msgspec refused), whose
        # drop the loop has not applied yet: their later outputs, already stepped, are
        # dropped, so the error stays the request's last event. Output thread only; the
        # loop thread reads its truth value under _lock (no direct send while it is set).
        self._ended_ids: set[Any] = set()
        self._thread = threading.Thread(target=self._main, name="enginecore-output", daemon=True)
        # The address the socket is bound to (cut_connections binds it again there).
        self._endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def start(self) -> None:
        """Start the output thread."""
        self._thread.start()

    def close(self, timeout: float) -> None:
        """Let the output thread send everything queued, then end; wait for it up to
        *timeout* seconds. It may still be sending after that (``Context.term()`` ends it)."""
        self.post(_STOP)
        self._thread.join(timeout)

    @property
    def running(self) -> bool:
        """Whether the output thread has started and not ended."""
        return self._thread.is_alive()

    def end(self) -> int:
        """Any thread: the client this output socket served is gone (a multi-client stage's
        session ended, :mod:`._fanout`): drop what is queued, and end the output thread
        without waiting for a peer (within ``recheck_ms``); the socket closes with no linger.
        What the loop posts afterwards is dropped. Returns how many events (one per output)
        were dropped. Never blocks."""
        self._final_linger = 0
        _, dropped = self.begin_session()
        self.post(_STOP)
        return dropped

    def join(self, timeout: float | None = None) -> None:
        """Wait until the output thread has ended and closed the socket (at most *timeout*
        seconds)."""
        self._thread.join(timeout)

    # -- handing events over (any thread) ------------------------------------------------------

    def post(self, item: Any, weight: int | None = None) -> None:
        """Any thread: queue *item* for the output thread: a list of events ready for the
        wire, or one event without a payload (an input error, a pong, the terminal event).
        *weight* is :func:`_weight` of it, if the caller knows it. Never blocks.

        The terminal event is recorded in :attr:`terminal` here, not when the output thread
        takes it: while no client can read, the output thread may wait for a peer to take an
        earlier frame until the stage ends (``Context.term()``), and never take the
        terminal event, which nobody could read anyway. The loop still ended as it says
        (a ``serve`` stopped by SIGTERM while a detached client's requests ran exited 1)."""
        if weight is None:
            weight = _weight(item)
        with self._lock:
            gate = self._gate
            last = _is_last(item)
            if gate.detached and not gate.admit(last, weight):
                return
            if last and item[0] != "stop":
                self.terminal = item[0]
            self._idle = False
            self.backlog += weight
            self._queue.put(item)

    def _post_loop(self, item: Any, weight: int) -> None:
        """Loop thread: :meth:`post`, also dropping what belongs to a previous session."""
        with self._lock:
            if self._gate.gated and not self._gate.admit_loop(_is_last(item), weight):
                return
            self._idle = False
            self.backlog += weight
            self._queue.put(item)

    def post_step(self, events: Events, weight: int, last: bool = False) -> None:
        """Loop thread: one step's events (its ``outputs`` and any errors), *weight* outputs.
        *last*: the engine has no more work after this step, so the loop is about to idle.

        A step of at least :data:`MAX_BATCH` outputs fills a frame by itself: while the
        output thread is idle, the loop thread encodes and sends it at once
        (:meth:`_send_or_post`), so the client can start on it while the next step runs.
        Queued instead, it would wait for the output thread to get the GIL, which with a
        pure-Python engine is after the loop has gone idle: a burst of 8 steps of 2,000
        outputs then left as one frame, ~3 ms after the first step (measured), with the
        client idle meanwhile. Smaller steps are queued, so consecutive ones share a frame,
        except the *last* before the loop idles, which no later step could share a frame
        with: the loop sends it too, saving the output thread's wake-up (measured ~240 us
        from the post to the client's read, on a stage that steps now and then). An engine
        whose ``step()`` releases the GIL pays the encoding between its steps (~20 ns per
        output) instead of overlapping it; measured no difference. Never blocks.
        """
        if (last or weight >= MAX_BATCH) and self._idle:  # unlocked peek; re-checked
            self._send_or_post(events)
        else:
            self._post_loop(events, weight)

    def emit(self, ev: tuple[Any, ...]) -> None:
        """Loop thread: one event of the loop (a utility answer, ``aborted``, ``shutdown``,
        ``fatal``), in the loop's order. A utility result that cannot cross the wire
        becomes that call's error. Never blocks."""
        kind = ev[0]
        if kind in ("shutdown", "fatal"):
            self.post(ev)  # the output thread ends with it
            return
        if kind == "utility" and ev[3] is None and type(ev[2]) not in _codec.FLAT_TYPES:
            try:
                ev = ("utility", ev[1], _codec.prepare(ev[2], "utility result"), None)
            except TypeError as exc:
                ev = self._replacements(ev, exc, self._loop_encoder)[0]
        self._send_or_post([ev])

    def prepare_outputs(self, rids: list[Any], fins: list[Any], payloads: list[Any]) -> Events:
        """Loop thread: a step's ``outputs`` event with each payload prepared for the wire
        (arrays, buffers, numpy scalars), and an error for each one that cannot cross it
        or that is a :class:`~enginecore.RequestRejected` (the routing hook ended its
        request with that error). The caller has checked that some payload is not of a
        flat type: neither costs anything on the all-flat fast path."""
        flat = _codec.FLAT_TYPES
        prepared = list(payloads)
        bad: list[tuple[int, Exception]] = []
        for i, payload in enumerate(payloads):
            if type(payload) not in flat:
                if isinstance(payload, RequestRejected):
                    bad.append((i, payload))
                    continue
                try:
                    prepared[i] = _codec.prepare(payload, "output payload")
                except TypeError as exc:
                    bad.append((i, exc))
        return self._split_outputs(rids, fins, prepared, bad)

    def ended_dropped(self, req_ids: list[str]) -> None:
        """Loop thread: the drop of *req_ids*, which an output error ended, is applied (see
        ``_controls.DropEnded``): what the loop emits from now on is of new requests.
        Tells the output thread in order with the loop's events; never blocks."""
        with self._lock:
            self._idle = False
            self._queue.put(("dropped", req_ids))

    def wait_for_room(self) -> None:
        """Loop thread, before a step: wait while more than :data:`BACKLOG_MAX` events are
        queued and ``may_wait()``.

        Without this, an engine that outpaces its client queues outputs without bound, and
        a utility answer or the shutdown event, queued behind them, waits as long as the
        client needs to read them all (tens of seconds, measured). Never while no client is
        connected (outputs wait in memory for the next one), and never past a shutdown
        request or the end of the output thread; re-checks those every 50 ms.
        """
        with self._drained:
            while self.backlog > BACKLOG_MAX and not self._ended and self._may_wait():
                self._drained.wait(0.05)

    def _send_or_post(self, events: Events) -> None:
        """Loop thread: send *events* now if the output thread is idle, else queue them
        behind what it has. Saves a thread hand-off (a wake-up, ~30-60 us here) per
        utility answer, and sends a big step as soon as it is done (:meth:`post_step`).

        The send never blocks: if the socket cannot take a frame at once (no client yet, or
        it is behind by the high-water mark) or fails, the rest is queued, and the output
        thread sends it the usual way (and handles a failure the usual way).
        """
        with self._lock:
            if self._gate.gated and not self._gate.admit_loop(False, _weight(events)):
                return
            if self._idle and not self._ended_ids:
                if self.resync:
                    self._resync()
                encoder = self._loop_encoder
                sock = self._sock
                start = 0
                while start < len(events):
                    chunk = events[start : start + MAX_BATCH]
                    try:
                        parts = encoder.encode(chunk)
                    except _ENCODE_ERRORS:
                        # The replacements may be more events than the chunk (an error per
                        # bad output): what is past MAX_BATCH goes in the next frame.
                        events[start : start + MAX_BATCH] = self._encodable(encoder, chunk)
                        chunk = events[start : start + MAX_BATCH]
                        if not chunk:
                            continue
                        parts = encoder.encode(chunk)
                    try:
                        _codec.send_parts(sock, parts, zmq.NOBLOCK)
                    except zmq.ZMQError:
                        break
                    start += len(chunk)
                else:
                    return
                events = events[start:]
            self._idle = False
            self.backlog += _weight(events)
            self._queue.put(events)

    def _resync(self) -> None:
        """Make libzmq drop the output connections that have closed, before a send.

        libzmq learns that a connection closed from a command to the socket, and processes
        commands on send at most once a millisecond. Until then, a ``PUSH`` still deals
        messages to the closed connection, where they are lost: right after the previous
        client's ``bye``, that was often the new client's first events.
        The caller owns the socket; an unthrottled ``getsockopt(EVENTS)`` processes every
        pending command. Once the new client has spoken, the previous client's connection
        is among them (see ``_stage_session.StageSession.receive``).
        """
        self.resync = False
        self._sock.getsockopt(zmq.EVENTS)

    # -- sessions --------------------------------------------------------------------------------

    def begin_session(self) -> tuple[int, int]:
        """Input thread, when a new client is welcomed (before its ``welcome`` is sent): drop
        everything queued for the previous one, and start a new session epoch. Returns the
        new epoch, to be applied by the loop in order (:meth:`loop_epoch`), and how many
        events were dropped. Never blocks."""
        with self._lock:
            last: Events = []
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item.__class__ is not list and item[0] in _KEPT:
                    last.append(item)
            kept = sum(item[0] in _LAST for item in last)  # a "dropped" marker weighs 0
            # What the output thread has taken and not sent is the previous client's too: it
            # is never sent (_send checks the epoch), and no longer counted.
            dropped = max(0, self.backlog - kept)
            self.backlog = kept
            epoch = self._gate.begin()  # gated until the loop has applied the new epoch
            self._idle = False  # the output thread has the marker to take
            self._queue.put(("session", epoch))
            for item in last:
                self._queue.put(item)
            self._drained.notify()
            return epoch, dropped

    def cut_connections(self) -> None:
        """Input thread, when the attached client of a one-client stage has been revoked
        (its CURVE key removed): close every connection of the output socket. A ``PUSH``
        cannot close one peer, and a revoked client that kept its ``PULL`` connected would
        keep every new client out (a ``hello`` is welcomed only once nothing is connected):
        the output thread unbinds the socket's address and binds it again, which drops the
        connections made through it (the monitor sees the listener's close, and the input
        side counts no peer left). A peer that connects again is checked against the
        current keys. Skipped if a new session began before the output thread got to it
        (its client's connection stays). Never blocks."""
        with self._lock:
            self._idle = False  # the output thread owns the socket until it has done it
            self._queue.put(("cut", self._gate.epoch))
            self._drained.notify()

    def _cut(self, epoch: int) -> None:
        """Output thread: :meth:`cut_connections`, unless session *epoch* has ended."""
        with self._lock:  # no begin_session between the check and the unbind
            if self._gate.epoch != epoch:
                return
            self._sock.unbind(self._endpoint)
        # libzmq closes the listener on its IO thread, after unbind() returns: the address
        # may still be in use for a moment. A client welcomed meanwhile (the monitor saw
        # the close) connects once it is bound: its PULL retries.
        deadline = time.monotonic() + _REBIND_S
        while True:
            try:
                self._sock.bind(self._endpoint)
                break
            except zmq.ZMQError as exc:
                if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.002)
        logger.info("enginecore: closed the output socket's connections (bound it again)")

    def loop_epoch(self, epoch: int) -> None:
        """Loop thread, in order with its input: the messages after this one come from the
        session *epoch* (:meth:`begin_session`); the loop's events are sent again."""
        with self._lock:
            self._gate.loop_begun(epoch)

    def set_detached(self, detached: bool) -> int:
        """Input thread: whether no client can read (none attached, or the attached one lost
        its output connection). While detached, at most ``detached_max`` events are queued.
        Returns how many were dropped past it, when a detached period ends (else 0)."""
        with self._lock:
            return self._gate.set_detached(detached)

    @property
    def detached_max(self) -> int:
        """The bound on what is queued while no client can read (events, one per output)."""
        return self._gate.detached_max

    def take_dropped(self) -> int:
        """How many events were dropped past ``detached_max`` in the detached period under
        way (0 if none); the count starts again. Any thread; never blocks."""
        with self._lock:
            return self._gate.take_dropped()

    def _send(self, parts: list[Any], epoch: int, weight: int) -> bool:
        """Output thread: send one frame of *weight* events, waiting for a peer to take it;
        ``False`` (nothing sent) once a new session has begun after the output thread's
        *epoch* (:meth:`begin_session` has counted the frame as dropped).

        The check and the send are one step under the lock, and the wait is outside it: a
        batch taken for a previous client, and waiting for a peer, is never sent to the
        next one once its ``PULL`` connects."""
        sock = self._sock
        while True:
            with self._lock:
                if self._gate.epoch != epoch:
                    return False
                try:
                    if len(parts) == 1:
                        sock.send(parts[0], zmq.NOBLOCK, copy=False)
                    else:
                        _codec.send_parts(sock, parts, zmq.NOBLOCK)
                except zmq.Again:
                    self.stuck = True
                else:
                    if self.stuck:
                        self.stuck = False
                    self.backlog -= weight
                    if self.backlog <= BACKLOG_MAX:
                        self._drained.notify()
                    return True
            # No peer, or the peer is behind by the high-water mark. ctx.term() ends the
            # wait with ContextTerminated, as it ended a blocking send; end() by the epoch
            # check above, at most recheck_ms later.
            sock.poll(self._recheck_ms, zmq.POLLOUT)

    # -- the output thread ---------------------------------------------------------------------

    def _main(self) -> None:
        get = self._queue.get
        send = self._send
        encoder = _codec.Encoder()
        epoch = 0  # of the last session marker taken
        linger: int | None = None  # the socket's own: deliver the last frames
        ending = False  # the batch taken ends with the terminal event
        try:
            while True:
                # Everything waiting, then one frame per MAX_BATCH events. A list holds
                # events ready for the wire (a step's outputs, a utility answer); anything
                # else is one event without a payload.
                item = get()  # blocks; no timeout: _STOP or the terminal event ends it
                events: Events = []
                done = False
                taken = 0
                while True:
                    if item.__class__ is list:
                        if self._ended_ids:
                            item = self._without_ended(item)
                        events += item
                        taken += _weight(item)
                    else:
                        kind = item[0]
                        if kind == "dropped":
                            self._ended_ids.difference_update(item[1])
                        elif kind == "session":
                            # What was taken before it belongs to the previous session
                            # (begin_session has counted it as dropped).
                            epoch = item[1]
                            events = []
                            taken = 0
                        elif kind == "stop":
                            done = True
                            break
                        elif kind == "cut":
                            self._cut(item[1])
                        else:
                            taken += 1
                            events.append(item)
                            if kind in ("shutdown", "fatal"):
                                ending = done = True
                                break
                    if len(events) >= MAX_BATCH:
                        break
                    try:
                        item = get(block=False)
                    except queue.Empty:
                        break
                if self.resync:
                    self._resync()
                for start in range(0, len(events), MAX_BATCH):
                    chunk = (
                        events if len(events) <= MAX_BATCH else events[start : start + MAX_BATCH]
                    )
                    weight = taken if chunk is events else _weight(chunk)
                    if start and self._ended_ids:  # an earlier chunk ended a request
                        chunk = _drop_outputs_of(chunk, self._ended_ids)
                    try:
                        frames = [encoder.encode(chunk)]
                    except _ENCODE_ERRORS:
                        # The replacements may be more events than the chunk (an error per
                        # bad output): cut again, so that no frame has more than MAX_BATCH.
                        chunk = self._encodable(encoder, chunk, self._ended_ids)
                        frames = [
                            encoder.encode(chunk[i : i + MAX_BATCH])
                            for i in range(0, len(chunk), MAX_BATCH)
                        ]
                    if not chunk:  # all of it was filtered out
                        with self._lock:
                            self.backlog -= weight
                        continue
                    # The chunk's weight goes off the backlog with its last frame.
                    last = len(frames) - 1
                    if not all(
                        send(parts, epoch, weight if i == last else 0)
                        for i, parts in enumerate(frames)
                    ):
                        # A new session began: the rest is the previous one's, except the
                        # terminal event, which is every client's.
                        if ending:
                            send(encoder.encode(events[-1:]), self._gate.epoch, 0)
                        break
                if done:
                    return
                # Nothing of this batch lives on while the thread waits for the next one:
                # its payloads (a pipeline stage's arrays, and the shared memory under them)
                # would stay alive until the next event.
                item = None
                events = chunk = []
                frames = []
                with self._lock:
                    if self._queue.empty():
                        self._idle = True  # the loop thread may send (_send_or_post)
        except zmq.ContextTerminated:
            # The process is ending and no client is reading (none attached, or it is gone):
            # what is left cannot be delivered.
            linger = 0
        except BaseException:
            logger.exception("enginecore: the output thread failed; shutting the stage down")
            self.failed = True
            linger = 0
            self._on_failure()
        finally:
            with self._lock:
                self._idle = False  # for good: the loop thread no longer sends
                self._ended = True
                self._drained.notify()
            self._sock.close(linger=self._final_linger if linger is None else linger)

    # -- what cannot cross the wire --------------------------------------------------------------

    def _encodable(
        self,
        encoder: _codec.Encoder,
        events: Iterable[tuple[Any, ...]],
        ended: set[Any] | None = None,
    ) -> Events:
        """*events*, each one that msgspec refuses replaced (see :meth:`_replacements`).

        Only reached for what passed the checks and that msgspec then refuses: an int out
        of range after the flat fast path, a str with a lone surrogate. A request that an
        ``error`` ends here has its outputs in the later *events* dropped, and its id is
        added to *ended* (the output thread's filter, for the steps the loop runs before
        it has dropped the request; the loop thread passes none: it drops the request
        before its next step)."""
        good: Events = []
        ended_here: set[Any] = set()
        for event in events:
            ev = event
            if ended_here and ev[0] == "outputs":
                ev = _outputs_without(ev, ended_here)
                if not ev[1]:
                    continue
            try:
                encoder.encode(ev)
            except _ENCODE_ERRORS as exc:
                replacements = self._replacements(ev, exc, encoder)
                if ev[0] == "outputs":
                    fins = dict(zip(ev[1], ev[2], strict=True))
                    for r in replacements:
                        if r[0] == "error" and r[1] is not None and not fins.get(r[1], True):
                            ended_here.add(r[1])
                good += replacements
            else:
                good.append(ev)
        if ended is not None:
            ended |= ended_here
        return good

    def _without_ended(self, events: Events) -> Events:
        """Output thread: *events* without the outputs of the requests in
        :attr:`_ended_ids`; what is left out is taken off the backlog at once."""
        kept = _drop_outputs_of(events, self._ended_ids)
        lost = _weight(events) - _weight(kept)
        if lost:
            with self._lock:
                self.backlog -= lost
        return kept

    def _replacements(self, ev: tuple[Any, ...], exc: Exception, encoder: _codec.Encoder) -> Events:
        """What is sent instead of *ev*, which cannot cross the wire (*exc* says why).

        The policy: the request or call *ev* belongs to ends with an error, and nothing
        else does. An ``outputs`` event keeps its good outputs; each bad one becomes an
        ``error`` for its request (:meth:`_split_outputs`). A utility answer becomes that
        call's error. A request's ``error`` whose message cannot be encoded (a lone
        surrogate in a :class:`~enginecore.RequestRejected` message) keeps its request,
        with the message escaped. Anything else becomes an unscoped ``error``. Each
        replacement is checked with *encoder* (the calling thread's): should even that fail
        (an id that cannot be encoded), an unscoped ``error`` is all that is left to send.
        """
        kind = ev[0]
        if kind == "outputs":
            rids, fins, payloads = ev[1], ev[2], ev[3]  # a load report may follow: it goes
            bad: list[tuple[int, Exception]] = []
            for i, payload in enumerate(payloads):
                try:
                    encoder.encode((rids[i], payload))  # a bad id: see below
                except _ENCODE_ERRORS as payload_exc:
                    bad.append((i, TypeError(f"output payload cannot be encoded: {payload_exc!r}")))
            replacements = self._split_outputs(rids, fins, payloads, bad)
        elif kind == "utility":
            logger.error("enginecore: a utility result cannot be encoded: %s", exc)
            if not isinstance(exc, TypeError):  # prepare()'s TypeError already says where
                exc = TypeError(f"utility result cannot be encoded: {exc!r}")
            replacements = [("utility", ev[1], None, repr(exc))]
        elif kind == "error" and ev[1] is not None:
            replacements = [("error", ev[1], ascii(ev[2]))]
        else:
            logger.error("enginecore: dropping an event that cannot be encoded: %s", exc)
            replacements = [("error", None, f"{kind} event cannot be encoded: {exc!r}")]
        good: Events = []
        for candidate in replacements:
            try:
                encoder.encode(candidate)
            except _ENCODE_ERRORS:
                good.append(("error", None, f"{kind} event cannot be encoded: {exc!r}"))
            else:
                good.append(candidate)
        return good

    def _split_outputs(
        self,
        rids: list[Any],
        fins: list[Any],
        payloads: list[Any],
        bad: list[tuple[int, Exception]],
    ) -> Events:
        """The ``outputs`` event without the *bad* outputs (index, why), then one ``error``
        for each: the last event of its request, which is dropped from the engine
        (``abort_request``) unless that output was its last anyway. *why* is a
        :class:`~enginecore.RequestRejected` for an output the routing hook ended with an
        error, whose message the client gets as it is."""
        if not bad:
            return [("outputs", rids, fins, payloads)]
        skip = {i for i, _ in bad}
        # The error is its request's last event: a request's later outputs in this step (its
        # last one too, which would end it before the error came: the error would be late,
        # and the bad output lost without a word) go, and so do its later bad ones.
        first: dict[Any, int] = {}
        for i, _ in bad:
            rid = rids[i]
            if rid is not None and rid not in first:
                first[rid] = i
        if first:
            skip.update(j for j, rid in enumerate(rids) if j > first.get(rid, j))
            bad = [(i, exc) for i, exc in bad if rids[i] is None or first[rids[i]] == i]
        keep = [i for i in range(len(payloads)) if i not in skip]
        events: Events = []
        if keep:
            events.append(
                (
                    "outputs",
                    [rids[i] for i in keep],
                    [fins[i] for i in keep],
                    [payloads[i] for i in keep],
                )
            )
        for i, exc in bad:
            rid = rids[i]
            if isinstance(exc, RequestRejected):
                # The engine's decision, not a failure of the stage: the event reports it.
                message = str(exc)
                logger.debug("enginecore: request %r ended by the engine: %s", rid, message)
                if rid is None:
                    message = f"an unrouted engine output is an error: {message}"
            else:
                logger.error("enginecore: dropping an output that cannot be encoded: %s", exc)
                if rid is None:
                    message = f"an unrouted engine output cannot be encoded: {exc}"
                elif fins[i]:
                    message = f"the last output cannot be encoded: {exc}"
                else:
                    message = f"output cannot be encoded, request aborted: {exc}"
            if rid is not None and not fins[i]:
                # The engine may still have the request (unless a later output of it in this
                # step was its last): drop it there before it steps again.
                self._abort_request(rid)
            events.append(("error", rid, message))
        return events


def _drop_outputs_of(events: Events, req_ids: set[Any]) -> Events:
    """*events* without the outputs of *req_ids* (an ``outputs`` event left empty goes)."""
    kept: Events = []
    for ev in events:
        if ev[0] == "outputs" and not req_ids.isdisjoint(ev[1]):
            rest = _outputs_without(ev, req_ids)
            if rest[1]:
                kept.append(rest)
        else:
            kept.append(ev)
    return kept


def _outputs_without(ev: tuple[Any, ...], req_ids: set[Any]) -> tuple[Any, ...]:
    """The ``outputs`` event *ev* without the outputs of *req_ids* (and with its load
    report, if it has one)."""
    rids, fins, payloads = ev[1], ev[2], ev[3]
    keep = [i for i, rid in enumerate(rids) if rid not in req_ids]
    return (
        "outputs",
        [rids[i] for i in keep],
        [fins[i] for i in keep],
        [payloads[i] for i in keep],
        *ev[4:],
    )


def _is_last(item: Any) -> bool:
    """Whether *item* (as :meth:`Outbox.post` takes it) is the stage's last event."""
    return item.__class__ is not list and item[0] in _LAST


def _weight(item: Any) -> int:
    """What *item* adds to the backlog: one per output, one per other event."""
    if item.__class__ is not list:
        return 1
    w = 0
    for ev in item:
        w += len(ev[3]) if ev[0] == "outputs" else 1
    return w
