"""One stage: the engine loop on the calling thread, between an input and an output thread.

::

    client --DEALER--> ROUTER  input thread (_inbox -> _stage_session) --> input_queue
                                  (read by the loop thread itself while it idles)  |
                                                  EngineCoreLoop.run(), this thread
                                                  (the engine behind _stage_engine)
                                                                           |
    client <--PULL---- PUSH    output thread (_outbox) <--post / emit------+

:class:`StageRuntime` owns the ZMQ context and both sockets, wires the parts together, runs
the loop and tears everything down in a fixed order (see :meth:`StageRuntime.run`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import signal
import socket
import stat
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, Final, cast

import zmq

from .._engine import Engine, PipelinedEngine
from .._loop import EngineCoreLoop
from .._signals import install_shutdown_handlers
from ._controls import DropEnded, Stop
from ._curve import Authenticator, KeyWatch, ServerCurve, secure_server, start_authenticator
from ._errors import positive_seconds
from ._fanout import CLIENT_BUFFER, RECHECK_MS, Fanout, session_endpoint
from ._inbox import Inbox
from ._input_queue import IdleTimer, InputQueue
from ._outbox import Outbox, StageOutput
from ._stage_engine import StageEngine, submit_unless_ended
from ._stage_session import (
    HEARTBEAT_TIMEOUT_MS,
    CallTable,
    MultiStageSession,
    StageSession,
    log_detached_drops,
)
from ._statistics import LOAD_INTERVAL, StageStatistics, check_load_interval, stage_statistics
from ._watchdog import StepWatchdog, check_watchdog
from ._wire import check_max_message_bytes, is_ipv6_endpoint

__all__ = [
    "DETACHED_BUFFER",
    "EXIT_FATAL",
    "EXIT_IO_FAILED",
    "EXIT_OK",
    "EXIT_ORPHANED",
    "StageRuntime",
    "check_client_buffer",
    "check_client_paths",
    "check_max_clients",
    "pipeline_depth_of",
]

logger = logging.getLogger("enginecore.stage")

# Exit codes of a stage process.
EXIT_OK: Final = 0  # clean shutdown
EXIT_FATAL: Final = 1  # the engine loop died of an exception (or startup failed)
EXIT_IO_FAILED: Final = 4  # an IO thread failed; the stage could no longer talk
# (not 2: that is a usage error, argparse's, for ``serve``)
EXIT_ORPHANED: Final = 3  # the parent died and a graceful shutdown did not finish in time

DETACHED_BUFFER: Final = 1024
"""The default bound on the events (one per output) queued while no client can read."""

# How long the output socket may take to deliver the last frames when the stage ends.
_OUTPUT_LINGER_MS: Final = 1000
# The largest frame an output socket takes from a peer: none sends it a message (a PUSH),
# only the handshake's commands (under 1 KiB with CURVE) and heartbeats. Without a bound a
# peer that has no key yet may announce a frame of gigabytes before its handshake, and
# libzmq holds it in memory while it arrives (docs/security.md).
_OUTPUT_MAX_FRAME: Final = 64 * 1024
# What CURVE adds to each frame on the wire, and libzmq's MAXMSGSIZE counts: the MESSAGE
# command's name (8 bytes), its short nonce (8), a flags byte and the box's MAC (16). The
# input socket's MAXMSGSIZE is the bound plus this, so that the bound is the same with
# CURVE as without: on the frame as the client encodes it.
_CURVE_FRAME_OVERHEAD: Final = 33
# How long authorize() waits for the input side to cut the peers of the keys removed.
_SWEEP_WAIT_S: Final = 5.0


def pipeline_depth_of(engine: Engine | PipelinedEngine[Any]) -> int:
    """The depth a stage runs *engine* at: a :class:`~enginecore.PipelinedEngine`'s
    ``pipeline_depth`` attribute if it has one, else 2 (the point of the protocol is to
    overlap two steps); 1 for an :class:`~enginecore.Engine`. :class:`TypeError` /
    :class:`ValueError` for a bad attribute, at start-up."""
    if not isinstance(engine, PipelinedEngine):
        return 1
    depth = getattr(engine, "pipeline_depth", 2)
    if isinstance(depth, bool) or not isinstance(depth, int):
        raise TypeError(f"the engine's pipeline_depth must be an int, got {depth!r}")
    if depth < 1:
        raise ValueError(f"the engine's pipeline_depth must be >= 1, got {depth}")
    return depth


class StageRuntime:
    """The sockets, IO threads and loop of one stage. Single use: :meth:`run` once.

    Binds *input_address* (``ROUTER``) and *output_address* (``PUSH``) at once; the bound
    endpoints are :attr:`input_address` and :attr:`output_address`. *engine_name* is sent to
    clients in the handshake; *name* (default: *engine_name*) names the stage in its
    statistics. *handle_signals* turn into a graceful shutdown while
    :meth:`run` runs (in the main thread only), and are ignored from the loop's end on (the
    runtime is then its process's: a second signal must not cut the teardown short); with
    none, ``run()`` may be called from any thread.

    Sessions: when a client detaches (``bye``, or a new client takes its session over), the
    requests live in the stage are aborted, in order after what it sent, unless
    *keep_requests_on_detach*; nothing queued for it reaches the next client. While no
    client can read, at most *detached_buffer* events (one per output) are queued, and the
    rest are dropped and counted in the log (``docs/stage.md``, "Headless mode").

    A :class:`~enginecore.PipelinedEngine` runs at its ``pipeline_depth`` (default 2;
    :func:`pipeline_depth_of`); the watchdog then watches each ``launch`` and each
    ``collect``.

    Load reports: while the stage steps, at most every *load_interval* seconds (``None``:
    never), the engine's ``stats()`` and the live requests ride on a step's ``outputs``
    event (:mod:`._statistics`). A client's ``stats`` request is answered from the loop's
    statistics and the stage's counters, without waiting for the loop.

    Watchdog: with *step_timeout* (seconds), a step that runs longer is reported once (every
    thread's stack on stderr, a log line, a ``stalled`` event, then ``resumed`` when it
    returns); with *kill_after* too, a step that runs that long ends the process with a
    ``fatal`` event and exit code 1 (:class:`~._watchdog.StepWatchdog`). No watchdog by
    default here; ``launch()`` and ``serve`` default to :data:`~._watchdog.STEP_TIMEOUT`.

    CURVE: with *curve* (:class:`~._curve.ServerCurve`), both sockets are CURVE servers
    and a ZAP handler thread admits only its authorized client keys; a connection that
    fails the handshake never reaches the sockets (``docs/security.md``).

    Several clients: with *max_clients* above 1 (``serve --max-clients``), up to that many
    clients are attached at once, each with an output socket of its own, bound when it is
    welcomed next to *output_address* (:func:`~._fanout.session_endpoint`; the socket at
    *output_address* itself then carries nothing) and named in its ``welcome``. Each gets
    the outputs of its own requests, the answers to its own calls, and every load report;
    a client that leaves (``bye``, or silent past *session_timeout*) has only its own
    requests aborted (:mod:`._fanout`, ``docs/wire.md`` section 3). No client holds the loop
    back: a client whose output connection closed (and did not come back within
    :data:`~._stage_session.OUTPUT_GRACE_S`), or that has more than *client_buffer* events
    (one per output) queued, is detached the same way, with a warning in the log.
    *keep_requests_on_detach* needs *max_clients* 1 (:class:`ValueError`).

    Frame size: with *max_message_bytes* (``serve --max-message-bytes``; an int >=
    :data:`~._wire.MIN_MESSAGE_BYTES`), the input socket takes no frame (message part)
    larger than that many bytes (``ZMQ_MAXMSGSIZE``, on the frame as the client encodes
    it, with CURVE too): libzmq drops the connection of a peer that announces a bigger one
    before taking it in, and the peer's message is lost. Every ``welcome`` says the
    bound, and the Python clients refuse a bigger message before sending it
    (:class:`~enginecore.stage.MessageTooLargeError`). ``None`` (the default): unbounded.
    """

    def __init__(
        self,
        engine: Engine | PipelinedEngine[Any],
        input_address: str,
        output_address: str,
        *,
        engine_name: str,
        session_timeout: float = 10.0,
        detached_buffer: int = DETACHED_BUFFER,
        keep_requests_on_detach: bool = False,
        step_timeout: float | None = None,
        kill_after: float | None = None,
        handle_signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
        load_interval: float | None = LOAD_INTERVAL,
        name: str | None = None,
        curve: ServerCurve | None = None,
        max_clients: int = 1,
        client_buffer: int = CLIENT_BUFFER,
        max_message_bytes: int | None = None,
    ) -> None:
        check_watchdog(step_timeout, kill_after)
        check_max_message_bytes(max_message_bytes)
        check_max_clients(max_clients, keep_requests_on_detach=keep_requests_on_detach)
        check_client_buffer(client_buffer)
        check_client_paths(output_address, max_clients)
        self._client_path = 0  # the last "-<n>" of a client's ipc output path (input thread)
        check_session_timeout(session_timeout)
        self._curve = curve
        load_interval = check_load_interval(load_interval)
        started = time.monotonic()
        self._signals = tuple(handle_signals)
        # How long the last frames may take to leave. Zero once the parent is known dead:
        # nobody is left to read them, and an orphan must go quickly.
        self._flush_timeout = _OUTPUT_LINGER_MS / 1000
        self.finished = threading.Event()
        """Set once :meth:`run` has torn everything down."""
        self._ctx = zmq.Context()
        self._auth: Authenticator | None = None
        self._keys: KeyWatch | None = None
        bound: list[str] = []  # the endpoints bound so far: their ipc files go on a failure
        try:
            if curve is not None:
                # The ZAP handler first: a CURVE server socket consults it for every client.
                self._auth = start_authenticator(self._ctx, curve)
            in_sock = self._ctx.socket(zmq.ROUTER)
            in_sock.setsockopt(zmq.LINGER, 0)
            # A peer's new connection takes over its routing id from an old one not seen
            # closed yet (a broken TCP connection, until the heartbeat drops it): the Python
            # clients keep one id for their life (_clientbase.routing_id), so a client whose
            # connection is made again stays the same peer. Without it, libzmq ignores the
            # new connection's id and takes its next message for one.
            in_sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            if max_message_bytes is not None:
                # A peer that announces a bigger frame is disconnected at its header: the
                # frame is never held here (docs/security.md).
                in_sock.setsockopt(
                    zmq.MAXMSGSIZE,
                    max_message_bytes + (_CURVE_FRAME_OVERHEAD if curve is not None else 0),
                )
            out_sock = self._ctx.socket(zmq.PUSH)
            out_sock.setsockopt(zmq.LINGER, _OUTPUT_LINGER_MS)
            out_sock.setsockopt(zmq.MAXMSGSIZE, _OUTPUT_MAX_FRAME)
            for sock in (in_sock, out_sock):
                # ZMTP heartbeats drop a TCP peer that vanished without closing its connection.
                sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
                sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
                if curve is not None:
                    secure_server(sock, curve)
            in_sock.setsockopt(zmq.IPV6, is_ipv6_endpoint(input_address))
            out_sock.setsockopt(zmq.IPV6, is_ipv6_endpoint(output_address))
            _bind(in_sock, "input", input_address)
            bound.append(in_sock.getsockopt_string(zmq.LAST_ENDPOINT))
            _bind(out_sock, "output", output_address)
            bound.append(out_sock.getsockopt_string(zmq.LAST_ENDPOINT))
            out_monitor = out_sock.get_monitor_socket(
                zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
            )
            self.input_address: str = in_sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self.output_address: str = out_sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._outbox = Outbox(
                out_sock,
                abort_request=self._abort_request,
                on_failure=self._io_failed,
                may_wait=self._may_hold_the_loop,
                detached_max=detached_buffer,
            )
            # One client at a time: the loop's events go to the one output socket. Several:
            # each client's to its own (_fanout), and the shared socket stays idle.
            self._fanout = (
                None
                if max_clients == 1
                else Fanout(
                    self._open_session_output,
                    prepare_outputs=self._outbox.prepare_outputs,
                    detached_max=detached_buffer,
                    client_buffer=client_buffer,
                )
            )
            self._output: StageOutput = self._outbox if self._fanout is None else self._fanout
            self._watchdog = (
                None
                if step_timeout is None
                else StepWatchdog(
                    step_timeout, kill_after, post=self._output.post, kill=self._kill_stalled
                )
            )
            self._input = InputQueue()
            calls = CallTable()
            stage_engine = StageEngine(
                engine,
                self._output,
                calls=calls,
                abort_on_detach=not keep_requests_on_detach,
                watchdog=self._watchdog,
                input_side=self._input,
                load_interval=load_interval,
                clients=self._fanout,
            )
            self.loop = EngineCoreLoop(
                stage_engine,
                stage_engine.emit if self._fanout is None else stage_engine.emit_routed,
                pipeline_depth=pipeline_depth_of(engine),
                input_queue=self._input,
            )
            if stage_engine.reporter is not None:
                # A load report's engine.stats() call is also the loop's sample: one call
                # serves both (the loop skips its own for an interval after it).
                stage_engine.reporter.sample = self.loop._timer.sample_engine
                # And the idle wait sends one more when the loop idles after a busy report
                # (a pipelined engine's last collect cannot know that it is the last).
                self._input.idle_report = stage_engine.reporter
            if callable(getattr(engine, "idle_due", None)):
                # A pipeline stage's credit held back as it idles (_pipe_stage, "credits").
                self._input.idle_timer = cast(IdleTimer, engine)
            self._statistics = functools.partial(
                stage_statistics,
                self.loop,
                live=stage_engine.live,
                outputs=lambda: stage_engine.counts.outputs,
                backlog=lambda: self._output.backlog,
                reporter=stage_engine.reporter,
                stalled=self._stalled,
                cut_clients=self._cut_clients,
                name=engine_name if name is None else name,
                factory=engine_name,
                started=started,
            )
            if self._fanout is None:
                self._session = StageSession(
                    self._outbox,
                    calls,
                    engine_name=engine_name,
                    output_address=self.output_address,
                    session_timeout=session_timeout,
                    statistics=self._statistics,
                    # A pipeline's stage answers and chases tagged aborts, and takes routes
                    # and links that name generations (docs/wire.md section 8): its welcome
                    # says so to the coordinator.
                    features=("tags", "gens") if hasattr(engine, "chase_abort") else (),
                    keep_requests=keep_requests_on_detach,
                    max_message_bytes=max_message_bytes,
                )
            else:
                self._session = MultiStageSession(
                    self._outbox,
                    calls,
                    clients=self._fanout,
                    max_clients=max_clients,
                    engine_name=engine_name,
                    output_address=self.output_address,
                    session_timeout=session_timeout,
                    statistics=self._statistics,
                    max_message_bytes=max_message_bytes,
                )
            if self._auth is not None:
                # A new connection to the input socket: the keys of its peers are read again.
                in_monitor = in_sock.get_monitor_socket(
                    zmq.EVENT_HANDSHAKE_SUCCEEDED, f"inproc://enginecore.input-keys.{id(self)}"
                )
                self._keys = KeyWatch(self._auth, self._session.with_session, in_monitor)
            self._inbox = Inbox(
                in_sock,
                out_monitor,
                self._session,
                self._input,
                self._output,
                on_failure=self._io_failed,
                clients=self._fanout,
                keys=self._keys,
            )
        except BaseException:
            if self._keys is not None:
                self._keys.close()
            if self._auth is not None:
                self._auth.stop()
            self._ctx.destroy(linger=0)
            for endpoint in bound:  # libzmq leaves the ipc socket files behind
                _unlink_ipc(endpoint)
            if hasattr(self, "_input"):
                self._input.close_pipe()
            raise

    # The edges between the parts, named here so that each is visible in one place.

    def _abort_request(self, req_id: str) -> None:
        # Output side -> loop input: an output of req_id could not be encoded, or was a
        # RequestRejected, before req_id's last output: the stage has ended the request
        # with an error, and drops it from the engine (loop or output thread).
        # After the loop ended there is no engine left to drop it from.
        submit_unless_ended(self.loop, DropEnded((req_id,)))

    def _stalled(self) -> bool:
        # Any thread: the watchdog's verdict on the step running now.
        return self._watchdog is not None and self._watchdog.stalled

    def _cut_clients(self) -> int:
        # Any thread: the clients a shared stage cut for falling behind (an int the loop
        # thread increments: a read never waits).
        return 0 if self._fanout is None else self._fanout.cut_clients

    def _io_failed(self) -> None:
        # An IO thread failed: the stage can no longer talk, so it stops.
        self.loop.request_shutdown()

    def _may_hold_the_loop(self) -> bool:
        # Back-pressure applies only while a client is connected to read, and never past a
        # shutdown request.
        return self._session.output_peers > 0 and not self.loop.shutdown_requested

    def _open_session_output(self, epoch: int) -> tuple[Outbox, str, zmq.Socket[bytes]]:
        # Input thread, at a welcome on a multi-client stage: the client's own PUSH, set up
        # as the shared one is, its outbox (not detached: the welcomed client reads), and a
        # monitor on it for the input side (its connections, and its close).
        endpoint = self._client_endpoint(epoch)
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.PUSH)
        monitor: zmq.Socket[bytes] | None = None
        try:
            sock.setsockopt(zmq.LINGER, _OUTPUT_LINGER_MS)
            sock.setsockopt(zmq.MAXMSGSIZE, _OUTPUT_MAX_FRAME)
            sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            if self._curve is not None:
                secure_server(sock, self._curve)
            sock.setsockopt(zmq.IPV6, is_ipv6_endpoint(endpoint))
            _bind(sock, "client's output", endpoint)  # a StageBindError names the path
            # An address of our own: pyzmq's default names the socket's fd, which a closed
            # client socket may still hold while the next one is opened.
            monitor = sock.get_monitor_socket(
                zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED,
                f"inproc://enginecore.client-output.{epoch}",
            )
            # The loop waits for this client's output thread only while the client takes
            # frames: once it is stuck, the fan-out cuts it instead (past its bound).
            box: list[Outbox] = []
            outbox = Outbox(
                sock,
                abort_request=self._abort_request,
                on_failure=self._io_failed,
                may_wait=lambda: not box[0].stuck and not self.loop.shutdown_requested,
                detached_max=self._outbox.detached_max,
                recheck_ms=RECHECK_MS,
            )
            box.append(outbox)
            outbox.set_detached(False)
            return outbox, sock.getsockopt_string(zmq.LAST_ENDPOINT), monitor
        except BaseException:
            if monitor is not None:
                monitor.close(linger=0)
            sock.close(linger=0)
            raise

    def _client_endpoint(self, epoch: int) -> str:
        # Input thread: where the next client's output socket binds. On tcp, a free port;
        # on ipc, the output path with "-<n>" after it, n counting up from the epoch and
        # past the paths that are not free: another process's live socket there, or a file
        # that is not a socket, was taken over (and deleted at exit) by libzmq's bind.
        base = self.output_address
        if not base.startswith("ipc://"):
            return session_endpoint(base, epoch)
        first = max(epoch, self._client_path + 1)
        for number in range(first, first + _CLIENT_PATH_TRIES):
            endpoint = session_endpoint(base, number)
            try:
                _probe_ipc(endpoint, "client's output")
            except StageBindError as exc:
                logger.warning("enginecore: %s; trying the next path", exc)
                continue
            self._client_path = number
            return endpoint
        raise StageBindError(
            f"cannot bind a client's output socket: the {_CLIENT_PATH_TRIES} paths from "
            f"{session_endpoint(base, first)!r} on are not free"
        )

    def _kill_stalled(self, message: str) -> None:
        # Watchdog thread: a step passed kill_after. The loop thread is stuck in it and
        # cannot be interrupted, so the stage ends from here: the fatal event goes out (the
        # output thread ends with it), ctx.term() delivers it (waiting out the output
        # socket's linger), and the process exits. Each wait is bounded.
        logger.critical("enginecore: %s", message)
        self._output.post(("fatal", message))
        self._output.join(timeout=self._flush_timeout)
        term = threading.Thread(target=self._ctx.term, name="enginecore-term", daemon=True)
        term.start()
        term.join(self._flush_timeout)
        # run()'s teardown never comes: its last step, removing the ipc socket files, here
        # (a shared stage's per-client ones too).
        if self._fanout is not None:
            self._fanout.unlink_all()
        for address in (self.input_address, self.output_address):
            _unlink_ipc(address)
        logging.shutdown()
        os._exit(EXIT_FATAL)

    def statistics(self) -> StageStatistics:
        """The stage's statistics, as a client's ``stats()`` gets them. Any thread, any
        time; never waits for the loop or a step (for a metrics endpoint in the stage
        process)."""
        return StageStatistics.from_wire(self._statistics())

    def authorize(self, keys: Iterable[bytes | str]) -> int | None:
        """With CURVE: admit *keys* (client public keys, Z85 text of 40 characters, ``bytes``
        or ``str``; :class:`ValueError` for another key, :class:`TypeError` for one key
        instead of a collection, before anything changes) from now on, instead of those
        admitted so far (``serve`` calls it on SIGHUP: key rotation, ``docs/security.md``).
        New connections are checked against them, and so is every message of the
        connections already made: a client whose key was removed has its session ended and
        its live requests aborted, and it is told (a ``reject``: its client raises
        :class:`~enginecore.stage.SessionLostError`); its later messages are refused.
        While the stage runs, returns once the input side has done that (at most a few
        seconds, while a long step holds the input side), with how many sessions it ended
        (``None`` if it was not done in time: they are ended as soon as it is; 0 while the
        stage does not run, with no session to end). :class:`RuntimeError` for a stage
        without CURVE. Not from the loop's thread; any other, any time."""
        if self._auth is None or self._keys is None:
            raise RuntimeError("this stage does not use CURVE: it has no authorized keys")
        before = self._keys.cut_now()
        generation = self._auth.authorize(keys)
        if not self._inbox.running or self.finished.is_set():
            return 0
        cut = self._keys.wait_swept(generation, _SWEEP_WAIT_S, alive=lambda: self._inbox.running)
        return None if cut is None else cut - before

    def request_drain(self, seconds: float) -> None:
        """Drain, then stop: as a client's ``shutdown`` with a drain of *seconds*, applied
        in order after what is queued for the loop. Any thread, before or during
        :meth:`run`; never blocks. Not for a signal handler (it takes the queue's lock):
        ``serve`` hands a signal to a thread of its own first. After the loop ended: nothing."""
        submit_unless_ended(self.loop, Stop(seconds))

    def abandon(self) -> None:
        """The parent process is gone: shut down without waiting for the last frames to be
        read, since nobody is left to read them. Any thread; never blocks."""
        self._flush_timeout = 0.0
        self.loop.request_shutdown()

    def run(self) -> int:
        """Run until shutdown or a fatal error; return the process exit code. Blocks."""
        self._inbox.start()
        self._outbox.start()
        if self._fanout is not None:
            self._fanout.start()
        if self._watchdog is not None:
            self._watchdog.start()
        try:
            if self._signals:
                # Not restored when the loop ends (shutdown_on_signals would restore them):
                # replaced below, each in one step.
                install_shutdown_handlers(self.loop, self._signals)
            # SystemExit / KeyboardInterrupt from the engine: the loop has logged it, emitted
            # its fatal event and re-raised. Propagating would skip exit_soon() and let
            # SystemExit(0) end the process with 0; the exit code below says fatal.
            with self._input.signals_wake(), contextlib.suppress(BaseException):
                self.loop.run()
        finally:
            # The stop is under way: a later stop signal (kill and a terminal send several)
            # must not end the teardown by the default action, -15 in place of the exit
            # code. Ignored until the process exits: the runtime is the process's. Straight
            # from the handler to SIG_IGN: a restore of the previous handler first (SIG_DFL)
            # left a window where a signal of a burst ended the process with -15.
            for sig in self._signals:
                signal.signal(sig, signal.SIG_IGN)
            # Teardown, in this order:
            # 1. The output thread sends what is queued, the terminal event included (unless
            #    emit itself failed), and ends; we wait at most the flush timeout for it, and
            #    not at all while no client is attached and nothing is connected to the output
            #    socket: nobody could read it, and an idle stage must stop at once. (A client
            #    just welcomed counts even before the monitor reports its PULL: a stage that
            #    dies right after the handshake still sends it the fatal event.)
            # 2. The input thread takes the input side back if the loop held it, and
            #    ctx.term() wakes it (and an output thread stuck on a peer that is gone) with
            #    ETERM; it returns once both closed their sockets, the output socket after
            #    its linger.
            # 3. The ipc socket files that libzmq leaves behind are removed.
            if self._watchdog is not None:
                self._watchdog.close()
            readers = self._session.attached or self._session.output_peers > 0
            if self._fanout is not None:
                self._fanout.close(timeout=self._flush_timeout if readers else 0.0)
            self._outbox.close(timeout=self._flush_timeout if readers else 0.0)
            self._input.close()
            if self._auth is not None:
                self._auth.stop()  # its socket is on the context: closed before term()
            self._ctx.term()
            self._inbox.join()
            self._input.close_pipe()
            if self._keys is not None:
                self._keys.close()
            # A detached period that the stop ended: its drops are logged here.
            log_detached_drops(self._outbox.take_dropped(), self._outbox.detached_max, at_exit=True)
            self._outbox.join()
            if self._fanout is not None:
                self._fanout.join()
                self._fanout.unlink_all()
            for address in (self.input_address, self.output_address):
                _unlink_ipc(address)
            self.finished.set()
        if self._inbox.failed or self._output.failed:
            return EXIT_IO_FAILED
        # How the loop ended: the terminal event it handed over, sent or not (with no
        # client to read, the output thread may still hold an earlier frame at term()).
        return EXIT_OK if self._output.terminal == "shutdown" else EXIT_FATAL


class StageBindError(OSError):
    """A stage's socket could not bind its address (a port in use, an ipc path in a missing
    directory or too long for a socket): the message names the socket, the address and why,
    so ``serve`` prints it as one line instead of a traceback of ZeroMQ's internals."""


def probe_bind(address: str, which: str) -> None:
    """Before a stage's engine is built (a model may load for minutes): raise
    :class:`StageBindError` if *address* certainly cannot be bound (a TCP port already in
    use, or one this process may not bind; an ipc path in a missing directory, one that
    another process listens on, or one that is not a socket: :func:`_probe_ipc`), as the
    bind itself would after the engine was built. Anything this check cannot tell (``*`` or
    0 ports, an interface name, an address that does not resolve here) is left to the bind.
    A port taken between this check and the bind still fails there (an ipc path is checked
    again right before its bind)."""
    scheme, _, rest = address.partition("://")
    if scheme == "ipc":
        directory = os.path.dirname(rest)
        if directory and not os.path.isdir(directory):
            raise StageBindError(
                f"cannot bind the {which} socket to {address!r}: No such file or directory"
            )
        _probe_ipc(address, which)
        return
    host, _, port_text = rest.rpartition(":")
    if scheme != "tcp" or not port_text.isdigit() or int(port_text) == 0:
        return
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        infos = socket.getaddrinfo(
            host or None, int(port_text), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (OSError, UnicodeError):
        return  # an interface name, or a host ZeroMQ resolves otherwise: the bind tells
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                raise StageBindError(
                    f"cannot bind the {which} socket to {address!r}: {exc.strerror}"
                ) from exc


def _unlink_ipc(address: str) -> None:
    """Remove the socket file of an ipc *address* that libzmq left behind; nothing for
    another transport or for a Linux abstract name (``ipc://@NAME``: no file; a file of
    that name in the working directory is someone else's)."""
    if address.startswith("ipc://") and not address.startswith("ipc://@"):
        with contextlib.suppress(OSError):
            os.unlink(address[len("ipc://") :])


# The longest path a Unix socket's address holds (sockaddr_un.sun_path, less its NUL).
_IPC_PATH_MAX: Final[int] = getattr(zmq, "IPC_PATH_MAX_LEN", 107) or 107
# The most digits of the "-<n>" after a client's ipc output path that the check at start
# makes room for (n counts the sessions: ten billion of them).
_CLIENT_PATH_DIGITS: Final = 10
# How many paths after a taken one a client's output socket tries before it gives up.
_CLIENT_PATH_TRIES: Final = 100


def check_client_paths(output_address: str, max_clients: int) -> None:
    """:class:`ValueError` if a stage that serves *max_clients* (above 1) binds each
    client's output socket on ipc at a path too long for a socket: the *output_address*
    path with ``-<n>`` after it (:func:`~._fanout.session_endpoint`), room left for
    :data:`_CLIENT_PATH_DIGITS` digits. Without it, every ``connect()`` failed once the
    engine was built. Nothing for tcp, one client, or ``ipc://*`` (a short path of
    libzmq's own)."""
    if max_clients <= 1 or not output_address.startswith("ipc://") or output_address == "ipc://*":
        return
    longest = session_endpoint(output_address, 10**_CLIENT_PATH_DIGITS - 1)
    length = len(longest[len("ipc://") :].encode())
    if length > _IPC_PATH_MAX:
        raise ValueError(
            f"with more than one client, each client's output socket is bound at the "
            f"output path with '-<n>' after it, up to {longest!r}: {length} characters "
            f"long, and a socket's path is at most {_IPC_PATH_MAX} characters; choose an "
            f"output path of at most {_IPC_PATH_MAX - 1 - _CLIENT_PATH_DIGITS} characters"
        )


def _probe_ipc(address: str, which: str) -> None:
    """:class:`StageBindError` if the ipc *address* names a path that libzmq's bind would
    take from someone: it unlinks whatever is there and binds anew. A socket file that a
    connect reaches (or whose backlog is full) is another process's live socket: taking it
    over would orphan that stage, "Address already in use". A file that is not a socket
    (a symbolic link too, dangling or not) would be destroyed. A path too long for a
    socket's address fails too (in one short line). A socket file whose connect is refused
    is stale (its process ended without removing it): the bind may take it over. Anything
    else is left to the bind."""
    path = address[len("ipc://") :]
    if len(path.encode()) > _IPC_PATH_MAX:  # pyzmq's own message names it three times
        raise StageBindError(
            f"cannot bind the {which} socket to {address!r}: the path is "
            f"{len(path.encode())} characters long; a socket's path is at most "
            f"{_IPC_PATH_MAX} characters"
        )
    try:
        # (For a Linux abstract name, ipc://@NAME, libzmq unlinks a file named @NAME in the
        # working directory all the same: checked as a path too.)
        mode = os.lstat(path).st_mode
    except OSError:
        return  # no such file (the usual case), or one the bind will report on
    if not stat.S_ISSOCK(mode):
        # (A symbolic link, dangling or not, is replaced too: the bind unlinks the link.)
        what = (
            "a directory"
            if stat.S_ISDIR(mode)
            else "a symbolic link"
            if stat.S_ISLNK(mode)
            else "a file that is not a socket"
        )
        raise StageBindError(
            f"cannot bind the {which} socket to {address!r}: the path exists and is {what} "
            f"(an ipc bind would replace it)"
        )
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(path)
        except BlockingIOError:  # EAGAIN: a listener whose backlog is full
            pass
        except OSError:
            return  # ECONNREFUSED: a stale file; EACCES and the like: the bind tells
    raise StageBindError(f"cannot bind the {which} socket to {address!r}: Address already in use")


def _bind(sock: zmq.Socket[bytes], which: str, address: str) -> None:
    if address.startswith("ipc://"):
        # Checked again here: another stage may have bound the path while the engine was
        # built (probe_bind ran before), and a StageRuntime made in code is checked too.
        _probe_ipc(address, which)
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        # zmq.strerror: pyzmq's own strerror repeats the address ("(addr='tcp://...')").
        raise StageBindError(
            f"cannot bind the {which} socket to {address!r}: "
            f"{zmq.strerror(exc.errno) if exc.errno else exc}"
        ) from exc


def check_session_timeout(session_timeout: float) -> None:
    """:class:`TypeError` / :class:`ValueError` for a bad ``session_timeout`` (a finite
    number of seconds > 0). A negative or NaN one let any new ``hello`` take over the
    attached client's session at once, however recently it had spoken."""
    positive_seconds(session_timeout, "session_timeout")


def check_client_buffer(client_buffer: int) -> None:
    """:class:`TypeError` / :class:`ValueError` for a bad ``client_buffer`` (an int >= 1)."""
    if isinstance(client_buffer, bool) or not isinstance(client_buffer, int):
        raise TypeError(f"client_buffer must be an int, got {client_buffer!r}")
    if client_buffer < 1:
        raise ValueError(f"client_buffer must be >= 1, got {client_buffer}")


def check_max_clients(max_clients: int, *, keep_requests_on_detach: bool = False) -> None:
    """:class:`TypeError` / :class:`ValueError` for a bad ``max_clients`` (an int >= 1), or
    for one above 1 with *keep_requests_on_detach*: a client that leaves a stage that others
    still use has nobody to hand its requests to."""
    if isinstance(max_clients, bool) or not isinstance(max_clients, int):
        raise TypeError(f"max_clients must be an int, got {max_clients!r}")
    if max_clients < 1:
        raise ValueError(f"max_clients must be >= 1, got {max_clients}")
    if max_clients > 1 and keep_requests_on_detach:
        raise ValueError(
            "keep_requests_on_detach needs max_clients 1: on a stage that serves several "
            "clients, a client's requests end with its session"
        )
