"""The user's engine as the loop of a stage process sees it: :class:`StageEngine`.

Everything here runs on the loop thread. The adapter adds three things to the engine:

- its ``step()`` hands each step's outputs, routed and checked, to the output thread as one
  ``outputs`` event, and returns nothing to the loop (:func:`make_step`);
- after ``abort(req_ids)`` returns, an ``aborted`` event, ordered with the outputs, so none
  of the aborted requests' outputs follows it;
- the ordered stop: a client's ``shutdown`` is applied in order, after everything sent
  before it (:func:`ordered_stop`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

from .._engine import Engine
from .._messages import Event, Utility
from . import _codec
from ._outbox import BACKLOG_MAX, Outbox
from ._routing import make_router

__all__ = ["StageEngine", "make_step", "ordered_stop"]


# -- the ordered stop -------------------------------------------------------------------------
# The loop has no "stop after what is queued" message, so the stage builds one out of a
# utility call that only it can make: the input thread queues ordered_stop(), the loop applies
# it in order, StageEngine.utility() sees the token and calls request_shutdown(), and
# StageEngine.emit() drops the call's answer, which no client asked for.


class _StopCallId(int):
    """The call id of an ordered stop; its ``utility`` answer is never sent."""


# A wire message can never carry this object, so only the stage itself can make this call.
_STOP_TOKEN: Final = object()


def ordered_stop() -> Utility:
    """The ``input_queue`` message for a client's ``shutdown``.

    Applied *in order*: everything the client sent before it is applied first, exactly like
    a message. (``request_shutdown()`` called from the input thread would not be: called
    before ``run()`` has started, it makes the run skip what is already queued.)
    """
    return Utility(_StopCallId(0), "shutdown", (_STOP_TOKEN,))


# -- the adapter --------------------------------------------------------------------------------


class StageEngine:
    """*engine* with the stage's ``step``, ``abort`` and ``utility``, and the loop's ``emit``.

    ``has_work`` and ``add`` are the engine's own bound methods, stored as attributes, so the
    hot path pays nothing for the adapter. Set :attr:`request_shutdown` to the loop's.
    """

    def __init__(self, engine: Engine, outbox: Outbox) -> None:
        self.has_work = engine.has_work
        self.add = engine.add
        self.step = make_step(engine, outbox)
        self._utility = engine.utility
        self._abort = engine.abort
        self._emit = outbox.emit
        self.request_shutdown: Callable[[], None] = lambda: None

    def abort(self, req_ids: Sequence[str]) -> None:
        self._abort(req_ids)
        self._emit(("aborted", list(req_ids)))

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        if args and args[0] is _STOP_TOKEN:
            self.request_shutdown()
            return None
        return self._utility(name, args)

    def emit(self, event: Event) -> None:
        """The loop's ``emit``: utility answers and the terminal event (never an
        ``output``: :func:`make_step` hands a step's outputs over itself)."""
        if event[0] != "utility" or type(event[1]) is not _StopCallId:
            self._emit(event)


def make_step(engine: Engine, outbox: Outbox) -> Callable[[], tuple[()]]:
    """The loop's ``step``: *engine*'s step, its outputs routed on the loop thread (before the
    engine can reuse an output) and posted to *outbox* as **one** ``outputs`` event; it
    returns nothing to the loop.

    An exception in ``step`` or in routing is fatal, and the outputs routed before it are
    still sent first. A payload that cannot cross the wire ends only its request. Before a
    step, waits while the output thread is far behind a connected client
    (:meth:`Outbox.wait_for_room`).
    """
    route = make_router(engine)
    engine_step = engine.step
    post = outbox.post_step
    wait_for_room = outbox.wait_for_room
    prepare_outputs = outbox.prepare_outputs
    flat = _codec.FLAT_TYPES

    def step() -> tuple[()]:
        if outbox.backlog > BACKLOG_MAX:  # unlocked peek; wait_for_room re-checks
            wait_for_room()
        rids: list[Any] = []
        fins: list[Any] = []
        payloads: list[Any] = []
        try:
            route(engine_step(), rids, fins, payloads)
        finally:
            # One hand-over per step (Outbox.post_step: a big step is sent at once while
            # the output thread idles, a small one queued to share a frame).
            if payloads:
                # Fast path: every payload of an exact flat type (an out-of-range int is
                # caught when msgspec refuses it, in the output thread).
                if set(map(type, payloads)) <= flat:
                    post([("outputs", rids, fins, payloads)], len(payloads))
                else:
                    post(prepare_outputs(rids, fins, payloads), len(payloads))
        return ()

    return step
