"""Reading a stage's statistics without attaching to it: :class:`StageObserver`.

A stage serves one client at a time (``docs/wire.md`` section 3), so a monitoring tool
(``python -m enginecore top``) cannot be a client beside the one that uses the stage. It
is an *observer* instead: a ``DEALER`` on the stage's input socket that only ever sends
``["stats", call_id]``, and never ``hello``. The stage answers a ``stats`` request from a
peer that is not its attached client on the input socket, as it answers a ``hello``, with
the ``["utility", call_id, result, nil]`` event that a client gets on its output socket: so
the observer needs no output socket and no session, and the attached client never sees
anything of it. The stage's input thread answers, without waiting for the loop or a step.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from typing import Any

import msgspec
import zmq

from ._errors import ProtocolError, UtilityError
from ._statistics import StageStatistics
from ._wire import is_ipv6_endpoint

__all__ = ["StageObserver"]

_SEND_HWM = 8  # requests queued for a stage that is not there yet; more are dropped


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

    def __init__(self, address: str, ctx: zmq.Context[zmq.Socket[bytes]] | None = None) -> None:
        self.address = address
        self._own_ctx = ctx is None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context() if ctx is None else ctx
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
        sock.setsockopt(zmq.IPV6, is_ipv6_endpoint(address))
        try:
            sock.connect(address)
        except zmq.ZMQError:
            sock.close()
            if self._own_ctx:
                self._ctx.term()
            raise
        self.socket: zmq.Socket[bytes] = sock
        """The ``DEALER``: poll it for ``POLLIN`` to know an answer is waiting."""
        self._ids = itertools.count(random.randrange(1, 2**52)).__next__
        self._pending: int | None = None  # the latest request's call id
        self._closed = False

    def request(self) -> bool:
        """Ask for the stage's statistics; never blocks. Only the answer to the latest
        request counts (an older one that arrives late is dropped). ``False`` when the
        request could not even be queued (the stage has been unreachable for a while)."""
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
        refused the request, :class:`ProtocolError` if its answer is not statistics."""
        deadline = time.monotonic() + max(0.0, timeout)
        while self._pending is not None:
            left_ms = max(0, math.ceil((deadline - time.monotonic()) * 1000))
            if not self.socket.poll(left_ms, zmq.POLLIN):
                return None
            reply = self._read()
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
        observers)."""
        self.request()
        stats = self.answer(timeout)
        if stats is None:
            raise TimeoutError(f"no answer from a stage at {self.address} in {timeout:g} s")
        return stats

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
        return None  # a welcome or reject is not for an observer; nothing else comes here

    def close(self) -> None:
        """Close the socket (and the context, if this observer made it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.socket.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> StageObserver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
