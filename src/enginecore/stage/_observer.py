"""Reading a stage's statistics without attaching to it: :class:`StageObserver`.

A stage serves one client at a time, or at most ``--max-clients`` (``docs/wire.md``
section 3), so a monitoring tool (``python -m enginecore top``) must not take a client's
place beside the ones that use the stage. It
is an *observer* instead: a ``DEALER`` on the stage's input socket that only ever sends
``["stats", call_id]``, and never ``hello``. The stage answers a ``stats`` request from a
peer that is not its attached client on the input socket, as it answers a ``hello``, with
the ``["utility", call_id, result, nil]`` event that a client gets on its output socket: so
the observer needs no output socket and no session, and the attached client never sees
anything of it. The stage's input thread answers, without waiting for the loop or a step.

A stage served with CURVE (``docs/security.md``) admits an observer like any client: with a
listed key pair and the stage's public key (``curve=``). The observer watches its DEALER's
socket monitor, so a refused key, a wrong server key or CURVE on one side only is an
:class:`~enginecore.stage.AuthenticationError`, not a silent timeout.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from ._address import check_address
from ._curve import HANDSHAKE_EVENTS, CurveKeys, HandshakeWatch, secure_client
from ._errors import AuthenticationError, ProtocolError, StageClosedError, UtilityError
from ._statistics import StageStatistics
from ._wire import is_ipv6_endpoint

__all__ = ["StageObserver"]

_SEND_HWM = 8  # requests queued for a stage that is not there yet; more are dropped
_POLL_MAX_S = 3600.0  # the longest single poll of answer(): longer timeouts poll again


class StageObserver:
    """Reads the statistics of the stage at *address* (its input address, as for
    ``StageClient.connect``) without attaching to it: the stage may be serving a client
    meanwhile, and that client's session is not disturbed. Blocking, one thread at a time.

    ``stats()`` asks and waits. A tool that watches several stages at once uses
    :meth:`request`, polls every observer's :attr:`socket` (a ``zmq.Poller``) and takes
    the answers with :meth:`answer`, so that one stage that does not answer delays none of
    the others. Nothing here ever waits for a stage that is gone: requests are sent without
    blocking (at most a few are queued while it is unreachable) and every wait is bounded.
    """

    def __init__(
        self,
        address: str,
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
        *,
        curve: CurveKeys | None = None,
    ) -> None:
        """*curve* (:class:`~enginecore.stage.CurveKeys`: a key pair the stage lists and
        the stage's public key) observes a stage served with CURVE. :class:`TypeError` for
        an *address* that is not a ``str``, :class:`ValueError` for one that is neither
        ``ipc://PATH`` nor ``tcp://HOST:PORT`` (a port from 1 to 65535)."""
        if not isinstance(address, str):
            raise TypeError(f"address must be a str, got {type(address).__name__}")
        check_address(address, bind=False)
        if curve is not None and not isinstance(curve, CurveKeys):
            raise TypeError(f"curve must be CurveKeys, got {type(curve).__name__}")
        self.address = address
        self._curve = curve
        self._own_ctx = ctx is None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context() if ctx is None else ctx
        sock = self._ctx.socket(zmq.DEALER)
        monitor: zmq.Socket[bytes] | None = None
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
            sock.setsockopt(zmq.IPV6, is_ipv6_endpoint(address))
            if curve is not None:
                secure_client(sock, curve)
            monitor = sock.get_monitor_socket(HANDSHAKE_EVENTS)
            sock.connect(address)
        except zmq.ZMQError:
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            sock.close()
            if self._own_ctx:
                self._ctx.term()
            raise
        self.socket: zmq.Socket[bytes] = sock
        """The ``DEALER``: poll it for ``POLLIN`` to know an answer is waiting."""
        self.monitor: zmq.Socket[bytes] = monitor
        """Its socket monitor: poll it too, and call :meth:`failure` when it is readable,
        to know at once that the stage refused the observer."""
        self._watch = HandshakeWatch(address, curve)
        self._ids = itertools.count(random.randrange(1, 2**52)).__next__
        self._pending: int | None = None  # the latest request's call id
        self._closed = False

    def failure(self) -> AuthenticationError | None:
        """Why the stage refuses this observer (read from the socket monitor: a key it does
        not list, a wrong server key, CURVE on one side only), or ``None``. A later
        successful handshake (the stage restarted with the right keys) clears it. Never
        blocks."""
        self._check_open()
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return self._watch.failure
            if int(event["event"]) == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._watch = HandshakeWatch(self.address, self._curve)
            self._watch.feed(event)

    def request(self) -> bool:
        """Ask for the stage's statistics; never blocks. Only the answer to the latest
        request counts (an older one that arrives late is dropped). ``False`` when the
        request could not even be queued (the stage has been unreachable for a while)."""
        self._check_open()
        call_id = self._ids()
        self._pending = call_id
        try:
            self.socket.send(msgspec.msgpack.encode(("stats", call_id)), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def answer(self, timeout: float = 0.0) -> StageStatistics | None:
        """The answer to the latest :meth:`request`, if it arrives within *timeout* seconds
        (``0``: only if it is already here), else ``None``. Answers to older requests and
        anything that is not an answer are dropped. :class:`UtilityError` if the stage
        refused the request, :class:`ProtocolError` if its answer is not statistics, and
        :class:`~enginecore.stage.AuthenticationError` (a ``ProtocolError``) as soon as the
        stage refuses the observer's handshake (:meth:`failure`), or its key once a key
        rotation removed it (the stage's ``reject``). *timeout*: seconds >= 0, ``math.inf``
        for no limit (:class:`ValueError` for a negative or NaN one, :class:`TypeError`
        for a non-number)."""
        self._check_open()
        deadline = time.monotonic() + _seconds(timeout)
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while self._pending is not None:
            left = deadline - time.monotonic()
            # An infinite or huge timeout waits in bounded polls (zmq takes a C int of ms).
            left_ms = max(0, math.ceil(min(left, _POLL_MAX_S) * 1000))
            ready = dict(poller.poll(left_ms))
            if self.monitor in ready:
                failure = self.failure()
                if failure is not None:
                    raise failure
            if self.socket not in ready:
                if not ready and left <= _POLL_MAX_S:
                    return None
                continue
            reply = self._read()
            if reply is not None and reply[0] == "reject":
                # With CURVE: the stage no longer authorizes this observer's key (key
                # rotation); it answers every request so (docs/security.md).
                self._pending = None
                raise AuthenticationError(
                    f"the stage at {self.address} refused this observer: {reply[2]}"
                )
            if reply is None or reply[1] != self._pending:
                continue
            self._pending = None
            _, _, result, error = reply
            if error is not None:
                raise UtilityError("stats", str(error))
            try:
                return StageStatistics.from_wire(result)
            except ValueError as exc:
                raise ProtocolError(
                    f"the stage at {self.address} answered stats with {exc}"
                ) from exc
        return None

    def stats(self, timeout: float = 5.0) -> StageStatistics:
        """Ask for the stage's statistics and wait for them; :class:`TimeoutError` if no
        answer comes within *timeout* seconds (no stage there, or not one that answers
        observers), :class:`~enginecore.stage.AuthenticationError` if the stage refuses
        the observer (with CURVE: as soon as its handshake fails). *timeout* as for
        :meth:`answer`; on a closed observer, :class:`~enginecore.stage.StageClosedError`
        (so do :meth:`request`, :meth:`answer` and :meth:`failure`)."""
        _seconds(timeout)
        self.request()
        stats = self.answer(timeout)
        if stats is None:
            failure = self.failure()
            if failure is not None:
                raise failure
            raise TimeoutError(f"no answer from a stage at {self.address} in {timeout:g} s")
        return stats

    def _check_open(self) -> None:
        if self._closed:
            raise StageClosedError(f"this observer is closed (stage at {self.address})")

    def _read(self) -> list[Any] | None:
        try:
            parts = self.socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None
        try:
            reply = msgspec.msgpack.decode(parts[0])
        except msgspec.DecodeError:
            return None
        if type(reply) is list and len(reply) >= 4 and reply[0] == "utility":
            return reply
        if type(reply) is list and len(reply) >= 3 and reply[0] == "reject":
            return reply  # its key was revoked (a stage rejects an observer for nothing else)
        return None  # a welcome is not for an observer; nothing else comes here

    def close(self) -> None:
        """Close the socket (and the context, if this observer made it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> StageObserver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _seconds(timeout: object) -> float:
    """*timeout*, checked: seconds >= 0, not NaN, not a ``bool``."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {timeout!r}")
    if not timeout >= 0:  # NaN too
        raise ValueError(f"timeout must be a non-negative number of seconds, got {timeout!r}")
    return float(timeout)
