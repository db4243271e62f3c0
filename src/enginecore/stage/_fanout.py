"""The output side of a stage that serves several clients at once (``serve --max-clients N``
with N > 1): :class:`Fanout`, one :class:`~._outbox.Outbox` and one ``PUSH`` socket per
client.

A ``PUSH`` socket deals its messages out round-robin to every connected ``PULL``, so one
output socket can only serve one client (``docs/wire.md`` section 3). A multi-client stage
binds a fresh socket for each client it welcomes (:meth:`Fanout.open_session`, on the
input thread) and names it in that client's ``welcome``; the client side is unchanged.
Each socket has its own :class:`~._outbox.Outbox` (queue, thread, encoding policy), so a
client that reads slowly delays only its own frames.

::

    loop thread --post_step / emit--> Fanout --(request id -> session)--> Outbox 1 --> PUSH 1
                                          \\----------------------------> Outbox 2 --> PUSH 2
    input thread --post_to(session, pong / input error)-----------------^

Routing, on the loop thread, in the loop's order (the controls of :mod:`._controls`):

- :class:`~._controls.ClientInput` names the client whose messages follow; an ``add``
  that the loop makes live is that client's request (:meth:`Fanout.admitter`), and what
  the loop emits while it applies them (an ``error`` for a refused add, ``aborted``) is
  that client's event (:meth:`Fanout.emit`). An abort only aborts the sender's own
  requests (:meth:`Fanout.own`).
- A step's outputs go to the clients that own their requests. While only one client is
  attached, the step goes to it as it is: no per-output lookup, and no ownership is
  recorded (every live request is that client's); when a second one joins, the live
  requests are recorded as the first one's.
- A utility answer goes to the session that made the call (:meth:`Fanout.answer`; the
  :class:`~._stage_session.CallTable` names it), or nowhere once that client has left.
- The stage's load report rides on every client's frames: a step that carries one sends
  it to each attached client, on that client's ``outputs`` event, or on an ``outputs``
  event with no output for a client that has none in the step. So the pools of different
  clients see each other's load (``docs/pool.md``).
- ``stalled``, ``resumed``, ``shutdown`` and ``fatal`` go to every client.

:class:`~._controls.ClientLeft` (a ``bye``, or silence past the session timeout) aborts
that client's live requests, and only its, then ends its ``Outbox`` (what is queued for it
is dropped) and closes its socket.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

from ._outbox import BACKLOG_MAX, Events, _weight
from ._stage_engine import LIVE_IN_STAGE

__all__ = ["LIVE_FOR_ANOTHER", "RECHECK_MS", "ClientOutbox", "Fanout", "session_endpoint"]

logger = logging.getLogger("enginecore.stage")

LIVE_FOR_ANOTHER: Final = (
    "add refused: this request id is live in the stage for another client (the clients "
    "of a shared stage must use request ids that are unique across all of them)"
)
"""The message of the ``error`` event for an ``add`` of an id that another client of a
multi-client stage has live."""

RECHECK_MS: Final = 100
"""How often a client's output thread, waiting for its peer, checks whether the client has
left (its socket is then closed without waiting for the peer)."""

_TERMINAL: Final = frozenset({"shutdown", "fatal"})


class ClientOutbox(Protocol):
    """What the fan-out uses of one client's :class:`~._outbox.Outbox`."""

    @property
    def backlog(self) -> int: ...

    @property
    def running(self) -> bool: ...

    @property
    def failed(self) -> bool: ...

    def start(self) -> None: ...

    def post(self, item: Any, weight: int | None = None) -> None: ...

    def post_step(self, events: Events, weight: int, last: bool = False) -> None: ...

    def emit(self, ev: tuple[Any, ...]) -> None: ...

    def ended_dropped(self, req_ids: list[str]) -> None: ...

    def wait_for_room(self) -> None: ...

    def end(self) -> None: ...

    def close(self, timeout: float) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...

    def take_dropped(self) -> int: ...


class Fanout:
    """The output side of a multi-client stage (module docstring). Implements
    :class:`~._outbox.StageOutput` for the loop thread and the runtime,
    :class:`~._controls.ClientsTarget` for the client controls, and what
    :class:`~._stage_session.MultiStageSession` needs (:meth:`open_session`,
    :meth:`post_to`).

    *open_output(epoch)* binds a new ``PUSH`` socket for session *epoch* and returns its
    :class:`~._outbox.Outbox` (not started, not detached, with ``recheck_ms``
    :data:`RECHECK_MS`) and its endpoint (input thread; :class:`ClientOutbox` is what is
    used of it). *prepare_outputs* is an :class:`~._outbox.Outbox`'s
    :meth:`~._outbox.Outbox.prepare_outputs` (the same policy for every client).
    :meth:`bind` gives it the stage's live requests and the function that drops requests
    from the engine."""

    # Threads and what they own:
    # - _open (session epoch -> its Outbox and endpoint), _all and _terminal: under _lock.
    #   The input thread adds to _open (open_session), the loop thread removes (left), the
    #   runtime reads it at the end (close, join).
    # - _routes, _current, _current_epoch, _owner and _shared: the loop thread's alone.
    #   _routes holds the sessions the loop has applied ClientJoined for, and not yet
    #   ClientLeft; _owner maps a live request id to its session's epoch, kept only while
    #   _shared (more than one route).

    def __init__(
        self,
        open_output: Callable[[int], tuple[ClientOutbox, str]],
        *,
        prepare_outputs: Callable[[list[Any], list[Any], list[Any]], Events],
        detached_max: int,
    ) -> None:
        self._open_output = open_output
        self._prepare_outputs = prepare_outputs
        self._detached_max = detached_max
        self._lock = threading.Lock()
        self._open: dict[int, tuple[ClientOutbox, str]] = {}
        self._all: list[ClientOutbox] = []  # every outbox still running, or that failed
        self._terminal: str | None = None
        self._routes: dict[int, ClientOutbox] = {}
        self._current: ClientOutbox | None = None
        self._current_epoch = 0
        self._owner: dict[str, int] = {}
        self._shared = False
        self._live: set[str] = set()
        self._drop: Callable[[Sequence[str]], None] = lambda ids: None

    def bind(self, live: set[str], drop: Callable[[Sequence[str]], None]) -> None:
        """The stage's live requests, and the function that drops requests from the engine
        (no ``aborted`` event): a leaving client's requests go through it."""
        self._live = live
        self._drop = drop

    # -- input thread ------------------------------------------------------------------------

    def open_session(self, epoch: int) -> str:
        """Input thread, at a ``hello`` that is welcomed: open session *epoch*'s socket and
        outbox (*open_output*), start the outbox; its endpoint (for the ``welcome``).
        Raises what opening raises."""
        outbox, address = self._open_output(epoch)
        with self._lock:
            self._all = [o for o in self._all if o.running or o.failed]
            self._all.append(outbox)
            self._open[epoch] = (outbox, address)
        outbox.start()
        return address

    def post_to(self, epoch: int, item: Any, weight: int) -> None:
        """Input thread: events for the client of session *epoch* (a pong, an input error,
        its ``stats`` answer). Dropped if it has left. Never blocks."""
        with self._lock:
            entry = self._open.get(epoch)
        if entry is not None:
            entry[0].post(item, weight)

    # -- loop thread: the client controls -------------------------------------------------

    def joined(self, epoch: int) -> None:
        """:class:`~._controls.ClientJoined`."""
        with self._lock:
            entry = self._open.get(epoch)
        if entry is None:
            return
        routes = self._routes
        if len(routes) == 1:
            # A second client: from now on each live request needs its owner, and the ones
            # live now are the first client's (the others' were aborted when they left).
            (first,) = routes
            self._owner = dict.fromkeys(self._live, first)
        routes[epoch] = entry[0]
        self._shared = len(routes) > 1

    def sender(self, epoch: int) -> None:
        """:class:`~._controls.ClientInput`."""
        self._current = self._routes.get(epoch)
        self._current_epoch = epoch

    def left(self, epoch: int) -> None:
        """:class:`~._controls.ClientLeft`: abort the client's live requests (only its),
        stop routing to it, end its outbox and close its socket."""
        routes = self._routes
        if routes.pop(epoch, None) is not None:
            if self._shared:
                owner = self._owner
                ids = [rid for rid, e in owner.items() if e == epoch]
                for rid in ids:
                    del owner[rid]
            else:
                ids = list(self._live)  # it was the only client: every live request is its
            self._shared = len(routes) > 1
            if not self._shared:
                self._owner = {}
            if ids:
                logger.info(
                    "enginecore: a client detached; aborting its %d live requests", len(ids)
                )
                self._drop(ids)
        if self._current_epoch == epoch:
            self._current = None
        with self._lock:
            entry = self._open.pop(epoch, None)
        if entry is not None:
            outbox, address = entry
            outbox.end()
            _unlink(address)

    # -- loop thread: routing ----------------------------------------------------------------

    def admitter(self, live: set[str]) -> Callable[[str], None]:
        """The ``admit`` of :func:`~._stage_engine.make_add`: *live* gets the request, and,
        while several clients are attached, the request is recorded as the sender's."""
        add = live.add
        owner_of = self

        def admit(rid: str) -> None:
            add(rid)
            if owner_of._shared:
                owner_of._owner[rid] = owner_of._current_epoch

        return admit

    def own(self, req_ids: Sequence[str]) -> Sequence[str]:
        """The ids of *req_ids* that the sender may abort: all but the ones another client
        has live. The loop aborts them at once: they are no longer anyone's."""
        if not self._shared:
            return req_ids
        owner, me = self._owner, self._current_epoch
        mine = [rid for rid in req_ids if owner.get(rid, me) == me]
        for rid in mine:
            owner.pop(rid, None)
        return mine

    def emit(self, ev: tuple[Any, ...]) -> None:
        """An event of the loop (``StageOutput.emit``): the terminal event to every client;
        any other (an ``error`` or ``aborted`` that answers a message, a pipeline's credit)
        to the client whose message the loop is applying."""
        kind = ev[0]
        if kind in _TERMINAL:
            self.post(ev)
            return
        current = self._current
        if current is None:
            return  # that client has left
        if (
            kind == "error"
            and ev[2] == LIVE_IN_STAGE
            and self._shared
            and self._owner.get(ev[1], self._current_epoch) != self._current_epoch
        ):
            ev = ("error", ev[1], LIVE_FOR_ANOTHER)
        current.emit(ev)

    def answer(self, epoch: int, ev: tuple[Any, ...]) -> None:
        """A utility answer, to the client of session *epoch* (dropped if it has left)."""
        route = self._routes.get(epoch)
        if route is not None:
            route.emit(ev)

    def post_step(self, events: Events, weight: int, last: bool = False) -> None:
        """One step's events (``StageOutput.post_step``): as they are to the only client; split
        by request owner when there are several (module docstring)."""
        routes = self._routes
        if not self._shared:
            for only in routes.values():  # none or one
                only.post_step(events, weight, last)
            return
        owner, me = self._owner, self._current_epoch
        per: dict[int, Events] = {}
        report = None
        for ev in events:
            kind = ev[0]
            if kind == "outputs":
                if len(ev) > 4:
                    report = ev[4]
                parts: dict[int, tuple[list[Any], list[Any], list[Any]]] = {}
                pop, get = owner.pop, owner.get
                for rid, fin, payload in zip(ev[1], ev[2], ev[3], strict=True):
                    e = pop(rid, me) if fin else get(rid, me)
                    part = parts.get(e)
                    if part is None:
                        part = parts[e] = ([], [], [])
                    part[0].append(rid)
                    part[1].append(fin)
                    part[2].append(payload)
                for e, (rids, fins, payloads) in parts.items():
                    per.setdefault(e, []).append(("outputs", rids, fins, payloads))
            elif kind == "error" and ev[1] is not None:
                per.setdefault(owner.get(ev[1], me), []).append(ev)
            else:
                per.setdefault(me, []).append(ev)
        if report is not None:
            # The whole stage's load, to every client: each pool sees the others' requests.
            for e in routes:
                evs = per.get(e)
                if evs is None:
                    per[e] = [("outputs", [], [], [], report)]
                    continue
                for i, ev in enumerate(evs):
                    if ev[0] == "outputs":
                        evs[i] = (*ev, report)
                        break
                else:
                    evs.insert(0, ("outputs", [], [], [], report))
        for e, evs in per.items():
            route = routes.get(e)
            if route is not None:
                route.post_step(evs, _weight(evs), last)

    def prepare_outputs(self, rids: list[Any], fins: list[Any], payloads: list[Any]) -> Events:
        """``StageOutput.prepare_outputs``: the same policy for every client."""
        return self._prepare_outputs(rids, fins, payloads)

    def ended_dropped(self, req_ids: list[str]) -> None:
        """``StageOutput.ended_dropped``: every client's output thread forgets the ids."""
        for route in self._routes.values():
            route.ended_dropped(req_ids)
        owner = self._owner
        for rid in req_ids:
            owner.pop(rid, None)

    def wait_for_room(self) -> None:
        """``StageOutput.wait_for_room``: wait while a client is far behind (each client's
        outbox re-checks every 50 ms, and stops waiting once its thread has ended)."""
        for route in list(self._routes.values()):
            if route.backlog > BACKLOG_MAX:
                route.wait_for_room()

    def loop_epoch(self, epoch: int) -> None:
        """``StageOutput.loop_epoch``: a one-client stage's; a multi-client stage never
        queues a ``SessionChange``."""

    # -- any thread --------------------------------------------------------------------------

    @property
    def backlog(self) -> int:
        """The longest queue of events (one per output) waiting to be sent to a client."""
        return max([o.backlog for o in list(self._routes.values())], default=0)

    @property
    def detached_max(self) -> int:
        return self._detached_max

    @property
    def terminal(self) -> str | None:
        """``"shutdown"`` or ``"fatal"`` once the loop emitted it (sent to every client
        attached then)."""
        return self._terminal

    @property
    def failed(self) -> bool:
        """Whether a client's output thread failed."""
        with self._lock:
            outboxes = list(self._all)
        return any(o.failed for o in outboxes)

    def start(self) -> None:
        """Nothing to start: each client's outbox starts when it is welcomed."""

    def post(self, item: Any, weight: int | None = None) -> None:
        """Any thread: an event for every client (``stalled``, ``resumed``, ``shutdown``,
        ``fatal``). Never blocks."""
        with self._lock:
            if item[0] in _TERMINAL:
                self._terminal = item[0]
            outboxes = [entry[0] for entry in self._open.values()]
        for outbox in outboxes:
            outbox.post(item, weight)

    def close(self, timeout: float) -> None:
        """Let every client's output thread send what is queued, then end; wait up to
        *timeout* seconds in all."""
        deadline = time.monotonic() + timeout
        with self._lock:
            outboxes = [entry[0] for entry in self._open.values()]
        for outbox in outboxes:
            outbox.close(0.0)
        for outbox in outboxes:
            outbox.join(max(0.0, deadline - time.monotonic()))

    def join(self, timeout: float | None = None) -> None:
        """Wait until every client's output thread has ended (each up to *timeout*)."""
        with self._lock:
            outboxes = list(self._all)
        for outbox in outboxes:
            outbox.join(timeout)

    def take_dropped(self) -> int:
        """What the clients' outboxes dropped past the detached bound (a client's outbox is
        never detached: 0)."""
        with self._lock:
            outboxes = [entry[0] for entry in self._open.values()]
        return sum(o.take_dropped() for o in outboxes)

    def unlink_all(self) -> None:
        """After the stage has ended: remove the ipc socket files still left."""
        with self._lock:
            addresses = [entry[1] for entry in self._open.values()]
            self._open.clear()
        for address in addresses:
            _unlink(address)


def _unlink(address: str) -> None:
    if address.startswith("ipc://"):
        with contextlib.suppress(OSError):
            os.unlink(address[len("ipc://") :])


def session_endpoint(base: str, epoch: int) -> str:
    """Where a multi-client stage binds session *epoch*'s output socket, given its own
    output endpoint *base*: on tcp, the same host and a port the system picks; otherwise
    (ipc) *base* with ``-<epoch>`` appended."""
    if base.startswith("tcp://"):
        host = base[len("tcp://") :].rsplit(":", 1)[0]
        return f"tcp://{host}:*"
    return f"{base}-{epoch}"
