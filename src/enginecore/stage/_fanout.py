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
  clients see each other's load (``docs/pool.md``). A client that joins gets a report at
  the stage's next chance (:meth:`Fanout.bind`'s *joined*): the ones before went to the
  others.
- ``stalled``, ``resumed``, ``shutdown`` and ``fatal`` go to every client.

:class:`~._controls.ClientLeft` (a ``bye``, silence past the session timeout, a lost
output connection, or falling behind) aborts that client's live requests, and only its,
then ends its ``Outbox`` (what is queued for it is dropped) and closes its socket.

No client holds the loop back. A one-client stage waits before a step while its client is
far behind (back-pressure); here that would stall every client for the slowest one. Instead,
a client that has stopped taking frames (its socket is full: :attr:`~._outbox.Outbox.stuck`)
and has more than *client_buffer* events queued when a step's events come for it is *cut*
(:meth:`Fanout.post_step`, loop thread). (A client whose output thread is merely behind,
with the socket taking frames, is waited for as before, past :data:`BACKLOG_MAX`: that is
the stage's own CPU, not the client. A client whose ``PULL`` has not connected yet takes no
frames either: its first events wait for it, up to the bound, so that a client that never
connects cannot hold the loop.)
Its outbox ends at once (its queue dropped
and counted, its socket closed), what the loop emits for it from then on goes nowhere, and
the input side is told (:meth:`Fanout.take_gone`, woken through :attr:`Fanout.wake_fd`), which
detaches the client the usual way: a ``ClientLeft`` in order after what it sent, which
aborts its requests. Each client's output socket also has a monitor, which the input side
reads (:attr:`Fanout.new_monitors`): a client whose output connection closed is detached
too (``_stage_session.MultiStageSession``).
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

__all__ = [
    "CLIENT_BUFFER",
    "LIVE_FOR_ANOTHER",
    "RECHECK_MS",
    "ClientOutbox",
    "Fanout",
    "session_endpoint",
]

logger = logging.getLogger("enginecore.stage")

LIVE_FOR_ANOTHER: Final = (
    "add refused: this request id is live in the stage for another client (the clients "
    "of a shared stage must use request ids that are unique across all of them)"
)
"""The message of the ``error`` event for an ``add`` of an id that another client of a
multi-client stage has live."""

CLIENT_BUFFER: Final = BACKLOG_MAX
"""The default bound on the events (one per output) queued for one client of a multi-client
stage: past it, the client is detached (``serve --client-buffer``)."""

RECHECK_MS: Final = 100
"""How often a client's output thread, waiting for its peer, checks whether the client has
left (its socket is then closed without waiting for the peer)."""

_TERMINAL: Final = frozenset({"shutdown", "fatal"})


class ClientOutbox(Protocol):
    """What the fan-out uses of one client's :class:`~._outbox.Outbox`."""

    @property
    def backlog(self) -> int: ...

    @property
    def stuck(self) -> bool: ...

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

    def end(self) -> int: ...

    def close(self, timeout: float) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...

    def take_dropped(self) -> int: ...


class _Route(Protocol):
    """What the loop thread uses of a client's route: its :class:`ClientOutbox`, or
    :data:`_CUT`."""

    @property
    def backlog(self) -> int: ...

    @property
    def stuck(self) -> bool: ...

    def post_step(self, events: Events, weight: int, last: bool = False) -> None: ...

    def emit(self, ev: tuple[Any, ...]) -> None: ...

    def ended_dropped(self, req_ids: list[str]) -> None: ...

    def wait_for_room(self) -> None: ...


class _Cut:
    """What the loop routes to for a client that was cut (it fell behind): nothing reaches
    it, until its ``ClientLeft`` removes the route."""

    backlog = 0
    stuck = False

    def post_step(self, events: Events, weight: int, last: bool = False) -> None:
        pass

    def emit(self, ev: tuple[Any, ...]) -> None:
        pass

    def ended_dropped(self, req_ids: list[str]) -> None:
        pass

    def wait_for_room(self) -> None:
        pass


_CUT: Final = _Cut()


class Fanout:
    """The output side of a multi-client stage (module docstring). Implements
    :class:`~._outbox.StageOutput` for the loop thread and the runtime,
    :class:`~._controls.ClientsTarget` for the client controls, and what
    :class:`~._stage_session.MultiStageSession` needs (:meth:`open_session`,
    :meth:`post_to`).

    *open_output(epoch)* binds a new ``PUSH`` socket for session *epoch* and returns its
    :class:`~._outbox.Outbox` (not started, not detached, with ``recheck_ms``
    :data:`RECHECK_MS`), its endpoint, and a monitor socket on it (or ``None``) that
    reports its connections (input thread; :class:`ClientOutbox` is what is used of the
    outbox). *prepare_outputs* is an :class:`~._outbox.Outbox`'s
    :meth:`~._outbox.Outbox.prepare_outputs` (the same policy for every client).
    :meth:`bind` gives it the stage's live requests and the function that drops requests
    from the engine. *client_buffer* bounds what is queued for one client (module
    docstring)."""

    # Threads and what they own:
    # - _open (session epoch -> its Outbox and endpoint), _all and _terminal: under _lock.
    #   The input thread adds to _open (open_session), the loop thread removes (left), the
    #   runtime reads it at the end (close, join).
    # - _routes, _current, _current_epoch, _owner and _shared: the loop thread's alone.
    #   _routes holds the sessions the loop has applied ClientJoined for, and not yet
    #   ClientLeft; _owner maps a live request id to its session's epoch, kept only while
    #   _shared (more than one route). A route is _CUT once its client fell behind, until
    #   its ClientLeft.
    # - _gone (sessions cut and not yet taken by the input side) and gone_waiting: under
    #   _lock; the loop thread appends and writes a byte to the wake pipe, the input side
    #   takes them (take_gone) and drains the pipe.
    # - new_monitors: the input side's alone (open_session appends, the Inbox takes).

    def __init__(
        self,
        open_output: Callable[[int], tuple[ClientOutbox, str, Any]],
        *,
        prepare_outputs: Callable[[list[Any], list[Any], list[Any]], Events],
        detached_max: int,
        client_buffer: int = CLIENT_BUFFER,
    ) -> None:
        self._open_output = open_output
        self._prepare_outputs = prepare_outputs
        self._detached_max = detached_max
        self.client_buffer = client_buffer
        self.new_monitors: list[tuple[int, Any]] = []
        """``(epoch, monitor socket)`` of the client sockets opened since the input side
        last took them (it polls each, and closes it once its socket has closed)."""
        self._gone: list[tuple[int, str]] = []
        self.gone_waiting = False
        """Whether a client was cut and the input side has not taken it yet (unlocked
        peek; :meth:`take_gone`)."""
        self.cut_clients = 0
        """How many clients were cut for falling behind."""
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._lock = threading.Lock()
        self._open: dict[int, tuple[ClientOutbox, str]] = {}
        self._all: list[ClientOutbox] = []  # every outbox still running, or that failed
        self._terminal: str | None = None
        self._routes: dict[int, _Route] = {}
        self._current: _Route | None = None
        self._current_epoch = 0
        self._owner: dict[str, int] = {}
        self._shared = False
        self._live: set[str] = set()
        self._drop: Callable[[Sequence[str]], None] = lambda ids: None
        self._on_joined: Callable[[], None] = lambda: None

    def bind(
        self,
        live: set[str],
        drop: Callable[[Sequence[str]], None],
        *,
        joined: Callable[[], None] | None = None,
    ) -> None:
        """The stage's live requests, the function that drops requests from the engine
        (no ``aborted`` event): a leaving client's requests go through it, and *joined*,
        called on the loop thread once a client's route is in place (:meth:`joined`): the
        stage's load reports send that client one at the next chance
        (``LoadReporter.resend``)."""
        self._live = live
        self._drop = drop
        if joined is not None:
            self._on_joined = joined

    # -- input thread ------------------------------------------------------------------------

    def open_session(self, epoch: int) -> str:
        """Input thread, at a ``hello`` that is welcomed: open session *epoch*'s socket and
        outbox (*open_output*), start the outbox; its endpoint (for the ``welcome``).
        Raises what opening raises."""
        outbox, address, monitor = self._open_output(epoch)
        with self._lock:
            self._all = [o for o in self._all if o.running or o.failed]
            self._all.append(outbox)
            self._open[epoch] = (outbox, address)
        if monitor is not None:
            self.new_monitors.append((epoch, monitor))
        outbox.start()
        return address

    def post_to(self, epoch: int, item: Any, weight: int) -> None:
        """Input thread: events for the client of session *epoch* (a pong, an input error,
        its ``stats`` answer). Dropped if it has left. Never blocks."""
        with self._lock:
            entry = self._open.get(epoch)
        if entry is not None:
            entry[0].post(item, weight)

    @property
    def wake_fd(self) -> int:
        """A pipe that becomes readable when a client is cut: the input side polls it, then
        calls :meth:`take_gone`."""
        return self._wake_r

    def take_gone(self) -> list[tuple[int, str]]:
        """Input side: the sessions cut since the last call, with why, and drain the wake
        pipe. Never blocks."""
        with self._lock:
            gone, self._gone = self._gone, []
            self.gone_waiting = False
        with contextlib.suppress(OSError):  # BlockingIOError: empty; EBADF: closed at the end
            os.read(self._wake_r, 4096)
        return gone

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
        # The reports made so far went to the others only (this one, welcomed on the input
        # side, had no route yet): the next chance sends one to every client.
        self._on_joined()

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
        bound = self.client_buffer
        if not self._shared:
            for e, only in routes.items():  # none or one
                if only.backlog > bound and only.stuck:
                    self._cut(e, only)
                else:
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
                if route.backlog > bound and route.stuck:
                    self._cut(e, route)
                else:
                    route.post_step(evs, _weight(evs), last)

    def _cut(self, epoch: int, route: _Route) -> None:
        """Loop thread: session *epoch*'s client has more than :attr:`client_buffer` events
        queued: end its outbox (its queue dropped), route nothing more to it, and tell the
        input side, which detaches it (module docstring). Never blocks."""
        backlog = route.backlog
        with self._lock:
            entry = self._open.get(epoch)
        dropped = 0 if entry is None else entry[0].end()
        self._routes[epoch] = _CUT
        if self._current_epoch == epoch:
            self._current = _CUT
        self.cut_clients += 1
        why = (
            f"fell behind: {backlog} events (one per output) were queued for it, past the "
            f"client buffer ({self.client_buffer}); its queue was dropped ({dropped} events)"
        )
        with self._lock:
            self._gone.append((epoch, why))
            self.gone_waiting = True
        with contextlib.suppress(OSError):  # full: a wake-up is pending anyway
            os.write(self._wake_w, b"x")

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
        """``StageOutput.wait_for_room``: for each client with more than
        :data:`BACKLOG_MAX` events queued, cut it if it is stuck past its bound, else wait
        while its output thread catches up and the client takes frames (its outbox's
        ``may_wait`` stops the wait once it is stuck; the next step then cuts it)."""
        bound = self.client_buffer
        for e, route in list(self._routes.items()):
            if route.backlog > BACKLOG_MAX:
                if route.stuck:
                    if route.backlog > bound:
                        self._cut(e, route)
                else:
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
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


def _unlink(address: str) -> None:
    if address.startswith("ipc://"):
        with contextlib.suppress(OSError):
            os.unlink(address[len("ipc://") :])


def session_endpoint(base: str, epoch: int) -> str:
    """Where a multi-client stage binds session *epoch*'s output socket, given its own
    output endpoint *base*: on tcp, the same host and a port the system picks; otherwise
    (ipc) *base* with ``-<epoch>`` appended (the runtime counts on past a path that is not
    free: ``StageRuntime._client_endpoint``)."""
    if base.startswith("tcp://"):
        host = base[len("tcp://") :].rsplit(":", 1)[0]
        return f"tcp://{host}:*"
    return f"{base}-{epoch}"
