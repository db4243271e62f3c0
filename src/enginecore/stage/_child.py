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
from . import _wire

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

# The loop thread waits before a step while more events than this are queued for the output
# thread (see StageRuntime._throttle).
_BACKLOG_MAX: Final = 8 * _MAX_BATCH

_STOP: Final = ("stop",)  # output-thread sentinel (never sent)
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

Route = Callable[[Any], "tuple[str | None, bool, Any]"]


def make_router(engine: object) -> Route:
    """Build ``out -> (req_id, finished, payload)`` for *engine* (see docs/stage.md).

    An engine may define ``route_output(out)`` returning that triple. Otherwise an output that
    is a 2-tuple/list ``(req_id: str, payload)`` is routed to ``req_id`` with that payload,
    and it is finished when the engine's optional ``is_finished(out)`` says so. Any other
    output is not routed: ``(None, False, out)``.
    """
    hook = getattr(engine, "route_output", None)
    if callable(hook):

        def route(out: Any) -> tuple[str | None, bool, Any]:
            triple = hook(out)
            if (
                type(triple) is not tuple
                or len(triple) != 3
                or not (triple[0] is None or type(triple[0]) is str)
                or type(triple[1]) is not bool
            ):
                raise TypeError(
                    f"{type(engine).__name__}.route_output() must return "
                    f"(req_id: str | None, finished: bool, payload), got {triple!r:.200}"
                )
            return triple

        return route

    is_finished = getattr(engine, "is_finished", None)
    if not callable(is_finished):
        is_finished = None

    def default_route(out: Any) -> tuple[str | None, bool, Any]:
        t = type(out)
        if (t is tuple or t is list) and len(out) == 2 and type(out[0]) is str:
            finished = False
            if is_finished is not None:
                finished = bool(is_finished(out))
            return out[0], finished, out[1]
        return None, False, out

    return default_route


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
        self._loop_encoder = _wire.new_encoder()  # the loop thread's, for _deliver
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
        self._session_seen = 0.0
        self._out_peers = 0

    def _make_step(self, engine: Engine) -> Callable[[], Iterable[Any]]:
        """The loop's ``step``: the engine's step, its outputs routed and checked, handed to
        the output thread as **one** list, and nothing returned to the loop.

        Same semantics as emitting each output (routing on the loop thread before the engine
        can reuse an output; an exception in ``step`` or routing is fatal, and the outputs
        routed before it are still sent first; a payload that cannot cross the wire ends only
        its request), but one queue hand-off per step instead of one per output, and the
        output thread has nothing left to check.
        """
        route = make_router(engine)
        hook = getattr(engine, "route_output", None)
        raw_hook = hook if callable(hook) else None
        engine_step = engine.step
        post = self._post
        bad_output = self._bad_output
        scalars = _wire._SCALARS
        int_min, int_max = _wire._INT_MIN, _wire._INT_MAX
        check = _wire.check_encodable
        engine_name = type(engine).__name__

        def bad_route(triple: object) -> NoReturn:
            raise TypeError(
                f"{engine_name}.route_output() must return "
                f"(req_id: str | None, finished: bool, payload), got {triple!r:.200}"
            )

        def checked(ev: tuple[Any, ...]) -> tuple[Any, ...]:
            try:
                check(ev[3], "output payload")
            except TypeError as exc:
                return bad_output(ev, exc)
            return ev

        def step() -> tuple[()]:
            if self._out_backlog > _BACKLOG_MAX:  # unlocked peek; _throttle re-checks
                self._throttle()
            events: list[tuple[Any, ...]] = []
            append = events.append
            try:
                # Two copies of one loop: with the engine's route_output (make_router's
                # validation inlined) or with make_router's default. The payload check has a
                # fast path for exact scalars; check_encodable does the rest.
                if raw_hook is not None:
                    for out in engine_step():
                        triple = raw_hook(out)
                        if triple.__class__ is not tuple or len(triple) != 3:
                            bad_route(triple)
                        rid, finished, payload = triple
                        if finished.__class__ is not bool or (
                            rid.__class__ is not str and rid is not None
                        ):
                            bad_route(triple)
                        t = payload.__class__
                        if int_min <= payload <= int_max if t is int else t in scalars:
                            append(("output", rid, finished, payload))
                        else:
                            append(checked(("output", rid, finished, payload)))
                else:
                    for out in engine_step():
                        rid, finished, payload = route(out)
                        t = payload.__class__
                        if int_min <= payload <= int_max if t is int else t in scalars:
                            append(("output", rid, finished, payload))
                        else:
                            append(checked(("output", rid, finished, payload)))
            finally:
                # Always through the output thread, never encoded and sent here: with an
                # engine whose step() releases the GIL (a GPU), the output thread encodes
                # and sends this step while the next one runs. On the loop thread it would
                # sit on the critical path between steps.
                if events:
                    post(events)
            return ()

        return step

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
        if ev[0] in ("shutdown", "fatal"):
            self._post(ev)
            return
        events: list[tuple[Any, ...]] = []
        self._prepare_one(ev, events)
        self._deliver(events)

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

    def _post(self, item: Any) -> None:
        """Any thread: queue *item* (an event to check, or a list of checked events) for the
        output thread."""
        with self._out_lock:
            self._out_idle = False
            self._out_backlog += len(item) if item.__class__ is list else 1
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
                        frame = encoder.encode(chunk)
                    except _ENCODE_ERRORS:
                        chunk = self._encode_one_by_one(encoder, chunk)
                        events[start : start + _MAX_BATCH] = chunk
                        frame = encoder.encode(chunk)
                    try:
                        sock.send(frame, zmq.NOBLOCK)
                    except zmq.ZMQError:
                        break
                    start += _MAX_BATCH
                else:
                    return
                events = events[start:]
            self._out_idle = False
            self._out_backlog += len(events)
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
    def _recv(sock: zmq.Socket[bytes]) -> list[bytes]:
        """One message, without blocking (``zmq.Again`` if none is waiting).

        Not ``recv_multipart()``: it calls ``getsockopt(RCVMORE)`` after every part, ~2 us
        each in pyzmq 27; a Frame's ``more`` costs nothing. A ROUTER message has >= 1 part
        after the routing id.
        """
        ident = sock.recv(zmq.NOBLOCK)
        part = sock.recv(copy=False)
        parts = [ident, part.bytes]
        while part.more:
            part = sock.recv(copy=False)
            parts.append(part.bytes)
        return parts

    def _handle_one(self, parts: list[bytes]) -> None:
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

    def _handle_frame(self, parts: list[bytes]) -> None:
        ident = parts[0]
        if len(parts) != 2:
            self._post(
                ("error", None, f"expected one frame per message, got {len(parts) - 1} frames")
            )
            return
        frame = parts[1]
        try:
            msg = _wire.client_msg_decoder.decode(frame)
        except msgspec.DecodeError as exc:
            self._report_bad_frame(frame, exc)
            return
        if ident == self._session:
            self._session_seen = time.monotonic()
        put = self._pending.append  # handed to input_queue by _input_main, in order
        if type(msg) is _wire.AddMsg:
            put(Add(msg.req_id, msg.data))
        elif type(msg) is _wire.AbortMsg:
            put(Abort(msg.req_ids))
        elif type(msg) is _wire.UtilityMsg:
            put(Utility(msg.call_id, msg.name, tuple(msg.args)))
        elif type(msg) is _wire.PingMsg:
            self._post(("pong", msg.seq))
        elif type(msg) is _wire.ShutdownMsg:
            put(shutdown_message())
        elif type(msg) is _wire.HelloMsg:
            self._hello(ident, msg)
        elif type(msg) is _wire.ByeMsg and ident == self._session:
            self._session = None

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

    def _report_bad_frame(self, frame: bytes, exc: Exception) -> None:
        # Recover an id if the frame is valid msgpack with a recognisable head, so the error
        # reaches the one request or call it concerns instead of hanging it.
        head: Any = None
        with contextlib.suppress(msgspec.DecodeError):
            head = _wire.any_decoder.decode(frame)
        what = f"invalid message ({len(frame)} bytes): {exc}"
        if type(head) is list and len(head) >= 2:
            if head[0] == "add" and type(head[1]) is str:
                self._post(("error", head[1], what))
                return
            if head[0] == "utility" and type(head[1]) is int:
                self._post(("utility", head[1], None, f"ProtocolError({what!r})"))
                return
        self._post(("error", None, what))

    # -- output thread -----------------------------------------------------------------------

    def _output_main(self) -> None:
        sock = self._out
        get = self._outq.get
        prepare = self._prepare_one
        encoder = _wire.new_encoder()
        linger: int | None = None  # the socket's own: deliver the last frames
        try:
            while True:
                # Everything waiting, then one frame per _MAX_BATCH events. A list is one
                # step's outputs, already routed and checked on the loop thread (_make_step);
                # anything else is one event, checked here.
                item = get()  # blocks; no timeout: _STOP or the terminal event ends it
                events: list[tuple[Any, ...]] = []
                done = False
                taken = 0
                while True:
                    if item.__class__ is list:
                        events.extend(item)
                        taken += len(item)
                    else:
                        taken += 1
                        if prepare(item, events):
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
                        frame = encoder.encode(chunk)
                    except _ENCODE_ERRORS:
                        frame = encoder.encode(self._encode_one_by_one(encoder, chunk))
                    sock.send(frame, copy=False)
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

    def _prepare_one(self, ev: tuple[Any, ...], events: list[tuple[Any, ...]]) -> bool:
        """Check one event's payload and append it to *events*, or its error report if it
        cannot be encoded. Returns whether it ends the output (``stop`` or terminal)."""
        kind = ev[0]
        if kind == "output":
            try:
                _wire.check_encodable(ev[3], "output payload")
            except TypeError as exc:
                events.append(self._bad_output(ev, exc))
                return False
        elif kind == "utility":
            try:
                _wire.check_encodable(ev[2], "utility result")
            except TypeError as exc:
                events.append(("utility", ev[1], None, repr(exc)))
                return False
        elif kind == "stop":
            return True
        elif kind in ("shutdown", "fatal"):
            self.terminal = kind
            events.append(ev)
            return True
        events.append(ev)
        return False

    def _bad_output(self, ev: tuple[Any, ...], exc: Exception) -> tuple[Any, ...]:
        rid = ev[1]
        logger.error("enginecore: dropping an output that cannot be encoded: %s", exc)
        if rid is None:
            return ("error", None, f"an unrouted engine output cannot be encoded: {exc}")
        # The client ends this request's stream with the error; stop the engine working on it.
        self.loop.input_queue.put(Abort([rid]))
        return ("error", rid, f"output cannot be encoded, request aborted: {exc}")

    def _encode_one_by_one(
        self, encoder: msgspec.msgpack.Encoder, events: Iterable[tuple[Any, ...]]
    ) -> list[Any]:
        # Only reached if check_encodable let something through that msgspec refuses (a str
        # with a lone surrogate, say). The replacement keeps the event's scope, so the
        # request or call it belongs to ends instead of waiting forever.
        good: list[Any] = []
        for ev in events:
            try:
                encoder.encode(ev)
            except _ENCODE_ERRORS as exc:
                good.append(self._unencodable(encoder, ev, exc))
            else:
                good.append(ev)
        return good

    def _unencodable(
        self, encoder: msgspec.msgpack.Encoder, ev: tuple[Any, ...], exc: Exception
    ) -> tuple[Any, ...]:
        err = TypeError(f"{ev[0]} event cannot be encoded: {exc!r}")
        replacement: tuple[Any, ...]
        if ev[0] == "output":
            replacement = self._bad_output(ev, err)
        elif ev[0] == "utility":
            logger.error("enginecore: a utility result cannot be encoded: %s", exc)
            replacement = ("utility", ev[1], None, repr(err))
        else:
            logger.error("enginecore: dropping an event that cannot be encoded: %s", exc)
            replacement = ("error", None, str(err))
        try:
            encoder.encode(replacement)
        except _ENCODE_ERRORS:  # the id itself is unencodable: nothing to scope it to
            return ("error", None, f"{ev[0]} event cannot be encoded: {exc!r}")
        return replacement


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
