"""One stage of a pipeline, inside its stage process: :class:`PipeStage`.

A pipeline (:mod:`._pipeline`) launches every stage with :func:`pipe_stage` as its factory.
It builds the user's engine and wraps it, so the stage runtime drives the wrapper as it
drives any engine; nothing else in the runtime knows about pipelines but one message,
``pipe`` (``docs/wire.md`` section 8), which the session turns into a
:class:`~._controls.PipeInput` control. The wrapper adds:

- **the edge**, in the producing stage's process: each routed output goes through the
  stage's edge function, ``edge(payload) -> (to_next, to_caller)``; ``to_next`` is sent
  straight to the next stage's input socket (a ``DEALER`` of this stage's own), one ``pipe``
  message per step, arrays without a copy; ``to_caller`` goes to the coordinator in the
  ``outputs`` event, as any output would. Either may be :data:`NOTHING`. Without an edge
  function every output goes to the next stage. The last stage has no edge: its outputs go
  to the caller.
- **the end of a request here** (``docs/wire.md`` section 8): the request's payloads for
  the caller are outputs with ``finished=False``, the last stage's too; its end is reported
  to the coordinator as an extra output of it, ``finished=True``, whose payload is an
  ``int`` of the bits ``ENDED``, ``SENT_ON`` and ``BEFORE`` (:mod:`._edge`), only where
  the coordinator needs it. A stage that sent payloads on, its input complete (no
  ``REPORT`` on its ``END``) and nothing sent to the caller, reports nothing: its ``END``
  tells the next stage, whose report covers it (the runtime takes such a request out of
  its live set through :meth:`PipeStage.take_ended`). One that sent nothing on reports
  ``ENDED | BEFORE``: the request stops here, done. Otherwise (it ended the request before
  its input did, its ``END`` said ``REPORT``, or it sent the caller payloads, which its
  report must follow) it reports its own end, and its ``END`` says ``REPORT``; a request
  it ended before its input did is reported ``BEFORE`` once the previous stage's ``END``
  arrives (:meth:`PipeStage.pipe_late`). The coordinator knows the request is done in the
  pipeline when it has ended in every stage it reached. An engine may end a request with
  the payload :data:`NOTHING`: the end, and no payload for anyone.
- **input from the previous stage**: ``pipe_input(kind, req_id, item)``. An engine with
  ``feed(req_id, data)`` gets its request's first input through ``add`` and every later one
  through ``feed``, as they arrive, and ``close_input(req_id)`` (if it has one) once its
  input is complete: when the previous stage's request ended, or right after ``add`` in
  the first stage, whose input is the caller's one item. An engine without ``feed`` gets
  one ``add(req_id, items)`` when the previous stage's request ends, *items* the list of
  every payload sent on, in order (the first stage: ``add(req_id, data)``, the caller's
  data as it is).
- **abort chases the data**: an ``abort`` message applied here is sent on to the next stage
  after the data this stage sent for those requests (one connection keeps order), so the
  next stage never receives a payload of a request after its abort, and the coordinator
  needs to send an abort to the first stage only. Each stage applies it once, and says so
  with one ``aborted`` event, which the coordinator counts. An abort of the stage's own (an
  error that ended the request, a detach, a drain's deadline) does not chase: the
  coordinator aborts an errored request from the first stage itself. A replay's fence
  (below) is an abort flagged as such: answered by a flagged ``aborted``
  (``StageEngine.pipe_fence``), and chased on flagged (:meth:`PipeStage.chase_abort`).
- **credits**: the stage counts what it sent the next stage and the next stage has not
  taken yet (items, and bytes of pipe frames); while that reaches its window,
  :meth:`PipeStage.has_work` says no, so the loop starts no step (messages are still
  applied). The next stage counts what its loop took (``pipe_received``, per frame) and
  gives it back as a ``credit`` event to the coordinator, which passes it on to this stage
  (``pipe_credit``), in batches: after a step (the runtime takes it, ``take_credit``, into
  that step's frame) once it took a quarter of this stage's window (*credit_items* or
  *credit_bytes*), or, for less, :data:`CREDIT_DELAY_S` after its loop went idle (the idle
  wait asks ``idle_due`` and calls ``idle_fire``; the event goes through the runtime's
  ``emit``, which it hands the wrapper: ``attach_emit``). Credit for inputs the engine
  still holds unprocessed (``pending_inputs()``) waits until they go out, with no
  deadline: a stage that waits on its engine or on a full window is not woken for it.
  What is held back is less than
  a quarter of the window, so it never holds a step of this stage back (a full window
  means the next stage has three quarters of it or more still to take, and is not idle).
  It saves a message through the coordinator and a wake-up of this stage for every small
  step (measured: a fifth of a hop's cost with one request in flight).
- **shared memory** (:mod:`._shm`): with a pool (*shm*), a numpy array of at least the
  pool's threshold that goes to the next stage is copied into one of this stage's
  shared-memory slots and travels as a reference (ext 4), under a lease the next stage
  renews while it holds the array; its bytes count against the window as a frame's do. A
  stage whose previous stage has a pool takes such arrays when its input side decodes the
  ``pipe`` message (:func:`._shm.configure_reader`). The pool's slots are unlinked at exit.
- **retry** (*replay_bytes*, the stage's ``on_next_error=Retry(n)``): the stage keeps a
  log of what it sent the next stage for each request (:meth:`PipeStage.pipe_replay`),
  from the request's first payload on until the request's abort, or the coordinator's
  ``release`` once the request is done in the pipeline. When the next stage fails a
  request, the coordinator sends ``replay``: the stage sends an ``abort`` of it down the
  link, flagged as a fence (``["abort", [id], routes, true]``, *routes* nil without pools:
  the next stages drop what they hold of it, and answer ``aborted``, flagged too, which the
  coordinator waits for, dropping their events until then), then the logged
  items again, as a first input, in order (and the end, if the request ended here), and
  answers ``replayed``. A request whose logged payloads exceed *replay_bytes* (estimated:
  :func:`payload_size`) loses its log: its replay fails, and the coordinator ends it.
- **replica pools** (*routed*: a stage of the pipeline runs as several processes,
  ``docs/pipelines.md``, "Replica pools as stages"): the stage holds a link to every
  replica of the next stage (*downstream* a list), each with its own window (a step does
  not start while any is full), and its own shared-memory pool (:func:`._shm.link_prefix`).
  Each request's route, the replicas of the stages after this one, arrives before its first
  input (:meth:`PipeStage.pipe_route`: the coordinator's ``route`` before the first
  stage's add, or a ``pipe`` message's routes); its first item picks the link, every later
  item and its end follow on that link, and the first item carries the rest of the route
  on. The route is forgotten when the request ends or is aborted here; an abort carries
  the routes of its requests, and is chased along them. The stage names its replica index
  in its pipe messages, and the next stage gives credit back per sending replica. A
  ``gone`` of one replica of the next stage closes that link only.
- **a dead neighbour** (``gone``, :meth:`PipeStage.pipe_gone`): the coordinator tells the
  stage after a dead one (whose input side then drops every later message of the dead
  stage's link, by its routing id, :func:`._edge.link_id`) and the stage before it (which
  sends it nothing more and unlinks and unmaps its slots).
- **a restarted neighbour** (``link``, :meth:`PipeStage.pipe_link`): a replica of the next
  stage was started again; the link to it is opened anew, to its new address, with an
  empty window and a new pool of slots named after its generation. The coordinator then
  calls :data:`~._edge.LINKS_UTILITY`, which the loop answers after it applied the ``link``.
  If the next stage restarts (*next_restarts*), what this stage would send a process of it
  that is gone is held meanwhile, per link, in order (``edge_held``), and sent down the new
  link first: a request routed to the new process may reach this stage before its
  ``link`` (they come on different connections). A request's held items go with its abort.
  What is held counts against its link's window as if in flight (items, and bytes by
  :func:`payload_size`), so a stage holding a window's worth stops stepping until the
  ``link`` sends it or aborts drop it (the loop applies messages while it waits); the later
  items of a request whose first item went to the dead process are dropped, not held.
  Where the routes name the generation of each request's process of the next stage
  (``[replica, generation]``, and the ``link`` the new process's: ``docs/wire.md`` section
  8, "Restarts"), the stage sorts by it: what is meant for its link's process goes, what is
  meant for a newer one is held (even before the dead one's ``gone``: down the old link it
  would be lost), and so is the chased abort of such a request, in order, for that
  generation's ``link``; what is meant for a dead one is dropped, its abort not chased.
  A restarted previous stage's process needs nothing here: its link has a new routing id
  (:func:`._edge.link_id`'s generation), which the input side tells the stage with each
  frame (:meth:`PipeStage.pipe_received`), and the credit still owed to the dead one is
  forgotten with its ``gone`` (or as soon as the new one sends: the two may be read in
  either order), which clears only what that generation sent.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeAlias

import zmq

from .._engine import Engine, PipelinedEngine
from .._exceptions import RequestRejected, describe
from . import _codec, _shm
from ._codec import only_types
from ._edge import (
    BEFORE,
    END,
    ENDED,
    FIRST,
    LINKS_UTILITY,
    MORE,
    NOTHING,
    ONLY,
    REPORT,
    SENT_ON,
)
from ._process import build_engine
from ._routing import make_router
from ._wire import is_ipv6_endpoint

__all__ = [
    "LINKS_UTILITY",
    "PipeStage",
    "PipelinedPipeStage",
    "pipe_stage",
]

logger = logging.getLogger("enginecore.stage")

# How long the link to the next stage may take to deliver its last messages at exit.
_LINK_LINGER_MS: Final = 2000

Edge = Callable[[Any], tuple[Any, Any]]

_NO_COLUMNS: Final[tuple[list[Any], list[bool], list[Any]]] = ([], [], [])

_Held: TypeAlias = "tuple[int, str, Any, list[Any] | None, int | None, int]"
"""What a stage holds for a gone process's successor (:meth:`PipeStage.pipe_link`):
``(kind, request, item, the rest of its route for a first item else None, the generation
its route names else None, the item's size)``; an abort to chase is ``(_HELD_ABORT,
request, (fence, tag), the rest of its route, generation, 0)``. The size
(:func:`payload_size`, taken once, as the item is held) is what the item counts against
the link's byte window while it is held (:meth:`PipeStage.has_work`)."""
_HELD_ABORT: Final = -1  # the kind of a held abort (no pipe kind is negative)


def _abort_message(
    req_ids: list[str], rests: list[list[Any]], fence: bool, tag: int | None
) -> tuple[Any, ...]:
    """The ``abort`` a routed stage chases down a link (``docs/wire.md`` section 8): with
    the rest of each request's route, and a fence's flag or a tag after it."""
    if tag is not None:
        return ("abort", req_ids, rests, fence, tag)
    if fence:
        return ("abort", req_ids, rests, True)
    return ("abort", req_ids, rests)


_UNBOUNDED: Final = 1 << 62

CREDIT_DELAY_S: Final = 0.002
"""How long an idle stage holds back credit below its batch (a quarter of the previous stage's
window) before it gives it back: the previous stage's ``edge_in_flight`` reaches 0 this
long after the pipeline went quiet. Requests that come closer together than this share
one ``credit`` message."""


def payload_size(value: Any, depth: int = 0) -> int:
    """About how many bytes *value* holds, for the replay log's bound: a string's, bytes'
    or buffer's length, an array's ``nbytes``, 8 per other scalar, the sum over a list,
    tuple or dict (keys too)."""
    cls = value.__class__
    if cls is str or cls is bytes or cls is bytearray:
        return len(value)
    if cls is int or cls is float or cls is bool or value is None:
        return 8
    view = getattr(value, "view", None)
    if isinstance(view, memoryview):  # a buffer that _codec.prepare() wrapped
        return view.nbytes
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):  # a numpy array or scalar, a memoryview
        return nbytes
    if depth > 64:
        return 8
    if isinstance(value, (list, tuple)):
        return 8 + sum([payload_size(v, depth + 1) for v in value])
    if isinstance(value, dict):
        return 8 + sum(
            [payload_size(k, depth + 1) + payload_size(v, depth + 1) for k, v in value.items()]
        )
    return 8


class PipeStage:
    """The user's :class:`~enginecore.Engine` *inner* as one stage of a pipeline (module
    docstring). *edge*: the edge function (``None``: every output to the next stage);
    *downstream*: the next stage's input address (``None``: the last stage, whose outputs
    all go to the caller). *window* and *window_bytes*: the most pipe items, and bytes of
    pipe messages, sent to the next stage and not yet taken by it (``None``: no bound); a
    step does not start while either is reached (module docstring, "credits"). *shm*: the
    pool of shared-memory slots for big arrays to the next stage (``None``: all on
    ZeroMQ). *downstream* may list the addresses of the next stage's replicas (a replica
    pool): one link to each, with a window each. *routed*: the pipeline has replica pools,
    so each request's route (the replicas of the stages after this one) arrives with its
    first input (``pipe_route``), picks its link, and goes on with it; *replica* is this
    stage's replica index, named in its pipe messages for the credit. *downstream_keys*:
    per link, the next stage's CURVE public key, or ``None`` (no CURVE); a link with one is
    a CURVE client with *link_curve* (this stage's ``(public, secret)`` key pair), which
    retries its handshake until the next stage admits the key. *next_restarts*: the next
    stage's dead processes are started again (routed only): what goes to one that is gone
    is held for the link to its successor (:meth:`pipe_link`), counted against that link's
    window (*window*, *window_bytes*) meanwhile; *next_generations*: per link,
    the generation of the process it goes to, which the routes' generations are told
    against (``None``: not known, nothing is told apart by it). Loop thread only, like any
    engine."""

    def __init__(
        self,
        inner: Engine | PipelinedEngine[Any],
        *,
        stage: str,
        edge: Edge | None = None,
        downstream: str | Sequence[str] | None = None,
        window: int | None = None,
        window_bytes: int | None = None,
        shm: _shm.ShmPool | Sequence[_shm.ShmPool] | None = None,
        shm_reader: _shm.ShmReader | None = None,
        link_id: str | None = None,
        replay_bytes: int | None = None,
        replica: int = 0,
        routed: bool = False,
        credit_items: int = 1,
        credit_bytes: int = 1,
        shm_factory: Callable[[str], _shm.ShmPool] | None = None,
        link_curve: tuple[bytes, bytes] | None = None,
        downstream_keys: Sequence[bytes | None] | None = None,
        next_restarts: bool = False,
        next_generations: Sequence[int] | None = None,
    ) -> None:
        self._inner = inner
        self._stage = stage
        self._shm_reader = shm_reader
        self._shm_factory = shm_factory  # a new link's pool (pipe_link), by slot prefix
        self._inner_has_work = inner.has_work
        self._inner_utility = inner.utility
        stats = getattr(inner, "stats", None)
        self._inner_stats: Callable[[], dict[str, float]] | None = (
            stats if callable(stats) else None
        )
        if downstream is None:
            downstreams: list[str] = []
        elif isinstance(downstream, str):
            downstreams = [downstream]
        else:
            downstreams = list(downstream)
        nlinks = len(downstreams)
        server_keys = [None] * nlinks if downstream_keys is None else list(downstream_keys)
        if len(server_keys) != nlinks:
            raise ValueError(f"{len(server_keys)} server keys for {nlinks} links")
        if any(k is not None for k in server_keys) and link_curve is None:
            raise ValueError("a link to a CURVE server needs this stage's link key pair")
        # Credits (loop thread only), per link. Sent on and not yet taken by the next stage:
        self._out_items = [0] * nlinks
        self._out_bytes = [0] * nlinks
        self._window_items = _UNBOUNDED if window is None else window
        self._window_bytes = _UNBOUNDED if window_bytes is None else window_bytes
        self._waiting = False  # has_work() said no for want of credit, and none came since
        self._waits = 0  # how often that began
        self._sent_items = 0
        self._sent_bytes = 0
        # Taken from the previous stage and not yet given back (a credit event, after the
        # next step or when the loop would go idle):
        self._taken_items = 0
        self._taken_bytes = 0
        # Routed: per sending process, (replica, generation), [items, bytes]; and per
        # replica, the newest generation that sent any (an older one is dead: pipe_received).
        self._taken_by: dict[tuple[int, int], list[int]] = {}
        self._newest: dict[int, int] = {}
        # Given back after a step once this much was taken (half the previous stage's
        # window), or CREDIT_DELAY_S after the loop went idle (at _credit_due, monotonic):
        self._credit_items = max(1, credit_items)
        self._credit_bytes = max(1, credit_bytes)
        self._credit_due: float | None = None
        # Routes (a pipeline with replica pools): per request live here, the link to the
        # next stage's replica it goes to, and the rest of its route, sent on with its first
        # input; the routes of an abort about to be chased (pipe_route(abort=True)).
        self._pooled = routed
        self._replica = replica
        self._next: dict[str, int] = {}
        self._rest: dict[str, list[Any]] = {}
        self._abort_routes: dict[str, list[Any]] = {}
        self._log_route: dict[str, tuple[int, list[Any], int | None]] = {}
        # A next stage that restarts, with routes that name generations (docs/wire.md
        # section 8, "Restarts"): per request whose route names one, the generation of its
        # process of the next stage; per link, the generation of the process it goes to
        # (None: not known, an older coordinator's link: no request is told apart by it).
        self._gen: dict[str, int] = {}
        # The requests of _gen whose generation is not their link's: their items are sorted
        # one by one (_by_generation); the others go as any.
        self._odd: set[str] = set()
        self._link_gens: list[int | None] = (
            [None] * nlinks if next_generations is None else list(next_generations)
        )
        if len(self._link_gens) != nlinks:
            raise ValueError(f"{len(self._link_gens)} generations for {nlinks} links")
        self._unroute: list[str] = []  # ended in this step: their routes go after the send
        self._emit: Callable[[Any], None] | None = None
        pending = getattr(inner, "pending_inputs", None)
        self._pending: Callable[[], int] | None = pending if callable(pending) else None
        self._route = make_router(inner)
        self._edge = edge
        feed = getattr(inner, "feed", None)
        close_input = getattr(inner, "close_input", None)
        self._feed: Callable[[str, Any], None] | None = feed if callable(feed) else None
        self._close_input: Callable[[str], None] | None = (
            close_input if callable(close_input) else None
        )
        # The requests live in this stage, as the wrapper sees them: added (or their first
        # input taken), not yet ended or aborted.
        self._live: set[str] = set()
        self._sent: dict[str, int] = {}  # payloads sent on, per live request that sent any
        # The end reports (module docstring, "the end of a request here"): the live requests
        # whose input is still open here (a feed engine's, between FIRST and END); those
        # whose END came with REPORT; those that ended here before their input did, whose
        # END from the previous stage is still to come. _open and _early map each to the
        # process of the previous stage that sends its input (its replica index and its
        # generation): if that one dies, the END of an early one never comes (pipe_gone).
        self._open: dict[str, tuple[int, int]] = {}
        self._report: set[str] = set()
        self._early: dict[str, tuple[int, int]] = {}
        # The process of the previous stage that sent the frame being applied: (replica,
        # generation).
        self._sender = (0, 0)
        self._spoke: set[str] = set()  # live requests whose edge sent the caller payloads
        self._quiet: list[str] = []  # ended in this step without a report (take_ended)
        self._gathered: dict[str, list[Any]] = {}  # inputs of a request, for an engine without feed
        # Shared memory: one pool per link (a list, one per replica of the next stage), or
        # one pool for the one link to a next stage of one process.
        if shm is None:
            shms: list[_shm.ShmPool | None] = [None] * nlinks
        elif isinstance(shm, _shm.ShmPool):
            shms = [shm] if nlinks == 1 else [None] * nlinks
        else:
            shms = list(shm)
            if len(shms) != nlinks:
                raise ValueError(f"{len(shms)} shared-memory pools for {nlinks} links")
        self._shms = shms
        self._encoders = [_codec.Encoder(pool) for pool in shms]
        self._encoder = _codec.Encoder()  # aborts: no arrays
        self._columns = _NO_COLUMNS
        self._links: list[zmq.Socket[Any] | None] = []
        # The next stage (or one replica of it) died (pipe_gone): nothing more is sent to
        # it, counted here. _next_gone: every link is gone.
        self._gone: set[int] = set()
        self._next_gone = False
        self._last = nlinks == 0
        self._edge_dropped = 0
        # A next stage that restarts (routed): what is sent to a process that is gone is
        # held, per link, in order, until the link to its successor (pipe_link), which sends
        # it first; a request's held items go with its abort (_unhold). Each: (kind,
        # request, item, the rest of its route for a first item, else None, the generation
        # its route names, else None); an abort to chase (_HELD_ABORT, request, (fence,
        # tag), the rest of its route, generation).
        self._holds = routed and next_restarts
        self._holding: dict[int, list[_Held]] = {}
        # Per link, the data items held (not the aborts) and their sizes (_Held's last
        # field): they count against the link's window as if in flight (has_work), so that
        # what is held while a process restarts is bounded as what is sent is. Kept exact
        # by _hold (adding) and _set_held (every removal: sent, dropped).
        self._held_items = [0] * nlinks
        self._held_bytes = [0] * nlinks
        # Per link, the requests whose first item is held: only theirs is held (_hold).
        self._held_firsts: dict[int, set[str]] = {}
        self._previous_gone = False
        self._late_dropped = 0  # messages of the gone previous stage, dropped unread
        # The replay log (retry), per request: what it sent on, in order, and its size; the
        # requests that ended here (their log ends with END); those whose log outgrew
        # replay_bytes (not retryable); replays done.
        self._replay_bytes = replay_bytes if nlinks else None
        # _split's fast path: no edge function, no replay log, a next stage, no routes.
        self._fast = edge is None and nlinks > 0 and self._replay_bytes is None and not routed
        self._log: dict[str, list[Any]] = {}
        self._log_size: dict[str, int] = {}
        self._log_ended: dict[str, int] = {}  # its END's REPORT bit, if it ended here
        self._unlogged: set[str] = set()
        self._replays = 0
        self._link_id = link_id
        self._ctx: zmq.Context[Any] | None = None
        self._link_curve = link_curve
        if nlinks:
            ctx = self._ctx = zmq.Context(io_threads=1)
            self._links = [
                self._connect(address, key)
                for address, key in zip(downstreams, server_keys, strict=True)
            ]
            links, pools = self._links, self._shms

            def close() -> None:  # at exit: deliver what is still queued, within the linger
                for sock in links:  # the current links (pipe_link replaces them in place)
                    if sock is not None:
                        sock.close()
                ctx.term()
                for pool in pools:
                    if pool is not None:
                        pool.close()

            atexit.register(close)

    def _connect(self, address: str, server_key: bytes | None = None) -> zmq.Socket[Any]:
        """A link to the next stage's process at *address*: a ``DEALER`` of this stage's
        own, with the routing id the coordinator names in a ``gone`` to the next stage; to
        a stage on TCP (*server_key*, its CURVE public key), a CURVE client with this
        stage's link keys."""
        assert self._ctx is not None
        sock: zmq.Socket[Any] = self._ctx.socket(zmq.DEALER)
        if self._link_id is not None:
            sock.setsockopt(zmq.ROUTING_ID, self._link_id.encode())
        if server_key is not None:
            assert self._link_curve is not None
            sock.curve_publickey, sock.curve_secretkey = self._link_curve
            sock.curve_serverkey = server_key
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, _LINK_LINGER_MS)
        if is_ipv6_endpoint(address):
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(address)
        return sock

    # -- the engine's methods, as the stage runtime calls them --------------------------------

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        """The engine's utilities, and one of the pipeline's own: :data:`LINKS_UTILITY`
        answers, per link to the next stage, whether it is up (the coordinator calls it
        after a ``link``, to know the link is in place: the loop applies messages in
        order)."""
        if name == LINKS_UTILITY:
            return [i not in self._gone for i in range(len(self._links))]
        return self._inner_utility(name, args)

    def has_work(self) -> bool:
        """The engine's, unless the window to the next stage is full: on some link, what is
        in flight and what is held for a process that restarts (:meth:`pipe_link`) reach
        the window, in items or bytes. Gives back the credit for what it took from the
        previous stage when the loop would go idle."""
        if self._inner_has_work():
            out_items, out_bytes = self._out_items, self._out_bytes
            if self._holding:  # held for a process that restarts: as if in flight
                out_items = [o + h for o, h in zip(out_items, self._held_items, strict=True)]
                out_bytes = [o + h for o, h in zip(out_bytes, self._held_bytes, strict=True)]
            if (
                max(out_items, default=0) < self._window_items
                and max(out_bytes, default=0) < self._window_bytes
            ):
                return True
            if not self._waiting:
                self._waiting = True
                self._waits += 1
        if self._taken_items:
            self._give_credit()
            if self._credit_due is None and self._taken_items > self._held():
                # Held back below the batch: give it later. (Not for inputs the engine
                # still holds: a deadline would fire, give nothing and be set again.)
                self._credit_due = time.monotonic() + CREDIT_DELAY_S
        return False

    def _held(self) -> int:
        """How many of the items taken the engine still holds unprocessed (its
        ``pending_inputs()``, at most all of them; 0 for an engine without it)."""
        if self._pending is None:
            return 0
        return min(self._taken_items, max(0, self._pending()))

    def idle_due(self) -> float | None:
        """The idle wait's timer (:class:`~._input_queue.IdleTimer`): when the credit held
        back as the loop went idle is due (``time.monotonic()``), or ``None``."""
        return self._credit_due if self._taken_items else None

    def idle_fire(self) -> None:
        """The idle wait's timer fired (loop thread, the engine idle): give back what is
        held back, however little."""
        self._credit_due = None
        self._give_credit(force=True)

    def attach_emit(self, emit: Callable[[Any], None]) -> None:
        """The stage runtime's ``emit`` (loop thread), for the credit events."""
        self._emit = emit

    def pipe_received(self, items: int, nbytes: int, sender: int = 0, generation: int = 0) -> None:
        """The stage runtime applies a pipe frame of *items* items, *nbytes* bytes, from
        replica *sender* of the previous stage, its process of *generation* (called before
        its items): give it back as credit after the next step (or when the loop would go
        idle), and note the sender of the items (``pipe_gone``).

        A process of a stage that restarts sends under its replica index, as the dead one
        at that index did, and the two can be read in any order (the dead one's messages
        still queued here, the ``gone`` that names it on another connection): so the sender
        is told by its generation too. Once a newer generation at that index sent anything,
        the older one is dead: the credit still owed to it is forgotten, and a late frame of
        it is given no credit (the credit goes to the replica index, that is, to the new
        process, whose window never held those items)."""
        self._sender = key = (sender, generation)
        if self._pooled and items:
            newest = self._newest.get(sender)
            if newest is None or generation > newest:
                self._newest[sender] = generation
                if newest is not None:
                    self._forgive(sender, newest)
            elif generation < newest:  # a dead process's frame, read after its successor's
                return
            by = self._taken_by.get(key)
            if by is None:
                self._taken_by[key] = [items, nbytes]
            else:
                by[0] += items
                by[1] += nbytes
        self._taken_items += items
        self._taken_bytes += nbytes

    def _forgive(self, replica: int, generation: int | None) -> None:
        """Forget the credit owed to the previous stage's process *replica* of *generation*
        and to every older one at that index (``None``: every generation): they died."""
        taken = self._taken_by
        for key in [k for k in taken if k[0] == replica]:
            if generation is None or key[1] <= generation:
                owed = taken.pop(key)
                self._taken_items = max(0, self._taken_items - owed[0])
                self._taken_bytes = max(0, self._taken_bytes - owed[1])

    def pipe_credit(self, items: int, nbytes: int, replica: int = 0) -> None:
        """The next stage (its replica *replica*) took *items* items, *nbytes* bytes, of
        what this one sent it."""
        if 0 <= replica < len(self._out_items):
            self._out_items[replica] = max(0, self._out_items[replica] - items)
            self._out_bytes[replica] = max(0, self._out_bytes[replica] - nbytes)
        self._waiting = False

    def pipe_route(self, req_ids: list[str], routes: list[list[Any]], abort: bool) -> None:
        """Routes through the replica pools after this stage (module docstring): per id,
        the next stage's replica first. *abort*: for the abort that follows, which
        :meth:`chase_abort` sends along them; otherwise the routes of requests whose first
        input comes next (the coordinator's ``route`` before the first stage's add, or a
        ``pipe`` message's)."""
        if abort:
            self._abort_routes.update(zip(req_ids, routes, strict=True))
            return
        nxt, rest, gens = self._next, self._rest, self._gen
        for rid, route in zip(req_ids, routes, strict=True):
            if route:
                first = route[0]
                if first.__class__ is list:  # [replica, generation]: a stage that restarts
                    index = nxt[rid] = first[0]
                    gen = gens[rid] = first[1]
                    link_gens = self._link_gens
                    known = link_gens[index] if 0 <= index < len(link_gens) else None
                    if known is not None and gen != known:
                        self._odd.add(rid)
                    elif self._odd:
                        self._odd.discard(rid)
                else:
                    nxt[rid] = first
                    if gens:
                        self._unroute_gen(rid)
                rest[rid] = route[1:]

    def pipe_gone(
        self, side: str, late: int, replica: int = 0, generation: int | None = None
    ) -> None:
        """The coordinator's ``gone``: the stage on *side* died.

        - ``"previous"`` (its process *replica* of *generation*, of a pool or a stage that
          restarts; *generation* ``None``: a link without a replica, whichever process sent
          at that index): the input side drops every later message of its link, unread
          (*late* of them each time it does: counted as ``pipe_dropped``); the requests it
          sent are aborted by the coordinator's abort, which follows the ``gone``. Those of
          them that ended here before their input did wait for an ``END`` that may have
          been among the dropped messages: they wait no more. (Such a request may be over
          for the coordinator already, with no abort to come: its previous stage reported
          its own end.) The credit still owed to that process is forgotten. Only what that
          generation sent: a process started again at that index may have sent already (its
          messages and this ``gone`` come on different connections, in no order), and its
          requests and credit stay.
        - ``"next"`` (its replica *replica*, of a pool): nothing more is sent to it (what
          would have been is counted as ``edge_dropped``), what is still queued for it is
          let go, its window is empty, and the shared-memory slots, which it can no longer
          release, are unlinked and unmapped, so that their memory returns now, not at
          shutdown. If the next stage restarts (*next_restarts*), what would have been sent
          to it is held instead, in order (``edge_held``), for the link to the process
          started in its place (:meth:`pipe_link`), counted against that link's window
          meanwhile (:meth:`has_work`); a request's held items are dropped
          (``edge_dropped``) when its abort is applied here."""
        if side == "previous":
            self._previous_gone = True
            self._late_dropped += late
            if late:
                return
            early = self._early
            if early:
                dead = [
                    rid
                    for rid, (r, g) in early.items()
                    if r == replica and (generation is None or g <= generation)
                ]
                for rid in dead:
                    del early[rid]
            if self._pooled:
                # That producer is gone: the credit owed to it goes with it, so that a
                # process started again in its place gets none of it (its window starts
                # empty); what its successor sent is owed to the successor.
                self._forgive(replica, generation)
            return
        links = self._links
        if side != "next" or not 0 <= replica < len(links) or replica in self._gone:
            return
        self._gone.add(replica)
        self._next_gone = len(self._gone) == len(links)
        link = links[replica]
        if link is not None:
            link.close(linger=0)
            links[replica] = None
        self._out_items[replica] = self._out_bytes[replica] = 0
        self._waiting = False
        pool = self._shms[replica]
        if pool is not None:
            pool.close()

    def pipe_link(
        self,
        replica: int,
        address: str,
        slots: str,
        server_key: str = "",
        generation: int | None = None,
    ) -> None:
        """The coordinator's ``link``: replica *replica* of the next stage was started again
        and listens at *address*. The link to it is replaced by a new one (a link still
        open, to a dead process the ``gone`` has not reached yet, is closed first), with an
        empty window, and, with *slots*, a new pool of shared-memory slots named so (the
        dead process's names are never reused). With *server_key* (Z85), the new process
        listens on TCP with CURVE: the link is a CURVE client with this stage's link keys (a
        stage launched without them, whose next stage did not listen on TCP, logs an error
        and does not replace the link: down after the usual ``gone``). Requests are routed
        to it from then on.

        What was held for that index since its ``gone`` (a next stage that restarts) goes
        down the new link first, in order (the requests whose first item is held:
        :meth:`_send_held`). It belongs to requests routed to the new process: the
        coordinator makes the new process routable once the start is done, and from the
        third stage on sends the ``link`` only once this stage applied the abort of every
        request the dead process held (``PipelineCore.linkable``), which dropped their held
        items; so a request routed to the new process whose data this stage applies before
        the ``link`` is not lost. (That data comes on another connection than the ``link``;
        it can come first once the coordinator made the new process routable without this
        stage's confirmation of the ``link`` (:data:`LINKS_UTILITY`), which it waits for up
        to ``startup_timeout``: a stage whose loop was held up through the restart.)

        *generation*: the new process's (``None``: a coordinator that does not say it).
        Where the routes name generations (``docs/wire.md`` section 8, "Restarts"), what was
        held for that generation goes now, what was held for an older one is dropped (its
        process died: an abort is not chased there, as for ``-1``), and what is held for a
        newer one stays held, for its own ``link``."""
        links = self._links
        if not 0 <= replica < len(links) or self._ctx is None:
            return
        if server_key and self._link_curve is None:
            logger.error(
                "enginecore: pipeline stage %r: a link to a stage on TCP with CURVE, but "
                "this stage has no link keys; the link to replica %d is not replaced",
                self._stage,
                replica,
            )
            return
        old = links[replica]
        if old is not None:
            old.close(linger=0)
        pool = self._shms[replica]
        if pool is not None:
            pool.close()
        new_pool = self._shm_factory(slots) if slots and self._shm_factory is not None else None
        if pool is not None and new_pool is not None:
            new_pool.carry_counts(pool)  # the stage's shm_* numbers count in all
        self._shms[replica] = new_pool
        self._encoders[replica] = _codec.Encoder(new_pool)
        links[replica] = self._connect(address, server_key.encode() or None)
        self._gone.discard(replica)
        self._next_gone = False
        self._out_items[replica] = self._out_bytes[replica] = 0
        self._waiting = False
        self._link_gens[replica] = generation
        gens = self._gen
        if gens:  # which requests' generation is not their link's now
            odd, nxt = self._odd, self._next
            for rid, gen in gens.items():
                if nxt.get(rid) == replica:
                    if generation is not None and gen != generation:
                        odd.add(rid)
                    else:
                        odd.discard(rid)
        held = self._holding.get(replica)
        if held:
            self._set_held(replica, [])  # out of the hold: in flight once sent
            self._send_held(replica, held, generation)

    def _unroute_gen(self, rid: str) -> None:
        """Forget the generation *rid*'s route named (its route is forgotten here)."""
        self._gen.pop(rid, None)
        self._odd.discard(rid)

    def _hold(
        self, index: int, kind: int, rid: str, item: Any, tail: list[Any] | None, gen: int | None
    ) -> None:
        """Hold a data item for link *index* (:meth:`pipe_link`), counted against its
        window (:meth:`has_work`) by its :func:`payload_size`: not the encoded size, which
        is known only once sent (a new link's encoder, the new process's shared-memory
        slots), but close to it for what matters (an array or a buffer: its ``nbytes``,
        taken at no cost), and cheap (the same estimate as the replay log's).

        A later item of a request whose first item is not held there is dropped at once
        (``edge_dropped``): its first item went to the dead process, and the new one has
        no use for the rest (:meth:`_send_held` would drop it at the link). Held, it would
        take room in the window until a ``link`` that may never come (a process that failed
        for good), when the coordinator counts the request done with no abort to drop it
        (one the dead process had ended, whose last items this stage made after its
        ``gone``)."""
        if kind & FIRST:
            self._held_firsts.setdefault(index, set()).add(rid)
        elif rid not in self._held_firsts.get(index, ()):
            self._edge_dropped += 1
            return
        size = payload_size(item)
        self._holding.setdefault(index, []).append((kind, rid, item, tail, gen, size))
        self._held_items[index] += 1
        self._held_bytes[index] += size

    def _set_held(self, index: int, held: list[_Held]) -> None:
        """What link *index* holds is now *held* (less than before: sent, or dropped), its
        counts recomputed from it; the room freed lets a step start (as a credit does)."""
        if held:
            self._holding[index] = held
        else:
            self._holding.pop(index, None)
        data = [h for h in held if h[0] != _HELD_ABORT]
        self._held_items[index] = len(data)
        self._held_bytes[index] = sum([h[5] for h in data])
        firsts = {h[1] for h in data if h[0] & FIRST}
        if firsts:
            self._held_firsts[index] = firsts
        else:
            self._held_firsts.pop(index, None)
        self._waiting = False

    def _send_held(self, index: int, held: list[_Held], generation: int | None = None) -> None:
        """Send what was held for link *index* while its process was gone (:meth:`pipe_link`):
        in order, before anything newer, counted against the new link's window as any
        send; a held abort goes as its own ``abort`` message, after the data held before
        it. An item the encoder refuses ends its request with an ``error`` event (the step
        that made it is over). *generation*: the new process's; what was held for an older
        one is dropped (its process died), what was held for a newer one stays held (its
        own ``link`` is still to come). Only the requests whose first item is held: the
        earlier items of the others went to the dead process, so the rest is of no use to
        the new one (a request the dead process had ended, whose last items came after its
        ``gone``; the coordinator may count it done, with no abort to come), and would be
        taken for a later request's under that id there: dropped (``edge_dropped``; as
        they are held already, :meth:`_hold`: this only makes sure)."""
        ready: list[_Held] = []
        later: list[_Held] = []
        for h in held:
            gen = h[4]
            if gen is None or generation is None or gen == generation:
                ready.append(h)
            elif gen > generation:
                later.append(h)
            elif h[0] != _HELD_ABORT:
                self._edge_dropped += 1
        if later:
            self._set_held(index, later)
        data = [h for h in ready if h[0] != _HELD_ABORT]
        firsts = {h[1] for h in data if h[0] & FIRST}
        if len(firsts) < len({h[1] for h in data}):
            kept = [h for h in ready if h[0] == _HELD_ABORT or h[1] in firsts]
            self._edge_dropped += len(ready) - len(kept)
            ready = kept
        run: list[_Held] = []
        for h in ready:
            if h[0] != _HELD_ABORT:
                run.append(h)
                continue
            if run:
                self._send_run(index, run)
                run = []
            link = self._links[index]
            if link is not None:
                fence, tag = h[2]
                assert h[3] is not None
                abort = _abort_message([h[1]], [h[3]], fence, tag)
                link.send(self._encoder.encode(abort)[0])
        if run:
            self._send_run(index, run)

    def _send_run(self, index: int, held: list[_Held]) -> None:
        """Send held data items down link *index* (:meth:`_send_held`) as one ``pipe``."""
        kinds = [h[0] for h in held]
        ids = [h[1] for h in held]
        items = [h[2] for h in held]
        routes = {h[1]: h[3] for h in held if h[3] is not None}
        out_r: list[Any] = []
        out_p: list[Any] = []
        self._send_link(index, kinds, ids, items, routes, out_r, [], out_p)
        if out_r and self._emit is not None:
            for rid in dict.fromkeys(out_r):
                why = out_p[out_r.index(rid)]
                self._emit(("error", rid, str(why)))

    def _unhold(self, req_ids: Sequence[str]) -> None:
        """Drop the data held for *req_ids* (:meth:`pipe_link`), counted as
        ``edge_dropped``: their abort was applied here, or they are otherwise over here.

        A held abort stays. The abort of a request whose data is held for a newer
        generation is held too, once applied here (:meth:`chase_abort`, right after this):
        the coordinator routed the request to the new process, and waits for that
        process's answer to the abort (and the later stages'), which only a chased abort
        brings. Its data need not go first: the new process answers an abort of a request
        it does not hold, and chases it on as any. A held abort is only ever of a request
        the coordinator still holds (it frees an id once every stage on its route answered
        the abort, or died), or of a dead process's, dropped at the next ``link``: so a
        first item of the same id (a replay after a fence, or an id added again) leaves
        it, and a ``release`` (a request done) never meets one."""
        drop = set(req_ids)
        holding = self._holding
        for index in list(holding):
            held = holding[index]
            kept = [h for h in held if h[1] not in drop or h[0] == _HELD_ABORT]
            if len(kept) < len(held):
                self._edge_dropped += len(held) - len(kept)
                self._set_held(index, kept)

    def take_credit(self, force: bool = False) -> tuple[Any, ...] | None:
        """The ``credit`` event for what the engine has taken since the last one, or
        ``None``: all of it, or, for an engine with ``pending_inputs()``, all but the inputs
        it still holds unprocessed (their share of the bytes, pro rata), so that a slow
        engine's backlog counts against the window; ``None`` too while that is below the
        batch (*credit_items* and *credit_bytes*), unless *force* (module docstring,
        "credits"). The stage runtime calls it after each step, and sends the event in the
        step's frame."""
        items, nbytes = self._taken_items, self._taken_bytes
        if not items:
            return None
        held = self._held()
        kept = nbytes * held // items if held else 0
        give, give_bytes = items - held, nbytes - kept
        if not give or (
            not force and give < self._credit_items and give_bytes < self._credit_bytes
        ):
            return None
        self._credit_due = None
        if held:
            self._taken_items, self._taken_bytes = held, kept
            if self._pooled:
                return ("credit", give, give_bytes, self._take_links(give))
            return ("credit", give, give_bytes)
        self._taken_items = self._taken_bytes = 0
        if self._pooled:
            links = [[s, i, b] for (s, _), (i, b) in self._taken_by.items()]
            self._taken_by.clear()
            return ("credit", items, nbytes, links)
        return ("credit", items, nbytes)

    def _take_links(self, items: int) -> list[list[int]]:
        """The credit of *items* items, per sending replica (first come, first given back;
        each one's bytes pro rata), taken out of what is owed to each."""
        links: list[list[int]] = []
        for key, by in list(self._taken_by.items()):
            if not items:
                break
            give = min(items, by[0])
            nbytes = by[1] if give == by[0] else by[1] * give // by[0]
            links.append([key[0], give, nbytes])
            items -= give
            by[0] -= give
            by[1] -= nbytes
            if not by[0]:
                del self._taken_by[key]
        return links

    def _give_credit(self, force: bool = False) -> None:
        """The loop would go idle: send the credit now (:meth:`take_credit`)."""
        credit = self.take_credit(force)
        if credit is not None and self._emit is not None:
            self._emit(credit)

    def stats(self) -> dict[str, float]:
        """The engine's own numbers, and the edge's: ``edge_in_flight`` and
        ``edge_in_flight_bytes`` (sent to the next stage, not yet taken; items are payloads
        and each request's end of input, one item, as the window counts), ``edge_sent`` and
        ``edge_sent_bytes`` (in all), ``edge_waits`` (how often the window held a step
        back); with shared memory, the pool's ``shm_*`` (:meth:`._shm.ShmPool.stats`); and
        in a stage whose previous stage sends through shared memory, ``shm_taken`` (arrays
        taken), ``shm_refused`` (refused: their lease had expired, or their slot was gone),
        ``shm_held`` (taken and still alive here) and ``shm_mapped`` (its slots mapped
        here). After a stage next to this one died: ``edge_dropped`` (payloads not sent to
        a dead next stage; from its ``gone`` on, also once relinked), ``edge_held`` and
        ``edge_held_bytes`` (before a stage that restarts, always: payloads held for the
        successor of a dead process of it, and their :func:`payload_size`, sent once it is
        linked in, not in ``edge_in_flight`` until then, but counted against the window
        with it: a stage holding a window's worth waits, in ``edge_waits``; dropped with
        their request's abort, and counted in ``edge_dropped`` then),
        ``pipe_dropped`` (late messages of a dead previous stage, dropped unread). With a
        replay log (its edge retries): ``replay_logged`` (requests logged now),
        ``replay_logged_bytes`` (their estimated size) and ``replays``."""
        out = dict(self._inner_stats()) if self._inner_stats is not None else {}
        if not self._last:
            out["edge_in_flight"] = sum(self._out_items)
            out["edge_in_flight_bytes"] = sum(self._out_bytes)
            out["edge_sent"] = self._sent_items
            out["edge_sent_bytes"] = self._sent_bytes
            out["edge_waits"] = self._waits
            if self._gone or self._edge_dropped:
                out["edge_dropped"] = self._edge_dropped
            if self._holds:
                out["edge_held"] = sum(self._held_items)
                out["edge_held_bytes"] = sum(self._held_bytes)
            pools = [pool.stats() for pool in self._shms if pool is not None]
            for numbers in pools:  # summed over the links
                for key, value in numbers.items():
                    out[key] = out.get(key, 0) + value
        reader = self._shm_reader
        if reader is not None:
            out["shm_taken"] = reader.taken
            out["shm_refused"] = reader.expired
            out["shm_held"] = reader.held
            out["shm_mapped"] = reader.mapped
        if self._previous_gone:
            out["pipe_dropped"] = self._late_dropped
        if self._replay_bytes is not None:
            out["replay_logged"] = len(self._log)
            out["replay_logged_bytes"] = sum(self._log_size.values())
            out["replays"] = self._replays
        return out

    def add(self, req_id: str, data: Any) -> None:
        """A request from the coordinator: the first stage's whole input (an engine with
        ``close_input`` is told so at once)."""
        if self._holding:  # an id freed and added again: the old request's are over
            self._unhold((req_id,))
        self._inner.add(req_id, data)
        self._live.add(req_id)
        if self._close_input is not None and self._feed is not None:
            self._close_input(req_id)

    def pipe_input(self, kind: int, req_id: str, item: Any) -> None:
        """Input from the previous stage. The stage runtime calls it for a request live in
        the stage, except for a *kind* with :data:`FIRST`, which makes it live; a
        :class:`~enginecore.RequestRejected` from the engine ends only this request."""
        inner = self._inner
        if kind & FIRST and self._holding:  # an id freed and used again: the old request's
            self._unhold((req_id,))  # held items are over (its items come after its first)
        if self._feed is not None:
            if kind & FIRST:
                inner.add(req_id, item)
                self._live.add(req_id)
                if not kind & END:
                    self._open[req_id] = self._sender
            elif kind == MORE:
                self._feed(req_id, item)
            if kind & END:
                if kind & REPORT:
                    self._report.add(req_id)
                self._open.pop(req_id, None)
                if self._close_input is not None:
                    self._close_input(req_id)
            return
        if kind == FIRST:
            self._gathered[req_id] = [item]
        elif kind == MORE:
            self._gathered[req_id].append(item)
        else:
            items = [item] if kind & FIRST else self._gathered.pop(req_id)
            inner.add(req_id, items)
            self._live.add(req_id)
            if kind & REPORT:
                self._report.add(req_id)

    def pipe_late(self, req_id: str, kind: int) -> None:
        """The END (or ONLY) of *req_id*, not live here: the stage runtime calls this for
        such an item of the previous stage. If the request ended here before its input did,
        its input has now ended too: every stage before this one has ended it, which this
        stage reports (``BEFORE``), unless the item says those stages report their own
        ends (``REPORT``). Otherwise (it ended here with an error, or was aborted) it is
        dropped, as any input of a request no longer here."""
        early = self._early
        if early and req_id in early:
            del early[req_id]
            if not kind & REPORT and self._emit is not None:
                self._emit(("outputs", [req_id], [True], [BEFORE]))

    def abort(self, req_ids: Sequence[str]) -> None:
        """Drop *req_ids* here: every abort the stage applies (an ``abort`` message, or one
        of its own: an error that ended the request, a detach, a drain's deadline)."""
        self._inner.abort(req_ids)
        gathered, live, sent = self._gathered, self._live, self._sent
        opened, report, early, spoke = self._open, self._report, self._early, self._spoke
        for rid in req_ids:
            live.discard(rid)
            sent.pop(rid, None)
            gathered.pop(rid, None)
            opened.pop(rid, None)
            report.discard(rid)
            early.pop(rid, None)
            spoke.discard(rid)
        if self._holding:
            self._unhold(req_ids)
        if self._pooled:
            nxt, rest = self._next, self._rest
            for rid in req_ids:
                nxt.pop(rid, None)
                rest.pop(rid, None)
            if self._gen:
                for rid in req_ids:
                    self._unroute_gen(rid)
        if self._replay_bytes is not None:
            self._forget(req_ids)

    # -- retry: the replay log -------------------------------------------------------------------

    def _forget(self, req_ids: Sequence[str]) -> None:
        log, size, ended, unlogged = self._log, self._log_size, self._log_ended, self._unlogged
        for rid in req_ids:
            if log.pop(rid, None) is not None:
                del size[rid]
            ended.pop(rid, None)
            unlogged.discard(rid)
            self._log_route.pop(rid, None)

    def _log_item(self, rid: str, first: bool, item: Any) -> None:
        """Log *item*, sent on for *rid* (*first*: its first payload, a new log)."""
        log, size = self._log, self._log_size
        if first:
            self._log_ended.pop(rid, None)
            self._unlogged.discard(rid)
            log[rid] = [item]
            size[rid] = payload_size(item)
            if self._pooled:
                self._log_route[rid] = (
                    self._next.get(rid, 0),
                    self._rest.get(rid, []),
                    self._gen.get(rid),
                )
        else:
            items = log.get(rid)
            if items is None:  # not retryable any more
                return
            items.append(item)
            size[rid] += payload_size(item)
        assert self._replay_bytes is not None
        if size[rid] > self._replay_bytes:
            del log[rid], size[rid]
            self._unlogged.add(rid)

    def pipe_release(self, req_ids: list[str]) -> None:
        """The coordinator's ``release``: *req_ids* are done in the pipeline; their logs go
        (not that of a request live here: a new one under a freed id), and so does what is
        held of them for a gone process's successor (:meth:`pipe_link`)."""
        if self._replay_bytes is not None or self._holding:
            live = self._live
            done = [rid for rid in req_ids if rid not in live]
            if self._replay_bytes is not None:
                self._forget(done)
            if self._holding:
                self._unhold(done)

    def pipe_replay(self, req_id: str) -> tuple[bool, str]:
        """The coordinator's ``replay``: the next stage failed *req_id*. Send an ``abort`` of
        it down the link (always, so that the coordinator can count the next stages'
        ``aborted`` answers), then its logged items again, first to last (with the end if
        the request ended here); what this stage sends of it later follows them. Returns
        whether it replayed, and if not why."""
        index, rest, gen = self._log_route.get(req_id) or (
            self._next.get(req_id, 0),
            self._rest.get(req_id, []),
            self._gen.get(req_id),
        )
        link = self._links[index] if 0 <= index < len(self._links) else None
        known = self._link_gens[index] if link is not None else None
        if link is None or (gen is not None and known is not None and gen != known):
            # (Another generation: the process the request went to died.)
            return False, "the next stage is gone"
        # The fence, flagged as such (docs/wire.md section 8: a trailing true, after the
        # routes, nil without pools).
        routes = [rest] if self._pooled else None
        link.send(self._encoder.encode(("abort", [req_id], routes, True))[0])
        items = self._log.get(req_id)
        if items is None:
            if req_id in self._unlogged:
                why = (
                    f"its inputs to the next stage exceeded the replay log's bound "
                    f"({self._replay_bytes} bytes)"
                )
            elif self._replay_bytes is None:
                why = "the previous stage keeps no replay log"
            else:
                why = "the previous stage no longer holds its inputs"
            return False, why
        count = len(items)
        kinds = [FIRST] + [MORE] * (count - 1)
        on_p = list(items)
        ended = self._log_ended.get(req_id)
        if ended is not None:
            if count == 1:
                kinds[0] = ONLY | ended
            else:
                kinds.append(END | ended)
                on_p.append(None)
        out_r: list[Any] = []
        routed = self._pooled and req_id not in self._next
        if routed:  # it ended here: its route again, for the replay (the log's)
            self._next[req_id], self._rest[req_id] = index, rest
            if gen is not None:
                self._gen[req_id] = gen
        try:
            self._send_on(kinds, [req_id] * len(kinds), on_p, out_r, [], [])
        finally:
            if routed:
                del self._next[req_id], self._rest[req_id]
                self._unroute_gen(req_id)
        if out_r:  # an item the encoder refused (the request failed here when it was sent)
            return False, "its inputs could not be encoded again"
        self._replays += 1
        return True, ""

    def chase_abort(
        self, req_ids: Sequence[str], fence: bool = False, tag: int | None = None
    ) -> None:
        """An ``abort`` message was applied here (the stage runtime calls this after
        :meth:`abort` and its ``aborted`` event): send it on to the next stage, after every
        pipe message this stage sent for those requests, so the next stage applies it after
        their data, and sends it on in turn. Only an abort message chases: an abort of the
        stage's own (an error that ended the request) is followed by the coordinator's,
        from the first stage, and every stage must answer that one exactly once. *fence*:
        the abort was a replay's fence, and goes on flagged as one; *tag*: the abort was
        tagged by the coordinator (an abort after a death), and goes on with its tag."""
        links = self._links
        if not links or (self._next_gone and not self._holds):
            self._abort_routes.clear()
            return
        if not self._pooled:
            link = links[0]
            if link is not None:
                ids = list(req_ids)
                msg: tuple[Any, ...] = ("abort", ids, None, True) if fence else ("abort", ids)
                if tag is not None:
                    msg = ("abort", ids, None, fence, tag)
                link.send(self._encoder.encode(msg)[0])
            return
        # Along each request's route (the abort's routes, from the coordinator or the
        # previous stage; none: replica 0 of each stage, where it never went). -1: the
        # request's process there died (a new one never held it): no further. [replica,
        # generation]: a stage that restarts, its process of that generation (below).
        routes = self._abort_routes
        by_link: dict[tuple[int, int | None], tuple[list[str], list[list[Any]]]] = {}
        for rid in req_ids:
            route = routes.pop(rid, None) or [0]
            first = route[0]
            key = (first[0], first[1]) if first.__class__ is list else (first, None)
            ids, rests = by_link.setdefault(key, ([], []))
            ids.append(rid)
            rests.append(route[1:])
        routes.clear()
        for (index, gen), (ids, rests) in by_link.items():
            if not 0 <= index < len(links):
                continue
            link = links[index]
            known = self._link_gens[index] if gen is not None else None
            if known is not None and (gen != known or link is None):
                assert gen is not None
                if gen >= known:
                    # Routed to a process started again whose link has not come yet (its
                    # data is held, or was dropped by the abort: _unhold): its answer is
                    # awaited, so the abort goes down that link when it comes (one held
                    # for a dead process's generation is dropped then: _by_generation).
                    held = self._holding.setdefault(index, [])
                    for rid, rest in zip(ids, rests, strict=True):
                        held.append((_HELD_ABORT, rid, (fence, tag), rest, gen, 0))
                # Older: its process died (a new one never held it): no further, as -1.
                continue
            if link is not None:
                link.send(self._encoder.encode(_abort_message(ids, rests, fence, tag))[0])

    def step(self) -> list[Any]:
        return self._routed(self._inner.step())  # type: ignore[union-attr]

    def _routed(self, outputs: Any) -> list[Any]:
        """Route a step's *outputs* with the engine's own routing, then the edge; keep the
        columns for :meth:`route_outputs` and return one item per column entry (the number
        of outputs the stage runtime sees is not the engine's: the edge adds and removes)."""
        rids: list[Any] = []
        fins: list[Any] = []
        payloads: list[Any] = []
        self._route(outputs, rids, fins, payloads)
        if rids:
            rids, fins, payloads = self._split(rids, fins, payloads)
        self._columns = (rids, fins, payloads)
        return rids

    def take_ended(self) -> list[str]:
        """The requests the last step ended here without an end report (they went on to
        the next stage, whose end report covers this one): the stage runtime calls it right
        after :meth:`route_outputs`, to take them out of its live requests."""
        quiet = self._quiet
        if not quiet:
            return quiet
        self._quiet = []
        return quiet

    def route_outputs(self, outputs: list[Any]) -> tuple[list[Any], list[bool], list[Any]]:
        """The stage runtime's routing hook, called right after :meth:`step` (or
        ``collect``) with what it returned: the columns it made."""
        columns = self._columns
        self._columns = _NO_COLUMNS
        return columns

    # -- the edge -------------------------------------------------------------------------------

    def _split(
        self, rids: list[Any], fins: list[bool], payloads: list[Any]
    ) -> tuple[list[Any], list[bool], list[Any]]:
        out_r: list[Any] = []
        out_f: list[bool] = []
        out_p: list[Any] = []
        if (
            self._fast
            and not any(fins)
            and only_types(payloads, _codec.FLAT_TYPES)
            and self._live.issuperset(rids)
        ):
            # The fast path (a stage without an edge function or a replay log, not the
            # last): every output is a payload of a live request for the next stage and
            # none ends a request, so the step's columns are the pipe message's (checks in
            # C; a flat payload is neither NOTHING nor a RequestRejected).
            sent = self._sent
            get = sent.get
            kinds: list[int] = []
            append = kinds.append
            for rid in rids:
                n = get(rid, 0)
                append(MORE if n else FIRST)
                sent[rid] = n + 1
            self._send_on(kinds, rids, payloads, out_r, out_f, out_p)
            return out_r, out_f, out_p
        kinds = []
        on_r: list[str] = []
        on_p: list[Any] = []
        live, sent, edge, last = self._live, self._sent, self._edge, self._last
        unroute = self._unroute if self._pooled else None
        opened, report, spoke = self._open, self._report, self._spoke
        flat = _codec.FLAT_TYPES
        failed: set[str] | None = None
        logging = self._replay_bytes is not None
        for rid, fin, payload in zip(rids, fins, payloads, strict=True):
            if rid not in live or isinstance(payload, RequestRejected):
                # Unrouted, not this stage's (or stale), or ended with an error by the
                # engine: the stage handles it as it would without a pipeline.
                if failed is not None and rid in failed:
                    continue
                if fin and rid in live:
                    live.discard(rid)
                    if unroute is not None:
                        unroute.append(rid)
                    sent.pop(rid, None)
                    opened.pop(rid, None)
                    report.discard(rid)
                    spoke.discard(rid)
                out_r.append(rid)
                out_f.append(fin)
                out_p.append(payload)
                continue
            if failed is not None and rid in failed:
                continue
            if payload is NOTHING:  # the engine ends the request with no payload
                to_next = to_caller = NOTHING
            elif last:
                to_next, to_caller = NOTHING, payload
            elif edge is None:
                to_next, to_caller = payload, NOTHING
            else:
                try:
                    pair = edge(payload)
                    if type(pair) is not tuple or len(pair) != 2:
                        raise TypeError(
                            f"an edge function must return (to_next, to_caller), got {pair!r:.100}"
                        )
                    to_next, to_caller = pair
                    if to_next is not NOTHING and type(to_next) not in flat:
                        to_next = _codec.prepare(to_next, "the input for the next stage")
                except Exception as exc:
                    failed = self._fail(rid, exc, out_r, out_f, out_p, failed)
                    continue
            if to_next is not NOTHING:
                n = sent.get(rid, 0)
                kinds.append(MORE if n else FIRST)
                on_r.append(rid)
                on_p.append(to_next)
                sent[rid] = n + 1
                if logging:
                    self._log_item(rid, not n, to_next)
            if to_caller is not NOTHING:
                out_r.append(rid)
                out_f.append(False)
                out_p.append(to_caller)
                if not last:
                    spoke.add(rid)
            if fin:
                live.discard(rid)
                if unroute is not None:
                    unroute.append(rid)
                n = sent.pop(rid, 0)
                # Its own end is reported (module docstring) if it ended before its input
                # did (the previous stage's end is still to come: no BEFORE), if an END
                # with REPORT said so (the stages before it report theirs: no BEFORE), or if
                # it sent the caller payloads (which its report follows).
                own = 0
                before = BEFORE
                if opened and rid in opened:
                    self._early[rid] = opened.pop(rid)
                    own = REPORT
                    before = 0
                if report and rid in report:
                    report.discard(rid)
                    own = REPORT
                    before = 0
                if spoke and rid in spoke:
                    spoke.discard(rid)
                    own = REPORT
                if n:
                    if logging:
                        self._log_ended[rid] = own
                    if n == 1 and on_r and on_r[-1] == rid and kinds[-1] == FIRST:
                        kinds[-1] = ONLY | own
                    else:
                        kinds.append(END | own)
                        on_r.append(rid)
                        on_p.append(None)
                    if own:
                        out_r.append(rid)
                        out_f.append(True)
                        out_p.append(ENDED | SENT_ON | before)
                    else:
                        self._quiet.append(rid)
                else:
                    out_r.append(rid)
                    out_f.append(True)
                    out_p.append(ENDED | before)
        if kinds:
            self._send_on(kinds, on_r, on_p, out_r, out_f, out_p)
        if unroute:  # ended here: their routes are no longer needed (sent on with them)
            nxt, rest = self._next, self._rest
            for rid in unroute:
                nxt.pop(rid, None)
                rest.pop(rid, None)
            if self._gen:
                for rid in unroute:
                    self._unroute_gen(rid)
            unroute.clear()
        return out_r, out_f, out_p

    def _fail(
        self,
        rid: str,
        exc: Exception,
        out_r: list[Any],
        out_f: list[bool],
        out_p: list[Any],
        failed: set[str] | None,
    ) -> set[str]:
        """End *rid* with an error: its edge raised (or made what cannot cross the wire).
        The stage ends it in the engine (``DropEnded``) and the abort chases what it sent."""
        if failed is None:
            failed = set()
        failed.add(rid)
        why = exc if isinstance(exc, RequestRejected) else describe(exc)
        out_r.append(rid)
        out_f.append(False)
        out_p.append(RequestRejected(f"the edge to the next stage failed: {why}"))
        return failed

    def _send_on(
        self,
        kinds: list[int],
        on_r: list[str],
        on_p: list[Any],
        out_r: list[Any],
        out_f: list[bool],
        out_p: list[Any],
    ) -> None:
        if self._next_gone and not self._holds:  # nobody to send to, for good: the
            # coordinator ends these requests
            self._edge_dropped += len(kinds)
            return
        if not self._pooled:
            self._send_link(0, kinds, on_r, on_p, None, out_r, out_f, out_p)
            return
        # Routed (module docstring): each item on its request's link, in order; a first
        # input carries the rest of its request's route.
        nxt, rest = self._next, self._rest
        groups: dict[int, tuple[list[int], list[str], list[Any], dict[str, list[Any]]]] = {}
        for kind, rid, item in zip(kinds, on_r, on_p, strict=True):
            index = nxt.get(rid, 0)
            group = groups.get(index)
            if group is None:
                group = groups[index] = ([], [], [], {})
            group[0].append(kind)
            group[1].append(rid)
            group[2].append(item)
            if kind & FIRST:
                group[3][rid] = rest.get(rid, [])
        odd = self._odd
        for index, group in groups.items():
            g_kinds, g_ids, g_items, g_routes = group
            gone = index in self._gone
            if (gone or (odd and not odd.isdisjoint(g_ids))) and self._gen:
                # Routes that name generations: what is not for the link's process now.
                g_kinds, g_ids, g_items = self._by_generation(
                    index, gone, g_kinds, g_ids, g_items, g_routes
                )
                if not g_kinds:
                    continue
            if gone and self._holds:
                # Its process died and a new one is coming: a request routed to the new one
                # may come before its link (pipe_link), which sends these first.
                for kind, rid, item in zip(g_kinds, g_ids, g_items, strict=True):
                    tail = g_routes.get(rid) if kind & FIRST else None
                    self._hold(index, kind, rid, item, tail, None)
                continue
            if gone or not 0 <= index < len(self._links):
                self._edge_dropped += len(g_kinds)
                continue
            self._send_link(index, g_kinds, g_ids, g_items, g_routes, out_r, out_f, out_p)

    def _by_generation(
        self,
        index: int,
        gone: bool,
        kinds: list[int],
        ids: list[str],
        items: list[Any],
        routes: dict[str, list[Any]],
    ) -> tuple[list[int], list[str], list[Any]]:
        """Sort items for link *index* by the generation of the next stage's process that
        each one's route names (``docs/wire.md`` section 8, "Restarts"), against the
        generation of the process the link goes to: that one's, the link up, and the items
        whose route names none are returned, to go as any; a newer one's, or that one's
        once the link is *gone*, are held for the next ``link`` (:meth:`pipe_link`), in
        order, even before the dead process's ``gone`` (a request routed to the new
        process may reach this stage first: the link still goes to the dead one, and what
        went down it would be lost); an older one's are dropped (its process died). The
        next ``link`` drops what is held for an older generation than its own: held for
        the link's own generation once it is gone, an item is dropped then, unless that
        ``link`` is of the same generation (a process that started with a link to a dead
        process, whose successor's generation it was told at its launch)."""
        known = self._link_gens[index] if 0 <= index < len(self._link_gens) else None
        if known is None:
            return kinds, ids, items
        gens = self._gen
        out_k: list[int] = []
        out_r: list[str] = []
        out_p: list[Any] = []
        for kind, rid, item in zip(kinds, ids, items, strict=True):
            gen = gens.get(rid)
            if gen is None:
                pass
            elif gen < known:
                self._edge_dropped += 1
                continue
            elif gen > known or gone:
                self._hold(index, kind, rid, item, routes.get(rid) if kind & FIRST else None, gen)
                continue
            out_k.append(kind)
            out_r.append(rid)
            out_p.append(item)
        return out_k, out_r, out_p

    def _send_link(
        self,
        index: int,
        kinds: list[int],
        on_r: list[str],
        on_p: list[Any],
        routes: dict[str, list[Any]] | None,
        out_r: list[Any],
        out_f: list[bool],
        out_p: list[Any],
    ) -> None:
        """One ``pipe`` message on link *index* (with *routes* and this replica's index,
        routed), or, if msgspec refuses an item, one per item."""
        link = self._links[index]
        assert link is not None
        shm = self._shms[index]
        encoder = self._encoders[index]
        replica = self._replica

        def message(k: list[int], r: list[str], p: list[Any]) -> tuple[Any, ...]:
            if routes is None:
                return ("pipe", k, r, p)
            return ("pipe", k, r, p, {rid: routes[rid] for rid in r if rid in routes}, replica)

        try:
            parts = encoder.encode(message(kinds, on_r, on_p))
        except _codec.ENCODE_ERRORS:
            if shm is not None:
                shm.abandon()
            # One item msgspec refuses (an int out of range): send the others one by one,
            # and end the request of each refused one with an error.
            for kind, rid, item in zip(kinds, on_r, on_p, strict=True):
                try:
                    parts = encoder.encode(message([kind], [rid], [item]))
                except _codec.ENCODE_ERRORS as exc:
                    if shm is not None:
                        shm.abandon()
                    out_r.append(rid)
                    out_f.append(False)
                    out_p.append(
                        RequestRejected(f"the input for the next stage cannot be encoded: {exc}")
                    )
                    continue
                self._count_sent(index, 1, parts)
                _codec.send_parts(link, parts, 0)
            return
        self._count_sent(index, len(kinds), parts)
        _codec.send_parts(link, parts, 0)

    def _count_sent(self, index: int, items: int, parts: list[Any]) -> None:
        nbytes = sum([len(p) if p.__class__ is bytes else p.nbytes for p in parts])
        pool = self._shms[index]
        if pool is not None:  # and the bytes of its arrays in shared memory
            nbytes += pool.commit()
        self._out_items[index] += items
        self._out_bytes[index] += nbytes
        self._sent_items += items
        self._sent_bytes += nbytes


class PipelinedPipeStage(PipeStage):
    """:class:`PipeStage` around a :class:`~enginecore.PipelinedEngine`: ``launch`` and
    ``collect`` are the engine's (``collect``'s outputs go through :meth:`route_outputs`,
    as a step's do)."""

    def __init__(
        self,
        inner: PipelinedEngine[Any],
        *,
        stage: str,
        edge: Edge | None = None,
        downstream: str | Sequence[str] | None = None,
        window: int | None = None,
        window_bytes: int | None = None,
        shm: _shm.ShmPool | Sequence[_shm.ShmPool] | None = None,
        shm_reader: _shm.ShmReader | None = None,
        link_id: str | None = None,
        replay_bytes: int | None = None,
        replica: int = 0,
        routed: bool = False,
        credit_items: int = 1,
        credit_bytes: int = 1,
        shm_factory: Callable[[str], _shm.ShmPool] | None = None,
        link_curve: tuple[bytes, bytes] | None = None,
        downstream_keys: Sequence[bytes | None] | None = None,
        next_restarts: bool = False,
        next_generations: Sequence[int] | None = None,
    ) -> None:
        super().__init__(
            inner,
            stage=stage,
            edge=edge,
            downstream=downstream,
            window=window,
            window_bytes=window_bytes,
            shm=shm,
            shm_reader=shm_reader,
            link_id=link_id,
            replay_bytes=replay_bytes,
            replica=replica,
            routed=routed,
            credit_items=credit_items,
            credit_bytes=credit_bytes,
            shm_factory=shm_factory,
            link_curve=link_curve,
            downstream_keys=downstream_keys,
            next_restarts=next_restarts,
            next_generations=next_generations,
        )
        self.launch = inner.launch
        collect = inner.collect
        routed_outputs = self._routed

        def collect_routed(handle: Any) -> list[Any]:
            return routed_outputs(collect(handle))

        self.collect = collect_routed
        self.pipeline_depth = getattr(inner, "pipeline_depth", 2)
        cancel = getattr(inner, "cancel", None)
        if callable(cancel):
            self.cancel = cancel


def import_edge(spec: str) -> Callable[[Any], Any]:
    """The edge function ``"pkg.module:fn"`` names (``fn`` may be dotted). Its errors say
    that it is the edge that does not resolve, not the engine's factory:
    :class:`ValueError` for a malformed string, :class:`ImportError` /
    :class:`AttributeError` if it does not resolve, :class:`TypeError` if not callable."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"edge must look like 'pkg.module:fn', got {spec!r}")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except ImportError as exc:
        raise ImportError(f"edge {spec!r} does not resolve: {exc}") from exc
    except AttributeError as exc:
        raise AttributeError(f"edge {spec!r} does not resolve: {exc}") from exc
    if not callable(obj):
        raise TypeError(f"edge {spec!r} is a {type(obj).__name__}, not callable")
    return obj  # type: ignore[no-any-return]


def pipe_stage(
    factory: str,
    stage: str,
    kwargs: dict[str, Any] | None = None,
    edge: str | None = None,
    downstream: str | list[str] | None = None,
    window: int | None = None,
    window_bytes: int | None = None,
    shm_prefix: str | None = None,
    shm_threshold: int = _shm.DEFAULT_THRESHOLD,
    shm_pool_bytes: int = _shm.DEFAULT_POOL_BYTES,
    shm_lease: float = _shm.DEFAULT_LEASE,
    shm_upstream: str | None = None,
    link_id: str | None = None,
    replay_bytes: int | None = None,
    replica: int = 0,
    routed: bool = False,
    shm_links: bool | list[str] = False,
    shm_upstream_pooled: bool = False,
    credit_items: int = 1,
    credit_bytes: int = 1,
    link_keys: list[bytes] | None = None,
    downstream_keys: list[bytes | None] | None = None,
    next_restarts: bool = False,
    next_generations: list[int] | None = None,
) -> PipeStage:
    """The factory a pipeline launches each stage with: builds *factory*'s engine
    (``factory(**kwargs)``) and wraps it (:class:`PipeStage`). *edge* is the edge
    function's import string (``"pkg.module:fn"``), resolved here, in the stage process.
    *shm_prefix*: this stage's segments' prefix, to send arrays of *shm_threshold* bytes or
    more to the next stage through shared memory (``None``: never); *shm_upstream*: the
    previous stage's, whose arrays this stage takes (``None``: it sends none). *link_id*:
    the routing id of this stage's link to the next one (:func:`._edge.link_id`), which the
    coordinator names when it tells the next stage that this one is gone. *replay_bytes*:
    keep a replay log of each request's inputs to the next stage, up to that many bytes a
    request, for the coordinator's ``replay`` (``None``: none; the edge's policy is
    ``fail``). *downstream* may list the next stage's replicas' addresses (a replica
    pool); *replica*: this stage's replica index; *routed*: the pipeline has replica pools
    (requests' routes travel with them: :class:`PipeStage`). *shm_links*: an edge into or
    out of a replica pool: one pool of slots per link, each ``shm_pool_bytes`` shared evenly
    among the links and named :func:`._shm.link_prefix` (a list: those prefixes, one per
    link, as the pipeline names them when a stage restarts); *shm_upstream_pooled*: the
    edge into this stage is such an edge (*shm_upstream* is then this replica's prefix on
    it). *credit_items*, *credit_bytes*: the batch of credit this stage gives back to the
    previous one after a step (a quarter of that stage's window; :class:`PipeStage`).
    *downstream_keys*: per link, the next stage's CURVE public key (a stage that listens on
    TCP: placed on Ray, or local after one), or ``None`` (ipc, no CURVE); *link_keys*:
    ``[public, secret]``, this stage's key pair for those links (made by the coordinator
    for a local stage, in the actor for one on Ray, ``docs/pipelines.md``, "Stages on other
    hosts"). *next_restarts*: the next stage's dead processes are started again: what this
    stage sends to one that is gone is held for its successor (:meth:`PipeStage.pipe_link`);
    *next_generations*: then, per link, the generation of the process it goes to (the routes
    name the generation of each request's process: ``docs/wire.md`` section 8)."""
    reader = (
        None if shm_upstream is None else _shm.configure_reader(shm_upstream, shm_upstream_pooled)
    )
    inner = build_engine(factory, dict(kwargs or {}))
    edge_fn = None if edge is None else import_edge(edge)
    pool: _shm.ShmPool | list[_shm.ShmPool] | None = None
    if shm_prefix is not None and downstream is not None and not shm_links:
        pool = _shm.ShmPool(
            shm_prefix, threshold=shm_threshold, max_bytes=shm_pool_bytes, lease=shm_lease
        )
    elif shm_prefix is not None and downstream is not None:
        nlinks = 1 if isinstance(downstream, str) else len(downstream)
        share = max(1, shm_pool_bytes // nlinks)

        def shm_factory(slots: str) -> _shm.ShmPool:
            return _shm.ShmPool(slots, threshold=shm_threshold, max_bytes=share, lease=shm_lease)

        if isinstance(shm_links, list):
            prefixes = shm_links
        else:
            prefixes = [f"{shm_prefix}{i}-{replica}-" for i in range(nlinks)]  # link_prefix
        pool = [shm_factory(slots) for slots in prefixes]
    options: dict[str, Any] = {
        "stage": stage,
        "edge": edge_fn,
        "downstream": downstream,
        "window": window,
        "window_bytes": window_bytes,
        "shm": pool,
        "shm_reader": reader,
        "link_id": link_id,
        "replay_bytes": replay_bytes,
        "replica": replica,
        "routed": routed,
        "credit_items": credit_items,
        "credit_bytes": credit_bytes,
        "link_curve": None if link_keys is None else (link_keys[0], link_keys[1]),
        "downstream_keys": downstream_keys,
        "next_restarts": next_restarts,
        "next_generations": next_generations,
    }
    if isinstance(pool, list):
        options["shm_factory"] = shm_factory
    if isinstance(inner, PipelinedEngine):
        return PipelinedPipeStage(inner, **options)
    return PipeStage(inner, **options)
