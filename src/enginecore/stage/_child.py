"""The stage process: the engine loop on the main thread, plus two ZMQ IO threads.

::

    client --(ROUTER, input thread)--> input_queue --> EngineCoreLoop (main thread)
    client <--(PUSH, output thread)--- SimpleQueue <-- step() / emit()
    client <--(PUSH, main thread, only while the output thread is idle: _deliver)

The input thread blocks in ``poll`` (no timeout) on its socket and on the output socket's
monitor (it counts output connections, see ``_hello``), decodes and validates each frame
and puts typed messages on ``loop.input_queue`` in arrival order. A frame it cannot use becomes an
``error`` event (request- or call-scoped when an id can be recovered) and never reaches the
engine. The stage's ``step()`` routes and checks a whole step's outputs on the loop thread and
hands them over as one list. The output thread blocks on its queue, drains everything waiting
and sends it in frames of up to 512 events. While it is idle (nothing queued, nothing unsent),
the loop thread sends single events (utility answers, ``aborted``) itself, under
``_out_lock``, without blocking; see ``_deliver``. Step outputs always go through the output
thread, which encodes them while the next step runs. Shutdown: when the loop returns, the
output thread sends the last frame (it holds the terminal event), then ``ctx.term()`` wakes
the input thread with ``ETERM``.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import queue
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, NoReturn

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from .._engine import Engine
from .._loop import EngineCoreLoop
from .._messages import Abort, Add, Event, Utility
from .._signals import shutdown_on_signals
from . import _codec, _wire

__all__ = ["import_factory", "run_launched", "serve"]

logger = logging.getLogger("enginecore.stage")

# Exit codes of a stage process.
EXIT_OK: Final = 0  # clean shutdown
EXIT_FATAL: Final = 1  # the engine loop died of an exception (or startup failed)
EXIT_IO_FAILED: Final = 2  # an IO thread failed; the stage could no longer talk
EXIT_ORPHANED: Final = 3  # the parent died and a graceful shutdown did not finish in time

# How long the output socket may take to deliver the last frames when the process ends.
_OUTPUT_LINGER_MS: Final = 1000
# Upper bound on one output frame, in events: keeps frames (and latency) bounded under load.
_MAX_BATCH: Final = 512

# The loop thread waits before a step while more than this many outputs (or other events)
# are queued for the output thread (see StageRuntime._throttle).
_BACKLOG_MAX: Final = 65536

_STOP: Final = ("stop",)  # output-thread sentinel (never sent)
# Exact types of received data that need no check (decoded ints are always in range).
_RECEIVED_FLAT: Final = frozenset({type(None), bool, int, float, str, bytes})
# What msgspec raises for a value it cannot encode (a lone surrogate: UnicodeEncodeError).
_ENCODE_ERRORS: Final = (TypeError, ValueError, OverflowError, msgspec.EncodeError)


def import_factory(spec: str) -> Callable[..., Any]:
    """Resolve ``"pkg.module:attr"`` (``attr`` may be dotted) to a callable.

    Raises :class:`ValueError` for a malformed string, :class:`ImportError` /
    :class:`AttributeError` if it does not resolve, :class:`TypeError` if not callable.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"engine factory must look like 'pkg.module:factory', got {spec!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"engine factory {spec!r} is a {type(obj).__name__}, not callable")
    return obj  # type: ignore[no-any-return]


def build_engine(spec: str, kwargs: dict[str, Any]) -> Engine:
    """Call the factory; check that it returned an :class:`~enginecore.Engine`."""
    engine = import_factory(spec)(**kwargs)
    if not isinstance(engine, Engine):
        raise TypeError(
            f"engine factory {spec!r} returned a {type(engine).__name__}, which does not "
            f"implement the enginecore.Engine protocol"
        )
    return engine


# -- output routing -------------------------------------------------------------------------

Route = Callable[[Iterable[Any], list[Any], list[Any], list[Any]], None]
"""``route(step_outputs, req_ids, finished, payloads)``: appends one step's routed outputs to
the three lists of its ``outputs`` event."""

_ROUTE_SHAPE: Final = "(req_ids: list[str | None], finished: list[bool], payloads: list)"
_RID_TYPES: Final = frozenset({str, type(None)})
_BOOL_TYPES: Final = frozenset({bool})


def make_router(engine: object) -> Route:
    """Build the router of *engine*'s step outputs (see docs/stage.md, "Routing").

    In order of preference: the engine's ``route_outputs(outputs)``, which returns
    ``(req_ids, finished, payloads)`` for a whole step; its ``route_output(out)``, which
    returns ``(req_id, finished, payload)`` for one output; else an output that is a
    2-tuple/list ``(req_id: str, payload)`` is routed to ``req_id``, finished when the
    engine's optional ``is_finished(out)`` says so, and any other output is unrouted
    (``req_id=None``). What a hook returns is checked: a wrong shape raises
    :class:`TypeError`, fatal to the loop (a bug in the engine), after the outputs routed
    before it. Runs on the loop thread.
    """
    name = type(engine).__name__
    batch_hook = getattr(engine, "route_outputs", None)
    if callable(batch_hook):

        def route_batch(
            outs: Iterable[Any], rids: list[Any], fins: list[Any], payloads: list[Any]
        ) -> None:
            outs = outs if outs.__class__ is list else list(outs)
            if not outs:
                return
            cols = batch_hook(outs)
            if cols.__class__ is not tuple or len(cols) != 3:
                _bad_batch(name, len(outs), cols)
            r, f, p = cols
            n = len(outs)
            if (
                r.__class__ is not list
                or f.__class__ is not list
                or p.__class__ is not list
                or len(r) != n
                or len(f) != n
                or len(p) != n
                or not set(map(type, r)) <= _RID_TYPES
                or not set(map(type, f)) <= _BOOL_TYPES
            ):
                _bad_batch(name, n, cols)
            rids += r
            fins += f
            payloads += p

        return route_batch

    hook = getattr(engine, "route_output", None)
    if callable(hook):

        def route_each(
            outs: Iterable[Any], rids: list[Any], fins: list[Any], payloads: list[Any]
        ) -> None:
            for out in outs:
                triple = hook(out)
                if triple.__class__ is not tuple or len(triple) != 3:
                    _bad_route(name, triple)
                rid, finished, payload = triple
                if finished.__class__ is not bool or (rid.__class__ is not str and rid is not None):
                    _bad_route(name, triple)
                rids.append(rid)
                fins.append(finished)
                payloads.append(payload)

        return route_each

    is_finished = getattr(engine, "is_finished", None)
    if not callable(is_finished):
        is_finished = None

    def route_default(
        outs: Iterable[Any], rids: list[Any], fins: list[Any], payloads: list[Any]
    ) -> None:
        for out in outs:
            t = out.__class__
            if (t is tuple or t is list) and len(out) == 2 and out[0].__class__ is str:
                finished = False if is_finished is None else bool(is_finished(out))
                rids.append(out[0])
                fins.append(finished)
                payloads.append(out[1])
            else:
                rids.append(None)
                fins.append(False)
                payloads.append(out)

    return route_default


def _bad_route(name: str, triple: object) -> NoReturn:
    raise TypeError(
        f"{name}.route_output() must return "
        f"(req_id: str | None, finished: bool, payload), got {triple!r:.200}"
    )


def _bad_batch(name: str, n: int, cols: object) -> NoReturn:
    raise TypeError(
        f"{name}.route_outputs() must return {_ROUTE_SHAPE}, three lists of one item per "
        f"output ({n}), got {cols!r:.200}"
    )


class _ShutdownCallId(int):
    """The call id of the in-band shutdown utility; its ``utility`` event is not sent."""


# A wire message can never carry this object, so only the stage itself can make this call.
_SHUTDOWN_TOKEN: Final = object()


def shutdown_message() -> Utility:
    """The ``input_queue`` message for a client's ``shutdown``.

    A shutdown that comes over the wire is applied *in order*: everything the client sent
    before it is applied first, exactly like a message. (``request_shutdown()`` called from
    the input thread would not be: called before ``run()`` has started, it makes the run
    skip what is already queued.) The loop thread then calls ``request_shutdown()`` itself.
    """
    return Utility(_ShutdownCallId(0), "shutdown", (_SHUTDOWN_TOKEN,))


class _StageEngine:
    """The user's engine, plus two things the stage needs on the loop's thread.

    After ``abort()`` returns, an ``aborted`` event: emitted on the loop thread, it is ordered
    with the outputs, so none of the aborted requests' outputs follows it. And the in-band
    shutdown (see :func:`shutdown_message`). ``has_work`` and ``add`` are the engine's own
    bound methods, stored as attributes, so the hot path pays nothing; ``step`` is the
    runtime's (see ``StageRuntime._make_step``).
    """

    def __init__(
        self, engine: Engine, put: Callable[[Any], None], step: Callable[[], Iterable[Any]]
    ) -> None:
        self.has_work = engine.has_work
        self.add = engine.add
        self.step = step
        self._utility = engine.utility
        self._abort = engine.abort
        self._put = put
        self.request_shutdown: Callable[[], None] = lambda: None  # set to the loop's

    def abort(self, req_ids: Sequence[str]) -> None:
        self._abort(req_ids)
        self._put(("aborted", list(req_ids)))

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        if args and args[0] is _SHUTDOWN_TOKEN:
            self.request_shutdown()
            return None
        return self._utility(name, args)


# -- the runtime ----------------------------------------------------------------------------


class StageRuntime:
    """Sockets, IO threads and loop of one stage process. Single use: ``run()`` once."""

    # Threads and what they own:
    # - main thread: the loop (engine, emit, routing). Calls ctx.term() at the very end.
    # - input thread: self._in (ROUTER) and the session fields; reads nothing else.
    # - output thread: self._out (PUSH); records self.terminal.
    # self._outq is the hand-off from the loop and the input thread to the output thread; every
    # put goes through _post or _deliver, under _out_lock.
    # - _out_lock guards _out_idle: True while the output thread has sent everything it took
    #   and nothing is queued. Then, and only under _out_lock, the loop thread may send on
    #   self._out itself (_deliver): a zmq socket is used by one thread at a time, and the
    #   lock orders the two users. Once the output thread ends, _out_idle stays False.

    def __init__(
        self,
        engine: Engine,
        input_address: str,
        output_address: str,
        *,
        engine_name: str,
        session_timeout: float = 10.0,
        handle_signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
    ) -> None:
        self._engine_name = engine_name
        self._session_timeout = session_timeout
        self._signals = tuple(handle_signals)
        self._outq: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._out_lock = threading.Lock()
        self._out_idle = True
        # Events queued for the output thread and not yet sent (guarded by _out_lock), and
        # whether it has ended; _out_drained is signalled after each batch it sends.
        self._out_backlog = 0
        self._out_ended = False
        self._out_drained = threading.Condition(self._out_lock)
        self._loop_encoder = _codec.Encoder()  # the loop thread's, for _deliver
        stage_engine = _StageEngine(engine, self._emit_one, self._make_step(engine))
        self.loop = EngineCoreLoop(stage_engine, self._make_emit())
        stage_engine.request_shutdown = self.loop.request_shutdown
        self.terminal: str | None = None
        self.io_failed = False
        # How long the last frames may take to leave. Zero once the parent is known dead:
        # nobody is left to read them, and an orphan must go quickly.
        self.flush_timeout = _OUTPUT_LINGER_MS / 1000
        self.finished = threading.Event()
        self._ctx = zmq.Context()
        try:
            self._in = self._ctx.socket(zmq.ROUTER)
            self._in.setsockopt(zmq.LINGER, 0)
            self._out = self._ctx.socket(zmq.PUSH)
            self._out.setsockopt(zmq.LINGER, _OUTPUT_LINGER_MS)
            for sock in (self._in, self._out):
                # ZMTP heartbeats drop a TCP peer that vanished without closing its connection.
                sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
                sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
            self._in.bind(input_address)
            self._out.bind(output_address)
            # Connections to the output socket, counted by the input thread (see _hello).
            self._out_monitor = self._out.get_monitor_socket(
                zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
            )
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self.input_address: str = self._in.getsockopt_string(zmq.LAST_ENDPOINT)
        self.output_address: str = self._out.getsockopt_string(zmq.LAST_ENDPOINT)
        # Input-thread state: the attached client's routing id and when it was last heard.
        self._session: bytes | None = None
        # Input-thread messages decoded but not yet on input_queue (see _input_main).
        self._pending: list[Any] = []
        self._decoder = _codec.Decoder(_wire.ClientMsg, strict=False)
        self._session_seen = 0.0
        self._out_peers = 0

    def _make_step(self, engine: Engine) -> Callable[[], Iterable[Any]]:
        """The loop's ``step``: the engine's step, its outputs routed and checked, handed to
        the output thread as **one** ``outputs`` event, and nothing returned to the loop.

        Same semantics as emitting each output (routing on the loop thread before the engine
        can reuse an output; an exception in ``step`` or routing is fatal, and the outputs
        routed before it are still sent first; a payload that cannot cross the wire ends only
        its request), but one event and one queue hand-off per step.
        """
        route = make_router(engine)
        engine_step = engine.step
        post = self._post
        flat = _codec.FLAT_TYPES
        prepare_outputs = self._prepare_outputs

        def step() -> tuple[()]:
            if self._out_backlog > _BACKLOG_MAX:  # unlocked peek; _throttle re-checks
                self._throttle()
            rids: list[Any] = []
            fins: list[Any] = []
            payloads: list[Any] = []
            try:
                route(engine_step(), rids, fins, payloads)
            finally:
                # Always through the output thread, never encoded and sent here: with an
                # engine whose step() releases the GIL (a GPU), the output thread encodes
                # and sends this step while the next one runs. On the loop thread it would
                # sit on the critical path between steps.
                if payloads:
                    # Fast path: every payload of an exact flat type (an out-of-range int is
                    # caught when msgspec refuses it, in the output thread).
                    if set(map(type, payloads)) <= flat:
                        post([("outputs", rids, fins, payloads)], len(payloads))
                    else:
                        events = prepare_outputs(rids, fins, payloads)
                        post(events, len(payloads))
            return ()

        return step

    def _prepare_outputs(
        self, rids: list[Any], fins: list[Any], payloads: list[Any]
    ) -> list[tuple[Any, ...]]:
        """Loop thread: prepare each payload for the wire (arrays, buffers, numpy scalars);
        one that cannot cross it ends only its request (see :meth:`_bad_output`)."""
        flat = _codec.FLAT_TYPES
        prepared = list(payloads)
        bad: list[tuple[int, Exception]] = []
        for i, payload in enumerate(payloads):
            if type(payload) not in flat:
                try:
                    prepared[i] = _codec.prepare(payload, "output payload")
                except TypeError as exc:
                    bad.append((i, exc))
        return self._without(rids, fins, prepared, bad)

    def _without(
        self,
        rids: list[Any],
        fins: list[Any],
        payloads: list[Any],
        bad: list[tuple[int, Exception]],
    ) -> list[tuple[Any, ...]]:
        """The ``outputs`` event without the *bad* outputs, then one error event for each."""
        if not bad:
            return [("outputs", rids, fins, payloads)]
        skip = {i for i, _ in bad}
        keep = [i for i in range(len(payloads)) if i not in skip]
        events: list[tuple[Any, ...]] = []
        if keep:
            events.append(
                (
                    "outputs",
                    [rids[i] for i in keep],
                    [fins[i] for i in keep],
                    [payloads[i] for i in keep],
                )
            )
        events.extend(self._bad_output(rids[i], exc) for i, exc in bad)
        return events

    def _make_emit(self) -> Callable[[Event], None]:
        emit_one = self._emit_one

        def emit(event: Event) -> None:
            # Runs on the loop thread; an exception here is fatal to the loop. Never sees an
            # "output": the stage's step() (_make_step) routes and hands over a step's outputs
            # itself and returns none to the loop.
            if event[0] != "utility" or type(event[1]) is not _ShutdownCallId:
                emit_one(event)

        return emit

    def _emit_one(self, ev: tuple[Any, ...]) -> None:
        """Loop thread: one event to the client. The terminal events go through the output
        thread (it ends with them); the rest are checked here and delivered."""
        kind = ev[0]
        if kind in ("shutdown", "fatal"):
            self._post(ev)
            return
        if kind == "utility" and ev[3] is None and type(ev[2]) not in _codec.FLAT_TYPES:
            try:
                ev = ("utility", ev[1], _codec.prepare(ev[2], "utility result"), None)
            except TypeError as exc:
                logger.error("enginecore: a utility result cannot be encoded: %s", exc)
                ev = ("utility", ev[1], None, repr(exc))
        self._deliver([ev])

    def _throttle(self) -> None:
        """Loop thread, before a step: wait while the output thread is more than
        _BACKLOG_MAX events behind and a client is connected to read them.

        Without this, an engine that outpaces its client queues outputs without bound, and
        a utility answer or the shutdown event, queued behind them, waits as long as the
        client needs to read them all (tens of seconds, measured). Never while no client is
        connected (outputs wait in memory for the next one, as before), and never past a
        shutdown request or the end of the output thread.
        """
        loop = self.loop
        with self._out_drained:
            while (
                self._out_backlog > _BACKLOG_MAX
                and self._out_peers > 0
                and not self._out_ended
                and not loop.shutdown_requested
            ):
                self._out_drained.wait(0.05)

    def _post(self, item: Any, weight: int | None = None) -> None:
        """Any thread: queue *item* for the output thread: a list of checked events, or one
        event without a payload (an input error, a pong, the terminal event, ``_STOP``).
        *weight* is :func:`_weight` of it, if the caller knows it."""
        if weight is None:
            weight = _weight(item)
        with self._out_lock:
            self._out_idle = False
            self._out_backlog += weight
            self._outq.put(item)

    def _deliver(self, events: list[tuple[Any, ...]]) -> None:
        """Loop thread: send checked *events* now if the output thread is idle, else queue
        them behind what it has. Saves a thread hand-off (a wake-up, ~30-60 us here) per
        utility answer; used for single events only, never for a step's outputs.

        The send never blocks: if the socket cannot take a frame at once (no client yet, or
        it is behind by the high-water mark) or fails, the rest is queued, and the output
        thread sends it the usual way (and handles a failure the usual way).
        """
        with self._out_lock:
            if self._out_idle:
                encoder = self._loop_encoder
                sock = self._out
                start = 0
                while start < len(events):
                    chunk = events[start : start + _MAX_BATCH]
                    try:
                        parts = encoder.encode(chunk)
                    except _ENCODE_ERRORS:
                        chunk = self._encode_one_by_one(encoder, chunk)
                        events[start : start + _MAX_BATCH] = chunk
                        parts = encoder.encode(chunk)
                    try:
                        sock.send_multipart(parts, zmq.NOBLOCK, copy=False)
                    except zmq.ZMQError:
                        break
                    start += _MAX_BATCH
                else:
                    return
                events = events[start:]
            self._out_idle = False
            self._out_backlog += _weight(events)
            self._outq.put(events)

    def run(self) -> int:
        """Run until shutdown or a fatal error; return the process exit code. Blocks."""
        threads = [
            threading.Thread(target=self._input_main, name="enginecore-input", daemon=True),
            threading.Thread(target=self._output_main, name="enginecore-output", daemon=True),
        ]
        for t in threads:
            t.start()
        try:
            # SystemExit / KeyboardInterrupt from the engine: the loop has logged it, emitted
            # its fatal event and re-raised. Propagating would skip exit_soon() and let
            # SystemExit(0) end the process with 0; the exit code below says fatal.
            with shutdown_on_signals(self.loop, self._signals), contextlib.suppress(BaseException):
                self.loop.run()
        finally:
            # The terminal event is already queued unless emit itself failed; _STOP ends the
            # output thread either way, after it has sent everything before it.
            self._post(_STOP)
            threads[1].join(timeout=self.flush_timeout)
            # Wakes the input thread (and an output thread stuck on a peer that is gone) with
            # ETERM; returns once both closed their sockets (output: after its linger).
            self._ctx.term()
            for t in threads:
                t.join()
            # libzmq leaves the socket files of bound ipc endpoints behind; remove ours.
            for address in (self.input_address, self.output_address):
                if address.startswith("ipc://"):
                    with contextlib.suppress(OSError):
                        os.unlink(address[len("ipc://") :])
            self.finished.set()
        if self.io_failed:
            return EXIT_IO_FAILED
        return EXIT_OK if self.terminal == "shutdown" else EXIT_FATAL

    # -- input thread ------------------------------------------------------------------------

    def _input_main(self) -> None:
        sock = self._in
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._out_monitor, zmq.POLLIN)
        pending = self._pending
        submit_many = self.loop.submit_many
        try:
            while True:
                try:
                    ready = dict(poller.poll())  # blocks; no timeout: ctx.term() ends it
                    if self._out_monitor in ready:
                        self._count_output_peers()
                    if sock not in ready:
                        continue
                    # Every frame already waiting (up to _MAX_BATCH), then one hand-off to
                    # the loop: a burst costs one poll, one lock and one wake-up of the loop
                    # thread, not one of each per message.
                    for _ in range(_MAX_BATCH):
                        try:
                            parts = self._recv(sock)
                        except zmq.Again:
                            break
                        self._handle_one(parts)
                except zmq.ContextTerminated:
                    return
                finally:
                    if pending:
                        submit_many(pending)
                        pending.clear()
        except BaseException:
            logger.exception("enginecore: the input thread failed; shutting the stage down")
            self.io_failed = True
            self.loop.request_shutdown()
        finally:
            self._out_monitor.close(linger=0)
            sock.close(linger=0)

    @staticmethod
    def _recv(sock: zmq.Socket[bytes]) -> list[Any]:
        """One message, ``[routing id, body, *buffers]``, without blocking (``zmq.Again``
        if none is waiting). The body and buffers are ``zmq.Frame`` s: an array in a buffer
        reaches the engine as a view on its frame, without a copy.

        Not ``recv_multipart()``: it calls ``getsockopt(RCVMORE)`` after every part, ~2 us
        each in pyzmq 27; a Frame's ``more`` costs nothing. A ROUTER message has >= 1 part
        after the routing id.
        """
        ident = sock.recv(zmq.NOBLOCK)
        part = sock.recv(copy=False)
        parts: list[Any] = [ident, part]
        while part.more:
            part = sock.recv(copy=False)
            parts.append(part)
        return parts

    def _handle_one(self, parts: list[Any]) -> None:
        try:
            self._handle_frame(parts)
        except Exception as exc:  # a bug here must not kill the thread
            logger.exception("enginecore: error while handling an input frame")
            self._post(("error", None, f"stage failed to handle a frame: {exc!r}"))

    def _count_output_peers(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self._out_monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._out_peers += 1
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._out_peers = max(0, self._out_peers - 1)

    def _handle_frame(self, parts: list[Any]) -> None:
        ident = parts[0]
        try:
            msg = self._decoder.decode(parts[1:])
        except msgspec.DecodeError as exc:
            self._report_bad_frame(ident, parts[1], exc)
            return
        if ident == self._session:
            self._session_seen = time.monotonic()
        put = self._pending.append  # handed to input_queue by _input_main, in order
        cls = type(msg)
        if cls is _wire.AddMsg:
            data = msg.data
            if type(data) not in _RECEIVED_FLAT:
                try:
                    _codec.check_received(data, "data")
                except ValueError as exc:
                    self._post(("error", msg.req_id, f"invalid message: {exc}"))
                    return
            put(Add(msg.req_id, data))
        elif cls is _wire.AddsMsg:
            self._adds(msg)
        elif cls is _wire.AbortMsg:
            put(Abort(msg.req_ids))
        elif cls is _wire.UtilityMsg:
            try:
                _codec.check_received(msg.args, "args")
            except ValueError as exc:
                self._post(("utility", msg.call_id, None, f"ProtocolError({str(exc)!r})"))
                return
            put(Utility(msg.call_id, msg.name, tuple(msg.args)))
        elif cls is _wire.PingMsg:
            self._post(("pong", msg.seq))
        elif cls is _wire.ShutdownMsg:
            put(shutdown_message())
        elif cls is _wire.HelloMsg:
            self._hello(ident, msg)
        elif cls is _wire.ByeMsg and ident == self._session:
            self._session = None

    def _adds(self, msg: _wire.AddsMsg) -> None:
        req_ids, data = msg.req_ids, msg.data
        if len(req_ids) != len(data):
            what = (
                f"invalid message: adds has {len(req_ids)} request ids but {len(data)} data items"
            )
            self._post([("error", rid, what) for rid in req_ids], len(req_ids))
            return
        put = self._pending.append
        errors: list[tuple[Any, ...]] = []
        for rid, item in zip(req_ids, data, strict=True):
            if type(item) not in _RECEIVED_FLAT:
                try:
                    _codec.check_received(item, "data")
                except ValueError as exc:
                    errors.append(("error", rid, f"invalid message: {exc}"))
                    continue
            put(Add(rid, item))
        if errors:
            self._post(errors, len(errors))

    def _hello(self, ident: bytes, msg: _wire.HelloMsg) -> None:
        reply: _wire.WelcomeMsg | _wire.RejectMsg
        now = time.monotonic()
        if msg.version != _wire.PROTOCOL_VERSION:
            reply = _wire.RejectMsg(
                _wire.PROTOCOL_VERSION,
                f"protocol version {msg.version} is not supported; this stage speaks "
                f"version {_wire.PROTOCOL_VERSION}",
            )
        elif (
            self._session is not None
            and self._session != ident
            and now - self._session_seen < self._session_timeout
        ):
            reply = _wire.RejectMsg(
                _wire.PROTOCOL_VERSION, "another client is attached to this stage"
            )
        elif self._session is not None and self._session != ident and self._has_output_peer():
            # The silent client's PULL is still connected: the PUSH socket would deal the new
            # client's events out between the two, round-robin, and half of them would be lost.
            reply = _wire.RejectMsg(
                _wire.PROTOCOL_VERSION,
                "another client is attached to this stage: it has been silent for the session "
                "timeout, but it is still connected to the output socket",
            )
        else:
            self._session = ident
            self._session_seen = now
            reply = _wire.WelcomeMsg(
                _wire.PROTOCOL_VERSION, self.output_address, os.getpid(), self._engine_name
            )
        self._in.send_multipart([ident, msgspec.msgpack.encode(reply)])

    def _has_output_peer(self) -> bool:
        self._count_output_peers()  # events that arrived while this frame was handled
        return self._out_peers > 0

    def _report_bad_frame(self, ident: bytes, body: Any, exc: Exception) -> None:
        # Recover the tag and an id from the head of the body, so that the error reaches
        # the one request or call it concerns instead of leaving it hanging.
        raw = body.bytes if isinstance(body, zmq.Frame) else body
        tag, head = _codec.recover_head(raw)
        what = f"invalid message ({len(raw)} bytes): {exc}"
        if tag == "add" and type(head) is str:
            self._post(("error", head, what))
        elif tag == "adds" and type(head) is list:
            self._post([("error", rid, what) for rid in head], len(head))
        elif tag == "utility" and type(head) is int:
            self._post(("utility", head, None, f"ProtocolError({what!r})"))
        elif tag == "hello":
            reply = _wire.RejectMsg(_wire.PROTOCOL_VERSION, f"invalid hello: {what}")
            self._in.send_multipart([ident, msgspec.msgpack.encode(reply)])
        else:
            self._post(("error", None, what))

    # -- output thread -----------------------------------------------------------------------

    def _output_main(self) -> None:
        sock = self._out
        get = self._outq.get
        encoder = _codec.Encoder()
        linger: int | None = None  # the socket's own: deliver the last frames
        try:
            while True:
                # Everything waiting, then one frame per _MAX_BATCH events. A list holds
                # checked events (a step's outputs, routed and checked on the loop thread by
                # _make_step; a utility answer); anything else is one event without payload.
                item = get()  # blocks; no timeout: _STOP or the terminal event ends it
                events: list[tuple[Any, ...]] = []
                done = False
                taken = 0
                while True:
                    if item.__class__ is list:
                        events += item
                        taken += _weight(item)
                    else:
                        taken += 1
                        kind = item[0]
                        if kind == "stop":
                            done = True
                            break
                        events.append(item)
                        if kind in ("shutdown", "fatal"):
                            self.terminal = kind
                            done = True
                            break
                    if len(events) >= _MAX_BATCH:
                        break
                    try:
                        item = get(block=False)
                    except queue.Empty:
                        break
                for start in range(0, len(events), _MAX_BATCH):
                    chunk = (
                        events if len(events) <= _MAX_BATCH else events[start : start + _MAX_BATCH]
                    )
                    try:
                        parts = encoder.encode(chunk)
                    except _ENCODE_ERRORS:
                        parts = encoder.encode(self._encode_one_by_one(encoder, chunk))
                    if len(parts) == 1:
                        sock.send(parts[0], copy=False)
                    else:
                        sock.send_multipart(parts, copy=False)
                if done:
                    return
                with self._out_lock:
                    self._out_backlog -= taken
                    if self._outq.empty():
                        self._out_idle = True  # the loop thread may send (_deliver)
                    if self._out_backlog <= _BACKLOG_MAX:
                        self._out_drained.notify()
        except zmq.ContextTerminated:
            # The process is ending and no client is reading (none attached, or it is gone):
            # what is left cannot be delivered.
            linger = 0
        except BaseException:
            logger.exception("enginecore: the output thread failed; shutting the stage down")
            self.io_failed = True
            linger = 0
            self.loop.request_shutdown()
        finally:
            with self._out_lock:
                self._out_idle = False  # for good: the loop thread no longer sends
                self._out_ended = True
                self._out_drained.notify()
            sock.close(linger=linger)

    def _bad_output(self, rid: str | None, exc: Exception) -> tuple[Any, ...]:
        """The error event for an output of *rid* that cannot cross the wire; the request
        is aborted in the engine (its stream ends with the error)."""
        logger.error("enginecore: dropping an output that cannot be encoded: %s", exc)
        if rid is None:
            return ("error", None, f"an unrouted engine output cannot be encoded: {exc}")
        self.loop.input_queue.put(Abort([rid]))
        return ("error", rid, f"output cannot be encoded, request aborted: {exc}")

    def _encode_one_by_one(
        self, encoder: _codec.Encoder, events: Iterable[tuple[Any, ...]]
    ) -> list[Any]:
        # Only reached if something passed the checks that msgspec then refuses (an int out
        # of range after the flat fast path, a str with a lone surrogate). The replacement
        # keeps the event's scope, so the request or call it belongs to ends instead of
        # waiting forever.
        good: list[Any] = []
        for ev in events:
            try:
                encoder.encode(ev)
            except _ENCODE_ERRORS as exc:
                good += self._unencodable(encoder, ev, exc)
            else:
                good.append(ev)
        return good

    def _unencodable(
        self, encoder: _codec.Encoder, ev: tuple[Any, ...], exc: Exception
    ) -> list[tuple[Any, ...]]:
        kind = ev[0]
        if kind == "outputs":
            _, rids, fins, payloads = ev
            bad: list[tuple[int, Exception]] = []
            for i, payload in enumerate(payloads):
                try:
                    encoder.encode(payload)
                except _ENCODE_ERRORS as payload_exc:
                    bad.append((i, TypeError(f"output payload cannot be encoded: {payload_exc!r}")))
            replacement = self._without(rids, fins, payloads, bad)
        elif kind == "utility":
            logger.error("enginecore: a utility result cannot be encoded: %s", exc)
            answer = TypeError(f"utility result cannot be encoded: {exc!r}")
            replacement = [("utility", ev[1], None, repr(answer))]
        else:
            logger.error("enginecore: dropping an event that cannot be encoded: %s", exc)
            replacement = [("error", None, f"{kind} event cannot be encoded: {exc!r}")]
        good = []
        for candidate in replacement:
            try:
                encoder.encode(candidate)
            except _ENCODE_ERRORS:  # the id itself is unencodable: nothing to scope it to
                good.append(("error", None, f"{kind} event cannot be encoded: {exc!r}"))
            else:
                good.append(candidate)
        return good


def _weight(item: Any) -> int:
    """What *item* adds to the output backlog: one per output, one per other event."""
    if item.__class__ is not list:
        return 1
    w = 0
    for ev in item:
        w += len(ev[3]) if ev[0] == "outputs" else 1
    return w


# -- process entry points -------------------------------------------------------------------


def _report(conn: Any, *message: Any) -> None:
    with contextlib.suppress(OSError):
        conn.send_bytes(msgspec.msgpack.encode(message))


def run_launched(
    factory: str,
    kwargs_frame: bytes,
    input_address: str,
    output_address: str,
    conn: Any,
    ipc_dir: str,
) -> None:
    """Target of the spawned stage process (see ``_launch.launch_process``).

    *conn* is this end of a duplex pipe: the child reports ``["ready", pid]`` or
    ``["error", repr, traceback]`` on it, then waits on it for EOF, which means the parent
    died. Ends the process with the stage's exit code.
    """
    # The parent owns this process's lifecycle: a terminal Ctrl-C goes to the parent, whose
    # client shuts the stage down; should the parent die instead, the pipe says so.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    holder: list[StageRuntime] = []
    parent_gone = threading.Event()
    threading.Thread(
        target=_watch_parent,
        args=(conn, holder, parent_gone, ipc_dir),
        name="enginecore-parent",
        daemon=True,
    ).start()
    try:
        kwargs = msgspec.msgpack.decode(kwargs_frame)
        engine = build_engine(factory, kwargs)
        runtime = StageRuntime(
            engine,
            input_address,
            output_address,
            engine_name=factory,
            handle_signals=(signal.SIGTERM,),
        )
    except BaseException as exc:
        _report(conn, "error", repr(exc), traceback.format_exc())
        sys.exit(EXIT_FATAL)
    holder.append(runtime)
    _report(conn, "ready", os.getpid())
    code = runtime.run()
    if parent_gone.is_set():
        # Nobody else is left to remove the socket directory.
        shutil.rmtree(ipc_dir, ignore_errors=True)
    exit_soon(code)
    sys.exit(code)


# How long interpreter shutdown may take once the loop has ended.
_EXIT_WATCHDOG_S: Final = 5.0


def exit_soon(code: int) -> None:
    """Make sure the process ends: a normal exit waits for every non-daemon thread, and an
    engine may have left one running. After a grace period, ``os._exit(code)``."""

    def watchdog() -> None:
        time.sleep(_EXIT_WATCHDOG_S)
        logger.error(
            "enginecore: the stage process did not exit %.0f s after its loop ended "
            "(a non-daemon thread?); forcing exit code %d",
            _EXIT_WATCHDOG_S,
            code,
        )
        os._exit(code)

    threading.Thread(target=watchdog, name="enginecore-exit", daemon=True).start()


def _watch_parent(
    conn: Any, holder: list[StageRuntime], parent_gone: threading.Event, ipc_dir: str
) -> None:
    with contextlib.suppress(EOFError, OSError):
        conn.recv_bytes()  # the parent never sends: this returns or raises only at EOF
    if holder and holder[0].finished.is_set():
        return
    parent_gone.set()
    logger.error("enginecore: the parent process is gone; shutting the stage down")
    if holder:
        holder[0].flush_timeout = 0.0
        holder[0].loop.request_shutdown()
        if holder[0].finished.wait(1.5):
            return
    shutil.rmtree(ipc_dir, ignore_errors=True)
    os._exit(EXIT_ORPHANED)


def serve(
    factory: str,
    kwargs: dict[str, Any],
    bind: str,
    output_bind: str,
    *,
    session_timeout: float,
    ready: Callable[[StageRuntime], None],
) -> int:
    """Run a headless stage in this process (``python -m enginecore serve``). Blocks.

    Calls *ready* once the sockets are bound; returns the exit code. SIGTERM and SIGINT shut
    it down gracefully.
    """
    engine = build_engine(factory, kwargs)
    runtime = StageRuntime(
        engine, bind, output_bind, engine_name=factory, session_timeout=session_timeout
    )
    ready(runtime)
    code = runtime.run()
    exit_soon(code)
    return code
