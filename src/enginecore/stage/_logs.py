"""Stage logs: the stage's name and pid on every record, a default handler, the level, and
the forwarding of a launched stage's records to its parent's ``logging``.

In the stage process, :func:`configure_stage` (called first thing by ``run_launched`` and
``serve``):

- wraps the log record factory, so every record made in the process has a ``stage``
  attribute (the pid is already there, as ``process``): a user's own handlers may format
  ``%(stage)s`` and ``%(process)d``;
- sets the root logger's level, if a level was given;
- replaces :data:`logging.lastResort` with a stderr handler of :data:`STAGE_LOG_FORMAT` and
  no level of its own: the handler that :mod:`logging` uses only while no handler is
  configured, so it yields to any configuration the engine makes (``basicConfig()`` in the
  factory, say) and costs nothing then;
- with forwarding, adds a :class:`ForwardHandler` to the root logger instead, in a launched
  stage in place of the handlers there (those that the parent's main module configured as
  the spawn imported it again: the parent shows the forwarded records with its own).

Forwarding. The child pushes each record, as a msgpack array of plain fields (never a
pickle), on a ZMQ ``PUSH`` socket that it *connects* to a ``PULL`` socket the parent bound in
the stage's private (0700) ipc directory before it started the child. A send never waits
(``NOBLOCK``, a bounded queue): once the parent stops taking records, the child drops them
and counts them; the next record that gets through carries the count, and the parent logs
it. ZMQ frames its messages (a pipe would tear records longer than ``PIPE_BUF``, or block),
and its queue is filled from the start, before the connection is up.

In the parent, one thread per process (not per stage), started with the first forwarding
stage and ended once no stage forwards any more, reads every forwarding stage's socket and
re-emits each record through ``logging.getLogger(name).handle(record)``, the way the
logging cookbook's socket receiver does: the child's level decided, the parent's handlers
and filters apply. A stage's socket is closed when the stage's handler says it is done (at
the child's ``logging.shutdown``), or a short grace period after the client released the
stage (its process has exited by then).

A stage placed on Ray (``enginecore.stage.ray``) may run on another host, so the direction
of the connection turns: the actor's handler *binds* its ``PUSH`` socket on the node's IP
(TCP; a CURVE server that admits only the client's key, unless the stage is insecure) and
the client's ``PULL`` connects to the address the actor returned (:func:`forward_from`). A
bound socket queues nothing before a peer is there, so the actor waits for the client's
handshake (:meth:`ForwardHandler.wait_connected`) before it builds the engine.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any, Final

import msgspec
import zmq

from ._curve import CurveKeys, ServerCurve, secure_client, secure_server, start_authenticator
from ._wire import is_ipv6_endpoint

__all__ = [
    "STAGE_LOG_FORMAT",
    "ForwardHandler",
    "LogSource",
    "check_log_level",
    "configure_stage",
    "forward_from",
    "forward_to_parent",
]

logger = logging.getLogger("enginecore.stage")

STAGE_LOG_FORMAT: Final = "%(asctime)s %(levelname)s %(stage)s[%(process)d] %(name)s: %(message)s"

# The child's queue of records not yet taken by the parent; beyond it, records are dropped.
_SNDHWM: Final = 10_000
_RCVHWM: Final = 10_000
# How long the child's end-of-log message may wait for room, and then its queued records
# to leave, at its exit, if the parent is slow (so at most twice this).
_LINGER_MS: Final = 500
# How long the parent still reads a released stage's socket for its last records, if the
# stage's end-of-log message did not come (a stage that was killed sends none).
_GRACE_S: Final = 1.0
# Frames read from one stage in a row before the others get their turn.
_BURST: Final = 256


def check_log_level(level: object, what: str = "log_level") -> int | None:
    """A log level as an ``int``: *level* is ``None`` (leave the level alone), an ``int``
    >= 0 or a level name (``"debug"``, ``"INFO"``, ...). :class:`TypeError` /
    :class:`ValueError` otherwise."""
    if level is None:
        return None
    if isinstance(level, bool) or not isinstance(level, (int, str)):
        raise TypeError(
            f"{what} must be an int or a level name such as 'INFO', got {type(level).__name__}"
        )
    if isinstance(level, int):
        if level < 0:
            raise ValueError(f"{what} must be >= 0, got {level}")
        return level
    value = logging.getLevelName(level.strip().upper())
    if not isinstance(value, int):
        names = ", ".join(("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"))
        raise ValueError(f"{what} must be a level name ({names}) or an int, got {level!r}")
    return value


# -- the wire: one msgpack array per message -------------------------------------------------


class _Record(msgspec.Struct, array_like=True, frozen=True, tag="r"):
    """A log record, as plain fields."""

    name: str
    levelno: int
    levelname: str
    message: str  # record.getMessage(): the arguments are merged in the child
    created: float
    pathname: str
    lineno: int
    func: str | None
    process: int | None
    process_name: str | None
    thread: int | None
    thread_name: str | None
    stage: str
    exc_text: str | None
    stack_info: str | None
    dropped: int  # records the child dropped since the last one that got through


class _End(msgspec.Struct, array_like=True, frozen=True, tag="e"):
    """The child's handler is closed: nothing follows."""

    stage: str
    process: int
    dropped: int  # records dropped since the last one that got through


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Record | _End)
_exc_formatter = logging.Formatter()


# -- the stage process -------------------------------------------------------------------------


class _StageFilter(logging.Filter):
    """Puts ``stage`` on a record that lacks it (one made by a record factory that the
    engine installed after ours), so that :data:`STAGE_LOG_FORMAT` always works."""

    def __init__(self, stage: str) -> None:
        super().__init__()
        self.stage = stage

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "stage"):
            record.stage = self.stage
        return True


def configure_stage(
    stage: str,
    level: int | None,
    forward_address: str | None,
    *,
    forward: ForwardHandler | None = None,
) -> None:
    """Set up logging in a stage process (see the module docstring). Call it once, first.
    *forward*: a handler made already (a Ray stage's, bound), instead of one that connects
    to *forward_address*."""
    previous = logging.getLogRecordFactory()

    def record_factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        record.stage = stage
        return record

    logging.setLogRecordFactory(record_factory)
    if level is not None:
        logging.getLogger().setLevel(level)
    if forward is not None or forward_address is not None:
        root = logging.getLogger()
        if forward is None:
            # A launched stage is spawned: its root logger's handlers now are the ones the
            # parent's main module made as spawn imported it again here (a module-level
            # ``logging.basicConfig()``). The parent has the same ones and shows every
            # forwarded record with them: kept here, they would show each one twice.
            for old in root.handlers[:]:
                root.removeHandler(old)
                old.close()
        handler: logging.Handler = forward or ForwardHandler(forward_address or "", stage)
        handler.addFilter(_StageFilter(stage))
        root.addHandler(handler)
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(STAGE_LOG_FORMAT))
        handler.addFilter(_StageFilter(stage))
        logging.lastResort = handler


class ForwardHandler(logging.Handler):
    """Sends each record to the parent (see the module docstring); never waits.

    :attr:`dropped` counts the records that the parent did not take in time. Records that
    come after :meth:`close`, or in a process that the stage forked, go to stderr in the
    default format. ``logging.Handler.handle`` holds the handler's lock around
    :meth:`emit`, so the socket is used by one thread at a time.
    """

    def __init__(
        self, address: str, stage: str, *, bind: bool = False, curve: ServerCurve | None = None
    ) -> None:
        """Connect to the parent's socket at *address*; with *bind*, bind there instead
        (``tcp://HOST:0`` for a free port; :attr:`address` is then the bound one), a CURVE
        server with *curve* (its own ZAP handler admits only *curve*'s keys)."""
        super().__init__()
        self.stage = stage
        self.dropped = 0
        self._unreported = 0
        self._pid = os.getpid()
        self._fork_handler: tuple[int, logging.Handler] | None = None
        # A context of its own: the stage runtime terminates its context before the process
        # ends, and records logged after that must still go.
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = zmq.Context(io_threads=1)
        self._sock: zmq.Socket[bytes] | None = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, _SNDHWM)
        self._sock.setsockopt(zmq.LINGER, _LINGER_MS)
        self._auth: Any = None
        self._monitor: zmq.Socket[bytes] | None = None
        self.address = address
        if not bind:
            self._sock.connect(address)
            return
        try:
            self._sock.setsockopt(zmq.IPV6, is_ipv6_endpoint(address))
            if curve is not None:
                self._auth = start_authenticator(self._ctx, curve)
                secure_server(self._sock, curve)
            self._monitor = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            self._sock.bind(address)
            self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            self._close_now()
            raise

    def wait_connected(self, timeout: float) -> bool:
        """A bound handler: wait until the parent's socket has connected (its handshake
        done), at most *timeout* seconds; whether it has. Records sent before are dropped
        (and counted), so a stage waits for this before it logs anything that matters."""
        monitor = self._monitor
        if monitor is None:
            return True
        return bool(monitor.poll(max(0, round(timeout * 1000))))

    def emit(self, record: logging.LogRecord) -> None:
        sock = self._sock
        if sock is None or self._pid != os.getpid():
            # Closed (logging.shutdown at exit: the parent has had the end message), or a
            # process the stage forked (an engine's fork worker: the socket is the stage's,
            # not its own). Nothing reaches the parent from here: the record goes to the
            # stderr the stage shares with it, rather than nowhere.
            self._stderr().handle(record)
            return
        try:
            frame = self._encode(record)
        except Exception:
            self.handleError(record)
            return
        try:
            sock.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError:  # zmq.Again: the queue is full (the parent is slow or gone)
            self.dropped += 1
            self._unreported += 1
        else:
            self._unreported = 0

    def _stderr(self) -> logging.Handler:
        """A stderr handler of the default format, made in this process (a fork makes its
        own)."""
        handler = self._fork_handler
        if handler is None or handler[0] != os.getpid():
            stream = logging.StreamHandler(sys.stderr)
            stream.setFormatter(logging.Formatter(STAGE_LOG_FORMAT, defaults={"stage": self.stage}))
            handler = self._fork_handler = (os.getpid(), stream)
        return handler[1]

    def _encode(self, record: logging.LogRecord) -> bytes:
        exc_text = record.exc_text
        if record.exc_info and not exc_text:
            exc_text = _exc_formatter.formatException(record.exc_info)
        wire = _Record(
            name=record.name,
            levelno=record.levelno,
            levelname=record.levelname,
            message=record.getMessage(),
            created=record.created,
            pathname=record.pathname,
            lineno=record.lineno,
            func=record.funcName,
            process=record.process,
            process_name=record.processName,
            thread=record.thread,
            thread_name=record.threadName,
            stage=getattr(record, "stage", self.stage),
            exc_text=exc_text or None,
            stack_info=record.stack_info,
            dropped=self._unreported,
        )
        try:
            return _encoder.encode(wire)
        except UnicodeEncodeError:  # a lone surrogate somewhere: keep the record anyway
            return _encoder.encode(_without_surrogates(wire))

    def close(self) -> None:
        """Tell the parent that nothing follows, let queued records leave (at most
        ``_LINGER_MS``), close the socket. Called by ``logging.shutdown`` at exit."""
        self.acquire()
        try:
            sock, ctx = self._sock, self._ctx
            self._sock = self._ctx = None
            if sock is not None and ctx is not None and self._pid == os.getpid():
                # The end may wait for room (at most _LINGER_MS): it carries the last count
                # of dropped records, and the parent reads on once a record or the end came.
                end = _End(self.stage, self._pid, self._unreported)
                sock.setsockopt(zmq.SNDTIMEO, _LINGER_MS)
                with contextlib.suppress(zmq.ZMQError):
                    sock.send(_encoder.encode(end))
                self._sock, self._ctx = sock, ctx
                self._close_now()
        finally:
            self.release()
        super().close()

    def _close_now(self) -> None:
        """Close the socket (its queued records may leave for ``_LINGER_MS``), the monitor
        and the ZAP handler, and the context."""
        sock, ctx, monitor, auth = self._sock, self._ctx, self._monitor, self._auth
        self._sock = self._ctx = self._monitor = self._auth = None
        if monitor is not None and sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            monitor.close(linger=0)
        if sock is not None:
            sock.close()
        if auth is not None:
            auth.stop()
        if ctx is not None:
            ctx.term()


def _without_surrogates(wire: _Record) -> _Record:
    def fix(text: str | None) -> str | None:
        return None if text is None else text.encode("utf-8", "backslashreplace").decode()

    fields = {f: getattr(wire, f) for f in wire.__struct_fields__}
    for f, value in fields.items():
        if isinstance(value, str):
            fields[f] = fix(value)
    return _Record(**fields)


# -- the parent process ------------------------------------------------------------------------


class LogSource:
    """One launched stage's forwarded records, as the parent receives them. Made by
    :func:`forward_to_parent`; :meth:`release` once the stage's process has exited."""

    def __init__(self, receiver: _Receiver, sock: zmq.Socket[bytes], stage: str) -> None:
        self.stage = stage
        self.address: str | None = None  # where it connected (a stage placed on Ray)
        self.dropped = 0  # as the child reported them
        self.undecodable = 0
        self._receiver = receiver
        self.sock = sock  # the receiver thread's, once registered
        self.deadline: float | None = None
        self.released = False
        self._pid = os.getpid()

    def release(self) -> None:
        """The stage is gone: read what is left of its records for a moment, then close.
        Never waits; idempotent."""
        if self._pid != os.getpid():  # a fork of the parent does not own the receiver
            return
        with _lock:
            if self.released:
                return
            self.released = True
            # A receiver that is no longer current has ended, and closed this socket.
            if self._receiver is _current:
                self._receiver.commands.append(("release", self))
                self._receiver.wake()


class _Receiver:
    """The parent's log thread and what it reads (see the module docstring)."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=1)
        self.commands: list[tuple[str, LogSource]] = []  # under _lock
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self.thread = threading.Thread(target=self._main, name="enginecore-logs", daemon=True)

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a full pipe is readable already
            os.write(self._wake_w, b"x")

    def dispose(self) -> None:
        """Before the thread ever started: free what ``__init__`` took."""
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.ctx.term()

    def _main(self) -> None:
        global _current
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        live: dict[zmq.Socket[bytes], LogSource] = {}
        try:
            while True:
                # Commands first: the first "add" comes before the thread's first poll.
                with _lock:
                    commands, self.commands = self.commands, []
                    if not commands and not live:
                        if _current is self:
                            _current = None
                        return
                now = time.monotonic()
                for command, source in commands:
                    if command == "add":
                        live[source.sock] = source
                        poller.register(source.sock, zmq.POLLIN)
                    elif source.sock in live and source.deadline is None:
                        source.deadline = now + _GRACE_S
                deadlines = [s.deadline for s in live.values() if s.deadline is not None]
                timeout = None
                if deadlines:
                    timeout = max(0, round((min(deadlines) - now) * 1000))
                ready = dict(poller.poll(timeout))
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                now = time.monotonic()
                for sock, source in list(live.items()):
                    ended = False
                    if sock in ready or source.deadline is not None:
                        ended = _read(source)
                    if ended or (source.deadline is not None and now >= source.deadline):
                        poller.unregister(sock)
                        sock.close(linger=0)
                        del live[sock]
        finally:
            for sock in live:
                sock.close(linger=0)
            os.close(self._wake_r)
            os.close(self._wake_w)
            self.ctx.term()


def _read(source: LogSource) -> bool:
    """Re-emit the records waiting on *source*'s socket (at most ``_BURST``); ``True`` once
    the stage's handler has said that nothing follows."""
    for _ in range(_BURST):
        try:
            frame = source.sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return False
        try:
            message = _decoder.decode(frame)
        except msgspec.DecodeError:
            source.undecodable += 1
            continue
        if message.dropped:
            source.dropped += message.dropped
            logger.warning(
                "enginecore: stage %s (pid %s) dropped %d log records: the parent did not "
                "take them in time",
                message.stage,
                message.process,
                message.dropped,
            )
        if isinstance(message, _End):
            return True
        _reemit(message)
    return False


def _reemit(message: _Record) -> None:
    filename = os.path.basename(message.pathname)
    record = logging.makeLogRecord(
        {
            "name": message.name,
            "msg": message.message,
            "args": None,
            "levelno": message.levelno,
            "levelname": message.levelname,
            "created": message.created,
            "msecs": (message.created - int(message.created)) * 1000,
            "pathname": message.pathname,
            "filename": filename,
            "module": os.path.splitext(filename)[0],
            "lineno": message.lineno,
            "funcName": message.func,
            "process": message.process,
            "processName": message.process_name,
            "thread": message.thread,
            "threadName": message.thread_name,
            "stage": message.stage,
            "exc_text": message.exc_text,
            "stack_info": message.stack_info,
        }
    )
    target = logging.getLogger() if message.name == "root" else logging.getLogger(message.name)
    try:
        target.handle(record)
    except Exception:
        # A handler that raises instead of calling its handleError() (as the stdlib's
        # handlers do) must not end the log thread, nor go unseen: reported as
        # logging.Handler.handleError reports an error.
        _handle_error(record)


def _handle_error(record: logging.LogRecord) -> None:
    """What :meth:`logging.Handler.handleError` does with an error in ``emit()``, for a
    parent-side handler that raised on a forwarded *record*: the traceback and the record on
    ``sys.stderr`` (each time), unless :data:`logging.raiseExceptions` is false (then,
    as there, nothing)."""
    if not (logging.raiseExceptions and sys.stderr):
        return
    try:
        sys.stderr.write("--- Logging error ---\n")
        traceback.print_exc(file=sys.stderr)
        stage = getattr(record, "stage", "?")
        sys.stderr.write(
            f"A handler of logger {record.name!r} raised on a record forwarded from stage "
            f"{stage} (pid {record.process}); the log forwarding goes on.\n"
            f"Message: {record.msg!r}\n"
        )
    except OSError:  # as logging: stderr is gone
        pass


_lock = threading.Lock()
_current: _Receiver | None = None


def forward_to_parent(ipc_dir: str, stage: str) -> tuple[str, LogSource]:
    """Bind a ``PULL`` socket for a stage's records in *ipc_dir* and hand it to the log
    thread (started if need be). Returns the address for the child, and the source to
    :meth:`~LogSource.release` once the stage has exited."""
    address = f"ipc://{os.path.join(ipc_dir, 'log')}"
    return address, _add_source(stage, lambda sock: sock.bind(address))


def forward_from(address: str, stage: str, curve: CurveKeys | None) -> LogSource:
    """Connect a ``PULL`` socket to the records of a stage whose handler bound *address*
    (a stage placed on Ray), a CURVE client with *curve*, and hand it to the log thread.
    Returns the source to :meth:`~LogSource.release` once the stage has ended."""

    def connect(sock: zmq.Socket[bytes]) -> None:
        sock.setsockopt(zmq.IPV6, is_ipv6_endpoint(address))
        if curve is not None:
            secure_client(sock, curve)
        sock.connect(address)

    source = _add_source(stage, connect)
    source.address = address
    return source


def _add_source(stage: str, attach: Any) -> LogSource:
    """A ``PULL`` socket of the log thread's context, set up by ``attach(sock)``, read by
    the log thread (started if need be) from now on."""
    global _current
    with _lock:
        receiver = _current
        fresh = receiver is None
        if receiver is None:
            receiver = _Receiver()
        sock = receiver.ctx.socket(zmq.PULL)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, _RCVHWM)
            attach(sock)
        except BaseException:
            sock.close(linger=0)
            if fresh:
                receiver.dispose()
            raise
        source = LogSource(receiver, sock, stage)
        receiver.commands.append(("add", source))
        if fresh:
            _current = receiver
            receiver.thread.start()
        else:
            receiver.wake()
    return source


def _finish_at_exit() -> None:
    # Registered before ``_launch``'s hook (which imports this module), so it runs after it:
    # every stage has been stopped and released by then, and each one's last records come
    # within _GRACE_S. Give them that long to be re-emitted before the interpreter goes.
    with _lock:
        receiver = _current
    if receiver is not None and receiver.thread.ident != threading.get_ident():
        receiver.thread.join(_GRACE_S + 1.0)


atexit.register(_finish_at_exit)


def _forget_receiver_in_forked_child() -> None:
    # The thread does not exist in a fork, and its ZMQ context must not be used there.
    global _current, _lock
    _current = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_receiver_in_forked_child)
