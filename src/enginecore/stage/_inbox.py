"""The input side of a stage process: one thread reads the input socket and the output
socket's monitor, and moves what arrives into the session (:class:`Inbox`).

The input thread blocks in ``poll`` on the input socket (``ROUTER``) and on the output
socket's monitor, which tells it how many clients are connected to the output socket. It
polls with no timeout, except while a ``hello`` is held (its deadline), or while a
multi-client stage has clients attached (the next one's session timeout). On each wake-up it
reads every message already waiting (up to :data:`MAX_BURST`) and hands each to the
:class:`~._stage_session.StageSession`, which decodes and checks it; then it sends the
session's replies (``welcome``, ``reject``), posts its events (errors, pongs) to the outbox,
and leaves its loop messages in :attr:`Inbox.pending` for the input queue to hand to the
loop in one go, in arrival order: a burst costs one poll, one lock and one wake-up of the
loop thread, not one of each per message. While the loop is idle, the loop thread itself
does this reading (:meth:`Inbox.read`), inside its queue's ``get()``, and between its short
steps, and the input thread is parked: see :mod:`._input_queue`.

A stage that serves several clients (:mod:`._fanout`) has more to watch, in the same
poll: each client's output socket's monitor (registered when the client is welcomed, closed
when its socket has closed), and the fan-out's wake-up pipe, which says that the loop cut
a client that fell behind (the session then detaches it).

A CURVE stage also checks the key behind each message (:class:`~._curve.KeyWatch`): one
lookup of the routing id for a peer already admitted; the first message of a peer (and its
first after a new connection) reads the frame's ``User-Id``. At a change of the authorized
keys (a wake-up pipe, and the input socket's monitor for new connections, in the same
poll), the peers of the keys removed have their sessions ended (``StageSession.revoke``),
and so has any later message of theirs. A stage without CURVE runs none of this.

What the session decides (validation, sessions, the held hello) is in
:mod:`._stage_session`; this module only moves bytes. A frame goes ``_inbox`` ->
``_stage_session`` -> (``_input_queue`` | ``_outbox``) and never comes back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from ._input_queue import InputQueue
from ._outbox import StageOutput
from ._stage_session import MultiStageSession, StageSession

if TYPE_CHECKING:
    from ._curve import KeyWatch
    from ._fanout import Fanout

__all__ = ["MAX_BURST", "Inbox"]

logger = logging.getLogger("enginecore.stage")

MAX_BURST: Final = 512
"""Messages read per wake-up of the input thread before they are handed to the loop."""

# Plain ints: zmq's constants are enum flags, and `int & flag` goes through enum's Python
# code (~1 µs).
_EVENTS: Final = int(zmq.EVENTS)
_POLLIN: Final = int(zmq.POLLIN)
_ACCEPTED: Final = int(zmq.EVENT_ACCEPTED)
_DISCONNECTED: Final = int(zmq.EVENT_DISCONNECTED)
_MONITOR_STOPPED: Final = int(zmq.EVENT_MONITOR_STOPPED)
_CLOSED: Final = int(zmq.EVENT_CLOSED)


class Inbox:
    """The input socket, the output socket's monitor, and the input thread, around a
    :class:`~._stage_session.StageSession`. ``start()`` once; ``Context.term()`` ends the
    thread (:meth:`join` waits for it). Implements the input queue's
    :class:`~._input_queue.InputReader`.

    Loop messages go to *queue* (an :class:`~._input_queue.InputQueue`, which this attaches
    to), events to *outbox*. If the thread fails, :attr:`failed` is set and *on_failure* is
    called (the runtime stops the loop); the queue does the same when a read on the loop
    thread fails. *clients*: a multi-client stage's fan-out (module docstring); *session*
    is then a :class:`~._stage_session.MultiStageSession`.
    """

    # Everything here belongs to the thread that holds the input side (the input thread, or
    # the loop inside InputQueue.get() or after_step(); they pass it under the queue's
    # mutex), except session.output_peers and session.attached, which the loop thread also
    # reads unlocked (Outbox.wait_for_room's may_wait, teardown; a stale read is harmless).

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        out_monitor: zmq.Socket[bytes],
        session: StageSession,
        queue: InputQueue,
        outbox: StageOutput,
        *,
        on_failure: Callable[[], None],
        clients: Fanout | None = None,
        keys: KeyWatch | None = None,
    ) -> None:
        if not isinstance(queue, InputQueue):
            raise TypeError(f"the stage's input queue must be an InputQueue, got {queue!r}")
        self.sock = sock
        self.monitor = out_monitor
        self.session = session
        self._clients = clients
        self._multi = session if isinstance(session, MultiStageSession) else None
        self._pollers: list[zmq.Poller] = []
        # A multi-client stage's client output monitors: monitor socket -> session epoch.
        self._client_monitors: dict[zmq.Socket[bytes], int] = {}
        if self._multi is not None:
            self.has_input = self._has_input_multi  # type: ignore[method-assign]
        self._keys = keys
        self._receive: Callable[[bytes, list[Any], float], None] = session.receive
        if keys is not None:
            self._receive = self._checked_receive(keys)
            unchecked = self.has_input
            self.has_input = lambda: keys.stale or unchecked()  # type: ignore[method-assign]
        self._post = outbox.post
        self._on_failure = on_failure
        self.failed = False
        self._queue = queue
        queue.attach(self, self._failed)
        self._thread = threading.Thread(target=self._main, name="enginecore-input", daemon=True)

    @property
    def pending(self) -> list[Any]:
        """The loop messages read and not yet queued, in order (the session's)."""
        return self.session.to_loop

    def start(self) -> None:
        """Start the input thread."""
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the input thread has started and not ended."""
        return self._thread.is_alive()

    def join(self) -> None:
        """Wait until the input thread has ended (after ``Context.term()``)."""
        self._thread.join()

    def _failed(self) -> None:
        self.failed = True
        self._on_failure()

    # -- InputReader -------------------------------------------------------------------------

    def register(self, poller: zmq.Poller) -> None:
        """Add the input socket and the monitor to *poller*."""
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        self._pollers.append(poller)
        if self._clients is not None:
            poller.register(self._clients.wake_fd, zmq.POLLIN)
            for monitor in self._client_monitors:
                poller.register(monitor, zmq.POLLIN)
        if self._keys is not None:
            poller.register(self._keys.wake_fd, zmq.POLLIN)
            poller.register(self._keys.monitor, zmq.POLLIN)

    def read(self, poller: zmq.Poller, timeout_ms: int | None = None) -> dict[Any, int]:
        """Wait in *poller* (up to *timeout_ms*, ``None``: no timeout; a held hello's
        deadline shortens it), then read and handle what the sockets have: the monitor's
        events, every message already waiting (up to :data:`MAX_BURST`), a held hello's
        fate. The loop messages are left in :attr:`pending`, in order; replies are sent
        and events posted. Returns what *poller* found ready.

        Called by whichever thread holds the input side: the input thread, or the loop while
        idle or between short steps (:class:`~._input_queue.InputQueue`)."""
        session = self.session
        if session.held is not None or session.expires:
            until = session.wait_ms(time.monotonic())
            if until is not None:
                timeout_ms = until if timeout_ms is None else min(timeout_ms, until)
        ready = dict(poller.poll(timeout_ms))
        if self.monitor in ready:
            self._count_output_peers()
        woken = False
        if self._clients is not None:
            woken = self._clients.wake_fd in ready
            if self._client_monitors:
                self._read_client_monitors(ready)
        keys = self._keys
        if keys is not None:
            if keys.monitor in ready:  # a new connection: every peer's key is read again
                keys.connected()
            if keys.stale or keys.wake_fd in ready:
                keys.sweep(session.revoke)  # the keys changed: cut the removed keys' peers
        if self.sock in ready:
            sock = self.sock
            receive = self._receive
            now = time.monotonic()
            for i in range(MAX_BURST):
                try:
                    ident, parts = _recv(sock)
                except zmq.Again:
                    break
                receive(ident, parts, now)
                # A lone message (a utility call, most often) ends here: asking whether
                # another is waiting costs ~1.2 µs, a receive that fails ~2.5 (pyzmq builds
                # an Again); a burst pays both, once.
                if i == 0 and not cast(int, sock.getsockopt(_EVENTS)) & _POLLIN:
                    break
        if session.held is not None:
            self._count_output_peers()  # what happened while this burst was read
            session.settle(time.monotonic())
        elif session.expires or woken:  # a multi-client stage's deadlines, and cut clients
            session.settle(time.monotonic())
        if self._clients is not None and self._clients.new_monitors:
            self._watch_new_clients()
        if session.replies:
            self._send_replies()
        if session.events:
            events, session.events = session.events, []
            self._post(events if len(events) > 1 else events[0], len(events))
        return ready

    def _checked_receive(self, keys: KeyWatch) -> Callable[[bytes, list[Any], float], None]:
        # A CURVE stage's receive: a peer admitted under the current keys costs one dict
        # lookup; any other reads its frame's key once (KeyWatch.admit), and one whose key
        # the stage no longer authorizes has its message dropped and its session ended.
        allowed = keys.allowed
        receive = self.session.receive
        admit = keys.admit
        revoke = self.session.revoke

        def checked(ident: bytes, parts: list[Any], now: float) -> None:
            if ident in allowed:
                receive(ident, parts, now)
                return
            key = admit(ident, parts[0])
            if key is None:
                receive(ident, parts, now)
            else:
                revoke(ident, key)

        return checked

    def has_input(self) -> bool:
        """Whether :meth:`read` has anything to do at once: a message or a monitor event
        waiting, or a held ``hello``. ``ZMQ_EVENTS`` on each socket: ~1.2 µs each, and,
        unlike a ``poll``, the calling thread keeps the GIL."""
        if self.session.held is not None:
            return True
        events = cast(int, self.sock.getsockopt(_EVENTS))
        return bool((events | cast(int, self.monitor.getsockopt(_EVENTS))) & _POLLIN)

    def _has_input_multi(self) -> bool:
        # has_input on a multi-client stage (set in __init__; the one-client path pays
        # nothing): also a client cut by the loop, a client monitor's event, or a session
        # deadline passed.
        if Inbox.has_input(self):
            return True
        assert self._clients is not None
        assert self._multi is not None
        if self._clients.gone_waiting:
            return True
        for monitor in self._client_monitors:
            if cast(int, monitor.getsockopt(_EVENTS)) & _POLLIN:
                return True
        return self._multi.wait_ms(time.monotonic()) == 0

    def readable(self, ready: dict[Any, int]) -> bool:
        """Whether *ready* (from :meth:`read`) includes the input socket."""
        return self.sock in ready

    # -- the input thread ------------------------------------------------------------------------

    def _main(self) -> None:
        poller = zmq.Poller()
        self.register(poller)
        q = self._queue
        try:
            while True:
                try:
                    q.wait_turn()  # while the idle loop reads the input side itself
                    self.read(poller)
                except zmq.ContextTerminated:
                    return
                finally:
                    q.hand_over(self.session.to_loop)
        except BaseException:
            logger.exception("enginecore: the input thread failed; shutting the stage down")
            self._failed()
        finally:
            for monitor in self._client_monitors:
                monitor.close(linger=0)
            self._client_monitors.clear()
            if self._clients is not None:
                for _epoch, monitor in self._clients.new_monitors:
                    monitor.close(linger=0)
                self._clients.new_monitors.clear()
            if self._keys is not None:
                self._keys.monitor.close(linger=0)
            self.monitor.close(linger=0)
            self.sock.close(linger=0)

    def _send_replies(self) -> None:
        replies, self.session.replies = self.session.replies, []
        for ident, body in replies:
            self.sock.send_multipart([ident, body])

    def _count_output_peers(self) -> None:
        changed = self.session.output_peers_changed
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = event["event"]
            if kind == _ACCEPTED:
                changed(1)
            elif kind == _DISCONNECTED:
                changed(-1)
            elif kind == _CLOSED:  # the address unbound: its connections went with it
                self.session.output_closed()

    def _watch_new_clients(self) -> None:
        # Poll the output monitors of the clients just welcomed, in every poller (only the
        # thread holding the input side polls, so changing the other's poller is safe).
        assert self._clients is not None
        new, self._clients.new_monitors = self._clients.new_monitors, []
        for epoch, monitor in new:
            self._client_monitors[monitor] = epoch
            for poller in self._pollers:
                poller.register(monitor, zmq.POLLIN)

    def _read_client_monitors(self, ready: dict[Any, int]) -> None:
        # A client's output connections, for its session; a monitor whose socket closed (the
        # client left, and its output thread ended) is closed.
        assert self._multi is not None
        changed = self._multi.client_output_changed
        now = time.monotonic()
        for monitor, epoch in list(self._client_monitors.items()):
            if monitor not in ready:
                continue
            while True:
                try:
                    event = recv_monitor_message(monitor, zmq.NOBLOCK)
                except zmq.Again:
                    break
                kind = event["event"]
                if kind == _ACCEPTED:
                    changed(epoch, 1, now)
                elif kind == _DISCONNECTED:
                    changed(epoch, -1, now)
                elif kind == _MONITOR_STOPPED:
                    del self._client_monitors[monitor]
                    for poller in self._pollers:
                        poller.unregister(monitor)
                    monitor.close(linger=0)
                    break


def _recv(sock: zmq.Socket[bytes]) -> tuple[bytes, list[Any]]:
    """One message, ``(routing id, [body, *buffers])``, without blocking (``zmq.Again`` if none
    is waiting). The body and buffers are ``zmq.Frame`` s: an array in a buffer reaches the
    engine as a view on its frame, without a copy.

    Not ``recv_multipart()``: it calls ``getsockopt(RCVMORE)`` after every part, ~2 us each
    in pyzmq 27; a Frame's ``more`` costs nothing. A ROUTER message has >= 1 part after the
    routing id.
    """
    ident = sock.recv(zmq.NOBLOCK)
    part = sock.recv(copy=False)
    parts: list[Any] = [part]
    while part.more:
        part = sock.recv(copy=False)
        parts.append(part)
    return ident, parts
