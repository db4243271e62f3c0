"""The input side of a stage process: one thread reads the input socket, checks what arrives
and hands it to the loop; it also keeps the session (who the attached client is).

The input thread blocks in ``poll`` on the input socket (``ROUTER``) and on the output
socket's monitor, which tells it how many clients are connected to the output socket. It
polls with no timeout, except while a ``hello`` is held (below). On each wake-up it reads
every message already waiting (up to :data:`MAX_BURST`), decodes and checks each one, and
hands the valid ones to the loop's queue in one go, in arrival order: a burst costs one
poll, one lock and one wake-up of the loop thread, not one of each per message. While the
loop is idle, the loop thread itself does this reading (:meth:`Inbox.read`), inside its
queue's ``get()``, and between its short steps, and the input thread is parked: see
:mod:`._input_queue`.

Nothing invalid reaches the engine (``docs/wire.md`` section 6). A message that cannot be
decoded, or whose payload is not a valid wire value, becomes an error event scoped to what
it names, if that can be read from it: a request-scoped ``error`` for each request id, a
failed answer for a utility call id, a ``reject`` for a ``hello``; otherwise an unscoped
``error``. Errors and pongs go straight to the output thread, not through the loop.

Sessions (``docs/wire.md`` section 3): one client at a time. A ``hello`` is rejected while
another client is attached and has been heard from within the session timeout. The output
socket is a ``PUSH``: it deals events out round-robin to every connected ``PULL``, so the
new client must be the only one before its first event is sent. Two things see to that:

- a ``hello`` is not welcomed while anything is still connected to the output socket (right
  after a ``bye``, the previous client's ``PULL`` often still is). It is *held*, unanswered,
  until the monitor reports the disconnect, then welcomed; after :data:`HELLO_HOLD_S` it is
  rejected;
- when the new client's first message arrives, the output socket is made to drop the closed
  connection before it sends again (``Outbox.resync``): libzmq may otherwise go on dealing
  to it for up to a millisecond.

Nothing of one session reaches the next: a ``bye`` queues a session change for the loop,
in order after the client's messages (its live requests are aborted there, by default), and
welcoming a new client drops what the outbox holds for the previous one and queues the new
session's change (``Outbox.begin_session``, ``_stage_engine.session_change``). While no
client can read (none attached, or the attached one lost its output connection) the outbox
is *detached* and bounded (``Outbox.set_detached``); this thread logs what it dropped.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Any, Final, cast

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from .._loop import EngineCoreLoop
from .._messages import Abort, make_add, make_utility
from . import _codec, _wire
from ._input_queue import InputQueue
from ._outbox import Outbox
from ._stage_engine import adds, ordered_stop, session_change

__all__ = ["HEARTBEAT_TIMEOUT_MS", "HELLO_HOLD_S", "MAX_BURST", "Inbox"]

logger = logging.getLogger("enginecore.stage")

MAX_BURST: Final = 512
"""Messages read per wake-up of the input thread before they are handed to the loop."""

HEARTBEAT_TIMEOUT_MS: Final = 5000
"""The stage's ZMTP heartbeat timeout: a TCP peer that vanished is dropped after this."""

HELLO_HOLD_S: Final = HEARTBEAT_TIMEOUT_MS / 1000
"""How long a ``hello`` is held while the output socket still has a connection: as long as
the heartbeat needs to drop one whose peer vanished."""

# Plain ints: zmq's constants are enum flags, and `int & flag` goes through enum's Python
# code (~1 µs).
_EVENTS: Final = int(zmq.EVENTS)
_POLLIN: Final = int(zmq.POLLIN)

# Exact types of received data that need no check (decoded ints are always in range).
_RECEIVED_FLAT: Final = frozenset({type(None), bool, int, float, str, bytes})


def log_detached_drops(dropped: int, detached_max: int, *, at_exit: bool = False) -> None:
    """Log, once per detached period, what the outbox dropped past its bound."""
    if dropped:
        logger.warning(
            "enginecore: dropped %d events (one per output) while no client could read "
            "them (the detached buffer holds %d)%s",
            dropped,
            detached_max,
            "; the stage stopped before a client attached" if at_exit else "",
        )


class Inbox:
    """The input socket, the output socket's monitor, the session, and the input thread.
    ``start()`` once; ``Context.term()`` ends the thread (:meth:`join` waits for it).

    Valid messages go to *loop*'s input queue, an :class:`~._input_queue.InputQueue`,
    errors and pongs to *outbox*. If the thread fails, :attr:`failed` is set and the loop
    is asked to shut down.
    """

    # Everything here belongs to the thread that holds the input side (the input thread, or
    # the loop inside InputQueue.get() or after_step(); they pass it under the queue's
    # mutex), except output_peers, which the loop thread also reads unlocked while it does
    # not hold it (Outbox.wait_for_room's may_wait; a stale read is harmless).

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        out_monitor: zmq.Socket[bytes],
        loop: EngineCoreLoop,
        outbox: Outbox,
        *,
        engine_name: str,
        output_address: str,
        session_timeout: float,
    ) -> None:
        if not isinstance(loop.input_queue, InputQueue):
            raise TypeError("the loop's input_queue must be an InputQueue")
        self.sock = sock
        self.monitor = out_monitor
        self.loop = loop
        self._outbox = outbox
        self._post = outbox.post
        self._welcome = msgspec.msgpack.encode(
            _wire.WelcomeMsg(_wire.PROTOCOL_VERSION, output_address, os.getpid(), engine_name)
        )
        self._session_timeout = session_timeout
        self._decoder = _codec.Decoder(_wire.ClientMsg, strict=False)
        # Decoded messages not yet handed to the loop (see _main).
        self.pending: list[Any] = []
        # The attached client's routing id and when it was last heard from.
        self._session: bytes | None = None
        self._session_seen = 0.0
        self._unheard = False  # welcomed, and no message from it yet
        # A hello waiting for the output socket to lose its last connection:
        # (routing id, deadline, why it is rejected at the deadline).
        self._held: tuple[bytes, float, str] | None = None
        self.output_peers = 0  # connections to the output socket, from its monitor
        # Whether the attached client's PULL has connected, and whether no client can read
        # (see _update_detached).
        self._pull_seen = False
        self._detached = True
        self.failed = False
        self._queue = loop.input_queue
        self._queue.attach(self)
        self._thread = threading.Thread(target=self._main, name="enginecore-input", daemon=True)

    @property
    def attached(self) -> bool:
        """Whether a client is attached (welcomed, and has not left). Read unlocked by the
        loop thread at teardown; a stale read is harmless."""
        return self._session is not None

    def start(self) -> None:
        """Start the input thread."""
        self._thread.start()

    def join(self) -> None:
        """Wait until the input thread has ended (after ``Context.term()``)."""
        self._thread.join()

    # -- the input thread ------------------------------------------------------------------------

    def _main(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        q = self._queue
        try:
            while True:
                try:
                    q.wait_turn()  # while the idle loop reads the input side itself
                    self.read(poller)
                except zmq.ContextTerminated:
                    return
                finally:
                    q.hand_over(self.pending)
        except BaseException:
            logger.exception("enginecore: the input thread failed; shutting the stage down")
            self.failed = True
            self.loop.request_shutdown()
        finally:
            self.monitor.close(linger=0)
            self.sock.close(linger=0)

    def read(self, poller: zmq.Poller, timeout_ms: int | None = None) -> dict[Any, int]:
        """Wait in *poller* (up to *timeout_ms*, ``None``: no timeout; a held hello's
        deadline shortens it), then read and handle what the sockets have: the monitor's
        events, every message already waiting (up to :data:`MAX_BURST`), a held hello's
        fate. The valid messages are left in :attr:`pending`, in order. Returns what
        *poller* found ready.

        Called by whichever thread holds the input side: the input thread, or the loop while
        idle or between short steps (:class:`~._input_queue.InputQueue`)."""
        held = self._held
        if held is not None:
            until = _ms_until(held[1])
            timeout_ms = until if timeout_ms is None else min(timeout_ms, until)
        ready = dict(poller.poll(timeout_ms))
        if self.monitor in ready:
            self._count_output_peers()
        if self.sock in ready:
            sock = self.sock
            for i in range(MAX_BURST):
                try:
                    parts = _recv(sock)
                except zmq.Again:
                    break
                self._handle_one(parts)
                # A lone message (a utility call, most often) ends here: asking whether
                # another is waiting costs ~1.2 µs, a receive that fails ~2.5 (pyzmq builds
                # an Again); a burst pays both, once.
                if i == 0 and not cast(int, sock.getsockopt(_EVENTS)) & _POLLIN:
                    break
        if self._held is not None:
            self._settle_held(self._held)
        return ready

    def has_input(self) -> bool:
        """Whether :meth:`read` has anything to do at once: a message or a monitor event
        waiting, or a held ``hello``. ``ZMQ_EVENTS`` on each socket: ~1.2 µs each, and,
        unlike a ``poll``, the calling thread keeps the GIL."""
        if self._held is not None:
            return True
        events = cast(int, self.sock.getsockopt(_EVENTS))
        return bool((events | cast(int, self.monitor.getsockopt(_EVENTS))) & _POLLIN)

    def _handle_one(self, parts: list[Any]) -> None:
        try:
            self._handle(parts)
        except Exception as exc:  # a bug here must not kill the thread
            logger.exception("enginecore: error while handling an input frame")
            self._post(("error", None, f"stage failed to handle a frame: {exc!r}"))

    def _handle(self, parts: list[Any]) -> None:
        ident = parts[0]
        try:
            msg = self._decoder.decode(parts[1:])
        except Exception as exc:  # DecodeError; also RecursionError for a deep nesting
            self._report_bad_frame(ident, parts[1], exc)
            return
        if ident == self._session:
            self._session_seen = time.monotonic()
            if self._unheard:
                # The first message of a new client: its events follow. libzmq's IO thread
                # (this context has one) finished closing the previous client's output
                # connection, down to the command that tells the output socket, before it
                # read this message; a resync makes the output socket act on that command
                # before it sends anything more (Outbox._resync).
                self._unheard = False
                self._outbox.resync = True
        put = self.pending.append  # handed to the loop after the read, in order
        cls = type(msg)
        if cls is _wire.AddMsg:
            data = msg.data
            if type(data) not in _RECEIVED_FLAT:
                problem = _invalid(data, "data")
                if problem is not None:
                    self._post(("error", msg.req_id, f"invalid message: {problem}"))
                    return
            put(make_add(msg.req_id, data))
        elif cls is _wire.AddsMsg:
            self._adds(msg)
        elif cls is _wire.AbortMsg:
            put(Abort(msg.req_ids))
        elif cls is _wire.UtilityMsg:
            args = msg.args
            if args and not set(map(type, args)) <= _RECEIVED_FLAT:
                problem = _invalid(args, "args")
                if problem is not None:
                    self._post(("utility", msg.call_id, None, f"ProtocolError({problem!r})"))
                    return
            put(make_utility(msg.call_id, msg.name, tuple(args)))
        elif cls is _wire.PingMsg:
            self._post(("pong", msg.seq))
        elif cls is _wire.ShutdownMsg:
            drain = msg.drain
            if drain is not None and not 0 <= drain < math.inf:
                self._post(
                    ("error", None, f"invalid message: shutdown drain must be >= 0, got {drain}")
                )
                return
            put(ordered_stop(drain))
        elif cls is _wire.HelloMsg:
            self._hello(ident, msg)
        elif cls is _wire.ByeMsg:
            self._bye(ident)

    def _adds(self, msg: _wire.AddsMsg) -> None:
        req_ids, data = msg.req_ids, msg.data
        if len(req_ids) != len(data):
            what = (
                f"invalid message: adds has {len(req_ids)} request ids but {len(data)} data items"
            )
            self._post([("error", rid, what) for rid in req_ids] or [("error", None, what)])
            return
        if not req_ids:
            return
        if set(map(type, data)) <= _RECEIVED_FLAT:  # nothing to check: one burst
            self.pending.append(adds(req_ids, data))
            return
        ok_ids: list[str] = []
        ok_data: list[Any] = []
        errors: list[tuple[Any, ...]] = []
        for rid, item in zip(req_ids, data, strict=True):
            if type(item) not in _RECEIVED_FLAT:
                problem = _invalid(item, "data")
                if problem is not None:
                    errors.append(("error", rid, f"invalid message: {problem}"))
                    continue
            ok_ids.append(rid)
            ok_data.append(item)
        if ok_ids:
            self.pending.append(adds(ok_ids, ok_data))
        if errors:
            self._post(errors, len(errors))

    def _report_bad_frame(self, ident: bytes, body: Any, exc: Exception) -> None:
        # Recover the tag and an id from the head of the body, so that the error reaches
        # the one request or call it concerns instead of leaving it hanging.
        raw = body.buffer if isinstance(body, zmq.Frame) else body
        tag, head = _codec.recover_head(raw)
        why = str(exc) if isinstance(exc, msgspec.DecodeError) else f"{type(exc).__name__}: {exc}"
        what = f"invalid message ({len(raw)} bytes): {why}"
        if tag == "add" and type(head) is str:
            self._post(("error", head, what))
        elif tag == "adds" and type(head) is list and head:
            self._post([("error", rid, what) for rid in head], len(head))
        elif tag == "utility" and type(head) is int:
            self._post(("utility", head, None, f"ProtocolError({what!r})"))
        elif tag == "hello":
            self._reject(ident, f"invalid hello: {what}")
        else:
            self._post(("error", None, what))

    # -- sessions --------------------------------------------------------------------------------

    def _hello(self, ident: bytes, msg: _wire.HelloMsg) -> None:
        if msg.version != _wire.PROTOCOL_VERSION:
            self._reject(
                ident,
                f"protocol version {msg.version} is not supported; this stage speaks "
                f"version {_wire.PROTOCOL_VERSION}",
            )
            return
        if ident == self._session:  # the attached client, again
            self._accept(ident)
            return
        if self._held is not None:
            if self._held[0] != ident:
                self._reject(ident, "another client is connecting to this stage")
            return  # the same client again: its first hello is still held
        silent = self._session is not None
        if silent and time.monotonic() - self._session_seen < self._session_timeout:
            self._reject(ident, "another client is attached to this stage")
            return
        self._count_output_peers()  # what happened while this burst was read
        if self.output_peers == 0:
            self._accept(ident)
            return
        if silent:
            why = (
                "another client is attached to this stage: it has been silent for the session "
                "timeout, but it is still connected to the output socket"
            )
        else:
            why = (
                f"another client is still connected to the output socket after "
                f"{HELLO_HOLD_S:g} s (a client that sends bye must close its PULL socket)"
            )
        self._held = (ident, time.monotonic() + HELLO_HOLD_S, why)

    def _settle_held(self, held: tuple[bytes, float, str]) -> None:
        """Welcome the held hello once the output socket has no connection left; reject it
        at its deadline."""
        ident, deadline, why = held
        if self.output_peers == 0:
            self._held = None
            self._accept(ident)
        elif time.monotonic() >= deadline:
            self._held = None
            self._reject(ident, why)

    def _bye(self, ident: bytes) -> None:
        if ident == self._session:
            self._session = None
            # After everything it sent (pending keeps arrival order).
            self.pending.append(session_change(None))
            self._update_detached()
        elif self._held is not None and self._held[0] == ident:
            self._held = None  # it gave up waiting

    def _accept(self, ident: bytes) -> None:
        self._unheard = ident != self._session
        if self._unheard:
            # A new client: nothing queued for the previous one may reach it. (Its output
            # connection is gone: a hello is only welcomed with no output peer.)
            epoch, dropped = self._outbox.begin_session()
            if dropped:
                logger.info(
                    "enginecore: dropped %d events of the previous client at a new session",
                    dropped,
                )
            self.pending.append(session_change(epoch))
            self._pull_seen = False
        self._session = ident
        self._session_seen = time.monotonic()
        self._update_detached()
        self.sock.send_multipart([ident, self._welcome])

    def _update_detached(self) -> None:
        """Tell the outbox whether a client can read: one is attached, and its ``PULL`` is
        connected or has not connected yet (its first events wait for it, unbounded). Logs
        what the outbox dropped once a detached period ends."""
        if self._session is not None and self.output_peers > 0:
            self._pull_seen = True
        detached = self._session is None or (self._pull_seen and self.output_peers == 0)
        if detached == self._detached:
            return
        self._detached = detached
        log_detached_drops(self._outbox.set_detached(detached), self._outbox.detached_max)

    def _reject(self, ident: bytes, reason: str) -> None:
        reject = _wire.RejectMsg(_wire.PROTOCOL_VERSION, reason)
        self.sock.send_multipart([ident, msgspec.msgpack.encode(reject)])

    def _count_output_peers(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_ACCEPTED:
                self.output_peers += 1
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.output_peers = max(0, self.output_peers - 1)
            self._update_detached()


def _recv(sock: zmq.Socket[bytes]) -> list[Any]:
    """One message, ``[routing id, body, *buffers]``, without blocking (``zmq.Again`` if none
    is waiting). The body and buffers are ``zmq.Frame`` s: an array in a buffer reaches the
    engine as a view on its frame, without a copy.

    Not ``recv_multipart()``: it calls ``getsockopt(RCVMORE)`` after every part, ~2 us each
    in pyzmq 27; a Frame's ``more`` costs nothing. A ROUTER message has >= 1 part after the
    routing id.
    """
    ident = sock.recv(zmq.NOBLOCK)
    part = sock.recv(copy=False)
    parts: list[Any] = [ident, part]
    while part.more:
        part = sock.recv(copy=False)
        parts.append(part)
    return parts


def _ms_until(deadline: float) -> int:
    return max(0, math.ceil((deadline - time.monotonic()) * 1000))


def _invalid(value: object, what: str) -> str | None:
    """Why a decoded *value* is not a valid wire value, or ``None`` if it is."""
    try:
        _codec.check_received(value, what)
    except ValueError as exc:
        return str(exc)
    except RecursionError:  # msgspec decodes deeper values than check_received can walk
        return f"{what}: nested too deeply"
    return None
