"""The stage's controls: the actions that must reach the loop in order with a client's
messages, as named :class:`~enginecore.Control` messages (contract rule 18).

Each is queued on the loop's ``input_queue`` like an ``Add`` and applied on the loop
thread, in queue order, by calling the :class:`~._stage_engine.StageEngine` method that
does the work (:class:`StageTarget`); the loop passes itself in, so a control can stop it
or schedule more work. None of them can be sent by a client: the input side makes them
from what it decoded (:mod:`._stage_session`), the output side from what it could not
send, the runtime from ``serve``'s SIGTERM, a drain's timer from its deadline.

========================  =================================================================
control                   made by, and what the loop does with it
========================  =================================================================
:class:`Stop`             a client's ``shutdown`` (or ``serve``'s SIGTERM with a drain):
                          stop now, or drain first (``StageEngine.stop``)
:class:`DrainDeadline`    the drain's timer: abort what is still live, then stop
:class:`DropEnded`        the output side ended a request with an ``error`` before its last
                          output: drop it from the engine, with no ``aborted`` event
:class:`SessionChange`    a ``bye`` (*epoch* ``None``) or a new client welcomed: abort the
                          leaving client's live requests, and tell the outbox which session
                          the loop's events belong to from now on
:class:`AddBurst`         a client's ``adds`` frame: one message for the whole burst,
                          applied item by item as if each were its own ``Add``
:class:`PipeInput`        a pipeline's previous stage's ``pipe`` frame: input for requests
                          (a first one, more, the end), item by item
:class:`PipeCredit`       the coordinator's ``credit``: the next stage took what this one
                          sent it, so the window to it has room again
:class:`PipeGone`         the coordinator's ``gone``: the previous or the next stage died;
                          also, one per late message from a gone previous stage, dropped
:class:`PipeLink`         the coordinator's ``link``: a replica of the next stage was
                          started again; connect that link to its new address
:class:`PipeReplay`       the coordinator's ``replay``: the next stage failed a request;
                          abort it down the link, send its logged inputs again
:class:`PipeRelease`      the coordinator's ``release``: requests done; forget their logs
:class:`PipeRoute`        a pipeline with replica pools: the routes of requests (the
                          coordinator's ``route``, or a ``pipe``'s or ``abort``'s routes)
:class:`PipeFence`        an ``abort`` flagged as a replay's fence: applied as any abort,
                          answered by an ``aborted`` flagged the same, chased on flagged
:class:`PipeAbort`        an ``abort`` the coordinator tagged (sent after a death): applied
                          as any abort, answered and chased on with the same tag
:class:`ClientJoined`     a multi-client stage welcomed a client (``serve --max-clients``):
                          its outputs, answers and errors go to its own output socket
:class:`ClientInput`      a multi-client stage: the messages after it come from that client
                          (queued only when the sender changes)
:class:`ClientLeft`       a multi-client stage: that client said ``bye`` or went silent past
                          the session timeout: abort its live requests, close its socket
========================  =================================================================
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from .._messages import Control

if TYPE_CHECKING:
    from .._loop import EngineCoreLoop

__all__ = [
    "AddBurst",
    "ClientInput",
    "ClientJoined",
    "ClientLeft",
    "ClientsTarget",
    "DrainDeadline",
    "DropEnded",
    "PipeAbort",
    "PipeCredit",
    "PipeFence",
    "PipeGone",
    "PipeInput",
    "PipeLink",
    "PipeRelease",
    "PipeReplay",
    "PipeRoute",
    "SessionChange",
    "StageTarget",
    "Stop",
]


class StageTarget(Protocol):
    """What the controls call: the loop's engine in a stage
    (:class:`~._stage_engine.StageEngine`). A protocol, so that this module imports nothing
    of the stage: the adapter imports the controls, not the other way round."""

    def stop(self, drain: float | None, loop: EngineCoreLoop) -> None: ...

    def drain_deadline(self, timer: int) -> None: ...

    def drop_ended(self, req_ids: Sequence[str]) -> None: ...

    def change_session(self, epoch: int | None, *, abort: bool = False) -> None: ...

    @property
    def add_burst(self) -> Callable[[list[str], list[Any]], None]: ...

    def pipe_input(
        self,
        kinds: list[int],
        req_ids: list[str],
        data: list[Any],
        received: tuple[int, int, int, int],
    ) -> None: ...

    def pipe_credit(self, items: int, nbytes: int, replica: int) -> None: ...

    def pipe_gone(self, side: str, late: int, replica: int, generation: int | None) -> None: ...

    def pipe_link(
        self, replica: int, address: str, slots: str, server_key: str, generation: int | None
    ) -> None: ...

    def pipe_route(self, req_ids: list[str], routes: list[list[Any]], abort: bool) -> None: ...

    def pipe_replay(self, req_id: str, attempt: int) -> None: ...

    def pipe_release(self, req_ids: list[str]) -> None: ...

    def pipe_fence(self, req_ids: Sequence[str]) -> None: ...

    def pipe_abort(self, req_ids: Sequence[str], tag: int) -> None: ...


class ClientsTarget(Protocol):
    """What the client controls call: a multi-client stage's output side
    (:class:`~._fanout.Fanout`), which routes the loop's events to each client's socket."""

    def joined(self, epoch: int) -> None: ...

    def sender(self, epoch: int) -> None: ...

    def left(self, epoch: int) -> None: ...


class ClientJoined(Control):
    """A multi-client stage welcomed the client of session *epoch*: from here on, its
    requests' outputs and its answers go to its own output socket."""

    __slots__ = ("clients", "epoch")

    def __init__(self, clients: ClientsTarget, epoch: int) -> None:
        self.clients = clients
        self.epoch = epoch

    def apply(self, engine: StageTarget, loop: EngineCoreLoop) -> None:
        self.clients.joined(self.epoch)

    def __repr__(self) -> str:
        return f"ClientJoined(epoch={self.epoch})"


class ClientInput(Control):
    """A multi-client stage: the messages queued after this one come from the client of
    session *epoch* (an add it makes live is its request; an error or ``aborted`` that
    answers them is its event). Queued only when the sender changes."""

    __slots__ = ("clients", "epoch")

    def __init__(self, clients: ClientsTarget, epoch: int) -> None:
        self.clients = clients
        self.epoch = epoch

    def apply(self, engine: StageTarget, loop: EngineCoreLoop) -> None:
        self.clients.sender(self.epoch)

    def __repr__(self) -> str:
        return f"ClientInput(epoch={self.epoch})"


class ClientLeft(Control):
    """A multi-client stage: the client of session *epoch* said ``bye`` or was silent past
    the session timeout. Applied after everything it sent: its live requests (only its
    own) are aborted, with no ``aborted`` event, and its output socket closes."""

    __slots__ = ("clients", "epoch")

    def __init__(self, clients: ClientsTarget, epoch: int) -> None:
        self.clients = clients
        self.epoch = epoch

    def apply(self, engine: StageTarget, loop: EngineCoreLoop) -> None:
        self.clients.left(self.epoch)

    def __repr__(self) -> str:
        return f"ClientLeft(epoch={self.epoch})"


class Stop(Control):
    """A client's ``shutdown``: stop after everything sent before it (*drain* ``None``), or
    drain for at most *drain* seconds first (``StageEngine.stop`` has the rules).

    Applied in order, unlike ``request_shutdown()`` from the input thread, which, called
    before ``run()`` has started, would make the run skip what is already queued."""

    __slots__ = ("drain",)

    def __init__(self, drain: float | None = None) -> None:
        self.drain = drain

    def apply(self, engine: StageTarget, loop: EngineCoreLoop) -> None:
        engine.stop(self.drain, loop)

    def __repr__(self) -> str:
        return f"Stop(drain={self.drain!r})"


class DrainDeadline(Control):
    """Queued by a drain's timer: the requests still live are aborted, each with an
    ``error`` event, and the loop stops. Stale (nothing done) if the drain it belongs to
    has ended, or a later drain replaced it, before the timer's control was applied: *timer*
    numbers the drain's timers."""

    __slots__ = ("timer",)

    def __init__(self, timer: int) -> None:
        self.timer = timer

    def apply(self, engine: StageTarget, loop: EngineCoreLoop) -> None:
        engine.drain_deadline(self.timer)

    def __repr__(self) -> str:
        return f"DrainDeadline(timer={self.timer})"


class DropEnded(Control):
    """Drop *req_ids* from the engine: the stage has ended each with an ``error`` event (an
    output that could not be encoded, or that the routing hook made a
    :class:`~enginecore.RequestRejected`) before its last output. No ``aborted`` event: the
    error was the request's last event, and the client may already have added the id again.
    Queued before the error event is sent, so it applies before anything the client sends
    once it has seen the error."""

    __slots__ = ("req_ids",)

    def __init__(self, req_ids: Sequence[str]) -> None:
        self.req_ids = req_ids

    def apply(self, engine: StageTarget, loop: EngineCoreLoop) -> None:
        engine.drop_ended(self.req_ids)

    def __repr__(self) -> str:
        return f"DropEnded({list(self.req_ids)!r})"


class SessionChange(Control):
    """The end of a session (*epoch* ``None``: a ``bye``) or the start of session *epoch*
    (a client welcomed). Applied after everything the previous client sent: its live
    requests are aborted unless the stage keeps them (always with *abort*: the client's
    CURVE key was revoked), with no ``aborted`` event (nobody asked), and the loop's events
    belong to session *epoch* from then on."""

    __slots__ = ("abort", "epoch")

    def __init__(self, epoch: int | None, *, abort: bool = False) -> None:
        self.epoch = epoch
        self.abort = abort

    def apply(self, engine: StageTarget, loop: EngineCoreLoop) -> None:
        engine.change_session(self.epoch, abort=self.abort)

    def __repr__(self) -> str:
        return f"SessionChange(epoch={self.epoch!r}, abort={self.abort!r})"


class AddBurst(Control):
    """A client's ``adds`` frame as one message: ``add(req_ids[i], data[i])`` for each
    ``i``, in order, each exactly as a lone ``Add`` would be (no message per request to
    build, and one dispatch by the loop). The lengths are equal (the session checks)."""

    __slots__ = ("data", "req_ids")

    def __init__(self, req_ids: list[str], data: list[Any]) -> None:
        self.req_ids = req_ids
        self.data = data

    def apply(self, engine: StageTarget, loop: EngineCoreLoop) -> None:
        try:
            engine.add_burst(self.req_ids, self.data)
        finally:
            # The loop's statistics count adds, and this is as many (refused ones too,
            # as the loop counts an Add that the engine refuses).
            loop._stats.adds += len(self.req_ids)

    def __repr__(self) -> str:
        return f"AddBurst({len(self.req_ids)} requests)"


class PipeInput(Control):
    """A ``pipe`` frame from the previous stage of a pipeline (``docs/wire.md`` section 8):
    ``kinds[i]`` of input ``data[i]`` for request ``req_ids[i]``, applied in order
    (``StageEngine.pipe_input``). The lengths are equal (the session checks)."""

    __slots__ = ("data", "kinds", "received", "req_ids")

    def __init__(
        self,
        kinds: list[int],
        req_ids: list[str],
        data: list[Any],
        received: tuple[int, int, int, int] = (0, 0, 0, 0),
    ) -> None:
        self.kinds = kinds
        self.req_ids = req_ids
        self.data = data
        self.received = received
        """``(items, nbytes, sender, generation)`` of the whole frame, invalid items
        included: what the stage gives back as credit to the one that sent it (*sender*: its
        replica index; *generation*: its process's, from its link's routing id)."""

    def apply(self, engine: StageTarget, loop: EngineCoreLoop) -> None:
        try:
            engine.pipe_input(self.kinds, self.req_ids, self.data, self.received)
        finally:
            # A request's first input is its add, for the loop's statistics.
            loop._stats.adds += sum(kind & 1 for kind in self.kinds)

    def __repr__(self) -> str:
        return f"PipeInput({len(self.req_ids)} items)"


class PipeCredit(Control):
    """The coordinator's ``credit`` (``docs/wire.md`` section 8): the next stage of a
    pipeline took *items* items, *nbytes* bytes, of what this stage sent it
    (``StageEngine.pipe_credit``)."""

    __slots__ = ("items", "nbytes", "replica")

    def __init__(self, items: int, nbytes: int, replica: int = 0) -> None:
        self.items = items
        self.nbytes = nbytes
        self.replica = replica  # which replica of the next stage took it

    def apply(self, engine: StageTarget, loop: EngineCoreLoop) -> None:
        engine.pipe_credit(self.items, self.nbytes, self.replica)

    def __repr__(self) -> str:
        return f"PipeCredit({self.items} items, {self.nbytes} bytes)"


class PipeGone(Control):
    """The coordinator's ``gone`` (``docs/wire.md`` section 8): the pipeline's stage on
    *side* of this one (``"previous"`` or ``"next"``) died (``StageEngine.pipe_gone``).
    With *late* > 0: the input side dropped that many messages that came from the gone
    previous stage after the ``gone`` (counted; they are never decoded). *replica*: which
    process of the stage on that side (a pool, or a stage that restarts); *generation*, on
    the ``"previous"`` side: that process's generation (from the dead link's routing id),
    ``None`` for a link without a replica (any process at that index)."""

    __slots__ = ("generation", "late", "replica", "side")

    def __init__(
        self, side: str, late: int = 0, replica: int = 0, generation: int | None = None
    ) -> None:
        self.side = side
        self.late = late
        self.replica = replica
        self.generation = generation

    def apply(self, engine: StageTarget, loop: EngineCoreLoop) -> None:
        engine.pipe_gone(self.side, self.late, self.replica, self.generation)

    def __repr__(self) -> str:
        return f"PipeGone({self.side!r}, late={self.late})"


class PipeLink(Control):
    """The coordinator's ``link`` (``docs/wire.md`` section 8): replica *replica* of the
    next stage was started again at *address* (``StageEngine.pipe_link``); *slots*: the
    new link's shared-memory slot prefix (``""``: none); *server_key*: its CURVE public key
    (Z85) if it listens on TCP (``""``: ipc); *generation*: the new process's (``None``: a
    coordinator that does not say it), which the routes' generations are told against."""

    __slots__ = ("address", "generation", "replica", "server_key", "slots")

    def __init__(
        self,
        replica: int,
        address: str,
        slots: str = "",
        server_key: str = "",
        generation: int | None = None,
    ) -> None:
        self.replica = replica
        self.address = address
        self.slots = slots
        self.server_key = server_key
        self.generation = generation

    def apply(self, engine: StageTarget, loop: EngineCoreLoop) -> None:
        engine.pipe_link(self.replica, self.address, self.slots, self.server_key, self.generation)

    def __repr__(self) -> str:
        return f"PipeLink({self.replica}, {self.address!r})"


class PipeReplay(Control):
    """The coordinator's ``replay`` (``docs/wire.md`` section 8): the next stage failed
    *req_id*; abort it down the link and send its logged inputs again, as attempt *attempt*
    (``StageEngine.pipe_replay``)."""

    __slots__ = ("attempt", "req_id")

    def __init__(self, req_id: str, attempt: int) -> None:
        self.req_id = req_id
        self.attempt = attempt

    def apply(self, engine: StageTarget, loop: EngineCoreLoop) -> None:
        engine.pipe_replay(self.req_id, self.attempt)

    def __repr__(self) -> str:
        return f"PipeReplay({self.req_id!r}, attempt={self.attempt})"


class PipeRelease(Control):
    """The coordinator's ``release`` (``docs/wire.md`` section 8): *req_ids* are done in the
    pipeline; their replay logs go (``StageEngine.pipe_release``)."""

    __slots__ = ("req_ids",)

    def __init__(self, req_ids: list[str]) -> None:
        self.req_ids = req_ids

    def apply(self, engine: StageTarget, loop: EngineCoreLoop) -> None:
        engine.pipe_release(self.req_ids)

    def __repr__(self) -> str:
        return f"PipeRelease({len(self.req_ids)} requests)"


class PipeRoute(Control):
    """A pipeline with replica pools (``docs/wire.md`` section 8): the routes of *req_ids*
    (per id, the replicas of the stages after this one; ``[replica, generation]`` for a
    stage that restarts, section 8, "Restarts"), from the coordinator's ``route``
    before their add, a ``pipe``'s first inputs, or an ``abort`` (*abort*: for chasing it,
    applied right before it) (``StageEngine.pipe_route``)."""

    __slots__ = ("abort", "req_ids", "routes")

    def __init__(self, req_ids: list[str], routes: list[list[Any]], abort: bool = False) -> None:
        self.req_ids = req_ids
        self.routes = routes
        self.abort = abort

    def apply(self, engine: StageTarget, loop: EngineCoreLoop) -> None:
        engine.pipe_route(self.req_ids, self.routes, self.abort)

    def __repr__(self) -> str:
        return f"PipeRoute({len(self.req_ids)} requests, abort={self.abort})"


class PipeAbort(Control):
    """An ``abort`` tagged by the coordinator (``docs/wire.md`` section 8, "Tagged aborts":
    one it sent after a death): applied as the loop applies an ``Abort``, answered by an
    ``aborted`` event with the same tag, and sent on down the link still tagged
    (``StageEngine.pipe_abort``), so that the coordinator tells its answer from one to a
    copy of an earlier abort. (The loop's statistics count it in ``aborts``, as the
    ``abort`` message it is on the wire, and as a control.)"""

    __slots__ = ("req_ids", "tag")

    def __init__(self, req_ids: list[str], tag: int) -> None:
        self.req_ids = req_ids
        self.tag = tag

    def apply(self, engine: StageTarget, loop: EngineCoreLoop) -> None:
        try:
            engine.pipe_abort(self.req_ids, self.tag)
        finally:
            loop._stats.aborts += 1  # an abort message applied, as the loop counts an Abort

    def __repr__(self) -> str:
        return f"PipeAbort({self.req_ids!r}, tag={self.tag})"


class PipeFence(Control):
    """An ``abort`` flagged as a replay's *fence* (``docs/wire.md`` section 8): applied as
    the loop applies an ``Abort``, answered by an ``aborted`` event flagged the same, and
    sent on down the link still flagged (``StageEngine.pipe_fence``), so that the
    coordinator never takes its answer for the confirmation of an abort of its own. (The
    loop's statistics count it in ``aborts``: it is an ``abort`` message on the wire, and
    drops its requests from the engine as any abort does; as a control too.)"""

    __slots__ = ("req_ids",)

    def __init__(self, req_ids: list[str]) -> None:
        self.req_ids = req_ids

    def apply(self, engine: StageTarget, loop: EngineCoreLoop) -> None:
        try:
            engine.pipe_fence(self.req_ids)
        finally:
            loop._stats.aborts += 1  # an abort message applied, as the loop counts an Abort

    def __repr__(self) -> str:
        return f"PipeFence({self.req_ids!r})"
